//! The defect: every `orch demo` left its sample service's staging and production processes
//! listening after it exited. The demo now stops them on every way out; this test interrupts
//! a demo (Ctrl-C) while production runs and checks through `/proc` that no process of the
//! service is left.

use crate::common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{ORCH, become_subreaper, python_available, reap_orphans};

/// Processes whose working directory is inside `dir` (the demo runs each release there).
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_demo_leaves_no_service_process_running() {
    if !python_available() {
        eprintln!("python3 is not installed: the demo's sample service cannot run; skipping");
        return;
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let mut child = tokio::process::Command::new(ORCH)
        .args(["demo", "--dir"])
        .arg(&dir)
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let releases = dir.join("service-state/releases");
    // Wait until the service runs (its first production deploy), and a stage or two more.
    let deadline = Instant::now() + Duration::from_secs(120);
    while processes_in(&releases).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the sample service never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = child.id().unwrap() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("the demo exits after Ctrl-C")
        .unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");
    let left = processes_in(&releases);
    reap_orphans();
    assert!(left.is_empty(), "service processes left: {left:?}");
    let mut stdout = String::new();
    use tokio::io::AsyncReadExt as _;
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .await
        .unwrap();
    assert!(
        stdout.contains("production http://127.0.0.1:")
            && stdout.contains("staging http://127.0.0.1:"),
        "the ports are printed: {stdout}"
    );
}
