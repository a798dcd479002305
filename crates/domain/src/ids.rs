//! Validated names: work item ids, prefixes, repo, stage, agent and artifact names.
//!
//! These strings end up in file paths, git branch names, SQL rows and shell environments, so
//! each is checked once, at the edge, and carried as a newtype afterwards. A hostile id such as
//! `../../x` can never become a `WorkItemId`, so no later code has to re-check it.

use std::fmt;
use std::num::NonZeroU64;
use std::str::FromStr;

/// Why a string is not a valid name of some kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {input:?}: {reason}")]
pub struct IdError {
    /// What kind of name was expected (`"work item id"`, `"repo name"`, ...).
    pub kind: &'static str,
    /// The rejected input, cut to a readable length.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Longest input echoed back in an [`IdError`].
const MAX_ECHO: usize = 80;

fn err(kind: &'static str, input: &str, reason: impl Into<String>) -> IdError {
    let input = if input.chars().count() > MAX_ECHO {
        let mut cut: String = input.chars().take(MAX_ECHO).collect();
        cut.push('…');
        cut
    } else {
        input.to_owned()
    };
    IdError {
        kind,
        input,
        reason: reason.into(),
    }
}

/// Rejects the inputs that are dangerous in paths and shells whatever the grammar says, with a
/// reason a person recognises ("contains a path separator" rather than "bad character").
fn reject_hostile(kind: &'static str, s: &str, max_len: usize) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(err(kind, s, "is empty"));
    }
    if s.len() > max_len {
        return Err(err(
            kind,
            s,
            format!("is {} bytes long, the limit is {max_len}", s.len()),
        ));
    }
    if s.contains('\0') {
        return Err(err(kind, s, "contains a NUL byte"));
    }
    if s.contains(['/', '\\']) {
        return Err(err(kind, s, "contains a path separator"));
    }
    if s.contains("..") {
        return Err(err(kind, s, "contains `..`"));
    }
    if s.chars().any(char::is_whitespace) {
        return Err(err(kind, s, "contains whitespace"));
    }
    if s.chars().any(char::is_control) {
        return Err(err(kind, s, "contains a control character"));
    }
    if !s.is_ascii() {
        return Err(err(kind, s, "contains a non-ASCII character"));
    }
    Ok(())
}

/// `[a-z][a-z0-9]*(-[a-z0-9]+)*`: lower-case words joined by single dashes.
fn check_kebab(kind: &'static str, s: &str, max_len: usize) -> Result<(), IdError> {
    reject_hostile(kind, s, max_len)?;
    if s.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(err(kind, s, "must be lower case"));
    }
    if !s.starts_with(|c: char| c.is_ascii_lowercase()) {
        return Err(err(kind, s, "must start with a letter a-z"));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Err(err(
            kind,
            s,
            format!("contains {c:?}; only a-z, 0-9 and `-` are allowed"),
        ));
    }
    if s.ends_with('-') || s.contains("--") {
        return Err(err(
            kind,
            s,
            "must not end with `-` or contain `--` (kebab-case)",
        ));
    }
    Ok(())
}

/// Implements the string plumbing every name newtype shares: `as_str`, `Display`, `FromStr`,
/// `TryFrom<&str>`, `TryFrom<String>`, `AsRef<str>`, `From<Self> for String` and serde
/// (as a plain string; deserializing validates).
macro_rules! string_newtype {
    ($name:ident, $check:path) => {
        impl $name {
            /// The validated text.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// A name written in this crate's source. Tests validate every such constant
            /// (the default pipeline is checked by `Pipeline::validate`).
            #[allow(dead_code)]
            pub(crate) fn known(s: &'static str) -> Self {
                debug_assert!($check(s).is_ok(), "bad built-in name {s:?}");
                Self(s.to_owned())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                $check(s)?;
                Ok(Self(s.to_owned()))
            }
        }

        impl TryFrom<&str> for $name {
            type Error = IdError;
            fn try_from(s: &str) -> Result<Self, IdError> {
                s.parse()
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                $check(&s)?;
                Ok(Self(s))
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.0
            }
        }

        // Comparing with plain text is always safe (no unvalidated value is built), and it
        // lets code and tests holding a typed row compare it with a literal (`task.stage ==
        // "done"`) as they did when the row held strings.
        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.0 == other
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                self == other.0
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::try_from(s).map_err(serde::de::Error::custom)
            }
        }
    };
}

