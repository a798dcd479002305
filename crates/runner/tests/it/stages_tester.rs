//! The tester against real parts: a real git repo with a worktree on `orch/<id>`, a real SQLite
//! store, real `sh -c` test commands (passing, failing, hanging, missing), and every report
//! read back through the unchanged `parse_test_status` gate.

use crate::common;

use std::path::Path;
use std::sync::Arc;

use orch_domain::artifact::{Artifact, Value};
use orch_domain::config::RepoConfig;
use orch_domain::gate::{TestStatus, parse_test_status};
use orch_domain::staging::rfc3339_utc;
use orch_runner::counters::Counters;
use orch_runner::engine::{StageEffect, StageExecutor};
use orch_runner::stages::TesterExecutor;
use orch_store::testing::T0;

use common::{Fixture, ID};

fn repo_config(test: Option<&str>, test_timeout_s: u64) -> RepoConfig {
    RepoConfig {
        test: test.map(str::to_owned),
        test_timeout_s,
        ..common::repo_config("DEMO")
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
    let f = Fixture::new("verification", "tester", repo_config(Some(test), timeout_s)).await;
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
        let f = Fixture::new("verification", "tester", repo_config(test, 30)).await;
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
    let mut f = Fixture::new("verification", "tester", repo_config(Some("true"), 30)).await;
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

/// The gate judges what the branch commits: a file a stage left untracked, or one the repo's
/// `.gitignore` hides (a planted `sitecustomize.py`, a stale build), is gone before the tests
/// run, while committed files are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_the_branch_does_not_commit_are_removed_before_the_tests() {
    let test = "test -e committed.txt && test ! -e planted.txt && test ! -e cache/hit.log \
                && test ! -e .gitignore.d && echo only-committed";
    let f = Fixture::new("verification", "tester", repo_config(Some(test), 30)).await;
    let wt = &f.run.worktree;
    std::fs::write(wt.join("committed.txt"), "kept\n").unwrap();
    std::fs::write(wt.join(".gitignore"), "*.log\n").unwrap();
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@t"])
            .args(args)
            .current_dir(wt)
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {out:?}");
    };
    git(&["add", "committed.txt", ".gitignore"]);
    git(&["commit", "-qm", "the change"]);
    std::fs::write(wt.join("planted.txt"), "untracked\n").unwrap();
    std::fs::create_dir_all(wt.join("cache")).unwrap();
    std::fs::write(wt.join("cache/hit.log"), "ignored\n").unwrap();
    std::fs::create_dir_all(wt.join(".gitignore.d")).unwrap();

    let effect = TesterExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap();
    assert!(
        matches!(effect, StageEffect::Produced { outcome: None }),
        "{effect:?}"
    );
    let report = read(&f.run.artifact_path("12-test-report.md")).expect("report written");
    let gate = parse_test_status(Some(&report), &f.run.work_item);
    assert!(gate.is(TestStatus::Passed), "{gate:?}\n{report}");
    assert!(report.contains("only-committed"), "{report}");
    assert!(wt.join("committed.txt").exists());
    assert!(!wt.join("planted.txt").exists() && !wt.join("cache").exists());
}
