//! The release train: what reaches a repo's default branch and production, in which order, and
//! what each deploy shipped.
//!
//! The model, in four rules:
//! 1. **One release at a time per repo.** The stages of [`Pipeline::release_track`] (merge →
//!    staging → deploy → observe → lessons) are held by one task of a repo at a time. Entering
//!    the track is [`Store::advance_stage_exclusive`]: a compare-and-swap in the database, so it
//!    holds across processes and hosts, and it is released by the holder's stage leaving the
//!    track (moving on, looping back, failing, being cancelled) — a dead process never holds
//!    it. A task that finds the track held waits in its current stage: its job is requeued
//!    with `[orch:release-wait seq=N]` (`orch_domain::control::markers::release_wait`) and
//!    re-tries only the stage change (the artifact is already committed), with a
//!    `release.waiting` event naming the holder.
//! 2. **The default branch only receives what passed staging.** The merge gate builds and
//!    verifies the candidate (the item's branch brought up to date with the default branch)
//!    without moving the default branch; staging stages exactly that commit and records it
//!    (`release.staged`); the deploy stage first *promotes* it: the default branch moves from
//!    exactly the commit the candidate was built on to exactly the staged commit (a
//!    compare-and-swap on orch's clone and on the remote). If the default branch moved
//!    meanwhile (a push from outside orch), the task goes back to `merge` to rebuild the
//!    candidate and stage it again. A remote that refuses the push although nobody moved the
//!    branch (a protected branch) is published through the repo's forge instead
//!    ([`crate::forge::release`]): the ref moved to exactly the staged commit, or the item's
//!    release pull request merged with its head pinned; the forge's commit is deployed only
//!    if its tree is exactly the staged tree (else `release.forge_mismatch`, back to `merge`).
//! 3. **Production ships exactly the staged commit**, and every deploy records the items it
//!    shipped (`release.deployed`: revision, previous live revision, the work items between).
//! 4. **A rolled-back change is taken out.** With `on_failure = "revert"` the change is
//!    reverted on the default branch (a revert commit made without any working tree, published
//!    by compare-and-swap, recorded as `18-revert.md` and `release.reverted`) before the track is
//!    released, so the next item stages and deploys on the corrected branch. With
//!    `on_failure = "hold"` (or when the revert conflicts) the item keeps the track in
//!    `lessons` (`release.held`) until an operator approves (`orch approve`) or cancels it.

use std::path::Path;

use anyhow::{Context as _, Result, bail};
use orch_domain::control::events;
use orch_domain::payload::{self, Change, ReleaseDeployed, ReleaseRolledBack, ShippedChange};
use orch_domain::pipeline::Pipeline;
use orch_domain::text::one_line;
use orch_exec::RevertResult;
use orch_store::{Event, Exclusive, Store};
use serde_json::json;

use crate::engine::StageRun;
use crate::repos::{self, RepoPaths};

/// The artifact recording a revert.
pub const REVERT_LOG: &str = orch_domain::pipeline::REVERT_LOG;

/// How long a task waiting for the release track waits between tries (the engine's).
pub const WAIT_S: u64 = crate::engine::TRACK_WAIT_S;

/// The guard for entering the release track of `pipeline` (the engine's own).
pub fn track(pipeline: &Pipeline) -> Exclusive {
    crate::engine::release_track(pipeline)
}

fn value(e: &Event) -> serde_json::Value {
    e.data_value()
}

fn field(e: &Event, key: &str) -> Option<String> {
    value(e).get(key)?.as_str().map(str::to_owned)
}

fn seq_of(e: &Event) -> Option<i64> {
    value(e).get("seq")?.as_i64()
}

/// Appends a release event to the run's task, fenced by the job's lease: the one way the
/// release train records anything. An attempt that lost its job (or cannot write) gets the
/// error and stops there; nothing is dropped in silence. Each record is made so that the job's
/// next attempt, finding the effect done and its record missing, makes it then (the promotion
/// by its intent, the revert by its trailer, the deploy by its recorded outcome, staging by
/// running again).
async fn record(
    run: &StageRun,
    kind: &str,
    message: String,
    data: serde_json::Value,
) -> Result<i64> {
    let event = orch_store::NewEvent::new(kind, message)
        .task(run.task.id)
        .job(run.job.id)
        .stage(run.stage.name.as_str())
        .data(data.to_string());
    run.store
        .append_event_fenced(run.lease, event)
        .await
        .with_context(|| format!("cannot record {kind} for {}", run.work_item))
}

async fn latest(run: &StageRun, kind: &str) -> Result<Option<Event>> {
    let events = run.store.task_events(run.task.id).await?;
    Ok(events.into_iter().rev().find(|e| e.kind == kind))
}

/// Records the commit that passed staging (called by the staging runner on SUCCESS). An
/// error fails the staging attempt: its retry stages again and records then, since the deploy
/// ships only a recorded staged commit.
pub async fn record_staged(run: &StageRun, revision: &str) -> Result<()> {
    record(
        run,
        events::RELEASE_STAGED,
        format!("staging passed on `{revision}`"),
        json!({"repo": run.repo_name.as_str(), "revision": revision, "seq": run.task.stage_seq}),
    )
    .await?;
    Ok(())
}

/// What [`promote`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Promotion {
    /// The default branch holds the staged commit `new` (moved from `old`).
    Promoted { old: String, new: String },
    /// The default branch moved to `main` since the candidate `staged` was built.
    Moved { main: String, staged: String },
}

/// Moves the default branch to the commit that passed staging (rule 2). Idempotent: a re-run
/// after a crash finds the move done (or redoes the part that was not).
pub async fn promote(run: &StageRun, seq: i64) -> Result<Promotion> {
    let Some(staged) = latest(run, events::RELEASE_STAGED).await? else {
        bail!(
            "no staged revision is recorded for {}: the deploy ships only what passed staging",
            run.work_item
        );
    };
    let staged = field(&staged, "revision").context("the release.staged event has no revision")?;
    let branch = run.repo.default_branch.as_str();
    let main = sync_or_step_aside(run, Step::Aside).await?;
    let done = latest(run, events::RELEASE_PROMOTED)
        .await?
        .filter(|e| seq_of(e) == Some(seq) && staged_of(e).as_deref() == Some(&staged));
    if let Some(done) = done {
        // A later job of the same visit (a finalizer defer, a re-run). Through the forge, the
        // promoted commit is the forge's (same tree as the staged one).
        let new = field(&done, "new").unwrap_or_else(|| staged.clone());
        if run.git.is_ancestor(&run.repo_dir, &new, &main).await? {
            let old = field(&done, "old").unwrap_or_default();
            return Ok(Promotion::Promoted { old, new });
        }
        return Ok(Promotion::Moved { main, staged });
    }
    // A publication through the forge that an earlier attempt began: found and finished
    // (by the pull request's merged state or the branch), never done twice.
    let through_forge = latest(run, events::RELEASE_FORGE_MERGING)
        .await?
        .filter(|e| seq_of(e) == Some(seq) && field(e, "staged").as_deref() == Some(&staged));
    if let Some(intent) = through_forge {
        let old = field(&intent, "old").context("the release.forge_merging event has no old")?;
        return forge_promotion(run, seq, &old, &staged, Some(&intent)).await;
    }
    let intent = latest(run, events::RELEASE_PROMOTING)
        .await?
        .filter(|e| seq_of(e) == Some(seq) && field(e, "new").as_deref() == Some(&staged));
    if let Some(intent) = &intent
        && run.git.is_ancestor(&run.repo_dir, &staged, &main).await?
    {
        // Done before a crash: the event that says so may be missing.
        let old = field(intent, "old").unwrap_or_default();
        finish_promotion(run, seq, &old, &staged).await?;
        return Ok(Promotion::Promoted { old, new: staged });
    }
    if main == staged {
        return Ok(Promotion::Promoted {
            old: main,
            new: staged,
        });
    }
    if !run.git.is_ancestor(&run.repo_dir, &main, &staged).await? {
        return Ok(Promotion::Moved { main, staged });
    }
    // Written ahead of the move: an attempt that lost its job (or cannot write) moves nothing.
    record(
        run,
        events::RELEASE_PROMOTING,
        format!("moving `{branch}` from `{main}` to the staged `{staged}`"),
        json!({"repo": run.repo_name.as_str(), "old": main, "new": staged, "seq": seq}),
    )
    .await
    .context("cannot record the promotion's intent; the default branch was not moved")?;
    let published = match repos::move_default_branch(
        &run.git,
        &run.repo_dir,
        &run.repo,
        &main,
        &staged,
    )
    .await
    {
        Ok(published) => published,
        // A protected branch: through the forge's API, when the repo has one.
        Err(e) if repos::push_refused(&e) && run.repo.forge.is_some() => {
            tracing::info!(work_item = %run.work_item, error = %e, "the default branch refused the push; publishing through the forge");
            return forge_promotion(run, seq, &main, &staged, None).await;
        }
        Err(e) => return Err(e),
    };
    note_unpublished(run, &published).await?;
    // The branch moved and its record is not made yet: a crash here (or a lease lost) leaves
    // the intent, by which the next attempt finds the move done and records it.
    crate::failpoint::pause("release.after_promote", &run.repo_dir.to_string_lossy()).await;
    finish_promotion(run, seq, &main, &staged).await?;
    Ok(Promotion::Promoted {
        old: main,
        new: staged,
    })
}

