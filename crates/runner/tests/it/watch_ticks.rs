//! A post-deploy watch run through the real engine: its ticks (a poll each) leave the work
//! item's worktree alone — no reset, no commit, no git — and the tick that ends the watch
//! prepares it (a crashed attempt's leftovers removed) before writing the post-deploy log, which
//! is committed on the item's branch.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use orch_deploystate::{ArmOutcome, ArmedRecord, WatchState};
use orch_domain::config::Config;
use orch_domain::monitor::{WatchParams, planned_polls};
use orch_exec::Git;
use orch_runner::counters::Counters;
use orch_runner::deploy::monitor::POST_DEPLOY_LOG;
use orch_runner::deploy::{MONITOR_AGENT, MonitorExecutor};
use orch_runner::engine::{Engine, EngineConfig, StageJob};
use orch_runner::live_config::LiveConfig;
use orch_runner::repos::{self, RepoPaths};
use orch_runner::worker::{Registry, Worker, WorkerConfig};
use orch_store::testing::TestDb;
use orch_store::{JobState, NewEvent, NewJob, NewTask, WorkItemSpec};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn a_watchs_ticks_leave_the_worktree_alone_and_its_end_commits_the_log() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let db = TestDb::sqlite().await;
    let store = &db.store;
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let source = tmp.path().join("service");
    common::init_repo(&git, &source, "the service\n").await;
    let health =
        common::listen(axum::Router::new().route("/health", axum::routing::get(|| async { "ok" })))
            .await;
    let params = WatchParams {
        window_s: 2,
        interval_s: 1,
        initial_delay_s: 0,
        poll_timeout_s: 2,
    };
    let toml = format!(
        "[agents.analyst]\nbackend = \"claude\"\n[agents.architect]\nbackend = \"claude\"\n\
         [agents.developer]\nbackend = \"claude\"\n[agents.reviewer]\nbackend = \"claude\"\n\
         [repos.app]\npath = \"service\"\nprefix = \"APP\"\nhealth_url = \"{health}/health\"\n\
         [repos.app.post_deploy]\nwindow_s = 2\ninterval_s = 1\ninitial_delay_s = 0\n"
    );
    let config = Arc::new(Config::from_toml_str(&toml, &|_: &str| None).unwrap());
    let repos_dir = tmp.path().join("repos");
    let mut engine = Engine::new(
        store.clone(),
        EngineConfig {
            config: config.clone(),
            live: LiveConfig::new(config.clone(), store.now_ms()),
            pipeline: Arc::new(config.pipeline().unwrap()),
            root: tmp.path().to_path_buf(),
            repos_dir: repos_dir.clone(),
            node: "n1".into(),
        },
        Arc::new(Counters::new()),
    );
    engine.set_executor(MONITOR_AGENT, Arc::new(MonitorExecutor::default()));
    let engine = Arc::new(engine);
    let mut registry = Registry::new();
    engine.register(&mut registry, Duration::from_secs(60));

    let task = store
        .create_task(NewTask {
            work_item: WorkItemSpec::Next {
                prefix: "APP".parse().unwrap(),
            },
            repo: "app".parse().unwrap(),
            title: "t".into(),
            body: String::new(),
            stage: "observe".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "submitted"),
            first_job: None,
        })
        .await
        .unwrap();
    let id: orch_domain::ids::WorkItemId = task.work_item_id.clone();
    // The worktree as the stages before left it, plus a file a crashed attempt left behind.
    let name = "app".parse().unwrap();
    let repo = config.repos.get(&name).unwrap().clone();
    let paths = RepoPaths::new(&repos_dir, &name);
    repos::ensure_clone(&git, tmp.path(), &paths, &name, &repo)
        .await
        .unwrap();
    let worktree = repos::prepare_worktree(&git, &paths, &id, "main")
        .await
        .unwrap();
    let artifacts = worktree.join(id.artifact_dir());
    std::fs::create_dir_all(&artifacts).unwrap();
    let leftover = artifacts.join("leftover.txt");
    std::fs::write(&leftover, "half written by a dead attempt").unwrap();

    let ws = WatchState::new(&repos_dir, "app", id.as_str());
    let armed = ArmedRecord::new(params, store.now_ms(), "abc123");
    assert_eq!(ws.arm(&armed), ArmOutcome::Armed);
    let first = StageJob {
        stage: "observe".into(),
        seq: task.stage_seq,
    }
    .to_content();
    store
        .enqueue(
            NewJob::new(MONITOR_AGENT, first)
                .task(task.id)
                .node("n1")
                .max_attempts(3),
        )
        .await
        .unwrap();

    let mut wc = WorkerConfig::new("w");
    wc.poll_interval = Duration::from_millis(20);
    wc.node = Some("n1".into());
    let stop = CancellationToken::new();
    let worker = tokio::spawn(
        Worker::new(store.clone(), registry, wc).run(stop.clone(), CancellationToken::new()),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut ticks_seen = 0;
    loop {
        let t = store.get_task(task.id).await.unwrap().unwrap();
        if t.stage != "observe" {
            break;
        }
        let polls = ws.series().polls.len();
        let live = store
            .task_jobs(task.id)
            .await
            .unwrap()
            .iter()
            .filter(|j| matches!(j.state, JobState::Queued | JobState::Running))
            .count();
        if polls > ticks_seen && polls < planned_polls(&params) as usize && !ws.is_done() {
            // A tick has polled and the watch goes on: the worktree is as the tick found it.
            // (After the last slot the ending job prepares it for the log.)
            ticks_seen = polls;
            assert!(
                leftover.exists(),
                "tick {polls} reset the worktree (the leftover is gone)"
            );
        }
        if live == 1 && polls > 0 {
            // The next tick waits for its slot on the test clock, which stands still.
            db.clock.advance_ms(1_000);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the watch did not end: {t:?}, {polls} polls"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    worker.await.unwrap();
    assert!(ticks_seen >= 1, "no tick was seen before the watch ended");

    // observe → lessons (whose job then fails here: this process has no lessons executor).
    let history = store.task_events(task.id).await.unwrap();
    let advanced = history
        .iter()
        .find(|e| e.kind == "stage.advanced")
        .unwrap_or_else(|| panic!("the watch never advanced: {history:#?}"));
    let data: serde_json::Value = serde_json::from_str(&advanced.data).unwrap();
    assert_eq!(
        (data["from"].as_str(), data["to"].as_str()),
        (Some("observe"), Some("lessons")),
        "{advanced:?}"
    );
    assert!(ws.is_done());
    assert!(
        !leftover.exists(),
        "the last tick wrote its log into an unprepared worktree"
    );
    let branch = id.branch_name();
    let log = format!("{}/{POST_DEPLOY_LOG}", id.artifact_dir());
    let shown = std::process::Command::new("git")
        .args(["show", &format!("{branch}:{log}")])
        .current_dir(&paths.repo_dir)
        .output()
        .unwrap();
    assert!(
        shown.status.success(),
        "the post-deploy log is not committed on {branch}: {}",
        String::from_utf8_lossy(&shown.stderr)
    );
    assert!(String::from_utf8_lossy(&shown.stdout).contains("HEALTHY"));
    let tree = std::process::Command::new("git")
        .args(["ls-tree", "-r", "--name-only", &branch])
        .current_dir(&paths.repo_dir)
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&tree.stdout).contains("leftover.txt"),
        "the leftover was committed"
    );
}
