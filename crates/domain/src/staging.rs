//! Decisions of the deterministic staging runner (ORCH-115, seed `000_…`, design.md §5): how the
//! results of the configured staging steps become SUCCESS / FAILED / TOOL_ERROR, when a
//! TOOL_ERROR is deferred and when it is exhausted (D-2, D5), and the `15-staging-log.md`
//! artifact (D-3) that the unchanged `parse_staging_status` gate reads back.
//!
//! Pure: the runner executes the steps, counts the defer markers in the jobs queue and writes
//! the file; this module only decides and renders. Time comes in as epoch milliseconds.

use std::fmt::Write as _;

use crate::control::markers;
pub use crate::text::rfc3339_utc;
use crate::text::{md_cell, one_line};

/// The stable `failure_kind` values of a staging result (frontmatter key `failure_kind`,
/// read by the lessons loop). `none` is written when there is no failure.
pub mod failure_kind {
    /// A non-smoke step (build, deploy-to-staging, …) exited non-zero: the change is at fault.
    pub const STEP_FAILED: &str = "step_failed";
    /// A smoke check failed against a responding environment: the change is at fault.
    pub const SMOKE_FAILED: &str = "smoke_failed";
    /// A smoke check ran out of time after the smoke phase began: the environment was deployed
    /// and answers too slowly or hangs, which is the change's fault (design.md §5 makes only a
    /// timeout *before* the smoke checks an infrastructure error).
    pub const SMOKE_TIMEOUT: &str = "smoke_timeout";
    /// TOOL_ERROR: the program of a step does not exist (spawn ENOENT, or shell exit 127).
    pub const TOOL_MISSING: &str = "tool_missing";
    /// TOOL_ERROR: the program of a step cannot be executed (spawn EACCES, or shell exit 126).
    pub const PERMISSION_DENIED: &str = "permission_denied";
    /// TOOL_ERROR: a step was killed by a signal the runner did not send.
    pub const SIGNALED: &str = "signaled";
    /// TOOL_ERROR: a step timed out before the smoke checks began.
    pub const TIMEOUT: &str = "timeout";
    /// TOOL_ERROR: the staging endpoint could not be reached at all.
    pub const UNREACHABLE: &str = "unreachable";
    /// TOOL_ERROR: fewer step results than planned steps, all of them passing (the run was
    /// cut short; nothing proves the rest would pass).
    pub const INCOMPLETE: &str = "incomplete";
    /// TOOL_ERROR: the step results do not match the plan (name or order differs).
    pub const PLAN_MISMATCH: &str = "plan_mismatch";
    /// TOOL_ERROR: the repo has no staging steps: nothing could verify the change.
    pub const NO_STEPS: &str = "no_steps";
    /// FAILED after the TOOL_ERROR defer limit was reached (design.md §5, D5).
    pub const TOOL_ERROR_EXHAUSTED: &str = "tool_error_exhausted";
}

/// The default bound on infrastructure defers of one staging visit (D5: "default 2").
pub const DEFAULT_DEFER_LIMIT: u32 = 2;

/// How one staging step ended, as observed by the runner's exec layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepExit {
    /// The process ran and exited with this code.
    Exited(i32),
    /// The process was killed by this signal (not by the runner's own timeout).
    Signaled(i32),
    /// The runner killed the step at its timeout.
    TimedOut,
    /// The program could not be found (spawn failed with ENOENT).
    NotFound,
    /// The program could not be executed (spawn failed with EACCES).
    PermissionDenied,
    /// A check could not reach the staging endpoint at all (connection refused, DNS, TLS).
    Unreachable,
}

impl std::fmt::Display for StepExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepExit::Exited(code) => write!(f, "exit {code}"),
            StepExit::Signaled(sig) => write!(f, "signal {sig}"),
            StepExit::TimedOut => f.write_str("timed out"),
            StepExit::NotFound => f.write_str("not found"),
            StepExit::PermissionDenied => f.write_str("permission denied"),
            StepExit::Unreachable => f.write_str("unreachable"),
        }
    }
}

/// The result of one executed staging step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepResult {
    /// The step's name from the repo's configuration (`build`, `deploy`, `smoke-health`, …).
    pub name: String,
    /// The command line as configured, for the log.
    pub command: String,
    /// How it ended.
    pub exit: StepExit,
    /// Wall-clock duration.
    pub duration_ms: u64,
    /// The last part of its combined output (the exec layer bounds it).
    pub output_tail: String,
    /// True for smoke checks (they run against the deployed staging environment).
    pub is_smoke: bool,
}

/// The steps the repo configures for staging, by name, in execution order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StagingPlan {
    /// Step names in the order the runner executes them.
    pub step_names: Vec<String>,
}

/// The three-way classification of a staging run (design.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagingVerdict {
    /// Every planned step passed.
    Success,
    /// The change is at fault; never retried.
    Failed,
    /// Infrastructure is at fault; deferred up to the limit (D5).
    ToolError,
}

