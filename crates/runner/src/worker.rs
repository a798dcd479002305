//! The worker runtime: N concurrent job executions per process, fed by fetch loops that
//! complete finished jobs and claim new ones in one transaction, a heartbeat that keeps every
//! held lease alive (and stops handlers whose lease was lost), and a graceful shutdown that
//! finishes within a grace period or gives the leases back.
//!
//! Two shapes, chosen by [`WorkerConfig::claim_batch`]:
//! - per-job (`claim_batch = 1`): one fetch loop per slot; each loop marks its finished job done
//!   and claims the next one in the same statement: one commit per job;
//! - batched (`claim_batch > 1`): one fetch loop per two slots (at most four; one on SQLite,
//!   whose single writer serializes them anyway) claims up to
//!   `claim_batch` jobs at a time into its local buffer and marks finished jobs done in batches,
//!   in the same statement as its next claim.
//!
//! Once the queue is drained, a fetch cooldown ([`WorkerConfig::fetch_cooldown`]) spaces the
//! claims for jobs that come due on their own and holds finished jobs' completions for at most
//! that long, so that 1,000 watches' ticks due a millisecond apart share statements.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use orch_store::{Claim, ClaimedJob, Job, JobOutcome, Lease, NewEvent, NewJob, Store, StoreError};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::histogram::{self, Histogram, LabeledHistograms};
use crate::pacing::{AfterClaim, Capacity, Pacing};

/// What a handler tells the runtime about its job.
#[derive(Debug)]
pub enum Outcome {
    /// Mark the job done (batched with other completions).
    Done,
    /// Mark the job done and enqueue this follow-up of it (a watch's next tick): the follow-ups
    /// of a batch of finished jobs are inserted in one statement just before the batch's
    /// completions, instead of one insert each while the handlers run. Should the process die
    /// in between, the job is rescued, runs again and asks for the same follow-up, which its
    /// dedupe key keeps to one.
    DoneThen(Box<NewJob>),
    /// Put the job back for another attempt after `delay` (failed at the attempt limit).
    Retry { error: String, delay: Duration },
    /// Fail the job for good.
    Fail { error: String },
    /// The handler already marked its own job with `mark_job` (or lost its lease doing so).
    Marked,
}

/// Everything a handler gets for one job.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub job: Job,
    pub lease: Lease,
    pub store: Store,
    pub worker_id: String,
    /// The lease duration this worker claims and heartbeats with.
    pub lease_ms: i64,
    /// Cancelled when the lease is lost or a hard shutdown begins: stop and return.
    pub cancel: CancellationToken,
}

impl JobContext {
    /// Renews this job's lease now, for a whole lease duration: the fence before an effect
    /// outside the database that a stale attempt must never make (pushing a branch other
    /// nodes continue from). An error when the lease is lost (the job was rescued and runs
    /// elsewhere) or the store cannot say.
    pub async fn renew(&self) -> anyhow::Result<()> {
        let lost = self
            .store
            .heartbeat(&self.worker_id, &[self.lease], self.lease_ms)
            .await
            .map_err(|e| {
                anyhow::anyhow!("cannot renew the lease of job {}: {e}", self.lease.job_id)
            })?;
        if !lost.is_empty() {
            anyhow::bail!(
                "lease lost: job {} attempt {} runs elsewhere now",
                self.lease.job_id,
                self.lease.attempt
            );
        }
        Ok(())
    }
}

/// Runs jobs of one or more kinds.
#[async_trait::async_trait]
pub trait JobHandler: Send + Sync + 'static {
    /// Runs one job. An `Err` is retried with backoff until the attempt limit.
    async fn run(&self, cx: JobContext) -> anyhow::Result<Outcome>;
}

/// One registered kind: its handler and its wall-clock limit.
#[derive(Clone)]
struct Entry {
    handler: Arc<dyn JobHandler>,
    timeout: Duration,
}

