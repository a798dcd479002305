//! The `deploy` stage (design.md §6): run the repo's deploy command for the merged revision, then
//! the **finalizer** confirms it (health reachable, revision live) with a bounded,
//! restart-safe count of defers, and arms the post-deploy watch (design.md §7).
//!
//! Restart safety (design.md §6 self-deploy, §11): the `INITIATED` marker (holding the revision) is
//! on disk before the command starts, and the command's `result` after it ends. A job that
//! finds `INITIATED` — because orch restarted itself during a self-deploy, crashed, or this is
//! a finalizer defer — never deploys again: it confirms. A confirmed or failed visit is
//! recorded as an event (`deploy.confirmed` / `deploy.failed` / `deploy.unconfirmed` with the
//! visit's `seq`) before the markers are cleared, so a re-run after that replays the outcome.
//!
//! A deploy that fails (non-zero exit, timeout, a signal, cannot start) or is never confirmed
//! is not just recorded: production is settled first ([`super::recover`]: looked at, rolled
//! back when that is the remedy, verified, or an operator alerted), then the change is
//! reverted on the default branch and the visit fails with what happened to production.
//!
//! Choices: without a deploy command there is nothing orch deploys. If `health_url` is set the
//! revision is taken as deployed outside orch and confirmed and watched like any other; without
//! it the stage passes with a `deploy.skipped` event and no watch is armed (nothing to poll).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use orch_deploystate::{
    ArmOutcome, ArmedRecord, DeployResult, DeployState, MARKER_INITIATED, WatchState,
};
use orch_domain::control::markers;
use orch_domain::gate::GateOutcome;
use orch_domain::payload::{self, DeploySkipped, SkipThen};
use orch_domain::recovery::Trouble;
use orch_exec::process::ExitKind;
use orch_store::JobCount;
use serde_json::json;

use super::probe::{check_health, live_revision, revision_matches};
use super::{
    OUTPUT_TAIL_LINES, data, event_seq, events, record, record_payload, run_repo_command,
    watch_params,
};
use crate::engine::{StageEffect, StageExecutor, StageRun};

/// The default bound on finalizer defers per deploy visit.
pub const DEFAULT_FINALIZE_LIMIT: u32 = 5;
/// The default delay between finalizer checks, seconds.
pub const DEFAULT_FINALIZE_DELAY_S: u64 = 5;

/// The `deploy` stage's executor (agent `deployer`).
#[derive(Debug, Clone)]
pub struct DeployerExecutor {
    /// Defers allowed before an unconfirmed deploy fails the task (default 5): the finalizer
    /// checks at most `finalize_limit + 1` times per visit.
    pub finalize_limit: u32,
    /// Seconds between finalizer checks (default 5).
    pub finalize_delay_s: u64,
    /// Health polls verifying the rollback of a failed or unconfirmed deploy (default 3).
    pub verify_polls: u32,
    /// Time before each verification poll (default 5 s).
    pub verify_interval: Duration,
}

impl Default for DeployerExecutor {
    fn default() -> Self {
        DeployerExecutor {
            finalize_limit: DEFAULT_FINALIZE_LIMIT,
            finalize_delay_s: DEFAULT_FINALIZE_DELAY_S,
            verify_polls: 3,
            verify_interval: Duration::from_secs(5),
        }
    }
}

/// The value a confirmed deploy passes to the pipeline (deploy has no artifact; any pass
/// moves on to `observe`).
pub const CONFIRMED: &str = "CONFIRMED";

