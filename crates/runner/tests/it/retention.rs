//! Retention never changes a decision. Each restart-safe counter (the staging runner's defers,
//! the merge gate's infrastructure retries, the finalizer's defers, the watch's ticks) is a
//! count of marker jobs (`Store::count_jobs`); here each is brought to its limit on three
//! tasks — one still live, one finished, one finished and then retried — with every job old
//! enough to prune. The decision each runner takes from its count (the same `JobCount` it
//! builds, compared with the same limit) is read before and after `maintenance::prune`, and
//! for the retried task in its new visit: identical. Run on SQLite and on PostgreSQL.

use std::time::Duration;

use orch_domain::control::{self, events, markers};
use orch_domain::monitor::{WatchParams, planned_polls};
use orch_runner::maintenance::{self, PRUNE_PAUSE};
use orch_store::testing::TestDb;
use orch_store::{AdvanceStage, Backend, Claim, Fence, JobCount, NewEvent, NewJob, NewTask, Task};

const DAY_MS: i64 = 24 * 3600 * 1000;
const RETENTION: Duration = Duration::from_secs(3 * 24 * 3600);

/// One counter: the stage whose runner counts, its agent, its marker in a visit, its limit.
struct Counter {
    stage: &'static str,
    agent: &'static str,
    marker: fn(i64) -> String,
    limit: u32,
}

fn staging_defers() -> Counter {
    Counter {
        stage: "staging",
        agent: "deployer",
        marker: markers::staging_defer,
        limit: orch_domain::staging::DEFAULT_DEFER_LIMIT,
    }
}

fn merge_infra_retries() -> Counter {
    Counter {
        stage: "merge",
        agent: "merge-gate",
        marker: markers::merge_infra_retry,
        limit: orch_runner::stages::merge_gate::INFRA_RETRY_LIMIT,
    }
}

fn finalizer_defers() -> Counter {
    Counter {
        stage: "deploy",
        agent: "deployer",
        marker: markers::deploy_finalize_prefix,
        limit: orch_runner::deploy::deployer::DEFAULT_FINALIZE_LIMIT,
    }
}

fn watch_ticks() -> Counter {
    let defaults = orch_domain::config::PostDeployConfig::default();
    Counter {
        stage: "observe",
        agent: "post-deploy-monitor",
        marker: markers::monitor_tick_prefix,
        limit: planned_polls(&WatchParams {
            window_s: defaults.window_s,
            interval_s: defaults.interval_s,
            initial_delay_s: defaults.initial_delay_s,
            poll_timeout_s: defaults.poll_timeout_s,
        }),
    }
}

/// What a runner decides from its count: how many so far and whether the limit is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Decision {
    so_far: i64,
    exhausted: bool,
}

/// The decision the counter's runner takes for `task` as it is now (its current visit).
async fn decide(db: &TestDb, c: &Counter, task_id: i64) -> Decision {
    let task = db.store.get_task(task_id).await.unwrap().unwrap();
    let so_far = db
        .store
        .count_jobs(&JobCount {
            task_id,
            agent: c.agent.to_owned(),
            content_contains: Some((c.marker)(task.stage_seq)),
        })
        .await
        .unwrap();
    Decision {
        so_far,
        exhausted: so_far >= i64::from(c.limit),
    }
}

async fn task_at(db: &TestDb, n: usize, stage: &str) -> Task {
    db.store
        .create_task(NewTask {
            work_item: orch_store::WorkItemSpec::Exact(format!("RET-{n}").parse().unwrap()),
            repo: "svc".parse().unwrap(),
            title: "retention".into(),
            body: String::new(),
            stage: stage.parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new(events::TASK_SUBMITTED, "submitted"),
            first_job: None,
        })
        .await
        .unwrap()
}

/// The counter's marker jobs of the task's current visit, `limit` of them, each claimed and
/// finished as the runner's requeues would be.
async fn count_to_the_limit(db: &TestDb, c: &Counter, task: &Task) {
    for n in 1..=c.limit {
        let content = format!(
            "{{\"stage\":\"{}\",\"seq\":{}}}\n{} n={n}",
            c.stage,
            task.stage_seq,
            (c.marker)(task.stage_seq)
        );
        db.store
            .enqueue(NewJob::new(c.agent, content).task(task.id))
            .await
            .unwrap();
        let claim = Claim {
            worker_id: "w".into(),
            kinds: vec![c.agent.to_owned()],
            limit: 1,
            lease_ms: 30_000,
            node: None,
            node_grace_ms: None,
        };
        let got = db.store.claim(&claim).await.unwrap();
        assert_eq!(got.len(), 1);
        db.store
            .complete_and_claim(&[got[0].lease], None)
            .await
            .unwrap();
        db.clock.advance_ms(1_000);
    }
}

