//! `orch demo`: the whole product on one machine in about a minute. In a directory (kept
//! afterwards so people can look) it creates a sample service repository, an `orch.toml` that
//! drives it with the scripted demo agent, the embedded database, and runs the workers and the
//! HTTP dashboard in this process. Two work items go through every stage: one deploys healthy
//! (after one review round trip), the other breaks production health and is rolled back by the
//! post-deploy watch. Then it prints what happened and where to look.

pub mod agent;
mod claude;

pub(crate) use claude::serve_model;

use std::collections::HashMap;
use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use orch_domain::control::events;
use orch_exec::git::{Git, Pathspec};
use orch_runner::worker::{Worker, WorkerConfig};
use orch_store::{ConnectOptions, Store, Task};
use tokio_util::sync::CancellationToken;

use crate::cli::{DemoArgs, Global};
use crate::context::Context;
use crate::output::{age, table};
use crate::runtime::Runtime;

const SERVICE_FILES: &[(&str, &str)] = &[
    ("app.py", include_str!("../../demo/service/app.py")),
    (
        "test_app.py",
        include_str!("../../demo/service/test_app.py"),
    ),
    ("deploy.sh", include_str!("../../demo/service/deploy.sh")),
    (
        "rollback.sh",
        include_str!("../../demo/service/rollback.sh"),
    ),
    ("stop.sh", include_str!("../../demo/service/stop.sh")),
    ("smoke.sh", include_str!("../../demo/service/smoke.sh")),
    ("README.md", include_str!("../../demo/service/README.md")),
    (".gitignore", include_str!("../../demo/service/.gitignore")),
];

const ITEMS: &[(&str, &str)] = &[
    (
        "Add a /version endpoint",
        "Clients need to know which API version they talk to. Add `GET /version`.",
    ),
    (
        "Make the greeting configurable",
        "Add `GET /greeting`, configurable through the APP_GREETING environment variable.",
    ),
];

/// Under `--json` the demo's running commentary goes to stderr and stdout carries one JSON
/// document at the end (the outcomes and the deploy history).
static COMMENTARY_ON_STDERR: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The demo's own requests and its cancel are orch's, not an operator's.
fn demo_actor() -> orch_domain::control::actor::Actor {
    orch_domain::control::actor::Actor::Orch {
        what: "the demo".to_owned(),
    }
}

/// A line of the demo's commentary (see [`COMMENTARY_ON_STDERR`]), through the output
/// module like everything the binary prints.
macro_rules! say {
    () => {
        say!("")
    };
    ($($arg:tt)*) => {
        if COMMENTARY_ON_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
            crate::output::say(&format!($($arg)*))
        } else {
            crate::output::outln(&format!($($arg)*))
        }
    };
}

