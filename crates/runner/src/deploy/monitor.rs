//! The `observe` stage: the post-deploy monitor (ORCH-021, seed `002_…`, design.md §7). One job is
//! one tick: it polls the service once, appends the poll to the watch's `series`, and either
//! asks for the next tick (a requeue with `available_at_delay_s` = the time to the next slot)
//! or ends the watch with a verdict and its reaction, writes `16-post-deploy-log.md` (design.md §7)
//! and marks the watch `done` (design.md §7, §5).
//!
//! Restart safety (design.md §7, §3): the tick a job polls for is recovered from the jobs queue —
//! the number of this visit's jobs carrying the tick marker — and never lags behind the clock
//! (a slot missed while no worker ran is skipped, not polled late); the series ignores a
//! repeated tick; `done` makes any later job a no-op; a rollback is recorded as started before
//! it runs, so a re-run never rolls back twice. Every sentinel read falls back conservatively
//! (design.md §7 "never-raise"): a missing or corrupt `armed` ends the watch DEGRADED with the loss
//! said in the log and an event; lost evidence never ends HEALTHY.
//!
//! A stranded watch (`armed` without `done`, no live job — e.g. the job failed for good) is
//! found by [`active_watches`] (`GET /queue`, as an active observation, design.md §7) and completed by a
//! job that [`recover_watches`] enqueues.

use std::path::Path;
use std::time::Duration;

use orch_deploystate::{ArmedRead, ArmedRecord, WatchState, list_active};
use orch_domain::control::markers;
use orch_domain::monitor::{
    ActionTaken, CheckOutcome, Decision, Poll, PostDeployLog, Thresholds, Verdict, WatchParams,
    decide, discount_lost_evidence, judge_superseded, planned_polls, render_post_deploy_log,
    tick_at_ms,
};
use orch_domain::payload::{self, DeployConfirmed, NodeTakeover};
use orch_domain::recovery::Trouble;
use orch_store::{JobCount, NewEvent, NewJob, Store};
use serde_json::json;

use super::probe::{Probe, live_revision, revision_matches};
use super::{MONITOR_AGENT, data, events, record, watch_params};
use crate::engine::{StageEffect, StageExecutor, StageJob, StageRun};

/// The artifact the monitor writes (design.md §7).
pub const POST_DEPLOY_LOG: &str = "16-post-deploy-log.md";

/// The sentinel file that says a newer deploy of the same repo superseded a watch; its
/// content is `<work item> <revision>` of the newer deploy.
pub const SUPERSEDED_FILE: &str = "superseded";

/// Marks every other active watch of `repo` in `repos_dir` as superseded by `work_item`'s
/// deploy of `revision` (called by the deployer when it arms a watch): their next tick ends
/// them from the evidence so far, without a rollback (their revision is no longer live).
/// Never raises: a marker that cannot be written is logged. Returns the superseded work items.
pub fn supersede_others(
    repos_dir: &Path,
    repo: &str,
    work_item: &str,
    revision: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    for w in list_active(repos_dir) {
        if w.repo != repo || w.work_item_id == work_item {
            continue;
        }
        let ws = WatchState::new(repos_dir, &w.repo, &w.work_item_id);
        let Some(dir) = ws.dir() else { continue };
        let path = dir.join(SUPERSEDED_FILE);
        let tmp = dir.join(format!(".{SUPERSEDED_FILE}.tmp"));
        let written = std::fs::write(&tmp, format!("{work_item} {revision}\n"))
            .and_then(|()| std::fs::rename(&tmp, &path));
        match written {
            Ok(()) => out.push(w.work_item_id),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot mark an older watch superseded; it runs to its deadline");
            }
        }
    }
    out
}

/// `(work item, revision)` of the deploy that superseded this watch, if any.
/// A delay for a message: `30s`, or `0.97s` when not a whole second.
fn seconds(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.2}s", ms as f64 / 1000.0)
    }
}

fn superseded_by(ws: &WatchState) -> Option<(String, String)> {
    let path = ws.dir()?.join(SUPERSEDED_FILE);
    let text = std::fs::read_to_string(&path).ok()?;
    let mut parts = text.split_whitespace();
    let item = parts.next()?.to_owned();
    let rev = parts.next().unwrap_or("unknown").to_owned();
    Some((item, rev))
}

/// The `observe` stage's executor (agent `post-deploy-monitor`).
#[derive(Debug, Clone)]
pub struct MonitorExecutor {
    /// Health polls after a rollback command before it counts as failed (default 3).
    pub verify_polls: u32,
    /// Time before each verification poll (default 5 s).
    pub verify_interval: Duration,
}

impl Default for MonitorExecutor {
    fn default() -> Self {
        MonitorExecutor {
            verify_polls: 3,
            verify_interval: Duration::from_secs(5),
        }
    }
}

/// How a watch ended, for the log and the events.
struct Ending {
    verdict: Verdict,
    reason: String,
    action: ActionTaken,
    action_detail: String,
    /// The revision production was verified healthy at, when it was.
    live: Option<String>,
}

