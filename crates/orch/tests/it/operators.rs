//! Operator commands against a running `orch serve`: a stage marked `approval = true` waits for
//! `orch approve`, `orch cancel` stops a task for good, `orch retry` puts a failed task back at
//! the stage it failed in; wrong-state commands are refused with a clear message.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::{
    ORCH, become_subreaper, demo_setup, open, reap_orphans, stop_service, terminate, wait_for_task,
};
use orch_store::{AdvanceStage, Fence, NewEvent, Store, Task};

fn orch(config: &Path, args: &[&str]) -> Output {
    std::process::Command::new(ORCH)
        .arg("--config")
        .arg(config)
        .args(args)
        .env("ORCH_LOG", "warn")
        .output()
        .unwrap()
}

async fn wait_for(store: &Store, id: &str, what: &str, pred: impl Fn(&Task) -> bool) -> Task {
    wait_for_task(store, id, Duration::from_secs(120), what, pred).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_cancel_and_retry() {
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir: PathBuf = tmp.path().join("demo");
    demo_setup(&dir);
    let config = dir.join("orch.toml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("\n[pipeline.stages.architecture]\napproval = true\n");
    std::fs::write(&config, text).unwrap();
    for title in [
        "Add a /version endpoint",
        "Make the greeting configurable",
        "Add a /version endpoint again",
    ] {
        let out = orch(&config, &["submit", "--repo", "service", "--title", title]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let serve = tokio::process::Command::new(ORCH)
        .arg("--config")
        .arg(&config)
        .args(["serve", "--bind", "127.0.0.1:0"])
        .env("ORCH_LOG", "warn")
        .env("ORCH_DEMO_AGENT_SLEEP_MS", "50")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let store = open(&dir).await;
    for id in ["APP-1", "APP-2", "APP-3"] {
        wait_for(&store, id, "the approval stage", |t| {
            t.stage == "architecture"
        })
        .await;
    }
    // Waiting means no job: once the task has no queued or running job (polled, with a
    // deadline), nothing can run until an operator approves.
    let t1 = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
    let t0 = Instant::now();
    while store
        .task_jobs(t1.id)
        .await
        .unwrap()
        .iter()
        .any(|j| j.state.is_live())
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "APP-1 still has a live job while it waits for approval"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let t1 = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
    assert_eq!(t1.stage, "architecture", "still waiting without approval");
    assert!(
        store
            .task_agent_runs(t1.id)
            .await
            .unwrap()
            .iter()
            .all(|r| r.stage != "architecture"),
        "the architect did not run"
    );

    let out = orch(&config, &["approve", "APP-1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for(&store, "APP-1", "leaving architecture", |t| {
        t.stage != "architecture"
    })
    .await;
    let again = orch(&config, &["approve", "APP-1"]);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("does not wait for approval"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    let out = orch(&config, &["cancel", "APP-2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t2 = wait_for(&store, "APP-2", "cancelled", |t| t.stage == "cancelled").await;
    let twice = orch(&config, &["cancel", "APP-2"]);
    assert!(
        String::from_utf8_lossy(&twice.stderr).contains("already ended"),
        "{}",
        String::from_utf8_lossy(&twice.stderr)
    );
    let not_failed = orch(&config, &["retry", "APP-2"]);
    assert!(
        String::from_utf8_lossy(&not_failed.stderr).contains("only a failed task"),
        "{}",
        String::from_utf8_lossy(&not_failed.stderr)
    );
    assert!(
        store
            .task_jobs(t2.id)
            .await
            .unwrap()
            .iter()
            .all(|j| !j.state.is_live()),
        "a cancelled task has no live job"
    );

    // APP-3 fails while waiting (as an operator or a crash would leave it), then is retried.
    let t3 = store.get_task_by_work_item("APP-3").await.unwrap().unwrap();
    store
        .advance_stage(AdvanceStage {
            task_id: t3.id,
            expected_stage: "architecture".parse().unwrap(),
            new_stage: "failed".parse().unwrap(),
            fence: Fence::Seq(t3.stage_seq),
            event: NewEvent::new("task.failed", "failed by the test")
                .data(r#"{"from": "architecture", "to": "failed"}"#),
            next_job: None,
        })
        .await
        .unwrap();
    let out = orch(&config, &["retry", "APP-3"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let t3 = wait_for(&store, "APP-3", "back in the pipeline", |t| {
        !t.is_terminal()
    })
    .await;
    assert_eq!(
        t3.stage, "architecture",
        "retried at the stage it failed in"
    );
    let approve = orch(&config, &["approve", "APP-3"]);
    assert!(
        approve.status.success(),
        "the retried approval stage waits again: {}",
        String::from_utf8_lossy(&approve.stderr)
    );
    wait_for(
        &store,
        "APP-3",
        "leaving architecture after approval",
        |t| t.stage != "architecture",
    )
    .await;
    let out = orch(&config, &["--json", "status", "APP-3"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Each operator call names its caller: here the CLI and its OS user.
    for kind in ["task.retried", "stage.approved"] {
        assert!(
            v["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["kind"] == kind
                    && e["message"].as_str().unwrap().contains(" via the CLI by ")
                    && e["data"]["by"]["via"] == "cli"),
            "{kind}: {v}"
        );
    }

    terminate(serve).await;
    stop_service(&dir);
    reap_orphans();
    store.close().await;
}
