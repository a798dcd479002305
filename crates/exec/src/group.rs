//! Process groups: every child of orch leads its own group, and this module is the only code that
//! signals and reaps such a group, so a killed run leaves nothing behind: no orphan still running,
//! no zombie left for a PID 1 that does not reap (as on the machines orch was built on).
//!
//! How that holds:
//! - on Linux orch marks itself a *child subreaper* (`PR_SET_CHILD_SUBREAPER`) once, so the
//!   grandchildren of a run, orphaned when their parent dies, become children of orch instead of
//!   PID 1, and [`reap`] collects them with `waitpid(-pgid)`;
//! - the group leader is always reaped by tokio's `Child::wait` first; [`reap`] is only called after
//!   that, so it never steals the leader's exit status from tokio;
//! - [`signal`] refuses process group ids ≤ 1, so a bug can never become `kill(-1)`;
//! - a descendant that leaves the group (`setsid`, a daemonizing tool such as git's detached
//!   auto-maintenance) cannot be stopped with it, but once orphaned it is adopted by orch like
//!   any other, and [`reap_adopted`] collects it when it exits. It only touches children that are
//!   not live group leaders of orch (those belong to tokio) and not in orch's own process group
//!   (children spawned by anything else), so it never takes another waiter's exit status.

use std::collections::HashSet;
use std::io;
use std::process::ExitStatus;
use std::sync::{Mutex, MutexGuard, Once, PoisonError};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// How long to wait for the group to disappear after SIGKILL before giving up with a warning
/// (a process stuck in uninterruptible sleep cannot die until its I/O returns).
pub(crate) const AFTER_KILL: Duration = Duration::from_secs(5);
/// Polling step while waiting for a group's members to die and be reaped.
const POLL: Duration = Duration::from_millis(10);

/// Group leaders spawned by [`spawn`] that tokio has not reaped yet: [`reap_adopted`] must not
/// touch them. Spawning and sweeping both hold this lock, so a leader that exits at once is
/// registered before any sweep can see it.
static LEADERS: Mutex<Option<HashSet<i32>>> = Mutex::new(None);

fn leaders() -> MutexGuard<'static, Option<HashSet<i32>>> {
    LEADERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Spawns `command` (configured with `process_group(0)`) and registers it as a live leader
/// (and, durably, in [`crate::records`]; `run` when its escaped daemons are to be killed too).
pub(crate) fn spawn(command: &mut Command, run: Option<u64>) -> io::Result<Child> {
    let mut live = leaders();
    let child = command.spawn()?;
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        live.get_or_insert_with(HashSet::new).insert(pid);
        crate::records::spawned(pid, run);
    }
    Ok(child)
}

/// Spawns a child that must outlive orch (a supervisor, [`crate::supervise`]): registered as
/// a live leader, so [`reap_adopted`] never takes its exit status from tokio, but not recorded
/// in [`crate::records`], so a restarted orch never stops it. [`release`] it once reaped.
pub(crate) fn spawn_unrecorded(command: &mut Command) -> io::Result<Child> {
    let mut live = leaders();
    let child = command.spawn()?;
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        live.get_or_insert_with(HashSet::new).insert(pid);
    }
    Ok(child)
}

/// Forgets a leader once tokio has reaped it.
pub(crate) fn release(pid: i32) {
    if let Some(live) = leaders().as_mut() {
        live.remove(&pid);
    }
    crate::records::reaped(pid);
}

/// Reaps exited children that orch adopted as subreaper and that no one else waits for:
/// not a live leader, not in orch's own process group. Never fails; cheap (a few /proc reads).
pub(crate) fn reap_adopted() {
    let live = leaders();
    // SAFETY: getpgrp cannot fail and touches no memory.
    let own_group = unsafe { libc::getpgrp() };
    for pid in children() {
        if pid <= 1 || live.as_ref().is_some_and(|l| l.contains(&pid)) {
            continue;
        }
        // SAFETY: getpgid has no memory-safety preconditions.
        let pgid = unsafe { libc::getpgid(pid) };
        if pgid < 0 || pgid == own_group {
            continue;
        }
        // SAFETY: a null status pointer is allowed; WNOHANG leaves a running child alone.
        let reaped = unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
        if reaped == pid {
            tracing::debug!(pid, "reaped an adopted orphan");
        }
    }
}

