//! `orch-bench items`: many work items in flight at once on one repo (issue 16). A fresh demo
//! project (`orch demo --setup-only`: the sample service repo, its `orch.toml`, the scripted
//! stand-in agent `orch demo-agent`, embedded SQLite or a fresh PostgreSQL database) served by a
//! real `orch serve` on a free loopback port, with one in-process worker per item by default and
//! as many agent slots, so every item can have a stage running at once. N items are submitted
//! through `POST /tasks` (the config's token); each is a "note" change (the scripted developer
//! writes `notes/<id>.txt`), so any number of them merge without conflicts.
//!
//! While they run, every `--sample-ms` (one request after the other, each on a new connection):
//! `GET /queue`, `GET /` (the dashboard) and one task page (`/ui/tasks/<id>`, the items in
//! turn); `orch serve`'s resident memory and CPU time (its own, and its waited-for children's:
//! agents, git, tests) from `/proc`; every 2 s the disk used under the repos dir (orch's clone
//! and the worktrees) and the worktree count.
//!
//! The run ends when every item has passed verification (it waits for the repo's release track
//! or is on it: one release at a time per repo, by design), or with `--to-end` when every item
//! has ended. Then `orch serve` is stopped (SIGTERM, then the demo's sample service and anything
//! else still running inside the project) and orch's own time is read back from the store:
//!
//! - a *stage visit* is the jobs of one `(stage, seq)` (the payload of every stage job);
//! - a job's handler time is `finished_at − started_at` (claim to completion, last attempt);
//! - orch's overhead of a visit = the handler time of its jobs − the agent runs inside them
//!   (`agent_runs` of the job's attempt) − the test command of a verification (`duration_ms` of
//!   `12-test-report.md`);
//! - jobs that only retry entering the release track (`release-wait` marker) are not part of a
//!   visit: the wait between them is the track's serialization; they are reported apart;
//! - the overhead is split at the visit's events: *prepare* (claim → `stage.started`: task lock,
//!   clone check, worktree reset), *run* (`stage.started` → the event that ends the job's work,
//!   minus agent and test: prompt, spawn, artifact checks, commit, gate, stage change) and
//!   *complete* (that event → the job's completion);
//! - *queue wait* (the visit's first job ready → claimed) is shown apart: it is capacity, not
//!   orch's per-stage work.
//!
//! Figures are printed (stderr; JSON on stdout with `--json`), never asserted.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use orch_domain::artifact::{Artifact, Value};
use orch_domain::config::Config;
use orch_domain::control::{events, markers};
use orch_runner::engine::StageJob;
use orch_runner::stages::tester::TEST_REPORT;
use orch_store::{AgentRun, ConnectOptions, Event, Job, Store, Task, TaskFilter};

use crate::cli::{BenchItemsArgs, ServeProject};
use crate::queue::{self, percentile, round2};
use crate::watches::{clock_ticks, proc_cpu_ticks, proc_status_kib};
use crate::{Context, print_json};

/// The endpoints sampled while the items run.
const ENDPOINTS: [&str; 3] = ["GET /queue", "GET / (dashboard)", "GET /ui/tasks/<id>"];
/// Time limit of one sampled request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Progress (the store) is read this often; the disk is walked every other time.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// The most connections the bench lets `orch serve` open on a stock PostgreSQL.
const PG_MAX_WORKERS: usize = 80;

pub async fn items(cx: &Context, args: BenchItemsArgs) -> Result<ExitCode> {
    let n = args.items.max(1);
    let tmp = tempfile::Builder::new()
        .prefix("orch-bench-items-")
        .tempdir()
        .context("cannot create a temp dir for the bench")?;
    let dir = tmp.path().join("project");
    queue::setup_project(&cx.orch, &dir, ServeProject::Demo).await?;
    let project = Project::read(&dir)?;
    let workers = args.workers.unwrap_or(if args.pg_url.is_some() {
        n.min(PG_MAX_WORKERS)
    } else {
        n
    });
    let workers = workers.max(1);
    let agent_slots = args
        .agent_concurrency
        .unwrap_or(u32::try_from(workers).unwrap_or(u32::MAX))
        .max(1);

    // The database: the demo's SQLite, or a fresh one on the PostgreSQL server.
    let pg = match &args.pg_url {
        Some(admin) => {
            let (target, name) = crate::scale::fresh_database(admin, 1).await?;
            Some((admin.clone(), target.url, name))
        }
        None => None,
    };
    let db_url = match &pg {
        Some((_, url, _)) => url.clone(),
        None => format!("sqlite://{}", dir.join(".orch/orch.db").display()),
    };
    let result = run(
        cx,
        &args,
        n,
        workers,
        agent_slots,
        &dir,
        &project,
        &db_url,
        &tmp,
    )
    .await;
    if let Some((admin, _, name)) = &pg {
        crate::scale::drop_database(admin, name).await;
    }
    if args.keep {
        let kept = tmp.keep();
        eprintln!(
            "kept the project in {} (orch serve's log: {})",
            kept.join("project").display(),
            kept.join("serve.log").display()
        );
    }
    let report = result?;
    if cx.json {
        print_json(&report);
    }
    Ok(ExitCode::SUCCESS)
}

/// What the bench reads from the demo's `orch.toml`.
struct Project {
    repo: String,
    token: String,
    repos_dir: PathBuf,
    /// Every stage in pipeline order.
    stages: Vec<String>,
    /// The stages of the release track (one item of the repo at a time).
    track: Vec<String>,
}

