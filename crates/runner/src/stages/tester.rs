//! The tester (stage `verification`, agent `tester`): deterministic code, not an LLM. It runs
//! the repo's `test` command with `sh -c` in the work item's worktree under the repo's
//! `test_timeout_s` and writes `12-test-report.md` with `test_status: PASSED|FAILED`, read back
//! by the unchanged `parse_test_status` gate (design.md §3).
//!
//! A change can break the tests in any way, hanging them included, so a command that is not
//! found, is killed by a signal or runs out of time is a FAILED report with a reason that says
//! so; only `sh` itself failing to start is a transient error (`Err`, the job is retried).
//!
//! The shell-running helpers here are shared with the merge gate, which runs the same
//! verification command on the merged result.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use orch_domain::artifact::{Artifact, Frontmatter, MODEL_NOT_APPLICABLE, Value};
use orch_domain::gate::TestStatus;
use orch_domain::staging::rfc3339_utc;
use orch_exec::{Cmd, ExitKind, Output, SpawnError};

use crate::counters::Counters;
use crate::engine::{StageEffect, StageExecutor, StageRun};

/// The artifact the tester writes.
pub const TEST_REPORT: &str = "12-test-report.md";

/// The counter group of the tester: `tester {runs, passed, failed}`.
pub const COUNTER_GROUP: &str = "tester";
const COUNTER_NAMES: [&str; 3] = ["runs", "passed", "failed"];

/// Lines of command output kept in a report.
pub(crate) const TAIL_LINES: usize = 60;
/// Characters of command output kept in a report (the end is kept).
pub(crate) const TAIL_CHARS: usize = 6_000;

/// Runs the repo's test command for stage `verification`.
pub struct TesterExecutor {
    counters: Arc<Counters>,
}

impl TesterExecutor {
    /// A tester reporting to `counters` (group `tester`, declared at zero here so it shows
    /// in `GET /queue` before the first run).
    pub fn new(counters: Arc<Counters>) -> Self {
        counters.declare(COUNTER_GROUP, &COUNTER_NAMES);
        TesterExecutor { counters }
    }
}

#[async_trait::async_trait]
impl StageExecutor for TesterExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let Some(command) = configured_test(run) else {
            return Ok(StageEffect::Failed {
                reason: format!("repo {} has no test command", run.repo_name),
            });
        };
        self.counters.incr(COUNTER_GROUP, "runs");
        let result = run_test_command(run, command, run.repo.test_timeout_s)
            .await
            .with_context(|| {
                format!(
                    "verification of {} in {}",
                    run.work_item,
                    run.worktree.display()
                )
            })?;
        let report = render_test_report(run, command, &result);
        run.write_document(TEST_REPORT, &report)?;
        let counter = match result.status {
            TestStatus::Passed => "passed",
            TestStatus::Failed => "failed",
        };
        self.counters.incr(COUNTER_GROUP, counter);
        tracing::info!(
            work_item = %run.work_item,
            status = result.status.as_str(),
            reason = %result.reason,
            "verification finished"
        );
        Ok(StageEffect::Produced { outcome: None })
    }
}

/// The repo's test command, when one is configured (blank counts as none).
pub(crate) fn configured_test(run: &StageRun) -> Option<&str> {
    run.repo
        .test
        .as_deref()
        .map(str::trim)
        .filter(|c| !c.is_empty())
}

/// How one run of a test command ended.
#[derive(Debug, Clone)]
pub(crate) struct TestRun {
    /// PASSED exactly when the command exited 0.
    pub status: TestStatus,
    /// How the process ended.
    pub exit: ExitKind,
    /// One sentence saying why this status.
    pub reason: String,
    pub duration_ms: u64,
    /// The last part of its output (stdout, then stderr).
    pub tail: String,
    /// How the run was contained (`sandboxed (…)`, or `UNSANDBOXED …`).
    pub sandbox: String,
}

/// Why a test command has no result.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TestRunError {
    /// `sh` could not be started (or the worktree is missing): infrastructure, not the change.
    #[error("cannot run the test command `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: SpawnError,
    },
    /// The job's lease was lost or the process is stopping; nothing was decided.
    #[error("the test command `{command}` was cancelled (the job was stopped)")]
    Cancelled { command: String },
}

