//! An agent run's transcript read as a conversation: the messages, the tool calls with their
//! inputs and results, the commands run with their exit codes. One reader per format the
//! runner stores (`claude-stream-json`, `codex-json`, `aider-chat-md`, `text`); the task page
//! and `orch logs --transcript` both show what it returns. A line a reader does not know is
//! kept as a note, never dropped, so a newer CLI's new event kinds still show up.

use serde_json::Value;

/// One step of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Text said by `role` (`assistant`, `user`, `reasoning`, `output`).
    Message {
        /// Who said it.
        role: String,
        /// What was said.
        text: String,
    },
    /// A tool the model called, with its input (a command, a path and content, …).
    ToolCall {
        /// The tool's name.
        name: String,
        /// Its input, as text.
        input: String,
    },
    /// What a tool call returned.
    ToolResult {
        /// The result's text.
        text: String,
        /// Whether the tool reported an error.
        error: bool,
    },
    /// A command the agent ran, its exit code and output.
    Command {
        /// The command line.
        command: String,
        /// Its exit code, when it finished.
        exit_code: Option<i64>,
        /// What it printed.
        output: String,
    },
    /// Anything else: the session's start, the final result, an error, an unknown line.
    Note(String),
}

/// The transcript format the runner stores for a backend.
pub fn format_of(backend: &str) -> &'static str {
    match backend {
        "claude" => "claude-stream-json",
        "codex" => "codex-json",
        "aider" => "aider-chat-md",
        "openai" => "openai-chat-json",
        _ => "text",
    }
}

/// The entries of `text` stored in `format`.
pub fn entries(format: &str, text: &str) -> Vec<Entry> {
    match format {
        "claude-stream-json" => json_lines(text, claude_event),
        "codex-json" => json_lines(text, codex_event),
        "aider-chat-md" => aider(text),
        "openai-chat-json" => json_lines(text, openai_line),
        _ if text.trim().is_empty() => Vec::new(),
        _ => vec![Entry::Message {
            role: "output".into(),
            text: text.trim_end().to_owned(),
        }],
    }
}

fn json_lines(text: &str, read: fn(&Value, &mut Vec<Entry>)) -> Vec<Entry> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(v) if v.is_object() => read(&v, &mut out),
            _ => out.push(Entry::Note(line.to_owned())),
        }
    }
    out
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// A tool's input as text: a command alone, a lone string alone, else JSON.
fn input_text(input: &Value) -> String {
    if let Some(cmd) = input.get("command").and_then(Value::as_str) {
        return cmd.to_owned();
    }
    if let Some(obj) = input.as_object()
        && obj.len() == 1
        && let Some(s) = obj.values().next().and_then(Value::as_str)
    {
        return s.to_owned();
    }
    serde_json::to_string_pretty(input).unwrap_or_else(|_| input.to_string())
}