impl Project {
    fn read(dir: &Path) -> Result<Project> {
        let path = dir.join("orch.toml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let config = Config::from_toml_str(&text, &|_| None)
            .with_context(|| format!("cannot use {}", path.display()))?;
        let repo = config
            .repos
            .keys()
            .next()
            .context("the demo's orch.toml declares no repo")?
            .as_str()
            .to_owned();
        let token = config
            .settings
            .token
            .as_ref()
            .map(|t| t.expose().to_owned())
            .context("the demo's orch.toml sets no API token")?;
        let pipeline = config.pipeline().context("the demo's pipeline")?;
        Ok(Project {
            repo,
            token,
            repos_dir: dir.join(&config.settings.repos_dir),
            stages: pipeline
                .stages
                .iter()
                .map(|s| s.name.as_str().to_owned())
                .collect(),
            track: pipeline
                .release_track()
                .iter()
                .map(|s| s.as_str().to_owned())
                .collect(),
        })
    }

    /// The stages before the release track.
    fn before_track(&self) -> Vec<String> {
        self.stages
            .iter()
            .take_while(|s| !self.track.contains(s))
            .cloned()
            .collect()
    }

    fn repo_dir(&self) -> PathBuf {
        self.repos_dir.join(&self.repo)
    }
}

/// `orch serve` of the project: stopped by [`Serve::stop`], or killed with everything running
/// inside the project when dropped on an error.
struct Serve {
    child: tokio::process::Child,
    pid: i32,
    dir: PathBuf,
    stopped: bool,
}

impl Serve {
    #[allow(clippy::too_many_arguments)]
    fn start(
        orch: &Path,
        dir: &Path,
        log: &Path,
        port: u16,
        db_url: &str,
        workers: usize,
        agent_slots: u32,
        think_ms: u64,
        think_jitter_ms: u64,
        path_first: Option<&Path>,
    ) -> Result<Serve> {
        let log_file = std::fs::File::create(log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let mut cmd = tokio::process::Command::new(orch);
        if let Some(first) = path_first {
            let mut path = std::ffi::OsString::from(first);
            if let Some(rest) = std::env::var_os("PATH") {
                path.push(":");
                path.push(rest);
            }
            cmd.env("PATH", path);
        }
        let child = cmd
            .arg("--config")
            .arg(dir.join("orch.toml"))
            .args(["--database-url", db_url])
            .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
            .args(["--grace-s", "5"])
            .current_dir(dir)
            .env("ORCH_LOG", "warn")
            .env("ORCH_WORKERS", workers.to_string())
            .env("ORCH_AGENT_CONCURRENCY", agent_slots.to_string())
            .env("ORCH_DEMO_AGENT_SLEEP_MS", think_ms.to_string())
            // The demo's 60 s agent limit would kill a slower scripted agent mid-run and fail
            // its item: the limit is the longest think time and a minute more.
            .env(
                "ORCH_AGENT_TIMEOUT_S",
                ((think_ms + think_jitter_ms) / 1000 + 60)
                    .max(60)
                    .to_string(),
            )
            .env(
                "ORCH_DEMO_AGENT_SLEEP_JITTER_MS",
                think_jitter_ms.to_string(),
            )
            .env_remove("ORCH_DATABASE_URL")
            .env_remove("ORCH_FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {} serve", orch.display()))?;
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .context("orch serve has no pid")?;
        Ok(Serve {
            child,
            pid,
            dir: dir.to_owned(),
            stopped: false,
        })
    }

    /// The exit status when `orch serve` has exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGTERM (its running jobs get the 5 s grace), SIGKILL to its group after 30 s; then
    /// whatever still runs inside the project (the sample service's instances). Returns the
    /// seconds `orch serve` took to exit.
    async fn stop(&mut self) -> f64 {
        let t0 = Instant::now();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("orch serve did not stop within 30 s of SIGTERM; killing its group");
            // SAFETY: signalling our own child's process group.
            unsafe { libc::kill(-self.pid, libc::SIGKILL) };
            let _ = self.child.wait().await;
        }
        let took = t0.elapsed().as_secs_f64();
        self.stopped = true;
        orch_exec::stop_processes_under(&self.dir, Duration::from_secs(3));
        took
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if !self.stopped {
            // SAFETY: signalling our own child's process group.
            unsafe { libc::kill(-self.pid, libc::SIGKILL) };
            let _ = self.child.try_wait();
            orch_exec::stop_processes_under(&self.dir, Duration::from_secs(3));
        }
    }
}

/// One sampled endpoint.
#[derive(Default)]
struct Endpoint {
    ms: Vec<f64>,
    errors: usize,
    first_error: Option<String>,
}

impl Endpoint {
    fn record(&mut self, ms: f64, answer: Result<queue::HttpAnswer>) -> Option<Vec<u8>> {
        match answer {
            Ok(a) if a.status == 200 => {
                self.ms.push(ms);
                Some(a.body)
            }
            Ok(a) => {
                self.fail(format!(
                    "status {}: {}",
                    a.status,
                    String::from_utf8_lossy(&a.body[..a.body.len().min(200)])
                ));
                None
            }
            Err(e) => {
                self.fail(format!("{e:#}"));
                None
            }
        }
    }

    fn fail(&mut self, error: String) {
        self.errors += 1;
        self.first_error.get_or_insert(error);
    }
}

/// Disk used under the repos dir (allocated blocks, as `du` counts them).
#[derive(Debug, Default, Clone, Copy)]
struct Disk {
    total: u64,
    worktrees: u64,
    count: usize,
}

fn disk_usage(project: &Project) -> Disk {
    let worktrees_dir = project.repo_dir().join("worktrees");
    let count = std::fs::read_dir(&worktrees_dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| {
                    !e.file_name().to_string_lossy().starts_with('.')
                        && e.file_type().is_ok_and(|t| t.is_dir())
                })
                .count()
        })
        .unwrap_or(0);
    Disk {
        total: du(&project.repos_dir),
        worktrees: du(&worktrees_dir),
        count,
    }
}

/// Bytes allocated under `path` (not following links); entries that vanish meanwhile (a
/// worktree removed, a lock file) count as nothing.
fn du(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    let mut bytes = meta.blocks() * 512;
    if meta.is_dir()
        && let Ok(entries) = std::fs::read_dir(path)
    {
        for e in entries.filter_map(|e| e.ok()) {
            bytes += du(&e.path());
        }
    }
    bytes
}

