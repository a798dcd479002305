//! End to end with every LLM stage on the `openai` backend, against a loopback HTTP server
//! speaking the OpenAI chat completions format (the only fake: a hosted model is outside this
//! machine). The real `orch serve` drives the sample repo through every stage to `done`.

use crate::common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use common::{
    ORCH, become_subreaper, demo_setup, git_show, open, python_available, reap_orphans, skip,
    stop_service, terminate, wait_terminal,
};

#[derive(Default)]
struct Seen {
    requests: Vec<(String, String)>, // (model, auth header)
}

fn artifact(stage: &str, author: &str, id: &str, model: &str, extra: &str, body: &str) -> String {
    format!(
        "---\nwork_item: {id}\nstage: {stage}\nauthor_agent: {author}\nstatus: final\n\
         created_at: \"2026-11-29T12:00:00Z\"\nmodel_used: {model}\n{extra}---\n\n{body}\n"
    )
}

async fn chat(
    State(seen): State<Arc<Mutex<Seen>>>,
    headers: axum::http::HeaderMap,
    Json(req): Json<serde_json::Value>,
) -> Json<serde_json::Value> {
    let model = req["model"].as_str().unwrap_or_default().to_owned();
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    seen.lock().unwrap().requests.push((model.clone(), auth));
    let prompt: String = req["messages"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter_map(|x| x["content"].as_str())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default();
    let id = prompt
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .find(|w| {
            w.starts_with("APP-") && w[4..].chars().all(|c| c.is_ascii_digit()) && w.len() > 4
        })
        .unwrap_or("APP-1")
        .to_owned();
    let content = match model.as_str() {
        "fake-analysis" => artifact(
            "analysis",
            "analyst",
            &id,
            &model,
            "",
            "# Requirements\n\n- BR-1: serve the version.\n- AC-1: tests pass.",
        ),
        "fake-architecture" => format!(
            "<<<FILE 06-architecture.md>>>\n{}<<<FILE 08-data-requirements.md>>>\n{}",
            artifact(
                "architecture",
                "architect",
                &id,
                &model,
                "",
                "# Architecture\n\nNo change in structure."
            ),
            artifact(
                "architecture",
                "architect",
                &id,
                &model,
                "",
                "# Data requirements\n\nNone."
            ),
        ),
        "fake-implementation" => artifact(
            "implementation",
            "developer",
            &id,
            &model,
            "",
            "# Implementation\n\nDocumented the plan; no code change needed.",
        ),
        "fake-review" => artifact(
            "review",
            "reviewer",
            &id,
            &model,
            "review_status: APPROVED\n",
            "# Review\n\nApproved.",
        ),
        other => format!("unknown model {other}"),
    };
    Json(serde_json::json!({
        "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt.len() / 4, "completion_tokens": content.len() / 4, "total_tokens": (prompt.len() + content.len()) / 4},
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_llm_stage_through_an_openai_compatible_endpoint() {
    if !python_available() {
        return skip("python3 is not installed: the sample service cannot run");
    }
    become_subreaper();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(chat))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.ok() });

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let config_path = dir.join("orch.toml");
    let config = std::fs::read_to_string(&config_path).unwrap();
    let cut = config
        .find("[agents.analyst]")
        .expect("the demo config declares agents");
    let mut config = config[..cut].to_owned();
    for (agent, stage) in [
        ("analyst", "analysis"),
        ("architect", "architecture"),
        ("developer", "implementation"),
        ("reviewer", "review"),
    ] {
        config.push_str(&format!(
            "[agents.{agent}]\nbackend = \"openai\"\nendpoint = \"http://127.0.0.1:{port}/v1\"\nmodel = \"fake-{stage}\"\napi_key_env = \"ORCH_TEST_FAKE_KEY\"\ntimeout_s = 30\n\n"
        ));
    }
    std::fs::write(&config_path, config).unwrap();

    let submit = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(&config_path)
        .args([
            "submit",
            "--repo",
            "service",
            "--title",
            "Document the version",
            "--body",
            "Say which version runs.",
        ])
        .output()
        .unwrap();
    assert!(
        submit.status.success(),
        "{}",
        String::from_utf8_lossy(&submit.stderr)
    );
    let metrics_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let serve = tokio::process::Command::new(ORCH)
        .arg("--config")
        .arg(&config_path)
        .args(["serve", "--bind", &format!("127.0.0.1:{metrics_port}")])
        .env("ORCH_LOG", "warn")
        .env("ORCH_TEST_FAKE_KEY", "sk-test-secret-123")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let store = open(&dir).await;
    let task = wait_terminal(&store, "APP-1", Duration::from_secs(180)).await;
    // The last job commits its completion after the task reaches `done`; its duration is
    // recorded before that commit, so once no job of the task is live, /metrics has them all.
    let settle = Instant::now();
    while store.task_jobs(task.id).await.unwrap().iter().any(|j| {
        matches!(
            j.state,
            orch_store::JobState::Queued | orch_store::JobState::Running
        )
    }) {
        assert!(
            settle.elapsed() < Duration::from_secs(30),
            "jobs still live"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = http_get(metrics_port, "/metrics").await;
    terminate(serve).await;
    stop_service(&dir);
    reap_orphans();

    let events = store.task_events(task.id).await.unwrap();
    assert_eq!(
        task.stage,
        "done",
        "{:#?}",
        events
            .iter()
            .map(|e| (&e.kind, &e.message))
            .collect::<Vec<_>>()
    );
    let repo = dir.join(".orch/repos/service");
    let req = git_show(&repo, "orch/APP-1:docs/work-items/APP-1/02-requirements.md")
        .expect("requirements on the branch");
    assert!(req.contains("model_used: fake-analysis"));
    assert!(
        git_show(
            &repo,
            "orch/APP-1:docs/work-items/APP-1/08-data-requirements.md"
        )
        .is_some(),
        "multi-file reply split into artifacts"
    );
    let review = git_show(&repo, "orch/APP-1:docs/work-items/APP-1/11-review.md").unwrap();
    assert!(review.contains("review_status: APPROVED"));
    let runs = store.task_agent_runs(task.id).await.unwrap();
    assert_eq!(runs.len(), 4, "{runs:?}");
    for r in &runs {
        assert_eq!(r.backend, "openai");
        assert!(
            r.model.as_deref().is_some_and(|m| m.starts_with("fake-")),
            "{r:?}"
        );
        assert!(
            r.input_tokens.unwrap_or(0) > 0 && r.output_tokens.unwrap_or(0) > 0,
            "usage read from the reply: {r:?}"
        );
        assert!(
            r.error
                .as_deref()
                .is_none_or(|e| !e.contains("sk-test-secret")),
            "no key in rows"
        );
    }
    // /metrics of the live serve: token and cost totals match the rows; every agent kind that
    // ran has a duration histogram; the key never shows.
    assert!(!metrics.contains("sk-test-secret"), "no key in /metrics");
    let value = |name: &str, labels: &str| -> f64 {
        let head = if labels.is_empty() {
            format!("{name} ")
        } else {
            format!("{name}{{{labels}}} ")
        };
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&head))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {head} in /metrics:\n{metrics}"))
    };
    let mut by_agent: std::collections::BTreeMap<&str, (i64, i64)> = Default::default();
    for r in &runs {
        let e = by_agent.entry(r.agent.as_str()).or_default();
        e.0 += r.input_tokens.unwrap_or(0);
        e.1 += r.output_tokens.unwrap_or(0);
    }
    for (agent, (input, output)) in &by_agent {
        let l = format!("agent=\"{agent}\",direction=\"input\"");
        assert_eq!(value("orch_agent_tokens_total", &l), *input as f64);
        let l = format!("agent=\"{agent}\",direction=\"output\"");
        assert_eq!(value("orch_agent_tokens_total", &l), *output as f64);
        // Runs are by agent and outcome: sum the agent's outcomes.
        let head = format!("orch_agent_runs_total{{agent=\"{agent}\",outcome=");
        let runs: f64 = metrics
            .lines()
            .filter(|l| l.starts_with(&head))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert!(runs >= 1.0, "no runs of {agent} in /metrics:\n{metrics}");
    }
    let jobs = store.task_jobs(task.id).await.unwrap();
    for job in jobs
        .iter()
        .filter(|j| j.state == orch_store::JobState::Done)
    {
        // prometheus-client writes `le` before the family's labels.
        let l = format!("le=\"+Inf\",agent=\"{}\"", job.agent);
        assert!(
            value("orch_job_duration_seconds_bucket", &l) >= 1.0,
            "{} ran: its duration is counted",
            job.agent
        );
    }
    assert!(value("orch_claim_query_seconds_count", "") >= 1.0);
    let requests = seen.lock().unwrap().requests.clone();
    assert_eq!(requests.len(), 4);
    assert!(
        requests
            .iter()
            .all(|(_, auth)| auth == "Bearer sk-test-secret-123"),
        "the key from api_key_env is sent"
    );
    for e in &events {
        assert!(
            !e.message.contains("sk-test-secret") && !e.data.contains("sk-test-secret"),
            "no key in events"
        );
    }
    store.close().await;
}

/// `GET path` on the loopback port; the whole answer (head and body) as text.
async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to orch serve");
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    String::from_utf8_lossy(&buf).into_owned()
}
