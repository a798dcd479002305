//! Delivery metrics (issue 32): the four DORA keys and what only orch can say, computed from a
//! task's recorded events and agent runs — no table or column of their own.
//!
//! Pure: the caller passes the records ([`ItemRecord`]) and the time range ([`Range`]); there
//! is no clock here (a relative `--since 7d` is resolved by [`parse_instant`] against a `now`
//! the caller passes). The store reads the records (`Store::report_records`), the API and the
//! CLI render a [`Report`].
//!
//! The definitions (DORA's published ones, read on orch's records):
//! - **A production deploy** is a deploy command's recorded end: `deploy.confirmed` (the new
//!   revision live and healthy), `deploy.failed` or `deploy.unconfirmed`. It counts in the range
//!   its end falls in.
//! - **Deployment frequency**: those deploys in the range, per day of the range.
//! - **Lead time for changes**: for each *confirmed* deploy in the range (a healthy production
//!   deploy), its time minus the item's submission, and minus its first commit (the end of its
//!   first `implementation` visit: orch commits the developer's work on the item's branch and
//!   then advances). Median and 90th percentile.
//! - **Change failure rate**: the deploys in the range that were afterwards rolled back (by the
//!   deploy's own rollback or the watch's) or reverted on the default branch, over the deploys
//!   in the range.
//! - **Time to restore**: for each such failure detected in the range, from the detection (the
//!   failed or unconfirmed deploy, the watch's `FAILED` verdict, or a rollback starting,
//!   whichever is recorded first) to production verified healthy again (a verified rollback, or
//!   orch settling production `healthy`). A failure never restored is counted, not timed.
//!
//! orch's own figures, over the items that **ended** in the range (their outcome is
//! [`crate::outcome::outcome_of`]'s): the spend of all of them (failed ones included: that is
//! what shipping cost) per shipped item; agent runs and review loops (`stage.loop_back` from
//! `review`) per shipped item; staging verdicts in the range (passed: `release.staged`; the
//! change's failures: a loop back from `staging`; infrastructure errors: a staging tool-error
//! defer, or the item failed at `staging` when they were exhausted); the time items waited for
//! the repo's release track (each `release.waiting` to the stage change that ended it); and
//! every figure of the agent runs by backend and model.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::control::{self, events as kind, markers};
use crate::monitor::{ActionTaken, Verdict};
use crate::outcome::{self, EventView, Outcome, RollbackFact};
use crate::payload::{
    self, ProductionChecked, RollbackResult, Settled, StageChange, StageRequeued, WatchVerdict,
};

/// Epoch milliseconds.
pub type Millis = i64;

const DAY_MS: Millis = 86_400_000;

/// The stage whose first completion is an item's first commit.
pub const FIRST_COMMIT_STAGE: &str = "implementation";
/// The stage whose loops back are review loops.
pub const REVIEW_STAGE: &str = "review";
/// The staging stage.
pub const STAGING_STAGE: &str = "staging";

/// The event kinds a report reads (the outcome's facts and the report's own).
pub fn kinds() -> Vec<&'static str> {
    let mut k: Vec<&'static str> = outcome::FACT_KINDS.to_vec();
    k.extend([
        kind::STAGE_ADVANCED,
        kind::STAGE_LOOP_BACK,
        kind::STAGE_REQUEUED,
        kind::RELEASE_WAITING,
        kind::RELEASE_STAGED,
        kind::DEPLOY_ROLLBACK_STARTED,
        kind::POST_DEPLOY_ROLLBACK_STARTED,
        // Where a deploy's visit starts and where a retry starts over (the deploy segments).
        kind::DEPLOY_STARTED,
        kind::TASK_RETRIED,
    ]);
    k.sort_unstable();
    k.dedup();
    k
}

/// A half-open time range `[since, until)` in epoch milliseconds; `since < until`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Included.
    pub since: Millis,
    /// Excluded.
    pub until: Millis,
}

impl Range {
    /// The range, refused when it is empty or reversed.
    pub fn new(since: Millis, until: Millis) -> Result<Range, String> {
        if since >= until {
            return Err(format!(
                "the range is empty: since ({}) is not before until ({})",
                crate::text::rfc3339_utc(since),
                crate::text::rfc3339_utc(until)
            ));
        }
        Ok(Range { since, until })
    }

    /// Whether `t` is in the range.
    pub fn contains(&self, t: Millis) -> bool {
        self.since <= t && t < self.until
    }

    /// The range's length in days (fractional).
    pub fn days(&self) -> f64 {
        (self.until - self.since) as f64 / DAY_MS as f64
    }
}

/// The window a report covers when the caller names no `since`: 30 days.
pub const DEFAULT_WINDOW_MS: Millis = 30 * DAY_MS;

impl Range {
    /// The range of `--since`/`--until` (`?since=`/`?until=`), each parsed by
    /// [`parse_instant`] against `now`: `until` defaults to `now`, `since` to
    /// [`DEFAULT_WINDOW_MS`] before `until`.
    pub fn parse(since: Option<&str>, until: Option<&str>, now: Millis) -> Result<Range, String> {
        let until = match until {
            Some(u) => parse_instant(u, now).map_err(|e| format!("until: {e}"))?,
            None => now,
        };
        let since = match since {
            Some(s) => parse_instant(s, now).map_err(|e| format!("since: {e}"))?,
            None => until.saturating_sub(DEFAULT_WINDOW_MS),
        };
        Range::new(since, until)
    }
}

/// Parses an instant of `--since`/`--until`/`?since=`: an RFC 3339 UTC time
/// (`2026-12-01T08:00:00Z`, fractional seconds and a `±hh:mm` offset allowed), a date
/// (`2026-12-01`, its UTC midnight), epoch milliseconds (all digits), `now`, or a duration before
/// `now` (`90m`, `36h`, `7d`, `2w`).
pub fn parse_instant(s: &str, now: Millis) -> Result<Millis, String> {
    let s = s.trim();
    let bad = || {
        format!(
            "`{}` is not a time: use an RFC 3339 time (2026-12-01T08:00:00Z), a date (2026-12-01), epoch milliseconds, `now`, or a duration before now (90m, 36h, 7d, 2w)",
            crate::text::escape(s)
        )
    };
    if s.is_empty() || s.len() > 40 {
        return Err(bad());
    }
    if s == "now" {
        return Ok(now);
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse::<Millis>().map_err(|_| bad());
    }
    if let Some(unit) = s.chars().last().filter(|c| "mhdw".contains(*c)) {
        let n = &s[..s.len() - 1];
        if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) {
            let n: i64 = n.parse().map_err(|_| bad())?;
            let unit_ms = match unit {
                'm' => 60_000,
                'h' => 3_600_000,
                'd' => DAY_MS,
                _ => 7 * DAY_MS,
            };
            return n
                .checked_mul(unit_ms)
                .and_then(|d| now.checked_sub(d))
                .ok_or_else(bad);
        }
    }
    parse_rfc3339(s).ok_or_else(bad)
}

