//! `orch deploys REPO`: the repo's deploy history, items in flight and lessons, read from the
//! database. `--json` prints the same document as `GET /repos/{repo}/deploys`.

use std::process::ExitCode;

use anyhow::{Context as _, Result};

use crate::context::Context;
use crate::output::{print_json, table};

pub async fn run(cx: &Context, repo: &str) -> Result<ExitCode> {
    let repo: orch_domain::ids::RepoName = repo.parse()?;
    let store = cx.open_store().await?;
    let doc = orch_api::repo_deploys(&store, repo.as_str()).await;
    store.close().await;
    let doc = doc?.with_context(|| format!("repo {repo} has no work items"))?;
    if cx.json {
        print_json(&serde_json::to_value(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    crate::output::outln(&format!("repo {repo}\n"));
    if doc.deploys.is_empty() {
        crate::output::outln("no production deploy recorded yet");
    } else {
        let rows: Vec<Vec<String>> = doc
            .deploys
            .iter()
            .rev()
            .map(|d| {
                let items: Vec<String> = d
                    .items
                    .iter()
                    .map(|i| match i.change.as_str() {
                        "merge" | "" => i.work_item.clone(),
                        c => format!("{} ({c})", i.work_item),
                    })
                    .collect();
                let mut after = Vec::new();
                if d.rolled_back {
                    after.push("rolled back".to_owned());
                }
                if d.rollback_failed {
                    after.push("rollback failed".to_owned());
                }
                for r in &d.reverts {
                    after.push(format!("reverted {}", r.work_item));
                }
                vec![
                    jiff_time(d.at_ms),
                    d.revision
                        .as_deref()
                        .unwrap_or_default()
                        .chars()
                        .take(12)
                        .collect(),
                    items.join(", "),
                    d.verdict.clone().unwrap_or_default(),
                    after.join("; "),
                ]
            })
            .collect();
        crate::output::out(&table(
            &["deployed", "revision", "shipped", "watch", "afterwards"],
            &rows,
        ));
    }
    crate::output::outln(&format!(
        "\nin flight: {}",
        if doc.in_flight.is_empty() {
            "none".to_owned()
        } else {
            doc.in_flight
                .iter()
                .map(|t| format!("{} ({})", t.work_item_id, t.stage))
                .collect::<Vec<_>>()
                .join(", ")
        }
    ));
    if !doc.lessons.is_empty() {
        crate::output::outln("\nlessons:");
        for l in doc.lessons.iter().take(10) {
            crate::output::outln(&format!("  {}  {}", l.work_item, l.message));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Epoch ms as `YYYY-MM-DD HH:MM:SSZ`.
fn jiff_time(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| t.strftime("%Y-%m-%d %H:%M:%SZ").to_string())
        .unwrap_or_else(|_| ms.to_string())
}