/// The staged commit a `release.promoted` event promoted: its `staged` (a promotion through
/// the forge, whose `new` is the forge's commit), else its `new`.
fn staged_of(e: &Event) -> Option<String> {
    field(e, "staged").or_else(|| field(e, "new"))
}

/// One publication through the forge: `new` onto the default branch, from exactly `old`.
struct Publication<'a> {
    /// The branch orch owns that carries `new` (the pull request's head).
    head: String,
    old: &'a str,
    new: &'a str,
    /// The pull request's title and body; the commit's title and message (merge, squash).
    pull_title: String,
    pull_body: String,
    title: String,
    message: String,
}

impl<'a> Publication<'a> {
    /// The publication of commit `new` (made on `old`, the default branch) on the branch
    /// `orch/<what>/<id>`: the pull request titled by `message`'s first line, its body
    /// `pull_body` and a word that orch owns the branch; with the repo's forge.
    fn of_commit(
        run: &StageRun,
        what: &str,
        old: &'a str,
        new: &'a str,
        message: &str,
        pull_body: String,
    ) -> Result<(orch_domain::forge::ForgeConfig, Publication<'a>)> {
        let cfg = run
            .repo
            .forge
            .clone()
            .with_context(|| format!("the repo has no forge to publish the {what} through"))?;
        let (title, body) = message.split_once('\n').unwrap_or((message, ""));
        let publication = Publication {
            head: format!("orch/{what}/{}", run.work_item),
            old,
            new,
            pull_title: title.to_owned(),
            pull_body: format!("{pull_body}\n\nDo not push to this branch: orch owns it."),
            title: title.to_owned(),
            message: body.trim_start().to_owned(),
        };
        Ok((cfg, publication))
    }
}

/// What the forge put on the default branch.
enum ForgePublished {
    /// `commit` (the staged commit itself, or the forge's merge/squash/rebase of it) has
    /// exactly the verified tree and descends from `old`.
    Published { commit: String, pull: Option<u64> },
    /// It does not: nothing may be deployed from it.
    Mismatch {
        commit: String,
        why: String,
        staged_tree: String,
        merged_tree: String,
    },
}

/// Promotes through the forge's API (the default branch refused orch's push): the staged
/// commit goes to `orch/release/<id>`, then the default branch takes it (the ref moved, or the
/// pull request merged with its head pinned), and what the forge made is checked against the
/// staged tree. `intent` is an earlier attempt's `release.forge_merging`, to finish.
async fn forge_promotion(
    run: &StageRun,
    seq: i64,
    old: &str,
    staged: &str,
    intent: Option<&Event>,
) -> Result<Promotion> {
    let cfg = run
        .repo
        .forge
        .clone()
        .context("the repo has no forge to publish the release through")?;
    let id = run.work_item.as_str();
    let title = one_line(&run.task.title);
    let method = cfg.merge_method;
    let publication = Publication {
        head: format!("orch/release/{id}"),
        old,
        new: staged,
        pull_title: format!("{id}: {title}"),
        pull_body: format!(
            "Released by orch: exactly the commit staging verified (`{staged}`), onto `{}` at `{old}`.\n\nDo not push to this branch: orch owns it.",
            run.repo.default_branch
        ),
        title: format!("{id}: {title}"),
        message: format!(
            "Staging verified exactly {staged}; published through GitHub ({}).\n\nWork-Item: {id}\nStage: {}\n",
            method.as_str(),
            run.stage.name
        ),
    };
    let outcome = publish_through_forge(run, &cfg, seq, &publication, intent, Step::Aside).await?;
    close_open_wait(run, &cfg).await?;
    let via = format!("GitHub {} ({})", cfg.repo, method.as_str());
    match outcome {
        ForgePublished::Published { commit, pull } => {
            // orch's clone takes what the forge made (a fast-forward of its branch).
            repos::sync_default_branch(&run.git, &run.repo_dir, &run.repo).await?;
            let branch = run.repo.default_branch.as_str();
            record(
                run,
                events::RELEASE_PROMOTED,
                format!(
                    "`{branch}` now holds `{commit}` through {via}, with exactly the tree of the staged `{staged}` (was `{old}`)"
                ),
                json!({"repo": run.repo_name.as_str(), "old": old, "new": commit, "staged": staged,
                       "via": via, "pull": pull, "seq": seq}),
            )
            .await?;
            Ok(Promotion::Promoted {
                old: old.to_owned(),
                new: commit,
            })
        }
        ForgePublished::Mismatch {
            commit,
            why,
            staged_tree,
            merged_tree,
        } => {
            record(
                run,
                events::RELEASE_FORGE_MISMATCH,
                format!(
                    "{via} put `{commit}` on `{}`, which is not what staging verified: {why}; nothing is deployed, the item goes back to the merge gate",
                    run.repo.default_branch
                ),
                json!({"repo": run.repo_name.as_str(), "forge": cfg.repo, "method": method.as_str(),
                       "staged": staged, "merged": commit, "staged_tree": staged_tree,
                       "merged_tree": merged_tree, "seq": seq}),
            )
            .await?;
            let main = repos::sync_default_branch(&run.git, &run.repo_dir, &run.repo).await?;
            Ok(Promotion::Moved {
                main,
                staged: staged.to_owned(),
            })
        }
    }
}

/// Publishes `p.new` onto the default branch through the forge's API and checks what the
/// forge made. The intent (`release.forge_merging`) is written, fenced, before the call that
/// moves the branch; an earlier attempt's `intent` is finished instead: a pull request found
/// merged is not merged again, a branch found holding the commit is not moved again.
async fn publish_through_forge(
    run: &StageRun,
    cfg: &orch_domain::forge::ForgeConfig,
    seq: i64,
    p: &Publication<'_>,
    intent: Option<&Event>,
    step: Step,
) -> Result<ForgePublished> {
    use crate::forge::release::Api;
    use orch_domain::forge::MergeMethod;
    let branch = run.repo.default_branch.as_str();
    let method = cfg.merge_method;
    let api = through_forge(run, cfg, step, || async { Api::new(cfg) }).await?;
    let intent_data = |pull: Option<u64>| {
        json!({"repo": run.repo_name.as_str(), "forge": cfg.repo, "method": method.as_str(),
               "pull": pull, "branch": p.head, "old": p.old, "staged": p.new, "seq": seq})
    };
    let mut merged: Option<String> = None;
    let mut pull_no: Option<u64> = None;
    if method == MergeMethod::FastForward {
        // Already there (an earlier attempt moved it): not moved again.
        if intent.is_some()
            && let Some(remote) = run
                .git
                .ls_remote_branch(&run.repo_dir, repos::ORIGIN, branch)
                .await?
            && run.git.fetch(&run.repo_dir, repos::ORIGIN).await.is_ok()
            && run.git.is_ancestor(&run.repo_dir, p.new, &remote).await?
        {
            merged = Some(p.new.to_owned());
        }
        if merged.is_none() {
            // The commit must be on the forge before its ref can point at it.
            repos::push_owned_branch(&run.git, &run.repo_dir, &p.head, p.new).await?;
            if intent.is_none() {
                record(
                    run,
                    events::RELEASE_FORGE_MERGING,
                    format!(
                        "`{branch}` refused orch's push: moving it to `{}` through GitHub {} (PATCH git/refs, no force)",
                        p.new, cfg.repo
                    ),
                    intent_data(None),
                )
                .await
                .context("cannot record the intent to publish through the forge; nothing was published")?;
            }
            through_forge(run, cfg, step, || api.update_branch(branch, p.new)).await?;
            merged = Some(p.new.to_owned());
        }
    } else {
        let earlier = intent.and_then(|e| value(e)["pull"].as_u64());
        if let Some(n) = earlier {
            let pull = through_forge(run, cfg, step, || api.pull(n)).await?;
            if pull.merged {
                // Merged before the attempt that asked for it could record it.
                merged = Some(pull.merge_commit_sha.with_context(|| {
                    format!("pull request #{n} is merged but names no merge commit")
                })?);
                pull_no = Some(n);
            } else if pull.state == "open" {
                pull_no = Some(n);
            }
        }
        if merged.is_none() {
            repos::push_owned_branch(&run.git, &run.repo_dir, &p.head, p.new).await?;
            let n = match pull_no {
                Some(n) => n,
                None => {
                    through_forge(run, cfg, step, || {
                        api.find_or_open_release_pull(&p.head, branch, &p.pull_title, &p.pull_body)
                    })
                    .await?
                    .number
                }
            };
            if earlier != Some(n) {
                record(
                    run,
                    events::RELEASE_FORGE_MERGING,
                    format!(
                        "`{branch}` refused orch's push: merging pull request #{n} of GitHub {} ({}) with its head pinned to `{}`",
                        cfg.repo,
                        method.as_str(),
                        p.new
                    ),
                    intent_data(Some(n)),
                )
                .await
                .context("cannot record the intent to merge through the forge; nothing was merged")?;
            }
            let sha = through_forge(run, cfg, step, || {
                api.merge_pull(n, p.new, method.as_str(), &p.title, &p.message)
            })
            .await?;
            crate::failpoint::hit("release.after_forge_merge");
            merged = Some(sha);
            pull_no = Some(n);
        }
    }
    let commit = merged.context("the forge made no commit")?;
    verify_forge_commit(run, method, p.old, p.new, commit, pull_no).await
}

