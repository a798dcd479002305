//! The Aider preset: its flags (no commits of its own, no network lookups, history files in
//! the run's directory, the prompt in a file), `--restore-chat-history`, its console output
//! read for usage, cost, edits and errors, and what it leaves in a worktree undone.

use std::path::Path;

use orch_domain::config::{AgentConfig, PromptVia};
use orch_exec::process::run as run_process;
use serde_json::Value;

use super::{
    Dirs, MAX_ERROR_BYTES, Parsed, Parser, Plan, SessionArgs, bound_text, class_of_text, strs,
};

/// The program, and the CLI's name in events and `agent_runs.backend`.
pub(crate) const NAME: &str = "aider";
/// The oldest and newest versions orch's real-CLI tests ran (see the README).
pub(crate) const TESTED: (&str, &str) = ("0.86.2", "0.86.2");
/// Its files in a user's `HOME` (`config_home = "user"`).
pub(super) const USER_CONFIG: &[&str] = &[".aider"];

/// The command line and environment of a run.
pub(super) fn plan(
    config: &AgentConfig,
    dirs: &Dirs,
    program: String,
    mut env: Vec<(String, String)>,
) -> Plan {
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
        program,
        args: [args, config.args.clone()].concat(),
        via: PromptVia::File,
        parser: Parser::Aider,
        env,
        codex_config: None,
    }
}

/// Continue a session: Aider restores its chat history (any session id does).
pub(super) fn with_session(plan: &mut Plan, session: &SessionArgs) {
    if session.resume.is_some() {
        plan.args.push("--restore-chat-history".to_owned());
    }
}

/// A count as Aider prints it: `596`, `1.2k`, `3.4M`.
pub(super) fn aider_count(s: &str) -> Option<i64> {
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
pub(super) fn parse(text: &str) -> Parsed {
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

/// Undoes what Aider does to a worktree besides the work: its `.aider*` files at the root
/// and the files it `git add`s (the index is reset to `HEAD`; the engine commits what the
/// stage may commit). Returns what was removed or unstaged.
pub(super) async fn clean_after(git: &orch_exec::Git, worktree: &Path) -> Vec<String> {
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
