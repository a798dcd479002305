//! `orch-bench history`: how large the store grows with the work it has done, retention on and
//! off. N demo-shaped work items are written through the store (no agents, no git: only what
//! the store keeps of them), one after the other on a clock that moves `--hours-apart` per item:
//! each item is a task that passes the demo's eleven stages (a stage job each, claimed and
//! completed; a `stage.started` event and the stage change's event; an agent run with tokens and
//! cost at the five LLM stages), eight watch ticks at `observe` (the demo's 8 s window, 1 s
//! apart: one job each) and the job its end enqueues. With retention on, maintenance's prune runs
//! after every item, in its 500-job batches, with the default retention (3 days), as a serving
//! orch does once a minute. The figure is the store's size at the end (SQLite: the file's
//! pages, free ones included; PostgreSQL: the four tables with indexes and TOAST) and its rows.
//! On PostgreSQL it also reads the `jobs` table's dead row versions and size and how often
//! autovacuum ran on it, with the server's default autovacuum settings or, with
//! `--pg-tuned-autovacuum`, the README's per-table settings ("PostgreSQL upkeep for a busy
//! queue"). Printed, never asserted.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context as _, Result};
use orch_domain::control::{events, markers};
use orch_store::{
    AdvanceStage, AgentRunFinish, Claim, Clock as _, ConnectOptions, Fence, JobOutcome,
    ManualClock, NewAgentRun, NewEvent, NewJob, NewTask, Store, SystemClock, WorkItemSpec,
};

use crate::cli::BenchHistoryArgs;
use crate::pgbench;
use crate::queue::{Target, fresh_target_at, selected};
use crate::{Context, print_json};

/// The demo's stages, in order; the LLM ones run an agent.
const STAGES: [(&str, bool); 11] = [
    ("intake", false),
    ("analysis", true),
    ("architecture", true),
    ("implementation", true),
    ("review", true),
    ("verification", false),
    ("merge", false),
    ("staging", false),
    ("deploy", false),
    ("observe", false),
    ("lessons", true),
];
/// Watch ticks of one item (the demo's `window_s = 8`, `interval_s = 1`).
const TICKS: u32 = 8;
/// The default retention (`[settings] retention = "3d"`).
const RETENTION_MS: i64 = 3 * 24 * 3_600_000;
const PRUNE_BATCH: u32 = 500;

pub async fn history(cx: &Context, args: BenchHistoryArgs) -> Result<ExitCode> {
    let mut results = Vec::new();
    for backend in selected(args.backend) {
        for retention in [false, true] {
            let target = fresh_target_at(backend, &args.pg_url).await?;
            let tuned = backend == "postgres" && args.pg_tuned_autovacuum;
            let r = run(&target, args.items, args.hours_apart, retention, tuned).await?;
            eprintln!(
                "{backend:<8} {} items, retention {:<3}: {:>7.1} MiB  ({} jobs, {} events, {} agent runs; {} jobs pruned) in {:.1} s",
                args.items,
                if retention { "3d" } else { "off" },
                r.bytes as f64 / (1024.0 * 1024.0),
                r.jobs,
                r.events,
                r.agent_runs,
                r.pruned,
                r.seconds
            );
            if let Some(v) = &r.vacuum {
                eprintln!(
                    "{backend:<8}   jobs table ({} autovacuum settings, server autovacuum {}): {} live, {} dead row versions, {:.1} MiB with indexes, autovacuumed {} times",
                    if tuned { "tuned" } else { "default" },
                    if v.server_autovacuum { "on" } else { "off" },
                    v.live,
                    v.dead,
                    v.jobs_bytes as f64 / (1024.0 * 1024.0),
                    v.autovacuums
                );
            }
            results.push(serde_json::json!({
                "backend": target.name, "items": args.items, "hours_apart": args.hours_apart,
                "retention": if retention { "3d" } else { "off" },
                "database_bytes": r.bytes, "jobs": r.jobs, "events": r.events,
                "agent_runs": r.agent_runs, "jobs_pruned": r.pruned,
                "autovacuum": r.vacuum.as_ref().map(|_| if tuned { "tuned" } else { "default" }),
                "jobs_live_tuples": r.vacuum.as_ref().map(|v| v.live),
                "jobs_dead_tuples": r.vacuum.as_ref().map(|v| v.dead),
                "jobs_table_bytes": r.vacuum.as_ref().map(|v| v.jobs_bytes),
                "jobs_autovacuums": r.vacuum.as_ref().map(|v| v.autovacuums),
                "server_autovacuum": r.vacuum.as_ref().map(|v| v.server_autovacuum),
                "seconds": r.seconds,
            }));
        }
    }
    if cx.json {
        print_json(&serde_json::json!({ "history": results }));
    }
    Ok(ExitCode::SUCCESS)
}

