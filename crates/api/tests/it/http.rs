//! The HTTP surface against a real migrated SQLite store: every route's status and content
//! from real rows, auth, limits, hostile ids, metrics syntax, the dashboard's escaping, and one
//! real socket to prove `serve` answers and shuts down gracefully.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode, header};
use orch_api::*;
use orch_store::testing::{T0, TestDb};
use orch_store::{
    AgentRunFinish, Claim, NewAgentRun, NewEvent, NewJob, NewTask, Store, Task, WorkItemSpec,
};
use serde_json::{Value, json};
use tower::ServiceExt;

const TOKEN: &str = "t0k3n-s3cret";

// ----- a recording Operations -----------------------------------------------------------------

#[derive(Default)]
struct Recorder {
    store: Mutex<Option<Store>>,
    calls: Mutex<Vec<String>>,
    /// Returned by the next approve/retry/cancel instead of success.
    refuse_next: Mutex<Option<OpError>>,
    counters: Vec<RunnerCounters>,
    observations: Vec<Observation>,
    artifacts: HashMap<String, Vec<ArtifactFile>>,
    series: HashMap<String, Vec<SeriesPoint>>,
    timings: WorkerTimings,
}

impl Recorder {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, call: String) -> Result<(), OpError> {
        self.calls.lock().unwrap().push(call);
        match self.refuse_next.lock().unwrap().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[async_trait]
impl Operations for Recorder {
    async fn submit(&self, req: SubmitRequest, by: &Actor) -> Result<SubmitResult, OpError> {
        self.record(format!(
            "submit {} {} {}",
            req.repo,
            req.title,
            by.describe()
        ))?;
        let store = self.store.lock().unwrap().clone().unwrap();
        let task = store
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
                event: NewEvent::new("task.submitted", "submitted over HTTP"),
                first_job: Some(NewJob::new("analyst", "analyse")),
            })
            .await?;
        Ok(SubmitResult {
            work_item_id: task.work_item_id.to_string(),
            task_id: task.id,
        })
    }

    async fn approve(&self, id: &str, by: &Actor) -> Result<(), OpError> {
        self.record(format!("approve {id} {}", by.describe()))
    }

    async fn retry(&self, id: &str, by: &Actor) -> Result<(), OpError> {
        self.record(format!("retry {id} {}", by.describe()))
    }

    async fn cancel(&self, id: &str, by: &Actor) -> Result<(), OpError> {
        self.record(format!("cancel {id} {}", by.describe()))
    }

    async fn runner_counters(&self) -> Vec<RunnerCounters> {
        self.counters.clone()
    }

    async fn active_observations(&self) -> Vec<Observation> {
        self.observations.clone()
    }

    async fn artifacts(&self, id: &str) -> Result<Vec<ArtifactFile>, OpError> {
        Ok(self.artifacts.get(id).cloned().unwrap_or_default())
    }

    async fn observation_series(&self, id: &str) -> Vec<SeriesPoint> {
        self.series.get(id).cloned().unwrap_or_default()
    }

    async fn worker_timings(&self) -> WorkerTimings {
        self.timings.clone()
    }
}

// ----- harness --------------------------------------------------------------------------------

struct Harness {
    db: TestDb,
    ops: Arc<Recorder>,
    token: Option<String>,
}

/// One HTTP answer.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text))
    }

    fn content_type(&self) -> &str {
        self.headers
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }

    /// Asserts the API's error shape and returns the code.
    fn error_code(&self) -> String {
        assert!(
            self.content_type().starts_with("application/json"),
            "error without JSON: {} {:?} {}",
            self.status,
            self.content_type(),
            self.text
        );
        let v = self.json();
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(!msg.is_empty(), "error without a message: {v}");
        assert!(!msg.contains(TOKEN), "the token leaked into {msg}");
        v["error"]["code"].as_str().unwrap().to_owned()
    }
}

fn counters() -> Vec<RunnerCounters> {
    vec![
        RunnerCounters {
            runner: "staging_runner".into(),
            counters: vec![
                ("runs".into(), 3),
                ("success".into(), 1),
                ("failed".into(), 1),
                ("tool_error".into(), 1),
                ("deferred".into(), 1),
            ],
        },
        RunnerCounters {
            runner: "we\"ird\\run\nner".into(),
            counters: vec![("x".into(), 7)],
        },
    ]
}

impl Harness {
    async fn new(token: Option<&str>) -> Harness {
        Harness::with(token, |_| {}).await
    }

    async fn with(token: Option<&str>, setup: impl FnOnce(&mut Recorder)) -> Harness {
        // SQLite, and PostgreSQL when `scripts/test` runs this file again with
        // ORCH_TEST_BACKEND=postgres.
        let db = TestDb::from_env().await;
        let mut rec = Recorder {
            counters: counters(),
            observations: vec![
                Observation {
                    work_item_id: "ORCH-7".into(),
                    repo: "svc".into(),
                    armed_at_ms: Some(T0 - 60_000),
                    deadline_ms: Some(T0 + 540_000),
                    revision: "abc123".into(),
                    polls: 2,
                    problem: None,
                },
                // A watch whose `armed` file is corrupt: its times are unknown, not invented.
                Observation {
                    work_item_id: "ORCH-8".into(),
                    repo: "svc".into(),
                    armed_at_ms: None,
                    deadline_ms: None,
                    revision: "unknown (state unreadable)".into(),
                    polls: 0,
                    problem: Some("armed unusable: not JSON".into()),
                },
            ],
            timings: WorkerTimings {
                job_seconds: vec![(
                    "analyst".into(),
                    Histogram {
                        buckets: vec![(0.1, 2), (1.0, 5)],
                        sum_seconds: 3.5,
                        count: 6,
                    },
                )],
                claim_wait: Histogram {
                    buckets: vec![(0.005, 9), (0.01, 10)],
                    sum_seconds: 0.04,
                    count: 10,
                },
                claim_query: Histogram::default(),
            },
            ..Recorder::default()
        };
        *rec.store.lock().unwrap() = Some(db.store.clone());
        setup(&mut rec);
        Harness {
            db,
            ops: Arc::new(rec),
            token: token.map(str::to_owned),
        }
    }

    fn state(&self) -> ApiState {
        ApiState::new(self.db.store.clone(), self.ops.clone(), self.token.clone())
    }

    /// The single place that calls the router.
    async fn check(&self, req: Request<Body>, want: StatusCode) -> Answer {
        let what = format!("{} {}", req.method(), req.uri());
        let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
        let resp = app(self.state()).oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        assert_eq!(status, want, "{what} answered {text}");
        // Every answer is held to docs/openapi.yaml.
        crate::contract::assert_answer(&method, &path, status.as_u16(), &headers, &text);
        Answer {
            status,
            headers,
            text,
        }
    }

    async fn get(&self, uri: &str, want: StatusCode) -> Answer {
        self.check(Request::get(uri).body(Body::empty()).unwrap(), want)
            .await
    }

    async fn get_accepting(&self, uri: &str, accept: &str, want: StatusCode) -> Answer {
        let req = Request::get(uri)
            .header(header::ACCEPT, accept)
            .body(Body::empty())
            .unwrap();
        self.check(req, want).await
    }

    async fn post(
        &self,
        uri: &str,
        token: Option<&str>,
        body: Option<&str>,
        want: StatusCode,
    ) -> Answer {
        let mut req = Request::post(uri);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let body = match body {
            Some(b) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Body::from(b.to_owned())
            }
            None => Body::empty(),
        };
        self.check(req.body(body).unwrap(), want).await
    }

    async fn task(&self, id: &str, title: &str, repo: &str, job: Option<&str>) -> Task {
        self.db
            .store
            .create_task(NewTask {
                work_item: WorkItemSpec::Exact(id.parse().unwrap()),
                repo: repo.parse().unwrap(),
                title: title.into(),
                body: "the body".into(),
                stage: "intake".parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new("task.submitted", "submitted"),
                first_job: job.map(|agent| NewJob::new(agent, "content")),
            })
            .await
            .unwrap()
    }
}

// ----- health ---------------------------------------------------------------------------------

/// How a call without connect info or a User-Agent (a test's `oneshot`) is attributed.
const NO_PEER: &str = "via the API from an unknown address with the operator token (no User-Agent)";

#[tokio::test]
async fn healthz_is_ok_then_503_when_the_store_is_closed() {
    let h = Harness::new(None).await;
    h.db.clock.advance_ms(42_000);
    let v = h.get("/healthz", StatusCode::OK).await.json();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["db"], "ok");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["schema_version"], json!(orch_store::SCHEMA_VERSION));

    let state = h.state();
    h.db.store.close().await;
    let resp = app(state)
        .oneshot(Request::get("/healthz").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["status"], "unavailable");
    assert!(v["db"].as_str().unwrap().starts_with("error: "), "{v}");

    // The other store-backed routes say so too, with the error shape.
    let a = h.get("/queue", StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(a.error_code(), "store_unavailable");
    let page = h.get("/", StatusCode::SERVICE_UNAVAILABLE).await;
    assert!(page.content_type().starts_with("text/html"));
    assert!(
        page.text.contains("the store could not answer"),
        "{}",
        page.text
    );
    let m = h.get("/metrics", StatusCode::OK).await;
    assert!(m.text.contains("\norch_up 0\n"), "{}", m.text);
    assert!(
        !m.text.contains("orch_jobs{"),
        "no store families when down"
    );
    assert!(
        m.text.contains("\norch_staging_runner_runs_total 3\n"),
        "{}",
        m.text
    );
}

// ----- queue and metrics ------------------------------------------------------------------------

