//! How a task ended, in one place: the API, the dashboard and `orch status` all ask
//! [`outcome_of`], so they never disagree about whether an item shipped or was rolled back.
//!
//! The release train writes the outcome on the terminal event (`task.done`, `task.failed`,
//! `task.cancelled` carry `data.outcome`, and for a failure `data.stage` and `data.reason`).
//! Tasks finished before that contract carry no outcome and it is derived: `done` is shipped,
//! except when the post-deploy watch decided FAILED and rolled back (a `post_deploy.verdict`
//! event whose verdict is FAILED and a `post_deploy.rollback` event), which is `rolled_back`;
//! `failed` and `cancelled` are themselves. A task still in a pipeline stage has no outcome.
//!
//! Pure: the caller passes the stage and the events (kind + parsed JSON data).

use serde_json::Value;

use crate::control::{self, events as kind};

/// How a finished task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Deployed and watched healthy (or a pipeline without a watch finished).
    Shipped,
    /// Production was rolled back; the change is still on the default branch.
    RolledBack,
    /// Rolled back and reverted on the default branch.
    Reverted,
    /// The pipeline stopped with an error.
    Failed,
    /// An operator cancelled it.
    Cancelled,
}

impl Outcome {
    /// Every outcome, in display order.
    pub const ALL: [Outcome; 5] = [
        Outcome::Shipped,
        Outcome::RolledBack,
        Outcome::Reverted,
        Outcome::Failed,
        Outcome::Cancelled,
    ];

    /// The wire spelling (`shipped`, `rolled_back`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Shipped => "shipped",
            Outcome::RolledBack => "rolled_back",
            Outcome::Reverted => "reverted",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }

    /// Parses the wire spelling; anything else is `None`.
    pub fn parse(s: &str) -> Option<Outcome> {
        Outcome::ALL.into_iter().find(|o| o.as_str() == s)
    }

    /// Whether the change is in production now (only `shipped`).
    pub fn is_success(self) -> bool {
        self == Outcome::Shipped
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event as [`outcome_of`] reads it.
#[derive(Debug, Clone, Copy)]
pub struct EventView<'a> {
    /// The event kind (`task.done`, `post_deploy.verdict`, …).
    pub kind: &'a str,
    /// The stage recorded on the event, if any.
    pub stage: Option<&'a str>,
    /// The event's message.
    pub message: &'a str,
    /// The event's data; `Value::Null` when it had none or was not JSON.
    pub data: &'a Value,
}

/// A finished task's outcome with, for a failure or a rollback, where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskOutcome {
    /// How it ended.
    pub outcome: Outcome,
    /// The stage the failure or rollback happened in (`observe` for a rollback).
    pub stage: Option<String>,
    /// Why, in one sentence, when known.
    pub reason: Option<String>,
    /// Whether the outcome was written by the pipeline (`data.outcome`) rather than derived.
    pub recorded: bool,
}

