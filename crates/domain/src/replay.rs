//! Replay (issue 32): every decision of a work item re-derived from what was recorded, with
//! today's rules, and compared with what was decided then.
//!
//! What is replayed, per recorded stage change (the `stage.advanced`, `stage.loop_back`,
//! `task.done`/`task.failed` events the engine writes with the stage's commit):
//! - **gate**: the stage's artifacts as committed on the item's branch at that commit, read
//!   through the stage's gate ([`crate::pipeline::StageDef::check`]); compared with the value the
//!   event recorded. Stages whose executor reports its outcome itself (deploy; staging's
//!   `TOOL_ERROR_EXHAUSTED`; a deploy's `RESTAGE`) have no artifact gate to replay.
//! - **route**: where [`Pipeline::decide`] sends the item from that gate outcome and the loops
//!   back taken before; compared with the stage the event moved it to.
//! - **staging**: `15-staging-log.md`'s steps classified again ([`staging::classify`]) and
//!   decided with the defers the log counts ([`staging::decide_after`]); compared with its
//!   `staging_status` and `failure_kind`.
//! - **watch**: the series in `16-post-deploy-log.md` decided again ([`monitor::decide_with`])
//!   with the parameters frozen in its Watch table, at the time the log was written; compared
//!   with the recorded `post_deploy.verdict`, with whether a rollback ran.
//!
//! [`Overrides`] (`orch replay --set key=value`) change the thresholds the rules decide with,
//! to ask what other settings would have decided on the same recorded inputs. Nothing here
//! reads a file or a clock: the caller hands in the texts and the events' facts.
//!
//! What the record cannot say is said, never guessed: a log that does not parse, a commit
//! that is gone, a watch that ended without polls is `Unreplayable` with the reason; a watch
//! whose recorded polls end before the changed rules would have decided is "undecided".

use std::collections::BTreeMap;

use crate::artifact::{Artifact, Value};
use crate::gate::{GateOutcome, Verdict as GateVerdict};
use crate::ids::{ArtifactName, StageName, WorkItemId};
use crate::monitor::{
    self, ActionTaken, Check, CheckOutcome, Decision as WatchDecision, Poll, Thresholds,
    WatchParams,
};
use crate::pipeline::{Pipeline, RESTAGE, TOOL_ERROR_EXHAUSTED};
use crate::staging::{self, DeferPolicy, StagingDecision, StagingPlan, StepExit, StepResult};

/// The staging runner's log (D-3).
pub const STAGING_LOG: &str = "15-staging-log.md";
/// The post-deploy monitor's log (design.md §7).
pub const POST_DEPLOY_LOG: &str = "16-post-deploy-log.md";
/// How the engine records a gate that did not pass (`outcome` of a stage change).
pub const NOT_SUCCESS: &str = "NOT_SUCCESS";

// ---- overrides ---------------------------------------------------------------------------

/// The keys `--set` accepts, with what each means.
pub const KEYS: [(&str, &str); 5] = [
    (
        "post_deploy.consecutive_fail_limit",
        "FAILED once this many FAIL polls follow each other (default 3; at least 1)",
    ),
    (
        "post_deploy.failure_limit",
        "FAILED once the FAIL polls are more than this many (default 3)",
    ),
    (
        "post_deploy.healthy_max_fails",
        "HEALTHY allows at most this many FAIL polls (default 1)",
    ),
    (
        "post_deploy.healthy_last_valid_pass",
        "HEALTHY needs this many trailing valid polls, all PASS (default 2; at least 1)",
    ),
    (
        "staging.defer_limit",
        "TOOL_ERROR defers per staging visit before FAILED tool_error_exhausted (default: the repo's staging_defer_limit)",
    ),
];

/// Thresholds changed for a replay (`--set key=value`); `None` keeps today's value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `post_deploy.consecutive_fail_limit`.
    pub consecutive_fail_limit: Option<u32>,
    /// `post_deploy.failure_limit`.
    pub failure_limit: Option<u32>,
    /// `post_deploy.healthy_max_fails`.
    pub healthy_max_fails: Option<u32>,
    /// `post_deploy.healthy_last_valid_pass`.
    pub healthy_last_valid_pass: Option<u32>,
    /// `staging.defer_limit`.
    pub staging_defer_limit: Option<u32>,
}

/// Why a `--set` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverrideError {
    /// Not `key=value`.
    #[error("`{0}` is not key=value (e.g. post_deploy.failure_limit=5)")]
    NotKeyValue(String),
    /// A key replay does not know.
    #[error("unknown key `{key}`; the keys are {known}")]
    UnknownKey {
        /// The key given (escaped).
        key: String,
        /// The keys there are.
        known: String,
    },
    /// A value that is not a whole number in range.
    #[error("{key}: `{value}` is not valid: {why}")]
    BadValue {
        /// The key.
        key: String,
        /// The value given (escaped).
        value: String,
        /// What is expected.
        why: String,
    },
    /// The same key twice.
    #[error("{0} is set twice")]
    Repeated(String),
}

impl Overrides {
    /// Parses `key=value` items (the `--set` flags, in order).
    pub fn parse<S: AsRef<str>>(items: &[S]) -> Result<Overrides, OverrideError> {
        let mut o = Overrides::default();
        for item in items {
            let item = item.as_ref();
            let Some((key, value)) = item.split_once('=') else {
                return Err(OverrideError::NotKeyValue(crate::text::escape(item)));
            };
            let (key, value) = (key.trim(), value.trim());
            let slot = match key {
                "post_deploy.consecutive_fail_limit" => &mut o.consecutive_fail_limit,
                "post_deploy.failure_limit" => &mut o.failure_limit,
                "post_deploy.healthy_max_fails" => &mut o.healthy_max_fails,
                "post_deploy.healthy_last_valid_pass" => &mut o.healthy_last_valid_pass,
                "staging.defer_limit" => &mut o.staging_defer_limit,
                _ => {
                    return Err(OverrideError::UnknownKey {
                        key: crate::text::escape(key),
                        known: KEYS.map(|(k, _)| k).join(", "),
                    });
                }
            };
            let min = match key {
                "post_deploy.consecutive_fail_limit" | "post_deploy.healthy_last_valid_pass" => 1,
                _ => 0,
            };
            let bad = |why: String| OverrideError::BadValue {
                key: key.to_owned(),
                value: crate::text::escape(value),
                why,
            };
            let n: u32 = value
                .parse()
                .map_err(|_| bad(format!("a whole number from {min} to 10000 is expected")))?;
            if !(min..=10_000).contains(&n) {
                return Err(bad(format!(
                    "a whole number from {min} to 10000 is expected"
                )));
            }
            if slot.replace(n).is_some() {
                return Err(OverrideError::Repeated(key.to_owned()));
            }
        }
        Ok(o)
    }

    /// True when nothing is changed: the replay checks the record against today's rules.
    pub fn is_empty(&self) -> bool {
        self.pairs().is_empty()
    }

