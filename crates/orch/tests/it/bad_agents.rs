//! Agents that misbehave never advance a task: an agent that writes malformed frontmatter, one
//! that writes outside its work item's folder, and one that exits 0 without writing anything
//! each fail their attempts with a clear reason in the events, the task ends `failed` at that
//! stage (never past it), and the orchestrator keeps running the other tasks.

use crate::common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::{ORCH, demo_setup, open, wait_terminal};

fn script(dir: &Path, name: &str, body: &str) -> String {
    use std::os::unix::fs::PermissionsExt as _;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\ncat > /dev/null\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_artifacts_fail_the_attempt_and_never_advance_the_task() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    // One analyst script that misbehaves in the way the work item's title asks for.
    let analyst = script(
        &dir,
        "bad-analyst.sh",
        r#"case "$(cat "$ORCH_ARTIFACT_DIR/01-request.md")" in
  *malformed*) printf -- '---\nwork_item: %s\nstage: analysis\nstage: again\n---\nbody\n' "$ORCH_WORK_ITEM" > "$ORCH_ARTIFACT" ;;
  *outside*) echo "hacked" >> "$ORCH_WORKTREE/app.py"
             printf -- '---\nwork_item: %s\nstage: analysis\nauthor_agent: analyst\nstatus: final\ncreated_at: "2026-11-29T00:00:00Z"\nmodel_used: x\n---\nok\n' "$ORCH_WORK_ITEM" > "$ORCH_ARTIFACT" ;;
  *) : ;;
esac
exit 0"#,
    );
    let config_path = dir.join("orch.toml");
    let config = std::fs::read_to_string(&config_path).unwrap();
    let cut = config.find("[agents.analyst]").unwrap();
    let rest = &config[cut..];
    let after = rest.find("[agents.architect]").unwrap();
    let config = format!(
        "{}[agents.analyst]\nbackend = \"command\"\ncommand = \"{analyst}\"\ntimeout_s = 20\n\n{}",
        &config[..cut],
        &rest[after..]
    );
    std::fs::write(&config_path, config).unwrap();
    for title in [
        "Write malformed frontmatter",
        "Write outside the folder",
        "Write nothing at all",
    ] {
        common::submit(&config_path, title);
    }
    let mut serve = tokio::process::Command::new(ORCH)
        .arg("--config")
        .arg(&config_path)
        .args(["serve", "--bind", "127.0.0.1:0"])
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let store = open(&dir).await;
    let mut ended = Vec::new();
    for id in ["APP-1", "APP-2", "APP-3"] {
        // Retries back off 1 s, 2 s between the 3 attempts.
        ended.push(wait_terminal(&store, id, Duration::from_secs(120)).await);
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(serve.id().unwrap() as i32, libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(20), serve.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(
        status.success(),
        "orch kept running and stopped cleanly: {status}"
    );

    for (t, reason) in ended.iter().zip([
        "duplicate frontmatter key `stage`",
        "`app.py`: outside `docs/work-items/APP-2/`; `analysis` writes no code",
        "without",
    ]) {
        assert_eq!(
            t.stage, "failed",
            "{} never advances past analysis",
            t.work_item_id
        );
        let events = store.task_events(t.id).await.unwrap();
        assert!(
            events
                .iter()
                .all(|e| !(e.kind == "stage.advanced" && e.message.starts_with("analysis"))),
            "{}: analysis never advanced",
            t.work_item_id
        );
        let all: String = events
            .iter()
            .map(|e| format!("{} {}\n", e.kind, e.message))
            .collect();
        let runs = store.task_agent_runs(t.id).await.unwrap();
        let run_errors: String = runs
            .iter()
            .filter_map(|r| r.error.clone())
            .collect::<Vec<_>>()
            .join("\n");
        let jobs = store.task_jobs(t.id).await.unwrap();
        let job_errors: String = jobs
            .iter()
            .filter_map(|j| j.last_error.clone())
            .collect::<Vec<_>>()
            .join("\n");
        let text = format!("{all}\n{run_errors}\n{job_errors}");
        assert!(
            text.contains(reason),
            "{}: the reason {reason:?} is recorded:\n{text}",
            t.work_item_id
        );
        let analysis = jobs
            .iter()
            .find(|j| j.task_content.contains("\"analysis\""))
            .unwrap();
        assert_eq!(
            analysis.attempt, 3,
            "{}: every attempt was tried: {analysis:?}",
            t.work_item_id
        );
    }
    // The agent's stray edit never reached the branch or the default branch.
    let repo = dir.join(".orch/repos/service");
    for rev in ["orch/APP-2:app.py", "main:app.py"] {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(&repo)
            .args(["show", rev])
            .output()
            .unwrap();
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("hacked"),
            "{rev} is clean"
        );
    }
    store.close().await;
}
