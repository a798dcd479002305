//! Agent sessions resume instead of restarting (issue 29): the real `orch serve` runs a work
//! item whose agent stage is the REAL Claude Code, Codex or Aider against the scripted model
//! server (`orch-modelserver`) on 127.0.0.1. The model holds a request open mid-run; the test
//! then loses the host's processes: kill -9 of orch's group AND of the supervised command's
//! session (supervisor, CLI and all it started), so the command leaves no result. The next
//! `orch serve` runs the try again; the model server must then see the *resumed* session's
//! conversation (what the first run said and did, plus orch's note), `agent.session_resumed`
//! must be recorded, and the item must go on. With the session's files removed while orch was
//! down, the run starts afresh instead (`agent.session_lost`, a fresh conversation).
//!
//! A CLI that is not installed makes its test print `SKIPPED: <reason>` and return; with
//! `ORCH_REQUIRE_AGENT_CLIS=1` it fails instead.

use crate::common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{
    ORCH, Serve, agent_cli, become_subreaper, demo_setup, open, python_available, reap_orphans,
};
use orch_modelserver::{Action, Api, Ask, ModelServer, Recorded, Reply, Turn};

/// Words of orch's note in a resumed run's prompt.
const NOTE_WORDS: &str = "your previous run of this task was interrupted";
/// What the first run's command prints (the model asks for it on its first turn).
const PROBE: &str = "resume-probe-5b1e";

/// The demo's config with its four LLM agents replaced by `preset` at `endpoint`.
fn configure(dir: &Path, preset: &str, program: &Path, endpoint: &str, model: &str) {
    let path = dir.join("orch.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let cut = text
        .find("[agents.analyst]")
        .expect("the demo declares agents");
    let mut text = text[..cut].to_owned();
    for agent in ["analyst", "architect", "developer", "reviewer"] {
        text.push_str(&format!(
            "[agents.{agent}]\nbackend = \"{preset}\"\ncommand = {:?}\nendpoint = \"{endpoint}\"\n\
             model = \"{model}\"\napi_key_env = \"CARGO_PKG_NAME\"\ncli_retries = 0\ntimeout_s = 180\n\n",
            program.display().to_string()
        ));
    }
    std::fs::write(&path, text).unwrap();
}

/// The model: until the host is lost, Claude Code and Codex are asked to run `echo PROBE`
/// and the next request (carrying its result) is held open; Aider's first request is held.
/// After, it writes what orch's prompt asks for: on the first turn of a fresh run, on the turn
/// after the earlier ones of a resumed one.
fn model(lost: Arc<AtomicBool>) -> impl orch_modelserver::Brain {
    move |turn: &Turn| {
        if !lost.load(Ordering::SeqCst) {
            if turn.api == Api::Chat || turn.index > 0 {
                return Reply::Hang;
            }
            return Reply::Tools(vec![Action::Bash(format!("echo {PROBE}"))]);
        }
        let resumed = turn.prompt.contains(NOTE_WORDS);
        let writes_at = usize::from(resumed && turn.api != Api::Chat);
        let ask = Ask::of(&turn.prompt);
        if turn.index == writes_at && !ask.files.is_empty() {
            Reply::Tools(ask.writes(&turn.model))
        } else {
            Reply::Text("Done.".into())
        }
    }
}

/// `(ppid, session)` of a live, non-zombie process.
fn stat(pid: i32) -> Option<(i32, i32)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    if matches!(f.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    Some((f.get(1)?.parse().ok()?, f.get(3)?.parse().ok()?))
}

/// The supervisor `sup` and every process of its session or below it.
fn session_of(sup: i32) -> HashSet<i32> {
    let all: Vec<(i32, i32, i32)> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| stat(pid).map(|(ppid, sid)| (pid, ppid, sid)))
        .collect();
    let mut set: HashSet<i32> = all
        .iter()
        .filter(|(pid, _, sid)| *sid == sup || *pid == sup)
        .map(|(pid, _, _)| *pid)
        .collect();
    loop {
        let more: Vec<i32> = all
            .iter()
            .filter(|(pid, ppid, _)| set.contains(ppid) && !set.contains(pid))
            .map(|(pid, _, _)| *pid)
            .collect();
        if more.is_empty() {
            return set;
        }
        set.extend(more);
    }
}

/// The supervised records' directory of the demo in `dir`.
fn records(dir: &Path) -> PathBuf {
    dir.join(".orch/repos/.orch-children/supervised")
}