    /// The keys set, with their values, in [`KEYS`]' order.
    pub fn pairs(&self) -> Vec<(&'static str, u32)> {
        [
            self.consecutive_fail_limit,
            self.failure_limit,
            self.healthy_max_fails,
            self.healthy_last_valid_pass,
            self.staging_defer_limit,
        ]
        .into_iter()
        .zip(KEYS)
        .filter_map(|(v, (k, _))| v.map(|v| (k, v)))
        .collect()
    }

    /// The watch's thresholds: today's, with the overrides applied.
    pub fn thresholds(&self) -> Thresholds {
        let d = Thresholds::default();
        Thresholds {
            failed_consecutive_fails: self
                .consecutive_fail_limit
                .unwrap_or(d.failed_consecutive_fails),
            failed_total_fails_above: self.failure_limit.unwrap_or(d.failed_total_fails_above),
            healthy_max_fails: self.healthy_max_fails.unwrap_or(d.healthy_max_fails),
            healthy_last_valid_pass: self
                .healthy_last_valid_pass
                .map_or(d.healthy_last_valid_pass, |n| n as usize),
        }
    }
}

// ---- the recorded inputs -----------------------------------------------------------------

/// One recorded stage change and what it was decided from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageChange {
    /// The event's id (for the output; decisions are listed in this order).
    pub event_id: i64,
    /// When it was recorded (epoch ms).
    pub at_ms: i64,
    /// The stage the item left.
    pub from: String,
    /// The stage it went to.
    pub to: String,
    /// The gate's value the event recorded (or an executor's reported value, or
    /// [`NOT_SUCCESS`]).
    pub outcome: String,
    /// Loops back the item had taken before this change.
    pub loops_before: u32,
    /// The files of the item's folder (`docs/work-items/<id>/`, name and text) as committed
    /// with this change, or why they cannot be read (no commit recorded, the commit is gone).
    pub files: Result<Vec<(String, String)>, String>,
    /// For a change out of `observe`: the verdict and action of the visit's
    /// `post_deploy.verdict` event, when one was recorded.
    pub watch_event: Option<(String, String)>,
}

/// A work item's record, as the caller read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemRecord {
    /// The item.
    pub work_item: WorkItemId,
    /// The staging defer limit in force (the repo's `staging_defer_limit`): the staging log does
    /// not record it.
    pub staging_defer_limit: u32,
    /// Its stage changes, oldest first.
    pub changes: Vec<StageChange>,
}

// ---- the output --------------------------------------------------------------------------

/// Which rule a decision comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A stage's artifact gate.
    Gate,
    /// The pipeline's next stage.
    Route,
    /// The staging runner's classification and defer rule.
    Staging,
    /// The post-deploy watch's verdict.
    Watch,
}

impl Kind {
    /// `gate`, `route`, `staging` or `watch`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Gate => "gate",
            Kind::Route => "route",
            Kind::Staging => "staging",
            Kind::Watch => "watch",
        }
    }
}

/// Whether the replay agrees with the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agreement {
    /// Same decision.
    Agrees,
    /// Another decision.
    Differs,
    /// The record does not hold what the decision was made from (said in `replayed`).
    Unreplayable,
}

impl Agreement {
    /// `agrees`, `differs` or `cannot replay`.
    pub fn as_str(self) -> &'static str {
        match self {
            Agreement::Agrees => "agrees",
            Agreement::Differs => "differs",
            Agreement::Unreplayable => "cannot replay",
        }
    }
}

/// A watch's rollback, as recorded and as replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rollback {
    /// A rollback ran (verified or not).
    pub recorded: bool,
    /// The replayed verdict would have rolled back; `None` when the replay cannot tell (the
    /// recorded polls end before the replayed rules decide).
    pub replayed: Option<bool>,
}

/// One decision, replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// The stage change it belongs to.
    pub event_id: i64,
    /// When that change was recorded.
    pub at_ms: i64,
    /// Which rule.
    pub kind: Kind,
    /// The stage it was made in.
    pub stage: String,
    /// What was decided, in words (`review gate (11-review.md)`).
    pub what: String,
    /// What was recorded.
    pub recorded: String,
    /// What the rules decide now (or `cannot replay: …`).
    pub replayed: String,
    /// The comparison.
    pub agreement: Agreement,
    /// The replayed decision's reason.
    pub detail: String,
    /// For a watch: the rollback recorded and replayed.
    pub rollback: Option<Rollback>,
}

/// Counts over replayed decisions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Decisions replayed (all kinds).
    pub decisions: u32,
    /// Agreeing.
    pub agree: u32,
    /// Differing.
    pub differ: u32,
    /// That could not be replayed.
    pub unreplayable: u32,
    /// Watches replayed.
    pub watches: u32,
    /// Watches whose recorded ending ran a rollback.
    pub rollbacks_recorded: u32,
    /// Watches whose replayed verdict would have rolled back.
    pub rollbacks_replayed: u32,
    /// Recorded rollbacks the replayed rules would not have run.
    pub rollbacks_avoided: u32,
    /// Rollbacks the replayed rules would have run where none was recorded.
    pub rollbacks_added: u32,
    /// Watches whose rollback the replay cannot tell (undecided on the recorded polls).
    pub rollbacks_undetermined: u32,
}

impl Summary {
    /// Counts `decisions`.
    pub fn of<'a>(decisions: impl IntoIterator<Item = &'a Replayed>) -> Summary {
        let mut s = Summary::default();
        for d in decisions {
            s.decisions += 1;
            match d.agreement {
                Agreement::Agrees => s.agree += 1,
                Agreement::Differs => s.differ += 1,
                Agreement::Unreplayable => s.unreplayable += 1,
            }
            let Some(r) = d.rollback else { continue };
            s.watches += 1;
            s.rollbacks_recorded += u32::from(r.recorded);
            match (r.recorded, r.replayed) {
                (_, None) => s.rollbacks_undetermined += 1,
                (true, Some(false)) => s.rollbacks_avoided += 1,
                (false, Some(true)) => s.rollbacks_added += 1,
                _ => {}
            }
            s.rollbacks_replayed += u32::from(r.replayed == Some(true));
        }
        s
    }
}

// ---- replay ------------------------------------------------------------------------------

/// Replays every decision of `item` with `pipeline` (today's, from the configuration) and the
/// thresholds `overrides` leaves or changes. Total: a record that cannot be read gives an
/// `Unreplayable` decision saying why, never a panic.
pub fn replay_item(pipeline: &Pipeline, item: &ItemRecord, overrides: &Overrides) -> Vec<Replayed> {
    let mut out = Vec::new();
    for change in &item.changes {
        replay_change(pipeline, item, change, overrides, &mut out);
    }
    out
}

