//! The tester against real parts: a real git repo with a worktree on `orch/<id>`, a real SQLite
//! store, real `sh -c` test commands (passing, failing, hanging, missing), and every report
//! read back through the unchanged `parse_test_status` gate.

use std::path::Path;
use std::sync::Arc;

use orch_domain::artifact::{Artifact, Value};
use orch_domain::config::{MergeStrategy, PostDeployConfig, RepoConfig, Settings};
use orch_domain::gate::{TestStatus, parse_test_status};
use orch_domain::ids::WorkItemId;
use orch_domain::pipeline::Pipeline;
use orch_domain::staging::rfc3339_utc;
use orch_exec::{Git, Pathspec};
use orch_runner::counters::Counters;
use orch_runner::engine::{StageEffect, StageExecutor, StageJob, StageRun};
use orch_runner::stages::TesterExecutor;
use orch_store::testing::{T0, TestDb};
use orch_store::{Claim, NewEvent, NewJob, NewTask, WorkItemSpec};
use tokio_util::sync::CancellationToken;

const ID: &str = "DEMO-1";

fn repo_config(test: Option<&str>, test_timeout_s: u64) -> RepoConfig {
    RepoConfig {
        path: None,
        url: None,
        default_branch: "main".into(),
        prefix: "DEMO".parse().unwrap(),
        test: test.map(str::to_owned),
        test_timeout_s,
        staging: vec![],
        staging_smoke: vec![],
        deploy: None,
        deploy_timeout_s: 900,
        rollback: None,
        health_url: None,
        revision_url: None,
        alert: None,
        alert_webhook: None,
        merge_strategy: MergeStrategy::Ff,
        post_deploy: PostDeployConfig::default(),
        staging_defer_limit: 2,
        staging_defer_delay_s: None,
        lessons_file: "LESSONS.md".into(),
    }
}

/// A store, a repo `demo` with one commit on `main`, a task `DEMO-1` at `stage` with a claimed
/// job of `agent`, and its worktree on `orch/DEMO-1`.
struct Fixture {
    _db: TestDb,
    _tmp: tempfile::TempDir,
    run: StageRun,
    counters: Arc<Counters>,
}

async fn fixture(stage: &str, agent: &str, repo: RepoConfig) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let repos_dir = tmp.path().join("repos");
    let repo_dir = repos_dir.join("demo");
    let git = Git::new();
    git.init_repo(&repo_dir, "main").await.unwrap();
    std::fs::write(repo_dir.join("README.md"), "demo\n").unwrap();
    git.add_and_commit(&repo_dir, &Pathspec::All, "init")
        .await
        .unwrap();

    let db = TestDb::sqlite().await;
    let store = db.store.clone();
    let content = StageJob {
        stage: stage.into(),
        seq: 0,
    }
    .to_content();
    let task = store
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact(ID.into()),
            repo: "demo".into(),
            title: "a change".into(),
            body: "body".into(),
            stage: stage.into(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.created", "created"),
            first_job: Some(NewJob::new(agent, content)),
        })
        .await
        .unwrap();
    let claimed = store
        .claim(&Claim {
            worker_id: "test".into(),
            limit: 1,
            lease_ms: 60_000,
            kinds: vec![agent.into()],
            node: None,
        })
        .await
        .unwrap()
        .pop()
        .unwrap();
    let worktree = repo_dir.join("worktrees").join(ID);
    git.worktree_add(&repo_dir, &worktree, &task.branch, "main")
        .await
        .unwrap();
    let work_item: WorkItemId = ID.parse().unwrap();
    let stage_def = Pipeline::default_pipeline()
        .stage(&stage.parse().unwrap())
        .unwrap()
        .clone();
    let counters = Arc::new(Counters::new());
    let run = StageRun {
        store,
        job: claimed.job,
        lease: claimed.lease,
        cancel: CancellationToken::new(),
        task,
        work_item: work_item.clone(),
        stage: stage_def,
        repo_name: "demo".parse().unwrap(),
        repo,
        settings: Settings::default(),
        repos_dir,
        repo_dir,
        artifact_dir: worktree.join(work_item.artifact_dir()),
        worktree,
        feedback: None,
        loops: 0,
        git,
        counters: counters.clone(),
        node: "test-node".into(),
    };
    Fixture {
        _db: db,
        _tmp: tmp,
        run,
        counters,
    }
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// What a tester run must produce.
struct Expect {
    status: TestStatus,
    exit: Value,
    reason: &'static str,
    output: &'static str,
}

