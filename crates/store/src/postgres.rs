//! The PostgreSQL driver: the shared engine for many `orch worker` processes on many machines.
//! Claims use `FOR UPDATE SKIP LOCKED`; completing finished jobs and claiming the next ones is
//! one statement; new jobs are announced with NOTIFY on the channel [`CHANNEL`], and a listener
//! task turns notifications into wake-ups (bumping them after every reconnect, because
//! notifications sent while disconnected are lost).

use std::str::FromStr;
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions};
use sqlx::{FromRow, Row};
use tokio::sync::watch;

use crate::common::*;
use crate::error::{Result, StoreError, redact_url};
use crate::migrate::{self, MIGRATED_KIND, MigrateReport};
use crate::model::*;
use crate::sql::{self, JOB_COLUMNS};
use crate::{Clock, ConnectOptions, stage_job_key};

/// The NOTIFY channel that announces new or re-queued jobs.
pub const CHANNEL: &str = "orch_jobs";

/// Serializes concurrent `migrate` calls across processes.
const MIGRATE_LOCK: i64 = 0x006f_7263_686d_6967; // "orchmig"

#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    target: String,
    clock: Arc<dyn Clock>,
    wake: Arc<watch::Sender<u64>>,
    listener: Arc<OnceLock<()>>,
}

/// Marks leases done and claims new jobs in one statement. The shapes are chosen for the
/// generic plan every connection runs (see `connect_with`): both updates reach their rows by
/// primary key (the completions join from their array; the claim takes `id = ANY(…)`), and the
/// pick walks `jobs_ready` in its order, whatever the parameters. `(state = 'running') IS TRUE`
/// is deliberately not indexable: as a plain condition the planner walked every running row
/// through `jobs_state_agent` instead (5,000 completions with 87,000 jobs running: seconds per
/// statement).
/// `plan_shapes_hold_under_generic_plans` checks the plan.
static COMPLETE_AND_CLAIM: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH done AS ( \
            UPDATE jobs j SET state = 'done', finished_at = $1, lease_expires_at = NULL \
            FROM UNNEST($2::bigint[], $3::bigint[]) AS c(id, attempt) \
            WHERE j.id = c.id AND j.attempt = c.attempt AND (j.state = 'running') IS TRUE \
            RETURNING j.id \
         ), claimed AS ( \
            UPDATE jobs j SET state = 'running', attempt = j.attempt + 1, \
                lease_expires_at = $1 + $7, locked_by = $8, started_at = $1 \
            WHERE j.id = ANY(ARRAY( \
                SELECT id FROM jobs \
                WHERE state = 'queued' AND available_at <= $1 \
                  AND (cardinality($5::text[]) = 0 OR agent = ANY($5::text[])) \
                  AND (node IS NULL OR node = $6::text) \
                ORDER BY priority DESC, available_at, id \
                LIMIT $4 \
                FOR UPDATE SKIP LOCKED)) \
            RETURNING {cols} \
         ) \
         SELECT d.done_ids, c.* \
         FROM (SELECT coalesce(array_agg(id), '{{}}'::bigint[]) AS done_ids FROM done) d \
         LEFT JOIN claimed c ON true",
        cols = JOB_COLUMNS
            .split(", ")
            .map(|c| format!("j.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ")
    )
});

/// The claim statement's text, for the plan-shape test.
#[doc(hidden)]
pub fn complete_and_claim_sql() -> &'static str {
    COMPLETE_AND_CLAIM.as_str()
}

static JOB_BY_ID: LazyLock<String> = LazyLock::new(|| sql::select_jobs("WHERE id = $1"));
static TASK_JOBS: LazyLock<String> =
    LazyLock::new(|| sql::select_jobs("WHERE task_id = $1 ORDER BY id"));
static TASK_BY_ID: LazyLock<String> = LazyLock::new(|| sql::select_tasks("WHERE id = $1"));
static TASK_BY_ID_FOR_UPDATE: LazyLock<String> =
    LazyLock::new(|| sql::select_tasks("WHERE id = $1 FOR UPDATE"));
static TASK_BY_WORK_ITEM: LazyLock<String> =
    LazyLock::new(|| sql::select_tasks("WHERE work_item_id = $1"));
