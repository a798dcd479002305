//! Crash tests with real processes: `orch worker` processes are SIGKILLed at random (seeded)
//! instants while thousands of `bench.effect` jobs run, and restarted each time. Afterwards
//! every job's effect (an event written in the transaction that marks the job done) happened
//! exactly once and no job is lost. Set `ORCH_CRASH_SEED` to replay a run.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use orch_store::testing::TestDb;
use orch_store::{ConnectOptions, JobState, NewJob, Store};
use rand::{Rng as _, SeedableRng as _};

const ORCH: &str = env!("CARGO_BIN_EXE_orch");

fn seed() -> u64 {
    std::env::var("ORCH_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x0bc4)
}

/// The test's own view of the database, on the real clock (the workers use the real clock).
async fn real_clock_store(url: &str) -> Store {
    Store::connect(url, ConnectOptions::default())
        .await
        .expect("open the test database")
}

struct Proc {
    child: tokio::process::Child,
}

impl Proc {
    fn worker(url: &str, worker_id: &str, args: &[&str], failpoints: Option<&str>) -> Proc {
        let mut cmd = tokio::process::Command::new(ORCH);
        cmd.args([
            "worker",
            "--database-url",
            url,
            "--worker-id",
            worker_id,
            "--grace-s",
            "1",
        ])
        .args(args)
        .env("ORCH_LOG", "warn")
        .env_remove("ORCH_FAILPOINTS")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
        if let Some(fp) = failpoints {
            cmd.env("ORCH_FAILPOINTS", fp);
        }
        let child = cmd.spawn().expect("spawn orch worker");
        Proc { child }
    }

    async fn kill9(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: plain syscall on our own child's pid.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        let _ = self.child.wait().await;
    }

    async fn terminate(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: plain syscall on our own child's pid.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        match tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await {
            Ok(status) => {
                let status = status.expect("wait for worker");
                assert!(status.success(), "worker exits 0 on SIGTERM, got {status}");
            }
            Err(_) => panic!("worker did not stop within 20 s of SIGTERM"),
        }
    }

    /// Waits for a process that is expected to abort itself (a failpoint).
    async fn wait_exit(mut self, within: Duration) -> std::process::ExitStatus {
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(s) => s.expect("wait"),
            Err(_) => {
                self.child.start_kill().ok();
                panic!("process did not exit within {within:?}")
            }
        }
    }
}

async fn enqueue(store: &Store, n: usize, rng: &mut rand::rngs::StdRng) -> Vec<i64> {
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let ms = rng.random_range(0..6);
        ids.push(
            store
                .enqueue(NewJob::new("bench.effect", format!("sleep_ms={ms}")).max_attempts(1000))
                .await
                .expect("enqueue")
                .job_id,
        );
    }
    ids
}

async fn unfinished(store: &Store) -> i64 {
    let stats = store.queue_stats().await.expect("queue stats");
    stats
        .counts
        .iter()
        .filter(|c| matches!(c.state, JobState::Queued | JobState::Running))
        .map(|c| c.count)
        .sum()
}

/// Jobs queued before each kill round: more than a worker finishes before its kill.
const BACKLOG: usize = 400;

