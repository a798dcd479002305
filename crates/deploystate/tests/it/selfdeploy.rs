//! Self-deploy markers against real temp dirs: the INITIATED → result → clear cycle, broken
//! result files, hostile names.

use std::fs;
use std::path::Path;

use orch_deploystate::{DeployResult, DeployState, MARKER_INITIATED, RESULT_FILE};

fn result() -> DeployResult {
    DeployResult {
        success: true,
        revision: Some("abc1234".into()),
        finished_at_ms: 1_781_611_200_000,
        detail: "restarted".into(),
    }
}

/// The one place the read API is checked.
fn check(s: &DeployState, initiated: bool, result: Option<DeployResult>) {
    assert_eq!(s.has_marker(MARKER_INITIATED), initiated, "INITIATED");
    assert_eq!(s.read_result(), result, "result");
}

fn state(dir: &Path) -> DeployState {
    DeployState::new(dir, "orch", "ORCH-36")
}

#[test]
fn initiated_then_result_then_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let s = state(tmp.path());
    check(&s, false, None);
    assert!(s.write_marker(MARKER_INITIATED, "pid 42, rev abc1234"));
    check(&s, true, None);
    let dir = tmp.path().join(".deploy-state-orch/ORCH-36");
    assert_eq!(s.dir(), Some(dir.as_path()));
    assert_eq!(
        fs::read_to_string(dir.join("INITIATED")).unwrap(),
        "pid 42, rev abc1234"
    );
    assert!(s.write_result(&result()));
    check(&s, true, Some(result()));
    assert!(s.clear_state());
    check(&s, false, None);
    assert!(!tmp.path().join(".deploy-state-orch").exists());
    assert!(s.clear_state(), "clearing twice is fine");
}

#[test]
fn broken_results_read_as_unknown() {
    let tmp = tempfile::tempdir().unwrap();
    let s = state(tmp.path());
    assert!(s.write_result(&result()));
    let path = s.dir().unwrap().join(RESULT_FILE);
    let full = fs::read(&path).unwrap();
    for broken in [
        &full[..full.len() / 2],
        b"",
        b"[1,2]",
        b"{\"success\": \"yes\"}",
    ] {
        fs::write(&path, broken).unwrap();
        check(&s, false, None);
    }
    // a marker written as free text under the result's name is not a result either
    assert!(s.write_marker(RESULT_FILE, "ok"));
    check(&s, false, None);
    // a directory where the file should be
    fs::remove_file(&path).unwrap();
    fs::create_dir(&path).unwrap();
    check(&s, false, None);
    assert!(!s.write_result(&result()), "a directory is not overwritten");
    fs::create_dir(s.dir().unwrap().join(MARKER_INITIATED)).unwrap();
    check(&s, true, None);
}

#[test]
fn hostile_names_are_refused_and_touch_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    fs::create_dir(&base).unwrap();
    for (repo, id) in [
        ("orch", "../../x"),
        ("..", "ORCH-1"),
        ("orch", "a\0"),
        ("o\\r", "ORCH-1"),
    ] {
        let s = DeployState::new(&base, repo, id);
        assert!(s.dir().is_none());
        assert!(!s.write_marker(MARKER_INITIATED, "x"));
        assert!(!s.write_result(&result()));
        check(&s, false, None);
        assert!(!s.clear_state());
    }
    let s = state(&base);
    for name in ["../escape", "..", "", "a/b", "nul\0"] {
        assert!(!s.write_marker(name, "x"), "{name:?}");
        assert!(!s.has_marker(name), "{name:?}");
    }
    let top: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(top, ["base"]);
    assert_eq!(fs::read_dir(&base).unwrap().count(), 0);
}
