//! `orch-bench queue`: the peer queues' benchmark method (docs/benchmarks.md) applied to orch's
//! queue. Workload A: bulk-enqueue N no-op jobs (chunks of 5,000), then drain them with P real
//! `orch worker` processes × C concurrency, timing from their spawn until no unfinished job is
//! left (polled every 20 ms). Workload B: one idle worker (concurrency 1); N times, enqueue one
//! job and wait for its handler to start; idle gaps of 20–100 ms. `queue-api` times `GET /queue`
//! over a large store; `serve` times `orch serve` start-up and idle memory. Figures are printed,
//! never asserted.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use orch_runner::builtin;
use orch_runner::worker::{Outcome, Registry, Worker, WorkerConfig, handler_fn};
use orch_store::{Clock as _, ConnectOptions, JobState, NewJob, Store};
use rand::{Rng as _, SeedableRng as _};
use tokio_util::sync::CancellationToken;

use crate::cli::{BenchBackend, BenchQueueApiArgs, BenchQueueArgs, ServeProject};
use crate::{Context, pgbench, print_json};

pub(crate) struct Target {
    pub(crate) name: &'static str,
    pub(crate) url: String,
    pub(crate) _dir: Option<tempfile::TempDir>,
}

pub async fn queue(cx: &Context, args: BenchQueueArgs) -> Result<ExitCode> {
    let mut results = Vec::new();
    for backend in selected(args.backend) {
        let baseline = if backend == "postgres" && args.baseline_s > 0 {
            let target = fresh_target(backend, &args).await?;
            let b = pgbench::baseline(&target.url, args.baseline_s).await?;
            if let Some(b) = b {
                eprintln!(
                    "{backend:<8} pgbench baseline, 8 clients: claim+done {:>8.0} jobs/s   \
                     claim 10 + done 10 {:>8.0} jobs/s",
                    b.per_job, b.batch10
                );
                results.push(serde_json::json!({
                    "backend": "postgres", "workload": "pgbench baseline",
                    "per_job_per_s": b.per_job.round(), "batch10_per_s": b.batch10.round(),
                }));
            }
            b
        } else {
            None
        };
        for (procs, conc) in [(1usize, 8usize), (2, 4)] {
            for batch in [1u32, args.claim_batch] {
                let target = fresh_target(backend, &args).await?;
                let r = throughput(cx, &target, args.jobs, procs, conc, batch).await?;
                let versus =
                    baseline.map(|b| r.jobs_per_s / if batch == 1 { b.per_job } else { b.batch10 });
                eprintln!(
                    "{backend:<8} {procs}x{conc} {:<8} enqueue {:>9.0}/s  drain {:>8.0} jobs/s{}",
                    if batch == 1 { "per-job" } else { "batched" },
                    r.enqueue_per_s,
                    r.jobs_per_s,
                    versus.map_or(String::new(), |v| format!("  ({v:.2}x pgbench)"))
                );
                results.push(serde_json::json!({
                    "backend": target.name, "processes": procs, "concurrency": conc,
                    "mode": if batch == 1 { "per-job" } else { "batched" },
                    "claim_batch": batch, "jobs": args.jobs,
                    "bulk_enqueue_per_s": r.enqueue_per_s.round(),
                    "jobs_per_s": r.jobs_per_s.round(),
                    "versus_pgbench": versus.map(round2),
                }));
            }
        }
        let target = fresh_target(backend, &args).await?;
        let l = latency(&target, args.latency_jobs).await?;
        eprintln!(
            "{backend:<8} latency p50 {:.2} ms  p95 {:.2} ms  p99 {:.2} ms  (enqueue call p50 {:.2} ms)",
            l.p50, l.p95, l.p99, l.enqueue_p50
        );
        results.push(serde_json::json!({
            "backend": target.name, "workload": "latency", "samples": args.latency_jobs,
            "p50_ms": round2(l.p50), "p95_ms": round2(l.p95), "p99_ms": round2(l.p99),
            "enqueue_call_p50_ms": round2(l.enqueue_p50),
        }));
    }
    if cx.json {
        print_json(&serde_json::Value::Array(results));
    }
    Ok(ExitCode::SUCCESS)
}

