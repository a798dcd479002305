//! The prompt of an LLM stage (design.md §4, §8): the stage's role template, the work item, the
//! feedback of a loop back, the repo's recent lessons, the branch's changed files, the
//! artifacts so far and exact instructions for the artifact(s) to write, with a complete
//! example frontmatter block.
//!
//! [`render`] is pure and bounded: whatever the inputs, the prompt stays within
//! [`MAX_PROMPT_BYTES`]. Every part has its own bound; the artifacts get what is left, shared
//! so that small files stay whole and the biggest are cut (with a note saying where to read
//! the rest), and when even that is not enough the oldest are left out by name. The disk
//! reads that feed it are in [`load`], which never fails: a file that cannot be read is
//! left out with a warning.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};

use orch_domain::artifact::{Artifact, Value};
use orch_domain::gate::{ArtifactPattern, ArtifactSpec};
use orch_domain::ids::{AgentName, ArtifactName, StageName, WorkItemId};
use orch_domain::pipeline::StageDef;
use orch_domain::text::one_line;

/// The largest prompt [`render`] produces, in bytes.
pub(crate) const MAX_PROMPT_BYTES: usize = 200 * 1024;
/// The most of the repo's lessons file a prompt carries (the most recent entries).
pub(crate) const MAX_LESSONS_BYTES: usize = 16 * 1024;
const MAX_ROLE_BYTES: usize = 32 * 1024;
const MAX_TITLE_BYTES: usize = 1024;
const MAX_BODY_BYTES: usize = 32 * 1024;
const MAX_FEEDBACK_BYTES: usize = 48 * 1024;
const MAX_CHANGES_BYTES: usize = 16 * 1024;
/// The most read of one artifact file; a longer file is shown cut anyway.
const MAX_ARTIFACT_READ: u64 = 256 * 1024;
/// How much of the end of the lessons file is read to pick the recent entries from.
const MAX_LESSONS_READ: u64 = 256 * 1024;
/// Room kept per artifact for the note that says it was cut.
const CUT_NOTE_RESERVE: usize = 200;
/// The least content worth showing of an artifact; below it, older ones are left out.
const MIN_ARTIFACT_SHOWN: usize = 2048;

/// The shipped role templates, by role.
const ROLES: [(&str, &str); 4] = [
    ("analyst", include_str!("../../roles/analyst.md")),
    ("architect", include_str!("../../roles/architect.md")),
    ("developer", include_str!("../../roles/developer.md")),
    ("reviewer", include_str!("../../roles/reviewer.md")),
];

/// The role that does each default LLM stage.
const STAGE_ROLES: [(&str, &str); 4] = [
    ("analysis", "analyst"),
    ("architecture", "architect"),
    ("implementation", "developer"),
    ("review", "reviewer"),
];

/// How the agent hands its artifacts back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// The agent writes the files itself (CLI backends working in the worktree).
    WriteFiles,
    /// The agent replies with the files' content and orch writes them (chat endpoints).
    Reply,
}

/// The line that starts each file of a multi-file reply (chat endpoints).
pub(crate) const FILE_MARKER_PREFIX: &str = "<<<FILE ";
/// The end of a [`FILE_MARKER_PREFIX`] line.
pub(crate) const FILE_MARKER_SUFFIX: &str = ">>>";

/// An artifact already in the work item's folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ArtifactFile {
    pub name: ArtifactName,
    /// What was read (at most [`MAX_ARTIFACT_READ`] bytes, invalid UTF-8 replaced).
    pub content: String,
    /// The file's real size in bytes.
    pub size: u64,
}

/// Everything a prompt is made of.
#[derive(Debug, Clone)]
pub(crate) struct PromptInput<'a> {
    /// The role template; `None` when it travels separately (a chat system message).
    pub role: Option<&'a str>,
    pub agent: &'a AgentName,
    pub stage: &'a StageDef,
    pub work_item: &'a WorkItemId,
    pub title: &'a str,
    pub body: &'a str,
    /// The work item's branch (`orch/<id>`).
    pub branch: &'a str,
    /// The absolute path of `docs/work-items/<id>` in the worktree.
    pub artifact_dir: &'a Path,
    /// The artifacts so far, sorted by name.
    pub artifacts: &'a [ArtifactFile],
    /// The recent lessons (already selected, see [`recent_lessons`]) and the file's name.
    pub lessons: Option<(&'a str, &'a str)>,
    /// The failing artifact of a loop back.
    pub feedback: Option<(&'a ArtifactName, &'a str)>,
    /// Loops back so far.
    pub loops: u32,
    /// Files the branch changed against the default branch, and that branch's name.
    pub changed_files: &'a [String],
    pub default_branch: &'a str,
    /// The model configured for the agent, if any.
    pub model: Option<&'a str>,
    /// The current time, RFC 3339 UTC (for the example `created_at`).
    pub now: &'a str,
    pub attempt: i64,
    pub delivery: Delivery,
}