/// The pids of orch's children (Linux `/proc`; empty elsewhere or when unreadable).
fn children() -> Vec<i32> {
    let mut pids = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return pids;
    };
    for task in tasks.flatten() {
        if let Ok(list) = std::fs::read_to_string(task.path().join("children")) {
            pids.extend(
                list.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    }
    pids
}

/// Makes orch the reaper of its orphaned descendants (Linux only; elsewhere a no-op). Idempotent.
pub(crate) fn become_subreaper() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes one integer argument and touches
            // no memory of ours.
            let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
            if rc != 0 {
                tracing::warn!(
                    error = %std::io::Error::last_os_error(),
                    "cannot become a child subreaper; grandchildren of killed runs may stay as zombies"
                );
            }
        }
    });
}

/// Sends `sig` to every process of group `pgid`. Returns false when the group no longer exists
/// (or the id is not a valid group id).
pub(crate) fn signal(pgid: i32, sig: i32) -> bool {
    if pgid <= 1 {
        return false;
    }
    // SAFETY: kill has no memory-safety preconditions; a negative pid addresses a process group.
    let rc = unsafe { libc::kill(-pgid, sig) };
    if rc == 0 {
        return true;
    }
    // EPERM means a member exists that we may not signal (it changed its credentials).
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// True while any process (zombies included) is still in group `pgid`.
pub(crate) fn exists(pgid: i32) -> bool {
    signal(pgid, 0)
}

/// Reaps every exited member of group `pgid` that is our child, until the group is gone or
/// `deadline` passes. Returns true when the group is gone. Call only after the leader was reaped.
pub(crate) async fn reap(pgid: i32, deadline: Instant) -> bool {
    if pgid <= 1 {
        return true;
    }
    loop {
        loop {
            // SAFETY: a null status pointer is allowed; -pgid selects children in that group.
            let pid = unsafe { libc::waitpid(-pgid, std::ptr::null_mut(), libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
        }
        if !exists(pgid) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Stops a running group: SIGTERM to the whole group, up to `grace` for it to exit, then SIGKILL
/// to whatever is left; reaps the leader (through tokio) and every other member. Returns the
/// leader's exit status when it could be collected.
pub(crate) async fn terminate(child: &mut Child, pgid: i32, grace: Duration) -> Option<ExitStatus> {
    let mut guard = KillOnDrop(Some(pgid));
    let grace_end = after(grace);
    signal(pgid, libc::SIGTERM);
    let mut status = tokio::time::timeout(grace, child.wait())
        .await
        .ok()
        .and_then(Result::ok);
    let gone = status.is_some() && reap(pgid, grace_end).await;
    if !gone {
        signal(pgid, libc::SIGKILL);
        if status.is_none() {
            status = match tokio::time::timeout(AFTER_KILL, child.wait()).await {
                Ok(Ok(s)) => Some(s),
                Ok(Err(e)) => {
                    tracing::warn!(pgid, error = %e, "cannot wait for a killed process");
                    None
                }
                Err(_) => {
                    tracing::warn!(pgid, "a killed process did not exit within {AFTER_KILL:?}");
                    None
                }
            };
        }
        if status.is_some() && !reap(pgid, after(AFTER_KILL)).await {
            tracing::warn!(pgid, "members of a killed process group are still present");
        }
    }
    guard.0 = None;
    status
}

/// After the leader exited on its own: stop whatever it left running in its group (background
/// jobs, daemons that did not leave the group) and reap it all, so nothing outlives the run and
/// holds its output pipes open.
pub(crate) async fn sweep(pgid: i32, grace: Duration) {
    if !exists(pgid) {
        return;
    }
    // Members that already exited are zombies handed to us; reap them before deciding.
    if reap(pgid, Instant::now()).await {
        return;
    }
    tracing::debug!(pgid, "stopping processes left behind by a finished command");
    signal(pgid, libc::SIGTERM);
    if reap(pgid, after(grace)).await {
        return;
    }
    signal(pgid, libc::SIGKILL);
    if !reap(pgid, after(AFTER_KILL)).await {
        tracing::warn!(pgid, "members of a killed process group are still present");
    }
}

/// The live (not zombie) processes of session `sid`, its leader excepted, that started at or
/// after clock tick `since` (from `/proc`; empty when it cannot be read).
fn session_members(sid: i32, since: u64) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            if pid == sid {
                return None;
            }
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // After the command name: state ppid pgrp session … starttime (the 20th).
            let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
            if matches!(fields.first(), None | Some(&"Z") | Some(&"X")) {
                return None;
            }
            let session: i32 = fields.get(3)?.parse().ok()?;
            let start: u64 = fields.get(19)?.parse().ok()?;
            (session == sid && start >= since).then_some(pid)
        })
        .collect()
}

/// Stops what a dead session leader left running in its session `sid` (a supervisor killed
/// without stopping its command: the command's group, and anything else it started that kept
/// the session): SIGTERM to every member, up to `grace` for them to exit, then SIGKILL; the
/// members that are orch's children (orphans adopted as subreaper) are reaped. Processes that
/// started before clock tick `since` (the leader's own start) are never touched: they cannot
/// belong to it. Returns how many processes were found running.
pub(crate) async fn stop_session(sid: i32, since: u64, grace: Duration) -> usize {
    if sid <= 1 {
        return 0;
    }
    let found = session_members(sid, since);
    if found.is_empty() {
        return 0;
    }
    let mut termed: HashSet<i32> = HashSet::new();
    let grace_end = after(grace);
    let kill_end = after(grace.saturating_add(AFTER_KILL));
    let mut members = found.clone();
    loop {
        let killing = Instant::now() >= grace_end;
        for &pid in &members {
            if killing {
                kill_one(pid, libc::SIGKILL);
            } else if termed.insert(pid) {
                kill_one(pid, libc::SIGTERM);
            }
        }
        tokio::time::sleep(POLL).await;
        reap_adopted();
        members = session_members(sid, since);
        if members.is_empty() {
            break;
        }
        if Instant::now() >= kill_end {
            tracing::warn!(
                sid,
                left = ?members,
                "processes of a dead supervisor's session are still present after SIGKILL"
            );
            break;
        }
    }
    found.len()
}

fn kill_one(pid: i32, sig: i32) {
    if pid > 1 {
        // SAFETY: kill takes plain integers; pid > 1 is one process, never a group or all.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// The instant `d` from now; a grace too large to represent (`Duration::MAX`) means a day.
fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400))
}

/// SIGKILLs the group if dropped while armed: the last line of defence when a termination is
/// itself cancelled (runtime shutting down).
struct KillOnDrop(Option<i32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            signal(pgid, libc::SIGKILL);
        }
    }
}

/// The pids of processes whose working directory is inside `dir` (from `/proc`).
pub fn processes_under(dir: &std::path::Path) -> Vec<i32> {
    let Ok(dir) = dir.canonicalize() else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(&dir))
        })
        .collect()
}

/// Stops every process whose working directory is inside `dir` (services a script started
/// there and left running): SIGTERM, up to `grace` for them to go, then SIGKILL.
pub fn stop_processes_under(dir: &std::path::Path, grace: std::time::Duration) {
    let pids = processes_under(dir);
    if pids.is_empty() {
        return;
    }
    for pid in &pids {
        // SAFETY: kill(2) with a pid read from /proc; a vanished pid is ESRCH, ignored.
        unsafe { libc::kill(*pid, libc::SIGTERM) };
    }
    let deadline = std::time::Instant::now() + grace;
    while std::time::Instant::now() < deadline && !processes_under(dir).is_empty() {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    for pid in processes_under(dir) {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}
