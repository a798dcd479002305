//! The lessons stage with real parts: a real git repo and the work item's worktree whose
//! branch carries every version of its artifacts (a review rejected, then approved), a real
//! SQLite store with the task's events and jobs, and — for the whole deploy tail — a real
//! loopback service, deploy and rollback scripts. Lessons carry their provenance and are
//! appended to the lessons file once, however often the stage runs.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use orch_deploystate::{ArmOutcome, ArmedRecord, WatchState};
use orch_domain::artifact::{Artifact, Frontmatter, Value};
use orch_domain::config::RepoConfig;
use orch_domain::control::events;
use orch_exec::{Git, Pathspec};
use orch_runner::deploy::lessons::{ENTRY_MARKER, LESSONS_ARTIFACT};
use orch_runner::deploy::{DeployerExecutor, LessonsExecutor, MonitorExecutor};
use orch_runner::engine::{StageEffect, StageExecutor, StageJob, StageRun};
use orch_store::testing::TestDb;
use orch_store::{
    AdvanceStage, Claim, Fence, JobOutcome, NewEvent, NewJob, NewTask, Task, WorkItemSpec,
};

const ITEM: &str = "ORCH-3";

struct Fx {
    db: TestDb,
    _tmp: tempfile::TempDir,
    repos_dir: PathBuf,
    repo_dir: PathBuf,
    worktree: PathBuf,
    repo: RepoConfig,
    task: Task,
    git: Git,
    loops: u32,
}

impl Fx {
    /// A repo `app` with `main`, the work item's worktree on `orch/ORCH-3`, a task at `stage`.
    async fn new(stage: &str) -> Fx {
        Fx::on(stage, TestDb::sqlite().await).await
    }

    /// [`Fx::new`] on the store `db`.
    async fn on(stage: &str, db: TestDb) -> Fx {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let tmp = tempfile::tempdir().unwrap();
        let repos_dir = tmp.path().join("repos");
        let repo_dir = repos_dir.join("app");
        let git = Git::new();
        common::init_repo(&git, &repo_dir, "app\n").await;
        let worktree = repo_dir.join("worktrees").join(ITEM);
        git.worktree_add(&repo_dir, &worktree, &format!("orch/{ITEM}"), "main")
            .await
            .unwrap();
        let repo = RepoConfig {
            path: Some(repo_dir.display().to_string()),
            deploy_timeout_s: 30,
            ..common::repo_config("ORCH")
        };

        let task = db
            .store
            .create_task(NewTask {
                work_item: WorkItemSpec::Exact(ITEM.parse().unwrap()),
                repo: "app".parse().unwrap(),
                title: "Retry the payment webhook".into(),
                body: String::new(),
                stage: stage.parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new("task.created", "test"),
                first_job: None,
            })
            .await
            .unwrap();
        Fx {
            db,
            _tmp: tmp,
            repos_dir,
            repo_dir,
            worktree,
            repo,
            task,
            git,
            loops: 0,
        }
    }

    fn artifact_dir(&self) -> PathBuf {
        self.worktree.join("docs/work-items").join(ITEM)
    }

    /// Writes an artifact with the common keys plus `keys`, and commits it on the branch.
    async fn commit_artifact(&self, file: &str, keys: &[(&str, &str)], body: &str) {
        let mut fm = Frontmatter::new();
        fm.insert("work_item", ITEM);
        fm.insert("stage", "x");
        fm.insert("author_agent", "test");
        fm.insert("status", "final");
        fm.insert("model_used", "n/a");
        for (k, v) in keys {
            fm.insert(*k, *v);
        }
        std::fs::create_dir_all(self.artifact_dir()).unwrap();
        std::fs::write(
            self.artifact_dir().join(file),
            Artifact::new(fm, body.to_owned()).render(),
        )
        .unwrap();
        self.commit(file).await;
    }

    async fn commit(&self, message: &str) {
        self.git
            .add_and_commit(&self.worktree, &Pathspec::All, message)
            .await
            .unwrap();
    }

    /// Moves the task on, as the engine does after a stage.
    async fn advance(&mut self, to: &str) {
        self.task = self
            .db
            .store
            .advance_stage(AdvanceStage {
                task_id: self.task.id,
                expected_stage: self.task.stage.clone(),
                new_stage: to.parse().unwrap(),
                fence: Fence::Seq(self.task.stage_seq),
                event: NewEvent::new("stage.changed", format!("to {to}")),
                next_job: None,
            })
            .await
            .unwrap()
            .task;
    }

