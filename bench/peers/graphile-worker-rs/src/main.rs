//! The Rust port of graphile-worker (crate `graphile_worker`) as a peer of `orch-bench peers`.
//! It speaks the peer protocol of bench/peers/README.md; the database is `DATABASE_URL`.
//!
//!   gw-rs-peer migrate               create the schema (the worker's `init` migrates)
//!   gw-rs-peer enqueue N             add N no-op jobs with `add_jobs`, 5,000 per call;
//!                                    prints {"enqueue_s": S} (the calls only)
//!   gw-rs-peer worker C MODE         prints `ready`, waits for `go` on stdin, then works with
//!                                    concurrency C until stdin closes; MODE `batched` = a
//!                                    local queue of 100 and completions batched without delay,
//!                                    `per-job` = the crate's defaults
//!   gw-rs-peer latency N             an idle worker (concurrency 1) in this process; N times:
//!                                    add one job, wait for its handler to start, sleep
//!                                    20–100 ms; prints {"pickup_ms": [..], "enqueue_ms": [..]}
//!
//! Errors end the program with a message and exit code 1; the harness reports them.

use std::process::ExitCode;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use graphile_worker::{
    IntoTaskHandlerResult, JobSpec, LocalQueueConfig, TaskHandler, WorkerContext, WorkerOptions,
};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncBufReadExt as _;
use tokio::sync::mpsc;

/// Where the latency run's handler reports its start.
static STARTED: OnceLock<mpsc::UnboundedSender<Instant>> = OnceLock::new();
static HANDLED: AtomicU64 = AtomicU64::new(0);

#[derive(Clone, Serialize, Deserialize)]
struct Noop {
    n: u64,
}

impl TaskHandler for Noop {
    const IDENTIFIER: &'static str = "noop";

    async fn run(self, _ctx: WorkerContext) -> impl IntoTaskHandlerResult {
        if let Some(tx) = STARTED.get() {
            let _ = tx.send(Instant::now());
        }
        HANDLED.fetch_add(1, Ordering::Relaxed);
        Ok::<(), String>(())
    }
}

type Fallible<T> = Result<T, String>;

fn database_url() -> Fallible<String> {
    std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set".to_owned())
}

/// The crate's defaults (poll interval 1 s, LISTEN/NOTIFY on) plus the batched mode's options.
fn options(concurrency: usize, batched: bool) -> Fallible<WorkerOptions> {
    let mut o = WorkerOptions::default()
        .database_url(&database_url()?)
        .max_pg_conn(u32::try_from(concurrency + 4).unwrap_or(u32::MAX).max(10))
        .concurrency(concurrency)
        .listen_os_shutdown_signals(false)
        .define_job::<Noop>();
    if batched {
        o = o
            .local_queue(LocalQueueConfig::default().with_size(100))
            .complete_job_batch_delay(Duration::ZERO)
            .fail_job_batch_delay(Duration::ZERO);
    }
    Ok(o)
}

fn count(arg: Option<&String>, what: &str) -> Fallible<usize> {
    arg.ok_or_else(|| format!("missing {what}"))?
        .parse()
        .map_err(|e| format!("bad {what}: {e}"))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("migrate") => migrate().await,
        Some("enqueue") => match count(args.get(1), "job count") {
            Ok(n) => enqueue(n).await,
            Err(e) => Err(e),
        },
        Some("worker") => match count(args.get(1), "concurrency") {
            Ok(c) => worker(c, args.get(2).map(String::as_str) == Some("batched")).await,
            Err(e) => Err(e),
        },
        Some("latency") => match count(args.get(1), "sample count") {
            Ok(n) => latency(n).await,
            Err(e) => Err(e),
        },
        _ => Err(
            "usage: gw-rs-peer migrate | enqueue N | worker C [per-job|batched] | latency N"
                .to_owned(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gw-rs-peer: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn migrate() -> Fallible<()> {
    options(1, false)?
        .init()
        .await
        .map_err(|e| format!("init (migrations): {e}"))?;
    Ok(())
}

async fn enqueue(n: usize) -> Fallible<()> {
    let worker = options(1, false)?
        .init()
        .await
        .map_err(|e| format!("init: {e}"))?;
    let utils = worker.create_utils();
    let spec = JobSpec::default();
    let jobs: Vec<(Noop, &JobSpec)> = (0..n as u64).map(|n| (Noop { n }, &spec)).collect();
    let t0 = Instant::now();
    for chunk in jobs.chunks(5_000) {
        utils
            .add_jobs::<Noop>(chunk)
            .await
            .map_err(|e| format!("add_jobs: {e}"))?;
    }
    println!("{{\"enqueue_s\": {}}}", t0.elapsed().as_secs_f64());
    Ok(())
}

async fn worker(concurrency: usize, batched: bool) -> Fallible<()> {
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    println!("ready");
    loop {
        match stdin.next_line().await {
            Ok(Some(line)) if line.trim() == "go" => break,
            Ok(Some(_)) => {}
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("reading stdin: {e}")),
        }
    }
    // Start-up (connect, migration check) counts: it happens after `go`.
    let worker = options(concurrency, batched)?
        .init()
        .await
        .map_err(|e| format!("init: {e}"))?;
    // Until stdin closes: the harness ends the run by closing it (or by a signal).
    tokio::select! {
        r = worker.run() => r.map_err(|e| format!("worker stopped: {e}")),
        _ = async { while let Ok(Some(_)) = stdin.next_line().await {} } => {
            eprintln!("gw-rs-peer: {} jobs handled", HANDLED.load(Ordering::Relaxed));
            Ok(())
        }
    }
}

async fn latency(n: usize) -> Fallible<()> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    STARTED
        .set(tx)
        .map_err(|_| "latency started twice".to_owned())?;
    let worker = std::sync::Arc::new(
        options(1, false)?
            .init()
            .await
            .map_err(|e| format!("init: {e}"))?,
    );
    let utils = worker.create_utils();
    let running = worker.clone();
    let run = tokio::spawn(async move { running.run().await });
    // Let the worker reach its idle, listening state.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut gaps = Gaps(0x9E37_79B9_7F4A_7C15);
    let (mut pickup, mut enqueue) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n as u64 {
        let t0 = Instant::now();
        utils
            .add_job(Noop { n: i }, JobSpec::default())
            .await
            .map_err(|e| format!("add_job: {e}"))?;
        let t1 = Instant::now();
        let started = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .map_err(|_| format!("job {i} was not picked up within 30 s"))?
            .ok_or("the handler channel closed")?;
        pickup.push(ms(started.saturating_duration_since(t0)));
        enqueue.push(ms(t1 - t0));
        tokio::time::sleep(Duration::from_millis(gaps.next_ms())).await;
    }
    worker.request_shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(5), run).await;
    let out = serde_json::json!({ "pickup_ms": pickup, "enqueue_ms": enqueue });
    println!("{out}");
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Idle gaps of 20–100 ms from a fixed-seed xorshift, so no poll timer lines up with them.
struct Gaps(u64);

impl Gaps {
    fn next_ms(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        20 + x % 81
    }
}
