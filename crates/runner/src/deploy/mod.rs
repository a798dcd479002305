//! The deploy tail's stage executors (design.md §3 rows deploy → observe → lessons): the deployer
//! with its finalizer (design.md §6), the post-deploy monitor (design.md §7, seed ORCH-021) and the
//! lessons loop (design.md §8). They plug into the engine through [`crate::engine::StageExecutor`];
//! the engine commits what they write, gates it and changes the stage.
//!
//! Map:
//! - [`probe`]: the HTTP checks (health, live revision) with FAIL/ERROR told apart.
//! - [`promote`]: `deploy` stage's executor: the release train's promotion of the staged
//!   commit, then the deployer.
//! - [`deployer`]: `deploy` stage: the deploy command under self-deploy markers, the
//!   finalizer's bounded restart-safe confirmation, arming the watch.
//! - [`monitor`]: `observe` stage: one poll per job, the verdict, rollback or alert, the
//!   `16-post-deploy-log.md` artifact, and the recovery sweep for stranded watches.
//! - [`recover`]: the one place that settles production after anything went wrong in deploy
//!   or observe: verified healthy at a known revision (rolled back when that is the remedy),
//!   or an operator alerted with what is live, what was tried and what to do.
//! - [`alert`]: the alert (event, then the `alert` command and the webhook job:
//!   [`crate::notify`]).
//! - [`lessons`]: `lessons` stage: objective outcomes → `17-lessons.md` and the lessons file.
//!
//! Invariants:
//! - **No new state but files and markers** (design.md §7): counts (finalizer defers, monitor
//!   ticks) are recovered from the jobs queue by marker substrings, the way the finalizer's
//!   defer count always was; the watch lives in the `orch-deploystate` sentinel files.
//! - **Restart-safe side effects.** The deploy command completes at most once per stage visit
//!   (`INITIATED` is on disk before it starts; a run interrupted by orch's death before the
//!   revision went live is run once more, `deploy.redeployed`); a rollback starts once per
//!   visit (a `post_deploy.rollback_started` event is recorded before it starts) and a run
//!   that orch's death interrupted before its command ended and production was back runs
//!   again, at most [`ROLLBACK_RERUNS`] times (`*.rollback_rerun`); a command that ended
//!   successfully (`*.rollback_ran`) is only verified again, never rerun; an outcome once
//!   recorded as an event (the rollback's too) is replayed, never redone.
//! - **Local state pins jobs.** The sentinel files live in this machine's `repos_dir`: the
//!   `observe` and `deploy` jobs must carry `NewJob.node = run.node` (the engine copies the
//!   node onto requeued jobs; [`monitor::recover_watches`] sets it).
//! - Every event carries the stage visit (`seq`) in its data, so replays and lessons can tell
//!   visits apart.

/// How many times one visit runs an interrupted rollback again. Each rerun needs orch to have
/// died while the previous one ran and production still not back; the bound stops a rollback
/// that itself kills orch from looping.
pub const ROLLBACK_RERUNS: u32 = 3;

pub mod alert;
pub mod deployer;
pub mod lessons;
pub mod monitor;
pub mod probe;
pub mod promote;
pub mod recover;

use std::time::Duration;

use orch_domain::config::PostDeployConfig;
// The deploy tail writes `DEPLOY_*`, `POST_DEPLOY_*` and `LESSONS_RECORDED` (each event's data
// is a JSON object with `seq`); its submodules take `events` from here.
use orch_domain::control::events;
use orch_domain::monitor::WatchParams;
use orch_exec::process::{Cmd, Output, SpawnError, run as run_process};
use orch_store::{Event, NewEvent};

use crate::engine::{StageJob, StageRun};

pub use deployer::DeployerExecutor;
pub use lessons::LessonsExecutor;
pub use monitor::{
    ActiveWatchInfo, MonitorExecutor, RecoveryAction, active_watches, recover_watches,
};
pub use promote::Promote;