/// Job kinds this process can run. A worker claims only these kinds.
#[derive(Clone, Default)]
pub struct Registry {
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.entries.keys()).finish()
    }
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `handler` for `kind`; a job running longer than `timeout` is stopped and retried.
    pub fn register(
        &mut self,
        kind: impl Into<String>,
        timeout: Duration,
        handler: Arc<dyn JobHandler>,
    ) -> &mut Self {
        self.entries.insert(kind.into(), Entry { handler, timeout });
        self
    }

    pub fn kinds(&self) -> Vec<String> {
        let mut kinds: Vec<String> = self.entries.keys().cloned().collect();
        kinds.sort();
        kinds
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// How a worker process runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Recorded on every claimed job (`locked_by`); unique per process.
    pub worker_id: String,
    /// Jobs running at once in this process.
    pub concurrency: usize,
    /// 1: per-job mode; more: batched claims of up to this many jobs.
    pub claim_batch: u32,
    pub lease: Duration,
    /// Fallback poll when no wake-up arrives (wake-ups can be lost).
    pub poll_interval: Duration,
    /// On shutdown, running jobs get this long to finish before their leases are released.
    pub shutdown_grace: Duration,
    /// This machine's node name, for jobs pinned to it. When set, the heartbeat also records
    /// the node as seen (`Store::node_seen`) every beat, busy or idle.
    pub node: Option<String>,
    /// Jobs pinned to another node become claimable here once they have been ready, and that
    /// node unseen, for this long (design.md §10). `None`: never take over.
    pub node_grace: Option<Duration>,
    /// Once a claim finds the queue drained (fewer jobs due than it asked for), the next claim
    /// for jobs that come due on their own (delayed jobs: a watch's ticks) waits at least this
    /// long after it, and finished jobs are marked done within this long, so jobs due a few
    /// milliseconds apart share one statement instead of one each. A wake-up for a job due now,
    /// a poll and a backlog (a claim that came back full) claim as soon as a slot is free.
    /// Applied at most `poll_interval` and a tenth of the lease. Zero: every due job and every
    /// finished job is a statement of its own.
    pub fetch_cooldown: Duration,
}

impl WorkerConfig {
    pub fn new(worker_id: impl Into<String>) -> Self {
        WorkerConfig {
            worker_id: worker_id.into(),
            concurrency: 4,
            claim_batch: 4,
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(30),
            node: None,
            node_grace: None,
            fetch_cooldown: DEFAULT_FETCH_COOLDOWN,
        }
    }

    fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX)
    }

    /// The cooldown as the fetch loops apply it: at most a tenth of the lease, since finished
    /// jobs wait up to this long to be marked done and must be well within their lease then,
    /// and at most the poll interval, the longest any job waits for a claim otherwise.
    fn cooldown(&self) -> Duration {
        self.fetch_cooldown
            .min(self.lease / 10)
            .min(self.poll_interval)
    }

    fn node_grace_ms(&self) -> Option<i64> {
        self.node_grace
            .map(|g| i64::try_from(g.as_millis()).unwrap_or(i64::MAX).max(1))
    }
}

/// [`WorkerConfig::fetch_cooldown`]'s default (`settings.fetch_cooldown_ms`).
pub const DEFAULT_FETCH_COOLDOWN: Duration =
    Duration::from_millis(orch_domain::config::DEFAULT_FETCH_COOLDOWN_MS);

/// A worker id unique enough across machines and restarts: `<host>-<pid>-<random>`.
pub fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded randomly per process: enough to tell restarts of one pid apart.
    let salt = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{host}-{}-{:04x}", std::process::id(), salt & 0xffff)
}

/// Live counters of one worker process (read by `/metrics` and the benchmark).
#[derive(Debug)]
pub struct WorkerStats {
    pub claimed: AtomicU64,
    pub done: AtomicU64,
    pub retried: AtomicU64,
    pub failed: AtomicU64,
    /// Completions refused because the lease was lost in the meantime.
    pub fenced: AtomicU64,
    pub leases_lost: AtomicU64,
    pub released: AtomicU64,
    pub store_errors: AtomicU64,
    /// Handler run time, by job kind.
    pub job_seconds: LabeledHistograms,
    /// How long a claimed job had been ready (`available_at` → claimed): the queue's wait.
    pub claim_wait: Histogram,
    /// Round trip of one complete-and-claim statement that claimed something.
    pub claim_query: Histogram,
}

impl Default for WorkerStats {
    fn default() -> Self {
        WorkerStats {
            claimed: AtomicU64::new(0),
            done: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            fenced: AtomicU64::new(0),
            leases_lost: AtomicU64::new(0),
            released: AtomicU64::new(0),
            store_errors: AtomicU64::new(0),
            job_seconds: LabeledHistograms::new(histogram::JOB_BOUNDS),
            claim_wait: Histogram::new(histogram::FAST_BOUNDS),
            claim_query: Histogram::new(histogram::FAST_BOUNDS),
        }
    }
}

/// A lease this process holds: the token that stops its handler, and the instant until which
/// the lease is certainly still this process's. That instant is measured here, from when the
/// claim or the last successful renewal was *sent*, less a tenth of the lease
/// ([`certain_for`]), so on this machine's clock it comes before the expiry the database
/// recorded (see [`heartbeat_loop`]: past it, the handler is stopped without asking).
#[derive(Clone)]
struct HeldLease {
    lease: Lease,
    token: CancellationToken,
    valid_until: Instant,
    /// Stopped here because its renewal could not reach the database before `valid_until`:
    /// its result is not recorded; the lease is given back if it is still ours.
    given_up: bool,
}

/// How long a shutdown that leaves supervised commands running waits for the other handlers
/// to end on their cancellation.
const STOPPED_GRACE: Duration = Duration::from_secs(10);

/// The leases this process holds, by job id.
type Held = Arc<Mutex<HashMap<i64, HeldLease>>>;

