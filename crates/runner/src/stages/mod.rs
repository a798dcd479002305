//! The deterministic stage executors of the pipeline's tail: the tester (`verification`), the
//! merge gate (`merge`) and the staging runner (`staging`, seed ORCH-115). Each one does its
//! stage's work in the work item's worktree through `orch_exec`, writes its artifact into
//! `run.artifact_dir` and reports a [`crate::engine::StageEffect`]; the engine commits the
//! artifact on the work item's branch, gates it and changes the stage.
//!
//! Invariants: no executor writes `tasks.stage` (only the engine's fenced `advance_stage`
//! does); restart-safe counts (staging defers, merge infra retries) are counted from the jobs
//! queue, never kept in a column (seed ORCH-115 D-2); counters are in-process only (D-4).

pub mod merge_gate;
pub mod staging;
pub mod tester;

use std::path::Path;

use anyhow::Context as _;

pub use merge_gate::MergeGateExecutor;
pub use staging::StagingExecutor;
pub use tester::TesterExecutor;

/// Writes an artifact atomically: the text goes to a temporary file next to `path`, which is
/// then renamed over it, so a crash never leaves a half-written artifact for a gate to read.
/// Creates the artifact directory when needed.
pub(crate) fn write_artifact(path: &Path, content: &str) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .with_context(|| format!("artifact path {} has no directory", path.display()))?;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the artifact directory {}", dir.display()))?;
    let name = path
        .file_name()
        .with_context(|| format!("artifact path {} has no file name", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    std::fs::write(&tmp, content)
        .with_context(|| format!("cannot write the artifact {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| {
        format!(
            "cannot move the artifact {} into place as {}",
            tmp.display(),
            path.display()
        )
    })
}
