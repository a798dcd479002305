//! The merge gate (stage `merge`, agent `merge-gate`, SPEC §6): brings the work item's branch
//! up to date with the default branch, runs the verification command on that merged result,
//! merges the branch into the default branch in the repo's main checkout (fast-forward or merge
//! commit, `merge_strategy`) and pushes it when the repo has a remote. It writes
//! `14-merge-log.md` with `merge_status: MERGED|CONFLICT|FAILED` into the worktree; the engine
//! commits it on `orch/<id>` after the merge, so the trail lives on the work item's branch.
//!
//! Serialization. Merges into one repo never overlap:
//! - within the process, a per-repo `tokio::sync::Mutex` (a static registry keyed by the
//!   canonical `repo_dir`) queues them;
//! - across processes on one machine (several `orch worker`s sharing a `repos_dir`), a lock
//!   file `<repo_dir>/.git/orch-merge.lock` created with `O_EXCL` is held for the whole merge
//!   and removed after; a lock older than [`STALE_LOCK_AFTER`] is the leftover of a killed
//!   process and is broken with a warning; a fresh one held by another process is
//!   contention, retried later like any infrastructure error;
//! - across machines (each with its own `repos_dir`), the remote is the serialization point:
//!   a push that lost the race is rejected, the local default branch is put back where the
//!   remote has it, and the retry fetches and brings the branch up to date again.
//!
//! Infrastructure errors (git failing to run, a failed fetch or push, lock contention) are
//! retried a bounded number of times, counted from the jobs queue exactly like the staging
//! defers (seed ORCH-115 D-2: restart-safe, no column): each retry is a fresh `merge-gate` job
//! carrying [`infra_retry_marker`]`(stage_seq)`; past [`INFRA_RETRY_LIMIT`] the result is
//! `FAILED` with `failure_kind: infra_exhausted`.
//!
//! Restart safety: when the branch head is already contained in the default branch (a crash
//! after the merge, before the stage changed), the result is MERGED without merging again.
//! With a remote, `origin/<default>` is the truth: a local default branch that diverged from
//! it (an unpushed merge of a crashed attempt) is reset to it, and that attempt's own retry
//! merges again.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, PoisonError};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use orch_domain::artifact::{Artifact, Value};
use orch_domain::config::MergeStrategy as RepoMergeStrategy;
use orch_domain::config::RepoConfig;
use orch_domain::gate::{MergeStatus, TestStatus};
use orch_exec::{Git, MergeResult, MergeStrategy};
use orch_store::JobCount;

use super::tester::{
    TestRun, TestRunError, common_frontmatter, configured_test, fenced, format_duration,
    run_test_command,
};
use crate::counters::Counters;
use crate::engine::{StageEffect, StageExecutor, StageRun};
use crate::repos;

/// The artifact the merge gate writes.
pub const MERGE_LOG: &str = "14-merge-log.md";

/// The job kind of the merge gate, whose retry jobs are counted.
pub const AGENT: &str = "merge-gate";

/// The counter group: `merge_gate {runs, merged, conflict, failed, infra_retry}`.
pub const COUNTER_GROUP: &str = "merge_gate";
const COUNTER_NAMES: [&str; 5] = ["runs", "merged", "conflict", "failed", "infra_retry"];

/// Infrastructure retries allowed per merge visit; the infrastructure error after the last one
/// is `FAILED` / `infra_exhausted`.
pub const INFRA_RETRY_LIMIT: u32 = 3;

/// The lock file (in the main checkout's `.git`) that serializes merges across processes.
pub const MERGE_LOCK_FILE: &str = "orch-merge.lock";

/// A merge lock older than this is a leftover of a killed process and is broken.
pub const STALE_LOCK_AFTER: Duration = Duration::from_secs(10 * 60);

/// The remote fetched from and pushed to.
const REMOTE: &str = "origin";

/// The marker a retry job of the merge gate carries in its `task_content`: the retry count of
/// a merge visit is the number of that task's `merge-gate` jobs containing it (the D-2 scheme
/// of the staging defers). Scoped to the stage visit by `stage_seq`; the closing `]` keeps
/// `seq=1]` from matching inside `seq=12]`.
pub fn infra_retry_marker(stage_seq: i64) -> String {
    format!("[orch:merge-infra-retry seq={stage_seq}]")
}

/// The delay before retry number `attempt` (1-based): 30 s, 60 s, 120 s, … at most 300 s.
pub fn infra_retry_delay_s(attempt: u32) -> u64 {
    let exp = attempt.clamp(1, 16) - 1;
    30_u64.saturating_mul(1_u64 << exp).min(300)
}