/// Two tasks with analyst jobs, a delayed deployer job, one claimed job; 5 s later.
async fn busy_queue() -> (Harness, Task) {
    let h = Harness::new(None).await;
    let t1 = h.task("ORCH-1", "first", "svc", Some("analyst")).await;
    h.task("ORCH-2", "second", "web", Some("analyst")).await;
    h.db.store
        .enqueue(NewJob::new("deployer", "x").task(t1.id).delay_s(60))
        .await
        .unwrap();
    h.db.clock.advance_ms(5_000);
    let claimed =
        h.db.store
            .claim(&Claim {
                worker_id: "w1".into(),
                limit: 1,
                lease_ms: 30_000,
                kinds: vec!["analyst".into()],
                node: None,
                node_grace_ms: None,
            })
            .await
            .unwrap();
    assert_eq!(claimed.len(), 1);
    (h, t1)
}

/// The dashboard's lease table names each lease's work item (read with the leases, in one
/// query) and labels the finished counts as the recent window's.
#[tokio::test]
async fn dashboard_names_the_leased_work_item_and_the_finished_window() {
    let (h, t1) = busy_queue().await;
    let html = h.get("/", StatusCode::OK).await.text;
    let link = format!("<a href=\"/ui/tasks/{0}\">{0}</a>", t1.work_item_id);
    let leases = html
        .split("<h2>Live leases</h2>")
        .nth(1)
        .and_then(|rest| rest.split("</table>").next())
        .expect("the page has a lease table");
    assert!(
        leases.contains(&format!("<td>{link}</td>\n<td><code>analyst</code></td>")),
        "{leases}"
    );
    assert!(
        html.contains(
            "Finished work by outcome <span class=\"muted\">(finished in the last 24 h)</span>"
        ),
        "{html}"
    );
    assert!(html.contains("jobs done <span class=\"muted\">(last 24 h)</span>"));
}

#[tokio::test]
async fn queue_shows_jobs_leases_stages_counters_and_observations() {
    let (h, t1) = busy_queue().await;
    let v = h.get("/queue", StatusCode::OK).await.json();
    assert_eq!(v["now_ms"], json!(T0 + 5_000));
    assert_eq!(v["jobs"]["by_state"]["queued"], 2);
    assert_eq!(v["jobs"]["by_state"]["running"], 1);
    assert_eq!(v["jobs"]["by_state"]["done"], 0);
    assert_eq!(v["finished_window"], "finished in the last 24 h");
    assert_eq!(
        v["finished_since_ms"],
        json!(T0 + 5_000 - orch_store::RECENT_WINDOW_MS)
    );
    assert_eq!(v["jobs"]["by_agent"]["analyst"]["queued"], 1);
    assert_eq!(v["jobs"]["by_agent"]["analyst"]["running"], 1);
    assert_eq!(v["jobs"]["by_agent"]["deployer"]["queued"], 1);
    assert_eq!(v["oldest_queued_age_s"], json!(5.0));
    let leases = v["leases"].as_array().unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0]["worker"], "w1");
    assert_eq!(leases[0]["agent"], "analyst");
    assert_eq!(leases[0]["task_id"], json!(t1.id));
    assert_eq!(leases[0]["expires_at_ms"], json!(T0 + 35_000));
    assert_eq!(leases[0]["expires_in_s"], json!(30.0));
    assert_eq!(v["tasks_by_stage"]["intake"], 2);
    assert_eq!(v["runners"]["staging_runner"]["runs"], 3);
    assert_eq!(v["runners"]["staging_runner"]["deferred"], 1);
    let obs = v["active_observations"].as_array().unwrap();
    assert_eq!(obs.len(), 2);
    assert_eq!(obs[0]["work_item_id"], "ORCH-7");
    assert_eq!(obs[0]["revision"], "abc123");
    assert_eq!(obs[0]["remaining_s"], json!(535.0));
    assert_eq!(obs[0]["problem"], json!(null));
    assert_eq!(obs[1]["work_item_id"], "ORCH-8");
    assert_eq!(obs[1]["remaining_s"], json!(null), "no made-up deadline");
    assert_eq!(obs[1]["deadline_ms"], json!(null));
    assert_eq!(obs[1]["problem"], "armed unusable: not JSON");
}

#[tokio::test]
async fn queue_shows_nodes_and_takeovers() {
    let h = Harness::new(None).await;
    let t = h.task("ORCH-1", "first", "svc", Some("deployer")).await;
    h.db.store.node_seen("box-a").await.unwrap();
    h.db.clock.advance_ms(7_000);
    h.db.store.node_seen("box-b").await.unwrap();
    h.db.store
        .append_event(
            NewEvent::new("node.takeover", "node box-b took over ORCH-1's deploy job")
                .task(t.id)
                .job(9)
                .data(json!({"from": "box-a", "to": "box-b", "stage": "deploy"}).to_string()),
        )
        .await
        .unwrap();
    let v = h.get("/queue", StatusCode::OK).await.json();
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2, "{v}");
    assert_eq!(nodes[0]["node"], "box-a");
    assert_eq!(nodes[0]["last_seen_age_s"], json!(7.0));
    assert_eq!(nodes[1]["node"], "box-b");
    assert_eq!(nodes[1]["last_seen_age_s"], json!(0.0));
    let takeovers = v["takeovers"].as_array().unwrap();
    assert_eq!(takeovers.len(), 1);
    assert_eq!(takeovers[0]["from"], "box-a");
    assert_eq!(takeovers[0]["to"], "box-b");
    assert_eq!(takeovers[0]["stage"], "deploy");
    assert_eq!(takeovers[0]["job_id"], 9);
    assert_eq!(takeovers[0]["task_id"], json!(t.id));
    // A beacon is a finished job row of its own kind, never a queued or running one.
    assert_eq!(v["jobs"]["by_agent"]["node-beacon"]["done"], 2);
    let m = h.get("/metrics", StatusCode::OK).await.text;
    assert!(
        m.contains("orch_node_last_seen_age_seconds{node=\"box-a\"} 7.0"),
        "{m}"
    );
    assert!(
        m.contains("orch_node_last_seen_age_seconds{node=\"box-b\"} 0.0"),
        "{m}"
    );
}

/// One parsed exposition line: name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

/// Parses one exposition line `name{k="v",…} value` into its parts.
fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let name_ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    if !name_ok {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        rest = r;
        loop {
            if let Some(r) = rest.strip_prefix('}') {
                rest = r;
                break;
            }
            let eq = rest.find("=\"")?;
            let key = rest[..eq].trim_start_matches(',').to_owned();
            if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return None;
            }
            let mut value = String::new();
            let mut chars = rest[eq + 2..].char_indices();
            let end = loop {
                let (i, c) = chars.next()?;
                match c {
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        '\\' => value.push('\\'),
                        '"' => value.push('"'),
                        _ => return None,
                    },
                    '"' => break i,
                    '\n' => return None,
                    c => value.push(c),
                }
            };
            labels.push((key, value));
            rest = &rest[eq + 2 + end + 1..];
        }
    }
    let value = rest.strip_prefix(' ')?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name.to_owned(), labels, value))
}

#[tokio::test]
async fn metrics_follow_openmetrics_and_carry_the_queue() {
    let (h, t1) = busy_queue().await;
    for (agent, tokens, cost) in [
        ("analyst", 1_000, 0.5),
        ("analyst", 10, 0.25),
        ("dev", 7, 1.0),
    ] {
        let run =
            h.db.store
                .start_agent_run(NewAgentRun {
                    task_id: t1.id,
                    job_id: None,
                    stage: "analysis".into(),
                    agent: agent.into(),
                    backend: "command".into(),
                    model: None,
                    attempt: 1,
                })
                .await
                .unwrap();
        h.db.store
            .finish_agent_run(
                run,
                AgentRunFinish {
                    outcome: "success".into(),
                    exit_code: Some(0),
                    input_tokens: Some(tokens),
                    output_tokens: Some(tokens * 2),
                    cost_usd: Some(cost),
                    error: None,
                    data: String::new(),
                },
            )
            .await
            .unwrap();
    }
    let a = h
        .get_accepting("/metrics", OPENMETRICS_ACCEPT, StatusCode::OK)
        .await;
    assert!(
        a.content_type()
            .starts_with("application/openmetrics-text; version=1.0.0"),
        "{}",
        a.content_type()
    );
    assert!(a.text.ends_with("# EOF\n"), "{}", a.text);
    let mut samples = Vec::new();
    let mut typed = std::collections::HashSet::new();
    for line in a.text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed.insert(rest.split(' ').next().unwrap().to_owned());
            continue;
        }
        if line.starts_with("# HELP ") || line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let parsed = parse_sample(line).unwrap_or_else(|| panic!("bad exposition line {line:?}"));
        // A histogram's samples carry the family name plus _bucket, _sum or _count.
        let family = ["_bucket", "_sum", "_count", "_total", "_info"]
            .iter()
            .find_map(|sfx| parsed.0.strip_suffix(sfx))
            .filter(|f| typed.contains(*f))
            .unwrap_or(&parsed.0);
        assert!(
            typed.contains(family),
            "{} has no TYPE line before it",
            parsed.0
        );
        samples.push(parsed);
    }
    let get = |name: &str, labels: &[(&str, &str)]| -> Option<f64> {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && l.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|s| s.2)
    };
    for (name, labels, want) in [
        ("orch_up", vec![], 1.0),
        (
            "orch_build_info",
            vec![("version", env!("CARGO_PKG_VERSION"))],
            1.0,
        ),
        (
            "orch_jobs",
            vec![("agent", "analyst"), ("state", "running")],
            1.0,
        ),
        (
            "orch_jobs",
            vec![("agent", "deployer"), ("state", "queued")],
            1.0,
        ),
        ("orch_oldest_queued_job_age_seconds", vec![], 5.0),
        ("orch_live_leases", vec![("agent", "analyst")], 1.0),
        ("orch_tasks", vec![("stage", "intake")], 2.0),
        ("orch_finished_tasks", vec![("outcome", "rolled_back")], 0.0),
        ("orch_finished_tasks", vec![("outcome", "shipped")], 0.0),
        // One metric per runner counter, no generic `name` label.
        ("orch_staging_runner_tool_error_total", vec![], 1.0),
        // A hostile runner name becomes a valid metric name.
        ("orch_we_ird_run_ner_x_total", vec![], 7.0),
        ("orch_post_deploy_watches_armed", vec![("repo", "svc")], 2.0),
        (
            "orch_agent_runs_total",
            vec![("agent", "analyst"), ("outcome", "success")],
            2.0,
        ),
        (
            "orch_agent_runs_total",
            vec![("agent", "dev"), ("outcome", "success")],
            1.0,
        ),
        (
            "orch_agent_tokens_total",
            vec![("agent", "analyst"), ("direction", "input")],
            1_010.0,
        ),
        (
            "orch_agent_tokens_total",
            vec![("agent", "analyst"), ("direction", "output")],
            2_020.0,
        ),
        (
            "orch_agent_cost_usd_total",
            vec![("agent", "analyst")],
            0.75,
        ),
        ("orch_agent_cost_usd_total", vec![("agent", "dev")], 1.0),
        (
            "orch_agent_unknown_cost_runs_total",
            vec![("agent", "analyst")],
            0.0,
        ),
        (
            "orch_job_duration_seconds_bucket",
            vec![("agent", "analyst"), ("le", "0.1")],
            2.0,
        ),
        (
            "orch_job_duration_seconds_bucket",
            vec![("agent", "analyst"), ("le", "+Inf")],
            6.0,
        ),
        (
            "orch_job_duration_seconds_sum",
            vec![("agent", "analyst")],
            3.5,
        ),
        (
            "orch_job_duration_seconds_count",
            vec![("agent", "analyst")],
            6.0,
        ),
        (
            "orch_job_claim_wait_seconds_bucket",
            vec![("le", "0.005")],
            9.0,
        ),
        ("orch_job_claim_wait_seconds_count", vec![], 10.0),
        ("orch_claim_query_seconds_count", vec![], 0.0),
    ] {
        assert_eq!(
            get(name, &labels),
            Some(want),
            "{name} {labels:?} in\n{}",
            a.text
        );
    }
    for present in [
        "process_start_time_seconds",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
    ] {
        assert!(
            samples.iter().any(|s| s.0 == present),
            "{present} missing in\n{}",
            a.text
        );
    }
    assert!(
        !a.text.contains("name=\""),
        "a generic `name` label:\n{}",
        a.text
    );
    openmetrics_parser_accepts(&a.text);
}

