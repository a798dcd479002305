//! The agent executor with real parts: a real git repo and worktree, a real SQLite store,
//! fake agent CLIs as shell scripts (a fake `claude` printing Claude Code's JSON result, a
//! fake `codex` printing JSONL events, agents that hang, print megabytes, exit without
//! writing) and a loopback HTTP server speaking the OpenAI chat format.

use crate::common;

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use orch_domain::config::{AgentConfig, Backend, PromptVia, RepoConfig, Settings};
use orch_domain::gate::Verdict;
use orch_domain::ids::{AgentName, ArtifactName};
use orch_domain::pipeline::Pipeline;
use orch_exec::git::{Git, Pathspec};
use orch_runner::agents::{AgentExecutor, RetryPolicy};
use orch_runner::engine::{StageEffect, StageExecutor, StageRun};
use orch_store::testing::TestDb;
use orch_store::{
    AgentRun, AgentRunFinish, Claim, Job, Lease, NewAgentRun, NewEvent, NewJob, NewTask, Task,
    WorkItemSpec,
};
use serde_json::{Value, json};

// --- fixture ---------------------------------------------------------------------------------

/// A work item ORCH-1 of repo `svc` with its worktree, task, claimed job and a bin dir for
/// fake agents.
struct Fx {
    db: TestDb,
    _dir: tempfile::TempDir,
    root: PathBuf,
    repo_dir: PathBuf,
    worktree: PathBuf,
    git: Git,
    task: Task,
    job: Job,
    lease: Lease,
}

const ID: &str = "ORCH-1";

impl Fx {
    async fn new() -> Fx {
        let db = TestDb::sqlite().await;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::create_dir_all(root.join("out")).unwrap();
        let repo_dir = root.join("repos/svc");
        let git = Git::new();
        common::init_repo(&git, &repo_dir, "svc\n").await;
        let worktree = repo_dir.join("worktrees").join(ID);
        git.worktree_add(&repo_dir, &worktree, "orch/ORCH-1", "main")
            .await
            .unwrap();
        let task = db
            .store
            .create_task(NewTask {
                work_item: WorkItemSpec::Exact(ID.parse().unwrap()),
                repo: "svc".parse().unwrap(),
                title: "Add a dry-run flag".into(),
                body: "The CLI needs `--dry-run` that prints the plan and changes nothing.".into(),
                stage: "analysis".parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new("task.submitted", "submitted"),
                first_job: Some(NewJob::new("analyst", "{\"stage\":\"analysis\",\"seq\":1}")),
            })
            .await
            .unwrap();
        let claimed = db
            .store
            .claim(&Claim {
                worker_id: "test".into(),
                limit: 1,
                lease_ms: 600_000,
                kinds: vec!["analyst".into()],
                node: None,
                node_grace_ms: None,
            })
            .await
            .unwrap();
        let c = claimed.into_iter().next().expect("the job is claimed");
        Fx {
            db,
            _dir: dir,
            root,
            repo_dir,
            worktree,
            git,
            task,
            job: c.job,
            lease: c.lease,
        }
    }

    fn artifact_dir(&self) -> PathBuf {
        self.worktree.join("docs/work-items").join(ID)
    }

    fn out(&self, name: &str) -> PathBuf {
        self.root.join("out").join(name)
    }

    fn read_out(&self, name: &str) -> String {
        std::fs::read_to_string(self.out(name))
            .unwrap_or_else(|e| panic!("{}: {e}", self.out(name).display()))
    }

    /// A `StageRun` of `stage` for this work item.
    fn run(&self, stage: &str) -> StageRun {
        let pipeline = Pipeline::default_pipeline();
        let stage = pipeline.stage(&stage.parse().unwrap()).unwrap().clone();
        let (job, lease) = (self.job.clone(), self.lease);
        let repo = repo_config(&self.repo_dir);
        StageRun {
            stage,
            git: self.git.clone(),
            ..common::stage_run(&self.db, &self.task, job, lease, &self.repo_dir, repo)
        }
    }

    /// Writes an executable `/bin/sh` script with the artifact-writing helper available.
    fn script(&self, name: &str, body: &str) -> PathBuf {
        let path = self.root.join("bin").join(name);
        let text = format!(
            "#!/bin/sh\n{SHELL_LIB}\nOUT='{}'\n{body}\n",
            self.root.join("out").display()
        );
        std::fs::write(&path, text).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    async fn rows(&self) -> Vec<AgentRun> {
        self.db.store.task_agent_runs(self.task.id).await.unwrap()
    }
}

fn repo_config(path: &Path) -> RepoConfig {
    RepoConfig {
        path: Some(path.display().to_string()),
        test_timeout_s: 1800,
        ..common::repo_config("ORCH")
    }
}

/// `write_artifact PATH [HEADING]`: a valid artifact for the current work item and stage.
const SHELL_LIB: &str = r#"write_artifact() {
  extra=""
  if [ "$ORCH_STAGE" = review ]; then extra="review_status: APPROVED"; fi
  cat > "$1" <<EOF
---
work_item: $ORCH_WORK_ITEM
stage: $ORCH_STAGE
author_agent: $ORCH_AGENT
status: final
created_at: 2027-01-15T08:00:00Z
model_used: fake-model
$extra
---
# ${2:-Artifact}

Written by a fake agent at $(date +%s%N).
EOF
}"#;

fn agent(backend: Backend, command: Option<&Path>) -> AgentConfig {
    AgentConfig {
        backend,
        command: command.map(|p| p.display().to_string()),
        args: Vec::new(),
        prompt_via: PromptVia::Stdin,
        model: None,
        endpoint: None,
        api_key_env: None,
        timeout_s: Some(30),
        allowed_tools: None,
        disallowed_tools: None,
        max_turns: None,
        cli_retries: None,
        config_home: None,
        price: None,
        network: Vec::new(),
        env: Vec::new(),
    }
}

fn fast() -> RetryPolicy {
    RetryPolicy {
        tries: 3,
        base: Duration::from_millis(10),
        max: Duration::from_millis(50),
    }
}

fn executor(agents: Vec<(&str, AgentConfig)>, settings: &Settings) -> AgentExecutor {
    let agents: BTreeMap<AgentName, AgentConfig> = agents
        .into_iter()
        .map(|(n, c)| (n.parse().unwrap(), c))
        .collect();
    AgentExecutor::new(agents, settings).with_retry(fast())
}

fn produced(effect: &StageEffect) -> bool {
    matches!(effect, StageEffect::Produced { outcome: None })
}

/// The outcomes of the task's agent runs, in order.
fn outcomes(rows: &[AgentRun]) -> Vec<&str> {
    rows.iter().map(|r| r.outcome.as_str()).collect()
}

