//! The forge sync (issue 31, second part): for every work item that came from a forge's issue
//! (its `task.submitted` carries a [`forge::Origin`]), orch's side of the story goes back to
//! the forge: a draft pull request of `orch/<id>` once the stage that writes the code
//! (`StageDef::writes_code`: implementation) starts, its description
//! kept current, a commit status `orch/<stage>` per stage, the pull request's reviews acted
//! on (a change request sends the item back to that stage with the review as the
//! developer's feedback; an approval satisfies an `approval = true` stage the item waits at),
//! and the outcome said on the issue and the pull request (the issue closed when it shipped).
//!
//! Outbox style, restart-safe, no leader:
//! - [`ForgeSyncPass`] (every process) reads each forge item's events and enqueues a
//!   [`FORGE_SYNC`] job keyed by the newest event (`forge-sync:<task>:<event>`), so whichever
//!   process notices first, one job per new event. The job records its cursor
//!   (`forge.synced {through}`) when everything up to that event is on the forge; a crash
//!   before that replays the job, and everything it sends is idempotent (a status is set, a
//!   description replaced, the pull request found by its head before one is opened).
//! - The pass also reads each open pull request's reviews (conditional on their ETag) and
//!   enqueues one job per review that asks for something (`forge-review:<forge>:<pull>:<id>`,
//!   unique forever); the job's stage change carries the review's id, so the review is acted
//!   on once even after its job row is pruned.
//! - The outcome is one job per ending (`forge-outcome:<task>:<seq>`); its comment starts with
//!   a marker it looks for before posting, so a crash between posting and recording posts
//!   nothing twice.
//! - The jobs are task-less: a forge that does not answer never fails an item. They wait,
//!   retried with the pause `forge::pause_after` decides (`forge.waiting` when they start
//!   waiting, `forge.resumed` after).
//! - The token stays in [`crate::forge::GitHub`]; review text is untrusted input, bounded and
//!   defused by [`forge::review_feedback`], and reaches the developer only as the Markdown body
//!   of the feedback document `11-pull-request-review.md` on the work branch.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use orch_domain::config::{Config, RepoConfig};
use orch_domain::control::actor::Actor;
use orch_domain::control::{self, dedupe, events, jobs};
use orch_domain::forge::{self, ForgeConfig, Origin, ReviewState, StatusState};
use orch_domain::ids::RepoName;
use orch_domain::payload::{
    self, ForgeOutcome, ForgePull, ForgeReview, ForgeSynced, ReleaseDeployed, SentStatus,
    StageChange,
};
use orch_store::{AdvanceStage, Event, Fence, JobState, NewEvent, NewJob, Store, Task};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::engine::Engine;
use crate::forge::{GitHub, PollError, ReviewsPage};
use crate::live_config::LiveConfig;
use crate::ops::{Ops, OpsError};
use crate::repos::{self, RepoPaths};
use crate::worker::{JobContext, JobHandler, Outcome};

/// The job kind.
pub const FORGE_SYNC: &str = jobs::FORGE_SYNC;
/// How often the pass reads the forge items' events (the store only).
pub const SCAN_EVERY: Duration = Duration::from_secs(2);
/// Ended items are followed this long after they ended (their outcome is said by then).
pub const FOLLOW_ENDED_MS: i64 = 24 * 3600 * 1000;
/// A forge sync job is retried, paced, as long as this (it fails no item).
const MAX_ATTEMPTS: i64 = 100_000;

/// A [`FORGE_SYNC`] job's content.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "what", rename_all = "lowercase")]
enum SyncJob {
    /// Bring the forge up to the task's event `through`.
    Sync { task: i64, through: i64 },
    /// Act on one review of pull request `pull`.
    Review {
        task: i64,
        pull: u64,
        review: forge::Review,
    },
    /// Say the outcome of the ending that was visit `seq`.
    Outcome { task: i64, seq: i64 },
}

fn job_of(content: &SyncJob, key: String) -> Option<NewJob> {
    let text = serde_json::to_string(content).ok()?;
    Some(
        NewJob::new(FORGE_SYNC, text)
            .dedupe(key)
            .max_attempts(MAX_ATTEMPTS),
    )
}

/// The item's origin on the forge, from its `task.submitted`.
pub fn origin_of(events: &[Event]) -> Option<Origin> {
    events
        .iter()
        .find(|e| e.kind == events::TASK_SUBMITTED)
        .and_then(|e| Origin::of(&e.data_value()))
}

fn is_forge_kind(kind: &str) -> bool {
    kind.starts_with("forge.")
}

/// The newest event the forge follows (the sync's own events aside).
fn through_of(events: &[Event]) -> i64 {
    events
        .iter()
        .filter(|e| !is_forge_kind(&e.kind))
        .map(|e| e.id)
        .max()
        .unwrap_or(0)
}

/// The sync's cursor: the newest event already on the forge.
fn cursor_of(events: &[Event]) -> i64 {
    events
        .iter()
        .filter(|e| e.kind == events::FORGE_SYNCED)
        .filter_map(|e| payload::read::<ForgeSynced>(&e.data))
        .map(|s| s.through)
        .max()
        .unwrap_or(0)
}

