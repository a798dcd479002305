//! The `openai` backend (design.md §4): an OpenAI-compatible chat endpoint (vLLM, llama.cpp,
//! Ollama, hosted APIs) for document stages. orch sends the role template as the system
//! message and the prompt as the user message, and writes the reply — the artifact itself —
//! to the stage's artifact file(s).
//!
//! HTTP 429 and 5xx answers and failures to connect are transient (retried by the executor);
//! 400, 401, 403 and 404 and a missing key variable are permanent (the stage fails at once);
//! any other failure fails the attempt. The API key is read from the variable `api_key_env` names when
//! the request is made, and appears in no log, row or error.

use std::time::Duration;

use orch_domain::gate::ArtifactSpec;
use orch_domain::ids::ArtifactName;
use serde_json::{Value, json};

use super::prompt::{FILE_MARKER_PREFIX, FILE_MARKER_SUFFIX};
use super::{AgentError, Invocation, MAX_ERROR_BYTES, TryEnd, TryResult, bound_text, files};

/// The largest response body read.
const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;
/// The most of an error response shown in a message.
const MAX_BODY_SHOWN: usize = 500;

/// Runs one try against the chat endpoint.
pub(crate) async fn run(inv: &Invocation<'_>, client: &reqwest::Client) -> TryResult {
    let Some(endpoint) = inv.config.endpoint.as_deref() else {
        return TryResult::failed(inv.error("the `openai` backend needs an `endpoint`"));
    };
    let Some(model) = inv.config.model.as_deref() else {
        return TryResult::failed(inv.error("the `openai` backend needs a `model`"));
    };
    let key = match &inv.config.api_key_env {
        None => None,
        Some(var) => match std::env::var(var) {
            Ok(k) if !k.trim().is_empty() => Some(k),
            _ => {
                // Bad configuration: retrying will not set it.
                return TryResult::permanent(inv.error(format!(
                    "the environment variable `{var}` (api_key_env) is not set or is empty"
                )));
            }
        },
    };
    let url = format!("{}/chat/completions", endpoint.trim_end_matches('/'));
    let body = json!({
        "model": model,
        "messages": [
            {"role": "system", "content": inv.system},
            {"role": "user", "content": inv.prompt},
        ],
    });
    // The transcript: the messages sent, one JSON line each, then the answer.
    if let Some(t) = inv.transcript {
        for m in body["messages"].as_array().into_iter().flatten() {
            t.push(format!("{m}\n").as_bytes());
        }
    }
    let mut request = client.post(&url).json(&body).timeout(inv.timeout);
    if let Some(key) = &key {
        request = request.bearer_auth(key);
    }
    let started = std::time::Instant::now();
    let exchange = async {
        let response = request.send().await?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = read_bounded(response).await?;
        Ok::<_, reqwest::Error>((status, retry_after, body))
    };
    let outcome = tokio::select! {
        r = exchange => r,
        () = inv.run.cancel.cancelled() => {
            return TryResult {
                started: true,
                ..TryResult::failed(AgentError::Cancelled { agent: inv.agent.clone() })
            };
        }
    };
    let mut result = match outcome {
        // Refused before a byte was sent: nothing was spent.
        Err(e) if e.is_connect() => network_failure(inv, &url, &e),
        Err(e) => TryResult {
            started: true,
            ..network_failure(inv, &url, &e)
        },
        Ok((status, retry_after, body)) => {
            if let Some(t) = inv.transcript {
                let line = match serde_json::from_slice::<Value>(&body) {
                    Ok(v) => v.to_string(),
                    Err(_) => json!({"http_status": status.as_u16(), "body": String::from_utf8_lossy(&body)})
                        .to_string(),
                };
                t.push(format!("{line}\n").as_bytes());
            }
            let mut r = answer(inv, &url, status, &body);
            r.started = true;
            r.data.insert("http_status".into(), status.as_u16().into());
            r.retry_after = retry_after;
            r
        }
    };
    result.data.insert(
        "duration_ms".into(),
        u64::try_from(started.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .into(),
    );
    result
}

/// A request that got no complete answer.
fn network_failure(inv: &Invocation<'_>, url: &str, e: &reqwest::Error) -> TryResult {
    if e.is_timeout() {
        return TryResult::failed(AgentError::TimedOut {
            agent: inv.agent.clone(),
            secs: inv.timeout.as_secs(),
        });
    }
    let message = format!("request to {url} failed: {}", error_chain(e));
    if e.is_builder() {
        TryResult::failed(inv.error(message))
    } else {
        // Connection refused or reset, DNS, a body cut short: the network, worth a retry.
        TryResult::new(TryEnd::Transient(bound_text(&message, MAX_ERROR_BYTES)))
    }
}

/// The error and its causes on one line (reqwest's top-level message hides the cause).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

/// The body, at most [`MAX_RESPONSE_BYTES`] of it.
async fn read_bounded(mut response: reqwest::Response) -> Result<Vec<u8>, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = MAX_RESPONSE_BYTES.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if room <= chunk.len() {
            break;
        }
    }
    Ok(body)
}

