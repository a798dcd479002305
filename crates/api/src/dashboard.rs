//! The web dashboard: server-rendered HTML (askama, templates in `crates/api/templates/`).
//! Pages: the queue (`/`), one page per task (`/ui/tasks/{id}`) and one per repo
//! (`/ui/repos/{repo}`). Every page reads without JavaScript; with it, a small inline script
//! refreshes the page's `data-live` regions in place (it fetches the same URL and swaps those
//! regions, keeping open `<details>` and everything else on the page), stops once a task page
//! shows a finished task, and sends the operator actions (approve, retry, cancel) with the
//! bearer token typed into the page. No external assets. Every value from the store or from
//! disk is HTML-escaped by the templates; artifacts are rendered from Markdown with raw HTML
//! escaped ([`crate::markdown`]).

use askama::Template;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{Html, IntoResponse, Response};
use orch_domain::control::{self, events};
use orch_domain::outcome::Outcome;
use orch_domain::text::civil_from_days;

use crate::ApiState;
use crate::extract::ApiQuery;
use crate::id::validate_work_item_id;
use crate::ops::{ArtifactFile, Observation, RunnerCounters};
use crate::snapshot::QueueSnapshot;

/// Tasks shown on the front page.
const INDEX_TASKS: u32 = 200;
/// Longest artifact text shown on a task page; the rest is cut with a note.
const MAX_ARTIFACT_SHOWN: usize = 256 * 1024;

// ----- view models ---------------------------------------------------------------------------

struct JobStateRow {
    state: &'static str,
    count: i64,
    /// A finished state: counted over the recent window only.
    recent: bool,
}

struct AgentRow {
    agent: String,
    /// Counts in the order of `JobState::ALL`.
    counts: Vec<i64>,
}

struct LeaseRow {
    job_id: i64,
    work_item: String,
    agent: String,
    worker: String,
    attempt: i64,
    expires: String,
}

struct ObservationRow {
    work_item_id: String,
    repo: String,
    armed_at: String,
    deadline: String,
    remaining: String,
    revision: String,
    polls: u64,
    bars: Vec<Bar>,
    chart_w: u32,
}

impl ObservationRow {
    fn new(o: &Observation, now: i64, series: &[crate::ops::SeriesPoint]) -> Self {
        let bars = chart_bars(series);
        ObservationRow {
            work_item_id: o.work_item_id.clone(),
            repo: o.repo.clone(),
            armed_at: o.armed_at_ms.map_or_else(|| "unknown".to_owned(), fmt_time),
            deadline: o.deadline_ms.map_or_else(|| "unknown".to_owned(), fmt_time),
            remaining: match (o.deadline_ms, &o.problem) {
                (Some(d), None) => fmt_relative(d.saturating_sub(now)),
                (Some(d), Some(p)) => format!("{} ({p})", fmt_relative(d.saturating_sub(now))),
                (None, p) => p.clone().unwrap_or_else(|| "unknown".to_owned()),
            },
            revision: o.revision.clone(),
            polls: o.polls,
            chart_w: (bars.len() as u32 * BAR_STEP).max(BAR_STEP),
            bars,
        }
    }
}

/// One box of a task's pipeline row.
struct PipeBox {
    name: String,
    /// CSS class: `past`, `current`, `future`, `stopped` (where a failed/cancelled task was).
    class: &'static str,
    /// How many times the task entered this stage; shown when above 1.
    visits: usize,
}

/// A task's pipeline as a row of stage boxes, the current one highlighted.
struct PipelineView {
    boxes: Vec<PipeBox>,
    /// Loops back taken (`stage.loop_back` events).
    loops: u32,
}

impl PipelineView {
    /// Lays out the built-in pipeline for a task at `stage`, with visit and loop counts read
    /// from its events. A stage the built-in pipeline does not know is appended, so the current
    /// stage is always visible.
    fn new(stage: &str, events: &[orch_store::Event]) -> Self {
        let mut names: Vec<String> = orch_domain::pipeline::Pipeline::default_pipeline()
            .stages
            .iter()
            .map(|s| s.name.as_str().to_owned())
            .collect();
        let terminal = control::is_terminal_stage(stage);
        let visits = |name: &str| {
            events
                .iter()
                .filter(|e| {
                    events::STAGE_ENTERED.contains(&e.kind.as_str())
                        && e.stage.as_deref() == Some(name)
                })
                .count()
        };
        let loops = control::loops_used(events.iter().map(|e| e.kind.as_str()));
        // Where a failed or cancelled task stopped: the last non-terminal stage it entered.
        let stopped_at = events
            .iter()
            .rev()
            .filter_map(|e| e.stage.as_deref())
            .find(|s| !control::is_terminal_stage(s))
            .map(str::to_owned);
        if !names.iter().any(|n| n == stage) {
            names.push(stage.to_owned());
        }
        let current = names.iter().position(|n| n == stage);
        let stop = if terminal && stage != control::DONE {
            stopped_at
                .as_ref()
                .and_then(|s| names.iter().position(|n| n == s))
        } else {
            None
        };
        let boxes = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let class = if Some(i) == current {
                    "current"
                } else if Some(i) == stop {
                    "stopped"
                } else if terminal && stage != control::DONE {
                    if stop.is_some_and(|s| i < s) {
                        "past"
                    } else {
                        "future"
                    }
                } else if current.is_some_and(|c| i < c) {
                    "past"
                } else {
                    "future"
                };
                PipeBox {
                    name: name.clone(),
                    class,
                    visits: visits(name),
                }
            })
            .collect();
        PipelineView { boxes, loops }
    }
}

/// One bar of a watch's inline SVG chart.
struct Bar {
    x: u32,
    y: u32,
    h: u32,
    color: &'static str,
    title: String,
}

/// Width of one bar (and its gap) in the inline chart, in SVG units.
const BAR_STEP: u32 = 6;
/// Height of the inline chart.
const CHART_H: u32 = 32;
/// Most polls drawn (the newest).
const CHART_MAX_BARS: usize = 60;

/// The bars of a series: height from the value (scaled to the largest), or full height when
/// the poll has no value; colour from the status.
fn chart_bars(series: &[crate::ops::SeriesPoint]) -> Vec<Bar> {
    let shown = &series[series.len().saturating_sub(CHART_MAX_BARS)..];
    let max = shown
        .iter()
        .filter_map(|p| p.value)
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold(0.0_f64, f64::max);
    shown
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let frac = match p.value {
                Some(v) if max > 0.0 && v.is_finite() => (v / max).clamp(0.05, 1.0),
                _ => 1.0,
            };
            let h = ((CHART_H as f64) * frac).round().max(1.0) as u32;
            let color = match p.status.as_str() {
                "PASS" => "#3a9d5d",
                "FAIL" => "#c0392b",
                "ERROR" => "#e67e22",
                _ => "#99a",
            };
            let value = p.value.map(|v| format!(" {v}")).unwrap_or_default();
            Bar {
                x: i as u32 * BAR_STEP,
                y: CHART_H - h,
                h,
                color,
                title: format!("{} {}{value}", fmt_time(p.at_ms), p.status),
            }
        })
        .collect()
}