/// Runs `command` with `sh -c` in the worktree under `timeout_s` and says how it ended.
pub(crate) async fn run_test_command(
    run: &StageRun,
    command: &str,
    timeout_s: u64,
) -> Result<TestRun, TestRunError> {
    // The gate judges what is committed: files the branch does not hold (untracked, or
    // ignored ones a stage left, such as a planted `sitecustomize.py` or a stale build) are
    // removed first, so the tests cannot pass on anything else.
    run.git
        .clean_all_under(&run.worktree, &["."])
        .await
        .map_err(|e| TestRunError::Spawn {
            command: command.to_owned(),
            source: SpawnError::Io {
                program: "git clean".to_owned(),
                source: std::io::Error::other(e.to_string()),
            },
        })?;
    // The repository's code is untrusted: it runs in the repo's sandbox (`crate::contain`).
    let contained = crate::contain::for_repo_code(run, &run.worktree).map_err(|reason| {
        TestRunError::Spawn {
            command: command.to_owned(),
            source: SpawnError::Sandbox {
                program: "sh".to_owned(),
                reason,
            },
        }
    })?;
    // Below orch's priority: a test run is batch work (a staging step is not: the service it
    // may start would keep the lower priority for good).
    let cmd = contained.apply(shell_cmd(run, command, Duration::from_secs(timeout_s)).batch());
    let key = run.command_key("tests");
    let out = orch_exec::run(&cmd.supervised(key.clone()))
        .await
        .map_err(|source| TestRunError::Spawn {
            command: command.to_owned(),
            source,
        })?;
    run.note_supervision("tests", &key, &out).await;
    let note = contained.note.clone();
    drop(contained);
    let (status, reason) = match out.status {
        ExitKind::Exited(0) => (TestStatus::Passed, "the test command passed".to_owned()),
        ExitKind::Exited(127) => (
            TestStatus::Failed,
            "the test command was not found (shell exit 127): a program it runs is not installed or not on PATH".to_owned(),
        ),
        ExitKind::Exited(126) => (
            TestStatus::Failed,
            "the test command could not be executed (shell exit 126: permission denied or not an executable)".to_owned(),
        ),
        ExitKind::Exited(code) => (
            TestStatus::Failed,
            format!("the tests failed with exit code {code}"),
        ),
        ExitKind::Signaled(sig) => (
            TestStatus::Failed,
            format!("the test command was killed by signal {sig}"),
        ),
        ExitKind::TimedOut => (
            TestStatus::Failed,
            format!(
                "the test command timed out after {timeout_s} s and was killed (the change may hang the tests)"
            ),
        ),
        ExitKind::Cancelled => {
            return Err(TestRunError::Cancelled {
                command: command.to_owned(),
            });
        }
    };
    Ok(TestRun {
        status,
        exit: out.status,
        reason,
        duration_ms: duration_ms(out.duration),
        tail: output_tail(&out),
        sandbox: note,
    })
}

/// `sh -c <command>` in the worktree with the stage's `ORCH_*` environment, stopped when the
/// job is cancelled. It inherits only the allowlisted part of orch's environment and what
/// `[repos.<name>] env` names; give it a sandbox with [`crate::contain`].
pub(crate) fn shell_cmd(run: &StageRun, command: &str, timeout: Duration) -> Cmd {
    Cmd::new("sh")
        .env_allow(run.repo.env.iter().cloned())
        .arg("-c")
        .arg(command)
        .cwd(&run.worktree)
        .timeout(timeout)
        .env("ORCH_WORK_ITEM", run.work_item.as_str())
        .env("ORCH_BRANCH", &run.task.branch)
        .env("ORCH_STAGE", run.stage.name.as_str())
        .env("ORCH_WORKTREE", &run.worktree)
        .cancel_on(run.cancel.clone())
}

