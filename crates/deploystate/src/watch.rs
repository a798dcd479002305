//! The post-deploy watch's sentinel state (ORCH-021, design.md §7): the files `armed`,
//! `series` and `done` under `<repos_dir>/.post-deploy-state-<repo>/<work_item_id>/`, kept on
//! disk instead of in tables (no migration: design.md §7, AC-12). Every access is never-raise
//! (design.md §7): a missing or broken file gives a conservative fallback — never evidence that is
//! not there — and a `tracing::warn!` says what happened.
//!
//! Besides the seed's three files the directory holds `lost` (why evidence was lost, one line
//! per incident, so a loss is never silent), `series.corrupt` (the last unreadable series,
//! kept for inspection), `.lock` (the writers' lock), `.series.next` (the series before the
//! last poll: each poll is written there and swapped in) and transient `.<name>.tmp.*` files.

use std::fs;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use orch_domain::monitor::{Poll, WatchParams, deadline_ms};
use serde::{Deserialize, Serialize};

use crate::fsx::{self, Read, StateError};

/// The prefix of a repo's watch directory inside `repos_dir` (design.md §7).
pub const STATE_DIR_PREFIX: &str = ".post-deploy-state-";
/// Sentinel: the watch is armed (design.md §7; JSON [`ArmedRecord`]).
pub const ARMED_FILE: &str = "armed";
/// Sentinel: the JSON list of polls (design.md §7).
pub const SERIES_FILE: &str = "series";
/// Sentinel: the watch finished; later jobs do nothing (design.md §7).
pub const DONE_FILE: &str = "done";
/// Why evidence was lost, one line per incident.
pub const LOST_FILE: &str = "lost";
/// Where an unreadable series is moved before a fresh one is started.
pub const CORRUPT_SERIES_FILE: &str = "series.corrupt";

/// What `armed` records: the frozen parameters, when the watch was armed, its deadline and
/// the deployed revision (design.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmedRecord {
    /// The parameters frozen at arming.
    pub params: WatchParams,
    /// When the watch was armed (epoch ms).
    pub armed_at_ms: i64,
    /// The deadline (epoch ms), see [`orch_domain::monitor::deadline_ms`].
    pub deadline_ms: i64,
    /// The deployed revision being watched.
    pub revision: String,
}

impl ArmedRecord {
    /// A record whose deadline follows from the parameters.
    pub fn new(params: WatchParams, armed_at_ms: i64, revision: impl Into<String>) -> ArmedRecord {
        ArmedRecord {
            params,
            armed_at_ms,
            deadline_ms: deadline_ms(&params, armed_at_ms),
            revision: revision.into(),
        }
    }
}

/// What [`WatchState::arm`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArmOutcome {
    /// The watch is now armed with the given record.
    Armed,
    /// It was already armed: nothing was written; this is the record in force. The caller
    /// compares its revision to tell a retried arm from a new deploy (which must
    /// [`WatchState::clear`] first).
    AlreadyArmed(ArmedRecord),
    /// Arming failed (refused id, I/O error); the reason was logged.
    Failed(String),
}

/// What [`WatchState::armed`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArmedRead {
    /// The watch is armed with this record.
    Present(ArmedRecord),
    /// Not armed.
    Absent,
    /// `armed` exists but cannot be used (corrupt, truncated, unreadable, not a file, or the
    /// state path was refused); the reason was logged. Treat as "armed, parameters unknown".
    Corrupt(String),
}

/// What [`WatchState::series`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeriesRead {
    /// The polls that could be read (empty when the series is unusable).
    pub polls: Vec<Poll>,
    /// Set when evidence was lost now or earlier: the series is unusable, or a `lost` note
    /// exists. An empty or short series then makes the decision DEGRADED, never HEALTHY.
    pub lost: Option<String>,
}

/// One armed-but-not-done watch found by [`list_active`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveWatch {
    /// The repo.
    pub repo: String,
    /// The work item.
    pub work_item_id: String,
    /// Its `armed` record (or why it cannot be read).
    pub armed: ArmedRead,
}

/// The sentinel state of one work item's post-deploy watch. Construction never fails: a
/// refused repo or id makes every operation return its fallback.
#[derive(Debug, Clone)]
pub struct WatchState {
    dir: Result<PathBuf, String>,
}

