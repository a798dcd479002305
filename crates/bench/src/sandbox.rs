//! `orch-bench sandbox`: what the sandbox costs one run, start to teardown (spawn, the
//! namespaces and mounts, the cgroup, the relay when the network is an allowlist, the wait and
//! the clean-up), against the same command run directly, in the same run: rounds alternate the
//! modes so the machine's noise falls on all of them alike.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use orch_exec::process::{Cmd, run};
use orch_exec::sandbox::{self, Endpoint, Init, Network, Sandbox};

use crate::Context;

/// The modes compared.
const MODES: [&str; 3] = ["direct", "sandbox", "sandbox+allowlist"];

pub async fn sandbox(cx: &Context, runs: usize) -> Result<()> {
    let version = sandbox::probe(Path::new("bwrap"))
        .map_err(|why| anyhow::anyhow!("the sandbox cannot run here: {why}"))?;
    let work = tempfile::tempdir().context("cannot create a work dir")?;
    let mut plain = Sandbox::new();
    plain.writable = vec![work.path().to_owned()];
    plain.init = None;
    let mut allow = plain.clone();
    allow.init = Some(Init {
        program: cx.orch.clone(),
        args: vec![sandbox::INIT_ARG.into()],
    });
    allow.network = Network::Allow(vec![
        Endpoint::parse("127.0.0.1:10009").map_err(anyhow::Error::msg)?,
    ]);
    let (plain, allow) = (Arc::new(plain), Arc::new(allow));
    let cmd = |mode: &str| {
        let base = Cmd::new("true")
            .cwd(work.path())
            .env_allow(Vec::<String>::new());
        match mode {
            "sandbox" => base.sandbox(plain.clone()),
            "sandbox+allowlist" => base.sandbox(allow.clone()),
            _ => base,
        }
    };
    let title =
        format!("sandbox cost per run of `true` ({version}, {runs} rounds, modes alternated):");
    let rows = alternate(&title, &MODES, runs, |mode| {
        let c = cmd(mode);
        async move {
            let t0 = Instant::now();
            let out = run(&c)
                .await
                .with_context(|| format!("{mode}: cannot run"))?;
            let took = t0.elapsed();
            anyhow::ensure!(out.success(), "{mode}: {}", out.tail_text(10));
            Ok(took)
        }
    })
    .await?;
    println!("  limits here: {}", sandbox::limits_support());
    if cx.json {
        crate::print_json(&serde_json::json!({ "bwrap": version, "runs": runs, "modes": rows }));
    }
    Ok(())
}

/// Runs `one(mode)` for every mode, `runs` rounds after one warm-up round, the modes alternated
/// so the machine's noise falls on all alike; prints p50/p95 per mode and its p50 ratio to the
/// first mode under `title`; returns the rows for `--json`.
pub async fn alternate<F, Fut>(
    title: &str,
    modes: &[&'static str],
    runs: usize,
    mut one: F,
) -> Result<Vec<serde_json::Value>>
where
    F: FnMut(&'static str) -> Fut,
    Fut: std::future::Future<Output = Result<Duration>>,
{
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); modes.len()];
    for round in 0..=runs {
        for (i, mode) in modes.iter().enumerate() {
            let took = one(mode).await?;
            if round > 0 {
                times[i].push(took);
            }
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let pct = |v: &mut Vec<Duration>, p: f64| {
        v.sort();
        v.get(((v.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    let mut rows = Vec::new();
    let base_p50 = ms(pct(&mut times[0].clone(), 0.5));
    println!("{title}");
    println!(
        "  {:<20} {:>9} {:>9} {:>14}",
        "mode", "p50 ms", "p95 ms", "p50 / first"
    );
    for (i, mode) in modes.iter().enumerate() {
        let (p50, p95) = (ms(pct(&mut times[i], 0.5)), ms(pct(&mut times[i], 0.95)));
        println!(
            "  {mode:<20} {p50:>9.2} {p95:>9.2} {:>14.1}",
            p50 / base_p50
        );
        rows.push(serde_json::json!({"mode": mode, "p50_ms": p50, "p95_ms": p95, "ratio_p50": p50 / base_p50}));
    }
    Ok(rows)
}
