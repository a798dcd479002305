//! The rows of the four tables and the parameter structs of every store operation.
//!
//! Times are epoch milliseconds (`i64`), always taken from the store's [`crate::Clock`], never
//! from the database server, so tests can move time without sleeping.

/// Epoch milliseconds.
pub type Millis = i64;

use orch_domain::ids::{Prefix, RepoName, StageName, WorkItemId};

/// The lifecycle of a job row.
///
/// `queued → running → done | failed | queued (retry, rescue, release)`; `queued | running → cancelled`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum JobState {
    Queued,
    Running,
    Done,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 5] = [
        JobState::Queued,
        JobState::Running,
        JobState::Done,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Done => "done",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Queued or running: the job still has work ahead of it.
    pub fn is_live(self) -> bool {
        matches!(self, JobState::Queued | JobState::Running)
    }
}

impl TryFrom<String> for JobState {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        JobState::parse(&s).ok_or_else(|| format!("unknown job state {s:?}"))
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A row of `jobs`.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Job {
    pub id: i64,
    pub task_id: Option<i64>,
    /// The job kind: which handler runs it (`developer`, `deployer`, `post-deploy-monitor`, …).
    pub agent: String,
    /// Free-form payload. Deferral markers live here as substrings (seed ORCH-115 D-2).
    pub task_content: String,
    #[sqlx(try_from = "String")]
    pub state: JobState,
    pub priority: i64,
    /// The attempt currently running or last run; bumped by every claim. It is the fencing token.
    pub attempt: i64,
    pub max_attempts: i64,
    pub available_at: Millis,
    pub lease_expires_at: Option<Millis>,
    pub locked_by: Option<String>,
    /// An idempotency key: at most one job row ever carries a given key.
    pub dedupe_key: Option<String>,
    /// Affinity: when set, only a worker on this node may claim the job.
    pub node: Option<String>,
    pub last_error: Option<String>,
    pub created_at: Millis,
    pub started_at: Option<Millis>,
    pub finished_at: Option<Millis>,
}

/// The fencing token of a claimed job: its id and the attempt the claim created.
/// Every state change of a running job must present it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    pub job_id: i64,
    pub attempt: i64,
}

/// A job taken by a worker, with the lease that fences its state changes.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedJob {
    pub job: Job,
    pub lease: Lease,
}

/// A job to insert. Build with [`NewJob::new`] and the chained setters.
#[derive(Debug, Clone, PartialEq)]
pub struct NewJob {
    pub task_id: Option<i64>,
    pub agent: String,
    pub task_content: String,
    /// Delay before the job becomes visible to workers (`available_at_delay_s` in the seeds), in ms.
    pub delay_ms: i64,
    pub priority: i64,
    pub max_attempts: i64,
    pub dedupe_key: Option<String>,
    pub node: Option<String>,
}

impl NewJob {
    pub const DEFAULT_MAX_ATTEMPTS: i64 = 3;

    pub fn new(agent: impl Into<String>, task_content: impl Into<String>) -> Self {
        NewJob {
            task_id: None,
            agent: agent.into(),
            task_content: task_content.into(),
            delay_ms: 0,
            priority: 0,
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS,
            dedupe_key: None,
            node: None,
        }
    }

    pub fn task(mut self, task_id: i64) -> Self {
        self.task_id = Some(task_id);
        self
    }

    /// `available_at_delay_s`: the job is invisible to workers for this many seconds.
    pub fn delay_s(mut self, seconds: i64) -> Self {
        self.delay_ms = seconds.saturating_mul(1000);
        self
    }

    pub fn delay_ms(mut self, ms: i64) -> Self {
        self.delay_ms = ms;
        self
    }

    pub fn priority(mut self, priority: i64) -> Self {
        self.priority = priority;
        self
    }

    pub fn max_attempts(mut self, max_attempts: i64) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    pub fn dedupe(mut self, key: impl Into<String>) -> Self {
        self.dedupe_key = Some(key.into());
        self
    }

