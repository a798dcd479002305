//! CLI agent backends (SPEC §4): any program (`command`), and the presets for Claude Code
//! (`claude -p --output-format json`), Codex CLI (`codex exec --json`) and Aider.
//!
//! The program runs in the work item's worktree through `orch_exec::process::run` (its own
//! process group, the agent's timeout, the job's cancellation, bounded output). The prompt
//! goes on stdin or in a temporary file outside the worktree (`ORCH_PROMPT_FILE`, or the
//! `{prompt_file}` placeholder in the arguments), deleted when the try ends. `ORCH_*`
//! variables name the work item, stage, worktree and expected artifact. The presets' JSON
//! output is read for tokens and cost; a run that reports an error is a failure even when it
//! exits 0.

use std::io::Write as _;
use std::path::Path;

use orch_domain::config::{AgentConfig, Backend, PromptVia};
use orch_exec::process::{Cmd, ExitKind, Output, run as run_process};
use serde_json::Value;

use super::{
    AgentError, Invocation, MAX_ERROR_BYTES, TokenUsage, TryEnd, TryResult, bound_text,
    mentions_transient,
};

/// Bytes kept from the end of stdout and of stderr. Claude Code's result object is the whole
/// of its stdout, so this bounds the largest result it can report.
const OUTPUT_LIMIT: usize = 4 * 1024 * 1024;
/// How much of the end of the output is searched for transient-error words.
const TRANSIENT_SCAN_BYTES: usize = 8 * 1024;

/// Variables an agent must not inherit from orch: its API token and database, and git
/// variables that would point the agent's git at another repository.
const SCRUBBED_ENV: [&str; 7] = [
    "ORCH_TOKEN",
    "ORCH_DATABASE_URL",
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_COMMON_DIR",
];

/// How a backend's stdout is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parser {
    /// Not read (no usage reported).
    Plain,
    /// Claude Code's JSON result object.
    Claude,
    /// Codex CLI's JSONL events.
    Codex,
}

/// The program line of a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    program: String,
    args: Vec<String>,
    via: PromptVia,
    parser: Parser,
}

/// The program, arguments, prompt channel and output parser of `config`.
fn plan(config: &AgentConfig) -> Result<Plan, String> {
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
        },
        Backend::Claude => Plan {
            program: program("claude"),
            args: [
                strs(&[
                    "-p",
                    "--output-format",
                    "json",
                    "--permission-mode",
                    "acceptEdits",
                ]),
                model_args("--model"),
                config.args.clone(),
            ]
            .concat(),
            via: config.prompt_via,
            parser: Parser::Claude,
        },
        Backend::Codex => {
            let stdin_marker = match config.prompt_via {
                PromptVia::Stdin => strs(&["-"]),
                PromptVia::File => Vec::new(),
            };
            Plan {
                program: program("codex"),
                args: [
                    strs(&["exec", "--json", "--full-auto"]),
                    model_args("-m"),
                    config.args.clone(),
                    stdin_marker,
                ]
                .concat(),
                via: config.prompt_via,
                parser: Parser::Codex,
            }
        }
        Backend::Aider => Plan {
            program: program("aider"),
            args: [
                strs(&[
                    "--yes-always",
                    "--no-auto-commits",
                    "--message-file",
                    "{prompt_file}",
                ]),
                model_args("--model"),
                config.args.clone(),
            ]
            .concat(),
            via: PromptVia::File,
            parser: Parser::Plain,
        },
        Backend::Openai => return Err("the `openai` backend is not a command".to_owned()),
    })
}

