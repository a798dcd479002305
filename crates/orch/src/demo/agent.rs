//! `orch demo-agent`: the demo's scripted stand-in for an LLM coding agent. It is driven by
//! orch's `command` backend exactly like a real CLI agent (prompt on stdin, `ORCH_*`
//! variables), edits the sample service's code and writes each stage's artifact in the real
//! formats, then prints a Claude Code style JSON result (with usage and cost) on stdout.
//!
//! Three scenarios, chosen by the request's title: "version" adds a `/version` endpoint (the
//! first review asks for a test, the second approves), "greeting" adds a greeting but breaks
//! `/health` in production only, which the post-deploy watch catches and rolls back, and
//! "note" writes only `notes/<work item>.txt` (approved at once), so any number of such items
//! merge without conflicts (the cross-process merge serialization test).

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use orch_domain::artifact::{Artifact, Frontmatter, Value};

pub(crate) struct Env {
    pub(crate) work_item: String,
    pub(crate) stage: String,
    pub(crate) worktree: PathBuf,
    pub(crate) artifact_dir: PathBuf,
}

fn env(name: &str) -> Result<String> {
    std::env::var(name)
        .with_context(|| format!("{name} is not set: run me through orch's command backend"))
}

pub fn run() -> Result<ExitCode> {
    let mut prompt = String::new();
    let _ = std::io::stdin()
        .take(4 * 1024 * 1024)
        .read_to_string(&mut prompt);
    let e = Env {
        work_item: env("ORCH_WORK_ITEM")?,
        stage: env("ORCH_STAGE")?,
        worktree: PathBuf::from(env("ORCH_WORKTREE")?),
        artifact_dir: match std::env::var("ORCH_ARTIFACT_DIR") {
            Ok(d) => PathBuf::from(d),
            Err(_) => PathBuf::from(env("ORCH_ARTIFACT")?)
                .parent()
                .map(Path::to_path_buf)
                .context("ORCH_ARTIFACT has no parent directory")?,
        },
    };
    std::fs::create_dir_all(&e.artifact_dir)?;
    let request = std::fs::read_to_string(e.artifact_dir.join("01-request.md")).unwrap_or_default();
    let scenario = Scenario::of(&request);
    // A little thinking time, so the demo's progress display has something to show
    // (tests make it longer to kill orch in the middle of a run).
    let think_ms = std::env::var("ORCH_DEMO_AGENT_SLEEP_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(300)
        .min(600_000);
    // Up to this much more, drawn per run (benchmarks: real agents never take the same time,
    // so items submitted together do not stay in lockstep).
    let jitter_ms = std::env::var("ORCH_DEMO_AGENT_SLEEP_JITTER_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        .min(600_000);
    let extra_ms = match jitter_ms {
        0 => 0,
        j => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::from(d.subsec_nanos()));
            (nanos ^ u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15)) % j
        }
    };
    std::thread::sleep(std::time::Duration::from_millis(think_ms + extra_ms));
    let written = produce(&e, &request, &prompt, scenario)?;
    let input_tokens = (prompt.len() / 4) as u64 + 120;
    let output_tokens = (written / 4) as u64 + 40;
    let cost = input_tokens as f64 * 3e-6 + output_tokens as f64 * 15e-6;
    println!(
        "{}",
        serde_json::json!({
            "type": "result", "subtype": "success", "is_error": false,
            "duration_ms": 300, "num_turns": 1,
            "result": format!("{} done for {}", e.stage, e.work_item),
            "session_id": format!("demo-{}-{}", e.work_item, e.stage),
            "total_cost_usd": (cost * 1e6).round() / 1e6,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        })
    );
    Ok(ExitCode::SUCCESS)
}

/// Does the stage's work in `e`'s worktree; returns the bytes of artifacts written. (The
/// demo's model server for the real Claude Code runs it on a scratch copy, see `claude.rs`.)
pub(crate) fn produce(e: &Env, request: &str, prompt: &str, scenario: Scenario) -> Result<usize> {
    match e.stage.as_str() {
        "analysis" => analysis(e, request, prompt),
        "architecture" => architecture(e),
        "implementation" => implementation(e, scenario, prompt),
        "review" => review(e, scenario),
        other => anyhow::bail!("the demo agent has no script for stage {other}"),
    }
}

/// What the scripted developer does, chosen by the request's title.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    Version,
    Greeting,
    Note,
    /// A banner that breaks `/health` in staging: staging fails it every time.
    Banner,
}