impl WatchState {
    /// The state of `work_item_id`'s watch in `<repos_dir>/.post-deploy-state-<repo>/`.
    /// `repo` and `work_item_id` must be single path components (see the crate docs).
    pub fn new(repos_dir: &Path, repo: &str, work_item_id: &str) -> WatchState {
        let dir = fsx::component("repo", repo)
            .and_then(|repo| Ok((repo, fsx::component("work item id", work_item_id)?)))
            .map(|(repo, id)| repos_dir.join(format!("{STATE_DIR_PREFIX}{repo}")).join(id))
            .map_err(|e| {
                tracing::warn!(error = %e, "post-deploy state: refused path");
                e.to_string()
            });
        WatchState { dir }
    }

    /// The state directory, unless the path was refused.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref().ok()
    }

    fn file(&self, name: &str) -> Result<PathBuf, String> {
        self.dir
            .as_ref()
            .map(|d| d.join(name))
            .map_err(Clone::clone)
    }

    /// Arms the watch once (design.md §7: `armed` is the arm's idempotency marker, like
    /// `INITIATED`). If a readable `armed` exists, nothing is written and it is returned.
    /// An unusable `armed` file is replaced: the old series is moved aside and the loss noted
    /// in `lost`, so the new window never mixes with evidence from an unknown one.
    pub fn arm(&self, record: &ArmedRecord) -> ArmOutcome {
        let dir = match &self.dir {
            Ok(dir) => dir,
            Err(e) => return ArmOutcome::Failed(e.clone()),
        };
        let path = dir.join(ARMED_FILE);
        let _lock = fsx::lock_dir(dir);
        match fsx::read_json::<ArmedRecord>(&path) {
            Read::Found(existing) => return ArmOutcome::AlreadyArmed(existing),
            Read::Absent => {}
            Read::Unusable(StateError::Corrupt { .. }) => {
                let why = "armed was corrupt; re-armed, earlier series set aside";
                tracing::warn!(path = %path.display(), "post-deploy state: {why}");
                if let Err(e) = self.set_series_aside(why) {
                    return failed("arm", e);
                }
            }
            Read::Unusable(e) => return failed("arm", e),
        }
        match fsx::write_json(&path, record) {
            Ok(()) => ArmOutcome::Armed,
            Err(e) => failed("arm", e),
        }
    }

    /// Reads `armed`.
    pub fn armed(&self) -> ArmedRead {
        let path = match self.file(ARMED_FILE) {
            Ok(path) => path,
            Err(e) => return ArmedRead::Corrupt(e),
        };
        match fsx::read_json::<ArmedRecord>(&path) {
            Read::Found(record) if record.deadline_ms < record.armed_at_ms => {
                let why = format!(
                    "{}: deadline {} is before armed_at {}",
                    path.display(),
                    record.deadline_ms,
                    record.armed_at_ms
                );
                tracing::warn!("post-deploy state: {why}");
                ArmedRead::Corrupt(why)
            }
            Read::Found(record) => ArmedRead::Present(record),
            Read::Absent => ArmedRead::Absent,
            Read::Unusable(e) => {
                tracing::warn!(error = %e, "post-deploy state: armed unusable");
                ArmedRead::Corrupt(e.to_string())
            }
        }
    }

    /// Appends one poll to `series` atomically (read, write temp, fsync, rename) under the
    /// directory lock, so concurrent appenders lose nothing. A poll for a tick already recorded
    /// is not appended again (a re-run job must not repeat a slot) and counts as recorded.
    /// An unreadable-but-present series is moved to `series.corrupt`, the loss is noted in
    /// `lost`, and a new series starts with this poll. Returns whether the poll is on disk.
    pub fn append_poll(&self, poll: &Poll) -> bool {
        self.append(poll).is_some()
    }

    /// [`WatchState::append_poll`], returning what [`WatchState::series`] would read right
    /// after it (the series as written, and the `lost` notes), so a tick does not read back
    /// the file it has just written. `None` when the poll is not on disk.
    pub fn record_poll(&self, poll: &Poll) -> Option<SeriesRead> {
        let polls = self.append(poll)?;
        Some(SeriesRead {
            polls,
            lost: self.lost_notes(Vec::new()),
        })
    }

    /// The series on disk after appending `poll` (see [`WatchState::append_poll`]).
    fn append(&self, poll: &Poll) -> Option<Vec<Poll>> {
        let Ok(dir) = &self.dir else { return None };
        let path = dir.join(SERIES_FILE);
        let _lock = fsx::lock_dir(dir);
        let mut polls = match fsx::read_json::<Vec<Poll>>(&path) {
            Read::Found(polls) => polls,
            Read::Absent => Vec::new(),
            Read::Unusable(StateError::Corrupt { source, .. }) => {
                let why = format!(
                    "series was corrupt before tick {} ({source}); earlier polls lost",
                    poll.tick
                );
                tracing::warn!(path = %path.display(), "post-deploy state: {why}");
                if let Err(e) = self.set_series_aside(&why) {
                    tracing::warn!(error = %e, "post-deploy state: cannot set the corrupt series aside");
                    return None;
                }
                Vec::new()
            }
            Read::Unusable(e) => {
                tracing::warn!(error = %e, "post-deploy state: cannot append a poll");
                return None;
            }
        };
        if polls.iter().any(|p| p.tick == poll.tick) {
            tracing::info!(tick = poll.tick, path = %path.display(), "post-deploy state: tick already recorded");
            return Some(polls);
        }
        polls.push(poll.clone());
        match fsx::replace_json(&path, &polls) {
            Ok(()) => Some(polls),
            Err(e) => {
                tracing::warn!(error = %e, "post-deploy state: cannot append a poll");
                None
            }
        }
    }

    /// Moves an existing `series` to `series.corrupt` and notes why in `lost`. Must hold the lock.
    fn set_series_aside(&self, why: &str) -> Result<(), StateError> {
        let dir = self.dir.as_ref().map_err(|e| StateError::Refused {
            what: "state directory",
            value: e.clone(),
        })?;
        let (series, aside) = (dir.join(SERIES_FILE), dir.join(CORRUPT_SERIES_FILE));
        match fs::symlink_metadata(&series) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(StateError::io("stat", &series, e)),
            Ok(meta) if !meta.is_file() => {
                return Err(StateError::io(
                    "set aside",
                    &series,
                    io::Error::other("not a regular file; left untouched"),
                ));
            }
            Ok(_) => {
                fs::rename(&series, &aside).map_err(|e| StateError::io("move aside", &series, e))?
            }
        }
        self.note_lost(why)
    }

    fn note_lost(&self, why: &str) -> Result<(), StateError> {
        let dir = self.dir.as_ref().map_err(|e| StateError::Refused {
            what: "state directory",
            value: e.clone(),
        })?;
        fs::create_dir_all(dir).map_err(|e| StateError::io("create directory", dir, e))?;
        let path = dir.join(LOST_FILE);
        let line = why.replace(['\n', '\r'], " ");
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| StateError::io("open", &path, e))?;
        writeln!(f, "{line}").map_err(|e| StateError::io("append to", &path, e))?;
        f.sync_all().map_err(|e| StateError::io("fsync", &path, e))
    }

    /// Records that evidence was lost for a reason found outside this crate (design.md §10: a
    /// watch re-armed on another node has its evidence so far marked lost, never silently).
    pub fn mark_lost(&self, reason: &str) -> bool {
        let Some(dir) = self.dir() else { return false };
        let _lock = fsx::lock_dir(dir);
        match self.note_lost(reason) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "post-deploy state: cannot note lost evidence");
                false
            }
        }
    }

    /// Reads `series`. Absent = no polls yet. Unusable = no polls and `lost` says why (the
    /// decision then cannot be HEALTHY on evidence that is not there). Any earlier `lost` note
    /// is reported too.
    pub fn series(&self) -> SeriesRead {
        let path = match self.file(SERIES_FILE) {
            Ok(path) => path,
            Err(e) => {
                return SeriesRead {
                    polls: Vec::new(),
                    lost: Some(e),
                };
            }
        };
        let mut lost = Vec::new();
        let polls = match fsx::read_json::<Vec<Poll>>(&path) {
            Read::Found(polls) => polls,
            Read::Absent => Vec::new(),
            Read::Unusable(e) => {
                tracing::warn!(error = %e, "post-deploy state: series unusable; evidence lost");
                lost.push(e.to_string());
                Vec::new()
            }
        };
        SeriesRead {
            polls,
            lost: self.lost_notes(lost),
        }
    }

    /// `lost` (what was noted so far, then every line of the `lost` file), joined; `None`
    /// when there is nothing.
    fn lost_notes(&self, mut lost: Vec<String>) -> Option<String> {
        if let Ok(dir) = &self.dir {
            match fsx::read_bytes(&dir.join(LOST_FILE)) {
                Read::Found(bytes) => lost.extend(
                    String::from_utf8_lossy(&bytes)
                        .lines()
                        .filter(|l| !l.trim().is_empty())
                        .map(str::to_string),
                ),
                Read::Absent => {}
                Read::Unusable(e) => lost.push(e.to_string()),
            }
        }
        (!lost.is_empty()).then(|| lost.join("; "))
    }

    /// Writes `done` with a one-line summary (design.md §7, §5). Returns whether it is on disk.
    pub fn mark_done(&self, summary: &str) -> bool {
        let Ok(path) = self.file(DONE_FILE) else {
            return false;
        };
        let mut text = summary.replace(['\n', '\r'], " ");
        text.push('\n');
        match fsx::write_atomic(&path, text.as_bytes()) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "post-deploy state: cannot write done");
                false
            }
        }
    }

    /// Whether `done` exists (in any form). When that cannot be told (I/O error, refused path)
    /// the answer is `false` and a warning is logged: the job then reads `armed`/`series`,
    /// which fall back on their own, and the stage CAS keeps it from finishing twice.
    pub fn is_done(&self) -> bool {
        let Ok(path) = self.file(DONE_FILE) else {
            return false;
        };
        match fs::symlink_metadata(&path) {
            Ok(_) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "post-deploy state: cannot tell whether done");
                false
            }
        }
    }

    /// Removes the state directory (design.md §7: best-effort hygiene after `done`). Absent counts
    /// as removed. Returns whether it is gone.
    pub fn clear(&self) -> bool {
        let Ok(dir) = &self.dir else { return false };
        match fsx::remove_tree(dir) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "post-deploy state: cannot clear");
                false
            }
        }
    }
}

