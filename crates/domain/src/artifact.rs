//! Artifacts: the numbered Markdown files with YAML frontmatter that every stage leaves in
//! `docs/work-items/<id>/`, and that gates read to decide the next stage.
//!
//! The frontmatter block is split off by hand (so the body's bytes are kept exactly, CRLF
//! included) and parsed with serde-saphyr into an ordered map. Duplicate keys are an error, never
//! "last one wins": a gate must not read a status that a later line silently replaced.
//! [`Artifact::render`] quotes whatever YAML would otherwise reinterpret, so parsing what was
//! rendered gives back the same artifact.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::options::{DuplicateKeyPolicy, MergeKeyPolicy, NonFiniteFloatPolicy};

/// The keys every artifact's frontmatter must have (design.md §3).
pub const REQUIRED_KEYS: [&str; 6] = [
    "work_item",
    "stage",
    "author_agent",
    "status",
    "created_at",
    "model_used",
];

/// The `model_used` value deterministic producers write.
pub const MODEL_NOT_APPLICABLE: &str = "n/a";

/// A frontmatter value: a scalar, or a nested list or map kept as a generic value.
///
/// Non-finite floats are read back as the strings `.nan`, `.inf`, `-.inf`; integers beyond
/// `i64` are read as floats.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `null`, `~` or an empty value.
    Null,
    /// `true` / `false` (YAML 1.2 spellings only; `yes` is the string "yes").
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A floating point number.
    Float(f64),
    /// A string.
    String(String),
    /// A list.
    Seq(Vec<Value>),
    /// A map, in the order its keys were written.
    Map(Vec<(String, Value)>),
}

impl Value {
    /// The string, if this is a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// A short name of the value's kind, for error messages ("a string", "a list", ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a float",
            Value::String(_) => "a string",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a map",
        }
    }
}

/// Renders the value as YAML (flow style for lists and maps), as [`Artifact::render`] writes it.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::new();
        render_value(&mut out, self);
        f.write_str(&out)
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::String(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::String(s)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Value {
        Value::Bool(b)
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Value {
        Value::Int(n)
    }
}

impl From<u32> for Value {
    fn from(n: u32) -> Value {
        Value::Int(i64::from(n))
    }
}

impl From<f64> for Value {
    fn from(x: f64) -> Value {
        Value::Float(x)
    }
}

/// The frontmatter of an artifact: keys in the order they were written, each at most once.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Frontmatter {
    entries: Vec<(String, Value)>,
}

impl Frontmatter {
    /// An empty frontmatter.
    pub fn new() -> Frontmatter {
        Frontmatter::default()
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The value of `key` if it is present and a string (`status: 1` is not a string).
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Sets `key` to `value`: a new key goes last, an existing key keeps its place and its old
    /// value is returned.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Option<Value> {
        let key = key.into();
        let value = value.into();
        match self.entries.iter_mut().find(|(k, _)| *k == key) {
            Some((_, old)) => Some(std::mem::replace(old, value)),
            None => {
                self.entries.push((key, value));
                None
            }
        }
    }

    /// The entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The [`REQUIRED_KEYS`] that are missing, in their canonical order.
    pub fn missing_required_keys(&self) -> Vec<&'static str> {
        REQUIRED_KEYS
            .iter()
            .copied()
            .filter(|k| !self.contains_key(k))
            .collect()
    }
}

/// An artifact file: frontmatter and the Markdown body after it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Artifact {
    /// The parsed frontmatter block.
    pub frontmatter: Frontmatter,
    /// Everything after the closing `---` line, byte for byte.
    pub body: String,
}

/// Why a text is not a valid artifact. Line numbers count from 1 at the file's first line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArtifactError {
    /// The text does not open with a `---` line.
    #[error("no frontmatter: the first line must be `---`")]
    NoFrontmatter,
    /// The opening `---` has no closing `---` line.
    #[error("unterminated frontmatter: the `---` on line 1 has no closing `---` line")]
    Unterminated,
    /// The block between the `---` lines is not valid YAML.
    #[error("invalid frontmatter YAML: {message}{}", line_unless_said(message, *.line))]
    Yaml {
        /// The file line of the error, when known.
        line: Option<u64>,
        /// What the YAML parser said.
        message: String,
    },
    /// A key appears twice.
    #[error("duplicate frontmatter key `{key}`{}", at_line(*.line))]
    DuplicateKey {
        /// The repeated key.
        key: String,
        /// The file line of the second occurrence, when known.
        line: Option<u64>,
    },
    /// The YAML is valid but is not a mapping (e.g. a list or a bare string).
    #[error("frontmatter must be a mapping of keys to values, found {found}")]
    NotAMap {
        /// What was found instead.
        found: &'static str,
    },
}

