//! What a stage's commit may touch (issue 27): the rules the engine applies to every change a
//! stage leaves in its work item's worktree, *before* anything is staged or committed, so a
//! refused change never reaches a branch.
//!
//! - **Places.** No stage changes orch's own files (a `.orch` folder anywhere: role prompts,
//!   state) or its configuration (a file named `orch.toml` anywhere); only the lessons stage
//!   writes the repo's lessons file. In `docs/work-items/`, a stage writes only its own
//!   documents in its own work item's folder: never another item's documents, never those of
//!   an earlier stage of its own item (they were approved when that stage passed) nor those of
//!   the runners (tests, merge, staging, deploy, watch, lessons). A document stage (analysis,
//!   architecture, review) writes nothing else; the developer (`implementation`) also writes
//!   code anywhere outside those places. Names are compared without regard to ASCII case: a
//!   checkout on a case-insensitive file system would take `.ORCH/` for `.orch/`.
//! - **What a path holds** ([`Entry`], as `lstat` sees it): a regular file with one name, or
//!   nothing (a deletion). Never a symbolic link, a hard link (a file with more than one name:
//!   its content is another file's), a directory git would store as a nested repository, a
//!   FIFO, a socket or a device.
//! - **Names**: UTF-8, no control character (C0, DEL, C1: line breaks and terminal escapes
//!   included) and no invisible or direction-changing mark ([`crate::text::is_hidden_format`]),
//!   no component over [`MAX_NAME_BYTES`] and no path over [`MAX_PATH_BYTES`].
//! - **Size**: at most `[settings] max_changed_files` changed paths.
//!
//! [`check`] is pure: the runner lists the changes (git's porcelain status, untracked files one
//! by one) and what each path holds, and acts on the [`Violation`]s.

use std::fmt;

use crate::gate::ArtifactPattern;
use crate::ids::{ArtifactName, StageName, WorkItemId};
use crate::pipeline::{Pipeline, StageDef, StageKind};
use crate::text::{escape, escape_bytes, is_control, is_hidden_format};

/// The longest path component (bytes) a commit may hold: the limit of common file systems.
pub const MAX_NAME_BYTES: usize = 255;
/// The longest repo-relative path (bytes) a commit may hold.
pub const MAX_PATH_BYTES: usize = 1024;
/// `[settings] max_changed_files`'s default: far above a normal change, far below an attempt
/// to drown the repo (or a reviewer) in files.
pub const DEFAULT_MAX_CHANGED_FILES: u32 = 2_000;
/// The largest `max_changed_files` accepted: git's listing of that many changes still fits
/// in what orch reads from one git command.
pub const MAX_CHANGED_FILES_LIMIT: u32 = 100_000;
/// Where every work item's documents live.
pub const WORK_ITEMS_DIR: &str = "docs/work-items";
/// orch's own folder (role prompts `.orch/roles/*.md`, its state).
pub const ORCH_DIR: &str = ".orch";
/// orch's configuration file.
pub const CONFIG_FILE: &str = "orch.toml";

/// What the worktree holds at a changed path, without following a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// Nothing: the change deletes the path.
    Absent,
    /// A regular file with `links` names (`st_nlink`).
    File {
        /// How many names the file has; more than one is a hard link.
        links: u64,
    },
    /// A symbolic link.
    Symlink,
    /// A directory (git lists one only when it would store a nested repository).
    Directory,
    /// A named pipe.
    Fifo,
    /// A Unix socket.
    Socket,
    /// A block or character device.
    Device,
}

/// One changed path of the worktree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The path relative to the worktree's root, `/`-separated, as git reports it (bytes: a
    /// name need not be UTF-8).
    pub path: Vec<u8>,
    /// What is there now.
    pub entry: Entry,
}

impl Change {
    /// A change of `path` that now holds `entry`.
    pub fn new(path: impl Into<Vec<u8>>, entry: Entry) -> Change {
        Change {
            path: path.into(),
            entry,
        }
    }
}

