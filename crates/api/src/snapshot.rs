//! One read of "the queue at a glance" (store stats, tasks by stage, in-process counters and
//! watches), shared by `GET /queue`, `GET /metrics` and the dashboard so the three never disagree.

use orch_store::{Event, NodeSeen, QueueStats, Store, StoreError};

use crate::ApiState;
use crate::ops::{Observation, ReleaseTrack, RunnerCounters};

/// Everything the queue views show, read at one moment.
#[derive(Debug, Clone)]
pub(crate) struct QueueSnapshot {
    pub stats: QueueStats,
    pub tasks_by_stage: Vec<(String, i64)>,
    pub runners: Vec<RunnerCounters>,
    pub observations: Vec<Observation>,
    pub tracks: Vec<ReleaseTrack>,
    /// Every node's beacon (when a worker on it was last seen), by name.
    pub nodes: Vec<NodeSeen>,
    /// The latest takeovers of a gone node's jobs (`node.takeover` events), newest last.
    pub takeovers: Vec<Event>,
    pub version: String,
    pub uptime_ms: i64,
}

impl QueueSnapshot {
    /// Reads the store and the orchestrator's in-process state.
    pub async fn read(state: &ApiState) -> Result<QueueSnapshot, StoreError> {
        // Two independent reads on two connections: the view costs the slower, not the sum.
        let since = recent_since(&state.store);
        let (stats, tasks_by_stage) = tokio::try_join!(
            state.store.queue_stats(),
            state.store.active_tasks_by_stage(since)
        )?;
        let (nodes, takeovers) =
            tokio::try_join!(state.store.nodes(), latest_takeovers(&state.store))?;
        let runners = state.ops.runner_counters().await;
        let observations = state.ops.active_observations().await;
        let tracks = state.ops.release_tracks().await;
        Ok(QueueSnapshot {
            uptime_ms: stats.now.saturating_sub(state.started_at_ms).max(0),
            stats,
            tasks_by_stage,
            runners,
            observations,
            tracks,
            nodes,
            takeovers,
            version: state.version.clone(),
        })
    }

    /// How long ago node `n` was last seen (never negative).
    pub fn node_age_ms(&self, n: &NodeSeen) -> i64 {
        self.stats.now.saturating_sub(n.last_seen_ms).max(0)
    }

    /// How long the oldest ready-but-unclaimed job has waited (never negative).
    pub fn oldest_queued_age_ms(&self) -> Option<i64> {
        self.stats
            .oldest_ready_at
            .map(|at| self.stats.now.saturating_sub(at).max(0))
    }

    /// Jobs in one state, summed over kinds.
    pub fn jobs_in(&self, state: orch_store::JobState) -> i64 {
        self.stats
            .counts
            .iter()
            .filter(|c| c.state == state)
            .map(|c| c.count)
            .sum()
    }
}

/// The start of the views' "recently finished" window: the store's now − 24 h.
pub(crate) fn recent_since(store: &Store) -> i64 {
    store.now_ms().saturating_sub(orch_store::RECENT_WINDOW_MS)
}

/// How many takeovers the queue views list.
pub(crate) const TAKEOVERS_SHOWN: usize = 20;

/// The last [`TAKEOVERS_SHOWN`] `node.takeover` events (rare: one per job a gone node held).
pub(crate) async fn latest_takeovers(store: &Store) -> Result<Vec<Event>, StoreError> {
    const PAGE: u32 = 500;
    let mut out: Vec<Event> = Vec::new();
    let mut after = 0;
    loop {
        let page = store
            .events_by_kind(orch_domain::control::events::NODE_TAKEOVER, after, PAGE)
            .await?;
        let full = page.len() == PAGE as usize;
        if let Some(last) = page.last() {
            after = last.id;
        }
        out.extend(page);
        if out.len() > TAKEOVERS_SHOWN {
            out.drain(..out.len() - TAKEOVERS_SHOWN);
        }
        if !full {
            return Ok(out);
        }
    }
}
