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

// One file per CLI preset: its flags, environment, session arguments, output parser, the
// files of its own in a user's HOME and the versions orch's real-CLI tests ran.
mod aider;
mod claude;
mod codex;

/// Bytes kept from the end of stdout and of stderr. Claude Code's result object is the whole
/// of its stdout, so this bounds the largest result it can report.
const OUTPUT_LIMIT: usize = 4 * 1024 * 1024;
/// How much of the end of the output is searched for transient-error words.
const TRANSIENT_SCAN_BYTES: usize = 8 * 1024;

/// Claude Code's default turn limit per run.
pub(crate) const DEFAULT_MAX_TURNS: u32 = 50;
/// Retries a CLI makes itself on API errors, by default.
pub(crate) const DEFAULT_CLI_RETRIES: u32 = 2;

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
    let program = |default: &str| {
        config
            .command
            .clone()
            .filter(|c| !c.trim().is_empty())
            .unwrap_or_else(|| default.to_owned())
    };
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
        Backend::Claude => claude::plan(config, role, program(claude::NAME), env, retries),
        Backend::Codex => codex::plan(config, dirs, contained, program(codex::NAME), env, retries),
        Backend::Aider => aider::plan(config, dirs, program(aider::NAME), env),
        Backend::Openai => return Err("the `openai` backend is not a command".to_owned()),
    })
}

/// The CLI name of a preset backend (`None`: not a preset).
pub(super) fn preset_name(backend: Backend) -> Option<&'static str> {
    match backend {
        Backend::Claude => Some(claude::NAME),
        Backend::Codex => Some(codex::NAME),
        Backend::Aider => Some(aider::NAME),
        Backend::Command | Backend::Openai => None,
    }
}

/// The oldest and newest versions of preset `name`'s CLI that orch's real-CLI tests ran;
/// empty for a name that is no preset.
pub(super) fn preset_tested(name: &str) -> (&'static str, &'static str) {
    match name {
        claude::NAME => claude::TESTED,
        codex::NAME => codex::TESTED,
        aider::NAME => aider::TESTED,
        _ => ("", ""),
    }
}

/// `[flag, model]` when the agent names a model.
fn model_args(config: &AgentConfig, flag: &str) -> Vec<String> {
    config
        .model
        .iter()
        .flat_map(|m| [flag.to_owned(), m.clone()])
        .collect()
}

fn strs(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| (*s).to_owned()).collect()
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
    match backend {
        Backend::Claude => claude::with_session(&mut plan, session),
        Backend::Codex => codex::with_session(&mut plan, session),
        Backend::Aider => aider::with_session(&mut plan, session),
        Backend::Command | Backend::Openai => {}
    }
    plan
}

