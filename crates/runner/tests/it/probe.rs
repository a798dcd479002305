//! The post-deploy probe's HTTP against a real loopback service speaking HTTP/1.1 the ways real
//! services do: keep-alive or not, closing a kept connection in between, chunked and oversized
//! bodies, redirects, a hung answer. What is checked: the checks of one poll share one fresh
//! connection, and nothing about a kept connection ever turns into a FAIL of the service.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use orch_domain::monitor::CheckOutcome;
use orch_runner::deploy::probe::Probe;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const REV: &str = "4f2a9c1e0b7d3a5f6e8c9b0a1d2e3f4a5b6c7d8e";

/// What the service does with one request.
#[derive(Clone)]
enum Reply {
    /// 200 with this body and `content-length`, the connection kept open.
    Ok(String),
    /// 200 with this body, then `connection: close` and the connection closed.
    OkThenClose(String),
    /// 200 with this body sent in two chunks.
    Chunked(String),
    /// A redirect to this path.
    Redirect(&'static str),
    /// The connection closed without an answer.
    Drop,
    /// No answer at all.
    Hang,
    /// 200 announcing ten bytes more than it sends, then the connection closed.
    BrokenBody,
}

/// Which reply a request gets: `(path, index of the connection, index of the request on it)`.
type Script = dyn Fn(&str, usize, usize) -> Reply + Send + Sync;

/// A loopback service run by `script`; counts its connections.
struct Service {
    base: String,
    connections: Arc<AtomicUsize>,
}

impl Service {
    async fn start(
        script: impl Fn(&str, usize, usize) -> Reply + Send + Sync + 'static,
    ) -> Service {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let connections = Arc::new(AtomicUsize::new(0));
        let script: Arc<Script> = Arc::new(script);
        let counted = connections.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let conn = counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, conn, script.clone()));
            }
        });
        Service { base, connections }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

async fn serve(mut s: tokio::net::TcpStream, conn: usize, script: Arc<Script>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    for nth in 0.. {
        let end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(k) => buf.extend_from_slice(&chunk[..k]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end);
        let mut path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
        // Basic authorization for `u:p`, as a client sends credentials from the URL.
        if head
            .to_ascii_lowercase()
            .contains("\r\nauthorization: basic dtpw\r\n")
        {
            path.push_str("+auth");
        }
        assert!(
            head.to_ascii_lowercase().contains("\r\nhost: 127.0.0.1:"),
            "every request names its host: {head}"
        );
        let reply = match script(&path, conn, nth) {
            Reply::Ok(body) => format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            ),
            Reply::OkThenClose(body) => {
                let text = format!(
                    "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(text.as_bytes()).await;
                return;
            }
            Reply::Chunked(body) => {
                let (a, b) = body.split_at(body.len() / 2);
                format!(
                    "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
                    a.len(),
                    b.len()
                )
            }
            Reply::Redirect(to) => {
                format!("HTTP/1.1 302 Found\r\nlocation: {to}\r\ncontent-length: 0\r\n\r\n")
            }
            Reply::Drop => return,
            Reply::BrokenBody => {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\nok")
                    .await;
                return;
            }
            Reply::Hang => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                return;
            }
        };
        if s.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn probe() -> Probe {
    Probe::new(Duration::from_secs(2))
}

/// The usual service: `/health` is "ok", `/revision` the watched revision.
fn usual(path: &str) -> String {
    if path == "/revision" {
        REV.to_owned()
    } else {
        "ok".to_owned()
    }
}

/// One poll of the usual service, health then revision with one probe: both pass.
async fn a_passing_poll(svc: &Service) {
    let mut p = probe();
    let health = p.health(&svc.url("/health")).await;
    assert_eq!(health.outcome, CheckOutcome::Pass, "{health:?}");
    let rev = p.revision(&svc.url("/revision"), REV).await;
    assert_eq!(rev.check.outcome, CheckOutcome::Pass, "{rev:?}");
}

#[tokio::test]
async fn the_checks_of_a_poll_share_one_connection_and_each_poll_opens_its_own() {
    let svc = Service::start(|path, _, _| Reply::Ok(usual(path))).await;
    for poll in 1..=3 {
        let mut p = probe();
        let health = p.health(&svc.url("/health")).await;
        let revision = p.revision(&svc.url("/revision"), REV).await;
        assert_eq!(health.outcome, CheckOutcome::Pass, "{health:?}");
        assert_eq!(health.status_code, Some(200));
        assert!(health.latency_ms.is_some());
        assert_eq!(revision.check.outcome, CheckOutcome::Pass, "{revision:?}");
        assert_eq!(revision.live.as_deref(), Some(REV));
        assert_eq!(
            p.live_revision(&svc.url("/revision")).await.as_deref(),
            Some(REV)
        );
        drop(p);
        assert_eq!(svc.connections(), poll, "one connection per poll");
    }
}

#[tokio::test]
async fn a_service_that_closes_the_connection_is_asked_again_on_a_new_one_never_failed() {
    // Says `connection: close` with its answer.
    let svc = Service::start(|path, _, _| Reply::OkThenClose(usual(path))).await;
    a_passing_poll(&svc).await;
    assert_eq!(svc.connections(), 2);

    // Drops a kept connection's next request without a word (an idle timeout, a restart).
    let svc = Service::start(|path, _, nth| {
        if nth == 0 {
            Reply::Ok(usual(path))
        } else {
            Reply::Drop
        }
    })
    .await;
    a_passing_poll(&svc).await;
    assert_eq!(svc.connections(), 2, "asked again on a new connection");

    // A service that drops every request fails the check: the fresh connection decides.
    let svc = Service::start(|_, _, _| Reply::Drop).await;
    let mut p = probe();
    let health = p.health(&svc.url("/health")).await;
    assert_eq!(health.outcome, CheckOutcome::Fail, "{health:?}");
    assert_eq!(health.status_code, None);
    assert!(health.detail.contains("the exchange failed"), "{health:?}");
    let rev = p.revision(&svc.url("/revision"), REV).await;
    assert_eq!(rev.check.outcome, CheckOutcome::Fail, "{rev:?}");
    assert_eq!(svc.connections(), 2, "nothing kept after a failure");
}

#[tokio::test]
async fn chunked_and_oversized_bodies_are_read_within_the_limit() {
    let big = "x".repeat(orch_runner::deploy::probe::BODY_LIMIT + 4096);
    let svc = Service::start(move |path, _, _| match path {
        "/revision" => Reply::Chunked(format!("{{\"revision\": \"{REV}\"}}")),
        "/big" => Reply::Ok(big.clone()),
        _ => Reply::Ok("ok".into()),
    })
    .await;
    let mut p = probe();
    let rev = p.revision(&svc.url("/revision"), REV).await;
    assert_eq!(rev.check.outcome, CheckOutcome::Pass, "{rev:?}");
    assert_eq!(rev.live.as_deref(), Some(REV));
    assert_eq!(svc.connections(), 1);
    let big = p.health(&svc.url("/big")).await;
    assert_eq!(big.outcome, CheckOutcome::Pass, "{big:?}");
    assert!(big.detail.ends_with('…'), "the detail quotes an excerpt");
    // the rest of that body was never read: the next check needs a new connection
    assert_eq!(
        p.health(&svc.url("/health")).await.outcome,
        CheckOutcome::Pass
    );
    assert_eq!(svc.connections(), 2);
}

#[tokio::test]
async fn a_redirect_is_followed_and_a_hung_answer_times_out() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let svc = Service::start(|path, _, _| match path {
        "/health" => Reply::Redirect("/healthz"),
        "/hang" => Reply::Hang,
        _ => Reply::Ok("ok".into()),
    })
    .await;
    let mut p = probe();
    let health = p.health(&svc.url("/health")).await;
    assert_eq!(health.outcome, CheckOutcome::Pass, "{health:?}");
    assert_eq!(
        health.status_code,
        Some(200),
        "the redirect's target answered"
    );

    let mut p = Probe::new(Duration::from_secs(1));
    assert_eq!(
        p.health(&svc.url("/healthz")).await.outcome,
        CheckOutcome::Pass
    );
    let hung = p.health(&svc.url("/hang")).await;
    assert_eq!(hung.outcome, CheckOutcome::Fail, "{hung:?}");
    assert!(
        hung.detail.contains("no answer within the timeout"),
        "{hung:?}"
    );
    assert!(hung.latency_ms.is_some_and(|ms| ms >= 900), "{hung:?}");
    // the hung connection is not reused
    let before = svc.connections();
    assert_eq!(
        p.health(&svc.url("/healthz")).await.outcome,
        CheckOutcome::Pass
    );
    assert_eq!(svc.connections(), before + 1);
}

