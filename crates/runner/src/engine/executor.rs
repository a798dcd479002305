//! The contract between the pipeline engine and whatever does a stage's work (an LLM agent
//! backend or a deterministic runner). The engine owns everything around the work: loading the
//! task, the worktree, committing artifacts, the gate, the decision and the fenced stage
//! change. An executor only does the work and reports what happened.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::BoxFuture;

use orch_domain::config::{RepoConfig, Settings};
use orch_domain::gate::GateOutcome;
use orch_domain::ids::{ArtifactName, RepoName, WorkItemId};
use orch_domain::pipeline::StageDef;
use orch_exec::git::Git;
use orch_store::{Job, Lease, Store, Task};
use tokio_util::sync::CancellationToken;

use crate::counters::Counters;

/// Everything an executor gets for one stage attempt.
#[derive(Clone)]
pub struct StageRun {
    pub store: Store,
    /// The job being run and its fencing token. Executors that need to change job state use
    /// this lease; the stage itself is changed only by the engine.
    pub job: Job,
    pub lease: Lease,
    /// Cancelled when the lease is lost or the process stops hard: stop and return.
    pub cancel: CancellationToken,
    pub task: Task,
    pub work_item: WorkItemId,
    pub stage: StageDef,
    pub repo_name: RepoName,
    pub repo: RepoConfig,
    pub settings: Settings,
    /// `<repos_dir>`: sentinel state dirs live here (`.post-deploy-state-<repo>/…`).
    pub repos_dir: PathBuf,
    /// The repo's main checkout, on its default branch (`<repos_dir>/<repo>`).
    pub repo_dir: PathBuf,
    /// The work item's own worktree (`<repos_dir>/<repo>/worktrees/<id>`), on branch
    /// `orch/<id>`, already created and up to date — unless the executor defers it
    /// ([`StageExecutor::defers_worktree`]): then [`StageRun::ensure_worktree`] first.
    pub worktree: PathBuf,
    /// `docs/work-items/<id>` inside the worktree.
    pub artifact_dir: PathBuf,
    /// The failing artifact when this visit is a loop back (its name and content).
    pub feedback: Option<(ArtifactName, String)>,
    /// Loops back to implementation so far (0 for a deferring executor's run: the engine reads
    /// them when it decides).
    pub loops: u32,
    pub git: Git,
    pub counters: Arc<Counters>,
    /// This machine's node name (for jobs pinned to local state).
    pub node: String,
    /// Whether the worktree is still to be prepared (a deferring executor's job).
    pub prep: WorktreePrep,
    /// Where an agent's stage began (its branch and commit), which it must not move; `None`
    /// for a runner's stage.
    pub start: Option<StageStart>,
}

/// The branch an agent's stage works on and the commit it began from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageStart {
    /// `orch/<id>`.
    pub branch: String,
    /// Its commit when the stage began.
    pub head: String,
}

/// The worktree's preparation: done before the executor runs (the default), or deferred to
/// its first [`StageRun::ensure_worktree`].
#[derive(Clone, Default)]
pub struct WorktreePrep(Option<Arc<Deferred>>);

struct Deferred {
    prepare: Box<dyn Fn() -> BoxFuture<'static, anyhow::Result<()>> + Send + Sync>,
    done: tokio::sync::OnceCell<()>,
}

impl WorktreePrep {
    /// A preparation run by `prepare` on first use, at most once (until it succeeds).
    pub fn deferred(
        prepare: impl Fn() -> BoxFuture<'static, anyhow::Result<()>> + Send + Sync + 'static,
    ) -> WorktreePrep {
        WorktreePrep(Some(Arc::new(Deferred {
            prepare: Box::new(prepare),
            done: tokio::sync::OnceCell::new(),
        })))
    }

    /// True when the executor defers the worktree ([`StageExecutor::defers_worktree`]).
    pub fn is_deferred(&self) -> bool {
        self.0.is_some()
    }

