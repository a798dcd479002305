//! CLI agent backends (design.md §4): any program (`command`), and the presets for today's Claude
//! Code (`claude -p --output-format json`), Codex CLI (`codex exec --json`) and Aider, each
//! checked against the real CLI (see the README for the versions).
//!
//! The program runs in the work item's worktree through `orch_exec::process::run` (its own
//! process group, the agent's timeout, the job's cancellation, bounded output). The prompt
//! goes on stdin or in a temporary file outside the worktree (`ORCH_PROMPT_FILE`, or the
//! `{prompt_file}` placeholder in the arguments), deleted when the try ends. `ORCH_*`
//! variables name the work item, stage, worktree and expected artifact.
//!
//! The presets run each CLI with a configuration home of its own per run (a directory of the
//! run as `HOME`, and `CODEX_HOME` below it: the supervised command's durable state directory,
//! so a lost run's session can continue, see [`super::resume`]; a temporary one without
//! supervision), so the orch user's settings, hooks and
//! logins do not leak in (`config_home = "user"` opts out), give each role only the tools it
//! needs, and read the CLI's own report: tokens and cost, errors (classified permanent or
//! transient, see [`Class`]) and permission denials. A run whose report cannot be read has
//! unknown usage, which budgets count conservatively.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use orch_domain::config::{AgentConfig, Backend, PromptVia};
use orch_exec::process::{Cmd, ExitKind, Output, SpawnError, run as run_process};
use serde_json::{Value, json};

use super::{
    AgentError, Denial, Invocation, MAX_ERROR_BYTES, TokenUsage, TryEnd, TryResult, bound_text,
    mentions_transient,
};

/// Bytes kept from the end of stdout and of stderr. Claude Code's result object is the whole
/// of its stdout, so this bounds the largest result it can report.
const OUTPUT_LIMIT: usize = 4 * 1024 * 1024;
/// How much of the end of the output is searched for transient-error words.
const TRANSIENT_SCAN_BYTES: usize = 8 * 1024;

/// Claude Code's default turn limit per run.
pub(crate) const DEFAULT_MAX_TURNS: u32 = 50;
/// Retries a CLI makes itself on API errors, by default.
pub(crate) const DEFAULT_CLI_RETRIES: u32 = 2;

/// Claude Code tools no role gets unless configured: the web, scheduling, sub-agents,
/// worktree switching and messaging.
const CLAUDE_DENIED_TOOLS: [&str; 17] = [
    "WebFetch",
    "WebSearch",
    "Agent",
    "Task",
    "CronCreate",
    "CronDelete",
    "CronList",
    "ScheduleWakeup",
    "Workflow",
    "SendMessage",
    "EnterWorktree",
    "ExitWorktree",
    "Skill",
    "TaskCreate",
    "TaskUpdate",
    "TaskStop",
    "ReportFindings",
];

/// Tools whose denial means the agent could not do its work (a write, an edit, a command):
/// such a run fails for good.
const REQUIRED_TOOLS: [&str; 5] = ["Write", "Edit", "MultiEdit", "NotebookEdit", "Bash"];

/// What a role may do: document stages read and write files; the stage that may write code
/// (the developer's) also runs the repo's commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Reads and writes files.
    Documents,
    /// Reads and writes files and runs commands.
    Commands,
}

impl Role {
    /// The role of the agent running `stage`, from its descriptor
    /// ([`orch_domain::pipeline::StageDef::writes_code`]).
    pub(crate) fn of(stage: &orch_domain::pipeline::StageDef) -> Role {
        if stage.writes_code {
            Role::Commands
        } else {
            Role::Documents
        }
    }

    fn claude_tools(self) -> &'static [&'static str] {
        match self {
            Role::Documents => &["Read", "Write", "Edit"],
            Role::Commands => &["Read", "Write", "Edit", "Bash"],
        }
    }
}

/// How a backend's stdout is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parser {
    /// Not read (no usage reported).
    Plain,
    /// Claude Code's JSON result object.
    Claude,
    /// Codex CLI's JSONL events.
    Codex,
    /// Aider's console output.
    Aider,
}

/// The program line of a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    program: String,
    args: Vec<String>,
    via: PromptVia,
    parser: Parser,
    /// Variables set for this preset (never secrets: those are added at spawn time).
    env: Vec<(String, String)>,
    /// `$CODEX_HOME/config.toml` to write before the run.
    codex_config: Option<String>,
}

/// Where a run's private files live: `home` (its `HOME`, unless the user's is kept) and
/// `files` (aider's history files).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Dirs {
    /// `None` keeps the orch user's `HOME`.
    home: Option<PathBuf>,
    files: PathBuf,
}

/// The program, arguments, prompt channel, variables and output parser of `config`.
/// `contained`: orch's own sandbox runs the CLI (a CLI's own sandbox cannot be set up inside
/// it: Codex's then runs with full access inside orch's).
fn plan(config: &AgentConfig, role: Role, dirs: &Dirs, contained: bool) -> Result<Plan, String> {
    let model_args = |flag: &str| -> Vec<String> {
        config
            .model
            .iter()
            .flat_map(|m| [flag.to_owned(), m.clone()])
            .collect()
    };
    let program = |default: &str| {
        config
            .command
            .clone()
            .filter(|c| !c.trim().is_empty())
            .unwrap_or_else(|| default.to_owned())
    };
    let strs = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let mut env: Vec<(String, String)> = Vec::new();
    if let Some(home) = &dirs.home {
        env.push(("HOME".into(), home.display().to_string()));
    }
    let retries = config.cli_retries.unwrap_or(DEFAULT_CLI_RETRIES);
    Ok(match config.backend {
        Backend::Command => Plan {
            program: config
                .command
                .clone()
                .filter(|c| !c.trim().is_empty())
                .ok_or("the `command` backend needs a `command`")?,
            args: config.args.clone(),
            via: config.prompt_via,
            parser: Parser::Plain,
            // Its own HOME, as the presets get (orch's is hidden in the sandbox).
            env,
            codex_config: None,
        },
        Backend::Claude => {
            let allowed: Vec<String> = match &config.allowed_tools {
                Some(list) => list.clone(),
                None => strs(role.claude_tools()),
            };
            let disallowed: Vec<String> = match &config.disallowed_tools {
                Some(list) => list.clone(),
                None => strs(&CLAUDE_DENIED_TOOLS),
            };
            // The tools the model is offered: the role's, plus any allowed by configuration
            // (`Bash(git status:*)` offers `Bash`), minus the refused ones.
            let mut offered: Vec<String> = strs(role.claude_tools());
            for a in &allowed {
                let name = a.split('(').next().unwrap_or(a).trim().to_owned();
                if !name.is_empty() && !offered.contains(&name) {
                    offered.push(name);
                }
            }
            offered.retain(|t| !disallowed.contains(t));
            // stream-json (which `-p` wants with `--verbose`): every message, tool call and
            // tool result as a line, the result object last — the run's transcript.
            let mut args = strs(&[
                "-p",
                "--output-format",
                "stream-json",
                "--verbose",
                "--max-turns",
            ]);
            args.push(config.max_turns.unwrap_or(DEFAULT_MAX_TURNS).to_string());
            args.push("--tools".into());
            args.push(offered.join(","));
            if !allowed.is_empty() {
                args.push("--allowedTools".into());
                args.push(allowed.join(","));
            }
            if !disallowed.is_empty() {
                args.push("--disallowedTools".into());
                args.push(disallowed.join(","));
            }
            env.push((
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC".into(),
                "1".into(),
            ));
            env.push(("CLAUDE_CODE_MAX_RETRIES".into(), retries.to_string()));
            if let Some(url) = &config.endpoint {
                env.push(("ANTHROPIC_BASE_URL".into(), url.clone()));
            }
            Plan {
                program: program("claude"),
                args: [args, model_args("--model"), config.args.clone()].concat(),
                via: config.prompt_via,
                parser: Parser::Claude,
                env,
                codex_config: None,
            }
        }
        Backend::Codex => {
            let stdin_marker = match config.prompt_via {
                PromptVia::Stdin => strs(&["-"]),
                PromptVia::File => Vec::new(),
            };
            let codex_config = dirs.home.as_ref().map(|home| {
                env.push((
                    "CODEX_HOME".into(),
                    home.join(".codex").display().to_string(),
                ));
                codex_config(config, retries)
            });
            Plan {
                program: program("codex"),
                args: [
                    strs(&[
                        "exec",
                        "--json",
                        "-s",
                        if contained {
                            "danger-full-access"
                        } else {
                            "workspace-write"
                        },
                        "--skip-git-repo-check",
                    ]),
                    model_args("-m"),
                    config.args.clone(),
                    stdin_marker,
                ]
                .concat(),
                via: config.prompt_via,
                parser: Parser::Codex,
                env,
                codex_config,
            }
        }
        Backend::Aider => {
            let file = |name: &str| dirs.files.join(name).display().to_string();
            let mut args = strs(&[
                "--yes-always",
                "--no-auto-commits",
                "--no-dirty-commits",
                "--no-gitignore",
                "--map-tokens",
                "0",
                "--no-auto-lint",
                "--no-detect-urls",
                "--no-check-update",
                "--no-show-release-notes",
                "--no-analytics",
                "--no-pretty",
                "--no-fancy-input",
                "--no-show-model-warnings",
            ]);
            args.extend([
                "--chat-history-file".to_owned(),
                file("chat.history.md"),
                "--input-history-file".to_owned(),
                file("input.history"),
                "--llm-history-file".to_owned(),
                file("llm.history"),
                "--message-file".to_owned(),
                "{prompt_file}".to_owned(),
            ]);
            if let Some(model) = &config.model {
                // An OpenAI-compatible endpoint is reached through litellm's `openai/` route.
                let model = if config.endpoint.is_some() && !model.contains('/') {
                    format!("openai/{model}")
                } else {
                    model.clone()
                };
                args.extend(["--model".to_owned(), model]);
            }
            if let Some(url) = &config.endpoint {
                args.extend(["--openai-api-base".to_owned(), url.clone()]);
            }
            // litellm would fetch its price list from the internet on every start.
            env.push(("LITELLM_LOCAL_MODEL_COST_MAP".into(), "True".into()));
            Plan {
                program: program("aider"),
                args: [args, config.args.clone()].concat(),
                via: PromptVia::File,
                parser: Parser::Aider,
                env,
                codex_config: None,
            }
        }
        Backend::Openai => return Err("the `openai` backend is not a command".to_owned()),
    })
}

