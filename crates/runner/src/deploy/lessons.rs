//! The `lessons` stage (design.md §8, ORCH-8; seed ORCH-021 §4: the post-deploy log is the lessons
//! loop's source, BR-10). It turns a work item's *objective* outcomes — a rollback, a FAILED or
//! DEGRADED watch, FAILED staging, review rejections, failed tests, merge conflicts, a failed
//! or unconfirmed deploy, exhausted retries, loops back — into lessons with provenance (work
//! item, artifact or event, date), writes `17-lessons.md` and appends them to the repo's
//! lessons file in the work item's worktree (committed on its branch by the engine).
//!
//! Sources, all recorded facts, no judgement: every committed version of the status artifacts
//! on the work item's branch (a rejected review later overwritten by an approval still
//! counts), the task's events, its jobs that failed for good, and the loop count.
//!
//! Idempotent: each lesson has a stable id (`<work item>/<kind>/<source>#<n>`); an entry whose
//! id is already in the lessons file is not appended again, so a re-run changes nothing there.
//! Once the watch is `done`, its sentinel directory is removed here (design.md §7 hygiene): by now
//! the `observe` stage's result is committed, so no job of it can still need the files.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Component, Path};

use orch_deploystate::WatchState;
use orch_domain::artifact::{Artifact, Frontmatter, MODEL_NOT_APPLICABLE};
use orch_domain::control::markers;
use orch_domain::staging::rfc3339_utc;
use orch_exec::process::run as run_process;
use orch_store::{Event, JobState};
use serde_json::json;

use super::{data, event_str, events, record};
use crate::engine::{StageEffect, StageExecutor, StageRun};

/// The artifact the lessons stage writes.
pub const LESSONS_ARTIFACT: &str = "17-lessons.md";
/// The marker that starts every entry in the lessons file; the id follows it.
pub const ENTRY_MARKER: &str = "orch-lesson:";

/// The `lessons` stage's executor (agent `lessons`).
#[derive(Debug, Clone, Default)]
pub struct LessonsExecutor;

/// One lesson with its provenance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lesson {
    /// Stable id: `<work item>/<kind>/<source>#<n>`.
    pub id: String,
    /// What kind of outcome (`rollback`, `staging_failed`, `review_rejected`, …).
    pub kind: &'static str,
    /// What happened, one line.
    pub summary: String,
    /// Where it is recorded: an artifact path, `event #<id> (<kind>)` or `job #<id>`.
    pub source: String,
    /// When it happened (RFC 3339, UTC).
    pub date: String,
}

/// A status artifact and the values of its status key that are lessons.
struct Watched {
    file: &'static str,
    key: &'static str,
    outcomes: &'static [(&'static str, &'static str)],
}

const WATCHED: [Watched; 5] = [
    Watched {
        file: "11-review.md",
        key: "review_status",
        outcomes: &[("CHANGES_REQUESTED", "review_rejected")],
    },
    Watched {
        file: "12-test-report.md",
        key: "test_status",
        outcomes: &[("FAILED", "tests_failed")],
    },
    Watched {
        file: "14-merge-log.md",
        key: "merge_status",
        outcomes: &[("CONFLICT", "merge_conflict"), ("FAILED", "merge_failed")],
    },
    Watched {
        file: "15-staging-log.md",
        key: "staging_status",
        outcomes: &[("FAILED", "staging_failed")],
    },
    Watched {
        file: "16-post-deploy-log.md",
        key: "post_deploy_status",
        outcomes: &[
            ("FAILED", "post_deploy_failed"),
            ("DEGRADED", "post_deploy_degraded"),
        ],
    },
];