#[async_trait::async_trait]
impl StageExecutor for DeployerExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let seq = super::visit_seq(run);
        run.counters.incr("deployer", "runs");
        if let Some(effect) = replay(run, seq).await? {
            return Ok(effect);
        }
        let state = DeployState::new(
            &run.repos_dir,
            run.repo_name.as_str(),
            run.work_item.as_str(),
        );
        if state.has_marker(MARKER_INITIATED) {
            clear_stale_markers(run, &state, seq).await?;
        }
        if !state.has_marker(MARKER_INITIATED) {
            restore_markers(run, &state, seq).await?;
        }
        if state.has_marker(MARKER_INITIATED) {
            // This job's deploy command was started by an orch that stopped while it ran, and
            // it runs (or ended) under its supervisor: wait for it and take its result, as the
            // stopped orch would have.
            if state.read_result().is_none()
                && let Some(command) = run.repo.deploy.clone()
                && let Some(revision) = initiated_revision(&state)
                && orch_exec::supervise::job_has_records(run.job.id)
            {
                return self
                    .run_and_finalize(run, &state, seq, &command, &revision)
                    .await;
            }
            if state.read_result().is_none()
                && run.repo.deploy.is_some()
                && let Some(revision) = initiated_revision(&state)
                && !live_now(run, &revision).await
                && !finalizing_began(run, seq).await?
            {
                // The command never ended: orch stopped while it ran (and a restarted orch stops
                // what its dead incarnation left running). The revision is not live, so the
                // deploy did not happen: run it once more (at most once per visit, so a deploy
                // that itself restarts orch cannot loop; never once the finalizer judged it,
                // since a rollback it started makes the revision not live on purpose).
                record(
                    run,
                    seq,
                    events::DEPLOY_REDEPLOYED,
                    format!("the deploy of `{revision}` was interrupted before it ended and `{revision}` is not live: running it once more"),
                    data([("revision", json!(revision))]),
                )
                .await?;
                return self.deploy(run, &state, seq).await;
            }
            tracing::info!(work_item = %run.work_item, "deploy: INITIATED found; finalizing instead of deploying again");
            return self.finalize(run, &state, seq).await;
        }
        self.deploy(run, &state, seq).await
    }
}

/// What a `deploy.skipped` said the stage goes on with.
fn skipped_then(e: &orch_store::Event) -> Option<SkipThen> {
    payload::read::<DeploySkipped>(&e.data).map(|d| d.outcome)
}

/// Whether `e` says a visit's deploy got past writing its markers: `deploy.started`, or a
/// confirming `deploy.skipped` (no command, the revision taken as deployed).
fn began(e: &orch_store::Event) -> bool {
    e.kind == events::DEPLOY_STARTED
        || (e.kind == events::DEPLOY_SKIPPED && skipped_then(e) == Some(SkipThen::Confirm))
}

/// `INITIATED` is on this node's disk, but the events say no deploy of this visit began (the
/// command runs only after `deploy.started` is recorded) while another visit's did: the markers
/// are that visit's, left here when this node went away and another node took the visit over
/// (design.md §10), and this visit is a later one (a retry). They are cleared, so this visit
/// deploys its own revision instead of finalizing another's (`deploy.stale_markers_cleared`).
async fn clear_stale_markers(run: &StageRun, state: &DeployState, seq: i64) -> anyhow::Result<()> {
    let history = run.store.task_events(run.task.id).await?;
    let here = history
        .iter()
        .any(|e| began(e) && event_seq(e) == Some(seq));
    let elsewhere = history
        .iter()
        .rev()
        .find(|e| began(e) && event_seq(e).is_some_and(|s| s != seq));
    let (false, Some(other)) = (here, elsewhere) else {
        return Ok(());
    };
    let stale = initiated_revision(state).unwrap_or_else(|| "unknown".to_owned());
    if !state.clear_state() {
        bail!(
            "deploy: cannot clear the stale markers (of `{stale}`, visit {:?}) of {}",
            event_seq(other),
            run.work_item
        );
    }
    record(
        run,
        seq,
        events::DEPLOY_STALE_MARKERS_CLEARED,
        format!(
            "the deploy markers on node {} (of `{stale}`) belong to visit {} of this item, not to this one: cleared",
            run.node,
            event_seq(other).unwrap_or_default()
        ),
        data([("revision", json!(stale)), ("node", json!(run.node))]),
    )
    .await?;
    Ok(())
}

