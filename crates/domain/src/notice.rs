//! The notification orch sends when a person should know: every terminal outcome, every hold
//! that waits for an operator, and every alert (production could not be verified healthy at a
//! known revision). One document, [`Notice`], versioned ([`VERSION`]); it is the body POSTed
//! to a repo's `alert_webhook` (or, with `alert_webhook_format = "slack"`, the [`slack`]
//! message made from it) and what the `alert` command reads on stdin. README "When things go
//! wrong" documents it field by field.
//!
//! A notice's `id` is stable for the occasion it reports (`<work item>-<event id>`, the event
//! that recorded the occasion): a delivery retried after a timeout carries the same id, so a
//! receiver keeps each occasion once.
//!
//! Pure: built from values the caller read; no clock (the time is a field).

use serde::{Deserialize, Serialize};

/// The version of the document's shape. A field is only ever added in a version; a change of
/// meaning is a new version.
pub const VERSION: u32 = 1;

/// What a notice reports (`event`).
pub mod event {
    /// The item ended: `outcome` says how.
    pub const OUTCOME: &str = "outcome";
    /// The repo's releases are held by the item until an operator approves or cancels it.
    pub const HOLD: &str = "hold";
    /// An operator is needed now: production could not be verified healthy at a known
    /// revision (or nothing could watch it).
    pub const ALERT: &str = "alert";
}

/// What orch saw live in production.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Live {
    /// The revision the service names, when it named one.
    pub revision: Option<String>,
    /// The health check: `PASS`, `FAIL`, `BLIND` (orch could not observe) or `UNWATCHED` (no
    /// health URL).
    pub health: String,
    /// The same in words.
    pub description: String,
}

/// Links a person follows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Links {
    /// The item's page on the dashboard.
    pub task: String,
    /// The repo's page (deploys, rollbacks, reverts).
    pub repo: String,
    /// The item in the API (`GET /tasks/{id}`).
    pub api: String,
}

/// One notification (version [`VERSION`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notice {
    /// [`VERSION`].
    pub version: u32,
    /// Stable per occasion: `<work item>-<event id>`; retries repeat it.
    pub id: String,
    /// [`event::OUTCOME`], [`event::HOLD`] or [`event::ALERT`].
    pub event: String,
    /// When the occasion was recorded (epoch milliseconds).
    pub at_ms: i64,
    /// The work item (`APP-12`).
    pub work_item: String,
    /// Its title.
    pub title: String,
    /// The repo.
    pub repo: String,
    /// The stage the item was in (its terminal stage for an outcome).
    pub stage: String,
    /// The revision the occasion is about (the item's deploy), when there is one.
    pub revision: Option<String>,
    /// The revision live before it, when known.
    pub previous_revision: Option<String>,
    /// For an outcome: `shipped`, `rolled_back`, `reverted`, `accepted`, `failed` or
    /// `cancelled`.
    pub outcome: Option<String>,
    /// For an alert: the verdict it follows (`FAILED`, `DEGRADED` of the watch; `UNCONFIRMED`,
    /// `DEPLOY_FAILED` of a deploy).
    pub verdict: Option<String>,
    /// For an alert: what was done (`alert`: nothing could be; `rollback_failed`: a rollback
    /// ran and production did not come back).
    pub action: Option<String>,
    /// Why, in a sentence.
    pub reason: String,
    /// What orch last saw live in production, when it looked.
    pub live: Option<Live>,
    /// What orch tried, in order (a deploy, a rollback, its verification).
    pub tried: Vec<String>,
    /// What a person should do now, when something is needed.
    pub todo: Option<String>,
    /// Where to look.
    pub links: Links,
}

impl Notice {
    /// The document as sent (`alert_webhook_format = "orch"`).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".to_owned())
    }

    /// One line: `APP-3 failed at deploy: … — live: … — do: …`.
    pub fn summary(&self) -> String {
        let mut line = format!("{}: {}", self.head(), self.reason);
        if let Some(live) = &self.live {
            line.push_str(&format!(" — live: {}", live.description));
        }
        if let Some(todo) = &self.todo {
            line.push_str(&format!(" — do: {todo}"));
        }
        line
    }
}

