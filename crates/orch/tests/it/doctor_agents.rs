//! `orch doctor` per agent tells the truth about what a run will meet: the key variable is set,
//! the endpoint answers, the CLI starts and reports a version orch was tested with. Each
//! problem is a FAIL (or, for a version newer than the newest tested, a WARN) that names its
//! fix.
//! The CLIs are small scripts that print a version the way the real ones do (`2.1.197 (Claude
//! Code)`, `codex-cli 0.171.0`, `aider 0.86.2`); the endpoint is a real listening socket or a
//! port nothing listens on.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Output;

const ORCH: &str = env!("CARGO_BIN_EXE_orch");
/// A variable no test environment sets.
const UNSET: &str = "ORCH_DOCTOR_TEST_UNSET_KEY_7F3A";
/// One this test sets for `orch doctor`.
const SET: &str = "ORCH_DOCTOR_TEST_KEY";

fn orch(dir: &Path, args: &[&str]) -> Output {
    std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(args)
        .env(SET, "sk-doctor-test")
        .env_remove(UNSET)
        .current_dir(dir)
        .output()
        .expect("run orch")
}

/// A fake CLI at `dir/name` that prints `version` for `--version`.
fn fake_cli(dir: &Path, name: &str, version: &str) -> String {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!("#!/bin/sh\n[ \"$1\" = --version ] && echo '{version}' && exit 0\nexit 2\n"),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.display().to_string()
}

/// The report's line for agent `name`'s check containing `what`, and the line after it.
fn line<'a>(report: &'a str, prefix: &str, what: &str) -> (&'a str, &'a str) {
    let lines: Vec<&str> = report.lines().collect();
    let i = lines
        .iter()
        .position(|l| l.starts_with(prefix) && l.contains(what))
        .unwrap_or_else(|| panic!("no `{prefix}… {what}` line in:\n{report}"));
    (lines[i], lines.get(i + 1).copied().unwrap_or_default())
}

#[test]
fn doctor_fails_each_agent_problem_with_its_fix_and_warns_outside_the_tested_versions() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let out = orch(d, &["init"]);
    assert!(out.status.success(), "{out:?}");
    // A listening endpoint (it answers whatever it is asked) and a port nothing listens on.
    let listening = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let up = listening.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        for mut c in listening.incoming().flatten() {
            let mut b = [0u8; 1024];
            let _ = c.read(&mut b);
            let _ = c.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let current = fake_cli(d, "claude-current", "2.1.197 (Claude Code)");
    let old = fake_cli(d, "claude-old", "1.0.3 (Claude Code)");
    let new = fake_cli(d, "codex-new", "codex-cli 9.0.0");
    let agents = format!(
        "[agents.analyst]\nbackend = \"claude\"\ncommand = \"{current}\"\napi_key_env = \"{UNSET}\"\n\
         endpoint = \"http://127.0.0.1:{up}\"\n\n\
         [agents.architect]\nbackend = \"claude\"\ncommand = \"{current}\"\napi_key_env = \"{SET}\"\n\
         endpoint = \"http://127.0.0.1:{down}\"\n\n\
         [agents.developer]\nbackend = \"claude\"\ncommand = \"{}/no-such-claude\"\napi_key_env = \"{SET}\"\n\n\
         [agents.reviewer]\nbackend = \"claude\"\ncommand = \"{old}\"\napi_key_env = \"{SET}\"\n\n\
         [agents.helper]\nbackend = \"codex\"\ncommand = \"{new}\"\n\n",
        d.display()
    );
    let config = std::fs::read_to_string(d.join("orch.toml")).unwrap();
    let cut = config
        .find("[agents.analyst]")
        .expect("the template declares agents");
    let rest = &config[cut..];
    // Keep what follows the template's agents (if anything) after ours.
    let after = rest
        .match_indices("\n[")
        .map(|(i, _)| &rest[i + 1..])
        .find(|s| !s.starts_with("[agents."))
        .unwrap_or("");
    std::fs::write(
        d.join("orch.toml"),
        format!("{}{agents}{after}", &config[..cut]),
    )
    .unwrap();

    let out = orch(d, &["doctor"]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "{report}");
    assert!(
        !report.contains("everything orch needs is here"),
        "{report}"
    );

    // An unset key variable: a FAIL naming it, with what to set.
    let (l, fix) = line(
        &report,
        "FAIL",
        &format!("agent analyst: API key variable {UNSET}"),
    );
    assert!(l.contains("is not set"), "{l}");
    assert!(
        fix.contains("fix:")
            && fix.contains(&format!("export {UNSET}="))
            && fix.contains("api_key_env"),
        "{fix}"
    );
    // The set one passes; the listening endpoint answers.
    line(
        &report,
        "ok",
        &format!("agent architect: API key variable {SET} is set"),
    );
    line(
        &report,
        "ok",
        &format!("agent analyst: endpoint http://127.0.0.1:{up} answers"),
    );
    // An endpoint nothing listens on.
    let (_, fix) = line(
        &report,
        "FAIL",
        &format!("agent architect: endpoint http://127.0.0.1:{down} does not answer"),
    );
    assert!(
        fix.contains("fix:") && fix.contains("[agents.architect] endpoint"),
        "{fix}"
    );
    // A missing CLI.
    let (_, fix) = line(&report, "FAIL", "agent developer: ");
    assert!(
        report.contains("no-such-claude does not exist") && fix.contains("install"),
        "{report}"
    );
    // The tested version passes; an older one fails (orch may misread what it prints, and an
    // upgrade is the fix) and a newer one warns, each with the tested range.
    line(
        &report,
        "ok",
        "agent analyst: claude 2.1.197 (tested: 2.1.197 to",
    );
    let (_, fix) = line(
        &report,
        "FAIL",
        "agent reviewer: claude 1.0.3 is older than the oldest tested (2.1.197)",
    );
    assert!(fix.contains("upgrade claude"), "{fix}");
    line(
        &report,
        "WARN",
        "agent helper: codex 9.0.0 is newer than the newest tested",
    );
    // No api_key_env at all: the CLI would get no key.
    let (_, fix) = line(&report, "FAIL", "agent helper: no api_key_env");
    assert!(fix.contains("set api_key_env"), "{fix}");
}