impl StagingVerdict {
    /// `SUCCESS`, `FAILED` or `TOOL_ERROR`.
    pub fn as_str(self) -> &'static str {
        match self {
            StagingVerdict::Success => "SUCCESS",
            StagingVerdict::Failed => "FAILED",
            StagingVerdict::ToolError => "TOOL_ERROR",
        }
    }
}

/// What [`classify`] concluded from the step results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classification {
    /// SUCCESS, FAILED or TOOL_ERROR.
    pub verdict: StagingVerdict,
    /// One of [`failure_kind`]'s values; `None` exactly when the verdict is SUCCESS.
    pub failure_kind: Option<String>,
    /// One human sentence naming the deciding step.
    pub reason: String,
}

/// Classifies a staging run. The first step that did not pass decides (the runner stops
/// there; later results, if any, are shown in the log but do not change the verdict):
///
/// | step ended | verdict | failure_kind |
/// |---|---|---|
/// | exit 0 | passes | — |
/// | exit 127 / 126 (POSIX shell: command not found / not executable) | TOOL_ERROR | `tool_missing` / `permission_denied` |
/// | other non-zero exit, smoke step | FAILED | `smoke_failed` |
/// | other non-zero exit, other step | FAILED | `step_failed` |
/// | killed by a signal | TOOL_ERROR | `signaled` |
/// | timeout before any smoke step began | TOOL_ERROR | `timeout` |
/// | timeout once the smoke phase began | FAILED | `smoke_timeout` |
/// | program not found / not executable | TOOL_ERROR | `tool_missing` / `permission_denied` |
/// | endpoint unreachable | TOOL_ERROR | `unreachable` |
///
/// Conservative on missing evidence: an empty plan, results that do not match the plan, or
/// fewer results than planned steps are TOOL_ERROR, never SUCCESS.
pub fn classify(steps: &[StepResult], plan: &StagingPlan) -> Classification {
    use failure_kind as k;
    if plan.step_names.is_empty() {
        return tool_error(
            k::NO_STEPS,
            "no staging steps are configured: nothing verified the change".into(),
        );
    }
    let mut smoke_began = false;
    for (i, step) in steps.iter().enumerate() {
        let n = i + 1;
        match plan.step_names.get(i) {
            None => {
                return tool_error(
                    k::PLAN_MISMATCH,
                    format!(
                        "step #{n} `{}` is not in the plan of {} steps",
                        step.name,
                        plan.step_names.len()
                    ),
                );
            }
            Some(planned) if *planned != step.name => {
                return tool_error(
                    k::PLAN_MISMATCH,
                    format!("step #{n} is `{}` but the plan says `{planned}`", step.name),
                );
            }
            Some(_) => {}
        }
        smoke_began |= step.is_smoke;
        let what = if step.is_smoke { "smoke check" } else { "step" };
        let name = &step.name;
        match step.exit {
            StepExit::Exited(0) => continue,
            StepExit::Exited(127) | StepExit::NotFound => {
                return tool_error(
                    k::TOOL_MISSING,
                    format!("{what} `{name}`: the program was not found ({})", step.exit),
                );
            }
            StepExit::Exited(126) | StepExit::PermissionDenied => {
                return tool_error(
                    k::PERMISSION_DENIED,
                    format!(
                        "{what} `{name}`: the program could not be executed ({})",
                        step.exit
                    ),
                );
            }
            StepExit::Exited(code) => {
                let kind = if step.is_smoke {
                    k::SMOKE_FAILED
                } else {
                    k::STEP_FAILED
                };
                return failed(
                    kind,
                    format!("{what} `{name}` failed with exit code {code}"),
                );
            }
            StepExit::Signaled(sig) => {
                return tool_error(
                    k::SIGNALED,
                    format!("{what} `{name}` was killed by signal {sig}"),
                );
            }
            StepExit::TimedOut if smoke_began => {
                return failed(
                    k::SMOKE_TIMEOUT,
                    format!("{what} `{name}` timed out after the smoke checks began"),
                );
            }
            StepExit::TimedOut => {
                return tool_error(
                    k::TIMEOUT,
                    format!("{what} `{name}` timed out before the smoke checks began"),
                );
            }
            StepExit::Unreachable => {
                return tool_error(
                    k::UNREACHABLE,
                    format!("{what} `{name}`: the staging endpoint is unreachable"),
                );
            }
        }
    }
    if steps.len() < plan.step_names.len() {
        return tool_error(
            k::INCOMPLETE,
            format!(
                "only {} of {} planned steps ran; the next would have been `{}`",
                steps.len(),
                plan.step_names.len(),
                plan.step_names[steps.len()]
            ),
        );
    }
    Classification {
        verdict: StagingVerdict::Success,
        failure_kind: None,
        reason: format!("all {} planned steps passed", plan.step_names.len()),
    }
}

