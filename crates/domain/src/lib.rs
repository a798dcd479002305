//! The pure core of orch: validated names, artifacts and their frontmatter, gates, the
//! pipeline as data with its decision function, and the `orch.toml` configuration model.
//!
//! Invariant: nothing in this crate does I/O, reads a clock or spawns a process. Time, file
//! contents and environment variables are passed in by the caller, so every function here is
//! deterministic and testable without setup.

pub mod artifact;
pub mod config;
pub mod gate;
pub mod ids;
pub mod pipeline;