/// The backends a `--backend` choice names, SQLite first.
pub(crate) fn selected(choice: BenchBackend) -> impl Iterator<Item = &'static str> {
    ["sqlite", "postgres"].into_iter().filter(move |b| {
        matches!(
            (choice, *b),
            (BenchBackend::All, _)
                | (BenchBackend::Sqlite, "sqlite")
                | (BenchBackend::Postgres, "postgres")
        )
    })
}

pub(crate) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

async fn fresh_target(backend: &'static str, args: &BenchQueueArgs) -> Result<Target> {
    fresh_target_at(backend, &args.pg_url).await
}

pub(crate) async fn fresh_target_at(backend: &'static str, pg_url: &str) -> Result<Target> {
    if backend == "sqlite" {
        let dir = tempfile::tempdir().context("cannot create a temp dir for the bench database")?;
        let url = format!("sqlite://{}", dir.path().join("bench.db").display());
        return Ok(Target {
            name: "sqlite",
            url,
            _dir: Some(dir),
        });
    }
    // SAFETY of the env var: read only by the testing helper, set before any worker starts.
    unsafe { std::env::set_var("ORCH_TEST_PG_URL", pg_url) };
    let url = orch_store::testing::fresh_pg_schema().await;
    Ok(Target {
        name: "postgres",
        url,
        _dir: None,
    })
}

pub(crate) async fn open(target: &Target, pool: u32) -> Result<Store> {
    let store = Store::connect(
        &target.url,
        ConnectOptions {
            create_if_missing: true,
            max_connections: pool,
            ..ConnectOptions::default()
        },
    )
    .await?;
    store.migrate().await?;
    Ok(store)
}

pub(crate) struct Throughput {
    pub(crate) enqueue_per_s: f64,
    pub(crate) jobs_per_s: f64,
}

