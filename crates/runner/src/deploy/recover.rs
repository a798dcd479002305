//! The one place that settles production after anything went wrong in deploy or observe
//! (design.md §11): orch looks at production (health and the revision it names), asks the
//! domain's rule ([`orch_domain::recovery::next`]) what to do, rolls back when that is the
//! remedy, verifies by polls, and ends either **verified healthy at a known revision** or with
//! an operator **alerted** (the `alert` command and the webhook) naming what is live, what was
//! tried and what to do. The conclusion is recorded as `production.checked`.
//!
//! Callers: the deployer (a deploy command that failed, timed out, was killed or could not
//! start; a deploy never confirmed) and the monitor (a FAILED or DEGRADED watch, a watch that
//! could not watch).
//!
//! Restart safety, as before this module gathered it: the rollback is recorded as started
//! before its command runs; a command that orch's death interrupted runs again only while
//! production is not back, at most [`super::ROLLBACK_RERUNS`] times per visit; a command that
//! ended (`*.rollback_ran`) is only verified again; a recorded rollback result and a recorded
//! `production.checked` are replayed, never redone. The alert is delivered once per visit and
//! occasion (see [`super::alert`]).

use std::time::Duration;

use orch_domain::monitor::CheckOutcome;
use orch_domain::recovery::{Health, Next, Sight, Situation, Trouble, next};
use orch_exec::process::ExitKind;
use orch_store::Event;
use serde_json::json;

use super::probe::Probe;
use orch_domain::payload::{self, ProductionChecked, RollbackResult, Rolled, Settled};

use super::{OUTPUT_TAIL_LINES, data, event_seq, events, record, run_repo_command};
use crate::engine::StageRun;

/// The events one caller's rollback writes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kinds {
    pub started: &'static str,
    pub rerun: &'static str,
    pub ran: &'static str,
    /// The verified result (the monitor's has `verified: true` in its data).
    pub ok: &'static str,
    /// The failed result (the monitor's has `verified: false`).
    pub failed: &'static str,
}

/// The deployer's rollback of a failed or unconfirmed deploy.
pub(crate) const DEPLOY: Kinds = Kinds {
    started: events::DEPLOY_ROLLBACK_STARTED,
    rerun: events::DEPLOY_ROLLBACK_RERUN,
    ran: events::DEPLOY_ROLLBACK_RAN,
    ok: events::DEPLOY_ROLLED_BACK,
    failed: events::DEPLOY_ROLLBACK_FAILED,
};

/// The monitor's rollback of a FAILED watch.
pub(crate) const WATCH: Kinds = Kinds {
    started: events::POST_DEPLOY_ROLLBACK_STARTED,
    rerun: events::POST_DEPLOY_ROLLBACK_RERUN,
    ran: events::POST_DEPLOY_ROLLBACK_RAN,
    ok: events::POST_DEPLOY_ROLLBACK,
    failed: events::POST_DEPLOY_ROLLBACK,
};

/// How a rollback is verified: up to `polls` looks, each after `interval`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Verify {
    pub polls: u32,
    pub interval: Duration,
}

/// What went wrong, for the rule and the alert.
pub(crate) struct Case<'a> {
    pub trouble: Trouble,
    /// The item's revision (the one that went wrong).
    pub revision: &'a str,
    /// The revision live before it, when known.
    pub previous: Option<String>,
    /// What went wrong, in a sentence (the alert's reason starts with it).
    pub what: String,
    /// What was tried before this module was asked (the deploy command and how it ended).
    pub tried: Vec<String>,
    /// The alert's verdict word (`FAILED`, `DEGRADED`, `UNCONFIRMED`, `DEPLOY_FAILED`).
    pub verdict: &'a str,
    /// Alert even when production is settled without a rollback (a FAILED watch whose revision
    /// is no longer live: the hold that follows needs a person anyway).
    pub alert_if_settled: bool,
}

/// The conclusion.
#[derive(Debug, Clone)]
pub(crate) struct Settlement {
    /// `Some(live)`: production verified healthy at `live`.
    pub settled: Option<String>,
    pub rolled: Rolled,
    /// One sentence for the stage's reason and the logs.
    pub summary: String,
}

/// Looks at production once: the health check and the revision the service names, on one
/// connection.
pub(crate) async fn look(run: &StageRun) -> Sight {
    look_at(&run.repo).await
}

