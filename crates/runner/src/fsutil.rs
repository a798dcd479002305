//! Small file helpers shared by the runner, and the two rules for touching a work item's
//! worktree, whose content an agent (or the repository's own code) controls: orch writes
//! there only through real directories ([`write_in_worktree`]: a folder replaced by a symbolic
//! link never sends a document outside the repo), and reads there only regular files, never
//! through a link at the last step nor blocking on a FIFO ([`open_regular`]).

use std::fs::File;
use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Component, Path, PathBuf};

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

/// Why the directories from `root` down to `rel` (a relative path, `rel` itself included)
/// cannot be trusted: the first one that is a symbolic link or not a directory, in words.
/// Missing directories are fine (nothing is there to follow). Nothing is followed.
pub fn unsafe_dirs(root: &Path, rel: &Path) -> Option<String> {
    let mut at = root.to_path_buf();
    let mut shown = PathBuf::new();
    for part in rel.components() {
        let Component::Normal(name) = part else {
            return Some(format!("`{}` is not a plain relative path", rel.display()));
        };
        at.push(name);
        shown.push(name);
        match std::fs::symlink_metadata(&at) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => return Some(format!("`{}` cannot be inspected: {e}", shown.display())),
            Ok(m) if m.file_type().is_symlink() => {
                let target = std::fs::read_link(&at)
                    .map(|t| t.display().to_string())
                    .unwrap_or_else(|_| "?".into());
                return Some(format!(
                    "`{}` is a symbolic link (to {target}), not a directory",
                    shown.display()
                ));
            }
            Ok(m) if !m.is_dir() => {
                return Some(format!("`{}` is not a directory", shown.display()));
            }
            Ok(_) => {}
        }
    }
    None
}

/// Writes `content` to `root/rel` atomically, through real directories only: each folder on
/// the way below `root` is checked (never followed when it is a link) and created when
/// missing, and the file itself replaces whatever is at its name (a link there is replaced,
/// not followed).
pub fn write_in_worktree(root: &Path, rel: &Path, content: &str) -> Result<()> {
    let refuse = |why: String| anyhow::anyhow!("refusing to write `{}`: {why}", rel.display());
    // The root is orch's own (a worktree's path under `repos_dir`): made when missing.
    std::fs::create_dir_all(root).with_context(|| format!("cannot create {}", root.display()))?;
    let parent = rel.parent().unwrap_or_else(|| Path::new(""));
    let mut at = root.to_path_buf();
    for part in parent.components() {
        let Component::Normal(name) = part else {
            return Err(refuse("not a plain relative path".into()));
        };
        at.push(name);
        // Each folder is looked at before anything is made below it, so a link on the way
        // is found before it could be followed.
        let shown = at.strip_prefix(root).unwrap_or(&at).display().to_string();
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(refuse(format!(
                    "`{shown}` is a symbolic link, not a directory"
                )));
            }
            Ok(_) => return Err(refuse(format!("`{shown}` is not a directory"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir(&at)
                .with_context(|| format!("cannot create {}", at.display()))?,
            Err(e) => return Err(refuse(format!("`{shown}` cannot be inspected: {e}"))),
        }
    }
    write_atomic(&root.join(rel), content)
}

/// Opens `path` for reading only when it is a regular file: a symbolic link at its name is
/// refused (`O_NOFOLLOW`), a FIFO does not block the open (`O_NONBLOCK`) and is refused, as
/// is anything else that is not a regular file.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(file)
}

/// The most [`read_regular`] reads: the files it reads are written by agents and the
/// repository's code, and a sparse file of any size costs them nothing.
pub const MAX_READ: u64 = 32 << 20;

/// The text of the regular file at `path` ([`open_regular`]), lossy UTF-8; `Ok(None)` when
/// there is none; an error when it is larger than [`MAX_READ`].
pub fn read_regular(path: &Path) -> std::io::Result<Option<String>> {
    let file = match open_regular(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    file.take(MAX_READ + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_READ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is larger than {} MiB", path.display(), MAX_READ >> 20),
        ));
    }
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

/// A regular file (not a link) below `dir`, at most `depth` folders down, whose name matches.
pub fn find_file(dir: &Path, matches: &dyn Fn(&str) -> bool, depth: usize) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten().take(10_000) {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if kind.is_file() && matches(&name) {
            return Some(entry.path());
        }
        if kind.is_dir()
            && depth > 0
            && let Some(found) = find_file(&entry.path(), matches, depth - 1)
        {
            return Some(found);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_never_go_through_a_link_and_reads_take_only_regular_files() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, outside) = (tmp.path().join("wt"), tmp.path().join("outside"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let doc = Path::new("docs/work-items/APP-1/12-test-report.md");
        write_in_worktree(&root, doc, "one").unwrap();
        assert_eq!(std::fs::read_to_string(root.join(doc)).unwrap(), "one");
        assert_eq!(unsafe_dirs(&root, Path::new("docs/work-items/APP-1")), None);

        // The item's folder replaced by a link to a folder outside.
        std::fs::remove_dir_all(root.join("docs/work-items/APP-1")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("docs/work-items/APP-1")).unwrap();
        let err = write_in_worktree(&root, doc, "two")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`docs/work-items/APP-1` is a symbolic link"),
            "{err}"
        );
        assert_eq!(
            std::fs::read_dir(&outside).unwrap().count(),
            0,
            "nothing written outside"
        );
        assert!(
            unsafe_dirs(&root, Path::new("docs/work-items/APP-1"))
                .unwrap()
                .contains("symbolic link")
        );

        // A link at the file's own name is replaced, never written through.
        std::fs::remove_file(root.join("docs/work-items/APP-1")).unwrap();
        let target = outside.join("secret");
        std::fs::write(&target, "keep").unwrap();
        std::fs::create_dir_all(root.join("docs/work-items/APP-1")).unwrap();
        std::os::unix::fs::symlink(&target, root.join(doc)).unwrap();
        assert!(
            open_regular(&root.join(doc)).is_err(),
            "a link is not opened"
        );
        write_in_worktree(&root, doc, "three").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        assert_eq!(
            read_regular(&root.join(doc)).unwrap().as_deref(),
            Some("three")
        );

        // A FIFO is refused at once, not waited on.
        let fifo = root.join("LESSONS.md");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        assert!(read_regular(&fifo).is_err());
        // A sparse file far larger than the cap is refused after reading the cap, not read.
        let huge = root.join("huge");
        std::fs::File::create(&huge)
            .unwrap()
            .set_len(100 << 30)
            .unwrap();
        let err = read_regular(&huge).unwrap_err();
        assert!(err.to_string().contains("larger than 32 MiB"), "{err}");
        assert_eq!(read_regular(&root.join("missing")).unwrap(), None);
    }
}
