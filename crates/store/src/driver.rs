//! What differs between the databases, and nothing else: [`Driver`] is the small per-backend
//! part (pools, how a write transaction begins and commits, the row-lock suffix, the cross-process
//! locks and the few statements written differently); [`crate::db::Db`] holds the store's rules
//! written once above it. The hot path, the bulk insert, connecting, the schema dump and LISTEN
//! are each driver's own (`sqlite.rs`, `postgres.rs`).

use std::future::Future;

use sqlx::{Database, Pool, Transaction};

use crate::error::Result;
use crate::migrate::Migration;
use crate::model::Millis;
use crate::sql;

/// One database's part of the store. Implemented by [`crate::sqlite::Sqlite`] and
/// [`crate::postgres::Postgres`].
pub trait Driver: Send + Sync + 'static {
    type DB: Database;

    /// Appended to a `SELECT` that reads rows its transaction is about to change:
    /// `" FOR UPDATE"` on PostgreSQL; empty on SQLite, whose write transaction (`BEGIN
    /// IMMEDIATE`) already holds the database's only write lock.
    const FOR_UPDATE: &'static str;
    /// As [`Driver::FOR_UPDATE`], for a sweep that several processes may run at once: rows
    /// another sweep holds are skipped, not waited for.
    const FOR_UPDATE_SKIP_LOCKED: &'static str;
    /// Appended to the task-jobs retention batch's sub-select (`sql::prune_task_jobs`): locks
    /// the finished tasks whose jobs it deletes (`" FOR SHARE OF t"` on PostgreSQL), so a
    /// retry of one of them is ordered before or after the batch, never inside it; empty on
    /// SQLite, whose write transaction already excludes every other writer.
    const FOR_SHARE_OF_TASK: &'static str;
    /// The `WHERE … LIMIT … OFFSET …` of `list_tasks`: `$1 stage or NULL, $2 repo or NULL,
    /// $3 limit, $4 offset` (PostgreSQL needs the NULL parameters typed).
    const LIST_TASKS_WHERE: &'static str;
    /// `count_jobs`: `$1 task_id, $2 agent, $3 substring or NULL` → count (substring search is
    /// `instr` on SQLite, `strpos` on PostgreSQL).
    const COUNT_JOBS: &'static str;
    /// `$1 prefix` → the largest `n` of the work items `<prefix>-<n>` (NULL when none).
    const MAX_WORK_ITEM_NUMBER: &'static str;
    /// `$1 repo, $2 task_id, $3 stages (a JSON array of strings)` → `work_item_id, stage` of
    /// another task of the repo at one of the stages (`advance_stage_exclusive`).
    const TRACK_HOLDER: &'static str;
    /// The `WHERE` of `events_of_tasks`: `$1 task ids, $2 kinds` (both JSON arrays; no kinds:
    /// every kind).
    const EVENTS_OF_TASKS_WHERE: &'static str;
    /// `newest_event_ids`: `$1 task ids` (a JSON array) → `(task id, newest event id)` of each
    /// given task with events. Written as one `max(id)` subquery per task, each the end of the
    /// task's `events_task` range (a backward index read of one entry): filtering `events` by
    /// `task_id IN (…)` and grouping instead read the whole table on PostgreSQL.
    const NEWEST_EVENT_IDS: &'static str;
    /// The `WHERE` of `agent_runs_of_tasks`: `$1 task ids` (a JSON array).
    const RUNS_OF_TASKS_WHERE: &'static str;
    /// → whether the orch schema exists (its `events` table), as a boolean.
    const SCHEMA_EXISTS: &'static str;
    /// This backend's migrations, oldest first.
    const MIGRATIONS: &'static [Migration];
    /// Refreshes the planner statistics of the four tables (`refresh_statistics`); empty when
    /// the backend has nothing to do.
    const ANALYZE_ALL: &'static str;
    /// Whether a statement may name the index it must read (SQLite's `INDEXED BY`). SQLite,
    /// without statistics, would otherwise read a recent window of finished jobs or ended tasks
    /// through the `(state, …)`/`(stage, …)` index, every finished row; PostgreSQL's planner
    /// picks the partial index from its statistics.
    const INDEXED_BY: bool;
    /// → the bytes the four tables take with their indexes, as a BIGINT (`database_size`).
    const DATABASE_SIZE: &'static str;

    /// Rows an `execute` changed.
    fn rows_affected(result: &<Self::DB as Database>::QueryResult) -> u64;

    /// The pool writes go through (SQLite: its one writer connection).
    fn writer(&self) -> &Pool<Self::DB>;
    /// The pool reads go through; by default the writer's.
    fn reader(&self) -> &Pool<Self::DB> {
        self.writer()
    }

    /// Begins a write transaction (SQLite: `BEGIN IMMEDIATE`, so it never has to upgrade a
    /// read lock and fail with `SQLITE_BUSY` half way).
    fn begin(&self) -> impl Future<Output = Result<Transaction<'static, Self::DB>>> + Send;

    /// Commits `tx`; with `wake`, announces to the workers that jobs are available, or will be
    /// at its due time (PostgreSQL: `pg_notify` inside the transaction, delivered at commit;
    /// SQLite: the in-process signal, after the commit).
    fn commit(
        &self,
        tx: Transaction<'static, Self::DB>,
        wake: Option<Announce>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Serializes migrations across processes until `tx` ends. By default nothing to do: a
    /// database whose write transaction holds its only write lock (SQLite) already does.
    fn lock_migrations(
        tx: &mut <Self::DB as Database>::Connection,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = tx;
        async { Ok(()) }
    }

    /// Serializes retention batches across processes until `tx` ends, so that each batch's
    /// `jobs.pruned` event carries the running total. By default nothing to do, as for
    /// [`Driver::lock_migrations`].
    fn lock_prune(
        tx: &mut <Self::DB as Database>::Connection,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = tx;
        async { Ok(()) }
    }

    /// Serializes exclusive stage changes of one repo (`advance_stage_exclusive`) across
    /// processes until `tx` ends. By default nothing to do, as for [`Driver::lock_migrations`].
    fn lock_repo_track(
        tx: &mut <Self::DB as Database>::Connection,
        repo: &str,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (tx, repo);
        async { Ok(()) }
    }

    /// Serializes the allocation of work item ids of one prefix across processes until `tx`
    /// ends. By default nothing to do, as for [`Driver::lock_migrations`].
    fn lock_work_item_prefix(
        tx: &mut <Self::DB as Database>::Connection,
        prefix: &str,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (tx, prefix);
        async { Ok(()) }
    }
}