fn held_insert(held: &Held, lease: Lease, valid_until: Instant) {
    if let Ok(mut map) = held.lock() {
        let token = CancellationToken::new();
        map.insert(
            lease.job_id,
            HeldLease {
                lease,
                token,
                valid_until,
                given_up: false,
            },
        );
    }
}

/// Forgets `lease`, and only that attempt: a newer attempt of the same job claimed by another
/// loop of this process in the meantime keeps its entry (its renewals and its fence).
fn held_remove(held: &Held, lease: &Lease) {
    if let Ok(mut map) = held.lock()
        && map.get(&lease.job_id).is_some_and(|h| h.lease == *lease)
    {
        map.remove(&lease.job_id);
        // The attempt's outcome is recorded (or it was given up): its supervised commands'
        // records go, so a later attempt runs them afresh.
        orch_exec::supervise::forget_job(lease.job_id);
    }
}

/// The entry of `lease` if this process still holds exactly that lease.
fn held_get(held: &Held, lease: &Lease) -> Option<HeldLease> {
    held.lock()
        .ok()?
        .get(&lease.job_id)
        .filter(|h| h.lease == *lease)
        .cloned()
}

fn held_contains(held: &Held, lease: &Lease) -> bool {
    held_get(held, lease).is_some()
}

fn held_snapshot(held: &Held) -> Vec<HeldLease> {
    held.lock()
        .map(|m| m.values().cloned().collect())
        .unwrap_or_default()
}

/// How long a lease is certain from the instant its claim or renewal was sent: the lease less a
/// tenth, so that a worker cut off stops before the database's expiry (and before any rescue,
/// which also waits for a sweep), allowing for the scheduling of this process and small clock
/// differences between machines.
fn certain_for(lease: Duration) -> Duration {
    lease.saturating_sub(lease / 10)
}

/// A successful renewal sent at `sent`: each lease renewed is certain until
/// `sent + certain_for(lease)`.
fn held_renewed(held: &Held, renewed: &[Lease], sent: Instant, lease: Duration) {
    if let Ok(mut map) = held.lock() {
        for l in renewed {
            if let Some(h) = map
                .get_mut(&l.job_id)
                .filter(|h| h.lease == *l && !h.given_up)
            {
                h.valid_until = h.valid_until.max(sent + certain_for(lease));
            }
        }
    }
}

/// Self-fencing: every lease whose certain validity has run out (its renewals did not reach the
/// database in time: a cut link, a database down or too slow) is given up here. Its handler is
/// stopped (its children killed) at once rather than when the database is reachable again:
/// by then the job may be running elsewhere. Returns the leases given up.
fn held_expire(held: &Held, now: Instant) -> Vec<Lease> {
    let Ok(mut map) = held.lock() else {
        return Vec::new();
    };
    map.values_mut()
        .filter(|h| !h.given_up && h.valid_until <= now)
        .map(|h| {
            h.given_up = true;
            h.token.cancel();
            h.lease
        })
        .collect()
}

/// The earliest instant a held lease stops being certain.
fn held_deadline(held: &Held) -> Option<Instant> {
    held.lock()
        .ok()?
        .values()
        .filter(|h| !h.given_up)
        .map(|h| h.valid_until)
        .min()
}

/// A running worker process's job side.
pub struct Worker {
    store: Store,
    registry: Arc<Registry>,
    config: WorkerConfig,
    stats: Arc<WorkerStats>,
}

impl Worker {
    pub fn new(store: Store, registry: Registry, config: WorkerConfig) -> Self {
        Worker {
            store,
            registry: Arc::new(registry),
            config,
            stats: Arc::new(WorkerStats::default()),
        }
    }

    pub fn stats(&self) -> Arc<WorkerStats> {
        self.stats.clone()
    }

    /// Runs until `stop` is cancelled, then shuts down gracefully (see module docs).
    /// `hard_stop`, when cancelled, cuts the grace period short.
    pub async fn run(self, stop: CancellationToken, hard_stop: CancellationToken) {
        let held: Held = Arc::new(Mutex::new(HashMap::new()));
        let heartbeat_stop = CancellationToken::new();
        let heartbeat = tokio::spawn(heartbeat_loop(
            self.store.clone(),
            self.config.clone(),
            held.clone(),
            self.stats.clone(),
            heartbeat_stop.clone(),
        ));
        let (loops, slots, batch, prefetch) = if self.config.claim_batch <= 1 {
            (self.config.concurrency.max(1), 1, 1, 0)
        } else {
            // One loop per two slots (at most four): a loop waits for its own round trip, so
            // several loops keep several database connections busy where one would leave the
            // database idle between its statements (PostgreSQL, 20,000 no-op jobs at
            // concurrency 8: one loop 19.5k jobs/s, four loops 25.5–26.5k).
            // SQLite has one writer connection per process, which serializes the loops' every
            // statement: there one loop is fastest (measured: 14k jobs/s with one, 5.8k with
            // four).
            let concurrency = self.config.concurrency.max(1);
            let loops = match self.store.backend() {
                orch_store::Backend::Sqlite => 1,
                orch_store::Backend::Postgres => concurrency.div_ceil(2).clamp(1, 4),
            };
            let batch = self.config.claim_batch as usize;
            (loops, concurrency.div_ceil(loops), batch, batch)
        };
        let mut fetchers = JoinSet::new();
        for i in 0..loops {
            let f = Fetcher {
                store: self.store.clone(),
                registry: self.registry.clone(),
                config: self.config.clone(),
                stats: self.stats.clone(),
                held: held.clone(),
                slots,
                batch,
                prefetch,
                index: i,
            };
            fetchers.spawn(f.run(stop.clone(), hard_stop.clone()));
        }
        while fetchers.join_next().await.is_some() {}
        heartbeat_stop.cancel();
        let _ = heartbeat.await;
        tracing::info!(worker = %self.config.worker_id, "worker stopped");
    }
}

