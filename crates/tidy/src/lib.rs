//! The architecture's invariants, checked as text over the repository (in the manner of
//! rust-analyzer's `tidy.rs`). `tests/tidy.rs` runs [`check_tree`] on the checkout; the unit
//! tests below plant a violation of every rule and watch it fail.
//!
//! The rules (a line that matches is a violation unless an [`EXCEPTIONS`] entry covers it):
//!
//! - **`sql`**: SQL lives in `crates/store` only. Elsewhere, no `.rs` line (shipped code or
//!   tests) uses a `sqlx` path or holds an SQL statement (upper-case `SELECT … FROM`,
//!   `INSERT INTO`, `UPDATE … SET`, `DELETE FROM`, `CREATE TABLE|INDEX`, `ALTER TABLE`,
//!   `DROP TABLE`), no `Cargo.toml` depends on `sqlx`, and there is no `.sql` file.
//! - **`spawn`**: processes are started in `crates/exec` only. Elsewhere, *shipped* code (a
//!   crate's `src/`, up to its `#[cfg(test)] mod …`) names no `std::process::Command`,
//!   `tokio::process`, `Command::new(`, `libc::fork|kill|killpg|exec…|posix_spawn` or
//!   `nix::unistd::fork`. Tests may start processes: the project's standard is that tests run
//!   real child processes (the `orch` binary, git).
//! - **`wire-json`**: orch's wire (what its HTTP API answers and what `orch --json` prints) is
//!   shaped in `crates/api` only. Checked as: no shipped code outside `crates/api` names
//!   `axum` (so nothing else can answer HTTP), and the binary crate `crates/orch/src`, the other
//!   place that faces users, builds no JSON itself (no `json!`, no `Serialize` derive or impl):
//!   it prints the API's DTOs. JSON that other crates build is not wire and is allowed: the
//!   runner's event `data`, job payloads and the store's migration records are *storage*: a
//!   record kept in a column, read back by orch; the API passes an event's `data` through only
//!   as one opaque field of its own `EventDto`, whose envelope and names are the API's. Sentinel
//!   files in `crates/deploystate` are storage too, and request bodies for another service's API
//!   (OpenAI, alert webhooks) are that service's wire.
//! - **`test-support`**: no shipped crate takes test support as a normal dependency: in a
//!   crate's `Cargo.toml`, the `testing` feature appears only under `[dev-dependencies]` (the
//!   benchmarks, which are not shipped, are the exception).
//! - **`shared-seeds`**: no file points at the `shared` folder beside the checkout (the
//!   `SHARED` pattern): the repository explains itself (docs/design.md holds the seed
//!   contracts).
//! - **`machine-path`**: no file carries an absolute path of a machine (under the work, home or
//!   root directories, `MACHINE_ROOTS`); examples use `/tmp`, `~` or relative paths.
//! - **`control-words`**: the strings orch stores and reads back to decide (event kinds, job
//!   markers) are spelled once, in `crates/domain/src/control.rs` (`CONTROL`). Elsewhere, no
//!   shipped code line (comments aside) holds a string literal equal to a known event kind (the
//!   `pub const NAME: &str = "group.name";` lines of that file, read from the tree) or one that
//!   starts a marker (`"[orch:`). Tests may spell them: they check the stored contract.
//! - **`print-boundary`**: the binary prints through its output module only
//!   (`crates/orch/src/output.rs`), which strips terminal control sequences from what agents
//!   and users wrote. Elsewhere in `crates/orch/src`, shipped code (comments aside) uses no
//!   printing macro (`println!`, `print!`, `eprintln!`, `eprint!`) and takes no
//!   `std::io::stdout()`/`stderr()` handle (asking whether one is a terminal aside).
//! - **`domain-pure`**: `crates/domain` decides from its arguments alone: its shipped code
//!   (comments aside) touches no file, socket, process, environment variable or clock (no
//!   `std::fs`, `File::`, `std::process`, `env::var`, `SystemTime`, `Instant::now`, `::now(`,
//!   `TcpStream`/`TcpListener`/`UdpSocket`, `thread::sleep`, `std::io::stdin`, printing), and
//!   its manifest's `[dependencies]` name no runtime, HTTP, database, clock or randomness crate
//!   (`IMPURE_CRATES`). Time comes in as an argument; that is what lets `orch replay` re-derive a
//!   decision and tests pin the clock.
//! - **`engine-layering`**: the pipeline engine knows no particular stage. No line of
//!   `crates/runner/src/engine/` (code, comments and tests alike: a doc link is an arrow too)
//!   refers to the deploy tail or the release train (`crate::deploy`, `crate::release`, a
//!   `super::` path to them, or a `use crate::{…}` list naming them): the engine reads a
//!   stage's descriptor and asks its executor, and those modules plug in as executors
//!   (`crates/runner/src/catalogue.rs`), never the other way round.
//! - **`payload-keys`**: the keys of the events that decide an item's outcome are read
//!   through their types. Outside `crates/domain/src/payload.rs` (`PAYLOAD`), no shipped code
//!   line (comments aside) reads the key `from`, `to`, `outcome`, `settled`, `attempted`,
//!   `verified` or `tried` of a JSON value by name (`["from"]`, `get("to")`,
//!   `field(e, "outcome")`, `s("from")`): the event data that carries them (stage changes, the
//!   node takeover, the skipped deploy, rollback results, production's settlement) is read as
//!   `payload::StageChange`, `NodeTakeover`, `DeploySkipped`, `RollbackResult`,
//!   `ProductionChecked`, so a reader cannot ask for a key no writer writes.
//!
//! An exception that no longer matches anything is itself a failure, so the list only shrinks.