/// The stage's gate over the files in the artifact dir.
fn gate(fx: &Fx, stage: &str) -> Verdict {
    let run = fx.run(stage);
    let mut files = Vec::new();
    for e in std::fs::read_dir(fx.artifact_dir()).unwrap() {
        let e = e.unwrap();
        let name: ArtifactName = e.file_name().to_str().unwrap().parse().unwrap();
        files.push((name, std::fs::read_to_string(e.path()).unwrap()));
    }
    let refs: Vec<(ArtifactName, &str)> =
        files.iter().map(|(n, t)| (n.clone(), t.as_str())).collect();
    run.stage.check(&run.work_item, &refs).verdict
}

const CLAUDE_RESULT: &str = r#"{"type":"result","subtype":"success","is_error":false,"duration_ms":1234,"num_turns":4,"result":"Wrote the requirements.","session_id":"sess-1","total_cost_usd":0.0123,"usage":{"input_tokens":1000,"output_tokens":200,"cache_creation_input_tokens":300,"cache_read_input_tokens":400}}"#;

// --- CLI backends ----------------------------------------------------------------------------

#[tokio::test]
async fn claude_preset_writes_the_artifact_and_records_tokens_and_cost() {
    let fx = Fx::new().await;
    std::fs::create_dir_all(fx.artifact_dir()).unwrap();
    std::fs::write(
        fx.artifact_dir().join("01-request.md"),
        "---\nwork_item: ORCH-1\n---\nOriginal request: make dry runs possible.\n",
    )
    .unwrap();
    std::fs::write(
        fx.worktree.join("LESSONS.md"),
        "# Lessons\n\n## ORCH-0 (2027-01-01, 15-staging-log.md)\nRun the smoke test before claiming success.\n",
    )
    .unwrap();
    let claude = fx.script(
        "claude",
        &format!(
            "cat > \"$OUT/prompt.md\"\nprintf '%s\\n' \"$@\" > \"$OUT/args.txt\"\n\
             env | grep '^ORCH_' | sort > \"$OUT/env.txt\"\npwd > \"$OUT/pwd.txt\"\n\
             write_artifact \"$ORCH_ARTIFACT\" Requirements\nprintf '%s\\n' '{CLAUDE_RESULT}'"
        ),
    );
    let mut config = agent(Backend::Claude, Some(&claude));
    config.model = Some("claude-test".into());
    let ex = executor(vec![("analyst", config)], &Settings::default());

    let effect = ex.execute(&fx.run("analysis")).await.unwrap();
    assert!(produced(&effect), "{effect:?}");
    assert_eq!(gate(&fx, "analysis"), Verdict::Pass("final".into()));

    let rows = fx.rows().await;
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(
        (
            r.backend.as_str(),
            r.model.as_deref(),
            r.outcome.as_str(),
            r.exit_code
        ),
        ("claude", Some("claude-test"), "ok", Some(0))
    );
    assert_eq!((r.input_tokens, r.output_tokens), (Some(1700), Some(200)));
    assert_eq!(r.cost_usd, Some(0.0123));
    assert_eq!(
        (r.stage.as_str(), r.agent.as_str()),
        ("analysis", "analyst")
    );
    assert_eq!((r.job_id, r.attempt), (Some(fx.job.id), fx.lease.attempt));
    assert!(r.finished_at.is_some());
    let data: Value = serde_json::from_str(&r.data).unwrap();
    assert_eq!(data["claude_session_id"], "sess-1");
    assert_eq!(data["try"], 1);

    assert_eq!(
        fx.read_out("args.txt"),
        "-p\n--output-format\nstream-json\n--verbose\n--max-turns\n50\n--tools\nRead,Write,Edit\n--allowedTools\n\
         Read,Write,Edit\n--disallowedTools\nWebFetch,WebSearch,Agent,Task,CronCreate,CronDelete,\
         CronList,ScheduleWakeup,Workflow,SendMessage,EnterWorktree,ExitWorktree,Skill,TaskCreate,\
         TaskUpdate,TaskStop,ReportFindings\n--model\nclaude-test\n"
    );
    let env = fx.read_out("env.txt");
    let art = fx.artifact_dir();
    for line in [
        "ORCH_WORK_ITEM=ORCH-1".to_owned(),
        "ORCH_STAGE=analysis".to_owned(),
        "ORCH_AGENT=analyst".to_owned(),
        format!("ORCH_ATTEMPT={}", fx.lease.attempt),
        format!("ORCH_WORKTREE={}", fx.worktree.display()),
        format!("ORCH_ARTIFACT_DIR={}", art.display()),
        format!("ORCH_ARTIFACT={}", art.join("02-requirements.md").display()),
        "ORCH_MODEL=claude-test".to_owned(),
    ] {
        assert!(env.lines().any(|l| l == line), "{line} not in\n{env}");
    }
    assert!(!env.contains("ORCH_PROMPT_FILE"), "{env}");
    assert_eq!(
        fx.read_out("pwd.txt").trim(),
        fx.worktree.display().to_string()
    );

    let prompt = fx.read_out("prompt.md");
    for part in [
        "# Role: analyst",
        "# Work item ORCH-1: Add a dry-run flag",
        "The CLI needs `--dry-run` that prints the plan and changes nothing.",
        "## docs/work-items/ORCH-1/01-request.md",
        "Original request: make dry runs possible.",
        "# Lessons from earlier work in this repository",
        "Run the smoke test before claiming success.",
        "- `docs/work-items/ORCH-1/02-requirements.md` (absolute path: ",
        "- `work_item`: `ORCH-1` (exactly this)",
        "model_used: claude-test\n---",
    ] {
        assert!(
            prompt.contains(part),
            "{part:?} not in the prompt:\n{prompt}"
        );
    }
}

#[tokio::test]
async fn codex_preset_sums_usage_over_turns() {
    let fx = Fx::new().await;
    let codex = fx.script(
        "codex",
        r#"cat > "$OUT/prompt.md"
printf '%s\n' "$@" > "$OUT/args.txt"
write_artifact "$ORCH_ARTIFACT"
echo '{"type":"thread.started","thread_id":"th-9"}'
echo '{"type":"turn.started"}'
echo '{"type":"item.completed","item":{"id":"i0","type":"agent_message","text":"done"}}'
echo '{"type":"turn.completed","usage":{"input_tokens":1000,"cached_input_tokens":200,"output_tokens":50}}'
echo '{"type":"turn.completed","usage":{"input_tokens":500,"cached_input_tokens":0,"output_tokens":25}}'"#,
    );
    let mut config = agent(Backend::Codex, Some(&codex));
    config.model = Some("gpt-test".into());
    let ex = executor(vec![("analyst", config)], &Settings::default());
    assert!(produced(&ex.execute(&fx.run("analysis")).await.unwrap()));

    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["ok"]);
    let r = &rows[0];
    assert_eq!(
        (r.backend.as_str(), r.model.as_deref()),
        ("codex", Some("gpt-test"))
    );
    assert_eq!(
        (r.input_tokens, r.output_tokens, r.cost_usd),
        (Some(1500), Some(75), None)
    );
    assert_eq!(
        fx.read_out("args.txt"),
        "exec\n--json\n-s\nworkspace-write\n--skip-git-repo-check\n-m\ngpt-test\n-\n"
    );
    assert!(fx.read_out("prompt.md").contains("# Role: analyst"));
}

