//! git for orch: the operations the pipeline needs (repos, work-item worktrees, commits, merges,
//! pushes, reading committed artifacts), each one a run of the `git` binary through
//! [`crate::process::run`], so git inherits the same timeout, process-group kill and bounded capture
//! as every other child of orch.
//!
//! Every invocation gets `GIT_TERMINAL_PROMPT=0` (never wait for a password), a fixed
//! author/committer identity ([`Identity`], `orch <orch@localhost>` by default),
//! `-c commit.gpgsign=false`, foreground garbage collection (so no detached `git gc` outlives its
//! run), and none of the `GIT_DIR`-like variables orch itself may have inherited.
//!
//! git never runs a program it did not choose: every invocation disables hooks
//! (`core.hooksPath=/dev/null`), the file-system monitor (`core.fsmonitor=false`), the `ext::`
//! transport, and names git's own upload/receive-pack programs on every fetch, push and clone
//! (`--upload-pack`/`--receive-pack`), whatever a
//! repository's configuration says (a repository's config and hooks are written by whoever
//! could write its git directory: orch keeps that out of every sandboxed child's reach, and
//! these options hold even where it could not). git gets an allowlisted environment
//! ([`GIT_ENV`] besides [`crate::env::BASE`]): its ssh agent, askpass and proxy, never orch's
//! token, database URL or agents' keys.
//!
//! Operations that orch repeats after a crash are idempotent: [`Git::worktree_add`] reuses or
//! repairs, [`Git::worktree_remove`] succeeds on a missing worktree, [`Git::add_and_commit`]
//! with nothing to commit is `None`, [`Git::clone_repo`] keeps an existing clone. Worktree changes are
//! serialized per repository inside the process.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use crate::process::{self, Cmd, ExitKind, Output, SpawnError};

/// Default limit for one git command.
pub const DEFAULT_GIT_TIMEOUT: Duration = Duration::from_secs(300);

/// The most stdout orch reads from one git command (a larger committed file or listing is an
/// error, never a silently cut answer).
const GIT_OUTPUT_LIMIT: usize = 16 * 1024 * 1024;
/// Lines of stderr kept in a [`GitError::Failed`].
const ERROR_LINES: usize = 20;
/// Options given to every git command: no signing prompt, no background maintenance, and no
/// program a repository's configuration names (hooks, fsmonitor, transports, pack programs).
pub const CONFIG: [&str; 12] = [
    "-c",
    "commit.gpgsign=false",
    "-c",
    "gc.autoDetach=false",
    "-c",
    "maintenance.autoDetach=false",
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "protocol.ext.allow=never",
];

/// git's own program for the remote side of a fetch (a repository's `remote.*.uploadpack`
/// could name any program).
const UPLOAD_PACK: &str = "--upload-pack=git-upload-pack";
/// git's own program for the remote side of a push.
const RECEIVE_PACK: &str = "--receive-pack=git-receive-pack";

/// Variables of orch's environment git inherits besides [`crate::env::BASE`]: what it needs to
/// reach a remote (ssh agent, askpass, proxies, certificates) and the location of its own
/// configuration files.
pub const GIT_ENV: [&str; 18] = [
    "SSH_AUTH_SOCK",
    "GIT_SSH",
    "GIT_SSH_COMMAND",
    "GIT_ASKPASS",
    "SSH_ASKPASS",
    "GIT_SSL_CAINFO",
    "GIT_SSL_CAPATH",
    "GIT_SSL_NO_VERIFY",
    "GIT_CONFIG_GLOBAL",
    "GIT_CONFIG_SYSTEM",
    "GIT_CONFIG_NOSYSTEM",
    "XDG_CONFIG_HOME",
    "http_proxy",
    "https_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "no_proxy",
    "NO_PROXY",
];
/// Variables that would point git at another repository than the one orch names.
const LEAKY_ENV: [&str; 8] = [
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
    "GIT_PREFIX",
];

/// Author and committer of every commit orch makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// `user.name`.
    pub name: String,
    /// `user.email`.
    pub email: String,
}

impl Default for Identity {
    fn default() -> Identity {
        Identity {
            name: "orch".to_owned(),
            email: "orch@localhost".to_owned(),
        }
    }
}

/// How to run git.
#[derive(Debug, Clone)]
pub struct Git {
    /// The git binary (`git` looks it up in `PATH`).
    pub bin: PathBuf,
    /// Wall-clock limit of each git command.
    pub timeout: Duration,
    /// Author and committer identity.
    pub identity: Identity,
}

impl Default for Git {
    fn default() -> Git {
        Git {
            bin: PathBuf::from("git"),
            timeout: DEFAULT_GIT_TIMEOUT,
            identity: Identity::default(),
        }
    }
}

/// A failed git operation; its message names the command, the directory and the cause.
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    /// git could not be started at all.
    #[error("git {} in {}: {source}", .args.join(" "), .dir.display())]
    Spawn {
        /// Where it ran.
        dir: PathBuf,
        /// The git arguments.
        args: Vec<String>,
        /// Why it could not start.
        #[source]
        source: SpawnError,
    },
    /// git ran and failed.
    #[error("git {} in {} failed ({exit}): {stderr}", .args.join(" "), .dir.display())]
    Failed {
        /// Where it ran.
        dir: PathBuf,
        /// The git arguments.
        args: Vec<String>,
        /// How it ended.
        exit: ExitKind,
        /// The last lines of its stderr (of stdout when stderr was empty).
        stderr: String,
    },
    /// git printed more than orch reads from one command.
    #[error("git {} in {} printed {bytes} bytes, more than the {limit} orch reads", .args.join(" "), .dir.display())]
    TooMuchOutput {
        /// Where it ran.
        dir: PathBuf,
        /// The git arguments.
        args: Vec<String>,
        /// How much it printed.
        bytes: u64,
        /// The limit.
        limit: usize,
    },
    /// A revision to merge does not exist.
    #[error("revision '{rev}' does not exist in {}", .dir.display())]
    UnknownRevision {
        /// The repository.
        dir: PathBuf,
        /// The revision.
        rev: String,
    },
    /// The worktree path holds a worktree of another branch (or a detached HEAD); orch does
    /// not take over a worktree it did not create for that branch.
    #[error("worktree {} is on {found}, not on branch '{branch}'; left untouched", .path.display())]
    WorktreeMismatch {
        /// The worktree path.
        path: PathBuf,
        /// The branch orch wanted there.
        branch: String,
        /// What is checked out there instead.
        found: String,
    },
    /// A stale worktree directory could not be cleared safely.
    #[error("refusing to delete {}: {reason}", .path.display())]
    RefuseToDelete {
        /// The directory.
        path: PathBuf,
        /// Why it was not deleted.
        reason: &'static str,
    },
    /// A file system step around git failed.
    #[error("cannot {action} {}: {source}", .path.display())]
    Io {
        /// What orch tried to do.
        action: &'static str,
        /// On which path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Which changes [`Git::add_and_commit`] commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pathspec {
    /// Everything: new, modified and deleted files (`git add -A`).
    All,
    /// Only these paths (files or directories, relative to the working tree root); an empty
    /// list commits nothing.
    Only(Vec<PathBuf>),
}

/// How [`Git::merge`] merges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeStrategy {
    /// Only move the branch forward; a diverged branch is [`MergeResult::NotFastForward`].
    FastForwardOnly,
    /// Always record a merge commit (`--no-ff`).
    MergeCommit,
}

/// The outcome of a merge that git could attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MergeResult {
    /// Merged (or already contained); `sha` is the new `HEAD`.
    Merged {
        /// `HEAD` after the merge.
        sha: String,
    },
    /// The merge conflicted in these files; it was aborted and the tree is as before.
    Conflict {
        /// Paths with conflicts, sorted.
        files: Vec<String>,
    },
    /// Fast-forward only, but the branches have diverged; nothing was changed.
    NotFastForward,
}

/// What [`Git::worktree_add`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorktreeAdd {
    /// A new worktree was created.
    Created,
    /// A healthy worktree of that branch was already there and is kept as it is.
    Reused,
    /// A broken or unregistered leftover was cleared and the worktree created again.
    Repaired,
}

/// One line of `git status --porcelain`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusEntry {
    /// The two-letter status `XY` (`??` untracked, ` M` modified, `A ` added, `R ` renamed, …).
    pub code: String,
    /// The path, relative to the working tree root.
    pub path: String,
    /// For renames and copies, the path it came from.
    pub orig_path: Option<String>,
}

impl Git {
    /// Git with the defaults: `git` from `PATH`, [`DEFAULT_GIT_TIMEOUT`], identity `orch`.
    pub fn new() -> Git {
        Git::default()
    }

    /// A git command in `dir` as orch runs every one: the hardening options ([`CONFIG`]), an
    /// allowlisted environment without the `GIT_DIR`-like variables, never a prompt, the
    /// timeout. Arguments follow.
    pub fn command(&self, dir: &Path) -> Cmd {
        let mut cmd = Cmd::new(&self.bin)
            .args(CONFIG)
            .cwd(dir)
            .env_allow(GIT_ENV)
            .env("GIT_TERMINAL_PROMPT", "0")
            .timeout(self.timeout);
        for key in LEAKY_ENV {
            cmd = cmd.env_remove(key);
        }
        cmd
    }

