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

use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;

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

/// Parses a probe URL: `http` or `https`, else the monitor cannot ask.
fn parse_url(url: &str) -> Result<reqwest::Url, Fetched> {
    match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") => Ok(u),
        Ok(u) => Err(Fetched::CannotObserve {
            error: format!("unsupported URL scheme `{}` in {url:?}", u.scheme()),
        }),
        Err(e) => Err(Fetched::CannotObserve {
            error: format!("invalid URL {url:?}: {e}"),
        }),
    }
}

/// Milliseconds since `started`.
fn elapsed_ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// GETs `parsed` with the shared reqwest client (TLS, redirects) within `timeout`, reading at
/// most [`BODY_LIMIT`] bytes of the body: every `https` probe, and an `http` one the service
/// redirects.
async fn fetch_with_client(parsed: reqwest::Url, url: &str, timeout: Duration) -> Fetched {
    let client = match client(timeout) {
        Ok(c) => c,
        Err(error) => return Fetched::CannotObserve { error },
    };
    let started = Instant::now();
    let mut resp = match client.get(parsed).send().await {
        Ok(r) => r,
        Err(e) if e.is_builder() => {
            return Fetched::CannotObserve {
                error: format!("cannot build the request to {url}: {e}"),
            };
        }
        Err(e) => {
            return Fetched::Unreachable {
                latency_ms: elapsed_ms(started),
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
                    latency_ms: elapsed_ms(started),
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
        latency_ms: elapsed_ms(started),
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// The checks of one poll. A plain `http` check goes out on a connection of the probe's own:
/// opened by the first check, reused by the next checks of the same poll to the same host and
/// port (health and revision are usually one service), closed when the probe is dropped. So
/// every poll still sees the service as it is now on a fresh connection (never an old process
/// through a connection kept from an earlier poll), at the cost of one TCP connection per poll
/// instead of one per check. The connection is driven inside the check's own future: no task
/// or pool per request (`orch-bench watches`: with reqwest, two connections per poll were
/// over a third of the runtime's CPU at 1,000 watches a second; a quarter now, a third of it the
/// kernel's TCP handshake). A check on a kept connection that the service closed in between is
/// asked again on a new one. `https`, and an answer that redirects, go through the shared
/// reqwest client ([`client`]), which speaks TLS and follows redirects.
pub struct Probe {
    timeout: Duration,
    conn: Option<Conn>,
}

/// An open HTTP/1.1 connection of a [`Probe`] and the future that drives it.
struct Conn {
    /// `host[:port]` as the URL gave it (the `Host` header).
    authority: String,
    sender: hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    /// Dropped when it ends (the connection is closed): only then does `sender` learn that the
    /// connection can take no more requests.
    driver: Option<std::pin::Pin<Box<Driver>>>,
}

type Driver = hyper::client::conn::http1::Connection<
    hyper_util::rt::TokioIo<tokio::net::TcpStream>,
    Empty<Bytes>,
>;

/// What one exchange on a [`Conn`] gave.
struct Answer {
    status: u16,
    /// The answer is a redirect (a 3xx with `Location`).
    redirect: bool,
    body: Vec<u8>,
    /// The body was read to its end (the connection can carry another request).
    whole: bool,
}

/// How an exchange broke.
enum Broke {
    /// Before an answer arrived (refused, reset, closed).
    Before(hyper::Error),
    /// The status line arrived, then the body broke off.
    Body { status: u16, error: hyper::Error },
}

impl Broke {
    /// What the check reports of it.
    fn describe(&self, url: &str) -> String {
        match self {
            Broke::Before(e) => format!("the exchange failed ({url}): {}", chain(e)),
            Broke::Body { status, error } => format!(
                "HTTP {status}, then the body broke off: the exchange failed ({url}): {}",
                chain(error)
            ),
        }
    }
}

impl Probe {
    /// A probe whose every check must end within `timeout` (connect, request and body).
    pub fn new(timeout: Duration) -> Probe {
        Probe {
            timeout,
            conn: None,
        }
    }

    /// [`check_health`] on this probe's connection.
    pub async fn health(&mut self, url: &str) -> Check {
        health_check(self.fetch(url).await)
    }

    /// [`check_revision`] on this probe's connection.
    pub async fn revision(&mut self, url: &str, watched: &str) -> RevisionProbe {
        revision_check(self.fetch(url).await, watched)
    }

    /// [`live_revision`] on this probe's connection.
    pub async fn live_revision(&mut self, url: &str) -> Option<String> {
        live_revision_of(url, self.fetch(url).await)
    }

    /// GETs `url` within the timeout, reading at most [`BODY_LIMIT`] bytes of the body.
    async fn fetch(&mut self, url: &str) -> Fetched {
        let parsed = match parse_url(url) {
            Ok(u) => u,
            Err(cannot) => return cannot,
        };
        // TLS, and credentials in the URL (reqwest sends them as Basic authorization), are
        // the shared client's.
        if parsed.scheme() != "http" || !parsed.username().is_empty() || parsed.password().is_some()
        {
            return fetch_with_client(parsed, url, self.timeout).await;
        }
        let Some(host) = parsed.host_str().map(str::to_owned) else {
            return Fetched::CannotObserve {
                error: format!("no host in {url:?}"),
            };
        };
        let port = parsed.port_or_known_default().unwrap_or(80);
        let authority = match parsed.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.clone(),
        };
        let target = match parsed.query() {
            Some(q) => format!("{}?{q}", parsed.path()),
            None => parsed.path().to_owned(),
        };
        let request = || {
            hyper::Request::get(target.as_str())
                .header(hyper::header::HOST, authority.as_str())
                .header(hyper::header::USER_AGENT, USER_AGENT)
                .header(hyper::header::ACCEPT, "*/*")
                .body(Empty::new())
                .map_err(|e| format!("cannot build the request to {url}: {e}"))
        };
        if let Err(error) = request() {
            return Fetched::CannotObserve { error };
        }
        let started = Instant::now();
        let exchange = async {
            // A kept connection the service has closed in the meantime is no evidence: the
            // check is asked again on a new one. An answer that arrived and then broke off is
            // the service's (reported, not asked again).
            if let Some(conn) = self.conn.as_mut().filter(|c| c.authority == authority) {
                match conn.exchange(request()?).await {
                    Ok(answer) => return Ok(answer),
                    Err(Broke::Before(_)) => {}
                    Err(broke) => return Err(broke.describe(url)),
                }
            }
            self.conn = None;
            let stream = connect(&host, port)
                .await
                .map_err(|e| format!("cannot connect ({url}): {e}"))?;
            let (sender, driver) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("the exchange failed ({url}): {}", chain(&e)))?;
            let conn = self.conn.insert(Conn {
                authority: authority.clone(),
                sender,
                driver: Some(Box::pin(driver)),
            });
            conn.exchange(request()?)
                .await
                .map_err(|broke| broke.describe(url))
        };
        let answer = match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(error)) => {
                self.conn = None;
                return Fetched::Unreachable {
                    latency_ms: elapsed_ms(started),
                    error,
                };
            }
            Err(_) => {
                self.conn = None;
                return Fetched::Unreachable {
                    latency_ms: elapsed_ms(started),
                    error: format!("no answer within the timeout ({url})"),
                };
            }
        };
        if !answer.whole {
            self.conn = None;
        }
        if answer.redirect {
            // Followed within what is left of the check's time.
            let left = self.timeout.saturating_sub(started.elapsed());
            return fetch_with_client(parsed, url, left.max(Duration::from_millis(1))).await;
        }
        Fetched::Response {
            status: answer.status,
            latency_ms: elapsed_ms(started),
            body: String::from_utf8_lossy(&answer.body).into_owned(),
        }
    }
}