    pub fn node(mut self, node: impl Into<String>) -> Self {
        self.node = Some(node.into());
        self
    }
}

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    pub job_id: i64,
    /// True when a job with the same dedupe key already existed; `job_id` is that job.
    pub duplicate: bool,
}

/// Parameters of a claim.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    /// Recorded in `locked_by`; heartbeats must present it.
    pub worker_id: String,
    /// At most this many jobs in one statement.
    pub limit: u32,
    pub lease_ms: i64,
    /// Job kinds this worker can run. A worker never claims a kind it has no handler for.
    pub kinds: Vec<String>,
    /// This worker's node: it may claim jobs pinned to it and unpinned jobs.
    pub node: Option<String>,
    /// The node grace: a job pinned to another node becomes claimable here once it has been
    /// ready for longer than this and that node has not been seen ([`crate::Store::node_seen`])
    /// for longer than this, or never. `None`: never take over another node's jobs.
    pub node_grace_ms: Option<i64>,
}

/// How a running job ended, as decided by its handler.
#[derive(Debug, Clone, PartialEq)]
pub enum JobOutcome {
    Done,
    /// Back to the queue for another attempt after `delay_ms`. At the attempt limit this
    /// becomes [`JobOutcome::Failed`].
    Retry {
        error: String,
        delay_ms: i64,
    },
    /// Final failure. If the job drove a task and the task has no other live job, the task
    /// moves to `failed` in the same transaction (it would otherwise be stranded).
    Failed {
        error: String,
    },
}

/// The result of [`crate::Store::complete_and_claim`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompleteAndClaim {
    /// Completions that lost their lease (stale attempt): nothing was changed for them.
    pub fenced: Vec<Lease>,
    pub claimed: Vec<ClaimedJob>,
}

/// Parameters of a rescue pass over expired leases.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rescue {
    /// Backoff before the re-queued attempt: `min(base * 2^(attempt-1), max)`.
    pub backoff_base_ms: i64,
    pub backoff_max_ms: i64,
    /// At most this many jobs per pass.
    pub limit: u32,
    /// Attempts lost to a dead worker do not count against `max_attempts`; a job whose
    /// worker died this many times while running it fails for good.
    pub max_crashes: i64,
}

impl Default for Rescue {
    fn default() -> Self {
        Rescue {
            backoff_base_ms: 1_000,
            backoff_max_ms: 300_000,
            limit: 1_000,
            max_crashes: 10,
        }
    }
}

impl Rescue {
    pub fn backoff_ms(&self, attempt: i64) -> i64 {
        let exp = attempt.clamp(1, 30) - 1;
        self.backoff_base_ms
            .saturating_mul(1_i64 << exp)
            .min(self.backoff_max_ms)
    }
}

/// What a rescue pass did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RescueReport {
    /// Jobs put back in the queue (id, new available_at).
    pub requeued: Vec<i64>,
    /// Jobs whose worker died `max_crashes` times, failed for good.
    pub failed: Vec<i64>,
    /// Tasks moved to `failed` because their only live job failed.
    pub failed_tasks: Vec<i64>,
}

/// What one retention batch ([`crate::Store::prune_finished`]) removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Jobs deleted by this batch.
    pub jobs: u64,
    /// Every job pruned so far, this batch included (the `jobs.pruned` events' running total).
    pub total: i64,
}

/// Counting jobs for restart-safe counters (defers, ticks, infra retries): the count is the state.
/// Only a live task's jobs are counted (a finished task counts 0): retention prunes jobs of
/// finished tasks only, so no count ever reads a job that pruning may remove, and a retried
/// task's counters are scoped to its new visit's `seq`, which no pruned job carries.
#[derive(Debug, Clone, PartialEq)]
pub struct JobCount {
    pub task_id: i64,
    pub agent: String,
    /// Only jobs whose `task_content` contains this substring (literal, not a pattern).
    pub content_contains: Option<String>,
}