/// What one stage may write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// The work item whose worktree it is.
    pub work_item: WorkItemId,
    /// The stage.
    pub stage: StageName,
    /// An agent's stage or a runner's.
    pub kind: StageKind,
    /// The developer's stage: code anywhere outside the protected places.
    pub writes_code: bool,
    /// The documents the stage writes in its work item's folder.
    pub documents: Vec<ArtifactPattern>,
    /// The other stages' documents, and whose they are (for the message).
    pub others: Vec<(ArtifactPattern, StageName, StageKind)>,
    /// The repo's lessons file, relative to the root (`lessons_file`, default `LESSONS.md`).
    pub lessons_file: String,
    /// Whether this stage writes the lessons file (the lessons stage).
    pub writes_lessons: bool,
    /// The most changed paths one commit may hold.
    pub max_files: usize,
}

impl Scope {
    /// The scope of `stage` of `pipeline` for `work_item`, read from its descriptor: its own
    /// artifacts and [`StageDef::also_writes`] are its documents; a stage that
    /// [`StageDef::writes_code`] (the developer's `implementation`) writes code; one that
    /// [`StageDef::writes_lessons`] (`lessons`) writes `lessons_file`.
    pub fn of(
        pipeline: &Pipeline,
        stage: &StageDef,
        work_item: &WorkItemId,
        lessons_file: &str,
        max_files: usize,
    ) -> Scope {
        let others = pipeline
            .stages
            .iter()
            .filter(|s| s.name != stage.name)
            .flat_map(|s| {
                s.artifacts
                    .iter()
                    .map(|a| (a.name.clone(), s.name.clone(), s.kind))
            })
            .collect();
        Scope {
            work_item: work_item.clone(),
            stage: stage.name.clone(),
            kind: stage.kind,
            writes_code: stage.writes_code,
            documents: stage
                .artifacts
                .iter()
                .map(|a| a.name.clone())
                .chain(
                    stage
                        .also_writes
                        .iter()
                        .cloned()
                        .map(ArtifactPattern::Exact),
                )
                .collect(),
            others,
            lessons_file: lessons_file.trim_start_matches("./").to_owned(),
            writes_lessons: stage.writes_lessons,
            max_files,
        }
    }

