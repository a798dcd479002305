//! Durable records of the process groups orch starts, so that a restarted orch can stop what a
//! dead incarnation of it left running (kill -9 of orch leaves its children's groups alive: a
//! staging script, a deploy, an agent's daemon).
//!
//! - An *incarnation* is one orch process: `<pid>-<start time>` (the start time from
//!   `/proc/<pid>/stat`, so a reused pid is never taken for the old process).
//! - Once [`record_children_in`] named a directory, every group spawned through
//!   [`crate::process`] leaves a file `<incarnation>.<pgid>` there (written right after the
//!   spawn, holding the leader's start time) that is removed when the group has been reaped.
//! - Every child gets `ORCH_INCARNATION=<incarnation>/<run>` in its environment (`run` numbers
//!   the runs of one incarnation); descendants that leave the group (`setsid` daemons) inherit
//!   it and are found by it.
//! - [`stop_dead_incarnations`] (run by `orch serve`/`orch worker` before they claim jobs)
//!   kills, for every incarnation in the directory that is no longer alive, its recorded groups
//!   and, for runs marked [`crate::Cmd::no_daemons`] (agents) that were still in progress when
//!   it died, their escaped descendants; then it forgets the records. A daemon a deploy or a
//!   staging step starts on purpose (the service) is what it was run for and is left running. Live incarnations (another orch on
//!   this node sharing the directory) are left alone, and so is any process running the orch
//!   binary itself (a self-deployed orch inherits the variable of the one that deployed it).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The environment variable that marks every descendant of an orch incarnation.
pub const INCARNATION_ENV: &str = "ORCH_INCARNATION";

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// This process's incarnation id: `<pid>-<start time in clock ticks since boot>`.
pub fn incarnation() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let pid = std::process::id() as i32;
        format!("{pid}-{}", start_time(pid).unwrap_or(0))
    })
}

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`), `None` when it is gone.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// True when the process state of `pid` is zombie (exited, not yet reaped) or it is gone.
fn dead_or_zombie(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_none_or(|state| state == "Z" || state == "X"),
        Err(_) => true,
    }
}

fn alive(incarnation: &str) -> bool {
    let Some((pid, start)) = incarnation.split_once('-') else {
        return false;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<i32>(), start.parse::<u64>()) else {
        return false;
    };
    start_time(pid) == Some(start) && !dead_or_zombie(pid)
}

/// A number for the next run of this incarnation (its `ORCH_INCARNATION` value is
/// `<incarnation>/<run>`).
pub(crate) fn next_run() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The `ORCH_INCARNATION` value of run `run` of this incarnation.
pub(crate) fn marker(run: u64) -> String {
    format!("{}/{run}", incarnation())
}

/// Records this process's children in `dir` from now on (created if missing). Call once at
/// startup, before anything is spawned; later calls keep the first directory.
pub fn record_children_in(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let _ = DIR.set(dir.to_owned());
    Ok(())
}

fn record_path(pgid: i32) -> Option<PathBuf> {
    DIR.get()
        .map(|d| d.join(format!("{}.{pgid}", incarnation())))
}

/// The suffix of the file naming an incarnation's worker id (`<incarnation>.worker`).
const WORKER_SUFFIX: &str = "worker";

/// Records that this incarnation claims jobs as `worker_id` (in the directory of
/// [`record_children_in`]), so that once it is dead a restarted orch on this node can free its
/// leases at once ([`dead_workers`]) instead of waiting for them to expire.
pub fn record_worker(worker_id: &str) -> std::io::Result<()> {
    let Some(dir) = DIR.get() else {
        return Ok(());
    };
    std::fs::write(
        dir.join(format!("{}.{WORKER_SUFFIX}", incarnation())),
        worker_id,
    )
}

/// A dead incarnation's worker id, found by [`dead_workers`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadWorker {
    pub incarnation: String,
    pub worker_id: String,
    record: PathBuf,
}

impl DeadWorker {
    /// Forgets the record (once its leases were freed).
    pub fn forget(&self) {
        let _ = std::fs::remove_file(&self.record);
    }
}

/// Every worker id recorded in `dir` (this machine's orch processes, live or dead whose leases
/// are not freed yet).
pub fn node_worker_ids(dir: &Path) -> std::collections::HashSet<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Default::default();
    };
    entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .rsplit_once('.')
                .is_some_and(|(_, suffix)| suffix == WORKER_SUFFIX)
        })
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty())
        .collect()
}

/// The worker ids of incarnations in `dir` that are no longer alive, except ids that a live
/// incarnation also uses (a restart that kept its `--worker-id`). Their leases can be freed
/// now: the process that held them is gone for certain (its pid and start time say so).
pub fn dead_workers(dir: &Path) -> Vec<DeadWorker> {
    let me = incarnation();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut dead = Vec::new();
    let mut live_ids = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((owner, WORKER_SUFFIX)) = name.rsplit_once('.') else {
            continue;
        };
        let Ok(id) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let id = id.trim().to_owned();
        if owner == me {
            // This process has claimed nothing yet: an id it shares with a dead one is free.
            continue;
        }
        if alive(owner) {
            live_ids.push(id);
        } else if !id.is_empty() {
            dead.push(DeadWorker {
                incarnation: owner.to_owned(),
                worker_id: id,
                record: entry.path(),
            });
        }
    }
    dead.retain(|d| !live_ids.contains(&d.worker_id));
    dead
}

/// A group was spawned: record it (best effort; a failure is logged). `run` is set for a run
/// whose escaped daemons must be killed too if orch dies while it runs.
pub(crate) fn spawned(pgid: i32, run: Option<u64>) {
    let Some(path) = record_path(pgid) else {
        return;
    };
    let run = run.map(|r| r.to_string()).unwrap_or_default();
    let text = format!("{pgid} {} {run}\n", start_time(pgid).unwrap_or(0));
    if let Err(e) = std::fs::write(&path, text) {
        tracing::warn!(path = %path.display(), error = %e, "cannot record a child process group");
    }
}

/// A group was reaped: forget it.
pub(crate) fn reaped(pgid: i32) {
    if let Some(path) = record_path(pgid) {
        let _ = std::fs::remove_file(path);
    }
}

/// What [`stop_dead_incarnations`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cleanup {
    /// Dead incarnations found.
    pub incarnations: Vec<String>,
    /// Process groups of dead incarnations that were still alive and were killed.
    pub groups_killed: Vec<i32>,
    /// Escaped descendants (left the group) of dead incarnations that were killed.
    pub escaped_killed: Vec<i32>,
}

/// Kills every recorded group and every marked descendant of incarnations in `dir` that are no
/// longer alive, waits (up to a few seconds) for them to go, and removes their records.
pub fn stop_dead_incarnations(dir: &Path) -> Cleanup {
    let mut out = Cleanup::default();
    let me = incarnation();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    let mut doomed: Vec<(PathBuf, i32, u64)> = Vec::new();
    let mut in_flight: Vec<String> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((owner, pgid)) = name.rsplit_once('.') else {
            continue;
        };
        let Ok(pgid) = pgid.parse::<i32>() else {
            continue;
        };
        if owner == me || alive(owner) {
            continue;
        }
        if !out.incarnations.iter().any(|i| i == owner) {
            out.incarnations.push(owner.to_owned());
        }
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        let mut fields = text.split_whitespace().skip(1);
        let leader_start = fields.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        if let Some(run) = fields.next() {
            in_flight.push(format!("{owner}/{run}"));
        }
        doomed.push((entry.path(), pgid, leader_start));
    }
    let mut waiting: Vec<i32> = Vec::new();
    // SAFETY: getpgrp cannot fail and touches no memory.
    let own_group = unsafe { libc::getpgrp() };
    for (_, pgid, leader_start) in &doomed {
        // Never our own group: a self-deploy may start the new orch inside the deploy
        // command's group.
        if *pgid <= 1 || *pgid == own_group {
            continue;
        }
        // While any process is in group `pgid` the number cannot be given to a new process;
        // so a live process with that pid but another start time means our group is gone and
        // the number was reused: leave it alone.
        match start_time(*pgid) {
            Some(start) if start != *leader_start => continue,
            _ => {}
        }
        if crate::group::signal(*pgid, libc::SIGKILL) {
            out.groups_killed.push(*pgid);
            waiting.push(*pgid);
        }
    }
    out.escaped_killed = kill_marked(&in_flight);
    let deadline = Instant::now() + Duration::from_secs(5);
    for pgid in waiting {
        while !group_gone(pgid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    for (path, _, _) in doomed {
        let _ = std::fs::remove_file(path);
    }
    out
}

/// True when group `pgid` has no member left that is not a zombie.
fn group_gone(pgid: i32) -> bool {
    crate::group::reap_adopted();
    procs()
        .into_iter()
        .filter(|&pid| pgid_of(pid) == Some(pgid))
        .all(dead_or_zombie)
}

fn pgid_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(2)?.parse().ok()
}

fn procs() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .collect()
}

/// Stops what run `run` of this incarnation left running outside its process group once the
/// run has ended (descendants that started a session of their own: `setsid`, a nested
/// sandbox's `--new-session`): SIGKILL to each, then up to `wait` for them to die, reaping the
/// ones orch adopted. For runs that must leave nothing behind ([`crate::Cmd::no_daemons`]).
/// Returns the pids that were killed.
pub(crate) async fn stop_escaped(run: u64, wait: Duration) -> Vec<i32> {
    // Reading every process's environ is blocking file I/O: off the async workers.
    let marked = [marker(run)];
    let killed = match tokio::task::spawn_blocking(move || kill_marked(&marked)).await {
        Ok(killed) => killed,
        Err(e) => {
            tracing::warn!(run, error = %e, "the sweep for a run's escaped processes did not finish");
            Vec::new()
        }
    };
    let deadline = Instant::now() + wait;
    loop {
        crate::group::reap_adopted();
        if killed.iter().all(|&pid| dead_or_zombie(pid)) || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    crate::group::reap_adopted();
    killed
}

/// SIGKILLs every process (not running the orch binary itself) whose environment names one of
/// the runs `dead` (`<incarnation>/<run>`).
fn kill_marked(dead: &[String]) -> Vec<i32> {
    if dead.is_empty() {
        return Vec::new();
    }
    let own = std::process::id() as i32;
    let own_exe = std::fs::read_link("/proc/self/exe").ok();
    let mut killed = Vec::new();
    for pid in procs() {
        if pid == own || pid <= 1 || dead_or_zombie(pid) {
            continue;
        }
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let marked = environ.split(|&b| b == 0).any(|var| {
            var.strip_prefix(INCARNATION_ENV.as_bytes())
                .and_then(|v| v.strip_prefix(b"="))
                .is_some_and(|v| dead.iter().any(|d| d.as_bytes() == v))
        });
        if !marked {
            continue;
        }
        if own_exe.is_some() && std::fs::read_link(format!("/proc/{pid}/exe")).ok() == own_exe {
            continue;
        }
        // SAFETY: kill has no memory-safety preconditions; pid > 1 was checked.
        if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
            killed.push(pid);
        }
    }
    killed
}