#[async_trait::async_trait]
impl StageExecutor for LessonsExecutor {
    async fn execute(&self, run: &StageRun) -> anyhow::Result<StageEffect> {
        let seq = super::visit_seq(run);
        let history = run.store.task_events(run.task.id).await?;
        if let Some(reason) = crate::release::open_hold(&history) {
            // The repo's releases stay held (this task keeps the release track) until an
            // operator approves or cancels the item.
            return Ok(StageEffect::Requeue {
                delay_ms: HOLD_RECHECK_S * 1000,
                marker: markers::release_hold(seq),
                reason: format!(
                    "repo {} is held ({reason}): waiting for `orch approve {}` or `orch cancel {}`",
                    run.repo_name, run.work_item, run.work_item
                ),
            });
        }
        // A come-back after the audit commit stepped aside for the forge carries how many
        // lessons the first job appended (they are in the worktree now: appending finds none).
        let carried = markers::parse(&run.job.task_content)
            .into_iter()
            .find(|m| m.name == markers::FORGE_WAIT && m.seq == seq)
            .map(|m| m.n.unwrap_or(0) as usize);
        if carried.is_none() {
            run.counters.incr("lessons", "runs");
        }
        let lessons = gather(run).await?;
        let now = run.store.now_ms();

        let (appended, file_note) = match lessons_file_path(&run.repo.lessons_file) {
            None => (
                0,
                format!(
                    "lessons file `{}` refused: it must be a relative path inside the repo",
                    run.repo.lessons_file
                ),
            ),
            Some(rel) => {
                let new = append_to_lessons_file(rel, run, &lessons, now)?;
                run.counters.add(
                    "lessons",
                    "recorded",
                    u64::try_from(new).unwrap_or(u64::MAX),
                );
                let n = new + carried.unwrap_or(0);
                (
                    n,
                    format!(
                        "{n} new entr{} appended to `{}`",
                        if n == 1 { "y" } else { "ies" },
                        run.repo.lessons_file
                    ),
                )
            }
        };

        let doc = render(run, &lessons, now, &file_note);
        run.write_document(LESSONS_ARTIFACT, &doc)
            .map_err(|e| anyhow::anyhow!("lessons: {e:#}"))?;

        // The item's whole trail (and the lessons, if any) reach the default branch in one
        // commit, lessons or not.
        let (published, note) = match publish_to_default_branch(
            run,
            lessons_file_path(&run.repo.lessons_file),
            &lessons,
            now,
        )
        .await
        {
            Ok(p) => p,
            // The forge has not answered for as long as one job waits: the stage comes back
            // after the pause (what it wrote is in its worktree; the lessons are not appended
            // twice), its wait on record.
            Err(aside) => {
                return Ok(StageEffect::Requeue {
                    delay_ms: aside.delay_s.saturating_mul(1000),
                    marker: format!("{} n={appended}", markers::forge_wait(seq)),
                    reason: format!("{aside}; the audit commit comes back then"),
                });
            }
        };
        let file_note = format!("{file_note}; {note}");

        let ws = WatchState::new(
            &run.repos_dir,
            run.repo_name.as_str(),
            run.work_item.as_str(),
        );
        if ws.is_done() && !ws.clear() {
            tracing::warn!(work_item = %run.work_item, "lessons: the finished watch's state could not be removed (hygiene only)");
        }

        let kinds: Vec<&str> = lessons.iter().map(|l| l.kind).collect();
        record(
            run,
            seq,
            events::LESSONS_RECORDED,
            if lessons.is_empty() {
                format!("no incidents: no lessons; {note}")
            } else {
                format!(
                    "{} lesson(s): {}; {file_note}",
                    lessons.len(),
                    kinds.join(", ")
                )
            },
            data([
                ("count", json!(lessons.len())),
                ("appended", json!(appended)),
                ("kinds", json!(kinds)),
                ("published", json!(published)),
            ]),
        )
        .await?;
        Ok(StageEffect::Produced { outcome: None })
    }
}

