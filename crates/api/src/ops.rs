//! The operations the HTTP edge asks of the running orchestrator: submit, approve, retry,
//! cancel, and the in-process state that lives nowhere in the database (runner counters, armed
//! post-deploy watches, artifact files on disk).
//!
//! The api crate defines this trait and the orchestrator implements it, so the api never depends
//! on the runner. Everything here is plain Rust: JSON shapes live in [`crate::dto`] only.

use async_trait::async_trait;
pub use orch_domain::control::actor::Actor;

/// A new work item to submit (`POST /tasks`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitRequest {
    /// A repo declared in `orch.toml`.
    pub repo: String,
    /// One line; already trimmed and non-empty.
    pub title: String,
    /// Free text (may be empty).
    pub body: String,
}

/// One webhook delivery from a forge (`POST /hooks/github/{repo}`), as received: the raw
/// body (its signature is over these bytes) and the headers orch reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookDelivery {
    /// The repo named in the URL (not yet checked against the config).
    pub repo: String,
    /// `X-GitHub-Event`.
    pub event: Option<String>,
    /// `X-GitHub-Delivery`.
    pub delivery: Option<String>,
    /// `X-Hub-Signature-256`.
    pub signature: Option<String>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

/// What orch did with a delivery whose signature held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WebhookReply {
    /// The item is created (or was already): `duplicate` when this delivery id was
    /// taken before.
    Queued {
        work_item_id: String,
        duplicate: bool,
    },
    /// Nothing for orch in it, and why.
    Ignored(String),
}

/// What a submit created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitResult {
    pub work_item_id: String,
    pub task_id: i64,
}

/// In-process counters of one deterministic runner or worker, e.g. `staging_runner` with
/// `runs, success, failed, tool_error, deferred` (design.md §5 D-4). Not persisted; shown read-only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerCounters {
    /// The runner's name (`staging_runner`, `merge_gate`, `worker`, …).
    pub runner: String,
    /// `(counter name, value)` in display order.
    pub counters: Vec<(String, u64)>,
}

/// An armed post-deploy watch (design.md §7), including a stale `armed` without `done` after a crash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub work_item_id: String,
    pub repo: String,
    /// Epoch milliseconds; `None` when the watch's `armed` file is unreadable.
    pub armed_at_ms: Option<i64>,
    /// Epoch milliseconds; `None` when the watch's `armed` file is unreadable.
    pub deadline_ms: Option<i64>,
    /// The deployed revision being watched (`unknown (state unreadable)` when it cannot be read).
    pub revision: String,
    /// Polls recorded in the series so far.
    pub polls: u64,
    /// What is wrong with the watch's state (a corrupt `armed`, lost evidence), if anything.
    pub problem: Option<String>,
}

/// A repo's release track (one release at a time): who holds it and who waits for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseTrack {
    pub repo: String,
    /// The work item on the track and its stage, if any.
    pub holder: Option<(String, String)>,
    /// Why the holder keeps the repo held (`on_failure = "hold"`, a failed revert), if it does.
    pub held: Option<String>,
    /// Work items whose stage is done and that wait to enter the track, oldest first.
    pub waiting: Vec<String>,
}

/// One poll of a post-deploy watch's series, for the dashboard's inline chart.
#[derive(Debug, Clone, PartialEq)]
pub struct SeriesPoint {
    /// When the poll ran (epoch ms).
    pub at_ms: i64,
    /// The poll's status: `PASS`, `FAIL`, `ERROR` or `NODATA`.
    pub status: String,
    /// A measured value to plot (e.g. a latency in ms); `None` draws a status-only bar.
    pub value: Option<f64>,
}

/// One artifact file of a work item (`docs/work-items/<id>/NN-name.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactFile {
    /// File name inside the work item's folder, e.g. `02-requirements.md`.
    pub name: String,
    /// The file's text (frontmatter + body).
    pub content: String,
}

/// Why an operation was refused. Each variant maps to one HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// The work item / repo does not exist (404).
    #[error("not found: {0}")]
    NotFound(String),
    /// The task is not in a state that allows this (409), e.g. approving a task that does not
    /// wait for approval, or a concurrent stage change.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The request is well-formed but its content is refused (422), e.g. an unknown repo.
    #[error("invalid: {0}")]
    Invalid(String),
    /// Something broke on the server side (500). The message is logged and returned.
    #[error("internal error: {0}")]
    Internal(String),
    /// The caller could not prove who it is (401): a webhook delivery's signature.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// The database cannot be reached or used right now (503).
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
}

impl From<anyhow::Error> for OpError {
    fn from(e: anyhow::Error) -> Self {
        let down = e
            .chain()
            .filter_map(|c| c.downcast_ref::<orch_store::StoreError>())
            .any(orch_store::StoreError::is_unavailable);
        if down {
            OpError::Unavailable(format!("{e:#}"))
        } else {
            OpError::Internal(format!("{e:#}"))
        }
    }
}