/// The shipped role template for `stage` done by `agent`: by the stage's default role, else
/// by the agent's name, else a generic one.
pub(crate) fn shipped_role(stage: &StageName, agent: &AgentName) -> String {
    let role = STAGE_ROLES
        .iter()
        .find(|(s, _)| *s == stage.as_str())
        .map(|(_, r)| *r)
        .unwrap_or(agent.as_str());
    match ROLES.iter().find(|(r, _)| *r == role) {
        Some((_, text)) => (*text).to_owned(),
        None => format!(
            "# Role: {agent}\n\nYou are the `{agent}` agent of an AI-agent delivery pipeline, \
             doing stage `{stage}` of the work item below. Do the stage's work in this \
             repository and write the artifact(s) the instructions at the end ask for.\n"
        ),
    }
}

/// Renders the prompt. Pure; the result is at most [`MAX_PROMPT_BYTES`] long.
pub(crate) fn render(p: &PromptInput<'_>) -> String {
    let head = render_head(p);
    let feedback = render_feedback(p);
    let lessons = render_lessons(p);
    let changes = render_changes(p);
    let task = render_task(p);
    let fixed = head.len() + feedback.len() + lessons.len() + changes.len() + task.len();
    let artifacts = render_artifacts(p, MAX_PROMPT_BYTES.saturating_sub(fixed));
    let mut out = String::with_capacity(fixed + artifacts.len());
    for part in [&head, &feedback, &lessons, &changes, &artifacts, &task] {
        out.push_str(part);
    }
    if out.len() > MAX_PROMPT_BYTES {
        // Unreachable while every part keeps its bound; never send more than promised.
        tracing::warn!(
            bytes = out.len(),
            "the prompt grew past its bound; cutting it"
        );
        out.truncate(floor_boundary(&out, MAX_PROMPT_BYTES));
    }
    out
}

fn render_head(p: &PromptInput<'_>) -> String {
    let mut out = String::new();
    if let Some(role) = p.role {
        out.push_str(&bounded(
            role.trim_end(),
            MAX_ROLE_BYTES,
            "the role template",
        ));
        out.push_str("\n\n");
    }
    let title = bounded(p.title.trim(), MAX_TITLE_BYTES, "the title");
    let _ = write!(out, "# Work item {}: {}\n\n", p.work_item, one_line(&title));
    let body = p.body.trim();
    if body.is_empty() {
        out.push_str("(The work item has no description beyond its title.)\n\n");
    } else {
        out.push_str(&fenced(&bounded(
            body,
            MAX_BODY_BYTES,
            "the work item's description",
        )));
        out.push('\n');
    }
    out
}

fn render_feedback(p: &PromptInput<'_>) -> String {
    let Some((name, text)) = p.feedback else {
        return String::new();
    };
    let mut out = String::new();
    let _ = write!(
        out,
        "# This is a loop back: the previous work failed\n\n\
         The work item was sent back to stage `{stage}` (loop {loops}) because `{name}` did not \
         pass. It is shown below: fix every problem it names before you write your artifact \
         again, and do not repeat the previous approach unchanged.\n",
        stage = p.stage.name,
        loops = p.loops.max(1),
    );
    let said = failure_summary(text);
    if !said.is_empty() {
        let _ = write!(out, "\nIt says: {}.\n", said.join(", "));
    }
    let _ = write!(
        out,
        "\n## {}\n\n{}\n",
        rel(p.work_item, name.as_str()),
        fenced(&bounded(text, MAX_FEEDBACK_BYTES, "the feedback artifact"))
    );
    out
}

/// The status keys (`*_status`) and the `reason`/`failure_kind` of a failing artifact, as
/// `` `key: value` `` items; nothing when its frontmatter cannot be read.
fn failure_summary(text: &str) -> Vec<String> {
    let Ok(artifact) = Artifact::parse(text) else {
        return Vec::new();
    };
    artifact
        .frontmatter
        .iter()
        .filter(|(k, _)| k.ends_with("_status") || matches!(*k, "reason" | "failure_kind"))
        .filter_map(|(k, v)| match v {
            Value::String(s) => Some(format!("`{k}: {}`", one_line(&truncate_chars(s, 300)))),
            Value::Int(_) | Value::Float(_) | Value::Bool(_) => Some(format!("`{k}: {v}`")),
            _ => None,
        })
        .collect()
}

fn render_lessons(p: &PromptInput<'_>) -> String {
    let Some((lessons, file)) = p.lessons else {
        return String::new();
    };
    if lessons.trim().is_empty() {
        return String::new();
    }
    format!(
        "# Lessons from earlier work in this repository\n\n\
         The most recent entries of `{file}`: mistakes that cost earlier work items a stage. \
         Do not repeat them.\n\n{}\n",
        fenced(&bounded(lessons, MAX_LESSONS_BYTES, "the lessons"))
    )
}

fn render_changes(p: &PromptInput<'_>) -> String {
    if p.changed_files.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "# Files this branch changed\n\n`git diff --name-only {}...HEAD` in the worktree \
         (read them with `git diff {}...HEAD -- <file>`):\n\n",
        p.default_branch, p.default_branch
    );
    let mut listed = 0;
    for file in p.changed_files {
        let line = format!("- `{}`\n", one_line(file));
        if out.len() + line.len() > MAX_CHANGES_BYTES - 100 {
            break;
        }
        out.push_str(&line);
        listed += 1;
    }
    if listed < p.changed_files.len() {
        let _ = writeln!(
            out,
            "- … and {} more (run the command above for all of them)",
            p.changed_files.len() - listed
        );
    }
    out.push('\n');
    out
}

