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
//!
//! Infrastructure or the change? The runner tells them apart by looking, not by exit codes:
//! with `staging_health_url` set it looks at the staging environment itself before the smoke
//! checks (nothing answers: the smoke checks do not run, TOOL_ERROR `unreachable`) and again
//! after a step that failed in a way an unreachable host also explains — a smoke check that
//! failed or timed out, a step exiting 255 (ssh's own error) or 7 (curl's "could not
//! connect") — where no answer (refused, DNS, timeout) is `unreachable` and any answer leaves
//! the failure the change's. What it saw is in the log's Summary. The conventions that remain
//! (README "Staging: infrastructure or the change?"): exit 75 (EX_TEMPFAIL) from any step says
//! "unreachable" itself; without a staging health URL, exit 255 from a step and curl's 7 from a
//! smoke check are read as unreachable. No steps configured is TOOL_ERROR `no_steps`: nothing
//! verified the change, and missing evidence is never success.

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

/// A step exiting with this code (EX_TEMPFAIL) reports the staging endpoint unreachable.
pub const UNREACHABLE_EXIT: i32 = 75;
/// curl's exit code for "could not connect": looked into (or, without a staging health URL,
/// read as unreachable) in smoke checks.
pub const CURL_COULD_NOT_CONNECT: i32 = 7;
/// ssh's exit code for its own errors (the host could not be reached, authentication):
/// looked into (or, without a staging health URL, read as unreachable) in any step.
pub const SSH_ERROR: i32 = 255;
/// The longest one look at the staging health URL waits for an answer, seconds (at most the
/// step's own timeout).
pub const LOOK_TIMEOUT_S: u64 = 10;

/// The artifact the staging runner writes (D-3: name and place unchanged).
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

/// What one staging run did, for its log.
struct Ran<'a> {
    environment: &'a StagingEnvironment,
    steps: &'a [StepResult],
    classification: &'a Classification,
    /// Defers of this visit before this run.
    defers: u32,
    /// What the runner saw at the staging health URL.
    looks: &'a [String],
}

/// One step of the plan: a staging step or a smoke check.
struct PlannedStep<'a> {
    name: &'a str,
    run: &'a str,
    timeout_s: u64,
    is_smoke: bool,
    /// Runs in the repo's sandbox (the default); `false` for a step that starts a service.
    sandboxed: bool,
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
                sandboxed: s.sandbox,
            })
            .collect();
        let revision = revision(run).await;
        let url = run.repo.staging_health_url.clone();
        let environment = StagingEnvironment {
            name: STAGE.to_owned(),
            url: url.clone(),
            branch: run.task.branch.clone(),
            revision: revision.clone(),
        };

        // No steps: `classify` calls the empty plan TOOL_ERROR `no_steps` (nothing verified the
        // change); it is deferred and then FAILED `tool_error_exhausted` like any tool error.
        let mut steps = Vec::with_capacity(planned.len());
        let mut looks = Vec::new();
        let mut smoke_began = false;
        for step in &planned {
            if step.is_smoke && !smoke_began {
                smoke_began = true;
                if let Some(url) = &url
                    && let Some(why) =
                        look(url, step.timeout_s, "before the smoke checks", &mut looks).await
                {
                    // Nothing answers where the smoke checks would go: they are not run.
                    steps.push(StepResult {
                        name: step.name.to_owned(),
                        command: step.run.to_owned(),
                        exit: StepExit::Unreachable,
                        duration_ms: 0,
                        output_tail: format!(
                            "not run: the staging health URL {url} does not answer ({why})"
                        ),
                        is_smoke: true,
                    });
                    break;
                }
            }
            let mut result = run_step(run, step, revision.as_deref()).await?;
            let passed = result.exit == StepExit::Exited(0);
            if !passed {
                result.exit = self
                    .judge(step, result.exit, url.as_deref(), &mut looks)
                    .await;
            }
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
                let ran = Ran {
                    environment: &environment,
                    steps: &steps,
                    classification: &c,
                    defers,
                    looks: &looks,
                };
                self.write_log(run, &ran, &decision)?;
                if let StagingDecision::Failed {
                    failure_kind,
                    reason,
                } = &decision
                    && failure_kind == orch_domain::staging::failure_kind::TOOL_ERROR_EXHAUSTED
                {
                    // The log says FAILED (the seed's two values); the pipeline is told it was
                    // the infrastructure, so the item fails without blaming the change.
                    self.counters.incr(COUNTER_GROUP, "failed");
                    let id = &run.work_item;
                    let hint = if c.failure_kind.as_deref()
                        == Some(orch_domain::staging::failure_kind::NO_STEPS)
                    {
                        format!(
                            "repo {} configures no staging steps: add them (`orch doctor` says how), then `orch retry {id}`",
                            run.repo_name
                        )
                    } else {
                        format!(
                            "the staging environment, not the change, is at fault: `orch retry {id}` once it is back"
                        )
                    };
                    return Ok(StageEffect::Produced {
                        outcome: Some(orch_domain::gate::GateOutcome::pass(
                            orch_domain::pipeline::TOOL_ERROR_EXHAUSTED.to_owned(),
                            format!("{reason}; {hint}"),
                        )),
                    });
                }
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
                    crate::release::record_staged(run, rev).await?;
                }
                Ok(StageEffect::Produced { outcome: None })
            }
        }
    }
}