/// The markers of this visit are not on this node's disk, but the events say the deploy got
/// past writing them: the visit began on a node that is gone and this node took it over
/// (design.md §10), or the disk lost them. Rebuilds them from the events, so the ordinary
/// rules apply and the deploy is never applied twice: `deploy.started` (the command was
/// about to run) restores `INITIATED` with its revision; a `deploy.deferred` or a confirming
/// `deploy.skipped` of the visit (the command had ended well, the finalizer was waiting)
/// restores a successful `result` too. Without such an event the deploy never began here or
/// anywhere, and it runs as usual.
async fn restore_markers(run: &StageRun, state: &DeployState, seq: i64) -> anyhow::Result<()> {
    let history = run.store.task_events(run.task.id).await?;
    let mine: Vec<_> = history
        .iter()
        .filter(|e| event_seq(e) == Some(seq))
        .collect();
    let started = mine.iter().rev().find(|e| began(e));
    let Some(started) = started else {
        return Ok(());
    };
    let Some(revision) = super::event_str(started, "revision") else {
        bail!(
            "deploy: event {} ({}) of this visit names no revision; cannot rebuild the deploy's markers",
            started.id,
            started.kind
        );
    };
    let ended_well = started.kind == events::DEPLOY_SKIPPED
        || mine.iter().any(|e| e.kind == events::DEPLOY_DEFERRED);
    if !state.write_marker(MARKER_INITIATED, &revision) {
        bail!(
            "deploy: cannot rebuild the {MARKER_INITIATED} marker for {} (refusing to go on: the deploy could run twice)",
            run.work_item
        );
    }
    if ended_well
        && !state.write_result(&DeployResult {
            success: true,
            revision: Some(revision.clone()),
            finished_at_ms: started.created_at,
            detail: "rebuilt from the events: the deploy command had ended well".to_owned(),
        })
    {
        tracing::warn!(work_item = %run.work_item, "deploy: cannot rebuild the result marker; the finalizer confirms by health and revision");
    }
    let what = if ended_well {
        "its command had ended well"
    } else {
        "its command's end was not recorded"
    };
    record(
        run,
        seq,
        events::DEPLOY_MARKERS_RESTORED,
        format!(
            "the deploy of `{revision}` began elsewhere ({}, event {}) and its markers are not on node {}: rebuilt from the events ({what})",
            started.kind, started.id, run.node
        ),
        data([
            ("revision", json!(revision)),
            ("ended_well", json!(ended_well)),
            ("node", json!(run.node)),
        ]),
    )
    .await?;
    Ok(())
}

/// True when the service says `revision` is live (`revision_url`). Health is not asked: a
/// revision that went live and is unhealthy was deployed (the finalizer and the watch judge it);
/// deploying it again would apply the deploy twice. Unknown (no `revision_url`, no answer) is
/// false.
async fn live_now(run: &StageRun, revision: &str) -> bool {
    let Some(url) = &run.repo.revision_url else {
        return false;
    };
    let timeout = Duration::from_secs(run.repo.post_deploy.poll_timeout_s.max(1));
    live_revision(url, timeout)
        .await
        .is_some_and(|live| revision_matches(revision, &live))
}

/// Whether this visit already ran its deploy command a second time, or the finalizer already
/// judged the deploy (deferred it, or began rolling it back): from then on a revision that is
/// not live is the finalizer's business, never a reason to deploy again.
async fn finalizing_began(run: &StageRun, seq: i64) -> anyhow::Result<bool> {
    Ok(run.store.task_events(run.task.id).await?.iter().any(|e| {
        event_seq(e) == Some(seq)
            && matches!(
                e.kind.as_str(),
                events::DEPLOY_REDEPLOYED
                    | events::DEPLOY_DEFERRED
                    | events::DEPLOY_ROLLBACK_STARTED
                    | events::DEPLOY_ROLLED_BACK
                    | events::DEPLOY_ROLLBACK_FAILED
            )
    }))
}

