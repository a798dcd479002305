//! `orch_exec::supervise` against real processes, in the hostile cases: the supervisor killed on
//! its own, a record an agent (or a crash) left corrupt or pointing elsewhere, keys that try to
//! leave the records directory, and the timeout and cancellation of an adopted command.
//!
//! The supervisor is this crate's `orch-exec-supervisor` binary (orch runs its own binary as
//! `orch __supervise`). "An earlier orch" is a copy of this test binary re-executed in the
//! [`earlier_orch`] role and killed -9. This process is a child subreaper: the supervisors
//! and commands orphaned by those kills come to it, and are reaped here.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use orch_exec::process::{Cmd, ExitKind, run};
use orch_exec::supervise::{self, Supervision};
use tokio_util::sync::CancellationToken;

/// The one records directory of this process (supervision is enabled once per process).
fn records() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // SAFETY: prctl with integer arguments: orphaned descendants come to us, to reap.
        assert_eq!(
            unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) },
            0
        );
        let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        // The directories of earlier runs of this test go.
        for e in std::fs::read_dir(&tmp).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("supervise-").and_then(|p| p.parse().ok())
                && orch_exec::process::process_gone(pid)
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let dir = tmp
            .join(format!("supervise-{}", std::process::id()))
            .join("records");
        supervise::enable_with(&dir, supervisor_program()).unwrap();
        dir
    })
}

fn supervisor_program() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_orch-exec-supervisor"))
}

fn sh(script: &str) -> Cmd {
    Cmd::new("sh")
        .arg("-c")
        .arg(script)
        .timeout(Duration::from_secs(30))
        .kill_grace(Duration::from_millis(500))
}

