//! The engine's half of [`orch_domain::protect`]: before a stage's work is staged or
//! committed, what the stage left in its worktree is listed (git's porcelain status, `-z`,
//! untracked files one by one), each path is inspected without following a link, and the
//! domain's rules decide. Nothing is added to git before the check, so a refused change
//! never reaches a branch, nor even orch's object store.
//!
//! - An **agent's stage** that breaks a rule fails the attempt with the rule and the path in
//!   an `artifact.rejected` event. Its worktree is removed (untracked files, special files and
//!   nested repositories with it), and the branch is moved back if the agent committed on it
//!   itself; the next attempt starts from a fresh checkout of the branch. An agent's stage also
//!   may not move its branch or switch the worktree away from it.
//! - For every stage, index entries flagged `skip-worktree` or `assume-unchanged` (whose file
//!   git would neither list nor stage, committing the index's content instead) are dropped
//!   first by rebuilding the index from `HEAD`; what `git add -A` then commits is what the
//!   files are, as listed here.
//! - A **runner's stage** (tests, merge, staging, deploy, watch, lessons) runs the repository's
//!   own code, whose by-products (a cache, a report) are no part of the runner's commit: what
//!   it may not commit is put back as the branch has it and said in a `commit.discarded`
//!   event, and the stage goes on with its own documents.

use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};

use anyhow::Result;
use orch_domain::control::events;
use orch_domain::pipeline::{Pipeline, StageKind};
use orch_domain::protect::{self, Change, Entry, Rule, Scope, Violation};
use orch_exec::git::{Changed, Git, GitError};

use super::{StageRun, StageStart as Start};

/// The most violations an event lists (its text says how many more there were).
const LISTED: usize = 12;
/// The most violations an event's data keeps.
const KEPT: usize = 200;

/// What the check found.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// The stage may commit what it left.
    Clean,
    /// An agent's stage broke a rule: the attempt fails with `reason` (already recorded, and
    /// the worktree put back).
    Refused { reason: String },
}

/// The rules for `run`'s stage: the domain's scope, read from the stage's descriptor (its
/// documents, [`orch_domain::pipeline::StageDef::also_writes`], whether it writes code or the
/// lessons file).
pub(crate) fn scope(pipeline: &Pipeline, run: &StageRun) -> Scope {
    Scope::of(
        pipeline,
        &run.stage,
        &run.work_item,
        &run.repo.lessons_file,
        usize::try_from(run.settings.max_changed_files).unwrap_or(usize::MAX),
    )
}

/// Checks what `run`'s stage left and acts on it (see the module docs).
pub(crate) async fn check(
    git: &Git,
    pipeline: &Pipeline,
    run: &StageRun,
) -> Result<(Verdict, Vec<Violation>)> {
    let start = run.start.as_ref();
    let scope = scope(pipeline, run);
    let agent = run.stage.kind == StageKind::Llm;
    let mut violations = Vec::new();
    if agent && let Some(start) = start {
        violations.extend(moved(git, run, start).await?);
    }
    // An index entry that hides its file from git would be committed from the index alone.
    if violations.is_empty() {
        let hidden = |path: &Vec<u8>| Violation {
            path: orch_domain::text::escape_bytes(path),
            rule: Rule::IndexFlag,
            reason: protect::reason(&scope, &Rule::IndexFlag),
        };
        violations.extend(git.unhide_index(&run.worktree).await?.iter().map(hidden));
    }
    // A listing too big for orch to read is itself a violation, and then nothing is listed.
    let (listed, unlisted) = match git.changes(&run.worktree).await {
        Ok(listed) => (listed, false),
        Err(GitError::TooMuchOutput { bytes, .. }) => {
            violations.push(too_many(&scope, bytes));
            (Vec::new(), true)
        }
        Err(e) => return Err(e.into()),
    };
    let inspected: Vec<Change> = listed
        .iter()
        .map(|c| Change::new(c.path.clone(), entry_at(&run.worktree, &c.path)))
        .collect();
    violations.extend(protect::check(&scope, &inspected));
    // The item's folder must stay a real folder whatever git lists (it lists a link, never
    // what is behind one).
    let folder = run.work_item.artifact_dir();
    let listed_above = |v: &Violation| {
        !v.path.is_empty() && (folder == v.path || folder.starts_with(&format!("{}/", v.path)))
    };
    if let Some(why) = crate::fsutil::unsafe_dirs(&run.worktree, Path::new(&folder))
        && !violations.iter().any(listed_above)
    {
        violations.push(Violation {
            path: folder.clone(),
            rule: Rule::Symlink,
            reason: format!("{why}; documents are written only through real folders"),
        });
    }
    if violations.is_empty() {
        return Ok((Verdict::Clean, violations));
    }
    if agent {
        let reason = format!(
            "{}'s change refused before commit (nothing of it was committed; the next attempt starts from the branch): {}",
            run.stage.name,
            protect::summary(&violations, LISTED)
        );
        put_back_worktree(git, run, start).await;
        return Ok((Verdict::Refused { reason }, violations));
    }
    // A flag git keeps setting (a sparse checkout) cannot be put back path by path.
    if violations.iter().any(|v| v.rule == Rule::IndexFlag) {
        anyhow::bail!(
            "{} cannot commit: {}",
            run.stage.name,
            protect::summary(&violations, LISTED)
        );
    }
    discard(git, run, &listed, unlisted, &violations).await?;
    Ok((Verdict::Clean, violations))
}