/// Extends every held lease every lease/3; cancels the handlers of leases that were lost; and
/// records this node as seen (its beacon), so other nodes know its pinned jobs are still its.
///
/// A renewal that cannot reach the database is not waited for past the moment a held lease
/// stops being certain (`valid_until`): there every such lease is given up and its handler
/// stopped, without waiting for the database to say so (a worker cut off from the database
/// must not keep running, and spawning, what another worker is about to take over).
async fn heartbeat_loop(
    store: Store,
    config: WorkerConfig,
    held: Held,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    let every = (config.lease / 3).max(Duration::from_millis(50));
    let beacon = |until: Instant| {
        let store = store.clone();
        let stats = stats.clone();
        let node = config.node.clone();
        async move {
            let Some(node) = node else { return };
            match tokio::time::timeout_at(until.into(), store.node_seen(&node)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    stats.store_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, %node, "could not record this node as seen; retrying at the next beat");
                }
                Err(_) => {
                    stats.store_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%node, "recording this node as seen timed out; retrying at the next beat");
                }
            }
        }
    };
    // How long one database call of the beat may take: until the next beat, or until the
    // first held lease stops being certain, whichever comes first.
    let bound = |held: &Held| {
        let next = Instant::now() + every;
        held_deadline(held).map_or(next, |d| d.min(next))
    };
    beacon(bound(&held)).await;
    loop {
        // The next beat, or sooner the moment a held lease stops being certain (a slow call
        // may have eaten into the time since its renewal was sent).
        let wake = bound(&held);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
        give_up_expired(&held, &stats, config.lease);
        beacon(bound(&held)).await;
        let snapshot: Vec<HeldLease> = held_snapshot(&held)
            .into_iter()
            .filter(|h| !h.given_up)
            .collect();
        if snapshot.is_empty() {
            continue;
        }
        let leases: Vec<Lease> = snapshot.iter().map(|h| h.lease).collect();
        let sent = Instant::now();
        let until = held_deadline(&held).unwrap_or(sent + certain_for(config.lease));
        let renewal = store.heartbeat(&config.worker_id, &leases, config.lease_ms());
        match tokio::time::timeout_at(until.into(), renewal).await {
            Ok(Ok(lost)) => {
                let renewed: Vec<Lease> = leases
                    .iter()
                    .filter(|l| !lost.contains(l))
                    .copied()
                    .collect();
                held_renewed(&held, &renewed, sent, config.lease);
                for lease in lost {
                    // Completions committed between the snapshot and the heartbeat also look
                    // "lost"; only leases still held are.
                    if !held_contains(&held, &lease) {
                        continue;
                    }
                    tracing::warn!(
                        job = lease.job_id,
                        attempt = lease.attempt,
                        "lease lost (rescued, cancelled or taken over); stopping its handler"
                    );
                    stats.leases_lost.fetch_add(1, Ordering::Relaxed);
                    if let Some(h) = snapshot.iter().find(|h| h.lease == lease) {
                        h.token.cancel();
                    }
                    held_remove(&held, &lease);
                }
            }
            Ok(Err(e)) => {
                stats.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "heartbeat failed; retrying at the next beat");
            }
            Err(_) => {
                stats.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    waited_ms = sent.elapsed().as_millis() as u64,
                    "heartbeat got no answer from the database before a lease ran out"
                );
            }
        }
        give_up_expired(&held, &stats, config.lease);
    }
}

/// Gives up (and stops the handlers of) the held leases no renewal has kept certain.
fn give_up_expired(held: &Held, stats: &WorkerStats, lease: Duration) {
    for l in held_expire(held, Instant::now()) {
        stats.leases_lost.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            job = l.job_id,
            attempt = l.attempt,
            lease_ms = lease.as_millis() as u64,
            "lease lost here: no renewal reached the database within the lease; stopping its handler (another worker may run the job now)"
        );
    }
}

/// One claim/complete loop with `slots` concurrent executions.
struct Fetcher {
    store: Store,
    registry: Arc<Registry>,
    config: WorkerConfig,
    stats: Arc<WorkerStats>,
    held: Held,
    slots: usize,
    batch: usize,
    prefetch: usize,
    index: usize,
}