fn replay_change(
    pipeline: &Pipeline,
    item: &ItemRecord,
    c: &StageChange,
    overrides: &Overrides,
    out: &mut Vec<Replayed>,
) {
    let base = |kind: Kind, what: String, recorded: String| Replayed {
        event_id: c.event_id,
        at_ms: c.at_ms,
        kind,
        stage: c.from.clone(),
        what,
        recorded,
        replayed: String::new(),
        agreement: Agreement::Unreplayable,
        detail: String::new(),
        rollback: None,
    };
    let cannot = |mut r: Replayed, why: &str| {
        r.replayed = format!("cannot replay: {why}");
        r
    };
    let stage: Option<StageName> = c.from.parse().ok();
    let Some(def) = stage.as_ref().and_then(|s| pipeline.stage(s)) else {
        out.push(cannot(
            base(
                Kind::Route,
                format!("{} → next stage", c.from),
                c.to.clone(),
            ),
            &format!(
                "stage `{}` is not in today's pipeline",
                crate::text::escape(&c.from)
            ),
        ));
        return;
    };
    let reported = c.outcome == RESTAGE || c.outcome == TOOL_ERROR_EXHAUSTED;
    // The gate: only for a stage whose artifacts decide it.
    let mut gate_for_route: Option<GateOutcome> = None;
    if !def.artifacts.is_empty() && !reported {
        let names: Vec<String> = def.artifacts.iter().map(|a| a.name.to_string()).collect();
        let r = base(
            Kind::Gate,
            format!("{} gate ({})", c.from, names.join(", ")),
            c.outcome.clone(),
        );
        match &c.files {
            Err(why) => out.push(cannot(r, why)),
            Ok(files) => {
                let named: Vec<(ArtifactName, &str)> = files
                    .iter()
                    .filter_map(|(n, t)| n.parse().ok().map(|n| (n, t.as_str())))
                    .collect();
                let gate = def.check(&item.work_item, &named);
                let value = gate_value(&gate);
                let mut r = r;
                r.agreement = agreement(&value, &c.outcome);
                r.replayed = value;
                r.detail = gate.reason.clone();
                out.push(r);
                gate_for_route = Some(gate);
            }
        }
    }
    // The route, from the replayed gate (or the executor's reported outcome).
    let gate = gate_for_route.unwrap_or_else(|| recorded_gate(&c.outcome));
    let mut r = base(
        Kind::Route,
        format!("{} → next stage", c.from),
        c.to.clone(),
    );
    match stage
        .as_ref()
        .map(|s| pipeline.decide(s, &gate, c.loops_before))
    {
        Some(Ok(d)) => {
            r.replayed = d.next_stage.as_str().to_owned();
            r.agreement = agreement(&r.replayed, &c.to);
            r.detail = d.reason;
            out.push(r);
        }
        Some(Err(e)) => out.push(cannot(r, &e.to_string())),
        None => out.push(cannot(r, "no stage")),
    }
    if def.name.as_str() == "staging" {
        out.push(replay_staging(
            item,
            c,
            overrides,
            base(
                Kind::Staging,
                "staging classification (15-staging-log.md)".into(),
                String::new(),
            ),
        ));
    }
    if def.name.as_str() == "observe" {
        out.push(replay_watch(
            c,
            overrides,
            base(
                Kind::Watch,
                "post-deploy watch verdict (16-post-deploy-log.md)".into(),
                String::new(),
            ),
        ));
    }
}

fn gate_value(g: &GateOutcome) -> String {
    match &g.verdict {
        GateVerdict::Pass(v) => v.clone(),
        GateVerdict::NotSuccess => NOT_SUCCESS.to_owned(),
    }
}

fn recorded_gate(outcome: &str) -> GateOutcome {
    if outcome == NOT_SUCCESS {
        GateOutcome::not_success("as recorded")
    } else {
        GateOutcome::pass(outcome.to_owned(), "as recorded")
    }
}

fn agreement(replayed: &str, recorded: &str) -> Agreement {
    if replayed == recorded {
        Agreement::Agrees
    } else {
        Agreement::Differs
    }
}

fn file<'a>(c: &'a StageChange, name: &str) -> Result<&'a str, String> {
    let files = c.files.as_ref().map_err(Clone::clone)?;
    files
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.as_str())
        .ok_or_else(|| format!("`{name}` is not in the item's folder at the change's commit"))
}

fn replay_staging(
    item: &ItemRecord,
    c: &StageChange,
    overrides: &Overrides,
    mut r: Replayed,
) -> Replayed {
    let log = match file(c, STAGING_LOG).and_then(read_staging_log) {
        Ok(log) => log,
        Err(why) => {
            r.recorded = c.outcome.clone();
            r.replayed = format!("cannot replay: {why}");
            return r;
        }
    };
    r.recorded = staging_text(&log.status, log.failure_kind.as_deref());
    let plan = StagingPlan {
        step_names: log.steps.iter().map(|s| s.name.clone()).collect(),
    };
    let classification = staging::classify(&log.steps, &plan);
    let limit = overrides
        .staging_defer_limit
        .unwrap_or(item.staging_defer_limit);
    let policy = DeferPolicy {
        limit,
        ..DeferPolicy::default()
    };
    let defers = log.attempt.saturating_sub(1);
    let decision = staging::decide_after(&classification, defers, &policy);
    let (replayed, detail) = match &decision {
        StagingDecision::Success => (staging_text("SUCCESS", None), classification.reason.clone()),
        StagingDecision::Failed {
            failure_kind,
            reason,
        } => (staging_text("FAILED", Some(failure_kind)), reason.clone()),
        StagingDecision::Defer { attempt, delay_s } => (
            format!("deferred (defer {attempt} of {limit})"),
            format!(
                "{}: {}; deferred {delay_s} s — the run after the defer was never made, so what it would have found is not recorded",
                classification.verdict.as_str(),
                classification.reason
            ),
        ),
    };
    r.agreement = agreement(&replayed, &r.recorded);
    r.replayed = replayed;
    r.detail = detail;
    r
}

fn staging_text(status: &str, kind: Option<&str>) -> String {
    match kind {
        Some(k) if k != "none" => format!("{status} ({k})"),
        _ => status.to_owned(),
    }
}

/// How a watch that decided nothing from polls says so in its log's reason (the monitor's
/// words): nothing was armed, the armed state was lost, or a retry found the revision gone.
const NO_POLL_ENDINGS: [&str; 3] = [
    "nothing was watched",
    "evidence lost:",
    "retried after the watch had ended",
];
/// How a superseded watch's reason begins (the monitor's words).
const SUPERSEDED: &str = "superseded by ";