pub async fn run(global: &Global, args: DemoArgs) -> Result<ExitCode> {
    COMMENTARY_ON_STDERR.store(global.json, std::sync::atomic::Ordering::Relaxed);
    for tool in ["git", "python3", "setsid", "tar"] {
        if which(tool).is_none() {
            anyhow::bail!(
                "the demo needs `{tool}` on PATH (the sample service is a Python script deployed by shell scripts)"
            );
        }
    }
    let dir = match args.dir {
        Some(d) => {
            std::fs::create_dir_all(&d)
                .with_context(|| format!("cannot create {}", d.display()))?;
            d.canonicalize()?
        }
        None => tempfile::Builder::new()
            .prefix("orch-demo-")
            .tempdir()
            .context("cannot create a temp dir for the demo")?
            .keep(),
    };
    anyhow::ensure!(
        !dir.join("orch.toml").exists(),
        "{} already holds a demo (orch.toml exists); pick another --dir",
        dir.display()
    );
    let exe = std::env::current_exe().context("cannot find the orch executable")?;
    let [prod_port, staging_port, api_port] = free_ports()?;
    let state = dir.join("service-state");
    std::fs::create_dir_all(&state)?;
    let git = Git::new();
    let service = dir.join("service");
    create_service_repo(&git, &service).await?;

    let config_path = dir.join("orch.toml");
    let agent = write_agent_script(&dir, &exe)?;
    // The agents and the service's own code run sandboxed when this machine can; otherwise the
    // demo says plainly that they run unsandboxed (`sandbox = "off"`).
    let sandboxed = match orch_exec::sandbox::probe(Path::new("bwrap")) {
        Ok(_) => true,
        Err(why) => {
            say!(
                "NOTE: the demo runs its agents and tests UNSANDBOXED ({why}); with bubblewrap installed they run in a sandbox"
            );
            false
        }
    };
    let toml = demo_config(&agent, &state, prod_port, staging_port, api_port, sandboxed);
    // `--agent claude`: the real Claude Code against the demo's model server (kept running
    // until the demo ends).
    let claude = match args.agent {
        crate::cli::DemoAgent::Scripted => None,
        crate::cli::DemoAgent::Claude => Some(claude::ClaudeDemo::start(&dir).await?),
    };
    let toml = claude.as_ref().map_or(toml.clone(), |c| c.configure(&toml));
    std::fs::write(&config_path, &toml)
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    let mut g = Global {
        config: config_path.clone(),
        database_url: None,
        json: false,
        verbose: global.verbose,
        quiet: global.quiet,
    };
    g.database_url = None;
    let cx = Context::new(&g)?;
    let config = cx.require_config()?.clone();
    std::fs::create_dir_all(cx.state_dir())
        .with_context(|| format!("cannot create {}", cx.state_dir().display()))?;
    let store = cx
        .open_store_with(
            ConnectOptions {
                create_if_missing: true,
                ..ConnectOptions::default()
            },
            false,
        )
        .await?;
    store.migrate().await?;
    let runtime = Arc::new(Runtime::new(&cx.places(&config), &config, &store)?);
    if args.setup_only {
        if global.json {
            let doc = orch_api::demo_report_json(&store, "service", &dir, None, None, None).await?;
            crate::output::print_json(&doc);
        }
        store.close().await;
        if !global.json {
            crate::output::outln(&dir.display().to_string());
        }
        return Ok(ExitCode::SUCCESS);
    }

    say!("orch demo in {}", dir.display());
    if let Some(c) = &claude {
        say!(
            "  LLM stages: the real Claude Code ({}) against the demo's model server",
            c.program.display()
        );
    }
    say!("  sample service repo: {}", service.display());
    say!("  dashboard while it runs: http://127.0.0.1:{api_port}/");
    say!(
        "  the sample service while it runs: production http://127.0.0.1:{prod_port}/health, staging http://127.0.0.1:{staging_port}/health (stopped when the demo exits)\n"
    );
    // Stops the service's instances on every way out: return, error, Ctrl-C, SIGTERM.
    let _services = ServiceGuard::new(state.clone());

    // Production runs the initial release before any work item ships.
    let first = orch_exec::run(
        &orch_exec::Cmd::new("sh")
            .arg("deploy.sh")
            .args(["production".to_owned(), prod_port.to_string()])
            .arg(state.as_os_str())
            .cwd(&service)
            .timeout(Duration::from_secs(30)),
    )
    .await
    .context("cannot start the sample service")?;
    anyhow::ensure!(
        first.success(),
        "the sample service's first deploy failed: {}",
        first.tail_text(10)
    );

    let stop = CancellationToken::new();
    let mut wc = WorkerConfig::new("demo");
    wc.concurrency = 4;
    wc.claim_batch = 1;
    wc.lease = Duration::from_secs(30);
    wc.poll_interval = Duration::from_millis(200);
    wc.node = Some(runtime.engine.config().node.clone());
    let worker = Worker::new(store.clone(), runtime.registry(), wc.clone());
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", api_port)).await?;
    let api = crate::cmd::worker::spawn_api(
        listener,
        &store,
        &runtime,
        worker.stats(),
        &config,
        stop.clone(),
    );
    let workers = tokio::spawn(crate::cmd::worker::run_workers(
        store.clone(),
        worker,
        runtime.passes(wc.lease, config.settings.retention.period()),
        stop.clone(),
        CancellationToken::new(),
    ));

    // Both items at once: the release train lets one release of the repo through at a time
    // (merge → staging → deploy → watch → lessons), so each watch sees only its own change.
    let mut ids = Vec::new();
    for (title, body) in ITEMS {
        let t = runtime
            .ops
            .submit("service", title, body, &demo_actor())
            .await?;
        say!("submitted {}: {title}", t.work_item_id);
        ids.push(t.work_item_id.to_string());
    }
    say!();
    let started = Instant::now();
    let mut finished = watch_progress(&store, &ids, started, Duration::from_secs(300)).await;
    // The loop closes: a third request's analyst gets the rollback lesson in its prompt. It is
    // cancelled after analysis (an operator command), the demo has shown what it needed.
    let mut lesson_seen = None;
    if finished.is_ok() {
        match third_item(&store, &runtime).await {
            Ok((task, seen)) => {
                lesson_seen = seen;
                if let Ok(tasks) = finished.as_mut() {
                    tasks.push(task);
                }
            }
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "the third demo item failed"),
        }
    }
    stop.cancel();
    let _ = workers.await;
    let _ = api.await;
    for env in ["production", "staging"] {
        let stop_cmd = orch_exec::Cmd::new("sh")
            .arg(service.join("stop.sh").as_os_str())
            .arg(env)
            .arg(state.as_os_str())
            .timeout(Duration::from_secs(10));
        let _ = orch_exec::run(&stop_cmd).await;
    }
    let tasks = finished?;
    let doc = summary(
        &store,
        &tasks,
        &dir,
        &config_path,
        started,
        lesson_seen.as_deref(),
    )
    .await?;
    if global.json {
        crate::output::print_json(&doc);
    }
    store.close().await;
    let all_ended = tasks.iter().all(|t| t.is_terminal());
    Ok(if all_ended {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Submits APP-3, lets its analysis run, cancels it, and returns the lessons section its
/// requirements quote (read from its branch).
async fn third_item(store: &Store, runtime: &Runtime) -> Result<(Task, Option<String>)> {
    let t = runtime
        .ops
        .submit(
            "service",
            "Add a /healthz alias",
            "Some load balancers probe `/healthz`; answer it like `/health`.",
            &demo_actor(),
        )
        .await?;
    say!(
        "  +  ---   {:6}  submitted after APP-2's rollback, to show the lesson reach a prompt",
        t.work_item_id
    );
    let t0 = Instant::now();
    loop {
        let cur = store
            .get_task_by_work_item(t.work_item_id.as_str())
            .await?
            .context("APP-3 vanished")?;
        if !matches!(cur.stage.as_str(), "intake" | "analysis") {
            break;
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(60),
            "APP-3 did not finish analysis"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cancelled = runtime
        .ops
        .cancel(t.work_item_id.as_str(), &demo_actor())
        .await?;
    say!(
        "  +  ---   {:6}  cancelled by the demo after analysis",
        t.work_item_id
    );
    let repo_dir = runtime.places.repos_dir.join("service");
    let path = format!("{}/02-requirements.md", t.work_item_id.artifact_dir());
    let text = runtime
        .engine
        .git()
        .show_file(&repo_dir, &cancelled.branch, &path)
        .await?;
    let section = text.and_then(|t| {
        t.split("## Lessons considered")
            .nth(1)
            .map(|s| format!("## Lessons considered{}", s.trim_end()))
    });
    Ok((cancelled, section))
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(tool))
            .find(|p| p.is_file())
    })
}

/// `N` distinct free ports on 127.0.0.1: all are held at once while they are picked, so two
/// of them can never be the same port (picking them one by one could).
fn free_ports<const N: usize>() -> Result<[u16; N]> {
    let mut held = Vec::with_capacity(N);
    let mut ports = [0u16; N];
    for port in &mut ports {
        let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
        *port = l.local_addr()?.port();
        held.push(l);
    }
    Ok(ports)
}

async fn create_service_repo(git: &Git, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    git.init_repo(dir, "main").await?;
    for (name, content) in SERVICE_FILES {
        std::fs::write(dir.join(name), content).with_context(|| format!("cannot write {name}"))?;
    }
    git.add_and_commit(
        dir,
        &Pathspec::All,
        "Sample service: /health and /revision, tests, deploy scripts",
    )
    .await?;
    // An ordinary checkout, as a user has it: orch fast-forwards it when it is clean
    // (orch_runner::repos::publish_default_branch), no git configuration needed.
    Ok(())
}

/// The scripted agent as a CLI: `agent.sh <preset flags…>` runs `orch demo-agent <flags…>`.
fn write_agent_script(dir: &Path, exe: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    // In a directory of its own: a sandboxed run is shown the program's directory, and nothing
    // else of the demo's.
    let bin = dir.join("agent");
    std::fs::create_dir_all(&bin).with_context(|| format!("cannot create {}", bin.display()))?;
    let path = bin.join("demo-agent.sh");
    let quoted = format!("'{}'", exe.display().to_string().replace('\'', "'\\''"));
    std::fs::write(&path, format!("#!/bin/sh\n# The demo's scripted agent, run by orch's claude preset.\nexec {quoted} demo-agent \"$@\"\n"))
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path)
}