/// Where the items are, read from the store.
#[derive(Default)]
struct Progress {
    /// `(task, seq)` of every `release.waiting` event seen so far.
    waiting: HashSet<(i64, i64)>,
    last_event: i64,
    tasks: usize,
    /// Past the last stage before the release track: waiting for the track, on it, or ended.
    passed: usize,
    ended: usize,
    /// Ended failed or cancelled (a clean run has none: the figures of a run with some are not
    /// those of the work the items were meant to do).
    failed: usize,
    /// Before the track and not waiting for it.
    before_track: usize,
}

impl Progress {
    async fn update(&mut self, store: &Store, project: &Project) -> Result<()> {
        loop {
            let batch = store
                .events_by_kind(events::RELEASE_WAITING, self.last_event, 1000)
                .await?;
            for e in &batch {
                self.last_event = self.last_event.max(e.id);
                let seq = serde_json::from_str::<serde_json::Value>(&e.data)
                    .ok()
                    .and_then(|v| v["seq"].as_i64());
                if let (Some(task), Some(seq)) = (e.task_id, seq) {
                    self.waiting.insert((task, seq));
                }
            }
            if batch.len() < 1000 {
                break;
            }
        }
        let tasks = all_tasks(store).await?;
        self.tasks = tasks.len();
        self.ended = tasks.iter().filter(|t| t.is_terminal()).count();
        self.failed = tasks
            .iter()
            .filter(|t| t.is_terminal() && t.stage != orch_domain::control::DONE)
            .count();
        self.passed = tasks
            .iter()
            .filter(|t| {
                t.is_terminal()
                    || project.track.iter().any(|s| *s == t.stage)
                    || self.waiting.contains(&(t.id, t.stage_seq))
            })
            .count();
        self.before_track = self.tasks - self.passed;
        Ok(())
    }
}

async fn all_tasks(store: &Store) -> Result<Vec<Task>> {
    let mut all = Vec::new();
    loop {
        let page = store
            .list_tasks(&TaskFilter {
                stage: None,
                repo: None,
                limit: 1000,
                offset: u32::try_from(all.len()).unwrap_or(u32::MAX),
            })
            .await?;
        let len = page.len();
        all.extend(page);
        if len < 1000 {
            return Ok(all);
        }
    }
}

/// What the submitter measured.
struct Submits {
    ms: Vec<f64>,
    seconds: f64,
}

