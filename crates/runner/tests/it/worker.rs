//! The worker runtime against both backends: every job runs exactly once in both claim shapes,
//! shutdown drains or gives leases back, a lost lease stops its handler, and errors, panics and
//! timeouts become retries.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use orch_runner::builtin;
use orch_runner::worker::{Outcome, Registry, Worker, WorkerConfig, handler_fn};
use orch_store::testing::TestDb;
use orch_store::{JobState, NewJob, Rescue, Store};
use tokio_util::sync::CancellationToken;

macro_rules! both {
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

both!(
    every_job_runs_exactly_once_per_job_mode,
    every_job_runs_exactly_once_batched,
    two_workers_share_the_queue_without_running_a_job_twice,
    shutdown_lets_running_jobs_finish_within_the_grace,
    shutdown_past_the_grace_releases_leases_without_spending_attempts,
    lost_lease_stops_the_handler_and_its_result_is_not_recorded,
    errors_panics_and_timeouts_become_retries,
    kinds_without_a_handler_are_never_claimed,
    follow_ups_are_enqueued_once_with_their_jobs_completion,
    claims_for_jobs_not_yet_due_are_spaced_by_the_cooldown,
    a_job_to_run_now_is_claimed_at_once_whatever_the_cooldown,
    a_job_to_run_now_is_claimed_by_a_busy_loop_when_a_slot_frees,
);

fn config(concurrency: usize, batch: u32) -> WorkerConfig {
    let mut c = WorkerConfig::new(format!("test-{concurrency}-{batch}"));
    c.concurrency = concurrency;
    c.claim_batch = batch;
    c.lease = Duration::from_secs(30);
    c.poll_interval = Duration::from_millis(50);
    c.shutdown_grace = Duration::from_secs(5);
    c
}

struct Running {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Running {
    fn start(store: &Store, registry: Registry, config: WorkerConfig) -> Running {
        let stop = CancellationToken::new();
        let worker = Worker::new(store.clone(), registry, config);
        let handle = tokio::spawn(worker.run(stop.clone(), CancellationToken::new()));
        Running { stop, handle }
    }

    async fn shutdown(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("worker stops within 30s")
            .expect("worker task did not panic");
    }
}

/// Waits (up to 60 s) until `f` holds.
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..1200 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for: {what}");
}

async fn job_states(store: &Store, ids: &[i64]) -> HashMap<JobState, usize> {
    let mut counts = HashMap::new();
    for id in ids {
        let job = store.get_job(*id).await.unwrap().expect("job exists");
        *counts.entry(job.state).or_insert(0) += 1;
    }
    counts
}

async fn effects_per_job(store: &Store) -> HashMap<i64, usize> {
    let mut per_job = HashMap::new();
    let mut after = 0;
    loop {
        let page = store
            .events_by_kind(builtin::EFFECT, after, 1000)
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        after = last.id;
        for e in &page {
            *per_job
                .entry(e.job_id.expect("effect names its job"))
                .or_insert(0) += 1;
        }
    }
    per_job
}

async fn enqueue_effects(store: &Store, n: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let e = store
            .enqueue(NewJob::new(builtin::EFFECT, format!("effect {i}")))
            .await
            .unwrap();
        ids.push(e.job_id);
    }
    ids
}

async fn run_to_completion(db: &TestDb, workers: Vec<WorkerConfig>, n: usize) {
    let ids = enqueue_effects(&db.store, n).await;
    let running: Vec<Running> = workers
        .into_iter()
        .map(|c| {
            let mut r = Registry::new();
            builtin::register(&mut r);
            Running::start(&db.store, r, c)
        })
        .collect();
    let store = db.store.clone();
    let want = ids.clone();
    eventually("all jobs done", || {
        let store = store.clone();
        let want = want.clone();
        async move { job_states(&store, &want).await.get(&JobState::Done) == Some(&want.len()) }
    })
    .await;
    for r in running {
        r.shutdown().await;
    }
    let effects = effects_per_job(&db.store).await;
    assert_eq!(effects.len(), n, "every job had an effect");
    for id in &ids {
        assert_eq!(effects.get(id), Some(&1), "job {id} had exactly one effect");
    }
}