#[tokio::test]
async fn codex_turn_failure_fails_the_attempt_with_its_message() {
    let fx = Fx::new().await;
    let codex = fx.script(
        "codex",
        r#"echo '{"type":"turn.failed","error":{"message":"model refused the sandbox policy"}}'
exit 1"#,
    );
    let ex = executor(
        vec![("analyst", agent(Backend::Codex, Some(&codex)))],
        &Settings::default(),
    );
    let e = ex
        .execute(&fx.run("analysis"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("model refused the sandbox policy"), "{e}");
    assert!(e.contains("exited with code 1"), "{e}");
    assert_eq!(outcomes(&fx.rows().await), ["error"]);
}

#[tokio::test]
async fn aider_gets_the_prompt_in_a_temporary_file_outside_the_worktree() {
    let fx = Fx::new().await;
    let aider = fx.script(
        "aider",
        r#"printf '%s\n' "$@" > "$OUT/args.txt"
while [ "$#" -gt 0 ]; do
  if [ "$1" = --message-file ]; then cp "$2" "$OUT/prompt.md"; echo "$2" > "$OUT/prompt-path.txt"; fi
  shift
done
write_artifact "$ORCH_ARTIFACT""#,
    );
    let ex = executor(
        vec![("analyst", agent(Backend::Aider, Some(&aider)))],
        &Settings::default(),
    );
    assert!(produced(&ex.execute(&fx.run("analysis")).await.unwrap()));
    let args = fx.read_out("args.txt");
    assert!(
        args.starts_with("--yes-always\n--no-auto-commits\n--no-dirty-commits\n--no-gitignore\n")
            && args.contains("\n--message-file\n"),
        "{args}"
    );
    let prompt_path = PathBuf::from(fx.read_out("prompt-path.txt").trim());
    assert!(
        !prompt_path.starts_with(&fx.worktree),
        "{}",
        prompt_path.display()
    );
    assert!(
        !prompt_path.exists(),
        "the prompt file is removed after the run"
    );
    assert!(fx.read_out("prompt.md").contains("# Work item ORCH-1"));
    let rows = fx.rows().await;
    // Aider printed no `Tokens:` line: its usage is unknown, not zero, and the row says so.
    assert_eq!(outcomes(&rows), ["usage_unknown"]);
    assert_eq!(
        (
            rows[0].input_tokens,
            rows[0].output_tokens,
            rows[0].cost_usd
        ),
        (None, None, None)
    );
}

#[tokio::test]
async fn command_backend_with_a_prompt_file_sees_feedback_and_the_repo_role_override() {
    let fx = Fx::new().await;
    std::fs::create_dir_all(fx.worktree.join(".orch/roles")).unwrap();
    std::fs::write(
        fx.worktree.join(".orch/roles/developer.md"),
        "# Our developer\nAlways run `make check`.\n",
    )
    .unwrap();
    let agent_sh = fx.script(
        "my-agent",
        r#"[ "$1" = --prompt ] && [ "$2" = "$ORCH_PROMPT_FILE" ] || { echo "bad args: $*" >&2; exit 2; }
cp "$2" "$OUT/prompt.md"
write_artifact "$ORCH_ARTIFACT" Implementation"#,
    );
    let mut config = agent(Backend::Command, Some(&agent_sh));
    config.args = vec!["--prompt".into(), "{prompt_file}".into()];
    config.prompt_via = PromptVia::File;
    let ex = executor(vec![("developer", config)], &Settings::default());
    let review = "---\nwork_item: ORCH-1\nstage: review\nauthor_agent: reviewer\nstatus: final\n\
                  created_at: 2027-01-15T08:00:00Z\nmodel_used: m\nreview_status: CHANGES_REQUESTED\n---\n\
                  1. blocking: `--dry-run` still writes the lock file.\n";
    let mut run = fx.run("implementation");
    run.feedback = Some(("11-review.md".parse().unwrap(), review.to_owned()));
    run.loops = 1;
    let effect = ex.execute(&run).await.unwrap();
    assert!(produced(&effect), "{effect:?}");

    let prompt = fx.read_out("prompt.md");
    for part in [
        "# Our developer\nAlways run `make check`.",
        "# This is a loop back: the previous work failed",
        "because `11-review.md` did not pass",
        "It says: `review_status: CHANGES_REQUESTED`.",
        "1. blocking: `--dry-run` still writes the lock file.",
        "docs/work-items/ORCH-1/10-implementation.md",
    ] {
        assert!(
            prompt.contains(part),
            "{part:?} not in the prompt:\n{prompt}"
        );
    }
    assert!(
        !prompt.contains("# Role: developer"),
        "the override replaces the shipped role"
    );
    let data: Value = serde_json::from_str(&fx.rows().await[0].data).unwrap();
    assert_eq!(data["role"], ".orch/roles/developer.md");
}

#[tokio::test]
async fn review_prompt_lists_the_branch_changes_and_the_status_key() {
    let fx = Fx::new().await;
    std::fs::write(fx.worktree.join("main.rs"), "fn main() {}\n").unwrap();
    fx.git
        .add_and_commit(&fx.worktree, &Pathspec::All, "implement")
        .await
        .unwrap();
    let reviewer = fx.script(
        "reviewer",
        "cat > \"$OUT/prompt.md\"\nwrite_artifact \"$ORCH_ARTIFACT\" Review",
    );
    let ex = executor(
        vec![("reviewer", agent(Backend::Command, Some(&reviewer)))],
        &Settings::default(),
    );
    assert!(produced(&ex.execute(&fx.run("review")).await.unwrap()));
    assert_eq!(gate(&fx, "review"), Verdict::Pass("APPROVED".into()));
    let prompt = fx.read_out("prompt.md");
    for part in [
        "# Role: reviewer",
        "# Files this branch changed",
        "- `main.rs`",
        "- `review_status`: exactly one of `APPROVED`, `CHANGES_REQUESTED`",
        "review_status: APPROVED\n---",
    ] {
        assert!(
            prompt.contains(part),
            "{part:?} not in the prompt:\n{prompt}"
        );
    }
}

#[tokio::test]
async fn an_agent_that_exits_0_without_writing_fails_the_attempt_with_the_path() {
    let fx = Fx::new().await;
    let lazy = fx.script("lazy", "cat > /dev/null\nexit 0");
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&lazy)))],
        &Settings::default(),
    );
    let e = ex
        .execute(&fx.run("analysis"))
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "agent analyst exited 0 without writing docs/work-items/ORCH-1/02-requirements.md"
    );
    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["missing_artifact"]);
    assert_eq!(rows[0].error.as_deref(), Some(e.as_str()));
}

#[tokio::test]
async fn an_artifact_left_from_an_earlier_visit_does_not_count_as_written() {
    let fx = Fx::new().await;
    std::fs::create_dir_all(fx.artifact_dir()).unwrap();
    std::fs::write(fx.artifact_dir().join("02-requirements.md"), "old\n").unwrap();
    let lazy = fx.script("lazy", "exit 0");
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&lazy)))],
        &Settings::default(),
    );
    let e = ex
        .execute(&fx.run("analysis"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("without updating docs/work-items/ORCH-1/02-requirements.md"),
        "{e}"
    );
}