/// The event data of `violations`: `{stage, count, rules: [{path, rule, reason}]}`.
pub(crate) fn data(run: &StageRun, violations: &[Violation]) -> serde_json::Value {
    let rules: Vec<serde_json::Value> = violations
        .iter()
        .take(KEPT)
        .map(|v| serde_json::json!({"path": v.path, "rule": v.rule.code(), "reason": v.reason}))
        .collect();
    serde_json::json!({
        "stage": run.stage.name.as_str(),
        "attempt": run.lease.attempt,
        "count": violations.len(),
        "rules": rules,
    })
}

/// The text of a runner's `commit.discarded` event.
pub(crate) fn discarded_text(run: &StageRun, violations: &[Violation]) -> String {
    format!(
        "{} left what it does not commit (by-products of the repository's code); removed, not committed: {}",
        run.stage.name,
        protect::summary(violations, LISTED)
    )
}

/// The kind of event for a runner's discarded by-products.
pub(crate) const DISCARDED: &str = events::COMMIT_DISCARDED;

/// The violation of a listing git printed too much of to read.
fn too_many(scope: &Scope, bytes: u64) -> Violation {
    let rule = Rule::TooManyFiles {
        count: usize::try_from(bytes).unwrap_or(usize::MAX),
        limit: scope.max_files,
    };
    Violation {
        path: String::new(),
        reason: format!(
            "git's list of the changes is {bytes} bytes, more than orch reads: far more changed paths than the {} one commit may hold (`[settings] max_changed_files`)",
            scope.max_files
        ),
        rule,
    }
}

/// What `worktree/rel` holds, without following a link: not at its name, and not on the way
/// to it (a path below a link is absent as far as the worktree is concerned; git lists the
/// link itself).
fn entry_at(worktree: &Path, rel: &[u8]) -> Entry {
    let rel = Path::new(std::ffi::OsStr::from_bytes(rel));
    if let Some(parent) = rel.parent()
        && crate::fsutil::unsafe_dirs(worktree, parent).is_some()
    {
        return Entry::Absent;
    }
    let Ok(meta) = std::fs::symlink_metadata(worktree.join(rel)) else {
        return Entry::Absent;
    };
    let kind = meta.file_type();
    if kind.is_symlink() {
        Entry::Symlink
    } else if kind.is_dir() {
        Entry::Directory
    } else if kind.is_file() {
        Entry::File {
            links: meta.nlink(),
        }
    } else if kind.is_fifo() {
        Entry::Fifo
    } else if kind.is_socket() {
        Entry::Socket
    } else {
        Entry::Device
    }
}