/// The digest of a pull request description, as `forge.synced` records the one sent.
fn body_digest(body: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(body.as_bytes())
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The digest of the description the forge has (the last `forge.synced` that names one).
fn last_body_of(events: &[Event]) -> Option<String> {
    events
        .iter()
        .rev()
        .filter(|e| e.kind == events::FORGE_SYNCED)
        .filter_map(|e| payload::read::<ForgeSynced>(&e.data))
        .find_map(|s| s.body)
}

/// The pull request orch closed at an ending, when nothing reopened it since: an item live
/// again after that (an operator retried it) has it reopened, so its reviews steer it again.
/// Orch closed it when, since the last reopening, it recorded its intent to close it
/// (`forge.pull_closing`, written before the call) or a close it made (`closed_now`): a crash
/// between the call and its record, or an item retried and ending again before any sync ran
/// (its second ending finds the pull request closed, by orch), keeps orch's right to reopen it.
fn closed_by_orch(history: &[Event]) -> Option<u64> {
    let since = history
        .iter()
        .rposition(|e| e.kind == events::FORGE_PULL_REOPENED)
        .map_or(0, |i| i + 1);
    let since = history.get(since..).unwrap_or_default();
    let last = since
        .iter()
        .rev()
        .find(|e| e.kind == events::FORGE_PULL_CLOSED || e.kind == events::FORGE_PULL_CLOSING)?;
    let pull = last.data_value()["pull"].as_u64()?;
    since
        .iter()
        .any(|e| {
            let d = e.data_value();
            d["pull"].as_u64() == Some(pull)
                && (e.kind == events::FORGE_PULL_CLOSING
                    || (e.kind == events::FORGE_PULL_CLOSED && d["closed_now"] == true))
        })
        .then_some(pull)
}

/// Whether orch recorded its intent to close pull request `number` at the ending `seq`.
fn closing_recorded(history: &[Event], number: u64, seq: i64) -> bool {
    history.iter().any(|e| {
        let d = e.data_value();
        e.kind == events::FORGE_PULL_CLOSING
            && d["pull"].as_u64() == Some(number)
            && d["seq"].as_i64() == Some(seq)
    })
}

/// Whether GitHub's refusal is for good: 404 (gone) or a 403 that is not a rate limit (no
/// `Retry-After`, quota not used up: the token may not do it). Asking again cannot help.
fn refused_for_good(e: &PollError) -> bool {
    let a = &e.answer;
    a.status == 404 || (a.status == 403 && a.retry_after.is_none() && a.remaining != Some(0))
}

/// The item's pull request's number, once found or opened.
fn pull_of(events: &[Event]) -> Option<u64> {
    events
        .iter()
        .rev()
        .find(|e| e.kind == events::FORGE_PULL)
        .and_then(|e| payload::read::<ForgePull>(&e.data))
        .map(|p| p.number)
}

/// The approval of review `review` that a job recorded it is about to make (`forge.review`,
/// `action: approving`): the stage and visit it approves.
fn approving_of(events: &[Event], review: u64) -> Option<(String, i64)> {
    events
        .iter()
        .filter(|e| e.kind == events::FORGE_REVIEW)
        .filter_map(|e| payload::read::<ForgeReview>(&e.data))
        .find(|r| r.review == review && r.action == ForgeReview::APPROVING)
        .and_then(|r| Some((r.stage?, r.seq?)))
}

/// The reviews already acted on: named by `forge.review` or by the loop back they caused.
fn reviews_taken(events: &[Event]) -> HashSet<u64> {
    events
        .iter()
        .filter_map(|e| match e.kind.as_str() {
            events::FORGE_REVIEW => payload::read::<ForgeReview>(&e.data).map(|r| r.review),
            events::STAGE_LOOP_BACK => payload::read::<StageChange>(&e.data)?.review,
            _ => None,
        })
        .collect()
}

fn forge_of(config: &Config, name: &RepoName) -> Option<(RepoName, RepoConfig, ForgeConfig)> {
    let repo = config.repos.get(name)?.clone();
    let f = repo.forge.clone()?;
    Some((name.clone(), repo, f))
}

/// The state of stage `stage`'s status as the events say, in event order: which stages each
/// event touched, and the latest state of each.
fn statuses_of(events: &[Event]) -> Vec<(i64, String, StatusState, String)> {
    let mut out = Vec::new();
    for e in events {
        let change = || payload::read::<StageChange>(&e.data).unwrap_or_default();
        match e.kind.as_str() {
            k if k == events::STAGE_STARTED => {
                if let Some(stage) = &e.stage {
                    out.push((e.id, stage.clone(), StatusState::Pending, e.message.clone()));
                }
            }
            k if k == events::STAGE_ADVANCED => {
                let c = change();
                if let Some(from) = c.from.clone() {
                    let outcome = c.outcome.clone().unwrap_or_else(|| "passed".to_owned());
                    // A stage whose failure does not send the item back (the watch's rollback
                    // goes on to lessons) still failed.
                    let state = match outcome.as_str() {
                        "NOT_SUCCESS"
                        | "FAILED"
                        | "CONFLICT"
                        | "DEGRADED"
                        | "TOOL_ERROR_EXHAUSTED" => StatusState::Failure,
                        _ => StatusState::Success,
                    };
                    out.push((e.id, from, state, outcome));
                }
                if c.awaits_approval()
                    && let Some(to) = c.to
                {
                    out.push((
                        e.id,
                        to,
                        StatusState::Pending,
                        "waiting for an approval (an approving review gives it)".to_owned(),
                    ));
                }
            }
            k if k == events::STAGE_LOOP_BACK => {
                let StageChange { from, to, .. } = change();
                if let Some(from) = from {
                    out.push((
                        e.id,
                        from,
                        StatusState::Failure,
                        format!(
                            "sent back to {}: {}",
                            to.as_deref().unwrap_or("an earlier stage"),
                            e.message
                        ),
                    ));
                }
            }
            k if k == events::STAGE_APPROVED => {
                if let Some(stage) = &e.stage {
                    out.push((e.id, stage.clone(), StatusState::Pending, e.message.clone()));
                }
            }
            k if k == events::TASK_DONE => {
                if let Some(from) = change().from {
                    out.push((e.id, from, StatusState::Success, "done".to_owned()));
                }
            }
            k if k == events::TASK_FAILED => {
                if let Some(stage) = change().failed_stage().map(str::to_owned) {
                    out.push((e.id, stage, StatusState::Failure, e.message.clone()));
                }
            }
            k if k == events::TASK_CANCELLED => {
                if let Some(from) = change().from {
                    out.push((e.id, from, StatusState::Error, e.message.clone()));
                }
            }
            _ => {}
        }
    }
    out
}

/// The per-repo state of the pass: when the reviews are next read, the ETag of each pull
/// request's reviews, whether reading them waits (an outage, a rate limit), and what the pass
/// last read of each item.
#[derive(Debug, Default)]
struct RepoSync {
    next_reviews_ms: i64,
    failures: u32,
    waiting_since_ms: Option<i64>,
    etags: HashMap<u64, String>,
    seen: HashMap<i64, Seen>,
}

/// How long the pass trusts an unchanged [`Mark`]: each followed item's history is read again
/// at least this often. On PostgreSQL event ids are taken when a transaction inserts, not
/// when it commits, so an event committing late can carry an id lower than the newest one a
/// pass already saw: the mark would not move for it, and without this re-read its sync job
/// would wait for the item's next change.
const REREAD_MS: i64 = 30_000;

/// What tells the pass that an item has something new: its row's last change and its newest
/// event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mark {
    updated_at: i64,
    stage_seq: i64,
    newest_event: i64,
}

/// What the pass read of an item's history at [`Mark`], kept until the mark moves or
/// [`REREAD_MS`] passed since it was read.
#[derive(Debug)]
struct Seen {
    mark: Mark,
    /// When the history was read (the store's clock).
    read_at: i64,
    /// It came from this forge's issue.
    follows: bool,
    pull: Option<u64>,
    taken: HashSet<u64>,
}

/// Enqueues the forge sync's jobs: one per new event of a forge item, one per review that asks
/// for something. Every process runs it; the jobs' dedupe keys make each once.
pub struct ForgeSyncPass {
    pub live: LiveConfig,
    pub tick: Duration,
    state: crate::forge::RepoStates<RepoSync>,
}

impl ForgeSyncPass {
    pub fn new(live: LiveConfig) -> ForgeSyncPass {
        ForgeSyncPass {
            live,
            tick: SCAN_EVERY,
            state: crate::forge::RepoStates::new(),
        }
    }

    async fn scan_repo(
        &self,
        store: &Store,
        name: &RepoName,
        forge_cfg: &ForgeConfig,
    ) -> anyhow::Result<()> {
        let key = crate::forge::state_key(name, forge_cfg);
        let mut st = self.state.take(&key);
        let result = self.scan(store, name, forge_cfg, &mut st).await;
        self.state.put(key, st);
        result
    }

    async fn scan(
        &self,
        store: &Store,
        name: &RepoName,
        forge_cfg: &ForgeConfig,
        st: &mut RepoSync,
    ) -> anyhow::Result<()> {
        let now = store.now_ms();
        let reviews_due = now >= st.next_reviews_ms;
        let prefix = format!("{}-", forge_cfg.prefix);
        // Every live task of the repo, however many, and the ones that ended within the day.
        let tasks: Vec<Task> = store
            .tasks_followed(name.as_str(), now - FOLLOW_ENDED_MS)
            .await?
            .into_iter()
            .filter(|t| t.work_item_id.as_str().starts_with(&prefix))
            .collect();
        let ids: Vec<i64> = tasks.iter().map(|t| t.id).collect();
        let newest: HashMap<i64, i64> = store.newest_event_ids(&ids).await?.into_iter().collect();
        let followed: HashSet<i64> = ids.iter().copied().collect();
        st.seen.retain(|id, _| followed.contains(id));
        let mut gh: Option<GitHub> = None;
        let mut failed: Option<PollError> = None;
        for task in tasks {
            let mark = Mark {
                updated_at: task.updated_at,
                stage_seq: task.stage_seq,
                newest_event: newest.get(&task.id).copied().unwrap_or(0),
            };
            // An item whose row and newest event are as the last pass saw them has nothing new:
            // its history is not read again (a restart reads every one once), except every
            // `REREAD_MS` (an event that committed late, below the newest id, on PostgreSQL).
            if st
                .seen
                .get(&task.id)
                .is_none_or(|s| s.mark != mark || now - s.read_at >= REREAD_MS)
            {
                let history = store.task_events(task.id).await?;
                let follows = origin_of(&history)
                    .is_some_and(|o| o.repo.eq_ignore_ascii_case(&forge_cfg.repo));
                let through = through_of(&history);
                if follows
                    && through > cursor_of(&history)
                    && let Some(job) = job_of(
                        &SyncJob::Sync {
                            task: task.id,
                            through,
                        },
                        dedupe::forge_sync(task.id, through),
                    )
                {
                    store.enqueue(job).await?;
                }
                // Kept only once its job is enqueued: an error above reads it again next pass.
                st.seen.insert(
                    task.id,
                    Seen {
                        mark,
                        read_at: now,
                        follows,
                        pull: pull_of(&history),
                        taken: reviews_taken(&history),
                    },
                );
            }
            let Some(seen) = st.seen.get(&task.id) else {
                continue;
            };
            if !seen.follows || !reviews_due || task.is_terminal() || failed.is_some() {
                continue;
            }
            let Some(pull) = seen.pull else {
                continue;
            };
            if gh.is_none() {
                match GitHub::connect(forge_cfg) {
                    Ok(g) => gh = Some(g),
                    Err(e) => {
                        failed = Some(e);
                        continue;
                    }
                }
            }
            let Some(g) = gh.as_ref() else { continue };
            let page = match g
                .reviews(pull, st.etags.get(&pull).map(String::as_str))
                .await
            {
                Ok(p) => p,
                Err(e) => {
                    failed = Some(e);
                    continue;
                }
            };
            let ReviewsPage::Fresh { reviews, etag } = page else {
                continue;
            };
            let taken = st
                .seen
                .get(&task.id)
                .map(|s| s.taken.clone())
                .unwrap_or_default();
            let mut all_queued = true;
            for review in reviews {
                if ReviewState::of(&review.state) == ReviewState::Other
                    || taken.contains(&review.id)
                {
                    continue;
                }
                if !review.trusted() {
                    // Anyone may review a public repository's pull request: only the
                    // repository's people steer the item.
                    tracing::info!(work_item = %task.work_item_id, review = review.id,
                        "forge sync: a review by someone without write access to {} is not acted on", forge_cfg.repo);
                    continue;
                }
                let key = dedupe::forge_review(&forge_cfg.repo, pull, review.id);
                let job = job_of(
                    &SyncJob::Review {
                        task: task.id,
                        pull,
                        review,
                    },
                    key,
                );
                match job {
                    Some(job) => {
                        store.enqueue(job).await?;
                    }
                    None => all_queued = false,
                }
            }
            match etag {
                Some(etag) if all_queued => {
                    st.etags.insert(pull, etag);
                }
                _ => {
                    st.etags.remove(&pull);
                }
            }
        }
        if reviews_due {
            self.paced(store, name, forge_cfg, st, failed).await;
        }
        Ok(())
    }