/// Checks what the forge put on the default branch: `commit` must have exactly the tree of
/// `verified` and descend from `old`; a merge or a squash must sit right on `old`, and a
/// rebase's commits must all be the pull request's, rewritten, the first right on `old` (a
/// branch that moved in between is not what staging verified). With a rebase only `commit`,
/// the last of its commits, is checked and deployed: the ones before it are on the branch but
/// were never staged as such, and orch deploys none of them.
async fn verify_forge_commit(
    run: &StageRun,
    method: orch_domain::forge::MergeMethod,
    old: &str,
    verified: &str,
    commit: String,
    pull: Option<u64>,
) -> Result<ForgePublished> {
    use orch_domain::forge::MergeMethod;
    let dir = &run.repo_dir;
    run.git
        .fetch(dir, repos::ORIGIN)
        .await
        .context("cannot fetch what the forge made")?;
    if run
        .git
        .rev_parse(dir, &format!("{commit}^{{commit}}"))
        .await?
        .is_none()
    {
        bail!(
            "the forge's commit {commit:.12} is not in `{}` after a fetch",
            repos::ORIGIN
        );
    }
    let tree = |rev: String| async move {
        run.git
            .rev_parse(dir, &format!("{rev}^{{tree}}"))
            .await?
            .with_context(|| format!("{rev:.12} has no tree"))
    };
    let staged_tree = tree(verified.to_owned()).await?;
    let merged_tree = tree(commit.clone()).await?;
    let why = if staged_tree != merged_tree {
        Some(format!(
            "its tree {merged_tree:.12} is not the staged tree {staged_tree:.12}"
        ))
    } else if !run.git.is_ancestor(dir, old, &commit).await? {
        Some(format!(
            "it does not descend from `{old:.12}`, where the default branch was"
        ))
    } else if matches!(method, MergeMethod::Merge | MergeMethod::Squash)
        && run
            .git
            .rev_parse(dir, &format!("{commit}^1"))
            .await?
            .as_deref()
            != Some(old)
    {
        Some(format!(
            "its parent is not `{old:.12}`: the default branch moved before the merge"
        ))
    } else if method == MergeMethod::Rebase {
        not_a_rebase_of(&run.git, dir, old, verified, &commit).await?
    } else {
        None
    };
    Ok(match why {
        None => ForgePublished::Published { commit, pull },
        Some(why) => ForgePublished::Mismatch {
            commit,
            why,
            staged_tree,
            merged_tree,
        },
    })
}

/// Why `commit` is not the forge's rebase of `old..verified` onto exactly `old`, if it is not.
/// GitHub's rebase merge replays the pull request's commits one by one onto the base branch:
/// a new commit for each (new id and committer, even where a fast-forward was possible; the
/// author, its date and the message kept), in a line, leaving out merge commits and commits
/// that were empty to begin with. So each commit of `old..commit` must be a commit of
/// `old..verified` that is not a merge (each taken once), and none may be a merge. Anything
/// else sits between `old` and the release although the tree matches (a commit pushed to the
/// default branch before the rebase, whose change the tree happens not to show): not what
/// staging verified, as a merge or a squash whose parent is not `old` is not. With `old` an
/// ancestor of `commit` (checked first) and no merge in between, the commits are a line whose
/// first sits right on `old`.
async fn not_a_rebase_of(
    git: &orch_exec::Git,
    dir: &Path,
    old: &str,
    verified: &str,
    commit: &str,
) -> Result<Option<String>> {
    let mut pulled: Vec<orch_exec::CommitOrigin> = git
        .commit_origins(dir, &format!("{old}..{verified}"))
        .await?
        .into_iter()
        .filter(|c| c.parents < 2)
        .collect();
    let rebased = git.commit_origins(dir, &format!("{old}..{commit}")).await?;
    if let Some(c) = rebased.iter().find(|c| c.parents > 1) {
        return Ok(Some(format!(
            "`{:.12}` between `{old:.12}` and it is a merge commit, which a rebase does not make",
            c.sha
        )));
    }
    for c in rebased.iter().rev() {
        let same = |p: &orch_exec::CommitOrigin| {
            p.author == c.author && p.message.trim_end() == c.message.trim_end()
        };
        match pulled.iter().position(same) {
            Some(i) => {
                pulled.swap_remove(i);
            }
            None => {
                return Ok(Some(format!(
                    "`{:.12}` between `{old:.12}` and it is not one of the pull request's commits rebased: the default branch moved before the rebase",
                    c.sha
                )));
            }
        }
    }
    Ok(None)
}

/// Whether a wait for the forge may step aside ([`StepAside`]) when it outlasts the forge's
/// `wait_step_s` in one job: the deploy's promotion may (its stage comes back as a new job),
/// and so may the watch's revert (the watch's ending comes back) and the audit commit (the
/// lessons stage comes back); a failed deploy's revert waits within its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Aside,
    Stay,
}

/// A release that waited for the forge as long as one job may (`wait_step_s`): the stage
/// steps aside and comes back after `delay_s`, its waiting on record (`forge.waiting`).
#[derive(Debug)]
pub struct StepAside {
    pub delay_s: u64,
    pub why: String,
}

impl std::fmt::Display for StepAside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "waiting for GitHub {} s more: {}",
            self.delay_s, self.why
        )
    }
}

impl std::error::Error for StepAside {}

/// The release's wait for the forge this visit began and did not end (its latest
/// `forge.waiting` after its latest `forge.resumed`): when it began and when its pending
/// check was first answered.
async fn waiting_on_record(run: &StageRun) -> Result<(Option<i64>, Option<i64>)> {
    let events = run.store.task_events(run.task.id).await?;
    let last = events.iter().rev().find(|e| {
        (e.kind == events::FORGE_WAITING || e.kind == events::FORGE_RESUMED)
            && value(e)["release"] == true
            && seq_of(e) == Some(run.task.stage_seq)
    });
    Ok(match last {
        Some(e) if e.kind == events::FORGE_WAITING => {
            let d = value(e);
            (
                Some(d["since"].as_i64().unwrap_or(e.created_at)),
                d["checks_since"].as_i64(),
            )
        }
        _ => (None, None),
    })
}