/// `/metrics` answers what the scraper asks for: the Prometheus text format 0.0.4 by default
/// (no `Accept`, `text/plain`, OpenMetrics refused with `q=0`), OpenMetrics when `Accept` names
/// it. Both are read by the Prometheus project's reference parsers: the text format with each
/// family once (an OpenMetrics body read as 0.0.4 shows every counter twice), and the same
/// `orch_` samples with the same values in both.
#[tokio::test]
async fn metrics_speak_both_formats_by_accept_and_both_parse_the_same() {
    let (h, _) = busy_queue().await;
    for accept in [
        None,
        Some("text/plain"),
        Some("*/*"),
        Some("application/openmetrics-text;q=0, text/plain;version=0.0.4"),
    ] {
        let a = match accept {
            None => h.get("/metrics", StatusCode::OK).await,
            Some(v) => h.get_accepting("/metrics", v, StatusCode::OK).await,
        };
        assert_eq!(
            a.content_type(),
            "text/plain; version=0.0.4; charset=utf-8",
            "Accept: {accept:?}"
        );
        assert!(
            !a.text.contains("# EOF") && !a.text.contains("# UNIT"),
            "{accept:?}: OpenMetrics-only lines in\n{}",
            a.text
        );
    }
    let text = h.get("/metrics", StatusCode::OK).await.text;
    let om = h
        .get_accepting("/metrics", OPENMETRICS_ACCEPT, StatusCode::OK)
        .await;
    assert!(
        om.content_type()
            .starts_with("application/openmetrics-text")
    );
    let Some(dir) = prometheus_client_dir() else {
        return;
    };
    let parse = |module: &str, body: &str| -> Vec<Value> {
        let script = [
            "import sys, json".to_owned(),
            format!("from {module} import text_string_to_metric_families"),
            "for f in text_string_to_metric_families(sys.stdin.read()):".to_owned(),
            "    for s in f.samples:".to_owned(),
            "        print(json.dumps([f.name, f.type, s.name, sorted(s.labels.items()), s.value]))"
                .to_owned(),
        ]
        .join("\n");
        python(&dir, &script, body, &format!("{module} rejected /metrics"))
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let from_text = parse("prometheus_client.parser", &text);
    let from_om = parse("prometheus_client.openmetrics.parser", &om.text);
    // Each family once, with its samples under it (a counter's family is not also read as an
    // untyped family of its own `_total` samples).
    let mut families: HashMap<String, String> = HashMap::new();
    for s in &from_text {
        let (family, kind) = (s[0].as_str().unwrap(), s[1].as_str().unwrap());
        if let Some(seen) = families.insert(family.to_owned(), kind.to_owned()) {
            assert_eq!(seen, kind, "{family} read with two types");
        }
        assert_ne!(kind, "unknown", "{family} has no type in\n{text}");
    }
    for (family, kind) in [
        ("orch_jobs_pruned", "counter"),
        ("orch_jobs", "gauge"),
        ("orch_job_duration_seconds", "histogram"),
    ] {
        assert_eq!(
            families.get(family).map(String::as_str),
            Some(kind),
            "{families:?}"
        );
    }
    assert!(
        !families.contains_key("orch_jobs_pruned_total"),
        "a counter read twice: {families:?}"
    );
    // The same samples (this process's own figures move between scrapes: left out).
    let samples = |all: &[Value]| -> Vec<String> {
        let mut v: Vec<String> = all
            .iter()
            .filter(|s| {
                let name = s[2].as_str().unwrap();
                name.starts_with("orch_") && !name.ends_with("_created")
            })
            .map(|s| format!("{} {} {}", s[2], s[3], s[4]))
            .collect();
        v.sort();
        v
    };
    let (t, o) = (samples(&from_text), samples(&from_om));
    assert!(t.len() > 20, "{t:?}");
    assert_eq!(t, o);
}

/// The `Accept` header Prometheus's scraper sends (OpenMetrics first, the text format after).
const OPENMETRICS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// A directory on `PYTHONPATH` where the Prometheus project's Python client (its reference
/// parsers of both text formats) imports; `None` (after saying why) when it cannot be had.
fn prometheus_client_dir() -> Option<std::path::PathBuf> {
    python_package_dir(
        "py-prometheus-client",
        "import prometheus_client.openmetrics.parser, prometheus_client.parser",
        "prometheus-client>=0.20",
    )
}

/// A directory on `PYTHONPATH` where `import` works: the scratch dir `name` of the tests, with
/// `requirement` installed into it by pip when missing; `None` (after saying why) when Python
/// or pip cannot provide it.
fn python_package_dir(name: &str, import: &str, requirement: &str) -> Option<std::path::PathBuf> {
    use std::process::Command;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let importable = |dir: &std::path::Path| {
        Command::new("python3")
            .args(["-c", import])
            .env("PYTHONPATH", dir)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if importable(&dir) {
        return Some(dir);
    }
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
        ])
        .arg(&dir)
        .arg(requirement)
        .output();
    match out {
        Ok(o) if o.status.success() && importable(&dir) => Some(dir),
        Ok(o) => {
            skip(&format!(
                "pip could not install {requirement}: {}",
                String::from_utf8_lossy(&o.stderr)
            ));
            None
        }
        Err(e) => {
            skip(&format!("python3 is not runnable (for {requirement}): {e}"));
            None
        }
    }
}

