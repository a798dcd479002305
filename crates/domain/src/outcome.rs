//! How a task ended, in one place: the API, the dashboard, `/metrics`, `orch status` and the
//! engine's terminal event all ask [`outcome_of`], so they never disagree about whether an item
//! shipped or was rolled back, and no view can say the opposite of what happened.
//!
//! The outcome is **derived from the recorded facts, never from the stage reached**: what the
//! deploy did (confirmed, failed, unconfirmed), the watch's verdict and action, whether a
//! rollback ran and was verified, whether the change was reverted on the default branch,
//! whether an operator accepted what was live, and what orch last saw live. [`facts_of`] reads
//! them from a task's events (those since its last `task.retried`: a retry starts over);
//! [`outcome_from`] is the rule, a pure function of [`Facts`] (property-tested below: no
//! outcome contradicts the verdict and action recorded). The `outcome` a terminal event
//! carries in its data was computed by the same rule when the task ended; the views derive it
//! again, so an older row written by an older rule is read by today's.
//!
//! The rule, in order:
//! 1. cancelled by an operator → `cancelled`;
//! 2. a rollback of this item's revision ran and was verified (and nothing recorded says a
//!    rollback failed) → `reverted` when the change was also reverted on the default branch,
//!    else `rolled_back`, whether the deploy or the watch rolled it back;
//! 3. the task reached `done`:
//!    - with everything clean (the deploy not failed, the watch not FAILED, no rollback, no
//!      revert) → `shipped` (a DEGRADED watch raised its alert; the change is live);
//!    - otherwise, when an operator released the hold → `accepted` (the operator accepted the
//!      revision that was live then, named in `live`);
//!    - otherwise → `failed` (a record no clean run leaves; never called shipped);
//! 4. anything else → `failed`, with the stage and the reason of the failure.
//!
//! Pure: the caller passes the stage and the events (kind + parsed JSON data).

use serde_json::Value;

use crate::control::{self, events as kind};
use crate::monitor::{ActionTaken, Verdict};
use crate::payload::{
    self, DeployConfirmed, ProductionChecked, ReleaseRolledBack, ReleaseUnheld, RollbackResult,
    StageChange, WatchVerdict,
};

/// How a finished task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Deployed and watched healthy (or a pipeline without a watch finished).
    Shipped,
    /// Production was rolled back; the change is still on the default branch.
    RolledBack,
    /// Rolled back and reverted on the default branch.
    Reverted,
    /// Production could not be verified back, and an operator approved going on: the operator
    /// accepted the revision that was live then.
    Accepted,
    /// The pipeline stopped with an error.
    Failed,
    /// An operator cancelled it.
    Cancelled,
}

impl Outcome {
    /// Every outcome, in display order.
    pub const ALL: [Outcome; 6] = [
        Outcome::Shipped,
        Outcome::RolledBack,
        Outcome::Reverted,
        Outcome::Accepted,
        Outcome::Failed,
        Outcome::Cancelled,
    ];

    /// The wire spelling (`shipped`, `rolled_back`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Shipped => "shipped",
            Outcome::RolledBack => "rolled_back",
            Outcome::Reverted => "reverted",
            Outcome::Accepted => "accepted",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }

    /// The words a person reads (`rolled back and reverted`, `operator accepted`).
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Shipped => "shipped",
            Outcome::RolledBack => "rolled back",
            Outcome::Reverted => "rolled back and reverted",
            Outcome::Accepted => "operator accepted",
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

