//! The HTTP checks of the deploy tail: is the service healthy, and which revision is live. The
//! deploy finalizer uses them to confirm a deploy (design.md §6), the post-deploy monitor polls them
//! (design.md §7, seed ORCH-021) and verifies a rollback with them.
//!
//! A check never fails as a Rust error: it is a [`Check`] whose outcome tells *who* is at fault
//! (design.md §7). FAIL means the service answered badly or not at all (non-2xx, connection refused
//! or reset, no answer within the timeout); ERROR means the monitor itself could not observe
//! (a URL it cannot use, an HTTP client it cannot build); NODATA means there was nothing to
//! read. Only FAIL is evidence against the deploy.
//!
//! Probes go straight to the service (no system proxy) and read at most [`BODY_LIMIT`] bytes.

use std::time::{Duration, Instant};

use orch_domain::monitor::{Check, CheckOutcome, Reaction, Verdict, reaction};

/// The name of the health check in a poll.
pub const HEALTH_CHECK: &str = "health";
/// The name of the revision check in a poll.
pub const REVISION_CHECK: &str = "revision";
/// The most of a response body a probe reads.
pub const BODY_LIMIT: usize = 64 * 1024;
/// The most of a body quoted in a check's detail.
const DETAIL_CHARS: usize = 200;

/// What one GET found.
enum Fetched {
    /// The service answered.
    Response {
        status: u16,
        latency_ms: u64,
        body: String,
    },
    /// The service did not answer (refused, reset, timed out): its fault.
    Unreachable { latency_ms: u64, error: String },
    /// The monitor could not ask (bad URL, no HTTP client): not the service's fault.
    CannotObserve { error: String },
}

/// GETs `url` within `timeout`, reading at most [`BODY_LIMIT`] bytes of the body.
async fn fetch(url: &str, timeout: Duration) -> Fetched {
    let parsed = match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") => u,
        Ok(u) => {
            return Fetched::CannotObserve {
                error: format!("unsupported URL scheme `{}` in {url:?}", u.scheme()),
            };
        }
        Err(e) => {
            return Fetched::CannotObserve {
                error: format!("invalid URL {url:?}: {e}"),
            };
        }
    };
    let client = match client(timeout) {
        Ok(c) => c,
        Err(error) => return Fetched::CannotObserve { error },
    };
    let started = Instant::now();
    let elapsed =
        |started: Instant| u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let mut resp = match client.get(parsed).send().await {
        Ok(r) => r,
        Err(e) if e.is_builder() => {
            return Fetched::CannotObserve {
                error: format!("cannot build the request to {url}: {e}"),
            };
        }
        Err(e) => {
            return Fetched::Unreachable {
                latency_ms: elapsed(started),
                error: describe(&e, url),
            };
        }
    };
    let status = resp.status().as_u16();
    let mut body = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                let room = BODY_LIMIT.saturating_sub(body.len());
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if body.len() >= BODY_LIMIT {
                    break;
                }
            }
            Ok(None) => break,
            // The status line arrived but the body broke off: the service answered badly.
            Err(e) => {
                return Fetched::Unreachable {
                    latency_ms: elapsed(started),
                    error: format!(
                        "HTTP {status}, then the body broke off: {}",
                        describe(&e, url)
                    ),
                };
            }
        }
    }
    Fetched::Response {
        status,
        latency_ms: elapsed(started),
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// An HTTP client with `timeout` for the whole exchange, built once per timeout and shared:
/// building one loads the system's root certificates, which cost a poll about 10 ms of CPU
/// (`orch-bench watches`: 1,000 watches at 1 s needed 1.6 cores, 1.0 with the shared client).
/// It keeps no idle connection, so every check opens its own and sees the service as it is now
/// (never an old process through a kept-alive connection). reqwest is built without a default
/// TLS crypto provider and panics when none is installed (the `orch` binary installs one at
/// start); that panic is caught here and becomes an ERROR check instead of a dead worker.
pub(crate) fn client(timeout: Duration) -> Result<reqwest::Client, String> {
    static CLIENTS: std::sync::Mutex<Vec<(Duration, reqwest::Client)>> =
        std::sync::Mutex::new(Vec::new());
    if let Ok(cache) = CLIENTS.lock()
        && let Some((_, c)) = cache.iter().find(|(t, _)| *t == timeout)
    {
        return Ok(c.clone());
    }
    let built = client_uncached(timeout)?;
    if let Ok(mut cache) = CLIENTS.lock() {
        cache.push((timeout, built.clone()));
    }
    Ok(built)
}

fn client_uncached(timeout: Duration) -> Result<reqwest::Client, String> {
    let build = || {
        reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_max_idle_per_host(0)
            .no_proxy()
            .user_agent(concat!(
                "orch/",
                env!("CARGO_PKG_VERSION"),
                " post-deploy probe"
            ))
            .build()
    };
    match std::panic::catch_unwind(build) {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(format!("cannot build the HTTP client: {e}")),
        Err(_) => {
            tracing::warn!("cannot build the HTTP client: no TLS crypto provider is installed");
            Err("cannot build the HTTP client: no TLS crypto provider is installed".to_owned())
        }
    }
}

/// A short cause for a failed exchange.
fn describe(e: &reqwest::Error, url: &str) -> String {
    let what = if e.is_timeout() {
        "no answer within the timeout"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "the exchange failed"
    };
    let mut cause = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        cause = format!("{cause}: {s}");
        source = s.source();
    }
    format!("{what} ({url}): {cause}")
}

