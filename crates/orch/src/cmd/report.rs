//! `orch report`: the delivery report (`GET /report`'s document), as a table or `--json`.

use std::process::ExitCode;

use anyhow::Result;
use orch_api::dto;

use crate::cli::ReportArgs;
use crate::context::Context;
use crate::exit::{Kind, fail};
use crate::output::{outln, print_json, table};

pub async fn run(cx: &Context, args: ReportArgs) -> Result<ExitCode> {
    let store = cx.open_store().await?;
    let now = store.now_ms();
    let report = dto::read_report(
        &store,
        args.repo.as_deref(),
        args.since.as_deref(),
        args.until.as_deref(),
        now,
    )
    .await;
    store.close().await;
    let report = match report {
        Ok(r) => r,
        Err(dto::ReportError::Input(m)) => return Err(fail(Kind::Invalid, m)),
        Err(dto::ReportError::Store(e)) => {
            return Err(anyhow::Error::new(e).context("reading the delivery report"));
        }
    };
    if cx.json {
        print_json(&dto::to_json(&report));
        return Ok(ExitCode::SUCCESS);
    }
    outln(&format!(
        "Delivery report {} → {} (UTC, end excluded){}",
        report.since,
        report.until,
        report
            .repo
            .as_ref()
            .map_or_else(String::new, |r| format!(", repo {r}"))
    ));
    outln("");
    let mut columns: Vec<(String, &dto::DeliveryFigures)> =
        vec![("all".to_owned(), &report.overall)];
    columns.extend(report.by_repo.iter().map(|r| (r.repo.clone(), &r.figures)));
    let mut header: Vec<&str> = vec!["figure"];
    header.extend(columns.iter().map(|(n, _)| n.as_str()));
    let row = |name: &str, f: fn(&dto::DeliveryFigures) -> String| {
        let mut r = vec![name.to_owned()];
        r.extend(columns.iter().map(|(_, c)| f(c)));
        r
    };
    let rows = vec![
        row("deploys", |f| f.dora.deploys.to_string()),
        row("deploys per day", |f| {
            format!("{:.2}", f.dora.deploys_per_day)
        }),
        row("lead time from submission (median)", |f| {
            dur(f.dora.lead_time_from_submission.median_ms)
        }),
        row("lead time from first commit (median)", |f| {
            dur(f.dora.lead_time_from_first_commit.median_ms)
        }),
        row("change failure rate", |f| {
            f.dora.change_failure_rate.map_or_else(
                || "—".to_owned(),
                |r| {
                    format!(
                        "{:.1}% ({} of {})",
                        r * 100.0,
                        f.dora.change_failures,
                        f.dora.deploys
                    )
                },
            )
        }),
        row("  rolled back / reverted", |f| {
            format!("{} / {}", f.dora.rolled_back, f.dora.reverted)
        }),
        row("time to restore (median)", |f| {
            dur(f.dora.time_to_restore.median_ms)
        }),
        row("  failures not restored", |f| f.dora.unrestored.to_string()),
        row("items ended / shipped", |f| {
            format!(
                "{} / {}",
                f.items.ended.values().sum::<u64>(),
                f.items.shipped
            )
        }),
        row("cost per shipped item", |f| {
            match (
                f.items.cost_per_shipped_usd,
                f.items.known_cost_per_shipped_usd,
            ) {
                (Some(c), _) => format!("${c:.4}"),
                (None, Some(k)) => format!(
                    "≥ ${k:.4} ({} runs of unknown cost)",
                    f.items.unknown_cost_runs
                ),
                (None, None) => "—".to_owned(),
            }
        }),
        row("agent runs per shipped item", |f| {
            ratio(f.items.agent_runs_per_shipped)
        }),
        row("review loops per shipped item", |f| {
            ratio(f.items.review_loops_per_shipped)
        }),
        row("staging: passed / change / infrastructure", |f| {
            format!(
                "{} / {} / {}",
                f.staging.passed, f.staging.change_failures, f.staging.infrastructure_errors
            )
        }),
        row("release-track wait (total, waits)", |f| {
            format!(
                "{} ({})",
                dur(Some(f.release_wait.total_ms)),
                f.release_wait.count
            )
        }),
    ];
    crate::output::out(&table(&header, &rows));
    let agents: Vec<Vec<String>> = report
        .overall
        .by_agent
        .iter()
        .map(|a| {
            vec![
                a.backend.clone(),
                a.model.clone().unwrap_or_else(|| "(default)".to_owned()),
                a.runs.to_string(),
                a.cost_usd.map_or_else(
                    || format!("≥ ${:.4}", a.known_cost_usd),
                    |c| format!("${c:.4}"),
                ),
                a.items.to_string(),
                a.shipped.to_string(),
                a.change_failures.to_string(),
            ]
        })
        .collect();
    if !agents.is_empty() {
        outln("");
        outln("By agent backend and model (items that ended in the range):");
        crate::output::out(&table(
            &[
                "backend",
                "model",
                "runs",
                "cost",
                "items",
                "shipped",
                "change failures",
            ],
            &agents,
        ));
    }
    if !report.stage_time.is_empty() {
        outln("");
        outln("Where time goes (items that ended in the range; per item, all its visits):");
        let stages: Vec<Vec<String>> = report
            .stage_time
            .iter()
            .map(|s| {
                vec![
                    s.stage.clone(),
                    s.time.count.to_string(),
                    dur(Some(s.time.total_ms)),
                    dur(s.time.median_ms),
                    dur(s.time.p90_ms),
                ]
            })
            .collect();
        crate::output::out(&table(
            &["stage", "items", "total", "median", "p90"],
            &stages,
        ));
    }
    if report.weekly.len() > 1 {
        outln("");
        outln("Per week (Monday, UTC):");
        let weeks: Vec<Vec<String>> = report
            .weekly
            .iter()
            .map(|w| {
                vec![
                    w.since.get(..10).unwrap_or(&w.since).to_owned(),
                    w.deploys.to_string(),
                    w.change_failures.to_string(),
                    dur(w.lead_time_from_submission.median_ms),
                    w.shipped.to_string(),
                ]
            })
            .collect();
        crate::output::out(&table(
            &[
                "week of",
                "deploys",
                "change failures",
                "lead time (median)",
                "shipped",
            ],
            &weeks,
        ));
    }
    Ok(ExitCode::SUCCESS)
}

/// `3h 05m`, `12m 30s`, `45s`; `—` when there is none.
fn dur(ms: Option<i64>) -> String {
    let Some(ms) = ms else {
        return "—".to_owned();
    };
    let s = ms / 1000;
    match s {
        s if s >= 86_400 => format!("{}d {:02}h", s / 86_400, s % 86_400 / 3_600),
        s if s >= 3_600 => format!("{}h {:02}m", s / 3_600, s % 3_600 / 60),
        s if s >= 60 => format!("{}m {:02}s", s / 60, s % 60),
        s => format!("{s}s"),
    }
}

fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "—".to_owned(), |r| format!("{r:.2}"))
}