/// A bigger chart of a watch's series for the task page, with its caption.
struct Chart {
    w: u32,
    bar_w: u32,
    h: u32,
    bars: Vec<Bar>,
    polls: usize,
    pass: usize,
    fail: usize,
    other: usize,
    /// Where the series was read: the armed watch, or `16-post-deploy-log.md`.
    source: String,
    /// The verdict and action when the watch has ended.
    verdict: String,
    first: String,
    last: String,
}

/// Height of the task page's chart.
const BIG_CHART_H: u32 = 80;
/// Width of one bar (and its gap) of the task page's chart, at least.
const BIG_STEP: u32 = 12;
/// Width the task page's chart aims at.
const BIG_CHART_W: u32 = 360;

impl Chart {
    fn new(series: &[crate::ops::SeriesPoint], source: String, verdict: String) -> Chart {
        let small = chart_bars(series);
        let scale = |v: u32| v * BIG_CHART_H / CHART_H;
        // Short series get wider bars, so a four-poll watch is still a readable chart.
        let step = (BIG_CHART_W / small.len().max(1) as u32).clamp(BIG_STEP, 48);
        let bars: Vec<Bar> = small
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                // A failed poll is often fast (connection refused): never a sliver.
                let floor = if b.color == "#3a9d5d" {
                    2
                } else {
                    BIG_CHART_H / 2
                };
                let h = scale(b.h).max(floor);
                Bar {
                    x: i as u32 * step,
                    y: BIG_CHART_H - h,
                    h,
                    color: b.color,
                    title: b.title,
                }
            })
            .collect();
        let count = |s: &str| series.iter().filter(|p| p.status == s).count();
        Chart {
            w: (bars.len() as u32 * step).max(step),
            bar_w: step * 4 / 5,
            h: BIG_CHART_H,
            polls: series.len(),
            pass: count("PASS"),
            fail: count("FAIL"),
            other: series.len() - count("PASS") - count("FAIL"),
            first: series
                .first()
                .map(|p| fmt_time(p.at_ms))
                .unwrap_or_default(),
            last: series.last().map(|p| fmt_time(p.at_ms)).unwrap_or_default(),
            bars,
            source,
            verdict,
        }
    }
}

struct StageRow {
    stage: String,
    /// The stage percent-encoded for a query string.
    query: String,
    count: i64,
}

struct QueueView {
    job_states: Vec<JobStateRow>,
    state_names: Vec<&'static str>,
    agents: Vec<AgentRow>,
    oldest_queued: String,
    leases: Vec<LeaseRow>,
    stages: Vec<StageRow>,
    runners: Vec<RunnerCounters>,
    observations: Vec<ObservationRow>,
}

impl QueueView {
    fn new(
        s: &QueueSnapshot,
        work_items: &std::collections::HashMap<i64, String>,
        series: &std::collections::HashMap<String, Vec<crate::ops::SeriesPoint>>,
    ) -> Self {
        let now = s.stats.now;
        let all = orch_store::JobState::ALL;
        let mut agents: Vec<AgentRow> = Vec::new();
        for c in &s.stats.counts {
            let Some(col) = all.iter().position(|st| *st == c.state) else {
                continue;
            };
            let row = match agents.iter_mut().position(|r| r.agent == c.agent) {
                Some(i) => &mut agents[i],
                None => {
                    agents.push(AgentRow {
                        agent: c.agent.clone(),
                        counts: vec![0; all.len()],
                    });
                    let last = agents.len() - 1;
                    &mut agents[last]
                }
            };
            row.counts[col] += c.count;
        }
        agents.sort_by(|a, b| a.agent.cmp(&b.agent));
        QueueView {
            job_states: all
                .iter()
                .map(|st| JobStateRow {
                    state: st.as_str(),
                    count: s.jobs_in(*st),
                    recent: !matches!(
                        st,
                        orch_store::JobState::Queued | orch_store::JobState::Running
                    ),
                })
                .collect(),
            state_names: all.iter().map(|st| st.as_str()).collect(),
            agents,
            oldest_queued: s
                .oldest_queued_age_ms()
                .map(fmt_duration)
                .unwrap_or_else(|| "none waiting".to_owned()),
            leases: s
                .stats
                .leases
                .iter()
                .map(|l| LeaseRow {
                    job_id: l.job_id,
                    work_item: l
                        .task_id
                        .and_then(|t| work_items.get(&t).cloned())
                        .unwrap_or_default(),
                    agent: l.agent.clone(),
                    worker: l.worker.clone().unwrap_or_default(),
                    attempt: l.attempt,
                    expires: l
                        .expires_at
                        .map(|e| fmt_relative(e.saturating_sub(now)))
                        .unwrap_or_default(),
                })
                .collect(),
            stages: s
                .tasks_by_stage
                .iter()
                .map(|(stage, count)| StageRow {
                    stage: stage.clone(),
                    query: percent_encode(stage),
                    count: *count,
                })
                .collect(),
            runners: s.runners.clone(),
            observations: s
                .observations
                .iter()
                .map(|o| {
                    let points = series.get(&o.work_item_id).map(Vec::as_slice);
                    ObservationRow::new(o, now, points.unwrap_or_default())
                })
                .collect(),
        }
    }
}

/// A task's outcome for display: a CSS class, a label and the why.
struct OutcomeView {
    /// `shipped`, `rolled_back`, …, or `in-flight`.
    class: &'static str,
    label: String,
    stage: String,
    reason: String,
}

impl OutcomeView {
    fn new(task: &orch_store::Task, o: Option<&orch_domain::outcome::TaskOutcome>) -> Self {
        match o {
            Some(o) => OutcomeView {
                class: o.outcome.as_str(),
                label: match (o.outcome, &o.live) {
                    (Outcome::Accepted, Some(live)) => format!("operator accepted {live:.12}"),
                    (outcome, _) => outcome.label().to_owned(),
                },
                stage: o.stage.clone().unwrap_or_default(),
                reason: o.reason.clone().unwrap_or_default(),
            },
            None => OutcomeView {
                class: "in-flight",
                label: format!("in progress: {}", task.stage),
                stage: task.stage.to_string(),
                reason: String::new(),
            },
        }
    }
}