/// A follow-up job of a finished one (`Outcome::DoneThen`) waiting for its batch, with when
/// its handler returned it.
type FollowUp = (Instant, NewJob);

/// The follow-ups as they are to be inserted now: a delay counts from when the handler asked,
/// so the time one waited for its batch is taken off it (a watch's tick stays on its slot).
fn as_held(follow_ups: &[FollowUp]) -> Vec<NewJob> {
    follow_ups
        .iter()
        .map(|(asked, job)| {
            let held = i64::try_from(asked.elapsed().as_millis()).unwrap_or(i64::MAX);
            let mut job = job.clone();
            job.delay_ms = job.delay_ms.saturating_sub(held).max(0);
            job
        })
        .collect()
}

/// A finished execution: its lease, the job's task (if any), what the handler returned and
/// when.
type Finished = (Lease, Option<i64>, Result<Outcome, String>, Instant);

impl Fetcher {
    async fn run(self, stop: CancellationToken, hard_stop: CancellationToken) {
        let kinds = self.registry.kinds();
        let mut wake = self.store.wakeups();
        let mut running: JoinSet<Finished> = JoinSet::new();
        let mut buffer: VecDeque<ClaimedJob> = VecDeque::new();
        let mut pending_done: Vec<Lease> = Vec::new();
        // The follow-ups of finished jobs in `pending_done`, inserted just before them.
        let mut follow_ups: Vec<FollowUp> = Vec::new();
        // When to claim, how much, when to flush and when to look next: `crate::pacing`.
        let mut pacing = Pacing::new(
            self.config.cooldown(),
            self.config.poll_interval,
            wake.borrow().now_seq,
            Instant::now(),
        );
        let cap = Capacity {
            slots: self.slots,
            prefetch: self.prefetch,
            batch: self.batch,
        };
        // Stagger loops a little so per-job loops do not claim in lockstep.
        if self.index > 0 {
            tokio::time::sleep(Duration::from_millis(self.index as u64)).await;
        }
        loop {
            let stopping = stop.is_cancelled();
            while let Some(res) = running.try_join_next() {
                self.finish(res, &mut pending_done, &mut follow_ups).await;
                pacing.job_finished();
            }
            pacing.pending(pending_done.len(), Instant::now());
            self.start_buffered(&mut buffer, &mut running);
            let want = pacing.want(
                stopping,
                !kinds.is_empty(),
                running.len(),
                buffer.len(),
                cap,
            );
            let flush = pacing.flush(
                pending_done.len(),
                want,
                stopping,
                self.batch,
                Instant::now(),
            );
            if want > 0 || flush {
                let claim = (want > 0).then(|| Claim {
                    worker_id: self.config.worker_id.clone(),
                    limit: want as u32,
                    lease_ms: self.config.lease_ms(),
                    kinds: kinds.clone(),
                    node: self.config.node.clone(),
                    node_grace_ms: self.config.node_grace_ms(),
                });
                if !follow_ups.is_empty() {
                    match self.store.enqueue_many(as_held(&follow_ups)).await {
                        Ok(_) => follow_ups.clear(),
                        Err(e) => {
                            self.back_off(&mut pacing, "enqueueing follow-up jobs", &e)
                                .await;
                            continue;
                        }
                    }
                }
                let started = Instant::now();
                let claimed_at = self.store.now_ms();
                match self
                    .store
                    .complete_and_claim(&pending_done, claim.as_ref())
                    .await
                {
                    Ok(out) => {
                        if want > 0 {
                            self.stats.claim_query.observe(started.elapsed());
                        }
                        self.settle_done(&pending_done, &out.fenced);
                        pending_done.clear();
                        let got = out.claimed.len();
                        self.accept(out.claimed, &mut buffer, started);
                        self.start_buffered(&mut buffer, &mut running);
                        match pacing.claimed(want, got, started) {
                            AfterClaim::Again => continue,
                            AfterClaim::Wait { asked: true } => {
                                let (idle, due_before) = self.idle_sleep(&kinds, claimed_at).await;
                                pacing.idle(idle, due_before, started, Instant::now());
                            }
                            AfterClaim::Wait { asked: false } => {}
                        }
                    }
                    Err(e) => {
                        self.back_off(&mut pacing, "claim/complete", &e).await;
                        continue;
                    }
                }
            }
            if stopping && running.is_empty() && pending_done.is_empty() {
                self.release_buffer(&mut buffer).await;
                return;
            }
            if stopping {
                self.drain(
                    &mut running,
                    (&mut pending_done, &mut follow_ups),
                    &hard_stop,
                    &mut buffer,
                )
                .await;
                continue;
            }
            let wake_at = pacing.wait_until();
            tokio::select! {
                res = running.join_next(), if !running.is_empty() => {
                    if let Some(res) = res {
                        self.finish(res, &mut pending_done, &mut follow_ups).await;
                    }
                    pacing.job_finished();
                }
                changed = wake.changed() => {
                    if changed.is_err() {
                        // The store's wake-up source is gone; rely on polling.
                        wake = self.store.wakeups();
                        pacing.resubscribed(wake.borrow().now_seq);
                    } else {
                        let w = *wake.borrow_and_update();
                        let wait = w.due_at.saturating_sub(self.store.now_ms());
                        pacing.woken(w.now_seq, wait, Instant::now());
                    }
                }
                _ = tokio::time::sleep_until(wake_at.into()) => pacing.timer(Instant::now()),
                _ = stop.cancelled() => pacing.stop_requested(),
            }
        }
    }

