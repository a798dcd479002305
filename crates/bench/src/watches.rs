//! `orch-bench watches`: many post-deploy watches at once (issue 16). N tasks at stage
//! `observe` in a fresh SQLite store, each with an armed watch (`WatchState::arm`, as the deploy
//! finalizer arms it) on one loopback health/revision service, and a first
//! `post-deploy-monitor` job each. An in-process worker (the real `Worker` and the real
//! `MonitorExecutor`: probes, sentinel files, tick counts from the jobs table) runs the ticks;
//! a requeue is enqueued as the engine enqueues it (same payload marker, delay, dedupe key, node
//! pin), but the engine's own per-job work (stage events, the worktree commit) is not run.
//!
//! Figures: CPU time of this process over the run's wall time (fraction of one core, from
//! `/proc/self/stat`), the loopback service's own thread reported apart; peak resident memory;
//! poll lateness = a poll's `at_ms` (in `series`) minus its slot's scheduled time; slots never
//! polled (the monitor skips a slot it reaches late rather than polling it late).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use orch_deploystate::{ArmOutcome, ArmedRecord, WatchState};
use orch_domain::config::{RepoConfig, Settings};
use orch_domain::control::dedupe;
use orch_domain::monitor::{WatchParams, planned_polls, tick_at_ms};
use orch_domain::pipeline::{Pipeline, StageDef};
use orch_runner::counters::Counters;
use orch_runner::deploy::{MONITOR_AGENT, MonitorExecutor};
use orch_runner::engine::{StageEffect, StageExecutor, StageJob, StageRun};
use orch_runner::worker::{JobContext, Outcome, Registry, Worker, WorkerConfig, handler_fn};
use orch_store::{ConnectOptions, NewEvent, NewJob, NewTask, Store, Task, WorkItemSpec};
use tokio_util::sync::CancellationToken;

use crate::cli::BenchWatchesArgs;
use crate::queue::{percentile, round2};
use crate::{Context, print_json};

const REPO: &str = "app";
const REVISION: &str = "4f2a9c1e0b7d3a5f6e8c9b0a1d2e3f4a5b6c7d8e";
const NODE: &str = "bench-node";
/// Attempts of a stage job, as the engine gives them.
const STAGE_ATTEMPTS: i64 = 3;

/// What every tick needs, shared by the handler.
struct Shared {
    store: Store,
    tasks: HashMap<i64, Task>,
    stage: StageDef,
    repo: RepoConfig,
    repos_dir: PathBuf,
    counters: Arc<Counters>,
    git: orch_exec::Git,
    executor: MonitorExecutor,
}

