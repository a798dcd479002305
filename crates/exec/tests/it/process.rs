//! `orch_exec::process` against real child processes: exit codes, signals, timeouts and
//! cancellation that must take the whole process group (grandchildren included) with them,
//! bounded capture of large output, stdin that the child never reads, and spawn errors.

use std::time::{Duration, Instant};

use orch_exec::process::{Cmd, ExitKind, Output, SpawnError, run};
use tokio_util::sync::CancellationToken;

fn sh(script: &str) -> Cmd {
    Cmd::new("sh")
        .arg("-c")
        .arg(script)
        .timeout(Duration::from_secs(30))
}

/// True while `pid` exists (as a process or an unreaped zombie).
fn exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// True once `pid` has exited: it is a zombie waiting to be reaped, or gone.
fn has_exited(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) S …`: the state follows the last `)`.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

fn pids(text: &str) -> Vec<i32> {
    let pids: Vec<i32> = text.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert!(!pids.is_empty(), "no pids in {text:?}");
    pids
}

/// Bytes printed by `seq 1 n`.
fn seq_bytes(n: u64) -> u64 {
    (1..=n).map(|i| i.to_string().len() as u64 + 1).sum()
}

/// Runs `cmd` and checks how it ended and what it printed.
async fn check(cmd: Cmd, status: ExitKind, stdout: &str, stderr: &str) -> Output {
    let shown = cmd.to_string();
    let out = run(&cmd).await.unwrap();
    assert_eq!(out.status, status, "{shown}: {out:?}");
    assert_eq!(out.stdout_lossy(), stdout, "{shown}");
    assert_eq!(out.stderr_lossy(), stderr, "{shown}");
    assert_eq!(out.success(), status == ExitKind::Exited(0), "{shown}");
    out
}

#[tokio::test]
async fn ends_as_the_program_ended() {
    check(sh("exit 0"), ExitKind::Exited(0), "", "").await;
    check(sh("exit 3"), ExitKind::Exited(3), "", "").await;
    check(
        sh("echo out; echo err >&2; exit 1"),
        ExitKind::Exited(1),
        "out\n",
        "err\n",
    )
    .await;
    check(
        sh("kill -KILL $$"),
        ExitKind::Signaled(libc::SIGKILL),
        "",
        "",
    )
    .await;
    check(
        sh("kill -TERM $$"),
        ExitKind::Signaled(libc::SIGTERM),
        "",
        "",
    )
    .await;
    check(
        Cmd::new("cat").stdin("hello\n"),
        ExitKind::Exited(0),
        "hello\n",
        "",
    )
    .await;
    check(
        sh(r#"printf %s "$ORCH_TEST_VAR""#).env("ORCH_TEST_VAR", "value with spaces"),
        ExitKind::Exited(0),
        "value with spaces",
        "",
    )
    .await;
    check(
        sh(r#"printf %s "${HOME-unset}""#).env_remove("HOME"),
        ExitKind::Exited(0),
        "unset",
        "",
    )
    .await;
    check(
        Cmd::new("/usr/bin/env").env_clear().env("ONLY", "1"),
        ExitKind::Exited(0),
        "ONLY=1\n",
        "",
    )
    .await;
}

#[tokio::test]
async fn runs_in_the_working_directory() {
    let dir = tempfile::tempdir().unwrap();
    let expect = format!("{}\n", dir.path().canonicalize().unwrap().display());
    check(
        Cmd::new("pwd").cwd(dir.path()),
        ExitKind::Exited(0),
        &expect,
        "",
    )
    .await;
}

#[tokio::test]
async fn timeout_kills_the_whole_group_including_grandchildren() {
    let cmd = sh("echo $$; sleep 100 & echo $!; sleep 100")
        .timeout(Duration::from_millis(300))
        .kill_grace(Duration::from_secs(5));
    let out = run(&cmd).await.unwrap();
    assert_eq!(out.status, ExitKind::TimedOut);
    // SIGTERM is enough and the orphaned sleep is reaped by us at once, well within the grace.
    assert!(out.duration < Duration::from_secs(2), "{:?}", out.duration);
    let pids = pids(&out.stdout_lossy());
    assert_eq!(pids.len(), 2);
    for pid in pids {
        assert!(
            !exists(pid),
            "pid {pid} survived the timeout (or was not reaped)"
        );
    }
}

#[tokio::test]
async fn a_group_ignoring_sigterm_is_killed_after_the_grace() {
    // An ignored SIGTERM is inherited by the background and foreground sleeps.
    let cmd = sh("trap '' TERM; echo $$; sleep 100 & echo $!; sleep 100")
        .timeout(Duration::from_millis(200))
        .kill_grace(Duration::from_millis(400));
    let out = run(&cmd).await.unwrap();
    assert_eq!(out.status, ExitKind::TimedOut);
    assert!(
        out.duration >= Duration::from_millis(600),
        "{:?}",
        out.duration
    );
    assert!(out.duration < Duration::from_secs(5), "{:?}", out.duration);
    for pid in pids(&out.stdout_lossy()) {
        assert!(!exists(pid), "pid {pid} survived SIGKILL");
    }
}

#[tokio::test]
async fn cancel_kills_the_whole_group() {
    let token = CancellationToken::new();
    let cmd = sh("echo $$; sleep 100 & echo $!; sleep 100").cancel_on(token.clone());
    let canceller = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        token.cancel();
    });
    let out = run(&cmd).await.unwrap();
    canceller.await.unwrap();
    assert_eq!(out.status, ExitKind::Cancelled);
    assert!(out.duration < Duration::from_secs(5), "{:?}", out.duration);
    for pid in pids(&out.stdout_lossy()) {
        assert!(!exists(pid), "pid {pid} survived the cancellation");
    }
}

#[tokio::test]
async fn unbounded_limits_do_not_overflow() {
    let cmd = sh("exit 0")
        .timeout(Duration::MAX)
        .kill_grace(Duration::MAX);
    assert_eq!(run(&cmd).await.unwrap().status, ExitKind::Exited(0));
    let token = CancellationToken::new();
    let cmd = sh("sleep 100")
        .timeout(Duration::MAX)
        .kill_grace(Duration::MAX)
        .cancel_on(token.clone());
    let (out, ()) = tokio::join!(run(&cmd), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        token.cancel();
    });
    assert_eq!(out.unwrap().status, ExitKind::Cancelled);
}

#[tokio::test]
async fn a_run_cancelled_before_it_starts_spawns_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let token = CancellationToken::new();
    token.cancel();
    let cmd = sh("touch ran").cwd(dir.path()).cancel_on(token);
    let out = run(&cmd).await.unwrap();
    assert_eq!(out.status, ExitKind::Cancelled);
    assert!(!marker.exists());
}

#[tokio::test]
async fn dropping_the_run_kills_the_whole_group() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = sh("echo $$ > pids; sleep 100 & echo $! >> pids; sleep 100")
        .cwd(dir.path())
        .kill_grace(Duration::from_millis(500));
    let dropped = tokio::time::timeout(Duration::from_millis(500), run(&cmd)).await;
    assert!(dropped.is_err(), "the run should still have been going");
    let pids = pids(&std::fs::read_to_string(dir.path().join("pids")).unwrap());
    assert_eq!(pids.len(), 2);
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| exists(p)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for pid in pids {
        assert!(!exists(pid), "pid {pid} survived dropping the run");
    }
}

#[tokio::test]
async fn processes_left_behind_by_a_finished_command_are_stopped() {
    // The background sleep keeps stdout open: without the sweep the run would last 100 s.
    let out = run(&sh("sleep 100 & echo $!").kill_grace(Duration::from_secs(1)))
        .await
        .unwrap();
    assert_eq!(out.status, ExitKind::Exited(0));
    assert!(out.duration < Duration::from_secs(5), "{:?}", out.duration);
    for pid in pids(&out.stdout_lossy()) {
        assert!(!exists(pid), "background pid {pid} outlived its command");
    }
}

#[tokio::test]
async fn a_daemon_that_left_the_group_is_reaped_when_it_exits() {
    // `setsid` moves the daemon into its own session: the group kill cannot reach it, it
    // outlives the run, is orphaned and adopted by us; a later run reaps it once it exits.
    let dir = tempfile::tempdir().unwrap();
    let script = "setsid sh -c 'touch ready; exec sleep 0.5' </dev/null >/dev/null 2>&1 & \
                  while [ ! -f ready ]; do sleep 0.01; done; echo $!";
    let out = run(&sh(script).cwd(dir.path())).await.unwrap();
    assert_eq!(out.status, ExitKind::Exited(0));
    let pid = pids(&out.stdout_lossy())[0];
    assert!(exists(pid), "the daemon should have escaped the group kill");
    // Wait (polling, with a deadline) until the daemon has exited: a zombie, or already gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !has_exited(pid) {
        assert!(Instant::now() < deadline, "the daemon {pid} did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run(&Cmd::new("true")).await.unwrap();
    assert!(!exists(pid), "the exited daemon {pid} was left as a zombie");
}

/// A run that must leave nothing behind (an agent): what it started in a session of its own
/// ends with it, whether the run exited or met its timeout; the escaped processes are reaped.
#[tokio::test]
async fn a_run_that_may_leave_no_daemon_stops_what_left_its_group() {
    // The daemon is in its own session before the run goes on (`ready`): else the group's
    // sweep could reach it before its `setsid`, and the test would pass for the wrong reason.
    const DAEMON: &str = "setsid sh -c 'touch ready; exec sleep 300' </dev/null >/dev/null 2>&1 & \
                          while [ ! -f ready ]; do sleep 0.01; done; echo $!";
    for (tail, timeout, status) in [
        ("", Duration::from_secs(60), ExitKind::Exited(0)),
        ("; sleep 300", Duration::from_secs(2), ExitKind::TimedOut),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cmd = sh(&format!("{DAEMON}{tail}"))
            .cwd(dir.path())
            .no_daemons()
            .timeout(timeout)
            .kill_grace(Duration::from_millis(200));
        let out = run(&cmd).await.unwrap();
        assert_eq!(out.status, status, "{tail}");
        let pid = pids(&out.stdout_lossy())[0];
        assert!(
            !exists(pid),
            "{tail}: the escaped daemon {pid} outlived its run"
        );
    }
    // Without the mark the daemon is what the command was run for (a deploy's service): it
    // stays.
    let dir = tempfile::tempdir().unwrap();
    let out = run(&sh(DAEMON).cwd(dir.path())).await.unwrap();
    let pid = pids(&out.stdout_lossy())[0];
    assert!(exists(pid), "a deploy's service must outlive the deploy");
    // SAFETY: kill(2) on the pid this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !has_exited(pid) {
        assert!(Instant::now() < deadline, "the daemon {pid} did not die");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run(&Cmd::new("true")).await.unwrap();
}

#[tokio::test]
async fn megabytes_of_output_stay_bounded_with_exact_counts() {
    let cmd = sh("seq 1 1000000; seq 1 300000 >&2").output_limit(1000);
    let out = run(&cmd).await.unwrap();
    assert_eq!(out.status, ExitKind::Exited(0));
    assert_eq!(out.stdout_bytes, seq_bytes(1_000_000));
    assert_eq!(out.stderr_bytes, seq_bytes(300_000));
    assert_eq!(out.stdout_tail.len(), 1000);
    assert_eq!(out.stderr_tail.len(), 1000);
    assert!(out.stdout_truncated());
    assert!(out.stdout_lossy().ends_with("999999\n1000000\n"));
    assert!(out.stderr_lossy().ends_with("299999\n300000\n"));
    assert_eq!(out.tail_text(2), "299999\n300000");
}

#[tokio::test]
async fn stdin_the_child_does_not_read_cannot_deadlock() {
    let big = vec![b'x'; 10 << 20];
    for script in ["exit 0", "sleep 0.3", "head -c 10 >/dev/null"] {
        let out = run(&sh(script).stdin(big.clone())).await.unwrap();
        assert_eq!(out.status, ExitKind::Exited(0), "{script}");
        assert!(
            out.duration < Duration::from_secs(10),
            "{script}: {:?}",
            out.duration
        );
    }
    let out = run(&Cmd::new("wc").arg("-c").stdin(vec![b'y'; 3_000_000]))
        .await
        .unwrap();
    assert_eq!(out.stdout_lossy().trim(), "3000000");
}

#[tokio::test]
async fn spawn_errors_say_what_went_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let not_executable = dir.path().join("script.sh");
    std::fs::write(&not_executable, "#!/bin/sh\necho hi\n").unwrap();

    let check_err = |cmd: Cmd, kind: &'static str| async move {
        let err = run(&cmd).await.unwrap_err();
        let got = match &err {
            SpawnError::NotFound { .. } => "not found",
            SpawnError::PermissionDenied { .. } => "permission denied",
            SpawnError::Io { .. } => "io",
            SpawnError::Sandbox { .. } => "sandbox",
        };
        assert_eq!(got, kind, "{cmd}: {err}");
        assert!(
            err.to_string().contains(&cmd.program.display().to_string()),
            "{err}"
        );
        err
    };
    check_err(Cmd::new("/nonexistent/dir/prog"), "not found").await;
    check_err(Cmd::new("orch-no-such-program-xyz"), "not found").await;
    check_err(Cmd::new(&not_executable), "permission denied").await;
    check_err(Cmd::new(dir.path()), "permission denied").await;
    let err = check_err(Cmd::new("true").cwd(dir.path().join("missing")), "io").await;
    let source = std::error::Error::source(&err).unwrap().to_string();
    assert!(source.contains("missing"), "{source}");
}

#[test]
fn tail_text_takes_the_last_lines_of_stdout_then_stderr() {
    let check = |stdout: &str, stderr: &str, n: usize, expect: &str| {
        let out = Output {
            status: ExitKind::Exited(1),
            stdout_tail: stdout.as_bytes().to_vec(),
            stderr_tail: stderr.as_bytes().to_vec(),
            stdout_bytes: stdout.len() as u64,
            stderr_bytes: stderr.len() as u64,
            duration: Duration::ZERO,
            supervision: Default::default(),
        };
        assert_eq!(out.tail_text(n), expect, "{stdout:?} {stderr:?} {n}");
    };
    check("", "", 3, "");
    check("a\nb\nc\n", "", 2, "b\nc");
    check("a\nb", "e1\ne2\n", 3, "b\ne1\ne2");
    check("a\n", "e\n\n\n", 5, "a\ne");
    check("a\nb\n", "e\n", 0, "");
}

#[test]
fn cmd_displays_as_a_command_line() {
    let cmd = Cmd::new("git").args(["commit", "-m", "two words", ""]);
    assert_eq!(cmd.to_string(), "git commit -m 'two words' ''");
}

/// orch killed -9 while a stage command runs: the command (its own process group) lives on
/// until the next incarnation stops it, and must not die of SIGPIPE the moment it prints. The
/// "orch" here is a copy of this test binary re-executed in the parent role.
#[tokio::test]
async fn a_child_that_outlives_its_killed_parent_can_still_print() {
    const ROLE: &str = "ORCH_EXEC_TEST_PARENT_DIR";
    // The test's name as the harness lists it: its module (this suite) and its own name.
    const NAME: &str = "process::a_child_that_outlives_its_killed_parent_can_still_print";
    if let Ok(dir) = std::env::var(ROLE) {
        // The parent role: run a child that waits for `go`, then prints a lot, then says done.
        let script = "echo $$ > pid; while [ ! -f go ]; do sleep 0.01; done; \
                      i=0; while [ $i -lt 2000 ]; do echo out $i; echo err $i >&2; i=$((i+1)); done; \
                      echo done > done";
        let _ = run(&sh(script).cwd(dir)).await;
        return;
    }
    // SAFETY: prctl with integer arguments: the orphaned child is reparented to us, to reap.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) },
        0
    );
    let dir = tempfile::tempdir().unwrap();
    let mut parent = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
        .env(ROLE, dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let child = loop {
        if let Ok(text) = std::fs::read_to_string(dir.path().join("pid"))
            && text.ends_with('\n')
        {
            break pids(&text)[0];
        }
        assert!(
            Instant::now() < deadline,
            "the parent never started its child"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    parent.kill().unwrap(); // SIGKILL: no destructor runs, nothing stops the child
    parent.wait().unwrap();
    std::fs::write(dir.path().join("go"), "").unwrap();
    while !has_exited(child) {
        assert!(
            Instant::now() < deadline,
            "the child {child} did not finish"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut status = 0;
    // SAFETY: waitpid on our adopted child's pid with a valid status pointer.
    let reaped = unsafe { libc::waitpid(child, &mut status, 0) };
    assert_eq!(reaped, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child was killed (signal {}) when it printed after its parent died",
        libc::WTERMSIG(status)
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("done")).unwrap(),
        "done\n"
    );
}

#[tokio::test]
async fn a_batch_run_and_what_it_starts_run_below_orchs_priority() {
    // SAFETY: getpriority takes plain integers.
    let own = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let want = (own + orch_exec::process::BATCH_NICE).min(19);
    // `nice` prints its own niceness; the second one is a grandchild started by the shell.
    let out = run(&sh("nice; sh -c nice").batch()).await.unwrap();
    assert!(out.success(), "{out:?}");
    let seen: Vec<i32> = out
        .stdout_lossy()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect();
    assert_eq!(seen, [want, want], "child and grandchild");
    // Without it, children keep orch's priority.
    let out = run(&sh("nice")).await.unwrap();
    assert_eq!(out.stdout_lossy().trim(), own.to_string());
}
