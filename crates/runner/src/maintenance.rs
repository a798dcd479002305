//! Maintenance: small periodic passes with one start/stop contract. Every pass is safe to run
//! from many processes at once (the rescue is exactly-once per expired lease; cleanup and
//! sweeps are idempotent), so every `orch serve` and `orch worker` runs them without electing a
//! leader.

use std::sync::Arc;
use std::time::Duration;

use orch_store::{Rescue, Store};
use tokio_util::sync::CancellationToken;

/// One periodic maintenance pass.
#[async_trait::async_trait]
pub trait Pass: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn every(&self) -> Duration;
    async fn run(&self, store: &Store) -> anyhow::Result<()>;
}

/// Re-queues or fails jobs whose lease expired.
pub struct RescuePass {
    pub every: Duration,
    pub rescue: Rescue,
}

#[async_trait::async_trait]
impl Pass for RescuePass {
    fn name(&self) -> &'static str {
        "rescue"
    }

    fn every(&self) -> Duration {
        self.every
    }

    async fn run(&self, store: &Store) -> anyhow::Result<()> {
        let report = store.rescue_expired(self.rescue).await?;
        if !report.requeued.is_empty() || !report.failed.is_empty() {
            tracing::warn!(
                requeued = ?report.requeued,
                failed = ?report.failed,
                failed_tasks = ?report.failed_tasks,
                "rescued jobs whose worker stopped heartbeating"
            );
        }
        Ok(())
    }
}

/// Deletes old finished jobs of finished tasks.
pub struct CleanupPass {
    pub every: Duration,
    pub retention: Duration,
}

#[async_trait::async_trait]
impl Pass for CleanupPass {
    fn name(&self) -> &'static str {
        "cleanup"
    }

    fn every(&self) -> Duration {
        self.every
    }

    async fn run(&self, store: &Store) -> anyhow::Result<()> {
        let retention = i64::try_from(self.retention.as_millis()).unwrap_or(i64::MAX);
        let cutoff = store.now_ms().saturating_sub(retention);
        let mut total = 0;
        loop {
            let n = store.cleanup_finished(cutoff, 5_000).await?;
            total += n;
            if n < 5_000 {
                break;
            }
        }
        if total > 0 {
            tracing::info!(deleted = total, "cleaned up old finished jobs");
        }
        Ok(())
    }
}

/// Re-enqueues a tick for every armed post-deploy watch on this node that has none queued
/// (design.md §7: a stale `armed` without `done` after a crash is completed by a restored job).
pub struct WatchRecoveryPass {
    pub every: Duration,
    pub repos_dir: std::path::PathBuf,
    pub node: String,
}

#[async_trait::async_trait]
impl Pass for WatchRecoveryPass {
    fn name(&self) -> &'static str {
        "watch-recovery"
    }

    fn every(&self) -> Duration {
        self.every
    }

    async fn run(&self, store: &Store) -> anyhow::Result<()> {
        for (work_item, action) in
            crate::deploy::monitor::recover_watches(store, &self.repos_dir, &self.node).await
        {
            if matches!(
                action,
                crate::deploy::monitor::RecoveryAction::Enqueued {
                    duplicate: false,
                    ..
                }
            ) {
                tracing::warn!(%work_item, "re-armed a post-deploy watch that had no tick queued");
            }
        }
        Ok(())
    }
}

/// The default passes for a lease length and retention.
pub fn default_passes(lease: Duration, retention: Duration) -> Vec<Arc<dyn Pass>> {
    vec![
        Arc::new(RescuePass {
            every: (lease / 4).clamp(Duration::from_millis(100), Duration::from_secs(15)),
            rescue: Rescue::default(),
        }),
        Arc::new(CleanupPass {
            every: Duration::from_secs(600),
            retention,
        }),
    ]
}

/// Runs every pass on its own schedule until `stop` is cancelled. A failing pass logs and
/// tries again at its next turn.
pub async fn run(store: Store, passes: Vec<Arc<dyn Pass>>, stop: CancellationToken) {
    let mut tasks = tokio::task::JoinSet::new();
    for pass in passes {
        let store = store.clone();
        let stop = stop.clone();
        tasks.spawn(async move {
            loop {
                if let Err(e) = pass.run(&store).await {
                    tracing::warn!(pass = pass.name(), error = %format!("{e:#}"), "maintenance pass failed");
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(pass.every()) => {}
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}