/// Submits `n` note items through `POST /tasks`, one after the other; sends each work item id
/// to `ids` as it is created.
async fn submit_all(
    port: u16,
    token: String,
    repo: String,
    n: usize,
    over: Duration,
    ids: tokio::sync::mpsc::UnboundedSender<String>,
) -> Result<Submits> {
    let t0 = Instant::now();
    let mut ms = Vec::with_capacity(n);
    for i in 1..=n {
        // Paced: item i goes at its share of `over` (none when `over` is zero).
        let at = t0 + over.mul_f64((i - 1) as f64 / n.max(1) as f64);
        tokio::time::sleep_until(at.into()).await;
        let body = serde_json::json!({
            "repo": repo,
            "title": format!("Add a note ({i} of {n})"),
            "body": "Write a short note file for this work item (orch-bench items).",
        })
        .to_string();
        let t = Instant::now();
        let answer = queue::http(
            port,
            "POST",
            "/tasks",
            Some(&token),
            Some(&body),
            REQUEST_TIMEOUT,
        )
        .await
        .with_context(|| format!("submitting item {i}"))?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(
            answer.status == 201,
            "POST /tasks answered {}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
        let v: serde_json::Value =
            serde_json::from_slice(&answer.body).context("the answer to POST /tasks")?;
        let id = v["work_item_id"]
            .as_str()
            .context("POST /tasks answered no work_item_id")?;
        let _ = ids.send(id.to_owned());
    }
    Ok(Submits {
        ms,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// What the sampling loop saw.
#[derive(Default)]
struct Sampled {
    endpoints: [Endpoint; 3],
    samples: usize,
    running: Vec<f64>,
    peak_rss_kib: u64,
    peak_own_cores: f64,
    peak_children_cores: f64,
    peak_disk: Disk,
    peak_in_flight: usize,
    peak_before_track: usize,
}

#[allow(clippy::too_many_arguments)]
async fn run(
    cx: &Context,
    args: &BenchItemsArgs,
    n: usize,
    workers: usize,
    agent_slots: u32,
    dir: &Path,
    project: &Project,
    db_url: &str,
    tmp: &tempfile::TempDir,
) -> Result<serde_json::Value> {
    if db_url.starts_with("postgres") {
        // `orch serve` checks the schema; it does not create it.
        let store = Store::connect(db_url, ConnectOptions::default()).await?;
        store.migrate().await?;
        store.close().await;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("cannot find a free port")?
        .port();
    let log = tmp.path().join("serve.log");
    let git_trace = match args.trace_git {
        true => Some(GitTrace::install(tmp.path())?),
        false => None,
    };
    let t_start = Instant::now();
    let mut serve = Serve::start(
        &cx.orch,
        dir,
        &log,
        port,
        db_url,
        workers,
        agent_slots,
        args.think_ms,
        args.think_jitter_ms,
        git_trace.as_ref().map(|g| g.dir.as_path()),
    )?;
    if let Err(e) = queue::wait_healthy(port, t_start, Duration::from_secs(30)).await {
        return Err(e.context(log_tail(&log)));
    }
    let store = Store::connect(db_url, ConnectOptions::default()).await?;
    let backend = if db_url.starts_with("postgres") {
        "postgres"
    } else {
        "sqlite"
    };
    eprintln!(
        "orch serve up on 127.0.0.1:{port} ({backend}): {workers} workers, {agent_slots} agent \
         slots, agent think time {} ms + up to {} ms; submitting {n} items{}",
        args.think_ms,
        args.think_jitter_ms,
        if args.submit_over_s > 0.0 {
            format!(" over {:.0} s", args.submit_over_s)
        } else {
            String::new()
        }
    );

    let (id_tx, mut id_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut submitter = Some(tokio::spawn(submit_all(
        port,
        project.token.clone(),
        project.repo.clone(),
        n,
        Duration::from_secs_f64(args.submit_over_s.max(0.0)),
        id_tx,
    )));
    let mut submits = None;
    let mut ids: Vec<String> = Vec::with_capacity(n);
    let mut s = Sampled::default();
    let mut progress = Progress::default();
    let stat = format!("/proc/{}/stat", serve.pid);
    let status = format!("/proc/{}/status", serve.pid);
    let ticks = clock_ticks();
    let (own0, children0) = proc_cpu_ticks(&stat);
    let bench0 = proc_cpu_ticks("/proc/self/stat").0;
    let t0 = Instant::now();
    let mut last_check = (t0, own0, children0);
    let mut checks = 0u64;
    let mut last_report = t0;
    let mut interval = tokio::time::interval(Duration::from_millis(args.sample_ms.max(20)));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let limited = loop {
        interval.tick().await;
        while let Ok(id) = id_rx.try_recv() {
            ids.push(id);
        }
        let task_path = ids
            .get(s.samples % ids.len().max(1))
            .map(|id| format!("/ui/tasks/{id}"));
        let paths = [Some("/queue".to_owned()), Some("/".to_owned()), task_path];
        for (i, path) in paths.iter().enumerate() {
            let Some(path) = path else { continue };
            let t = Instant::now();
            let answer = queue::http(port, "GET", path, None, None, REQUEST_TIMEOUT).await;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            let body = s.endpoints[i].record(ms, answer);
            if i == 0
                && let Some(running) = body
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    .and_then(|v| v["jobs"]["by_state"]["running"].as_f64())
            {
                s.running.push(running);
            }
        }
        s.samples += 1;
        s.peak_rss_kib = s.peak_rss_kib.max(proc_status_kib(&status, "VmRSS:"));

        if last_check.0.elapsed() >= CHECK_EVERY {
            let (own, children) = proc_cpu_ticks(&stat);
            let secs = last_check.0.elapsed().as_secs_f64();
            s.peak_own_cores = s
                .peak_own_cores
                .max((own - last_check.1) as f64 / ticks / secs);
            s.peak_children_cores = s
                .peak_children_cores
                .max((children - last_check.2) as f64 / ticks / secs);
            last_check = (Instant::now(), own, children);
            checks += 1;
            if checks.is_multiple_of(2) {
                let d = disk_usage(project);
                if d.total > s.peak_disk.total {
                    s.peak_disk = d;
                }
            }
            progress.update(&store, project).await?;
            s.peak_in_flight = s.peak_in_flight.max(progress.tasks - progress.ended);
            s.peak_before_track = s.peak_before_track.max(progress.before_track);
        }
        if let Some(h) = submitter.take_if(|h| h.is_finished()) {
            submits = Some(h.await.context("the submitter panicked")??);
        }
        if let Some(status) = serve.exited() {
            anyhow::bail!(
                "orch serve exited during the run ({status}); {}",
                log_tail(&log)
            );
        }
        if last_report.elapsed() >= Duration::from_secs(15) {
            last_report = Instant::now();
            eprintln!(
                "  +{:>5.0} s  submitted {:>4}  past verification {:>4}  ended {:>4}  running jobs \
                 {:>4}  GET /queue last {:.0} ms",
                t0.elapsed().as_secs_f64(),
                ids.len(),
                progress.passed,
                progress.ended,
                s.running.last().copied().unwrap_or(0.0),
                s.endpoints[0].ms.last().copied().unwrap_or(f64::NAN)
            );
        }
        let target = if args.to_end {
            progress.ended
        } else {
            progress.passed
        };
        if submits.is_some() && progress.tasks == n && target == n {
            break false;
        }
        if t0.elapsed() >= Duration::from_secs(args.limit_s) {
            eprintln!(
                "stopping at the {} s limit: {} of {n} items past verification, {} ended",
                args.limit_s, progress.passed, progress.ended
            );
            break true;
        }
    };
    let wall_s = t0.elapsed().as_secs_f64();
    let (own1, children1) = proc_cpu_ticks(&stat);
    let bench_cpu_s = (proc_cpu_ticks("/proc/self/stat").0 - bench0) as f64 / ticks;
    let hwm_kib = proc_status_kib(&status, "VmHWM:");
    let end_disk = disk_usage(project);
    if end_disk.total > s.peak_disk.total {
        s.peak_disk = end_disk;
    }
    let stop_s = serve.stop().await;
    let submits = match (submits, submitter) {
        (Some(done), _) => done,
        (None, Some(h)) => {
            h.abort();
            anyhow::bail!("the items were not all submitted within the limit");
        }
        (None, None) => anyhow::bail!("the submitter vanished"),
    };

    let analysis = analyse(&store, project).await?;
    store.close().await;
    let report = Report {
        n,
        workers,
        agent_slots,
        think_ms: args.think_ms,
        think_jitter_ms: args.think_jitter_ms,
        submit_over_s: args.submit_over_s,
        sample_ms: args.sample_ms,
        backend,
        to_end: args.to_end,
        limited,
        wall_s,
        stop_s,
        own_cores: (own1 - own0) as f64 / ticks / wall_s,
        children_cores: (children1 - children0) as f64 / ticks / wall_s,
        bench_cores: bench_cpu_s / wall_s,
        hwm_kib,
        end_disk,
        progress: &progress,
        sampled: &mut s,
        submits: &submits,
        analysis: &analysis,
        project,
    };
    let mut doc = report.print();
    if let Some(g) = &git_trace {
        doc["git"] = g.report(&analysis)?;
    }
    Ok(doc)
}

/// `--trace-git`: a `git` first on `orch serve`'s PATH that runs the real one and appends
/// `start end exit cwd args` (seconds since the epoch, bash's `EPOCHREALTIME`: no extra
/// process) to a log.
struct GitTrace {
    dir: PathBuf,
    log: PathBuf,
}

impl GitTrace {
    fn install(tmp: &Path) -> Result<GitTrace> {
        use std::os::unix::fs::PermissionsExt as _;
        let real = std::env::var_os("PATH")
            .and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|p| p.join("git"))
                    .find(|p| p.is_file())
            })
            .context("--trace-git: no git on PATH")?;
        let dir = tmp.join("git-trace");
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let log = tmp.join("git-trace.log");
        let quote = |p: &Path| format!("'{}'", p.display().to_string().replace('\'', "'\\''"));
        let script = format!(
            "#!/bin/bash\n# orch-bench items --trace-git: times the real git.\n\
             s=$EPOCHREALTIME\n{} \"$@\"\nrc=$?\na=\"$*\"\n\
             printf '%s %s %s %s %s\\n' \"$s\" \"$EPOCHREALTIME\" \"$rc\" \"${{PWD// /_}}\" \"${{a//$'\\n'/ }}\" >> {}\n\
             exit $rc\n",
            quote(&real),
            quote(&log)
        );
        let wrapper = dir.join("git");
        std::fs::write(&wrapper, script)
            .with_context(|| format!("cannot write {}", wrapper.display()))?;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("cannot make {} executable", wrapper.display()))?;
        Ok(GitTrace { dir, log })
    }

    /// Git's time by command, printed and as JSON; per stage job over the jobs counted.
    fn report(&self, analysis: &Analysis) -> Result<serde_json::Value> {
        let text = std::fs::read_to_string(&self.log)
            .with_context(|| format!("cannot read {}", self.log.display()))?;
        // command → durations (ms)
        let mut by_cmd: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        let mut total_ms = 0.0;
        let mut calls = 0usize;
        for line in text.lines() {
            let mut f = line.split_whitespace();
            let (Some(start), Some(end), Some(_rc), Some(_cwd)) = (
                f.next().and_then(|v| v.parse::<f64>().ok()),
                f.next().and_then(|v| v.parse::<f64>().ok()),
                f.next(),
                f.next(),
            ) else {
                continue;
            };
            let ms = (end - start) * 1000.0;
            total_ms += ms;
            calls += 1;
            by_cmd.entry(git_command(f)).or_default().push(ms);
        }
        let jobs = analysis.stage_jobs().max(1);
        eprintln!(
            "  git (--trace-git): {calls} commands, {:.1} s in all; per stage job ({} counted, \
             wait retries included): {:.1} commands, {:.0} ms",
            total_ms / 1000.0,
            jobs,
            calls as f64 / jobs as f64,
            total_ms / jobs as f64
        );
        let mut rows: Vec<(String, Vec<f64>)> = by_cmd.into_iter().collect();
        rows.sort_by(|a, b| b.1.iter().sum::<f64>().total_cmp(&a.1.iter().sum::<f64>()));
        let mut out = Vec::new();
        for (cmd, mut ms) in rows {
            let sum: f64 = ms.iter().sum();
            eprintln!(
                "    {cmd:<22} {:>7} calls  p50 {:>6.1} ms  p95 {:>7.1} ms  {:>7.1} s in all",
                ms.len(),
                percentile(&mut ms, 0.5),
                percentile(&mut ms, 0.95),
                sum / 1000.0
            );
            let mut j = stats(&mut ms);
            j["command"] = cmd.into();
            j["total_s"] = round2(sum / 1000.0).into();
            out.push(j);
        }
        Ok(serde_json::json!({
            "commands": calls, "total_s": round2(total_ms / 1000.0),
            "stage_jobs": jobs, "by_command": out,
        }))
    }
}

/// The git subcommand of an argument list (`worktree add`, `status`, …), after the global
/// options (`-c key=value`, `-C dir`, `--flag`).
fn git_command<'a>(mut args: impl Iterator<Item = &'a str>) -> String {
    while let Some(a) = args.next() {
        if a == "-c" || a == "-C" {
            args.next();
            continue;
        }
        if a.starts_with('-') {
            continue;
        }
        return match a {
            "worktree" | "remote" | "stash" => {
                format!("{a} {}", args.next().unwrap_or_default())
            }
            _ => a.to_owned(),
        };
    }
    "?".to_owned()
}

/// The last lines of `orch serve`'s log, for an error message.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(15)..].join("\n");
    format!("orch serve's log ends with:\n{tail}")
}

