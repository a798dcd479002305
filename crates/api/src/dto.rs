//! The JSON shapes of orch's wire: the HTTP API and `orch --json`, which prints these same
//! documents (the CLI builds no JSON itself). Only this module knows them: store rows and
//! operation results are plain Rust and are converted here, so a change of wire format touches
//! one file. One shape per thing: `id` is a row's numeric id and `work_item_id` the `APP-1`
//! name; times are epoch milliseconds in fields ending in `_ms`; durations in seconds end in
//! `_s`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ops::{ArtifactFile, Observation, ReleaseTrack, RunnerCounters};
use crate::snapshot::QueueSnapshot;

/// A document as JSON, for printing (`orch --json`).
pub fn to_json<T: Serialize>(doc: &T) -> serde_json::Value {
    // These documents have string keys and finite numbers only: converting cannot fail.
    serde_json::to_value(doc).unwrap_or(serde_json::Value::Null)
}

/// `{"error": {"code", "message"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// The inside of [`ErrorBody`].
#[derive(Debug, Serialize)]
pub struct ErrorDetail {
    pub code: &'static str,
    pub message: String,
}

/// `GET /healthz`.
#[derive(Debug, Serialize)]
pub struct Health {
    /// `ok` or `unavailable`.
    pub status: &'static str,
    /// `ok`, or the store's error.
    pub db: String,
    pub version: String,
    pub schema_version: Option<i64>,
    pub uptime_s: i64,
    /// The configuration this process runs (absent when the process does not say).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<ConfigHealth>,
}

/// `config` of `GET /healthz`: `status` is `current`, `stale` (the file on disk is invalid;
/// `error` says where) or `restart_needed` (changed `keys` apply only after a restart).
#[derive(Debug, Serialize)]
pub struct ConfigHealth {
    pub status: &'static str,
    pub generation: u64,
    pub loaded_at_ms: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<String>,
}

impl From<crate::ops::ConfigReport> for ConfigHealth {
    fn from(r: crate::ops::ConfigReport) -> Self {
        let status = if r.stale.is_some() {
            "stale"
        } else if !r.restart_needed.is_empty() {
            "restart_needed"
        } else {
            "current"
        };
        ConfigHealth {
            status,
            generation: r.generation,
            loaded_at_ms: r.loaded_at_ms,
            error: r.stale,
            keys: r.restart_needed,
        }
    }
}

/// Body of `POST /tasks`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitBody {
    pub repo: String,
    pub title: String,
    #[serde(default)]
    pub body: String,
}

/// Answer of `POST /hooks/github/{repo}` for a delivery whose signature held.
#[derive(Debug, Serialize)]
pub struct WebhookAnswer {
    /// Whether the delivery leads to a work item.
    pub accepted: bool,
    /// The work item, when accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub work_item_id: Option<String>,
    /// Whether this delivery id was taken before (nothing new was queued).
    pub duplicate: bool,
    /// Why nothing is done, when not accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Answer of `POST /tasks`.
#[derive(Debug, Serialize)]
pub struct Submitted {
    pub work_item_id: String,
    pub task_id: i64,
    /// The task as stored right after the submit (absent if it cannot be read back).
    pub task: Option<TaskDto>,
}

impl Submitted {
    /// The answer for a task just submitted.
    pub fn of(task: &orch_store::Task) -> Self {
        Submitted {
            work_item_id: task.work_item_id.to_string(),
            task_id: task.id,
            task: Some(TaskDto::from(task)),
        }
    }
}

/// An operator action on a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Approve,
    Retry,
    Cancel,
}

impl Action {
    /// `approve`, `retry` or `cancel`.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Approve => "approve",
            Action::Retry => "retry",
            Action::Cancel => "cancel",
        }
    }
}

/// Answer of `POST /tasks/{id}/approve|retry|cancel`.
#[derive(Debug, Serialize)]
pub struct ActionDone {
    pub work_item_id: String,
    /// `approve`, `retry` or `cancel`.
    pub action: &'static str,
    /// The task as stored after the action.
    pub task: Option<TaskDto>,
}

impl ActionDone {
    /// The answer for `action` done on `task` (as stored after it).
    pub fn of(task: &orch_store::Task, action: Action) -> Self {
        ActionDone {
            work_item_id: task.work_item_id.to_string(),
            action: action.as_str(),
            task: Some(TaskDto::from(task)),
        }
    }
}

/// A task row.
#[derive(Debug, Serialize)]
pub struct TaskDto {
    pub id: i64,
    pub work_item_id: String,
    pub repo: String,
    pub title: String,
    pub body: String,
    pub stage: String,
    pub stage_seq: i64,
    pub terminal: bool,
    pub branch: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// How a finished task ended; null while it is in flight (or when not read).
    pub outcome: Option<OutcomeDto>,
}

/// How a finished task ended (`orch_domain::outcome`).
#[derive(Debug, Serialize)]
pub struct OutcomeDto {
    /// `shipped`, `rolled_back`, `reverted`, `accepted`, `failed` or `cancelled`, derived from
    /// the recorded facts (`orch_domain::outcome`).
    pub outcome: &'static str,
    /// Where it failed or was rolled back.
    pub stage: Option<String>,
    pub reason: Option<String>,
    /// The revision orch last saw (or recorded as) live in production for this item.
    pub live: Option<String>,
    /// True when the terminal event carries the same outcome (written when the task ended).
    pub recorded: bool,
}

impl From<&orch_domain::outcome::TaskOutcome> for OutcomeDto {
    fn from(o: &orch_domain::outcome::TaskOutcome) -> Self {
        OutcomeDto {
            outcome: o.outcome.as_str(),
            stage: o.stage.clone(),
            reason: o.reason.clone(),
            live: o.live.clone(),
            recorded: o.recorded,
        }
    }
}

impl TaskDto {
    /// The task with its outcome.
    pub(crate) fn with_outcome(
        t: &orch_store::Task,
        o: Option<&orch_domain::outcome::TaskOutcome>,
    ) -> Self {
        let mut dto = TaskDto::from(t);
        dto.outcome = o.map(OutcomeDto::from);
        dto
    }
}

