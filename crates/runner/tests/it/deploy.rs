//! The `deploy` stage with real parts: a real git repo whose merged revision is deployed, a
//! real SQLite store with a manual clock, real deploy scripts (they count their runs in a
//! file) and a real loopback HTTP service whose health and live revision come from files the
//! scripts and the tests write. Crash cases: a deploy killed between `INITIATED` and its result
//! is finalized without deploying twice; the finalizer's defers are bounded and counted from
//! the jobs queue; a recorded outcome is replayed after the markers are gone.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use orch_deploystate::{ArmedRead, DeployResult, DeployState, MARKER_INITIATED, WatchState};
use orch_domain::config::RepoConfig;
use orch_domain::control::{events, markers};
use orch_domain::gate::{GateOutcome, Verdict};
use orch_exec::Git;
use orch_runner::counters::Counters;
use orch_runner::deploy::DeployerExecutor;
use orch_runner::engine::{StageEffect, StageExecutor, StageJob, StageRun};
use orch_store::testing::TestDb;
use orch_store::{JobCount, NewEvent, NewJob, NewTask, Task, WorkItemSpec};

const ITEM: &str = "ORCH-7";

/// A loopback service: `GET /health` answers the status in `<ctl>/health` (200 when absent),
/// `GET /revision` the content of `<ctl>/live_rev` (404 when absent); `POST /hook` (the alert
/// webhook) appends the body as one line to `<ctl>/hooks` (503 while `<ctl>/hook_refuses`
/// exists).
async fn serve(ctl: PathBuf) -> String {
    async fn health(State(ctl): State<Arc<PathBuf>>) -> (StatusCode, String) {
        let code = std::fs::read_to_string(ctl.join("health"))
            .ok()
            .and_then(|t| t.trim().parse::<u16>().ok())
            .unwrap_or(200);
        (
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            format!("health {code}"),
        )
    }
    async fn revision(State(ctl): State<Arc<PathBuf>>) -> (StatusCode, String) {
        match std::fs::read_to_string(ctl.join("live_rev")) {
            Ok(rev) => (StatusCode::OK, rev),
            Err(_) => (StatusCode::NOT_FOUND, "no revision".into()),
        }
    }
    async fn hook(State(ctl): State<Arc<PathBuf>>, body: String) -> StatusCode {
        if ctl.join("hook_refuses").exists() {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        let mut all = std::fs::read_to_string(ctl.join("hooks")).unwrap_or_default();
        all.push_str(&body);
        all.push('\n');
        std::fs::write(ctl.join("hooks"), all).unwrap();
        StatusCode::NO_CONTENT
    }
    let app = Router::new()
        .route("/health", get(health))
        .route("/revision", get(revision))
        .route("/hook", axum::routing::post(hook))
        .with_state(Arc::new(ctl));
    common::listen(app).await
}

struct Fx {
    db: TestDb,
    _tmp: tempfile::TempDir,
    ctl: PathBuf,
    repos_dir: PathBuf,
    repo_dir: PathBuf,
    repo: RepoConfig,
    revision: String,
    task: Task,
    git: Git,
    counters: Arc<Counters>,
}

impl Fx {
    /// A repo `app` with one commit on `main`, a task at stage `deploy`, the service up and
    /// the deploy script `deploy.sh` (counts runs, makes the revision live).
    async fn new() -> Fx {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let db = TestDb::sqlite().await;
        let tmp = tempfile::tempdir().unwrap();
        let ctl = tmp.path().join("ctl");
        std::fs::create_dir_all(&ctl).unwrap();
        let repos_dir = tmp.path().join("repos");
        let repo_dir = repos_dir.join("app");
        let git = Git::new();
        common::init_repo(&git, &repo_dir, "app\n").await;
        let revision = git.rev_parse(&repo_dir, "main").await.unwrap().unwrap();
        let base = serve(ctl.clone()).await;
        let repo = repo_config(
            &repo_dir,
            Some(format!("sh {}/deploy.sh", ctl.display())),
            &base,
        );
        std::fs::write(
            ctl.join("deploy.sh"),
            format!(
                "echo run >> {c}/runs\npwd > {c}/cwd\necho \"$ORCH_WORK_ITEM\" > {c}/item\necho \"$ORCH_REVISION\" > {c}/live_rev\n",
                c = ctl.display()
            ),
        )
        .unwrap();
        let task = db
            .store
            .create_task(NewTask {
                work_item: WorkItemSpec::Exact(ITEM.parse().unwrap()),
                repo: "app".parse().unwrap(),
                title: "ship it".into(),
                body: String::new(),
                stage: "deploy".parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: NewEvent::new("task.created", "test"),
                first_job: None,
            })
            .await
            .unwrap();
        Fx {
            db,
            _tmp: tmp,
            ctl,
            repos_dir,
            repo_dir,
            repo,
            revision,
            task,
            git,
            counters: Arc::new(Counters::new()),
        }
    }

    fn first_content(&self) -> String {
        StageJob {
            stage: "deploy".into(),
            seq: self.task.stage_seq,
        }
        .to_content()
    }

    /// A run of a new `deployer` job carrying `content`, as the engine would build it.
    async fn run(&self, content: String) -> StageRun {
        let job_id = self
            .db
            .store
            .enqueue(NewJob::new("deployer", content).task(self.task.id))
            .await
            .unwrap()
            .job_id;
        self.run_of(job_id).await
    }

    async fn run_of(&self, job_id: i64) -> StageRun {
        let run = common::run_of(
            &self.db,
            &self.task,
            job_id,
            &self.repo_dir,
            self.repo.clone(),
        );
        StageRun {
            git: self.git.clone(),
            counters: self.counters.clone(),
            node: "node-a".into(),
            prep: Default::default(),
            ..run.await
        }
    }

    fn runs(&self) -> usize {
        read(&self.ctl.join("runs")).lines().count()
    }

    fn deploy_state(&self) -> DeployState {
        DeployState::new(&self.repos_dir, "app", ITEM)
    }

    fn watch(&self) -> WatchState {
        WatchState::new(&self.repos_dir, "app", ITEM)
    }

    async fn event_kinds(&self) -> Vec<String> {
        let events = self.db.store.task_events(self.task.id).await.unwrap();
        events.into_iter().map(|e| e.kind).collect()
    }

    /// Drives the stage as the engine would: every requeue becomes a new job with the marker,
    /// after advancing the clock by its delay. Returns the final outcome and the requeues.
    async fn drive(&self, exec: &DeployerExecutor) -> (GateOutcome, Vec<(u64, String)>) {
        let mut content = self.first_content();
        let mut requeues = Vec::new();
        for _ in 0..20 {
            let run = self.run(content.clone()).await;
            match exec.execute(&run).await.unwrap() {
                StageEffect::Produced { outcome: Some(o) } => return (o, requeues),
                StageEffect::Requeue {
                    delay_ms, marker, ..
                } => {
                    self.db.clock.advance_ms(i64::try_from(delay_ms).unwrap());
                    content = StageJob::from_content(&content)
                        .unwrap()
                        .with_marker(&marker);
                    requeues.push((delay_ms, marker));
                }
                other => panic!("unexpected effect {other:?}"),
            }
        }
        panic!("the deployer did not finish within 20 jobs");
    }
}

/// The repo's configuration as `orch.toml` would give it.
fn repo_config(repo_dir: &Path, deploy: Option<String>, base: &str) -> RepoConfig {
    RepoConfig {
        path: Some(repo_dir.display().to_string()),
        deploy,
        deploy_timeout_s: 60,
        health_url: Some(format!("{base}/health")),
        revision_url: Some(format!("{base}/revision")),
        ..common::repo_config("ORCH")
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn passed(o: &GateOutcome) -> bool {
    matches!(o.verdict, Verdict::Pass(_))
}

#[tokio::test]
async fn deploys_the_merged_revision_once_confirms_it_and_arms_the_watch() {
    let fx = Fx::new().await;
    let (outcome, requeues) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{outcome:?}");
    assert!(requeues.is_empty(), "{requeues:?}");
    assert!(outcome.reason.contains(&fx.revision), "{}", outcome.reason);
    assert_eq!(fx.runs(), 1);
    assert_eq!(read(&fx.ctl.join("item")).trim(), ITEM);
    assert_eq!(read(&fx.ctl.join("live_rev")).trim(), fx.revision);
    // The command runs in a checkout of exactly the revision it deploys.
    let cwd = PathBuf::from(read(&fx.ctl.join("cwd")).trim());
    assert_eq!(
        cwd.canonicalize().unwrap(),
        fx.repo_dir
            .join("worktrees/.release")
            .canonicalize()
            .unwrap()
    );
    let checked_out = std::process::Command::new("git")
        .arg("-C")
        .arg(&cwd)
        .args(["rev-parse", "HEAD"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&checked_out.stdout).trim(),
        fx.revision
    );

    match fx.watch().armed() {
        ArmedRead::Present(rec) => {
            assert_eq!(rec.revision, fx.revision);
            assert_eq!(rec.armed_at_ms, fx.db.store.now_ms());
            assert_eq!(rec.params.window_s, 600);
            assert_eq!(rec.deadline_ms, rec.armed_at_ms + 600_000);
        }
        other => panic!("watch not armed: {other:?}"),
    }
    assert!(
        !fx.deploy_state().has_marker(MARKER_INITIATED),
        "markers cleared"
    );
    let kinds = fx.event_kinds().await;
    assert!(
        kinds.contains(&events::DEPLOY_STARTED.to_owned()),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&events::DEPLOY_CONFIRMED.to_owned()),
        "{kinds:?}"
    );
    let confirmed = &fx
        .db
        .store
        .events_by_kind(events::DEPLOY_CONFIRMED, 0, 10)
        .await
        .unwrap()[0];
    assert!(confirmed.data.contains(&fx.revision), "{}", confirmed.data);

    // The job runs again after the markers were cleared (a crash before the engine advanced):
    // the recorded outcome is replayed, nothing is deployed again.
    let again = fx.run(fx.first_content()).await;
    match DeployerExecutor::default().execute(&again).await.unwrap() {
        StageEffect::Produced { outcome: Some(o) } => assert!(passed(&o), "{o:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(fx.runs(), 1, "never deployed twice");
}

/// A failed deploy takes its change out of the default branch. When the revert cannot give a
/// verdict (here the repo's tests hang past their timeout), the attempt fails before anything
/// is recorded, so the job's next attempt finds the failure unrecorded and reverts again (a
/// recorded failure would be replayed without a revert); the last attempt records the failure
/// with the revert's error, once.
#[tokio::test]
async fn a_failed_deploys_revert_that_cannot_run_is_retried_before_the_failure_is_recorded() {
    let mut fx = Fx::new().await;
    fx.repo.deploy = Some(format!("echo run >> {}/runs; exit 3", fx.ctl.display()));
    fx.repo.test = Some("sleep 30".into());
    fx.repo.test_timeout_s = 1;
    std::fs::write(fx.repo_dir.join("change.txt"), "the change\n").unwrap();
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(&fx.repo_dir)
            .args(["-c", "user.name=t", "-c", "user.email=t@t"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    git(&["add", "change.txt"]);
    git(&[
        "commit",
        "-q",
        "-m",
        &format!("change\n\nWork-Item: {ITEM}"),
    ]);
    let merged = git(&["rev-parse", "main"]);
    common::record_promoted(&fx.db, &fx.task, &fx.revision, &merged).await;
    let job = |max_attempts: i64| {
        NewJob::new("deployer", fx.first_content())
            .task(fx.task.id)
            .max_attempts(max_attempts)
    };
    let first = fx.db.store.enqueue(job(3)).await.unwrap().job_id;
    let run = fx.run_of(first).await;
    let err = format!(
        "{:#}",
        DeployerExecutor::default().execute(&run).await.unwrap_err()
    );
    assert!(err.contains("did not finish (attempt 1 of 3)"), "{err}");
    assert!(err.contains("timed out"), "{err}");
    let kinds = fx.event_kinds().await;
    assert!(
        !kinds.iter().any(|k| k == events::DEPLOY_FAILED),
        "nothing recorded yet: {kinds:?}"
    );
    assert_eq!(git(&["rev-parse", "main"]), merged, "nothing published");

    let last = fx.db.store.enqueue(job(1)).await.unwrap().job_id;
    let run = fx.run_of(last).await;
    let outcome = match DeployerExecutor::default().execute(&run).await.unwrap() {
        StageEffect::Produced { outcome: Some(o) } => o,
        other => panic!("{other:?}"),
    };
    assert!(!passed(&outcome));
    assert!(
        outcome.reason.contains("the revert failed"),
        "{}",
        outcome.reason
    );
    let failed = fx
        .db
        .store
        .events_by_kind(events::DEPLOY_FAILED, 0, 10)
        .await
        .unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(fx.runs(), 1, "the failed deploy command is never run again");
}

#[tokio::test]
async fn a_failing_deploy_command_fails_the_stage_with_its_output_tail() {
    let mut fx = Fx::new().await;
    fx.repo.deploy = Some("echo preparing; echo 'disk full on web-3' >&2; exit 3".into());
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(!passed(&outcome));
    assert!(
        outcome.reason.contains("disk full on web-3"),
        "{}",
        outcome.reason
    );
    assert!(outcome.reason.contains("exit code 3"), "{}", outcome.reason);
    assert_eq!(
        fx.watch().armed(),
        ArmedRead::Absent,
        "no watch for a failed deploy"
    );
    assert!(!fx.deploy_state().has_marker(MARKER_INITIATED));
    let failed = fx
        .db
        .store
        .events_by_kind(events::DEPLOY_FAILED, 0, 10)
        .await
        .unwrap();
    assert_eq!(failed.len(), 1);
    assert!(
        failed[0].message.contains("disk full"),
        "{}",
        failed[0].message
    );

    // Replayed on a re-run, never re-deployed.
    let again = fx.run(fx.first_content()).await;
    match DeployerExecutor::default().execute(&again).await.unwrap() {
        StageEffect::Produced { outcome: Some(o) } => assert!(!passed(&o)),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_deploy_killed_between_initiated_and_its_result_is_finalized_without_deploying_twice() {
    let mut fx = Fx::new().await;
    // The deploy makes the revision live, then hangs (like orch restarting itself).
    fx.repo.deploy = Some(format!("sh {c}/deploy.sh; sleep 30", c = fx.ctl.display()));
    let run = fx.run(fx.first_content()).await;
    let job_id = run.job.id;
    let handle = tokio::spawn(async move { DeployerExecutor::default().execute(&run).await });
    let runs_file = fx.ctl.join("live_rev");
    for _ in 0..200 {
        if read(&runs_file).trim() == fx.revision {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(fx.runs(), 1, "the deploy script started");
    handle.abort(); // the process dies: no result is written
    let _ = handle.await;
    assert!(fx.deploy_state().has_marker(MARKER_INITIATED));
    assert_eq!(fx.deploy_state().read_result(), None);

    // The job is rescued and runs again: it finds INITIATED and confirms instead.
    let rerun = fx.run_of(job_id).await;
    match DeployerExecutor::default().execute(&rerun).await.unwrap() {
        StageEffect::Produced { outcome: Some(o) } => assert!(passed(&o), "{o:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(fx.runs(), 1, "the deploy command ran exactly once");
    assert!(matches!(fx.watch().armed(), ArmedRead::Present(r) if r.revision == fx.revision));
    let started = fx
        .db
        .store
        .events_by_kind(events::DEPLOY_STARTED, 0, 10)
        .await
        .unwrap();
    assert_eq!(started.len(), 1);
}

#[tokio::test]
async fn a_result_recorded_by_the_restarted_process_is_honoured() {
    let fx = Fx::new().await;
    // Self-deploy: the old process wrote INITIATED, the restarted one recorded a failure.
    let state = fx.deploy_state();
    assert!(state.write_marker(MARKER_INITIATED, &fx.revision));
    assert!(state.write_result(&DeployResult {
        success: false,
        revision: Some(fx.revision.clone()),
        finished_at_ms: 1,
        detail: "migration 42 failed".into(),
    }));
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(!passed(&outcome));
    assert!(
        outcome.reason.contains("migration 42 failed"),
        "{}",
        outcome.reason
    );
    assert_eq!(fx.runs(), 0, "a job that finds INITIATED never deploys");
    assert!(!state.has_marker(MARKER_INITIATED), "cleared");
}

/// The one place the finalizer's confirmation table calls the deployer: the service answers
/// `health` (None = up) and `live` (None = no revision endpoint answer, Some("$REV") = the
/// merged revision) after the deploy; `want_defers` requeues are expected, then `want_pass`.
async fn check(
    health: Option<u16>,
    live: Option<&str>,
    script_makes_live: bool,
    want_defers: usize,
    want_pass: bool,
    reason_has: &str,
) {
    let mut fx = Fx::new().await;
    if !script_makes_live {
        fx.repo.deploy = Some(format!("echo run >> {}/runs", fx.ctl.display()));
    }
    if let Some(code) = health {
        std::fs::write(fx.ctl.join("health"), code.to_string()).unwrap();
    }
    if let Some(rev) = live {
        let rev = rev.replace("$REV", &fx.revision[..12]);
        std::fs::write(fx.ctl.join("live_rev"), rev).unwrap();
    }
    let exec = DeployerExecutor::default();
    let (outcome, requeues) = fx.drive(&exec).await;
    let case = format!("health {health:?} live {live:?}");
    assert_eq!(requeues.len(), want_defers, "{case}: {requeues:?}");
    assert_eq!(passed(&outcome), want_pass, "{case}: {outcome:?}");
    assert!(
        outcome.reason.contains(reason_has),
        "{case}: {}",
        outcome.reason
    );
    assert_eq!(fx.runs(), 1, "{case}: deployed exactly once");
    for (i, (delay, marker)) in requeues.iter().enumerate() {
        assert_eq!(*delay, exec.finalize_delay_s * 1000);
        assert!(
            marker.starts_with(&markers::deploy_finalize_prefix(fx.task.stage_seq)),
            "{marker}"
        );
        assert!(marker.ends_with(&format!("n={}", i + 1)), "{marker}");
    }
    let counted = fx
        .db
        .store
        .count_jobs(&JobCount {
            task_id: fx.task.id,
            agent: "deployer".into(),
            content_contains: Some(markers::deploy_finalize_prefix(fx.task.stage_seq)),
        })
        .await
        .unwrap();
    assert_eq!(
        counted,
        i64::try_from(want_defers).unwrap(),
        "{case}: the count is the queue"
    );
    assert!(!fx.deploy_state().has_marker(MARKER_INITIATED), "{case}");
    let counter = |n: &str| fx.counters.get("deployer", n);
    assert_eq!(
        counter("deferred"),
        u64::try_from(want_defers).unwrap(),
        "{case}"
    );
    assert_eq!(counter("confirmed"), u64::from(want_pass), "{case}");
    assert_eq!(counter("unconfirmed"), u64::from(!want_pass), "{case}");
    let armed = matches!(fx.watch().armed(), ArmedRead::Present(_));
    assert_eq!(armed, want_pass, "{case}: armed only when confirmed");
}

#[tokio::test]
async fn finalizer_confirmation_table() {
    let limit = DeployerExecutor::default().finalize_limit as usize;
    // healthy and the merged revision live (abbreviated): confirmed at once
    check(None, Some("$REV"), false, 0, true, "confirmed").await;
    // the service answers 503: deferred up to the limit, then the task fails
    check(Some(503), None, true, limit, false, "HTTP 503").await;
    // healthy but an old revision is live: deferred, then unconfirmed
    check(
        None,
        Some("0ld0ld0ld0"),
        false,
        limit,
        false,
        "live revision is `0ld0ld0ld0`",
    )
    .await;
    // healthy but the revision endpoint has nothing: unconfirmed, not guessed
    check(None, None, false, limit, false, "cannot be read").await;
}

#[tokio::test]
async fn the_finalizer_confirms_once_the_service_comes_up() {
    let fx = Fx::new().await;
    std::fs::write(fx.ctl.join("health"), "502").unwrap();
    let exec = DeployerExecutor::default();
    let first = fx.run(fx.first_content()).await;
    let marker = match exec.execute(&first).await.unwrap() {
        StageEffect::Requeue { marker, reason, .. } => {
            assert!(reason.contains("HTTP 502"), "{reason}");
            marker
        }
        other => panic!("{other:?}"),
    };
    std::fs::remove_file(fx.ctl.join("health")).unwrap();
    fx.db.clock.advance_ms(5_000);
    let second = fx
        .run(
            StageJob::from_content(&fx.first_content())
                .unwrap()
                .with_marker(&marker),
        )
        .await;
    match exec.execute(&second).await.unwrap() {
        StageEffect::Produced { outcome: Some(o) } => assert!(passed(&o), "{o:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(fx.runs(), 1);
    match fx.watch().armed() {
        ArmedRead::Present(rec) => assert_eq!(
            rec.armed_at_ms,
            fx.db.store.now_ms(),
            "armed at confirmation"
        ),
        other => panic!("{other:?}"),
    }
    let deferred = fx
        .db
        .store
        .events_by_kind(events::DEPLOY_DEFERRED, 0, 10)
        .await
        .unwrap();
    assert_eq!(deferred.len(), 1);
}

#[tokio::test]
async fn without_a_deploy_command_nothing_is_deployed_and_a_watch_needs_a_health_url() {
    // No deploy command, no health_url: nothing to deploy, nothing to watch.
    let mut fx = Fx::new().await;
    fx.repo.deploy = None;
    fx.repo.health_url = None;
    fx.repo.revision_url = None;
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{outcome:?}");
    assert!(
        outcome.reason.contains("nothing to deploy"),
        "{}",
        outcome.reason
    );
    assert_eq!(fx.watch().armed(), ArmedRead::Absent);
    assert_eq!(
        fx.event_kinds().await.last().map(String::as_str),
        Some(events::DEPLOY_SKIPPED)
    );

    // No deploy command but a health_url: deployed outside orch, confirmed and watched.
    let mut fx = Fx::new().await;
    fx.repo.deploy = None;
    std::fs::write(fx.ctl.join("live_rev"), &fx.revision).unwrap();
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{outcome:?}");
    assert_eq!(fx.runs(), 0);
    assert!(matches!(fx.watch().armed(), ArmedRead::Present(r) if r.revision == fx.revision));
}

#[tokio::test]
async fn a_finished_watch_of_an_earlier_deploy_is_replaced_by_the_new_one() {
    let fx = Fx::new().await;
    let ws = fx.watch();
    let old = orch_deploystate::ArmedRecord::new(Default::default(), 5, "0123456789abcdef");
    assert_eq!(ws.arm(&old), orch_deploystate::ArmOutcome::Armed);
    assert!(ws.mark_done("HEALTHY"));
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{outcome:?}");
    assert!(!ws.is_done(), "the new watch is not done");
    assert!(matches!(ws.armed(), ArmedRead::Present(r) if r.revision == fx.revision));
}

/// How the unconfirmed-deploy case ends.
struct Unconfirmed {
    name: &'static str,
    /// The rollback command (`None`: none configured). `$C` is the control dir.
    rollback: Option<&'static str>,
    /// A revision made live by someone else before the finalizer gives up.
    other_live: Option<&'static str>,
    want_rollbacks: usize,
    want_event: Option<&'static str>,
    want_alert: bool,
    reason_has: &'static str,
}

/// A healthy rollback: the old revision is live again and the service answers 200.
const GOOD_ROLLBACK: &str =
    "echo rb >> $C/rollbacks; echo 0ld0ld0ld0ld > $C/live_rev; rm -f $C/health";

/// The one place the unconfirmed-deploy table runs: the deploy makes its revision live but the
/// service answers 503 through every finalizer check.
async fn check_unconfirmed(case: Unconfirmed) {
    let mut fx = Fx::new().await;
    let c = fx.ctl.display().to_string();
    // Production ran the old release before the deploy (what a rollback goes back to).
    std::fs::write(fx.ctl.join("live_rev"), "0ld0ld0ld0ld").unwrap();
    std::fs::write(fx.ctl.join("health"), "503").unwrap();
    fx.repo.rollback = case.rollback.map(|r| r.replace("$C", &c));
    fx.repo.alert = Some(format!(
        "echo \"$ORCH_WORK_ITEM|$ORCH_VERDICT|$ORCH_ACTION|$ORCH_REVISION|$ORCH_REASON\" >> {c}/alerts"
    ));
    let base = fx.repo.health_url.clone().unwrap().replace("/health", "");
    fx.repo.alert_webhook = Some(format!("{base}/hook"));
    let exec = DeployerExecutor {
        finalize_limit: 1,
        verify_polls: 2,
        verify_interval: Duration::from_millis(20),
        ..DeployerExecutor::default()
    };
    // First job deploys and defers once (limit 1).
    let first = fx.run(fx.first_content()).await;
    let marker = match exec.execute(&first).await.unwrap() {
        StageEffect::Requeue { marker, .. } => marker,
        other => panic!("{}: {other:?}", case.name),
    };
    if let Some(rev) = case.other_live {
        std::fs::write(fx.ctl.join("live_rev"), rev).unwrap();
    }
    let content = StageJob::from_content(&fx.first_content())
        .unwrap()
        .with_marker(&marker);
    let second = fx.run(content.clone()).await;
    let outcome = match exec.execute(&second).await.unwrap() {
        StageEffect::Produced { outcome: Some(o) } => o,
        other => panic!("{}: {other:?}", case.name),
    };
    assert!(!passed(&outcome), "{}: {outcome:?}", case.name);
    assert!(
        outcome.reason.contains(case.reason_has),
        "{}: {}",
        case.name,
        outcome.reason
    );
    assert_eq!(fx.runs(), 1, "{}: deployed once", case.name);
    let rollbacks = read(&fx.ctl.join("rollbacks")).lines().count();
    assert_eq!(rollbacks, case.want_rollbacks, "{}", case.name);
    let kinds = fx.event_kinds().await;
    assert!(
        kinds.contains(&events::DEPLOY_UNCONFIRMED.to_owned()),
        "{}: {kinds:?}",
        case.name
    );
    for kind in [events::DEPLOY_ROLLED_BACK, events::DEPLOY_ROLLBACK_FAILED] {
        assert_eq!(
            kinds.iter().any(|k| k == kind),
            case.want_event == Some(kind),
            "{}: {kind} in {kinds:?}",
            case.name
        );
    }
    assert_eq!(
        kinds
            .iter()
            .filter(|k| *k == events::DEPLOY_ROLLBACK_STARTED)
            .count(),
        case.want_rollbacks,
        "{}: rollback_started once per run",
        case.name
    );
    assert!(
        !matches!(fx.watch().armed(), ArmedRead::Present(_)),
        "{}: no watch",
        case.name
    );

    // The alert: the command saw the env, the webhook's job delivers the document.
    let delivered = common::deliver_notices(&fx.db, "app", &fx.repo).await;
    let alerts = read(&fx.ctl.join("alerts"));
    let hooks = read(&fx.ctl.join("hooks"));
    if case.want_alert {
        let line = alerts.lines().next().unwrap_or_default();
        let fields: Vec<&str> = line.splitn(5, '|').collect();
        assert_eq!(fields.len(), 5, "{}: {alerts:?}", case.name);
        assert_eq!(fields[0], ITEM, "{}", case.name);
        assert_eq!(fields[1], "UNCONFIRMED", "{}", case.name);
        // What was done: a rollback that ran and did not bring production back, or nothing.
        let action = if case.want_rollbacks > 0 {
            "rollback_failed"
        } else {
            "alert"
        };
        assert_eq!(fields[2], action, "{}", case.name);
        assert_eq!(fields[3], fx.revision, "{}", case.name);
        assert!(fields[4].contains("not confirmed"), "{}: {line}", case.name);
        assert_eq!(delivered.len(), 1, "{}: one delivery job", case.name);
        let body: serde_json::Value =
            serde_json::from_str(hooks.lines().next().unwrap_or("null")).unwrap();
        assert_eq!(body["version"], 1, "{}: {hooks}", case.name);
        assert_eq!(body["event"], "alert", "{}", case.name);
        assert_eq!(body["action"], action, "{}", case.name);
        assert_eq!(body["verdict"], "UNCONFIRMED", "{}", case.name);
        assert_eq!(body["work_item"], ITEM, "{}: {hooks}", case.name);
        assert_eq!(body["repo"], "app", "{}", case.name);
        assert_eq!(body["revision"], fx.revision.as_str(), "{}", case.name);
        assert_eq!(body["previous_revision"], "0ld0ld0ld0ld", "{}", case.name);
        assert!(
            body["reason"].as_str().unwrap().contains("UNCONFIRMED"),
            "{}: {body}",
            case.name
        );
        assert!(
            body["live"]["description"]
                .as_str()
                .is_some_and(|d| !d.is_empty()),
            "{}: what is live: {body}",
            case.name
        );
        assert!(body["todo"].as_str().is_some(), "{}: {body}", case.name);
        assert_eq!(
            kinds
                .iter()
                .filter(|k| *k == events::POST_DEPLOY_ALERT_SENT)
                .count(),
            1,
            "{}: the command ran once: {kinds:?}",
            case.name
        );
        let kinds = fx.event_kinds().await;
        assert!(
            kinds.contains(&events::NOTIFY_DELIVERED.to_owned()),
            "{}: {kinds:?}",
            case.name
        );
    } else {
        assert!(
            alerts.is_empty() && hooks.is_empty(),
            "{}: {alerts} {hooks}",
            case.name
        );
        assert!(
            !kinds.iter().any(|k| k == events::POST_DEPLOY_ALERT),
            "{}",
            case.name
        );
        assert!(delivered.is_empty(), "{}: no webhook job", case.name);
    }
    // What production was left as is recorded once.
    assert_eq!(
        fx.event_kinds()
            .await
            .iter()
            .filter(|k| *k == events::PRODUCTION_CHECKED)
            .count(),
        1,
        "{}",
        case.name
    );

    // A re-run of the last job replays the outcome: nothing rolls back or pages again.
    let again = fx.run(content).await;
    match exec.execute(&again).await.unwrap() {
        StageEffect::Produced { outcome: Some(o) } => assert!(!passed(&o), "{o:?}"),
        other => panic!("{}: {other:?}", case.name),
    }
    assert_eq!(
        read(&fx.ctl.join("rollbacks")).lines().count(),
        case.want_rollbacks
    );
    assert_eq!(
        read(&fx.ctl.join("alerts")),
        alerts,
        "{}: paged once",
        case.name
    );
    assert!(
        common::deliver_notices(&fx.db, "app", &fx.repo)
            .await
            .is_empty(),
        "{}: no second webhook job",
        case.name
    );
}

#[tokio::test]
async fn an_unconfirmed_deploy_is_rolled_back_only_while_its_revision_is_live() {
    let table = [
        Unconfirmed {
            name: "rollback restores health and the old revision",
            rollback: Some(GOOD_ROLLBACK),
            other_live: None,
            want_rollbacks: 1,
            want_event: Some(events::DEPLOY_ROLLED_BACK),
            want_alert: false,
            reason_has: "production verified healthy at `0ld0ld0ld0ld` after the rollback",
        },
        Unconfirmed {
            name: "the rollback command fails",
            rollback: Some("echo rb >> $C/rollbacks; echo 'no previous release' >&2; exit 4"),
            other_live: None,
            want_rollbacks: 1,
            want_event: Some(events::DEPLOY_ROLLBACK_FAILED),
            want_alert: true,
            reason_has: "no previous release",
        },
        Unconfirmed {
            name: "the rollback runs but the service stays down",
            rollback: Some("echo rb >> $C/rollbacks; echo 0ld0ld0ld0ld > $C/live_rev"),
            other_live: None,
            want_rollbacks: 1,
            want_event: Some(events::DEPLOY_ROLLBACK_FAILED),
            want_alert: true,
            reason_has: "not verified",
        },
        Unconfirmed {
            name: "another revision went live meanwhile: no rollback",
            rollback: Some(GOOD_ROLLBACK),
            other_live: Some("fe11a5fe11a5"),
            want_rollbacks: 0,
            want_event: None,
            want_alert: true,
            reason_has: "another release is live",
        },
        Unconfirmed {
            name: "no rollback command",
            rollback: None,
            other_live: None,
            want_rollbacks: 0,
            want_event: None,
            want_alert: true,
            reason_has: "no rollback command",
        },
    ];
    for case in table {
        check_unconfirmed(case).await;
    }
}

#[tokio::test]
async fn a_broken_alert_hook_is_recorded_and_never_fails_the_stage() {
    let mut fx = Fx::new().await;
    std::fs::write(fx.ctl.join("health"), "503").unwrap();
    std::fs::write(fx.ctl.join("hook_refuses"), "").unwrap();
    fx.repo.alert = Some("sleep 30".into());
    let base = fx.repo.health_url.clone().unwrap().replace("/health", "");
    fx.repo.alert_webhook = Some(format!("{base}/hook"));
    let exec = DeployerExecutor {
        finalize_limit: 0,
        ..DeployerExecutor::default()
    };
    let started = std::time::Instant::now();
    let (outcome, _) = fx.drive(&exec).await;
    assert!(!passed(&outcome), "{outcome:?}");
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "the alert command timed out"
    );
    let failed = fx
        .db
        .store
        .events_by_kind(events::POST_DEPLOY_ALERT_FAILED, 0, 10)
        .await
        .unwrap();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].message.contains("timed out"),
        "{}",
        failed[0].message
    );
    // The webhook is a job of its own: the stage never waited for it. Its try fails, is
    // recorded, and comes back later.
    let tries = common::deliver_notices(&fx.db, "app", &fx.repo).await;
    assert_eq!(tries.len(), 1);
    assert!(
        matches!(&tries[0].1, orch_runner::worker::Outcome::Retry { delay, .. } if *delay == Duration::from_secs(2)),
        "{:?}",
        tries[0].1
    );
    let failed = fx
        .db
        .store
        .events_by_kind(events::NOTIFY_FAILED, 0, 10)
        .await
        .unwrap();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].message.contains("503"), "{}", failed[0].message);
    assert!(
        !failed[0].message.contains("/hook"),
        "only the host is named: {}",
        failed[0].message
    );
}

#[tokio::test]
async fn arming_a_watch_supersedes_the_older_active_watches_of_the_same_repo() {
    let fx = Fx::new().await;
    let arm = |repo: &str, item: &str| {
        let ws = WatchState::new(&fx.repos_dir, repo, item);
        let rec = orch_deploystate::ArmedRecord::new(Default::default(), 5, "0123456789abcdef");
        assert_eq!(ws.arm(&rec), orch_deploystate::ArmOutcome::Armed);
        ws
    };
    let older = arm("app", "ORCH-6");
    let finished = arm("app", "ORCH-5");
    assert!(finished.mark_done("HEALTHY"));
    let other_repo = arm("billing", "ORCH-4");
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{outcome:?}");
    let marker = |ws: &WatchState| read(&ws.dir().unwrap().join("superseded"));
    assert_eq!(
        marker(&older).trim(),
        format!("{ITEM} {}", fx.revision),
        "the older active watch of the repo is superseded by this deploy"
    );
    assert_eq!(marker(&finished), "", "a finished watch is left alone");
    assert_eq!(
        marker(&other_repo),
        "",
        "another repo's watch is left alone"
    );
    assert_eq!(marker(&fx.watch()), "", "the new watch is not superseded");
}

/// A deploy whose command was killed with orch before it did anything (a restarted orch stops
/// what its dead incarnation left running) is run once more; once per visit, so a deploy that
/// restarts orch itself cannot loop.
#[tokio::test]
async fn a_deploy_interrupted_before_it_went_live_runs_once_more_and_only_once() {
    let mut fx = Fx::new().await;
    let slow = fx.ctl.join("slow");
    std::fs::write(&slow, "").unwrap();
    fx.repo.deploy = Some(format!(
        "if [ -f {c}/slow ]; then sleep 30; fi; sh {c}/deploy.sh",
        c = fx.ctl.display()
    ));
    let run = fx.run(fx.first_content()).await;
    let job_id = run.job.id;
    let handle = tokio::spawn(async move { DeployerExecutor::default().execute(&run).await });
    for _ in 0..400 {
        if fx
            .event_kinds()
            .await
            .iter()
            .any(|k| k == events::DEPLOY_STARTED)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    handle.abort(); // orch dies while the command sleeps: no result, nothing live
    let _ = handle.await;
    std::fs::remove_file(&slow).unwrap();
    assert!(fx.deploy_state().has_marker(MARKER_INITIATED));
    assert_eq!(fx.runs(), 0, "the interrupted command never deployed");

    let rerun = fx.run_of(job_id).await;
    match DeployerExecutor::default().execute(&rerun).await.unwrap() {
        StageEffect::Produced { outcome: Some(o) } => assert!(passed(&o), "{o:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(fx.runs(), 1, "deployed once, by the second run");
    let kinds = fx.event_kinds().await;
    assert_eq!(
        kinds
            .iter()
            .filter(|k| *k == events::DEPLOY_REDEPLOYED)
            .count(),
        1
    );

    // Interrupted again in the same visit (INITIATED, no result, not live): no third run.
    assert!(
        fx.deploy_state()
            .write_marker(MARKER_INITIATED, &fx.revision)
    );
    std::fs::write(fx.ctl.join("live_rev"), "something-else\n").unwrap();
    let again = fx.run_of(job_id).await;
    let _ = DeployerExecutor::default().execute(&again).await.unwrap();
    assert_eq!(fx.runs(), 1, "a visit re-runs its deploy at most once");
}

/// A deploy killed with orch after its revision went live — but unhealthy, as a bad change is —
/// was applied: the next job confirms (and the finalizer judges the health), it never deploys
/// the same revision a second time.
#[tokio::test]
async fn a_deploy_interrupted_after_an_unhealthy_revision_went_live_is_not_run_again() {
    let mut fx = Fx::new().await;
    fx.repo.deploy = Some(format!(
        "sh {c}/deploy.sh; echo 500 > {c}/health; sleep 30",
        c = fx.ctl.display()
    ));
    let run = fx.run(fx.first_content()).await;
    let job_id = run.job.id;
    let handle = tokio::spawn(async move { DeployerExecutor::default().execute(&run).await });
    for _ in 0..400 {
        if read(&fx.ctl.join("health")).trim() == "500" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    handle.abort(); // orch dies after the revision went live, before the command ended
    let _ = handle.await;
    assert_eq!(fx.runs(), 1, "the interrupted command deployed");
    assert!(fx.deploy_state().has_marker(MARKER_INITIATED));

    let rerun = fx.run_of(job_id).await;
    let effect = DeployerExecutor::default().execute(&rerun).await.unwrap();
    assert_eq!(fx.runs(), 1, "not deployed a second time: {effect:?}");
    assert!(
        !fx.event_kinds()
            .await
            .iter()
            .any(|k| k == events::DEPLOY_REDEPLOYED),
        "no redeploy event"
    );
}

/// An interrupted deploy whose finalizer already began rolling it back (so its revision is not
/// live on purpose) is never deployed again: the next job finishes the finalizer's work.
#[tokio::test]
async fn a_deploy_being_rolled_back_is_not_deployed_again() {
    for judged in [events::DEPLOY_DEFERRED, events::DEPLOY_ROLLBACK_STARTED] {
        let fx = Fx::new().await;
        assert!(
            fx.deploy_state()
                .write_marker(MARKER_INITIATED, &fx.revision)
        );
        // The rollback (or whatever else) made another revision live.
        std::fs::write(fx.ctl.join("live_rev"), "0ld0ld0ld0ld\n").unwrap();
        fx.db
            .store
            .append_event(
                NewEvent::new(judged, "judged before the crash")
                    .task(fx.task.id)
                    .data(serde_json::json!({ "seq": fx.task.stage_seq }).to_string()),
            )
            .await
            .unwrap();
        let run = fx.run(fx.first_content()).await;
        let effect = DeployerExecutor::default().execute(&run).await.unwrap();
        assert_eq!(fx.runs(), 0, "{judged}: not deployed again: {effect:?}");
        assert!(
            !fx.event_kinds()
                .await
                .iter()
                .any(|k| k == events::DEPLOY_REDEPLOYED),
            "{judged}"
        );
    }
}

/// orch died between recording an unconfirmed deploy's `deploy.rollback_started` and the end
/// of its rollback command: production still runs the bad revision, so the next job runs the
/// rollback once more (`deploy.rollback_rerun`) and verifies it — unless production is already
/// back, when it only verifies. Never a third run.
#[tokio::test]
async fn an_unconfirmed_deploys_interrupted_rollback_runs_once_more() {
    for already_back in [false, true] {
        let mut fx = Fx::new().await;
        let c = fx.ctl.display().to_string();
        std::fs::write(fx.ctl.join("health"), "503").unwrap();
        fx.repo.rollback = Some(GOOD_ROLLBACK.replace("$C", &c));
        let exec = DeployerExecutor {
            finalize_limit: 1,
            verify_polls: 2,
            verify_interval: Duration::from_millis(20),
            ..DeployerExecutor::default()
        };
        let first = fx.run(fx.first_content()).await;
        let marker = match exec.execute(&first).await.unwrap() {
            StageEffect::Requeue { marker, .. } => marker,
            other => panic!("{other:?}"),
        };
        // The crash: the rollback was recorded as started, its command never ran.
        fx.db
            .store
            .append_event(
                NewEvent::new(events::DEPLOY_ROLLBACK_STARTED, "rolling back")
                    .task(fx.task.id)
                    .data(serde_json::json!({ "seq": fx.task.stage_seq }).to_string()),
            )
            .await
            .unwrap();
        if already_back {
            std::fs::write(fx.ctl.join("live_rev"), "0ld0ld0ld0ld").unwrap();
            std::fs::remove_file(fx.ctl.join("health")).unwrap();
        }
        let content = StageJob::from_content(&fx.first_content())
            .unwrap()
            .with_marker(&marker);
        let second = fx.run(content.clone()).await;
        let outcome = match exec.execute(&second).await.unwrap() {
            StageEffect::Produced { outcome: Some(o) } => o,
            other => panic!("{other:?}"),
        };
        assert!(!passed(&outcome), "{outcome:?}");
        let rollbacks = read(&fx.ctl.join("rollbacks")).lines().count();
        let kinds = fx.event_kinds().await;
        let reruns = kinds
            .iter()
            .filter(|k| *k == events::DEPLOY_ROLLBACK_RERUN)
            .count();
        if already_back {
            assert_eq!((rollbacks, reruns), (0, 0), "only verified: {kinds:?}");
        } else {
            assert_eq!((rollbacks, reruns), (1, 1), "run once more: {kinds:?}");
        }
        assert!(
            kinds.iter().any(|k| k == events::DEPLOY_ROLLED_BACK),
            "verified: {kinds:?}"
        );
    }
}

// ----- a visit taken over from a node that is gone (design.md §10) ------------------------------

impl Fx {
    /// Records that a deploy of `revision` began in visit `seq` (on some node).
    async fn started_elsewhere(&self, seq: i64, revision: &str) {
        self.db
            .store
            .append_event(
                NewEvent::new(events::DEPLOY_STARTED, format!("deploying `{revision}`"))
                    .task(self.task.id)
                    .data(serde_json::json!({"seq": seq, "revision": revision}).to_string()),
            )
            .await
            .unwrap();
    }
}

/// The gone node ran the deploy command and its revision is live; this node has no markers:
/// they are rebuilt from `deploy.started` and the deploy is confirmed, never run again.
#[tokio::test]
async fn a_visit_begun_on_a_gone_node_whose_revision_is_live_is_confirmed_not_deployed() {
    let fx = Fx::new().await;
    fx.started_elsewhere(fx.task.stage_seq, &fx.revision).await;
    std::fs::write(fx.ctl.join("live_rev"), &fx.revision).unwrap();
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{}", outcome.reason);
    assert_eq!(fx.runs(), 0, "the live deploy was not applied again");
    let kinds = fx.event_kinds().await;
    assert!(
        kinds.contains(&events::DEPLOY_MARKERS_RESTORED.to_owned()),
        "{kinds:?}"
    );
    assert!(!kinds.contains(&events::DEPLOY_REDEPLOYED.to_owned()));
}

/// The gone node recorded `deploy.started` but its revision is not live (it died before or
/// during the command): the deploy runs once more here, once.
#[tokio::test]
async fn a_visit_begun_on_a_gone_node_whose_revision_is_not_live_is_deployed_once() {
    let fx = Fx::new().await;
    fx.started_elsewhere(fx.task.stage_seq, &fx.revision).await;
    std::fs::write(fx.ctl.join("live_rev"), "0ld0ld0ld0ld\n").unwrap();
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{}", outcome.reason);
    assert_eq!(fx.runs(), 1);
    let kinds = fx.event_kinds().await;
    assert!(kinds.contains(&events::DEPLOY_MARKERS_RESTORED.to_owned()));
    assert_eq!(
        kinds
            .iter()
            .filter(|k| *k == events::DEPLOY_REDEPLOYED)
            .count(),
        1
    );
}

/// Markers left on this node by another visit of the item (this node went away, the visit was
/// taken over and finished elsewhere, the item was retried): this visit deploys its own
/// revision instead of finalizing the stale one.
#[tokio::test]
async fn markers_of_another_visit_are_cleared_before_this_visit_deploys() {
    let fx = Fx::new().await;
    fx.started_elsewhere(fx.task.stage_seq - 1, "5ta1e5ta1e5ta1e")
        .await;
    assert!(
        fx.deploy_state()
            .write_marker(MARKER_INITIATED, "5ta1e5ta1e5ta1e")
    );
    std::fs::write(fx.ctl.join("live_rev"), "5ta1e5ta1e5ta1e\n").unwrap();
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{}", outcome.reason);
    assert_eq!(fx.runs(), 1, "this visit's deploy ran");
    assert_eq!(read(&fx.ctl.join("live_rev")).trim(), fx.revision);
    let kinds = fx.event_kinds().await;
    assert!(
        kinds.contains(&events::DEPLOY_STALE_MARKERS_CLEARED.to_owned()),
        "{kinds:?}"
    );
}

/// A watch of the same revision armed before this visit began (another visit's, left on this
/// node when the visit was taken over elsewhere) is replaced, not reused with its old window.
#[tokio::test]
async fn a_watch_armed_before_this_visit_is_replaced_not_reused() {
    let fx = Fx::new().await;
    let stale = orch_deploystate::ArmedRecord::new(
        orch_runner::deploy::watch_params(&fx.repo.post_deploy),
        fx.task.updated_at - 3_600_000,
        fx.revision.as_str(),
    );
    assert!(matches!(
        fx.watch().arm(&stale),
        orch_deploystate::ArmOutcome::Armed
    ));
    let (outcome, _) = fx.drive(&DeployerExecutor::default()).await;
    assert!(passed(&outcome), "{}", outcome.reason);
    match fx.watch().armed() {
        ArmedRead::Present(rec) => assert_eq!(rec.armed_at_ms, fx.db.store.now_ms()),
        other => panic!("watch not armed: {other:?}"),
    }
}
