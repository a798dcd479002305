//! The merge gate against real parts: real git repos (a main checkout, a worktree on
//! `orch/<id>`, bare and refusing remotes), a real SQLite store whose jobs queue counts the
//! infrastructure retries, real verification commands, and every `14-merge-log.md` read back
//! through the unchanged `parse_merge_status` gate.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use orch_domain::artifact::{Artifact, Frontmatter, Value};
use orch_domain::config::{MergeStrategy, RepoConfig};
use orch_domain::gate::{MergeStatus, parse_merge_status};
use orch_domain::staging::rfc3339_utc;
use orch_exec::{Cmd, Git, Pathspec};
use orch_runner::counters::Counters;
use orch_runner::engine::{StageEffect, StageExecutor, StageJob};
use orch_runner::stages::MergeGateExecutor;
use orch_runner::stages::merge_gate::{MERGE_LOCK_FILE, infra_retry_marker};
use orch_store::testing::T0;
use orch_store::{NewEvent, NewJob, NewTask, WorkItemSpec};

use common::{Fixture, ID};

/// Runs git directly (test setup that `Git` has no operation for).
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

/// Where the main checkout comes from (`Fixture::new` makes a local repo without a remote).
#[derive(Clone, Copy, PartialEq)]
enum Origin {
    /// A clone of a bare repo (pushes succeed).
    Bare,
    /// A clone of a bare repo whose `pre-receive` hook refuses every push. (A non-bare
    /// checkout no longer refuses: orch fast-forwards it instead of pushing into it.)
    Refusing,
}