/// Interprets an HTTP answer and, on success, writes the artifact(s).
fn answer(inv: &Invocation<'_>, url: &str, status: reqwest::StatusCode, body: &[u8]) -> TryResult {
    let text = String::from_utf8_lossy(body);
    if status.as_u16() == 429 || status.is_server_error() {
        return TryResult::new(TryEnd::Transient(format!(
            "HTTP {status} from {url}: {}",
            excerpt(&text)
        )));
    }
    if !status.is_success() {
        let e = inv.error(format!("HTTP {status} from {url}: {}", excerpt(&text)));
        // Authentication, a bad request, an unknown model: retrying will not help.
        return match status.as_u16() {
            400 | 401 | 403 | 404 => TryResult::permanent(e),
            _ => TryResult::failed(e),
        };
    }
    let mut result = TryResult::new(TryEnd::Ok);
    let reply: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return TryResult::failed(inv.error(format!(
                "the answer from {url} is not JSON ({e}): {}",
                excerpt(&text)
            )));
        }
    };
    if let Some(usage) = reply.get("usage") {
        result.usage.input = usage.get("prompt_tokens").and_then(Value::as_i64);
        result.usage.output = usage.get("completion_tokens").and_then(Value::as_i64);
        // Some gateways (OpenRouter, LiteLLM) report the cost too.
        result.usage.cost_usd = usage.get("cost").and_then(Value::as_f64);
    }
    let choice = reply.get("choices").and_then(|c| c.get(0));
    let finish = choice
        .and_then(|c| c.get("finish_reason"))
        .and_then(Value::as_str);
    if let Some(f) = finish {
        result.data.insert("finish_reason".into(), f.into());
    }
    let content = choice
        .and_then(|c| c.get("message"))
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str);
    let Some(content) = content.filter(|c| !c.trim().is_empty()) else {
        result.end = TryEnd::Failed(inv.error(format!(
            "the answer from {url} has no choices[0].message.content"
        )));
        return result;
    };
    if finish == Some("length") {
        result.end = TryEnd::Failed(inv.error(
            "the reply was cut off at the model's length limit (finish_reason: length); \
             the artifact would be incomplete",
        ));
        return result;
    }
    let files = match split_files(
        &strip_fence(content),
        &inv.run.stage.artifacts,
        inv.primary_name(),
    ) {
        Ok(f) => f,
        Err(e) => {
            result.end = TryEnd::Failed(inv.error(e));
            return result;
        }
    };
    let mut written = Vec::new();
    for (name, text) in files {
        let path = inv.artifact_dir.join(name.as_str());
        if let Err(source) = files::write_atomic(&path, &text) {
            result.end = TryEnd::Failed(AgentError::Io {
                agent: inv.agent.clone(),
                path,
                source,
            });
            return result;
        }
        written.push(Value::from(name.as_str()));
    }
    result.data.insert("written".into(), Value::Array(written));
    result
}

impl Invocation<'_> {
    /// The file name of the stage's primary artifact.
    fn primary_name(&self) -> Option<ArtifactName> {
        self.primary
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse().ok())
    }
}

fn excerpt(text: &str) -> String {
    let t = text.trim();
    if t.len() <= MAX_BODY_SHOWN {
        return t.to_owned();
    }
    let mut end = MAX_BODY_SHOWN;
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &t[..end])
}

/// The reply without a code fence wrapped around the whole of it (models like to add one).
pub(crate) fn strip_fence(content: &str) -> String {
    let t = content.trim();
    let ticks = t.chars().take_while(|c| *c == '`').count();
    if ticks >= 3
        && let Some((_info, rest)) = t[ticks..].split_once('\n')
        && let Some(inner) = rest.trim_end().strip_suffix(&"`".repeat(ticks))
        && (inner.is_empty() || inner.ends_with('\n'))
    {
        return with_newline(inner);
    }
    with_newline(t)
}

fn with_newline(s: &str) -> String {
    let mut s = s.trim_end().to_owned();
    s.push('\n');
    s
}