/// Runs one try of a CLI backend.
pub(crate) async fn run(inv: &Invocation<'_>) -> TryResult {
    let plan = match plan(inv.config) {
        Ok(p) => p,
        Err(e) => return TryResult::failed(inv.error(e)),
    };
    let wants_file =
        plan.via == PromptVia::File || plan.args.iter().any(|a| a.contains("{prompt_file}"));
    let prompt_file = if wants_file {
        match write_prompt_file(inv.prompt) {
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
    let mut cmd = Cmd::new(&plan.program)
        .no_daemons()
        .args(args)
        .cwd(inv.worktree)
        .timeout(inv.timeout)
        .output_limit(OUTPUT_LIMIT)
        .cancel_on(inv.run.cancel.clone());
    for key in SCRUBBED_ENV {
        cmd = cmd.env_remove(key);
    }
    for (key, value) in vars.env() {
        cmd = cmd.env(key, value);
    }
    if plan.via == PromptVia::Stdin {
        cmd = cmd.stdin(inv.prompt.as_bytes().to_vec());
    }
    let started = std::time::Instant::now();
    let out = run_process(&cmd).await;
    drop(prompt_file);
    let mut result = match out {
        Ok(out) => interpret(inv, &plan, &out),
        Err(e) => TryResult::failed(inv.error(e.to_string())),
    };
    result.data.insert("program".into(), plan.program.into());
    result.data.insert(
        "duration_ms".into(),
        u64::try_from(started.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .into(),
    );
    result
}

/// The prompt in a private temporary file (outside the worktree, so it is never committed).
fn write_prompt_file(prompt: &str) -> std::io::Result<tempfile::NamedTempFile> {
    let mut file = tempfile::Builder::new()
        .prefix("orch-prompt-")
        .suffix(".md")
        .tempfile()?;
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

/// Turns a finished process into a try result.
fn interpret(inv: &Invocation<'_>, plan: &Plan, out: &Output) -> TryResult {
    let mut result = TryResult::new(TryEnd::Ok);
    result
        .data
        .insert("stdout_bytes".into(), out.stdout_bytes.into());
    result
        .data
        .insert("stderr_bytes".into(), out.stderr_bytes.into());
    let code = match out.status {
        ExitKind::TimedOut => {
            result.end = TryEnd::Failed(AgentError::TimedOut {
                agent: inv.agent.clone(),
                secs: inv.timeout.as_secs(),
            });
            return result;
        }
        ExitKind::Cancelled => {
            result.end = TryEnd::Failed(AgentError::Cancelled {
                agent: inv.agent.clone(),
            });
            return result;
        }
        ExitKind::Signaled(sig) => {
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
    };
    result.usage = parsed.usage;
    result.data.extend(parsed.data);
    if code == 0 && parsed.error.is_none() {
        if plan.parser != Parser::Plain && parsed.usage == TokenUsage::default() {
            tracing::warn!(agent = %inv.agent, program = %plan.program, "the agent reported no usage; tokens and cost are unknown");
        }
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
    let scan = format!(
        "{}\n{}",
        parsed.error.as_deref().unwrap_or(""),
        tail_of(out, TRANSIENT_SCAN_BYTES)
    );
    let message = bound_text(&message, MAX_ERROR_BYTES);
    result.end = if mentions_transient(&scan) {
        TryEnd::Transient(message)
    } else {
        TryEnd::Failed(inv.error(message))
    };
    result
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
    data: serde_json::Map<String, Value>,
}

fn int(v: &Value, key: &str) -> Option<i64> {
    v.get(key).and_then(Value::as_i64)
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
    for key in ["session_id", "num_turns", "duration_ms", "subtype"] {
        if let Some(v) = result.get(key) {
            parsed.data.insert(format!("claude_{key}"), v.clone());
        }
    }
    if result.get("is_error").and_then(Value::as_bool) == Some(true) {
        let text = result
            .get("result")
            .and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
            .or_else(|| result.get("subtype").and_then(Value::as_str))
            .unwrap_or("is_error is true");
        parsed.error = Some(bound_text(text.trim(), MAX_ERROR_BYTES));
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

/// Codex CLI's `exec --json` events: usage summed over `turn.completed`; a `turn.failed`, or
/// an `error` not followed by a completed turn, is the run's error.
fn parse_codex(stdout: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let (mut input, mut cached, mut output, mut turns) = (0i64, 0i64, 0i64, 0i64);
    let mut failed: Option<String> = None;
    let mut pending: Option<String> = None;
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
    parsed.error = failed.or(pending).map(|e| bound_text(&e, MAX_ERROR_BYTES));
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

    /// Plans `backend` with `extra` config lines and compares program, args and channel.
    fn check(backend: &str, extra: &str, expect: Result<(&str, &[&str], PromptVia), &str>) {
        let got = plan(&config(backend, extra));
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

    #[test]
    fn presets_build_their_command_lines() {
        use PromptVia::{File, Stdin};
        check(
            "claude",
            "",
            Ok((
                "claude",
                &[
                    "-p",
                    "--output-format",
                    "json",
                    "--permission-mode",
                    "acceptEdits",
                ],
                Stdin,
            )),
        );
        check(
            "claude",
            "model = \"opus\"\ncommand = \"/opt/claude\"\nargs = [\"--verbose\"]",
            Ok((
                "/opt/claude",
                &[
                    "-p",
                    "--output-format",
                    "json",
                    "--permission-mode",
                    "acceptEdits",
                    "--model",
                    "opus",
                    "--verbose",
                ],
                Stdin,
            )),
        );
        check(
            "codex",
            "model = \"o4\"",
            Ok((
                "codex",
                &["exec", "--json", "--full-auto", "-m", "o4", "-"],
                Stdin,
            )),
        );
        check(
            "codex",
            "prompt_via = \"file\"\nargs = [\"{prompt_file}\"]",
            Ok((
                "codex",
                &["exec", "--json", "--full-auto", "{prompt_file}"],
                File,
            )),
        );
        check(
            "aider",
            "model = \"sonnet\"",
            Ok((
                "aider",
                &[
                    "--yes-always",
                    "--no-auto-commits",
                    "--message-file",
                    "{prompt_file}",
                    "--model",
                    "sonnet",
                ],
                File,
            )),
        );
        check(
            "command",
            "command = \"my-agent\"\nargs = [\"--in\", \"{prompt_file}\"]\nprompt_via = \"file\"",
            Ok(("my-agent", &["--in", "{prompt_file}"], File)),
        );
        check("command", "", Err("needs a `command`"));
        check("openai", "", Err("not a command"));
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
}