    /// Creates `dir` (if needed) and makes it a repository whose first branch is
    /// `default_branch`. Running it on an existing repository is harmless.
    pub async fn init_repo(&self, dir: &Path, default_branch: &str) -> Result<(), GitError> {
        create_dir_all(dir)?;
        self.run(
            dir,
            args(["init", "--quiet", "--initial-branch", default_branch]),
        )
        .await?;
        Ok(())
    }

    /// Clones `src` (a URL or a local path) into `dest`. A repository already at `dest` is
    /// kept as it is (the clone is not redone after a restart).
    pub async fn clone_repo(&self, src: &str, dest: &Path) -> Result<(), GitError> {
        let dest = &absolute(dest);
        if dest.join(".git").exists() && self.is_toplevel(dest).await {
            tracing::debug!(dest = %dest.display(), "clone already present");
            return Ok(());
        }
        let parent = parent_dir(dest);
        create_dir_all(&parent)?;
        // git runs in `parent`: a relative local source must not change meaning.
        let src: OsString = if Path::new(src).exists() {
            absolute(Path::new(src)).into()
        } else {
            src.into()
        };
        let mut argv = args(["clone", "--quiet", UPLOAD_PACK, "--"]);
        argv.push(src);
        argv.push(dest.into());
        self.run(&parent, argv).await?;
        Ok(())
    }

    /// The full object id `rev` names, or `None` when it names nothing.
    pub async fn rev_parse(&self, dir: &Path, rev: &str) -> Result<Option<String>, GitError> {
        let argv = args(["rev-parse", "--verify", "--quiet", "--end-of-options", rev]);
        let out = self.output(dir, argv.clone(), None).await?;
        match out.status {
            ExitKind::Exited(0) => Ok(Some(out.stdout_lossy().trim().to_owned())),
            ExitKind::Exited(1) if out.stderr_tail.is_empty() => Ok(None),
            _ => Err(failed(dir, &argv, &out)),
        }
    }

    /// The branch checked out in `dir`, or `None` on a detached `HEAD`.
    pub async fn current_branch(&self, dir: &Path) -> Result<Option<String>, GitError> {
        let argv = args(["symbolic-ref", "--quiet", "--short", "HEAD"]);
        let out = self.output(dir, argv.clone(), None).await?;
        match out.status {
            ExitKind::Exited(0) => Ok(Some(out.stdout_lossy().trim().to_owned())),
            ExitKind::Exited(1) => Ok(None),
            _ => Err(failed(dir, &argv, &out)),
        }
    }

    /// Makes `path` a worktree of `repo` with `branch` checked out. A worktree inside the
    /// repository's own working tree (`<repo>/worktrees/<id>`) gets its parent directory listed
    /// in the repository's `.git/info/exclude`, so the main checkout stays clean. Idempotent:
    /// - a healthy worktree of `branch` at `path` is reused;
    /// - a registration whose directory is gone or broken, or a directory git does not know,
    ///   is cleared (`git worktree prune`, the leftover directory deleted) and re-added;
    /// - an existing local branch is checked out as it is; a branch that only exists on a remote
    ///   (`<remote>/<branch>`, `origin` preferred) is checked out tracking it; otherwise the
    ///   branch is created from `base`.
    ///
    /// A worktree of another branch at `path` is an error ([`GitError::WorktreeMismatch`]).
    pub async fn worktree_add(
        &self,
        repo: &Path,
        path: &Path,
        branch: &str,
        base: &str,
    ) -> Result<WorktreeAdd, GitError> {
        // git runs in `repo`: a relative path must mean the same to git and to this code.
        let path = &absolute(path);
        // The common case (every job of a work item after its first): a healthy worktree of
        // `branch`, registered and excluded. It is recognised from this worktree alone, without
        // the repository's lock, so that the jobs of many work items do not queue behind each
        // other's `git worktree list` (which reads every worktree of the repository).
        if self.reusable_unlocked(repo, path, branch).await {
            return Ok(WorktreeAdd::Reused);
        }
        let lock = repo_lock(repo);
        let _held = lock.lock().await;
        let target = normalize(path);
        // Whether `path` is registered (and prunable), from the registration files when the
        // repo is an ordinary clone (`git worktree list` would read every worktree of it under
        // the lock, each creation slower than the last), else from git.
        let registered: Option<bool> = match registrations_naming(repo, path) {
            // A live registration wins over stale ones naming the same path.
            Some(found) => found
                .iter()
                .find(|r| !r.prunable)
                .or(found.first())
                .map(|r| r.prunable),
            None => self
                .worktrees(repo)
                .await?
                .into_iter()
                .find(|w| normalize(&w.path) == target)
                .map(|w| w.prunable),
        };
        let mut repaired = false;
        if let Some(prunable) = registered {
            if !prunable && path.join(".git").is_file() && self.is_toplevel(path).await {
                return match self.current_branch(path).await? {
                    Some(current) if current == branch => {
                        self.exclude_nested(repo, path).await;
                        Ok(WorktreeAdd::Reused)
                    }
                    other => Err(GitError::WorktreeMismatch {
                        path: path.to_owned(),
                        branch: branch.to_owned(),
                        found: other
                            .map_or("a detached HEAD".to_owned(), |b| format!("branch '{b}'")),
                    }),
                };
            }
            tracing::warn!(path = %path.display(), "worktree registered but broken; recreating it");
            let mut argv = args(["worktree", "remove", "--force", "--force"]);
            argv.push(path.into());
            let out = self.output(repo, argv, None).await?;
            if !out.success() {
                tracing::debug!(stderr = %out.stderr_lossy(), "worktree remove of a broken worktree failed; pruning");
            }
            repaired = true;
            self.run(repo, args(["worktree", "prune"])).await?;
        }
        if is_non_empty(path) {
            tracing::warn!(path = %path.display(), "a directory git does not know is in the worktree's place; deleting it");
            remove_stray(repo, path)?;
            repaired = true;
        }
        create_dir_all(&parent_dir(path))?;

        let mut argv = args(["worktree", "add", "--quiet"]);
        if self
            .rev_parse(repo, &format!("refs/heads/{branch}"))
            .await?
            .is_some()
        {
            argv.push(path.into());
            argv.push(branch.into());
        } else if let Some(remote_ref) = self.remote_branch(repo, branch).await? {
            argv.extend(args(["--track", "-b", branch]));
            argv.push(path.into());
            argv.push(remote_ref.into());
        } else {
            argv.extend(args(["-b", branch]));
            argv.push(path.into());
            argv.push(base.into());
        }
        if let Err(first) = self.run(repo, argv.clone()).await {
            // A stale registration (this branch or this path still registered for a worktree
            // whose directory is gone) makes git refuse: prune what git would prune, then try
            // once more. Any other failure, or a path that is now a live worktree (another
            // process sharing this repos_dir made it), is the error as it is.
            let stale = matches!(&first, GitError::Failed { stderr, .. }
                if stderr.contains("already used by worktree")
                    || stderr.contains("already checked out")
                    || stderr.contains("missing but"));
            if !stale || registration(repo, path).is_some_and(|r| !r.prunable) {
                return Err(first);
            }
            tracing::debug!(error = %first, "worktree add refused by a stale registration; pruning and retrying");
            self.run(repo, args(["worktree", "prune"])).await?;
            self.run(repo, argv).await?;
            repaired = true;
        }
        self.exclude_nested(repo, path).await;
        Ok(if repaired {
            WorktreeAdd::Repaired
        } else {
            WorktreeAdd::Created
        })
    }

    /// Makes `path` a worktree of `repo` with a detached `HEAD` at exactly `rev`, its files as
    /// committed there (a re-used one is forced to `rev` and cleaned). For running a release's
    /// commands on the exact revision that was staged.
    pub async fn worktree_detached(
        &self,
        repo: &Path,
        path: &Path,
        rev: &str,
    ) -> Result<(), GitError> {
        let path = &absolute(path);
        let lock = repo_lock(repo);
        let _held = lock.lock().await;
        let target = normalize(path);
        let registered = self
            .worktrees(repo)
            .await?
            .into_iter()
            .any(|w| normalize(&w.path) == target && !w.prunable);
        if registered && path.join(".git").is_file() && self.is_toplevel(path).await {
            self.run(
                path,
                args(["checkout", "--quiet", "--force", "--detach", rev]),
            )
            .await?;
            self.run(path, args(["clean", "--quiet", "-f", "-d"]))
                .await?;
            return Ok(());
        }
        self.run(repo, args(["worktree", "prune"])).await?;
        if path.symlink_metadata().is_ok() {
            remove_stray(repo, path)?;
        }
        create_dir_all(&parent_dir(path))?;
        let mut argv = args(["worktree", "add", "--quiet", "--force", "--detach"]);
        argv.push(path.into());
        argv.push(rev.into());
        self.run(repo, argv).await?;
        self.exclude_nested(repo, path).await;
        Ok(())
    }

