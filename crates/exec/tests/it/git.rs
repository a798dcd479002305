//! `orch_exec::git` against real repositories in temporary directories: commits, worktrees that
//! must survive being added twice or finding a broken leftover, merges that conflict or cannot
//! fast-forward, pushes to a real bare remote, and reading files as committed on a branch.

use std::path::{Path, PathBuf};

use orch_exec::git::{
    Git, GitError, MergeResult, MergeStrategy, Pathspec, RevertResult, WorktreeAdd,
};

fn write(dir: &Path, rel: &str, content: &str) {
    let path = dir.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, content).unwrap();
}

fn read(dir: &Path, rel: &str) -> String {
    std::fs::read_to_string(dir.join(rel)).unwrap()
}

/// A repository at `<tmp>/repo` on `main` with one commit (README.md); returns its path.
async fn repo(tmp: &Path) -> PathBuf {
    let git = Git::new();
    let dir = tmp.join("repo");
    git.init_repo(&dir, "main").await.unwrap();
    write(&dir, "README.md", "hello\n");
    git.add_and_commit(&dir, &Pathspec::All, "initial")
        .await
        .unwrap()
        .unwrap();
    dir
}

/// Commits `content` to `rel` in `dir` and returns the commit.
async fn commit(dir: &Path, rel: &str, content: &str) -> String {
    write(dir, rel, content);
    Git::new()
        .add_and_commit(dir, &Pathspec::All, &format!("change {rel}"))
        .await
        .unwrap()
        .unwrap()
}

async fn head(dir: &Path) -> String {
    Git::new().rev_parse(dir, "HEAD").await.unwrap().unwrap()
}

async fn is_clean(dir: &Path) -> bool {
    Git::new().status_porcelain(dir).await.unwrap().is_empty()
}

#[tokio::test]
async fn init_commit_and_rev_parse() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let dir = tmp.path().join("r");
    git.init_repo(&dir, "trunk").await.unwrap();
    assert_eq!(
        git.current_branch(&dir).await.unwrap().as_deref(),
        Some("trunk")
    );
    assert_eq!(
        git.rev_parse(&dir, "HEAD").await.unwrap(),
        None,
        "unborn branch"
    );
    // Nothing to commit is not an error.
    assert_eq!(
        git.add_and_commit(&dir, &Pathspec::All, "empty")
            .await
            .unwrap(),
        None
    );

    write(&dir, "a.txt", "a\n");
    let sha = git
        .add_and_commit(&dir, &Pathspec::All, "add a")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sha.len(), 40);
    assert_eq!(head(&dir).await, sha);
    assert_eq!(
        git.add_and_commit(&dir, &Pathspec::All, "again")
            .await
            .unwrap(),
        None
    );
    // A hook planted in the repository never runs (orch's git disables hooks): the commit
    // goes through and the hook's marker is never written.
    let hook = dir.join(".git/hooks/pre-commit");
    let marker = dir.join("hook-ran");
    std::fs::create_dir_all(hook.parent().unwrap()).unwrap();
    std::fs::write(
        &hook,
        format!("#!/bin/sh\ntouch '{}'\nexit 1\n", marker.display()),
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    write(&dir, "c.txt", "c\n");
    let hooked = git
        .add_and_commit(&dir, &Pathspec::All, "past the hook")
        .await
        .unwrap();
    assert!(hooked.is_some());
    assert!(!marker.exists(), "the planted hook ran");
    std::fs::remove_file(&hook).unwrap();
    // A commit that fails (the index cannot be written) is an error, and the commit id is read
    // back right (from the ref files) when it succeeds.
    let index = dir.join(".git/index");
    let saved = std::fs::read(&index).unwrap();
    std::fs::remove_file(&index).unwrap();
    std::fs::create_dir(&index).unwrap();
    write(&dir, "b.txt", "b\n");
    let err = git
        .add_and_commit(&dir, &Pathspec::All, "refused")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("index"), "{err}");
    std::fs::remove_dir(&index).unwrap();
    std::fs::write(&index, saved).unwrap();
    let sha = hooked.unwrap();
    let second = git
        .add_and_commit(&dir, &Pathspec::All, "add b")
        .await
        .unwrap()
        .unwrap();
    assert_ne!(second, sha);
    assert_eq!(head(&dir).await, second);
    // A merge left in progress with nothing staged: no commit (git would make a merge commit).
    std::fs::write(dir.join(".git/MERGE_HEAD"), format!("{sha}\n")).unwrap();
    assert!(git.operation_in_progress(&dir));
    assert_eq!(
        git.add_and_commit(&dir, &Pathspec::All, "nothing")
            .await
            .unwrap(),
        None
    );
    assert_eq!(head(&dir).await, second);
    std::fs::remove_file(dir.join(".git/MERGE_HEAD")).unwrap();
    assert!(!git.operation_in_progress(&dir));
    assert_eq!(
        git.show_file(&dir, "HEAD", "a.txt")
            .await
            .unwrap()
            .as_deref(),
        Some("a\n")
    );
    // init on an existing repository keeps it.
    git.init_repo(&dir, "trunk").await.unwrap();
    assert_eq!(head(&dir).await, second);
    // The fixed identity is used.
    let out = orch_exec::run(
        &orch_exec::Cmd::new("git")
            .args(["log", "-1", "--format=%an <%ae>|%cn <%ce>|%s"])
            .cwd(&dir),
    )
    .await
    .unwrap();
    assert_eq!(
        out.stdout_lossy().trim(),
        "orch <orch@localhost>|orch <orch@localhost>|add b"
    );
}

