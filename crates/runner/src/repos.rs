//! Where repos and worktrees live on this machine: `<repos_dir>/<repo>` is orch's own clone of
//! each declared repo (with a detached `HEAD`: its default branch moves only by
//! compare-and-swap when the release train promotes or reverts, then is published to `origin`),
//! and `<repos_dir>/<repo>/worktrees/<id>` is one work item's worktree on branch `orch/<id>`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use anyhow::{Context as _, Result};
use orch_domain::config::RepoConfig;
use orch_domain::ids::{RepoName, WorkItemId};
use orch_exec::git::{Git, WorktreeAdd};

/// Paths of one repo on this machine.
#[derive(Debug, Clone)]
pub struct RepoPaths {
    pub repo_dir: PathBuf,
}

impl RepoPaths {
    pub fn new(repos_dir: &Path, repo: &RepoName) -> RepoPaths {
        RepoPaths {
            repo_dir: repos_dir.join(repo.as_str()),
        }
    }

    pub fn worktree(&self, work_item: &WorkItemId) -> PathBuf {
        self.repo_dir.join("worktrees").join(work_item.as_str())
    }
}

static CLONE_LOCKS: LazyLock<Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn clone_lock(dir: &Path) -> Arc<tokio::sync::Mutex<()>> {
    match CLONE_LOCKS.lock() {
        Ok(mut m) => m.entry(dir.to_path_buf()).or_default().clone(),
        Err(_) => Arc::new(tokio::sync::Mutex::new(())),
    }
}

/// Makes sure orch's clone of `repo` exists: cloned from `url`, or from the local `path`
/// (resolved against `root`). Idempotent; concurrent callers in this process wait for one clone.
pub async fn ensure_clone(
    git: &Git,
    root: &Path,
    paths: &RepoPaths,
    name: &RepoName,
    repo: &RepoConfig,
) -> Result<()> {
    let lock = clone_lock(&paths.repo_dir);
    let _held = lock.lock().await;
    if paths.repo_dir.join(".git").exists() {
        return detach(git, &paths.repo_dir).await;
    }
    let source = match (&repo.url, &repo.path) {
        (Some(url), _) => url.clone(),
        (None, Some(path)) => {
            let p = Path::new(path);
            let p = if p.is_absolute() {
                p.to_path_buf()
            } else {
                root.join(p)
            };
            p.display().to_string()
        }
        (None, None) => anyhow::bail!("[repos.{name}] has neither `path` nor `url`"),
    };
    if let Some(parent) = paths.repo_dir.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    git.clone_repo(&source, &paths.repo_dir)
        .await
        .with_context(|| format!("cannot clone repo {name} from {source}"))?;
    detach(git, &paths.repo_dir).await
}

/// orch's clone keeps a detached `HEAD`: its branches move only by compare-and-swap of their
/// refs (the release train), never by a working tree that could be left half-updated.
async fn detach(git: &Git, repo_dir: &Path) -> Result<()> {
    if git.current_branch(repo_dir).await?.is_some() {
        git.detach_head(repo_dir)
            .await
            .with_context(|| format!("cannot detach HEAD of {}", repo_dir.display()))?;
    }
    Ok(())
}

/// The remote orch's clone fetches from and publishes to.
pub const REMOTE: &str = "origin";

/// Makes the local default branch exactly what the remote has (the remote is the truth when
/// there is one: a local move that was never published is dropped). Returns the head.
pub async fn sync_default_branch(git: &Git, repo_dir: &Path, branch: &str) -> Result<String> {
    if git.has_remote(repo_dir, REMOTE).await? {
        git.fetch(repo_dir, REMOTE)
            .await
            .with_context(|| format!("cannot fetch `{REMOTE}` in {}", repo_dir.display()))?;
        let upstream = format!("refs/remotes/{REMOTE}/{branch}");
        if let Some(remote) = git.rev_parse(repo_dir, &upstream).await? {
            let local = git
                .rev_parse(repo_dir, &format!("refs/heads/{branch}"))
                .await?;
            if local.as_deref() != Some(remote.as_str()) {
                git.update_branch(repo_dir, branch, &remote, local.as_deref())
                    .await
                    .with_context(|| format!("cannot set `{branch}` to `{upstream}`"))?;
            }
            return Ok(remote);
        }
    }
    git.rev_parse(repo_dir, &format!("refs/heads/{branch}"))
        .await?
        .with_context(|| format!("branch `{branch}` has no commit in {}", repo_dir.display()))
}

/// Moves the default branch from exactly `old` to `new`: in orch's clone, then on the remote
/// (a push that succeeds only if the remote's branch is still at `old`). Either move losing
/// its compare-and-swap is an error and the caller starts over from [`sync_default_branch`].
pub async fn publish_default_branch(
    git: &Git,
    repo_dir: &Path,
    repo: &RepoConfig,
    old: &str,
    new: &str,
) -> Result<()> {
    let branch = repo.default_branch.as_str();
    if git.has_remote(repo_dir, REMOTE).await? {
        git.push_lease(repo_dir, REMOTE, branch, old, new)
            .await
            .with_context(|| {
                format!("cannot move `{branch}` on `{REMOTE}` from {old:.12} to {new:.12}")
            })?;
    }
    let local = git
        .rev_parse(repo_dir, &format!("refs/heads/{branch}"))
        .await?;
    if local.as_deref() != Some(new) {
        git.update_branch(repo_dir, branch, new, Some(old))
            .await
            .with_context(|| format!("cannot move `{branch}` from {old:.12} to {new:.12}"))?;
    }
    Ok(())
}

/// The checkout a release's commands (deploy, rollback) run in: a worktree with a detached
/// `HEAD` at exactly the revision being released (`<repo_dir>/worktrees/.release`).
pub async fn release_checkout(git: &Git, paths: &RepoPaths, rev: &str) -> Result<PathBuf> {
    let dir = paths.repo_dir.join("worktrees").join(".release");
    git.worktree_detached(&paths.repo_dir, &dir, rev)
        .await
        .with_context(|| format!("cannot check out {rev:.12} for the release"))?;
    Ok(dir)
}

/// Creates (or reuses, or repairs) the work item's worktree and resets it to the branch's
/// committed state, so a crashed attempt's leftovers never leak into the next attempt.
pub async fn prepare_worktree(
    git: &Git,
    paths: &RepoPaths,
    work_item: &WorkItemId,
    default_branch: &str,
) -> Result<PathBuf> {
    let worktree = paths.worktree(work_item);
    let added = git
        .worktree_add(
            &paths.repo_dir,
            &worktree,
            &work_item.branch_name(),
            default_branch,
        )
        .await
        .with_context(|| format!("cannot prepare the worktree of {work_item}"))?;
    if added != WorktreeAdd::Created {
        git.reset_hard(&worktree, "HEAD").await?;
        git.clean(&worktree).await?;
    }
    Ok(worktree)
}
