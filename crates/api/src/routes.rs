//! The JSON routes: health, queue, metrics, tasks (list, one, events, artifacts), submit and the
//! operator actions. Handlers read the store directly and delegate every change to
//! [`crate::Operations`]; they convert rows to [`crate::dto`] shapes and nothing else.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use orch_domain::ids::ArtifactName;

use crate::ApiState;
use crate::dto::{self, Action};
use crate::error::AppError;
use crate::extract::{ApiJson, ApiQuery, Caller};
use crate::id::{WorkItemPath, validate_work_item_id};
use crate::metrics;
use crate::ops::{Actor, SubmitRequest, WebhookDelivery, WebhookReply};
use crate::snapshot::QueueSnapshot;

/// Tasks listed when the query names no limit.
const DEFAULT_LIMIT: u32 = 100;
/// Most tasks one list call returns.
const MAX_LIMIT: u32 = 1000;
/// Longest title accepted by submit, in characters.
const MAX_TITLE: usize = 200;
/// Longest repo name accepted by submit.
const MAX_REPO: usize = 64;

type ApiResult<T> = Result<T, AppError>;

/// `GET /healthz`: 200 when the store answers a query, 503 otherwise.
pub(crate) async fn healthz(State(state): State<ApiState>) -> Response {
    let uptime_s = state
        .store
        .now_ms()
        .saturating_sub(state.started_at_ms)
        .max(0)
        / 1000;
    match state.store.schema_version().await {
        Ok(v) => Json(dto::Health {
            status: "ok",
            db: "ok".to_owned(),
            version: state.version.clone(),
            schema_version: Some(v),
            uptime_s,
            config: state.ops.config_state().map(Into::into),
        })
        .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "health check: the store did not answer");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(dto::Health {
                    status: "unavailable",
                    db: format!("error: {e}"),
                    version: state.version.clone(),
                    schema_version: None,
                    uptime_s,
                    config: state.ops.config_state().map(Into::into),
                }),
            )
                .into_response()
        }
    }
}

/// `GET /queue`.
pub(crate) async fn queue(State(state): State<ApiState>) -> ApiResult<Json<dto::Queue>> {
    let snap = QueueSnapshot::read(&state)
        .await
        .map_err(|e| AppError::store("the queue", &e))?;
    Ok(Json(dto::Queue::new(&snap)))
}

/// `GET /costs`: what agent runs cost, by repo, stage and UTC day, unknown costs counted.
pub(crate) async fn costs(State(state): State<ApiState>) -> ApiResult<Json<dto::CostReport>> {
    let rows = state
        .store
        .usage_by_repo_stage_day()
        .await
        .map_err(|e| AppError::store("the agent runs' costs", &e))?;
    Ok(Json(dto::CostReport::new(&rows)))
}

/// `GET /report?repo=&since=&until=`: the delivery report (DORA keys and orch's figures);
/// 400 for a bad repo name or time, or an empty range.
pub(crate) async fn report(
    State(state): State<ApiState>,
    ApiQuery(q): ApiQuery<dto::ReportQuery>,
) -> ApiResult<Json<dto::DeliveryReport>> {
    let now = state.store.now_ms();
    match dto::read_report(
        &state.store,
        q.repo.as_deref(),
        q.since.as_deref(),
        q.until.as_deref(),
        now,
    )
    .await
    {
        Ok(r) => Ok(Json(r)),
        Err(dto::ReportError::Input(m)) => Err(AppError::bad_request(m)),
        Err(dto::ReportError::Store(e)) => Err(AppError::store("the delivery report", &e)),
    }
}