#[async_trait::async_trait]
impl StageExecutor for MonitorExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let seq = super::visit_seq(run);
        let ws = WatchState::new(
            &run.repos_dir,
            run.repo_name.as_str(),
            run.work_item.as_str(),
        );
        if ws.is_done() {
            if let Some(effect) = self.retried(run, &ws, seq).await? {
                return Ok(effect);
            }
            tracing::info!(work_item = %run.work_item, "post-deploy watch already done; nothing to do");
            return Ok(StageEffect::Produced { outcome: None });
        }
        let armed = match ws.armed() {
            ArmedRead::Present(armed) => armed,
            ArmedRead::Absent => match rearm_after_takeover(run, &ws, seq).await? {
                Some(armed) => armed,
                None => return self.without_watch(run, &ws, seq, None).await,
            },
            ArmedRead::Corrupt(why) => return self.without_watch(run, &ws, seq, Some(why)).await,
        };
        self.tick(run, &ws, seq, &armed).await
    }

    /// A tick polls and writes only the watch's state files, outside the worktree: the
    /// worktree is prepared for the post-deploy log at the end, not on every tick.
    fn defers_worktree(&self) -> bool {
        true
    }

    /// The watch's first poll is due after the repo's initial delay: so is its first job.
    fn first_delay_s(&self, repo: &orch_domain::config::RepoConfig) -> u64 {
        repo.post_deploy.initial_delay_s
    }

    /// A task that failed (in any stage) leaves no watch armed and no deploy markers: a retry
    /// deploys afresh ([`crate::release::end_watch`]).
    fn task_failed(&self, repos_dir: &std::path::Path, task: &orch_store::Task, reason: &str) {
        crate::release::end_watch(
            repos_dir,
            task.repo.as_str(),
            task.work_item_id.as_str(),
            reason,
        );
    }
}

impl MonitorExecutor {
    /// A visit that an operator's retry started after the watch had ended with the task's
    /// failure: the newest of the task's `task.retried`, `post_deploy.verdict` and
    /// `post_deploy.rearmed` events is the retry. The item's revision still live: a fresh watch
    /// of it (`post_deploy.rearmed`), then ticks as usual. Another revision live (a later deploy,
    /// a rollback): nothing of this item can be watched, the visit ends DEGRADED saying so.
    /// `None` when this visit is not such a retry.
    async fn retried(
        &self,
        run: &StageRun,
        ws: &WatchState,
        seq: i64,
    ) -> anyhow::Result<Option<StageEffect>> {
        let history = run.store.task_events(run.task.id).await?;
        let newest = history.iter().rev().find(|e| {
            matches!(
                e.kind.as_str(),
                events::TASK_RETRIED | events::POST_DEPLOY_VERDICT | events::POST_DEPLOY_REARMED
            )
        });
        if newest.is_none_or(|e| e.kind != events::TASK_RETRIED) {
            return Ok(None);
        }
        let old = match ws.armed() {
            ArmedRead::Present(armed) => armed,
            ArmedRead::Absent => return self.without_watch(run, ws, seq, None).await.map(Some),
            ArmedRead::Corrupt(why) => {
                return self.without_watch(run, ws, seq, Some(why)).await.map(Some);
            }
        };
        let timeout = Duration::from_secs(run.repo.post_deploy.poll_timeout_s.max(1));
        let live = match &run.repo.revision_url {
            Some(url) => live_revision(url, timeout).await,
            None => None,
        };
        let params = watch_params(&run.repo.post_deploy);
        let still_live = live
            .as_deref()
            .is_some_and(|live| revision_matches(&old.revision, live));
        if !still_live {
            let now = run.store.now_ms();
            let live = live.map_or("unknown (no revision_url answer)".to_owned(), |l| {
                format!("`{l}`")
            });
            let ending = Ending {
                verdict: Verdict::Degraded,
                reason: format!(
                    "retried after the watch had ended: `{}` is no longer live (live: {live}), \
                     so nothing of {} can be watched",
                    old.revision, run.work_item
                ),
                action: ActionTaken::None,
                action_detail: String::new(),
                live: None,
            };
            return finish(run, ws, seq, &params, now, &old.revision, &[], None, ending)
                .await
                .map(Some);
        }
        let armed = ArmedRecord::new(params, run.store.now_ms(), old.revision.clone());
        if !ws.clear() {
            anyhow::bail!(
                "post-deploy watch of {}: cannot clear the ended watch to watch it again",
                run.work_item
            );
        }
        match ws.arm(&armed) {
            orch_deploystate::ArmOutcome::Armed => {}
            orch_deploystate::ArmOutcome::AlreadyArmed(_) => {}
            orch_deploystate::ArmOutcome::Failed(why) => {
                anyhow::bail!(
                    "post-deploy watch of {}: cannot arm it again: {why}",
                    run.work_item
                )
            }
        }
        record(
            run,
            seq,
            events::POST_DEPLOY_REARMED,
            format!(
                "retried by an operator: `{}` is still live, watching it again",
                armed.revision
            ),
            data([("revision", json!(armed.revision))]),
        )
        .await?;
        self.tick(run, ws, seq, &armed).await.map(Some)
    }

