//! The PostgreSQL driver: the shared engine for many `orch worker` processes on many machines.
//! Claims use `FOR UPDATE SKIP LOCKED`; completing finished jobs and claiming the next ones is
//! one statement; new jobs are announced with NOTIFY on the schema's channel ([`CHANNEL`]),
//! their due time as the payload, and a listener task turns notifications into wake-ups
//! (bumping them after every reconnect, because notifications sent while disconnected are lost).

use std::str::FromStr;
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use sqlx::postgres::{
    PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgQueryResult,
};
use sqlx::{FromRow, Row, Transaction};
use tokio::sync::watch;

use crate::ConnectOptions;
use crate::common::*;
use crate::db::Db;
use crate::driver::{Announce, Driver, Statements};
use crate::error::{Result, StoreError, redact_url};
use crate::migrate::{self, Migration};
use crate::model::*;
use crate::sql::JOB_COLUMNS;

/// The NOTIFY channel that announces new or re-queued jobs, as an SQL expression: `orch_jobs`
/// when the store's `jobs` table (the one its statements resolve through `search_path`) is in
/// `public`, `orch_jobs.<md5 of its schema>` elsewhere (ASCII, 42 bytes, under PostgreSQL's 63
/// whatever the schema's name), so that the stores of one database's schemas do not wake each
/// other's workers. The payload is when the job is due (epoch ms); empty: now, or unknown.
pub const CHANNEL: &str = "(SELECT CASE n WHEN 'public' THEN 'orch_jobs' \
     ELSE 'orch_jobs.' || md5(n) END FROM (SELECT relnamespace::regnamespace::text AS n \
     FROM pg_class WHERE oid = 'jobs'::regclass) AS s)";

/// Serializes concurrent `migrate` calls across processes.
const MIGRATE_LOCK: i64 = 0x006f_7263_686d_6967; // "orchmig"

/// The PostgreSQL half of the store: its pool, its LISTEN task, and the statements only
/// PostgreSQL writes this way. The rules common to both databases are in [`Db`].
#[derive(Debug, Clone)]
pub struct PgDriver {
    pool: PgPool,
    wake: Arc<watch::Sender<Wake>>,
    listener: Arc<OnceLock<()>>,
}

/// The store on PostgreSQL.
pub type PgStore = Db<PgDriver>;

static STATEMENTS: LazyLock<Statements> = LazyLock::new(Statements::new::<PgDriver>);

impl Driver for PgDriver {
    type DB = sqlx::Postgres;
    const FOR_UPDATE: &'static str = " FOR UPDATE";
    const FOR_UPDATE_SKIP_LOCKED: &'static str = " FOR UPDATE SKIP LOCKED";
    const FOR_SHARE_OF_TASK: &'static str = " FOR SHARE OF t";
    const LIST_TASKS_WHERE: &'static str = "WHERE ($1::text IS NULL OR stage = $1::text) \
         AND ($2::text IS NULL OR repo = $2::text) ORDER BY id DESC LIMIT $3 OFFSET $4";
    const COUNT_JOBS: &'static str = "SELECT count(*) FROM jobs WHERE task_id = $1 \
         AND agent = $2 AND ($3::text IS NULL OR strpos(task_content, $3::text) > 0) \
         AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = $1 \
         AND t.stage NOT IN ('done', 'failed', 'cancelled'))";
    const TRACK_HOLDER: &'static str = "SELECT work_item_id, stage FROM tasks \
         WHERE repo = $1 AND id <> $2 \
         AND stage IN (SELECT jsonb_array_elements_text($3::text::jsonb)) ORDER BY id LIMIT 1";
    const MAX_WORK_ITEM_NUMBER: &'static str = "SELECT max(CAST(substr(work_item_id, \
         length($1::text) + 2) AS BIGINT)) \
         FROM tasks WHERE substr(work_item_id, 1, length($1::text) + 1) = $1::text || '-' \
         AND substr(work_item_id, length($1::text) + 2) ~ '^[0-9]{1,18}$'";
    const EVENTS_OF_TASKS_WHERE: &'static str = "WHERE task_id IN \
         (SELECT jsonb_array_elements_text($1::text::jsonb)::bigint) \
         AND ($2::text = '[]' OR kind IN (SELECT jsonb_array_elements_text($2::text::jsonb)))";
    const NEWEST_EVENT_IDS: &'static str = NEWEST_EVENT_IDS;
    // `= ANY(ARRAY(…))`: the generic plan walks `agent_runs_task` (with `IN (SELECT …)` it
    // hash-joined a scan of the whole table).
    const RUNS_OF_TASKS_WHERE: &'static str =
        "WHERE task_id = ANY(ARRAY(SELECT jsonb_array_elements_text($1::text::jsonb)::bigint))";
    const SCHEMA_EXISTS: &'static str = "SELECT to_regclass('events') IS NOT NULL";
    const MIGRATIONS: &'static [Migration] = migrate::POSTGRES;
    const INDEXED_BY: bool = false;
    const ANALYZE_ALL: &'static str = "ANALYZE tasks, jobs, events, agent_runs";
    const DATABASE_SIZE: &'static str = "SELECT CAST(coalesce(sum(pg_total_relation_size(c.oid)), 0) AS BIGINT) \
         FROM pg_class c WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace \
         AND c.relname IN ('tasks', 'jobs', 'events', 'agent_runs')";