/// The artifacts so far within `budget` bytes: small files whole, the biggest cut, the
/// oldest left out by name when even that does not fit.
fn render_artifacts(p: &PromptInput<'_>, budget: usize) -> String {
    let feedback = p.feedback.map(|(n, _)| n);
    let shown: Vec<&ArtifactFile> = p
        .artifacts
        .iter()
        .filter(|a| Some(&a.name) != feedback)
        .collect();
    let mut out = String::from("# Artifacts so far\n\n");
    if shown.is_empty() {
        out.push_str(match feedback {
            Some(_) => "None besides the feedback above.\n\n",
            None => "None yet.\n\n",
        });
        return if out.len() <= budget {
            out
        } else {
            String::new()
        };
    }
    let _ = write!(
        out,
        "The files in `{}` (the whole files are in the worktree):\n\n",
        p.work_item.artifact_dir()
    );
    if feedback.is_some() {
        out.push_str("(The feedback artifact is shown above and not repeated.)\n\n");
    }
    // Each file costs its header, fences and a possible cut note besides its content.
    let overhead = |a: &ArtifactFile| -> usize {
        let fence = fence_for(&a.content).len();
        rel(p.work_item, a.name.as_str()).len() + 2 * fence + 16 + CUT_NOTE_RESERVE
    };
    // Keep the newest files whose overhead and a useful minimum fit; name the rest.
    let omitted_note_reserve = 200
        + shown
            .iter()
            .map(|a| a.name.as_str().len() + 4)
            .sum::<usize>();
    let room = budget.saturating_sub(out.len() + omitted_note_reserve);
    let mut kept = 0;
    let mut fixed = 0;
    let mut needed = 0;
    for a in shown.iter().rev() {
        let need = overhead(a) + a.content.len().min(MIN_ARTIFACT_SHOWN);
        if needed + need > room {
            break;
        }
        needed += need;
        fixed += overhead(a);
        kept += 1;
    }
    let (omitted, kept_files) = shown.split_at(shown.len() - kept);
    let content_room = room.saturating_sub(fixed);
    let shares = fair_shares(
        &kept_files
            .iter()
            .map(|a| a.content.len())
            .collect::<Vec<_>>(),
        content_room,
    );
    if !omitted.is_empty() {
        let names: Vec<String> = omitted.iter().map(|a| format!("`{}`", a.name)).collect();
        let _ = write!(
            out,
            "Left out for room (read them in the worktree): {}.\n\n",
            names.join(", ")
        );
    }
    for (a, share) in kept_files.iter().zip(shares) {
        let cut = floor_line_boundary(&a.content, share);
        let shown_text = &a.content[..cut];
        let _ = write!(out, "## {}\n\n", rel(p.work_item, a.name.as_str()));
        let fence = fence_for(&a.content);
        let _ = write!(out, "{fence}\n{shown_text}");
        if !shown_text.is_empty() && !shown_text.ends_with('\n') {
            out.push('\n');
        }
        let _ = writeln!(out, "{fence}");
        let shown_bytes = cut as u64;
        if shown_bytes < a.size {
            let _ = writeln!(
                out,
                "[orch cut this file here: {} of its {} bytes are not shown; read the whole \
                 file at `{}`]",
                a.size - shown_bytes,
                a.size,
                rel(p.work_item, a.name.as_str())
            );
        }
        out.push('\n');
    }
    if out.len() > budget {
        // The reserves above make this unreachable; keep the bound regardless.
        out.truncate(floor_boundary(&out, budget));
    }
    out
}

/// Max-min fair shares of `room` between items of the given sizes: no item gets more than
/// its size, and what small items do not use goes to the bigger ones.
fn fair_shares(sizes: &[usize], room: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| sizes[i]);
    let mut shares = vec![0; sizes.len()];
    let mut left = room;
    for (k, &i) in order.iter().enumerate() {
        let fair = left / (sizes.len() - k);
        let share = sizes[i].min(fair);
        shares[i] = share;
        left -= share;
    }
    shares
}