    /// One tick of an armed watch.
    async fn tick(
        &self,
        run: &StageRun,
        ws: &WatchState,
        seq: i64,
        armed: &ArmedRecord,
    ) -> anyhow::Result<StageEffect> {
        let params = armed.params;
        if let Some((by, by_revision)) = superseded_by(ws) {
            return self
                .superseded(run, ws, seq, armed, &by, &by_revision)
                .await;
        }
        let now = run.store.now_ms();
        let first = tick_at_ms(&params, armed.armed_at_ms, 0);
        if now < first {
            let waits = count(run, &markers::monitor_wait_prefix(seq)).await?;
            let delay_ms = u64::try_from(first - now).unwrap_or(0).max(1);
            return Ok(StageEffect::Requeue {
                delay_ms,
                marker: markers::monitor_wait(seq, waits.saturating_add(1)),
                reason: format!("post-deploy watch: first poll in {}", seconds(delay_ms)),
            });
        }

        // The job that acts on the verdict a tick reached polls nothing more: the verdict
        // stands on the polls that were made (and is decided again from them, below).
        let ending = run.job.task_content.contains(&markers::monitor_end(seq));
        // The slot to poll for: the number of this visit's tick jobs up to this one, never
        // behind the clock. A tick job carries it in its marker (the queue keeps it with the
        // job: a rescued job reads the same number, so no slot is polled twice); a job without
        // one (the first, an ending) counts the visit's tick jobs in the queue. Counting on
        // every tick would read every earlier tick job: O(ticks) per poll.
        let tick_jobs = match own_tick(run, seq) {
            Some(n) => n,
            None => count(run, &markers::monitor_tick_prefix(seq)).await?,
        };
        let interval_ms =
            i64::try_from(params.interval_s.max(1).saturating_mul(1_000)).unwrap_or(i64::MAX);
        let slot_now = u32::try_from((now - first) / interval_ms).unwrap_or(u32::MAX);
        let tick = tick_jobs.max(slot_now);
        // The series as this tick left it: returned by the append, read only when nothing
        // was appended (an ending) or the append failed.
        let mut recorded = None;
        if !ending && tick < planned_polls(&params) {
            run.counters.incr("post_deploy_monitor", "ticks");
            let poll = self.poll(run, &params, &armed.revision, tick, now).await;
            crate::failpoint::hit("monitor.before_append");
            recorded = ws.record_poll(&poll);
            if recorded.is_none() {
                let why = format!("poll of tick {tick} could not be stored in the series");
                ws.mark_lost(&why);
                record(
                    run,
                    seq,
                    events::POST_DEPLOY_EVIDENCE_LOST,
                    &why,
                    data([("tick", json!(tick))]),
                )
                .await?;
            }
        }

        let series = recorded.unwrap_or_else(|| ws.series());
        match decide(&series.polls, &params, armed.armed_at_ms, now) {
            Decision::Continue { next_delay_ms } => Ok(StageEffect::Requeue {
                delay_ms: next_delay_ms.max(1),
                marker: markers::monitor_tick(seq, tick.saturating_add(1)),
                reason: format!(
                    "post-deploy watch: tick {tick} polled; next in {}",
                    seconds(next_delay_ms)
                ),
            }),
            // The tick that reached the verdict gives its worker's slot back at once: the
            // ending (the worktree, a rollback, the log's commit, the stage change) is a job of
            // its own that waits behind every poll due now, so watches ending together never
            // make the others miss their slots. It decides again from the same polls: a
            // verdict only ever stands or comes later, never changes.
            Decision::Final(verdict, reason) if !ending => Ok(StageEffect::Yield {
                marker: markers::monitor_end(seq),
                reason: format!(
                    "post-deploy watch: {} after tick {tick} ({reason}); acting on it next",
                    verdict.as_str()
                ),
            }),
            Decision::Final(verdict, reason) => {
                // The worktree the log goes into is prepared before anything is acted on: should
                // that fail, the retry starts over with nothing half done (no rollback run whose
                // bookkeeping waits behind a git failure).
                run.ensure_worktree().await?;
                let (verdict, reason) =
                    discount_lost_evidence(verdict, reason, series.lost.as_deref());
                let ending = self.react(run, seq, armed, verdict, reason).await?;
                finish(
                    run,
                    ws,
                    seq,
                    &params,
                    armed.armed_at_ms,
                    &armed.revision,
                    &series.polls,
                    series.lost.as_deref(),
                    ending,
                )
                .await
            }
        }
    }