// ---------------------------------------------------------------------------------------------

/// A work item id prefix: 1..=16 characters, `[A-Z][A-Z0-9]*` (e.g. `ORCH`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Prefix(String);

/// Longest allowed [`Prefix`].
const MAX_PREFIX: usize = 16;

fn check_prefix(s: &str) -> Result<(), IdError> {
    const KIND: &str = "prefix";
    reject_hostile(KIND, s, MAX_PREFIX)?;
    if s.bytes().any(|b| b.is_ascii_lowercase()) {
        return Err(err(KIND, s, "must be upper case"));
    }
    if !s.starts_with(|c: char| c.is_ascii_uppercase()) {
        return Err(err(KIND, s, "must start with a letter A-Z"));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_uppercase() || c.is_ascii_digit()))
    {
        return Err(err(
            KIND,
            s,
            format!("contains {c:?}; only A-Z and 0-9 are allowed"),
        ));
    }
    Ok(())
}

string_newtype!(Prefix, check_prefix);

// ---------------------------------------------------------------------------------------------

/// A work item id `<PREFIX>-<n>`, e.g. `ORCH-115`: a [`Prefix`], a dash and a positive integer
/// written without leading zeros; at most 64 characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkItemId(String);

/// Longest allowed [`WorkItemId`].
const MAX_WORK_ITEM_ID: usize = 64;

fn check_work_item_id(s: &str) -> Result<(), IdError> {
    parse_work_item_id(s).map(|_| ())
}

/// Splits and validates an id, returning its prefix part and number.
fn parse_work_item_id(s: &str) -> Result<(&str, NonZeroU64), IdError> {
    const KIND: &str = "work item id";
    reject_hostile(KIND, s, MAX_WORK_ITEM_ID)?;
    let Some((prefix, number)) = s.rsplit_once('-') else {
        return Err(err(
            KIND,
            s,
            "expected `<PREFIX>-<number>`, e.g. `ORCH-115`",
        ));
    };
    check_prefix(prefix).map_err(|e| err(KIND, s, format!("prefix {:?} {}", prefix, e.reason)))?;
    if number.is_empty() {
        return Err(err(KIND, s, "the number after `-` is missing"));
    }
    if !number.bytes().all(|b| b.is_ascii_digit()) {
        return Err(err(
            KIND,
            s,
            format!("{number:?} after `-` is not a number"),
        ));
    }
    if number.starts_with('0') {
        return Err(err(
            KIND,
            s,
            "the number must be positive and have no leading zeros",
        ));
    }
    let n: u64 = number
        .parse()
        .map_err(|_| err(KIND, s, "the number is too large"))?;
    let n = NonZeroU64::new(n).ok_or_else(|| err(KIND, s, "the number must be positive"))?;
    Ok((prefix, n))
}

string_newtype!(WorkItemId, check_work_item_id);

impl WorkItemId {
    /// Builds `<prefix>-<n>`; `n` must be positive.
    pub fn new(prefix: &Prefix, n: u64) -> Result<WorkItemId, IdError> {
        format!("{prefix}-{n}").parse()
    }

    /// The prefix part (`ORCH` of `ORCH-115`).
    pub fn prefix(&self) -> Prefix {
        let (prefix, _) = self.0.rsplit_once('-').unwrap_or((&self.0, ""));
        Prefix(prefix.to_owned())
    }

    /// The number part (`115` of `ORCH-115`).
    pub fn number(&self) -> u64 {
        // Validated on construction; the fallback is unreachable but keeps this infallible.
        parse_work_item_id(&self.0).map_or(0, |(_, n)| n.get())
    }

    /// The git branch the work item's changes live on: `orch/<id>`.
    pub fn branch_name(&self) -> String {
        format!("orch/{}", self.0)
    }

