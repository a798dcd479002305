//! Notifications as a product: the one signed webhook and the `alert` command.
//!
//! Every occasion a person should know of — a terminal outcome, a hold that waits for an
//! operator, an alert — is recorded as an event first, then announced ([`announce`]):
//! - the repo's `alert` command runs at once (best effort, [`ALERT_TIMEOUT_S`]) for an alert,
//!   a hold and a failed item, with the notification document on stdin and its facts in
//!   `ORCH_*` variables; its end is recorded (`post_deploy.alert_sent` / `…_failed`, channel
//!   `command`, with the notice's id), so a re-run after a crash does not page twice;
//! - the webhook delivery is a job of its own ([`NOTIFY`], dedupe key `notify:<event id>`, so
//!   one per occasion however often it is asked for), which the pipeline never waits for. The
//!   [`NotifyHandler`] POSTs the document (or its Slack form), signed with HMAC-SHA256 over
//!   `<timestamp>.<body>` when `alert_webhook_secret` is set, and records every try on the
//!   item (`notify.delivered`, `notify.failed` with when it tries again). A failed try is
//!   retried with exponential backoff (2 s doubling, at most 5 min) up to [`NOTIFY_ATTEMPTS`]
//!   tries; the last failure is recorded and the job ends (it never fails a task). Every try
//!   carries the same `id` (`X-Orch-Delivery`), so a receiver that saw an earlier try keeps
//!   one.
//!
//! Webhook URLs can hold secrets (a Slack hook's path): events and logs name only the host.

use std::time::Duration;

use hmac::{KeyInit as _, Mac as _};
use orch_domain::config::{Config, RepoConfig, WebhookFormat};
use orch_domain::control::{dedupe, events, jobs};
use orch_domain::notice::{Notice, slack};
use orch_exec::process::{Cmd, run as run_process};
use orch_store::{NewEvent, NewJob, Store};
use serde_json::json;

use crate::live_config::LiveConfig;
use crate::worker::{JobContext, JobHandler, Outcome};

/// The webhook delivery job's kind.
pub const NOTIFY: &str = jobs::NOTIFY;
/// Tries of one delivery before it is given up (recorded, never failing anything).
pub const NOTIFY_ATTEMPTS: i64 = 8;
/// Timeout of one delivery (the command, or the webhook request), seconds.
pub const ALERT_TIMEOUT_S: u64 = 10;
/// The signature header: `t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`.
pub const SIGNATURE_HEADER: &str = "x-orch-signature";
/// The delivery's id header (the notice's `id`, the same on every try).
pub const DELIVERY_HEADER: &str = "x-orch-delivery";
/// The notice's `event` header.
pub const EVENT_HEADER: &str = "x-orch-event";

/// Where an announcement's events go and what runs its command.
pub struct Target<'a> {
    pub store: &'a Store,
    pub repo: &'a RepoConfig,
    /// The directory the `alert` command runs in (the repo's clone).
    pub cwd: &'a std::path::Path,
    /// The task the events are recorded on.
    pub task_id: i64,
    /// The stage recorded on the events.
    pub stage: &'a str,
    /// Fences the events when the announcer holds a stage job's lease.
    pub lease: Option<orch_store::Lease>,
}

