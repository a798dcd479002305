//! `orch-bench report`: how long `orch report` takes over a store of N finished work items
//! (10,000 by default), on SQLite and PostgreSQL. The items are written through the store
//! (`orch_store::testing::seed_item`), cycling the five in-range shapes of the report tests'
//! history (shipped with a review loop and a release-track wait; rolled back; reverted; a
//! staging change failure then an infrastructure defer, shipped; failed at staging for the
//! infrastructure), one submitted every `--minutes-apart`, all within the report's range
//! (PostgreSQL seeds with `synchronous_commit = off`: the figure is the read's). The
//! figures: the wall time of the real binary (`orch report --json --since … --until …`, process
//! start to exit, so connecting and printing are in it; its clock is the real one, the range is
//! given) and of the store read plus the
//! computation in this process, each the median (and slowest) of `--runs` runs. Printed, never
//! asserted.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context as _, Result};
use orch_store::testing::{report_history, seed_item};
use orch_store::{ConnectOptions, ManualClock, Store};

use crate::cli::BenchReportArgs;
use crate::queue::{fresh_target_at, selected};
use crate::{Context, print_json};

/// 2026-12-01T00:00:00Z: where the seeded history starts.
const D: i64 = 1_796_083_200_000;
const H: i64 = 3_600_000;

pub async fn report(cx: &Context, args: BenchReportArgs) -> Result<ExitCode> {
    let mut results = Vec::new();
    for backend in selected(args.backend) {
        let target = fresh_target_at(backend, &args.pg_url).await?;
        let clock = ManualClock::new(D);
        // Seeding only: PostgreSQL commits without waiting for the disk (the report is a read).
        let seed_url = if backend == "postgres" {
            format!("{}&options[synchronous_commit]=off", target.url)
        } else {
            target.url.clone()
        };
        let store = Store::connect(
            &seed_url,
            ConnectOptions {
                create_if_missing: true,
                max_connections: 4,
                clock: clock.clone(),
                ..ConnectOptions::default()
            },
        )
        .await
        .with_context(|| format!("opening the {backend} bench store"))?;
        store.migrate().await?;
        let t0 = Instant::now();
        // The five in-range shapes (the sixth is before the range), each shifted so items
        // follow one another.
        let shapes: Vec<_> = report_history(0).into_iter().take(5).collect();
        let apart = (args.minutes_apart * 60_000.0) as i64;
        for n in 0..args.items {
            let mut item = shapes[n % shapes.len()].clone();
            let shift = D + n as i64 * apart - item.created;
            item.created += shift;
            for e in &mut item.events {
                e.0 += shift;
            }
            if let Some(end) = &mut item.end {
                end.0 += shift;
            }
            seed_item(&store, &clock, "BENCH", &item)
                .await
                .with_context(|| format!("seeding item {n}"))?;
        }
        store.refresh_statistics().await?;
        let seeded_s = t0.elapsed().as_secs_f64();
        let until = D + args.items as i64 * apart + 48 * H;
        let since = D.to_string();
        let until_s = until.to_string();
        store.close().await;
        // In process: the store's read and the computation, on a store opened afresh (as the
        // binary opens it).
        let store = Store::connect(&target.url, ConnectOptions::default())
            .await
            .with_context(|| format!("reopening the {backend} bench store"))?;
        let range = orch_domain::report::Range::new(D, until).map_err(anyhow::Error::msg)?;
        let mut inproc = Vec::new();
        let mut shipped = 0;
        for _ in 0..args.runs {
            let t = Instant::now();
            let r = store.report(range, None).await?;
            inproc.push(t.elapsed().as_secs_f64() * 1000.0);
            shipped = r.overall.shipped;
        }
        store.close().await;
        // The real binary.
        let mut binary = Vec::new();
        for _ in 0..args.runs {
            let t = Instant::now();
            let out = tokio::process::Command::new(&cx.orch)
                .args(["report", "--json", "--since", &since, "--until", &until_s])
                .env("ORCH_DATABASE_URL", &target.url)
                .env("ORCH_CONFIG", "/nonexistent/orch.toml")
                .output()
                .await
                .context("running orch report")?;
            binary.push(t.elapsed().as_secs_f64() * 1000.0);
            anyhow::ensure!(
                out.status.success(),
                "orch report failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let (bin_med, bin_max) = median_max(&mut binary);
        let (in_med, in_max) = median_max(&mut inproc);
        eprintln!(
            "{backend:<8} {} finished items ({shipped} shipped; seeded in {seeded_s:.1} s): orch report --json median {bin_med:.0} ms (slowest {bin_max:.0} ms); store read + computation median {in_med:.0} ms (slowest {in_max:.0} ms), {} runs",
            args.items, args.runs
        );
        results.push(serde_json::json!({
            "backend": backend, "items": args.items, "shipped": shipped, "runs": args.runs,
            "binary_median_ms": bin_med, "binary_max_ms": bin_max,
            "in_process_median_ms": in_med, "in_process_max_ms": in_max,
            "seed_seconds": seeded_s,
        }));
    }
    if cx.json {
        print_json(&serde_json::json!({ "report": results }));
    }
    Ok(ExitCode::SUCCESS)
}

fn median_max(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let med = v.get(v.len() / 2).copied().unwrap_or(f64::NAN);
    let max = v.last().copied().unwrap_or(f64::NAN);
    (med, max)
}
