//! End to end with the REAL agent CLIs: `orch serve` drives a work item of the demo's sample
//! repo through its LLM stages run by the Claude Code, Codex and Aider presets, against the
//! scripted model server (`orch-modelserver`) on 127.0.0.1 — the only fake is the hosted
//! model. The stage's artifact is written by the CLI's own tools, committed, gated, and the
//! task advances through orch's engine.
//!
//! A CLI that is not installed (`scripts/install-agent-clis`) makes its test print
//! `SKIPPED: <reason>` and return; with `ORCH_REQUIRE_AGENT_CLIS=1` it fails instead.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{ORCH, Serve, agent_cli, become_subreaper, demo_setup, open, python_available};
use orch_modelserver::{ModelServer, artifact_writer};

/// The demo's config with its four LLM agents replaced by `preset` at `endpoint`.
fn configure(dir: &Path, preset: &str, program: &Path, endpoint: &str, model: &str) {
    let path = dir.join("orch.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let cut = text
        .find("[agents.analyst]")
        .expect("the demo declares agents");
    let mut text = text[..cut].to_owned();
    for agent in ["analyst", "architect", "developer", "reviewer"] {
        text.push_str(&format!(
            "[agents.{agent}]\nbackend = \"{preset}\"\ncommand = {:?}\nendpoint = \"{endpoint}\"\n\
             model = \"{model}\"\napi_key_env = \"CARGO_PKG_NAME\"\ncli_retries = 0\ntimeout_s = 120\n\n",
            program.display().to_string()
        ));
    }
    std::fs::write(&path, text).unwrap();
}

/// Submits a work item and runs `orch serve` until its stage is none of `past`; checks the
/// agent runs and `orch status`.
async fn drive(preset: &str, model: &str, past: &[&str]) {
    drive_with(preset, model, past, Vec::new()).await;
}

/// [`drive`] with the model asking the CLI to run `before` first; returns the model server's
/// record of the requests (the tool results the CLI sent back).
async fn drive_with(
    preset: &str,
    model: &str,
    past: &[&str],
    before: Vec<orch_modelserver::Action>,
) -> Vec<orch_modelserver::Recorded> {
    let Some(program) = agent_cli(preset) else {
        return Vec::new();
    };
    if !python_available() {
        common::skip("python3 is not installed (the sample service's tests need it)");
        return Vec::new();
    }
    become_subreaper();
    let server = ModelServer::start(artifact_writer(before)).await.unwrap();
    let endpoint = if preset == "claude" {
        server.url()
    } else {
        server.openai_url()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    configure(&dir, preset, &program, &endpoint, model);
    let submit = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
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
    let serve = Serve::spawn(Serve::command(&dir, "127.0.0.1:0"));
    let store = open(&dir).await;
    let t0 = Instant::now();
    let reached = loop {
        let t = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
        if !past.contains(&t.stage.as_str()) {
            break t;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "APP-1 stuck at {}",
            t.stage
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    serve.terminate().await;
    let runs = store.task_agent_runs(reached.id).await.unwrap();
    let events = store.task_events(reached.id).await.unwrap();
    assert!(
        !matches!(reached.stage.as_str(), "failed" | "cancelled"),
        "APP-1 {}: {:?} {:?}",
        reached.stage,
        runs.iter()
            .map(|r| (&r.stage, &r.outcome, &r.error))
            .collect::<Vec<_>>(),
        events
            .iter()
            .map(|e| (&e.kind, &e.message))
            .collect::<Vec<_>>()
    );
    assert!(!runs.is_empty());
    // Runs of the stages passed; one of the next stage may be cut short by the stop.
    for r in runs.iter().filter(|r| past.contains(&r.stage.as_str())) {
        assert_eq!(
            (r.backend.as_str(), r.outcome.as_str()),
            (preset, "ok"),
            "{r:?}"
        );
        assert!(r.input_tokens.is_some() && r.cost_usd.is_some(), "{r:?}");
    }
    let stages: Vec<&str> = runs.iter().map(|r| r.stage.as_str()).collect();
    println!(
        "{preset}: APP-1 reached {} after agent runs in {stages:?}",
        reached.stage
    );
    let status = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(["status", "APP-1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    // Every run of the stages passed is priced; a run the stop cut short has an unknown cost,
    // which makes the total unknown (never a sum counting it as zero).
    let unknown = runs.iter().filter(|r| r.cost_usd.is_none()).count();
    if unknown == 0 {
        assert!(text.contains("cost $"), "{text}");
    } else {
        assert!(
            text.contains(&format!(
                "cost unknown ({unknown} of {} runs; $",
                runs.len()
            )),
            "{text}"
        );
    }
    server.requests()
}

const LLM_STAGES: [&str; 6] = [
    "intake",
    "analysis",
    "architecture",
    "implementation",
    "review",
    "verification",
];

/// Claude Code in orch's sandbox runs every LLM stage; its Bash tool reaches the model server
/// (its endpoint) and nothing else on loopback, though another server listens there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_runs_every_llm_stage_through_the_engine_in_the_sandbox() {
    let probe = OtherPort::listen();
    let requests = drive_with(
        "claude",
        "claude-sonnet-4-5",
        &LLM_STAGES,
        vec![orch_modelserver::Action::Bash(probe.command())],
    )
    .await;
    probe.check(&requests);
}

/// Codex in orch's sandbox: its shell reaches the model server (its endpoint) and nothing else
/// on loopback, though another server listens there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_runs_the_analysis_stage_through_the_engine_in_the_sandbox() {
    let probe = OtherPort::listen();
    let requests = drive_with(
        "codex",
        "gpt-5-codex",
        &["intake", "analysis"],
        vec![orch_modelserver::Action::Bash(probe.command())],
    )
    .await;
    probe.check(&requests);
}

/// A server on another loopback port that an agent's shell must not reach: the network
/// allowlist lets a run reach its model endpoint only.
struct OtherPort {
    port: u16,
}

impl OtherPort {
    fn listen() -> OtherPort {
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = other.local_addr().unwrap().port();
        std::thread::spawn(move || {
            use std::io::{Read as _, Write as _};
            for mut c in other.incoming().flatten() {
                let mut b = [0u8; 2048];
                let _ = c.read(&mut b);
                let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\nreached-other");
            }
        });
        OtherPort { port }
    }

    /// The shell command the model asks the CLI to run.
    fn command(&self) -> String {
        format!(
            "curl -s -m 3 http://127.0.0.1:{}/; echo \" probe-exit=$?\"",
            self.port
        )
    }

    /// The probe ran (its result went back to the model) and could not connect; `requests`
    /// empty means the test was skipped.
    fn check(&self, requests: &[orch_modelserver::Recorded]) {
        if requests.is_empty() {
            return;
        }
        let bodies: String = requests.iter().map(|r| r.body.to_string()).collect();
        assert!(
            bodies.contains("probe-exit=7"),
            "the probe ran and could not connect: {bodies}"
        );
        assert!(!bodies.contains("reached-other"), "{bodies}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_runs_the_analysis_stage_through_the_engine() {
    drive("aider", "gpt-4.1", &["intake", "analysis"]).await;
}

/// `orch demo --agent claude`: the whole demo with its LLM stages run by the real Claude
/// Code, the demo's scripted agent deciding the files through the demo's model server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_with_the_real_claude_code() {
    let Some(program) = agent_cli("claude") else {
        return;
    };
    if !python_available() {
        return common::skip("python3 is not installed (the demo's sample service needs it)");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let out = tokio::process::Command::new(ORCH)
        .args(["demo", "--agent", "claude", "--dir"])
        .arg(&dir)
        .env("ORCH_DEMO_CLAUDE", &program)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    common::reap_orphans();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("the real Claude Code"), "{text}");
    assert!(
        text.contains("APP-1  Add a /version endpoint  → shipped"),
        "{text}"
    );
    assert!(
        text.contains("loop 1 of 3 back to implementation"),
        "{text}"
    );
    let store = open(&dir).await;
    let task = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
    let runs = store.task_agent_runs(task.id).await.unwrap();
    assert_eq!(runs.len(), 6, "{runs:?}");
    for r in &runs {
        assert_eq!(
            (r.backend.as_str(), r.outcome.as_str()),
            ("claude", "ok"),
            "{r:?}"
        );
        let data: serde_json::Value = serde_json::from_str(&r.data).unwrap();
        assert_eq!(data["claude_subtype"], "success");
    }
    common::stop_service(&dir);
}