/// The event kinds [`facts_of`] reads (a caller that reads only some kinds of events, such as
/// `/metrics` over the whole store, reads these).
pub const FACT_KINDS: &[&str] = &[
    kind::TASK_DONE,
    kind::TASK_FAILED,
    kind::TASK_CANCELLED,
    kind::TASK_RETRIED,
    kind::DEPLOY_CONFIRMED,
    kind::DEPLOY_FAILED,
    kind::DEPLOY_UNCONFIRMED,
    kind::DEPLOY_ROLLED_BACK,
    kind::DEPLOY_ROLLBACK_FAILED,
    kind::POST_DEPLOY_VERDICT,
    kind::POST_DEPLOY_ROLLBACK,
    kind::RELEASE_ROLLED_BACK,
    kind::RELEASE_REVERTED,
    kind::RELEASE_UNHELD,
    kind::PRODUCTION_CHECKED,
];

/// How the task's terminal stage was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Terminal {
    /// `done`.
    Done,
    /// `failed`.
    Failed,
    /// `cancelled`.
    Cancelled,
}

/// What the deploy of the task's change did, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeployFact {
    /// No production deploy was recorded (none configured, or it never got there).
    None,
    /// `deploy.confirmed`.
    Confirmed,
    /// `deploy.failed`: the command failed, timed out or could not start.
    Failed,
    /// `deploy.unconfirmed`: the command ended well but production never confirmed it.
    Unconfirmed,
}

/// What the rollback of the task's revision did, as recorded (the latest record wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RollbackFact {
    /// No rollback ran.
    NotRun,
    /// It ran and production was verified back.
    Verified,
    /// It ran (or was started) and production was not verified back.
    Failed,
}

/// The recorded facts an outcome follows from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// The terminal stage.
    pub terminal: Terminal,
    /// What the deploy did.
    pub deploy: DeployFact,
    /// The post-deploy watch's verdict, when a watch ended.
    pub verdict: Option<Verdict>,
    /// The action the watch recorded with its verdict.
    pub action: Option<ActionTaken>,
    /// What the rollback did.
    pub rollback: RollbackFact,
    /// The change was reverted on the default branch.
    pub reverted: bool,
    /// An operator released the repo's hold; what was live then, when known.
    pub accepted: Option<Option<String>>,
    /// The revision orch last saw (or recorded as) live in production, when known.
    pub live: Option<String>,
}

impl Facts {
    /// True when a record says the rollback of the item's revision did not restore production.
    pub fn rollback_failed(&self) -> bool {
        self.rollback == RollbackFact::Failed || self.action == Some(ActionTaken::RollbackFailed)
    }

    /// True when production was rolled back from the item's revision and verified back, and no
    /// record says otherwise.
    pub fn restored(&self) -> bool {
        !self.rollback_failed()
            && (self.rollback == RollbackFact::Verified
                || self.action == Some(ActionTaken::Rollback))
    }

    /// True when nothing recorded went wrong in deploy or observe.
    pub fn clean(&self) -> bool {
        !matches!(self.deploy, DeployFact::Failed | DeployFact::Unconfirmed)
            && self.verdict != Some(Verdict::Failed)
            && matches!(
                self.action,
                None | Some(ActionTaken::None | ActionTaken::Alert)
            )
            && self.rollback == RollbackFact::NotRun
            && !self.reverted
    }
}

/// The rule (see the module's comment): the outcome of a task with these facts.
pub fn outcome_from(f: &Facts) -> Outcome {
    if f.terminal == Terminal::Cancelled {
        return Outcome::Cancelled;
    }
    if f.restored() {
        return if f.reverted {
            Outcome::Reverted
        } else {
            Outcome::RolledBack
        };
    }
    match f.terminal {
        Terminal::Done if f.clean() => Outcome::Shipped,
        Terminal::Done if f.accepted.is_some() => Outcome::Accepted,
        _ => Outcome::Failed,
    }
}

/// A finished task's outcome with, for a failure or a rollback, where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskOutcome {
    /// How it ended.
    pub outcome: Outcome,
    /// The stage the failure or rollback happened in (`observe` for a watch's rollback).
    pub stage: Option<String>,
    /// Why, in one sentence, when known.
    pub reason: Option<String>,
    /// The revision orch last saw live in production for this item, when known.
    pub live: Option<String>,
    /// Whether the terminal event carries the same outcome (written when the task ended).
    pub recorded: bool,
}