use std::fmt;
use std::path::{Path, PathBuf};

/// A permitted violation: `rule` (`"*"`: every rule) in files whose repository path starts
/// with `path`.
#[derive(Debug, Clone, Copy)]
pub struct Exception {
    pub rule: &'static str,
    pub path: &'static str,
    pub reason: &'static str,
}

/// Every exception, with its reason. Keep this short.
pub const EXCEPTIONS: &[Exception] = &[
    Exception {
        rule: "*",
        path: "crates/tidy/src/lib.rs",
        reason: "the checker names the patterns it looks for, in its documentation and code",
    },
    Exception {
        rule: "sql",
        path: "crates/bench/src/pgbench.rs",
        reason: "the same-run pgbench baseline is raw SQL on a scratch table by design (it \
                 measures the database, not orch); the benchmarks are not shipped",
    },
    Exception {
        rule: "sql",
        path: "crates/bench/src/history.rs",
        reason: "the history benchmark applies the README's per-table autovacuum settings to a \
                 scratch schema to measure them (what an operator would type); the benchmarks \
                 are not shipped",
    },
    Exception {
        rule: "test-support",
        path: "crates/bench/Cargo.toml",
        reason: "the benchmarks create scratch PostgreSQL schemas with the store's test support; \
                 they are not shipped",
    },
    Exception {
        rule: "spawn",
        path: "crates/bench/src/",
        reason: "the benchmarks start the orch binary under measurement and pgbench as real \
                 processes; they are not shipped",
    },
    Exception {
        rule: "wire-json",
        path: "crates/modelserver/src/",
        reason: "the scripted stand-in for a hosted model speaks the providers' wire formats \
                 (Anthropic Messages, OpenAI Responses and chat completions), not orch's; it \
                 serves tests and the demo only",
    },
    Exception {
        rule: "wire-json",
        path: "crates/orch/src/reload.rs",
        reason: "the running config's state file under .orch/run (read back by `orch status`) \
                 is storage, not wire",
    },
    Exception {
        rule: "wire-json",
        path: "crates/orch/src/demo/agent.rs",
        reason: "the demo's scripted agent prints what a model CLI prints: another program's \
                 output format, not orch's wire",
    },
    Exception {
        rule: "print-boundary",
        path: "crates/orch/src/demo/agent.rs",
        reason: "the demo's scripted agent prints a model CLI's JSON result for the orch that \
                 runs it, not for a terminal",
    },
    Exception {
        rule: "print-boundary",
        path: "crates/orch/src/demo/claude.rs",
        reason: "the scripted model server prints its own URL for the process that started it",
    },
    Exception {
        rule: "print-boundary",
        path: "crates/orch/src/main.rs",
        reason: "the log writer (tracing-subscriber escapes control characters in the fields \
                 it formats)",
    },
];

/// One offending line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub rule: &'static str,
    /// Repository path, `/`-separated.
    pub path: String,
    /// 1-based; 0 for a whole file.
    pub line: usize,
    pub text: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] {}:{}: {}",
            self.rule,
            self.path,
            self.line,
            self.text.trim()
        )
    }
}

/// What a run over a tree found.
#[derive(Debug, Default)]
pub struct Report {
    /// Violations no exception covers.
    pub violations: Vec<Violation>,
    /// Exceptions that covered nothing.
    pub stale: Vec<Exception>,
    pub files: usize,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.violations.is_empty() && self.stale.is_empty()
    }
}