    /// When the reviews are read next, and `forge.waiting`/`forge.resumed` as polling says them.
    async fn paced(
        &self,
        store: &Store,
        name: &RepoName,
        forge_cfg: &ForgeConfig,
        st: &mut RepoSync,
        failed: Option<PollError>,
    ) {
        let now = store.now_ms();
        let interval_s = match forge_cfg.poll_interval_s {
            0 => 60,
            s => s,
        };
        let Some(e) = failed else {
            st.failures = 0;
            st.next_reviews_ms = now.saturating_add(
                i64::try_from(interval_s.saturating_mul(1000)).unwrap_or(i64::MAX / 2),
            );
            if let Some(since) = st.waiting_since_ms.take() {
                let waited_s = (now - since) / 1000;
                let event = NewEvent::new(
                    events::FORGE_RESUMED,
                    format!(
                        "GitHub {} answers again; reading the pull requests' reviews for repo {name} resumed after {waited_s} s",
                        forge_cfg.repo
                    ),
                )
                .data(json!({"repo": name.as_str(), "forge": forge_cfg.repo, "waited_s": waited_s, "what": "reviews"}).to_string());
                if let Err(e) = store.append_event(event).await {
                    tracing::warn!(error = %e, "forge sync: cannot record forge.resumed");
                }
            }
            return;
        };
        st.failures = st.failures.saturating_add(1);
        let pause = forge::pause_after(
            &e.answer,
            now / 1000,
            st.failures,
            interval_s,
            forge_cfg.max_backoff_s,
            crate::forge::jitter(),
        )
        .unwrap_or(forge::Pause {
            secs: interval_s,
            why: e.message.clone(),
            failure: true,
        });
        st.next_reviews_ms = now
            .saturating_add(i64::try_from(pause.secs.saturating_mul(1000)).unwrap_or(i64::MAX / 2));
        let why = format!("{}: {}", pause.why, e.message);
        tracing::warn!(repo = %name, forge = %forge_cfg.repo, wait_s = pause.secs, "forge sync: {why}");
        if st.waiting_since_ms.is_none() {
            st.waiting_since_ms = Some(now);
            let event = NewEvent::new(
                events::FORGE_WAITING,
                format!(
                    "reading the pull requests' reviews on GitHub {} for repo {name} waits {} s: {why}; no item fails",
                    forge_cfg.repo, pause.secs
                ),
            )
            .data(json!({"repo": name.as_str(), "forge": forge_cfg.repo, "why": why,
                         "wait_s": pause.secs, "failures": st.failures, "what": "reviews"}).to_string());
            if let Err(e) = store.append_event(event).await {
                tracing::warn!(error = %e, "forge sync: cannot record forge.waiting");
            }
        }
    }
}

#[async_trait::async_trait]
impl crate::maintenance::Pass for ForgeSyncPass {
    fn name(&self) -> &'static str {
        "forge-sync"
    }

    fn every(&self) -> Duration {
        self.tick
    }

    async fn run(&self, store: &Store) -> anyhow::Result<()> {
        let config = self.live.current();
        for (name, repo) in &config.repos {
            let Some(forge_cfg) = repo.forge.as_ref() else {
                continue;
            };
            self.scan_repo(store, name, forge_cfg).await?;
        }
        Ok(())
    }
}

/// Why a sync job could not finish: the forge (waited for), or anything else.
enum SyncError {
    Forge(PollError),
    Other(anyhow::Error),
}

impl From<PollError> for SyncError {
    fn from(e: PollError) -> SyncError {
        SyncError::Forge(e)
    }
}

impl From<anyhow::Error> for SyncError {
    fn from(e: anyhow::Error) -> SyncError {
        SyncError::Other(e)
    }
}

impl From<orch_store::StoreError> for SyncError {
    fn from(e: orch_store::StoreError) -> SyncError {
        SyncError::Other(e.into())
    }
}

/// Runs the [`FORGE_SYNC`] jobs.
pub struct ForgeSyncHandler {
    pub ops: Ops,
    pub engine: Arc<Engine>,
    /// One job per item at a time in this process: the next one reads what the last one
    /// recorded (its pull request) instead of racing it to open a second.
    locks: Mutex<HashMap<i64, Arc<tokio::sync::Mutex<()>>>>,
    /// Reviewers' permissions read from the forge, by `(forge repo, login)`, with when they
    /// were read: asked again after [`PERMISSION_TTL`].
    permissions: Mutex<HashMap<(String, String), (std::time::Instant, String)>>,
    /// The login each forge token acts as, by `(api_url, token_env)`: the author of orch's
    /// own comments.
    own_logins: Mutex<HashMap<(String, String), String>>,
}

/// How long a reviewer's permission read from the forge is taken as it is.
const PERMISSION_TTL: Duration = Duration::from_secs(300);

impl ForgeSyncHandler {
    pub fn new(ops: Ops, engine: Arc<Engine>) -> ForgeSyncHandler {
        ForgeSyncHandler {
            ops,
            engine,
            locks: Mutex::new(HashMap::new()),
            permissions: Mutex::new(HashMap::new()),
            own_logins: Mutex::new(HashMap::new()),
        }
    }

    /// The login the forge's token acts as, asked once per API and token variable.
    async fn own_login(&self, gh: &GitHub, forge_cfg: &ForgeConfig) -> Result<String, PollError> {
        let key = (forge_cfg.api_url.clone(), forge_cfg.token_env.clone());
        if let Ok(m) = self.own_logins.lock()
            && let Some(l) = m.get(&key)
        {
            return Ok(l.clone());
        }
        let login = gh.own_login().await?;
        if let Ok(mut m) = self.own_logins.lock() {
            m.insert(key, login.clone());
        }
        Ok(login)
    }

    /// `login`'s permission on the forge repository, read at most every [`PERMISSION_TTL`].
    async fn permission(
        &self,
        gh: &GitHub,
        forge_cfg: &ForgeConfig,
        login: &str,
    ) -> Result<String, PollError> {
        let key = (
            forge_cfg.repo.to_ascii_lowercase(),
            login.to_ascii_lowercase(),
        );
        if let Ok(m) = self.permissions.lock()
            && let Some((at, p)) = m.get(&key)
            && at.elapsed() < PERMISSION_TTL
        {
            return Ok(p.clone());
        }
        let p = gh.permission(login).await?;
        if let Ok(mut m) = self.permissions.lock() {
            if m.len() > 4096 {
                m.retain(|_, (at, _)| at.elapsed() < PERMISSION_TTL);
            }
            m.insert(key, (std::time::Instant::now(), p.clone()));
        }
        Ok(p)
    }

