//! `orch replay`: every decision of a work item (or of a repo's items in a range) re-derived
//! from what was recorded, with today's rules (`orch_domain::replay`), as a table or `--json`.
//!
//! This side only reads: the item's events from the store, and the files of its folder as
//! committed with each stage change from orch's clone (`git ls-tree`/`cat-file`, never a
//! fetch, a checkout or a write). The domain decides.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use orch_api::dto;
use orch_domain::control::events;
use orch_domain::ids::{RepoName, WorkItemId};
use orch_domain::payload;
use orch_domain::replay::{
    Agreement, ItemRecord, Overrides, Replayed, StageChange, Summary, replay_item,
};
use orch_exec::git::Git;
use orch_store::{Event, Store, Task};
use serde_json::Value;

use crate::cli::ReplayArgs;
use crate::context::Context;
use crate::exit::{Kind, fail};
use crate::output::{outln, print_json, table};

/// The events that change a task's stage after a gate: they carry `from`, `to`, the gate's
/// value and the stage's commit.
const STAGE_CHANGES: [&str; 4] = [
    events::STAGE_ADVANCED,
    events::STAGE_LOOP_BACK,
    events::TASK_DONE,
    events::TASK_FAILED,
];

pub async fn run(cx: &Context, args: ReplayArgs) -> Result<ExitCode> {
    let overrides =
        Overrides::parse(&args.set).map_err(|e| fail(Kind::Invalid, format!("--set: {e}")))?;
    let config = cx.require_config()?;
    let pipeline = config
        .pipeline()
        .map_err(|e| fail(Kind::Config, format!("invalid pipeline in orch.toml: {e}")))?;
    let repos_dir = cx.repos_dir(config);
    let store = cx.open_store().await?;
    let read = read_items(&store, &args).await;
    store.close().await;
    let (tasks, range) = read?;
    let git = Git::new();
    let mut items: Vec<(Task, Vec<Replayed>)> = Vec::new();
    for (task, history) in tasks {
        let limit = config
            .repos
            .get(&task.repo)
            .map_or(orch_domain::staging::DEFAULT_DEFER_LIMIT, |r| {
                r.staging_defer_limit
            });
        let record = record_of(&git, &repos_dir, &task, &history, limit).await?;
        let mut decisions = replay_item(&pipeline, &record, &overrides);
        if let Some((since, until)) = range {
            decisions.retain(|d| (since..until).contains(&d.at_ms));
        }
        items.push((task, decisions));
    }
    let all: Vec<&Replayed> = items.iter().flat_map(|(_, d)| d).collect();
    let summary = Summary::of(all.iter().copied());
    let disagrees = summary.differ > 0;
    if cx.json {
        let rfc = |ms: i64| orch_domain::text::rfc3339_utc(ms);
        let doc = dto::ReplayReport {
            overrides: overrides
                .pairs()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect::<BTreeMap<_, _>>(),
            since: range.map(|(s, _)| rfc(s)),
            until: range.map(|(_, u)| rfc(u)),
            repo: args.repo.clone(),
            items: items
                .iter()
                .map(|(t, d)| dto::ReplayItem {
                    work_item_id: t.work_item_id.to_string(),
                    repo: t.repo.to_string(),
                    decisions: d.iter().map(dto::ReplayDecision::from_domain).collect(),
                })
                .collect(),
            summary: dto::ReplaySummary::from_domain(
                u32::try_from(items.len()).unwrap_or(u32::MAX),
                &summary,
            ),
        };
        print_json(&dto::to_json(&doc));
    } else {
        print_text(&items, &overrides, &summary, range);
    }
    // A disagreement fails CI; with `--set` a difference is the answer asked for.
    Ok(if disagrees && overrides.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The tasks to replay with their events: one item, or a repo's items alive in the range.
async fn read_items(
    store: &Store,
    args: &ReplayArgs,
) -> Result<(Vec<(Task, Vec<Event>)>, Option<(i64, i64)>)> {
    let (tasks, range) = match (&args.id, &args.repo) {
        (Some(id), _) => {
            let id: WorkItemId = id
                .parse()
                .map_err(|e| fail(Kind::Invalid, format!("{e}")))?;
            let task = store
                .get_task_by_work_item(id.as_str())
                .await?
                .ok_or_else(|| fail(Kind::NotFound, format!("no work item {id}")))?;
            (vec![task], None)
        }
        (None, Some(repo)) => {
            let repo: RepoName = repo
                .parse()
                .map_err(|e| fail(Kind::Invalid, format!("{e}")))?;
            let now = store.now_ms();
            let parse = |s: &str| {
                orch_domain::report::parse_instant(s, now).map_err(|m| fail(Kind::Invalid, m))
            };
            let until = args.until.as_deref().map(parse).transpose()?.unwrap_or(now);
            let since = match args.since.as_deref() {
                Some(s) => parse(s)?,
                None => until.saturating_sub(30 * 86_400_000),
            };
            if since >= until {
                return Err(fail(Kind::Invalid, "--since must be before --until"));
            }
            let tasks = store
                .tasks_alive_in(since, until, Some(repo.as_str()))
                .await
                .with_context(|| format!("listing the items of repo {repo}"))?;
            (tasks, Some((since, until)))
        }
        (None, None) => {
            return Err(fail(Kind::Usage, "give a work item id or --repo"));
        }
    };
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        let history = store
            .task_events(task.id)
            .await
            .with_context(|| format!("reading the events of {}", task.work_item_id))?;
        out.push((task, history));
    }
    Ok((out, range))
}

/// The item's record for the domain: each recorded stage change with the files of the
/// item's folder as committed with it.
async fn record_of(
    git: &Git,
    repos_dir: &Path,
    task: &Task,
    history: &[Event],
    staging_defer_limit: u32,
) -> Result<ItemRecord> {
    let work_item = &task.work_item_id;
    let clone = Some(orch_runner::repos::RepoPaths::new(repos_dir, &task.repo).repo_dir);
    let folder = work_item.artifact_dir();
    let mut changes = Vec::new();
    let mut loops = 0u32;
    let mut watch: Option<(String, String)> = None;
    // The last commit a stage change was read at: the branch's state before the next change.
    let mut prev: Option<String> = None;
    for e in history {
        let data: Value = serde_json::from_str(&e.data).unwrap_or(Value::Null);
        let s = |k: &str| data.get(k).and_then(Value::as_str).map(str::to_owned);
        if e.kind == events::POST_DEPLOY_VERDICT {
            watch = s("verdict").map(|v| (v, s("action").unwrap_or_default()));
        }
        // Only the engine's stage changes read a gate (they record `commit`, maybe `null`).
        let change = STAGE_CHANGES
            .contains(&e.kind.as_str())
            .then(|| payload::read_value::<payload::StageChange>(&data))
            .flatten()
            .filter(|c| c.commit.is_some());
        let Some(change) = change else {
            if e.kind == events::STAGE_LOOP_BACK {
                loops += 1;
            }
            continue;
        };
        let terminal = matches!(e.kind.as_str(), events::TASK_DONE | events::TASK_FAILED);
        let gate_value = if terminal {
            change.result
        } else {
            change.outcome
        };
        let (Some(from), Some(to), Some(outcome)) = (change.from, change.to, gate_value) else {
            continue;
        };
        let files = match &clone {
            None => Err(format!("the repo name {:?} is not valid", task.repo)),
            Some(dir) => {
                // No commit recorded: the stage committed nothing new (a re-gate after a wait
                // for the release track, an attempt after a crash that had committed): the
                // gate read the branch as it stood.
                let commit = match change.commit.flatten() {
                    Some(c) => object_id(&c),
                    None => branch_head_at(git, dir, work_item, prev.as_deref(), &from).await,
                };
                match commit {
                    Ok(c) => {
                        let files = files_at(git, dir, &c, &folder).await;
                        prev = Some(c);
                        files
                    }
                    Err(why) => Err(why),
                }
            }
        };
        changes.push(StageChange {
            event_id: e.id,
            at_ms: e.created_at,
            watch_event: if from == "observe" {
                watch.take()
            } else {
                None
            },
            from,
            to,
            outcome,
            loops_before: loops,
            files,
        });
        if e.kind == events::STAGE_LOOP_BACK {
            loops += 1;
        }
    }
    Ok(ItemRecord {
        work_item: work_item.clone(),
        staging_defer_limit,
        changes,
    })
}

/// A recorded commit, checked to be an object id before it reaches a git command line.
fn object_id(commit: &str) -> std::result::Result<String, String> {
    if (7..=64).contains(&commit.len()) && commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(commit.to_owned())
    } else {
        Err(format!(
            "the recorded commit `{}` is not an object id",
            orch_domain::text::escape(commit)
        ))
    }
}

