//! Small file helpers shared by the runner.

use std::path::Path;

use anyhow::{Context as _, Result};

/// Writes `content` to `path` atomically: a crash leaves the old file or the new one, never
/// half of one; concurrent writers never share a temp file
/// ([`orch_deploystate::write_file_atomic`], the one writer).
pub fn write_atomic_io(path: &Path, content: &str) -> std::io::Result<()> {
    orch_deploystate::write_file_atomic(path, content.as_bytes())
}

/// [`write_atomic_io`] with the path in the error.
pub fn write_atomic(path: &Path, content: &str) -> Result<()> {
    write_atomic_io(path, content).with_context(|| format!("cannot write {}", path.display()))
}
