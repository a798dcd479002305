//! Publishing the default branch to the repository a user declared
//! (`repos::publish_default_branch`), against real git repositories: an ordinary checkout
//! (clean, dirty, branch not checked out), a bare repository and a `file://` remote. Each case
//! checks the compare-and-swap (a branch that moved is never overwritten) and what happened to
//! the user's working tree.

use crate::common;

use std::path::{Path, PathBuf};

use orch_domain::config::{MergeStrategy, RepoConfig};
use orch_domain::gate::{MergeStatus, parse_merge_status};
use orch_exec::{Cmd, Git, Pathspec};
use orch_runner::engine::{StageEffect, StageExecutor};
use orch_runner::repos::{self, Outcome, Setup};
use orch_runner::stages::MergeGateExecutor;

use common::Fixture;

async fn sh_git(dir: &Path, args: &[&str]) -> String {
    let out = orch_exec::run(&Cmd::new("git").args(args).cwd(dir))
        .await
        .unwrap();
    assert!(out.success(), "git {args:?}: {}", out.tail_text(20));
    out.stdout_lossy().trim().to_owned()
}

async fn commit(git: &Git, dir: &Path, file: &str, content: &str) -> String {
    std::fs::write(dir.join(file), content).unwrap();
    git.add_and_commit(dir, &Pathspec::All, &format!("change {file}"))
        .await
        .unwrap()
        .unwrap()
}

/// The user's side and orch's clone of it.
struct Setup2 {
    _tmp: tempfile::TempDir,
    user: PathBuf,
    clone: PathBuf,
    git: Git,
    repo: RepoConfig,
}

enum Kind {
    Checkout,
    Bare,
    FileUrl,
}

/// A user repository of `kind` with one commit on `main`, and orch's clone of it (as
/// `repos::ensure_clone` makes it).
async fn setup(kind: Kind) -> Setup2 {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let checkout = tmp.path().join("checkout");
    common::init_repo(&git, &checkout, "hello\n").await;
    let (user, path, url) = match kind {
        Kind::Checkout => (checkout.clone(), Some(checkout.display().to_string()), None),
        Kind::Bare | Kind::FileUrl => {
            let bare = tmp.path().join("shared.git");
            sh_git(
                tmp.path(),
                &[
                    "clone",
                    "--quiet",
                    "--bare",
                    checkout.to_str().unwrap(),
                    bare.to_str().unwrap(),
                ],
            )
            .await;
            match kind {
                Kind::Bare => (bare.clone(), Some(bare.display().to_string()), None),
                _ => (
                    bare.clone(),
                    None,
                    Some(format!("file://{}", bare.display())),
                ),
            }
        }
    };
    let repo = RepoConfig {
        path: path.clone(),
        url: url.clone(),
        ..common::repo_config("DEMO")
    };
    let clone = tmp.path().join("repos").join("demo");
    let paths = repos::RepoPaths::new(&tmp.path().join("repos"), &"demo".parse().unwrap());
    repos::ensure_clone(&git, tmp.path(), &paths, &"demo".parse().unwrap(), &repo)
        .await
        .unwrap();
    Setup2 {
        _tmp: tmp,
        user,
        clone,
        git,
        repo,
    }
}

