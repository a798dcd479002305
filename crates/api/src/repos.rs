//! A repo's release story, built from existing store reads: its tasks (`list_tasks` by repo)
//! and the events that tell deploys, verdicts, rollbacks, reverts and lessons
//! (`events_by_kind`, kept to this repo's tasks). Shared by `GET /repos/{repo}/deploys`, the
//! dashboard's repo page and `orch deploys`.
//!
//! Deploys are the `release.deployed` events (`{repo, revision, previous_revision, items,
//! seq}`), oldest first. Tasks deployed before the release train wrote those have only a
//! `deploy.confirmed` event on the deploying task: each becomes a deploy of that one item,
//! marked `source = "deploy.confirmed"`.

use std::collections::{BTreeMap, HashMap};

use orch_domain::control::events;
use orch_domain::outcome::TaskOutcome;
use orch_domain::payload::{
    self, DeployConfirmed, ReleaseDeployed, ReleaseReverted, RollbackResult, WatchVerdict,
};
use orch_store::{Event, Store, StoreError, Task, TaskFilter};

/// Tasks of one repo read at most (newest first).
const MAX_TASKS: u32 = 1000;
/// Events of one kind read per store call.
const PAGE: u32 = 1000;

/// One item a deploy shipped.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ShippedItem {
    pub work_item: String,
    pub commit: Option<String>,
    /// `merge` or `revert`.
    pub change: String,
}

/// One production deploy of the repo.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Deploy {
    pub event_id: i64,
    pub at_ms: i64,
    /// The work item whose task ran the deploy.
    pub deployed_by: String,
    pub revision: Option<String>,
    pub previous_revision: Option<String>,
    pub seq: Option<i64>,
    pub items: Vec<ShippedItem>,
    /// `release.deployed`, or `deploy.confirmed` for deploys before the release train.
    pub source: &'static str,
    /// The post-deploy watch's verdict on the deploying task after this deploy.
    pub verdict: Option<String>,
    /// Whether production was rolled back from this deploy and verified back (by the watch, or
    /// by the deployer after a failed or unconfirmed deploy).
    pub rolled_back: bool,
    /// Whether a rollback of this deploy ran and production was not verified back.
    pub rollback_failed: bool,
    /// `(work item, revert commit)` of items reverted on the default branch after it.
    pub reverts: Vec<(String, String)>,
}

/// A lesson recorded by a work item (`lessons.recorded`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LessonEvent {
    pub work_item: String,
    pub at_ms: i64,
    pub message: String,
}

/// A repo's story.
#[derive(Debug, Clone)]
pub(crate) struct RepoStory {
    pub repo: String,
    /// Tasks still in a pipeline stage, newest first.
    pub in_flight: Vec<Task>,
    /// Finished tasks with their outcome, newest first.
    pub finished: Vec<(Task, Option<TaskOutcome>)>,
    /// Oldest first.
    pub deploys: Vec<Deploy>,
    pub lessons: Vec<LessonEvent>,
}