/// The default branch as the remote has it (`repos::sync_default_branch`), for a publication
/// that may step aside: while this visit waits for the forge (an earlier job stepped aside), a
/// fetch that fails is the same outage (GitHub's git down with its API) and steps aside again
/// instead of failing the attempt. Outside such a wait, a failed fetch is an error as before.
pub(crate) async fn sync_or_step_aside(run: &StageRun, step: Step) -> Result<String> {
    match repos::sync_default_branch(&run.git, &run.repo_dir, &run.repo).await {
        Ok(main) => Ok(main),
        Err(e) => {
            let Some(cfg) = run.repo.forge.as_ref().filter(|_| step == Step::Aside) else {
                return Err(e);
            };
            if waiting_on_record(run).await?.0.is_none() {
                return Err(e);
            }
            tracing::warn!(work_item = %run.work_item, forge = %cfg.repo, error = %format!("{e:#}"), "forge: the fetch fails while the release waits for GitHub; stepping aside again");
            Err(anyhow::Error::new(StepAside {
                delay_s: cfg.max_backoff_s.clamp(1, cfg.wait_step_s.max(1)),
                why: format!(
                    "cannot fetch `{}` from GitHub {}: {}",
                    run.repo.default_branch,
                    cfg.repo,
                    one_line(&format!("{e:#}"))
                ),
            }))
        }
    }
}

/// Ends the wait for the forge an earlier job of this visit began (it stepped aside) when no
/// call of this job saw it end: the publication it waited for is through.
async fn close_open_wait(run: &StageRun, cfg: &orch_domain::forge::ForgeConfig) -> Result<()> {
    if let (Some(since), _) = waiting_on_record(run).await? {
        say_resumed(run, cfg, since).await?;
    }
    Ok(())
}

/// Records the end of the release's wait for the forge that began at `since`.
async fn say_resumed(
    run: &StageRun,
    cfg: &orch_domain::forge::ForgeConfig,
    since: i64,
) -> Result<()> {
    let waited_s = (run.store.now_ms() - since) / 1000;
    record(
        run,
        events::FORGE_RESUMED,
        format!(
            "GitHub {} answers again; the release of {} goes on after {waited_s} s",
            cfg.repo, run.work_item
        ),
        json!({"repo": run.repo_name.as_str(), "forge": cfg.repo, "waited_s": waited_s,
               "release": true, "seq": run.task.stage_seq}),
    )
    .await?;
    Ok(())
}

/// Runs one call to the forge until it is answered: an outage or a rate limit is waited out
/// (backing off as polling does, `forge.waiting` once when the waiting starts and
/// `forge.resumed` when it ends: the item never fails for it); a refusal is an error. A merge
/// waiting for a required status check (`Answer::checks_pending`) is waited out too, but at
/// most the forge's `check_wait_s` from the first such answer: past it the call is an error
/// (`forge.check_wait_over` recorded), like a refusal, instead of waiting forever on a check
/// that never reports.
async fn through_forge<T, F, Fut>(
    run: &StageRun,
    cfg: &orch_domain::forge::ForgeConfig,
    step: Step,
    mut call: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, crate::forge::release::Failure>>,
{
    use crate::forge::release::Failure;
    let started = run.store.now_ms();
    let mut failures = 0u32;
    // A wait an earlier job of this visit began (it stepped aside) goes on: not said again,
    // and a pending check's clock keeps running from its first answer.
    let (mut since, mut checks_since) = match step {
        Step::Aside => waiting_on_record(run).await?,
        Step::Stay => (None, None),
    };
    let mut checks_said = checks_since.is_some();
    loop {
        match call().await {
            Ok(v) => {
                // The call that waited is answered. (Another call answering is no sign that
                // this wait, begun by an earlier job, is over: a merge may still wait for its
                // checks. The promotion closes that wait when it is done.)
                if failures > 0
                    && let Some(since) = since
                {
                    say_resumed(run, cfg, since).await?;
                }
                return Ok(v);
            }
            Err(Failure::Refused { message, .. }) => {
                bail!(
                    "GitHub {} refused the release of {}: {message}",
                    cfg.repo,
                    run.work_item
                )
            }
            Err(Failure::Outage { answer, message }) => {
                failures = failures.saturating_add(1);
                let now = run.store.now_ms();
                if answer.checks_pending {
                    let first = *checks_since.get_or_insert(now);
                    let waited_s = u64::try_from((now - first) / 1000).unwrap_or(0);
                    if waited_s >= cfg.check_wait_s {
                        record(
                            run,
                            events::FORGE_CHECK_WAIT_OVER,
                            format!(
                                "the release of {} through GitHub {} stops waiting for its required status checks after {waited_s} s (check_wait_s {}): {message}",
                                run.work_item, cfg.repo, cfg.check_wait_s
                            ),
                            json!({"repo": run.repo_name.as_str(), "forge": cfg.repo,
                                   "waited_s": waited_s, "check_wait_s": cfg.check_wait_s}),
                        )
                        .await?;
                        bail!(
                            "GitHub {} kept refusing the release of {} for its required status checks, {waited_s} s (check_wait_s {}): {message}",
                            cfg.repo,
                            run.work_item,
                            cfg.check_wait_s
                        );
                    }
                }
                let pause = orch_domain::forge::pause_after(
                    &answer,
                    now / 1000,
                    failures,
                    RETRY_S,
                    cfg.max_backoff_s,
                    crate::forge::jitter(),
                );
                let (secs, why) = match pause {
                    Some(p) => (p.secs.max(1), format!("{}: {message}", p.why)),
                    None => (RETRY_S, message),
                };
                tracing::warn!(work_item = %run.work_item, forge = %cfg.repo, wait_s = secs, failures, "forge: the release waits: {why}");
                let checks_new = answer.checks_pending && !checks_said;
                if since.is_none() || checks_new {
                    since.get_or_insert(now);
                    checks_said |= answer.checks_pending;
                    record(
                        run,
                        events::FORGE_WAITING,
                        format!(
                            "the release of {} through GitHub {} waits {secs} s: {why}; the item does not fail, it goes on when GitHub answers",
                            run.work_item, cfg.repo
                        ),
                        json!({"repo": run.repo_name.as_str(), "forge": cfg.repo, "why": why,
                               "wait_s": secs, "failures": failures, "release": true,
                               "seq": run.task.stage_seq, "since": since,
                               "checks_since": checks_since}),
                    )
                    .await?;
                }
                // One job waits at most `wait_step_s`: then the stage steps aside and comes
                // back as a new job after the pause, so no wait meets the job's timeout.
                if step == Step::Aside {
                    let in_job_s = u64::try_from((now - started) / 1000).unwrap_or(0);
                    if in_job_s.saturating_add(secs) > cfg.wait_step_s {
                        return Err(anyhow::Error::new(StepAside { delay_s: secs, why }));
                    }
                }
                tokio::select! {
                    () = run.cancel.cancelled() => bail!("cancelled while waiting for GitHub {}", cfg.repo),
                    () = tokio::time::sleep(std::time::Duration::from_secs(secs)) => {}
                }
            }
        }
    }
}

/// The first pause of a release waiting for the forge, doubling with each failure up to the
/// forge's `max_backoff_s`.
const RETRY_S: u64 = 2;

/// A release that reached orch's clone but not the user's checkout (it has local changes) is
/// said in an event: the user must take it in by hand (or clean the checkout; the next release
/// publishes it). Fenced like every release record: an error fails the attempt.
pub async fn note_unpublished(run: &StageRun, published: &repos::Published) -> Result<()> {
    if let Some(warning) = published.warning() {
        record(
            run,
            events::RELEASE_UNPUBLISHED,
            warning.to_owned(),
            json!({"repo": run.repo_name.as_str(), "target": published.target}),
        )
        .await?;
    }
    Ok(())
}

async fn finish_promotion(run: &StageRun, seq: i64, old: &str, new: &str) -> Result<()> {
    let branch = run.repo.default_branch.as_str();
    record(
        run,
        events::RELEASE_PROMOTED,
        format!("`{branch}` now holds the staged `{new}` (was `{old}`)"),
        json!({"repo": run.repo_name.as_str(), "old": old, "new": new, "seq": seq}),
    )
    .await?;
    Ok(())
}

/// The revision promoted in this task's latest promotion: `(old, new)`.
pub async fn promoted(run: &StageRun) -> Result<Option<(String, String)>> {
    Ok(latest(run, events::RELEASE_PROMOTED)
        .await?
        .and_then(|e| Some((field(&e, "old")?, field(&e, "new")?))))
}

/// The revision live in production for `repo`, as the release events recorded it: the last
/// confirmed deploy's revision, or the revision a later rollback went back to.
pub async fn live_revision(store: &Store, repo: &str) -> Result<Option<String>> {
    let mut best: Option<(i64, Option<String>)> = None;
    for kind in [events::RELEASE_DEPLOYED, events::RELEASE_ROLLED_BACK] {
        let mut after = 0;
        loop {
            let page = store.events_by_kind(kind, after, 500).await?;
            let Some(last) = page.last() else { break };
            after = last.id;
            for e in &page {
                let live = if kind == events::RELEASE_DEPLOYED {
                    match payload::read::<ReleaseDeployed>(&e.data) {
                        Some(d) if d.repo == repo && d.confirmed => Some(d.revision),
                        _ => continue,
                    }
                } else {
                    match payload::read::<ReleaseRolledBack>(&e.data) {
                        Some(r) if r.repo == repo => r.live,
                        _ => continue,
                    }
                };
                if best.as_ref().is_none_or(|(id, _)| e.id > *id) {
                    best = Some((e.id, live));
                }
            }
        }
    }
    Ok(best.and_then(|(_, live)| live))
}

/// The most commits read to list what a deploy shipped.
const MAX_COMMITS: usize = 5000;

/// The work items whose changes are in `prev..rev` (all of `rev`'s history when `prev` is
/// unknown), oldest first: read from the `Work-Item:`/`Stage:` trailers orch writes on every
/// commit it makes and the `Orch-Revert:` trailer of its reverts. Commits that only carry
/// documents after a release (`Stage: audit`) are not changes.
pub async fn shipped_changes(
    git: &orch_exec::Git,
    dir: &Path,
    prev: Option<&str>,
    rev: &str,
) -> Result<Vec<ShippedChange>> {
    let range = match prev {
        Some(p) if p != rev => format!("{p}..{rev}"),
        Some(_) => return Ok(Vec::new()),
        None => rev.to_owned(),
    };
    let commits = git.commit_messages(dir, &range).await?;
    let mut out: Vec<ShippedChange> = Vec::new();
    for (sha, message) in commits.iter().take(MAX_COMMITS).rev() {
        let trailer = |key: &str| {
            message
                .lines()
                .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
        };
        let (work_item, change) = if let Some(item) = trailer("Orch-Revert:") {
            (item, Change::Revert)
        } else if let Some(item) = trailer("Work-Item:") {
            if matches!(trailer("Stage:").as_deref(), Some("audit" | "lessons")) {
                continue;
            }
            (item, Change::Merge)
        } else {
            continue;
        };
        if let Some(existing) = out
            .iter_mut()
            .find(|c| c.work_item == work_item && c.change == change)
        {
            existing.commit.clone_from(sha);
        } else {
            out.push(ShippedChange {
                work_item,
                commit: sha.clone(),
                change,
            });
        }
    }
    // An item merged and reverted inside the range is not in the deployed revision: one entry
    // says so (`reverted`), so a list never shows it as shipped.
    let both: Vec<String> = out
        .iter()
        .filter(|c| c.change == Change::Revert)
        .filter(|r| {
            out.iter()
                .any(|m| m.change == Change::Merge && m.work_item == r.work_item)
        })
        .map(|r| r.work_item.clone())
        .collect();
    out.retain(|c| !(both.contains(&c.work_item) && c.change == Change::Merge));
    for c in &mut out {
        if c.change == Change::Revert && both.contains(&c.work_item) {
            c.change = Change::Reverted;
        }
    }
    Ok(out)
}

/// The revision live before this visit's deploy: what the service named just before the
/// deploy command ran (`deploy.started`'s `previous`), else the last one the release events
/// recorded (a confirmed deploy, or where a rollback went back to). Never raises.
pub async fn previous_live(run: &StageRun, seq: i64) -> Option<String> {
    let events = run.store.task_events(run.task.id).await.ok()?;
    let observed = events
        .iter()
        .find(|e| e.kind == events::DEPLOY_STARTED && seq_of(e) == Some(seq))
        .and_then(|e| field(e, "previous"));
    if observed.is_some() {
        return observed;
    }
    match live_revision(&run.store, run.repo_name.as_str()).await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the previous live revision");
            None
        }
    }
}