    /// What the stage may write in its item's folder, for a message: `only
    /// 06-architecture.md, 07-adr-*.md` or `nothing`.
    fn documents_text(&self) -> String {
        match self.documents.is_empty() {
            true => "nothing".to_owned(),
            false => format!(
                "only {}",
                self.documents
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// Which rule a change breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// More changed paths than the limit.
    TooManyFiles {
        /// Changed paths.
        count: usize,
        /// `max_changed_files`.
        limit: usize,
    },
    /// The name is not UTF-8.
    NotUtf8,
    /// The name holds a control character.
    ControlCharacter(char),
    /// The name holds an invisible or direction-changing mark.
    HiddenCharacter(char),
    /// A component is longer than [`MAX_NAME_BYTES`].
    LongName {
        /// Its length in bytes.
        bytes: usize,
    },
    /// The path is longer than [`MAX_PATH_BYTES`].
    LongPath {
        /// Its length in bytes.
        bytes: usize,
    },
    /// A symbolic link.
    Symlink,
    /// A file with more than one name.
    HardLink {
        /// Its names.
        links: u64,
    },
    /// A directory: a nested repository.
    NestedRepository,
    /// A named pipe.
    Fifo,
    /// A socket.
    Socket,
    /// A device.
    Device,
    /// Inside a `.orch` folder.
    OrchFiles,
    /// A file named `orch.toml`.
    OrchConfig,
    /// The repo's lessons file, by a stage other than lessons.
    LessonsFile,
    /// Outside this work item's folder in `docs/work-items/`.
    OtherItem,
    /// A document of another agent stage of this work item.
    EarlierDocument {
        /// Whose.
        stage: StageName,
    },
    /// A document of a runner stage of this work item.
    RunnerDocument {
        /// Whose.
        stage: StageName,
    },
    /// In this item's folder but none of this stage's documents.
    NotADocument,
    /// Outside the documents, by a stage that writes only documents.
    OutsideDocuments,
    /// An agent's stage committed, reset or switched branches itself (found by the runner,
    /// which compares the branch with where the stage began).
    BranchMoved,
    /// An index entry flagged so that git would commit the index's content, not the file's
    /// (`skip-worktree`, `assume-unchanged`; found by the runner).
    IndexFlag,
}

impl Rule {
    /// A stable name for the rule (event data).
    pub fn code(&self) -> &'static str {
        match self {
            Rule::TooManyFiles { .. } => "too_many_files",
            Rule::NotUtf8 => "not_utf8",
            Rule::ControlCharacter(_) => "control_character",
            Rule::HiddenCharacter(_) => "hidden_character",
            Rule::LongName { .. } => "long_name",
            Rule::LongPath { .. } => "long_path",
            Rule::Symlink => "symlink",
            Rule::HardLink { .. } => "hard_link",
            Rule::NestedRepository => "nested_repository",
            Rule::Fifo => "fifo",
            Rule::Socket => "socket",
            Rule::Device => "device",
            Rule::OrchFiles => "orch_files",
            Rule::OrchConfig => "orch_config",
            Rule::LessonsFile => "lessons_file",
            Rule::OtherItem => "other_item",
            Rule::EarlierDocument { .. } => "earlier_document",
            Rule::RunnerDocument { .. } => "runner_document",
            Rule::NotADocument => "not_a_document",
            Rule::OutsideDocuments => "outside_documents",
            Rule::BranchMoved => "branch_moved",
            Rule::IndexFlag => "index_flag",
        }
    }
}

/// One refused change: the path (escaped for display) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The path as [`escape_bytes`] shows it (empty for [`Rule::TooManyFiles`]).
    pub path: String,
    /// The rule broken.
    pub rule: Rule,
    /// The rule in words, for the operator.
    pub reason: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.path.is_empty() {
            true => write!(f, "{}", self.reason),
            false => write!(f, "`{}`: {}", self.path, self.reason),
        }
    }
}

/// Every rule `changes` break for the stage of `scope`: at most one violation per path (the
/// first rule it breaks: name, then what it holds, then where it is), and one for the count.
/// Empty when the stage may commit the change.
pub fn check(scope: &Scope, changes: &[Change]) -> Vec<Violation> {
    let mut out = Vec::new();
    if changes.len() > scope.max_files {
        let rule = Rule::TooManyFiles {
            count: changes.len(),
            limit: scope.max_files,
        };
        out.push(Violation {
            path: String::new(),
            reason: format!(
                "{} changed paths, more than the {} one commit may hold (`[settings] max_changed_files`)",
                changes.len(),
                scope.max_files
            ),
            rule,
        });
    }
    for change in changes {
        let found = name_rule(&change.path)
            .or_else(|| entry_rule(change.entry))
            .or_else(|| {
                // A name that passed is UTF-8.
                let path = std::str::from_utf8(&change.path).unwrap_or_default();
                place_rule(scope, path)
            });
        if let Some(rule) = found {
            out.push(Violation {
                path: escape_bytes(&change.path),
                reason: reason(scope, &rule),
                rule,
            });
        }
    }
    out
}

/// What is wrong with the name `path`, if anything.
pub fn name_rule(path: &[u8]) -> Option<Rule> {
    let Ok(text) = std::str::from_utf8(path) else {
        return Some(Rule::NotUtf8);
    };
    if let Some(c) = text.chars().find(|c| is_control(*c)) {
        return Some(Rule::ControlCharacter(c));
    }
    if let Some(c) = text.chars().find(|c| is_hidden_format(*c)) {
        return Some(Rule::HiddenCharacter(c));
    }
    if let Some(long) = text.split('/').find(|c| c.len() > MAX_NAME_BYTES) {
        return Some(Rule::LongName { bytes: long.len() });
    }
    if path.len() > MAX_PATH_BYTES {
        return Some(Rule::LongPath { bytes: path.len() });
    }
    None
}