fn excerpt(body: &str) -> String {
    let trimmed = body.trim();
    let mut out: String = trimmed.chars().take(DETAIL_CHARS).collect();
    if trimmed.chars().count() > DETAIL_CHARS {
        out.push('…');
    }
    out
}

/// Checks the health endpoint once: PASS on a 2xx answer; FAIL on any other status or when
/// the service does not answer (refused, reset, timed out); ERROR when the monitor cannot ask
/// (invalid URL, no HTTP client). Records the status code and latency when there was an answer.
pub async fn check_health(url: &str, timeout: Duration) -> Check {
    let mut check = Check {
        name: HEALTH_CHECK.to_owned(),
        outcome: CheckOutcome::Error,
        status_code: None,
        latency_ms: None,
        detail: String::new(),
    };
    match fetch(url, timeout).await {
        Fetched::Response {
            status,
            latency_ms,
            body,
        } => {
            check.outcome = if (200..300).contains(&status) {
                CheckOutcome::Pass
            } else {
                CheckOutcome::Fail
            };
            check.status_code = Some(status);
            check.latency_ms = Some(latency_ms);
            check.detail = format!("HTTP {status}: {}", excerpt(&body));
        }
        Fetched::Unreachable { latency_ms, error } => {
            check.outcome = CheckOutcome::Fail;
            check.latency_ms = Some(latency_ms);
            check.detail = error;
        }
        Fetched::CannotObserve { error } => check.detail = error,
    }
    check
}

/// Reads a revision from a response body: a JSON object's `"revision"` string, or else the
/// whole body trimmed. `None` when that is empty.
fn parse_revision(body: &str) -> Option<String> {
    let trimmed = body.trim();
    let from_json = serde_json::from_str::<serde_json::Value>(trimmed)
        .ok()
        .and_then(|v| v.get("revision")?.as_str().map(|s| s.trim().to_owned()));
    let rev = from_json.unwrap_or_else(|| trimmed.to_owned());
    (!rev.is_empty()).then_some(rev)
}

/// The revision the service says is live: the body of a 2xx answer trimmed, or the
/// `"revision"` string of a JSON object. `None` when it cannot be told (no answer, non-2xx,
/// empty body) — an unknown revision, never a guessed one.
pub async fn live_revision(url: &str, timeout: Duration) -> Option<String> {
    match fetch(url, timeout).await {
        Fetched::Response { status, body, .. } if (200..300).contains(&status) => {
            parse_revision(&body)
        }
        Fetched::Response { status, .. } => {
            tracing::info!(url, status, "revision endpoint answered non-2xx");
            None
        }
        Fetched::Unreachable { error, .. } | Fetched::CannotObserve { error } => {
            tracing::info!(url, %error, "revision endpoint not readable");
            None
        }
    }
}

