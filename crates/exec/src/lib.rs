//! orch-exec: the only place in orch that spawns processes.
//!
//! - [`process`]: run one child in its own process group with a timeout, an early stop, bounded
//!   capture of its output and a guaranteed kill-and-reap of the whole group.
//! - [`git`]: the git operations orch needs, each a run of the `git` binary through [`process`].
//! - [`records`]: durable records of the groups orch started, and the startup cleanup that
//!   stops what a dead incarnation of orch left running.
//! - [`sandbox`]: the bubblewrap sandbox untrusted children run in (agents, the repository's
//!   tests), with a network allowlist enforced outside it and resource limits.
//! - [`supervise`]: the supervisor a stage's long commands run under, so they outlive orch and
//!   a restarted orch adopts them instead of running them again.
//! - [`env`]: the allowlist of orch's environment a child inherits.
//!
//! Invariants: nothing else in orch creates processes; no run leaves a process of its group
//! running or unreaped (orch makes itself a child subreaper on Linux so orphaned grandchildren
//! come back to it); no captured output grows past its limit. Error messages are complete on
//! their own (command, directory, cause); the cause is also kept as `source()`.

mod group;
mod spool;
mod tail;

pub mod env;
pub mod git;
pub mod process;
pub mod records;
pub mod sandbox;
pub mod supervise;

pub use git::{
    CommitOrigin, Git, GitError, Identity, MergeResult, MergeStrategy, Pathspec, RevertResult,
    StatusEntry, WorktreeAdd,
};
pub use group::{processes_under, stop_processes_under};
pub use process::{Cmd, ExitKind, Output, OutputSink, SpawnError, run};
pub use sandbox::{Endpoint, Limits, Network, Sandbox};
