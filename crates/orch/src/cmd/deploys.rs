//! `orch deploys REPO`: the repo's deploy history, items in flight and lessons, read from the
//! database. `--json` prints the same document as `GET /repos/{repo}/deploys`.

use std::process::ExitCode;

use anyhow::{Context as _, Result};
use serde_json::Value;

use crate::context::Context;
use crate::output::{print_json, table};

pub async fn run(cx: &Context, repo: &str) -> Result<ExitCode> {
    let repo: orch_domain::ids::RepoName = repo.parse()?;
    let store = cx.open_store().await?;
    let doc = orch_api::repo_deploys_json(&store, repo.as_str()).await;
    store.close().await;
    let doc = doc?.with_context(|| format!("repo {repo} has no work items"))?;
    if cx.json {
        print_json(&doc);
        return Ok(ExitCode::SUCCESS);
    }
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    let list = |v: &Value, k: &str| {
        v.get(k)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    crate::output::outln(&format!("repo {repo}\n"));
    let deploys = list(&doc, "deploys");
    if deploys.is_empty() {
        crate::output::outln("no production deploy recorded yet");
    } else {
        let rows: Vec<Vec<String>> = deploys
            .iter()
            .rev()
            .map(|d| {
                let items: Vec<String> = list(d, "items")
                    .iter()
                    .map(|i| match s(i, "change").as_str() {
                        "merge" | "" => s(i, "work_item"),
                        c => format!("{} ({c})", s(i, "work_item")),
                    })
                    .collect();
                let mut after = Vec::new();
                if d.get("rolled_back").and_then(Value::as_bool) == Some(true) {
                    after.push("rolled back".to_owned());
                }
                if d.get("rollback_failed").and_then(Value::as_bool) == Some(true) {
                    after.push("rollback failed".to_owned());
                }
                for r in list(d, "reverts") {
                    after.push(format!("reverted {}", s(&r, "work_item")));
                }
                vec![
                    jiff_time(d.get("at_ms").and_then(Value::as_i64).unwrap_or(0)),
                    s(d, "revision").chars().take(12).collect(),
                    items.join(", "),
                    s(d, "verdict"),
                    after.join("; "),
                ]
            })
            .collect();
        crate::output::out(&table(
            &["deployed", "revision", "shipped", "watch", "afterwards"],
            &rows,
        ));
    }
    let in_flight = list(&doc, "in_flight");
    crate::output::outln(&format!(
        "\nin flight: {}",
        if in_flight.is_empty() {
            "none".to_owned()
        } else {
            in_flight
                .iter()
                .map(|t| format!("{} ({})", s(t, "work_item_id"), s(t, "stage")))
                .collect::<Vec<_>>()
                .join(", ")
        }
    ));
    let lessons = list(&doc, "lessons");
    if !lessons.is_empty() {
        crate::output::outln("\nlessons:");
        for l in lessons.iter().take(10) {
            crate::output::outln(&format!("  {}  {}", s(l, "work_item"), s(l, "message")));
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
