//! `orch-bench peers`: orch's queue and its peers' measured in the same run, interleaved, so no
//! ratio compares two hours (or days) of a shared machine. A round measures, each in a fresh
//! database dropped afterwards:
//!
//! - per-job drains: orch (`--claim-batch 1`) and graphile-worker (Node, its defaults);
//! - batched drains: orch (`--claim-batch 100`), graphile-worker with a local queue of 100 and
//!   batched completions, and the Rust port of graphile-worker likewise;
//! - pickup latency of orch (PostgreSQL) and both graphile-workers.
//!
//! Within a mode the order rotates from round to round, so no system always goes first. A drain
//! is the method of [`queue::throughput`]: N bulk-enqueued no-op jobs, then one worker process
//! with concurrency C, timed until the queue is empty (polled every 20 ms). orch's clock starts
//! at the worker's spawn; a peer's at `go`, after its process has loaded its modules and said
//! `ready` (the method its figures were published with; the spawn-to-ready time is printed
//! too). The peer programs and their protocol are in bench/peers/ (README.md); the script
//! scripts/bench-peers installs them. Figures are printed, never asserted.

use std::ffi::OsString;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};

use crate::cli::BenchPeersArgs;
use crate::queue::{self, Latency, percentile, round2};
use crate::scale::{drop_database, fresh_database};
use crate::{Context, print_json};

/// How a drain is done and what it is compared within.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    PerJob,
    Batched,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::PerJob => "per-job",
            Mode::Batched => "batched",
        }
    }
}

/// One of the systems measured.
#[derive(Debug, Clone)]
enum System {
    Orch,
    /// A peer program: the command that starts it (before its subcommand), and the program
    /// that watches its queue drain (`watch`).
    Peer {
        name: &'static str,
        program: Vec<OsString>,
        watcher: Vec<OsString>,
    },
}

impl System {
    fn name(&self) -> &'static str {
        match self {
            System::Orch => "orch",
            System::Peer { name, .. } => name,
        }
    }
}

/// The figures of one drain.
#[derive(Debug, Clone, Copy)]
struct Drain {
    enqueue_per_s: f64,
    jobs_per_s: f64,
    /// A peer's figure with its clock started at its spawn instead of at `go`.
    jobs_per_s_from_spawn: Option<f64>,
    /// A peer's spawn → `ready` (process start, module loading).
    ready_ms: Option<f64>,
}