    /// Removes the worktree at `path` (uncommitted changes included), prunes git's records of
    /// it and deletes what is left of the directory. Removing a missing worktree succeeds.
    pub async fn worktree_remove(&self, repo: &Path, path: &Path) -> Result<(), GitError> {
        let path = &absolute(path);
        let lock = repo_lock(repo);
        let _held = lock.lock().await;
        let target = normalize(path);
        let registered = self
            .worktrees(repo)
            .await?
            .iter()
            .any(|w| normalize(&w.path) == target);
        if registered {
            let mut argv = args(["worktree", "remove", "--force", "--force"]);
            argv.push(path.into());
            let out = self.output(repo, argv, None).await?;
            if !out.success() {
                tracing::debug!(stderr = %out.stderr_lossy(), "worktree remove failed; pruning and deleting");
            }
        }
        self.run(repo, args(["worktree", "prune"])).await?;
        if path.symlink_metadata().is_ok() {
            remove_stray(repo, path)?;
        }
        Ok(())
    }

    /// Stages `paths` and commits them with `message`. Returns the new commit, or `None` when
    /// there was nothing to commit (not an error). Hooks run; a failing hook is an error.
    pub async fn add_and_commit(
        &self,
        dir: &Path,
        paths: &Pathspec,
        message: &str,
    ) -> Result<Option<String>, GitError> {
        let only: Vec<OsString> = match paths {
            Pathspec::All => Vec::new(),
            Pathspec::Only(list) => {
                let mut v = vec![OsString::from("--")];
                v.extend(list.iter().map(OsString::from));
                v
            }
        };
        if matches!(paths, Pathspec::Only(list) if list.is_empty()) {
            return Ok(None);
        }
        let mut add = args(["add", "-A"]);
        add.extend(only.iter().cloned());
        self.run(dir, add).await?;

        // Committed straight away: every stage commits something, so asking first whether
        // anything is staged cost a process per commit. A commit that fails with status 1 is
        // either "nothing to commit" or a real failure (a hook): only then is the index asked.
        // With a merge, cherry-pick or revert in progress git would commit even with nothing
        // staged: then the index is asked first, as always before.
        if self.operation_in_progress(dir) && self.nothing_staged(dir, &only).await? {
            return Ok(None);
        }
        let mut commit = args(["commit", "--quiet", "--file", "-"]);
        commit.extend(only.iter().cloned());
        let out = self
            .output(dir, commit.clone(), Some(message.as_bytes().to_vec()))
            .await?;
        match out.status {
            ExitKind::Exited(0) => {}
            ExitKind::Exited(1) if self.nothing_staged(dir, &only).await? => return Ok(None),
            _ => return Err(failed(dir, &commit, &out)),
        }
        match head_from_files(dir) {
            Some(id) => Ok(Some(id)),
            None => self.rev_parse(dir, "HEAD").await,
        }
    }

    /// Whether the index of `dir` holds nothing to commit (for the pathspec `only`):
    /// `git diff --cached --quiet`, whose status 1 says something is staged.
    async fn nothing_staged(&self, dir: &Path, only: &[OsString]) -> Result<bool, GitError> {
        let mut staged = args(["diff", "--cached", "--quiet"]);
        staged.extend(only.iter().cloned());
        let out = self.output(dir, staged.clone(), None).await?;
        match out.status {
            ExitKind::Exited(0) => Ok(true),
            ExitKind::Exited(1) => Ok(false),
            _ => Err(failed(dir, &staged, &out)),
        }
    }

    /// The changes in the working tree of `dir`: one entry per changed, added, deleted or
    /// untracked file (untracked directories are listed file by file).
    pub async fn status_porcelain(&self, dir: &Path) -> Result<Vec<StatusEntry>, GitError> {
        let out = self
            .text(
                dir,
                args(["status", "--porcelain=v1", "-z", "--untracked-files=all"]),
            )
            .await?;
        Ok(parse_status(&out))
    }

    /// Every change in the working tree of `dir` against `HEAD`, one entry per path, as bytes
    /// (a name need not be UTF-8; a newline in one is read correctly: `-z`): changed, added,
    /// deleted and untracked files, untracked directories listed file by file, renames as a
    /// deletion and an addition. Ignored files are not listed (`git add -A` leaves them too).
    pub async fn changes(&self, dir: &Path) -> Result<Vec<Changed>, GitError> {
        let argv = args([
            "status",
            "--porcelain=v1",
            "-z",
            "--untracked-files=all",
            "--no-renames",
            "--ignore-submodules=none",
        ]);
        let out = self.run(dir, argv.clone()).await?;
        whole_stdout(dir, &argv, &out)?;
        Ok(parse_changes(&out.stdout_tail))
    }

    /// Index entries of `dir` flagged `skip-worktree` or `assume-unchanged`: git neither
    /// lists nor stages their working-tree file, so `git add -A` would commit whatever the
    /// index holds for them. When there are any, the index is rebuilt from `HEAD` (`read-tree`,
    /// which drops the flags; the working tree is left as it is). Returns the paths still
    /// flagged after that (a sparse checkout sets its flags again): empty when none is hidden.
    pub async fn unhide_index(&self, dir: &Path) -> Result<Vec<Vec<u8>>, GitError> {
        let flagged = self.flagged(dir).await?;
        if flagged.is_empty() {
            return Ok(flagged);
        }
        self.run(dir, args(["read-tree", "HEAD"])).await?;
        self.flagged(dir).await
    }

    /// The index entries of `dir` tagged `S` (skip-worktree) or with a lower-case tag
    /// (assume-unchanged) by `git ls-files -v`.
    async fn flagged(&self, dir: &Path) -> Result<Vec<Vec<u8>>, GitError> {
        let argv = args(["ls-files", "-v", "-z"]);
        let out = self.run(dir, argv.clone()).await?;
        whole_stdout(dir, &argv, &out)?;
        Ok(out
            .stdout_tail
            .split(|b| *b == 0)
            .filter(|e| e.len() > 2 && (e[0] == b'S' || e[0].is_ascii_lowercase()))
            .map(|e| e[2..].to_vec())
            .collect())
    }

    /// Deletes untracked and ignored files under `paths` of `dir` (`git clean -ffdx`): what
    /// orch reads there must be what the branch holds.
    pub async fn clean_all_under(&self, dir: &Path, paths: &[&str]) -> Result<(), GitError> {
        let mut argv = args(["clean", "--quiet", "-f", "-f", "-d", "-x", "--"]);
        argv.extend(paths.iter().map(OsString::from));
        self.run(dir, argv).await?;
        Ok(())
    }

    /// Puts `paths` (relative to `dir`'s root; each must be known to the index or `HEAD`)
    /// back as `HEAD` has them, in the index and the working tree: a path `HEAD` lacks is
    /// removed from both. The paths go to git on stdin, NUL-separated, so any name works.
    pub async fn restore_paths(&self, dir: &Path, paths: &[Vec<u8>]) -> Result<(), GitError> {
        if paths.is_empty() {
            return Ok(());
        }
        let argv = args([
            "restore",
            "--source=HEAD",
            "--staged",
            "--worktree",
            "--pathspec-from-file=-",
            "--pathspec-file-nul",
        ]);
        let mut list = Vec::new();
        for p in paths {
            list.extend_from_slice(p);
            list.push(0);
        }
        let out = self.output(dir, argv.clone(), Some(list)).await?;
        match out.success() {
            true => Ok(()),
            false => Err(failed(dir, &argv, &out)),
        }
    }

    /// Paths changed in the working tree of `dir` that are not under `allowed_prefix` (a
    /// directory relative to the root, e.g. `docs/work-items/ORCH-1`), sorted: catches an agent
    /// that wrote outside its area. Both sides of a rename count.
    pub async fn changed_files_outside(
        &self,
        dir: &Path,
        allowed_prefix: &str,
    ) -> Result<Vec<String>, GitError> {
        let entries = self.status_porcelain(dir).await?;
        let mut outside: Vec<String> = entries
            .into_iter()
            .flat_map(|e| std::iter::once(e.path).chain(e.orig_path))
            .filter(|p| !under_prefix(p, allowed_prefix))
            .collect();
        outside.sort();
        outside.dedup();
        Ok(outside)
    }

    /// Files that differ between `base` and `head` since `head` left `base`
    /// (`git diff --name-only base...head`), sorted: what a branch's commits changed.
    pub async fn changed_files_between(
        &self,
        dir: &Path,
        base: &str,
        head: &str,
    ) -> Result<Vec<String>, GitError> {
        let range = format!("{base}...{head}");
        let out = self
            .text(dir, args(["diff", "--name-only", "-z", &range, "--"]))
            .await?;
        let mut files = split_nul(&out);
        files.sort();
        Ok(files)
    }

    /// Merges `branch` (any revision) into the branch checked out in `dir`. A conflict is
    /// aborted, leaving the tree as it was, and reported as [`MergeResult::Conflict`].
    pub async fn merge(
        &self,
        dir: &Path,
        branch: &str,
        strategy: MergeStrategy,
    ) -> Result<MergeResult, GitError> {
        let mode = match strategy {
            MergeStrategy::FastForwardOnly => "--ff-only",
            MergeStrategy::MergeCommit => "--no-ff",
        };
        self.merge_rev(dir, branch, mode).await
    }

    /// Brings the branch checked out in `worktree` up to date with `default_branch` (any
    /// revision, e.g. `main` or `origin/main`) by merging it in (fast-forward when possible).
    /// A conflict is aborted and reported as [`MergeResult::Conflict`].
    pub async fn rebase_or_merge_default(
        &self,
        worktree: &Path,
        default_branch: &str,
    ) -> Result<MergeResult, GitError> {
        self.merge_rev(worktree, default_branch, "--ff").await
    }

