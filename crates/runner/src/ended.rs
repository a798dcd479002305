//! What happens once a task ends, whatever ended it: the pipeline (done, failed by a gate or
//! the loop bound), an operator's cancel, or a job that failed for good. The store enqueues a
//! `task-ended` job in the same transaction as every terminal stage change
//! (`orch_domain::control::jobs::TASK_ENDED`), so no ending is missed whichever process dies;
//! [`TaskEndedHandler`] then
//! 1. announces the outcome ([`crate::notify::announce`]): the webhook's `outcome` notice
//!    (outcome, reason, revisions, what is live, what was tried, links), and the `alert`
//!    command too when the item failed (a person must look);
//! 2. publishes the item's whole trail on the default branch: its documents up to the last one
//!    it reached (the revert record `18-revert.md` included), lessons or not, failed or
//!    shipped — unless the lessons stage already did. It never moves the default branch under
//!    a release: while another item holds the repo's release track it waits (a follow-up job
//!    every [`TRACK_WAIT_S`] s), and it commits only `docs/work-items/<id>/` with the `Stage:
//!    audit` trailer, which the deploy history does not count as a change. A trail that cannot
//!    be published is said in `trail.published` (`published: false`) and in the log.
//!
//! Idempotent: a notice is announced once (the command's record, the webhook job's dedupe
//! key), the trail commit holds only what the default branch lacks.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use orch_domain::control::{dedupe, events, jobs};
use orch_domain::ids::RepoName;
use orch_domain::notice::{self, Notice};
use orch_domain::outcome::{Outcome, TaskOutcome};
use orch_store::{Event, NewEvent, NewJob, Task};
use serde_json::json;

use crate::engine::Engine;
use crate::repos::{self, RepoPaths};
use crate::worker::{JobContext, JobHandler, Outcome as JobDone};

/// The job's kind.
pub const TASK_ENDED: &str = jobs::TASK_ENDED;
/// How long the trail waits between looks at a busy release track.
pub const TRACK_WAIT_S: u64 = 15;

/// Runs the [`TASK_ENDED`] jobs.
pub struct TaskEndedHandler {
    pub engine: Arc<Engine>,
}

/// The payload: `{"task", "seq", "wait"}` (`wait`: how many times the trail waited).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Payload {
    task: i64,
    seq: i64,
    #[serde(default)]
    wait: u32,
}

#[async_trait::async_trait]
impl JobHandler for TaskEndedHandler {
    async fn run(&self, cx: JobContext) -> anyhow::Result<JobDone> {
        let Ok(p) = serde_json::from_str::<Payload>(&cx.job.task_content) else {
            tracing::warn!(job = cx.job.id, "task-ended: unreadable payload; dropped");
            return Ok(JobDone::Done);
        };
        let store = self.engine.store();
        let Some(task) = store.get_task(p.task).await? else {
            return Ok(JobDone::Done);
        };
        if !task.is_terminal() || task.stage_seq != p.seq {
            // Retried since: the new visit ends with its own job.
            return Ok(JobDone::Done);
        }
        let config = self.engine.config().live.current();
        let name = task.repo.clone();
        let Some(repo) = config.repos.get(&name).cloned() else {
            tracing::info!(work_item = %task.work_item_id, repo = %task.repo, "task-ended: the repo is no longer configured; nothing announced or published");
            return Ok(JobDone::Done);
        };
        let history = store.task_events(task.id).await?;
        let paths = RepoPaths::new(&self.engine.config().repos_dir, &name);
        if p.wait == 0 {
            self.announce(&cx, &task, &history, &repo, &config.settings, &paths)
                .await?;
        }
        if trail_published(&history, p.seq) {
            return Ok(JobDone::Done);
        }
        let track = crate::release::track(&self.engine.config().pipeline);
        if let Some((holder, stage)) = store
            .track_holder(task.repo.as_str(), task.id, &track)
            .await?
        {
            tracing::info!(work_item = %task.work_item_id, %holder, %stage, "task-ended: the trail waits for the release track");
            let next = Payload {
                wait: p.wait.saturating_add(1),
                ..p
            };
            let job = NewJob::new(TASK_ENDED, json!(next).to_string())
                .dedupe(dedupe::task_ended_wait(p.task, p.seq, next.wait))
                .delay_s(i64::try_from(TRACK_WAIT_S).unwrap_or(15));
            return Ok(JobDone::DoneThen(Box::new(job)));
        }
        let (published, message, commit, files) = match self
            .publish(&task, &name, &repo, &paths)
            .await
        {
            Ok(Some((commit, files))) => (
                true,
                format!(
                    "{}'s trail ({files} file(s)) committed on `{}` as {:.12}",
                    task.work_item_id, repo.default_branch, commit
                ),
                Some(commit),
                files,
            ),
            Ok(None) => (
                true,
                format!(
                    "{}'s trail is already on `{}`",
                    task.work_item_id, repo.default_branch
                ),
                None,
                0,
            ),
            Err(e) => {
                tracing::warn!(work_item = %task.work_item_id, error = %format!("{e:#}"), "task-ended: the trail was not published");
                (
                    false,
                    format!(
                        "{}'s trail was not published on `{}`: {e:#}",
                        task.work_item_id, repo.default_branch
                    ),
                    None,
                    0,
                )
            }
        };
        let event = NewEvent::new(events::TRAIL_PUBLISHED, message)
            .task(task.id)
            .job(cx.job.id)
            .stage(task.stage.clone())
            .data(
                json!({"branch": repo.default_branch, "commit": commit, "files": files,
                       "published": published, "seq": p.seq})
                .to_string(),
            );
        store.append_event_fenced(cx.lease, event).await?;
        Ok(JobDone::Done)
    }
}

