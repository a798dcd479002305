//! The staging runner (seed ORCH-115) against real parts: a real git repo with a worktree on
//! `orch/<id>`, a real SQLite store whose jobs queue holds the defer markers (D-2), real shell
//! steps, and every `15-staging-log.md` read back through the unchanged `parse_staging_status`
//! gate (D-3, AC-2/AC-5, TC-04).

use crate::common;

use std::path::Path;
use std::sync::Arc;

use orch_domain::artifact::{Artifact, Value};
use orch_domain::config::{RepoConfig, StepConfig};
use orch_domain::control::markers;
use orch_domain::gate::{StagingStatus, parse_staging_status};
use orch_domain::staging::rfc3339_utc;
use orch_runner::counters::Counters;
use orch_runner::engine::{StageEffect, StageExecutor, StageJob, StageRun};
use orch_runner::stages::StagingExecutor;
use orch_store::testing::T0;
use orch_store::{JobCount, NewJob};

use common::{Fixture, ID};

/// A step: name, shell command, timeout in seconds.
type Step = (&'static str, &'static str, u64);

fn steps(list: &[Step]) -> Vec<StepConfig> {
    list.iter()
        .map(|(name, run, timeout_s)| StepConfig {
            name: (*name).into(),
            run: (*run).into(),
            timeout_s: *timeout_s,
            // The runner's classification is under test here, on the host; the sandboxed
            // steps are the demo's (crates/orch/tests).
            sandbox: false,
        })
        .collect()
}