/// The record of the agent command in flight (no result yet) and its supervisor's pid.
fn agent_in_flight(dir: &Path) -> Option<(PathBuf, i32)> {
    std::fs::read_dir(records(dir))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.contains(".agent-") && !name.contains('~') && !p.join("result.json").exists()
        })
        .find_map(|p| {
            let text = std::fs::read_to_string(p.join("supervisor")).ok()?;
            let pid = text.split_whitespace().next()?.parse().ok()?;
            Some((p, pid))
        })
}

/// The state directory beside record `rec` (`j<job>.~state-agent-<n>`).
fn state_of(rec: &Path) -> PathBuf {
    let name = rec.file_name().unwrap().to_string_lossy().into_owned();
    let (job, rest) = name.split_once('.').unwrap();
    rec.with_file_name(format!("{job}.~state-{rest}"))
}

/// Removes a CLI's session files from state directory `state`.
fn remove_session_files(preset: &str, state: &Path) {
    let path = match preset {
        "claude" => state.join("home/.claude/projects"),
        "codex" => state.join("home/.codex/sessions"),
        _ => state.join("files/chat.history.md"),
    };
    assert!(path.exists(), "{} is there before removal", path.display());
    if path.is_dir() {
        std::fs::remove_dir_all(&path).unwrap();
    } else {
        std::fs::remove_file(&path).unwrap();
    }
}

async fn until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        reap_orphans();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The text of every request after the first `from`, as sent.
fn bodies(requests: &[Recorded], from: usize) -> Vec<String> {
    requests[from.min(requests.len())..]
        .iter()
        .filter(|r| r.turn.is_some())
        .map(|r| r.body.to_string())
        .collect()
}

/// Runs APP-1 with `preset` until its first agent run is held, loses the host's processes,
/// (with `remove_files`, removes the session's files) and runs orch again; checks what the
/// model server sees and what is recorded.
async fn resume(preset: &str, model_name: &str, remove_files: bool) {
    resume_with(preset, model_name, remove_files, false).await;
}

