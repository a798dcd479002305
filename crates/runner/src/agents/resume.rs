//! Agent sessions that survive a lost run (issue 29): a CLI preset's session files live in a
//! durable state directory of the run's supervised command (`orch_exec::supervise::state_dir`,
//! `j<job>.~state-agent-<n>`) instead of a throwaway home, and the session id is recorded
//! there by orch. When the command was lost (its record has no result and its supervisor is
//! gone: the machine rebooted), the same try continues its session (Claude Code `--resume`,
//! Codex `exec resume`, Aider `--restore-chat-history`) with a note in the prompt, if the
//! session's files are still there; otherwise it starts afresh, and both are recorded
//! (`agent.session_resumed`, `agent.session_lost`).
//!
//! Layout of a state directory: `home/` (the CLI's `HOME`, `CODEX_HOME` below it) and
//! `files/` (Aider's histories) are the agent's, writable in its sandbox; `session` is orch's
//! note (`<cli> <id>`), beside them, never inside. Everything read back is hostile input: the
//! note is read bounded, without following links, and an id goes on a command line only if
//! it is a plain name ([`valid_id`]).

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use orch_domain::config::Backend;
use orch_exec::process::OutputSink;

/// orch's note of the session, in the state directory (not in the agent's part).
const NOTE: &str = "session";
/// orch's note of the task and lease attempt the state belongs to, beside [`NOTE`]: a lost
/// run is continued only by the next attempt of the same task (`<task id> <attempt>`).
const RUN: &str = "run";
/// Bytes of the note read at most.
const NOTE_MAX: u64 = 512;
/// Longest session id accepted.
const ID_MAX: usize = 128;
/// Longest stdout line scanned for a session id (a longer one is skipped).
const LINE_MAX: usize = 64 * 1024;

/// What the prompt of a resumed run begins with.
pub(crate) const RESUME_NOTE: &str = "Note from orch: your previous run of this task was \
interrupted (its process was lost, e.g. the machine restarted) before it finished. This is \
the same session, resumed: continue where you left off. Check what is already in place \
before redoing it, then finish the task as asked below.\n\n";

/// A run's durable state directory.
#[derive(Debug, Clone)]
pub(crate) struct State {
    dir: PathBuf,
}

/// What a try does about an earlier, lost run of the same command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing was lost: a fresh run.
    Fresh,
    /// Continue session `id` (Aider: its chat history; `id` is the history file's name).
    Resume { id: String },
    /// The lost run's session cannot be continued (`why`): a fresh run.
    Lost { id: Option<String>, why: String },
}

/// The CLI's name in events.
pub(crate) fn cli_name(backend: Backend) -> &'static str {
    super::backend_name(backend)
}

/// Whether `backend` can continue a session.
pub(crate) fn resumable(backend: Backend) -> bool {
    matches!(backend, Backend::Claude | Backend::Codex | Backend::Aider)
}

/// A session id that may go on a command line: 1 to 128 ASCII letters, digits, `-` and `_`,
/// starting with a letter or digit (never an option).
pub(crate) fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= ID_MAX
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A random UUID (version 4), the session id orch gives Claude Code up front.
pub(crate) fn new_uuid() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

impl State {
    /// The state directory of the command keyed `key`, with its `home/` and `files/`; `None`
    /// when commands are not supervised (nothing outlives the run).
    pub(crate) fn open(key: &str) -> std::io::Result<Option<State>> {
        let Some(dir) = orch_exec::supervise::state_dir(key)? else {
            return Ok(None);
        };
        let state = State { dir };
        state.make_parts()?;
        Ok(Some(state))
    }