    /// The folder of the work item's artifacts, relative to the repo root:
    /// `docs/work-items/<id>` (under [`crate::protect::WORK_ITEMS_DIR`]). The one place the
    /// folder is spelled: every reader and writer of an item's documents goes through it.
    pub fn artifact_dir(&self) -> String {
        format!("{}/{}", crate::protect::WORK_ITEMS_DIR, self.0)
    }

    /// The relative path of one of the work item's artifacts:
    /// `docs/work-items/<id>/<artifact>`.
    pub fn artifact_path(&self, artifact: &ArtifactName) -> String {
        format!("{}/{}", self.artifact_dir(), artifact)
    }
}

// ---------------------------------------------------------------------------------------------

/// A repo name as declared in `orch.toml`: `[a-z0-9][a-z0-9._-]{0,63}`, never containing `..`.
/// It names a folder under `repos_dir`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RepoName(String);

fn check_repo_name(s: &str) -> Result<(), IdError> {
    const KIND: &str = "repo name";
    reject_hostile(KIND, s, 64)?;
    if s.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(err(KIND, s, "must be lower case"));
    }
    if !s.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit()) {
        return Err(err(KIND, s, "must start with a-z or 0-9"));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-')))
    {
        return Err(err(
            KIND,
            s,
            format!("contains {c:?}; only a-z, 0-9, `.`, `_` and `-` are allowed"),
        ));
    }
    Ok(())
}

string_newtype!(RepoName, check_repo_name);

// ---------------------------------------------------------------------------------------------

/// A pipeline stage name, kebab-case (`analysis`, `post-deploy`), at most 32 characters.
/// The terminal stages are `done`, `failed` and `cancelled`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StageName(String);

fn check_stage_name(s: &str) -> Result<(), IdError> {
    check_kebab("stage name", s, 32)
}

string_newtype!(StageName, check_stage_name);

impl StageName {
    /// The terminal stage of a work item that went through the whole pipeline.
    pub fn done() -> StageName {
        StageName(crate::control::DONE.to_owned())
    }

    /// The terminal stage of a work item that could not be completed.
    pub fn failed() -> StageName {
        StageName(crate::control::FAILED.to_owned())
    }

    /// The terminal stage of a work item cancelled by a person.
    pub fn cancelled() -> StageName {
        StageName(crate::control::CANCELLED.to_owned())
    }

    /// Whether this is `done`, `failed` or `cancelled`.
    pub fn is_terminal(&self) -> bool {
        crate::control::is_terminal_stage(&self.0)
    }
}

// ---------------------------------------------------------------------------------------------

/// An agent (job kind) name, kebab-case (`developer`, `merge-gate`, `post-deploy-monitor`),
/// at most 64 characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AgentName(String);

fn check_agent_name(s: &str) -> Result<(), IdError> {
    check_kebab("agent name", s, 64)
}

string_newtype!(AgentName, check_agent_name);

// ---------------------------------------------------------------------------------------------

/// An artifact file name `NN-name.md`: two digits, a dash, `[a-z0-9-]+`, `.md`
/// (e.g. `02-requirements.md`, `07-adr-foo.md`); at most 128 characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ArtifactName(String);

fn check_artifact_name(s: &str) -> Result<(), IdError> {
    const KIND: &str = "artifact name";
    reject_hostile(KIND, s, 128)?;
    let shape = "expected `NN-name.md`, e.g. `02-requirements.md`";
    let b = s.as_bytes();
    if b.len() < 2 || !b[0].is_ascii_digit() || !b[1].is_ascii_digit() {
        return Err(err(KIND, s, format!("{shape}: must start with two digits")));
    }
    let Some(rest) = s[2..].strip_prefix('-') else {
        return Err(err(
            KIND,
            s,
            format!("{shape}: a `-` must follow the digits"),
        ));
    };
    let Some(stem) = rest.strip_suffix(".md") else {
        return Err(err(KIND, s, format!("{shape}: must end with `.md`")));
    };
    if stem.is_empty() {
        return Err(err(KIND, s, format!("{shape}: the name is empty")));
    }
    if let Some(c) = stem
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Err(err(
            KIND,
            s,
            format!("contains {c:?}; the name allows only a-z, 0-9 and `-`"),
        ));
    }
    Ok(())
}