struct TaskRow {
    work_item_id: String,
    repo: String,
    title: String,
    stage: String,
    updated: String,
    pipeline: PipelineView,
    outcome: OutcomeView,
}

impl TaskRow {
    fn new(t: &orch_store::Task, events: &[orch_store::Event]) -> Self {
        let o = crate::outcomes::of(t, events);
        TaskRow {
            work_item_id: t.work_item_id.to_string(),
            repo: t.repo.to_string(),
            title: t.title.clone(),
            stage: t.stage.to_string(),
            updated: fmt_time(t.updated_at),
            pipeline: PipelineView::new(t.stage.as_str(), events),
            outcome: OutcomeView::new(t, o.as_ref()),
        }
    }
}

#[derive(Template)]
#[template(path = "index.html")]
struct IndexPage {
    version: String,
    now: String,
    live: bool,
    queue: QueueView,
    tasks: Vec<TaskRow>,
    stage_filter: String,
    outcomes: Vec<(&'static str, String, i64)>,
    /// What the finished counts cover ("finished in the last 24 h").
    finished_window: &'static str,
    repos: Vec<String>,
    /// Repos whose agents and tests run unsandboxed: a warning at the top of the page.
    unsandboxed: Vec<String>,
    process_started: String,
}

struct EventRow {
    at: String,
    kind: String,
    stage: String,
    message: String,
    data: String,
}

struct RunRow {
    id: i64,
    agent: String,
    stage: String,
    backend: String,
    model: String,
    attempt: i64,
    started: String,
    duration: String,
    outcome: String,
    failed: bool,
    exit_code: String,
    input_tokens: String,
    output_tokens: String,
    cost: String,
    error: String,
}

/// One agent run's transcript on the task page: its conversation and the diff it left.
struct TranscriptView {
    run_id: i64,
    title: String,
    open: bool,
    entries: Vec<EntryView>,
    diff: String,
}

/// One step of a transcript: `kind` is `message`, `call`, `result`, `command` or `note`.
struct EntryView {
    kind: &'static str,
    label: String,
    body: String,
    error: bool,
}

/// The longest text of one transcript entry shown on the page (the stored file has it all).
const ENTRY_TEXT_MAX: usize = 16 * 1024;

fn entry_view(e: orch_domain::transcript::Entry) -> EntryView {
    use orch_domain::transcript::Entry;
    let cut = |t: String| {
        if t.len() <= ENTRY_TEXT_MAX {
            return t;
        }
        let mut end = ENTRY_TEXT_MAX;
        while !t.is_char_boundary(end) {
            end -= 1;
        }
        format!(
            "{}\n… ({} more bytes in the transcript file)",
            &t[..end],
            t.len() - end
        )
    };
    match e {
        Entry::Message { role, text } => EntryView {
            kind: "message",
            label: role,
            body: cut(text),
            error: false,
        },
        Entry::ToolCall { name, input } => EntryView {
            kind: "call",
            label: format!("tool call: {name}"),
            body: cut(input),
            error: false,
        },
        Entry::ToolResult { text, error } => EntryView {
            kind: "result",
            label: if error { "tool error" } else { "tool result" }.to_owned(),
            body: cut(text),
            error,
        },
        Entry::Command {
            command,
            exit_code,
            output,
        } => EntryView {
            kind: "command",
            label: format!(
                "$ {command}  ({})",
                exit_code.map_or_else(|| "running".to_owned(), |c| format!("exit {c}"))
            ),
            body: cut(output),
            error: exit_code.is_some_and(|c| c != 0),
        },
        Entry::Note(text) => EntryView {
            kind: "note",
            label: String::new(),
            body: cut(text),
            error: false,
        },
    }
}

/// The transcripts of a task's runs kept on this machine, newest run first.
async fn transcripts(
    state: &ApiState,
    work_item: &str,
    runs: &[orch_store::AgentRun],
) -> Vec<TranscriptView> {
    let mut out = Vec::new();
    let newest = runs.iter().map(|r| r.id).max();
    for r in runs.iter().rev() {
        let Some(t) = state.ops.run_transcript(work_item, r.id).await else {
            continue;
        };
        let data: serde_json::Value = serde_json::from_str(&r.data).unwrap_or_default();
        let format = data["transcript"]["format"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| orch_domain::transcript::format_of(&r.backend).to_owned());
        let entries: Vec<EntryView> = orch_domain::transcript::entries(&format, &t.text)
            .into_iter()
            .map(entry_view)
            .collect();
        out.push(TranscriptView {
            run_id: r.id,
            title: format!(
                "run {} · {} ({}) · {} · {}{}",
                r.id,
                r.agent,
                r.backend,
                r.stage,
                r.outcome,
                if data["transcript"]["truncated"] == true {
                    " · cut at the size limit"
                } else {
                    ""
                }
            ),
            open: r.finished_at.is_none() || Some(r.id) == newest,
            entries,
            diff: t.diff.unwrap_or_default(),
        });
    }
    out
}

struct JobRow {
    id: i64,
    agent: String,
    state: &'static str,
    attempt: String,
    available: String,
    worker: String,
    last_error: String,
}

struct ArtifactView {
    /// A DOM id (`art-02-requirements`), so the live refresh keeps it open.
    dom_id: String,
    name: String,
    size: String,
    frontmatter: String,
    /// Safe HTML rendered from the body's Markdown.
    html: String,
    content: String,
}

/// One row of the stage timeline.
struct VisitRow {
    stage: String,
    /// Percent offsets of the bar in the task's time span.
    left: String,
    width: String,
    duration: String,
    loop_back: bool,
    waits: usize,
    current: bool,
    terminal: bool,
    at: String,
}

#[derive(Template)]
#[template(path = "task.html")]
struct TaskPage {
    transcripts: Vec<TranscriptView>,
    version: String,
    now: String,
    live: bool,
    task: orch_store::Task,
    outcome: OutcomeView,
    created: String,
    updated: String,
    took: String,
    usage_runs: i64,
    usage_tokens_in: i64,
    usage_tokens_out: i64,
    usage_cost: String,
    events: Vec<EventRow>,
    visits: Vec<VisitRow>,
    runs: Vec<RunRow>,
    jobs: Vec<JobRow>,
    artifacts: Vec<ArtifactView>,
    artifacts_error: String,
    observations: Vec<ObservationRow>,
    chart: Option<Chart>,
    pipeline: PipelineView,
    can_cancel: bool,
    can_retry: bool,
}

struct DeployRow {
    at: String,
    deployed_by: String,
    revision: String,
    previous_revision: String,
    items: Vec<crate::repos::ShippedItem>,
    source: &'static str,
    verdict: String,
    rolled_back: bool,
    rollback_failed: bool,
    reverts: Vec<(String, String)>,
}

#[derive(Template)]
#[template(path = "repo.html")]
struct RepoPage {
    version: String,
    now: String,
    live: bool,
    repo: String,
    in_flight: Vec<TaskRow>,
    finished: Vec<TaskRow>,
    deploys: Vec<DeployRow>,
    lessons: Vec<(String, String, String)>,
    lessons_file: Option<String>,
    lessons_html: String,
    legacy_deploys: bool,
    /// The repo's agents and tests run unsandboxed: a warning at the top of the page.
    unsandboxed: bool,
}

#[derive(Template)]
#[template(path = "costs.html")]
struct CostsPage {
    version: String,
    now: String,
    live: bool,
    total: String,
    groups: Vec<(&'static str, Vec<CostRow>)>,
}

struct CostRow {
    key: String,
    runs: i64,
    tokens_in: i64,
    tokens_out: i64,
    cost: String,
    unknown: bool,
}

/// `GET /ui/costs`: what agent runs cost by repo, stage and day (the `GET /costs` report).
pub(crate) async fn costs_page(State(state): State<ApiState>) -> Result<Response, PageError> {
    let rows = state
        .store
        .usage_by_repo_stage_day()
        .await
        .map_err(|e| store_error(&state, "the agent runs' costs", &e))?;
    let report = crate::dto::CostReport::new(&rows);
    let view = |groups: &[crate::dto::CostGroup]| {
        groups
            .iter()
            .map(|g| CostRow {
                key: g.key.clone(),
                runs: g.usage.runs,
                tokens_in: g.usage.input_tokens,
                tokens_out: g.usage.output_tokens,
                cost: g.usage.cost_text(),
                unknown: g.usage.unknown_cost_runs > 0,
            })
            .collect::<Vec<_>>()
    };
    let page = CostsPage {
        version: state.version.clone(),
        now: fmt_time(state.store.now_ms()),
        live: false,
        total: report.total.cost_text(),
        groups: vec![
            ("repo", view(&report.by_repo)),
            ("stage", view(&report.by_stage)),
            ("day (UTC)", view(&report.by_day)),
        ],
    };
    Ok(render(&page))
}

#[derive(Template)]
#[template(path = "report.html")]
struct ReportPage {
    version: String,
    now: String,
    live: bool,
    /// The form's values, as asked.
    repo: String,
    since: String,
    until: String,
    /// The range read, in words.
    range: String,
    cards: Vec<(&'static str, String, &'static str)>,
    chart_w: u32,
    /// The weekly bars: deploys (and of them change failures) per week.
    bars: Vec<WeekBar>,
    weeks: Vec<WeekRow>,
    stages: Vec<StageTimeRow>,
    repos: Vec<(String, String, String, String, String)>,
    agents: Vec<(String, String, String, String, String)>,
}

struct WeekBar {
    x: u32,
    /// Top and height of the whole bar (deploys) and of its failed part.
    y: u32,
    h: u32,
    fail_y: u32,
    fail_h: u32,
    label: String,
    title: String,
}

struct WeekRow {
    week: String,
    deploys: u64,
    failures: u64,
    rate: String,
    lead: String,
    restore: String,
    shipped: u64,
    cost: String,
}

struct StageTimeRow {
    stage: String,
    items: u64,
    total: String,
    median: String,
    p90: String,
    /// The bar's width: its share of the largest stage's total, in percent.
    pct: u32,
}

/// Height of the weekly chart's bars area and the width of one week's slot, in px.
const TREND_H: u32 = 120;
const WEEK_W: u32 = 40;

/// `GET /ui/report`: the delivery report (the `GET /report` document) with the trend per week
/// and where time goes per stage; `?repo=`, `?since=`, `?until=` as the API's.
pub(crate) async fn report_page(
    State(state): State<ApiState>,
    query: Result<ApiQuery<crate::dto::ReportQuery>, crate::error::AppError>,
) -> Result<Response, PageError> {
    let q = match query {
        Ok(ApiQuery(q)) => q,
        Err(e) => return Err(page_error(&state, StatusCode::BAD_REQUEST, e.message)),
    };
    // An empty form field is no filter.
    fn given(v: &Option<String>) -> Option<&str> {
        v.as_deref().map(str::trim).filter(|v| !v.is_empty())
    }
    let (repo, since, until) = (given(&q.repo), given(&q.since), given(&q.until));
    let now = state.store.now_ms();
    let r = match crate::dto::read_report(&state.store, repo, since, until, now).await {
        Ok(r) => r,
        Err(crate::dto::ReportError::Input(m)) => {
            return Err(page_error(&state, StatusCode::BAD_REQUEST, m));
        }
        Err(crate::dto::ReportError::Store(e)) => {
            return Err(store_error(&state, "the delivery report", &e));
        }
    };
    let dur = |d: Option<i64>| d.map_or_else(|| "–".to_owned(), fmt_duration);
    let rate = |r: Option<f64>| r.map_or_else(|| "–".to_owned(), |r| format!("{:.0}%", r * 100.0));
    let usd = |known: f64, unknown: u64| {
        if unknown > 0 {
            format!("≥ ${known:.2}")
        } else {
            format!("${known:.2}")
        }
    };
    let per = |v: Option<f64>| v.map_or_else(|| "–".to_owned(), |v| format!("{v:.1}"));
    let o = &r.overall;
    let cards = vec![
        ("deploys", o.dora.deploys.to_string(), "deploys"),
        (
            "deploys per day",
            format!("{:.2}", o.dora.deploys_per_day),
            "per-day",
        ),
        (
            "lead time (median, from submission)",
            dur(o.dora.lead_time_from_submission.median_ms),
            "lead",
        ),
        (
            "change failure rate",
            rate(o.dora.change_failure_rate),
            "cfr",
        ),
        (
            "time to restore (median)",
            dur(o.dora.time_to_restore.median_ms),
            "restore",
        ),
        ("shipped", o.items.shipped.to_string(), "shipped"),
        (
            "cost per shipped change",
            o.items
                .known_cost_per_shipped_usd
                .map_or_else(|| "–".to_owned(), |c| usd(c, o.items.unknown_cost_runs)),
            "cost",
        ),
        (
            "agent runs per shipped",
            per(o.items.agent_runs_per_shipped),
            "runs",
        ),
        (
            "review loops per shipped",
            per(o.items.review_loops_per_shipped),
            "loops",
        ),
        (
            "staging: passed / change / infrastructure",
            format!(
                "{} / {} / {}",
                o.staging.passed, o.staging.change_failures, o.staging.infrastructure_errors
            ),
            "staging",
        ),
        (
            "release track wait (median)",
            dur(o.release_wait.median_ms),
            "wait",
        ),
    ];
    let most = r.weekly.iter().map(|w| w.deploys).max().unwrap_or(0).max(1);
    let scale = |n: u64| u32::try_from(n * u64::from(TREND_H) / most).unwrap_or(TREND_H);
    let day = |s: &str| s.get(..10).unwrap_or(s).to_owned();
    let bars = r
        .weekly
        .iter()
        .zip(0_u32..)
        .map(|(w, i)| {
            let h = scale(w.deploys);
            let fail_h = scale(w.change_failures.min(w.deploys));
            WeekBar {
                x: 4 + i * WEEK_W,
                y: TREND_H + 4 - h,
                h,
                fail_y: TREND_H + 4 - fail_h,
                fail_h,
                label: day(&w.since).get(5..).unwrap_or_default().to_owned(),
                title: format!(
                    "week of {}: {} deploys, {} change failures",
                    day(&w.since),
                    w.deploys,
                    w.change_failures
                ),
            }
        })
        .collect::<Vec<_>>();
    let chart_w = 8 + WEEK_W * u32::try_from(bars.len()).unwrap_or(0);
    let weeks = r
        .weekly
        .iter()
        .rev()
        .map(|w| WeekRow {
            week: day(&w.since),
            deploys: w.deploys,
            failures: w.change_failures,
            rate: rate(w.change_failure_rate),
            lead: dur(w.lead_time_from_submission.median_ms),
            restore: dur(w.time_to_restore.median_ms),
            shipped: w.shipped,
            cost: usd(w.known_cost_usd, w.unknown_cost_runs),
        })
        .collect();
    let longest = r
        .stage_time
        .iter()
        .map(|s| s.time.total_ms)
        .max()
        .unwrap_or(0)
        .max(1);
    let stages = r
        .stage_time
        .iter()
        .map(|s| StageTimeRow {
            stage: s.stage.clone(),
            items: s.time.count,
            total: fmt_duration(s.time.total_ms),
            median: dur(s.time.median_ms),
            p90: dur(s.time.p90_ms),
            pct: u32::try_from(s.time.total_ms.max(0) * 100 / longest).unwrap_or(100),
        })
        .collect();
    let repos = r
        .by_repo
        .iter()
        .map(|d| {
            let f = &d.figures;
            (
                d.repo.clone(),
                f.dora.deploys.to_string(),
                rate(f.dora.change_failure_rate),
                dur(f.dora.lead_time_from_submission.median_ms),
                f.items.shipped.to_string(),
            )
        })
        .collect();
    let agents = o
        .by_agent
        .iter()
        .map(|a| {
            (
                a.backend.clone(),
                a.model.clone().unwrap_or_else(|| "(default)".to_owned()),
                a.runs.to_string(),
                usd(a.known_cost_usd, a.unknown_cost_runs),
                format!("{} of {}", a.shipped, a.items),
            )
        })
        .collect();
    let page = ReportPage {
        version: state.version.clone(),
        now: fmt_time(now),
        live: false,
        repo: repo.unwrap_or_default().to_owned(),
        since: since.unwrap_or_default().to_owned(),
        until: until.unwrap_or_default().to_owned(),
        range: format!(
            "{} to {}{}",
            r.since,
            r.until,
            r.repo
                .as_deref()
                .map(|repo| format!(", repo {repo}"))
                .unwrap_or_default()
        ),
        cards,
        chart_w,
        bars,
        weeks,
        stages,
        repos,
        agents,
    };
    Ok(render(&page))
}

#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage {
    version: String,
    now: String,
    live: bool,
    status: u16,
    title: String,
    message: String,
}

// ----- handlers ------------------------------------------------------------------------------

/// A dashboard failure, answered as an HTML page.
pub(crate) struct PageError {
    status: StatusCode,
    message: String,
    version: String,
    now: i64,
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let page = ErrorPage {
            live: false,
            version: self.version,
            now: fmt_time(self.now),
            status: self.status.as_u16(),
            title: self.status.canonical_reason().unwrap_or("Error").to_owned(),
            message: self.message,
        };
        (self.status, render(&page)).into_response()
    }
}