#[tokio::test]
async fn architecture_needs_both_documents_but_not_an_adr() {
    let fx = Fx::new().await;
    let half = fx.script(
        "half",
        "write_artifact \"$ORCH_ARTIFACT_DIR/06-architecture.md\"",
    );
    let ex = executor(
        vec![("architect", agent(Backend::Command, Some(&half)))],
        &Settings::default(),
    );
    let e = ex
        .execute(&fx.run("architecture"))
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "agent architect exited 0 without writing docs/work-items/ORCH-1/08-data-requirements.md"
    );
    let both = fx.script(
        "both",
        "write_artifact \"$ORCH_ARTIFACT_DIR/06-architecture.md\"\nwrite_artifact \"$ORCH_ARTIFACT_DIR/08-data-requirements.md\"",
    );
    let ex = executor(
        vec![("architect", agent(Backend::Command, Some(&both)))],
        &Settings::default(),
    );
    assert!(produced(
        &ex.execute(&fx.run("architecture")).await.unwrap()
    ));
    assert_eq!(gate(&fx, "architecture"), Verdict::Pass("final".into()));
}

#[tokio::test]
async fn a_hung_agent_is_killed_with_its_process_group_at_the_timeout() {
    let fx = Fx::new().await;
    let hang = fx.script(
        "hang",
        "echo $$ > \"$OUT/sh.pid\"\nsleep 1000 &\necho $! > \"$OUT/sleep.pid\"\nwait",
    );
    let mut config = agent(Backend::Command, Some(&hang));
    config.timeout_s = Some(1);
    let ex = executor(vec![("analyst", config)], &Settings::default());
    let started = Instant::now();
    let e = ex
        .execute(&fx.run("analysis"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        e,
        "agent analyst timed out after 1s; its whole process group was killed"
    );
    let rows = fx.rows().await;
    assert_eq!(
        outcomes(&rows),
        ["timeout"],
        "a timeout is not retried within the attempt"
    );
    for pid_file in ["sh.pid", "sleep.pid"] {
        let pid: i32 = fx.read_out(pid_file).trim().parse().unwrap();
        assert!(!alive(pid), "{pid_file} {pid} still runs");
    }
}

/// True when `pid` exists and is not a zombie.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[tokio::test]
async fn a_cancelled_run_stops_the_agent_and_finishes_its_row() {
    let fx = Fx::new().await;
    let hang = fx.script("hang", "sleep 1000");
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&hang)))],
        &Settings::default(),
    );
    let run = fx.run("analysis");
    let cancel = run.cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        cancel.cancel();
    });
    let e = ex.execute(&run).await.unwrap_err().to_string();
    assert!(e.contains("was cancelled"), "{e}");
    assert_eq!(outcomes(&fx.rows().await), ["cancelled"]);
}

#[tokio::test]
async fn dropping_the_attempt_kills_the_agent_and_closes_its_row_as_abandoned() {
    let fx = Fx::new().await;
    let hang = fx.script("hang", "echo $$ > \"$OUT/sh.pid\"\nsleep 1000");
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&hang)))],
        &Settings::default(),
    );
    let run = fx.run("analysis");
    let dropped = tokio::time::timeout(Duration::from_millis(1500), ex.execute(&run)).await;
    assert!(dropped.is_err(), "the attempt was still running");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows = fx.rows().await;
        if outcomes(&rows) == ["abandoned"] {
            assert!(rows[0].finished_at.is_some());
            break;
        }
        assert!(Instant::now() < deadline, "row not closed: {rows:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid: i32 = fx.read_out("sh.pid").trim().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(
            Instant::now() < deadline,
            "the agent {pid} outlived its attempt"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn megabytes_of_output_stay_bounded_in_errors_and_rows() {
    let fx = Fx::new().await;
    let loud = fx.script(
        "loud",
        "head -c 5000000 /dev/zero | tr '\\0' x\nhead -c 5000000 /dev/zero | tr '\\0' y >&2\necho 'the real reason' >&2\nexit 3",
    );
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&loud)))],
        &Settings::default(),
    );
    let e = ex
        .execute(&fx.run("analysis"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.len() < 3_000, "{} bytes", e.len());
    assert!(
        e.contains("exited with code 3"),
        "{}",
        &e[..200.min(e.len())]
    );
    assert!(
        e.ends_with("the real reason"),
        "{}",
        &e[e.len().saturating_sub(200)..]
    );
    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["error"]);
    assert!(rows[0].error.as_ref().unwrap().len() <= 2_100);
    let data: Value = serde_json::from_str(&rows[0].data).unwrap();
    assert_eq!(data["stdout_bytes"], 5_000_000);
    assert_eq!(data["stderr_bytes"], 5_000_016);
}

#[tokio::test]
async fn a_cli_rate_limit_is_retried_within_the_attempt() {
    let fx = Fx::new().await;
    let flaky = fx.script(
        "flaky",
        r#"n=$(cat "$OUT/count" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$OUT/count"
if [ "$n" = 1 ]; then echo 'API Error: 529 {"type":"overloaded_error","message":"Overloaded"}' >&2; exit 1; fi
write_artifact "$ORCH_ARTIFACT""#,
    );
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&flaky)))],
        &Settings::default(),
    );
    assert!(produced(&ex.execute(&fx.run("analysis")).await.unwrap()));
    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["transient_error", "ok"]);
    assert!(rows[0].error.as_ref().unwrap().contains("529"));
    assert_eq!(rows[0].exit_code, Some(1));
}

/// The `command` contract's exit statuses (README): 75 is "try again later" (retried within
/// the attempt, whatever the output says), 77 and 78 fail the stage at once, not retried.
#[tokio::test]
async fn a_command_agents_exit_status_says_retry_or_give_up() {
    let fx = Fx::new().await;
    let later = fx.script(
        "later",
        r#"n=$(cat "$OUT/count" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$OUT/count"
if [ "$n" = 1 ]; then echo 'busy' >&2; exit 75; fi
write_artifact "$ORCH_ARTIFACT""#,
    );
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&later)))],
        &Settings::default(),
    );
    assert!(produced(&ex.execute(&fx.run("analysis")).await.unwrap()));
    assert_eq!(outcomes(&fx.rows().await), ["transient_error", "ok"]);
    for code in [77, 78] {
        let fx = Fx::new().await;
        let refused = fx.script(
            "refused",
            &format!("echo 'no key for this' >&2; exit {code}"),
        );
        let ex = executor(
            vec![("analyst", agent(Backend::Command, Some(&refused)))],
            &Settings::default(),
        );
        let effect = ex.execute(&fx.run("analysis")).await.unwrap();
        let StageEffect::Failed { reason } = effect else {
            panic!("exit {code} fails the stage for good: {effect:?}");
        };
        assert!(reason.contains("no key for this"), "{reason}");
        assert!(reason.contains("not retried"), "{reason}");
        assert_eq!(outcomes(&fx.rows().await), ["error"], "exit {code}");
    }
}

