//! The data of the events that more than one crate reads, as types: the writer serializes one
//! and every reader deserializes the same one, so each key is spelled once and a reader cannot
//! ask for a key the writer never wrote. Old rows stay readable: a key added later has a
//! default.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::control;
use crate::monitor::{ActionTaken, Verdict};
use crate::outcome::Outcome;

/// Reads an event's data (JSON text) as `T`; `None` when it is not that shape (a row of
/// another kind, or corrupt): the reader skips it, never invents one.
pub fn read<T: DeserializeOwned>(data: &str) -> Option<T> {
    serde_json::from_str(data).ok()
}

/// Reads an event's data already parsed as JSON as `T` (see [`read`]).
pub fn read_value<T: DeserializeOwned>(data: &serde_json::Value) -> Option<T> {
    T::deserialize(data).ok()
}

/// An event's data as stored: the JSON text of `payload` (keys in the order `json!` writes
/// them, so a typed writer stores the same text the untyped one did).
pub fn text<T: Serialize>(payload: &T) -> String {
    serde_json::to_value(payload).map_or_else(|_| "{}".to_owned(), |v| v.to_string())
}

/// A key some writers store as `null` and others leave out: `None` when absent, `Some(None)`
/// when `null` (a reader may tell the two apart, as `orch replay` does with `commit`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// The data of a stage change: `stage.advanced`, `stage.loop_back`, `task.done`, `task.failed`,
/// `task.cancelled` and `task.retried` (see [`control::events`]). Each writer fills the keys it
/// knows and leaves the others out (absent keys are not written), so every row reads back as it
/// was written; rows of older versions lack some keys, hence every key is optional.
///
/// Who writes which keys:
/// - the engine's stage change (advance, loop back, end by `decide`): `from`, `to`, `outcome`
///   (the gate's value; on an end, the task's [`Outcome`], the gate's value moving to
///   `result`), `feedback` and `commit` (`null` when none), `awaiting_approval`, `attempt`;
///   an end in `failed` adds `stage` and `reason`;
/// - a failure outside `decide` (the engine's [`StageChange::failed`], the store's stranded
///   task): `from`, `to`, `outcome`, `stage`, `reason`;
/// - an operator's retry ([`StageChange::retried`]): `from`, `to`, `by`; a cancel
///   ([`StageChange::cancelled`]): `from`, `to`, `outcome`, `reason`, `by`;
/// - a forge review's change request (a loop back): `from`, `to`, `outcome`, `feedback`,
///   `review`, `pull`, `by`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageChange {
    /// The stage left (absent in some old rows of a stranded task's failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// The stage entered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// Between pipeline stages, the gate's value (`PASS`, `CHANGES_REQUESTED`, `NOT_SUCCESS`,
    /// …); when the task ends, the task's outcome ([`StageChange::task_outcome`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// When the pipeline ended the task, the last gate's value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// The feedback document the stage entered reads (a loop back); `Some(None)`: the engine
    /// said there is none (`null`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub feedback: Option<Option<String>>,
    /// The stage entered waits for an approval before it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub awaiting_approval: Option<bool>,
    /// The commit the gate read; `Some(None)`: the stage committed nothing new (`null`); `None`:
    /// no gate was read (an operator's call, a failure, a review).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub commit: Option<Option<String>>,
    /// The attempt of the stage job that made the change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<i64>,
    /// The stage a failure happened in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// Why the task failed or was cancelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The forge review whose change request sent the item back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub review: Option<u64>,
    /// The pull request of that review.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull: Option<u64>,
    /// Who made the call ([`control::actor::Actor::data`], under [`control::actor::KEY`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<Value>,
}

impl StageChange {
    /// A move from `from` to `to`, nothing else said yet.
    pub fn new(from: &str, to: &str) -> StageChange {
        StageChange {
            from: Some(from.to_owned()),
            to: Some(to.to_owned()),
            ..StageChange::default()
        }
    }

    /// A task failed in `stage` outside the pipeline's decision (a job that failed for good, a
    /// stage that cannot run) because of `reason`.
    pub fn failed(stage: &str, reason: &str) -> StageChange {
        StageChange {
            outcome: Some(control::FAILED.to_owned()),
            stage: Some(stage.to_owned()),
            reason: Some(reason.to_owned()),
            ..StageChange::new(stage, control::FAILED)
        }
    }

    /// An operator put a failed task back at `stage`; `by` is the caller's data.
    pub fn retried(stage: &str, by: Value) -> StageChange {
        StageChange {
            by: Some(by),
            ..StageChange::new(control::FAILED, stage)
        }
    }

    /// An operator cancelled a task at `from`, saying `reason`; `by` is the caller's data.
    pub fn cancelled(from: &str, reason: &str, by: Value) -> StageChange {
        StageChange {
            outcome: Some(control::CANCELLED.to_owned()),
            reason: Some(reason.to_owned()),
            by: Some(by),
            ..StageChange::new(from, control::CANCELLED)
        }
    }

