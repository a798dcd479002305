//! The integration tests of `crates/deploystate`, one binary with a module per suite (one link
//! of the whole stack instead of one per file). Run one suite with
//! `cargo test -p orch-deploystate --test it <suite>::`.

mod selfdeploy;
mod watch;