/// One stage visit's figures, in milliseconds.
#[derive(Debug, Default, Clone)]
struct Visit {
    overhead: f64,
    prepare: Option<f64>,
    run: Option<f64>,
    complete: Option<f64>,
    /// Agent runs and the test command inside the visit.
    work: f64,
    queue_wait: f64,
    jobs: usize,
}

#[derive(Default)]
struct Analysis {
    /// Stage → its counted visits.
    visits: BTreeMap<String, Vec<Visit>>,
    /// Handler time of the jobs that only retried entering the release track.
    wait_retries: Vec<f64>,
    /// Visits not counted: still running at the end, or a test whose time is unknown.
    not_counted: usize,
    /// Per item: submit → its last pre-track stage done (ms).
    to_track: Vec<f64>,
    agent_runs: usize,
    tests: usize,
}

impl Analysis {
    /// Stage jobs counted: those of the visits and the release-track wait retries.
    fn stage_jobs(&self) -> usize {
        self.visits
            .values()
            .flatten()
            .map(|v| v.jobs)
            .sum::<usize>()
            + self.wait_retries.len()
    }
}

/// The kinds of event that end a job's work.
const END_KINDS: [&str; 7] = [
    events::STAGE_ADVANCED,
    events::STAGE_LOOP_BACK,
    events::TASK_DONE,
    events::TASK_FAILED,
    events::TASK_CANCELLED,
    events::STAGE_REQUEUED,
    events::RELEASE_WAITING,
];