    /// True when `dir` has a remote called `remote`.
    pub async fn has_remote(&self, dir: &Path, remote: &str) -> Result<bool, GitError> {
        let out = self.text(dir, args(["remote"])).await?;
        Ok(out.lines().any(|line| line.trim() == remote))
    }

    /// Pushes `branch` to the same name on `remote`. Returns false (and does nothing) when
    /// there is no such remote.
    pub async fn push(&self, dir: &Path, remote: &str, branch: &str) -> Result<bool, GitError> {
        if !self.has_remote(dir, remote).await? {
            return Ok(false);
        }
        let refspec = format!("refs/heads/{branch}:refs/heads/{branch}");
        self.run(
            dir,
            args(["push", "--quiet", RECEIVE_PACK, remote, &refspec]),
        )
        .await?;
        Ok(true)
    }

    /// Fetches `remote` (pruning deleted branches). Returns false (and does nothing) when there
    /// is no such remote.
    pub async fn fetch(&self, dir: &Path, remote: &str) -> Result<bool, GitError> {
        if !self.has_remote(dir, remote).await? {
            return Ok(false);
        }
        self.run(
            dir,
            args(["fetch", "--quiet", UPLOAD_PACK, "--prune", remote]),
        )
        .await?;
        Ok(true)
    }

    /// The files under `path` (relative to the root; a directory or a file) as committed on
    /// `branch`, sorted. A branch that does not exist has no files.
    pub async fn log_files(
        &self,
        dir: &Path,
        branch: &str,
        path: &str,
    ) -> Result<Vec<String>, GitError> {
        let Some(tree) = self.rev_parse(dir, &format!("{branch}^{{tree}}")).await? else {
            return Ok(Vec::new());
        };
        let out = self
            .text(
                dir,
                args([
                    "ls-tree",
                    "-r",
                    "-z",
                    "--full-tree",
                    "--name-only",
                    &tree,
                    "--",
                    path,
                ]),
            )
            .await?;
        let mut files = split_nul(&out);
        files.sort();
        Ok(files)
    }

    /// Whether the checkout in `dir` has a merge, cherry-pick or revert in progress (the files
    /// git leaves for one in the checkout's git directory). True when that cannot be told.
    pub fn operation_in_progress(&self, dir: &Path) -> bool {
        let Some(gitdir) = git_dir_of(dir) else {
            return true;
        };
        ["MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD"]
            .iter()
            .any(|f| std::fs::symlink_metadata(gitdir.join(f)).is_ok())
    }

    /// Every file under `path` (relative to the root; a file or a directory) as committed on
    /// `branch`, sorted by path, with its content (invalid UTF-8 replaced): what
    /// [`Git::log_files`] lists, each read as [`Git::show_file`] would, in three git processes
    /// whatever their number (one `cat-file --batch` for all the blobs) instead of three per
    /// file. Empty when the branch does not exist.
    pub async fn files_at(
        &self,
        dir: &Path,
        branch: &str,
        path: &str,
    ) -> Result<Vec<(String, String)>, GitError> {
        let Some(tree) = self.rev_parse(dir, &format!("{branch}^{{tree}}")).await? else {
            return Ok(Vec::new());
        };
        let listing = self
            .text(
                dir,
                args(["ls-tree", "-r", "-z", "--full-tree", &tree, "--", path]),
            )
            .await?;
        // `<mode> <type> <object>\t<path>`, NUL-terminated.
        let mut blobs: Vec<(String, String)> = split_nul(&listing)
            .into_iter()
            .filter_map(|entry| {
                let (meta, file) = entry.split_once('\t')?;
                let mut meta = meta.split(' ');
                let (_mode, kind, object) = (meta.next()?, meta.next()?, meta.next()?);
                (kind == "blob").then(|| (file.to_owned(), object.to_owned()))
            })
            .collect();
        blobs.sort();
        if blobs.is_empty() {
            return Ok(Vec::new());
        }
        let mut wanted = String::new();
        for (_, object) in &blobs {
            wanted.push_str(object);
            wanted.push('\n');
        }
        let argv = args(["cat-file", "--batch"]);
        let out = self
            .output(dir, argv.clone(), Some(wanted.into_bytes()))
            .await?;
        if !out.success() {
            return Err(failed(dir, &argv, &out));
        }
        whole_stdout(dir, &argv, &out)?;
        let contents =
            parse_batch(&out.stdout_tail, blobs.len()).ok_or_else(|| GitError::Failed {
                dir: dir.to_owned(),
                args: lossy(&argv),
                exit: out.status,
                stderr: "its answer does not parse as `cat-file --batch` output".to_owned(),
            })?;
        Ok(blobs
            .into_iter()
            .zip(contents)
            .map(|((file, _), content)| (file, content))
            .collect())
    }

    /// The content of `path` (relative to the root) as committed at `rev`, or `None` when the
    /// revision or the file does not exist. Invalid UTF-8 is replaced.
    pub async fn show_file(
        &self,
        dir: &Path,
        rev: &str,
        path: &str,
    ) -> Result<Option<String>, GitError> {
        let Some(object) = self.rev_parse(dir, &format!("{rev}:{path}")).await? else {
            return Ok(None);
        };
        let kind = self.text(dir, args(["cat-file", "-t", &object])).await?;
        if kind.trim() != "blob" {
            return Ok(None);
        }
        Ok(Some(
            self.text(dir, args(["cat-file", "blob", &object])).await?,
        ))
    }

    /// Resets the checked-out branch, index and working tree of `dir` to `rev`.
    pub async fn reset_hard(&self, dir: &Path, rev: &str) -> Result<(), GitError> {
        self.run(dir, args(["reset", "--quiet", "--hard", rev, "--"]))
            .await?;
        Ok(())
    }

    /// Puts `path` (relative to `dir`'s root) back as `HEAD` has it, in the index and the
    /// working tree; a path `HEAD` does not have is only dropped from the index.
    pub async fn restore_from_head(&self, dir: &Path, path: &Path) -> Result<(), GitError> {
        let rel = path.to_string_lossy().into_owned();
        if self.rev_parse(dir, &format!("HEAD:{rel}")).await?.is_some() {
            self.run(dir, args(["checkout", "HEAD", "--", &rel]))
                .await?;
        } else {
            self.run(
                dir,
                args(["rm", "--cached", "--quiet", "--ignore-unmatch", "--", &rel]),
            )
            .await?;
        }
        Ok(())
    }

    /// Deletes untracked files and directories in `dir` (ignored files, such as build output,
    /// and nested repositories and worktrees are kept).
    pub async fn clean(&self, dir: &Path) -> Result<(), GitError> {
        self.run(dir, args(["clean", "--quiet", "-f", "-d"]))
            .await?;
        Ok(())
    }

    // ---- ref-level operations: no working tree, every branch move a compare-and-swap ----

    /// Detaches `HEAD` of the checkout in `dir` at its current commit, so its branches can be
    /// moved by [`Git::update_branch`] without leaving its working tree behind.
    pub async fn detach_head(&self, dir: &Path) -> Result<(), GitError> {
        self.run(dir, args(["checkout", "--quiet", "--detach"]))
            .await?;
        Ok(())
    }

    /// Moves `refs/heads/<branch>` to `new`, only if it is at `old` now (`None`: only if the
    /// branch does not exist). Losing the race is [`GitError::Failed`]: nothing moved.
    pub async fn update_branch(
        &self,
        dir: &Path,
        branch: &str,
        new: &str,
        old: Option<&str>,
    ) -> Result<(), GitError> {
        let refname = format!("refs/heads/{branch}");
        let zero = "0".repeat(40);
        let old = old.unwrap_or(&zero);
        self.run(
            dir,
            args(["update-ref", "-m", "orch: release", &refname, new, old]),
        )
        .await?;
        Ok(())
    }

    /// Makes a commit whose parent is `parent` and whose tree is `parent`'s with `files`
    /// (paths relative to the root) written, without any working tree; returns its id. No
    /// branch moves: the caller publishes it with [`Git::update_branch`].
    pub async fn commit_files_onto(
        &self,
        dir: &Path,
        parent: &str,
        files: &[(String, Vec<u8>)],
        message: &str,
    ) -> Result<String, GitError> {
        let index = TempIndex::new();
        self.indexed(dir, &index, args(["read-tree", parent]), None)
            .await?;
        for (path, content) in files {
            let blob = self
                .indexed(
                    dir,
                    &index,
                    args(["hash-object", "-w", "--stdin"]),
                    Some(content.clone()),
                )
                .await?;
            let info = format!("100644,{},{path}", blob.trim());
            self.indexed(
                dir,
                &index,
                args(["update-index", "--add", "--cacheinfo", &info]),
                None,
            )
            .await?;
        }
        let tree = self
            .indexed(dir, &index, args(["write-tree"]), None)
            .await?;
        self.commit_tree(dir, tree.trim(), &[parent], message).await
    }