#[tokio::test]
async fn commit_only_some_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let dir = repo(tmp.path()).await;
    write(&dir, "docs/work-items/A-1/02-requirements.md", "req\n");
    write(&dir, "src/lib.rs", "// code\n");
    std::fs::remove_file(dir.join("README.md")).unwrap();

    let only = Pathspec::Only(vec!["docs/work-items/A-1".into()]);
    let sha = git
        .add_and_commit(&dir, &only, "requirements")
        .await
        .unwrap();
    assert!(sha.is_some());
    assert_eq!(
        git.add_and_commit(&dir, &only, "again").await.unwrap(),
        None
    );
    let mut left: Vec<(String, String)> = git
        .status_porcelain(&dir)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.code, e.path))
        .collect();
    left.sort();
    assert_eq!(
        left,
        vec![
            (" D".into(), "README.md".into()),
            ("??".into(), "src/lib.rs".into())
        ]
    );
    // The rest, deletion included.
    assert!(
        git.add_and_commit(&dir, &Pathspec::All, "rest")
            .await
            .unwrap()
            .is_some()
    );
    assert!(is_clean(&dir).await);
    assert_eq!(
        git.show_file(&dir, "HEAD", "README.md").await.unwrap(),
        None
    );
}

#[tokio::test]
async fn changed_files_outside_an_allowed_area() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let dir = repo(tmp.path()).await;
    commit(&dir, "src/old.rs", "old\n").await;
    let check = |allowed: &'static str, expect: Vec<&'static str>| {
        let git = git.clone();
        let dir = dir.clone();
        async move {
            let got = git.changed_files_outside(&dir, allowed).await.unwrap();
            assert_eq!(got, expect, "allowed {allowed}");
        }
    };
    check("docs/work-items/A-1", vec![]).await;
    write(&dir, "docs/work-items/A-1/10-implementation.md", "x\n");
    write(&dir, "docs/work-items/A-1/sub/deep.md", "x\n");
    check("docs/work-items/A-1", vec![]).await;
    write(&dir, "docs/work-items/A-10/x.md", "x\n");
    write(&dir, "README.md", "changed\n");
    check(
        "docs/work-items/A-1",
        vec!["README.md", "docs/work-items/A-10/x.md"],
    )
    .await;
    check("", vec![]).await;
    // A rename out of the area counts on both sides.
    orch_exec::run(
        &orch_exec::Cmd::new("git")
            .args(["mv", "src/old.rs", "docs/work-items/A-1/old.rs"])
            .cwd(&dir),
    )
    .await
    .unwrap();
    check(
        "docs/work-items/A-1",
        vec!["README.md", "docs/work-items/A-10/x.md", "src/old.rs"],
    )
    .await;
}