    fn content(&self) -> String {
        StageJob {
            stage: self.task.stage.to_string(),
            seq: self.task.stage_seq,
        }
        .to_content()
    }

    async fn run(&self, agent: &str, content: String) -> StageRun {
        let (job, lease) = common::enqueue(&self.db, &self.task, agent, content).await;
        self.run_as(job, lease)
    }

    /// The run of `job`'s attempt that holds `lease`.
    fn run_as(&self, job: orch_store::Job, lease: orch_store::Lease) -> StageRun {
        StageRun {
            worktree: self.worktree.clone(),
            artifact_dir: self.artifact_dir(),
            loops: self.loops,
            git: self.git.clone(),
            node: "node-a".into(),
            prep: Default::default(),
            ..common::stage_run(
                &self.db,
                &self.task,
                job,
                lease,
                &self.repo_dir,
                self.repo.clone(),
            )
        }
    }

    /// Runs the lessons stage once; returns `17-lessons.md`.
    async fn lessons(&self) -> Artifact {
        let run = self.run("lessons", self.content()).await;
        let effect = LessonsExecutor.execute(&run).await.unwrap();
        assert!(
            matches!(effect, StageEffect::Produced { outcome: None }),
            "{effect:?}"
        );
        let text = std::fs::read_to_string(self.artifact_dir().join(LESSONS_ARTIFACT)).unwrap();
        Artifact::parse(&text).unwrap()
    }

    fn lessons_file(&self) -> String {
        std::fs::read_to_string(self.worktree.join("LESSONS.md")).unwrap_or_default()
    }
}

/// The lesson kinds listed in `17-lessons.md`'s table, in order.
fn kinds(doc: &Artifact) -> Vec<String> {
    doc.body
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| #"))
        .filter_map(|l| l.split(" | ").nth(1).map(str::to_owned))
        .collect()
}

/// The one place the artifact-history table calls the lessons stage: `history` is committed
/// in order (file, status key and value, extra keys), then the stage runs.
async fn check(history: &[(&str, &[(&str, &str)])], want: &[&str]) {
    let fx = Fx::new("lessons").await;
    for (i, (file, keys)) in history.iter().enumerate() {
        let body = format!("\n## Findings (round {i})\n\nThe retry loop has no backoff.\n");
        fx.commit_artifact(file, keys, &body).await;
    }
    let doc = fx.lessons().await;
    let case = format!("{history:?}");
    assert_eq!(kinds(&doc), want, "{case}\n{}", doc.body);
    assert_eq!(
        doc.frontmatter.get("lessons_count"),
        Some(&Value::Int(i64::try_from(want.len()).unwrap())),
        "{case}"
    );
    if want.is_empty() {
        assert!(doc.body.contains("No incidents"), "{case}");
        assert_eq!(fx.lessons_file(), "", "{case}: nothing appended");
    } else {
        let entries = fx.lessons_file().matches(ENTRY_MARKER).count();
        assert_eq!(entries, want.len(), "{case}");
    }
}

