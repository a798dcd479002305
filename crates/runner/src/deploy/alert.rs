//! The deploy tail's alert hook (design.md §7 "DEGRADED → alert"): an alert is always recorded as a
//! `post_deploy.alert` event, and when the repo configures them it is also delivered to a
//! human — the `alert` shell command and/or a JSON POST to `alert_webhook`. Delivery is
//! best-effort with a timeout: a broken hook never fails the stage, it is recorded as
//! `post_deploy.alert_failed` (delivered: `post_deploy.alert_sent`), one event per channel.
//!
//! Restart safety: a channel already recorded (sent or failed) for the same stage visit and
//! occasion is not delivered again, so a re-run after a crash does not page twice.

use std::time::Duration;

use orch_exec::process::{Cmd, run as run_process};
use serde_json::json;

use super::{OUTPUT_TAIL_LINES, data, event_seq, event_str, events, record};
use crate::engine::StageRun;

/// Timeout of one delivery (the command, or the webhook request), seconds.
pub const ALERT_TIMEOUT_S: u64 = 10;

/// What an alert is about.
#[derive(Debug, Clone, Copy)]
pub struct Alert<'a> {
    /// What happened, one word: `degraded`, `failed`, `rollback_failed`, `unconfirmed`, ...
    /// (with the visit, the key that keeps a re-run from delivering twice).
    pub occasion: &'a str,
    /// The verdict (`HEALTHY`/`DEGRADED`/`FAILED`, or `UNCONFIRMED` for a deploy).
    pub verdict: &'a str,
    /// The action taken (`alert`, `rollback`, `rollback_failed`, ...).
    pub action: &'a str,
    /// Why, in a sentence.
    pub reason: &'a str,
    /// The revision concerned.
    pub revision: &'a str,
}

/// Raises `alert`: records the `post_deploy.alert` event, then delivers it to the configured
/// command and webhook (best effort). Errors only when the store fails.
pub(crate) async fn raise(run: &StageRun, seq: i64, alert: &Alert<'_>) -> anyhow::Result<()> {
    tracing::warn!(work_item = %run.work_item, verdict = alert.verdict, "alert: {}", alert.reason);
    run.counters.incr("post_deploy_monitor", "alerts");
    let recorded = run.store.task_events(run.task.id).await?;
    let delivered = |channel: &str| {
        recorded.iter().any(|e| {
            matches!(
                e.kind.as_str(),
                events::POST_DEPLOY_ALERT_SENT | events::POST_DEPLOY_ALERT_FAILED
            ) && event_seq(e) == Some(seq)
                && event_str(e, "channel").as_deref() == Some(channel)
                && event_str(e, "occasion").as_deref() == Some(alert.occasion)
        })
    };
    let raised_before = recorded.iter().any(|e| {
        e.kind == events::POST_DEPLOY_ALERT
            && event_seq(e) == Some(seq)
            && event_str(e, "occasion").as_deref() == Some(alert.occasion)
    });
    if !raised_before {
        record(
            run,
            seq,
            events::POST_DEPLOY_ALERT,
            alert.reason,
            fields(alert, None),
        )
        .await?;
    }
    if let Some(command) = run.repo.alert.clone()
        && !delivered("command")
    {
        let result = run_command(run, &command, alert).await;
        note(run, seq, alert, "command", result).await?;
    }
    if let Some(url) = run.repo.alert_webhook.clone()
        && !delivered("webhook")
    {
        let result = post(run, &url, alert).await;
        note(run, seq, alert, "webhook", result).await?;
    }
    Ok(())
}

fn fields(alert: &Alert<'_>, channel: Option<&str>) -> serde_json::Map<String, serde_json::Value> {
    let mut d = data([
        ("occasion", json!(alert.occasion)),
        ("verdict", json!(alert.verdict)),
        ("action", json!(alert.action)),
        ("revision", json!(alert.revision)),
    ]);
    if let Some(c) = channel {
        d.insert("channel".into(), json!(c));
    }
    d
}

async fn note(
    run: &StageRun,
    seq: i64,
    alert: &Alert<'_>,
    channel: &str,
    result: Result<String, String>,
) -> anyhow::Result<()> {
    let (kind, message) = match result {
        Ok(detail) => (events::POST_DEPLOY_ALERT_SENT, detail),
        Err(why) => {
            tracing::warn!(work_item = %run.work_item, channel, "alert not delivered: {why}");
            (events::POST_DEPLOY_ALERT_FAILED, why)
        }
    };
    record(run, seq, kind, message, fields(alert, Some(channel))).await
}

/// Runs the alert command with `sh -c` in the repo checkout.
async fn run_command(run: &StageRun, command: &str, alert: &Alert<'_>) -> Result<String, String> {
    let cmd = Cmd::new("sh")
        .arg("-c")
        .arg(command)
        .cwd(&run.repo_dir)
        .env("ORCH_WORK_ITEM", run.work_item.as_str())
        .env("ORCH_REPO", run.repo_name.as_str())
        .env("ORCH_VERDICT", alert.verdict)
        .env("ORCH_ACTION", alert.action)
        .env("ORCH_REASON", alert.reason)
        .env("ORCH_REVISION", alert.revision)
        .timeout(Duration::from_secs(ALERT_TIMEOUT_S));
    match run_process(&cmd).await {
        Ok(out) if out.success() => Ok(format!("alert command `{command}` ran")),
        Ok(out) => Err(format!(
            "alert command `{command}` ended with {}:\n{}",
            out.status,
            out.tail_text(OUTPUT_TAIL_LINES)
        )),
        Err(e) => Err(format!("alert command `{command}` could not start: {e}")),
    }
}

/// POSTs the alert as JSON to `url`; any 2xx answer is delivered.
async fn post(run: &StageRun, url: &str, alert: &Alert<'_>) -> Result<String, String> {
    let body = json!({
        "work_item": run.work_item.as_str(),
        "repo": run.repo_name.as_str(),
        "verdict": alert.verdict,
        "action": alert.action,
        "reason": alert.reason,
        "revision": alert.revision,
    });
    let client = super::probe::client(Duration::from_secs(ALERT_TIMEOUT_S))
        .map_err(|e| format!("alert webhook {url}: {e}"))?;
    match client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
    {
        Ok(resp) if resp.status().is_success() => {
            Ok(format!("alert webhook {url} answered {}", resp.status()))
        }
        Ok(resp) => Err(format!("alert webhook {url} answered {}", resp.status())),
        Err(e) => Err(format!("alert webhook {url} failed: {e}")),
    }
}
