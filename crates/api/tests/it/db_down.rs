//! The database goes away under a running API: every route answers 503 with the one error
//! shape and a message that says the database is unavailable (POST /tasks used to answer 500).
//! A real PostgreSQL database is created, used, then dropped with its sessions cut. (`/metrics`
//! keeps answering 200 with `orch_up 0`, the Prometheus convention for a scrape of a sick target.)

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use orch_api::*;
use orch_store::testing::{drop_database, ensure_database, pg_admin_url};
use orch_store::{ConnectOptions, NewEvent, NewJob, NewTask, Store, WorkItemSpec};
use serde_json::Value;
use tower::ServiceExt;

const TOKEN: &str = "t0k3n";

/// Operations that go to the store, as the real ones do.
struct StoreOps(Store);

impl StoreOps {
    async fn find(&self, id: &str) -> Result<(), OpError> {
        match self.0.get_task_by_work_item(id).await? {
            Some(_) => Ok(()),
            None => Err(OpError::NotFound(id.to_owned())),
        }
    }
}

#[async_trait]
impl Operations for StoreOps {
    async fn submit(&self, req: SubmitRequest, _: &Actor) -> Result<SubmitResult, OpError> {
        let task = self
            .0
            .create_task(NewTask {
                work_item: WorkItemSpec::Next {
                    prefix: "ORCH".parse().unwrap(),
                },
                repo: req
                    .repo
                    .parse()
                    .map_err(|e: orch_domain::ids::IdError| OpError::Invalid(e.to_string()))?,
                title: req.title,
                body: req.body,
                stage: "intake".parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new("task.submitted", "submitted"),
                first_job: Some(NewJob::new("analyst", "x")),
            })
            .await?;
        Ok(SubmitResult {
            work_item_id: task.work_item_id.to_string(),
            task_id: task.id,
        })
    }
    async fn approve(&self, id: &str, _: &Actor) -> Result<(), OpError> {
        self.find(id).await
    }
    async fn retry(&self, id: &str, _: &Actor) -> Result<(), OpError> {
        self.find(id).await
    }
    async fn cancel(&self, id: &str, _: &Actor) -> Result<(), OpError> {
        self.find(id).await
    }
    async fn runner_counters(&self) -> Vec<RunnerCounters> {
        Vec::new()
    }
    async fn active_observations(&self) -> Vec<Observation> {
        Vec::new()
    }
    async fn artifacts(&self, id: &str) -> Result<Vec<ArtifactFile>, OpError> {
        self.find(id).await.map(|()| Vec::new())
    }
}

async fn call(state: &ApiState, method: &str, uri: &str) -> (StatusCode, String) {
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"));
    let body = if method == "POST" && uri == "/tasks" {
        req = req.header(header::CONTENT_TYPE, "application/json");
        Body::from(r#"{"repo":"svc","title":"t","body":"b"}"#)
    } else {
        Body::empty()
    };
    // A hang guard, not a performance bound: the answer must come, not wait forever.
    let resp = tokio::time::timeout(
        Duration::from_secs(60),
        app(state.clone()).oneshot(req.body(body).unwrap()),
    )
    .await
    .unwrap_or_else(|_| panic!("{method} {uri} did not answer"))
    .unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    crate::contract::assert_answer(method, uri, status.as_u16(), &headers, &text);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_503_when_the_database_is_dropped() {
    let admin = pg_admin_url();
    let name = format!("orch_down_{}", std::process::id());
    let base = admin.rsplit_once('/').unwrap().0.to_owned();
    drop_database(&admin, &name).await.unwrap();
    ensure_database(&admin, &name).await.unwrap();
    let store = Store::connect(
        &format!("{base}/{name}"),
        ConnectOptions {
            connect_timeout: Duration::from_secs(2),
            ..ConnectOptions::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let state = ApiState::new(
        store.clone(),
        Arc::new(StoreOps(store.clone())),
        Some(TOKEN.to_owned()),
    );
    let (status, body) = call(&state, "POST", "/tasks").await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "works while the database is up: {body}"
    );
    let id: Value = serde_json::from_str(&body).unwrap();
    let id = id["work_item_id"].as_str().unwrap().to_owned();

    drop_database(&admin, &name).await.unwrap();

    let routes: Vec<(&str, String)> = ROUTES
        .iter()
        .map(|(method, path, _)| {
            let path = path
                .replace("{id}", &id)
                .replace("{name}", "01-request.md")
                .replace("{repo}", "svc");
            (*method, path)
        })
        .collect();
    assert!(routes.len() >= 14, "{routes:?}");
    for (method, uri) in routes {
        let (status, body) = call(&state, method, &uri).await;
        if uri == "/openapi.yaml" {
            continue; // a static document: it needs no database
        }
        if uri.starts_with(orch_api::WEBHOOK_PREFIX) {
            // Judged by its signature before the database is used, and this test's operations
            // have no forge (404); orch's own answers 503 for a signed delivery it cannot
            // store (`OpError::from` of the store's error).
            continue;
        }
        if uri == "/metrics" {
            // A scrape still succeeds (Prometheus convention) and says the store is down.
            assert_eq!(status, StatusCode::OK, "{body}");
            assert!(body.contains("orch_up 0"), "{body}");
            continue;
        }
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{method} {uri} with the database gone: {body}"
        );
        if uri == "/healthz" || uri == "/" || uri.starts_with("/ui/") {
            continue; // their own shapes (health JSON, HTML, Prometheus text)
        }
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("{method} {uri}: not JSON ({e}): {body}"));
        assert_eq!(
            v["error"]["code"], "store_unavailable",
            "{method} {uri}: {v}"
        );
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("unavailable") || message.contains("could not answer"),
            "{method} {uri}: {message}"
        );
    }
    store.close().await;
}
