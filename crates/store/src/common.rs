//! Small pieces both drivers share: error texts, the retry-at-limit rule, row decoding of
//! aggregate rows, and input checks.

use sqlx::Row;

use crate::error::{Result, StoreError};
use crate::model::*;

pub(crate) fn stranded_event(task_id: i64, job_id: i64, error: &str) -> NewEvent {
    NewEvent::new(
        "task.failed",
        format!("job {job_id} failed for good and the task had no other live job: {error}"),
    )
    .task(task_id)
    .job(job_id)
    .stage("failed")
}

pub(crate) fn rescue_error(worker: Option<&str>, attempt: i64, max_attempts: i64) -> String {
    format!(
        "lease expired: worker {} stopped heartbeating (attempt {attempt} of {max_attempts})",
        worker.unwrap_or("?")
    )
}

/// A retry asked for at the attempt limit is a failure.
pub(crate) fn retry_or_fail(outcome: JobOutcome, attempt: i64, max_attempts: i64) -> JobOutcome {
    match outcome {
        JobOutcome::Retry { error, .. } if attempt >= max_attempts => JobOutcome::Failed {
            error: format!("{error} (attempt {attempt} of {max_attempts}: no attempts left)"),
        },
        other => other,
    }
}

pub(crate) fn lease_lost(lease: Lease, state: &str, attempt: i64) -> StoreError {
    let actual = if attempt != lease.attempt {
        format!("{state} under attempt {attempt}")
    } else {
        state.to_owned()
    };
    StoreError::LeaseLost { lease, actual }
}

pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty()
        || prefix.len() > 16
        || !prefix
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
    {
        return Err(StoreError::Invalid(format!(
            "work item prefix {prefix:?} must be 1-16 characters of [A-Z0-9]"
        )));
    }
    Ok(())
}

pub(crate) fn json_or_empty(data: &str) -> &str {
    if data.trim().is_empty() { "{}" } else { data }
}

/// Queue counts in display order: by agent, then state name.
pub(crate) fn by_agent(mut counts: Vec<KindCount>) -> Vec<KindCount> {
    counts.sort_by(|a, b| (&a.agent, a.state.as_str()).cmp(&(&b.agent, b.state.as_str())));
    counts
}

pub(crate) fn kind_count<R: Row>(row: R) -> Result<KindCount>
where
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    let state: String = row.try_get(1)?;
    Ok(KindCount {
        agent: row.try_get(0)?,
        state: JobState::parse(&state).ok_or_else(|| {
            StoreError::Invalid(format!("unknown job state {state:?} in the database"))
        })?,
        count: row.try_get(2)?,
    })
}

/// Runs, input tokens, output tokens and cost from the row's columns `at..at + 4` (the
/// aggregates of `sql::TASK_USAGE` and `sql::USAGE_BY_AGENT`, which never return NULL).
pub(crate) fn usage<R: Row>(row: &R, at: usize) -> Result<Usage>
where
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> f64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    Ok(Usage {
        runs: row.try_get(at)?,
        input_tokens: row.try_get(at + 1)?,
        output_tokens: row.try_get(at + 2)?,
        cost_usd: row.try_get(at + 3)?,
    })
}

pub(crate) fn live_lease<R: Row>(row: R) -> Result<LiveLease>
where
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    Ok(LiveLease {
        job_id: row.try_get(0)?,
        task_id: row.try_get(1)?,
        agent: row.try_get(2)?,
        worker: row.try_get(3)?,
        attempt: row.try_get(4)?,
        expires_at: row.try_get(5)?,
    })
}

/// The answer of `complete_and_claim` from what its statement returned: the claimed jobs in
/// claim order, and the completions whose fence did not hold (not among `done_ids`).
pub(crate) fn completed_and_claimed(
    done: &[Lease],
    done_ids: &[i64],
    claimed: Vec<Job>,
) -> CompleteAndClaim {
    let mut claimed: Vec<ClaimedJob> = claimed
        .into_iter()
        .map(|job| ClaimedJob {
            lease: Lease {
                job_id: job.id,
                attempt: job.attempt,
            },
            job,
        })
        .collect();
    claimed.sort_by_key(|c| (-c.job.priority, c.job.available_at, c.job.id));
    CompleteAndClaim {
        claimed,
        fenced: done
            .iter()
            .filter(|l| !done_ids.contains(&l.job_id))
            .copied()
            .collect(),
    }
}
