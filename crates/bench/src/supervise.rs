//! `orch-bench supervise`: what running a stage's command under orch's supervisor costs, start
//! to collected result, against the same command run directly, in the same run (modes
//! alternated): `supervised` starts the supervisor (orch's binary), hands it the command over a
//! pipe, and reads the result files it writes; `adopted` is what a restarted orch pays to take
//! the result of a command that ended while it was away.

use std::time::Instant;

use anyhow::{Context as _, Result};
use orch_exec::process::{Cmd, run};
use orch_exec::supervise::{self, Supervision};

use crate::Context;

/// The modes compared.
const MODES: [&str; 3] = ["direct", "supervised", "adopted"];
/// The job id the benchmark's keys use.
const JOB: i64 = 0;

pub async fn supervise(cx: &Context, runs: usize) -> Result<()> {
    let work = tempfile::tempdir().context("cannot create a work dir")?;
    supervise::enable_with(&work.path().join("supervised"), cx.orch.clone())
        .context("cannot enable supervision")?;
    let cmd = Cmd::new("true")
        .cwd(work.path())
        .env_allow(Vec::<String>::new());
    let mut n = 0u64;
    let title = format!(
        "a stage command's supervisor, per run of `true` ({runs} rounds, modes alternated):"
    );
    let rows = crate::sandbox::alternate(&title, &MODES, runs, |mode| {
        n += 1;
        let key = format!("j{JOB}.bench-{n}");
        let cmd = cmd.clone();
        async move {
            let keyed = cmd.clone().supervised(key);
            if mode == "adopted" {
                // The command ended while "orch was away": its record holds the result.
                run(&keyed)
                    .await
                    .with_context(|| format!("{mode}: cannot run"))?;
            }
            let t0 = Instant::now();
            let out = match mode {
                "direct" => run(&cmd).await,
                _ => run(&keyed).await,
            }
            .with_context(|| format!("{mode}: cannot run"))?;
            let took = t0.elapsed();
            anyhow::ensure!(out.success(), "{mode}: {}", out.tail_text(10));
            let expected = match mode {
                "direct" => Supervision::Direct,
                "supervised" => Supervision::Started,
                _ => Supervision::AdoptedFinished,
            };
            anyhow::ensure!(
                out.supervision == expected,
                "{mode}: ran as {:?}",
                out.supervision
            );
            supervise::forget_job(JOB);
            Ok(took)
        }
    })
    .await?;
    if cx.json {
        crate::print_json(&serde_json::json!({ "runs": runs, "modes": rows }));
    }
    Ok(())
}
