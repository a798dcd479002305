//! `orch-bench watches`: many post-deploy watches at once (issue 16). N tasks at stage
//! `observe` in a fresh SQLite store, each with its worktree in a real clone of a real git repo
//! and an armed watch (`WatchState::arm`, as the deploy finalizer arms it) on one loopback
//! health/revision service, and a first `post-deploy-monitor` job each. An in-process worker
//! runs the ticks through the real engine (`Engine`'s job handler: the task and stage checks,
//! the clone check, stage events, the requeue) with the real `MonitorExecutor` (probes,
//! sentinel files, tick counts from the jobs table): what one `orch worker` does per tick.
//! `--eager-worktree` prepares the worktree on every tick and commits its progress, as the
//! engine did before the monitor deferred it.
//!
//! Figures: CPU time of this process and of the git processes it waited for, over the run's
//! wall time (fraction of one core, from `/proc/self/stat`), the loopback service's own thread
//! reported apart; peak resident memory; poll lateness = a poll's `at_ms` (in `series`) minus
//! its slot's scheduled time; slots never polled (the monitor skips a slot it reaches late
//! rather than polling it late).

use std::collections::HashMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use orch_deploystate::{ArmOutcome, ArmedRecord, WatchState};
use orch_domain::config::Config;
use orch_domain::monitor::{WatchParams, planned_polls, tick_at_ms};
use orch_runner::counters::Counters;
use orch_runner::deploy::{MONITOR_AGENT, MonitorExecutor};
use orch_runner::engine::{Engine, EngineConfig, StageEffect, StageExecutor, StageJob, StageRun};
use orch_runner::live_config::LiveConfig;
use orch_runner::repos::{self, RepoPaths};
use orch_runner::worker::{Registry, Worker, WorkerConfig};
use orch_store::{ConnectOptions, NewEvent, NewJob, NewTask, Store, WorkItemSpec};
use tokio_util::sync::CancellationToken;

use crate::cli::BenchWatchesArgs;
use crate::queue::{percentile, round2};
use crate::{Context, print_json};

const REPO: &str = "app";
const REVISION: &str = "4f2a9c1e0b7d3a5f6e8c9b0a1d2e3f4a5b6c7d8e";
const NODE: &str = "bench-node";
/// Attempts of a stage job, as the engine gives them.
const STAGE_ATTEMPTS: i64 = 3;

