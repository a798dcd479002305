//! `Ops::approve_at` on a real store, both backends: the stage check and the enqueue are one
//! compare-and-swap on the visit, so two approvals racing enqueue the stage's job once (the
//! other is a `Conflict`), and an approval of a visit the item has left enqueues nothing.

use std::sync::Arc;

use orch_domain::config::Config;
use orch_domain::control::actor::Actor;
use orch_domain::control::events;
use orch_runner::counters::Counters;
use orch_runner::engine::{Engine, EngineConfig};
use orch_runner::live_config::LiveConfig;
use orch_runner::ops::{Ops, OpsError};
use orch_store::testing::TestDb;
use orch_store::{AdvanceStage, Fence, NewEvent, NewTask, Store, Task, WorkItemSpec};

/// Operations over `db` with a pipeline whose `deploy` waits for approval.
fn ops(db: &TestDb, root: &std::path::Path) -> Ops {
    let toml = "[agents.analyst]\nbackend = \"claude\"\n[agents.architect]\nbackend = \"claude\"\n\
                [agents.developer]\nbackend = \"claude\"\n[agents.reviewer]\nbackend = \"claude\"\n\
                [repos.app]\npath = \"app\"\nprefix = \"APP\"\n\
                [pipeline.stages.deploy]\napproval = true\n";
    let config = Arc::new(Config::from_toml_str(toml, &|_: &str| None).unwrap());
    let pipeline = Arc::new(config.pipeline().unwrap());
    let engine = Engine::new(
        db.store.clone(),
        EngineConfig {
            config: config.clone(),
            live: LiveConfig::new(config.clone(), db.store.now_ms()),
            pipeline,
            root: root.to_path_buf(),
            repos_dir: root.join("repos"),
            node: "n1".into(),
        },
        Arc::new(Counters::new()),
    );
    Ops::new(db.store.clone(), Arc::new(engine))
}

/// A task of repo `app` waiting at `deploy` (no job: it waits for the approval).
async fn waiting(store: &Store) -> Task {
    store
        .create_task(NewTask {
            work_item: WorkItemSpec::Next {
                prefix: "APP".parse().unwrap(),
            },
            repo: "app".parse().unwrap(),
            title: "a change".into(),
            body: String::new(),
            stage: "deploy".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "submitted"),
            first_job: None,
        })
        .await
        .unwrap()
}

fn operator(n: usize) -> Actor {
    Actor::Orch {
        what: format!("operator {n}"),
    }
}

/// The task's jobs and `stage.approved` events.
async fn written(store: &Store, task: &Task) -> (usize, usize) {
    let jobs = store.task_jobs(task.id).await.unwrap().len();
    let approvals = store
        .task_events(task.id)
        .await
        .unwrap()
        .iter()
        .filter(|e| e.kind == events::STAGE_APPROVED)
        .count();
    (jobs, approvals)
}

async fn approvals_race_and_one_wins(db: TestDb) {
    let tmp = tempfile::tempdir().unwrap();
    let ops = ops(&db, tmp.path());
    for _ in 0..3 {
        let task = waiting(&db.store).await;
        let mut racing = Vec::new();
        for n in 0..4 {
            let ops = ops.clone();
            let id = task.work_item_id.clone();
            racing.push(tokio::spawn(async move {
                ops.approve_at(id.as_str(), &operator(n), Some(("deploy", 0)))
                    .await
            }));
        }
        let (mut won, mut conflicts) = (0, 0);
        for r in racing {
            match r.await.unwrap() {
                Ok(_) => won += 1,
                Err(OpsError::Conflict(_)) => conflicts += 1,
                Err(e) => panic!("unexpected: {e}"),
            }
        }
        assert_eq!((won, conflicts), (1, 3), "exactly one approval wins");
        assert_eq!(
            written(&db.store, &task).await,
            (1, 1),
            "one job, one event"
        );
    }
}

async fn an_approval_of_a_visit_the_item_left_enqueues_nothing(db: TestDb) {
    let tmp = tempfile::tempdir().unwrap();
    let ops = ops(&db, tmp.path());
    let task = waiting(&db.store).await;
    // The item moves on (here: cancelled back and retried into a new visit of `deploy`).
    let moved = db
        .store
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "deploy".parse().unwrap(),
            new_stage: "failed".parse().unwrap(),
            fence: Fence::Seq(task.stage_seq),
            event: NewEvent::new(events::TASK_FAILED, "failed"),
            next_job: None,
        })
        .await
        .unwrap()
        .task;
    let again = db
        .store
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "failed".parse().unwrap(),
            new_stage: "deploy".parse().unwrap(),
            fence: Fence::Seq(moved.stage_seq),
            event: NewEvent::new(events::TASK_RETRIED, "retried"),
            next_job: None,
        })
        .await
        .unwrap()
        .task;
    let before = written(&db.store, &task).await;
    let stale = ops
        .approve_at(
            task.work_item_id.as_str(),
            &operator(0),
            Some(("deploy", task.stage_seq)),
        )
        .await;
    assert!(matches!(stale, Err(OpsError::Conflict(_))), "{stale:?}");
    assert_eq!(written(&db.store, &task).await, before, "nothing written");
    // The visit it is at is approved once.
    ops.approve_at(
        task.work_item_id.as_str(),
        &operator(1),
        Some(("deploy", again.stage_seq)),
    )
    .await
    .unwrap();
    let twice = ops.approve(task.work_item_id.as_str(), &operator(2)).await;
    assert!(matches!(twice, Err(OpsError::Conflict(_))), "{twice:?}");
    let (jobs, approvals) = written(&db.store, &task).await;
    assert_eq!((jobs - before.0, approvals - before.1), (1, 1));
}

macro_rules! both_backends {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(orch_store::testing::TestDb::sqlite().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(orch_store::testing::TestDb::postgres().await).await;
                }
            )*
        }
    };
}

both_backends!(
    approvals_race_and_one_wins,
    an_approval_of_a_visit_the_item_left_enqueues_nothing,
);
