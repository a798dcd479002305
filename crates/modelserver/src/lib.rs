//! A scripted LLM on 127.0.0.1: the one thing orch's agents talk to that is outside this
//! machine, faked at the wire so the real agent CLIs can be run against it. It speaks
//!
//! - the Anthropic Messages API (`POST /v1/messages`, SSE when `stream: true`) as Claude Code
//!   calls it: tool calls are `tool_use` blocks (`Write`, `Bash`) that Claude Code executes;
//! - the OpenAI Responses API (`POST /v1/responses`, SSE) as Codex calls it: tool calls are
//!   `function_call` items of Codex's `exec_command` tool;
//! - OpenAI chat completions (`POST /v1/chat/completions`, SSE or not) as Aider calls it: a
//!   file is written by Aider's "whole file" edit format (the path, then a fenced block).
//!
//! What the model answers is decided per conversation turn by a [`Brain`]: a fixed
//! [`Script`] in the tests, or the demo's scripted agent. The turn number is derived from the
//! request itself (how many assistant turns it already holds), so a CLI that retries a request
//! or a new run of the CLI sees the same turn again; `hits` counts how often a turn was asked,
//! which is how a script fails a turn a number of times and then answers it. Requests that
//! offer no tools (a CLI's side requests, e.g. a title) are answered with a short text and are
//! not turns. Every request is recorded for the tests to inspect.
//!
//! Wire shapes of this crate are the providers', not orch's: it is test and demo support, not
//! part of orch's API.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{OriginalUri, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use serde_json::{Value, json};

/// Which provider API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// Anthropic Messages (Claude Code).
    Anthropic,
    /// OpenAI Responses (Codex).
    Responses,
    /// OpenAI chat completions (Aider).
    Chat,
}

/// One thing the model asks the CLI to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write `content` to `path` (absolute, or relative to the CLI's working directory).
    Write { path: String, content: String },
    /// Run a shell command in the CLI's working directory.
    Bash(String),
    /// Read a file (Claude Code's `Write` refuses to replace a file it has not read).
    Read(String),
}

/// The model's answer to one turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A final text answer (the turn ends the conversation).
    Text(String),
    /// Tool calls (Claude Code, Codex) or file edits (Aider), with a sentence before them.
    Tools(Vec<Action>),
    /// An HTTP error with this status and message (429 carries `retry-after: 0`).
    Status(u16, String),
    /// Never answer: the request is held open until the client gives up or is killed.
    Hang,
}

/// A turn of a conversation as the model sees it.
#[derive(Debug, Clone)]
pub struct Turn {
    /// The API the request came through.
    pub api: Api,
    /// 0 for the first request of a conversation, +1 per assistant turn it already holds.
    pub index: usize,
    /// How many requests asked for this turn before this one (0 the first time).
    pub hits: u32,
    /// All the text of the request's user messages (the prompt), joined by newlines.
    pub prompt: String,
    /// The text of the last tool results (or of the last user message).
    pub last_result: String,
    /// The model name the request asked for.
    pub model: String,
}

/// Decides the model's answer to a turn.
pub trait Brain: Send + Sync + 'static {
    /// The answer to `turn`.
    fn reply(&self, turn: &Turn) -> Reply;
}

impl<F: Fn(&Turn) -> Reply + Send + Sync + 'static> Brain for F {
    fn reply(&self, turn: &Turn) -> Reply {
        self(turn)
    }
}

/// One step of a [`Script`]: the answer to one turn, optionally failing its first `times`
/// requests with an HTTP status first.
#[derive(Debug, Clone)]
pub struct Step {
    /// `(status, times)`: answer the first `times` requests of this turn with `status`.
    pub fail_first: Option<(u16, u32)>,
    /// The answer after that.
    pub reply: Reply,
}

impl Step {
    /// A step that answers `reply` at once.
    pub fn ok(reply: Reply) -> Step {
        Step {
            fail_first: None,
            reply,
        }
    }
}

/// A fixed conversation: step `i` answers turn `i`; turns past the end answer `Done.`.
#[derive(Debug, Clone, Default)]
pub struct Script(pub Vec<Step>);