fn at_line(line: Option<u64>) -> String {
    line.map_or_else(String::new, |l| format!(" at line {l}"))
}

/// The parser's messages usually say the line themselves; add it only when they don't.
fn line_unless_said(message: &str, line: Option<u64>) -> String {
    if message.contains(" line ") {
        String::new()
    } else {
        at_line(line)
    }
}

impl Artifact {
    /// An artifact with the given frontmatter and body.
    pub fn new(frontmatter: Frontmatter, body: impl Into<String>) -> Artifact {
        Artifact {
            frontmatter,
            body: body.into(),
        }
    }

    /// Parses an artifact: a `---` line, YAML mapping, a `---` line, then the body.
    /// Lines may end in LF or CRLF; the body is kept exactly as written.
    pub fn parse(text: &str) -> Result<Artifact, ArtifactError> {
        let (yaml, body) = split(text)?;
        let frontmatter = parse_yaml(yaml)?;
        Ok(Artifact {
            frontmatter,
            body: body.to_owned(),
        })
    }

    /// Renders the artifact; [`Artifact::parse`] of the result gives back `self` (keys in
    /// order, every string exactly, the body byte for byte).
    pub fn render(&self) -> String {
        let mut out = String::from("---\n");
        for (key, value) in &self.frontmatter.entries {
            render_str(&mut out, key);
            out.push(':');
            if !matches!(value, Value::Null) {
                out.push(' ');
                render_value(&mut out, value);
            }
            out.push('\n');
        }
        out.push_str("---\n");
        out.push_str(&self.body);
        out
    }
}

/// Splits `text` into the YAML between the `---` lines and the body after them.
fn split(text: &str) -> Result<(&str, &str), ArtifactError> {
    let rest = text
        .strip_prefix("---\n")
        .or_else(|| text.strip_prefix("---\r\n"))
        .ok_or(if text == "---" {
            ArtifactError::Unterminated
        } else {
            ArtifactError::NoFrontmatter
        })?;
    let mut offset = 0;
    while offset <= rest.len() {
        let line_end = rest[offset..].find('\n').map(|i| offset + i);
        let line = &rest[offset..line_end.unwrap_or(rest.len())];
        if line.strip_suffix('\r').unwrap_or(line) == "---" {
            let body_start = line_end.map_or(rest.len(), |i| i + 1);
            return Ok((&rest[..offset], &rest[body_start..]));
        }
        match line_end {
            Some(i) => offset = i + 1,
            None => break,
        }
    }
    Err(ArtifactError::Unterminated)
}

/// How the YAML parser is set up for frontmatter: duplicates are errors, no merge keys, YAML 1.2
/// booleans only, and number-like text that would lose its spelling (`0755`, `1_000`) kept as
/// a string.
fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        duplicate_keys: DuplicateKeyPolicy::Error,
        merge_keys: MergeKeyPolicy::AsOrdinary,
        strict_booleans: true,
        null_as_string: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
        non_finite_float_policy: NonFiniteFloatPolicy::AsString,
        with_snippet: false,
    }
}

/// The frontmatter's first YAML line is line 2 of the file.
const YAML_LINE_OFFSET: u64 = 1;

fn parse_yaml(yaml: &str) -> Result<Frontmatter, ArtifactError> {
    let blank = yaml.lines().all(|l| {
        let t = l.trim();
        t.is_empty() || t.starts_with('#')
    });
    if blank {
        return Ok(Frontmatter::new());
    }
    let value: Value =
        serde_saphyr::from_str_with_options(yaml, yaml_options()).map_err(yaml_error)?;
    match value {
        Value::Map(entries) => Ok(Frontmatter { entries }),
        Value::Null => Ok(Frontmatter::new()),
        other => Err(ArtifactError::NotAMap {
            found: other.kind(),
        }),
    }
}