/// Records a production deploy and what it shipped (rule 3). What it shipped is read best
/// effort (an unreadable history ships "no new work item"); the record itself is fenced: an
/// error fails the attempt, and the next one finds the deploy's outcome recorded and makes
/// this record then (`deploy::deployer`'s replay).
pub async fn record_deployed(
    run: &StageRun,
    seq: i64,
    revision: &str,
    confirmed: bool,
) -> Result<()> {
    let prev = previous_live(run, seq).await;
    let items = match shipped_changes(&run.git, &run.repo_dir, prev.as_deref(), revision).await {
        Ok(items) => items,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the changes of a deploy");
            Vec::new()
        }
    };
    let names: Vec<String> = items.iter().map(ShippedChange::label).collect();
    // Published through the forge: the deployed commit is the forge's, with exactly the staged
    // commit's tree (checked before the deploy); the record names both.
    let through_forge = latest(run, events::RELEASE_PROMOTED)
        .await
        .ok()
        .flatten()
        .filter(|e| field(e, "new").as_deref() == Some(revision))
        .and_then(|e| Some((field(&e, "staged")?, field(&e, "via")?)))
        .filter(|(staged, _)| staged != revision);
    let forge_note = through_forge
        .as_ref()
        .map(|(staged, via)| {
            format!(" (the commit {via} made of the staged `{staged}`, the same tree)")
        })
        .unwrap_or_default();
    let message = format!(
        "deploy of `{revision}`{forge_note} {}: ships {}",
        if confirmed {
            "confirmed"
        } else {
            "not confirmed"
        },
        if names.is_empty() {
            "no new work item".to_owned()
        } else {
            names.join(", ")
        }
    );
    let (staged, via) = through_forge.unzip();
    let data = ReleaseDeployed {
        repo: run.repo_name.as_str().to_owned(),
        revision: revision.to_owned(),
        previous_revision: prev,
        confirmed,
        items,
        staged,
        via,
        seq: Some(seq),
    };
    record(
        run,
        events::RELEASE_DEPLOYED,
        message,
        serde_json::to_value(data).context("cannot encode the deploy record")?,
    )
    .await?;
    Ok(())
}

/// A Markdown section saying what this task's last production deploy shipped (revision,
/// previous live revision, work items), for `16-post-deploy-log.md`; empty when none is
/// recorded. Never raises.
pub async fn shipped_section(run: &StageRun) -> String {
    let Ok(Some(e)) = latest(run, events::RELEASE_DEPLOYED).await else {
        return String::new();
    };
    let Some(d) = payload::read::<ReleaseDeployed>(&e.data) else {
        tracing::warn!(work_item = %run.work_item, event = e.id, "a release.deployed event of another shape: no section on what the deploy shipped");
        return String::new();
    };
    let items: Vec<String> = d
        .items
        .iter()
        .map(|i| match i.change {
            Change::Merge => format!("- {} (`{:.12}`)", i.work_item, i.commit),
            change => format!(
                "- {}: {} (`{:.12}`)",
                i.work_item,
                change.as_str(),
                i.commit
            ),
        })
        .collect();
    format!(
        "\n## What this deploy shipped\n\n- revision: `{}`\n- previous live revision: `{}`\n- work items between them:\n\n{}\n",
        d.revision,
        d.previous_revision.as_deref().unwrap_or("unknown"),
        if items.is_empty() {
            "- (none recorded)".to_owned()
        } else {
            items.join("\n")
        }
    )
}

/// Records that production went back from `revision` to `live`. Fenced: an error fails the
/// attempt (the watch's ending runs again and records it; it is recorded once).
pub async fn record_rolled_back(run: &StageRun, revision: &str, live: Option<&str>) -> Result<()> {
    record(
        run,
        events::RELEASE_ROLLED_BACK,
        format!(
            "production rolled back from `{revision}` to `{}`",
            live.unwrap_or("the previous release")
        ),
        serde_json::to_value(ReleaseRolledBack {
            repo: run.repo_name.as_str().to_owned(),
            revision: revision.to_owned(),
            live: live.map(str::to_owned),
        })
        .context("cannot encode the rollback record")?,
    )
    .await?;
    Ok(())
}