/// The branch `orch/<id>` as the gate of a stage change that recorded no commit read it: the
/// commits of this item and stage that follow `prev` (the commit the previous change was read
/// at), the last of them; else `prev` itself (the stage committed nothing at all).
async fn branch_head_at(
    git: &Git,
    dir: &Path,
    work_item: &WorkItemId,
    prev: Option<&str>,
    stage: &str,
) -> std::result::Result<String, String> {
    let branch = work_item.branch_name();
    if !dir.join(".git").exists() && !dir.join("HEAD").exists() {
        return Err(format!("orch's clone is not at {}", dir.display()));
    }
    let range = prev.map_or_else(|| branch.clone(), |p| format!("{p}..{branch}"));
    let commits = git.commit_messages(dir, &range).await.map_err(|e| {
        format!("the stage change recorded no commit, and `{branch}` cannot be read: {e}")
    })?;
    let item = format!("Work-Item: {work_item}");
    let of_stage = format!("Stage: {stage}");
    let mut head = prev.map(str::to_owned);
    for (sha, message) in commits.iter().rev() {
        if !message.lines().any(|l| l.trim() == item) {
            continue;
        }
        if !message.lines().any(|l| l.trim() == of_stage) {
            break;
        }
        head = Some(sha.clone());
    }
    head.ok_or_else(|| {
        format!("the stage change recorded no commit, and `{branch}` has none of stage {stage}")
    })
}