fn yaml_error(e: serde_saphyr::Error) -> ArtifactError {
    let line = e
        .location()
        .map(|l| l.line())
        .filter(|l| *l > 0)
        .map(|l| l + YAML_LINE_OFFSET);
    if let serde_saphyr::Error::DuplicateMappingKey { key, .. } = &e {
        return ArtifactError::DuplicateKey {
            key: key.clone().unwrap_or_else(|| "?".to_owned()),
            line,
        };
    }
    let message = e.render_with_options(serde_saphyr::render_options! {
        snippets: serde_saphyr::SnippetMode::Off,
        line_offset: YAML_LINE_OFFSET,
    });
    ArtifactError::Yaml { line, message }
}

// --- reading ---------------------------------------------------------------------------------

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a YAML value")
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Int(n))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(i64::try_from(n).map_or(Value::Float(n as f64), Value::Int))
    }

    fn visit_f64<E>(self, x: f64) -> Result<Value, E> {
        Ok(Value::Float(x))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Seq(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries: Vec<(String, Value)> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            if entries.iter().any(|(k, _)| *k == key) {
                // The parser already rejects duplicates; this keeps the map honest regardless.
                return Err(de::Error::custom(format!("duplicate key `{key}`")));
            }
            let value = map.next_value()?;
            entries.push((key, value));
        }
        Ok(Value::Map(entries))
    }
}

// --- writing ---------------------------------------------------------------------------------

/// YAML 1.1 words that some readers take as booleans or null even though orch reads YAML 1.2;
/// they are quoted so every reader sees a string.
const RESERVED_WORDS: [&str; 9] = ["y", "n", "yes", "no", "on", "off", "true", "false", "null"];

/// Whether `s` can be written as a plain scalar and read back as the same string by any YAML
/// reader: a letter, then letters, digits, `_`, `.`, `/`, `-`, and not a reserved word.
fn is_plain_safe(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-'))
        && !RESERVED_WORDS.contains(&s.to_ascii_lowercase().as_str())
}

/// `s` as a YAML scalar: plain when no reader can take it for anything but that string
/// (`SUCCESS`, `n/a`, `staging-runner`, `ORCH-115`), otherwise double-quoted with escapes. The
/// one YAML string writer: artifacts' frontmatter (here and in `staging::render_frontmatter`).
pub fn yaml_scalar(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    render_str(&mut out, s);
    out
}

fn render_str(out: &mut String, s: &str) {
    if is_plain_safe(s) {
        out.push_str(s);
        return;
    }
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\0' => out.push_str("\\0"),
            c if is_yaml_printable(c) => out.push(c),
            c => {
                let n = u32::from(c);
                if n <= 0xFF {
                    out.push_str(&format!("\\x{n:02X}"));
                } else if n <= 0xFFFF {
                    out.push_str(&format!("\\u{n:04X}"));
                } else {
                    out.push_str(&format!("\\U{n:08X}"));
                }
            }
        }
    }
    out.push('"');
}

/// Characters written as themselves inside a double-quoted scalar: YAML's printable set minus
/// the byte order mark and the characters YAML 1.1 treats as line breaks.
fn is_yaml_printable(c: char) -> bool {
    matches!(u32::from(c),
        0x20..=0x7E | 0xA0..=0x2027 | 0x202A..=0xD7FF | 0xE000..=0xFEFE | 0xFF00..=0xFFFD
        | 0x10000..=0x10FFFF)
}

fn render_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Int(n) => out.push_str(&n.to_string()),
        Value::Float(x) => render_float(out, *x),
        Value::String(s) => render_str(out, s),
        Value::Seq(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                render_value(out, item);
            }
            out.push(']');
        }
        Value::Map(entries) => {
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                render_str(out, k);
                out.push_str(": ");
                render_value(out, v);
            }
            out.push('}');
        }
    }
}

