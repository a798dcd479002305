//! `orch queue`: the queue at a glance.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use orch_api::dto;

use crate::context::Context;
use crate::output::{age, print_json, table};

pub async fn run(cx: &Context) -> Result<ExitCode> {
    let store = cx.open_store().await?;
    if cx.json {
        // The `GET /queue` document, as a process that runs no worker sees it.
        let (observations, tracks) = match &cx.config {
            Some(config) => {
                let pipeline = config.pipeline().context("the configured pipeline")?;
                (
                    crate::api_ops::active_observations(cx.repos_dir(config)).await,
                    crate::api_ops::release_tracks(&store, &pipeline).await,
                )
            }
            None => (Vec::new(), Vec::new()),
        };
        let queue =
            dto::Queue::read_store(&store, env!("CARGO_PKG_VERSION"), observations, tracks).await;
        store.close().await;
        print_json(&dto::to_json(&queue.context("reading the queue")?));
        return Ok(ExitCode::SUCCESS);
    }
    let stats = store.queue_stats().await?;
    let stages = store.active_tasks_by_stage(stats.finished_since).await?;
    let nodes = store.nodes().await?;
    store.close().await;
    let mut by_state: BTreeMap<&str, i64> = BTreeMap::new();
    let mut by_agent: BTreeMap<&str, BTreeMap<&str, i64>> = BTreeMap::new();
    for c in &stats.counts {
        *by_state.entry(c.state.as_str()).or_default() += c.count;
        *by_agent
            .entry(c.agent.as_str())
            .or_default()
            .entry(c.state.as_str())
            .or_default() += c.count;
    }
    let oldest_ms = stats.oldest_ready_at.map(|at| (stats.now - at).max(0));
    let states = ["queued", "running", "done", "failed", "cancelled"];
    let summary: Vec<String> = states
        .iter()
        .map(|s| format!("{s} {}", by_state.get(s).copied().unwrap_or(0)))
        .collect();
    crate::output::outln(&format!(
        "jobs: {} (done, failed, cancelled: {})",
        summary.join(", "),
        orch_api::FINISHED_WINDOW_LABEL
    ));
    match oldest_ms {
        Some(ms) => crate::output::outln(&format!("oldest ready job waiting: {}", age(ms))),
        None => crate::output::outln("no job is waiting"),
    }
    if !by_agent.is_empty() {
        let mut headers = vec!["agent"];
        headers.extend(states);
        let rows: Vec<Vec<String>> = by_agent
            .iter()
            .map(|(agent, m)| {
                let mut row = vec![(*agent).to_owned()];
                row.extend(
                    states
                        .iter()
                        .map(|s| m.get(s).copied().unwrap_or(0).to_string()),
                );
                row
            })
            .collect();
        crate::output::out(&format!("\n{}", table(&headers, &rows)));
    }
    if !stages.is_empty() {
        let rows: Vec<Vec<String>> = stages
            .iter()
            .map(|(s, n)| vec![s.clone(), n.to_string()])
            .collect();
        crate::output::out(&format!(
            "\n{}(tasks at done, failed, cancelled: {})\n",
            table(&["stage", "tasks"], &rows),
            orch_api::FINISHED_WINDOW_LABEL
        ));
    }
    if !stats.leases.is_empty() {
        let rows: Vec<Vec<String>> = stats
            .leases
            .iter()
            .map(|l| {
                vec![
                    l.job_id.to_string(),
                    l.agent.clone(),
                    l.worker.clone().unwrap_or_default(),
                    l.attempt.to_string(),
                    l.expires_at
                        .map(|at| age(at - stats.now))
                        .unwrap_or_default(),
                ]
            })
            .collect();
        crate::output::out(&format!(
            "\n{}",
            table(&["job", "agent", "worker", "attempt", "expires in"], &rows)
        ));
    }
    if !nodes.is_empty() {
        // Each node's heartbeat beacon: its pinned jobs move once it is unseen for the grace.
        let rows: Vec<Vec<String>> = nodes
            .iter()
            .map(|n| vec![n.node.clone(), age((stats.now - n.last_seen_ms).max(0))])
            .collect();
        crate::output::out(&format!("\n{}", table(&["node", "last seen ago"], &rows)));
    }
    Ok(ExitCode::SUCCESS)
}

/// `orch costs`: the cost report (`GET /costs`) as three tables: by repo, stage and day.
pub async fn costs(cx: &Context) -> Result<ExitCode> {
    let store = cx.open_store().await?;
    let rows = store.usage_by_repo_stage_day().await;
    store.close().await;
    let report = dto::CostReport::new(&rows.context("reading the agent runs' costs")?);
    if cx.json {
        print_json(&dto::to_json(&report));
        return Ok(ExitCode::SUCCESS);
    }
    let line = |key: &str, u: &dto::UsageDto| {
        vec![
            key.to_owned(),
            u.runs.to_string(),
            u.input_tokens.to_string(),
            u.output_tokens.to_string(),
            u.cost_text(),
        ]
    };
    for (title, groups) in [
        ("repo", &report.by_repo),
        ("stage", &report.by_stage),
        ("day (UTC)", &report.by_day),
    ] {
        let rows: Vec<Vec<String>> = groups.iter().map(|g| line(&g.key, &g.usage)).collect();
        crate::output::out(&table(
            &[title, "runs", "tokens in", "tokens out", "cost"],
            &rows,
        ));
        crate::output::outln("");
    }
    crate::output::outln(&format!(
        "total: {} runs, {} tokens in, {} out, cost {}",
        report.total.runs,
        report.total.input_tokens,
        report.total.output_tokens,
        report.total.cost_text()
    ));
    Ok(ExitCode::SUCCESS)
}
