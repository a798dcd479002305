//! The file primitives every sentinel helper is built on: refusing hostile path components,
//! bounded JSON reads that tell "absent" from "unusable", atomic writes (temp file + fsync +
//! rename + directory fsync; for the per-poll series, a swap with a sibling file and no fsync)
//! and an advisory per-directory lock. These return errors with
//! context; the public helpers turn them into fallbacks and warnings.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest sentinel file read (a watch series is a few KiB; anything bigger is not ours).
pub(crate) const MAX_READ_BYTES: u64 = 16 * 1024 * 1024;

/// What went wrong with a sentinel file.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StateError {
    #[error(
        "refused {what} {value:?}: it must be non-empty, not `.`, and contain no `/`, `\\`, `..` or NUL"
    )]
    Refused { what: &'static str, value: String },
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("corrupt {}: {source}", path.display())]
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{} is {size} bytes, over the {MAX_READ_BYTES}-byte limit", path.display())]
    TooLarge { path: PathBuf, size: u64 },
    #[error("cannot encode {}: {source}", path.display())]
    Encode {
        path: PathBuf,
        source: serde_json::Error,
    },
}

impl StateError {
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> StateError {
        StateError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Accepts a path component only if it cannot leave its parent directory: non-empty, not
/// `.`, and free of `/`, `\`, `..` and NUL. Callers pass already-validated ids; this is the
/// second line of defence (design.md §11: a hostile work item id such as `../../x`).
pub(crate) fn component<'a>(what: &'static str, value: &'a str) -> Result<&'a str, StateError> {
    let bad = value.is_empty()
        || value == "."
        || value.contains(['/', '\\', '\0'])
        || value.contains("..");
    if bad {
        Err(StateError::Refused {
            what,
            value: value.to_string(),
        })
    } else {
        Ok(value)
    }
}

/// The result of reading a sentinel file.
pub(crate) enum Read<T> {
    /// The file does not exist.
    Absent,
    /// The file was read and decoded.
    Found(T),
    /// The file exists but cannot be used (unreadable, not a file, too large, corrupt).
    Unusable(StateError),
}

/// Reads at most [`MAX_READ_BYTES`] of `path`.
pub(crate) fn read_bytes(path: &Path) -> Read<Vec<u8>> {
    let meta = match fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Read::Absent,
        Err(e) => return Read::Unusable(StateError::io("stat", path, e)),
    };
    if meta.len() > MAX_READ_BYTES {
        return Read::Unusable(StateError::TooLarge {
            path: path.to_path_buf(),
            size: meta.len(),
        });
    }
    match fs::read(path) {
        Ok(bytes) => Read::Found(bytes),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Read::Absent,
        Err(e) => Read::Unusable(StateError::io("read", path, e)),
    }
}

/// Reads and decodes a JSON sentinel file.
pub(crate) fn read_json<T: DeserializeOwned>(path: &Path) -> Read<T> {
    match read_bytes(path) {
        Read::Found(bytes) => match serde_json::from_slice(&bytes) {
            Ok(value) => Read::Found(value),
            Err(source) => Read::Unusable(StateError::Corrupt {
                path: path.to_path_buf(),
                source,
            }),
        },
        Read::Absent => Read::Absent,
        Read::Unusable(e) => Read::Unusable(e),
    }
}

/// Encodes `value` as JSON and writes it atomically and durably to `path`.
pub(crate) fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), StateError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|source| StateError::Encode {
        path: path.to_path_buf(),
        source,
    })?;
    write_atomic(path, &bytes)
}

