//! Gates: deterministic code that reads an artifact's frontmatter and says whether the stage
//! succeeded, and with which status value.
//!
//! Gates are conservative (design.md §3): a missing file, unparsable frontmatter, a duplicate key, a
//! missing or empty required key, a frontmatter written for another work item, or a status
//! value that is not exactly one of the allowed spellings (`approved` is not `APPROVED`) is
//! never success. Every outcome carries a reason a person can act on.

use std::fmt;

use crate::artifact::{Artifact, Frontmatter, REQUIRED_KEYS, Value};
use crate::ids::{ArtifactName, WorkItemId};

/// What a gate concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<V = String> {
    /// The artifact is valid; the value is its status (see [`check_artifact`]).
    Pass(V),
    /// The artifact is missing or invalid. Never treated as success.
    NotSuccess,
}

/// A gate's verdict with the reason for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateOutcome<V = String> {
    /// What the gate concluded.
    pub verdict: Verdict<V>,
    /// Why, in words fit for an event log.
    pub reason: String,
}

impl<V> GateOutcome<V> {
    /// A passing outcome with `value`.
    pub fn pass(value: V, reason: impl Into<String>) -> GateOutcome<V> {
        GateOutcome {
            verdict: Verdict::Pass(value),
            reason: reason.into(),
        }
    }

    /// A not-success outcome.
    pub fn not_success(reason: impl Into<String>) -> GateOutcome<V> {
        GateOutcome {
            verdict: Verdict::NotSuccess,
            reason: reason.into(),
        }
    }

    /// The value, when the verdict is [`Verdict::Pass`].
    pub fn value(&self) -> Option<&V> {
        match &self.verdict {
            Verdict::Pass(v) => Some(v),
            Verdict::NotSuccess => None,
        }
    }
}

// --- what a gate expects ---------------------------------------------------------------------

/// Which file(s) an [`ArtifactSpec`] covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArtifactPattern {
    /// Exactly this file.
    Exact(ArtifactName),
    /// Every file whose name starts with this prefix (e.g. `07-adr-` for `07-adr-*.md`).
    Family(String),
}

impl ArtifactPattern {
    /// Whether `name` is covered.
    pub fn matches(&self, name: &ArtifactName) -> bool {
        match self {
            ArtifactPattern::Exact(exact) => exact == name,
            ArtifactPattern::Family(prefix) => name.as_str().starts_with(prefix.as_str()),
        }
    }
}

impl fmt::Display for ArtifactPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArtifactPattern::Exact(name) => write!(f, "{name}"),
            ArtifactPattern::Family(prefix) => write!(f, "{prefix}*.md"),
        }
    }
}

/// The status key of an artifact and its allowed values, spelled exactly (`review_status`:
/// `APPROVED`, `CHANGES_REQUESTED`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusKey {
    /// The frontmatter key.
    pub key: String,
    /// The allowed values, exact spelling and case.
    pub allowed: Vec<String>,
}

/// What a stage's artifact must look like for its gate to pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactSpec {
    /// The file, or family of files, this spec covers.
    pub name: ArtifactPattern,
    /// Keys required besides the common [`REQUIRED_KEYS`] and the status key.
    pub required_keys: Vec<String>,
    /// The key whose value routes the pipeline, when the artifact has one.
    pub status_key: Option<StatusKey>,
    /// Whether the stage may leave no such file.
    pub optional: bool,
}

impl ArtifactSpec {
    /// A required artifact with only the common keys and no status key.
    pub fn new(name: ArtifactName) -> ArtifactSpec {
        ArtifactSpec {
            name: ArtifactPattern::Exact(name),
            required_keys: Vec::new(),
            status_key: None,
            optional: false,
        }
    }

    /// An optional family of artifacts whose names start with `prefix` (`07-adr-`).
    pub fn family(prefix: impl Into<String>) -> ArtifactSpec {
        ArtifactSpec {
            name: ArtifactPattern::Family(prefix.into()),
            required_keys: Vec::new(),
            status_key: None,
            optional: true,
        }
    }

    /// Sets the status key and its allowed values.
    pub fn with_status(mut self, key: &str, allowed: &[&str]) -> ArtifactSpec {
        self.status_key = Some(StatusKey {
            key: key.to_owned(),
            allowed: allowed.iter().map(|v| (*v).to_owned()).collect(),
        });
        self
    }