pub(crate) async fn throughput(
    cx: &Context,
    target: &Target,
    n: usize,
    procs: usize,
    conc: usize,
    batch: u32,
) -> Result<Throughput> {
    let store = open(target, 4).await?;
    let t0 = Instant::now();
    let mut left = n;
    while left > 0 {
        let chunk = left.min(5_000);
        let jobs = (0..chunk).map(|_| NewJob::new(builtin::NOOP, "")).collect();
        store.enqueue_many(jobs).await?;
        left -= chunk;
    }
    let enqueue_per_s = n as f64 / t0.elapsed().as_secs_f64();
    // The workers are real `orch worker` processes of this binary, as the peers' were their
    // own processes: started after the enqueue, the clock running from their spawn (start-up
    // included) until the store has no queued or running job, polled every 20 ms.
    let exe = &cx.orch;
    let no_config = tempfile::tempdir().context("temp dir for the bench workers")?;
    let start = Instant::now();
    let mut children = Vec::with_capacity(procs);
    for p in 0..procs {
        let child = tokio::process::Command::new(exe)
            .arg("-q")
            .arg("--config")
            // Absent: the workers run only the built-in kinds, whatever the current directory.
            .arg(no_config.path().join("orch.toml"))
            .args(["--database-url", &target.url, "worker"])
            .args(["--concurrency", &conc.to_string()])
            .args(["--claim-batch", &batch.to_string()])
            .args(["--worker-id", &format!("bench-{p}")])
            .env_remove("ORCH_DATABASE_URL")
            .env_remove("ORCH_WORKERS")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot spawn an orch worker for the bench")?;
        children.push(child);
    }
    loop {
        if !store.has_live_jobs().await? {
            break;
        }
        for c in &mut children {
            if let Some(status) = c.try_wait().context("cannot watch a bench worker")? {
                anyhow::bail!("a bench worker exited during the drain: {status}");
            }
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(900),
            "the drain took over 15 minutes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let stats = store.queue_stats().await?;
    let done: i64 = stats
        .counts
        .iter()
        // Only the drained kind: a worker with a node name also keeps a `node-beacon` row.
        .filter(|c| c.state == JobState::Done && c.agent == builtin::NOOP)
        .map(|c| c.count)
        .sum();
    anyhow::ensure!(
        done == i64::try_from(n).unwrap_or(i64::MAX),
        "{done} of {n} jobs done after the drain"
    );
    for mut c in children {
        // Idle by now and holding no lease: a kill loses nothing.
        let _ = c.start_kill();
        let _ = c.wait().await;
    }
    store.close().await;
    Ok(Throughput {
        enqueue_per_s,
        jobs_per_s: n as f64 / elapsed,
    })
}

pub(crate) struct Latency {
    pub(crate) p50: f64,
    pub(crate) p95: f64,
    pub(crate) p99: f64,
    pub(crate) enqueue_p50: f64,
}

pub(crate) async fn latency(target: &Target, samples: usize) -> Result<Latency> {
    let store = open(target, 4).await?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let mut registry = Registry::new();
    registry.register(
        "bench.latency",
        Duration::from_secs(60),
        handler_fn(move |_cx| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(Instant::now());
                Ok(Outcome::Done)
            }
        }),
    );
    let mut config = WorkerConfig::new("bench-latency");
    config.concurrency = 1;
    config.claim_batch = 1;
    let stop = CancellationToken::new();
    // One store for the enqueuer and the worker, as in `orch serve` (the API and the workers
    // share it): on SQLite the wake-up is in-process; on PostgreSQL it is LISTEN/NOTIFY anyway.
    let worker = tokio::spawn(
        Worker::new(store.clone(), registry, config).run(stop.clone(), CancellationToken::new()),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut lat = Vec::with_capacity(samples);
    let mut enq = Vec::with_capacity(samples);
    for i in 0..samples {
        let t0 = Instant::now();
        store
            .enqueue(NewJob::new("bench.latency", format!("{i}")))
            .await?;
        enq.push(t0.elapsed().as_secs_f64() * 1000.0);
        let t1 = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .context("a latency job was not picked up within 30 s")?
            .context("the latency worker stopped")?;
        lat.push(t1.duration_since(t0).as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_millis(rng.random_range(20..=100))).await;
    }
    stop.cancel();
    let _ = worker.await;
    store.close().await;
    Ok(Latency {
        p50: percentile(&mut lat, 0.50),
        p95: percentile(&mut lat, 0.95),
        p99: percentile(&mut lat, 0.99),
        enqueue_p50: percentile(&mut enq, 0.50),
    })
}

pub(crate) fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((v.len() as f64 - 1.0) * q).round() as usize;
    v[idx.min(v.len() - 1)]
}

/// Starts `orch serve` in a fresh project `runs` times: time until `/healthz` answers, and
/// resident memory after `idle_s` idle. The project is the demo's (`orch demo --setup-only`:
/// its config, repo and SQLite database) or an empty `orch init` one.
pub async fn serve(
    cx: &Context,
    runs: usize,
    project: ServeProject,
    idle_s: u64,
) -> Result<ExitCode> {
    let exe = &cx.orch;
    let tmp = tempfile::tempdir().context("cannot create a temp dir")?;
    let dir = tmp.path().join("project");
    setup_project(exe, &dir, project).await?;
    let mut startup_ms = Vec::new();
    let mut rss_kib = Vec::new();
    for _ in 0..runs.max(1) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let t0 = Instant::now();
        let mut child = tokio::process::Command::new(exe)
            .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
            .current_dir(&dir)
            .env("ORCH_LOG", "error")
            .env_remove("ORCH_DATABASE_URL")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        wait_healthy(port, t0, Duration::from_secs(30)).await?;
        startup_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_secs(idle_s)).await;
        if let Some(pid) = child.id() {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            if let Some(kib) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
            {
                rss_kib.push(kib);
            }
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        let _ = child.wait().await;
    }
    let p50_start = percentile(&mut startup_ms, 0.5);
    let p50_rss = percentile(&mut rss_kib, 0.5) / 1024.0;
    let max_rss = percentile(&mut rss_kib, 1.0) / 1024.0;
    eprintln!(
        "orch serve ({project:?} project): start-up to /healthz p50 {p50_start:.1} ms over {} runs; \
         RSS after {idle_s} s idle p50 {p50_rss:.1} MiB (max {max_rss:.1})",
        startup_ms.len()
    );
    if cx.json {
        print_json(&serde_json::json!({
            "project": format!("{project:?}").to_lowercase(), "runs": startup_ms.len(),
            "startup_ms_p50": round2(p50_start), "idle_s": idle_s,
            "idle_rss_mib_p50": round2(p50_rss), "idle_rss_mib_max": round2(max_rss),
        }));
    }
    Ok(ExitCode::SUCCESS)
}