/// Reads the repo's story; `None` when the repo has no task at all.
pub(crate) async fn read(store: &Store, repo: &str) -> Result<Option<RepoStory>, StoreError> {
    let tasks = store
        .list_tasks(&TaskFilter {
            stage: None,
            repo: Some(repo.to_owned()),
            limit: MAX_TASKS,
            offset: 0,
        })
        .await?;
    if tasks.is_empty() {
        return Ok(None);
    }
    let by_id: HashMap<i64, &Task> = tasks.iter().map(|t| (t.id, t)).collect();
    let mut events: BTreeMap<&str, Vec<Event>> = BTreeMap::new();
    let mut kinds = vec![events::RELEASE_DEPLOYED, events::LESSONS_RECORDED];
    kinds.extend(orch_domain::outcome::FACT_KINDS);
    for kind in kinds {
        let mut after = 0;
        let list = events.entry(kind).or_default();
        loop {
            let page = store.events_by_kind(kind, after, PAGE).await?;
            let full = page.len() == PAGE as usize;
            for e in page {
                after = after.max(e.id);
                if e.task_id.is_some_and(|t| by_id.contains_key(&t)) {
                    list.push(e);
                }
            }
            if !full {
                break;
            }
        }
    }
    let take =
        |events: &mut BTreeMap<&str, Vec<Event>>, k: &str| events.remove(k).unwrap_or_default();
    let work_item = |e: &Event| {
        e.task_id
            .and_then(|t| by_id.get(&t))
            .map(|t| t.work_item_id.to_string())
            .unwrap_or_default()
    };

    // Deploys: the release train's events; tasks with none fall back to deploy.confirmed.
    let mut deploys: Vec<Deploy> = Vec::new();
    let released = take(&mut events, events::RELEASE_DEPLOYED);
    let released: Vec<(Event, ReleaseDeployed)> = released
        .into_iter()
        .filter_map(|e| {
            let d = payload::read::<ReleaseDeployed>(&e.data)?;
            (d.repo == repo).then_some((e, d))
        })
        .collect();
    for (e, d) in &released {
        deploys.push(Deploy {
            event_id: e.id,
            at_ms: e.created_at,
            deployed_by: work_item(e).to_string(),
            revision: Some(d.revision.clone()),
            previous_revision: d.previous_revision.clone(),
            seq: d.seq,
            items: d
                .items
                .iter()
                .map(|i| ShippedItem {
                    work_item: i.work_item.clone(),
                    commit: (!i.commit.is_empty()).then(|| i.commit.clone()),
                    change: i.change.as_str().to_owned(),
                })
                .collect(),
            source: events::RELEASE_DEPLOYED,
            verdict: None,
            rolled_back: false,
            rollback_failed: false,
            reverts: Vec::new(),
        });
    }
    // A deploy the release train recorded is not listed twice: its task's `deploy.confirmed`
    // of the same revision is skipped.
    let released_revs: std::collections::HashSet<(Option<i64>, Option<String>)> = released
        .iter()
        .map(|(e, d)| (e.task_id, Some(d.revision.clone())))
        .collect();
    for e in take(&mut events, events::DEPLOY_CONFIRMED) {
        let revision = payload::read::<DeployConfirmed>(&e.data)
            .map(|d| d.revision)
            .filter(|r| !r.is_empty());
        if released_revs.contains(&(e.task_id, revision.clone())) {
            continue;
        }
        let wi = work_item(&e);
        deploys.push(Deploy {
            event_id: e.id,
            at_ms: e.created_at,
            deployed_by: wi.to_string(),
            revision: revision.clone(),
            previous_revision: None,
            seq: None,
            items: vec![ShippedItem {
                work_item: wi.to_string(),
                commit: revision,
                change: "merge".to_owned(),
            }],
            source: events::DEPLOY_CONFIRMED,
            verdict: None,
            rolled_back: false,
            rollback_failed: false,
            reverts: Vec::new(),
        });
    }
    deploys.sort_by_key(|d| d.event_id);

    // The verdict and rollback of a deploy: the first ones on the deploying task after it
    // (and before that task's next deploy).
    let verdicts = events
        .get(events::POST_DEPLOY_VERDICT)
        .cloned()
        .unwrap_or_default();
    // Every rollback result, verified or not: the watch's and the deployer's.
    let rollbacks: Vec<(Event, bool)> = [
        events::POST_DEPLOY_ROLLBACK,
        events::DEPLOY_ROLLED_BACK,
        events::DEPLOY_ROLLBACK_FAILED,
    ]
    .iter()
    .flat_map(|k| events.get(k).cloned().unwrap_or_default())
    .filter_map(|e| {
        let result = payload::read::<RollbackResult>(&e.data);
        let verified = match e.kind.as_str() {
            events::DEPLOY_ROLLED_BACK => true,
            // `attempted: false`: no rollback ran at all.
            events::DEPLOY_ROLLBACK_FAILED if result.as_ref().is_some_and(|r| !r.attempted) => {
                return None;
            }
            events::DEPLOY_ROLLBACK_FAILED => false,
            _ => result.is_some_and(|r| r.verified),
        };
        Some((e, verified))
    })
    .collect();
    let n = deploys.len();
    for i in 0..n {
        let (task_wi, from) = (deploys[i].deployed_by.clone(), deploys[i].event_id);
        let until = deploys[i + 1..]
            .iter()
            .find(|d| d.deployed_by == task_wi)
            .map_or(i64::MAX, |d| d.event_id);
        let in_window = |e: &&Event| e.id > from && e.id < until && work_item(e) == task_wi;
        deploys[i].verdict = verdicts.iter().find(in_window).map(|e| {
            payload::read::<WatchVerdict>(&e.data)
                .map_or_else(|| e.message.clone(), |v| v.verdict.as_str().to_owned())
        });
        // The latest rollback result in the window says how it ended.
        let last = rollbacks
            .iter()
            .filter(|(e, _)| in_window(&e))
            .max_by_key(|(e, _)| e.id);
        deploys[i].rolled_back = last.is_some_and(|(_, ok)| *ok);
        deploys[i].rollback_failed = last.is_some_and(|(_, ok)| !*ok);
    }
    // Reverts: to the latest deploy before the revert that shipped the item.
    let reverted = events
        .get(events::RELEASE_REVERTED)
        .cloned()
        .unwrap_or_default();
    for e in &reverted {
        let d = payload::read::<ReleaseReverted>(&e.data);
        if d.as_ref()
            .is_some_and(|d| !d.repo.is_empty() && d.repo != repo)
        {
            continue;
        }
        let wi = d
            .as_ref()
            .map(|d| d.work_item.clone())
            .filter(|w| !w.is_empty())
            .unwrap_or_else(|| work_item(e).to_string());
        let commit = d.map(|d| d.revert_commit).unwrap_or_default();
        if let Some(dep) = deploys
            .iter_mut()
            .rev()
            .find(|dep| dep.event_id < e.id && dep.items.iter().any(|i| i.work_item == wi))
        {
            dep.reverts.push((wi, commit));
        }
    }

    let lessons = take(&mut events, events::LESSONS_RECORDED)
        .iter()
        .rev()
        .map(|e| LessonEvent {
            work_item: work_item(e).to_string(),
            at_ms: e.created_at,
            message: e.message.clone(),
        })
        .collect();

    // Outcomes of finished tasks from the events read above (the facts' kinds).
    let mut outcome_events: HashMap<i64, Vec<Event>> = HashMap::new();
    for e in orch_domain::outcome::FACT_KINDS
        .iter()
        .flat_map(|k| take(&mut events, k))
    {
        if let Some(t) = e.task_id {
            outcome_events.entry(t).or_default().push(e);
        }
    }
    let mut in_flight = Vec::new();
    let mut finished = Vec::new();
    for t in &tasks {
        if t.is_terminal() {
            let mut evs = outcome_events.remove(&t.id).unwrap_or_default();
            evs.sort_by_key(|e| e.id);
            let o = crate::outcomes::of(t, &evs);
            finished.push((t.clone(), o));
        } else {
            in_flight.push(t.clone());
        }
    }
    Ok(Some(RepoStory {
        repo: repo.to_owned(),
        in_flight,
        finished,
        deploys,
        lessons,
    }))
}