#[tokio::test]
async fn objective_outcomes_in_the_artifact_history_become_lessons() {
    let r = "11-review.md";
    let t = "12-test-report.md";
    let m = "14-merge-log.md";
    let s = "15-staging-log.md";
    let p = "16-post-deploy-log.md";
    // A clean run: no incidents.
    check(
        &[
            (r, &[("review_status", "APPROVED")]),
            (t, &[("test_status", "PASSED")]),
            (m, &[("merge_status", "MERGED")]),
            (s, &[("staging_status", "SUCCESS")]),
            (
                p,
                &[("post_deploy_status", "HEALTHY"), ("action_taken", "none")],
            ),
        ],
        &[],
    )
    .await;
    // Rejected twice, then approved: both rejections count, though the file says APPROVED.
    check(
        &[
            (r, &[("review_status", "CHANGES_REQUESTED")]),
            (r, &[("review_status", "CHANGES_REQUESTED")]),
            (r, &[("review_status", "APPROVED")]),
        ],
        &["review_rejected", "review_rejected"],
    )
    .await;
    check(
        &[
            (t, &[("test_status", "FAILED")]),
            (t, &[("test_status", "PASSED")]),
        ],
        &["tests_failed"],
    )
    .await;
    check(&[(m, &[("merge_status", "CONFLICT")])], &["merge_conflict"]).await;
    check(
        &[(
            s,
            &[
                ("staging_status", "FAILED"),
                ("failure_kind", "smoke_failed"),
            ],
        )],
        &["staging_failed"],
    )
    .await;
    check(
        &[(
            s,
            &[
                ("staging_status", "FAILED"),
                ("failure_kind", "tool_error_exhausted"),
            ],
        )],
        &["retries_exhausted"],
    )
    .await;
    check(
        &[(
            p,
            &[
                ("post_deploy_status", "FAILED"),
                ("action_taken", "rollback"),
            ],
        )],
        &["rollback", "post_deploy_failed"],
    )
    .await;
    check(
        &[(
            p,
            &[
                ("post_deploy_status", "DEGRADED"),
                ("action_taken", "alert"),
            ],
        )],
        &["post_deploy_degraded"],
    )
    .await;
}

#[tokio::test]
async fn lessons_carry_provenance_and_are_appended_once() {
    let mut fx = Fx::new("lessons").await;
    fx.loops = 1;
    std::fs::write(
        fx.worktree.join("LESSONS.md"),
        "# Team lessons\n\n- keep it simple\n",
    )
    .unwrap();
    fx.commit("team lessons").await;
    fx.commit_artifact(
        "11-review.md",
        &[
            ("review_status", "CHANGES_REQUESTED"),
            ("created_at", "2026-03-01T10:00:00Z"),
        ],
        "\n# Review\n\nThe webhook retries without backoff.\n",
    )
    .await;
    fx.commit_artifact(
        "11-review.md",
        &[
            ("review_status", "APPROVED"),
            ("created_at", "2026-03-02T10:00:00Z"),
        ],
        "\nLooks good.\n",
    )
    .await;
    fx.commit_artifact(
        "15-staging-log.md",
        &[
            ("staging_status", "FAILED"),
            ("failure_kind", "smoke_failed"),
            ("reason", "smoke check `GET /pay` answered 502"),
            ("created_at", "2026-03-03T10:00:00Z"),
        ],
        "",
    )
    .await;
    // A job that exhausted its attempts, while the stage's own job is queued.
    fx.db
        .store
        .enqueue(NewJob::new("lessons", fx.content()).task(fx.task.id))
        .await
        .unwrap();
    let failed = fx
        .db
        .store
        .enqueue(
            NewJob::new("developer", fx.content())
                .task(fx.task.id)
                .max_attempts(1),
        )
        .await
        .unwrap()
        .job_id;
    let claimed = fx
        .db
        .store
        .claim(&Claim {
            worker_id: "w".into(),
            limit: 1,
            lease_ms: 60_000,
            kinds: vec!["developer".into()],
            node: None,
            node_grace_ms: None,
        })
        .await
        .unwrap();
    assert_eq!(claimed[0].job.id, failed);
    fx.db
        .store
        .mark_job(
            claimed[0].lease,
            JobOutcome::Failed {
                error: "agent timed out after 1800s".into(),
            },
            None,
        )
        .await
        .unwrap();
    let task = fx.db.store.get_task(fx.task.id).await.unwrap().unwrap();
    assert_eq!(
        task.stage, "lessons",
        "the task had another live job: not stranded"
    );

    let doc = fx.lessons().await;
    assert_eq!(
        kinds(&doc),
        [
            "review_rejected",
            "staging_failed",
            "retries_exhausted",
            "loop_back"
        ]
    );
    let fm = &doc.frontmatter;
    assert_eq!(fm.get_str("work_item"), Some(ITEM));
    assert_eq!(fm.get_str("stage"), Some("lessons"));
    assert_eq!(fm.get_str("author_agent"), Some("lessons"));
    assert_eq!(fm.get_str("model_used"), Some("n/a"));
    assert!(fm.get_str("created_at").is_some());
    assert_eq!(fm.get("lessons_count"), Some(&Value::Int(4)));

    let file = fx.lessons_file();
    assert!(
        file.starts_with("# Team lessons\n\n- keep it simple\n"),
        "kept:\n{file}"
    );
    assert!(
        file.contains(&format!("## {ITEM} — Retry the payment webhook")),
        "{file}"
    );
    let review =
        format!("{ENTRY_MARKER} {ITEM}/review_rejected/docs/work-items/{ITEM}/11-review.md#1 ");
    assert!(file.contains(&review), "{file}");
    assert!(
        file.contains(
            "2026-03-01 — review_status `CHANGES_REQUESTED`: The webhook retries without backoff."
        ),
        "{file}"
    );
    assert!(
        file.contains(&format!("(source: `docs/work-items/{ITEM}/11-review.md`)")),
        "{file}"
    );
    assert!(
        file.contains("smoke check `GET /pay` answered 502"),
        "{file}"
    );
    assert!(
        file.contains(&format!("(source: `job #{failed}`)")),
        "{file}"
    );
    assert!(file.contains("agent timed out after 1800s"), "{file}");

    // Re-run (a crash before the engine advanced): nothing appended twice.
    let doc2 = fx.lessons().await;
    assert_eq!(kinds(&doc2), kinds(&doc));
    assert_eq!(fx.lessons_file(), file, "idempotent");
    let recorded = fx
        .db
        .store
        .events_by_kind(events::LESSONS_RECORDED, 0, 10)
        .await
        .unwrap();
    assert_eq!(recorded.len(), 2);
    assert!(
        recorded[0].data.contains("\"appended\":4"),
        "{}",
        recorded[0].data
    );
    assert!(
        recorded[1].data.contains("\"appended\":0"),
        "{}",
        recorded[1].data
    );
}

