//! The integration tests of `crates/runner`, one binary with a module per suite (one link
//! of the whole stack instead of one per file). Run one suite with
//! `cargo test -p orch-runner --test it <suite>::`.

mod agent_clis;
mod agents;
mod approve;
mod artifact_snapshots;
mod common;
mod deploy;
mod ended;
mod lessons;
mod monitor;
mod probe;
mod publish;
mod release_tracks;
mod retention;
mod stages_merge;
mod stages_staging;
mod stages_tester;
mod staging_inputs;
mod supervised_pass;
mod toy_stage;
mod watch_ticks;
mod worker;
mod support {
    pub mod agent_cli;
}
