//! `orch report`, the real binary, over a history seeded through the store (the figures worked
//! by hand in `orch_store::testing::report_history`), on SQLite and PostgreSQL: `--json` is
//! the API's document with the hand-computed figures; the table names them; bad input is
//! exit 2 with a message saying what was wrong.

use std::process::{Output, Stdio};

use orch_store::testing::{TestDb, report_history, seed_item};
use serde_json::Value;

const ORCH: &str = env!("CARGO_BIN_EXE_orch");

fn orch(url: &str, args: &[&str]) -> Output {
    let dir = tempfile::tempdir().expect("a temp dir");
    std::process::Command::new(ORCH)
        .current_dir(dir.path())
        .args(args)
        .env("ORCH_DATABASE_URL", url)
        .env_remove("ORCH_CONFIG")
        .env("ORCH_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run orch")
}

async fn report_over_a_seeded_history(db: TestDb) {
    for item in report_history(1_796_083_200_000) {
        seed_item(&db.store, &db.clock, "REP", &item).await.unwrap();
    }
    let range = ["--since", "2026-12-01", "--until", "2026-12-11"];
    let out = orch(&db.url, &[&["report", "--json"][..], &range[..]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(&stdout).expect("JSON");
    let dora = &r["overall"]["dora"];
    assert_eq!(dora["deploys"], 4);
    assert_eq!(dora["deploys_per_day"], 0.4);
    assert_eq!(dora["change_failure_rate"], 0.5);
    assert_eq!(
        dora["lead_time_from_submission"]["median_ms"],
        4 * 3_600_000
    );
    assert_eq!(dora["lead_time_from_first_commit"]["p90_ms"], 5 * 3_600_000);
    assert_eq!(dora["time_to_restore"]["mean_ms"], 45 * 60_000);
    assert_eq!(r["overall"]["items"]["agent_runs_per_shipped"], 2.0);
    assert_eq!(r["overall"]["items"]["review_loops_per_shipped"], 0.5);
    assert_eq!(r["overall"]["staging"]["change_failures"], 1);
    assert_eq!(r["overall"]["release_wait"]["total_ms"], 3_600_000);

    let out = orch(
        &db.url,
        &[&["report", "--repo", "b"][..], &range[..]].concat(),
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    for line in [
        "deploys per day",
        "change failure rate",
        "0.0% (0 of 1)",
        "claude",
        "Where time goes",
        "Per week (Monday, UTC):",
        "2026-12-07",
    ] {
        assert!(table.contains(line), "{line:?} missing from:\n{table}");
    }

    for (args, says) in [
        (&["report", "--since", "last tuesday"][..], "is not a time"),
        (
            &["report", "--since", "2026-12-02", "--until", "2026-12-01"][..],
            "the range is empty",
        ),
        (&["report", "--repo", "../etc"][..], "repo:"),
    ] {
        let out = orch(&db.url, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_report_over_a_seeded_history() {
    report_over_a_seeded_history(TestDb::sqlite().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_report_over_a_seeded_history() {
    report_over_a_seeded_history(TestDb::postgres().await).await;
}