impl<'a> Target<'a> {
    /// A deploy-tail stage's announcements: its task, stage and repo clone, fenced by its lease.
    pub(crate) fn of_run(run: &'a crate::engine::StageRun) -> Target<'a> {
        Target {
            store: &run.store,
            repo: &run.repo,
            cwd: &run.repo_dir,
            task_id: run.task.id,
            stage: run.stage.name.as_str(),
            lease: Some(run.lease),
        }
    }
}

/// `t=<unix seconds>,v1=<hex>`: the signature of `body` sent at `unix_s` with `secret`.
pub fn signature(secret: &str, unix_s: i64, body: &str) -> String {
    // HMAC takes a key of any length: this never fails, and a failure would send no signature.
    let Ok(mut mac) = <hmac::Hmac<sha2::Sha256>>::new_from_slice(secret.as_bytes()) else {
        return format!("t={unix_s},v1=");
    };
    mac.update(unix_s.to_string().as_bytes());
    mac.update(b".");
    mac.update(body.as_bytes());
    let bytes = mac.finalize().into_bytes();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("t={unix_s},v1={hex}")
}

/// The host a webhook URL names (what events and logs may say of it).
pub fn host_of(url: &str) -> String {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
        .unwrap_or_else(|| "an unparsable URL".to_owned())
}

/// Announces `notice`, recorded as event `event_id`: runs the `alert` command when `page` is
/// true and the repo has one (once per notice), and enqueues the webhook delivery when the
/// repo has a webhook (once per event). Errors only when the store fails.
pub async fn announce(
    target: &Target<'_>,
    notice: &Notice,
    event_id: i64,
    page: bool,
) -> anyhow::Result<()> {
    if page && let Some(command) = target.repo.alert.clone() {
        let recorded = target.store.task_events(target.task_id).await?;
        let ran = recorded.iter().any(|e| {
            matches!(
                e.kind.as_str(),
                events::POST_DEPLOY_ALERT_SENT | events::POST_DEPLOY_ALERT_FAILED
            ) && crate::deploy::event_str(e, "notice").as_deref() == Some(notice.id.as_str())
        });
        if !ran {
            let result = run_command(target, &command, notice).await;
            let (kind, message) = match result {
                Ok(m) => (events::POST_DEPLOY_ALERT_SENT, m),
                Err(m) => {
                    tracing::warn!(work_item = %notice.work_item, "alert command: {m}");
                    (events::POST_DEPLOY_ALERT_FAILED, m)
                }
            };
            let event = NewEvent::new(kind, message)
                .task(target.task_id)
                .stage(target.stage)
                .data(
                    json!({"channel": "command", "notice": notice.id, "event": notice.event})
                        .to_string(),
                );
            match target.lease {
                Some(lease) => target.store.append_event_fenced(lease, event).await?,
                None => target.store.append_event(event).await?,
            };
        }
    }
    if target.repo.alert_webhook.is_some() {
        let job = NewJob::new(NOTIFY, notice.to_json())
            .dedupe(dedupe::notify(event_id))
            .max_attempts(NOTIFY_ATTEMPTS);
        target.store.enqueue(job).await?;
    }
    Ok(())
}

/// Runs the alert command with `sh -c` in the repo's clone: the notice on stdin, its facts in
/// `ORCH_*` variables.
async fn run_command(target: &Target<'_>, command: &str, n: &Notice) -> Result<String, String> {
    let live = n
        .live
        .as_ref()
        .map_or("unknown", |l| l.description.as_str());
    // Trusted (orch's configuration names it): on the host, with the allowlisted environment.
    let cmd = crate::contain::for_trusted(target.repo)
        .apply(Cmd::new("sh"))
        .arg("-c")
        .arg(command)
        .cwd(target.cwd)
        .env("ORCH_WORK_ITEM", &n.work_item)
        .env("ORCH_REPO", &n.repo)
        .env("ORCH_EVENT", &n.event)
        .env("ORCH_VERDICT", n.verdict.as_deref().unwrap_or(&n.event))
        .env(
            "ORCH_ACTION",
            n.action
                .as_deref()
                .or(n.outcome.as_deref())
                .unwrap_or(&n.event),
        )
        .env("ORCH_REASON", &n.reason)
        .env("ORCH_REVISION", n.revision.as_deref().unwrap_or(""))
        .env("ORCH_LIVE", live)
        .env("ORCH_TODO", n.todo.as_deref().unwrap_or(""))
        .stdin(n.to_json().into_bytes())
        .timeout(Duration::from_secs(ALERT_TIMEOUT_S));
    match run_process(&cmd).await {
        Ok(out) if out.success() => Ok(format!("alert command `{command}` ran")),
        Ok(out) => Err(format!(
            "alert command `{command}` ended with {}:\n{}",
            out.status,
            out.tail_text(crate::deploy::OUTPUT_TAIL_LINES)
        )),
        Err(e) => Err(format!("alert command `{command}` could not start: {e}")),
    }
}

/// Runs the [`NOTIFY`] jobs: one POST per try.
pub struct NotifyHandler {
    pub store: Store,
    pub live: LiveConfig,
}

/// The delay before try `attempt + 1`: 2 s doubling per try, at most 5 min.
pub fn backoff(attempt: i64) -> Duration {
    let exp = u32::try_from(attempt.clamp(1, 10) - 1).unwrap_or(0);
    Duration::from_secs((2u64 << exp).min(300))
}

#[async_trait::async_trait]
impl JobHandler for NotifyHandler {
    async fn run(&self, cx: JobContext) -> anyhow::Result<Outcome> {
        let notice: Notice = match serde_json::from_str(&cx.job.task_content) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(job = cx.job.id, error = %e, "notify: the job holds no notification document; dropped");
                return Ok(Outcome::Done);
            }
        };
        let config: std::sync::Arc<Config> = self.live.current();
        let repo = notice
            .repo
            .parse()
            .ok()
            .and_then(|r| config.repos.get(&r))
            .cloned();
        let Some((repo, url)) = repo.and_then(|r| r.alert_webhook.clone().map(|u| (r, u))) else {
            tracing::info!(id = %notice.id, "notify: the repo no longer has a webhook; nothing sent");
            return Ok(Outcome::Done);
        };
        let task_id = self
            .store
            .get_task_by_work_item(&notice.work_item)
            .await?
            .map(|t| t.id);
        let attempt = cx.lease.attempt;
        let sent = deliver(&url, &repo, &notice, self.store.now_ms()).await;
        let host = host_of(&url);
        let (kind, message, data, outcome) = match sent {
            Ok(status) => (
                events::NOTIFY_DELIVERED,
                format!(
                    "{} notification {} delivered to the webhook at {host} (HTTP {status}, try {attempt})",
                    notice.event, notice.id
                ),
                json!({"id": notice.id, "event": notice.event, "attempt": attempt, "status": status}),
                Outcome::Done,
            ),
            Err(why) if attempt < cx.job.max_attempts => {
                let delay = backoff(attempt);
                (
                    events::NOTIFY_FAILED,
                    format!(
                        "{} notification {} not delivered to the webhook at {host} (try {attempt} of {}): {why}; trying again in {} s",
                        notice.event,
                        notice.id,
                        cx.job.max_attempts,
                        delay.as_secs()
                    ),
                    json!({"id": notice.id, "event": notice.event, "attempt": attempt, "error": why, "retry_in_s": delay.as_secs()}),
                    Outcome::Retry { error: why, delay },
                )
            }
            Err(why) => (
                events::NOTIFY_FAILED,
                format!(
                    "{} notification {} not delivered to the webhook at {host} after {attempt} tries: {why}; given up",
                    notice.event, notice.id
                ),
                json!({"id": notice.id, "event": notice.event, "attempt": attempt, "error": why, "retry_in_s": null}),
                Outcome::Done,
            ),
        };
        if kind == events::NOTIFY_FAILED {
            tracing::warn!(id = %notice.id, "{message}");
        }
        let mut event = NewEvent::new(kind, message)
            .job(cx.job.id)
            .data(data.to_string());
        event.task_id = task_id;
        self.store.append_event_fenced(cx.lease, event).await?;
        Ok(outcome)
    }
}