impl From<&orch_store::Task> for TaskDto {
    fn from(t: &orch_store::Task) -> Self {
        TaskDto {
            id: t.id,
            work_item_id: t.work_item_id.to_string(),
            repo: t.repo.to_string(),
            title: t.title.clone(),
            body: t.body.clone(),
            stage: t.stage.to_string(),
            stage_seq: t.stage_seq,
            terminal: t.is_terminal(),
            branch: t.branch.clone(),
            created_at_ms: t.created_at,
            updated_at_ms: t.updated_at,
            outcome: None,
        }
    }
}

/// `GET /tasks`.
#[derive(Debug, Serialize)]
pub struct TaskList {
    pub count: usize,
    pub tasks: Vec<TaskDto>,
}

impl TaskList {
    /// `tasks` with their outcomes (each finished task's events are read).
    pub async fn read(
        store: &orch_store::Store,
        tasks: &[orch_store::Task],
    ) -> Result<TaskList, orch_store::StoreError> {
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            let outcome = crate::outcomes::read(store, t).await?;
            out.push(TaskDto::with_outcome(t, outcome.as_ref()));
        }
        Ok(TaskList {
            count: out.len(),
            tasks: out,
        })
    }
}

/// Query of `GET /tasks`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskQuery {
    pub stage: Option<String>,
    pub repo: Option<String>,
    pub limit: Option<u32>,
    pub offset: Option<u32>,
}

/// `GET /tasks/{id}`.
#[derive(Debug, Serialize)]
pub struct TaskDetail {
    pub task: TaskDto,
    pub usage: UsageDto,
    /// The event timeline, oldest first.
    pub events: Vec<EventDto>,
    pub agent_runs: Vec<AgentRunDto>,
    pub jobs: Vec<JobDto>,
    /// The production deploys this task ran and what each shipped (`release.deployed`).
    pub deploys: Vec<TaskDeployDto>,
}

impl TaskDetail {
    /// Everything about `task`, read from the store.
    pub async fn read(
        store: &orch_store::Store,
        task: &orch_store::Task,
    ) -> Result<TaskDetail, orch_store::StoreError> {
        let usage = store.task_usage(task.id).await?;
        let runs = store.task_agent_runs(task.id).await?;
        let jobs = store.task_jobs(task.id).await?;
        let events = store.task_events(task.id).await?;
        let outcome = crate::outcomes::of(task, &events);
        Ok(TaskDetail {
            task: TaskDto::with_outcome(task, outcome.as_ref()),
            usage: UsageDto::new(usage),
            events: events.iter().map(EventDto::from).collect(),
            agent_runs: runs.iter().map(AgentRunDto::from).collect(),
            jobs: jobs.iter().map(JobDto::from).collect(),
            deploys: TaskDeployDto::of(&events),
        })
    }
}

/// A production deploy a task ran (`GET /tasks/{id}`).
#[derive(Debug, Serialize)]
pub struct TaskDeployDto {
    pub at_ms: i64,
    pub revision: Option<String>,
    pub previous_revision: Option<String>,
    pub confirmed: bool,
    pub items: Vec<ShippedItemDto>,
}

impl TaskDeployDto {
    /// The deploys recorded in a task's events.
    pub fn of(events: &[orch_store::Event]) -> Vec<TaskDeployDto> {
        events
            .iter()
            .filter(|e| e.kind == orch_domain::control::events::RELEASE_DEPLOYED)
            .filter_map(|e| {
                let d =
                    orch_domain::payload::read::<orch_domain::payload::ReleaseDeployed>(&e.data)?;
                Some(TaskDeployDto {
                    at_ms: e.created_at,
                    revision: Some(d.revision),
                    previous_revision: d.previous_revision,
                    confirmed: d.confirmed,
                    items: d.items.iter().map(ShippedItemDto::from).collect(),
                })
            })
            .collect()
    }
}

/// Tokens and cost of a task. A run whose cost is not known (still running, a tool that
/// reports none and no price for its model, output that could not be read) makes the total
/// unknown: `cost_usd` is then `null`, never a sum that counts it as zero.
#[derive(Debug, Serialize)]
pub struct UsageDto {
    pub runs: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    /// The total cost; `null` while `unknown_cost_runs > 0`.
    pub cost_usd: Option<f64>,
    /// The sum of the costs that are known (the whole cost when none is unknown).
    pub known_cost_usd: f64,
    /// Runs whose cost is not known.
    pub unknown_cost_runs: i64,
}

impl UsageDto {
    /// The task's usage totals from the store.
    pub fn new(u: orch_store::Usage) -> Self {
        UsageDto {
            runs: u.runs,
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            cost_usd: (u.unknown_cost_runs == 0).then_some(u.cost_usd),
            known_cost_usd: u.cost_usd,
            unknown_cost_runs: u.unknown_cost_runs,
        }
    }

    /// The cost as people read it, the same in `orch status`, the dashboard and the demo:
    /// `$0.0392`, or `unknown (2 of 6 runs; $0.0123 known)` when some run's cost is unknown
    /// (`unknown (6 of 6 runs)` when none is known).
    pub fn cost_text(&self) -> String {
        match (self.cost_usd, self.unknown_cost_runs) {
            (Some(total), _) => format!("${total:.4}"),
            (None, n) if n >= self.runs => format!("unknown ({n} of {} runs)", self.runs),
            (None, n) => format!(
                "unknown ({n} of {} runs; ${:.4} known)",
                self.runs, self.known_cost_usd
            ),
        }
    }
}

/// What agent runs cost, summed by repo, by stage and by UTC day (`GET /costs`, `orch costs`).
/// A group with a run of unknown cost has `cost_usd: null`, with the known part and the count.
#[derive(Debug, Serialize)]
pub struct CostReport {
    /// Every run.
    pub total: UsageDto,
    pub by_repo: Vec<CostGroup>,
    pub by_stage: Vec<CostGroup>,
    /// Oldest day first; `key` is the day as `YYYY-MM-DD` (UTC).
    pub by_day: Vec<CostGroup>,
}