fn replay_watch(c: &StageChange, overrides: &Overrides, mut r: Replayed) -> Replayed {
    let log = match file(c, POST_DEPLOY_LOG).and_then(read_watch_log) {
        Ok(log) => log,
        Err(why) => {
            r.recorded = c
                .watch_event
                .as_ref()
                .map_or_else(|| "—".to_owned(), |(v, _)| v.clone());
            r.replayed = format!("cannot replay: {why}");
            return r;
        }
    };
    // The decision as the database recorded it, else as the log says.
    let (verdict, action) = c
        .watch_event
        .clone()
        .unwrap_or_else(|| (log.status.clone(), log.action.clone()));
    r.recorded = verdict.clone();
    let rolled =
        |a: &str| a == ActionTaken::Rollback.as_str() || a == ActionTaken::RollbackFailed.as_str();
    let recorded_rollback = rolled(&action);
    if NO_POLL_ENDINGS.iter().any(|p| log.reason.starts_with(p)) {
        r.replayed = format!(
            "cannot replay: the watch decided nothing from polls ({})",
            crate::text::one_line_max(&log.reason, 160)
        );
        r.rollback = Some(Rollback {
            recorded: recorded_rollback,
            replayed: Some(recorded_rollback),
        });
        return r;
    }
    let t = overrides.thresholds();
    let superseded = log.reason.starts_with(SUPERSEDED);
    let decided = if superseded {
        let (v, why) = monitor::judge_superseded(
            &log.series,
            &log.params,
            &t,
            log.armed_at_ms,
            log.lost.as_deref(),
        );
        Some((v, format!("superseded: {why}")))
    } else {
        let now = decided_at(&log);
        match monitor::decide_with(&log.series, &log.params, &t, log.armed_at_ms, now) {
            WatchDecision::Final(v, why) => {
                Some(monitor::discount_lost_evidence(v, why, log.lost.as_deref()))
            }
            WatchDecision::Continue { .. } => None,
        }
    };
    match decided {
        Some((v, why)) => {
            r.replayed = v.as_str().to_owned();
            r.agreement = agreement(&r.replayed, &verdict);
            r.detail = why;
            // A FAILED verdict rolls back only while the watched revision is live: where the
            // record says how a FAILED ending went, that stands; a verdict newly FAILED is
            // counted as a rollback (the revision was live while it was watched).
            let replayed_rollback = match v {
                monitor::Verdict::Failed if superseded => false,
                monitor::Verdict::Failed if verdict == monitor::Verdict::Failed.as_str() => {
                    recorded_rollback
                }
                monitor::Verdict::Failed => true,
                _ => false,
            };
            r.rollback = Some(Rollback {
                recorded: recorded_rollback,
                replayed: Some(replayed_rollback),
            });
        }
        None => {
            let last = log.series.iter().map(|p| p.tick).max();
            r.replayed = "undecided".to_owned();
            r.agreement = Agreement::Differs;
            r.detail = format!(
                "the recorded polls end at {} and these rules would have gone on watching: what the later polls would have seen is not recorded",
                last.map_or_else(|| "no poll".to_owned(), |t| format!("tick {t}"))
            );
            r.rollback = Some(Rollback {
                recorded: recorded_rollback,
                replayed: None,
            });
        }
    }
    r
}

/// When the recorded verdict was reached. The tick that polled last decides at its poll's
/// time: when today's rules are final there (an early FAILED, the last slot polled), that is
/// the moment, and changed rules that are not final then would have gone on polling. Else the
/// verdict came later without a poll (the slots left were missed): by the time the log was
/// written. Times in the log are to the second, so each is taken at its last millisecond (a
/// final verdict stays final as time passes with the same polls).
fn decided_at(log: &WatchLogRecord) -> i64 {
    let last_poll = log
        .series
        .iter()
        .map(|p| p.at_ms)
        .max()
        .unwrap_or(log.armed_at_ms)
        .saturating_add(999);
    let today = Thresholds::default();
    match monitor::decide_with(&log.series, &log.params, &today, log.armed_at_ms, last_poll) {
        WatchDecision::Final(..) => last_poll,
        WatchDecision::Continue { .. } => log.created_at_ms.saturating_add(999).max(last_poll),
    }
}

// ---- reading the logs back -----------------------------------------------------------------

/// What `15-staging-log.md` recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingLogRecord {
    /// `staging_status`.
    pub status: String,
    /// `failure_kind` (`None` for `none`).
    pub failure_kind: Option<String>,
    /// `attempt`: the run of the visit, 1-based (defers before it + 1).
    pub attempt: u32,
    /// The steps of the Steps table (duration and output are not needed to decide).
    pub steps: Vec<StepResult>,
}

/// Reads `15-staging-log.md` back (the form [`staging::render_staging_log`] writes).
pub fn read_staging_log(text: &str) -> Result<StagingLogRecord, String> {
    let what = STAGING_LOG;
    let a = Artifact::parse(text).map_err(|e| format!("`{what}`: {e}"))?;
    let fm = |k: &str| fm_str(&a, k).ok_or_else(|| format!("`{what}` has no `{k}`"));
    let status = fm("staging_status")?;
    let failure_kind = fm_str(&a, "failure_kind").filter(|k| k != "none");
    let attempt = match a.frontmatter.get("attempt") {
        Some(Value::Int(n)) if *n >= 1 => u32::try_from(*n).unwrap_or(u32::MAX),
        _ => return Err(format!("`{what}`: `attempt` is not a whole number from 1")),
    };
    let rows =
        table_rows(&a.body, "## Steps").ok_or_else(|| format!("`{what}` has no Steps table"))?;
    let mut steps = Vec::new();
    for cells in rows {
        if cells.first().is_some_and(|c| c == "—") {
            continue; // "(no step ran)"
        }
        if cells.len() < 7 {
            return Err(format!(
                "`{what}`: a Steps row has {} cells, not 7",
                cells.len()
            ));
        }
        if cells[0].parse::<u32>().is_err() {
            return Err(format!(
                "`{what}`: a Steps row is numbered `{}`",
                crate::text::escape(&cells[0])
            ));
        }
        let exit = parse_exit(&cells[4]).ok_or_else(|| {
            format!(
                "`{what}`: step `{}` ended with `{}`, which is no known exit",
                crate::text::escape(&cells[1]),
                crate::text::escape(&cells[4])
            )
        })?;
        steps.push(StepResult {
            name: unescape_cell(&cells[1]),
            command: unescape_cell(&cells[3]),
            exit,
            duration_ms: 0,
            output_tail: String::new(),
            is_smoke: cells[2] == "yes",
        });
    }
    Ok(StagingLogRecord {
        status,
        failure_kind,
        attempt,
        steps,
    })
}

/// `exit 3`, `signal 9`, `timed out`, `not found`, `permission denied`, `unreachable`: the
/// `Display` of [`StepExit`].
fn parse_exit(s: &str) -> Option<StepExit> {
    let s = s.trim();
    if let Some(n) = s.strip_prefix("exit ") {
        return n.parse().ok().map(StepExit::Exited);
    }
    if let Some(n) = s.strip_prefix("signal ") {
        return n.parse().ok().map(StepExit::Signaled);
    }
    [
        StepExit::TimedOut,
        StepExit::NotFound,
        StepExit::PermissionDenied,
        StepExit::Unreachable,
    ]
    .into_iter()
    .find(|e| e.to_string() == s)
}