/// [`look`] at the production of `repo`.
pub async fn look_at(repo: &orch_domain::config::RepoConfig) -> Sight {
    let timeout = Duration::from_secs(repo.post_deploy.poll_timeout_s.max(1));
    let mut probe = Probe::new(timeout);
    let (health, health_detail) = match &repo.health_url {
        None => (Health::Unwatched, "no health_url is configured".to_owned()),
        Some(url) => {
            let c = probe.health(url).await;
            let h = match c.outcome {
                CheckOutcome::Pass => Health::Pass,
                CheckOutcome::Fail => Health::Fail,
                CheckOutcome::Error | CheckOutcome::NoData => Health::Blind,
            };
            (h, c.detail)
        }
    };
    let live = match &repo.revision_url {
        Some(url) => probe.live_revision(url).await,
        None => None,
    };
    Sight {
        health,
        health_detail: orch_domain::text::one_line_max(&health_detail, 200),
        live,
        reads_revision: repo.revision_url.is_some(),
    }
}

/// Settles production for `case` in visit `seq` (see the module's comment).
pub(crate) async fn settle(
    run: &StageRun,
    seq: i64,
    kinds: &Kinds,
    verify: &Verify,
    case: Case<'_>,
) -> anyhow::Result<Settlement> {
    let history = run.store.task_events(run.task.id).await?;
    if let Some(done) = super::of_visit(&history, seq, events::PRODUCTION_CHECKED)
        .rev()
        .find(|e| {
            payload::read::<ProductionChecked>(&e.data)
                .is_some_and(|c| c.trouble == case.trouble.as_str())
        })
    {
        return Ok(replayed(done));
    }
    let command = run.repo.rollback.clone();
    let mut tried = case.tried.clone();
    let mut rolled = Rolled::NotRun;
    let mut ran = false;
    let mut command_failed = false;
    let situation = |ran: bool| Situation {
        trouble: case.trouble,
        bad: case.revision,
        previous: case.previous.as_deref(),
        rollback_configured: command.is_some(),
        rollback_ran: ran,
    };
    let mut sight = look(run).await;
    if let Some((result, verified)) = rollback_result(&history, seq, kinds) {
        // Replayed: the rollback's result is recorded; only the conclusion is missing.
        ran = true;
        rolled = if verified {
            Rolled::Verified
        } else {
            Rolled::Failed
        };
        command_failed = !verified && !super::of_visit(&history, seq, kinds.ran).any(|_| true);
        tried.push(result.message.clone());
    } else if super::of_visit(&history, seq, kinds.started)
        .next()
        .is_some()
    {
        // Started in an earlier attempt that orch's death cut short.
        let reruns = super::rollback_reruns(&history, seq, kinds.rerun);
        let ended = super::of_visit(&history, seq, kinds.ran).next().is_some();
        let back = matches!(next(&situation(true), &sight), Next::Settled { .. });
        // This job's rollback command outlived the orch that started it (under its
        // supervisor): it is adopted — waited for or its result taken — never run again.
        let adopt = orch_exec::supervise::job_has_records(run.job.id);
        if !ended
            && (adopt || (!back && reruns < super::ROLLBACK_RERUNS))
            && let Some(cmd) = &command
        {
            if !adopt {
                super::record_rollback_rerun(
                    run,
                    seq,
                    kinds.rerun,
                    &format!("the rollback of `{}`", case.revision),
                    case.revision,
                    cmd,
                    reruns,
                )
                .await?;
            }
            let (r, s, failed) = roll_back(run, seq, kinds, verify, &case, cmd, &mut tried).await?;
            (rolled, sight, command_failed) = (r, s, failed);
        } else {
            tracing::warn!(work_item = %run.work_item, "rollback already started in this visit (a re-run): verifying only");
            let (verified, s) = verify_polls(run, verify, &situation(true)).await?;
            sight = s;
            rolled = record_result(run, seq, kinds, &case, verified, &sight, &mut tried).await?;
        }
        ran = true;
    }
    let mut step = next(&situation(ran), &sight);
    if step == Next::RollBack
        && let Some(cmd) = &command
    {
        record(
            run,
            seq,
            kinds.started,
            format!(
                "rolling back `{}` with `{cmd}`: {}",
                case.revision, case.what
            ),
            data([("revision", json!(case.revision)), ("command", json!(cmd))]),
        )
        .await?;
        let (r, s, failed) = roll_back(run, seq, kinds, verify, &case, cmd, &mut tried).await?;
        (rolled, sight, command_failed) = (r, s, failed);
        step = next(&situation(true), &sight);
    }
    let (settled, why) = match step {
        Next::Settled { live } if !command_failed => (Some(live), None),
        Next::Settled { live } => (
            Some(live.clone()),
            Some(format!(
                "the rollback command failed, although production now answers healthy at `{live}`"
            )),
        ),
        Next::Alert { why } => (None, Some(why)),
        Next::RollBack => (
            None,
            Some("a rollback is needed, but none could be run".to_owned()),
        ),
    };
    let alert_why = match (&settled, why) {
        (_, Some(why)) => Some(why),
        (Some(live), None) if case.alert_if_settled && rolled == Rolled::NotRun => Some(format!(
            "production answers healthy at `{live}`, not at the watched revision: not rolled back"
        )),
        _ => None,
    };
    let todo = todo(run, &case, &settled);
    let summary = match (&settled, &alert_why) {
        (Some(live), None) => format!(
            "production verified healthy at `{live}`{}",
            if rolled == Rolled::Verified {
                " after the rollback"
            } else {
                ""
            }
        ),
        (_, Some(why)) => format!(
            "operator alerted: {why}{}; live: {}",
            match (rolled, tried.last()) {
                (Rolled::NotRun, _) | (_, None) => String::new(),
                (_, Some(last)) => format!(" ({last})"),
            },
            sight.describe()
        ),
        (None, None) => format!("live: {}", sight.describe()),
    };
    if let Some(why) = &alert_why {
        super::alert::raise(
            run,
            seq,
            &super::alert::Alert {
                occasion: &format!("{}-{}", case.trouble.as_str(), rolled.as_str()),
                verdict: case.verdict,
                action: action_word(rolled, true),
                reason: &format!("{}: {}; {why}", case.verdict, case.what),
                revision: case.revision,
                previous: case.previous.as_deref(),
                sight: Some(&sight),
                tried: &tried,
                todo: &todo,
            },
        )
        .await?;
    }
    super::record_payload(
        run,
        seq,
        events::PRODUCTION_CHECKED,
        &summary,
        &ProductionChecked {
            trouble: case.trouble.as_str().to_owned(),
            revision: case.revision.to_owned(),
            previous: case.previous.clone(),
            live: sight.live.clone().or(settled.clone()),
            health: sight.health.as_str().to_owned(),
            description: sight.describe(),
            settled: if alert_why.is_some() {
                Settled::Alerted
            } else {
                Settled::Healthy
            },
            rolled,
            settled_at: settled.clone(),
            tried: tried.clone(),
            todo: todo.clone(),
            seq: None,
        },
    )
    .await?;
    Ok(Settlement {
        settled,
        rolled,
        summary,
    })
}