fn render_task(p: &PromptInput<'_>) -> String {
    let mut out = String::from("# Your task\n\n");
    let _ = write!(
        out,
        "You are `{agent}`, doing stage `{stage}` of work item {id} (attempt {attempt}). ",
        agent = p.agent,
        stage = p.stage.name,
        id = p.work_item,
        attempt = p.attempt,
    );
    match p.delivery {
        Delivery::WriteFiles => {
            let _ = write!(
                out,
                "Your working directory is the work item's own git worktree, on branch `{}`. \
                 Work only in it: do not switch branches, rewrite history or push, and do not \
                 touch other work items' folders.\n\n",
                p.branch
            );
        }
        Delivery::Reply => {
            out.push_str("You cannot run commands or write files: orch writes what you reply.\n\n")
        }
    }
    let required: Vec<&ArtifactSpec> = p.stage.artifacts.iter().filter(|s| !s.optional).collect();
    let optional: Vec<&ArtifactSpec> = p.stage.artifacts.iter().filter(|s| s.optional).collect();
    match p.delivery {
        Delivery::WriteFiles => {
            let _ = write!(
                out,
                "Before you finish, write {} (orch checks that it exists, then a gate reads \
                 its frontmatter):\n\n",
                if required.len() == 1 {
                    "this file"
                } else {
                    "these files; for each"
                }
            );
            for spec in &required {
                let name = spec.name.to_string();
                let _ = writeln!(
                    out,
                    "- `{}` (absolute path: `{}`)",
                    rel(p.work_item, &name),
                    p.artifact_dir.join(&name).display()
                );
            }
            for spec in &optional {
                let _ = writeln!(
                    out,
                    "- optional: `{}` in the same folder, when you have one to write{}",
                    rel(p.work_item, &spec.name.to_string()),
                    family_hint(spec)
                );
            }
            out.push('\n');
        }
        Delivery::Reply => {
            let several = required.len() > 1 || !optional.is_empty();
            if several {
                let _ = write!(
                    out,
                    "Reply with the complete content of these files, each one preceded by a \
                     line `{FILE_MARKER_PREFIX}<file name>{FILE_MARKER_SUFFIX}` and nothing \
                     else around them:\n\n"
                );
                for spec in &required {
                    let _ = writeln!(out, "- `{}`", spec.name);
                }
                for spec in &optional {
                    let _ = writeln!(out, "- optional: `{}`{}", spec.name, family_hint(spec));
                }
                out.push('\n');
            } else if let Some(spec) = required.first() {
                let _ = write!(
                    out,
                    "Reply with the complete content of `{}` and nothing else: start with its \
                     `---` frontmatter line, no code fence and no commentary around it.\n\n",
                    spec.name
                );
            }
        }
    }
    for spec in required.iter().chain(&optional) {
        render_spec_instructions(&mut out, p, spec);
    }
    out.push_str(
        "A missing file, unreadable frontmatter, a missing or empty key, a `work_item` of \
         another work item, or a status value spelled differently (another case, extra words) \
         fails the stage.\n",
    );
    out
}

fn family_hint(spec: &ArtifactSpec) -> String {
    match &spec.name {
        ArtifactPattern::Family(prefix) => format!(" (e.g. `{prefix}short-name.md`)"),
        ArtifactPattern::Exact(_) => String::new(),
    }
}

