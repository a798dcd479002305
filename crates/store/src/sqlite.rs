//! The SQLite driver: the embedded default. One file under `.orch/`, WAL journal, one writer
//! connection per process (`BEGIN IMMEDIATE` for every write transaction), a busy timeout for
//! writers in other processes, and a small pool of readers.

use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, LazyLock};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteQueryResult,
    SqliteSynchronous,
};
use sqlx::{Row, Transaction};
use tokio::sync::watch;

use crate::ConnectOptions;
use crate::common::*;
use crate::db::Db;
use crate::driver::{Announce, Driver, Statements};
use crate::error::{Result, StoreError};
use crate::migrate::{self, Migration};
use crate::model::*;
use crate::sql::JOB_COLUMNS;

/// The SQLite half of the store: its pools, its wake-up signal, and the statements only
/// SQLite writes this way. The rules common to both databases are in [`Db`].
#[derive(Debug, Clone)]
pub struct SqliteDriver {
    /// Exactly one connection: SQLite has one writer, so writes queue here instead of spinning
    /// on the file lock.
    write: SqlitePool,
    read: SqlitePool,
    wake: Arc<watch::Sender<Wake>>,
}

/// The store on SQLite.
pub type SqliteStore = Db<SqliteDriver>;

static STATEMENTS: LazyLock<Statements> = LazyLock::new(Statements::new::<SqliteDriver>);

impl Driver for SqliteDriver {
    type DB = sqlx::Sqlite;
    const FOR_UPDATE: &'static str = "";
    const FOR_UPDATE_SKIP_LOCKED: &'static str = "";
    const FOR_SHARE_OF_TASK: &'static str = "";
    const LIST_TASKS_WHERE: &'static str = "WHERE ($1 IS NULL OR stage = $1) \
         AND ($2 IS NULL OR repo = $2) ORDER BY id DESC LIMIT $3 OFFSET $4";
    const COUNT_JOBS: &'static str = "SELECT count(*) FROM jobs WHERE task_id = $1 \
         AND agent = $2 AND ($3 IS NULL OR instr(task_content, $3) > 0) \
         AND EXISTS (SELECT 1 FROM tasks t WHERE t.id = $1 \
         AND t.stage NOT IN ('done', 'failed', 'cancelled'))";
    const TRACK_HOLDER: &'static str = "SELECT work_item_id, stage FROM tasks \
         WHERE repo = $1 AND id <> $2 AND stage IN (SELECT value FROM json_each($3)) \
         ORDER BY id LIMIT 1";
    const MAX_WORK_ITEM_NUMBER: &'static str = "SELECT max(CAST(substr(work_item_id, \
         length($1) + 2) AS INTEGER)) FROM tasks \
         WHERE substr(work_item_id, 1, length($1) + 1) = $1 || '-' \
         AND substr(work_item_id, length($1) + 2) NOT GLOB '*[^0-9]*'";
    const EVENTS_OF_TASKS_WHERE: &'static str = "WHERE task_id IN \
         (SELECT value FROM json_each($1)) \
         AND ($2 = '[]' OR kind IN (SELECT value FROM json_each($2)))";
    const NEWEST_EVENT_IDS: &'static str = "SELECT id, newest FROM \
         (SELECT t.id AS id, (SELECT max(e.id) FROM events e INDEXED BY events_task \
         WHERE e.task_id = t.id) AS newest \
         FROM (SELECT DISTINCT value AS id FROM json_each($1)) t) \
         WHERE newest IS NOT NULL";
    const RUNS_OF_TASKS_WHERE: &'static str = "WHERE task_id IN (SELECT value FROM json_each($1))";
    const SCHEMA_EXISTS: &'static str = "SELECT EXISTS (SELECT 1 FROM sqlite_master \
         WHERE type = 'table' AND name = 'events')";
    const MIGRATIONS: &'static [Migration] = migrate::SQLITE;
    const INDEXED_BY: bool = true;
    const ANALYZE_ALL: &'static str = "";
    const DATABASE_SIZE: &'static str = "SELECT CAST(page_count * page_size AS INTEGER) \
         FROM pragma_page_count(), pragma_page_size()";