/// Every lesson of the work item, in the order it happened per source.
pub async fn gather(run: &StageRun) -> anyhow::Result<Vec<Lesson>> {
    let id = run.work_item.as_str();
    let mut lessons = Vec::new();
    let mut ordinals = std::collections::HashMap::<String, u32>::new();
    let mut push = |kind: &'static str, source: String, summary: String, date: String| {
        let n = ordinals.entry(format!("{kind}/{source}")).or_insert(0);
        *n += 1;
        lessons.push(Lesson {
            id: format!("{id}/{kind}/{source}#{n}"),
            kind,
            summary: one_line(&summary),
            source,
            date,
        });
    };

    // 1. every version of the status artifacts on the branch (and an uncommitted one).
    let mut saw_post_deploy = false;
    for w in &WATCHED {
        let rel = format!("{}/{}", run.work_item.artifact_dir(), w.file);
        for (text, fallback_ms) in artifact_versions(run, &rel).await {
            let Ok(artifact) = Artifact::parse(&text) else {
                continue;
            };
            let fm = &artifact.frontmatter;
            let Some(status) = fm.get_str(w.key) else {
                continue;
            };
            let date = fm
                .get_str("created_at")
                .map(str::to_owned)
                .unwrap_or_else(|| rfc3339_utc(fallback_ms));
            let why = fm
                .get_str("reason")
                .map(str::to_owned)
                .unwrap_or_else(|| first_line(&artifact.body));
            if w.file == "16-post-deploy-log.md" {
                saw_post_deploy = true;
                match fm.get_str("action_taken") {
                    Some("rollback") => push(
                        "rollback",
                        rel.clone(),
                        format!("{status} after deploy; rolled back: {why}"),
                        date.clone(),
                    ),
                    Some("rollback_failed") => push(
                        "rollback_failed",
                        rel.clone(),
                        format!("{status} after deploy; the rollback failed: {why}"),
                        date.clone(),
                    ),
                    _ => {}
                }
            }
            let Some((_, kind)) = w.outcomes.iter().find(|(v, _)| *v == status) else {
                continue;
            };
            let kind = match fm.get_str("failure_kind") {
                Some("tool_error_exhausted") => "retries_exhausted",
                _ => kind,
            };
            let detail = match fm.get_str("failure_kind") {
                Some(fk) => format!("{} `{status}` ({fk}): {why}", w.key),
                None => format!("{} `{status}`: {why}", w.key),
            };
            push(kind, rel.clone(), detail, date);
        }
    }

    // 2. the task's events.
    let events = run.store.task_events(run.task.id).await?;
    let mut saw_loop_event = false;
    for e in &events {
        let source = format!("event #{} ({})", e.id, e.kind);
        let date = rfc3339_utc(e.created_at);
        match e.kind.as_str() {
            events::DEPLOY_FAILED => push("deploy_failed", source, e.message.clone(), date),
            events::DEPLOY_UNCONFIRMED => {
                push("deploy_unconfirmed", source, e.message.clone(), date)
            }
            events::POST_DEPLOY_VERDICT if !saw_post_deploy => {
                if let Some(lesson) = verdict_lesson(e) {
                    push(lesson, source, e.message.clone(), date);
                }
            }
            k if k.contains("loop_back") || k.contains("loop-back") => {
                saw_loop_event = true;
                push("loop_back", source, e.message.clone(), date);
            }
            _ => {}
        }
    }

    // 3. jobs that failed for good (their attempts exhausted).
    for job in run.store.task_jobs(run.task.id).await? {
        if job.state == JobState::Failed {
            push(
                "retries_exhausted",
                format!("job #{}", job.id),
                format!(
                    "`{}` job failed for good after {} of {} attempt(s): {}",
                    job.agent,
                    job.attempt,
                    job.max_attempts,
                    one_line(job.last_error.as_deref().unwrap_or("no error recorded"))
                ),
                rfc3339_utc(job.finished_at.unwrap_or(job.created_at)),
            );
        }
    }

    // 4. loops back, when the engine's events did not say so already.
    if run.loops > 0 && !saw_loop_event {
        push(
            "loop_back",
            "task".to_owned(),
            format!(
                "{} loop(s) back to implementation before the change got through",
                run.loops
            ),
            rfc3339_utc(run.store.now_ms()),
        );
    }
    Ok(lessons)
}

/// The lesson kind of a `post_deploy.verdict` event (used when the log is missing).
fn verdict_lesson(e: &Event) -> Option<&'static str> {
    match (
        event_str(e, "action").as_deref(),
        event_str(e, "verdict").as_deref(),
    ) {
        (Some("rollback"), _) => Some("rollback"),
        (Some("rollback_failed"), _) => Some("rollback_failed"),
        (_, Some("FAILED")) => Some("post_deploy_failed"),
        (_, Some("DEGRADED")) => Some("post_deploy_degraded"),
        _ => None,
    }
}

