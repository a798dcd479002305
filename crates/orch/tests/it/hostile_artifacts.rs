//! Artifacts an agent must not be able to pass off: a symlink named as the artifact (pointing at
//! a valid file outside the repo) and an artifact over the size limit. Each is refused with a
//! clear reason (never followed, never reported as merely "missing"), the task never advances
//! past the stage, and the rejected file is never committed on the work item's branch.

use crate::common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{ORCH, demo_setup, open};

const LIMIT: u64 = 1024 * 1024;

fn script(dir: &Path, name: &str, body: &str) -> String {
    use std::os::unix::fs::PermissionsExt as _;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\ncat > /dev/null\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.display().to_string()
}

fn git_has(repo: &Path, rev_path: &str) -> bool {
    std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["cat-file", "-e", rev_path])
        .status()
        .unwrap()
        .success()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlinked_and_oversized_artifacts_are_refused_and_never_committed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let valid = "---\nwork_item: %s\nstage: analysis\nauthor_agent: analyst\nstatus: final\n\
                 created_at: \"2026-11-29T00:00:00Z\"\nmodel_used: x\n---\nok\n";
    let outside = dir.join("outside-requirements.md");
    let analyst = script(
        &dir,
        "hostile-analyst.sh",
        &format!(
            r#"case "$(cat "$ORCH_ARTIFACT_DIR/01-request.md")" in
  *symlink*) ln -sf "{outside}" "$ORCH_ARTIFACT" ;;
  *huge*) printf -- '{valid}' "$ORCH_WORK_ITEM" > "$ORCH_ARTIFACT"
          head -c {pad} /dev/zero | tr '\0' 'x' >> "$ORCH_ARTIFACT" ;;
esac
exit 0"#,
            outside = outside.display(),
            pad = LIMIT + 10,
        ),
    );
    // The file the link points at, outside the repository (an agent in the sandbox cannot
    // write there; it can still link to it).
    std::fs::write(&outside, valid.replace("%s", "APP-1")).unwrap();
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
    for title in ["Pass a symlink off", "Write a huge artifact"] {
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
    let t0 = Instant::now();
    let ended = loop {
        let mut ended = Vec::new();
        for id in ["APP-1", "APP-2"] {
            let t = store.get_task_by_work_item(id).await.unwrap().unwrap();
            if t.is_terminal() || !["intake", "analysis"].contains(&t.stage.as_str()) {
                ended.push(t);
            }
        }
        if ended.len() == 2 {
            break ended;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "tasks did not leave analysis: {ended:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // SAFETY: signalling our own child.
    unsafe { libc::kill(serve.id().unwrap() as i32, libc::SIGTERM) };
    let _ = tokio::time::timeout(Duration::from_secs(20), serve.wait()).await;

    let repo = dir.join(".orch/repos/service");
    for (t, reason) in ended
        .iter()
        .zip(["a symbolic link; no stage may commit one", "is too big: "])
    {
        assert_eq!(
            t.stage, "failed",
            "{} never advances past analysis",
            t.work_item_id
        );
        let events = store.task_events(t.id).await.unwrap();
        let rejected: Vec<&str> = events
            .iter()
            .filter(|e| e.kind == "artifact.rejected")
            .map(|e| e.message.as_str())
            .collect();
        assert!(
            rejected.iter().any(|m| m.contains(reason)),
            "{}: {reason:?} in {rejected:#?}",
            t.work_item_id
        );
        if reason.contains("too big") {
            assert!(
                rejected
                    .iter()
                    .any(|m| m.contains(&format!("limit {LIMIT}")) && m.contains(" bytes")),
                "{rejected:#?}"
            );
        }
        // `orch logs` material: each failed attempt says so (not a crash).
        let failed: Vec<&str> = events
            .iter()
            .filter(|e| e.kind == "job.attempt_failed")
            .map(|e| e.message.as_str())
            .collect();
        assert!(
            failed.iter().any(|m| m.starts_with("attempt 1 failed: ")),
            "{}: {failed:#?}",
            t.work_item_id
        );
        assert!(
            events.iter().all(|e| e.kind != "job.rescued"),
            "no crash happened, none is reported"
        );
        let artifact = format!(
            "{}:docs/work-items/{}/02-requirements.md",
            t.branch, t.work_item_id
        );
        assert!(
            !git_has(&repo, &artifact),
            "{artifact}: a rejected artifact is never committed"
        );
    }
    store.close().await;
}