    /// The task's outcome a terminal change recorded (`None` for a gate's value, or a word of
    /// no outcome).
    pub fn task_outcome(&self) -> Option<Outcome> {
        self.outcome.as_deref().and_then(Outcome::parse)
    }

    /// Whether the stage entered waits for an approval.
    pub fn awaits_approval(&self) -> bool {
        self.awaiting_approval == Some(true)
    }

    /// The stage this change says a failure happened in: its `stage`, else the stage it left.
    pub fn failed_stage(&self) -> Option<&str> {
        self.stage.as_deref().or(self.from.as_deref())
    }

    /// The data as stored.
    pub fn text(&self) -> String {
        text(self)
    }
}

/// `stage.requeued`: a stage job comes back later as a fresh job of the same visit (a defer, a
/// tick, a wait). The engine writes every key; a row that lacks one reads it as `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRequeued {
    /// When the follow-up is due, from now.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// The follow-up's marker line ([`control::markers`]), whose count is a restart-safe
    /// counter (a staging tool error's defers, ORCH-115).
    #[serde(default)]
    pub marker: Option<String>,
    /// The follow-up's priority.
    #[serde(default)]
    pub priority: Option<i64>,
}

/// `node.takeover`: a node took over a job pinned to a node gone longer than the grace.
/// Every key is written; an old or broken row reads with the missing ones `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeTakeover {
    /// The node that is gone.
    #[serde(default)]
    pub from: Option<String>,
    /// The node that took the job over.
    #[serde(default)]
    pub to: Option<String>,
    /// When the gone node was last seen (`null`: it left no beacon).
    #[serde(default)]
    pub last_seen_ms: Option<i64>,
    /// The visit of the stage.
    #[serde(default)]
    pub seq: Option<i64>,
    /// The stage.
    #[serde(default)]
    pub stage: Option<String>,
    /// The job taken over.
    #[serde(default)]
    pub job: Option<i64>,
    /// The job's kind.
    #[serde(default)]
    pub agent: Option<String>,
}

/// `forge.pull`: the item's pull request was found or opened on the forge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgePull {
    /// Its number.
    pub number: u64,
    /// Its page.
    #[serde(default)]
    pub url: String,
    /// The work branch.
    #[serde(default)]
    pub head: String,
    /// The default branch it would merge into.
    #[serde(default)]
    pub base: String,
    /// Opened now (`false`: an existing one was found by its head).
    #[serde(default)]
    pub opened: bool,
}

/// One commit status the forge sync set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentStatus {
    /// The status's context (`orch/<stage>`).
    pub context: String,
    /// Its state (`pending`, `success`, `failure`, `error`).
    pub state: String,
}

/// `forge.synced`: the forge is up to date with the item's events up to `through` (the
/// sync's cursor).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgeSynced {
    /// The newest event on the forge.
    pub through: i64,
    /// The pull request, once there is one (`null` before).
    #[serde(default)]
    pub pull: Option<u64>,
    /// The statuses set.
    #[serde(default)]
    pub statuses: Vec<SentStatus>,
    /// The digest of the description the forge has (`null` before there is a pull request).
    #[serde(default)]
    pub body: Option<String>,
    /// Whether this sync sent the description (it is sent only when it changed).
    #[serde(default)]
    pub described: bool,
}

/// `forge.review`: a review of the item's pull request was taken (noted, or an approval about
/// to be made).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgeReview {
    /// The review's id on the forge.
    pub review: u64,
    /// Its state on the forge (`APPROVED`, `CHANGES_REQUESTED`, …).
    #[serde(default)]
    pub state: String,
    /// The pull request.
    #[serde(default)]
    pub pull: Option<u64>,
    /// What orch did: [`ForgeReview::APPROVING`], or `noted` (with `why`).
    #[serde(default)]
    pub action: String,
    /// Why it was only noted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// The stage an approval approves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// The visit an approval approves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<i64>,
    /// The reviewer's login.
    #[serde(default)]
    pub by: String,
}

impl ForgeReview {
    /// The action of an approval recorded before it is made.
    pub const APPROVING: &'static str = "approving";
}

/// `forge.outcome`: the item's outcome was said on the forge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgeOutcome {
    /// The outcome said ([`Outcome`]'s word).
    #[serde(default)]
    pub outcome: String,
    /// The visit that ended the item.
    pub seq: i64,
    /// The issue.
    #[serde(default)]
    pub issue: u64,
    /// The pull request, when there was one.
    #[serde(default)]
    pub pull: Option<u64>,
    /// The numbers of the issue and pull request commented on.
    #[serde(default)]
    pub comments: Vec<u64>,
    /// The comments' ids.
    #[serde(default)]
    pub comment_ids: Vec<u64>,
    /// The issue was closed (the item shipped).
    #[serde(default)]
    pub closed: bool,
}

