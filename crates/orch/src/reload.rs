//! Config reload for `orch serve` and `orch worker`: polls `orch.toml` (size, mtime and a hash of
//! its content, every 2 s or `ORCH_CONFIG_POLL_MS`) and swaps a valid new config into the
//! process's [`LiveConfig`], used from the next job on ("config reloaded" in the log). An invalid
//! file is reported with file, line and key, and the older config is kept; the process then
//! says it runs a stale config: in the log, in `/healthz` (`config`), and in `orch status`, which
//! reads the small state file each running process keeps in `.orch/run/config-<pid>.json`.

use std::hash::{Hash as _, Hasher as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use orch_runner::live_config::{ConfigState, LiveConfig};
use tokio_util::sync::CancellationToken;

use crate::places::Places;

/// How often the file is looked at.
fn poll_interval() -> Duration {
    let ms = std::env::var("ORCH_CONFIG_POLL_MS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .unwrap_or(2000);
    Duration::from_millis(ms)
}

fn content_hash(text: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// This process's state file in `state_dir`.
pub fn state_file(state_dir: &Path) -> PathBuf {
    state_dir
        .join("run")
        .join(format!("config-{}.json", std::process::id()))
}

fn write_state(file: &Path, config_path: &Path, st: &ConfigState) {
    let v = serde_json::json!({
        "pid": std::process::id(),
        "config": config_path.display().to_string(),
        "generation": st.generation,
        "loaded_at_ms": st.loaded_at_ms,
        "stale": st.stale,
        "restart_needed": st.restart_needed,
    });
    let write = || -> anyhow::Result<()> {
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        orch_runner::fsutil::write_atomic(file, &v.to_string())
    };
    if let Err(e) = write() {
        tracing::debug!(error = %format!("{e:#}"), "cannot write the config state file");
    }
}

/// Watches `config_path` until `stop`; removes this process's state file on the way out.
pub fn spawn(
    places: &Places,
    live: LiveConfig,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let places = places.clone();
    let (config_path, state_dir) = (places.config_path.clone(), places.state_dir.clone());
    tokio::spawn(async move {
        let file = state_file(&state_dir);
        let mut seen = std::fs::read_to_string(&config_path)
            .ok()
            .map(|t| content_hash(&t));
        write_state(&file, &config_path, &live.state());
        let every = poll_interval();
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(every) => {}
            }
            let text = match std::fs::read_to_string(&config_path) {
                Ok(t) => t,
                Err(e) => {
                    if seen.is_some() {
                        let why = format!("cannot read {}: {e}", config_path.display());
                        tracing::error!("{why}; still running the config loaded earlier");
                        live.mark_stale(why);
                        write_state(&file, &config_path, &live.state());
                        seen = None;
                    }
                    continue;
                }
            };
            let hash = content_hash(&text);
            if seen == Some(hash) {
                continue;
            }
            seen = Some(hash);
            match crate::config_file::parse_config(&config_path, &text) {
                Ok(config) => {
                    // A repo added or moved: its checkout is hidden from sandboxes from now on.
                    orch_runner::contain::protect(places.protected(&config));
                    let restart = live.replace(config, now_ms());
                    let generation = live.state().generation;
                    tracing::info!(config = %config_path.display(), generation,
                        "config reloaded: the next job uses it");
                    if !restart.is_empty() {
                        tracing::warn!(keys = ?restart,
                            "these changed settings apply only after a restart; the process keeps the old values");
                    }
                }
                Err(why) => {
                    tracing::error!(
                        "{why}; still running the config loaded earlier (fix the file: it is re-read when it changes)"
                    );
                    // The state file first: whoever sees the stale config in `/healthz` finds
                    // it in `orch status` too.
                    let mut st = live.state();
                    st.stale = Some(why.clone());
                    write_state(&file, &config_path, &st);
                    live.mark_stale(why);
                }
            }
            write_state(&file, &config_path, &live.state());
        }
        if let Err(e) = std::fs::remove_file(&file)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::debug!(error = %e, "cannot remove the config state file");
        }
    })
}

/// One line per running process (found by its state file, alive by `/proc/<pid>`) whose config
/// is not what the file says: stale or waiting for a restart. Files of dead processes are removed.
pub fn stale_processes(state_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(state_dir.join("run")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("config-")
            .and_then(|n| n.strip_suffix(".json"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let Some(v) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        else {
            continue;
        };
        if let Some(why) = v["stale"].as_str() {
            out.push(format!(
                "process {pid} runs an older config: the file on disk is invalid ({why})"
            ));
        }
        let restart: Vec<&str> = v["restart_needed"]
            .as_array()
            .map(|a| a.iter().filter_map(|k| k.as_str()).collect())
            .unwrap_or_default();
        if !restart.is_empty() {
            out.push(format!(
                "process {pid} needs a restart to apply: {}",
                restart.join(", ")
            ));
        }
    }
    out.sort();
    out
}