/// The keys of one artifact and a complete example frontmatter block.
fn render_spec_instructions(out: &mut String, p: &PromptInput<'_>, spec: &ArtifactSpec) {
    let _ = write!(
        out,
        "## `{}`: frontmatter\n\nThe file starts with a YAML frontmatter block with these keys:\n\n",
        spec.name
    );
    let mut example: Vec<(String, String)> = Vec::new();
    for key in spec.all_required_keys() {
        let exactly = |v: String| (format!("`{v}` (exactly this)"), v);
        let (shown, value) = match key {
            "work_item" => exactly(p.work_item.to_string()),
            "stage" => exactly(p.stage.name.to_string()),
            "author_agent" => exactly(p.agent.to_string()),
            "status" => (
                "`final` when the document is complete".to_owned(),
                "final".to_owned(),
            ),
            "created_at" => (
                format!("the current time, RFC 3339 UTC, e.g. `{}`", p.now),
                p.now.to_owned(),
            ),
            "model_used" => match p.model {
                Some(m) => (
                    format!("`{m}` (the model that wrote the document)"),
                    m.to_owned(),
                ),
                None => (
                    "the name of the model that wrote the document".to_owned(),
                    "<your model name>".to_owned(),
                ),
            },
            other => match spec.status_key.as_ref().filter(|s| s.key == other) {
                Some(status) => (
                    format!(
                        "exactly one of {}, spelled exactly so (upper case)",
                        status
                            .allowed
                            .iter()
                            .map(|v| format!("`{v}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    status.allowed.first().cloned().unwrap_or_default(),
                ),
                None => ("required, not empty".to_owned(), "<value>".to_owned()),
            },
        };
        let _ = writeln!(out, "- `{key}`: {shown}");
        example.push((key.to_owned(), value));
    }
    let name = match &spec.name {
        ArtifactPattern::Exact(n) => n.to_string(),
        ArtifactPattern::Family(prefix) => format!("{prefix}short-name.md"),
    };
    let heading = heading_for(&name);
    let number = name.get(..2).unwrap_or("");
    let title = one_line(&truncate_chars(p.title.trim(), 80));
    let _ = write!(
        out,
        "\nExample (complete; change only the values you must):\n\n````markdown\n---\n"
    );
    for (k, v) in &example {
        let _ = writeln!(out, "{k}: {v}");
    }
    let _ = write!(
        out,
        "---\n\n# {number} — {heading}: {} — {title}\n\n…\n````\n\n",
        p.work_item
    );
}

/// `Requirements` for `02-requirements.md`, `Adr Short Name` for `07-adr-short-name.md`.
fn heading_for(file: &str) -> String {
    let stem = file.trim_end_matches(".md");
    let stem = stem.get(3..).unwrap_or(stem);
    stem.split('-')
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect::<String>())
                .unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

// --- lessons -------------------------------------------------------------------------------

/// The most recent entries of a lessons file within `limit` bytes, oldest first, with a note
/// when older ones were left out. Entries start at `## ` headings; a file without them is
/// split at blank lines. The newest entry alone past the limit is cut. `None` when empty.
pub(crate) fn recent_lessons(text: &str, limit: usize) -> Option<String> {
    let entries = split_entries(text);
    if entries.is_empty() {
        return None;
    }
    const NOTE_RESERVE: usize = 120;
    let room = limit.saturating_sub(NOTE_RESERVE);
    let mut picked: Vec<&str> = Vec::new();
    let mut used = 0;
    for e in entries.iter().rev() {
        let cost = e.len() + 2;
        if used + cost > room {
            break;
        }
        used += cost;
        picked.push(e);
    }
    let mut out = String::new();
    let older = entries.len() - picked.len();
    if picked.is_empty() {
        let newest = entries.last().copied().unwrap_or_default();
        let cut = floor_line_boundary(newest, room);
        out.push_str(&format!(
            "({older} older entries left out.)\n\n{}\n[cut: the rest of this entry is in the file]\n",
            &newest[..cut]
        ));
        return Some(out);
    }
    if older > 0 {
        let _ = write!(out, "({older} older entries left out.)\n\n");
    }
    for e in picked.iter().rev() {
        out.push_str(e);
        out.push_str("\n\n");
    }
    Some(out.trim_end().to_owned() + "\n")
}

/// Entries of a lessons file, trimmed and non-empty.
fn split_entries(text: &str) -> Vec<&str> {
    let headed = text.lines().any(|l| l.starts_with("## "));
    let mut starts = vec![0];
    let mut offset = 0;
    let mut prev_blank = false;
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_end();
        let start = if headed {
            trimmed.starts_with("## ")
        } else {
            prev_blank && !trimmed.is_empty()
        };
        if start && offset > 0 {
            starts.push(offset);
        }
        prev_blank = trimmed.is_empty();
        offset += line.len();
    }
    starts.push(text.len());
    let mut entries: Vec<&str> = starts
        .windows(2)
        .map(|w| text[w[0]..w[1]].trim())
        .filter(|e| !e.is_empty())
        .collect();
    if headed {
        // The preamble before the first heading (the file's title) is not a lesson.
        if let Some(first) = entries.first()
            && !first.starts_with("## ")
        {
            entries.remove(0);
        }
    }
    entries
}

// --- reading the inputs --------------------------------------------------------------------

/// What [`load`] read from disk.
#[derive(Debug, Default)]
pub(crate) struct Loaded {
    /// The role template (the repo's override or the shipped one).
    pub role: String,
    /// Where the role came from, for the run record.
    pub role_source: String,
    pub artifacts: Vec<ArtifactFile>,
    pub lessons: Option<String>,
}

/// Reads the role template (the worktree's `.orch/roles/<agent>.md` when present), the
/// artifacts in `artifact_dir` and the recent lessons. Never fails: what cannot be read is
/// left out with a warning. Blocking; call it off the async runtime.
pub(crate) fn load(
    worktree: &Path,
    artifact_dir: &Path,
    lessons_file: &str,
    stage: &StageName,
    agent: &AgentName,
) -> Loaded {
    let override_path = worktree
        .join(".orch")
        .join("roles")
        .join(format!("{agent}.md"));
    let (role, role_source) = match read_head(&override_path, MAX_ROLE_BYTES as u64) {
        Some((text, _)) if !text.trim().is_empty() => (text, format!(".orch/roles/{agent}.md")),
        _ => (shipped_role(stage, agent), "shipped".to_owned()),
    };
    Loaded {
        role,
        role_source,
        artifacts: read_artifacts(artifact_dir),
        lessons: read_tail(&worktree.join(lessons_file), MAX_LESSONS_READ)
            .and_then(|text| recent_lessons(&text, MAX_LESSONS_BYTES)),
    }
}

fn read_artifacts(dir: &Path) -> Vec<ArtifactFile> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot list the artifacts; the prompt has none");
            return Vec::new();
        }
    };
    let mut names = BTreeSet::new();
    for entry in entries.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        match name.parse::<ArtifactName>() {
            Ok(n) if entry.file_type().is_ok_and(|t| t.is_file()) => {
                names.insert(n);
            }
            _ => {}
        }
    }
    names
        .into_iter()
        .filter_map(|name| {
            let (content, size) = read_head(&dir.join(name.as_str()), MAX_ARTIFACT_READ)?;
            Some(ArtifactFile {
                name,
                content,
                size,
            })
        })
        .collect()
}

/// The first `limit` bytes of a file (lossy UTF-8) and its size; `None` when it is missing
/// (silently) or unreadable or not a regular file (a link, a FIFO: with a warning).
fn read_head(path: &Path, limit: u64) -> Option<(String, u64)> {
    let file = match crate::fsutil::open_regular(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read a prompt input; leaving it out");
            return None;
        }
    };
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut bytes = Vec::new();
    if let Err(e) = file.take(limit).read_to_end(&mut bytes) {
        tracing::warn!(path = %path.display(), error = %e, "cannot read a prompt input; leaving it out");
        return None;
    }
    Some((String::from_utf8_lossy(&bytes).into_owned(), size))
}