    fn rows_affected(result: &SqliteQueryResult) -> u64 {
        result.rows_affected()
    }

    fn writer(&self) -> &SqlitePool {
        &self.write
    }

    fn reader(&self) -> &SqlitePool {
        &self.read
    }

    async fn begin(&self) -> Result<Transaction<'static, sqlx::Sqlite>> {
        Ok(self.write.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn commit(
        &self,
        tx: Transaction<'static, sqlx::Sqlite>,
        wake: Option<Announce>,
    ) -> Result<()> {
        tx.commit().await?;
        if let Some(a) = wake {
            self.notify(a.due_at, a.now);
        }
        Ok(())
    }
}

impl SqliteDriver {
    /// The in-process wake-up: a job became available, or will at `due_at` (`Millis::MIN`:
    /// now or unknown), as announced at `now`.
    fn notify(&self, due_at: Millis, now: Millis) {
        self.wake.send_modify(|w| *w = w.next(due_at, now));
    }
}

/// Marks leases done and claims new jobs in one UPDATE: one statement, so one implicit
/// transaction and one trip to the connection's thread instead of BEGIN, one UPDATE per lease,
/// the claim and COMMIT (each a trip). Every SET expression reads the row as it was, so a row
/// that was `running` (a lease being completed: fenced by its attempt) becomes `done` and a row
/// that was `queued` (picked in `jobs_ready` order, at most `$6`) becomes `running` under a new
/// attempt; RETURNING's `state` tells the two apart. The rows to change come from one
/// materialized `FROM` list (completions, then the pick) joined to `jobs` by rowid: with the
/// completions in a subquery of the WHERE instead, the planner re-read the JSON once per
/// running row (5,000 completions with 80,000 rows running: seconds per statement).
///
/// `$1 now, $2 lease_ms, $3 worker_id, $4 kinds (JSON array), $5 node, $6 limit (0: no claim),
/// $7 completions (JSON array of [id, attempt]), $8 node grace in ms (NULL: no takeover)`.
static COMPLETE_AND_CLAIM: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE jobs SET \
            state = CASE WHEN state = 'running' THEN 'done' ELSE 'running' END, \
            finished_at = CASE WHEN state = 'running' THEN $1 ELSE finished_at END, \
            lease_expires_at = CASE WHEN state = 'running' THEN NULL ELSE $1 + $2 END, \
            attempt = CASE WHEN state = 'running' THEN attempt ELSE attempt + 1 END, \
            locked_by = CASE WHEN state = 'running' THEN locked_by ELSE $3 END, \
            started_at = CASE WHEN state = 'running' THEN started_at ELSE $1 END \
         FROM ( \
            SELECT json_extract(value, '$[0]') AS jid, json_extract(value, '$[1]') AS jattempt, \
                'running' AS was FROM json_each($7) \
          UNION ALL \
            SELECT id, attempt, 'queued' FROM (SELECT q.id, q.attempt FROM jobs q \
                WHERE q.state = 'queued' AND q.available_at <= $1 \
                AND ($4 = '[]' OR q.agent IN (SELECT value FROM json_each($4))) \
                AND (q.node IS NULL OR q.node = $5 OR {gone}) \
                ORDER BY q.priority DESC, q.available_at, q.id LIMIT $6)) AS t \
         WHERE jobs.id = t.jid AND jobs.attempt = t.jattempt AND jobs.state = t.was \
         RETURNING {JOB_COLUMNS}",
        gone = crate::sql::node_gone("$1", "$8"),
    )
});