#[tokio::test]
async fn worktree_add_is_idempotent_and_repairs_leftovers() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let base = head(&repo).await;
    let wt = repo.join("worktrees/A-1");

    assert_eq!(
        git.worktree_add(&repo, &wt, "orch/A-1", "main")
            .await
            .unwrap(),
        WorktreeAdd::Created
    );
    // The main checkout does not see its worktrees as untracked files (and clean keeps them).
    assert!(is_clean(&repo).await);
    git.clean(&repo).await.unwrap();
    assert!(wt.join("README.md").exists());
    assert_eq!(
        git.current_branch(&wt).await.unwrap().as_deref(),
        Some("orch/A-1")
    );
    assert_eq!(head(&wt).await, base);
    let work = commit(&wt, "docs/work-items/A-1/02.md", "req\n").await;
    write(&wt, "uncommitted.txt", "keep me\n");

    // Twice, then twice at once: the healthy worktree is reused, uncommitted work included.
    assert_eq!(
        git.worktree_add(&repo, &wt, "orch/A-1", "main")
            .await
            .unwrap(),
        WorktreeAdd::Reused
    );
    let (a, b) = tokio::join!(
        git.worktree_add(&repo, &wt, "orch/A-1", "main"),
        git.worktree_add(&repo, &wt, "orch/A-1", "main")
    );
    assert_eq!(
        (a.unwrap(), b.unwrap()),
        (WorktreeAdd::Reused, WorktreeAdd::Reused)
    );
    assert_eq!(read(&wt, "uncommitted.txt"), "keep me\n");

    // Another branch at that path is not taken over.
    let err = git
        .worktree_add(&repo, &wt, "orch/B-2", "main")
        .await
        .unwrap_err();
    assert!(matches!(err, GitError::WorktreeMismatch { .. }), "{err}");

    // Directory deleted behind git's back: pruned and re-added on the existing branch.
    std::fs::remove_dir_all(&wt).unwrap();
    assert_eq!(
        git.worktree_add(&repo, &wt, "orch/A-1", "main")
            .await
            .unwrap(),
        WorktreeAdd::Repaired
    );
    assert_eq!(
        head(&wt).await,
        work,
        "the existing branch is checked out, not recreated from base"
    );

    // A broken directory (its .git file gone) is cleared and re-added.
    std::fs::remove_file(wt.join(".git")).unwrap();
    assert_eq!(
        git.worktree_add(&repo, &wt, "orch/A-1", "main")
            .await
            .unwrap(),
        WorktreeAdd::Repaired
    );
    assert_eq!(head(&wt).await, work);

    // Junk git does not know about in the worktree's place.
    let wt2 = repo.join("worktrees/C-3");
    write(&wt2, "junk/file.txt", "junk\n");
    assert_eq!(
        git.worktree_add(&repo, &wt2, "orch/C-3", "main")
            .await
            .unwrap(),
        WorktreeAdd::Repaired
    );
    assert!(!wt2.join("junk").exists());
    assert_eq!(head(&wt2).await, base);

    // An empty directory is simply used.
    let wt3 = tmp.path().join("elsewhere/D-4");
    std::fs::create_dir_all(&wt3).unwrap();
    assert_eq!(
        git.worktree_add(&repo, &wt3, "orch/D-4", "main")
            .await
            .unwrap(),
        WorktreeAdd::Created
    );
}