/// Creates a fresh project in `dir` (created if missing) with the `orch` binary `exe`: the
/// demo's (`orch demo --setup-only`: its config, sample repo and SQLite database) or an empty
/// `orch init` one.
pub(crate) async fn setup_project(
    exe: &std::path::Path,
    dir: &std::path::Path,
    project: ServeProject,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the project dir {}", dir.display()))?;
    let mut cmd = tokio::process::Command::new(exe);
    match project {
        ServeProject::Init => cmd.arg("init"),
        ServeProject::Demo => cmd
            .args(["-q", "demo", "--setup-only", "--dir"])
            .arg(dir)
            .env_remove("ORCH_DATABASE_URL"),
    };
    let setup = cmd
        .current_dir(dir)
        .output()
        .await
        .with_context(|| format!("cannot run {} for the {project:?} project", exe.display()))?;
    anyhow::ensure!(
        setup.status.success(),
        "the {project:?} project setup failed: {}",
        String::from_utf8_lossy(&setup.stderr)
    );
    Ok(())
}

/// Polls `GET /healthz` on 127.0.0.1:`port` every 2 ms until it answers 200; an error once
/// `limit` has passed since `since`.
pub(crate) async fn wait_healthy(port: u16, since: Instant, limit: Duration) -> Result<()> {
    while since.elapsed() < limit {
        if healthz(port).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    anyhow::bail!(
        "orch serve did not answer /healthz within {} s",
        limit.as_secs()
    )
}

async fn healthz(port: u16) -> bool {
    http(port, "GET", "/healthz", None, None, Duration::from_secs(2))
        .await
        .is_ok_and(|r| r.status == 200)
}

/// An HTTP answer: status and body (de-chunked).
pub(crate) struct HttpAnswer {
    pub(crate) status: u16,
    pub(crate) body: Vec<u8>,
}

/// One HTTP/1.1 request to 127.0.0.1:`port` on a new connection (`Connection: close`), as a
/// client without keep-alive makes it: connect, send, read the whole answer, all within
/// `timeout`. `token` is sent as a bearer token; `json` as an `application/json` body.
pub(crate) async fn http(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    json: Option<&str>,
    timeout: Duration,
) -> Result<HttpAnswer> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .with_context(|| format!("cannot connect to 127.0.0.1:{port}"))?;
        let mut req =
            format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
        if let Some(t) = token {
            req.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        if let Some(b) = json {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        req.push_str("\r\n");
        req.push_str(json.unwrap_or_default());
        s.write_all(req.as_bytes())
            .await
            .with_context(|| format!("cannot send {method} {path}"))?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf)
            .await
            .with_context(|| format!("cannot read the answer to {method} {path}"))?;
        anyhow::Ok(buf)
    };
    let buf = tokio::time::timeout(timeout, exchange)
        .await
        .with_context(|| format!("{method} {path} took over {} s", timeout.as_secs_f64()))??;
    parse_answer(&buf).with_context(|| format!("the answer to {method} {path}"))
}