async fn every_job_runs_exactly_once_per_job_mode(db: TestDb) {
    run_to_completion(&db, vec![config(4, 1)], 300).await;
}

async fn every_job_runs_exactly_once_batched(db: TestDb) {
    run_to_completion(&db, vec![config(4, 8)], 300).await;
}

async fn two_workers_share_the_queue_without_running_a_job_twice(db: TestDb) {
    let mut a = config(3, 1);
    a.worker_id = "worker-a".into();
    let mut b = config(3, 6);
    b.worker_id = "worker-b".into();
    run_to_completion(&db, vec![a, b], 400).await;
}

/// A registry with one kind, `slow`, whose handler sleeps `sleep` and counts starts/finishes.
fn slow_registry(sleep: Duration, started: Arc<AtomicU64>, finished: Arc<AtomicU64>) -> Registry {
    let mut r = Registry::new();
    r.register(
        "slow",
        Duration::from_secs(60),
        handler_fn(move |cx| {
            let started = started.clone();
            let finished = finished.clone();
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                tokio::select! {
                    _ = tokio::time::sleep(sleep) => {}
                    _ = cx.cancel.cancelled() => return Err(anyhow::anyhow!("cancelled")),
                }
                finished.fetch_add(1, Ordering::SeqCst);
                Ok(Outcome::Done)
            }
        }),
    );
    r
}

async fn shutdown_lets_running_jobs_finish_within_the_grace(db: TestDb) {
    let started = Arc::new(AtomicU64::new(0));
    let finished = Arc::new(AtomicU64::new(0));
    let mut ids = Vec::new();
    for i in 0..2 {
        ids.push(
            db.store
                .enqueue(NewJob::new("slow", format!("{i}")))
                .await
                .unwrap()
                .job_id,
        );
    }
    let r = Running::start(
        &db.store,
        slow_registry(
            Duration::from_millis(600),
            started.clone(),
            finished.clone(),
        ),
        config(2, 1),
    );
    let s = started.clone();
    eventually("both jobs started", || {
        let s = s.clone();
        async move { s.load(Ordering::SeqCst) == 2 }
    })
    .await;
    r.shutdown().await;
    assert_eq!(finished.load(Ordering::SeqCst), 2);
    assert_eq!(
        job_states(&db.store, &ids).await.get(&JobState::Done),
        Some(&2)
    );
}

async fn shutdown_past_the_grace_releases_leases_without_spending_attempts(db: TestDb) {
    let started = Arc::new(AtomicU64::new(0));
    let finished = Arc::new(AtomicU64::new(0));
    let id = db
        .store
        .enqueue(NewJob::new("slow", "x").max_attempts(1))
        .await
        .unwrap()
        .job_id;
    let mut c = config(1, 1);
    c.shutdown_grace = Duration::from_millis(200);
    let r = Running::start(
        &db.store,
        slow_registry(Duration::from_secs(120), started.clone(), finished.clone()),
        c,
    );
    let s = started.clone();
    eventually("job started", || {
        let s = s.clone();
        async move { s.load(Ordering::SeqCst) == 1 }
    })
    .await;
    r.shutdown().await;
    assert_eq!(finished.load(Ordering::SeqCst), 0);
    let job = db.store.get_job(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Queued, "released, not failed: {job:?}");
    // With max_attempts = 1 a spent attempt would make the next run fail at once; a second
    // worker must be able to run it to the end.
    let r = Running::start(
        &db.store,
        slow_registry(Duration::from_millis(10), started.clone(), finished.clone()),
        config(1, 1),
    );
    let store = db.store.clone();
    eventually("released job done", || {
        let store = store.clone();
        async move { store.get_job(id).await.unwrap().unwrap().state == JobState::Done }
    })
    .await;
    r.shutdown().await;
}