async fn rev(dir: &Path, name: &str) -> String {
    sh_git(dir, &["rev-parse", name]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_checkout_with_the_branch_checked_out_is_fast_forwarded() {
    let s = setup(Kind::Checkout).await;
    let old = rev(&s.clone, "main").await;
    let new = commit(&s.git, &s.clone, "feature.txt", "new\n").await;
    // An untracked file of the user's is kept.
    std::fs::write(s.user.join("notes.txt"), "mine\n").unwrap();
    let p = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &new)
        .await
        .unwrap();
    assert_eq!(p.outcome, Outcome::CheckoutFastForwarded, "{p:?}");
    assert!(p.warning().is_none());
    assert_eq!(rev(&s.user, "HEAD").await, new);
    assert_eq!(
        std::fs::read_to_string(s.user.join("feature.txt")).unwrap(),
        "new\n"
    );
    assert_eq!(
        std::fs::read_to_string(s.user.join("notes.txt")).unwrap(),
        "mine\n"
    );
    assert_eq!(
        sh_git(&s.user, &["status", "--porcelain", "--untracked-files=no"]).await,
        ""
    );
    // orch's clone knows where origin is now, and publishing again is a no-op.
    assert_eq!(rev(&s.clone, "refs/remotes/origin/main").await, new);
    let again = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &new)
        .await
        .unwrap();
    assert_eq!(again.outcome, Outcome::AlreadyThere);
    // No ref of orch's was left in the user's repository.
    let refs = sh_git(&s.user, &["for-each-ref", "--format=%(refname)"]).await;
    assert_eq!(refs, "refs/heads/main", "{refs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkout_with_local_changes_is_left_alone_with_a_warning() {
    let s = setup(Kind::Checkout).await;
    let old = rev(&s.clone, "main").await;
    let new = commit(&s.git, &s.clone, "feature.txt", "new\n").await;
    std::fs::write(s.user.join("README.md"), "edited by the user\n").unwrap();
    let p = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &new)
        .await
        .unwrap();
    assert_eq!(p.outcome, Outcome::CloneOnly, "{p:?}");
    let warning = p.warning().unwrap();
    assert!(
        warning.contains("published to orch's clone only")
            && warning.contains("local changes")
            && warning.contains("merge --ff-only"),
        "{warning}"
    );
    assert_eq!(rev(&s.user, "HEAD").await, old, "HEAD untouched");
    assert_eq!(
        std::fs::read_to_string(s.user.join("README.md")).unwrap(),
        "edited by the user\n"
    );
    assert!(!s.user.join("feature.txt").exists());
    // origin/main in orch's clone still says where the user's branch really is, so the next
    // publish (once the checkout is clean) starts from there.
    assert_eq!(rev(&s.clone, "refs/remotes/origin/main").await, old);
    std::fs::write(s.user.join("README.md"), "hello\n").unwrap();
    let newer = commit(&s.git, &s.clone, "more.txt", "more\n").await;
    let p = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &newer)
        .await
        .unwrap();
    assert_eq!(p.outcome, Outcome::CheckoutFastForwarded, "{p:?}");
    assert_eq!(rev(&s.user, "HEAD").await, newer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_not_checked_out_is_moved_by_its_ref_only() {
    let s = setup(Kind::Checkout).await;
    sh_git(&s.user, &["checkout", "--quiet", "-b", "topic"]).await;
    std::fs::write(s.user.join("wip.txt"), "wip\n").unwrap();
    let old = rev(&s.clone, "main").await;
    let new = commit(&s.git, &s.clone, "feature.txt", "new\n").await;
    let p = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &new)
        .await
        .unwrap();
    assert_eq!(p.outcome, Outcome::RefUpdated, "{p:?}");
    assert_eq!(rev(&s.user, "refs/heads/main").await, new);
    assert_eq!(
        sh_git(&s.user, &["symbolic-ref", "--short", "HEAD"]).await,
        "topic"
    );
    assert!(
        !s.user.join("feature.txt").exists(),
        "working tree untouched"
    );
    assert!(s.user.join("wip.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkout_that_moved_is_not_overwritten() {
    let s = setup(Kind::Checkout).await;
    let old = rev(&s.clone, "main").await;
    let new = commit(&s.git, &s.clone, "feature.txt", "new\n").await;
    let theirs = commit(&s.git, &s.user, "user.txt", "user's commit\n").await;
    let err = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &new)
        .await
        .unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("not at") && msg.contains("someone else moved it"),
        "{msg}"
    );
    assert_eq!(rev(&s.user, "HEAD").await, theirs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bare_and_file_url_remotes_get_a_lease_push_that_never_forces() {
    for kind in [Kind::Bare, Kind::FileUrl] {
        let s = setup(kind).await;
        let old = rev(&s.clone, "main").await;
        let new = commit(&s.git, &s.clone, "feature.txt", "new\n").await;
        let p = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &new)
            .await
            .unwrap();
        assert_eq!(p.outcome, Outcome::Pushed, "{p:?}");
        assert_eq!(rev(&s.user, "refs/heads/main").await, new);

        // Someone else pushes; orch's next publish from the stale `new` is refused.
        let other = s.user.parent().unwrap().join("other");
        sh_git(
            s.user.parent().unwrap(),
            &[
                "clone",
                "--quiet",
                s.user.to_str().unwrap(),
                other.to_str().unwrap(),
            ],
        )
        .await;
        let theirs = commit(&s.git, &other, "theirs.txt", "x\n").await;
        sh_git(&other, &["push", "--quiet", "origin", "main"]).await;
        let mine = commit(&s.git, &s.clone, "mine.txt", "y\n").await;
        let err = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &new, &mine)
            .await
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("someone else moved it"), "{msg}");
        assert_eq!(rev(&s.user, "refs/heads/main").await, theirs, "not forced");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_that_would_drop_commits_is_refused() {
    let s = setup(Kind::Bare).await;
    let old = rev(&s.clone, "main").await;
    let new = commit(&s.git, &s.clone, "feature.txt", "new\n").await;
    repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &new)
        .await
        .unwrap();
    // Publishing `old` again from `new` would rewind the branch: refused, not forced.
    let err = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &new, &old)
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("would drop commits"), "{err:#}");
    assert_eq!(rev(&s.user, "refs/heads/main").await, new);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_branches_go_to_remotes_and_bare_repos_but_not_into_a_checkout() {
    let checkout = setup(Kind::Checkout).await;
    assert!(!repos::shares_work_branches(&checkout.git, &checkout.clone, &checkout.repo).await);
    let bare = setup(Kind::Bare).await;
    assert!(repos::shares_work_branches(&bare.git, &bare.clone, &bare.repo).await);
    let url = setup(Kind::FileUrl).await;
    assert!(repos::shares_work_branches(&url.git, &url.clone, &url.repo).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_tells_every_setup_apart() {
    let git = Git::new();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |path: &str| RepoConfig {
        path: Some(path.to_owned()),
        ..common::repo_config("DEMO")
    };
    let missing = repos::inspect(&git, tmp.path(), &cfg("nope"))
        .await
        .unwrap_err();
    assert!(
        format!("{missing:#}").contains("does not exist"),
        "{missing:#}"
    );
    std::fs::create_dir(tmp.path().join("plain")).unwrap();
    let plain = repos::inspect(&git, tmp.path(), &cfg("plain"))
        .await
        .unwrap_err();
    assert!(
        format!("{plain:#}").contains("is not a git repository"),
        "{plain:#}"
    );
    common::init_repo(&git, &tmp.path().join("co"), "x\n").await;
    assert!(matches!(
        repos::inspect(&git, tmp.path(), &cfg("co")).await.unwrap(),
        Setup::Checkout { .. }
    ));
    sh_git(tmp.path(), &["init", "--quiet", "--bare", "b.git"]).await;
    assert!(matches!(
        repos::inspect(&git, tmp.path(), &cfg("b.git"))
            .await
            .unwrap(),
        Setup::Bare { .. }
    ));
    let remote = RepoConfig {
        url: Some("https://bob:hunter22@example.com/r.git".into()),
        ..common::repo_config("DEMO")
    };
    match repos::inspect(&git, tmp.path(), &remote).await.unwrap() {
        Setup::Remote { url } => assert_eq!(url, "https://***@example.com/r.git"),
        other => panic!("{other:?}"),
    }
}

/// The defect: the merge gate pushed `main` into the user's checkout, where it is checked out;
/// git refused (`receive.denyCurrentBranch`), the gate retried for minutes, then failed. Now
/// the candidate is built and the release's move of `main` fast-forwards the checkout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merging_into_an_ordinary_checkout_is_not_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let user = tmp.path().join("checkout");
    common::init_repo(&git, &user, "demo\n").await;
    let repo_dir = Fixture::repo_dir_in(&tmp);
    git.clone_repo(user.to_str().unwrap(), &repo_dir)
        .await
        .unwrap();
    let repo = RepoConfig {
        path: Some(user.display().to_string()),
        test: Some("true".into()),
        merge_strategy: MergeStrategy::Ff,
        ..common::repo_config("DEMO")
    };
    let f = Fixture::in_repo(tmp, "merge", "merge-gate", repo).await;
    commit(&f.run.git, &f.run.worktree, "feature.txt", "x\n").await;
    let effect = MergeGateExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap();
    assert!(matches!(effect, StageEffect::Produced { .. }), "{effect:?}");
    let log = std::fs::read_to_string(f.run.artifact_path("14-merge-log.md")).unwrap();
    let gate = parse_merge_status(Some(&log), &f.run.work_item);
    assert!(gate.is(MergeStatus::Merged), "{gate:?}\n{log}");
    // The release train moves the default branch to the staged candidate (the promotion before
    // the deploy) the same way: into the user's checkout, where `main` is checked out.
    let candidate = rev(&f.run.worktree, "HEAD").await;
    let main = rev(&f.run.repo_dir, "main").await;
    let published =
        repos::move_default_branch(&f.run.git, &f.run.repo_dir, &f.run.repo, &main, &candidate)
            .await
            .unwrap();
    assert_eq!(
        published.outcome,
        repos::Outcome::CheckoutFastForwarded,
        "{published:?}"
    );
    let merged = rev(&f.run.repo_dir, "main").await;
    assert_eq!(merged, candidate);
    assert_eq!(rev(&user, "HEAD").await, merged);
    assert_eq!(
        std::fs::read_to_string(user.join("feature.txt")).unwrap(),
        "x\n"
    );
    let branches = sh_git(&user, &["branch", "--format=%(refname:short)"]).await;
    assert_eq!(branches, "main", "no orch/* branch in the user's checkout");
}

/// orch killed -9 while it cloned leaves a half-made clone; it is made beside the repo's
/// directory and moved there whole, so the next job finds either nothing (and clones again,
/// removing what the dead process left) or a whole clone, never a checkout it cannot detach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_cut_short_by_a_kill_is_never_where_the_next_job_looks() {
    let s = setup(Kind::Checkout).await;
    let repos = s.clone.parent().unwrap().to_path_buf();
    std::fs::remove_dir_all(&s.clone).unwrap();
    // What a process killed mid-clone left: a gone process's and (pid reused) this one's.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    gone.wait().unwrap();
    for pid in [gone_pid, std::process::id()] {
        let left = repos.join(format!(".cloning-demo.{pid}"));
        std::fs::create_dir_all(left.join(".git")).unwrap();
        std::fs::write(left.join("README.md"), "half a checkout\n").unwrap();
    }
    let paths = repos::RepoPaths::new(&repos, &"demo".parse().unwrap());
    repos::ensure_clone(
        &s.git,
        s._tmp.path(),
        &paths,
        &"demo".parse().unwrap(),
        &s.repo,
    )
    .await
    .unwrap();
    assert_eq!(rev(&s.clone, "HEAD").await, rev(&s.user, "main").await);
    let left: Vec<String> = std::fs::read_dir(&repos)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(".cloning-"))
        .collect();
    assert!(left.is_empty(), "no unfinished clone left: {left:?}");
}