/// How a try continues or names its CLI session ([`super::resume`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct SessionArgs {
    /// Continue this session (a valid id; Aider: any value restores its chat history).
    resume: Option<String>,
    /// Start a new session with this id (Claude Code's `--session-id`).
    new_id: Option<String>,
    /// The command is adopted (running, or ended while orch was away): orch writes nothing
    /// into its home, which its agent may still be writing.
    adopting: bool,
}

/// `plan` with the session arguments of its CLI: Claude Code `--resume <id>` or
/// `--session-id <id>`, Codex `exec … resume <id> -`, Aider `--restore-chat-history`.
fn with_session(mut plan: Plan, backend: Backend, session: &SessionArgs) -> Plan {
    match (backend, &session.resume, &session.new_id) {
        (Backend::Claude, Some(id), _) => {
            plan.args.extend(["--resume".to_owned(), id.clone()]);
        }
        (Backend::Claude, None, Some(id)) => {
            plan.args.extend(["--session-id".to_owned(), id.clone()]);
        }
        (Backend::Codex, Some(id), _) => {
            // `resume <id>` is a subcommand of `exec`: after exec's options, before the
            // prompt's `-`.
            let at = if plan.via == PromptVia::Stdin && plan.args.last().is_some_and(|a| a == "-") {
                plan.args.len() - 1
            } else {
                plan.args.len()
            };
            plan.args.insert(at, id.clone());
            plan.args.insert(at, "resume".to_owned());
        }
        (Backend::Aider, Some(_), _) => plan.args.push("--restore-chat-history".to_owned()),
        _ => {}
    }
    plan
}

/// A TOML string literal.
fn toml_str(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// `$CODEX_HOME/config.toml` of a run: a provider `orch` speaking the Responses API at the
/// agent's `endpoint` (OpenAI's by default) with the key from `api_key_env`.
fn codex_config(config: &AgentConfig, retries: u32) -> String {
    let base_url = config
        .endpoint
        .clone()
        .unwrap_or_else(|| "https://api.openai.com/v1".to_owned());
    let key = config
        .api_key_env
        .clone()
        .unwrap_or_else(|| "OPENAI_API_KEY".to_owned());
    let mut text = String::from("# Written by orch for one agent run.\n");
    if let Some(model) = &config.model {
        text.push_str(&format!("model = {}\n", toml_str(model)));
    }
    text.push_str(&format!(
        "model_provider = \"orch\"\napproval_policy = \"never\"\n\n[model_providers.orch]\n\
         name = \"orch\"\nbase_url = {}\nwire_api = \"responses\"\nenv_key = {}\n\
         request_max_retries = {retries}\nstream_max_retries = {retries}\n",
        toml_str(&base_url),
        toml_str(&key)
    ));
    text
}

/// With `config_home = "user"`, the CLI's own files in the orch user's `HOME` (its login and
/// settings), which the run's sandbox then shows writable; nothing else of `HOME`.
fn user_config_dirs(backend: Backend) -> Vec<PathBuf> {
    let Some(home) = std::env::var_os("HOME").map(PathBuf::from) else {
        return Vec::new();
    };
    let names: &[&str] = match backend {
        Backend::Claude => &[".claude", ".claude.json"],
        Backend::Codex => &[".codex"],
        Backend::Aider => &[".aider"],
        Backend::Command | Backend::Openai => &[],
    };
    names.iter().map(|n| home.join(n)).collect()
}

/// Whether the run's configuration home is its own (`config_home` unset or `run`).
fn home_is_the_runs(config: &AgentConfig) -> bool {
    matches!(
        config.config_home.as_deref().map(str::trim),
        None | Some("run")
    )
}

/// Makes `dir` a real directory: a link or a file at its name (a kept home is the agent's
/// to write) is removed, never followed.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => std::fs::remove_file(dir)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::create_dir_all(dir)
}

/// Writes `name` in `dir` afresh: whatever was at the name is removed first (a link is
/// removed, not followed) and the file is created new (`O_EXCL`: never through a link).
fn write_new(dir: &Path, name: &str, text: &str) -> std::io::Result<()> {
    let path = dir.join(name);
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path)?,
        Ok(_) => std::fs::remove_file(&path)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)?;
    f.write_all(text.as_bytes())
}

/// Creates the run's private directories: a temporary directory (removed when dropped)
/// holding `home/` unless `config_home` keeps the user's or names another. With a durable
/// `state` ([`super::resume::State`]) its `home/` and `files/` are used instead, so the
/// CLI's session outlives a lost run.
fn make_dirs(
    config: &AgentConfig,
    state: Option<&super::resume::State>,
    adopting: bool,
) -> std::io::Result<(tempfile::TempDir, Dirs)> {
    let tmp = tempfile::Builder::new().prefix("orch-agent-").tempdir()?;
    let home = match config.config_home.as_deref().map(str::trim) {
        None | Some("run") => Some(
            state
                .map(super::resume::State::home)
                .unwrap_or_else(|| tmp.path().join("home")),
        ),
        Some("user") => None,
        Some(dir) => Some(PathBuf::from(dir)),
    };
    if let Some(h) = &home {
        std::fs::create_dir_all(h)?;
        // An identity of its own, so a CLI that wants one for git (Aider) finds it here
        // instead of writing it into the repository's configuration (read-only to it).
        // The home may be a kept one the agent wrote before: never written through a link.
        if !adopting && std::fs::symlink_metadata(h.join(".gitconfig")).is_err() {
            write_new(
                h,
                ".gitconfig",
                "[user]\n\tname = orch agent\n\temail = agent@orch.invalid\n",
            )?;
        }
    }
    let files = state
        .map(super::resume::State::files)
        .unwrap_or_else(|| tmp.path().join("files"));
    std::fs::create_dir_all(&files)?;
    Ok((tmp, Dirs { home, files }))
}