fn digits(s: &str) -> Option<i64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn parse_rfc3339(s: &str) -> Option<Millis> {
    if !s.is_ascii() || s.len() < 10 {
        return None;
    }
    let b = s.as_bytes();
    if b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let (y, m, d) = (digits(&s[0..4])?, digits(&s[5..7])?, digits(&s[8..10])?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let month_len = [
        31,
        if leap { 29 } else { 28 },
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
    if !(1..=12).contains(&m) || d < 1 || d > month_len[usize::try_from(m - 1).ok()?] {
        return None;
    }
    let day_ms = days_from_civil(y, m, d) * DAY_MS;
    if s.len() == 10 {
        return Some(day_ms);
    }
    let rest = &s[10..];
    let rest = rest.strip_prefix(['T', 't', ' '])?;
    if rest.len() < 8 || rest.as_bytes()[2] != b':' || rest.as_bytes()[5] != b':' {
        return None;
    }
    let (hh, mm, ss) = (
        digits(&rest[0..2])?,
        digits(&rest[3..5])?,
        digits(&rest[6..8])?,
    );
    if hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    let mut tail = &rest[8..];
    let mut frac_ms = 0;
    if let Some(f) = tail.strip_prefix('.') {
        let n = f.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return None;
        }
        let ms3: String = f[..n].chars().chain("000".chars()).take(3).collect();
        frac_ms = digits(&ms3)?;
        tail = &f[n..];
    }
    let offset_ms = match tail {
        "Z" | "z" => 0,
        t if t.len() == 6 && (t.starts_with('+') || t.starts_with('-')) && &t[3..4] == ":" => {
            let (oh, om) = (digits(&t[1..3])?, digits(&t[4..6])?);
            if oh > 23 || om > 59 {
                return None;
            }
            let o = (oh * 60 + om) * 60_000;
            if t.starts_with('+') { o } else { -o }
        }
        _ => return None,
    };
    Some(day_ms + ((hh * 60 + mm) * 60 + ss) * 1_000 + frac_ms - offset_ms)
}

/// One recorded event of an item, as the report reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemEvent {
    /// The event kind.
    pub kind: String,
    /// The stage recorded on the event.
    pub stage: Option<String>,
    /// The event's message.
    pub message: String,
    /// The event's data (`Null` when it had none).
    pub data: Value,
    /// When it was recorded.
    pub at: Millis,
}

/// One agent run of an item.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemRun {
    /// The backend (`claude`, `codex`, `command`, …).
    pub backend: String,
    /// The model, when one was named.
    pub model: Option<String>,
    /// `None`: the cost is unknown (still running, or the CLI did not say).
    pub cost_usd: Option<f64>,
}

/// One work item with what the report reads of it.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemRecord {
    /// The item's repo.
    pub repo: String,
    /// The current stage (terminal when it ended).
    pub stage: String,
    /// Submission.
    pub created_at: Millis,
    /// Its last stage change: when it ended, for a terminal stage.
    pub updated_at: Millis,
    /// Its events of [`kinds`], oldest first.
    pub events: Vec<ItemEvent>,
    /// Its agent runs.
    pub runs: Vec<ItemRun>,
}

/// Durations of some events: how many, their median, 90th percentile and mean.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Durations {
    /// How many.
    pub count: u64,
    /// The median (nearest rank).
    pub median_ms: Option<Millis>,
    /// The 90th percentile (nearest rank).
    pub p90_ms: Option<Millis>,
    /// The mean.
    pub mean_ms: Option<Millis>,
    /// Their sum.
    pub total_ms: Millis,
}

impl Durations {
    /// Nearest-rank percentiles of the samples (no interpolation: every figure is a sample).
    pub fn of(mut samples: Vec<Millis>) -> Durations {
        samples.sort_unstable();
        let n = samples.len();
        let rank = |p: usize| samples[(n * p).div_ceil(100).max(1) - 1];
        let total: Millis = samples.iter().sum();
        Durations {
            count: n as u64,
            median_ms: (n > 0).then(|| rank(50)),
            p90_ms: (n > 0).then(|| rank(90)),
            mean_ms: (n > 0).then(|| total / n as i64),
            total_ms: total,
        }
    }
}

/// Staging verdicts recorded in the range.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StagingVerdicts {
    /// Staging passed (`release.staged`).
    pub passed: u64,
    /// The change failed staging (sent back to `implementation`).
    pub change_failures: u64,
    /// The staging environment failed, not the change (a tool-error defer, or the item failed
    /// at staging once they were exhausted).
    pub infrastructure_errors: u64,
}

/// The figures of the agent runs of one backend and model, over the items that ended in the
/// range.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentFigures {
    /// The backend.
    pub backend: String,
    /// `None`: the backend's default (no model recorded).
    pub model: Option<String>,
    /// Its runs.
    pub runs: u64,
    /// The known costs' sum: a lower bound while `unknown_cost_runs > 0`.
    pub cost_usd: f64,
    /// Runs whose cost is not known.
    pub unknown_cost_runs: u64,
    /// Items it ran for.
    pub items: u64,
    /// Of those, shipped.
    pub shipped: u64,
    /// Of those, with a production deploy rolled back or reverted.
    pub change_failures: u64,
}