/// `GET /metrics`: always 200, in the Prometheus text format 0.0.4 or, when `Accept` asks for
/// it, OpenMetrics; `orch_up 0` when the store did not answer.
pub(crate) async fn metrics(State(state): State<ApiState>, headers: HeaderMap) -> Response {
    let format =
        metrics::Format::negotiate(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
    let now = state.store.now_ms();
    // The deploys of the views' recent window (a report over it reads only the tasks live or
    // ended in it).
    let window = orch_domain::report::Range {
        since: now - orch_store::RECENT_WINDOW_MS,
        until: now + 1,
    };
    let (snap, usage, runs, outcomes, pruned, delivery) = tokio::join!(
        QueueSnapshot::read(&state),
        state.store.usage_by_agent(),
        state.store.runs_by_agent_outcome(),
        crate::outcomes::counts(&state.store),
        state.store.pruned_total(),
        state.store.report(window, None)
    );
    let store = match (snap, usage, runs, outcomes, pruned, delivery) {
        (Ok(snap), Ok(usage), Ok(runs), Ok(outcomes), Ok(pruned), Ok(delivery)) => {
            let mut facts = metrics::Scrape::store_facts(&snap, &outcomes, usage, runs, pruned);
            facts.deploys_by_repo = delivery
                .repos
                .iter()
                .map(|(repo, f)| (repo.clone(), f.deploys, f.change_failures))
                .collect();
            Some(facts)
        }
        (snap, usage, runs, outcomes, pruned, delivery) => {
            let e = [
                snap.err(),
                usage.err(),
                runs.err(),
                outcomes.err(),
                pruned.err(),
                delivery.err(),
            ]
            .into_iter()
            .flatten()
            .next();
            if let Some(e) = e {
                tracing::warn!(error = %e, "metrics: the store did not answer");
            }
            None
        }
    };
    let mut watches_by_repo = std::collections::BTreeMap::new();
    for o in state.ops.active_observations().await {
        *watches_by_repo.entry(o.repo).or_default() += 1;
    }
    let scrape = metrics::Scrape {
        version: state.version.clone(),
        store,
        runners: state.ops.runner_counters().await,
        watches_by_repo,
        timings: state.ops.worker_timings().await,
        process: tokio::task::spawn_blocking(metrics::ProcessStats::read)
            .await
            .unwrap_or_default(),
    };
    (
        [(header::CONTENT_TYPE, format.content_type())],
        metrics::render(scrape, format),
    )
        .into_response()
}

/// `GET /openapi.yaml`: the API's OpenAPI document, as committed in `docs/openapi.yaml`.
pub(crate) async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/yaml; charset=utf-8")],
        include_str!("../../../docs/openapi.yaml"),
    )
        .into_response()
}

/// A filter value from a query string: control characters (NUL included) are a 400.
fn filter_value(name: &str, v: Option<String>) -> ApiResult<Option<String>> {
    match v {
        Some(v) if v.chars().any(char::is_control) => Err(AppError::bad_request(format!(
            "{name} must not contain control characters"
        ))),
        Some(v) if v.len() > 200 => Err(AppError::bad_request(format!(
            "{name} is longer than 200 bytes"
        ))),
        v => Ok(v.filter(|s| !s.is_empty())),
    }
}

/// `GET /tasks?stage=&repo=&limit=&offset=`: newest first.
pub(crate) async fn list_tasks(
    State(state): State<ApiState>,
    ApiQuery(q): ApiQuery<dto::TaskQuery>,
) -> ApiResult<Json<dto::TaskList>> {
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(AppError::bad_request(format!(
            "limit must be 1-{MAX_LIMIT}, got {limit}"
        )));
    }
    let filter = orch_store::TaskFilter {
        stage: filter_value("stage", q.stage)?,
        repo: filter_value("repo", q.repo)?,
        limit,
        offset: q.offset.unwrap_or(0),
    };
    let tasks = state
        .store
        .list_tasks(&filter)
        .await
        .map_err(|e| AppError::store("the task list", &e))?;
    let list = dto::TaskList::read(&state.store, &tasks)
        .await
        .map_err(|e| AppError::store("a task's outcome", &e))?;
    Ok(Json(list))
}

/// The task of a work item, or 404.
pub(crate) async fn find_task(state: &ApiState, id: &str) -> ApiResult<orch_store::Task> {
    state
        .store
        .get_task_by_work_item(id)
        .await
        .map_err(|e| AppError::store("a task", &e))?
        .ok_or_else(|| AppError::not_found(format!("no task for work item {id}")))
}

/// `GET /tasks/{id}`: the task (its stage), usage, event timeline, agent runs and jobs.
pub(crate) async fn get_task(
    State(state): State<ApiState>,
    WorkItemPath(id): WorkItemPath,
) -> ApiResult<Json<dto::TaskDetail>> {
    let task = find_task(&state, &id).await?;
    let detail = dto::TaskDetail::read(&state.store, &task)
        .await
        .map_err(|e| AppError::store("a task's details", &e))?;
    Ok(Json(detail))
}