/// Runs one try of a CLI backend.
pub(crate) async fn run(inv: &Invocation<'_>) -> TryResult {
    let role = Role::of(&inv.run.stage);
    let key = inv.run.command_key("agent");
    let backend = inv.config.backend;
    let (state, session) = session_of(inv, &key).await;
    let resumed_prompt;
    let prompt: &str = if session.resume.is_some() {
        resumed_prompt = format!("{}{}", super::resume::RESUME_NOTE, inv.prompt);
        &resumed_prompt
    } else {
        inv.prompt
    };
    let (tmp, dirs) = match make_dirs(inv.config, state.as_ref(), session.adopting) {
        Ok(d) => d,
        Err(e) => {
            return TryResult::failed(
                inv.error(format!("cannot create the run's configuration home: {e}")),
            );
        }
    };
    // The run's sandbox: the worktree and its private directory writable, its model endpoint
    // reachable, nothing of orch's in sight (`crate::contain`).
    let mut extra = match &dirs.home {
        Some(h) => vec![h.clone()],
        None => user_config_dirs(inv.config.backend),
    };
    if state.is_some() {
        extra.push(dirs.files.clone());
    }
    let contained = match crate::contain::for_agent(inv.run, inv.config, tmp.path(), &extra) {
        Ok(c) => c,
        Err(e) => return TryResult::permanent(inv.error(e)),
    };
    let plan = match plan(inv.config, role, &dirs, contained.is_sandboxed()) {
        Ok(p) => with_session(p, backend, &session),
        Err(e) => return TryResult::permanent(inv.error(e)),
    };
    if let (Some(text), Some(home), false) = (&plan.codex_config, &dirs.home, session.adopting) {
        let dir = home.join(".codex");
        if let Err(e) = private_dir(&dir).and_then(|()| write_new(&dir, "config.toml", text)) {
            return TryResult::failed(inv.error(format!(
                "cannot write {}: {e}",
                dir.join("config.toml").display()
            )));
        }
    }
    let wants_file =
        plan.via == PromptVia::File || plan.args.iter().any(|a| a.contains("{prompt_file}"));
    let prompt_file = if wants_file {
        match write_prompt_file(prompt, tmp.path()) {
            Ok(f) => Some(f),
            Err(e) => {
                return TryResult::failed(
                    inv.error(format!("cannot write the prompt to a temporary file: {e}")),
                );
            }
        }
    } else {
        None
    };
    let prompt_path = prompt_file.as_ref().map(|f| f.path().to_owned());
    let vars = Vars {
        prompt_file: prompt_path.as_deref(),
        inv,
    };
    let args: Vec<String> = plan.args.iter().map(|a| vars.substitute(a)).collect();
    let mut cmd = contained.apply(
        Cmd::new(&plan.program)
            .no_daemons()
            .batch()
            .args(args)
            .cwd(inv.worktree)
            .timeout(inv.timeout)
            .output_limit(OUTPUT_LIMIT)
            .cancel_on(inv.run.cancel.clone()),
    );
    for (key, value) in vars.env() {
        cmd = cmd.env(key, value);
    }
    let transcript = inv.transcript.map(super::transcript::Transcript::sink);
    match (&state, backend) {
        // The session id as the CLI announces it, recorded while it runs.
        (Some(s), Backend::Claude | Backend::Codex) => {
            cmd = cmd.stdout_sink(s.capture(backend, transcript));
        }
        _ => {
            if let Some(sink) = transcript {
                cmd = cmd.stdout_sink(sink);
            }
        }
    }
    for (key, value) in &plan.env {
        cmd = cmd.env(key, value);
    }
    // Unsandboxed, the run's temporary files go to a directory of its own too (and Codex,
    // which refuses to put its sandbox's helpers under the temporary directory, finds its
    // home outside that one).
    if !contained.is_sandboxed() {
        let private_tmp = tmp.path().join("tmp");
        if let Err(e) = std::fs::create_dir_all(&private_tmp) {
            return TryResult::failed(
                inv.error(format!("cannot create {}: {e}", private_tmp.display())),
            );
        }
        cmd = cmd.env("TMPDIR", private_tmp);
    }
    // The key, read at the moment of use from the variable the agent names, under the name
    // the CLI reads (Codex and a custom command read the named variable themselves). A named
    // variable that is unset fails the stage at once: no CLI can authenticate without it.
    if let Some(var) = &inv.config.api_key_env
        && std::env::var(var).map_or(true, |v| v.trim().is_empty())
    {
        return TryResult::permanent(inv.error(missing_key_message(inv.agent.as_str(), var)));
    }
    if let Some(var) = &inv.config.api_key_env
        && let Ok(key) = std::env::var(var)
    {
        match inv.config.backend {
            Backend::Claude => cmd = cmd.env("ANTHROPIC_API_KEY", key),
            Backend::Aider => cmd = cmd.env("OPENAI_API_KEY", key),
            Backend::Codex | Backend::Command => cmd = cmd.env(var, key),
            Backend::Openai => {}
        }
    }
    if plan.via == PromptVia::Stdin {
        cmd = cmd.stdin(prompt.as_bytes().to_vec());
    }
    let started = std::time::Instant::now();
    let out = run_process(&cmd.supervised(key.clone())).await;
    if let Ok(o) = &out {
        inv.run.note_supervision("agent", &key, o).await;
    }
    drop(prompt_file);
    let mut result = match out {
        Ok(out) => {
            let mut r = TryResult {
                started: true,
                ..interpret(inv, &plan, &out)
            };
            // Started by an earlier orch and adopted (`command.adopted` says how).
            if out.supervision.adopted() {
                r.data.insert("adopted".into(), json!(true));
            }
            r
        }
        Err(e @ (SpawnError::NotFound { .. } | SpawnError::PermissionDenied { .. })) => {
            TryResult::permanent(inv.error(e.to_string()))
        }
        Err(e) => TryResult::failed(inv.error(e.to_string())),
    };
    if plan.parser == Parser::Codex {
        codex_rollout_denials(&dirs, &mut result);
    }
    if plan.parser == Parser::Aider {
        // Aider's chat history says more than its console (the prompt, the replies, the
        // edits): it replaces the console output as the transcript.
        if let Some(t) = inv.transcript
            && let Ok(Some(history)) =
                crate::fsutil::read_regular(&dirs.files.join("chat.history.md"))
        {
            t.replace(history.as_bytes());
        }
        let cleaned = clean_after_aider(&inv.run.git, inv.worktree).await;
        if !cleaned.is_empty() {
            result.data.insert("aider_cleaned".into(), json!(cleaned));
        }
    }
    drop(tmp);
    if let Some(id) = &session.resume {
        result
            .data
            .insert("resumed_session".into(), id.clone().into());
    }
    result.data.insert("program".into(), plan.program.into());
    result
        .data
        .insert("sandbox".into(), contained.note.clone().into());
    result.data.insert(
        "config_home".into(),
        match &dirs.home {
            Some(_) if inv.config.config_home.is_none() => "run".into(),
            Some(h) => h.display().to_string().into(),
            None => "user".into(),
        },
    );
    result.data.insert(
        "duration_ms".into(),
        u64::try_from(started.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .into(),
    );
    result
}

/// The run's durable state and its session arguments: a fresh run of a resumable preset
/// with its own home keeps its session in the state directory of `key` (Claude Code is given
/// its id up front); a run whose earlier command was lost continues that session when its
/// files are still there (`agent.session_resumed`), else starts afresh
/// (`agent.session_lost`). An adopted command (running, or ended while orch was away) leaves
/// the state as it is. Without supervision, or with another home, there is no state.
async fn session_of(
    inv: &Invocation<'_>,
    key: &str,
) -> (Option<super::resume::State>, SessionArgs) {
    use super::resume::{Decision, State, cli_name, new_uuid, resumable};
    use orch_exec::supervise::{Recorded, recorded};
    let backend = inv.config.backend;
    let mut args = SessionArgs::default();
    if !resumable(backend) || !home_is_the_runs(inv.config) {
        return (None, args);
    }
    let state = match State::open(key) {
        Ok(Some(s)) => s,
        Ok(None) => return (None, args),
        Err(e) => {
            tracing::warn!(key, error = %e, "cannot keep the agent's session: it runs in a temporary home");
            return (None, args);
        }
    };
    let was = recorded(key);
    if was == Recorded::Kept {
        args.adopting = true;
        return (Some(state), args);
    }
    let (task, attempt) = (inv.run.task.id, inv.run.lease.attempt);
    let decision = if was == Recorded::Lost {
        match state.continues(task, attempt) {
            Ok(()) => state.decide(backend),
            Err(why) => Decision::Lost { id: None, why },
        }
    } else {
        Decision::Fresh
    };
    let cli = cli_name(backend);
    match &decision {
        Decision::Resume { id } => {
            inv.run
                .note_session(
                    orch_domain::control::events::AGENT_SESSION_RESUMED,
                    format!(
                        "agent {} ({cli}): its run was lost (no result, supervisor gone); {} continues",
                        inv.agent,
                        if backend == Backend::Aider {
                            "its chat history".to_owned()
                        } else {
                            format!("its session {id}")
                        }
                    ),
                    serde_json::json!({"cli": cli, "session_id": id, "key": key,
                        "why": "the previous run's process was lost and its session files are still there"}),
                )
                .await;
            args.resume = Some(id.clone());
        }
        Decision::Lost { id, why } => {
            inv.run
                .note_session(
                    orch_domain::control::events::AGENT_SESSION_LOST,
                    format!(
                        "agent {} ({cli}): its run was lost and cannot be continued ({why}): it starts afresh",
                        inv.agent
                    ),
                    serde_json::json!({"cli": cli, "session_id": id, "key": key, "why": why}),
                )
                .await;
        }
        Decision::Fresh => {}
    }
    if args.resume.is_none() {
        // A fresh start: nothing of an earlier session is kept.
        if let Err(e) = state.clear() {
            tracing::warn!(key, error = %e, "cannot clear the agent's state directory");
            return (None, args);
        }
        if backend == Backend::Claude {
            match new_uuid().and_then(|id| state.record(backend, &id).map(|()| id)) {
                Ok(id) => args.new_id = Some(id),
                Err(e) => tracing::warn!(key, error = %e, "cannot record the agent's session id"),
            }
        }
    }
    // This attempt owns the state now: only its successor may continue it.
    if let Err(e) = state.bind(task, attempt) {
        tracing::warn!(key, error = %e, "cannot bind the agent's state to its attempt; a lost run will start afresh");
    }
    (Some(state), args)
}

/// Undoes what Aider does to a worktree besides the work: its `.aider*` files at the root
/// and the files it `git add`s (the index is reset to `HEAD`; the engine commits what the
/// stage may commit). Returns what was removed or unstaged.
async fn clean_after_aider(git: &orch_exec::Git, worktree: &Path) -> Vec<String> {
    let mut cleaned = Vec::new();
    if let Ok(entries) = std::fs::read_dir(worktree) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".aider") {
                let path = entry.path();
                let removed = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                match removed {
                    Ok(()) => cleaned.push(name),
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove aider's file")
                    }
                }
            }
        }
    }
    let staged =
        run_process(
            &git.command(worktree)
                .args(["diff", "--cached", "--name-only", "-z"]),
        )
        .await;
    if let Ok(out) = staged
        && out.success()
    {
        let names: Vec<String> = out
            .stdout_lossy()
            .split('\0')
            .filter(|s| !s.is_empty())
            .map(|s| format!("unstaged {s}"))
            .collect();
        if !names.is_empty() {
            match run_process(&git.command(worktree).args(["reset", "-q"])).await {
                Ok(o) if o.success() => cleaned.extend(names),
                Ok(o) => {
                    tracing::warn!(output = %o.tail_text(5), "cannot reset aider's staged files")
                }
                Err(e) => tracing::warn!(error = %e, "cannot reset aider's staged files"),
            }
        }
    }
    cleaned
}

/// The prompt in a private temporary file in the run's own directory `dir` (outside the
/// worktree, so it is never committed; inside what the run's sandbox shows it).
fn write_prompt_file(prompt: &str, dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let mut file = tempfile::Builder::new()
        .prefix("orch-prompt-")
        .suffix(".md")
        .tempfile_in(dir)?;
    file.write_all(prompt.as_bytes())?;
    file.flush()?;
    Ok(file)
}

/// The values of the `ORCH_*` variables and of the argument placeholders.
struct Vars<'a> {
    prompt_file: Option<&'a Path>,
    inv: &'a Invocation<'a>,
}