fn page_error(state: &ApiState, status: StatusCode, message: impl Into<String>) -> PageError {
    PageError {
        status,
        message: message.into(),
        version: state.version.clone(),
        now: state.store.now_ms(),
    }
}

fn store_error(state: &ApiState, what: &str, e: &orch_store::StoreError) -> PageError {
    tracing::warn!(error = %e, "dashboard: store query for {what} failed");
    page_error(
        state,
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the store could not answer ({what}): {e}"),
    )
}

/// Renders a template; a render failure (a bug) becomes a plain 500 page.
fn render<T: Template>(t: &T) -> Response {
    match t.render() {
        Ok(html) => Html(html).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "dashboard template failed to render");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                Html("<!doctype html><title>orch</title><p>the page failed to render; see the server log</p>".to_owned()),
            )
                .into_response()
        }
    }
}

/// Query of the front page.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct IndexQuery {
    stage: Option<String>,
}

/// `GET /`: queue summary, outcomes, counters, watches and the newest tasks.
pub(crate) async fn index(
    State(state): State<ApiState>,
    query: Result<ApiQuery<IndexQuery>, crate::error::AppError>,
) -> Result<Response, PageError> {
    let stage_filter = match query {
        Ok(ApiQuery(q)) => q.stage.unwrap_or_default(),
        Err(e) => return Err(page_error(&state, StatusCode::BAD_REQUEST, e.message)),
    };
    if stage_filter.chars().any(char::is_control) {
        return Err(page_error(
            &state,
            StatusCode::BAD_REQUEST,
            "stage must not contain control characters",
        ));
    }
    let snap = QueueSnapshot::read(&state)
        .await
        .map_err(|e| store_error(&state, "the queue", &e))?;
    let tasks = state
        .store
        .list_tasks(&orch_store::TaskFilter {
            stage: Some(stage_filter.clone()).filter(|s| !s.is_empty()),
            repo: None,
            limit: INDEX_TASKS,
            offset: 0,
        })
        .await
        .map_err(|e| store_error(&state, "the task list", &e))?;
    let outcome_counts = crate::outcomes::counts(&state.store)
        .await
        .map_err(|e| store_error(&state, "the outcomes", &e))?;
    // The leases' work items came with the leases (one query).
    let work_items: std::collections::HashMap<i64, String> = snap
        .stats
        .leases
        .iter()
        .filter_map(|l| Some((l.task_id?, l.work_item_id.clone()?)))
        .collect();
    let mut series = std::collections::HashMap::new();
    for o in &snap.observations {
        let points = state.ops.observation_series(&o.work_item_id).await;
        series.insert(o.work_item_id.clone(), points);
    }
    let mut events = events_of(&state, &tasks).await;
    let mut rows = Vec::with_capacity(tasks.len());
    let mut repos: Vec<String> = Vec::new();
    for t in &tasks {
        if !repos.iter().any(|r| *r == t.repo) {
            repos.push(t.repo.to_string());
        }
        rows.push(TaskRow::new(t, &events.remove(&t.id).unwrap_or_default()));
    }
    repos.sort();
    let page = IndexPage {
        version: state.version.clone(),
        now: fmt_time(snap.stats.now),
        live: true,
        queue: QueueView::new(&snap, &work_items, &series),
        tasks: rows,
        stage_filter,
        outcomes: Outcome::ALL
            .iter()
            .map(|o| {
                (
                    o.as_str(),
                    o.as_str().replace('_', " "),
                    outcome_counts.get(o).copied().unwrap_or(0),
                )
            })
            .collect(),
        finished_window: crate::FINISHED_WINDOW_LABEL,
        repos,
        unsandboxed: state.ops.unsandboxed_repos(),
        process_started: fmt_time(state.started_at_ms),
    };
    Ok(render(&page))
}