fn entry_rule(entry: Entry) -> Option<Rule> {
    match entry {
        Entry::Absent | Entry::File { links: 0..=1 } => None,
        Entry::File { links } => Some(Rule::HardLink { links }),
        Entry::Symlink => Some(Rule::Symlink),
        Entry::Directory => Some(Rule::NestedRepository),
        Entry::Fifo => Some(Rule::Fifo),
        Entry::Socket => Some(Rule::Socket),
        Entry::Device => Some(Rule::Device),
    }
}

fn place_rule(scope: &Scope, path: &str) -> Option<Rule> {
    let lower = path.to_ascii_lowercase();
    let components: Vec<&str> = lower.split('/').collect();
    if components.contains(&ORCH_DIR) {
        return Some(Rule::OrchFiles);
    }
    if components.last() == Some(&CONFIG_FILE) {
        return Some(Rule::OrchConfig);
    }
    if lower == scope.lessons_file.to_ascii_lowercase() {
        return (!scope.writes_lessons).then_some(Rule::LessonsFile);
    }
    let area = lower == "docs" || lower == WORK_ITEMS_DIR;
    let Some(rest) = lower.strip_prefix(&format!("{WORK_ITEMS_DIR}/")) else {
        return match area {
            true => Some(Rule::OtherItem),
            false => (!scope.writes_code).then_some(Rule::OutsideDocuments),
        };
    };
    let own_dir = format!("{}/", scope.work_item.artifact_dir());
    let Some(name) = path.strip_prefix(&own_dir) else {
        // Another item's folder, a file beside the folders, or this item's folder spelled
        // in another case (which a case-insensitive checkout takes for this one).
        let own = scope.work_item.as_str().to_ascii_lowercase();
        return match rest.split('/').next() == Some(own.as_str()) && rest.contains('/') {
            true => Some(Rule::NotADocument),
            false => Some(Rule::OtherItem),
        };
    };
    let Ok(artifact) = name.parse::<ArtifactName>() else {
        return Some(Rule::NotADocument);
    };
    if scope.documents.iter().any(|p| p.matches(&artifact)) {
        return None;
    }
    match scope.others.iter().find(|(p, _, _)| p.matches(&artifact)) {
        Some((_, stage, StageKind::Llm)) => Some(Rule::EarlierDocument {
            stage: stage.clone(),
        }),
        Some((_, stage, StageKind::Deterministic)) => Some(Rule::RunnerDocument {
            stage: stage.clone(),
        }),
        None => Some(Rule::NotADocument),
    }
}