#[tokio::test]
async fn a_finished_watch_is_cleaned_up_and_an_active_one_kept() {
    let fx = Fx::new("lessons").await;
    let ws = WatchState::new(&fx.repos_dir, "app", ITEM);
    assert_eq!(
        ws.arm(&ArmedRecord::new(Default::default(), 1, "abc1234")),
        ArmOutcome::Armed
    );
    fx.lessons().await;
    assert!(ws.dir().unwrap().exists(), "an active watch is not touched");
    assert!(ws.mark_done("HEALTHY"));
    fx.lessons().await;
    assert!(
        !ws.dir().unwrap().exists(),
        "done: removed (design.md §7 hygiene)"
    );
}

#[tokio::test]
async fn a_lessons_file_outside_the_repo_is_refused_but_17_is_written() {
    let mut fx = Fx::new("lessons").await;
    fx.repo.lessons_file = "../outside.md".into();
    fx.commit_artifact("12-test-report.md", &[("test_status", "FAILED")], "")
        .await;
    let doc = fx.lessons().await;
    assert_eq!(kinds(&doc), ["tests_failed"]);
    assert!(doc.body.contains("refused"), "{}", doc.body);
    assert!(!fx.repo_dir.join("worktrees/outside.md").exists());
}

// ---- the whole deploy tail -----------------------------------------------------------------

async fn serve(ctl: PathBuf) -> String {
    async fn health(State(ctl): State<Arc<PathBuf>>) -> StatusCode {
        match std::fs::read_to_string(ctl.join("health")) {
            Ok(code) => StatusCode::from_u16(code.trim().parse().unwrap_or(500))
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            Err(_) => StatusCode::OK,
        }
    }
    async fn revision(State(ctl): State<Arc<PathBuf>>) -> (StatusCode, String) {
        match std::fs::read_to_string(ctl.join("live_rev")) {
            Ok(rev) => (StatusCode::OK, rev),
            Err(_) => (StatusCode::NOT_FOUND, String::new()),
        }
    }
    let app = Router::new()
        .route("/health", get(health))
        .route("/revision", get(revision))
        .with_state(Arc::new(ctl));
    common::listen(app).await
}

/// Runs `exec` for the task's current stage as the engine would until it produces.
async fn drive(
    fx: &Fx,
    agent: &str,
    exec: &dyn StageExecutor,
    before: impl Fn(usize),
) -> StageEffect {
    let mut content = fx.content();
    for i in 0..50 {
        before(i);
        let run = fx.run(agent, content.clone()).await;
        match exec.execute(&run).await.unwrap() {
            StageEffect::Requeue {
                delay_ms, marker, ..
            } => {
                fx.db.clock.advance_ms(i64::try_from(delay_ms).unwrap());
                content = StageJob::from_content(&content)
                    .unwrap()
                    .with_marker(&marker);
            }
            StageEffect::Yield { marker, .. } => {
                content = StageJob::from_content(&content)
                    .unwrap()
                    .with_marker(&marker);
            }
            done => return done,
        }
    }
    panic!("{agent} did not finish");
}