fn repo_config(staging: &[Step], smoke: &[Step], defer_limit: u32) -> RepoConfig {
    RepoConfig {
        test_timeout_s: 1800,
        staging: steps(staging),
        staging_smoke: steps(smoke),
        staging_defer_limit: defer_limit,
        ..common::repo_config("DEMO")
    }
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// Enqueues `n` deployer jobs carrying the defer marker of stage visit `seq`, as earlier defers
/// would have (D-2).
async fn earlier_defers(run: &StageRun, n: u32, seq: i64) {
    for _ in 0..n {
        let content = StageJob {
            stage: "staging".into(),
            seq,
        }
        .with_marker(&markers::staging_defer(seq));
        run.store
            .enqueue(
                NewJob::new("deployer", content)
                    .task(run.task.id)
                    .delay_s(60),
            )
            .await
            .unwrap();
    }
}

/// What a staging run must produce.
enum Expect {
    /// `15-staging-log.md` with this status, failure kind, attempt and reason fragment.
    Log {
        status: StagingStatus,
        failure_kind: &'static str,
        attempt: i64,
        reason: &'static str,
    },
    /// A requeue with this delay and reason fragment; no log.
    Defer { delay_s: u64, reason: &'static str },
}

/// Runs the staging runner on `staging` + `smoke` after `defers` earlier defers of this visit
/// with `limit`, and checks the effect, the log (through the gate, key by key) and the
/// counters `(success, failed, tool_error, deferred)`.
async fn check(
    staging: &[Step],
    smoke: &[Step],
    defers: u32,
    limit: u32,
    want: Expect,
    counters: (u64, u64, u64, u64),
) -> Fixture {
    let f = Fixture::new("staging", "deployer", repo_config(staging, smoke, limit)).await;
    earlier_defers(&f.run, defers, f.run.task.stage_seq).await;
    let runner = StagingExecutor::new(f.counters.clone());
    let effect = runner.execute(&f.run).await.unwrap();
    let log = read(&f.run.artifact_path("15-staging-log.md"));
    let case = format!("{staging:?} {smoke:?} defers {defers}");
    match want {
        Expect::Log {
            status,
            failure_kind,
            attempt,
            reason,
        } => {
            // An exhausted tool error tells the pipeline so (the item fails without a loop
            // back); any other final result is read back from the log by the gate.
            if failure_kind == "tool_error_exhausted" {
                assert!(
                    matches!(&effect, StageEffect::Produced { outcome: Some(o) }
                        if o.verdict == orch_domain::gate::Verdict::Pass(
                            orch_domain::pipeline::TOOL_ERROR_EXHAUSTED.to_owned())),
                    "{case}: {effect:?}"
                );
            } else {
                assert!(
                    matches!(effect, StageEffect::Produced { outcome: None }),
                    "{case}: {effect:?}"
                );
            }
            let log = log.unwrap_or_else(|| panic!("{case}: no log"));
            let gate = parse_staging_status(Some(&log), &f.run.work_item);
            assert!(gate.is(status), "{case}: {gate:?}\n{log}");
            assert_eq!(gate.is_success(), status == StagingStatus::Success);
            let line = format!("staging_status: {}", status.as_str());
            assert!(log.lines().any(|l| l == line), "{case}: exact line\n{log}");
            let fm = Artifact::parse(&log).unwrap().frontmatter;
            let s = |k: &str| fm.get_str(k).unwrap_or_default().to_owned();
            assert_eq!(s("work_item"), ID);
            assert_eq!(s("stage"), "staging");
            assert_eq!(s("author_agent"), "staging-runner");
            assert_eq!(s("model_used"), "n/a");
            assert_eq!(s("created_at"), rfc3339_utc(T0));
            assert_eq!(s("failure_kind"), failure_kind, "{case}\n{log}");
            assert_eq!(fm.get("attempt"), Some(&Value::Int(attempt)), "{case}");
            assert!(s("reason").contains(reason), "{case}: {}", s("reason"));
        }
        Expect::Defer { delay_s, reason } => {
            match effect {
                StageEffect::Requeue {
                    delay_ms: d,
                    marker,
                    reason: r,
                } => {
                    assert_eq!(d, delay_s * 1000, "{case}");
                    assert_eq!(marker, markers::staging_defer(f.run.task.stage_seq));
                    assert_eq!(marker, "[orch:staging-tool-error-defer seq=0]");
                    assert!(r.contains(reason), "{case}: {r}");
                }
                other => panic!("{case}: {other:?}"),
            }
            assert!(log.is_none(), "{case}: a defer writes no log");
        }
    }
    let c = |n: &str| f.counters.get("staging_runner", n);
    assert_eq!(c("runs"), 1, "{case}");
    assert_eq!(
        (c("success"), c("failed"), c("tool_error"), c("deferred")),
        counters,
        "{case}"
    );
    f
}

const BUILD: Step = ("build", "echo built > built.txt", 30);
const SMOKE_OK: Step = (
    "smoke-health",
    "grep -q built built.txt && echo \"ok $ORCH_WORK_ITEM $ORCH_BRANCH $ORCH_REVISION\"",
    30,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_passing_is_success() {
    let f = check(
        &[BUILD],
        &[SMOKE_OK],
        0,
        2,
        Expect::Log {
            status: StagingStatus::Success,
            failure_kind: "none",
            attempt: 1,
            reason: "all 2 planned steps passed",
        },
        (1, 0, 0, 0),
    )
    .await;
    let log = read(&f.run.artifact_path("15-staging-log.md")).unwrap();
    let head = f
        .run
        .git
        .rev_parse(&f.run.worktree, "HEAD")
        .await
        .unwrap()
        .unwrap();
    assert!(
        log.contains(&format!("ok DEMO-1 orch/DEMO-1 {head}")),
        "the steps see ORCH_WORK_ITEM/ORCH_BRANCH/ORCH_REVISION:\n{log}"
    );
    assert!(log.contains("| 2 | smoke-health | yes |"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smoke_check_failing_against_a_responding_env_is_failed_and_never_deferred() {
    check(
        &[BUILD],
        &[("smoke-health", "echo 'HTTP/1.1 500 boom'; exit 1", 30)],
        0,
        2,
        Expect::Log {
            status: StagingStatus::Failed,
            failure_kind: "smoke_failed",
            attempt: 1,
            reason: "smoke check `smoke-health` failed with exit code 1",
        },
        (0, 1, 0, 0),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_step_stops_the_run_before_later_steps() {
    let f = check(
        &[
            ("build", "exit 2", 30),
            ("deploy", "touch deployed.txt", 30),
        ],
        &[SMOKE_OK],
        0,
        2,
        Expect::Log {
            status: StagingStatus::Failed,
            failure_kind: "step_failed",
            attempt: 1,
            reason: "step `build` failed with exit code 2",
        },
        (0, 1, 0, 0),
    )
    .await;
    assert!(!f.run.worktree.join("deployed.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_tool_is_deferred_with_the_marker() {
    let f = check(
        &[("deploy", "no-such-tool-xyz deploy --env staging", 30)],
        &[SMOKE_OK],
        0,
        2,
        Expect::Defer {
            delay_s: 60,
            reason: "tool_missing",
        },
        (0, 0, 1, 1),
    )
    .await;
    // The marker counts exactly the jobs of this visit (D-2): none yet, the engine enqueues it.
    let n = f
        .run
        .store
        .count_jobs(&JobCount {
            task_id: f.run.task.id,
            agent: "deployer".into(),
            content_contains: Some(markers::staging_defer(f.run.task.stage_seq)),
        })
        .await
        .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_defer_waits_longer() {
    check(
        &[("deploy", "no-such-tool-xyz", 30)],
        &[],
        1,
        2,
        Expect::Defer {
            delay_s: 120,
            reason: "defer 2 of 2",
        },
        (0, 0, 1, 1),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_error_past_the_limit_is_failed_exhausted() {
    check(
        &[("deploy", "no-such-tool-xyz", 30)],
        &[SMOKE_OK],
        2,
        2,
        Expect::Log {
            status: StagingStatus::Failed,
            failure_kind: "tool_error_exhausted",
            attempt: 3,
            reason: "after 2 defer(s) (limit 2)",
        },
        (0, 1, 1, 0),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_of_zero_never_defers() {
    check(
        &[("deploy", "no-such-tool-xyz", 30)],
        &[],
        0,
        0,
        Expect::Log {
            status: StagingStatus::Failed,
            failure_kind: "tool_error_exhausted",
            attempt: 1,
            reason: "tool_missing",
        },
        (0, 1, 1, 0),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defers_of_another_stage_visit_do_not_count() {
    let f = Fixture::new(
        "staging",
        "deployer",
        repo_config(&[("deploy", "no-such-tool-xyz", 30)], &[], 2),
    )
    .await;
    earlier_defers(&f.run, 5, f.run.task.stage_seq + 1).await;
    let runner = StagingExecutor::new(f.counters.clone());
    match runner.execute(&f.run).await.unwrap() {
        StageEffect::Requeue { delay_ms, .. } => assert_eq!(delay_ms, 60_000),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_before_the_smoke_checks_is_a_tool_error() {
    check(
        &[("deploy", "sleep 30", 1)],
        &[SMOKE_OK],
        0,
        2,
        Expect::Defer {
            delay_s: 60,
            reason: "(timeout)",
        },
        (0, 0, 1, 1),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_after_the_smoke_checks_began_is_failed() {
    check(
        &[BUILD],
        &[("smoke-slow", "sleep 30", 1)],
        0,
        2,
        Expect::Log {
            status: StagingStatus::Failed,
            failure_kind: "smoke_timeout",
            attempt: 1,
            reason: "timed out after the smoke checks began",
        },
        (0, 1, 0, 0),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_killed_by_a_signal_is_a_tool_error() {
    check(
        &[("deploy", "kill -9 $$", 30)],
        &[],
        0,
        2,
        Expect::Defer {
            delay_s: 60,
            reason: "signaled",
        },
        (0, 0, 1, 1),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_staging_steps_is_a_tool_error_never_success() {
    // Missing evidence is never success: deferred like any tool error …
    check(
        &[],
        &[],
        0,
        2,
        Expect::Defer {
            delay_s: 60,
            reason: "no_steps",
        },
        (0, 0, 1, 1),
    )
    .await;
    // … then FAILED once the defers are spent, never SUCCESS.
    let f = check(
        &[],
        &[],
        2,
        2,
        Expect::Log {
            status: StagingStatus::Failed,
            failure_kind: "tool_error_exhausted",
            attempt: 3,
            reason: "no staging steps are configured",
        },
        (0, 1, 1, 0),
    )
    .await;
    let log = read(&f.run.artifact_path("15-staging-log.md")).unwrap();
    assert!(log.contains("(no step ran)"), "{log}");
}

/// A URL on a port nothing listens on (bound, then released).
async fn closed_port_url(path: &str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}{path}")
}

/// A staging environment that answers `/health` with `status`.
async fn answering(status: u16) -> String {
    let app = axum::Router::new().route(
        "/health",
        axum::routing::get(move || async move {
            (axum::http::StatusCode::from_u16(status).unwrap(), "staging")
        }),
    );
    format!("{}/health", common::listen(app).await)
}

/// [`check`] with a staging health URL, returning the log too.
async fn check_looking(
    url: &str,
    staging: &[Step],
    smoke: &[Step],
    defers: u32,
) -> (StageEffect, Option<String>) {
    let mut repo = repo_config(staging, smoke, 2);
    repo.staging_health_url = Some(url.to_owned());
    let f = Fixture::new("staging", "deployer", repo).await;
    earlier_defers(&f.run, defers, f.run.task.stage_seq).await;
    let runner = StagingExecutor::new(f.counters.clone());
    let effect = runner.execute(&f.run).await.unwrap();
    (effect, read(&f.run.artifact_path("15-staging-log.md")))
}

fn deferred_as(effect: &StageEffect, kind: &str) {
    match effect {
        StageEffect::Requeue { reason, .. } => assert!(reason.contains(kind), "{reason}"),
        other => panic!("expected a defer ({kind}): {other:?}"),
    }
}

/// The `failure_kind` and `staging_status` of a log.
fn verdict_of(log: &str) -> (String, String) {
    let fm = Artifact::parse(log).unwrap().frontmatter;
    (
        fm.get_str("staging_status").unwrap().to_owned(),
        fm.get_str("failure_kind").unwrap().to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_smoke_check_against_a_closed_port_is_the_infrastructure() {
    let url = closed_port_url("/health").await;
    let smoke =
        format!("python3 -c \"import urllib.request; urllib.request.urlopen('{url}', timeout=2)\"");
    let smoke: &'static str = Box::leak(smoke.into_boxed_str());
    // The runner looks first: nothing answers, so the smoke check is not even run.
    let (effect, log) = check_looking(&url, &[BUILD], &[("health", smoke, 10)], 0).await;
    deferred_as(&effect, "unreachable");
    assert!(log.is_none(), "a defer writes no log");
    // Exhausted: FAILED tool_error_exhausted naming the unreachable endpoint, never smoke_failed.
    let (_, log) = check_looking(&url, &[BUILD], &[("health", smoke, 10)], 2).await;
    let log = log.unwrap();
    assert_eq!(
        verdict_of(&log),
        ("FAILED".to_owned(), "tool_error_exhausted".to_owned())
    );
    assert!(log.contains("unreachable"), "{log}");
    assert!(
        log.contains("did not answer"),
        "what the runner saw:\n{log}"
    );
    assert!(!log.contains("smoke_failed"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ssh_like_step_exiting_255_against_a_down_host_is_the_infrastructure() {
    let url = closed_port_url("/health").await;
    let (effect, _) = check_looking(
        &url,
        &[(
            "deploy-staging",
            "echo 'ssh: connect to host staging port 22: Connection refused' >&2; exit 255",
            10,
        )],
        &[("health", "true", 10)],
        0,
    )
    .await;
    deferred_as(&effect, "unreachable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_against_an_answering_environment_is_the_change() {
    let url = answering(503).await;
    // The environment answers (even 503): the smoke check's failure is the change's.
    let (_, log) = check_looking(&url, &[BUILD], &[("health", "exit 1", 10)], 0).await;
    let log = log.unwrap();
    assert_eq!(
        verdict_of(&log),
        ("FAILED".to_owned(), "smoke_failed".to_owned())
    );
    assert!(log.contains("answered (HTTP 503)"), "{log}");
    // A 255 with the host answering is the step's own failure.
    let (_, log) = check_looking(&url, &[("deploy", "exit 255", 10)], &[], 0).await;
    assert_eq!(
        verdict_of(&log.unwrap()),
        ("FAILED".to_owned(), "step_failed".to_owned())
    );
    // And everything passing against an answering environment is SUCCESS, the look said.
    let url = answering(200).await;
    let (_, log) = check_looking(&url, &[BUILD], &[("health", "true", 10)], 0).await;
    let log = log.unwrap();
    assert_eq!(verdict_of(&log), ("SUCCESS".to_owned(), "none".to_owned()));
    assert!(log.contains("before the smoke checks"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_health_url_the_conventions_decide() {
    // ssh's 255 in any step, curl's 7 in a smoke check, 75 anywhere: unreachable.
    for (staging, smoke) in [
        (&[("deploy", "exit 255", 10)][..], &[][..]),
        (&[BUILD][..], &[("health", "exit 7", 10)][..]),
        (&[("deploy", "exit 75", 10)][..], &[][..]),
    ] {
        let f = Fixture::new("staging", "deployer", repo_config(staging, smoke, 2)).await;
        let effect = StagingExecutor::new(f.counters.clone())
            .execute(&f.run)
            .await
            .unwrap();
        deferred_as(&effect, "unreachable");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deployer_job_of_another_stage_is_refused_d1() {
    let f = Fixture::new("deploy", "deployer", repo_config(&[BUILD], &[], 2)).await;
    let runner = StagingExecutor::new(f.counters.clone());
    match runner.execute(&f.run).await.unwrap() {
        StageEffect::Failed { reason } => assert!(reason.contains("(D1)"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(!f.run.worktree.join("built.txt").exists(), "no step ran");
    assert_eq!(f.counters.get("staging_runner", "runs"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_are_declared_at_zero_d4() {
    let counters = Arc::new(Counters::new());
    let _runner = StagingExecutor::new(counters.clone());
    let snapshot = counters.snapshot();
    assert_eq!(snapshot.len(), 1);
    assert_eq!(snapshot[0].0, "staging_runner");
    let names: Vec<(&str, u64)> = snapshot[0]
        .1
        .iter()
        .map(|(n, v)| (n.as_str(), *v))
        .collect();
    assert_eq!(
        names,
        [
            ("deferred", 0),
            ("failed", 0),
            ("runs", 0),
            ("success", 0),
            ("tool_error", 0)
        ]
    );
}