struct CountOnDrop(Arc<AtomicU64>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

async fn lost_lease_stops_the_handler_and_its_result_is_not_recorded(db: TestDb) {
    let started = Arc::new(AtomicU64::new(0));
    let cancelled = Arc::new(AtomicU64::new(0));
    let mut r = Registry::new();
    {
        let started = started.clone();
        let cancelled = cancelled.clone();
        r.register(
            "held",
            Duration::from_secs(60),
            handler_fn(move |cx| {
                let started = started.clone();
                let cancelled = cancelled.clone();
                async move {
                    // Stopped = returned after the cancel or dropped by the runtime: either way
                    // the guard counts it.
                    let _guard = CountOnDrop(cancelled);
                    started.fetch_add(1, Ordering::SeqCst);
                    cx.cancel.cancelled().await;
                    // What a stale attempt asks for is not done: not its completion, not its
                    // follow-up (the rescued attempt asks again).
                    Ok(Outcome::DoneThen(Box::new(NewJob::new("after", "x"))))
                }
            }),
        );
    }
    let id = db
        .store
        .enqueue(NewJob::new("held", "x"))
        .await
        .unwrap()
        .job_id;
    let mut c = config(1, 1);
    c.lease = Duration::from_millis(600);
    let worker = Running::start(&db.store, r, c);
    let s = started.clone();
    eventually("handler started", || {
        let s = s.clone();
        async move { s.load(Ordering::SeqCst) == 1 }
    })
    .await;
    // Another process decides the lease expired (store time jumps past it) and rescues the job.
    db.clock.advance_ms(10_000);
    let report = db
        .store
        .rescue_expired(Rescue {
            backoff_base_ms: 3_600_000,
            backoff_max_ms: 3_600_000,
            limit: 10,
            ..Rescue::default()
        })
        .await
        .unwrap();
    assert_eq!(report.requeued, vec![id]);
    let c2 = cancelled.clone();
    eventually("handler stopped by the heartbeat", || {
        let c2 = c2.clone();
        async move { c2.load(Ordering::SeqCst) == 1 }
    })
    .await;
    worker.shutdown().await;
    let job = db.store.get_job(id).await.unwrap().unwrap();
    assert_eq!(
        job.state,
        JobState::Queued,
        "the stale handler's Done was not recorded: {job:?}"
    );
    assert_eq!(job.attempt, 1);
    let stats = db.store.queue_stats().await.unwrap();
    let after: Vec<_> = stats.counts.iter().filter(|c| c.agent == "after").collect();
    assert!(
        after.is_empty(),
        "no follow-up of the stale attempt: {after:?}"
    );
}

/// Chains of jobs, each link asking for the next as its follow-up (`Outcome::DoneThen`), some
/// delayed, each with a dedupe key, as a watch's ticks are: in both claim shapes every link
/// runs once, in order, and nothing is left queued or running.
async fn follow_ups_are_enqueued_once_with_their_jobs_completion(db: TestDb) {
    const CHAINS: u32 = 6;
    const LINKS: u32 = 15;
    type Ran = Arc<std::sync::Mutex<Vec<(u32, u32, u32)>>>;
    let ran: Ran = Arc::default();
    let mut r = Registry::new();
    {
        let ran = ran.clone();
        r.register(
            "link",
            Duration::from_secs(60),
            handler_fn(move |cx| {
                let ran = ran.clone();
                async move {
                    let parts: Vec<u32> = cx
                        .job
                        .task_content
                        .split(':')
                        .map(str::parse)
                        .collect::<Result<_, _>>()?;
                    let [round, chain, link] = parts[..] else {
                        anyhow::bail!("bad content {}", cx.job.task_content);
                    };
                    ran.lock().unwrap().push((round, chain, link));
                    if link == LINKS {
                        return Ok(Outcome::Done);
                    }
                    let next = NewJob::new("link", format!("{round}:{chain}:{}", link + 1))
                        .delay_ms(if link % 3 == 0 { 40 } else { 0 })
                        .dedupe(format!("link-{round}-{chain}-{}", link + 1));
                    Ok(Outcome::DoneThen(Box::new(next)))
                }
            }),
        );
    }
    for (round, shape) in [config(3, 1), config(4, 8)].into_iter().enumerate() {
        let round = u32::try_from(round).unwrap();
        for chain in 0..CHAINS {
            db.store
                .enqueue(NewJob::new("link", format!("{round}:{chain}:0")))
                .await
                .unwrap();
        }
        let worker = Running::start(&db.store, r.clone(), shape);
        let seen = ran.clone();
        let clock = db.clock.clone();
        eventually("every chain ran to its end", || {
            let seen = seen.clone();
            // The store's clock is the test's: the delayed links come due as it moves.
            clock.advance_ms(50);
            async move {
                let ran = seen.lock().unwrap();
                ran.iter()
                    .filter(|(r, _, l)| *r == round && *l == LINKS)
                    .count()
                    == CHAINS as usize
            }
        })
        .await;
        worker.shutdown().await;
        let ran: Vec<(u32, u32)> = ran
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, _, _)| *r == round)
            .map(|(_, c, l)| (*c, *l))
            .collect();
        assert_eq!(
            ran.len(),
            (CHAINS * (LINKS + 1)) as usize,
            "each link once: {ran:?}"
        );
        for chain in 0..CHAINS {
            let links: Vec<u32> = ran
                .iter()
                .filter(|(c, _)| *c == chain)
                .map(|(_, l)| *l)
                .collect();
            assert_eq!(
                links,
                (0..=LINKS).collect::<Vec<_>>(),
                "chain {chain} in order"
            );
        }
        let stats = db.store.queue_stats().await.unwrap();
        let left: Vec<_> = stats
            .counts
            .iter()
            .filter(|c| c.state != JobState::Done && c.count > 0)
            .collect();
        assert!(left.is_empty(), "every job done, none left: {left:?}");
    }
}