fn touch(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[tokio::test]
async fn the_whole_tail_deploy_watch_rollback_lessons() {
    let mut fx = Fx::new("deploy").await;
    let ctl = fx._tmp.path().join("ctl");
    std::fs::create_dir_all(&ctl).unwrap();
    let base = serve(ctl.clone()).await;
    let c = ctl.display().to_string();
    fx.repo.deploy = Some(format!(
        "echo \"$ORCH_REVISION\" > {c}/live_rev; echo 500 > {c}/health"
    ));
    fx.repo.rollback = Some(format!(
        "echo previous0 > {c}/live_rev; rm -f {c}/health; echo \"$ORCH_REVISION\" > {c}/rolled_back"
    ));
    fx.repo.health_url = Some(format!("{base}/health"));
    fx.repo.revision_url = Some(format!("{base}/revision"));
    // The release train promoted the item's change to main (as the deploy stage does).
    let before = git_out(&fx.repo_dir, &["rev-parse", "main"]);
    std::fs::write(fx.repo_dir.join("feature.txt"), "the change\n").unwrap();
    git_out(&fx.repo_dir, &["add", "feature.txt"]);
    git_out(
        &fx.repo_dir,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "-m",
            "ORCH-3 change\n\nWork-Item: ORCH-3\nStage: implementation",
        ],
    );
    let merged = git_out(&fx.repo_dir, &["rev-parse", "main"]);
    for kind in ["release.staged", "release.promoted"] {
        fx.db
            .store
            .append_event(
                NewEvent::new(kind, "test")
                    .task(fx.task.id)
                    .data(
                        serde_json::json!({"repo": "app", "revision": merged, "old": before, "new": merged, "seq": fx.task.stage_seq})
                            .to_string(),
                    ),
            )
            .await
            .unwrap();
    }

    // deploy: the new revision answers 500 right after the deploy, then comes up.
    let health = ctl.join("health");
    let effect = drive(&fx, "deployer", &DeployerExecutor::default(), |i| {
        if i == 2 {
            let _ = std::fs::remove_file(&health);
        }
    })
    .await;
    assert!(
        matches!(&effect, StageEffect::Produced { outcome: Some(o) } if o.value().is_some()),
        "{effect:?}"
    );
    fx.advance("observe").await;

    // observe: the service breaks again → FAILED early → rollback, verified.
    touch(&health, "500");
    let monitor = MonitorExecutor {
        verify_polls: 3,
        verify_interval: Duration::from_millis(20),
    };
    let effect = drive(&fx, "post-deploy-monitor", &monitor, |_| {}).await;
    assert!(
        matches!(effect, StageEffect::Produced { outcome: None }),
        "{effect:?}"
    );
    assert_eq!(
        std::fs::read_to_string(ctl.join("rolled_back"))
            .unwrap()
            .trim(),
        merged
    );
    // The rolled-back change left main: a revert commit, recorded as 18-revert.md.
    let reverted = git_out(&fx.repo_dir, &["rev-parse", "main"]);
    assert_ne!(reverted, merged);
    assert!(
        git_out(&fx.repo_dir, &["log", "-1", "--format=%B", "main"])
            .contains("Orch-Revert: ORCH-3")
    );
    assert!(
        git_out(&fx.repo_dir, &["ls-tree", "--name-only", "main"])
            .lines()
            .all(|f| f != "feature.txt")
    );
    assert!(fx.artifact_dir().join("18-revert.md").is_file());
    assert_eq!(
        fx.db
            .store
            .events_by_kind("release.reverted", 0, 10)
            .await
            .unwrap()
            .len(),
        1
    );
    fx.commit("observe: post-deploy log").await; // the engine commits the stage's files
    fx.advance("lessons").await;

    // lessons: the rollback is a lesson with its provenance; the watch state is cleaned up.
    let doc = fx.lessons().await;
    assert_eq!(
        kinds(&doc),
        ["rollback", "post_deploy_failed"],
        "{}",
        doc.body
    );
    let file = fx.lessons_file();
    assert!(
        file.contains(&format!(
            "{ITEM}/rollback/docs/work-items/{ITEM}/16-post-deploy-log.md#1"
        )),
        "{file}"
    );
    assert!(file.contains("rolled back"), "{file}");
    assert!(
        WatchState::new(&fx.repos_dir, "app", ITEM)
            .dir()
            .is_some_and(|d| !d.exists())
    );
    let verdict = fx
        .db
        .store
        .events_by_kind(events::POST_DEPLOY_VERDICT, 0, 10)
        .await
        .unwrap();
    assert!(
        verdict[0].data.contains("\"action\":\"rollback\""),
        "{}",
        verdict[0].data
    );
}