/// `$1 kinds (JSON array, '[]': any), $2 node` → when the first queued job this worker may run
/// becomes due. `jobs_ready` is ordered by priority, then due time: the statement steps from
/// one priority present to the next (an index seek each) and takes, per priority, the first row
/// in due order that fits, so it reads a few index entries, not every queued row (with 1,000
/// watches queued and a tick due every millisecond, reading them all was a third of a worker's
/// CPU).
pub const NEXT_AVAILABLE_AT: &str = "WITH RECURSIVE p(priority) AS ( \
        SELECT (SELECT priority FROM jobs INDEXED BY jobs_ready WHERE state = 'queued' \
                ORDER BY priority DESC LIMIT 1) \
      UNION ALL \
        SELECT (SELECT q.priority FROM jobs q INDEXED BY jobs_ready \
                WHERE q.state = 'queued' AND q.priority < p.priority \
                ORDER BY q.priority DESC LIMIT 1) \
        FROM p WHERE p.priority IS NOT NULL) \
     SELECT min((SELECT j.available_at FROM jobs j INDEXED BY jobs_ready \
                 WHERE j.state = 'queued' AND j.priority = p.priority \
                 AND ($1 = '[]' OR j.agent IN (SELECT value FROM json_each($1))) \
                 AND (j.node IS NULL OR j.node = $2) \
                 ORDER BY j.available_at LIMIT 1)) \
     FROM p WHERE p.priority IS NOT NULL";

/// `$1` a JSON array of `[task_id, agent, task_content, priority, max_attempts, available_at,
/// dedupe_key, node]` rows, `$2 now`. Rows whose dedupe key exists are skipped.
const BULK_INSERT_JOBS: &str = "INSERT INTO jobs (task_id, agent, task_content, state, \
     priority, attempt, max_attempts, available_at, dedupe_key, node, created_at) \
     SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), \
        json_extract(value, '$[2]'), 'queued', json_extract(value, '$[3]'), 0, \
        json_extract(value, '$[4]'), json_extract(value, '$[5]'), json_extract(value, '$[6]'), \
        json_extract(value, '$[7]'), $2 \
     FROM json_each($1) WHERE true \
     ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING";

impl Db<SqliteDriver> {
    pub async fn connect(path: &str, opts: ConnectOptions) -> Result<SqliteStore> {
        let target = format!("sqlite://{path}");
        let connect_err = |reason: String| StoreError::Connect {
            target: target.clone(),
            reason,
        };
        if path.is_empty() {
            return Err(StoreError::BadUrl {
                url: target.clone(),
                reason: "the SQLite path is empty".into(),
            });
        }
        if !opts.create_if_missing && !Path::new(path).exists() {
            return Err(connect_err(
                "the file does not exist; run `orch init` to create it".into(),
            ));
        }
        let base = SqliteConnectOptions::from_str(&format!("sqlite://{path}"))
            .map_err(|e| StoreError::BadUrl {
                url: target.clone(),
                reason: e.to_string(),
            })?
            .create_if_missing(opts.create_if_missing)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(if opts.sqlite_full_sync {
                SqliteSynchronous::Full
            } else {
                SqliteSynchronous::Normal
            })
            .busy_timeout(opts.connect_timeout.max(std::time::Duration::from_secs(5)))
            .foreign_keys(true);
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .after_connect(|conn, _| Box::pin(stable_plans(conn)))
            .acquire_timeout(opts.connect_timeout.max(std::time::Duration::from_secs(30)))
            .connect_with(base.clone())
            .await
            .map_err(|e| connect_err(describe_open_error(&e)))?;
        // A query that reads the file's header: a corrupt or foreign file fails here, at open,
        // with a message that names the cause, instead of in the middle of some later write.
        sqlx::query("SELECT count(*) FROM sqlite_master")
            .fetch_one(&write)
            .await
            .map_err(|e| connect_err(describe_open_error(&e)))?;
        let read = SqlitePoolOptions::new()
            .max_connections(4)
            .after_connect(|conn, _| Box::pin(stable_plans(conn)))
            .acquire_timeout(opts.connect_timeout.max(std::time::Duration::from_secs(30)))
            .connect_with(base)
            .await
            .map_err(|e| connect_err(describe_open_error(&e)))?;
        let (wake, _) = watch::channel(Wake::default());
        Ok(Db {
            d: SqliteDriver {
                write,
                read,
                wake: Arc::new(wake),
            },
            clock: opts.clock,
            target,
            sql: &STATEMENTS,
        })
    }