async fn analyse(store: &Store, project: &Project) -> Result<Analysis> {
    let git = orch_exec::Git::new();
    let repo_dir = project.repo_dir();
    let gate_stage = project.before_track().last().cloned();
    let mut a = Analysis::default();
    for task in all_tasks(store).await? {
        let jobs = store.task_jobs(task.id).await?;
        let evs = store.task_events(task.id).await?;
        let runs = store.task_agent_runs(task.id).await?;
        // The test report on the item's branch: its time and the stage it belongs to.
        let path = format!("{}/{TEST_REPORT}", task.work_item_id.artifact_dir());
        let test = git
            .show_file(&repo_dir, &task.branch, &path)
            .await
            .ok()
            .flatten()
            .and_then(|text| Artifact::parse(&text).ok())
            .and_then(|art| {
                let stage = art.frontmatter.get_str("stage")?.to_owned();
                match art.frontmatter.get("duration_ms") {
                    Some(Value::Int(ms)) => Some((stage, *ms as f64)),
                    _ => None,
                }
            });
        let mut by_visit: BTreeMap<(i64, String), Vec<&Job>> = BTreeMap::new();
        for job in &jobs {
            let Ok(sj) = StageJob::from_content(&job.task_content) else {
                continue;
            };
            if markers::is_release_wait(&job.task_content) {
                if let (Some(s), Some(f)) = (job.started_at, job.finished_at) {
                    a.wait_retries.push((f - s) as f64);
                }
                continue;
            }
            by_visit.entry((sj.seq, sj.stage)).or_default().push(job);
        }
        let last_seq_of = |stage: &str| {
            by_visit
                .keys()
                .filter(|(_, s)| s == stage)
                .map(|(q, _)| *q)
                .max()
        };
        let test_seq = test.as_ref().and_then(|(stage, _)| last_seq_of(stage));
        for ((seq, stage), vjobs) in &by_visit {
            if vjobs
                .iter()
                .any(|j| j.started_at.is_none() || j.finished_at.is_none())
            {
                a.not_counted += 1;
                continue;
            }
            let command = match &test {
                Some((s, ms)) if s == stage && test_seq == Some(*seq) => Some(*ms),
                Some((s, _)) if s == stage => None,
                _ => Some(0.0),
            };
            let Some(command) = command else {
                // An earlier visit of the tested stage: its test time is not on the branch.
                a.not_counted += 1;
                continue;
            };
            if command > 0.0 {
                a.tests += 1;
            }
            let v = visit(vjobs, &evs, &runs, command, &mut a.agent_runs);
            if gate_stage.as_deref() == Some(stage.as_str())
                && let Some(end) = vjobs.iter().filter_map(|j| end_event(j, &evs)).max()
            {
                a.to_track.push((end - task.created_at) as f64);
            }
            a.visits.entry(stage.clone()).or_default().push(v);
        }
    }
    Ok(a)
}

/// The time of the event that ended `job`'s work (its last attempt).
fn end_event(job: &Job, evs: &[Event]) -> Option<i64> {
    let started = job.started_at?;
    evs.iter()
        .filter(|e| {
            e.job_id == Some(job.id)
                && e.created_at >= started
                && END_KINDS.contains(&e.kind.as_str())
        })
        .map(|e| e.created_at)
        .max()
}

fn visit(
    jobs: &[&Job],
    evs: &[Event],
    runs: &[AgentRun],
    command: f64,
    n_runs: &mut usize,
) -> Visit {
    let mut v = Visit {
        jobs: jobs.len(),
        ..Visit::default()
    };
    let (mut prepare, mut run, mut complete) = (Some(0.0), Some(0.0), Some(0.0));
    let mut work_left = command;
    for job in jobs {
        let (Some(started), Some(finished)) = (job.started_at, job.finished_at) else {
            continue;
        };
        let agent: f64 = runs
            .iter()
            .filter(|r| r.job_id == Some(job.id) && r.attempt == job.attempt)
            .filter_map(|r| {
                *n_runs += 1;
                r.finished_at.map(|f| (f - r.started_at) as f64)
            })
            .sum();
        // The test command ran inside the (single) job of the visit that wrote the report.
        let work = agent + std::mem::take(&mut work_left);
        v.work += work;
        v.overhead += (finished - started) as f64 - work;
        let began = evs
            .iter()
            .filter(|e| {
                e.job_id == Some(job.id)
                    && e.created_at >= started
                    && e.kind == events::STAGE_STARTED
            })
            .map(|e| e.created_at)
            .min()
            // A watch's ticks record no `stage.started` (their worktree is deferred): they start
            // their work at the claim.
            .or_else(|| (job.agent == orch_runner::deploy::MONITOR_AGENT).then_some(started));
        let ended = end_event(job, evs);
        let add = |acc: Option<f64>, x: Option<f64>| Some(acc? + x?);
        prepare = add(prepare, began.map(|b| (b - started) as f64));
        run = add(run, began.zip(ended).map(|(b, e)| (e - b) as f64 - work));
        complete = add(complete, ended.map(|e| (finished - e) as f64));
    }
    v.prepare = prepare;
    v.run = run;
    v.complete = complete;
    if let Some(first) = jobs.iter().min_by_key(|j| j.id) {
        v.queue_wait = first
            .started_at
            .map_or(0.0, |s| (s - first.available_at).max(0) as f64);
    }
    v
}