/// What a `deploy.skipped` (no deploy command) goes on with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipThen {
    /// Nothing to deploy and nothing to watch (no health URL either): the stage passes.
    Pass,
    /// The revision is taken as deployed outside orch: confirmed and watched at the health URL.
    Confirm,
}

/// `deploy.skipped`: no deploy command is configured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeploySkipped {
    /// The revision not deployed by orch.
    pub revision: String,
    /// What the stage does instead.
    pub outcome: SkipThen,
    /// The visit of the stage.
    #[serde(default)]
    pub seq: Option<i64>,
}

/// How a change reached a deployed revision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    /// The work item's change was merged.
    #[default]
    Merge,
    /// A revert of a change shipped before.
    Revert,
    /// Merged and reverted within the range: not in the deployed revision.
    Reverted,
}

impl Change {
    /// The word stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Change::Merge => "merge",
            Change::Revert => "revert",
            Change::Reverted => "reverted",
        }
    }
}

/// One change a deploy shipped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShippedChange {
    /// The work item whose commit it is.
    pub work_item: String,
    /// The item's last commit in the range.
    #[serde(default)]
    pub commit: String,
    /// How it got there.
    #[serde(default)]
    pub change: Change,
}

impl ShippedChange {
    /// `APP-3`, or `APP-3 (revert)` for anything but a merge.
    pub fn label(&self) -> String {
        match self.change {
            Change::Merge => self.work_item.clone(),
            other => format!("{} ({})", self.work_item, other.as_str()),
        }
    }
}

/// `release.deployed`: a production deploy and what it shipped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseDeployed {
    /// The repo deployed to.
    pub repo: String,
    /// The revision deployed.
    pub revision: String,
    /// The revision live before it, when known.
    #[serde(default)]
    pub previous_revision: Option<String>,
    /// Whether the service confirmed it runs `revision`.
    #[serde(default)]
    pub confirmed: bool,
    /// The changes between `previous_revision` and `revision`, oldest first.
    #[serde(default)]
    pub items: Vec<ShippedChange>,
    /// Released through the forge: the staged commit whose tree `revision` has (the forge made
    /// `revision` of it: a merge, a squash, a rebase).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged: Option<String>,
    /// How the forge made `revision` (the merge method), with `staged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// The visit of the deploy stage that deployed it.
    #[serde(default)]
    pub seq: Option<i64>,
}

/// `deploy.confirmed`: the deploy command ran and production named `revision` (or the deploy
/// was otherwise confirmed); `armed` when a post-deploy watch was armed for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeployConfirmed {
    /// The revision deployed.
    pub revision: String,
    /// A post-deploy watch was armed (the repo has a `health_url`).
    #[serde(default)]
    pub armed: bool,
    /// The visit of the stage.
    #[serde(default)]
    pub seq: Option<i64>,
}

/// `release.reverted`: the item's change `reverted_from..reverted_to` taken out of the default
/// branch by `revert_commit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseReverted {
    /// The repo.
    #[serde(default)]
    pub repo: String,
    /// The item reverted.
    #[serde(default)]
    pub work_item: String,
    /// The commit that reverts it, on the default branch.
    pub revert_commit: String,
    /// The default branch before the item's change.
    #[serde(default)]
    pub reverted_from: String,
    /// The default branch with the item's change.
    #[serde(default)]
    pub reverted_to: String,
}

/// `release.unheld`: an operator released the repo's hold; what production named then.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReleaseUnheld {
    /// The repo.
    #[serde(default)]
    pub repo: String,
    /// Who released it (`control::actor`'s data).
    #[serde(default)]
    pub by: Value,
    /// The revision production named, when it answered.
    #[serde(default)]
    pub live: Option<String>,
    /// Whether its health check passed, when it was looked at.
    #[serde(default)]
    pub healthy: Option<bool>,
}

/// `release.rolled_back`: production went back from `revision` to `live`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRolledBack {
    /// The repo rolled back.
    #[serde(default)]
    pub repo: String,
    /// The revision rolled back.
    #[serde(default)]
    pub revision: String,
    /// What runs now, when known.
    #[serde(default)]
    pub live: Option<String>,
}

/// The result of a rollback: `deploy.rolled_back` / `deploy.rollback_failed` (the deployer's)
/// and `post_deploy.rollback` (the watch's, verified or not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackResult {
    /// The revision rolled back.
    pub revision: String,
    /// Production was verified back (healthy, and no longer at `revision`).
    #[serde(default)]
    pub verified: bool,
    /// A rollback command ran (rows of old versions say `false` when none did).
    #[serde(default = "yes")]
    pub attempted: bool,
    /// What the service named after it, when it answered.
    #[serde(default)]
    pub live: Option<String>,
    /// The visit of the stage.
    #[serde(default)]
    pub seq: Option<i64>,
}

fn yes() -> bool {
    true
}