impl Vars<'_> {
    fn pairs(&self) -> Vec<(&'static str, &'static str, String)> {
        let inv = self.inv;
        let path = |p: &Path| p.display().to_string();
        let mut v = vec![
            (
                "ORCH_WORK_ITEM",
                "{work_item}",
                inv.run.work_item.to_string(),
            ),
            ("ORCH_STAGE", "{stage}", inv.run.stage.name.to_string()),
            ("ORCH_AGENT", "{agent}", inv.agent.to_string()),
            ("ORCH_WORKTREE", "{worktree}", path(inv.worktree)),
            (
                "ORCH_ARTIFACT_DIR",
                "{artifact_dir}",
                path(inv.artifact_dir),
            ),
            (
                "ORCH_ATTEMPT",
                "{attempt}",
                inv.run.lease.attempt.to_string(),
            ),
        ];
        if let Some(p) = inv.primary {
            v.push(("ORCH_ARTIFACT", "{artifact}", path(p)));
        }
        if !inv.expected.is_empty() {
            let all: Vec<String> = inv
                .expected
                .iter()
                .map(|n| path(&inv.artifact_dir.join(n.as_str())))
                .collect();
            v.push(("ORCH_ARTIFACTS", "{artifacts}", all.join("\n")));
        }
        if let Some(p) = self.prompt_file {
            v.push(("ORCH_PROMPT_FILE", "{prompt_file}", path(p)));
        }
        if let Some(m) = &inv.config.model {
            v.push(("ORCH_MODEL", "{model}", m.clone()));
        }
        v
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        self.pairs().into_iter().map(|(k, _, v)| (k, v)).collect()
    }

    fn substitute(&self, arg: &str) -> String {
        self.pairs()
            .iter()
            .fold(arg.to_owned(), |a, (_, ph, v)| a.replace(ph, v))
    }
}

/// What kind of failure a CLI reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Retrying will not help (authentication, a bad request, the turn limit): the attempt
    /// fails for good with the CLI's message.
    Permanent,
    /// Worth another try after a wait (rate limits, overload, 5xx, the network).
    Transient,
    /// Unclear: the attempt fails and the job is retried as a new attempt.
    Other,
}

/// The class of an HTTP status a CLI reported.
fn class_of_status(status: i64) -> Class {
    match status {
        408 | 409 | 425 | 429 | 500..=599 => Class::Transient,
        400..=499 => Class::Permanent,
        _ => Class::Other,
    }
}

/// The class of Claude Code's `api_error` kind (its result's structured error field), when
/// the kind says.
fn class_of_api_error(kind: &str) -> Option<Class> {
    let k = kind.to_lowercase();
    if [
        "connection",
        "timeout",
        "overloaded",
        "rate_limit",
        "server",
        "unavailable",
        "network",
    ]
    .iter()
    .any(|w| k.contains(w))
    {
        Some(Class::Transient)
    } else if [
        "auth",
        "permission",
        "invalid_request",
        "not_found",
        "billing",
        "credit",
    ]
    .iter()
    .any(|w| k.contains(w))
    {
        Some(Class::Permanent)
    } else {
        None
    }
}

/// Whether a CLI's message says authentication failed (no key, a wrong key, no login).
fn is_auth_text(text: &str) -> bool {
    let lower = text.to_lowercase();
    [
        "authentication",
        "unauthorized",
        "invalid api key",
        "invalid x-api-key",
        "incorrect api key",
        "not logged in",
        "please run /login",
        "api key",
    ]
    .iter()
    .any(|w| lower.contains(w))
        || has_status(&lower, &["401", "403"])
}

/// What to set, in orch's terms, when a CLI could not authenticate.
fn auth_hint(inv: &Invocation<'_>) -> String {
    let agent = inv.agent.as_str();
    match &inv.config.api_key_env {
        Some(var) => format!(
            "authentication failed: check the key in `{var}` (named by api_key_env in \
             [agents.{agent}]) and that `endpoint` accepts it; a CLI login does not apply \
             (each run gets a fresh HOME)"
        ),
        None => format!(
            "authentication failed: set api_key_env = \"<VARIABLE>\" in [agents.{agent}] and \
             export that variable with the key where orch runs; a CLI login does not apply \
             (each run gets a fresh HOME)"
        ),
    }
}

/// The error of a run whose `api_key_env` names an unset variable.
pub fn missing_key_message(agent: &str, var: &str) -> String {
    format!(
        "`{var}` is not set: [agents.{agent}] api_key_env names it as the variable holding \
         the API key; export {var}=<key> in the environment of `orch serve`/`orch worker` \
         (or point api_key_env at the variable that holds it), then retry the work item"
    )
}

/// The class of an error text (a CLI's message that carries no status field).
pub(crate) fn class_of_text(text: &str) -> Class {
    let lower = text.to_lowercase();
    const PERMANENT: [&str; 14] = [
        "not logged in",
        "please run /login",
        "authentication",
        "unauthorized",
        "invalid api key",
        "invalid x-api-key",
        "incorrect api key",
        "permission_error",
        "permissiondenied",
        "forbidden",
        "badrequest",
        "invalid_request_error",
        "notfounderror",
        "model_not_found",
    ];
    const TRANSIENT: [&str; 15] = [
        // Claude Code 2.1.197: "Unable to connect to API (ConnectionRefused)".
        "unable to connect",
        "connectionrefused",
        "connection_failed",
        "temporary",
        "high demand",
        "internalservererror",
        "internal server error",
        "server_error",
        "serviceunavailable",
        "apiconnectionerror",
        "connection refused",
        "connection reset",
        "timed out",
        "timeout",
        "stream disconnected",
    ];
    if PERMANENT.iter().any(|w| lower.contains(w)) || has_status(&lower, &["401", "403"]) {
        Class::Permanent
    } else if mentions_transient(text)
        || TRANSIENT.iter().any(|w| lower.contains(w))
        || has_status(&lower, &["500", "502", "504"])
    {
        Class::Transient
    } else {
        Class::Other
    }
}

/// Whether one of `codes` stands alone in `text` (not inside a longer number).
fn has_status(text: &str, codes: &[&str]) -> bool {
    codes.iter().any(|code| {
        text.match_indices(code).any(|(i, _)| {
            let before = text[..i].chars().next_back();
            let after = text[i + code.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_digit())
                && !after.is_some_and(|c| c.is_ascii_digit())
        })
    })
}

/// Turns a finished process into a try result.
fn interpret(inv: &Invocation<'_>, plan: &Plan, out: &Output) -> TryResult {
    let mut result = TryResult::new(TryEnd::Ok);
    result
        .data
        .insert("stdout_bytes".into(), out.stdout_bytes.into());
    result
        .data
        .insert("stderr_bytes".into(), out.stderr_bytes.into());
    let reports_usage = plan.parser != Parser::Plain;
    let code = match out.status {
        ExitKind::TimedOut => {
            // The CLI may have spent tokens before it hung: unknown, not zero.
            result.usage_unknown = reports_usage;
            result.end = TryEnd::Failed(AgentError::TimedOut {
                agent: inv.agent.clone(),
                secs: inv.timeout.as_secs(),
            });
            return result;
        }
        ExitKind::Cancelled => {
            result.usage_unknown = reports_usage;
            result.end = TryEnd::Failed(AgentError::Cancelled {
                agent: inv.agent.clone(),
            });
            return result;
        }
        ExitKind::Signaled(sig) => {
            result.usage_unknown = reports_usage;
            result.end = TryEnd::Failed(inv.error(format!(
                "`{}` was killed by signal {sig}{}",
                plan.program,
                tail_suffix(out)
            )));
            return result;
        }
        ExitKind::Exited(code) => code,
    };
    result.exit_code = Some(i64::from(code));
    let parsed = match plan.parser {
        Parser::Plain => Parsed::default(),
        Parser::Claude => parse_claude(&out.stdout_lossy()),
        Parser::Codex => parse_codex(&out.stdout_lossy()),
        Parser::Aider => parse_aider(&format!("{}\n{}", out.stdout_lossy(), out.stderr_lossy())),
    };
    result.usage = parsed.usage;
    result.data.extend(parsed.data);
    result.denials = parsed.denials;
    if reports_usage && (parsed.usage.input.is_none() || parsed.usage.output.is_none()) {
        tracing::warn!(agent = %inv.agent, program = %plan.program, "the agent's output reported no usage; tokens and cost are unknown");
        result.usage_unknown = true;
    }
    if code == 0 && parsed.error.is_none() {
        return result;
    }
    let message = match (&parsed.error, code) {
        (Some(e), 0) => format!("`{}` reported an error: {e}", plan.program),
        (Some(e), _) => format!("`{}` exited with code {code}: {e}", plan.program),
        (None, _) => format!(
            "`{}` exited with code {code}{}",
            plan.program,
            tail_suffix(out)
        ),
    };
    let auth = plan.parser != Parser::Plain && parsed.auth;
    let message = if auth || (plan.parser != Parser::Plain && is_auth_text(&message)) {
        format!("{message} — {}", auth_hint(inv))
    } else {
        message
    };
    let message = bound_text(&message, MAX_ERROR_BYTES);
    let class = match (plan.parser, code) {
        // A plain command says what kind of failure it had by its exit status (sysexits(3)).
        (Parser::Plain, EX_TEMPFAIL) => Class::Transient,
        (Parser::Plain, EX_NOPERM | EX_CONFIG) => Class::Permanent,
        _ => classify_unreported(parsed.class, parsed.error.as_deref(), plan, out),
    };
    result.end = match class {
        Class::Transient => TryEnd::Transient(message),
        Class::Permanent => TryEnd::Permanent(inv.error(message)),
        Class::Other => TryEnd::Failed(inv.error(message)),
    };
    result
}

