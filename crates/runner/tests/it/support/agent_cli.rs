//! The installed agent CLIs, shared by the runner's and the binary's real-CLI tests (each
//! includes this file with `#[path]`): `scripts/install-agent-clis` installs them at pinned
//! versions into `${ORCH_AGENT_CLI_CACHE:-~/.cache/orch-agent-clis}` and records a status per
//! tool.

use std::path::PathBuf;

/// The installed `tool`, or `None` after printing why it is skipped (or panicking when
/// `ORCH_REQUIRE_AGENT_CLIS=1`).
pub fn agent_cli(tool: &str) -> Option<PathBuf> {
    let cache = std::env::var_os("ORCH_AGENT_CLI_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/orch-agent-clis"))
        });
    let reason = match &cache {
        None => "neither ORCH_AGENT_CLI_CACHE nor HOME is set".to_owned(),
        Some(cache) => {
            let bin = cache.join("bin").join(tool);
            let status =
                std::fs::read_to_string(cache.join("status").join(tool)).unwrap_or_default();
            if bin.exists() && status.starts_with("ok") {
                return Some(bin);
            }
            if status.trim().is_empty() {
                format!(
                    "{tool} is not installed in {} (run scripts/install-agent-clis)",
                    cache.display()
                )
            } else {
                format!("{tool} could not be installed: {}", status.trim())
            }
        }
    };
    if std::env::var("ORCH_REQUIRE_AGENT_CLIS").as_deref() == Ok("1") {
        panic!("ORCH_REQUIRE_AGENT_CLIS=1 but {reason}");
    }
    println!("SKIPPED: {reason}");
    None
}
