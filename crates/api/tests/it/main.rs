//! The integration tests of `crates/api`, one binary with a module per suite (one link
//! of the whole stack instead of one per file). Run one suite with
//! `cargo test -p orch-api --test it <suite>::`.

mod contract;
mod db_down;
mod http;
mod openapi;
mod report;