static LIST_TASKS: LazyLock<String> = LazyLock::new(|| {
    sql::select_tasks(
        "WHERE ($1::text IS NULL OR stage = $1::text) AND ($2::text IS NULL OR repo = $2::text) \
         ORDER BY id DESC LIMIT $3 OFFSET $4",
    )
});
static INSERT_TASK: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO tasks (work_item_id, repo, title, body, stage, stage_seq, branch, \
         created_at, updated_at) VALUES ($1, $2, $3, $4, $5, 0, $6, $7, $7) \
         ON CONFLICT (work_item_id) DO NOTHING RETURNING {}",
        sql::TASK_COLUMNS
    )
});
static ADVANCE_TASK: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE tasks SET stage = $2, stage_seq = stage_seq + 1, updated_at = $3 \
         WHERE id = $1 AND stage = $4 AND stage_seq = $5 RETURNING {}",
        sql::TASK_COLUMNS
    )
});
static TASK_EVENTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM events WHERE task_id = $1 ORDER BY id",
        sql::EVENT_COLUMNS
    )
});
static EVENTS_BY_KIND: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM events WHERE kind = $1 AND id > $2 ORDER BY id LIMIT $3",
        sql::EVENT_COLUMNS
    )
});
static TASK_AGENT_RUNS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM agent_runs WHERE task_id = $1 ORDER BY id",
        sql::AGENT_RUN_COLUMNS
    )
});

impl PgStore {
    pub async fn connect(url: &str, opts: ConnectOptions) -> Result<PgStore> {
        let target = redact_url(url);
        let conn_opts = PgConnectOptions::from_str(url).map_err(|e| StoreError::BadUrl {
            url: target.clone(),
            reason: e.to_string(),
        })?;
        PgStore::connect_with(conn_opts, target, opts).await
    }

    /// Connects with explicit options (tests use this to pin a `search_path`).
    pub async fn connect_with(
        conn_opts: PgConnectOptions,
        target: String,
        opts: ConnectOptions,
    ) -> Result<PgStore> {
        // Every statement here is prepared once per connection and run with parameters. Left to
        // itself PostgreSQL keeps re-planning the claim on every execution (its `LIMIT $n`
        // makes each custom plan look far cheaper than the generic one), and planning was a
        // third of the database's CPU in the per-job drain (perf, 2026-11-30). Our statements
        // are key lookups and ordered index walks whose generic plans are the custom ones.
        let conn_opts = conn_opts.options([("plan_cache_mode", "force_generic_plan")]);
        let pool = PgPoolOptions::new()
            .max_connections(opts.max_connections.max(2))
            .acquire_timeout(opts.connect_timeout)
            .connect_with(conn_opts)
            .await
            .map_err(|e| StoreError::Connect {
                target: target.clone(),
                reason: describe_connect_error(&e),
            })?;
        let (wake, _) = watch::channel(0);
        Ok(PgStore {
            pool,
            target,
            clock: opts.clock,
            wake: Arc::new(wake),
            listener: Arc::new(OnceLock::new()),
        })
    }

    pub fn target(&self) -> String {
        self.target.clone()
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Starts the LISTEN task on first use.
    pub fn wakeups(&self) -> watch::Receiver<u64> {
        let rx = self.wake.subscribe();
        self.listener.get_or_init(|| {
            tokio::spawn(listen(self.pool.clone(), Arc::downgrade(&self.wake)));
        });
        rx
    }

    fn now(&self) -> Millis {
        self.clock.now_ms()
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }

    // ----- schema -------------------------------------------------------------------------

    pub async fn schema_version(&self) -> Result<i64> {
        let mut conn = self.pool.acquire().await?;
        read_version(&mut conn).await
    }

    pub async fn migrate(&self) -> Result<MigrateReport> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
        let from = read_version(&mut tx).await?;
        let pending = migrate::pending(migrate::POSTGRES, &self.target, from)?;
        let mut applied = Vec::new();
        for m in &pending {
            sqlx::raw_sql(m.sql).execute(&mut *tx).await?;
            sqlx::query(sql::INSERT_EVENT)
                .bind(None::<i64>)
                .bind(None::<i64>)
                .bind(MIGRATED_KIND)
                .bind(None::<String>)
                .bind(format!("applied schema migration {}", m.name))
                .bind(migrate::event_data(m))
                .bind(self.now())
                .execute(&mut *tx)
                .await?;
            applied.push(m.name.to_owned());
        }
        tx.commit().await?;
        Ok(MigrateReport {
            from,
            to: pending.last().map_or(from, |m| m.version),
            applied,
        })
    }