    /// Ends a watch a newer deploy superseded: the verdict from the evidence so far (judged
    /// as at the deadline), no rollback (the watched revision is no longer live), an alert
    /// only when the evidence holds FAIL polls (a watch merely cut short is DEGRADED for lack
    /// of evidence, with nothing live to act on).
    async fn superseded(
        &self,
        run: &StageRun,
        ws: &WatchState,
        seq: i64,
        armed: &ArmedRecord,
        by: &str,
        by_revision: &str,
    ) -> anyhow::Result<StageEffect> {
        // As before any final action: prepared first (see `tick`).
        run.ensure_worktree().await?;
        let series = ws.series();
        let (verdict, why) = judge_superseded(
            &series.polls,
            &armed.params,
            &Thresholds::default(),
            armed.armed_at_ms,
            series.lost.as_deref(),
        );
        let reason = format!(
            "superseded by {by} (deploy of `{by_revision}`) after {} polls; judged on the evidence so far: {why}",
            series.polls.len()
        );
        record(
            run,
            seq,
            events::POST_DEPLOY_SUPERSEDED,
            &reason,
            data([
                ("by", json!(by)),
                ("by_revision", json!(by_revision)),
                ("revision", json!(armed.revision)),
            ]),
        )
        .await?;
        let failed_polls = series
            .polls
            .iter()
            .filter(|p| p.status() == CheckOutcome::Fail)
            .count();
        let no_rollback = format!(
            "no rollback: `{}` is no longer live ({by} deployed `{by_revision}`)",
            armed.revision
        );
        let (action, action_detail) = match verdict {
            Verdict::Healthy => (ActionTaken::None, String::new()),
            // Cut short with nothing wrong seen: not enough evidence, nothing live to act on.
            Verdict::Degraded if failed_polls == 0 => (ActionTaken::None, no_rollback),
            Verdict::Degraded | Verdict::Failed => {
                let detail = format!("{no_rollback}; {failed_polls} FAIL polls seen before");
                let why_all = format!("{}: {reason}; {detail}", verdict.as_str());
                let sight = super::recover::look(run).await;
                super::alert::raise(
                    run,
                    seq,
                    &super::alert::Alert {
                        occasion: &format!("{}-superseded", verdict.as_str().to_lowercase()),
                        verdict: verdict.as_str(),
                        action: ActionTaken::Alert.as_str(),
                        reason: &why_all,
                        revision: &armed.revision,
                        previous: None,
                        sight: Some(&sight),
                        tried: &[],
                        todo: &format!(
                            "check that {by}'s `{by_revision}` is healthy; {} was not rolled back",
                            run.work_item
                        ),
                    },
                )
                .await?;
                (ActionTaken::Alert, detail)
            }
        };
        let ending = Ending {
            verdict,
            reason,
            action,
            action_detail,
            live: None,
        };
        finish(
            run,
            ws,
            seq,
            &armed.params,
            armed.armed_at_ms,
            &armed.revision,
            &series.polls,
            series.lost.as_deref(),
            ending,
        )
        .await
    }

    /// Polls the service once: the health check, and the revision check when configured.
    async fn poll(
        &self,
        run: &StageRun,
        params: &WatchParams,
        watched: &str,
        tick: u32,
        now: i64,
    ) -> Poll {
        // One probe for the poll: its checks share a connection where they can.
        let mut probe = Probe::new(Duration::from_secs(params.poll_timeout_s.max(1)));
        let mut checks = Vec::new();
        if let Some(url) = &run.repo.health_url {
            checks.push(probe.health(url).await);
        }
        if let Some(url) = &run.repo.revision_url {
            checks.push(probe.revision(url, watched).await.check);
        }
        if let Some(url) = &run.repo.control_url {
            let mut control = probe.health(url).await;
            control.name = "control".to_owned();
            if control.outcome != CheckOutcome::Pass {
                // The monitor cannot see: what it could not reach is its blindness, not the
                // service's failure.
                for c in &mut checks {
                    if c.outcome == CheckOutcome::Fail && c.status_code.is_none() {
                        c.outcome = CheckOutcome::Error;
                        c.detail =
                            format!("{} (control check failed: the monitor is blind)", c.detail);
                    }
                }
                control.outcome = CheckOutcome::Error;
                checks.push(control);
            }
        }
        Poll {
            tick,
            at_ms: now,
            checks,
        }
    }

    /// The reaction to a final verdict (design.md §7, §11): HEALTHY → none; FAILED and
    /// DEGRADED → production is settled by [`super::recover`]: FAILED rolls back while the
    /// watched revision is live (or the service does not answer at all), verified by polls;
    /// whatever is not verified healthy at a known revision alerts; DEGRADED always alerts.
    async fn react(
        &self,
        run: &StageRun,
        seq: i64,
        armed: &ArmedRecord,
        verdict: Verdict,
        reason: String,
    ) -> anyhow::Result<Ending> {
        let trouble = match verdict {
            Verdict::Healthy => {
                return Ok(Ending {
                    verdict,
                    reason,
                    action: ActionTaken::None,
                    action_detail: String::new(),
                    live: Some(armed.revision.clone()),
                });
            }
            Verdict::Degraded => Trouble::WatchDegraded,
            Verdict::Failed => Trouble::WatchFailed,
        };
        let settlement = super::recover::settle(
            run,
            seq,
            &super::recover::WATCH,
            &super::recover::Verify {
                polls: self.verify_polls,
                interval: self.verify_interval,
            },
            super::recover::Case {
                trouble,
                revision: &armed.revision,
                previous: crate::release::previous_of_deploy(run).await,
                what: reason.clone(),
                tried: Vec::new(),
                verdict: verdict.as_str(),
                alert_if_settled: true,
            },
        )
        .await?;
        let action = match settlement.rolled {
            orch_domain::payload::Rolled::Verified => ActionTaken::Rollback,
            orch_domain::payload::Rolled::Failed => ActionTaken::RollbackFailed,
            orch_domain::payload::Rolled::NotRun => ActionTaken::Alert,
        };
        Ok(Ending {
            verdict,
            reason,
            action,
            action_detail: settlement.summary,
            live: settlement.settled,
        })
    }

