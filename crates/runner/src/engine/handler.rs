//! The stage job handler: everything around an executor's work (see the module docs of
//! [`crate::engine`]). Every stage change goes through `advance_stage` fenced by the job's
//! lease; a job whose stage visit is over is a no-op, so a re-run after a crash at any instant
//! never applies a stage twice.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use orch_domain::config::Config;
use orch_domain::control::{self, dedupe, events, markers};
use orch_domain::gate::{GateOutcome, Verdict};
use orch_domain::ids::{ArtifactName, StageName, WorkItemId};
use orch_domain::payload::{self, NodeTakeover, StageChange, StageRequeued};
use orch_domain::pipeline::{Decision, Pipeline, StageDef, StageKind};
use orch_exec::git::{Git, Pathspec};
use orch_store::{
    AdvanceStage, Exclusive, Fence, JobState, NewEvent, NewJob, Store, StoreError, Task,
};

use super::{
    Executors, StageEffect, StageExecutor, StageJob, StageRun, StageStart, WorktreePrep, artifacts,
    guard,
};
use crate::counters::Counters;
use crate::repos::{self, RepoPaths};
use crate::worker::{JobContext, JobHandler, Outcome, Registry};

/// Attempts of one stage job before its task fails.
pub const STAGE_ATTEMPTS: i64 = 3;
/// How long a task waiting to enter the release track waits between tries.
pub const TRACK_WAIT_S: u64 = 3;

/// Where the engine finds things.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The config the process started with (its pipeline and job kinds).
    pub config: Arc<Config>,
    /// The config in use: read once at the start of each job (repos, settings), so a reloaded
    /// `orch.toml` applies from the next job on.
    pub live: crate::live_config::LiveConfig,
    pub pipeline: Arc<Pipeline>,
    /// The project root: relative repo paths are resolved against it.
    pub root: PathBuf,
    pub repos_dir: PathBuf,
    pub node: String,
}

/// The pipeline engine: handles the jobs of every stage.
pub struct Engine {
    store: Store,
    cfg: EngineConfig,
    git: Git,
    /// Each stage's executor, by stage name ([`Engine::install`]).
    executors: HashMap<String, Arc<dyn StageExecutor>>,
    counters: Arc<Counters>,
    /// One stage job per task at a time in this process: two jobs of one stage visit (a
    /// rescued attempt and its own follow-up, after a crash between the two) must not share the
    /// worktree at once.
    task_locks: std::sync::Mutex<HashMap<i64, Arc<tokio::sync::Mutex<()>>>>,
}

/// A new task's first stage and the job that runs it (visit 0), `None` for a pipeline without
/// stages. Needs only the pipeline: a submit inserts one row and builds no engine.
pub fn first_job(pipeline: &Pipeline) -> Option<(StageName, NewJob)> {
    let first = pipeline.stages.first()?;
    let stage = first.name.clone();
    let job = NewJob::new(
        job_kind(first),
        StageJob {
            stage: stage.to_string(),
            seq: 0,
        }
        .to_content(),
    )
    .max_attempts(STAGE_ATTEMPTS);
    Some((stage, job))
}

/// The job kind of a stage ([`StageDef::job_kind`]: its agent, else its own name).
pub fn job_kind(stage: &StageDef) -> String {
    stage.job_kind().to_owned()
}

/// The guard for entering the release track of `pipeline`: its stages whose descriptor says
/// [`StageDef::release_track`].
pub fn release_track(pipeline: &Pipeline) -> Exclusive {
    Exclusive {
        stages: pipeline.release_track(),
    }
}

impl Engine {
    pub fn new(store: Store, cfg: EngineConfig, counters: Arc<Counters>) -> Engine {
        Engine {
            store,
            cfg,
            git: Git::new(),
            executors: HashMap::new(),
            counters,
            task_locks: std::sync::Mutex::new(HashMap::new()),
        }
    }

