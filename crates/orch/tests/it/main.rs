//! The integration tests of `crates/orch`, one binary with a module per suite (one link
//! of the whole stack instead of one per file). Run one suite with
//! `cargo test -p orch --test it <suite>::`.

mod agent_clis;
mod agent_resume;
mod bad_agents;
mod bounded_input;
mod campaign;
mod children;
mod cli;
mod common;
mod config_reload;
mod conventions;
mod crash;
mod dashboard;
mod demo_cleanup;
mod doctor_agents;
mod failure_matrix;
mod forge;
mod forge_release;
mod gc_crash;
mod hostile;
mod hostile_artifacts;
mod merge_serial;
mod netns;
mod operators;
mod pipeline;
mod pipeline_openai;
mod release_train;
mod replay;
mod report;
mod self_deploy;
mod signals;
mod staging_restart;
mod takeover;
mod transcripts;
mod walkthrough;
mod watch_crash;