    fn make_parts(&self) -> std::io::Result<()> {
        for part in [self.home(), self.files()] {
            match std::fs::symlink_metadata(&part) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    std::fs::remove_file(&part)?;
                    std::fs::create_dir(&part)?;
                }
                Err(_) => std::fs::create_dir(&part)?,
            }
        }
        Ok(())
    }

    /// The CLI's `HOME`.
    pub(crate) fn home(&self) -> PathBuf {
        self.dir.join("home")
    }

    /// Aider's history files.
    pub(crate) fn files(&self) -> PathBuf {
        self.dir.join("files")
    }

    /// Starts over: the agent's parts emptied, the note removed.
    pub(crate) fn clear(&self) -> std::io::Result<()> {
        for part in [self.home(), self.files()] {
            match std::fs::remove_dir_all(&part) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        for note in [NOTE, RUN] {
            match std::fs::remove_file(self.dir.join(note)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        self.make_parts()
    }

    /// Records that the state belongs to `task`'s lease attempt `attempt`, durably.
    pub(crate) fn bind(&self, task: i64, attempt: i64) -> std::io::Result<()> {
        write_durable(&self.dir, RUN, format!("{task} {attempt}\n").as_bytes())
    }

    /// The task and attempt the state was last bound to, if its note is readable.
    pub(crate) fn bound(&self) -> Option<(i64, i64)> {
        let bytes = read_bounded(&self.dir.join(RUN))?;
        let text = std::str::from_utf8(&bytes).ok()?;
        let (task, attempt) = text.trim().split_once(' ')?;
        Some((task.parse().ok()?, attempt.parse().ok()?))
    }

    /// Whether a lost run in this state may be continued by `task`'s attempt `attempt`: only
    /// by the attempt right after the one that was lost, of the same task. Another attempt in
    /// between ran the job elsewhere (its worktree and branch moved on); another task means
    /// the job id was used again. `Err` says why not.
    pub(crate) fn continues(&self, task: i64, attempt: i64) -> Result<(), String> {
        match self.bound() {
            Some((t, a)) if t == task && a.checked_add(1) == Some(attempt) => Ok(()),
            Some((t, _)) if t != task => {
                Err("the state belongs to another task (its job id was used again)".into())
            }
            Some((_, a)) => Err(format!(
                "the lost run was attempt {a}; attempt {attempt} follows other attempts (perhaps on another node)"
            )),
            None => Err("the lost run's state names no task and attempt".into()),
        }
    }

    /// Records `id` as the session of `backend`'s run, durably.
    pub(crate) fn record(&self, backend: Backend, id: &str) -> std::io::Result<()> {
        if !valid_id(id) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "not a plain session id",
            ));
        }
        write_durable(
            &self.dir,
            NOTE,
            format!("{} {id}\n", cli_name(backend)).as_bytes(),
        )
    }

    /// The recorded session of `backend`, if the note is readable, of that CLI and valid.
    pub(crate) fn recorded(&self, backend: Backend) -> Option<String> {
        let bytes = read_bounded(&self.dir.join(NOTE))?;
        let text = std::str::from_utf8(&bytes).ok()?;
        let (cli, id) = text.trim().split_once(' ')?;
        (cli == cli_name(backend) && valid_id(id)).then(|| id.to_owned())
    }

    /// What to do about a lost run of `backend` in this state directory.
    pub(crate) fn decide(&self, backend: Backend) -> Decision {
        if backend == Backend::Aider {
            let history = self.files().join("chat.history.md");
            return match std::fs::symlink_metadata(&history) {
                Ok(m) if m.is_file() && m.len() > 0 => Decision::Resume {
                    id: "chat.history.md".into(),
                },
                _ => Decision::Lost {
                    id: None,
                    why: "the lost run left no chat history".into(),
                },
            };
        }
        let Some(id) = self
            .recorded(backend)
            .or_else(|| self.codex_rollout_id(backend))
        else {
            return Decision::Lost {
                id: None,
                why: "the lost run recorded no session id".into(),
            };
        };
        let home = self.home();
        let found = match backend {
            Backend::Claude => {
                let name = format!("{id}.jsonl");
                crate::fsutil::find_file(&home.join(".claude").join("projects"), &|n| n == name, 1)
            }
            Backend::Codex => {
                let suffix = format!("-{id}.jsonl");
                crate::fsutil::find_file(
                    &home.join(".codex").join("sessions"),
                    &|n| n.starts_with("rollout-") && n.ends_with(&suffix),
                    3,
                )
            }
            _ => None,
        };
        if found.is_some() {
            Decision::Resume { id }
        } else {
            Decision::Lost {
                id: Some(id),
                why: "the session's files are gone".into(),
            }
        }
    }

    /// Codex's session id from the name of its one rollout file
    /// (`sessions/…/rollout-<time>-<uuid>.jsonl`) when orch did not read it from the stream
    /// before the run was lost: the home is this try's own, so its only rollout is this run's.
    /// More than one, or a name that does not end in a UUID, gives none.
    fn codex_rollout_id(&self, backend: Backend) -> Option<String> {
        if backend != Backend::Codex {
            return None;
        }
        let mut names = Vec::new();
        collect_files(
            &self.home().join(".codex").join("sessions"),
            &|n| n.starts_with("rollout-") && n.ends_with(".jsonl"),
            3,
            &mut names,
        );
        let [name] = names.as_slice() else {
            return None;
        };
        let stem = name.strip_suffix(".jsonl")?;
        let id = stem.get(stem.len().checked_sub(36)?..)?;
        let uuid = id.bytes().enumerate().all(|(i, b)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                b == b'-'
            } else {
                b.is_ascii_hexdigit()
            }
        });
        (uuid && valid_id(id)).then(|| id.to_owned())
    }

    /// A sink that records the session id the CLI announces on stdout (Codex's
    /// `thread.started`), once, then passes every chunk on to `next`.
    pub(crate) fn capture(&self, backend: Backend, next: Option<OutputSink>) -> OutputSink {
        let state = self.clone();
        let scan = Arc::new(Mutex::new(Scan::default()));
        OutputSink(Arc::new(move |bytes: &[u8]| {
            if let Ok(mut s) = scan.lock()
                && !s.done
                && let Some(id) = s.feed(bytes)
            {
                s.done = true;
                if state.recorded(backend).as_deref() != Some(id.as_str())
                    && let Err(e) = state.record(backend, &id)
                {
                    tracing::warn!(error = %e, "cannot record the agent's session id");
                }
            }
            if let Some(next) = &next {
                (next.0)(bytes);
            }
        }))
    }
}

