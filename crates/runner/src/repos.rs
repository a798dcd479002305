//! Where repos and worktrees live on this machine: `<repos_dir>/<repo>` is orch's own clone of
//! each declared repo, with a detached `HEAD`: its default branch moves only by compare-and-swap
//! when the release train promotes a staged commit, reverts or records the audit trail
//! ([`move_default_branch`]), and is then published to `origin` by [`publish_default_branch`];
//! `<repos_dir>/<repo>/worktrees/<id>` is one work item's worktree on branch `orch/<id>`, and
//! `<repos_dir>/<repo>/worktrees/.release` a checkout of exactly the revision a release command
//! acts on.
//!
//! The repository a user declares is one of three setups ([`Setup`]); what orch does to each:
//! - **remote URL** (`url = "file://…"`, ssh, https): the default branch is pushed with
//!   `--force-with-lease=<branch>:<old>` (never a plain force), and the work items' `orch/<id>`
//!   branches are pushed too (other machines continue from them). Credentials come from git's
//!   own environment (ssh agent, credential helper, `GIT_ASKPASS`); orch never prompts
//!   (`GIT_TERMINAL_PROMPT=0`) and redacts a password written into a URL from what it prints.
//! - **bare repository** (`path` to a bare repo): the same lease push.
//! - **ordinary checkout** (`path` to a working tree): orch never pushes into it. It fetches the
//!   new commits into the checkout's object store (no ref, index or file changes), then:
//!   - the default branch not checked out anywhere: the branch ref is moved `old → new` with
//!     `git update-ref` (a compare-and-swap);
//!   - checked out, no staged or modified tracked files, `HEAD` at `old`: `git merge --ff-only`
//!     in that checkout (what `git pull --ff-only` would do; untracked files are kept, and git
//!     refuses rather than overwrite one);
//!   - checked out with local changes: the checkout is left exactly as it is and the merge
//!     stays in orch's clone only ([`Outcome::CloneOnly`], a warning with the command to run);
//!     a later publish moves it once the checkout is clean.
//!
//!   `orch/<id>` branches stay in orch's clone (they are not pushed into the checkout).
//!
//! In every setup a branch that is not at `old` is an error naming both revisions: orch never
//! overwrites a commit it has not seen.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use anyhow::{Context as _, Result};
use orch_domain::config::RepoConfig;
use orch_domain::ids::{RepoName, WorkItemId};
use orch_exec::git::{Git, MergeResult, MergeStrategy, WorktreeAdd};

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
    // Every stage job comes here first: a clone already there with its HEAD detached (as orch
    // keeps it) needs nothing, and is seen without queueing for the lock behind the other jobs
    // of the repo. Only reads; anything else takes the lock below.
    if head_detached(&paths.repo_dir) {
        return Ok(());
    }
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
    let parent = paths
        .repo_dir
        .parent()
        .with_context(|| format!("{} has no parent directory", paths.repo_dir.display()))?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    // Cloned beside the final place and moved there whole: a clone killed half-way (orch
    // killed -9 during its checkout) never sits where the next job looks, where it would be a
    // repository whose checkout cannot be detached. Leftovers of such clones are removed.
    remove_dead_clones(parent, name.as_str());
    let tmp = parent.join(format!("{CLONING_PREFIX}{name}.{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .with_context(|| format!("cannot remove the unfinished clone {}", tmp.display()))?;
    }
    git.clone_repo(&source, &tmp)
        .await
        .with_context(|| format!("cannot clone repo {name} from {source}"))?;
    detach(git, &tmp).await?;
    match std::fs::rename(&tmp, &paths.repo_dir) {
        Ok(()) => Ok(()),
        // Another orch process on this machine finished its clone first: use that one.
        Err(_) if paths.repo_dir.join(".git").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            detach(git, &paths.repo_dir).await
        }
        Err(e) => Err(e).with_context(|| {
            format!(
                "cannot move the clone {} to {}",
                tmp.display(),
                paths.repo_dir.display()
            )
        }),
    }
}

/// The prefix of a clone being made (`.cloning-<repo>.<pid>` beside the repo's directory).
const CLONING_PREFIX: &str = ".cloning-";