/// With `config_home = "user"`, the CLI's own files in the orch user's `HOME` (its login and
/// settings), which the run's sandbox then shows writable; nothing else of `HOME`.
fn user_config_dirs(backend: Backend) -> Vec<PathBuf> {
    let Some(home) = std::env::var_os("HOME").map(PathBuf::from) else {
        return Vec::new();
    };
    let names: &[&str] = match backend {
        Backend::Claude => claude::USER_CONFIG,
        Backend::Codex => codex::USER_CONFIG,
        Backend::Aider => aider::USER_CONFIG,
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
        codex::rollout_denials(&dirs, &mut result);
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
        let cleaned = aider::clean_after(&inv.run.git, inv.worktree).await;
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
        Parser::Claude => claude::parse(&out.stdout_lossy()),
        Parser::Codex => codex::parse(&out.stdout_lossy()),
        Parser::Aider => aider::parse(&format!("{}\n{}", out.stdout_lossy(), out.stderr_lossy())),
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

#[cfg(test)]
mod tests {
    use super::*;
    use super::{aider, claude, codex};

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
        let p = claude::parse(ok);
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
            claude::parse(err).error.as_deref(),
            Some("Credit balance is too low")
        );

        let verbose = format!(r#"[{{"type":"system"}},{ok}]"#);
        assert_eq!(claude::parse(&verbose).usage.output, Some(50));
        let lines = format!("{{\"type\":\"system\"}}\nnoise\n{ok}\n");
        assert_eq!(claude::parse(&lines).usage.input, Some(115));
        assert_eq!(claude::parse("not json at all"), Parsed::default());
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
        let p = codex::parse(ok);
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
            codex::parse(failed).error.as_deref(),
            Some("stream disconnected")
        );
        let error = "{\"type\":\"error\",\"message\":\"429 Too Many Requests\"}\n";
        assert_eq!(
            codex::parse(error).error.as_deref(),
            Some("429 Too Many Requests")
        );
        assert_eq!(codex::parse("").usage, TokenUsage::default());
    }

    #[test]
    fn claude_errors_keep_status_turn_limit_text_and_denials() {
        let max_turns = r#"{"type":"result","subtype":"error_max_turns","is_error":true,"num_turns":3,"errors":["Reached maximum number of turns (2)"],"total_cost_usd":0.01,"usage":{"input_tokens":10,"output_tokens":5},"permission_denials":[]}"#;
        let p = claude::parse(max_turns);
        assert_eq!(p.class, Some(Class::Permanent));
        let e = p.error.unwrap();
        assert!(
            e.contains("error_max_turns") && e.contains("Reached maximum number of turns (2)"),
            "{e}"
        );

        let api = r#"{"type":"result","subtype":"success","is_error":true,"api_error_status":500,"result":"API Error: 500 boom. This is usually temporary.","usage":{"input_tokens":0,"output_tokens":0}}"#;
        let p = claude::parse(api);
        assert_eq!(p.class, Some(Class::Transient));
        assert_eq!(
            p.data.get("claude_api_error_status"),
            Some(&Value::from(500))
        );
        assert!(p.error.unwrap().contains("API error 500"));
        let auth = r#"{"type":"result","subtype":"success","is_error":true,"api_error_status":401,"result":"Invalid API key"}"#;
        assert_eq!(claude::parse(auth).class, Some(Class::Permanent));
        assert!(claude::parse(auth).auth);

        // The structured fields decide before the words: newer Claude Code names the kind.
        let refused = r#"{"type":"result","subtype":"success","is_error":true,"terminal_reason":"api_error","api_error":"connection_failed","result":"API Error: Connection refused"}"#;
        let p = claude::parse(refused);
        assert_eq!(p.class, Some(Class::Transient));
        assert_eq!(
            p.data.get("claude_api_error"),
            Some(&Value::from("connection_failed"))
        );
        let kind_says_auth = r#"{"type":"result","subtype":"success","is_error":true,"api_error":"authentication_failed","result":"rate limit words do not decide"}"#;
        let p = claude::parse(kind_says_auth);
        assert_eq!(p.class, Some(Class::Permanent));
        assert!(p.auth);
        // 2.1.197 has no kind: its words, which used to slip past the text match.
        let old = r#"{"type":"result","subtype":"success","is_error":true,"result":"Unable to connect to API (ConnectionRefused)"}"#;
        assert_eq!(claude::parse(old).class, Some(Class::Transient));
        let login = r#"{"type":"result","subtype":"success","is_error":true,"result":"Not logged in · Please run /login"}"#;
        assert_eq!(claude::parse(login).class, Some(Class::Permanent));
        assert!(is_auth_text("Not logged in · Please run /login"));

        let denied = r#"{"type":"result","subtype":"success","is_error":false,"result":"done","usage":{"input_tokens":1,"output_tokens":1},"permission_denials":[{"tool_name":"Bash","tool_use_id":"t1","tool_input":{"command":"python3 -m unittest -q"}},{"tool_name":"WebFetch","tool_use_id":"t2","tool_input":{"url":"http://x"}}]}"#;
        let p = claude::parse(denied);
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
        let p = codex::parse(out);
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
        assert_eq!(codex::parse(failed).class, Some(Class::Permanent));
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
        let d = codex::parse_rollout(rollout);
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
        let p = aider::parse(ok);
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
        let p = aider::parse(retried);
        assert_eq!((p.error, p.usage.input), (None, Some(596)));
        let auth = "litellm.AuthenticationError: AuthenticationError: OpenAIException - Incorrect API key\nThe API provider is not able to authenticate you. Check your API key.\n";
        let p = aider::parse(auth);
        assert_eq!(p.class, Some(Class::Permanent));
        assert_eq!(p.usage, TokenUsage::default());
        let down = "litellm.InternalServerError: InternalServerError: OpenAIException - boom\nThe API provider's servers are down or overloaded.\nRetrying in 0.2 seconds...\n";
        assert_eq!(aider::parse(down).class, Some(Class::Transient));
    }
}