/// The outcome of a visit already recorded (a re-run after the markers were cleared).
async fn replay(run: &StageRun, seq: i64) -> anyhow::Result<Option<StageEffect>> {
    let events = run.store.task_events(run.task.id).await?;
    let recorded = events
        .iter()
        .rev()
        .filter(|e| event_seq(e) == Some(seq))
        .find(|e| {
            matches!(
                e.kind.as_str(),
                events::DEPLOY_CONFIRMED | events::DEPLOY_FAILED | events::DEPLOY_UNCONFIRMED
            ) || (e.kind == events::DEPLOY_SKIPPED && skipped_then(e) == Some(SkipThen::Pass))
        });
    let Some(e) = recorded else {
        return Ok(None);
    };
    tracing::info!(work_item = %run.work_item, kind = %e.kind, "deploy: outcome already recorded for this visit; replaying it");
    // The deploy record (`release.deployed`) is written after the outcome: an attempt that
    // died or lost its lease in between left it out, and the re-run writes it now.
    let deployed = events
        .iter()
        .any(|d| d.kind == events::RELEASE_DEPLOYED && event_seq(d) == Some(seq));
    if !deployed
        && e.kind != events::DEPLOY_SKIPPED
        && let Some(revision) = super::event_str(e, "revision")
    {
        crate::release::record_deployed(run, seq, &revision, e.kind == events::DEPLOY_CONFIRMED)
            .await?;
    }
    let outcome = match e.kind.as_str() {
        events::DEPLOY_CONFIRMED | events::DEPLOY_SKIPPED => {
            GateOutcome::pass(CONFIRMED.to_owned(), e.message.clone())
        }
        _ => GateOutcome::not_success(e.message.clone()),
    };
    Ok(Some(StageEffect::Produced {
        outcome: Some(outcome),
    }))
}

/// The revision to go back to when the service runs `observed` before visit `seq`'s deploy.
/// When `observed` is a revision an earlier visit of this same item deployed (a deploy cut
/// short by a crash or a takeover, after which the item was merged and staged again), it is
/// not a release to return to — it is this change's own earlier build — so the answer is what
/// ran before *that* deploy, followed back through the item's visits. `None` when that is
/// unknown (the caller then falls back to the release record).
fn before_own_deploys(
    history: &[orch_store::Event],
    seq: i64,
    observed: Option<String>,
) -> Option<String> {
    let mut previous = observed?;
    // Each step goes to a strictly earlier visit, so the walk ends; the bound is a guard.
    let mut before = seq;
    for _ in 0..history.len() {
        let own = history.iter().rev().find(|e| {
            e.kind == events::DEPLOY_STARTED
                && event_seq(e).is_some_and(|s| s < before)
                && super::event_str(e, "revision").is_some_and(|r| revision_matches(&r, &previous))
        });
        let Some(own) = own else {
            return Some(previous);
        };
        before = event_seq(own).unwrap_or(0);
        previous = super::event_str(own, "previous")?;
    }
    Some(previous)
}

fn produced(outcome: GateOutcome) -> StageEffect {
    StageEffect::Produced {
        outcome: Some(outcome),
    }
}

impl DeployerExecutor {
    /// First run of the visit: mark `INITIATED`, run the deploy command, record its result,
    /// then finalize in the same job.
    async fn deploy(
        &self,
        run: &StageRun,
        state: &DeployState,
        seq: i64,
    ) -> anyhow::Result<StageEffect> {
        let branch = &run.repo.default_branch;
        // The release train promoted exactly the staged commit: that is what ships.
        let promoted = crate::release::promoted(run).await?.map(|(_, new)| new);
        let revision = match promoted {
            Some(rev) => Some(rev),
            None => run
                .git
                .rev_parse(&run.repo_dir, branch)
                .await
                .with_context(|| {
                    format!(
                        "deploy: cannot resolve the merged revision `{branch}` in {}",
                        run.repo_dir.display()
                    )
                })?,
        };
        let revision = revision.ok_or_else(|| {
            anyhow!(
                "deploy: branch `{branch}` has no commit in {}",
                run.repo_dir.display()
            )
        })?;

        let Some(command) = run.repo.deploy.clone() else {
            if run.repo.health_url.is_none() {
                let msg = format!(
                    "no deploy command and no health_url configured for repo `{}`: nothing to deploy, nothing to watch",
                    run.repo_name
                );
                record_payload(
                    run,
                    seq,
                    events::DEPLOY_SKIPPED,
                    &msg,
                    &DeploySkipped {
                        revision: revision.to_string(),
                        outcome: SkipThen::Pass,
                        seq: None,
                    },
                )
                .await?;
                return Ok(produced(GateOutcome::pass(CONFIRMED.to_owned(), msg)));
            }
            let msg = format!(
                "no deploy command configured for repo `{}`: `{revision}` is taken as deployed outside orch; confirming and watching it at health_url",
                run.repo_name
            );
            record_payload(
                run,
                seq,
                events::DEPLOY_SKIPPED,
                &msg,
                &DeploySkipped {
                    revision: revision.to_string(),
                    outcome: SkipThen::Confirm,
                    seq: None,
                },
            )
            .await?;
            if !state.write_marker(MARKER_INITIATED, &revision) {
                bail!(
                    "deploy: cannot write the {MARKER_INITIATED} marker for {}",
                    run.work_item
                );
            }
            state.write_result(&DeployResult {
                success: true,
                revision: Some(revision.clone()),
                finished_at_ms: run.store.now_ms(),
                detail: "no deploy command".to_owned(),
            });
            return self.finalize(run, state, seq).await;
        };

        // What production runs before the deploy, as the service says: the deploy history's
        // true previous revision (and what a rollback goes back to).
        let previous = match &run.repo.revision_url {
            Some(url) => {
                let timeout = Duration::from_secs(run.repo.post_deploy.poll_timeout_s.max(1));
                let observed = live_revision(url, timeout)
                    .await
                    .filter(|live| !revision_matches(&revision, live));
                let history = run.store.task_events(run.task.id).await?;
                before_own_deploys(&history, seq, observed)
            }
            None => None,
        };
        // The marker goes first: without it a crash during the command would deploy twice.
        if !state.write_marker(MARKER_INITIATED, &revision) {
            bail!(
                "deploy: cannot write the {MARKER_INITIATED} marker under {}: refusing to deploy without it (a crash would deploy twice)",
                state
                    .dir()
                    .map_or_else(|| "(refused path)".to_owned(), |d| d.display().to_string())
            );
        }
        record(
            run,
            seq,
            events::DEPLOY_STARTED,
            format!("deploying `{revision}` with `{command}`"),
            data([
                ("revision", json!(revision)),
                ("command", json!(command)),
                ("previous", json!(previous)),
            ]),
        )
        .await?;
        crate::failpoint::hit("deploy.after_initiated");
        self.run_and_finalize(run, state, seq, &command, &revision)
            .await
    }