/// Whether `worker` holds a running job's lease now, waiting up to `within` for it to.
async fn holds_a_lease(store: &Store, worker: &str, within: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        let stats = store.queue_stats().await.expect("queue stats");
        if stats
            .leases
            .iter()
            .any(|l| l.worker.as_deref() == Some(worker))
        {
            return true;
        }
        if t0.elapsed() >= within {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn wait_drained(store: &Store, within: Duration) {
    let t0 = Instant::now();
    while unfinished(store).await > 0 {
        assert!(
            t0.elapsed() < within,
            "jobs still unfinished after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// job id → (effects, worker of each effect)
async fn effects(store: &Store) -> HashMap<i64, Vec<String>> {
    let mut out: HashMap<i64, Vec<String>> = HashMap::new();
    let mut after = 0;
    loop {
        let page = store
            .events_by_kind("bench.effect", after, 5000)
            .await
            .expect("events");
        let Some(last) = page.last() else { break };
        after = last.id;
        for e in page {
            let v: serde_json::Value = serde_json::from_str(&e.data).expect("effect data is JSON");
            let worker = v["worker"].as_str().unwrap_or_default().to_owned();
            out.entry(e.job_id.expect("effect names its job"))
                .or_default()
                .push(worker);
        }
    }
    out
}

async fn assert_exactly_once(store: &Store, ids: &[i64]) {
    let effects = effects(store).await;
    let mut missing = Vec::new();
    let mut doubled = Vec::new();
    for id in ids {
        match effects.get(id).map(Vec::len) {
            Some(1) => {}
            None | Some(0) => missing.push(*id),
            Some(_) => doubled.push(*id),
        }
        let job = store
            .get_job(*id)
            .await
            .expect("get job")
            .expect("job exists");
        assert_eq!(job.state, JobState::Done, "job {id} finished: {job:?}");
    }
    assert!(
        missing.is_empty(),
        "jobs with no effect (lost): {missing:?}"
    );
    assert!(
        doubled.is_empty(),
        "jobs whose effect happened twice: {doubled:?}"
    );
    assert_eq!(
        effects.len(),
        ids.len(),
        "no effect for a job that was never enqueued"
    );
}

async fn kill_loop(db: TestDb) {
    let seed = seed();
    eprintln!("crash test seed {seed} (replay with ORCH_CRASH_SEED={seed})");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let store = real_clock_store(&db.url).await;
    let mut ids = enqueue(&store, 2000, &mut rng).await;
    let mut kills_mid_run = 0;
    for round in 0..50 {
        // A backlog that outlasts the round: a worker that drained the queue before its kill
        // would be killed idle, and the round would test nothing.
        let backlog = usize::try_from(unfinished(&store).await).unwrap_or(0);
        ids.extend(enqueue(&store, BACKLOG.saturating_sub(backlog).max(60), &mut rng).await);
        let batch = if rng.random_bool(0.5) { "1" } else { "8" };
        let worker_id = format!("crash-{round}");
        let w = Proc::worker(
            &db.url,
            &worker_id,
            &[
                "--concurrency",
                "4",
                "--claim-batch",
                batch,
                "--lease-ms",
                "1000",
            ],
            None,
        );
        tokio::time::sleep(Duration::from_millis(rng.random_range(60..400))).await;
        // The kill is meant to land while this worker holds a lease (a start-up slower than
        // the pause, on a loaded machine, is waited out, at most a few seconds).
        if holds_a_lease(&store, &worker_id, Duration::from_secs(5)).await {
            kills_mid_run += 1;
        }
        w.kill9().await;
    }
    // Exact instants: die right before and right after the effect's commit.
    for (i, fp) in ["effect.before_mark", "effect.after_mark"]
        .iter()
        .cycle()
        .take(6)
        .enumerate()
    {
        let w = Proc::worker(
            &db.url,
            &format!("fp-{i}"),
            &["--concurrency", "2", "--lease-ms", "1000"],
            Some(fp),
        );
        let status = w.wait_exit(Duration::from_secs(30)).await;
        assert!(!status.success(), "failpoint {fp} aborted the worker");
    }
    let last = Proc::worker(
        &db.url,
        "final",
        &["--concurrency", "4", "--lease-ms", "1000"],
        None,
    );
    wait_drained(&store, Duration::from_secs(300)).await;
    last.terminate().await;
    assert!(
        kills_mid_run >= 45,
        "most kills landed while the killed worker held a lease ({kills_mid_run}/50)"
    );
    assert_exactly_once(&store, &ids).await;
    let rescued = {
        let mut n = 0;
        for id in &ids {
            if store.get_job(*id).await.unwrap().unwrap().attempt > 1 {
                n += 1;
            }
        }
        n
    };
    eprintln!(
        "{} jobs, 50 kills ({kills_mid_run} holding a lease) + 6 failpoint aborts, {rescued} jobs re-run after a crash",
        ids.len()
    );
    assert!(
        rescued > 0,
        "some kills caught jobs in flight (else the test proves nothing)"
    );
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_workers_killed_at_random_lose_nothing_and_repeat_nothing() {
    kill_loop(TestDb::sqlite().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_workers_killed_at_random_lose_nothing_and_repeat_nothing() {
    kill_loop(TestDb::postgres().await).await;
}

/// Three workers share PostgreSQL; one is killed while it holds leases; the other two finish
/// its jobs once those leases expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_survivors_finish_the_killed_workers_jobs() {
    let db = TestDb::postgres().await;
    let store = real_clock_store(&db.url).await;
    let mut ids = Vec::new();
    for i in 0..240 {
        ids.push(
            store
                .enqueue(NewJob::new("bench.effect", format!("job {i} sleep_ms=150")))
                .await
                .unwrap()
                .job_id,
        );
    }
    let args = [
        "--concurrency",
        "2",
        "--claim-batch",
        "1",
        "--lease-ms",
        "1500",
    ];
    let a = Proc::worker(&db.url, "w-a", &args, None);
    let victim = Proc::worker(&db.url, "w-victim", &args, None);
    let c = Proc::worker(&db.url, "w-c", &args, None);
    // Kill the victim while it holds leases.
    let t0 = Instant::now();
    loop {
        let stats = store.queue_stats().await.unwrap();
        let held: Vec<i64> = stats
            .leases
            .iter()
            .filter(|l| l.worker.as_deref() == Some("w-victim"))
            .map(|l| l.job_id)
            .collect();
        if !held.is_empty() && effects(&store).await.len() >= 20 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "victim never held a lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    victim.kill9().await;
    // What the victim held when it died: its leases still on the books right after the kill.
    let held: Vec<i64> = store
        .queue_stats()
        .await
        .unwrap()
        .leases
        .iter()
        .filter(|l| l.worker.as_deref() == Some("w-victim"))
        .map(|l| l.job_id)
        .collect();
    assert!(
        !held.is_empty(),
        "the victim died holding leases (jobs take 150 ms; it runs 2 at once)"
    );
    wait_drained(&store, Duration::from_secs(120)).await;
    a.terminate().await;
    c.terminate().await;
    assert_exactly_once(&store, &ids).await;
    let effects = effects(&store).await;
    let mut taken_over = 0;
    for id in &held {
        let job = store.get_job(*id).await.unwrap().unwrap();
        let by = &effects[id][0];
        if by != "w-victim" {
            taken_over += 1;
            assert!(
                job.attempt >= 2,
                "job {id} re-ran under a new attempt: {job:?}"
            );
            assert!(
                by == "w-a" || by == "w-c",
                "job {id} finished by a survivor, not {by}"
            );
        }
    }
    assert!(
        taken_over > 0,
        "the victim's in-flight jobs {held:?} were finished by the survivors"
    );
    store.close().await;
}
