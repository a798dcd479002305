//! Retention under kill -9, with real processes: `orch gc` is SIGKILLed at seeded random
//! instants while it prunes a backlog of old finished jobs, then run again to the end. After
//! every kill the store holds exactly what it held minus what the recorded `jobs.pruned`
//! events say was pruned (nothing deleted unrecorded, nothing counted twice), every job of a
//! live task is still there and every restart-safe counter decides as before; at the end
//! exactly the prunable jobs are gone, each batch's event counted once. On SQLite and on
//! PostgreSQL. Set `ORCH_GC_CRASH_SEED` to replay a run.

use std::process::Stdio;
use std::time::{Duration, Instant};

use orch_domain::control::{self, events, markers};
use orch_store::testing::TestDb;
use orch_store::{
    AdvanceStage, Backend, Claim, Fence, JobCount, NewEvent, NewJob, NewTask, Store, Task,
};
use rand::{Rng as _, SeedableRng as _};

const ORCH: &str = env!("CARGO_BIN_EXE_orch");
const DAY_MS: i64 = 24 * 3600 * 1000;
/// Finished tasks whose jobs are old enough to prune, and their jobs each.
const ENDED_TASKS: usize = 60;
const JOBS_PER_TASK: usize = 400;
/// Live tasks (their jobs are never pruned), each with a staging defer counter at its limit.
const LIVE_TASKS: usize = 5;

