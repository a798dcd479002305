//! An agent run's transcript: what the CLI said while it worked (Claude Code's `stream-json`
//! lines, Codex's `--json` events, Aider's chat history, a command's stdout), kept in a file
//! beside the run (`<repos_dir>/.transcripts/<work item>/<run id>.log`, never in the store's
//! columns; the run's `data.transcript` names it), written while the run goes so the task
//! page can show it live, bounded ([`LIMIT`] bytes, the beginning kept) and with every secret
//! value orch knows replaced by `[REDACTED]` before a byte reaches the disk.
//!
//! Redaction is by value, not by pattern: a secret split across two reads is caught, because
//! the writer holds back the end of what it read while that end could be the start of a
//! secret (at most `longest secret − 1` bytes), until more arrives or the run ends.

use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};

use orch_exec::OutputSink;
use serde_json::{Value, json};

/// The most bytes of one run's transcript kept on disk.
pub(crate) const LIMIT: u64 = 2 * 1024 * 1024;
/// What a secret is replaced by.
pub(crate) const REDACTED: &[u8] = b"[REDACTED]";
/// Values shorter than this are not treated as secrets (they would blank out ordinary text).
const MIN_SECRET: usize = 6;

/// The transcript file of run `run_id` of `work_item`, relative to `repos_dir`.
pub fn relative_path(work_item: &str, run_id: i64) -> String {
    format!(".transcripts/{work_item}/{run_id}.log")
}

/// The diff file of run `run_id` of `work_item`, relative to `repos_dir`.
pub fn diff_relative_path(work_item: &str, run_id: i64) -> String {
    format!(".transcripts/{work_item}/{run_id}.diff")
}

/// One run's transcript being written. Cheap to share: the output sink holds a clone.
#[derive(Clone)]
pub(crate) struct Transcript {
    inner: Arc<Mutex<Writer>>,
    /// Relative to `repos_dir`.
    pub(crate) relative: String,
}

struct Writer {
    file: Option<std::fs::File>,
    /// Read but not yet written: a secret may continue in the next read.
    pending: Vec<u8>,
    written: u64,
    dropped: u64,
    redactions: u64,
    secrets: Vec<Vec<u8>>,
    /// The longest secret's length.
    hold: usize,
    error: Option<String>,
}

impl Transcript {
    /// Creates (or empties) the transcript file of `run_id` under `repos_dir`.
    pub(crate) fn create(
        repos_dir: &Path,
        work_item: &str,
        run_id: i64,
        secrets: &[String],
    ) -> std::io::Result<Transcript> {
        let relative = relative_path(work_item, run_id);
        let path = repos_dir.join(&relative);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = create_private(&path)?;
        let mut list: Vec<Vec<u8>> = secrets
            .iter()
            .map(|s| s.trim())
            .filter(|s| s.len() >= MIN_SECRET)
            .map(|s| s.as_bytes().to_vec())
            .collect();
        // Longest first, so a secret containing another is replaced whole.
        list.sort_by_key(|s| std::cmp::Reverse(s.len()));
        list.dedup();
        let hold = list.first().map_or(0, |s| s.len().saturating_sub(1));
        Ok(Transcript {
            inner: Arc::new(Mutex::new(Writer {
                file: Some(file),
                pending: Vec::new(),
                written: 0,
                dropped: 0,
                redactions: 0,
                secrets: list,
                hold,
                error: None,
            })),
            relative,
        })
    }

    /// A sink for a child's stdout that appends to this transcript.
    pub(crate) fn sink(&self) -> OutputSink {
        let me = self.clone();
        OutputSink(Arc::new(move |bytes: &[u8]| me.push(bytes)))
    }

    /// Appends `bytes` (redacted; past the limit, counted and dropped).
    pub(crate) fn push(&self, bytes: &[u8]) {
        let Ok(mut w) = self.inner.lock() else {
            return;
        };
        w.pending.extend_from_slice(bytes);
        w.flush(false);
    }

    /// Replaces what was written so far with `bytes` (Aider: its chat history, which says
    /// more than its console output).
    pub(crate) fn replace(&self, bytes: &[u8]) {
        let Ok(mut w) = self.inner.lock() else {
            return;
        };
        if let Some(f) = w.file.as_mut()
            && let Err(e) = f.set_len(0).and_then(|()| {
                use std::io::Seek as _;
                f.rewind()
            })
        {
            w.error = Some(e.to_string());
            return;
        }
        w.pending.clear();
        w.written = 0;
        w.dropped = 0;
        w.pending.extend_from_slice(bytes);
        w.flush(false);
    }

