//! Issue 33: the engine knows no particular stage. A new deterministic stage is its
//! descriptor (domain data: a `StageDef`) and one executor, registered the way the runtime
//! registers the built-in ones (`catalogue::builtin`, `Executors::with`, `Engine::install`).
//! An item runs through the real `intake` and this toy stage to `done` on a real store, a real
//! git repository and a real worker, and the engine applies the toy's policy (its jobs pinned
//! to the node, its first job delayed, what its commit may hold) from the descriptor and the
//! executor alone.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use orch_domain::artifact::{Artifact, Frontmatter, MODEL_NOT_APPLICABLE, Value};
use orch_domain::config::{Config, RepoConfig};
use orch_domain::control::{actor::Actor, events};
use orch_domain::gate::ArtifactSpec;
use orch_domain::pipeline::{On, Pipeline, StageDef, StageKind, Transition};
use orch_exec::Git;
use orch_runner::counters::Counters;
use orch_runner::engine::{Engine, EngineConfig, StageEffect, StageExecutor, StageRun};
use orch_runner::live_config::LiveConfig;
use orch_runner::worker::{Registry, Worker, WorkerConfig};
use orch_store::testing::TestDb;
use tokio_util::sync::CancellationToken;

/// The toy's executor name, job kind (agent) and documents.
const TOY: &str = "toy";
const TOY_AGENT: &str = "toy-runner";
const TOY_DOC: &str = "20-toy.md";
const TOY_NOTES: &str = "20-toy-notes.md";
/// A by-product of the repository's code, which no runner's commit holds.
const BY_PRODUCT: &str = "scratch.txt";

/// The one runner module a new stage needs: its executor.
#[derive(Default)]
struct ToyExecutor {
    runs: AtomicU32,
}

#[async_trait::async_trait]
impl StageExecutor for ToyExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let mut fm = Frontmatter::new();
        fm.insert("work_item", Value::from(run.work_item.as_str()));
        fm.insert("stage", Value::from(run.stage.name.as_str()));
        fm.insert("author_agent", Value::from(TOY_AGENT));
        fm.insert("status", Value::from("final"));
        fm.insert("created_at", Value::from("2026-01-01T00:00:00Z"));
        fm.insert("model_used", Value::from(MODEL_NOT_APPLICABLE));
        let doc = Artifact::new(fm, format!("# Toy\n\n{}\n", run.task.title)).render();
        run.write_document(TOY_DOC, &doc)?;
        run.write_document(TOY_NOTES, "the toy's notes\n")?;
        std::fs::write(
            run.worktree.join(BY_PRODUCT),
            "left by the repository's code\n",
        )?;
        Ok(StageEffect::Produced { outcome: None })
    }

    fn first_delay_s(&self, _repo: &RepoConfig) -> u64 {
        1
    }
}

/// The domain data of the new stage: the real `intake` goes on to `toy`, which ends the item.
fn pipeline() -> Pipeline {
    let mut intake = Pipeline::default_pipeline().stages[0].clone();
    intake.transitions = [
        (On::Pass, Transition::Next("toy".parse().unwrap())),
        (On::NotSuccess, Transition::Fail),
    ]
    .into();
    let toy = StageDef {
        artifacts: vec![ArtifactSpec::new(TOY_DOC.parse().unwrap())],
        transitions: [
            (On::Pass, Transition::Done),
            (On::NotSuccess, Transition::Fail),
        ]
        .into(),
        ..StageDef::new(
            "toy".parse().unwrap(),
            Some(TOY_AGENT.parse().unwrap()),
            StageKind::Deterministic,
            TOY,
        )
    }
    .keeping_local_state()
    .also_writing(TOY_NOTES.parse().unwrap());
    let pipeline = Pipeline {
        stages: vec![intake, toy],
        max_loops: 3,
    };
    pipeline.validate().unwrap();
    pipeline
}