pub async fn watches(cx: &Context, args: BenchWatchesArgs) -> Result<ExitCode> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n = args.watches.max(1);
    let tmp = tempfile::tempdir().context("cannot create a temp dir for the bench")?;
    let (base, server_tid) = start_service()?;
    let repos_dir = tmp.path().join("repos");
    let repo_dir = repos_dir.join(REPO);
    std::fs::create_dir_all(&repo_dir).context("cannot create the bench repos dir")?;
    let url = format!("sqlite://{}", tmp.path().join("bench.db").display());
    let store = Store::connect(
        &url,
        ConnectOptions {
            create_if_missing: true,
            ..ConnectOptions::default()
        },
    )
    .await?;
    store.migrate().await?;

    let params = WatchParams {
        window_s: args.window_s,
        interval_s: args.interval_s.max(1),
        // Time to enqueue the first jobs and start the worker before the first slot.
        initial_delay_s: 5,
        poll_timeout_s: 2,
    };
    // The repo as orch.toml declares it (its defaults for everything else).
    let repo: RepoConfig = serde_json::from_value(serde_json::json!({
        "path": repo_dir.display().to_string(),
        "prefix": "BENCH",
        "health_url": format!("{base}/health"),
        "revision_url": format!("{base}/revision"),
        "post_deploy": {
            "window_s": params.window_s,
            "interval_s": params.interval_s,
            "initial_delay_s": params.initial_delay_s,
            "poll_timeout_s": params.poll_timeout_s,
        },
    }))
    .context("the bench repo's config")?;

    let t_setup = Instant::now();
    let mut tasks = HashMap::with_capacity(n);
    let mut order = Vec::with_capacity(n);
    for i in 0..n {
        let task = store
            .create_task(NewTask {
                work_item: WorkItemSpec::Exact(format!("BENCH-{}", i + 1)),
                repo: REPO.into(),
                title: format!("watch {i}"),
                body: String::new(),
                stage: "observe".into(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new(orch_domain::control::events::TASK_SUBMITTED, "bench watch"),
                first_job: None,
            })
            .await
            .with_context(|| format!("cannot create bench task {i}"))?;
        order.push(task.id);
        tasks.insert(task.id, task);
    }
    // Arm every watch (spread over `spread_ms`), then enqueue each one's first job.
    let armed_base = store.now_ms();
    let mut armed = Vec::with_capacity(n);
    for (i, id) in order.iter().enumerate() {
        let task = &tasks[id];
        let offset = i64::try_from(args.spread_ms.saturating_mul(i as u64) / n as u64).unwrap_or(0);
        let record = ArmedRecord::new(params, armed_base + offset, REVISION);
        let ws = WatchState::new(&repos_dir, REPO, &task.work_item_id);
        anyhow::ensure!(
            ws.arm(&record) == ArmOutcome::Armed,
            "cannot arm the watch of {}",
            task.work_item_id
        );
        armed.push((ws, record));
    }
    let first_jobs: Vec<NewJob> = order
        .iter()
        .map(|id| {
            let task = &tasks[id];
            let content = StageJob {
                stage: "observe".into(),
                seq: task.stage_seq,
            }
            .to_content();
            NewJob::new(MONITOR_AGENT, content)
                .task(task.id)
                .max_attempts(STAGE_ATTEMPTS)
                .node(NODE)
        })
        .collect();
    store.enqueue_many(first_jobs).await?;
    let setup_s = t_setup.elapsed().as_secs_f64();
    eprintln!("{n} tasks created, watches armed and first jobs enqueued in {setup_s:.1} s");

    let stage = Pipeline::default_pipeline()
        .stage(&"observe".parse()?)
        .context("the default pipeline has no observe stage")?
        .clone();
    let shared = Arc::new(Shared {
        store: store.clone(),
        tasks,
        stage,
        repo,
        repos_dir: repos_dir.clone(),
        counters: Arc::new(Counters::new()),
        git: orch_exec::Git::new(),
        executor: MonitorExecutor::default(),
    });
    let mut registry = Registry::new();
    let handler_shared = shared.clone();
    registry.register(
        MONITOR_AGENT,
        Duration::from_secs(60),
        handler_fn(move |cx| {
            let shared = handler_shared.clone();
            async move { tick(&shared, cx).await }
        }),
    );
    let mut config = WorkerConfig::new("bench-watches");
    config.concurrency = args.concurrency.max(1);
    config.claim_batch = args.claim_batch.max(1);
    config.node = Some(NODE.to_owned());
    let stop = CancellationToken::new();

    let cpu0 = cpu_ticks("/proc/self/stat");
    let srv0 = cpu_ticks(&format!("/proc/self/task/{server_tid}/stat"));
    let t0 = Instant::now();
    let worker = tokio::spawn(
        Worker::new(store.clone(), registry, config).run(stop.clone(), CancellationToken::new()),
    );
    let deadline_ms = armed
        .iter()
        .map(|(_, r)| r.deadline_ms)
        .max()
        .unwrap_or(armed_base);
    let mut max_rss_kib = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        max_rss_kib = max_rss_kib.max(status_kib("VmRSS:"));
        if store.now_ms() > deadline_ms && armed.iter().all(|(ws, _)| ws.is_done()) {
            break;
        }
        anyhow::ensure!(
            store.now_ms() < deadline_ms + 120_000,
            "the watches did not end within 2 minutes of their deadline"
        );
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu_s = (cpu_ticks("/proc/self/stat") - cpu0) as f64 / clock_ticks();
    let srv_s =
        (cpu_ticks(&format!("/proc/self/task/{server_tid}/stat")) - srv0) as f64 / clock_ticks();
    stop.cancel();
    let _ = worker.await;
    let hwm_kib = status_kib("VmHWM:");

    let mut late_ms = Vec::new();
    let mut skipped = 0u64;
    let planned = planned_polls(&params);
    for (ws, record) in &armed {
        let polls = ws.series().polls;
        skipped += u64::from(planned.saturating_sub(u32::try_from(polls.len()).unwrap_or(0)));
        for p in polls {
            late_ms.push((p.at_ms - tick_at_ms(&params, record.armed_at_ms, p.tick)) as f64);
        }
    }
    let polls = late_ms.len();
    let (p50, p99, max) = (
        percentile(&mut late_ms, 0.50),
        percentile(&mut late_ms, 0.99),
        percentile(&mut late_ms, 1.0),
    );
    let orch_core = (cpu_s - srv_s) / wall_s;
    eprintln!(
        "{n} watches, {} s interval, {} s window ({planned} slots each), worker concurrency {} \
         claim batch {}, arming spread over {} ms:",
        params.interval_s, params.window_s, args.concurrency, args.claim_batch, args.spread_ms
    );
    eprintln!(
        "  wall {wall_s:.1} s; CPU {cpu_s:.1} s = {:.2} of one core (loopback service thread \
         {srv_s:.1} s; without it {orch_core:.2})",
        cpu_s / wall_s
    );
    eprintln!(
        "  resident memory: max sampled {:.1} MiB, peak (VmHWM) {:.1} MiB",
        max_rss_kib as f64 / 1024.0,
        hwm_kib as f64 / 1024.0
    );
    eprintln!(
        "  polls {polls} of {} planned ({skipped} slots skipped); lateness p50 {p50:.0} ms  \
         p99 {p99:.0} ms  max {max:.0} ms",
        planned as usize * n
    );
    eprintln!(
        "  goal (within one core, p99 lateness < 1 s, no slot skipped): {}",
        if orch_core <= 1.0 && p99 < 1_000.0 && skipped == 0 {
            "met"
        } else {
            "NOT met"
        }
    );
    if cx.json {
        print_json(&serde_json::json!({
            "watches": n, "interval_s": params.interval_s, "window_s": params.window_s,
            "concurrency": args.concurrency, "claim_batch": args.claim_batch,
            "spread_ms": args.spread_ms, "wall_s": round2(wall_s), "cpu_s": round2(cpu_s),
            "cores": round2(cpu_s / wall_s), "service_cpu_s": round2(srv_s),
            "cores_without_service": round2(orch_core),
            "max_rss_mib": round2(max_rss_kib as f64 / 1024.0),
            "vm_hwm_mib": round2(hwm_kib as f64 / 1024.0),
            "polls": polls, "planned": planned as usize * n, "skipped": skipped,
            "lateness_p50_ms": p50, "lateness_p99_ms": p99, "lateness_max_ms": max,
        }));
    }
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

/// One `post-deploy-monitor` job: the real executor, then the engine's requeue.
async fn tick(shared: &Shared, cx: JobContext) -> Result<Outcome> {
    let task_id = cx.job.task_id.context("a monitor job without a task")?;
    let task = shared
        .tasks
        .get(&task_id)
        .context("a monitor job of an unknown task")?
        .clone();
    let sj = StageJob::from_content(&cx.job.task_content).map_err(|e| anyhow::anyhow!("{e}"))?;
    let work_item: orch_domain::ids::WorkItemId = task.work_item_id.parse()?;
    let repo_dir = shared.repos_dir.join(REPO);
    let worktree = repo_dir.join("worktrees").join(&task.work_item_id);
    let run = StageRun {
        store: shared.store.clone(),
        job: cx.job.clone(),
        lease: cx.lease,
        cancel: cx.cancel.clone(),
        task,
        work_item: work_item.clone(),
        stage: shared.stage.clone(),
        repo_name: REPO.parse()?,
        repo: shared.repo.clone(),
        settings: Settings::default(),
        repos_dir: shared.repos_dir.clone(),
        repo_dir,
        artifact_dir: worktree.join(work_item.artifact_dir()),
        worktree,
        feedback: None,
        loops: 0,
        git: shared.git.clone(),
        counters: shared.counters.clone(),
        node: NODE.to_owned(),
    };
    match shared.executor.execute(&run).await? {
        StageEffect::Requeue {
            delay_ms, marker, ..
        } => {
            let job = NewJob::new(MONITOR_AGENT, sj.with_marker(&marker))
                .task(task_id)
                .delay_ms(i64::try_from(delay_ms).unwrap_or(i64::MAX))
                .max_attempts(STAGE_ATTEMPTS)
                .dedupe(dedupe::requeue_of(cx.job.id))
                .node(NODE);
            shared.store.enqueue(job).await?;
            Ok(Outcome::Done)
        }
        StageEffect::Produced { .. } => Ok(Outcome::Done),
        StageEffect::Failed { reason } => Ok(Outcome::Fail { error: reason }),
    }
}

/// The loopback service: `/revision` answers the watched revision, anything else 200 `ok`;
/// one request per connection, as the probes' fresh clients make them. Runs on its own thread
/// (a single-threaded runtime) so that its CPU time can be told apart. Returns its base URL
/// and the thread's id.
fn start_service() -> Result<(String, i32)> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").context("cannot bind the loopback service")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("bench-service".into())
        .spawn(move || {
            // SAFETY: gettid has no preconditions.
            let _ = tx.send(unsafe { libc::gettid() });
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("orch-bench: the loopback service cannot start: {e}");
                    return;
                }
            };
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                while let Ok((stream, _)) = listener.accept().await {
                    tokio::spawn(answer(stream));
                }
            });
        })
        .context("cannot start the loopback service thread")?;
    let tid = rx
        .recv()
        .context("the loopback service thread did not start")?;
    Ok((format!("http://{addr}"), tid))
}