#[tokio::test]
async fn checks_of_other_services_get_their_own_connections() {
    let a = Service::start(|path, _, _| Reply::Ok(usual(path))).await;
    let b = Service::start(|path, _, _| Reply::Ok(usual(path))).await;
    let mut p = probe();
    for _ in 0..2 {
        assert_eq!(
            p.health(&a.url("/health")).await.outcome,
            CheckOutcome::Pass
        );
        let rev = p.revision(&b.url("/revision"), REV).await;
        assert_eq!(rev.check.outcome, CheckOutcome::Pass, "{rev:?}");
    }
    // one connection is kept at a time: switching services opens a new one each time
    assert_eq!((a.connections(), b.connections()), (2, 2));
    // a bad URL never touches the kept connection
    let bad = p.health("http://[::1").await;
    assert_eq!(bad.outcome, CheckOutcome::Error, "{bad:?}");
    assert_eq!(
        p.health(&b.url("/health")).await.outcome,
        CheckOutcome::Pass
    );
    assert_eq!(b.connections(), 2, "the kept connection served it");
}

#[tokio::test]
async fn credentials_in_the_url_are_sent_and_a_broken_answer_on_a_kept_connection_fails() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let svc = Service::start(|path, _, nth| match path {
        "/health+auth" => Reply::Ok("ok".into()),
        "/health" => Reply::Ok("who are you".into()),
        _ if nth == 1 => Reply::BrokenBody,
        _ => Reply::Ok("ok".into()),
    })
    .await;
    let mut p = probe();
    let with = svc.url("/health").replace("http://", "http://u:p@");
    let health = p.health(&with).await;
    assert_eq!(health.outcome, CheckOutcome::Pass, "{health:?}");
    assert!(
        health.detail.contains("HTTP 200: ok"),
        "sent as Basic authorization: {health:?}"
    );

    // The second answer on a kept connection breaks off: the service's failure, not asked again.
    let mut p = probe();
    assert_eq!(p.health(&svc.url("/a")).await.outcome, CheckOutcome::Pass);
    let before = svc.connections();
    let broken = p.health(&svc.url("/b")).await;
    assert_eq!(broken.outcome, CheckOutcome::Fail, "{broken:?}");
    assert!(broken.detail.contains("body broke off"), "{broken:?}");
    assert_eq!(
        svc.connections(),
        before,
        "not asked again on a new connection"
    );
}
