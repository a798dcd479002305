//! Control words that more than one crate writes or reads: the terminal stages and the formats
//! of the jobs' dedupe keys. Defined once here; the store, the engine and the operator commands
//! use these instead of spelling the strings again.

/// The stage a task reaches when it went through the whole pipeline.
pub const DONE: &str = "done";
/// The stage a task reaches when it could not be completed.
pub const FAILED: &str = "failed";
/// The stage a task reaches when a person cancelled it.
pub const CANCELLED: &str = "cancelled";

/// The stages that end a task (design.md §1): no job runs for a task in one of them.
pub const TERMINAL_STAGES: [&str; 3] = [DONE, FAILED, CANCELLED];

/// True when `stage` ends a task.
pub fn is_terminal_stage(stage: &str) -> bool {
    TERMINAL_STAGES.contains(&stage)
}

/// Dedupe keys: a key is unique forever in `jobs`, so enqueueing under the same key twice (a
/// retry after a crash between two steps) finds the first job instead of adding a second.
pub mod dedupe {
    /// The key of the job that starts visit `stage_seq` of task `task_id`'s current stage
    /// (`stage:<task>:<seq>`): the store gives it to a next job that has none.
    pub fn stage_job(task_id: i64, stage_seq: i64) -> String {
        format!("stage:{task_id}:{stage_seq}")
    }

    /// The key of the follow-up job a requeue of job `job_id` enqueues
    /// (`requeue-of:<job>`): one follow-up per job, however often the requeue is retried.
    pub fn requeue_of(job_id: i64) -> String {
        format!("requeue-of:{job_id}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_stages_and_key_formats() {
        assert!(TERMINAL_STAGES.iter().all(|s| is_terminal_stage(s)));
        assert!(!is_terminal_stage("review"));
        assert!(!is_terminal_stage("Done"), "stages are exact words");
        assert_eq!(dedupe::stage_job(7, 3), "stage:7:3");
        assert_eq!(dedupe::requeue_of(42), "requeue-of:42");
    }
}
