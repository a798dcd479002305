//! The merge gate (stage `merge`, agent `merge-gate`): builds the release **candidate** — the
//! work item's branch brought up to date with the default branch — and runs the verification
//! command on it. It writes `14-merge-log.md` with `merge_status: MERGED|CONFLICT|FAILED` into
//! the worktree; the engine commits it on `orch/<id>`, and that commit is what staging stages.
//!
//! The default branch does not move here: it is moved to exactly the commit that passed
//! staging when the deploy stage promotes it ([`crate::release`]). `MERGED` means "merged with
//! the default branch into a verified candidate". Merges of one repo never overlap because the
//! stage is on the repo's release track (one task at a time, held in the database), so no lock
//! file is needed and a dead process holds nothing.
//!
//! Infrastructure errors (git failing to run, a failed fetch) are retried a bounded number of
//! times, counted from the jobs queue exactly like the staging defers (seed ORCH-115 D-2:
//! restart-safe, no column): each retry is a fresh `merge-gate` job carrying
//! `markers::merge_infra_retry(stage_seq)`; past [`INFRA_RETRY_LIMIT`] the result is `FAILED` with
//! `failure_kind: infra_exhausted`.
//!
//! Restart safety: the candidate is rebuilt from the committed branch on every attempt; a
//! branch already contained in the default branch is reported MERGED without building anything.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use orch_domain::artifact::{Artifact, Value};
use orch_domain::config::MergeStrategy as RepoMergeStrategy;
use orch_domain::control::markers;
use orch_domain::gate::{MergeStatus, TestStatus};
use orch_domain::text::one_line;
use orch_exec::{Git, MergeResult};
use orch_store::JobCount;

use super::tester::{
    TestRun, TestRunError, common_frontmatter, configured_test, fenced, format_duration,
    run_test_command,
};
use crate::counters::Counters;
use crate::engine::{StageEffect, StageExecutor, StageRun};

/// The artifact the merge gate writes.
pub const MERGE_LOG: &str = "14-merge-log.md";

/// The job kind of the merge gate, whose retry jobs are counted.
pub const AGENT: &str = "merge-gate";

/// The counter group: `merge_gate {runs, merged, conflict, failed, infra_retry}`.
pub const COUNTER_GROUP: &str = "merge_gate";
const COUNTER_NAMES: [&str; 5] = ["runs", "merged", "conflict", "failed", "infra_retry"];

/// Infrastructure retries allowed per merge visit; the infrastructure error after the last one
/// is `FAILED` / `infra_exhausted`. The retries so far are this task's `merge-gate` jobs whose
/// content carries `markers::merge_infra_retry(stage_seq)` (the D-2 scheme of the staging
/// defers).
pub const INFRA_RETRY_LIMIT: u32 = 3;

/// The delay before retry number `attempt` (1-based): 30 s, 60 s, 120 s, … at most 300 s.
pub fn infra_retry_delay_s(attempt: u32) -> u64 {
    let exp = attempt.clamp(1, 16) - 1;
    30_u64.saturating_mul(1_u64 << exp).min(300)
}

/// Builds and verifies the release candidate of stage `merge` (the default branch does not move).
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
        let result = merge(run, &mut trail).await;
        let report = match result {
            Ok(report) => report,
            Err(Interrupted::Stopped(e)) => return Err(e),
            Err(Interrupted::Infra(reason)) => {
                let marker = markers::merge_infra_retry(run.task.stage_seq);
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
                        delay_ms: delay_s.saturating_mul(1000),
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
        run.write_document(MERGE_LOG, &doc)?;
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
        content_contains: Some(markers::merge_infra_retry(run.task.stage_seq)),
    };
    match run.store.count_jobs(&q).await {
        Ok(n) => u32::try_from(n.max(0)).unwrap_or(u32::MAX),
        Err(e) => {
            tracing::warn!(work_item = %run.work_item, error = %e, "cannot count the merge retries for the log");
            0
        }
    }
}