    pub async fn schema_dump(&self) -> Result<String> {
        let mut out = String::new();
        let cols = sqlx::query(
            "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text, \
                    coalesce(column_default::text, '') \
             FROM information_schema.columns WHERE table_schema = current_schema() \
             ORDER BY table_name, ordinal_position",
        )
        .fetch_all(&self.pool)
        .await?;
        for row in cols {
            let (table, column, ty, nullable, default): (String, String, String, String, String) = (
                row.try_get(0)?,
                row.try_get(1)?,
                row.try_get(2)?,
                row.try_get(3)?,
                row.try_get(4)?,
            );
            let default = if default.starts_with("nextval(") {
                "serial".to_owned()
            } else {
                default
            };
            out.push_str(&format!(
                "column {table}.{column} {ty} null={nullable} default={default}\n"
            ));
        }
        let idx = sqlx::query(
            "SELECT indexdef::text FROM pg_indexes WHERE schemaname = current_schema() \
             ORDER BY tablename, indexname",
        )
        .fetch_all(&self.pool)
        .await?;
        for row in idx {
            let def: String = row.try_get(0)?;
            // The schema name differs between databases and test schemas; drop it.
            let def = def.replace(&format!("{}.", current_schema(&self.pool).await?), "");
            out.push_str(&def);
            out.push('\n');
        }
        Ok(out)
    }

    // ----- jobs ---------------------------------------------------------------------------

