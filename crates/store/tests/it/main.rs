//! The integration tests of `crates/store`, one binary with a module per suite (one link
//! of the whole stack instead of one per file). Run one suite with
//! `cargo test -p orch-store --test it <suite>::`.

mod conformance;
mod report;
mod schema;
