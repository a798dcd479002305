//! Task commands: submit, status, logs, approve, retry, cancel. They work on the database
//! directly (no server needed); a running `orch serve` picks the changes up.

use std::io::Read as _;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use orch_api::dto::{self, Action};
use orch_domain::MAX_REQUEST_BYTES;
use orch_domain::control::events;
use orch_store::{Event, Store, Task, TaskFilter};

use crate::cli::{StatusArgs, SubmitArgs};
use crate::context::Context;
use crate::exit::{Kind, fail};
use crate::output::{age, print_json, table_fit, width};
use crate::runtime::Runtime;

async fn runtime(cx: &Context) -> Result<(Store, Runtime)> {
    let config = cx.require_config()?.clone();
    let store = cx.open_store().await?;
    let rt = Runtime::new(&cx.places(&config), &config, &store)?;
    Ok((store, rt))
}

pub async fn submit(cx: &Context, args: SubmitArgs) -> Result<ExitCode> {
    let body = match (&args.body_file, &args.body) {
        (Some(p), _) if p.as_os_str() == "-" => {
            read_body(std::io::stdin().lock(), "stdin").context("cannot read the body")?
        }
        (Some(p), _) => {
            let file =
                std::fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
            read_body(file, &p.display().to_string()).context("cannot read the body")?
        }
        (None, Some(b)) => {
            check_body_len(b.len(), "--body")?;
            b.clone()
        }
        (None, None) => String::new(),
    };
    // One row and its first job: no engine, no executors.
    let config = cx.require_config()?;
    let pipeline = config.pipeline().context("invalid pipeline in orch.toml")?;
    let store = cx.open_store().await?;
    let by = crate::context::cli_actor();
    let task = orch_runner::ops::submit(
        &store,
        config,
        &pipeline,
        &args.repo,
        &args.title,
        &body,
        &by,
    )
    .await;
    store.close().await;
    let task = task?;
    if cx.json {
        print_json(&dto::to_json(&dto::Submitted::of(&task)));
    } else {
        crate::output::outln(&format!(
            "{} submitted (repo {}, branch {}); it starts when a worker is running (`orch serve`)",
            task.work_item_id, task.repo, task.branch
        ));
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads a work item's body from `r`, at most [`MAX_REQUEST_BYTES`] of it: a bigger (or
/// endless, like `/dev/zero`) source is refused after reading one byte past the limit.
fn read_body(r: impl std::io::Read, what: &str) -> Result<String> {
    let mut buf = Vec::new();
    r.take(MAX_REQUEST_BYTES as u64 + 1)
        .read_to_end(&mut buf)
        .with_context(|| format!("reading {what}"))?;
    check_body_len(buf.len(), what)?;
    String::from_utf8(buf).with_context(|| format!("{what} is not UTF-8 text"))
}

fn check_body_len(len: usize, what: &str) -> Result<()> {
    if len > MAX_REQUEST_BYTES {
        anyhow::bail!(
            "the body in {what} is too big: more than {MAX_REQUEST_BYTES} bytes (the limit of a \
             request, the same as the API's)"
        );
    }
    Ok(())
}

pub enum Op {
    Approve,
    Retry,
    Cancel,
}

pub async fn operate(cx: &Context, op: Op, id: &str) -> Result<ExitCode> {
    let (store, rt) = runtime(cx).await?;
    let by = crate::context::cli_actor();
    let (task, verb, action) = match op {
        Op::Approve => (rt.ops.approve(id, &by).await?, "approved", Action::Approve),
        Op::Retry => (rt.ops.retry(id, &by).await?, "retried", Action::Retry),
        Op::Cancel => (rt.ops.cancel(id, &by).await?, "cancelled", Action::Cancel),
    };
    store.close().await;
    if cx.json {
        print_json(&dto::to_json(&dto::ActionDone::of(&task, action)));
    } else {
        crate::output::outln(&format!(
            "{} {verb}; now at stage {}",
            task.work_item_id, task.stage
        ));
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn status(cx: &Context, args: StatusArgs) -> Result<ExitCode> {
    stale_config_notes(cx);
    let store = cx.open_store().await?;
    if let Some(id) = &args.id {
        let task = find(&store, id).await?;
        if cx.json {
            let detail = dto::TaskDetail::read(&store, &task).await;
            store.close().await;
            let detail = detail.with_context(|| format!("reading {}", task.work_item_id))?;
            print_json(&dto::to_json(&detail));
            return Ok(ExitCode::SUCCESS);
        }
        let events = store.task_events(task.id).await?;
        let usage = dto::UsageDto::new(store.task_usage(task.id).await?);
        let outcome = orch_api::task_outcome(&task, &events);
        crate::output::outln(&format!("{}  {}", task.work_item_id, task.title));
        crate::output::outln(&format!(
            "repo {}  branch {}  stage {}",
            task.repo, task.branch, task.stage
        ));
        if let Some(o) = &outcome {
            let at = o
                .stage
                .as_deref()
                .map(|s| format!(" at {s}"))
                .unwrap_or_default();
            let why = o
                .reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            crate::output::outln(&format!("outcome {}{at}{why}", o.outcome));
            if let Some(live) = &o.live {
                crate::output::outln(&format!("live in production (as orch last saw it): {live}"));
            }
        }
        crate::output::outln(&format!(
            "agent runs {}  tokens in {} out {}  cost {}",
            usage.runs,
            usage.input_tokens,
            usage.output_tokens,
            usage.cost_text()
        ));
        let stage_events: Vec<&Event> = events
            .iter()
            .filter(|e| {
                e.kind.starts_with(events::STAGE_ADVANCED)
                    || e.kind.starts_with(events::STAGE_LOOP_BACK)
                    || e.kind.starts_with("task.")
                    || e.kind == events::STAGE_APPROVED
            })
            .collect();
        crate::output::out(&format!("\n{}", timeline(&stage_events, task.created_at)));
    } else {
        let tasks = store
            .list_tasks(&TaskFilter {
                stage: args.stage.clone(),
                repo: None,
                limit: args.limit,
                offset: 0,
            })
            .await?;
        let now = store.now_ms();
        if cx.json {
            let list = dto::TaskList::read(&store, &tasks).await;
            store.close().await;
            let list = list.context("reading the tasks' outcomes")?;
            print_json(&dto::to_json(&list));
            return Ok(ExitCode::SUCCESS);
        } else if tasks.is_empty() {
            crate::output::outln("no tasks yet: `orch submit --repo R --title ...`");
        } else {
            let mut rows: Vec<Vec<String>> = Vec::with_capacity(tasks.len());
            for t in &tasks {
                rows.push(vec![
                    t.work_item_id.to_string(),
                    t.stage.to_string(),
                    outcome_label(&store, t).await?,
                    t.repo.to_string(),
                    age(now - t.updated_at),
                    t.title.clone(),
                ]);
            }
            crate::output::out(&table_fit(
                &["id", "stage", "outcome", "repo", "updated", "title"],
                &rows,
                width(),
            ));
        }
    }
    store.close().await;
    Ok(ExitCode::SUCCESS)
}

pub async fn logs(cx: &Context, id: &str) -> Result<ExitCode> {
    let store = cx.open_store().await?;
    let task = find(&store, id).await?;
    if cx.json {
        let detail = dto::TaskDetail::read(&store, &task).await;
        store.close().await;
        let detail = detail.with_context(|| format!("reading {}", task.work_item_id))?;
        print_json(&dto::to_json(&detail));
        return Ok(ExitCode::SUCCESS);
    }
    let events = store.task_events(task.id).await?;
    let runs = store.task_agent_runs(task.id).await?;
    store.close().await;
    crate::output::outln(&format!(
        "{}  {}  (stage {})\n",
        task.work_item_id, task.title, task.stage
    ));
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            vec![
                format!("+{}", age(e.created_at - task.created_at)),
                e.kind.clone(),
                e.stage.clone().unwrap_or_default(),
                e.message.lines().next().unwrap_or_default().to_owned(),
            ]
        })
        .collect();
    let width = width();
    crate::output::out(&table_fit(
        &["at", "event", "stage", "message"],
        &rows,
        width,
    ));
    if !runs.is_empty() {
        let rows: Vec<Vec<String>> = runs
            .iter()
            .map(|r| {
                vec![
                    r.stage.clone(),
                    r.agent.clone(),
                    r.backend.clone(),
                    r.outcome.clone(),
                    r.input_tokens.map(|t| t.to_string()).unwrap_or_default(),
                    r.output_tokens.map(|t| t.to_string()).unwrap_or_default(),
                    r.cost_usd
                        .map(|c| format!("{c:.4}"))
                        .unwrap_or_else(|| "unknown".to_owned()),
                    r.error
                        .as_deref()
                        .and_then(|e| e.lines().next())
                        .unwrap_or_default()
                        .to_owned(),
                ]
            })
            .collect();
        crate::output::out(&format!(
            "\n{}",
            table_fit(
                &[
                    "stage", "agent", "backend", "outcome", "in", "out", "cost $", "error"
                ],
                &rows,
                width
            )
        ));
    }
    Ok(ExitCode::SUCCESS)
}

/// `orch logs ID --transcript`: every agent run's transcript as a conversation, oldest run
/// first, each with the diff it left (`--json`: the stored text and diff per run).
pub async fn transcripts(cx: &Context, id: &str) -> Result<ExitCode> {
    let config = cx.require_config()?;
    let repos_dir = cx.repos_dir(config);
    let store = cx.open_store().await?;
    let task = find(&store, id).await?;
    let runs = store.task_agent_runs(task.id).await?;
    store.close().await;
    let mut json_runs = Vec::new();
    for r in &runs {
        let kept =
            crate::api_ops::read_transcript(&repos_dir, task.work_item_id.as_str(), r.id).await;
        let data: serde_json::Value = serde_json::from_str(&r.data).unwrap_or_default();
        let format = data["transcript"]["format"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| orch_domain::transcript::format_of(&r.backend).to_owned());
        if cx.json {
            json_runs.push(dto::RunTranscript {
                run_id: r.id,
                agent: r.agent.clone(),
                backend: r.backend.clone(),
                stage: r.stage.clone(),
                outcome: r.outcome.clone(),
                format,
                transcript: kept.as_ref().map(|k| k.text.clone()),
                diff: kept.as_ref().and_then(|k| k.diff.clone()),
            });
            continue;
        }
        crate::output::outln(&format!(
            "=== run {} · {} ({}) · {} · attempt {} · {}",
            r.id, r.agent, r.backend, r.stage, r.attempt, r.outcome
        ));
        let Some(kept) = kept else {
            crate::output::outln("(no transcript kept on this machine)\n");
            continue;
        };
        for e in orch_domain::transcript::entries(&format, &kept.text) {
            crate::output::outln(&transcript_entry(&e));
        }
        if let Some(diff) = &kept.diff {
            crate::output::outln(&format!("--- the run's diff\n{}", diff.trim_end()));
        }
        crate::output::outln("");
    }
    if cx.json {
        print_json(&dto::to_json(&dto::Transcripts {
            work_item: task.work_item_id.to_string(),
            runs: json_runs,
        }));
    }
    Ok(ExitCode::SUCCESS)
}

/// One transcript entry as text: who or what, then the text indented.
fn transcript_entry(e: &orch_domain::transcript::Entry) -> String {
    use orch_domain::transcript::Entry;
    let indent = |t: &str| {
        t.trim_end()
            .lines()
            .map(|l| format!("    {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let with = |head: String, body: &str| {
        if body.trim().is_empty() {
            head
        } else {
            format!("{head}\n{}", indent(body))
        }
    };
    match e {
        Entry::Message { role, text } => with(format!("[{role}]"), text),
        Entry::ToolCall { name, input } => with(format!("[tool call {name}]"), input),
        Entry::ToolResult { text, error } => with(
            if *error {
                "[tool error]"
            } else {
                "[tool result]"
            }
            .to_owned(),
            text,
        ),
        Entry::Command {
            command,
            exit_code,
            output,
        } => with(
            format!(
                "[command] $ {command} ({})",
                exit_code.map_or_else(|| "running".to_owned(), |c| format!("exit {c}"))
            ),
            output,
        ),
        Entry::Note(text) => format!("[note] {text}"),
    }
}

/// The task's outcome for the status table (`-` in flight), from the one outcome rule.
async fn outcome_label(store: &Store, t: &Task) -> Result<String> {
    if !t.is_terminal() {
        return Ok("-".to_owned());
    }
    let events = store.task_events(t.id).await?;
    Ok(orch_api::task_outcome(t, &events)
        .map(|o| o.outcome.as_str().to_owned())
        .unwrap_or_else(|| "-".to_owned()))
}

/// Says (on stderr) when a running `orch serve`/`orch worker` of this project runs an older
/// config than the file.
fn stale_config_notes(cx: &Context) {
    for note in crate::reload::stale_processes(&cx.state_dir()) {
        crate::say(&format!("orch: note: {note}"));
    }
}

async fn find(store: &Store, id: &str) -> Result<Task> {
    let id: orch_domain::ids::WorkItemId = id.parse()?;
    store
        .get_task_by_work_item(id.as_str())
        .await?
        .ok_or_else(|| fail(Kind::NotFound, format!("no work item {id}")))
}

/// The stage timeline: when each stage change happened, relative to submission.
pub fn timeline(events: &[&Event], t0: i64) -> String {
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            vec![
                format!("+{}", age(e.created_at - t0)),
                e.stage.clone().unwrap_or_default(),
                e.message.lines().next().unwrap_or_default().to_owned(),
            ]
        })
        .collect();
    table_fit(&["at", "stage", "why"], &rows, width())
}

#[cfg(test)]
mod cost_tests {
    use super::*;

    fn usage(runs: i64, cost_usd: f64, unknown_cost_runs: i64) -> String {
        dto::UsageDto::new(orch_store::Usage {
            runs,
            input_tokens: 10,
            output_tokens: 1,
            cost_usd,
            unknown_cost_runs,
        })
        .cost_text()
    }

    /// Regression (issues 12, 30): `status` printed `cost $0.0000` when no cost was known; a
    /// total with an unknown part is unknown, and says how many runs it covers.
    #[test]
    fn status_says_cost_unknown_instead_of_zero() {
        assert_eq!(usage(1, 0.0, 1), "unknown (1 of 1 runs)");
        assert_eq!(usage(3, 0.25, 1), "unknown (1 of 3 runs; $0.2500 known)");
        assert_eq!(usage(2, 0.25, 0), "$0.2500");
        assert_eq!(usage(0, 0.0, 0), "$0.0000");
    }
}