/// The events of the listed tasks, read at once (a read per row made a page of 200 tasks 200
/// queries). Only for the rows' visit/loop counts and outcomes: a failed read draws the rows
/// without them.
async fn events_of(
    state: &ApiState,
    tasks: &[orch_store::Task],
) -> std::collections::HashMap<i64, Vec<orch_store::Event>> {
    let ids: Vec<i64> = tasks.iter().map(|t| t.id).collect();
    match state.store.events_of_tasks(&ids, &[]).await {
        Ok(events) => orch_store::group_by_task(events),
        Err(e) => {
            tracing::warn!(error = %e, "dashboard: cannot read the tasks' events");
            std::collections::HashMap::new()
        }
    }
}

/// The `{id}` of a dashboard path, validated; failures become an HTML page.
pub(crate) struct PageId(String);

impl FromRequestParts<ApiState> for PageId {
    type Rejection = PageError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &ApiState,
    ) -> Result<Self, Self::Rejection> {
        let id = match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(id)) => id,
            Err(e) => return Err(page_error(state, StatusCode::BAD_REQUEST, e.body_text())),
        };
        validate_work_item_id(&id).map_err(|m| page_error(state, StatusCode::BAD_REQUEST, m))?;
        Ok(PageId(id))
    }
}

/// `GET /ui/tasks/{id}`: the story of one task: outcome at the top, the stage timeline, the
/// watch's chart, agent runs, artifacts, and the raw event log and jobs collapsed below.
pub(crate) async fn task_page(
    State(state): State<ApiState>,
    PageId(id): PageId,
) -> Result<Response, PageError> {
    let task = state
        .store
        .get_task_by_work_item(&id)
        .await
        .map_err(|e| store_error(&state, "a task", &e))?
        .ok_or_else(|| {
            page_error(
                &state,
                StatusCode::NOT_FOUND,
                format!("no task for work item {id}"),
            )
        })?;
    let store_err = |e: orch_store::StoreError| store_error(&state, "a task's details", &e);
    let usage = state.store.task_usage(task.id).await.map_err(store_err)?;
    let events = state.store.task_events(task.id).await.map_err(store_err)?;
    let runs = state
        .store
        .task_agent_runs(task.id)
        .await
        .map_err(store_err)?;
    let jobs = state.store.task_jobs(task.id).await.map_err(store_err)?;
    let (files, artifacts_error) = match state.ops.artifacts(task.work_item_id.as_str()).await {
        Ok(files) => (files, String::new()),
        Err(e) => (Vec::new(), e.to_string()),
    };
    let now = state.store.now_ms();
    let mut observations = Vec::new();
    let mut chart = None;
    for o in state.ops.active_observations().await {
        if o.work_item_id == task.work_item_id {
            let series = state.ops.observation_series(&o.work_item_id).await;
            if !series.is_empty() {
                chart = Some(Chart::new(
                    &series,
                    "the armed watch (live)".to_owned(),
                    String::new(),
                ));
            }
            observations.push(ObservationRow::new(&o, now, &series));
        }
    }
    if chart.is_none()
        && let Some(log) = files.iter().find(|f| f.name.starts_with("16-"))
    {
        let series = crate::story::series_from_log(&log.content);
        if !series.is_empty() {
            let fm = crate::markdown::render_artifact(&log.content).frontmatter;
            let field = |k: &str| {
                fm.lines()
                    .find_map(|l| l.strip_prefix(k))
                    .and_then(|v| v.strip_prefix(':'))
                    .map(|v| v.trim().trim_matches('"').to_owned())
                    .unwrap_or_default()
            };
            let verdict = match (field("post_deploy_status"), field("action_taken")) {
                (v, a) if !v.is_empty() => format!("{v}, action {a}"),
                _ => String::new(),
            };
            chart = Some(Chart::new(&series, log.name.clone(), verdict));
        }
    }
    let outcome = crate::outcomes::of(&task, &events);
    let visits = crate::story::visits(&events, now);
    let t0 = visits.first().map_or(task.created_at, |v| v.start_ms);
    let t1 = visits.last().map_or(now, |v| v.end_ms).max(t0 + 1);
    let span = (t1 - t0) as f64;
    let pct = |v: f64| format!("{:.2}", v.clamp(0.0, 100.0));
    let visit_rows = visits
        .iter()
        .map(|v| {
            let left = (v.start_ms - t0) as f64 / span * 100.0;
            let width = ((v.end_ms - v.start_ms) as f64 / span * 100.0).max(0.4);
            VisitRow {
                stage: v.stage.clone(),
                left: pct(left.min(99.6)),
                width: pct(width.min(100.0 - left.min(99.6))),
                duration: fmt_duration(v.end_ms - v.start_ms),
                loop_back: v.loop_back,
                waits: v.waits,
                current: v.current,
                terminal: v.terminal,
                at: format!("+{}", fmt_duration(v.start_ms - t0)),
            }
        })
        .collect();
    let pipeline = PipelineView::new(task.stage.as_str(), &events);
    let terminal = task.is_terminal();
    let transcripts = transcripts(&state, task.work_item_id.as_str(), &runs).await;
    let page = TaskPage {
        transcripts,
        version: state.version.clone(),
        now: fmt_time(now),
        live: !terminal,
        outcome: OutcomeView::new(&task, outcome.as_ref()),
        created: fmt_time(task.created_at),
        updated: fmt_time(task.updated_at),
        took: fmt_duration(t1 - t0),
        usage_runs: usage.runs,
        usage_tokens_in: usage.input_tokens,
        usage_tokens_out: usage.output_tokens,
        usage_cost: crate::dto::UsageDto::new(usage).cost_text(),
        events: events
            .iter()
            .map(|e| EventRow {
                at: fmt_time(e.created_at),
                kind: e.kind.clone(),
                stage: e.stage.clone().unwrap_or_default(),
                message: e.message.clone(),
                data: if e.data.trim() == "{}" {
                    String::new()
                } else {
                    e.data.clone()
                },
            })
            .collect(),
        visits: visit_rows,
        runs: runs.iter().map(|r| run_row(r, now)).collect(),
        jobs: jobs
            .iter()
            .map(|j| JobRow {
                id: j.id,
                agent: j.agent.clone(),
                state: j.state.as_str(),
                attempt: format!("{}/{}", j.attempt, j.max_attempts),
                available: fmt_time(j.available_at),
                worker: j.locked_by.clone().unwrap_or_default(),
                last_error: j.last_error.clone().unwrap_or_default(),
            })
            .collect(),
        artifacts: files.into_iter().map(artifact_view).collect(),
        artifacts_error,
        observations,
        chart,
        pipeline,
        can_cancel: !terminal,
        can_retry: task.stage == control::FAILED,
        task,
    };
    Ok(render(&page))
}