fn tool_error(kind: &str, reason: String) -> Classification {
    Classification {
        verdict: StagingVerdict::ToolError,
        failure_kind: Some(kind.into()),
        reason,
    }
}

fn failed(kind: &str, reason: String) -> Classification {
    Classification {
        verdict: StagingVerdict::Failed,
        failure_kind: Some(kind.into()),
        reason,
    }
}

/// Counts the defers of one staging visit (D-2: restart-safe, no column, NFR-1): the number of
/// job contents that contain [`markers::staging_defer`]`(stage_seq)` (a job counts once,
/// however often the marker appears — the same rule as the store's `count_jobs` with
/// `content_contains`).
pub fn count_defers(task_contents: &[&str], stage_seq: i64) -> u32 {
    let marker = markers::staging_defer(stage_seq);
    let n = task_contents.iter().filter(|c| c.contains(&marker)).count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The defer policy of TOOL_ERROR results (D5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeferPolicy {
    /// Defers allowed per staging visit; the TOOL_ERROR after the last one is FAILED
    /// `tool_error_exhausted`. Default [`DEFAULT_DEFER_LIMIT`] (2).
    pub limit: u32,
    /// Delay before the first deferred attempt; doubles with each defer.
    pub base_delay_s: u64,
    /// Upper bound of the delay.
    pub max_delay_s: u64,
}

impl Default for DeferPolicy {
    fn default() -> Self {
        DeferPolicy {
            limit: DEFAULT_DEFER_LIMIT,
            base_delay_s: 60,
            max_delay_s: 600,
        }
    }
}

impl DeferPolicy {
    /// The delay of defer number `attempt` (1-based): `min(base * 2^(attempt-1), max)`.
    pub fn delay_s(&self, attempt: u32) -> u64 {
        let exp = attempt.clamp(1, 32) - 1;
        self.base_delay_s
            .saturating_mul(1_u64 << exp)
            .min(self.max_delay_s)
    }
}

/// What the runner does with a classified staging run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StagingDecision {
    /// Write `staging_status: SUCCESS` and advance to deploy.
    Success,
    /// Write `staging_status: FAILED` and loop back to implementation. Never retried.
    Failed {
        /// One of [`failure_kind`]'s values.
        failure_kind: String,
        /// One human sentence.
        reason: String,
    },
    /// Enqueue a fresh `deployer` job carrying [`markers::staging_defer`] after `delay_s`; no
    /// artifact is written (the stage stays `staging`).
    Defer {
        /// Delay of the fresh job (`available_at_delay_s`).
        delay_s: u64,
        /// Which defer this is, 1-based (`defers_so_far + 1`).
        attempt: u32,
    },
}

/// Decides what follows a classification, given the defers this staging visit already had
/// (counted with [`count_defers`]). SUCCESS and FAILED are final; FAILED is never retried.
/// TOOL_ERROR is deferred while `defers_so_far < policy.limit`, then becomes FAILED
/// `tool_error_exhausted` (D5).
pub fn decide_after(
    c: &Classification,
    defers_so_far: u32,
    policy: &DeferPolicy,
) -> StagingDecision {
    match c.verdict {
        StagingVerdict::Success => StagingDecision::Success,
        StagingVerdict::Failed => StagingDecision::Failed {
            failure_kind: c
                .failure_kind
                .clone()
                .unwrap_or_else(|| failure_kind::STEP_FAILED.into()),
            reason: c.reason.clone(),
        },
        StagingVerdict::ToolError if defers_so_far < policy.limit => {
            let attempt = defers_so_far + 1;
            StagingDecision::Defer {
                delay_s: policy.delay_s(attempt),
                attempt,
            }
        }
        StagingVerdict::ToolError => StagingDecision::Failed {
            failure_kind: failure_kind::TOOL_ERROR_EXHAUSTED.into(),
            reason: format!(
                "infrastructure error persisted after {defers_so_far} defer(s) (limit {}): {} ({})",
                policy.limit,
                c.reason,
                c.failure_kind.as_deref().unwrap_or("tool_error")
            ),
        },
    }
}

/// The machine value of `staging_status:` (D-3): exactly `SUCCESS` or `FAILED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StagingStatus {
    /// `SUCCESS`.
    Success,
    /// `FAILED`.
    Failed,
}

impl StagingStatus {
    /// `SUCCESS` or `FAILED` (uppercase, as `parse_staging_status` expects).
    pub fn as_str(self) -> &'static str {
        match self {
            StagingStatus::Success => "SUCCESS",
            StagingStatus::Failed => "FAILED",
        }
    }
}

/// A final staging outcome: what `15-staging-log.md` records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingOutcome {
    /// SUCCESS or FAILED.
    pub status: StagingStatus,
    /// `None` for SUCCESS.
    pub failure_kind: Option<String>,
    /// One human sentence.
    pub reason: String,
}