// The patterns are assembled from pieces so that this file does not match its own rules.
const SQLX_PATH: &str = concat!("sql", "x::");
const SPAWN_PATTERNS: &[&str] = &[
    concat!("std::process::", "Command"),
    concat!("process::", "Command"),
    concat!("tokio::", "process"),
    concat!("Command::", "new("),
    concat!("libc::", "fork"),
    concat!("libc::", "kill"),
    concat!("libc::", "exec"),
    concat!("libc::", "posix_spawn"),
    concat!("nix::unistd::", "fork"),
];
const SHARED: &str = concat!("..", "/shared");
const MACHINE_ROOTS: &[&str] = &[
    concat!("/wo", "rk/"),
    concat!("/ho", "me/"),
    concat!("/ro", "ot/"),
    concat!("/Use", "rs/"),
];

/// What `crates/domain`'s shipped code may not touch (the `domain-pure` rule).
const IMPURE_PATTERNS: &[&str] = &[
    concat!("std::", "fs"),
    concat!("fs::", "read"),
    concat!("fs::", "write"),
    concat!("File", "::"),
    concat!("std::", "process"),
    concat!("env::", "var"),
    concat!("System", "Time"),
    concat!("Instant::", "now"),
    concat!("::now", "("),
    concat!("Tcp", "Stream"),
    concat!("Tcp", "Listener"),
    concat!("Udp", "Socket"),
    concat!("thread::", "sleep"),
    concat!("io::", "stdin"),
    concat!("print", "ln!"),
    concat!("eprint", "ln!"),
];
/// Crates `crates/domain` may not depend on: runtimes, HTTP, databases, clocks, randomness.
const IMPURE_CRATES: &[&str] = &[
    "tokio",
    "reqwest",
    "hyper",
    "axum",
    "sqlx",
    "chrono",
    "time",
    "rand",
    "nix",
    "libc",
    "getrandom",
];

/// The file that spells every control word (see the `control-words` rule).
pub const CONTROL: &str = "crates/domain/src/control.rs";
const MARKER_LITERAL: &str = concat!("\"[or", "ch:");
/// The ways to print around `crates/orch/src/output.rs` (the `print-boundary` rule).
const PRINT_PATTERNS: &[&str] = &[
    concat!("print", "ln!("),
    concat!("print", "!("),
    concat!("io::std", "out()"),
    concat!("io::std", "err()"),
];
/// The binary's output module, where printing happens.
const OUTPUT: &str = "crates/orch/src/output.rs";
/// The typed event data (the `payload-keys` rule).
pub const PAYLOAD: &str = "crates/domain/src/payload.rs";
/// The keys read only through [`PAYLOAD`]'s types.
const PAYLOAD_KEYS: &[&str] = &[
    "from",
    "to",
    "outcome",
    "settled",
    "attempted",
    "verified",
    "tried",
];
/// The pipeline engine's folder (the `engine-layering` rule).
pub const ENGINE: &str = "crates/runner/src/engine/";
/// The modules the engine may not refer to: the deploy tail and the release train.
const ABOVE_ENGINE: &[&str] = &["deploy", "release"];

/// The event kinds [`CONTROL`] defines: the values of its `pub const NAME: &str = "a.b";`
/// lines (a dotted lower-case word; the terminal stages have no dot).
pub fn event_kinds(control: &str) -> Vec<String> {
    control
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("pub const ")?;
            let (_, value) = rest.split_once(": &str = \"")?;
            let kind = value.strip_suffix("\";")?;
            let (group, name) = kind.split_once('.')?;
            let word =
                |w: &str| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            (word(group) && word(name)).then(|| kind.to_owned())
        })
        .collect()
}

/// The violations of one file's text (`path` is its repository path, `/`-separated), with no
/// event kinds known (see [`check_file_with`]).
pub fn check_file(path: &str, text: &str) -> Vec<Violation> {
    check_file_with(path, text, &[])
}