/// `rule` in words, naming what the stage may do instead.
pub fn reason(scope: &Scope, rule: &Rule) -> String {
    let stage = &scope.stage;
    let own = scope.work_item.artifact_dir();
    match rule {
        Rule::TooManyFiles { count, limit } => format!(
            "{count} changed paths, more than the {limit} one commit may hold (`[settings] max_changed_files`)"
        ),
        Rule::NotUtf8 => "the name is not UTF-8".to_owned(),
        Rule::ControlCharacter(c) => format!(
            "the name holds a control character (U+{:04X}: a line break or terminal escape)",
            u32::from(*c)
        ),
        Rule::HiddenCharacter(c) => format!(
            "the name holds an invisible or direction-changing character (U+{:04X}), so it would not read as what it is",
            u32::from(*c)
        ),
        Rule::LongName { bytes } => {
            format!("a name of {bytes} bytes, over the {MAX_NAME_BYTES}-byte limit")
        }
        Rule::LongPath { bytes } => {
            format!("a path of {bytes} bytes, over the {MAX_PATH_BYTES}-byte limit")
        }
        Rule::Symlink => "a symbolic link; no stage may commit one".to_owned(),
        Rule::HardLink { links } => format!(
            "a hard link (one file with {links} names, whose content is another file's); no stage may commit one"
        ),
        Rule::NestedRepository => {
            "a directory git would store as a nested repository; no stage may commit one".to_owned()
        }
        Rule::Fifo => "a FIFO (named pipe); no stage may commit one".to_owned(),
        Rule::Socket => "a socket; no stage may commit one".to_owned(),
        Rule::Device => "a device file; no stage may commit one".to_owned(),
        Rule::OrchFiles => format!(
            "inside `{ORCH_DIR}/`, orch's own files (role prompts, state); no stage may change them"
        ),
        Rule::OrchConfig => {
            format!("orch's configuration (`{CONFIG_FILE}`); no stage may change it")
        }
        Rule::LessonsFile => format!(
            "the repo's lessons file (`{}`); only the lessons stage writes it",
            escape(&scope.lessons_file)
        ),
        Rule::OtherItem => format!(
            "outside `{own}/`: another work item's documents (or the folder that holds them); a stage writes only its own item's"
        ),
        Rule::EarlierDocument { stage: whose } => format!(
            "a document of stage `{whose}`, approved when that stage passed; `{stage}` may write {} there",
            scope.documents_text()
        ),
        Rule::RunnerDocument { stage: whose } => format!(
            "a document of the `{whose}` runner; `{stage}` may write {} there",
            scope.documents_text()
        ),
        Rule::NotADocument => format!(
            "not one of `{stage}`'s documents; in `{own}/` it may write {}",
            scope.documents_text()
        ),
        Rule::OutsideDocuments => format!(
            "outside `{own}/`; `{stage}` writes no code: it may write {} there",
            scope.documents_text()
        ),
        Rule::BranchMoved => {
            "the stage moved its branch itself; only orch commits on a work item's branch"
                .to_owned()
        }
        Rule::IndexFlag => "flagged skip-worktree or assume-unchanged in the index, so git would commit the index's content instead of the file's".to_owned(),
    }
}