#[tokio::test]
async fn transient_failures_give_up_after_the_tries() {
    let fx = Fx::new().await;
    let limited = fx.script(
        "limited",
        "echo 'Error: rate limit reached for requests' >&2\nexit 1",
    );
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&limited)))],
        &Settings::default(),
    );
    let e = ex
        .execute(&fx.run("analysis"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("still failing after 3 tries"), "{e}");
    assert!(e.contains("rate limit reached"), "{e}");
    assert_eq!(
        outcomes(&fx.rows().await),
        ["transient_error", "transient_error", "transient_error"]
    );
}

#[tokio::test]
async fn a_claude_error_result_is_not_retried() {
    let fx = Fx::new().await;
    let broke = fx.script(
        "claude",
        r#"echo '{"type":"result","subtype":"success","is_error":true,"result":"Credit balance is too low","total_cost_usd":0,"usage":{"input_tokens":3,"output_tokens":0}}'
exit 1"#,
    );
    let ex = executor(
        vec![("analyst", agent(Backend::Claude, Some(&broke)))],
        &Settings::default(),
    );
    let e = ex
        .execute(&fx.run("analysis"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("Credit balance is too low"), "{e}");
    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["error"]);
    assert_eq!(
        (rows[0].input_tokens, rows[0].cost_usd),
        (Some(3), Some(0.0))
    );
}

#[tokio::test]
async fn a_missing_program_is_a_clear_error_and_fails_the_stage_without_a_retry() {
    let fx = Fx::new().await;
    let ex = executor(
        vec![(
            "analyst",
            agent(Backend::Claude, Some(&fx.root.join("bin/nope"))),
        )],
        &Settings::default(),
    );
    let effect = ex.execute(&fx.run("analysis")).await.unwrap();
    let StageEffect::Failed { reason } = effect else {
        panic!("a missing program is permanent: {effect:?}");
    };
    assert!(reason.contains("program not found"), "{reason}");
    assert!(reason.contains("not retried"), "{reason}");
    assert_eq!(outcomes(&fx.rows().await), ["error"]);
}

/// What a run cost is known or it is unknown, never guessed (issue 30): a run that never
/// started spent nothing (a known zero), while a `command` agent that ran and reported no
/// usage has an unknown cost (no zero recorded), which `Store::task_usage` counts apart.
#[tokio::test]
async fn a_run_that_never_started_cost_nothing_and_one_that_ran_unreported_is_unknown() {
    let fx = Fx::new().await;
    let missing = executor(
        vec![(
            "analyst",
            agent(Backend::Command, Some(&fx.root.join("bin/nope"))),
        )],
        &Settings::default(),
    );
    let _ = missing.execute(&fx.run("analysis")).await.unwrap();
    let quiet = fx.script(
        "quiet",
        "cat > /dev/null
write_artifact \"$ORCH_ARTIFACT\"",
    );
    let ran = executor(
        vec![("analyst", agent(Backend::Command, Some(&quiet)))],
        &Settings::default(),
    );
    assert!(produced(&ran.execute(&fx.run("analysis")).await.unwrap()));
    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["error", "ok"]);
    assert_eq!(
        (rows[0].input_tokens, rows[0].cost_usd),
        (Some(0), Some(0.0)),
        "never started: {rows:?}"
    );
    let data: Value = serde_json::from_str(&rows[0].data).unwrap();
    assert_eq!(data["cost_source"], "not_started", "{data}");
    assert_eq!(rows[1].cost_usd, None, "ran without a report: {rows:?}");
    let usage = fx.db.store.task_usage(fx.task.id).await.unwrap();
    assert_eq!((usage.runs, usage.unknown_cost_runs), (2, 1), "{usage:?}");
}

/// The README's minimal `command` agent, taken from README.md as printed (the `sh` block
/// that starts `#!/bin/sh` / `# orch-echo-agent:`), runs through the command backend for
/// every document stage (the architecture's two documents, the review's status key) and what
/// it writes passes each stage's gate: the contract the README states is the one orch keeps.
#[tokio::test]
async fn the_readme_command_agent_runs_as_printed() {
    const README: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
    let readme = std::fs::read_to_string(README).unwrap();
    let start = readme
        .find("```sh\n#!/bin/sh\n# orch-echo-agent:")
        .expect("the README shows the example agent")
        + "```sh\n".len();
    let len = readme[start..].find("```").expect("the block ends");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("orch-echo-agent");
    std::fs::write(&path, &readme[start..start + len]).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    for (stage, agent_name, verdict) in [
        ("analysis", "analyst", "final"),
        ("architecture", "architect", "final"),
        ("review", "reviewer", "APPROVED"),
    ] {
        let fx = Fx::new().await;
        let ex = executor(
            vec![(agent_name, agent(Backend::Command, Some(&path)))],
            &Settings::default(),
        );
        let effect = ex.execute(&fx.run(stage)).await.unwrap();
        let rows = fx.rows().await;
        assert!(produced(&effect), "{stage}: {effect:?} {rows:?}");
        assert_eq!(
            gate(&fx, stage),
            Verdict::Pass(verdict.into()),
            "{stage}: {rows:?}"
        );
        assert_eq!(outcomes(&rows), ["ok"], "{stage}");
    }
}

// --- budgets, configuration, concurrency -----------------------------------------------------

/// Pre-spends (tokens in, tokens out, cost) on the task, runs analysis under `settings`, and
/// expects `Ok(())` for a run that went ahead or `Err(fragments)` of the Failed reason.
async fn check_budget(spent: (i64, i64, f64), settings: Settings, expect: Result<(), &[&str]>) {
    let finish = AgentRunFinish {
        outcome: "ok".into(),
        input_tokens: Some(spent.0),
        output_tokens: Some(spent.1),
        cost_usd: Some(spent.2),
        data: "{}".into(),
        ..AgentRunFinish::default()
    };
    check_budget_after(finish, settings, expect).await;
}

/// Records an earlier agent run finished as `finish`, then runs analysis under `settings`
/// and expects `Ok(())` for a run that went ahead or `Err(fragments)` of the Failed reason.
async fn check_budget_after(
    finish: AgentRunFinish,
    settings: Settings,
    expect: Result<(), &[&str]>,
) {
    let fx = Fx::new().await;
    let id = fx
        .db
        .store
        .start_agent_run(NewAgentRun {
            task_id: fx.task.id,
            job_id: None,
            stage: "analysis".into(),
            agent: "analyst".into(),
            backend: "claude".into(),
            model: None,
            attempt: 1,
        })
        .await
        .unwrap();
    fx.db.store.finish_agent_run(id, finish).await.unwrap();
    let ran = fx.script(
        "agent",
        "touch \"$OUT/ran\"\nwrite_artifact \"$ORCH_ARTIFACT\"",
    );
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&ran)))],
        &settings,
    );
    let effect = ex.execute(&fx.run("analysis")).await.unwrap();
    match expect {
        Ok(()) => {
            assert!(produced(&effect), "{effect:?}");
            assert!(fx.out("ran").exists());
            assert_eq!(fx.rows().await.len(), 2);
        }
        Err(fragments) => {
            let StageEffect::Failed { reason } = effect else {
                panic!("expected Failed, got {effect:?}");
            };
            for f in fragments {
                assert!(reason.contains(f), "{f:?} not in {reason:?}");
            }
            assert!(
                !fx.out("ran").exists(),
                "the agent must not start over budget"
            );
            assert_eq!(fx.rows().await.len(), 1, "no agent run is recorded");
        }
    }
}