/// One group of a [`CostReport`].
#[derive(Debug, Serialize)]
pub struct CostGroup {
    pub key: String,
    pub usage: UsageDto,
}

impl CostReport {
    /// The report from the store's rows (one per repo, stage and day).
    pub fn new(rows: &[orch_store::UsageRow]) -> CostReport {
        use std::collections::BTreeMap;
        fn add(a: &mut orch_store::Usage, b: &orch_store::Usage) {
            a.runs += b.runs;
            a.input_tokens += b.input_tokens;
            a.output_tokens += b.output_tokens;
            a.cost_usd += b.cost_usd;
            a.unknown_cost_runs += b.unknown_cost_runs;
        }
        let mut total = orch_store::Usage::default();
        let mut repo: BTreeMap<String, orch_store::Usage> = BTreeMap::new();
        let mut stage: BTreeMap<String, orch_store::Usage> = BTreeMap::new();
        let mut day: BTreeMap<i64, orch_store::Usage> = BTreeMap::new();
        for r in rows {
            add(&mut total, &r.usage);
            add(repo.entry(r.repo.clone()).or_default(), &r.usage);
            add(stage.entry(r.stage.clone()).or_default(), &r.usage);
            add(day.entry(r.day).or_default(), &r.usage);
        }
        let groups = |m: BTreeMap<String, orch_store::Usage>| {
            m.into_iter()
                .map(|(key, u)| CostGroup {
                    key,
                    usage: UsageDto::new(u),
                })
                .collect()
        };
        CostReport {
            total: UsageDto::new(total),
            by_repo: groups(repo),
            by_stage: groups(stage),
            by_day: day
                .into_iter()
                .map(|(d, u)| CostGroup {
                    key: day_text(d),
                    usage: UsageDto::new(u),
                })
                .collect(),
        }
    }
}

/// `YYYY-MM-DD` of a day counted from 1970-01-01.
fn day_text(day: i64) -> String {
    // `YYYY-MM-DDTHH:MM:SSZ` of the day's midnight: its first ten characters.
    let text = orch_domain::text::rfc3339_utc(day.saturating_mul(86_400_000));
    text.get(..10).unwrap_or(&text).to_owned()
}

/// An agent run row.
#[derive(Debug, Serialize)]
pub struct AgentRunDto {
    pub id: i64,
    pub job_id: Option<i64>,
    pub stage: String,
    pub agent: String,
    pub backend: String,
    pub model: Option<String>,
    pub attempt: i64,
    pub started_at_ms: i64,
    pub finished_at_ms: Option<i64>,
    pub outcome: String,
    pub exit_code: Option<i64>,
    pub input_tokens: Option<i64>,
    pub output_tokens: Option<i64>,
    pub cost_usd: Option<f64>,
    pub error: Option<String>,
    pub data: serde_json::Value,
}

impl From<&orch_store::AgentRun> for AgentRunDto {
    fn from(r: &orch_store::AgentRun) -> Self {
        AgentRunDto {
            id: r.id,
            job_id: r.job_id,
            stage: r.stage.clone(),
            agent: r.agent.clone(),
            backend: r.backend.clone(),
            model: r.model.clone(),
            attempt: r.attempt,
            started_at_ms: r.started_at,
            finished_at_ms: r.finished_at,
            outcome: r.outcome.clone(),
            exit_code: r.exit_code,
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            cost_usd: r.cost_usd,
            error: r.error.clone(),
            data: json_text(&r.data),
        }
    }
}

/// A job row without its payload (payloads are references and may be long).
#[derive(Debug, Serialize)]
pub struct JobDto {
    pub id: i64,
    pub agent: String,
    pub state: &'static str,
    pub attempt: i64,
    pub max_attempts: i64,
    pub available_at_ms: i64,
    pub locked_by: Option<String>,
    pub lease_expires_at_ms: Option<i64>,
    pub node: Option<String>,
    pub last_error: Option<String>,
    pub created_at_ms: i64,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
}

impl From<&orch_store::Job> for JobDto {
    fn from(j: &orch_store::Job) -> Self {
        JobDto {
            id: j.id,
            agent: j.agent.clone(),
            state: j.state.as_str(),
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            available_at_ms: j.available_at,
            locked_by: j.locked_by.clone(),
            lease_expires_at_ms: j.lease_expires_at,
            node: j.node.clone(),
            last_error: j.last_error.clone(),
            created_at_ms: j.created_at,
            started_at_ms: j.started_at,
            finished_at_ms: j.finished_at,
        }
    }
}

/// `GET /tasks/{id}/events`.
#[derive(Debug, Serialize)]
pub struct EventList {
    pub work_item_id: String,
    pub events: Vec<EventDto>,
}

/// An event row.
#[derive(Debug, Serialize)]
pub struct EventDto {
    pub id: i64,
    pub job_id: Option<i64>,
    pub kind: String,
    pub stage: Option<String>,
    pub message: String,
    /// The event's JSON data (a string when the stored text is not JSON).
    pub data: serde_json::Value,
    pub created_at_ms: i64,
}

impl From<&orch_store::Event> for EventDto {
    fn from(e: &orch_store::Event) -> Self {
        EventDto {
            id: e.id,
            job_id: e.job_id,
            kind: e.kind.clone(),
            stage: e.stage.clone(),
            message: e.message.clone(),
            data: json_text(&e.data),
            created_at_ms: e.created_at,
        }
    }
}

/// `GET /tasks/{id}/artifacts`.
#[derive(Debug, Serialize)]
pub struct ArtifactList {
    pub work_item_id: String,
    pub artifacts: Vec<ArtifactDto>,
}

/// One artifact file.
#[derive(Debug, Serialize)]
pub struct ArtifactDto {
    pub name: String,
    pub bytes: usize,
    pub content: String,
}

impl From<ArtifactFile> for ArtifactDto {
    fn from(a: ArtifactFile) -> Self {
        ArtifactDto {
            name: a.name,
            bytes: a.content.len(),
            content: a.content,
        }
    }
}