impl Conn {
    /// Sends `request` and reads the answer (at most [`BODY_LIMIT`] bytes of its body) while
    /// driving the connection in this same future.
    async fn exchange(&mut self, request: hyper::Request<Empty<Bytes>>) -> Result<Answer, Broke> {
        let Conn { sender, driver, .. } = self;
        let work = async move {
            sender.ready().await.map_err(Broke::Before)?;
            let response = sender.send_request(request).await.map_err(Broke::Before)?;
            let status = response.status();
            let redirect =
                status.is_redirection() && response.headers().contains_key(hyper::header::LOCATION);
            let status = status.as_u16();
            let mut body = response.into_body();
            let mut bytes = Vec::new();
            let mut whole = true;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|error| Broke::Body { status, error })?;
                if let Ok(chunk) = frame.into_data() {
                    let room = BODY_LIMIT.saturating_sub(bytes.len());
                    bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
                    if bytes.len() >= BODY_LIMIT {
                        whole = false;
                        break;
                    }
                }
            }
            Ok(Answer {
                status,
                redirect,
                body: bytes,
                whole,
            })
        };
        tokio::pin!(work);
        loop {
            let Some(running) = driver.as_mut() else {
                return work.await;
            };
            tokio::select! {
                biased;
                answer = &mut work => return answer,
                // The connection's own work (writing the request, reading the answer); should
                // it end first, the request fails with the reason, which `work` returns.
                _ = running.as_mut() => *driver = None,
            }
        }
    }
}