/// Everything the report prints.
struct Report<'a> {
    n: usize,
    workers: usize,
    agent_slots: u32,
    think_ms: u64,
    think_jitter_ms: u64,
    submit_over_s: f64,
    sample_ms: u64,
    backend: &'static str,
    to_end: bool,
    limited: bool,
    wall_s: f64,
    stop_s: f64,
    own_cores: f64,
    children_cores: f64,
    bench_cores: f64,
    hwm_kib: u64,
    end_disk: Disk,
    progress: &'a Progress,
    sampled: &'a mut Sampled,
    submits: &'a Submits,
    analysis: &'a Analysis,
    project: &'a Project,
}

fn stats(v: &mut [f64]) -> serde_json::Value {
    serde_json::json!({
        "n": v.len(),
        "p50": round2(percentile(v, 0.50)),
        "p95": round2(percentile(v, 0.95)),
        "p99": round2(percentile(v, 0.99)),
        "max": round2(percentile(v, 1.0)),
    })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

impl Report<'_> {
    fn print(self) -> serde_json::Value {
        let s = self.sampled;
        let a = self.analysis;
        let what = match (self.to_end, self.progress.failed) {
            (true, _) => "every item ended".to_owned(),
            (false, 0) => "every item passed verification".to_owned(),
            (false, n) => format!("every item passed verification or ended ({n} failed)"),
        };
        eprintln!(
            "\n{} items on one repo, {} backend, {} workers, {} agent slots, think time {} ms \
             + up to {} ms, submitted over {:.0} s: {} after {:.1} s{}",
            self.n,
            self.backend,
            self.workers,
            self.agent_slots,
            self.think_ms,
            self.think_jitter_ms,
            self.submit_over_s,
            if self.limited {
                "limit reached"
            } else {
                what.as_str()
            },
            self.wall_s,
            if self.limited {
                format!(
                    " ({} past verification, {} ended)",
                    self.progress.passed, self.progress.ended
                )
            } else {
                String::new()
            }
        );
        if self.progress.failed > 0 {
            eprintln!(
                "  WARNING: {} items failed or were cancelled (see `orch serve`'s log with \
                 --keep): they left the pipeline early, so this run does not measure the work \
                 they were meant to do",
                self.progress.failed
            );
        }
        let mut submit_ms = self.submits.ms.clone();
        eprintln!(
            "  submit: {} items in {:.2} s ({:.0}/s), POST /tasks p50 {:.1} ms p99 {:.1} ms",
            submit_ms.len(),
            self.submits.seconds,
            submit_ms.len() as f64 / self.submits.seconds.max(1e-9),
            percentile(&mut submit_ms, 0.5),
            percentile(&mut submit_ms, 0.99)
        );
        let mut running = s.running.clone();
        let mean_running = running.iter().sum::<f64>() / running.len().max(1) as f64;
        eprintln!(
            "  in flight: up to {} items not ended, up to {} before the release track at once; \
             running jobs mean {mean_running:.0}, max {:.0} (GET /queue)",
            s.peak_in_flight,
            s.peak_before_track,
            percentile(&mut running, 1.0)
        );
        let mut to_track = a.to_track.clone();
        eprintln!(
            "  submit -> past verification per item: p50 {:.1} s  p95 {:.1} s  max {:.1} s",
            percentile(&mut to_track, 0.5) / 1000.0,
            percentile(&mut to_track, 0.95) / 1000.0,
            percentile(&mut to_track, 1.0) / 1000.0
        );
        eprintln!(
            "  latency, one request after the other on new connections, {} rounds every {} ms \
             (actual period {:.0} ms):",
            s.samples,
            self.sample_ms,
            self.wall_s * 1000.0 / s.samples.max(1) as f64
        );
        let mut endpoints = Vec::new();
        for (name, e) in ENDPOINTS.iter().zip(s.endpoints.iter_mut()) {
            eprintln!(
                "    {name:<20} p50 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms  ({} ok, {} errors{})",
                percentile(&mut e.ms, 0.5),
                percentile(&mut e.ms, 0.99),
                percentile(&mut e.ms, 1.0),
                e.ms.len(),
                e.errors,
                e.first_error
                    .as_ref()
                    .map(|x| format!(": first {x}"))
                    .unwrap_or_default()
            );
            let mut j = stats(&mut e.ms);
            j["endpoint"] = (*name).into();
            j["errors"] = e.errors.into();
            endpoints.push(j);
        }
        eprintln!(
            "  orch serve: RSS peak {:.1} MiB (VmHWM {:.1} MiB); CPU {:.2} cores own + {:.2} \
             cores children (agents, git, tests) on average, peak over 1 s {:.2} + {:.2}; \
             stopped in {:.1} s (the bench itself: {:.2} cores)",
            s.peak_rss_kib as f64 / 1024.0,
            self.hwm_kib as f64 / 1024.0,
            self.own_cores,
            self.children_cores,
            s.peak_own_cores,
            s.peak_children_cores,
            self.stop_s,
            self.bench_cores
        );
        let d = s.peak_disk;
        eprintln!(
            "  disk under the repos dir: peak {:.1} MiB with {} worktrees ({:.1} MiB in worktrees, \
             {:.0} KiB each; orch's clone {:.1} MiB); at the end {:.1} MiB, {} worktrees",
            mib(d.total),
            d.count,
            mib(d.worktrees),
            d.worktrees as f64 / 1024.0 / d.count.max(1) as f64,
            mib(d.total - d.worktrees),
            mib(self.end_disk.total),
            self.end_disk.count
        );
        eprintln!(
            "  orch's own time per stage visit (handler time - agent runs - test command), ms; \
             prepare / run / complete are p50s:"
        );
        eprintln!(
            "    {:<15} {:>6} {:>8} {:>8} {:>8}   {:>8} {:>8} {:>8}   {:>9} {:>10} {:>10}",
            "stage",
            "visits",
            "p50",
            "p95",
            "max",
            "prepare",
            "run",
            "complete",
            "agent/test",
            "queue p50",
            "queue p95"
        );
        let before = self.project.before_track();
        let mut pooled = Vec::new();
        let mut stages_json = Vec::new();
        for stage in &self.project.stages {
            let Some(visits) = a.visits.get(stage) else {
                continue;
            };
            let mut over: Vec<f64> = visits.iter().map(|v| v.overhead).collect();
            if before.contains(stage) {
                pooled.extend(over.iter().copied());
            }
            let part = |f: fn(&Visit) -> Option<f64>| {
                let mut x: Vec<f64> = visits.iter().filter_map(f).collect();
                percentile(&mut x, 0.5)
            };
            let (prep, run, complete) =
                (part(|v| v.prepare), part(|v| v.run), part(|v| v.complete));
            let work = part(|v| Some(v.work));
            let mut queue: Vec<f64> = visits.iter().map(|v| v.queue_wait).collect();
            let jobs: usize = visits.iter().map(|v| v.jobs).sum();
            eprintln!(
                "    {:<15} {:>6} {:>8.0} {:>8.0} {:>8.0}   {:>8.0} {:>8.0} {:>8.0}   {:>9.0} {:>10.0} {:>10.0}{}",
                stage,
                visits.len(),
                percentile(&mut over, 0.5),
                percentile(&mut over, 0.95),
                percentile(&mut over, 1.0),
                prep,
                run,
                complete,
                work,
                percentile(&mut queue, 0.5),
                percentile(&mut queue, 0.95),
                if jobs > visits.len() {
                    format!("  ({jobs} jobs)")
                } else {
                    String::new()
                }
            );
            let mut j = stats(&mut over);
            j["stage"] = stage.as_str().into();
            j["jobs"] = jobs.into();
            j["release_track"] = (!before.contains(stage)).into();
            j["prepare_p50"] = round2(prep).into();
            j["run_p50"] = round2(run).into();
            j["complete_p50"] = round2(complete).into();
            j["agent_or_test_p50"] = round2(work).into();
            j["queue_wait"] = stats(&mut queue);
            stages_json.push(j);
        }
        let (p50, p95, max) = (
            percentile(&mut pooled, 0.5),
            percentile(&mut pooled, 0.95),
            percentile(&mut pooled, 1.0),
        );
        eprintln!(
            "    {:<15} {:>6} {p50:>8.0} {p95:>8.0} {max:>8.0}",
            "before track",
            pooled.len()
        );
        let mut retries = a.wait_retries.clone();
        let retry_s = retries.iter().sum::<f64>() / 1000.0 + 0.0;
        if retries.is_empty() {
            eprintln!("  release-track wait retries: none");
        } else {
            eprintln!(
                "  release-track wait retries (not in the visits): {} jobs, handler p50 {:.0} ms \
                 p95 {:.0} ms, {retry_s:.1} worker-seconds in all",
                retries.len(),
                percentile(&mut retries, 0.5),
                percentile(&mut retries, 0.95),
            );
        }
        eprintln!(
            "  counted: {} agent runs, {} test commands; {} visits not counted (unfinished at the \
             end, or an earlier test whose time is not on the branch)",
            a.agent_runs, a.tests, a.not_counted
        );
        eprintln!(
            "  goal (orch's own time per stage visit < 100 ms at {} items in flight): p50 {}, \
             p95 {}",
            self.n,
            if p50 < 100.0 { "met" } else { "NOT met" },
            if p95 < 100.0 { "met" } else { "NOT met" }
        );
        let mut to_track_j = stats(&mut to_track);
        to_track_j["unit"] = "ms".into();
        serde_json::json!({
            "items": self.n, "workers": self.workers, "agent_concurrency": self.agent_slots,
            "think_ms": self.think_ms, "think_jitter_ms": self.think_jitter_ms,
            "submit_over_s": self.submit_over_s, "backend": self.backend,
            "until": if self.to_end { "ended" } else { "past verification" },
            "limit_reached": self.limited, "wall_s": round2(self.wall_s),
            "past_verification": self.progress.passed, "ended": self.progress.ended,
            "failed": self.progress.failed,
            "submit": {
                "seconds": round2(self.submits.seconds),
                "post_ms": stats(&mut submit_ms),
            },
            "peak_items_in_flight": s.peak_in_flight,
            "peak_items_before_track": s.peak_before_track,
            "running_jobs_mean": round2(mean_running),
            "running_jobs_max": percentile(&mut running, 1.0),
            "submit_to_past_verification_ms": to_track_j,
            "samples": s.samples,
            "endpoints": endpoints,
            "serve": {
                "rss_peak_mib": round2(s.peak_rss_kib as f64 / 1024.0),
                "vm_hwm_mib": round2(self.hwm_kib as f64 / 1024.0),
                "cores_own": round2(self.own_cores),
                "cores_children": round2(self.children_cores),
                "cores_own_peak_1s": round2(s.peak_own_cores),
                "cores_children_peak_1s": round2(s.peak_children_cores),
                "stop_s": round2(self.stop_s),
            },
            "bench_cores": round2(self.bench_cores),
            "disk_peak": {
                "repos_dir_mib": round2(mib(d.total)),
                "worktrees_mib": round2(mib(d.worktrees)),
                "worktrees": d.count,
                "clone_mib": round2(mib(d.total - d.worktrees)),
            },
            "disk_end": {
                "repos_dir_mib": round2(mib(self.end_disk.total)),
                "worktrees": self.end_disk.count,
            },
            "overhead_ms": {
                "stages": stages_json,
                "before_track": { "visits": pooled.len(), "p50": round2(p50), "p95": round2(p95), "max": round2(max) },
                "release_wait_retries": stats(&mut retries),
                "release_wait_retry_worker_s": round2(retry_s),
                "visits_not_counted": a.not_counted,
                "agent_runs": a.agent_runs,
                "test_commands": a.tests,
            },
        })
    }
}