    /// Why review `review` of pull request `pull` is not acted on, if it is not: its
    /// reviewer lacks write access (or is not among the forge's `reviewers`), or the review
    /// no longer stands as listed (changed or dismissed since, superseded by the reviewer's
    /// later review, or of another commit than the branch's head orch knows).
    async fn standing(
        &self,
        item: &Item,
        pull: u64,
        review: &forge::Review,
    ) -> Result<Option<String>, SyncError> {
        let gh = GitHub::connect(&item.forge_cfg)?;
        let p = gh.pull(pull).await?;
        if p.state == "closed" && p.merged_at.is_none() {
            // Someone closed the item's pull request: its reviews no longer speak for the
            // item. Said on the issue, once per pull request.
            let marker = format!("<!-- {}:closed-pull {pull} -->", "orch");
            let own = self.own_login(&gh, &item.forge_cfg).await?;
            if gh
                .own_comment(item.origin.issue, &marker, &own)
                .await?
                .is_none()
            {
                gh.comment(
                    item.origin.issue,
                    &format!(
                        "{marker}\nPull request #{pull} of {} was closed without being merged: \
                         orch does not act on its reviews. Approve the item with `orch approve` \
                         (or the dashboard), or cancel it.",
                        item.task.work_item_id
                    ),
                )
                .await?;
            }
            return Ok(Some(format!(
                "pull request #{pull} is closed without being merged"
            )));
        }
        let permission = self.permission(&gh, &item.forge_cfg, &review.user).await?;
        if let Err(why) = forge::may_steer(&review.user, &permission, &item.forge_cfg.reviewers) {
            return Ok(Some(why));
        }
        let Some(fresh) = gh.review(pull, review.id).await? else {
            return Ok(Some("the review is no longer on GitHub".to_owned()));
        };
        let all = match gh.reviews(pull, None).await? {
            ReviewsPage::Fresh { reviews, .. } => reviews,
            ReviewsPage::NotModified => Vec::new(),
        };
        let head = self.head(item).await;
        if let Err(why) = forge::review_stands(review, &fresh, &all, head.as_deref()) {
            return Ok(Some(why));
        }
        if ReviewState::of(&fresh.state) == ReviewState::Approved {
            // GitHub's own rule: no approval while a change request with write access stands.
            for cr in forge::standing_change_requests(&all, &fresh.user) {
                let permission = self.permission(&gh, &item.forge_cfg, &cr.user).await?;
                if forge::may_steer(&cr.user, &permission, &item.forge_cfg.reviewers).is_ok() {
                    return Ok(Some(format!(
                        "review {} by {} still requests changes",
                        cr.id,
                        orch_domain::text::escape(&cr.user)
                    )));
                }
            }
        }
        Ok(None)
    }

    fn lock_of(&self, task_id: i64) -> Arc<tokio::sync::Mutex<()>> {
        match self.locks.lock() {
            Ok(mut m) => {
                if m.len() > 1024 {
                    m.retain(|_, l| Arc::strong_count(l) > 1);
                }
                m.entry(task_id).or_default().clone()
            }
            Err(_) => Arc::new(tokio::sync::Mutex::new(())),
        }
    }
}

/// One forge item, read once.
struct Item {
    task: Task,
    history: Vec<Event>,
    origin: Origin,
    name: RepoName,
    repo: RepoConfig,
    forge_cfg: ForgeConfig,
}

#[async_trait::async_trait]
impl JobHandler for ForgeSyncHandler {
    async fn run(&self, cx: JobContext) -> anyhow::Result<Outcome> {
        let job: SyncJob = match serde_json::from_str(&cx.job.task_content) {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(job = cx.job.id, error = %e, "forge sync: unreadable job; dropped");
                return Ok(Outcome::Done);
            }
        };
        let task_id = match &job {
            SyncJob::Sync { task, .. }
            | SyncJob::Review { task, .. }
            | SyncJob::Outcome { task, .. } => *task,
        };
        let lock = self.lock_of(task_id);
        let _held = lock.lock().await;
        let Some(item) = self.item(task_id).await? else {
            return Ok(Outcome::Done);
        };
        let result = match job {
            SyncJob::Sync { through, .. } => self.sync(&cx, &item, through).await,
            SyncJob::Review { pull, review, .. } => self.review(&cx, &item, pull, &review).await,
            SyncJob::Outcome { seq, .. } => self.outcome(&cx, &item, seq).await,
        };
        let attempt = cx.lease.attempt;
        match result {
            Ok(outcome) => {
                if attempt > 1 && self.waited(&item, cx.job.id).await {
                    let event = NewEvent::new(
                        events::FORGE_RESUMED,
                        format!(
                            "GitHub {} answers again; the forge sync of {} went on at try {attempt}",
                            item.forge_cfg.repo, item.task.work_item_id
                        ),
                    )
                    .task(item.task.id)
                    .job(cx.job.id)
                    .data(json!({"repo": item.name.as_str(), "forge": item.forge_cfg.repo, "attempt": attempt}).to_string());
                    cx.store.append_event_fenced(cx.lease, event).await?;
                }
                Ok(outcome)
            }
            Err(SyncError::Forge(e)) => {
                let now = cx.store.now_ms();
                let failures = u32::try_from(attempt).unwrap_or(u32::MAX);
                let pause = forge::pause_after(
                    &e.answer,
                    now / 1000,
                    failures,
                    2,
                    item.forge_cfg.max_backoff_s,
                    crate::forge::jitter(),
                )
                .unwrap_or(forge::Pause {
                    secs: 2,
                    why: e.message.clone(),
                    failure: true,
                });
                let why = format!("{}: {}", pause.why, e.message);
                tracing::warn!(work_item = %item.task.work_item_id, forge = %item.forge_cfg.repo, wait_s = pause.secs, "forge sync waits: {why}");
                if !self.waited(&item, cx.job.id).await {
                    let event = NewEvent::new(
                        events::FORGE_WAITING,
                        format!(
                            "the forge sync of {} with GitHub {} waits {} s: {why}; the item does not wait for it, and the sync resumes by itself",
                            item.task.work_item_id, item.forge_cfg.repo, pause.secs
                        ),
                    )
                    .task(item.task.id)
                    .job(cx.job.id)
                    .data(json!({"repo": item.name.as_str(), "forge": item.forge_cfg.repo, "why": why,
                                 "wait_s": pause.secs, "failures": failures}).to_string());
                    cx.store.append_event_fenced(cx.lease, event).await?;
                }
                Ok(Outcome::Retry {
                    error: why,
                    delay: Duration::from_secs(pause.secs.max(1)),
                })
            }
            Err(SyncError::Other(e)) => Err(e),
        }
    }
}

impl ForgeSyncHandler {
    async fn item(&self, task_id: i64) -> anyhow::Result<Option<Item>> {
        let store = self.engine.store();
        let Some(task) = store.get_task(task_id).await? else {
            return Ok(None);
        };
        let history = store.task_events(task.id).await?;
        let Some(origin) = origin_of(&history) else {
            return Ok(None);
        };
        let config = self.engine.config().live.current();
        let Some((name, repo, forge_cfg)) = forge_of(&config, &task.repo) else {
            tracing::info!(work_item = %task.work_item_id, "forge sync: the repo no longer has a forge; nothing sent");
            return Ok(None);
        };
        Ok(Some(Item {
            task,
            history,
            origin,
            name,
            repo,
            forge_cfg,
        }))
    }

    /// Whether job `job` already said it waits.
    async fn waited(&self, item: &Item, job: i64) -> bool {
        let store = self.engine.store();
        match store.task_events(item.task.id).await {
            Ok(events) => events
                .iter()
                .any(|e| e.kind == events::FORGE_WAITING && e.job_id == Some(job)),
            Err(_) => true,
        }
    }