/// Opens a TCP connection to `host` (a name, an IPv4 address or a bracketed IPv6 one).
async fn connect(host: &str, port: u16) -> std::io::Result<tokio::net::TcpStream> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    tokio::net::TcpStream::connect((bare, port)).await
}

/// An error and its sources, `: `-separated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out = format!("{out}: {s}");
        source = s.source();
    }
    out
}

/// The `User-Agent` of every probe.
const USER_AGENT: &str = concat!("orch/", env!("CARGO_PKG_VERSION"), " post-deploy probe");

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
            .user_agent(USER_AGENT)
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
    format!("{what} ({url}): {}", chain(e))
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
    Probe::new(timeout).health(url).await
}

fn health_check(fetched: Fetched) -> Check {
    let mut check = Check {
        name: HEALTH_CHECK.to_owned(),
        outcome: CheckOutcome::Error,
        status_code: None,
        latency_ms: None,
        detail: String::new(),
    };
    match fetched {
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

/// What one look at a URL found, for the staging runner's question "is the environment there
/// at all?": any HTTP answer (whatever its status), no answer (refused, reset, DNS, no answer
/// within the timeout), or a URL orch cannot ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// The service answered with this status.
    Answered(u16),
    /// Nothing answered: why.
    Unreachable(String),
    /// orch could not ask (an unusable URL): why. No verdict about the environment.
    CannotAsk(String),
}

/// Looks at `url` once (see [`Reach`]).
pub async fn reach(url: &str, timeout: Duration) -> Reach {
    match Probe::new(timeout).fetch(url).await {
        Fetched::Response { status, .. } => Reach::Answered(status),
        Fetched::Unreachable { error, .. } => Reach::Unreachable(error),
        Fetched::CannotObserve { error } => Reach::CannotAsk(error),
    }
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
    Probe::new(timeout).live_revision(url).await
}

fn live_revision_of(url: &str, fetched: Fetched) -> Option<String> {
    match fetched {
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
    Probe::new(timeout).revision(url, watched).await
}

fn revision_check(fetched: Fetched, watched: &str) -> RevisionProbe {
    let mut check = Check {
        name: REVISION_CHECK.to_owned(),
        outcome: CheckOutcome::Error,
        status_code: None,
        latency_ms: None,
        detail: String::new(),
    };
    let mut live = None;
    match fetched {
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