    /// Ends a watch that could not watch: DEGRADED (never HEALTHY without evidence), with the
    /// loss said — `armed` absent or unusable, or a repo without `health_url` (the deploy armed
    /// nothing). Production is looked at and an operator alerted ([`super::recover`],
    /// `Trouble::Unwatched`): nothing proved it healthy.
    async fn without_watch(
        &self,
        run: &StageRun,
        ws: &WatchState,
        seq: i64,
        corrupt: Option<String>,
    ) -> anyhow::Result<StageEffect> {
        // As before any final action: prepared first (see `tick`).
        run.ensure_worktree().await?;
        let params = watch_params(&run.repo.post_deploy);
        let now = run.store.now_ms();
        let series = ws.series();
        let history = run.store.task_events(run.task.id).await?;
        let revision = history
            .iter()
            .rev()
            .find(|e| e.kind == events::DEPLOY_CONFIRMED)
            .and_then(|e| payload::read::<DeployConfirmed>(&e.data))
            .map_or_else(|| "unknown".to_owned(), |d| d.revision);
        let (reason, lost) = match (corrupt, &run.repo.health_url) {
            (None, None) => (
                "nothing was watched: the repo has no health_url, so the deploy armed no watch"
                    .to_owned(),
                None,
            ),
            (corrupt, _) => {
                let lost = match corrupt {
                    Some(why) => format!("the watch's `armed` file is unusable ({why})"),
                    None => "no armed watch found: the watch's state is missing".to_owned(),
                };
                record(run, seq, events::POST_DEPLOY_EVIDENCE_LOST, &lost, data([])).await?;
                (format!("evidence lost: {lost}"), Some(lost))
            }
        };
        let settlement = super::recover::settle(
            run,
            seq,
            &super::recover::WATCH,
            &super::recover::Verify {
                polls: self.verify_polls,
                interval: self.verify_interval,
            },
            super::recover::Case {
                trouble: Trouble::Unwatched,
                revision: &revision,
                previous: crate::release::previous_of_deploy(run).await,
                what: reason.clone(),
                tried: Vec::new(),
                verdict: Verdict::Degraded.as_str(),
                alert_if_settled: true,
            },
        )
        .await?;
        let lost = match (lost, series.lost) {
            (Some(a), Some(b)) => Some(format!("{a}; {b}")),
            (a, b) => a.or(b),
        };
        let ending = Ending {
            verdict: Verdict::Degraded,
            reason,
            action: ActionTaken::Alert,
            action_detail: settlement.summary,
            live: settlement.settled,
        };
        finish(
            run,
            ws,
            seq,
            &params,
            now,
            &revision,
            &series.polls,
            lost.as_deref(),
            ending,
        )
        .await
    }
}

/// The watch of this visit ran on a node that is gone, and this node took its job over
/// (a `node.takeover` event of this visit naming this node, design.md §10): the `armed` and
/// `series` files stayed on that node's disk. Re-arms the watch here from the deploy's
/// `deploy.confirmed` event (its revision; armed when it was recorded; this node's watch
/// parameters), so its ticks go on against the original deadline, and marks the polls taken
/// there as lost (`lost`, a `post_deploy.taken_over` event): lost evidence never ends HEALTHY.
/// `None` when this is no takeover or the events hold no armed deploy (then the watch's
/// state is missing, as before).
async fn rearm_after_takeover(
    run: &StageRun,
    ws: &WatchState,
    seq: i64,
) -> anyhow::Result<Option<ArmedRecord>> {
    let history = run.store.task_events(run.task.id).await?;
    let Some(takeover) = history
        .iter()
        .rev()
        .filter(|e| e.kind == events::NODE_TAKEOVER)
        .filter_map(|e| payload::read::<NodeTakeover>(&e.data))
        .find(|t| t.seq == Some(seq) && t.to.as_deref() == Some(run.node.as_str()))
    else {
        return Ok(None);
    };
    let from = takeover.from.unwrap_or_else(|| "?".to_owned());
    let Some((confirmed, revision)) = history.iter().rev().find_map(|e| {
        (e.kind == events::DEPLOY_CONFIRMED)
            .then(|| payload::read::<DeployConfirmed>(&e.data))
            .flatten()
            .filter(|d| d.armed)
            .map(|d| (e, d.revision))
    }) else {
        return Ok(None);
    };
    let record = ArmedRecord::new(
        watch_params(&run.repo.post_deploy),
        confirmed.created_at,
        revision.as_str(),
    );
    match ws.arm(&record) {
        orch_deploystate::ArmOutcome::Armed => {}
        orch_deploystate::ArmOutcome::AlreadyArmed(existing) => return Ok(Some(existing)),
        orch_deploystate::ArmOutcome::Failed(e) => {
            anyhow::bail!("post-deploy watch: cannot re-arm after the takeover: {e}")
        }
    }
    let lost = format!(
        "the watch ran on node {from} until that node was gone; the polls it took there are lost with it (re-armed on node {})",
        run.node
    );
    ws.mark_lost(&lost);
    record_rearmed(run, seq, &revision, &from, &lost, confirmed.created_at).await?;
    Ok(Some(record))
}

async fn record_rearmed(
    run: &StageRun,
    seq: i64,
    revision: &str,
    from: &str,
    lost: &str,
    armed_at: i64,
) -> anyhow::Result<()> {
    record(
        run,
        seq,
        events::POST_DEPLOY_TAKEN_OVER,
        format!(
            "post-deploy watch of `{revision}` re-armed on node {} from the events: {lost}",
            run.node
        ),
        data([
            ("revision", json!(revision)),
            ("from", json!(from)),
            ("armed_at_ms", json!(armed_at)),
        ]),
    )
    .await
}

