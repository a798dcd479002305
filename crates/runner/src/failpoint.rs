//! Failpoints: named instants where a test can make this process die on purpose, so crash tests
//! kill a real process at an exact point (e.g. after a follow-up job is enqueued and before the
//! current job is marked). Activated only by the `ORCH_FAILPOINTS` environment variable, a
//! comma-separated list of names; a listed failpoint aborts the process (like `kill -9`: no
//! destructors, no flushing, leases left to expire).
//!
//! In-process tests can instead *pause* an attempt at a failpoint that [`pause`] marks: a
//! [`Gate`] registered for the name and a scope (the run's repo directory, so tests running
//! side by side in one binary never meet each other's gates) stops the attempt there until the
//! test lets it go, e.g. after stealing its lease. Nothing is registered in a real process, so
//! there it costs one lookup in an empty map.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use tokio::sync::Notify;

static ACTIVE: LazyLock<HashSet<String>> = LazyLock::new(|| {
    std::env::var("ORCH_FAILPOINTS")
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
});

/// Aborts the process if failpoint `name` is active.
pub fn hit(name: &str) {
    if !ACTIVE.is_empty() && ACTIVE.contains(name) {
        eprintln!("orch: failpoint {name} hit; aborting the process");
        std::process::abort();
    }
}

/// True when any failpoint is active (shown in `orch doctor` so nobody runs with one by accident).
pub fn any_active() -> bool {
    !ACTIVE.is_empty()
}

/// Gates by `(failpoint, scope)`.
type Gates = HashMap<(String, String), Arc<Gate>>;

/// Gates registered by in-process tests.
static GATES: LazyLock<Mutex<Gates>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// A failpoint an attempt may be paused at: [`hit`] (a crash test's abort), then, when an
/// in-process test registered a [`Gate`] for `name` and `scope`, a pause until the test lets
/// the attempt go. A gate serves one arrival (it is removed when reached).
pub async fn pause(name: &str, scope: &str) {
    hit(name);
    let gate = GATES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&(name.to_owned(), scope.to_owned()));
    if let Some(gate) = gate {
        gate.reached.notify_one();
        gate.resume.notified().await;
    }
}

/// A test's hold on one arrival at a [`pause`] failpoint.
#[derive(Debug, Default)]
pub struct Gate {
    reached: Notify,
    resume: Notify,
}

impl Gate {
    /// Registers a gate for the next attempt that reaches failpoint `name` in `scope`.
    pub fn register(name: &str, scope: &str) -> Arc<Gate> {
        let gate = Arc::new(Gate::default());
        GATES
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((name.to_owned(), scope.to_owned()), gate.clone());
        gate
    }

    /// Waits until an attempt stands at the gate.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets the attempt standing at the gate go on.
    pub fn resume(&self) {
        self.resume.notify_one();
    }
}
