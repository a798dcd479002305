//! orch's HTTP edge: the JSON API, Prometheus metrics and the server-rendered dashboard
//! (design.md §9). It is the only crate that knows orch's JSON shapes, all in [`dto`]: the
//! API's documents, which `orch --json` prints too.
//!
//! Invariants:
//! - Reads go to the [`Store`]; every change goes through [`Operations`], implemented by the
//!   orchestrator. This crate does not depend on the runner.
//! - Mutating calls (any method other than GET/HEAD/OPTIONS) need `Authorization: Bearer
//!   <token>`; with no token configured they are refused (403). Never open by default.
//! - Work item ids in paths are validated ([`validate_work_item_id`]) before any handler runs.
//! - Every JSON error has the shape `{"error": {"code", "message"}}`, including bad JSON, an
//!   oversized body (413), timeouts and unknown routes.

mod auth;
mod dashboard;
pub mod dto;
mod error;
mod extract;
mod id;
mod markdown;
mod metrics;
mod ops;
mod outcomes;
mod repos;
mod routes;
mod snapshot;
mod story;

use std::future::{Future, IntoFuture};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use orch_store::Store;
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutLayer};

pub use dto::{ErrorBody, ErrorDetail};
use error::AppError;
pub use id::validate_work_item_id;
pub use ops::{
    Actor, ArtifactFile, ConfigReport, Histogram, Observation, OpError, Operations, ReleaseTrack,
    RunTranscript, RunnerCounters, SeriesPoint, SubmitRequest, SubmitResult, WebhookDelivery,
    WebhookReply, WorkerTimings,
};

/// How a finished task ended, from its events (oldest first): the domain's one rule
/// ([`orch_domain::outcome::outcome_of`]) fed with the store's events. `None` in flight.
pub fn task_outcome(
    task: &orch_store::Task,
    events: &[orch_store::Event],
) -> Option<orch_domain::outcome::TaskOutcome> {
    outcomes::of(task, events)
}

/// The document of `GET /repos/{repo}/deploys` (also `orch deploys`); `None` when the repo
/// has no task.
pub async fn repo_deploys(
    store: &Store,
    repo: &str,
) -> Result<Option<dto::RepoDeploys>, orch_store::StoreError> {
    Ok(repos::read(store, repo)
        .await?
        .map(|story| dto::RepoDeploys::from(&story)))
}

/// The JSON of `orch --json demo` ([`dto::DemoReport`]): `repo`'s story when the demo ran,
/// nothing of it for `--setup-only` (`finished_in_s` `None`).
pub async fn demo_report_json(
    store: &Store,
    repo: &str,
    dir: &std::path::Path,
    config: Option<&std::path::Path>,
    finished_in_s: Option<u64>,
    lesson_seen: Option<&str>,
) -> Result<serde_json::Value, orch_store::StoreError> {
    let service = match finished_in_s {
        Some(_) => repos::read(store, repo)
            .await?
            .map(|story| dto::RepoDeploys::from(&story)),
        None => None,
    };
    let report = dto::DemoReport {
        dir: dir.display().to_string(),
        config: config.map(|c| c.display().to_string()),
        finished_in_s,
        lesson_seen: lesson_seen.map(str::to_owned),
        service,
    };
    Ok(serde_json::to_value(report).unwrap_or_default())
}

/// Largest request body accepted (64 KiB); larger bodies get 413.
/// What the control views' finished counts cover ([`orch_store::RECENT_WINDOW_MS`]): they
/// read the active part of the store, so older history is counted only in the report.
pub const FINISHED_WINDOW_LABEL: &str = "finished in the last 24 h";

pub const BODY_LIMIT: usize = orch_domain::MAX_REQUEST_BYTES;
/// Largest webhook delivery accepted (`POST /hooks/github/{repo}`): 1 MiB.
pub const WEBHOOK_BODY_LIMIT: usize = 1024 * 1024;
/// The path prefix of forge webhooks: not authenticated by the token (the forge cannot send
/// it) but by each delivery's signature, which the handler verifies before anything else.
pub const WEBHOOK_PREFIX: &str = "/hooks/github/";
/// Longest a request may take, body included, before it gets 408.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a client may take to send the request body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`serve`] waits for in-flight requests after the shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What every handler can reach. Cheap to clone.
#[derive(Clone)]
pub struct ApiState {
    /// The store, read directly by the GET routes.
    pub store: Store,
    /// The bearer token of mutating calls; `None` (or empty) refuses them all.
    pub token: Option<String>,
    /// The orchestrator's operations and in-process state.
    pub ops: Arc<dyn Operations>,
    /// When the server started (epoch ms, from the store's clock), for uptime.
    pub started_at_ms: i64,
    /// The version shown by `/healthz`, `/queue`, `/metrics` and the dashboard.
    pub version: String,
}