/// `GET /queue`.
#[derive(Debug, Serialize)]
pub struct Queue {
    pub now_ms: i64,
    pub version: String,
    pub uptime_s: i64,
    /// Queued and running jobs exactly; of the finished states only those that finished in
    /// the window `finished_window` names (since `finished_since_ms`).
    pub jobs: JobCounts,
    /// What the finished counts (`jobs`' done/failed/cancelled, `tasks_by_stage`' terminal
    /// stages) cover: "finished in the last 24 h". Older history is in the report.
    pub finished_window: &'static str,
    pub finished_since_ms: i64,
    /// Age of the oldest job that is ready to run but not yet claimed; null when none waits.
    pub oldest_queued_age_s: Option<f64>,
    pub leases: Vec<LeaseDto>,
    pub tasks_by_stage: BTreeMap<String, i64>,
    /// Counters of every deterministic runner, by runner then counter name.
    pub runners: BTreeMap<String, BTreeMap<String, u64>>,
    pub active_observations: Vec<ObservationDto>,
    /// One release at a time per repo: the holder of each busy track and who waits for it.
    pub release_tracks: Vec<ReleaseTrackDto>,
    /// Every node a worker ran on, with when it was last seen (its heartbeat beacon).
    pub nodes: Vec<NodeDto>,
    /// The latest jobs taken over from a node gone longer than the grace, newest last.
    pub takeovers: Vec<TakeoverDto>,
}

/// A node in `GET /queue`.
#[derive(Debug, Serialize)]
pub struct NodeDto {
    pub node: String,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
    pub last_seen_age_s: f64,
}

/// A takeover in `GET /queue` (a `node.takeover` event).
#[derive(Debug, Serialize)]
pub struct TakeoverDto {
    pub at_ms: i64,
    pub task_id: Option<i64>,
    pub job_id: Option<i64>,
    pub from: Option<String>,
    pub to: Option<String>,
    pub stage: Option<String>,
    pub message: String,
}

/// A repo's release track in `GET /queue`.
#[derive(Debug, Serialize)]
pub struct ReleaseTrackDto {
    pub repo: String,
    pub holder: Option<String>,
    pub holder_stage: Option<String>,
    pub held: Option<String>,
    pub waiting: Vec<String>,
}

/// Job counts of `GET /queue`.
#[derive(Debug, Serialize)]
pub struct JobCounts {
    /// Every state, zeros included.
    pub by_state: BTreeMap<&'static str, i64>,
    /// Agent (job kind) → state → count; only non-zero entries.
    pub by_agent: BTreeMap<String, BTreeMap<&'static str, i64>>,
}

/// A running job's lease.
#[derive(Debug, Serialize)]
pub struct LeaseDto {
    pub job_id: i64,
    pub task_id: Option<i64>,
    pub agent: String,
    pub worker: Option<String>,
    pub attempt: i64,
    pub expires_at_ms: Option<i64>,
    /// Negative when the lease has already expired (awaiting rescue).
    pub expires_in_s: Option<f64>,
}

/// An armed post-deploy watch.
#[derive(Debug, Serialize)]
pub struct ObservationDto {
    pub work_item_id: String,
    pub repo: String,
    /// `null` when the watch's `armed` file is unreadable (see `problem`).
    pub armed_at_ms: Option<i64>,
    pub deadline_ms: Option<i64>,
    /// Negative when the deadline has passed (a stale watch awaiting its job); `null` when
    /// the deadline is unknown.
    pub remaining_s: Option<f64>,
    pub revision: String,
    pub polls: u64,
    /// What is wrong with the watch's state, if anything.
    pub problem: Option<String>,
}

impl ObservationDto {
    fn new(o: &Observation, now_ms: i64) -> Self {
        ObservationDto {
            work_item_id: o.work_item_id.clone(),
            repo: o.repo.clone(),
            armed_at_ms: o.armed_at_ms,
            deadline_ms: o.deadline_ms,
            remaining_s: o.deadline_ms.map(|d| secs(d.saturating_sub(now_ms))),
            revision: o.revision.clone(),
            polls: o.polls,
            problem: o.problem.clone(),
        }
    }
}

impl Queue {
    /// The queue as a process that runs no worker sees it (`orch queue`): the store's figures,
    /// the watches and release tracks it is given; no runner counters, uptime 0.
    pub async fn read_store(
        store: &orch_store::Store,
        version: &str,
        observations: Vec<Observation>,
        tracks: Vec<ReleaseTrack>,
    ) -> Result<Queue, orch_store::StoreError> {
        let (stats, tasks_by_stage, nodes, takeovers) = tokio::try_join!(
            store.queue_stats(),
            store.active_tasks_by_stage(crate::snapshot::recent_since(store)),
            store.nodes(),
            crate::snapshot::latest_takeovers(store)
        )?;
        Ok(Queue::new(&QueueSnapshot {
            stats,
            tasks_by_stage,
            runners: Vec::new(),
            observations,
            tracks,
            nodes,
            takeovers,
            version: version.to_owned(),
            uptime_ms: 0,
        }))
    }

