//! orch's own secrets (its API token, its database URL) taken out of its environment at start-up
//! and kept in memory: a child inherits an allowlisted environment anyway, and this also keeps
//! them out of `/proc/<pid>/environ`, which a process of the same user (an unsandboxed deploy
//! script, or anything when the sandbox is off) could otherwise read. The process is also made
//! non-dumpable, so its memory is not readable through `/proc` by other processes of its user.

use std::sync::OnceLock;

static TAKEN: OnceLock<Vec<(String, String)>> = OnceLock::new();

/// Takes orch's secrets out of the environment. Call first thing in `main`, before any thread.
pub fn take() {
    // SAFETY: called at the top of `main`, before the runtime or any other thread exists.
    let taken =
        unsafe { orch_exec::env::take_from_own_environment(&orch_domain::net::SECRET_VARS) };
    let _ = TAKEN.set(taken);
}

/// A variable as orch's environment had it at start-up: the taken secrets, else the live
/// environment.
pub fn var(name: &str) -> Option<String> {
    TAKEN
        .get()
        .and_then(|t| t.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        .or_else(|| std::env::var(name).ok())
}