/// A row of `tasks`, decoded and validated. There is no status column: the stage is the status.
///
/// The store checks the work item id, the repo and the stage when it reads the row (see
/// `common::TaskRow`), so no caller re-parses them: a value that is not a valid name
/// (a row written by hand, or by a version that did not validate) never reaches a path, a
/// branch name or a shell as if it had been checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub id: i64,
    pub work_item_id: WorkItemId,
    pub repo: RepoName,
    pub title: String,
    pub body: String,
    /// The stage is the status; `done`, `failed` and `cancelled` are terminal.
    pub stage: StageName,
    /// Bumped by every stage change: a stage visit's identity, and the operator CAS token.
    pub stage_seq: i64,
    pub branch: String,
    pub created_at: Millis,
    pub updated_at: Millis,
}

impl Task {
    pub fn is_terminal(&self) -> bool {
        self.stage.is_terminal()
    }
}

/// How the work item id of a new task is chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkItemSpec {
    /// The next free number for this prefix: `<prefix>-<max+1>`.
    Next { prefix: Prefix },
    /// An id chosen by the caller; it must be free.
    Exact(WorkItemId),
}

/// A task to create, with its first event and (optionally) its first job, in one transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTask {
    pub work_item: WorkItemSpec,
    pub repo: RepoName,
    pub title: String,
    pub body: String,
    pub stage: StageName,
    /// The branch is `<branch_prefix><work_item_id>`.
    pub branch_prefix: String,
    pub event: NewEvent,
    /// Its `task_id` is filled in by the store.
    pub first_job: Option<NewJob>,
}

/// What fences a stage change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// The caller's job lease: the job must belong to the task and still be running under
    /// this attempt (the CAS/lease contract of ORCH-114).
    Job(Lease),
    /// An operator command (approve, retry, cancel): the task's `stage_seq` must be unchanged
    /// since the operator read it.
    Seq(i64),
}

/// `advance_stage(task, expected_stage → new_stage)`: the only writer of `tasks.stage`.
#[derive(Debug, Clone, PartialEq)]
pub struct AdvanceStage {
    pub task_id: i64,
    pub expected_stage: StageName,
    pub new_stage: StageName,
    pub fence: Fence,
    /// Appended in the same transaction; `task_id` and `stage` are filled in by the store.
    pub event: NewEvent,
    /// Enqueued in the same transaction. Its `task_id` is filled in; without a dedupe key it
    /// gets `stage:<task_id>:<new stage_seq>`.
    pub next_job: Option<NewJob>,
}

/// One stage visit of a task, as an operator read it: what [`crate::Store::write_at_visit`]
/// compares before it writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visit {
    pub task_id: i64,
    pub stage: StageName,
    pub stage_seq: i64,
}

impl Visit {
    /// The visit `task` is at.
    pub fn of(task: &Task) -> Visit {
        Visit {
            task_id: task.id,
            stage: task.stage.clone(),
            stage_seq: task.stage_seq,
        }
    }
}

/// A guard on a stage change into a set of stages that at most one task of a repo may occupy at
/// a time (the repo's release track): the change is refused with [`crate::StoreError::TrackBusy`]
/// when another task of the same repo is at one of `stages`. Checked and applied in one
/// transaction, serialized per repo, so two tasks racing into the set cannot both win.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exclusive {
    pub stages: Vec<StageName>,
}

/// The result of a successful stage change.
#[derive(Debug, Clone, PartialEq)]
pub struct Advanced {
    pub task: Task,
    pub next_job_id: Option<i64>,
}

/// Task list filter with paging.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskFilter {
    pub stage: Option<String>,
    pub repo: Option<String>,
    pub limit: u32,
    pub offset: u32,
}

