//! Signals with a dead log reader: `orch worker` whose stderr is a pipe nobody reads any more
//! must still stop gracefully on SIGTERM (a log write that fails once panicked the signal
//! handler's task, and the process then ignored SIGTERM for good).

use std::io::Read as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ORCH: &str = env!("CARGO_BIN_EXE_orch");

fn orch_init(dir: &Path) {
    let out = Command::new(ORCH)
        .current_dir(dir)
        .arg("init")
        .env_remove("ORCH_DATABASE_URL")
        .env_remove("ORCH_CONFIG")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits up to `limit` for `child` to exit (a hang guard, not a performance bound).
fn wait_exit(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn sigterm_with_a_closed_log_pipe_stops(command: &str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    orch_init(d);
    let (mut reader, writer) = std::io::pipe().unwrap();
    let mut child = Command::new(ORCH)
        .current_dir(d)
        .args([command, "--grace-s", "1"])
        .args(if command == "serve" {
            &["--bind", "127.0.0.1:0"][..]
        } else {
            &[][..]
        })
        .env_remove("ORCH_DATABASE_URL")
        .env_remove("ORCH_CONFIG")
        .env("ORCH_LOG", "info")
        .stdin(Stdio::null())
        .stdout(writer.try_clone().unwrap())
        .stderr(writer)
        .spawn()
        .unwrap();
    // Like `head -c1`: read one byte of its log (it has started), then close the pipe.
    let mut one = [0u8; 1];
    reader.read_exact(&mut one).unwrap();
    drop(reader);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = wait_exit(&mut child, Duration::from_secs(30));
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let status = status.unwrap_or_else(|| panic!("orch {command} ignored SIGTERM"));
    assert!(
        status.success(),
        "orch {command} shuts down gracefully, got {status:?}"
    );
}

#[test]
fn worker_stops_on_sigterm_after_its_log_pipe_closed() {
    sigterm_with_a_closed_log_pipe_stops("worker");
}

#[test]
fn serve_stops_on_sigterm_after_its_log_pipe_closed() {
    sigterm_with_a_closed_log_pipe_stops("serve");
}
