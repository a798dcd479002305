//! The deterministic staging runner (seed ORCH-115, design.md §5): the `deployer` job of a task
//! whose stage is `staging` (the stage discriminator D1) runs the repo's staging steps and then
//! its smoke checks, classifies the run as SUCCESS / FAILED / TOOL_ERROR with the pure
//! `orch_domain::staging` rules, defers TOOL_ERROR a bounded number of times (D5) counted from
//! the jobs queue (D-2), and writes `15-staging-log.md` (D-3) for the unchanged
//! `parse_staging_status` gate.
//!
//! What lives where (D-1, NFR-1: no table, column or migration): the defer count is the number
//! of this task's `deployer` jobs whose `task_content` carries
//! `markers::staging_defer(stage_seq)`; the deferred job itself is enqueued by the engine from [`StageEffect::Requeue`]; the stage is
//! changed only by the engine's fenced `advance_stage`; the counters are in-process (D-4).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use orch_domain::control::markers;
use orch_domain::staging::{
    Classification, DeferPolicy, StagingDecision, StagingEnvironment, StagingLog, StagingPlan,
    StagingVerdict, StepExit, StepResult, classify, decide_after, render_staging_log,
};
use orch_exec::{ExitKind, SpawnError};
use orch_store::JobCount;

use super::tester::{duration_ms, output_tail, shell_cmd};
use crate::counters::Counters;
use crate::engine::{StageEffect, StageExecutor, StageRun};

/// The artifact the staging runner writes (D-3: name and place unchanged).
/// A step exiting with this code (EX_TEMPFAIL) reports the staging endpoint unreachable.
pub const UNREACHABLE_EXIT: i32 = 75;
/// curl's exit code for "could not connect", read as unreachable in smoke checks.
pub const CURL_COULD_NOT_CONNECT: i32 = 7;

pub const STAGING_LOG: &str = "15-staging-log.md";

/// The stage this runner handles (D1: the `deployer` job of a task in this stage).
pub const STAGE: &str = "staging";

/// The job kind whose jobs this runner handles and whose deferred jobs it counts (D-1, D-2).
pub const AGENT: &str = "deployer";

/// The counter group (D-4): `staging_runner {runs, success, failed, tool_error, deferred}`.
/// `tool_error` counts runs classified TOOL_ERROR (deferred or exhausted); `deferred` counts
/// the defers among them.
pub const COUNTER_GROUP: &str = "staging_runner";
const COUNTER_NAMES: [&str; 5] = ["runs", "success", "failed", "tool_error", "deferred"];

/// The reason written when a repo has no staging steps.
pub const NO_STEPS_REASON: &str =
    "no staging steps configured: nothing to stage, SUCCESS by configuration";

/// Runs the staging steps and smoke checks of stage `staging`.
pub struct StagingExecutor {
    counters: Arc<Counters>,
}

impl StagingExecutor {
    /// A staging runner reporting to `counters`; the `staging_runner` group is declared at
    /// zero here so `GET /queue` shows it before the first run (D-4).
    pub fn new(counters: Arc<Counters>) -> Self {
        counters.declare(COUNTER_GROUP, &COUNTER_NAMES);
        StagingExecutor { counters }
    }
}

/// One step of the plan: a staging step or a smoke check.
struct PlannedStep<'a> {
    name: &'a str,
    run: &'a str,
    timeout_s: u64,
    is_smoke: bool,
}