/// A `command` agent's exit status for "try again later": retried within the attempt.
pub(crate) const EX_TEMPFAIL: i32 = 75;
/// … for "not allowed" (authentication, permission): the stage fails, not retried.
pub(crate) const EX_NOPERM: i32 = 77;
/// … for "configured wrong": the stage fails, not retried.
pub(crate) const EX_CONFIG: i32 = 78;

/// The class of a failure: the preset's report when it says, else the words of the output's
/// end (a plain command's words decide nothing permanent).
fn classify_unreported(
    reported: Option<Class>,
    error: Option<&str>,
    plan: &Plan,
    out: &Output,
) -> Class {
    reported.unwrap_or_else(|| {
        let scan = format!(
            "{}\n{}",
            error.unwrap_or(""),
            tail_of(out, TRANSIENT_SCAN_BYTES)
        );
        match class_of_text(&scan) {
            // A plain command's own words decide nothing permanent: only a preset's report.
            Class::Permanent if plan.parser == Parser::Plain => Class::Other,
            c => c,
        }
    })
}

/// `": <last lines of output>"`, or nothing when there was no output.
fn tail_suffix(out: &Output) -> String {
    let tail = tail_of(out, MAX_ERROR_BYTES - 200);
    if tail.trim().is_empty() {
        String::new()
    } else {
        format!(": {}", tail.trim())
    }
}

/// The last lines of stderr (or of stdout when stderr is empty) within `max` bytes.
fn tail_of(out: &Output, max: usize) -> String {
    let text = if out.stderr_tail.iter().any(|b| !b.is_ascii_whitespace()) {
        out.stderr_lossy()
    } else {
        out.stdout_lossy()
    };
    let lines: Vec<&str> = text.trim_end().lines().collect();
    let last = lines[lines.len().saturating_sub(20)..].join("\n");
    bound_text(&last, max)
}

/// What a preset's output said.
#[derive(Debug, Default, PartialEq)]
struct Parsed {
    usage: TokenUsage,
    /// The run's own report of a failure.
    error: Option<String>,
    /// The failure's class when the report says (an HTTP status, the turn limit).
    class: Option<Class>,
    /// Actions the CLI refused the agent.
    denials: Vec<Denial>,
    data: serde_json::Map<String, Value>,
    /// The report says authentication or permission failed (HTTP 401/403).
    auth: bool,
}

fn int(v: &Value, key: &str) -> Option<i64> {
    v.get(key).and_then(Value::as_i64)
}

/// A short text of a tool call's input (a command, a path), for denials.
fn input_summary(input: &Value) -> String {
    let text = ["command", "file_path", "path", "url", "cmd"]
        .iter()
        .find_map(|k| input.get(*k).and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_else(|| input.to_string());
    bound_text(&text, 300)
}

/// Claude Code's `--output-format json` result: one object (`"type": "result"`), or, with
/// `--verbose`, an array or lines of events ending in it.
fn parse_claude(stdout: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let Some(result) = find_claude_result(stdout) else {
        return parsed;
    };
    if let Some(usage) = result.get("usage") {
        let cache = int(usage, "cache_creation_input_tokens").unwrap_or(0)
            + int(usage, "cache_read_input_tokens").unwrap_or(0);
        parsed.usage.input = int(usage, "input_tokens").map(|i| i + cache);
        parsed.usage.output = int(usage, "output_tokens");
    }
    parsed.usage.cost_usd = result.get("total_cost_usd").and_then(Value::as_f64);
    for key in [
        "session_id",
        "num_turns",
        "duration_ms",
        "subtype",
        "api_error_status",
        "api_error",
        "terminal_reason",
        "stop_reason",
        "errors",
    ] {
        if let Some(v) = result.get(key).filter(|v| !v.is_null()) {
            parsed.data.insert(format!("claude_{key}"), v.clone());
        }
    }
    if let Some(models) = result.get("modelUsage").and_then(Value::as_object) {
        let names: Vec<Value> = models.keys().map(|k| Value::from(k.as_str())).collect();
        parsed
            .data
            .insert("claude_models".into(), Value::Array(names));
    }
    for d in result
        .get("permission_denials")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let tool = d
            .get("tool_name")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_owned();
        parsed.denials.push(Denial {
            required: REQUIRED_TOOLS.contains(&tool.as_str()),
            detail: input_summary(d.get("tool_input").unwrap_or(&Value::Null)),
            tool,
        });
    }
    let subtype = result.get("subtype").and_then(Value::as_str).unwrap_or("");
    let errors: Vec<String> = result
        .get("errors")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|e| {
            e.as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| e.to_string())
        })
        .collect();
    let status = result.get("api_error_status").and_then(Value::as_i64);
    let is_error = result.get("is_error").and_then(Value::as_bool) == Some(true);
    if is_error || subtype.starts_with("error") {
        let text = result
            .get("result")
            .and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
            .map(str::to_owned)
            .or_else(|| (!errors.is_empty()).then(|| errors.join("; ")))
            .unwrap_or_else(|| {
                if subtype.is_empty() {
                    "is_error is true".to_owned()
                } else {
                    subtype.to_owned()
                }
            });
        let mut text = text.trim().to_owned();
        if let Some(status) = status {
            text = format!("API error {status}: {text}");
        }
        if subtype.starts_with("error_") {
            text = format!("{subtype}: {text}");
            if !errors.is_empty() && !text.contains(&errors[0]) {
                text = format!("{text} ({})", errors.join("; "));
            }
        }
        // The structured fields first (newer Claude Code: `api_error` names the kind, e.g.
        // "connection_failed"; `api_error_status` the HTTP status), the message text last.
        let api_error = result.get("api_error").and_then(Value::as_str);
        parsed.auth = matches!(status, Some(401 | 403))
            || api_error.is_some_and(|k| k.contains("auth") || k.contains("permission"));
        parsed.class = Some(
            match (subtype, status, api_error.and_then(class_of_api_error)) {
                ("error_max_turns" | "error_max_budget_usd", _, _) => Class::Permanent,
                (_, Some(s), _) => class_of_status(s),
                (_, None, Some(c)) => c,
                _ => class_of_text(&text),
            },
        );
        parsed.error = Some(bound_text(&text, MAX_ERROR_BYTES));
    }
    parsed
}

fn find_claude_result(stdout: &str) -> Option<Value> {
    let is_result = |v: &Value| v.get("type").and_then(Value::as_str) == Some("result");
    match serde_json::from_str::<Value>(stdout.trim()) {
        Ok(v) if is_result(&v) => return Some(v),
        Ok(Value::Array(events)) => return events.into_iter().rev().find(is_result),
        _ => {}
    }
    stdout
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .find(is_result)
}

/// Words of a command's output that mean the sandbox refused it.
const SANDBOX_DENIED: [&str; 3] = [
    "read-only file system",
    "operation not permitted",
    "permission denied",
];

