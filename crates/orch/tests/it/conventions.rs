//! The CLI's conventions, one regression test per defect a new user met: JSON under `--json`
//! for every command and every error (the API's error shape), distinct exit codes, output fitted
//! to the terminal's width with an error column for agent runs, no colour codes off a terminal,
//! `orch init` keeping the token out of git, and `orch doctor` telling repo setups and broken
//! agents apart.

use crate::common;

use std::path::Path;
use std::process::{Output, Stdio};

use orch_store::{AgentRunFinish, NewAgentRun, NewEvent, NewTask, WorkItemSpec};

use common::ORCH;

fn orch_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = std::process::Command::new(ORCH);
    cmd.current_dir(dir)
        .args(args)
        .env_remove("ORCH_DATABASE_URL")
        .env_remove("ORCH_CONFIG")
        .env_remove("COLUMNS")
        .env_remove("NO_COLOR")
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run orch")
}

fn orch(dir: &Path, args: &[&str]) -> Output {
    orch_env(dir, args, &[])
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The exit code and the parsed JSON error of a failed `--json` command.
#[track_caller]
fn json_error(o: &Output) -> (i32, String, String) {
    let text = stdout(o);
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {text}\nstderr: {}",
            String::from_utf8_lossy(&o.stderr)
        )
    });
    let code = v["error"]["code"].as_str().expect("error.code").to_owned();
    let message = v["error"]["message"]
        .as_str()
        .expect("error.message")
        .to_owned();
    (o.status.code().unwrap_or(-1), code, message)
}

fn sh(dir: &Path, cmd: &str) {
    let ok = std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .status()
        .unwrap()
        .success();
    assert!(ok, "{cmd}");
}

#[test]
fn errors_under_json_are_json_and_failures_have_distinct_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // No config, no database: unavailable (69).
    let (exit, code, message) = json_error(&orch(d, &["--json", "status"]));
    assert_eq!((exit, code.as_str()), (69, "unavailable"), "{message}");
    // Usage (2), also for clap's own errors.
    let (exit, code, _) = json_error(&orch(d, &["--json", "frobnicate"]));
    assert_eq!((exit, code.as_str()), (2, "usage"));
    assert_eq!(orch(d, &["frobnicate"]).status.code(), Some(2));
    assert!(stdout(&orch(d, &["--help"])).contains("Exit codes"));
    assert!(orch(d, &["init", "--json"]).status.success());
    // Not found (66), invalid id (2).
    let (exit, code, message) = json_error(&orch(d, &["status", "APP-404", "--json"]));
    assert_eq!((exit, code.as_str()), (66, "not_found"), "{message}");
    let (exit, code, _) = json_error(&orch(d, &["status", "../x", "--json"]));
    assert_eq!((exit, code.as_str()), (2, "invalid"));
    let (exit, code, _) = json_error(&orch(
        d,
        &["--json", "submit", "--repo", "nope", "--title", "t"],
    ));
    assert_eq!((exit, code.as_str()), (2, "invalid"));
    // Config (78) with file, line and key.
    let config = std::fs::read_to_string(d.join("orch.toml")).unwrap();
    std::fs::write(
        d.join("orch.toml"),
        config.replace("workers = 4", "workers = 0"),
    )
    .unwrap();
    let (exit, code, message) = json_error(&orch(d, &["--json", "queue"]));
    assert_eq!((exit, code.as_str()), (78, "config"));
    let line = config.lines().position(|l| l == "workers = 4").unwrap() + 1;
    assert!(
        message.contains(&format!("orch.toml:{line}:")) && message.contains("[settings] workers"),
        "{message}"
    );
    let plain = orch(d, &["queue"]);
    assert_eq!(plain.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&plain.stderr).contains(&format!("orch.toml:{line}:")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflicting_operation_exits_75() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::demo_setup(d);
    let submitted = orch(
        d,
        &[
            "--json", "submit", "--repo", "service", "--title", "A change",
        ],
    );
    assert!(
        submitted.status.success(),
        "{}",
        String::from_utf8_lossy(&submitted.stderr)
    );
    // Approving a task that does not wait for approval is a conflict.
    let out = orch(d, &["--json", "approve", "APP-1"]);
    let (exit, code, message) = json_error(&out);
    assert_eq!((exit, code.as_str()), (75, "conflict"), "{message}");
}

#[test]
fn doctor_json_prints_json() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = orch(d, &["doctor", "--json"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("JSON");
    assert_eq!(v["ok"], false);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["status"] == "fail" && c["fix"] == "run `orch init`"),
        "{v}"
    );
}

