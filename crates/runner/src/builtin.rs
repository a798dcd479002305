//! Built-in job kinds that need no configuration: `bench.noop` (does nothing; the benchmark's
//! load) and `bench.effect` (records one `bench.effect` event in the same transaction that
//! marks the job done, so crash tests can count effects instead of statuses). A `bench.effect`
//! job whose content contains `sleep_ms=N` works N ms (bounded to 60 s) before its effect.

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
            if let Some(ms) = sleep_ms(&cx.job.task_content) {
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_millis(ms)) => {}
                    _ = cx.cancel.cancelled() => anyhow::bail!("cancelled before the effect"),
                }
            }
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

/// `sleep_ms=N` in a job's content, at most 60 s.
fn sleep_ms(content: &str) -> Option<u64> {
    let rest = content.split("sleep_ms=").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse::<u64>().ok().map(|ms| ms.min(60_000))
}

#[cfg(test)]
mod tests {
    #[test]
    fn sleep_ms_is_parsed_and_bounded() {
        assert_eq!(super::sleep_ms("x sleep_ms=15 y"), Some(15));
        assert_eq!(super::sleep_ms("sleep_ms=999999999"), Some(60_000));
        assert_eq!(super::sleep_ms("sleep_ms=abc"), None);
        assert_eq!(super::sleep_ms(""), None);
    }
}