/// The revision that was live before this task's deploy (from its `release.deployed`).
pub async fn previous_of_deploy(run: &StageRun) -> Option<String> {
    let e = latest(run, events::RELEASE_DEPLOYED).await.ok()??;
    payload::read::<ReleaseDeployed>(&e.data)?.previous_revision
}

/// What [`revert`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reverted {
    /// The change was reverted by this commit now on the default branch.
    Reverted { commit: String },
    /// It could not be reverted (conflict, or nothing known to revert): the repo holds.
    Held { reason: String },
}

/// Rule 4: takes this task's promoted change out of the default branch (idempotent: a revert
/// already on the branch is found by its trailer). Writes [`REVERT_LOG`] in the worktree.
/// Through the forge, `step` says whether a long wait for it may step aside ([`StepAside`]:
/// the caller's job comes back later) or waits within the job.
pub async fn revert(run: &StageRun, why: &str, step: Step) -> Result<Reverted> {
    let Some((old, new)) = promoted(run).await? else {
        return Ok(Reverted::Held {
            reason: format!(
                "no promotion of {} is recorded: nothing orch can revert",
                run.work_item
            ),
        });
    };
    let branch = run.repo.default_branch.as_str();
    let trailer = format!("Orch-Revert: {}", run.work_item);
    for attempt in 0..3 {
        let main = sync_or_step_aside(run, step).await?;
        let since = run
            .git
            .commit_messages(&run.repo_dir, &format!("{new}..{main}"))
            .await?;
        if let Some((sha, _)) = since.iter().find(|(_, m)| m.contains(&trailer)) {
            // Already on the default branch: an earlier attempt published it. That attempt may
            // have died before recording it, so the record is made here unless it exists; a
            // wait for the forge it began is over.
            if step == Step::Aside
                && let Some(cfg) = &run.repo.forge
            {
                close_open_wait(run, cfg).await?;
            }
            write_revert_log(run, &old, &new, sha, why)?;
            let recorded = run
                .store
                .task_events(run.task.id)
                .await?
                .iter()
                .any(|e| e.kind == events::RELEASE_REVERTED);
            if !recorded {
                record_reverted(run, &old, &new, sha, why).await?;
            }
            return Ok(Reverted::Reverted {
                commit: sha.clone(),
            });
        }
        let message = format!(
            "Revert {}: {}\n\nThe post-deploy watch rolled this change back: {}\n\nWork-Item: {}\nStage: {}\n{trailer}\n",
            run.work_item,
            run.task.title,
            one_line(why),
            run.work_item,
            run.stage.name
        );
        let keep = run.work_item.artifact_dir();
        let made = run
            .git
            .revert_onto(&run.repo_dir, &main, &old, &new, &keep, &message)
            .await?;
        let sha = match made {
            RevertResult::Conflict { files } => {
                return Ok(Reverted::Held {
                    reason: format!(
                        "reverting {} on `{branch}` conflicts with later changes in {}",
                        run.work_item,
                        files.join(", ")
                    ),
                });
            }
            RevertResult::Reverted { sha } => sha,
        };
        // Through the merge gate's verification: the repo's tests on exactly the revert commit.
        if let Some(why) = verify_revert(run, &sha).await? {
            return Ok(Reverted::Held {
                reason: format!(
                    "the revert of {} fails verification on `{branch}`: {why}",
                    run.work_item
                ),
            });
        }
        match repos::move_default_branch(&run.git, &run.repo_dir, &run.repo, &main, &sha).await {
            Ok(published) => {
                note_unpublished(run, &published).await?;
                write_revert_log(run, &old, &new, &sha, why)?;
                crate::failpoint::hit("release.after_revert_published");
                record_reverted(run, &old, &new, &sha, why).await?;
                return Ok(Reverted::Reverted { commit: sha });
            }
            // A protected branch: the revert goes through the forge's API, like a promotion.
            Err(e) if repos::push_refused(&e) && run.repo.forge.is_some() => {
                tracing::info!(work_item = %run.work_item, error = %e, "the default branch refused the revert; publishing through the forge");
                let revert = Revert {
                    old: &old,
                    new: &new,
                    main: &main,
                    sha: &sha,
                    message: &message,
                };
                return forge_revert(run, &revert, why, step).await;
            }
            Err(e) if attempt < 2 => {
                tracing::warn!(work_item = %run.work_item, error = %e, "the revert lost a race for the default branch; again");
            }
            Err(e) => return Err(e),
        }
    }
    bail!(
        "the revert of {} kept losing the race for `{branch}`",
        run.work_item
    )
}

/// A revert commit made on `main`: it takes `old..new` out.
struct Revert<'a> {
    old: &'a str,
    new: &'a str,
    main: &'a str,
    sha: &'a str,
    message: &'a str,
}

/// Publishes the revert commit `sha` (made on `main`) through the forge's API: the branch
/// `orch/revert/<id>`, then as a promotion. What the forge made must have exactly the revert's
/// tree; else the repo holds. A re-run after a kill finds the revert on the branch by its
/// trailer (`Orch-Revert:`, kept in the forge's commit message) and does not publish it again.
async fn forge_revert(run: &StageRun, r: &Revert<'_>, why: &str, step: Step) -> Result<Reverted> {
    let id = run.work_item.as_str();
    let (cfg, publication) = Publication::of_commit(
        run,
        "revert",
        r.main,
        r.sha,
        r.message,
        format!(
            "orch reverts {id}: production rolled it back ({}).",
            one_line(why)
        ),
    )?;
    let seq = crate::deploy::visit_seq(run);
    let published = publish_through_forge(run, &cfg, seq, &publication, None, step).await?;
    if step == Step::Aside {
        close_open_wait(run, &cfg).await?;
    }
    match published {
        ForgePublished::Published { commit, .. } => {
            repos::sync_default_branch(&run.git, &run.repo_dir, &run.repo).await?;
            write_revert_log(run, r.old, r.new, &commit, why)?;
            crate::failpoint::hit("release.after_revert_published");
            record_reverted(run, r.old, r.new, &commit, why).await?;
            Ok(Reverted::Reverted { commit })
        }
        ForgePublished::Mismatch { commit, why, .. } => Ok(Reverted::Held {
            reason: format!(
                "GitHub {} put `{commit:.12}` on `{}` for the revert of {id}, which is not the verified revert: {why}",
                cfg.repo, run.repo.default_branch
            ),
        }),
    }
}

/// Publishes the audit commit `commit` (made on `main`: the item's last documents and its
/// lessons) through the forge's API when the default branch refuses orch's push, on the
/// branch `orch/audit/<id>`; the commit the forge made, with exactly the audit commit's tree.
/// Idempotent as the audit is: a re-run finds the documents on the default branch. A wait for
/// the forge longer than one job steps aside ([`StepAside`]: the lessons stage comes back).
pub async fn publish_audit_through_forge(
    run: &StageRun,
    main: &str,
    commit: &str,
    message: &str,
) -> Result<String> {
    let id = run.work_item.as_str();
    let (cfg, publication) = Publication::of_commit(
        run,
        "audit",
        main,
        commit,
        message,
        format!("The documents of {id}'s last stages and its lessons, after its release."),
    )?;
    let seq = crate::deploy::visit_seq(run);
    let published = publish_through_forge(run, &cfg, seq, &publication, None, Step::Aside).await?;
    close_open_wait(run, &cfg).await?;
    match published {
        ForgePublished::Published { commit, .. } => {
            repos::sync_default_branch(&run.git, &run.repo_dir, &run.repo).await?;
            Ok(commit)
        }
        ForgePublished::Mismatch { commit, why, .. } => bail!(
            "GitHub {} put `{commit:.12}` on `{}` for {id}'s audit trail, which is not the audit commit: {why}",
            cfg.repo,
            run.repo.default_branch
        ),
    }
}

/// Records `release.reverted`: the item's change `old..new` taken out by `sha` (fenced: an
/// error fails the attempt, whose retry finds the revert by its trailer and records it).
async fn record_reverted(run: &StageRun, old: &str, new: &str, sha: &str, why: &str) -> Result<()> {
    record(
        run,
        events::RELEASE_REVERTED,
        format!(
            "{} reverted on `{}` by `{sha}` ({})",
            run.work_item,
            run.repo.default_branch,
            one_line(why)
        ),
        serde_json::to_value(payload::ReleaseReverted {
            repo: run.repo_name.as_str().to_owned(),
            work_item: run.work_item.as_str().to_owned(),
            revert_commit: sha.to_owned(),
            reverted_from: old.to_owned(),
            reverted_to: new.to_owned(),
        })
        .context("cannot encode the revert record")?,
    )
    .await?;
    Ok(())
}

