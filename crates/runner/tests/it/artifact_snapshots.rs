//! The exact text of the deterministic runners' artifacts: `15-staging-log.md` (rendered by
//! `orch_domain::staging::render_staging_log`), `12-test-report.md` (the tester) and
//! `14-merge-log.md` (the merge gate), compared with committed copies in `tests/snapshots/`.
//! The tester and the merge gate render privately, so they run for real (a real git repo, a
//! real command) on a store with a manual clock; the few values a real run cannot fix (commit
//! ids, durations) are masked before the comparison. Any change to an artifact's wording or
//! layout shows up in review as a change to a snapshot file.
//!
//! To accept an intended change: `ORCH_UPDATE_SNAPSHOTS=1 cargo test -p orch-runner --test it
//! artifact_snapshots::`.

use crate::common;

use std::path::{Path, PathBuf};

use orch_domain::config::RepoConfig;
use orch_domain::staging::{
    DeferPolicy, StagingEnvironment, StagingLog, StagingPlan, StepExit, StepResult, classify,
    decide_after, render_staging_log,
};
use orch_exec::Pathspec;
use orch_runner::engine::{StageEffect, StageExecutor};
use orch_runner::stages::{MergeGateExecutor, TesterExecutor};
use orch_store::testing::T0;

use common::{Fixture, ID};

/// Compares `actual` with `tests/snapshots/<name>`, or rewrites it under ORCH_UPDATE_SNAPSHOTS=1.
fn check(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name);
    if std::env::var("ORCH_UPDATE_SNAPSHOTS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if expected != actual {
        let first = expected
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
        panic!(
            "{name} differs from {} from line {}:\n--- committed\n{}\n+++ rendered\n{}\n\
             If the change is intended, run `ORCH_UPDATE_SNAPSHOTS=1 cargo test -p orch-runner \
             --test it artifact_snapshots::` and commit the snapshot.",
            path.display(),
            first + 1,
            expected
                .lines()
                .skip(first)
                .take(8)
                .collect::<Vec<_>>()
                .join("\n"),
            actual
                .lines()
                .skip(first)
                .take(8)
                .collect::<Vec<_>>()
                .join("\n"),
        );
    }
}

/// Masks what a real run cannot fix: commit ids (7 to 40 lowercase hex digits standing alone;
/// no word of these artifacts' fixed text is one) and
/// durations (`duration_ms: N`, `- duration: …`, `(12 ms)`, `(1.250 s)`).
fn mask(text: &str) -> String {
    // YAML quotes an id that happens to read as a number (`"1234e56"`); the mask has no quotes.
    mask_durations(&mask_ids(text)).replace(": \"<sha>\"\n", ": <sha>\n")
}