/// The files directly in `folder` as committed at `commit` in orch's clone `dir`, by name;
/// why not, when they cannot be read.
async fn files_at(
    git: &Git,
    dir: &Path,
    commit: &str,
    folder: &str,
) -> std::result::Result<Vec<(String, String)>, String> {
    if !dir.join(".git").exists() && !dir.join("HEAD").exists() {
        return Err(format!("orch's clone is not at {}", dir.display()));
    }
    match git.rev_parse(dir, &format!("{commit}^{{commit}}")).await {
        Ok(Some(_)) => {}
        Ok(None) => {
            return Err(format!(
                "commit {commit} is not in orch's clone at {}",
                dir.display()
            ));
        }
        Err(e) => return Err(format!("reading commit {commit}: {e}")),
    }
    let prefix = format!("{folder}/");
    match git.files_at(dir, commit, folder).await {
        Ok(files) => Ok(files
            .into_iter()
            .filter_map(|(path, text)| {
                let name = path.strip_prefix(&prefix)?;
                (!name.contains('/')).then(|| (name.to_owned(), text))
            })
            .collect()),
        Err(e) => Err(format!("reading {folder} at {commit}: {e}")),
    }
}

fn print_text(
    items: &[(Task, Vec<Replayed>)],
    overrides: &Overrides,
    summary: &Summary,
    range: Option<(i64, i64)>,
) {
    let rfc = orch_domain::text::rfc3339_utc;
    if let Some((since, until)) = range {
        outln(&format!(
            "Replay {} → {} (UTC, end excluded)",
            rfc(since),
            rfc(until)
        ));
    }
    let set = overrides.pairs();
    if set.is_empty() {
        outln("Rules: today's (no --set)");
    } else {
        let set: Vec<String> = set.iter().map(|(k, v)| format!("{k}={v}")).collect();
        outln(&format!("Rules: today's with {}", set.join(", ")));
    }
    for (task, decisions) in items {
        outln("");
        outln(&format!("{} ({})", task.work_item_id, task.repo));
        if decisions.is_empty() {
            outln("  no recorded decision");
            continue;
        }
        let rows: Vec<Vec<String>> = decisions
            .iter()
            .map(|d| {
                vec![
                    match d.agreement {
                        Agreement::Agrees => "ok".to_owned(),
                        Agreement::Differs => "DIFFERS".to_owned(),
                        Agreement::Unreplayable => "CANNOT".to_owned(),
                    },
                    d.kind.as_str().to_owned(),
                    d.what.clone(),
                    d.recorded.clone(),
                    d.replayed.clone(),
                ]
            })
            .collect();
        crate::output::out(&table(
            &["", "rule", "decision", "recorded", "replayed"],
            &rows,
        ));
        for d in decisions
            .iter()
            .filter(|d| d.agreement == Agreement::Differs)
        {
            outln(&format!("  {}: {}", d.what, d.detail));
        }
    }
    outln("");
    outln(&format!(
        "{} decisions in {} items: {} agree, {} differ, {} cannot be replayed",
        summary.decisions,
        items.len(),
        summary.agree,
        summary.differ,
        summary.unreplayable
    ));
    if summary.watches > 0 {
        outln(&format!(
            "watches: {}; rollbacks recorded {}, replayed {}: {} avoided, {} added, {} undetermined",
            summary.watches,
            summary.rollbacks_recorded,
            summary.rollbacks_replayed,
            summary.rollbacks_avoided,
            summary.rollbacks_added,
            summary.rollbacks_undetermined
        ));
    }
}