#[test]
fn doctor_tells_repo_setups_apart_and_catches_broken_agents() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert!(orch(d, &["init"]).status.success());
    std::fs::create_dir(d.join("plain-dir")).unwrap();
    sh(
        d,
        "git init -q -b main co && git -C co -c user.email=a@b -c user.name=a commit -q --allow-empty -m init",
    );
    sh(d, "git clone -q --bare co bare.git");
    std::fs::write(d.join("agent.sh"), "#!/bin/sh\n").unwrap(); // not executable
    let mut config = std::fs::read_to_string(d.join("orch.toml")).unwrap();
    config = config.replace(
        "[agents.analyst]\nbackend = \"claude\"",
        "[agents.analyst]\nbackend = \"command\"\ncommand = \"./agent.sh\"",
    );
    config = config.replace(
        "[agents.developer]\nbackend = \"claude\"",
        "[agents.developer]\nbackend = \"openai\"\nendpoint = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"",
    );
    for (name, prefix, path) in [
        ("missing", "MI", "no-such-dir"),
        ("notgit", "NG", "plain-dir"),
        ("checkout", "CO", "co"),
        ("bare", "BA", "bare.git"),
    ] {
        config.push_str(&format!(
            "\n[repos.{name}]\npath = \"{path}\"\nprefix = \"{prefix}\"\ntest = \"true\"\n"
        ));
    }
    config.push_str(&format!(
        "\n[repos.remote]\nurl = \"file://{}\"\nprefix = \"RE\"\ntest = \"true\"\n",
        d.join("bare.git").display()
    ));
    std::fs::write(d.join("orch.toml"), config).unwrap();
    let out = orch(d, &["--json", "doctor"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("JSON");
    let checks = v["checks"].as_array().unwrap();
    let find = |needle: &str| -> serde_json::Value {
        checks
            .iter()
            .find(|c| c["what"].as_str().unwrap_or("").contains(needle))
            .cloned()
            .unwrap_or_else(|| panic!("no check mentions {needle:?}: {v:#}"))
    };
    assert_eq!(find("repo missing:")["status"], "fail");
    assert!(
        find("repo missing:")["what"]
            .as_str()
            .unwrap()
            .contains("does not exist")
    );
    assert!(
        find("repo notgit:")["what"]
            .as_str()
            .unwrap()
            .contains("is not a git repository")
    );
    assert_eq!(find("repo notgit:")["status"], "fail");
    let co = find("repo checkout:");
    assert_eq!(co["status"], "ok");
    assert!(
        co["what"]
            .as_str()
            .unwrap()
            .contains("orch never pushes into it"),
        "{co}"
    );
    assert!(co["fix"].as_str().unwrap().contains("checked out"), "{co}");
    assert!(
        find("repo bare:")["what"]
            .as_str()
            .unwrap()
            .contains("bare repository")
    );
    assert_eq!(find("repo bare:")["status"], "ok");
    let remote = find("repo remote:");
    assert_eq!(remote["status"], "ok", "{remote}");
    assert!(remote["what"].as_str().unwrap().contains("lease"));
    let agent = find("agent analyst:");
    assert_eq!(agent["status"], "fail");
    assert!(
        agent["what"].as_str().unwrap().contains("not executable"),
        "{agent}"
    );
    let openai = find("must change code");
    assert_eq!(openai["status"], "fail", "{openai}");
    assert_eq!(out.status.code(), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_fit_the_terminal_width_not_124_and_agent_runs_show_their_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::demo_setup(d);
    let store = common::open(d).await;
    let task = store
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact("APP-7".parse().unwrap()),
            repo: "service".parse().unwrap(),
            title: "wide".into(),
            body: String::new(),
            stage: "analysis".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "submitted"),
            first_job: None,
        })
        .await
        .unwrap();
    let long = format!("{} END", "word ".repeat(60));
    store
        .append_event(NewEvent::new("note", long.clone()).task(task.id))
        .await
        .unwrap();
    let run = store
        .start_agent_run(NewAgentRun {
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
            AgentRunFinish {
                outcome: "failed".into(),
                error: Some("claude exited 1: invalid API key".into()),
                data: "{}".into(),
                ..AgentRunFinish::default()
            },
        )
        .await
        .unwrap();
    store.close().await;
    // A wide terminal shows the whole message; a narrow one cuts it to its width.
    let wide = stdout(&orch_env(d, &["logs", "APP-7"], &[("COLUMNS", "400")]));
    assert!(wide.contains("END"), "{wide}");
    assert!(
        wide.contains("error") && wide.contains("invalid API key"),
        "{wide}"
    );
    let narrow = stdout(&orch_env(d, &["logs", "APP-7"], &[("COLUMNS", "80")]));
    assert!(narrow.lines().all(|l| l.chars().count() <= 80), "{narrow}");
    assert!(!narrow.contains("END"));
    // Redirected without COLUMNS: nothing is cut.
    let piped = stdout(&orch(d, &["logs", "APP-7"]));
    assert!(piped.contains("END"), "{piped}");
}

#[test]
fn no_colour_codes_in_redirected_logs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = orch_env(d, &["init"], &[("ORCH_LOG", "debug")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.is_empty(), "debug logs expected on stderr");
    assert!(
        !err.contains('\u{1b}'),
        "ANSI codes in redirected logs: {err:?}"
    );
}