/// `(12 ms)` and `(1.250 s)` → `(<duration>)`.
fn mask_durations(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('(') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let digits = after
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(after.len());
        let unit = [" ms)", " s)"]
            .into_iter()
            .find(|u| digits > 0 && after[digits..].starts_with(u));
        match unit {
            Some(u) => {
                out.push_str("(<duration>)");
                rest = &after[digits + u.len()..];
            }
            None => {
                out.push('(');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

fn mask_ids(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        if trimmed.starts_with("duration_ms: ") {
            out.push_str("duration_ms: <ms>\n");
            continue;
        }
        if trimmed.starts_with("- duration: ") {
            out.push_str("- duration: <duration>\n");
            continue;
        }
        let mut word = String::new();
        for ch in line.chars() {
            if ch.is_ascii_alphanumeric() {
                word.push(ch);
                continue;
            }
            out.push_str(&mask_word(&word));
            word.clear();
            out.push(ch);
        }
        out.push_str(&mask_word(&word));
    }
    out
}

fn mask_word(w: &str) -> String {
    let hex = w
        .chars()
        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase());
    if hex && (7..=40).contains(&w.len()) {
        "<sha>".to_owned()
    } else {
        w.to_owned()
    }
}

fn step(name: &str, command: &str, exit: StepExit, tail: &str, smoke: bool) -> StepResult {
    StepResult {
        name: name.into(),
        command: command.into(),
        exit,
        duration_ms: 1_250,
        output_tail: tail.into(),
        is_smoke: smoke,
    }
}

/// Renders a staging log from steps, the way the staging runner does (classify, decide).
fn staging_log(steps: &[StepResult], defers: u32) -> String {
    let plan = StagingPlan {
        step_names: steps.iter().map(|s| s.name.clone()).collect(),
    };
    let c = classify(steps, &plan);
    let decision = decide_after(&c, defers, &DeferPolicy::default());
    let outcome = decision
        .outcome(&c)
        .expect("a final decision (not a defer) has an outcome");
    let environment = StagingEnvironment {
        name: "staging".into(),
        url: Some("http://127.0.0.1:8081".into()),
        branch: "orch/DEMO-1".into(),
        revision: Some("0123456789abcdef0123456789abcdef01234567".into()),
    };
    render_staging_log(&StagingLog {
        looks: &[],
        work_item: ID,
        created_at_ms: T0,
        attempt: defers + 1,
        environment: &environment,
        steps,
        classification: &c,
        outcome: &outcome,
    })
}

#[test]
fn staging_log_success() {
    let steps = [
        step(
            "build",
            "make build",
            StepExit::Exited(0),
            "built 3 targets\n",
            false,
        ),
        step(
            "deploy-staging",
            "sh deploy.sh staging",
            StepExit::Exited(0),
            "deployed\n",
            false,
        ),
        step(
            "health",
            "sh smoke.sh 8081",
            StepExit::Exited(0),
            "200 OK\n",
            true,
        ),
    ];
    check("15-staging-log.success.md", &staging_log(&steps, 0));
}

#[test]
fn staging_log_failed_after_the_last_defer() {
    let steps = [step(
        "build",
        "no-such-tool-xyz -q",
        StepExit::Exited(127),
        "sh: 1: no-such-tool-xyz: not found\n",
        false,
    )];
    check(
        "15-staging-log.tool-error-exhausted.md",
        &staging_log(&steps, 2),
    );
}

#[test]
fn staging_log_failed_smoke() {
    let steps = [
        step("build", "make build", StepExit::Exited(0), "built\n", false),
        step(
            "health",
            "sh smoke.sh 8081",
            StepExit::Exited(1),
            "503 | `x`\n",
            true,
        ),
    ];
    check("15-staging-log.smoke-failed.md", &staging_log(&steps, 0));
}

fn repo_config(test: Option<&str>) -> RepoConfig {
    RepoConfig {
        test: test.map(str::to_owned),
        test_timeout_s: 30,
        ..common::repo_config("DEMO")
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_report_passed() {
    let f = Fixture::new(
        "verification",
        "tester",
        repo_config(Some("printf 'Ran 3 tests\\n\\nOK\\n'")),
    )
    .await;
    let effect = TesterExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap();
    assert!(matches!(effect, StageEffect::Produced { .. }), "{effect:?}");
    let report = read(&f.run.artifact_path("12-test-report.md"));
    check("12-test-report.passed.md", &mask(&report));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_report_failed() {
    let f = Fixture::new(
        "verification",
        "tester",
        repo_config(Some("echo 'FAIL: test_health' >&2; exit 3")),
    )
    .await;
    let effect = TesterExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap();
    assert!(matches!(effect, StageEffect::Produced { .. }), "{effect:?}");
    let report = read(&f.run.artifact_path("12-test-report.md"));
    check("12-test-report.failed.md", &mask(&report));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_log_merged() {
    let f = Fixture::new("merge", "merge-gate", repo_config(Some("echo verified"))).await;
    std::fs::write(f.run.worktree.join("feature.txt"), "a feature\n").unwrap();
    f.run
        .git
        .add_and_commit(&f.run.worktree, &Pathspec::All, "add a feature")
        .await
        .unwrap();
    let effect = MergeGateExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap();
    assert!(matches!(effect, StageEffect::Produced { .. }), "{effect:?}");
    let log = read(&f.run.artifact_path("14-merge-log.md"));
    check("14-merge-log.merged.md", &mask(&log));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_log_conflict() {
    let f = Fixture::new("merge", "merge-gate", repo_config(Some("echo verified"))).await;
    std::fs::write(f.run.worktree.join("README.md"), "the branch's readme\n").unwrap();
    f.run
        .git
        .add_and_commit(&f.run.worktree, &Pathspec::All, "branch edits the readme")
        .await
        .unwrap();
    std::fs::write(f.run.repo_dir.join("README.md"), "main's readme\n").unwrap();
    f.run
        .git
        .add_and_commit(&f.run.repo_dir, &Pathspec::All, "main edits the readme")
        .await
        .unwrap();
    let effect = MergeGateExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap();
    assert!(matches!(effect, StageEffect::Produced { .. }), "{effect:?}");
    let log = read(&f.run.artifact_path("14-merge-log.md"));
    check("14-merge-log.conflict.md", &mask(&log));
}

#[test]
fn mask_hides_commit_ids_and_durations_only() {
    let cases = [
        ("merged `0123abc` into main\n", "merged `<sha>` into main\n"),
        ("duration_ms: 17\n", "duration_ms: <ms>\n"),
        ("merged_revision: \"1234e56\"\n", "merged_revision: <sha>\n"),
        ("- duration: 1.250 s\n", "- duration: <duration>\n"),
        ("added feedbac 1234567\n", "added <sha> <sha>\n"),
        ("as abcdefa, not abcdef\n", "as <sha>, not abcdef\n"),
        (
            "passed (1 ms), (2.500 s); (x) (3 days)\n",
            "passed (<duration>), (<duration>); (x) (3 days)\n",
        ),
    ];
    for (input, want) in cases {
        assert_eq!(mask(input), want, "{input:?}");
    }
}
