//! Decision rules of the post-deploy monitor (ORCH-021, seed `002_…`, design.md §7): the watch's
//! schedule (frozen parameters, planned polls, deadline, tick slots recovered from the jobs
//! queue), how a poll's checks aggregate, when the series is FAILED early, HEALTHY or DEGRADED
//! at the deadline, what reaction follows, and the `16-post-deploy-log.md` artifact.
//!
//! Pure: the runner polls, keeps the series in the sentinel files (crate `orch-deploystate`),
//! counts this task's `post-deploy-monitor` jobs and runs the rollback; this module decides.
//! The types that are persisted in the sentinel files (`WatchParams`, `Poll`, `Check`,
//! `CheckOutcome`, `Verdict`) derive serde with explicit, stable spellings.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::staging::{FmValue, render_frontmatter};
use crate::text::{md_cell, one_line, rfc3339_utc};

/// Default observation window (design.md §7).
pub const DEFAULT_WINDOW_S: u64 = 600;
/// Default poll interval (design.md §7).
pub const DEFAULT_INTERVAL_S: u64 = 30;
/// Default delay before the first poll (design.md §7).
pub const DEFAULT_INITIAL_DELAY_S: u64 = 30;
/// Default timeout of one poll's checks (design.md §7).
pub const DEFAULT_POLL_TIMEOUT_S: u64 = 10;

/// FAILED early once this many FAIL polls follow each other.
pub const FAILED_CONSECUTIVE_FAILS: u32 = 3;
/// FAILED early once the FAIL polls are *more than* this many.
pub const FAILED_TOTAL_FAILS_ABOVE: u32 = 3;
/// HEALTHY allows at most this many FAIL polls.
pub const HEALTHY_MAX_FAILS: u32 = 1;
/// HEALTHY needs this many trailing valid polls, all PASS.
pub const HEALTHY_LAST_VALID_PASS: usize = 2;

/// The watch's parameters, frozen into the `armed` sentinel when the watch is armed (design.md §7),
/// so a configuration change mid-watch cannot move its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchParams {
    /// Length of the observation window from arming, seconds (default 600).
    pub window_s: u64,
    /// Time between polls, seconds (default 30).
    pub interval_s: u64,
    /// Time from arming to the first poll, seconds (default 30).
    pub initial_delay_s: u64,
    /// Timeout of one poll's checks, seconds (default 10).
    pub poll_timeout_s: u64,
}

impl Default for WatchParams {
    fn default() -> Self {
        WatchParams {
            window_s: DEFAULT_WINDOW_S,
            interval_s: DEFAULT_INTERVAL_S,
            initial_delay_s: DEFAULT_INITIAL_DELAY_S,
            poll_timeout_s: DEFAULT_POLL_TIMEOUT_S,
        }
    }
}

/// Why watch parameters were rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    /// `interval_s` must be at least 1.
    #[error("post-deploy watch: interval_s must be at least 1 second")]
    ZeroInterval,
    /// `poll_timeout_s` must be at least 1 and shorter than the interval.
    #[error(
        "post-deploy watch: poll_timeout_s ({poll_timeout_s}) must be at least 1 and less than interval_s ({interval_s})"
    )]
    PollTimeout {
        /// The configured poll timeout.
        poll_timeout_s: u64,
        /// The configured interval.
        interval_s: u64,
    },
    /// HEALTHY needs the last 2 valid polls PASS, so the window must plan at least 2 polls.
    #[error(
        "post-deploy watch: window_s {window_s} with initial_delay_s {initial_delay_s} and interval_s {interval_s} plans {planned} poll(s); HEALTHY needs at least 2"
    )]
    TooFewPolls {
        /// The configured window.
        window_s: u64,
        /// The configured initial delay.
        initial_delay_s: u64,
        /// The configured interval.
        interval_s: u64,
        /// The polls that would be planned.
        planned: u32,
    },
}

impl WatchParams {
    /// Checks the parameters at configuration time. The decision functions are total anyway
    /// (an interval of 0 is treated as 1), but a watch that can never be HEALTHY is a
    /// configuration mistake worth a clear error.
    pub fn validate(&self) -> Result<(), ParamsError> {
        if self.interval_s == 0 {
            return Err(ParamsError::ZeroInterval);
        }
        if self.poll_timeout_s == 0 || self.poll_timeout_s >= self.interval_s {
            return Err(ParamsError::PollTimeout {
                poll_timeout_s: self.poll_timeout_s,
                interval_s: self.interval_s,
            });
        }
        let planned = planned_polls(self);
        if planned < 2 {
            return Err(ParamsError::TooFewPolls {
                window_s: self.window_s,
                initial_delay_s: self.initial_delay_s,
                interval_s: self.interval_s,
                planned,
            });
        }
        Ok(())
    }
}

/// The number of polls a window plans: poll slots lie at `initial_delay_s + k * interval_s`
/// after arming, for every slot within `window_s` (at least one). Defaults: slots at
/// 30 s, 60 s, …, 600 s = 20 polls.
pub fn planned_polls(params: &WatchParams) -> u32 {
    let interval = params.interval_s.max(1);
    match params.window_s.checked_sub(params.initial_delay_s) {
        None => 1,
        Some(span) => u32::try_from((span / interval).saturating_add(1)).unwrap_or(u32::MAX),
    }
}

/// The scheduled time of poll slot `tick` (0-based): `armed_at + initial_delay + tick * interval`.
pub fn tick_at_ms(params: &WatchParams, armed_at_ms: i64, tick: u32) -> i64 {
    let offset_s = params
        .initial_delay_s
        .saturating_add(u64::from(tick).saturating_mul(params.interval_s.max(1)));
    let offset_ms = i64::try_from(offset_s.saturating_mul(1_000)).unwrap_or(i64::MAX);
    armed_at_ms.saturating_add(offset_ms)
}

