//! Sentinel-file state of orch's deploy tail, kept on disk instead of in tables so the deploy
//! tail adds no schema (seeds ORCH-021 §1/§3, ORCH-115 D-2; design.md §2 NFR-1/AC-12):
//!
//! - [`WatchState`]: the post-deploy watch, `<repos_dir>/.post-deploy-state-<repo>/<id>/`
//!   with `armed`, `series` and `done` (design.md §7), and [`list_active`] for `GET /queue` and the
//!   recovery sweep;
//! - [`DeployState`]: the self-deploy markers, `<dir>/.deploy-state-<repo>/<id>/` with
//!   `INITIATED` and `result` (design.md §6).
//!
//! Invariants:
//! - **Never raise.** Every public function returns a conservative fallback (`false`,
//!   `None`, `Absent`/`Corrupt`, an empty series with `lost` set) and logs what happened with
//!   `tracing::warn!`. A missing or broken file never becomes evidence of health.
//! - **Atomic writes.** A file is replaced by temp file + fsync + rename + directory fsync, so
//!   a kill -9 at any instant leaves the old or the new content, never a mix.
//! - **Confined paths.** `repo`, `work_item_id` and marker names must be single path
//!   components: anything empty, `.`, or containing `/`, `\`, `..` or NUL is refused (callers
//!   validate ids already; this is the second line of defence against `../../x`).
//! - **Writers.** The read-modify-write of `series` (and arming) holds an OS advisory lock on
//!   the state directory's `.lock`, so concurrent appenders in any thread or process lose
//!   nothing. Where the file system cannot lock, a warning is logged and the job queue's
//!   one-tick-at-a-time scheduling is relied on (single writer).
//! - This crate only stores; the decisions are `orch_domain::monitor`'s.

mod fsx;
mod selfdeploy;
mod watch;

/// Writes `bytes` to `path` so that a reader sees the old file or the whole new one, also
/// after a crash (unique temp file in the same directory, fsync, rename, directory fsync;
/// creates the directory): orch's one atomic file writer. The error names the operation and
/// the path, and keeps the I/O error's kind.
pub fn write_file_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    fsx::write_atomic(path, bytes).map_err(|e| {
        let kind = match &e {
            fsx::StateError::Io { source, .. } => source.kind(),
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, e.to_string())
    })
}

pub use selfdeploy::{
    DEPLOY_STATE_DIR_PREFIX, DeployResult, DeployState, MARKER_INITIATED, RESULT_FILE,
};
pub use watch::{
    ARMED_FILE, ActiveWatch, ArmOutcome, ArmedRead, ArmedRecord, CORRUPT_SERIES_FILE, DONE_FILE,
    LOST_FILE, SERIES_FILE, STATE_DIR_PREFIX, SeriesRead, WatchState, list_active,
};
