//! What follows a task's end (`task-ended`, enqueued by the store with the terminal stage
//! change), with real parts: a real checkout and orch's clone of it, a real SQLite store with a
//! manual clock, the real alert command. A failed item's notification goes out at once (the
//! webhook's job queued, the alert command run, once); its trail waits while another item holds
//! the repo's release track, then reaches the default branch (orch's clone and the user's
//! checkout) in one commit that deploy histories do not count as a change; a second run
//! publishes nothing.

use std::path::Path;
use std::sync::Arc;

use orch_domain::config::Config;
use orch_domain::control::{events, jobs};
use orch_runner::counters::Counters;
use orch_runner::ended::TaskEndedHandler;
use orch_runner::engine::{Engine, EngineConfig};
use orch_runner::live_config::LiveConfig;
use orch_runner::worker::{JobContext, JobHandler, Outcome};
use orch_store::testing::TestDb;
use orch_store::{AdvanceStage, Claim, Fence, NewEvent, NewTask, Store, Task, WorkItemSpec};

fn git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=t", "-c", "user.email=t@t"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

async fn task_at(store: &Store, id: &str, stage: &str) -> Task {
    store
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact(id.parse().unwrap()),
            repo: "app".parse().unwrap(),
            title: format!("item {id}"),
            body: String::new(),
            stage: stage.parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new(events::TASK_SUBMITTED, "submitted"),
            first_job: None,
        })
        .await
        .unwrap()
}

async fn end(store: &Store, task: &Task, stage: &str, kind: &str, reason: &str) {
    store
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: task.stage.clone(),
            new_stage: stage.parse().unwrap(),
            fence: Fence::Seq(task.stage_seq),
            event: NewEvent::new(kind, reason).data(
                serde_json::json!({"from": task.stage, "to": stage, "stage": task.stage, "reason": reason})
                    .to_string(),
            ),
            next_job: None,
        })
        .await
        .unwrap();
}