/// What `16-post-deploy-log.md` recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchLogRecord {
    /// `post_deploy_status`.
    pub status: String,
    /// `action_taken`.
    pub action: String,
    /// `reason`.
    pub reason: String,
    /// `created_at` (to the second).
    pub created_at_ms: i64,
    /// The frozen parameters of the Watch table.
    pub params: WatchParams,
    /// `armed at` (to the second).
    pub armed_at_ms: i64,
    /// The series, poll by poll.
    pub series: Vec<Poll>,
    /// The `Evidence lost` line, when there is one.
    pub lost: Option<String>,
}

/// Reads `16-post-deploy-log.md` back (the form [`monitor::render_post_deploy_log`] writes):
/// the frontmatter's verdict, the Watch table's frozen parameters and the Series table.
pub fn read_watch_log(text: &str) -> Result<WatchLogRecord, String> {
    let what = POST_DEPLOY_LOG;
    let a = Artifact::parse(text).map_err(|e| format!("`{what}`: {e}"))?;
    let fm = |k: &str| fm_str(&a, k).ok_or_else(|| format!("`{what}` has no `{k}`"));
    let status = fm("post_deploy_status")?;
    let action = fm("action_taken")?;
    let reason = fm("reason")?;
    let created_at_ms = instant(&fm("created_at")?)
        .ok_or_else(|| format!("`{what}`: `created_at` is not a time"))?;
    let mut watch = BTreeMap::new();
    for cells in
        table_rows(&a.body, "## Watch").ok_or_else(|| format!("`{what}` has no Watch table"))?
    {
        if let [k, v, ..] = cells.as_slice() {
            watch.insert(k.clone(), v.clone());
        }
    }
    let num = |k: &str| -> Result<u64, String> {
        watch
            .get(k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("`{what}`: the Watch table has no whole `{k}`"))
    };
    let params = WatchParams {
        window_s: num("window_s")?,
        interval_s: num("interval_s")?,
        initial_delay_s: num("initial_delay_s")?,
        poll_timeout_s: num("poll_timeout_s")?,
    };
    let armed_at_ms = watch
        .get("armed at")
        .and_then(|v| instant(v))
        .ok_or_else(|| format!("`{what}`: the Watch table has no `armed at` time"))?;
    let lost = a
        .body
        .lines()
        .find_map(|l| l.strip_prefix("> Evidence lost: "))
        .map(str::to_owned);
    let mut series: Vec<(Poll, String)> = Vec::new();
    for cells in
        table_rows(&a.body, "## Series").ok_or_else(|| format!("`{what}` has no Series table"))?
    {
        if cells.first().is_some_and(|c| c == "—") {
            continue; // "(no polls recorded)"
        }
        if cells.len() < 8 {
            return Err(format!(
                "`{what}`: a Series row has {} cells, not 8",
                cells.len()
            ));
        }
        let tick: u32 = cells[0].parse().map_err(|_| {
            format!(
                "`{what}`: a Series row's tick is `{}`",
                crate::text::escape(&cells[0])
            )
        })?;
        let at_ms = instant(&cells[1]).ok_or_else(|| {
            format!(
                "`{what}`: tick {tick}'s time `{}` is not a time",
                crate::text::escape(&cells[1])
            )
        })?;
        let check = if cells[3] == "(no checks)" {
            None
        } else {
            let outcome = outcome_of(&cells[4]).ok_or_else(|| {
                format!(
                    "`{what}`: tick {tick}'s check outcome `{}` is not PASS, FAIL, ERROR or NODATA",
                    crate::text::escape(&cells[4])
                )
            })?;
            Some(Check {
                name: unescape_cell(&cells[3]),
                outcome,
                status_code: cells[5].parse().ok(),
                latency_ms: cells[6].strip_suffix(" ms").and_then(|l| l.parse().ok()),
                detail: unescape_cell(&cells[7]),
            })
        };
        match series.last_mut() {
            Some((p, _))
                if p.tick == tick
                    && p.at_ms == at_ms
                    && check.is_some()
                    && !p.checks.is_empty() =>
            {
                p.checks.extend(check);
            }
            _ => series.push((
                Poll {
                    tick,
                    at_ms,
                    checks: check.into_iter().collect(),
                },
                cells[2].clone(),
            )),
        }
    }
    // Each row repeats its poll's status: the checks read back must make the same one.
    for (p, shown) in &series {
        if p.status().as_str() != shown {
            return Err(format!(
                "`{what}`: tick {}'s poll says {} but its checks make {}",
                p.tick,
                crate::text::escape(shown),
                p.status().as_str()
            ));
        }
    }
    Ok(WatchLogRecord {
        status,
        action,
        reason,
        created_at_ms,
        params,
        armed_at_ms,
        series: series.into_iter().map(|(p, _)| p).collect(),
        lost,
    })
}

fn outcome_of(s: &str) -> Option<CheckOutcome> {
    [
        CheckOutcome::Pass,
        CheckOutcome::Fail,
        CheckOutcome::Error,
        CheckOutcome::NoData,
    ]
    .into_iter()
    .find(|o| o.as_str() == s)
}

fn instant(s: &str) -> Option<i64> {
    // Only RFC 3339 here: `now` and durations mean nothing in a record.
    if !s.contains('T') {
        return None;
    }
    crate::report::parse_instant(s, 0).ok()
}

fn fm_str(a: &Artifact, key: &str) -> Option<String> {
    match a.frontmatter.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The rows of the first Markdown table under the heading `heading` (header and separator
/// skipped), each split into trimmed cells; `None` when there is no such heading.
fn table_rows(body: &str, heading: &str) -> Option<Vec<Vec<String>>> {
    let mut lines = body.lines().skip_while(|l| l.trim_end() != heading);
    lines.next()?;
    let mut rows = Vec::new();
    let mut seen_table = false;
    for line in lines {
        let line = line.trim();
        if line.starts_with("## ") {
            break;
        }
        if !line.starts_with('|') {
            if seen_table {
                break;
            }
            continue;
        }
        seen_table = true;
        rows.push(split_row(line));
    }
    // Header and separator.
    Some(rows.into_iter().skip(2).collect())
}

/// Splits `| a | b \| c |` into `["a", "b \| c"]`: an escaped `\|` stays in its cell.
fn split_row(line: &str) -> Vec<String> {
    let inner = line.strip_prefix('|').unwrap_or(line);
    let mut cells = Vec::new();
    let mut cell = String::new();
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cell.push_str("\\|");
                chars.next();
            }
            '|' => cells.push(std::mem::take(&mut cell).trim().to_owned()),
            c => cell.push(c),
        }
    }
    if !cell.trim().is_empty() {
        cells.push(cell.trim().to_owned());
    }
    cells
}

