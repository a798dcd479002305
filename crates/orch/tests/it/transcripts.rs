//! Transcripts with the REAL agent CLIs: `orch serve` runs the demo repo's analysis stage with
//! Claude Code, Codex and Aider against the scripted model server, with an API key planted in
//! its environment. The model asks for a command (Claude Code's Bash, Codex's exec; Aider runs
//! none and edits instead), says the key back, and writes the key into the artifact. The run's
//! stored transcript must hold the scripted tool call and then its result, never the key (nor
//! its diff, `orch logs --transcript` or the task page, checked in headless Chromium).
//!
//! A CLI that is not installed (`scripts/install-agent-clis`) makes its test print
//! `SKIPPED: <reason>` and return; with `ORCH_REQUIRE_AGENT_CLIS=1` it fails instead.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{ORCH, Serve, agent_cli, become_subreaper, demo_setup, open};
use orch_modelserver::{Action, Ask, Brain, ModelServer, Reply, Turn, artifact_writer};

const KEY_VAR: &str = "ORCH_TEST_PLANTED_KEY";
const CHROMIUM: &str = "/usr/bin/chromium";
/// The command the model asks for; its output (`transcript-probe-42`) is not in its text.
const PROBE: &str = "echo transcript-probe-$((6*7))";

fn configure(dir: &Path, preset: &str, program: &Path, endpoint: &str, model: &str) {
    let path = dir.join("orch.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let cut = text
        .find("[agents.analyst]")
        .expect("the demo declares agents");
    let mut text = text[..cut].to_owned();
    // Claude Code's analyst gets Bash too, so the scripted command runs.
    let tools = if preset == "claude" {
        "allowed_tools = [\"Read\", \"Write\", \"Edit\", \"Bash\"]\n"
    } else {
        ""
    };
    for agent in ["analyst", "architect", "developer", "reviewer"] {
        text.push_str(&format!(
            "[agents.{agent}]\nbackend = \"{preset}\"\ncommand = {:?}\nendpoint = \"{endpoint}\"\n\
             model = \"{model}\"\napi_key_env = \"{KEY_VAR}\"\ncli_retries = 0\ntimeout_s = 120\n{tools}\n",
            program.display().to_string()
        ));
    }
    std::fs::write(&path, text).unwrap();
}

/// The model: the probe command first (not for Aider), then the artifact (with the key in its
/// body), then a last word that says the key.
fn brain(preset: &'static str, secret: String) -> impl Brain {
    let before = match preset {
        "claude" => vec![Action::Bash(format!(
            "{PROBE}; echo \"key=$ANTHROPIC_API_KEY\""
        ))],
        "codex" => vec![Action::Bash(format!("{PROBE}; echo \"key=${KEY_VAR}\""))],
        _ => Vec::new(),
    };
    let n = before.len();
    let writer = artifact_writer(before);
    move |turn: &Turn| {
        if turn.index == n {
            let ask = Ask::of(&turn.prompt);
            if !ask.files.is_empty() {
                let writes = ask
                    .writes(&turn.model)
                    .into_iter()
                    .map(|a| match a {
                        Action::Write { path, content } => Action::Write {
                            path,
                            content: format!("{content}\nThe key this run saw: {secret}\n"),
                        },
                        other => other,
                    })
                    .collect();
                return Reply::Tools(writes);
            }
        }
        match writer.reply(turn) {
            Reply::Text(t) if turn.index > n => {
                Reply::Text(format!("{t} For the record, the key is {secret}."))
            }
            other => other,
        }
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Every file below `dir`.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The task page as headless Chromium renders it (after its scripts ran), or `None` without
/// Chromium.
fn chromium_dom(url: &str) -> Option<String> {
    if !Path::new(CHROMIUM).exists() {
        eprintln!("{CHROMIUM} is missing: skipping the browser part (apt-get install -y chromium)");
        return None;
    }
    let profile = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(url)
        .output()
        .expect("run chromium");
    common::reap_orphans();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The index of the first line at or after `from` containing `needle`.
fn line_at(lines: &[&str], from: usize, needle: &str) -> Option<usize> {
    lines
        .iter()
        .enumerate()
        .skip(from)
        .find(|(_, l)| l.contains(needle))
        .map(|(i, _)| i)
}

async fn transcript_of(preset: &'static str, model: &str) {
    let Some(program) = agent_cli(preset) else {
        return;
    };
    become_subreaper();
    let secret = format!(
        "sk-planted-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let server = ModelServer::start(brain(preset, secret.clone()))
        .await
        .unwrap();
    let endpoint = if preset == "claude" {
        server.url()
    } else {
        server.openai_url()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    configure(&dir, preset, &program, &endpoint, model);
    let config = dir.join("orch.toml");
    let submit = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(&config)
        .args([
            "submit",
            "--repo",
            "service",
            "--title",
            "Document the version",
            "--body",
            "Say which version runs.",
        ])
        .output()
        .unwrap();
    assert!(
        submit.status.success(),
        "{}",
        String::from_utf8_lossy(&submit.stderr)
    );
    let port = free_port();
    let mut cmd = Serve::command(&dir, &format!("127.0.0.1:{port}"));
    cmd.env(KEY_VAR, &secret);
    let serve = Serve::spawn(cmd);
    let store = open(&dir).await;
    let t0 = Instant::now();
    let task = loop {
        let t = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
        if !["intake", "analysis"].contains(&t.stage.as_str()) {
            break t;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "APP-1 stuck at {}",
            t.stage
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let runs = store.task_agent_runs(task.id).await.unwrap();
    let run = runs
        .iter()
        .find(|r| r.stage == "analysis")
        .expect("an analysis run");
    assert_eq!(run.outcome, "ok", "{run:?}");
    let data: serde_json::Value = serde_json::from_str(&run.data).unwrap();
    let meta = &data["transcript"];
    assert_eq!(
        meta["file"],
        format!(".transcripts/APP-1/{}.log", run.id),
        "{data}"
    );
    assert!(meta["redactions"].as_u64().is_some_and(|n| n > 0), "{data}");

    // The task page, as Chromium renders it while orch serves it.
    let dom = chromium_dom(&format!("http://127.0.0.1:{port}/ui/tasks/APP-1"));
    serve.terminate().await;
    if let Some(dom) = dom {
        let start = dom
            .find("id=\"live-transcripts\"")
            .expect("the task page has a transcripts section");
        let end = dom[start..]
            .find("id=\"live-artifacts\"")
            .map_or(dom.len(), |i| start + i);
        let section = &dom[start..end];
        assert!(
            section.contains(&format!("id=\"transcript-{}\"", run.id)),
            "{section}"
        );
        let expect = match preset {
            "claude" => "tool call: Bash",
            "codex" => "$ ",
            _ => "Applied edit to",
        };
        assert!(section.contains(expect), "{section}");
        if preset != "aider" {
            assert!(section.contains("transcript-probe-42"), "{section}");
        }
        assert!(section.contains("the run's diff"), "{section}");
        assert!(!section.contains(&secret), "the key is on the page");
        assert!(section.contains("[REDACTED]"), "{section}");
    }

    // The stored files: the transcript and the diff beside the run, neither with the key.
    let kept = files_under(&dir.join(".orch"))
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("/.transcripts/"))
        .collect::<Vec<_>>();
    assert!(
        kept.iter()
            .any(|p| p.ends_with(format!("APP-1/{}.log", run.id)))
            && kept
                .iter()
                .any(|p| p.ends_with(format!("APP-1/{}.diff", run.id))),
        "{kept:?}"
    );
    for p in &kept {
        let text = String::from_utf8_lossy(&std::fs::read(p).unwrap()).into_owned();
        assert!(!text.contains(&secret), "the key is in {}", p.display());
    }
    for r in &runs {
        let row = format!("{:?} {}", r.error, r.data);
        assert!(!row.contains(&secret), "the key is in run {}", r.id);
    }

    // `orch logs --transcript`: the scripted call, then its result, in that order.
    let logs = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(&config)
        .args(["logs", "APP-1", "--transcript"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&logs.stdout).into_owned();
    assert!(
        logs.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&logs.stderr)
    );
    assert!(!text.contains(&secret), "the key is printed: {text}");
    let lines: Vec<&str> = text.lines().collect();
    let head = line_at(&lines, 0, &format!("=== run {} ", run.id)).expect("the run's header");
    match preset {
        "claude" => {
            let call = line_at(&lines, head, "[tool call Bash]").expect("the Bash call");
            assert!(
                lines[call + 1].contains("echo transcript-probe-$((6*7))"),
                "{text}"
            );
            let result = line_at(&lines, call, "[tool result]").expect("its result");
            assert!(lines[result + 1].contains("transcript-probe-42"), "{text}");
            // Claude Code passes its key to the commands it runs: redacted, if it did.
            assert!(lines[result + 2].contains("key="), "{text}");
            println!("claude: the command printed {}", lines[result + 2].trim());
            let last = line_at(&lines, result, "the key is [REDACTED]").expect("the last word");
            assert!(last > result);
        }
        "codex" => {
            let cmd = line_at(&lines, head, "[command] $ ").expect("the command");
            assert!(
                lines[cmd].contains("transcript-probe-$((6*7))") && lines[cmd].contains("(exit 0)"),
                "{text}"
            );
            assert!(lines[cmd + 1].contains("transcript-probe-42"), "{text}");
            line_at(&lines, cmd, "the key is [REDACTED]").expect("the last word, after it");
        }
        _ => {
            let prompt = line_at(&lines, head, "[user]").expect("the prompt");
            let reply = line_at(&lines, prompt, "[assistant]").expect("the reply");
            let edit = line_at(&lines, reply, "Applied edit to").expect("the edit applied");
            assert!(lines[edit].contains("docs/work-items/APP-1/"), "{text}");
        }
    }
    let diff = line_at(&lines, head, "--- the run's diff").expect("the run's diff");
    line_at(&lines, diff, "The key this run saw: [REDACTED]").expect("the diff, redacted");
    println!("{preset}: transcript of run {} checked", run.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_transcript_holds_the_call_and_its_result_and_never_the_key() {
    transcript_of("claude", "claude-sonnet-4-5").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_transcript_holds_the_command_and_its_exit_code_and_never_the_key() {
    transcript_of("codex", "gpt-5-codex").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_transcript_holds_the_edit_and_never_the_key() {
    transcript_of("aider", "gpt-4.1").await;
}
