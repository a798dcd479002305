//! The store's rules, written once for both databases: [`Db`] over a [`Driver`].
//!
//! Every method here is the same on SQLite and PostgreSQL; where the databases differ it asks
//! the driver (begin/commit-and-wake, the row-lock suffix, a cross-process lock, a statement
//! constant). The few operations written differently per database (the hot path
//! `complete_and_claim`, `heartbeat`, `enqueue`, `enqueue_many`, `next_available_at`,
//! `schema_dump`, connecting, LISTEN) are `impl Db<Sqlite>` / `impl Db<Postgres>` blocks in
//! `sqlite.rs` and `postgres.rs`.
//!
//! To add a store method: write it here once (reads on `self.d.reader()`, single writes on
//! `self.d.writer()`, transactions with `self.d.begin()` … `self.d.commit(tx, announce)`, locking
//! reads with `D::FOR_UPDATE`), add its delegation to [`crate::Store`], and a case to
//! `tests/conformance.rs`. Only when its SQL must differ, add a constant to [`Driver`] (or an
//! `impl Db<…>` method in both driver files).

use std::sync::Arc;

use orch_domain::control::events;
use orch_domain::ids::{StageName, WorkItemId};
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, FromRow, IntoArguments, Row, Type};

use crate::common::*;
use crate::driver::{Announce, Driver, Statements};
use crate::error::{Result, StoreError};
use crate::migrate::{self, MigrateReport};
use crate::model::*;
use crate::{Clock, EVENTS_OF_TASKS_CHUNK, sql, stage_job_key};

/// A store on one database: the shared rules over the driver `D`.
#[derive(Debug, Clone)]
pub struct Db<D> {
    pub(crate) d: D,
    pub(crate) clock: Arc<dyn Clock>,
    /// Where the store points, with any password hidden.
    pub(crate) target: String,
    /// The driver's statements (`Statements::new::<D>()`, built once per driver).
    pub(crate) sql: &'static Statements,
}

/// The connection type of a driver's database.
type Conn<D> = <<D as Driver>::DB as Database>::Connection;

/// What [`Db::lock_running`] reads of a job its lease still holds.
struct RunningJob {
    max_attempts: i64,
    task_id: Option<i64>,
}

