//! `GET /report`: the delivery report over a history seeded through the store (the figures
//! worked by hand in `orch_store::testing::report_history`), and bad input refused with 400
//! and a message that says what was wrong.

use std::sync::Arc;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use orch_api::*;
use orch_store::testing::{TestDb, report_history, seed_item};
use serde_json::Value;
use tower::ServiceExt;

/// 2026-12-01T00:00:00Z.
const D: i64 = 1_796_083_200_000;

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

async fn get(state: &ApiState, uri: &str) -> (StatusCode, Value) {
    let resp = app(state.clone())
        .oneshot(Request::get(uri).body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&bytes);
    crate::contract::assert_answer("GET", uri, status.as_u16(), &headers, &text);
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{uri}: not JSON ({e}): {}", String::from_utf8_lossy(&bytes)));
    (status, v)
}

/// A dashboard page: its status and HTML.
async fn page_of(state: &ApiState, uri: &str) -> (StatusCode, String) {
    let resp = app(state.clone())
        .oneshot(Request::get(uri).body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test]
async fn the_report_route_answers_the_hand_computed_figures_and_refuses_bad_input() {
    let db = TestDb::sqlite().await;
    for item in report_history(D) {
        seed_item(&db.store, &db.clock, "REP", &item).await.unwrap();
    }
    let state = ApiState::new(db.store.clone(), Arc::new(Refuse), None);
    let (status, r) = get(
        &state,
        "/report?since=2026-12-01&until=2026-12-11T00:00:00Z",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert_eq!(r["since"], "2026-12-01T00:00:00Z");
    assert_eq!(r["until_ms"], D + 10 * 86_400_000);
    let dora = &r["overall"]["dora"];
    assert_eq!(dora["deploys"], 4);
    assert_eq!(dora["change_failure_rate"], 0.5);
    assert_eq!(
        dora["lead_time_from_submission"]["median_ms"],
        4 * 3_600_000
    );
    assert_eq!(
        dora["lead_time_from_first_commit"]["median_ms"],
        2 * 3_600_000
    );
    assert_eq!(dora["time_to_restore"]["median_ms"], 1_800_000);
    let items = &r["overall"]["items"];
    assert_eq!(items["shipped"], 2);
    assert_eq!(items["cost_usd"], Value::Null, "a run's cost is unknown");
    assert_eq!(items["known_cost_usd"], 7.75);
    assert_eq!(items["known_cost_per_shipped_usd"], 3.875);
    assert_eq!(r["overall"]["staging"]["infrastructure_errors"], 3);
    assert_eq!(r["overall"]["by_agent"][1]["backend"], "codex");
    assert_eq!(r["by_repo"][1]["repo"], "b");

    // The trend: Tuesday 12-01 to Monday 12-07, then to the range's end; every deploy fell in
    // the first week.
    let weekly = r["weekly"].as_array().unwrap();
    let spans: Vec<(&str, &str, u64)> = weekly
        .iter()
        .map(|w| {
            (
                w["since"].as_str().unwrap(),
                w["until"].as_str().unwrap(),
                w["deploys"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        spans,
        [
            ("2026-12-01T00:00:00Z", "2026-12-07T00:00:00Z", 4),
            ("2026-12-07T00:00:00Z", "2026-12-11T00:00:00Z", 0)
        ]
    );
    assert_eq!(weekly[0]["change_failures"], 2);
    // Where time goes: only item A reached `merge`, at +3 h, and ended at +7 h.
    let merge = r["stage_time"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "merge")
        .unwrap_or_else(|| panic!("no merge in {}", r["stage_time"]));
    assert_eq!(merge["time"]["count"], 1);
    assert_eq!(merge["time"]["total_ms"], 4 * 3_600_000);

    // The dashboard's page of the same report.
    let page = page_of(&state, "/ui/report?since=2026-12-01&until=2026-12-11").await;
    assert_eq!(page.0, StatusCode::OK, "{}", page.1);
    for part in [
        "2026-12-01T00:00:00Z to 2026-12-11T00:00:00Z",
        "<div class=\"n\">4</div><div class=\"l\">deploys</div>",
        "<div class=\"n\">50%</div><div class=\"l\">change failure rate</div>",
        "<title>week of 2026-12-01: 4 deploys, 2 change failures</title>",
        "data-stage=\"merge\" title=\"1 items; median 4h 00m, p90 4h 00m\"",
        "<a href=\"/ui/repos/b\">b</a>",
    ] {
        assert!(page.1.contains(part), "{part} missing from:\n{}", page.1);
    }
    // An empty form field is no filter; bad input is a 400 page that says why.
    let (status, _) = page_of(&state, "/ui/report?repo=&since=&until=").await;
    assert_eq!(status, StatusCode::OK);
    for (uri, says) in [
        ("/ui/report?since=yesterday", "`yesterday` is not a time"),
        ("/ui/report?repo=%3Cscript%3Ealert(1)", "repo:"),
        ("/ui/report?limit=3", "limit"),
    ] {
        let (status, text) = page_of(&state, uri).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}");
        assert!(text.contains(says), "{uri}: {text}");
        assert!(!text.contains("<script>alert"), "{uri}: {text}");
    }

    let (status, b) = get(&state, "/report?repo=b&since=2026-12-01&until=2026-12-11").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(b["repo"], "b");
    assert_eq!(b["overall"]["dora"]["deploys"], 1);

    for (uri, says) in [
        (
            "/report?since=yesterday",
            "since: `yesterday` is not a time",
        ),
        (
            "/report?since=2026-12-11&until=2026-12-01",
            "the range is empty",
        ),
        ("/report?repo=..%2F..%2Fetc", "repo:"),
        ("/report?repo=a%27%20OR%20%271%27%3D%271", "repo:"),
        ("/report?until=2026-02-30", "until:"),
        ("/report?limit=3", "limit"),
    ] {
        let (status, e) = get(&state, uri).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}: {e}");
        let message = e["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{uri}: {message}");
    }

    // `/metrics`: the deploys of the last 24 h by repo (from +19 h to +43 h: C and D).
    db.clock.set(D + 43 * 3_600_000);
    let resp = app(state.clone())
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let m = String::from_utf8_lossy(&bytes);
    for line in [
        "orch_production_deploys{repo=\"a\"} 1\n",
        "orch_production_change_failures{repo=\"a\"} 1\n",
        "orch_production_deploys{repo=\"b\"} 1\n",
        "orch_production_change_failures{repo=\"b\"} 0\n",
    ] {
        assert!(m.contains(line), "{line:?} missing from:\n{m}");
    }
}