/// Writes the log (best effort), marks the watch done and records the verdict.
#[allow(clippy::too_many_arguments)]
async fn finish(
    run: &StageRun,
    ws: &WatchState,
    seq: i64,
    params: &WatchParams,
    armed_at_ms: i64,
    revision: &str,
    series: &[Poll],
    evidence_lost: Option<&str>,
    ending: Ending,
) -> anyhow::Result<StageEffect> {
    if ending.verdict == Verdict::Failed
        && let Err(e) = release_reaction(run, revision, &ending).await
    {
        // Before the log is written: the revert waits for the forge longer than one job may,
        // so this ending comes back as a new ending job after the pause (it decides the same
        // from the same polls and finds the rollback and the revert's progress on record),
        // having written nothing the lessons would read twice.
        return match e.downcast_ref::<crate::release::StepAside>() {
            Some(aside) => Ok(StageEffect::Requeue {
                delay_ms: aside.delay_s.saturating_mul(1000),
                marker: markers::monitor_end(seq),
                reason: format!("{aside}; the watch's ending (the revert) comes back then"),
            }),
            None => Err(e),
        };
    }
    let doc = render_post_deploy_log(&PostDeployLog {
        work_item: run.work_item.as_str(),
        created_at_ms: run.store.now_ms(),
        revision,
        params,
        armed_at_ms,
        series,
        verdict: ending.verdict,
        reason: &ending.reason,
        action: ending.action,
        action_detail: &ending.action_detail,
        evidence_lost,
    });
    // What the watched deploy shipped (deploy causality), under the series.
    let doc = format!("{doc}{}", crate::release::shipped_section(run).await);
    // The ticks left the worktree alone (`defers_worktree`); every path here prepared it
    // before acting (a no-op then), and the log is the first write into it.
    run.ensure_worktree().await?;
    let path = run.artifact_path(POST_DEPLOY_LOG);
    let written = run.write_document(POST_DEPLOY_LOG, &doc);
    if let Err(e) = &written {
        tracing::warn!(path = %path.display(), error = %e, "post-deploy log not written (best effort)");
    }
    let summary = format!(
        "{} action={} revision={revision}: {}",
        ending.verdict.as_str(),
        ending.action.as_str(),
        ending.reason
    );
    let verdict_counter = match ending.verdict {
        Verdict::Healthy => "healthy",
        Verdict::Degraded => "degraded",
        Verdict::Failed => "failed",
    };
    run.counters.incr("post_deploy_monitor", verdict_counter);
    match ending.action {
        ActionTaken::Rollback => run.counters.incr("post_deploy_monitor", "rollback"),
        ActionTaken::RollbackFailed => run.counters.incr("post_deploy_monitor", "rollback_failed"),
        ActionTaken::Alert | ActionTaken::None => {}
    }
    // The verdict is recorded before `done` is written: a crash between the two leaves the
    // watch not done, so the ending job runs again, decides the same from the same polls and
    // finds its verdict already recorded. The other order lost it: a re-run found the watch
    // done and advanced the stage with neither the verdict nor the log.
    if !verdict_recorded(run, seq).await? {
        super::record_payload(
            run,
            seq,
            events::POST_DEPLOY_VERDICT,
            format!(
                "post-deploy watch {}: {} (action {})",
                ending.verdict.as_str(),
                ending.reason,
                ending.action.as_str()
            ),
            &orch_domain::payload::WatchVerdict {
                verdict: ending.verdict,
                action: ending.action,
                revision: revision.to_owned(),
                log_written: written.is_ok(),
                evidence_lost: evidence_lost.map(str::to_owned),
                seq: Some(seq),
            },
        )
        .await?;
    }
    crate::failpoint::hit("monitor.before_done");
    if !ws.mark_done(&summary) {
        tracing::warn!(work_item = %run.work_item, "post-deploy watch: `done` not written; a later job repeats the ending, not the reaction");
    }
    Ok(StageEffect::Produced { outcome: None })
}

/// Whether this watch (visit `seq`, since an operator's retry or another node's takeover
/// re-armed it, if one did) has recorded its verdict already: the ending of a job cut short
/// after the record runs again. A re-armed watch decides anew and records its own verdict.
async fn verdict_recorded(run: &StageRun, seq: i64) -> anyhow::Result<bool> {
    let history = run.store.task_events(run.task.id).await?;
    let since = history
        .iter()
        .rposition(|e| {
            matches!(
                e.kind.as_str(),
                events::TASK_RETRIED | events::POST_DEPLOY_REARMED | events::POST_DEPLOY_TAKEN_OVER
            )
        })
        .map_or(0, |i| i + 1);
    Ok(
        super::of_visit(&history[since..], seq, events::POST_DEPLOY_VERDICT)
            .next()
            .is_some(),
    )
}