/// Removes the unfinished clones of `repo` in `parent` whose process is gone. Best effort.
fn remove_dead_clones(parent: &Path, repo: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let prefix = format!("{CLONING_PREFIX}{repo}.");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if orch_exec::process::process_gone(pid) {
            let path = entry.path();
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {
                    tracing::info!(dir = %path.display(), "removed a clone left unfinished by a process that is gone")
                }
                Err(e) => {
                    tracing::warn!(dir = %path.display(), error = %e, "cannot remove an unfinished clone")
                }
            }
        }
    }
}

/// Whether `repo_dir` is a clone (a `.git` directory) whose `HEAD` file holds a commit id
/// rather than a branch ref: read from the file `git symbolic-ref` reads, so the check of every
/// stage job starts no process. False on any doubt (the locked path then decides).
fn head_detached(repo_dir: &Path) -> bool {
    let head = repo_dir.join(".git").join("HEAD");
    // A symbolic link (`core.preferSymlinkRefs`) is an attached HEAD whose target holds an id.
    if !std::fs::symlink_metadata(&head).is_ok_and(|m| m.file_type().is_file()) {
        return false;
    }
    std::fs::read_to_string(head).is_ok_and(|head| {
        let head = head.trim();
        matches!(head.len(), 40 | 64) && head.bytes().all(|b| b.is_ascii_hexdigit())
    })
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

/// Brings orch's default branch up to date with `origin`'s and returns it. The remote is the
/// truth for what others did: a local branch behind it is fast-forwarded. A local branch
/// *ahead* of it holds releases that could not be published yet (a user's checkout with local
/// changes, [`Outcome::CloneOnly`]): it is kept and publishing is tried again. Diverged
/// branches are an error naming both (orch never drops a released commit by itself).
pub async fn sync_default_branch(git: &Git, repo_dir: &Path, repo: &RepoConfig) -> Result<String> {
    let branch = repo.default_branch.as_str();
    let local = git
        .rev_parse(repo_dir, &format!("refs/heads/{branch}"))
        .await?;
    if !git.has_remote(repo_dir, ORIGIN).await? {
        return local
            .with_context(|| format!("branch `{branch}` has no commit in {}", repo_dir.display()));
    }
    git.fetch(repo_dir, ORIGIN)
        .await
        .with_context(|| format!("cannot fetch `{ORIGIN}` in {}", repo_dir.display()))?;
    let upstream = format!("refs/remotes/{ORIGIN}/{branch}");
    let Some(remote) = git.rev_parse(repo_dir, &upstream).await? else {
        return local
            .with_context(|| format!("branch `{branch}` has no commit in {}", repo_dir.display()));
    };
    let Some(local) = local else {
        git.update_branch(repo_dir, branch, &remote, None).await?;
        return Ok(remote);
    };
    if local == remote {
        return Ok(local);
    }
    if git.is_ancestor(repo_dir, &local, &remote).await? {
        git.update_branch(repo_dir, branch, &remote, Some(&local))
            .await
            .with_context(|| format!("cannot fast-forward `{branch}` to `{upstream}`"))?;
        return Ok(remote);
    }
    if git.is_ancestor(repo_dir, &remote, &local).await? {
        let published = publish_default_branch(git, repo_dir, repo, &remote, &local).await?;
        if let Some(warning) = published.warning() {
            tracing::warn!(repo = %repo_dir.display(), %warning, "the default branch is still ahead of origin's");
        }
        return Ok(local);
    }
    anyhow::bail!(
        "`{branch}` in orch's clone ({}) and in `{ORIGIN}` ({}) diverged: someone rewrote it while orch had releases not yet published there; reconcile them (e.g. merge orch's `{branch}` into yours) and retry",
        short(&local),
        short(&remote)
    )
}

/// Moves the default branch from exactly `old` to `new` (a release: a promotion, a revert, the
/// audit trail): on `origin` first ([`publish_default_branch`]), then in orch's clone (a ref
/// compare-and-swap). Either one losing its race is an error; the caller starts over from
/// [`sync_default_branch`].
pub async fn move_default_branch(
    git: &Git,
    repo_dir: &Path,
    repo: &RepoConfig,
    old: &str,
    new: &str,
) -> Result<Published> {
    let branch = repo.default_branch.as_str();
    let published = if git.has_remote(repo_dir, ORIGIN).await? {
        Some(publish_default_branch(git, repo_dir, repo, old, new).await?)
    } else {
        None
    };
    let local = git
        .rev_parse(repo_dir, &format!("refs/heads/{branch}"))
        .await?;
    if local.as_deref() != Some(new) {
        git.update_branch(repo_dir, branch, new, Some(old))
            .await
            .with_context(|| {
                format!(
                    "cannot move `{branch}` from {} to {}",
                    short(old),
                    short(new)
                )
            })?;
    }
    Ok(published.unwrap_or(Published {
        outcome: Outcome::AlreadyThere,
        target: repo_dir.display().to_string(),
        message: "no remote: orch's clone only".to_owned(),
    }))
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

/// Before a stage runs where work branches are shared, or after this node took over a work
/// item from a node that is gone (design.md §10): fetches `origin` so the revisions and the
/// `orch/<id>` branch other nodes pushed are here, and puts the local `orch/<id>` where the
/// remote's is. The remote is the record: every stage's result reaches it by a push fenced by
/// the stage's lease, and a stage only completes once its push is done
/// ([`crate::engine`]). A local branch behind it (an earlier stage this node ran) is
/// fast-forwarded. A local branch with commits the remote lacks holds an attempt that never
/// completed (a node cut off after it committed, whose lease was gone by the push): it is moved
/// to the remote's commit, its own kept under `refs/orch/stale/orch/<id>/<commit>`, and
/// `Some(what was set aside)` says so, for an event. Built on, that attempt would have
/// replaced the completed stages' work on the remote (the three-host test saw each stage push
/// over the previous one's). Nothing to do without a remote, or before the remote has the
/// branch.
pub async fn catch_up_work_branch(
    git: &Git,
    paths: &RepoPaths,
    work_item: &WorkItemId,
) -> Result<Option<String>> {
    let repo_dir = &paths.repo_dir;
    if !git.fetch(repo_dir, ORIGIN).await.with_context(|| {
        format!(
            "cannot fetch `{ORIGIN}` in {} to catch `orch/{work_item}` up",
            repo_dir.display()
        )
    })? {
        return Ok(None);
    }
    let branch = work_item.branch_name();
    let local = git
        .rev_parse(repo_dir, &format!("refs/heads/{branch}"))
        .await?;
    let remote = git
        .rev_parse(repo_dir, &format!("refs/remotes/{ORIGIN}/{branch}"))
        .await?;
    let (Some(local), Some(remote)) = (local, remote) else {
        return Ok(None);
    };
    if local == remote {
        return Ok(None);
    }
    if git.is_ancestor(repo_dir, &local, &remote).await? {
        git.update_branch(repo_dir, &branch, &remote, Some(&local))
            .await
            .with_context(|| format!("cannot fast-forward `{branch}` to `{remote:.12}`"))?;
        return Ok(None);
    }
    let kept = format!("refs/orch/stale/{branch}/{local}");
    git.update_ref(repo_dir, &kept, &local, None)
        .await
        .with_context(|| format!("cannot keep `{branch}`'s {local:.12} as `{kept}`"))?;
    git.update_branch(repo_dir, &branch, &remote, Some(&local))
        .await
        .with_context(|| format!("cannot move `{branch}` to the remote's `{remote:.12}`"))?;
    let message = format!(
        "`{branch}` here held {local:.12}, commits the remote does not have (an attempt that never completed); moved to the remote's {remote:.12}, the old commit kept as `{kept}`"
    );
    tracing::warn!(%work_item, %message, "stale work branch set aside");
    Ok(Some(message))
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
    // A reused worktree is put back to its last commit, which is nearly always where the last
    // job left it: one `status` (changed, staged and untracked files; ignored ones are left
    // alone either way) and a look for a merge, cherry-pick or revert left in progress say so,
    // instead of running `reset --hard` and `clean -d` on every stage job.
    // A listing git cannot give (more changes than orch reads) is a reason to reset too.
    if added != WorktreeAdd::Created
        && (git.operation_in_progress(&worktree)
            || git
                .status_porcelain(&worktree)
                .await
                .map_or(true, |s| !s.is_empty()))
    {
        git.reset_hard(&worktree, "HEAD").await?;
        git.clean(&worktree).await?;
    }
    Ok(worktree)
}

/// The kind of repository a `[repos.<name>]` points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setup {
    /// `url`: a remote that orch pushes to (the URL is kept redacted).
    Remote { url: String },
    /// `path` to a bare repository.
    Bare { path: PathBuf },
    /// `path` to an ordinary checkout (a working tree).
    Checkout { path: PathBuf },
}

impl Setup {
    /// What orch does to this setup, in one sentence for `orch doctor`.
    pub fn explain(&self, default_branch: &str) -> String {
        match self {
            Setup::Remote { url } => format!(
                "remote {url}: merges are pushed to `{default_branch}` with a lease (never forced); work branches `orch/<id>` are pushed too"
            ),
            Setup::Bare { path } => format!(
                "bare repository {}: merges are pushed to `{default_branch}` with a lease (never forced); work branches `orch/<id>` are pushed too",
                path.display()
            ),
            Setup::Checkout { path } => format!(
                "your checkout {}: orch never pushes into it; a merge fast-forwards `{default_branch}` there when it is checked out with no local changes (or moves the branch ref when it is not checked out); with local changes the checkout is left alone and orch says so; `orch/<id>` branches stay in orch's clone",
                path.display()
            ),
        }
    }
}

/// The local path of `repo`'s `path`, resolved against `root`.
pub fn local_path(root: &Path, repo: &RepoConfig) -> Option<PathBuf> {
    let p = Path::new(repo.path.as_deref()?);
    Some(if p.is_absolute() {
        p.to_path_buf()
    } else {
        root.join(p)
    })
}

/// Classifies the repository `repo` points at (`root` resolves a relative `path`); the error
/// tells a missing path from a directory that is not a git repository.
pub async fn inspect(git: &Git, root: &Path, repo: &RepoConfig) -> Result<Setup> {
    if let Some(url) = &repo.url {
        return Ok(Setup::Remote {
            url: redact_url(url),
        });
    }
    let path = local_path(root, repo).context("neither `path` nor `url` is set")?;
    local_setup(git, &path).await
}

async fn local_setup(git: &Git, path: &Path) -> Result<Setup> {
    if !path.exists() {
        anyhow::bail!("{} does not exist", path.display());
    }
    if !path.is_dir() {
        anyhow::bail!("{} is not a directory", path.display());
    }
    let top = git
        .is_bare(path)
        .await
        .map_err(|e| anyhow::anyhow!("{} is not a git repository ({e})", path.display()))?;
    if top {
        return Ok(Setup::Bare {
            path: path.to_path_buf(),
        });
    }
    Ok(Setup::Checkout {
        path: path.to_path_buf(),
    })
}

/// `url` with any password (or token) in its user part replaced by `***`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let host_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(host_end);
    match authority.rsplit_once('@') {
        // A user part can be a token by itself (`https://<token>@host`): all of it goes.
        Some((_, host)) => format!("{scheme}://***@{host}{path}"),
        None => url.to_owned(),
    }
}