/// Runs the tester with `test` under `timeout_s` and checks the effect, the report (through
/// the gate and key by key) and the counters.
async fn check(test: &str, timeout_s: u64, want: Expect) {
    let f = fixture("verification", "tester", repo_config(Some(test), timeout_s)).await;
    let tester = TesterExecutor::new(f.counters.clone());
    let effect = tester.execute(&f.run).await.unwrap();
    assert!(
        matches!(effect, StageEffect::Produced { outcome: None }),
        "{test}: {effect:?}"
    );
    let report = read(&f.run.artifact_path("12-test-report.md")).expect("report written");
    let gate = parse_test_status(Some(&report), &f.run.work_item);
    assert!(gate.is(want.status), "{test}: {gate:?}\n{report}");

    let fm = Artifact::parse(&report).unwrap().frontmatter;
    let s = |k: &str| fm.get_str(k).unwrap_or_default().to_owned();
    assert_eq!(s("work_item"), ID);
    assert_eq!(s("stage"), "verification");
    assert_eq!(s("author_agent"), "tester");
    assert_eq!(s("model_used"), "n/a");
    assert_eq!(s("created_at"), rfc3339_utc(T0));
    assert_eq!(s("command"), test);
    assert_eq!(fm.get("exit"), Some(&want.exit), "{test}\n{report}");
    assert!(matches!(fm.get("duration_ms"), Some(Value::Int(ms)) if *ms >= 0));
    assert!(s("reason").contains(want.reason), "{test}: {}", s("reason"));
    assert!(report.contains(want.output), "{test}: output\n{report}");

    let (passed, failed) = match want.status {
        TestStatus::Passed => (1, 0),
        TestStatus::Failed => (0, 1),
    };
    assert_eq!(f.counters.get("tester", "runs"), 1);
    assert_eq!(f.counters.get("tester", "passed"), passed);
    assert_eq!(f.counters.get("tester", "failed"), failed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passing_tests_are_passed() {
    check(
        "echo all good; test \"$ORCH_WORK_ITEM\" = DEMO-1 && test \"$ORCH_BRANCH\" = orch/DEMO-1",
        30,
        Expect {
            status: TestStatus::Passed,
            exit: Value::Int(0),
            reason: "passed",
            output: "all good",
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_tests_are_failed_with_their_output() {
    check(
        "echo 'assertion failed: 1 == 2' >&2; exit 3",
        30,
        Expect {
            status: TestStatus::Failed,
            exit: Value::Int(3),
            reason: "exit code 3",
            output: "assertion failed: 1 == 2",
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_tests_time_out_as_failed() {
    let started = std::time::Instant::now();
    check(
        "echo started; sleep 30",
        1,
        Expect {
            status: TestStatus::Failed,
            exit: Value::String("timed out".into()),
            reason: "timed out after 1 s",
            output: "started",
        },
    )
    .await;
    assert!(started.elapsed().as_secs() < 15, "the hang was killed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_test_tool_is_a_failed_report() {
    check(
        "no-such-tool-xyz --run",
        30,
        Expect {
            status: TestStatus::Failed,
            exit: Value::Int(127),
            reason: "not found",
            output: "no-such-tool-xyz",
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_test_killed_by_a_signal_is_failed() {
    check(
        "kill -9 $$",
        30,
        Expect {
            status: TestStatus::Failed,
            exit: Value::String("signal 9".into()),
            reason: "signal 9",
            output: "(no output)",
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_with_backticks_cannot_close_the_fence() {
    check(
        "printf 'before\\n```\\nafter\\n'",
        30,
        Expect {
            status: TestStatus::Passed,
            exit: Value::Int(0),
            reason: "passed",
            output: "````text\nbefore\n```\nafter\n````",
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_test_command_fails_the_stage_without_a_report() {
    for test in [None, Some("   ")] {
        let f = fixture("verification", "tester", repo_config(test, 30)).await;
        let tester = TesterExecutor::new(f.counters.clone());
        match tester.execute(&f.run).await.unwrap() {
            StageEffect::Failed { reason } => {
                assert_eq!(reason, "repo demo has no test command");
            }
            other => panic!("{test:?}: {other:?}"),
        }
        assert!(read(&f.run.artifact_path("12-test-report.md")).is_none());
        assert_eq!(f.counters.get("tester", "runs"), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_worktree_is_a_transient_error() {
    let mut f = fixture("verification", "tester", repo_config(Some("true"), 30)).await;
    f.run.worktree = f.run.repos_dir.join("gone");
    let tester = TesterExecutor::new(f.counters.clone());
    let err = tester.execute(&f.run).await.unwrap_err();
    assert!(format!("{err:#}").contains("gone"), "{err:#}");
    assert_eq!(f.counters.get("tester", "passed"), 0);
    assert_eq!(f.counters.get("tester", "failed"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_are_declared_at_zero() {
    let counters = Arc::new(Counters::new());
    let _tester = TesterExecutor::new(counters.clone());
    assert_eq!(
        counters.snapshot(),
        vec![(
            "tester".to_owned(),
            vec![
                ("failed".to_owned(), 0),
                ("passed".to_owned(), 0),
                ("runs".to_owned(), 0)
            ]
        )]
    );
}