impl StagingDecision {
    /// The outcome to write to the log, or `None` for a defer (a deferred run writes no
    /// artifact: `staging_status` only ever says SUCCESS or FAILED).
    pub fn outcome(&self, c: &Classification) -> Option<StagingOutcome> {
        match self {
            StagingDecision::Success => Some(StagingOutcome {
                status: StagingStatus::Success,
                failure_kind: None,
                reason: c.reason.clone(),
            }),
            StagingDecision::Failed {
                failure_kind,
                reason,
            } => Some(StagingOutcome {
                status: StagingStatus::Failed,
                failure_kind: Some(failure_kind.clone()),
                reason: reason.clone(),
            }),
            StagingDecision::Defer { .. } => None,
        }
    }
}

/// Where the staging run happened, for the log's Environment section.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StagingEnvironment {
    /// The environment's name (e.g. `staging`).
    pub name: String,
    /// The staging endpoint, when configured.
    pub url: Option<String>,
    /// The work item's branch.
    pub branch: String,
    /// The revision that was staged, when known.
    pub revision: Option<String>,
}

/// Everything `15-staging-log.md` shows.
#[derive(Debug, Clone, Copy)]
pub struct StagingLog<'a> {
    /// The work item id (`ORCH-115`).
    pub work_item: &'a str,
    /// When the log was produced (epoch ms), rendered as RFC 3339 UTC.
    pub created_at_ms: i64,
    /// Which run of this staging visit this was, 1-based (defers so far + 1).
    pub attempt: u32,
    /// Where it ran.
    pub environment: &'a StagingEnvironment,
    /// The executed steps, in order.
    pub steps: &'a [StepResult],
    /// The classification of this run.
    pub classification: &'a Classification,
    /// The final outcome (see [`StagingDecision::outcome`]).
    pub outcome: &'a StagingOutcome,
    /// What the runner saw when it looked at the staging health URL itself (before the smoke
    /// checks, after a step that failed), one line each; empty when none is configured.
    pub looks: &'a [String],
}

/// The longest output tail shown in one table cell, in characters (the end is kept).
pub const MAX_CELL_CHARS: usize = 1_500;

/// Renders `docs/work-items/<id>/15-staging-log.md` (D-3): YAML frontmatter with the common
/// keys plus `staging_status` (exactly `SUCCESS` or `FAILED`), `failure_kind` (`none` on
/// success), `attempt` and `reason`, then the fixed body: Summary, Environment, Steps (a table
/// of command, exit, duration, output tail) and Verdict. Only the producer changes (D-3):
/// `author_agent: staging-runner`, `model_used: n/a`; the key `staging_status:` keeps its name
/// and case so the unchanged `parse_staging_status` reads it (AC-2/AC-5, TC-04). The key is
/// always written as the plain line `staging_status: SUCCESS` / `staging_status: FAILED`.
pub fn render_staging_log(log: &StagingLog<'_>) -> String {
    let outcome = log.outcome;
    let mut out = render_frontmatter(&[
        ("work_item", FmValue::Str(log.work_item)),
        ("stage", FmValue::Str("staging")),
        ("author_agent", FmValue::Str("staging-runner")),
        ("status", FmValue::Str("final")),
        ("created_at", FmValue::Str(&rfc3339_utc(log.created_at_ms))),
        ("model_used", FmValue::Str("n/a")),
        ("staging_status", FmValue::Str(outcome.status.as_str())),
        (
            "failure_kind",
            FmValue::Str(outcome.failure_kind.as_deref().unwrap_or("none")),
        ),
        ("attempt", FmValue::Int(i64::from(log.attempt))),
        ("reason", FmValue::Str(&outcome.reason)),
    ]);
    let env = log.environment;
    let c = log.classification;
    let _ = write!(
        out,
        "\n# 15 — Staging log: {}\n\n## Summary\n\n**{}** — {}\n\nRun {} of this staging visit; {} step(s) executed.\n",
        one_line(log.work_item),
        outcome.status.as_str(),
        one_line(&outcome.reason),
        log.attempt,
        log.steps.len(),
    );
    if !log.looks.is_empty() {
        out.push_str("\nThe runner looked at the staging health URL itself:\n\n");
        for look in log.looks {
            let _ = writeln!(out, "- {}", one_line(look));
        }
    }
    out.push_str("\n## Environment\n\n| key | value |\n|---|---|\n");
    for (key, value) in [
        ("environment", env.name.as_str()),
        ("url", env.url.as_deref().unwrap_or("—")),
        ("branch", env.branch.as_str()),
        ("revision", env.revision.as_deref().unwrap_or("—")),
    ] {
        let _ = writeln!(out, "| {key} | {} |", md_cell(value, MAX_CELL_CHARS));
    }
    out.push_str("\n## Steps\n\n| # | step | smoke | command | exit | duration | output tail |\n|---|---|---|---|---|---|---|\n");
    if log.steps.is_empty() {
        out.push_str("| — | (no step ran) | | | | | |\n");
    }
    for (i, s) in log.steps.iter().enumerate() {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            i + 1,
            md_cell(&s.name, MAX_CELL_CHARS),
            if s.is_smoke { "yes" } else { "no" },
            md_cell(&s.command, MAX_CELL_CHARS),
            s.exit,
            format_duration_ms(s.duration_ms),
            md_cell(&s.output_tail, MAX_CELL_CHARS),
        );
    }
    let _ = write!(
        out,
        "\n## Verdict\n\n- classification: `{}` ({})\n- staging_status: `{}`\n- failure_kind: `{}`\n- reason: {}\n",
        c.verdict.as_str(),
        c.failure_kind.as_deref().unwrap_or("none"),
        outcome.status.as_str(),
        outcome.failure_kind.as_deref().unwrap_or("none"),
        one_line(&outcome.reason),
    );
    out
}