/// The job kind of the `deploy` stage (and of `staging`, handled elsewhere).
pub const DEPLOYER_AGENT: &str = "deployer";
/// The job kind of the `observe` stage (design.md §7: a job kind of the existing queue).
pub const MONITOR_AGENT: &str = "post-deploy-monitor";
/// The job kind of the `lessons` stage.
pub const LESSONS_AGENT: &str = "lessons";

/// In-process counter groups of the deploy tail (read-only in `GET /queue`, never persisted,
/// like the staging runner's, seed ORCH-115 D-4): `(group, names)`.
pub const COUNTERS: [(&str, &[&str]); 3] = [
    (
        "deployer",
        &["runs", "confirmed", "failed", "unconfirmed", "deferred"],
    ),
    (
        "post_deploy_monitor",
        &[
            "ticks",
            "healthy",
            "degraded",
            "failed",
            "rollback",
            "rollback_failed",
            "alerts",
        ],
    ),
    ("lessons", &["runs", "recorded"]),
];

/// Declares the deploy tail's counters at zero so they show before the first increment.
pub fn declare_counters(counters: &crate::counters::Counters) {
    for (group, names) in COUNTERS {
        counters.declare(group, names);
    }
}

/// The watch parameters configured for a repo (frozen into `armed` when the watch is armed).
pub fn watch_params(pd: &PostDeployConfig) -> WatchParams {
    WatchParams {
        window_s: pd.window_s,
        interval_s: pd.interval_s,
        initial_delay_s: pd.initial_delay_s,
        poll_timeout_s: pd.poll_timeout_s,
    }
}

/// The stage visit this job belongs to: the `seq` of its payload, or the task's current one.
pub fn visit_seq(run: &StageRun) -> i64 {
    StageJob::from_content(&run.job.task_content)
        .map(|j| j.seq)
        .unwrap_or(run.task.stage_seq)
}

/// [`record`] with a typed payload ([`orch_domain::payload`]) as the data.
pub(crate) async fn record_payload<T: serde::Serialize>(
    run: &StageRun,
    seq: i64,
    kind: &str,
    message: impl Into<String>,
    payload: &T,
) -> anyhow::Result<()> {
    let data = match serde_json::to_value(payload)? {
        serde_json::Value::Object(map) => map,
        other => anyhow::bail!("the payload of a {kind} event is not an object: {other}"),
    };
    record(run, seq, kind, message, data).await
}

/// Appends an event for this run's task and job, with `seq` added to `data`, fenced by the
/// job's lease (an attempt that lost its job records nothing: `StoreError::LeaseLost`).
pub(crate) async fn record(
    run: &StageRun,
    seq: i64,
    kind: &str,
    message: impl Into<String>,
    mut data: serde_json::Map<String, serde_json::Value>,
) -> anyhow::Result<()> {
    data.insert("seq".into(), seq.into());
    let event = NewEvent::new(kind, message)
        .task(run.task.id)
        .job(run.job.id)
        .stage(run.stage.name.as_str())
        .data(serde_json::Value::Object(data).to_string());
    run.store.append_event_fenced(run.lease, event).await?;
    Ok(())
}

/// Records that an interrupted rollback runs again — `kind` is the deployer's or the monitor's
/// `*.rollback_rerun`, `subject` names the rollback — as rerun `done + 1` of at most
/// [`ROLLBACK_RERUNS`].
pub(crate) async fn record_rollback_rerun(
    run: &StageRun,
    seq: i64,
    kind: &str,
    subject: &str,
    revision: &str,
    command: &str,
    done: u32,
) -> anyhow::Result<()> {
    record(
        run,
        seq,
        kind,
        format!(
            "{subject} was interrupted and production is not back: running `{command}` again (rerun {} of at most {ROLLBACK_RERUNS})",
            done + 1
        ),
        data([
            ("revision", serde_json::json!(revision)),
            ("command", serde_json::json!(command)),
            ("rerun", serde_json::json!(done + 1)),
        ]),
    )
    .await
}