/// The Slack incoming-webhook message of a notice (`alert_webhook_format = "slack"`): `text`
/// carries every fact of the document, as lines.
pub fn slack(n: &Notice) -> String {
    let mut lines = vec![format!("*{}* — {}", n.head(), n.title)];
    lines.push(format!("reason: {}", n.reason));
    if let Some(rev) = &n.revision {
        lines.push(format!(
            "revision: `{rev}` (previous: `{}`)",
            n.previous_revision.as_deref().unwrap_or("unknown")
        ));
    }
    if let Some(live) = &n.live {
        lines.push(format!("live: {}", live.description));
    }
    for t in &n.tried {
        lines.push(format!("tried: {t}"));
    }
    if let Some(todo) = &n.todo {
        lines.push(format!("to do: {todo}"));
    }
    lines.push(format!(
        "<{}|{} on the dashboard>",
        n.links.task, n.work_item
    ));
    serde_json::json!({ "text": lines.join("\n") }).to_string()
}

impl Notice {
    /// What happened to whom: `APP-3 rolled back`, `APP-3 holds repo svc`, `ALERT APP-3 in svc`.
    fn head(&self) -> String {
        match (self.event.as_str(), &self.outcome) {
            (event::OUTCOME, Some(o)) => format!("{} {}", self.work_item, o.replace('_', " ")),
            (event::HOLD, _) => format!("{} holds repo {}", self.work_item, self.repo),
            _ => format!("ALERT {} in {}", self.work_item, self.repo),
        }
    }
}

/// The links of work item `work_item` of `repo` under the dashboard's `base` address.
pub fn links(base: &str, work_item: &str, repo: &str) -> Links {
    let base = base.trim_end_matches('/');
    Links {
        task: format!("{base}/ui/tasks/{work_item}"),
        repo: format!("{base}/ui/repos/{repo}"),
        api: format!("{base}/tasks/{work_item}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice() -> Notice {
        Notice {
            version: VERSION,
            id: "APP-3-42".into(),
            event: event::ALERT.into(),
            at_ms: 1,
            work_item: "APP-3".into(),
            title: "Add a banner".into(),
            repo: "svc".into(),
            stage: "deploy".into(),
            revision: Some("bbbbbbb".into()),
            previous_revision: Some("aaaaaaa".into()),
            outcome: None,
            verdict: Some("DEPLOY_FAILED".into()),
            action: Some("rollback_failed".into()),
            reason: "the rollback failed".into(),
            live: Some(Live {
                revision: None,
                health: "FAIL".into(),
                description: "nothing answers (connection refused)".into(),
            }),
            tried: vec!["deploy `sh deploy.sh` exited 1".into()],
            todo: Some("bring `aaaaaaa` back by hand".into()),
            links: links("http://127.0.0.1:7878/", "APP-3", "svc"),
        }
    }

    #[test]
    fn the_document_round_trips_and_keeps_its_field_names() {
        let n = notice();
        let v: serde_json::Value = serde_json::from_str(&n.to_json()).unwrap();
        for key in [
            "version",
            "id",
            "event",
            "at_ms",
            "work_item",
            "title",
            "repo",
            "stage",
            "revision",
            "previous_revision",
            "outcome",
            "verdict",
            "action",
            "reason",
            "live",
            "tried",
            "todo",
            "links",
        ] {
            assert!(v.get(key).is_some(), "{key} in {v}");
        }
        assert_eq!(v["version"], 1);
        assert_eq!(v["links"]["task"], "http://127.0.0.1:7878/ui/tasks/APP-3");
        let back: Notice = serde_json::from_str(&n.to_json()).unwrap();
        assert_eq!(back, n);
    }

    #[test]
    fn the_slack_message_carries_every_fact() {
        let v: serde_json::Value = serde_json::from_str(&slack(&notice())).unwrap();
        let text = v["text"].as_str().unwrap();
        for want in [
            "ALERT APP-3 in svc",
            "the rollback failed",
            "`bbbbbbb` (previous: `aaaaaaa`)",
            "live: nothing answers",
            "tried: deploy",
            "to do: bring",
            "<http://127.0.0.1:7878/ui/tasks/APP-3|APP-3 on the dashboard>",
        ] {
            assert!(text.contains(want), "{want} in {text}");
        }
        assert_eq!(v.as_object().unwrap().len(), 1, "only `text`");
    }

    #[test]
    fn the_summary_names_what_is_live_and_what_to_do() {
        let s = notice().summary();
        assert!(
            s.starts_with("ALERT APP-3 in svc: the rollback failed"),
            "{s}"
        );
        assert!(s.contains("live: nothing answers"), "{s}");
        assert!(s.contains("do: bring"), "{s}");
    }
}
