//! The Claude Code preset: `claude -p --output-format stream-json --verbose`, the tools each
//! role is offered, its environment, `--resume`/`--session-id`, and its result object read
//! for usage, cost, errors and permission denials.

use orch_domain::config::AgentConfig;
use serde_json::Value;

use super::{
    Class, DEFAULT_MAX_TURNS, Denial, MAX_ERROR_BYTES, Parsed, Parser, Plan, REQUIRED_TOOLS, Role,
    SessionArgs, bound_text, class_of_api_error, class_of_status, class_of_text, input_summary,
    int, model_args, strs,
};

/// The program, and the CLI's name in events and `agent_runs.backend`.
pub(crate) const NAME: &str = "claude";
/// The oldest and newest versions orch's real-CLI tests ran (see the README).
pub(crate) const TESTED: (&str, &str) = ("2.1.197", "2.1.332");
/// Its files in a user's `HOME` (`config_home = "user"`).
pub(super) const USER_CONFIG: &[&str] = &[".claude", ".claude.json"];

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

/// The tools a role is offered.
fn tools(role: Role) -> &'static [&'static str] {
    match role {
        Role::Documents => &["Read", "Write", "Edit"],
        Role::Commands => &["Read", "Write", "Edit", "Bash"],
    }
}

/// The command line and environment of a run.
pub(super) fn plan(
    config: &AgentConfig,
    role: Role,
    program: String,
    mut env: Vec<(String, String)>,
    retries: u32,
) -> Plan {
    let allowed: Vec<String> = match &config.allowed_tools {
        Some(list) => list.clone(),
        None => strs(tools(role)),
    };
    let disallowed: Vec<String> = match &config.disallowed_tools {
        Some(list) => list.clone(),
        None => strs(&CLAUDE_DENIED_TOOLS),
    };
    // The tools the model is offered: the role's, plus any allowed by configuration
    // (`Bash(git status:*)` offers `Bash`), minus the refused ones.
    let mut offered: Vec<String> = strs(tools(role));
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
        program,
        args: [args, model_args(config, "--model"), config.args.clone()].concat(),
        via: config.prompt_via,
        parser: Parser::Claude,
        env,
        codex_config: None,
    }
}

/// Continue session `resume` (`--resume <id>`) or name a new one (`--session-id <id>`).
pub(super) fn with_session(plan: &mut Plan, session: &SessionArgs) {
    match (&session.resume, &session.new_id) {
        (Some(id), _) => plan.args.extend(["--resume".to_owned(), id.clone()]),
        (None, Some(id)) => plan.args.extend(["--session-id".to_owned(), id.clone()]),
        (None, None) => {}
    }
}

/// Claude Code's `--output-format json` result: one object (`"type": "result"`), or, with
/// `--verbose`, an array or lines of events ending in it.
pub(super) fn parse(stdout: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let Some(result) = find_result(stdout) else {
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

fn find_result(stdout: &str) -> Option<Value> {
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