/// The deadline: the time of the last planned slot (= arming + `window_s` when the window is a
/// whole number of intervals past the initial delay, as with the defaults). Recorded in
/// `armed`; the window is anchored to `armed_at`, so a restart neither loses nor extends it.
pub fn deadline_ms(params: &WatchParams, armed_at_ms: i64) -> i64 {
    tick_at_ms(params, armed_at_ms, planned_polls(params).saturating_sub(1))
}

/// When the next `post-deploy-monitor` job should run, or `None` when no slot is left (the
/// window is over: decide now).
///
/// `ticks_scheduled` is the number of this task's `post-deploy-monitor` jobs so far, counted
/// in the jobs queue (design.md §7: the tick count is recovered from the queue, restart-safe). The
/// answer is the first slot whose index is at least `ticks_scheduled` and whose time is after
/// `now_ms`: slots missed while no worker ran are skipped rather than polled in a burst (a
/// burst of polls seconds apart is not evidence across the window), and a count that lags
/// behind never schedules a slot that already passed.
pub fn next_tick_ms(
    params: &WatchParams,
    armed_at_ms: i64,
    ticks_scheduled: u32,
    now_ms: i64,
) -> Option<i64> {
    let k = ticks_scheduled.max(first_slot_after(params, armed_at_ms, now_ms));
    (k < planned_polls(params)).then(|| tick_at_ms(params, armed_at_ms, k))
}

/// The index of the first slot strictly after `now_ms`.
fn first_slot_after(params: &WatchParams, armed_at_ms: i64, now_ms: i64) -> u32 {
    let first = tick_at_ms(params, armed_at_ms, 0);
    if now_ms < first {
        return 0;
    }
    let interval_ms = i128::from(params.interval_s.max(1)) * 1_000;
    let k = (i128::from(now_ms) - i128::from(first)) / interval_ms + 1;
    u32::try_from(k).unwrap_or(u32::MAX)
}

/// The outcome of one check of a poll, and the aggregated status of a poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum CheckOutcome {
    /// The service answered well.
    Pass,
    /// The service answered badly (health failure, 5xx) or not at all.
    Fail,
    /// The monitor itself could not observe (its own error, not the service's).
    Error,
    /// Nothing to observe (no check configured, no data returned).
    #[serde(rename = "NODATA")]
    NoData,
}

impl CheckOutcome {
    /// `PASS`, `FAIL`, `ERROR` or `NODATA`.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckOutcome::Pass => "PASS",
            CheckOutcome::Fail => "FAIL",
            CheckOutcome::Error => "ERROR",
            CheckOutcome::NoData => "NODATA",
        }
    }

    /// A valid poll is evidence about the service: PASS or FAIL.
    pub fn is_valid(self) -> bool {
        matches!(self, CheckOutcome::Pass | CheckOutcome::Fail)
    }
}

/// One check of a poll (health URL, error-rate probe, …).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// The check's configured name.
    pub name: String,
    /// What it observed.
    pub outcome: CheckOutcome,
    /// The HTTP status, when there was a response.
    #[serde(default)]
    pub status_code: Option<u16>,
    /// Response time, when there was a response.
    #[serde(default)]
    pub latency_ms: Option<u64>,
    /// A short human note (error text, body excerpt).
    #[serde(default)]
    pub detail: String,
}

/// One poll: every check run at one slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Poll {
    /// The slot this poll belongs to (0-based). A poll repeated for the same slot (a job
    /// re-run after a crash) is ignored: the first one recorded counts.
    pub tick: u32,
    /// When the poll ran (epoch ms).
    pub at_ms: i64,
    /// Its checks.
    pub checks: Vec<Check>,
}

impl Poll {
    /// The poll's status: FAIL if any check failed (the service answered badly — evidence
    /// even when another check could not observe), else ERROR if any check errored, else
    /// NODATA if any had no data or there were no checks, else PASS (every check passed).
    pub fn status(&self) -> CheckOutcome {
        let has = |o: CheckOutcome| self.checks.iter().any(|c| c.outcome == o);
        if has(CheckOutcome::Fail) {
            CheckOutcome::Fail
        } else if has(CheckOutcome::Error) {
            CheckOutcome::Error
        } else if self.checks.is_empty() || has(CheckOutcome::NoData) {
            CheckOutcome::NoData
        } else {
            CheckOutcome::Pass
        }
    }
}

/// The polls that count: the first poll of each tick, in series order.
fn effective(series: &[Poll]) -> Vec<&Poll> {
    let mut seen = std::collections::HashSet::new();
    series.iter().filter(|p| seen.insert(p.tick)).collect()
}

/// Counts over a series (repeated ticks counted once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeriesStats {
    /// Polls counted.
    pub polls: u32,
    /// PASS polls.
    pub pass: u32,
    /// FAIL polls.
    pub fail: u32,
    /// ERROR polls.
    pub error: u32,
    /// NODATA polls.
    pub nodata: u32,
    /// Checks that got an HTTP 5xx.
    pub http_5xx: u32,
    /// The longest run of FAIL polls one after another.
    pub max_consecutive_fail: u32,
    /// Checks counted (every check of every poll: health, revision, control).
    pub checks: u32,
    /// FAIL checks.
    pub checks_fail: u32,
    /// Checks that were not evidence: ERROR or NODATA.
    pub checks_errored: u32,
}

