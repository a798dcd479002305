//! `orch worker` (workers + maintenance) and `orch serve` (the same plus the HTTP API and
//! dashboard).

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use orch_runner::worker::{Registry, Worker, WorkerConfig, WorkerStats};
use orch_runner::{builtin, maintenance};
use orch_store::Store;
use tokio_util::sync::CancellationToken;

use crate::cli::{ServeArgs, WorkerArgs};
use crate::context::{Context, Project, Startup};
use crate::runtime::Runtime;

pub async fn run(cx: &Context, args: WorkerArgs) -> Result<ExitCode> {
    let (stop, hard) = crate::signals::shutdown_tokens()?;
    let Startup {
        project,
        worker: config,
        store,
    } = cx.startup(&args, false).await?;
    let mut reloader = None;
    let (registry, passes) = match project {
        Some(Project { config: c, places }) => {
            recover_from_dead_incarnations(&places.children_dir(), &store, &config.worker_id).await;
            let rt = Runtime::new_on_node(&places, &c, &store, node_of(&config))?;
            let (registry, passes) = (
                rt.registry(),
                rt.passes(config.lease, c.settings.retention.period()),
            );
            reloader = Some(crate::reload::spawn(&places, rt.live.clone(), stop.clone()));
            (registry, passes)
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

/// `orch serve`'s start-up, in one pass: what the context resolves ([`Context::startup`]),
/// then the dead incarnations' leftovers, the runtime, the config reloader, the HTTP API and
/// the workers, each handed what the steps before it built.
pub async fn serve(cx: &Context, args: ServeArgs) -> Result<ExitCode> {
    let (stop, hard) = crate::signals::shutdown_tokens()?;
    let Startup {
        project,
        worker: wconfig,
        store,
    } = cx.startup(&args.worker, true).await?;
    let Some(Project { config, places }) = project else {
        anyhow::bail!("orch serve needs a config ({})", cx.config_path.display());
    };
    recover_from_dead_incarnations(&places.children_dir(), &store, &wconfig.worker_id).await;
    let runtime = Arc::new(Runtime::new_on_node(
        &places,
        &config,
        &store,
        node_of(&wconfig),
    )?);
    let registry = runtime.registry();
    let passes = runtime.passes(wconfig.lease, config.settings.retention.period());
    let reloader = crate::reload::spawn(&places, runtime.live.clone(), stop.clone());
    let worker = Worker::new(store.clone(), registry, wconfig.clone());
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
    run_workers(store.clone(), worker, passes, stop.clone(), hard).await;
    stop.cancel();
    let _ = reloader.await;
    let _ = api.await;
    store.close().await;
    leave_supervised();
    Ok(ExitCode::SUCCESS)
}

/// The node the worker claims as (always set by [`Context::startup`]).
fn node_of(config: &WorkerConfig) -> &str {
    config.node.as_deref().unwrap_or("localhost")
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

/// Before claiming anything: record this process's children (and its worker id) from now on,
/// stop what dead orch processes on this node left running (their recorded groups and escaped
/// daemons), so a re-run stage never races the previous run of itself, and end the leases
/// those dead processes held, so their jobs run again now instead of after the lease: a
/// process that keeps crashing loses seconds per crash, not a lease each time.
async fn recover_from_dead_incarnations(dir: &std::path::Path, store: &Store, worker_id: &str) {
    use orch_exec::records;
    if let Err(e) = records::record_children_in(dir) {
        tracing::warn!(dir = %dir.display(), error = %e,
            "cannot record child processes; a crash may leave them running");
        return;
    }
    let done = records::stop_dead_incarnations(dir);
    if !done.incarnations.is_empty() {
        tracing::warn!(incarnations = ?done.incarnations, groups = ?done.groups_killed,
            escaped = ?done.escaped_killed,
            "stopped what dead orch processes on this node left running");
    }
    for dead in records::dead_workers(dir) {
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
