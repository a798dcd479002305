//! Small pieces both drivers share: error texts, the retry-at-limit rule, row decoding of
//! aggregate rows, and input checks.

use orch_domain::control::{self, events};
use orch_domain::payload::StageChange;
use sqlx::Row;

use orch_domain::ids::IdError;

use crate::error::{Result, StoreError};
use crate::model::*;

/// The `task.failed` event of a task whose last live job failed for good. Like every stage
/// change it says `from`/`to` (and the outcome contract's `outcome`/`stage`/`reason`).
pub(crate) fn stranded_event(task: &Task, job_id: i64, error: &str) -> NewEvent {
    NewEvent::new(
        events::TASK_FAILED,
        format!("job {job_id} failed for good and the task had no other live job: {error}"),
    )
    .task(task.id)
    .job(job_id)
    .data(StageChange::failed(task.stage.as_str(), error).text())
}

/// The job a task reaching a terminal stage gets, in the same transaction (see
/// `orch_domain::control::jobs::TASK_ENDED`): task-less, so cancelling the task's jobs never
/// cancels it; one per terminal visit (its dedupe key).
pub(crate) fn task_ended_job(task: &Task) -> NewJob {
    NewJob::new(
        control::jobs::TASK_ENDED,
        serde_json::json!({"task": task.id, "seq": task.stage_seq}).to_string(),
    )
    .dedupe(control::dedupe::task_ended(task.id, task.stage_seq))
}

/// The `jobs.pruned` event of one retention batch, written in the transaction that deleted
/// `ids`: how many, the running `total`, the cutoff and the lowest and highest id.
pub(crate) fn prune_event(ids: &[i64], total: i64, finished_before: Millis) -> NewEvent {
    let first = ids.iter().min().copied();
    let last = ids.iter().max().copied();
    NewEvent::new(
        events::JOBS_PRUNED,
        format!(
            "retention pruned {} finished job(s) of finished tasks (finished before {finished_before} ms); {total} pruned in all",
            ids.len()
        ),
    )
    .data(
        serde_json::json!({
            "jobs": ids.len(), "total": total, "finished_before": finished_before,
            "first_id": first, "last_id": last,
        })
        .to_string(),
    )
}

/// The running total a `jobs.pruned` event's data carries; an error when it is unreadable (a
/// total restarted from zero would be a lie on `/metrics`).
pub(crate) fn prune_total_of(data: &str) -> Result<i64> {
    serde_json::from_str::<serde_json::Value>(data)
        .ok()
        .and_then(|v| v.get("total").and_then(serde_json::Value::as_i64))
        .ok_or_else(|| {
            StoreError::Invalid(format!(
                "the latest {} event has no readable total: {data}",
                events::JOBS_PRUNED
            ))
        })
}

/// What a rescue does with one expired lease.
pub(crate) struct RescuePlan {
    /// The crash bound is reached: the job fails with `error`.
    pub give_up: bool,
    /// `last_error` of the job.
    pub error: String,
    /// Requeued this far in the future (when not giving up).
    pub delay_ms: i64,
    /// The `job.rescued` event (always written).
    pub event: NewEvent,
}