/// A JSON object from pairs, for event data.
pub(crate) fn data<const N: usize>(
    pairs: [(&str, serde_json::Value); N],
) -> serde_json::Map<String, serde_json::Value> {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// The events of kind `kind` recorded in stage visit `seq`, oldest first.
pub(crate) fn of_visit<'a>(
    events: &'a [Event],
    seq: i64,
    kind: &'a str,
) -> impl DoubleEndedIterator<Item = &'a Event> + 'a {
    events
        .iter()
        .filter(move |e| e.kind == kind && event_seq(e) == Some(seq))
}

/// How many times visit `seq` ran its rollback again (`kind`: the deployer's or the monitor's
/// `*.rollback_rerun`).
pub(crate) fn rollback_reruns(events: &[Event], seq: i64, kind: &str) -> u32 {
    u32::try_from(of_visit(events, seq, kind).count()).unwrap_or(u32::MAX)
}

/// Records that the rollback command ended successfully (`kind`: `*.rollback_ran`): from then
/// on a re-run only verifies it.
pub(crate) async fn record_rollback_ran(
    run: &StageRun,
    seq: i64,
    kind: &str,
    subject: &str,
    revision: &str,
    command: &str,
) -> anyhow::Result<()> {
    record(
        run,
        seq,
        kind,
        format!("`{command}` ended successfully; verifying {subject}"),
        data([
            ("revision", serde_json::json!(revision)),
            ("command", serde_json::json!(command)),
        ]),
    )
    .await
}

/// The `seq` in an event's data, if any.
pub(crate) fn event_seq(event: &Event) -> Option<i64> {
    serde_json::from_str::<serde_json::Value>(&event.data)
        .ok()?
        .get("seq")?
        .as_i64()
}

/// A string field of an event's data.
pub(crate) fn event_str(event: &Event, key: &str) -> Option<String> {
    serde_json::from_str::<serde_json::Value>(&event.data)
        .ok()?
        .get(key)?
        .as_str()
        .map(str::to_owned)
}

/// Runs a repo command (`label`: `deploy`, `rollback`) with `sh -c` in a checkout of
/// `revision`, with the deploy timeout, `ORCH_WORK_ITEM`, `ORCH_REVISION` and `env`, stopped
/// when the run is cancelled. It runs under a supervisor: a restart of orch while it runs neither cuts
/// it in half nor runs it twice (the restarted orch adopts it).
pub(crate) async fn run_repo_command(
    run: &StageRun,
    label: &str,
    command: &str,
    revision: &str,
    env: &[(&str, &str)],
) -> Result<Output, SpawnError> {
    // The command runs in a checkout of exactly the revision it is about.
    let cwd = match crate::repos::release_checkout(&run.git, &crate::release::paths(run), revision)
        .await
    {
        Ok(dir) => dir,
        Err(e) => {
            tracing::warn!(work_item = %run.work_item, error = %format!("{e:#}"), "no checkout of the release; running in orch's clone");
            run.repo_dir.clone()
        }
    };
    // Trusted (orch's configuration names it; what it runs passed review and staging): on the
    // host, with the allowlisted environment.
    let contained = crate::contain::for_trusted(&run.repo);
    let cmd = env.iter().fold(
        Cmd::new("sh")
            .arg("-c")
            .arg(command)
            .cwd(&cwd)
            .env("ORCH_WORK_ITEM", run.work_item.as_str())
            .env("ORCH_REVISION", revision)
            .env("ORCH_REPO", run.repo_name.as_str())
            .timeout(Duration::from_secs(run.repo.deploy_timeout_s.max(1)))
            .cancel_on(run.cancel.clone()),
        |cmd, (key, value)| cmd.env(key, value),
    );
    let cmd = contained.apply(cmd);
    let key = run.command_key(label);
    let out = run_process(&cmd.supervised(key.clone())).await;
    if let Ok(o) = &out {
        run.note_supervision(label, &key, o).await;
    }
    out
}

/// The last lines of a command's output for events and reasons.
pub(crate) const OUTPUT_TAIL_LINES: usize = 20;