/// Runs `script` under python3 with `dir` on `PYTHONPATH` and `input` on stdin: its stdout, or
/// a failed test with what it said.
fn python(dir: &std::path::Path, script: &str, input: &str, what: &str) -> String {
    use std::process::{Command, Stdio};
    let mut child = Command::new("python3")
        .args(["-c", script])
        .env("PYTHONPATH", dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(input.as_bytes()).expect("write the input");
    }
    let out = child.wait_with_output().expect("wait for python3");
    assert!(
        out.status.success(),
        "{what}: {}\n{input}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Parses the exposition with the Prometheus project's own OpenMetrics parser (the Python
/// `prometheus_client.openmetrics.parser`) and checks each family's type and unit. Skips,
/// saying why, when Python or pip cannot provide it.
fn openmetrics_parser_accepts(text: &str) {
    let Some(dir) = prometheus_client_dir() else {
        return;
    };
    let script = [
        "import sys",
        "from prometheus_client.openmetrics.parser import text_string_to_metric_families",
        "for f in text_string_to_metric_families(sys.stdin.read()):",
        "    print(f.name, f.type, f.unit or '-', len(f.samples))",
    ]
    .join("\n");
    let stdout = python(
        &dir,
        &script,
        text,
        "the OpenMetrics parser rejected /metrics",
    );
    let families: std::collections::HashMap<String, (String, String)> = stdout
        .lines()
        .filter_map(|l| {
            let mut w = l.split(' ');
            Some((
                w.next()?.to_owned(),
                (w.next()?.to_owned(), w.next()?.to_owned()),
            ))
        })
        .collect();
    for (name, kind, unit) in [
        ("orch_up", "gauge", "-"),
        ("orch_build", "info", "-"),
        ("process_start_time_seconds", "gauge", "seconds"),
        ("process_cpu_seconds", "counter", "seconds"),
        ("process_resident_memory_bytes", "gauge", "bytes"),
        ("process_open_fds", "gauge", "-"),
        ("orch_jobs", "gauge", "-"),
        ("orch_tasks", "gauge", "-"),
        ("orch_finished_tasks", "gauge", "-"),
        ("orch_agent_runs", "counter", "-"),
        ("orch_agent_tokens", "counter", "-"),
        ("orch_agent_cost_usd", "counter", "usd"),
        ("orch_agent_unknown_cost_runs", "counter", "-"),
        ("orch_staging_runner_tool_error", "counter", "-"),
        ("orch_job_duration_seconds", "histogram", "seconds"),
        ("orch_job_claim_wait_seconds", "histogram", "seconds"),
        ("orch_oldest_queued_job_age_seconds", "gauge", "seconds"),
    ] {
        assert_eq!(
            families.get(name).map(|(k, u)| (k.as_str(), u.as_str())),
            Some((kind, unit)),
            "family {name} in {families:?}"
        );
    }
    for name in families.keys() {
        assert!(
            name.starts_with("orch_") || name.starts_with("process_"),
            "{name} has no orch_/process_ prefix"
        );
    }
}

// ----- tasks --------------------------------------------------------------------------------------

#[tokio::test]
async fn task_list_filters_by_stage_repo_and_limit() {
    let h = Harness::new(None).await;
    for (id, repo) in [("ORCH-1", "svc"), ("ORCH-2", "web"), ("ORCH-3", "svc")] {
        h.task(id, &format!("title of {id}"), repo, None).await;
        h.db.clock.advance_ms(1_000);
    }
    let ids = |v: Value| -> Vec<String> {
        v["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["work_item_id"].as_str().unwrap().to_owned())
            .collect()
    };
    for (uri, want) in [
        ("/tasks", vec!["ORCH-3", "ORCH-2", "ORCH-1"]),
        ("/tasks?repo=svc", vec!["ORCH-3", "ORCH-1"]),
        ("/tasks?stage=intake&limit=2", vec!["ORCH-3", "ORCH-2"]),
        ("/tasks?stage=done", vec![]),
        ("/tasks?limit=1&offset=2", vec!["ORCH-1"]),
    ] {
        let v = h.get(uri, StatusCode::OK).await.json();
        assert_eq!(v["count"], json!(want.len()), "{uri}");
        assert_eq!(ids(v), want, "{uri}");
    }
    let v = h.get("/tasks?repo=web", StatusCode::OK).await.json();
    let t = &v["tasks"][0];
    assert_eq!(t["title"], "title of ORCH-2");
    assert_eq!(t["stage"], "intake");
    assert_eq!(t["branch"], "orch/ORCH-2");
    assert_eq!(t["terminal"], false);
    assert_eq!(t["created_at_ms"], json!(T0 + 1_000));

    for uri in [
        "/tasks?limit=0",
        "/tasks?limit=5000",
        "/tasks?limit=abc",
        "/tasks?bogus=1",
    ] {
        let a = h.get(uri, StatusCode::BAD_REQUEST).await;
        assert_eq!(a.error_code(), "bad_request", "{uri}");
    }
}

#[tokio::test]
async fn task_detail_has_usage_agent_runs_and_jobs() {
    let h = Harness::new(None).await;
    let t = h.task("ORCH-5", "detail", "svc", Some("analyst")).await;
    for (tokens, cost) in [(1000, 0.5), (200, 0.25)] {
        let run =
            h.db.store
                .start_agent_run(NewAgentRun {
                    task_id: t.id,
                    job_id: None,
                    stage: "analysis".into(),
                    agent: "analyst".into(),
                    backend: "command".into(),
                    model: Some("claude-x".into()),
                    attempt: 1,
                })
                .await
                .unwrap();
        h.db.clock.advance_ms(2_000);
        h.db.store
            .finish_agent_run(
                run,
                AgentRunFinish {
                    outcome: "success".into(),
                    exit_code: Some(0),
                    input_tokens: Some(tokens),
                    output_tokens: Some(tokens / 10),
                    cost_usd: Some(cost),
                    error: None,
                    data: r#"{"turns":3}"#.into(),
                },
            )
            .await
            .unwrap();
    }
    let v = h.get("/tasks/ORCH-5", StatusCode::OK).await.json();
    assert_eq!(v["task"]["work_item_id"], "ORCH-5");
    assert_eq!(v["task"]["body"], "the body");
    assert_eq!(v["usage"]["runs"], 2);
    assert_eq!(v["usage"]["input_tokens"], 1200);
    assert_eq!(v["usage"]["output_tokens"], 120);
    assert_eq!(v["usage"]["cost_usd"], json!(0.75));
    assert_eq!(v["usage"]["known_cost_usd"], json!(0.75));
    assert_eq!(v["usage"]["unknown_cost_runs"], 0);
    let runs = v["agent_runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["model"], "claude-x");
    assert_eq!(runs[0]["input_tokens"], 1000);
    assert_eq!(runs[0]["finished_at_ms"], json!(T0 + 2_000));
    assert_eq!(runs[0]["data"]["turns"], 3);
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0]["agent"], "analyst");
    assert_eq!(jobs[0]["state"], "queued");
    let events = v["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["kind"], "task.submitted");
    assert_eq!(events[0]["stage"], "intake");

    let a = h.get("/tasks/ORCH-6", StatusCode::NOT_FOUND).await;
    assert_eq!(a.error_code(), "not_found");
}

/// Regression (issue 30): a run whose cost is unknown (a `command` agent reports none) made
/// the API say `cost_usd: 0.75` and `orch status` `$0.7500` while the task page's run said
/// "unknown". Now the total is unknown everywhere: `null` in the API (with the known part and
/// the count of runs it leaves out), the same words on the task page, and on `/metrics`.
#[tokio::test]
async fn an_unknown_cost_makes_the_total_unknown_in_the_api_the_page_and_metrics() {
    let h = Harness::new(None).await;
    let t = h
        .task("ORCH-5", "unknown cost", "svc", Some("analyst"))
        .await;
    for cost in [Some(0.5), Some(0.25), None] {
        let run =
            h.db.store
                .start_agent_run(NewAgentRun {
                    task_id: t.id,
                    job_id: None,
                    stage: "analysis".into(),
                    agent: "analyst".into(),
                    backend: "command".into(),
                    model: None,
                    attempt: 1,
                })
                .await
                .unwrap();
        h.db.store
            .finish_agent_run(
                run,
                AgentRunFinish {
                    outcome: "ok".into(),
                    exit_code: Some(0),
                    cost_usd: cost,
                    data: "{}".into(),
                    ..AgentRunFinish::default()
                },
            )
            .await
            .unwrap();
    }
    let v = h.get("/tasks/ORCH-5", StatusCode::OK).await.json();
    assert_eq!(v["usage"]["cost_usd"], Value::Null, "{v}");
    assert_eq!(v["usage"]["known_cost_usd"], json!(0.75), "{v}");
    assert_eq!(v["usage"]["unknown_cost_runs"], 1, "{v}");
    assert_eq!(v["agent_runs"][2]["cost_usd"], Value::Null, "{v}");
    let page = h.get("/ui/tasks/ORCH-5", StatusCode::OK).await.text;
    assert!(
        page.contains("cost <b>unknown (1 of 3 runs; $0.7500 known)</b>"),
        "{page}"
    );
    assert!(!page.contains("cost <b>$"), "{page}");
    let metrics = h.get("/metrics", StatusCode::OK).await.text;
    assert!(
        metrics.contains("orch_agent_unknown_cost_runs_total{agent=\"analyst\"} 1"),
        "{metrics}"
    );
    // The cost report: per repo, stage and day, the unknown run counted, never a zero.
    let c = h.get("/costs", StatusCode::OK).await.json();
    for group in ["by_repo", "by_stage", "by_day"] {
        let g = &c[group];
        assert_eq!(g.as_array().map(Vec::len), Some(1), "{c}");
        assert_eq!(g[0]["usage"]["runs"], 3, "{c}");
        assert_eq!(g[0]["usage"]["cost_usd"], Value::Null, "{c}");
        assert_eq!(g[0]["usage"]["known_cost_usd"], json!(0.75), "{c}");
        assert_eq!(g[0]["usage"]["unknown_cost_runs"], 1, "{c}");
    }
    assert_eq!(
        (&c["by_repo"][0]["key"], &c["by_stage"][0]["key"]),
        (&json!("svc"), &json!("analysis"))
    );
    let day = c["by_day"][0]["key"].as_str().unwrap_or_default();
    let today = orch_domain::text::rfc3339_utc(h.db.store.now_ms());
    assert_eq!(day, &today[..10], "{c}");
    assert_eq!(c["total"]["unknown_cost_runs"], 1, "{c}");
    let page = h.get("/ui/costs", StatusCode::OK).await.text;
    assert!(
        page.contains("<td>svc</td>")
            && page.contains("<span class=\"err\">unknown (1 of 3 runs; $0.7500 known)</span>"),
        "{page}"
    );
}

#[tokio::test]
async fn task_events_are_oldest_first_with_their_data() {
    let h = Harness::new(None).await;
    let t = h.task("ORCH-9", "events", "svc", None).await;
    h.db.clock.advance_ms(1_000);
    h.db.store
        .append_event(
            NewEvent::new("gate.passed", "requirements are valid")
                .task(t.id)
                .stage("analysis")
                .data(r#"{"artifact":"02-requirements.md"}"#),
        )
        .await
        .unwrap();
    let v = h.get("/tasks/ORCH-9/events", StatusCode::OK).await.json();
    assert_eq!(v["work_item_id"], "ORCH-9");
    let ev = v["events"].as_array().unwrap();
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0]["kind"], "task.submitted");
    assert_eq!(ev[1]["kind"], "gate.passed");
    assert_eq!(ev[1]["stage"], "analysis");
    assert_eq!(ev[1]["message"], "requirements are valid");
    assert_eq!(ev[1]["data"]["artifact"], "02-requirements.md");
    assert_eq!(ev[1]["created_at_ms"], json!(T0 + 1_000));
    h.get("/tasks/ORCH-10/events", StatusCode::NOT_FOUND).await;
}

#[tokio::test]
async fn task_artifacts_come_from_operations() {
    let h = Harness::with(None, |r| {
        r.artifacts.insert(
            "ORCH-3".into(),
            vec![ArtifactFile {
                name: "01-request.md".into(),
                content: "---\nwork_item: ORCH-3\n---\nhello".into(),
            }],
        );
    })
    .await;
    h.task("ORCH-3", "arts", "svc", None).await;
    let v = h
        .get("/tasks/ORCH-3/artifacts", StatusCode::OK)
        .await
        .json();
    assert_eq!(v["work_item_id"], "ORCH-3");
    assert_eq!(v["artifacts"][0]["name"], "01-request.md");
    assert_eq!(
        v["artifacts"][0]["content"],
        "---\nwork_item: ORCH-3\n---\nhello"
    );
    assert_eq!(v["artifacts"][0]["bytes"], 31);
    h.get("/tasks/ORCH-4/artifacts", StatusCode::NOT_FOUND)
        .await;
}

#[tokio::test]
async fn one_artifact_by_name_and_hostile_names_are_400() {
    let h = Harness::with(None, |r| {
        r.artifacts.insert(
            "ORCH-3".into(),
            vec![ArtifactFile {
                name: "02-requirements.md".into(),
                content: "---\nwork_item: ORCH-3\n---\nreqs".into(),
            }],
        );
    })
    .await;
    h.task("ORCH-3", "arts", "svc", None).await;
    let v = h
        .get("/tasks/ORCH-3/artifacts/02-requirements.md", StatusCode::OK)
        .await
        .json();
    assert_eq!(v["name"], "02-requirements.md");
    assert_eq!(v["content"], "---\nwork_item: ORCH-3\n---\nreqs");
    let a = h
        .get(
            "/tasks/ORCH-3/artifacts/03-design.md",
            StatusCode::NOT_FOUND,
        )
        .await;
    assert_eq!(a.error_code(), "not_found");
    let a = h
        .get(
            "/tasks/ORCH-9/artifacts/02-requirements.md",
            StatusCode::NOT_FOUND,
        )
        .await;
    assert_eq!(a.error_code(), "not_found");
    for name in [
        "..%2F..%2Fetc%2Fpasswd",
        "%2E%2E",
        "02-requirements.md%00",
        "requirements.md",
        "02-Requirements.md",
        "02-req.txt",
        "02-.md",
        "2-x.md",
        "02-a%2Fb.md",
        "02-a%5Cb.md",
    ] {
        let a = h
            .get(
                &format!("/tasks/ORCH-3/artifacts/{name}"),
                StatusCode::BAD_REQUEST,
            )
            .await;
        assert_eq!(a.error_code(), "invalid_name", "{name}");
    }
    let a = h
        .get(
            "/tasks/orch-3/artifacts/02-requirements.md",
            StatusCode::BAD_REQUEST,
        )
        .await;
    assert_eq!(a.error_code(), "invalid_id");
}

// ----- submit, auth, limits -----------------------------------------------------------------------

#[tokio::test]
async fn submit_creates_a_task_with_the_right_token_only() {
    let h = Harness::new(Some(TOKEN)).await;
    let body = r#"{"repo":"svc","title":"  add a login page ","body":"details"}"#;
    for (token, want, code) in [
        (None, StatusCode::UNAUTHORIZED, "unauthorized"),
        (Some("wrong"), StatusCode::UNAUTHORIZED, "unauthorized"),
        (
            Some("t0k3n-s3cre"),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
    ] {
        let a = h.post("/tasks", token, Some(body), want).await;
        assert_eq!(a.error_code(), code);
        assert_eq!(a.headers.get(header::WWW_AUTHENTICATE).unwrap(), "Bearer");
    }
    assert!(
        h.ops.calls().is_empty(),
        "refused calls never reach the orchestrator"
    );

    let a = h
        .post("/tasks", Some(TOKEN), Some(body), StatusCode::CREATED)
        .await;
    let v = a.json();
    assert_eq!(v["work_item_id"], "ORCH-1");
    assert_eq!(a.headers.get(header::LOCATION).unwrap(), "/tasks/ORCH-1");
    assert_eq!(v["task"]["title"], "add a login page");
    assert_eq!(v["task"]["stage"], "intake");
    assert_eq!(
        h.ops.calls(),
        vec![format!("submit svc add a login page {NO_PEER}")]
    );
    let stored =
        h.db.store
            .get_task_by_work_item("ORCH-1")
            .await
            .unwrap()
            .unwrap();
    assert_eq!(stored.id, v["task_id"].as_i64().unwrap());
    assert_eq!(stored.body, "details");
}

#[tokio::test]
async fn without_a_configured_token_mutating_calls_are_refused() {
    for configured in [None, Some("")] {
        let h = Harness::new(configured).await;
        h.task("ORCH-1", "t", "svc", None).await;
        for uri in ["/tasks", "/tasks/ORCH-1/approve", "/tasks/ORCH-1/cancel"] {
            let a = h
                .post(
                    uri,
                    Some(""),
                    Some(r#"{"repo":"svc","title":"x"}"#),
                    StatusCode::FORBIDDEN,
                )
                .await;
            assert_eq!(a.error_code(), "no_token_configured");
            assert!(
                a.json()["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("token")
            );
        }
        assert!(h.ops.calls().is_empty());
        // Reads stay open.
        h.get("/tasks", StatusCode::OK).await;
    }
}

#[tokio::test]
async fn bad_bodies_get_the_json_error_shape() {
    let h = Harness::new(Some(TOKEN)).await;
    let big = format!(
        r#"{{"repo":"svc","title":"big","body":"{}"}}"#,
        "x".repeat(BODY_LIMIT + 1)
    );
    let title_201 = "x".repeat(201);
    let long_title = format!(r#"{{"repo":"svc","title":"{title_201}"}}"#);
    for (body, want, code) in [
        (
            big.as_str(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        ("{not json", StatusCode::BAD_REQUEST, "bad_json"),
        (
            r#"{"repo":"svc","title":"a","#,
            StatusCode::BAD_REQUEST,
            "bad_json",
        ),
        (
            r#"{"repo":"svc"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_json",
        ),
        (
            r#"{"repo":1,"title":"a"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_json",
        ),
        (
            r#"{"repo":"svc","title":"a","extra":1}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_json",
        ),
        // serde would say "expected struct SubmitBody".
        (
            "\"a string\"",
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_json",
        ),
        ("[1, 2]", StatusCode::UNPROCESSABLE_ENTITY, "invalid_json"),
        (
            r#"{"repo":"svc","title":"   "}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
        ),
        (
            r#"{"repo":"../etc","title":"a"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
        ),
        (
            r#"{"repo":"svc","title":"a\nb"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
        ),
        (
            long_title.as_str(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
        ),
    ] {
        let a = h.post("/tasks", Some(TOKEN), Some(body), want).await;
        assert_eq!(a.error_code(), code, "{}", &body[..body.len().min(60)]);
        let message = a.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            !message.contains("struct") && !message.contains("SubmitBody"),
            "a Rust type in {message:?}"
        );
    }
    // No content type.
    let req = Request::post("/tasks")
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .body(Body::from(r#"{"repo":"svc","title":"a"}"#))
        .unwrap();
    let a = h.check(req, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
    assert_eq!(a.error_code(), "unsupported_media_type");
    // A body streamed without a length is limited too.
    let chunks = unsized_body(BODY_LIMIT * 2);
    let req = Request::post("/tasks")
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(chunks)
        .unwrap();
    let a = h.check(req, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert_eq!(a.error_code(), "payload_too_large");
    assert!(h.ops.calls().is_empty(), "{:?}", h.ops.calls());
}

/// A body of `n` bytes in 1 KiB chunks, with no known length.
fn unsized_body(n: usize) -> Body {
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..n / 1024).map(|_| Ok(vec![b' '; 1024])).collect();
    Body::from_stream(futures::stream::iter(chunks))
}

#[tokio::test]
async fn hostile_work_item_ids_are_refused_before_any_handler() {
    let h = Harness::new(Some(TOKEN)).await;
    h.task("ORCH-1", "t", "svc", None).await;
    for id in [
        "..%2F..%2Fetc%2Fpasswd",
        "..",
        "orch-1",
        "ORCH-01",
        "ORCH-1%00",
        "ORCH-1%0Ax",
        "%E2%80%AEORCH-1",
        "ORCH-1;rm",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA-1",
        "%3Cscript%3E-1",
        // Not UTF-8 once decoded: refused by the path extractor itself.
        "ORCH-%FF",
    ] {
        for suffix in ["", "/events", "/artifacts"] {
            let a = h
                .get(&format!("/tasks/{id}{suffix}"), StatusCode::BAD_REQUEST)
                .await;
            assert_eq!(a.error_code(), "invalid_id", "{id}{suffix}");
            assert!(
                a.json()["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("PREFIX-NUMBER")
                    || id == "ORCH-%FF",
                "{}",
                a.text
            );
        }
        for action in ["approve", "retry", "cancel"] {
            let a = h
                .post(
                    &format!("/tasks/{id}/{action}"),
                    Some(TOKEN),
                    None,
                    StatusCode::BAD_REQUEST,
                )
                .await;
            assert_eq!(a.error_code(), "invalid_id");
        }
        let page = h
            .get(&format!("/ui/tasks/{id}"), StatusCode::BAD_REQUEST)
            .await;
        assert!(page.content_type().starts_with("text/html"));
        assert_eq!(page.text.matches("<script").count(), 1, "{}", page.text);
    }
    // Unencoded traversal never reaches a handler: no route matches.
    let a = h
        .get("/tasks/../../etc/passwd", StatusCode::NOT_FOUND)
        .await;
    assert_eq!(a.error_code(), "not_found");
    assert!(h.ops.calls().is_empty());
}

#[tokio::test]
async fn actions_reach_operations_and_map_their_errors() {
    let h = Harness::new(Some(TOKEN)).await;
    h.task("ORCH-4", "t", "svc", None).await;
    for action in ["approve", "retry", "cancel"] {
        let v = h
            .post(
                &format!("/tasks/ORCH-4/{action}"),
                Some(TOKEN),
                None,
                StatusCode::OK,
            )
            .await
            .json();
        assert_eq!(v["action"], action);
        assert_eq!(v["work_item_id"], "ORCH-4");
        assert_eq!(v["task"]["stage"], "intake");
    }
    assert_eq!(
        h.ops.calls(),
        ["approve", "retry", "cancel"].map(|a| format!("{a} ORCH-4 {NO_PEER}"))
    );

    for (err, want, code) in [
        (
            OpError::Conflict("not waiting for approval".into()),
            StatusCode::CONFLICT,
            "conflict",
        ),
        (
            OpError::NotFound("gone".into()),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            OpError::Invalid("nope".into()),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid",
        ),
        (
            OpError::Internal("disk on fire".into()),
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
        ),
        (
            OpError::Unavailable("connection refused".into()),
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
        ),
        (
            OpError::Unauthorized("the signature does not match".into()),
            StatusCode::UNAUTHORIZED,
            "bad_signature",
        ),
    ] {
        *h.ops.refuse_next.lock().unwrap() = Some(err.clone());
        let a = h
            .post("/tasks/ORCH-4/approve", Some(TOKEN), None, want)
            .await;
        assert_eq!(a.error_code(), code);
        let msg = a.json()["error"]["message"].as_str().unwrap().to_owned();
        let inner = match &err {
            OpError::NotFound(m)
            | OpError::Conflict(m)
            | OpError::Invalid(m)
            | OpError::Internal(m)
            | OpError::Unauthorized(m)
            | OpError::Unavailable(m) => m,
        };
        assert!(msg.contains(inner.as_str()), "{msg}");
    }

    // An unknown work item is a 404 and never reaches the orchestrator.
    let before = h.ops.calls().len();
    let a = h
        .post(
            "/tasks/ORCH-99/approve",
            Some(TOKEN),
            None,
            StatusCode::NOT_FOUND,
        )
        .await;
    assert_eq!(a.error_code(), "not_found");
    assert_eq!(h.ops.calls().len(), before);
}

#[tokio::test]
async fn unknown_routes_and_methods_get_json_errors() {
    let h = Harness::new(Some(TOKEN)).await;
    let a = h.get("/api/nope", StatusCode::NOT_FOUND).await;
    assert_eq!(a.error_code(), "not_found");
    let a = h
        .get("/tasks/ORCH-1/approve", StatusCode::METHOD_NOT_ALLOWED)
        .await;
    assert_eq!(a.error_code(), "method_not_allowed");
    assert!(a.headers.contains_key(header::ALLOW));
    let a = h
        .post("/queue", Some(TOKEN), None, StatusCode::METHOD_NOT_ALLOWED)
        .await;
    assert_eq!(a.error_code(), "method_not_allowed");
    // A mutating method on an unknown route still needs the token.
    let a = h
        .post("/api/nope", None, None, StatusCode::UNAUTHORIZED)
        .await;
    assert_eq!(a.error_code(), "unauthorized");
}

#[tokio::test]
async fn state_debug_never_shows_the_token() {
    let h = Harness::new(Some(TOKEN)).await;
    let shown = format!("{:?}", h.state());
    assert!(!shown.contains(TOKEN), "{shown}");
    assert!(shown.contains("redacted"), "{shown}");
}

// ----- dashboard ------------------------------------------------------------------------------------

#[tokio::test]
async fn dashboard_shows_real_data_and_escapes_it() {
    let h = Harness::with(None, |r| {
        r.artifacts.insert(
            "ORCH-2".into(),
            vec![ArtifactFile {
                name: "02-requirements.md".into(),
                content: "---\nstatus: ok\n---\n<script>alert('art')</script> & more".into(),
            }],
        );
    })
    .await;
    h.task("ORCH-1", "plain task", "svc", Some("analyst")).await;
    let t2 = h
        .task(
            "ORCH-2",
            "<script>alert(1)</script>",
            "svc",
            Some("developer"),
        )
        .await;
    let run =
        h.db.store
            .start_agent_run(NewAgentRun {
                task_id: t2.id,
                job_id: None,
                stage: "implementation".into(),
                agent: "developer".into(),
                backend: "command".into(),
                model: Some("gpt-x".into()),
                attempt: 1,
            })
            .await
            .unwrap();
    h.db.clock.advance_ms(65_000);
    h.db.store
        .finish_agent_run(
            run,
            AgentRunFinish {
                outcome: "success".into(),
                exit_code: Some(0),
                input_tokens: Some(12345),
                output_tokens: Some(678),
                cost_usd: Some(1.25),
                error: None,
                data: String::new(),
            },
        )
        .await
        .unwrap();
    h.db.store
        .append_event(
            NewEvent::new("note", "<b>bold</b> claim")
                .task(t2.id)
                .stage("intake"),
        )
        .await
        .unwrap();

    let page = h.get("/", StatusCode::OK).await;
    assert!(page.content_type().starts_with("text/html"));
    let html = &page.text;
    for want in [
        "data-live",
        "href=\"/ui/tasks/ORCH-1\"",
        "href=\"/ui/tasks/ORCH-2\"",
        "plain task",
        "staging_runner",
        "tool_error",
        "ORCH-7",
        "abc123",
        "analyst",
        "developer",
    ] {
        assert!(html.contains(want), "index lacks {want:?}:\n{html}");
    }
    assert!(has_escaped(html, "<script>alert(1)</script>"), "{html}");
    assert!(
        !html.contains("<script>alert"),
        "unescaped script in:\n{html}"
    );
    assert_eq!(
        html.matches("<script").count(),
        1,
        "only the page's own script"
    );
    assert!(!html.contains("http-equiv=\"refresh\""));
    assert!(
        !html.contains("<link") && !html.contains("src=\"http"),
        "external assets"
    );

    let page = h.get("/ui/tasks/ORCH-2", StatusCode::OK).await;
    let html = &page.text;
    for want in [
        "ORCH-2",
        "task.submitted",
        "12345",
        "678",
        "$1.2500",
        "gpt-x",
        "1m 05s",
        "02-requirements.md",
        "orch/ORCH-2",
    ] {
        assert!(html.contains(want), "task page lacks {want:?}:\n{html}");
    }
    for raw in [
        "<script>alert(1)</script>",
        "<b>bold</b> claim",
        "<script>alert('art')</script> & more",
    ] {
        assert!(has_escaped(html, raw), "{raw:?} is not escaped in:\n{html}");
    }
    assert!(
        !html.contains("<script>alert") && !html.contains("<b>bold"),
        "unescaped:\n{html}"
    );

    let page = h.get("/?stage=intake", StatusCode::OK).await;
    assert!(page.text.contains("at stage"));
    let page = h.get("/ui/tasks/ORCH-3", StatusCode::NOT_FOUND).await;
    assert!(page.text.contains("no task for work item ORCH-3"));
}

/// True when `html` holds `raw` HTML-escaped (named or numeric entities).
fn has_escaped(html: &str, raw: &str) -> bool {
    let escape = |named: bool| {
        let mut out = String::new();
        for c in raw.chars() {
            match (c, named) {
                ('<', true) => out.push_str("&lt;"),
                ('>', true) => out.push_str("&gt;"),
                ('&', true) => out.push_str("&amp;"),
                ('<' | '>' | '&' | '"' | '\'', _) => out.push_str(&format!("&#{};", c as u32)),
                (c, _) => out.push(c),
            }
        }
        out
    };
    html.contains(&escape(true)) || html.contains(&escape(false))
}

// ----- a real socket ---------------------------------------------------------------------------------

#[tokio::test]
async fn serve_answers_on_a_real_socket_and_shuts_down_gracefully() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let h = Harness::new(Some(TOKEN)).await;
    h.task("ORCH-1", "over the wire", "svc", None).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, h.state(), async move {
        let _ = stop_rx.await;
    }));

    let request = |req: String| async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    };
    let resp = request(format!(
        "GET /tasks/ORCH-1 HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    ))
    .await;
    assert!(resp.starts_with("HTTP/1.1 200 OK\r\n"), "{resp}");
    assert!(resp.contains("\"title\":\"over the wire\""), "{resp}");
    let body = r#"{"repo":"svc","title":"via socket"}"#;
    let resp = request(format!(
        "POST /tasks HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ))
    .await;
    assert!(resp.starts_with("HTTP/1.1 201 Created\r\n"), "{resp}");

    // An idle keep-alive connection must not hold the shutdown up.
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    idle.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = idle.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200 OK"));

    stop_tx.send(()).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("serve stops promptly after the signal")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the listener is closed"
    );
}

#[tokio::test]
async fn dashboard_draws_pipelines_loops_and_watch_charts() {
    let h = Harness::with(None, |r| {
        r.series.insert(
            "ORCH-7".into(),
            vec![
                SeriesPoint {
                    at_ms: T0 - 30_000,
                    status: "PASS".into(),
                    value: Some(120.0),
                },
                SeriesPoint {
                    at_ms: T0 - 15_000,
                    status: "FAIL".into(),
                    value: Some(480.0),
                },
                SeriesPoint {
                    at_ms: T0,
                    status: "NODATA".into(),
                    value: None,
                },
            ],
        );
    })
    .await;
    let t1 = h.task("ORCH-1", "loops", "svc", None).await;
    // Move ORCH-1 to implementation, loop back to analysis once, then on again.
    for (kind, stage) in [
        ("stage.advanced", "analysis"),
        ("stage.advanced", "implementation"),
        ("stage.loop_back", "analysis"),
        ("stage.advanced", "implementation"),
    ] {
        h.db.store
            .append_event(NewEvent::new(kind, "moved").task(t1.id).stage(stage))
            .await
            .unwrap();
    }
    let t7 = h.task("ORCH-7", "watched", "svc", None).await;
    h.db.store
        .append_event(
            NewEvent::new("task.cancelled", "cancelled")
                .task(t7.id)
                .stage("cancelled"),
        )
        .await
        .unwrap();

    let html = h.get("/", StatusCode::OK).await.text;
    // ORCH-1 is at intake in the store (the events above are only the timeline).
    let row = section(&html, "id=\"task-ORCH-1\"", "</tr>");
    assert!(
        row.contains("class=\"box current\" title=\"intake\""),
        "{row}"
    );
    assert!(row.contains("↺ 1 loop<"), "{row}");
    assert!(row.contains("implementation<sup>×2</sup>"), "{row}");
    assert!(row.contains("analysis<sup>×2</sup>"), "{row}");
    // The chart: one bar per poll, coloured by status, height scaled to the largest value.
    assert!(html.contains("<svg class=\"chart\""), "{html}");
    assert!(html.contains("fill=\"#3a9d5d\""), "{html}");
    assert!(html.contains("fill=\"#c0392b\""), "{html}");
    assert!(html.contains("y=\"24\" width=\"5\" height=\"8\""), "{html}");
    assert!(html.contains("y=\"0\" width=\"5\" height=\"32\""), "{html}");
    assert_eq!(html.matches("<script").count(), 1, "{html}");

    let page = h.get("/ui/tasks/ORCH-7", StatusCode::OK).await.text;
    assert!(page.contains("<svg class=\"chart big\""), "{page}");
    assert!(
        page.contains("class=\"box current\" title=\"intake\""),
        "{page}"
    );
    // The JSON route of the same path is JSON, not the page.
    let v = h.get("/tasks/ORCH-7", StatusCode::OK).await.json();
    assert_eq!(v["task"]["work_item_id"], "ORCH-7");
}

/// The part of `html` from `start` to the next `end`.
fn section<'a>(html: &'a str, start: &str, end: &str) -> &'a str {
    let from = html
        .find(start)
        .unwrap_or_else(|| panic!("no {start:?} in:\n{html}"));
    let rest = &html[from..];
    &rest[..rest.find(end).unwrap_or(rest.len())]
}

// ----- outcomes, repo pages, openapi -------------------------------------------------------------

impl Harness {
    /// Moves a task along with the store's real `advance_stage` (operator fence).
    async fn advance(&self, task: &Task, to: &str, kind: &str, data: serde_json::Value) -> Task {
        let current = self
            .db
            .store
            .get_task(task.id)
            .await
            .unwrap()
            .expect("the task");
        self.db
            .store
            .advance_stage(orch_store::AdvanceStage {
                task_id: task.id,
                expected_stage: current.stage.clone(),
                new_stage: to.parse().unwrap(),
                fence: orch_store::Fence::Seq(current.stage_seq),
                event: NewEvent::new(kind, format!("{} -> {to}", current.stage))
                    .data(data.to_string()),
                next_job: None,
            })
            .await
            .unwrap()
            .task
    }

    /// Appends an event with the store's real `append_event`.
    async fn event(
        &self,
        task: &Task,
        kind: &str,
        stage: &str,
        msg: &str,
        data: serde_json::Value,
    ) {
        self.db
            .store
            .append_event(
                NewEvent::new(kind, msg)
                    .task(task.id)
                    .stage(stage)
                    .data(data.to_string()),
            )
            .await
            .unwrap();
    }
}

/// The demo's APP-2 as today's code leaves it: deployed, the watch FAILED and rolled back,
/// then lessons and `done` with no recorded outcome. ORCH-1 shipped; ORCH-3 is in flight.
async fn release_history() -> Harness {
    let h = Harness::with(None, |r| {
        r.artifacts.insert(
            "ORCH-2".into(),
            vec![ArtifactFile {
                name: "16-post-deploy-log.md".into(),
                content: "---\nwork_item: ORCH-2\npost_deploy_status: FAILED\naction_taken: rollback\n---\n\
# 16 — Post-deploy log: ORCH-2\n\n**FAILED** — 3 consecutive FAIL polls\n\n<script>alert('md')</script>\n\n\
[bad](javascript:alert(1)) [good](https://example.com/x)\n\n## Series\n\n\
| tick | at | poll | check | outcome | status | latency | detail |\n|---|---|---|---|---|---|---|---|\n\
| 0 | 2026-11-29T10:00:00Z | PASS | health | PASS | 200 | 12 ms | ok |\n\
| 1 | 2026-11-29T10:00:30Z | FAIL | health | FAIL | 500 | 40 ms | boom |\n\
| 2 | 2026-11-29T10:01:00Z | FAIL | health | FAIL | 500 | 35 ms | boom |\n\
| 3 | 2026-11-29T10:01:30Z | FAIL | health | FAIL | 500 | 31 ms | boom |\n\n## Reaction\n"
                    .into(),
            }],
        );
    })
    .await;
    let t1 = h.task("ORCH-1", "shipped one", "svc", None).await;
    let t2 = h.task("ORCH-2", "rolled back one", "svc", None).await;
    let t3 = h.task("ORCH-3", "in flight", "svc", None).await;
    h.task("ORCH-4", "other repo", "web", None).await;
    for (t, rev) in [(&t1, "rev1111111111111"), (&t2, "rev2222222222222")] {
        h.advance(t, "deploy", "stage.advanced", json!({})).await;
        h.event(
            t,
            "deploy.confirmed",
            "deploy",
            "confirmed",
            json!({"revision": rev}),
        )
        .await;
        h.advance(t, "observe", "stage.advanced", json!({})).await;
    }
    h.event(
        &t1,
        "post_deploy.verdict",
        "observe",
        "post-deploy watch HEALTHY: fine (action none)",
        json!({"verdict": "HEALTHY", "action": "none"}),
    )
    .await;
    h.event(
        &t2,
        "post_deploy.verdict",
        "observe",
        "post-deploy watch FAILED: 3 consecutive FAIL polls (FAILED at 3) (action rollback)",
        json!({"verdict": "FAILED", "action": "rollback"}),
    )
    .await;
    h.event(
        &t2,
        "post_deploy.rollback",
        "observe",
        "rolled back `rev2222222222222`; verified",
        json!({"revision": "rev2222222222222", "verified": true}),
    )
    .await;
    // The release train's own record of a later deploy that shipped a revert of ORCH-2.
    h.event(
        &t1,
        "release.deployed",
        "observe",
        "deployed",
        json!({"repo": "svc", "revision": "rev3333333333333", "previous_revision": "rev2222222222222",
               "items": [{"work_item": "ORCH-1", "commit": "c1", "change": "merge"},
                         {"work_item": "ORCH-2", "commit": "c2", "change": "revert"}], "seq": 3}),
    )
    .await;
    for t in [&t1, &t2] {
        h.advance(t, "lessons", "stage.advanced", json!({})).await;
        h.event(
            t,
            "lessons.recorded",
            "lessons",
            "1 lesson(s): rollback",
            json!({"count": 1}),
        )
        .await;
        h.advance(t, "done", "task.done", json!({})).await;
    }
    h.advance(&t3, "review", "stage.advanced", json!({})).await;
    h
}

#[tokio::test]
async fn a_rolled_back_task_is_rolled_back_in_the_api_the_pages_and_metrics() {
    let h = release_history().await;
    let list = h.get("/tasks?repo=svc", StatusCode::OK).await.json();
    let outcome = |id: &str| {
        list["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["work_item_id"] == id)
            .map(|t| t["outcome"].clone())
            .unwrap()
    };
    assert_eq!(outcome("ORCH-1")["outcome"], "shipped");
    assert_eq!(outcome("ORCH-2")["outcome"], "rolled_back");
    assert_eq!(outcome("ORCH-2")["stage"], "observe");
    assert_eq!(
        outcome("ORCH-2")["reason"],
        "3 consecutive FAIL polls (FAILED at 3)"
    );
    assert_eq!(outcome("ORCH-2")["recorded"], false);
    assert_eq!(outcome("ORCH-3"), Value::Null);
    let one = h.get("/tasks/ORCH-2", StatusCode::OK).await.json();
    assert_eq!(one["task"]["outcome"]["outcome"], "rolled_back");

    // The task page tells it at the top, before the timeline.
    let html = h.get("/ui/tasks/ORCH-2", StatusCode::OK).await.text;
    let story = section(&html, "<section class=\"story", "</section>");
    assert!(story.contains("data-outcome=\"rolled_back\""), "{story}");
    assert!(story.contains("rolled back"), "{story}");
    assert!(
        story.contains("3 consecutive FAIL polls (FAILED at 3)"),
        "{story}"
    );
    assert!(
        html.find("class=\"story").unwrap() < html.find("Stage timeline").unwrap(),
        "the story is not at the top"
    );
    // A finished page does not poll.
    assert!(html.contains("<body data-live=\"0\">"), "{html}");
    // The chart from 16-post-deploy-log.md, after the watch ended: 4 bars, 3 red.
    let chart = section(&html, "<svg class=\"chart big\"", "</svg>");
    assert_eq!(chart.matches("<rect").count(), 4, "{chart}");
    assert_eq!(chart.matches("fill=\"#c0392b\"").count(), 3, "{chart}");
    assert!(
        html.contains("verdict <b>FAILED, action rollback</b>"),
        "{html}"
    );
    // The artifact is rendered, its raw HTML escaped, the javascript: link dropped.
    assert!(html.contains("<strong>FAILED</strong>"), "{html}");
    assert!(html.contains("#unsafe-link-removed"), "{html}");
    assert!(html.contains("href=\"https://example.com/x\""), "{html}");
    assert!(!html.contains("<script>alert"), "{html}");
    assert!(!html.contains("href=\"javascript:"), "{html}");
    // The stage timeline has one bar per visit.
    let tl = section(&html, "<div class=\"tl\"", "<p class=\"muted\">↺");
    assert_eq!(tl.matches("class=\"bar\"").count(), 5, "{tl}");

    // The queue page does not show it as plain green done.
    let index = h.get("/", StatusCode::OK).await.text;
    let row = section(&index, "id=\"task-ORCH-2\"", "</tr>");
    assert!(row.contains("chip rolled_back"), "{row}");
    assert!(row.contains("pipe rolled_back"), "{row}");
    assert!(!row.contains("chip shipped"), "{row}");
    let row = section(&index, "id=\"task-ORCH-1\"", "</tr>");
    assert!(row.contains("chip shipped"), "{row}");
    assert!(index.contains("<body data-live=\"1\">"));
    assert!(!index.contains("http-equiv=\"refresh\""));

    let m = h.get("/metrics", StatusCode::OK).await.text;
    for want in [
        "orch_finished_tasks{outcome=\"rolled_back\"} 1\n",
        "orch_finished_tasks{outcome=\"shipped\"} 1\n",
        "orch_finished_tasks{outcome=\"failed\"} 0\n",
    ] {
        assert!(m.contains(want), "{want} in\n{m}");
    }
}

#[tokio::test]
async fn the_outcome_follows_the_facts_not_what_the_terminal_event_says() {
    let h = Harness::new(None).await;
    // The watch decided FAILED, the rollback "succeeded" but production never came back, the
    // repo was held, an operator approved: the terminal event of an older rule says shipped.
    let t = h
        .task("ORCH-9", "approved after a failed rollback", "svc", None)
        .await;
    let t = h.advance(&t, "observe", "stage.advanced", json!({})).await;
    h.event(
        &t,
        "post_deploy.rollback",
        "observe",
        "rollback of `abc1234` ran but is not verified: health FAIL",
        json!({"revision": "abc1234", "verified": false}),
    )
    .await;
    h.event(
        &t,
        "post_deploy.verdict",
        "observe",
        "post-deploy watch FAILED: 3 consecutive FAIL polls (action rollback_failed)",
        json!({"verdict": "FAILED", "action": "rollback_failed", "revision": "abc1234"}),
    )
    .await;
    h.event(
        &t,
        "release.held",
        "observe",
        "held",
        json!({"repo": "svc", "reason": "r"}),
    )
    .await;
    h.event(
        &t,
        "release.unheld",
        "lessons",
        "released by an operator",
        json!({"repo": "svc", "live": "def5678", "healthy": true}),
    )
    .await;
    h.advance(&t, "done", "task.done", json!({"outcome": "shipped"}))
        .await;
    let v = h.get("/tasks/ORCH-9", StatusCode::OK).await.json();
    assert_eq!(v["task"]["outcome"]["outcome"], "accepted", "{v}");
    assert_eq!(v["task"]["outcome"]["recorded"], false);
    assert_eq!(v["task"]["outcome"]["live"], "def5678");
    let reason = v["task"]["outcome"]["reason"].as_str().unwrap();
    assert!(reason.contains("accepted `def5678`"), "{reason}");
    let html = h.get("/ui/tasks/ORCH-9", StatusCode::OK).await.text;
    let story = section(&html, "<section class=\"story", "</section>");
    assert!(story.contains("operator accepted"), "{story}");
    assert!(!story.contains("shipped"), "{story}");
    let list = h.get("/tasks", StatusCode::OK).await.json();
    let row = list["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["work_item_id"] == "ORCH-9")
        .cloned()
        .unwrap();
    assert_eq!(row["outcome"]["outcome"], "accepted");
    let repo = h.get("/ui/repos/svc", StatusCode::OK).await.text;
    assert!(!repo.contains("chip shipped"), "{repo}");
    let m = h.get("/metrics", StatusCode::OK).await.text;
    assert!(
        m.contains("orch_finished_tasks{outcome=\"accepted\"} 1\n"),
        "{m}"
    );
    assert!(
        m.contains("orch_finished_tasks{outcome=\"shipped\"} 0\n"),
        "{m}"
    );
    let t = h.task("ORCH-10", "failed", "svc", None).await;
    h.advance(
        &t,
        "failed",
        "task.failed",
        json!({"outcome": "failed", "stage": "staging", "reason": "smoke check failed"}),
    )
    .await;
    let v = h.get("/tasks/ORCH-10", StatusCode::OK).await.json();
    assert_eq!(v["task"]["outcome"]["stage"], "staging");
    let html = h.get("/ui/tasks/ORCH-10", StatusCode::OK).await.text;
    let story = section(&html, "<section class=\"story", "</section>");
    assert!(story.contains("smoke check failed"), "{story}");
    assert!(story.contains("staging"), "{story}");
    // A failed task offers retry, not cancel.
    assert!(html.contains("data-action=\"retry\""), "{html}");
    assert!(!html.contains("data-action=\"cancel\""), "{html}");
}

#[tokio::test]
async fn the_repo_page_shows_deploys_verdicts_rollbacks_and_lessons() {
    let h = release_history().await;
    let v = h.get("/repos/svc/deploys", StatusCode::OK).await.json();
    assert_eq!(v["repo"], "svc");
    let in_flight: Vec<&str> = v["in_flight"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["work_item_id"].as_str().unwrap())
        .collect();
    assert_eq!(in_flight, ["ORCH-3"]);
    let deploys = v["deploys"].as_array().unwrap();
    assert_eq!(deploys.len(), 3, "{v}");
    // Before the release train: one item each, from deploy.confirmed, with the watch's word.
    assert_eq!(deploys[0]["deployed_by"], "ORCH-1");
    assert_eq!(deploys[0]["source"], "deploy.confirmed");
    assert_eq!(deploys[0]["verdict"], "HEALTHY");
    assert_eq!(deploys[0]["rolled_back"], false);
    assert_eq!(deploys[1]["deployed_by"], "ORCH-2");
    assert_eq!(deploys[1]["verdict"], "FAILED");
    assert_eq!(deploys[1]["rolled_back"], true);
    assert_eq!(deploys[1]["revision"], "rev2222222222222");
    // The release train's record: which items, and the revert.
    assert_eq!(deploys[2]["source"], "release.deployed");
    assert_eq!(deploys[2]["previous_revision"], "rev2222222222222");
    assert_eq!(deploys[2]["items"][1]["work_item"], "ORCH-2");
    assert_eq!(deploys[2]["items"][1]["change"], "revert");
    let finished = v["finished"].as_array().unwrap();
    assert!(
        finished
            .iter()
            .any(|t| t["work_item_id"] == "ORCH-2" && t["outcome"]["outcome"] == "rolled_back"),
        "{v}"
    );
    assert_eq!(v["lessons"].as_array().unwrap().len(), 2);
    assert!(
        !v.to_string().contains("ORCH-4"),
        "another repo's item leaked: {v}"
    );

    let html = h.get("/ui/repos/svc", StatusCode::OK).await.text;
    for want in [
        "href=\"/ui/tasks/ORCH-3\"",
        "chip rolled_back\">rolled back",
        "rev222222222",
        "(revert)",
        "1 lesson(s): rollback",
    ] {
        assert!(html.contains(want), "{want} in\n{html}");
    }
    h.get("/repos/nope/deploys", StatusCode::NOT_FOUND).await;
    let a = h
        .get("/repos/..%2Fx/deploys", StatusCode::BAD_REQUEST)
        .await;
    assert_eq!(a.error_code(), "invalid_repo");
    h.get("/ui/repos/nope", StatusCode::NOT_FOUND).await;
}

#[tokio::test]
async fn openapi_is_served_and_filters_with_control_characters_are_400() {
    let h = Harness::new(None).await;
    let a = h.get("/openapi.yaml", StatusCode::OK).await;
    assert!(a.content_type().starts_with("application/yaml"));
    assert!(a.text.contains("openapi: "), "{}", a.text);
    // The document as served passes the OpenAPI validator (an unquoted description with a
    // comma once turned into a key of its own).
    if let Some(dir) = python_package_dir(
        "py-openapi-spec-validator",
        "import openapi_spec_validator",
        "openapi-spec-validator>=0.7",
    ) {
        let script = [
            "import sys, yaml",
            "from openapi_spec_validator import validate",
            "validate(yaml.safe_load(sys.stdin.read()))",
            "print('valid')",
        ]
        .join("\n");
        let out = python(
            &dir,
            &script,
            &a.text,
            "openapi-spec-validator rejected /openapi.yaml",
        );
        assert_eq!(out.trim(), "valid");
    }
    for uri in ["/tasks?stage=%00", "/tasks?repo=a%0Ab", "/?stage=%00"] {
        let a = h.get(uri, StatusCode::BAD_REQUEST).await;
        if uri.starts_with("/tasks") {
            assert_eq!(a.error_code(), "bad_request");
        }
    }
}

#[tokio::test]
async fn cross_site_browser_calls_are_refused_even_with_the_token() {
    let h = Harness::new(Some(TOKEN)).await;
    h.task("ORCH-4", "t", "svc", None).await;
    for (header, value) in [
        ("sec-fetch-site", "cross-site"),
        ("origin", "http://evil.example"),
    ] {
        let req = Request::post("/tasks/ORCH-4/cancel")
            .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
            .header(header::HOST, "127.0.0.1:7878")
            .header(header, value)
            .body(Body::empty())
            .unwrap();
        let a = h.check(req, StatusCode::FORBIDDEN).await;
        assert_eq!(a.error_code(), "cross_site");
    }
    assert!(h.ops.calls().is_empty());
    // Served with connect info (as `serve` does), the call names its peer and client.
    let mut req = Request::post("/tasks/ORCH-4/cancel")
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .header(header::HOST, "127.0.0.1:7878")
        .header("origin", "http://127.0.0.1:7878")
        .header("sec-fetch-site", "same-origin")
        .header(
            header::USER_AGENT,
            header::HeaderValue::from_bytes("Mozilla/5.0 \u{9b}2J\u{202e}".as_bytes()).unwrap(),
        )
        .body(Body::empty())
        .unwrap();
    let peer: std::net::SocketAddr = "127.0.0.1:41234".parse().unwrap();
    req.extensions_mut()
        .insert(axum::extract::ConnectInfo(peer));
    h.check(req, StatusCode::OK).await;
    assert_eq!(
        h.ops.calls(),
        [
            "cancel ORCH-4 via the API from 127.0.0.1:41234 with the operator token (User-Agent \"Mozilla/5.0 \\u{9b}2J\\u{202e}\")"
        ]
    );
}

/// The skip convention of every test tree: `SKIPPED: <reason>` and pass, unless
/// `ORCH_REQUIRE_ALL=1`, which makes a skip a failure.
fn skip(reason: &str) {
    if std::env::var("ORCH_REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("cannot run {reason}, and ORCH_REQUIRE_ALL=1");
    }
    eprintln!("SKIPPED: {reason}");
}
