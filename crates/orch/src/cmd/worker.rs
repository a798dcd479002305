//! `orch worker` (workers + maintenance) and `orch serve` (the same plus the HTTP API and
//! dashboard).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use orch_runner::worker::{Registry, Worker, WorkerConfig, WorkerStats, default_worker_id};
use orch_runner::{builtin, maintenance};
use orch_store::{ConnectOptions, Store};
use tokio_util::sync::CancellationToken;

use crate::cli::{ServeArgs, WorkerArgs};
use crate::context::Context;
use crate::runtime::Runtime;

pub async fn run(cx: &Context, args: WorkerArgs) -> Result<ExitCode> {
    let (stop, hard) = crate::signals::shutdown_tokens()?;
    let (store, config) = open(cx, &args).await?;
    let mut reloader = None;
    let (registry, passes) = match &cx.config {
        Some(c) => {
            recover_from_dead_incarnations(&cx.repos_dir(c), &store, &config.worker_id).await;
            let rt = Runtime::new_on_node(cx, c, &store, config.node.as_deref())?;
            reloader = Some(crate::reload::spawn(cx, rt.live.clone(), stop.clone()));
            let retention = c.settings.retention.period();
            (rt.registry(), rt.passes(config.lease, retention))
        }
        None => {
            tracing::warn!(config = %cx.config_path.display(),
                "no config: running only the built-in job kinds");
            let mut r = Registry::new();
            builtin::register(&mut r);
            let retention = orch_domain::config::DEFAULT_RETENTION.period();
            (r, maintenance::default_passes(config.lease, retention))
        }
    };
    tracing::info!(worker = %config.worker_id, database = %store.target(),
        concurrency = config.concurrency, kinds = ?registry.kinds(), "worker started");
    let worker = Worker::new(store.clone(), registry, config.clone());
    run_workers(store.clone(), worker, passes, stop.clone(), hard).await;
    stop.cancel();
    if let Some(r) = reloader {
        let _ = r.await;
    }
    store.close().await;
    leave_supervised();
    Ok(ExitCode::SUCCESS)
}

pub async fn serve(cx: &Context, args: ServeArgs) -> Result<ExitCode> {
    let config = cx.require_config()?.clone();
    let (stop, hard) = crate::signals::shutdown_tokens()?;
    let (store, wconfig) = open(cx, &args.worker).await?;
    recover_from_dead_incarnations(&cx.repos_dir(&config), &store, &wconfig.worker_id).await;
    let runtime = Arc::new(Runtime::new_on_node(
        cx,
        &config,
        &store,
        wconfig.node.as_deref(),
    )?);
    let worker = Worker::new(store.clone(), runtime.registry(), wconfig.clone());
    let reloader = crate::reload::spawn(cx, runtime.live.clone(), stop.clone());
    let bind = args
        .bind
        .clone()
        .unwrap_or_else(|| config.settings.bind.clone());
    let listener = tokio::net::TcpListener::bind(&bind)
        .await
        .with_context(|| format!("cannot listen on {bind}"))?;
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or(bind);
    let api = spawn_api(
        listener,
        &store,
        &runtime,
        worker.stats(),
        &config,
        stop.clone(),
    );
    tracing::info!(worker = %wconfig.worker_id, database = %store.target(), %addr, "serve started");
    crate::say(&format!(
        "orch: serving http://{addr}/ (API, dashboard, /metrics)"
    ));
    run_workers(
        store.clone(),
        worker,
        runtime.passes(wconfig.lease, config.settings.retention.period()),
        stop.clone(),
        hard,
    )
    .await;
    stop.cancel();
    let _ = reloader.await;
    let _ = api.await;
    store.close().await;
    leave_supervised();
    Ok(ExitCode::SUCCESS)
}

/// When the shutdown left stage commands running under their supervisors (an upgrade, a
/// SIGTERM), exits now: the tasks waiting on them own the files those commands use (an
/// agent's private home), which their destructors would remove. The next orch adopts them.
fn leave_supervised() {
    if orch_exec::supervise::left_running() {
        tracing::info!(
            "left running stage commands to their supervisors; the next orch on this machine adopts them"
        );
        std::process::exit(0);
    }
}

/// Where this node's orch processes record the process groups they start.
pub fn children_dir(repos_dir: &std::path::Path) -> std::path::PathBuf {
    repos_dir.join(".orch-children")
}