impl Brain for Script {
    fn reply(&self, turn: &Turn) -> Reply {
        let Some(step) = self.0.get(turn.index) else {
            return Reply::Text("Done.".into());
        };
        match step.fail_first {
            Some((status, times)) if turn.hits < times => Reply::Status(
                status,
                format!("scripted failure {} of {times}", turn.hits + 1),
            ),
            _ => step.reply.clone(),
        }
    }
}

/// A request as the server received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Path and query.
    pub path: String,
    /// The JSON body (`Null` when it was not JSON).
    pub body: Value,
    /// The turn it was, `None` for side requests.
    pub turn: Option<usize>,
}

impl Recorded {
    /// The names of the tools the request offered.
    pub fn tool_names(&self) -> Vec<String> {
        self.body
            .get("tools")
            .and_then(Value::as_array)
            .map(|tools| {
                tools
                    .iter()
                    .filter_map(|t| {
                        t.get("name")
                            .or_else(|| t.get("function").and_then(|f| f.get("name")))
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Tokens every answered turn reports: input, output.
pub const TURN_USAGE: (u64, u64) = (1000, 100);

struct Shared {
    brain: Box<dyn Brain>,
    hits: Mutex<HashMap<(Api, usize), u32>>,
    recorded: Mutex<Vec<Recorded>>,
}

/// A running model server; it stops when dropped.
pub struct ModelServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ModelServer {
    /// Serves `brain` on a free port of 127.0.0.1 (inside the current tokio runtime).
    pub async fn start(brain: impl Brain) -> std::io::Result<ModelServer> {
        let shared = Arc::new(Shared {
            brain: Box::new(brain),
            hits: Mutex::new(HashMap::new()),
            recorded: Mutex::new(Vec::new()),
        });
        let app = axum::Router::new()
            .route("/v1/messages", post(anthropic))
            .route("/v1/responses", post(responses))
            .route("/v1/chat/completions", post(chat))
            .route("/chat/completions", post(chat))
            .fallback(any(not_found))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("model server stopped: {e}");
            }
        });
        Ok(ModelServer { addr, shared, task })
    }

    /// `http://127.0.0.1:<port>` (Claude Code's `ANTHROPIC_BASE_URL`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `http://127.0.0.1:<port>/v1` (the OpenAI base URL of Codex and Aider).
    pub fn openai_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.shared.recorded).clone()
    }

    /// The requests that were conversation turns.
    pub fn turns(&self) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.turn.is_some())
            .collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn not_found(OriginalUri(uri): OriginalUri) -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(
            json!({"error": {"type": "not_found_error", "message": format!("no route {uri}")}}),
        ),
    )
        .into_response()
}

/// The text of a content value: a string, or the `text` (and tool result `content`) of its
/// blocks.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| {
                let t = b.get("text").and_then(Value::as_str).unwrap_or_default();
                let inner = b.get("content").map(text_of).unwrap_or_default();
                let out = b.get("output").map(text_of).unwrap_or_default();
                [t.to_owned(), inner, out].concat()
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Records the request and asks the brain; `None` for a side request (no tools offered).
fn decide(
    shared: &Shared,
    api: Api,
    path: String,
    body: &Value,
    turn: Option<(usize, String, String)>,
) -> Option<Reply> {
    let Some((index, prompt, last_result)) = turn else {
        lock(&shared.recorded).push(Recorded {
            path,
            body: body.clone(),
            turn: None,
        });
        return None;
    };
    let hits = {
        let mut hits = lock(&shared.hits);
        let h = hits.entry((api, index)).or_insert(0);
        *h += 1;
        *h - 1
    };
    lock(&shared.recorded).push(Recorded {
        path,
        body: body.clone(),
        turn: Some(index),
    });
    let turn = Turn {
        api,
        index,
        hits,
        prompt,
        last_result,
        model: body
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
    };
    Some(shared.brain.reply(&turn))
}