    pub async fn enqueue(&self, job: NewJob) -> Result<Enqueued> {
        let mut tx = self.pool.begin().await?;
        let out = insert_job(&mut tx, &job, self.now()).await?;
        if !out.duplicate {
            notify(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(out)
    }

    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<u64> {
        const BULK_ANALYZE_ROWS: u64 = 1_000;
        let now = self.now();
        let mut tx = self.pool.begin().await?;
        let mut inserted = 0;
        for chunk in jobs.chunks(10_000) {
            let mut task_ids = Vec::with_capacity(chunk.len());
            let mut agents = Vec::with_capacity(chunk.len());
            let mut contents = Vec::with_capacity(chunk.len());
            let mut priorities = Vec::with_capacity(chunk.len());
            let mut max_attempts = Vec::with_capacity(chunk.len());
            let mut available = Vec::with_capacity(chunk.len());
            let mut dedupe = Vec::with_capacity(chunk.len());
            let mut nodes = Vec::with_capacity(chunk.len());
            for j in chunk {
                task_ids.push(j.task_id);
                agents.push(j.agent.as_str());
                contents.push(j.task_content.as_str());
                priorities.push(j.priority);
                max_attempts.push(j.max_attempts);
                available.push(now.saturating_add(j.delay_ms));
                dedupe.push(j.dedupe_key.as_deref());
                nodes.push(j.node.as_deref());
            }
            inserted += sqlx::query(
                "INSERT INTO jobs (task_id, agent, task_content, state, priority, attempt, \
                    max_attempts, available_at, dedupe_key, node, created_at) \
                 SELECT t, a, c, 'queued', p, 0, m, av, d, n, $9 \
                 FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], \
                             $6::bigint[], $7::text[], $8::text[]) AS u(t, a, c, p, m, av, d, n) \
                 ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING",
            )
            .bind(&task_ids)
            .bind(&agents)
            .bind(&contents)
            .bind(&priorities)
            .bind(&max_attempts)
            .bind(&available)
            .bind(&dedupe)
            .bind(&nodes)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        }
        if inserted > 0 {
            notify(&mut tx).await?;
        }
        tx.commit().await?;
        if inserted >= BULK_ANALYZE_ROWS {
            // A bulk insert makes the planner's row estimates stale until autovacuum gets to
            // it; with stale estimates the claim walks the (state, agent) index and sorts every
            // queued row instead of reading the head of `jobs_ready` (measured: 8–19 ms instead
            // of ~0.1 ms per claim at 10,000 queued jobs). Refresh them now; best effort.
            if let Err(e) = sqlx::query("ANALYZE jobs").execute(&self.pool).await {
                tracing::warn!(error = %e, "could not refresh the jobs table's statistics after a bulk enqueue");
            }
        }
        Ok(inserted)
    }

    pub async fn complete_and_claim(
        &self,
        done: &[Lease],
        claim: Option<&Claim>,
    ) -> Result<CompleteAndClaim> {
        let now = self.now();
        let ids: Vec<i64> = done.iter().map(|l| l.job_id).collect();
        let attempts: Vec<i64> = done.iter().map(|l| l.attempt).collect();
        let no_kinds: Vec<String> = Vec::new();
        let rows = sqlx::query(COMPLETE_AND_CLAIM.as_str())
            .bind(now)
            .bind(&ids)
            .bind(&attempts)
            .bind(claim.map_or(0, |c| i64::from(c.limit)))
            .bind(claim.map_or(&no_kinds, |c| &c.kinds))
            .bind(claim.and_then(|c| c.node.as_deref()))
            .bind(claim.map_or(0, |c| c.lease_ms))
            .bind(claim.map_or("", |c| c.worker_id.as_str()))
            .fetch_all(&self.pool)
            .await?;
        let mut out = CompleteAndClaim::default();
        let mut done_ids: Vec<i64> = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            if i == 0 {
                done_ids = row.try_get("done_ids")?;
            }
            let id: Option<i64> = row.try_get("id")?;
            if id.is_some() {
                let job = Job::from_row(row)?;
                out.claimed.push(ClaimedJob {
                    lease: Lease {
                        job_id: job.id,
                        attempt: job.attempt,
                    },
                    job,
                });
            }
        }
        out.claimed
            .sort_by_key(|c| (-c.job.priority, c.job.available_at, c.job.id));
        out.fenced = done
            .iter()
            .filter(|l| !done_ids.contains(&l.job_id))
            .copied()
            .collect();
        Ok(out)
    }

    pub async fn heartbeat(
        &self,
        worker_id: &str,
        leases: &[Lease],
        lease_ms: i64,
    ) -> Result<Vec<Lease>> {
        let ids: Vec<i64> = leases.iter().map(|l| l.job_id).collect();
        let attempts: Vec<i64> = leases.iter().map(|l| l.attempt).collect();
        let kept: Vec<i64> = sqlx::query_scalar(
            // Rows by primary key, joined from the array; the state test is not indexable (see
            // COMPLETE_AND_CLAIM).
            "UPDATE jobs j SET lease_expires_at = $1 \
             FROM UNNEST($2::bigint[], $3::bigint[]) AS c(id, attempt) \
             WHERE j.id = c.id AND j.attempt = c.attempt AND (j.state = 'running') IS TRUE \
               AND j.locked_by = $4 \
             RETURNING j.id",
        )
        .bind(self.now() + lease_ms)
        .bind(&ids)
        .bind(&attempts)
        .bind(worker_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(leases
            .iter()
            .filter(|l| !kept.contains(&l.job_id))
            .copied()
            .collect())
    }

    pub async fn mark_job(
        &self,
        lease: Lease,
        outcome: JobOutcome,
        event: Option<NewEvent>,
    ) -> Result<()> {
        let now = self.now();
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(
            "SELECT state, attempt, max_attempts, task_id FROM jobs WHERE id = $1 FOR UPDATE",
        )
        .bind(lease.job_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Err(StoreError::JobNotFound(lease.job_id));
        };
        let state: String = row.try_get(0)?;
        let attempt: i64 = row.try_get(1)?;
        let max_attempts: i64 = row.try_get(2)?;
        let task_id: Option<i64> = row.try_get(3)?;
        if state != "running" || attempt != lease.attempt {
            return Err(lease_lost(lease, &state, attempt));
        }
        let outcome = retry_or_fail(outcome, attempt, max_attempts);
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
                notify(&mut tx).await?;
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
                    fail_stranded_task(&mut tx, task_id, lease.job_id, error, now).await?;
                }
            }
        }
        if let Some(event) = event {
            insert_event(&mut tx, &event, now).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn release(&self, leases: &[Lease]) -> Result<u64> {
        let now = self.now();
        let mut tx = self.pool.begin().await?;
        let mut released = 0;
        for lease in leases {
            released += sqlx::query(sql::RELEASE)
                .bind(lease.job_id)
                .bind(lease.attempt)
                .bind(now)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
        if released > 0 {
            notify(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(released)
    }

    pub async fn rescue_expired(&self, rescue: Rescue) -> Result<RescueReport> {
        let now = self.now();
        let mut tx = self.pool.begin().await?;
        let expired = sqlx::query(
            "SELECT id, attempt, max_attempts, task_id, locked_by FROM jobs \
             WHERE state = 'running' AND lease_expires_at < $1 \
             ORDER BY lease_expires_at, id LIMIT $2 \
             FOR UPDATE SKIP LOCKED",
        )
        .bind(now)
        .bind(i64::from(rescue.limit))
        .fetch_all(&mut *tx)
        .await?;
        let mut report = RescueReport::default();
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
            insert_event(&mut tx, &plan.event, now).await?;
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
                    && fail_stranded_task(&mut tx, task_id, id, &plan.error, now).await?
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
            }
        }
        if !report.requeued.is_empty() {
            notify(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(report)
    }

    pub async fn cancel_job(&self, job_id: i64) -> Result<bool> {
        let res = sqlx::query(sql::CANCEL_JOB)
            .bind(job_id)
            .bind(self.now())
            .execute(&self.pool)
            .await?;
        if res.rows_affected() == 0 && self.get_job(job_id).await?.is_none() {
            return Err(StoreError::JobNotFound(job_id));
        }
        Ok(res.rows_affected() > 0)
    }

    pub async fn cancel_task_jobs(&self, task_id: i64, keep: Option<i64>) -> Result<u64> {
        let res = sqlx::query(sql::CANCEL_TASK_JOBS)
            .bind(task_id)
            .bind(keep.unwrap_or(-1))
            .bind(self.now())
            .execute(&self.pool)
            .await?;
        Ok(res.rows_affected())
    }

    pub async fn cleanup_finished(&self, older_than: Millis, limit: u32) -> Result<u64> {
        let res = sqlx::query(
            "DELETE FROM jobs WHERE id IN (SELECT j.id FROM jobs j LEFT JOIN tasks t ON t.id = j.task_id \
             WHERE j.state IN ('done', 'failed', 'cancelled') AND j.finished_at < $1 \
             AND (j.task_id IS NULL OR t.stage IN ('done', 'failed', 'cancelled')) LIMIT $2)",
        )
        .bind(older_than)
        .bind(i64::from(limit))
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected())
    }

    pub async fn next_available_at(
        &self,
        kinds: &[String],
        node: Option<&str>,
    ) -> Result<Option<Millis>> {
        Ok(sqlx::query_scalar(
            "SELECT min(available_at) FROM jobs WHERE state = 'queued' \
             AND (cardinality($1::text[]) = 0 OR agent = ANY($1::text[])) \
             AND (node IS NULL OR node = $2::text)",
        )
        .bind(kinds)
        .bind(node)
        .fetch_one(&self.pool)
        .await?)
    }

    pub async fn get_job(&self, job_id: i64) -> Result<Option<Job>> {
        Ok(sqlx::query_as(JOB_BY_ID.as_str())
            .bind(job_id)
            .fetch_optional(&self.pool)
            .await?)
    }

    pub async fn count_jobs(&self, q: &JobCount) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM jobs WHERE task_id = $1 AND agent = $2 \
             AND ($3::text IS NULL OR strpos(task_content, $3::text) > 0)",
        )
        .bind(q.task_id)
        .bind(&q.agent)
        .bind(&q.content_contains)
        .fetch_one(&self.pool)
        .await?)
    }