/// Replaces every occurrence of `url`'s password in `text` (git may echo the URL).
fn redact_in(text: &str, url: &str) -> String {
    let Some((_, rest)) = url.split_once("://") else {
        return text.to_owned();
    };
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    match authority.rsplit_once('@') {
        Some((userinfo, _)) if !userinfo.is_empty() => {
            let mut out = text.replace(userinfo, "***");
            for part in userinfo.split(':').filter(|p| p.len() >= 4) {
                out = out.replace(part, "***");
            }
            out
        }
        _ => text.to_owned(),
    }
}

/// How [`publish_default_branch`] published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The remote or bare repository's branch was moved by a lease push.
    Pushed,
    /// The branch was already at `new`; nothing changed.
    AlreadyThere,
    /// The user's checkout had the branch checked out, clean, and was fast-forwarded.
    CheckoutFastForwarded,
    /// The branch is not checked out in the user's repository: only its ref was moved.
    RefUpdated,
    /// The user's checkout has local changes (or is mid-operation): it was left alone and the
    /// change is in orch's clone only. Not a failure; [`Published::warning`] says what to do.
    CloneOnly,
}

/// What [`publish_default_branch`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub outcome: Outcome,
    /// Where it published (a path, or the URL with its password redacted).
    pub target: String,
    /// One line for the merge log.
    pub message: String,
}