/// A stage change's text key as [`str_field`] reads one: trimmed, and `None` when empty.
fn said(value: &Option<String>) -> Option<String> {
    value
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

fn str_field(v: &Value, key: &str) -> Option<String> {
    v.get(key)
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// The facts of a task at terminal stage `stage` from its events (oldest first); `None` for a
/// stage that is not terminal. Only the events since the task's last `task.retried` count.
pub fn facts_of(stage: &str, events: &[EventView<'_>]) -> Option<Facts> {
    let terminal = match stage {
        control::DONE => Terminal::Done,
        control::FAILED => Terminal::Failed,
        control::CANCELLED => Terminal::Cancelled,
        _ => return None,
    };
    let from = events
        .iter()
        .rposition(|e| e.kind == kind::TASK_RETRIED)
        .map_or(0, |i| i + 1);
    let mut f = Facts {
        terminal,
        deploy: DeployFact::None,
        verdict: None,
        action: None,
        rollback: RollbackFact::NotRun,
        reverted: false,
        accepted: None,
        live: None,
    };
    for e in &events[from..] {
        match e.kind {
            kind::DEPLOY_CONFIRMED => {
                f.deploy = DeployFact::Confirmed;
                f.live = payload::read_value::<DeployConfirmed>(e.data)
                    .map(|d| d.revision)
                    .filter(|r| !r.trim().is_empty())
                    .or(f.live.take());
            }
            kind::DEPLOY_FAILED => f.deploy = DeployFact::Failed,
            kind::DEPLOY_UNCONFIRMED => f.deploy = DeployFact::Unconfirmed,
            kind::DEPLOY_ROLLED_BACK => f.rollback = RollbackFact::Verified,
            // Written with `attempted: false` when no rollback was run at all.
            kind::DEPLOY_ROLLBACK_FAILED if RollbackResult::attempted_in(e.data) => {
                f.rollback = RollbackFact::Failed;
            }
            kind::POST_DEPLOY_VERDICT => {
                f.verdict = verdict_of(e);
                f.action = action_of(e);
            }
            kind::POST_DEPLOY_ROLLBACK => {
                f.rollback = if RollbackResult::verified_in(e.data) {
                    RollbackFact::Verified
                } else {
                    RollbackFact::Failed
                };
            }
            // Recorded only after a verified rollback.
            kind::RELEASE_ROLLED_BACK => {
                f.rollback = RollbackFact::Verified;
                if let Some(live) = payload::read_value::<ReleaseRolledBack>(e.data)
                    .and_then(|r| r.live)
                    .filter(|l| !l.trim().is_empty())
                {
                    f.live = Some(live);
                }
            }
            kind::RELEASE_REVERTED => f.reverted = true,
            kind::RELEASE_UNHELD => {
                let live = payload::read_value::<ReleaseUnheld>(e.data)
                    .and_then(|u| u.live)
                    .filter(|l| !l.trim().is_empty());
                if live.is_some() {
                    f.live.clone_from(&live);
                }
                f.accepted = Some(live);
            }
            kind::PRODUCTION_CHECKED => {
                f.live = payload::read_value::<ProductionChecked>(e.data)
                    .and_then(|c| c.live)
                    .filter(|l| !l.trim().is_empty());
            }
            _ => {}
        }
    }
    Some(f)
}

/// The outcome of a task at `stage` with these events (oldest first); `None` while the task is
/// still in a pipeline stage.
pub fn outcome_of(stage: &str, events: &[EventView<'_>]) -> Option<TaskOutcome> {
    let facts = facts_of(stage, events)?;
    let outcome = outcome_from(&facts);
    let terminal_kind = control::terminal_event(stage)?;
    let last = events.iter().rev().find(|e| e.kind == terminal_kind);
    let recorded = last
        .and_then(|e| payload::read_value::<StageChange>(e.data))
        .and_then(|c| c.task_outcome())
        == Some(outcome);
    let (stage, reason) = match outcome {
        Outcome::Shipped => (None, None),
        Outcome::RolledBack | Outcome::Reverted => rollback_story(events, last),
        Outcome::Accepted => {
            let live = facts
                .accepted
                .clone()
                .flatten()
                .map_or_else(|| "an unverified revision".to_owned(), |r| format!("`{r}`"));
            let (stage, why) = rollback_story(events, last);
            let why = why.map_or_else(String::new, |w| format!(": {w}"));
            (
                stage,
                Some(format!(
                    "production was not verified back and an operator accepted {live}{why}"
                )),
            )
        }
        Outcome::Failed => failure_story(events, last),
        Outcome::Cancelled => (
            None,
            last.map(|e| e.message.trim().to_owned())
                .filter(|m| !m.is_empty()),
        ),
    };
    Some(TaskOutcome {
        outcome,
        stage,
        reason,
        live: facts.live,
        recorded,
    })
}

/// Where and why a failed task failed: the terminal event's `stage`/`from` and `reason` (or its
/// message), else the last pipeline stage an event recorded.
fn failure_story(
    events: &[EventView<'_>],
    last: Option<&EventView<'_>>,
) -> (Option<String>, Option<String>) {
    let change = last.and_then(|e| payload::read_value::<StageChange>(e.data));
    let stage = change
        .as_ref()
        .and_then(|c| said(&c.stage).or_else(|| said(&c.from)))
        .filter(|s| !control::is_terminal_stage(s))
        .or_else(|| {
            events
                .iter()
                .rev()
                .filter_map(|e| e.stage)
                .find(|s| !control::is_terminal_stage(s))
                .map(str::to_owned)
        });
    let reason = last.and_then(|e| {
        change.as_ref().and_then(|c| said(&c.reason)).or_else(|| {
            let m = e.message.trim();
            (!m.is_empty()).then(|| m.to_owned())
        })
    });
    (stage, reason)
}

/// The verdict of a `post_deploy.verdict` event.
fn verdict_of(e: &EventView<'_>) -> Option<Verdict> {
    WatchVerdict::verdict_in(e.data, e.message)
}

/// The action of a `post_deploy.verdict` event.
fn action_of(e: &EventView<'_>) -> Option<ActionTaken> {
    WatchVerdict::action_in(e.data, e.message)
}

/// Where and why production was rolled back: the stage of the rollback (`observe` for the
/// watch's, `deploy` for an unconfirmed or failed deploy's) and the reason (the FAILED verdict's,
/// else the deploy failure's, else the terminal event's).
fn rollback_story(
    events: &[EventView<'_>],
    last: Option<&EventView<'_>>,
) -> (Option<String>, Option<String>) {
    let verdict = events
        .iter()
        .rev()
        .find(|e| e.kind == kind::POST_DEPLOY_VERDICT && verdict_of(e) == Some(Verdict::Failed));
    if let Some(v) = verdict {
        let reason = str_field(v.data, "reason")
            .or_else(|| Some(verdict_reason(v.message)))
            .filter(|s| !s.is_empty());
        return (Some("observe".to_owned()), reason);
    }
    let deploy = events
        .iter()
        .rev()
        .find(|e| matches!(e.kind, kind::DEPLOY_FAILED | kind::DEPLOY_UNCONFIRMED));
    if let Some(d) = deploy {
        let m = d.message.trim();
        return (
            Some("deploy".to_owned()),
            (!m.is_empty()).then(|| m.to_owned()),
        );
    }
    let reason = last
        .and_then(|e| payload::read_value::<StageChange>(e.data))
        .and_then(|c| said(&c.reason));
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
    use proptest::prelude::*;
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

    fn verdict(v: &str, action: &str) -> (&'static str, &'static str, &'static str, Value) {
        (
            "post_deploy.verdict",
            "observe",
            "post-deploy watch",
            json!({"verdict": v, "action": action, "reason": "3 consecutive FAIL polls"}),
        )
    }

    #[test]
    fn in_flight_tasks_have_no_outcome() {
        check("review", &[("task.submitted", "intake", "", NONE)], None);
        check("observe", &[], None);
    }

    #[test]
    fn plain_endings_follow_the_terminal_event() {
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
            "failed",
            &[(
                "task.failed",
                "failed",
                "msg",
                json!({"outcome": "failed", "stage": "staging", "reason": "smoke check failed"}),
            )],
            Some("failed:staging:smoke check failed"),
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
    fn a_verified_rollback_is_rolled_back_or_reverted() {
        let rollback = (
            "post_deploy.rollback",
            "observe",
            "rolled back",
            json!({"verified": true}),
        );
        let done = ("task.done", "done", "lessons: valid", json!({}));
        check(
            "done",
            &[
                verdict("FAILED", "rollback"),
                rollback.clone(),
                done.clone(),
            ],
            Some("rolled_back:observe:3 consecutive FAIL polls"),
        );
        let revert = (
            "release.reverted",
            "observe",
            "",
            json!({"repo": "svc", "work_item": "APP-2", "revert_commit": "abc"}),
        );
        check(
            "done",
            &[
                verdict("FAILED", "rollback"),
                rollback.clone(),
                revert.clone(),
                done,
            ],
            Some("reverted:observe:3 consecutive FAIL polls"),
        );
        // A failed deploy rolled back by the deployer, then reverted: the task failed, the
        // facts say production went back and the change left the default branch.
        check(
            "failed",
            &[
                ("deploy.rolled_back", "deploy", "rolled back", json!({})),
                revert,
                (
                    "deploy.failed",
                    "deploy",
                    "deploy command `sh deploy.sh` ended with exit 1",
                    json!({}),
                ),
                ("task.failed", "failed", "", json!({"stage": "deploy"})),
            ],
            Some("reverted:deploy:deploy command `sh deploy.sh` ended with exit 1"),
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
            &[bare, ("task.done", "done", "", NONE)],
            Some("rolled_back:observe:3 FAIL polls"),
        );
    }

    #[test]
    fn an_approval_after_a_failed_rollback_is_never_shipped() {
        let failed_rollback = (
            "post_deploy.rollback",
            "observe",
            "rollback ran but is not verified",
            json!({"verified": false}),
        );
        let held = ("release.held", "observe", "held", json!({}));
        let unheld = (
            "release.unheld",
            "lessons",
            "released",
            json!({"repo": "svc", "live": "abc1234"}),
        );
        let done = (
            "task.done",
            "done",
            "lessons: valid",
            json!({"outcome": "shipped"}),
        );
        check(
            "done",
            &[
                verdict("FAILED", "rollback_failed"),
                failed_rollback,
                held,
                unheld,
                done.clone(),
            ],
            Some(
                "accepted:observe:production was not verified back and an operator accepted `abc1234`: 3 consecutive FAIL polls",
            ),
        );
        // FAILED with an alert only (no rollback command) and then approved: accepted too.
        check(
            "done",
            &[
                verdict("FAILED", "alert"),
                (
                    "release.unheld",
                    "lessons",
                    "",
                    json!({"repo": "svc", "live": null}),
                ),
                done.clone(),
            ],
            Some(
                "accepted:observe:production was not verified back and an operator accepted an unverified revision: 3 consecutive FAIL polls",
            ),
        );
        // A FAILED verdict that reached done with nobody's approval is not called shipped.
        check(
            "done",
            &[verdict("FAILED", "alert"), done],
            Some("failed:observe:lessons: valid"),
        );
    }

    #[test]
    fn a_retry_starts_the_facts_over() {
        check(
            "done",
            &[
                ("deploy.failed", "deploy", "exit 1", json!({})),
                ("deploy.rolled_back", "deploy", "", json!({})),
                ("task.failed", "failed", "", json!({})),
                ("task.retried", "deploy", "", json!({})),
                ("deploy.confirmed", "deploy", "", json!({"revision": "abc"})),
                verdict("HEALTHY", "none"),
                ("task.done", "done", "", json!({})),
            ],
            Some("shipped::"),
        );
    }

    #[test]
    fn the_live_revision_is_the_last_one_recorded() {
        let rows = [
            ("deploy.confirmed", "deploy", "", json!({"revision": "new"})),
            verdict("FAILED", "rollback"),
            (
                "release.rolled_back",
                "observe",
                "",
                json!({"revision": "new", "live": "old"}),
            ),
            ("task.done", "done", "", json!({"outcome": "rolled_back"})),
        ];
        let views: Vec<EventView<'_>> = rows
            .iter()
            .map(|(kind, st, message, data)| EventView {
                kind,
                stage: Some(*st),
                message,
                data,
            })
            .collect();
        let o = outcome_of("done", &views).unwrap();
        assert_eq!(o.outcome, Outcome::RolledBack);
        assert_eq!(o.live.as_deref(), Some("old"));
        assert!(o.recorded);
    }

    #[test]
    fn spellings_round_trip() {
        for o in Outcome::ALL {
            assert_eq!(Outcome::parse(o.as_str()), Some(o));
        }
        assert_eq!(Outcome::parse("Shipped"), None);
    }

    fn any_facts() -> impl Strategy<Value = Facts> {
        let terminal = prop_oneof![
            Just(Terminal::Done),
            Just(Terminal::Failed),
            Just(Terminal::Cancelled)
        ];
        let deploy = prop_oneof![
            Just(DeployFact::None),
            Just(DeployFact::Confirmed),
            Just(DeployFact::Failed),
            Just(DeployFact::Unconfirmed)
        ];
        let verdict = proptest::option::of(prop_oneof![
            Just(Verdict::Healthy),
            Just(Verdict::Degraded),
            Just(Verdict::Failed)
        ]);
        let action = proptest::option::of(prop_oneof![
            Just(ActionTaken::None),
            Just(ActionTaken::Alert),
            Just(ActionTaken::Rollback),
            Just(ActionTaken::RollbackFailed)
        ]);
        let rollback = prop_oneof![
            Just(RollbackFact::NotRun),
            Just(RollbackFact::Verified),
            Just(RollbackFact::Failed)
        ];
        let rev = proptest::option::of("[0-9a-f]{7}");
        (
            terminal,
            deploy,
            verdict,
            action,
            rollback,
            any::<bool>(),
            proptest::option::of(rev.clone()),
            rev,
        )
            .prop_map(
                |(terminal, deploy, verdict, action, rollback, reverted, accepted, live)| Facts {
                    terminal,
                    deploy,
                    verdict,
                    action,
                    rollback,
                    reverted,
                    accepted,
                    live,
                },
            )
    }

    /// Events that record `f` (the facts the rule reads), in an order a run could write them.
    fn events_of(f: &Facts) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        match f.deploy {
            DeployFact::None => {}
            DeployFact::Confirmed => out.push(("deploy.confirmed", json!({"revision": "r"}))),
            DeployFact::Failed => out.push(("deploy.failed", json!({}))),
            DeployFact::Unconfirmed => out.push(("deploy.unconfirmed", json!({}))),
        }
        match f.rollback {
            RollbackFact::NotRun => {}
            RollbackFact::Verified => out.push(("post_deploy.rollback", json!({"verified": true}))),
            RollbackFact::Failed => out.push(("post_deploy.rollback", json!({"verified": false}))),
        }
        if let Some(v) = f.verdict {
            let action = f.action.map(ActionTaken::as_str);
            out.push((
                "post_deploy.verdict",
                json!({"verdict": v.as_str(), "action": action}),
            ));
        }
        if f.reverted {
            out.push(("release.reverted", json!({})));
        }
        if let Some(live) = &f.accepted {
            out.push(("release.unheld", json!({"live": live})));
        }
        let (kind, stage) = match f.terminal {
            Terminal::Done => ("task.done", "done"),
            Terminal::Failed => ("task.failed", "failed"),
            Terminal::Cancelled => ("task.cancelled", "cancelled"),
        };
        out.push((kind, json!({"stage_hint": stage})));
        out
    }

    proptest! {
        #![proptest_config(crate::proptest_config(4096))]

        /// No outcome contradicts the verdict and action recorded.
        #[test]
        fn no_outcome_contradicts_the_record(f in any_facts()) {
            let o = outcome_from(&f);
            // Cancelled exactly when cancelled.
            prop_assert_eq!(o == Outcome::Cancelled, f.terminal == Terminal::Cancelled);
            // Shipped only when nothing went wrong and the task reached done.
            if o == Outcome::Shipped {
                prop_assert_eq!(f.terminal, Terminal::Done);
                prop_assert!(f.verdict != Some(Verdict::Failed));
                prop_assert!(!matches!(f.action, Some(ActionTaken::Rollback | ActionTaken::RollbackFailed)));
                prop_assert_eq!(f.rollback, RollbackFact::NotRun);
                prop_assert!(!matches!(f.deploy, DeployFact::Failed | DeployFact::Unconfirmed));
                prop_assert!(!f.reverted);
            }
            // Rolled back / reverted only on a verified rollback nothing contradicts.
            if matches!(o, Outcome::RolledBack | Outcome::Reverted) {
                prop_assert!(f.rollback == RollbackFact::Verified || f.action == Some(ActionTaken::Rollback));
                prop_assert!(f.rollback != RollbackFact::Failed);
                prop_assert!(f.action != Some(ActionTaken::RollbackFailed));
                prop_assert_eq!(o == Outcome::Reverted, f.reverted);
            }
            // A rollback recorded as failed is never a success or a rollback.
            if f.rollback_failed() {
                prop_assert!(!matches!(o, Outcome::Shipped | Outcome::RolledBack | Outcome::Reverted));
            }
            // A FAILED verdict is never shipped.
            if f.verdict == Some(Verdict::Failed) {
                prop_assert!(o != Outcome::Shipped);
            }
            // Accepted needs an operator's approval at done.
            if o == Outcome::Accepted {
                prop_assert!(f.accepted.is_some());
                prop_assert_eq!(f.terminal, Terminal::Done);
            }
            // A failed task is never shipped or accepted.
            if f.terminal == Terminal::Failed {
                prop_assert!(!matches!(o, Outcome::Shipped | Outcome::Accepted));
            }
        }

        /// The facts read back from events that record them are those facts, and the outcome
        /// the views derive from the events is the rule's.
        #[test]
        fn facts_read_back_from_their_events(f in any_facts()) {
            let rows = events_of(&f);
            let stage = match f.terminal {
                Terminal::Done => "done",
                Terminal::Failed => "failed",
                Terminal::Cancelled => "cancelled",
            };
            let views: Vec<EventView<'_>> = rows
                .iter()
                .map(|(kind, data)| EventView { kind, stage: None, message: "", data })
                .collect();
            let got = facts_of(stage, &views).unwrap();
            prop_assert_eq!(got.terminal, f.terminal);
            prop_assert_eq!(got.deploy, f.deploy);
            prop_assert_eq!(got.verdict, f.verdict);
            prop_assert_eq!(got.action, f.verdict.and(f.action));
            prop_assert_eq!(got.rollback, f.rollback);
            prop_assert_eq!(got.reverted, f.reverted);
            prop_assert_eq!(&got.accepted, &f.accepted);
            let o = outcome_of(stage, &views).unwrap();
            prop_assert_eq!(o.outcome, outcome_from(&got));
        }
    }
}