#[tokio::test]
async fn a_copied_worktree_is_not_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let wt = repo.join("worktrees/A-1");
    git.worktree_add(&repo, &wt, "orch/A-1", "main")
        .await
        .unwrap();
    // A copy under another name works as a checkout of A-1's branch (its .git file names
    // A-1's registration) but git has not registered it: it is not a healthy worktree.
    let copy = repo.join("worktrees/B-2");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(&wt)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        git.current_branch(&copy).await.unwrap().as_deref(),
        Some("orch/A-1")
    );
    let got = git.worktree_add(&repo, &copy, "orch/A-1", "main").await;
    assert!(
        !matches!(got, Ok(WorktreeAdd::Reused)),
        "an unregistered copy was reused: {got:?}"
    );
    // The registered one still is.
    assert_eq!(
        git.worktree_add(&repo, &wt, "orch/A-1", "main")
            .await
            .unwrap(),
        WorktreeAdd::Reused
    );
}

#[tokio::test]
async fn worktree_add_refuses_to_delete_a_repository() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let other = tmp.path().join("other");
    git.init_repo(&other, "main").await.unwrap();
    write(&other, "precious.txt", "data\n");
    let err = git
        .worktree_add(&repo, &other, "orch/A-1", "main")
        .await
        .unwrap_err();
    assert!(matches!(err, GitError::RefuseToDelete { .. }), "{err}");
    assert_eq!(read(&other, "precious.txt"), "data\n");
}

#[tokio::test]
async fn worktree_remove_is_idempotent() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let wt = repo.join("worktrees/A-1");
    git.worktree_add(&repo, &wt, "orch/A-1", "main")
        .await
        .unwrap();
    write(&wt, "dirty.txt", "uncommitted\n");

    git.worktree_remove(&repo, &wt).await.unwrap();
    assert!(!wt.exists());
    git.worktree_remove(&repo, &wt).await.unwrap();
    // The branch stays; adding again checks it out.
    assert!(
        git.rev_parse(&repo, "refs/heads/orch/A-1")
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(
        git.worktree_add(&repo, &wt, "orch/A-1", "main")
            .await
            .unwrap(),
        WorktreeAdd::Created
    );

    // Directory already gone: still fine, and git forgets it.
    std::fs::remove_dir_all(&wt).unwrap();
    git.worktree_remove(&repo, &wt).await.unwrap();
    assert_eq!(
        git.worktree_add(&repo, &wt, "orch/A-1", "main")
            .await
            .unwrap(),
        WorktreeAdd::Created
    );
}

#[tokio::test]
async fn merge_commit_fast_forward_and_conflict() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let wt = repo.join("worktrees/A-1");
    git.worktree_add(&repo, &wt, "orch/A-1", "main")
        .await
        .unwrap();
    let feature = commit(&wt, "feature.txt", "feature\n").await;

    // Fast-forward when main has not moved.
    let merged = git
        .merge(&repo, "orch/A-1", MergeStrategy::FastForwardOnly)
        .await
        .unwrap();
    assert_eq!(
        merged,
        MergeResult::Merged {
            sha: feature.clone()
        }
    );
    // Merging it again is a no-op.
    let again = git
        .merge(&repo, "orch/A-1", MergeStrategy::MergeCommit)
        .await
        .unwrap();
    assert_eq!(
        again,
        MergeResult::Merged {
            sha: feature.clone()
        }
    );

    // Diverged: fast-forward only changes nothing; a merge commit has two parents.
    let main_tip = commit(&repo, "main.txt", "main\n").await;
    let feature2 = commit(&wt, "feature2.txt", "more\n").await;
    let ff = git
        .merge(&repo, "orch/A-1", MergeStrategy::FastForwardOnly)
        .await
        .unwrap();
    assert_eq!(ff, MergeResult::NotFastForward);
    assert_eq!(head(&repo).await, main_tip);
    let MergeResult::Merged { sha } = git
        .merge(&repo, "orch/A-1", MergeStrategy::MergeCommit)
        .await
        .unwrap()
    else {
        panic!("expected a merge");
    };
    assert_eq!(
        git.rev_parse(&repo, &format!("{sha}^1")).await.unwrap(),
        Some(main_tip)
    );
    assert_eq!(
        git.rev_parse(&repo, &format!("{sha}^2")).await.unwrap(),
        Some(feature2)
    );
    assert_eq!(read(&repo, "feature2.txt"), "more\n");

    // Conflict: reported with its files, aborted, tree clean and unchanged.
    commit(&repo, "README.md", "main says\n").await;
    commit(&wt, "README.md", "branch says\n").await;
    let before = head(&repo).await;
    let conflict = git
        .merge(&repo, "orch/A-1", MergeStrategy::MergeCommit)
        .await
        .unwrap();
    assert_eq!(
        conflict,
        MergeResult::Conflict {
            files: vec!["README.md".into()]
        }
    );
    assert_eq!(head(&repo).await, before);
    assert!(is_clean(&repo).await);
    assert_eq!(read(&repo, "README.md"), "main says\n");
    assert_eq!(git.rev_parse(&repo, "MERGE_HEAD").await.unwrap(), None);

    let err = git
        .merge(&repo, "no-such-branch", MergeStrategy::MergeCommit)
        .await
        .unwrap_err();
    assert!(matches!(err, GitError::UnknownRevision { .. }), "{err}");
}