/// The figures over a set of items (one repo's, or all).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    // --- DORA, over the deploys in the range
    /// Production deploys whose end fell in the range.
    pub deploys: u64,
    /// `deploys` per day of the range.
    pub deploys_per_day: f64,
    /// Confirmed deploys: the deploy minus the item's submission.
    pub lead_time_from_submission: Durations,
    /// Confirmed deploys: the deploy minus the item's first commit.
    pub lead_time_from_first_commit: Durations,
    /// Deploys in the range afterwards rolled back or reverted (`rolled_back + reverted`).
    pub change_failures: u64,
    /// Deploys rolled back (not reverted).
    pub rolled_back: u64,
    /// Deploys rolled back and reverted, or reverted.
    pub reverted: u64,
    /// `change_failures / deploys`; `None` without a deploy.
    pub change_failure_rate: Option<f64>,
    /// Failures detected in the range and restored.
    pub time_to_restore: Durations,
    /// Failures detected in the range that no record shows restored.
    pub unrestored: u64,
    // --- orch's own, over the items that ended in the range
    /// Items that ended in the range, by outcome (`shipped`, `rolled_back`, …).
    pub ended: BTreeMap<&'static str, u64>,
    /// Ended items that shipped.
    pub shipped: u64,
    /// The ended items' agent runs.
    pub agent_runs: u64,
    /// Known costs of the ended items' runs (a lower bound while `unknown_cost_runs > 0`).
    pub cost_usd: f64,
    /// Runs of the ended items whose cost is not known.
    pub unknown_cost_runs: u64,
    /// `cost_usd / shipped`.
    pub cost_per_shipped_usd: Option<f64>,
    /// The shipped items' agent runs per shipped item.
    pub agent_runs_per_shipped: Option<f64>,
    /// The shipped items' loops back from `review` per shipped item.
    pub review_loops_per_shipped: Option<f64>,
    /// Staging verdicts recorded in the range.
    pub staging: StagingVerdicts,
    /// Waits for the release track that began in the range and have ended.
    pub release_wait: Durations,
    /// The ended items' agent runs by backend and model, sorted.
    pub by_agent: Vec<AgentFigures>,
}

/// The report: the range, every item's figures, and each repo's.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The range it covers.
    pub range: Range,
    /// Every item's figures.
    pub overall: Figures,
    /// By repo name, sorted.
    pub repos: Vec<(String, Figures)>,
    /// The trend: every item's figures week by week (weeks start on Monday 00:00 UTC; the
    /// first and last are cut to the range), oldest first, at most [`MAX_WEEKS`] (the latest).
    pub weekly: Vec<(Range, Figures)>,
    /// Where the time of the items that ended in the range went, stage by stage.
    pub stage_time: Vec<StageTime>,
}

/// The most weeks a report's trend holds (about two years; older weeks are left out of the
/// trend, never out of the report's figures).
pub const MAX_WEEKS: usize = 104;

/// How long the items that ended in the range stayed at one stage: per item, the sum of its
/// visits (from entering the stage to leaving it, waits for an approval or the release track
/// included).
#[derive(Debug, Clone, PartialEq)]
pub struct StageTime {
    /// The stage.
    pub stage: String,
    /// Per item that visited it, its time there.
    pub time: Durations,
}

/// The report over `items` for `range` (items may be in any order; each item's events oldest
/// first).
pub fn report(items: &[ItemRecord], range: Range) -> Report {
    let mut by_repo: BTreeMap<&str, Vec<&ItemRecord>> = BTreeMap::new();
    for i in items {
        by_repo.entry(i.repo.as_str()).or_default().push(i);
    }
    let all: Vec<&ItemRecord> = items.iter().collect();
    Report {
        range,
        overall: figures(&all, range),
        repos: by_repo
            .into_iter()
            .map(|(repo, items)| (repo.to_owned(), figures(&items, range)))
            .collect(),
        weekly: weekly(&all, range),
        stage_time: stage_time(&all, range),
    }
}

const WEEK_MS: Millis = 7 * DAY_MS;
/// 1970-01-01 was a Thursday: the first Monday after the epoch is 4 days later.
const MONDAY_MS: Millis = 4 * DAY_MS;

/// The weeks of `range` (Monday 00:00 UTC to the next, cut to the range), the latest
/// [`MAX_WEEKS`], oldest first.
pub fn weeks(range: Range) -> Vec<Range> {
    let monday = |t: Millis| t - (t - MONDAY_MS).rem_euclid(WEEK_MS);
    let mut out = Vec::new();
    let mut start = monday(range.until.saturating_sub(1));
    while out.len() < MAX_WEEKS {
        let since = start.max(range.since);
        let until = start.saturating_add(WEEK_MS).min(range.until);
        out.push(Range { since, until });
        if since <= range.since {
            break;
        }
        start -= WEEK_MS;
    }
    out.reverse();
    out
}

/// [`figures`] week by week. Each week reads only the items whose record touches it (from
/// the submission to the last event or update): every figure of a week comes from an event or
/// an end inside it, so the others add nothing, and a long range costs about one pass.
fn weekly(items: &[&ItemRecord], range: Range) -> Vec<(Range, Figures)> {
    let weeks = weeks(range);
    let mut of_week: Vec<Vec<&ItemRecord>> = vec![Vec::new(); weeks.len()];
    for &item in items {
        let last = item
            .events
            .iter()
            .map(|e| e.at)
            .chain([item.updated_at, item.created_at])
            .max()
            .unwrap_or(item.created_at);
        let first = item
            .events
            .iter()
            .map(|e| e.at)
            .chain([item.created_at])
            .min()
            .unwrap_or(item.created_at);
        let from = weeks.partition_point(|w| w.until <= first);
        for (w, bucket) in weeks.iter().zip(of_week.iter_mut()).skip(from) {
            if w.since > last {
                break;
            }
            bucket.push(item);
        }
    }
    weeks
        .into_iter()
        .zip(of_week)
        .map(|(w, items)| (w, figures(&items, w)))
        .collect()
}

/// Where the time of the items that ended in `range` went, stage by stage, in the order the
/// stages first appear in the items' histories.
fn stage_time(items: &[&ItemRecord], range: Range) -> Vec<StageTime> {
    let mut order: Vec<String> = Vec::new();
    let mut per_stage: BTreeMap<String, Vec<Millis>> = BTreeMap::new();
    for item in items {
        if !(control::is_terminal_stage(&item.stage) && range.contains(item.updated_at)) {
            continue;
        }
        let mut spent: BTreeMap<String, Millis> = BTreeMap::new();
        let mut visits: Vec<String> = Vec::new();
        // The stage the item is at and since when; the first move names where it started.
        let mut at: Option<(String, Millis)> = None;
        for e in &item.events {
            let entered = match e.kind.as_str() {
                kind::STAGE_ADVANCED | kind::STAGE_LOOP_BACK | kind::TASK_RETRIED => {
                    e.stage.clone()
                }
                k if kind::TASK_ENDED.contains(&k) => None,
                _ => continue,
            };
            let current = at
                .take()
                .or_else(|| from_stage(e).map(|f| (f, item.created_at)));
            if let Some((stage, since)) = current {
                *spent.entry(stage.clone()).or_default() += (e.at - since).max(0);
                visits.push(stage);
            }
            if let Some(stage) = entered.filter(|s| !control::is_terminal_stage(s)) {
                at = Some((stage, e.at));
            }
        }
        for stage in visits {
            if !order.contains(&stage) {
                order.push(stage);
            }
        }
        for (stage, ms) in spent {
            per_stage.entry(stage).or_default().push(ms);
        }
    }
    order
        .into_iter()
        .filter_map(|stage| {
            let samples = per_stage.remove(&stage)?;
            Some(StageTime {
                time: Durations::of(samples),
                stage,
            })
        })
        .collect()
}