fn parse_answer(buf: &[u8]) -> Result<HttpAnswer> {
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of the headers")?;
    let head = String::from_utf8_lossy(&buf[..split]);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .with_context(|| format!("no status in {:?}", head.lines().next().unwrap_or_default()))?;
    let raw = &buf[split + 4..];
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked { dechunk(raw)? } else { raw.to_vec() };
    Ok(HttpAnswer { status, body })
}

fn dechunk(mut raw: &[u8]) -> Result<Vec<u8>> {
    let mut body = Vec::with_capacity(raw.len());
    loop {
        let eol = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("a chunk size line without an end")?;
        let size_text = String::from_utf8_lossy(&raw[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("a bad chunk size {size_text:?}"))?;
        raw = &raw[eol + 2..];
        if size == 0 {
            return Ok(body);
        }
        anyhow::ensure!(raw.len() >= size + 2, "a chunk cut short");
        body.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// `orch bench queue-api`: fills a fresh store per backend with `tasks` tasks and `jobs` jobs
/// (spread over the tasks and eight agents, in the mix of [`JobMix`]), serves `orch_api::app`
/// on a real loopback listener, and times `requests` sequential `GET /queue` calls and as many
/// of the dashboard's home page `GET /` (connect, request, whole answer). Operations are inert:
/// the figure is the store's share.
///
/// The store is a year of history around a fixed amount of work in flight, as an installation
/// that has run for a while holds it: the finished jobs finished, and the ended tasks ended,
/// spread over the past 365 days (the fill runs on a clock set back in time, through the real
/// claim/complete path), the last [`RECENT_FINISHED`] jobs and [`RECENT_ENDED`] tasks within
/// the last 24 hours; [`LIVE_TASKS`] tasks live and the jobs in flight as [`JobMix`] says, the
/// same at every size. Only the history grows with `--jobs` and `--tasks`.
pub async fn queue_api(cx: &Context, args: BenchQueueApiArgs) -> Result<ExitCode> {
    let mut results = Vec::new();
    for backend in selected(args.backend) {
        let target = fresh_target_at(backend, &args.pg_url).await?;
        let real_now = orch_store::SystemClock.now_ms();
        let clock = orch_store::ManualClock::new(real_now - YEAR_MS);
        let fill = Store::connect(
            &target.url,
            ConnectOptions {
                create_if_missing: true,
                max_connections: 8,
                clock: clock.clone(),
                ..ConnectOptions::default()
            },
        )
        .await?;
        fill.migrate().await?;
        let t0 = Instant::now();
        let task_ids = fill_tasks(&fill, &clock, args.tasks, real_now).await?;
        let tasks_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mix = fill_jobs(&fill, &clock, &task_ids, args.jobs, real_now).await?;
        let jobs_s = t1.elapsed().as_secs_f64();
        // The planner's statistics after the bulk load (PostgreSQL), as autovacuum would have
        // them on an installation that grew to this size over months.
        fill.refresh_statistics().await?;
        fill.close().await;
        // And, with --vacuum, the visibility map as autovacuum leaves it (a server with
        // autovacuum off, as this project's, never sets it: every index-only count then reads
        // the table's rows too).
        if args.vacuum && backend == "postgres" {
            crate::pgbench::psql(&target.url, &["VACUUM (ANALYZE) tasks, jobs"]).await?;
        }
        eprintln!(
            "{backend:<8} filled {} tasks ({} live) in {tasks_s:.1} s, {} jobs in {jobs_s:.1} s \
             ({} done, {} failed, {} running, {} ready, {} delayed)",
            task_ids.len(),
            LIVE_TASKS.min(task_ids.len()),
            args.jobs,
            mix.done,
            mix.failed,
            mix.running,
            mix.ready,
            mix.delayed
        );
        let store = open(&target, 8).await?;
        let size = store.database_size().await.ok();
        let mut q = time_route(&store, "/queue", args.requests).await?;
        let mut d = time_route(&store, "/", args.requests).await?;
        store.close().await;
        let (p50, p95, max) = (
            percentile(&mut q, 0.50),
            percentile(&mut q, 0.95),
            percentile(&mut q, 1.0),
        );
        let (d50, d95, dmax) = (
            percentile(&mut d, 0.50),
            percentile(&mut d, 0.95),
            percentile(&mut d, 1.0),
        );
        eprintln!(
            "{backend:<8} GET /queue over {} requests: p50 {p50:.2} ms  p95 {p95:.2} ms  max {max:.2} ms",
            q.len()
        );
        eprintln!(
            "{backend:<8} GET / (dashboard) over {} requests: p50 {d50:.2} ms  p95 {d95:.2} ms  max {dmax:.2} ms",
            d.len()
        );
        results.push(serde_json::json!({
            "backend": target.name, "tasks": task_ids.len(), "jobs": args.jobs,
            "live_tasks": LIVE_TASKS.min(task_ids.len()),
            "running": mix.running, "ready": mix.ready, "delayed": mix.delayed,
            "database_bytes": size, "vacuumed": args.vacuum && backend == "postgres",
            "requests": q.len(), "queue_p50_ms": round2(p50), "queue_p95_ms": round2(p95),
            "queue_max_ms": round2(max), "dashboard_p50_ms": round2(d50),
            "dashboard_p95_ms": round2(d95), "dashboard_max_ms": round2(dmax),
        }));
    }
    if cx.json {
        print_json(&serde_json::json!({ "queue_api": results }));
    }
    Ok(ExitCode::SUCCESS)
}

const YEAR_MS: i64 = 365 * 24 * 3_600_000;
const HOUR_MS: i64 = 3_600_000;
/// Tasks in flight (spread over four live stages), at every size.
const LIVE_TASKS: usize = 2_000;
/// Ended tasks that ended within the last 24 hours.
const RECENT_ENDED: usize = 200;
/// Finished jobs that finished within the last 24 hours (one fill chunk).
const RECENT_FINISHED: usize = 5_000;

/// Creates `n` tasks: the first `n - LIVE_TASKS` ended (done), created and ended over the past
/// year, the last [`RECENT_ENDED`] of them within the last day; then [`LIVE_TASKS`] live ones.
async fn fill_tasks(
    store: &Store,
    clock: &orch_store::ManualClock,
    n: usize,
    real_now: i64,
) -> Result<Vec<i64>> {
    const LIVE: [&str; 4] = ["intake", "analysis", "implementation", "review"];
    let live = LIVE_TASKS.min(n);
    let ended = n - live;
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let (stage, at) = if i < ended {
            let at = if i + RECENT_ENDED >= ended {
                real_now - HOUR_MS
            } else {
                real_now - YEAR_MS + (i as i64) * (YEAR_MS - 2 * 24 * HOUR_MS) / (ended as i64)
            };
            ("done", at)
        } else {
            (LIVE[i % LIVE.len()], real_now - HOUR_MS)
        };
        clock.set(at);
        let task = store
            .create_task(orch_store::NewTask {
                work_item: orch_store::WorkItemSpec::Exact(format!("BENCH-{}", i + 1).parse()?),
                repo: format!("repo{}", i % 10).parse()?,
                title: format!("bench task {i}"),
                body: String::new(),
                stage: stage.parse()?,
                branch_prefix: "orch/".into(),
                event: orch_store::NewEvent::new(
                    orch_domain::control::events::TASK_SUBMITTED,
                    "bench",
                ),
                first_job: None,
            })
            .await
            .with_context(|| format!("cannot create bench task {i}"))?;
        ids.push(task.id);
    }
    Ok(ids)
}

/// Fills the store with `n` jobs: the work in flight of [`JobMix`] (a few hundred running under
/// live leases, a backlog ready to run and more waiting for a later time), and the rest history:
/// finished (done, some failed) through the real claim/complete path, in chunks of 5,000 whose
/// clock moves over the past year, the last chunk within the last day.
async fn fill_jobs(
    store: &Store,
    clock: &orch_store::ManualClock,
    task_ids: &[i64],
    n: usize,
    real_now: i64,
) -> Result<JobMix> {
    const AGENTS: [&str; 8] = [
        "analyst",
        "architect",
        "developer",
        "reviewer",
        "tester",
        "merge",
        "staging",
        "deployer",
    ];
    // The last chunk is the recent one: RECENT_FINISHED jobs finished within the last day.
    const CHUNK: usize = RECENT_FINISHED;
    let mix = JobMix::of(n);
    let job = |i: usize, delay_s: i64| {
        let mut job = NewJob::new(AGENTS[i % AGENTS.len()], format!("{i}"));
        if let Some(t) = task_ids.get(i % task_ids.len().max(1)) {
            job = job.task(*t);
        }
        job.delay_s(delay_s)
    };
    let claim = orch_store::Claim {
        worker_id: "bench-fill".into(),
        limit: 5_000,
        lease_ms: 3_600_000,
        kinds: AGENTS.iter().map(|a| (*a).to_owned()).collect(),
        node: None,
        node_grace_ms: None,
    };
    // Claims exactly `want` jobs (the only queued ones at the time).
    let claim_all = |want: usize| {
        let claim = claim.clone();
        async move {
            let mut claimed = Vec::with_capacity(want);
            while claimed.len() < want {
                let mut c = claim.clone();
                c.limit = u32::try_from((want - claimed.len()).min(CHUNK)).unwrap_or(5_000);
                let got = store.claim(&c).await?;
                anyhow::ensure!(
                    !got.is_empty(),
                    "bench fill: the queue ran dry while claiming"
                );
                claimed.extend(got.into_iter().map(|c| c.lease));
            }
            anyhow::Ok(claimed)
        }
    };
    // 1. History: failed jobs (no task: a failed job would fail its task too) a year ago.
    clock.set(real_now - YEAR_MS);
    let failed: Vec<NewJob> = (0..mix.failed)
        .map(|i| NewJob::new(AGENTS[i % AGENTS.len()], format!("f{i}")).max_attempts(1))
        .collect();
    enqueue_chunked(store, failed).await?;
    for lease in claim_all(mix.failed).await? {
        store
            .mark_job(
                lease,
                orch_store::JobOutcome::Failed {
                    error: "bench: failed on purpose".into(),
                },
                None,
            )
            .await?;
    }
    // 2. History: done jobs, a chunk at a time over the year; the last chunk in the last day.
    let chunks = mix.done.div_ceil(CHUNK).max(1);
    let mut done = 0;
    for k in 0..chunks {
        let size = CHUNK.min(mix.done - done);
        if size == 0 {
            break;
        }
        let at = if k + 1 == chunks {
            real_now - HOUR_MS
        } else {
            real_now - YEAR_MS + (k as i64) * (YEAR_MS - 2 * 24 * HOUR_MS) / (chunks as i64)
        };
        clock.set(at);
        store
            .enqueue_many((done..done + size).map(|i| job(i, 0)).collect())
            .await?;
        let leases = claim_all(size).await?;
        clock.set(at + 60_000);
        let out = store.complete_and_claim(&leases, None).await?;
        anyhow::ensure!(out.fenced.is_empty(), "bench fill: completions were fenced");
        done += size;
    }
    // 3. In flight, now: running jobs under live leases, a backlog that is ready, and jobs
    // waiting for a later time.
    clock.set(orch_store::SystemClock.now_ms());
    let base = mix.done;
    enqueue_chunked(store, (0..mix.running).map(|i| job(base + i, 0)).collect()).await?;
    claim_all(mix.running).await?;
    let base = base + mix.running;
    enqueue_chunked(store, (0..mix.ready).map(|i| job(base + i, 0)).collect()).await?;
    let base = base + mix.ready;
    enqueue_chunked(
        store,
        (0..mix.delayed)
            .map(|i| job(base + i, 3_600 + (i % 600) as i64))
            .collect(),
    )
    .await?;
    Ok(mix)
}

async fn enqueue_chunked(store: &Store, jobs: Vec<NewJob>) -> Result<()> {
    let mut rest = jobs;
    while !rest.is_empty() {
        let tail = rest.split_off(rest.len().min(5_000));
        store.enqueue_many(rest).await?;
        rest = tail;
    }
    Ok(())
}

/// How `fill_jobs` divides its jobs among states.
#[derive(Debug, Clone, Copy)]
struct JobMix {
    done: usize,
    failed: usize,
    running: usize,
    ready: usize,
    delayed: usize,
}

impl JobMix {
    /// The work in flight is the same at every size (400 running, 20,000 ready, 10,000
    /// waiting, fewer in a small store); failed jobs are a 500th of the rest, the rest is done.
    fn of(n: usize) -> JobMix {
        let running = (n / 250).min(400);
        let ready = (n / 5).min(20_000);
        let delayed = (n / 10).min(10_000);
        let history = n.saturating_sub(running + ready + delayed);
        let failed = history / 500;
        let done = history - failed;
        JobMix {
            done,
            failed,
            running,
            ready,
            delayed,
        }
    }
}

/// Operations that do nothing: the route's cost is the store's.
struct InertOps;

#[async_trait::async_trait]
impl orch_api::Operations for InertOps {
    async fn submit(
        &self,
        _: orch_api::SubmitRequest,
        _: &orch_api::Actor,
    ) -> Result<orch_api::SubmitResult, orch_api::OpError> {
        Err(orch_api::OpError::Invalid("bench".into()))
    }
    async fn approve(&self, _: &str, _: &orch_api::Actor) -> Result<(), orch_api::OpError> {
        Err(orch_api::OpError::Invalid("bench".into()))
    }
    async fn retry(&self, _: &str, _: &orch_api::Actor) -> Result<(), orch_api::OpError> {
        Err(orch_api::OpError::Invalid("bench".into()))
    }
    async fn cancel(&self, _: &str, _: &orch_api::Actor) -> Result<(), orch_api::OpError> {
        Err(orch_api::OpError::Invalid("bench".into()))
    }
    async fn runner_counters(&self) -> Vec<orch_api::RunnerCounters> {
        Vec::new()
    }
    async fn active_observations(&self) -> Vec<orch_api::Observation> {
        Vec::new()
    }
    async fn artifacts(&self, _: &str) -> Result<Vec<orch_api::ArtifactFile>, orch_api::OpError> {
        Ok(Vec::new())
    }
}

async fn time_route(store: &Store, path: &str, requests: usize) -> Result<Vec<f64>> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot bind a loopback port for the bench")?;
    let port = listener
        .local_addr()
        .context("bench listener address")?
        .port();
    let state = orch_api::ApiState::new(store.clone(), std::sync::Arc::new(InertOps), None);
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    let server = tokio::spawn(orch_api::serve(listener, state, async move {
        stopped.cancelled().await
    }));
    let mut ms = Vec::with_capacity(requests);
    // One warm-up request, not counted.
    for i in 0..=requests {
        let t0 = Instant::now();
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .context("cannot connect to the bench server")?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .context("cannot send the bench request")?;
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut buf))
            .await
            .with_context(|| format!("GET {path} took over 60 s"))?
            .context("cannot read the bench answer")?;
        anyhow::ensure!(
            buf.starts_with(b"HTTP/1.1 200"),
            "GET {path} answered {}",
            String::from_utf8_lossy(&buf[..buf.len().min(300)])
        );
        if i > 0 {
            ms.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
    }
    stop.cancel();
    let _ = server.await;
    Ok(ms)
}