impl TaskEndedHandler {
    /// The `outcome` notice of the ended task (the webhook; the `alert` command when it failed).
    async fn announce(
        &self,
        cx: &JobContext,
        task: &Task,
        history: &[Event],
        repo: &orch_domain::config::RepoConfig,
        settings: &orch_domain::config::Settings,
        paths: &RepoPaths,
    ) -> anyhow::Result<()> {
        if repo.alert.is_none() && repo.alert_webhook.is_none() {
            return Ok(());
        }
        let Some(terminal) = history
            .iter()
            .rev()
            .find(|e| events::TASK_ENDED.contains(&e.kind.as_str()))
        else {
            return Ok(());
        };
        let Some(outcome) = outcome_of_task(task, history) else {
            return Ok(());
        };
        let notice = outcome_notice(task, history, terminal, &outcome, settings);
        let page = outcome.outcome == Outcome::Failed;
        let cwd = if paths.repo_dir.is_dir() {
            paths.repo_dir.as_path()
        } else {
            self.engine.config().repos_dir.as_path()
        };
        crate::notify::announce(
            &crate::notify::Target {
                store: self.engine.store(),
                repo,
                cwd,
                task_id: task.id,
                stage: task.stage.as_str(),
                lease: Some(cx.lease),
            },
            &notice,
            terminal.id,
            page,
        )
        .await
    }

    /// Commits the item's documents the default branch lacks (read from its branch `orch/<id>`)
    /// onto it, by compare-and-swap, retried from the new state when it loses a race. `None`
    /// when there was nothing to publish.
    async fn publish(
        &self,
        task: &Task,
        name: &RepoName,
        repo: &orch_domain::config::RepoConfig,
        paths: &RepoPaths,
    ) -> anyhow::Result<Option<(String, usize)>> {
        let git = self.engine.git();
        let work_item = &task.work_item_id;
        repos::ensure_clone(git, &self.engine.config().root, paths, name, repo).await?;
        if git.has_remote(&paths.repo_dir, "origin").await? {
            repos::catch_up_work_branch(git, paths, work_item).await?;
        }
        let dir = work_item.artifact_dir();
        let branch = format!("refs/heads/{}", work_item.branch_name());
        let theirs = git
            .files_at(&paths.repo_dir, &branch, &dir)
            .await
            .with_context(|| format!("cannot read {dir} on {branch}"))?;
        if theirs.is_empty() {
            return Ok(None);
        }
        for attempt in 0..3 {
            let main = repos::sync_default_branch(git, &paths.repo_dir, repo).await?;
            let ours = git.files_at(&paths.repo_dir, &main, &dir).await?;
            let files: Vec<(String, Vec<u8>)> = theirs
                .iter()
                .filter(|(path, content)| !ours.iter().any(|(p, c)| p == path && c == content))
                .map(|(path, content)| (path.clone(), content.clone().into_bytes()))
                .collect();
            if files.is_empty() {
                return Ok(None);
            }
            let message = format!(
                "{}: its trail on {}\n\n{} ended ({}); its documents reach the default branch with it.\n\nWork-Item: {}\nStage: audit\n",
                task.work_item_id,
                repo.default_branch,
                task.work_item_id,
                task.stage,
                task.work_item_id
            );
            let commit = git
                .commit_files_onto(&paths.repo_dir, &main, &files, &message)
                .await?;
            match repos::move_default_branch(git, &paths.repo_dir, repo, &main, &commit).await {
                Ok(published) => {
                    if let Some(w) = published.warning() {
                        tracing::warn!(work_item = %task.work_item_id, "{w}");
                    }
                    return Ok(Some((commit, files.len())));
                }
                Err(e) if attempt < 2 => {
                    tracing::warn!(work_item = %task.work_item_id, error = %format!("{e:#}"), "the trail lost a race for the default branch; again");
                }
                Err(e) => return Err(e),
            }
        }
        anyhow::bail!(
            "the trail kept losing the race for `{}`",
            repo.default_branch
        )
    }
}

