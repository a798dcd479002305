//! The data of the events that more than one crate reads, as types: the writer serializes one
//! and every reader deserializes the same one, so each key is spelled once and a reader cannot
//! ask for a key the writer never wrote. Old rows stay readable: a key added later has a
//! default.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::monitor::{ActionTaken, Verdict};

/// Reads an event's data (JSON text) as `T`; `None` when it is not that shape (a row of
/// another kind, or corrupt): the reader skips it, never invents one.
pub fn read<T: DeserializeOwned>(data: &str) -> Option<T> {
    serde_json::from_str(data).ok()
}

/// Reads an event's data already parsed as JSON as `T` (see [`read`]).
pub fn read_value<T: DeserializeOwned>(data: &serde_json::Value) -> Option<T> {
    T::deserialize(data).ok()
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

/// `release.rolled_back`: production went back from `revision` to `live`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRolledBack {
    /// The repo rolled back.
    pub repo: String,
    /// The revision rolled back.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
