//! The process helpers the end-to-end tests of the `orch` binary share: reaping the orphans the
//! demo leaves, stopping the demo's sample service, reading a committed file, opening the demo's
//! database, `orch demo --setup-only`, an `orch serve` child that can be killed as a group
//! or stopped with SIGTERM, waiting for a task (polling with a deadline), and reporting a test
//! that cannot run here as skipped.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use orch_store::{ConnectOptions, Store, Task};

/// The `orch` binary under test.
pub const ORCH: &str = env!("CARGO_BIN_EXE_orch");

/// Whether `python3` runs here (the demo's sample service needs it).
pub fn python_available() -> bool {
    std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Makes this test process the reaper of orphans it creates (PID 1 here does not reap).
pub fn become_subreaper() {
    // SAFETY: prctl with constant arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

/// Reaps every child that has exited, without blocking.
pub fn reap_orphans() {
    loop {
        // SAFETY: non-blocking wait for any child.
        let pid = unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) };
        if pid <= 0 {
            break;
        }
    }
}

/// Reaps the exited orphans this process adopted as subreaper, and only them: children in the
/// test's own process group (the `orch` processes it spawned and waits for, the commands whose
/// output it collects) are left to their waiters, so two runs side by side in one test never
/// take each other's exit statuses. Everything orch starts leads a process group of its own.
pub fn reap_adopted() {
    // SAFETY: getpgrp cannot fail and touches no memory.
    let own = unsafe { libc::getpgrp() };
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    let children: Vec<i32> = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .collect::<Vec<_>>()
        })
        .collect();
    for pid in children {
        // SAFETY: getpgid has no memory-safety preconditions.
        let pgid = unsafe { libc::getpgid(pid) };
        if pgid < 0 || pgid == own {
            continue;
        }
        // SAFETY: a null status pointer is allowed; WNOHANG leaves a running child alone.
        unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
    }
}

/// Stops the demo's sample service in both environments.
pub fn stop_service(dir: &Path) {
    for env in ["production", "staging"] {
        let _ = std::process::Command::new("sh")
            .arg(dir.join("service/stop.sh"))
            .arg(env)
            .arg(dir.join("service-state"))
            .status();
    }
}

/// `git show <rev:path>` in `repo`; None when git fails.
pub fn git_show(repo: &Path, rev_path: &str) -> Option<String> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["show", rev_path])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A test that cannot run on this machine (a missing tool): prints `SKIPPED: <reason>` so the
/// run shows it, and passes — unless `ORCH_REQUIRE_ALL=1` (set it where every test must run,
/// e.g. CI), which turns the skip into a failure. Use as `return skip("…")`.
pub fn skip(reason: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("this test")
        .to_owned();
    if std::env::var("ORCH_REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("{test} cannot run here ({reason}) and ORCH_REQUIRE_ALL=1");
    }
    eprintln!("SKIPPED: {test}: {reason}");
}

/// The task of work item `id`, which must exist.
pub async fn task(store: &Store, id: &str) -> Task {
    store
        .get_task_by_work_item(id)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{id} exists"))
}

