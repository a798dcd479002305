//! `orch replay`, the real binary, over the real demo (a git repository, SQLite, the scripted
//! agent, a real service): every recorded decision of its items replays in agreement with
//! today's rules; one threshold changed flips exactly the one watch verdict it should; bad
//! `--set` input and a missing clone give clear answers, never a panic.

use crate::common;

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use common::{ORCH, become_subreaper, python_available, reap_orphans, skip, stop_service};
use serde_json::Value;

fn orch(dir: &Path, args: &[&str]) -> Output {
    std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(args)
        .env("ORCH_LOG", "warn")
        .env_remove("ORCH_DATABASE_URL")
        .stdin(Stdio::null())
        .output()
        .expect("run orch")
}

/// `orch --json replay …`: exit code and document.
fn replay_json(dir: &Path, args: &[&str]) -> (Option<i32>, Value) {
    let out = orch(dir, &[&["--json", "replay"][..], args].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let doc = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "replay {args:?}: not JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), doc)
}

fn decisions(doc: &Value) -> Vec<&Value> {
    doc["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|i| i["decisions"].as_array().into_iter().flatten())
        .collect()
}

fn not_agreeing(doc: &Value) -> Vec<String> {
    decisions(doc)
        .into_iter()
        .filter(|d| d["agreement"] != "agrees")
        .map(|d| d.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_agrees_with_the_demo_and_a_threshold_flips_one_verdict() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let out = tokio::time::timeout(
        Duration::from_secs(400),
        tokio::process::Command::new(ORCH)
            .args(["demo", "--dir"])
            .arg(&dir)
            .env("ORCH_LOG", "warn")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the demo finishes within 400 s")
    .expect("run orch demo");
    stop_service(&dir);
    reap_orphans();
    assert!(
        out.status.success(),
        "demo failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Every item of the demo, one by one and as a range: all agree, nothing unreplayable.
    let (code, all) = replay_json(&dir, &["--repo", "service", "--since", "1d"]);
    assert_eq!(code, Some(0), "{all}");
    let items: Vec<&str> = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["work_item_id"].as_str().unwrap())
        .collect();
    // The two items that run the whole pipeline, and the one the demo cancels early.
    assert_eq!(items.len(), 3, "the demo's items: {all}");
    assert!(not_agreeing(&all).is_empty(), "{:#?}", not_agreeing(&all));
    let kinds: std::collections::BTreeSet<&str> = decisions(&all)
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["gate", "route", "staging", "watch"].into_iter().collect(),
        "every kind of decision is replayed: {all}"
    );
    let s = &all["summary"];
    assert_eq!(s["watches"], 2, "{s}");
    assert_eq!(
        s["rollbacks_recorded"], 1,
        "the demo rolls one item back: {s}"
    );
    assert_eq!(s["rollbacks_replayed"], 1, "{s}");
    for id in &items {
        let (code, one) = replay_json(&dir, &[id]);
        assert_eq!(code, Some(0), "{one}");
        assert!(not_agreeing(&one).is_empty(), "{id}: {one}");
        let out = orch(&dir, &["replay", id]);
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{table}");
        assert!(
            table.contains("0 differ, 0 cannot be replayed"),
            "{id}: {table}"
        );
    }

    // The healthy watch ended on 8 PASS polls of 8: needing 9 trailing PASS polls makes it
    // DEGRADED, and that is the only decision that changes (the FAILED watch stays FAILED).
    let (code, flipped) = replay_json(
        &dir,
        &[
            "--repo",
            "service",
            "--since",
            "1d",
            "--set",
            "post_deploy.healthy_last_valid_pass=9",
        ],
    );
    assert_eq!(
        code,
        Some(0),
        "a difference asked for with --set is no failure"
    );
    assert_eq!(
        flipped["overrides"]["post_deploy.healthy_last_valid_pass"],
        9
    );
    let diff: Vec<&Value> = decisions(&flipped)
        .into_iter()
        .filter(|d| d["agreement"] != "agrees")
        .collect();
    assert_eq!(diff.len(), 1, "{diff:#?}");
    assert_eq!(diff[0]["kind"], "watch");
    assert_eq!(diff[0]["recorded"], "HEALTHY");
    assert_eq!(diff[0]["replayed"], "DEGRADED");
    let s = &flipped["summary"];
    assert_eq!(
        (&s["differ"], &s["rollbacks_avoided"], &s["rollbacks_added"]),
        (&1.into(), &0.into(), &0.into()),
        "{s}"
    );

    // The rolled-back watch FAILED on 3 consecutive FAIL polls; at 4 it would have watched on,
    // and what it would have seen is not recorded: undecided, its rollback undetermined.
    let (_, longer) = replay_json(
        &dir,
        &[
            "--repo",
            "service",
            "--set",
            "post_deploy.consecutive_fail_limit=4",
        ],
    );
    let diff: Vec<&Value> = decisions(&longer)
        .into_iter()
        .filter(|d| d["agreement"] != "agrees")
        .collect();
    assert_eq!(diff.len(), 1, "{diff:#?}");
    assert_eq!(
        (&diff[0]["recorded"], &diff[0]["replayed"]),
        (&"FAILED".into(), &"undecided".into())
    );
    assert_eq!(longer["summary"]["rollbacks_undetermined"], 1);
    let out = orch(
        &dir,
        &[
            "replay",
            "--repo",
            "service",
            "--set",
            "post_deploy.consecutive_fail_limit=4",
        ],
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("rollbacks recorded 1"), "{table}");
    assert!(table.contains("1 undetermined"), "{table}");

    // Bad input: exit 2 naming what is wrong; an unknown item is 66.
    for (args, says) in [
        (
            &["replay", items[0], "--set", "post_deploy.nope=1"][..],
            "unknown key `post_deploy.nope`",
        ),
        (
            &[
                "replay",
                items[0],
                "--set",
                "post_deploy.failure_limit=lots",
            ][..],
            "`lots` is not valid",
        ),
        (
            &["replay", items[0], "--set", "failure_limit"][..],
            "not key=value",
        ),
        (&["replay", "../etc"][..], ""),
    ] {
        let out = orch(&dir, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(says) || args[1] == "../etc",
            "{args:?}: {stderr}"
        );
    }
    let out = orch(&dir, &["replay", "APP-999"]);
    assert_eq!(
        out.status.code(),
        Some(66),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // orch's clone gone: what needs the artifacts cannot be replayed, and says why; no panic,
    // and no decision is claimed to differ.
    let clone = dir.join(".orch").join("repos").join("service");
    assert!(
        clone.join(".git").exists(),
        "the demo's clone: {}",
        clone.display()
    );
    let aside = dir.join(".orch").join("repos").join("service-aside");
    std::fs::rename(&clone, &aside).unwrap();
    let (code, gone) = replay_json(&dir, &[items[0]]);
    std::fs::rename(&aside, &clone).unwrap();
    assert_eq!(code, Some(0), "{gone}");
    let cannot: Vec<&Value> = decisions(&gone)
        .into_iter()
        .filter(|d| d["agreement"] == "cannot replay")
        .collect();
    assert!(!cannot.is_empty(), "{gone}");
    assert!(
        cannot.iter().all(|d| d["replayed"]
            .as_str()
            .unwrap()
            .contains("orch's clone is not at")),
        "{cannot:#?}"
    );
    assert_eq!(gone["summary"]["differ"], 0, "{gone}");
}