/// `1.234 s` from milliseconds, or `850 ms` under one second.
fn format_duration_ms(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms} ms")
    } else {
        format!("{}.{:03} s", ms / 1_000, ms % 1_000)
    }
}

// ---- frontmatter rendering (also used by `monitor`) ---------------------------------------

/// A frontmatter value: strings are quoted when needed, integers are written plain.
pub(crate) enum FmValue<'a> {
    Str(&'a str),
    Int(i64),
}

/// Renders a `---` … `---` YAML frontmatter block, one `key: value` per line, in the given
/// order. Values that could be misread (colons, quotes, `#`, leading digits, YAML keywords,
/// newlines, …) are double-quoted with escapes, so each value stays on its own line.
pub(crate) fn render_frontmatter(pairs: &[(&str, FmValue<'_>)]) -> String {
    let mut out = String::from("---\n");
    for (key, value) in pairs {
        let rendered = match value {
            FmValue::Str(s) => crate::artifact::yaml_scalar(s),
            FmValue::Int(n) => n.to_string(),
        };
        let _ = writeln!(out, "{key}: {rendered}");
    }
    out.push_str("---\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn step(name: &str, exit: StepExit, is_smoke: bool) -> StepResult {
        StepResult {
            name: name.into(),
            command: format!("./{name}.sh"),
            exit,
            duration_ms: 1_234,
            output_tail: String::new(),
            is_smoke,
        }
    }

    fn plan(names: &[&str]) -> StagingPlan {
        StagingPlan {
            step_names: names.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The one place the classification API is called.
    fn check(
        steps: &[StepResult],
        plan_names: &[&str],
        verdict: StagingVerdict,
        kind: Option<&str>,
    ) {
        let c = classify(steps, &plan(plan_names));
        assert_eq!(
            (c.verdict, c.failure_kind.as_deref()),
            (verdict, kind),
            "steps {steps:?} plan {plan_names:?} → {c:?}"
        );
        assert!(!c.reason.is_empty());
    }

    const PLAN: [&str; 3] = ["build", "deploy", "smoke"];

    #[test]
    fn classification_table() {
        use StagingVerdict::*;
        use StepExit::*;
        use failure_kind as k;
        let ok = |n: &str| step(n, Exited(0), n == "smoke");
        // (steps, verdict, failure_kind)
        let cases: Vec<(Vec<StepResult>, StagingVerdict, Option<&str>)> = vec![
            (vec![ok("build"), ok("deploy"), ok("smoke")], Success, None),
            (
                vec![step("build", Exited(1), false)],
                Failed,
                Some(k::STEP_FAILED),
            ),
            (
                vec![ok("build"), step("deploy", Exited(2), false)],
                Failed,
                Some(k::STEP_FAILED),
            ),
            (
                vec![ok("build"), ok("deploy"), step("smoke", Exited(22), true)],
                Failed,
                Some(k::SMOKE_FAILED),
            ),
            // timeout before smoke began = infrastructure; once smoke began = the change
            (
                vec![step("build", TimedOut, false)],
                ToolError,
                Some(k::TIMEOUT),
            ),
            (
                vec![ok("build"), step("deploy", TimedOut, false)],
                ToolError,
                Some(k::TIMEOUT),
            ),
            (
                vec![ok("build"), ok("deploy"), step("smoke", TimedOut, true)],
                Failed,
                Some(k::SMOKE_TIMEOUT),
            ),
            (
                vec![step("build", NotFound, false)],
                ToolError,
                Some(k::TOOL_MISSING),
            ),
            (
                vec![step("build", Exited(127), false)],
                ToolError,
                Some(k::TOOL_MISSING),
            ),
            (
                vec![step("build", PermissionDenied, false)],
                ToolError,
                Some(k::PERMISSION_DENIED),
            ),
            (
                vec![step("build", Exited(126), false)],
                ToolError,
                Some(k::PERMISSION_DENIED),
            ),
            (
                vec![step("build", Signaled(9), false)],
                ToolError,
                Some(k::SIGNALED),
            ),
            (
                vec![ok("build"), ok("deploy"), step("smoke", Signaled(15), true)],
                ToolError,
                Some(k::SIGNALED),
            ),
            (
                vec![ok("build"), ok("deploy"), step("smoke", Unreachable, true)],
                ToolError,
                Some(k::UNREACHABLE),
            ),
            // missing evidence is never SUCCESS
            (vec![], ToolError, Some(k::INCOMPLETE)),
            (
                vec![ok("build"), ok("deploy")],
                ToolError,
                Some(k::INCOMPLETE),
            ),
            (
                vec![ok("deploy"), ok("build"), ok("smoke")],
                ToolError,
                Some(k::PLAN_MISMATCH),
            ),
            (
                vec![ok("build"), ok("deploy"), ok("smoke"), ok("extra")],
                ToolError,
                Some(k::PLAN_MISMATCH),
            ),
            // the first failing step decides; later results do not change it
            (
                vec![
                    step("build", Exited(1), false),
                    step("deploy", Unreachable, false),
                ],
                Failed,
                Some(k::STEP_FAILED),
            ),
            (
                vec![
                    step("build", Unreachable, false),
                    step("deploy", Exited(1), false),
                ],
                ToolError,
                Some(k::UNREACHABLE),
            ),
        ];
        for (steps, verdict, kind) in cases {
            check(&steps, &PLAN, verdict, kind);
        }
        check(&[], &[], ToolError, Some(k::NO_STEPS));
    }

    #[test]
    fn a_smoke_step_earlier_in_the_plan_makes_a_later_timeout_the_changes_fault() {
        let steps = [
            step("smoke-pre", StepExit::Exited(0), true),
            step("deploy", StepExit::TimedOut, false),
        ];
        check(
            &steps,
            &["smoke-pre", "deploy"],
            StagingVerdict::Failed,
            Some(failure_kind::SMOKE_TIMEOUT),
        );
    }

    fn decide(verdict: StagingVerdict, defers: u32, limit: u32) -> StagingDecision {
        let c = Classification {
            verdict,
            failure_kind: match verdict {
                StagingVerdict::Success => None,
                StagingVerdict::Failed => Some(failure_kind::SMOKE_FAILED.into()),
                StagingVerdict::ToolError => Some(failure_kind::TIMEOUT.into()),
            },
            reason: "r".into(),
        };
        decide_after(
            &c,
            defers,
            &DeferPolicy {
                limit,
                ..DeferPolicy::default()
            },
        )
    }

    #[test]
    fn defer_decisions_follow_d5() {
        use StagingVerdict::*;
        assert_eq!(DeferPolicy::default().limit, 2, "D5 default limit");
        assert_eq!(decide(Success, 0, 2), StagingDecision::Success);
        assert_eq!(decide(Success, 5, 2), StagingDecision::Success);
        // FAILED is never retried, whatever the defer count
        for defers in [0, 1, 2, 3] {
            assert!(
                matches!(decide(Failed, defers, 2), StagingDecision::Failed { ref failure_kind, .. } if failure_kind == "smoke_failed"),
                "defers {defers}"
            );
        }
        assert_eq!(
            decide(ToolError, 0, 2),
            StagingDecision::Defer {
                delay_s: 60,
                attempt: 1
            }
        );
        assert_eq!(
            decide(ToolError, 1, 2),
            StagingDecision::Defer {
                delay_s: 120,
                attempt: 2
            }
        );
        for defers in [2, 3, 100] {
            match decide(ToolError, defers, 2) {
                StagingDecision::Failed {
                    failure_kind,
                    reason,
                } => {
                    assert_eq!(failure_kind, "tool_error_exhausted");
                    assert!(reason.contains("timeout"), "{reason}");
                }
                other => panic!("defers {defers}: {other:?}"),
            }
        }
        assert!(
            matches!(decide(ToolError, 0, 0), StagingDecision::Failed { .. }),
            "limit 0 never defers"
        );
        assert_eq!(DeferPolicy::default().delay_s(10), 600, "delay is capped");
        assert_eq!(DeferPolicy::default().delay_s(u32::MAX), 600);
    }

    #[test]
    fn defer_markers_are_counted_per_stage_visit() {
        let m1 = markers::staging_defer(1);
        let m12 = markers::staging_defer(12);
        assert!(m1.starts_with(&markers::start(markers::STAGING_DEFER)));
        assert!(!m12.contains(&m1), "seq 1 must not match inside seq 12");
        let with = |m: &str| format!("staging ORCH-7\n{m}\n");
        let contents = [
            with(&m1),
            with(&m1),
            with(&m12),
            "plain deployer job".to_string(),
            format!("{m1} {m1}"), // one job, counted once
        ];
        let refs: Vec<&str> = contents.iter().map(String::as_str).collect();
        assert_eq!(count_defers(&refs, 1), 3);
        assert_eq!(count_defers(&refs, 12), 1);
        assert_eq!(count_defers(&refs, 2), 0);
        assert_eq!(count_defers(&[], 1), 0);
    }

    #[test]
    fn rfc3339_vectors() {
        for (ms, want) in [
            (0, "1970-01-01T00:00:00Z"),
            (999, "1970-01-01T00:00:00Z"),
            (-1, "1969-12-31T23:59:59Z"),
            (951_782_400_000, "2000-02-29T00:00:00Z"),
            (1_781_611_200_000, "2026-06-16T12:00:00Z"),
            (4_102_444_799_000, "2099-12-31T23:59:59Z"),
            (253_402_300_799_999, "9999-12-31T23:59:59Z"),
            (i64::MAX, "9999-12-31T23:59:59Z"),
            (i64::MIN, "0000-01-01T00:00:00Z"),
        ] {
            assert_eq!(rfc3339_utc(ms), want, "{ms}");
        }
    }

    /// An independent slow parser: counts days year by year.
    fn parse_rfc3339_s(s: &str) -> i64 {
        let n = |a: usize, b: usize| s[a..b].parse::<i64>().unwrap();
        let (y, m, d) = (n(0, 4), n(5, 7), n(8, 10));
        let leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
        let mut days = 0_i64;
        if y >= 1970 {
            for yy in 1970..y {
                days += if leap(yy) { 366 } else { 365 };
            }
        } else {
            for yy in y..1970 {
                days -= if leap(yy) { 366 } else { 365 };
            }
        }
        let month_len = [
            31,
            if leap(y) { 29 } else { 28 },
            31,
            30,
            31,
            30,
            31,
            31,
            30,
            31,
            30,
            31,
        ];
        days += month_len[..(m - 1) as usize].iter().sum::<i64>() + d - 1;
        days * 86_400 + n(11, 13) * 3_600 + n(14, 16) * 60 + n(17, 19)
    }

    proptest::proptest! {
        #[test]
        fn rfc3339_round_trips(ms in -62_167_219_200_000_i64..253_402_300_799_999) {
            let s = rfc3339_utc(ms);
            proptest::prop_assert_eq!(s.len(), 20);
            proptest::prop_assert_eq!(parse_rfc3339_s(&s), ms.div_euclid(1_000), "{}", s);
        }

        #[test]
        fn any_string_survives_the_frontmatter(s in "\\PC*|[#:'\"\\\\\n\r\t| -]{0,12}") {
            let fm = render_frontmatter(&[("reason", FmValue::Str(&s))]);
            let map: BTreeMap<String, String> = serde_saphyr::from_str(frontmatter_block(&fm)).unwrap();
            proptest::prop_assert_eq!(map.get("reason"), Some(&s));
        }
    }

    /// Splits the `---` block off an artifact the simple way a gate does.
    fn frontmatter_block(doc: &str) -> &str {
        let rest = doc.strip_prefix("---\n").expect("starts with ---");
        let end = rest.find("\n---\n").expect("closing ---");
        &rest[..end + 1]
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct StagingFrontmatter {
        work_item: String,
        stage: String,
        author_agent: String,
        status: String,
        created_at: String,
        model_used: String,
        staging_status: String,
        failure_kind: String,
        attempt: u32,
        reason: String,
    }

    fn sample_log(outcome: &StagingOutcome, steps: &[StepResult], c: &Classification) -> String {
        let env = StagingEnvironment {
            name: "staging".into(),
            url: Some("https://staging.example/health?a=1|b".into()),
            branch: "orch/ORCH-115".into(),
            revision: Some("0123abcd".into()),
        };
        render_staging_log(&StagingLog {
            looks: &[],
            work_item: "ORCH-115",
            created_at_ms: 1_781_611_200_000,
            attempt: 3,
            environment: &env,
            steps,
            classification: c,
            outcome,
        })
    }

    #[test]
    fn staging_log_frontmatter_parses_and_quotes_safely() {
        let steps = vec![
            step("build", StepExit::Exited(0), false),
            StepResult {
                output_tail: "line 1 | col\nHTTP/1.1 503 <b>down</b>\r\nkey: \"v\"".into(),
                ..step("smoke", StepExit::Exited(22), true)
            },
        ];
        let c = classify(&steps, &plan(&["build", "smoke"]));
        let reason = "smoke check `smoke` failed: \"503\" at url: https://x #1\nsecond line";
        let outcome = StagingOutcome {
            status: StagingStatus::Failed,
            failure_kind: Some("smoke_failed".into()),
            reason: reason.into(),
        };
        let doc = sample_log(&outcome, &steps, &c);
        let fm: StagingFrontmatter = serde_saphyr::from_str(frontmatter_block(&doc)).unwrap();
        assert_eq!(fm.work_item, "ORCH-115");
        assert_eq!(fm.stage, "staging");
        assert_eq!(fm.author_agent, "staging-runner");
        assert_eq!(fm.status, "final");
        assert_eq!(fm.created_at, "2026-06-16T12:00:00Z");
        assert_eq!(fm.model_used, "n/a");
        assert_eq!(fm.staging_status, "FAILED");
        assert_eq!(fm.failure_kind, "smoke_failed");
        assert_eq!(fm.attempt, 3);
        assert_eq!(fm.reason, reason, "quotes, colons, # and newlines survive");
        // a line-based gate sees the exact uppercase key/value (D-3)
        assert!(doc.lines().any(|l| l == "staging_status: FAILED"), "{doc}");
        assert_eq!(
            doc.matches("\n---\n").count(),
            1,
            "the body never closes the block early"
        );

        // body schema: the fixed sections, in order
        let mut at = 0;
        for section in ["## Summary", "## Environment", "## Steps", "## Verdict"] {
            let found = doc[at..]
                .find(section)
                .unwrap_or_else(|| panic!("{section} missing or out of order:\n{doc}"));
            at += found;
        }
        // every row of the steps table has the header's column count: pipes and newlines are escaped
        let steps_header = "| # | step | smoke | command | exit | duration | output tail |";
        let rows: Vec<&str> = doc
            .lines()
            .skip_while(|l| *l != steps_header)
            .take_while(|l| l.starts_with('|'))
            .collect();
        assert_eq!(rows.len(), 4, "header, separator and 2 step rows:\n{doc}");
        for row in &rows {
            assert_eq!(row.replace("\\|", "").matches('|').count(), 8, "row {row}");
        }
        assert!(
            doc.contains("line 1 \\| col<br>HTTP/1.1 503 &lt;b&gt;down&lt;/b&gt;<br>key: \"v\""),
            "{doc}"
        );
        assert!(
            doc.contains("| 2 | smoke | yes | ./smoke.sh | exit 22 | 1.234 s |"),
            "{doc}"
        );
        assert!(
            doc.contains("https://staging.example/health?a=1\\|b"),
            "{doc}"
        );
        assert!(
            doc.contains("- classification: `FAILED` (smoke_failed)"),
            "{doc}"
        );
    }

    #[test]
    fn staging_log_success_and_exhausted() {
        let steps = vec![step("build", StepExit::Exited(0), false)];
        let c = classify(&steps, &plan(&["build"]));
        let decision = decide_after(&c, 0, &DeferPolicy::default());
        let outcome = decision.outcome(&c).unwrap();
        let doc = sample_log(&outcome, &steps, &c);
        let fm: StagingFrontmatter = serde_saphyr::from_str(frontmatter_block(&doc)).unwrap();
        assert_eq!(
            (fm.staging_status.as_str(), fm.failure_kind.as_str()),
            ("SUCCESS", "none")
        );
        assert!(doc.lines().any(|l| l == "staging_status: SUCCESS"));

        let steps = vec![step("build", StepExit::NotFound, false)];
        let c = classify(&steps, &plan(&["build"]));
        assert_eq!(
            decide_after(&c, 0, &DeferPolicy::default()).outcome(&c),
            None,
            "a defer writes no log"
        );
        let outcome = decide_after(&c, 2, &DeferPolicy::default())
            .outcome(&c)
            .unwrap();
        let doc = sample_log(&outcome, &steps, &c);
        let fm: StagingFrontmatter = serde_saphyr::from_str(frontmatter_block(&doc)).unwrap();
        assert_eq!(
            (fm.staging_status.as_str(), fm.failure_kind.as_str()),
            ("FAILED", "tool_error_exhausted")
        );
        assert!(
            doc.contains("- classification: `TOOL_ERROR` (tool_missing)"),
            "{doc}"
        );

        let doc = sample_log(&outcome, &[], &c);
        assert!(doc.contains("(no step ran)"));
    }

    #[test]
    fn yaml_scalars_quote_what_could_be_misread() {
        for (input, want) in [
            ("SUCCESS", "SUCCESS"),
            ("n/a", "n/a"),
            ("staging-runner", "staging-runner"),
            ("ORCH-115", "ORCH-115"),
            ("", "\"\""),
            ("yes", "\"yes\""),
            ("Null", "\"Null\""),
            ("1", "\"1\""),
            ("a: b", "\"a: b\""),
            ("say \"hi\"", "\"say \\\"hi\\\"\""),
            ("#x", "\"#x\""),
            ("a\nb", "\"a\\nb\""),
            ("-x", "\"-x\""),
            ("bell\u{7}", "\"bell\\x07\""),
        ] {
            let scalar = crate::artifact::yaml_scalar(input);
            assert_eq!(scalar, want, "{input:?}");
            // Read back as the same string.
            let map: BTreeMap<String, String> =
                serde_saphyr::from_str(&format!("k: {scalar}\n")).unwrap();
            assert_eq!(map["k"], input, "{scalar}");
        }
    }

    #[test]
    fn md_cells_keep_the_tail() {
        assert_eq!(md_cell("", 10), "—");
        assert_eq!(md_cell("abcdef", 3), "…def");
        assert_eq!(md_cell("a|b\r\nc\td", 100), "a\\|b<br>c d");
        assert_eq!(one_line("a\n  b\r\n\nc"), "a b c");
    }
}
