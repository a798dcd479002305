//! End to end: the real `orch` binary drives a real git repository through every stage with
//! the scripted demo agent (a CLI speaking Claude Code's JSON format), real deploy scripts and a
//! real HTTP service; and `orch serve` killed during an agent run resumes and finishes.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{
    ORCH, Serve, become_subreaper, demo_setup, git_show, open, python_available, reap_orphans,
    skip, stop_service, task, wait_terminal,
};
/// Processes whose working directory is inside `dir`.
fn orch_processes_in(dir: &std::path::Path) -> Vec<i32> {
    let Ok(dir) = dir.canonicalize() else {
        return Vec::new();
    };
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(&dir))
        })
        .collect()
}

/// `orch [--json] demo --dir <dir>` to its end (at most 400 s).
async fn run_demo(dir: &Path, json: bool) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(ORCH);
    if json {
        cmd.arg("--json");
    }
    tokio::time::timeout(
        Duration::from_secs(400),
        cmd.args(["demo", "--dir"])
            .arg(dir)
            .env("ORCH_LOG", "warn")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the demo finishes within 400 s")
    .expect("run orch demo")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_drives_two_items_through_every_stage_one_healthy_one_rolled_back() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let out = run_demo(&dir, false).await;
    // The demo stops its sample service itself (it used to leave both instances running).
    let left = orch_processes_in(&dir.join("service-state/releases"));
    stop_service(&dir);
    assert!(left.is_empty(), "the demo left service processes: {left:?}");
    reap_orphans();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    // Every "look around" command runs as printed (it used to call `orch`, not on PATH after
    // `cargo run`). `serve` is left out: it would not return.
    let look: Vec<&str> = stdout
        .split("look around:")
        .nth(1)
        .expect("a look-around section")
        .lines()
        .filter_map(|l| l.split('#').next())
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('(') && !l.ends_with(" serve"))
        .collect();
    assert!(look.len() >= 4, "{stdout}");
    for line in look {
        let ran = std::process::Command::new("sh")
            .args(["-c", line])
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            ran.status.success(),
            "`{line}` failed: {}",
            String::from_utf8_lossy(&ran.stderr)
        );
    }
    let store = open(&dir).await;
    let repo = dir.join(".orch/repos/service");

    // APP-1: one review round trip, deployed, watched healthy, lessons, done.
    let t1 = task(&store, "APP-1").await;
    assert_eq!(t1.stage, "done", "{stdout}");
    let e1 = store.task_events(t1.id).await.unwrap();
    let kinds: Vec<&str> = e1.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "stage.loop_back").count(),
        1,
        "one review loop: {kinds:?}"
    );
    assert!(kinds.contains(&"deploy.confirmed"), "{kinds:?}");
    let verdict1 = e1
        .iter()
        .find(|e| e.kind == "post_deploy.verdict")
        .expect("a verdict event");
    assert!(
        verdict1.message.contains("HEALTHY") || verdict1.data.contains("HEALTHY"),
        "{verdict1:?}"
    );
    for name in [
        "01-request.md",
        "02-requirements.md",
        "06-architecture.md",
        "07-adr-001-stdlib-only.md",
        "08-data-requirements.md",
        "10-implementation.md",
        "11-review.md",
        "12-test-report.md",
        "14-merge-log.md",
        "15-staging-log.md",
        "16-post-deploy-log.md",
        "17-lessons.md",
    ] {
        let content = git_show(&repo, &format!("orch/APP-1:docs/work-items/APP-1/{name}"))
            .unwrap_or_else(|| panic!("{name} is committed on orch/APP-1"));
        assert!(content.starts_with("---"), "{name} has frontmatter");
        assert!(
            content.contains("work_item: APP-1"),
            "{name} names its work item"
        );
    }
    let review = git_show(&repo, "orch/APP-1:docs/work-items/APP-1/11-review.md").unwrap();
    assert!(review.contains("review_status: APPROVED"));
    let app = git_show(&repo, "main:app.py").unwrap();
    assert!(
        app.contains("\"/version\""),
        "APP-1's code is merged into main"
    );
    let runs = store.task_agent_runs(t1.id).await.unwrap();
    assert!(
        runs.len() >= 5,
        "analysis, architecture, 2x implementation, 2x review: {runs:?}"
    );
    for r in &runs {
        assert_eq!(r.backend, "claude");
        assert!(
            r.input_tokens.unwrap_or(0) > 0 && r.output_tokens.unwrap_or(0) > 0,
            "{r:?}"
        );
        assert!(r.cost_usd.unwrap_or(0.0) > 0.0, "{r:?}");
        assert!(r.finished_at.is_some(), "{r:?}");
    }

    // APP-2: breaks production health; the watch decides FAILED and rolls back.
    let t2 = task(&store, "APP-2").await;
    assert_eq!(t2.stage, "done", "{stdout}");
    let e2 = store.task_events(t2.id).await.unwrap();
    let verdict2 = e2
        .iter()
        .find(|e| e.kind == "post_deploy.verdict")
        .expect("a verdict event");
    assert!(
        verdict2.message.contains("FAILED") || verdict2.data.contains("FAILED"),
        "{verdict2:?}"
    );
    let log2 = git_show(
        &repo,
        "orch/APP-2:docs/work-items/APP-2/16-post-deploy-log.md",
    )
    .expect("post-deploy log");
    assert!(log2.contains("post_deploy_status: FAILED"), "{log2}");
    assert!(log2.contains("action_taken: rollback"), "{log2}");
    let lessons =
        git_show(&repo, "orch/APP-2:docs/work-items/APP-2/17-lessons.md").expect("lessons");
    assert!(
        lessons.to_lowercase().contains("rollback")
            || lessons.to_lowercase().contains("rolled back"),
        "{lessons}"
    );
    assert!(
        stdout.contains("APP-1") && stdout.contains("look around"),
        "the summary is printed:\n{stdout}"
    );
    // The loop closes: a later request's prompt carried APP-2's rollback lesson.
    let t3 = task(&store, "APP-3").await;
    assert_eq!(t3.stage, "cancelled");
    let req3 = git_show(&repo, "orch/APP-3:docs/work-items/APP-3/02-requirements.md")
        .expect("APP-3 requirements");
    assert!(
        req3.contains("Lessons considered") && req3.contains("APP-2") && req3.contains("rollback"),
        "{req3}"
    );
    let lessons_main =
        git_show(&repo, "main:LESSONS.md").expect("lessons reach the default branch");
    assert!(
        lessons_main.contains("APP-2") && lessons_main.contains("rollback"),
        "{lessons_main}"
    );
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_killed_during_an_agent_run_resumes_with_a_new_attempt_and_finishes() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir: PathBuf = tmp.path().join("demo");
    demo_setup(&dir);
    let submit = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args([
            "submit",
            "--repo",
            "service",
            "--title",
            "Add a /version endpoint",
            "--body",
            "Add GET /version.",
        ])
        .output()
        .expect("orch submit");
    assert!(
        submit.status.success(),
        "{}",
        String::from_utf8_lossy(&submit.stderr)
    );

    let store = open(&dir).await;
    let serve = Serve::start(&dir, 4_000);
    // Wait until the analyst is in the middle of its run, then kill everything.
    let t0 = Instant::now();
    let t = loop {
        let t = task(&store, "APP-1").await;
        let runs = store.task_agent_runs(t.id).await.unwrap();
        if runs
            .iter()
            .any(|r| r.stage == "analysis" && r.finished_at.is_none())
        {
            break t;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the analysis run never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    serve.kill_group().await;
    let worktree = dir.join(".orch/repos/service/worktrees/APP-1");
    assert!(worktree.exists(), "the worktree survives the crash");

    let serve = Serve::start(&dir, 50);
    let done = wait_terminal(&store, "APP-1", Duration::from_secs(240)).await;
    serve.terminate().await;
    stop_service(&dir);
    reap_orphans();
    assert_eq!(done.stage, "done");
    let jobs = store.task_jobs(t.id).await.unwrap();
    let analysis = jobs
        .iter()
        .find(|j| j.task_content.contains("\"analysis\""))
        .expect("the analysis job");
    assert!(
        analysis.attempt >= 2,
        "the killed run was retried as a new attempt: {analysis:?}"
    );
    let runs = store.task_agent_runs(t.id).await.unwrap();
    let analysis_runs: Vec<_> = runs.iter().filter(|r| r.stage == "analysis").collect();
    // The agent outlived the kill under its supervisor: the new attempt adopted it, so it is
    // one run (one row, paid for once), finished with its own result.
    assert_eq!(analysis_runs.len(), 1, "{analysis_runs:?}");
    assert!(
        analysis_runs[0].finished_at.is_some() && analysis_runs[0].outcome == "ok",
        "{analysis_runs:?}"
    );
    assert!(
        analysis_runs[0].data.contains("\"adopted\":true"),
        "{analysis_runs:?}"
    );
    let events = store.task_events(t.id).await.unwrap();
    let advances = events
        .iter()
        .filter(|e| e.kind == "stage.advanced" && e.message.starts_with("analysis"))
        .count();
    assert_eq!(advances, 1, "analysis advanced exactly once");
    store.close().await;
}

/// `orch --json demo`: the commentary goes to stderr, stdout is one JSON document with every
/// item's outcome and the deploy history (what each production deploy shipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_under_json_prints_one_document() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let out = run_demo(&dir, true).await;
    stop_service(&dir);
    reap_orphans();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("look around:"),
        "the commentary is on stderr"
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {stdout}"));
    let service = &v["service"];
    let outcome = |id: &str| {
        service["finished"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["work_item_id"] == id)
            .map(|t| {
                t["outcome"]["outcome"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
    };
    assert_eq!(outcome("APP-1").as_deref(), Some("shipped"), "{v}");
    assert_eq!(outcome("APP-2").as_deref(), Some("reverted"), "{v}");
    assert_eq!(outcome("APP-3").as_deref(), Some("cancelled"), "{v}");
    let deploys = service["deploys"].as_array().expect("deploys");
    assert!(
        deploys.iter().any(|d| d["items"]
            .as_array()
            .is_some_and(|items| items.iter().any(|i| i["work_item"] == "APP-1"))),
        "a deploy shipped APP-1: {v}"
    );
    assert!(
        deploys
            .iter()
            .any(|d| d["reverts"].as_array().is_some_and(|r| !r.is_empty())),
        "APP-2 was reverted: {v}"
    );
    assert!(v["finished_in_s"].as_u64().is_some(), "{v}");
}
