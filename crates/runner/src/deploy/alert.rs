//! The deploy tail's alert (design.md §7 "DEGRADED → alert", §11): an operator is needed because
//! production could not be verified healthy at a known revision. An alert is always recorded
//! as a `post_deploy.alert` event (with what is live, what was tried and what to do), then
//! announced ([`crate::notify::announce`]): the repo's `alert` command runs at once and the
//! webhook delivery is queued as a job of its own. A broken hook never fails the stage: the
//! command's end is recorded (`post_deploy.alert_sent` / `post_deploy.alert_failed`), the
//! webhook's tries too (`notify.delivered` / `notify.failed`).
//!
//! Restart safety: the alert event is recorded once per stage visit and occasion, the command
//! runs once per notice, the webhook job is one per alert event (its dedupe key), so a re-run
//! after a crash does not page twice.

use orch_domain::notice::{self, Notice};
use orch_domain::recovery::Sight;
use serde_json::json;

use super::{data, event_seq, event_str, events};
use crate::engine::StageRun;

/// What an alert is about.
#[derive(Debug, Clone, Copy)]
pub struct Alert<'a> {
    /// What happened, one word: `degraded`, `failed`, `rollback_failed`, `unconfirmed`, ...
    /// (with the visit, the key that keeps a re-run from delivering twice).
    pub occasion: &'a str,
    /// The verdict (`HEALTHY`/`DEGRADED`/`FAILED`, `UNCONFIRMED` or `DEPLOY_FAILED` for a deploy).
    pub verdict: &'a str,
    /// The action taken (`alert`, `rollback`, `rollback_failed`, ...).
    pub action: &'a str,
    /// Why, in a sentence.
    pub reason: &'a str,
    /// The revision concerned.
    pub revision: &'a str,
    /// The revision live before it, when known.
    pub previous: Option<&'a str>,
    /// What orch last saw live, when it looked.
    pub sight: Option<&'a Sight>,
    /// What was tried, in order.
    pub tried: &'a [String],
    /// What a person should do.
    pub todo: &'a str,
}

/// Raises `alert`: records the `post_deploy.alert` event (once per visit and occasion), then
/// announces it. Errors only when the store fails.
pub(crate) async fn raise(run: &StageRun, seq: i64, alert: &Alert<'_>) -> anyhow::Result<()> {
    tracing::warn!(work_item = %run.work_item, verdict = alert.verdict, "alert: {}", alert.reason);
    run.counters.incr("post_deploy_monitor", "alerts");
    let recorded = run.store.task_events(run.task.id).await?;
    let before = recorded.iter().rev().find(|e| {
        e.kind == events::POST_DEPLOY_ALERT
            && event_seq(e) == Some(seq)
            && event_str(e, "occasion").as_deref() == Some(alert.occasion)
    });
    let (event_id, at_ms) = match before {
        Some(e) => (e.id, e.created_at),
        None => {
            let mut d = data([
                ("occasion", json!(alert.occasion)),
                ("verdict", json!(alert.verdict)),
                ("action", json!(alert.action)),
                ("revision", json!(alert.revision)),
                ("previous", json!(alert.previous)),
                ("live", json!(alert.sight.and_then(|s| s.live.clone()))),
                ("live_description", json!(alert.sight.map(Sight::describe))),
                ("tried", json!(alert.tried)),
                ("todo", json!(alert.todo)),
            ]);
            d.insert("seq".into(), seq.into());
            let event = orch_store::NewEvent::new(events::POST_DEPLOY_ALERT, alert.reason)
                .task(run.task.id)
                .job(run.job.id)
                .stage(run.stage.name.as_str())
                .data(serde_json::Value::Object(d).to_string());
            let id = run.store.append_event_fenced(run.lease, event).await?;
            (id, run.store.now_ms())
        }
    };
    let notice = Notice {
        version: notice::VERSION,
        id: format!("{}-{event_id}", run.work_item),
        event: notice::event::ALERT.to_owned(),
        at_ms,
        work_item: run.work_item.as_str().to_owned(),
        title: run.task.title.clone(),
        repo: run.repo_name.as_str().to_owned(),
        stage: run.stage.name.as_str().to_owned(),
        revision: Some(alert.revision.to_owned()).filter(|r| r != "unknown"),
        previous_revision: alert.previous.map(str::to_owned),
        outcome: None,
        verdict: Some(alert.verdict.to_owned()),
        action: Some(alert.action.to_owned()),
        reason: alert.reason.to_owned(),
        live: alert.sight.map(live_of),
        tried: alert.tried.to_vec(),
        todo: Some(alert.todo.to_owned()).filter(|t| !t.is_empty()),
        links: notice::links(
            &run.settings.link_base(),
            run.work_item.as_str(),
            run.repo_name.as_str(),
        ),
    };
    crate::notify::announce(&crate::notify::Target::of_run(run), &notice, event_id, true).await
}

/// A look at production as the notice carries it.
pub(crate) fn live_of(s: &Sight) -> notice::Live {
    notice::Live {
        revision: s.live.clone(),
        health: s.health.as_str().to_owned(),
        description: s.describe(),
    }
}
