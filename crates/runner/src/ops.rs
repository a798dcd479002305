//! Operator operations shared by the CLI and the HTTP API: submit, approve, retry, cancel.
//! Each is fenced by the task's `stage_seq` as read (an operator CAS), so two operators (or an
//! operator and a worker) racing on one task cannot both win. Each names its caller
//! ([`Actor`]: the API with the token and where from, the CLI and which OS user, orch itself)
//! in its event's text and under `by` in its data.

use std::sync::Arc;

use orch_domain::MAX_REQUEST_BYTES;
use orch_domain::config::Config;
use orch_domain::control::actor::{self, Actor};
use orch_domain::control::{self, events};
use orch_domain::ids::{RepoName, StageName, WorkItemId};
use orch_domain::payload::{self, StageChange};
use orch_domain::pipeline::Pipeline;
use orch_store::{
    AdvanceStage, Fence, NewEvent, NewTask, Store, StoreError, Task, Visit, WorkItemSpec,
};

use crate::engine::{Engine, StageJob, first_job};

/// Creates a task for a new work item of `repo` with its first stage's job, in one
/// transaction: all a submit needs is the config and the store (the CLI's `orch submit`
/// builds no engine). The body is bounded by [`MAX_REQUEST_BYTES`], as the API's; the title is
/// one line without control characters, as the API's.
pub async fn submit(
    store: &Store,
    config: &Config,
    pipeline: &Pipeline,
    repo: &str,
    title: &str,
    body: &str,
    by: &Actor,
) -> OpsResult<Task> {
    let repo_name: RepoName = repo
        .parse()
        .map_err(|e| OpsError::Invalid(format!("{e}")))?;
    let Some(repo_cfg) = config.repos.get(&repo_name) else {
        let known: Vec<&str> = config.repos.keys().map(|r| r.as_str()).collect();
        return Err(OpsError::Invalid(format!(
            "repo {repo} is not declared in orch.toml (declared: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        )));
    };
    let task = store
        .create_task(new_task(
            pipeline,
            &repo_name,
            WorkItemSpec::Next {
                prefix: repo_cfg.prefix.clone(),
            },
            title,
            body,
            by,
            serde_json::Map::new(),
        )?)
        .await?;
    Ok(task)
}

/// The task a new work item of `repo` is: stage `intake` with its first job and its
/// `task.submitted` event naming `by` (with `extra` beside `by` in its data), after the
/// request's rules: the title one line of 1 to 200 bytes without control characters (trimmed),
/// the body at most [`MAX_REQUEST_BYTES`]. The one shape of a new item, for a submit and for a
/// forge's issue ([`crate::forge::create_item`]).
pub fn new_task(
    pipeline: &Pipeline,
    repo: &RepoName,
    work_item: WorkItemSpec,
    title: &str,
    body: &str,
    by: &Actor,
    extra: serde_json::Map<String, serde_json::Value>,
) -> OpsResult<NewTask> {
    let title = title.trim();
    if title.is_empty() || title.len() > 200 || title.chars().any(char::is_control) {
        return Err(OpsError::Invalid(
            "the title must be one line of 1 to 200 characters without control characters".into(),
        ));
    }
    if body.len() > MAX_REQUEST_BYTES {
        return Err(OpsError::Invalid(format!(
            "the body is {} bytes, over the {} KiB limit",
            body.len(),
            MAX_REQUEST_BYTES / 1024
        )));
    }
    let mut data = extra;
    data.insert(actor::KEY.to_owned(), by.data());
    let (stage, first) = first_job(pipeline)
        .ok_or_else(|| OpsError::Invalid("the pipeline has no stages".into()))?;
    Ok(NewTask {
        work_item,
        repo: repo.clone(),
        title: title.to_owned(),
        body: body.to_owned(),
        stage,
        branch_prefix: "orch/".into(),
        event: NewEvent::new(
            events::TASK_SUBMITTED,
            format!("submitted {}: {title}", by.describe()),
        )
        .data(serde_json::Value::Object(data).to_string()),
        first_job: Some(first),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl From<StoreError> for OpsError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::TaskNotFound(_) => OpsError::NotFound(e.to_string()),
            StoreError::TrackBusy { .. } => {
                OpsError::Conflict(format!("{e}; try again when that release has finished"))
            }
            StoreError::StageConflict { .. } | StoreError::WorkItemTaken(_) => OpsError::Conflict(
                format!("{e} (someone else changed the task; look again and retry)"),
            ),
            StoreError::Invalid(m) => OpsError::Invalid(m),
            other => OpsError::Internal(other.into()),
        }
    }
}

pub type OpsResult<T> = Result<T, OpsError>;

/// The operations, over one store and engine.
#[derive(Clone)]
pub struct Ops {
    store: Store,
    engine: Arc<Engine>,
}

impl Ops {
    pub fn new(store: Store, engine: Arc<Engine>) -> Ops {
        Ops { store, engine }
    }

    /// Creates a task for a new work item of `repo`, with its intake job.
    pub async fn submit(&self, repo: &str, title: &str, body: &str, by: &Actor) -> OpsResult<Task> {
        let config = self.engine.config().live.current();
        let pipeline = &self.engine.config().pipeline;
        submit(&self.store, &config, pipeline, repo, title, body, by).await
    }

    pub async fn task(&self, id: &str) -> OpsResult<Task> {
        let id: WorkItemId = id.parse().map_err(|e| OpsError::Invalid(format!("{e}")))?;
        self.store
            .get_task_by_work_item(id.as_str())
            .await?
            .ok_or_else(|| OpsError::NotFound(format!("no work item {id}")))
    }

    /// Lets a task waiting at an `approval = true` stage go on, or releases the hold a
    /// rolled-back item keeps on its repo's releases (see [`crate::release`]).
    pub async fn approve(&self, id: &str, by: &Actor) -> OpsResult<Task> {
        self.approve_at(id, by, None).await
    }

    /// [`Ops::approve`], only while the task is still at `expected` (stage, `stage_seq`): a
    /// caller that checked the stage before approving gets [`OpsError::Conflict`] when the
    /// task moved meanwhile, and the stage job it enqueues is of that visit (a later visit
    /// finds it stale). Without `expected`, the visit read here is the one approved. The
    /// check and the write are one operation ([`Store::write_at_visit`]: a compare-and-swap on
    /// the visit in the transaction that enqueues the job and appends `stage.approved`): of
    /// two approvals racing, or an approval racing the item moving on, exactly one writes and
    /// the other gets [`OpsError::Conflict`].
    pub async fn approve_at(
        &self,
        id: &str,
        by: &Actor,
        expected: Option<(&str, i64)>,
    ) -> OpsResult<Task> {
        let task = self.task(id).await?;
        if let Some((stage, seq)) = expected
            && (task.stage != stage || task.stage_seq != seq)
        {
            return Err(OpsError::Conflict(format!(
                "{id} moved on: it is at stage {} (visit {}), not at {stage} (visit {seq})",
                task.stage, task.stage_seq
            )));
        }
        let events = self.store.task_events(task.id).await?;
        if !task.is_terminal()
            && let Some(reason) = crate::release::open_hold(&events)
        {
            // What production runs as the operator goes on: the revision the item's outcome
            // names as accepted when production was not verified back.
            let config = self.engine.config().live.current();
            let repo = config.repos.get(&task.repo).cloned();
            // A short look: the operator's call waits for it.
            let sight = match repo {
                Some(mut repo) => {
                    repo.post_deploy.poll_timeout_s = repo.post_deploy.poll_timeout_s.min(3);
                    Some(crate::deploy::recover::look_at(&repo).await)
                }
                None => None,
            };
            let live = sight.as_ref().and_then(|s| s.live.clone());
            let seen = sight.as_ref().map_or_else(
                || "production was not looked at (the repo is no longer configured)".to_owned(),
                |s| format!("production: {}", s.describe()),
            );
            self.store
                .write_at_visit(
                    Visit::of(&task),
                    None,
                    NewEvent::new(
                        events::RELEASE_UNHELD,
                        format!(
                            "the hold of repo {} was released {} (it was: {reason}); {seen}",
                            task.repo,
                            by.describe()
                        ),
                    )
                    .data(payload::text(&payload::ReleaseUnheld {
                        repo: task.repo.to_string(),
                        by: by.data(),
                        live,
                        healthy: sight
                            .as_ref()
                            .map(|s| s.health == orch_domain::recovery::Health::Pass),
                    })),
                )
                .await?;
            return Ok(task);
        }
        let stage = self
            .engine
            .config()
            .pipeline
            .stages
            .iter()
            .find(|s| s.name.as_str() == task.stage)
            .cloned();
        let Some(stage) = stage.filter(|s| s.approval) else {
            return Err(OpsError::Conflict(format!(
                "{id} is at stage {} which does not wait for approval",
                task.stage
            )));
        };
        if self.engine.has_live_job(task.id).await? {
            return Err(OpsError::Conflict(format!(
                "{id} is already approved and running"
            )));
        }
        let Some(job) = self.engine.stage_job(stage.name.as_str(), task.stage_seq) else {
            return Err(OpsError::Conflict(format!(
                "{id}: stage {} has no job",
                task.stage
            )));
        };
        // The standard dedupe key of this stage visit: approving twice enqueues one job.
        let job = job
            .task(task.id)
            .dedupe(orch_store::stage_job_key(task.id, task.stage_seq));
        let event = NewEvent::new(
            events::STAGE_APPROVED,
            format!("{} approved {}", task.stage, by.describe()),
        )
        .data(serde_json::json!({ actor::KEY: by.data() }).to_string());
        match self
            .store
            .write_at_visit(Visit::of(&task), Some(job), event)
            .await?
        {
            Some(enq) if enq.duplicate => Err(OpsError::Conflict(format!(
                "{id} is already approved (stage {}, visit {})",
                task.stage, task.stage_seq
            ))),
            _ => Ok(task),
        }
    }

    /// Puts a failed task back at the stage it failed in, as a new visit.
    pub async fn retry(&self, id: &str, by: &Actor) -> OpsResult<Task> {
        let task = self.task(id).await?;
        if task.stage != control::FAILED {
            return Err(OpsError::Conflict(format!(
                "{id} is at stage {}; only a failed task can be retried",
                task.stage
            )));
        }
        // The stage it failed in: named by the failure event when the engine failed it,
        // else the stage of its last job (a job that failed for good).
        let events = self.store.task_events(task.id).await?;
        let from_event = events
            .iter()
            .rev()
            .find(|e| e.kind == events::TASK_FAILED)
            .and_then(|e| payload::read::<StageChange>(&e.data))
            .and_then(|c| c.from)
            .filter(|s| !control::is_terminal_stage(s));
        let from_jobs = || async {
            let jobs = self.store.task_jobs(task.id).await?;
            Ok::<Option<String>, OpsError>(
                jobs.iter()
                    .filter_map(|j| StageJob::from_content(&j.task_content).ok())
                    .rfind(|sj| !control::is_terminal_stage(&sj.stage))
                    .map(|sj| sj.stage),
            )
        };
        let stage = match from_event {
            Some(s) => s,
            None => from_jobs().await?.ok_or_else(|| {
                OpsError::Conflict(format!("{id}: cannot tell which stage failed"))
            })?,
        };
        if self.engine.stage_job(&stage, 0).is_none() {
            return Err(OpsError::Conflict(format!(
                "{id} failed at stage {stage}, which the pipeline no longer has"
            )));
        }
        // A stage of the pipeline (just checked), so a valid name.
        let stage: StageName = stage.parse().map_err(|e| {
            OpsError::Conflict(format!("{id}: the stage it failed in is not a stage: {e}"))
        })?;
        let waits = self
            .engine
            .config()
            .pipeline
            .stages
            .iter()
            .any(|s| s.name == stage && s.approval);
        let next_job = if waits {
            None
        } else {
            self.engine.stage_job(stage.as_str(), task.stage_seq + 1)
        };
        let adv = AdvanceStage {
            task_id: task.id,
            expected_stage: StageName::failed(),
            new_stage: stage.clone(),
            fence: Fence::Seq(task.stage_seq),
            event: NewEvent::new(
                events::TASK_RETRIED,
                format!("retried at stage {stage} {}", by.describe()),
            )
            .data(StageChange::retried(stage.as_str(), by.data()).text()),
            next_job,
        };
        // A retry into the release track takes it like any other entry: one release at a time.
        let track = crate::release::track(&self.engine.config().pipeline);
        let adv = if track.stages.contains(&stage) {
            self.store.advance_stage_exclusive(adv, &track).await?
        } else {
            self.store.advance_stage(adv).await?
        };
        Ok(adv.task)
    }

    /// Cancels a task: its stage becomes `cancelled` and its live jobs are cancelled (a running
    /// job's worker loses its lease and stops).
    pub async fn cancel(&self, id: &str, by: &Actor) -> OpsResult<Task> {
        let task = self.task(id).await?;
        if task.is_terminal() {
            return Err(OpsError::Conflict(format!(
                "{id} has already ended ({})",
                task.stage
            )));
        }
        // The outcome's reason too: `orch status` and the dashboard say who cancelled.
        let cancelled = format!("cancelled {}", by.describe());
        let adv = self
            .store
            .advance_stage(AdvanceStage {
                task_id: task.id,
                expected_stage: task.stage.clone(),
                new_stage: StageName::cancelled(),
                fence: Fence::Seq(task.stage_seq),
                event: NewEvent::new(events::TASK_CANCELLED, cancelled.clone()).data(
                    StageChange::cancelled(task.stage.as_str(), &cancelled, by.data()).text(),
                ),
                next_job: None,
            })
            .await?;
        self.store.cancel_task_jobs(task.id, None).await?;
        // A cancelled deploy or watch ends here (the watch's node also ends it in its
        // recovery sweep, when this process is elsewhere).
        crate::release::end_watch(
            &self.engine.config().repos_dir,
            task.repo.as_str(),
            task.work_item_id.as_str(),
            &format!("the task was cancelled {}", by.describe()),
        );
        Ok(adv.task)
    }
}
