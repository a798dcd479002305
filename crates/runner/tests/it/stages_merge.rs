//! The merge gate against real parts: real git repos (orch's clone with a detached `HEAD`, a
//! worktree on `orch/<id>`, a bare remote), a real SQLite store whose jobs queue counts the
//! infrastructure retries, real verification commands, and every `14-merge-log.md` read back
//! through the unchanged `parse_merge_status` gate.
//!
//! The gate builds a *candidate* (the item's branch brought up to date with the default branch)
//! in the item's worktree and verifies it; it never moves the default branch (that is the
//! deploy's promotion) and never pushes anything.

use crate::common;

use std::path::Path;
use std::sync::Arc;

use orch_domain::artifact::{Artifact, Frontmatter, Value};
use orch_domain::config::{MergeStrategy, RepoConfig};
use orch_domain::control::markers;
use orch_domain::gate::{MergeStatus, parse_merge_status};
use orch_domain::staging::rfc3339_utc;
use orch_exec::{Cmd, Git, Pathspec};
use orch_runner::counters::Counters;
use orch_runner::engine::{StageEffect, StageExecutor, StageJob, StageRun};
use orch_runner::stages::MergeGateExecutor;
use orch_runner::stages::merge_gate::INFRA_RETRY_LIMIT;
use orch_store::testing::T0;
use orch_store::{NewEvent, NewJob, NewTask, WorkItemSpec};

use common::{Fixture, ID};

/// Runs git directly (test setup and inspection that `Git` has no operation for).
async fn sh_git(dir: &Path, args: &[&str]) -> String {
    let out = orch_exec::run(&Cmd::new("git").args(args).cwd(dir))
        .await
        .unwrap();
    assert!(out.success(), "git {args:?}: {}", out.tail_text(20));
    out.stdout_lossy()
}

fn repo_config(test: Option<&str>, merge_strategy: MergeStrategy) -> RepoConfig {
    RepoConfig {
        test: test.map(str::to_owned),
        merge_strategy,
        ..common::repo_config("DEMO")
    }
}

/// orch's clone as production keeps it: `HEAD` detached, branches moved only by ref updates.
async fn detach(f: &Fixture) {
    f.run.git.detach_head(&f.run.repo_dir).await.unwrap();
    assert_eq!(
        f.run.git.current_branch(&f.run.repo_dir).await.unwrap(),
        None
    );
}

/// The shared fixture (a local repo without a remote), orch's clone detached.
async fn fixture(repo: RepoConfig) -> Fixture {
    let f = Fixture::new("merge", "merge-gate", repo).await;
    detach(&f).await;
    f
}

/// Where the bare remote of [`fixture_with_remote`] lives.
fn origin_dir(f: &Fixture) -> std::path::PathBuf {
    f.tmp.path().join("origin.git")
}

/// The shared fixture over orch's clone of a bare `origin` (detached like in production).
async fn fixture_with_remote(repo: RepoConfig) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let repo_dir = Fixture::repo_dir_in(&tmp);
    let git = Git::new();
    let seed = tmp.path().join("upstream");
    common::init_repo(&git, &seed, "demo\n").await;
    let bare = tmp.path().join("origin.git");
    sh_git(
        tmp.path(),
        &[
            "clone",
            "--quiet",
            "--bare",
            seed.to_str().unwrap(),
            bare.to_str().unwrap(),
        ],
    )
    .await;
    git.clone_repo(bare.to_str().unwrap(), &repo_dir)
        .await
        .unwrap();
    let f = Fixture::in_repo(tmp, "merge", "merge-gate", repo).await;
    detach(&f).await;
    f
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// Writes `file` with `content` in `dir` and commits it; returns the new commit.
async fn commit(git: &Git, dir: &Path, file: &str, content: &str) -> String {
    std::fs::write(dir.join(file), content).unwrap();
    git.add_and_commit(dir, &Pathspec::All, &format!("change {file}"))
        .await
        .unwrap()
        .unwrap()
}

async fn rev(f: &Fixture, dir: &Path, name: &str) -> Option<String> {
    f.run.git.rev_parse(dir, name).await.unwrap()
}

async fn head(f: &Fixture, dir: &Path) -> String {
    rev(f, dir, "HEAD").await.unwrap()
}

/// Where the local default branch of orch's clone is.
async fn main_of(f: &Fixture) -> String {
    rev(f, &f.run.repo_dir, "refs/heads/main").await.unwrap()
}