/// `GET /tasks/{id}/events`: oldest first.
pub(crate) async fn task_events(
    State(state): State<ApiState>,
    WorkItemPath(id): WorkItemPath,
) -> ApiResult<Json<dto::EventList>> {
    let task = find_task(&state, &id).await?;
    let events = state
        .store
        .task_events(task.id)
        .await
        .map_err(|e| AppError::store("a task's events", &e))?;
    Ok(Json(dto::EventList {
        work_item_id: task.work_item_id.to_string(),
        events: events.iter().map(dto::EventDto::from).collect(),
    }))
}

/// `GET /tasks/{id}/artifacts`.
pub(crate) async fn task_artifacts(
    State(state): State<ApiState>,
    WorkItemPath(id): WorkItemPath,
) -> ApiResult<Json<dto::ArtifactList>> {
    let task = find_task(&state, &id).await?;
    let files = state.ops.artifacts(task.work_item_id.as_str()).await?;
    Ok(Json(dto::ArtifactList {
        work_item_id: task.work_item_id.to_string(),
        artifacts: files.into_iter().map(dto::ArtifactDto::from).collect(),
    }))
}

/// `GET /tasks/{id}/artifacts/{name}`: one artifact file. The name must be `NN-name.md`
/// (checked by the domain's `ArtifactName`), so `..`, separators and NUL are 400 before any
/// lookup.
pub(crate) async fn task_artifact(
    State(state): State<ApiState>,
    path: Result<Path<(String, String)>, axum::extract::rejection::PathRejection>,
) -> ApiResult<Json<dto::ArtifactDto>> {
    let Path((id, name)) = path?;
    validate_work_item_id(&id)
        .map_err(|m| AppError::new(StatusCode::BAD_REQUEST, "invalid_id", m))?;
    let name: ArtifactName = name
        .parse()
        .map_err(|e| AppError::new(StatusCode::BAD_REQUEST, "invalid_name", format!("{e}")))?;
    let task = find_task(&state, &id).await?;
    let files = state.ops.artifacts(task.work_item_id.as_str()).await?;
    files
        .into_iter()
        .find(|f| f.name == name.as_str())
        .map(|f| Json(dto::ArtifactDto::from(f)))
        .ok_or_else(|| {
            AppError::not_found(format!("work item {id} has no artifact {}", name.as_str()))
        })
}

/// `POST /hooks/github/{repo}`: a GitHub webhook delivery (issue 31). Not authenticated by
/// the token but by `X-Hub-Signature-256`, checked by the operations before anything else:
/// 401 and nothing changed when it does not hold; 202 when the delivery leads to a work item
/// (`duplicate` for a delivery id taken before), 200 when there is nothing in it for orch.
pub(crate) async fn github_webhook(
    State(state): State<ApiState>,
    Path(repo): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let delivery = WebhookDelivery {
        repo,
        event: text("x-github-event"),
        delivery: text("x-github-delivery"),
        signature: text("x-hub-signature-256"),
        body: body.to_vec(),
    };
    let answer = match state.ops.forge_webhook(delivery).await {
        Ok(WebhookReply::Queued {
            work_item_id,
            duplicate,
        }) => (
            StatusCode::ACCEPTED,
            dto::WebhookAnswer {
                accepted: true,
                work_item_id: Some(work_item_id),
                duplicate,
                reason: None,
            },
        ),
        Ok(WebhookReply::Ignored(reason)) => (
            StatusCode::OK,
            dto::WebhookAnswer {
                accepted: false,
                work_item_id: None,
                duplicate: false,
                reason: Some(reason),
            },
        ),
        Err(e) => {
            tracing::warn!(error = %e, "refused a forge webhook delivery");
            return Err(e.into());
        }
    };
    Ok((answer.0, Json(answer.1)).into_response())
}

/// `POST /tasks` with `{repo, title, body}`: 201 and the new work item's id.
pub(crate) async fn submit(
    State(state): State<ApiState>,
    Caller(by): Caller,
    ApiJson(body): ApiJson<dto::SubmitBody>,
) -> ApiResult<Response> {
    let req = validate_submit(body)?;
    let created = state.ops.submit(req, &by).await?;
    let task = match state
        .store
        .get_task_by_work_item(&created.work_item_id)
        .await
    {
        Ok(t) => t.as_ref().map(dto::TaskDto::from),
        Err(e) => {
            tracing::warn!(error = %e, work_item = %created.work_item_id, "cannot read back a submitted task");
            None
        }
    };
    let location = format!("/tasks/{}", created.work_item_id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(dto::Submitted {
            work_item_id: created.work_item_id,
            task_id: created.task_id,
            task,
        }),
    )
        .into_response())
}