async fn answer(mut s: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.len() > 16 * 1024 {
            break;
        }
    }
    let body = if buf.starts_with(b"GET /revision") {
        REVISION
    } else {
        "ok"
    };
    let reply = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = s.write_all(reply.as_bytes()).await;
    let _ = s.shutdown().await;
}

/// utime + stime (clock ticks) of a `/proc/…/stat` file; 0 when unreadable.
fn cpu_ticks(path: &str) -> u64 {
    proc_cpu_ticks(path).0
}

/// From a `/proc/…/stat` file, in clock ticks: utime + stime (the process's own CPU time) and
/// cutime + cstime (that of its children it has waited for); zeros when unreadable.
pub(crate) fn proc_cpu_ticks(path: &str) -> (u64, u64) {
    let Ok(text) = std::fs::read_to_string(path) else {
        return (0, 0);
    };
    // The fields after the command name (which may hold spaces) start after the last ')'.
    let Some((_, rest)) = text.rsplit_once(')') else {
        return (0, 0);
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime, stime, cutime and cstime are fields 14 to 17.
    let get = |i: usize| {
        fields
            .get(i - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (get(14) + get(15), get(16) + get(17))
}

pub(crate) fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// A `/proc/self/status` line's value in KiB (`VmRSS:`, `VmHWM:`); 0 when unreadable.
fn status_kib(key: &str) -> u64 {
    proc_status_kib("/proc/self/status", key)
}

/// A `/proc/…/status` line's value in KiB (`VmRSS:`, `VmHWM:`); 0 when unreadable.
pub(crate) fn proc_status_kib(path: &str, key: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}