/// The release train's part of a FAILED watch (before `done` is written, so a re-run after a
/// crash completes it; each step is idempotent): a verified rollback is recorded and the change
/// reverted on the default branch (`on_failure = "revert"`), or the repo is held — also when
/// production could not be rolled back, since then nobody should ship on top of it.
async fn release_reaction(run: &StageRun, revision: &str, ending: &Ending) -> anyhow::Result<()> {
    use crate::release::{self, Reverted};
    let history = run.store.task_events(run.task.id).await?;
    let already_held = release::open_hold(&history).is_some();
    if already_held
        && let Some(e) = history
            .iter()
            .rev()
            .find(|e| e.kind == events::RELEASE_HELD)
    {
        // A re-run after a crash: the hold's announcement may be what was cut short (each of
        // its deliveries happens once however often this runs).
        let reason = super::event_str(e, "reason").unwrap_or_default();
        release::announce_hold(run, e.id, e.created_at, &reason).await?;
    }
    let rolled_back_recorded = history
        .iter()
        .any(|e| e.kind == events::RELEASE_ROLLED_BACK);
    let held = |reason: String| async move {
        if already_held {
            Ok(())
        } else {
            release::hold(run, &reason).await
        }
    };
    if ending.action != ActionTaken::Rollback {
        return held(format!(
            "{}'s watch ended FAILED and production was not rolled back ({})",
            run.work_item, ending.action_detail
        ))
        .await;
    }
    if !rolled_back_recorded {
        // Where production went back to: as verified after the rollback, else as recorded.
        let mut live = match &ending.live {
            Some(l) => Some(l.clone()),
            None => release::previous_of_deploy(run).await,
        };
        if live.is_none()
            && let Some(url) = &run.repo.revision_url
        {
            // A release orch did not deploy: the service says which one runs now.
            let timeout = Duration::from_secs(run.repo.post_deploy.poll_timeout_s.max(1));
            live = live_revision(url, timeout).await;
        }
        release::record_rolled_back(run, revision, live.as_deref()).await?;
    }
    match run.repo.on_failure {
        orch_domain::config::OnFailure::Hold => {
            held(format!(
                "on_failure = \"hold\": {}'s rolled-back change stays on `{}`",
                run.work_item, run.repo.default_branch
            ))
            .await
        }
        orch_domain::config::OnFailure::Revert => {
            match release::revert(run, &ending.reason, release::Step::Aside).await {
                Ok(Reverted::Reverted { .. }) => Ok(()),
                // GitHub has not answered for as long as one job waits: the ending comes back
                // (`finish`), never a hold for an outage.
                Err(e) if e.is::<release::StepAside>() => Err(e),
                // A verdict: the revert conflicts or fails the repo's tests.
                Ok(Reverted::Held { reason }) => held(reason).await,
                // No verdict (git or the tests could not run, the run is stopping): the job runs
                // again, and only the last attempt holds the repo — a hold waits for an operator.
                Err(e) if run.cancel.is_cancelled() || run.job.attempt < run.job.max_attempts => {
                    Err(e.context(format!(
                        "the revert of {} did not finish (attempt {} of {})",
                        run.work_item, run.job.attempt, run.job.max_attempts
                    )))
                }
                Err(e) => {
                    held(format!(
                        "the revert of {} failed in all {} attempts: {e:#}",
                        run.work_item, run.job.max_attempts
                    ))
                    .await
                }
            }
        }
    }
}

/// This visit's jobs of this run's kind whose content contains `marker`.
/// The tick number this job's own `monitor-tick` marker of visit `seq` carries.
fn own_tick(run: &StageRun, seq: i64) -> Option<u32> {
    markers::parse(&run.job.task_content)
        .into_iter()
        .find(|m| m.name == markers::MONITOR_TICK && m.seq == seq)
        .and_then(|m| m.n)
}

async fn count(run: &StageRun, marker: &str) -> anyhow::Result<u32> {
    let n = run
        .store
        .count_jobs(&JobCount {
            task_id: run.task.id,
            agent: run.job.agent.clone(),
            content_contains: Some(marker.to_owned()),
        })
        .await?;
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// One armed-but-not-done watch, for `GET /queue` ("active observations", design.md §7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveWatchInfo {
    /// The repo.
    pub repo: String,
    /// The work item.
    pub work_item_id: String,
    /// The watched revision, when `armed` is readable.
    pub revision: Option<String>,
    /// When the watch was armed (epoch ms), when readable.
    pub armed_at_ms: Option<i64>,
    /// Its deadline (epoch ms), when readable.
    pub deadline_ms: Option<i64>,
    /// Polls recorded so far.
    pub polls: usize,
    /// The polls the window plans, when readable.
    pub planned_polls: Option<u32>,
    /// What is wrong with its state, if anything (corrupt `armed`, lost evidence).
    pub problem: Option<String>,
}

/// Every active watch in `repos_dir` (armed, not done), sorted by repo and work item.
pub fn active_watches(repos_dir: &Path) -> Vec<ActiveWatchInfo> {
    list_active(repos_dir)
        .into_iter()
        .map(|w| {
            let series = WatchState::new(repos_dir, &w.repo, &w.work_item_id).series();
            let (record, problem) = match w.armed {
                ArmedRead::Present(r) => (Some(r), series.lost),
                ArmedRead::Corrupt(why) => (None, Some(format!("armed unusable: {why}"))),
                ArmedRead::Absent => (None, Some("armed vanished while listing".to_owned())),
            };
            ActiveWatchInfo {
                repo: w.repo,
                work_item_id: w.work_item_id,
                revision: record.as_ref().map(|r| r.revision.clone()),
                armed_at_ms: record.as_ref().map(|r| r.armed_at_ms),
                deadline_ms: record.as_ref().map(|r| r.deadline_ms),
                polls: series.polls.len(),
                planned_polls: record.as_ref().map(|r| planned_polls(&r.params)),
                problem,
            }
        })
        .collect()
}

