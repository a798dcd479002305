//! What a stage may leave in its work item's artifact folder before the engine commits it.
//! An artifact is a regular file of at most [`MAX_ARTIFACT_BYTES`]: a symlink (which the branch
//! would store as a link to anything, e.g. a file outside the repo) or an oversized file is
//! refused with a clear reason and put back as the branch has it (removed when the branch has
//! none), so a rejected artifact is never committed nor pushed. Nothing here follows a link.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use orch_domain::ids::ArtifactName;
use orch_domain::pipeline::StageDef;
use orch_exec::git::Git;

/// An artifact bigger than this is refused (and never read).
pub const MAX_ARTIFACT_BYTES: u64 = 1024 * 1024;

/// One refused entry of the artifact folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The file name inside the artifact folder.
    pub name: String,
    /// Why, in words for the operator.
    pub reason: String,
}

/// Why `path` is not an acceptable artifact file, without following a link; `None` when it is
/// a regular file within the size limit.
pub fn refusal(path: &Path) -> Option<String> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) => return Some(format!("{name}: cannot be inspected: {e}")),
    };
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(path)
            .map(|t| t.display().to_string())
            .unwrap_or_else(|_| "?".into());
        return Some(format!(
            "{name} is a symbolic link (to {target}), not a file; artifacts must be regular files"
        ));
    }
    if !meta.is_file() {
        return None; // a directory is not an artifact; the gate decides what is missing
    }
    if meta.len() > MAX_ARTIFACT_BYTES {
        return Some(format!(
            "{name} is too big: {} bytes, limit {MAX_ARTIFACT_BYTES}",
            meta.len()
        ));
    }
    None
}

/// Refuses every symlink and oversized file at the top of `artifact_dir` (inside the worktree
/// `worktree`) and resets each one to the branch's committed state. Call before committing.
pub async fn refuse_unsafe(
    git: &Git,
    worktree: &Path,
    artifact_dir: &Path,
) -> Result<Vec<Refused>> {
    let Ok(entries) = std::fs::read_dir(artifact_dir) else {
        return Ok(Vec::new());
    };
    let mut refused = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if let Some(reason) = refusal(&path) {
            reset_to_branch(git, worktree, &path).await?;
            refused.push(Refused {
                name: entry.file_name().to_string_lossy().into_owned(),
                reason,
            });
        }
    }
    refused.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(refused)
}

/// Removes `path` (the link itself, never its target) and restores the committed version of
/// it when `HEAD` has one.
async fn reset_to_branch(git: &Git, worktree: &Path, path: &Path) -> Result<()> {
    std::fs::remove_file(path).with_context(|| format!("cannot remove {}", path.display()))?;
    let rel: PathBuf = path
        .strip_prefix(worktree)
        .with_context(|| format!("{} is not inside {}", path.display(), worktree.display()))?
        .to_owned();
    git.restore_from_head(worktree, &rel)
        .await
        .with_context(|| format!("cannot restore {} from the branch", rel.display()))?;
    Ok(())
}

/// Reads an artifact of at most [`MAX_ARTIFACT_BYTES`] without following a link; `None` when
/// missing, not a regular file, too big or not UTF-8.
pub fn read_bounded(path: &Path) -> Option<String> {
    if let Some(reason) = refusal(path) {
        tracing::warn!(path = %path.display(), %reason, "artifact not read");
        return None;
    }
    let mut text = String::new();
    crate::fsutil::open_regular(path)
        .ok()?
        .take(MAX_ARTIFACT_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// The artifacts of `stage` present in `dir` (exact names and families like `07-adr-*`).
pub fn read_stage_artifacts(dir: &Path, stage: &StageDef) -> Vec<(ArtifactName, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(artifact) = name.parse::<ArtifactName>() else {
            continue;
        };
        if !stage
            .artifacts
            .iter()
            .any(|spec| spec.name.matches(&artifact))
        {
            continue;
        }
        if let Some(content) = read_bounded(&entry.path()) {
            out.push((artifact, content));
        }
    }
    out.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_file_and_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("02-requirements.md");
        std::fs::write(&ok, "x").unwrap();
        assert_eq!(refusal(&ok), None);
        let big = dir.path().join("10-implementation.md");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(MAX_ARTIFACT_BYTES + 1).unwrap();
        assert_eq!(
            refusal(&big).unwrap(),
            format!(
                "10-implementation.md is too big: {} bytes, limit {MAX_ARTIFACT_BYTES}",
                MAX_ARTIFACT_BYTES + 1
            )
        );
        let link = dir.path().join("11-review.md");
        std::os::unix::fs::symlink(&ok, &link).unwrap();
        assert!(refusal(&link).unwrap().contains("symbolic link"));
        assert_eq!(read_bounded(&link), None, "a link is never followed");
        assert_eq!(read_bounded(&big), None);
        assert_eq!(read_bounded(&ok).as_deref(), Some("x"));
    }
}