string_newtype!(ArtifactName, check_artifact_name);

impl ArtifactName {
    /// The two-digit number that orders artifacts (`2` for `02-requirements.md`).
    pub fn number(&self) -> u8 {
        self.0[..2].parse().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses `input` as `T` and compares the outcome with `expect`: `Ok(text)` for the
    /// displayed value, `Err(fragment)` for a fragment of the error message.
    fn check<T>(input: &str, expect: Result<&str, &str>)
    where
        T: FromStr<Err = IdError> + fmt::Display + serde::de::DeserializeOwned,
    {
        let got = input.parse::<T>();
        match (&got, expect) {
            (Ok(v), Ok(text)) => assert_eq!(v.to_string(), text, "input {input:?}"),
            (Err(e), Err(fragment)) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(fragment),
                    "input {input:?}: error {msg:?} lacks {fragment:?}"
                );
            }
            (got, expect) => panic!(
                "input {input:?}: got {:?}, expected {expect:?}",
                got.as_ref().map(|v| v.to_string())
            ),
        }
        // Deserializing validates exactly like parsing.
        let json = serde_json::to_string(input).unwrap();
        let de = serde_json::from_str::<T>(&json);
        assert_eq!(de.is_ok(), got.is_ok(), "serde disagrees on {input:?}");
    }

    #[test]
    fn work_item_ids() {
        let long = format!("{}-1", "A".repeat(17));
        let cases: &[(&str, Result<&str, &str>)] = &[
            ("ORCH-115", Ok("ORCH-115")),
            ("A-1", Ok("A-1")),
            ("X9-42", Ok("X9-42")),
            (
                "ABCDEFGHIJKLMNOP-18446744073709551615",
                Ok("ABCDEFGHIJKLMNOP-18446744073709551615"),
            ),
            ("../../x", Err("contains a path separator")),
            ("..", Err("contains `..`")),
            ("ORCH-1/..", Err("path separator")),
            ("ORCH-1\\x", Err("path separator")),
            ("ORCH-1\0", Err("NUL")),
            ("ORCH- 1", Err("whitespace")),
            ("ORCH-1\n", Err("whitespace")),
            (" ORCH-1", Err("whitespace")),
            ("orch-1", Err("must be upper case")),
            ("Orch-1", Err("must be upper case")),
            ("ORCH-0", Err("positive")),
            ("ORCH-01", Err("leading zeros")),
            ("ORCH-", Err("missing")),
            ("ORCH", Err("expected `<PREFIX>-<number>`")),
            ("-1", Err("is empty")),
            ("1ORCH-1", Err("must start with a letter")),
            ("OR_CH-1", Err("only A-Z and 0-9")),
            ("ORCH-1a", Err("not a number")),
            ("ORCH--1", Err("only A-Z and 0-9")),
            ("ORCH-+1", Err("not a number")),
            ("ORCH-18446744073709551616", Err("too large")),
            (&long, Err("limit is 16")),
            ("", Err("is empty")),
            ("ORCH-١", Err("non-ASCII")),
        ];
        for (input, expect) in cases {
            check::<WorkItemId>(input, *expect);
        }
        let too_long = format!("ORCH-1{}", "0".repeat(70));
        check::<WorkItemId>(&too_long, Err("limit is 64"));
    }

    #[test]
    fn work_item_id_parts() {
        let id: WorkItemId = "ORCH-115".parse().unwrap();
        assert_eq!(id.prefix().as_str(), "ORCH");
        assert_eq!(id.number(), 115);
        assert_eq!(id.branch_name(), "orch/ORCH-115");
        assert_eq!(id.artifact_dir(), "docs/work-items/ORCH-115");
        let name: ArtifactName = "15-staging-log.md".parse().unwrap();
        assert_eq!(
            id.artifact_path(&name),
            "docs/work-items/ORCH-115/15-staging-log.md"
        );
        let prefix: Prefix = "AB12".parse().unwrap();
        assert_eq!(WorkItemId::new(&prefix, 7).unwrap().as_str(), "AB12-7");
        assert!(WorkItemId::new(&prefix, 0).is_err());
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"ORCH-115\"");
    }

    #[test]
    fn long_hostile_input_is_cut_in_the_message() {
        let input = "/".repeat(1000);
        let e = input.parse::<WorkItemId>().unwrap_err();
        assert!(e.to_string().len() < 200, "{e}");
    }

    #[test]
    fn prefixes() {
        let cases: &[(&str, Result<&str, &str>)] = &[
            ("ORCH", Ok("ORCH")),
            ("A", Ok("A")),
            ("ABCDEFGHIJKLMNOP", Ok("ABCDEFGHIJKLMNOP")),
            ("ABCDEFGHIJKLMNOPQ", Err("limit is 16")),
            ("orch", Err("upper case")),
            ("9A", Err("start with a letter")),
            ("A-B", Err("only A-Z and 0-9")),
            ("../A", Err("path separator")),
            ("", Err("empty")),
        ];
        for (input, expect) in cases {
            check::<Prefix>(input, *expect);
        }
    }

    #[test]
    fn repo_names() {
        let max = "a".repeat(64);
        let over = "a".repeat(65);
        let cases: &[(&str, Result<&str, &str>)] = &[
            ("orch", Ok("orch")),
            ("my-app.v2_x", Ok("my-app.v2_x")),
            ("0day", Ok("0day")),
            (&max, Ok(&max)),
            (&over, Err("limit is 64")),
            ("a..b", Err("`..`")),
            ("..", Err("`..`")),
            ("../etc", Err("path separator")),
            (".hidden", Err("must start with a-z or 0-9")),
            ("-x", Err("must start with a-z or 0-9")),
            ("App", Err("lower case")),
            ("a b", Err("whitespace")),
            ("a:b", Err("only a-z")),
            ("", Err("empty")),
        ];
        for (input, expect) in cases {
            check::<RepoName>(input, *expect);
        }
    }

    #[test]
    fn stage_and_agent_names() {
        let cases: &[(&str, Result<&str, &str>)] = &[
            ("analysis", Ok("analysis")),
            ("post-deploy", Ok("post-deploy")),
            ("stage2", Ok("stage2")),
            ("Analysis", Err("lower case")),
            ("2nd", Err("start with a letter")),
            ("a_b", Err("only a-z, 0-9 and `-`")),
            ("a-", Err("kebab")),
            ("a--b", Err("kebab")),
            ("../x", Err("path separator")),
            ("", Err("empty")),
        ];
        for (input, expect) in cases {
            check::<StageName>(input, *expect);
            check::<AgentName>(input, *expect);
        }
        check::<StageName>(&"a".repeat(33), Err("limit is 32"));
        check::<AgentName>("post-deploy-monitor", Ok("post-deploy-monitor"));
        assert!(StageName::done().is_terminal());
        assert!(StageName::failed().is_terminal());
        assert!(StageName::cancelled().is_terminal());
        assert!(!"review".parse::<StageName>().unwrap().is_terminal());
    }

    #[test]
    fn artifact_names() {
        let cases: &[(&str, Result<&str, &str>)] = &[
            ("02-requirements.md", Ok("02-requirements.md")),
            ("07-adr-foo.md", Ok("07-adr-foo.md")),
            ("15-staging-log.md", Ok("15-staging-log.md")),
            ("99-x.md", Ok("99-x.md")),
            ("2-requirements.md", Err("two digits")),
            ("002-x.md", Err("a `-` must follow")),
            ("02_requirements.md", Err("a `-` must follow")),
            ("02-requirements.txt", Err("must end with `.md`")),
            ("02-.md", Err("name is empty")),
            ("02-Requirements.md", Err("only a-z, 0-9 and `-`")),
            ("02-a.b.md", Err("only a-z, 0-9 and `-`")),
            ("../02-x.md", Err("path separator")),
            ("02-x.md/..", Err("path separator")),
            ("02-x..md", Err("`..`")),
            ("02-x.md\0", Err("NUL")),
            ("", Err("empty")),
        ];
        for (input, expect) in cases {
            check::<ArtifactName>(input, *expect);
        }
        let name: ArtifactName = "07-adr-foo.md".parse().unwrap();
        assert_eq!(name.number(), 7);
    }
}