/// Moves `main` of orch's clone forward by a commit adding `file`, the way the release train
/// moves it (a commit built without a working tree, a compare-and-swap of the ref); returns
/// the new commit.
async fn advance_main(f: &Fixture, file: &str, content: &str) -> String {
    let git = &f.run.git;
    let old = main_of(f).await;
    let new = git
        .commit_files_onto(
            &f.run.repo_dir,
            &old,
            &[(file.to_owned(), content.as_bytes().to_vec())],
            &format!("main: {file}"),
        )
        .await
        .unwrap();
    git.update_branch(&f.run.repo_dir, "main", &new, Some(&old))
        .await
        .unwrap();
    new
}

async fn is_ancestor(f: &Fixture, a: &str, b: &str) -> bool {
    f.run.git.is_ancestor(&f.run.repo_dir, a, b).await.unwrap()
}

/// The commit's parents, in order.
async fn parents(f: &Fixture, commit: &str) -> Vec<String> {
    sh_git(
        &f.run.repo_dir,
        &["rev-list", "--parents", "--max-count=1", commit],
    )
    .await
    .split_whitespace()
    .skip(1)
    .map(str::to_owned)
    .collect()
}

/// Runs the merge gate once.
async fn execute(f: &Fixture) -> StageEffect {
    MergeGateExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap()
}

/// Checks that the effect is `Produced` and the log of `run` says `status` with
/// `failure_kind`, `conflicts` and a reason containing `reason`, through the gate and key by
/// key; returns the frontmatter.
fn check_run(
    run: &StageRun,
    effect: &StageEffect,
    status: MergeStatus,
    failure_kind: &str,
    conflicts: &[&str],
    reason: &str,
) -> Frontmatter {
    assert!(
        matches!(effect, StageEffect::Produced { outcome: None }),
        "{effect:?}"
    );
    let log = read(&run.artifact_path("14-merge-log.md")).expect("merge log written");
    let gate = parse_merge_status(Some(&log), &run.work_item);
    assert!(gate.is(status), "{gate:?}\n{log}");
    let fm = Artifact::parse(&log).unwrap().frontmatter;
    let s = |k: &str| fm.get_str(k).unwrap_or_default().to_owned();
    assert_eq!(s("work_item"), run.work_item.as_str());
    assert_eq!(s("stage"), "merge");
    assert_eq!(s("author_agent"), "merge-gate");
    assert_eq!(s("model_used"), "n/a");
    assert_eq!(s("created_at"), rfc3339_utc(T0));
    assert_eq!(s("failure_kind"), failure_kind, "{log}");
    let want: Vec<Value> = conflicts
        .iter()
        .map(|c| Value::String((*c).into()))
        .collect();
    assert_eq!(fm.get("conflicts"), Some(&Value::Seq(want)), "{log}");
    assert!(s("reason").contains(reason), "{}\n{log}", s("reason"));
    fm
}

/// [`check_run`] for the fixture's own run.
fn check(
    f: &Fixture,
    effect: &StageEffect,
    status: MergeStatus,
    failure_kind: &str,
    conflicts: &[&str],
    reason: &str,
) -> Frontmatter {
    assert_eq!(f.run.work_item.as_str(), ID);
    check_run(&f.run, effect, status, failure_kind, conflicts, reason)
}

/// The fixture's merge log.
fn merge_log(f: &Fixture) -> String {
    read(&f.run.artifact_path("14-merge-log.md")).expect("merge log written")
}

/// The merge gate counters `(merged, conflict, failed, infra_retry)`.
fn counters(f: &Fixture) -> (u64, u64, u64, u64) {
    let c = |n: &str| f.counters.get("merge_gate", n);
    (c("merged"), c("conflict"), c("failed"), c("infra_retry"))
}

/// Files changed in the worktree other than the work item's artifacts.
async fn dirty_outside_artifacts(f: &Fixture) -> Vec<String> {
    f.run
        .git
        .changed_files_outside(&f.run.worktree, &f.run.work_item.artifact_dir())
        .await
        .unwrap()
}