#[tokio::test]
async fn budgets_stop_a_run_before_it_starts() {
    let tokens = |max| Settings {
        max_tokens_per_item: Some(max),
        ..Settings::default()
    };
    let cost = |max| Settings {
        max_cost_usd_per_item: Some(max),
        ..Settings::default()
    };
    check_budget(
        (900_000, 100_000, 0.5),
        tokens(500_000),
        Err(&[
            "work item ORCH-1 has used its token budget",
            "1000000 tokens (900000 in, 100000 out, over 1 agent runs)",
            "max_tokens_per_item = 500000",
            "agent analyst was not started",
        ]),
    )
    .await;
    check_budget(
        (10, 10, 3.0),
        cost(2.5),
        Err(&["cost budget: $3.0000", "max_cost_usd_per_item = $2.5"]),
    )
    .await;
    check_budget((10, 10, 0.01), tokens(500_000), Ok(())).await;
    check_budget((10, 10, 0.01), cost(2.5), Ok(())).await;
}

/// Regression (issue 12): a run whose cost was unknown counted as $0, so cost budgets never
/// tripped for tools that report no cost. Unknown cost now counts as `unknown_run_cost_usd`,
/// or as the whole budget when that is unset; unknown tokens likewise.
#[tokio::test]
async fn unknown_usage_counts_toward_budgets_not_as_zero() {
    let unknown_cost = || AgentRunFinish {
        outcome: "ok".into(),
        input_tokens: Some(1000),
        output_tokens: Some(100),
        cost_usd: None,
        data: r#"{"cost_unknown":true}"#.into(),
        ..AgentRunFinish::default()
    };
    let unknown_usage = || AgentRunFinish {
        outcome: "usage_unknown".into(),
        data: r#"{"usage_unknown":true}"#.into(),
        ..AgentRunFinish::default()
    };
    let cost = |max, assumed| Settings {
        max_cost_usd_per_item: Some(max),
        unknown_run_cost_usd: assumed,
        ..Settings::default()
    };
    check_budget_after(
        unknown_cost(),
        cost(5.0, None),
        Err(&[
            "has used its cost budget",
            "1 run(s) of unknown cost counted as $5 each",
            "unset: the whole budget",
            "[prices]",
        ]),
    )
    .await;
    check_budget_after(unknown_cost(), cost(5.0, Some(1.0)), Ok(())).await;
    check_budget_after(
        unknown_cost(),
        cost(0.5, Some(1.0)),
        Err(&["1 run(s) of unknown cost counted as $1 each"]),
    )
    .await;
    check_budget_after(
        unknown_usage(),
        Settings {
            max_tokens_per_item: Some(100_000),
            ..Settings::default()
        },
        Err(&["has used its token budget", "1 run(s) of unknown usage"]),
    )
    .await;
    check_budget_after(
        unknown_usage(),
        Settings {
            max_tokens_per_item: Some(100_000),
            unknown_run_tokens: Some(10_000),
            ..Settings::default()
        },
        Ok(()),
    )
    .await;
    // A run that failed before anything ran (no usage, not marked unknown) costs nothing.
    check_budget_after(
        AgentRunFinish {
            outcome: "error".into(),
            data: "{}".into(),
            ..AgentRunFinish::default()
        },
        cost(0.01, None),
        Ok(()),
    )
    .await;
}

/// Regression (issue 12): Codex reports tokens but no cost; the price table turns them into
/// cost, so the cost budget trips.
#[tokio::test]
async fn tokens_priced_by_the_table_trip_the_cost_budget() {
    let fx = Fx::new().await;
    let codex = fx.script(
        "codex",
        r#"write_artifact "$ORCH_ARTIFACT"
echo '{"type":"turn.completed","usage":{"input_tokens":1000000,"cached_input_tokens":0,"output_tokens":100000}}'"#,
    );
    let mut config = agent(Backend::Codex, Some(&codex));
    config.model = Some("gpt-5-codex".into());
    config.price = Some(orch_domain::config::Price {
        input_per_mtok: 1.25,
        output_per_mtok: 10.0,
    });
    let settings = Settings {
        max_cost_usd_per_item: Some(2.0),
        ..Settings::default()
    };
    let ex = executor(vec![("analyst", config)], &settings);
    assert!(produced(&ex.execute(&fx.run("analysis")).await.unwrap()));
    let rows = fx.rows().await;
    assert_eq!(rows[0].cost_usd, Some(2.25));
    let data: Value = serde_json::from_str(&rows[0].data).unwrap();
    assert_eq!(data["cost_source"], "price_table");
    let effect = ex.execute(&fx.run("analysis")).await.unwrap();
    let StageEffect::Failed { reason } = effect else {
        panic!("expected the budget to stop the run, got {effect:?}");
    };
    assert!(reason.contains("cost budget: $2.2500"), "{reason}");
}

/// Regression (issue 12): a preset agent that exits 0 but prints no readable report was
/// recorded `ok` with no usage, which budgets read as zero. It is `usage_unknown` now, and the
/// budget counts it.
#[tokio::test]
async fn an_agent_exiting_0_with_unparsable_output_has_unknown_usage_that_budgets_count() {
    let fx = Fx::new().await;
    let claude = fx.script(
        "claude",
        "write_artifact \"$ORCH_ARTIFACT\"\necho 'Done! (not JSON)'",
    );
    let settings = Settings {
        max_cost_usd_per_item: Some(10.0),
        ..Settings::default()
    };
    let ex = executor(
        vec![("analyst", agent(Backend::Claude, Some(&claude)))],
        &settings,
    );
    assert!(produced(&ex.execute(&fx.run("analysis")).await.unwrap()));
    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["usage_unknown"]);
    let data: Value = serde_json::from_str(&rows[0].data).unwrap();
    assert_eq!(
        (data["usage_unknown"].clone(), data["cost_unknown"].clone()),
        (json!(true), json!(true))
    );
    assert_eq!((rows[0].input_tokens, rows[0].cost_usd), (None, None));
    let effect = ex.execute(&fx.run("analysis")).await.unwrap();
    let StageEffect::Failed { reason } = effect else {
        panic!("the unknown run counts as the whole budget: {effect:?}");
    };
    assert!(reason.contains("1 run(s) of unknown cost"), "{reason}");
}

