//! The defect: a running worker kept the `orch.toml` it started with, so `orch retry` after
//! fixing an agent's command silently reran the old one. Now a running `orch serve` re-reads
//! the file; the next job uses the fixed command. An invalid file is reported (file, line, key)
//! and the older config kept, and `/healthz` and `orch status` say the process runs a stale one.

use crate::common;

use std::io::{Read as _, Write as _};
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::{ORCH, Serve, demo_setup};

fn orch(dir: &Path, args: &[&str]) -> Output {
    std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(args)
        .env_remove("ORCH_DATABASE_URL")
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn json(dir: &Path, args: &[&str]) -> serde_json::Value {
    let out = orch(dir, args);
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

fn healthz(port: u16) -> serde_json::Value {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return serde_json::Value::Null;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_once("\r\n\r\n")
        .and_then(|(_, body)| serde_json::from_str(body).ok())
        .unwrap_or(serde_json::Value::Null)
}

async fn until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_serve_uses_the_fixed_agent_command_after_a_config_change() {
    common::become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    demo_setup(d);
    let good = std::fs::read_to_string(d.join("orch.toml")).unwrap();
    let broken_agent = d.join("broken-agent.sh");
    std::fs::write(
        &broken_agent,
        "#!/bin/sh\necho 'this agent is misconfigured' >&2\nexit 3\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&broken_agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let demo_agent = d.join("agent/demo-agent.sh").display().to_string();
    let broken = good.replacen(
        &format!("[agents.analyst]\nbackend = \"claude\"\ncommand = \"{demo_agent}\""),
        &format!(
            "[agents.analyst]\nbackend = \"claude\"\ncommand = \"{}\"",
            broken_agent.display()
        ),
        1,
    );
    assert_ne!(broken, good, "the analyst's command was replaced");
    std::fs::write(d.join("orch.toml"), &broken).unwrap();

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cmd = Serve::command(d, &format!("127.0.0.1:{port}"));
    cmd.env("ORCH_CONFIG_POLL_MS", "100");
    let serve = Serve::spawn(cmd);
    until("/healthz", 30, || healthz(port)["status"] == "ok").await;
    assert_eq!(healthz(port)["config"]["status"], "current");
    assert_eq!(healthz(port)["config"]["generation"], 0);

    let out = orch(
        d,
        &["submit", "--repo", "service", "--title", "Write a note"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The broken command runs (and fails) at least once.
    until("a failed analyst run", 60, || {
        json(d, &["--json", "logs", "APP-1"])["agent_runs"]
            .as_array()
            .is_some_and(|runs| {
                runs.iter()
                    .any(|r| r["outcome"] != "ok" && r["finished_at_ms"].is_i64())
            })
    })
    .await;

    // An invalid file: reported with file, line and key; the process keeps its config.
    let invalid = broken.replace("workers = 4", "workers = 0");
    std::fs::write(d.join("orch.toml"), &invalid).unwrap();
    until("a stale config in /healthz", 30, || {
        healthz(port)["config"]["status"] == "stale"
    })
    .await;
    let h = healthz(port);
    let error = h["config"]["error"].as_str().unwrap_or_default().to_owned();
    let line = invalid.lines().position(|l| l == "workers = 0").unwrap() + 1;
    assert!(
        error.contains(&format!("orch.toml:{line}:")) && error.contains("workers"),
        "{h}"
    );
    let status = String::from_utf8_lossy(&orch(d, &["status"]).stderr).into_owned();
    assert!(status.contains("runs an older config"), "{status}");

    // The fix: the next job uses it, without a restart.
    std::fs::write(d.join("orch.toml"), &good).unwrap();
    until("the reload", 30, || {
        let h = healthz(port);
        h["config"]["status"] == "current" && h["config"]["generation"].as_u64() >= Some(1)
    })
    .await;
    let stage = json(d, &["--json", "status", "APP-1"])["task"]["stage"].clone();
    if stage == "failed" {
        let out = orch(d, &["retry", "APP-1"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    until("APP-1 past analysis", 90, || {
        let s = json(d, &["--json", "status", "APP-1"])["task"]["stage"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        !matches!(s.as_str(), "" | "intake" | "analysis" | "failed")
    })
    .await;
    let runs = json(d, &["--json", "logs", "APP-1"])["agent_runs"].clone();
    assert!(
        runs.as_array()
            .unwrap()
            .iter()
            .any(|r| r["stage"] == "analysis" && r["outcome"] == "ok"),
        "the fixed command ran: {runs:#}"
    );
    // Stop here: the item would go on to staging and deploy the sample service.
    let out = orch(d, &["cancel", "APP-1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serve.terminate().await;
    common::stop_service(d);
    let releases = d.join("service-state/releases");
    for pid in processes_in(&releases) {
        // SAFETY: a process of this test's sample service, found by its working directory.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    common::reap_orphans();
}

/// Processes whose working directory is inside `dir`.
fn processes_in(dir: &Path) -> Vec<i32> {
    let Ok(dir) = dir.canonicalize() else {
        return Vec::new();
    };
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(&dir))
        })
        .collect()
}
