//! The deterministic stage executors: `intake` (the request as `01-request.md`) and those of
//! the pipeline's tail: the tester (`verification`), the merge gate (`merge`) and the staging
//! runner (`staging`, seed ORCH-115). Each one does its
//! stage's work in the work item's worktree through `orch_exec`, writes its artifact into
//! `run.artifact_dir` and reports a [`crate::engine::StageEffect`]; the engine commits the
//! artifact on the work item's branch, gates it and changes the stage.
//!
//! Invariants: no executor writes `tasks.stage` (only the engine's fenced `advance_stage`
//! does); restart-safe counts (staging defers, merge infra retries) are counted from the jobs
//! queue, never kept in a column (seed ORCH-115 D-2); counters are in-process only (D-4).

pub mod intake;
pub mod merge_gate;
pub mod staging;
pub mod tester;

pub use intake::IntakeExecutor;
pub use merge_gate::MergeGateExecutor;
pub use staging::StagingExecutor;
pub use tester::TesterExecutor;
