//! Small file helpers shared by the runner.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context as _, Result};

/// Writes `content` to `path` via a unique temp file in the same directory, fsync and rename:
/// a crash leaves the old file or the new one, never half of one; concurrent writers never
/// share a temp file.
pub fn write_atomic_io(path: &Path, content: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".orch-write-")
        .tempfile_in(dir)?;
    tmp.write_all(content.as_bytes())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// [`write_atomic_io`] with the path in the error.
pub fn write_atomic(path: &Path, content: &str) -> Result<()> {
    write_atomic_io(path, content).with_context(|| format!("cannot write {}", path.display()))
}