/// A row of `events`, append-only.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Event {
    pub id: i64,
    pub task_id: Option<i64>,
    pub job_id: Option<i64>,
    pub kind: String,
    /// The task's stage when the event was written (for a stage change: the new stage).
    pub stage: Option<String>,
    pub message: String,
    /// JSON text.
    pub data: String,
    pub created_at: Millis,
}

impl Event {
    /// The event's data as JSON; `Value::Null` when it has none or it is not JSON.
    pub fn data_value(&self) -> serde_json::Value {
        serde_json::from_str(&self.data).unwrap_or(serde_json::Value::Null)
    }
}

/// The outcome of a task at stage `stage` from its events (oldest first), by the domain's one
/// rule ([`orch_domain::outcome::outcome_of`]); `None` while the stage is not terminal.
pub fn outcome_of_events<'a>(
    stage: &str,
    events: impl IntoIterator<Item = &'a Event>,
) -> Option<orch_domain::outcome::TaskOutcome> {
    let events: Vec<&Event> = events.into_iter().collect();
    let data: Vec<serde_json::Value> = events.iter().map(|e| e.data_value()).collect();
    let views: Vec<orch_domain::outcome::EventView<'_>> = events
        .iter()
        .zip(&data)
        .map(|(e, d)| orch_domain::outcome::EventView {
            kind: &e.kind,
            stage: e.stage.as_deref(),
            message: &e.message,
            data: d,
        })
        .collect();
    orch_domain::outcome::outcome_of(stage, &views)
}

/// An event to append.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub task_id: Option<i64>,
    pub job_id: Option<i64>,
    pub kind: String,
    pub stage: Option<String>,
    pub message: String,
    /// JSON text; `{}` when empty.
    pub data: String,
}

impl NewEvent {
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        NewEvent {
            task_id: None,
            job_id: None,
            kind: kind.into(),
            stage: None,
            message: message.into(),
            data: "{}".to_owned(),
        }
    }

    pub fn task(mut self, task_id: i64) -> Self {
        self.task_id = Some(task_id);
        self
    }

    pub fn job(mut self, job_id: i64) -> Self {
        self.job_id = Some(job_id);
        self
    }

    pub fn stage(mut self, stage: impl Into<String>) -> Self {
        self.stage = Some(stage.into());
        self
    }

    pub fn data(mut self, json: impl Into<String>) -> Self {
        self.data = json.into();
        self
    }
}

/// A row of `agent_runs`: one execution of an agent backend.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AgentRun {
    pub id: i64,
    pub task_id: i64,
    pub job_id: Option<i64>,
    pub stage: String,
    pub agent: String,
    pub backend: String,
    pub model: Option<String>,
    pub attempt: i64,
    pub started_at: Millis,
    pub finished_at: Option<Millis>,
    /// `running`, `success`, `failed`, `timeout`, `error`, …
    pub outcome: String,
    pub exit_code: Option<i64>,
    pub input_tokens: Option<i64>,
    pub output_tokens: Option<i64>,
    pub cost_usd: Option<f64>,
    pub error: Option<String>,
    /// JSON text.
    pub data: String,
}

/// An agent run starting now.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAgentRun {
    pub task_id: i64,
    pub job_id: Option<i64>,
    pub stage: String,
    pub agent: String,
    pub backend: String,
    pub model: Option<String>,
    pub attempt: i64,
}

/// How an agent run ended.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AgentRunFinish {
    pub outcome: String,
    pub exit_code: Option<i64>,
    pub input_tokens: Option<i64>,
    pub output_tokens: Option<i64>,
    pub cost_usd: Option<f64>,
    pub error: Option<String>,
    /// JSON text; `{}` when empty.
    pub data: String,
}

/// Tokens and cost of agent runs (a task's, or an agent's over every task).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub runs: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    /// The sum of the costs that are known: a lower bound when `unknown_cost_runs > 0`.
    pub cost_usd: f64,
    /// Runs with no recorded cost (still running, or their cost could not be known): the
    /// total cost is unknown while there is one.
    pub unknown_cost_runs: i64,
}