/// True while `pid` runs (an unreaped zombie counts as ended).
fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits until `pid` ended, reaping it if it is our child; false if it still runs at the
/// deadline.
async fn ended(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        // SAFETY: non-blocking wait for one pid, null status pointer.
        unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
        if !running(pid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for `path` to exist and end with a newline; returns its text.
async fn wait_for(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn pids(text: &str) -> Vec<i32> {
    text.lines().map(|l| l.trim().parse().unwrap()).collect()
}

fn supervisor_pid(key: &str) -> i32 {
    let text = std::fs::read_to_string(records().join(key).join("supervisor")).unwrap();
    text.split_whitespace().next().unwrap().parse().unwrap()
}

/// A command that writes its pid and a background child's pid to `pids` and then sleeps.
const SLEEPER: &str =
    "echo $$ > pids.tmp; sleep 100 & echo $! >> pids.tmp; mv pids.tmp pids; sleep 100";

#[tokio::test]
async fn a_supervisor_killed_alone_stops_its_command_and_reports_an_error() {
    records();
    let work = tempfile::tempdir().unwrap();
    let key = "j9101.killed-0";
    let cmd = sh(SLEEPER).cwd(work.path()).supervised(key);
    let task = tokio::spawn(async move { run(&cmd).await });
    let pids = pids(&wait_for(&work.path().join("pids")).await);
    let supervisor = supervisor_pid(key);
    // SAFETY: kill with integer arguments; the pid is our own supervisor's.
    assert_eq!(unsafe { libc::kill(supervisor, libc::SIGKILL) }, 0);
    let started = Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the run hangs after its supervisor was killed")
        .unwrap();
    let err = out.expect_err("a run whose supervisor was killed must not succeed");
    let message = format!("{err}");
    assert!(message.contains("without a result"), "{message}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // The command and its background child were stopped (and reaped), not left to run on.
    for pid in pids {
        assert!(
            ended(pid, Duration::from_millis(200)).await,
            "pid {pid} runs on after its supervisor was killed"
        );
    }
    supervise::forget_job(9101);
}

/// The result file of a real run, to plant elsewhere.
async fn a_real_result() -> Vec<u8> {
    let key = "j9102.real-0";
    let out = run(&sh("echo real").supervised(key)).await.unwrap();
    assert_eq!(out.supervision, Supervision::Started);
    assert!(out.success());
    std::fs::read(records().join(key).join("result.json")).unwrap()
}

#[tokio::test]
async fn a_corrupt_record_is_never_taken_for_success() {
    records();
    let real = a_real_result().await;
    assert!(serde_json::from_slice::<serde_json::Value>(&real).is_ok());
    let outside = tempfile::tempdir().unwrap();
    let planted = outside.path().join("planted");
    std::fs::create_dir(&planted).unwrap();
    std::fs::write(planted.join("result.json"), &real).unwrap();
    std::fs::write(planted.join("stdout"), "planted\n").unwrap();
    std::fs::write(planted.join("supervisor"), "1 1\n").unwrap();
    std::fs::write(outside.path().join("secret"), "secret\n").unwrap();

    let work = tempfile::tempdir().unwrap();
    let mut n = 0;
    let mut record = |setup: &dyn Fn(&Path)| {
        let key = format!("j9103.corrupt-{n}");
        n += 1;
        setup(&records().join(&key));
        let marker = work.path().join(&key);
        let cmd = sh(&format!("touch {}; echo ran", marker.display())).supervised(&key);
        (cmd, marker)
    };
    let dir = |d: &Path| std::fs::create_dir(d).unwrap();

    // A result that cannot be read: a clear error, and the command is not run again.
    let unreadable: [&dyn Fn(&Path); 5] = [
        &|d| {
            dir(d);
            std::fs::write(d.join("result.json"), "garbage\0\u{1}").unwrap();
        },
        &|d| {
            dir(d);
            std::fs::write(d.join("result.json"), &real[..real.len() / 2]).unwrap();
        },
        &|d| {
            dir(d);
            std::fs::write(d.join("result.json"), "").unwrap();
        },
        &|d| {
            dir(d);
            std::fs::create_dir(d.join("result.json")).unwrap();
            std::fs::write(d.join("supervisor"), "garbage").unwrap();
        },
        // A link to a successful result elsewhere is not a result.
        &|d| {
            dir(d);
            symlink(planted.join("result.json"), d.join("result.json")).unwrap();
        },
    ];
    for setup in unreadable {
        let (cmd, marker) = record(setup);
        let err = run(&cmd)
            .await
            .expect_err("a corrupt result must not be taken for a result");
        assert!(format!("{err}").contains("unreadable"), "{err}");
        assert!(!marker.exists(), "{cmd}: the command ran again");
    }

    // A record that is no record, or whose supervisor cannot be told: the command runs again.
    let rerun: [&dyn Fn(&Path); 5] = [
        // The record is a link to a directory with a successful result: never followed.
        &|d| symlink(&planted, d).unwrap(),
        &|d| symlink(outside.path().join("nowhere"), d).unwrap(),
        &|d| std::fs::write(d, "a file").unwrap(),
        &|d| {
            dir(d);
            std::fs::write(d.join("supervisor"), "garbage\n").unwrap();
        },
        &|d| {
            dir(d);
            std::fs::write(d.join("supervisor"), "-1 x\0\n").unwrap();
            std::fs::write(d.join("log"), "old log\n").unwrap();
        },
    ];
    for setup in rerun {
        let (cmd, marker) = record(setup);
        let out = run(&cmd).await.unwrap();
        assert_eq!(out.supervision, Supervision::Restarted, "{cmd}");
        assert!(out.success(), "{cmd}: {out:?}");
        assert_eq!(out.stdout_lossy(), "ran\n");
        assert!(marker.exists(), "{cmd}: the command did not run again");
    }
    // What the links pointed at was neither read as the result nor removed nor written.
    assert_eq!(std::fs::read(planted.join("result.json")).unwrap(), real);
    assert_eq!(
        std::fs::read_to_string(planted.join("stdout")).unwrap(),
        "planted\n"
    );
    assert!(!outside.path().join("nowhere").exists());

    // A finished record whose output tail is a link: the result holds, the link is not read.
    let (cmd, marker) = record(&|d| {
        dir(d);
        std::fs::write(d.join("result.json"), &real).unwrap();
        symlink(outside.path().join("secret"), d.join("stdout")).unwrap();
    });
    let out = run(&cmd).await.unwrap();
    assert_eq!(out.supervision, Supervision::AdoptedFinished);
    assert!(!out.stdout_lossy().contains("secret"), "{out:?}");
    assert!(!marker.exists());
    supervise::forget_job(9102);
    supervise::forget_job(9103);
    assert!(planted.join("result.json").exists());
}

#[tokio::test]
async fn a_hostile_key_is_refused_and_never_leaves_the_records() {
    let records = records();
    let base = records.parent().unwrap();
    let work = tempfile::tempdir().unwrap();
    let abs = work.path().join("absolute");
    let long = "j9104.".to_owned() + &"x".repeat(5000);
    let keys = [
        "../escaped".to_owned(),
        "j9104.a/../../escaped2".to_owned(),
        "j9104.a/b".to_owned(),
        abs.display().to_string(),
        "..".to_owned(),
        ".".to_owned(),
        String::new(),
        ".j9104.hidden".to_owned(),
        "j9104.nul\0x".to_owned(),
        "j9104.~note".to_owned(),
        long,
    ];
    for key in &keys {
        let marker = work.path().join("ran");
        let cmd = sh(&format!("touch {}", marker.display())).supervised(key.as_str());
        let err = run(&cmd).await.expect_err("a hostile key must be refused");
        assert!(
            format!("{err}").contains("not a plain name"),
            "{key:?}: {err}"
        );
        assert!(!marker.exists(), "{key:?}: the command ran");
    }
    assert!(!base.join("escaped").exists());
    assert!(!base.join("escaped2").exists());
    assert!(!abs.exists());
    let names: Vec<_> = std::fs::read_dir(records)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("9104"))
        .collect();
    assert!(names.is_empty(), "{names:?}");
    // A plain key still works.
    let out = run(&sh("true").supervised("j9104.plain_key-0"))
        .await
        .unwrap();
    assert_eq!(out.supervision, Supervision::Started);
    supervise::forget_job(9104);
}

const ROLE: &str = "ORCH_EXEC_TEST_EARLIER_ORCH";

/// The role of an earlier orch: starts `SCRIPT` supervised as `KEY` with timeout `TIMEOUT_MS`
/// in `WORK`, and is killed -9 while it waits. A no-op in a normal test run.
#[tokio::test]
async fn earlier_orch() {
    let Ok(dir) = std::env::var(ROLE) else {
        return;
    };
    supervise::enable_with(Path::new(&dir), supervisor_program()).unwrap();
    let var = |name: &str| std::env::var(name).unwrap();
    let cmd = adoptable(&var("KEY"), Path::new(&var("WORK")), &var("TIMEOUT_MS"));
    let _ = run(&cmd).await;
    std::process::exit(3);
}

fn adoptable(key: &str, work: &Path, timeout_ms: &str) -> Cmd {
    sh(SLEEPER)
        .cwd(work)
        .timeout(Duration::from_millis(timeout_ms.parse().unwrap()))
        .supervised(key)
}

/// Starts the command under an earlier orch and kills that orch -9: the supervisor and the
/// command run on. Returns the command's pids and the supervisor's.
async fn left_by_an_earlier_orch(key: &str, work: &Path, timeout_ms: &str) -> (Vec<i32>, i32) {
    let mut orch = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "supervise::earlier_orch",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROLE, records())
        .env("KEY", key)
        .env("WORK", work)
        .env("TIMEOUT_MS", timeout_ms)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pids = pids(&wait_for(&work.join("pids")).await);
    orch.kill().unwrap(); // SIGKILL: nothing of the earlier orch stops the command
    orch.wait().unwrap();
    let supervisor = supervisor_pid(key);
    assert!(running(supervisor), "the supervisor died with the orch");
    for &pid in &pids {
        assert!(running(pid), "the command died with the orch");
    }
    (pids, supervisor)
}

#[tokio::test]
async fn an_adopted_command_still_times_out() {
    records();
    let work = tempfile::tempdir().unwrap();
    let key = "j9105.timeout-0";
    let (pids, supervisor) = left_by_an_earlier_orch(key, work.path(), "3000").await;
    let started = Instant::now();
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        run(&adoptable(key, work.path(), "3000")),
    )
    .await
    .expect("the adopted command outlived its timeout")
    .unwrap();
    assert_eq!(out.supervision, Supervision::AdoptedRunning);
    assert_eq!(out.status, ExitKind::TimedOut, "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    for pid in pids {
        assert!(
            ended(pid, Duration::from_secs(2)).await,
            "pid {pid} survived"
        );
    }
    assert!(ended(supervisor, Duration::from_secs(5)).await);
    supervise::forget_job(9105);
}

#[tokio::test]
async fn an_adopted_command_is_stopped_by_its_cancel_token() {
    records();
    let work = tempfile::tempdir().unwrap();
    let key = "j9106.cancel-0";
    let (pids, supervisor) = left_by_an_earlier_orch(key, work.path(), "60000").await;
    let token = CancellationToken::new();
    let cmd = adoptable(key, work.path(), "60000").cancel_on(token.clone());
    let started = Instant::now();
    let (out, ()) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(20), run(&cmd)),
        async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            token.cancel();
        }
    );
    let out = out
        .expect("the cancelled adopted command was waited for")
        .unwrap();
    assert_eq!(out.supervision, Supervision::AdoptedRunning);
    assert_eq!(out.status, ExitKind::Cancelled, "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    for pid in pids {
        assert!(
            ended(pid, Duration::from_secs(2)).await,
            "pid {pid} survived"
        );
    }
    assert!(ended(supervisor, Duration::from_secs(5)).await);
    supervise::forget_job(9106);
}