/// Encodes `value` as compact JSON and replaces `path` with it atomically but without an
/// fsync: for a file rewritten every second by every watch (the poll series), where two
/// fsyncs per write would be most of the cost and, on a real disk, the limit. A crash of the
/// process loses nothing (the rename is atomic and the page cache outlives the process); a
/// crash of the machine may leave the older file, or one that no longer parses, which every
/// reader treats as lost evidence, never as health (the database itself commits without an
/// fsync per transaction too, SQLite's `synchronous = NORMAL`).
///
/// Once the file exists, the new content goes into a sibling `.<name>.next`, written in place,
/// and the two names are swapped in one atomic rename (`RENAME_EXCHANGE`): no inode is created
/// or freed per write (a temp file per write costs the filesystem an inode allocation each
/// time, which on ext4 without a journal grew with the inodes freed in the last seconds and
/// became the largest single cost of 1,000 watches). `.<name>.next` then holds the previous
/// content, which nothing reads. Where the swap is not available, a temp file and a rename.
/// The caller holds the directory's lock ([`lock_dir`]).
pub(crate) fn replace_json<T: Serialize>(path: &Path, value: &T) -> Result<(), StateError> {
    let bytes = serde_json::to_vec(value).map_err(|source| StateError::Encode {
        path: path.to_path_buf(),
        source,
    })?;
    match exchange_into(path, &bytes) {
        Ok(()) => Ok(()),
        Err(e) => {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::debug!(path = %path.display(), error = %e, "swap not available; writing a temp file");
            }
            write_atomic_with(path, &bytes, false)
        }
    }
}

/// Writes `bytes` to `<dir>/.<name>.next` and swaps it with the existing `path` atomically.
/// `NotFound` when `path` does not exist yet (the first write creates it the plain way).
#[cfg(target_os = "linux")]
fn exchange_into(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt as _;
    if !fs::symlink_metadata(path)?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let next = dir.join(format!(".{name}.next"));
    if fs::symlink_metadata(&next).is_ok_and(|m| !m.is_file()) {
        return Err(io::Error::other(format!(
            "{} is not a regular file",
            next.display()
        )));
    }
    // Written over in place, never truncated to zero first: ext4 (`auto_da_alloc`) flushes a
    // file that was truncated to zero and rewritten when it is closed, which made every poll
    // wait for a disk write (`orch-bench watches`: a twentieth of the runtime's CPU was in `close`).
    // The series only grows, so the new content is longer than the old; should it be shorter,
    // the file is cut to its length, never to zero.
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&next)?;
    f.write_all(bytes)?;
    let len = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
    if f.metadata()?.len() > len {
        f.set_len(len)?;
    }
    drop(f);
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other);
    let (from, to) = (c(&next)?, c(path)?);
    // SAFETY: two NUL-terminated paths that live across the call; AT_FDCWD resolves them as
    // given; RENAME_EXCHANGE swaps two existing names atomically or fails and changes nothing.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange_into(_path: &Path, _bytes: &[u8]) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "no atomic swap here",
    ))
}

/// Writes `bytes` to `path` so that a reader sees either the old file or the whole new one,
/// also after a crash: a unique temp file in the same directory, fsync, rename over `path`,
/// then fsync the directory so the rename itself is durable. Creates the directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    write_atomic_with(path, bytes, true)
}

/// [`write_atomic`], with the two fsyncs only when `durable`.
fn write_atomic_with(path: &Path, bytes: &[u8], durable: bool) -> Result<(), StateError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    fs::create_dir_all(dir).map_err(|e| StateError::io("create directory", dir, e))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(
        ".{name}.tmp.{}.{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| StateError::io("create", &tmp, e))?;
        f.write_all(bytes)
            .map_err(|e| StateError::io("write", &tmp, e))?;
        if durable {
            f.sync_all().map_err(|e| StateError::io("fsync", &tmp, e))?;
        }
        fs::rename(&tmp, path).map_err(|e| StateError::io("rename into place", path, e))
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    if durable {
        sync_dir(dir);
    }
    Ok(())
}

/// Best-effort fsync of a directory (makes a rename or removal durable).
pub(crate) fn sync_dir(dir: &Path) {
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        tracing::debug!(dir = %dir.display(), error = %e, "directory fsync failed (best effort)");
    }
}

/// An exclusive advisory lock on `<dir>/.lock`, held until dropped. It serialises the
/// read-modify-write of one state directory across threads and processes (it is an OS file
/// lock, taken per open file). `None` when it cannot be taken: the caller proceeds as the
/// single writer the job queue already makes it, and this is logged.
pub(crate) fn lock_dir(dir: &Path) -> Option<File> {
    let path = dir.join(".lock");
    let locked = fs::create_dir_all(dir)
        .and_then(|()| {
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
        })
        .and_then(|f| f.lock().map(|()| f));
    match locked {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(lock = %path.display(), error = %e, "sentinel state: cannot take the directory lock; proceeding as single writer");
            None
        }
    }
}

