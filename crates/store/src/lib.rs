//! The durable store of orch: exactly four tables (`events`, `tasks`, `agent_runs`, `jobs`), a
//! job queue whose every state change is fenced, and `advance_stage`, the only writer of
//! `tasks.stage`.
//!
//! The rules are written once ([`db::Db`]) above a small per-database [`driver::Driver`]
//! (transactions, the row-lock suffix, cross-process locks, the few statements each database
//! writes its own way); each driver module ([`sqlite`], [`postgres`]) adds only its hot path,
//! bulk insert, connection, schema dump and wake-ups, with its migrations. One [`Store`] type
//! chooses the database; one conformance suite (`tests/conformance.rs`) runs the same test
//! functions against both. A new backend = a `Driver` + its own few operations + the suite.
//!
//! Invariants (see ARCHITECTURE.md):
//! - Only this crate has SQL.
//! - A change to a running job presents its [`Lease`] (job id + attempt); a stale attempt gets
//!   [`StoreError::LeaseLost`], never a silent success.
//! - `advance_stage` is a compare-and-swap on the expected stage, fenced by the caller's job
//!   lease or by the task's `stage_seq`, in one transaction with its event and next job.
//! - A `dedupe_key` is an idempotency key: at most one job row ever carries it.
//! - Finished jobs of unfinished tasks are never deleted: restart-safe counters are counted
//!   from them, and only for live tasks (`count_jobs`), so retention never changes a count.

mod clock;
mod common;
pub mod db;
pub mod driver;
mod error;
mod migrate;
mod model;
pub mod postgres;
mod sql;
pub mod sqlite;
#[cfg(feature = "testing")]
pub mod testing;

use std::sync::Arc;

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{Result, StoreError, redact_url};
pub use migrate::{MigrateReport, SCHEMA_VERSION};
pub use model::*;
pub use sql::{NODE_BEACON_KIND, NODE_BEACON_PREFIX};

/// Which database a store talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

/// How to open a store.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub clock: Arc<dyn Clock>,
    /// SQLite: create the file when missing (only `orch init` and tests do).
    pub create_if_missing: bool,
    /// PostgreSQL: connections in the pool.
    pub max_connections: u32,
    /// SQLite: `synchronous=FULL` (durable across power loss) instead of `NORMAL` (durable
    /// across process crashes; the last commits may roll back on power loss).
    pub sqlite_full_sync: bool,
    /// How long to wait for a connection (and, on SQLite, for the write lock).
    pub connect_timeout: std::time::Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            clock: Arc::new(SystemClock),
            create_if_missing: false,
            max_connections: 10,
            sqlite_full_sync: false,
            connect_timeout: std::time::Duration::from_secs(5),
        }
    }
}

/// The store: a handle to SQLite or PostgreSQL. Cheap to clone.
#[derive(Debug, Clone)]
pub enum Store {
    Sqlite(sqlite::SqliteStore),
    Postgres(postgres::PgStore),
}

macro_rules! dispatch {
    ($self:ident, $method:ident ( $($arg:expr),* )) => {
        match $self {
            Store::Sqlite(s) => s.$method($($arg),*).await,
            Store::Postgres(s) => s.$method($($arg),*).await,
        }
    };
}

/// The SQLite database file `url` names: `sqlite://PATH`, `sqlite:PATH` or a bare path ending
/// in `.db`; `None` for any other URL. The one reading of a SQLite URL ([`Store::connect`]'s,
/// and the binary's when it looks for the file before opening it).
pub fn sqlite_file(url: &str) -> Option<&str> {
    let url = url.trim();
    url.strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .or_else(|| (url.ends_with(".db") && !url.contains("://")).then_some(url))
}