/// The outcome of a task at `stage` with these events (oldest first); `None` while the task is
/// still in a pipeline stage.
pub fn outcome_of(stage: &str, events: &[EventView<'_>]) -> Option<TaskOutcome> {
    let terminal_kind = control::terminal_event(stage)?;
    let str_field = |v: &Value, key: &str| {
        v.get(key)
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    // 1. Recorded by the pipeline on the (last) terminal event.
    if let Some(e) = events.iter().rev().find(|e| e.kind == terminal_kind)
        && let Some(outcome) = e
            .data
            .get("outcome")
            .and_then(Value::as_str)
            .and_then(Outcome::parse)
    {
        let mut stage = str_field(e.data, "stage");
        let mut reason = str_field(e.data, "reason");
        if matches!(outcome, Outcome::RolledBack | Outcome::Reverted) {
            let (s, r) = rollback_story(events);
            stage = stage.or(s);
            reason = reason.or(r);
        }
        return Some(TaskOutcome {
            outcome,
            stage,
            reason,
            recorded: true,
        });
    }
    // 2. Derived from the stage and the events.
    let derived = match stage {
        control::DONE => {
            let failed_watch = events
                .iter()
                .any(|e| e.kind == kind::POST_DEPLOY_VERDICT && verdict_is_failed(e));
            let rolled_back = events.iter().any(|e| e.kind == kind::POST_DEPLOY_ROLLBACK);
            if failed_watch && rolled_back {
                let reverted = events.iter().any(|e| e.kind == kind::RELEASE_REVERTED);
                let (stage, reason) = rollback_story(events);
                TaskOutcome {
                    outcome: if reverted {
                        Outcome::Reverted
                    } else {
                        Outcome::RolledBack
                    },
                    stage,
                    reason,
                    recorded: false,
                }
            } else {
                TaskOutcome {
                    outcome: Outcome::Shipped,
                    stage: None,
                    reason: None,
                    recorded: false,
                }
            }
        }
        control::FAILED => {
            let last = events.iter().rev().find(|e| e.kind == kind::TASK_FAILED);
            // The stage it failed in: the data's `stage`/`from`, else the last pipeline stage
            // an event recorded.
            let stage = last
                .and_then(|e| str_field(e.data, "stage").or_else(|| str_field(e.data, "from")))
                .or_else(|| {
                    events
                        .iter()
                        .rev()
                        .filter_map(|e| e.stage)
                        .find(|s| !control::is_terminal_stage(s))
                        .map(str::to_owned)
                });
            let reason = last.and_then(|e| {
                str_field(e.data, "reason").or_else(|| {
                    let m = e.message.trim();
                    (!m.is_empty()).then(|| m.to_owned())
                })
            });
            TaskOutcome {
                outcome: Outcome::Failed,
                stage,
                reason,
                recorded: false,
            }
        }
        _ => TaskOutcome {
            outcome: Outcome::Cancelled,
            stage: None,
            reason: events
                .iter()
                .rev()
                .find(|e| e.kind == kind::TASK_CANCELLED)
                .map(|e| e.message.trim().to_owned())
                .filter(|m| !m.is_empty()),
            recorded: false,
        },
    };
    Some(derived)
}

/// Whether a `post_deploy.verdict` event says FAILED (its data's `verdict`/`status`, or its
/// message when the data has neither).
fn verdict_is_failed(e: &EventView<'_>) -> bool {
    let field = ["verdict", "post_deploy_status", "status"]
        .iter()
        .find_map(|k| e.data.get(*k).and_then(Value::as_str));
    match field {
        Some(v) => v == "FAILED",
        None => e
            .message
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|w| w == "FAILED"),
    }
}

/// Where and why a watch rolled back: the `observe` stage and the FAILED verdict's reason.
fn rollback_story(events: &[EventView<'_>]) -> (Option<String>, Option<String>) {
    let verdict = events
        .iter()
        .rev()
        .find(|e| e.kind == kind::POST_DEPLOY_VERDICT && verdict_is_failed(e));
    let reason = verdict.and_then(|e| {
        e.data
            .get("reason")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| Some(verdict_reason(e.message)))
            .filter(|s| !s.is_empty())
    });
    (Some("observe".to_owned()), reason)
}

/// The reason in a verdict message `post-deploy watch FAILED: <reason> (action <a>)`; another
/// message is kept whole.
fn verdict_reason(message: &str) -> String {
    let m = message.trim();
    let Some(rest) = m.strip_prefix("post-deploy watch FAILED:") else {
        return m.to_owned();
    };
    let rest = rest.trim();
    match rest.rfind(" (action ") {
        Some(at) if rest.ends_with(')') => rest[..at].trim().to_owned(),
        _ => rest.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `(kind, stage, message, data)` rows → the outcome, as `outcome:stage:reason`.
    fn check(stage: &str, rows: &[(&str, &str, &str, Value)], want: Option<&str>) {
        let views: Vec<EventView<'_>> = rows
            .iter()
            .map(|(kind, st, message, data)| EventView {
                kind,
                stage: Some(st).filter(|s| !s.is_empty()).copied(),
                message,
                data,
            })
            .collect();
        let got = outcome_of(stage, &views).map(|o| {
            format!(
                "{}:{}:{}",
                o.outcome,
                o.stage.unwrap_or_default(),
                o.reason.unwrap_or_default()
            )
        });
        assert_eq!(got.as_deref(), want, "{stage} {rows:?}");
    }

    const NONE: Value = Value::Null;

    #[test]
    fn in_flight_tasks_have_no_outcome() {
        check("review", &[("task.submitted", "intake", "", NONE)], None);
        check("observe", &[], None);
    }

    #[test]
    fn older_tasks_derive_it_from_the_stage() {
        check(
            "done",
            &[("task.done", "done", "lessons: valid", NONE)],
            Some("shipped::"),
        );
        check(
            "failed",
            &[
                ("stage.advanced", "review", "", NONE),
                ("task.failed", "failed", "loop bound reached", json!({})),
            ],
            Some("failed:review:loop bound reached"),
        );
        check(
            "cancelled",
            &[(
                "task.cancelled",
                "cancelled",
                "cancelled by an operator",
                NONE,
            )],
            Some("cancelled::cancelled by an operator"),
        );
    }

    #[test]
    fn a_failed_watch_with_a_rollback_is_rolled_back_without_a_recorded_outcome() {
        let verdict = (
            "post_deploy.verdict",
            "observe",
            "post-deploy watch FAILED: 3 consecutive FAIL polls",
            json!({"verdict": "FAILED", "reason": "3 consecutive FAIL polls"}),
        );
        let rollback = ("post_deploy.rollback", "observe", "rolled back", json!({}));
        let done = ("task.done", "done", "lessons: valid", json!({}));
        check(
            "done",
            &[verdict.clone(), rollback.clone(), done.clone()],
            Some("rolled_back:observe:3 consecutive FAIL polls"),
        );
        // A FAILED verdict without a rollback (alert only) did not roll back: shipped.
        check("done", &[verdict.clone(), done.clone()], Some("shipped::"));
        // A HEALTHY verdict with some rollback event is not a rollback.
        let healthy = (
            "post_deploy.verdict",
            "observe",
            "post-deploy watch HEALTHY",
            json!({"verdict": "HEALTHY"}),
        );
        check(
            "done",
            &[healthy, rollback.clone(), done.clone()],
            Some("shipped::"),
        );
        // A verdict event with no data reads its message.
        let bare = (
            "post_deploy.verdict",
            "observe",
            "post-deploy watch FAILED: 3 FAIL polls (action rollback)",
            NONE,
        );
        check(
            "done",
            &[bare, rollback.clone(), done.clone()],
            Some("rolled_back:observe:3 FAIL polls"),
        );
        // And with a revert on the default branch it is reverted.
        let revert = (
            "release.reverted",
            "observe",
            "",
            json!({"repo": "svc", "work_item": "APP-2", "revert_commit": "abc"}),
        );
        check(
            "done",
            &[verdict, rollback, revert, done],
            Some("reverted:observe:3 consecutive FAIL polls"),
        );
    }

    #[test]
    fn a_recorded_outcome_wins() {
        check(
            "done",
            &[(
                "task.done",
                "done",
                "",
                json!({"outcome": "reverted", "reason": "health failed"}),
            )],
            Some("reverted:observe:health failed"),
        );
        check(
            "failed",
            &[(
                "task.failed",
                "failed",
                "msg",
                json!({"outcome": "failed", "stage": "staging", "reason": "smoke check failed"}),
            )],
            Some("failed:staging:smoke check failed"),
        );
        // An unknown recorded outcome falls back to the derivation.
        check(
            "done",
            &[("task.done", "done", "", json!({"outcome": "weird"}))],
            Some("shipped::"),
        );
    }

    #[test]
    fn spellings_round_trip() {
        for o in Outcome::ALL {
            assert_eq!(Outcome::parse(o.as_str()), Some(o));
        }
        assert_eq!(Outcome::parse("Shipped"), None);
    }
}