    /// After a store error: counts it, says so and waits the pacing's backoff (doubling, at
    /// most 5 s).
    async fn back_off(&self, pacing: &mut Pacing, what: &str, e: &StoreError) {
        self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %e, "{what} failed; retrying with backoff");
        tokio::time::sleep(pacing.failed()).await;
    }

    /// How long until the next job this loop may run comes due (at most the poll interval),
    /// and whether it was already due at `claimed_at`, when the last claim looked.
    async fn idle_sleep(&self, kinds: &[String], claimed_at: i64) -> (Duration, bool) {
        let poll = self.config.poll_interval;
        match self
            .store
            .next_available_at(kinds, self.config.node.as_deref())
            .await
        {
            Ok(Some(at)) => {
                let wait = at.saturating_sub(self.store.now_ms()).max(0);
                (
                    Duration::from_millis(u64::try_from(wait).unwrap_or(0)).min(poll),
                    at <= claimed_at,
                )
            }
            _ => (poll, false),
        }
    }

    /// Takes claimed jobs into the buffer; `sent` is when the claim went out (the leases are
    /// certain for a lease from then).
    fn accept(&self, claimed: Vec<ClaimedJob>, buffer: &mut VecDeque<ClaimedJob>, sent: Instant) {
        let now = self.store.now_ms();
        for c in claimed {
            self.stats.claimed.fetch_add(1, Ordering::Relaxed);
            let waited = now.saturating_sub(c.job.available_at).max(0);
            self.stats
                .claim_wait
                .observe(Duration::from_millis(u64::try_from(waited).unwrap_or(0)));
            held_insert(&self.held, c.lease, sent + certain_for(self.config.lease));
            buffer.push_back(c);
        }
    }

    fn start_buffered(&self, buffer: &mut VecDeque<ClaimedJob>, running: &mut JoinSet<Finished>) {
        while running.len() < self.slots {
            let Some(c) = buffer.pop_front() else { return };
            let token = match held_get(&self.held, &c.lease) {
                Some(h) if !h.given_up => h.token,
                // Lost (or given up) while waiting in the buffer: do not run it.
                Some(_) => {
                    let (store, held, stats) =
                        (self.store.clone(), self.held.clone(), self.stats.clone());
                    tokio::spawn(async move { give_back(&store, &held, &stats, c.lease).await });
                    continue;
                }
                None => continue,
            };
            let Some(entry) = self.registry.entries.get(&c.job.agent).cloned() else {
                // Claimed only registered kinds; a missing entry is a bug, not input.
                tracing::error!(kind = %c.job.agent, "claimed a kind with no handler");
                continue;
            };
            let cx = JobContext {
                job: c.job,
                lease: c.lease,
                store: self.store.clone(),
                worker_id: self.config.worker_id.clone(),
                lease_ms: self.config.lease_ms(),
                cancel: token,
            };
            running.spawn(execute(entry, cx, self.stats.clone()));
        }
    }

    /// Routes a finished execution: done → the batched fast path (with its follow-up, if
    /// any); the rest → `mark_job`.
    async fn finish(
        &self,
        res: Result<Finished, tokio::task::JoinError>,
        pending_done: &mut Vec<Lease>,
        follow_ups: &mut Vec<FollowUp>,
    ) {
        let (lease, task_id, result, ended) = match res {
            Ok(f) => f,
            // `execute` catches panics; a join error here means the runtime is shutting down.
            Err(e) => {
                tracing::error!(error = %e, "job execution task ended abnormally");
                return;
            }
        };
        match held_get(&self.held, &lease) {
            // The lease was lost while the handler ran; whatever it returned cannot be recorded.
            None => return,
            // Given up here (no renewal reached the database in time): the handler was stopped,
            // so what it returned is not the job's result either.
            Some(h) if h.given_up => {
                // Off this loop: the database was unreachable a moment ago and may still be,
                // and this loop has other handlers to join and its shutdown to honour.
                let (store, held, stats) =
                    (self.store.clone(), self.held.clone(), self.stats.clone());
                tokio::spawn(async move { give_back(&store, &held, &stats, lease).await });
                return;
            }
            Some(_) => {}
        }
        let outcome = match result {
            Ok(o) => o,
            Err(error) => {
                let attempt = u32::try_from(lease.attempt.clamp(1, 20)).unwrap_or(1);
                Outcome::Retry {
                    error,
                    delay: Duration::from_secs(1) * 2u32.pow(attempt - 1),
                }
            }
        };
        let (store_outcome, counter) = match outcome {
            Outcome::Done => {
                pending_done.push(lease);
                return;
            }
            Outcome::DoneThen(next) => {
                pending_done.push(lease);
                follow_ups.push((ended, *next));
                return;
            }
            Outcome::Marked => {
                held_remove(&self.held, &lease);
                return;
            }
            Outcome::Retry { error, delay } => (
                JobOutcome::Retry {
                    error,
                    delay_ms: i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
                },
                &self.stats.retried,
            ),
            Outcome::Fail { error } => (JobOutcome::Failed { error }, &self.stats.failed),
        };
        let event = task_id.map(|t| failed_attempt_event(t, lease, &store_outcome));
        match self.store.mark_job(lease, store_outcome, event).await {
            Ok(()) => {
                counter.fetch_add(1, Ordering::Relaxed);
            }
            Err(StoreError::LeaseLost { .. }) => {
                self.stats.fenced.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    job = lease.job_id,
                    attempt = lease.attempt,
                    "could not record the job's failure: its lease was lost"
                );
            }
            Err(e) => {
                self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(job = lease.job_id, error = %e,
                    "could not record the job's failure; its lease will expire and it will be rescued");
            }
        }
        held_remove(&self.held, &lease);
    }

    fn settle_done(&self, done: &[Lease], fenced: &[Lease]) {
        for lease in done {
            held_remove(&self.held, lease);
            if fenced.contains(lease) {
                self.stats.fenced.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    job = lease.job_id,
                    attempt = lease.attempt,
                    "job finished but its lease was lost before it could be marked done; \
                     it was not recorded and will run again under its new attempt"
                );
            } else {
                self.stats.done.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Shutdown: wait for running jobs (up to the grace, or until the hard stop); then jobs
    /// waiting on a supervised command are left to it (their leases kept, for the next orch on
    /// this machine to adopt), the rest are cancelled and their leases given back.
    async fn drain(
        &self,
        running: &mut JoinSet<Finished>,
        (pending_done, follow_ups): (&mut Vec<Lease>, &mut Vec<FollowUp>),
        hard_stop: &CancellationToken,
        buffer: &mut VecDeque<ClaimedJob>,
    ) {
        self.release_buffer(buffer).await;
        if running.is_empty() {
            return;
        }
        let deadline = tokio::time::sleep(self.config.shutdown_grace);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                res = running.join_next() => match res {
                    Some(res) => self.finish(res, pending_done, follow_ups).await,
                    None => return,
                },
                _ = &mut deadline => break,
                _ = hard_stop.cancelled() => break,
            }
        }
        // Jobs waiting on a supervised command keep their leases and their commands: the next
        // orch on this machine frees the leases at once and adopts the commands.
        let waiting = orch_exec::supervise::waiting_jobs();
        let (left, stopped): (Vec<HeldLease>, Vec<HeldLease>) = held_snapshot(&self.held)
            .into_iter()
            .filter(|h| !pending_done.contains(&h.lease))
            .partition(|h| waiting.contains(&h.lease.job_id));
        if !left.is_empty() {
            orch_exec::supervise::leave_running();
        }
        // Out of time for the rest: stop their handlers and release their leases.
        let leases: Vec<Lease> = stopped
            .iter()
            .map(|h| {
                h.token.cancel();
                h.lease
            })
            .collect();
        if left.is_empty() {
            running.abort_all();
            while running.join_next().await.is_some() {}
        } else {
            // The stopped handlers end on their cancellation; the others are never dropped
            // (their destructors would remove what their commands use): the process exits.
            let wait_stopped = async {
                while running.len() > left.len() {
                    match running.join_next().await {
                        Some(res) => self.finish(res, pending_done, follow_ups).await,
                        None => break,
                    }
                }
            };
            let _ = tokio::time::timeout(STOPPED_GRACE, wait_stopped).await;
            tracing::info!(jobs = ?left.iter().map(|h| h.lease.job_id).collect::<Vec<_>>(),
                "leaving these jobs' commands running under their supervisors");
            std::mem::forget(std::mem::take(running));
        }
        self.release(&leases).await;
    }

    async fn release_buffer(&self, buffer: &mut VecDeque<ClaimedJob>) {
        let leases: Vec<Lease> = buffer.drain(..).map(|c| c.lease).collect();
        self.release(&leases).await;
    }

    async fn release(&self, leases: &[Lease]) {
        if leases.is_empty() {
            return;
        }
        match self.store.release(leases).await {
            Ok(n) => {
                self.stats.released.fetch_add(n, Ordering::Relaxed);
                tracing::info!(released = n, "gave unfinished jobs back to the queue");
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not release leases; they will expire and be rescued")
            }
        }
        for l in leases {
            held_remove(&self.held, l);
        }
    }
}