#[async_trait::async_trait]
impl StageExecutor for StagingExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        // D1: this code handles the deployer job only while the task is in `staging`; the
        // deploy stage's deployer job is someone else's.
        if run.task.stage != STAGE {
            return Ok(StageEffect::Failed {
                reason: format!(
                    "the staging runner got a job of {} in stage `{}`, not `{STAGE}` (D1)",
                    run.work_item, run.task.stage
                ),
            });
        }
        self.counters.incr(COUNTER_GROUP, "runs");
        let planned: Vec<PlannedStep<'_>> = run
            .repo
            .staging
            .iter()
            .map(|s| (s, false))
            .chain(run.repo.staging_smoke.iter().map(|s| (s, true)))
            .map(|(s, is_smoke)| PlannedStep {
                name: &s.name,
                run: &s.run,
                timeout_s: s.timeout_s,
                is_smoke,
            })
            .collect();
        let revision = revision(run).await;
        let environment = StagingEnvironment {
            name: STAGE.to_owned(),
            url: None,
            branch: run.task.branch.clone(),
            revision: revision.clone(),
        };

        if planned.is_empty() {
            // The choice for a repo without staging: SUCCESS, stated in the log. The domain's
            // `classify` calls an empty plan TOOL_ERROR (`no_steps`) because nothing verified
            // the change; here the configuration says there is nothing to verify, and deferring
            // would only delay the same answer until `tool_error_exhausted`.
            let c = Classification {
                verdict: StagingVerdict::Success,
                failure_kind: None,
                reason: NO_STEPS_REASON.to_owned(),
            };
            self.write_log(run, &environment, &[], &c, &StagingDecision::Success, 0)?;
            self.counters.incr(COUNTER_GROUP, "success");
            if let Some(rev) = &revision {
                crate::release::record_staged(run, rev).await;
            }
            return Ok(StageEffect::Produced { outcome: None });
        }

        let mut steps = Vec::with_capacity(planned.len());
        for step in &planned {
            let result = run_step(run, step, revision.as_deref()).await?;
            let passed = result.exit == StepExit::Exited(0);
            steps.push(result);
            if !passed {
                break; // the first step that did not pass decides; the rest never run
            }
        }
        let plan = StagingPlan {
            step_names: planned.iter().map(|s| s.name.to_owned()).collect(),
        };
        let c = classify(&steps, &plan);

        // D-2: the defer count is the number of this task's deployer jobs carrying the marker
        // of this stage visit (the running job included when it is itself a deferred one).
        let marker = markers::staging_defer(run.task.stage_seq);
        let defers = run
            .store
            .count_jobs(&JobCount {
                task_id: run.task.id,
                agent: AGENT.to_owned(),
                content_contains: Some(marker.clone()),
            })
            .await
            .with_context(|| format!("counting the staging defers of {}", run.work_item))?;
        let defers = u32::try_from(defers.max(0)).unwrap_or(u32::MAX);
        // D5: the limit comes from the repo (default 2); delays from the domain policy unless
        // the repo sets its own base delay (`staging_defer_delay_s`, cap ten times the base).
        let mut policy = DeferPolicy {
            limit: run.repo.staging_defer_limit,
            ..DeferPolicy::default()
        };
        if let Some(base) = run.repo.staging_defer_delay_s {
            policy.base_delay_s = base;
            policy.max_delay_s = base.saturating_mul(10);
        }
        let decision = decide_after(&c, defers, &policy);
        if c.verdict == StagingVerdict::ToolError {
            self.counters.incr(COUNTER_GROUP, "tool_error");
        }
        match decision {
            StagingDecision::Defer { delay_s, attempt } => {
                // No log: `staging_status` only ever says SUCCESS or FAILED (D-3).
                self.counters.incr(COUNTER_GROUP, "deferred");
                let reason = format!(
                    "staging TOOL_ERROR ({}): {}; defer {attempt} of {} in {delay_s} s",
                    c.failure_kind.as_deref().unwrap_or("tool_error"),
                    c.reason,
                    policy.limit
                );
                tracing::warn!(work_item = %run.work_item, %reason, "staging deferred");
                Ok(StageEffect::Requeue {
                    delay_ms: delay_s.saturating_mul(1000),
                    marker,
                    reason,
                })
            }
            StagingDecision::Success | StagingDecision::Failed { .. } => {
                self.write_log(run, &environment, &steps, &c, &decision, defers)?;
                let counter = if decision == StagingDecision::Success {
                    "success"
                } else {
                    "failed" // FAILED is final: never retried (design.md §5)
                };
                self.counters.incr(COUNTER_GROUP, counter);
                if decision == StagingDecision::Success
                    && let Some(rev) = &revision
                {
                    // What passed staging is what the release train may promote and deploy.
                    crate::release::record_staged(run, rev).await;
                }
                Ok(StageEffect::Produced { outcome: None })
            }
        }
    }
}

