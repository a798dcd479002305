//! The presets with the REAL agent CLIs (Claude Code, Codex, Aider, installed at pinned
//! versions by `scripts/install-agent-clis` into `${ORCH_AGENT_CLI_CACHE:-~/.cache/orch-agent-clis}`)
//! against a scripted model server on 127.0.0.1 (`orch-modelserver`): the only fake is the
//! hosted model, faked at the wire. Per preset: success, a tool call, a permission denial,
//! the turn limit, an API error, a rate limit and a hang.
//!
//! A CLI that is not installed makes its tests print `SKIPPED: <reason>` and return; with
//! `ORCH_REQUIRE_AGENT_CLIS=1` (CI sets it when the install script succeeded) they fail
//! instead, so a broken install never passes silently.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use orch_domain::config::{
    AgentConfig, Backend, PromptVia, RepoConfig, Settings, default_prices, price_in,
};
use orch_domain::ids::AgentName;
use orch_domain::pipeline::Pipeline;
use orch_exec::git::Git;
use orch_modelserver::{Action, ModelServer, Reply, Script, Step, TURN_USAGE, artifact_writer};
use orch_runner::agents::{AgentExecutor, RetryPolicy};
use orch_runner::engine::{StageEffect, StageExecutor, StageRun};
use orch_store::testing::TestDb;
use orch_store::{AgentRun, Claim, Job, Lease, NewEvent, NewJob, NewTask, Task, WorkItemSpec};
use serde_json::Value;

// --- the installed CLIs ----------------------------------------------------------------------

use crate::support::agent_cli;
use agent_cli::agent_cli as cli;

// --- fixture ---------------------------------------------------------------------------------

const ID: &str = "CLI-1";

/// A work item with a real repo, worktree, SQLite store and a claimed job of the stage.
struct Fx {
    db: TestDb,
    _dir: tempfile::TempDir,
    repo_dir: PathBuf,
    worktree: PathBuf,
    task: Task,
    job: Job,
    lease: Lease,
}

impl Fx {
    async fn new(stage: &str, agent: &str) -> Fx {
        let db = TestDb::sqlite().await;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let repo_dir = root.join("repos/svc");
        let git = Git::new();
        common::init_repo(&git, &repo_dir, "svc\n").await;
        let worktree = repo_dir.join("worktrees").join(ID);
        git.worktree_add(&repo_dir, &worktree, "orch/CLI-1", "main")
            .await
            .unwrap();
        let task = db
            .store
            .create_task(NewTask {
                work_item: WorkItemSpec::Exact(ID.parse().unwrap()),
                repo: "svc".parse().unwrap(),
                title: "Add a dry-run flag".into(),
                body: "The CLI needs `--dry-run`.".into(),
                stage: stage.parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new("task.submitted", "submitted"),
                first_job: Some(NewJob::new(
                    agent,
                    format!("{{\"stage\":\"{stage}\",\"seq\":1}}"),
                )),
            })
            .await
            .unwrap();
        let c = db
            .store
            .claim(&Claim {
                worker_id: "test".into(),
                limit: 1,
                lease_ms: 600_000,
                kinds: vec![agent.into()],
                node: None,
                node_grace_ms: None,
            })
            .await
            .unwrap()
            .into_iter()
            .next()
            .expect("the job is claimed");
        Fx {
            db,
            _dir: dir,
            repo_dir,
            worktree,
            task,
            job: c.job,
            lease: c.lease,
        }
    }

    fn artifact_dir(&self) -> PathBuf {
        self.worktree.join("docs/work-items").join(ID)
    }

    fn run(&self, stage: &str) -> StageRun {
        let pipeline = Pipeline::default_pipeline();
        let stage = pipeline.stage(&stage.parse().unwrap()).unwrap().clone();
        let repo = RepoConfig {
            path: Some(self.repo_dir.display().to_string()),
            ..common::repo_config("CLI")
        };
        StageRun {
            stage,
            ..common::stage_run(
                &self.db,
                &self.task,
                self.job.clone(),
                self.lease,
                &self.repo_dir,
                repo,
            )
        }
    }