/// One POST of `notice` to `url`: the HTTP status of a 2xx answer, else why not.
async fn deliver(
    url: &str,
    repo: &RepoConfig,
    notice: &Notice,
    now_ms: i64,
) -> Result<u16, String> {
    let body = match repo.alert_webhook_format {
        WebhookFormat::Orch => notice.to_json(),
        WebhookFormat::Slack => slack(notice),
    };
    let client = crate::deploy::probe::client(Duration::from_secs(ALERT_TIMEOUT_S))?;
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .header(DELIVERY_HEADER, notice.id.as_str())
        .header(EVENT_HEADER, notice.event.as_str());
    if let Some(secret) = &repo.alert_webhook_secret {
        req = req.header(
            SIGNATURE_HEADER,
            signature(secret.expose(), now_ms / 1000, &body),
        );
    }
    match req.body(body).send().await {
        Ok(resp) if resp.status().is_success() => Ok(resp.status().as_u16()),
        Ok(resp) => Err(format!("answered HTTP {}", resp.status().as_u16())),
        Err(e) if e.is_timeout() => Err(format!("no answer within {ALERT_TIMEOUT_S} s")),
        Err(e) if e.is_connect() => Err("could not connect".to_owned()),
        Err(e) => Err(format!("the request failed: {}", without_url(&e))),
    }
}

/// A reqwest error's text without the URL it names (it can hold a secret).
fn without_url(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    if let Some(url) = e.url() {
        text = text.replace(url.as_str(), &host_of(url.as_str()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_hmac_sha256_of_time_dot_body() {
        let sig = signature("Jefe", 0, "body");
        assert!(sig.starts_with("t=0,v1="), "{sig}");
        assert_eq!(sig.len(), "t=0,v1=".len() + 64);
        // Known value: HMAC-SHA256(key "key", "0.body").
        let mut mac = <hmac::Hmac<sha2::Sha256>>::new_from_slice(b"key").unwrap();
        mac.update(b"0.body");
        let want: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(signature("key", 0, "body"), format!("t=0,v1={want}"));
        // RFC 4231 test case 2 through the same function: t = "what do ya want for nothing?"
        // cannot be expressed (t is a number), so the known answer is checked on the primitive.
        let mut mac = <hmac::Hmac<sha2::Sha256>>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        let got: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            got,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn backoff_doubles_up_to_five_minutes() {
        let secs: Vec<u64> = (1..=10).map(|a| backoff(a).as_secs()).collect();
        assert_eq!(secs, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
    }

    #[test]
    fn only_the_host_of_a_webhook_is_named() {
        assert_eq!(
            host_of("https://hooks.slack.com/services/T0/B0/SECRET"),
            "hooks.slack.com"
        );
        assert_eq!(host_of("not a url"), "an unparsable URL");
    }
}