#[test]
fn init_inside_a_git_repo_keeps_the_token_out_of_git() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    sh(d, "git init -q -b main .");
    let out = orch(d, &["init"]);
    assert!(out.status.success());
    assert!(stdout(&out).contains(".gitignore"));
    sh(d, "git check-ignore -q orch.toml");
    sh(d, "git check-ignore -q .orch/orch.db");
    let status = std::process::Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=all"])
        .current_dir(d)
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert_eq!(status.trim(), "?? .gitignore", "{status}");
    // Idempotent: a second init adds nothing.
    let before = std::fs::read_to_string(d.join(".gitignore")).unwrap();
    assert!(orch(d, &["init"]).status.success());
    assert_eq!(
        std::fs::read_to_string(d.join(".gitignore")).unwrap(),
        before
    );
}

/// `orch --json worker` (and `serve`, which logs the same way): stdout stays empty and every
/// log line on stderr is one JSON object with a level and a message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_logs_are_json_lines_under_json() {
    use tokio::io::AsyncBufReadExt as _;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::demo_setup(d);
    let mut worker = tokio::process::Command::new(ORCH)
        .current_dir(d)
        .args([
            "--json",
            "--config",
            "orch.toml",
            "worker",
            "--node",
            "json-node",
        ])
        .env_remove("ORCH_DATABASE_URL")
        .env("ORCH_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(worker.stderr.take().unwrap()).lines();
    let first = tokio::time::timeout(std::time::Duration::from_secs(60), lines.next_line())
        .await
        .expect("a log line within 60 s")
        .unwrap()
        .expect("a log line");
    let pid = i32::try_from(worker.id().unwrap()).unwrap();
    // SAFETY: SIGTERM to the worker we spawned.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let mut all = vec![first];
    while let Some(line) = lines.next_line().await.unwrap() {
        all.push(line);
    }
    let out = worker.wait_with_output().await.unwrap();
    assert!(out.status.success(), "{all:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "",
        "stdout stays empty"
    );
    for line in &all {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}"));
        assert!(v["level"].is_string(), "{line}");
        assert!(v["message"].is_string(), "{line}");
    }
}

/// `orch --json demo --setup-only` prints the demo's directory as JSON.
#[test]
fn demo_setup_under_json_prints_json() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("demo");
    let out = orch(
        dir.path(),
        &[
            "--json",
            "demo",
            "--setup-only",
            "--dir",
            target.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("JSON");
    assert_eq!(v["dir"].as_str(), target.to_str());
}

/// `orch --json` prints the HTTP API's documents (`orch_api::dto`): one shape per thing, `id`
/// is a row's id and `work_item_id` the item's name, times are `*_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_output_is_the_apis_documents() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::demo_setup(d);
    let doc = |args: &[&str]| -> serde_json::Value {
        let out = orch(d, args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(stdout(&out).trim()).expect("JSON")
    };
    // POST /tasks's answer.
    let v = doc(&[
        "--json", "submit", "--repo", "service", "--title", "A change",
    ]);
    assert_eq!(v["work_item_id"], "APP-1", "{v}");
    assert!(v["task_id"].is_i64(), "{v}");
    assert_eq!(v["task"]["id"], v["task_id"], "{v}");
    assert_eq!(v["task"]["work_item_id"], "APP-1", "{v}");
    assert!(v["task"]["created_at_ms"].is_i64(), "{v}");

    // GET /tasks/{id}, for `status ID` and `logs ID`.
    for cmd in ["status", "logs"] {
        let v = doc(&["--json", cmd, "APP-1"]);
        for key in ["task", "usage", "events", "agent_runs", "jobs", "deploys"] {
            assert!(v.get(key).is_some(), "{cmd}: no {key}: {v}");
        }
        assert_eq!(v["task"]["stage"], "intake", "{v}");
        assert_eq!(v["usage"]["unknown_cost_runs"], 0, "{v}");
        let first = &v["events"][0];
        assert_eq!(first["kind"], "task.submitted", "{v}");
        assert!(
            first["created_at_ms"].is_i64() && first.get("at_ms").is_none(),
            "{v}"
        );
        assert!(v["jobs"][0]["id"].is_i64(), "{v}");
    }
    // GET /tasks.
    let v = doc(&["--json", "status"]);
    assert_eq!(v["count"], 1, "{v}");
    assert_eq!(v["tasks"][0]["work_item_id"], "APP-1", "{v}");
    // GET /queue, as a process without a worker sees it.
    let v = doc(&["--json", "queue"]);
    assert_eq!(v["jobs"]["by_state"]["queued"], 1, "{v}");
    assert_eq!(v["tasks_by_stage"]["intake"], 1, "{v}");
    for key in ["leases", "active_observations", "release_tracks"] {
        assert!(v[key].is_array(), "{key}: {v}");
    }
    // POST /tasks/{id}/cancel's answer.
    let v = doc(&["--json", "cancel", "APP-1"]);
    assert_eq!(v["action"], "cancel", "{v}");
    assert_eq!(v["task"]["stage"], "cancelled", "{v}");
    assert_eq!(v["task"]["terminal"], true, "{v}");
    // The CLI-only documents keep their fields.
    let v = doc(&["--json", "migrate"]);
    assert!(v["to"].is_i64() && v["applied"].is_array(), "{v}");
}