/// Runs the repo's test command on a checkout of exactly `sha`; `Some(why)` when it does not
/// pass. No test command: nothing to verify.
async fn verify_revert(run: &StageRun, sha: &str) -> Result<Option<String>> {
    let Some(command) = run
        .repo
        .test
        .as_deref()
        .map(str::trim)
        .filter(|c| !c.is_empty())
    else {
        return Ok(None);
    };
    let dir = repos::release_checkout(&run.git, &paths(run), sha).await?;
    // The repository's tests are its code: in the repo's sandbox.
    let contained = crate::contain::for_repo_code(run, &dir).map_err(|reason| {
        anyhow::anyhow!("cannot verify the revert of {}: {reason}", run.work_item)
    })?;
    let cmd = orch_exec::Cmd::new("sh")
        .arg("-c")
        .arg(command)
        .cwd(&dir)
        .env("ORCH_WORK_ITEM", run.work_item.as_str())
        .env("ORCH_REVISION", sha)
        .timeout(std::time::Duration::from_secs(
            run.repo.test_timeout_s.max(1),
        ))
        .cancel_on(run.cancel.clone());
    let key = run.command_key("revert-tests");
    let out = orch_exec::run(&contained.apply(cmd).supervised(key.clone()))
        .await
        .with_context(|| format!("cannot run the test command `{command}` on the revert"))?;
    run.note_supervision("revert tests", &key, &out).await;
    drop(contained);
    match out.status {
        // No verdict on the revert: the run is stopping, or the tests never finished. An error
        // retries the job; only its last attempt holds the repo (see `deploy::monitor`).
        orch_exec::ExitKind::Cancelled => {
            bail!("cancelled while verifying the revert of {}", run.work_item)
        }
        orch_exec::ExitKind::TimedOut | orch_exec::ExitKind::Signaled(_) => bail!(
            "`{command}` on the revert of {} {} before it gave a verdict",
            run.work_item,
            out.status
        ),
        orch_exec::ExitKind::Exited(_) => {}
    }
    Ok((!out.success()).then(|| {
        format!(
            "`{command}` ended with {}: {}",
            out.status,
            one_line(&out.tail_text(5))
        )
    }))
}

fn write_revert_log(run: &StageRun, old: &str, new: &str, commit: &str, why: &str) -> Result<()> {
    let mut fm = orch_domain::artifact::Frontmatter::new();
    fm.insert("work_item", run.work_item.as_str());
    fm.insert("stage", run.stage.name.as_str());
    fm.insert("author_agent", "release-train");
    fm.insert("status", "REVERTED");
    fm.insert(
        "created_at",
        crate::time::rfc3339(run.store.now_ms()).as_str(),
    );
    fm.insert("model_used", "n/a");
    fm.insert("revert_commit", commit);
    fm.insert("reverted_from", old);
    fm.insert("reverted_to", new);
    let body = format!(
        "\n# 18 — Revert: {}\n\nThe change `{old:.12}..{new:.12}` was taken out of `{}` by `{commit}` after production rolled it back.\n\nWhy: {}\n\nLater items stage and deploy on the corrected branch; this item's documents stay in `{}`.\n",
        run.work_item,
        run.repo.default_branch,
        one_line(why),
        run.work_item.artifact_dir()
    );
    let doc = orch_domain::artifact::Artifact::new(fm, body).render();
    run.write_document(REVERT_LOG, &doc)
}

/// Holds the repo's releases with this task (rule 4), fenced by the job's lease: an attempt
/// that lost its job (or could not write) holds nothing and says so, and the job's next
/// attempt decides again.
pub async fn hold(run: &StageRun, reason: &str) -> Result<()> {
    let message = format!(
        "repo {} is held: {reason}; later releases wait until an operator runs `orch approve {}` (go on) or `orch cancel {}`",
        run.repo_name, run.work_item, run.work_item
    );
    let id = record(
        run,
        events::RELEASE_HELD,
        message,
        json!({"repo": run.repo_name.as_str(), "reason": reason}),
    )
    .await
    .with_context(|| format!("cannot hold repo {}", run.repo_name))?;
    announce_hold(run, id, run.store.now_ms(), reason).await
}

/// Announces the hold recorded as event `event_id`: a hold waits for an operator, so the
/// `alert` command runs and the webhook gets a `hold` notice (each once per hold, however
/// often this is called: [`crate::notify::announce`]).
pub async fn announce_hold(run: &StageRun, event_id: i64, at_ms: i64, reason: &str) -> Result<()> {
    use orch_domain::notice::{self, Notice};
    let sight = crate::deploy::recover::look(run).await;
    let history = run.store.task_events(run.task.id).await?;
    let deployed = history
        .iter()
        .rev()
        .find(|e| e.kind == events::RELEASE_DEPLOYED)
        .and_then(|e| payload::read::<ReleaseDeployed>(&e.data));
    let id = run.work_item.as_str();
    let notice = Notice {
        version: notice::VERSION,
        id: format!("{id}-{event_id}"),
        event: notice::event::HOLD.to_owned(),
        at_ms,
        work_item: id.to_owned(),
        title: run.task.title.clone(),
        repo: run.repo_name.as_str().to_owned(),
        stage: run.stage.name.as_str().to_owned(),
        revision: deployed.as_ref().map(|d| d.revision.clone()),
        previous_revision: deployed.and_then(|d| d.previous_revision),
        outcome: None,
        verdict: None,
        action: None,
        reason: format!("repo {} is held: {reason}", run.repo_name),
        live: Some(crate::deploy::alert::live_of(&sight)),
        tried: history
            .iter()
            .rev()
            .find(|e| e.kind == events::PRODUCTION_CHECKED)
            .and_then(|e| payload::read::<payload::ProductionChecked>(&e.data))
            .map(|c| c.tried)
            .unwrap_or_default(),
        todo: Some(format!(
            "make production and `{}` right, then `orch approve {id}` (go on) or `orch cancel {id}`; later releases of {} wait until then",
            run.repo.default_branch, run.repo_name
        )),
        links: notice::links(&run.settings.link_base(), id, run.repo_name.as_str()),
    };
    // An alert of this visit already paged about the same incident (and said to approve or
    // cancel): the hold pages only when nothing did.
    let seq = crate::deploy::visit_seq(run);
    let paged = history
        .iter()
        .any(|e| e.kind == events::POST_DEPLOY_ALERT && seq_of(e) == Some(seq));
    crate::notify::announce(
        &crate::notify::Target::of_run(run),
        &notice,
        event_id,
        !paged,
    )
    .await
}

/// The hold this task's events still carry (a `release.held` without a later
/// `release.unheld`), as its reason.
pub fn open_hold(events: &[Event]) -> Option<String> {
    let mut hold = None;
    for e in events {
        match e.kind.as_str() {
            events::RELEASE_HELD => hold = Some(field(e, "reason").unwrap_or_default()),
            events::RELEASE_UNHELD => hold = None,
            _ => {}
        }
    }
    hold
}

/// Ends the post-deploy watch and clears the deploy markers of a task that became terminal
/// (cancelled, failed) while in `deploy` or `observe`, so no watch stays armed for it and a
/// retry deploys afresh. Never raises.
pub fn end_watch(repos_dir: &Path, repo: &str, work_item: &str, reason: &str) {
    let ws = orch_deploystate::WatchState::new(repos_dir, repo, work_item);
    if !ws.is_done()
        && matches!(
            ws.armed(),
            orch_deploystate::ArmedRead::Present(_) | orch_deploystate::ArmedRead::Corrupt(_)
        )
        && !ws.mark_done(reason)
    {
        tracing::warn!(
            work_item,
            "could not end the post-deploy watch of a terminal task"
        );
    }
    let ds = orch_deploystate::DeployState::new(repos_dir, repo, work_item);
    if !ds.clear_state() {
        tracing::warn!(
            work_item,
            "could not clear the deploy markers of a terminal task"
        );
    }
}