/// Merges work item branches into their repo's default branch for stage `merge`.
pub struct MergeGateExecutor {
    counters: Arc<Counters>,
}

impl MergeGateExecutor {
    /// A merge gate reporting to `counters` (group `merge_gate`, declared at zero here).
    pub fn new(counters: Arc<Counters>) -> Self {
        counters.declare(COUNTER_GROUP, &COUNTER_NAMES);
        MergeGateExecutor { counters }
    }
}

/// The result written to `14-merge-log.md`.
#[derive(Debug)]
struct MergeReport {
    status: MergeStatus,
    merged_revision: Option<String>,
    conflicts: Vec<String>,
    failure_kind: Option<&'static str>,
    reason: String,
    verification: Option<(String, TestRun)>,
}

impl MergeReport {
    fn merged(revision: String, reason: String) -> MergeReport {
        MergeReport {
            status: MergeStatus::Merged,
            merged_revision: Some(revision),
            conflicts: Vec::new(),
            failure_kind: None,
            reason,
            verification: None,
        }
    }

    fn conflict(files: Vec<String>, reason: String) -> MergeReport {
        MergeReport {
            status: MergeStatus::Conflict,
            merged_revision: None,
            conflicts: files,
            failure_kind: Some("conflict"),
            reason,
            verification: None,
        }
    }

    fn failed(kind: &'static str, reason: String) -> MergeReport {
        MergeReport {
            status: MergeStatus::Failed,
            merged_revision: None,
            conflicts: Vec::new(),
            failure_kind: Some(kind),
            reason,
            verification: None,
        }
    }
}

/// Why an attempt ended without a verdict.
#[derive(Debug)]
enum Interrupted {
    /// Infrastructure: retried a bounded number of times.
    Infra(String),
    /// The job was cancelled (lease lost, hard stop): nothing decided, the engine retries.
    Stopped(anyhow::Error),
}

fn infra(what: impl std::fmt::Display, e: impl std::fmt::Display) -> Interrupted {
    Interrupted::Infra(format!("{what}: {e}"))
}

/// What an attempt did, in order, for the log's Steps section.
#[derive(Debug, Default)]
struct Trail(Vec<String>);

impl Trail {
    fn push(&mut self, step: impl Into<String>) {
        self.0.push(step.into());
    }
}

#[async_trait::async_trait]
impl StageExecutor for MergeGateExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        self.counters.incr(COUNTER_GROUP, "runs");
        let mut trail = Trail::default();
        let result = serialized(run, &mut trail).await;
        let report = match result {
            Ok(report) => report,
            Err(Interrupted::Stopped(e)) => return Err(e),
            Err(Interrupted::Infra(reason)) => {
                let marker = infra_retry_marker(run.task.stage_seq);
                let so_far = run
                    .store
                    .count_jobs(&JobCount {
                        task_id: run.task.id,
                        agent: AGENT.to_owned(),
                        content_contains: Some(marker.clone()),
                    })
                    .await
                    .with_context(|| format!("counting the merge retries of {}", run.work_item))?;
                let so_far = u32::try_from(so_far.max(0)).unwrap_or(u32::MAX);
                if so_far < INFRA_RETRY_LIMIT {
                    let attempt = so_far + 1;
                    let delay_s = infra_retry_delay_s(attempt);
                    self.counters.incr(COUNTER_GROUP, "infra_retry");
                    let reason = format!(
                        "merge infrastructure error: {reason}; retry {attempt} of {INFRA_RETRY_LIMIT} in {delay_s} s"
                    );
                    tracing::warn!(work_item = %run.work_item, %reason, "merge deferred");
                    return Ok(StageEffect::Requeue {
                        delay_s,
                        marker,
                        reason,
                    });
                }
                trail.push(format!("infrastructure error: {reason}"));
                MergeReport::failed(
                    "infra_exhausted",
                    format!(
                        "infrastructure errors persisted after {so_far} retries (limit {INFRA_RETRY_LIMIT}): {reason}"
                    ),
                )
            }
        };
        let so_far = count_retries(run).await;
        let doc = render_merge_log(run, &report, &trail, so_far);
        crate::fsutil::write_atomic(&run.artifact_path(MERGE_LOG), &doc)?;
        let counter = match report.status {
            MergeStatus::Merged => "merged",
            MergeStatus::Conflict => "conflict",
            MergeStatus::Failed => "failed",
        };
        self.counters.incr(COUNTER_GROUP, counter);
        tracing::info!(
            work_item = %run.work_item,
            status = report.status.as_str(),
            reason = %report.reason,
            "merge gate finished"
        );
        Ok(StageEffect::Produced { outcome: None })
    }
}