    /// Adds required keys.
    pub fn requiring(mut self, keys: &[&str]) -> ArtifactSpec {
        self.required_keys
            .extend(keys.iter().map(|k| (*k).to_owned()));
        self
    }

    /// Marks the artifact optional.
    pub fn optional(mut self) -> ArtifactSpec {
        self.optional = true;
        self
    }

    /// Every key the artifact must have: the common ones, the spec's own, the status key.
    pub fn all_required_keys(&self) -> Vec<&str> {
        let mut keys: Vec<&str> = REQUIRED_KEYS.to_vec();
        for k in self
            .required_keys
            .iter()
            .map(String::as_str)
            .chain(self.status_key.as_ref().map(|s| s.key.as_str()))
        {
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        keys
    }
}

// --- the generic gate ------------------------------------------------------------------------

/// Checks one artifact's text against `spec` for `work_item`.
///
/// `content` is `None` when the file does not exist. On success the verdict carries the value of
/// the spec's status key, or, for a spec without one, the common `status` value.
pub fn check_artifact(
    content: Option<&str>,
    spec: &ArtifactSpec,
    work_item: &WorkItemId,
) -> GateOutcome {
    let name = &spec.name;
    let Some(content) = content else {
        return GateOutcome::not_success(format!("`{name}` is missing"));
    };
    let artifact = match Artifact::parse(content) {
        Ok(a) => a,
        Err(e) => return GateOutcome::not_success(format!("`{name}`: {e}")),
    };
    check_frontmatter(&artifact.frontmatter, spec, work_item)
}

fn check_frontmatter(fm: &Frontmatter, spec: &ArtifactSpec, work_item: &WorkItemId) -> GateOutcome {
    let name = &spec.name;
    let missing: Vec<String> = spec
        .all_required_keys()
        .into_iter()
        .filter(|k| is_missing(fm.get(k)))
        .map(|k| format!("`{k}`"))
        .collect();
    if !missing.is_empty() {
        return GateOutcome::not_success(format!(
            "`{name}`: missing or empty frontmatter key{} {}",
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", ")
        ));
    }
    match fm.get("work_item") {
        Some(Value::String(s)) if s == work_item.as_str() => {}
        Some(other) => {
            return GateOutcome::not_success(format!(
                "`{name}`: `work_item` is {}, expected `{work_item}`",
                describe(other)
            ));
        }
        None => {
            return GateOutcome::not_success(format!("`{name}`: missing key `work_item`"));
        }
    }
    let Some(status) = &spec.status_key else {
        let value = fm.get("status").map_or_else(String::new, plain_text);
        return GateOutcome::pass(value, format!("`{name}` is valid"));
    };
    let key = &status.key;
    let allowed = status.allowed.join(", ");
    match fm.get(key) {
        Some(Value::String(v)) if status.allowed.iter().any(|a| a == v) => {
            GateOutcome::pass(v.clone(), format!("`{name}`: `{key}: {v}`"))
        }
        Some(Value::String(v)) if status.allowed.iter().any(|a| a.eq_ignore_ascii_case(v)) => {
            GateOutcome::not_success(format!(
                "`{name}`: `{key}` is `{v}`, in the wrong case; expected exactly one of {allowed}"
            ))
        }
        Some(other) => GateOutcome::not_success(format!(
            "`{name}`: `{key}` is {}, expected exactly one of {allowed}",
            describe(other)
        )),
        None => GateOutcome::not_success(format!("`{name}`: missing key `{key}`")),
    }
}

/// A required key counts as missing when absent, null or an empty string.
fn is_missing(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.trim().is_empty(),
        Some(_) => false,
    }
}

/// `"`x`"` for a string, `"an integer `3`"` for anything else: how a bad value is named.
fn describe(v: &Value) -> String {
    match v {
        Value::String(s) => format!("`{}`", truncate(s)),
        other => format!("{} `{}`", other.kind(), truncate(&other.to_string())),
    }
}

/// The text of a scalar as a person would read it (a string without quotes).
fn plain_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn truncate(s: &str) -> String {
    const MAX: usize = 60;
    if s.chars().count() <= MAX {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(MAX).collect();
        t.push('…');
        t
    }
}