fn failed(op: &str, e: StateError) -> ArmOutcome {
    tracing::warn!(error = %e, "post-deploy state: {op} failed");
    ArmOutcome::Failed(e.to_string())
}

/// Every watch in `repos_dir` that is armed (an `armed` entry exists, readable or not) and not
/// done, sorted by repo and work item: the active observations of `GET /queue` and the input
/// of the recovery sweep (design.md §7: a stale `armed` without `done` after a crash is completed
/// by a restored job). Unreadable directories and refused names are skipped with a warning.
pub fn list_active(repos_dir: &Path) -> Vec<ActiveWatch> {
    let mut out = Vec::new();
    for (repo, repo_dir) in subdirs(repos_dir) {
        let Some(repo) = repo.strip_prefix(STATE_DIR_PREFIX) else {
            continue;
        };
        if fsx::component("repo", repo).is_err() {
            tracing::warn!(dir = %repo_dir.display(), "post-deploy state: skipping a refused repo name");
            continue;
        }
        for (id, item_dir) in subdirs(&repo_dir) {
            if fsx::component("work item id", &id).is_err() {
                tracing::warn!(dir = %item_dir.display(), "post-deploy state: skipping a refused work item id");
                continue;
            }
            let armed_exists = fs::symlink_metadata(item_dir.join(ARMED_FILE)).is_ok();
            let state = WatchState::new(repos_dir, repo, &id);
            if armed_exists && !state.is_done() {
                out.push(ActiveWatch {
                    repo: repo.to_string(),
                    work_item_id: id,
                    armed: state.armed(),
                });
            }
        }
    }
    out.sort_by(|a, b| (&a.repo, &a.work_item_id).cmp(&(&b.repo, &b.work_item_id)));
    out
}

/// The real (non-symlink) subdirectories of `dir` with UTF-8 names; errors are logged and skipped.
fn subdirs(dir: &Path) -> Vec<(String, PathBuf)> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "post-deploy state: cannot list");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "post-deploy state: cannot list an entry");
                continue;
            }
        };
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        match entry.file_name().into_string() {
            Ok(name) => out.push((name, entry.path())),
            Err(name) => {
                tracing::warn!(name = ?name, "post-deploy state: skipping a non-UTF-8 name");
            }
        }
    }
    out
}