impl Published {
    /// A warning worth an event (the user's checkout did not get the change), if any.
    pub fn warning(&self) -> Option<&str> {
        (self.outcome == Outcome::CloneOnly).then_some(self.message.as_str())
    }
}

/// The remote orch's clone publishes to.
pub(crate) const ORIGIN: &str = "origin";

/// Moves the default branch of the repository `repo` declares (orch's clone's `origin`) from
/// exactly `old` to `new` (`old` empty: the branch must not exist yet), then records `new` as
/// `origin/<branch>` in orch's clone. A branch found anywhere but at `old` (or `new`) is an
/// error naming both revisions; nothing is ever forced. See the module docs for what each setup
/// gets; `new` must be a commit in `repo_dir` (orch's clone).
pub async fn publish_default_branch(
    git: &Git,
    repo_dir: &Path,
    repo: &RepoConfig,
    old: &str,
    new: &str,
) -> anyhow::Result<Published> {
    let branch = repo.default_branch.as_str();
    let url = git
        .remote_url(repo_dir, ORIGIN)
        .await?
        .with_context(|| format!("orch's clone {} has no `{ORIGIN}`", repo_dir.display()))?;
    let old_opt = (!old.is_empty()).then_some(old);
    // Only ever forward: a lease alone would let a push drop commits that `new` lacks.
    if let Some(old) = old_opt
        && !git.is_ancestor(repo_dir, old, new).await?
    {
        anyhow::bail!(
            "{} does not contain {}, where `{branch}` was: publishing it would drop commits; refused",
            short(new),
            short(old)
        );
    }
    let published = if repo.url.is_some() {
        push_with_lease(git, repo_dir, &url, branch, old_opt, new).await?
    } else {
        match local_setup(git, Path::new(&url)).await? {
            Setup::Checkout { path } => {
                publish_to_checkout(git, repo_dir, &path, branch, old_opt, new).await?
            }
            Setup::Bare { .. } | Setup::Remote { .. } => {
                push_with_lease(git, repo_dir, &url, branch, old_opt, new).await?
            }
        }
    };
    if published.outcome != Outcome::CloneOnly {
        git.update_ref(
            repo_dir,
            &format!("refs/remotes/{ORIGIN}/{branch}"),
            new,
            None,
        )
        .await?;
    }
    Ok(published)
}