fn seed() -> u64 {
    std::env::var("ORCH_GC_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9c)
}

fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Task number `n` (from 0) of the test: work item `GC-<n + 1>` (a work item's number is
/// positive: `GC-0` is not a work item id, and the store refuses to write one).
async fn task(store: &Store, n: usize) -> Task {
    store
        .create_task(NewTask {
            work_item: orch_store::WorkItemSpec::Exact(format!("GC-{}", n + 1).parse().unwrap()),
            repo: "svc".parse().unwrap(),
            title: "gc".into(),
            body: String::new(),
            stage: "staging".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new(events::TASK_SUBMITTED, "submitted"),
            first_job: None,
        })
        .await
        .expect("create task")
}

/// `jobs` finished jobs of `task` carrying its visit's staging defer marker, through the real
/// claim and completion.
async fn finished_jobs(store: &Store, task: &Task, jobs: usize) {
    let marker = markers::staging_defer(task.stage_seq);
    let batch: Vec<NewJob> = (0..jobs)
        .map(|i| NewJob::new("deployer", format!("{i}\n{marker}")).task(task.id))
        .collect();
    store.enqueue_many(batch).await.expect("enqueue");
    let claim = Claim {
        worker_id: "fill".into(),
        kinds: vec!["deployer".into()],
        limit: u32::try_from(jobs).unwrap_or(u32::MAX),
        lease_ms: 60_000,
        node: None,
        node_grace_ms: None,
    };
    let got = store.claim(&claim).await.expect("claim");
    assert_eq!(got.len(), jobs);
    let leases: Vec<_> = got.iter().map(|c| c.lease).collect();
    let out = store
        .complete_and_claim(&leases, None)
        .await
        .expect("complete");
    assert!(out.fenced.is_empty());
}

async fn cancel(store: &Store, t: &Task) {
    store
        .advance_stage(AdvanceStage {
            task_id: t.id,
            expected_stage: t.stage.clone(),
            new_stage: control::CANCELLED.parse().unwrap(),
            fence: Fence::Seq(t.stage_seq),
            event: NewEvent::new(events::TASK_CANCELLED, "cancelled"),
            next_job: None,
        })
        .await
        .expect("cancel");
}

async fn all_jobs(store: &Store) -> i64 {
    store.count_all_jobs().await.expect("count jobs")
}

/// Sum of the `jobs` of every `jobs.pruned` event, and their number.
async fn recorded(store: &Store) -> (i64, usize) {
    let mut after = 0;
    let (mut sum, mut n) = (0, 0);
    let mut running = 0;
    loop {
        let page = store
            .events_by_kind(events::JOBS_PRUNED, after, 1000)
            .await
            .expect("events");
        let Some(last) = page.last() else { break };
        after = last.id;
        for e in page {
            let v: serde_json::Value = serde_json::from_str(&e.data).expect("JSON");
            let jobs = v["jobs"].as_i64().expect("jobs");
            running += jobs;
            assert_eq!(
                v["total"].as_i64(),
                Some(running),
                "each batch's total is the sum so far: {v}"
            );
            sum += jobs;
            n += 1;
        }
    }
    (sum, n)
}

async fn defers(store: &Store, t: &Task) -> i64 {
    store
        .count_jobs(&JobCount {
            task_id: t.id,
            agent: "deployer".into(),
            content_contains: Some(markers::staging_defer(t.stage_seq)),
        })
        .await
        .expect("count")
}

fn gc(url: &str, json: bool) -> tokio::process::Child {
    let mut cmd = tokio::process::Command::new(ORCH);
    if json {
        cmd.arg("--json");
    }
    cmd.args(["gc", "--database-url", url, "--retention", "3d"])
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd.spawn().expect("spawn orch gc")
}

async fn killed_while_pruning_loses_nothing_and_prunes_nothing_twice(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = &db.store;
    // Everything below happened ten days ago (on the store's clock), except the live tasks.
    db.clock.set(wall_ms() - 10 * DAY_MS);
    let mut live = Vec::new();
    for n in 0..LIVE_TASKS {
        let t = task(store, n).await;
        finished_jobs(
            store,
            &t,
            orch_domain::staging::DEFAULT_DEFER_LIMIT as usize,
        )
        .await;
        live.push(t);
    }
    for n in 0..ENDED_TASKS {
        let t = task(store, LIVE_TASKS + n).await;
        finished_jobs(store, &t, JOBS_PER_TASK).await;
        cancel(store, &t).await;
    }
    db.clock.set(wall_ms());
    let ended_jobs = (ENDED_TASKS * JOBS_PER_TASK) as i64;
    let initial = all_jobs(store).await;
    let live_decisions: Vec<i64> = {
        let mut v = Vec::new();
        for t in &live {
            v.push(defers(store, t).await);
        }
        v
    };
    assert!(
        live_decisions
            .iter()
            .all(|d| *d == i64::from(orch_domain::staging::DEFAULT_DEFER_LIMIT))
    );

    let seed = seed();
    eprintln!("gc crash seed: {seed} (ORCH_GC_CRASH_SEED)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut kills_mid_prune = 0;
    for round in 0..4 {
        let before = store.pruned_total().await.expect("total");
        let mut child = gc(&db.url, false);
        // Wait for this process's first batch, then kill it a random moment later.
        let t0 = Instant::now();
        loop {
            if store.pruned_total().await.expect("total") > before {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("orch gc exited ({status}) before its first batch in round {round}");
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "no batch in 60 s");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..40))).await;
        let still_running = matches!(child.try_wait(), Ok(None));
        if let Some(pid) = child.id() {
            // SAFETY: plain syscall on our own child's pid.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        let _ = child.wait().await;
        if still_running {
            kills_mid_prune += 1;
        }
        let total = store.pruned_total().await.expect("total");
        let (sum, _) = recorded(store).await;
        assert_eq!(sum, total, "the latest total is the events' sum");
        assert_eq!(
            all_jobs(store).await,
            initial - total,
            "after kill {round}: every deleted job is recorded once, nothing else is gone"
        );
        for (t, d) in live.iter().zip(&live_decisions) {
            assert_eq!(defers(store, t).await, *d, "a live task's counter changed");
        }
        if total == ended_jobs {
            break;
        }
    }
    assert!(kills_mid_prune > 0, "no kill landed while pruning");
    // Run to the end.
    let out = gc(&db.url, true).wait_with_output().await.expect("gc");
    assert!(
        out.status.success(),
        "orch gc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("gc --json");
    let total = store.pruned_total().await.expect("total");
    assert_eq!(total, ended_jobs, "exactly the prunable jobs were pruned");
    assert_eq!(doc["pruned_total"].as_i64(), Some(total));
    let (sum, batches) = recorded(store).await;
    assert_eq!(sum, ended_jobs);
    assert!(batches >= ended_jobs as usize / 500);
    assert_eq!(all_jobs(store).await, initial - ended_jobs);
    for (t, d) in live.iter().zip(&live_decisions) {
        assert_eq!(defers(store, t).await, *d);
        assert_eq!(store.task_jobs(t.id).await.expect("jobs").len() as i64, *d);
    }
    eprintln!(
        "{}: {kills_mid_prune} kill(s) mid-prune, {ended_jobs} pruned in {batches} batches",
        backend.as_str()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_gc_killed_while_pruning_loses_nothing_and_prunes_nothing_twice() {
    killed_while_pruning_loses_nothing_and_prunes_nothing_twice(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_gc_killed_while_pruning_loses_nothing_and_prunes_nothing_twice() {
    killed_while_pruning_loses_nothing_and_prunes_nothing_twice(Backend::Postgres).await;
}