/// `GET /ui/repos/{repo}`: items in flight, the deploy history, finished items and lessons.
pub(crate) async fn repo_page(
    State(state): State<ApiState>,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, PageError> {
    let repo = match path {
        Ok(Path(r)) => r,
        Err(e) => return Err(page_error(&state, StatusCode::BAD_REQUEST, e.body_text())),
    };
    let repo = crate::routes::repo_param(&repo)
        .map_err(|m| page_error(&state, StatusCode::BAD_REQUEST, m))?;
    let story = crate::repos::read(&state.store, &repo)
        .await
        .map_err(|e| store_error(&state, "a repo's deploys", &e))?
        .ok_or_else(|| {
            page_error(
                &state,
                StatusCode::NOT_FOUND,
                format!("no task for repo {repo}"),
            )
        })?;
    let mut events = events_of(&state, &story.in_flight).await;
    let in_flight = story
        .in_flight
        .iter()
        .map(|t| TaskRow::new(t, &events.remove(&t.id).unwrap_or_default()))
        .collect();
    let finished = story
        .finished
        .iter()
        .map(|(t, o)| TaskRow {
            work_item_id: t.work_item_id.to_string(),
            repo: t.repo.to_string(),
            title: t.title.clone(),
            stage: t.stage.to_string(),
            updated: fmt_time(t.updated_at),
            pipeline: PipelineView {
                boxes: Vec::new(),
                loops: 0,
            },
            outcome: OutcomeView::new(t, o.as_ref()),
        })
        .collect();
    let lessons_file = state.ops.repo_lessons(&repo).await;
    let lessons_html = lessons_file
        .as_deref()
        .map(crate::markdown::to_safe_html)
        .unwrap_or_default();
    let page = RepoPage {
        version: state.version.clone(),
        now: fmt_time(state.store.now_ms()),
        live: true,
        repo: story.repo.clone(),
        in_flight,
        finished,
        deploys: story
            .deploys
            .iter()
            .rev()
            .map(|d| DeployRow {
                at: fmt_time(d.at_ms),
                deployed_by: d.deployed_by.clone(),
                revision: short_rev(d.revision.as_deref()),
                previous_revision: short_rev(d.previous_revision.as_deref()),
                items: d.items.clone(),
                source: d.source,
                verdict: d.verdict.clone().unwrap_or_default(),
                rolled_back: d.rolled_back,
                rollback_failed: d.rollback_failed,
                reverts: d
                    .reverts
                    .iter()
                    .map(|(w, c)| (w.clone(), short_rev(Some(c))))
                    .collect(),
            })
            .collect(),
        lessons: story
            .lessons
            .iter()
            .map(|l| (l.work_item.clone(), fmt_time(l.at_ms), l.message.clone()))
            .collect(),
        legacy_deploys: story
            .deploys
            .iter()
            .any(|d| d.source == events::DEPLOY_CONFIRMED),
        lessons_file,
        unsandboxed: state.ops.unsandboxed_repos().contains(&repo),
        lessons_html,
    };
    Ok(render(&page))
}

/// The first 12 characters of a revision.
fn short_rev(r: Option<&str>) -> String {
    r.map(|r| r.chars().take(12).collect()).unwrap_or_default()
}

fn run_row(r: &orch_store::AgentRun, now: i64) -> RunRow {
    let opt = |v: Option<i64>| v.map(|v| v.to_string()).unwrap_or_default();
    let tokens = |v: Option<i64>| {
        v.map(|v| v.to_string())
            .unwrap_or_else(|| "unknown".to_owned())
    };
    RunRow {
        id: r.id,
        agent: r.agent.clone(),
        stage: r.stage.clone(),
        backend: r.backend.clone(),
        model: r.model.clone().unwrap_or_default(),
        attempt: r.attempt,
        started: fmt_time(r.started_at),
        duration: match r.finished_at {
            Some(end) => fmt_duration(end.saturating_sub(r.started_at)),
            None => format!(
                "{} (running)",
                fmt_duration(now.saturating_sub(r.started_at))
            ),
        },
        outcome: r.outcome.clone(),
        failed: !matches!(r.outcome.as_str(), "ok" | "success" | "running"),
        exit_code: opt(r.exit_code),
        input_tokens: tokens(r.input_tokens),
        output_tokens: tokens(r.output_tokens),
        cost: r
            .cost_usd
            .map(|c| format!("${c:.4}"))
            .unwrap_or_else(|| "unknown".to_owned()),
        error: r.error.clone().unwrap_or_default(),
    }
}

fn artifact_view(a: ArtifactFile) -> ArtifactView {
    let size = format!("{} bytes", a.content.len());
    let content = if a.content.len() > MAX_ARTIFACT_SHOWN {
        let mut cut = MAX_ARTIFACT_SHOWN;
        while !a.content.is_char_boundary(cut) {
            cut -= 1;
        }
        format!(
            "{}\n\n[… cut at {} KiB; the whole file is in the API]",
            &a.content[..cut],
            MAX_ARTIFACT_SHOWN / 1024
        )
    } else {
        a.content
    };
    let rendered = crate::markdown::render_artifact(&content);
    let dom_id = format!(
        "art-{}",
        a.name
            .trim_end_matches(".md")
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect::<String>()
    );
    ArtifactView {
        dom_id,
        name: a.name,
        size,
        frontmatter: rendered.frontmatter,
        html: rendered.html,
        content,
    }
}

// ----- formatting ----------------------------------------------------------------------------

/// Epoch ms as `YYYY-MM-DD HH:MM:SSZ` (UTC).
fn fmt_time(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// A duration in ms for humans: `850ms`, `4.2s`, `3m 05s`, `2h 07m`, `3d 04h`.
fn fmt_duration(ms: i64) -> String {
    let ms = ms.max(0);
    let s = ms / 1000;
    if ms < 1000 {
        format!("{ms}ms")
    } else if s < 60 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if s < 3600 {
        format!("{}m {:02}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h {:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}d {:02}h", s / 86_400, (s % 86_400) / 3600)
    }
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A signed offset from now: `in 4.2s` or `12.0s ago`.
fn fmt_relative(delta_ms: i64) -> String {
    if delta_ms >= 0 {
        format!("in {}", fmt_duration(delta_ms))
    } else {
        format!("{} ago", fmt_duration(delta_ms.saturating_neg()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        for (ms, want) in [
            (0, "1970-01-01 00:00:00Z"),
            (1_800_000_000_000, "2027-01-15 08:00:00Z"),
            (951_782_400_000, "2000-02-29 00:00:00Z"),
            (-1_000, "1969-12-31 23:59:59Z"),
        ] {
            assert_eq!(fmt_time(ms), want, "{ms}");
        }
    }

    #[test]
    fn durations() {
        for (ms, want) in [
            (-5, "0ms"),
            (850, "850ms"),
            (4_200, "4.2s"),
            (185_000, "3m 05s"),
            (7_620_000, "2h 07m"),
            (273_600_000, "3d 04h"),
        ] {
            assert_eq!(fmt_duration(ms), want, "{ms}");
        }
        assert_eq!(fmt_relative(4_200), "in 4.2s");
        assert_eq!(fmt_relative(-12_000), "12.0s ago");
    }

    #[test]
    fn percent_encoding() {
        for (input, want) in [
            ("review", "review"),
            ("a b&c", "a%20b%26c"),
            ("é", "%C3%A9"),
        ] {
            assert_eq!(percent_encode(input), want, "{input}");
        }
    }

    fn event(kind: &str, stage: &str) -> orch_store::Event {
        orch_store::Event {
            id: 0,
            task_id: Some(1),
            job_id: None,
            kind: kind.into(),
            stage: Some(stage.into()),
            message: String::new(),
            data: "{}".into(),
            created_at: 0,
        }
    }

    /// Lays out `stage` after `moves` (kind, stage) and compares `name:class[xN]` of the boxes
    /// that are not `future`, and the loop count.
    fn check(stage: &str, moves: &[(&str, &str)], want: &[&str], want_loops: u32) {
        let events: Vec<_> = moves.iter().map(|(k, s)| event(k, s)).collect();
        let view = PipelineView::new(stage, &events);
        let got: Vec<String> = view
            .boxes
            .iter()
            .filter(|b| b.class != "future")
            .map(|b| match b.visits {
                0 | 1 => format!("{}:{}", b.name, b.class),
                n => format!("{}:{}x{n}", b.name, b.class),
            })
            .collect();
        assert_eq!(got, want, "{stage} after {moves:?}");
        assert_eq!(view.loops, want_loops, "{stage} after {moves:?}");
    }

    #[test]
    fn pipelines() {
        let sub = ("task.submitted", "intake");
        let adv = |s| ("stage.advanced", s);
        check("intake", &[sub], &["intake:current"], 0);
        check(
            "architecture",
            &[sub, adv("analysis"), adv("architecture")],
            &["intake:past", "analysis:past", "architecture:current"],
            0,
        );
        // A loop back from review to implementation: two visits each way, one loop.
        check(
            "review",
            &[
                sub,
                adv("analysis"),
                adv("architecture"),
                adv("implementation"),
                adv("review"),
                ("stage.loop_back", "implementation"),
                adv("review"),
            ],
            &[
                "intake:past",
                "analysis:past",
                "architecture:past",
                "implementation:pastx2",
                "review:currentx2",
            ],
            1,
        );
        // Cancelled while in analysis: analysis is where it stopped, the terminal box is current.
        check(
            "cancelled",
            &[sub, adv("analysis"), ("task.cancelled", "cancelled")],
            &["intake:past", "analysis:stopped", "cancelled:current"],
            0,
        );
        // A stage the built-in pipeline does not know is still drawn, as current.
        let view = PipelineView::new("custom-gate", &[]);
        let last = view.boxes.last().unwrap();
        assert_eq!((last.name.as_str(), last.class), ("custom-gate", "current"));
        assert!(
            view.boxes[..view.boxes.len() - 1]
                .iter()
                .all(|b| b.class == "past")
        );
    }

    #[test]
    fn chart_bars_scale_to_the_largest_value_and_keep_the_newest() {
        let point = |status: &str, value: Option<f64>| crate::ops::SeriesPoint {
            at_ms: 0,
            status: status.into(),
            value,
        };
        let bars = chart_bars(&[
            point("PASS", Some(50.0)),
            point("FAIL", Some(200.0)),
            point("NODATA", None),
            point("ERROR", Some(f64::NAN)),
        ]);
        let got: Vec<(u32, u32, u32, &str)> =
            bars.iter().map(|b| (b.x, b.y, b.h, b.color)).collect();
        assert_eq!(
            got,
            [
                (0, 24, 8, "#3a9d5d"),
                (6, 0, 32, "#c0392b"),
                (12, 0, 32, "#99a"),
                (18, 0, 32, "#e67e22"),
            ]
        );
        let many: Vec<_> = (0..100).map(|i| point("PASS", Some(i as f64))).collect();
        let bars = chart_bars(&many);
        assert_eq!(bars.len(), CHART_MAX_BARS);
        assert_eq!(bars.last().map(|b| b.h), Some(CHART_H));
        assert!(chart_bars(&[]).is_empty());
    }

    #[test]
    fn long_artifacts_are_cut_on_a_char_boundary() {
        let content = "é".repeat(MAX_ARTIFACT_SHOWN);
        let v = artifact_view(ArtifactFile {
            name: "02-requirements.md".into(),
            content,
        });
        assert!(v.content.contains("cut at 256 KiB"));
        assert!(v.content.len() < MAX_ARTIFACT_SHOWN + 100);
    }
}