/// The last [`TAIL_LINES`] lines of a run's output (stdout, then stderr), at most
/// [`TAIL_CHARS`] characters, keeping the end.
pub(crate) fn output_tail(out: &Output) -> String {
    let text = out.tail_text(TAIL_LINES);
    let total = text.chars().count();
    if total <= TAIL_CHARS {
        return text;
    }
    let mut kept = String::from("…");
    kept.extend(text.chars().skip(total - TAIL_CHARS));
    kept
}

pub(crate) fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The frontmatter value of an exit: the code when the process exited, else what happened.
pub(crate) fn exit_value(exit: ExitKind) -> Value {
    match exit {
        ExitKind::Exited(code) => Value::Int(i64::from(code)),
        ExitKind::Signaled(sig) => Value::String(format!("signal {sig}")),
        ExitKind::TimedOut => Value::String("timed out".to_owned()),
        ExitKind::Cancelled => Value::String("cancelled".to_owned()),
    }
}

/// A Markdown fenced block holding `text` verbatim ([`orch_domain::text::fenced`]).
pub(crate) fn fenced(lang: &str, text: &str) -> String {
    orch_domain::text::fenced(lang, text)
}

/// The common frontmatter keys of a deterministic producer (design.md §3).
pub(crate) fn common_frontmatter(run: &StageRun, author: &str) -> Frontmatter {
    let mut fm = Frontmatter::new();
    fm.insert("work_item", run.work_item.as_str());
    fm.insert("stage", run.stage.name.as_str());
    fm.insert("author_agent", author);
    fm.insert("status", "final");
    fm.insert("created_at", rfc3339_utc(run.store.now_ms()));
    fm.insert("model_used", MODEL_NOT_APPLICABLE);
    fm
}

/// `12-test-report.md`: the common keys, `test_status`, `exit`, `duration_ms`, `command`
/// and `reason`; the body shows the command, how it ended and the tail of its output.
fn render_test_report(run: &StageRun, command: &str, r: &TestRun) -> String {
    let mut fm = common_frontmatter(run, "tester");
    fm.insert("test_status", r.status.as_str());
    fm.insert("exit", exit_value(r.exit));
    fm.insert(
        "duration_ms",
        Value::Int(i64::try_from(r.duration_ms).unwrap_or(i64::MAX)),
    );
    fm.insert("command", command);
    fm.insert("reason", r.reason.as_str());
    let body = format!(
        "\n# 12 — Test report: {id}\n\n## Summary\n\n**{status}** — {reason}\n\n\
         ## Command\n\n{command_block}\nRun with `sh -c` in the worktree `{worktree}`.\n\n\
         - exit: {exit}\n- duration: {duration}\n- timeout: {timeout} s\n- {sandbox}\n\n\
         ## Output (last {lines} lines)\n\n{output}",
        id = run.work_item,
        status = r.status.as_str(),
        reason = r.reason,
        command_block = fenced("sh", command),
        worktree = display_relative(&run.worktree, &run.repos_dir),
        exit = r.exit,
        duration = format_duration(r.duration_ms),
        timeout = run.repo.test_timeout_s,
        sandbox = r.sandbox,
        lines = TAIL_LINES,
        output = fenced("text", &r.tail),
    );
    Artifact::new(fm, body).render()
}

/// `1.234 s`, or `850 ms` under a second.
pub(crate) fn format_duration(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms} ms")
    } else {
        format!("{}.{:03} s", ms / 1_000, ms % 1_000)
    }
}

/// `path` relative to `base` when it lies inside it (the report is committed; absolute paths
/// of one machine say little on another).
pub(crate) fn display_relative(path: &Path, base: &Path) -> String {
    path.strip_prefix(base)
        .unwrap_or(path)
        .display()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_are_longer_than_backtick_runs_inside() {
        for (text, fence) in [
            ("plain", "```"),
            ("a ``` b", "````"),
            ("`````", "``````"),
            ("", "```"),
        ] {
            let block = fenced("text", text);
            assert!(block.starts_with(&format!("{fence}text\n")), "{block}");
            assert!(block.ends_with(&format!("\n{fence}\n")), "{block}");
        }
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(format_duration(850), "850 ms");
        assert_eq!(format_duration(1_234), "1.234 s");
    }
}