/// Where work branches are shared, the remote's `orch/<id>` is the record: a node's commits
/// the remote lacks (an attempt that committed and then lost its lease, its push refused by the
/// fence) are set aside before its next stage, never built on and so never pushed over the
/// stages other nodes completed meanwhile (the three-host test once saw each stage replace the
/// previous one's commit). A branch only behind the remote is fast-forwarded, with nothing set
/// aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_attempt_the_remote_lacks_is_set_aside_never_built_on() {
    let s = setup(Kind::Bare).await;
    let root = s.clone.parent().unwrap().parent().unwrap().to_path_buf();
    let item: orch_domain::ids::WorkItemId = "DEMO-1".parse().unwrap();
    let branch = item.branch_name();
    let demo = "demo".parse().unwrap();
    let a = repos::RepoPaths::new(&root.join("repos"), &demo);
    let b = repos::RepoPaths::new(&root.join("repos-b"), &demo);
    repos::ensure_clone(&s.git, &root, &b, &demo, &s.repo)
        .await
        .unwrap();

    // Node a runs the first stage and pushes it.
    let wa = repos::prepare_worktree(&s.git, &a, &item, "main")
        .await
        .unwrap();
    let first = commit(&s.git, &wa, "first.md", "1\n").await;
    sh_git(&wa, &["push", "--quiet", "origin", &branch]).await;
    // Node a's next attempt commits, then loses its lease: its push never happens.
    let stale = commit(&s.git, &wa, "stale.md", "stale\n").await;
    // Node b rescues that stage from the remote's branch and completes it.
    assert_eq!(
        repos::catch_up_work_branch(&s.git, &b, &item)
            .await
            .unwrap(),
        None
    );
    let wb = repos::prepare_worktree(&s.git, &b, &item, "main")
        .await
        .unwrap();
    assert_eq!(
        rev(&wb, "HEAD").await,
        first,
        "b starts from the remote's branch"
    );
    let second = commit(&s.git, &wb, "second.md", "2\n").await;
    sh_git(&wb, &["push", "--quiet", "origin", &branch]).await;

    // Node a's next stage: its stale commit is set aside, kept, and gone from the worktree.
    let said = repos::catch_up_work_branch(&s.git, &a, &item)
        .await
        .unwrap()
        .expect("the stale attempt is set aside");
    assert!(
        said.contains(&stale[..12]) && said.contains(&second[..12]),
        "{said}"
    );
    assert_eq!(
        rev(&a.repo_dir, &format!("refs/heads/{branch}")).await,
        second
    );
    assert_eq!(
        rev(&a.repo_dir, &format!("refs/orch/stale/{branch}/{stale}")).await,
        stale,
        "the set-aside commit is kept"
    );
    let wa = repos::prepare_worktree(&s.git, &a, &item, "main")
        .await
        .unwrap();
    assert_eq!(rev(&wa, "HEAD").await, second);
    assert!(wa.join("second.md").exists() && !wa.join("stale.md").exists());
    let third = commit(&s.git, &wa, "third.md", "3\n").await;
    sh_git(&wa, &["push", "--quiet", "origin", &branch]).await;
    let log = sh_git(&s.user, &["log", "--format=%H", &branch]).await;
    assert!(
        log.contains(&third) && log.contains(&second) && !log.contains(&stale),
        "the remote holds every completed stage and no stale attempt:\n{log}"
    );

    // A local commit merely ahead of the remote (the push that never happened) is set aside
    // too; a branch behind the remote is fast-forwarded with nothing set aside.
    let ahead = commit(&s.git, &wa, "ahead.md", "x\n").await;
    let said = repos::catch_up_work_branch(&s.git, &a, &item)
        .await
        .unwrap()
        .expect("a commit the remote lacks is set aside");
    assert!(said.contains(&ahead[..12]), "{said}");
    assert_eq!(
        rev(&a.repo_dir, &format!("refs/heads/{branch}")).await,
        third
    );
    assert_eq!(
        repos::catch_up_work_branch(&s.git, &b, &item)
            .await
            .unwrap(),
        None,
        "b is only behind"
    );
    assert_eq!(
        rev(&b.repo_dir, &format!("refs/heads/{branch}")).await,
        third
    );
}