impl StagingExecutor {
    /// How a step that did not pass ended, once the runner looked where it could: a failure an
    /// unreachable environment also explains is `Unreachable` when the staging health URL does
    /// not answer (or, with no URL to look at, by the conventions of ssh's 255 and curl's 7).
    async fn judge(
        &self,
        step: &PlannedStep<'_>,
        exit: StepExit,
        url: Option<&str>,
        looks: &mut Vec<String>,
    ) -> StepExit {
        let ambiguous = match exit {
            StepExit::Exited(SSH_ERROR | CURL_COULD_NOT_CONNECT) => true,
            StepExit::Exited(_) | StepExit::TimedOut => step.is_smoke,
            _ => false,
        };
        if !ambiguous {
            return exit;
        }
        match url {
            Some(url) => {
                let when = format!(
                    "after {} `{}` ended with {exit}",
                    if step.is_smoke { "smoke check" } else { "step" },
                    step.name
                );
                match look(url, step.timeout_s, &when, looks).await {
                    Some(_) => StepExit::Unreachable,
                    None => exit,
                }
            }
            None => match exit {
                StepExit::Exited(SSH_ERROR) => StepExit::Unreachable,
                StepExit::Exited(CURL_COULD_NOT_CONNECT) if step.is_smoke => StepExit::Unreachable,
                other => other,
            },
        }
    }

    /// Writes `15-staging-log.md` for a final decision (D-3: `author_agent: staging-runner`,
    /// `model_used: n/a`, `staging_status: SUCCESS|FAILED` exactly, for the unchanged
    /// `parse_staging_status`, AC-2/AC-5, TC-04).
    fn write_log(
        &self,
        run: &StageRun,
        r: &Ran<'_>,
        decision: &StagingDecision,
    ) -> anyhow::Result<()> {
        let outcome = decision
            .outcome(r.classification)
            .context("a deferred staging run has no log to write")?;
        let doc = render_staging_log(&StagingLog {
            work_item: run.work_item.as_str(),
            created_at_ms: run.store.now_ms(),
            attempt: r.defers.saturating_add(1),
            environment: r.environment,
            steps: r.steps,
            classification: r.classification,
            outcome: &outcome,
            looks: r.looks,
        });
        run.write_document(STAGING_LOG, &doc)?;
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

/// Looks at the staging health URL once (at most [`LOOK_TIMEOUT_S`], and never longer than
/// the step's own timeout) and notes what it saw in `looks`; `Some(why)` when nothing answered.
async fn look(
    url: &str,
    step_timeout_s: u64,
    when: &str,
    looks: &mut Vec<String>,
) -> Option<String> {
    let timeout = Duration::from_secs(step_timeout_s.clamp(1, LOOK_TIMEOUT_S));
    match crate::deploy::probe::reach(url, timeout).await {
        crate::deploy::probe::Reach::Answered(status) => {
            looks.push(format!("{when}: {url} answered (HTTP {status})"));
            None
        }
        crate::deploy::probe::Reach::Unreachable(why) => {
            looks.push(format!("{when}: {url} did not answer ({why})"));
            Some(why)
        }
        crate::deploy::probe::Reach::CannotAsk(why) => {
            looks.push(format!("{when}: could not look at {url} ({why})"));
            None
        }
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
    // A step runs the repository's code: in the repo's sandbox, unless it is marked as one
    // that starts a service meant to outlive it (then trusted, like a deploy).
    let contained = if step.sandboxed {
        crate::contain::for_repo_code(run, &run.worktree).map_err(|reason| {
            anyhow::anyhow!(
                "staging step `{}` of {}: {reason}",
                step.name,
                run.work_item
            )
        })?
    } else {
        crate::contain::for_trusted(&run.repo)
    };
    let cmd = contained.apply(
        shell_cmd(run, step.run, Duration::from_secs(step.timeout_s))
            .env("ORCH_REVISION", revision.unwrap_or_default()),
    );
    let result = |exit: StepExit, duration_ms: u64, output_tail: String| StepResult {
        name: step.name.to_owned(),
        command: step.run.to_owned(),
        exit,
        duration_ms,
        output_tail,
        is_smoke: step.is_smoke,
    };
    let key = run.command_key("staging");
    match orch_exec::run(&cmd.supervised(key.clone())).await {
        Ok(out) => {
            run.note_supervision(&format!("staging step {}", step.name), &key, &out)
                .await;
            let exit = match out.status {
                // A step says the staging endpoint could not be reached with EX_TEMPFAIL (75):
                // infrastructure, not the change (seed ORCH-115: TOOL_ERROR). Other failures an
                // unreachable host also explains are looked into by `judge`.
                ExitKind::Exited(UNREACHABLE_EXIT) => StepExit::Unreachable,
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
        Err(e @ (SpawnError::Io { .. } | SpawnError::Sandbox { .. })) => Err(anyhow::Error::new(e)
            .context(format!(
                "staging step `{}` of {} in {}",
                step.name,
                run.work_item,
                run.worktree.display()
            ))),
    }
}
