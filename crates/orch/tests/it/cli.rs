//! The CLI against bad input and in normal use: every failure is a clear message on stderr and
//! a non-zero exit, with nothing half-written; `orch serve` answers /healthz and /queue and
//! stops cleanly on SIGTERM.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use orch_store::{ConnectOptions, NewEvent, Store};

const ORCH: &str = env!("CARGO_BIN_EXE_orch");

fn orch(dir: &Path, args: &[&str]) -> Output {
    std::process::Command::new(ORCH)
        .current_dir(dir)
        .args(args)
        .env_remove("ORCH_DATABASE_URL")
        .env_remove("ORCH_CONFIG")
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run orch")
}

#[track_caller]
fn fails_with(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected a failure, got success; stderr: {stderr}"
    );
    assert!(
        stderr.contains(needle),
        "stderr should mention {needle:?}:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic: {stderr}");
}

#[track_caller]
fn succeeds(out: &Output) -> String {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn database_problems_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fails_with(&orch(d, &["queue"]), "no orch database at");
    fails_with(
        &orch(d, &["--database-url", "mysql://x", "queue"]),
        "invalid database URL",
    );
    fails_with(
        &orch(
            d,
            &[
                "--database-url",
                "postgres://root@127.0.0.1:1/nope",
                "queue",
            ],
        ),
        "cannot open the database",
    );
    std::fs::create_dir_all(d.join(".orch")).unwrap();
    std::fs::write(
        d.join(".orch/orch.db"),
        b"this is not a database, just some bytes padding it out",
    )
    .unwrap();
    let out = orch(d, &["queue"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        stderr.contains("not a database") || stderr.contains("corrupt"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    succeeds(&orch(d, &["init"]));
    let url = format!("sqlite://{}", d.join(".orch/orch.db").display());
    let store = Store::connect(&url, ConnectOptions::default())
        .await
        .unwrap();
    store
        .append_event(
            NewEvent::new("schema.migrated", "from the future")
                .data(r#"{"version": 99, "name": "9999_future"}"#),
        )
        .await
        .unwrap();
    store.close().await;
    fails_with(&orch(d, &["queue"]), "newer than this orch binary supports");
    fails_with(
        &orch(d, &["worker"]),
        "newer than this orch binary supports",
    );
}

#[test]
fn init_is_idempotent_and_config_errors_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let first = succeeds(&orch(d, &["init"]));
    assert!(first.contains("wrote"));
    let config = std::fs::read_to_string(d.join("orch.toml")).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(d.join("orch.toml"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "orch.toml holds the token: owner-only");
    let second = succeeds(&orch(d, &["init"]));
    assert!(second.contains("kept existing"));
    assert_eq!(
        std::fs::read_to_string(d.join("orch.toml")).unwrap(),
        config,
        "not overwritten"
    );
    succeeds(&orch(d, &["migrate"]));
    std::fs::write(
        d.join("orch.toml"),
        config.replace("\n[settings]\n", "\n[settings]\nworkerz = 3\n"),
    )
    .unwrap();
    fails_with(&orch(d, &["queue"]), "workerz");
}

#[test]
fn task_commands_refuse_hostile_ids_and_unknown_repos() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    succeeds(&orch(d, &["init"]));
    fails_with(&orch(d, &["status", "../../etc/passwd"]), "work item");
    fails_with(&orch(d, &["cancel", "APP-1/../x"]), "work item");
    fails_with(&orch(d, &["status", "APP-404"]), "no work item APP-404");
    fails_with(
        &orch(d, &["submit", "--repo", "nope", "--title", "x"]),
        "not declared",
    );
    let out = succeeds(&orch(d, &["status", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        v,
        serde_json::json!({"count": 0, "tasks": []}),
        "GET /tasks's shape"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_healthz_and_queue_and_stops_on_sigterm() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    succeeds(&orch(d, &["init"]));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(ORCH)
        .current_dir(d)
        .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let mut health = None;
    for _ in 0..100 {
        if let Ok(r) = client.get(format!("{base}/healthz")).send().await {
            health = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let health = health.expect("serve answers /healthz");
    assert_eq!(health.status(), 200);
    let queue: serde_json::Value = client
        .get(format!("{base}/queue"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(queue.is_object(), "{queue}");
    let text = serde_json::to_string(&queue).unwrap();
    assert!(
        text.contains("staging_runner") && text.contains("merge_gate"),
        "runner counters are shown: {text}"
    );
    let refused = client
        .post(format!("{base}/api/tasks"))
        .json(&serde_json::json!({"repo": "x", "title": "y", "body": ""}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401, "mutating calls need the token");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id().unwrap() as i32, libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("stops within 20 s")
        .unwrap();
    assert!(status.success(), "clean exit on SIGTERM: {status}");
}

#[test]
fn doctor_names_what_is_missing_and_how_to_fix_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    succeeds(&orch(d, &["init"]));
    let mut config = std::fs::read_to_string(d.join("orch.toml")).unwrap();
    for agent in ["analyst", "architect", "developer", "reviewer"] {
        config = config.replace(
            &format!("[agents.{agent}]\nbackend = \"claude\""),
            &format!(
                "[agents.{agent}]\nbackend = \"command\"\ncommand = \"no-such-agent-cli-xyz\""
            ),
        );
    }
    config.push_str("\n[repos.app]\npath = \"missing-checkout\"\nprefix = \"APP\"\ndeploy = \"nope-deploy-tool ./go\"\n");
    std::fs::write(d.join("orch.toml"), config).unwrap();
    let out = orch(d, &["doctor"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "problems make doctor exit non-zero:\n{stdout}"
    );
    assert!(stdout.contains("ok    git is installed"), "{stdout}");
    assert!(
        stdout.contains("FAIL  agent analyst: `no-such-agent-cli-xyz` is not on PATH"),
        "{stdout}"
    );
    assert!(
        stdout.contains("FAIL  repo app: ") && stdout.contains("missing-checkout does not exist"),
        "{stdout}"
    );
    assert!(
        stdout.contains("FAIL  repo app: no `test` command"),
        "{stdout}"
    );
    assert!(stdout.contains("runs `nope-deploy-tool`"), "{stdout}");
    assert!(
        stdout.contains("FAIL  repo app: deploy without health_url"),
        "{stdout}"
    );
    assert!(
        stdout.contains("FAIL  repo app: no staging steps"),
        "{stdout}"
    );
    assert!(
        stdout.contains("repo app: deploy without rollback")
            && stdout.contains("repo app: deploys with nobody to alert"),
        "{stdout}"
    );
    assert!(
        stdout.contains("fix: "),
        "every problem says how to fix it: {stdout}"
    );
}

/// `orch logs X | head -1`: once nobody reads its stdout, a command stops there the way a
/// filter does, killed by SIGPIPE (status 141 in a shell), with nothing on stderr (no panic,
/// no error message), in text and in JSON. The reader is a pipe whose read end is closed
/// before orch starts, so every run meets it at its first write.
#[test]
fn a_closed_stdout_pipe_ends_the_command_quietly_by_sigpipe() {
    use std::os::unix::process::ExitStatusExt as _;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("demo");
    let setup = std::process::Command::new(ORCH)
        .args(["demo", "--setup-only", "--dir"])
        .arg(&d)
        .output()
        .unwrap();
    assert!(
        setup.status.success(),
        "{}",
        String::from_utf8_lossy(&setup.stderr)
    );
    succeeds(&orch(
        &d,
        &["submit", "--repo", "service", "--title", "Piped away"],
    ));
    for args in [
        &["logs", "APP-1"][..],
        &["status", "APP-1"],
        &["status"],
        &["--json", "logs", "APP-1"],
        &["queue"],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = std::process::Command::new(ORCH)
            .current_dir(&d)
            .args(args)
            .env_remove("ORCH_DATABASE_URL")
            .env_remove("ORCH_CONFIG")
            .env("ORCH_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGPIPE),
            "orch {args:?}: {:?}, stderr: {stderr}",
            out.status
        );
        assert!(stderr.is_empty(), "orch {args:?} says nothing: {stderr}");
    }
}

/// `orch costs`: per repo, stage and day, a run of unknown cost makes its groups unknown (with
/// the known part and the count), in the tables and in `--json`.
#[tokio::test]
async fn costs_count_unknown_runs_per_repo_stage_and_day() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    succeeds(&orch(d, &["init"]));
    let url = format!("sqlite://{}", d.join(".orch/orch.db").display());
    let store = Store::connect(&url, ConnectOptions::default())
        .await
        .unwrap();
    for (id, repo, costs) in [
        ("APP-1", "app", vec![Some(0.5), None]),
        ("WEB-1", "web", vec![Some(0.25)]),
    ] {
        let task = store
            .create_task(orch_store::NewTask {
                work_item: orch_store::WorkItemSpec::Exact(id.parse().unwrap()),
                repo: repo.parse().unwrap(),
                title: "t".into(),
                body: String::new(),
                stage: "analysis".parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new("task.submitted", "submitted"),
                first_job: None,
            })
            .await
            .unwrap();
        for cost in costs {
            let run = store
                .start_agent_run(orch_store::NewAgentRun {
                    task_id: task.id,
                    job_id: None,
                    stage: "analysis".into(),
                    agent: "analyst".into(),
                    backend: "claude".into(),
                    model: None,
                    attempt: 1,
                })
                .await
                .unwrap();
            store
                .finish_agent_run(
                    run,
                    orch_store::AgentRunFinish {
                        outcome: "ok".into(),
                        input_tokens: Some(100),
                        output_tokens: Some(10),
                        cost_usd: cost,
                        data: "{}".into(),
                        ..orch_store::AgentRunFinish::default()
                    },
                )
                .await
                .unwrap();
        }
    }
    store.close().await;
    let text = succeeds(&orch(d, &["costs"]));
    assert!(
        text.contains("unknown (1 of 2 runs; $0.5000 known)") && text.contains("$0.2500"),
        "{text}"
    );
    assert!(
        text.contains(
            "total: 3 runs, 300 tokens in, 30 out, cost unknown (1 of 3 runs; $0.7500 known)"
        ),
        "{text}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&succeeds(&orch(d, &["--json", "costs"]))).unwrap();
    assert_eq!(v["by_repo"][0]["key"], "app", "{v}");
    assert_eq!(
        v["by_repo"][0]["usage"]["cost_usd"],
        serde_json::Value::Null
    );
    assert_eq!(v["by_repo"][0]["usage"]["unknown_cost_runs"], 1);
    assert_eq!(v["by_repo"][1]["usage"]["cost_usd"], 0.25);
    assert_eq!(v["by_stage"][0]["usage"]["runs"], 3);
    assert_eq!(v["by_day"].as_array().map(Vec::len), Some(1), "{v}");
}