fn render_float(out: &mut String, x: f64) {
    if x.is_nan() {
        out.push_str(".nan");
    } else if x.is_infinite() {
        out.push_str(if x > 0.0 { ".inf" } else { "-.inf" });
    } else {
        // Debug is the shortest text that reads back as the same f64, and always has a `.`
        // or an exponent, so it is never taken for an integer.
        out.push_str(&format!("{x:?}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Parses `input` and compares with `expect`: `Ok((keys and rendered values, body))` or
    /// `Err(fragment of the error message)`.
    /// Expected outcome of a parse: `Ok((entries as rendered, body))` or `Err(message fragment)`.
    type Expect<'a> = Result<(&'a [(&'a str, &'a str)], &'a str), &'a str>;

    fn check(input: &str, expect: Expect<'_>) {
        let got = Artifact::parse(input);
        match (&got, expect) {
            (Ok(a), Ok((entries, body))) => {
                let got_entries: Vec<(String, String)> = a
                    .frontmatter
                    .iter()
                    .map(|(k, v)| (k.to_owned(), v.to_string()))
                    .collect();
                let want: Vec<(String, String)> = entries
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect();
                assert_eq!(got_entries, want, "input {input:?}");
                assert_eq!(a.body, body, "input {input:?}");
                // Whatever parsed renders back to something that parses the same.
                assert_eq!(Artifact::parse(&a.render()).as_ref(), Ok(a));
            }
            (Err(e), Err(fragment)) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(fragment),
                    "input {input:?}: {msg:?} lacks {fragment:?}"
                );
            }
            (got, expect) => panic!("input {input:?}: got {got:?}, expected {expect:?}"),
        }
    }

    #[test]
    fn parse_cases() {
        let seed = "---\nwork_item: ORCH-115\nstage: architecture\nauthor_agent: architect\n\
                    status: proposed\ncreated_at: 2026-06-16\nmodel_used: claude-opus-4-8\n---\n\n# 08\n";
        check(
            seed,
            Ok((
                &[
                    ("work_item", "ORCH-115"),
                    ("stage", "architecture"),
                    ("author_agent", "architect"),
                    ("status", "proposed"),
                    ("created_at", "\"2026-06-16\""),
                    ("model_used", "claude-opus-4-8"),
                ],
                "\n# 08\n",
            )),
        );
        let cases: &[(&str, Expect<'_>)] = &[
            ("# title\nno frontmatter\n", Err("no frontmatter")),
            ("", Err("no frontmatter")),
            (" ---\na: 1\n---\n", Err("no frontmatter")),
            ("---", Err("unterminated")),
            ("---\na: 1\n", Err("unterminated")),
            ("---\na: 1\n--- \nbody", Err("unterminated")),
            ("---\n- a\n- b\n---\n", Err("found a list")),
            ("---\njust text\n---\n", Err("found a string")),
            (
                "---\na: 1\nb: 2\na: 3\n---\n",
                Err("duplicate frontmatter key `a` at line 4"),
            ),
            (
                "---\nstatus: x\nnested: {k: 1, k: 2}\n---\n",
                Err("duplicate frontmatter key `k` at line 3"),
            ),
            ("---\na: [1, 2\n---\n", Err("invalid frontmatter YAML")),
            ("---\na: 1\n---\n", Ok((&[("a", "1")], ""))),
            ("---\na: 1\n---", Ok((&[("a", "1")], ""))),
            ("---\n---\n", Ok((&[], ""))),
            ("---\n# only a comment\n---\nbody\n", Ok((&[], "body\n"))),
            (
                "---\na: x\n---\nintro\n---\nmore\n---\n",
                Ok((&[("a", "x")], "intro\n---\nmore\n---\n")),
            ),
            (
                "---\r\nstatus: APPROVED\r\n---\r\nline1\r\nline2",
                Ok((&[("status", "APPROVED")], "line1\r\nline2")),
            ),
            (
                "---\nb: yes\nn: null\ne:\nt: true\nf: 1.5\no: 0755\nq: 'it''s'\n---\n",
                Ok((
                    &[
                        ("b", "\"yes\""),
                        ("n", "null"),
                        ("e", "null"),
                        ("t", "true"),
                        ("f", "1.5"),
                        ("o", "\"0755\""),
                        ("q", "\"it's\""),
                    ],
                    "",
                )),
            ),
            (
                "---\nlist: [a, 2]\nmap:\n  x: 1\n  y: [z]\n---\n",
                Ok((&[("list", "[a, 2]"), ("map", "{x: 1, \"y\": [z]}")], "")),
            ),
        ];
        for (input, expect) in cases {
            check(input, *expect);
        }
    }

    #[test]
    fn yaml_errors_name_the_file_line() {
        let e = Artifact::parse("---\na: 1\nb: [\n---\n").unwrap_err();
        match e {
            ArtifactError::Yaml { line, .. } => assert!(line.is_some_and(|l| l >= 3), "{line:?}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn frontmatter_accessors() {
        let mut fm = Frontmatter::new();
        assert_eq!(fm.insert("status", "APPROVED"), None);
        fm.insert("attempt", 2u32);
        assert_eq!(
            fm.insert("status", "CHANGES_REQUESTED"),
            Some(Value::from("APPROVED"))
        );
        assert_eq!(fm.get_str("status"), Some("CHANGES_REQUESTED"));
        assert_eq!(fm.get_str("attempt"), None);
        assert_eq!(fm.get("attempt"), Some(&Value::Int(2)));
        let keys: Vec<&str> = fm.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["status", "attempt"]);
        assert_eq!(
            fm.missing_required_keys(),
            [
                "work_item",
                "stage",
                "author_agent",
                "created_at",
                "model_used"
            ]
        );
    }

    #[test]
    fn render_quotes_what_yaml_would_reinterpret() {
        let mut fm = Frontmatter::new();
        for (k, v) in [
            ("a", "yes"),
            ("b", "1"),
            ("c", "null"),
            ("d", ":"),
            ("e", "#"),
            ("f", "  lead"),
            ("g", "two\nlines"),
            ("h", "ünïcødé ✓"),
            ("i", "ORCH-115"),
            ("j", ""),
            ("k", "\u{FEFF}bom\u{85}\u{2028}"),
        ] {
            fm.insert(k, v);
        }
        let a = Artifact::new(fm, "body\n");
        let text = a.render();
        assert!(text.contains("\na: \"yes\"\n"), "{text}");
        assert!(text.contains("\ni: ORCH-115\n"), "{text}");
        assert!(text.contains("\ng: \"two\\nlines\"\n"), "{text}");
        assert_eq!(Artifact::parse(&text), Ok(a));
    }

    fn scalar() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::Int),
            any::<f64>()
                .prop_filter("finite", |x| x.is_finite())
                .prop_map(Value::Float),
            any::<String>().prop_map(Value::String),
            prop::sample::select(vec![
                "yes",
                "No",
                "1",
                "-0",
                "0x1F",
                "1e3",
                "null",
                "~",
                ":",
                "#",
                "- a",
                "? x",
                "&a",
                "*a",
                "!tag",
                "|",
                ">",
                "'",
                "\"",
                "%",
                "@",
                "`",
                "[",
                "{",
                "<<",
                "---",
                "...",
                " lead",
                "trail ",
                "a: b",
                "a #b",
                ".nan",
                ".inf",
                "2026-06-16",
            ])
            .prop_map(Value::from),
        ]
    }

    fn value() -> impl Strategy<Value = Value> {
        scalar().prop_recursive(2, 12, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Seq),
                prop::collection::vec((any::<String>(), inner), 0..4).prop_map(|kvs| {
                    let mut seen = std::collections::HashSet::new();
                    Value::Map(
                        kvs.into_iter()
                            .filter(|(k, _)| seen.insert(k.clone()))
                            .collect(),
                    )
                }),
            ]
        })
    }

    fn artifact() -> impl Strategy<Value = Artifact> {
        (
            prop::collection::vec((any::<String>(), value()), 0..8),
            any::<String>(),
        )
            .prop_map(|(entries, body)| {
                let mut fm = Frontmatter::new();
                for (k, v) in entries {
                    fm.insert(k, v);
                }
                Artifact::new(fm, body)
            })
    }

    proptest! {
        #![proptest_config(crate::proptest_config(1024))]

        #[test]
        fn render_then_parse_is_identity(a in artifact()) {
            let text = a.render();
            prop_assert_eq!(Artifact::parse(&text), Ok(a), "rendered:\n{}", text);
        }

        #[test]
        fn parse_never_panics(text in "(---\r?\n)?[ -~\n\r\t]{0,200}(\n---\n)?[ -~\n]{0,40}") {
            let _ = Artifact::parse(&text);
        }
    }
}