impl SeriesStats {
    /// Counts a series.
    pub fn of(series: &[Poll]) -> SeriesStats {
        let mut s = SeriesStats::default();
        let mut run = 0;
        for poll in effective(series) {
            s.polls += 1;
            match poll.status() {
                CheckOutcome::Pass => s.pass += 1,
                CheckOutcome::Fail => s.fail += 1,
                CheckOutcome::Error => s.error += 1,
                CheckOutcome::NoData => s.nodata += 1,
            }
            run = if poll.status() == CheckOutcome::Fail {
                run + 1
            } else {
                0
            };
            s.max_consecutive_fail = s.max_consecutive_fail.max(run);
            let five_xx = poll
                .checks
                .iter()
                .filter(|c| c.status_code.is_some_and(|code| (500..600).contains(&code)));
            s.http_5xx += u32::try_from(five_xx.count()).unwrap_or(u32::MAX);
            for c in &poll.checks {
                s.checks = s.checks.saturating_add(1);
                match c.outcome {
                    CheckOutcome::Pass => {}
                    CheckOutcome::Fail => s.checks_fail = s.checks_fail.saturating_add(1),
                    CheckOutcome::Error | CheckOutcome::NoData => {
                        s.checks_errored = s.checks_errored.saturating_add(1);
                    }
                }
            }
        }
        s
    }

    /// PASS + FAIL polls: the ones that are evidence about the service.
    pub fn valid(&self) -> u32 {
        self.pass + self.fail
    }
}

/// The watch's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    /// Enough valid evidence, and it is good.
    Healthy,
    /// Not enough evidence, or mixed evidence: not proof of failure.
    Degraded,
    /// Repeated failures.
    Failed,
}

impl Verdict {
    /// `HEALTHY`, `DEGRADED` or `FAILED` (the `post_deploy_status` value).
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Healthy => "HEALTHY",
            Verdict::Degraded => "DEGRADED",
            Verdict::Failed => "FAILED",
        }
    }
}

/// What a monitor tick concludes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Keep watching: enqueue the next tick after this many milliseconds, at the next slot's
    /// instant (not rounded up to a whole second: rounding would make every poll late).
    Continue {
        /// The delay of the next `post-deploy-monitor` job.
        next_delay_ms: u64,
    },
    /// The watch is over with this verdict and reason.
    Final(Verdict, String),
}

/// The thresholds of the verdict rules. Production decides with [`Thresholds::default`] (the
/// constants above, design.md §7); `orch replay --set post_deploy.…=N` asks what other values
/// would have decided on the same recorded series, through the same [`decide_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// FAILED once this many FAIL polls follow each other ([`FAILED_CONSECUTIVE_FAILS`]).
    pub failed_consecutive_fails: u32,
    /// FAILED once the FAIL polls are more than this many ([`FAILED_TOTAL_FAILS_ABOVE`]).
    pub failed_total_fails_above: u32,
    /// HEALTHY allows at most this many FAIL polls ([`HEALTHY_MAX_FAILS`]).
    pub healthy_max_fails: u32,
    /// HEALTHY needs this many trailing valid polls, all PASS ([`HEALTHY_LAST_VALID_PASS`]).
    pub healthy_last_valid_pass: usize,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            failed_consecutive_fails: FAILED_CONSECUTIVE_FAILS,
            failed_total_fails_above: FAILED_TOTAL_FAILS_ABOVE,
            healthy_max_fails: HEALTHY_MAX_FAILS,
            healthy_last_valid_pass: HEALTHY_LAST_VALID_PASS,
        }
    }
}

/// Decides from the series so far (design.md §7):
/// - FAILED, at any time, on [`FAILED_CONSECUTIVE_FAILS`] (3) FAIL polls one after another, or
///   on more than [`FAILED_TOTAL_FAILS_ABOVE`] (3) FAIL polls in all;
/// - before the deadline (and before the last slot was polled): Continue to the next slot;
/// - at the deadline: HEALTHY when there were at most 1 FAIL poll, the last 2 valid polls are
///   PASS, and at least half the planned polls are valid (PASS or FAIL); anything else is
///   DEGRADED — not enough evidence is not proof of failure, and never proof of health.
///
/// "Consecutive" means adjacent in the series: an ERROR or NODATA poll between two FAIL polls
/// breaks the run. A tick polled twice counts once.
pub fn decide(series: &[Poll], params: &WatchParams, armed_at_ms: i64, now_ms: i64) -> Decision {
    decide_with(series, params, &Thresholds::default(), armed_at_ms, now_ms)
}

/// [`decide`] with explicit thresholds: the one implementation of the rules.
pub fn decide_with(
    series: &[Poll],
    params: &WatchParams,
    t: &Thresholds,
    armed_at_ms: i64,
    now_ms: i64,
) -> Decision {
    let stats = SeriesStats::of(series);
    let consecutive = t.failed_consecutive_fails;
    let above = t.failed_total_fails_above;
    let max_fails = t.healthy_max_fails;
    let last_n = t.healthy_last_valid_pass;
    if stats.max_consecutive_fail >= consecutive {
        return Decision::Final(
            Verdict::Failed,
            format!(
                "{} consecutive FAIL polls (FAILED at {consecutive}); {} FAIL of {} polls",
                stats.max_consecutive_fail, stats.fail, stats.polls
            ),
        );
    }
    if stats.fail > above {
        return Decision::Final(
            Verdict::Failed,
            format!(
                "{} FAIL polls of {} (FAILED above {above})",
                stats.fail, stats.polls
            ),
        );
    }
    let planned = planned_polls(params);
    let last_slot_polled = series.iter().any(|p| p.tick >= planned.saturating_sub(1));
    let deadline = deadline_ms(params, armed_at_ms);
    if now_ms < deadline && !last_slot_polled {
        let next = tick_at_ms(
            params,
            armed_at_ms,
            first_slot_after(params, armed_at_ms, now_ms),
        )
        .min(deadline);
        let wait_ms = u64::try_from(next.saturating_sub(now_ms)).unwrap_or(0);
        return Decision::Continue {
            next_delay_ms: wait_ms,
        };
    }
    let valid = stats.valid();
    let last_valid: Vec<CheckOutcome> = effective(series)
        .iter()
        .rev()
        .map(|p| p.status())
        .filter(|s| s.is_valid())
        .take(last_n)
        .collect();
    let mut missing = Vec::new();
    if stats.fail > max_fails {
        missing.push(format!(
            "{} FAIL polls (HEALTHY allows at most {max_fails})",
            stats.fail
        ));
    }
    if last_valid.len() < last_n || last_valid.iter().any(|s| *s != CheckOutcome::Pass) {
        let shown: Vec<&str> = last_valid.iter().rev().map(|s| s.as_str()).collect();
        missing.push(format!(
            "the last {last_n} valid polls are not all PASS (last valid: [{}])",
            shown.join(", ")
        ));
    }
    if u64::from(valid) * 2 < u64::from(planned) {
        missing.push(format!(
            "only {valid} of {planned} planned polls are valid (at least half needed)"
        ));
    }
    if missing.is_empty() {
        Decision::Final(
            Verdict::Healthy,
            format!(
                "{valid} of {planned} planned polls valid, {} FAIL, the last {last_n} valid polls PASS",
                stats.fail
            ),
        )
    } else {
        Decision::Final(
            Verdict::Degraded,
            format!("not enough evidence of health: {}", missing.join("; ")),
        )
    }
}

