//! orch's runtime: the worker loop, the pipeline engine and its stage executors (agents and
//! deterministic runners), maintenance passes and the operator operations.

pub mod agents;
pub mod builtin;
pub mod catalogue;
pub mod contain;
pub mod counters;
pub mod deploy;
pub mod ended;
pub mod engine;
pub mod failpoint;
pub mod forge;
pub mod forge_sync;
pub mod fsutil;
pub mod histogram;
pub mod live_config;
pub mod maintenance;
pub mod notify;
pub mod ops;
mod pacing;
pub mod release;
pub mod repos;
pub mod stages;
pub mod time;
pub mod worker;