/// `git -C dir args…`, its trimmed stdout (panics on failure: test plumbing).
fn git_out(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test]
async fn the_trail_and_lessons_reach_the_default_branch_in_one_commit() {
    let fx = Fx::new("lessons").await;
    let remote = fx.repos_dir.join("remote.git");
    git_out(
        &fx.repos_dir,
        &[
            "clone",
            "--quiet",
            "--bare",
            fx.repo_dir.to_str().unwrap(),
            remote.to_str().unwrap(),
        ],
    );
    git_out(
        &fx.repo_dir,
        &["remote", "add", "origin", remote.to_str().unwrap()],
    );
    fx.commit_artifact(
        "15-staging-log.md",
        &[
            ("staging_status", "FAILED"),
            ("reason", "smoke check `GET /pay` answered 502"),
            ("created_at", "2026-03-03T10:00:00Z"),
        ],
        "",
    )
    .await;
    git_out(&fx.repo_dir, &["push", "--quiet", "origin", "main"]);
    let main_before = git_out(&fx.repo_dir, &["rev-parse", "main"]);

    let doc = fx.lessons().await;
    assert!(
        doc.body.contains("appended to `LESSONS.md`"),
        "{}",
        doc.body
    );
    let recorded = fx
        .db
        .store
        .events_by_kind(events::LESSONS_RECORDED, 0, 10)
        .await
        .unwrap();
    assert!(
        recorded[0].message.contains("committed on `main`"),
        "{}",
        recorded[0].message
    );

    let on_main = git_out(&fx.repo_dir, &["show", "main:LESSONS.md"]);
    assert_eq!(on_main.matches(ENTRY_MARKER).count(), 1, "{on_main}");
    assert!(
        on_main.contains(&format!("{ITEM}/staging_failed/")),
        "{on_main}"
    );
    assert_eq!(
        git_out(&fx.repo_dir, &["rev-parse", "main^"]),
        main_before,
        "one commit on main"
    );
    // The item's trail and the lessons, in one commit, documents only.
    assert_eq!(
        git_out(&fx.repo_dir, &["show", "--name-only", "--format=", "main"]),
        format!(
            "LESSONS.md\ndocs/work-items/{ITEM}/15-staging-log.md\ndocs/work-items/{ITEM}/17-lessons.md"
        ),
    );
    assert!(git_out(&fx.repo_dir, &["log", "-1", "--format=%B", "main"]).contains("Stage: audit"));
    let main_after = git_out(&fx.repo_dir, &["rev-parse", "main"]);
    assert_eq!(
        git_out(&remote, &["rev-parse", "main"]),
        main_after,
        "pushed to the remote"
    );

    // A re-run publishes no lesson twice.
    let _again = fx.lessons().await;
    assert_eq!(
        git_out(&fx.repo_dir, &["show", "main:LESSONS.md"]),
        on_main,
        "the lessons file is unchanged"
    );
    assert_eq!(
        git_out(&fx.repo_dir, &["show", "main:LESSONS.md"])
            .matches(ENTRY_MARKER)
            .count(),
        1
    );
}