/// Lost evidence is never proof of health (design.md §7): a HEALTHY verdict reached on a
/// series that lost polls (a corrupt series, a node gone mid-watch) becomes DEGRADED, the
/// loss said in the reason; other verdicts stand. The monitor applies it to every verdict it
/// acts on, and replay to every verdict it re-derives.
pub fn discount_lost_evidence(
    verdict: Verdict,
    reason: String,
    lost: Option<&str>,
) -> (Verdict, String) {
    match (lost, verdict) {
        (Some(lost), Verdict::Healthy) => (
            Verdict::Degraded,
            format!("{reason}; but evidence was lost ({lost}): not proof of health"),
        ),
        (_, v) => (v, reason),
    }
}

/// The verdict of a watch a newer deploy superseded: the evidence so far judged as at the
/// deadline; a window not over by that judgement is DEGRADED (cut short: not enough evidence).
/// Lost evidence is discounted as always ([`discount_lost_evidence`]).
pub fn judge_superseded(
    series: &[Poll],
    params: &WatchParams,
    t: &Thresholds,
    armed_at_ms: i64,
    lost: Option<&str>,
) -> (Verdict, String) {
    let (verdict, why) = match decide_with(
        series,
        params,
        t,
        armed_at_ms,
        deadline_ms(params, armed_at_ms),
    ) {
        Decision::Final(v, why) => (v, why),
        Decision::Continue { .. } => (Verdict::Degraded, "the window is not over".to_owned()),
    };
    discount_lost_evidence(verdict, why, lost)
}

/// What to do about a verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reaction {
    /// Run the repo's rollback command, then verify it by polls.
    Rollback,
    /// Alert only; no change to production.
    AlertOnly {
        /// Why there is no rollback, or what is degraded.
        reason: String,
    },
    /// Nothing to do.
    None,
}

/// The reaction to a verdict (design.md §7): HEALTHY → none; DEGRADED → alert; FAILED → rollback
/// only if the watched revision is still the live one, else alert. An unknown live revision
/// is not proof that the watched revision is live: alert, never roll back blind.
///
/// Revisions match when equal (ignoring ASCII case and surrounding space), or when one is a
/// prefix of the other, the shorter being at least 7 hex digits (git's abbreviated ids).
pub fn reaction(verdict: Verdict, watched_revision: &str, live_revision: Option<&str>) -> Reaction {
    match verdict {
        Verdict::Healthy => Reaction::None,
        Verdict::Degraded => Reaction::AlertOnly {
            reason: "the watch ended DEGRADED: not enough evidence of health".into(),
        },
        Verdict::Failed => match live_revision {
            None => Reaction::AlertOnly {
                reason: format!(
                    "FAILED, but the live revision is unknown: not rolling back `{watched_revision}` blind"
                ),
            },
            Some(live) if same_revision(watched_revision, live) => Reaction::Rollback,
            Some(live) => Reaction::AlertOnly {
                reason: format!(
                    "FAILED, but the watched revision `{watched_revision}` is no longer live (live: `{live}`): not rolling back"
                ),
            },
        },
    }
}

fn same_revision(a: &str, b: &str) -> bool {
    let (a, b) = (a.trim().to_ascii_lowercase(), b.trim().to_ascii_lowercase());
    if a.is_empty() || b.is_empty() {
        return false;
    }
    if a == b {
        return true;
    }
    let (short, long) = if a.len() <= b.len() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    short.len() >= 7
        && short.bytes().all(|c| c.is_ascii_hexdigit())
        && long.starts_with(short.as_str())
}

/// What the monitor actually did (`action_taken` in `16-post-deploy-log.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionTaken {
    /// No action (HEALTHY).
    None,
    /// An alert was raised; production unchanged.
    Alert,
    /// The rollback ran and was verified.
    Rollback,
    /// The rollback was attempted and did not succeed (or could not be verified).
    RollbackFailed,
}

impl ActionTaken {
    /// `none`, `alert`, `rollback` or `rollback_failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            ActionTaken::None => "none",
            ActionTaken::Alert => "alert",
            ActionTaken::Rollback => "rollback",
            ActionTaken::RollbackFailed => "rollback_failed",
        }
    }
}

/// Everything `16-post-deploy-log.md` shows.
#[derive(Debug, Clone, Copy)]
pub struct PostDeployLog<'a> {
    /// The work item id.
    pub work_item: &'a str,
    /// When the log was produced (epoch ms).
    pub created_at_ms: i64,
    /// The watched (deployed) revision.
    pub revision: &'a str,
    /// The frozen parameters from `armed`.
    pub params: &'a WatchParams,
    /// When the watch was armed (epoch ms).
    pub armed_at_ms: i64,
    /// The whole series as read from the sentinel file.
    pub series: &'a [Poll],
    /// The final verdict.
    pub verdict: Verdict,
    /// Its reason.
    pub reason: &'a str,
    /// What was done.
    pub action: ActionTaken,
    /// A human note about the action (alert text, rollback command result).
    pub action_detail: &'a str,
    /// Set when evidence was lost (corrupt series, node gone): said, never silent.
    pub evidence_lost: Option<&'a str>,
}