/// Agent runs' usage of one repo, stage and UTC day (the cost report's row).
#[derive(Debug, Clone, PartialEq)]
pub struct UsageRow {
    pub repo: String,
    pub stage: String,
    /// Days since 1970-01-01 (UTC) of the runs' start.
    pub day: i64,
    pub usage: Usage,
}

/// Count of jobs of one kind in one state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindCount {
    pub agent: String,
    pub state: JobState,
    pub count: i64,
}

/// A node's beacon: when a worker on it was first and last seen (`Store::node_seen`).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeSeen {
    pub node: String,
    pub first_seen_ms: Millis,
    pub last_seen_ms: Millis,
}

/// A running job's lease as shown in `GET /queue`.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveLease {
    pub job_id: i64,
    pub task_id: Option<i64>,
    pub agent: String,
    pub worker: Option<String>,
    pub attempt: i64,
    pub expires_at: Option<Millis>,
    /// The work item of the job's task (read with the lease, in the same query).
    pub work_item_id: Option<String>,
}

/// The queue at a glance: exact counts of the jobs in flight, and of the finished jobs only
/// those that finished since `finished_since` (the view's recent window, [`crate::RECENT_WINDOW_MS`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueStats {
    pub counts: Vec<KindCount>,
    /// `available_at` of the oldest job that is ready to run but not yet claimed.
    pub oldest_ready_at: Option<Millis>,
    /// Running jobs, soonest expiry first (at most 500).
    pub leases: Vec<LiveLease>,
    pub now: Millis,
    /// The start of the window the finished counts cover (`now` − [`crate::RECENT_WINDOW_MS`]).
    pub finished_since: Millis,
}

/// A wake-up of the store's workers ([`crate::Store::wakeups`]): `seq` moves on with every one;
/// `now_seq` moves on with every announcement of a job available now (or at an unknown time: a
/// stage change, a NOTIFY without a due time), so a worker that missed one in a burst of
/// announcements still sees it; `due_at` is the soonest time (epoch ms) at which a job announced
/// since the last due one becomes available (`i64::MIN`: now). A worker woken only for a job due
/// later moves its next poll up to that time instead of claiming at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wake {
    pub seq: u64,
    pub now_seq: u64,
    pub due_at: Millis,
}

impl Default for Wake {
    fn default() -> Self {
        Wake {
            seq: 0,
            now_seq: 0,
            due_at: Millis::MIN,
        }
    }
}

impl Wake {
    /// The next wake-up: one more, for a job due at `due_at` (`Millis::MIN`: now), announced
    /// at `now`. An earlier announcement still in the future is kept if it is sooner.
    pub fn next(self, due_at: Millis, now: Millis) -> Wake {
        let due_at = if self.due_at > now {
            self.due_at.min(due_at)
        } else {
            due_at
        };
        Wake {
            seq: self.seq.wrapping_add(1),
            now_seq: if due_at <= now {
                self.now_seq.wrapping_add(1)
            } else {
                self.now_seq
            },
            due_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An announcement for a job due now is not lost when one for a later job follows before
    /// a worker reads the wake-up: `now_seq` keeps it.
    #[test]
    fn a_job_due_now_survives_a_later_announcement() {
        let now = 1_000;
        let w = Wake::default().next(now + 5_000, now);
        assert_eq!((w.now_seq, w.due_at), (0, now + 5_000));
        let w = w.next(Millis::MIN, now).next(now + 9_000, now);
        assert_eq!(w.now_seq, 1, "the job due now is still announced");
        assert_eq!(w.due_at, now + 9_000);
        let w = w.next(now - 1, now);
        assert_eq!(w.now_seq, 2, "a due time already past is now");
        assert_eq!(w.seq, 4);
    }
}