/// The event's data as a stage change (`None` when it is not one).
fn change_of(e: &ItemEvent) -> Option<StageChange> {
    payload::read_value(&e.data)
}

/// The stage a stage change left.
fn from_stage(e: &ItemEvent) -> Option<String> {
    change_of(e)?.from
}

fn is_deploy_end(k: &str) -> bool {
    matches!(
        k,
        kind::DEPLOY_CONFIRMED | kind::DEPLOY_FAILED | kind::DEPLOY_UNCONFIRMED
    )
}

/// One production deploy of an item and what followed it (until the item's next deploy).
struct Deploy {
    at: Millis,
    confirmed: bool,
    /// Rolled back (`false`: reverted) — `None` when it was neither.
    failure: Option<bool>,
    detected_at: Option<Millis>,
    restored_at: Option<Millis>,
}

fn views(events: &[ItemEvent]) -> Vec<EventView<'_>> {
    events
        .iter()
        .map(|e| EventView {
            kind: &e.kind,
            stage: e.stage.as_deref(),
            message: &e.message,
            data: &e.data,
        })
        .collect()
}

fn deploys_of(events: &[ItemEvent]) -> Vec<Deploy> {
    let starts: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| is_deploy_end(&e.kind))
        .map(|(i, _)| i)
        .collect();
    let mut out = Vec::new();
    for (n, &at_end) in starts.iter().enumerate() {
        // The deploy's segment is its visit: from its `deploy.started` (a deploy that fails
        // rolls back and reverts *before* it records `deploy.failed`, so those facts come
        // first) up to the next deploy's start, the next deploy's end, or a retry (which starts
        // over). A history without `deploy.started` starts the segment after the previous end.
        let floor = if n == 0 { 0 } else { starts[n - 1] + 1 };
        let start = events[floor..=at_end]
            .iter()
            .rposition(|e| e.kind == kind::DEPLOY_STARTED)
            .map_or(at_end, |p| floor + p);
        let next_start = events[at_end + 1..]
            .iter()
            .position(|e| e.kind == kind::TASK_RETRIED || e.kind == kind::DEPLOY_STARTED)
            .map_or(events.len(), |p| at_end + 1 + p);
        let end = next_start.min(starts.get(n + 1).copied().unwrap_or(events.len()));
        let seg = &events[start..end];
        let v = views(seg);
        let Some(f) = outcome::facts_of(control::DONE, &v) else {
            continue;
        };
        let rolled = f.rollback != RollbackFact::NotRun
            || matches!(
                f.action,
                Some(ActionTaken::Rollback | ActionTaken::RollbackFailed)
            );
        let failure = if f.reverted {
            Some(false)
        } else if rolled {
            Some(true)
        } else {
            None
        };
        let first = &events[at_end];
        let detected_at = failure.and_then(|_| {
            seg.iter().find_map(|e| {
                let failed = match e.kind.as_str() {
                    kind::DEPLOY_FAILED | kind::DEPLOY_UNCONFIRMED => true,
                    kind::POST_DEPLOY_VERDICT => {
                        WatchVerdict::verdict_in(&e.data, &e.message) == Some(Verdict::Failed)
                    }
                    kind::DEPLOY_ROLLBACK_STARTED | kind::POST_DEPLOY_ROLLBACK_STARTED => true,
                    _ => false,
                };
                failed.then_some(e.at)
            })
        });
        let restored_at = detected_at.and_then(|d| {
            seg.iter().filter(|e| e.at >= d).find_map(|e| {
                let back = match e.kind.as_str() {
                    kind::DEPLOY_ROLLED_BACK | kind::RELEASE_ROLLED_BACK => true,
                    kind::POST_DEPLOY_ROLLBACK => RollbackResult::verified_in(&e.data),
                    kind::PRODUCTION_CHECKED => payload::read_value::<ProductionChecked>(&e.data)
                        .is_some_and(|c| c.settled == Settled::Healthy),
                    _ => false,
                };
                back.then_some(e.at)
            })
        });
        out.push(Deploy {
            at: first.at,
            confirmed: first.kind == kind::DEPLOY_CONFIRMED,
            failure,
            detected_at,
            restored_at,
        });
    }
    out
}

fn per(n: f64, d: u64) -> Option<f64> {
    (d > 0).then(|| n / d as f64)
}