/// [`resume`]; with `remove_note`, orch's note of the session id is removed too while orch is
/// down (a run lost before orch read the id from the stream).
async fn resume_with(preset: &str, model_name: &str, remove_files: bool, remove_note: bool) {
    let Some(program) = agent_cli(preset) else {
        return;
    };
    if !python_available() {
        return common::skip("python3 is not installed (the demo's setup needs it)");
    }
    become_subreaper();
    let lost = Arc::new(AtomicBool::new(false));
    let server = ModelServer::start(model(lost.clone())).await.unwrap();
    let endpoint = if preset == "claude" {
        server.url()
    } else {
        server.openai_url()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    configure(&dir, preset, &program, &endpoint, model_name);
    let submit = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
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

    // 1. The first agent run, held mid-way by the model.
    let serve = Serve::spawn(Serve::command(&dir, "127.0.0.1:0"));
    let held = |r: &Recorded| match preset {
        "aider" => r.turn == Some(0),
        _ => r.turn == Some(1),
    };
    until(
        "the model to hold the run",
        Duration::from_secs(180),
        || server.requests().iter().any(held),
    )
    .await;
    let (rec, sup) = agent_in_flight(&dir).expect("the agent's command is recorded, in flight");
    let state = state_of(&rec);
    assert!(state.join("home").is_dir(), "{}", state.display());
    // orch's note of the session, read while the run is held (the state goes with the job).
    let note = if preset == "aider" {
        String::new()
    } else {
        let note = std::fs::read_to_string(state.join("session")).unwrap();
        assert!(note.starts_with(&format!("{preset} ")), "{note}");
        note
    };
    let store = open(&dir).await;
    let task = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
    let held_stage = task.stage.clone();

    // 2. The host's processes are lost: orch, the supervisor and its command, all at once.
    let victims = session_of(sup);
    assert!(
        victims.len() >= 2,
        "the supervisor and its command: {victims:?}"
    );
    serve.kill_group().await;
    for pid in &victims {
        // SAFETY: signalling processes this test's orch started.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    until("the lost processes to go", Duration::from_secs(20), || {
        victims.iter().all(|p| stat(*p).is_none())
    })
    .await;
    reap_orphans();
    assert!(
        rec.is_dir() && !rec.join("result.json").exists(),
        "the lost command left no result"
    );
    if remove_files {
        remove_session_files(preset, &state);
    }
    if remove_note {
        std::fs::remove_file(state.join("session")).unwrap();
    }
    let before = server.requests().len();
    lost.store(true, Ordering::SeqCst);

    // 3. orch again: the same try continues its session (or starts afresh).
    let serve = Serve::spawn(Serve::command(&dir, "127.0.0.1:0"));
    let t0 = Instant::now();
    let reached = loop {
        let t = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
        if t.stage != held_stage {
            break t;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "APP-1 stuck at {}; events {:?}",
            t.stage,
            store
                .task_events(t.id)
                .await
                .unwrap()
                .iter()
                .map(|e| (e.kind.clone(), e.message.clone()))
                .collect::<Vec<_>>()
        );
        reap_orphans();
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    serve.terminate().await;
    // The job's state directory went with its records once its outcome was recorded.
    assert!(!state.exists(), "{} is removed", state.display());
    let events = store.task_events(reached.id).await.unwrap();
    let runs = store.task_agent_runs(reached.id).await.unwrap();
    let story = || {
        format!(
            "{:?}\n{:?}",
            events
                .iter()
                .map(|e| (&e.kind, &e.message, &e.data))
                .collect::<Vec<_>>(),
            runs.iter()
                .map(|r| (&r.stage, &r.outcome, &r.error, &r.data))
                .collect::<Vec<_>>()
        )
    };
    let kind = if remove_files {
        "agent.session_lost"
    } else {
        "agent.session_resumed"
    };
    let event = events
        .iter()
        .find(|e| e.kind == kind)
        .unwrap_or_else(|| panic!("no {kind}: {}", story()));
    let data: serde_json::Value = serde_json::from_str(&event.data).unwrap();
    assert_eq!(data["cli"], preset, "{data}");
    let other = if remove_files {
        "agent.session_resumed"
    } else {
        "agent.session_lost"
    };
    assert!(!events.iter().any(|e| e.kind == other), "{}", story());
    assert!(
        events.iter().any(|e| e.kind == "command.rerun"),
        "{}",
        story()
    );

    // What the model saw after the restart: the first request of the try.
    let after = bodies(&server.requests(), before);
    let first = after
        .first()
        .unwrap_or_else(|| panic!("no request after the restart: {}", story()));
    if remove_files {
        // A fresh conversation: nothing of the first run, no note.
        assert!(!first.contains(PROBE), "{first}");
        assert!(!first.contains(NOTE_WORDS), "{first}");
    } else {
        assert!(first.contains(NOTE_WORDS), "{first}");
        if preset == "aider" {
            // The restored chat: the first run's message, then the resumed one's.
            assert!(
                first.matches("doing stage `").count() >= 2,
                "the earlier message is in the conversation: {first}"
            );
        } else {
            // The first run's turn (its command and what it printed) is in the conversation.
            assert!(first.contains(PROBE), "{first}");
            // The session resumed is the one the first run recorded.
            let id = data["session_id"].as_str().unwrap();
            // (Without the note, found from the one rollout file's name: the same id.)
            assert_eq!(note.trim(), format!("{preset} {id}"));
        }
    }
    // The item went on past the held stage.
    assert!(
        !matches!(reached.stage.as_str(), "failed" | "cancelled"),
        "APP-1 {}: {}",
        reached.stage,
        story()
    );
    let resumed_run = runs
        .iter()
        .find(|r| r.stage == held_stage && r.outcome == "ok")
        .unwrap_or_else(|| panic!("the held stage's run ended ok: {}", story()));
    let run_data: serde_json::Value = serde_json::from_str(&resumed_run.data).unwrap();
    assert_eq!(
        run_data.get("resumed_session").is_some(),
        !remove_files,
        "{run_data}"
    );
    println!(
        "{preset}: {kind} ({}), APP-1 reached {}; run {}",
        event.message, reached.stage, run_data["sandbox"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_resumes_its_session_after_the_host_is_lost() {
    resume("claude", "claude-sonnet-4-5", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_resumes_its_session_after_the_host_is_lost() {
    resume("codex", "gpt-5-codex", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_resumes_its_chat_after_the_host_is_lost() {
    resume("aider", "gpt-4.1", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_starts_afresh_when_its_session_files_are_gone() {
    resume("claude", "claude-sonnet-4-5", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_starts_afresh_when_its_chat_history_is_gone() {
    resume("aider", "gpt-4.1", true).await;
}

/// Codex lost before orch recorded its thread id: the id comes from its one rollout file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_resumes_from_its_rollout_when_the_id_was_not_recorded() {
    resume_with("codex", "gpt-5-codex", false, true).await;
}