/// Never-raise: the retries this merge visit had so far, for the log (0 when the queue
/// cannot be read; the log is informational there).
async fn count_retries(run: &StageRun) -> u32 {
    let q = JobCount {
        task_id: run.task.id,
        agent: AGENT.to_owned(),
        content_contains: Some(infra_retry_marker(run.task.stage_seq)),
    };
    match run.store.count_jobs(&q).await {
        Ok(n) => u32::try_from(n.max(0)).unwrap_or(u32::MAX),
        Err(e) => {
            tracing::warn!(work_item = %run.work_item, error = %e, "cannot count the merge retries for the log");
            0
        }
    }
}

/// Takes the repo's in-process mutex and its cross-process lock file, then merges.
async fn serialized(run: &StageRun, trail: &mut Trail) -> Result<MergeReport, Interrupted> {
    let mutex = repo_mutex(&run.repo_dir);
    let _in_process = tokio::select! {
        guard = mutex.lock_owned() => guard,
        () = run.cancel.cancelled() => {
            return Err(Interrupted::Stopped(anyhow::anyhow!(
                "cancelled while waiting for the merge lock of {}", run.repo_dir.display()
            )));
        }
    };
    let holder = format!(
        "pid={} node={} work_item={} job={}",
        std::process::id(),
        run.node,
        run.work_item,
        run.job.id
    );
    let _file = LockFile::acquire(&run.repo_dir, &holder).map_err(Interrupted::Infra)?;
    merge(run, trail).await
}

/// The in-process mutex of the repo at `repo_dir`.
fn repo_mutex(repo_dir: &Path) -> Arc<tokio::sync::Mutex<()>> {
    type Registry = std::sync::Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>;
    static LOCKS: OnceLock<Registry> = OnceLock::new();
    let key = std::fs::canonicalize(repo_dir).unwrap_or_else(|_| repo_dir.to_path_buf());
    let mut map = LOCKS
        .get_or_init(Registry::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    map.entry(key).or_default().clone()
}

/// The cross-process merge lock: a file created with `O_EXCL`, removed on drop, broken when
/// older than [`STALE_LOCK_AFTER`]. Also taken by the lessons stage for its default-branch commit.
pub(crate) struct LockFile {
    path: PathBuf,
}

impl LockFile {
    /// Takes the lock, or says who holds it (never waits).
    pub(crate) fn acquire(repo_dir: &Path, holder: &str) -> Result<LockFile, String> {
        let path = repo_dir.join(".git").join(MERGE_LOCK_FILE);
        // Two tries: the second follows breaking a stale lock.
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    if let Err(e) = writeln!(file, "{holder}") {
                        tracing::warn!(path = %path.display(), error = %e, "cannot write the holder into the merge lock; it still locks");
                    }
                    return Ok(LockFile { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let age = match std::fs::metadata(&path).and_then(|m| m.modified()) {
                        Ok(modified) => SystemTime::now()
                            .duration_since(modified)
                            .unwrap_or(Duration::ZERO),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(e) => {
                            return Err(format!(
                                "cannot read the age of the merge lock {}: {e}",
                                path.display()
                            ));
                        }
                    };
                    let held_by = std::fs::read_to_string(&path).unwrap_or_default();
                    let held_by = held_by.trim();
                    if age < STALE_LOCK_AFTER {
                        return Err(format!(
                            "the merge lock {} is held ({}, {} s old)",
                            path.display(),
                            if held_by.is_empty() {
                                "holder unknown"
                            } else {
                                held_by
                            },
                            age.as_secs()
                        ));
                    }
                    tracing::warn!(
                        path = %path.display(),
                        held_by,
                        age_s = age.as_secs(),
                        "breaking a stale merge lock (its process is presumed dead)"
                    );
                    match std::fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => {
                            return Err(format!(
                                "cannot break the stale merge lock {}: {e}",
                                path.display()
                            ));
                        }
                    }
                }
                Err(e) => {
                    return Err(format!(
                        "cannot create the merge lock {}: {e}",
                        path.display()
                    ));
                }
            }
        }
        Err(format!(
            "the merge lock {} was taken again right after a stale one was broken",
            path.display()
        ))
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the merge lock; it will be broken as stale later");
        }
    }
}