fn demo_config(
    agent: &Path,
    state: &Path,
    prod: u16,
    staging: u16,
    api: u16,
    sandboxed: bool,
) -> String {
    let exe = toml_str(&agent.display().to_string());
    let st = state.display().to_string();
    // The agents' time limit is `[settings] agent_timeout_s` (60 s), so `ORCH_AGENT_TIMEOUT_S`
    // can raise it (a benchmark's slower scripted agents).
    let agent = |name: &str| {
        format!(
            "[agents.{name}]\nbackend = \"claude\"\ncommand = {exe}\nmodel = \"demo-scripted-1\"\n\
             # The scripted agent's think time, set in orch's environment by benchmarks and tests.\n\
             env = [\"ORCH_DEMO_AGENT_SLEEP_MS\", \"ORCH_DEMO_AGENT_SLEEP_JITTER_MS\"]\n\n"
        )
    };
    let mut s = format!(
        "# orch demo configuration (written by `orch demo`).\n\n\
         [settings]\nrepos_dir = \".orch/repos\"\nbind = \"127.0.0.1:{api}\"\ntoken = \"demo-token\"\n\
         workers = 4\nlease_s = 30\npoll_interval_ms = 200\nagent_concurrency = 4\nagent_timeout_s = 60\n\n\
         [repos.service]\npath = \"service\"\nprefix = \"APP\"\ndefault_branch = \"main\"\n\
         test = \"python3 -m unittest -q\"\ntest_timeout_s = 60\n\
         deploy = {}\nrollback = {}\ndeploy_timeout_s = 30\n\
         health_url = \"http://127.0.0.1:{prod}/health\"\nrevision_url = \"http://127.0.0.1:{prod}/revision\"\n{off}\n\
         [[repos.service.staging]]\nname = \"unit-tests\"\nrun = \"python3 -m unittest -q\"\ntimeout_s = 60\n\n\
         [[repos.service.staging]]\nname = \"deploy-staging\"\nrun = {}\ntimeout_s = 30\n\
         # It starts the staging service, which must outlive the step: trusted, like a deploy.\n\
         sandbox = false\n\n\
         [[repos.service.staging_smoke]]\nname = \"health\"\nrun = \"sh smoke.sh {staging}\"\ntimeout_s = 10\n\n\
         [repos.service.post_deploy]\nwindow_s = 8\ninterval_s = 1\ninitial_delay_s = 1\npoll_timeout_s = 2\n\n{}",
        toml_str(&format!("sh deploy.sh production {prod} {st}")),
        toml_str(&format!("sh rollback.sh production {prod} {st}")),
        toml_str(&format!("sh deploy.sh staging {staging} {st}")),
        if sandboxed {
            format!(
                "# The agents and the service's tests run in a sandbox; the smoke check may reach staging.\n\
                 [repos.service.sandbox]\nnetwork = [\"127.0.0.1:{staging}\"]\n\n"
            )
        } else {
            String::new()
        },
        off = if sandboxed {
            ""
        } else {
            "# No sandbox could be set up on this machine: the agents and tests run UNSANDBOXED.\nsandbox = \"off\"\n"
        },
    );
    for name in ["analyst", "architect", "developer", "reviewer"] {
        s.push_str(&agent(name));
    }
    s
}