/// The remote refused to move the default branch although nobody else had moved it (a
/// protected branch, a hook): not a lost race. The release train then publishes through the
/// forge's API when the repo has one ([`crate::release`]).
#[derive(Debug)]
pub struct PushRefused {
    pub message: String,
}

impl std::fmt::Display for PushRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PushRefused {}

/// Whether `e` is (or wraps) a [`PushRefused`].
pub fn push_refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<PushRefused>())
}

/// Puts exactly `new` on `branch` of `origin`, a branch orch owns (a release's
/// `orch/release/<id>`): by a lease on where the remote has it now, so a concurrent push by
/// another orch process is not overwritten blindly.
pub async fn push_owned_branch(git: &Git, repo_dir: &Path, branch: &str, new: &str) -> Result<()> {
    let found = git
        .ls_remote_branch(repo_dir, ORIGIN, branch)
        .await
        .with_context(|| format!("cannot read `{branch}` on `{ORIGIN}`"))?;
    if found.as_deref() == Some(new) {
        return Ok(());
    }
    let url = git.remote_url(repo_dir, ORIGIN).await?.unwrap_or_default();
    git.push_with_lease(repo_dir, ORIGIN, branch, found.as_deref(), new)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot push {} to `{branch}` on {}: {}",
                short(new),
                redact_url(&url),
                redact_in(&e.to_string(), &url)
            )
        })
}

fn lost_race(target: &str, branch: &str, old: Option<&str>, found: Option<&str>) -> anyhow::Error {
    anyhow::anyhow!(
        "`{branch}` in {target} is at {}, not at {} as orch last saw it: someone else moved it; orch does not overwrite it (the merge is redone from the new state)",
        found.map_or("nothing (the branch does not exist)".to_owned(), short),
        old.map_or("nothing (a new branch)".to_owned(), short),
    )
}

fn short(sha: &str) -> String {
    sha.get(..12).unwrap_or(sha).to_owned()
}

