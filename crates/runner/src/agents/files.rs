//! The artifact files around an agent run: what they looked like before it (so that a file
//! left over from an earlier visit does not pass for new work), which expected ones it did
//! not write, and writing a file atomically for backends whose reply orch writes itself.

use std::hash::{DefaultHasher, Hasher};
use std::io::Read as _;
use std::path::Path;
use std::time::SystemTime;

use orch_domain::ids::ArtifactName;

/// The most of a file hashed to tell whether it changed (its size and time count too).
const HASH_LIMIT: u64 = 4 * 1024 * 1024;

/// What an artifact file looked like at one moment.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Stamp {
    len: u64,
    modified: Option<SystemTime>,
    hash: u64,
}

/// The expected files before a run: each with its stamp, `None` when absent.
pub(crate) type Snapshot = Vec<(ArtifactName, Option<Stamp>)>;

/// Stamps `names` in `dir`.
pub(crate) fn snapshot(dir: &Path, names: &[ArtifactName]) -> Snapshot {
    names
        .iter()
        .map(|n| (n.clone(), stamp(&dir.join(n.as_str()))))
        .collect()
}

/// A file's stamp; `None` when it is not a readable regular file.
fn stamp(path: &Path) -> Option<Stamp> {
    let meta = std::fs::metadata(path).ok().filter(|m| m.is_file())?;
    let mut hasher = DefaultHasher::new();
    let mut file = std::fs::File::open(path).ok()?.take(HASH_LIMIT);
    let mut buf = [0u8; 64 * 1024];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.write(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    Some(Stamp {
        len: meta.len(),
        modified: meta.modified().ok(),
        hash: hasher.finish(),
    })
}

/// Which expected files a run left missing, and which it left exactly as they were before it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Unwritten {
    pub missing: Vec<ArtifactName>,
    pub unchanged: Vec<ArtifactName>,
}

/// Compares the files in `dir` with `before`.
pub(crate) fn unwritten(dir: &Path, before: &Snapshot) -> Unwritten {
    let mut out = Unwritten::default();
    for (name, old) in before {
        match (old, stamp(&dir.join(name.as_str()))) {
            (_, None) => out.missing.push(name.clone()),
            (Some(old), Some(new)) if *old == new => out.unchanged.push(name.clone()),
            _ => {}
        }
    }
    out
}

/// `fresh`, kept for job `job`'s try `try_no`; when the job adopts commands an earlier orch
/// started (see [`orch_exec::supervise`]), the snapshot that orch kept instead, so an adopted
/// agent run's files are judged against what they were before it ran, not after. Without
/// supervision, or when the kept copy cannot be written or read, `fresh` (logged).
pub(crate) fn snapshot_once(job: i64, try_no: u32, fresh: Snapshot) -> Snapshot {
    use orch_exec::supervise;
    let name = format!("before-{try_no}");
    if supervise::job_has_records(job)
        && let Some(bytes) = supervise::kept(job, &name)
    {
        match serde_json::from_slice::<Vec<(String, Option<Stamp>)>>(&bytes) {
            Ok(kept) => {
                let kept: Option<Snapshot> = kept
                    .into_iter()
                    .map(|(n, s)| n.parse().ok().map(|n| (n, s)))
                    .collect();
                if let Some(kept) = kept {
                    return kept;
                }
                tracing::warn!(
                    job,
                    "a kept artifact snapshot names an invalid file; using a fresh one"
                );
            }
            Err(e) => {
                tracing::warn!(job, error = %e, "a kept artifact snapshot is unreadable; using a fresh one");
            }
        }
        return fresh;
    }
    let plain: Vec<(String, Option<Stamp>)> = fresh
        .iter()
        .map(|(n, s)| (n.to_string(), s.clone()))
        .collect();
    match serde_json::to_vec(&plain) {
        Ok(bytes) => supervise::keep(job, &name, &bytes),
        Err(e) => tracing::warn!(job, error = %e, "cannot encode an artifact snapshot"),
    }
    fresh
}

pub(crate) use crate::fsutil::write_atomic_io as write_atomic;

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> ArtifactName {
        s.parse().unwrap()
    }

    /// Writes `before` files, snapshots, applies `change`, and expects (missing, unchanged).
    fn check(before: &[(&str, &str)], change: impl FnOnce(&Path), expect: (&[&str], &[&str])) {
        let dir = tempfile::tempdir().unwrap();
        for (n, c) in before {
            std::fs::write(dir.path().join(n), c).unwrap();
        }
        let names = [name("02-requirements.md"), name("08-data-requirements.md")];
        let snap = snapshot(dir.path(), &names);
        change(dir.path());
        let got = unwritten(dir.path(), &snap);
        let strs = |v: &[ArtifactName]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(
            (strs(&got.missing), strs(&got.unchanged)),
            (
                expect.0.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                expect.1.iter().map(|s| s.to_string()).collect::<Vec<_>>()
            )
        );
    }

    #[test]
    fn missing_and_unchanged_files_are_told_apart() {
        check(
            &[],
            |_| {},
            (&["02-requirements.md", "08-data-requirements.md"], &[]),
        );
        check(
            &[],
            |d| {
                write_atomic(&d.join("02-requirements.md"), "new").unwrap();
                write_atomic(&d.join("08-data-requirements.md"), "new").unwrap();
            },
            (&[], &[]),
        );
        check(
            &[
                ("02-requirements.md", "old"),
                ("08-data-requirements.md", "old"),
            ],
            |d| std::fs::write(d.join("08-data-requirements.md"), "changed").unwrap(),
            (&[], &["02-requirements.md"]),
        );
        check(
            &[("02-requirements.md", "old")],
            |d| std::fs::remove_file(d.join("02-requirements.md")).unwrap(),
            (&["02-requirements.md", "08-data-requirements.md"], &[]),
        );
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/02-requirements.md");
        write_atomic(&p, "one").unwrap();
        write_atomic(&p, "two").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "two");
        let names: Vec<_> = std::fs::read_dir(dir.path().join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["02-requirements.md"]);
    }
}