impl Store {
    /// Opens `url`: `sqlite://PATH` (or a bare path ending in `.db`) or `postgres://…`.
    /// Does not migrate; call [`Store::migrate`] or [`Store::check_schema`].
    pub async fn connect(url: &str, opts: ConnectOptions) -> Result<Store> {
        let url = url.trim();
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Store::Postgres(
                postgres::PgStore::connect(url, opts).await?,
            ))
        } else if let Some(path) = sqlite_file(url) {
            Ok(Store::Sqlite(
                sqlite::SqliteStore::connect(path, opts).await?,
            ))
        } else {
            Err(StoreError::BadUrl {
                url: redact_url(url),
                reason: "expected sqlite://PATH or postgres://USER@HOST:PORT/DB".into(),
            })
        }
    }

    pub fn backend(&self) -> Backend {
        match self {
            Store::Sqlite(_) => Backend::Sqlite,
            Store::Postgres(_) => Backend::Postgres,
        }
    }

    /// Where the store points, with any password hidden.
    pub fn target(&self) -> String {
        match self {
            Store::Sqlite(s) => s.target(),
            Store::Postgres(s) => s.target(),
        }
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        match self {
            Store::Sqlite(s) => s.clock(),
            Store::Postgres(s) => s.clock(),
        }
    }

    pub fn now_ms(&self) -> Millis {
        self.clock().now_ms()
    }

    /// A receiver that changes whenever jobs may have become available: an in-process signal on
    /// SQLite, LISTEN/NOTIFY on PostgreSQL (it also changes after a listener reconnect, because
    /// notifications are lost across reconnects). Polling remains the fallback.
    pub fn wakeups(&self) -> tokio::sync::watch::Receiver<Wake> {
        match self {
            Store::Sqlite(s) => s.wakeups(),
            Store::Postgres(s) => s.wakeups(),
        }
    }

    pub async fn close(&self) {
        dispatch!(self, close())
    }

    // ----- schema -------------------------------------------------------------------------

    /// Applies pending migrations (idempotent; safe to run from several processes at once).
    pub async fn migrate(&self) -> Result<MigrateReport> {
        dispatch!(self, migrate())
    }

    /// The applied schema version; 0 when the database has no orch schema.
    pub async fn schema_version(&self) -> Result<i64> {
        dispatch!(self, schema_version())
    }

    /// Errors unless the schema is exactly the one this binary was built for.
    pub async fn check_schema(&self) -> Result<()> {
        let found = self.schema_version().await?;
        migrate::check_version(&self.target(), found)
    }

    /// The schema as text (tables, columns, indexes), for the test that holds the schema
    /// against a committed copy.
    pub async fn schema_dump(&self) -> Result<String> {
        dispatch!(self, schema_dump())
    }

    // ----- jobs ---------------------------------------------------------------------------

    /// Inserts a job (or finds the one that already carries its dedupe key).
    pub async fn enqueue(&self, job: NewJob) -> Result<Enqueued> {
        validate_new_job(&job)?;
        dispatch!(self, enqueue(job))
    }

    /// Inserts many jobs in one transaction; duplicates by dedupe key are skipped.
    /// Returns how many rows were inserted.
    pub async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<u64> {
        for job in &jobs {
            validate_new_job(job)?;
        }
        if jobs.is_empty() {
            return Ok(0);
        }
        dispatch!(self, enqueue_many(jobs))
    }

    /// Claims up to `claim.limit` available jobs in one statement, each with a lease.
    pub async fn claim(&self, claim: &Claim) -> Result<Vec<ClaimedJob>> {
        validate_claim(claim)?;
        dispatch!(self, complete_and_claim(&[], Some(claim))).map(|r| r.claimed)
    }

    /// Marks `done` jobs done (fenced) and claims new ones, in one transaction and, on
    /// PostgreSQL, one statement: a worker that finishes a job and takes the next pays one
    /// commit, not two.
    pub async fn complete_and_claim(
        &self,
        done: &[Lease],
        claim: Option<&Claim>,
    ) -> Result<CompleteAndClaim> {
        if let Some(claim) = claim {
            validate_claim(claim)?;
        }
        if done.is_empty() && claim.is_none() {
            return Ok(CompleteAndClaim::default());
        }
        dispatch!(self, complete_and_claim(done, claim))
    }

    /// Extends the leases of running jobs held by `worker_id`. Returns the leases that were
    /// lost (the job is no longer running under that attempt): their handlers must stop.
    pub async fn heartbeat(
        &self,
        worker_id: &str,
        leases: &[Lease],
        lease_ms: i64,
    ) -> Result<Vec<Lease>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        if lease_ms <= 0 {
            return Err(StoreError::Invalid(format!(
                "lease must be positive, got {lease_ms} ms"
            )));
        }
        dispatch!(self, heartbeat(worker_id, leases, lease_ms))
    }

    /// Ends a running job: `mark_job(done|failed)`, or back to the queue for a retry.
    /// Fenced: a stale attempt gets [`StoreError::LeaseLost`]. `event`, when given, is appended
    /// in the same transaction.
    pub async fn mark_job(
        &self,
        lease: Lease,
        outcome: JobOutcome,
        event: Option<NewEvent>,
    ) -> Result<()> {
        if let JobOutcome::Retry { delay_ms, .. } = &outcome
            && *delay_ms < 0
        {
            return Err(StoreError::Invalid(format!(
                "retry delay must not be negative, got {delay_ms} ms"
            )));
        }
        dispatch!(self, mark_job(lease, outcome, event))
    }

    /// Gives running jobs back to the queue without spending an attempt (graceful shutdown).
    /// Returns how many were released; a lease already lost is skipped.
    pub async fn release(&self, leases: &[Lease]) -> Result<u64> {
        if leases.is_empty() {
            return Ok(0);
        }
        dispatch!(self, release(leases))
    }

    /// Re-queues (attempt+1, with backoff) or fails (at the attempt limit) every running job
    /// whose lease has expired. Each expired job is rescued exactly once, even when several
    /// processes run this at the same time.
    pub async fn rescue_expired(&self, rescue: Rescue) -> Result<RescueReport> {
        dispatch!(self, rescue_expired(rescue))
    }

    /// Records that a worker on `node` is alive now: the node's beacon (a `done` job row of kind
    /// [`NODE_BEACON_KIND`] with dedupe key `node-beacon:<node>`, no new table or column), whose
    /// `finished_at` is the last time it was seen. Workers call it from their heartbeat; a claim
    /// with [`Claim::node_grace_ms`] takes jobs pinned to a node not seen for that long.
    pub async fn node_seen(&self, node: &str) -> Result<()> {
        if node.is_empty() || node.len() > 256 || node.contains('\0') {
            return Err(StoreError::Invalid(format!(
                "node name {node:?} must be 1-256 bytes without NUL"
            )));
        }
        dispatch!(self, node_seen(node))
    }

    /// Every node that has a beacon, with when it was first and last seen, by name.
    pub async fn nodes(&self) -> Result<Vec<NodeSeen>> {
        dispatch!(self, nodes())
    }

    /// Enqueues `job` on behalf of the running job `lease` and appends `event` with it, in one
    /// transaction: the follow-up and the record that says so exist together or not at all.
    /// Fenced: a stale attempt gets [`StoreError::LeaseLost`] and nothing is written. When the
    /// job already exists (its dedupe key: an earlier attempt enqueued it, with its event),
    /// nothing is written and the existing job is returned as a duplicate.
    pub async fn enqueue_fenced(
        &self,
        lease: Lease,
        job: NewJob,
        event: NewEvent,
    ) -> Result<Enqueued> {
        validate_new_job(&job)?;
        dispatch!(self, enqueue_fenced(lease, job, event))
    }

    /// Re-pins a running job to `node` (the node that took it over from a node gone longer than
    /// the grace) and appends `event`, in one transaction. Fenced: a stale attempt gets
    /// [`StoreError::LeaseLost`] and nothing changes.
    pub async fn take_over_job(&self, lease: Lease, node: &str, event: NewEvent) -> Result<()> {
        dispatch!(self, take_over_job(lease, node, event))
    }

    /// Ends now the leases of the running jobs `worker_id` holds: the caller knows that worker
    /// is dead (a process on the same machine that is gone, by pid and start time), so its jobs
    /// need not wait for their leases to run out; the next [`Store::rescue_expired`] requeues
    /// them as any crash (`job.rescued`, no attempt spent). Returns how many leases ended.
    pub async fn expire_leases_of(&self, worker_id: &str) -> Result<u64> {
        if worker_id.is_empty() {
            return Err(StoreError::Invalid("worker id must not be empty".into()));
        }
        dispatch!(self, expire_leases_of(worker_id))
    }

    /// Cancels a queued or running job. A running job's worker loses its lease.
    /// Returns false when the job had already ended.
    pub async fn cancel_job(&self, job_id: i64) -> Result<bool> {
        dispatch!(self, cancel_job(job_id))
    }

    /// Retention, one batch: deletes at most `limit` finished jobs (oldest first) that
    /// finished before `finished_before` and whose task ended before it (or that have no task),
    /// and records them in the same transaction as a `jobs.pruned` event carrying the running
    /// total. A crash loses the whole batch's deletion and its event together, never one
    /// without the other, so no job is counted as pruned twice or deleted unrecorded. Jobs of
    /// a live task are never deleted (restart-safe counters are counted from them); events,
    /// agent runs and tasks are never deleted.
    pub async fn prune_finished(&self, finished_before: Millis, limit: u32) -> Result<Pruned> {
        dispatch!(self, prune_finished(finished_before, limit))
    }

    /// Every job row in the store, exactly: a scan of the whole table, whose cost grows with
    /// history. For `orch gc`'s report and tests; the control views never call it.
    pub async fn count_all_jobs(&self) -> Result<i64> {
        dispatch!(self, count_all_jobs())
    }

    /// Every job retention has pruned so far, from the store (survives restarts).
    pub async fn pruned_total(&self) -> Result<i64> {
        dispatch!(self, pruned_total())
    }

    /// When the next queued job of these kinds becomes available (for sleeping precisely).
    pub async fn next_available_at(
        &self,
        kinds: &[String],
        node: Option<&str>,
    ) -> Result<Option<Millis>> {
        dispatch!(self, next_available_at(kinds, node))
    }

    pub async fn get_job(&self, job_id: i64) -> Result<Option<Job>> {
        dispatch!(self, get_job(job_id))
    }

    /// Counts a task's jobs of one kind, optionally only those whose `task_content` contains a
    /// marker substring. This is how deferral and tick counts survive restarts without a column.
    pub async fn count_jobs(&self, q: &JobCount) -> Result<i64> {
        dispatch!(self, count_jobs(q))
    }

    pub async fn task_jobs(&self, task_id: i64) -> Result<Vec<Job>> {
        dispatch!(self, task_jobs(task_id))
    }

    /// The queue at a glance, read from the active part of the table: exact counts of the
    /// queued and running jobs, and of the finished ones only those of the last
    /// [`RECENT_WINDOW_MS`] (`QueueStats::finished_since`); the running leases.
    pub async fn queue_stats(&self) -> Result<QueueStats> {
        dispatch!(self, queue_stats())
    }

    // ----- tasks --------------------------------------------------------------------------

    /// Creates a task with its first event and first job, in one transaction.
    pub async fn create_task(&self, task: NewTask) -> Result<Task> {
        if let Some(job) = &task.first_job {
            validate_new_job(job)?;
        }
        dispatch!(self, create_task(task))
    }

    pub async fn get_task(&self, task_id: i64) -> Result<Option<Task>> {
        dispatch!(self, get_task(task_id))
    }

    pub async fn get_task_by_work_item(&self, work_item_id: &str) -> Result<Option<Task>> {
        dispatch!(self, get_task_by_work_item(work_item_id))
    }

    /// Tasks, newest first.
    pub async fn list_tasks(&self, filter: &TaskFilter) -> Result<Vec<Task>> {
        dispatch!(self, list_tasks(filter))
    }

    /// Task counts by stage, over the whole table (a scan: for reports, not for the views).
    pub async fn count_tasks_by_stage(&self) -> Result<Vec<(String, i64)>> {
        dispatch!(self, count_tasks_by_stage())
    }

    /// What the control views count of tasks: the live ones by stage, exactly, and at the
    /// terminal stages only the tasks that ended at or after `since` (partial indexes, schema 2:
    /// the cost is the live and recently ended tasks, not the history). By stage.
    pub async fn active_tasks_by_stage(&self, since: Millis) -> Result<Vec<(String, i64)>> {
        dispatch!(self, active_tasks_by_stage(since))
    }

    /// The tasks that ended (reached a terminal stage) at or after `since` (the views' recent
    /// window: a range of the partial index `tasks_ended`), oldest ending first.
    pub async fn tasks_ended_since(&self, since: Millis) -> Result<Vec<Task>> {
        dispatch!(self, tasks_ended_since(since))
    }

    /// The bytes the store takes (SQLite: the database's pages; PostgreSQL: the four tables
    /// with their indexes and TOAST), for the benchmarks' size figures.
    pub async fn database_size(&self) -> Result<i64> {
        dispatch!(self, database_size())
    }

    /// Refreshes the planner's statistics after a bulk load (PostgreSQL `ANALYZE`; nothing on
    /// SQLite).
    pub async fn refresh_statistics(&self) -> Result<()> {
        dispatch!(self, refresh_statistics())
    }

    /// The compare-and-swap of a task's stage (see [`AdvanceStage`]).
    pub async fn advance_stage(&self, adv: AdvanceStage) -> Result<Advanced> {
        if adv.expected_stage == adv.new_stage {
            return Err(StoreError::Invalid(format!(
                "advance_stage from '{}' to itself",
                adv.expected_stage
            )));
        }
        if let Some(job) = &adv.next_job {
            validate_new_job(job)?;
        }
        dispatch!(self, advance_stage(adv, None))
    }

    /// [`Store::advance_stage`] that also refuses, with [`StoreError::TrackBusy`], to move the
    /// task while another task of its repo is at one of `exclusive.stages` (see [`Exclusive`]).
    pub async fn advance_stage_exclusive(
        &self,
        adv: AdvanceStage,
        exclusive: &Exclusive,
    ) -> Result<Advanced> {
        if adv.expected_stage == adv.new_stage {
            return Err(StoreError::Invalid(format!(
                "advance_stage from '{}' to itself",
                adv.expected_stage
            )));
        }
        if let Some(job) = &adv.next_job {
            validate_new_job(job)?;
        }
        dispatch!(self, advance_stage(adv, Some(exclusive)))
    }

    /// An operator's write at one stage visit, in one transaction: only while task
    /// `visit.task_id` is still at `visit.stage` with `visit.stage_seq` (a compare-and-swap on
    /// the visit, the task row locked), `job` is enqueued (its dedupe key defaulting to the
    /// visit's stage job key) and `event` appended on the task. A task that moved is
    /// [`StoreError::StageConflict`] and nothing is written; a job that already exists (an
    /// earlier write made it, with its event) writes nothing and comes back as a duplicate.
    /// With no job, only the event is written, under the same check.
    pub async fn write_at_visit(
        &self,
        visit: Visit,
        job: Option<NewJob>,
        event: NewEvent,
    ) -> Result<Option<Enqueued>> {
        if let Some(job) = &job {
            validate_new_job(job)?;
        }
        dispatch!(self, write_at_visit(visit, job, event))
    }

    /// The task of `repo` (other than `task_id`) at one of `exclusive`'s stages, as
    /// `(work_item_id, stage)`: who holds the track that task would enter. A read, not an
    /// admission: only [`Store::advance_stage_exclusive`] decides, in its transaction. A waiting
    /// task asks this first, so that a wait costs one indexed read instead of redoing its
    /// stage's finish.
    pub async fn track_holder(
        &self,
        repo: &str,
        task_id: i64,
        exclusive: &Exclusive,
    ) -> Result<Option<(String, String)>> {
        dispatch!(self, track_holder(repo, task_id, exclusive))
    }

    /// Fails the tasks left with no live job after one of their jobs failed for good
    /// (`finished_before` that instant; at most `limit`): the failure could not end them then,
    /// since another job was live, and nothing would move them now. Returns their ids.
    pub async fn fail_stranded_tasks(
        &self,
        finished_before: Millis,
        limit: u32,
    ) -> Result<Vec<i64>> {
        dispatch!(self, fail_stranded_tasks(finished_before, limit))
    }

    /// Cancels every live job of a task except `keep` (used with operator stage changes).
    pub async fn cancel_task_jobs(&self, task_id: i64, keep: Option<i64>) -> Result<u64> {
        dispatch!(self, cancel_task_jobs(task_id, keep))
    }

    // ----- events -------------------------------------------------------------------------

    pub async fn append_event(&self, event: NewEvent) -> Result<i64> {
        dispatch!(self, append_event(event))
    }

    /// An event a running job records, written only while `lease` holds; `StoreError::LeaseLost`
    /// (nothing written) once the job was rescued, cancelled, taken over or finished.
    pub async fn append_event_fenced(&self, lease: Lease, event: NewEvent) -> Result<i64> {
        dispatch!(self, append_event_fenced(lease, event))
    }

    /// A task's events, oldest first.
    pub async fn task_events(&self, task_id: i64) -> Result<Vec<Event>> {
        dispatch!(self, task_events(task_id))
    }

    /// The events of many tasks in one read per [`EVENTS_OF_TASKS_CHUNK`] tasks (a page
    /// listing tasks reads them all at once instead of one task at a time), by task in the
    /// order of `task_ids`' chunks, each task's oldest first; only the `kinds` given, or every
    /// kind when none is. Group them with [`group_by_task`].
    pub async fn events_of_tasks(&self, task_ids: &[i64], kinds: &[&str]) -> Result<Vec<Event>> {
        dispatch!(self, events_of_tasks(task_ids, kinds))
    }

    /// The tasks a report over `[since, until)` reads: live ones submitted before `until`,
    /// ended ones that ended at or after `since` and were submitted before `until`; `repo`:
    /// one repo's only. Bounded index reads (`tasks_live`, a range of `tasks_ended`).
    pub async fn tasks_alive_in(
        &self,
        since: Millis,
        until: Millis,
        repo: Option<&str>,
    ) -> Result<Vec<Task>> {
        dispatch!(self, tasks_alive_in(since, until, repo))
    }

    /// The tasks of `repo` a follower of its items reads (the forge sync): every live task,
    /// however many and however old, and the ones that ended at or after `ended_since`. Two
    /// index reads (`tasks_live`, a range of `tasks_ended`), no cap that could drop a live task.
    pub async fn tasks_followed(&self, repo: &str, ended_since: Millis) -> Result<Vec<Task>> {
        dispatch!(self, tasks_followed(repo, ended_since))
    }

    /// The newest event id of each of these tasks that has events, as `(task, event id)`: one
    /// statement per [`EVENTS_OF_TASKS_CHUNK`] tasks, in which each task costs one descent of
    /// the index `events_task` to the end of its range (a `max(id)` subquery per task), so the
    /// cost grows with the number of tasks asked about, not with their histories nor with the
    /// table. A follower compares it with what it read last to skip an unchanged history.
    pub async fn newest_event_ids(&self, task_ids: &[i64]) -> Result<Vec<(i64, i64)>> {
        dispatch!(self, newest_event_ids(task_ids))
    }

    /// The agent runs of these tasks, by task then oldest first (one statement per
    /// [`EVENTS_OF_TASKS_CHUNK`] tasks).
    pub async fn agent_runs_of_tasks(&self, task_ids: &[i64]) -> Result<Vec<AgentRun>> {
        dispatch!(self, agent_runs_of_tasks(task_ids))
    }

    /// What the delivery report over `range` reads (issue 32): each task
    /// [`Store::tasks_alive_in`] the range with its events of [`orch_domain::report::kinds`]
    /// and its agent runs, as the domain's records. Three bounded reads, the last two one
    /// statement per [`EVENTS_OF_TASKS_CHUNK`] tasks.
    pub async fn report_records(
        &self,
        range: orch_domain::report::Range,
        repo: Option<&str>,
    ) -> Result<Vec<orch_domain::report::ItemRecord>> {
        use orch_domain::report::{ItemEvent, ItemRecord, ItemRun};
        let tasks = self.tasks_alive_in(range.since, range.until, repo).await?;
        let ids: Vec<i64> = tasks.iter().map(|t| t.id).collect();
        let mut events = group_by_task(
            self.events_of_tasks(&ids, &orch_domain::report::kinds())
                .await?,
        );
        let mut runs: std::collections::HashMap<i64, Vec<ItemRun>> =
            std::collections::HashMap::new();
        for r in self.agent_runs_of_tasks(&ids).await? {
            runs.entry(r.task_id).or_default().push(ItemRun {
                backend: r.backend,
                model: r.model,
                cost_usd: r.cost_usd,
            });
        }
        Ok(tasks
            .into_iter()
            .map(|t| ItemRecord {
                events: events
                    .remove(&t.id)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|e| ItemEvent {
                        data: e.data_value(),
                        kind: e.kind,
                        stage: e.stage,
                        message: e.message,
                        at: e.created_at,
                    })
                    .collect(),
                runs: runs.remove(&t.id).unwrap_or_default(),
                repo: t.repo.into(),
                stage: t.stage.into(),
                created_at: t.created_at,
                updated_at: t.updated_at,
            })
            .collect())
    }

    /// The delivery report over `range` (`repo`: one repo's): [`Store::report_records`] read
    /// by [`orch_domain::report::report`].
    pub async fn report(
        &self,
        range: orch_domain::report::Range,
        repo: Option<&str>,
    ) -> Result<orch_domain::report::Report> {
        let records = self.report_records(range, repo).await?;
        Ok(orch_domain::report::report(&records, range))
    }

    /// Events of one kind (any task), oldest first, after `after_id`.
    pub async fn events_by_kind(
        &self,
        kind: &str,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<Event>> {
        dispatch!(self, events_by_kind(kind, after_id, limit))
    }

    // ----- agent runs ---------------------------------------------------------------------

    pub async fn start_agent_run(&self, run: NewAgentRun) -> Result<i64> {
        dispatch!(self, start_agent_run(run))
    }

    pub async fn finish_agent_run(&self, run_id: i64, finish: AgentRunFinish) -> Result<()> {
        dispatch!(self, finish_agent_run(run_id, finish))
    }

    pub async fn task_agent_runs(&self, task_id: i64) -> Result<Vec<AgentRun>> {
        dispatch!(self, task_agent_runs(task_id))
    }

    /// Tokens and cost a task has used so far.
    pub async fn task_usage(&self, task_id: i64) -> Result<Usage> {
        dispatch!(self, task_usage(task_id))
    }

    /// Whether any job is queued or running (a drained queue answers false).
    pub async fn has_live_jobs(&self) -> Result<bool> {
        dispatch!(self, has_live_jobs())
    }

    /// Tokens and cost of every agent run so far, by agent, sorted by agent.
    pub async fn usage_by_agent(&self) -> Result<Vec<(String, Usage)>> {
        dispatch!(self, usage_by_agent())
    }

    /// Usage of every agent run by the task's repo, the stage and the UTC day the run started,
    /// sorted by day, repo, stage (the cost report).
    pub async fn usage_by_repo_stage_day(&self) -> Result<Vec<UsageRow>> {
        dispatch!(self, usage_by_repo_stage_day())
    }

    /// How many agent runs each agent had, by outcome (`running`, `success`, …), sorted.
    pub async fn runs_by_agent_outcome(&self) -> Result<Vec<(String, String, i64)>> {
        dispatch!(self, runs_by_agent_outcome())
    }
}