/// Every committed version of `rel` on the worktree's branch, oldest first, with its commit
/// time, plus the working-tree file when it differs from the last commit. Git trouble is
/// logged and gives what could be read.
async fn artifact_versions(run: &StageRun, rel: &str) -> Vec<(String, i64)> {
    // `orch_exec::git` has no history query: this git command is built by `Git::command`, with
    // the same hardening as every other.
    let cmd = run
        .git
        .command(&run.worktree)
        .args(["log", "--reverse", "--format=%H %ct", "--"])
        .arg(rel);
    let commits: Vec<(String, i64)> = match run_process(&cmd).await {
        Ok(out) if out.success() => out
            .stdout_lossy()
            .lines()
            .filter_map(|l| {
                let (sha, ts) = l.trim().split_once(' ')?;
                Some((
                    sha.to_owned(),
                    ts.parse::<i64>().ok()?.saturating_mul(1_000),
                ))
            })
            .collect(),
        Ok(out) => {
            tracing::warn!(path = rel, status = %out.status, stderr = %out.stderr_lossy(), "lessons: git log failed; using the working tree only");
            Vec::new()
        }
        Err(e) => {
            tracing::warn!(path = rel, error = %e, "lessons: git log could not run; using the working tree only");
            Vec::new()
        }
    };
    let mut versions = Vec::new();
    for (sha, at_ms) in commits {
        match run.git.show_file(&run.worktree, &sha, rel).await {
            Ok(Some(text)) => versions.push((text, at_ms)),
            Ok(None) => {} // deleted in that commit
            Err(e) => {
                tracing::warn!(path = rel, commit = %sha, error = %e, "lessons: cannot read an artifact version")
            }
        }
    }
    if let Ok(Some(text)) = crate::fsutil::read_regular(&run.worktree.join(rel))
        && versions.last().is_none_or(|(last, _)| *last != text)
    {
        versions.push((text, run.store.now_ms()));
    }
    versions
}

/// How often a held release looks whether an operator acted.
const HOLD_RECHECK_S: u64 = 30;

/// Publishes the item's audit trail and lessons on the default branch: its branch reached the
/// default branch before this stage ran, so later worktrees (which start from the default
/// branch, and whose prompts read the lessons file) would never see them otherwise. Still on
/// the repo's release track, one commit built without a working tree holds the item's documents
/// the default branch lacks (15–18) and the lessons-file entries not yet there (none when
/// there are no lessons or the lessons file was refused); it is published by compare-and-swap
/// (`repos::move_default_branch`), retried from the remote's state when it loses a race.
/// Idempotent by entry id. Never raises: returns whether the trail is on the default branch
/// and a note saying what happened (also logged).
async fn publish_to_default_branch(
    run: &StageRun,
    rel: Option<&Path>,
    lessons: &[Lesson],
    now_ms: i64,
) -> Result<(bool, String), crate::release::StepAside> {
    let branch = &run.repo.default_branch;
    match publish(run, rel, lessons, now_ms).await {
        Ok(note) => Ok((true, note)),
        Err(e) => {
            if let Some(aside) = e.downcast_ref::<crate::release::StepAside>() {
                return Err(crate::release::StepAside {
                    delay_s: aside.delay_s,
                    why: aside.why.clone(),
                });
            }
            tracing::warn!(work_item = %run.work_item, repo_dir = %run.repo_dir.display(), error = %e, "lessons: not published on the default branch");
            Ok((false, format!("not published on `{branch}`: {e}")))
        }
    }
}