/// The merge itself, under both locks.
async fn merge(run: &StageRun, trail: &mut Trail) -> Result<MergeReport, Interrupted> {
    let git = &run.git;
    let repo_dir = &run.repo_dir;
    let default = run.repo.default_branch.as_str();
    let branch = run.task.branch.as_str();

    match git.current_branch(repo_dir).await {
        Ok(Some(b)) if b == default => {}
        Ok(other) => {
            return Err(Interrupted::Infra(format!(
                "the main checkout {} is on {}, not on the default branch `{default}`",
                repo_dir.display(),
                other.map_or("a detached HEAD".to_owned(), |b| format!("`{b}`"))
            )));
        }
        Err(e) => return Err(infra("reading the main checkout's branch", e)),
    }

    // 1. The default branch as the remote has it.
    let remote = git
        .has_remote(repo_dir, REMOTE)
        .await
        .map_err(|e| infra("listing remotes", e))?;
    if remote {
        git.fetch(repo_dir, REMOTE)
            .await
            .map_err(|e| infra(format!("fetching {REMOTE}"), e))?;
        trail.push(format!("fetched `{REMOTE}`"));
        sync_default_with_remote(git, repo_dir, default, trail).await?;
    }

    // 2. Already merged (a crash after the merge): report it, never merge twice.
    let head = rev(git, &run.worktree, "HEAD").await?;
    if git
        .is_ancestor(repo_dir, &head, default)
        .await
        .map_err(|e| Interrupted::Infra(e.to_string()))?
    {
        let revision = rev(git, repo_dir, default).await?;
        if remote {
            push(git, repo_dir, &run.repo, &revision, None, trail).await?;
        }
        trail.push(format!(
            "`{branch}` ({}) is already contained in `{default}`: not merged again",
            short(&head)
        ));
        return Ok(MergeReport::merged(
            revision.clone(),
            format!(
                "`{branch}` was already merged into `{default}` (at {}); not merged again",
                short(&revision)
            ),
        ));
    }

    // 3. Bring the branch up to date with the default branch.
    match git.rebase_or_merge_default(&run.worktree, default).await {
        Ok(MergeResult::Merged { sha }) if sha == head => {
            trail.push(format!("`{branch}` is up to date with `{default}`"));
        }
        Ok(MergeResult::Merged { sha }) => {
            trail.push(format!(
                "merged `{default}` into `{branch}`: {} → {}",
                short(&head),
                short(&sha)
            ));
        }
        Ok(MergeResult::Conflict { files }) => {
            trail.push(format!(
                "bringing `{branch}` up to date with `{default}` conflicted; the merge was aborted"
            ));
            let reason = format!(
                "`{branch}` conflicts with `{default}` in {} file(s): {}",
                files.len(),
                files.join(", ")
            );
            return Ok(MergeReport::conflict(files, reason));
        }
        Ok(MergeResult::NotFastForward) => {
            return Err(Interrupted::Infra(format!(
                "updating `{branch}` with `{default}` reported a non-fast-forward"
            )));
        }
        Err(e) => return Err(infra(format!("updating `{branch}` with `{default}`"), e)),
    }

    // 4. Verify the merged result.
    let verification = match configured_test(run) {
        None => {
            trail.push("no test command configured: verification skipped");
            None
        }
        Some(command) => match run_test_command(run, command, run.repo.test_timeout_s).await {
            Ok(r) if r.status == TestStatus::Passed => {
                trail.push(format!(
                    "verification passed on the updated branch ({})",
                    format_duration(r.duration_ms)
                ));
                Some((command.to_owned(), r))
            }
            Ok(r) => {
                trail.push(format!(
                    "verification failed on the updated branch: {}",
                    r.reason
                ));
                let mut report = MergeReport::failed(
                    "verification_failed",
                    format!(
                        "verification failed on `{branch}` brought up to date with `{default}`: {}",
                        r.reason
                    ),
                );
                report.verification = Some((command.to_owned(), r));
                return Ok(report);
            }
            Err(e @ TestRunError::Spawn { .. }) => {
                return Err(Interrupted::Infra(format!("verification: {e}")));
            }
            Err(e @ TestRunError::Cancelled { .. }) => {
                return Err(Interrupted::Stopped(anyhow::Error::new(e)));
            }
        },
    };

    // 5. Merge into the default branch in the main checkout.
    let before = rev(git, repo_dir, default).await?;
    let (strategy, label) = match run.repo.merge_strategy {
        RepoMergeStrategy::Ff => (MergeStrategy::FastForwardOnly, "fast-forward"),
        RepoMergeStrategy::Merge => (MergeStrategy::MergeCommit, "merge commit"),
    };
    let merged = match git.merge(repo_dir, branch, strategy).await {
        Ok(MergeResult::Merged { sha }) => sha,
        Ok(MergeResult::Conflict { files }) => {
            trail.push(format!(
                "merging `{branch}` into `{default}` conflicted; the merge was aborted"
            ));
            let reason = format!(
                "merging `{branch}` into `{default}` conflicts in {} file(s): {}",
                files.len(),
                files.join(", ")
            );
            let mut report = MergeReport::conflict(files, reason);
            report.verification = verification;
            return Ok(report);
        }
        Ok(MergeResult::NotFastForward) => {
            return Err(Interrupted::Infra(format!(
                "`{default}` moved while `{branch}` was verified: not a fast-forward"
            )));
        }
        Err(e) => return Err(infra(format!("merging `{branch}` into `{default}`"), e)),
    };
    trail.push(format!(
        "merged `{branch}` into `{default}` ({label}): {} → {}",
        short(&before),
        short(&merged)
    ));

    // 6. Publish.
    if remote {
        push(git, repo_dir, &run.repo, &merged, Some(&before), trail).await?;
    }
    let mut report = MergeReport::merged(
        merged.clone(),
        format!(
            "merged `{branch}` into `{default}` as {} ({label})",
            short(&merged)
        ),
    );
    report.verification = verification;
    Ok(report)
}