async fn errors_panics_and_timeouts_become_retries(db: TestDb) {
    let mut r = Registry::new();
    r.register(
        "err",
        Duration::from_secs(60),
        handler_fn(|_cx| async { Err(anyhow::anyhow!("boom: disk on fire")) }),
    );
    r.register(
        "panic",
        Duration::from_secs(60),
        handler_fn(|_cx| async { panic!("handler bug") }),
    );
    r.register(
        "hang",
        Duration::from_millis(200),
        handler_fn(|_cx| async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(Outcome::Done)
        }),
    );
    r.register(
        "fail",
        Duration::from_secs(60),
        handler_fn(|_cx| async {
            Ok(Outcome::Fail {
                error: "bad input".into(),
            })
        }),
    );
    let mut ids = HashMap::new();
    for kind in ["err", "panic", "hang", "fail"] {
        ids.insert(
            kind,
            db.store
                .enqueue(NewJob::new(kind, "x").max_attempts(2))
                .await
                .unwrap()
                .job_id,
        );
    }
    let w = Running::start(&db.store, r, config(4, 1));
    let store = db.store.clone();
    let want: Vec<i64> = ids.values().copied().collect();
    eventually("every job ran once and is no longer running", || {
        let store = store.clone();
        let want = want.clone();
        async move {
            for id in &want {
                let job = store.get_job(*id).await.unwrap().expect("job exists");
                // Claimed at least once (attempt 1), and back in the queue or failed.
                if job.attempt < 1 || job.state == JobState::Running || job.last_error.is_none() {
                    return false;
                }
            }
            true
        }
    })
    .await;
    w.shutdown().await;
    for (kind, want_error) in [
        ("err", "boom: disk on fire"),
        ("panic", "handler bug"),
        ("hang", "timed out"),
    ] {
        let job = db.store.get_job(ids[kind]).await.unwrap().unwrap();
        assert_eq!(job.state, JobState::Queued, "{kind} is retried: {job:?}");
        assert!(
            job.available_at > job.created_at,
            "{kind} retry is delayed (backoff)"
        );
        let err = job.last_error.unwrap_or_default();
        assert!(
            err.contains(want_error),
            "{kind}: error {err:?} mentions {want_error:?}"
        );
    }
    let failed = db.store.get_job(ids["fail"]).await.unwrap().unwrap();
    assert_eq!(failed.state, JobState::Failed);
    assert_eq!(
        failed.attempt, 1,
        "an explicit failure is final, no second attempt"
    );
}