#[tokio::test]
async fn bring_a_branch_up_to_date_with_the_default_branch() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let wt = repo.join("worktrees/A-1");
    git.worktree_add(&repo, &wt, "orch/A-1", "main")
        .await
        .unwrap();

    // Behind only: fast-forward.
    let main1 = commit(&repo, "main1.txt", "1\n").await;
    assert_eq!(
        git.rebase_or_merge_default(&wt, "main").await.unwrap(),
        MergeResult::Merged { sha: main1 }
    );
    // Diverged without conflict: merged in.
    commit(&wt, "work.txt", "work\n").await;
    commit(&repo, "main2.txt", "2\n").await;
    let MergeResult::Merged { .. } = git.rebase_or_merge_default(&wt, "main").await.unwrap() else {
        panic!("expected a merge");
    };
    assert_eq!(read(&wt, "main2.txt"), "2\n");
    assert_eq!(read(&wt, "work.txt"), "work\n");
    // Conflict: aborted, the branch is as before.
    commit(&repo, "README.md", "main\n").await;
    let mine = commit(&wt, "README.md", "mine\n").await;
    let result = git.rebase_or_merge_default(&wt, "main").await.unwrap();
    assert_eq!(
        result,
        MergeResult::Conflict {
            files: vec!["README.md".into()]
        }
    );
    assert_eq!(head(&wt).await, mine);
    assert!(is_clean(&wt).await);
}