    pub fn wakeups(&self) -> watch::Receiver<Wake> {
        self.d.wake.subscribe()
    }

    pub async fn close(&self) {
        self.d.read.close().await;
        self.d.write.close().await;
    }

    // ----- schema -------------------------------------------------------------------------

    pub async fn schema_dump(&self) -> Result<String> {
        let rows = sqlx::query(
            "SELECT type, name, sql FROM sqlite_master \
             WHERE name NOT LIKE 'sqlite_%' ORDER BY type DESC, name",
        )
        .fetch_all(&self.d.read)
        .await?;
        let mut out = String::new();
        for row in rows {
            let sql: Option<String> = row.try_get("sql")?;
            if let Some(sql) = sql {
                out.push_str(sql.trim());
                out.push_str(";\n");
            }
        }
        Ok(out)
    }

    // ----- jobs ---------------------------------------------------------------------------

    pub async fn enqueue(&self, job: NewJob) -> Result<Enqueued> {
        // One autocommit INSERT: a single trip to the connection's thread (an explicit
        // transaction costs three more). After a dedupe conflict the id is looked up in a second
        // statement; should cleanup delete that long-finished row in between, the lookup fails
        // with an error, never a wrong id.
        let now = self.now();
        let mut conn = self.d.write.acquire().await?;
        let out = Self::insert_job(&mut conn, &job, now).await?;
        if !out.duplicate {
            // A delayed job (a watch's next tick) only tells the workers when to look next.
            self.d.notify(due_at(std::slice::from_ref(&job), now), now);
        }
        Ok(out)
    }

    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<u64> {
        // One INSERT … SELECT per chunk of rows passed as one JSON array: one trip to the
        // connection's thread per chunk instead of one per row (20,000 jobs: 11k → 230k
        // jobs/s). Chunks are cut at 5,000 rows or ~4 MiB of JSON.
        const CHUNK_ROWS: usize = 5_000;
        const CHUNK_BYTES: usize = 4 << 20;
        let now = self.now();
        let mut chunks: Vec<String> = Vec::new();
        let mut rows: Vec<serde_json::Value> = Vec::new();
        let mut bytes = 0;
        for (i, j) in jobs.iter().enumerate() {
            bytes += j.task_content.len() + j.agent.len() + 64;
            rows.push(serde_json::json!([
                j.task_id,
                j.agent,
                j.task_content,
                j.priority,
                j.max_attempts,
                now.saturating_add(j.delay_ms),
                j.dedupe_key,
                j.node
            ]));
            if rows.len() >= CHUNK_ROWS || bytes >= CHUNK_BYTES || i + 1 == jobs.len() {
                chunks.push(serde_json::Value::Array(std::mem::take(&mut rows)).to_string());
                bytes = 0;
            }
        }
        let mut inserted = 0;
        if let [chunk] = chunks.as_slice() {
            // One statement is atomic on its own: no BEGIN and COMMIT around it, two trips to
            // the writer's thread fewer (a batch of a watch's ticks, every few milliseconds).
            inserted = sqlx::query(BULK_INSERT_JOBS)
                .bind(chunk)
                .bind(now)
                .execute(&self.d.write)
                .await?
                .rows_affected();
        } else if !chunks.is_empty() {
            let mut tx = self.d.begin().await?;
            for chunk in &chunks {
                inserted += sqlx::query(BULK_INSERT_JOBS)
                    .bind(chunk)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
            }
            tx.commit().await?;
        }
        self.refresh_job_statistics(inserted).await;
        if inserted > 0 {
            // Delayed jobs only (a batch of watch ticks) tell the workers when to look next.
            self.d.notify(due_at(&jobs, now), now);
        }
        Ok(inserted)
    }

