//! Self-deploy markers (design.md §6): when the repo being deployed is orch itself, the deploy
//! restarts the running process, so the deployer leaves markers in
//! `<dir>/.deploy-state-<repo>/<work_item_id>/` — `INITIATED` before the restart, `result`
//! after it — and the deploy finalizer picks up from them. The helpers never raise
//! (`has_marker`, `write_marker`, `read_result`, `clear_state`): they return a fallback and
//! log what happened (the pattern the post-deploy watch's sentinels copy, design.md §7).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::fsx::{self, Read};

/// The prefix of a repo's self-deploy state directory inside its base directory.
pub const DEPLOY_STATE_DIR_PREFIX: &str = ".deploy-state-";
/// Marker: the self-deploy was initiated (written before the process restarts).
pub const MARKER_INITIATED: &str = "INITIATED";
/// The result file (JSON [`DeployResult`]).
pub const RESULT_FILE: &str = "result";

/// The outcome of a self-deploy, written by the restarted process for the finalizer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeployResult {
    /// Whether the deploy command succeeded.
    pub success: bool,
    /// The revision now deployed, when known.
    #[serde(default)]
    pub revision: Option<String>,
    /// When the result was recorded (epoch ms).
    pub finished_at_ms: i64,
    /// A short human note (command output tail, error).
    #[serde(default)]
    pub detail: String,
}

/// The self-deploy markers of one work item. Construction never fails: a refused repo or id
/// makes every operation return its fallback.
#[derive(Debug, Clone)]
pub struct DeployState {
    dir: Result<PathBuf, String>,
}

impl DeployState {
    /// The markers of `work_item_id` in `<dir>/.deploy-state-<repo>/<work_item_id>/`.
    pub fn new(dir: &Path, repo: &str, work_item_id: &str) -> DeployState {
        let dir = fsx::component("repo", repo)
            .and_then(|repo| Ok((repo, fsx::component("work item id", work_item_id)?)))
            .map(|(repo, id)| {
                dir.join(format!("{DEPLOY_STATE_DIR_PREFIX}{repo}"))
                    .join(id)
            })
            .map_err(|e| {
                tracing::warn!(error = %e, "self-deploy state: refused path");
                e.to_string()
            });
        DeployState { dir }
    }

    /// The state directory, unless the path was refused.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref().ok()
    }

    fn marker_path(&self, name: &str) -> Option<PathBuf> {
        let dir = self.dir.as_ref().ok()?;
        match fsx::component("marker name", name) {
            Ok(name) => Some(dir.join(name)),
            Err(e) => {
                tracing::warn!(error = %e, "self-deploy state: refused marker");
                None
            }
        }
    }

    /// Whether marker `name` exists. `false` when it cannot be told (logged).
    pub fn has_marker(&self, name: &str) -> bool {
        let Some(path) = self.marker_path(name) else {
            return false;
        };
        match fs::symlink_metadata(&path) {
            Ok(_) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "self-deploy state: cannot check marker");
                false
            }
        }
    }

    /// Writes marker `name` with `content` atomically. Returns whether it is on disk.
    pub fn write_marker(&self, name: &str, content: &str) -> bool {
        let Some(path) = self.marker_path(name) else {
            return false;
        };
        match fsx::write_atomic(&path, content.as_bytes()) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "self-deploy state: cannot write marker");
                false
            }
        }
    }

    /// Writes the `result` file atomically. Returns whether it is on disk.
    pub fn write_result(&self, result: &DeployResult) -> bool {
        let Some(path) = self.marker_path(RESULT_FILE) else {
            return false;
        };
        match fsx::write_json(&path, result) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "self-deploy state: cannot write result");
                false
            }
        }
    }

    /// Reads the `result` file. `None` when absent, or when unusable (corrupt, truncated,
    /// unreadable — logged): the finalizer then treats the outcome as unknown and confirms by
    /// health checks instead.
    pub fn read_result(&self) -> Option<DeployResult> {
        let path = self.marker_path(RESULT_FILE)?;
        match fsx::read_json::<DeployResult>(&path) {
            Read::Found(result) => Some(result),
            Read::Absent => None,
            Read::Unusable(e) => {
                tracing::warn!(error = %e, "self-deploy state: result unusable");
                None
            }
        }
    }

    /// Removes the work item's markers. Absent counts as removed. Returns whether they are gone.
    pub fn clear_state(&self) -> bool {
        let Ok(dir) = &self.dir else { return false };
        match fsx::remove_tree(dir) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "self-deploy state: cannot clear");
                false
            }
        }
    }
}