async fn kinds_without_a_handler_are_never_claimed(db: TestDb) {
    let stranger = db
        .store
        .enqueue(NewJob::new("no-such-kind", "x"))
        .await
        .unwrap()
        .job_id;
    let known = db
        .store
        .enqueue(NewJob::new(builtin::NOOP, "x"))
        .await
        .unwrap()
        .job_id;
    let mut r = Registry::new();
    builtin::register(&mut r);
    let w = Running::start(&db.store, r, config(2, 4));
    let store = db.store.clone();
    eventually("known job done", || {
        let store = store.clone();
        async move { store.get_job(known).await.unwrap().unwrap().state == JobState::Done }
    })
    .await;
    w.shutdown().await;
    let job = db.store.get_job(stranger).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Queued);
    assert_eq!(job.attempt, 0, "never claimed");
}

/// A TCP relay to PostgreSQL that can be cut like a network link: while cut nothing crosses it
/// (bytes wait, as TCP keeps retransmitting them, and arrive when the link is back) and new
/// connections are accepted but not answered (a link that is down, not a server that refuses).
struct Link {
    port: u16,
    cut: Arc<std::sync::atomic::AtomicBool>,
}

impl Link {
    async fn to_postgres() -> Link {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let c = cut.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let cut = c.clone();
                tokio::spawn(async move {
                    wait_while_cut(&cut).await;
                    let Ok(outbound) = tokio::net::TcpStream::connect("127.0.0.1:5432").await
                    else {
                        return;
                    };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::join!(pump(ri, wo, cut.clone()), pump(ro, wi, cut));
                });
            }
        });
        Link { port, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
    }
}

async fn wait_while_cut(cut: &std::sync::atomic::AtomicBool) {
    while cut.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Copies `from` to `to`, holding what arrives while the link is cut until it is back.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        wait_while_cut(&cut).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A fresh PostgreSQL schema opened twice: directly (the rest of the cluster) and through a
/// [`Link`] that the test can cut (the worker under test).
async fn cut_off_database() -> (Store, Link, Store) {
    let url = orch_store::testing::fresh_pg_schema().await;
    let direct = Store::connect(&url, orch_store::ConnectOptions::default())
        .await
        .unwrap();
    direct.migrate().await.unwrap();
    let link = Link::to_postgres().await;
    let relayed = url.replacen("127.0.0.1:5432", &format!("127.0.0.1:{}", link.port), 1);
    assert_ne!(relayed, url, "the test database is at 127.0.0.1:5432");
    let relayed = Store::connect(&relayed, orch_store::ConnectOptions::default())
        .await
        .unwrap();
    (direct, link, relayed)
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// A worker cut off from the database (nothing crosses its link, as with a down network link)
/// stops its handler, and the child process the handler runs, once the lease it could not renew
/// is no longer certain — while it is still cut off, not when the link comes back: the database
/// still shows the job running under it. Another worker rescues and finishes the job; when the
/// link is back, the cut worker's give-back is refused by its fence and nothing of its attempt
/// is recorded. PostgreSQL only: SQLite is a file, it has no link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_from_the_database_stops_its_children_while_still_cut_off() {
    let (direct, link, cut_store) = cut_off_database().await;

    let tmp = tempfile::tempdir().unwrap();
    let pid_file = tmp.path().join("child.pid");
    let ran_elsewhere = Arc::new(AtomicU64::new(0));
    let r = long_child(&pid_file);
    let id = direct
        .enqueue(NewJob::new("long", "x"))
        .await
        .unwrap()
        .job_id;
    let mut c = config(1, 1);
    c.worker_id = "cut-off".into();
    c.lease = Duration::from_secs(3);
    let cut_worker = Worker::new(cut_store, r, c);
    let stats = cut_worker.stats();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(cut_worker.run(stop.clone(), CancellationToken::new()));

    let pid = child_pid(&pid_file).await;
    assert!(alive(pid));
    // Several renewals go through: the handler is not stopped while the link is up.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        alive(pid),
        "the child was stopped while the lease was being renewed"
    );
    assert_eq!(stats.leases_lost.load(Ordering::SeqCst), 0);

    link.set_cut(true);
    eventually("the cut-off worker stops its child", || async move {
        !alive(pid)
    })
    .await;
    assert_eq!(stats.leases_lost.load(Ordering::SeqCst), 1);
    // Still cut off: the database has not been told anything.
    let job = direct.get_job(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Running, "{job:?}");
    assert_eq!(job.locked_by.as_deref(), Some("cut-off"));

    // Another worker rescues the job once its lease has expired, and finishes it.
    eventually("the expired lease rescued", || {
        let direct = direct.clone();
        async move {
            let report = direct
                .rescue_expired(Rescue {
                    backoff_base_ms: 0,
                    backoff_max_ms: 0,
                    limit: 10,
                    ..Rescue::default()
                })
                .await
                .unwrap();
            report.requeued.contains(&id)
        }
    })
    .await;
    let mut r2 = Registry::new();
    {
        let ran = ran_elsewhere.clone();
        r2.register(
            "long",
            Duration::from_secs(60),
            handler_fn(move |_cx| {
                let ran = ran.clone();
                async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok(Outcome::Done)
                }
            }),
        );
    }
    let mut c2 = config(1, 1);
    c2.worker_id = "elsewhere".into();
    let other = Running::start(&direct, r2, c2);
    eventually("the job done elsewhere", || {
        let direct = direct.clone();
        async move { direct.get_job(id).await.unwrap().unwrap().state == JobState::Done }
    })
    .await;

    // The link comes back: the cut-off worker's attempt is refused by the fence.
    link.set_cut(false);
    eventually("the stopped attempt refused by its fence", || {
        let stats = stats.clone();
        async move { stats.fenced.load(Ordering::SeqCst) == 1 }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(60), handle)
        .await
        .expect("the cut-off worker stops")
        .unwrap();
    other.shutdown().await;
    let job = direct.get_job(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Done);
    assert_eq!(job.locked_by.as_deref(), Some("elsewhere"));
    assert_eq!(job.attempt, 2, "{job:?}");
    assert_eq!(ran_elsewhere.load(Ordering::SeqCst), 1);
    assert_eq!(stats.done.load(Ordering::SeqCst), 0);
    assert_eq!(stats.released.load(Ordering::SeqCst), 0);
}