/// Line scanning of a CLI's stdout for its session id.
#[derive(Default)]
struct Scan {
    line: Vec<u8>,
    skipping: bool,
    done: bool,
}

impl Scan {
    fn feed(&mut self, bytes: &[u8]) -> Option<String> {
        for &b in bytes {
            if b == b'\n' {
                let line = std::mem::take(&mut self.line);
                let skipped = std::mem::replace(&mut self.skipping, false);
                if !skipped && let Some(id) = session_of_line(&line) {
                    return Some(id);
                }
            } else if !self.skipping {
                if self.line.len() >= LINE_MAX {
                    self.line.clear();
                    self.skipping = true;
                } else {
                    self.line.push(b);
                }
            }
        }
        None
    }
}

/// The session id a JSON line announces: Codex's `{"type":"thread.started","thread_id":…}`,
/// Claude Code's `{"type":"system","session_id":…}`.
fn session_of_line(line: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(line).ok()?;
    let id = match v.get("type")?.as_str()? {
        "thread.started" => v.get("thread_id")?.as_str()?,
        "system" => v.get("session_id")?.as_str()?,
        _ => return None,
    };
    valid_id(id).then(|| id.to_owned())
}

/// Up to [`NOTE_MAX`] bytes of a regular file, not through a link.
fn read_bounded(path: &Path) -> Option<Vec<u8>> {
    let f = crate::fsutil::open_regular(path).ok()?;
    let mut bytes = Vec::new();
    f.take(NOTE_MAX).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// The names of the regular files (not links) below `dir`, at most `depth` folders down, that
/// match; at most two are collected (one is all a caller takes).
fn collect_files(dir: &Path, matches: &dyn Fn(&str) -> bool, depth: usize, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten().take(10_000) {
        if out.len() > 1 {
            return;
        }
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let name = entry.file_name().to_string_lossy().into_owned();
        if kind.is_file() && matches(&name) {
            out.push(name);
        } else if kind.is_dir() && depth > 0 {
            collect_files(&entry.path(), matches, depth - 1, out);
        }
    }
}

/// Writes `name` in `dir` whole or not at all, durable once this returns.
fn write_durable(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_run_is_continued_only_by_the_next_attempt_of_its_task() {
        let tmp = tempfile::tempdir().unwrap();
        let state = State {
            dir: tmp.path().to_owned(),
        };
        state.make_parts().unwrap();
        assert!(state.continues(7, 2).unwrap_err().contains("names no task"));
        state.bind(7, 1).unwrap();
        assert_eq!(state.bound(), Some((7, 1)));
        assert_eq!(state.continues(7, 2), Ok(()));
        assert!(
            state
                .continues(7, 3)
                .unwrap_err()
                .contains("other attempts")
        );
        assert!(state.continues(8, 2).unwrap_err().contains("another task"));
        // A planted or mangled note is no binding.
        std::fs::write(tmp.path().join(RUN), "7 x\n").unwrap();
        assert_eq!(state.bound(), None);
        state.bind(7, 1).unwrap();
        state.clear().unwrap();
        assert_eq!(state.bound(), None, "a fresh start forgets the binding");
    }

    #[test]
    fn ids_that_could_be_options_or_paths_are_refused() {
        assert!(valid_id("0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"));
        assert!(valid_id(&new_uuid().unwrap()));
        for bad in ["", "-rf", "../x", "a b", "a/b", "a\0", &"a".repeat(129)] {
            assert!(!valid_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_session_id_is_read_from_the_stream_in_pieces() {
        let mut s = Scan::default();
        assert_eq!(s.feed(b"{\"type\":\"thread.st"), None);
        assert_eq!(
            s.feed(b"arted\",\"thread_id\":\"t-1\"}\n{}\n"),
            Some("t-1".into())
        );
        let mut s = Scan::default();
        assert_eq!(
            s.feed(b"{\"type\":\"thread.started\",\"thread_id\":\"../x\"}\n"),
            None
        );
        let mut s = Scan::default();
        let long = vec![b'x'; LINE_MAX + 10];
        assert_eq!(s.feed(&long), None);
        assert_eq!(
            s.feed(b"\n{\"type\":\"system\",\"session_id\":\"s1\"}\n"),
            Some("s1".into())
        );
    }

    #[test]
    fn a_note_of_another_cli_or_a_hostile_one_is_not_taken() {
        let tmp = tempfile::tempdir().unwrap();
        let state = State {
            dir: tmp.path().to_owned(),
        };
        state.make_parts().unwrap();
        assert!(matches!(
            state.decide(Backend::Claude),
            Decision::Lost { id: None, .. }
        ));
        state.record(Backend::Codex, "t1").unwrap();
        assert_eq!(state.recorded(Backend::Claude), None);
        assert_eq!(state.recorded(Backend::Codex).as_deref(), Some("t1"));
        assert!(matches!(
            state.decide(Backend::Codex),
            Decision::Lost { id: Some(_), .. }
        ));
        let day = state.home().join(".codex/sessions/2026/12/06");
        std::fs::create_dir_all(&day).unwrap();
        std::fs::write(day.join("rollout-2026-12-06T00-00-00-t1.jsonl"), "{}").unwrap();
        assert_eq!(
            state.decide(Backend::Codex),
            Decision::Resume { id: "t1".into() }
        );
        std::fs::write(tmp.path().join(NOTE), "codex --help\n").unwrap();
        assert_eq!(state.recorded(Backend::Codex), None);
        // No usable note: the one rollout's name gives the id only if it ends in a UUID.
        assert!(matches!(
            state.decide(Backend::Codex),
            Decision::Lost { id: None, .. }
        ));
        let uuid = "01a24d00-2695-7b61-8011-b598b1f989ff";
        std::fs::remove_file(day.join("rollout-2026-12-06T00-00-00-t1.jsonl")).unwrap();
        std::fs::write(
            day.join(format!("rollout-2026-12-06T00-00-00-{uuid}.jsonl")),
            "{}",
        )
        .unwrap();
        assert_eq!(
            state.decide(Backend::Codex),
            Decision::Resume { id: uuid.into() }
        );
        // Two rollouts: which one was this run's is not known.
        std::fs::write(
            day.join(format!("rollout-2026-12-06T00-00-01-{uuid}.jsonl")),
            "{}",
        )
        .unwrap();
        assert!(matches!(
            state.decide(Backend::Codex),
            Decision::Lost { id: None, .. }
        ));
        state.clear().unwrap();
        assert!(!day.exists() && state.home().is_dir());
        assert_eq!(state.recorded(Backend::Codex), None);
    }
}