/// What the recovery sweep did about one active watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryAction {
    /// A tick job was enqueued (or an identical one already existed: `duplicate`).
    Enqueued {
        /// The job.
        job_id: i64,
        /// The dedupe key matched an existing job.
        duplicate: bool,
    },
    /// A live monitor job of the current visit exists: nothing to do.
    AlreadyQueued {
        /// That job.
        job_id: i64,
    },
    /// The task is not in `observe` (it moved on, or never got there): left alone.
    NotObserving {
        /// Where the task is.
        stage: String,
    },
    /// No task of this repo has the work item id: the watch was ended.
    NoTask,
    /// The store failed; the next sweep tries again.
    Failed(String),
}

/// The recovery sweep (design.md §7: a stale `armed` without `done` after a crash is completed by
/// a restored job): for every active watch in this node's `repos_dir` whose task is at stage
/// `observe` with no live `post-deploy-monitor` job of the current visit, enqueue one tick,
/// pinned to `node` (the sentinel files are local), with dedupe key
/// `monitor-recover:<task>:<seq>:<n>` so concurrent sweeps enqueue it once. Idempotent.
pub async fn recover_watches(
    store: &Store,
    repos_dir: &Path,
    node: &str,
) -> Vec<(String, RecoveryAction)> {
    let mut out = Vec::new();
    for w in list_active(repos_dir) {
        let action = match recover_one(store, repos_dir, &w.repo, &w.work_item_id, node).await {
            Ok(action) => action,
            Err(e) => {
                tracing::warn!(work_item = %w.work_item_id, error = %e, "post-deploy recovery sweep failed for one watch");
                RecoveryAction::Failed(format!("{e:#}"))
            }
        };
        out.push((w.work_item_id, action));
    }
    out
}

async fn recover_one(
    store: &Store,
    repos_dir: &Path,
    repo: &str,
    work_item_id: &str,
    node: &str,
) -> anyhow::Result<RecoveryAction> {
    let task = store
        .get_task_by_work_item(work_item_id)
        .await?
        .filter(|t| t.repo == repo);
    let Some(task) = task else {
        // No task will ever tick it (deleted, or a watch left by another database): it ends
        // here, said in the log, so it neither stays listed as active nor is swept forever.
        tracing::warn!(
            work_item = work_item_id,
            repo,
            "an armed watch has no task of this repo: ended"
        );
        crate::release::end_watch(
            repos_dir,
            repo,
            work_item_id,
            &format!("no task {work_item_id} of repo {repo} exists: nothing can finish this watch"),
        );
        return Ok(RecoveryAction::NoTask);
    };
    if task.is_terminal() {
        // Cancelled or failed while watched (maybe by a process on another node): the watch
        // ends with the task, so it neither stays armed nor blocks anything.
        crate::release::end_watch(
            repos_dir,
            repo,
            work_item_id,
            &format!("the task ended ({}) while its watch was armed", task.stage),
        );
        return Ok(RecoveryAction::NotObserving {
            stage: task.stage.to_string(),
        });
    }
    if task.stage != "observe" {
        return Ok(RecoveryAction::NotObserving {
            stage: task.stage.to_string(),
        });
    }
    let seq = task.stage_seq;
    let live = store.task_jobs(task.id).await?.into_iter().find(|j| {
        j.agent == MONITOR_AGENT
            && j.state.is_live()
            && StageJob::from_content(&j.task_content).is_ok_and(|p| p.seq == seq)
    });
    if let Some(job) = live {
        return Ok(RecoveryAction::AlreadyQueued { job_id: job.id });
    }
    let ticks = store
        .count_jobs(&JobCount {
            task_id: task.id,
            agent: MONITOR_AGENT.to_owned(),
            content_contains: Some(markers::monitor_tick_prefix(seq)),
        })
        .await?;
    let n = u32::try_from(ticks).unwrap_or(u32::MAX).saturating_add(1);
    let payload = StageJob {
        stage: task.stage.to_string(),
        seq,
    };
    let enqueued = store
        .enqueue(
            NewJob::new(
                MONITOR_AGENT,
                payload.with_marker(&markers::monitor_tick(seq, n)),
            )
            .task(task.id)
            .dedupe(format!("monitor-recover:{}:{seq}:{n}", task.id))
            .node(node),
        )
        .await?;
    if !enqueued.duplicate {
        let event = NewEvent::new(
            events::POST_DEPLOY_RECOVERED,
            format!(
                "stranded post-deploy watch: re-enqueued tick job {} on node {node}",
                enqueued.job_id
            ),
        )
        .task(task.id)
        .job(enqueued.job_id)
        .stage(task.stage.as_str())
        .data(json!({"seq": seq, "tick": n, "node": node}).to_string());
        store.append_event(event).await?;
    }
    Ok(RecoveryAction::Enqueued {
        job_id: enqueued.job_id,
        duplicate: enqueued.duplicate,
    })
}