    pub(crate) fn new(s: &QueueSnapshot) -> Self {
        let now = s.stats.now;
        let mut by_state: BTreeMap<&'static str, i64> = orch_store::JobState::ALL
            .iter()
            .map(|st| (st.as_str(), 0))
            .collect();
        let mut by_agent: BTreeMap<String, BTreeMap<&'static str, i64>> = BTreeMap::new();
        for c in &s.stats.counts {
            *by_state.entry(c.state.as_str()).or_default() += c.count;
            if c.count != 0 {
                *by_agent
                    .entry(c.agent.clone())
                    .or_default()
                    .entry(c.state.as_str())
                    .or_default() += c.count;
            }
        }
        Queue {
            now_ms: now,
            version: s.version.clone(),
            uptime_s: s.uptime_ms / 1000,
            jobs: JobCounts { by_state, by_agent },
            finished_window: crate::FINISHED_WINDOW_LABEL,
            finished_since_ms: s.stats.finished_since,
            oldest_queued_age_s: s.oldest_queued_age_ms().map(secs),
            leases: s
                .stats
                .leases
                .iter()
                .map(|l| LeaseDto {
                    job_id: l.job_id,
                    task_id: l.task_id,
                    agent: l.agent.clone(),
                    worker: l.worker.clone(),
                    attempt: l.attempt,
                    expires_at_ms: l.expires_at,
                    expires_in_s: l.expires_at.map(|e| secs(e.saturating_sub(now))),
                })
                .collect(),
            tasks_by_stage: s.tasks_by_stage.iter().cloned().collect(),
            runners: runners(&s.runners),
            active_observations: s
                .observations
                .iter()
                .map(|o| ObservationDto::new(o, now))
                .collect(),
            release_tracks: s
                .tracks
                .iter()
                .map(|t| ReleaseTrackDto {
                    repo: t.repo.clone(),
                    holder: t.holder.as_ref().map(|h| h.0.clone()),
                    holder_stage: t.holder.as_ref().map(|h| h.1.clone()),
                    held: t.held.clone(),
                    waiting: t.waiting.clone(),
                })
                .collect(),
            nodes: s
                .nodes
                .iter()
                .map(|n| NodeDto {
                    node: n.node.clone(),
                    first_seen_ms: n.first_seen_ms,
                    last_seen_ms: n.last_seen_ms,
                    last_seen_age_s: secs(s.node_age_ms(n)),
                })
                .collect(),
            takeovers: s
                .takeovers
                .iter()
                .map(|e| {
                    let t =
                        orch_domain::payload::read::<orch_domain::payload::NodeTakeover>(&e.data)
                            .unwrap_or_default();
                    TakeoverDto {
                        at_ms: e.created_at,
                        task_id: e.task_id,
                        job_id: e.job_id,
                        from: t.from,
                        to: t.to,
                        stage: t.stage,
                        message: e.message.clone(),
                    }
                })
                .collect(),
        }
    }
}

fn runners(rs: &[RunnerCounters]) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for r in rs {
        let entry = out.entry(r.runner.clone()).or_default();
        for (name, value) in &r.counters {
            entry.insert(name.clone(), *value);
        }
    }
    out
}

/// Milliseconds as fractional seconds.
pub(crate) fn secs(ms: i64) -> f64 {
    ms as f64 / 1000.0
}

/// Stored JSON text as a JSON value; text that is not JSON is kept as a string.
fn json_text(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_owned()))
}

/// `GET /repos/{repo}/deploys` (also `orch deploys --json`).
#[derive(Debug, Serialize)]
pub struct RepoDeploys {
    pub repo: String,
    /// Tasks still in a pipeline stage, newest first.
    pub in_flight: Vec<TaskDto>,
    /// Finished tasks with their outcome, newest first.
    pub finished: Vec<TaskDto>,
    /// Production deploys, oldest first.
    pub deploys: Vec<DeployDto>,
    /// `lessons.recorded` events, newest first.
    pub lessons: Vec<LessonDto>,
}

/// One production deploy.
#[derive(Debug, Serialize)]
pub struct DeployDto {
    pub at_ms: i64,
    /// The work item whose task ran the deploy.
    pub deployed_by: String,
    pub revision: Option<String>,
    pub previous_revision: Option<String>,
    pub seq: Option<i64>,
    pub items: Vec<ShippedItemDto>,
    /// `release.deployed`, or `deploy.confirmed` for a deploy before the release train.
    pub source: &'static str,
    /// The post-deploy watch's verdict (`HEALTHY`, `DEGRADED`, `FAILED`), when decided.
    pub verdict: Option<String>,
    pub rolled_back: bool,
    /// A rollback of this deploy ran and production was not verified back.
    pub rollback_failed: bool,
    pub reverts: Vec<RevertDto>,
}

/// An item a deploy shipped.
#[derive(Debug, Serialize)]
pub struct ShippedItemDto {
    pub work_item: String,
    pub commit: Option<String>,
    /// `merge` or `revert`.
    pub change: String,
}

impl From<&orch_domain::payload::ShippedChange> for ShippedItemDto {
    fn from(c: &orch_domain::payload::ShippedChange) -> ShippedItemDto {
        ShippedItemDto {
            work_item: c.work_item.clone(),
            commit: (!c.commit.is_empty()).then(|| c.commit.clone()),
            change: c.change.as_str().to_owned(),
        }
    }
}

/// An item reverted on the default branch after a deploy.
#[derive(Debug, Serialize)]
pub struct RevertDto {
    pub work_item: String,
    pub revert_commit: String,
}

/// A lesson recorded by a work item.
#[derive(Debug, Serialize)]
pub struct LessonDto {
    pub work_item: String,
    pub at_ms: i64,
    pub message: String,
}

impl From<&crate::repos::RepoStory> for RepoDeploys {
    fn from(s: &crate::repos::RepoStory) -> Self {
        RepoDeploys {
            repo: s.repo.clone(),
            in_flight: s.in_flight.iter().map(TaskDto::from).collect(),
            finished: s
                .finished
                .iter()
                .map(|(t, o)| TaskDto::with_outcome(t, o.as_ref()))
                .collect(),
            deploys: s
                .deploys
                .iter()
                .map(|d| DeployDto {
                    at_ms: d.at_ms,
                    deployed_by: d.deployed_by.clone(),
                    revision: d.revision.clone(),
                    previous_revision: d.previous_revision.clone(),
                    seq: d.seq,
                    items: d
                        .items
                        .iter()
                        .map(|i| ShippedItemDto {
                            work_item: i.work_item.clone(),
                            commit: i.commit.clone(),
                            change: i.change.clone(),
                        })
                        .collect(),
                    source: d.source,
                    verdict: d.verdict.clone(),
                    rolled_back: d.rolled_back,
                    rollback_failed: d.rollback_failed,
                    reverts: d
                        .reverts
                        .iter()
                        .map(|(w, c)| RevertDto {
                            work_item: w.clone(),
                            revert_commit: c.clone(),
                        })
                        .collect(),
                })
                .collect(),
            lessons: s
                .lessons
                .iter()
                .map(|l| LessonDto {
                    work_item: l.work_item.clone(),
                    at_ms: l.at_ms,
                    message: l.message.clone(),
                })
                .collect(),
        }
    }
}