/// The revert of a rolled-back change goes through verification like a merge: the repo's test
/// command runs on exactly the revert commit; when it fails, nothing is published and the repo
/// holds with the reason. Tests that never finish (timed out) are no verdict: an error, which
/// the caller retries, and nothing published.
#[tokio::test]
async fn a_revert_is_verified_before_it_reaches_main() {
    #[derive(Debug, PartialEq)]
    enum Want {
        Reverted,
        Held,
        NoVerdict,
    }
    for (test, want) in [
        ("test ! -f feature.txt", Want::Reverted),
        ("test -f feature.txt", Want::Held),
        ("sleep 30", Want::NoVerdict),
    ] {
        let mut fx = Fx::new("observe").await;
        fx.repo.test = Some(test.into());
        fx.repo.test_timeout_s = 1;
        let before = git_out(&fx.repo_dir, &["rev-parse", "main"]);
        std::fs::write(fx.repo_dir.join("feature.txt"), "the change\n").unwrap();
        git_out(&fx.repo_dir, &["add", "feature.txt"]);
        git_out(
            &fx.repo_dir,
            &[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "-q",
                "-m",
                "change\n\nWork-Item: ORCH-3",
            ],
        );
        let merged = git_out(&fx.repo_dir, &["rev-parse", "main"]);
        common::record_promoted(&fx.db, &fx.task, &before, &merged).await;
        let run = fx.run("post-deploy-monitor", fx.content()).await;
        let got =
            orch_runner::release::revert(&run, "health failed", orch_runner::release::Step::Stay)
                .await;
        let main_now = git_out(&fx.repo_dir, &["rev-parse", "main"]);
        match (&want, got) {
            (Want::Reverted, Ok(orch_runner::release::Reverted::Reverted { .. })) => {
                assert_ne!(main_now, merged);
            }
            (Want::Held, Ok(orch_runner::release::Reverted::Held { reason })) => {
                assert!(reason.contains("fails verification"), "{reason}");
                assert_eq!(main_now, merged, "an unverified revert is not published");
            }
            (Want::NoVerdict, Err(e)) => {
                let e = format!("{e:#}");
                assert!(e.contains("timed out before it gave a verdict"), "{e}");
                assert_eq!(main_now, merged, "an unverified revert is not published");
            }
            (want, got) => panic!("`{test}`: wanted {want:?}, got {got:?}"),
        }
    }
}

/// A hold is fenced by the job's lease: an attempt whose job was rescued (its worker looked
/// dead) writes no `release.held`, and says so; the attempt that holds the job does.
#[tokio::test]
async fn an_attempt_that_lost_its_job_holds_nothing() {
    let fx = Fx::new("observe").await;
    let run = fx.run("post-deploy-monitor", fx.content()).await;
    fx.db.clock.advance_ms(11 * 60 * 1000);
    let rescued = fx
        .db
        .store
        .rescue_expired(orch_store::Rescue::default())
        .await
        .unwrap();
    assert_eq!(rescued.requeued, vec![run.lease.job_id]);
    let err = orch_runner::release::hold(&run, "the revert conflicts")
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("lease"), "{err:#}");
    let held = |events: Vec<orch_store::Event>| {
        events
            .into_iter()
            .filter(|e| e.kind == events::RELEASE_HELD)
            .count()
    };
    assert_eq!(held(fx.db.store.task_events(fx.task.id).await.unwrap()), 0);
    let next = fx.run("post-deploy-monitor", fx.content()).await;
    orch_runner::release::hold(&next, "the revert conflicts")
        .await
        .unwrap();
    assert_eq!(held(fx.db.store.task_events(fx.task.id).await.unwrap()), 1);
}