    /// Runs the deploy command (or adopts it from an earlier orch), records its result, then
    /// finalizes in the same job.
    async fn run_and_finalize(
        &self,
        run: &StageRun,
        state: &DeployState,
        seq: i64,
        command: &str,
        revision: &str,
    ) -> anyhow::Result<StageEffect> {
        let result = run_repo_command(run, "deploy", command, revision, &[]).await;
        crate::failpoint::hit("deploy.after_command");
        let (success, detail) = match &result {
            Ok(out) if out.status == ExitKind::Cancelled => {
                // No result: the next run finds INITIATED and confirms what is live.
                bail!(
                    "deploy: cancelled while `{command}` ran (lease lost or shutdown); the finalizer will confirm it"
                );
            }
            Ok(out) if out.success() => (true, out.tail_text(OUTPUT_TAIL_LINES)),
            Ok(out) => (
                false,
                format!(
                    "deploy command `{command}` ended with {} after {:.1}s:\n{}",
                    out.status,
                    out.duration.as_secs_f64(),
                    out.tail_text(OUTPUT_TAIL_LINES)
                ),
            ),
            Err(e) => (
                false,
                format!("deploy command `{command}` could not start: {e}"),
            ),
        };
        if !state.write_result(&DeployResult {
            success,
            revision: Some(revision.to_owned()),
            finished_at_ms: run.store.now_ms(),
            detail: detail.clone(),
        }) {
            tracing::warn!(work_item = %run.work_item, "deploy: cannot write the result marker; continuing in this job");
        }
        if !success {
            return self
                .give_up(run, state, seq, Trouble::DeployFailed, detail, revision)
                .await;
        }
        self.finalize(run, state, seq).await
    }