/// Runs the rollback command once and verifies it; records what happened. Returns how it
/// went, the last look, and whether the command itself failed.
async fn roll_back(
    run: &StageRun,
    seq: i64,
    kinds: &Kinds,
    verify: &Verify,
    case: &Case<'_>,
    command: &str,
    tried: &mut Vec<String>,
) -> anyhow::Result<(Rolled, Sight, bool)> {
    // The revision to go back to, as orch's own record says (empty when it does not know):
    // a rollback command that keeps its own "previous" may have it wrong after a deploy was
    // cut short and the change deployed again.
    let to = case.previous.as_deref().unwrap_or_default();
    let out = run_repo_command(
        run,
        "rollback",
        command,
        case.revision,
        &[("ORCH_ROLLBACK_TO", to)],
    )
    .await;
    if kinds.started == WATCH.started {
        crate::failpoint::hit("monitor.after_rollback");
    }
    let failed = match &out {
        Ok(o) if o.success() => {
            super::record_rollback_ran(
                run,
                seq,
                kinds.ran,
                &format!("the rollback of `{}`", case.revision),
                case.revision,
                command,
            )
            .await?;
            tried.push(format!(
                "rollback `{command}` ended successfully after {:.1} s",
                o.duration.as_secs_f64()
            ));
            None
        }
        Ok(o) if o.status == ExitKind::Cancelled => anyhow::bail!(
            "rollback `{command}` cancelled (lease lost or shutdown); the re-run verifies it"
        ),
        Ok(o) => Some(format!(
            "rollback command `{command}` ended with {} after {:.1} s:\n{}",
            o.status,
            o.duration.as_secs_f64(),
            o.tail_text(OUTPUT_TAIL_LINES)
        )),
        Err(e) => Some(format!("rollback command `{command}` could not start: {e}")),
    };
    if let Some(why) = failed {
        tried.push(orch_domain::text::one_line_max(&why, 300));
        let sight = look(run).await;
        let result = RollbackResult {
            revision: case.revision.to_owned(),
            verified: false,
            attempted: true,
            live: sight.live.clone(),
            seq: Some(seq),
        };
        super::record_payload(run, seq, kinds.failed, &why, &result).await?;
        return Ok((Rolled::Failed, sight, true));
    }
    let situation = Situation {
        trouble: case.trouble,
        bad: case.revision,
        previous: case.previous.as_deref(),
        rollback_configured: true,
        rollback_ran: true,
    };
    let (verified, sight) = verify_polls(run, verify, &situation).await?;
    let rolled = record_result(run, seq, kinds, case, verified, &sight, tried).await?;
    Ok((rolled, sight, false))
}