async fn publish(
    run: &StageRun,
    rel: Option<&Path>,
    lessons: &[Lesson],
    now_ms: i64,
) -> anyhow::Result<String> {
    let branch = run.repo.default_branch.as_str();
    let rel_str = rel.map(|r| r.to_string_lossy().into_owned());
    let dir_rel = run.work_item.artifact_dir();
    for attempt in 0..3 {
        let main = crate::release::sync_or_step_aside(run, crate::release::Step::Aside).await?;
        let mut files: Vec<(String, Vec<u8>)> = Vec::new();
        let mut n = 0;
        if let Some(rel_str) = &rel_str {
            let existing = run
                .git
                .show_file(&run.repo_dir, &main, rel_str)
                .await?
                .unwrap_or_default();
            let (text, added) = with_lessons(&existing, run, lessons, now_ms);
            n = added;
            if n > 0 {
                files.push((rel_str.clone(), text.into_bytes()));
            }
        }
        // The item's artifacts as its worktree has them (14–18 after a release).
        let mut names: Vec<String> = std::fs::read_dir(&run.artifact_dir)?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".md"))
            .collect();
        names.sort();
        for name in names {
            let Some(content) = crate::fsutil::read_regular(&run.artifact_dir.join(&name))? else {
                continue;
            };
            let content = content.into_bytes();
            let path = format!("{dir_rel}/{name}");
            let on_main = run.git.show_file(&run.repo_dir, &main, &path).await?;
            if on_main.as_deref().map(str::as_bytes) != Some(content.as_slice()) {
                files.push((path, content));
            }
        }
        if files.is_empty() {
            return Ok(format!("the trail is already on `{branch}`"));
        }
        let message = format!(
            "{}: audit trail and lessons on {branch}\n\nThe documents of the release's last stages and {n} lesson entr{} (lessons file `{}`).\n\nWork-Item: {}\nStage: audit\n",
            run.work_item,
            if n == 1 { "y" } else { "ies" },
            rel_str.as_deref().unwrap_or("refused"),
            run.work_item
        );
        let commit = run
            .git
            .commit_files_onto(&run.repo_dir, &main, &files, &message)
            .await?;
        match crate::repos::move_default_branch(&run.git, &run.repo_dir, &run.repo, &main, &commit)
            .await
        {
            Ok(published) => {
                crate::release::note_unpublished(run, &published).await?;
                return Ok(format!(
                    "{} file(s) committed on `{branch}` as {}",
                    files.len(),
                    &commit[..commit.len().min(12)]
                ));
            }
            // A protected branch: through the forge's API, like the release itself.
            Err(e) if crate::repos::push_refused(&e) && run.repo.forge.is_some() => {
                let commit =
                    crate::release::publish_audit_through_forge(run, &main, &commit, &message)
                        .await?;
                return Ok(format!(
                    "{} file(s) put on `{branch}` through the forge as {}",
                    files.len(),
                    &commit[..commit.len().min(12)]
                ));
            }
            Err(e) if attempt < 2 => {
                tracing::warn!(work_item = %run.work_item, error = %format!("{e:#}"), "the audit commit lost a race for the default branch; again");
            }
            Err(e) => return Err(e),
        }
    }
    anyhow::bail!("the audit commit kept losing the race for `{branch}`")
}

/// `lessons_file` as a path inside the repo, or `None` when it could leave it.
fn lessons_file_path(rel: &str) -> Option<&Path> {
    let path = Path::new(rel);
    let inside = !rel.trim().is_empty()
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && path.components().any(|c| matches!(c, Component::Normal(_)));
    inside.then_some(path)
}

/// Appends the lessons not yet in the worktree's lessons file `rel`; returns how many were
/// appended. The file is read only when it is a regular file and written through real
/// folders only ([`crate::fsutil`]).
fn append_to_lessons_file(
    rel: &Path,
    run: &StageRun,
    lessons: &[Lesson],
    now_ms: i64,
) -> anyhow::Result<usize> {
    let path = run.worktree.join(rel);
    let existing = crate::fsutil::read_regular(&path)
        .map_err(|e| anyhow::anyhow!("lessons: cannot read {}: {e}", path.display()))?
        .unwrap_or_default();
    let (text, n) = with_lessons(&existing, run, lessons, now_ms);
    if n == 0 {
        return Ok(0);
    }
    crate::fsutil::write_in_worktree(&run.worktree, rel, &text)
        .map_err(|e| anyhow::anyhow!("lessons: {e:#}"))?;
    Ok(n)
}

