//! The pipeline engine: one job handler for every stage job. It loads the task, ignores stale
//! jobs (the task has moved on), prepares the work item's worktree, runs the stage's
//! executor, commits its artifacts on the work item's branch, reads them back through the
//! stage's gate, decides the next stage and changes it with the fenced `advance_stage`.
//!
//! The engine knows no particular stage: what it does around one (pin its jobs to a node,
//! guard its commits, serialize the release track, which executor runs it) it reads from the
//! stage's descriptor ([`orch_domain::pipeline::StageDef`]); what depends on the runner (the
//! first job's delay, local state to end when a task fails) it asks the stage's
//! [`StageExecutor`]. The runtime hands it the executors ([`Executors`], [`Engine::install`]).
//! Nothing here names the deploy tail's or the release train's modules (tidy rule
//! `engine-layering`): they plug in through those two.

pub mod artifacts;
pub mod executor;
mod guard;
mod handler;

pub use executor::{
    Executors, StageEffect, StageExecutor, StageRun, StageStart, WorktreePrep, YIELD_PRIORITY,
};
pub use handler::{
    Engine, EngineConfig, STAGE_ATTEMPTS, TRACK_WAIT_S, first_job, job_kind, release_track,
};

/// The payload of a stage job: which stage visit it belongs to. Markers (defers, ticks) are
/// appended after the first line, so counting them is a substring count (seed ORCH-115 D-2).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageJob {
    pub stage: String,
    /// The task's `stage_seq` when the job was enqueued: a job from an earlier visit is stale.
    pub seq: i64,
}

impl StageJob {
    pub fn to_content(&self) -> String {
        serde_json::to_string(self)
            .unwrap_or_else(|_| format!("{{\"stage\":\"{}\",\"seq\":{}}}", self.stage, self.seq))
    }

    /// Parses the first line of a job's content.
    pub fn from_content(content: &str) -> Result<StageJob, String> {
        let first = content.lines().next().unwrap_or_default();
        serde_json::from_str(first).map_err(|e| {
            let shown: String = first.chars().take(80).collect();
            format!("not a stage job payload ({e}): {shown:?}")
        })
    }

    /// The content of a follow-up job of the same visit carrying `marker`.
    pub fn with_marker(&self, marker: &str) -> String {
        format!("{}\n{}", self.to_content(), marker.replace('\n', " "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_job_round_trips_and_ignores_markers() {
        let j = StageJob {
            stage: "staging".into(),
            seq: 7,
        };
        let c = j.with_marker("[orch:staging-tool-error-defer seq=7]");
        assert_eq!(StageJob::from_content(&c), Ok(j.clone()));
        assert_eq!(StageJob::from_content(&j.to_content()), Ok(j));
        assert!(StageJob::from_content("garbage").is_err());
        assert!(StageJob::from_content("").is_err());
    }
}