fn sse(events: Vec<(Option<&str>, Value)>, done: bool) -> Response {
    let mut text = String::new();
    for (name, data) in events {
        if let Some(name) = name {
            text.push_str(&format!("event: {name}\n"));
        }
        text.push_str(&format!("data: {data}\n\n"));
    }
    if done {
        text.push_str("data: [DONE]\n\n");
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from(text))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// An error answer in the shape of `api`.
fn error(api: Api, status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match api {
        Api::Anthropic => {
            let kind = match status {
                429 => "rate_limit_error",
                529 => "overloaded_error",
                401 => "authentication_error",
                403 => "permission_error",
                400 => "invalid_request_error",
                _ => "api_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
        Api::Responses | Api::Chat => {
            let kind = match status {
                429 => "rate_limit_exceeded",
                401 => "invalid_api_key",
                _ => "server_error",
            };
            json!({"error": {"message": message, "type": kind, "code": kind}})
        }
    };
    let mut response = (code, axum::Json(body)).into_response();
    if status == 429 {
        response
            .headers_mut()
            .insert("retry-after", header::HeaderValue::from_static("0"));
    }
    response
}

async fn hang() -> Response {
    std::future::pending::<()>().await;
    StatusCode::GATEWAY_TIMEOUT.into_response()
}

/// The turn a tool call id of this server names (`toolu_t3_0`, `call_t3_0` → 3).
fn turn_of_id(id: &str) -> Option<usize> {
    let rest = id.split_once("_t")?.1;
    rest.split('_').next()?.parse().ok()
}

fn parse(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or(Value::Null)
}

fn has_tools(body: &Value) -> bool {
    body.get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
}

// --- Anthropic Messages ----------------------------------------------------------------------

async fn anthropic(
    State(shared): State<Arc<Shared>>,
    OriginalUri(uri): OriginalUri,
    _headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let body = parse(&body);
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let turn = has_tools(&body).then(|| {
        // Claude Code merges earlier turns into one assistant message, so turns are counted
        // by the ids this server gave its tool calls (`toolu_t<turn>_<i>`).
        let index = messages
            .iter()
            .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
            .flat_map(|m| {
                m.get("content")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|b| b.get("id").and_then(Value::as_str).and_then(turn_of_id))
            .map(|t| t + 1)
            .max()
            .unwrap_or(0);
        let users: Vec<String> = messages
            .iter()
            .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
            .map(|m| text_of(m.get("content").unwrap_or(&Value::Null)))
            .collect();
        let last = users.last().cloned().unwrap_or_default();
        (index, users.join("\n"), last)
    });
    let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("claude-scripted")
        .to_owned();
    let turn_index = turn.as_ref().map_or(0, |t| t.0);
    let reply = decide(&shared, Api::Anthropic, uri.to_string(), &body, turn)
        .unwrap_or_else(|| Reply::Text("OK".into()));
    let (blocks, stop) = match reply {
        Reply::Hang => return hang().await,
        Reply::Status(status, message) => return error(Api::Anthropic, status, &message),
        Reply::Text(t) => (vec![json!({"type": "text", "text": t})], "end_turn"),
        Reply::Tools(actions) => {
            let mut blocks = vec![json!({"type": "text", "text": "I will do that now."})];
            for (i, a) in actions.iter().enumerate() {
                let (name, input) = match a {
                    Action::Write { path, content } => {
                        ("Write", json!({"file_path": path, "content": content}))
                    }
                    Action::Bash(cmd) => (
                        "Bash",
                        json!({"command": cmd, "description": "Run a command"}),
                    ),
                    Action::Read(path) => ("Read", json!({"file_path": path})),
                };
                blocks.push(json!({"type": "tool_use", "id": format!("toolu_t{}_{i}", turn_index), "name": name, "input": input}));
            }
            (blocks, "tool_use")
        }
    };
    let (input_tokens, output_tokens) = TURN_USAGE;
    if !stream {
        return axum::Json(json!({
            "id": "msg_scripted", "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": stop, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        }))
        .into_response();
    }
    let mut events = vec![(
        Some("message_start"),
        json!({"type": "message_start", "message": {
            "id": "msg_scripted", "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1}}}),
    )];
    for (i, block) in blocks.iter().enumerate() {
        let (start, delta) = if block["type"] == "tool_use" {
            (
                json!({"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}),
                json!({"type": "input_json_delta", "partial_json": block["input"].to_string()}),
            )
        } else {
            (
                json!({"type": "text", "text": ""}),
                json!({"type": "text_delta", "text": block["text"]}),
            )
        };
        events.push((
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": i, "content_block": start}),
        ));
        events.push((
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": i, "delta": delta}),
        ));
        events.push((
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": i}),
        ));
    }
    events.push((
        Some("message_delta"),
        json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
               "usage": {"output_tokens": output_tokens}}),
    ));
    events.push((Some("message_stop"), json!({"type": "message_stop"})));
    sse(events, false)
}

// --- OpenAI Responses (Codex) ----------------------------------------------------------------

/// The shell command that writes `content` to `path` (a quoted heredoc: no expansion).
pub fn write_command(path: &str, content: &str) -> String {
    let mut marker = "ORCH_EOF".to_owned();
    while content.contains(&marker) {
        marker.push('_');
    }
    let quoted = format!("'{}'", path.replace('\'', "'\\''"));
    let nl = if content.ends_with('\n') || content.is_empty() {
        ""
    } else {
        "\n"
    };
    format!(
        "mkdir -p \"$(dirname {quoted})\" && cat > {quoted} <<'{marker}'\n{content}{nl}{marker}"
    )
}

async fn responses(
    State(shared): State<Arc<Shared>>,
    OriginalUri(uri): OriginalUri,
    body: axum::body::Bytes,
) -> Response {
    let body = parse(&body);
    let input = body
        .get("input")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let turn = has_tools(&body).then(|| {
        // An assistant turn is a run of assistant messages, reasoning, calls and their outputs.
        let is_model = |i: &Value| {
            matches!(
                i.get("type").and_then(Value::as_str),
                Some("function_call" | "function_call_output" | "reasoning")
            ) || i.get("role").and_then(Value::as_str) == Some("assistant")
        };
        let mut runs = 0;
        let mut in_run = false;
        for item in &input {
            let m = is_model(item);
            if m && !in_run {
                runs += 1;
            }
            in_run = m;
        }
        // The ids this server gave its calls (`call_t<turn>_<i>`) say best; runs of model
        // items otherwise.
        let index = input
            .iter()
            .filter(|i| i.get("type").and_then(Value::as_str) == Some("function_call"))
            .filter_map(|i| {
                i.get("call_id")
                    .and_then(Value::as_str)
                    .and_then(turn_of_id)
            })
            .map(|t| t + 1)
            .max()
            .unwrap_or(runs);
        let users: Vec<String> = input
            .iter()
            .filter(|i| i.get("role").and_then(Value::as_str) == Some("user"))
            .map(|i| text_of(i.get("content").unwrap_or(&Value::Null)))
            .collect();
        let last = input
            .iter()
            .rev()
            .find(|i| i.get("type").and_then(Value::as_str) == Some("function_call_output"))
            .map(|i| text_of(i.get("output").unwrap_or(&Value::Null)))
            .unwrap_or_default();
        (index, users.join("\n"), last)
    });
    let turn_index = turn.as_ref().map_or(0, |t| t.0);
    let reply = decide(&shared, Api::Responses, uri.to_string(), &body, turn)
        .unwrap_or_else(|| Reply::Text("OK".into()));
    let items: Vec<Value> = match reply {
        Reply::Hang => return hang().await,
        Reply::Status(status, message) => return error(Api::Responses, status, &message),
        Reply::Text(t) => vec![
            json!({"type": "message", "id": "msg_scripted", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": t, "annotations": []}]}),
        ],
        Reply::Tools(actions) => actions
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let cmd = match a {
                    Action::Write { path, content } => write_command(path, content),
                    Action::Bash(cmd) => cmd.clone(),
                    Action::Read(path) => format!("cat '{}'", path.replace('\'', "'\\''")),
                };
                json!({"type": "function_call", "id": format!("fc_t{turn_index}_{i}"), "call_id": format!("call_t{turn_index}_{i}"),
                       "name": "exec_command", "arguments": json!({"cmd": cmd}).to_string(), "status": "completed"})
            })
            .collect(),
    };
    let (input_tokens, output_tokens) = TURN_USAGE;
    let mut events = vec![(
        Some("response.created"),
        json!({"type": "response.created", "response": {"id": "resp_scripted", "status": "in_progress", "output": []}}),
    )];
    for (i, item) in items.iter().enumerate() {
        events.push((
            Some("response.output_item.done"),
            json!({"type": "response.output_item.done", "output_index": i, "item": item}),
        ));
    }
    events.push((
        Some("response.completed"),
        json!({"type": "response.completed", "response": {
            "id": "resp_scripted", "status": "completed", "output": items,
            "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": input_tokens + output_tokens}}}),
    ));
    sse(events, false)
}

// --- OpenAI chat completions (Aider) ---------------------------------------------------------

async fn chat(
    State(shared): State<Arc<Shared>>,
    OriginalUri(uri): OriginalUri,
    body: axum::body::Bytes,
) -> Response {
    let body = parse(&body);
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    // Aider offers no tools and sends example exchanges before the request: every request is
    // turn 0 (Aider asks once per message; `hits` counts its retries).
    let index = 0;
    let search_replace = messages.iter().any(|m| {
        m.get("role").and_then(Value::as_str) == Some("system")
            && text_of(m.get("content").unwrap_or(&Value::Null)).contains("SEARCH/REPLACE")
    });
    let users: Vec<String> = messages
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .map(|m| text_of(m.get("content").unwrap_or(&Value::Null)))
        .collect();
    let last = users.last().cloned().unwrap_or_default();
    let turn = Some((index, users.join("\n"), last));
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("scripted")
        .to_owned();
    let reply = decide(&shared, Api::Chat, uri.to_string(), &body, turn)
        .unwrap_or_else(|| Reply::Text("OK".into()));
    let text = match reply {
        Reply::Hang => return hang().await,
        Reply::Status(status, message) => return error(Api::Chat, status, &message),
        Reply::Text(t) => t,
        Reply::Tools(actions) => {
            let mut t = String::from("I will make these changes.\n\n");
            for a in actions {
                match a {
                    Action::Write { path, content } => {
                        let nl = if content.ends_with('\n') { "" } else { "\n" };
                        if search_replace {
                            // A new file: an empty SEARCH section.
                            t.push_str(&format!(
                                "{path}\n```\n<<<<<<< SEARCH\n=======\n{content}{nl}>>>>>>> REPLACE\n```\n\n"
                            ));
                        } else {
                            t.push_str(&format!("{path}\n```\n{content}{nl}```\n\n"));
                        }
                    }
                    Action::Bash(cmd) => t.push_str(&format!("```bash\n{cmd}\n```\n\n")),
                    Action::Read(_) => {}
                }
            }
            t
        }
    };
    let (input_tokens, output_tokens) = TURN_USAGE;
    let usage = json!({"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                       "total_tokens": input_tokens + output_tokens});
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        return axum::Json(json!({
            "id": "chatcmpl-scripted", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": usage,
        }))
        .into_response();
    }
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut events = vec![
        (
            None,
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        ),
        (None, chunk(json!({"content": text}), Value::Null)),
        (None, chunk(json!({}), json!("stop"))),
    ];
    events.push((
        None,
        json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": model,
               "choices": [], "usage": usage}),
    ));
    sse(events, true)
}

// --- a brain that does what orch's prompt asks -----------------------------------------------

/// What orch's prompt asks of an agent: who, which stage, which work item, which files.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ask {
    /// The agent (`You are `analyst``).
    pub agent: String,
    /// The stage.
    pub stage: String,
    /// The work item id.
    pub work_item: String,
    /// The absolute paths of the files to write.
    pub files: Vec<String>,
}

impl Ask {
    /// Reads orch's prompt (the `WriteFiles` delivery).
    pub fn of(prompt: &str) -> Ask {
        let between = |text: &str, start: &str| -> Option<String> {
            let i = text.find(start)? + start.len();
            let rest = &text[i..];
            Some(rest[..rest.find('`')?].to_owned())
        };
        let mut ask = Ask {
            agent: between(prompt, "You are `").unwrap_or_default(),
            stage: between(prompt, "doing stage `").unwrap_or_default(),
            ..Ask::default()
        };
        if let Some(i) = prompt.find("of work item ") {
            ask.work_item = prompt[i + "of work item ".len()..]
                .split(|c: char| c.is_whitespace() || c == '(')
                .next()
                .unwrap_or_default()
                .trim_end_matches(['.', ',', ':'])
                .to_owned();
        }
        let mut rest = prompt;
        while let Some(i) = rest.find("(absolute path: `") {
            rest = &rest[i + "(absolute path: `".len()..];
            if let Some(end) = rest.find('`') {
                let path = rest[..end].to_owned();
                if !ask.files.contains(&path) {
                    ask.files.push(path);
                }
                rest = &rest[end..];
            }
        }
        ask
    }

    /// A valid artifact for `path` (frontmatter orch's gates accept; reviews approve).
    pub fn artifact(&self, path: &str, model: &str) -> String {
        let name = path.rsplit('/').next().unwrap_or(path);
        let extra = if self.stage == "review" {
            "review_status: APPROVED\n"
        } else {
            ""
        };
        format!(
            "---\nwork_item: {}\nstage: {}\nauthor_agent: {}\nstatus: final\n\
             created_at: \"2026-12-01T12:00:00Z\"\nmodel_used: {model}\n{extra}---\n\n# {name}\n\n\
             Written by the scripted model for {} at stage {}.\n",
            self.work_item, self.stage, self.agent, self.work_item, self.stage
        )
    }

    /// The writes of every file asked for.
    pub fn writes(&self, model: &str) -> Vec<Action> {
        self.files
            .iter()
            .map(|f| Action::Write {
                path: f.clone(),
                content: self.artifact(f, model),
            })
            .collect()
    }
}

/// A model that, on the first turn, runs `before` (commands or writes, in their own turns)
/// and then writes every file orch's prompt asks for, then says `Done.`.
pub fn artifact_writer(before: Vec<Action>) -> impl Brain {
    move |turn: &Turn| {
        if turn.index < before.len() {
            return Reply::Tools(vec![before[turn.index].clone()]);
        }
        if turn.index == before.len() {
            let ask = Ask::of(&turn.prompt);
            if ask.files.is_empty() {
                return Reply::Text("I was not asked to write any file.".into());
            }
            return Reply::Tools(ask.writes(&turn.model));
        }
        Reply::Text("Done.".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_fail_a_turn_then_answer_it() {
        let script = Script(vec![Step {
            fail_first: Some((429, 2)),
            reply: Reply::Text("hi".into()),
        }]);
        let turn = |index, hits| Turn {
            api: Api::Anthropic,
            index,
            hits,
            prompt: String::new(),
            last_result: String::new(),
            model: String::new(),
        };
        assert!(matches!(script.reply(&turn(0, 0)), Reply::Status(429, _)));
        assert!(matches!(script.reply(&turn(0, 1)), Reply::Status(429, _)));
        assert_eq!(script.reply(&turn(0, 2)), Reply::Text("hi".into()));
        assert_eq!(script.reply(&turn(1, 0)), Reply::Text("Done.".into()));
    }

    #[test]
    fn write_command_quotes_the_path_and_keeps_the_content() {
        let c = write_command("a b/it's.md", "x $HOME `y`\nORCH_EOF\n");
        assert!(c.contains("'a b/it'\\''s.md'"), "{c}");
        assert!(c.ends_with("\nx $HOME `y`\nORCH_EOF\nORCH_EOF_"), "{c}");
    }

    #[test]
    fn asks_are_read_from_orch_prompts() {
        let prompt = "You are `architect`, doing stage `architecture` of work item APP-7 (attempt 1). \
                      Before you finish, write these files; for each\n\n\
                      - `docs/work-items/APP-7/06-architecture.md` (absolute path: `/wt/docs/work-items/APP-7/06-architecture.md`)\n\
                      - `docs/work-items/APP-7/08-data-requirements.md` (absolute path: `/wt/docs/work-items/APP-7/08-data-requirements.md`)\n";
        let ask = Ask::of(prompt);
        assert_eq!(
            ask,
            Ask {
                agent: "architect".into(),
                stage: "architecture".into(),
                work_item: "APP-7".into(),
                files: vec![
                    "/wt/docs/work-items/APP-7/06-architecture.md".into(),
                    "/wt/docs/work-items/APP-7/08-data-requirements.md".into()
                ],
            }
        );
        assert!(
            ask.artifact(&ask.files[0], "m")
                .contains("work_item: APP-7\nstage: architecture\n")
        );
    }
}