    /// Reverts on top of `head` what `from..to` changed (a three-way merge of `head` and
    /// `from` over the base `to`), keeping `keep` (a path, e.g. the work item's artifact
    /// folder) as `head` has it. Returns the revert commit (not published) or the conflicting
    /// files.
    pub async fn revert_onto(
        &self,
        dir: &Path,
        head: &str,
        from: &str,
        to: &str,
        keep: &str,
        message: &str,
    ) -> Result<RevertResult, GitError> {
        let merge_base = format!("--merge-base={to}");
        let tree = match self
            .merge_tree(dir, args([&merge_base, head, from]))
            .await?
        {
            Ok(tree) => tree,
            Err(files) => return Ok(RevertResult::Conflict { files }),
        };
        let index = TempIndex::new();
        self.indexed(dir, &index, args(["read-tree", &tree]), None)
            .await?;
        self.indexed(
            dir,
            &index,
            args(["rm", "--cached", "-r", "-q", "--ignore-unmatch", "--", keep]),
            None,
        )
        .await?;
        let kept = format!("{head}:{keep}");
        if self.rev_parse(dir, &kept).await?.is_some() {
            let prefix = format!("--prefix={}/", keep.trim_end_matches('/'));
            self.indexed(dir, &index, args(["read-tree", &prefix, &kept]), None)
                .await?;
        }
        let tree = self
            .indexed(dir, &index, args(["write-tree"]), None)
            .await?;
        let sha = self.commit_tree(dir, tree.trim(), &[head], message).await?;
        Ok(RevertResult::Reverted { sha })
    }

    /// A merge commit of `theirs` on top of `base` (first parent `base`), built without any
    /// working tree; no branch moves. A conflict is reported with its files.
    pub async fn merge_commit_onto(
        &self,
        dir: &Path,
        base: &str,
        theirs: &str,
        message: &str,
    ) -> Result<MergeResult, GitError> {
        let tree = match self.merge_tree(dir, args([base, theirs])).await? {
            Ok(tree) => tree,
            Err(files) => return Ok(MergeResult::Conflict { files }),
        };
        let sha = self
            .commit_tree(dir, &tree, &[base, theirs], message)
            .await?;
        Ok(MergeResult::Merged { sha })
    }

    /// `git merge-tree --write-tree` with `rest` (revisions, options): the merged tree, or the
    /// conflicting files (sorted, once each). Nothing is written but objects.
    async fn merge_tree(
        &self,
        dir: &Path,
        rest: Vec<OsString>,
    ) -> Result<Result<String, Vec<String>>, GitError> {
        let mut argv = args(["merge-tree", "--write-tree", "--name-only", "-z"]);
        argv.extend(rest);
        let out = self.output(dir, argv.clone(), None).await?;
        let text = out.stdout_lossy();
        let mut parts = text.split('\0');
        let tree = parts.next().unwrap_or_default().trim().to_owned();
        match out.status {
            ExitKind::Exited(0) => Ok(Ok(tree)),
            ExitKind::Exited(1) => {
                let mut files: Vec<String> = parts
                    .take_while(|p| !p.is_empty())
                    .map(str::to_owned)
                    .collect();
                files.sort();
                files.dedup();
                Ok(Err(files))
            }
            _ => Err(failed(dir, &argv, &out)),
        }
    }

    /// `(id, full message)` of every commit in `range` (e.g. `a..b`), newest first.
    pub async fn commit_messages(
        &self,
        dir: &Path,
        range: &str,
    ) -> Result<Vec<(String, String)>, GitError> {
        let out = self
            .text(dir, args(["log", "-z", "--format=%H%n%B", range, "--"]))
            .await?;
        Ok(split_nul(&out)
            .into_iter()
            .filter_map(|entry| {
                let entry = entry.trim_start_matches('\n');
                let (sha, body) = entry.split_once('\n').unwrap_or((entry, ""));
                (!sha.is_empty()).then(|| (sha.to_owned(), body.to_owned()))
            })
            .collect())
    }

    /// Every commit in `range` (e.g. `a..b`), newest first, with what a rebase keeps of it:
    /// its author (name, email, date) and its message. Used to tell a forge's rebase of a
    /// pull request (new ids and committer, the rest kept) from commits that are not in it.
    pub async fn commit_origins(
        &self,
        dir: &Path,
        range: &str,
    ) -> Result<Vec<CommitOrigin>, GitError> {
        let out = self
            .text(
                dir,
                args([
                    "log",
                    "-z",
                    "--date=raw",
                    "--format=%H%n%P%n%an <%ae> %ad%n%B",
                    range,
                    "--",
                ]),
            )
            .await?;
        Ok(split_nul(&out)
            .into_iter()
            .filter_map(|entry| {
                let mut lines = entry.trim_start_matches('\n').splitn(4, '\n');
                let sha = lines.next().filter(|s| !s.is_empty())?.to_owned();
                let parents = lines.next().unwrap_or_default().split_whitespace().count();
                let author = lines.next().unwrap_or_default().to_owned();
                let message = lines.next().unwrap_or_default().to_owned();
                Some(CommitOrigin {
                    sha,
                    parents,
                    author,
                    message,
                })
            })
            .collect())
    }

    async fn commit_tree(
        &self,
        dir: &Path,
        tree: &str,
        parents: &[&str],
        message: &str,
    ) -> Result<String, GitError> {
        let mut argv = args(["commit-tree", tree]);
        for p in parents {
            argv.push("-p".into());
            argv.push((*p).into());
        }
        argv.push("-F".into());
        argv.push("-".into());
        let out = self
            .output(dir, argv.clone(), Some(message.as_bytes().to_vec()))
            .await?;
        if !out.success() {
            return Err(failed(dir, &argv, &out));
        }
        Ok(out.stdout_lossy().trim().to_owned())
    }

    /// Runs git with the private index `index`; its stdout on success.
    async fn indexed(
        &self,
        dir: &Path,
        index: &TempIndex,
        argv: Vec<OsString>,
        stdin: Option<Vec<u8>>,
    ) -> Result<String, GitError> {
        let out = self
            .output_env(dir, argv.clone(), stdin, Some(&index.0))
            .await?;
        if out.success() {
            Ok(out.stdout_lossy())
        } else {
            Err(failed(dir, &argv, &out))
        }
    }

    // ---- internals ----

    /// Runs git and returns its output whatever the exit; `Err` only when it could not start.
    /// A run that failed on a lock file left by a git process that is gone (killed -9 with
    /// orch, say) has the lock cleared and runs once more (see [`stale_lock`]).
    async fn output(
        &self,
        dir: &Path,
        argv: Vec<OsString>,
        stdin: Option<Vec<u8>>,
    ) -> Result<Output, GitError> {
        let out = self
            .output_env(dir, argv.clone(), stdin.clone(), None)
            .await?;
        if out.success() {
            return Ok(out);
        }
        let Some(lock) = stale_lock(&out.stderr_lossy(), self.timeout) else {
            return Ok(out);
        };
        match std::fs::remove_file(&lock) {
            Ok(()) => {
                tracing::warn!(lock = %lock.display(),
                    "removed a git lock file whose holder is gone; running git again");
                self.output_env(dir, argv, stdin, None).await
            }
            Err(_) => Ok(out),
        }
    }

    /// [`Git::output`] with a private index file (`GIT_INDEX_FILE`), for plumbing that builds
    /// trees without touching any working tree or the repository's own index.
    async fn output_env(
        &self,
        dir: &Path,
        argv: Vec<OsString>,
        stdin: Option<Vec<u8>>,
        index: Option<&Path>,
    ) -> Result<Output, GitError> {
        let mut cmd = self
            .command(dir)
            .args(argv.iter().cloned())
            .env("GIT_AUTHOR_NAME", &self.identity.name)
            .env("GIT_AUTHOR_EMAIL", &self.identity.email)
            .env("GIT_COMMITTER_NAME", &self.identity.name)
            .env("GIT_COMMITTER_EMAIL", &self.identity.email)
            .output_limit(GIT_OUTPUT_LIMIT);
        if let Some(index) = index {
            cmd = cmd.env("GIT_INDEX_FILE", index);
        }
        if let Some(bytes) = stdin {
            cmd = cmd.stdin(bytes);
        }
        let out = process::run(&cmd).await.map_err(|source| GitError::Spawn {
            dir: dir.to_owned(),
            args: lossy(&argv),
            source,
        })?;
        tracing::debug!(dir = %dir.display(), args = ?lossy(&argv), status = %out.status, "git");
        Ok(out)
    }

    /// Runs git; anything but exit 0 is an error.
    async fn run(&self, dir: &Path, argv: Vec<OsString>) -> Result<Output, GitError> {
        let out = self.output(dir, argv.clone(), None).await?;
        if out.success() {
            Ok(out)
        } else {
            Err(failed(dir, &argv, &out))
        }
    }

    /// Runs git and returns its whole stdout; exit ≠ 0 or an over-long stdout is an error.
    async fn text(&self, dir: &Path, argv: Vec<OsString>) -> Result<String, GitError> {
        let out = self.run(dir, argv.clone()).await?;
        whole_stdout(dir, &argv, &out)?;
        Ok(out.stdout_lossy())
    }

    /// True when `dir` is the top of a working tree (not a subdirectory of some other one).
    async fn is_toplevel(&self, dir: &Path) -> bool {
        match self.text(dir, args(["rev-parse", "--show-toplevel"])).await {
            Ok(top) => normalize(Path::new(top.trim())) == normalize(dir),
            Err(_) => false,
        }
    }

    /// True when commit `a` is an ancestor of (or equal to) commit `b`.
    pub async fn is_ancestor(&self, dir: &Path, a: &str, b: &str) -> Result<bool, GitError> {
        let argv = args(["merge-base", "--is-ancestor", a, b]);
        let out = self.output(dir, argv.clone(), None).await?;
        match out.status {
            ExitKind::Exited(0) => Ok(true),
            ExitKind::Exited(1) => Ok(false),
            _ => Err(failed(dir, &argv, &out)),
        }
    }