/// orch's clone is still detached at `at` (the gate never checks anything out there).
async fn assert_clone_untouched(f: &Fixture, at: &str) {
    assert_eq!(
        f.run.git.current_branch(&f.run.repo_dir).await.unwrap(),
        None,
        "orch's clone stays detached"
    );
    assert_eq!(head(f, &f.run.repo_dir).await, at, "orch's clone HEAD");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_forward_candidate_when_main_did_not_move() {
    let f = fixture(repo_config(Some("test -f feature.txt"), MergeStrategy::Ff)).await;
    let main_before = main_of(&f).await;
    let branch_head = commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    let effect = execute(&f).await;
    let fm = check(
        &f,
        &effect,
        MergeStatus::Merged,
        "none",
        &[],
        "into the verified candidate",
    );
    // The candidate is the branch as it is: nothing to bring up to date.
    assert_eq!(fm.get_str("merged_revision"), Some(branch_head.as_str()));
    assert_eq!(head(&f, &f.run.worktree).await, branch_head);
    assert_eq!(fm.get_str("strategy"), Some("ff"));
    assert_eq!(fm.get("infra_retries"), Some(&Value::Int(0)));
    let log = merge_log(&f);
    assert!(log.contains("is up to date with `main`"), "{log}");
    assert!(log.contains("- test_status: `PASSED`"), "{log}");
    // The default branch does not move here.
    assert_eq!(main_of(&f).await, main_before, "main unchanged");
    assert_clone_untouched(&f, &main_before).await;
    assert!(!f.run.repo_dir.join("feature.txt").exists());
    assert_eq!(counters(&f), (1, 0, 0, 0));
    assert_eq!(f.counters.get("merge_gate", "runs"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn candidate_after_bringing_the_branch_up_to_date() {
    let f = fixture(repo_config(
        Some("test -f other.txt && test -f feature.txt"),
        MergeStrategy::Ff,
    ))
    .await;
    let clone_head = head(&f, &f.run.repo_dir).await;
    let branch_head = commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    let main = advance_main(&f, "other.txt", "y\n").await;
    let effect = execute(&f).await;
    let fm = check(
        &f,
        &effect,
        MergeStatus::Merged,
        "none",
        &[],
        "into the verified candidate",
    );
    let candidate = head(&f, &f.run.worktree).await;
    assert_eq!(fm.get_str("merged_revision"), Some(candidate.as_str()));
    assert_ne!(candidate, branch_head, "the branch was brought up to date");
    assert_ne!(candidate, main);
    assert!(
        is_ancestor(&f, &main, &candidate).await,
        "candidate has main"
    );
    assert!(
        is_ancestor(&f, &branch_head, &candidate).await,
        "candidate has the branch"
    );
    assert_eq!(
        rev(&f, &f.run.repo_dir, "refs/heads/orch/DEMO-1").await,
        Some(candidate.clone()),
        "the candidate is the item branch"
    );
    for file in ["other.txt", "feature.txt"] {
        assert!(
            f.run.worktree.join(file).exists(),
            "{file} in the candidate"
        );
    }
    assert!(
        dirty_outside_artifacts(&f).await.is_empty(),
        "worktree clean"
    );
    let log = merge_log(&f);
    assert!(log.contains("merged `main` into `orch/DEMO-1`"), "{log}");
    assert!(log.contains("- test_status: `PASSED`"), "{log}");
    assert_eq!(main_of(&f).await, main, "main unchanged");
    assert_clone_untouched(&f, &clone_head).await;
    assert_eq!(counters(&f), (1, 0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_strategy_candidate_is_a_merge_commit_on_top_of_main() {
    for main_moves in [false, true] {
        let f = fixture(repo_config(
            Some("test -f feature.txt"),
            MergeStrategy::Merge,
        ))
        .await;
        let branch_head = commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
        let main = if main_moves {
            advance_main(&f, "other.txt", "y\n").await
        } else {
            main_of(&f).await
        };
        let effect = execute(&f).await;
        let fm = check(
            &f,
            &effect,
            MergeStatus::Merged,
            "none",
            &[],
            "into the verified candidate",
        );
        assert_eq!(fm.get_str("strategy"), Some("merge"));
        let candidate = head(&f, &f.run.worktree).await;
        assert_eq!(fm.get_str("merged_revision"), Some(candidate.as_str()));
        assert_eq!(
            parents(&f, &candidate).await,
            [main.clone(), branch_head.clone()],
            "main moved: {main_moves}: first parent main, second the old branch head"
        );
        assert_eq!(
            rev(&f, &f.run.repo_dir, "refs/heads/orch/DEMO-1").await,
            Some(candidate.clone())
        );
        assert!(f.run.worktree.join("feature.txt").exists());
        assert_eq!(f.run.worktree.join("other.txt").exists(), main_moves);
        assert!(
            dirty_outside_artifacts(&f).await.is_empty(),
            "worktree clean"
        );
        assert_eq!(main_of(&f).await, main, "main unchanged");
        assert_eq!(counters(&f), (1, 0, 0, 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_lists_its_files_and_leaves_main_the_worktree_and_the_branch_as_before() {
    for strategy in [MergeStrategy::Ff, MergeStrategy::Merge] {
        let f = fixture(repo_config(
            Some("echo verified >> ../verified.log"),
            strategy,
        ))
        .await;
        let clone_head = head(&f, &f.run.repo_dir).await;
        commit(&f.run.git, &f.run.worktree, "README.md", "branch\n").await;
        let branch_tip = commit(&f.run.git, &f.run.worktree, "notes.txt", "n\n").await;
        let main = advance_main(&f, "README.md", "main\n").await;
        let effect = execute(&f).await;
        let fm = check(
            &f,
            &effect,
            MergeStatus::Conflict,
            "conflict",
            &["README.md"],
            "conflicts with `main` in 1 file(s): README.md",
        );
        assert_eq!(fm.get_str("merged_revision"), Some("none"));
        assert_eq!(main_of(&f).await, main, "main untouched");
        assert_clone_untouched(&f, &clone_head).await;
        assert_eq!(
            head(&f, &f.run.worktree).await,
            branch_tip,
            "the branch is as before: no merge commit"
        );
        assert_eq!(
            f.run.git.current_branch(&f.run.worktree).await.unwrap(),
            Some("orch/DEMO-1".to_owned())
        );
        assert_eq!(rev(&f, &f.run.worktree, "MERGE_HEAD").await, None);
        assert!(
            dirty_outside_artifacts(&f).await.is_empty(),
            "worktree clean"
        );
        assert_eq!(
            std::fs::read_to_string(f.run.worktree.join("README.md")).unwrap(),
            "branch\n"
        );
        assert!(f.run.worktree.join("notes.txt").exists());
        assert!(
            !f.run
                .worktree
                .parent()
                .unwrap()
                .join("verified.log")
                .exists(),
            "nothing verified"
        );
        let log = merge_log(&f);
        assert!(log.contains("- `README.md`"), "{log}");
        assert_eq!(counters(&f), (0, 1, 0, 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verification_failing_on_the_candidate_is_failed() {
    // Passes on the branch alone and on main alone; fails only on the candidate with both.
    let test = "if [ -f a.txt ] && [ -f b.txt ]; then echo 'a and b clash' >&2; exit 1; fi";
    let f = fixture(repo_config(Some(test), MergeStrategy::Ff)).await;
    let clone_head = head(&f, &f.run.repo_dir).await;
    let branch_head = commit(&f.run.git, &f.run.worktree, "b.txt", "b\n").await;
    let main = advance_main(&f, "a.txt", "a\n").await;
    let effect = execute(&f).await;
    let fm = check(
        &f,
        &effect,
        MergeStatus::Failed,
        "verification_failed",
        &[],
        "exit code 1",
    );
    assert_eq!(fm.get_str("merged_revision"), Some("none"));
    assert!(
        fm.get_str("reason")
            .unwrap()
            .contains("verification failed on `orch/DEMO-1` brought up to date with `main`"),
        "{fm:?}"
    );
    let candidate = head(&f, &f.run.worktree).await;
    assert!(
        is_ancestor(&f, &main, &candidate).await,
        "verified the candidate"
    );
    assert!(is_ancestor(&f, &branch_head, &candidate).await);
    assert_eq!(main_of(&f).await, main, "main untouched");
    assert_clone_untouched(&f, &clone_head).await;
    let log = merge_log(&f);
    assert!(log.contains("a and b clash"), "{log}");
    assert!(log.contains("- test_status: `FAILED`"), "{log}");
    assert_eq!(counters(&f), (0, 0, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_when_the_branch_is_already_in_main_reports_merged_without_building_anything() {
    for strategy in [MergeStrategy::Ff, MergeStrategy::Merge] {
        let f = fixture(repo_config(
            Some("echo verified >> ../verified.log"),
            strategy,
        ))
        .await;
        commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
        advance_main(&f, "other.txt", "y\n").await;
        let effect = execute(&f).await;
        check(
            &f,
            &effect,
            MergeStatus::Merged,
            "none",
            &[],
            "into the verified candidate",
        );
        // The engine commits the log on the branch; staging stages that commit and the deploy
        // promotes it: main moves to exactly it.
        let staged = f
            .run
            .git
            .add_and_commit(&f.run.worktree, &Pathspec::All, "merge log")
            .await
            .unwrap()
            .unwrap();
        let old_main = main_of(&f).await;
        f.run
            .git
            .update_branch(&f.run.repo_dir, "main", &staged, Some(&old_main))
            .await
            .unwrap();
        // A crash before the stage changed: the same job runs again.
        let effect = execute(&f).await;
        let fm = check(
            &f,
            &effect,
            MergeStatus::Merged,
            "none",
            &[],
            "is already contained in `main`",
        );
        assert_eq!(fm.get_str("merged_revision"), Some(staged.as_str()));
        assert_eq!(head(&f, &f.run.worktree).await, staged, "nothing built");
        assert_eq!(main_of(&f).await, staged, "main unchanged");
        let log = merge_log(&f);
        assert!(log.contains("nothing to merge"), "{log}");
        assert!(log.contains("## Verification\n\nnot run"), "{log}");
        let verified =
            std::fs::read_to_string(f.run.worktree.parent().unwrap().join("verified.log")).unwrap();
        assert_eq!(verified.lines().count(), 1, "verified once");
        assert_eq!(counters(&f), (2, 0, 0, 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_remote_main_is_synced_to_it_first_and_nothing_is_pushed() {
    let f = fixture_with_remote(repo_config(
        Some("test -f upstream.txt && test -f feature.txt"),
        MergeStrategy::Ff,
    ))
    .await;
    let clone_head = head(&f, &f.run.repo_dir).await;
    let bare = origin_dir(&f);
    let branch_head = commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    // Someone else pushed to origin meanwhile: orch's main is behind and is fast-forwarded.
    let other = f.tmp.path().join("other");
    f.run
        .git
        .clone_repo(bare.to_str().unwrap(), &other)
        .await
        .unwrap();
    let upstream = commit(&f.run.git, &other, "upstream.txt", "u\n").await;
    f.run.git.push(&other, "origin", "main").await.unwrap();

    let effect = execute(&f).await;
    let fm = check(
        &f,
        &effect,
        MergeStatus::Merged,
        "none",
        &[],
        "into the verified candidate",
    );
    assert_eq!(
        main_of(&f).await,
        upstream,
        "local main fast-forwarded to the remote's"
    );
    let candidate = head(&f, &f.run.worktree).await;
    assert_eq!(fm.get_str("merged_revision"), Some(candidate.as_str()));
    assert!(is_ancestor(&f, &upstream, &candidate).await);
    assert!(is_ancestor(&f, &branch_head, &candidate).await);
    // Nothing was pushed: the remote's main is what the other clone pushed, and it has no
    // other branch.
    let remote_main = sh_git(&bare, &["rev-parse", "refs/heads/main"]).await;
    assert_eq!(remote_main.trim(), upstream, "nothing pushed to main");
    let remote_refs = sh_git(&bare, &["for-each-ref", "--format=%(refname)"]).await;
    assert_eq!(
        remote_refs.trim(),
        "refs/heads/main",
        "nothing pushed at all"
    );
    assert_clone_untouched(&f, &clone_head).await;
    assert_eq!(counters(&f), (1, 0, 0, 0));
}

/// orch's main and the remote's diverged (the remote was rewritten while orch held a release it
/// had not published): orch never drops a released commit by itself; it is an infrastructure
/// error naming both, retried, and main is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_main_diverged_from_the_remote_is_never_reset_silently() {
    let f = fixture_with_remote(repo_config(Some("true"), MergeStrategy::Ff)).await;
    let bare = origin_dir(&f);
    commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    let other = f.tmp.path().join("other");
    f.run
        .git
        .clone_repo(bare.to_str().unwrap(), &other)
        .await
        .unwrap();
    commit(&f.run.git, &other, "upstream.txt", "u\n").await;
    f.run.git.push(&other, "origin", "main").await.unwrap();
    let local = advance_main(&f, "local.txt", "l\n").await;

    match execute(&f).await {
        StageEffect::Requeue { reason, .. } => {
            assert!(reason.contains("diverged"), "{reason}")
        }
        other => panic!("expected an infrastructure retry, got {other:?}"),
    }
    assert_eq!(main_of(&f).await, local, "orch's main is left as it was");
}

/// Enqueues `n` merge-gate jobs carrying the retry marker of stage visit `seq`, as earlier
/// infrastructure retries would have.
async fn earlier_retries(f: &Fixture, n: u32, seq: i64) {
    for _ in 0..n {
        let content = StageJob {
            stage: "merge".into(),
            seq,
        }
        .with_marker(&markers::merge_infra_retry(seq));
        f.run
            .store
            .enqueue(
                NewJob::new("merge-gate", content)
                    .task(f.run.task.id)
                    .delay_s(30),
            )
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fetch_is_retried_a_bounded_number_of_times_counted_from_the_queue() {
    assert_eq!(INFRA_RETRY_LIMIT, 3, "the cases below assume a limit of 3");
    // (earlier retries in the queue, expected delay or None for exhausted)
    for (earlier, delay) in [
        (0, Some(30)),
        (1, Some(60)),
        (2, Some(120)),
        (3, None),
        (7, None),
    ] {
        let f = fixture_with_remote(repo_config(
            Some("echo verified >> ../verified.log"),
            MergeStrategy::Ff,
        ))
        .await;
        let branch_head = commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
        let main = main_of(&f).await;
        // The remote is gone: every fetch fails.
        std::fs::remove_dir_all(origin_dir(&f)).unwrap();
        let seq = f.run.task.stage_seq;
        earlier_retries(&f, earlier, seq).await;
        earlier_retries(&f, 4, seq + 1).await; // another visit's: not counted
        let effect = execute(&f).await;
        match delay {
            Some(want) => {
                match effect {
                    StageEffect::Requeue {
                        delay_ms,
                        marker,
                        reason,
                    } => {
                        assert_eq!(delay_ms, want * 1000, "earlier {earlier}");
                        assert_eq!(marker, markers::merge_infra_retry(seq));
                        assert!(reason.contains("reading `main`"), "{reason}");
                        assert!(reason.contains("cannot fetch `origin`"), "{reason}");
                        assert!(
                            reason.contains(&format!("retry {} of 3", earlier + 1)),
                            "{reason}"
                        );
                    }
                    other => panic!("earlier {earlier}: {other:?}"),
                }
                assert!(read(&f.run.artifact_path("14-merge-log.md")).is_none());
                assert_eq!(counters(&f), (0, 0, 0, 1), "earlier {earlier}");
            }
            None => {
                let fm = check(
                    &f,
                    &effect,
                    MergeStatus::Failed,
                    "infra_exhausted",
                    &[],
                    "cannot fetch `origin`",
                );
                assert_eq!(fm.get_str("merged_revision"), Some("none"));
                assert_eq!(
                    fm.get("infra_retries"),
                    Some(&Value::Int(i64::from(earlier)))
                );
                assert_eq!(counters(&f), (0, 0, 1, 0), "earlier {earlier}");
            }
        }
        assert_eq!(f.counters.get("merge_gate", "runs"), 1);
        assert_eq!(main_of(&f).await, main, "main unchanged");
        assert_eq!(
            head(&f, &f.run.worktree).await,
            branch_head,
            "nothing built"
        );
        assert!(
            !f.run
                .worktree
                .parent()
                .unwrap()
                .join("verified.log")
                .exists(),
            "nothing verified"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_branch_that_does_not_exist_is_an_infrastructure_error() {
    let f = fixture(RepoConfig {
        default_branch: "trunk".into(),
        ..repo_config(Some("true"), MergeStrategy::Ff)
    })
    .await;
    let branch_head = commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    match execute(&f).await {
        StageEffect::Requeue {
            delay_ms,
            marker,
            reason,
        } => {
            assert_eq!(delay_ms, 30_000);
            assert_eq!(marker, markers::merge_infra_retry(f.run.task.stage_seq));
            assert!(reason.contains("reading `trunk`"), "{reason}");
            assert!(reason.contains("has no commit"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(read(&f.run.artifact_path("14-merge-log.md")).is_none());
    assert_eq!(
        head(&f, &f.run.worktree).await,
        branch_head,
        "nothing built"
    );
    assert_eq!(rev(&f, &f.run.repo_dir, "refs/heads/trunk").await, None);
    assert_eq!(counters(&f), (0, 0, 0, 1));
}

/// A second work item `DEMO-2` of the fixture's repo at stage `merge`, its worktree on
/// `orch/DEMO-2` made from `main` as it is now; returns its run.
async fn second_item(f: &Fixture) -> StageRun {
    let task2 = f
        .run
        .store
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact("DEMO-2".parse().unwrap()),
            repo: "demo".parse().unwrap(),
            title: "another change".into(),
            body: "body".into(),
            stage: "merge".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.created", "created"),
            first_job: Some(NewJob::new("merge-gate", "{}")),
        })
        .await
        .unwrap();
    let worktree2 = f.run.repo_dir.join("worktrees").join("DEMO-2");
    f.run
        .git
        .worktree_add(&f.run.repo_dir, &worktree2, &task2.branch, "main")
        .await
        .unwrap();
    let mut run2 = f.run.clone();
    run2.work_item = "DEMO-2".parse().unwrap();
    run2.artifact_dir = worktree2.join(run2.work_item.artifact_dir());
    run2.worktree = worktree2;
    run2.task = task2;
    run2
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_items_of_one_repo_at_the_same_time_get_correct_candidates_and_main_stays() {
    // Serializing merges of one repo is the release track's (the store's conformance tests);
    // here two runs overlap anyway and must neither disturb each other nor touch main.
    for strategy in [MergeStrategy::Ff, MergeStrategy::Merge] {
        let f = fixture(repo_config(Some("sleep 0.3 && test -f base.txt"), strategy)).await;
        let clone_head = head(&f, &f.run.repo_dir).await;
        let run2 = second_item(&f).await;
        let head1 = commit(&f.run.git, &f.run.worktree, "one.txt", "1\n").await;
        let head2 = commit(&f.run.git, &run2.worktree, "two.txt", "2\n").await;
        let main = advance_main(&f, "base.txt", "b\n").await;

        let gate = MergeGateExecutor::new(f.counters.clone());
        let (a, b) = tokio::join!(gate.execute(&f.run), gate.execute(&run2));
        let (a, b) = (a.unwrap(), b.unwrap());

        let mut candidates = Vec::new();
        for (run, effect, own, own_file, other, other_file) in [
            (&f.run, &a, &head1, "one.txt", &head2, "two.txt"),
            (&run2, &b, &head2, "two.txt", &head1, "one.txt"),
        ] {
            let fm = check_run(
                run,
                effect,
                MergeStatus::Merged,
                "none",
                &[],
                "into the verified candidate",
            );
            let candidate = f
                .run
                .git
                .rev_parse(&run.worktree, "HEAD")
                .await
                .unwrap()
                .unwrap();
            assert_eq!(fm.get_str("merged_revision"), Some(candidate.as_str()));
            assert_eq!(
                rev(
                    &f,
                    &f.run.repo_dir,
                    &format!("refs/heads/{}", run.task.branch)
                )
                .await,
                Some(candidate.clone()),
                "{}: the candidate is its own branch",
                run.work_item
            );
            assert!(
                is_ancestor(&f, &main, &candidate).await,
                "{}",
                run.work_item
            );
            assert!(is_ancestor(&f, own, &candidate).await, "{}", run.work_item);
            assert!(
                !is_ancestor(&f, other, &candidate).await,
                "{}",
                run.work_item
            );
            if strategy == MergeStrategy::Merge {
                assert_eq!(parents(&f, &candidate).await, [main.clone(), own.clone()]);
            }
            assert!(run.worktree.join(own_file).exists());
            assert!(run.worktree.join("base.txt").exists());
            assert!(!run.worktree.join(other_file).exists());
            candidates.push(candidate);
        }
        assert_ne!(candidates[0], candidates[1]);
        assert_eq!(main_of(&f).await, main, "main unchanged");
        assert_clone_untouched(&f, &clone_head).await;
        assert_eq!(counters(&f), (2, 0, 0, 0));
        assert_eq!(f.counters.get("merge_gate", "runs"), 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_are_declared_at_zero() {
    let counters = Arc::new(Counters::new());
    let _gate = MergeGateExecutor::new(counters.clone());
    let snapshot = counters.snapshot();
    assert_eq!(snapshot.len(), 1);
    assert_eq!(snapshot[0].0, "merge_gate");
    let names: Vec<(&str, u64)> = snapshot[0]
        .1
        .iter()
        .map(|(n, v)| (n.as_str(), *v))
        .collect();
    assert_eq!(
        names,
        [
            ("conflict", 0),
            ("failed", 0),
            ("infra_retry", 0),
            ("merged", 0),
            ("runs", 0)
        ]
    );
}