/// Removes a directory tree; an absent one counts as removed. Then removes its parent if that
/// became empty (best effort: another work item may still use it).
pub(crate) fn remove_tree(dir: &Path) -> Result<(), StateError> {
    match fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(StateError::io("remove", dir, e)),
    }
    if let Some(parent) = dir.parent() {
        let _ = fs::remove_dir(parent); // fails harmlessly while not empty
        sync_dir(parent.parent().unwrap_or(parent));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components() {
        for ok in ["ORCH-1", "orch", "a.b", "x_y", "é"] {
            assert!(component("id", ok).is_ok(), "{ok:?}");
        }
        for bad in [
            "", ".", "..", "../../x", "a/b", "a\\b", "a\0b", "x..y", "/abs",
        ] {
            assert!(component("id", bad).is_err(), "{bad:?}");
        }
        let msg = component("work item id", "../x").unwrap_err().to_string();
        assert!(
            msg.contains("work item id") && msg.contains("../x"),
            "{msg}"
        );
    }

    #[test]
    fn write_atomic_replaces_and_leaves_no_temp() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("sub/file");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(tmp.path().join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["file"]);
    }

    fn list(path: &Path) -> Option<Vec<i32>> {
        match read_json(path) {
            Read::Found(v) => Some(v),
            _ => None,
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn replace_json_swaps_two_files_and_creates_no_inode_per_write() {
        use std::os::unix::fs::MetadataExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("series");
        let ino = |p: &Path| fs::metadata(p).unwrap().ino();
        replace_json(&path, &vec![1]).unwrap();
        replace_json(&path, &vec![1, 2]).unwrap();
        let next = tmp.path().join(".series.next");
        let inodes = [ino(&path), ino(&next)];
        for n in 3..8 {
            let want: Vec<i32> = (1..=n).collect();
            replace_json(&path, &want).unwrap();
            assert_eq!(list(&path), Some(want));
            assert!(inodes.contains(&ino(&path)) && inodes.contains(&ino(&next)));
            assert_ne!(ino(&path), ino(&next));
        }
        // The sibling holds the previous content; no temp file is left.
        assert_eq!(list(&next), Some((1..=6).collect()));
        let mut names: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, [".series.next", "series"]);
        // The sibling is written over in place, not truncated first: a shorter content (a
        // series started again) leaves nothing of the longer one behind it.
        replace_json(&path, &vec![9]).unwrap();
        replace_json(&path, &vec![9, 8]).unwrap();
        assert_eq!(list(&path), Some(vec![9, 8]));
        assert_eq!(list(&next), Some(vec![9]));
        assert_eq!(fs::read(&path).unwrap(), b"[9,8]");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn replace_json_never_writes_through_a_planted_link() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("series");
        let victim = tmp.path().join("victim");
        fs::write(&victim, b"keep").unwrap();
        replace_json(&path, &vec![1]).unwrap();
        std::os::unix::fs::symlink(&victim, tmp.path().join(".series.next")).unwrap();
        replace_json(&path, &vec![1, 2]).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
        assert_eq!(list(&path), Some(vec![1, 2]));
    }

    #[test]
    fn reads_tell_absent_from_unusable() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(matches!(
            read_json::<u32>(&tmp.path().join("none")),
            Read::Absent
        ));
        fs::write(tmp.path().join("bad"), b"{").unwrap();
        assert!(matches!(
            read_json::<u32>(&tmp.path().join("bad")),
            Read::Unusable(StateError::Corrupt { .. })
        ));
        assert!(matches!(
            read_json::<u32>(tmp.path()),
            Read::Unusable(StateError::Io { .. })
        ));
        let big = File::create(tmp.path().join("big")).unwrap();
        big.set_len(MAX_READ_BYTES + 1).unwrap();
        assert!(matches!(
            read_json::<u32>(&tmp.path().join("big")),
            Read::Unusable(StateError::TooLarge { .. })
        ));
    }
}