/// The violations in one line for an event or an error: the first `max`, then how many more.
pub fn summary(violations: &[Violation], max: usize) -> String {
    let mut parts: Vec<String> = violations
        .iter()
        .take(max)
        .map(ToString::to_string)
        .collect();
    if violations.len() > max {
        parts.push(format!("and {} more", violations.len() - max));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(stage: &str) -> Scope {
        let pipeline = Pipeline::default_pipeline();
        let def = pipeline.stage(&stage.parse().unwrap()).unwrap().clone();
        Scope::of(&pipeline, &def, &"APP-1".parse().unwrap(), "LESSONS.md", 5)
    }

    fn file(path: &[u8]) -> Change {
        Change::new(path, Entry::File { links: 1 })
    }

    /// Checks `changes` against `stage`'s scope: `expect` is one `(rule code, reason
    /// fragment)` per violation, in order.
    fn check_case(stage: &str, changes: &[Change], expect: &[(&str, &str)]) {
        let got = check(&scope(stage), changes);
        let codes: Vec<&str> = got.iter().map(|v| v.rule.code()).collect();
        let want: Vec<&str> = expect.iter().map(|(c, _)| *c).collect();
        assert_eq!(codes, want, "{stage}: {changes:?} → {got:#?}");
        for (v, (_, fragment)) in got.iter().zip(expect) {
            assert!(
                v.to_string().contains(fragment),
                "{stage}: {v} lacks {fragment:?}"
            );
        }
    }

    /// A stage, what it left, and the `(rule, reason fragment)` expected per violation.
    type Case = (&'static str, Vec<Change>, Vec<(&'static str, &'static str)>);

    #[test]
    fn each_stage_commits_only_what_it_writes() {
        let cases: Vec<Case> = vec![
            // Document stages: their own documents, nothing else.
            (
                "analysis",
                vec![file(b"docs/work-items/APP-1/02-requirements.md")],
                vec![],
            ),
            (
                "architecture",
                vec![
                    file(b"docs/work-items/APP-1/06-architecture.md"),
                    file(b"docs/work-items/APP-1/07-adr-001-x.md"),
                ],
                vec![],
            ),
            (
                "analysis",
                vec![file(b"app.py")],
                vec![(
                    "outside_documents",
                    "`app.py`: outside `docs/work-items/APP-1/`; `analysis` writes no code: it may write only 02-requirements.md there",
                )],
            ),
            (
                "review",
                vec![file(b"docs/work-items/APP-1/10-implementation.md")],
                vec![(
                    "earlier_document",
                    "a document of stage `implementation`, approved when that stage passed; `review` may write only 11-review.md there",
                )],
            ),
            // The developer: code anywhere, but not the documents of its own earlier
            // stages, other items', the runners', orch's files, the lessons.
            (
                "implementation",
                vec![
                    file(b"app.py"),
                    file(b"src/deep/mod.rs"),
                    file(b"docs/guide.md"),
                    file(b"docs/work-items/APP-1/10-implementation.md"),
                ],
                vec![],
            ),
            (
                "implementation",
                vec![Change::new(
                    *b"docs/work-items/APP-1/02-requirements.md",
                    Entry::File { links: 1 },
                )],
                vec![("earlier_document", "stage `analysis`")],
            ),
            (
                "implementation",
                vec![Change::new(
                    *b"docs/work-items/APP-1/01-request.md",
                    Entry::Absent,
                )],
                vec![("runner_document", "the `intake` runner")],
            ),
            (
                "implementation",
                vec![file(b"docs/work-items/APP-2/02-requirements.md")],
                vec![("other_item", "another work item's documents")],
            ),
            (
                "implementation",
                vec![file(b"docs/work-items/index.md")],
                vec![("other_item", "")],
            ),
            (
                "implementation",
                vec![file(b"docs/work-items/app-1/02-requirements.md")],
                vec![("not_a_document", "")],
            ),
            (
                "implementation",
                vec![file(b"docs/work-items/APP-1/notes.txt")],
                vec![("not_a_document", "it may write only 10-implementation.md")],
            ),
            (
                "implementation",
                vec![file(b"docs/work-items/APP-1/sub/10-implementation.md")],
                vec![("not_a_document", "")],
            ),
            (
                "implementation",
                vec![file(b"docs/work-items/APP-1/12-test-report.md")],
                vec![("runner_document", "`verification` runner")],
            ),
            (
                "implementation",
                vec![file(b".orch/roles/analyst.md")],
                vec![("orch_files", "orch's own files")],
            ),
            (
                "implementation",
                vec![file(b"sub/.ORCH/state")],
                vec![("orch_files", "")],
            ),
            (
                "implementation",
                vec![file(b"orch.toml")],
                vec![("orch_config", "orch's configuration")],
            ),
            (
                "implementation",
                vec![file(b"deploy/Orch.toml")],
                vec![("orch_config", "")],
            ),
            (
                "implementation",
                vec![file(b"LESSONS.md")],
                vec![("lessons_file", "only the lessons stage writes it")],
            ),
            (
                "implementation",
                vec![file(b"lessons.md")],
                vec![("lessons_file", "")],
            ),
            (
                "implementation",
                vec![Change::new(*b"docs", Entry::Symlink)],
                vec![("symlink", "")],
            ),
            (
                "implementation",
                vec![Change::new(*b"docs/work-items", Entry::Absent)],
                vec![("other_item", "")],
            ),
            // Runners: their documents; lessons also the lessons file.
            (
                "lessons",
                vec![
                    file(b"LESSONS.md"),
                    file(b"docs/work-items/APP-1/17-lessons.md"),
                ],
                vec![],
            ),
            (
                "verification",
                vec![file(b"docs/work-items/APP-1/12-test-report.md")],
                vec![],
            ),
            (
                "verification",
                vec![file(b".pytest_cache/v/x")],
                vec![(
                    "outside_documents",
                    "`verification` writes no code: it may write only 12-test-report.md there",
                )],
            ),
            // Deploy writes no document of its own, only the release train's revert record
            // (its descriptor's `also_writes`); the watch's log is observe's.
            (
                "deploy",
                vec![
                    file(b"docs/work-items/APP-1/16-post-deploy-log.md"),
                    file(b"docs/work-items/APP-1/18-revert.md"),
                ],
                vec![(
                    "runner_document",
                    "`deploy` may write only 18-revert.md there",
                )],
            ),
            (
                "staging",
                vec![file(b"docs/work-items/APP-1/18-revert.md")],
                vec![(
                    "not_a_document",
                    "not one of `staging`'s documents; in `docs/work-items/APP-1/` it may write only 15-staging-log.md",
                )],
            ),
        ];
        for (stage, changes, expect) in cases {
            check_case(stage, &changes, &expect);
        }
    }

    #[test]
    fn links_special_files_and_hostile_names_are_refused_for_every_stage() {
        let dev = "implementation";
        let cases: Vec<(Change, (&str, &str))> = vec![
            (
                Change::new(*b"app.py", Entry::Symlink),
                ("symlink", "`app.py`: a symbolic link"),
            ),
            (
                Change::new(
                    *b"docs/work-items/APP-1/10-implementation.md",
                    Entry::File { links: 2 },
                ),
                ("hard_link", "one file with 2 names"),
            ),
            (
                Change::new(*b"vendor/lib", Entry::Directory),
                ("nested_repository", ""),
            ),
            (
                Change::new(*b"pipe", Entry::Fifo),
                ("fifo", "FIFO (named pipe)"),
            ),
            (Change::new(*b"sock", Entry::Socket), ("socket", "")),
            (Change::new(*b"null", Entry::Device), ("device", "")),
            (
                file(b"new\nline.py"),
                (
                    "control_character",
                    "`new\\nline.py`: the name holds a control character (U+000A",
                ),
            ),
            (
                file(b"\x1b]0;pwned\x07.py"),
                ("control_character", "`\\u{1b}]0;pwned\\u{7}.py`"),
            ),
            (file(b"tab\there"), ("control_character", "U+0009")),
            (file(b"c1\xc2\x9b.py"), ("control_character", "U+009B")),
            (
                file("evil\u{202e}yp.exe".as_bytes()),
                ("hidden_character", "U+202E"),
            ),
            (
                file("iso\u{2066}late".as_bytes()),
                ("hidden_character", "U+2066"),
            ),
            (file("mark\u{200f}".as_bytes()), ("hidden_character", "")),
            (file(b"bad\xff.py"), ("not_utf8", "`bad\\xff.py`")),
            (
                file(&[b'a'; 256]),
                ("long_name", "256 bytes, over the 255-byte limit"),
            ),
            (
                file(&[b"d/".repeat(600).as_slice(), b"f"].concat()),
                ("long_path", "1201 bytes"),
            ),
            // A name rule comes first, then what the path holds, then where it is.
            (
                Change::new(*b"orch.toml\n", Entry::Symlink),
                ("control_character", ""),
            ),
            (
                Change::new(*b"orch.toml", Entry::File { links: 3 }),
                ("hard_link", ""),
            ),
        ];
        for (change, expect) in cases {
            check_case(dev, std::slice::from_ref(&change), &[expect]);
        }
        // Names within the limits, non-ASCII and the joiners some scripts need are fine.
        check_case(
            dev,
            &[
                file(&[b'a'; 255]),
                file("café/ß/👩\u{200d}💻.md".as_bytes()),
            ],
            &[],
        );
    }

    #[test]
    fn more_changes_than_the_limit_are_refused_once_with_the_count() {
        let changes: Vec<Change> = (0..7).map(|i| file(format!("f{i}").as_bytes())).collect();
        check_case(
            "implementation",
            &changes,
            &[(
                "too_many_files",
                "7 changed paths, more than the 5 one commit may hold (`[settings] max_changed_files`)",
            )],
        );
        check_case("implementation", &changes[..5], &[]);
        let v = check(&scope("analysis"), &changes);
        assert_eq!(v.len(), 8, "the count, then each path");
        assert_eq!(summary(&v, 2), format!("{}; {}; and 6 more", v[0], v[1]));
    }
}