#[tokio::test]
async fn clone_push_fetch_and_remote_branches() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let origin = repo(tmp.path()).await;
    let clone = tmp.path().join("clones/repo");
    git.clone_repo(origin.to_str().unwrap(), &clone)
        .await
        .unwrap();
    assert_eq!(head(&clone).await, head(&origin).await);
    // Cloning again keeps the clone.
    let local = commit(&clone, "local.txt", "local\n").await;
    git.clone_repo(origin.to_str().unwrap(), &clone)
        .await
        .unwrap();
    assert_eq!(head(&clone).await, local);

    assert!(git.has_remote(&clone, "origin").await.unwrap());
    assert!(!git.has_remote(&clone, "upstream").await.unwrap());
    assert!(
        !git.push(&clone, "upstream", "main").await.unwrap(),
        "no remote: skipped"
    );
    assert!(!git.has_remote(&origin, "origin").await.unwrap());
    assert!(!git.fetch(&origin, "origin").await.unwrap());

    // Push a work branch from the clone; it lands in origin.
    let wt = clone.join("worktrees/A-1");
    git.worktree_add(&clone, &wt, "orch/A-1", "main")
        .await
        .unwrap();
    let work = commit(&wt, "docs/work-items/A-1/02.md", "req\n").await;
    assert!(git.push(&wt, "origin", "orch/A-1").await.unwrap());
    assert_eq!(
        git.rev_parse(&origin, "refs/heads/orch/A-1").await.unwrap(),
        Some(work.clone())
    );

    // Another machine: a fresh clone picks the work branch up from the remote.
    let other = tmp.path().join("other/repo");
    git.clone_repo(origin.to_str().unwrap(), &other)
        .await
        .unwrap();
    assert!(git.fetch(&other, "origin").await.unwrap());
    let wt_other = other.join("worktrees/A-1");
    git.worktree_add(&other, &wt_other, "orch/A-1", "main")
        .await
        .unwrap();
    assert_eq!(head(&wt_other).await, work);
    assert_eq!(read(&wt_other, "docs/work-items/A-1/02.md"), "req\n");

    // A rejected push is an error with git's words in it.
    commit(&origin, "origin-only.txt", "x\n").await;
    let err = git.push(&clone, "origin", "main").await.unwrap_err();
    let GitError::Failed { stderr, args, .. } = &err else {
        panic!("{err}")
    };
    assert!(args.contains(&"push".to_owned()));
    assert!(stderr.contains("rejected"), "{stderr}");
}

#[tokio::test]
async fn read_files_as_committed_on_a_branch() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let wt = repo.join("worktrees/A-1");
    git.worktree_add(&repo, &wt, "orch/A-1", "main")
        .await
        .unwrap();
    commit(
        &wt,
        "docs/work-items/A-1/02-requirements.md",
        "---\nstatus: ok\n---\n",
    )
    .await;
    commit(&wt, "docs/work-items/A-1/01-request.md", "request\n").await;
    write(&wt, "docs/work-items/A-1/11-review.md", "not committed\n");

    // Read from the main repository, where the branch is not checked out.
    let check_files = |path: &'static str, branch: &'static str, expect: Vec<&'static str>| {
        let (git, repo) = (git.clone(), repo.clone());
        async move {
            assert_eq!(
                git.log_files(&repo, branch, path).await.unwrap(),
                expect,
                "{branch} {path}"
            );
        }
    };
    check_files(
        "docs/work-items/A-1",
        "orch/A-1",
        vec![
            "docs/work-items/A-1/01-request.md",
            "docs/work-items/A-1/02-requirements.md",
        ],
    )
    .await;
    check_files("docs/work-items/A-1", "main", vec![]).await;
    check_files("docs/work-items/A-1", "orch/no-such", vec![]).await;
    check_files("README.md", "orch/A-1", vec!["README.md"]).await;
    // The same files with their contents, in a fixed number of processes.
    assert_eq!(
        git.files_at(&repo, "orch/A-1", "docs/work-items/A-1")
            .await
            .unwrap(),
        vec![
            (
                "docs/work-items/A-1/01-request.md".to_owned(),
                "request\n".to_owned()
            ),
            (
                "docs/work-items/A-1/02-requirements.md".to_owned(),
                "---\nstatus: ok\n---\n".to_owned()
            ),
        ]
    );
    assert!(
        git.files_at(&repo, "orch/no-such", "docs/work-items/A-1")
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        git.files_at(&repo, "main", "docs/work-items/A-1")
            .await
            .unwrap()
            .is_empty()
    );

    let show = |rev: &'static str, path: &'static str| {
        let (git, repo) = (git.clone(), repo.clone());
        async move { git.show_file(&repo, rev, path).await.unwrap() }
    };
    assert_eq!(
        show("orch/A-1", "docs/work-items/A-1/02-requirements.md")
            .await
            .as_deref(),
        Some("---\nstatus: ok\n---\n")
    );
    assert_eq!(
        show("orch/A-1", "docs/work-items/A-1/11-review.md").await,
        None
    );
    assert_eq!(
        show("main", "docs/work-items/A-1/01-request.md").await,
        None
    );
    assert_eq!(show("orch/no-such", "README.md").await, None);
    assert_eq!(
        show("orch/A-1", "docs").await,
        None,
        "a directory is not a file"
    );

    let changed = git
        .changed_files_between(&repo, "main", "orch/A-1")
        .await
        .unwrap();
    assert_eq!(
        changed,
        vec![
            "docs/work-items/A-1/01-request.md",
            "docs/work-items/A-1/02-requirements.md"
        ]
    );
}