/// Undoes [`crate::text::md_cell`]'s escapes (a cut text keeps its `…`).
fn unescape_cell(s: &str) -> String {
    if s == "—" {
        return String::new();
    }
    s.replace("\\|", "|")
        .replace("<br>", "\n")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::{PostDeployLog, render_post_deploy_log};
    use crate::staging::{StagingEnvironment, StagingLog, render_staging_log};

    const ARMED: i64 = 1_781_611_200_000;

    fn id() -> WorkItemId {
        "APP-7".parse().unwrap()
    }

    fn poll(tick: u32, o: CheckOutcome) -> Poll {
        Poll {
            tick,
            at_ms: ARMED + 30_000 * (i64::from(tick) + 1),
            checks: vec![
                Check {
                    name: "health".into(),
                    outcome: o,
                    status_code: (o != CheckOutcome::Error).then_some(200),
                    latency_ms: Some(4),
                    detail: "a | b\nc <d> & e".into(),
                },
                Check {
                    name: "revision".into(),
                    outcome: CheckOutcome::Pass,
                    status_code: Some(200),
                    latency_ms: None,
                    detail: String::new(),
                },
            ],
        }
    }

    fn series(s: &str) -> Vec<Poll> {
        s.chars()
            .enumerate()
            .map(|(i, c)| {
                let o = match c {
                    'P' => CheckOutcome::Pass,
                    'F' => CheckOutcome::Fail,
                    'E' => CheckOutcome::Error,
                    _ => CheckOutcome::NoData,
                };
                poll(u32::try_from(i).unwrap(), o)
            })
            .collect()
    }

    /// The log the monitor writes for `polls`, decided as the monitor decides at `at`.
    fn watch_log(polls: &str, at: i64, lost: Option<&str>, action: ActionTaken) -> String {
        let s = series(polls);
        let p = WatchParams::default();
        let (verdict, reason) = match monitor::decide(&s, &p, ARMED, at) {
            WatchDecision::Final(v, r) => monitor::discount_lost_evidence(v, r, lost),
            WatchDecision::Continue { .. } => panic!("not final"),
        };
        render_post_deploy_log(&PostDeployLog {
            work_item: "APP-7",
            created_at_ms: at + 1_500,
            revision: "abc1234",
            params: &p,
            armed_at_ms: ARMED,
            series: &s,
            verdict,
            reason: &reason,
            action,
            action_detail: "",
            evidence_lost: lost,
        })
    }

    fn staging_log(steps: &[StepResult], attempt: u32, limit: u32) -> String {
        let plan = StagingPlan {
            step_names: steps.iter().map(|s| s.name.clone()).collect(),
        };
        let c = staging::classify(steps, &plan);
        let policy = DeferPolicy {
            limit,
            ..DeferPolicy::default()
        };
        let outcome = staging::decide_after(&c, attempt - 1, &policy)
            .outcome(&c)
            .expect("final");
        render_staging_log(&StagingLog {
            work_item: "APP-7",
            created_at_ms: ARMED,
            attempt,
            environment: &StagingEnvironment::default(),
            steps,
            classification: &c,
            outcome: &outcome,
            looks: &[],
        })
    }

    fn step(name: &str, exit: StepExit, smoke: bool) -> StepResult {
        StepResult {
            name: name.into(),
            command: format!("./{name}.sh | tee x"),
            exit,
            duration_ms: 12,
            output_tail: "out\nput".into(),
            is_smoke: smoke,
        }
    }

    fn change(from: &str, to: &str, outcome: &str, files: &[(&str, String)]) -> StageChange {
        StageChange {
            event_id: 1,
            at_ms: ARMED,
            from: from.into(),
            to: to.into(),
            outcome: outcome.into(),
            loops_before: 0,
            files: Ok(files
                .iter()
                .map(|(n, t)| ((*n).to_owned(), t.clone()))
                .collect()),
            watch_event: None,
        }
    }

    fn item(changes: Vec<StageChange>) -> ItemRecord {
        ItemRecord {
            work_item: id(),
            staging_defer_limit: 2,
            changes,
        }
    }

    fn of_kind(d: &[Replayed], kind: Kind) -> Vec<&Replayed> {
        d.iter().filter(|r| r.kind == kind).collect()
    }

    #[test]
    fn overrides_parse_and_refuse_clearly() {
        let o = Overrides::parse(&["post_deploy.failure_limit=5", " staging.defer_limit = 0 "])
            .unwrap();
        assert_eq!(o.failure_limit, Some(5));
        assert_eq!(o.staging_defer_limit, Some(0));
        assert_eq!(
            o.pairs(),
            [("post_deploy.failure_limit", 5), ("staging.defer_limit", 0)]
        );
        assert_eq!(o.thresholds().failed_total_fails_above, 5);
        assert_eq!(o.thresholds().failed_consecutive_fails, 3);
        assert!(Overrides::parse::<&str>(&[]).unwrap().is_empty());
        let err = |s: &str| Overrides::parse(&[s]).unwrap_err().to_string();
        assert!(
            err("post_deploy.nope=1").contains(
                "unknown key `post_deploy.nope`; the keys are post_deploy.consecutive_fail_limit"
            ),
            "{}",
            err("post_deploy.nope=1")
        );
        assert!(err("post_deploy.failure_limit").contains("not key=value"));
        assert!(err("post_deploy.failure_limit=-1").contains("whole number from 0"));
        assert!(err("post_deploy.failure_limit=x").contains("`x` is not valid"));
        assert!(err("post_deploy.failure_limit=99999999999").contains("not valid"));
        assert!(err("post_deploy.consecutive_fail_limit=0").contains("from 1"));
        assert!(err("post_deploy.healthy_last_valid_pass=0").contains("from 1"));
        assert!(
            err("x\u{1b}[31m=1").contains("\\u{1b}") || !err("x\u{1b}[31m=1").contains('\u{1b}')
        );
        assert!(
            Overrides::parse(&["staging.defer_limit=1", "staging.defer_limit=2"])
                .unwrap_err()
                .to_string()
                .contains("set twice")
        );
    }

    #[test]
    fn the_watch_log_reads_back_as_written() {
        let polls = "PFENP";
        let s = series(polls);
        let doc = watch_log(
            &format!("{polls}{}", "P".repeat(15)),
            ARMED + 600_000,
            Some("node gone"),
            ActionTaken::Alert,
        );
        let r = read_watch_log(&doc).unwrap();
        assert_eq!(r.params, WatchParams::default());
        assert_eq!(r.armed_at_ms, ARMED);
        assert_eq!(r.created_at_ms, ARMED + 601_000, "to the second");
        assert_eq!(r.lost.as_deref(), Some("node gone"));
        assert_eq!(r.status, "DEGRADED");
        assert_eq!(r.action, "alert");
        assert_eq!(r.series.len(), 20);
        assert_eq!(
            &r.series[..5],
            &s[..],
            "checks, details and escapes survive"
        );
    }

    #[test]
    fn the_staging_log_reads_back_as_written() {
        let steps = vec![
            step("build", StepExit::Exited(0), false),
            step("de|ploy", StepExit::Signaled(9), false),
        ];
        let r = read_staging_log(&staging_log(&steps, 3, 2)).unwrap();
        assert_eq!(r.status, "FAILED");
        assert_eq!(r.failure_kind.as_deref(), Some("tool_error_exhausted"));
        assert_eq!(r.attempt, 3);
        let got: Vec<(&str, StepExit, bool, &str)> = r
            .steps
            .iter()
            .map(|s| (s.name.as_str(), s.exit, s.is_smoke, s.command.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("build", StepExit::Exited(0), false, "./build.sh | tee x"),
                (
                    "de|ploy",
                    StepExit::Signaled(9),
                    false,
                    "./de|ploy.sh | tee x"
                )
            ]
        );
        for e in [
            StepExit::Exited(-3),
            StepExit::TimedOut,
            StepExit::NotFound,
            StepExit::PermissionDenied,
            StepExit::Unreachable,
        ] {
            assert_eq!(parse_exit(&e.to_string()), Some(e));
        }
        let none = read_staging_log(&staging_log(&[], 3, 2)).unwrap();
        assert!(none.steps.is_empty());
    }

    /// A whole item as the pipeline records it: every decision agrees with today's rules.
    #[test]
    fn a_recorded_item_replays_in_agreement() {
        let review = "---\nwork_item: APP-7\nstage: review\nauthor_agent: reviewer\nstatus: final\ncreated_at: 2026-01-01T00:00:00Z\nmodel_used: m\nreview_status: CHANGES_REQUESTED\n---\nbody\n".to_owned();
        let staging = staging_log(
            &[
                step("build", StepExit::Exited(0), false),
                step("smoke", StepExit::Exited(0), true),
            ],
            1,
            2,
        );
        let healthy = watch_log(&"P".repeat(20), ARMED + 600_000, None, ActionTaken::None);
        let mut observe = change(
            "observe",
            "lessons",
            "HEALTHY",
            &[(POST_DEPLOY_LOG, healthy.clone())],
        );
        observe.watch_event = Some(("HEALTHY".into(), "none".into()));
        let rec = item(vec![
            change(
                "review",
                "implementation",
                "CHANGES_REQUESTED",
                &[("11-review.md", review)],
            ),
            change("staging", "deploy", "SUCCESS", &[(STAGING_LOG, staging)]),
            change("deploy", "observe", "DEPLOYED", &[]),
            observe,
        ]);
        let d = replay_item(&Pipeline::default_pipeline(), &rec, &Overrides::default());
        for r in &d {
            assert_eq!(r.agreement, Agreement::Agrees, "{r:?}");
        }
        let kinds: Vec<Kind> = d.iter().map(|r| r.kind).collect();
        use Kind::*;
        assert_eq!(
            kinds,
            [Gate, Route, Gate, Route, Staging, Route, Gate, Route, Watch]
        );
        let s = Summary::of(&d);
        assert_eq!((s.decisions, s.agree, s.watches), (9, 9, 1));

        // The loop bound is replayed too: with the bound used up, review fails the item.
        let mut used_up = rec.clone();
        used_up.changes[0].loops_before = 3;
        let d = replay_item(
            &Pipeline::default_pipeline(),
            &used_up,
            &Overrides::default(),
        );
        assert_eq!(d[1].replayed, "failed");
        assert_eq!(d[1].agreement, Agreement::Differs);
    }

    #[test]
    fn a_threshold_change_flips_the_verdicts_it_should_and_counts_rollbacks() {
        let healthy = watch_log(&"P".repeat(20), ARMED + 600_000, None, ActionTaken::None);
        // The 4th FAIL poll at the last slot: FAILED (more than 3) at the deadline.
        let failed_polls = format!("{}FPFPFPF", "P".repeat(13));
        let failed = watch_log(&failed_polls, ARMED + 600_000, None, ActionTaken::Rollback);
        // 3 consecutive FAIL polls early: FAILED at tick 3, the series ends there.
        let early = watch_log("PFFF", ARMED + 120_000, None, ActionTaken::Rollback);
        let watch = |n: i64, log: &str, v: &str, a: &str| {
            let mut c = change(
                "observe",
                "lessons",
                v,
                &[(POST_DEPLOY_LOG, log.to_owned())],
            );
            c.event_id = n;
            c.watch_event = Some((v.into(), a.into()));
            c
        };
        let rec = item(vec![
            watch(1, &healthy, "HEALTHY", "none"),
            watch(2, &failed, "FAILED", "rollback"),
            watch(3, &early, "FAILED", "rollback"),
        ]);
        let p = Pipeline::default_pipeline();
        let watches = |o: &Overrides| -> Vec<(String, Agreement, Option<Rollback>)> {
            of_kind(&replay_item(&p, &rec, o), Kind::Watch)
                .into_iter()
                .map(|r| (r.replayed.clone(), r.agreement, r.rollback))
                .collect()
        };
        let today = watches(&Overrides::default());
        assert!(today.iter().all(|w| w.1 == Agreement::Agrees), "{today:?}");

        // More FAIL polls allowed: the deadline's FAILED becomes DEGRADED, a rollback avoided.
        let o = Overrides::parse(&["post_deploy.failure_limit=4"]).unwrap();
        let got = watches(&o);
        assert_eq!(got[0].1, Agreement::Agrees);
        assert_eq!(got[1].0, "DEGRADED");
        assert_eq!(got[1].1, Agreement::Differs);
        assert_eq!(got[2].1, Agreement::Agrees, "3 consecutive still fail");
        let all = replay_item(&p, &rec, &o);
        let s = Summary::of(&all);
        assert_eq!(
            (s.differ, s.rollbacks_avoided, s.rollbacks_added),
            (1, 1, 0)
        );

        // A longer consecutive run needed: the early FAILED is undecided (no later polls).
        let o = Overrides::parse(&["post_deploy.consecutive_fail_limit=4"]).unwrap();
        let got = watches(&o);
        assert_eq!(got[2].0, "undecided");
        assert_eq!(got[2].2.and_then(|r| r.replayed), None);
        assert_eq!(
            Summary::of(&replay_item(&p, &rec, &o)).rollbacks_undetermined,
            1
        );

        // Stricter: FAILED at 1 FAIL poll adds no rollback to an all-PASS watch, but HEALTHY
        // needing 21 trailing PASS polls makes it DEGRADED.
        let o = Overrides::parse(&["post_deploy.healthy_last_valid_pass=21"]).unwrap();
        let got = watches(&o);
        assert_eq!(got[0].0, "DEGRADED");
        let o = Overrides::parse(&["post_deploy.failure_limit=0"]).unwrap();
        let s = Summary::of(&replay_item(&p, &rec, &o));
        assert_eq!(s.rollbacks_added, 0);
    }

    #[test]
    fn lost_evidence_and_superseded_watches_replay_by_the_monitors_rules() {
        let lost = watch_log(
            &"P".repeat(20),
            ARMED + 600_000,
            Some("node gone"),
            ActionTaken::Alert,
        );
        let mut c = change("observe", "lessons", "DEGRADED", &[(POST_DEPLOY_LOG, lost)]);
        c.watch_event = Some(("DEGRADED".into(), "alert".into()));
        let d = replay_item(
            &Pipeline::default_pipeline(),
            &item(vec![c]),
            &Overrides::default(),
        );
        let w = of_kind(&d, Kind::Watch)[0];
        assert_eq!(
            (w.replayed.as_str(), w.agreement),
            ("DEGRADED", Agreement::Agrees),
            "{w:?}"
        );

        // Superseded after 5 polls: judged as at the deadline, DEGRADED for lack of evidence.
        let s = series("PPPPP");
        let p = WatchParams::default();
        let (v, why) = monitor::judge_superseded(&s, &p, &Thresholds::default(), ARMED, None);
        let doc = render_post_deploy_log(&PostDeployLog {
            work_item: "APP-7",
            created_at_ms: ARMED + 160_000,
            revision: "abc1234",
            params: &p,
            armed_at_ms: ARMED,
            series: &s,
            verdict: v,
            reason: &format!(
                "superseded by APP-8 (deploy of `def`) after 5 polls; judged on the evidence so far: {why}"
            ),
            action: ActionTaken::None,
            action_detail: "",
            evidence_lost: None,
        });
        let c = change("observe", "lessons", "DEGRADED", &[(POST_DEPLOY_LOG, doc)]);
        let d = replay_item(
            &Pipeline::default_pipeline(),
            &item(vec![c]),
            &Overrides::default(),
        );
        let w = of_kind(&d, Kind::Watch)[0];
        assert_eq!(
            (w.replayed.as_str(), w.agreement),
            ("DEGRADED", Agreement::Agrees),
            "{w:?}"
        );
    }

    #[test]
    fn the_staging_defer_limit_is_replayed() {
        let steps = [step("build", StepExit::NotFound, false)];
        let log = staging_log(&steps, 3, 2);
        let rec = item(vec![change(
            "staging",
            "failed",
            TOOL_ERROR_EXHAUSTED,
            &[(STAGING_LOG, log)],
        )]);
        let p = Pipeline::default_pipeline();
        let d = replay_item(&p, &rec, &Overrides::default());
        assert!(d.iter().all(|r| r.agreement == Agreement::Agrees), "{d:?}");
        assert_eq!(
            of_kind(&d, Kind::Gate).len(),
            0,
            "a reported outcome has no gate"
        );
        let o = Overrides::parse(&["staging.defer_limit=3"]).unwrap();
        let d = replay_item(&p, &rec, &o);
        let s = of_kind(&d, Kind::Staging)[0];
        assert_eq!(s.recorded, "FAILED (tool_error_exhausted)");
        assert_eq!(s.replayed, "deferred (defer 3 of 3)");
        assert_eq!(s.agreement, Agreement::Differs);
    }

    /// Hostile or broken records: a clear `cannot replay`, never a panic.
    #[test]
    fn broken_records_cannot_be_replayed_and_say_why() {
        let p = Pipeline::default_pipeline();
        let good = watch_log(&"P".repeat(20), ARMED + 600_000, None, ActionTaken::None);
        let broken: Vec<(&str, String, &str)> = vec![
            ("no frontmatter", "# nothing\n".into(), "no frontmatter"),
            (
                "no watch",
                good.replace("## Watch", "## Elsewhere"),
                "no Watch table",
            ),
            (
                "bad armed",
                good.replace("| armed at | 2026", "| armed at | x2026"),
                "`armed at`",
            ),
            (
                "bad tick",
                good.replacen("| 3 | 2026", "| 3x | 2026", 1),
                "tick is `3x`",
            ),
            (
                "bad outcome",
                good.replacen("| health | PASS |", "| health | MAYBE |", 1),
                "MAYBE",
            ),
            (
                "status lies",
                good.replacen("| PASS | health | PASS |", "| FAIL | health | PASS |", 1),
                "says FAIL",
            ),
            (
                "short row",
                good.replacen("| health | PASS | 200 | 4 ms |", "| health |", 1),
                "cells",
            ),
            (
                "huge window",
                good.replace(
                    "| window_s | 600 |",
                    "| window_s | 99999999999999999999999 |",
                ),
                "window_s",
            ),
        ];
        for (name, text, want) in broken {
            let c = change("observe", "lessons", "HEALTHY", &[(POST_DEPLOY_LOG, text)]);
            let d = replay_item(&p, &item(vec![c]), &Overrides::default());
            let w = of_kind(&d, Kind::Watch)[0];
            assert_eq!(w.agreement, Agreement::Unreplayable, "{name}: {w:?}");
            assert!(w.replayed.starts_with("cannot replay: "), "{name}: {w:?}");
            assert!(
                w.replayed.contains(want),
                "{name}: {:?} lacks {want:?}",
                w.replayed
            );
        }
        // A missing log, a commit that is gone, a stage no longer in the pipeline.
        let c = change("observe", "lessons", "HEALTHY", &[]);
        let d = replay_item(&p, &item(vec![c]), &Overrides::default());
        assert!(
            of_kind(&d, Kind::Watch)[0]
                .replayed
                .contains("is not in the item's folder")
        );
        let mut c = change("staging", "deploy", "SUCCESS", &[]);
        c.files = Err("commit abc is not in orch's clone".into());
        let d = replay_item(&p, &item(vec![c]), &Overrides::default());
        assert_eq!(
            of_kind(&d, Kind::Gate)[0].replayed,
            "cannot replay: commit abc is not in orch's clone"
        );
        assert_eq!(
            of_kind(&d, Kind::Staging)[0].agreement,
            Agreement::Unreplayable
        );
        let c = change("qa\u{1b}", "x", "OK", &[]);
        let d = replay_item(&p, &item(vec![c]), &Overrides::default());
        assert_eq!(d.len(), 1);
        assert!(
            d[0].replayed.contains("not in today's pipeline") && !d[0].replayed.contains('\u{1b}')
        );
        // Broken staging logs.
        let ok = staging_log(&[step("build", StepExit::Exited(0), false)], 1, 2);
        for (text, want) in [
            (ok.replace("attempt: 1", "attempt: 0"), "attempt"),
            (ok.replace("| exit 0 |", "| exit zero |"), "no known exit"),
            (ok.replace("## Steps", "## Nope"), "no Steps table"),
            (
                ok.replace("staging_status: SUCCESS", "staging_status: [1]"),
                "staging_status",
            ),
        ] {
            let c = change("staging", "deploy", "SUCCESS", &[(STAGING_LOG, text)]);
            let d = replay_item(&p, &item(vec![c]), &Overrides::default());
            let s = of_kind(&d, Kind::Staging)[0];
            assert_eq!(s.agreement, Agreement::Unreplayable, "{s:?}");
            assert!(s.replayed.contains(want), "{:?} lacks {want:?}", s.replayed);
        }
    }
}