    fn rows_affected(result: &PgQueryResult) -> u64 {
        result.rows_affected()
    }

    fn writer(&self) -> &PgPool {
        &self.pool
    }

    async fn begin(&self) -> Result<Transaction<'static, sqlx::Postgres>> {
        Ok(self.pool.begin().await?)
    }

    async fn commit(
        &self,
        mut tx: Transaction<'static, sqlx::Postgres>,
        wake: Option<Announce>,
    ) -> Result<()> {
        if let Some(a) = wake {
            notify(&mut tx, a.due_at).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn lock_migrations(tx: &mut PgConnection) -> Result<()> {
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    async fn lock_prune(tx: &mut PgConnection) -> Result<()> {
        // One retention batch at a time, across every process: each carries the running total.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('orch.prune'))")
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    async fn lock_repo_track(tx: &mut PgConnection, repo: &str) -> Result<()> {
        // One exclusive stage change per repo at a time, across every process.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('orch.track:' || $1::text))")
            .bind(repo)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    async fn lock_work_item_prefix(tx: &mut PgConnection, prefix: &str) -> Result<()> {
        // One allocator per prefix at a time, across every process.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('orch.work_item:' || $1::text))")
            .bind(prefix)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
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
                SELECT q.id FROM jobs q \
                WHERE q.state = 'queued' AND q.available_at <= $1 \
                  AND (cardinality($5::text[]) = 0 OR q.agent = ANY($5::text[])) \
                  AND (q.node IS NULL OR q.node = $6::text OR {gone}) \
                ORDER BY q.priority DESC, q.available_at, q.id \
                LIMIT $4 \
                FOR UPDATE OF q SKIP LOCKED)) \
            RETURNING {cols} \
         ) \
         SELECT d.done_ids, c.* \
         FROM (SELECT coalesce(array_agg(id), '{{}}'::bigint[]) AS done_ids FROM done) d \
         LEFT JOIN claimed c ON true",
        gone = crate::sql::node_gone("$1", "$9::bigint"),
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

impl Db<PgDriver> {
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
        let (wake, _) = watch::channel(Wake::default());
        Ok(Db {
            d: PgDriver {
                pool,
                wake: Arc::new(wake),
                listener: Arc::new(OnceLock::new()),
            },
            clock: opts.clock,
            target,
            sql: &STATEMENTS,
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.d.pool
    }

    /// Starts the LISTEN task on first use.
    pub fn wakeups(&self) -> watch::Receiver<Wake> {
        let rx = self.d.wake.subscribe();
        self.d.listener.get_or_init(|| {
            tokio::spawn(listen(
                self.d.pool.clone(),
                Arc::downgrade(&self.d.wake),
                self.clock.clone(),
            ));
        });
        rx
    }

    pub async fn close(&self) {
        self.d.pool.close().await;
    }

    // ----- schema -------------------------------------------------------------------------

    pub async fn schema_dump(&self) -> Result<String> {
        let mut out = String::new();
        let cols = sqlx::query(
            "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text, \
                    coalesce(column_default::text, '') \
             FROM information_schema.columns WHERE table_schema = current_schema() \
             ORDER BY table_name, ordinal_position",
        )
        .fetch_all(&self.d.pool)
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
        .fetch_all(&self.d.pool)
        .await?;
        for row in idx {
            let def: String = row.try_get(0)?;
            // The schema name differs between databases and test schemas; drop it.
            let def = def.replace(&format!("{}.", current_schema(&self.d.pool).await?), "");
            out.push_str(&def);
            out.push('\n');
        }
        Ok(out)
    }

    // ----- jobs ---------------------------------------------------------------------------

    pub async fn enqueue(&self, job: NewJob) -> Result<Enqueued> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        let out = Self::insert_job(&mut tx, &job, now).await?;
        let wake = (!out.duplicate).then(|| Announce {
            due_at: due_at(std::slice::from_ref(&job), now),
            now,
        });
        self.d.commit(tx, wake).await?;
        Ok(out)
    }

    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<u64> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
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
        let wake = (inserted > 0).then(|| Announce {
            due_at: due_at(&jobs, now),
            now,
        });
        self.d.commit(tx, wake).await?;
        self.refresh_job_statistics(inserted).await;
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
            .bind(claim.and_then(|c| c.node_grace_ms))
            .fetch_all(&self.d.pool)
            .await?;
        let mut done_ids: Vec<i64> = Vec::new();
        let mut claimed = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            if i == 0 {
                done_ids = row.try_get("done_ids")?;
            }
            let id: Option<i64> = row.try_get("id")?;
            if id.is_some() {
                claimed.push(Job::from_row(row)?);
            }
        }
        Ok(completed_and_claimed(done, &done_ids, claimed))
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
        .fetch_all(&self.d.pool)
        .await?;
        Ok(leases
            .iter()
            .filter(|l| !kept.contains(&l.job_id))
            .copied()
            .collect())
    }

    pub async fn next_available_at(
        &self,
        kinds: &[String],
        node: Option<&str>,
    ) -> Result<Option<Millis>> {
        Ok(sqlx::query_scalar(NEXT_AVAILABLE_AT)
            .bind(kinds)
            .bind(node)
            .fetch_one(&self.d.pool)
            .await?)
    }
}

/// `$1 kinds (empty: any), $2 node` → when the first queued job this worker may run becomes
/// due. `jobs_ready` is ordered by priority, then due time: the statement steps from one
/// priority present to the next (an index seek each) and takes, per priority, the first row in
/// due order that fits, so it reads a few index entries, not every queued row.
/// `newest_event_ids` (see [`Driver::NEWEST_EVENT_IDS`]): a lateral `max(id)` per task, the
/// end of its `events_task` range; public for the plan test.
pub const NEWEST_EVENT_IDS: &str = "SELECT t.id, m.newest \
     FROM (SELECT DISTINCT jsonb_array_elements_text($1::text::jsonb)::bigint AS id) t \
     CROSS JOIN LATERAL (SELECT max(e.id) AS newest FROM events e WHERE e.task_id = t.id) m \
     WHERE m.newest IS NOT NULL";

pub const NEXT_AVAILABLE_AT: &str = "WITH RECURSIVE p(priority) AS ( \
        SELECT (SELECT priority FROM jobs WHERE state = 'queued' \
                ORDER BY priority DESC LIMIT 1) \
      UNION ALL \
        SELECT (SELECT q.priority FROM jobs q \
                WHERE q.state = 'queued' AND q.priority < p.priority \
                ORDER BY q.priority DESC LIMIT 1) \
        FROM p WHERE p.priority IS NOT NULL) \
     SELECT min((SELECT j.available_at FROM jobs j \
                 WHERE j.state = 'queued' AND j.priority = p.priority \
                 AND (cardinality($1::text[]) = 0 OR j.agent = ANY($1::text[])) \
                 AND (j.node IS NULL OR j.node = $2::text) \
                 ORDER BY j.available_at LIMIT 1)) \
     FROM p WHERE p.priority IS NOT NULL";

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
async fn listen(
    pool: PgPool,
    wake: std::sync::Weak<watch::Sender<Wake>>,
    clock: Arc<dyn crate::clock::Clock>,
) {
    // A wake-up for a job due at `due_at` (`Millis::MIN`: now or unknown); false once the
    // store is gone.
    let bump = |wake: &std::sync::Weak<watch::Sender<Wake>>, due_at: Millis| match wake.upgrade() {
        Some(tx) => {
            let now = clock.now_ms();
            tx.send_modify(|w| *w = w.next(due_at, now));
            true
        }
        None => false,
    };
    let mut backoff = Duration::from_millis(100);
    loop {
        if pool.is_closed() {
            return;
        }
        static NAME: LazyLock<String> = LazyLock::new(|| format!("SELECT {CHANNEL}"));
        let ready = async {
            let mut listener = PgListener::connect_with(&pool)
                .await
                .map_err(|e| ("LISTEN connection failed".to_owned(), e))?;
            let channel: String = sqlx::query_scalar(NAME.as_str())
                .fetch_one(&pool)
                .await
                .map_err(|e| ("cannot name the schema's NOTIFY channel".to_owned(), e))?;
            listener
                .listen(&channel)
                .await
                .map_err(|e| (format!("LISTEN {channel} failed"), e))?;
            Ok::<_, (String, sqlx::Error)>(listener)
        };
        let mut listener = match ready.await {
            Ok(l) => l,
            Err((what, e)) => {
                tracing::warn!(error = %e, "{what}; polling covers the gap");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        // Whatever was announced while we were not listening is lost: look now.
        if !bump(&wake, Millis::MIN) {
            return;
        }
        loop {
            match tokio::time::timeout(Duration::from_secs(5), listener.try_recv()).await {
                Ok(Ok(Some(n))) => {
                    // A payload that is not a due time (another version's, or none) is "now".
                    let due_at = n.payload().parse().unwrap_or(Millis::MIN);
                    if !bump(&wake, due_at) {
                        return;
                    }
                }
                // The connection dropped; try_recv reconnects on the next call, and the lost
                // notifications are covered by a bump.
                Ok(Ok(None)) => {
                    if !bump(&wake, Millis::MIN) {
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

/// Announces jobs due at `due_at` (`Millis::MIN`: now) on the schema's channel, delivered
/// when the transaction commits.
async fn notify(conn: &mut PgConnection, due_at: Millis) -> Result<()> {
    static NOTIFY: LazyLock<String> = LazyLock::new(|| format!("SELECT pg_notify({CHANNEL}, $1)"));
    let payload = if due_at == Millis::MIN {
        String::new()
    } else {
        due_at.to_string()
    };
    sqlx::query(NOTIFY.as_str())
        .bind(payload)
        .execute(&mut *conn)
        .await?;
    Ok(())
}