/// `orch --json demo`: where the demo ran, and the sample service's story (the same document as
/// `GET /repos/service/deploys`: every item with its outcome, each deploy with what it shipped,
/// the reverts, the lessons).
#[derive(Debug, Serialize)]
pub struct DemoReport {
    pub dir: String,
    pub config: Option<String>,
    /// None for `--setup-only`.
    pub finished_in_s: Option<u64>,
    /// The lessons section a later item's requirements quoted, when the demo saw one.
    pub lesson_seen: Option<String>,
    pub service: Option<RepoDeploys>,
}

/// `orch migrate --json`.
#[derive(Debug, Serialize)]
pub struct Migrated {
    /// The database (as the store names it, password hidden).
    pub database: String,
    pub from: i64,
    pub to: i64,
    /// The migrations applied now (none when the schema was up to date).
    pub applied: Vec<String>,
}

impl Migrated {
    /// What a migration of `database` did.
    pub fn of(database: String, r: &orch_store::MigrateReport) -> Self {
        Migrated {
            database,
            from: r.from,
            to: r.to,
            applied: r.applied.clone(),
        }
    }
}

/// `orch gc --json`: what one run of retention removed.
#[derive(Debug, Serialize)]
pub struct Gc {
    /// The database (as the store names it, password hidden).
    pub database: String,
    /// The retention applied (`"3d"`, …; `"off"`: nothing was pruned).
    pub retention: String,
    /// Jobs that finished, and whose task ended, before this instant were pruned.
    pub finished_before_ms: Option<i64>,
    /// Jobs this run deleted.
    pub pruned: u64,
    /// Batches (transactions, one `jobs.pruned` event each) this run wrote.
    pub batches: u32,
    /// Every job pruned so far in this store, by every process (`orch_jobs_pruned_total`).
    pub pruned_total: i64,
}

/// `orch init --json`.
#[derive(Debug, Serialize)]
pub struct Initialized {
    /// The config file.
    pub config: String,
    /// False when an existing config was kept.
    pub config_written: bool,
    pub database: String,
    pub schema_version: i64,
    /// The `.gitignore` that now keeps the config and `.orch/` out of git, inside a repository.
    pub gitignore: Option<String>,
}

/// `orch doctor --json`.
#[derive(Debug, Serialize)]
pub struct DoctorReport {
    /// No check failed.
    pub ok: bool,
    /// How many checks failed.
    pub problems: usize,
    pub checks: Vec<DoctorCheck>,
}

/// One check of `orch doctor`.
#[derive(Debug, Serialize)]
pub struct DoctorCheck {
    /// `ok`, `note` or `fail`.
    pub status: &'static str,
    pub what: String,
    /// What to do about it (null when there is nothing to do).
    pub fix: Option<String>,
}

/// `orch logs ID --transcript --json`: each agent run's kept transcript and diff.
#[derive(Debug, Serialize)]
pub struct Transcripts {
    pub work_item: String,
    pub runs: Vec<RunTranscript>,
}

/// One agent run's transcript in [`Transcripts`]; `transcript` and `diff` are `null` when this
/// machine kept none.
#[derive(Debug, Serialize)]
pub struct RunTranscript {
    pub run_id: i64,
    pub agent: String,
    pub backend: String,
    pub stage: String,
    pub outcome: String,
    pub format: String,
    pub transcript: Option<String>,
    pub diff: Option<String>,
}

/// Query of `GET /report`: `repo`, `since`, `until` (see `orch_domain::report::parse_instant`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportQuery {
    pub repo: Option<String>,
    pub since: Option<String>,
    pub until: Option<String>,
}

/// The delivery report (`GET /report`, `orch report --json`): the DORA keys and orch's own
/// figures over `[since, until)`, overall and by repo. How each is computed:
/// `orch_domain::report` and the README's "Delivery report".
#[derive(Debug, Serialize)]
pub struct DeliveryReport {
    /// RFC 3339 UTC.
    pub since: String,
    pub until: String,
    pub since_ms: i64,
    pub until_ms: i64,
    /// The repo asked for, if any.
    pub repo: Option<String>,
    pub overall: DeliveryFigures,
    pub by_repo: Vec<RepoDelivery>,
    /// The trend, week by week (Monday 00:00 UTC, cut to the range), oldest first; at most
    /// the latest 104 weeks.
    pub weekly: Vec<WeekDelivery>,
    /// Where the time of the items that ended in the range went, stage by stage.
    pub stage_time: Vec<StageTimeDto>,
}

/// One week of a [`DeliveryReport`]'s trend.
#[derive(Debug, Serialize)]
pub struct WeekDelivery {
    /// RFC 3339 UTC; included.
    pub since: String,
    /// RFC 3339 UTC; excluded.
    pub until: String,
    pub since_ms: i64,
    pub until_ms: i64,
    pub deploys: u64,
    pub change_failures: u64,
    pub change_failure_rate: Option<f64>,
    pub lead_time_from_submission: DurationsDto,
    pub time_to_restore: DurationsDto,
    pub shipped: u64,
    pub known_cost_usd: f64,
    pub unknown_cost_runs: u64,
}

/// One stage's part of the time of the items that ended in the range.
#[derive(Debug, Serialize)]
pub struct StageTimeDto {
    pub stage: String,
    /// Per item that visited the stage, its time there (all visits).
    pub time: DurationsDto,
}

/// One repo's figures in a [`DeliveryReport`].
#[derive(Debug, Serialize)]
pub struct RepoDelivery {
    pub repo: String,
    pub figures: DeliveryFigures,
}

/// The figures over one set of items.
#[derive(Debug, Serialize)]
pub struct DeliveryFigures {
    pub dora: Dora,
    pub items: ItemFigures,
    pub staging: StagingFigures,
    /// Waits for the release track that began in the range and have ended.
    pub release_wait: DurationsDto,
    /// The agent runs of the items that ended in the range, by backend and model.
    pub by_agent: Vec<AgentDelivery>,
}

