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

/// Stops this machine's supervised commands whose job is no longer this machine's to run:
/// another node holds it under a valid lease (it took the job over while this node was away),
/// or the job has ended. Left running, such a command would race the other node's run of it.
/// A job waiting to be claimed again is left alone: the next orch here adopts its command.
pub struct SupervisedPass {
    pub every: Duration,
    /// This machine's records of its orch processes (`<repos_dir>/.orch-children`).
    pub children_dir: std::path::PathBuf,
}

#[async_trait::async_trait]
impl Pass for SupervisedPass {
    fn name(&self) -> &'static str {
        "supervised"
    }

    fn every(&self) -> Duration {
        self.every
    }

    async fn run(&self, store: &Store) -> anyhow::Result<()> {
        let running = orch_exec::supervise::running();
        let recorded = orch_exec::supervise::jobs_with_records();
        if running.is_empty() && recorded.is_empty() {
            return Ok(());
        }
        let ours = orch_exec::records::node_worker_ids(&self.children_dir);
        let live: std::collections::HashSet<i64> = running.iter().map(|(_, j, _)| *j).collect();
        for (key, job, pid) in running {
            if let Some(why) = not_ours(store, &ours, job).await? {
                tracing::warn!(key, pid, %why, "stopping a supervised command that is no longer this machine's to run");
                orch_exec::supervise::stop(pid);
            }
        }
        // What is kept of a job this machine no longer runs (a lost command's record, an
        // agent's session with its transcript) goes once the job has ended or another node
        // holds it: its next attempt here could not continue it anyway
        // (`agents::resume::State::continues`), and it must not linger for days.
        for job in recorded {
            if live.contains(&job) {
                continue;
            }
            if let Some(why) = not_ours(store, &ours, job).await? {
                tracing::info!(job, %why, "forgetting the records of a job this machine no longer runs");
                orch_exec::supervise::forget_job(job);
            }
        }
        Ok(())
    }
}

/// Why `job` is no longer this machine's to run (`ours`: the worker ids of its orch
/// processes, live and dead), or `None` while it may be.
async fn not_ours(
    store: &Store,
    ours: &std::collections::HashSet<String>,
    job: i64,
) -> anyhow::Result<Option<String>> {
    let now = store.now_ms();
    Ok(match store.get_job(job).await? {
        None => Some("its job no longer exists".to_owned()),
        Some(j) => match j.state {
            orch_store::JobState::Running
                if j.lease_expires_at.is_some_and(|t| t > now)
                    && j.locked_by.as_ref().is_some_and(|w| !ours.contains(w)) =>
            {
                Some(format!(
                    "job {job} runs on {} now (taken over)",
                    j.locked_by.unwrap_or_default()
                ))
            }
            orch_store::JobState::Done
            | orch_store::JobState::Failed
            | orch_store::JobState::Cancelled => {
                Some(format!("job {job} has ended ({:?})", j.state))
            }
            _ => None,
        },
    })
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

/// Jobs deleted per retention batch: each batch is one short write transaction, so the hot
/// path never waits long behind it (SQLite has one writer).
pub const PRUNE_BATCH: u32 = 500;
/// Pause between two retention batches: the claims and completions waiting for the write lock
/// go first.
pub const PRUNE_PAUSE: Duration = Duration::from_millis(20);
/// Batches one turn of the retention pass deletes at most; the rest waits for its next turn,
/// so a shutdown never waits behind a long backlog.
pub const PRUNE_BATCHES_PER_TURN: u32 = 200;

/// What [`prune`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Jobs deleted.
    pub jobs: u64,
    /// Batches (transactions, each with its `jobs.pruned` event) that deleted something.
    pub batches: u32,
    /// Every job pruned so far, in the store's record (all processes, all time).
    pub total: i64,
    /// True when the batch limit stopped it with jobs still to prune.
    pub more: bool,
}

/// Retention: deletes, in batches of `batch`, the finished jobs of finished tasks (and
/// task-less ones) that finished, and whose task ended, longer than `period` ago, each batch
/// recorded as a `jobs.pruned` event in its own transaction (`Store::prune_finished`); at most
/// `max_batches` batches, `pause` apart. Safe to run from many processes at once and to kill
/// at any instant.
pub async fn prune(
    store: &Store,
    period: Duration,
    batch: u32,
    pause: Duration,
    max_batches: u32,
) -> anyhow::Result<PruneReport> {
    let period = i64::try_from(period.as_millis()).unwrap_or(i64::MAX);
    let cutoff = store.now_ms().saturating_sub(period);
    let mut report = PruneReport::default();
    loop {
        let pruned = store.prune_finished(cutoff, batch).await?;
        report.total = pruned.total;
        if pruned.jobs == 0 {
            return Ok(report);
        }
        report.jobs += pruned.jobs;
        report.batches += 1;
        if pruned.jobs < u64::from(batch) {
            return Ok(report);
        }
        if report.batches >= max_batches {
            report.more = true;
            return Ok(report);
        }
        tokio::time::sleep(pause).await;
    }
}

