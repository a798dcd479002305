//! Stale git lock files: a git process killed -9 (with orch) leaves `index.lock` or a
//! `refs/heads/*.lock` behind, and every later git command in that checkout failed. orch clears
//! such a lock when no git process works in the repository any more, and never while one does.

use std::path::{Path, PathBuf};
use std::time::Duration;

use orch_exec::git::{Git, Pathspec, stale_lock};

async fn repo(tmp: &Path) -> PathBuf {
    let git = Git::new();
    let dir = tmp.join("repo");
    git.init_repo(&dir, "main").await.unwrap();
    std::fs::write(dir.join("README.md"), "hello\n").unwrap();
    git.add_and_commit(&dir, &Pathspec::All, "initial")
        .await
        .unwrap()
        .unwrap();
    dir
}

#[tokio::test]
async fn index_lock_left_by_a_killed_git_is_cleared() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = repo(tmp.path()).await;
    std::fs::write(dir.join(".git/index.lock"), "").unwrap();
    std::fs::write(dir.join("a.txt"), "a\n").unwrap();
    let commit = Git::new()
        .add_and_commit(&dir, &Pathspec::All, "after a crash")
        .await
        .expect("the stale index.lock does not block git");
    assert!(commit.is_some());
    assert!(!dir.join(".git/index.lock").exists());
}

#[tokio::test]
async fn branch_ref_lock_left_by_a_killed_git_is_cleared() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = repo(tmp.path()).await;
    std::fs::write(dir.join(".git/refs/heads/main.lock"), "").unwrap();
    std::fs::write(dir.join("b.txt"), "b\n").unwrap();
    let commit = Git::new()
        .add_and_commit(&dir, &Pathspec::All, "after a crash")
        .await
        .expect("the stale ref lock does not block a commit");
    assert!(commit.is_some());
    assert!(!dir.join(".git/refs/heads/main.lock").exists());
}

#[tokio::test]
async fn a_live_holders_lock_is_left_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = repo(tmp.path()).await;
    let lock = dir.join(".git/index.lock");
    std::fs::write(&lock, "").unwrap();
    // A process named `git` working in the repository holds it.
    let fake_git = tmp.path().join("git");
    std::fs::copy("/bin/sleep", &fake_git).unwrap();
    let mut holder = std::process::Command::new(&fake_git)
        .arg("60")
        .current_dir(&dir)
        .spawn()
        .unwrap();
    let message = format!(
        "fatal: Unable to create '{}': File exists.\n",
        lock.display()
    );
    // Wait until the holder is visible as `git` in /proc (exec done).
    let pid = holder.id();
    for _ in 0..100 {
        if std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "git") {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(stale_lock(&message, Duration::from_secs(60)), None);
    std::fs::write(dir.join("c.txt"), "c\n").unwrap();
    let held = Git::new()
        .add_and_commit(&dir, &Pathspec::All, "while held")
        .await;
    assert!(
        held.is_err(),
        "git waits for a live holder's lock: {held:?}"
    );
    assert!(lock.exists(), "a live holder's lock is never removed");
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_eq!(
        stale_lock(&message, Duration::from_secs(60)),
        Some(lock.clone()),
        "once the holder is gone the lock is stale"
    );
}
