//! The repository keeps the architecture's invariants (see `orch_tidy` for the rules and the
//! few exceptions). A failure names the file, the line and the rule.

use std::path::Path;

#[test]
fn the_tree_is_tidy() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let report = match orch_tidy::check_tree(&root) {
        Ok(r) => r,
        Err(e) => panic!("cannot read the tree at {}: {e}", root.display()),
    };
    assert!(report.files > 100, "read only {} files", report.files);
    let mut problems: Vec<String> = report.violations.iter().map(|v| v.to_string()).collect();
    problems.extend(report.stale.iter().map(|e| {
        format!(
            "stale exception [{}] {}: nothing matches it any more; delete it from EXCEPTIONS",
            e.rule, e.path
        )
    }));
    assert!(
        problems.is_empty(),
        "{} tidy problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}