impl From<orch_store::StoreError> for OpError {
    fn from(e: orch_store::StoreError) -> Self {
        use orch_store::StoreError as S;
        match &e {
            S::TaskNotFound(_) | S::JobNotFound(_) => OpError::NotFound(e.to_string()),
            S::StageConflict { .. } | S::WorkItemTaken(_) | S::LeaseLost { .. } => {
                OpError::Conflict(e.to_string())
            }
            S::Invalid(_) => OpError::Invalid(e.to_string()),
            _ if e.is_unavailable() => OpError::Unavailable(e.to_string()),
            _ => OpError::Internal(e.to_string()),
        }
    }
}

/// A latency histogram read at one moment: cumulative bucket counts, as Prometheus wants them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    /// `(upper bound in seconds, observations ≤ bound)`, ascending; +Inf is `count`.
    pub buckets: Vec<(f64, u64)>,
    pub sum_seconds: f64,
    pub count: u64,
}

/// The worker's timings in this process (reset on restart), for `/metrics`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WorkerTimings {
    /// Handler run time, by job kind (agent), sorted by kind.
    pub job_seconds: Vec<(String, Histogram)>,
    /// From a job becoming ready to its claim.
    pub claim_wait: Histogram,
    /// Round trip of one claim statement.
    pub claim_query: Histogram,
}

/// The orchestrator as seen from the HTTP edge. Implemented by the `orch` binary; tests use a
/// small recording implementation. Work item ids passed in are already validated.
#[async_trait]
pub trait Operations: Send + Sync {
    /// Creates a task for a new work item (stage `intake`, first job enqueued); `by` made the
    /// call (recorded in its event).
    async fn submit(&self, req: SubmitRequest, by: &Actor) -> Result<SubmitResult, OpError>;
    /// Takes a forge's webhook delivery: verifies its signature, then queues the item of the
    /// labeled issue it is about (once per delivery id, once per issue). A refused delivery
    /// changes nothing. The default (no forge here) refuses every delivery as not found.
    async fn forge_webhook(&self, delivery: WebhookDelivery) -> Result<WebhookReply, OpError> {
        Err(OpError::NotFound(format!(
            "no forge webhook for repo {}",
            delivery.repo
        )))
    }
    /// Releases a task waiting at an approval gate.
    async fn approve(&self, work_item_id: &str, by: &Actor) -> Result<(), OpError>;
    /// Re-runs a failed task's last stage.
    async fn retry(&self, work_item_id: &str, by: &Actor) -> Result<(), OpError>;
    /// Moves a task to `cancelled` and cancels its live jobs.
    async fn cancel(&self, work_item_id: &str, by: &Actor) -> Result<(), OpError>;
    /// Counters of every deterministic runner and worker in this process. Never fails.
    async fn runner_counters(&self) -> Vec<RunnerCounters>;
    /// Armed post-deploy watches on this machine. Never fails (a corrupt sentinel is skipped
    /// and logged by the implementation).
    async fn active_observations(&self) -> Vec<Observation>;
    /// The release tracks of the repos with a holder or waiters. Never fails; the default is
    /// empty (no runner here).
    async fn release_tracks(&self) -> Vec<ReleaseTrack> {
        Vec::new()
    }
    /// The work item's artifact files, in name order.
    async fn artifacts(&self, work_item_id: &str) -> Result<Vec<ArtifactFile>, OpError>;
    /// The polls recorded so far by the armed watch of a work item, oldest first. Never fails;
    /// the default (no series available) is empty and the dashboard then shows only counts.
    async fn observation_series(&self, work_item_id: &str) -> Vec<SeriesPoint> {
        let _ = work_item_id;
        Vec::new()
    }
    /// The text of a repo's lessons file on this machine, when it is readable. Never fails;
    /// the default (not available) is `None` and the repo page then lists the
    /// `lessons.recorded` events only.
    async fn repo_lessons(&self, repo: &str) -> Option<String> {
        let _ = repo;
        None
    }
    /// The repos whose agents and tests run unsandboxed (`sandbox = "off"`), for the
    /// dashboard's warning. Never fails; the default (no configuration here) is empty.
    fn unsandboxed_repos(&self) -> Vec<String> {
        Vec::new()
    }
    /// The in-process worker's timings. Never fails; the default (no worker here) is empty.
    async fn worker_timings(&self) -> WorkerTimings {
        WorkerTimings::default()
    }

    /// The configuration this process runs (`/healthz` shows it); `None` when unknown.
    fn config_state(&self) -> Option<ConfigReport> {
        None
    }

    /// Agent run `run_id`'s transcript and diff as kept on this machine (see
    /// `orch_runner::agents::transcript`). Never fails; the default (none kept here) is
    /// `None`.
    async fn run_transcript(&self, work_item_id: &str, run_id: i64) -> Option<RunTranscript> {
        let _ = (work_item_id, run_id);
        None
    }
}

/// An agent run's transcript file and the diff it left, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunTranscript {
    /// The transcript's text (in the format of the run's backend).
    pub text: String,
    /// The worktree's changes after the run, when any.
    pub diff: Option<String>,
}

/// What configuration a running process uses: its reload generation, and whether the file on
/// disk differs from it (invalid, or changed settings that need a restart).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigReport {
    pub generation: u64,
    pub loaded_at_ms: i64,
    /// Why the file on disk is not in use (it is invalid).
    pub stale: Option<String>,
    /// Changed keys that only a restart applies.
    pub restart_needed: Vec<String>,
}