/// Splits a reply into files: at `<<<FILE name>>>` lines when there are any (each name must be
/// one of the stage's artifacts; text before the first marker is dropped), else the whole
/// reply is the primary artifact.
pub(crate) fn split_files(
    reply: &str,
    specs: &[ArtifactSpec],
    primary: Option<ArtifactName>,
) -> Result<Vec<(ArtifactName, String)>, String> {
    let marker = |line: &str| -> Option<String> {
        line.trim()
            .strip_prefix(FILE_MARKER_PREFIX)?
            .strip_suffix(FILE_MARKER_SUFFIX)
            .map(|n| n.trim().to_owned())
    };
    if !reply.lines().any(|l| marker(l).is_some()) {
        let Some(primary) = primary else {
            return Err("the stage has no artifact to write the reply to".to_owned());
        };
        return Ok(vec![(primary, reply.to_owned())]);
    }
    let mut files: Vec<(ArtifactName, String)> = Vec::new();
    for line in reply.split_inclusive('\n') {
        if let Some(name) = marker(line) {
            let parsed: ArtifactName = name
                .parse()
                .map_err(|e| format!("the reply names a file `{name}` orch will not write: {e}"))?;
            if !specs.iter().any(|s| s.name.matches(&parsed)) {
                return Err(format!(
                    "the reply names `{parsed}`, which is not an artifact of this stage"
                ));
            }
            if files.iter().any(|(n, _)| *n == parsed) {
                return Err(format!("the reply has `{parsed}` twice"));
            }
            files.push((parsed, String::new()));
        } else if let Some((_, text)) = files.last_mut() {
            text.push_str(line);
        }
    }
    Ok(files
        .into_iter()
        .map(|(n, t)| (n, strip_fence(&t)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use orch_domain::pipeline::Pipeline;

    #[test]
    fn fences_around_the_whole_reply_are_stripped() {
        let cases = [
            ("---\na: 1\n---\nbody\n", "---\na: 1\n---\nbody\n"),
            (
                "```markdown\n---\na: 1\n---\nbody\n```",
                "---\na: 1\n---\nbody\n",
            ),
            ("  ```\n---\nx\n```  \n", "---\nx\n"),
            (
                "````md\n```rust\nfn x() {}\n```\n````",
                "```rust\nfn x() {}\n```\n",
            ),
            // A fence that does not wrap everything stays.
            (
                "---\na: 1\n---\n```\ncode\n```",
                "---\na: 1\n---\n```\ncode\n```\n",
            ),
            ("```\nunterminated", "```\nunterminated\n"),
        ];
        for (input, expect) in cases {
            assert_eq!(strip_fence(input), expect, "{input:?}");
        }
    }

    /// Splits `reply` for the architecture stage and compares names and contents.
    fn check(reply: &str, expect: Result<&[(&str, &str)], &str>) {
        let p = Pipeline::default_pipeline();
        let stage = p.stage(&"architecture".parse().unwrap()).unwrap();
        let got = split_files(
            reply,
            &stage.artifacts,
            Some("06-architecture.md".parse().unwrap()),
        );
        match expect {
            Ok(files) => {
                let got = got.unwrap();
                let got: Vec<(&str, &str)> =
                    got.iter().map(|(n, t)| (n.as_str(), t.as_str())).collect();
                assert_eq!(got, files);
            }
            Err(fragment) => {
                let e = got.unwrap_err();
                assert!(e.contains(fragment), "{e}");
            }
        }
    }

    #[test]
    fn replies_split_into_the_stage_files() {
        check(
            "---\nx\n---\n",
            Ok(&[("06-architecture.md", "---\nx\n---\n")]),
        );
        check(
            "Here you go:\n<<<FILE 06-architecture.md>>>\n---\na\n---\n<<<FILE 08-data-requirements.md>>>\n```\n---\nb\n---\n```\n<<<FILE 07-adr-cache.md>>>\nc\n",
            Ok(&[
                ("06-architecture.md", "---\na\n---\n"),
                ("08-data-requirements.md", "---\nb\n---\n"),
                ("07-adr-cache.md", "c\n"),
            ]),
        );
        check(
            "<<<FILE ../../etc/passwd>>>\nx\n",
            Err("orch will not write"),
        );
        check(
            "<<<FILE 02-requirements.md>>>\nx\n",
            Err("not an artifact of this stage"),
        );
        check(
            "<<<FILE 06-architecture.md>>>\na\n<<<FILE 06-architecture.md>>>\nb\n",
            Err("twice"),
        );
    }
}
