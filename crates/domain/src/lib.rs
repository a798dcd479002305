//! The pure core of orch: validated names, artifacts and their frontmatter, gates, the
//! pipeline as data with its decision function, and the `orch.toml` configuration model.
//!
//! Invariant: nothing in this crate does I/O, reads a clock or spawns a process. Time, file
//! contents and environment variables are passed in by the caller, so every function here is
//! deterministic and testable without setup.
//!
//! Map:
//! - [`ids`]: validated names (`WorkItemId`, `RepoName`, `ArtifactName`, ...). Hostile input is
//!   rejected here, once.
//! - [`artifact`]: `NN-name.md` files: frontmatter (ordered, duplicate keys rejected) + body.
//! - [`gate`]: conservative checks of artifacts; only an exact, valid status is a pass.
//! - [`pipeline`]: the stages as data and `decide`, the only place that picks a next stage.
//! - [`config`]: the `orch.toml` model, `ORCH_*` overrides and the `orch init` template.
//! - [`staging`]: the staging runner's classification, defer rules and `15-staging-log.md` (ORCH-115).
//! - [`monitor`]: the post-deploy watch's decision rules and `16-post-deploy-log.md` (ORCH-021).
//! - [`net`]: `host:port` endpoints of the sandbox's network allowlists.
//! - [`outcome`]: how a finished task ended, derived from the recorded facts (shipped, rolled
//!   back, reverted, accepted by an operator, failed, cancelled).
//! - [`notice`]: the versioned notification document (webhook body, the alert command's
//!   stdin) and its Slack form.
//! - [`recovery`]: what orch does about production after anything went wrong in deploy or
//!   observe: settle it healthy at a known revision (rolling back when that is the remedy) or
//!   alert.
//! - [`protect`]: what a stage's commit may touch (protected paths, links, special files,
//!   hostile names, the changed-files limit), checked before anything is committed.
//! - [`transcript`]: an agent run's stored transcript read as a conversation (messages, tool
//!   calls and results, commands and exit codes), per CLI format.
//! - [`replay`]: every decision of a work item re-derived from its recorded inputs (artifacts,
//!   staging log, the watch's series) with today's rules, optionally changed thresholds.
//! - [`forge`]: `[repos.<name>.forge]`, issues as work items' requests (bounded, stored as
//!   data), pagination and the pause a forge's answer calls for (issue 31).
//! - [`payload`]: the data of the events more than one crate reads, as types (serde both
//!   ways): `release.deployed`, `release.rolled_back`, rollback results, `post_deploy.verdict`.
//! - [`control`]: the control words stored in the database, spelled once: terminal stages,
//!   event kinds, job markers and dedupe keys (with their parsers).
#![warn(missing_docs)]

pub mod artifact;
pub mod config;
pub mod control;
pub mod forge;
pub mod gate;
pub mod ids;
pub mod monitor;
pub mod net;
pub mod notice;
pub mod outcome;
pub mod payload;
pub mod pipeline;
pub mod protect;
pub mod recovery;
pub mod replay;
pub mod report;
pub mod staging;
pub mod text;
pub mod transcript;

/// The largest request orch accepts from outside: an HTTP request body (the API answers 413
/// past it) and a work item's body read by `orch submit` (refused past it, never read whole).
/// One limit for both, so what the CLI accepts the API accepts too.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Property tests run from a fixed seed so that every run checks the same cases and a failure
/// replays exactly; nothing is written next to the sources.
#[cfg(test)]
pub(crate) fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        cases,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x00c4_2026),
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    }
}