/// Looks up to `verify.polls` times, each after `verify.interval`, until the rule calls
/// production settled. A run cancelled meanwhile is an error, never "not verified".
async fn verify_polls(
    run: &StageRun,
    verify: &Verify,
    situation: &Situation<'_>,
) -> anyhow::Result<(bool, Sight)> {
    let mut sight = None;
    for i in 1..=verify.polls.max(1) {
        tokio::select! {
            () = tokio::time::sleep(verify.interval) => {}
            () = run.cancel.cancelled() => anyhow::bail!(
                "cancelled before rollback verification poll {i} (lease lost or shutdown)"
            ),
        }
        let s = look(run).await;
        if matches!(next(situation, &s), Next::Settled { .. }) {
            return Ok((true, s));
        }
        sight = Some(s);
    }
    match sight {
        Some(s) => Ok((false, s)),
        None => Ok((false, look(run).await)),
    }
}

/// Records the rollback's verified (or not) result.
async fn record_result(
    run: &StageRun,
    seq: i64,
    kinds: &Kinds,
    case: &Case<'_>,
    verified: bool,
    sight: &Sight,
    tried: &mut Vec<String>,
) -> anyhow::Result<Rolled> {
    let rev = case.revision;
    let message = if verified {
        format!("rolled back `{rev}`; verified: {}", sight.describe())
    } else {
        format!(
            "rollback of `{rev}` ran but is not verified: {}",
            sight.describe()
        )
    };
    tried.push(message.clone());
    let kind = if verified { kinds.ok } else { kinds.failed };
    let result = RollbackResult {
        revision: rev.to_owned(),
        verified,
        attempted: true,
        live: sight.live.clone(),
        seq: Some(seq),
    };
    super::record_payload(run, seq, kind, &message, &result).await?;
    Ok(if verified {
        Rolled::Verified
    } else {
        Rolled::Failed
    })
}

/// The rollback result this visit recorded, with whether it was verified.
fn rollback_result<'a>(history: &'a [Event], seq: i64, kinds: &Kinds) -> Option<(&'a Event, bool)> {
    let result = |e: &Event| payload::read::<RollbackResult>(&e.data);
    let e = history.iter().rev().find(|e| {
        event_seq(e) == Some(seq)
            && (e.kind == kinds.ok || e.kind == kinds.failed)
            && !(e.kind == events::DEPLOY_ROLLBACK_FAILED
                && result(e).is_some_and(|r| !r.attempted))
    })?;
    let verified = if kinds.ok == kinds.failed {
        result(e).is_some_and(|r| r.verified)
    } else {
        e.kind == kinds.ok
    };
    Some((e, verified))
}

/// A settlement read back from its `production.checked` event.
fn replayed(e: &Event) -> Settlement {
    // An unreadable row replays as "not settled": the conservative reading (the item holds).
    let checked = payload::read::<ProductionChecked>(&e.data);
    Settlement {
        settled: checked.as_ref().and_then(|c| c.settled_at.clone()),
        rolled: checked.map_or(Rolled::NotRun, |c| c.rolled),
        summary: e.message.clone(),
    }
}

/// The watch's `action_taken` word for how it went.
pub(crate) fn action_word(r: Rolled, alerted: bool) -> &'static str {
    match (r, alerted) {
        (Rolled::Verified, _) => "rollback",
        (Rolled::Failed, _) => "rollback_failed",
        (Rolled::NotRun, true) => "alert",
        (Rolled::NotRun, false) => "none",
    }
}

/// What a person should do, for the alert.
fn todo(run: &StageRun, case: &Case<'_>, settled: &Option<String>) -> String {
    let id = &run.work_item;
    let back_to = case
        .previous
        .as_deref()
        .map_or_else(|| "the last good release".to_owned(), |p| format!("`{p}`"));
    let restore = match (&run.repo.rollback, settled) {
        (_, Some(live)) => format!("check that `{live}` is the release you want live"),
        (Some(cmd), None) => format!(
            "bring production back to {back_to} by hand (the rollback command `{cmd}` did not), and check it answers healthy"
        ),
        (None, None) => format!(
            "bring production back to {back_to} by hand (no rollback command is configured), and check it answers healthy"
        ),
    };
    match case.trouble {
        Trouble::DeployFailed | Trouble::DeployUnconfirmed => format!(
            "{restore}; {id} failed and its change leaves `{}`; `orch logs {id}` shows what was tried",
            run.repo.default_branch
        ),
        Trouble::WatchFailed => format!(
            "{restore}; then `orch approve {id}` releases the repo's hold (or `orch cancel {id}`)"
        ),
        Trouble::WatchDegraded => format!(
            "check production: `{}` is live and not proven healthy; `orch logs {id}` shows the watch's polls",
            case.revision
        ),
        Trouble::Unwatched => format!(
            "check production by hand; set `health_url` (and `revision_url`) for repo {} so orch can watch its deploys",
            run.repo_name
        ),
    }
}