/// The last `limit` bytes of a file (lossy UTF-8, starting at a line), `None` when missing
/// or unreadable.
fn read_tail(path: &Path, limit: u64) -> Option<String> {
    let read = || -> std::io::Result<String> {
        let mut file = crate::fsutil::open_regular(path)?;
        let size = file.metadata()?.len();
        let start = size.saturating_sub(limit);
        file.seek(SeekFrom::Start(start))?;
        let mut bytes = Vec::new();
        file.take(limit).read_to_end(&mut bytes)?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        Ok(if start > 0 {
            // Drop the partial first line.
            text.split_once('\n')
                .map(|(_, rest)| rest.to_owned())
                .unwrap_or_default()
        } else {
            text
        })
    };
    match read() {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the lessons file; the prompt has none");
            None
        }
    }
}

/// The path of an artifact relative to the worktree root.
pub(crate) fn rel(work_item: &WorkItemId, file: &str) -> String {
    format!("{}/{file}", work_item.artifact_dir())
}

/// The absolute form of `path` (relative paths are taken from orch's working directory).
pub(crate) fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

// --- text helpers --------------------------------------------------------------------------

/// `text` cut to `max` bytes at a line (or char) boundary, with a note naming `what` when cut.
fn bounded(text: &str, max: usize, what: &str) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let note = format!(
        "\n[orch cut {what} here; all of it is {} bytes]",
        text.len()
    );
    let cut = floor_line_boundary(text, max.saturating_sub(note.len()));
    format!("{}{note}", &text[..cut])
}

/// `text` in a code fence longer than any backtick run inside it.
fn fenced(text: &str) -> String {
    let fence = fence_for(text);
    let nl = if text.ends_with('\n') { "" } else { "\n" };
    format!("{fence}\n{text}{nl}{fence}\n")
}

fn fence_for(text: &str) -> String {
    let mut longest = 0;
    let mut run = 0;
    for c in text.chars() {
        if c == '`' {
            run += 1;
            longest = longest.max(run);
        } else {
            run = 0;
        }
    }
    "`".repeat((longest + 1).max(3))
}

