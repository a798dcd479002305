//! Built-in job kinds that need no configuration: `bench.noop` (does nothing; the benchmark's
//! load) and `bench.effect` (records one `bench.effect` event in the same transaction that
//! marks the job done, so crash tests can count effects instead of statuses).

use std::sync::Arc;
use std::time::Duration;

use orch_store::{JobOutcome, NewEvent};

use crate::worker::{Outcome, Registry, handler_fn};

pub const NOOP: &str = "bench.noop";
pub const EFFECT: &str = "bench.effect";

/// Registers the built-in kinds.
pub fn register(registry: &mut Registry) {
    registry.register(
        NOOP,
        Duration::from_secs(60),
        handler_fn(|_cx| async { Ok(Outcome::Done) }),
    );
    registry.register(
        EFFECT,
        Duration::from_secs(60),
        handler_fn(|cx| async move {
            let event = NewEvent::new(EFFECT, format!("effect of job {}", cx.job.id))
                .job(cx.job.id)
                .data(format!(
                    r#"{{"attempt":{},"worker":{}}}"#,
                    cx.lease.attempt,
                    serde_json::Value::String(cx.worker_id.clone())
                ));
            crate::failpoint::hit("effect.before_mark");
            cx.store
                .mark_job(cx.lease, JobOutcome::Done, Some(event))
                .await?;
            crate::failpoint::hit("effect.after_mark");
            Ok(Outcome::Marked)
        }),
    );
}

/// A registry with only the built-in kinds.
pub fn registry() -> Arc<Registry> {
    let mut r = Registry::new();
    register(&mut r);
    Arc::new(r)
}
