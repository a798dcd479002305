//! `docs/openapi.yaml` and the router must agree: every API route in `orch_api::ROUTES` is
//! documented, every documented operation is served (a real request through `app` reaches a
//! handler, not the fallback or a 405), and the dashboard pages stay out of the document.

use std::collections::BTreeSet;
use std::sync::Arc;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use orch_api::*;
use orch_store::testing::TestDb;
use serde_json::Value;
use tower::ServiceExt;

const DOC: &str = "docs/openapi.yaml";
const TOKEN: &str = "openapi-test-token";

/// Operations that refuse everything: enough to tell a handler from the fallback.
struct Refuse;

#[async_trait]
impl Operations for Refuse {
    async fn submit(&self, _: SubmitRequest, _: &Actor) -> Result<SubmitResult, OpError> {
        Err(OpError::Invalid("refused by the test".into()))
    }
    async fn approve(&self, _: &str, _: &Actor) -> Result<(), OpError> {
        Err(OpError::Conflict("refused by the test".into()))
    }
    async fn retry(&self, _: &str, _: &Actor) -> Result<(), OpError> {
        Err(OpError::Conflict("refused by the test".into()))
    }
    async fn cancel(&self, _: &str, _: &Actor) -> Result<(), OpError> {
        Err(OpError::Conflict("refused by the test".into()))
    }
    async fn runner_counters(&self) -> Vec<RunnerCounters> {
        Vec::new()
    }
    async fn active_observations(&self) -> Vec<Observation> {
        Vec::new()
    }
    async fn artifacts(&self, _: &str) -> Result<Vec<ArtifactFile>, OpError> {
        Ok(Vec::new())
    }
}

fn document() -> Value {
    crate::contract::document().clone()
}

/// `(METHOD, path)` of every operation in the document.
fn documented(doc: &Value) -> BTreeSet<(String, String)> {
    let paths = doc["paths"].as_object().expect("paths is a map");
    let mut out = BTreeSet::new();
    for (path, item) in paths {
        for method in ["get", "put", "post", "delete", "patch", "head", "options"] {
            if item.get(method).is_some() {
                out.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    out
}

fn routed(kind: RouteKind) -> BTreeSet<(String, String)> {
    ROUTES
        .iter()
        .filter(|(_, _, k)| *k == kind)
        .map(|(m, p, _)| ((*m).to_owned(), (*p).to_owned()))
        .collect()
}

#[test]
fn the_document_is_openapi_3_with_operation_ids_and_responses() {
    let doc = document();
    assert!(
        doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")),
        "{}",
        doc["openapi"]
    );
    let mut ids = BTreeSet::new();
    for (method, path) in documented(&doc) {
        let op = &doc["paths"][&path][method.to_lowercase()];
        let id = op["operationId"].as_str().unwrap_or_default().to_owned();
        assert!(!id.is_empty(), "{method} {path} has no operationId");
        assert!(ids.insert(id.clone()), "operationId {id} is used twice");
        let responses = op["responses"].as_object().expect("responses map");
        assert!(
            responses.keys().any(|k| k.starts_with('2')),
            "{method} {path} documents no success response"
        );
        let secured = op.get("security").is_some();
        // A forge's webhook is the one mutating call authenticated by its signature instead.
        let signed = path.starts_with(orch_api::WEBHOOK_PREFIX);
        assert_eq!(
            secured,
            method != "GET" && !signed,
            "{method} {path}: mutating calls and only they need the bearer token"
        );
    }
}

#[test]
fn every_api_route_is_documented_and_every_documented_route_is_routed() {
    let doc = document();
    let docs = documented(&doc);
    let api = routed(RouteKind::Api);
    let undocumented: Vec<_> = api.difference(&docs).collect();
    let unrouted: Vec<_> = docs.difference(&api).collect();
    assert!(
        undocumented.is_empty(),
        "routes missing from {DOC}: {undocumented:?}"
    );
    assert!(
        unrouted.is_empty(),
        "documented but not in ROUTES: {unrouted:?}"
    );
    for (m, p) in routed(RouteKind::Page) {
        assert!(
            !docs.contains(&(m.clone(), p.clone())),
            "page {m} {p} is in the API document"
        );
    }
    assert!(api.len() >= 12, "{api:?}");
}

#[tokio::test]
async fn every_route_in_the_table_reaches_a_handler() {
    let db = TestDb::sqlite().await;
    let state = ApiState::new(db.store.clone(), Arc::new(Refuse), Some(TOKEN.into()));
    for (method, path, kind) in ROUTES {
        let uri = path
            .replace("{id}", "ORCH-1")
            .replace("{name}", "02-requirements.md")
            .replace("{repo}", "svc");
        let mut req = Request::builder()
            .method(*method)
            .uri(&uri)
            .header("authorization", format!("Bearer {TOKEN}"));
        let body = if *method == "POST" && uri == "/tasks" {
            req = req.header("content-type", "application/json");
            Body::from(r#"{"repo":"svc","title":"t"}"#)
        } else {
            Body::empty()
        };
        let resp = app(state.clone())
            .oneshot(req.body(body).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&bytes);
        // What every route answers, refused or served, is what the document says.
        crate::contract::assert_answer(method, &uri, status.as_u16(), &headers, &text);
        assert_ne!(
            status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {uri}: {text}"
        );
        assert!(
            !text.contains("no route for"),
            "{method} {uri} hit the fallback: {text}"
        );
        assert!(!status.is_server_error(), "{method} {uri}: {status} {text}");
        if *kind == RouteKind::Page && uri == "/" {
            assert_eq!(status, StatusCode::OK, "{text}");
        }
    }
    // An unknown path is the fallback, so the check above can fail.
    let resp = app(state)
        .oneshot(Request::get("/nope").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&bytes).contains("no route for"));
}