/// A revert an earlier attempt published on the default branch but died before recording
/// (the commit with its `Orch-Revert:` trailer is there, `release.reverted` is not): the next
/// attempt finds it, makes no second revert, and records it, once however often it runs.
#[tokio::test]
async fn a_published_revert_that_was_never_recorded_is_recorded_once() {
    let fx = Fx::new("observe").await;
    let before = git_out(&fx.repo_dir, &["rev-parse", "main"]);
    let commit = |file: &str, message: &str| {
        std::fs::write(fx.repo_dir.join(file), "x\n").unwrap();
        git_out(&fx.repo_dir, &["add", file]);
        git_out(
            &fx.repo_dir,
            &[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "-q",
                "-m",
                message,
            ],
        );
        git_out(&fx.repo_dir, &["rev-parse", "main"])
    };
    let merged = commit("feature.txt", "change\n\nWork-Item: ORCH-3");
    common::record_promoted(&fx.db, &fx.task, &before, &merged).await;
    let published = commit(
        "revert.txt",
        "Revert ORCH-3: the change\n\nWork-Item: ORCH-3\nOrch-Revert: ORCH-3",
    );
    let run = fx.run("post-deploy-monitor", fx.content()).await;
    for _ in 0..2 {
        let got =
            orch_runner::release::revert(&run, "health failed", orch_runner::release::Step::Stay)
                .await
                .unwrap();
        match got {
            orch_runner::release::Reverted::Reverted { commit } => assert_eq!(commit, published),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        git_out(&fx.repo_dir, &["rev-parse", "main"]),
        published,
        "no second revert"
    );
    let recorded = fx
        .db
        .store
        .task_events(fx.task.id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "release.reverted")
        .collect::<Vec<_>>();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert!(
        recorded[0].data.contains(&published),
        "{}",
        recorded[0].data
    );
}

/// The promotion moves the default branch, then records it (`release.promoted`). An attempt
/// whose lease is taken between the two (paused at `release.after_promote` while its job is
/// rescued) records nothing and fails there, never going on as if it had promoted; the job's
/// next attempt finds the move done (by the recorded intent) and records it, once. Every
/// release record is fenced the same way: the stale attempt cannot write `release.staged`
/// either.
async fn a_promotion_whose_lease_was_lost_before_its_record_is_recorded_by_the_retry(db: TestDb) {
    use orch_runner::failpoint::Gate;
    use orch_runner::release::{self, Promotion};
    let fx = Fx::on("deploy", db).await;
    let main = git_out(&fx.repo_dir, &["rev-parse", "main"]);
    let staged = git_out(
        &fx.repo_dir,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit-tree",
            "main^{tree}",
            "-p",
            "main",
            "-m",
            "the change\n\nWork-Item: ORCH-3",
        ],
    );
    let (job, lease) = common::enqueue(&fx.db, &fx.task, "deployer", fx.content()).await;
    let job_id = job.id;
    let run = fx.run_as(job, lease);
    release::record_staged(&run, &staged).await.unwrap();
    let seq = fx.task.stage_seq;
    let gate = Gate::register("release.after_promote", &fx.repo_dir.to_string_lossy());
    let (first, ()) = tokio::join!(release::promote(&run, seq), async {
        gate.reached().await;
        fx.db.clock.advance_ms(11 * 60 * 1000);
        let rescued = fx
            .db
            .store
            .rescue_expired(orch_store::Rescue::default())
            .await
            .unwrap();
        assert_eq!(rescued.requeued, vec![job_id]);
        gate.resume();
    });
    let err = first.expect_err("the stale attempt must fail, not report a promotion");
    assert!(format!("{err:#}").contains("lease"), "{err:#}");
    assert_eq!(
        git_out(&fx.repo_dir, &["rev-parse", "main"]),
        staged,
        "the move happened"
    );
    let promoted = || async {
        fx.db
            .store
            .task_events(fx.task.id)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == events::RELEASE_PROMOTED)
            .collect::<Vec<_>>()
    };
    assert!(
        promoted().await.is_empty(),
        "the stale attempt records nothing"
    );
    assert!(release::record_staged(&run, &staged).await.is_err());

    // The job's next attempt.
    let (job, lease) = common::first_lease(&fx.db, job_id).await;
    assert_eq!(lease.attempt, 2);
    let retry = fx.run_as(job, lease);
    for _ in 0..2 {
        let got = release::promote(&retry, seq).await.unwrap();
        assert_eq!(
            got,
            Promotion::Promoted {
                old: main.clone(),
                new: staged.clone()
            }
        );
    }
    let recorded = promoted().await;
    assert_eq!(recorded.len(), 1, "recorded once: {recorded:?}");
    let data: serde_json::Value = serde_json::from_str(&recorded[0].data).unwrap();
    assert_eq!(data["new"], staged.as_str());
    assert_eq!(data["old"], main.as_str());
    assert_eq!(data["seq"], seq);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_whose_lease_was_lost_before_its_record_is_recorded_by_the_retry_on_sqlite() {
    a_promotion_whose_lease_was_lost_before_its_record_is_recorded_by_the_retry(
        TestDb::sqlite().await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_whose_lease_was_lost_before_its_record_is_recorded_by_the_retry_on_postgres() {
    a_promotion_whose_lease_was_lost_before_its_record_is_recorded_by_the_retry(
        TestDb::postgres().await,
    )
    .await;
}