    fn task_lock(&self, task_id: i64) -> Arc<tokio::sync::Mutex<()>> {
        match self.task_locks.lock() {
            Ok(mut m) => {
                // Forget locks nobody holds or waits for, so the map stays small.
                if m.len() > 1024 {
                    m.retain(|_, l| Arc::strong_count(l) > 1);
                }
                m.entry(task_id).or_default().clone()
            }
            Err(_) => Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// Gives every stage of the pipeline the executor its descriptor names
    /// ([`StageDef::executor`]) from `executors`: how the runtime wires the stages. Fails,
    /// installing nothing, when a stage names an executor that `executors` lacks.
    pub fn install(&mut self, executors: &Executors) -> Result<()> {
        let mut chosen = Vec::new();
        let mut missing = Vec::new();
        for def in &self.cfg.pipeline.stages {
            match executors.get(&def.executor) {
                Some(e) => chosen.push((def.name.as_str().to_owned(), e)),
                None => missing.push(format!("`{}` (executor `{}`)", def.name, def.executor)),
            }
        }
        if !missing.is_empty() {
            anyhow::bail!(
                "no executor for stage {}; this build has {}",
                missing.join(", "),
                executors.names().join(", ")
            );
        }
        self.executors.extend(chosen);
        Ok(())
    }

    /// Sets the executor of every stage whose jobs are of kind `kind`, for a rig that runs
    /// only some stages (a test, a benchmark); the runtime uses [`Engine::install`].
    pub fn set_executor(&mut self, kind: &str, executor: Arc<dyn StageExecutor>) {
        for def in &self.cfg.pipeline.stages {
            if def.job_kind() == kind {
                self.executors
                    .insert(def.name.as_str().to_owned(), executor.clone());
            }
        }
    }

    /// The executor of stage `stage`, if this process has one.
    fn executor(&self, stage: &str) -> Option<&Arc<dyn StageExecutor>> {
        self.executors.get(stage)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn git(&self) -> &Git {
        &self.git
    }

    /// Registers a handler for every stage's job kind with `timeout`.
    pub fn register(self: &Arc<Self>, registry: &mut Registry, timeout: Duration) {
        let mut kinds: Vec<String> = self.cfg.pipeline.stages.iter().map(job_kind).collect();
        kinds.sort();
        kinds.dedup();
        for kind in kinds {
            registry.register(kind, timeout, Arc::new(Handler(self.clone())));
        }
        // What every ending leads to (the store enqueues it): the outcome's notification and
        // the item's trail on the default branch; and the webhook deliveries.
        registry.register(
            crate::ended::TASK_ENDED,
            crate::ended::timeout(),
            Arc::new(crate::ended::TaskEndedHandler {
                engine: self.clone(),
            }),
        );
        registry.register(
            crate::notify::NOTIFY,
            Duration::from_secs(crate::notify::ALERT_TIMEOUT_S * 3),
            Arc::new(crate::notify::NotifyHandler {
                store: self.store.clone(),
                live: self.cfg.live.clone(),
            }),
        );
        // A forge's webhook deliveries: each creates its issue's item (once).
        registry.register(
            crate::forge::FORGE_ISSUE,
            Duration::from_secs(60),
            Arc::new(crate::forge::ForgeIssueHandler {
                store: self.store.clone(),
                live: self.cfg.live.clone(),
                pipeline: self.cfg.pipeline.clone(),
            }),
        );
    }

    /// The job that runs `stage` for visit `seq`, or `None` for a terminal stage.
    pub fn stage_job(&self, stage: &str, seq: i64) -> Option<NewJob> {
        let def = self
            .cfg
            .pipeline
            .stages
            .iter()
            .find(|s| s.name.as_str() == stage)?;
        let mut job = NewJob::new(
            job_kind(def),
            StageJob {
                stage: stage.to_owned(),
                seq,
            }
            .to_content(),
        )
        .max_attempts(STAGE_ATTEMPTS);
        if def.pinned {
            job = job.node(self.cfg.node.clone());
        }
        Some(job)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    async fn handle(&self, cx: JobContext) -> Result<Outcome> {
        let sj = match StageJob::from_content(&cx.job.task_content) {
            Ok(sj) => sj,
            Err(e) => return Ok(Outcome::Fail { error: e }),
        };
        let Some(task_id) = cx.job.task_id else {
            return Ok(Outcome::Fail {
                error: "a stage job without a task".into(),
            });
        };
        let lock = self.task_lock(task_id);
        let _held = tokio::select! {
            g = lock.lock() => g,
            _ = cx.cancel.cancelled() => anyhow::bail!("cancelled while waiting for another job of task {task_id}"),
        };
        // Read the task under the lock: the job that held it may have moved the stage on.
        let Some(task) = self.store.get_task(task_id).await? else {
            return Ok(Outcome::Fail {
                error: format!("task {task_id} does not exist"),
            });
        };
        if task.stage != sj.stage || task.stage_seq != sj.seq {
            tracing::info!(job = cx.job.id, work_item = %task.work_item_id,
                job_stage = %sj.stage, task_stage = %task.stage,
                "stale stage job (the task has moved on); nothing to do");
            return Ok(Outcome::Done);
        }
        // A job pinned to another node reached this one only because that node has been gone
        // longer than the grace (the claim's rule): take it over before touching anything.
        let taken_over = match cx.job.node.as_deref().filter(|n| *n != self.cfg.node) {
            Some(from) => match self.take_over(&cx, &task, &sj, from).await {
                Ok(()) => true,
                Err(StoreError::LeaseLost { .. }) => return Ok(Outcome::Marked),
                Err(e) => return Err(e).context("cannot take the job over"),
            },
            None => false,
        };
        // A job waiting for the release track asks the database first: while another task
        // holds the track it waits again at the cost of one read, with no git at all (with many
        // items waiting, redoing each one's stage finish every few seconds kept the repo busy).
        if markers::is_release_wait(&cx.job.task_content)
            && self
                .store
                .track_holder(
                    task.repo.as_str(),
                    task.id,
                    &release_track(&self.cfg.pipeline),
                )
                .await?
                .is_some()
        {
            self.requeue_for_track(&cx, task.id, task.stage_seq).await?;
            return Ok(Outcome::Done);
        }
        match self.prepare(&cx, &task, taken_over).await {
            // The stage's work is done and committed; only entering the release track waits.
            Ok(run) if markers::is_release_wait(&cx.job.task_content) => {
                self.finish_stage(&cx, run, None).await
            }
            Ok(run) => self.run_stage(&cx, sj, run).await,
            Err(Prep::Fatal(reason)) => self.fail_task(&cx, &task, &reason).await,
            Err(Prep::Transient(e)) => Err(e),
        }
    }

    /// Re-pins the job to this node and records `node.takeover` (one fenced transaction). The
    /// executors then rebuild what the gone node kept on its disk from the events (the deploy's
    /// markers, the watch), see `deploy::deployer` and `deploy::monitor`.
    async fn take_over(
        &self,
        cx: &JobContext,
        task: &Task,
        sj: &StageJob,
        from: &str,
    ) -> std::result::Result<(), StoreError> {
        let now = self.store.now_ms();
        let last_seen = self
            .store
            .nodes()
            .await?
            .into_iter()
            .find(|n| n.node == from)
            .map(|n| n.last_seen_ms);
        let seen = match last_seen {
            Some(at) => format!("last seen {:.1} s ago", (now - at) as f64 / 1000.0),
            None => "never seen (no beacon)".to_owned(),
        };
        let to = &self.cfg.node;
        let message = format!(
            "node {to} took over {}'s {} job {} (visit {}) from node {from}, {seen}; what {from} kept on its disk is rebuilt from the events",
            task.work_item_id, sj.stage, cx.job.id, sj.seq
        );
        tracing::warn!(work_item = %task.work_item_id, job = cx.job.id, %from, %to, "{message}");
        let event = NewEvent::new(events::NODE_TAKEOVER, message)
            .task(task.id)
            .job(cx.job.id)
            .stage(task.stage.clone())
            .data(payload::text(&NodeTakeover {
                from: Some(from.to_owned()),
                to: Some(to.clone()),
                last_seen_ms: last_seen,
                seq: Some(sj.seq),
                stage: Some(sj.stage.clone()),
                job: Some(cx.job.id),
                agent: Some(cx.job.agent.clone()),
            }));
        self.store.take_over_job(cx.lease, to, event).await
    }

    async fn prepare(
        &self,
        cx: &JobContext,
        task: &Task,
        taken_over: bool,
    ) -> Result<StageRun, Prep> {
        let work_item = &task.work_item_id;
        let stage_name = &task.stage;
        let stage = self
            .cfg
            .pipeline
            .stage(stage_name)
            .cloned()
            .ok_or_else(|| Prep::Fatal(format!("stage {stage_name} is not in the pipeline")))?;
        let repo_name = &task.repo;
        let config = self.cfg.live.current();
        let repo =
            config.repos.get(repo_name).cloned().ok_or_else(|| {
                Prep::Fatal(format!("repo {repo_name} is not declared in orch.toml"))
            })?;
        let paths = RepoPaths::new(&self.cfg.repos_dir, repo_name);
        repos::ensure_clone(&self.git, &self.cfg.root, &paths, repo_name, &repo)
            .await
            .map_err(Prep::Transient)?;
        let worktree = paths.worktree(work_item);
        // A job that only retries entering the release track finishes at once: never deferred.
        let defers = !markers::is_release_wait(&cx.job.task_content)
            && self
                .executor(stage.name.as_str())
                .is_some_and(|e| e.defers_worktree());
        // A command this job started before orch restarted (an agent still writing, or done
        // writing while orch was away) is adopted: its worktree is taken as it is, not reset.
        let adopting = orch_exec::supervise::job_has_records(cx.job.id);
        // What the preparation needs, shared by the (possibly deferred) calls of it.
        let inputs = Arc::new((
            self.git.clone(),
            paths.clone(),
            work_item.clone(),
            repo.clone(),
            self.store.clone(),
            (task.id, cx.job.id, stage.name.as_str().to_owned()),
        ));
        let prep = move || {
            let inputs = inputs.clone();
            Box::pin(async move {
                let (git, paths, work_item, repo, store, (task, job, stage)) = &*inputs;
                let set_aside =
                    ready_worktree(git, paths, work_item, repo, taken_over, adopting).await?;
                if let Some(message) = set_aside {
                    let event = NewEvent::new(events::WORK_BRANCH_SET_ASIDE, message)
                        .task(*task)
                        .job(*job)
                        .stage(stage.clone());
                    if let Err(e) = store.append_event(event).await {
                        tracing::warn!(error = %e, "could not append an event");
                    }
                }
                Ok(())
            }) as futures::future::BoxFuture<'static, Result<()>>
        };
        let prep = if defers {
            WorktreePrep::deferred(prep)
        } else {
            prep().await.map_err(Prep::Transient)?;
            WorktreePrep::default()
        };
        // An agent's stage must end where it began: on its branch, at this commit.
        let start = match stage.kind == StageKind::Llm && !prep.is_deferred() {
            true => {
                // What the agent's prompt reads from the worktree (role overrides in `.orch/`,
                // the lessons file) is what the branch holds: nothing untracked or ignored
                // that an earlier stage left there (a `.gitignore` entry would hide it).
                let prompt_inputs = [".orch", repo.lessons_file.as_str()];
                self.git
                    .clean_all_under(&worktree, &prompt_inputs)
                    .await
                    .map_err(|e| Prep::Transient(e.into()))?;
                self.git
                    .rev_parse(&worktree, "HEAD")
                    .await
                    .map_err(|e| Prep::Transient(e.into()))?
                    .map(|head| StageStart {
                        branch: work_item.branch_name(),
                        head,
                    })
            }
            false => None,
        };
        let artifact_dir = worktree.join(work_item.artifact_dir());
        // A deferring executor's job (a watch's tick) reads no history and no feedback: the
        // loops are read when the stage is decided, and its worktree is not reset yet.
        let (loops, feedback) = if prep.is_deferred() {
            (0, None)
        } else {
            let (loops, name) = self
                .loops_and_feedback(task.id)
                .await
                .map_err(Prep::Transient)?;
            let feedback = name.and_then(|name| {
                artifacts::read_bounded(&artifact_dir.join(name.as_str())).map(|c| (name, c))
            });
            (loops, feedback)
        };
        Ok(StageRun {
            store: self.store.clone(),
            job: cx.job.clone(),
            lease: cx.lease,
            cancel: cx.cancel.clone(),
            task: task.clone(),
            work_item: work_item.clone(),
            stage,
            repo_name: repo_name.clone(),
            repo,
            settings: config.settings.clone(),
            repos_dir: self.cfg.repos_dir.clone(),
            repo_dir: paths.repo_dir.clone(),
            worktree,
            artifact_dir,
            feedback,
            loops,
            git: self.git.clone(),
            counters: self.counters.clone(),
            node: self.cfg.node.clone(),
            prep,
            start,
        })
    }

    /// Loops back so far, and the feedback artifact of the latest one if the task is still in
    /// the visit it started.
    async fn loops_and_feedback(&self, task_id: i64) -> Result<(u32, Option<ArtifactName>)> {
        let events = self.store.task_events(task_id).await?;
        let loops = control::loops_used(events.iter().map(|e| e.kind.as_str()));
        let mut feedback = None;
        for e in &events {
            if e.kind == events::STAGE_LOOP_BACK {
                feedback = payload::read::<StageChange>(&e.data)
                    .and_then(|c| c.feedback.flatten())
                    .and_then(|f| f.parse().ok());
            } else if e.kind == events::STAGE_ADVANCED {
                feedback = None;
            }
        }
        Ok((loops, feedback))
    }

    async fn run_stage(&self, cx: &JobContext, sj: StageJob, run: StageRun) -> Result<Outcome> {
        let kind = job_kind(&run.stage);
        let Some(executor) = self.executor(run.stage.name.as_str()).cloned() else {
            let reason = format!(
                "no executor for stage {} (agent {kind}) in this process",
                run.stage.name
            );
            return self.fail_task(cx, &run.task, &reason).await;
        };
        // A watch's ticks (a deferring executor's follow-up jobs) say what they did in their own
        // events; a `stage.started` for each would only bury them.
        if !run.prep.is_deferred() || markers::parse(&cx.job.task_content).is_empty() {
            self.event(
                &run,
                events::STAGE_STARTED,
                &format!("{} attempt {}", sj.stage, cx.lease.attempt),
                None,
            )
            .await;
        }
        // An agent run whose command this job adopts keeps its row (the agent finishes it).
        if cx.lease.attempt > 1 && !orch_exec::supervise::job_has_records(cx.job.id) {
            self.close_abandoned_runs(&run).await;
        }
        let effect = executor.execute(&run).await?;
        match effect {
            StageEffect::Failed { reason } => self.fail_task(cx, &run.task, &reason).await,
            StageEffect::Requeue {
                delay_ms,
                marker,
                reason,
            } => {
                let again = Again {
                    delay_ms,
                    priority: 0,
                    marker,
                    reason,
                };
                self.come_back(cx, &run, sj, &kind, again).await
            }
            StageEffect::Yield { marker, reason } => {
                let again = Again {
                    delay_ms: 0,
                    priority: super::YIELD_PRIORITY,
                    marker,
                    reason,
                };
                self.come_back(cx, &run, sj, &kind, again).await
            }
            StageEffect::Produced { outcome } => self.finish_stage(cx, run, outcome).await,
        }
    }

    /// Ends this job with a follow-up of the same stage visit (`Requeue`, `Yield`): commits
    /// what the executor wrote, enqueues the follow-up (once per job: its dedupe key) and says
    /// so in a `stage.requeued`, except for the routine follow-ups of an executor that defers
    /// its worktree (a watch's ticks: one event per poll would bury the rest of the history;
    /// the polls are in the watch's series and its log).
    async fn come_back(
        &self,
        cx: &JobContext,
        run: &StageRun,
        sj: StageJob,
        kind: &str,
        again: Again,
    ) -> Result<Outcome> {
        let Again {
            delay_ms,
            priority,
            marker,
            reason,
        } = again;
        // A deferred worktree nobody prepared holds nothing of this job's.
        if run.prep.is_ready() {
            self.commit(cx, run, "progress").await?;
        }
        let routine = run.prep.is_deferred() && !markers::parse(&cx.job.task_content).is_empty();
        let mut job = NewJob::new(kind, sj.with_marker(&marker))
            .task(run.task.id)
            .delay_ms(i64::try_from(delay_ms).unwrap_or(i64::MAX))
            .priority(priority)
            .max_attempts(STAGE_ATTEMPTS)
            .dedupe(dedupe::requeue_of(cx.job.id));
        if run.stage.pinned || cx.job.node.is_some() {
            job = job.node(self.cfg.node.clone());
        }
        // A routine tick's follow-up goes with its completion, batched with other jobs'.
        if routine && priority == 0 {
            return Ok(Outcome::DoneThen(Box::new(job)));
        }
        // The follow-up and its `stage.requeued` are written together, fenced by this job's
        // lease: a history never lacks a deferral that happened (a staging TOOL_ERROR's
        // defers are counted from it).
        let event = NewEvent::new(events::STAGE_REQUEUED, reason)
            .task(run.task.id)
            .job(run.job.id)
            .stage(run.stage.name.as_str().to_owned())
            .data(payload::text(&StageRequeued {
                delay_ms: Some(delay_ms),
                marker: Some(marker),
                priority: Some(priority),
            }));
        self.store.enqueue_fenced(cx.lease, job, event).await?;
        crate::failpoint::hit("engine.after_requeue");
        Ok(Outcome::Done)
    }

    /// A stage produced its result: check and commit what it left, read its gate, ask the
    /// pipeline where it goes ([`Route`]) and move the task there in one fenced stage change.
    async fn finish_stage(
        &self,
        cx: &JobContext,
        run: StageRun,
        outcome: Option<GateOutcome>,
    ) -> Result<Outcome> {
        run.ensure_worktree().await?;
        let refused = self.check_left(&run).await?;
        let commit = self.commit_checked(cx, &run, "result").await?;
        let gate = self.gate(&run, outcome, &refused).await?;
        let loops = match run.prep.is_deferred() {
            true => self.loops_and_feedback(run.task.id).await?.0,
            false => run.loops,
        };
        let decision = match self.cfg.pipeline.decide(&run.stage.name, &gate, loops) {
            Ok(d) => d,
            Err(e) => {
                return self
                    .fail_task(cx, &run.task, &format!("pipeline: {e}"))
                    .await;
            }
        };
        let track = release_track(&self.cfg.pipeline);
        let route = Route::of(&track, &run.stage, decision);
        let next_job = self.next_job(&run, &route);
        let data = self.change_data(cx, &run, &route, &gate, commit).await?;
        let adv = AdvanceStage {
            task_id: run.task.id,
            expected_stage: run.stage.name.clone(),
            new_stage: route.next.clone(),
            fence: Fence::Job(cx.lease),
            event: NewEvent::new(route.kind, route.decision.reason.clone())
                .job(cx.job.id)
                .data(data.text()),
            next_job,
        };
        self.advance(cx, &run, &route, &track, adv).await
    }

    /// The git checks of a finished stage, before anything is committed: what the stage left
    /// in its worktree ([`Engine::guard`]) and the repo's main checkout, which no stage may
    /// touch (a change there is reverted, said and fails the attempt), at the same time; then
    /// the artifact folder's unsafe files, each refused with an event. Returns the refusals.
    async fn check_left(&self, run: &StageRun) -> Result<Vec<artifacts::Refused>> {
        let (guarded, repo_status) =
            tokio::join!(self.guard(run), self.git.status_porcelain(&run.repo_dir));
        guarded?;
        let repo_status = repo_status?;
        if !repo_status.is_empty() {
            let files: Vec<String> = repo_status
                .iter()
                .map(|s| orch_domain::text::escape(&s.path))
                .collect();
            self.git.reset_hard(&run.repo_dir, "HEAD").await?;
            self.git.clean(&run.repo_dir).await?;
            let reason = format!(
                "files were changed in the repo's main checkout (outside the worktree): {}; reverted",
                files.join(", ")
            );
            self.event(run, events::ARTIFACT_REJECTED, &reason, None)
                .await;
            anyhow::bail!(reason);
        }
        let refused = artifacts::refuse_unsafe(&self.git, &run.worktree, &run.artifact_dir).await?;
        for r in &refused {
            self.event(run, events::ARTIFACT_REJECTED, &r.reason, None)
                .await;
        }
        Ok(refused)
    }

    /// The stage's gate: the executor's own outcome, else its artifacts read through the
    /// stage's gate. An LLM stage's bad artifact fails the attempt here (naming `refused` too):
    /// it never advances the task, the next attempt retries.
    async fn gate(
        &self,
        run: &StageRun,
        outcome: Option<GateOutcome>,
        refused: &[artifacts::Refused],
    ) -> Result<GateOutcome> {
        let gate = match outcome {
            Some(o) => o,
            None => {
                let files = artifacts::read_stage_artifacts(&run.artifact_dir, &run.stage);
                let refs: Vec<(ArtifactName, &str)> =
                    files.iter().map(|(n, c)| (n.clone(), c.as_str())).collect();
                run.stage.check(&run.work_item, &refs)
            }
        };
        if run.stage.kind == StageKind::Llm && gate.verdict == Verdict::NotSuccess {
            let refused: Vec<&str> = refused.iter().map(|r| r.reason.as_str()).collect();
            let reason = match refused.is_empty() {
                true => format!("artifact rejected: {}", gate.reason),
                false => format!("artifact rejected: {}; {}", refused.join("; "), gate.reason),
            };
            self.event(run, events::ARTIFACT_REJECTED, &reason, None)
                .await;
            anyhow::bail!(reason);
        }
        Ok(gate)
    }

    /// The next stage's first job, enqueued with the change when the route says so. A stage
    /// whose first job is due later (a watch's first poll, after its initial delay) says so
    /// through its executor.
    fn next_job(&self, run: &StageRun, route: &Route) -> Option<NewJob> {
        if !route.enqueues_next {
            return None;
        }
        let next = &route.next;
        self.stage_job(next.as_str(), run.task.stage_seq + 1)
            .map(|job| {
                match self
                    .executor(next.as_str())
                    .map(|e| e.first_delay_s(&run.repo))
                {
                    Some(delay) if delay > 0 => {
                        job.delay_s(i64::try_from(delay).unwrap_or(i64::MAX / 1000))
                    }
                    _ => job,
                }
            })
    }

    /// The data of the stage change's event: where from and to, the gate's value, the
    /// feedback, the commit and the attempt; a change to a terminal stage also carries the
    /// final outcome, by the rule every view applies to the recorded facts.
    async fn change_data(
        &self,
        cx: &JobContext,
        run: &StageRun,
        route: &Route,
        gate: &GateOutcome,
        commit: Option<String>,
    ) -> Result<StageChange> {
        let (decision, next) = (&route.decision, &route.next);
        let mut change = StageChange {
            outcome: Some(match &gate.verdict {
                Verdict::Pass(v) => v.clone(),
                Verdict::NotSuccess => "NOT_SUCCESS".into(),
            }),
            feedback: Some(decision.feedback.as_ref().map(|f| f.as_str().to_owned())),
            awaiting_approval: Some(decision.needs_approval),
            commit: Some(commit),
            attempt: Some(cx.lease.attempt),
            ..StageChange::new(run.stage.name.as_str(), next.as_str())
        };
        if decision.next_stage.is_terminal() {
            // The final outcome, for every view of the task (the gate's value stays `result`).
            change.result = change.outcome.take();
            if next.as_str() == control::FAILED {
                change.stage = Some(run.stage.name.as_str().to_owned());
                change.reason = Some(decision.reason.clone());
            }
            // The outcome from the recorded facts, by the rule every view applies.
            let history = self.store.task_events(run.task.id).await?;
            change.outcome = Some(
                orch_store::outcome_of_events(next.as_str(), &history)
                    .map_or(control::FAILED, |o| o.outcome.as_str())
                    .to_owned(),
            );
        }
        Ok(change)
    }

    /// Moves the task along `route` in one transaction fenced by the job's lease (entering the
    /// release track through its guard: a held track makes this job wait for it). A lost
    /// lease or a task moved by someone else ends this attempt without a change.
    async fn advance(
        &self,
        cx: &JobContext,
        run: &StageRun,
        route: &Route,
        track: &Exclusive,
        adv: AdvanceStage,
    ) -> Result<Outcome> {
        let advanced = if route.enters_track {
            self.store.advance_stage_exclusive(adv, track).await
        } else {
            self.store.advance_stage(adv).await
        };
        match advanced {
            Ok(_) => {}
            Err(StoreError::TrackBusy { holder, stage, .. }) => {
                return self.wait_for_track(cx, run, &holder, &stage).await;
            }
            Err(StoreError::LeaseLost { .. }) => return Ok(Outcome::Marked),
            Err(StoreError::StageConflict { .. }) => return Ok(Outcome::Done),
            Err(e) => return Err(e.into()),
        }
        crate::failpoint::hit("engine.after_advance");
        if route.terminal {
            self.remove_worktree(run).await;
        }
        Ok(Outcome::Done)
    }

    /// Agent runs of earlier attempts of this job that never finished belong to a process that
    /// died: record them as abandoned so no run stays "running" forever.
    async fn close_abandoned_runs(&self, run: &StageRun) {
        let runs = match self.store.task_agent_runs(run.task.id).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "could not list agent runs");
                return;
            }
        };
        for r in runs {
            if r.job_id == Some(run.job.id)
                && r.finished_at.is_none()
                && r.attempt < run.lease.attempt
            {
                let finish = orch_store::AgentRunFinish {
                    outcome: "abandoned".into(),
                    error: Some(format!(
                        "the process running attempt {} died; the job runs again as attempt {}",
                        r.attempt, run.lease.attempt
                    )),
                    data: "{}".into(),
                    ..Default::default()
                };
                if let Err(e) = self.store.finish_agent_run(r.id, finish).await {
                    tracing::warn!(error = %e, run = r.id, "could not close an abandoned agent run");
                }
            }
        }
    }

    /// Checks what the stage left ([`guard`]) and commits it: every commit a stage makes goes
    /// through here or through [`Engine::guard`] then [`Engine::commit_checked`].
    async fn commit(&self, cx: &JobContext, run: &StageRun, what: &str) -> Result<Option<String>> {
        self.guard(run).await?;
        self.commit_checked(cx, run, what).await
    }

    /// The check of what a stage may commit, before anything is staged (see [`guard`]): an
    /// agent's refused change fails the attempt (`artifact.rejected`, the worktree put back);
    /// a runner's by-products are put back and said (`commit.discarded`).
    async fn guard(&self, run: &StageRun) -> Result<()> {
        let (verdict, violations) = guard::check(&self.git, &self.cfg.pipeline, run).await?;
        match verdict {
            guard::Verdict::Refused { reason } => {
                tracing::warn!(work_item = %run.work_item, stage = %run.stage.name, %reason, "change refused");
                self.event(
                    run,
                    events::ARTIFACT_REJECTED,
                    &reason,
                    Some(guard::data(run, &violations)),
                )
                .await;
                anyhow::bail!(reason)
            }
            guard::Verdict::Clean if !violations.is_empty() => {
                let text = guard::discarded_text(run, &violations);
                tracing::info!(work_item = %run.work_item, stage = %run.stage.name, %text, "by-products discarded");
                self.event(
                    run,
                    guard::DISCARDED,
                    &text,
                    Some(guard::data(run, &violations)),
                )
                .await;
                Ok(())
            }
            guard::Verdict::Clean => Ok(()),
        }
    }

    /// Commits whatever the stage left in the worktree (checked by [`Engine::guard`]) and
    /// pushes the branch when the repo has a remote (the hand-off to other machines,
    /// design.md §10).
    async fn commit_checked(
        &self,
        cx: &JobContext,
        run: &StageRun,
        what: &str,
    ) -> Result<Option<String>> {
        let message = format!(
            "orch: {} {} {what} (attempt {})\n\nWork-Item: {}\nStage: {}",
            run.work_item, run.stage.name, run.lease.attempt, run.work_item, run.stage.name
        );
        let commit = self
            .git
            .add_and_commit(&run.worktree, &Pathspec::All, &message)
            .await
            .context("cannot commit the stage's changes")?;
        if commit.is_some()
            && repos::shares_work_branches(&self.git, &run.repo_dir, &run.repo).await
        {
            self.push_work_branch(cx, run).await?;
        }
        Ok(commit)
    }

    /// Publishes `orch/<id>` for the node that runs the next stage, fenced by the lease: an
    /// attempt whose lease was lost (a node cut off, then back) never pushes, so it cannot put
    /// its stale commits under the work of the attempt that replaced it. Should the remote hold
    /// commits this worktree has not seen (pushed by a stale attempt of this job in the instant
    /// before its lease ran out: the worktree started from the remote's branch,
    /// [`repos::catch_up_work_branch`]), the lease holder's branch replaces them by
    /// compare-and-swap. The push is part of the stage's work: a remote that cannot be reached
    /// fails the attempt (the next one starts again from the remote's branch), since a stage
    /// completed here but missing there would leave the node that runs the next stage on an
    /// older branch.
    async fn push_work_branch(&self, cx: &JobContext, run: &StageRun) -> Result<()> {
        let branch = run.work_item.branch_name();
        cx.renew()
            .await
            .with_context(|| format!("not pushing `{branch}`"))?;
        let Err(refused) = self.git.push(&run.worktree, repos::ORIGIN, &branch).await else {
            return Ok(());
        };
        let ours = self
            .git
            .rev_parse(&run.worktree, &format!("refs/heads/{branch}"))
            .await?
            .with_context(|| format!("`{branch}` is gone from the worktree"))?;
        let theirs = self
            .git
            .ls_remote_branch(&run.worktree, repos::ORIGIN, &branch)
            .await
            .with_context(|| format!("cannot push `{branch}` ({refused}), nor read the remote's"))?
            .with_context(|| format!("cannot push `{branch}`: {refused}"))?;
        cx.renew()
            .await
            .with_context(|| format!("not replacing `{branch}` on the remote"))?;
        self.git
            .push_with_lease(&run.worktree, repos::ORIGIN, &branch, Some(&theirs), &ours)
            .await
            .with_context(|| {
                format!("cannot replace `{branch}` on the remote ({theirs:.12}) by {ours:.12}")
            })?;
        let message = format!(
            "`{branch}` on the remote held {theirs:.12}, a commit this attempt had not seen (a stale attempt's push); replaced by this attempt's {ours:.12}"
        );
        tracing::warn!(work_item = %run.work_item, %message, "work branch replaced");
        self.event(run, events::WORK_BRANCH_REPLACED, &message, None)
            .await;
        Ok(())
    }

    async fn remove_worktree(&self, run: &StageRun) {
        if let Err(e) = self.git.worktree_remove(&run.repo_dir, &run.worktree).await {
            tracing::warn!(work_item = %run.work_item, error = %e, "could not remove the worktree");
        }
    }

    /// The release track of the repo is held by another task: this job's stage is done, so a
    /// job of the same kind comes back after [`TRACK_WAIT_S`] to try the stage change
    /// again (without redoing the work). The first wait of a visit is an event.
    async fn wait_for_track(
        &self,
        cx: &JobContext,
        run: &StageRun,
        holder: &str,
        holder_stage: &str,
    ) -> Result<Outcome> {
        let seq = run.task.stage_seq;
        self.requeue_for_track(cx, run.task.id, seq).await?;
        if !markers::is_release_wait(&cx.job.task_content) {
            self.event(
                run,
                events::RELEASE_WAITING,
                &format!(
                    "waiting for repo {}'s release track, held by {holder} (at {holder_stage}); one release at a time",
                    run.repo_name
                ),
                Some(serde_json::json!({
                    "repo": run.repo_name.as_str(), "holder": holder, "holder_stage": holder_stage,
                    "seq": seq,
                })),
            )
            .await;
        }
        Ok(Outcome::Done)
    }

    /// Enqueues the job that tries entering the release track again after
    /// [`TRACK_WAIT_S`]: this job's payload with `[orch:release-wait seq=N]`, once per
    /// job (its dedupe key). A job pinned to a node stays pinned, to this node: it is this
    /// node's, or this node has just taken it over.
    async fn requeue_for_track(&self, cx: &JobContext, task_id: i64, seq: i64) -> Result<()> {
        let marker = markers::release_wait(seq);
        let content = if cx.job.task_content.contains(&marker) {
            cx.job.task_content.clone()
        } else {
            StageJob::from_content(&cx.job.task_content)
                .map(|sj| sj.with_marker(&marker))
                .unwrap_or_else(|_| cx.job.task_content.clone())
        };
        let mut job = NewJob::new(cx.job.agent.clone(), content)
            .task(task_id)
            .delay_s(i64::try_from(TRACK_WAIT_S).unwrap_or(3))
            .max_attempts(STAGE_ATTEMPTS)
            .dedupe(dedupe::requeue_of(cx.job.id));
        if cx.job.node.is_some() {
            job = job.node(self.cfg.node.clone());
        }
        self.store.enqueue(job).await?;
        Ok(())
    }

    /// Moves the task to `failed` (fenced by this job) with `reason`.
    async fn fail_task(&self, cx: &JobContext, task: &Task, reason: &str) -> Result<Outcome> {
        let res = self
            .store
            .advance_stage(AdvanceStage {
                task_id: task.id,
                expected_stage: task.stage.clone(),
                new_stage: StageName::failed(),
                fence: Fence::Job(cx.lease),
                event: NewEvent::new(events::TASK_FAILED, reason.to_owned())
                    .job(cx.job.id)
                    .data(StageChange::failed(task.stage.as_str(), reason).text()),
                next_job: None,
            })
            .await;
        if res.is_ok() {
            // Every executor hears of it: one that keeps local state for the task (the deploy's
            // markers, the watch) ends it, wherever the task failed.
            let reason = format!("the task failed: {reason}");
            for executor in self.distinct_executors() {
                executor.task_failed(&self.cfg.repos_dir, task, &reason);
            }
        }
        match res {
            Ok(_) | Err(StoreError::StageConflict { .. }) => Ok(Outcome::Done),
            Err(StoreError::LeaseLost { .. }) => Ok(Outcome::Marked),
            Err(e) => Err(e.into()),
        }
    }

    /// Each installed executor once (one may serve several stages).
    fn distinct_executors(&self) -> Vec<&Arc<dyn StageExecutor>> {
        let mut seen = std::collections::HashSet::new();
        self.executors
            .values()
            .filter(|e| seen.insert(Arc::as_ptr(e).cast::<()>()))
            .collect()
    }

    async fn event(
        &self,
        run: &StageRun,
        kind: &str,
        message: &str,
        data: Option<serde_json::Value>,
    ) {
        let mut e = NewEvent::new(kind, message.to_owned())
            .task(run.task.id)
            .job(run.job.id)
            .stage(run.stage.name.as_str().to_owned());
        if let Some(d) = data {
            e = e.data(d.to_string());
        }
        if let Err(err) = self.store.append_event(e).await {
            tracing::warn!(error = %err, kind, "could not append an event");
        }
    }

    /// True when the task has a queued or running job.
    pub async fn has_live_job(&self, task_id: i64) -> Result<bool> {
        Ok(self
            .store
            .task_jobs(task_id)
            .await?
            .iter()
            .any(|j| matches!(j.state, JobState::Queued | JobState::Running)))
    }
}

/// Brings the work item's worktree to where a stage starts from: the branch caught up with
/// what another node pushed (design.md §10: where work branches are shared, another node may
/// have moved it since this node last worked on the item, and always after a takeover), then
/// the worktree created, reused or repaired and reset to the branch's committed state — unless
/// the job is `adopting` a command an earlier orch started in that worktree (then it is kept).
/// `Some`: a local attempt's commits the remote lacks were set aside (what, for an event).
async fn ready_worktree(
    git: &Git,
    paths: &RepoPaths,
    work_item: &WorkItemId,
    repo: &orch_domain::config::RepoConfig,
    taken_over: bool,
    adopting: bool,
) -> Result<Option<String>> {
    let existing = paths.worktree(work_item);
    let mut set_aside = None;
    let worktree = if adopting && existing.join(".git").exists() {
        tracing::info!(%work_item, "the job adopts a command an earlier orch started: its worktree is kept as it is");
        existing
    } else {
        if taken_over || repos::shares_work_branches(git, &paths.repo_dir, repo).await {
            set_aside = repos::catch_up_work_branch(git, paths, work_item).await?;
        }
        repos::prepare_worktree(git, paths, work_item, &repo.default_branch).await?
    };
    // Documents are written only through real folders: a branch whose item folder (or a
    // folder above it) is a link never gets a stage run on it.
    let folder = work_item.artifact_dir();
    if let Some(why) = crate::fsutil::unsafe_dirs(&worktree, std::path::Path::new(&folder)) {
        anyhow::bail!(
            "the work item's folder `{folder}` cannot be written safely: {why} on branch `{}`; orch writes documents only through real folders",
            work_item.branch_name()
        );
    }
    Ok(set_aside)
}

/// Where a finished stage goes, from the pipeline's decision alone (pure; see the unit
/// tests): the stage it moves to, the event kind that says so, whether the change is terminal,
/// whether the next stage's job is enqueued with it (not at a terminal stage, nor at one
/// waiting for approval) and whether it enters the release track (to a track stage from a
/// stage off it).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Route {
    decision: Decision,
    next: StageName,
    kind: &'static str,
    terminal: bool,
    enqueues_next: bool,
    enters_track: bool,
}