struct Run {
    bytes: i64,
    jobs: i64,
    events: i64,
    agent_runs: i64,
    pruned: i64,
    seconds: f64,
    vacuum: Option<Vacuum>,
}

/// PostgreSQL's view of the `jobs` table at the end of a run.
struct Vacuum {
    live: i64,
    dead: i64,
    jobs_bytes: i64,
    autovacuums: i64,
    /// The server's `autovacuum` setting (off: no table is vacuumed, whatever its settings).
    server_autovacuum: bool,
}

/// The README's per-table settings ("PostgreSQL upkeep for a busy queue"): a vacuum after a
/// small fraction of the table or a few hundred dead versions, whichever is more, unthrottled.
const TUNED: [&str; 2] = [
    "ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0.02, \
     autovacuum_vacuum_threshold = 500, autovacuum_vacuum_insert_scale_factor = 0.02, \
     autovacuum_vacuum_insert_threshold = 1000, autovacuum_analyze_scale_factor = 0.02, \
     autovacuum_analyze_threshold = 500, autovacuum_vacuum_cost_delay = 0)",
    "ALTER TABLE tasks SET (autovacuum_vacuum_scale_factor = 0.05, \
     autovacuum_analyze_scale_factor = 0.05)",
];

async fn vacuum_figures(target: &Target) -> Result<Vacuum> {
    // The statistics reach the cumulative view within a second of the last commit.
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    let out = pgbench::psql(
        &target.url,
        &[
            "SELECT n_live_tup, n_dead_tup, pg_total_relation_size(relid), autovacuum_count, \
             CASE WHEN current_setting('autovacuum') = 'on' THEN 1 ELSE 0 END \
             FROM pg_stat_user_tables WHERE relid = 'jobs'::regclass",
        ],
    )
    .await?;
    let f: Vec<i64> = out
        .trim()
        .split('|')
        .map(|x| x.trim().parse::<i64>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("unexpected pg_stat_user_tables row {out:?}"))?;
    anyhow::ensure!(f.len() == 5, "unexpected pg_stat_user_tables row {out:?}");
    Ok(Vacuum {
        live: f[0],
        dead: f[1],
        jobs_bytes: f[2],
        autovacuums: f[3],
        server_autovacuum: f[4] == 1,
    })
}

async fn run(
    target: &Target,
    items: usize,
    hours_apart: f64,
    retention: bool,
    tuned: bool,
) -> Result<Run> {
    let t0 = Instant::now();
    let apart_ms = (hours_apart * 3_600_000.0) as i64;
    let start = SystemClock.now_ms() - apart_ms * items as i64;
    let clock = ManualClock::new(start);
    let store = Store::connect(
        &target.url,
        ConnectOptions {
            create_if_missing: true,
            max_connections: 4,
            clock: clock.clone(),
            ..ConnectOptions::default()
        },
    )
    .await?;
    store.migrate().await?;
    if tuned {
        pgbench::psql(&target.url, &TUNED).await?;
    }
    for i in 0..items {
        clock.set(start + apart_ms * i as i64);
        item(&store, &clock, i)
            .await
            .with_context(|| format!("item {i}"))?;
        if retention {
            loop {
                let p = store
                    .prune_finished(clock.now_ms() - RETENTION_MS, PRUNE_BATCH)
                    .await?;
                if p.jobs == 0 {
                    break;
                }
            }
        }
    }
    let r = Run {
        bytes: store.database_size().await?,
        jobs: store.count_all_jobs().await?,
        events: events_count(&store).await?,
        agent_runs: runs_count(&store).await?,
        pruned: store.pruned_total().await?,
        seconds: t0.elapsed().as_secs_f64(),
        vacuum: if target.name == "postgres" {
            Some(vacuum_figures(target).await?)
        } else {
            None
        },
    };
    store.close().await;
    Ok(r)
}