    pub async fn complete_and_claim(
        &self,
        done: &[Lease],
        claim: Option<&Claim>,
    ) -> Result<CompleteAndClaim> {
        let now = self.now();
        let pairs: Vec<[i64; 2]> = done.iter().map(|l| [l.job_id, l.attempt]).collect();
        let done_json = serde_json::to_string(&pairs).unwrap_or_else(|_| "[]".into());
        let no_kinds = Vec::new();
        let kinds = claim.map_or(&no_kinds, |c| &c.kinds);
        let kinds = serde_json::to_string(kinds).unwrap_or_else(|_| "[]".into());
        let rows: Vec<Job> = sqlx::query_as(COMPLETE_AND_CLAIM.as_str())
            .bind(now)
            .bind(claim.map_or(0, |c| c.lease_ms))
            .bind(claim.map_or("", |c| c.worker_id.as_str()))
            .bind(kinds)
            .bind(claim.and_then(|c| c.node.as_deref()))
            .bind(claim.map_or(0, |c| i64::from(c.limit)))
            .bind(done_json)
            .bind(claim.and_then(|c| c.node_grace_ms))
            .fetch_all(&self.d.write)
            .await?;
        let (completed, claimed): (Vec<Job>, Vec<Job>) = rows
            .into_iter()
            .partition(|job| job.state == JobState::Done);
        let done_ids: Vec<i64> = completed.iter().map(|job| job.id).collect();
        Ok(completed_and_claimed(done, &done_ids, claimed))
    }

    pub async fn heartbeat(
        &self,
        worker_id: &str,
        leases: &[Lease],
        lease_ms: i64,
    ) -> Result<Vec<Lease>> {
        let now = self.now();
        let mut tx = self.d.begin().await?;
        let mut lost = Vec::new();
        for lease in leases {
            let res = sqlx::query(
                "UPDATE jobs SET lease_expires_at = $1 \
                 WHERE id = $2 AND attempt = $3 AND state = 'running' AND locked_by = $4",
            )
            .bind(now + lease_ms)
            .bind(lease.job_id)
            .bind(lease.attempt)
            .bind(worker_id)
            .execute(&mut *tx)
            .await?;
            if res.rows_affected() == 0 {
                lost.push(*lease);
            }
        }
        tx.commit().await?;
        Ok(lost)
    }

    pub async fn next_available_at(
        &self,
        kinds: &[String],
        node: Option<&str>,
    ) -> Result<Option<Millis>> {
        let kinds = serde_json::to_string(kinds).unwrap_or_else(|_| "[]".into());
        let at: Option<i64> = sqlx::query_scalar(NEXT_AVAILABLE_AT)
            .bind(kinds)
            .bind(node)
            .fetch_one(&self.d.read)
            .await?;
        Ok(at)
    }
}

fn describe_open_error(e: &sqlx::Error) -> String {
    let text = e.to_string();
    if text.contains("file is not a database") || text.contains("malformed") {
        format!(
            "{text}: the file is corrupt or is not a SQLite database; restore it from a backup, \
             or move it away and run `orch init`"
        )
    } else {
        text
    }
}

/// Plans that do not depend on bound values (SQLite's query planner stability guarantee, the
/// counterpart of PostgreSQL's `force_generic_plan` here): without it SQLite re-prepares a
/// statement whenever a bound value that could change its plan changes, such as the claim's
/// `LIMIT $n` from one claim to the next, and parsing and planning the claim again was a tenth
/// of the CPU of a worker ticking 1,000 watches a second. Every hot statement is written so
/// its one plan is right for any values (literals where a partial index must match).
async fn stable_plans(conn: &mut sqlx::SqliteConnection) -> std::result::Result<(), sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    let db = handle.as_raw_handle().as_ptr();
    // SAFETY: `db` is the open connection `handle` keeps locked for this call; the option
    // takes an int (1: on) and an int pointer for the new setting, which may be null.
    let rc = unsafe {
        libsqlite3_sys::sqlite3_db_config(
            db,
            libsqlite3_sys::SQLITE_DBCONFIG_ENABLE_QPSG,
            1 as std::ffi::c_int,
            std::ptr::null_mut::<std::ffi::c_int>(),
        )
    };
    if rc != libsqlite3_sys::SQLITE_OK {
        tracing::warn!(
            rc,
            "SQLite refused the query planner stability guarantee; statements may be re-planned per execution"
        );
    }
    Ok(())
}
