//! Input from outside is bounded: `orch submit` reads at most the request limit the API also
//! enforces (`orch_domain::MAX_REQUEST_BYTES`) and refuses more with a clear message, even from
//! an endless source.

use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Output, Stdio};

const ORCH: &str = env!("CARGO_BIN_EXE_orch");

/// `orch args` in `dir` with its address space capped at 1 GiB: a command that tries to read
/// an endless file into memory dies instead of taking the machine with it.
fn orch_capped(dir: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(ORCH);
    cmd.current_dir(dir)
        .args(args)
        .env_remove("ORCH_DATABASE_URL")
        .env_remove("ORCH_CONFIG")
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null());
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let cap = libc::rlimit {
                rlim_cur: 1 << 30,
                rlim_max: 1 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &cap) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().expect("run orch")
}

#[track_caller]
fn refused_as_too_big(out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a clear refusal (exit 1), not a crash: {:?}\n{stderr}",
        out.status
    );
    assert!(stderr.contains("too big"), "{stderr}");
    assert!(
        stderr.contains(&orch_domain::MAX_REQUEST_BYTES.to_string()),
        "names the limit: {stderr}"
    );
}

#[test]
fn submit_body_file_dev_zero_is_refused_without_eating_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert!(orch_capped(d, &["init"]).status.success());
    let out = orch_capped(
        d,
        &[
            "submit",
            "--repo",
            "app",
            "--title",
            "x",
            "--body-file",
            "/dev/zero",
        ],
    );
    refused_as_too_big(&out);
}

#[test]
fn submit_body_one_byte_over_the_limit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert!(orch_capped(d, &["init"]).status.success());
    let body = d.join("body.md");
    std::fs::write(&body, "x".repeat(orch_domain::MAX_REQUEST_BYTES + 1)).unwrap();
    let body = body.to_str().unwrap();
    refused_as_too_big(&orch_capped(
        d,
        &[
            "submit",
            "--repo",
            "app",
            "--title",
            "x",
            "--body-file",
            body,
        ],
    ));
    let big = "y".repeat(orch_domain::MAX_REQUEST_BYTES + 1);
    refused_as_too_big(&orch_capped(
        d,
        &["submit", "--repo", "app", "--title", "x", "--body", &big],
    ));
    // At the limit the body is read (and the submit goes on to its next check: the repo).
    std::fs::write(d.join("ok.md"), "z".repeat(orch_domain::MAX_REQUEST_BYTES)).unwrap();
    let out = orch_capped(
        d,
        &[
            "submit",
            "--repo",
            "app",
            "--title",
            "x",
            "--body-file",
            "ok.md",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("too big"), "{stderr}");
}