/// Claims every due job of `kind` and runs `handler` on each; returns what it answered.
async fn run_due(db: &TestDb, kind: &str, handler: &dyn JobHandler) -> Vec<Outcome> {
    let claimed = db
        .store
        .claim(&Claim {
            worker_id: "t".into(),
            limit: 10,
            lease_ms: 60_000,
            kinds: vec![kind.into()],
            node: None,
            node_grace_ms: None,
        })
        .await
        .unwrap();
    let mut out = Vec::new();
    for c in claimed {
        let cx = JobContext {
            job: c.job,
            lease: c.lease,
            store: db.store.clone(),
            worker_id: "t".into(),
            lease_ms: 60_000,
            cancel: Default::default(),
        };
        out.push(handler.run(cx).await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_items_trail_waits_for_the_track_then_reaches_the_default_branch() {
    let db = TestDb::sqlite().await;
    let store = &db.store;
    let tmp = tempfile::tempdir().unwrap();
    let checkout = tmp.path().join("app");
    std::fs::create_dir_all(&checkout).unwrap();
    git(&checkout, &["init", "-q", "-b", "main"]);
    std::fs::write(checkout.join("README.md"), "app\n").unwrap();
    git(&checkout, &["add", "-A"]);
    git(&checkout, &["commit", "-qm", "start"]);
    let alerts = tmp.path().join("alerts");
    let toml = format!(
        "[agents.analyst]\nbackend = \"claude\"\n[agents.architect]\nbackend = \"claude\"\n\
         [agents.developer]\nbackend = \"claude\"\n[agents.reviewer]\nbackend = \"claude\"\n\
         [repos.app]\npath = \"app\"\nprefix = \"APP\"\n\
         alert = \"cat >> {a}; echo >> {a}\"\nalert_webhook = \"http://127.0.0.1:9/hook\"\n",
        a = alerts.display()
    );
    let config = Arc::new(Config::from_toml_str(&toml, &|_: &str| None).unwrap());
    let repos_dir = tmp.path().join("repos");
    let engine = Arc::new(Engine::new(
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
    ));
    let handler = TaskEndedHandler {
        engine: engine.clone(),
    };
    // orch's clone, with the failed item's branch and its documents.
    let clone = repos_dir.join("app");
    std::fs::create_dir_all(&repos_dir).unwrap();
    git(
        tmp.path(),
        &[
            "clone",
            "-q",
            &checkout.display().to_string(),
            &clone.display().to_string(),
        ],
    );
    git(&clone, &["checkout", "-q", "-b", "orch/APP-1"]);
    let docs = clone.join("docs/work-items/APP-1");
    std::fs::create_dir_all(&docs).unwrap();
    std::fs::write(docs.join("01-request.md"), "# request\n").unwrap();
    std::fs::write(docs.join("15-staging-log.md"), "staging_status: FAILED\n").unwrap();
    std::fs::write(clone.join("code.py"), "the change\n").unwrap();
    git(&clone, &["add", "-A"]);
    git(
        &clone,
        &[
            "commit",
            "-qm",
            "orch: APP-1 staging\n\nWork-Item: APP-1\nStage: staging",
        ],
    );
    git(&clone, &["checkout", "-q", "--detach", "main"]);

    let failed = task_at(store, "APP-1", "staging").await;
    let holder = task_at(store, "APP-2", "deploy").await;
    end(
        store,
        &failed,
        "failed",
        events::TASK_FAILED,
        "staging failed",
    )
    .await;

    // The outcome is announced at once; the trail waits: APP-2 holds the release track.
    let first = run_due(&db, jobs::TASK_ENDED, &handler).await;
    let follow_up = match first.as_slice() {
        [Outcome::DoneThen(job)] => job.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(follow_up.delay_ms, 15_000);
    let notices = std::fs::read_to_string(&alerts).unwrap();
    let notice: serde_json::Value = serde_json::from_str(notices.lines().next().unwrap()).unwrap();
    assert_eq!(notice["event"], "outcome");
    assert_eq!(notice["outcome"], "failed");
    assert_eq!(notice["work_item"], "APP-1");
    assert!(
        notice["todo"]
            .as_str()
            .unwrap()
            .contains("orch retry APP-1"),
        "{notice}"
    );
    let queued = db
        .store
        .claim(&Claim {
            worker_id: "peek".into(),
            limit: 10,
            lease_ms: 60_000,
            kinds: vec![jobs::NOTIFY.into()],
            node: None,
            node_grace_ms: None,
        })
        .await
        .unwrap();
    assert_eq!(queued.len(), 1, "one webhook delivery job");
    let doc: serde_json::Value = serde_json::from_str(&queued[0].job.task_content).unwrap();
    assert_eq!(doc, notice, "the webhook gets the document the command got");
    assert!(
        git(&clone, &["ls-tree", "-r", "--name-only", "main"])
            .lines()
            .all(|f| !f.starts_with("docs/")),
        "nothing published while the track is held"
    );

    // APP-2 leaves the track; the follow-up publishes the trail (and only the documents).
    end(store, &holder, "done", events::TASK_DONE, "shipped").await;
    store.enqueue(*follow_up).await.unwrap();
    db.clock.advance_ms(15_001);
    let outcomes = run_due(&db, jobs::TASK_ENDED, &handler).await;
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Done)),
        "{outcomes:?}"
    );
    let on_main = git(&clone, &["ls-tree", "-r", "--name-only", "main"]);
    assert!(
        on_main.contains("docs/work-items/APP-1/01-request.md"),
        "{on_main}"
    );
    assert!(
        on_main.contains("docs/work-items/APP-1/15-staging-log.md"),
        "{on_main}"
    );
    assert!(
        !on_main.contains("code.py"),
        "the change itself never reaches main: {on_main}"
    );
    let message = git(&clone, &["log", "-1", "--format=%B", "main"]);
    assert!(message.contains("Stage: audit"), "{message}");
    // The user's checkout was clean on main: fast-forwarded.
    assert!(
        checkout
            .join("docs/work-items/APP-1/15-staging-log.md")
            .exists()
    );
    let evs = store.task_events(failed.id).await.unwrap();
    let trail: Vec<_> = evs
        .iter()
        .filter(|e| e.kind == events::TRAIL_PUBLISHED)
        .collect();
    assert_eq!(trail.len(), 1, "{evs:?}");
    assert!(
        trail[0].data.contains("\"published\":true"),
        "{}",
        trail[0].data
    );

    // A further run of the ending (a retry of the job) publishes and announces nothing again.
    let again = orch_store::NewJob::new(
        jobs::TASK_ENDED,
        serde_json::json!({"task": failed.id, "seq": failed.stage_seq + 1, "wait": 5}).to_string(),
    );
    store.enqueue(again).await.unwrap();
    let main_before = git(&clone, &["rev-parse", "main"]);
    run_due(&db, jobs::TASK_ENDED, &handler).await;
    assert_eq!(git(&clone, &["rev-parse", "main"]), main_before);
    assert_eq!(
        std::fs::read_to_string(&alerts).unwrap(),
        notices,
        "paged once"
    );
}