#[tokio::test]
async fn a_stage_without_its_agent_section_fails_for_good() {
    let fx = Fx::new().await;
    let ex = executor(Vec::new(), &Settings::default());
    let effect = ex.execute(&fx.run("analysis")).await.unwrap();
    let StageEffect::Failed { reason } = effect else {
        panic!("expected Failed, got {effect:?}");
    };
    assert!(reason.contains("no [agents.analyst] section"), "{reason}");
    assert!(fx.rows().await.is_empty());
}

/// Runs two analysis attempts at once under `concurrency` slots; returns whether the agents
/// overlapped.
async fn overlapped(concurrency: u32) -> bool {
    let fx = Fx::new().await;
    let slow = fx.script(
        "slow",
        r#"if mkdir "$OUT/lock" 2>/dev/null; then held=1; else held=0; echo overlap >> "$OUT/overlaps"; fi
sleep 0.5
write_artifact "$ORCH_ARTIFACT"
if [ "$held" = 1 ]; then rmdir "$OUT/lock"; fi"#,
    );
    let settings = Settings {
        agent_concurrency: concurrency,
        ..Settings::default()
    };
    let ex = executor(
        vec![("analyst", agent(Backend::Command, Some(&slow)))],
        &settings,
    );
    let (a, b) = (fx.run("analysis"), fx.run("analysis"));
    let ex2 = ex.clone();
    let (ra, rb) = tokio::join!(ex.execute(&a), ex2.execute(&b));
    assert!(produced(&ra.unwrap()) && produced(&rb.unwrap()));
    fx.out("overlaps").exists()
}

#[tokio::test]
async fn the_concurrency_limit_is_shared_by_clones() {
    assert!(!overlapped(1).await, "one slot: the runs must not overlap");
    assert!(
        overlapped(2).await,
        "two slots: the runs overlap (the check can fail)"
    );
}

// --- the openai backend ----------------------------------------------------------------------

/// One request the fake endpoint received: its `Authorization` header and JSON body.
type Seen = (Option<String>, Value);

/// A loopback chat endpoint answering from a script of (status, body), then `fallback`.
#[derive(Clone)]
struct FakeChat {
    script: Arc<Mutex<VecDeque<(u16, String)>>>,
    fallback: (u16, String),
    seen: Arc<Mutex<Vec<Seen>>>,
}

async fn chat(
    State(f): State<FakeChat>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<Value>,
) -> (StatusCode, String) {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    f.seen.lock().unwrap().push((auth, body));
    let (status, text) = f
        .script
        .lock()
        .unwrap()
        .pop_front()
        .unwrap_or_else(|| f.fallback.clone());
    (StatusCode::from_u16(status).unwrap(), text)
}

/// Starts a fake endpoint; returns its `/v1` base URL and the fake.
async fn serve(script: Vec<(u16, String)>, fallback: (u16, String)) -> (String, FakeChat) {
    let fake = FakeChat {
        script: Arc::new(Mutex::new(script.into())),
        fallback,
        seen: Arc::new(Mutex::new(Vec::new())),
    };
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/v1"), fake)
}

fn completion(content: &str) -> String {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "local-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 321, "completion_tokens": 54, "total_tokens": 375}
    })
    .to_string()
}

const REQUIREMENTS: &str = "---\nwork_item: ORCH-1\nstage: analysis\nauthor_agent: writer\nstatus: final\n\
                            created_at: 2027-01-15T08:00:00Z\nmodel_used: local-model\n---\n# Requirements\n\nBR-1: dry run.\n";

/// The variable that holds the test's API key: cargo sets it for every test process, so the
/// test needs no `set_var`.
const KEY_VAR: &str = "CARGO_PKG_NAME";

fn openai_agent(endpoint: &str) -> AgentConfig {
    let mut c = agent(Backend::Openai, None);
    c.endpoint = Some(endpoint.to_owned());
    c.model = Some("local-model".into());
    c.api_key_env = Some(KEY_VAR.into());
    c
}

fn with_writer(stage: &str, fx: &Fx) -> StageRun {
    let mut run = fx.run(stage);
    run.stage.agent = Some("writer".parse().unwrap());
    run
}

#[tokio::test]
async fn openai_reply_becomes_the_artifact() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fx = Fx::new().await;
    let (url, fake) = serve(
        vec![(200, completion(&format!("```markdown\n{REQUIREMENTS}```")))],
        (500, "unused".into()),
    )
    .await;
    let ex = executor(vec![("writer", openai_agent(&url))], &Settings::default());
    let effect = ex.execute(&with_writer("analysis", &fx)).await.unwrap();
    assert!(produced(&effect), "{effect:?}");
    let written = std::fs::read_to_string(fx.artifact_dir().join("02-requirements.md")).unwrap();
    assert_eq!(written, REQUIREMENTS, "the wrapping fence is stripped");
    assert_eq!(gate(&fx, "analysis"), Verdict::Pass("final".into()));

    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["ok"]);
    let r = &rows[0];
    assert_eq!(
        (
            r.backend.as_str(),
            r.model.as_deref(),
            r.input_tokens,
            r.output_tokens,
            r.cost_usd
        ),
        ("openai", Some("local-model"), Some(321), Some(54), None)
    );

    let seen = fake.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    let (auth, body) = &seen[0];
    let key = std::env::var(KEY_VAR).expect("cargo sets CARGO_PKG_NAME for tests");
    assert_eq!(auth.as_deref(), Some(format!("Bearer {key}").as_str()));
    assert_eq!(body["model"], "local-model");
    assert_eq!(body["messages"][0]["role"], "system");
    assert!(
        body["messages"][0]["content"]
            .as_str()
            .unwrap()
            .starts_with("# Role: analyst")
    );
    let user = body["messages"][1]["content"].as_str().unwrap();
    assert!(
        user.contains("Reply with the complete content of `02-requirements.md` and nothing else"),
        "{user}"
    );
    assert!(
        !user.contains("# Role:"),
        "the role travels as the system message only"
    );
}

#[tokio::test]
async fn openai_429_is_retried_and_then_succeeds() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fx = Fx::new().await;
    let (url, fake) = serve(
        vec![
            (429, r#"{"error":{"message":"Rate limit reached"}}"#.into()),
            (200, completion(REQUIREMENTS)),
        ],
        (500, "unused".into()),
    )
    .await;
    let ex = executor(vec![("writer", openai_agent(&url))], &Settings::default());
    assert!(produced(
        &ex.execute(&with_writer("analysis", &fx)).await.unwrap()
    ));
    let rows = fx.rows().await;
    assert_eq!(outcomes(&rows), ["transient_error", "ok"]);
    assert!(
        rows[0].error.as_ref().unwrap().contains("HTTP 429"),
        "{:?}",
        rows[0].error
    );
    assert_eq!(fake.seen.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn openai_5xx_forever_fails_after_the_tries_without_leaking_the_key() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fx = Fx::new().await;
    let (url, fake) = serve(Vec::new(), (500, "upstream exploded".into())).await;
    let ex = executor(vec![("writer", openai_agent(&url))], &Settings::default());
    let e = ex
        .execute(&with_writer("analysis", &fx))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("still failing after 3 tries"), "{e}");
    assert!(e.contains("HTTP 500 Internal Server Error"), "{e}");
    assert!(e.contains("upstream exploded"), "{e}");
    let rows = fx.rows().await;
    assert_eq!(
        outcomes(&rows),
        ["transient_error", "transient_error", "transient_error"]
    );
    assert_eq!(fake.seen.lock().unwrap().len(), 3);
    let key = std::env::var(KEY_VAR).unwrap();
    assert!(!e.contains(&key), "{e}");
    for r in &rows {
        assert!(!r.error.as_deref().unwrap_or("").contains(&key));
        assert!(!r.data.contains(&key));
    }
}