impl ApiState {
    /// A state starting now, with this crate's version.
    pub fn new(store: Store, ops: Arc<dyn Operations>, token: Option<String>) -> Self {
        ApiState {
            started_at_ms: store.now_ms(),
            store,
            token: token.filter(|t| !t.is_empty()),
            ops,
            version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }
}

impl std::fmt::Debug for ApiState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiState")
            .field("store", &self.store.target())
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("started_at_ms", &self.started_at_ms)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// What a route answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteKind {
    /// JSON (or the Prometheus text format): documented in `docs/openapi.yaml`.
    Api,
    /// A dashboard HTML page: not part of the OpenAPI document.
    Page,
}

/// One route the server answers: method, axum path pattern (`{id}` placeholders), kind.
pub type RouteEntry = (&'static str, &'static str, RouteKind);

/// Every route [`app`] serves, in one place, so tests can hold the OpenAPI document to it.
/// `GET /tasks/{id}` is JSON; the dashboard's task page lives at `/ui/tasks/{id}`.
pub const ROUTES: &[RouteEntry] = &[
    ("GET", "/healthz", RouteKind::Api),
    ("GET", "/queue", RouteKind::Api),
    ("GET", "/metrics", RouteKind::Api),
    ("GET", "/tasks", RouteKind::Api),
    ("POST", "/tasks", RouteKind::Api),
    ("GET", "/tasks/{id}", RouteKind::Api),
    ("GET", "/tasks/{id}/events", RouteKind::Api),
    ("GET", "/tasks/{id}/artifacts", RouteKind::Api),
    ("GET", "/tasks/{id}/artifacts/{name}", RouteKind::Api),
    ("POST", "/tasks/{id}/approve", RouteKind::Api),
    ("POST", "/tasks/{id}/retry", RouteKind::Api),
    ("POST", "/tasks/{id}/cancel", RouteKind::Api),
    ("GET", "/repos/{repo}/deploys", RouteKind::Api),
    ("GET", "/costs", RouteKind::Api),
    ("GET", "/report", RouteKind::Api),
    ("GET", "/openapi.yaml", RouteKind::Api),
    ("POST", "/hooks/github/{repo}", RouteKind::Api),
    ("GET", "/", RouteKind::Page),
    ("GET", "/ui/tasks/{id}", RouteKind::Page),
    ("GET", "/ui/repos/{repo}", RouteKind::Page),
    ("GET", "/ui/costs", RouteKind::Page),
    ("GET", "/ui/report", RouteKind::Page),
];

/// The handler of one [`ROUTES`] entry; `None` for an entry without one (a bug the route
/// table test catches).
fn handler(method: &str, path: &str) -> Option<MethodRouter<ApiState>> {
    Some(match (method, path) {
        ("GET", "/healthz") => get(routes::healthz),
        ("GET", "/queue") => get(routes::queue),
        ("GET", "/metrics") => get(routes::metrics),
        ("GET", "/tasks") => get(routes::list_tasks),
        ("POST", "/tasks") => post(routes::submit),
        ("GET", "/tasks/{id}") => get(routes::get_task),
        ("GET", "/tasks/{id}/events") => get(routes::task_events),
        ("GET", "/tasks/{id}/artifacts") => get(routes::task_artifacts),
        ("GET", "/tasks/{id}/artifacts/{name}") => get(routes::task_artifact),
        ("POST", "/tasks/{id}/approve") => post(routes::approve),
        ("POST", "/tasks/{id}/retry") => post(routes::retry),
        ("POST", "/tasks/{id}/cancel") => post(routes::cancel),
        ("GET", "/repos/{repo}/deploys") => get(routes::repo_deploys),
        ("GET", "/costs") => get(routes::costs),
        ("GET", "/report") => get(routes::report),
        ("GET", "/openapi.yaml") => get(routes::openapi),
        // A forge's deliveries can be larger than an API call (the whole issue, repository
        // and sender objects); still bounded.
        ("POST", "/hooks/github/{repo}") => {
            post(routes::github_webhook).layer(DefaultBodyLimit::max(WEBHOOK_BODY_LIMIT))
        }
        ("GET", "/") => get(dashboard::index),
        ("GET", "/ui/tasks/{id}") => get(dashboard::task_page),
        ("GET", "/ui/repos/{repo}") => get(dashboard::repo_page),
        ("GET", "/ui/costs") => get(dashboard::costs_page),
        ("GET", "/ui/report") => get(dashboard::report_page),
        _ => return None,
    })
}