pub async fn watches(cx: &Context, args: BenchWatchesArgs) -> Result<ExitCode> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n = args.watches.max(1);
    let tmp = tempfile::tempdir().context("cannot create a temp dir for the bench")?;
    let (base, server_tid) = start_service()?;
    let repos_dir = tmp.path().join("repos");
    let source = tmp.path().join("service");
    init_source(&source)?;
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
    // orch.toml as a user writes it: the four agents of the default pipeline, and the repo
    // with its probes and watch (its defaults for everything else).
    let toml = format!(
        "[agents.analyst]\nbackend = \"claude\"\n[agents.architect]\nbackend = \"claude\"\n\
         [agents.developer]\nbackend = \"claude\"\n[agents.reviewer]\nbackend = \"claude\"\n\
         [repos.{REPO}]\npath = \"service\"\nprefix = \"BENCH\"\n\
         health_url = \"{base}/health\"\nrevision_url = \"{base}/revision\"\n\
         [repos.{REPO}.post_deploy]\nwindow_s = {}\ninterval_s = {}\ninitial_delay_s = {}\n\
         poll_timeout_s = {}\n",
        params.window_s, params.interval_s, params.initial_delay_s, params.poll_timeout_s
    );
    let config = Arc::new(
        Config::from_toml_str(&toml, &|_: &str| None)
            .map_err(|e| anyhow::anyhow!("the bench's orch.toml: {e}"))?,
    );
    let repo_name: orch_domain::ids::RepoName = REPO.parse()?;
    let repo = config
        .repos
        .get(&repo_name)
        .context("the bench's orch.toml has no repo")?
        .clone();
    let git = orch_exec::Git::new();
    let paths = RepoPaths::new(&repos_dir, &repo_name);
    repos::ensure_clone(&git, tmp.path(), &paths, &repo_name, &repo).await?;

    let t_setup = Instant::now();
    let mut tasks = HashMap::with_capacity(n);
    let mut order = Vec::with_capacity(n);
    for i in 0..n {
        let task = store
            .create_task(NewTask {
                work_item: WorkItemSpec::Exact(format!("BENCH-{}", i + 1).parse()?),
                repo: REPO.parse()?,
                title: format!("watch {i}"),
                body: String::new(),
                stage: "observe".parse()?,
                branch_prefix: "orch/".into(),
                event: NewEvent::new(orch_domain::control::events::TASK_SUBMITTED, "bench watch"),
                first_job: None,
            })
            .await
            .with_context(|| format!("cannot create bench task {i}"))?;
        order.push(task.id);
        tasks.insert(task.id, task);
    }
    // Every item's worktree, as the stages before `observe` left it.
    let t_worktrees = Instant::now();
    for id in &order {
        let work_item = &tasks[id].work_item_id;
        repos::prepare_worktree(&git, &paths, work_item, &repo.default_branch).await?;
    }
    eprintln!(
        "{n} worktrees created in {:.1} s",
        t_worktrees.elapsed().as_secs_f64()
    );
    // Arm every watch (spread over `spread_ms`), then enqueue each one's first job.
    let armed_base = store.now_ms();
    let mut armed = Vec::with_capacity(n);
    for (i, id) in order.iter().enumerate() {
        let task = &tasks[id];
        let offset = i64::try_from(args.spread_ms.saturating_mul(i as u64) / n as u64).unwrap_or(0);
        let record = ArmedRecord::new(params, armed_base + offset, REVISION);
        let ws = WatchState::new(&repos_dir, REPO, task.work_item_id.as_str());
        anyhow::ensure!(
            ws.arm(&record) == ArmOutcome::Armed,
            "cannot arm the watch of {}",
            task.work_item_id
        );
        armed.push((ws, record));
    }
    // One at a time, as each deploy's stage change enqueues its watch's first job: a bulk
    // enqueue would also refresh the planner's statistics (`ANALYZE`), which a store that only
    // ever ran the pipeline never has, and which changes SQLite's cost per statement.
    for id in &order {
        let task = &tasks[id];
        let content = StageJob {
            stage: "observe".into(),
            seq: task.stage_seq,
        }
        .to_content();
        let job = NewJob::new(MONITOR_AGENT, content)
            .task(task.id)
            .max_attempts(STAGE_ATTEMPTS)
            .node(NODE);
        store.enqueue(job).await?;
    }
    let setup_s = t_setup.elapsed().as_secs_f64();
    eprintln!("{n} tasks created, watches armed and first jobs enqueued in {setup_s:.1} s");

    let pipeline = Arc::new(config.pipeline().context("the bench's pipeline")?);
    let mut engine = Engine::new(
        store.clone(),
        EngineConfig {
            config: config.clone(),
            live: LiveConfig::new(config.clone(), store.now_ms()),
            pipeline,
            root: tmp.path().to_path_buf(),
            repos_dir: repos_dir.clone(),
            node: NODE.to_owned(),
        },
        Arc::new(Counters::new()),
    );
    let monitor: Arc<dyn StageExecutor> = if args.eager_worktree {
        Arc::new(Eager(MonitorExecutor::default()))
    } else {
        Arc::new(MonitorExecutor::default())
    };
    engine.set_executor(MONITOR_AGENT, monitor);
    let engine = Arc::new(engine);
    let mut registry = Registry::new();
    engine.register(&mut registry, Duration::from_secs(60));
    let mut wc = WorkerConfig::new("bench-watches");
    wc.concurrency = args.concurrency.max(1);
    wc.claim_batch = args.claim_batch.max(1);
    wc.node = Some(NODE.to_owned());
    wc.fetch_cooldown = Duration::from_millis(args.fetch_cooldown_ms);
    let stop = CancellationToken::new();

    let (cpu0, children0) = proc_cpu_ticks("/proc/self/stat");
    let srv0 = cpu_ticks(&format!("/proc/self/task/{server_tid}/stat"));
    let t0 = Instant::now();
    let worker = tokio::spawn(
        Worker::new(store.clone(), registry, wc).run(stop.clone(), CancellationToken::new()),
    );
    let deadline_ms = armed
        .iter()
        .map(|(_, r)| r.deadline_ms)
        .max()
        .unwrap_or(armed_base);
    let mut max_rss_kib = 0u64;
    // The steady state: from the second slot of the last armed watch (every watch polling) to
    // the last slot of the first (before any watch ends and commits its log).
    let steady_from = armed
        .iter()
        .map(|(_, r)| tick_at_ms(&params, r.armed_at_ms, 1))
        .max()
        .unwrap_or(armed_base);
    let steady_to = armed
        .iter()
        .map(|(_, r)| r.deadline_ms)
        .min()
        .unwrap_or(armed_base);
    let mut steady_start: Option<(Instant, u64, u64, u64)> = None;
    let mut steady: Option<(f64, f64, f64, f64)> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        max_rss_kib = max_rss_kib.max(status_kib("VmRSS:"));
        let now = store.now_ms();
        if steady_start.is_none() && now >= steady_from {
            let (cpu, children) = proc_cpu_ticks("/proc/self/stat");
            let srv = cpu_ticks(&format!("/proc/self/task/{server_tid}/stat"));
            steady_start = Some((Instant::now(), cpu, children, srv));
        }
        if steady.is_none()
            && now >= steady_to
            && let Some((at, cpu, children, srv)) = steady_start
        {
            let (cpu1, children1) = proc_cpu_ticks("/proc/self/stat");
            let srv1 = cpu_ticks(&format!("/proc/self/task/{server_tid}/stat"));
            let ticks = |a: u64, b: u64| (a.saturating_sub(b)) as f64 / clock_ticks();
            steady = Some((
                at.elapsed().as_secs_f64(),
                ticks(cpu1, cpu),
                ticks(children1, children),
                ticks(srv1, srv),
            ));
        }
        if store.now_ms() > deadline_ms && armed.iter().all(|(ws, _)| ws.is_done()) {
            break;
        }
        anyhow::ensure!(
            store.now_ms() < deadline_ms + 120_000,
            "the watches did not end within 2 minutes of their deadline"
        );
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let (cpu1, children1) = proc_cpu_ticks("/proc/self/stat");
    let cpu_s = (cpu1 - cpu0) as f64 / clock_ticks();
    let git_s = (children1 - children0) as f64 / clock_ticks();
    let srv_s =
        (cpu_ticks(&format!("/proc/self/task/{server_tid}/stat")) - srv0) as f64 / clock_ticks();
    stop.cancel();
    let _ = worker.await;
    let hwm_kib = status_kib("VmHWM:");

    let mut late_ms = Vec::new();
    let mut skipped = 0u64;
    let planned = planned_polls(&params);
    // Where the skipped slots are: the first, the last, or in between.
    let (mut skipped_first, mut skipped_last) = (0u64, 0u64);
    for (ws, record) in &armed {
        let polls = ws.series().polls;
        skipped += u64::from(planned.saturating_sub(u32::try_from(polls.len()).unwrap_or(0)));
        skipped_first += u64::from(!polls.iter().any(|p| p.tick == 0));
        skipped_last += u64::from(!polls.iter().any(|p| p.tick + 1 == planned));
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
    let orch_core = (cpu_s - srv_s + git_s) / wall_s;
    eprintln!(
        "{n} watches, {} s interval, {} s window ({planned} slots each), worker concurrency {} \
         claim batch {} fetch cooldown {} ms, arming spread over {} ms:",
        params.interval_s,
        params.window_s,
        args.concurrency,
        args.claim_batch,
        args.fetch_cooldown_ms,
        args.spread_ms
    );
    eprintln!(
        "  wall {wall_s:.1} s; CPU {cpu_s:.1} s in the process = {:.2} of one core (loopback \
         service thread {srv_s:.1} s), git and other children {git_s:.1} s; orch in all \
         (process without the service, plus children) {orch_core:.2} of one core{}",
        cpu_s / wall_s,
        if args.eager_worktree {
            " [--eager-worktree]"
        } else {
            ""
        }
    );
    let steady_cores = steady.map(|(wall, cpu, children, srv)| {
        eprintln!(
            "  steady state (every watch polling, none ended yet: {wall:.1} s): {:.2} of one core \
             in the process without the service, {:.2} in children; orch in all {:.2}",
            (cpu - srv) / wall,
            children / wall,
            (cpu - srv + children) / wall
        );
        (cpu - srv + children) / wall
    });
    eprintln!(
        "  resident memory: max sampled {:.1} MiB, peak (VmHWM) {:.1} MiB",
        max_rss_kib as f64 / 1024.0,
        hwm_kib as f64 / 1024.0
    );
    eprintln!(
        "  polls {polls} of {} planned ({skipped} slots skipped: {skipped_first} first slots, \
         {skipped_last} last slots, {} in between); lateness p50 {p50:.0} ms  p99 {p99:.0} ms  \
         max {max:.0} ms",
        planned as usize * n,
        skipped.saturating_sub(skipped_first + skipped_last)
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
            "fetch_cooldown_ms": args.fetch_cooldown_ms,
            "spread_ms": args.spread_ms, "wall_s": round2(wall_s), "cpu_s": round2(cpu_s),
            "cores": round2(cpu_s / wall_s), "service_cpu_s": round2(srv_s),
            "children_cpu_s": round2(git_s), "eager_worktree": args.eager_worktree,
            "cores_orch_with_children": round2(orch_core),
            "max_rss_mib": round2(max_rss_kib as f64 / 1024.0),
            "vm_hwm_mib": round2(hwm_kib as f64 / 1024.0),
            "polls": polls, "planned": planned as usize * n, "skipped": skipped,
            "skipped_first": skipped_first, "skipped_last": skipped_last,
            "steady_cores_orch_with_children": steady_cores.map(round2),
            "lateness_p50_ms": p50, "lateness_p99_ms": p99, "lateness_max_ms": max,
        }));
    }
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