#[tokio::test]
async fn reset_hard_and_clean_restore_a_clean_tree() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let first = commit(&repo, ".gitignore", "target/\n").await;
    commit(&repo, "second.txt", "2\n").await;
    write(&repo, "README.md", "dirty\n");
    write(&repo, "untracked/dir/file.txt", "x\n");
    write(&repo, "target/build.out", "kept\n");

    git.reset_hard(&repo, &first).await.unwrap();
    git.clean(&repo).await.unwrap();
    assert_eq!(head(&repo).await, first);
    assert_eq!(read(&repo, "README.md"), "hello\n");
    assert!(!repo.join("second.txt").exists());
    assert!(!repo.join("untracked").exists());
    // Ignored build output is kept.
    assert_eq!(read(&repo, "target/build.out"), "kept\n");
    assert!(is_clean(&repo).await);
}

#[tokio::test]
async fn errors_name_the_command_the_directory_and_git_words() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let err = git.current_branch(tmp.path()).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("symbolic-ref"), "{text}");
    assert!(text.contains(&tmp.path().display().to_string()), "{text}");
    assert!(text.contains("not a git repository"), "{text}");

    let missing = Git {
        bin: "/nonexistent/git".into(),
        ..Git::new()
    };
    let err = missing.rev_parse(tmp.path(), "HEAD").await.unwrap_err();
    assert!(matches!(err, GitError::Spawn { .. }), "{err}");
    let cause = std::error::Error::source(&err).unwrap().to_string();
    assert!(cause.contains("not found"), "{cause}");
}

#[tokio::test]
async fn branch_moves_are_compare_and_swap() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let dir = repo(tmp.path()).await;
    let first = head(&dir).await;
    let second = commit(&dir, "a.txt", "a\n").await;
    git.detach_head(&dir).await.unwrap();
    assert_eq!(git.current_branch(&dir).await.unwrap(), None);
    // main is at `second`: a move that expects `first` loses and changes nothing.
    assert!(
        git.update_branch(&dir, "main", &first, Some(&first))
            .await
            .is_err()
    );
    assert_eq!(git.rev_parse(&dir, "main").await.unwrap().unwrap(), second);
    git.update_branch(&dir, "main", &first, Some(&second))
        .await
        .unwrap();
    assert_eq!(git.rev_parse(&dir, "main").await.unwrap().unwrap(), first);
    // Creating a branch expects it to be absent.
    git.update_branch(&dir, "new", &first, None).await.unwrap();
    assert!(git.update_branch(&dir, "new", &second, None).await.is_err());
    // The detached checkout's working tree did not move with the branch.
    assert!(is_clean(&dir).await);
}

