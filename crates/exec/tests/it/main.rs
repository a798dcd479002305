//! The integration tests of `crates/exec`, one binary with a module per suite (one link
//! of the whole stack instead of one per file). Run one suite with
//! `cargo test -p orch-exec --test it <suite>::`.

mod git;
mod git_locks;
mod process;
mod sandbox;
mod supervise;