/// Renders `docs/work-items/<id>/16-post-deploy-log.md` (design.md §7): frontmatter with the common
/// keys plus `post_deploy_status`, `action_taken`, `window_s`, `checks_total`,
/// `checks_failed`, `checks_errored`, `reason`, `revision`, and a body with the whole series.
/// It is a repository file, not replicated to the database (design.md §7), and the lessons loop's
/// source (BR-10, design.md §8).
///
/// The `checks_*` counts are of checks, as "check" means everywhere in the document (one
/// poll runs one check per configured endpoint: health, revision, control): `checks_total` =
/// every check of every poll, `checks_failed` = FAIL checks, `checks_errored` = checks that
/// were not evidence (ERROR or NODATA); so total = PASS checks + failed + errored. The body's
/// Counts section says so, beside the per-poll counts the verdict is decided on.
pub fn render_post_deploy_log(log: &PostDeployLog<'_>) -> String {
    let stats = SeriesStats::of(log.series);
    let planned = planned_polls(log.params);
    let mut out = render_frontmatter(&[
        ("work_item", FmValue::Str(log.work_item)),
        ("stage", FmValue::Str("observe")),
        ("author_agent", FmValue::Str("post-deploy-monitor")),
        ("status", FmValue::Str("final")),
        ("created_at", FmValue::Str(&rfc3339_utc(log.created_at_ms))),
        ("model_used", FmValue::Str("n/a")),
        ("post_deploy_status", FmValue::Str(log.verdict.as_str())),
        ("action_taken", FmValue::Str(log.action.as_str())),
        (
            "window_s",
            FmValue::Int(i64::try_from(log.params.window_s).unwrap_or(i64::MAX)),
        ),
        ("checks_total", FmValue::Int(i64::from(stats.checks))),
        ("checks_failed", FmValue::Int(i64::from(stats.checks_fail))),
        (
            "checks_errored",
            FmValue::Int(i64::from(stats.checks_errored)),
        ),
        ("reason", FmValue::Str(log.reason)),
        ("revision", FmValue::Str(log.revision)),
    ]);
    let _ = write!(
        out,
        "\n# 16 — Post-deploy log: {}\n\n## Summary\n\n**{}** — {}\n\nAction taken: `{}`{}\n",
        one_line(log.work_item),
        log.verdict.as_str(),
        one_line(log.reason),
        log.action.as_str(),
        if log.action_detail.trim().is_empty() {
            String::new()
        } else {
            format!(" — {}", one_line(log.action_detail))
        },
    );
    if let Some(lost) = log.evidence_lost {
        let _ = write!(out, "\n> Evidence lost: {}\n", one_line(lost));
    }
    let p = log.params;
    out.push_str("\n## Watch\n\n| key | value |\n|---|---|\n");
    for (key, value) in [
        ("revision", md_cell(log.revision, 200)),
        ("armed at", rfc3339_utc(log.armed_at_ms)),
        ("deadline", rfc3339_utc(deadline_ms(p, log.armed_at_ms))),
        ("window_s", p.window_s.to_string()),
        ("interval_s", p.interval_s.to_string()),
        ("initial_delay_s", p.initial_delay_s.to_string()),
        ("poll_timeout_s", p.poll_timeout_s.to_string()),
        ("planned polls", planned.to_string()),
    ] {
        let _ = writeln!(out, "| {key} | {value} |");
    }
    let _ = write!(
        out,
        "\n## Counts\n\n| polls | PASS | FAIL | ERROR | NODATA | valid | 5xx responses | longest FAIL run |\n|---|---|---|---|---|---|---|---|\n| {} | {} | {} | {} | {} | {} | {} | {} |\n",
        stats.polls,
        stats.pass,
        stats.fail,
        stats.error,
        stats.nodata,
        stats.valid(),
        stats.http_5xx,
        stats.max_consecutive_fail,
    );
    let _ = write!(
        out,
        "\nThe table counts polls (a poll's status is its worst check's); the verdict is decided on them. \
         The frontmatter's `checks_*` count checks: {} checks in {} polls (`checks_total`), {} FAIL \
         (`checks_failed`), {} ERROR or NODATA (`checks_errored`).\n",
        stats.checks, stats.polls, stats.checks_fail, stats.checks_errored,
    );
    out.push_str("\n## Series\n\n| tick | at | poll | check | outcome | status | latency | detail |\n|---|---|---|---|---|---|---|---|\n");
    if log.series.is_empty() {
        out.push_str("| — | — | — | (no polls recorded) | | | | |\n");
    }
    for poll in log.series {
        let at = rfc3339_utc(poll.at_ms);
        let status = poll.status().as_str();
        if poll.checks.is_empty() {
            let _ = writeln!(
                out,
                "| {} | {at} | {status} | (no checks) | | | | |",
                poll.tick
            );
        }
        for c in &poll.checks {
            let _ = writeln!(
                out,
                "| {} | {at} | {status} | {} | {} | {} | {} | {} |",
                poll.tick,
                md_cell(&c.name, 200),
                c.outcome.as_str(),
                c.status_code
                    .map_or_else(|| "—".to_string(), |s| s.to_string()),
                c.latency_ms
                    .map_or_else(|| "—".to_string(), |l| format!("{l} ms")),
                md_cell(&c.detail, 500),
            );
        }
    }
    let _ = write!(
        out,
        "\n## Reaction\n\n- post_deploy_status: `{}`\n- action_taken: `{}`\n- reason: {}\n",
        log.verdict.as_str(),
        log.action.as_str(),
        one_line(log.reason),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use CheckOutcome::*;

    const ARMED: i64 = 1_781_611_200_000;

    fn poll(tick: u32, outcomes: &[CheckOutcome]) -> Poll {
        Poll {
            tick,
            at_ms: tick_at_ms(&WatchParams::default(), ARMED, tick),
            checks: outcomes
                .iter()
                .enumerate()
                .map(|(i, o)| Check {
                    name: format!("check{i}"),
                    outcome: *o,
                    status_code: match o {
                        Pass => Some(200),
                        Fail => Some(503),
                        _ => None,
                    },
                    latency_ms: Some(12),
                    detail: String::new(),
                })
                .collect(),
        }
    }

    /// A series from a compact string, one poll per char: P=PASS F=FAIL E=ERROR N=NODATA.
    fn series(s: &str) -> Vec<Poll> {
        s.chars()
            .enumerate()
            .map(|(i, c)| {
                let o = match c {
                    'P' => Pass,
                    'F' => Fail,
                    'E' => Error,
                    'N' => NoData,
                    _ => panic!("bad series char {c}"),
                };
                poll(u32::try_from(i).unwrap(), &[o])
            })
            .collect()
    }

    /// The one place `decide` is called. `at` is seconds after arming.
    fn check(series_str: &str, at_s: i64, want: Option<Verdict>, reason_has: &str) {
        let got = decide(
            &series(series_str),
            &WatchParams::default(),
            ARMED,
            ARMED + at_s * 1_000,
        );
        match (&got, want) {
            (Decision::Final(v, reason), Some(w)) => {
                assert_eq!(*v, w, "series {series_str} at {at_s}s: {reason}");
                assert!(
                    reason.contains(reason_has),
                    "series {series_str}: reason {reason:?} lacks {reason_has:?}"
                );
            }
            (Decision::Continue { .. }, None) => {}
            _ => panic!("series {series_str} at {at_s}s: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn defaults_come_from_the_seed() {
        let p = WatchParams::default();
        assert_eq!(
            (
                p.window_s,
                p.interval_s,
                p.initial_delay_s,
                p.poll_timeout_s
            ),
            (600, 30, 30, 10)
        );
        assert_eq!(planned_polls(&p), 20);
        assert_eq!(deadline_ms(&p, ARMED), ARMED + 600_000);
        assert_eq!(p.validate(), Ok(()));
    }

    #[test]
    fn decision_table() {
        use Verdict::*;
        const END: i64 = 600; // the deadline with the defaults
        let p20 = "P".repeat(20);
        let cases: Vec<(String, i64, Option<Verdict>, &str)> = vec![
            // early FAILED: exactly 3 consecutive
            ("PFF".into(), 90, None, ""),
            ("PFFF".into(), 120, Some(Failed), "3 consecutive"),
            ("FFF".into(), 90, Some(Failed), "3 consecutive"),
            // a non-FAIL poll breaks the run
            ("FFEF".into(), 120, None, ""),
            ("FFNFP".into(), 150, None, ""),
            // total: 3 non-consecutive is not FAILED, 4 is
            ("FPFPFP".into(), 180, None, ""),
            ("FPFPFPF".into(), 210, Some(Failed), "4 FAIL polls"),
            // FAILED also at the deadline
            (
                format!("{}FPFPFPF", "P".repeat(13)),
                END,
                Some(Failed),
                "4 FAIL polls",
            ),
            // before the deadline nothing else is final, however good
            ("P".repeat(19), 570, None, ""),
            // HEALTHY at the deadline
            (p20.clone(), END, Some(Healthy), "20 of 20"),
            // exactly 1 FAIL is allowed, 2 are not
            (format!("F{}", "P".repeat(19)), END, Some(Healthy), "1 FAIL"),
            (
                format!("FP{}", "P".repeat(18).replacen('P', "F", 1)),
                END,
                Some(Degraded),
                "2 FAIL polls",
            ),
            // the last 2 valid polls must be PASS; invalid polls at the end are skipped over
            (
                format!("{}F", "P".repeat(19)),
                END,
                Some(Degraded),
                "last 2 valid",
            ),
            (
                format!("{}FP", "P".repeat(18)),
                END,
                Some(Degraded),
                "last 2 valid",
            ),
            (format!("{}FPP", "P".repeat(17)), END, Some(Healthy), ""),
            (format!("{}PPEN", "P".repeat(16)), END, Some(Healthy), ""),
            (
                format!("{}FPEN", "P".repeat(16)),
                END,
                Some(Degraded),
                "last 2 valid",
            ),
            // at least half the planned polls valid: 10 of 20 is enough, 9 is not
            (
                format!("{}{}", "E".repeat(10), "P".repeat(10)),
                END,
                Some(Healthy),
                "10 of 20",
            ),
            (
                format!("{}{}", "E".repeat(11), "P".repeat(9)),
                END,
                Some(Degraded),
                "only 9 of 20",
            ),
            // missing polls count like invalid ones
            ("P".repeat(9), END, Some(Degraded), "only 9 of 20"),
            ("P".repeat(10), END, Some(Healthy), ""),
            // all NODATA / all ERROR / empty: DEGRADED, never HEALTHY
            ("N".repeat(20), END, Some(Degraded), "only 0 of 20"),
            ("E".repeat(20), END, Some(Degraded), "only 0 of 20"),
            (String::new(), END, Some(Degraded), "only 0 of 20"),
            (String::new(), 0, None, ""),
            (String::new(), END + 3_600, Some(Degraded), ""),
            // one valid poll cannot satisfy the last-2 rule
            (
                format!("{}P", "N".repeat(19)),
                END,
                Some(Degraded),
                "last 2 valid",
            ),
        ];
        for (s, at, want, reason) in cases {
            check(&s, at, want, reason);
        }
    }

    #[test]
    fn the_last_slot_polled_ends_the_watch_even_if_the_clock_is_a_little_behind() {
        let s = series(&"P".repeat(20));
        let got = decide(&s, &WatchParams::default(), ARMED, ARMED + 599_000);
        assert!(
            matches!(got, Decision::Final(Verdict::Healthy, _)),
            "{got:?}"
        );
    }

    #[test]
    fn a_repeated_tick_counts_once() {
        // tick 1 polled twice (job re-run after a crash): FAIL, FAIL, FAIL but only 2 ticks
        let mut s = series("PF");
        s.push(poll(1, &[Fail]));
        s.push(poll(1, &[Fail]));
        assert!(matches!(
            decide(&s, &WatchParams::default(), ARMED, ARMED + 60_000),
            Decision::Continue { .. }
        ));
        let mut s = series(&"P".repeat(20));
        s.insert(5, poll(19, &[Fail])); // a later duplicate of tick 19 changes nothing
        assert_eq!(SeriesStats::of(&s).polls, 20);
    }

    #[test]
    fn continue_waits_for_the_next_slot() {
        let p = WatchParams::default();
        let cont = |now_s: i64| match decide(&[], &p, ARMED, ARMED + now_s * 1_000) {
            Decision::Continue { next_delay_ms } => next_delay_ms,
            other => panic!("{other:?}"),
        };
        assert_eq!(cont(0), 30_000, "first poll after the initial delay");
        assert_eq!(
            cont(30),
            30_000,
            "a poll just ran at slot 0: next is slot 1"
        );
        assert_eq!(cont(31), 29_000);
        assert_eq!(cont(575), 25_000, "the last slot is the deadline");
        let at_ms = ARMED + 30_500;
        assert_eq!(
            decide(&[], &p, ARMED, at_ms),
            Decision::Continue {
                next_delay_ms: 29_500
            },
            "aimed at the next slot's instant, not rounded to a second"
        );
    }

    #[test]
    fn next_tick_recovers_from_the_job_count() {
        let p = WatchParams::default();
        let s = |x: i64| ARMED + x * 1_000;
        // (jobs so far, now) -> slot time
        for (jobs, now, want) in [
            (0, s(0), Some(s(30))),
            (1, s(30), Some(s(60))),
            (5, s(150), Some(s(180))),
            // a restart before the slot: the same slot, not a repeat of an earlier one
            (5, s(100), Some(s(180))),
            // the count lags (a job row was cleaned up): never a past slot
            (1, s(300), Some(s(330))),
            // the worker was down: missed slots are skipped, not burst
            (3, s(401), Some(s(420))),
            (19, s(570), Some(s(600))),
            (20, s(570), None),
            (3, s(600), None),
            (0, s(10_000), None),
        ] {
            assert_eq!(
                next_tick_ms(&p, ARMED, jobs, now),
                want,
                "jobs {jobs} now {now}"
            );
        }
    }

    #[test]
    fn schedule_edges() {
        let p = |window_s, interval_s, initial_delay_s| WatchParams {
            window_s,
            interval_s,
            initial_delay_s,
            poll_timeout_s: 1,
        };
        assert_eq!(planned_polls(&p(100, 30, 30)), 3); // 30, 60, 90
        assert_eq!(deadline_ms(&p(100, 30, 30), 0), 90_000);
        assert_eq!(planned_polls(&p(10, 30, 30)), 1);
        assert_eq!(
            planned_polls(&p(600, 0, 30)),
            571,
            "interval 0 is treated as 1"
        );
        assert_eq!(planned_polls(&p(u64::MAX, 1, 0)), u32::MAX);
        assert_eq!(
            tick_at_ms(&p(u64::MAX, u64::MAX, u64::MAX), i64::MAX - 5, u32::MAX),
            i64::MAX
        );
        assert_eq!(p(600, 0, 30).validate(), Err(ParamsError::ZeroInterval));
        assert!(matches!(
            p(10, 30, 30).validate(),
            Err(ParamsError::TooFewPolls { planned: 1, .. })
        ));
        let q = WatchParams {
            poll_timeout_s: 30,
            ..WatchParams::default()
        };
        assert!(matches!(q.validate(), Err(ParamsError::PollTimeout { .. })));
    }

    #[test]
    fn poll_status_aggregation() {
        for (outcomes, want) in [
            (vec![], NoData),
            (vec![Pass], Pass),
            (vec![Pass, Pass], Pass),
            (vec![Pass, Fail], Fail),
            (vec![Error, Fail], Fail),
            (vec![Pass, Error], Error),
            (vec![Pass, NoData], NoData),
            (vec![NoData, Error], Error),
        ] {
            assert_eq!(poll(0, &outcomes).status(), want, "{outcomes:?}");
        }
    }

    #[test]
    fn reactions() {
        let sha = "0123456789abcdef0123456789abcdef01234567";
        for (verdict, live, want_rollback) in [
            (Verdict::Failed, Some(sha), true),
            (
                Verdict::Failed,
                Some(" 0123456789ABCDEF0123456789ABCDEF01234567 "),
                true,
            ),
            (Verdict::Failed, Some("0123456"), true),
            (Verdict::Failed, Some("012345"), false),
            (Verdict::Failed, Some("fedcba9876543210"), false),
            (Verdict::Failed, Some(""), false),
            (Verdict::Failed, None, false),
            (Verdict::Degraded, Some(sha), false),
            (Verdict::Healthy, Some(sha), false),
        ] {
            let r = reaction(verdict, sha, live);
            assert_eq!(
                r == Reaction::Rollback,
                want_rollback,
                "{verdict:?} live {live:?}: {r:?}"
            );
        }
        assert_eq!(reaction(Verdict::Healthy, sha, None), Reaction::None);
        assert!(matches!(
            reaction(Verdict::Degraded, sha, None),
            Reaction::AlertOnly { .. }
        ));
        match reaction(Verdict::Failed, sha, None) {
            Reaction::AlertOnly { reason } => assert!(reason.contains("unknown"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            reaction(Verdict::Failed, "", Some("")),
            Reaction::AlertOnly { .. }
        ));
    }

    #[test]
    fn persisted_spellings_are_stable() {
        let p = Poll {
            tick: 3,
            at_ms: 5,
            checks: vec![Check {
                name: "health".into(),
                outcome: NoData,
                status_code: None,
                latency_ms: Some(7),
                detail: "x".into(),
            }],
        };
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(
            json,
            r#"{"tick":3,"at_ms":5,"checks":[{"name":"health","outcome":"NODATA","status_code":null,"latency_ms":7,"detail":"x"}]}"#
        );
        assert_eq!(serde_json::from_str::<Poll>(&json).unwrap(), p);
        for (o, s) in [
            (Pass, "\"PASS\""),
            (Fail, "\"FAIL\""),
            (Error, "\"ERROR\""),
            (NoData, "\"NODATA\""),
        ] {
            assert_eq!(serde_json::to_string(&o).unwrap(), s);
        }
        assert_eq!(
            serde_json::to_string(&Verdict::Degraded).unwrap(),
            "\"DEGRADED\""
        );
        assert_eq!(
            serde_json::to_string(&ActionTaken::RollbackFailed).unwrap(),
            "\"rollback_failed\""
        );
    }

    fn frontmatter_block(doc: &str) -> &str {
        let rest = doc.strip_prefix("---\n").expect("starts with ---");
        let end = rest.find("\n---\n").expect("closing ---");
        &rest[..end + 1]
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct PostDeployFrontmatter {
        work_item: String,
        stage: String,
        author_agent: String,
        status: String,
        created_at: String,
        model_used: String,
        post_deploy_status: String,
        action_taken: String,
        window_s: u64,
        checks_total: u32,
        checks_failed: u32,
        checks_errored: u32,
        reason: String,
        revision: String,
    }

    #[test]
    fn post_deploy_log_renders_the_whole_series() {
        let mut s = series("PPFENPP");
        s[2].checks[0].detail = "HTTP 503 | upstream: \"down\"\nretry".into();
        s[4].checks.clear();
        let reason = "FAILED: 3 consecutive: FAIL #1";
        let doc = render_post_deploy_log(&PostDeployLog {
            work_item: "ORCH-21",
            created_at_ms: ARMED + 700_000,
            revision: "abc1234",
            params: &WatchParams::default(),
            armed_at_ms: ARMED,
            series: &s,
            verdict: Verdict::Failed,
            reason,
            action: ActionTaken::Rollback,
            action_detail: "rolled back to 9f9f9f9",
            evidence_lost: Some("series was corrupt at tick 2"),
        });
        let fm: PostDeployFrontmatter = serde_saphyr::from_str(frontmatter_block(&doc)).unwrap();
        assert_eq!(fm.work_item, "ORCH-21");
        assert_eq!(fm.stage, "observe");
        assert_eq!(fm.author_agent, "post-deploy-monitor");
        assert_eq!(fm.status, "final");
        assert_eq!(fm.created_at, "2026-06-16T12:11:40Z");
        assert_eq!(fm.model_used, "n/a");
        assert_eq!(fm.post_deploy_status, "FAILED");
        assert_eq!(fm.action_taken, "rollback");
        assert_eq!(fm.window_s, 600);
        // Checks, not polls: the poll without checks counts none.
        assert_eq!(
            (fm.checks_total, fm.checks_failed, fm.checks_errored),
            (6, 1, 1)
        );
        assert!(
            doc.contains("6 checks in 7 polls (`checks_total`), 1 FAIL (`checks_failed`), 1 ERROR or NODATA (`checks_errored`)"),
            "{doc}"
        );
        assert_eq!(fm.reason, reason);
        assert_eq!(fm.revision, "abc1234");
        assert!(doc.lines().any(|l| l == "post_deploy_status: FAILED"));
        let series_rows = doc
            .lines()
            .filter(|l| {
                l.contains("T12:")
                    && l[2..]
                        .split(' ')
                        .next()
                        .is_some_and(|c| c.parse::<u32>().is_ok())
            })
            .count();
        assert_eq!(
            series_rows, 7,
            "one row per check, including the poll with no checks:\n{doc}"
        );
        assert!(doc.contains("| 2 | 2026-06-16T12:01:30Z | FAIL | check0 | FAIL | 503 | 12 ms | HTTP 503 \\| upstream: \"down\"<br>retry |"), "{doc}");
        assert!(
            doc.contains("| 4 | 2026-06-16T12:02:30Z | NODATA | (no checks) |"),
            "{doc}"
        );
        assert!(doc.contains("Evidence lost: series was corrupt at tick 2"));
        assert!(
            doc.contains("| 7 | 4 | 1 | 1 | 1 | 5 | 1 | 1 |"),
            "counts row:\n{doc}"
        );

        let empty = render_post_deploy_log(&PostDeployLog {
            work_item: "ORCH-21",
            created_at_ms: 0,
            revision: "r",
            params: &WatchParams::default(),
            armed_at_ms: 0,
            series: &[],
            verdict: Verdict::Degraded,
            reason: "r",
            action: ActionTaken::Alert,
            action_detail: "",
            evidence_lost: None,
        });
        assert!(empty.contains("(no polls recorded)"));
        let fm: PostDeployFrontmatter = serde_saphyr::from_str(frontmatter_block(&empty)).unwrap();
        assert_eq!(
            (
                fm.checks_total,
                fm.post_deploy_status.as_str(),
                fm.action_taken.as_str()
            ),
            (0, "DEGRADED", "alert")
        );
    }
}