/// The four DORA keys over the production deploys in the range.
#[derive(Debug, Serialize)]
pub struct Dora {
    pub deploys: u64,
    pub deploys_per_day: f64,
    /// Confirmed deploys: the deploy minus the item's submission.
    pub lead_time_from_submission: DurationsDto,
    /// Confirmed deploys: the deploy minus the item's first commit.
    pub lead_time_from_first_commit: DurationsDto,
    pub change_failures: u64,
    pub rolled_back: u64,
    pub reverted: u64,
    /// `change_failures / deploys`; `null` without a deploy.
    pub change_failure_rate: Option<f64>,
    /// Failures detected in the range: detection to production verified healthy again.
    pub time_to_restore: DurationsDto,
    /// Failures detected in the range that no record shows restored.
    pub unrestored: u64,
}

/// orch's figures over the items that ended in the range.
#[derive(Debug, Serialize)]
pub struct ItemFigures {
    /// By outcome (`shipped`, `rolled_back`, `reverted`, `accepted`, `failed`, `cancelled`).
    pub ended: std::collections::BTreeMap<String, u64>,
    pub shipped: u64,
    pub agent_runs: u64,
    /// What every ended item's runs cost; `null` while `unknown_cost_runs > 0`.
    pub cost_usd: Option<f64>,
    pub known_cost_usd: f64,
    pub unknown_cost_runs: u64,
    /// `cost_usd / shipped`; `null` without a shipped item or while a cost is unknown.
    pub cost_per_shipped_usd: Option<f64>,
    /// `known_cost_usd / shipped` (a lower bound while a cost is unknown).
    pub known_cost_per_shipped_usd: Option<f64>,
    pub agent_runs_per_shipped: Option<f64>,
    pub review_loops_per_shipped: Option<f64>,
}

/// Staging verdicts recorded in the range.
#[derive(Debug, Serialize)]
pub struct StagingFigures {
    pub passed: u64,
    /// The change failed staging.
    pub change_failures: u64,
    /// The staging environment failed, not the change.
    pub infrastructure_errors: u64,
}

/// Durations in milliseconds (nearest-rank percentiles).
#[derive(Debug, Serialize)]
pub struct DurationsDto {
    pub count: u64,
    pub median_ms: Option<i64>,
    pub p90_ms: Option<i64>,
    pub mean_ms: Option<i64>,
    pub total_ms: i64,
}

/// One agent backend and model's part of a [`DeliveryFigures`].
#[derive(Debug, Serialize)]
pub struct AgentDelivery {
    pub backend: String,
    /// `null`: the backend's default.
    pub model: Option<String>,
    pub runs: u64,
    /// `null` while `unknown_cost_runs > 0`.
    pub cost_usd: Option<f64>,
    pub known_cost_usd: f64,
    pub unknown_cost_runs: u64,
    pub items: u64,
    pub shipped: u64,
    pub change_failures: u64,
}

impl DurationsDto {
    fn new(d: &orch_domain::report::Durations) -> DurationsDto {
        DurationsDto {
            count: d.count,
            median_ms: d.median_ms,
            p90_ms: d.p90_ms,
            mean_ms: d.mean_ms,
            total_ms: d.total_ms,
        }
    }
}

impl DeliveryFigures {
    fn new(f: &orch_domain::report::Figures) -> DeliveryFigures {
        let known = |cost: f64, unknown: u64| (unknown == 0).then_some(cost);
        let cost = known(f.cost_usd, f.unknown_cost_runs);
        DeliveryFigures {
            dora: Dora {
                deploys: f.deploys,
                deploys_per_day: f.deploys_per_day,
                lead_time_from_submission: DurationsDto::new(&f.lead_time_from_submission),
                lead_time_from_first_commit: DurationsDto::new(&f.lead_time_from_first_commit),
                change_failures: f.change_failures,
                rolled_back: f.rolled_back,
                reverted: f.reverted,
                change_failure_rate: f.change_failure_rate,
                time_to_restore: DurationsDto::new(&f.time_to_restore),
                unrestored: f.unrestored,
            },
            items: ItemFigures {
                ended: f.ended.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
                shipped: f.shipped,
                agent_runs: f.agent_runs,
                cost_usd: cost,
                known_cost_usd: f.cost_usd,
                unknown_cost_runs: f.unknown_cost_runs,
                cost_per_shipped_usd: cost.and(f.cost_per_shipped_usd),
                known_cost_per_shipped_usd: f.cost_per_shipped_usd,
                agent_runs_per_shipped: f.agent_runs_per_shipped,
                review_loops_per_shipped: f.review_loops_per_shipped,
            },
            staging: StagingFigures {
                passed: f.staging.passed,
                change_failures: f.staging.change_failures,
                infrastructure_errors: f.staging.infrastructure_errors,
            },
            release_wait: DurationsDto::new(&f.release_wait),
            by_agent: f
                .by_agent
                .iter()
                .map(|a| AgentDelivery {
                    backend: a.backend.clone(),
                    model: a.model.clone(),
                    runs: a.runs,
                    cost_usd: known(a.cost_usd, a.unknown_cost_runs),
                    known_cost_usd: a.cost_usd,
                    unknown_cost_runs: a.unknown_cost_runs,
                    items: a.items,
                    shipped: a.shipped,
                    change_failures: a.change_failures,
                })
                .collect(),
        }
    }
}