    /// True once the worktree is ready (always, unless deferred and not yet used).
    pub fn is_ready(&self) -> bool {
        self.0.as_ref().is_none_or(|d| d.done.initialized())
    }
}

impl StageRun {
    /// The path of artifact `name` in the worktree.
    pub fn artifact_path(&self, name: &str) -> PathBuf {
        self.artifact_dir.join(name)
    }

    /// Writes the stage's document `name` in the work item's folder, atomically and through
    /// real folders only (a folder replaced by a link is refused, never followed:
    /// [`crate::fsutil::write_in_worktree`]).
    pub fn write_document(&self, name: &str, content: &str) -> anyhow::Result<()> {
        let rel = std::path::Path::new(&self.work_item.artifact_dir()).join(name);
        crate::fsutil::write_in_worktree(&self.worktree, &rel, content)
    }

    /// Makes sure the worktree is prepared (created, reset to the branch's committed state,
    /// caught up with a shared branch) before the executor writes into it. A no-op when the
    /// engine prepared it before the run, and after the first success.
    pub async fn ensure_worktree(&self) -> anyhow::Result<()> {
        let Some(d) = &self.prep.0 else {
            return Ok(());
        };
        d.done.get_or_try_init(|| (d.prepare)()).await.map(|_| ())
    }

    /// The key of this job's next command labelled `label`, for [`orch_exec::Cmd::supervised`]:
    /// the same job run again (orch restarted) asks for the same keys in the same order and
    /// adopts its commands instead of running them twice.
    pub fn command_key(&self, label: &str) -> String {
        orch_exec::supervise::next_key(self.job.id, label)
    }

    /// Records that a command of this job (`label`, run with key `key`) was adopted from an
    /// earlier orch or run again because its record was lost; nothing for a command this
    /// process started. A failure to record is logged: the command's result stands.
    pub async fn note_supervision(&self, label: &str, key: &str, out: &orch_exec::Output) {
        use orch_domain::control::events;
        use orch_exec::supervise::Supervision;
        let (kind, message, state) = match out.supervision {
            Supervision::AdoptedRunning => (
                events::COMMAND_ADOPTED,
                format!(
                    "`{label}` was started by an earlier orch and still ran: adopted and waited for, not run again"
                ),
                "running",
            ),
            Supervision::AdoptedFinished => (
                events::COMMAND_ADOPTED,
                format!(
                    "`{label}` was started by an earlier orch and ended while orch was away: its result was taken, not run again"
                ),
                "finished",
            ),
            Supervision::Restarted => (
                events::COMMAND_RERUN,
                format!(
                    "`{label}` was started by an earlier orch whose record was lost (no result, supervisor gone): run again"
                ),
                "rerun",
            ),
            Supervision::Direct | Supervision::Started => return,
        };
        let event = orch_store::NewEvent::new(kind, message)
            .task(self.task.id)
            .job(self.job.id)
            .stage(self.stage.name.as_str())
            .data(serde_json::json!({"label": label, "key": key, "state": state}).to_string());
        if let Err(e) = self.store.append_event_fenced(self.lease, event).await {
            tracing::warn!(work_item = %self.work_item, label, error = %e, "cannot record a command's adoption");
        }
    }

    /// Records an event about an agent's session (`agent.session_resumed`,
    /// `agent.session_lost`), fenced by this job's lease. A failure is logged.
    pub async fn note_session(&self, kind: &str, message: String, data: serde_json::Value) {
        let event = orch_store::NewEvent::new(kind, message)
            .task(self.task.id)
            .job(self.job.id)
            .stage(self.stage.name.as_str())
            .data(data.to_string());
        if let Err(e) = self.store.append_event_fenced(self.lease, event).await {
            tracing::warn!(work_item = %self.work_item, kind, error = %e, "cannot record an agent session's event");
        }
    }

    /// This job's payload without any markers: what a re-enqueued job of the same stage visit
    /// should carry before its own marker is appended.
    pub fn base_content(&self) -> String {
        crate::engine::StageJob::from_content(&self.job.task_content)
            .map(|j| j.to_content())
            .unwrap_or_else(|_| self.job.task_content.clone())
    }
}