/// Every event, counted through the kinds' index (the bench's own figure, not a view).
async fn events_count(store: &Store) -> Result<i64> {
    let mut n = 0;
    for kind in [
        events::TASK_SUBMITTED,
        events::STAGE_STARTED,
        events::STAGE_ADVANCED,
        events::JOBS_PRUNED,
    ] {
        let mut after = 0;
        loop {
            let page = store.events_by_kind(kind, after, 10_000).await?;
            n += page.len() as i64;
            match page.last() {
                Some(e) if page.len() == 10_000 => after = e.id,
                _ => break,
            }
        }
    }
    Ok(n)
}

async fn runs_count(store: &Store) -> Result<i64> {
    Ok(store
        .usage_by_agent()
        .await?
        .iter()
        .map(|(_, u)| u.runs)
        .sum())
}

fn claim_all() -> Claim {
    Claim {
        worker_id: "bench-history".into(),
        limit: 100,
        lease_ms: 600_000,
        kinds: Vec::new(),
        node: None,
        node_grace_ms: None,
    }
}

/// Claims and completes every job due now; returns how many.
async fn drain(store: &Store) -> Result<usize> {
    let got = store.claim(&claim_all()).await?;
    let n = got.len();
    for c in got {
        store.mark_job(c.lease, JobOutcome::Done, None).await?;
    }
    Ok(n)
}

/// One demo-shaped work item, from submission to `done`.
async fn item(store: &Store, clock: &ManualClock, i: usize) -> Result<()> {
    let payload = |stage: &str, seq: i64| {
        serde_json::json!({ "stage": stage, "seq": seq, "work_item_id": format!("APP-{}", i + 1) })
            .to_string()
    };
    let mut task = store
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact(format!("APP-{}", i + 1).parse()?),
            repo: "service".parse()?,
            title: format!("note {i}: add a line to the notes"),
            body: "Write notes/<id>.txt with one line; the service's tests must pass.".into(),
            stage: STAGES[0].0.parse()?,
            branch_prefix: "orch/".into(),
            event: NewEvent::new(events::TASK_SUBMITTED, "submitted by the bench"),
            first_job: Some(NewJob::new(STAGES[0].0, payload(STAGES[0].0, 0))),
        })
        .await?;
    for (k, (stage, llm)) in STAGES.iter().enumerate() {
        clock.advance_ms(60_000);
        let got = store.claim(&claim_all()).await?;
        anyhow::ensure!(got.len() == 1, "stage {stage}: {} jobs due", got.len());
        let job = &got[0];
        let mut started = NewEvent::new(events::STAGE_STARTED, format!("{stage} started"));
        started.task_id = Some(task.id);
        started.job_id = Some(job.lease.job_id);
        started.stage = Some((*stage).to_owned());
        store.append_event(started).await?;
        if *llm {
            let run = store
                .start_agent_run(NewAgentRun {
                    task_id: task.id,
                    job_id: Some(job.lease.job_id),
                    stage: (*stage).to_owned(),
                    agent: (*stage).to_owned(),
                    backend: "demo".into(),
                    model: Some("demo-model".into()),
                    attempt: 1,
                })
                .await?;
            clock.advance_ms(30_000);
            store
                .finish_agent_run(
                    run,
                    AgentRunFinish {
                        outcome: "success".into(),
                        exit_code: Some(0),
                        input_tokens: Some(12_000),
                        output_tokens: Some(1_500),
                        cost_usd: Some(0.05),
                        error: None,
                        data: "{}".into(),
                    },
                )
                .await?;
        }
        if *stage == "observe" {
            for tick in 1..=TICKS {
                clock.advance_ms(1_000);
                store
                    .enqueue(
                        NewJob::new(
                            "post-deploy-monitor",
                            markers::monitor_tick(task.stage_seq, tick),
                        )
                        .task(task.id),
                    )
                    .await?;
            }
            drain(store).await?;
        }
        let next = STAGES.get(k + 1).map_or("done", |(s, _)| *s);
        let adv = store
            .advance_stage(AdvanceStage {
                task_id: task.id,
                expected_stage: stage.parse()?,
                new_stage: next.parse()?,
                fence: Fence::Seq(task.stage_seq),
                event: NewEvent::new(events::STAGE_ADVANCED, format!("{stage} → {next}")),
                next_job: (next != "done")
                    .then(|| NewJob::new(next, payload(next, task.stage_seq + 1))),
            })
            .await?;
        store.mark_job(job.lease, JobOutcome::Done, None).await?;
        task = adv.task;
    }
    // The job the end enqueued (task-ended: the notice and the trail).
    clock.advance_ms(1_000);
    drain(store).await?;
    Ok(())
}