/// Largest `task_content` accepted (1 MiB): payloads are references, not documents.
pub const MAX_TASK_CONTENT: usize = 1 << 20;

/// Tasks whose events [`Store::events_of_tasks`] reads in one statement.
pub const EVENTS_OF_TASKS_CHUNK: usize = 500;

/// The window of "recently finished" the control views count (`GET /queue`, `/metrics`, the
/// dashboard): 24 hours. Older history is not counted there (it is in the report and the
/// events), so a view costs the work in flight and this window, not the table.
pub const RECENT_WINDOW_MS: Millis = 24 * 3_600_000;

/// Events (as [`Store::events_of_tasks`] returns them) by task id, each task's oldest first.
pub fn group_by_task(events: Vec<Event>) -> std::collections::HashMap<i64, Vec<Event>> {
    let mut by_task: std::collections::HashMap<i64, Vec<Event>> = std::collections::HashMap::new();
    for e in events {
        if let Some(task_id) = e.task_id {
            by_task.entry(task_id).or_default().push(e);
        }
    }
    by_task
}

fn validate_new_job(job: &NewJob) -> Result<()> {
    let bad = |msg: String| Err(StoreError::Invalid(msg));
    if job.agent.is_empty()
        || job.agent.len() > 64
        || !job
            .agent
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
    {
        return bad(format!(
            "job kind {:?} must be 1-64 characters of [A-Za-z0-9-_.:]",
            job.agent
        ));
    }
    if job.delay_ms < 0 {
        return bad(format!(
            "delay must not be negative, got {} ms",
            job.delay_ms
        ));
    }
    if job.max_attempts < 1 {
        return bad(format!(
            "max_attempts must be at least 1, got {}",
            job.max_attempts
        ));
    }
    if job.task_content.len() > MAX_TASK_CONTENT {
        return bad(format!(
            "task_content is {} bytes, more than the {} allowed",
            job.task_content.len(),
            MAX_TASK_CONTENT
        ));
    }
    if job
        .dedupe_key
        .as_ref()
        .is_some_and(|k| k.is_empty() || k.len() > 512)
    {
        return bad("dedupe key must be 1-512 bytes".into());
    }
    // PostgreSQL's text cannot hold NUL; refuse it on both backends with one clear message.
    let has_nul = |s: &str| s.contains('\0');
    if has_nul(&job.task_content)
        || job.dedupe_key.as_deref().is_some_and(has_nul)
        || job.node.as_deref().is_some_and(has_nul)
    {
        return bad("task_content, dedupe key and node must not contain NUL characters".into());
    }
    Ok(())
}