    /// Writes what is held back and closes the file; the run's `data.transcript`.
    pub(crate) fn finish(&self, backend: &str) -> Value {
        let Ok(mut w) = self.inner.lock() else {
            return json!({"file": self.relative, "error": "the transcript's writer panicked"});
        };
        w.flush(true);
        if w.dropped > 0 {
            let note = format!(
                "\n[orch: transcript cut at {LIMIT} bytes; {} more bytes not kept]\n",
                w.dropped
            );
            if let Some(f) = w.file.as_mut() {
                let _ = f.write_all(note.as_bytes());
            }
        }
        w.file = None;
        let mut v = json!({
            "file": self.relative,
            "format": orch_domain::transcript::format_of(backend),
            "bytes": w.written,
            "truncated": w.dropped > 0,
            "redactions": w.redactions,
        });
        if let Some(e) = &w.error {
            v["error"] = e.clone().into();
        }
        v
    }
}

impl Writer {
    /// Redacts `pending` and writes all of it (`all`) or all but what a secret split across
    /// reads could still need.
    fn flush(&mut self, all: bool) {
        if !self.secrets.is_empty() {
            let (clean, n) = redact(&self.pending, &self.secrets);
            self.pending = clean;
            self.redactions += n;
        }
        let keep = if all { 0 } else { self.secret_prefix_at_end() };
        let cut = self.pending.len() - keep;
        if cut == 0 {
            return;
        }
        let out: Vec<u8> = self.pending.drain(..cut).collect();
        let room = LIMIT.saturating_sub(self.written);
        let take = usize::try_from(room).unwrap_or(usize::MAX).min(out.len());
        self.dropped += (out.len() - take) as u64;
        if take == 0 {
            return;
        }
        if let Some(f) = self.file.as_mut() {
            match f.write_all(&out[..take]) {
                Ok(()) => self.written += take as u64,
                Err(e) => {
                    self.error = Some(e.to_string());
                    self.file = None;
                }
            }
        }
    }
}

/// Creates (or empties) `path` for orch alone (mode 0600), never through a link planted there.
pub(crate) fn create_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

impl Writer {
    /// How many bytes at the end of `pending` could be the start of a secret that the next
    /// read completes (0 mostly: only those are held back, so the file keeps up with the run).
    fn secret_prefix_at_end(&self) -> usize {
        let max = self.hold.min(self.pending.len());
        (1..=max)
            .rev()
            .find(|&k| {
                let tail = &self.pending[self.pending.len() - k..];
                self.secrets
                    .iter()
                    .any(|s| s.len() > k && s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

/// `bytes` with every occurrence of each secret replaced by [`REDACTED`], and how many were.
pub(crate) fn redact(bytes: &[u8], secrets: &[Vec<u8>]) -> (Vec<u8>, u64) {
    let mut text = bytes.to_vec();
    let mut count = 0;
    for s in secrets {
        if s.is_empty() || text.len() < s.len() {
            continue;
        }
        let mut out = Vec::with_capacity(text.len());
        let mut i = 0;
        while i < text.len() {
            if text[i..].starts_with(s) {
                out.extend_from_slice(REDACTED);
                i += s.len();
                count += 1;
            } else {
                out.push(text[i]);
                i += 1;
            }
        }
        text = out;
    }
    (text, count)
}

/// Redacts a string the same way (a diff, a chat history).
pub(crate) fn redact_text(text: &str, secrets: &[String]) -> String {
    let list: Vec<Vec<u8>> = secrets
        .iter()
        .map(|s| s.trim())
        .filter(|s| s.len() >= MIN_SECRET)
        .map(|s| s.as_bytes().to_vec())
        .collect();
    let (out, _) = redact(text.as_bytes(), &list);
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_planted_at_the_transcript_path_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let at = dir.path().join(relative_path("APP-1", 9));
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&victim, &at).unwrap();
        assert!(Transcript::create(dir.path(), "APP-1", 9, &[]).is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    }

    #[test]
    fn a_secret_split_across_reads_is_redacted_and_the_size_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let t = Transcript::create(dir.path(), "APP-1", 7, &["s3cr3t-value".into()]).unwrap();
        t.push(b"{\"text\":\"key=s3cr");
        t.push(b"3t-value and again s3cr3t-value\"}\n");
        let meta = t.finish("claude");
        let text = std::fs::read_to_string(dir.path().join(&t.relative)).unwrap();
        assert_eq!(text, "{\"text\":\"key=[REDACTED] and again [REDACTED]\"}\n");
        assert_eq!(meta["redactions"], 2);
        assert_eq!(meta["format"], "claude-stream-json");
        assert_eq!(meta["file"], ".transcripts/APP-1/7.log");

        let t = Transcript::create(dir.path(), "APP-1", 8, &[]).unwrap();
        let chunk = vec![b'x'; 1024 * 1024];
        for _ in 0..3 {
            t.push(&chunk);
        }
        let meta = t.finish("codex");
        assert_eq!(meta["truncated"], true);
        assert_eq!(meta["bytes"], LIMIT);
        let len = std::fs::metadata(dir.path().join(&t.relative))
            .unwrap()
            .len();
        assert!(len > LIMIT && len < LIMIT + 200, "{len}");
    }
}