impl Scenario {
    pub(crate) fn of(request: &str) -> Scenario {
        let title = title_of(request).to_lowercase();
        if title.contains("greeting") {
            Scenario::Greeting
        } else if title.contains("note") {
            Scenario::Note
        } else if title.contains("banner") {
            Scenario::Banner
        } else {
            Scenario::Version
        }
    }
}

fn now() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn front(e: &Env, author: &str, extra: &[(&str, &str)]) -> Frontmatter {
    let mut fm = Frontmatter::new();
    fm.insert("work_item", Value::from(e.work_item.as_str()));
    fm.insert("stage", Value::from(e.stage.as_str()));
    fm.insert("author_agent", Value::from(author));
    fm.insert("status", Value::from("final"));
    fm.insert("created_at", Value::from(now()));
    fm.insert("model_used", Value::from("demo-scripted-1"));
    for (k, v) in extra {
        fm.insert(*k, Value::from(*v));
    }
    fm
}

fn write(e: &Env, name: &str, fm: Frontmatter, body: String) -> Result<usize> {
    let text = Artifact::new(fm, body).render();
    let path = e.artifact_dir.join(name);
    std::fs::write(&path, &text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(text.len())
}

fn title_of(request: &str) -> String {
    request
        .lines()
        .find_map(|l| l.strip_prefix("# "))
        .unwrap_or("the request")
        .trim()
        .to_owned()
}

fn analysis(e: &Env, request: &str, prompt: &str) -> Result<usize> {
    let title = title_of(request);
    let mut body = format!(
        "# Requirements: {title}\n\n\
         - BR-1: {title}.\n\
         - NFR-1: the service keeps answering `GET /health` with 200 in every environment.\n\
         - NFR-2: standard library only; no new dependencies.\n\
         - AC-1: the new behaviour is covered by a unit test.\n\
         - AC-2: `python3 -m unittest` passes.\n"
    );
    // A real analyst reads the repo's lessons in its prompt; this one quotes those that
    // record an objective failure, so the demo can show the loop closing.
    let lessons: Vec<&str> = prompt
        .lines()
        .filter(|l| l.contains("orch-lesson") && (l.contains("rollback") || l.contains("FAILED")))
        .take(5)
        .collect();
    if !lessons.is_empty() {
        body.push_str("\n## Lessons considered\n\n");
        for l in lessons {
            let text = l.split("-->").nth(1).unwrap_or(l).trim();
            body.push_str(&format!("- {text}\n"));
        }
        body.push_str("- NFR-3: production health must not depend on configuration that staging sets (see the rollback above).\n");
    }
    write(e, "02-requirements.md", front(e, "analyst", &[]), body)
}

fn architecture(e: &Env) -> Result<usize> {
    let mut n = write(
        e,
        "06-architecture.md",
        front(e, "architect", &[]),
        "# Architecture\n\nOne more route in `ROUTES` of `app.py`; handlers are plain functions \
         returning `(status, body)`, so unit tests call them without a socket.\n"
            .into(),
    )?;
    n += write(
        e,
        "07-adr-001-stdlib-only.md",
        front(e, "architect", &[]),
        "# ADR-001: standard library only\n\nDecision: keep `http.server`; no framework.\n".into(),
    )?;
    n += write(
        e,
        "08-data-requirements.md",
        front(e, "architect", &[]),
        "# Data requirements\n\nNo stored data. Configuration comes from the environment.\n".into(),
    )?;
    Ok(n)
}

fn edit(path: &Path, from: &str, to: &str) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    if text.contains(to) {
        return Ok(()); // already applied (a retried attempt)
    }
    anyhow::ensure!(
        text.contains(from),
        "{} does not contain the expected code",
        path.display()
    );
    std::fs::write(path, text.replacen(from, to, 1))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// What a pull request's review that sent the item back asked, as the developer read it in
/// its prompt (the loop back's feedback, `11-pull-request-review.md`): the review's first line.
fn pull_request_review(prompt: &str) -> Option<String> {
    if !prompt.contains("pull-request-review.md") {
        return None;
    }
    let after = prompt.split("## The review").nth(1)?;
    after
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("```") && !l.starts_with("~~~"))
        .map(|l| l.chars().take(200).collect())
}