/// The largest char boundary `<= max`.
fn floor_boundary(text: &str, max: usize) -> usize {
    if max >= text.len() {
        return text.len();
    }
    let mut i = max;
    while i > 0 && !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// A cut point `<= max`: after the last newline when one is reasonably close, else at a char
/// boundary.
fn floor_line_boundary(text: &str, max: usize) -> usize {
    let cut = floor_boundary(text, max);
    if cut == text.len() {
        return cut;
    }
    match text[..cut].rfind('\n') {
        Some(i) if cut - i < 2048 => i + 1,
        _ => cut,
    }
}

fn truncate_chars(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        text.chars().take(max).collect::<String>() + "…"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orch_domain::pipeline::Pipeline;

    fn stage(name: &str) -> StageDef {
        Pipeline::default_pipeline()
            .stage(&name.parse().unwrap())
            .cloned()
            .unwrap()
    }

    fn file(name: &str, content: &str) -> ArtifactFile {
        ArtifactFile {
            name: name.parse().unwrap(),
            content: content.to_owned(),
            size: content.len() as u64,
        }
    }

    struct Case<'a> {
        stage: &'a str,
        agent: &'a str,
        artifacts: Vec<ArtifactFile>,
        lessons: Option<&'a str>,
        feedback: Option<(&'a str, &'a str)>,
        changed: Vec<String>,
        body: &'a str,
        model: Option<&'a str>,
        delivery: Delivery,
    }

    impl Default for Case<'_> {
        fn default() -> Self {
            Case {
                stage: "analysis",
                agent: "analyst",
                artifacts: vec![file(
                    "01-request.md",
                    "---\nwork_item: ORCH-7\n---\nplease add X\n",
                )],
                lessons: None,
                feedback: None,
                changed: Vec::new(),
                body: "Add a flag `--dry-run`.",
                model: Some("sonnet"),
                delivery: Delivery::WriteFiles,
            }
        }
    }

    /// Renders `case` and checks that every `present` line is in the prompt and no `absent`
    /// one is; returns the prompt for further checks.
    fn check(case: Case<'_>, present: &[&str], absent: &[&str]) -> String {
        let stage = stage(case.stage);
        let agent: AgentName = case.agent.parse().unwrap();
        let id: WorkItemId = "ORCH-7".parse().unwrap();
        let feedback_name: Option<ArtifactName> = case.feedback.map(|(n, _)| n.parse().unwrap());
        let role = shipped_role(&stage.name, &agent);
        let input = PromptInput {
            role: Some(&role),
            agent: &agent,
            stage: &stage,
            work_item: &id,
            title: "Dry run",
            body: case.body,
            branch: "orch/ORCH-7",
            artifact_dir: Path::new("/wt/docs/work-items/ORCH-7"),
            artifacts: &case.artifacts,
            lessons: case.lessons.map(|l| (l, "LESSONS.md")),
            feedback: feedback_name.as_ref().zip(case.feedback.map(|(_, t)| t)),
            loops: 1,
            changed_files: &case.changed,
            default_branch: "main",
            model: case.model,
            now: "2027-01-15T08:00:00Z",
            attempt: 2,
            delivery: case.delivery,
        };
        let prompt = render(&input);
        assert!(prompt.len() <= MAX_PROMPT_BYTES, "{} bytes", prompt.len());
        for line in present {
            assert!(prompt.contains(line), "missing {line:?} in:\n{prompt}");
        }
        for line in absent {
            assert!(!prompt.contains(line), "unexpected {line:?} in:\n{prompt}");
        }
        prompt
    }

    #[test]
    fn analysis_prompt_has_role_item_artifacts_and_exact_instructions() {
        let prompt = check(
            Case::default(),
            &[
                "# Role: analyst",
                "# Work item ORCH-7: Dry run",
                "Add a flag `--dry-run`.",
                "## docs/work-items/ORCH-7/01-request.md",
                "please add X",
                "You are `analyst`, doing stage `analysis` of work item ORCH-7 (attempt 2).",
                "- `docs/work-items/ORCH-7/02-requirements.md` (absolute path: `/wt/docs/work-items/ORCH-7/02-requirements.md`)",
                "- `work_item`: `ORCH-7` (exactly this)",
                "- `stage`: `analysis` (exactly this)",
                "- `author_agent`: `analyst` (exactly this)",
                "- `created_at`: the current time, RFC 3339 UTC, e.g. `2027-01-15T08:00:00Z`",
                "---\nwork_item: ORCH-7\nstage: analysis\nauthor_agent: analyst\nstatus: final\n\
                 created_at: 2027-01-15T08:00:00Z\nmodel_used: sonnet\n---\n\n# 02 — Requirements: ORCH-7 — Dry run",
            ],
            &[
                "loop back",
                "Lessons",
                "Files this branch changed",
                "review_status",
            ],
        );
        // The instructions come last.
        assert!(prompt.find("# Your task").unwrap() > prompt.find("# Artifacts so far").unwrap());
    }

    #[test]
    fn review_prompt_names_the_status_key_and_its_values() {
        check(
            Case {
                stage: "review",
                agent: "critic",
                model: None,
                changed: vec![
                    "src/main.rs".into(),
                    "docs/work-items/ORCH-7/10-implementation.md".into(),
                ],
                ..Case::default()
            },
            &[
                "# Role: reviewer",
                "- `review_status`: exactly one of `APPROVED`, `CHANGES_REQUESTED`, spelled exactly so (upper case)",
                "author_agent: critic\n",
                "model_used: <your model name>\nreview_status: APPROVED\n---",
                "# Files this branch changed",
                "- `src/main.rs`",
                "git diff main...HEAD -- <file>",
            ],
            &[],
        );
    }

    #[test]
    fn architecture_lists_both_files_and_the_optional_family() {
        check(
            Case {
                stage: "architecture",
                agent: "architect",
                ..Case::default()
            },
            &[
                "- `docs/work-items/ORCH-7/06-architecture.md`",
                "- `docs/work-items/ORCH-7/08-data-requirements.md`",
                "- optional: `docs/work-items/ORCH-7/07-adr-*.md` in the same folder, when you have one to write (e.g. `07-adr-short-name.md`)",
                "## `08-data-requirements.md`: frontmatter",
                "# 08 — Data Requirements: ORCH-7 — Dry run",
            ],
            &[],
        );
    }

    #[test]
    fn reply_delivery_asks_for_content_and_file_markers() {
        check(
            Case {
                delivery: Delivery::Reply,
                ..Case::default()
            },
            &["Reply with the complete content of `02-requirements.md` and nothing else"],
            &["absolute path", "worktree, on branch"],
        );
        check(
            Case {
                stage: "architecture",
                agent: "architect",
                delivery: Delivery::Reply,
                ..Case::default()
            },
            &[
                "each one preceded by a line `<<<FILE <file name>>>>`",
                "- `06-architecture.md`",
            ],
            &[],
        );
    }

    #[test]
    fn feedback_says_plainly_what_failed_and_is_not_repeated() {
        let review = "---\nwork_item: ORCH-7\nstage: review\nreview_status: CHANGES_REQUESTED\n---\n\
                      1. blocking: the flag is ignored\n";
        let prompt = check(
            Case {
                stage: "implementation",
                agent: "developer",
                feedback: Some(("11-review.md", review)),
                artifacts: vec![file("01-request.md", "req"), file("11-review.md", review)],
                ..Case::default()
            },
            &[
                "# This is a loop back: the previous work failed",
                "sent back to stage `implementation` (loop 1) because `11-review.md` did not pass",
                "It says: `review_status: CHANGES_REQUESTED`.",
                "1. blocking: the flag is ignored",
                "(The feedback artifact is shown above and not repeated.)",
            ],
            &[],
        );
        assert_eq!(
            prompt
                .matches("## docs/work-items/ORCH-7/11-review.md")
                .count(),
            1
        );
    }

    #[test]
    fn lessons_are_included_when_present() {
        check(
            Case {
                lessons: Some("## ORCH-3 (2027-01-01)\nRun the migrations test.\n"),
                ..Case::default()
            },
            &[
                "# Lessons from earlier work in this repository",
                "The most recent entries of `LESSONS.md`",
                "Run the migrations test.",
            ],
            &[],
        );
    }

    #[test]
    fn huge_inputs_stay_within_the_bound_and_cut_the_biggest_first() {
        let big = "x".repeat(400 * 1024);
        let body = "b".repeat(100 * 1024);
        let prompt = check(
            Case {
                body: &body,
                artifacts: vec![
                    file("01-request.md", "small request\n"),
                    file("02-requirements.md", &big),
                    file("06-architecture.md", &"y\n".repeat(200 * 1024)),
                ],
                ..Case::default()
            },
            &[
                "small request",
                "[orch cut the work item's description here",
                "bytes are not shown; read the whole file at `docs/work-items/ORCH-7/02-requirements.md`",
                "read the whole file at `docs/work-items/ORCH-7/06-architecture.md`",
                "# Your task",
            ],
            &[],
        );
        assert!(
            prompt.len() > MAX_PROMPT_BYTES - 8 * 1024,
            "{}",
            prompt.len()
        );
    }

    #[test]
    fn many_artifacts_leave_out_the_oldest_by_name() {
        let artifacts: Vec<ArtifactFile> = (10..99)
            .map(|i| file(&format!("{i}-a.md"), &"z".repeat(60 * 1024)))
            .collect();
        check(
            Case {
                artifacts,
                ..Case::default()
            },
            &[
                "Left out for room (read them in the worktree): `10-a.md`",
                "## docs/work-items/ORCH-7/98-a.md",
            ],
            &["## docs/work-items/ORCH-7/10-a.md"],
        );
    }

    #[test]
    fn fair_shares_keep_small_items_whole() {
        assert_eq!(fair_shares(&[10, 1000, 50], 300), vec![10, 240, 50]);
        assert_eq!(fair_shares(&[10, 20], 300), vec![10, 20]);
        assert_eq!(fair_shares(&[100, 100], 50), vec![25, 25]);
        assert_eq!(fair_shares(&[], 50), Vec::<usize>::new());
    }

    #[test]
    fn recent_lessons_pick_the_newest_entries_within_the_limit() {
        let cases: &[(&str, usize, Option<&str>)] = &[
            ("", 1000, None),
            ("   \n\n", 1000, None),
            (
                "# Lessons\n\n## A\nold\n\n## B\nnew\n",
                1000,
                Some("## A\nold\n\n## B\nnew\n"),
            ),
            (
                "# Lessons\n\n## A\nold old old old old old\n\n## B\nnew\n",
                135,
                Some("(1 older entries left out.)\n\n## B\nnew\n"),
            ),
            (
                "first para\n\nsecond para\n",
                1000,
                Some("first para\n\nsecond para\n"),
            ),
        ];
        for (text, limit, expect) in cases {
            assert_eq!(recent_lessons(text, *limit).as_deref(), *expect, "{text:?}");
        }
        let huge = format!("## A\n{}\n", "w".repeat(50_000));
        let got = recent_lessons(&huge, MAX_LESSONS_BYTES).unwrap();
        assert!(got.len() <= MAX_LESSONS_BYTES, "{}", got.len());
        assert!(got.contains("[cut: the rest of this entry is in the file]"));
    }

    #[test]
    fn fences_outlast_the_backticks_inside() {
        assert_eq!(fence_for("plain"), "```");
        assert_eq!(fence_for("```rust\n```"), "````");
        assert_eq!(fenced("a"), "```\na\n```\n");
    }

    #[test]
    fn cuts_respect_utf8() {
        let s = "ééééé";
        assert_eq!(floor_boundary(s, 3), 2);
        assert!(bounded("ü".repeat(100).as_str(), 60, "x").len() <= 60);
    }

    #[test]
    fn role_lookup_by_stage_then_agent_then_generic() {
        let r = |s: &str, a: &str| shipped_role(&s.parse().unwrap(), &a.parse().unwrap());
        assert!(r("review", "critic").starts_with("# Role: reviewer"));
        assert!(r("custom", "developer").starts_with("# Role: developer"));
        assert!(r("custom", "writer").starts_with("# Role: writer"));
    }

    #[test]
    fn load_prefers_the_repo_override_and_reads_sorted_artifacts() {
        let dir = tempfile::tempdir().unwrap();
        let wt = dir.path();
        let arts = wt.join("docs/work-items/ORCH-7");
        std::fs::create_dir_all(&arts).unwrap();
        std::fs::write(arts.join("02-requirements.md"), "two").unwrap();
        std::fs::write(arts.join("01-request.md"), "one").unwrap();
        std::fs::write(arts.join("notes.txt"), "not an artifact").unwrap();
        std::fs::write(wt.join("LESSONS.md"), "## L1\nuse the helper\n").unwrap();
        let stage: StageName = "analysis".parse().unwrap();
        let agent: AgentName = "analyst".parse().unwrap();
        let loaded = load(wt, &arts, "LESSONS.md", &stage, &agent);
        assert_eq!(loaded.role_source, "shipped");
        let names: Vec<&str> = loaded.artifacts.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["01-request.md", "02-requirements.md"]);
        assert_eq!(loaded.lessons.as_deref(), Some("## L1\nuse the helper\n"));

        std::fs::create_dir_all(wt.join(".orch/roles")).unwrap();
        std::fs::write(wt.join(".orch/roles/analyst.md"), "# Our analyst\n").unwrap();
        let loaded = load(wt, &arts, "missing.md", &stage, &agent);
        assert_eq!(loaded.role, "# Our analyst\n");
        assert_eq!(loaded.role_source, ".orch/roles/analyst.md");
        assert_eq!(loaded.lessons, None);
    }
}