    async fn rows(&self) -> Vec<AgentRun> {
        self.db.store.task_agent_runs(self.task.id).await.unwrap()
    }

    async fn events(&self, kind: &str) -> Vec<orch_store::Event> {
        let all = self.db.store.task_events(self.task.id).await.unwrap();
        all.into_iter().filter(|e| e.kind == kind).collect()
    }

    /// `git status --porcelain` of the worktree (untracked files included) and the staged
    /// names.
    fn git_state(&self) -> (String, String) {
        let run = |args: &[&str]| {
            let out = std::process::Command::new("git")
                .args(args)
                .current_dir(&self.worktree)
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        (
            run(&[
                "status",
                "--porcelain",
                "--untracked-files=all",
                "--ignored",
            ]),
            run(&["diff", "--cached", "--name-only"]),
        )
    }
}

/// The variable holding the tests' API key: cargo sets it for every test process.
const KEY_VAR: &str = "CARGO_PKG_NAME";

fn config(backend: Backend, program: &Path, endpoint: String, model: &str) -> AgentConfig {
    AgentConfig {
        backend,
        command: Some(program.display().to_string()),
        args: Vec::new(),
        prompt_via: PromptVia::Stdin,
        model: Some(model.into()),
        endpoint: Some(endpoint),
        api_key_env: Some(KEY_VAR.into()),
        timeout_s: Some(240), // aider alone takes 10-20 s to start; a loaded machine triples it
        allowed_tools: None,
        disallowed_tools: None,
        max_turns: None,
        cli_retries: Some(0),
        config_home: None,
        price: None,
        network: Vec::new(),
        env: Vec::new(),
    }
}

fn executor(agent: &str, config: AgentConfig, settings: &Settings) -> AgentExecutor {
    let agents = [(agent.parse::<AgentName>().unwrap(), config)]
        .into_iter()
        .collect();
    AgentExecutor::new(agents, settings).with_retry(RetryPolicy {
        tries: 3,
        base: Duration::from_millis(20),
        max: Duration::from_millis(100),
    })
}

fn outcomes(rows: &[AgentRun]) -> Vec<&str> {
    rows.iter().map(|r| r.outcome.as_str()).collect()
}

fn data(row: &AgentRun) -> Value {
    serde_json::from_str(&row.data).unwrap()
}

fn failed_reason(effect: StageEffect) -> String {
    match effect {
        StageEffect::Failed { reason } => reason,
        other => panic!("expected the stage to fail for good, got {other:?}"),
    }
}

/// The artifact orch asked for is there and its gate passes.
fn assert_artifact(fx: &Fx, name: &str, stage: &str) {
    let path = fx.artifact_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        text.contains(&format!("work_item: {ID}\nstage: {stage}\n")),
        "{text}"
    );
}

const SECOND: Duration = Duration::from_secs(1);

// --- presets ---------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum P {
    Claude,
    Codex,
    Aider,
}

impl P {
    fn tool(self) -> &'static str {
        match self {
            P::Claude => "claude",
            P::Codex => "codex",
            P::Aider => "aider",
        }
    }

    fn backend(self) -> Backend {
        match self {
            P::Claude => Backend::Claude,
            P::Codex => Backend::Codex,
            P::Aider => Backend::Aider,
        }
    }

    /// A model each CLI accepts; Claude Code and Aider price these themselves, orch's price
    /// table prices Codex's.
    fn model(self) -> &'static str {
        match self {
            P::Claude => "claude-sonnet-4-5",
            P::Codex => "gpt-5-codex",
            P::Aider => "gpt-4.1",
        }
    }

    fn endpoint(self, server: &ModelServer) -> String {
        match self {
            P::Claude => server.url(),
            P::Codex | P::Aider => server.openai_url(),
        }
    }
}

/// Everything one scenario needs, or `None` when the CLI is not installed (reported).
struct Case {
    fx: Fx,
    server: ModelServer,
    config: AgentConfig,
    agent: &'static str,
    stage: &'static str,
}