/// Makes the local default branch contain `origin/<default>`; when they diverged (an
/// unpushed merge of a crashed attempt), the remote wins and the local branch is reset to it.
async fn sync_default_with_remote(
    git: &Git,
    repo_dir: &Path,
    default: &str,
    trail: &mut Trail,
) -> Result<(), Interrupted> {
    let upstream = format!("{REMOTE}/{default}");
    let known = git
        .rev_parse(repo_dir, &format!("refs/remotes/{upstream}"))
        .await
        .map_err(|e| infra(format!("reading `{upstream}`"), e))?;
    if known.is_none() {
        trail.push(format!("`{upstream}` does not exist yet"));
        return Ok(());
    }
    match git
        .merge(repo_dir, &upstream, MergeStrategy::FastForwardOnly)
        .await
    {
        Ok(MergeResult::Merged { sha }) => {
            trail.push(format!(
                "`{default}` contains `{upstream}` (at {})",
                short(&sha)
            ));
            Ok(())
        }
        Ok(MergeResult::NotFastForward | MergeResult::Conflict { .. }) => {
            tracing::warn!(
                repo = %repo_dir.display(),
                "the local `{default}` diverged from `{upstream}`; resetting it to the remote (unpushed merges are redone by their own retries)"
            );
            git.reset_hard(repo_dir, &upstream)
                .await
                .map_err(|e| infra(format!("resetting `{default}` to `{upstream}`"), e))?;
            trail.push(format!(
                "`{default}` had diverged from `{upstream}`: reset to the remote"
            ));
            Ok(())
        }
        Err(e) => Err(infra(format!("updating `{default}` from `{upstream}`"), e)),
    }
}

/// Publishes the default branch at `new` with [`repos::publish_default_branch`], from where
/// `origin` had it at the last fetch (a compare-and-swap). When it fails after this attempt
/// merged (`undo` is the revision before the merge), the local branch is put back so it never
/// holds a merge the remote refused; the retry merges again.
async fn push(
    git: &Git,
    repo_dir: &Path,
    repo: &RepoConfig,
    new: &str,
    undo: Option<&str>,
    trail: &mut Trail,
) -> Result<(), Interrupted> {
    let default = repo.default_branch.as_str();
    let old = git
        .rev_parse(repo_dir, &format!("refs/remotes/{REMOTE}/{default}"))
        .await
        .map_err(|e| infra(format!("reading `{REMOTE}/{default}`"), e))?
        .unwrap_or_default();
    match repos::publish_default_branch(git, repo_dir, repo, &old, new).await {
        Ok(published) => {
            if let Some(warning) = published.warning() {
                tracing::warn!(repo = %repo_dir.display(), "{warning}");
            }
            trail.push(published.message);
            Ok(())
        }
        Err(e) => {
            if let Some(before) = undo
                && let Err(reset) = git.reset_hard(repo_dir, before).await
            {
                tracing::warn!(repo = %repo_dir.display(), error = %reset, "cannot undo the unpublished merge; the next attempt resets to the remote");
            }
            Err(infra(
                format!("publishing `{default}` to `{REMOTE}`"),
                format!("{e:#}"),
            ))
        }
    }
}