/// `post_deploy.verdict`: how a post-deploy watch ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchVerdict {
    /// The verdict.
    pub verdict: Verdict,
    /// What the monitor did about it.
    pub action: ActionTaken,
    /// The watched revision.
    #[serde(default)]
    pub revision: String,
    /// `16-post-deploy-log.md` was written.
    #[serde(default)]
    pub log_written: bool,
    /// What of the watch's evidence was lost (a corrupt state file), when some was.
    #[serde(default)]
    pub evidence_lost: Option<String>,
    /// The visit of the stage.
    #[serde(default)]
    pub seq: Option<i64>,
}

impl WatchVerdict {
    /// The verdict of a `post_deploy.verdict` row written by any version of orch: the typed
    /// data's, else an older row's `post_deploy_status` or `status`, else the verdict word in
    /// its message.
    pub fn verdict_in(data: &Value, message: &str) -> Option<Verdict> {
        let parse = |w: &str| match w {
            "HEALTHY" => Some(Verdict::Healthy),
            "DEGRADED" => Some(Verdict::Degraded),
            "FAILED" => Some(Verdict::Failed),
            _ => None,
        };
        if let Some(v) = read_value::<WatchVerdict>(data) {
            return Some(v.verdict);
        }
        match ["verdict", "post_deploy_status", "status"]
            .iter()
            .find_map(|k| data.get(*k).and_then(Value::as_str))
        {
            Some(word) => parse(word),
            None => message
                .split(|c: char| !c.is_ascii_alphanumeric())
                .find_map(parse),
        }
    }

    /// The action of a `post_deploy.verdict` row written by any version of orch: the typed
    /// data's, else an older row's `action`, else `(action <a>)` in its message.
    pub fn action_in(data: &Value, message: &str) -> Option<ActionTaken> {
        if let Some(v) = read_value::<WatchVerdict>(data) {
            return Some(v.action);
        }
        let word = match data.get("action").and_then(Value::as_str) {
            Some(a) => a.trim().to_owned(),
            None => {
                let (_, rest) = message.rsplit_once("(action ")?;
                rest.trim_end_matches(')').trim().to_owned()
            }
        };
        [
            ActionTaken::None,
            ActionTaken::Alert,
            ActionTaken::Rollback,
            ActionTaken::RollbackFailed,
        ]
        .into_iter()
        .find(|a| a.as_str() == word)
    }
}

impl RollbackResult {
    /// Whether a rollback command ran, for a row of any version: rows that say nothing ran
    /// (`attempted: false`) are the only `false`.
    pub fn attempted_in(data: &Value) -> bool {
        read_value::<RollbackResult>(data).map_or_else(
            || data.get("attempted") != Some(&Value::Bool(false)),
            |r| r.attempted,
        )
    }

    /// Whether production was verified back, for a row of any version (unreadable: no).
    pub fn verified_in(data: &Value) -> bool {
        read_value::<RollbackResult>(data).map_or_else(
            || data.get("verified") == Some(&Value::Bool(true)),
            |r| r.verified,
        )
    }
}

/// How a rollback ended (`production.checked`'s `rolled`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rolled {
    /// No rollback command ran.
    #[default]
    NotRun,
    /// Production was verified back.
    Verified,
    /// The rollback ran and production was not verified back.
    Failed,
}

impl Rolled {
    /// The stored word (`not_run`, `verified`, `failed`).
    pub fn as_str(self) -> &'static str {
        match self {
            Rolled::NotRun => "not_run",
            Rolled::Verified => "verified",
            Rolled::Failed => "failed",
        }
    }
}

/// How production was left after trouble (`production.checked`'s `settled`); a row without
/// one reads as alerted, the conservative reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Settled {
    /// Verified healthy at a known revision (`settled_at`).
    Healthy,
    /// An operator was alerted: production is not known good.
    #[default]
    Alerted,
}

/// `production.checked`: how production was settled after a deploy or a watch went wrong — the
/// conclusion of the shared recovery (its rule: [`crate::recovery`]). Written once per trouble
/// and stage visit; a re-run replays it instead of acting again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProductionChecked {
    /// What went wrong (`crate::recovery::Trouble`: `deploy_failed`, `watch_failed`, …).
    pub trouble: String,
    /// The item's revision, the one that went wrong.
    pub revision: String,
    /// The revision live before it, when known.
    #[serde(default)]
    pub previous: Option<String>,
    /// The revision the service named at the last look.
    #[serde(default)]
    pub live: Option<String>,
    /// The health check's word at the last look.
    #[serde(default)]
    pub health: String,
    /// The last look, in words.
    #[serde(default)]
    pub description: String,
    /// Healthy at a known revision, or an operator alerted.
    #[serde(default)]
    pub settled: Settled,
    /// How the rollback went.
    #[serde(default)]
    pub rolled: Rolled,
    /// The revision production was verified healthy at (with [`Settled::Healthy`]).
    #[serde(default)]
    pub settled_at: Option<String>,
    /// What was tried, in order (the deploy command, the rollback, …).
    #[serde(default)]
    pub tried: Vec<String>,
    /// What a person should do (the alert's advice).
    #[serde(default)]
    pub todo: String,
    /// The visit of the stage.
    #[serde(default)]
    pub seq: Option<i64>,
}