/// A tool result's content: a string, or blocks of text.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match b.get("text").and_then(Value::as_str) {
                Some(t) => t.to_owned(),
                None => b.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Claude Code `--output-format stream-json` (`system` init, `assistant` and `user` messages,
/// the `result` last).
fn claude_event(v: &Value, out: &mut Vec<Entry>) {
    match str_of(v, "type") {
        "system" if str_of(v, "subtype") == "init" => {
            let tools: Vec<&str> = v
                .get("tools")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            out.push(Entry::Note(format!(
                "Claude Code {} started: model {}, tools {}",
                str_of(v, "claude_code_version"),
                str_of(v, "model"),
                tools.join(", ")
            )));
        }
        "assistant" | "user" => {
            let role = str_of(v, "type");
            let content = v.get("message").and_then(|m| m.get("content"));
            match content {
                Some(Value::String(s)) => out.push(Entry::Message {
                    role: role.into(),
                    text: s.clone(),
                }),
                Some(Value::Array(blocks)) => {
                    for b in blocks {
                        match str_of(b, "type") {
                            "text" => out.push(Entry::Message {
                                role: role.into(),
                                text: str_of(b, "text").to_owned(),
                            }),
                            "thinking" => out.push(Entry::Message {
                                role: "reasoning".into(),
                                text: str_of(b, "thinking").to_owned(),
                            }),
                            "tool_use" => out.push(Entry::ToolCall {
                                name: str_of(b, "name").to_owned(),
                                input: input_text(b.get("input").unwrap_or(&Value::Null)),
                            }),
                            "tool_result" => out.push(Entry::ToolResult {
                                text: content_text(b.get("content").unwrap_or(&Value::Null)),
                                error: b.get("is_error").and_then(Value::as_bool) == Some(true),
                            }),
                            _ => out.push(Entry::Note(b.to_string())),
                        }
                    }
                }
                _ => {}
            }
        }
        "result" => {
            let mut note = format!(
                "result: {} after {} turns",
                str_of(v, "subtype"),
                v.get("num_turns").and_then(Value::as_i64).unwrap_or(0)
            );
            if v.get("is_error").and_then(Value::as_bool) == Some(true) {
                note.push_str(&format!(" (error: {})", str_of(v, "result")));
            }
            for key in ["api_error", "api_error_status", "terminal_reason"] {
                if let Some(x) = v.get(key).filter(|x| !x.is_null()) {
                    note.push_str(&format!(", {key} {x}"));
                }
            }
            out.push(Entry::Note(note));
        }
        // Stream housekeeping (partial messages, rate-limit notices): not conversation.
        "stream_event" | "rate_limit_event" => {}
        _ => out.push(Entry::Note(v.to_string())),
    }
}

/// Codex `exec --json` events (`item.completed` carries messages, commands, file changes).
fn codex_event(v: &Value, out: &mut Vec<Entry>) {
    match str_of(v, "type") {
        "thread.started" => out.push(Entry::Note(format!(
            "Codex thread {} started",
            str_of(v, "thread_id")
        ))),
        "item.completed" => {
            let item = v.get("item").unwrap_or(&Value::Null);
            match str_of(item, "type") {
                "agent_message" => out.push(Entry::Message {
                    role: "assistant".into(),
                    text: str_of(item, "text").to_owned(),
                }),
                "reasoning" => out.push(Entry::Message {
                    role: "reasoning".into(),
                    text: str_of(item, "text").to_owned(),
                }),
                "command_execution" => out.push(Entry::Command {
                    command: str_of(item, "command").to_owned(),
                    exit_code: item.get("exit_code").and_then(Value::as_i64),
                    output: str_of(item, "aggregated_output").to_owned(),
                }),
                "file_change" => {
                    let changes: Vec<String> = item
                        .get("changes")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .map(|c| format!("{} {}", str_of(c, "kind"), str_of(c, "path")))
                        .collect();
                    out.push(Entry::ToolCall {
                        name: "file_change".into(),
                        input: changes.join("\n"),
                    });
                }
                "error" => out.push(Entry::Note(format!("warning: {}", str_of(item, "message")))),
                _ => out.push(Entry::Note(item.to_string())),
            }
        }
        "turn.failed" | "error" => {
            let msg = v
                .get("error")
                .and_then(|e| e.get("message").and_then(Value::as_str).or(e.as_str()))
                .or_else(|| v.get("message").and_then(Value::as_str))
                .unwrap_or("unknown error");
            out.push(Entry::Note(format!("error: {msg}")));
        }
        "turn.completed" => {
            let u = v.get("usage").unwrap_or(&Value::Null);
            out.push(Entry::Note(format!(
                "turn completed: {} tokens in, {} out",
                u.get("input_tokens").and_then(Value::as_i64).unwrap_or(0),
                u.get("output_tokens").and_then(Value::as_i64).unwrap_or(0)
            )));
        }
        // A command's start is shown with its end; turns start implicitly.
        "item.started" | "item.updated" | "turn.started" => {}
        _ => out.push(Entry::Note(v.to_string())),
    }
}

/// The `openai` backend's lines: each message sent (`role`, `content`), then the answer (a chat
/// completion, or an error body).
fn openai_line(v: &Value, out: &mut Vec<Entry>) {
    if let Some(role) = v.get("role").and_then(Value::as_str) {
        out.push(Entry::Message {
            role: role.to_owned(),
            text: content_text(v.get("content").unwrap_or(&Value::Null)),
        });
    } else if let Some(m) = v
        .get("choices")
        .and_then(|c| c.get(0))
        .and_then(|c| c.get("message"))
    {
        out.push(Entry::Message {
            role: "assistant".into(),
            text: content_text(m.get("content").unwrap_or(&Value::Null)),
        });
    } else {
        out.push(Entry::Note(v.to_string()));
    }
}

/// Aider's `.aider.chat.history.md`: `#### ` lines are the user's (orch's prompt), `> ` lines
/// Aider's own output (applied edits, errors), the rest the model's replies.
fn aider(text: &str) -> Vec<Entry> {
    #[derive(PartialEq)]
    enum K {
        User,
        Tool,
        Model,
    }
    let mut out = Vec::new();
    let mut cur: Option<(K, String)> = None;
    let flush = |cur: &mut Option<(K, String)>, out: &mut Vec<Entry>| {
        if let Some((k, t)) = cur.take() {
            let t = t.trim().to_owned();
            if t.is_empty() {
                return;
            }
            out.push(match k {
                K::User => Entry::Message {
                    role: "user".into(),
                    text: t,
                },
                K::Tool => Entry::ToolResult {
                    text: t,
                    error: false,
                },
                K::Model => Entry::Message {
                    role: "assistant".into(),
                    text: t,
                },
            });
        }
    };
    for line in text.lines() {
        let (kind, body) = if let Some(rest) = line.strip_prefix("# aider chat started at") {
            flush(&mut cur, &mut out);
            out.push(Entry::Note(format!("Aider chat started at{rest}")));
            continue;
        } else if let Some(rest) = line.strip_prefix("####") {
            (K::User, rest.strip_prefix(' ').unwrap_or(rest))
        } else if let Some(rest) = line.strip_prefix('>') {
            (K::Tool, rest.strip_prefix(' ').unwrap_or(rest))
        } else {
            (K::Model, line)
        };
        match &mut cur {
            Some((k, t)) if *k == kind => {
                t.push('\n');
                t.push_str(body);
            }
            _ => {
                flush(&mut cur, &mut out);
                cur = Some((kind, body.to_owned()));
            }
        }
    }
    flush(&mut cur, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claude_stream_json_reads_as_a_conversation() {
        let text = r#"{"type":"system","subtype":"init","model":"m","tools":["Bash"],"claude_code_version":"2.1.197"}
{"type":"assistant","message":{"content":[{"type":"text","text":"I will run it."},{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"echo hi"}}]}}
{"type":"user","message":{"content":[{"type":"tool_result","tool_use_id":"t1","content":"hi","is_error":false}]}}
[orch: transcript cut]
{"type":"result","subtype":"success","num_turns":2,"is_error":false}"#;
        let e = entries("claude-stream-json", text);
        assert_eq!(
            e[1..4],
            [
                Entry::Message {
                    role: "assistant".into(),
                    text: "I will run it.".into()
                },
                Entry::ToolCall {
                    name: "Bash".into(),
                    input: "echo hi".into()
                },
                Entry::ToolResult {
                    text: "hi".into(),
                    error: false
                },
            ]
        );
        assert_eq!(e[4], Entry::Note("[orch: transcript cut]".into()));
        assert_eq!(e.len(), 6);
    }

    #[test]
    fn codex_commands_keep_their_exit_codes() {
        let text = r#"{"type":"item.started","item":{"type":"command_execution","command":"ls"}}
{"type":"item.completed","item":{"type":"command_execution","command":"ls","aggregated_output":"a\n","exit_code":2}}
{"type":"item.completed","item":{"type":"agent_message","text":"done"}}"#;
        assert_eq!(
            entries("codex-json", text),
            [
                Entry::Command {
                    command: "ls".into(),
                    exit_code: Some(2),
                    output: "a\n".into()
                },
                Entry::Message {
                    role: "assistant".into(),
                    text: "done".into()
                }
            ]
        );
    }

    #[test]
    fn openai_lines_are_the_messages_then_the_answer() {
        let text = r#"{"role":"system","content":"You are the analyst."}
{"role":"user","content":"Write 02-requirements.md"}
{"choices":[{"message":{"role":"assistant","content":"---\nstatus: final"}}]}"#;
        let e = entries("openai-chat-json", text);
        assert_eq!(e.len(), 3);
        assert_eq!(
            e[2],
            Entry::Message {
                role: "assistant".into(),
                text: "---\nstatus: final".into()
            }
        );
        assert_eq!(format_of("openai"), "openai-chat-json");
    }

    #[test]
    fn aider_history_splits_prompt_replies_and_output() {
        let text = "\n# aider chat started at 2026-12-06 02:00:00\n\n#### Write the file\n#### now\n\nHere it is:\n\napp.py\n```\nx\n```\n\n> Applied edit to app.py\n";
        let e = entries("aider-chat-md", text);
        assert_eq!(e.len(), 4, "{e:?}");
        assert_eq!(
            e[1],
            Entry::Message {
                role: "user".into(),
                text: "Write the file\nnow".into()
            }
        );
        assert!(
            matches!(&e[2], Entry::Message { role, text } if role == "assistant" && text.contains("app.py"))
        );
        assert_eq!(
            e[3],
            Entry::ToolResult {
                text: "Applied edit to app.py".into(),
                error: false
            }
        );
    }
}