fn figures(items: &[&ItemRecord], range: Range) -> Figures {
    let mut f = Figures::default();
    let mut lead_sub = Vec::new();
    let mut lead_commit = Vec::new();
    let mut restore = Vec::new();
    let mut waits = Vec::new();
    let mut review_loops_shipped = 0_u64;
    let mut runs_shipped = 0_u64;
    let mut agents: BTreeMap<(String, Option<String>), (AgentFigures, BTreeSet<usize>)> =
        BTreeMap::new();
    for (idx, item) in items.iter().enumerate() {
        let ev = &item.events;
        // DORA: the deploys in the range.
        let first_commit = ev
            .iter()
            .find(|e| {
                e.kind == kind::STAGE_ADVANCED
                    && from_stage(e).as_deref() == Some(FIRST_COMMIT_STAGE)
            })
            .map(|e| e.at);
        let deploys = deploys_of(ev);
        let mut failed_deploy = false;
        for d in &deploys {
            if d.failure.is_some() {
                failed_deploy = true;
            }
            if range.contains(d.at) {
                f.deploys += 1;
                if d.confirmed {
                    lead_sub.push(d.at - item.created_at);
                    if let Some(c) = first_commit.filter(|c| *c <= d.at) {
                        lead_commit.push(d.at - c);
                    }
                }
                match d.failure {
                    Some(true) => f.rolled_back += 1,
                    Some(false) => f.reverted += 1,
                    None => {}
                }
            }
            if let Some(det) = d.detected_at.filter(|t| range.contains(*t)) {
                match d.restored_at {
                    Some(r) => restore.push(r - det),
                    None => f.unrestored += 1,
                }
            }
        }
        // Staging verdicts and release-track waits in the range.
        for (i, e) in ev.iter().enumerate() {
            if !range.contains(e.at) {
                continue;
            }
            match e.kind.as_str() {
                kind::RELEASE_STAGED => f.staging.passed += 1,
                kind::STAGE_LOOP_BACK if from_stage(e).as_deref() == Some(STAGING_STAGE) => {
                    f.staging.change_failures += 1;
                }
                kind::STAGE_REQUEUED
                    if e.stage.as_deref() == Some(STAGING_STAGE)
                        && payload::read_value::<StageRequeued>(&e.data)
                            .and_then(|r| r.marker)
                            .is_some_and(|m| m.contains(markers::STAGING_DEFER)) =>
                {
                    f.staging.infrastructure_errors += 1;
                }
                kind::TASK_FAILED
                    if change_of(e).is_some_and(|c| {
                        c.from.as_deref() == Some(STAGING_STAGE)
                            || c.stage.as_deref() == Some(STAGING_STAGE)
                    }) =>
                {
                    // The gate's value says whose failure it was: the staging tool's errors
                    // ran out, or the change failed with its loops spent. Without one the
                    // stage job itself failed (a tool or orch), which is not the change.
                    match change_of(e).and_then(|c| c.result).as_deref() {
                        Some(r) if r != crate::pipeline::TOOL_ERROR_EXHAUSTED => {
                            f.staging.change_failures += 1;
                        }
                        _ => f.staging.infrastructure_errors += 1,
                    }
                }
                kind::RELEASE_WAITING => {
                    let end = ev[i + 1..].iter().find(|n| {
                        n.kind == kind::STAGE_ADVANCED
                            || kind::TASK_ENDED.contains(&n.kind.as_str())
                    });
                    if let Some(end) = end {
                        waits.push(end.at - e.at);
                    }
                }
                _ => {}
            }
        }
        // orch's own: the items that ended in the range.
        if !(control::is_terminal_stage(&item.stage) && range.contains(item.updated_at)) {
            continue;
        }
        let Some(out) = outcome::outcome_of(&item.stage, &views(ev)) else {
            continue;
        };
        *f.ended.entry(out.outcome.as_str()).or_default() += 1;
        let shipped = out.outcome == Outcome::Shipped;
        if shipped {
            f.shipped += 1;
            runs_shipped += item.runs.len() as u64;
            review_loops_shipped += ev
                .iter()
                .filter(|e| {
                    e.kind == kind::STAGE_LOOP_BACK
                        && from_stage(e).as_deref() == Some(REVIEW_STAGE)
                })
                .count() as u64;
        }
        for r in &item.runs {
            f.agent_runs += 1;
            let (a, seen) = agents
                .entry((r.backend.clone(), r.model.clone()))
                .or_insert_with(|| {
                    (
                        AgentFigures {
                            backend: r.backend.clone(),
                            model: r.model.clone(),
                            ..AgentFigures::default()
                        },
                        BTreeSet::new(),
                    )
                });
            a.runs += 1;
            match r.cost_usd {
                Some(c) => {
                    f.cost_usd += c;
                    a.cost_usd += c;
                }
                None => {
                    f.unknown_cost_runs += 1;
                    a.unknown_cost_runs += 1;
                }
            }
            if seen.insert(idx) {
                a.items += 1;
                a.shipped += u64::from(shipped);
                a.change_failures += u64::from(failed_deploy);
            }
        }
    }
    f.deploys_per_day = f.deploys as f64 / range.days();
    f.change_failures = f.rolled_back + f.reverted;
    f.change_failure_rate = per(f.change_failures as f64, f.deploys);
    f.lead_time_from_submission = Durations::of(lead_sub);
    f.lead_time_from_first_commit = Durations::of(lead_commit);
    f.time_to_restore = Durations::of(restore);
    f.release_wait = Durations::of(waits);
    f.cost_per_shipped_usd = per(f.cost_usd, f.shipped);
    f.agent_runs_per_shipped = per(runs_shipped as f64, f.shipped);
    f.review_loops_per_shipped = per(review_loops_shipped as f64, f.shipped);
    f.by_agent = agents.into_values().map(|(a, _)| a).collect();
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const H: Millis = 3_600_000;
    /// 2026-12-01T00:00:00Z.
    const D: Millis = 1_796_083_200_000;

    fn ev(kind: &str, stage: &str, at: Millis, data: Value) -> ItemEvent {
        ItemEvent {
            kind: kind.to_owned(),
            stage: Some(stage.to_owned()),
            message: String::new(),
            data,
            at,
        }
    }
    fn adv(from: &str, to: &str, at: Millis) -> ItemEvent {
        ev(
            kind::STAGE_ADVANCED,
            to,
            at,
            json!({"from": from, "to": to}),
        )
    }
    fn back(from: &str, to: &str, at: Millis) -> ItemEvent {
        ev(
            kind::STAGE_LOOP_BACK,
            to,
            at,
            json!({"from": from, "to": to}),
        )
    }
    fn run(backend: &str, model: &str, cost: Option<f64>) -> ItemRun {
        ItemRun {
            backend: backend.to_owned(),
            model: Some(model.to_owned()),
            cost_usd: cost,
        }
    }
    fn item(
        repo: &str,
        stage: &str,
        created: Millis,
        events: Vec<ItemEvent>,
        runs: Vec<ItemRun>,
    ) -> ItemRecord {
        let updated_at = events.last().map_or(created, |e| e.at);
        ItemRecord {
            repo: repo.to_owned(),
            stage: stage.to_owned(),
            created_at: created,
            updated_at,
            events,
            runs,
        }
    }
    fn verdict(v: &str, action: &str, at: Millis) -> ItemEvent {
        ev(
            kind::POST_DEPLOY_VERDICT,
            "observe",
            at,
            json!({"verdict": v, "action": action}),
        )
    }
    fn done(at: Millis) -> ItemEvent {
        ev(
            kind::TASK_DONE,
            "done",
            at,
            json!({"from": "lessons", "to": "done"}),
        )
    }
    fn defer(at: Millis) -> ItemEvent {
        ev(
            kind::STAGE_REQUEUED,
            "staging",
            at,
            json!({"marker": markers::staging_defer(9)}),
        )
    }

    /// The synthetic history of the module's figures, worked by hand in the comments.
    pub(crate) fn history() -> Vec<ItemRecord> {
        let claude = || run("claude", "opus", Some(1.0));
        vec![
            // A: shipped; a review loop; waited 1 h for the track; deployed at +5 h.
            item(
                "a",
                "done",
                D,
                vec![
                    back("review", "implementation", D + H / 2),
                    adv("implementation", "review", D + H),
                    ev(kind::RELEASE_WAITING, "verification", D + 2 * H, json!({})),
                    adv("verification", "merge", D + 3 * H),
                    ev(kind::RELEASE_STAGED, "staging", D + 4 * H, json!({})),
                    ev(
                        kind::DEPLOY_CONFIRMED,
                        "deploy",
                        D + 5 * H,
                        json!({"revision": "a1"}),
                    ),
                    verdict("HEALTHY", "none", D + 6 * H),
                    done(D + 7 * H),
                ],
                vec![claude(), claude(), claude()],
            ),
            // B: deployed at +14 h, the watch FAILED at +15 h, rolled back verified at +15.5 h.
            item(
                "a",
                "done",
                D + 10 * H,
                vec![
                    adv("implementation", "review", D + 12 * H),
                    ev(kind::RELEASE_STAGED, "staging", D + 13 * H, json!({})),
                    ev(
                        kind::DEPLOY_CONFIRMED,
                        "deploy",
                        D + 14 * H,
                        json!({"revision": "b1"}),
                    ),
                    verdict("FAILED", "rollback", D + 15 * H),
                    ev(
                        kind::POST_DEPLOY_ROLLBACK,
                        "observe",
                        D + 15 * H + H / 2,
                        json!({"verified": true}),
                    ),
                    ev(
                        kind::RELEASE_ROLLED_BACK,
                        "observe",
                        D + 15 * H + H / 2,
                        json!({"live": "a1"}),
                    ),
                    done(D + 16 * H),
                ],
                vec![
                    run("codex", "gpt-5", Some(2.0)),
                    run("codex", "gpt-5", Some(2.0)),
                ],
            ),
            // C: deployed at +22 h, FAILED at +23 h, rolled back at +24 h, reverted.
            item(
                "a",
                "done",
                D + 20 * H,
                vec![
                    adv("implementation", "review", D + 21 * H),
                    ev(
                        kind::DEPLOY_CONFIRMED,
                        "deploy",
                        D + 22 * H,
                        json!({"revision": "c1"}),
                    ),
                    verdict("FAILED", "rollback", D + 23 * H),
                    ev(
                        kind::POST_DEPLOY_ROLLBACK,
                        "observe",
                        D + 24 * H,
                        json!({"verified": true}),
                    ),
                    ev(kind::RELEASE_REVERTED, "observe", D + 25 * H, json!({})),
                    done(D + 26 * H),
                ],
                vec![run("claude", "opus", Some(0.5))],
            ),
            // D (repo b): failed staging for the change, then an infrastructure defer, shipped.
            item(
                "b",
                "done",
                D + 30 * H,
                vec![
                    adv("implementation", "review", D + 31 * H),
                    back("staging", "implementation", D + 32 * H),
                    adv("implementation", "review", D + 33 * H),
                    defer(D + 34 * H),
                    ev(kind::RELEASE_STAGED, "staging", D + 35 * H, json!({})),
                    ev(
                        kind::DEPLOY_CONFIRMED,
                        "deploy",
                        D + 36 * H,
                        json!({"revision": "d1"}),
                    ),
                    verdict("HEALTHY", "none", D + 37 * H),
                    done(D + 38 * H),
                ],
                vec![run("claude", "opus", None)],
            ),
            // E: staging's infrastructure failed twice (a defer, then exhausted).
            item(
                "a",
                "failed",
                D + 40 * H,
                vec![
                    adv("implementation", "review", D + 41 * H),
                    defer(D + 42 * H),
                    ev(
                        kind::TASK_FAILED,
                        "failed",
                        D + 43 * H,
                        json!({"from": "staging", "to": "failed", "stage": "staging"}),
                    ),
                ],
                vec![run("claude", "opus", Some(0.25))],
            ),
            // F: before the range: counts nowhere.
            item(
                "a",
                "done",
                D - 5 * 24 * H,
                vec![
                    adv("implementation", "review", D - 5 * 24 * H + H),
                    ev(kind::DEPLOY_CONFIRMED, "deploy", D - 4 * 24 * H, json!({})),
                    done(D - 4 * 24 * H + H),
                ],
                vec![run("claude", "opus", Some(100.0))],
            ),
        ]
    }

    #[test]
    fn dora_keys_match_the_hand_computed_figures() {
        let r = report(&history(), Range::new(D, D + 10 * 24 * H).unwrap());
        let f = &r.overall;
        // A, B, C, D deployed in the range (F before it): 4 in 10 days.
        assert_eq!(f.deploys, 4);
        assert!((f.deploys_per_day - 0.4).abs() < 1e-9);
        // From submission: A 5 h, B 4 h, C 2 h, D 6 h → sorted 2,4,5,6: median (rank 2) 4 h,
        // p90 (rank 4) 6 h, mean 17/4 h.
        let l = &f.lead_time_from_submission;
        assert_eq!(
            (l.count, l.median_ms, l.p90_ms),
            (4, Some(4 * H), Some(6 * H))
        );
        assert_eq!(l.mean_ms, Some(17 * H / 4));
        // From the first commit: A 4 h, B 2 h, C 1 h, D 5 h (its first commit, not the second).
        let c = &f.lead_time_from_first_commit;
        assert_eq!(
            (c.count, c.median_ms, c.p90_ms),
            (4, Some(2 * H), Some(5 * H))
        );
        // B rolled back, C reverted: 2 of 4.
        assert_eq!((f.rolled_back, f.reverted, f.change_failures), (1, 1, 2));
        assert_eq!(f.change_failure_rate, Some(0.5));
        // Restored after 30 min (B) and 1 h (C).
        let t = &f.time_to_restore;
        assert_eq!(
            (t.count, t.median_ms, t.p90_ms, t.mean_ms),
            (2, Some(H / 2), Some(H), Some(3 * H / 4))
        );
        assert_eq!(f.unrestored, 0);
    }

    /// Weeks start on Monday 00:00 UTC and are cut to the range; a long range keeps the
    /// latest [`MAX_WEEKS`].
    #[test]
    fn weeks_start_on_monday_and_are_cut_to_the_range() {
        // D is Tuesday 2026-12-01; the next Monday is 2026-12-07.
        let monday = D + 6 * 24 * H;
        let w = weeks(Range::new(D, D + 10 * 24 * H).unwrap());
        assert_eq!(
            w,
            vec![
                Range::new(D, monday).unwrap(),
                Range::new(monday, D + 10 * 24 * H).unwrap()
            ]
        );
        assert_eq!(crate::text::rfc3339_utc(monday), "2026-12-07T00:00:00Z");
        let one = weeks(Range::new(monday + H, monday + 2 * H).unwrap());
        assert_eq!(one, vec![Range::new(monday + H, monday + 2 * H).unwrap()]);
        let long = weeks(Range::new(0, monday + H).unwrap());
        assert_eq!(long.len(), MAX_WEEKS);
        assert_eq!(long.last().map(|r| r.until), Some(monday + H));
        assert!(long.windows(2).all(|p| p[0].until == p[1].since));
    }

    /// Each week reads only the items that touch it, yet the counts of the weeks add up to the
    /// whole range's.
    #[test]
    fn the_weekly_trend_adds_up_to_the_whole_range() {
        let range = Range::new(D - 7 * 24 * H, D + 10 * 24 * H).unwrap();
        let r = report(&history(), range);
        assert_eq!(r.weekly.len(), 3, "{:?}", r.weekly);
        let sum = |f: fn(&Figures) -> u64| r.weekly.iter().map(|(_, w)| f(w)).sum::<u64>();
        let o = &r.overall;
        assert_eq!(o.deploys, 5, "F counts in this range");
        assert_eq!(sum(|f| f.deploys), o.deploys);
        assert_eq!(sum(|f| f.rolled_back), o.rolled_back);
        assert_eq!(sum(|f| f.reverted), o.reverted);
        assert_eq!(sum(|f| f.shipped), o.shipped);
        assert_eq!(sum(|f| f.agent_runs), o.agent_runs);
        assert_eq!(sum(|f| f.staging.passed), o.staging.passed);
        assert_eq!(
            sum(|f| f.staging.infrastructure_errors),
            o.staging.infrastructure_errors
        );
        // F deployed in the first week (Tuesday D-7d to Monday D-1d), the rest in the second.
        assert_eq!(r.weekly[0].1.deploys, 1);
        assert_eq!(r.weekly[1].1.deploys, 4);
        assert_eq!(r.weekly[2].1.deploys, 0);
    }

    /// Where time goes: per item, the sum of its visits to each stage, from entering it to
    /// leaving it; only the items that ended in the range.
    #[test]
    fn stage_time_sums_each_items_visits() {
        let x = item(
            "a",
            "done",
            D,
            vec![
                adv("intake", "analysis", D + H),
                adv("analysis", "implementation", D + 3 * H),
                adv("implementation", "review", D + 4 * H),
                back("review", "implementation", D + 5 * H),
                adv("implementation", "review", D + 7 * H),
                ev(
                    kind::TASK_DONE,
                    "done",
                    D + 8 * H,
                    json!({"from": "review", "to": "done"}),
                ),
            ],
            vec![],
        );
        let y = item(
            "a",
            "failed",
            D,
            vec![
                adv("intake", "analysis", D + 2 * H),
                ev(
                    kind::TASK_FAILED,
                    "failed",
                    D + 6 * H,
                    json!({"from": "analysis", "to": "failed"}),
                ),
            ],
            vec![],
        );
        // Still running: not counted.
        let z = item(
            "a",
            "review",
            D,
            vec![adv("intake", "review", D + H)],
            vec![],
        );
        let r = report(&[x, y, z], Range::new(D, D + 24 * H).unwrap());
        let got: Vec<(&str, u64, Millis, Option<Millis>)> = r
            .stage_time
            .iter()
            .map(|s| {
                (
                    s.stage.as_str(),
                    s.time.count,
                    s.time.total_ms,
                    s.time.p90_ms,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("intake", 2, 3 * H, Some(2 * H)),
                ("analysis", 2, 6 * H, Some(4 * H)),
                ("implementation", 1, 3 * H, Some(3 * H)),
                ("review", 1, 2 * H, Some(2 * H)),
            ]
        );
    }

    /// A deploy that fails its check is rolled back by the deployer, which records the
    /// rollback before `deploy.failed`: still a deploy, a change failure and a restore.
    #[test]
    fn a_deploy_that_failed_and_was_rolled_back_is_a_change_failure() {
        let at = D + H;
        let events = vec![
            adv("staging", "deploy", at),
            ev(kind::DEPLOY_STARTED, "deploy", at + 60_000, json!({})),
            ev(
                kind::DEPLOY_ROLLBACK_STARTED,
                "deploy",
                at + 10 * 60_000,
                json!({}),
            ),
            ev(
                kind::DEPLOY_ROLLED_BACK,
                "deploy",
                at + 25 * 60_000,
                json!({"verified": true}),
            ),
            ev(kind::DEPLOY_FAILED, "deploy", at + 26 * 60_000, json!({})),
            ev(
                kind::TASK_FAILED,
                "failed",
                at + 27 * 60_000,
                json!({"from": "deploy", "to": "failed"}),
            ),
        ];
        let items = vec![item("a", "failed", D, events, vec![])];
        let f = report(&items, Range::new(D, D + 24 * H).unwrap()).overall;
        assert_eq!(f.deploys, 1);
        assert_eq!((f.rolled_back, f.change_failures), (1, 1));
        assert_eq!(f.change_failure_rate, Some(1.0));
        // Detected when the rollback started (+10 min), restored when it was verified (+25).
        let t = &f.time_to_restore;
        assert_eq!((t.count, t.median_ms), (1, Some(15 * 60_000)));
        assert_eq!(f.unrestored, 0);
        assert_eq!(f.lead_time_from_submission.count, 0, "not a healthy deploy");
        // The store reads the kinds the segments need.
        for k in [
            kind::DEPLOY_STARTED,
            kind::TASK_RETRIED,
            kind::DEPLOY_FAILED,
        ] {
            assert!(kinds().contains(&k), "{k}");
        }
    }

    /// A task that failed at staging is the change's failure when the gate said so (its
    /// loops spent), the infrastructure's when the tool's errors ran out or the job failed.
    #[test]
    fn a_failure_at_staging_is_split_by_the_gates_value() {
        let failed = |at: Millis, result: Option<&str>| {
            let mut data = json!({"from": "staging", "to": "failed", "stage": "staging"});
            if let Some(r) = result {
                data["result"] = r.into();
            }
            item(
                "a",
                "failed",
                D,
                vec![ev(kind::TASK_FAILED, "failed", at, data)],
                vec![],
            )
        };
        let items = vec![
            failed(D + H, Some("FAILED")),
            failed(D + 2 * H, Some(crate::pipeline::TOOL_ERROR_EXHAUSTED)),
            failed(D + 3 * H, None),
        ];
        let f = report(&items, Range::new(D, D + 24 * H).unwrap()).overall;
        assert_eq!(
            (f.staging.change_failures, f.staging.infrastructure_errors),
            (1, 2)
        );
    }

    #[test]
    fn orch_figures_match_the_hand_computed_figures() {
        let r = report(&history(), Range::new(D, D + 10 * 24 * H).unwrap());
        let f = &r.overall;
        let ended: Vec<(&str, u64)> = f.ended.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(
            ended,
            [
                ("failed", 1),
                ("reverted", 1),
                ("rolled_back", 1),
                ("shipped", 2)
            ]
        );
        assert_eq!(f.shipped, 2);
        // 3 + 4 + 0.5 + unknown + 0.25 over two shipped items (F is outside the range).
        assert!((f.cost_usd - 7.75).abs() < 1e-9);
        assert_eq!(f.unknown_cost_runs, 1);
        assert_eq!(f.cost_per_shipped_usd, Some(7.75 / 2.0));
        assert_eq!(f.agent_runs, 8);
        assert_eq!(f.agent_runs_per_shipped, Some(2.0)); // A 3, D 1
        assert_eq!(f.review_loops_per_shipped, Some(0.5)); // A 1, D 0
        assert_eq!(
            f.staging,
            StagingVerdicts {
                passed: 3,
                change_failures: 1,
                infrastructure_errors: 3
            }
        );
        assert_eq!((f.release_wait.count, f.release_wait.total_ms), (1, H));
        assert_eq!(f.by_agent.len(), 2);
        let claude = &f.by_agent[0];
        assert_eq!(
            (claude.backend.as_str(), claude.model.as_deref()),
            ("claude", Some("opus"))
        );
        assert_eq!(
            (
                claude.runs,
                claude.unknown_cost_runs,
                claude.items,
                claude.shipped,
                claude.change_failures
            ),
            (6, 1, 4, 2, 1)
        );
        assert!((claude.cost_usd - 3.75).abs() < 1e-9);
        let codex = &f.by_agent[1];
        assert_eq!(
            (
                codex.runs,
                codex.items,
                codex.shipped,
                codex.change_failures
            ),
            (2, 1, 0, 1)
        );
        // Per repo: b holds D only.
        assert_eq!(
            r.repos.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        let b = &r.repos[1].1;
        assert_eq!((b.deploys, b.shipped, b.change_failures), (1, 1, 0));
        assert_eq!(
            b.staging,
            StagingVerdicts {
                passed: 1,
                change_failures: 1,
                infrastructure_errors: 1
            }
        );
    }

    #[test]
    fn a_narrow_range_counts_only_what_fell_in_it() {
        // [+13 h, +23 h): B's and C's deploys; C's failure detected at +23 h is outside.
        let r = report(&history(), Range::new(D + 13 * H, D + 23 * H).unwrap());
        let f = &r.overall;
        assert_eq!(f.deploys, 2);
        assert_eq!(f.time_to_restore.count, 1);
        assert_eq!(f.ended.get("rolled_back"), Some(&1));
        assert_eq!(f.shipped, 0);
        assert_eq!(f.cost_per_shipped_usd, None);
    }

    #[test]
    fn an_unrestored_failure_is_counted_not_timed() {
        let items = vec![item(
            "a",
            "done",
            D,
            vec![
                ev(kind::DEPLOY_CONFIRMED, "deploy", D + H, json!({})),
                verdict("FAILED", "rollback_failed", D + 2 * H),
                ev(
                    kind::POST_DEPLOY_ROLLBACK,
                    "observe",
                    D + 3 * H,
                    json!({"verified": false}),
                ),
                done(D + 4 * H),
            ],
            vec![],
        )];
        let f = report(&items, Range::new(D, D + 24 * H).unwrap()).overall;
        assert_eq!(
            (
                f.deploys,
                f.rolled_back,
                f.unrestored,
                f.time_to_restore.count
            ),
            (1, 1, 1, 0)
        );
    }

    #[test]
    fn instants_parse_and_bad_ones_say_why() {
        let now = D + 12 * H;
        assert_eq!(parse_instant("2026-12-01", now), Ok(D));
        assert_eq!(parse_instant("2026-12-01T00:00:00Z", now), Ok(D));
        assert_eq!(
            parse_instant("2026-12-01T01:30:00.250+01:30", now),
            Ok(D + 250)
        );
        assert_eq!(parse_instant("7d", now), Ok(now - 7 * 24 * H));
        assert_eq!(parse_instant("36h", now), Ok(now - 36 * H));
        assert_eq!(parse_instant("now", now), Ok(now));
        assert_eq!(parse_instant(&D.to_string(), now), Ok(D));
        for bad in [
            "",
            "yesterday",
            "2026-13-01",
            "2026-02-30",
            "2026-12-01T25:00:00Z",
            "7y",
            "2026-12-01T00:00:00",
            "99999999999999999999d",
            "x\u{1b}[2J",
        ] {
            let e = parse_instant(bad, now).unwrap_err();
            assert!(e.contains("is not a time"), "{bad}: {e}");
            assert!(!e.contains('\u{1b}'), "{e}");
        }
        assert!(Range::new(D, D).is_err());
        assert!(Range::new(D + 1, D).unwrap_err().contains("not before"));
    }

    #[test]
    fn dates_agree_with_the_formatter() {
        for ms in [0, D, D + 59 * 24 * H, 951_782_400_000, -86_400_000] {
            let s = crate::text::rfc3339_utc(ms);
            assert_eq!(parse_instant(&s, 0), Ok(ms - ms.rem_euclid(1000)), "{s}");
        }
    }
}