/// Checks every artifact a stage must leave, given the files present in the work item's folder
/// (`files`: name and content of each).
///
/// Each required exact file must exist and pass; every file of a family present must pass; an
/// optional file may be absent. On success the verdict carries the status value of the first
/// spec that has a status key, or else the first artifact's `status` value.
pub fn check_artifacts(
    specs: &[ArtifactSpec],
    work_item: &WorkItemId,
    files: &[(ArtifactName, &str)],
) -> GateOutcome {
    // The value that routes the stage: from the first spec with a status key, else from the
    // first file checked.
    let routing = specs.iter().position(|s| s.status_key.is_some());
    let mut value: Option<String> = None;
    let mut checked = Vec::new();
    for (index, spec) in specs.iter().enumerate() {
        let matching: Vec<&(ArtifactName, &str)> =
            files.iter().filter(|(n, _)| spec.name.matches(n)).collect();
        if matching.is_empty() {
            if spec.optional {
                continue;
            }
            return GateOutcome::not_success(format!("`{}` is missing", spec.name));
        }
        for (file, content) in matching {
            let outcome = check_artifact(Some(content), spec, work_item);
            let Verdict::Pass(v) = outcome.verdict else {
                let reason = match &spec.name {
                    ArtifactPattern::Family(_) => format!("{} ({file})", outcome.reason),
                    ArtifactPattern::Exact(_) => outcome.reason,
                };
                return GateOutcome::not_success(reason);
            };
            checked.push(file.to_string());
            if routing == Some(index) || (routing.is_none() && value.is_none()) {
                value = Some(v);
            }
        }
    }
    let value = value.unwrap_or_default();
    if checked.is_empty() {
        return GateOutcome::pass(value, "the stage requires no artifact");
    }
    GateOutcome::pass(value, format!("valid: {}", checked.join(", ")))
}

// --- the status gates ------------------------------------------------------------------------

/// Builds a status gate: the generic check, then the value mapped to its typed variant.
fn typed<V: Copy>(
    content: Option<&str>,
    spec: &ArtifactSpec,
    work_item: &WorkItemId,
    table: &[(&str, V)],
) -> GateOutcome<V> {
    let outcome = check_artifact(content, spec, work_item);
    match outcome.verdict {
        Verdict::Pass(value) => match table.iter().find(|(s, _)| *s == value) {
            Some((_, v)) => GateOutcome::pass(*v, outcome.reason),
            // Unreachable while the specs and tables agree; conservative all the same.
            None => GateOutcome::not_success(format!("unexpected status value `{value}`")),
        },
        Verdict::NotSuccess => GateOutcome::not_success(outcome.reason),
    }
}