/// [`check_file`], with the event kinds of [`CONTROL`] for the `control-words` rule.
pub fn check_file_with(path: &str, text: &str, kinds: &[String]) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut push = |rule: &'static str, line: usize, text: &str| {
        out.push(Violation {
            rule,
            path: path.to_owned(),
            line,
            text: text.chars().take(160).collect(),
        })
    };
    let in_crate = |name: &str| path.starts_with(&format!("crates/{name}/"));
    let is_rs = path.ends_with(".rs");
    let shipped_end = if is_rs && is_shipped_source(path) {
        shipped_lines(text)
    } else {
        0
    };
    if path.ends_with(".sql") && !in_crate("store") {
        push("sql", 0, "an SQL file outside crates/store");
    }
    let is_manifest = path.ends_with("Cargo.toml");
    let mut section = String::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if is_manifest && line.starts_with('[') {
            section = line.trim().to_owned();
        }
        if is_manifest
            && section != "[dev-dependencies]"
            && line.contains(concat!("\"test", "ing\""))
            && line.contains("features")
        {
            push("test-support", n, line);
        }
        let shipped = n <= shipped_end;
        if line.contains(SHARED) {
            push("shared-seeds", n, line);
        }
        if has_machine_path(line) {
            push("machine-path", n, line);
        }
        if !in_crate("store") {
            if is_rs && (line.contains(SQLX_PATH) || has_sql_statement(line)) {
                push("sql", n, line);
            }
            // A crate's manifest (the workspace root only declares versions).
            if is_manifest
                && path != "Cargo.toml"
                && line.trim_start().starts_with(concat!("sql", "x"))
            {
                push("sql", n, line);
            }
        }
        if shipped && !in_crate("exec") && SPAWN_PATTERNS.iter().any(|p| line.contains(p)) {
            push("spawn", n, line);
        }
        let names_axum = line.contains(concat!("axum", "::"));
        let shapes_json = line.contains(concat!("json", "!(")) || names_serialize(line);
        if shipped && !in_crate("api") && (names_axum || (in_crate("orch") && shapes_json)) {
            push("wire-json", n, line);
        }
        if shipped
            && in_crate("orch")
            && path != OUTPUT
            && !line.trim_start().starts_with("//")
            && PRINT_PATTERNS.iter().any(|p| line.contains(p))
            && !line.contains(concat!(".is_", "terminal()"))
        {
            push("print-boundary", n, line);
        }
        if shipped
            && in_crate("domain")
            && !line.trim_start().starts_with("//")
            && IMPURE_PATTERNS.iter().any(|p| line.contains(p))
        {
            push("domain-pure", n, line);
        }
        if is_manifest
            && path == "crates/domain/Cargo.toml"
            && section == "[dependencies]"
            && IMPURE_CRATES.iter().any(|c| {
                line.trim_start()
                    .strip_prefix(c)
                    .is_some_and(|rest| rest.trim_start().starts_with(['=', '.']))
            })
        {
            push("domain-pure", n, line);
        }
        if path.starts_with(ENGINE) && is_rs && refers_above_engine(line) {
            push("engine-layering", n, line);
        }
        if shipped
            && path != PAYLOAD
            && !line.trim_start().starts_with("//")
            && reads_payload_key(line)
        {
            push("payload-keys", n, line);
        }
        if shipped
            && path != CONTROL
            && !line.trim_start().starts_with("//")
            && (line.contains(MARKER_LITERAL)
                || kinds.iter().any(|k| line.contains(&format!("\"{k}\""))))
        {
            push("control-words", n, line);
        }
    }
    out
}

/// `crates/<name>/src/…`: code that ships (its unit tests excepted, see [`shipped_lines`]).
fn is_shipped_source(path: &str) -> bool {
    let mut parts = path.split('/');
    parts.next() == Some("crates") && parts.next().is_some() && parts.next() == Some("src")
}

/// How many leading lines of a source file ship: up to a top-level `#[cfg(test)]` that is
/// followed by a `mod` (the unit tests), else all of them.
fn shipped_lines(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim_end() == "#[cfg(test)]"
            && lines[i + 1..]
                .iter()
                .find(|l| !l.trim().is_empty() && !l.starts_with("#["))
                .is_some_and(|l| l.starts_with("mod ") || l.starts_with("pub mod "))
        {
            return i;
        }
    }
    lines.len()
}

/// Whether an engine line names a module the engine may not depend on: a `crate::` or
/// `super::` path to it, or a `use crate::{…}` list that names it.
fn refers_above_engine(line: &str) -> bool {
    ABOVE_ENGINE.iter().any(|m| {
        let word_at = |at: usize| {
            let after = line[at + m.len()..].chars().next();
            !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
        };
        let path = |prefix: &str| {
            line.match_indices(&format!("{prefix}{m}"))
                .any(|(at, _)| word_at(at + prefix.len()))
        };
        let listed = line.contains("crate::{")
            && line.match_indices(m).any(|(at, _)| {
                let before = line[..at].chars().next_back();
                matches!(before, Some('{' | ' ' | ',')) && word_at(at)
            });
        path("crate::") || path("super::") || listed
    })
}

/// Whether a line reads one of [`PAYLOAD_KEYS`] by name: indexes a value with it (`["from"]`)
/// or passes it as the last argument of a call (`get("to")`, `field(e, "outcome")`).
fn reads_payload_key(line: &str) -> bool {
    PAYLOAD_KEYS.iter().any(|k| {
        [("[", "]"), ("(", ")"), (", ", ")")]
            .iter()
            .any(|(open, close)| line.contains(&format!("{open}\"{k}\"{close}")))
    })
}