impl<D, DB> Db<D>
where
    D: Driver<DB = DB>,
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> f64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> bool: Decode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q, 'a> &'a str: Encode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB>,
    for<'q> Option<f64>: Encode<'q, DB>,
    for<'q> Option<String>: Encode<'q, DB>,
    usize: ColumnIndex<DB::Row>,
    for<'r> Job: FromRow<'r, DB::Row>,
    for<'r> TaskRow: FromRow<'r, DB::Row>,
    for<'r> Event: FromRow<'r, DB::Row>,
    for<'r> AgentRun: FromRow<'r, DB::Row>,
{
    pub fn target(&self) -> String {
        self.target.clone()
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    pub(crate) fn now(&self) -> Millis {
        self.clock.now_ms()
    }

    // ----- schema -------------------------------------------------------------------------

    pub async fn schema_version(&self) -> Result<i64> {
        let mut conn = self.d.reader().acquire().await?;
        Self::read_version(&mut conn).await
    }

    pub async fn migrate(&self) -> Result<MigrateReport> {
        let mut tx = self.d.begin().await?;
        D::lock_migrations(&mut tx).await?;
        let from = Self::read_version(&mut tx).await?;
        let pending = migrate::pending(D::MIGRATIONS, &self.target(), from)?;
        let mut applied = Vec::new();
        for m in &pending {
            sqlx::raw_sql(m.sql).execute(&mut *tx).await?;
            sqlx::query(sql::INSERT_EVENT)
                .bind(None::<i64>)
                .bind(None::<i64>)
                .bind(events::SCHEMA_MIGRATED)
                .bind(None::<String>)
                .bind(format!("applied schema migration {}", m.name))
                .bind(migrate::event_data(m))
                .bind(self.now())
                .execute(&mut *tx)
                .await?;
            applied.push(m.name.to_owned());
        }
        self.d.commit(tx, None).await?;
        Ok(MigrateReport {
            from,
            to: pending.last().map_or(from, |m| m.version),
            applied,
        })
    }

    async fn read_version(conn: &mut Conn<D>) -> Result<i64> {
        let exists: bool = sqlx::query_scalar(D::SCHEMA_EXISTS)
            .fetch_one(&mut *conn)
            .await?;
        if !exists {
            return Ok(0);
        }
        let rows: Vec<String> = sqlx::query_scalar(sql::EVENT_DATA_OF_KIND)
            .bind(events::SCHEMA_MIGRATED)
            .fetch_all(&mut *conn)
            .await?;
        Ok(rows
            .iter()
            .filter_map(|d| migrate::version_of(d))
            .max()
            .unwrap_or(0))
    }

    // ----- jobs ---------------------------------------------------------------------------

    pub async fn mark_job(
        &self,
        lease: Lease,
        outcome: JobOutcome,
        event: Option<NewEvent>,
    ) -> Result<()> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        let RunningJob {
            max_attempts,
            task_id,
        } = self.lock_running(&mut tx, lease).await?;
        let attempt = lease.attempt;
        let outcome = retry_or_fail(outcome, attempt, max_attempts);
        // A task the failure ended: its task-ended job is due now.
        let mut stranded = false;
        match &outcome {
            JobOutcome::Done => {
                sqlx::query(sql::MARK_DONE)
                    .bind(lease.job_id)
                    .bind(lease.attempt)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
            }
            JobOutcome::Retry { error, delay_ms } => {
                sqlx::query(sql::MARK_RETRY)
                    .bind(lease.job_id)
                    .bind(lease.attempt)
                    .bind(now + delay_ms)
                    .bind(error)
                    .execute(&mut *tx)
                    .await?;
            }
            JobOutcome::Failed { error } => {
                sqlx::query(sql::MARK_FAILED)
                    .bind(lease.job_id)
                    .bind(lease.attempt)
                    .bind(now)
                    .bind(error)
                    .execute(&mut *tx)
                    .await?;
                if let Some(task_id) = task_id {
                    stranded = self
                        .fail_stranded_task(&mut tx, task_id, lease.job_id, error, now)
                        .await?;
                }
            }
        }
        if let Some(event) = event {
            Self::insert_event(&mut tx, &event, now).await?;
        }
        // A retry is announced for when it is due: workers move their timers, no claim now.
        let wake = match outcome {
            JobOutcome::Retry { delay_ms, .. } => Some(Announce {
                due_at: now.saturating_add(delay_ms),
                now,
            }),
            _ if stranded => Some(Announce::NOW),
            _ => None,
        };
        self.d.commit(tx, wake).await
    }

    pub async fn release(&self, leases: &[Lease]) -> Result<u64> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        let mut released = 0;
        for lease in leases {
            let res = sqlx::query(sql::RELEASE)
                .bind(lease.job_id)
                .bind(lease.attempt)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            released += D::rows_affected(&res);
        }
        self.d
            .commit(tx, (released > 0).then_some(Announce::NOW))
            .await?;
        Ok(released)
    }

    pub async fn rescue_expired(&self, rescue: Rescue) -> Result<RescueReport> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        let expired = sqlx::query(self.sql.expired_leases.as_str())
            .bind(now)
            .bind(i64::from(rescue.limit))
            .fetch_all(&mut *tx)
            .await?;
        let mut report = RescueReport::default();
        let mut due_soonest: Option<Millis> = None;
        for row in expired {
            let id: i64 = row.try_get(0)?;
            let attempt: i64 = row.try_get(1)?;
            let task_id: Option<i64> = row.try_get(3)?;
            let worker: Option<String> = row.try_get(4)?;
            let crashes: i64 = sqlx::query_scalar(sql::CRASHES_OF_JOB)
                .bind(id)
                .fetch_one(&mut *tx)
                .await?;
            let plan = rescue_plan(
                &rescue,
                id,
                task_id,
                worker.as_deref(),
                attempt,
                crashes + 1,
            );
            Self::insert_event(&mut tx, &plan.event, now).await?;
            if plan.give_up {
                sqlx::query(sql::MARK_FAILED)
                    .bind(id)
                    .bind(attempt)
                    .bind(now)
                    .bind(&plan.error)
                    .execute(&mut *tx)
                    .await?;
                report.failed.push(id);
                if let Some(task_id) = task_id
                    && self
                        .fail_stranded_task(&mut tx, task_id, id, &plan.error, now)
                        .await?
                {
                    report.failed_tasks.push(task_id);
                }
            } else {
                sqlx::query(sql::RESCUE_REQUEUE)
                    .bind(id)
                    .bind(attempt)
                    .bind(now + plan.delay_ms)
                    .bind(&plan.error)
                    .execute(&mut *tx)
                    .await?;
                report.requeued.push(id);
                let due = now.saturating_add(plan.delay_ms);
                due_soonest = Some(due_soonest.map_or(due, |d: Millis| d.min(due)));
            }
        }
        let wake = due_soonest.map(|due_at| Announce { due_at, now });
        self.d.commit(tx, wake).await?;
        Ok(report)
    }

    pub async fn node_seen(&self, node: &str) -> Result<()> {
        sqlx::query(sql::NODE_SEEN)
            .bind(node)
            .bind(self.now())
            .execute(self.d.writer())
            .await?;
        Ok(())
    }

    pub async fn nodes(&self) -> Result<Vec<NodeSeen>> {
        sqlx::query(sql::NODES)
            .fetch_all(self.d.reader())
            .await?
            .iter()
            .map(|row| {
                Ok(NodeSeen {
                    node: row.try_get(0)?,
                    first_seen_ms: row.try_get(1)?,
                    last_seen_ms: row.try_get(2)?,
                })
            })
            .collect()
    }

    pub async fn take_over_job(&self, lease: Lease, node: &str, event: NewEvent) -> Result<()> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        self.lock_running(&mut tx, lease).await?;
        let res = sqlx::query(sql::TAKE_OVER_JOB)
            .bind(lease.job_id)
            .bind(lease.attempt)
            .bind(node)
            .execute(&mut *tx)
            .await?;
        if D::rows_affected(&res) == 0 {
            return Err(lease_lost(lease, "running", lease.attempt));
        }
        Self::insert_event(&mut tx, &event, now).await?;
        self.d.commit(tx, None).await
    }

    pub async fn enqueue_fenced(
        &self,
        lease: Lease,
        job: NewJob,
        event: NewEvent,
    ) -> Result<Enqueued> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        if let Err(e) = self.lock_running(&mut tx, lease).await {
            let _ = tx.rollback().await;
            return Err(e);
        }
        let out = Self::insert_job(&mut tx, &job, now).await?;
        // A duplicate is the follow-up an earlier attempt enqueued, its event with it.
        let wake = if out.duplicate {
            None
        } else {
            Self::insert_event(&mut tx, &event, now).await?;
            Some(Announce {
                due_at: due_at(std::slice::from_ref(&job), now),
                now,
            })
        };
        self.d.commit(tx, wake).await?;
        Ok(out)
    }

    pub async fn expire_leases_of(&self, worker_id: &str) -> Result<u64> {
        let res = sqlx::query(sql::EXPIRE_LEASES_OF)
            .bind(worker_id)
            .bind(self.now().saturating_sub(1))
            .execute(self.d.writer())
            .await?;
        Ok(D::rows_affected(&res))
    }

    pub async fn cancel_job(&self, job_id: i64) -> Result<bool> {
        let res = sqlx::query(sql::CANCEL_JOB)
            .bind(job_id)
            .bind(self.now())
            .execute(self.d.writer())
            .await?;
        let cancelled = D::rows_affected(&res) > 0;
        if !cancelled && self.get_job(job_id).await?.is_none() {
            return Err(StoreError::JobNotFound(job_id));
        }
        Ok(cancelled)
    }

    pub async fn cancel_task_jobs(&self, task_id: i64, keep: Option<i64>) -> Result<u64> {
        let res = sqlx::query(sql::CANCEL_TASK_JOBS)
            .bind(task_id)
            .bind(keep.unwrap_or(-1))
            .bind(self.now())
            .execute(self.d.writer())
            .await?;
        Ok(D::rows_affected(&res))
    }

    /// Ends the tasks [`sql::STRANDED_TASKS`] finds (`task.failed`, naming the job that failed
    /// and its error). The search reads without the write lock; each task is then re-checked in
    /// its own short transaction, under its row lock and at the stage visit the search saw
    /// (an operator's approve or retry in between wins). Returns the tasks failed.
    pub async fn fail_stranded_tasks(
        &self,
        finished_before: Millis,
        limit: u32,
    ) -> Result<Vec<i64>> {
        let rows = sqlx::query(sql::STRANDED_TASKS)
            .bind(finished_before)
            .bind(i64::from(limit))
            .fetch_all(self.d.reader())
            .await?;
        let mut failed = Vec::new();
        for row in rows {
            let task_id: i64 = row.try_get(0)?;
            let seq: i64 = row.try_get(1)?;
            let job_id: i64 = row.try_get(2)?;
            let error: Option<String> = row.try_get(3)?;
            let error = format!(
                "{}; the task's other jobs ended later without moving it on",
                error.unwrap_or_else(|| "no error recorded".to_owned())
            );
            let now = self.now();
            let mut tx = self.d.begin().await?;
            let current = match self.locked_task(&mut tx, task_id).await {
                Ok(current) => current,
                Err(e @ StoreError::CorruptRow { .. }) => {
                    // A maintenance pass over many tasks: one corrupt row is reported and
                    // left as it is, not allowed to stop the pass for every other task.
                    let _ = tx.rollback().await;
                    tracing::error!(error = %e, task = task_id, "a stranded task with a corrupt row is left as it is");
                    continue;
                }
                Err(e) => return Err(e),
            };
            let ended = current.is_some_and(|t| t.stage_seq == seq)
                && self
                    .fail_stranded_task(&mut tx, task_id, job_id, &error, now)
                    .await?;
            if ended {
                failed.push(task_id);
            }
            self.d.commit(tx, ended.then_some(Announce::NOW)).await?;
        }
        Ok(failed)
    }

    /// One retention batch: see [`crate::Store::prune_finished`].
    pub async fn prune_finished(&self, finished_before: Millis, limit: u32) -> Result<Pruned> {
        let now = self.now();
        let limit = i64::from(limit.max(1));
        let mut tx = self.d.begin().await?;
        D::lock_prune(&mut tx).await?;
        let mut ids: Vec<i64> = sqlx::query_scalar(self.sql.prune_task_jobs.as_str())
            .bind(finished_before)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let room = limit.saturating_sub(i64::try_from(ids.len()).unwrap_or(i64::MAX));
        if room > 0 {
            let taskless: Vec<i64> = sqlx::query_scalar(sql::PRUNE_TASKLESS_JOBS)
                .bind(finished_before)
                .bind(room)
                .fetch_all(&mut *tx)
                .await?;
            ids.extend(taskless);
        }
        let before: i64 = match sqlx::query_scalar::<_, String>(sql::LAST_PRUNE)
            .fetch_optional(&mut *tx)
            .await?
        {
            Some(data) => prune_total_of(&data)?,
            None => 0,
        };
        if ids.is_empty() {
            let _ = tx.rollback().await;
            return Ok(Pruned {
                jobs: 0,
                total: before,
            });
        }
        let jobs = u64::try_from(ids.len()).unwrap_or(u64::MAX);
        let total = before.saturating_add(i64::try_from(jobs).unwrap_or(i64::MAX));
        let event = prune_event(&ids, total, finished_before);
        Self::insert_event(&mut tx, &event, now).await?;
        self.d.commit(tx, None).await?;
        Ok(Pruned { jobs, total })
    }

    /// Every job retention has pruned so far (the latest `jobs.pruned` event's total).
    pub async fn pruned_total(&self) -> Result<i64> {
        match sqlx::query_scalar::<_, String>(sql::LAST_PRUNE)
            .fetch_optional(self.d.reader())
            .await?
        {
            Some(data) => prune_total_of(&data),
            None => Ok(0),
        }
    }

    pub async fn get_job(&self, job_id: i64) -> Result<Option<Job>> {
        Ok(sqlx::query_as(sql::JOB_BY_ID.as_str())
            .bind(job_id)
            .fetch_optional(self.d.reader())
            .await?)
    }

    pub async fn count_jobs(&self, q: &JobCount) -> Result<i64> {
        Ok(sqlx::query_scalar(D::COUNT_JOBS)
            .bind(q.task_id)
            .bind(&q.agent)
            .bind(&q.content_contains)
            .fetch_one(self.d.reader())
            .await?)
    }

    pub async fn task_jobs(&self, task_id: i64) -> Result<Vec<Job>> {
        Ok(sqlx::query_as(sql::TASK_JOBS.as_str())
            .bind(task_id)
            .fetch_all(self.d.reader())
            .await?)
    }

    pub async fn queue_stats(&self) -> Result<QueueStats> {
        let now = self.now();
        let mut conn = self.d.reader().acquire().await?;
        let finished_since = now.saturating_sub(crate::RECENT_WINDOW_MS);
        let mut counts = sqlx::query(sql::ACTIVE_JOB_COUNTS)
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .map(kind_count)
            .collect::<Result<Vec<_>>>()?;
        let recent = sql::with_since(&self.sql.recent_finished_job_counts, finished_since);
        for row in sqlx::raw_sql(sqlx::AssertSqlSafe(recent))
            .fetch_all(&mut *conn)
            .await?
        {
            counts.push(kind_count(row)?);
        }
        let counts = by_agent(counts);
        let oldest_ready_at: Option<i64> = sqlx::query_scalar(self.sql.oldest_ready.as_str())
            .bind(now)
            .fetch_optional(&mut *conn)
            .await?;
        let leases = sqlx::query(sql::LIVE_LEASES)
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .map(live_lease)
            .collect::<Result<Vec<_>>>()?;
        Ok(QueueStats {
            counts,
            oldest_ready_at,
            leases,
            now,
            finished_since,
        })
    }

    pub async fn count_all_jobs(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(sql::COUNT_ALL_JOBS)
            .fetch_one(self.d.reader())
            .await?)
    }

    pub async fn has_live_jobs(&self) -> Result<bool> {
        Ok(sqlx::query_scalar(sql::HAS_LIVE_JOBS)
            .fetch_one(self.d.reader())
            .await?)
    }

    // ----- tasks --------------------------------------------------------------------------

    pub async fn create_task(&self, new: NewTask) -> Result<Task> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        let work_item_id = match &new.work_item {
            WorkItemSpec::Exact(id) => id.clone(),
            WorkItemSpec::Next { prefix } => {
                D::lock_work_item_prefix(&mut tx, prefix.as_str()).await?;
                let max: Option<i64> = sqlx::query_scalar(D::MAX_WORK_ITEM_NUMBER)
                    .bind(prefix.as_str())
                    .fetch_one(&mut *tx)
                    .await?;
                let next = max
                    .unwrap_or(0)
                    .checked_add(1)
                    .and_then(|n| u64::try_from(n).ok())
                    .ok_or_else(|| {
                        StoreError::Invalid(format!(
                            "no work item number is left after {max:?} for prefix {prefix}"
                        ))
                    })?;
                WorkItemId::new(prefix, next).map_err(|e| StoreError::Invalid(e.to_string()))?
            }
        };
        let row: Option<TaskRow> = sqlx::query_as(sql::INSERT_TASK.as_str())
            .bind(work_item_id.as_str())
            .bind(new.repo.as_str())
            .bind(&new.title)
            .bind(&new.body)
            .bind(new.stage.as_str())
            .bind(format!("{}{}", new.branch_prefix, work_item_id))
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            return Err(StoreError::WorkItemTaken(work_item_id.to_string()));
        };
        let task = row.decode()?;
        let mut event = new.event;
        event.task_id = Some(task.id);
        event
            .stage
            .get_or_insert_with(|| task.stage.as_str().to_owned());
        Self::insert_event(&mut tx, &event, now).await?;
        let has_job = new.first_job.is_some();
        if let Some(mut job) = new.first_job {
            job.task_id = Some(task.id);
            job.dedupe_key
                .get_or_insert_with(|| stage_job_key(task.id, task.stage_seq));
            Self::insert_job(&mut tx, &job, now).await?;
        }
        self.d.commit(tx, has_job.then_some(Announce::NOW)).await?;
        Ok(task)
    }

    /// One task; a row that does not decode is a [`StoreError::CorruptRow`].
    pub async fn get_task(&self, task_id: i64) -> Result<Option<Task>> {
        sqlx::query_as::<_, TaskRow>(sql::TASK_BY_ID.as_str())
            .bind(task_id)
            .fetch_optional(self.d.reader())
            .await?
            .map(TaskRow::decode)
            .transpose()
    }

    /// One task; a row that does not decode is a [`StoreError::CorruptRow`].
    pub async fn get_task_by_work_item(&self, work_item_id: &str) -> Result<Option<Task>> {
        sqlx::query_as::<_, TaskRow>(sql::TASK_BY_WORK_ITEM.as_str())
            .bind(work_item_id)
            .fetch_optional(self.d.reader())
            .await?
            .map(TaskRow::decode)
            .transpose()
    }

    /// A page of tasks; a corrupt row is left out (see [`decode_listing`]), so a page may be
    /// shorter than the limit.
    pub async fn list_tasks(&self, filter: &TaskFilter) -> Result<Vec<Task>> {
        let rows: Vec<TaskRow> = sqlx::query_as(self.sql.list_tasks.as_str())
            .bind(&filter.stage)
            .bind(&filter.repo)
            .bind(i64::from(filter.limit.clamp(1, 1000)))
            .bind(i64::from(filter.offset))
            .fetch_all(self.d.reader())
            .await?;
        Ok(decode_listing(rows))
    }

    /// Task `task_id` locked for the transaction (`FOR UPDATE` on PostgreSQL), decoded; a
    /// corrupt row is a [`StoreError::CorruptRow`]: no stage change is made from a row whose
    /// names cannot be trusted.
    async fn locked_task(&self, conn: &mut Conn<D>, task_id: i64) -> Result<Option<Task>> {
        sqlx::query_as::<_, TaskRow>(self.sql.task_by_id_locked.as_str())
            .bind(task_id)
            .fetch_optional(&mut *conn)
            .await?
            .map(TaskRow::decode)
            .transpose()
    }

    pub async fn count_tasks_by_stage(&self) -> Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(sql::COUNT_TASKS_BY_STAGE)
            .fetch_all(self.d.reader())
            .await?)
    }

    /// Live tasks by stage (exact), then the tasks that ended since `since` by terminal stage.
    pub async fn active_tasks_by_stage(&self, since: Millis) -> Result<Vec<(String, i64)>> {
        let mut conn = self.d.reader().acquire().await?;
        let mut rows: Vec<(String, i64)> = sqlx::query_as(sql::LIVE_TASKS_BY_STAGE)
            .fetch_all(&mut *conn)
            .await?;
        let recent = sql::with_since(&self.sql.recently_ended_tasks_by_stage, since);
        let ended = sqlx::raw_sql(sqlx::AssertSqlSafe(recent))
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect::<Result<Vec<(String, i64)>>>()?;
        rows.extend(ended);
        rows.sort();
        Ok(rows)
    }

    /// The tasks that ended at or after `since`, oldest ending first (a corrupt row left out,
    /// see [`decode_listing`]).
    pub async fn tasks_ended_since(&self, since: Millis) -> Result<Vec<Task>> {
        let recent = sql::with_since(&self.sql.tasks_ended_since, since);
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(recent))
            .fetch_all(self.d.reader())
            .await?
            .iter()
            .map(|row| Ok(TaskRow::from_row(row)?))
            .collect::<Result<Vec<TaskRow>>>()?;
        Ok(decode_listing(rows))
    }

    /// Refreshes the planner's statistics of the four tables after a bulk load (PostgreSQL;
    /// nothing on SQLite, whose `ANALYZE` would add its `sqlite_stat1` table to the schema).
    pub async fn refresh_statistics(&self) -> Result<()> {
        if !D::ANALYZE_ALL.is_empty() {
            sqlx::raw_sql(D::ANALYZE_ALL)
                .execute(self.d.writer())
                .await?;
        }
        Ok(())
    }

    /// The bytes the store takes on disk: the SQLite file's pages (the write-ahead log's
    /// committed pages included); on PostgreSQL the four tables with their indexes and TOAST.
    pub async fn database_size(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(D::DATABASE_SIZE)
            .fetch_one(self.d.reader())
            .await?)
    }

    pub async fn advance_stage(
        &self,
        adv: AdvanceStage,
        exclusive: Option<&Exclusive>,
    ) -> Result<Advanced> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        let Some(current) = self.locked_task(&mut tx, adv.task_id).await? else {
            return Err(StoreError::TaskNotFound(adv.task_id.to_string()));
        };
        self.check_fence(&mut tx, &adv, &current).await?;
        if current.stage != adv.expected_stage {
            return Err(StoreError::StageConflict {
                task_id: current.id,
                expected: adv.expected_stage.into(),
                actual: current.stage.into(),
                actual_seq: current.stage_seq,
            });
        }
        if let Some(exclusive) = exclusive {
            D::lock_repo_track(&mut tx, current.repo.as_str()).await?;
            let stages = serde_json::to_string(&exclusive.stages)
                .map_err(|e| StoreError::Invalid(e.to_string()))?;
            let holder: Option<(String, String)> = sqlx::query_as(D::TRACK_HOLDER)
                .bind(current.repo.as_str())
                .bind(current.id)
                .bind(stages)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some((holder, stage)) = holder {
                return Err(StoreError::TrackBusy {
                    repo: current.repo.to_string(),
                    holder,
                    stage,
                });
            }
        }
        let task = Self::write_stage(&mut tx, &current, &adv.new_stage, adv.event, now).await?;
        let mut next_job_id = None;
        if let Some(mut job) = adv.next_job {
            job.task_id = Some(task.id);
            job.dedupe_key
                .get_or_insert_with(|| stage_job_key(task.id, task.stage_seq));
            next_job_id = Some(Self::insert_job(&mut tx, &job, now).await?.job_id);
        }
        let wake = next_job_id.is_some() || task.is_terminal();
        self.d.commit(tx, wake.then_some(Announce::NOW)).await?;
        Ok(Advanced { task, next_job_id })
    }

    pub async fn write_at_visit(
        &self,
        visit: Visit,
        job: Option<NewJob>,
        mut event: NewEvent,
    ) -> Result<Option<Enqueued>> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        let current = match self.locked_task(&mut tx, visit.task_id).await {
            Ok(current) => current,
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(e);
            }
        };
        let current = match current {
            Some(t) if t.stage == visit.stage && t.stage_seq == visit.stage_seq => t,
            other => {
                // Rolled back now: PostgreSQL would keep the task row locked meanwhile.
                let _ = tx.rollback().await;
                return Err(match other {
                    None => StoreError::TaskNotFound(visit.task_id.to_string()),
                    Some(t) => StoreError::StageConflict {
                        task_id: t.id,
                        expected: format!("{} (seq {})", visit.stage, visit.stage_seq),
                        actual: t.stage.into(),
                        actual_seq: t.stage_seq,
                    },
                });
            }
        };
        let mut wake = None;
        let mut enqueued = None;
        if let Some(mut job) = job {
            job.task_id = Some(current.id);
            job.dedupe_key
                .get_or_insert_with(|| stage_job_key(current.id, current.stage_seq));
            let out = Self::insert_job(&mut tx, &job, now).await?;
            if out.duplicate {
                // The visit's job exists: an earlier write made it, with its event.
                let _ = tx.rollback().await;
                return Ok(Some(out));
            }
            wake = Some(Announce {
                due_at: due_at(std::slice::from_ref(&job), now),
                now,
            });
            enqueued = Some(out);
        }
        event.task_id = Some(current.id);
        event.stage = Some(current.stage.as_str().to_owned());
        Self::insert_event(&mut tx, &event, now).await?;
        self.d.commit(tx, wake).await?;
        Ok(enqueued)
    }

    pub async fn track_holder(
        &self,
        repo: &str,
        task_id: i64,
        exclusive: &Exclusive,
    ) -> Result<Option<(String, String)>> {
        let stages = serde_json::to_string(&exclusive.stages)
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        Ok(sqlx::query_as(D::TRACK_HOLDER)
            .bind(repo)
            .bind(task_id)
            .bind(stages)
            .fetch_optional(self.d.reader())
            .await?)
    }

    // ----- events and agent runs ----------------------------------------------------------

    pub async fn append_event(&self, event: NewEvent) -> Result<i64> {
        let mut conn = self.d.writer().acquire().await?;
        Self::insert_event(&mut conn, &event, self.now()).await
    }

    /// [`Store::append_event`] on behalf of a running job: written only while `lease` still
    /// holds (the job is running in that attempt), else `StoreError::LeaseLost` and nothing is
    /// written. What a job's attempt records (a release held, a rollback, a deploy's result) is
    /// state later jobs act on: an attempt that lost its job must not leave it behind.
    pub async fn append_event_fenced(&self, lease: Lease, event: NewEvent) -> Result<i64> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        if let Err(e) = self.lock_running(&mut tx, lease).await {
            // Rolled back now, not when the dropped transaction's connection is next used:
            // PostgreSQL would keep the job row locked meanwhile, and a claim (`SKIP LOCKED`)
            // would pass the job over.
            let _ = tx.rollback().await;
            return Err(e);
        }
        let id = Self::insert_event(&mut tx, &event, now).await?;
        self.d.commit(tx, None).await?;
        Ok(id)
    }

    /// Test support (`orch_store::testing::start_job`): job `job_id` as a claim by `worker`
    /// would leave it, whatever its queue position or due time: running, its attempt bumped
    /// (kept when it is already running: a test re-running the same attempt), leased for
    /// `lease_ms`. Executors under test then hold a real lease, so their fenced writes are
    /// checked as in a worker.
    #[cfg(feature = "testing")]
    pub async fn start_job(&self, job_id: i64, worker: &str, lease_ms: i64) -> Result<Lease> {
        let now = self.now();
        let attempt: Option<i64> = sqlx::query_scalar(
            "UPDATE jobs SET attempt = CASE WHEN state = 'running' THEN attempt ELSE attempt + 1 END, \
             state = 'running', locked_by = $2, started_at = $3, lease_expires_at = $4 \
             WHERE id = $1 AND state IN ('queued', 'running') RETURNING attempt",
        )
        .bind(job_id)
        .bind(worker)
        .bind(now)
        .bind(now + lease_ms)
        .fetch_optional(self.d.writer())
        .await?;
        let attempt = attempt.ok_or(StoreError::JobNotFound(job_id))?;
        Ok(Lease { job_id, attempt })
    }

    pub async fn task_events(&self, task_id: i64) -> Result<Vec<Event>> {
        Ok(sqlx::query_as(sql::TASK_EVENTS.as_str())
            .bind(task_id)
            .fetch_all(self.d.reader())
            .await?)
    }

    pub async fn events_of_tasks(&self, task_ids: &[i64], kinds: &[&str]) -> Result<Vec<Event>> {
        let kinds = serde_json::to_string(kinds).map_err(|e| StoreError::Invalid(e.to_string()))?;
        let mut events = Vec::new();
        for ids in task_ids.chunks(EVENTS_OF_TASKS_CHUNK) {
            let ids = serde_json::to_string(ids).map_err(|e| StoreError::Invalid(e.to_string()))?;
            let chunk: Vec<Event> = sqlx::query_as(self.sql.events_of_tasks.as_str())
                .bind(ids)
                .bind(&kinds)
                .fetch_all(self.d.reader())
                .await?;
            events.extend(chunk);
        }
        Ok(events)
    }

    /// The tasks a report over `[since, until)` reads (`repo`: one repo's only): the live ones
    /// submitted before `until` and the ended ones that ended at or after `since` and were
    /// submitted before `until`. Two index reads (`tasks_live`, a range of `tasks_ended`),
    /// never the whole table; the range is written into the statements (see
    /// [`sql::with_since`]), the repo is bound.
    pub async fn tasks_alive_in(
        &self,
        since: Millis,
        until: Millis,
        repo: Option<&str>,
    ) -> Result<Vec<Task>> {
        let repo = repo.unwrap_or("");
        let mut conn = self.d.reader().acquire().await?;
        let mut tasks = Vec::new();
        for statement in [&self.sql.report_live_tasks, &self.sql.report_ended_tasks] {
            let text = sql::report_bounds(statement, since, until);
            let rows: Vec<TaskRow> = sqlx::query_as(sqlx::AssertSqlSafe(text))
                .bind(repo)
                .fetch_all(&mut *conn)
                .await?;
            tasks.extend(decode_listing(rows));
        }
        Ok(tasks)
    }

    /// Every live task of `repo` and its tasks that ended at or after `ended_since`
    /// ([`Db::tasks_alive_in`] with no upper bound): no cap.
    pub async fn tasks_followed(&self, repo: &str, ended_since: Millis) -> Result<Vec<Task>> {
        self.tasks_alive_in(ended_since, Millis::MAX, Some(repo))
            .await
    }

    /// `(task, newest event id)` of these tasks (those with events), one statement per
    /// [`EVENTS_OF_TASKS_CHUNK`] tasks: per task a `max(id)` subquery, the last entry of its
    /// `events_task` range ([`Driver::NEWEST_EVENT_IDS`]).
    pub async fn newest_event_ids(&self, task_ids: &[i64]) -> Result<Vec<(i64, i64)>> {
        let mut out = Vec::new();
        for ids in task_ids.chunks(EVENTS_OF_TASKS_CHUNK) {
            let ids = serde_json::to_string(ids).map_err(|e| StoreError::Invalid(e.to_string()))?;
            let chunk: Vec<(i64, i64)> = sqlx::query_as(self.sql.newest_event_ids.as_str())
                .bind(ids)
                .fetch_all(self.d.reader())
                .await?;
            out.extend(chunk);
        }
        Ok(out)
    }

    /// The agent runs of these tasks, by task then oldest first; one statement per
    /// [`EVENTS_OF_TASKS_CHUNK`] tasks (the index `agent_runs_task`).
    pub async fn agent_runs_of_tasks(&self, task_ids: &[i64]) -> Result<Vec<AgentRun>> {
        let mut runs = Vec::new();
        for ids in task_ids.chunks(EVENTS_OF_TASKS_CHUNK) {
            let ids = serde_json::to_string(ids).map_err(|e| StoreError::Invalid(e.to_string()))?;
            let chunk: Vec<AgentRun> = sqlx::query_as(self.sql.agent_runs_of_tasks.as_str())
                .bind(ids)
                .fetch_all(self.d.reader())
                .await?;
            runs.extend(chunk);
        }
        Ok(runs)
    }

    pub async fn events_by_kind(
        &self,
        kind: &str,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<Event>> {
        if let Some(statement) = sql::events_by_kind_literal(kind, after_id, i64::from(limit)) {
            return sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                .fetch_all(self.d.reader())
                .await?
                .iter()
                .map(|row| Ok(Event::from_row(row)?))
                .collect();
        }
        Ok(sqlx::query_as(sql::EVENTS_BY_KIND.as_str())
            .bind(kind)
            .bind(after_id)
            .bind(i64::from(limit))
            .fetch_all(self.d.reader())
            .await?)
    }

    pub async fn start_agent_run(&self, run: NewAgentRun) -> Result<i64> {
        Ok(sqlx::query_scalar(sql::INSERT_AGENT_RUN)
            .bind(run.task_id)
            .bind(run.job_id)
            .bind(&run.stage)
            .bind(&run.agent)
            .bind(&run.backend)
            .bind(&run.model)
            .bind(run.attempt)
            .bind(self.now())
            .fetch_one(self.d.writer())
            .await?)
    }

    pub async fn finish_agent_run(&self, run_id: i64, f: AgentRunFinish) -> Result<()> {
        let res = sqlx::query(sql::FINISH_AGENT_RUN)
            .bind(run_id)
            .bind(self.now())
            .bind(&f.outcome)
            .bind(f.exit_code)
            .bind(f.input_tokens)
            .bind(f.output_tokens)
            .bind(f.cost_usd)
            .bind(&f.error)
            .bind(json_or_empty(&f.data))
            .execute(self.d.writer())
            .await?;
        if D::rows_affected(&res) == 0 {
            return Err(StoreError::Invalid(format!("agent run {run_id} not found")));
        }
        Ok(())
    }

    pub async fn task_agent_runs(&self, task_id: i64) -> Result<Vec<AgentRun>> {
        Ok(sqlx::query_as(sql::TASK_AGENT_RUNS.as_str())
            .bind(task_id)
            .fetch_all(self.d.reader())
            .await?)
    }

    pub async fn task_usage(&self, task_id: i64) -> Result<Usage> {
        let row = sqlx::query(sql::TASK_USAGE)
            .bind(task_id)
            .fetch_one(self.d.reader())
            .await?;
        usage(&row, 0)
    }

    pub async fn usage_by_agent(&self) -> Result<Vec<(String, Usage)>> {
        sqlx::query(sql::USAGE_BY_AGENT)
            .fetch_all(self.d.reader())
            .await?
            .iter()
            .map(|row| Ok((row.try_get(0)?, usage(row, 1)?)))
            .collect()
    }

    /// Usage of every agent run by repo, stage and UTC day, sorted by day, repo, stage.
    pub async fn usage_by_repo_stage_day(&self) -> Result<Vec<UsageRow>> {
        sqlx::query(sql::USAGE_BY_REPO_STAGE_DAY)
            .fetch_all(self.d.reader())
            .await?
            .iter()
            .map(|row| {
                Ok(UsageRow {
                    repo: row.try_get(0)?,
                    stage: row.try_get(1)?,
                    day: row.try_get(2)?,
                    usage: usage(row, 3)?,
                })
            })
            .collect()
    }

    /// How many agent runs each agent had, by outcome, sorted.
    pub async fn runs_by_agent_outcome(&self) -> Result<Vec<(String, String, i64)>> {
        Ok(sqlx::query_as(sql::RUNS_BY_AGENT_OUTCOME)
            .fetch_all(self.d.reader())
            .await?)
    }

    // ----- steps shared by the operations above (and by the drivers' own) -----------------

    /// After a bulk insert of many jobs: the planner's row estimates stay stale until
    /// autovacuum (or nothing, on SQLite) gets to them, and with stale estimates the claim
    /// walks the `(state, agent)` index and sorts every queued row instead of reading the head
    /// of `jobs_ready` (measured on PostgreSQL: 8–19 ms instead of ~0.1 ms per claim at 10,000
    /// queued jobs). Refreshes them; best effort.
    pub(crate) async fn refresh_job_statistics(&self, inserted: u64) {
        const BULK_ANALYZE_ROWS: u64 = 1_000;
        if inserted < BULK_ANALYZE_ROWS {
            return;
        }
        if let Err(e) = sqlx::query("ANALYZE jobs").execute(self.d.writer()).await {
            tracing::warn!(error = %e, "could not refresh the jobs table's statistics after a bulk enqueue");
        }
    }

    /// Inserts a job, or finds the one that already carries its dedupe key.
    pub(crate) async fn insert_job(
        conn: &mut Conn<D>,
        job: &NewJob,
        now: Millis,
    ) -> Result<Enqueued> {
        let id: Option<i64> = sqlx::query_scalar(sql::INSERT_JOB)
            .bind(job.task_id)
            .bind(&job.agent)
            .bind(&job.task_content)
            .bind(job.priority)
            .bind(job.max_attempts)
            .bind(now.saturating_add(job.delay_ms))
            .bind(&job.dedupe_key)
            .bind(&job.node)
            .bind(now)
            .fetch_optional(&mut *conn)
            .await?;
        match id {
            Some(job_id) => Ok(Enqueued {
                job_id,
                duplicate: false,
            }),
            None => {
                let job_id: i64 = sqlx::query_scalar(sql::JOB_ID_BY_DEDUPE)
                    .bind(&job.dedupe_key)
                    .fetch_one(&mut *conn)
                    .await?;
                Ok(Enqueued {
                    job_id,
                    duplicate: true,
                })
            }
        }
    }

    pub(crate) async fn insert_event(conn: &mut Conn<D>, e: &NewEvent, now: Millis) -> Result<i64> {
        Ok(sqlx::query_scalar(sql::INSERT_EVENT)
            .bind(e.task_id)
            .bind(e.job_id)
            .bind(&e.kind)
            .bind(&e.stage)
            .bind(&e.message)
            .bind(json_or_empty(&e.data))
            .bind(now)
            .fetch_one(&mut *conn)
            .await?)
    }

    /// The fence of `advance_stage`: the caller's job lease, or the operator's `stage_seq`.
    async fn check_fence(
        &self,
        conn: &mut Conn<D>,
        adv: &AdvanceStage,
        current: &Task,
    ) -> Result<()> {
        match adv.fence {
            Fence::Seq(seq) if seq != current.stage_seq => Err(StoreError::StageConflict {
                task_id: current.id,
                expected: format!("{} (seq {seq})", adv.expected_stage),
                actual: current.stage.to_string(),
                actual_seq: current.stage_seq,
            }),
            Fence::Seq(_) => Ok(()),
            Fence::Job(lease) => {
                let job = self.lock_running(conn, lease).await?;
                if job.task_id != Some(current.id) {
                    return Err(StoreError::Invalid(format!(
                        "job {} does not belong to task {}",
                        lease.job_id, current.id
                    )));
                }
                Ok(())
            }
        }
    }

    /// The fence of every change to a running job: locks the job's row (until the transaction
    /// ends) and checks that `lease` still holds it — the job is running under the lease's
    /// attempt. Anything else is `LeaseLost` naming what the job is now.
    async fn lock_running(&self, conn: &mut Conn<D>, lease: Lease) -> Result<RunningJob> {
        let row = sqlx::query(self.sql.job_locked.as_str())
            .bind(lease.job_id)
            .fetch_optional(&mut *conn)
            .await?;
        let Some(row) = row else {
            return Err(StoreError::JobNotFound(lease.job_id));
        };
        let state: String = row.try_get(0)?;
        let attempt: i64 = row.try_get(1)?;
        if state != "running" || attempt != lease.attempt {
            return Err(lease_lost(lease, &state, attempt));
        }
        Ok(RunningJob {
            max_attempts: row.try_get(2)?,
            task_id: row.try_get(3)?,
        })
    }

    /// A task whose last live job failed would be stranded: move it to `failed`, with an event
    /// that names the job and its error. Returns true when the task was failed.
    async fn fail_stranded_task(
        &self,
        conn: &mut Conn<D>,
        task_id: i64,
        job_id: i64,
        error: &str,
        now: Millis,
    ) -> Result<bool> {
        let live: i64 = sqlx::query_scalar(sql::LIVE_JOBS_OF_TASK)
            .bind(task_id)
            .fetch_one(&mut *conn)
            .await?;
        if live > 0 {
            return Ok(false);
        }
        let current = match self.locked_task(conn, task_id).await {
            Ok(Some(current)) => current,
            Ok(None) => return Ok(false),
            Err(e @ StoreError::CorruptRow { .. }) => {
                // The job's own failure is still written (the caller's transaction goes on):
                // a corrupt task row must not stop a job's completion nor a rescue pass over
                // every other job. The task is left as it is for an operator: no stage change
                // is made from a row whose names cannot be trusted.
                tracing::error!(error = %e, job = job_id, "the task of a job failed for good has a corrupt row: left as it is");
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        if current.is_terminal() {
            return Ok(false);
        }
        let event = stranded_event(&current, job_id, error);
        Self::write_stage(conn, &current, &StageName::failed(), event, now).await?;
        Ok(true)
    }

    /// The one statement that writes `tasks.stage` (a compare-and-swap on the stage and its
    /// `stage_seq`), with its event. `advance_stage` and the stranded-task failure both go
    /// through it, so every stage change bumps `stage_seq` and leaves its event the same way.
    async fn write_stage(
        conn: &mut Conn<D>,
        current: &Task,
        new_stage: &StageName,
        mut event: NewEvent,
        now: Millis,
    ) -> Result<Task> {
        let row: TaskRow = sqlx::query_as(sql::ADVANCE_TASK.as_str())
            .bind(current.id)
            .bind(new_stage.as_str())
            .bind(now)
            .bind(current.stage.as_str())
            .bind(current.stage_seq)
            .fetch_optional(&mut *conn)
            .await?
            .ok_or_else(|| StoreError::StageConflict {
                task_id: current.id,
                expected: format!("{} (seq {})", current.stage, current.stage_seq),
                actual: "changed concurrently".into(),
                actual_seq: current.stage_seq,
            })?;
        let task = row.decode()?;
        event.task_id = Some(task.id);
        event.stage = Some(task.stage.as_str().to_owned());
        Self::insert_event(conn, &event, now).await?;
        if task.is_terminal() {
            // Whatever ended the task, its ending is announced and its trail published by a
            // job enqueued with the stage change: none is missed, whichever process dies.
            Self::insert_job(conn, &task_ended_job(&task), now).await?;
        }
        Ok(task)
    }
}