/// The monitor as the engine ran it before it deferred the worktree: prepared (and the
/// progress committed) on every tick. The same run's baseline for `--eager-worktree`.
struct Eager(MonitorExecutor);

#[async_trait::async_trait]
impl StageExecutor for Eager {
    async fn execute(&self, run: &StageRun) -> Result<StageEffect> {
        self.0.execute(run).await
    }
}

/// The sample service's repository: one commit on `main`.
fn init_source(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(dir.join("README.md"), "the watched service\n")?;
    for argv in [
        &["init", "-q", "-b", "main"][..],
        &["add", "-A"],
        &[
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@localhost",
            "commit",
            "-qm",
            "the service",
        ],
    ] {
        let status = std::process::Command::new("git")
            .args(argv)
            .current_dir(dir)
            .status()
            .context("cannot run git")?;
        anyhow::ensure!(status.success(), "git {argv:?} failed in {}", dir.display());
    }
    Ok(())
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

/// Answers the requests of one connection as an HTTP/1.1 service does (keep-alive: a probe's
/// checks of one poll share a connection) until the client closes it.
async fn answer(mut s: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            if buf.len() > 16 * 1024 {
                return;
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(k) => buf.extend_from_slice(&chunk[..k]),
            }
        };
        let body = if buf.starts_with(b"GET /revision") {
            REVISION
        } else {
            "ok"
        };
        buf.drain(..end);
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if s.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
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