    /// Confirms a deploy whose `INITIATED` marker is on disk.
    async fn finalize(
        &self,
        run: &StageRun,
        state: &DeployState,
        seq: i64,
    ) -> anyhow::Result<StageEffect> {
        let result = state.read_result();
        let revision = match initiated_revision(state)
            .or_else(|| result.as_ref().and_then(|r| r.revision.clone()))
        {
            Some(rev) => rev,
            None => run
                .git
                .rev_parse(&run.repo_dir, &run.repo.default_branch)
                .await
                .context("deploy finalizer: cannot resolve the merged revision")?
                .ok_or_else(|| {
                    anyhow!(
                        "deploy finalizer: no revision in the markers and none on `{}`",
                        run.repo.default_branch
                    )
                })?,
        };
        if let Some(r) = result.as_ref().filter(|r| !r.success) {
            return self
                .give_up(
                    run,
                    state,
                    seq,
                    Trouble::DeployFailed,
                    r.detail.clone(),
                    &revision,
                )
                .await;
        }

        let timeout = std::time::Duration::from_secs(run.repo.post_deploy.poll_timeout_s.max(1));
        let mut problems = Vec::new();
        let mut observed = Vec::new();
        match &run.repo.health_url {
            None if result.is_none() => problems.push(
                "the deploy was interrupted before its result was recorded, and there is no health_url to confirm it by"
                    .to_owned(),
            ),
            None => observed.push("no health_url: confirmed by the deploy command's exit".to_owned()),
            Some(url) => {
                let check = check_health(url, timeout).await;
                if check.outcome == orch_domain::monitor::CheckOutcome::Pass {
                    observed.push(format!("health {}", check.detail));
                } else {
                    problems.push(format!("health {}: {}", check.outcome.as_str(), check.detail));
                }
            }
        }
        if problems.is_empty()
            && let Some(url) = &run.repo.revision_url
        {
            match live_revision(url, timeout).await {
                Some(live) if revision_matches(&revision, &live) => {
                    observed.push(format!("revision `{live}` live"));
                }
                Some(live) => problems.push(format!("live revision is `{live}`, not `{revision}`")),
                None => problems.push(format!("the live revision cannot be read at {url}")),
            }
        }

        if problems.is_empty() {
            return self
                .confirm(run, state, seq, &revision, &observed.join("; "))
                .await;
        }
        let problem = problems.join("; ");
        let prefix = markers::deploy_finalize_prefix(seq);
        let defers = run
            .store
            .count_jobs(&JobCount {
                task_id: run.task.id,
                agent: run.job.agent.clone(),
                content_contains: Some(prefix),
            })
            .await?;
        let defers = u32::try_from(defers).unwrap_or(u32::MAX);
        if defers < self.finalize_limit {
            let n = defers + 1;
            let reason = format!(
                "deploy of `{revision}` not confirmed yet ({problem}); check {} of {} in {}s",
                n + 1,
                self.finalize_limit + 1,
                self.finalize_delay_s
            );
            run.counters.incr("deployer", "deferred");
            record(
                run,
                seq,
                events::DEPLOY_DEFERRED,
                &reason,
                data([("revision", json!(revision)), ("defer", json!(n))]),
            )
            .await?;
            return Ok(StageEffect::Requeue {
                delay_ms: self.finalize_delay_s.saturating_mul(1000),
                marker: markers::deploy_finalize(seq, n),
                reason,
            });
        }
        let reason = format!(
            "deploy of `{revision}` not confirmed after {} checks: {problem}",
            defers.saturating_add(1)
        );
        self.give_up(
            run,
            state,
            seq,
            Trouble::DeployUnconfirmed,
            reason,
            &revision,
        )
        .await
    }

    /// A deploy that failed or was never confirmed: production is settled first (looked at,
    /// rolled back when that is the remedy, verified, or an operator alerted:
    /// [`super::recover`]), then the visit fails with what happened.
    async fn give_up(
        &self,
        run: &StageRun,
        state: &DeployState,
        seq: i64,
        trouble: Trouble,
        detail: String,
        revision: &str,
    ) -> anyhow::Result<StageEffect> {
        let (kind, verdict) = match trouble {
            Trouble::DeployUnconfirmed => (events::DEPLOY_UNCONFIRMED, "UNCONFIRMED"),
            _ => (events::DEPLOY_FAILED, "DEPLOY_FAILED"),
        };
        let previous = crate::release::previous_live(run, seq).await;
        let what = orch_domain::text::one_line_max(&detail, 300);
        let settlement = super::recover::settle(
            run,
            seq,
            &super::recover::DEPLOY,
            &super::recover::Verify {
                polls: self.verify_polls,
                interval: self.verify_interval,
            },
            super::recover::Case {
                trouble,
                revision,
                previous,
                what: what.clone(),
                tried: vec![what],
                verdict,
                alert_if_settled: false,
            },
        )
        .await?;
        if settlement.rolled == orch_domain::payload::Rolled::Verified {
            crate::release::record_rolled_back(run, revision, settlement.settled.as_deref())
                .await?;
        }
        let reason = format!("{detail}; {}", settlement.summary);
        fail(run, state, seq, kind, reason, revision).await
    }

