//! orch's runtime: the worker loop that runs queued jobs, maintenance, and (as they land) the
//! pipeline engine, the deterministic runners and the agent backends.

pub mod builtin;
pub mod failpoint;
pub mod maintenance;
pub mod worker;