impl DeliveryReport {
    /// The document of a computed report (`repo`: the repo it was asked for).
    pub fn new(r: &orch_domain::report::Report, repo: Option<&str>) -> DeliveryReport {
        use orch_domain::text::rfc3339_utc;
        DeliveryReport {
            since: rfc3339_utc(r.range.since),
            until: rfc3339_utc(r.range.until),
            since_ms: r.range.since,
            until_ms: r.range.until,
            repo: repo.map(str::to_owned),
            overall: DeliveryFigures::new(&r.overall),
            by_repo: r
                .repos
                .iter()
                .map(|(repo, f)| RepoDelivery {
                    repo: repo.clone(),
                    figures: DeliveryFigures::new(f),
                })
                .collect(),
            weekly: r
                .weekly
                .iter()
                .map(|(w, f)| WeekDelivery {
                    since: rfc3339_utc(w.since),
                    until: rfc3339_utc(w.until),
                    since_ms: w.since,
                    until_ms: w.until,
                    deploys: f.deploys,
                    change_failures: f.change_failures,
                    change_failure_rate: f.change_failure_rate,
                    lead_time_from_submission: DurationsDto::new(&f.lead_time_from_submission),
                    time_to_restore: DurationsDto::new(&f.time_to_restore),
                    shipped: f.shipped,
                    known_cost_usd: f.cost_usd,
                    unknown_cost_runs: f.unknown_cost_runs,
                })
                .collect(),
            stage_time: r
                .stage_time
                .iter()
                .map(|s| StageTimeDto {
                    stage: s.stage.clone(),
                    time: DurationsDto::new(&s.time),
                })
                .collect(),
        }
    }
}

/// Reads the delivery report for a query (the route's and `orch report`'s one path): the repo
/// checked by the domain's `RepoName` rules, the range parsed against `now`. `Err(Left)`: bad
/// input (its message), `Err(Right)`: the store failed.
pub async fn read_report(
    store: &orch_store::Store,
    repo: Option<&str>,
    since: Option<&str>,
    until: Option<&str>,
    now: i64,
) -> Result<DeliveryReport, ReportError> {
    let repo = match repo {
        Some(r) => Some(
            r.parse::<orch_domain::ids::RepoName>()
                .map_err(|e| ReportError::Input(format!("repo: {e}")))?,
        ),
        None => None,
    };
    let range = orch_domain::report::Range::parse(since, until, now).map_err(ReportError::Input)?;
    let repo = repo.as_ref().map(|r| r.as_str());
    let report = store
        .report(range, repo)
        .await
        .map_err(ReportError::Store)?;
    Ok(DeliveryReport::new(&report, repo))
}

/// Why [`read_report`] gave no report.
#[derive(Debug)]
pub enum ReportError {
    /// Bad input: the message says which parameter and why.
    Input(String),
    /// The store failed.
    Store(orch_store::StoreError),
}

/// `orch replay --json`: every decision of the items replayed (issue 32), recorded against
/// replayed, with the thresholds changed by `--set` and the counts. How each decision is
/// replayed: `orch_domain::replay`.
#[derive(Debug, Serialize)]
pub struct ReplayReport {
    /// The thresholds `--set` changed (`key` → value); empty: today's rules.
    pub overrides: BTreeMap<String, u32>,
    /// The range of `--repo … --since`, RFC 3339 UTC, when one was asked for.
    pub since: Option<String>,
    pub until: Option<String>,
    pub repo: Option<String>,
    pub items: Vec<ReplayItem>,
    pub summary: ReplaySummary,
}

/// One work item's replayed decisions, oldest first.
#[derive(Debug, Serialize)]
pub struct ReplayItem {
    pub work_item_id: String,
    pub repo: String,
    pub decisions: Vec<ReplayDecision>,
}

/// One decision: what was recorded, what the rules decide from the same inputs now.
#[derive(Debug, Serialize)]
pub struct ReplayDecision {
    /// The stage change (event id) the decision belongs to.
    pub event_id: i64,
    pub at_ms: i64,
    /// `gate`, `route`, `staging` or `watch`.
    pub kind: &'static str,
    pub stage: String,
    pub what: String,
    pub recorded: String,
    /// The replayed decision, or `cannot replay: …`.
    pub replayed: String,
    /// `agrees`, `differs` or `cannot replay`.
    pub agreement: &'static str,
    pub detail: String,
    /// For a watch: whether a rollback ran, and whether the replayed verdict would run one
    /// (`null`: the replay cannot tell).
    pub rollback: Option<ReplayRollback>,
}

/// A watch's rollback, recorded and replayed.
#[derive(Debug, Serialize)]
pub struct ReplayRollback {
    pub recorded: bool,
    pub replayed: Option<bool>,
}

/// The counts of a [`ReplayReport`] (`orch_domain::replay::Summary`).
#[derive(Debug, Serialize)]
pub struct ReplaySummary {
    pub items: u32,
    pub decisions: u32,
    pub agree: u32,
    pub differ: u32,
    pub unreplayable: u32,
    pub watches: u32,
    pub rollbacks_recorded: u32,
    pub rollbacks_replayed: u32,
    pub rollbacks_avoided: u32,
    pub rollbacks_added: u32,
    pub rollbacks_undetermined: u32,
}

impl ReplayDecision {
    /// The wire shape of a replayed decision.
    pub fn from_domain(d: &orch_domain::replay::Replayed) -> ReplayDecision {
        ReplayDecision {
            event_id: d.event_id,
            at_ms: d.at_ms,
            kind: d.kind.as_str(),
            stage: d.stage.clone(),
            what: d.what.clone(),
            recorded: d.recorded.clone(),
            replayed: d.replayed.clone(),
            agreement: d.agreement.as_str(),
            detail: d.detail.clone(),
            rollback: d.rollback.map(|r| ReplayRollback {
                recorded: r.recorded,
                replayed: r.replayed,
            }),
        }
    }
}

impl ReplaySummary {
    /// The wire shape of the counts over `items` items.
    pub fn from_domain(items: u32, s: &orch_domain::replay::Summary) -> ReplaySummary {
        ReplaySummary {
            items,
            decisions: s.decisions,
            agree: s.agree,
            differ: s.differ,
            unreplayable: s.unreplayable,
            watches: s.watches,
            rollbacks_recorded: s.rollbacks_recorded,
            rollbacks_replayed: s.rollbacks_replayed,
            rollbacks_avoided: s.rollbacks_avoided,
            rollbacks_added: s.rollbacks_added,
            rollbacks_undetermined: s.rollbacks_undetermined,
        }
    }
}