fn implementation(e: &Env, scenario: Scenario, prompt: &str) -> Result<usize> {
    if scenario == Scenario::Note {
        let dir = e.worktree.join("notes");
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let path = dir.join(format!("{}.txt", e.work_item));
        std::fs::write(&path, format!("A note for {}.\n", e.work_item))
            .with_context(|| format!("cannot write {}", path.display()))?;
        return write(
            e,
            "10-implementation.md",
            front(e, "developer", &[]),
            format!(
                "# Implementation\n\nAdded a note.\n\nFiles: `notes/{}.txt`.\n",
                e.work_item
            ),
        );
    }
    let app = e.worktree.join("app.py");
    let tests = e.worktree.join("test_app.py");
    let review_asked_for_test = std::fs::read_to_string(e.artifact_dir.join("11-review.md"))
        .map(|r| r.contains("CHANGES_REQUESTED"))
        .unwrap_or(false);
    // The two scenarios edit different places of the same files, so their merges do not
    // conflict.
    let summary = if scenario == Scenario::Banner {
        // Staging's smoke check sees it; the unit tests do not.
        edit(
            &app,
            "    return 200, {\"status\": \"ok\", \"env\": ENV}",
            "    if ENV == \"staging\":\n        return 503, {\"status\": \"BANNER missing in staging\"}\n    \
             return 200, {\"status\": \"ok\", \"env\": ENV}",
        )?;
        "Added a banner (health reports it in staging)."
    } else if scenario == Scenario::Greeting {
        edit(
            &app,
            "def revision():",
            "GREETING = os.environ.get(\"APP_GREETING\")\nSTARTED = time.time()\n\n\n\
             def greeting():\n    return 200, {\"greeting\": GREETING or \"hello\"}\n\n\n\
             def revision():",
        )?;
        edit(&app, "import sys\n", "import sys\nimport time\n")?;
        // The latent bug: in production, once the service has run a few seconds without a
        // configured greeting, health fails. Tests and staging do not see it. Four seconds:
        // the deploy's confirmation must see it healthy first even on a loaded machine (at two,
        // a slow start failed the deploy instead of the watch), and the watch (8 s, a poll a
        // second) still sees three failures in a row.
        edit(
            &app,
            "    return 200, {\"status\": \"ok\", \"env\": ENV}",
            "    if ENV == \"production\" and GREETING is None and time.time() - STARTED > 4:\n        \
             return 500, {\"status\": \"greeting not configured\"}\n    \
             return 200, {\"status\": \"ok\", \"env\": ENV}",
        )?;
        edit(
            &app,
            "    \"/revision\": revision,\n",
            "    \"/revision\": revision,\n    \"/greeting\": greeting,\n",
        )?;
        edit(
            &tests,
            "    def test_revision(self):",
            "    def test_greeting(self):\n        code, body = app.greeting()\n        \
             self.assertEqual(code, 200)\n        self.assertIn(\"greeting\", body)\n\n    \
             def test_revision(self):",
        )?;
        "Added `GET /greeting` (configurable with APP_GREETING) and a unit test. Health now \
         reports when the greeting is not configured."
    } else {
        edit(
            &app,
            "class Handler(",
            "def version():\n    return 200, {\"version\": \"1.1.0\"}\n\n\n\
             ROUTES[\"/version\"] = version\n\n\nclass Handler(",
        )?;
        if review_asked_for_test {
            edit(
                &tests,
                "\nif __name__",
                "    def test_version(self):\n        code, body = app.version()\n        \
                 self.assertEqual(code, 200)\n        self.assertEqual(body[\"version\"], \"1.1.0\")\n\n\nif __name__",
            )?;
            "Added `GET /version`; on review feedback, added `test_version`."
        } else {
            "Added `GET /version`."
        }
    };
    let addressed = pull_request_review(prompt)
        .map(|r| format!("\n\nAddressed the pull request's review, which said: {r}"))
        .unwrap_or_default();
    write(
        e,
        "10-implementation.md",
        front(e, "developer", &[]),
        format!("# Implementation\n\n{summary}{addressed}\n\nFiles: `app.py`, `test_app.py`.\n"),
    )
}

fn review(e: &Env, scenario: Scenario) -> Result<usize> {
    let tests = std::fs::read_to_string(e.worktree.join("test_app.py")).unwrap_or_default();
    let (status, notes) = if scenario != Scenario::Version || tests.contains("test_version") {
        (
            "APPROVED",
            "The change is small, tested, and follows ADR-001.",
        )
    } else {
        (
            "CHANGES_REQUESTED",
            "AC-1 is not met: `/version` has no unit test. Add `test_version`.",
        )
    };
    write(
        e,
        "11-review.md",
        front(e, "reviewer", &[("review_status", status)]),
        format!("# Review\n\nVerdict: {status}\n\n{notes}\n"),
    )
}