fn validate_submit(body: dto::SubmitBody) -> ApiResult<SubmitRequest> {
    let repo = body.repo.trim();
    if repo.is_empty() || repo.len() > MAX_REPO {
        return Err(AppError::invalid(format!(
            "repo must be 1-{MAX_REPO} characters"
        )));
    }
    if repo.starts_with('.')
        || !repo
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(AppError::invalid(
            "repo may hold only A-Z, a-z, 0-9, '-', '_' and '.', and must not start with '.'",
        ));
    }
    let title = body.title.trim();
    if title.is_empty() {
        return Err(AppError::invalid("title must not be empty"));
    }
    if title.chars().count() > MAX_TITLE {
        return Err(AppError::invalid(format!(
            "title is longer than {MAX_TITLE} characters"
        )));
    }
    if title.chars().any(char::is_control) {
        return Err(AppError::invalid(
            "title must be one line without control characters",
        ));
    }
    if body.body.contains('\0') {
        return Err(AppError::invalid("body must not contain NUL characters"));
    }
    Ok(SubmitRequest {
        repo: repo.to_owned(),
        title: title.to_owned(),
        body: body.body,
    })
}

async fn act(
    state: ApiState,
    id: String,
    action: Action,
    by: Actor,
) -> ApiResult<Json<dto::ActionDone>> {
    find_task(&state, &id).await?;
    match action {
        Action::Approve => state.ops.approve(&id, &by).await?,
        Action::Retry => state.ops.retry(&id, &by).await?,
        Action::Cancel => state.ops.cancel(&id, &by).await?,
    }
    tracing::info!(work_item = %id, action = action.as_str(), by = %by.describe(), "operator action");
    let task = match state.store.get_task_by_work_item(&id).await {
        Ok(t) => t.as_ref().map(dto::TaskDto::from),
        Err(e) => {
            tracing::warn!(error = %e, work_item = %id, "cannot read back a task after {}", action.as_str());
            None
        }
    };
    Ok(Json(dto::ActionDone {
        work_item_id: id,
        action: action.as_str(),
        task,
    }))
}

/// `POST /tasks/{id}/approve`.
pub(crate) async fn approve(
    State(state): State<ApiState>,
    Caller(by): Caller,
    WorkItemPath(id): WorkItemPath,
) -> ApiResult<Json<dto::ActionDone>> {
    act(state, id, Action::Approve, by).await
}

/// `POST /tasks/{id}/retry`.
pub(crate) async fn retry(
    State(state): State<ApiState>,
    Caller(by): Caller,
    WorkItemPath(id): WorkItemPath,
) -> ApiResult<Json<dto::ActionDone>> {
    act(state, id, Action::Retry, by).await
}

/// `POST /tasks/{id}/cancel`.
pub(crate) async fn cancel(
    State(state): State<ApiState>,
    Caller(by): Caller,
    WorkItemPath(id): WorkItemPath,
) -> ApiResult<Json<dto::ActionDone>> {
    act(state, id, Action::Cancel, by).await
}

/// A repo name from a path: the domain's `RepoName` rules, else 400.
pub(crate) fn repo_param(repo: &str) -> Result<String, String> {
    repo.parse::<orch_domain::ids::RepoName>()
        .map(|r| r.as_str().to_owned())
        .map_err(|e| e.to_string())
}

/// `GET /repos/{repo}/deploys`: items in flight, finished items with their outcome, the deploy
/// history and the lessons recorded, for one repo. 404 when the repo has no task.
pub(crate) async fn repo_deploys(
    State(state): State<ApiState>,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> ApiResult<Json<dto::RepoDeploys>> {
    let Path(repo) = path?;
    let repo =
        repo_param(&repo).map_err(|m| AppError::new(StatusCode::BAD_REQUEST, "invalid_repo", m))?;
    let story = crate::repos::read(&state.store, &repo)
        .await
        .map_err(|e| AppError::store("a repo's deploys", &e))?
        .ok_or_else(|| AppError::not_found(format!("no task for repo {repo}")))?;
    Ok(Json(dto::RepoDeploys::from(&story)))
}

/// Any other path.
pub(crate) async fn fallback(uri: Uri) -> AppError {
    AppError::not_found(format!("no route for {}", uri.path()))
}