async fn case(p: P, stage: &'static str, brain: impl orch_modelserver::Brain) -> Option<Case> {
    let program = cli(p.tool())?;
    let agent = match stage {
        "implementation" => "developer",
        "review" => "reviewer",
        "architecture" => "architect",
        _ => "analyst",
    };
    let fx = Fx::new(stage, agent).await;
    let server = ModelServer::start(brain).await.unwrap();
    let mut config = config(p.backend(), &program, p.endpoint(&server), p.model());
    // The price loading orch.toml resolves (the built-in table).
    config.price = price_in(&default_prices(), p.model());
    Some(Case {
        fx,
        server,
        config,
        agent,
        stage,
    })
}

impl Case {
    async fn execute(&self) -> anyhow::Result<StageEffect> {
        let ex = executor(self.agent, self.config.clone(), &Settings::default());
        ex.execute(&self.fx.run(self.stage)).await
    }

    fn artifact(&self) -> &'static str {
        match self.stage {
            "implementation" => "10-implementation.md",
            _ => "02-requirements.md",
        }
    }
}

/// Fails turn 0 with `status` for its first `times` requests, then writes what orch asks.
fn fail_then_write(status: u16, times: u32) -> impl orch_modelserver::Brain {
    let writer = artifact_writer(Vec::new());
    move |turn: &orch_modelserver::Turn| {
        if turn.index == 0 && turn.hits < times {
            return Reply::Status(status, format!("scripted {status}"));
        }
        orch_modelserver::Brain::reply(&writer, turn)
    }
}

/// Processes whose working directory is inside `dir` (a CLI or a child it left behind).
fn processes_in(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = e.file_name().to_string_lossy().into_owned();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(cwd) = std::fs::read_link(e.path().join("cwd"))
            && cwd.starts_with(dir)
        {
            let cmd = std::fs::read_to_string(e.path().join("cmdline")).unwrap_or_default();
            found.push(format!("{pid}: {}", cmd.replace('\0', " ")));
        }
    }
    found
}