/// Whether `live` is the `watched` revision, by the domain's rule (equal ignoring case and
/// surrounding space, or one an abbreviation of the other of at least 7 hex digits): the same
/// rule that decides whether a FAILED watch may roll back, so confirmation and rollback agree.
pub fn revision_matches(watched: &str, live: &str) -> bool {
    reaction(Verdict::Failed, watched, Some(live)) == Reaction::Rollback
}

/// What the revision check of a poll found: the check and the live revision, when known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevisionProbe {
    /// The check for the poll.
    pub check: Check,
    /// The live revision, when the endpoint told it.
    pub live: Option<String>,
}

/// Checks the revision endpoint against `watched`: PASS when the watched revision is live;
/// ERROR when another revision is live (what the health check sees is then no evidence about
/// the watched deploy — the monitor cannot observe it any more); NODATA on an empty answer;
/// FAIL when the service answers non-2xx or not at all; ERROR when the monitor cannot ask.
pub async fn check_revision(url: &str, watched: &str, timeout: Duration) -> RevisionProbe {
    let mut check = Check {
        name: REVISION_CHECK.to_owned(),
        outcome: CheckOutcome::Error,
        status_code: None,
        latency_ms: None,
        detail: String::new(),
    };
    let mut live = None;
    match fetch(url, timeout).await {
        Fetched::Response {
            status,
            latency_ms,
            body,
        } => {
            check.status_code = Some(status);
            check.latency_ms = Some(latency_ms);
            if !(200..300).contains(&status) {
                check.outcome = CheckOutcome::Fail;
                check.detail = format!("HTTP {status}: {}", excerpt(&body));
            } else {
                match parse_revision(&body) {
                    None => {
                        check.outcome = CheckOutcome::NoData;
                        check.detail = format!("HTTP {status} with an empty revision");
                    }
                    Some(rev) if revision_matches(watched, &rev) => {
                        check.outcome = CheckOutcome::Pass;
                        check.detail = format!("live revision {}", excerpt(&rev));
                        live = Some(rev);
                    }
                    Some(rev) => {
                        check.outcome = CheckOutcome::Error;
                        check.detail = format!(
                            "live revision `{}` is not the watched `{watched}`: not evidence about the watched deploy",
                            excerpt(&rev)
                        );
                        live = Some(rev);
                    }
                }
            }
        }
        Fetched::Unreachable { latency_ms, error } => {
            check.outcome = CheckOutcome::Fail;
            check.latency_ms = Some(latency_ms);
            check.detail = error;
        }
        Fetched::CannotObserve { error } => check.detail = error,
    }
    RevisionProbe { check, live }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_are_read_from_text_or_json() {
        for (body, want) in [
            ("abc1234\n", Some("abc1234")),
            ("  {\"revision\": \" abc1234 \"}  ", Some("abc1234")),
            ("{\"rev\": 1}", Some("{\"rev\": 1}")),
            ("", None),
            ("  \n", None),
            ("{\"revision\": \"\"}", None),
        ] {
            assert_eq!(parse_revision(body).as_deref(), want, "{body:?}");
        }
    }

    #[test]
    fn revision_matching_follows_the_domain_rule() {
        let full = "0123456789abcdef0123456789abcdef01234567";
        assert!(revision_matches(full, "0123456"));
        assert!(revision_matches(full, full));
        assert!(!revision_matches(full, "012345"));
        assert!(!revision_matches(full, "fedcba9"));
        assert!(!revision_matches(full, ""));
    }

    #[tokio::test]
    async fn unusable_urls_are_the_monitors_error_not_the_services_failure() {
        for url in ["not a url", "ftp://127.0.0.1/x", ""] {
            let c = check_health(url, Duration::from_secs(1)).await;
            assert_eq!(c.outcome, CheckOutcome::Error, "{url}: {c:?}");
            assert!(!c.detail.is_empty());
            assert_eq!(live_revision(url, Duration::from_secs(1)).await, None);
        }
    }
}