    pub async fn task_jobs(&self, task_id: i64) -> Result<Vec<Job>> {
        Ok(sqlx::query_as(TASK_JOBS.as_str())
            .bind(task_id)
            .fetch_all(&self.pool)
            .await?)
    }

    pub async fn queue_stats(&self) -> Result<QueueStats> {
        let now = self.now();
        let mut conn = self.pool.acquire().await?;
        let counts = sqlx::query(sql::QUEUE_COUNTS)
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .map(kind_count)
            .collect::<Result<Vec<_>>>()?;
        let counts = by_agent(counts);
        let oldest_ready_at: Option<i64> = sqlx::query_scalar(sql::OLDEST_READY)
            .bind(now)
            .fetch_one(&mut *conn)
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
        })
    }

    // ----- tasks --------------------------------------------------------------------------

    pub async fn create_task(&self, new: NewTask) -> Result<Task> {
        let now = self.now();
        let mut tx = self.pool.begin().await?;
        let work_item_id = match &new.work_item {
            WorkItemSpec::Exact(id) => id.clone(),
            WorkItemSpec::Next { prefix } => {
                check_prefix(prefix)?;
                // One allocator per prefix at a time, across every process.
                sqlx::query(
                    "SELECT pg_advisory_xact_lock(hashtext('orch.work_item:' || $1::text))",
                )
                .bind(prefix)
                .execute(&mut *tx)
                .await?;
                let max: Option<i64> = sqlx::query_scalar(
                    "SELECT max(CAST(substr(work_item_id, length($1::text) + 2) AS BIGINT)) \
                     FROM tasks WHERE substr(work_item_id, 1, length($1::text) + 1) = $1::text || '-' \
                     AND substr(work_item_id, length($1::text) + 2) ~ '^[0-9]{1,18}$'",
                )
                .bind(prefix)
                .fetch_one(&mut *tx)
                .await?;
                format!("{prefix}-{}", max.unwrap_or(0) + 1)
            }
        };
        let task: Option<Task> = sqlx::query_as(INSERT_TASK.as_str())
            .bind(&work_item_id)
            .bind(&new.repo)
            .bind(&new.title)
            .bind(&new.body)
            .bind(&new.stage)
            .bind(format!("{}{}", new.branch_prefix, work_item_id))
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(task) = task else {
            return Err(StoreError::WorkItemTaken(work_item_id));
        };
        let mut event = new.event;
        event.task_id = Some(task.id);
        event.stage.get_or_insert_with(|| task.stage.clone());
        insert_event(&mut tx, &event, now).await?;
        if let Some(mut job) = new.first_job {
            job.task_id = Some(task.id);
            job.dedupe_key
                .get_or_insert_with(|| stage_job_key(task.id, task.stage_seq));
            insert_job(&mut tx, &job, now).await?;
            notify(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(task)
    }

    pub async fn get_task(&self, task_id: i64) -> Result<Option<Task>> {
        Ok(sqlx::query_as(TASK_BY_ID.as_str())
            .bind(task_id)
            .fetch_optional(&self.pool)
            .await?)
    }

    pub async fn get_task_by_work_item(&self, work_item_id: &str) -> Result<Option<Task>> {
        Ok(sqlx::query_as(TASK_BY_WORK_ITEM.as_str())
            .bind(work_item_id)
            .fetch_optional(&self.pool)
            .await?)
    }

    pub async fn list_tasks(&self, filter: &TaskFilter) -> Result<Vec<Task>> {
        Ok(sqlx::query_as(LIST_TASKS.as_str())
            .bind(&filter.stage)
            .bind(&filter.repo)
            .bind(i64::from(filter.limit.clamp(1, 1000)))
            .bind(i64::from(filter.offset))
            .fetch_all(&self.pool)
            .await?)
    }

    pub async fn count_tasks_by_stage(&self) -> Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(sql::COUNT_TASKS_BY_STAGE)
            .fetch_all(&self.pool)
            .await?)
    }

    pub async fn advance_stage(&self, adv: AdvanceStage) -> Result<Advanced> {
        let now = self.now();
        let mut tx = self.pool.begin().await?;
        let Some(current) = sqlx::query_as::<_, Task>(TASK_BY_ID_FOR_UPDATE.as_str())
            .bind(adv.task_id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Err(StoreError::TaskNotFound(adv.task_id.to_string()));
        };
        check_fence(&mut tx, &adv, &current).await?;
        if current.stage != adv.expected_stage {
            return Err(StoreError::StageConflict {
                task_id: current.id,
                expected: adv.expected_stage,
                actual: current.stage,
                actual_seq: current.stage_seq,
            });
        }
        let task = write_stage(&mut tx, &current, &adv.new_stage, adv.event, now).await?;
        let mut next_job_id = None;
        if let Some(mut job) = adv.next_job {
            job.task_id = Some(task.id);
            job.dedupe_key
                .get_or_insert_with(|| stage_job_key(task.id, task.stage_seq));
            next_job_id = Some(insert_job(&mut tx, &job, now).await?.job_id);
            notify(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(Advanced { task, next_job_id })
    }

    // ----- events and agent runs ----------------------------------------------------------

    pub async fn append_event(&self, event: NewEvent) -> Result<i64> {
        let mut conn = self.pool.acquire().await?;
        insert_event(&mut conn, &event, self.now()).await
    }

    pub async fn task_events(&self, task_id: i64) -> Result<Vec<Event>> {
        Ok(sqlx::query_as(TASK_EVENTS.as_str())
            .bind(task_id)
            .fetch_all(&self.pool)
            .await?)
    }

    pub async fn events_by_kind(
        &self,
        kind: &str,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<Event>> {
        Ok(sqlx::query_as(EVENTS_BY_KIND.as_str())
            .bind(kind)
            .bind(after_id)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
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
            .fetch_one(&self.pool)
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
            .execute(&self.pool)
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::Invalid(format!("agent run {run_id} not found")));
        }
        Ok(())
    }

    pub async fn task_agent_runs(&self, task_id: i64) -> Result<Vec<AgentRun>> {
        Ok(sqlx::query_as(TASK_AGENT_RUNS.as_str())
            .bind(task_id)
            .fetch_all(&self.pool)
            .await?)
    }

    pub async fn task_usage(&self, task_id: i64) -> Result<Usage> {
        let row = sqlx::query(sql::TASK_USAGE)
            .bind(task_id)
            .fetch_one(&self.pool)
            .await?;
        Ok(Usage {
            runs: row.try_get(0)?,
            input_tokens: row.try_get::<Option<i64>, _>(1)?.unwrap_or(0),
            output_tokens: row.try_get::<Option<i64>, _>(2)?.unwrap_or(0),
            cost_usd: row.try_get::<Option<f64>, _>(3)?.unwrap_or(0.0),
        })
    }

    pub async fn has_live_jobs(&self) -> Result<bool> {
        Ok(sqlx::query_scalar(sql::HAS_LIVE_JOBS)
            .fetch_one(&self.pool)
            .await?)
    }

    pub async fn usage_by_agent(&self) -> Result<Vec<(String, Usage)>> {
        sqlx::query(sql::USAGE_BY_AGENT)
            .fetch_all(&self.pool)
            .await?
            .into_iter()
            .map(agent_usage)
            .collect()
    }
}

fn describe_connect_error(e: &sqlx::Error) -> String {
    let text = e.to_string();
    if matches!(e, sqlx::Error::PoolTimedOut) {
        "timed out connecting (is PostgreSQL running and reachable?)".to_owned()
    } else if text.contains("Connection refused") {
        format!("{text} (is PostgreSQL running and listening there?)")
    } else {
        text
    }
}

async fn current_schema(pool: &PgPool) -> Result<String> {
    Ok(sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(pool)
        .await?)
}

/// The LISTEN loop: every notification or reconnect bumps the wake-up counter. Ends when the
/// store is gone or its pool is closed.
async fn listen(pool: PgPool, wake: std::sync::Weak<watch::Sender<u64>>) {
    let bump = |wake: &std::sync::Weak<watch::Sender<u64>>| match wake.upgrade() {
        Some(tx) => {
            tx.send_modify(|n| *n = n.wrapping_add(1));
            true
        }
        None => false,
    };
    let mut backoff = Duration::from_millis(100);
    loop {
        if pool.is_closed() {
            return;
        }
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; polling covers the gap");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        if let Err(e) = listener.listen(CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN {CHANNEL} failed; polling covers the gap");
            tokio::time::sleep(backoff).await;
            continue;
        }
        backoff = Duration::from_millis(100);
        // Whatever was announced while we were not listening is lost: look now.
        if !bump(&wake) {
            return;
        }
        loop {
            match tokio::time::timeout(Duration::from_secs(5), listener.try_recv()).await {
                Ok(Ok(Some(_))) => {
                    if !bump(&wake) {
                        return;
                    }
                }
                // The connection dropped; try_recv reconnects on the next call, and the lost
                // notifications are covered by a bump.
                Ok(Ok(None)) => {
                    if !bump(&wake) {
                        return;
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "LISTEN connection lost; reconnecting");
                    break;
                }
                Err(_idle) => {
                    if wake.strong_count() == 0 || pool.is_closed() {
                        return;
                    }
                }
            }
        }
    }
}