impl Route {
    fn of(track: &Exclusive, from: &StageDef, decision: Decision) -> Route {
        let next = decision.next_stage.clone();
        let terminal = decision.next_stage.is_terminal();
        let kind = if decision.loop_back {
            events::STAGE_LOOP_BACK
        } else if terminal {
            control::terminal_event(next.as_str()).unwrap_or(events::TASK_FAILED)
        } else {
            events::STAGE_ADVANCED
        };
        let enters_track =
            track.stages.contains(&next) && !track.stages.iter().any(|s| s == from.name.as_str());
        Route {
            enqueues_next: !terminal && !decision.needs_approval,
            next,
            kind,
            terminal,
            enters_track,
            decision,
        }
    }
}

/// A follow-up job of the same stage visit (see [`Engine::come_back`]).
struct Again {
    delay_ms: u64,
    priority: i64,
    marker: String,
    reason: String,
}

enum Prep {
    /// Retrying cannot help: the task fails with this reason.
    Fatal(String),
    /// Try again (a new attempt).
    Transient(anyhow::Error),
}

struct Handler(Arc<Engine>);

#[async_trait::async_trait]
impl JobHandler for Handler {
    async fn run(&self, cx: JobContext) -> Result<Outcome> {
        self.0.handle(cx).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orch_domain::gate::GateOutcome;
    use orch_domain::ids::StageName;

    fn name(s: &str) -> StageName {
        s.parse().unwrap()
    }

    fn decision(to: &str, loop_back: bool, needs_approval: bool) -> Decision {
        Decision {
            next_stage: name(to),
            loop_back,
            feedback: None,
            needs_approval,
            reason: format!("to {to}"),
        }
    }

    /// The default pipeline, its track guard and the stage that enters the track (the stage
    /// before its first track stage), the first track stage and the one after it.
    fn setup() -> (Pipeline, Exclusive, String, String, String) {
        let pipeline = Pipeline::default_pipeline();
        let track = release_track(&pipeline);
        let first = pipeline
            .stages
            .iter()
            .position(|s| s.release_track)
            .unwrap();
        let stage = |i: usize| pipeline.stages[i].name.as_str().to_owned();
        let (before, entry, inside) = (stage(first - 1), stage(first), stage(first + 1));
        (pipeline, track, before, entry, inside)
    }

    fn route(pipeline: &Pipeline, track: &Exclusive, from: &str, d: Decision) -> Route {
        let from = pipeline.stage(&name(from)).unwrap();
        Route::of(track, from, d)
    }

    #[test]
    fn an_advance_enqueues_the_next_stage_and_enters_the_track_only_from_outside() {
        let (p, track, before, entry, inside) = setup();
        let r = route(&p, &track, &before, decision(&entry, false, false));
        assert_eq!(r.kind, events::STAGE_ADVANCED);
        assert_eq!(r.next, entry);
        assert!(r.enqueues_next && r.enters_track && !r.terminal);
        let r = route(&p, &track, &entry, decision(&inside, false, false));
        assert_eq!(r.kind, events::STAGE_ADVANCED);
        assert!(r.enqueues_next && !r.enters_track, "already on the track");
        let r = route(&p, &track, "intake", decision("analysis", false, false));
        assert!(r.enqueues_next && !r.enters_track, "off the track");
    }

    #[test]
    fn a_stage_waiting_for_approval_gets_no_job() {
        let (p, track, before, entry, _) = setup();
        let r = route(&p, &track, &before, decision(&entry, false, true));
        assert_eq!(r.kind, events::STAGE_ADVANCED);
        assert!(!r.enqueues_next && !r.terminal);
        assert!(r.enters_track, "the approval waits on the track it entered");
    }

    #[test]
    fn a_loop_back_is_its_own_event_and_runs_the_earlier_stage_again() {
        let (p, track, _, entry, _) = setup();
        let r = route(&p, &track, &entry, decision("implementation", true, false));
        assert_eq!(r.kind, events::STAGE_LOOP_BACK);
        assert!(r.enqueues_next && !r.enters_track && !r.terminal);
    }

    #[test]
    fn a_terminal_stage_is_its_ending_event_with_no_job() {
        let (p, track, before, _, inside) = setup();
        for (from, to, kind) in [
            ("lessons", control::DONE, events::TASK_DONE),
            (inside.as_str(), control::FAILED, events::TASK_FAILED),
            (before.as_str(), control::FAILED, events::TASK_FAILED),
        ] {
            let r = route(&p, &track, from, decision(to, false, false));
            assert_eq!(r.kind, kind, "{from} -> {to}");
            assert!(r.terminal && !r.enqueues_next && !r.enters_track);
            assert_eq!(r.decision.reason, format!("to {to}"), "the event's text");
        }
    }

    /// The gate outcome that takes `from` along the first of its transitions `pick` accepts.
    fn outcome_for(
        from: &StageDef,
        pick: impl Fn(&orch_domain::pipeline::Transition) -> bool,
    ) -> GateOutcome {
        use orch_domain::pipeline::On;
        let on = from
            .transitions
            .iter()
            .find_map(|(on, t)| pick(t).then(|| on.clone()))
            .unwrap();
        match on {
            On::Value(v) => GateOutcome::pass(v, "ok"),
            On::Pass => GateOutcome::pass("PASS".to_owned(), "ok"),
            On::NotSuccess => GateOutcome::not_success("no".to_owned()),
        }
    }

    #[test]
    fn the_route_follows_the_pipelines_own_decision() {
        use orch_domain::pipeline::Transition as T;
        let (p, track, before, entry, _) = setup();
        let from = p.stage(&name(&before)).unwrap();
        let gate = outcome_for(from, |t| matches!(t, T::Next(to) if to.as_str() == entry));
        let d = p.decide(&from.name, &gate, 0).unwrap();
        let r = Route::of(&track, from, d.clone());
        assert_eq!(
            (r.next.as_str(), r.kind),
            (entry.as_str(), events::STAGE_ADVANCED)
        );
        assert!(r.enters_track && r.enqueues_next);
        assert_eq!(r.decision, d, "its reason is the event's text");

        // A loop back while loops are left; the task fails once the bound is used up.
        let looping = p
            .stages
            .iter()
            .find(|s| {
                s.transitions
                    .values()
                    .any(|t| matches!(t, T::LoopBack { .. }))
            })
            .unwrap();
        let gate = outcome_for(looping, |t| matches!(t, T::LoopBack { .. }));
        let r = Route::of(&track, looping, p.decide(&looping.name, &gate, 0).unwrap());
        assert_eq!(r.kind, events::STAGE_LOOP_BACK);
        assert!(r.enqueues_next && !r.terminal);
        let spent = p.decide(&looping.name, &gate, p.max_loops).unwrap();
        let r = Route::of(&track, looping, spent);
        assert_eq!(
            (r.next.as_str(), r.kind),
            (control::FAILED, events::TASK_FAILED)
        );
        assert!(r.terminal && !r.enqueues_next);
    }
}