/// Polls (every 100 ms) until work item `id`'s task satisfies `reached`, and returns it; fails
/// after `limit`, saying what was awaited and where the task was.
pub async fn wait_for_task(
    store: &Store,
    id: &str,
    limit: Duration,
    what: &str,
    reached: impl Fn(&Task) -> bool,
) -> Task {
    let t0 = Instant::now();
    loop {
        let t = store.get_task_by_work_item(id).await.unwrap();
        if let Some(t) = t.as_ref().filter(|t| reached(t)) {
            return t.clone();
        }
        assert!(
            t0.elapsed() < limit,
            "{id}: no {what} within {limit:?} (at {:?})",
            t.map(|t| t.stage)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Where the work items `ids` that have not ended stand, for a failing test to print: each
/// one's stage, its last 8 jobs (state, attempt, when due, node, lease holder, error, markers)
/// and its last 12 events.
pub async fn stuck_report(store: &Store, ids: &[String]) -> String {
    items_report(store, ids, false, 12).await
}

/// [`stuck_report`] of the items `ids` (also those that ended when `ended` is true) with their
/// last `events` events: for a failing test to show how each item got where it is.
pub async fn items_report(store: &Store, ids: &[String], ended: bool, events: usize) -> String {
    let now = store.now_ms();
    let mut out = String::new();
    for id in ids {
        let Ok(Some(t)) = store.get_task_by_work_item(id).await else {
            out.push_str(&format!("{id}: no task\n"));
            continue;
        };
        if t.is_terminal() && !ended {
            continue;
        }
        out.push_str(&format!("{id}: stage {} seq {}\n", t.stage, t.stage_seq));
        let jobs = store.task_jobs(t.id).await.unwrap_or_default();
        for j in jobs.iter().rev().take(8) {
            let markers: String = j.task_content.chars().take(160).collect();
            out.push_str(&format!(
                "  job {} {} {:?} attempt {}/{} due {:+} ms node {:?} locked_by {:?} error {:?} content {:?}\n",
                j.id,
                j.agent,
                j.state,
                j.attempt,
                j.max_attempts,
                j.available_at - now,
                j.node,
                j.locked_by,
                j.last_error,
                markers
            ));
        }
        let all = store.task_events(t.id).await.unwrap_or_default();
        for e in all.iter().rev().take(events).rev() {
            out.push_str(&format!("  event {} {} {}\n", e.id, e.kind, e.message));
        }
    }
    out
}

/// [`wait_for_task`] until the task is in a terminal stage (`done`, `failed`, `cancelled`).
pub async fn wait_terminal(store: &Store, id: &str, limit: Duration) -> Task {
    wait_for_task(store, id, limit, "terminal stage", Task::is_terminal).await
}

/// The demo's database in `dir`.
pub async fn open(dir: &Path) -> Store {
    let url = format!("sqlite://{}", dir.join(".orch/orch.db").display());
    Store::connect(&url, ConnectOptions::default())
        .await
        .expect("open the demo database")
}

/// The demo's `orch.toml` text with its repo's sandbox turned off (`sandbox = "off"`, its
/// `[repos.service.sandbox]` table removed): for a test of what an unsandboxed run does.
pub fn sandbox_off(config: &str) -> String {
    let mut text = config.replace("[repos.service]\n", "[repos.service]\nsandbox = \"off\"\n");
    if let Some(start) = text.find("[repos.service.sandbox]") {
        let end = text[start + 1..]
            .find("\n[")
            .map_or(text.len(), |i| start + 2 + i);
        text.replace_range(start..end, "");
    }
    text
}

/// `orch demo --setup-only --dir <dir>`, which must succeed.
pub fn demo_setup(dir: &Path) {
    let out = std::process::Command::new(ORCH)
        .args(["demo", "--setup-only", "--dir"])
        .arg(dir)
        .output()
        .expect("run orch demo --setup-only");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// SIGTERM to `child`, up to 20 s for it to exit, then reaps the orphans.
pub async fn terminate(mut child: tokio::process::Child) {
    if let Some(pid) = child.id() {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    let _ = tokio::time::timeout(Duration::from_secs(20), child.wait()).await;
    reap_orphans();
}

/// A running `orch serve` of the demo in `dir`.
pub struct Serve {
    pub child: tokio::process::Child,
}

impl Serve {
    /// The crash tests' `orch serve` on `bind`: its own process group, a 1 s grace, 2 s leases,
    /// 50 ms demo agents, no failpoints, silent.
    pub fn command(dir: &Path, bind: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(ORCH);
        cmd.arg("--config")
            .arg(dir.join("orch.toml"))
            .args(["serve", "--bind", bind, "--grace-s", "1"])
            .env("ORCH_LOG", "warn")
            .env("ORCH_LEASE_S", "2")
            .env("ORCH_DEMO_AGENT_SLEEP_MS", "50")
            .env_remove("ORCH_FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        cmd
    }

    /// Spawns `cmd`.
    pub fn spawn(mut cmd: tokio::process::Command) -> Serve {
        Serve {
            child: cmd.spawn().expect("spawn orch serve"),
        }
    }

    /// [`Serve::command`] on a free port, with demo agents that take `agent_sleep_ms`.
    pub fn start(dir: &Path, agent_sleep_ms: u64) -> Serve {
        let mut cmd = Serve::command(dir, "127.0.0.1:0");
        cmd.env("ORCH_DEMO_AGENT_SLEEP_MS", agent_sleep_ms.to_string());
        Serve::spawn(cmd)
    }

    /// SIGKILL to the whole process group: orch and whatever it runs in that group.
    pub async fn kill_group(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: signalling our own child's process group.
            unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
        }
        let _ = self.child.wait().await;
        reap_orphans();
    }

    /// Waits up to `within` for orch to exit on its own (a failpoint aborts it); its status,
    /// or `None` when it was still running (then it is killed with its group).
    pub async fn wait_exit(mut self, within: Duration) -> Option<std::process::ExitStatus> {
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(status) => {
                reap_orphans();
                status.ok()
            }
            Err(_) => {
                self.kill_group().await;
                None
            }
        }
    }

    /// SIGTERM, up to 20 s to exit, then reaps the orphans.
    pub async fn terminate(self) {
        terminate(self.child).await;
    }
}

/// `orch --config <config> submit --repo service --title <title>` (the demo's repo), which
/// must succeed.
pub fn submit(config: &Path, title: &str) {
    submit_to(config, "service", title);
}

/// `orch --config <config> submit --repo <repo> --title <title>`, which must succeed.
pub fn submit_to(config: &Path, repo: &str, title: &str) {
    let out = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(config)
        .args(["submit", "--repo", repo, "--title", title])
        .output()
        .expect("run orch submit");
    assert!(
        out.status.success(),
        "orch submit {title:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `orch --config <dir>/orch.toml --database-url <url> <args>`, which must succeed; its stdout.
pub fn orch_db(dir: &Path, url: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(["--database-url", url])
        .args(args)
        .env("ORCH_LOG", "warn")
        .output()
        .expect("run orch");
    assert!(
        out.status.success(),
        "orch {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An `orch worker` of the demo in `dir` on `url`: its own process group, 2 s leases, 50 ms
/// demo agents, no failpoints, silent.
pub fn spawn_worker(dir: &Path, url: &str, id: &str) -> tokio::process::Child {
    // Its warnings go to `<dir>/<id>.log` (see `worker_log`), for a failing test to show.
    let log = std::fs::File::create(dir.join(format!("{id}.log")))
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null());
    tokio::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(["--database-url", url])
        .args(["worker", "--worker-id", id, "--grace-s", "1"])
        .env("ORCH_LOG", "warn")
        .env("ORCH_LEASE_S", "2")
        .env("ORCH_DEMO_AGENT_SLEEP_MS", "50")
        .env_remove("ORCH_FAILPOINTS")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn orch worker")
}

/// The last `lines` lines a [`spawn_worker`] worker `id` logged.
pub fn worker_log(dir: &Path, id: &str, lines: usize) -> String {
    let text = std::fs::read_to_string(dir.join(format!("{id}.log"))).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[path = "../../../../runner/tests/it/support/agent_cli.rs"]
mod agent_cli_support;
#[allow(unused_imports)] // not every test binary runs an agent CLI
pub use agent_cli_support::agent_cli;