fn validate_claim(claim: &Claim) -> Result<()> {
    if claim.limit == 0 || claim.limit > 10_000 {
        return Err(StoreError::Invalid(format!(
            "claim limit must be 1-10000, got {}",
            claim.limit
        )));
    }
    if claim.lease_ms <= 0 {
        return Err(StoreError::Invalid(format!(
            "lease must be positive, got {} ms",
            claim.lease_ms
        )));
    }
    if claim.node_grace_ms.is_some_and(|g| g <= 0) {
        return Err(StoreError::Invalid(format!(
            "node grace must be positive, got {:?} ms",
            claim.node_grace_ms
        )));
    }
    if claim.worker_id.is_empty() {
        return Err(StoreError::Invalid("worker id must not be empty".into()));
    }
    Ok(())
}

/// The dedupe key `advance_stage` gives a next job that has none
/// (`orch_domain::control::dedupe::stage_job`).
pub fn stage_job_key(task_id: i64, stage_seq: i64) -> String {
    orch_domain::control::dedupe::stage_job(task_id, stage_seq)
}

#[cfg(test)]
mod tests {
    use super::sqlite_file;

    #[test]
    fn a_sqlite_url_names_its_file_and_nothing_else_does() {
        assert_eq!(sqlite_file("sqlite:///p/orch.db"), Some("/p/orch.db"));
        assert_eq!(sqlite_file(" sqlite:rel/orch.db "), Some("rel/orch.db"));
        assert_eq!(sqlite_file("/p/orch.db"), Some("/p/orch.db"));
        assert_eq!(sqlite_file("postgres://u@h:5432/db"), None);
        assert_eq!(sqlite_file("/p/orch"), None, "a bare path must end in .db");
        assert_eq!(sqlite_file("http://h/x.db"), None);
    }
}