/// A remote that refuses the default branch's push while nobody moved it (a pre-receive hook,
/// as branch protection) is a `PushRefused` (the release train then goes through the forge);
/// a branch someone else moved is a lost race, not a refusal. A branch orch owns still takes
/// its pushes (`push_owned_branch`, by a lease on where the remote has it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_branch_refuses_the_push_and_says_so_apart_from_a_lost_race() {
    use std::os::unix::fs::PermissionsExt as _;
    for kind in [Kind::Bare, Kind::FileUrl] {
        let s = setup(kind).await;
        let hook = s.user.join("hooks/pre-receive");
        std::fs::write(
            &hook,
            "#!/bin/sh\nwhile read old new ref; do\n  [ \"$ref\" = refs/heads/main ] && { echo 'GH006: Protected branch update failed' >&2; exit 1; }\ndone\nexit 0\n",
        )
        .unwrap();
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
        let old = rev(&s.clone, "main").await;
        let new = commit(&s.git, &s.clone, "feature.txt", "new\n").await;
        let err = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &new)
            .await
            .unwrap_err();
        assert!(repos::push_refused(&err), "{err:#}");
        assert!(
            format!("{err:#}").contains("refused to move `main`"),
            "{err:#}"
        );
        assert_eq!(rev(&s.user, "refs/heads/main").await, old, "nothing moved");

        // The branch orch owns takes the commit, and takes a later one over it.
        repos::push_owned_branch(&s.git, &s.clone, "orch/release/DEMO-1", &new)
            .await
            .unwrap();
        assert_eq!(rev(&s.user, "refs/heads/orch/release/DEMO-1").await, new);
        let newer = commit(&s.git, &s.clone, "more.txt", "more\n").await;
        repos::push_owned_branch(&s.git, &s.clone, "orch/release/DEMO-1", &newer)
            .await
            .unwrap();
        assert_eq!(rev(&s.user, "refs/heads/orch/release/DEMO-1").await, newer);

        // Someone else moved `main` (as the forge's merge does): a lost race, not a refusal.
        std::fs::remove_file(&hook).unwrap();
        sh_git(&s.user, &["update-ref", "refs/heads/main", &new, &old]).await;
        let err = repos::publish_default_branch(&s.git, &s.clone, &s.repo, &old, &newer)
            .await
            .unwrap_err();
        assert!(!repos::push_refused(&err), "{err:#}");
        assert!(
            format!("{err:#}").contains("someone else moved it"),
            "{err:#}"
        );
    }
}