/// What a stage attempt produced.
#[derive(Debug)]
pub enum StageEffect {
    /// The work is done and its artifacts are in the worktree: the engine commits them,
    /// reads them back through the stage's gate, decides and advances. `outcome` replaces the
    /// gate for stages without artifacts (deploy) and is combined with it otherwise: when set,
    /// it is the outcome used for the decision.
    Produced { outcome: Option<GateOutcome> },
    /// Come back later within the same stage visit: the engine enqueues a job of the same kind
    /// after `delay_ms` whose content carries `marker` (restart-safe counting of defers and
    /// ticks: the count is the number of such jobs, seed ORCH-115 D-2), commits any files the
    /// executor wrote, marks this job done, and leaves the stage unchanged.
    Requeue {
        /// Milliseconds until the next job is available (a watch aims at its slot's instant).
        delay_ms: u64,
        marker: String,
        reason: String,
    },
    /// Go on at once, but behind every job that is due: like `Requeue` with no delay, at
    /// [`YIELD_PRIORITY`]. For heavy work that must not hold a worker's slot while lighter,
    /// time-bound jobs wait for one (a watch's ending, its git commit and its reaction, behind
    /// the polls of the other watches due in the same instant).
    Yield { marker: String, reason: String },
    /// The attempt cannot succeed and retrying will not help (over budget, misconfigured
    /// stage): the job fails for good and the task goes to `failed` with `reason`.
    Failed { reason: String },
}

/// The priority of a [`StageEffect::Yield`] job: below every job enqueued at the default (0).
pub const YIELD_PRIORITY: i64 = -1;

/// Does the work of one kind of stage.
#[async_trait::async_trait]
pub trait StageExecutor: Send + Sync + 'static {
    /// Runs one attempt. An `Err` is a transient failure: the job is retried with backoff
    /// (a new attempt) until its attempt limit, then the task fails with the error.
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect>;

    /// True for an executor whose jobs mostly leave the worktree alone (a watch's ticks): the
    /// engine then prepares it only when the executor calls [`StageRun::ensure_worktree`] (which
    /// it must before writing there) or produces its result, and commits a requeue's progress
    /// only when it was prepared. Saves the git work of every such job.
    fn defers_worktree(&self) -> bool {
        false
    }

    /// How long after its stage is entered the stage's first job is due, in seconds (the
    /// watch's first poll waits for the repo's `post_deploy.initial_delay_s`); 0: at once.
    fn first_delay_s(&self, repo: &RepoConfig) -> u64 {
        let _ = repo;
        0
    }

    /// The engine moved `task` to `failed` (from any stage): an executor that keeps state of
    /// its own for a task outside the database (the deploy's markers, the watch's files under
    /// `repos_dir`) ends it here, so nothing stays armed for a task that is over. Never fails.
    fn task_failed(&self, repos_dir: &Path, task: &Task, reason: &str) {
        let _ = (repos_dir, task, reason);
    }
}

/// The executors a process has, by name ([`orch_domain::pipeline::StageDef::executor`]): the
/// runtime fills it with the built-in ones and [`crate::engine::Engine::install`] gives each
/// stage of the pipeline the one its descriptor names.
#[derive(Clone, Default)]
pub struct Executors {
    by_name: std::collections::BTreeMap<String, Arc<dyn StageExecutor>>,
}

impl Executors {
    pub fn new() -> Executors {
        Executors::default()
    }

    /// Adds (or replaces) the executor called `name`.
    pub fn with(mut self, name: &str, executor: Arc<dyn StageExecutor>) -> Executors {
        self.by_name.insert(name.to_owned(), executor);
        self
    }

    /// The executor called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<dyn StageExecutor>> {
        self.by_name.get(name).cloned()
    }

    /// The names it holds, in order.
    pub fn names(&self) -> Vec<&str> {
        self.by_name.keys().map(String::as_str).collect()
    }
}