/// Before claiming anything: record this process's children (and its worker id) from now on,
/// stop what dead orch processes on this node left running (their recorded groups and escaped
/// daemons), so a re-run stage never races the previous run of itself, and end the leases
/// those dead processes held, so their jobs run again now instead of after the lease: a
/// process that keeps crashing loses seconds per crash, not a lease each time.
async fn recover_from_dead_incarnations(
    repos_dir: &std::path::Path,
    store: &Store,
    worker_id: &str,
) {
    use orch_exec::records;
    let dir = children_dir(repos_dir);
    if let Err(e) = records::record_children_in(&dir) {
        tracing::warn!(dir = %dir.display(), error = %e,
            "cannot record child processes; a crash may leave them running");
        return;
    }
    let done = records::stop_dead_incarnations(&dir);
    if !done.incarnations.is_empty() {
        tracing::warn!(incarnations = ?done.incarnations, groups = ?done.groups_killed,
            escaped = ?done.escaped_killed,
            "stopped what dead orch processes on this node left running");
    }
    for dead in records::dead_workers(&dir) {
        match store.expire_leases_of(&dead.worker_id).await {
            Ok(n) => {
                if n > 0 {
                    tracing::warn!(worker = %dead.worker_id, incarnation = %dead.incarnation,
                        leases = n, "ended the leases of a dead orch process on this node");
                }
                dead.forget();
            }
            Err(e) => tracing::warn!(worker = %dead.worker_id, error = %e,
                "cannot end a dead orch process's leases; they expire on their own"),
        }
    }
    let supervised = dir.join("supervised");
    if let Err(e) = orch_exec::supervise::enable(&supervised) {
        tracing::warn!(dir = %supervised.display(), error = %e,
            "cannot supervise commands; a restart of orch will interrupt what its stages run");
    }
    if let Err(e) = records::record_worker(worker_id) {
        tracing::warn!(dir = %dir.display(), error = %e,
            "cannot record this process's worker id; after a crash its leases expire on their own");
    }
}

/// Starts the HTTP API on `listener` until `stop`.
pub fn spawn_api(
    listener: tokio::net::TcpListener,
    store: &Store,
    runtime: &Arc<Runtime>,
    stats: Arc<WorkerStats>,
    config: &orch_domain::config::Config,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let ops = Arc::new(crate::api_ops::ApiOps {
        runtime: runtime.clone(),
        worker_stats: stats,
    });
    let token = config
        .settings
        .token
        .as_ref()
        .map(|t| t.expose().to_owned());
    let state = orch_api::ApiState::new(store.clone(), ops, token);
    tokio::spawn(async move {
        if let Err(e) =
            orch_api::serve(listener, state, async move { stop.cancelled().await }).await
        {
            tracing::error!(error = %e, "the HTTP API stopped");
        }
    })
}

async fn open(cx: &Context, args: &WorkerArgs) -> Result<(Store, WorkerConfig)> {
    let settings = cx
        .config
        .as_ref()
        .map(|c| c.settings.clone())
        .unwrap_or_default();
    let mut config = WorkerConfig::new(args.worker_id.clone().unwrap_or_else(default_worker_id));
    config.concurrency = args.concurrency.unwrap_or(settings.workers as usize).max(1);
    config.claim_batch = args.claim_batch.max(1);
    config.lease = Duration::from_secs(settings.lease_s.max(1));
    if let Some(ms) = args.lease_ms {
        anyhow::ensure!(ms >= 200, "--lease-ms must be at least 200 (got {ms})");
        // The config's own `lease_s` was checked against `node_grace_s` when it was read
        // (`Config::validate`); only this flag can pass it.
        anyhow::ensure!(
            settings.node_grace_s.saturating_mul(1000) >= ms,
            "--lease-ms ({ms}) must be at most [settings] node_grace_s ({} s): a node is judged gone only after its leases could have expired",
            settings.node_grace_s
        );
        config.lease = Duration::from_millis(ms);
    }
    config.poll_interval = Duration::from_millis(settings.poll_interval_ms.clamp(10, 60_000));
    config.fetch_cooldown = Duration::from_millis(settings.fetch_cooldown_ms);
    config.shutdown_grace = Duration::from_secs(args.grace_s);
    config.node = Some(
        args.node
            .clone()
            .or(settings.node.clone())
            .unwrap_or_else(|| {
                cx.config
                    .as_ref()
                    .map(crate::runtime::node_name)
                    .unwrap_or_else(|| "localhost".into())
            }),
    );
    config.node_grace = Some(Duration::from_secs(settings.node_grace_s));
    let opts = ConnectOptions {
        max_connections: u32::try_from(config.concurrency + 6).unwrap_or(16),
        ..ConnectOptions::default()
    };
    let store = cx.open_store_with(opts, true).await?;
    Ok((store, config))
}

/// Runs the workers and the maintenance passes until `stop`; maintenance stops after the
/// workers have drained.
pub async fn run_workers(
    store: Store,
    worker: Worker,
    passes: Vec<Arc<dyn maintenance::Pass>>,
    stop: CancellationToken,
    hard: CancellationToken,
) {
    let maint_stop = CancellationToken::new();
    let maint = tokio::spawn(maintenance::run(store, passes, maint_stop.clone()));
    worker.run(stop, hard).await;
    maint_stop.cancel();
    let _ = maint.await;
}