/// The whole HTTP surface: JSON API, metrics, health and dashboard, with auth, limits and
/// timeouts applied. Serves exactly [`ROUTES`].
pub fn app(state: ApiState) -> Router {
    let mut router = Router::new();
    for (method, path, _) in ROUTES {
        match handler(method, path) {
            Some(h) => router = router.route(path, h),
            None => tracing::error!(method, path, "a route in ROUTES has no handler; skipped"),
        }
    }
    router
        .fallback(routes::fallback)
        .layer(RequestBodyTimeoutLayer::new(BODY_TIMEOUT))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .layer(axum::middleware::map_response(bare_errors_as_json))
        .with_state(state)
}

/// Gives error statuses produced without a body (by a layer or the router) the JSON error shape.
async fn bare_errors_as_json(resp: Response) -> Response {
    let status = resp.status();
    let is_error = status.is_client_error() || status.is_server_error();
    if !is_error || resp.headers().contains_key(header::CONTENT_TYPE) {
        return resp;
    }
    let allow = resp.headers().get(header::ALLOW).cloned();
    let mut out = AppError::from_status(status).into_response();
    if let Some(allow) = allow {
        out.headers_mut().insert(header::ALLOW, allow);
    }
    out
}

/// Why [`serve`] stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Accepting or serving connections failed.
    #[error("the HTTP server on {addr} failed: {source}")]
    Io {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// Serves [`app`] on `listener` until `shutdown` completes, then stops accepting connections
/// and waits up to [`SHUTDOWN_GRACE`] for requests in flight.
pub async fn serve<F>(
    listener: tokio::net::TcpListener,
    state: ApiState,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "an unknown address".to_owned());
    tracing::info!(%addr, token = state.token.is_some(), "HTTP API listening");
    let (stopping_tx, mut stopping_rx) = tokio::sync::watch::channel(false);
    let signal = async move {
        shutdown.await;
        let _ = stopping_tx.send(true);
    };
    // The peer address reaches the handlers: an operator call records where it came from.
    let service = app(state).into_make_service_with_connect_info::<std::net::SocketAddr>();
    let server = axum::serve(listener, service).with_graceful_shutdown(signal);
    let grace_addr = addr.clone();
    let grace_over = async move {
        let addr = grace_addr;
        if stopping_rx.wait_for(|stopping| *stopping).await.is_err() {
            // The signal future was dropped without firing: only the server can end things.
            std::future::pending::<()>().await;
        }
        tracing::info!(%addr, "HTTP API shutting down; waiting for requests in flight");
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        result = server.into_future() => result.map_err(|source| ServeError::Io { addr: addr.clone(), source })?,
        () = grace_over => {
            tracing::warn!(
                %addr,
                "HTTP API: requests still in flight after {:?}; closing them",
                SHUTDOWN_GRACE
            );
        }
    }
    tracing::info!(%addr, "HTTP API stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    async fn check(status: StatusCode, content_type: Option<&str>, want_code: Option<&str>) {
        let mut resp = Response::builder().status(status);
        if let Some(ct) = content_type {
            resp = resp.header(header::CONTENT_TYPE, ct);
        }
        let resp = bare_errors_as_json(resp.body(Body::from("original")).unwrap()).await;
        assert_eq!(resp.status(), status);
        let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        match want_code {
            Some(code) => {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(v["error"]["code"], code, "{status}");
            }
            None => assert_eq!(&body[..], b"original", "{status}"),
        }
    }

    #[tokio::test]
    async fn bare_error_statuses_get_the_json_shape() {
        for (status, ct, want) in [
            (StatusCode::REQUEST_TIMEOUT, None, Some("timeout")),
            (
                StatusCode::METHOD_NOT_ALLOWED,
                None,
                Some("method_not_allowed"),
            ),
            (
                StatusCode::PAYLOAD_TOO_LARGE,
                None,
                Some("payload_too_large"),
            ),
            (StatusCode::BAD_GATEWAY, None, Some("internal")),
            (StatusCode::NOT_FOUND, Some("text/html"), None),
            (StatusCode::OK, None, None),
        ] {
            check(status, ct, want).await;
        }
    }
}