    fn task_url(&self, item: &Item) -> String {
        let config = self.engine.config().live.current();
        orch_domain::notice::links(
            &config.settings.link_base(),
            item.task.work_item_id.as_str(),
            item.task.repo.as_str(),
        )
        .task
    }

    fn paths(&self, item: &Item) -> RepoPaths {
        RepoPaths::new(&self.engine.config().repos_dir, &item.name)
    }

    /// The branch's head in orch's clone, when it has one.
    async fn head(&self, item: &Item) -> Option<String> {
        let paths = self.paths(item);
        self.engine
            .git()
            .rev_parse(&paths.repo_dir, &format!("refs/heads/{}", item.task.branch))
            .await
            .ok()
            .flatten()
    }

    async fn pull_view(&self, item: &Item) -> forge::PullView {
        let paths = self.paths(item);
        let work_item = item.task.work_item_id.clone();
        let dir = work_item.artifact_dir();
        let documents = match self
            .engine
            .git()
            .files_at(
                &paths.repo_dir,
                &format!("refs/heads/{}", item.task.branch),
                &dir,
            )
            .await
        {
            Ok(files) => files
                .into_iter()
                .filter_map(|(path, _)| {
                    path.strip_prefix(&format!("{dir}/"))
                        .filter(|n| !n.contains('/'))
                        .map(str::to_owned)
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        let outcome_of_stage = |stage: &str| {
            item.history
                .iter()
                .rev()
                .filter(|e| e.kind == events::STAGE_ADVANCED || e.kind == events::STAGE_LOOP_BACK)
                .filter_map(|e| payload::read::<StageChange>(&e.data))
                .find(|c| c.from.as_deref() == Some(stage))
                .and_then(|c| c.outcome)
        };
        let latest = |kind: &str| {
            item.history
                .iter()
                .rev()
                .find(|e| e.kind == kind)
                .map(|e| e.message.clone())
        };
        let awaiting = item
            .history
            .iter()
            .rev()
            .find(|e| control::events::STAGE_ENTERED.contains(&e.kind.as_str()))
            .and_then(|e| payload::read::<StageChange>(&e.data))
            .is_some_and(|c| c.awaits_approval())
            && !item
                .history
                .iter()
                .rev()
                .take_while(|e| !control::events::STAGE_ENTERED.contains(&e.kind.as_str()))
                .any(|e| e.kind == events::STAGE_APPROVED);
        let outcome = orch_store::outcome_of_events(item.task.stage.as_str(), &item.history)
            .map(|o| o.outcome.label().to_owned());
        forge::PullView {
            work_item: work_item.into(),
            issue: item.origin.issue,
            web: item.origin.web_url(),
            branch: item.task.branch.clone(),
            stage: item.task.stage.to_string(),
            awaiting_approval: awaiting,
            documents,
            tests: outcome_of_stage("verification"),
            staging: outcome_of_stage("staging"),
            deploy: latest(events::RELEASE_DEPLOYED),
            watch: latest(events::POST_DEPLOY_VERDICT),
            outcome,
            task_url: self.task_url(item),
        }
    }

    /// Brings the forge up to event `through`: the pull request (once the code stage has
    /// started), the statuses of the stages the new events touched, the description; then the
    /// outcome's job when the item has ended, and the cursor.
    async fn sync(&self, cx: &JobContext, item: &Item, through: i64) -> Result<Outcome, SyncError> {
        if cursor_of(&item.history) >= through {
            return Ok(Outcome::Done);
        }
        let cursor = cursor_of(&item.history);
        let through = through.max(through_of(&item.history));
        let gh = GitHub::connect(&item.forge_cfg)?;
        // The pull request opens once the stage that writes the code has started.
        let code_stage = self.engine.config().pipeline.code_stage();
        let code_stage = code_stage.map(|s| s.name.as_str());
        let started = code_stage.is_some_and(|code| {
            item.history.iter().any(|e| {
                e.stage.as_deref() == Some(code)
                    || payload::read::<StageChange>(&e.data)
                        .is_some_and(|c| c.from.as_deref() == Some(code))
            })
        });
        let mut pull = pull_of(&item.history);
        let view = self.pull_view(item).await;
        let body = forge::pull_body(&view);
        let mut opened_now = false;
        if pull.is_none() && started {
            let found = crate::forge::find_or_open_pull(
                &gh,
                &item.task.title,
                &item.task.branch,
                &item.repo.default_branch,
                &body,
            )
            .await?;
            crate::failpoint::hit("forge.after_pull_opened");
            match found {
                Some((p, opened)) => {
                    opened_now = opened;
                    let event = NewEvent::new(
                        events::FORGE_PULL,
                        format!(
                            "{} pull request {}#{} of `{}` ({})",
                            if opened {
                                "opened the draft"
                            } else {
                                "found the"
                            },
                            item.forge_cfg.repo,
                            p.number,
                            item.task.branch,
                            p.html_url
                        ),
                    )
                    .task(item.task.id)
                    .job(cx.job.id)
                    .data(payload::text(&ForgePull {
                        number: p.number,
                        url: p.html_url.clone(),
                        head: item.task.branch.clone(),
                        base: item.repo.default_branch.clone(),
                        opened,
                    }));
                    cx.store.append_event_fenced(cx.lease, event).await?;
                    pull = Some(p.number);
                }
                None => {
                    tracing::warn!(work_item = %item.task.work_item_id, forge = %item.forge_cfg.repo,
                        "forge sync: GitHub refused the pull request of `{}` (is the branch on GitHub? the repo needs `url` or a bare repository as its remote)", item.task.branch);
                }
            }
        }
        // Live again after orch closed its pull request at an ending (a retry): reopened, when
        // the row, read again right before the call, is still live (it may have ended again
        // since the job loaded it; the next ending's sync then finds it as it is). A refusal
        // for good (403, 404) is recorded as not reopened, like a 422, and the sync goes on.
        if !item.task.is_terminal()
            && let Some(n) = closed_by_orch(&item.history)
            && pull == Some(n)
            && live_now(cx, item).await?
        {
            let reopened = match gh.reopen_pull(n).await {
                Ok(reopened) => reopened,
                Err(e) if refused_for_good(&e) => {
                    tracing::warn!(work_item = %item.task.work_item_id, pull = n,
                        "forge sync: GitHub refused to reopen the pull request: {}", e.message);
                    false
                }
                Err(e) => return Err(e.into()),
            };
            let event = NewEvent::new(
                events::FORGE_PULL_REOPENED,
                format!(
                    "pull request {}#{n} of {} {}",
                    item.forge_cfg.repo,
                    item.task.work_item_id,
                    if reopened {
                        "reopened: the item is live again"
                    } else {
                        "cannot be reopened (GitHub refused): its reviews steer nothing"
                    }
                ),
            )
            .task(item.task.id)
            .job(cx.job.id)
            .data(json!({"pull": n, "seq": item.task.stage_seq, "reopened": reopened}).to_string());
            cx.store.append_event_fenced(cx.lease, event).await?;
        }
        // The statuses of the stages the new events touched, each at its latest state.
        let mut latest: BTreeMap<String, (StatusState, String)> = BTreeMap::new();
        let mut touched: HashSet<String> = HashSet::new();
        for (id, stage, state, text) in statuses_of(&item.history) {
            if id > through {
                continue;
            }
            if id > cursor {
                touched.insert(stage.clone());
            }
            latest.insert(stage, (state, text));
        }
        let mut sent = Vec::new();
        if let Some(sha) = self.head(item).await {
            let url = self.task_url(item);
            for (stage, (state, text)) in &latest {
                if !touched.contains(stage) {
                    continue;
                }
                let context = forge::status_context(stage);
                if gh.set_status(&sha, *state, &context, text, &url).await? {
                    sent.push(SentStatus {
                        context,
                        state: state.as_str().to_owned(),
                    });
                }
            }
        }
        // The description is sent only when it differs from the last one sent (named by its
        // digest in the last `forge.synced`, whichever process sent it).
        let digest = body_digest(&body);
        let described =
            pull.is_some() && (opened_now || last_body_of(&item.history) == Some(digest.clone()));
        if let Some(number) = pull
            && !described
        {
            gh.set_pull_body(number, &body).await?;
        }
        if item.task.is_terminal()
            && let Some(job) = job_of(
                &SyncJob::Outcome {
                    task: item.task.id,
                    seq: item.task.stage_seq,
                },
                dedupe::forge_outcome(item.task.id, item.task.stage_seq),
            )
        {
            cx.store.enqueue(job).await?;
        }
        let event = NewEvent::new(
            events::FORGE_SYNCED,
            format!(
                "GitHub {} is up to date with {} ({} status{} set)",
                item.forge_cfg.repo,
                item.task.work_item_id,
                sent.len(),
                if sent.len() == 1 { "" } else { "es" }
            ),
        )
        .task(item.task.id)
        .job(cx.job.id)
        .data(payload::text(&ForgeSynced {
            through,
            pull,
            statuses: sent,
            body: pull.map(|_| digest),
            described: !described && pull.is_some(),
        }));
        cx.store.append_event_fenced(cx.lease, event).await?;
        Ok(Outcome::Done)
    }

    async fn note(
        &self,
        cx: &JobContext,
        item: &Item,
        pull: u64,
        review: &forge::Review,
        action: &str,
        why: &str,
    ) -> Result<Outcome, SyncError> {
        let user = orch_domain::text::escape(&review.user);
        let event = NewEvent::new(
            events::FORGE_REVIEW,
            format!(
                "review {} of {}#{pull} by {user} ({}): {why}",
                review.id, item.forge_cfg.repo, review.state
            ),
        )
        .task(item.task.id)
        .job(cx.job.id)
        .data(payload::text(&ForgeReview {
            review: review.id,
            state: review.state.clone(),
            pull: Some(pull),
            action: action.to_owned(),
            why: Some(why.to_owned()),
            stage: None,
            seq: None,
            by: review.user.clone(),
        }));
        cx.store.append_event_fenced(cx.lease, event).await?;
        Ok(Outcome::Done)
    }

    /// Acts on one review, once: an approval lets the item go on from the approval stage it
    /// waits at; a change request sends it back to the code stage with the review as its
    /// feedback. Anything else is noted (`forge.review`, `action: noted`).
    async fn review(
        &self,
        cx: &JobContext,
        item: &Item,
        pull: u64,
        review: &forge::Review,
    ) -> Result<Outcome, SyncError> {
        let task = &item.task;
        // An approval recorded as about to be made at the visit the item is still at: a crash
        // (or a lost lease) came between the record and the approval, which is made now.
        let resuming = approving_of(&item.history, review.id)
            .is_some_and(|(stage, seq)| stage == task.stage && seq == task.stage_seq);
        if (reviews_taken(&item.history).contains(&review.id) && !resuming) || !review.trusted() {
            return Ok(Outcome::Done);
        }
        let actor = Actor::Orch {
            what: format!(
                "review {} of GitHub pull request {}#{pull} by {}",
                review.id,
                item.forge_cfg.repo,
                orch_domain::text::escape(&review.user)
            ),
        };
        if task.is_terminal() {
            return self
                .note(
                    cx,
                    item,
                    pull,
                    review,
                    "noted",
                    &format!("the item has ended ({})", task.stage),
                )
                .await;
        }
        if ReviewState::of(&review.state) == ReviewState::Other {
            return Ok(Outcome::Done);
        }
        if resuming {
            return self.approve(cx, item, pull, review, &actor).await;
        }
        if let Some(why) = self.standing(item, pull, review).await? {
            tracing::info!(work_item = %task.work_item_id, review = review.id,
                "forge sync: a review is not acted on: {why}");
            return self.note(cx, item, pull, review, "noted", &why).await;
        }
        let pipeline = &self.engine.config().pipeline;
        let stage_def = pipeline
            .stages
            .iter()
            .find(|s| s.name.as_str() == task.stage);
        match ReviewState::of(&review.state) {
            ReviewState::Approved => {
                if !stage_def.is_some_and(|s| s.approval) {
                    return self
                        .note(
                            cx,
                            item,
                            pull,
                            review,
                            "noted",
                            &format!(
                                "the item is at stage {}, which waits for no approval",
                                task.stage
                            ),
                        )
                        .await;
                }
                // Recorded first, fenced by this job's lease, with the visit it approves: the
                // review is taken from here on, and a crash before the approval resumes it
                // (the approval of a visit is one stage job, by its dedupe key).
                let event = NewEvent::new(
                    events::FORGE_REVIEW,
                    format!(
                        "review {} of {}#{pull} by {} approves stage {} (visit {})",
                        review.id,
                        item.forge_cfg.repo,
                        orch_domain::text::escape(&review.user),
                        task.stage,
                        task.stage_seq
                    ),
                )
                .task(task.id)
                .job(cx.job.id)
                .data(payload::text(&ForgeReview {
                    review: review.id,
                    state: review.state.clone(),
                    pull: Some(pull),
                    action: ForgeReview::APPROVING.to_owned(),
                    why: None,
                    stage: Some(task.stage.to_string()),
                    seq: Some(task.stage_seq),
                    by: review.user.clone(),
                }));
                cx.store.append_event_fenced(cx.lease, event).await?;
                crate::failpoint::hit("forge.after_approving");
                self.approve(cx, item, pull, review, &actor).await
            }
            ReviewState::ChangesRequested => {
                self.request_changes(cx, item, pull, review, &actor).await
            }
            ReviewState::Other => Ok(Outcome::Done),
        }
    }

    /// Approves the stage and visit the item is at (checked by the caller) for review
    /// `review`; noted instead when the item moved meanwhile.
    async fn approve(
        &self,
        cx: &JobContext,
        item: &Item,
        pull: u64,
        review: &forge::Review,
        actor: &Actor,
    ) -> Result<Outcome, SyncError> {
        let task = &item.task;
        match self
            .ops
            .approve_at(
                task.work_item_id.as_str(),
                actor,
                Some((task.stage.as_str(), task.stage_seq)),
            )
            .await
        {
            Ok(_) => {
                self.note(
                    cx,
                    item,
                    pull,
                    review,
                    "approved",
                    &format!("approved stage {}", task.stage),
                )
                .await
            }
            Err(OpsError::Conflict(why)) => self.note(cx, item, pull, review, "noted", &why).await,
            Err(e) => Err(SyncError::Other(anyhow::anyhow!(
                "approving {}: {e}",
                task.work_item_id
            ))),
        }
    }

    async fn request_changes(
        &self,
        cx: &JobContext,
        item: &Item,
        pull: u64,
        review: &forge::Review,
        actor: &Actor,
    ) -> Result<Outcome, SyncError> {
        let task = &item.task;
        let pipeline = &self.engine.config().pipeline;
        let index = |name: &str| pipeline.stages.iter().position(|s| s.name.as_str() == name);
        let track = crate::release::track(pipeline);
        // Back to the stage that writes the code, as the pipeline's descriptor says.
        let code = pipeline
            .code_stage()
            .and_then(|c| Some((index(c.name.as_str())?, c.name.clone())));
        let (Some(at), Some((implementation, code_stage))) = (index(task.stage.as_str()), code)
        else {
            return self
                .note(
                    cx,
                    item,
                    pull,
                    review,
                    "noted",
                    "the pipeline has no stage that writes code to send the item back to",
                )
                .await;
        };
        if track.stages.contains(&task.stage) {
            // Said on the pull request: the reviewer would otherwise hear nothing.
            let why = format!(
                "the item is at stage {}, on the release track: a review cannot send it back from there",
                task.stage
            );
            let gh = GitHub::connect(&item.forge_cfg)?;
            gh.comment(
                pull,
                &format!(
                    "orch cannot act on review {}: {} is at stage `{}`, on the release \
                     track, and a change request cannot send it back to {code_stage} from \
                     there. Cancel the item (or let it fail) and open a new one, or roll back \
                     after it ships.",
                    review.id, task.work_item_id, task.stage
                ),
            )
            .await?;
            return self.note(cx, item, pull, review, "noted", &why).await;
        }
        if at <= implementation {
            return self
                .note(
                    cx,
                    item,
                    pull,
                    review,
                    "noted",
                    &format!(
                        "the item is at stage {}: only an item between {code_stage} and the release track goes back",
                        task.stage
                    ),
                )
                .await;
        }
        let loops = control::loops_used(item.history.iter().map(|e| e.kind.as_str()));
        if loops >= pipeline.max_loops {
            return self
                .note(
                    cx,
                    item,
                    pull,
                    review,
                    "noted",
                    &format!("the item has used its {loops} loops back"),
                )
                .await;
        }
        let jobs = cx.store.task_jobs(task.id).await?;
        if jobs.iter().any(|j| matches!(j.state, JobState::Running)) {
            // The stage's own job decides first; the review waits for it to end.
            return Ok(Outcome::Retry {
                error: format!(
                    "{} is running stage {}; the review waits",
                    task.work_item_id, task.stage
                ),
                delay: Duration::from_secs(2),
            });
        }
        let gh = GitHub::connect(&item.forge_cfg)?;
        let comments = gh.review_comments(pull, review.id).await?;
        let text = forge::review_feedback(
            task.work_item_id.as_str(),
            &item.forge_cfg.repo,
            pull,
            review,
            &comments,
        );
        self.commit_feedback(cx, item, &text).await?;
        let Some(next_job) = self
            .engine
            .stage_job(code_stage.as_str(), task.stage_seq + 1)
        else {
            return self
                .note(
                    cx,
                    item,
                    pull,
                    review,
                    "noted",
                    &format!("the {code_stage} stage has no job"),
                )
                .await;
        };
        let message = format!(
            "{} requests changes: back to {code_stage} with the review as feedback",
            actor.describe()
        );
        let adv = AdvanceStage {
            task_id: task.id,
            expected_stage: task.stage.clone(),
            new_stage: code_stage.clone(),
            fence: Fence::Seq(task.stage_seq),
            event: NewEvent::new(events::STAGE_LOOP_BACK, message)
                .job(cx.job.id)
                .data(
                    StageChange {
                        outcome: Some("CHANGES_REQUESTED".to_owned()),
                        feedback: Some(Some(forge::REVIEW_FEEDBACK.to_owned())),
                        review: Some(review.id),
                        pull: Some(pull),
                        by: Some(actor.data()),
                        ..StageChange::new(task.stage.as_str(), code_stage.as_str())
                    }
                    .text(),
                ),
            next_job: Some(next_job),
        };
        match cx.store.advance_stage(adv).await {
            Ok(_) => Ok(Outcome::Done),
            // The item moved meanwhile: look again with what it is now.
            Err(orch_store::StoreError::StageConflict { .. }) => Ok(Outcome::Retry {
                error: format!(
                    "{} moved on; the review is looked at again",
                    task.work_item_id
                ),
                delay: Duration::from_secs(1),
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// Commits the review's feedback document on the work branch (a compare-and-swap of the
    /// branch, pushed where work branches are shared, never forced); nothing when the branch
    /// already holds it.
    async fn commit_feedback(
        &self,
        cx: &JobContext,
        item: &Item,
        text: &str,
    ) -> Result<(), SyncError> {
        let git = self.engine.git();
        let paths = self.paths(item);
        let work_item = &item.task.work_item_id;
        let shared = repos::shares_work_branches(git, &paths.repo_dir, &item.repo).await;
        if shared {
            repos::catch_up_work_branch(git, &paths, work_item).await?;
        }
        let branch = &item.task.branch;
        let head = git
            .rev_parse(&paths.repo_dir, &format!("refs/heads/{branch}"))
            .await
            .map_err(anyhow::Error::from)?
            .with_context(|| format!("`{branch}` is not in orch's clone"))?;
        let path = format!("{}/{}", work_item.artifact_dir(), forge::REVIEW_FEEDBACK);
        let now = git
            .show_file(&paths.repo_dir, &head, &path)
            .await
            .map_err(anyhow::Error::from)?;
        if now.as_deref() == Some(text) {
            return Ok(());
        }
        let message = format!(
            "{work_item}: the pull request's review, as feedback\n\nWork-Item: {work_item}\nStage: review\n"
        );
        let commit = git
            .commit_files_onto(
                &paths.repo_dir,
                &head,
                &[(path, text.as_bytes().to_vec())],
                &message,
            )
            .await
            .map_err(anyhow::Error::from)?;
        cx.renew().await.context("not moving the work branch")?;
        git.update_branch(&paths.repo_dir, branch, &commit, Some(&head))
            .await
            .with_context(|| format!("cannot move `{branch}` to the review's commit"))?;
        if shared {
            git.push(&paths.repo_dir, repos::ORIGIN, branch)
                .await
                .with_context(|| format!("cannot push `{branch}` with the review"))?;
        }
        Ok(())
    }

    /// Says the outcome of the ending that was visit `seq` on the issue and the pull request,
    /// once (a comment with the ending's marker is looked for first), and closes the issue when
    /// the item shipped.
    async fn outcome(&self, cx: &JobContext, item: &Item, seq: i64) -> Result<Outcome, SyncError> {
        let task = &item.task;
        if !task.is_terminal() || task.stage_seq != seq {
            return Ok(Outcome::Done);
        }
        if item
            .history
            .iter()
            .filter(|e| e.kind == events::FORGE_OUTCOME)
            .filter_map(|e| payload::read::<ForgeOutcome>(&e.data))
            .any(|o| o.seq == seq)
        {
            return Ok(Outcome::Done);
        }
        let Some(o) = orch_store::outcome_of_events(task.stage.as_str(), &item.history) else {
            return Ok(Outcome::Done);
        };
        let deployed = item
            .history
            .iter()
            .rev()
            .find(|e| e.kind == events::RELEASE_DEPLOYED);
        let revision = deployed
            .and_then(|e| payload::read::<ReleaseDeployed>(&e.data))
            .map(|d| d.revision)
            .or(o.live.clone());
        // The release that shipped it (through the forge's pull request, when it went that
        // way) and the revert that took it out, from their records.
        let promoted = item
            .history
            .iter()
            .rev()
            .find(|e| e.kind == events::RELEASE_PROMOTED)
            .map(|e| e.data_value());
        let reverted = item
            .history
            .iter()
            .rev()
            .find(|e| e.kind == events::RELEASE_REVERTED)
            .and_then(|e| payload::read::<payload::ReleaseReverted>(&e.data));
        let view = forge::OutcomeView {
            work_item: task.work_item_id.to_string(),
            seq,
            outcome: o.outcome.as_str().to_owned(),
            reason: o.reason.clone(),
            revision,
            deploy: deployed.map(|e| e.message.clone()),
            shipped_commit: promoted
                .as_ref()
                .and_then(|d| d["new"].as_str().map(str::to_owned)),
            release_pull: promoted.as_ref().and_then(|d| d["pull"].as_u64()),
            revert_commit: reverted.map(|d| d.revert_commit),
            task_url: self.task_url(item),
        };
        let text = forge::outcome_comment(&view);
        let marker = forge::outcome_marker(task.work_item_id.as_str(), seq);
        let gh = GitHub::connect(&item.forge_cfg)?;
        let pull = pull_of(&item.history);
        let own = self.own_login(&gh, &item.forge_cfg).await?;
        let mut said = Vec::new();
        let mut ids = Vec::new();
        for number in std::iter::once(item.origin.issue).chain(pull) {
            let id = match gh.own_comment(number, &marker, &own).await? {
                Some(id) => id,
                None => {
                    let id = gh.comment(number, &text).await?;
                    crate::failpoint::hit("forge.after_outcome_comment");
                    id
                }
            };
            said.push(number);
            ids.push(id);
        }
        if let Some(number) = pull {
            self.close_pull(cx, item, &gh, number, seq).await?;
        }
        let shipped = o.outcome == orch_domain::outcome::Outcome::Shipped;
        if shipped {
            gh.close_issue(item.origin.issue).await?;
        }
        let event = NewEvent::new(
            events::FORGE_OUTCOME,
            format!(
                "{} {}: said on GitHub {}#{}{}{}",
                task.work_item_id,
                o.outcome.label(),
                item.forge_cfg.repo,
                item.origin.issue,
                pull.map(|p| format!(" and #{p}")).unwrap_or_default(),
                if shipped {
                    "; the issue is closed"
                } else {
                    "; the issue stays open"
                }
            ),
        )
        .task(task.id)
        .job(cx.job.id)
        .data(payload::text(&ForgeOutcome {
            outcome: o.outcome.as_str().to_owned(),
            seq,
            issue: item.origin.issue,
            pull,
            comments: said,
            comment_ids: ids,
            closed: shipped,
        }));
        cx.store.append_event_fenced(cx.lease, event).await?;
        Ok(Outcome::Done)
    }

    /// Closes the item's pull request `number` once its outcome is said: it is where review
    /// happened, not what the release merged, and an ended item's review steers nothing. Found
    /// by its state (closed already, by anyone: nothing sent), recorded once
    /// (`forge.pull_closed`). Orch's intent is recorded first (`forge.pull_closing`, fenced by
    /// the job's lease): a crash between the close and its record finds it closed on replay
    /// and still records it as orch's close (`closed_now`), so a retry reopens it. The task's
    /// row is read again right before the call: an item retried meanwhile (another process)
    /// is live, and its pull request is left open.
    async fn close_pull(
        &self,
        cx: &JobContext,
        item: &Item,
        gh: &GitHub,
        number: u64,
        seq: i64,
    ) -> Result<(), SyncError> {
        if item.history.iter().any(|e| {
            let d = e.data_value();
            e.kind == events::FORGE_PULL_CLOSED
                && d["pull"].as_u64() == Some(number)
                && d["seq"].as_i64() == Some(seq)
        }) {
            return Ok(());
        }
        let intended = closing_recorded(&item.history, number, seq);
        let open = gh.pull(number).await?.state == "open";
        if open {
            if !still_ended_at(cx, item, seq).await? {
                tracing::info!(work_item = %item.task.work_item_id, pull = number,
                    "forge sync: not closing the pull request: the item moved on since its ending");
                return Ok(());
            }
            if !intended {
                let event = NewEvent::new(
                    events::FORGE_PULL_CLOSING,
                    format!(
                        "closing pull request {}#{number} of {} after its outcome",
                        item.forge_cfg.repo, item.task.work_item_id
                    ),
                )
                .task(item.task.id)
                .job(cx.job.id)
                .data(json!({"pull": number, "seq": seq}).to_string());
                cx.store.append_event_fenced(cx.lease, event).await?;
            }
            gh.close_pull(number).await?;
            crate::failpoint::hit("forge.after_pull_closed");
        }
        // Closed by this job, or found closed after orch's own intent to close it (a crash
        // between the call and this record): orch's close either way.
        let closed_now = open || intended;
        let event = NewEvent::new(
            events::FORGE_PULL_CLOSED,
            format!(
                "pull request {}#{number} of {} {} after its outcome",
                item.forge_cfg.repo,
                item.task.work_item_id,
                if closed_now { "closed" } else { "found closed" }
            ),
        )
        .task(item.task.id)
        .job(cx.job.id)
        .data(json!({"pull": number, "seq": seq, "closed_now": closed_now}).to_string());
        cx.store.append_event_fenced(cx.lease, event).await?;
        Ok(())
    }
}

/// Whether the item is still ended at visit `seq`, read from its row now (not from when the
/// job loaded it): another process may have retried it since.
async fn still_ended_at(cx: &JobContext, item: &Item, seq: i64) -> Result<bool, SyncError> {
    Ok(ended_at(
        cx.store.get_task(item.task.id).await?.as_ref(),
        seq,
    ))
}

/// Whether the item is live, read from its row now: it may have ended again since the job
/// loaded it.
async fn live_now(cx: &JobContext, item: &Item) -> Result<bool, SyncError> {
    Ok(live(cx.store.get_task(item.task.id).await?.as_ref()))
}

/// A row that may still have its pull request closed for the ending at visit `seq`: ended, at
/// that very visit (a retry, even one that ended again since, moved `stage_seq`).
fn ended_at(row: Option<&Task>, seq: i64) -> bool {
    row.is_some_and(|t| t.is_terminal() && t.stage_seq == seq)
}

/// A row whose pull request may be reopened: live (a row gone is not).
fn live(row: Option<&Task>) -> bool {
    row.is_some_and(|t| !t.is_terminal())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: i64, kind: &str, data: serde_json::Value) -> Event {
        Event {
            id,
            task_id: Some(1),
            job_id: None,
            kind: kind.to_owned(),
            stage: None,
            message: String::new(),
            data: data.to_string(),
            created_at: 0,
        }
    }

    #[test]
    fn a_pull_request_orch_closed_is_reopened_once() {
        let closed = event(
            2,
            events::FORGE_PULL_CLOSED,
            json!({"pull": 7, "seq": 9, "closed_now": true}),
        );
        assert_eq!(closed_by_orch(&[]), None);
        assert_eq!(closed_by_orch(std::slice::from_ref(&closed)), Some(7));
        // Found closed (someone else closed it): not orch's to reopen.
        let found = event(
            2,
            events::FORGE_PULL_CLOSED,
            json!({"pull": 7, "seq": 9, "closed_now": false}),
        );
        assert_eq!(closed_by_orch(&[found]), None);
        let reopened = event(
            3,
            events::FORGE_PULL_REOPENED,
            json!({"pull": 7, "seq": 10, "reopened": true}),
        );
        assert_eq!(closed_by_orch(&[closed.clone(), reopened.clone()]), None);
        // Closed again at the next ending.
        let again = event(
            4,
            events::FORGE_PULL_CLOSED,
            json!({"pull": 7, "seq": 12, "closed_now": true}),
        );
        assert_eq!(
            closed_by_orch(&[closed.clone(), reopened.clone(), again]),
            Some(7)
        );
        // A crash between the close and its record: the intent stands for orch's close.
        let closing = event(2, events::FORGE_PULL_CLOSING, json!({"pull": 7, "seq": 9}));
        assert_eq!(closed_by_orch(std::slice::from_ref(&closing)), Some(7));
        let found_after_intent = event(
            3,
            events::FORGE_PULL_CLOSED,
            json!({"pull": 7, "seq": 9, "closed_now": false}),
        );
        assert_eq!(
            closed_by_orch(&[closing.clone(), found_after_intent]),
            Some(7)
        );
        // Retried and ended again before any sync: the second ending finds it closed, by orch.
        let found_at_next_ending = event(
            3,
            events::FORGE_PULL_CLOSED,
            json!({"pull": 7, "seq": 12, "closed_now": false}),
        );
        assert_eq!(
            closed_by_orch(&[closed.clone(), found_at_next_ending.clone()]),
            Some(7)
        );
        // But not across a reopening: then a found-closed one is someone else's close.
        assert_eq!(
            closed_by_orch(&[closing, closed, reopened, found_at_next_ending]),
            None
        );
    }

    /// The rows read again right before the close and the reopen (another process may have
    /// retried the item, or it ended again, since the job loaded it).
    #[test]
    fn close_and_reopen_go_only_on_a_row_that_did_not_move() {
        let row = |stage: &str, stage_seq| Task {
            id: 1,
            work_item_id: "GH-1".parse().unwrap(),
            repo: "app".parse().unwrap(),
            title: String::new(),
            body: String::new(),
            stage: stage.parse().unwrap(),
            stage_seq,
            branch: "orch/GH-1".into(),
            created_at: 0,
            updated_at: 0,
        };
        assert!(ended_at(Some(&row("failed", 9)), 9));
        // Retried: live again, or ended again at a later visit.
        assert!(!ended_at(Some(&row("code", 10)), 9));
        assert!(!ended_at(Some(&row("failed", 12)), 9));
        assert!(!ended_at(None, 9));
        assert!(live(Some(&row("code", 10))));
        assert!(!live(Some(&row("cancelled", 11))));
        assert!(!live(None));
    }

    #[test]
    fn only_a_refusal_for_good_is_taken_as_not_reopened() {
        let err = |status, retry_after: Option<&str>, remaining| PollError {
            answer: forge::Answer {
                status,
                retry_after: retry_after.map(str::to_owned),
                remaining,
                reset: None,
                checks_pending: false,
            },
            message: String::new(),
        };
        assert!(refused_for_good(&err(404, None, None)));
        assert!(refused_for_good(&err(403, None, Some(4000))));
        assert!(!refused_for_good(&err(403, Some("60"), None)));
        assert!(!refused_for_good(&err(403, None, Some(0))));
        assert!(!refused_for_good(&err(502, None, None)));
        assert!(!refused_for_good(&err(0, None, None)));
    }
}