async fn move_to(db: &TestDb, task_id: i64, to: &str, kind: &str) {
    let t = db.store.get_task(task_id).await.unwrap().unwrap();
    db.store
        .advance_stage(AdvanceStage {
            task_id,
            expected_stage: t.stage.clone(),
            new_stage: to.parse().unwrap(),
            fence: Fence::Seq(t.stage_seq),
            event: NewEvent::new(kind, format!("{} → {to}", t.stage)),
            next_job: None,
        })
        .await
        .unwrap();
}

async fn decisions_are_identical_before_and_after_pruning(db: TestDb, c: Counter) {
    let live = task_at(&db, 1, c.stage).await;
    let ended = task_at(&db, 2, c.stage).await;
    let retried = task_at(&db, 3, c.stage).await;
    for t in [&live, &ended, &retried] {
        count_to_the_limit(&db, &c, t).await;
    }
    for t in [&ended, &retried] {
        move_to(&db, t.id, control::CANCELLED, events::TASK_CANCELLED).await;
    }
    // Everything is now older than the retention.
    db.clock.advance_ms(4 * DAY_MS);
    let before = [
        decide(&db, &c, live.id).await,
        decide(&db, &c, ended.id).await,
        decide(&db, &c, retried.id).await,
    ];
    assert_eq!(
        before[0],
        Decision {
            so_far: i64::from(c.limit),
            exhausted: true
        },
        "the live task's counter is at its limit"
    );
    // What the retried task's new visit would count in a store never pruned: nothing yet.
    let fresh_visit = db
        .store
        .count_jobs(&JobCount {
            task_id: retried.id,
            agent: c.agent.to_owned(),
            content_contains: Some((c.marker)(
                db.store
                    .get_task(retried.id)
                    .await
                    .unwrap()
                    .unwrap()
                    .stage_seq
                    + 1,
            )),
        })
        .await
        .unwrap();

    let report = maintenance::prune(&db.store, RETENTION, 2, PRUNE_PAUSE, u32::MAX)
        .await
        .unwrap();
    assert_eq!(
        report.jobs,
        2 * u64::from(c.limit),
        "the finished tasks' jobs went, and only theirs"
    );
    assert_eq!(
        db.store.task_jobs(live.id).await.unwrap().len(),
        c.limit as usize
    );
    assert!(db.store.task_jobs(ended.id).await.unwrap().is_empty());
    let after = [
        decide(&db, &c, live.id).await,
        decide(&db, &c, ended.id).await,
        decide(&db, &c, retried.id).await,
    ];
    assert_eq!(before, after, "pruning changed a decision of {}", c.stage);

    move_to(&db, retried.id, c.stage, events::TASK_RETRIED).await;
    let d = decide(&db, &c, retried.id).await;
    assert_eq!(
        d,
        Decision {
            so_far: fresh_visit,
            exhausted: false
        },
        "the retried visit counts as in a store never pruned"
    );
    // Pruning again changes nothing and records nothing.
    let again = maintenance::prune(&db.store, RETENTION, 2, PRUNE_PAUSE, u32::MAX)
        .await
        .unwrap();
    assert_eq!(again.jobs, 0);
    assert_eq!(again.total, report.total);
    assert_eq!(decide(&db, &c, live.id).await, before[0]);
}

macro_rules! per_counter {
    ($($name:ident => $counter:expr),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = super::TestDb::new(super::Backend::Sqlite).await;
                    super::decisions_are_identical_before_and_after_pruning(db, $counter).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = super::TestDb::new(super::Backend::Postgres).await;
                    super::decisions_are_identical_before_and_after_pruning(db, $counter).await;
                }
            )*
        }
    };
}

per_counter!(
    staging_defers_decide_the_same_after_pruning => super::staging_defers(),
    merge_infra_retries_decide_the_same_after_pruning => super::merge_infra_retries(),
    finalizer_defers_decide_the_same_after_pruning => super::finalizer_defers(),
    watch_ticks_decide_the_same_after_pruning => super::watch_ticks(),
);