impl StagingExecutor {
    /// Writes `15-staging-log.md` for a final decision (D-3: `author_agent: staging-runner`,
    /// `model_used: n/a`, `staging_status: SUCCESS|FAILED` exactly, for the unchanged
    /// `parse_staging_status`, AC-2/AC-5, TC-04).
    fn write_log(
        &self,
        run: &StageRun,
        environment: &StagingEnvironment,
        steps: &[StepResult],
        c: &Classification,
        decision: &StagingDecision,
        defers: u32,
    ) -> anyhow::Result<()> {
        let outcome = decision
            .outcome(c)
            .context("a deferred staging run has no log to write")?;
        let doc = render_staging_log(&StagingLog {
            work_item: run.work_item.as_str(),
            created_at_ms: run.store.now_ms(),
            attempt: defers.saturating_add(1),
            environment,
            steps,
            classification: c,
            outcome: &outcome,
        });
        crate::fsutil::write_atomic(&run.artifact_path(STAGING_LOG), &doc)?;
        tracing::info!(
            work_item = %run.work_item,
            status = outcome.status.as_str(),
            failure_kind = outcome.failure_kind.as_deref().unwrap_or("none"),
            reason = %outcome.reason,
            "staging finished"
        );
        Ok(())
    }
}

/// The revision being staged: the worktree's `HEAD`. Never raises: without it the steps
/// still run (with an empty `ORCH_REVISION`) and the log shows `—`.
async fn revision(run: &StageRun) -> Option<String> {
    match run.git.rev_parse(&run.worktree, "HEAD").await {
        Ok(rev) => rev,
        Err(e) => {
            tracing::warn!(work_item = %run.work_item, error = %e, "cannot read the staged revision");
            None
        }
    }
}

/// Runs one step with `sh -c` in the worktree under its own timeout and maps how it ended to
/// the domain's [`StepExit`]. `Err` only when the job was cancelled or the process could not
/// be started for a reason that is not the step's program (the job is then retried).
async fn run_step(
    run: &StageRun,
    step: &PlannedStep<'_>,
    revision: Option<&str>,
) -> anyhow::Result<StepResult> {
    let cmd = shell_cmd(run, step.run, Duration::from_secs(step.timeout_s))
        .env("ORCH_REVISION", revision.unwrap_or_default());
    let result = |exit: StepExit, duration_ms: u64, output_tail: String| StepResult {
        name: step.name.to_owned(),
        command: step.run.to_owned(),
        exit,
        duration_ms,
        output_tail,
        is_smoke: step.is_smoke,
    };
    match orch_exec::run(&cmd).await {
        Ok(out) => {
            let exit = match out.status {
                // The staging endpoint could not be reached: infrastructure, not the change
                // (seed ORCH-115: TOOL_ERROR). A step says so with EX_TEMPFAIL (75); a smoke
                // check also with curl's "could not connect" (7).
                ExitKind::Exited(UNREACHABLE_EXIT) => StepExit::Unreachable,
                ExitKind::Exited(CURL_COULD_NOT_CONNECT) if step.is_smoke => StepExit::Unreachable,
                ExitKind::Exited(code) => StepExit::Exited(code),
                ExitKind::Signaled(sig) => StepExit::Signaled(sig),
                ExitKind::TimedOut => StepExit::TimedOut,
                ExitKind::Cancelled => anyhow::bail!(
                    "staging step `{}` of {} was cancelled (the job was stopped)",
                    step.name,
                    run.work_item
                ),
            };
            Ok(result(exit, duration_ms(out.duration), output_tail(&out)))
        }
        Err(SpawnError::NotFound { program }) => Ok(result(
            StepExit::NotFound,
            0,
            format!("cannot run {program}: not found"),
        )),
        Err(SpawnError::PermissionDenied { program }) => Ok(result(
            StepExit::PermissionDenied,
            0,
            format!("cannot run {program}: permission denied"),
        )),
        Err(e @ SpawnError::Io { .. }) => Err(anyhow::Error::new(e).context(format!(
            "staging step `{}` of {} in {}",
            step.name,
            run.work_item,
            run.worktree.display()
        ))),
    }
}
