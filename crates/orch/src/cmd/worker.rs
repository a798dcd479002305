//! `orch worker` (workers + maintenance) and `orch serve` (the same plus the HTTP API).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use orch_runner::worker::{Registry, Worker, WorkerConfig, default_worker_id};
use orch_runner::{builtin, maintenance};
use orch_store::{ConnectOptions, Store};
use tokio_util::sync::CancellationToken;

use crate::cli::{ServeArgs, WorkerArgs};
use crate::context::Context;

/// Retention of finished jobs of finished tasks.
const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

pub async fn run(cx: &Context, args: WorkerArgs) -> Result<ExitCode> {
    let (stop, hard) = crate::signals::shutdown_tokens()?;
    let (store, config) = open(cx, &args).await?;
    tracing::info!(worker = %config.worker_id, database = %store.target(),
        concurrency = config.concurrency, "worker started");
    run_workers(store.clone(), registry(), config, stop, hard).await;
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

pub async fn serve(cx: &Context, args: ServeArgs) -> Result<ExitCode> {
    let (stop, hard) = crate::signals::shutdown_tokens()?;
    let (store, config) = open(cx, &args.worker).await?;
    tracing::info!(worker = %config.worker_id, database = %store.target(), "serve started");
    run_workers(store.clone(), registry(), config, stop, hard).await;
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

/// The job kinds this binary runs.
fn registry() -> Registry {
    let mut r = Registry::new();
    builtin::register(&mut r);
    r
}

async fn open(cx: &Context, args: &WorkerArgs) -> Result<(Store, WorkerConfig)> {
    let mut config = WorkerConfig::new(args.worker_id.clone().unwrap_or_else(default_worker_id));
    config.concurrency = args.concurrency.unwrap_or(4).max(1);
    config.claim_batch = args.claim_batch.max(1);
    if let Some(ms) = args.lease_ms {
        anyhow::ensure!(ms >= 200, "--lease-ms must be at least 200 (got {ms})");
        config.lease = Duration::from_millis(ms);
    }
    config.shutdown_grace = Duration::from_secs(args.grace_s);
    config.node = args.node.clone();
    let opts = ConnectOptions {
        max_connections: u32::try_from(config.concurrency + 4).unwrap_or(16),
        ..ConnectOptions::default()
    };
    let store = cx.open_store_with(opts, true).await?;
    Ok((store, config))
}

/// Runs the workers and the maintenance passes until `stop`; maintenance stops after the
/// workers have drained.
pub async fn run_workers(
    store: Store,
    registry: Registry,
    config: WorkerConfig,
    stop: CancellationToken,
    hard: CancellationToken,
) {
    let maint_stop = CancellationToken::new();
    let passes = maintenance::default_passes(config.lease, RETENTION);
    let maint = tokio::spawn(maintenance::run(store.clone(), passes, maint_stop.clone()));
    Worker::new(store, registry, config).run(stop, hard).await;
    maint_stop.cancel();
    let _ = maint.await;
}