impl ProductionChecked {
    /// The revision that runs now: the verified one, else the one the service named.
    pub fn running(&self) -> Option<&str> {
        self.settled_at.as_deref().or(self.live.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Each writer's typed change stores exactly the text its `json!` stored before, and reads
    /// back as written.
    #[test]
    fn every_stage_change_writes_the_text_of_before_and_reads_back() {
        let by = json!({"via": "cli", "user": "alice", "uid": 1000});
        let engine = StageChange {
            outcome: Some("PASS".into()),
            feedback: Some(None),
            awaiting_approval: Some(false),
            commit: Some(Some("c".repeat(40))),
            attempt: Some(1),
            ..StageChange::new("review", "verification")
        };
        let mut ended = StageChange {
            outcome: Some("NOT_SUCCESS".into()),
            feedback: Some(Some("09-review.md".into())),
            awaiting_approval: Some(false),
            commit: Some(None),
            attempt: Some(2),
            ..StageChange::new("staging", control::FAILED)
        };
        ended.result = ended.outcome.take();
        ended.stage = Some("staging".into());
        ended.reason = Some("loops used up".into());
        ended.outcome = Some("failed".into());
        let review = StageChange {
            outcome: Some("CHANGES_REQUESTED".into()),
            feedback: Some(Some("11-pull-request-review.md".into())),
            review: Some(77),
            pull: Some(5),
            by: Some(by.clone()),
            ..StageChange::new("review", "implementation")
        };
        let cases = [
            (
                engine.clone(),
                json!({"from": "review", "to": "verification", "outcome": "PASS",
                       "feedback": null, "awaiting_approval": false,
                       "commit": "c".repeat(40), "attempt": 1}),
            ),
            (
                ended.clone(),
                json!({"from": "staging", "to": "failed", "outcome": "failed",
                       "feedback": "09-review.md", "awaiting_approval": false, "commit": null,
                       "attempt": 2, "result": "NOT_SUCCESS", "stage": "staging",
                       "reason": "loops used up"}),
            ),
            (
                StageChange::failed("deploy", "job 4 failed for good"),
                json!({"from": "deploy", "to": "failed", "outcome": "failed",
                       "stage": "deploy", "reason": "job 4 failed for good"}),
            ),
            (
                StageChange::retried("deploy", by.clone()),
                json!({"from": "failed", "to": "deploy", control::actor::KEY: by}),
            ),
            (
                StageChange::cancelled("analysis", "cancelled via the CLI", by.clone()),
                json!({"from": "analysis", "to": "cancelled", "outcome": "cancelled",
                       "reason": "cancelled via the CLI", control::actor::KEY: by}),
            ),
            (
                review.clone(),
                json!({"from": "review", "to": "implementation", "outcome": "CHANGES_REQUESTED",
                       "feedback": "11-pull-request-review.md", "review": 77, "pull": 5,
                       control::actor::KEY: by}),
            ),
        ];
        for (change, before) in cases {
            assert_eq!(change.text(), before.to_string());
            assert_eq!(read::<StageChange>(&change.text()), Some(change.clone()));
            assert_eq!(read_value::<StageChange>(&before), Some(change));
        }
        assert_eq!(ended.task_outcome(), Some(Outcome::Failed));
        assert_eq!(engine.task_outcome(), None);
        assert_eq!(ended.failed_stage(), Some("staging"));
    }

    /// Rows already in users' databases, in each shape an older orch wrote, read as before:
    /// what is absent is `None`, a stored `null` is told apart from an absent key.
    #[test]
    fn old_stage_change_rows_read_as_before() {
        let r = |t: &str| read::<StageChange>(t);
        // A bare advance (tests' fixtures, early versions).
        assert_eq!(
            r(r#"{"from":"intake","to":"analysis"}"#),
            Some(StageChange::new("intake", "analysis"))
        );
        // A stranded failure before it carried `from`/`to`.
        let stranded = r(r#"{"outcome":"failed","stage":"staging","reason":"smoke check failed"}"#);
        assert_eq!(
            stranded
                .as_ref()
                .map(|c| (c.from.clone(), c.failed_stage(), c.task_outcome())),
            Some((None, Some("staging"), Some(Outcome::Failed)))
        );
        // An end before the task's outcome was recorded: the gate's value in `outcome`.
        let done = r(r#"{"from":"lessons","to":"done","outcome":"PASS"}"#);
        assert_eq!(done.as_ref().and_then(StageChange::task_outcome), None);
        assert_eq!(done.and_then(|c| c.result), None);
        // An advance with no commit: `null`, unlike a change that read no gate at all.
        let advanced = r(
            r#"{"from":"review","to":"verification","outcome":"PASS","feedback":null,"awaiting_approval":true,"commit":null,"attempt":1}"#,
        );
        assert_eq!(
            advanced
                .as_ref()
                .map(|c| (c.commit.clone(), c.feedback.clone(), c.awaits_approval())),
            Some((Some(None), Some(None), true))
        );
        let cancel = r(
            r#"{"from":"analysis","to":"cancelled","outcome":"cancelled","reason":"x","by":{"via":"api","peer":null,"user_agent":null}}"#,
        );
        assert_eq!(cancel.as_ref().map(|c| c.commit.clone()), Some(None));
        assert_eq!(
            cancel.and_then(|c| c.by).map(|b| b["via"].clone()),
            Some(json!("api"))
        );
        // No data, or not a stage change's: nothing is invented.
        assert_eq!(r(""), None);
        assert_eq!(r("[1]"), None);
        assert_eq!(r("{}"), Some(StageChange::default()));
    }

    #[test]
    fn a_requeue_writes_the_text_of_before_and_an_old_row_reads() {
        let r = StageRequeued {
            delay_ms: Some(30_000),
            marker: Some(control::markers::staging_defer(2)),
            priority: Some(0),
        };
        assert_eq!(
            text(&r),
            json!({"delay_ms": 30_000, "marker": control::markers::staging_defer(2),
                   "priority": 0})
            .to_string()
        );
        assert_eq!(read::<StageRequeued>(&text(&r)), Some(r));
        let old = read_value::<StageRequeued>(&json!({"marker": "m"}));
        assert_eq!(
            old.map(|r| (r.marker, r.delay_ms)),
            Some((Some("m".into()), None))
        );
    }

    #[test]
    fn the_forge_events_write_the_text_of_before_and_read_back() {
        let pull = ForgePull {
            number: 5,
            url: "https://x/5".into(),
            head: "orch/APP-1".into(),
            base: "main".into(),
            opened: true,
        };
        let synced = ForgeSynced {
            through: 40,
            pull: None,
            statuses: vec![SentStatus {
                context: "orch/review".into(),
                state: "success".into(),
            }],
            body: None,
            described: false,
        };
        let noted = ForgeReview {
            review: 7,
            state: "COMMENTED".into(),
            pull: Some(5),
            action: "noted".into(),
            why: Some("x".into()),
            stage: None,
            seq: None,
            by: "bob".into(),
        };
        let approving = ForgeReview {
            action: ForgeReview::APPROVING.into(),
            why: None,
            stage: Some("deploy".into()),
            seq: Some(3),
            ..noted.clone()
        };
        let said = ForgeOutcome {
            outcome: "shipped".into(),
            seq: 9,
            issue: 1,
            pull: Some(5),
            comments: vec![1, 5],
            comment_ids: vec![11, 12],
            closed: true,
        };
        let cases = [
            (
                text(&pull),
                json!({"number": 5, "url": "https://x/5", "head": "orch/APP-1", "base": "main",
                       "opened": true}),
            ),
            (
                text(&synced),
                json!({"through": 40, "pull": null,
                       "statuses": [{"context": "orch/review", "state": "success"}],
                       "body": null, "described": false}),
            ),
            (
                text(&noted),
                json!({"review": 7, "state": "COMMENTED", "pull": 5, "action": "noted",
                       "why": "x", "by": "bob"}),
            ),
            (
                text(&approving),
                json!({"review": 7, "state": "COMMENTED", "pull": 5, "action": "approving",
                       "stage": "deploy", "seq": 3, "by": "bob"}),
            ),
            (
                text(&said),
                json!({"outcome": "shipped", "seq": 9, "issue": 1, "pull": 5,
                       "comments": [1, 5], "comment_ids": [11, 12], "closed": true}),
            ),
        ];
        for (written, before) in cases {
            assert_eq!(written, before.to_string());
        }
        assert_eq!(read::<ForgePull>(&text(&pull)), Some(pull));
        assert_eq!(read::<ForgeSynced>(&text(&synced)), Some(synced));
        assert_eq!(read::<ForgeReview>(&text(&noted)), Some(noted));
        assert_eq!(read::<ForgeReview>(&text(&approving)), Some(approving));
        assert_eq!(read::<ForgeOutcome>(&text(&said)), Some(said));
    }

    #[test]
    fn a_skipped_deploy_says_what_follows_in_its_stored_word() {
        let old = r#"{"revision":"abc","outcome":"confirm","seq":2}"#;
        let d = read::<DeploySkipped>(old);
        assert_eq!(d.as_ref().map(|d| d.outcome), Some(SkipThen::Confirm));
        assert_eq!(
            d.map(|d| text(&d)),
            Some(json!({"revision": "abc", "outcome": "confirm", "seq": 2}).to_string())
        );
        assert_eq!(
            read::<DeploySkipped>(r#"{"revision":"abc","outcome":"pass"}"#).map(|d| d.outcome),
            Some(SkipThen::Pass)
        );
        assert_eq!(
            read::<DeploySkipped>(r#"{"revision":"abc","outcome":"maybe"}"#),
            None
        );
    }

    #[test]
    fn a_takeover_reads_back_and_an_old_row_keeps_what_it_has() {
        let t = NodeTakeover {
            from: Some("a".into()),
            to: Some("b".into()),
            last_seen_ms: None,
            seq: Some(4),
            stage: Some("deploy".into()),
            job: Some(9),
            agent: Some("deployer".into()),
        };
        assert_eq!(
            text(&t),
            json!({"from": "a", "to": "b", "last_seen_ms": null, "seq": 4, "stage": "deploy",
                   "job": 9, "agent": "deployer"})
            .to_string()
        );
        assert_eq!(read::<NodeTakeover>(&text(&t)), Some(t));
        let old = read::<NodeTakeover>(r#"{"from":"a","stage":"observe"}"#);
        assert_eq!(
            old.map(|t| (t.from, t.to, t.stage)),
            Some((Some("a".into()), None, Some("observe".into())))
        );
    }

    #[test]
    fn a_deploy_reads_back_what_was_written() {
        let d = ReleaseDeployed {
            repo: "app".into(),
            revision: "b".repeat(40),
            previous_revision: Some("a".repeat(40)),
            confirmed: true,
            items: vec![
                ShippedChange {
                    work_item: "APP-1".into(),
                    commit: "c".repeat(40),
                    change: Change::Merge,
                },
                ShippedChange {
                    work_item: "APP-2".into(),
                    commit: "d".repeat(40),
                    change: Change::Reverted,
                },
            ],
            staged: None,
            via: None,
            seq: Some(3),
        };
        let text = serde_json::to_string(&d).unwrap_or_default();
        assert!(text.contains(r#""change":"reverted""#), "{text}");
        assert_eq!(read::<ReleaseDeployed>(&text), Some(d));
    }

    #[test]
    fn an_old_row_without_the_later_keys_still_reads() {
        let old = r#"{"repo":"app","revision":"abc","items":[{"work_item":"APP-1"}]}"#;
        let d = read::<ReleaseDeployed>(old);
        assert_eq!(
            d.map(|d| (d.confirmed, d.previous_revision, d.items[0].label())),
            Some((false, None, "APP-1".to_owned()))
        );
        assert_eq!(read::<ReleaseDeployed>(r#"{"repo":"app"}"#), None);
        assert_eq!(read::<ReleaseDeployed>("not json"), None);
    }

    #[test]
    fn a_rollback_and_a_verdict_read_back_in_their_stored_words() {
        let r = RollbackResult {
            revision: "b".repeat(40),
            verified: true,
            attempted: true,
            live: Some("a".repeat(40)),
            seq: Some(2),
        };
        let text = serde_json::to_string(&r).unwrap_or_default();
        assert_eq!(read::<RollbackResult>(&text), Some(r));
        // An old row: `attempted` absent means a rollback ran.
        let old = read::<RollbackResult>(r#"{"revision":"abc","verified":false}"#);
        assert_eq!(old.map(|r| r.attempted), Some(true));
        let v = WatchVerdict {
            verdict: Verdict::Failed,
            action: ActionTaken::RollbackFailed,
            revision: "c".repeat(40),
            log_written: true,
            evidence_lost: None,
            seq: Some(1),
        };
        let value = serde_json::to_value(&v).unwrap_or_default();
        assert_eq!(value["verdict"], "FAILED");
        assert_eq!(value["action"], "rollback_failed");
        assert_eq!(read_value::<WatchVerdict>(&value), Some(v));
        assert_eq!(
            read::<WatchVerdict>(r#"{"verdict":"MAYBE","action":"none"}"#),
            None
        );
    }

    /// A `production.checked` row as the untyped writer stored it reads back typed, and the
    /// typed writer stores the same keys.
    #[test]
    fn production_checked_reads_the_rows_of_before_and_writes_the_same_keys() {
        let before = json!({
            "trouble": "watch_failed", "revision": "r2", "previous": "r1", "live": "r1",
            "health": "PASS", "description": "healthy at r1", "settled": "healthy",
            "rolled": "verified", "settled_at": "r1", "tried": ["rollback.sh: exit 0"],
            "todo": "nothing", "seq": 4,
        });
        let c: ProductionChecked = read_value(&before).unwrap();
        assert_eq!(c.settled, Settled::Healthy);
        assert_eq!(c.rolled, Rolled::Verified);
        assert_eq!(c.running(), Some("r1"));
        assert_eq!(c.tried, vec!["rollback.sh: exit 0".to_owned()]);
        assert_eq!(serde_json::to_value(&c).unwrap(), before);
        // An alert with nothing settled names what the service said; a row missing the later
        // keys reads as alerted and not rolled, the conservative reading.
        let alerted: ProductionChecked =
            read_value(&json!({"trouble": "deploy_failed", "revision": "r2", "live": "r2"}))
                .unwrap();
        assert_eq!(alerted.settled, Settled::Alerted);
        assert_eq!(alerted.rolled, Rolled::NotRun);
        assert_eq!(alerted.running(), Some("r2"));
        assert_eq!(
            read_value::<ProductionChecked>(&json!({"settled": "maybe"})),
            None
        );
    }

    /// The verdict and action of a watch row of any version: typed, the older keys, or only
    /// the message.
    #[test]
    fn a_watch_verdict_reads_from_every_version_of_its_row() {
        let typed = json!({"verdict": "FAILED", "action": "rollback", "revision": "r"});
        assert_eq!(WatchVerdict::verdict_in(&typed, ""), Some(Verdict::Failed));
        assert_eq!(
            WatchVerdict::action_in(&typed, ""),
            Some(ActionTaken::Rollback)
        );
        let older = json!({"post_deploy_status": "DEGRADED", "action": "alert"});
        assert_eq!(
            WatchVerdict::verdict_in(&older, ""),
            Some(Verdict::Degraded)
        );
        assert_eq!(
            WatchVerdict::action_in(&older, ""),
            Some(ActionTaken::Alert)
        );
        let message = "post-deploy watch HEALTHY: 6/6 polls passed (action none)";
        assert_eq!(
            WatchVerdict::verdict_in(&json!({}), message),
            Some(Verdict::Healthy)
        );
        assert_eq!(
            WatchVerdict::action_in(&json!({}), message),
            Some(ActionTaken::None)
        );
        assert_eq!(
            WatchVerdict::verdict_in(&json!({"status": "MAYBE"}), "FAILED"),
            None
        );
        assert_eq!(WatchVerdict::action_in(&json!({}), "no action here"), None);
    }

    /// A rollback row's `attempted` and `verified`, typed or from an older row.
    #[test]
    fn a_rollback_result_reads_attempted_and_verified_from_any_row() {
        let typed = json!({"revision": "r", "verified": true});
        assert!(RollbackResult::attempted_in(&typed));
        assert!(RollbackResult::verified_in(&typed));
        let none_ran = json!({"revision": "r", "attempted": false});
        assert!(!RollbackResult::attempted_in(&none_ran));
        assert!(!RollbackResult::verified_in(&none_ran));
        // Older rows without a revision: the keys that are there still count.
        assert!(!RollbackResult::attempted_in(&json!({"attempted": false})));
        assert!(RollbackResult::verified_in(&json!({"verified": true})));
        assert!(RollbackResult::attempted_in(&json!({})));
        assert!(!RollbackResult::verified_in(&json!({})));
    }

    /// `deploy.confirmed`, `release.reverted` and `release.unheld` as their untyped writers
    /// stored them read back typed, and the typed writers store the same keys.
    #[test]
    fn deploy_confirmed_and_release_reverted_read_the_rows_of_before() {
        let confirmed = json!({"revision": "r2", "armed": true, "seq": 7});
        let c: DeployConfirmed = read_value(&confirmed).unwrap();
        assert!(c.armed);
        assert_eq!(c.revision, "r2");
        assert_eq!(serde_json::to_value(&c).unwrap(), confirmed);
        let unarmed: DeployConfirmed = read_value(&json!({"revision": "r3"})).unwrap();
        assert!(!unarmed.armed, "a row without `armed` armed nothing");
        assert_eq!(read_value::<DeployConfirmed>(&json!({"armed": true})), None);

        let reverted = json!({"repo": "svc", "work_item": "APP-2", "revert_commit": "c3",
                              "reverted_from": "c1", "reverted_to": "c2"});
        let r: ReleaseReverted = read_value(&reverted).unwrap();
        assert_eq!(
            (r.work_item.as_str(), r.revert_commit.as_str()),
            ("APP-2", "c3")
        );
        assert_eq!(serde_json::to_value(&r).unwrap(), reverted);
        let older: ReleaseReverted = read_value(&json!({"revert_commit": "c3"})).unwrap();
        assert_eq!(older.repo, "");

        let unheld = json!({"repo": "svc", "by": {"via": "cli", "user": "alice", "uid": 1000},
                            "live": "r1", "healthy": true});
        let u: ReleaseUnheld = read_value(&unheld).unwrap();
        assert_eq!((u.live.as_deref(), u.healthy), (Some("r1"), Some(true)));
        assert_eq!(serde_json::to_value(&u).unwrap(), unheld);
        let unseen: ReleaseUnheld =
            read_value(&json!({"repo": "svc", "by": null, "live": null, "healthy": null})).unwrap();
        assert_eq!(unseen.live, None);
    }
}