    async fn head(&self, dir: &Path) -> Result<String, GitError> {
        self.rev_parse(dir, "HEAD")
            .await?
            .ok_or_else(|| GitError::UnknownRevision {
                dir: dir.to_owned(),
                rev: "HEAD".to_owned(),
            })
    }

    /// Merges `rev` into `HEAD` with `mode` (`--ff-only`, `--no-ff` or `--ff`).
    async fn merge_rev(&self, dir: &Path, rev: &str, mode: &str) -> Result<MergeResult, GitError> {
        let Some(theirs) = self.rev_parse(dir, &format!("{rev}^{{commit}}")).await? else {
            return Err(GitError::UnknownRevision {
                dir: dir.to_owned(),
                rev: rev.to_owned(),
            });
        };
        if self.is_ancestor(dir, &theirs, "HEAD").await? {
            return Ok(MergeResult::Merged {
                sha: self.head(dir).await?,
            });
        }
        if mode == "--ff-only" && !self.is_ancestor(dir, "HEAD", &theirs).await? {
            return Ok(MergeResult::NotFastForward);
        }
        let argv = args(["merge", "--quiet", "--no-edit", mode, rev]);
        let out = self.output(dir, argv.clone(), None).await?;
        if out.success() {
            return Ok(MergeResult::Merged {
                sha: self.head(dir).await?,
            });
        }
        let conflicted = self
            .text(dir, args(["diff", "--name-only", "--diff-filter=U", "-z"]))
            .await?;
        let mut files = split_nul(&conflicted);
        if self.rev_parse(dir, "MERGE_HEAD").await?.is_some() {
            self.run(dir, args(["merge", "--abort"])).await?;
        }
        if files.is_empty() {
            return Err(failed(dir, &argv, &out));
        }
        files.sort();
        files.dedup();
        Ok(MergeResult::Conflict { files })
    }

    /// The worktrees git has registered for `repo` (the main one included).
    async fn worktrees(&self, repo: &Path) -> Result<Vec<WorktreeEntry>, GitError> {
        let out = self
            .text(repo, args(["worktree", "list", "--porcelain", "-z"]))
            .await?;
        Ok(parse_worktrees(&out))
    }

    /// Never-raise: lists the directory holding the worktree `path` in `repo`'s
    /// `info/exclude` when it lies inside `repo`'s working tree, so worktrees do not show up as
    /// untracked files of the main checkout. Failures are logged; the worktree works regardless.
    async fn exclude_nested(&self, repo: &Path, path: &Path) {
        if let Err(e) = self.try_exclude_nested(repo, path).await {
            tracing::warn!(repo = %repo.display(), path = %path.display(), error = %e, "cannot exclude the worktree from the main checkout; it will show as untracked there");
        }
    }

    /// Whether the worktree `path` of `repo` can be reused as it is, decided by reads only and
    /// without the repository's lock: registered in `repo` and not prunable (read from the
    /// files `git worktree list` reads), a working worktree whose top level is `path`, on
    /// `branch`, and already excluded from the main checkout. `false` on any doubt: the locked
    /// path of [`Git::worktree_add`] then decides (and repairs).
    async fn reusable_unlocked(&self, repo: &Path, path: &Path, branch: &str) -> bool {
        let Some(admin) = registration(repo, path).filter(|r| !r.prunable) else {
            return false;
        };
        // The branch as the worktree's HEAD file names it (what `symbolic-ref` reads); a HEAD
        // that is not a plain branch ref leaves the decision to the locked path.
        let on_branch = std::fs::read_to_string(admin.dir.join("HEAD"))
            .is_ok_and(|head| head.trim().strip_prefix("ref: refs/heads/") == Some(branch));
        on_branch && self.is_toplevel(path).await && self.excluded(repo, path).await
    }

    /// Whether `repo`'s `info/exclude` already keeps the worktree `path` out of the main
    /// checkout (true when `path` is not inside it); false when that cannot be read.
    async fn excluded(&self, repo: &Path, path: &Path) -> bool {
        match self.exclude_entry(repo, path).await {
            Ok(None) => true,
            Ok(Some((file, line))) => std::fs::read_to_string(file)
                .is_ok_and(|content| content.lines().any(|l| l.trim() == line)),
            Err(_) => false,
        }
    }

    /// `repo`'s `info/exclude` file and the line that keeps the worktree `path` out of the
    /// main checkout; `None` when `path` does not lie inside `repo`'s working tree.
    async fn exclude_entry(
        &self,
        repo: &Path,
        path: &Path,
    ) -> Result<Option<(PathBuf, String)>, GitError> {
        // An ordinary clone (`<repo>/.git` a directory, as orch's clones are) is its own top
        // level and keeps `info/exclude` in it: no git needed. Anything else asks git.
        let plain = repo.join(".git");
        let (top, exclude) = if plain.is_dir() {
            (normalize(repo), Some(plain.join("info").join("exclude")))
        } else {
            let top = self
                .text(repo, args(["rev-parse", "--show-toplevel"]))
                .await?;
            (normalize(Path::new(top.trim())), None)
        };
        let target = normalize(path);
        let Ok(rel) = target.strip_prefix(&top) else {
            return Ok(None);
        };
        let dir = rel
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(rel);
        let Some(dir) = dir.to_str().filter(|d| !d.is_empty()) else {
            return Ok(None);
        };
        let line = format!("/{dir}/");
        let exclude = match exclude {
            Some(file) => file,
            None => {
                let file = self
                    .text(repo, args(["rev-parse", "--git-path", "info/exclude"]))
                    .await?;
                repo.join(file.trim())
            }
        };
        Ok(Some((exclude, line)))
    }

    async fn try_exclude_nested(&self, repo: &Path, path: &Path) -> Result<(), GitError> {
        let Some((exclude, line)) = self.exclude_entry(repo, path).await? else {
            return Ok(());
        };
        let mut content = std::fs::read_to_string(&exclude).unwrap_or_default();
        if content.lines().any(|l| l.trim() == line) {
            return Ok(());
        }
        create_dir_all(&parent_dir(&exclude))?;
        if !content.is_empty() && !content.ends_with('\n') {
            content.push('\n');
        }
        content.push_str(&line);
        content.push('\n');
        std::fs::write(&exclude, content).map_err(|source| GitError::Io {
            action: "write",
            path: exclude.clone(),
            source,
        })
    }

    /// `<remote>/<branch>` when a remote-tracking branch of that name exists (`origin` first).
    async fn remote_branch(&self, repo: &Path, branch: &str) -> Result<Option<String>, GitError> {
        let out = self
            .text(
                repo,
                args(["for-each-ref", "--format=%(refname)", "refs/remotes/"]),
            )
            .await?;
        let mut found: Vec<String> = out
            .lines()
            .filter_map(|r| r.strip_prefix("refs/remotes/"))
            .filter(|r| r.split_once('/').is_some_and(|(_, b)| b == branch))
            .map(str::to_owned)
            .collect();
        found.sort_by_key(|r| !r.starts_with("origin/"));
        Ok(found.into_iter().next())
    }
}

/// Operations orch needs on a repository it does not own (the user's checkout, a bare repo, a
/// remote): compare-and-swap ref moves and fetches that never touch a working tree.
impl Git {
    /// True when `dir` is a bare repository (false for a working tree).
    pub async fn is_bare(&self, dir: &Path) -> Result<bool, GitError> {
        let out = self
            .text(dir, args(["rev-parse", "--is-bare-repository"]))
            .await?;
        Ok(out.trim() == "true")
    }

    /// The URL of `remote` in `dir`, or `None` when there is no such remote.
    pub async fn remote_url(&self, dir: &Path, remote: &str) -> Result<Option<String>, GitError> {
        if !self.has_remote(dir, remote).await? {
            return Ok(None);
        }
        let out = self
            .text(dir, args(["remote", "get-url", "--", remote]))
            .await?;
        Ok(Some(out.trim().to_owned()))
    }

    /// Where `branch` is on `remote` (a remote name or a URL), asked over the wire;
    /// `None` when the remote has no such branch.
    pub async fn ls_remote_branch(
        &self,
        dir: &Path,
        remote: &str,
        branch: &str,
    ) -> Result<Option<String>, GitError> {
        let refname = format!("refs/heads/{branch}");
        let out = self
            .text(
                dir,
                args(["ls-remote", UPLOAD_PACK, "--", remote, &refname]),
            )
            .await?;
        Ok(out.lines().find_map(|line| {
            let (sha, name) = line.split_once('\t')?;
            (name.trim() == refname).then(|| sha.trim().to_owned())
        }))
    }

    /// Pushes commit `new` to `refs/heads/<branch>` on `remote` only if the remote has it at
    /// `old` (`None`: only if it does not exist): `--force-with-lease=<ref>:<old>`, never a
    /// plain force. A remote that moved makes git refuse the push (an error).
    pub async fn push_with_lease(
        &self,
        dir: &Path,
        remote: &str,
        branch: &str,
        old: Option<&str>,
        new: &str,
    ) -> Result<(), GitError> {
        let refname = format!("refs/heads/{branch}");
        let lease = format!("--force-with-lease={refname}:{}", old.unwrap_or(""));
        let refspec = format!("{new}:{refname}");
        self.run(
            dir,
            args([
                "push",
                "--quiet",
                RECEIVE_PACK,
                &lease,
                "--",
                remote,
                &refspec,
            ]),
        )
        .await?;
        Ok(())
    }