/// `existing` with the lessons it lacks appended, and how many were appended.
fn with_lessons(
    existing: &str,
    run: &StageRun,
    lessons: &[Lesson],
    now_ms: i64,
) -> (String, usize) {
    let present: HashSet<&str> = existing
        .lines()
        .filter_map(|l| l.split(ENTRY_MARKER).nth(1))
        .filter_map(|rest| rest.split("-->").next())
        .map(str::trim)
        .collect();
    let new: Vec<&Lesson> = lessons
        .iter()
        .filter(|l| !present.contains(l.id.as_str()))
        .collect();
    if new.is_empty() {
        return (existing.to_owned(), 0);
    }
    let mut text = existing.to_owned();
    if text.is_empty() {
        text.push_str("# Lessons\n\nObjective outcomes of past work items (rollbacks, failed staging, review rejections, exhausted retries, loops back), recorded by orch's lessons stage with their provenance.\n");
    }
    if !text.ends_with('\n') {
        text.push('\n');
    }
    let _ = write!(
        text,
        "\n## {} — {} ({})\n\n",
        run.work_item,
        one_line(&run.task.title),
        day(&rfc3339_utc(now_ms))
    );
    for l in &new {
        text.push_str(&entry_line(run.work_item.as_str(), l));
        text.push('\n');
    }
    (text, new.len())
}

/// One lessons-file entry: a list item whose hidden id makes re-runs idempotent.
fn entry_line(work_item: &str, l: &Lesson) -> String {
    format!(
        "- <!-- {ENTRY_MARKER} {} --> **{work_item}** · {} · {} — {} (source: `{}`)",
        l.id,
        l.kind,
        day(&l.date),
        l.summary,
        l.source
    )
}

/// The day part of an RFC 3339 date (the first 10 characters; `created_at` is input, so this
/// counts characters, never bytes).
fn day(date: &str) -> String {
    date.chars().take(10).collect()
}

/// `17-lessons.md`: the common frontmatter keys plus `lessons_count`, and a table.
fn render(run: &StageRun, lessons: &[Lesson], now_ms: i64, file_note: &str) -> String {
    let mut fm = Frontmatter::new();
    fm.insert("work_item", run.work_item.as_str());
    fm.insert("stage", run.stage.name.as_str());
    fm.insert("author_agent", "lessons");
    fm.insert("status", "final");
    fm.insert("created_at", rfc3339_utc(now_ms));
    fm.insert("model_used", MODEL_NOT_APPLICABLE);
    fm.insert(
        "lessons_count",
        i64::try_from(lessons.len()).unwrap_or(i64::MAX),
    );
    let mut body = format!("\n# 17 — Lessons: {}\n\n", run.work_item);
    if lessons.is_empty() {
        body.push_str("No incidents: no rollback, failed staging, review rejection, failed deploy, exhausted retries or loop back was recorded for this work item.\n");
    } else {
        body.push_str("| # | kind | date | source | what happened |\n|---|---|---|---|---|\n");
        for (i, l) in lessons.iter().enumerate() {
            let _ = writeln!(
                body,
                "| {} | {} | {} | `{}` | {} |",
                i + 1,
                l.kind,
                l.date,
                l.source.replace('|', "\\|"),
                one_line(&l.summary).replace('|', "\\|")
            );
        }
    }
    let _ = write!(body, "\nLessons file: {file_note}.\n");
    Artifact::new(fm, body).render()
}

/// The first line of a body that says something (not a heading, not blank).
fn first_line(body: &str) -> String {
    body.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("---"))
        .map(one_line)
        .unwrap_or_else(|| "(no details)".to_owned())
}

/// `s` on one line, at most 300 characters.
fn one_line(s: &str) -> String {
    orch_domain::text::one_line_max(s, 300)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lessons_file_must_stay_inside_the_repo() {
        for (rel, ok) in [
            ("LESSONS.md", true),
            ("docs/LESSONS.md", true),
            ("./LESSONS.md", true),
            ("", false),
            (".", false),
            ("/etc/passwd", false),
            ("../x.md", false),
            ("docs/../../x.md", false),
        ] {
            assert_eq!(lessons_file_path(rel).is_some(), ok, "{rel:?}");
        }
    }

    #[test]
    fn a_non_ascii_created_at_does_not_break_the_entry() {
        assert_eq!(day("2026-03-01T10:00:00Z"), "2026-03-01");
        assert_eq!(day("двадцать шестой год"), "двадцать ш");
        assert_eq!(day(""), "");
    }

    #[test]
    fn one_line_flattens_and_bounds() {
        assert_eq!(one_line("a\n  b\tc"), "a b c");
        assert_eq!(one_line(&"x".repeat(400)).chars().count(), 300);
        assert_eq!(first_line("\n# T\n\nbody text\nmore"), "body text");
        assert_eq!(first_line("# only"), "(no details)");
    }
}