/// Polls until no process runs in `dir` (the killed group is being reaped), with a deadline.
async fn assert_no_process_in(dir: &Path) {
    let t0 = Instant::now();
    loop {
        let left = processes_in(dir);
        if left.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < 10 * SECOND,
            "processes left in {}: {left:?}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// --- scenarios -------------------------------------------------------------------------------

/// Success: the CLI writes the stage's artifact through its own file tool; usage and cost are
/// read (reported by the tool, or priced by orch's table); the agent gets only its role's
/// tools and its own configuration home.
async fn success(p: P) {
    let Some(c) = case(p, "analysis", artifact_writer(Vec::new())).await else {
        return;
    };
    let effect = c.execute().await.unwrap();
    assert!(
        matches!(effect, StageEffect::Produced { outcome: None }),
        "{effect:?}"
    );
    assert_artifact(&c.fx, c.artifact(), "analysis");
    let rows = c.fx.rows().await;
    assert_eq!(outcomes(&rows), ["ok"], "{rows:?}");
    let r = &rows[0];
    let d = data(r);
    assert_eq!(d["config_home"], "run", "{d}");
    let (tin, tout) = (TURN_USAGE.0 as i64, TURN_USAGE.1 as i64);
    match p {
        P::Claude => {
            // Two turns: the Write, then the final answer; Claude Code sums their usage and
            // prices it itself.
            assert_eq!(
                (r.input_tokens, r.output_tokens),
                (Some(2 * tin), Some(2 * tout))
            );
            let cost = r.cost_usd.expect("Claude Code reports its cost");
            assert!(
                (cost - (2.0 * 1000.0 * 3.0 + 2.0 * 100.0 * 15.0) / 1e6).abs() < 1e-9,
                "{cost}"
            );
            assert_eq!(d["cost_source"], "reported");
            assert_eq!(d["claude_subtype"], "success");
            let mut tools = c.server.turns()[0].tool_names();
            tools.sort();
            assert_eq!(
                tools,
                ["Edit", "Read", "Write"],
                "a document stage gets file tools only"
            );
        }
        P::Codex => {
            assert_eq!(
                (r.input_tokens, r.output_tokens),
                (Some(2 * tin), Some(2 * tout))
            );
            // Codex reports no cost: orch's price table (gpt-5-codex: $1.25 / $10 per Mtok).
            let cost = r.cost_usd.expect("priced by the table");
            assert!(
                (cost - (2000.0 * 1.25 + 200.0 * 10.0) / 1e6).abs() < 1e-9,
                "{cost}"
            );
            assert_eq!(d["cost_source"], "price_table");
            // The unknown-model-metadata warning item is recorded, not fatal.
            assert!(d["codex_warnings"].to_string().contains("metadata"), "{d}");
        }
        P::Aider => {
            // Aider counts tokens itself and prices models it knows (its `Cost:` line).
            assert!(
                r.input_tokens.is_some_and(|t| t > 0) && r.output_tokens.is_some_and(|t| t > 0),
                "{r:?}"
            );
            assert!(r.cost_usd.is_some_and(|c| c > 0.0), "{r:?}");
            assert_eq!(d["cost_source"], "reported");
            // The worktree holds the artifact and nothing of Aider's; nothing is staged.
            let (status, staged) = c.fx.git_state();
            assert_eq!(
                status,
                format!("?? docs/work-items/{ID}/02-requirements.md\n")
            );
            assert_eq!(staged, "");
        }
    }
}

/// A tool call: the developer's command runs (Claude Code's Bash, Codex's exec_command);
/// Aider edits a code file besides the artifact.
async fn tool_call(p: P) {
    let brain: Box<dyn Fn(&orch_modelserver::Turn) -> Reply + Send + Sync> = match p {
        P::Aider => Box::new(|turn: &orch_modelserver::Turn| {
            let ask = orch_modelserver::Ask::of(&turn.prompt);
            let mut writes = vec![Action::Write {
                path: "app.py".into(),
                content: "print('dry run')\n".into(),
            }];
            writes.extend(ask.writes(&turn.model));
            Reply::Tools(writes)
        }),
        _ => {
            let w = artifact_writer(vec![Action::Bash(
                "git status --short >/dev/null && echo ran > bash-ran.txt && echo \"$HOME\" > home.txt"
                    .into(),
            )]);
            Box::new(move |t: &orch_modelserver::Turn| orch_modelserver::Brain::reply(&w, t))
        }
    };
    let Some(c) = case(p, "implementation", move |t: &orch_modelserver::Turn| {
        brain(t)
    })
    .await
    else {
        return;
    };
    let effect = c.execute().await.unwrap();
    assert!(
        matches!(effect, StageEffect::Produced { outcome: None }),
        "{effect:?} {:?}",
        c.fx.rows().await
    );
    assert_artifact(&c.fx, c.artifact(), "implementation");
    let rows = c.fx.rows().await;
    assert_eq!(outcomes(&rows), ["ok"], "{rows:?}");
    match p {
        P::Aider => {
            assert_eq!(
                std::fs::read_to_string(c.fx.worktree.join("app.py")).unwrap(),
                "print('dry run')\n"
            );
            assert_eq!(c.fx.git_state().1, "", "Aider's `git add` is undone");
        }
        _ => {
            let ran = std::fs::read_to_string(c.fx.worktree.join("bash-ran.txt")).unwrap();
            assert_eq!(ran.trim(), "ran");
            // The CLI ran with a configuration home of its own, not the orch user's.
            let home = std::fs::read_to_string(c.fx.worktree.join("home.txt")).unwrap();
            let own = std::env::var("HOME").unwrap_or_default();
            assert!(home.contains("orch-agent-") && home.trim() != own, "{home}");
        }
    }
    if p == P::Claude {
        let mut tools = c.server.turns()[0].tool_names();
        tools.sort();
        assert_eq!(
            tools,
            ["Bash", "Edit", "Read", "Write"],
            "the developer also runs commands"
        );
    }
}

/// A permission denial: Claude Code refuses a command outside the allowed ones; Codex's
/// sandbox refuses a write outside the worktree. Both are recorded in the run, appended as
/// an event, and fail the stage for good (not `ok`, not retried). Aider never runs the
/// commands a model suggests.
async fn permission_denial(p: P) {
    // Outside the worktree and outside /tmp (which Codex's workspace-write sandbox allows).
    // Not under the checkout either: Codex also lets the agent write in the git repository that
    // holds its working directory (the target dir sits in orch's own checkout).
    let outside_dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let outside = outside_dir.path().join("outside.txt");
    let before = match p {
        P::Claude => Action::Bash("python3 -m unittest -q".into()),
        P::Codex | P::Aider => Action::Bash(format!("touch {}", outside.display())),
    };
    let brain: Box<dyn Fn(&orch_modelserver::Turn) -> Reply + Send + Sync> = match p {
        P::Aider => {
            let before = before.clone();
            Box::new(move |turn: &orch_modelserver::Turn| {
                let mut all = vec![before.clone()];
                all.extend(orch_modelserver::Ask::of(&turn.prompt).writes(&turn.model));
                Reply::Tools(all)
            })
        }
        _ => {
            let w = artifact_writer(vec![before.clone()]);
            Box::new(move |t: &orch_modelserver::Turn| orch_modelserver::Brain::reply(&w, t))
        }
    };
    let Some(mut c) = case(p, "implementation", move |t: &orch_modelserver::Turn| {
        brain(t)
    })
    .await
    else {
        return;
    };
    if p == P::Claude {
        c.config.allowed_tools = Some(vec![
            "Read".into(),
            "Write".into(),
            "Edit".into(),
            "Bash(git status:*)".into(),
        ]);
    }
    let effect = c.execute().await.unwrap();
    let rows = c.fx.rows().await;
    if p == P::Aider {
        assert!(
            matches!(effect, StageEffect::Produced { outcome: None }),
            "{effect:?}"
        );
        assert!(!outside.exists(), "Aider ran a suggested command");
        assert_eq!(outcomes(&rows), ["ok"]);
        return;
    }
    let reason = failed_reason(effect);
    assert!(reason.contains("was denied"), "{reason}");
    let expect = match p {
        P::Claude => "Bash `python3 -m unittest -q`",
        _ => "sandbox `",
    };
    assert!(reason.contains(expect), "{reason}");
    assert_eq!(
        outcomes(&rows),
        ["permission_denied"],
        "one run, not retried"
    );
    let d = data(&rows[0]);
    assert_eq!(d["permission_denials"][0]["required"], true, "{d}");
    let events = c.fx.events("agent.permission_denied").await;
    assert_eq!(events.len(), 1);
    assert!(
        events[0].message.contains("was denied"),
        "{}",
        events[0].message
    );
    assert!(!outside.exists());
}

/// The turn limit: Claude Code stops at `--max-turns` (error_max_turns with its errors[]
/// text), a permanent failure: the stage fails at once, one run. Codex has no turn limit: a
/// model that never stops is killed at the timeout. Aider asks once per message: a reply
/// without an edit leaves the artifact missing.
async fn max_turns(p: P) {
    let brain: Box<dyn Fn(&orch_modelserver::Turn) -> Reply + Send + Sync> = match p {
        P::Claude => Box::new(|t: &orch_modelserver::Turn| {
            Reply::Tools(vec![Action::Write {
                path: format!("notes/turn-{}.md", t.index),
                content: "thinking\n".into(),
            }])
        }),
        P::Codex => {
            Box::new(|_: &orch_modelserver::Turn| Reply::Tools(vec![Action::Bash("true".into())]))
        }
        P::Aider => {
            Box::new(|_: &orch_modelserver::Turn| Reply::Text("I have nothing to change.".into()))
        }
    };
    let Some(mut c) = case(p, "analysis", move |t: &orch_modelserver::Turn| brain(t)).await else {
        return;
    };
    c.config.max_turns = Some(2);
    if p == P::Codex {
        c.config.timeout_s = Some(8);
    }
    let result = c.execute().await;
    let rows = c.fx.rows().await;
    match p {
        P::Claude => {
            let reason = failed_reason(result.unwrap());
            assert!(reason.contains("error_max_turns"), "{reason}");
            assert!(
                reason.contains("maximum number of turns"),
                "the errors[] text: {reason}"
            );
            assert_eq!(outcomes(&rows), ["error"], "not retried");
            assert_eq!(data(&rows[0])["claude_subtype"], "error_max_turns");
        }
        P::Codex => {
            let e = result.unwrap_err().to_string();
            assert!(e.contains("timed out"), "{e}");
            assert_eq!(outcomes(&rows), ["timeout"]);
            assert_eq!(data(&rows[0])["usage_unknown"], true);
            assert_no_process_in(&c.fx.worktree).await;
        }
        P::Aider => {
            let e = result.unwrap_err().to_string();
            assert!(e.contains("without writing"), "{e}");
            assert_eq!(outcomes(&rows), ["missing_artifact"]);
        }
    }
}

/// An API error: HTTP 500 is transient (retried within the attempt with backoff, the status
/// recorded), 401 is permanent (the stage fails at once with the CLI's message; Aider
/// exits 0 then, and orch reads the failure from its output).
async fn api_error(p: P, status: u16) {
    let Some(c) = case(p, "analysis", fail_then_write(status, u32::MAX)).await else {
        return;
    };
    let result = c.execute().await;
    let rows = c.fx.rows().await;
    if status == 401 {
        let reason = failed_reason(result.unwrap());
        assert!(reason.contains("not retried"), "{reason}");
        // What to set, in orch's terms.
        assert!(
            reason.contains(&format!(
                "check the key in `{KEY_VAR}` (named by api_key_env"
            )),
            "{reason}"
        );
        assert_eq!(outcomes(&rows), ["error"], "one run: {rows:?}");
        if p == P::Claude {
            assert_eq!(data(&rows[0])["claude_api_error_status"], 401);
        }
        if p == P::Aider {
            assert_eq!(
                rows[0].exit_code,
                Some(0),
                "aider exits 0 when authentication fails"
            );
            assert!(reason.to_lowercase().contains("authentic"), "{reason}");
        }
        return;
    }
    let e = result.unwrap_err().to_string();
    assert!(e.contains("still failing after 3 tries"), "{e}");
    // Codex 0.171 words a 500 as "high demand … temporary errors" without the status.
    assert!(
        e.contains("500") || (p == P::Codex && e.contains("temporary")),
        "{e}"
    );
    assert_eq!(outcomes(&rows), ["transient_error"; 3]);
    if p == P::Claude {
        let d = data(&rows[0]);
        assert_eq!(d["claude_api_error_status"], 500, "{d}");
    }
}

/// A key variable that is not set: the stage fails at once (one run, not retried) before the
/// CLI starts, saying what to set; the model is never asked.
async fn missing_key(p: P) {
    let Some(mut c) = case(p, "analysis", artifact_writer(Vec::new())).await else {
        return;
    };
    c.config.api_key_env = Some("ORCH_TEST_SURELY_UNSET_KEY_91".into());
    let reason = failed_reason(c.execute().await.unwrap());
    assert!(
        reason.contains("`ORCH_TEST_SURELY_UNSET_KEY_91` is not set")
            && reason.contains("api_key_env")
            && reason.contains("export ORCH_TEST_SURELY_UNSET_KEY_91=")
            && reason.contains("not retried"),
        "{reason}"
    );
    assert_eq!(outcomes(&c.fx.rows().await), ["error"]);
    assert!(
        c.server.requests().is_empty(),
        "the CLI never reached the model"
    );
}

/// Nothing listens at the endpoint: a refused connection is transient (Claude Code 2.1.197
/// says "Unable to connect to API (ConnectionRefused)", newer ones `api_error:
/// "connection_failed"`), retried within the attempt. (Codex keeps reconnecting by itself
/// until the run's timeout, so it is not a scenario of its own.)
async fn refused(p: P) {
    let Some(mut c) = case(p, "analysis", artifact_writer(Vec::new())).await else {
        return;
    };
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    c.config.endpoint = Some(format!("http://127.0.0.1:{port}"));
    let e = c.execute().await.unwrap_err().to_string();
    assert!(e.contains("still failing after 3 tries"), "{e}");
    let rows = c.fx.rows().await;
    assert_eq!(outcomes(&rows), ["transient_error"; 3], "{rows:?}");
    println!("{p:?} refused: {e}");
}

/// A rate limit: 429 on the first request. Claude Code and Codex (their own retries off)
/// fail the try as transient and orch's next try succeeds; Aider retries by itself.
async fn rate_limit(p: P) {
    let Some(c) = case(p, "analysis", fail_then_write(429, 1)).await else {
        return;
    };
    let effect = c.execute().await.unwrap();
    assert!(
        matches!(effect, StageEffect::Produced { outcome: None }),
        "{effect:?}"
    );
    assert_artifact(&c.fx, c.artifact(), "analysis");
    let rows = c.fx.rows().await;
    match p {
        P::Aider => assert_eq!(outcomes(&rows), ["ok"]),
        _ => assert_eq!(outcomes(&rows), ["transient_error", "ok"], "{rows:?}"),
    }
    let first_turns = c
        .server
        .turns()
        .iter()
        .filter(|r| r.turn == Some(0))
        .count();
    assert!(first_turns >= 2, "the 429 was retried");
}

/// A hang: the model never answers; the run is killed with its process group at the
/// timeout, its usage recorded as unknown (not zero).
async fn hang(p: P) {
    let Some(mut c) = case(p, "analysis", Script(vec![Step::ok(Reply::Hang)])).await else {
        return;
    };
    c.config.timeout_s = Some(4);
    let e = c.execute().await.unwrap_err().to_string();
    assert!(e.contains("timed out after 4s"), "{e}");
    let rows = c.fx.rows().await;
    assert_eq!(outcomes(&rows), ["timeout"]);
    let d = data(&rows[0]);
    assert_eq!(d["usage_unknown"], true, "{d}");
    assert_eq!((rows[0].input_tokens, rows[0].cost_usd), (None, None));
    assert_no_process_in(&c.fx.worktree).await;
}

macro_rules! scenarios {
    ($($name:ident => $body:expr;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let t0 = Instant::now();
                $body.await;
                println!("{} took {:.1}s", stringify!($name), t0.elapsed().as_secs_f64());
            }
        )*
    };
}

scenarios! {
    claude_success_writes_the_artifact_with_file_tools_only => success(P::Claude);
    claude_tool_call_runs_the_developers_command => tool_call(P::Claude);
    claude_permission_denial_is_recorded_and_fails_the_stage => permission_denial(P::Claude);
    claude_max_turns_fails_at_once_with_its_errors_text => max_turns(P::Claude);
    claude_api_500_is_retried_within_the_attempt_with_its_status => api_error(P::Claude, 500);
    claude_api_401_fails_at_once => api_error(P::Claude, 401);
    claude_rate_limit_is_retried_and_succeeds => rate_limit(P::Claude);
    claude_unset_key_variable_fails_at_once_saying_what_to_set => missing_key(P::Claude);
    claude_refused_connection_is_transient => refused(P::Claude);
    codex_unset_key_variable_fails_at_once_saying_what_to_set => missing_key(P::Codex);
    aider_unset_key_variable_fails_at_once_saying_what_to_set => missing_key(P::Aider);
    claude_hang_is_killed_with_its_process_group => hang(P::Claude);

    codex_success_is_priced_by_the_table => success(P::Codex);
    codex_tool_call_runs_the_command => tool_call(P::Codex);
    codex_sandbox_denial_is_recorded_and_fails_the_stage => permission_denial(P::Codex);
    codex_has_no_turn_limit_so_a_looping_model_meets_the_timeout => max_turns(P::Codex);
    codex_api_500_is_retried_within_the_attempt => api_error(P::Codex, 500);
    codex_api_401_fails_at_once => api_error(P::Codex, 401);
    codex_rate_limit_is_retried_and_succeeds => rate_limit(P::Codex);
    codex_hang_is_killed_with_its_process_group => hang(P::Codex);

    aider_success_leaves_the_worktree_clean_and_reads_its_cost => success(P::Aider);
    aider_tool_call_edits_a_file_and_nothing_stays_staged => tool_call(P::Aider);
    aider_does_not_run_commands_the_model_suggests => permission_denial(P::Aider);
    aider_reply_without_an_edit_is_a_missing_artifact => max_turns(P::Aider);
    aider_api_401_fails_at_once_though_aider_exits_0 => api_error(P::Aider, 401);
    aider_rate_limit_is_retried_by_aider_itself => rate_limit(P::Aider);
    aider_hang_is_killed_with_its_process_group => hang(P::Aider);
}