    /// Fetches `refname` of `source` (a path or URL) into `dir`'s object store without
    /// changing any of `dir`'s refs, its index or its working tree.
    pub async fn fetch_objects(
        &self,
        dir: &Path,
        source: &str,
        refname: &str,
    ) -> Result<(), GitError> {
        self.run(
            dir,
            args([
                "fetch",
                "--quiet",
                UPLOAD_PACK,
                "--no-tags",
                "--no-write-fetch-head",
                "--",
                source,
                refname,
            ]),
        )
        .await?;
        Ok(())
    }

    /// Sets `refname` to `new` only if it is at `old` now (`None`: whatever it is), atomically
    /// (git's own compare-and-swap); no working tree is touched.
    pub async fn update_ref(
        &self,
        dir: &Path,
        refname: &str,
        new: &str,
        old: Option<&str>,
    ) -> Result<(), GitError> {
        let mut argv = args(["update-ref", "-m", "orch: publish", "--", refname, new]);
        if let Some(old) = old {
            argv.push(old.into());
        }
        self.run(dir, argv).await?;
        Ok(())
    }

    /// Deletes `refname` (a missing one is fine).
    pub async fn delete_ref(&self, dir: &Path, refname: &str) -> Result<(), GitError> {
        if self.rev_parse(dir, refname).await?.is_none() {
            return Ok(());
        }
        self.run(dir, args(["update-ref", "-d", "--", refname]))
            .await?;
        Ok(())
    }

    /// The working tree of `repo` (its main one or a linked worktree) that has `branch`
    /// checked out, if any.
    pub async fn checked_out_at(
        &self,
        repo: &Path,
        branch: &str,
    ) -> Result<Option<PathBuf>, GitError> {
        Ok(self
            .worktrees(repo)
            .await?
            .into_iter()
            .find(|w| !w.prunable && w.branch.as_deref() == Some(branch))
            .map(|w| w.path))
    }
}

/// One entry of `git worktree list --porcelain`.
#[derive(Debug, PartialEq, Eq)]
struct WorktreeEntry {
    path: PathBuf,
    branch: Option<String>,
    prunable: bool,
}

fn parse_worktrees(out: &str) -> Vec<WorktreeEntry> {
    let mut entries = Vec::new();
    let mut current: Option<WorktreeEntry> = None;
    for field in out.split('\0') {
        if let Some(path) = field.strip_prefix("worktree ") {
            entries.extend(current.take());
            current = Some(WorktreeEntry {
                path: PathBuf::from(path),
                branch: None,
                prunable: false,
            });
        } else if let Some(entry) = current.as_mut() {
            if let Some(branch) = field.strip_prefix("branch ") {
                entry.branch = Some(
                    branch
                        .strip_prefix("refs/heads/")
                        .unwrap_or(branch)
                        .to_owned(),
                );
            } else if field == "prunable" || field.starts_with("prunable ") {
                entry.prunable = true;
            }
        }
    }
    entries.extend(current);
    entries
}

fn parse_status(out: &str) -> Vec<StatusEntry> {
    let mut entries = Vec::new();
    let mut fields = out.split('\0').filter(|f| !f.is_empty());
    while let Some(field) = fields.next() {
        let (Some(code), Some(path)) = (field.get(..2), field.get(3..)) else {
            tracing::warn!(field, "unexpected git status line; skipped");
            continue;
        };
        let orig_path = if code.contains(['R', 'C']) {
            fields.next().map(str::to_owned)
        } else {
            None
        };
        entries.push(StatusEntry {
            code: code.to_owned(),
            path: path.to_owned(),
            orig_path,
        });
    }
    entries
}

/// One commit of [`Git::commit_origins`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitOrigin {
    pub sha: String,
    /// How many parents it has (2 or more: a merge commit).
    pub parents: usize,
    /// `Name <email> <seconds> <offset>`: the author and the author date, as git stores them.
    pub author: String,
    /// The full message.
    pub message: String,
}

/// One path of [`Git::changes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    /// The two-letter status `XY` (`??` untracked, ` M` modified, `A ` added, ` D` deleted).
    pub code: [u8; 2],
    /// The path relative to the working tree's root, as git stores it.
    pub path: Vec<u8>,
}

impl Changed {
    /// True for a file git does not track (nothing of it is in the index).
    pub fn is_untracked(&self) -> bool {
        &self.code == b"??"
    }
}

fn parse_changes(out: &[u8]) -> Vec<Changed> {
    out.split(|b| *b == 0)
        .filter(|f| !f.is_empty())
        .filter_map(|field| match (field.get(..2), field.get(3..)) {
            (Some(&[x, y]), Some(path)) if !path.is_empty() => Some(Changed {
                code: [x, y],
                path: path.to_vec(),
            }),
            _ => {
                tracing::warn!(field = %String::from_utf8_lossy(field), "unexpected git status entry; skipped");
                None
            }
        })
        .collect()
}

/// True when `path` is `prefix` or inside it (by whole path components).
fn under_prefix(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_matches('/');
    if prefix.is_empty() {
        return true;
    }
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// What [`Git::revert_onto`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RevertResult {
    /// The revert commit (not on any branch yet).
    Reverted { sha: String },
    /// The revert conflicts with what came after the change in these files.
    Conflict { files: Vec<String> },
}

/// A private index file in the temp dir, removed on drop.
struct TempIndex(PathBuf);

impl TempIndex {
    fn new() -> TempIndex {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        TempIndex(std::env::temp_dir().join(format!("orch-index-{}-{n}", std::process::id())))
    }
}