pub async fn peers(cx: &Context, args: BenchPeersArgs) -> Result<ExitCode> {
    let node: OsString = args.node.clone().into();
    let mut per_job = vec![System::Orch];
    let mut batched = vec![System::Orch];
    let mut latency = vec![System::Orch];
    if let Some(gw) = &args.graphile_worker {
        anyhow::ensure!(gw.is_file(), "no graphile-worker peer at {}", gw.display());
        let program = vec![node.clone(), gw.clone().into()];
        let gw = System::Peer {
            name: "graphile-worker",
            program: program.clone(),
            watcher: program,
        };
        per_job.push(gw.clone());
        batched.push(gw.clone());
        latency.push(gw);
    }
    if let Some(rs) = &args.graphile_worker_rs {
        anyhow::ensure!(
            rs.is_file(),
            "no graphile-worker-rs peer at {}",
            rs.display()
        );
        // The Rust port keeps graphile-worker's tables: the Node program watches its drain.
        let gw = args.graphile_worker.as_ref().context(
            "--graphile-worker-rs needs --graphile-worker (its program watches the drain)",
        )?;
        let rs = System::Peer {
            name: "graphile-worker-rs",
            program: vec![rs.clone().into()],
            watcher: vec![node.clone(), gw.clone().into()],
        };
        // Per-job (no local queue) the port waits for its poll interval between jobs: 1 s by
        // default, a few jobs a second; only its batched mode is a throughput contender.
        batched.push(rs.clone());
        latency.push(rs);
    }
    eprintln!(
        "peers: {} rounds; drains of {} jobs, 1 process x {}; batched = claim batch {}; \
         latency {} samples; started {} (load average {})",
        args.rounds,
        args.jobs,
        args.concurrency,
        args.claim_batch,
        args.latency_jobs,
        utc_now(),
        loadavg()
    );
    let mut seq = 0usize;
    let mut drains: Vec<(usize, Mode, &'static str, Drain)> = Vec::new();
    let mut latencies: Vec<(usize, &'static str, Latency)> = Vec::new();
    for round in 1..=args.rounds.max(1) {
        eprintln!(
            "round {round} at {} (load average {})",
            utc_now(),
            loadavg()
        );
        for (mode, systems) in [(Mode::PerJob, &per_job), (Mode::Batched, &batched)] {
            for system in rotated(systems, round) {
                seq += 1;
                let d = drain(cx, &args, system, mode, seq).await.with_context(|| {
                    format!("round {round}: {} {} drain", system.name(), mode.name())
                })?;
                eprintln!(
                    "round {round} {:<8} {:<19} enqueue {:>8.0}/s  drain {:>7.0} jobs/s{}",
                    mode.name(),
                    system.name(),
                    d.enqueue_per_s,
                    d.jobs_per_s,
                    match (d.ready_ms, d.jobs_per_s_from_spawn) {
                        (Some(r), Some(s)) =>
                            format!("  (spawn to ready {r:.0} ms; from spawn {s:.0} jobs/s)"),
                        _ => String::new(),
                    }
                );
                drains.push((round, mode, system.name(), d));
            }
        }
        for system in rotated(&latency, round) {
            seq += 1;
            let l = pickup(&args, system, seq)
                .await
                .with_context(|| format!("round {round}: {} latency", system.name()))?;
            eprintln!(
                "round {round} latency  {:<19} p50 {:>5.2} ms  p95 {:>5.2} ms  p99 {:>5.2} ms  \
                 (enqueue call p50 {:.2} ms)",
                system.name(),
                l.p50,
                l.p95,
                l.p99,
                l.enqueue_p50
            );
            latencies.push((round, system.name(), l));
        }
        for (mode, systems) in [(Mode::PerJob, &per_job), (Mode::Batched, &batched)] {
            let of = |name: &str| {
                drains
                    .iter()
                    .find(|(r, m, n, _)| *r == round && *m == mode && *n == name)
                    .map(|(.., d)| d.jobs_per_s)
            };
            let Some(orch) = of("orch") else { continue };
            for peer in systems.iter().skip(1) {
                if let Some(p) = of(peer.name()) {
                    eprintln!(
                        "round {round} {:<8} orch / {:<19} {:.2}",
                        mode.name(),
                        peer.name(),
                        orch / p
                    );
                }
            }
        }
    }
    eprintln!("finished {} (load average {})", utc_now(), loadavg());
    let summary = summarize(&drains, &latencies, &per_job, &batched, &latency);
    if cx.json {
        print_json(&serde_json::json!({ "peers": summary }));
    }
    Ok(ExitCode::SUCCESS)
}

/// `systems` in round `round`'s order: rotated by one place a round.
fn rotated(systems: &[System], round: usize) -> Vec<&System> {
    let k = (round - 1) % systems.len().max(1);
    systems[k..].iter().chain(&systems[..k]).collect()
}

/// Medians over rounds (min–max in brackets), and the median of each round's orch/peer ratio.
fn summarize(
    drains: &[(usize, Mode, &'static str, Drain)],
    latencies: &[(usize, &'static str, Latency)],
    per_job: &[System],
    batched: &[System],
    latency: &[System],
) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for (mode, systems) in [(Mode::PerJob, per_job), (Mode::Batched, batched)] {
        for system in systems {
            let name = system.name();
            let runs: Vec<&Drain> = drains
                .iter()
                .filter(|(_, m, n, _)| *m == mode && *n == name)
                .map(|(.., d)| d)
                .collect();
            let mut rate: Vec<f64> = runs.iter().map(|d| d.jobs_per_s).collect();
            let mut enq: Vec<f64> = runs.iter().map(|d| d.enqueue_per_s).collect();
            let mut spawn: Vec<f64> = runs
                .iter()
                .filter_map(|d| d.jobs_per_s_from_spawn)
                .collect();
            // orch / this system, round by round.
            let mut ratio: Vec<f64> = drains
                .iter()
                .filter(|(_, m, n, _)| *m == mode && *n == name)
                .filter_map(|(r, _, _, d)| {
                    drains
                        .iter()
                        .find(|(r2, m2, n2, _)| r2 == r && *m2 == mode && *n2 == "orch")
                        .map(|(.., o)| o.jobs_per_s / d.jobs_per_s)
                })
                .collect();
            let (med, lo, hi) = spread(&mut rate);
            let (r_med, r_lo, r_hi) = spread(&mut ratio);
            eprintln!(
                "median {:<8} {name:<19} drain {med:>7.0} jobs/s ({lo:.0}-{hi:.0})  \
                 enqueue {:>8.0}/s{}{}",
                mode.name(),
                percentile(&mut enq, 0.5),
                if spawn.is_empty() {
                    String::new()
                } else {
                    format!("  from spawn {:.0} jobs/s", percentile(&mut spawn, 0.5))
                },
                if name == "orch" {
                    String::new()
                } else {
                    format!("  orch/{name} {r_med:.2} ({r_lo:.2}-{r_hi:.2})")
                }
            );
            out.push(serde_json::json!({
                "mode": mode.name(), "system": name, "rounds": rate.len(),
                "jobs_per_s_median": med.round(), "jobs_per_s_min": lo.round(),
                "jobs_per_s_max": hi.round(),
                "bulk_enqueue_per_s_median": percentile(&mut enq, 0.5).round(),
                "jobs_per_s_from_spawn_median": (!spawn.is_empty())
                    .then(|| percentile(&mut spawn, 0.5).round()),
                "orch_over_this_median": (name != "orch").then(|| round2(r_med)),
                "orch_over_this_min": (name != "orch").then(|| round2(r_lo)),
                "orch_over_this_max": (name != "orch").then(|| round2(r_hi)),
            }));
        }
    }
    for system in latency {
        let name = system.name();
        let runs: Vec<&Latency> = latencies
            .iter()
            .filter(|(_, n, _)| *n == name)
            .map(|(.., l)| l)
            .collect();
        let mut p50: Vec<f64> = runs.iter().map(|l| l.p50).collect();
        let mut p95: Vec<f64> = runs.iter().map(|l| l.p95).collect();
        let mut p99: Vec<f64> = runs.iter().map(|l| l.p99).collect();
        let mut enq: Vec<f64> = runs.iter().map(|l| l.enqueue_p50).collect();
        let (m50, lo50, hi50) = spread(&mut p50);
        let (m95, m99, menq) = (
            percentile(&mut p95, 0.5),
            percentile(&mut p99, 0.5),
            percentile(&mut enq, 0.5),
        );
        eprintln!(
            "median latency  {name:<19} p50 {m50:.2} ms ({lo50:.2}-{hi50:.2})  p95 {m95:.2}  \
             p99 {m99:.2}  enqueue call p50 {menq:.2} ms"
        );
        out.push(serde_json::json!({
            "mode": "latency", "system": name, "rounds": p50.len(),
            "p50_ms_median": round2(m50), "p50_ms_min": round2(lo50), "p50_ms_max": round2(hi50),
            "p95_ms_median": round2(m95), "p99_ms_median": round2(m99),
            "enqueue_call_p50_ms_median": round2(menq),
        }));
    }
    out
}

/// (median, min, max).
fn spread(v: &mut [f64]) -> (f64, f64, f64) {
    (percentile(v, 0.5), percentile(v, 0.0), percentile(v, 1.0))
}

async fn drain(
    cx: &Context,
    args: &BenchPeersArgs,
    system: &System,
    mode: Mode,
    seq: usize,
) -> Result<Drain> {
    let (target, db) = fresh_database(&args.pg_url, seq).await?;
    let result = match system {
        System::Orch => {
            let batch = match mode {
                Mode::PerJob => 1,
                Mode::Batched => args.claim_batch,
            };
            queue::throughput(cx, &target, args.jobs, 1, args.concurrency, batch)
                .await
                .map(|t| Drain {
                    enqueue_per_s: t.enqueue_per_s,
                    jobs_per_s: t.jobs_per_s,
                    jobs_per_s_from_spawn: None,
                    ready_ms: None,
                })
        }
        System::Peer {
            program, watcher, ..
        } => peer_drain(args, &target.url, program, watcher, mode).await,
    };
    drop_database(&args.pg_url, &db).await;
    result
}

async fn peer_drain(
    args: &BenchPeersArgs,
    url: &str,
    program: &[OsString],
    watcher: &[OsString],
    mode: Mode,
) -> Result<Drain> {
    run_to_end(program, url, &["migrate"], Duration::from_secs(120)).await?;
    let out = run_to_end(
        program,
        url,
        &["enqueue", &args.jobs.to_string()],
        Duration::from_secs(600),
    )
    .await?;
    let enqueue_s = last_json(&out)?
        .get("enqueue_s")
        .and_then(serde_json::Value::as_f64)
        .context("the peer's enqueue printed no enqueue_s")?;
    let spawned = Instant::now();
    let mut watch = Peer::spawn(watcher, url, &["watch"])?;
    let mut worker = Peer::spawn(
        program,
        url,
        &["worker", &args.concurrency.to_string(), mode.name()],
    )?;
    let ready_by = Duration::from_secs(60);
    worker.expect_line("ready", ready_by).await?;
    watch.expect_line("ready", ready_by).await?;
    let ready_ms = spawned.elapsed().as_secs_f64() * 1000.0;
    let go = Instant::now();
    worker.send("go").await?;
    watch.send("go").await?;
    tokio::select! {
        r = watch.expect_line("empty", Duration::from_secs(900)) => r?,
        status = worker.child.wait() => {
            let status = status.context("cannot watch the peer worker")?;
            anyhow::bail!(
                "the peer worker exited during the drain ({status}): {}",
                worker.stderr_tail().await
            );
        }
    }
    let (elapsed, from_spawn) = (go.elapsed(), spawned.elapsed());
    worker.finish().await;
    watch.finish().await;
    let n = args.jobs as f64;
    Ok(Drain {
        enqueue_per_s: n / enqueue_s,
        jobs_per_s: n / elapsed.as_secs_f64(),
        jobs_per_s_from_spawn: Some(n / from_spawn.as_secs_f64()),
        ready_ms: Some(ready_ms),
    })
}

async fn pickup(args: &BenchPeersArgs, system: &System, seq: usize) -> Result<Latency> {
    let (target, db) = fresh_database(&args.pg_url, seq).await?;
    let result = match system {
        System::Orch => queue::latency(&target, args.latency_jobs).await,
        System::Peer { program, .. } => peer_latency(args, &target.url, program).await,
    };
    drop_database(&args.pg_url, &db).await;
    result
}

async fn peer_latency(args: &BenchPeersArgs, url: &str, program: &[OsString]) -> Result<Latency> {
    run_to_end(program, url, &["migrate"], Duration::from_secs(120)).await?;
    let n = args.latency_jobs;
    let out = run_to_end(
        program,
        url,
        &["latency", &n.to_string()],
        Duration::from_secs(60 + n as u64 / 5),
    )
    .await?;
    let v = last_json(&out)?;
    let samples = |key: &str| -> Result<Vec<f64>> {
        let list = v
            .get(key)
            .and_then(serde_json::Value::as_array)
            .with_context(|| format!("the peer's latency printed no {key}"))?;
        list.iter()
            .map(|x| x.as_f64().context("a latency sample is not a number"))
            .collect()
    };
    let (mut pick, mut enq) = (samples("pickup_ms")?, samples("enqueue_ms")?);
    anyhow::ensure!(pick.len() == n, "{} of {n} latency samples", pick.len());
    Ok(Latency {
        p50: percentile(&mut pick, 0.50),
        p95: percentile(&mut pick, 0.95),
        p99: percentile(&mut pick, 0.99),
        enqueue_p50: percentile(&mut enq, 0.50),
    })
}

/// The last stdout line that is a JSON object.
fn last_json(out: &str) -> Result<serde_json::Value> {
    let line = out
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("no JSON line in the peer's output: {out}"))?;
    serde_json::from_str(line).with_context(|| format!("the peer printed bad JSON: {line}"))
}

fn command(program: &[OsString], url: &str, args: &[&str]) -> Result<tokio::process::Command> {
    let (exe, prefix) = program
        .split_first()
        .context("an empty peer command line")?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args(prefix)
        .args(args)
        .env("DATABASE_URL", url)
        .kill_on_drop(true);
    Ok(cmd)
}

/// Runs a peer subcommand to its end; its stdout, or an error with its stderr.
async fn run_to_end(
    program: &[OsString],
    url: &str,
    args: &[&str],
    limit: Duration,
) -> Result<String> {
    let out = tokio::time::timeout(
        limit,
        command(program, url, args)?.stdin(Stdio::null()).output(),
    )
    .await
    .with_context(|| format!("peer `{}` took over {limit:?}", args.join(" ")))?
    .with_context(|| format!("cannot run peer {:?}", program))?;
    anyhow::ensure!(
        out.status.success(),
        "peer `{}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).context("the peer printed non-UTF-8")
}

/// A long-running peer process spoken to by lines on stdin and stdout.
struct Peer {
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    stderr: tokio::task::JoinHandle<String>,
}

impl Peer {
    fn spawn(program: &[OsString], url: &str, args: &[&str]) -> Result<Peer> {
        let mut child = command(program, url, args)?
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start peer {program:?}"))?;
        let stdout = child.stdout.take().context("the peer has no stdout")?;
        let mut stderr = child.stderr.take().context("the peer has no stderr")?;
        let stderr = tokio::spawn(async move {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text).await;
            text
        });
        Ok(Peer {
            stdin: child.stdin.take(),
            child,
            lines: tokio::io::BufReader::new(stdout).lines(),
            stderr,
        })
    }

    async fn expect_line(&mut self, want: &str, limit: Duration) -> Result<()> {
        let wait = async {
            loop {
                match self.lines.next_line().await {
                    Ok(Some(line)) if line.trim() == want => return Ok(()),
                    Ok(Some(_)) => {}
                    Ok(None) => anyhow::bail!("the peer ended before printing `{want}`"),
                    Err(e) => return Err(e).context("cannot read the peer's output"),
                }
            }
        };
        match tokio::time::timeout(limit, wait).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.context(self.stderr_tail().await)),
            Err(_) => anyhow::bail!("the peer did not print `{want}` within {limit:?}"),
        }
    }

    async fn send(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("the peer's stdin is closed")?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .context("cannot write to the peer")?;
        stdin.flush().await.context("cannot write to the peer")
    }

    /// What the peer said on stderr, its last lines (the process is killed first).
    async fn stderr_tail(&mut self) -> String {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        let text = (&mut self.stderr).await.unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Ends the process: stdin closed (the peer exits), killed after 10 s.
    async fn finish(mut self) {
        drop(self.stdin.take());
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }
}

fn utc_now() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    orch_domain::text::rfc3339_utc(ms)
}

/// The 1, 5 and 15 minute load averages of `/proc/loadavg`, or `?`.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "?".into())
}
