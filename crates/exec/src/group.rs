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
//! - [`signal`] refuses process group ids ≤ 1, so a bug can never become `kill(-1)`.
//!
//! Limit: a descendant that leaves the group (`setsid`, a daemonizing tool) is out of reach.

use std::process::ExitStatus;
use std::sync::Once;
use std::time::{Duration, Instant};

use tokio::process::Child;

/// How long to wait for the group to disappear after SIGKILL before giving up with a warning
/// (a process stuck in uninterruptible sleep cannot die until its I/O returns).
const AFTER_KILL: Duration = Duration::from_secs(5);
/// Polling step while waiting for a group's members to die and be reaped.
const POLL: Duration = Duration::from_millis(10);

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
    let grace_end = Instant::now() + grace;
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
        if status.is_some() && !reap(pgid, Instant::now() + AFTER_KILL).await {
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
    if reap(pgid, Instant::now() + grace).await {
        return;
    }
    signal(pgid, libc::SIGKILL);
    if !reap(pgid, Instant::now() + AFTER_KILL).await {
        tracing::warn!(pgid, "members of a killed process group are still present");
    }
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