/// A repo's release track as the store has it: `(repo, holder (work item, stage), hold
/// reason, waiting work items)`.
pub type TrackView = (
    String,
    Option<(String, String)>,
    Option<String>,
    Vec<String>,
);

/// Every repo's release track with a holder or a waiter (for `GET /queue`): holders are the
/// tasks at a track stage; waiters are tasks whose latest wait (`release.waiting`) is of their
/// current stage visit.
pub async fn tracks(store: &Store, pipeline: &Pipeline) -> Result<Vec<TrackView>> {
    use std::collections::BTreeMap;
    let mut by_repo: BTreeMap<String, TrackView> = BTreeMap::new();
    let track = pipeline.release_track();
    let mut holders = Vec::new();
    let mut others = Vec::new();
    for stage in &pipeline.stages {
        let tasks = store
            .list_tasks(&orch_store::TaskFilter {
                stage: Some(stage.name.as_str().to_owned()),
                repo: None,
                limit: 1000,
                offset: 0,
            })
            .await?;
        if track.contains(&stage.name) {
            holders.extend(tasks);
        } else {
            others.extend(tasks);
        }
    }
    // One read for all holders' holds and one for every other task's waits: with hundreds of
    // items in flight, a read per task made each `GET /queue` hundreds of queries.
    let ids = |tasks: &[orch_store::Task]| tasks.iter().map(|t| t.id).collect::<Vec<_>>();
    let mut holds = orch_store::group_by_task(
        store
            .events_of_tasks(
                &ids(&holders),
                &[events::RELEASE_HELD, events::RELEASE_UNHELD],
            )
            .await?,
    );
    for t in holders {
        let hold = open_hold(&holds.remove(&t.id).unwrap_or_default());
        let entry = by_repo
            .entry(t.repo.to_string())
            .or_insert_with(|| (t.repo.to_string(), None, None, Vec::new()));
        entry.1 = Some((t.work_item_id.to_string(), t.stage.to_string()));
        entry.2 = hold;
    }
    // The waiters: tasks off the track (a refused entry leaves a task at the stage it
    // finished) whose current visit was refused. Only the waits of tasks in flight are read,
    // so the cost follows what is in flight, not every wait the database ever recorded.
    let waits = orch_store::group_by_task(
        store
            .events_of_tasks(&ids(&others), &[events::RELEASE_WAITING])
            .await?,
    );
    let mut waiting: BTreeMap<i64, (String, String)> = BTreeMap::new();
    for t in others {
        let refused = waits
            .get(&t.id)
            .is_some_and(|evs| evs.iter().any(|e| seq_of(e) == Some(t.stage_seq)));
        if refused {
            waiting.insert(t.id, (t.repo.to_string(), t.work_item_id.to_string()));
        }
    }
    for (repo, id) in waiting.into_values() {
        by_repo
            .entry(repo.clone())
            .or_insert_with(|| (repo, None, None, Vec::new()))
            .3
            .push(id);
    }
    Ok(by_repo.into_values().collect())
}

/// The paths of this repo on this machine.
pub fn paths(run: &StageRun) -> RepoPaths {
    RepoPaths::new(&run.repos_dir, &run.repo_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `git` in `dir` with `env` (an author, a committer, a date), its trimmed output.
    fn git(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    const DEV: &[(&str, &str)] = &[
        ("GIT_AUTHOR_NAME", "dev"),
        ("GIT_AUTHOR_EMAIL", "dev@example.com"),
        ("GIT_COMMITTER_NAME", "dev"),
        ("GIT_COMMITTER_EMAIL", "dev@example.com"),
    ];

    /// A commit of `tree` on `parent` with `message`, by `env`'s author at `date`.
    fn commit(dir: &Path, tree: &str, parents: &[&str], message: &str, date: &str) -> String {
        let mut args = vec!["commit-tree", tree];
        for p in parents {
            args.extend(["-p", p]);
        }
        args.extend(["-m", message]);
        let mut env = DEV.to_vec();
        env.push(("GIT_AUTHOR_DATE", date));
        git(dir, &args, &env)
    }

    /// `original` made again on `parent` as GitHub's rebase makes it: same author, author date,
    /// message and change; GitHub's committer.
    fn rebased(dir: &Path, original: &str, parent: &str) -> String {
        let base = format!("--merge-base={original}^");
        let tree = git(
            dir,
            &["merge-tree", "--write-tree", &base, parent, original],
            &[],
        );
        let who = git(
            dir,
            &[
                "log",
                "-1",
                "--date=raw",
                "--format=%an%n%ae%n%ad%n%B",
                original,
            ],
            &[],
        );
        let mut lines = who.splitn(4, '\n');
        let (name, email, date, message) = (
            lines.next().unwrap(),
            lines.next().unwrap(),
            lines.next().unwrap(),
            lines.next().unwrap(),
        );
        git(
            dir,
            &["commit-tree", &tree, "-p", parent, "-m", message],
            &[
                ("GIT_AUTHOR_NAME", name),
                ("GIT_AUTHOR_EMAIL", email),
                ("GIT_AUTHOR_DATE", date),
                ("GIT_COMMITTER_NAME", "GitHub"),
                ("GIT_COMMITTER_EMAIL", "noreply@github.com"),
            ],
        )
    }

    /// A tree of `base` with `file` holding `text`.
    fn with_file(dir: &Path, base: &str, file: &str, text: &str) -> String {
        let index = dir.join("test.index");
        let env = [("GIT_INDEX_FILE", index.to_str().unwrap())];
        git(dir, &["read-tree", base], &env);
        let blob = {
            std::fs::write(dir.join("blob"), text).unwrap();
            git(dir, &["hash-object", "-w", "blob"], &[])
        };
        git(
            dir,
            &[
                "update-index",
                "--add",
                "--cacheinfo",
                &format!("100644,{blob},{file}"),
            ],
            &env,
        );
        git(dir, &["write-tree"], &env)
    }

    #[tokio::test]
    async fn a_rebase_is_the_pull_requests_commits_made_again_on_the_old_branch() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        git(dir, &["init", "-q", "--bare"], &[]);
        let empty = git(dir, &["hash-object", "-t", "tree", "-w", "/dev/null"], &[]);
        let old = commit(dir, &empty, &[], "base", "1700000000 +0000");
        // The pull request: a, b, a merge of `old` into it (left out by a rebase), c.
        let a = commit(
            dir,
            &with_file(dir, &empty, "a", "a"),
            &[&old],
            "a\n\nWork-Item: X-1\n",
            "1700000001 +0000",
        );
        let b_tree = with_file(dir, &format!("{a}^{{tree}}"), "b", "b");
        let b = commit(dir, &b_tree, &[&a], "b", "1700000002 +0000");
        let m = commit(dir, &b_tree, &[&b, &old], "merge", "1700000003 +0000");
        let c_tree = with_file(dir, &b_tree, "c", "c");
        let verified = commit(dir, &c_tree, &[&m], "c", "1700000004 +0000");
        let g = orch_exec::Git::default();
        let check = |on: String| {
            let (g, old, verified) = (g.clone(), old.clone(), verified.clone());
            async move {
                not_a_rebase_of(&g, dir, &old, &verified, &on)
                    .await
                    .unwrap()
            }
        };

        // GitHub's rebase: a', b', c' in a line on `old`.
        let a2 = rebased(dir, &a, &old);
        let b2 = rebased(dir, &b, &a2);
        let c2 = rebased(dir, &verified, &b2);
        assert_ne!(c2, verified);
        assert_eq!(check(c2.clone()).await, None);

        // The branch moved before the rebase: a commit of someone else's, even one that
        // changes nothing, is not the pull request's.
        let moved = commit(dir, &empty, &[&old], "someone else's", "1700000005 +0000");
        let a3 = rebased(dir, &a, &moved);
        let b3 = rebased(dir, &b, &a3);
        let c3 = rebased(dir, &verified, &b3);
        let why = check(c3).await.unwrap();
        assert!(
            why.contains(&moved[..12]) && why.contains("moved before the rebase"),
            "{why}"
        );

        // A merge commit between: not a rebase's.
        let merged = commit(dir, &c_tree, &[&c2, &verified], "merge", "1700000006 +0000");
        let why = check(merged).await.unwrap();
        assert!(why.contains("merge commit"), "{why}");

        // A pull request's commit twice: the second is not a rewrite of anything left.
        let twice = rebased(dir, &verified, &c2);
        assert!(check(twice).await.is_some());
    }
}