/// A lease expired: the attempt was lost to a dead (or stalled) worker, not failed by its
/// handler. `crashes` counts this one. It does not spend the job's attempts; past
/// `rescue.max_crashes` the job fails with a reason that says so.
pub(crate) fn rescue_plan(
    rescue: &Rescue,
    job_id: i64,
    task_id: Option<i64>,
    worker: Option<&str>,
    attempt: i64,
    crashes: i64,
) -> RescuePlan {
    let worker = worker.unwrap_or("?");
    let give_up = crashes >= rescue.max_crashes;
    let lost = format!(
        "attempt {attempt} lost: the worker stopped heartbeating (crash) \u{2014} not counted \
         as a failure"
    );
    let (error, message) = if give_up {
        let e = format!(
            "the job's worker died {crashes} times while running it (the last: worker {worker} \
             stopped heartbeating in attempt {attempt})"
        );
        (e.clone(), e)
    } else {
        (
            lost.clone(),
            format!(
                "{lost} (worker {worker}; crash {crashes} of at most {})",
                rescue.max_crashes
            ),
        )
    };
    let mut event = NewEvent::new(events::JOB_RESCUED, message)
        .job(job_id)
        .data(
            serde_json::json!({
                "attempt": attempt, "worker": worker, "crashes": crashes,
                "crash_limit": rescue.max_crashes, "gave_up": give_up,
            })
            .to_string(),
        );
    event.task_id = task_id;
    RescuePlan {
        give_up,
        error,
        delay_ms: rescue.backoff_ms(crashes),
        event,
    }
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
        unknown_cost_runs: row.try_get(at + 4)?,
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
        work_item_id: row.try_get(6)?,
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

/// When the first of `jobs` enqueued at `now` becomes due, for the workers' wake-up:
/// `Millis::MIN` (now) if any is due at once, else the soonest delayed one.
pub(crate) fn due_at(jobs: &[NewJob], now: Millis) -> Millis {
    jobs.iter()
        .map(|j| match j.delay_ms {
            d if d > 0 => now.saturating_add(d),
            _ => Millis::MIN,
        })
        .min()
        .unwrap_or(Millis::MIN)
}

/// A row of `tasks` as the database returns it: the text columns not yet checked. Only the
/// store sees it (`pub` only for the drivers' `FromRow` bounds; this module is private); [`TaskRow::decode`] turns it into a [`Task`] or a
/// [`StoreError::CorruptRow`] naming the row, the column and the value.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct TaskRow {
    pub id: i64,
    pub work_item_id: String,
    pub repo: String,
    pub title: String,
    pub body: String,
    pub stage: String,
    pub stage_seq: i64,
    pub branch: String,
    pub created_at: Millis,
    pub updated_at: Millis,
}

impl TaskRow {
    /// The row as a [`Task`], its names validated; the first one that does not parse is a
    /// [`StoreError::CorruptRow`].
    pub(crate) fn decode(self) -> Result<Task, StoreError> {
        let id = self.id;
        Ok(Task {
            id,
            work_item_id: column("tasks", id, "work_item_id", self.work_item_id)?,
            repo: column("tasks", id, "repo", self.repo)?,
            title: self.title,
            body: self.body,
            stage: column("tasks", id, "stage", self.stage)?,
            stage_seq: self.stage_seq,
            branch: self.branch,
            created_at: self.created_at,
            updated_at: self.updated_at,
        })
    }
}

/// Decodes `rows` of a listing (the dashboard, a report, a maintenance pass): a row that does
/// not decode is left out with an error in the log naming it, so one corrupt row neither hides
/// every other task nor stops a pass that works on the others. Nothing is deleted or changed:
/// the row stays for an operator to repair, and every single-row read of it
/// ([`crate::Store::get_task`], a stage change) still fails with the same error.
pub(crate) fn decode_listing(rows: Vec<TaskRow>) -> Vec<Task> {
    rows.into_iter()
        .filter_map(|row| match row.decode() {
            Ok(task) => Some(task),
            Err(e) => {
                tracing::error!(error = %e, "a corrupt task row is left out of a listing");
                None
            }
        })
        .collect()
}

/// Column `column` of row `id` of `table` as a validated name `T`, or the error that names
/// them and the value (cut to [`CORRUPT_VALUE_ECHO`] characters, escaped by `{:?}`).
pub(crate) fn column<T>(
    table: &'static str,
    id: i64,
    column: &'static str,
    value: String,
) -> Result<T, StoreError>
where
    T: TryFrom<String, Error = IdError>,
{
    T::try_from(value.clone()).map_err(|e| StoreError::CorruptRow {
        table,
        id,
        column,
        value: echo(&value),
        reason: e.reason,
    })
}

/// At most this many characters of a corrupt value are quoted in an error: the value may be
/// anything, of any length.
pub(crate) const CORRUPT_VALUE_ECHO: usize = 80;

/// `value` cut to [`CORRUPT_VALUE_ECHO`] characters (`…` marks a cut); the error escapes it.
fn echo(value: &str) -> String {
    if value.chars().count() > CORRUPT_VALUE_ECHO {
        let mut cut: String = value.chars().take(CORRUPT_VALUE_ECHO).collect();
        cut.push('…');
        cut
    } else {
        value.to_owned()
    }
}