/// An agent's stage must end on its branch at the commit it began from: it may not commit,
/// reset or switch branches itself (only orch commits on `orch/<id>`).
async fn moved(git: &Git, run: &StageRun, start: &Start) -> Result<Option<Violation>> {
    let branch = git.current_branch(&run.worktree).await?;
    let head = git.rev_parse(&run.worktree, "HEAD").await?;
    let tip = git
        .rev_parse(&run.worktree, &format!("refs/heads/{}", start.branch))
        .await?;
    let what = if branch.as_deref() != Some(start.branch.as_str()) {
        format!(
            "the worktree was switched from `{}` to {}",
            start.branch,
            branch.map_or_else(|| "a detached HEAD".to_owned(), |b| format!("`{b}`"))
        )
    } else if head.as_deref() != Some(start.head.as_str())
        || tip.as_deref() != Some(start.head.as_str())
    {
        format!(
            "`{}` was moved from {:.12} to {:.12} by the stage itself",
            start.branch,
            start.head,
            tip.as_deref().unwrap_or("nothing")
        )
    } else {
        return Ok(None);
    };
    Ok(Some(Violation {
        path: String::new(),
        rule: Rule::BranchMoved,
        reason: format!("{what}; only orch commits on a work item's branch"),
    }))
}

/// After an agent's refused change: the branch back where the stage began (compare-and-swap
/// from where the agent left it) and the worktree removed, so the next attempt checks the
/// branch out afresh. Failures are logged: the attempt fails either way, and the next one
/// prepares its worktree from the branch.
async fn put_back_worktree(git: &Git, run: &StageRun, start: Option<&Start>) {
    if let Some(start) = start {
        let refname = format!("refs/heads/{}", start.branch);
        match git.rev_parse(&run.repo_dir, &refname).await {
            Ok(Some(tip)) if tip != start.head => {
                if let Err(e) = git
                    .update_branch(&run.repo_dir, &start.branch, &start.head, Some(&tip))
                    .await
                {
                    tracing::warn!(work_item = %run.work_item, error = %e, "could not move the branch back");
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(work_item = %run.work_item, error = %e, "could not read the branch")
            }
        }
    }
    if let Err(e) = git.worktree_remove(&run.repo_dir, &run.worktree).await {
        tracing::warn!(work_item = %run.work_item, error = %e,
            "could not remove the worktree of a refused change; resetting it instead");
        let reset = async {
            git.reset_hard(&run.worktree, "HEAD").await?;
            git.clean(&run.worktree).await
        };
        if let Err(e) = reset.await {
            tracing::warn!(work_item = %run.work_item, error = %e, "could not reset the worktree");
        }
    }
}

/// A runner's discarded paths put back as the branch has them: untracked ones removed (the
/// link itself, never what it points to; a nested repository with its content), tracked ones
/// restored from `HEAD` in one git run. A runner may commit only its own documents, so every
/// other path has a violation of its own; when git's listing was too big to read, everything
/// goes back, the runner's documents with it (its gate then finds them missing, and says so).
async fn discard(
    git: &Git,
    run: &StageRun,
    listed: &[Changed],
    unlisted: bool,
    violations: &[Violation],
) -> Result<()> {
    if unlisted {
        git.reset_hard(&run.worktree, "HEAD").await?;
        git.clean(&run.worktree).await?;
        return Ok(());
    }
    let refused: std::collections::HashSet<&str> =
        violations.iter().map(|v| v.path.as_str()).collect();
    let mut tracked = Vec::new();
    for c in listed {
        if !refused.contains(orch_domain::text::escape_bytes(&c.path).as_str()) {
            continue;
        }
        if c.is_untracked() {
            remove_untracked(&run.worktree, &c.path)?;
        } else {
            tracked.push(c.path.clone());
        }
    }
    git.restore_paths(&run.worktree, &tracked).await?;
    Ok(())
}

/// Removes an untracked path of the worktree, never through a link on the way to it.
fn remove_untracked(worktree: &Path, rel: &[u8]) -> Result<()> {
    let rel = PathBuf::from(std::ffi::OsStr::from_bytes(rel));
    if let Some(parent) = rel.parent()
        && crate::fsutil::unsafe_dirs(worktree, parent).is_some()
    {
        return Ok(());
    }
    let path = worktree.join(&rel);
    let removed = match std::fs::symlink_metadata(&path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
        Ok(_) => std::fs::remove_file(&path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    removed.map_err(|e| anyhow::anyhow!("cannot remove {}: {e}", path.display()))
}