fn git_out(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_deterministic_stage_is_a_descriptor_and_one_executor() {
    let db = TestDb::sqlite().await;
    let store = &db.store;
    let tmp = tempfile::tempdir().unwrap();
    common::init_repo(&Git::new(), &tmp.path().join("service"), "the service\n").await;
    let toml = "[agents.analyst]\nbackend = \"claude\"\n[agents.architect]\nbackend = \"claude\"\n\
                [agents.developer]\nbackend = \"claude\"\n[agents.reviewer]\nbackend = \"claude\"\n\
                [repos.app]\npath = \"service\"\nprefix = \"APP\"\n";
    let config = Arc::new(Config::from_toml_str(toml, &|_: &str| None).unwrap());
    let live = LiveConfig::new(config.clone(), store.now_ms());
    let counters = Arc::new(Counters::new());
    let repos_dir = tmp.path().join("repos");
    let pipeline = Arc::new(pipeline());
    let engine_for = |pipeline: Arc<Pipeline>| {
        Engine::new(
            store.clone(),
            EngineConfig {
                config: config.clone(),
                live: live.clone(),
                pipeline,
                root: tmp.path().to_path_buf(),
                repos_dir: repos_dir.clone(),
                node: "n1".into(),
            },
            counters.clone(),
        )
    };

    // The registration path is the runtime's: the built-in executors and the toy's, each stage
    // given the one its descriptor names. Without the toy's, the engine refuses to start.
    let builtin = orch_runner::catalogue::builtin(&counters, &live);
    let refused = engine_for(pipeline.clone()).install(&builtin);
    let message = format!("{:#}", refused.unwrap_err());
    assert!(
        message.contains("`toy` (executor `toy`)"),
        "names the stage and its executor: {message}"
    );
    let toy = Arc::new(ToyExecutor::default());
    let mut engine = engine_for(pipeline.clone());
    engine.install(&builtin.with(TOY, toy.clone())).unwrap();
    let engine = Arc::new(engine);
    let mut registry = Registry::new();
    engine.register(&mut registry, Duration::from_secs(60));

    let by = Actor::Orch {
        what: "the toy stage test".into(),
    };
    let task = orch_runner::ops::submit(store, &config, &pipeline, "app", "a toy change", "", &by)
        .await
        .unwrap();
    assert_eq!(task.stage, "intake");

    let mut wc = WorkerConfig::new("w");
    wc.poll_interval = Duration::from_millis(20);
    wc.node = Some("n1".into());
    let stop = CancellationToken::new();
    let worker = tokio::spawn(
        Worker::new(store.clone(), registry, wc).run(stop.clone(), CancellationToken::new()),
    );
    // The store's clock stands still: the toy's first job waits for its first delay until the
    // clock is moved past it.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let toy_job = loop {
        let jobs = store.task_jobs(task.id).await.unwrap();
        if let Some(job) = jobs.iter().find(|j| j.agent == TOY_AGENT) {
            break job.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no toy job: {jobs:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Its own kind, pinned to this node, due a second after it was enqueued.
    assert_eq!(toy_job.node.as_deref(), Some("n1"), "pinned: {toy_job:?}");
    assert_eq!(
        toy_job.available_at - toy_job.created_at,
        1000,
        "the first delay: {toy_job:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(toy.runs.load(Ordering::SeqCst), 0, "not before its delay");
    db.clock.advance_ms(1001);
    let ended = loop {
        let t = store.get_task(task.id).await.unwrap().unwrap();
        if t.is_terminal() {
            break t;
        }
        if std::time::Instant::now() > deadline {
            let events = store.task_events(task.id).await.unwrap();
            let jobs = store.task_jobs(task.id).await.unwrap();
            panic!(
                "the item did not end; it is at {}\n{events:#?}\n{jobs:#?}",
                t.stage
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop.cancel();
    worker.await.unwrap();

    let history = store.task_events(task.id).await.unwrap();
    let said: Vec<String> = history
        .iter()
        .map(|e| format!("{} {}", e.kind, e.message))
        .collect();
    assert_eq!(ended.stage, "done", "{said:#?}");
    assert_eq!(toy.runs.load(Ordering::SeqCst), 1, "{said:#?}");
    let moves: Vec<(String, String)> = history
        .iter()
        .filter(|e| [events::STAGE_ADVANCED, events::TASK_DONE].contains(&e.kind.as_str()))
        .map(|e| {
            let d = e.data_value();
            (
                d["from"].as_str().unwrap_or_default().to_owned(),
                d["to"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        moves,
        [
            ("intake".to_owned(), "toy".to_owned()),
            ("toy".to_owned(), "done".to_owned())
        ]
    );

    let jobs = store.task_jobs(task.id).await.unwrap();
    let toy_jobs = jobs.iter().filter(|j| j.agent == TOY_AGENT).count();
    assert_eq!(toy_jobs, 1, "one visit, one job: {jobs:#?}");

    // What its commit holds is its descriptor's word: its document and the one it may also
    // write; the repository code's by-product is put back and said.
    let clone = repos_dir.join("app");
    let folder = "docs/work-items/APP-1";
    let files = git_out(
        &clone,
        &["ls-tree", "-r", "--name-only", "orch/APP-1", "--", folder],
    );
    let files: Vec<&str> = files.lines().collect();
    assert_eq!(
        files,
        [
            format!("{folder}/01-request.md"),
            format!("{folder}/{TOY_NOTES}"),
            format!("{folder}/{TOY_DOC}"),
        ],
    );
    let root = git_out(&clone, &["ls-tree", "--name-only", "orch/APP-1"]);
    assert!(!root.lines().any(|l| l == BY_PRODUCT), "{root}");
    assert!(
        history.iter().any(|e| e.kind == events::COMMIT_DISCARDED
            && e.stage.as_deref() == Some("toy")
            && e.message.contains(BY_PRODUCT)),
        "{said:#?}"
    );
}