#[tokio::test]
async fn openai_client_errors_and_refused_connections() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // 401: permanent, one try, the stage fails at once.
    let fx = Fx::new().await;
    let (url, _fake) = serve(Vec::new(), (401, r#"{"error":"bad key"}"#.into())).await;
    let ex = executor(vec![("writer", openai_agent(&url))], &Settings::default());
    let effect = ex.execute(&with_writer("analysis", &fx)).await.unwrap();
    let StageEffect::Failed { reason: e } = effect else {
        panic!("a 401 is permanent: {effect:?}");
    };
    assert!(e.contains("HTTP 401 Unauthorized"), "{e}");
    assert_eq!(outcomes(&fx.rows().await), ["error"]);

    // Nothing listens: connection refused is transient.
    let fx = Fx::new().await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let ex = executor(
        vec![(
            "writer",
            openai_agent(&format!("http://127.0.0.1:{port}/v1")),
        )],
        &Settings::default(),
    );
    let e = ex
        .execute(&with_writer("analysis", &fx))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("still failing after 3 tries"), "{e}");
    assert_eq!(
        outcomes(&fx.rows().await),
        ["transient_error", "transient_error", "transient_error"]
    );

    // The key's variable is not set: said by name, nothing sent.
    let fx = Fx::new().await;
    let (url, fake) = serve(Vec::new(), (200, completion(REQUIREMENTS))).await;
    let mut config = openai_agent(&url);
    config.api_key_env = Some("ORCH_TEST_SURELY_UNSET_KEY".into());
    let ex = executor(vec![("writer", config)], &Settings::default());
    let effect = ex.execute(&with_writer("analysis", &fx)).await.unwrap();
    let StageEffect::Failed { reason: e } = effect else {
        panic!("a missing key variable is permanent: {effect:?}");
    };
    assert!(
        e.contains("`ORCH_TEST_SURELY_UNSET_KEY` (api_key_env) is not set"),
        "{e}"
    );
    assert!(fake.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn openai_multi_file_reply_writes_every_architecture_document() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fx = Fx::new().await;
    let doc = |stage: &str, title: &str| {
        format!(
            "---\nwork_item: ORCH-1\nstage: {stage}\nauthor_agent: writer\nstatus: final\n\
             created_at: 2027-01-15T08:00:00Z\nmodel_used: local-model\n---\n# {title}\n"
        )
    };
    let reply = format!(
        "<<<FILE 06-architecture.md>>>\n{}<<<FILE 08-data-requirements.md>>>\n{}<<<FILE 07-adr-cache.md>>>\n{}",
        doc("architecture", "Architecture"),
        doc("architecture", "Data"),
        doc("architecture", "ADR: cache")
    );
    let (url, _fake) = serve(vec![(200, completion(&reply))], (500, "unused".into())).await;
    let ex = executor(vec![("writer", openai_agent(&url))], &Settings::default());
    assert!(produced(
        &ex.execute(&with_writer("architecture", &fx)).await.unwrap()
    ));
    for f in [
        "06-architecture.md",
        "07-adr-cache.md",
        "08-data-requirements.md",
    ] {
        assert!(fx.artifact_dir().join(f).is_file(), "{f}");
    }
    assert_eq!(gate(&fx, "architecture"), Verdict::Pass("final".into()));
}

/// The transcript is written while the run goes: what the agent printed is in the run's file
/// before the agent ends, with the key it was given (a value orch knows is secret) replaced;
/// the row names the file when the run is over.
#[tokio::test]
async fn the_transcript_is_written_while_the_run_goes_with_the_key_redacted() {
    let fx = Fx::new().await;
    let slow = fx.script(
        "slow",
        r#"cat > /dev/null
echo "first line, key=$CARGO_PKG_NAME"
while [ ! -e "$OUT/go" ]; do sleep 0.05; done
echo "second line"
write_artifact "$ORCH_ARTIFACT""#,
    );
    let mut cfg = agent(Backend::Command, Some(&slow));
    // Cargo sets it for every test process: the "key" this agent is given.
    cfg.api_key_env = Some("CARGO_PKG_NAME".into());
    let key = std::env::var("CARGO_PKG_NAME").unwrap();
    let ex = executor(vec![("analyst", cfg)], &Settings::default());
    let run = fx.run("analysis");
    let dir = run.repos_dir.join(".transcripts").join(ID);
    let running = tokio::spawn(async move { ex.execute(&run).await });
    let t0 = std::time::Instant::now();
    let live = loop {
        let text: String = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .collect();
        if text.contains("first line") {
            break text;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no live transcript in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(live, "first line, key=[REDACTED]\n");
    std::fs::write(fx.out("go"), "").unwrap();
    let effect = running.await.unwrap().unwrap();
    assert!(produced(&effect), "{effect:?}");
    let rows = fx.rows().await;
    let data: Value = serde_json::from_str(&rows[0].data).unwrap();
    let file = data["transcript"]["file"].as_str().unwrap();
    assert_eq!(file, format!(".transcripts/{ID}/{}.log", rows[0].id));
    assert_eq!(data["transcript"]["redactions"], 1, "{data}");
    let all = std::fs::read_to_string(fx.run("analysis").repos_dir.join(file)).unwrap();
    assert_eq!(all, "first line, key=[REDACTED]\nsecond line\n");
    assert!(!all.contains(&key));
    // The diff beside it holds the artifact the run wrote.
    let diff = std::fs::read_to_string(
        fx.run("analysis")
            .repos_dir
            .join(data["transcript"]["diff"].as_str().unwrap()),
    )
    .unwrap();
    assert!(diff.contains("+stage: analysis"), "{diff}");
    // Reading the diff hashed the artifact outside the repository: its object is not there.
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(&fx.worktree)
            .output()
            .unwrap()
    };
    let artifact = fx.artifact_dir().join("02-requirements.md");
    let hash = git(&["hash-object", artifact.to_str().unwrap()]);
    let hash = String::from_utf8_lossy(&hash.stdout).trim().to_owned();
    assert_eq!(hash.len(), 40, "{hash}");
    assert!(
        !git(&["cat-file", "-e", &hash]).status.success(),
        "the run's diff wrote {hash} into the repository"
    );
}