fn toml_str(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Shows each work item's stage as it moves, until every item ends or `limit` passes.
async fn watch_progress(
    store: &Store,
    ids: &[String],
    started: Instant,
    limit: Duration,
) -> Result<Vec<Task>> {
    let tty = std::io::stdout().is_terminal();
    let mp = indicatif::MultiProgress::new();
    let style = indicatif::ProgressStyle::with_template("{spinner} {prefix:6} [{bar:22}] {msg}")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> ");
    let stages = [
        "intake",
        "analysis",
        "architecture",
        "implementation",
        "review",
        "verification",
        "merge",
        "staging",
        "deploy",
        "observe",
        "lessons",
        "done",
    ];
    let bars: HashMap<String, indicatif::ProgressBar> = ids
        .iter()
        .map(|id| {
            let b = if tty {
                mp.add(indicatif::ProgressBar::new(stages.len() as u64 - 1))
            } else {
                indicatif::ProgressBar::hidden()
            };
            b.set_style(style.clone());
            b.set_prefix(id.clone());
            b.enable_steady_tick(Duration::from_millis(120));
            (id.clone(), b)
        })
        .collect();
    let mut last: HashMap<String, (String, i64)> = HashMap::new();
    loop {
        let mut tasks = Vec::new();
        for id in ids {
            let Some(t) = store.get_task_by_work_item(id).await? else {
                continue;
            };
            let seen = last.get(id).cloned();
            if seen.as_ref().map(|(s, q)| (s.as_str(), *q)) != Some((t.stage.as_str(), t.stage_seq))
            {
                let why = store
                    .task_events(t.id)
                    .await?
                    .into_iter()
                    .rev()
                    .find(|e| {
                        e.kind.starts_with("stage.")
                            && e.kind != events::STAGE_STARTED
                            && e.kind != events::STAGE_REQUEUED
                            || e.kind.starts_with("task.")
                    })
                    .map(|e| e.message)
                    .unwrap_or_default();
                let line = format!(
                    "  +{:>5.1}s  {:6}  {:14}  {}",
                    started.elapsed().as_secs_f64(),
                    t.work_item_id,
                    t.stage,
                    why.chars().take(110).collect::<String>()
                );
                if tty {
                    mp.println(crate::output::terminal_safe(&line)).ok();
                } else {
                    say!("{line}");
                }
                if let Some(b) = bars.get(id) {
                    let pos = stages
                        .iter()
                        .position(|s| *s == t.stage)
                        .unwrap_or(stages.len() - 1);
                    b.set_position(pos as u64);
                    b.set_message(t.stage.to_string());
                    if t.is_terminal() {
                        b.finish_with_message(t.stage.to_string());
                    }
                }
                last.insert(id.clone(), (t.stage.to_string(), t.stage_seq));
            }
            tasks.push(t);
        }
        if tasks.len() == ids.len() && tasks.iter().all(|t| t.is_terminal()) {
            return Ok(tasks);
        }
        if started.elapsed() > limit {
            for b in bars.values() {
                b.abandon();
            }
            anyhow::bail!(
                "the demo did not finish within {}s; see `orch --config … logs <id>`",
                limit.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

async fn summary(
    store: &Store,
    tasks: &[Task],
    dir: &Path,
    config: &Path,
    started: Instant,
    lesson_seen: Option<&str>,
) -> Result<serde_json::Value> {
    say!("\nfinished in {:.0}s\n", started.elapsed().as_secs_f64());
    for t in tasks {
        let events = store.task_events(t.id).await?;
        let runs = store.task_agent_runs(t.id).await?;
        let usage = store.task_usage(t.id).await?;
        let outcome = events
            .iter()
            .rev()
            .find(|e| {
                matches!(
                    e.kind.as_str(),
                    events::TASK_DONE | events::TASK_FAILED | events::TASK_CANCELLED
                )
            })
            .and_then(|e| orch_domain::payload::read::<orch_domain::payload::StageChange>(&e.data))
            .and_then(|c| c.outcome)
            .unwrap_or_else(|| t.stage.to_string());
        say!("{}  {}  → {outcome}", t.work_item_id, t.title);
        let rows: Vec<Vec<String>> = events
            .iter()
            .filter(|e| {
                matches!(
                    e.kind.as_str(),
                    events::STAGE_ADVANCED
                        | events::STAGE_LOOP_BACK
                        | events::TASK_DONE
                        | events::TASK_FAILED
                        | events::POST_DEPLOY_VERDICT
                        | events::DEPLOY_CONFIRMED
                        | events::RELEASE_WAITING
                        | events::RELEASE_PROMOTED
                        | events::RELEASE_REVERTED
                )
            })
            .map(|e| {
                vec![
                    format!("+{}", age(e.created_at - t.created_at)),
                    e.kind.clone(),
                    e.message
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .chars()
                        .take(90)
                        .collect(),
                ]
            })
            .collect();
        for line in table(&["at", "event", "what"], &rows).lines() {
            say!("    {line}");
        }
        say!(
            "    agent runs: {}  tokens in/out: {}/{}  cost: {}",
            runs.len(),
            usage.input_tokens,
            usage.output_tokens,
            orch_api::dto::UsageDto::new(usage).cost_text()
        );
        let verdict = events
            .iter()
            .rev()
            .find(|e| e.kind == events::POST_DEPLOY_VERDICT)
            .and_then(|v| {
                orch_domain::payload::read::<orch_domain::payload::WatchVerdict>(&v.data)
            });
        if let Some(v) = &verdict {
            say!(
                "    post-deploy watch: {} → action: {}",
                v.verdict.as_str(),
                v.action.as_str()
            );
        }
        say!();
    }
    say!("deploy history of repo service (what each production deploy shipped):");
    let deploys = store
        .events_by_kind(events::RELEASE_DEPLOYED, 0, 1000)
        .await?;
    for e in &deploys {
        let Some(d) = orch_domain::payload::read::<orch_domain::payload::ReleaseDeployed>(&e.data)
        else {
            continue;
        };
        let items: Vec<String> = d.items.iter().map(|i| i.label()).collect();
        say!(
            "    {:.12}  {}  ships: {}",
            d.revision,
            if d.confirmed {
                "confirmed"
            } else {
                "not confirmed"
            },
            if items.is_empty() {
                "-".to_owned()
            } else {
                items.join(", ")
            }
        );
    }
    for e in store
        .events_by_kind(events::RELEASE_REVERTED, 0, 1000)
        .await?
    {
        say!("    {}", e.message);
    }
    say!();
    if let Some(lines) = lesson_seen {
        say!(
            "the lesson reaches a later prompt: APP-3's analyst was given the repo's lessons and wrote"
        );
        for l in lines.lines() {
            say!("    {l}");
        }
        say!();
    }
    // The commands as printed must run: `orch` is this very binary (after `cargo run` it is
    // not on PATH), named by its full path unless PATH finds the same file.
    let exe = std::env::current_exe().context("cannot find the orch executable")?;
    let on_path = which("orch").and_then(|p| p.canonicalize().ok()) == exe.canonicalize().ok();
    let orch = if on_path {
        "orch".to_owned()
    } else {
        shell_quote(&exe.display().to_string())
    };
    let cfg = shell_quote(&config.display().to_string());
    say!("look around:");
    say!("  {orch} --config {cfg} status APP-1        # stage timeline, usage");
    say!("  {orch} --config {cfg} logs APP-2          # every event, agent runs");
    say!(
        "  git -C {} log --oneline --graph --all   # the artifact trail on orch/APP-* branches",
        shell_quote(&dir.join(".orch/repos/service").display().to_string())
    );
    say!(
        "  git -C {} log --format='%h %s' main  # main: the releases, APP-2's revert, the audit commits",
        shell_quote(&dir.join(".orch/repos/service").display().to_string())
    );
    say!(
        "  ls {}  # every item's whole trail, in the sample service's own checkout",
        shell_quote(
            &dir.join("service")
                .join(orch_domain::protect::WORK_ITEMS_DIR)
                .display()
                .to_string()
        )
    );
    say!("  {orch} --config {cfg} serve               # the dashboard again, on the same data");
    if !on_path {
        say!(
            "(to have `orch` on PATH: `cargo install --path crates/orch --locked` in orch's source tree)"
        );
    }
    Ok(orch_api::demo_report_json(
        store,
        "service",
        dir,
        Some(config),
        Some(started.elapsed().as_secs()),
        lesson_seen,
    )
    .await?)
}

/// `s` quoted for a POSIX shell when it needs it.
fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+:=@,".contains(c))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Stops the sample service's staging and production instances when dropped, and on Ctrl-C or
/// SIGTERM (then the process exits 130). An instance is any process whose working directory is
/// inside the demo's release store (`<state>/releases/…`): found through `/proc`, so an
/// instance a pid file lost track of is stopped too. SIGTERM, up to 3 s, then SIGKILL.
struct ServiceGuard {
    state: PathBuf,
    signals: tokio::task::JoinHandle<()>,
}

impl ServiceGuard {
    fn new(state: PathBuf) -> ServiceGuard {
        let releases = state.join("releases");
        let signals = tokio::spawn(async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot watch SIGTERM");
                        return;
                    }
                };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            crate::output::say("\norch demo: interrupted; stopping the sample service");
            stop_instances(&releases);
            std::process::exit(130);
        });
        ServiceGuard { state, signals }
    }
}

impl Drop for ServiceGuard {
    fn drop(&mut self) {
        self.signals.abort();
        stop_instances(&self.state.join("releases"));
    }
}

fn stop_instances(releases: &Path) {
    orch_exec::stop_processes_under(releases, Duration::from_secs(3));
}