/// The supervisor of an adopted command killed alone (orch alive, the command started by an
/// earlier orch): the same as for a command of this orch's.
#[tokio::test]
async fn an_adopted_commands_supervisor_killed_alone_stops_the_command() {
    records();
    let work = tempfile::tempdir().unwrap();
    let key = "j9107.adopted_killed-0";
    let (pids, supervisor) = left_by_an_earlier_orch(key, work.path(), "60000").await;
    let cmd = adoptable(key, work.path(), "60000");
    let (out, ()) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(20), run(&cmd)),
        async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            // SAFETY: kill with integer arguments; the pid is the adopted supervisor's.
            unsafe { libc::kill(supervisor, libc::SIGKILL) };
        }
    );
    let err = out
        .expect("the run hangs after its supervisor was killed")
        .expect_err("a run whose supervisor was killed must not succeed");
    assert!(format!("{err}").contains("without a result"), "{err}");
    assert!(ended(supervisor, Duration::from_secs(5)).await);
    for pid in pids {
        assert!(
            ended(pid, Duration::from_secs(2)).await,
            "pid {pid} survived"
        );
    }
    supervise::forget_job(9107);
}

/// A supervisor killed alone while no orch ran: the next orch finds a record without a result
/// and a dead supervisor, and must stop the command still running before running it again.
#[tokio::test]
async fn a_command_orphaned_while_orch_was_away_is_stopped_before_it_runs_again() {
    records();
    let work = tempfile::tempdir().unwrap();
    let key = "j9108.away-0";
    let (pids, supervisor) = left_by_an_earlier_orch(key, work.path(), "60000").await;
    // SAFETY: kill with integer arguments; the pid is the orphaned supervisor's.
    unsafe { libc::kill(supervisor, libc::SIGKILL) };
    assert!(ended(supervisor, Duration::from_secs(5)).await);
    std::fs::remove_file(work.path().join("pids")).unwrap();
    let cmd = sh("echo again").cwd(work.path()).supervised(key);
    let out = run(&cmd).await.unwrap();
    assert_eq!(out.supervision, Supervision::Restarted);
    assert_eq!(out.stdout_lossy(), "again\n");
    for pid in pids {
        assert!(
            ended(pid, Duration::from_millis(200)).await,
            "pid {pid} of the first run still runs beside the second"
        );
    }
    supervise::forget_job(9108);
}