impl Drop for TempIndex {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn split_nul(out: &str) -> Vec<String> {
    out.split('\0')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

fn args<const N: usize>(list: [&str; N]) -> Vec<OsString> {
    list.iter().map(OsString::from).collect()
}

fn lossy(argv: &[OsString]) -> Vec<String> {
    argv.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

fn failed(dir: &Path, argv: &[OsString], out: &Output) -> GitError {
    let text = if out.stderr_tail.is_empty() {
        out.stdout_lossy()
    } else {
        out.stderr_lossy()
    };
    GitError::Failed {
        dir: dir.to_owned(),
        args: lossy(argv),
        exit: out.status,
        stderr: process::last_lines(&text, ERROR_LINES),
    }
}

fn create_dir_all(dir: &Path) -> Result<(), GitError> {
    std::fs::create_dir_all(dir).map_err(|source| GitError::Io {
        action: "create directory",
        path: dir.to_owned(),
        source,
    })
}

/// The directory containing `path` (`.` for a bare name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

fn is_non_empty(path: &Path) -> bool {
    match std::fs::read_dir(path) {
        Ok(mut entries) => entries.next().is_some(),
        // A file (or a dangling symlink) in the worktree's place also has to go.
        Err(_) => path.symlink_metadata().is_ok(),
    }
}

/// Deletes a leftover worktree directory, unless it is (or contains) the repository itself or
/// holds a repository of its own.
fn remove_stray(repo: &Path, path: &Path) -> Result<(), GitError> {
    let target = normalize(path);
    let refuse = |reason| GitError::RefuseToDelete {
        path: path.to_owned(),
        reason,
    };
    if normalize(repo).starts_with(&target) {
        return Err(refuse("it is the repository or contains it"));
    }
    if path.join(".git").is_dir() {
        return Err(refuse(
            "it holds a repository of its own (.git is a directory)",
        ));
    }
    let meta = path.symlink_metadata().map_err(|source| GitError::Io {
        action: "inspect",
        path: path.to_owned(),
        source,
    })?;
    let removed = if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    removed.map_err(|source| GitError::Io {
        action: "delete",
        path: path.to_owned(),
        source,
    })
}

/// `path` made absolute against orch's working directory (unchanged if that fails).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

/// `path` made absolute with symlinks resolved as far as it exists, for comparing paths git
/// prints with paths orch was given.
fn normalize(path: &Path) -> PathBuf {
    if let Ok(real) = path.canonicalize() {
        return real;
    }
    let abs = absolute(path);
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => parent
            .canonicalize()
            .map(|p| p.join(name))
            .unwrap_or(abs.clone()),
        _ => abs,
    }
}

/// A linked worktree's registration in its repository: the administrative directory
/// `<repo>/.git/worktrees/<id>` and whether git would prune it (its worktree's `.git` is gone).
#[derive(Debug)]
struct Registration {
    dir: PathBuf,
    prunable: bool,
}

/// Where `repo` has registered the linked worktree `path`, read from the files `git worktree
/// list` reads: `path/.git` is a file naming `<repo>/.git/worktrees/<id>`, whose `gitdir`
/// file names `path/.git` back. `None` when `path` does not name a registration of `repo`.
fn registration(repo: &Path, path: &Path) -> Option<Registration> {
    let admin = named_path(&path.join(".git"), "gitdir:")?;
    let in_repo = admin.parent().is_some_and(|worktrees| {
        worktrees.file_name() == Some(std::ffi::OsStr::new("worktrees"))
            && worktrees
                .parent()
                .is_some_and(|common| common == normalize(&repo.join(".git")))
    });
    let back = named_path(&admin.join("gitdir"), "")?;
    (in_repo && back == normalize(&path.join(".git"))).then(|| Registration {
        prunable: !back.exists(),
        dir: admin,
    })
}

/// Every registration of `repo` whose `gitdir` names `path/.git`, found by reading
/// `<repo>/.git/worktrees/*/gitdir` (the registrations `git worktree list` lists). `None` when
/// `repo` is not an ordinary clone (its `.git` not a directory): then only git can tell.
fn registrations_naming(repo: &Path, path: &Path) -> Option<Vec<Registration>> {
    let common = repo.join(".git");
    if !common.is_dir() {
        return None;
    }
    let target = normalize(&path.join(".git"));
    let entries = match std::fs::read_dir(common.join("worktrees")) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(Vec::new()),
        Err(_) => return None,
    };
    let mut found = Vec::new();
    for entry in entries {
        let dir = entry.ok()?.path();
        if named_path(&dir.join("gitdir"), "").as_ref() == Some(&target) {
            found.push(Registration {
                prunable: !target.exists(),
                dir,
            });
        }
    }
    Some(found)
}

/// The path the first line of `file` names after `prefix` (relative to the file's directory
/// when relative), normalized; `None` when it cannot be read.
fn named_path(file: &Path, prefix: &str) -> Option<PathBuf> {
    let text = std::fs::read_to_string(file).ok()?;
    let value = text.lines().next()?.strip_prefix(prefix)?.trim().to_owned();
    Some(normalize(&file.parent()?.join(value)))
}

/// An error when git printed more than orch keeps of one command's stdout.
fn whole_stdout(dir: &Path, argv: &[OsString], out: &Output) -> Result<(), GitError> {
    if out.stdout_truncated() {
        return Err(GitError::TooMuchOutput {
            dir: dir.to_owned(),
            args: lossy(argv),
            bytes: out.stdout_bytes,
            limit: GIT_OUTPUT_LIMIT,
        });
    }
    Ok(())
}

/// The contents of the `count` objects `cat-file --batch` printed: `<object> <type> <size>\n`,
/// the bytes, `\n`, each (invalid UTF-8 replaced). `None` when the answer is anything else (an
/// object reported `missing`, a size that overruns the output).
fn parse_batch(mut out: &[u8], count: usize) -> Option<Vec<String>> {
    let mut contents = Vec::with_capacity(count);
    for _ in 0..count {
        let eol = out.iter().position(|&b| b == b'\n')?;
        let header = std::str::from_utf8(&out[..eol]).ok()?;
        let size: usize = header.rsplit(' ').next()?.parse().ok()?;
        let body = out.get(eol + 1..eol + 1 + size)?;
        contents.push(String::from_utf8_lossy(body).into_owned());
        out = out.get(eol + 1 + size + 1..)?;
    }
    Some(contents)
}

/// The git directory of the checkout whose top is `dir`: `dir/.git`, or the directory a
/// linked worktree's `.git` file names. `None` when it is neither.
fn git_dir_of(dir: &Path) -> Option<PathBuf> {
    let dotgit = dir.join(".git");
    let meta = std::fs::symlink_metadata(&dotgit).ok()?;
    if meta.is_dir() {
        Some(normalize(&dotgit))
    } else if meta.is_file() {
        named_path(&dotgit, "gitdir:")
    } else {
        None
    }
}

/// The commit `dir`'s `HEAD` points at, read from the files `git rev-parse HEAD` reads (the
/// checkout's `HEAD`, and the branch's loose ref in the common directory): no process for the
/// commit just made. `None` whenever that is not plainly so (packed or reftable refs, a
/// symbolic link, anything unexpected): the caller then asks git.
fn head_from_files(dir: &Path) -> Option<String> {
    let gitdir = git_dir_of(dir)?;
    let head = std::fs::read_to_string(gitdir.join("HEAD")).ok()?;
    let head = head.trim();
    let id = match head.strip_prefix("ref: ") {
        Some(name) => {
            let plain = name.starts_with("refs/heads/")
                && !name.contains("..")
                && !name.contains(['\\', '\0']);
            if !plain {
                return None;
            }
            let common = named_path(&gitdir.join("commondir"), "").unwrap_or(gitdir);
            let file = common.join(name);
            if !std::fs::symlink_metadata(&file).ok()?.is_file() {
                return None;
            }
            std::fs::read_to_string(file).ok()?.trim().to_owned()
        }
        None => head.to_owned(),
    };
    (matches!(id.len(), 40 | 64) && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

/// The in-process lock that serializes worktree changes of one repository.
fn repo_lock(repo: &Path) -> Arc<tokio::sync::Mutex<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>> = OnceLock::new();
    let mut locks = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    locks.entry(normalize(repo)).or_default().clone()
}

/// The lock file a failed git run names (`Unable to create '<path>.lock': File exists`) when it
/// is stale: no live `git` process works inside the repository it belongs to, or it is older
/// than twice the git timeout (no git run of orch lives that long). `None` otherwise: a live
/// holder's lock is never touched.
pub fn stale_lock(stderr: &str, git_timeout: Duration) -> Option<PathBuf> {
    let start = stderr.find("Unable to create '")? + "Unable to create '".len();
    let rest = &stderr[start..];
    let path = PathBuf::from(&rest[..rest.find("': File exists")?]);
    if path.extension().is_none_or(|e| e != "lock") {
        return None;
    }
    // The repository: everything before the `.git` component (worktrees live inside it).
    let mut repo = PathBuf::new();
    let mut found = false;
    for part in path.components() {
        if part.as_os_str() == ".git" {
            found = true;
            break;
        }
        repo.push(part);
    }
    if !found {
        return None;
    }
    let old = std::fs::symlink_metadata(&path)
        .ok()?
        .modified()
        .ok()
        .and_then(|m| m.elapsed().ok())
        .is_some_and(|age| age > git_timeout.saturating_mul(2));
    let repo = std::fs::canonicalize(&repo).unwrap_or(repo);
    (old || !git_running_in(&repo)).then_some(path)
}

/// True when a live process named `git` has its working directory inside `repo`.
fn git_running_in(repo: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return true; // cannot tell: assume a holder
    };
    entries.flatten().any(|e| {
        let p = e.path();
        let is_git = std::fs::read_to_string(p.join("comm")).is_ok_and(|c| c.trim() == "git");
        is_git
            && std::fs::read_link(p.join("cwd")).is_ok_and(|cwd| cwd.starts_with(repo))
            && std::fs::read_to_string(p.join("stat")).is_ok_and(|s| {
                s.rfind(')')
                    .and_then(|i| s[i + 1..].split_whitespace().next())
                    .is_some_and(|state| state != "Z")
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_worktree_list() {
        let out = "worktree /r\0HEAD abc\0branch refs/heads/main\0\0\
                   worktree /r/wt/a\0HEAD def\0branch refs/heads/orch/A-1\0prunable gitdir file points to non-existent location\0\0\
                   worktree /r/wt/b\0HEAD 123\0detached\0\0";
        let expect = vec![
            WorktreeEntry {
                path: "/r".into(),
                branch: Some("main".into()),
                prunable: false,
            },
            WorktreeEntry {
                path: "/r/wt/a".into(),
                branch: Some("orch/A-1".into()),
                prunable: true,
            },
            WorktreeEntry {
                path: "/r/wt/b".into(),
                branch: None,
                prunable: false,
            },
        ];
        assert_eq!(parse_worktrees(out), expect);
    }

    #[test]
    fn parses_changes_whatever_the_names_hold() {
        let out = b"?? new\nline\0 M a b\0?? bad\xff\0D  gone\0\0";
        let got = parse_changes(out);
        let paths: Vec<&[u8]> = got.iter().map(|c| c.path.as_slice()).collect();
        assert_eq!(paths, [&b"new\nline"[..], b"a b", b"bad\xff", b"gone"]);
        assert!(got[0].is_untracked() && !got[1].is_untracked());
        assert_eq!(&got[3].code, b"D ");
    }

    #[test]
    fn parses_status_with_renames() {
        let out = " M a.txt\0R  new.txt\0old.txt\0?? dir/x y.txt\0";
        let got = parse_status(out);
        assert_eq!(got.len(), 3);
        assert_eq!(
            (
                got[0].code.as_str(),
                got[0].path.as_str(),
                got[0].orig_path.as_deref()
            ),
            (" M", "a.txt", None)
        );
        assert_eq!(
            (
                got[1].code.as_str(),
                got[1].path.as_str(),
                got[1].orig_path.as_deref()
            ),
            ("R ", "new.txt", Some("old.txt"))
        );
        assert_eq!(
            (got[2].code.as_str(), got[2].path.as_str()),
            ("??", "dir/x y.txt")
        );
    }

    #[test]
    fn prefix_matches_whole_components() {
        let check = |path: &str, prefix: &str, expect: bool| {
            assert_eq!(under_prefix(path, prefix), expect, "{path} under {prefix}");
        };
        check("docs/work-items/A-1/02.md", "docs/work-items/A-1", true);
        check("docs/work-items/A-1/02.md", "docs/work-items/A-1/", true);
        check("docs/work-items/A-1", "docs/work-items/A-1", true);
        check("docs/work-items/A-10/02.md", "docs/work-items/A-1", false);
        check("src/main.rs", "docs/work-items/A-1", false);
        check("anything", "", true);
    }
}