async fn push_with_lease(
    git: &Git,
    repo_dir: &Path,
    url: &str,
    branch: &str,
    old: Option<&str>,
    new: &str,
) -> Result<Published> {
    let target = redact_url(url);
    match git
        .push_with_lease(repo_dir, ORIGIN, branch, old, new)
        .await
    {
        Ok(()) => Ok(Published {
            outcome: Outcome::Pushed,
            message: format!(
                "pushed `{branch}` to {target}: {} → {}",
                old.map_or("(new)".to_owned(), short),
                short(new)
            ),
            target,
        }),
        Err(push_err) => {
            let push_err = redact_in(&push_err.to_string(), url);
            // Tell a lost race from a broken remote by asking where the branch is now.
            match git.ls_remote_branch(repo_dir, ORIGIN, branch).await {
                Ok(found) if found.as_deref() == Some(new) => Ok(Published {
                    outcome: Outcome::AlreadyThere,
                    message: format!("`{branch}` in {target} is already at {}", short(new)),
                    target,
                }),
                Ok(found) if found.as_deref() != old => {
                    Err(lost_race(&target, branch, old, found.as_deref()))
                }
                // Nobody moved it, yet the push was refused: a protected branch, a hook.
                Ok(_) => Err(anyhow::Error::new(PushRefused {
                    message: format!(
                        "{target} refused to move `{branch}` (still at {}, as orch last saw it): {push_err}",
                        old.map_or("nothing".to_owned(), short)
                    ),
                })),
                _ => Err(anyhow::anyhow!(
                    "cannot push `{branch}` to {target}: {push_err}"
                )),
            }
        }
    }
}

async fn publish_to_checkout(
    git: &Git,
    repo_dir: &Path,
    checkout: &Path,
    branch: &str,
    old: Option<&str>,
    new: &str,
) -> Result<Published> {
    let target = checkout.display().to_string();
    let refname = format!("refs/heads/{branch}");
    let found = git.rev_parse(checkout, &refname).await?;
    if found.as_deref() == Some(new) {
        return Ok(Published {
            outcome: Outcome::AlreadyThere,
            message: format!(
                "`{branch}` in your checkout {target} is already at {}",
                short(new)
            ),
            target,
        });
    }
    if found.as_deref() != old {
        return Err(lost_race(&target, branch, old, found.as_deref()));
    }
    // The commits first, into the checkout's object store only, from a ref of orch's clone
    // (fetching a bare object id is not allowed by every git).
    let staging_ref = format!("refs/orch-publish/{branch}");
    git.update_ref(repo_dir, &staging_ref, new, None).await?;
    let fetched = git
        .fetch_objects(checkout, &repo_dir.display().to_string(), &staging_ref)
        .await;
    if let Err(e) = git.delete_ref(repo_dir, &staging_ref).await {
        tracing::debug!(error = %e, "cannot delete the publish ref in orch's clone");
    }
    fetched.with_context(|| format!("cannot fetch the merge into your checkout {target}"))?;

    let Some(worktree) = git.checked_out_at(checkout, branch).await? else {
        git.update_ref(checkout, &refname, new, Some(old.unwrap_or("")))
            .await
            .with_context(|| format!("cannot move `{branch}` in {target}"))?;
        return Ok(Published {
            outcome: Outcome::RefUpdated,
            message: format!(
                "moved `{branch}` in your checkout {target} (not checked out there): {} → {}",
                old.map_or("(new)".to_owned(), short),
                short(new)
            ),
            target,
        });
    };
    let wt = worktree.display().to_string();
    let changed: Vec<String> = git
        .status_porcelain(&worktree)
        .await?
        .into_iter()
        .filter(|e| e.code != "??")
        .map(|e| e.path)
        .collect();
    let busy = [
        "MERGE_HEAD",
        "REBASE_HEAD",
        "CHERRY_PICK_HEAD",
        "REVERT_HEAD",
    ];
    let mut in_progress = None;
    for name in busy {
        if git.rev_parse(&worktree, name).await?.is_some() {
            in_progress = Some(name);
            break;
        }
    }
    let head = git.rev_parse(&worktree, "HEAD").await?;
    let why = if !changed.is_empty() {
        Some(format!(
            "your checkout has local changes ({} file(s): {})",
            changed.len(),
            changed
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ))
    } else if let Some(name) = in_progress {
        Some(format!(
            "your checkout is in the middle of an operation ({name} exists)"
        ))
    } else if head.as_deref() != old {
        Some("your checkout's HEAD is not at the branch's last published commit".to_owned())
    } else {
        None
    };
    if let Some(why) = why {
        return Ok(Published {
            outcome: Outcome::CloneOnly,
            message: format!(
                "published to orch's clone only; {why}: {wt} was left untouched at {}; to take the change run `git -C {wt} merge --ff-only {}` when it is clean (a later merge does it too)",
                old.map_or("(nothing)".to_owned(), short),
                short(new)
            ),
            target,
        });
    }
    match git
        .merge(&worktree, new, MergeStrategy::FastForwardOnly)
        .await
    {
        Ok(MergeResult::Merged { sha }) if sha == new => Ok(Published {
            outcome: Outcome::CheckoutFastForwarded,
            message: format!(
                "fast-forwarded `{branch}` in your checkout {wt}: {} → {}",
                old.map_or("(new)".to_owned(), short),
                short(new)
            ),
            target,
        }),
        Ok(other) => Err(anyhow::anyhow!(
            "fast-forwarding `{branch}` in {wt} to {} did not end there ({other:?}); the checkout was not changed by orch beyond git's own fast-forward",
            short(new)
        )),
        Err(e) => Ok(Published {
            outcome: Outcome::CloneOnly,
            message: format!(
                "published to orch's clone only; git refused to fast-forward your checkout {wt} ({e}); run `git -C {wt} merge --ff-only {}` when it is ready",
                short(new)
            ),
            target,
        }),
    }
}