/// Kind `long`: a handler that runs a real child (`sleep 120`, its pid in `pid_file`) until it
/// is cancelled.
fn long_child(pid_file: &std::path::Path) -> Registry {
    let mut r = Registry::new();
    let pid_file = pid_file.to_path_buf();
    r.register(
        "long",
        Duration::from_secs(300),
        handler_fn(move |cx| {
            let pid_file = pid_file.clone();
            async move {
                let cmd = orch_exec::Cmd::new("sh")
                    .args([
                        "-c",
                        &format!("echo $$ > {}; exec sleep 120", pid_file.display()),
                    ])
                    .kill_grace(Duration::from_millis(500))
                    .cancel_on(cx.cancel.clone());
                let out = orch_exec::run(&cmd).await?;
                Ok(if out.success() {
                    Outcome::Done
                } else {
                    Outcome::Fail {
                        error: "the child was stopped".into(),
                    }
                })
            }
        }),
    );
    r
}

/// The pid a [`long_child`] handler wrote, once it has.
async fn child_pid(pid_file: &std::path::Path) -> i32 {
    let read = || {
        std::fs::read_to_string(pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
    };
    eventually("the child started", || async { read().is_some() }).await;
    read().unwrap()
}

/// The same cut, but the link comes back before anyone rescued the job: the stopped attempt's
/// lease is still the worker's, so it is given back (no attempt spent, no failure recorded) and
/// the job runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_attempt_whose_lease_was_not_taken_is_given_back() {
    let (direct, link, cut_store) = cut_off_database().await;
    let tmp = tempfile::tempdir().unwrap();
    let pid_file = tmp.path().join("child.pid");
    let id = direct
        .enqueue(NewJob::new("long", "x").max_attempts(1))
        .await
        .unwrap()
        .job_id;
    let mut c = config(1, 1);
    c.worker_id = "cut-off".into();
    c.lease = Duration::from_secs(3);
    let worker = Worker::new(cut_store, long_child(&pid_file), c);
    let stats = worker.stats();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(worker.run(stop.clone(), CancellationToken::new()));
    let pid = child_pid(&pid_file).await;
    link.set_cut(true);
    eventually("the cut-off worker stops its child", || async move {
        !alive(pid)
    })
    .await;
    let _ = std::fs::remove_file(&pid_file);
    link.set_cut(false);
    eventually("the stopped attempt given back", || {
        let stats = stats.clone();
        async move { stats.released.load(Ordering::SeqCst) == 1 }
    })
    .await;
    // Given back, not failed: the one attempt it had is not spent, and it runs again here.
    let again = child_pid(&pid_file).await;
    assert_ne!(again, pid);
    assert_eq!(stats.fenced.load(Ordering::SeqCst), 0);
    assert_eq!(stats.failed.load(Ordering::SeqCst), 0);
    let job = direct.get_job(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Running, "{job:?}");
    assert_eq!(job.attempt, 2, "{job:?}");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(60), handle)
        .await
        .expect("the worker stops")
        .unwrap();
}