/// The shared fixture over a main checkout that comes from `origin`.
async fn fixture_with(stage: &str, agent: &str, repo: RepoConfig, origin: Origin) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let repo_dir = Fixture::repo_dir_in(&tmp);
    let git = Git::new();
    let seed = tmp.path().join("upstream");
    common::init_repo(&git, &seed, "demo\n").await;
    match origin {
        Origin::Bare | Origin::Refusing => {
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
            if origin == Origin::Refusing {
                let hook = bare.join("hooks").join("pre-receive");
                std::fs::write(&hook, "#!/bin/sh\necho refused by the test >&2\nexit 1\n").unwrap();
                use std::os::unix::fs::PermissionsExt as _;
                std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
    }

    Fixture::in_repo(tmp, stage, agent, repo).await
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

async fn head(f: &Fixture, dir: &Path) -> String {
    f.run.git.rev_parse(dir, "HEAD").await.unwrap().unwrap()
}

/// Runs the merge gate once.
async fn execute(f: &Fixture) -> StageEffect {
    MergeGateExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap()
}

/// Checks that the effect is `Produced` and the log says `status` with `failure_kind`,
/// `conflicts` and a reason containing `reason`, through the gate and key by key; returns the
/// frontmatter.
fn check(
    f: &Fixture,
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
    let log = read(&f.run.artifact_path("14-merge-log.md")).expect("merge log written");
    let gate = parse_merge_status(Some(&log), &f.run.work_item);
    assert!(gate.is(status), "{gate:?}\n{log}");
    let fm = Artifact::parse(&log).unwrap().frontmatter;
    let s = |k: &str| fm.get_str(k).unwrap_or_default().to_owned();
    assert_eq!(s("work_item"), ID);
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
    assert!(
        !f.run.repo_dir.join(".git").join(MERGE_LOCK_FILE).exists(),
        "the merge lock is released"
    );
    fm
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_forward_when_main_did_not_move() {
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(Some("test -f feature.txt"), MergeStrategy::Ff),
    )
    .await;
    let branch_head = commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    let effect = execute(&f).await;
    let fm = check(
        &f,
        &effect,
        MergeStatus::Merged,
        "none",
        &[],
        "fast-forward",
    );
    assert_eq!(head(&f, &f.run.repo_dir).await, branch_head);
    assert_eq!(fm.get_str("merged_revision"), Some(branch_head.as_str()));
    assert_eq!(fm.get_str("strategy"), Some("ff"));
    assert_eq!(counters(&f), (1, 0, 0, 0));
    assert_eq!(f.counters.get("merge_gate", "runs"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_forward_after_bringing_the_branch_up_to_date() {
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(
            Some("test -f other.txt && test -f feature.txt"),
            MergeStrategy::Ff,
        ),
    )
    .await;
    commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    commit(&f.run.git, &f.run.repo_dir, "other.txt", "y\n").await;
    let effect = execute(&f).await;
    let fm = check(&f, &effect, MergeStatus::Merged, "none", &[], "merged");
    let main = head(&f, &f.run.repo_dir).await;
    assert_eq!(
        main,
        head(&f, &f.run.worktree).await,
        "main fast-forwarded to the updated branch"
    );
    assert_eq!(fm.get_str("merged_revision"), Some(main.as_str()));
    for file in ["other.txt", "feature.txt"] {
        assert!(f.run.repo_dir.join(file).exists(), "{file} on main");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_commit_strategy_records_a_merge() {
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(Some("true"), MergeStrategy::Merge),
    )
    .await;
    commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    let before = head(&f, &f.run.repo_dir).await;
    let effect = execute(&f).await;
    let fm = check(
        &f,
        &effect,
        MergeStatus::Merged,
        "none",
        &[],
        "merge commit",
    );
    let git = &f.run.git;
    let main = head(&f, &f.run.repo_dir).await;
    assert_eq!(fm.get_str("merged_revision"), Some(main.as_str()));
    assert_eq!(fm.get_str("strategy"), Some("merge"));
    let first = git.rev_parse(&f.run.repo_dir, "HEAD^1").await.unwrap();
    let second = git.rev_parse(&f.run.repo_dir, "HEAD^2").await.unwrap();
    assert_eq!(first, Some(before));
    assert_eq!(second, Some(head(&f, &f.run.worktree).await));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_lists_its_files_and_leaves_main_and_the_worktree_clean() {
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(Some("true"), MergeStrategy::Ff),
    )
    .await;
    let branch_head = commit(&f.run.git, &f.run.worktree, "README.md", "branch\n").await;
    commit(&f.run.git, &f.run.worktree, "notes.txt", "n\n").await;
    let main_head = commit(&f.run.git, &f.run.repo_dir, "README.md", "main\n").await;
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
    assert_eq!(head(&f, &f.run.repo_dir).await, main_head, "main untouched");
    assert_ne!(head(&f, &f.run.worktree).await, branch_head);
    assert_eq!(
        f.run
            .git
            .rev_parse(&f.run.worktree, "HEAD~1")
            .await
            .unwrap(),
        Some(branch_head),
        "the branch keeps its own commits, no merge commit"
    );
    assert!(
        dirty_outside_artifacts(&f).await.is_empty(),
        "worktree clean"
    );
    assert_eq!(
        std::fs::read_to_string(f.run.worktree.join("README.md")).unwrap(),
        "branch\n"
    );
    assert_eq!(counters(&f), (0, 1, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verification_failing_on_the_updated_branch_is_failed() {
    let test = "if [ -f a.txt ] && [ -f b.txt ]; then echo 'a and b clash' >&2; exit 1; fi";
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(Some(test), MergeStrategy::Ff),
    )
    .await;
    commit(&f.run.git, &f.run.worktree, "b.txt", "b\n").await;
    let main_head = commit(&f.run.git, &f.run.repo_dir, "a.txt", "a\n").await;
    let effect = execute(&f).await;
    check(
        &f,
        &effect,
        MergeStatus::Failed,
        "verification_failed",
        &[],
        "exit code 1",
    );
    assert_eq!(head(&f, &f.run.repo_dir).await, main_head, "main untouched");
    let log = read(&f.run.artifact_path("14-merge-log.md")).unwrap();
    assert!(log.contains("a and b clash"), "{log}");
    assert_eq!(counters(&f), (0, 0, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_after_the_merge_reports_merged_without_merging_again() {
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(
            Some("echo verified >> ../verified.log"),
            MergeStrategy::Merge,
        ),
    )
    .await;
    commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    let effect = execute(&f).await;
    check(
        &f,
        &effect,
        MergeStatus::Merged,
        "none",
        &[],
        "merge commit",
    );
    let merged = head(&f, &f.run.repo_dir).await;
    // A crash before the stage changed: the same job runs again.
    let effect = execute(&f).await;
    let fm = check(
        &f,
        &effect,
        MergeStatus::Merged,
        "none",
        &[],
        "already merged",
    );
    assert_eq!(head(&f, &f.run.repo_dir).await, merged, "no second merge");
    assert_eq!(fm.get_str("merged_revision"), Some(merged.as_str()));
    let verified =
        std::fs::read_to_string(f.run.worktree.parent().unwrap().join("verified.log")).unwrap();
    assert_eq!(verified.lines().count(), 1, "verified once");
    assert_eq!(counters(&f).0, 2);
}

/// Enqueues `n` merge-gate jobs carrying the retry marker of stage visit `seq`, as earlier
/// infrastructure retries would have.
async fn earlier_retries(f: &Fixture, n: u32, seq: i64) {
    for _ in 0..n {
        let content = StageJob {
            stage: "merge".into(),
            seq,
        }
        .with_marker(&infra_retry_marker(seq));
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

fn hold_lock(f: &Fixture, age: Duration) -> std::path::PathBuf {
    let lock = f.run.repo_dir.join(".git").join(MERGE_LOCK_FILE);
    std::fs::write(&lock, "pid=1 node=elsewhere work_item=DEMO-9 job=9\n").unwrap();
    let file = std::fs::File::options().write(true).open(&lock).unwrap();
    file.set_modified(SystemTime::now() - age).unwrap();
    lock
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_contention_is_retried_a_bounded_number_of_times_counted_from_the_queue() {
    // (earlier retries in the queue, expected delay or None for exhausted)
    for (earlier, delay) in [
        (0, Some(30)),
        (1, Some(60)),
        (2, Some(120)),
        (3, None),
        (7, None),
    ] {
        let f = Fixture::new(
            "merge",
            "merge-gate",
            repo_config(Some("true"), MergeStrategy::Ff),
        )
        .await;
        commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
        let main_head = head(&f, &f.run.repo_dir).await;
        let lock = hold_lock(&f, Duration::from_secs(60));
        earlier_retries(&f, earlier, f.run.task.stage_seq).await;
        earlier_retries(&f, 4, f.run.task.stage_seq + 1).await; // another visit's: not counted
        let effect = execute(&f).await;
        match delay {
            Some(want) => {
                match effect {
                    StageEffect::Requeue {
                        delay_s,
                        marker,
                        reason,
                    } => {
                        assert_eq!(delay_s, want, "earlier {earlier}");
                        assert_eq!(marker, "[orch:merge-infra-retry seq=0]");
                        assert!(reason.contains("is held"), "{reason}");
                        assert!(reason.contains("node=elsewhere"), "{reason}");
                    }
                    other => panic!("earlier {earlier}: {other:?}"),
                }
                assert!(read(&f.run.artifact_path("14-merge-log.md")).is_none());
                assert_eq!(counters(&f), (0, 0, 0, 1));
            }
            None => {
                // `check` also asserts the lock is gone: remove the foreign lock first.
                assert!(lock.exists(), "a foreign lock is never removed");
                std::fs::remove_file(&lock).unwrap();
                let fm = check(
                    &f,
                    &effect,
                    MergeStatus::Failed,
                    "infra_exhausted",
                    &[],
                    "is held",
                );
                assert_eq!(
                    fm.get("infra_retries"),
                    Some(&Value::Int(i64::from(earlier)))
                );
                assert_eq!(counters(&f), (0, 0, 1, 0));
            }
        }
        assert!(
            delay.is_none() || lock.exists(),
            "a foreign lock is never removed"
        );
        assert_eq!(head(&f, &f.run.repo_dir).await, main_head, "nothing merged");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_lock_is_broken() {
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(Some("true"), MergeStrategy::Ff),
    )
    .await;
    let branch_head = commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    hold_lock(&f, Duration::from_secs(11 * 60));
    let effect = execute(&f).await;
    check(&f, &effect, MergeStatus::Merged, "none", &[], "merged");
    assert_eq!(head(&f, &f.run.repo_dir).await, branch_head);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_remote_the_merge_is_fetched_and_pushed() {
    let f = fixture_with(
        "merge",
        "merge-gate",
        repo_config(Some("test -f upstream.txt"), MergeStrategy::Ff),
        Origin::Bare,
    )
    .await;
    commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    // Someone else pushed to origin meanwhile: the gate must fetch it and merge on top.
    let bare = f.run.repos_dir.parent().unwrap().join("origin.git");
    let other = f.run.repos_dir.parent().unwrap().join("other");
    f.run
        .git
        .clone_repo(bare.to_str().unwrap(), &other)
        .await
        .unwrap();
    commit(&f.run.git, &other, "upstream.txt", "u\n").await;
    f.run.git.push(&other, "origin", "main").await.unwrap();

    let effect = execute(&f).await;
    let fm = check(&f, &effect, MergeStatus::Merged, "none", &[], "merged");
    let merged = head(&f, &f.run.repo_dir).await;
    assert_eq!(fm.get_str("merged_revision"), Some(merged.as_str()));
    let remote_main = sh_git(&bare, &["rev-parse", "refs/heads/main"]).await;
    assert_eq!(remote_main.trim(), merged, "pushed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_push_is_retried_and_undone_then_exhausted() {
    for earlier in [0, 3] {
        let f = fixture_with(
            "merge",
            "merge-gate",
            repo_config(Some("true"), MergeStrategy::Ff),
            Origin::Refusing,
        )
        .await;
        commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
        let main_head = head(&f, &f.run.repo_dir).await;
        earlier_retries(&f, earlier, f.run.task.stage_seq).await;
        let effect = execute(&f).await;
        if earlier == 0 {
            match effect {
                StageEffect::Requeue {
                    delay_s,
                    marker,
                    reason,
                } => {
                    assert_eq!(delay_s, 30);
                    assert_eq!(marker, infra_retry_marker(f.run.task.stage_seq));
                    assert!(reason.contains("publishing `main` to `origin`"), "{reason}");
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(counters(&f), (0, 0, 0, 1));
        } else {
            check(
                &f,
                &effect,
                MergeStatus::Failed,
                "infra_exhausted",
                &[],
                "publishing `main`",
            );
            assert_eq!(counters(&f), (0, 0, 1, 0));
        }
        assert_eq!(
            head(&f, &f.run.repo_dir).await,
            main_head,
            "the unpushed merge is undone"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merges_into_one_repo_are_serialized() {
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(Some("sleep 0.3"), MergeStrategy::Ff),
    )
    .await;
    commit(&f.run.git, &f.run.worktree, "one.txt", "1\n").await;

    // A second work item of the same repo, merging at the same time.
    let store = &f.run.store;
    let task2 = store
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact("DEMO-2".into()),
            repo: "demo".into(),
            title: "another change".into(),
            body: "body".into(),
            stage: "merge".into(),
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
    commit(&f.run.git, &worktree2, "two.txt", "2\n").await;
    let mut run2 = f.run.clone();
    run2.work_item = "DEMO-2".parse().unwrap();
    run2.artifact_dir = worktree2.join(run2.work_item.artifact_dir());
    run2.worktree = worktree2;
    run2.task = task2;

    let gate = MergeGateExecutor::new(f.counters.clone());
    let (a, b) = tokio::join!(gate.execute(&f.run), gate.execute(&run2));
    for effect in [a.unwrap(), b.unwrap()] {
        assert!(
            matches!(effect, StageEffect::Produced { outcome: None }),
            "{effect:?}"
        );
    }
    for run in [&f.run, &run2] {
        let log = read(&run.artifact_path("14-merge-log.md")).unwrap();
        let gate = parse_merge_status(Some(&log), &run.work_item);
        assert!(
            gate.is(MergeStatus::Merged),
            "{}: {gate:?}\n{log}",
            run.work_item
        );
    }
    for file in ["one.txt", "two.txt"] {
        assert!(f.run.repo_dir.join(file).exists(), "{file} on main");
    }
    assert_eq!(counters(&f), (2, 0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_main_checkout_off_the_default_branch_is_an_infrastructure_error() {
    let f = Fixture::new(
        "merge",
        "merge-gate",
        repo_config(Some("true"), MergeStrategy::Ff),
    )
    .await;
    commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    sh_git(&f.run.repo_dir, &["checkout", "--quiet", "-b", "elsewhere"]).await;
    match execute(&f).await {
        StageEffect::Requeue { reason, .. } => {
            assert!(reason.contains("is on `elsewhere`"), "{reason}")
        }
        other => panic!("{other:?}"),
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