    /// The deploy is live: arm the watch, record the confirmation, clear the markers, pass.
    async fn confirm(
        &self,
        run: &StageRun,
        state: &DeployState,
        seq: i64,
        revision: &str,
        observed: &str,
    ) -> anyhow::Result<StageEffect> {
        let armed = if run.repo.health_url.is_some() {
            arm(run, revision)?;
            true
        } else {
            false
        };
        let message = format!(
            "deploy of `{revision}` confirmed ({observed}); {}",
            if armed {
                "post-deploy watch armed"
            } else {
                "no health_url: no watch armed"
            }
        );
        super::record_payload(
            run,
            seq,
            events::DEPLOY_CONFIRMED,
            &message,
            &orch_domain::payload::DeployConfirmed {
                revision: revision.to_owned(),
                armed,
                seq: None,
            },
        )
        .await?;
        run.counters.incr("deployer", "confirmed");
        crate::failpoint::hit("deploy.before_record_deployed");
        crate::release::record_deployed(run, seq, revision, true).await?;
        if !state.clear_state() {
            tracing::warn!(work_item = %run.work_item, "deploy: confirmed, but the markers could not be cleared (the recorded event keeps re-runs from deploying)");
        }
        Ok(produced(GateOutcome::pass(CONFIRMED.to_owned(), message)))
    }
}

/// Arms the watch for `revision` (idempotent). A finished watch, or one for another revision,
/// is from an earlier deploy and is replaced. Other work items' active watches of this repo
/// are marked superseded: their revision is no longer live.
fn arm(run: &StageRun, revision: &str) -> anyhow::Result<()> {
    let ws = WatchState::new(
        &run.repos_dir,
        run.repo_name.as_str(),
        run.work_item.as_str(),
    );
    if ws.is_done() {
        tracing::info!(work_item = %run.work_item, "deploy: replacing a finished watch from an earlier deploy");
        ws.clear();
    }
    let record = ArmedRecord::new(
        watch_params(&run.repo.post_deploy),
        run.store.now_ms(),
        revision,
    );
    let superseded = super::monitor::supersede_others(
        &run.repos_dir,
        run.repo_name.as_str(),
        run.work_item.as_str(),
        revision,
    );
    if !superseded.is_empty() {
        tracing::info!(work_item = %run.work_item, ?superseded, "deploy: older watches of this repo superseded");
    }
    match ws.arm(&record) {
        ArmOutcome::Armed => Ok(()),
        // Armed in this visit (it began when the task entered the stage): a retried arm. Armed
        // before it, the watch is another visit's, left here when this node went away and that
        // visit was taken over (design.md §10): replaced, not reused.
        ArmOutcome::AlreadyArmed(existing)
            if revision_matches(revision, &existing.revision)
                && existing.armed_at_ms >= run.task.updated_at =>
        {
            tracing::info!(work_item = %run.work_item, "deploy: watch already armed for this revision (a retried arm)");
            Ok(())
        }
        ArmOutcome::AlreadyArmed(existing) => {
            tracing::warn!(work_item = %run.work_item, old = %existing.revision, new = revision, armed_at = existing.armed_at_ms, "deploy: replacing a watch armed for another revision or by an earlier visit");
            ws.clear();
            match ws.arm(&record) {
                ArmOutcome::Armed => Ok(()),
                other => bail!("deploy: cannot re-arm the post-deploy watch: {other:?}"),
            }
        }
        ArmOutcome::Failed(e) => bail!("deploy: cannot arm the post-deploy watch: {e}"),
    }
}