/// Builds and verifies the candidate.
async fn merge(run: &StageRun, trail: &mut Trail) -> Result<MergeReport, Interrupted> {
    let git = &run.git;
    let repo_dir = &run.repo_dir;
    let default = run.repo.default_branch.as_str();
    let branch = run.task.branch.as_str();

    // 1. The default branch as the remote has it (the remote is the truth).
    let main = crate::repos::sync_default_branch(git, repo_dir, &run.repo)
        .await
        .map_err(|e| infra(format!("reading `{default}`"), format!("{e:#}")))?;
    trail.push(format!("`{default}` is at {}", short(&main)));

    // 2. Already merged (a crash after a promotion): report it, never merge twice.
    let head = rev(git, &run.worktree, "HEAD").await?;
    if git
        .is_ancestor(repo_dir, &head, &main)
        .await
        .map_err(|e| Interrupted::Infra(e.to_string()))?
    {
        // Contained because it was released and then reverted: merging "nothing" would
        // stage and ship the old commit again, without the revert.
        let reverted = git
            .commit_messages(repo_dir, &format!("{head}..{main}"))
            .await
            .map_err(|e| infra("reading the default branch's history", e))?
            .iter()
            .any(|(_, m)| m.contains(&format!("Orch-Revert: {}", run.work_item)));
        if reverted {
            trail.push(format!(
                "`{branch}` was released and then reverted on `{default}`"
            ));
            return Ok(MergeReport::failed(
                "reverted",
                format!(
                    "{}'s change was reverted on `{default}`; it is not merged again (revert the revert by hand, or submit a new item)",
                    run.work_item
                ),
            ));
        }
        trail.push(format!(
            "`{branch}` ({}) is already contained in `{default}`: nothing to merge",
            short(&head)
        ));
        return Ok(MergeReport::merged(
            head.clone(),
            format!(
                "`{branch}` is already contained in `{default}` (at {}); nothing to merge",
                short(&main)
            ),
        ));
    }

    // 3. The candidate: the branch brought up to date with the default branch, or, with the
    //    `merge` strategy, a merge commit of the branch on top of the default branch (so the
    //    default branch's first-parent history gets one merge commit per item).
    let updated = match run.repo.merge_strategy {
        RepoMergeStrategy::Ff => git.rebase_or_merge_default(&run.worktree, &main).await,
        RepoMergeStrategy::Merge => {
            let message = format!(
                "Merge {} onto `{default}`\n\nWork-Item: {}\nStage: merge\n",
                run.work_item, run.work_item
            );
            merge_commit_candidate(git, &run.worktree, &main, &head, &message).await
        }
    };
    match updated {
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
    let candidate = rev(git, &run.worktree, "HEAD").await?;

    // 4. Verify the candidate.
    let verification = match configured_test(run) {
        None => {
            trail.push("no test command configured: verification skipped");
            None
        }
        Some(command) => match run_test_command(run, command, run.repo.test_timeout_s).await {
            Ok(r) if r.status == TestStatus::Passed => {
                trail.push(format!(
                    "verification passed on the candidate ({})",
                    format_duration(r.duration_ms)
                ));
                Some((command.to_owned(), r))
            }
            Ok(r) => {
                trail.push(format!(
                    "verification failed on the candidate: {}",
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
    trail.push(format!(
        "candidate {} ready for staging; `{default}` moves to the staged commit when it is promoted for the deploy",
        short(&candidate)
    ));
    let mut report = MergeReport::merged(
        candidate.clone(),
        format!(
            "`{branch}` merged with `{default}` ({}) into the verified candidate {}",
            short(&main),
            short(&candidate)
        ),
    );
    report.verification = verification;
    Ok(report)
}

/// The `merge` strategy's candidate: a merge commit of the branch's `head` on top of `main`
/// (first parent `main`), built without a working tree; the branch then moves to it in one
/// step. A branch that already is such a merge on `main` is its own candidate.
async fn merge_commit_candidate(
    git: &Git,
    worktree: &Path,
    main: &str,
    head: &str,
    message: &str,
) -> Result<MergeResult, orch_exec::GitError> {
    let first_parent = git.rev_parse(worktree, &format!("{head}^1")).await?;
    let second_parent = git.rev_parse(worktree, &format!("{head}^2")).await?;
    if second_parent.is_some() && first_parent.as_deref() == Some(main) {
        // Already the candidate (a rebuild after a crash or a retry): no merge on a merge.
        return Ok(MergeResult::Merged {
            sha: head.to_owned(),
        });
    }
    let merged = git.merge_commit_onto(worktree, main, head, message).await?;
    if let MergeResult::Merged { sha } = &merged {
        git.reset_hard(worktree, sha).await?;
    }
    Ok(merged)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays() {
        let delays: Vec<u64> = (1..=6).map(infra_retry_delay_s).collect();
        assert_eq!(delays, [30, 60, 120, 240, 300, 300]);
        assert_eq!(infra_retry_delay_s(0), 30);
        assert_eq!(infra_retry_delay_s(u32::MAX), 300);
    }
}
