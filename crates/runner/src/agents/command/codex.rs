//! The Codex CLI preset: `codex exec --json` with a `$CODEX_HOME/config.toml` of the run's
//! own (a provider at the agent's endpoint), `exec … resume <id>`, and its JSONL events and
//! session rollout read for usage, errors and sandbox refusals.

use std::path::PathBuf;

use orch_domain::config::{AgentConfig, PromptVia};
use serde_json::{Value, json};

use super::{
    Denial, Dirs, MAX_ERROR_BYTES, Parsed, Parser, Plan, SessionArgs, TryResult, bound_text,
    class_of_text, int, model_args, strs,
};

/// The program, and the CLI's name in events and `agent_runs.backend`.
pub(crate) const NAME: &str = "codex";
/// The oldest and newest versions orch's real-CLI tests ran (see the README).
pub(crate) const TESTED: (&str, &str) = ("0.171.0", "0.171.0");
/// Its files in a user's `HOME` (`config_home = "user"`).
pub(super) const USER_CONFIG: &[&str] = &[".codex"];

/// The command line and environment of a run. `contained`: orch's own sandbox runs the CLI
/// (Codex's sandbox cannot be set up inside it: Codex then runs with full access inside
/// orch's).
pub(super) fn plan(
    config: &AgentConfig,
    dirs: &Dirs,
    contained: bool,
    program: String,
    mut env: Vec<(String, String)>,
    retries: u32,
) -> Plan {
    let stdin_marker = match config.prompt_via {
        PromptVia::Stdin => strs(&["-"]),
        PromptVia::File => Vec::new(),
    };
    let codex_config = dirs.home.as_ref().map(|home| {
        env.push((
            "CODEX_HOME".into(),
            home.join(".codex").display().to_string(),
        ));
        config_toml(config, retries)
    });
    Plan {
        program,
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
            model_args(config, "-m"),
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

/// Continue session `resume`: `resume <id>` is a subcommand of `exec`, after exec's options
/// and before the prompt's `-`.
pub(super) fn with_session(plan: &mut Plan, session: &SessionArgs) {
    let Some(id) = &session.resume else {
        return;
    };
    let at = if plan.via == PromptVia::Stdin && plan.args.last().is_some_and(|a| a == "-") {
        plan.args.len() - 1
    } else {
        plan.args.len()
    };
    plan.args.insert(at, id.clone());
    plan.args.insert(at, "resume".to_owned());
}

/// A TOML string literal.
fn toml_str(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// `$CODEX_HOME/config.toml` of a run: a provider `orch` speaking the Responses API at the
/// agent's `endpoint` (OpenAI's by default) with the key from `api_key_env`.
pub(super) fn config_toml(config: &AgentConfig, retries: u32) -> String {
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
pub(super) fn parse(stdout: &str) -> Parsed {
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
pub(super) fn rollout_denials(dirs: &Dirs, result: &mut TryResult) {
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
    let Some(rollout) = crate::fsutil::find_file(
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
    for denial in parse_rollout(&text) {
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

/// The sandbox refusals in a Codex rollout: a tool call whose output reports a non-zero exit
/// ("Process exited with code 1", "Exit code: 1") and words of a refusal.
pub(super) fn parse_rollout(text: &str) -> Vec<Denial> {
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