/// The object id `name` resolves to; a missing one is an infrastructure error.
async fn rev(git: &Git, dir: &Path, name: &str) -> Result<String, Interrupted> {
    match git.rev_parse(dir, name).await {
        Ok(Some(sha)) => Ok(sha),
        Ok(None) => Err(Interrupted::Infra(format!(
            "`{name}` does not resolve in {}",
            dir.display()
        ))),
        Err(e) => Err(infra(format!("resolving `{name}`"), e)),
    }
}

/// The first 12 characters of an object id.
fn short(sha: &str) -> &str {
    sha.get(..12).unwrap_or(sha)
}

/// `14-merge-log.md`: the common keys, `merge_status`, `merged_revision` (`none` without
/// one), `strategy` (`ff` / `merge`), `conflicts` (a list), `failure_kind` (`none` when
/// merged), `reason` and `infra_retries`; the body shows the steps taken, the conflicts and
/// the verification run.
fn render_merge_log(run: &StageRun, r: &MergeReport, trail: &Trail, retries: u32) -> String {
    let strategy = match run.repo.merge_strategy {
        RepoMergeStrategy::Ff => "ff",
        RepoMergeStrategy::Merge => "merge",
    };
    let mut fm = common_frontmatter(run, AGENT);
    fm.insert("merge_status", r.status.as_str());
    fm.insert(
        "merged_revision",
        r.merged_revision.as_deref().unwrap_or("none"),
    );
    fm.insert("strategy", strategy);
    fm.insert(
        "conflicts",
        Value::Seq(r.conflicts.iter().cloned().map(Value::String).collect()),
    );
    fm.insert("failure_kind", r.failure_kind.unwrap_or("none"));
    fm.insert("reason", r.reason.as_str());
    fm.insert("infra_retries", retries);

    let mut body = format!(
        "\n# 14 — Merge log: {}\n\n## Summary\n\n**{}** — {}\n\n## Merge\n\n| key | value |\n|---|---|\n",
        run.work_item,
        r.status.as_str(),
        one_line(&r.reason)
    );
    for (key, value) in [
        ("branch", run.task.branch.as_str()),
        ("default branch", run.repo.default_branch.as_str()),
        ("strategy", strategy),
        (
            "merged revision",
            r.merged_revision.as_deref().unwrap_or("—"),
        ),
        ("infra retries so far", &retries.to_string()),
    ] {
        let _ = writeln!(body, "| {key} | `{value}` |");
    }
    body.push_str("\n## Steps\n\n");
    if trail.0.is_empty() {
        body.push_str("(no step completed)\n");
    }
    for (i, step) in trail.0.iter().enumerate() {
        let _ = writeln!(body, "{}. {}", i + 1, one_line(step));
    }
    body.push_str("\n## Conflicts\n\n");
    if r.conflicts.is_empty() {
        body.push_str("none\n");
    }
    for file in &r.conflicts {
        let _ = writeln!(body, "- `{}`", file.replace('`', "'"));
    }
    body.push_str("\n## Verification\n\n");
    match &r.verification {
        None => body.push_str("not run\n"),
        Some((command, t)) => {
            let _ = write!(
                body,
                "{}\n- test_status: `{}`\n- exit: {}\n- duration: {}\n- reason: {}\n\n{}",
                fenced("sh", command),
                t.status.as_str(),
                t.exit,
                format_duration(t.duration_ms),
                one_line(&t.reason),
                fenced("text", &t.tail)
            );
        }
    }
    Artifact::new(fm, body).render()
}

/// Text collapsed to one Markdown line.
fn one_line(s: &str) -> String {
    s.split(['\n', '\r'])
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_markers_and_delays() {
        assert_eq!(infra_retry_marker(7), "[orch:merge-infra-retry seq=7]");
        assert!(!infra_retry_marker(12).contains(&infra_retry_marker(1)));
        let delays: Vec<u64> = (1..=6).map(infra_retry_delay_s).collect();
        assert_eq!(delays, [30, 60, 120, 240, 300, 300]);
        assert_eq!(infra_retry_delay_s(0), 30);
        assert_eq!(infra_retry_delay_s(u32::MAX), 300);
    }
}