#[tokio::test]
async fn commit_files_onto_and_revert_onto_touch_no_working_tree() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let dir = repo(tmp.path()).await;
    let base = head(&dir).await;
    // The change to revert: code plus its work item's docs.
    write(&dir, "app.py", "print('v2')\n");
    write(&dir, "docs/work-items/APP-1/01-request.md", "request\n");
    let change = git
        .add_and_commit(&dir, &Pathspec::All, "APP-1\n\nWork-Item: APP-1")
        .await
        .unwrap()
        .unwrap();
    git.detach_head(&dir).await.unwrap();
    // A later docs-only commit on main, made without a working tree.
    let later = git
        .commit_files_onto(
            &dir,
            &change,
            &[(
                "docs/work-items/APP-1/17-lessons.md".into(),
                b"lessons\n".to_vec(),
            )],
            "audit\n\nWork-Item: APP-1\nStage: audit",
        )
        .await
        .unwrap();
    assert_eq!(
        git.show_file(&dir, &later, "docs/work-items/APP-1/17-lessons.md")
            .await
            .unwrap()
            .as_deref(),
        Some("lessons\n")
    );
    assert_eq!(
        git.show_file(&dir, &later, "app.py")
            .await
            .unwrap()
            .as_deref(),
        Some("print('v2')\n")
    );
    // Revert base..change on top of `later`, keeping the work item's docs.
    let reverted = match git
        .revert_onto(
            &dir,
            &later,
            &base,
            &change,
            "docs/work-items/APP-1",
            "Revert APP-1",
        )
        .await
        .unwrap()
    {
        RevertResult::Reverted { sha } => sha,
        other => panic!("expected a revert, got {other:?}"),
    };
    assert_eq!(
        git.show_file(&dir, &reverted, "app.py").await.unwrap(),
        None
    );
    assert_eq!(
        git.show_file(&dir, &reverted, "README.md")
            .await
            .unwrap()
            .as_deref(),
        Some("hello\n")
    );
    for doc in ["01-request.md", "17-lessons.md"] {
        assert!(
            git.show_file(&dir, &reverted, &format!("docs/work-items/APP-1/{doc}"))
                .await
                .unwrap()
                .is_some(),
            "{doc} is kept"
        );
    }
    let messages = git
        .commit_messages(&dir, &format!("{base}..{reverted}"))
        .await
        .unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(messages[0].0, reverted);
    assert!(messages[2].1.contains("Work-Item: APP-1"));
    assert!(is_clean(&dir).await);

    // A later change to the same lines makes the revert conflict: nothing is made.
    let edited = git
        .commit_files_onto(
            &dir,
            &later,
            &[("app.py".into(), b"print('v3')\n".to_vec())],
            "edit",
        )
        .await
        .unwrap();
    match git
        .revert_onto(
            &dir,
            &edited,
            &base,
            &change,
            "docs/work-items/APP-1",
            "Revert APP-1",
        )
        .await
        .unwrap()
    {
        RevertResult::Conflict { files } => assert_eq!(files, ["app.py"]),
        other => panic!("expected a conflict, got {other:?}"),
    }
}

#[tokio::test]
async fn a_branch_left_registered_at_a_gone_path_is_added_at_a_new_one() {
    let tmp = tempfile::tempdir().unwrap();
    let git = Git::new();
    let repo = repo(tmp.path()).await;
    let old = repo.join("worktrees/A-1");
    git.worktree_add(&repo, &old, "orch/A-1", "main")
        .await
        .unwrap();
    let work = commit(&old, "docs/work-items/A-1/02.md", "req\n").await;
    // The directory is gone but git still has it registered with the branch checked out: a
    // plain `git worktree add` of that branch elsewhere is refused until it is pruned.
    std::fs::remove_dir_all(&old).unwrap();
    let elsewhere = repo.join("worktrees/moved/A-1");
    let got = git
        .worktree_add(&repo, &elsewhere, "orch/A-1", "main")
        .await
        .unwrap();
    assert!(
        matches!(got, WorktreeAdd::Created | WorktreeAdd::Repaired),
        "{got:?}"
    );
    assert_eq!(
        git.current_branch(&elsewhere).await.unwrap().as_deref(),
        Some("orch/A-1")
    );
    assert_eq!(
        head(&elsewhere).await,
        work,
        "the branch's work is checked out"
    );
    // Reused from then on, without the lock.
    assert_eq!(
        git.worktree_add(&repo, &elsewhere, "orch/A-1", "main")
            .await
            .unwrap(),
        WorktreeAdd::Reused
    );
}