/// Records a failed visit, clears the markers and fails the stage. The revert comes first: a
/// revert that could not run (git, the tests, a stopping run) fails this attempt before
/// anything is recorded, so the job's next attempt finds the visit unrecorded and tries again
/// (a recorded failure is replayed, never reverted again). Only the last attempt records a
/// failure whose revert failed.
async fn fail(
    run: &StageRun,
    state: &DeployState,
    seq: i64,
    kind: &str,
    reason: String,
    revision: &str,
) -> anyhow::Result<StageEffect> {
    // A change that never ran healthy in production leaves the default branch, whatever
    // `on_failure` says (hold is for changes that deployed and then failed their watch). Its
    // wait for a forge stays within this job: the deploy's failure is concluded here.
    let reverted = match crate::release::revert(run, &reason, crate::release::Step::Stay).await {
        Err(e) if run.cancel.is_cancelled() || run.job.attempt < run.job.max_attempts => {
            return Err(e.context(format!(
                "the revert of {} did not finish (attempt {} of {})",
                run.work_item, run.job.attempt, run.job.max_attempts
            )));
        }
        other => other,
    };
    let reason = match reverted {
        Ok(crate::release::Reverted::Reverted { commit }) => {
            format!(
                "{reason}; reverted on `{}` by `{commit}`",
                run.repo.default_branch
            )
        }
        Ok(crate::release::Reverted::Held { reason: why }) => {
            format!("{reason}; not reverted: {why}")
        }
        Err(e) => format!("{reason}; the revert failed: {e:#}"),
    };
    record(
        run,
        seq,
        kind,
        &reason,
        data([("revision", json!(revision))]),
    )
    .await?;
    let counter = if kind == events::DEPLOY_UNCONFIRMED {
        "unconfirmed"
    } else {
        "failed"
    };
    run.counters.incr("deployer", counter);
    crate::release::record_deployed(run, seq, revision, false).await?;
    if !state.clear_state() {
        tracing::warn!(work_item = %run.work_item, "deploy: the markers could not be cleared");
    }
    Ok(produced(GateOutcome::not_success(reason)))
}

/// The revision written into `INITIATED`, if readable.
fn initiated_revision(state: &DeployState) -> Option<String> {
    let path: PathBuf = state.dir()?.join(MARKER_INITIATED);
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(text.trim().to_owned()).filter(|s| !s.is_empty()),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "deploy: cannot read the INITIATED marker");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(c: char) -> String {
        c.to_string().repeat(40)
    }

    fn started(id: i64, seq: i64, revision: &str, previous: Option<&str>) -> orch_store::Event {
        orch_store::Event {
            id,
            task_id: Some(1),
            job_id: Some(id),
            kind: events::DEPLOY_STARTED.to_owned(),
            stage: Some("deploy".to_owned()),
            message: String::new(),
            data: json!({"seq": seq, "revision": revision, "previous": previous}).to_string(),
            created_at: 0,
        }
    }

    #[test]
    fn a_release_of_another_change_is_the_one_to_go_back_to() {
        let history = [started(1, 1, &sha('b'), Some(sha('a').as_str()))];
        assert_eq!(
            before_own_deploys(&history, 2, Some(sha('c'))).as_deref(),
            Some(sha('c').as_str())
        );
        assert_eq!(before_own_deploys(&history, 2, None), None);
    }

    #[test]
    fn this_items_own_earlier_build_is_never_the_one_to_go_back_to() {
        // Visit 1 deployed `bbbb` over `aaaa` and was cut short; the item was merged and staged
        // again as `cccc` (visit 2, also cut short), and visit 3 finds `cccc` serving.
        let history = [
            started(1, 1, &sha('b'), Some(sha('a').as_str())),
            started(2, 2, &sha('c'), Some(sha('b').as_str())),
        ];
        assert_eq!(
            before_own_deploys(&history, 3, Some(sha('c'))).as_deref(),
            Some(sha('a').as_str())
        );
        // The service may name a short revision.
        assert_eq!(
            before_own_deploys(&history, 3, Some("bbbbbbbb".to_owned())).as_deref(),
            Some(sha('a').as_str())
        );
        // What ran before the first deploy was not known: neither is the answer.
        let unknown = [started(1, 1, &sha('b'), None)];
        assert_eq!(before_own_deploys(&unknown, 2, Some(sha('b'))), None);
        // A later visit's events are not earlier builds.
        let later = [started(5, 4, &sha('b'), Some(sha('a').as_str()))];
        assert_eq!(
            before_own_deploys(&later, 3, Some(sha('b'))).as_deref(),
            Some(sha('b').as_str())
        );
    }
}