/// The retention pass (`[settings] retention`): [`prune`] in small batches off the hot path.
pub struct RetentionPass {
    pub every: Duration,
    /// `None`: retention is off, the pass does nothing.
    pub period: Option<Duration>,
}

#[async_trait::async_trait]
impl Pass for RetentionPass {
    fn name(&self) -> &'static str {
        "retention"
    }

    fn every(&self) -> Duration {
        self.every
    }

    async fn run(&self, store: &Store) -> anyhow::Result<()> {
        let Some(period) = self.period else {
            return Ok(());
        };
        let report = prune(
            store,
            period,
            PRUNE_BATCH,
            PRUNE_PAUSE,
            PRUNE_BATCHES_PER_TURN,
        )
        .await?;
        if report.jobs > 0 {
            tracing::info!(
                pruned = report.jobs,
                batches = report.batches,
                total = report.total,
                more = report.more,
                "retention pruned finished jobs of finished tasks"
            );
        }
        Ok(())
    }
}

/// Fails the tasks a job failure left with no live job (`Store::fail_stranded_tasks`): the
/// failure could not end such a task because another of its jobs was live, and that job later
/// ended without moving it on. Without this the task would sit in its stage forever, holding
/// the repo's release track if it was on it. `grace`: how long after the failure.
pub struct StrandedPass {
    pub every: Duration,
    pub grace: Duration,
}

#[async_trait::async_trait]
impl Pass for StrandedPass {
    fn name(&self) -> &'static str {
        "stranded-tasks"
    }

    fn every(&self) -> Duration {
        self.every
    }

    async fn run(&self, store: &Store) -> anyhow::Result<()> {
        let grace = i64::try_from(self.grace.as_millis()).unwrap_or(i64::MAX);
        let failed = store
            .fail_stranded_tasks(store.now_ms().saturating_sub(grace), 100)
            .await?;
        if !failed.is_empty() {
            tracing::warn!(tasks = ?failed, "failed tasks that a job failure had left with no job to run");
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

/// The default passes for a lease length and a retention period (`None`: keep every job).
pub fn default_passes(lease: Duration, retention: Option<Duration>) -> Vec<Arc<dyn Pass>> {
    vec![
        Arc::new(RescuePass {
            every: (lease / 4).clamp(Duration::from_millis(100), Duration::from_secs(15)),
            rescue: Rescue::default(),
        }),
        Arc::new(RetentionPass {
            every: Duration::from_secs(60),
            period: retention,
        }),
        Arc::new(StrandedPass {
            every: Duration::from_secs(60),
            grace: Duration::from_secs(60),
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

#[cfg(test)]
mod tests {
    use super::*;
    use orch_store::testing::TestDb;
    use orch_store::{Claim, JobOutcome, NewEvent, NewJob, NewTask, WorkItemSpec};

    /// The pass fails a task a job failure left without a live job, once its grace is over.
    #[tokio::test]
    async fn the_stranded_pass_ends_a_task_left_without_a_job_after_its_grace() {
        let db = TestDb::sqlite().await;
        let s = &db.store;
        let task = s
            .create_task(NewTask {
                work_item: WorkItemSpec::Next {
                    prefix: "ORCH".parse().unwrap(),
                },
                repo: "svc".parse().unwrap(),
                title: "t".into(),
                body: String::new(),
                stage: "review".parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new(orch_domain::control::events::TASK_SUBMITTED, "submitted"),
                first_job: Some(NewJob::new("reviewer", "review")),
            })
            .await
            .unwrap();
        s.enqueue(NewJob::new("reviewer", "an older visit's").task(task.id))
            .await
            .unwrap();
        let claim = Claim {
            worker_id: "w".into(),
            kinds: vec![],
            limit: 1,
            lease_ms: 30_000,
            node: None,
            node_grace_ms: None,
        };
        let first = s.claim(&claim).await.unwrap().remove(0);
        s.mark_job(
            first.lease,
            JobOutcome::Failed {
                error: "boom".into(),
            },
            None,
        )
        .await
        .unwrap();
        let other = s.claim(&claim).await.unwrap().remove(0);
        s.mark_job(other.lease, JobOutcome::Done, None)
            .await
            .unwrap();
        let pass = StrandedPass {
            every: Duration::from_secs(60),
            grace: Duration::from_secs(60),
        };
        pass.run(s).await.unwrap();
        let stage = |s: &Store| {
            let s = s.clone();
            async move { s.get_task(task.id).await.unwrap().unwrap().stage }
        };
        assert_eq!(stage(s).await, "review", "within the grace");
        db.clock.advance_ms(60_001);
        pass.run(s).await.unwrap();
        assert_eq!(stage(s).await, "failed");
    }
}
