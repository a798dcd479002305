//! `orch-bench workers`: queue throughput as real `orch worker` processes are added on one
//! PostgreSQL. Each round drains the same bulk-enqueued no-op jobs once per process count (the
//! drain of [`queue::throughput`]: spawn to empty queue, start-up included), each in a fresh
//! database, and divides every count's jobs/s by the one-process figure of the same round, so a
//! ratio never compares hours of a shared machine. The figures are the medians over rounds.

use std::process::ExitCode;

use anyhow::Result;

use crate::cli::BenchWorkersArgs;
use crate::queue::{self, Target, percentile, round2};
use crate::{Context, print_json};

pub async fn workers(cx: &Context, args: BenchWorkersArgs) -> Result<ExitCode> {
    anyhow::ensure!(!args.processes.is_empty(), "--processes lists no count");
    let mut results = Vec::new();
    let mut seq = 0usize;
    for &batch in &args.claim_batch {
        let mode = if batch == 1 { "per-job" } else { "batched" };
        // jobs/s and ratio to the first count, per count, over rounds.
        let mut per_s: Vec<Vec<f64>> = vec![Vec::new(); args.processes.len()];
        let mut ratio: Vec<Vec<f64>> = vec![Vec::new(); args.processes.len()];
        for round in 1..=args.rounds.max(1) {
            let mut reference = None;
            for (i, &procs) in args.processes.iter().enumerate() {
                seq += 1;
                let (target, db) = fresh_database(&args.pg_url, seq).await?;
                let r =
                    queue::throughput(cx, &target, args.jobs, procs, args.concurrency, batch).await;
                drop_database(&args.pg_url, &db).await;
                let r = r?;
                let base = *reference.get_or_insert(r.jobs_per_s);
                per_s[i].push(r.jobs_per_s);
                ratio[i].push(r.jobs_per_s / base);
                eprintln!(
                    "round {round} {mode:<8} {procs} x {} worker processes: drain {:>8.0} jobs/s  \
                     ({:.2}x {} process{})",
                    args.concurrency,
                    r.jobs_per_s,
                    r.jobs_per_s / base,
                    args.processes[0],
                    if args.processes[0] == 1 { "" } else { "es" }
                );
            }
        }
        for (i, &procs) in args.processes.iter().enumerate() {
            let (lo, hi) = (
                percentile(&mut per_s[i], 0.0),
                percentile(&mut per_s[i], 1.0),
            );
            let med = percentile(&mut per_s[i], 0.5);
            let r_lo = percentile(&mut ratio[i], 0.0);
            let r_hi = percentile(&mut ratio[i], 1.0);
            let r_med = percentile(&mut ratio[i], 0.5);
            eprintln!(
                "median {mode:<8} {procs} x {}: {med:>8.0} jobs/s ({lo:.0}-{hi:.0})  \
                 ratio {r_med:.2} ({r_lo:.2}-{r_hi:.2})",
                args.concurrency
            );
            results.push(serde_json::json!({
                "backend": "postgres", "mode": mode, "claim_batch": batch,
                "processes": procs, "concurrency": args.concurrency, "jobs": args.jobs,
                "rounds": per_s[i].len(), "jobs_per_s_median": med.round(),
                "jobs_per_s_min": lo.round(), "jobs_per_s_max": hi.round(),
                "ratio_median": round2(r_med), "ratio_min": round2(r_lo), "ratio_max": round2(r_hi),
            }));
        }
    }
    if cx.json {
        print_json(&serde_json::json!({ "workers": results }));
    }
    Ok(ExitCode::SUCCESS)
}

/// A fresh database on the server of `admin_url`, named for this process and `seq`.
pub(crate) async fn fresh_database(admin_url: &str, seq: usize) -> Result<(Target, String)> {
    let name = format!("orch_bench_{}_{seq}", std::process::id());
    orch_store::testing::ensure_database(admin_url, &name).await?;
    let base = admin_url
        .rsplit_once('/')
        .map(|(base, _)| base)
        .ok_or_else(|| anyhow::anyhow!("{admin_url} names no database"))?;
    Ok((
        Target {
            name: "postgres",
            url: format!("{base}/{name}"),
            _dir: None,
        },
        name,
    ))
}

pub(crate) async fn drop_database(admin_url: &str, name: &str) {
    if let Err(e) = orch_store::testing::drop_database(admin_url, name).await {
        eprintln!("orch-bench: cannot drop the scratch database {name}: {e}");
    }
}