fn has_sql_statement(line: &str) -> bool {
    let has = |s: &str| line.contains(s);
    (has("SELECT ") && has(" FROM "))
        || has("INSERT INTO ")
        || (has("UPDATE ") && has(" SET "))
        || has("DELETE FROM ")
        || has("CREATE TABLE")
        || has("CREATE INDEX")
        || has("ALTER TABLE")
        || has("DROP TABLE")
}

/// A `Serialize` derive or impl (the word, not "Serializes").
fn names_serialize(line: &str) -> bool {
    let word = concat!("Serial", "ize");
    line.match_indices(word).any(|(at, _)| {
        let after = line[at + word.len()..].chars().next();
        !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

fn has_machine_path(line: &str) -> bool {
    MACHINE_ROOTS.iter().any(|root| {
        line.match_indices(root).any(|(at, _)| {
            // An absolute path starts the line or follows a separator, not a word or `.`/`~`.
            let before = line[..at].chars().next_back();
            !before.is_some_and(|c| c.is_alphanumeric() || "._~-".contains(c))
        })
    })
}

/// Runs every rule over the files below `root`, then applies [`EXCEPTIONS`].
pub fn check_tree(root: &Path) -> std::io::Result<Report> {
    check_tree_with(root, EXCEPTIONS)
}

pub fn check_tree_with(root: &Path, exceptions: &[Exception]) -> std::io::Result<Report> {
    let mut files = Vec::new();
    walk(root, root, &mut files)?;
    let mut report = Report {
        files: files.len(),
        ..Report::default()
    };
    let mut used = vec![false; exceptions.len()];
    let kinds = event_kinds(&std::fs::read_to_string(root.join(CONTROL)).unwrap_or_default());
    if kinds.is_empty() {
        report.violations.push(Violation {
            rule: "control-words",
            path: CONTROL.to_owned(),
            line: 0,
            text: "no event kinds found: the file moved or their constants changed shape".into(),
        });
    }
    for (rel, abs) in files {
        let Ok(bytes) = std::fs::read(&abs) else {
            continue;
        };
        let Ok(text) = String::from_utf8(bytes) else {
            continue; // not text
        };
        for v in check_file_with(&rel, &text, &kinds) {
            match exceptions
                .iter()
                .position(|e| (e.rule == v.rule || e.rule == "*") && v.path.starts_with(e.path))
            {
                Some(i) => used[i] = true,
                None => report.violations.push(v),
            }
        }
    }
    report.stale = exceptions
        .iter()
        .zip(used)
        .filter(|(_, used)| !used)
        .map(|(e, _)| *e)
        .collect();
    Ok(report)
}

/// Every file below `dir` except version control, build output and dependencies.
fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) -> std::io::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let path = entry.path();
        let ty = entry.file_type()?;
        if ty.is_symlink() {
            continue;
        }
        if ty.is_dir() {
            if matches!(name.as_ref(), ".git" | "target" | "node_modules") {
                continue;
            }
            walk(root, &path, out)?;
        } else if ty.is_file() && name != ".git" {
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push((rel, path));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(path: &str, text: &str) -> Vec<&'static str> {
        check_file(path, text).into_iter().map(|v| v.rule).collect()
    }

    // Planted strings are assembled at run time so that this file stays clean.
    fn planted(parts: &[&str]) -> String {
        parts.concat()
    }

    #[test]
    fn sql_outside_the_store_is_caught() {
        let sqlx = planted(&["let n = sql", "x::query(\"x\");"]);
        assert_eq!(rules("crates/runner/src/ops.rs", &sqlx), ["sql"]);
        assert_eq!(
            rules("crates/orch/tests/it/cli.rs", &sqlx),
            ["sql"],
            "tests too"
        );
        assert!(rules("crates/store/src/db.rs", &sqlx).is_empty());
        for stmt in [
            planted(&["\"SEL", "ECT id FROM jobs\""]),
            planted(&["\"INS", "ERT INTO tasks (a) VALUES (1)\""]),
            planted(&["\"UPD", "ATE jobs SET state = 1\""]),
            planted(&["\"DEL", "ETE FROM jobs\""]),
        ] {
            assert_eq!(rules("crates/api/src/x.rs", &stmt), ["sql"], "{stmt}");
        }
        let dep = planted(&["sql", "x = { workspace = true }"]);
        assert_eq!(rules("crates/runner/Cargo.toml", &dep), ["sql"]);
        assert!(
            rules("Cargo.toml", &dep).is_empty(),
            "the workspace declares versions"
        );
        assert_eq!(rules("crates/runner/x.sql", "select 1;"), ["sql"]);
        // Prose and lower case are not statements.
        assert!(rules("crates/api/src/x.rs", "// select a row from the list").is_empty());
        assert!(rules("crates/orch/src/main.rs", "\"debug,sqlx=warn\"").is_empty());
    }

    #[test]
    fn io_and_clocks_in_domain_are_caught() {
        for line in [
            planted(&["let t = std::time::System", "Time::now();"]),
            planted(&["let s = std::f", "s::read_to_string(p)?;"]),
            planted(&["let v = std::env::v", "ar(\"HOME\");"]),
            planted(&["let c = std::net::Tcp", "Stream::connect(a)?;"]),
            planted(&["let n = Instant::n", "ow();"]),
            planted(&["std::thread::sl", "eep(d);"]),
        ] {
            assert_eq!(
                rules("crates/domain/src/monitor.rs", &line),
                ["domain-pure"],
                "{line}"
            );
            assert!(
                !rules("crates/runner/src/time.rs", &line).contains(&"domain-pure"),
                "other crates may: {line}"
            );
        }
        // Parsing an address is pure; prose about the clock is not code.
        assert!(rules("crates/domain/src/net.rs", "s.parse::<std::net::IpAddr>()").is_empty());
        assert!(
            rules(
                "crates/domain/src/x.rs",
                "// never reads the clock: now( is an argument"
            )
            .is_empty()
        );
        // Its unit tests may do what they like.
        let text = planted(&[
            "fn f() {}\n#[cfg(test)]\nmod tests {\n    fn t() { std::f",
            "s::read(\"x\"); }\n}\n",
        ]);
        assert!(rules("crates/domain/src/x.rs", &text).is_empty());
        // Its manifest takes no runtime, clock or randomness.
        let manifest = |dep: &str| format!("[dependencies]\nserde.workspace = true\n{dep}\n");
        for dep in [
            "tokio.workspace = true",
            "chrono = \"0.4\"",
            "rand = { version = \"0.9\" }",
        ] {
            assert_eq!(
                rules("crates/domain/Cargo.toml", &manifest(dep)),
                ["domain-pure"],
                "{dep}"
            );
        }
        assert!(
            rules(
                "crates/domain/Cargo.toml",
                "[dev-dependencies]\ntokio.workspace = true\n"
            )
            .is_empty()
        );
        assert!(
            rules(
                "crates/domain/Cargo.toml",
                &manifest("timeout-free.workspace = true")
            )
            .is_empty()
        );
        assert!(
            rules(
                "crates/runner/Cargo.toml",
                &manifest("tokio.workspace = true")
            )
            .is_empty()
        );
    }

    #[test]
    fn spawning_outside_exec_is_caught_in_shipped_code_only() {
        for line in [
            planted(&["let c = std::process::", "Command::new(\"git\");"]),
            planted(&["use tokio::", "process;"]),
            planted(&["unsafe { libc::", "kill(pid, 15) };"]),
            planted(&["unsafe { libc::", "fork() };"]),
        ] {
            assert_eq!(rules("crates/runner/src/x.rs", &line), ["spawn"], "{line}");
            assert!(rules("crates/exec/src/process.rs", &line).is_empty());
            assert!(
                rules("crates/orch/tests/it/crash.rs", &line).is_empty(),
                "tests"
            );
        }
        // After the unit-test module, lines do not ship.
        let text = planted(&[
            "fn f() {}\n#[cfg(test)]\nmod tests {\n    use std::process::",
            "Command;\n}\n",
        ]);
        assert!(rules("crates/runner/src/x.rs", &text).is_empty());
        // A `#[cfg(test)]` on a single item does not end the shipped part.
        let text = planted(&[
            "#[cfg(test)]\nfn helper() {}\nfn g() { std::process::",
            "Command::new(\"x\"); }\n",
        ]);
        assert_eq!(rules("crates/runner/src/x.rs", &text), ["spawn"]);
    }

    #[test]
    fn wire_json_outside_the_api_is_caught() {
        let json = planted(&["let v = serde_json::", "json!({\"id\": 1});"]);
        assert_eq!(rules("crates/orch/src/cmd/tasks.rs", &json), ["wire-json"]);
        assert!(rules("crates/api/src/dto.rs", &json).is_empty());
        assert!(
            rules("crates/runner/src/deploy/lessons.rs", &json).is_empty(),
            "event data is storage"
        );
        let derive = planted(&["#[derive(Debug, serde::Serial", "ize)]"]);
        assert_eq!(rules("crates/orch/src/output.rs", &derive), ["wire-json"]);
        assert!(rules("crates/orch/src/output.rs", "// Serializes one row").is_empty());
        let axum = planted(&["use ax", "um::Json;"]);
        assert_eq!(rules("crates/runner/src/x.rs", &axum), ["wire-json"]);
        assert!(rules("crates/api/src/lib.rs", &axum).is_empty());
        assert!(rules("crates/orch/tests/it/dashboard.rs", &axum).is_empty());
    }

    #[test]
    fn test_support_only_as_a_dev_dependency() {
        let line = planted(&[
            "orch-store = { workspace = true, features = [\"test",
            "ing\"] }",
        ]);
        let normal = format!("[dependencies]\n{line}\n");
        assert_eq!(rules("crates/orch/Cargo.toml", &normal), ["test-support"]);
        let dev = format!("[dependencies]\nx = 1\n\n[dev-dependencies]\n{line}\n");
        assert!(rules("crates/orch/Cargo.toml", &dev).is_empty());
    }

    #[test]
    fn pointers_outside_and_machine_paths_are_caught() {
        let shared = planted(&["see ../sha", "red/SPEC.md"]);
        assert_eq!(rules("README.md", &shared), ["shared-seeds"]);
        assert_eq!(rules("crates/domain/src/a.rs", &shared), ["shared-seeds"]);
        for p in ["/wo", "/ho", "/ro"] {
            let line = planted(&["target-dir = \"", p, "rk/target\""]);
            let line = line.replace("/hork", "/home").replace("/rork", "/root");
            assert_eq!(
                rules(".cargo/config.toml", &line),
                ["machine-path"],
                "{line}"
            );
        }
        assert!(rules("README.md", "orch demo in /tmp/orch-demo-Xq3f").is_empty());
        assert!(rules("README.md", "see docs/work/x and ~/work/y").is_empty());
    }

    #[test]
    fn control_words_outside_their_module_are_caught_in_shipped_code() {
        let control = planted(&[
            "pub mod events {\n    pub const TASK_DONE: &str = \"task",
            ".done\";\n    pub const RELEASE_WAITING: &str = \"release",
            ".waiting\";\n}\npub const DONE: &str = \"done\";\n",
        ]);
        let kinds = event_kinds(&control);
        assert_eq!(kinds, ["task.done", "release.waiting"]);
        let rules = |path: &str, text: &str| -> Vec<&'static str> {
            check_file_with(path, text, &kinds)
                .into_iter()
                .map(|v| v.rule)
                .collect()
        };
        let kind = planted(&["if e.kind == \"release", ".waiting\" {}"]);
        assert_eq!(rules("crates/api/src/story.rs", &kind), ["control-words"]);
        let marker = planted(&["let m = format!(\"[or", "ch:release-hold seq={seq}]\");"]);
        assert_eq!(rules("crates/runner/src/x.rs", &marker), ["control-words"]);
        assert!(rules(CONTROL, &kind).is_empty(), "the one place");
        assert!(
            rules("crates/runner/tests/it/x.rs", &kind).is_empty(),
            "tests"
        );
        let in_unit_tests = format!("fn f() {{}}\n#[cfg(test)]\nmod tests {{\n{kind}\n}}\n");
        assert!(rules("crates/api/src/story.rs", &in_unit_tests).is_empty());
        let comment = planted(&["// a `\"release", ".waiting\"` event"]);
        assert!(rules("crates/api/src/story.rs", &comment).is_empty());
        // Not a known kind: failpoints, file names, prefixes.
        for other in [
            "hit(\"release.after_promote\")",
            "\"task.\"",
            "\"orch.toml\"",
        ] {
            assert!(rules("crates/runner/src/x.rs", other).is_empty(), "{other}");
        }
    }

    #[test]
    fn a_stage_change_key_read_by_name_is_caught_outside_the_payload_types() {
        for line in [
            planted(&["let from = d[\"fr", "om\"].as_str();"]),
            planted(&["e.data.get(\"fr", "om\").and_then(Value::as_str)"]),
            planted(&["let to = event_str(e, \"t", "o\");"]),
            planted(&["    from: text(\"fr", "om\"),"]),
            planted(&["match v[\"out", "come\"].as_str() {"]),
            planted(&["c[\"sett", "led\"] == json!(\"alerted\")"]),
            planted(&["e.data.get(\"veri", "fied\") == Some(&Value::Bool(true))"]),
            planted(&["event_str(e, \"attem", "pted\")"]),
        ] {
            assert_eq!(
                rules("crates/runner/src/x.rs", &line),
                ["payload-keys"],
                "{line}"
            );
            assert!(rules(PAYLOAD, &line).is_empty(), "the one place");
            let in_tests = format!("fn f() {{}}\n#[cfg(test)]\nmod tests {{\n{line}\n}}\n");
            assert!(
                rules("crates/api/src/dto.rs", &in_tests).is_empty(),
                "tests"
            );
        }
        // Writing, other keys, a key among others, prose.
        for line in [
            "f.gauge(&[(\"outcome\", outcome)], *n)?;",
            "table(&[\"id\", \"stage\", \"outcome\"], &rows)",
            "let to = d[\"total\"].as_i64();",
            "// reads `[\"from\"]` of the event",
        ] {
            assert!(rules("crates/runner/src/x.rs", line).is_empty(), "{line}");
        }
    }

    #[test]
    fn the_engine_referring_to_the_deploy_tail_or_the_release_train_is_caught() {
        let engine = |file: &str| format!("{ENGINE}{file}");
        for line in [
            planted(&["        if job.agent == crate::dep", "loy::MONITOR_AGENT {"]),
            planted(&[
                "        match crate::rel",
                "ease::promote(run, seq).await? {",
            ]),
            planted(&["use crate::rel", "ease::{self, Promotion};"]),
            planted(&["use crate::{counters::Counters, dep", "loy};"]),
            planted(&["use super::super::rel", "ease;"]),
            planted(&["/// after [`crate::rel", "ease::WAIT_S`]"]),
        ] {
            assert_eq!(
                rules(&engine("handler.rs"), &line),
                ["engine-layering"],
                "{line}"
            );
            assert_eq!(rules(&engine("guard.rs"), &line), ["engine-layering"]);
            // Its unit tests too: an arrow in a test is an arrow.
            let in_tests = format!("fn f() {{}}\n#[cfg(test)]\nmod tests {{\n{line}\n}}\n");
            assert_eq!(rules(&engine("mod.rs"), &in_tests), ["engine-layering"]);
            // The other way round is the design: the deploy tail uses the engine.
            assert!(rules("crates/runner/src/deploy/monitor.rs", &line).is_empty());
            assert!(rules("crates/runner/src/catalogue.rs", &line).is_empty());
        }
        // What only looks alike: other modules, words that start the same, prose.
        for line in [
            "use crate::repos::{self, RepoPaths};",
            "use crate::{counters::Counters, repos};",
            "let released = crate::releases_of(x);",
            "// the release train's stages are on the release track",
            "let deployer = run.stage.executor.as_str();",
        ] {
            assert!(rules(&engine("handler.rs"), line).is_empty(), "{line}");
        }
    }

    #[test]
    fn printing_around_the_output_module_is_caught_in_the_binary() {
        for line in [
            planted(&["    print", "ln!(\"{}\", task.title);"]),
            planted(&["    eprint", "ln!(\"x\");"]),
            planted(&["    print", "!(\"{table}\");"]),
            planted(&["    let _ = std::io::std", "out().write_all(b);"]),
        ] {
            assert_eq!(
                rules("crates/orch/src/cmd/tasks.rs", &line),
                ["print-boundary"],
                "{line}"
            );
            assert!(rules(OUTPUT, &line).is_empty(), "the one place");
            assert!(
                rules("crates/runner/src/x.rs", &line).is_empty(),
                "the binary only"
            );
            assert!(
                rules("crates/orch/tests/it/cli.rs", &line).is_empty(),
                "tests"
            );
        }
        let tty = planted(&["let tty = std::io::std", "out().is_terminal();"]);
        assert!(rules("crates/orch/src/demo/mod.rs", &tty).is_empty());
        let comment = planted(&["// `eprint", "ln!` panics on a closed pipe"]);
        assert!(rules("crates/orch/src/main.rs", &comment).is_empty());
    }

    #[test]
    fn exceptions_cover_their_rule_and_path_and_stale_ones_fail() {
        let dir = std::env::temp_dir().join(format!("orch-tidy-{}", std::process::id()));
        let src = dir.join("crates/orch/src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(
            src.join("a.rs"),
            planted(&["fn a() { serde_json::", "json!({}); }\n"]),
        )
        .unwrap();
        let control = dir.join(CONTROL);
        std::fs::create_dir_all(control.parent().unwrap()).unwrap();
        std::fs::write(&control, planted(&["pub const A: &str = \"a", ".b\";\n"])).unwrap();
        let covered = [Exception {
            rule: "wire-json",
            path: "crates/orch/src/a.rs",
            reason: "test",
        }];
        let report = check_tree_with(&dir, &covered).unwrap();
        assert!(report.is_clean(), "{report:?}");
        let wrong_rule = [Exception {
            rule: "sql",
            path: "crates/orch/src/a.rs",
            reason: "test",
        }];
        let report = check_tree_with(&dir, &wrong_rule).unwrap();
        assert_eq!(report.violations.len(), 1);
        assert_eq!(report.stale.len(), 1, "an exception that matches nothing");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