/// Whether the item's trail is on the default branch already: published by this ending's
/// job, or by the lessons stage of the visit that ended.
fn trail_published(history: &[Event], seq: i64) -> bool {
    let since = history
        .iter()
        .rposition(|e| e.kind == events::TASK_RETRIED)
        .map_or(0, |i| i + 1);
    history[since..].iter().any(|e| {
        let v: serde_json::Value = serde_json::from_str(&e.data).unwrap_or_default();
        match e.kind.as_str() {
            events::TRAIL_PUBLISHED => v["seq"] == json!(seq) && v["published"] == json!(true),
            events::LESSONS_RECORDED => v["published"] == json!(true),
            _ => false,
        }
    })
}

/// The task's outcome by the one rule.
fn outcome_of_task(task: &Task, history: &[Event]) -> Option<TaskOutcome> {
    orch_store::outcome_of_events(task.stage.as_str(), history)
}

/// The `outcome` notice: the outcome and its reason, the deploy's revisions, what orch last saw
/// live (the last `production.checked`, or the watch's HEALTHY verdict), what was tried.
fn outcome_notice(
    task: &Task,
    history: &[Event],
    terminal: &Event,
    o: &TaskOutcome,
    settings: &orch_domain::config::Settings,
) -> Notice {
    let since = history
        .iter()
        .rposition(|e| e.kind == events::TASK_RETRIED)
        .map_or(0, |i| i + 1);
    let recent = &history[since..];
    let deployed = recent
        .iter()
        .rev()
        .find(|e| e.kind == events::RELEASE_DEPLOYED)
        .and_then(|e| orch_domain::payload::read::<orch_domain::payload::ReleaseDeployed>(&e.data));
    let checked = recent
        .iter()
        .rev()
        .find(|e| e.kind == events::PRODUCTION_CHECKED)
        .and_then(|e| {
            orch_domain::payload::read::<orch_domain::payload::ProductionChecked>(&e.data)
        });
    let healthy_watch = recent
        .iter()
        .rev()
        .find(|e| e.kind == events::POST_DEPLOY_VERDICT)
        .and_then(|e| orch_domain::payload::read::<orch_domain::payload::WatchVerdict>(&e.data))
        .filter(|v| v.verdict == orch_domain::monitor::Verdict::Healthy);
    let live = match (&checked, &healthy_watch) {
        (Some(c), _) => Some(notice::Live {
            revision: c.running().map(str::to_owned),
            health: c.health.clone(),
            description: c.description.clone(),
        }),
        (None, Some(v)) => {
            let rev = Some(v.revision.clone()).filter(|r| !r.is_empty());
            Some(notice::Live {
                description: format!(
                    "`{}` watched HEALTHY",
                    rev.as_deref().unwrap_or("the deployed revision")
                ),
                revision: rev,
                health: "PASS".to_owned(),
            })
        }
        (None, None) => None,
    };
    let tried = checked
        .as_ref()
        .map(|c| c.tried.clone())
        .unwrap_or_default();
    let id = &task.work_item_id;
    let todo = match o.outcome {
        Outcome::Failed => Some(
            checked
                .as_ref()
                .filter(|c| c.settled == orch_domain::payload::Settled::Alerted)
                .map(|c| c.todo.clone())
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| {
                    format!("`orch logs {id}` says why; fix the cause and `orch retry {id}`, or leave it failed")
                }),
        ),
        _ => None,
    };
    let reason = o.reason.clone().unwrap_or_else(|| match o.outcome {
        Outcome::Shipped => "deployed and watched; nothing went wrong".to_owned(),
        _ => terminal.message.clone(),
    });
    Notice {
        version: notice::VERSION,
        id: format!("{id}-{}", terminal.id),
        event: notice::event::OUTCOME.to_owned(),
        at_ms: terminal.created_at,
        work_item: id.to_string(),
        title: task.title.clone(),
        repo: task.repo.to_string(),
        stage: o.stage.clone().unwrap_or_else(|| task.stage.to_string()),
        revision: deployed.as_ref().map(|d| d.revision.clone()),
        previous_revision: deployed.and_then(|d| d.previous_revision),
        outcome: Some(o.outcome.as_str().to_owned()),
        verdict: None,
        action: None,
        reason,
        live,
        tried,
        todo,
        links: notice::links(&settings.link_base(), id.as_str(), task.repo.as_str()),
    }
}

/// How long a `task-ended` job may run (a publish is a few git commands).
pub fn timeout() -> Duration {
    Duration::from_secs(600)
}