/// Codex CLI's `exec --json` events: usage summed over `turn.completed`; a `turn.failed`, or
/// an `error` event not followed by a completed turn, is the run's error. `error` *items*
/// (e.g. "Model metadata … not found") are warnings. A command the sandbox refused is a
/// denial.
fn parse_codex(stdout: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let (mut input, mut cached, mut output, mut turns) = (0i64, 0i64, 0i64, 0i64);
    let mut failed: Option<String> = None;
    let mut pending: Option<String> = None;
    let mut warnings: Vec<Value> = Vec::new();
    let mut failed_commands: Vec<Value> = Vec::new();
    let mut commands = 0i64;
    for line in stdout.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line.trim()) else {
            continue;
        };
        let message = |v: &Value| -> String {
            v.get("error")
                .and_then(|e| e.get("message").and_then(Value::as_str).or(e.as_str()))
                .or_else(|| v.get("message").and_then(Value::as_str))
                .unwrap_or("unknown error")
                .to_owned()
        };
        match event.get("type").and_then(Value::as_str) {
            Some("turn.completed") => {
                let usage = event.get("usage").unwrap_or(&Value::Null);
                input += int(usage, "input_tokens").unwrap_or(0);
                cached += int(usage, "cached_input_tokens").unwrap_or(0);
                output += int(usage, "output_tokens").unwrap_or(0);
                turns += 1;
                pending = None;
            }
            Some("turn.failed") => failed = Some(message(&event)),
            Some("error") => pending = Some(message(&event)),
            Some("thread.started") => {
                if let Some(id) = event.get("thread_id") {
                    parsed.data.insert("codex_thread_id".into(), id.clone());
                }
            }
            Some("item.completed") => {
                let item = event.get("item").unwrap_or(&Value::Null);
                match item.get("type").and_then(Value::as_str) {
                    Some("error") => {
                        warnings.push(item.get("message").cloned().unwrap_or_else(|| item.clone()))
                    }
                    Some("command_execution") => {
                        commands += 1;
                        let code = item.get("exit_code").and_then(Value::as_i64);
                        if code.is_some_and(|c| c != 0) {
                            let command = item
                                .get("command")
                                .and_then(Value::as_str)
                                .unwrap_or_default();
                            let out = item
                                .get("aggregated_output")
                                .and_then(Value::as_str)
                                .unwrap_or_default();
                            failed_commands.push(json!({
                                "command": bound_text(command, 300),
                                "exit_code": code,
                                "output": bound_text(out, 500),
                            }));
                            let lower = out.to_lowercase();
                            if SANDBOX_DENIED.iter().any(|w| lower.contains(w)) {
                                parsed.denials.push(Denial {
                                    tool: "sandbox".into(),
                                    detail: bound_text(command, 300),
                                    required: true,
                                });
                            }
                        }
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    if turns > 0 {
        parsed.usage.input = Some(input);
        parsed.usage.output = Some(output);
        parsed
            .data
            .insert("codex_cached_input_tokens".into(), cached.into());
        parsed.data.insert("codex_turns".into(), turns.into());
    }
    parsed.data.insert("codex_commands".into(), commands.into());
    if !warnings.is_empty() {
        parsed
            .data
            .insert("codex_warnings".into(), Value::Array(warnings));
    }
    if !failed_commands.is_empty() {
        parsed.data.insert(
            "codex_failed_commands".into(),
            Value::Array(failed_commands),
        );
    }
    parsed.error = failed.or(pending).map(|e| bound_text(&e, MAX_ERROR_BYTES));
    if let Some(e) = &parsed.error {
        parsed.class = Some(class_of_text(e));
    }
    parsed
}

/// Adds the sandbox refusals that Codex's `exec --json` events leave out. Codex 0.171 emits
/// no `command_execution` item for an `exec_command` the sandbox refuses before its early-exit
/// window closes (a plain `touch` outside the workspace): the model gets "Read-only file
/// system" but the JSONL shows nothing. The session's rollout
/// (`$CODEX_HOME/sessions/…/rollout-…-<thread id>.jsonl`, read before the run's home is
/// removed) has every call and its output.
fn codex_rollout_denials(dirs: &Dirs, result: &mut TryResult) {
    let Some(thread) = result.data.get("codex_thread_id").and_then(Value::as_str) else {
        return;
    };
    let codex_home = match &dirs.home {
        Some(home) => Some(home.join(".codex")),
        None => std::env::var_os("CODEX_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".codex"))),
    };
    let Some(sessions) = codex_home.map(|h| h.join("sessions")) else {
        return;
    };
    let suffix = format!("-{thread}.jsonl");
    let Some(rollout) = find_file(
        &sessions,
        &|name: &str| name.starts_with("rollout-") && name.ends_with(&suffix),
        4,
    ) else {
        return;
    };
    // The rollout is the agent's file: read as a regular file, never through a link, bounded.
    let Ok(Some(text)) = crate::fsutil::read_regular(&rollout) else {
        return;
    };
    for denial in parse_codex_rollout(&text) {
        // The same refusal seen in the events too (as `/bin/bash -lc '<cmd>'`) counts once.
        if !result
            .denials
            .iter()
            .any(|d| d.tool == denial.tool && d.detail.contains(denial.detail.as_str()))
        {
            result.denials.push(denial);
        }
    }
}

/// The first file under `dir` (at most `depth` levels down) whose name `matches`.
fn find_file(dir: &Path, matches: &dyn Fn(&str) -> bool, depth: usize) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_file() && matches(&entry.file_name().to_string_lossy()) {
            return Some(path);
        }
        if kind.is_dir()
            && depth > 0
            && let Some(found) = find_file(&path, matches, depth - 1)
        {
            return Some(found);
        }
    }
    None
}

/// The sandbox refusals in a Codex rollout: a tool call whose output reports a non-zero exit
/// ("Process exited with code 1", "Exit code: 1") and words of a refusal.
fn parse_codex_rollout(text: &str) -> Vec<Denial> {
    let mut commands: std::collections::HashMap<String, String> = Default::default();
    let mut denials = Vec::new();
    for line in text.lines() {
        let Ok(entry) = serde_json::from_str::<Value>(line.trim()) else {
            continue;
        };
        let Some(item) = entry.get("payload") else {
            continue;
        };
        let call_id = item
            .get("call_id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        match item.get("type").and_then(Value::as_str) {
            Some("function_call" | "custom_tool_call" | "local_shell_call") => {
                let args = item
                    .get("arguments")
                    .and_then(Value::as_str)
                    .and_then(|a| serde_json::from_str::<Value>(a).ok())
                    .or_else(|| item.get("action").cloned())
                    .unwrap_or(Value::Null);
                let command = match args.get("cmd").or_else(|| args.get("command")) {
                    Some(Value::String(c)) => c.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(" "),
                    _ => continue,
                };
                commands.insert(call_id, command);
            }
            Some("function_call_output" | "custom_tool_call_output") => {
                let Some(command) = commands.get(&call_id) else {
                    continue;
                };
                let output = match item.get("output") {
                    Some(Value::String(o)) => o.clone(),
                    Some(other) => other.to_string(),
                    None => continue,
                };
                let lower = output.to_lowercase();
                let code = ["exited with code ", "exit code: ", "\"exit_code\":"]
                    .iter()
                    .find_map(|marker| {
                        let at = lower.find(marker)? + marker.len();
                        let digits: String = lower[at..]
                            .trim_start()
                            .chars()
                            .take_while(|c| c.is_ascii_digit() || *c == '-')
                            .collect();
                        digits.parse::<i64>().ok()
                    });
                if code.is_some_and(|c| c != 0) && SANDBOX_DENIED.iter().any(|w| lower.contains(w))
                {
                    denials.push(Denial {
                        tool: "sandbox".into(),
                        detail: bound_text(command, 300),
                        required: true,
                    });
                }
            }
            _ => {}
        }
    }
    denials
}

/// A count as Aider prints it: `596`, `1.2k`, `3.4M`.
fn aider_count(s: &str) -> Option<i64> {
    let s = s.trim().replace(',', "");
    let (num, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1e3),
        'm' | 'M' => (&s[..s.len() - 1], 1e6),
        _ => (s.as_str(), 1.0),
    };
    num.parse::<f64>().ok().map(|n| (n * mult).round() as i64)
}

/// Aider's console output: `Tokens: 2.3k sent, 1.1k cache write, 18 received.` per reply
/// (summed), `Cost: $0.01 message, $0.02 session.` when it knows the model's price (the last
/// session figure), `Applied edit to <file>`; an error (`litellm.…Error`, "The API
/// provider's servers are down…") not followed by a reply is the run's error, whatever the
/// exit code (Aider exits 0 when authentication fails or its retries run out).
fn parse_aider(text: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let (mut sent, mut received, mut replies) = (0i64, 0i64, 0i64);
    let mut cost: Option<f64> = None;
    let mut edits: Vec<Value> = Vec::new();
    // The errors since the last reply.
    let mut errors: Vec<String> = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("Tokens:") {
            replies += 1;
            errors.clear();
            let counts = rest.split("Cost:").next().unwrap_or(rest);
            for part in counts.trim().trim_end_matches('.').split(',') {
                let part = part.trim();
                if let Some(n) = part.strip_suffix(" sent") {
                    sent += aider_count(n).unwrap_or(0);
                } else if let Some(n) = part.strip_suffix(" received") {
                    received += aider_count(n).unwrap_or(0);
                }
            }
            if let Some(c) = l.split("Cost:").nth(1) {
                for part in c.split(',') {
                    if let Some(v) = part
                        .trim()
                        .strip_suffix("session.")
                        .or_else(|| part.trim().strip_suffix("session"))
                    {
                        cost = v.trim().trim_start_matches('$').parse().ok().or(cost);
                    }
                }
            }
        } else if let Some(c) = l.strip_prefix("Cost:") {
            for part in c.split(',') {
                if let Some(v) = part.trim().trim_end_matches('.').strip_suffix("session") {
                    cost = v.trim().trim_start_matches('$').parse().ok().or(cost);
                }
            }
        } else if let Some(f) = l.strip_prefix("Applied edit to ") {
            edits.push(f.trim().into());
        } else if (l.starts_with("litellm.") && l.contains("Error"))
            || l.starts_with("The API provider's servers are down")
            || l.starts_with("The API provider is not able to authenticate")
            || l.starts_with("The API provider has rate limited you")
            || l.contains("AuthenticationError")
            || l.starts_with("Error: ")
        {
            // The error's message may continue on the next lines (Aider wraps them).
            let mut msg = l.to_owned();
            for next in lines.iter().skip(i + 1).take(6) {
                let n = next.trim();
                if n.is_empty() || n.starts_with("Retrying in") {
                    break;
                }
                msg.push(' ');
                msg.push_str(n);
            }
            errors.push(msg);
        }
    }
    if replies > 0 {
        parsed.usage.input = Some(sent);
        parsed.usage.output = Some(received);
        parsed.data.insert("aider_replies".into(), replies.into());
    }
    parsed.usage.cost_usd = cost;
    if !edits.is_empty() {
        parsed
            .data
            .insert("aider_edits".into(), Value::Array(edits));
    }
    if !errors.is_empty() {
        errors.dedup();
        let msg = errors.join(" ");
        parsed.class = Some(class_of_text(&msg));
        parsed.error = Some(bound_text(&msg, MAX_ERROR_BYTES));
    }
    parsed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(backend: &str, extra: &str) -> AgentConfig {
        let text = format!("backend = \"{backend}\"\n{extra}");
        toml_config(&text)
    }

    fn toml_config(text: &str) -> AgentConfig {
        // AgentConfig is deserialized by the config loader; build the same through serde_json.
        let mut map = serde_json::Map::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let (k, v) = line.split_once(" = ").unwrap();
            map.insert(k.to_owned(), serde_json::from_str(v).unwrap());
        }
        serde_json::from_value(Value::Object(map)).unwrap()
    }

    #[test]
    fn sessions_continue_on_each_cli_s_own_command_line() {
        let resume = SessionArgs {
            resume: Some("abc-1".into()),
            ..SessionArgs::default()
        };
        let fresh = SessionArgs {
            new_id: Some("u-1".into()),
            ..SessionArgs::default()
        };
        let with = |backend: &str, kind: Backend, s: &SessionArgs| {
            let p = plan(&config(backend, ""), Role::Documents, &dirs(), false).unwrap();
            with_session(p, kind, s).args
        };
        let codex = with("codex", Backend::Codex, &resume);
        assert_eq!(codex[0], "exec");
        assert_eq!(&codex[codex.len() - 3..], ["resume", "abc-1", "-"]);
        assert!(!with("codex", Backend::Codex, &fresh).contains(&"resume".to_owned()));
        let claude = with("claude", Backend::Claude, &resume);
        assert!(claude.windows(2).any(|w| w == ["--resume", "abc-1"]));
        assert!(!claude.contains(&"--session-id".to_owned()));
        let claude = with("claude", Backend::Claude, &fresh);
        assert!(claude.windows(2).any(|w| w == ["--session-id", "u-1"]));
        assert!(
            with("aider", Backend::Aider, &resume).contains(&"--restore-chat-history".to_owned())
        );
        assert!(
            !with("aider", Backend::Aider, &fresh).contains(&"--restore-chat-history".to_owned())
        );
    }

    fn dirs() -> Dirs {
        Dirs {
            home: Some(PathBuf::from("/run/home")),
            files: PathBuf::from("/run/files"),
        }
    }

    /// Plans `backend` with `extra` config lines for `role` and compares program, args and
    /// channel.
    fn check(
        backend: &str,
        extra: &str,
        role: Role,
        expect: Result<(&str, &[&str], PromptVia), &str>,
    ) {
        let got = plan(&config(backend, extra), role, &dirs(), false);
        match expect {
            Ok((program, args, via)) => {
                let p = got.unwrap();
                assert_eq!(
                    (
                        p.program.as_str(),
                        p.args.iter().map(String::as_str).collect::<Vec<_>>(),
                        p.via
                    ),
                    (program, args.to_vec(), via),
                    "{backend} {extra}"
                );
            }
            Err(fragment) => {
                let e = got.unwrap_err();
                assert!(e.contains(fragment), "{e}");
            }
        }
    }

    const DENIED: &str = "WebFetch,WebSearch,Agent,Task,CronCreate,CronDelete,CronList,ScheduleWakeup,Workflow,SendMessage,EnterWorktree,ExitWorktree,Skill,TaskCreate,TaskUpdate,TaskStop,ReportFindings";

    #[test]
    fn presets_build_their_command_lines() {
        use PromptVia::{File, Stdin};
        use Role::{Commands, Documents};
        check(
            "claude",
            "",
            Documents,
            Ok((
                "claude",
                &[
                    "-p",
                    "--output-format",
                    "stream-json",
                    "--verbose",
                    "--max-turns",
                    "50",
                    "--tools",
                    "Read,Write,Edit",
                    "--allowedTools",
                    "Read,Write,Edit",
                    "--disallowedTools",
                    DENIED,
                ],
                Stdin,
            )),
        );
        check(
            "claude",
            "model = \"opus\"\ncommand = \"/opt/claude\"\nargs = [\"--verbose\"]\nmax_turns = 7",
            Commands,
            Ok((
                "/opt/claude",
                &[
                    "-p",
                    "--output-format",
                    "stream-json",
                    "--verbose",
                    "--max-turns",
                    "7",
                    "--tools",
                    "Read,Write,Edit,Bash",
                    "--allowedTools",
                    "Read,Write,Edit,Bash",
                    "--disallowedTools",
                    DENIED,
                    "--model",
                    "opus",
                    "--verbose",
                ],
                Stdin,
            )),
        );
        check(
            "claude",
            "allowed_tools = [\"Read\", \"Write\", \"Bash(python3 -m unittest:*)\", \"WebFetch\"]\ndisallowed_tools = []",
            Documents,
            Ok((
                "claude",
                &[
                    "-p",
                    "--output-format",
                    "stream-json",
                    "--verbose",
                    "--max-turns",
                    "50",
                    "--tools",
                    "Read,Write,Edit,Bash,WebFetch",
                    "--allowedTools",
                    "Read,Write,Bash(python3 -m unittest:*),WebFetch",
                ],
                Stdin,
            )),
        );
        check(
            "codex",
            "model = \"o4\"",
            Commands,
            Ok((
                "codex",
                &[
                    "exec",
                    "--json",
                    "-s",
                    "workspace-write",
                    "--skip-git-repo-check",
                    "-m",
                    "o4",
                    "-",
                ],
                Stdin,
            )),
        );
        check(
            "codex",
            "prompt_via = \"file\"\nargs = [\"{prompt_file}\"]",
            Documents,
            Ok((
                "codex",
                &[
                    "exec",
                    "--json",
                    "-s",
                    "workspace-write",
                    "--skip-git-repo-check",
                    "{prompt_file}",
                ],
                File,
            )),
        );
        check(
            "aider",
            "model = \"gpt-4.1\"\nendpoint = \"http://127.0.0.1:9/v1\"",
            Documents,
            Ok((
                "aider",
                &[
                    "--yes-always",
                    "--no-auto-commits",
                    "--no-dirty-commits",
                    "--no-gitignore",
                    "--map-tokens",
                    "0",
                    "--no-auto-lint",
                    "--no-detect-urls",
                    "--no-check-update",
                    "--no-show-release-notes",
                    "--no-analytics",
                    "--no-pretty",
                    "--no-fancy-input",
                    "--no-show-model-warnings",
                    "--chat-history-file",
                    "/run/files/chat.history.md",
                    "--input-history-file",
                    "/run/files/input.history",
                    "--llm-history-file",
                    "/run/files/llm.history",
                    "--message-file",
                    "{prompt_file}",
                    "--model",
                    "openai/gpt-4.1",
                    "--openai-api-base",
                    "http://127.0.0.1:9/v1",
                ],
                File,
            )),
        );
        check(
            "command",
            "command = \"my-agent\"\nargs = [\"--in\", \"{prompt_file}\"]\nprompt_via = \"file\"",
            Documents,
            Ok(("my-agent", &["--in", "{prompt_file}"], File)),
        );
        check("command", "", Documents, Err("needs a `command`"));
        check("openai", "", Documents, Err("not a command"));
    }

    #[test]
    fn presets_get_their_own_home_and_settings() {
        let env = |backend: &str, extra: &str| {
            let p = plan(&config(backend, extra), Role::Documents, &dirs(), false).unwrap();
            (p.env, p.codex_config)
        };
        let (claude, _) = env(
            "claude",
            "endpoint = \"http://127.0.0.1:9\"\ncli_retries = 0",
        );
        for pair in [
            ("HOME", "/run/home"),
            ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
            ("CLAUDE_CODE_MAX_RETRIES", "0"),
            ("ANTHROPIC_BASE_URL", "http://127.0.0.1:9"),
        ] {
            assert!(
                claude.contains(&(pair.0.into(), pair.1.into())),
                "{pair:?} in {claude:?}"
            );
        }
        let (codex, toml) = env(
            "codex",
            "endpoint = \"http://127.0.0.1:9/v1\"\nmodel = \"gpt-5\"\napi_key_env = \"MY_KEY\"",
        );
        assert!(
            codex.contains(&("CODEX_HOME".into(), "/run/home/.codex".into())),
            "{codex:?}"
        );
        let toml = toml.unwrap();
        for line in [
            "model = \"gpt-5\"",
            "model_provider = \"orch\"",
            "base_url = \"http://127.0.0.1:9/v1\"",
            "wire_api = \"responses\"",
            "env_key = \"MY_KEY\"",
            "request_max_retries = 2",
        ] {
            assert!(toml.contains(line), "{line} in {toml}");
        }
        let user = Dirs {
            home: None,
            files: PathBuf::from("/f"),
        };
        let p = plan(&config("codex", ""), Role::Documents, &user, false).unwrap();
        assert_eq!((p.env, p.codex_config), (Vec::new(), None));
    }

    #[test]
    fn claude_result_gives_tokens_cost_and_errors() {
        let ok = r#"{"type":"result","subtype":"success","is_error":false,"duration_ms":1200,"num_turns":3,"result":"done","session_id":"s1","total_cost_usd":0.0123,"usage":{"input_tokens":100,"output_tokens":50,"cache_creation_input_tokens":10,"cache_read_input_tokens":5}}"#;
        let p = parse_claude(ok);
        assert_eq!(
            p.usage,
            TokenUsage {
                input: Some(115),
                output: Some(50),
                cost_usd: Some(0.0123)
            }
        );
        assert_eq!(p.error, None);
        assert_eq!(p.data.get("claude_session_id"), Some(&Value::from("s1")));

        let err = r#"{"type":"result","subtype":"success","is_error":true,"result":"Credit balance is too low","total_cost_usd":0}"#;
        assert_eq!(
            parse_claude(err).error.as_deref(),
            Some("Credit balance is too low")
        );

        let verbose = format!(r#"[{{"type":"system"}},{ok}]"#);
        assert_eq!(parse_claude(&verbose).usage.output, Some(50));
        let lines = format!("{{\"type\":\"system\"}}\nnoise\n{ok}\n");
        assert_eq!(parse_claude(&lines).usage.input, Some(115));
        assert_eq!(parse_claude("not json at all"), Parsed::default());
    }

    #[test]
    fn codex_events_sum_usage_and_report_failures() {
        let ok = concat!(
            "{\"type\":\"thread.started\",\"thread_id\":\"t1\"}\n",
            "{\"type\":\"turn.started\"}\n",
            "{\"type\":\"error\",\"message\":\"Reconnecting... 1/5\"}\n",
            "{\"type\":\"turn.completed\",\"usage\":{\"input_tokens\":1000,\"cached_input_tokens\":200,\"output_tokens\":50}}\n",
            "{\"type\":\"turn.completed\",\"usage\":{\"input_tokens\":500,\"cached_input_tokens\":0,\"output_tokens\":25}}\n",
        );
        let p = parse_codex(ok);
        assert_eq!(
            (p.usage.input, p.usage.output, p.usage.cost_usd),
            (Some(1500), Some(75), None)
        );
        assert_eq!(p.error, None);
        assert_eq!(
            p.data.get("codex_cached_input_tokens"),
            Some(&Value::from(200))
        );

        let failed = "{\"type\":\"turn.failed\",\"error\":{\"message\":\"stream disconnected\"}}\n";
        assert_eq!(
            parse_codex(failed).error.as_deref(),
            Some("stream disconnected")
        );
        let error = "{\"type\":\"error\",\"message\":\"429 Too Many Requests\"}\n";
        assert_eq!(
            parse_codex(error).error.as_deref(),
            Some("429 Too Many Requests")
        );
        assert_eq!(parse_codex("").usage, TokenUsage::default());
    }

    #[test]
    fn claude_errors_keep_status_turn_limit_text_and_denials() {
        let max_turns = r#"{"type":"result","subtype":"error_max_turns","is_error":true,"num_turns":3,"errors":["Reached maximum number of turns (2)"],"total_cost_usd":0.01,"usage":{"input_tokens":10,"output_tokens":5},"permission_denials":[]}"#;
        let p = parse_claude(max_turns);
        assert_eq!(p.class, Some(Class::Permanent));
        let e = p.error.unwrap();
        assert!(
            e.contains("error_max_turns") && e.contains("Reached maximum number of turns (2)"),
            "{e}"
        );

        let api = r#"{"type":"result","subtype":"success","is_error":true,"api_error_status":500,"result":"API Error: 500 boom. This is usually temporary.","usage":{"input_tokens":0,"output_tokens":0}}"#;
        let p = parse_claude(api);
        assert_eq!(p.class, Some(Class::Transient));
        assert_eq!(
            p.data.get("claude_api_error_status"),
            Some(&Value::from(500))
        );
        assert!(p.error.unwrap().contains("API error 500"));
        let auth = r#"{"type":"result","subtype":"success","is_error":true,"api_error_status":401,"result":"Invalid API key"}"#;
        assert_eq!(parse_claude(auth).class, Some(Class::Permanent));
        assert!(parse_claude(auth).auth);

        // The structured fields decide before the words: newer Claude Code names the kind.
        let refused = r#"{"type":"result","subtype":"success","is_error":true,"terminal_reason":"api_error","api_error":"connection_failed","result":"API Error: Connection refused"}"#;
        let p = parse_claude(refused);
        assert_eq!(p.class, Some(Class::Transient));
        assert_eq!(
            p.data.get("claude_api_error"),
            Some(&Value::from("connection_failed"))
        );
        let kind_says_auth = r#"{"type":"result","subtype":"success","is_error":true,"api_error":"authentication_failed","result":"rate limit words do not decide"}"#;
        let p = parse_claude(kind_says_auth);
        assert_eq!(p.class, Some(Class::Permanent));
        assert!(p.auth);
        // 2.1.197 has no kind: its words, which used to slip past the text match.
        let old = r#"{"type":"result","subtype":"success","is_error":true,"result":"Unable to connect to API (ConnectionRefused)"}"#;
        assert_eq!(parse_claude(old).class, Some(Class::Transient));
        let login = r#"{"type":"result","subtype":"success","is_error":true,"result":"Not logged in · Please run /login"}"#;
        assert_eq!(parse_claude(login).class, Some(Class::Permanent));
        assert!(is_auth_text("Not logged in · Please run /login"));

        let denied = r#"{"type":"result","subtype":"success","is_error":false,"result":"done","usage":{"input_tokens":1,"output_tokens":1},"permission_denials":[{"tool_name":"Bash","tool_use_id":"t1","tool_input":{"command":"python3 -m unittest -q"}},{"tool_name":"WebFetch","tool_use_id":"t2","tool_input":{"url":"http://x"}}]}"#;
        let p = parse_claude(denied);
        assert_eq!(p.error, None);
        assert_eq!(
            p.denials,
            vec![
                Denial {
                    tool: "Bash".into(),
                    detail: "python3 -m unittest -q".into(),
                    required: true
                },
                Denial {
                    tool: "WebFetch".into(),
                    detail: "http://x".into(),
                    required: false
                },
            ]
        );
    }

    #[test]
    fn codex_warning_items_are_not_errors_and_sandbox_refusals_are_denials() {
        let out = concat!(
            "{\"type\":\"thread.started\",\"thread_id\":\"t\"}\n",
            "{\"type\":\"item.completed\",\"item\":{\"id\":\"item_0\",\"type\":\"error\",\"message\":\"Model metadata for `m` not found.\"}}\n",
            "{\"type\":\"item.completed\",\"item\":{\"id\":\"item_1\",\"type\":\"command_execution\",\"command\":\"touch /etc/x\",\"aggregated_output\":\"touch: cannot touch '/etc/x': Read-only file system\\n\",\"exit_code\":1,\"status\":\"failed\"}}\n",
            "{\"type\":\"item.completed\",\"item\":{\"id\":\"item_2\",\"type\":\"command_execution\",\"command\":\"false\",\"aggregated_output\":\"\",\"exit_code\":1,\"status\":\"failed\"}}\n",
            "{\"type\":\"turn.completed\",\"usage\":{\"input_tokens\":10,\"cached_input_tokens\":0,\"output_tokens\":2}}\n",
        );
        let p = parse_codex(out);
        assert_eq!(p.error, None);
        assert_eq!((p.usage.input, p.usage.output), (Some(10), Some(2)));
        assert_eq!(p.denials.len(), 1, "{:?}", p.denials);
        assert_eq!(p.denials[0].detail, "touch /etc/x");
        assert_eq!(
            p.data["codex_failed_commands"].as_array().map(Vec::len),
            Some(2)
        );
        assert_eq!(p.data["codex_warnings"].as_array().map(Vec::len), Some(1));
        let failed = "{\"type\":\"error\",\"message\":\"unexpected status 401 Unauthorized: bad key\"}\n{\"type\":\"turn.failed\",\"error\":{\"message\":\"unexpected status 401 Unauthorized: bad key\"}}\n";
        assert_eq!(parse_codex(failed).class, Some(Class::Permanent));
    }

    #[test]
    fn codex_rollout_gives_the_refusals_the_events_leave_out() {
        let rollout = concat!(
            "{\"type\":\"session_meta\",\"payload\":{\"id\":\"t\"}}\n",
            "{\"type\":\"response_item\",\"payload\":{\"type\":\"function_call\",\"name\":\"exec_command\",\"arguments\":\"{\\\"cmd\\\":\\\"touch /var/tmp/x\\\"}\",\"call_id\":\"c0\"}}\n",
            "{\"type\":\"response_item\",\"payload\":{\"type\":\"function_call_output\",\"call_id\":\"c0\",\"output\":\"Chunk ID: 1\\nWall time: 0.0000 seconds\\nProcess exited with code 1\\nOutput:\\ntouch: cannot touch '/var/tmp/x': Read-only file system\\n\"}}\n",
            "{\"type\":\"response_item\",\"payload\":{\"type\":\"function_call\",\"name\":\"exec_command\",\"arguments\":\"{\\\"cmd\\\":\\\"grep -r denied .\\\"}\",\"call_id\":\"c1\"}}\n",
            "{\"type\":\"response_item\",\"payload\":{\"type\":\"function_call_output\",\"call_id\":\"c1\",\"output\":\"Process exited with code 0\\nOutput:\\nlog: permission denied\\n\"}}\n",
        );
        let d = parse_codex_rollout(rollout);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(
            (d[0].tool.as_str(), d[0].detail.as_str()),
            ("sandbox", "touch /var/tmp/x")
        );
        assert!(d[0].required);
    }

    #[test]
    fn aider_output_gives_tokens_cost_and_errors_whatever_the_exit_code() {
        let ok = "Aider v0.86.2\nI will write it.\n\nTokens: 2.3k sent, 18 received. Cost: $0.0070 message, $0.0070 session.\n\nnotes/x.md\nApplied edit to notes/x.md\n";
        let p = parse_aider(ok);
        assert_eq!(
            p.usage,
            TokenUsage {
                input: Some(2300),
                output: Some(18),
                cost_usd: Some(0.007)
            }
        );
        assert_eq!(p.error, None);
        let retried = "litellm.RateLimitError: RateLimitError: OpenAIException - slow down\nRetrying in 0.2 seconds...\nTokens: 596 sent, 18 received.\nApplied edit to a.md\n";
        let p = parse_aider(retried);
        assert_eq!((p.error, p.usage.input), (None, Some(596)));
        let auth = "litellm.AuthenticationError: AuthenticationError: OpenAIException - Incorrect API key\nThe API provider is not able to authenticate you. Check your API key.\n";
        let p = parse_aider(auth);
        assert_eq!(p.class, Some(Class::Permanent));
        assert_eq!(p.usage, TokenUsage::default());
        let down = "litellm.InternalServerError: InternalServerError: OpenAIException - boom\nThe API provider's servers are down or overloaded.\nRetrying in 0.2 seconds...\n";
        assert_eq!(parse_aider(down).class, Some(Class::Transient));
    }
}