/// A lease given up by self-fencing, once its handler has stopped: given back to the queue (no
/// attempt spent) if it is still this process's; when the fence refuses, the job was rescued
/// and runs elsewhere, and nothing of this attempt is recorded.
async fn give_back(store: &Store, held: &Held, stats: &WorkerStats, lease: Lease) {
    match store.release(&[lease]).await {
        Ok(0) => {
            stats.fenced.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                job = lease.job_id,
                attempt = lease.attempt,
                "the stopped attempt's lease was lost: the job was rescued and runs elsewhere; nothing of this attempt is recorded"
            );
        }
        Ok(n) => {
            stats.released.fetch_add(n, Ordering::Relaxed);
            tracing::info!(
                job = lease.job_id,
                attempt = lease.attempt,
                "gave the stopped job back to the queue (no attempt spent)"
            );
        }
        Err(e) => {
            stats.store_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(job = lease.job_id, error = %e,
                "could not give the stopped job back; its lease will expire and it will be rescued");
        }
    }
    held_remove(held, &lease);
}

/// Runs one job: the handler races its timeout and its cancellation; a panic is caught and
/// becomes a retryable error.
async fn execute(entry: Entry, cx: JobContext, stats: Arc<WorkerStats>) -> Finished {
    let started = Instant::now();
    let lease = cx.lease;
    let task_id = cx.job.task_id;
    let cancel = cx.cancel.clone();
    let kind = cx.job.agent.clone();
    let timeout = entry.timeout;
    let handler = entry.handler;
    orch_exec::supervise::begin_job(lease.job_id);
    let work = AssertUnwindSafe(handler.run(cx)).catch_unwind();
    let result = tokio::select! {
        r = work => match r {
            Ok(Ok(outcome)) => Ok(outcome),
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(panic) => Err(format!("handler for {kind} panicked: {}", panic_text(&panic))),
        },
        _ = tokio::time::sleep(timeout) => {
            cancel.cancel();
            Err(format!("{kind} job timed out after {}s", timeout.as_secs()))
        }
        _ = cancel.cancelled() => Err("cancelled: lease lost or shutting down".to_owned()),
    };
    stats.job_seconds.observe(&kind, started.elapsed());
    (lease, task_id, result, Instant::now())
}