/// A command's state directory (what an agent's session keeps across a lost run) sits beside
/// its record, never inside it, is no record itself (a `supervisor` file planted in it names
/// no running command), and goes with the job; `recorded` says before a run whether the
/// command is absent, kept (adopt) or lost (run again).
#[tokio::test]
async fn a_state_directory_is_beside_the_record_and_lost_commands_are_told_apart() {
    use supervise::Recorded;
    records();
    let work = tempfile::tempdir().unwrap();
    let key = "j9109.agent-0";
    assert_eq!(supervise::recorded(key), Recorded::Absent);
    let state = supervise::state_dir(key).unwrap().unwrap();
    assert_eq!(state, records().join("j9109.~state-agent-0"));
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&state).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert!(supervise::state_dir("j9109/../x").is_err());
    // A planted supervisor note naming a live process (this one) is not taken for a record.
    let me = std::process::id() as i32;
    let start = orch_exec::records::start_time(me).unwrap();
    std::fs::write(state.join("supervisor"), format!("{me} {start}")).unwrap();
    assert!(
        supervise::running()
            .iter()
            .all(|(k, _, _)| !k.contains('~')),
        "{:?}",
        supervise::running()
    );
    assert_eq!(supervise::recorded(key), Recorded::Absent);
    let (pids, supervisor) = left_by_an_earlier_orch(key, work.path(), "60000").await;
    assert_eq!(supervise::recorded(key), Recorded::Kept);
    // The host is lost: the supervisor and its command die together, no result.
    for pid in pids.iter().copied().chain([supervisor]) {
        // SAFETY: kill with integer arguments; the pids are this test's orphans.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    for pid in pids.iter().copied().chain([supervisor]) {
        assert!(ended(pid, Duration::from_secs(5)).await, "pid {pid}");
    }
    assert_eq!(supervise::recorded(key), Recorded::Lost);
    assert!(state.is_dir(), "the state outlives the lost command");
    let out = run(&sh("echo again").cwd(work.path()).supervised(key))
        .await
        .unwrap();
    assert_eq!(out.supervision, Supervision::Restarted);
    assert_eq!(supervise::recorded(key), Recorded::Kept);
    supervise::forget_job(9109);
    assert!(!state.exists() && !records().join(key).exists());
    // A link at the state's name is removed, never followed.
    let elsewhere = tempfile::tempdir().unwrap();
    symlink(elsewhere.path(), records().join("j9110.~state-agent-0")).unwrap();
    let state = supervise::state_dir("j9110.agent-0").unwrap().unwrap();
    assert!(std::fs::symlink_metadata(&state).unwrap().is_dir());
    assert!(elsewhere.path().is_dir());
    supervise::forget_job(9110);
}
