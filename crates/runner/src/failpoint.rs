//! Failpoints: named instants where a test can make this process die on purpose, so crash tests
//! kill a real process at an exact point (e.g. after a follow-up job is enqueued and before the
//! current job is marked). Activated only by the `ORCH_FAILPOINTS` environment variable, a
//! comma-separated list of names; a listed failpoint aborts the process (like `kill -9`: no
//! destructors, no flushing, leases left to expire).

use std::collections::HashSet;
use std::sync::LazyLock;

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