async fn notify(conn: &mut PgConnection) -> Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(CHANNEL)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn read_version(conn: &mut PgConnection) -> Result<i64> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('events') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(0);
    }
    let rows: Vec<String> = sqlx::query_scalar("SELECT data FROM events WHERE kind = $1")
        .bind(MIGRATED_KIND)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows
        .iter()
        .filter_map(|d| migrate::version_of(d))
        .max()
        .unwrap_or(0))
}

async fn insert_job(conn: &mut PgConnection, job: &NewJob, now: Millis) -> Result<Enqueued> {
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

async fn insert_event(conn: &mut PgConnection, e: &NewEvent, now: Millis) -> Result<i64> {
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

async fn check_fence(conn: &mut PgConnection, adv: &AdvanceStage, current: &Task) -> Result<()> {
    match adv.fence {
        Fence::Seq(seq) if seq != current.stage_seq => Err(StoreError::StageConflict {
            task_id: current.id,
            expected: format!("{} (seq {seq})", adv.expected_stage),
            actual: current.stage.clone(),
            actual_seq: current.stage_seq,
        }),
        Fence::Seq(_) => Ok(()),
        Fence::Job(lease) => {
            let row =
                sqlx::query("SELECT state, attempt, task_id FROM jobs WHERE id = $1 FOR UPDATE")
                    .bind(lease.job_id)
                    .fetch_optional(&mut *conn)
                    .await?;
            let Some(row) = row else {
                return Err(StoreError::JobNotFound(lease.job_id));
            };
            let state: String = row.try_get(0)?;
            let attempt: i64 = row.try_get(1)?;
            let task_id: Option<i64> = row.try_get(2)?;
            if task_id != Some(current.id) {
                return Err(StoreError::Invalid(format!(
                    "job {} does not belong to task {}",
                    lease.job_id, current.id
                )));
            }
            if state != "running" || attempt != lease.attempt {
                return Err(lease_lost(lease, &state, attempt));
            }
            Ok(())
        }
    }
}

async fn fail_stranded_task(
    conn: &mut PgConnection,
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
    let Some(current) = sqlx::query_as::<_, Task>(TASK_BY_ID_FOR_UPDATE.as_str())
        .bind(task_id)
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(false);
    };
    if current.is_terminal() {
        return Ok(false);
    }
    let event = stranded_event(&current, job_id, error);
    write_stage(conn, &current, "failed", event, now).await?;
    Ok(true)
}

/// The one statement that writes `tasks.stage` (a compare-and-swap on the stage and its
/// `stage_seq`), with its event. `advance_stage` and the stranded-task failure both go
/// through it, so every stage change bumps `stage_seq` and leaves its event the same way.
async fn write_stage(
    conn: &mut PgConnection,
    current: &Task,
    new_stage: &str,
    mut event: NewEvent,
    now: Millis,
) -> Result<Task> {
    let task: Task = sqlx::query_as(ADVANCE_TASK.as_str())
        .bind(current.id)
        .bind(new_stage)
        .bind(now)
        .bind(&current.stage)
        .bind(current.stage_seq)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| StoreError::StageConflict {
            task_id: current.id,
            expected: format!("{} (seq {})", current.stage, current.stage_seq),
            actual: "changed concurrently".into(),
            actual_seq: current.stage_seq,
        })?;
    event.task_id = Some(task.id);
    event.stage = Some(task.stage.clone());
    insert_event(conn, &event, now).await?;
    Ok(task)
}