macro_rules! status_gate {
    (
        $(#[$enum_doc:meta])* $enum:ident,
        $(#[$spec_doc:meta])* $spec_fn:ident,
        $(#[$fn_doc:meta])* $parse_fn:ident,
        $file:literal, $key:literal,
        extra_keys: [$($extra:literal),*],
        $( $(#[$vdoc:meta])* $variant:ident = $text:literal ),+ $(,)?
    ) => {
        $(#[$enum_doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $enum {
            $( $(#[$vdoc])* $variant, )+
        }

        impl $enum {
            /// The exact frontmatter spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $enum::$variant => $text, )+
                }
            }
        }

        impl fmt::Display for $enum {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        $(#[$spec_doc])*
        pub fn $spec_fn() -> ArtifactSpec {
            ArtifactSpec::new(ArtifactName::known($file))
                .requiring(&[$($extra),*])
                .with_status($key, &[$($text),+])
        }

        $(#[$fn_doc])*
        pub fn $parse_fn(content: Option<&str>, work_item: &WorkItemId) -> GateOutcome<$enum> {
            typed(content, &$spec_fn(), work_item, &[$(($text, $enum::$variant)),+])
        }
    };
}

status_gate!(
    /// `review_status` of `11-review.md`.
    ReviewStatus,
    /// The spec of `11-review.md`.
    review_spec,
    /// Reads `11-review.md`: `APPROVED` or `CHANGES_REQUESTED`, exactly.
    parse_review_status,
    "11-review.md", "review_status",
    extra_keys: [],
    /// The reviewer approved the change.
    Approved = "APPROVED",
    /// The reviewer wants changes: back to implementation.
    ChangesRequested = "CHANGES_REQUESTED",
);

status_gate!(
    /// `test_status` of `12-test-report.md`.
    TestStatus,
    /// The spec of `12-test-report.md`.
    test_report_spec,
    /// Reads `12-test-report.md`: `PASSED` or `FAILED`, exactly.
    parse_test_status,
    "12-test-report.md", "test_status",
    extra_keys: [],
    /// The test command passed.
    Passed = "PASSED",
    /// The test command failed.
    Failed = "FAILED",
);

status_gate!(
    /// `merge_status` of `14-merge-log.md`.
    MergeStatus,
    /// The spec of `14-merge-log.md`.
    merge_log_spec,
    /// Reads `14-merge-log.md`: `MERGED`, `CONFLICT` or `FAILED`, exactly.
    parse_merge_status,
    "14-merge-log.md", "merge_status",
    extra_keys: [],
    /// Merged into the default branch.
    Merged = "MERGED",
    /// The branch conflicts with the default branch.
    Conflict = "CONFLICT",
    /// The merge failed otherwise (verification after the update, push, infrastructure).
    Failed = "FAILED",
);

status_gate!(
    /// `staging_status` of `15-staging-log.md` (seed 000, D-3: the key's name and case are a
    /// contract).
    StagingStatus,
    /// The spec of `15-staging-log.md`.
    staging_log_spec,
    /// Reads `15-staging-log.md`. Only exactly `SUCCESS` is success; `FAILED` and anything
    /// else (a missing file, `success`, `TOOL_ERROR`) is not.
    parse_staging_status,
    "15-staging-log.md", "staging_status",
    extra_keys: [],
    /// Every staging step passed.
    Success = "SUCCESS",
    /// The change is at fault, or tool errors were exhausted.
    Failed = "FAILED",
);

status_gate!(
    /// `post_deploy_status` of `16-post-deploy-log.md` (seed 002).
    PostDeployStatus,
    /// The spec of `16-post-deploy-log.md`, with the machine-readable keys of seed 002 §4.
    post_deploy_log_spec,
    /// Reads `16-post-deploy-log.md`: `HEALTHY`, `DEGRADED` or `FAILED`, exactly.
    parse_post_deploy_status,
    "16-post-deploy-log.md", "post_deploy_status",
    extra_keys: ["action_taken", "window_s", "checks_total", "checks_failed"],
    /// The watch saw enough passing polls.
    Healthy = "HEALTHY",
    /// Not enough evidence either way, or some failures.
    Degraded = "DEGRADED",
    /// The service failed after the deploy.
    Failed = "FAILED",
);

impl<V: PartialEq> GateOutcome<V> {
    /// Whether the verdict is `Pass(value)`.
    pub fn is(&self, value: V) -> bool {
        self.verdict == Verdict::Pass(value)
    }
}

impl GateOutcome<StagingStatus> {
    /// Whether staging succeeded: exactly `staging_status: SUCCESS`.
    pub fn is_success(&self) -> bool {
        self.is(StagingStatus::Success)
    }
}

impl<V: fmt::Display> GateOutcome<V> {
    /// The same outcome with the value as its frontmatter text, as [`crate::pipeline`] takes it.
    pub fn into_generic(self) -> GateOutcome {
        GateOutcome {
            verdict: match self.verdict {
                Verdict::Pass(v) => Verdict::Pass(v.to_string()),
                Verdict::NotSuccess => Verdict::NotSuccess,
            },
            reason: self.reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> WorkItemId {
        "ORCH-115".parse().unwrap()
    }

    /// An artifact for ORCH-115 with the common keys, then `extra` lines.
    fn doc(extra: &str) -> String {
        format!(
            "---\nwork_item: ORCH-115\nstage: staging\nauthor_agent: staging-runner\nstatus: done\n\
             created_at: 2026-06-16T10:00:00Z\nmodel_used: n/a\n{extra}---\n\n# body\n"
        )
    }

    /// Runs `gate` on `content` and compares the verdict and a fragment of the reason.
    fn check<V: fmt::Debug + PartialEq>(
        gate: impl Fn(Option<&str>, &WorkItemId) -> GateOutcome<V>,
        content: Option<&str>,
        verdict: Verdict<V>,
        reason_fragment: &str,
    ) {
        let got = gate(content, &id());
        assert_eq!(
            got.verdict, verdict,
            "content {content:?}: reason {:?}",
            got.reason
        );
        assert!(
            got.reason.contains(reason_fragment),
            "content {content:?}: reason {:?} lacks {reason_fragment:?}",
            got.reason
        );
    }

    #[test]
    fn staging_gate_is_conservative() {
        use StagingStatus::*;
        let cases: Vec<(Option<String>, Verdict<StagingStatus>, &str)> = vec![
            (
                Some(doc("staging_status: SUCCESS\n")),
                Verdict::Pass(Success),
                "staging_status: SUCCESS",
            ),
            (
                Some(doc("staging_status: FAILED\nfailure_kind: step_failed\n")),
                Verdict::Pass(Failed),
                "FAILED",
            ),
            (None, Verdict::NotSuccess, "`15-staging-log.md` is missing"),
            (
                Some("# no frontmatter\n".into()),
                Verdict::NotSuccess,
                "no frontmatter",
            ),
            (
                Some("---\nstaging_status: SUCCESS\n".into()),
                Verdict::NotSuccess,
                "unterminated",
            ),
            (
                Some(doc("staging_status: success\n")),
                Verdict::NotSuccess,
                "wrong case",
            ),
            (
                Some(doc("staging_status: Success\n")),
                Verdict::NotSuccess,
                "wrong case",
            ),
            (
                Some(doc("staging_status: TOOL_ERROR\n")),
                Verdict::NotSuccess,
                "`TOOL_ERROR`, expected exactly one of SUCCESS, FAILED",
            ),
            (
                Some(doc("staging_status: \" SUCCESS\"\n")),
                Verdict::NotSuccess,
                "expected exactly one of",
            ),
            (
                Some(doc("staging_status: true\n")),
                Verdict::NotSuccess,
                "a boolean `true`",
            ),
            (
                Some(doc("staging_status: [SUCCESS]\n")),
                Verdict::NotSuccess,
                "a list",
            ),
            (
                Some(doc("staging_status:\n")),
                Verdict::NotSuccess,
                "missing or empty frontmatter key `staging_status`",
            ),
            (
                Some(doc("")),
                Verdict::NotSuccess,
                "missing or empty frontmatter key `staging_status`",
            ),
            (
                Some(doc("staging_status: FAILED\nstaging_status: SUCCESS\n")),
                Verdict::NotSuccess,
                "duplicate frontmatter key `staging_status`",
            ),
            (
                Some(doc("staging_status: SUCCESS\n").replace("ORCH-115", "ORCH-116")),
                Verdict::NotSuccess,
                "`work_item` is `ORCH-116`, expected `ORCH-115`",
            ),
            (
                Some(
                    doc("staging_status: SUCCESS\n")
                        .replace("work_item: ORCH-115", "work_item: 115"),
                ),
                Verdict::NotSuccess,
                "`work_item` is an integer `115`",
            ),
            (
                Some(doc("staging_status: SUCCESS\n").replace("model_used: n/a\n", "")),
                Verdict::NotSuccess,
                "missing or empty frontmatter key `model_used`",
            ),
            (
                Some(doc("staging_status: SUCCESS\n").replace("status: done\n", "status: ''\n")),
                Verdict::NotSuccess,
                "key `status`",
            ),
            (
                Some(
                    doc("staging_status: SUCCESS\n")
                        .replace("created_at: 2026-06-16T10:00:00Z\nmodel_used: n/a\n", ""),
                ),
                Verdict::NotSuccess,
                "keys `created_at`, `model_used`",
            ),
            (
                Some("---\n- staging_status: SUCCESS\n---\n".into()),
                Verdict::NotSuccess,
                "must be a mapping",
            ),
            (
                Some("---\nstaging_status: [\n---\n".into()),
                Verdict::NotSuccess,
                "invalid frontmatter YAML",
            ),
        ];
        for (content, verdict, fragment) in cases {
            check(parse_staging_status, content.as_deref(), verdict, fragment);
        }
        assert!(parse_staging_status(Some(&doc("staging_status: SUCCESS\n")), &id()).is_success());
        assert!(!parse_staging_status(Some(&doc("staging_status: FAILED\n")), &id()).is_success());
        assert!(!parse_staging_status(None, &id()).is_success());
    }

    #[test]
    fn seed_staging_log_reads_back() {
        // The producer side of seed 000 D-3: author staging-runner, model n/a.
        let text = "---\nwork_item: ORCH-115\nstage: staging\nauthor_agent: staging-runner\n\
                    status: done\ncreated_at: \"2026-06-16T10:00:00Z\"\nmodel_used: n/a\n\
                    staging_status: SUCCESS\nfailure_kind: none\nattempt: 1\nreason: all steps passed\n---\n";
        assert!(parse_staging_status(Some(text), &id()).is_success());
    }

    #[test]
    fn review_gate() {
        use ReviewStatus::*;
        let cases: Vec<(Option<String>, Verdict<ReviewStatus>, &str)> = vec![
            (
                Some(doc("review_status: APPROVED\n")),
                Verdict::Pass(Approved),
                "APPROVED",
            ),
            (
                Some(doc("review_status: CHANGES_REQUESTED\n")),
                Verdict::Pass(ChangesRequested),
                "CHANGES_REQUESTED",
            ),
            (
                Some(doc("review_status: approved\n")),
                Verdict::NotSuccess,
                "`approved`, in the wrong case",
            ),
            (
                Some(doc("review_status: changes_requested\n")),
                Verdict::NotSuccess,
                "wrong case",
            ),
            (
                Some(doc("review_status: LGTM\n")),
                Verdict::NotSuccess,
                "expected exactly one of APPROVED, CHANGES_REQUESTED",
            ),
            (
                Some(doc("review_status: APPROVED\nreview_status: APPROVED\n")),
                Verdict::NotSuccess,
                "duplicate",
            ),
            (None, Verdict::NotSuccess, "`11-review.md` is missing"),
        ];
        for (content, verdict, fragment) in cases {
            check(parse_review_status, content.as_deref(), verdict, fragment);
        }
    }

    #[test]
    fn test_gate() {
        use TestStatus::*;
        let cases: Vec<(Option<String>, Verdict<TestStatus>, &str)> = vec![
            (
                Some(doc("test_status: PASSED\n")),
                Verdict::Pass(Passed),
                "PASSED",
            ),
            (
                Some(doc("test_status: FAILED\n")),
                Verdict::Pass(Failed),
                "FAILED",
            ),
            (
                Some(doc("test_status: passed\n")),
                Verdict::NotSuccess,
                "wrong case",
            ),
            (
                Some(doc("test_status: PASS\n")),
                Verdict::NotSuccess,
                "expected exactly one of PASSED, FAILED",
            ),
            (
                Some(doc("test_status: 0\n")),
                Verdict::NotSuccess,
                "an integer `0`",
            ),
            (None, Verdict::NotSuccess, "`12-test-report.md` is missing"),
        ];
        for (content, verdict, fragment) in cases {
            check(parse_test_status, content.as_deref(), verdict, fragment);
        }
    }

    #[test]
    fn merge_gate() {
        use MergeStatus::*;
        let cases: Vec<(Option<String>, Verdict<MergeStatus>, &str)> = vec![
            (
                Some(doc("merge_status: MERGED\n")),
                Verdict::Pass(Merged),
                "MERGED",
            ),
            (
                Some(doc("merge_status: CONFLICT\n")),
                Verdict::Pass(Conflict),
                "CONFLICT",
            ),
            (
                Some(doc("merge_status: FAILED\n")),
                Verdict::Pass(Failed),
                "FAILED",
            ),
            (
                Some(doc("merge_status: Merged\n")),
                Verdict::NotSuccess,
                "wrong case",
            ),
            (
                Some(doc("merge_status: SKIPPED\n")),
                Verdict::NotSuccess,
                "expected exactly one of MERGED, CONFLICT, FAILED",
            ),
            (None, Verdict::NotSuccess, "`14-merge-log.md` is missing"),
        ];
        for (content, verdict, fragment) in cases {
            check(parse_merge_status, content.as_deref(), verdict, fragment);
        }
    }

    #[test]
    fn post_deploy_gate() {
        use PostDeployStatus::*;
        let keys = "action_taken: none\nwindow_s: 600\nchecks_total: 20\nchecks_failed: 0\n";
        let with = |status: &str| doc(&format!("post_deploy_status: {status}\n{keys}"));
        let cases: Vec<(Option<String>, Verdict<PostDeployStatus>, &str)> = vec![
            (Some(with("HEALTHY")), Verdict::Pass(Healthy), "HEALTHY"),
            (Some(with("DEGRADED")), Verdict::Pass(Degraded), "DEGRADED"),
            (Some(with("FAILED")), Verdict::Pass(Failed), "FAILED"),
            (Some(with("healthy")), Verdict::NotSuccess, "wrong case"),
            (
                Some(with("UNKNOWN")),
                Verdict::NotSuccess,
                "expected exactly one of HEALTHY, DEGRADED, FAILED",
            ),
            (
                Some(doc("post_deploy_status: HEALTHY\n")),
                Verdict::NotSuccess,
                "keys `action_taken`, `window_s`, `checks_total`, `checks_failed`",
            ),
            (
                None,
                Verdict::NotSuccess,
                "`16-post-deploy-log.md` is missing",
            ),
        ];
        for (content, verdict, fragment) in cases {
            check(
                parse_post_deploy_status,
                content.as_deref(),
                verdict,
                fragment,
            );
        }
    }

    #[test]
    fn generic_check_without_status_key_passes_the_status_value() {
        let spec = ArtifactSpec::new(ArtifactName::known("02-requirements.md"));
        let got = check_artifact(Some(&doc("")), &spec, &id());
        assert_eq!(got.verdict, Verdict::Pass("done".to_owned()));
        assert_eq!(got.reason, "`02-requirements.md` is valid");
    }

    #[test]
    fn stage_check_over_several_files() {
        let architecture = ArtifactSpec::new(ArtifactName::known("06-architecture.md"));
        let adr = ArtifactSpec::family("07-adr-");
        let data = ArtifactSpec::new(ArtifactName::known("08-data-requirements.md"));
        let specs = [architecture, adr, data];
        let good = doc("");
        let bad = doc("").replace("ORCH-115", "ORCH-9");
        let name = |s: &str| s.parse::<ArtifactName>().unwrap();

        type Files<'a> = Vec<(ArtifactName, &'a str)>;
        let cases: Vec<(Files<'_>, Verdict, &str)> = vec![
            (
                vec![
                    (name("06-architecture.md"), &good),
                    (name("08-data-requirements.md"), &good),
                ],
                Verdict::Pass("done".into()),
                "valid: 06-architecture.md, 08-data-requirements.md",
            ),
            (
                vec![
                    (name("06-architecture.md"), &good),
                    (name("07-adr-queue.md"), &good),
                    (name("07-adr-schema.md"), &good),
                    (name("08-data-requirements.md"), &good),
                ],
                Verdict::Pass("done".into()),
                "07-adr-queue.md, 07-adr-schema.md",
            ),
            (
                vec![
                    (name("06-architecture.md"), &good),
                    (name("07-adr-schema.md"), &bad),
                    (name("08-data-requirements.md"), &good),
                ],
                Verdict::NotSuccess,
                "`07-adr-*.md`: `work_item` is `ORCH-9`, expected `ORCH-115` (07-adr-schema.md)",
            ),
            (
                vec![(name("06-architecture.md"), &good)],
                Verdict::NotSuccess,
                "`08-data-requirements.md` is missing",
            ),
            (
                vec![],
                Verdict::NotSuccess,
                "`06-architecture.md` is missing",
            ),
        ];
        for (files, verdict, fragment) in cases {
            let got = check_artifacts(&specs, &id(), &files);
            assert_eq!(got.verdict, verdict, "{}", got.reason);
            assert!(
                got.reason.contains(fragment),
                "{:?} lacks {fragment:?}",
                got.reason
            );
        }

        // A stage whose second artifact carries the status key routes on that key.
        let specs = [
            ArtifactSpec::new(ArtifactName::known("10-implementation.md")),
            review_spec(),
        ];
        let review = doc("review_status: CHANGES_REQUESTED\n");
        let files = [
            (name("10-implementation.md"), good.as_str()),
            (name("11-review.md"), review.as_str()),
        ];
        let got = check_artifacts(&specs, &id(), &files);
        assert_eq!(got.verdict, Verdict::Pass("CHANGES_REQUESTED".into()));
    }

    #[test]
    fn typed_outcome_converts_to_generic() {
        let got = parse_review_status(Some(&doc("review_status: APPROVED\n")), &id());
        assert_eq!(
            got.into_generic().verdict,
            Verdict::Pass("APPROVED".to_owned())
        );
    }
}