/// Whether the work items' `orch/<id>` branches are pushed to `origin`: yes for a remote URL
/// and a bare repository (other machines continue from them), no for an ordinary checkout (a
/// user's checkout is not a hand-off point; its branch list stays the user's).
///
/// Asked by every stage job (twice when it commits), so the answer for a `path` repo is kept
/// for [`SHARES_TTL`] per clone and declared path: it changes only when someone turns the
/// repository at that path into another kind, and costs two or three git processes to learn.
pub async fn shares_work_branches(git: &Git, repo_dir: &Path, repo: &RepoConfig) -> bool {
    if repo.url.is_some() {
        return true;
    }
    let key = (repo_dir.to_path_buf(), repo.path.clone());
    let now = std::time::Instant::now();
    if let Ok(known) = SHARES.lock()
        && let Some((at, shares)) = known.get(&key)
        && now.duration_since(*at) < SHARES_TTL
    {
        return *shares;
    }
    let shares = match git.remote_url(repo_dir, ORIGIN).await {
        Ok(Some(url)) => match local_setup(git, Path::new(&url)).await {
            Ok(setup) => matches!(setup, Setup::Bare { .. }),
            Err(_) => return false,
        },
        Ok(None) => false,
        // Not learnt (no clone yet, git failing): not kept either.
        Err(_) => return false,
    };
    if let Ok(mut known) = SHARES.lock() {
        if known.len() > 1024 {
            known.clear();
        }
        known.insert(key, (now, shares));
    }
    shares
}

/// How long [`shares_work_branches`] keeps what it learnt about a `path` repo.
const SHARES_TTL: std::time::Duration = std::time::Duration::from_secs(30);

type SharesKey = (PathBuf, Option<String>);
static SHARES: LazyLock<Mutex<HashMap<SharesKey, (std::time::Instant, bool)>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_plain_head_file_holding_an_id_is_detached() {
        let tmp = tempfile::tempdir().unwrap();
        let git_dir = tmp.path().join(".git");
        std::fs::create_dir_all(git_dir.join("refs/heads")).unwrap();
        let id = "4f2a9c1e0b7d3a5f6e8c9b0a1d2e3f4a5b6c7d8e";
        let head = git_dir.join("HEAD");
        std::fs::write(&head, format!("{id}\n")).unwrap();
        assert!(head_detached(tmp.path()));
        std::fs::write(&head, "ref: refs/heads/main\n").unwrap();
        assert!(!head_detached(tmp.path()));
        std::fs::write(&head, "not an id\n").unwrap();
        assert!(!head_detached(tmp.path()));
        // core.preferSymlinkRefs: HEAD links to the branch, whose file holds an id.
        std::fs::remove_file(&head).unwrap();
        std::fs::write(git_dir.join("refs/heads/main"), format!("{id}\n")).unwrap();
        std::os::unix::fs::symlink("refs/heads/main", &head).unwrap();
        assert!(!head_detached(tmp.path()));
        assert!(!head_detached(&tmp.path().join("missing")));
    }

    #[test]
    fn urls_lose_their_passwords() {
        assert_eq!(
            redact_url("https://bob:s3cret@example.com/a.git"),
            "https://***@example.com/a.git"
        );
        assert_eq!(
            redact_url("https://ghp_token@example.com/a.git"),
            "https://***@example.com/a.git"
        );
        assert_eq!(redact_url("file:///srv/a.git"), "file:///srv/a.git");
        assert_eq!(redact_url("git@host:a.git"), "git@host:a.git");
        assert_eq!(
            redact_in("fatal: https://bob:s3cret@h/a", "https://bob:s3cret@h/a"),
            "fatal: https://***@h/a"
        );
    }
}