/// A registry whose `tick` handler counts its runs and says when one starts.
fn counting_registry(
    ran: Arc<AtomicU64>,
    started: tokio::sync::mpsc::UnboundedSender<i64>,
) -> Registry {
    let mut r = Registry::new();
    r.register(
        "tick",
        Duration::from_secs(60),
        handler_fn(move |cx| {
            let (ran, started) = (ran.clone(), started.clone());
            async move {
                ran.fetch_add(1, Ordering::SeqCst);
                let _ = started.send(cx.job.id);
                Ok(Outcome::Done)
            }
        }),
    );
    r
}

/// Jobs that come due on their own (a watch's ticks, here due every 5 ms of the store's
/// clock) are not a claim each: once a claim finds the queue drained, the next waits out the
/// cooldown, and what came due meanwhile goes in one claim. For a second the store's clock
/// stands still with every job due "in a few ms": a loop without the cooldown claims every few
/// milliseconds then (about 200 times), one with a 400 ms cooldown a handful of times.
async fn claims_for_jobs_not_yet_due_are_spaced_by_the_cooldown(db: TestDb) {
    const JOBS: usize = 20;
    for i in 0..JOBS {
        db.store
            .enqueue(NewJob::new("tick", format!("tick {i}")).delay_ms(5 * (i as i64 + 1)))
            .await
            .unwrap();
    }
    let ran = Arc::new(AtomicU64::new(0));
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    // Two slots, batched: one fetch loop on either backend.
    let mut c = config(2, 8);
    c.poll_interval = Duration::from_secs(10);
    c.fetch_cooldown = Duration::from_millis(400);
    let worker = Worker::new(db.store.clone(), counting_registry(ran.clone(), tx), c);
    let stats = worker.stats();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(worker.run(stop.clone(), CancellationToken::new()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let claims = stats.claim_query.snapshot().count;
    assert_eq!(ran.load(Ordering::SeqCst), 0, "nothing was due yet");
    // The first, one about every 400 ms after it, one more for PostgreSQL's LISTEN start.
    assert!(
        (1..=5).contains(&claims),
        "{claims} claims in a second of jobs due in a few ms, with a 400 ms cooldown"
    );
    db.clock.advance_ms(1_000);
    let counter = ran.clone();
    eventually("every job ran", || {
        let n = counter.load(Ordering::SeqCst);
        async move { n == JOBS as u64 }
    })
    .await;
    stop.cancel();
    handle.await.unwrap();
    assert_eq!(
        job_states_all(&db.store).await.get(&JobState::Done),
        Some(&JOBS),
        "every job marked done by the stop at the latest"
    );
}

/// A job enqueued to run now wakes the loop, and the cooldown does not hold it: with a
/// cooldown of a minute the job starts within seconds.
async fn a_job_to_run_now_is_claimed_at_once_whatever_the_cooldown(db: TestDb) {
    let ran = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for batch in [1, 8] {
        let mut c = config(2, batch);
        c.lease = Duration::from_secs(600);
        c.poll_interval = Duration::from_secs(60);
        c.fetch_cooldown = Duration::from_secs(60);
        let worker = Running::start(&db.store, counting_registry(ran.clone(), tx.clone()), c);
        // Let the loops make their first claim, find nothing and settle into the cooldown.
        tokio::time::sleep(Duration::from_millis(300)).await;
        for round in 0..2 {
            let id = db
                .store
                .enqueue(NewJob::new("tick", format!("now {batch} {round}")))
                .await
                .unwrap()
                .job_id;
            let started = tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .unwrap_or_else(|_| panic!("job {id} (batch {batch}) did not start within 20 s"));
            assert_eq!(started, Some(id));
        }
        worker.shutdown().await;
    }
    assert_eq!(
        job_states_all(&db.store).await.get(&JobState::Done),
        Some(&4),
        "the stop marked every finished job done"
    );
}

async fn job_states_all(store: &Store) -> HashMap<JobState, usize> {
    let stats = store.queue_stats().await.unwrap();
    let mut counts = HashMap::new();
    for c in stats.counts {
        *counts.entry(c.state).or_insert(0) += usize::try_from(c.count).unwrap();
    }
    counts
}

/// A busy batched loop whose last claim came back short (drained) gets a wake-up for a job due
/// now while its buffer is too full to claim: the next job to finish claims it, rather than
/// the poll a minute later.
async fn a_job_to_run_now_is_claimed_by_a_busy_loop_when_a_slot_frees(db: TestDb) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut r = Registry::new();
    for kind in ["gated", "quick"] {
        let (gate, tx) = (gate.clone(), tx.clone());
        r.register(
            kind,
            Duration::from_secs(600),
            handler_fn(move |cx| {
                let (gate, tx) = (gate.clone(), tx.clone());
                async move {
                    let _ = tx.send(cx.job.task_content.clone());
                    if cx.job.agent == "gated" {
                        gate.acquire().await?.forget();
                    }
                    Ok(Outcome::Done)
                }
            }),
        );
    }
    for i in 0..3 {
        db.store
            .enqueue(NewJob::new("gated", format!("gated {i}")))
            .await
            .unwrap();
    }
    // Two slots and a buffer of four: the first claim takes the three gated jobs (fewer than
    // it asked for: drained), two run and one waits in the buffer.
    let mut c = config(2, 4);
    c.lease = Duration::from_secs(600);
    c.poll_interval = Duration::from_secs(60);
    c.fetch_cooldown = Duration::from_secs(60);
    let worker = Running::start(&db.store, r, c);
    let first = [
        next(&mut rx, "a gated job").await,
        next(&mut rx, "a gated job").await,
    ];
    assert!(first.iter().all(|c| c.starts_with("gated")), "{first:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    db.store
        .enqueue(NewJob::new("quick", "quick"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // One gated job ends: the buffered one takes its slot, and the loop claims the quick job.
    gate.add_permits(1);
    assert_eq!(next(&mut rx, "the buffered gated job").await, "gated 2");
    // Another ends: the quick job takes its slot.
    gate.add_permits(1);
    assert_eq!(next(&mut rx, "the job due now").await, "quick");
    gate.add_permits(1);
    worker.shutdown().await;
    assert_eq!(
        job_states_all(&db.store).await.get(&JobState::Done),
        Some(&4),
        "every job done"
    );
}

/// The next started handler's content, within 20 s.
async fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>, what: &str) -> String {
    tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("{what} did not start within 20 s"))
        .expect("a handler started")
}

/// A claim that finds nothing because the due jobs are locked (another loop's claim in flight,
/// here another connection holding the row for two seconds) is not a drained queue: the loop
/// claims again as soon as they are free, not after the cooldown of a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_lost_a_race_for_due_jobs_does_not_cool_down() {
    let db = TestDb::postgres().await;
    let job = db
        .store
        .enqueue(NewJob::new("tick", "locked"))
        .await
        .unwrap()
        .job_id;
    let held = orch_store::testing::hold_job_row(&db.url, job, Duration::from_secs(2))
        .await
        .expect("the row is locked");
    let ran = Arc::new(AtomicU64::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut c = config(2, 1);
    c.lease = Duration::from_secs(600);
    c.poll_interval = Duration::from_secs(60);
    c.fetch_cooldown = Duration::from_secs(60);
    let worker = Running::start(&db.store, counting_registry(ran.clone(), tx), c);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the locked job was not claimed"
    );
    let started = tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("the job started within 20 s of its row being locked for 2 s");
    assert_eq!(started, Some(job));
    held.await.unwrap().expect("the lock was held and released");
    worker.shutdown().await;
}
