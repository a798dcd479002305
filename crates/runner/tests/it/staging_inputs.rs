//! The staging runner against a real staging endpoint on loopback (up, answering 5xx, refusing
//! connections, hanging) and against hostile steps (binary garbage by the megabyte, a daemon
//! left behind, a process that ignores SIGTERM); and the gate against hand-edited logs. Each
//! case has one defined outcome.

use crate::common;

use std::time::{Duration, Instant};

use orch_domain::config::StepConfig;
use orch_domain::gate::{StagingStatus, parse_staging_status};
use orch_runner::engine::{StageEffect, StageExecutor};
use orch_runner::stages::StagingExecutor;

use common::{Fixture, listen, repo_config};

const PROBE: &str = "python3 -c 'import sys,urllib.request,urllib.error\n\
try:\n    urllib.request.urlopen(sys.argv[1], timeout=30)\n    sys.exit(0)\n\
except urllib.error.HTTPError:\n    sys.exit(1)\n\
except urllib.error.URLError as e:\n    sys.exit(75 if isinstance(e.reason, ConnectionRefusedError) else 1)'";

fn step(name: &str, run: String, timeout_s: u64) -> StepConfig {
    StepConfig {
        name: name.into(),
        run,
        timeout_s,
        // The runner's classification is under test here, on the host; the sandboxed
        // steps are the demo's (crates/orch/tests).
        sandbox: false,
    }
}

enum Want {
    Log(StagingStatus, &'static str),
    Defer,
}

async fn check(
    case: &str,
    staging: Vec<StepConfig>,
    smoke: Vec<StepConfig>,
    want: Want,
) -> Fixture {
    let mut repo = repo_config("DEMO");
    repo.staging = staging;
    repo.staging_smoke = smoke;
    let f = Fixture::new("staging", "deployer", repo).await;
    let effect = StagingExecutor::new(f.counters.clone())
        .execute(&f.run)
        .await
        .unwrap();
    let log = std::fs::read_to_string(f.run.artifact_path("15-staging-log.md")).ok();
    match want {
        Want::Log(status, failure_kind) => {
            assert!(
                matches!(effect, StageEffect::Produced { .. }),
                "{case}: {effect:?}"
            );
            let log = log.unwrap_or_else(|| panic!("{case}: no log"));
            let gate = parse_staging_status(Some(&log), &f.run.work_item);
            assert!(gate.is(status), "{case}: {gate:?}\n{log}");
            assert!(
                log.contains(&format!("failure_kind: {failure_kind}")),
                "{case}:\n{log}"
            );
        }
        Want::Defer => {
            assert!(
                matches!(effect, StageEffect::Requeue { .. }),
                "{case}: {effect:?}"
            );
            assert!(log.is_none(), "{case}: a defer writes no log");
        }
    }
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_staging_endpoint_up_failing_refusing_or_hanging() {
    let app = axum::Router::new()
        .route("/up", axum::routing::get(|| async { "ok" }))
        .route(
            "/err",
            axum::routing::get(|| async {
                (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "boom")
            }),
        )
        .route(
            "/hang",
            axum::routing::get(|| async {
                tokio::time::sleep(Duration::from_secs(120)).await;
                "late"
            }),
        );
    let base = listen(app).await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let smoke =
        |url: String, timeout_s| vec![step("smoke-health", format!("{PROBE} {url}"), timeout_s)];
    check(
        "up",
        vec![],
        smoke(format!("{base}/up"), 30),
        Want::Log(StagingStatus::Success, "none"),
    )
    .await;
    check(
        "5xx",
        vec![],
        smoke(format!("{base}/err"), 30),
        Want::Log(StagingStatus::Failed, "smoke_failed"),
    )
    .await;
    check(
        "refused",
        vec![],
        smoke(format!("{closed}/up"), 30),
        Want::Defer,
    )
    .await;
    let t0 = Instant::now();
    check(
        "hanging",
        vec![],
        smoke(format!("{base}/hang"), 1),
        Want::Log(StagingStatus::Failed, "smoke_timeout"),
    )
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "a hanging check is cut at its timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_steps_have_defined_outcomes() {
    // Megabytes of binary garbage: a bounded, readable tail in a parseable log.
    let f = check(
        "garbage",
        vec![step(
            "noisy",
            "head -c 20000000 /dev/urandom; exit 3".into(),
            60,
        )],
        vec![],
        Want::Log(StagingStatus::Failed, "step_failed"),
    )
    .await;
    let log = std::fs::read_to_string(f.run.artifact_path("15-staging-log.md")).unwrap();
    assert!(
        log.len() < 200_000,
        "the log keeps a bounded tail ({} bytes)",
        log.len()
    );
    // A step that leaves a daemon behind: the step's result counts; the daemon does not outlive it.
    let secs = 3000 + std::process::id() % 997;
    let marker = format!("sleep {secs}");
    check(
        "daemon",
        vec![step("forks", format!("{marker} & echo started"), 30)],
        vec![],
        Want::Log(StagingStatus::Success, "none"),
    )
    .await;
    // The daemon is stopped with the step's group; poll (with a deadline) until it is gone.
    let t0 = Instant::now();
    loop {
        let ps = std::process::Command::new("ps")
            .args(["-eo", "args"])
            .output()
            .unwrap();
        if !String::from_utf8_lossy(&ps.stdout).contains(&marker) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the left-behind daemon was not stopped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A build step that ignores SIGTERM and hangs: killed at its timeout, infrastructure (defer).
    let t0 = Instant::now();
    check(
        "ignores-term",
        vec![step("stubborn", "trap '' TERM; sleep 120".into(), 1)],
        vec![],
        Want::Defer,
    )
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "SIGKILL follows the ignored SIGTERM"
    );
}

#[test]
fn hand_edited_staging_logs() {
    let id: orch_domain::ids::WorkItemId = "DEMO-1".parse().unwrap();
    let head = "work_item: DEMO-1\nstage: staging\nauthor_agent: staging-runner\nstatus: final\n\
                created_at: \"2026-11-29T00:00:00Z\"\nmodel_used: n/a\n";
    let doc = |status_line: &str| format!("---\n{head}{status_line}\n---\nbody\n");
    let cases: Vec<(&str, String, bool)> = vec![
        ("exact", doc("staging_status: SUCCESS"), true),
        ("lower case", doc("staging_status: success"), false),
        (
            "trailing spaces are YAML layout",
            doc("staging_status: SUCCESS   "),
            true,
        ),
        (
            "spaces inside quotes",
            doc("staging_status: \" SUCCESS\""),
            false,
        ),
        (
            "CRLF line ends",
            doc("staging_status: SUCCESS").replace('\n', "\r\n"),
            true,
        ),
        (
            "a BOM before the block",
            format!("\u{feff}{}", doc("staging_status: SUCCESS")),
            false,
        ),
        (
            "duplicate key",
            doc("staging_status: SUCCESS\nstaging_status: SUCCESS"),
            false,
        ),
        ("missing key", doc(""), false),
    ];
    for (case, text, pass) in cases {
        let gate = parse_staging_status(Some(&text), &id);
        assert_eq!(gate.is_success(), pass, "{case}: {gate:?}");
    }
    assert!(
        !parse_staging_status(None, &id).is_success(),
        "a missing file"
    );
}