/// The event of an attempt whose handler failed (as opposed to one lost to a dead worker,
/// `job.rescued`): it counts against the job's attempts.
fn failed_attempt_event(task_id: i64, lease: Lease, outcome: &JobOutcome) -> NewEvent {
    let (message, last) = match outcome {
        JobOutcome::Failed { error } => (
            format!("attempt {} failed: {error} (no retry)", lease.attempt),
            true,
        ),
        JobOutcome::Retry { error, .. } => (
            format!(
                "attempt {} failed: {error} (counted against the job's attempts)",
                lease.attempt
            ),
            false,
        ),
        JobOutcome::Done => (format!("attempt {} done", lease.attempt), false),
    };
    NewEvent::new(orch_domain::control::events::JOB_ATTEMPT_FAILED, message)
        .task(task_id)
        .job(lease.job_id)
        .data(serde_json::json!({"attempt": lease.attempt, "final": last}).to_string())
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// A handler from an async closure (tests, built-in kinds).
pub fn handler_fn<F, Fut>(f: F) -> Arc<dyn JobHandler>
where
    F: Fn(JobContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<Outcome>> + Send + 'static,
{
    struct FnHandler<F>(F);
    #[async_trait::async_trait]
    impl<F, Fut> JobHandler for FnHandler<F>
    where
        F: Fn(JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = anyhow::Result<Outcome>> + Send + 'static,
    {
        async fn run(&self, cx: JobContext) -> anyhow::Result<Outcome> {
            (self.0)(cx).await
        }
    }
    Arc::new(FnHandler(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A follow-up's delay counts from when its handler asked for it: the time it then waited
    /// for its batch is taken off, never below zero.
    #[test]
    fn a_held_follow_up_keeps_its_due_time() {
        let ago = |ms| {
            Instant::now()
                .checked_sub(Duration::from_millis(ms))
                .unwrap_or_else(Instant::now)
        };
        let held = as_held(&[
            (ago(300), NewJob::new("tick", "a").delay_ms(1_000)),
            (ago(2_000), NewJob::new("tick", "b").delay_ms(1_000)),
            (Instant::now(), NewJob::new("tick", "c")),
        ]);
        assert!(
            (1..=700).contains(&held[0].delay_ms),
            "300 ms held of a 1 s delay: {}",
            held[0].delay_ms
        );
        assert_eq!(held[1].delay_ms, 0, "held past its due time: due now");
        assert_eq!(held[2].delay_ms, 0);
        assert_eq!(
            held.iter()
                .map(|j| j.task_content.as_str())
                .collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
    }
}