/// Statement texts that depend on a driver's constants, built once per driver
/// (see [`Statements::new`]). The rest is in [`crate::sql`].
#[derive(Debug)]
pub struct Statements {
    /// `$1 task_id`, locking the row: the read of `advance_stage`.
    pub task_by_id_locked: String,
    /// `$1 job_id` → `state, attempt, max_attempts, task_id`, locking the row: the fence of a
    /// running job's lease (`Db::lock_running`).
    pub job_locked: String,
    /// `$1 now, $2 limit` → `id, attempt, max_attempts, task_id, locked_by` of expired leases.
    pub expired_leases: String,
    /// `$1 finished before, $2 limit` → ids of the finished tasks' jobs a retention batch
    /// deleted.
    pub prune_task_jobs: String,
    pub list_tasks: String,
    /// `$1 task ids, $2 kinds` (JSON arrays) → their events, by task then oldest first.
    pub events_of_tasks: String,
    /// [`sql::recent_finished_job_counts`] on this driver.
    pub recent_finished_job_counts: String,
    /// [`sql::recently_ended_tasks_by_stage`] on this driver.
    pub recently_ended_tasks_by_stage: String,
    /// [`sql::tasks_ended_since`] on this driver.
    pub tasks_ended_since: String,
    /// [`sql::oldest_ready`] on this driver.
    pub oldest_ready: String,
    /// `$1 task ids` (a JSON array) → their agent runs, by task then oldest first.
    pub agent_runs_of_tasks: String,
    /// `$1 task ids` (a JSON array), `$2` `'[]'` → `(task_id, max(id))` of their events.
    pub newest_event_ids: String,
    /// [`sql::report_live_tasks`] on this driver.
    pub report_live_tasks: String,
    /// [`sql::report_ended_tasks`] on this driver.
    pub report_ended_tasks: String,
}

/// ` INDEXED BY <index>` where the driver takes it, else nothing.
fn indexed_by<D: Driver>(index: &str) -> String {
    if D::INDEXED_BY {
        format!(" INDEXED BY {index}")
    } else {
        String::new()
    }
}

impl Statements {
    pub fn new<D: Driver>() -> Statements {
        Statements {
            task_by_id_locked: sql::select_tasks(&format!("WHERE id = $1{}", D::FOR_UPDATE)),
            job_locked: format!(
                "SELECT state, attempt, max_attempts, task_id FROM jobs WHERE id = $1{}",
                D::FOR_UPDATE
            ),
            expired_leases: format!(
                "SELECT id, attempt, max_attempts, task_id, locked_by FROM jobs \
                 WHERE state = 'running' AND lease_expires_at < $1 \
                 ORDER BY lease_expires_at, id LIMIT $2{}",
                D::FOR_UPDATE_SKIP_LOCKED
            ),
            prune_task_jobs: sql::prune_task_jobs(D::FOR_SHARE_OF_TASK),
            list_tasks: sql::select_tasks(D::LIST_TASKS_WHERE),
            events_of_tasks: format!(
                "SELECT {} FROM events {} ORDER BY task_id, id",
                sql::EVENT_COLUMNS,
                D::EVENTS_OF_TASKS_WHERE
            ),
            recent_finished_job_counts: sql::recent_finished_job_counts(&indexed_by::<D>(
                "jobs_finished",
            )),
            recently_ended_tasks_by_stage: sql::recently_ended_tasks_by_stage(&indexed_by::<D>(
                "tasks_ended",
            )),
            tasks_ended_since: sql::tasks_ended_since(&indexed_by::<D>("tasks_ended")),
            oldest_ready: sql::oldest_ready(&indexed_by::<D>("jobs_queued_at")),
            agent_runs_of_tasks: format!(
                "SELECT {} FROM agent_runs {} ORDER BY task_id, id",
                sql::AGENT_RUN_COLUMNS,
                D::RUNS_OF_TASKS_WHERE
            ),
            newest_event_ids: D::NEWEST_EVENT_IDS.to_owned(),
            report_live_tasks: sql::report_live_tasks(&indexed_by::<D>("tasks_live")),
            report_ended_tasks: sql::report_ended_tasks(&indexed_by::<D>("tasks_ended")),
        }
    }
}

/// What a commit announces to the workers: jobs available at `due_at` (`Millis::MIN`: now), as
/// of `now` (the store's clock).
#[derive(Debug, Clone, Copy)]
pub struct Announce {
    pub due_at: Millis,
    pub now: Millis,
}

impl Announce {
    /// Jobs available now.
    pub const NOW: Announce = Announce {
        due_at: Millis::MIN,
        now: Millis::MIN,
    };
}
