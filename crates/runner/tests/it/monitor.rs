//! The post-deploy monitor (`observe`, ORCH-021) with real parts: the sentinel files in a temp
//! `repos_dir`, a real SQLite store whose manual clock walks through the watch window, real
//! rollback scripts, and a real loopback HTTP service whose health and live revision come from
//! files the tests and scripts write. The engine's requeues are simulated by enqueueing the
//! marker jobs it would enqueue, so tick counts come from the real jobs table.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use orch_deploystate::{ArmOutcome, ArmedRecord, WatchState};
use orch_domain::artifact::{Artifact, Frontmatter};
use orch_domain::config::{PostDeployConfig, RepoConfig};
use orch_domain::control::{events, markers};
use orch_domain::monitor::{CheckOutcome, WatchParams};
use orch_runner::counters::Counters;
use orch_runner::deploy::monitor::supersede_others;
use orch_runner::deploy::probe::{check_health, check_revision, live_revision};
use orch_runner::deploy::{MonitorExecutor, RecoveryAction, active_watches, recover_watches};
use orch_runner::engine::{StageEffect, StageExecutor, StageJob, StageRun};
use orch_store::testing::TestDb;
use orch_store::{AdvanceStage, Fence, JobCount, NewEvent, NewJob, NewTask, Task, WorkItemSpec};

const ITEM: &str = "ORCH-21";
const REV: &str = "4f2a9c1e0b7d3a5f6e8c9b0a1d2e3f4a5b6c7d8e";
const AGENT: &str = "post-deploy-monitor";

/// 10 polls: slots at 30 s, 60 s, …, 300 s after arming.
const PARAMS: WatchParams = WatchParams {
    window_s: 300,
    interval_s: 30,
    initial_delay_s: 30,
    poll_timeout_s: 2,
};

/// A loopback service: `/health` answers the status in `<ctl>/health` (200 when absent),
/// `/revision` the content of `<ctl>/live_rev` (404 when absent), `/slow` answers after 3 s;
/// `POST /hook` (the alert webhook) appends its body as one line to `<ctl>/hooks`.
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
    async fn slow() -> &'static str {
        tokio::time::sleep(Duration::from_secs(3)).await;
        "late"
    }
    async fn hook(State(ctl): State<Arc<PathBuf>>, body: String) -> StatusCode {
        let mut all = std::fs::read_to_string(ctl.join("hooks")).unwrap_or_default();
        all.push_str(&body);
        all.push('\n');
        std::fs::write(ctl.join("hooks"), all).unwrap();
        StatusCode::OK
    }
    let app = Router::new()
        .route("/health", get(health))
        .route("/revision", get(revision))
        .route("/slow", get(slow))
        .route("/hook", axum::routing::post(hook))
        .with_state(Arc::new(ctl));
    common::listen(app).await
}

/// A URL on a port nothing listens on.
async fn closed_port_url(path: &str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}{path}")
}

struct Fx {
    db: TestDb,
    _tmp: tempfile::TempDir,
    ctl: PathBuf,
    base: String,
    repos_dir: PathBuf,
    repo_dir: PathBuf,
    repo: RepoConfig,
    task: Task,
    counters: Arc<Counters>,
}

impl Fx {
    /// A task at stage `observe` of repo `app`, the service up and answering [`REV`].
    async fn new() -> Fx {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let db = TestDb::sqlite().await;
        let tmp = tempfile::tempdir().unwrap();
        let ctl = tmp.path().join("ctl");
        std::fs::create_dir_all(&ctl).unwrap();
        std::fs::write(ctl.join("live_rev"), &REV[..12]).unwrap();
        let repos_dir = tmp.path().join("repos");
        let repo_dir = repos_dir.join("app");
        std::fs::create_dir_all(&repo_dir).unwrap();
        let base = serve(ctl.clone()).await;
        let repo = RepoConfig {
            path: Some(repo_dir.display().to_string()),
            deploy_timeout_s: 30,
            health_url: Some(format!("{base}/health")),
            revision_url: Some(format!("{base}/revision")),
            post_deploy: PostDeployConfig {
                window_s: PARAMS.window_s,
                interval_s: PARAMS.interval_s,
                initial_delay_s: PARAMS.initial_delay_s,
                poll_timeout_s: PARAMS.poll_timeout_s,
            },
            ..common::repo_config("ORCH")
        };

        let task = db
            .store
            .create_task(NewTask {
                work_item: WorkItemSpec::Exact(ITEM.parse().unwrap()),
                repo: "app".parse().unwrap(),
                title: "watch it".into(),
                body: String::new(),
                stage: "observe".parse().unwrap(),
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
            base,
            repos_dir,
            repo_dir,
            repo,
            task,
            counters: Arc::new(Counters::new()),
        }
    }

    fn watch(&self) -> WatchState {
        WatchState::new(&self.repos_dir, "app", ITEM)
    }

    /// Arms the watch now, as the deploy finalizer does.
    fn arm(&self) -> ArmedRecord {
        let rec = ArmedRecord::new(PARAMS, self.db.store.now_ms(), REV);
        assert_eq!(self.watch().arm(&rec), ArmOutcome::Armed);
        rec
    }

    fn first_content(&self) -> String {
        StageJob {
            stage: "observe".into(),
            seq: self.task.stage_seq,
        }
        .to_content()
    }

    async fn run(&self, content: String) -> StageRun {
        let job_id = self
            .db
            .store
            .enqueue(NewJob::new(AGENT, content).task(self.task.id))
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
            counters: self.counters.clone(),
            node: "node-a".into(),
            prep: Default::default(),
            ..run.await
        }
    }

    /// Runs jobs as the engine would until the watch ends: before each job `hook(polls so
    /// far, ctl)` may change the service; each requeue advances the clock by its delay and
    /// enqueues the marker job. Returns the requeues `(delay, marker)`.
    async fn drive(&self, exec: &MonitorExecutor, hook: fn(usize, &Path)) -> Vec<(u64, String)> {
        let (ending, requeues) = self.to_the_ending(exec, hook).await;
        if let Some(content) = ending {
            hook(self.watch().series().polls.len(), &self.ctl);
            let run = self.run(content).await;
            match exec.execute(&run).await.unwrap() {
                StageEffect::Produced { outcome: None } => {}
                other => panic!("unexpected effect of the ending job {other:?}"),
            }
        }
        requeues
    }

    /// [`Fx::drive`] up to the job that acts on the verdict, which is not run: its content
    /// (`None` when the watch ended without one), and the requeues.
    async fn to_the_ending(
        &self,
        exec: &MonitorExecutor,
        hook: fn(usize, &Path),
    ) -> (Option<String>, Vec<(u64, String)>) {
        let mut content = self.first_content();
        let mut requeues = Vec::new();
        for _ in 0..100 {
            hook(self.watch().series().polls.len(), &self.ctl);
            let run = self.run(content.clone()).await;
            match exec.execute(&run).await.unwrap() {
                StageEffect::Produced { outcome: None } => return (None, requeues),
                StageEffect::Requeue {
                    delay_ms, marker, ..
                } => {
                    self.db.clock.advance_ms(i64::try_from(delay_ms).unwrap());
                    content = StageJob::from_content(&content)
                        .unwrap()
                        .with_marker(&marker);
                    requeues.push((delay_ms, marker));
                }
                // The verdict reached: its ending runs next, as its own job.
                StageEffect::Yield { marker, .. } => {
                    assert_eq!(marker, markers::monitor_end(self.task.stage_seq));
                    assert!(!content.contains(&marker), "one ending job per watch");
                    let ending = StageJob::from_content(&content)
                        .unwrap()
                        .with_marker(&marker);
                    return (Some(ending), requeues);
                }
                other => panic!("unexpected effect {other:?}"),
            }
        }
        panic!("the watch did not end within 100 jobs");
    }

    fn artifact_log_path(&self) -> PathBuf {
        self.repo_dir
            .join("worktrees")
            .join(ITEM)
            .join("docs/work-items")
            .join(ITEM)
            .join("16-post-deploy-log.md")
    }

    fn log(&self) -> Option<Frontmatter> {
        let path = self
            .repo_dir
            .join("worktrees")
            .join(ITEM)
            .join("docs/work-items")
            .join(ITEM)
            .join("16-post-deploy-log.md");
        let text = std::fs::read_to_string(path).ok()?;
        Some(Artifact::parse(&text).unwrap().frontmatter)
    }

    async fn events_of(&self, kind: &str) -> Vec<orch_store::Event> {
        let all = self.db.store.task_events(self.task.id).await.unwrap();
        all.into_iter().filter(|e| e.kind == kind).collect()
    }

    async fn count(&self, marker: &str) -> i64 {
        self.db
            .store
            .count_jobs(&JobCount {
                task_id: self.task.id,
                agent: AGENT.into(),
                content_contains: Some(marker.into()),
            })
            .await
            .unwrap()
    }

    /// Configures the repo's `alert` command (one `|`-separated line per alert into
    /// `<ctl>/alerts`) and `alert_webhook` (the loopback `/hook`).
    fn with_alert_hooks(&mut self) {
        self.repo.alert = Some(format!(
            "printf '%s|%s|%s|%s|%s\\n' \"$ORCH_WORK_ITEM\" \"$ORCH_VERDICT\" \"$ORCH_ACTION\" \"$ORCH_REVISION\" \"$ORCH_REASON\" >> {}/alerts",
            self.ctl.display()
        ));
        self.repo.alert_webhook = Some(format!("{}/hook", self.base));
    }

    /// What the alert hooks received: the command's lines (split on `|`, reason last) and
    /// the webhook's `alert` documents, once the queued webhook jobs have run (holds are
    /// announced too: their documents are left out here).
    async fn delivered(&self) -> (Vec<Vec<String>>, Vec<serde_json::Value>) {
        common::deliver_notices(&self.db, "app", &self.repo).await;
        let lines = read(&self.ctl.join("alerts"))
            .lines()
            .filter(|l| {
                l.starts_with(&format!("{ITEM}|")) && !l.starts_with(&format!("{ITEM}|hold|"))
            })
            .map(|l| l.splitn(5, '|').map(str::to_owned).collect())
            .collect();
        let hooks = read(&self.ctl.join("hooks"))
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["event"] == "alert")
            .collect();
        (lines, hooks)
    }

    fn ticks(&self) -> Vec<u32> {
        self.watch().series().polls.iter().map(|p| p.tick).collect()
    }
}

fn exec() -> MonitorExecutor {
    MonitorExecutor {
        verify_polls: 3,
        verify_interval: Duration::from_millis(20),
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

// ---- the probes ---------------------------------------------------------------------------

/// The one place the probe table calls `check_health`.
async fn check_probe(
    url: &str,
    timeout_s: u64,
    want: CheckOutcome,
    status: Option<u16>,
    detail_has: &str,
) {
    let c = check_health(url, Duration::from_secs(timeout_s)).await;
    assert_eq!(c.outcome, want, "{url}: {c:?}");
    assert_eq!(c.status_code, status, "{url}: {c:?}");
    assert!(c.detail.contains(detail_has), "{url}: {c:?}");
    if status.is_some() {
        assert!(c.latency_ms.is_some(), "{url}: latency recorded");
    }
}

#[tokio::test]
async fn probes_tell_the_services_failure_from_the_monitors_error() {
    let fx = Fx::new().await;
    let b = &fx.base;
    check_probe(
        &format!("{b}/health"),
        2,
        CheckOutcome::Pass,
        Some(200),
        "HTTP 200",
    )
    .await;
    std::fs::write(fx.ctl.join("health"), "503").unwrap();
    check_probe(
        &format!("{b}/health"),
        2,
        CheckOutcome::Fail,
        Some(503),
        "HTTP 503",
    )
    .await;
    check_probe(
        &format!("{b}/nope"),
        2,
        CheckOutcome::Fail,
        Some(404),
        "HTTP 404",
    )
    .await;
    check_probe(
        &closed_port_url("/health").await,
        2,
        CheckOutcome::Fail,
        None,
        "cannot connect",
    )
    .await;
    check_probe(
        &format!("{b}/slow"),
        1,
        CheckOutcome::Fail,
        None,
        "no answer within the timeout",
    )
    .await;
    check_probe("http://[::1", 1, CheckOutcome::Error, None, "invalid URL").await;

    let t = Duration::from_secs(2);
    assert_eq!(
        live_revision(&format!("{b}/revision"), t).await.as_deref(),
        Some(&REV[..12])
    );
    std::fs::write(
        fx.ctl.join("live_rev"),
        format!("{{\"revision\":\"{REV}\"}}"),
    )
    .unwrap();
    assert_eq!(
        live_revision(&format!("{b}/revision"), t).await.as_deref(),
        Some(REV)
    );
    std::fs::remove_file(fx.ctl.join("live_rev")).unwrap();
    assert_eq!(
        live_revision(&format!("{b}/revision"), t).await,
        None,
        "404 is unknown"
    );
    std::fs::write(fx.ctl.join("live_rev"), "0ld0ld0ld0").unwrap();
    let probe = check_revision(&format!("{b}/revision"), REV, t).await;
    assert_eq!(
        probe.check.outcome,
        CheckOutcome::Error,
        "another revision live: {probe:?}"
    );
    assert_eq!(probe.live.as_deref(), Some("0ld0ld0ld0"));
}

// ---- whole watches --------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Service {
    /// Health answers this status from the start (200 = up).
    Status(u16),
    /// Nothing listens on either URL.
    Refused,
}

struct Scenario {
    name: &'static str,
    service: Service,
    /// What `/revision` answers (`None`: no revision_url configured).
    live: Option<&'static str>,
    /// The rollback command (`$CTL` is replaced by the control directory).
    rollback: Option<&'static str>,
    hook: fn(usize, &Path),
    verdict: &'static str,
    action: &'static str,
    polls: usize,
    rollback_ran: bool,
}

const FIX: &str = "echo \"$ORCH_REVISION $ORCH_WORK_ITEM\" >> $CTL/rolled_back; echo 9999999999 > $CTL/live_rev; rm -f $CTL/health";
const NO_FIX: &str = "echo \"$ORCH_REVISION $ORCH_WORK_ITEM\" >> $CTL/rolled_back";

fn no_change(_: usize, _: &Path) {}

/// The one place whole-watch scenarios call the monitor.
async fn check(s: Scenario) {
    let mut fx = Fx::new().await;
    match s.service {
        Service::Status(200) => {}
        Service::Status(code) => std::fs::write(fx.ctl.join("health"), code.to_string()).unwrap(),
        Service::Refused => {
            fx.repo.health_url = Some(closed_port_url("/health").await);
            fx.repo.revision_url = Some(closed_port_url("/revision").await);
        }
    }
    match s.live {
        None => fx.repo.revision_url = None,
        Some(live) => std::fs::write(fx.ctl.join("live_rev"), live.replace("$REV", REV)).unwrap(),
    }
    fx.repo.rollback = s
        .rollback
        .map(|r| r.replace("$CTL", &fx.ctl.display().to_string()));
    fx.with_alert_hooks();
    let armed = fx.arm();
    let requeues = fx.drive(&exec(), s.hook).await;
    let name = s.name;

    // The schedule: one wait for the first slot, then one requeue per poll until the end.
    assert!(
        requeues[0]
            .1
            .starts_with(&markers::monitor_wait_prefix(fx.task.stage_seq)),
        "{name}: {requeues:?}"
    );
    assert_eq!(
        requeues[0].0, 30_000,
        "{name}: first poll after the initial delay"
    );
    assert!(
        requeues[1..].iter().all(|(d, m)| *d == 30_000
            && m.starts_with(&markers::monitor_tick_prefix(fx.task.stage_seq))),
        "{name}: {requeues:?}"
    );
    assert_eq!(
        requeues.len(),
        s.polls,
        "{name}: a wait + (polls - 1) ticks requeued"
    );
    assert_eq!(
        fx.ticks(),
        (0..u32::try_from(s.polls).unwrap()).collect::<Vec<_>>(),
        "{name}"
    );
    assert_eq!(
        fx.count(&markers::monitor_tick_prefix(fx.task.stage_seq))
            .await,
        i64::try_from(s.polls).unwrap() - 1,
        "{name}: ticks counted in the queue"
    );

    let fm = fx
        .log()
        .unwrap_or_else(|| panic!("{name}: no 16-post-deploy-log.md"));
    assert_eq!(fm.get_str("post_deploy_status"), Some(s.verdict), "{name}");
    assert_eq!(fm.get_str("action_taken"), Some(s.action), "{name}");
    assert_eq!(fm.get_str("revision"), Some(REV), "{name}");
    // Checks, not polls: health, and the revision when one is configured.
    let per_poll = if s.live.is_some() { 2 } else { 1 };
    assert_eq!(
        fm.get("checks_total"),
        Some(&orch_domain::artifact::Value::Int(
            i64::try_from(s.polls * per_poll).unwrap()
        )),
        "{name}"
    );
    assert_eq!(
        fm.get("window_s"),
        Some(&orch_domain::artifact::Value::Int(300)),
        "{name}"
    );
    assert!(fx.watch().is_done(), "{name}: done");

    let verdicts = fx.events_of(events::POST_DEPLOY_VERDICT).await;
    assert_eq!(verdicts.len(), 1, "{name}");
    assert!(
        verdicts[0]
            .data
            .contains(&format!("\"verdict\":\"{}\"", s.verdict)),
        "{name}: {}",
        verdicts[0].data
    );
    let alerts = fx.events_of(events::POST_DEPLOY_ALERT).await;
    assert_eq!(
        !alerts.is_empty(),
        matches!(s.action, "alert" | "rollback_failed"),
        "{name}: alerts {alerts:?}"
    );
    // The alert hooks: the command and the webhook got the alert once each, or nothing.
    let alerted = matches!(s.action, "alert" | "rollback_failed");
    let (lines, hooks) = fx.delivered().await;
    assert_eq!(lines.len(), usize::from(alerted), "{name}: {lines:?}");
    assert_eq!(hooks.len(), usize::from(alerted), "{name}: {hooks:?}");
    if alerted {
        assert_eq!(lines[0][1], s.verdict, "{name}: ORCH_VERDICT");
        assert_eq!(lines[0][2], s.action, "{name}: ORCH_ACTION");
        assert_eq!(lines[0][3], REV, "{name}: ORCH_REVISION");
        assert!(!lines[0][4].is_empty(), "{name}: ORCH_REASON");
        assert_eq!(hooks[0]["work_item"], ITEM, "{name}");
        assert_eq!(hooks[0]["repo"], "app", "{name}");
        assert_eq!(hooks[0]["verdict"], s.verdict, "{name}");
        assert_eq!(hooks[0]["action"], s.action, "{name}");
        assert_eq!(hooks[0]["revision"], REV, "{name}");
        assert!(hooks[0]["reason"].as_str().is_some_and(|r| !r.is_empty()));
        assert_eq!(
            fx.events_of(events::POST_DEPLOY_ALERT_SENT).await.len(),
            1,
            "{name}: the command ran once"
        );
        assert_eq!(
            fx.events_of(events::NOTIFY_DELIVERED)
                .await
                .iter()
                .filter(|e| e.data.contains("\"event\":\"alert\""))
                .count(),
            1,
            "{name}: the webhook got the alert once"
        );
    }
    let rolled = read(&fx.ctl.join("rolled_back"));
    assert_eq!(!rolled.is_empty(), s.rollback_ran, "{name}: rollback ran?");
    if s.rollback_ran {
        assert_eq!(
            rolled.trim(),
            format!("{REV} {ITEM}"),
            "{name}: ORCH_REVISION is the watched revision, once"
        );
    }
    assert!(
        fx.db.store.now_ms() <= armed.deadline_ms,
        "{name}: never past the deadline"
    );
    let counter = |n: &str| fx.counters.get("post_deploy_monitor", n);
    assert_eq!(counter("ticks"), u64::try_from(s.polls).unwrap(), "{name}");
    assert_eq!(counter(&s.verdict.to_lowercase()), 1, "{name}");

    // A job arriving after the end changes nothing.
    let before = fx.db.store.task_events(fx.task.id).await.unwrap().len();
    let late = fx.run(fx.first_content()).await;
    assert!(matches!(
        exec().execute(&late).await.unwrap(),
        StageEffect::Produced { outcome: None }
    ));
    assert_eq!(
        fx.db.store.task_events(fx.task.id).await.unwrap().len(),
        before,
        "{name}: done is a no-op"
    );
}

fn fail_at_4_and_7(polls: usize, ctl: &Path) {
    if polls == 4 || polls == 7 {
        std::fs::write(ctl.join("health"), "500").unwrap();
    } else {
        let _ = std::fs::remove_file(ctl.join("health"));
    }
}

fn another_revision_from_3(polls: usize, ctl: &Path) {
    if polls == 3 {
        std::fs::write(ctl.join("live_rev"), "0ld0ld0ld0").unwrap();
    }
}

#[tokio::test]
async fn a_healthy_service_ends_healthy_with_no_action() {
    check(Scenario {
        name: "healthy",
        service: Service::Status(200),
        live: Some("$REV"),
        rollback: Some(FIX),
        hook: no_change,
        verdict: "HEALTHY",
        action: "none",
        polls: 10,
        rollback_ran: false,
    })
    .await;
}

#[tokio::test]
async fn five_hundreds_fail_early_and_roll_back_with_verification() {
    check(Scenario {
        name: "500s, rollback fixes it",
        service: Service::Status(500),
        live: Some("$REV"),
        rollback: Some(FIX),
        hook: no_change,
        verdict: "FAILED",
        action: "rollback",
        polls: 3,
        rollback_ran: true,
    })
    .await;
}

#[tokio::test]
async fn a_rollback_that_does_not_help_or_fails_is_rollback_failed_and_alerts() {
    check(Scenario {
        name: "rollback does not help",
        service: Service::Status(500),
        live: Some("$REV"),
        rollback: Some(NO_FIX),
        hook: no_change,
        verdict: "FAILED",
        action: "rollback_failed",
        polls: 3,
        rollback_ran: true,
    })
    .await;
    check(Scenario {
        name: "rollback command fails",
        service: Service::Status(503),
        live: Some("$REV"),
        rollback: Some("echo 'no previous release' >&2; exit 7"),
        hook: no_change,
        verdict: "FAILED",
        action: "rollback_failed",
        polls: 3,
        rollback_ran: false,
    })
    .await;
    check(Scenario {
        name: "no rollback command",
        service: Service::Status(503),
        live: Some("$REV"),
        rollback: None,
        hook: no_change,
        verdict: "FAILED",
        action: "alert",
        polls: 3,
        rollback_ran: false,
    })
    .await;
}

#[tokio::test]
async fn a_changed_or_unknown_live_revision_alerts_instead_of_rolling_back() {
    check(Scenario {
        name: "another revision live",
        service: Service::Status(500),
        live: Some("0ld0ld0ld0"),
        rollback: Some(FIX),
        hook: no_change,
        verdict: "FAILED",
        action: "alert",
        polls: 3,
        rollback_ran: false,
    })
    .await;
    check(Scenario {
        name: "no revision_url",
        service: Service::Status(500),
        live: None,
        rollback: Some(FIX),
        hook: no_change,
        verdict: "FAILED",
        action: "alert",
        polls: 3,
        rollback_ran: false,
    })
    .await;
    // Nothing answers at all, not even the revision endpoint: the service is down, nothing
    // newer replaced it, so it is rolled back (here the rollback cannot bring the closed ports
    // back: rollback_failed, alerted).
    check(Scenario {
        name: "all connections refused",
        service: Service::Refused,
        live: Some("$REV"),
        rollback: Some(FIX),
        hook: no_change,
        verdict: "FAILED",
        action: "rollback_failed",
        polls: 3,
        rollback_ran: true,
    })
    .await;
}

#[tokio::test]
async fn mixed_or_lost_evidence_ends_degraded_with_an_alert() {
    check(Scenario {
        name: "2 FAIL polls",
        service: Service::Status(200),
        live: Some("$REV"),
        rollback: Some(FIX),
        hook: fail_at_4_and_7,
        verdict: "DEGRADED",
        action: "alert",
        polls: 10,
        rollback_ran: false,
    })
    .await;
    check(Scenario {
        name: "revision replaced mid-watch",
        service: Service::Status(200),
        live: Some("$REV"),
        rollback: Some(FIX),
        hook: another_revision_from_3,
        verdict: "DEGRADED",
        action: "alert",
        polls: 10,
        rollback_ran: false,
    })
    .await;
}

// ---- sentinel trouble and restarts ---------------------------------------------------------

#[tokio::test]
async fn a_corrupt_armed_file_ends_degraded_with_the_loss_said_never_healthy() {
    let fx = Fx::new().await;
    fx.arm();
    let dir = fx.watch().dir().unwrap().to_path_buf();
    std::fs::write(dir.join("armed"), b"{\"params\": trunc").unwrap();
    let run = fx.run(fx.first_content()).await;
    assert!(matches!(
        exec().execute(&run).await.unwrap(),
        StageEffect::Produced { outcome: None }
    ));
    let fm = fx.log().unwrap();
    assert_eq!(fm.get_str("post_deploy_status"), Some("DEGRADED"));
    assert_eq!(fm.get_str("action_taken"), Some("alert"));
    assert!(
        fm.get_str("reason").unwrap().contains("evidence lost"),
        "{fm:?}"
    );
    assert_eq!(
        fx.events_of(events::POST_DEPLOY_EVIDENCE_LOST).await.len(),
        1
    );
    assert_eq!(fx.events_of(events::POST_DEPLOY_ALERT).await.len(), 1);
    assert!(fx.watch().is_done());
}

/// Corrupts the series once, when it holds 5 polls (the series that replaces it reaches 5
/// polls again before the watch ends: that one is left alone).
fn corrupt_series_at_5(polls: usize, ctl: &Path) {
    let dir = ctl
        .parent()
        .unwrap()
        .join("repos/.post-deploy-state-app")
        .join(ITEM);
    if polls == 5 && !dir.join("series.corrupt").exists() {
        std::fs::write(dir.join("series"), b"[{\"tick\":0,").unwrap();
    }
}

#[tokio::test]
async fn a_series_corrupted_mid_watch_is_never_healthy() {
    // Polls 5..9 alone would satisfy HEALTHY (5 of 10 valid, last 2 PASS), but polls 0..4
    // are lost: the verdict is DEGRADED with the loss said.
    let fx = Fx::new().await;
    fx.arm();
    fx.drive(&exec(), corrupt_series_at_5).await;
    let fm = fx.log().unwrap();
    assert_eq!(fm.get_str("post_deploy_status"), Some("DEGRADED"), "{fm:?}");
    assert!(
        fm.get_str("reason").unwrap().contains("evidence was lost"),
        "{fm:?}"
    );
    assert_eq!(fx.ticks(), vec![5, 6, 7, 8, 9]);
    assert!(!fx.events_of(events::POST_DEPLOY_ALERT).await.is_empty());
}

#[tokio::test]
async fn without_an_armed_watch_the_end_is_degraded_and_alerts_only_if_one_was_expected() {
    // A health_url is configured, so a watch was expected: its state is lost.
    let fx = Fx::new().await;
    let run = fx.run(fx.first_content()).await;
    exec().execute(&run).await.unwrap();
    let fm = fx.log().unwrap();
    assert_eq!(
        (fm.get_str("post_deploy_status"), fm.get_str("action_taken")),
        (Some("DEGRADED"), Some("alert"))
    );
    assert_eq!(
        fx.events_of(events::POST_DEPLOY_EVIDENCE_LOST).await.len(),
        1
    );

    // No health_url: the deploy armed nothing by design; DEGRADED (no evidence), and an
    // operator is told: nothing verified production.
    let mut fx = Fx::new().await;
    fx.repo.health_url = None;
    let run = fx.run(fx.first_content()).await;
    exec().execute(&run).await.unwrap();
    let fm = fx.log().unwrap();
    assert_eq!(
        (fm.get_str("post_deploy_status"), fm.get_str("action_taken")),
        (Some("DEGRADED"), Some("alert"))
    );
    let alerts = fx.events_of(events::POST_DEPLOY_ALERT).await;
    assert_eq!(alerts.len(), 1);
    assert!(
        alerts[0].message.contains("no health_url"),
        "{}",
        alerts[0].message
    );
    assert!(
        fx.events_of(events::POST_DEPLOY_EVIDENCE_LOST)
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn a_done_watch_makes_any_job_a_no_op() {
    let fx = Fx::new().await;
    fx.arm();
    assert!(fx.watch().mark_done("HEALTHY action=none"));
    let before = fx.db.store.task_events(fx.task.id).await.unwrap().len();
    let run = fx.run(fx.first_content()).await;
    assert!(matches!(
        exec().execute(&run).await.unwrap(),
        StageEffect::Produced { outcome: None }
    ));
    assert_eq!(
        fx.db.store.task_events(fx.task.id).await.unwrap().len(),
        before
    );
    assert!(fx.log().is_none(), "nothing written");
    assert!(fx.ticks().is_empty(), "nothing polled");
}

#[tokio::test]
async fn the_first_poll_waits_for_its_slot_without_consuming_a_tick() {
    let fx = Fx::new().await;
    fx.arm();
    fx.db.clock.advance_ms(10_000);
    let seq = fx.task.stage_seq;
    let run = fx.run(fx.first_content()).await;
    let marker = match exec().execute(&run).await.unwrap() {
        StageEffect::Requeue {
            delay_ms, marker, ..
        } => {
            assert_eq!(delay_ms, 20_000, "the rest of the initial delay");
            marker
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(marker, format!("{} n=1", markers::monitor_wait_prefix(seq)));
    assert!(fx.ticks().is_empty());
    // The wait job runs at the slot: tick 0, and no tick job was counted for it.
    fx.db.clock.advance_ms(20_000);
    let run = fx
        .run(
            StageJob::from_content(&fx.first_content())
                .unwrap()
                .with_marker(&marker),
        )
        .await;
    match exec().execute(&run).await.unwrap() {
        StageEffect::Requeue {
            delay_ms, marker, ..
        } => {
            assert_eq!(delay_ms, 30_000);
            assert_eq!(
                marker,
                format!("{} tick=1", markers::monitor_tick_prefix(seq))
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fx.ticks(), vec![0]);
    assert_eq!(fx.count(&markers::monitor_tick_prefix(seq)).await, 0);
}

#[tokio::test]
async fn ticks_are_recovered_from_the_queue_neither_lost_nor_repeated() {
    let fx = Fx::new().await;
    let armed = fx.arm();
    let seq = fx.task.stage_seq;
    let at = |s: i64| armed.armed_at_ms + s * 1000;
    let with = |m: &str| {
        StageJob::from_content(&fx.first_content())
            .unwrap()
            .with_marker(m)
    };

    // Slot 0 and 1 polled normally.
    fx.db.clock.set(at(30));
    let j0 = fx.run(fx.first_content()).await;
    let StageEffect::Requeue { marker: m1, .. } = exec().execute(&j0).await.unwrap() else {
        panic!()
    };
    fx.db.clock.set(at(60));
    let j1 = fx.run(with(&m1)).await;
    let j1_id = j1.job.id;
    let StageEffect::Requeue { marker: m2, .. } = exec().execute(&j1).await.unwrap() else {
        panic!()
    };
    assert_eq!(fx.ticks(), vec![0, 1]);

    // The same job runs again (rescued after a crash) within its slot: not repeated.
    fx.db.clock.set(at(70));
    let again = fx.run_of(j1_id).await;
    let StageEffect::Requeue {
        marker: m2b,
        delay_ms,
        ..
    } = exec().execute(&again).await.unwrap()
    else {
        panic!()
    };
    assert_eq!(
        (m2b.as_str(), delay_ms),
        (m2.as_str(), 20_000),
        "same next tick, at its slot"
    );
    assert_eq!(fx.ticks(), vec![0, 1], "tick 1 not polled twice");

    // The worker was down for a while: the next job polls the slot of now, not a burst.
    fx.db.clock.set(at(185));
    let j2 = fx.run(with(&m2)).await;
    let StageEffect::Requeue {
        marker: m3,
        delay_ms,
        ..
    } = exec().execute(&j2).await.unwrap()
    else {
        panic!()
    };
    assert_eq!(
        fx.ticks(),
        vec![0, 1, 5],
        "slots 2-4 skipped (missed), slot 5 = now"
    );
    assert_eq!(delay_ms, 25_000, "next at slot 6 (210 s)");
    assert_eq!(m3, format!("{} tick=6", markers::monitor_tick_prefix(seq)));

    // Finish: slots 6..9 then the deadline.
    let mut marker = m3;
    let mut end = None;
    for s in [210, 240, 270, 300] {
        fx.db.clock.set(at(s));
        let j = fx.run(with(&marker)).await;
        match exec().execute(&j).await.unwrap() {
            StageEffect::Requeue { marker: m, .. } => marker = m,
            // The verdict is reached with the last slot; its own job acts on it.
            StageEffect::Yield { marker: m, .. } => {
                let ending = fx.run(with(&m)).await;
                match exec().execute(&ending).await.unwrap() {
                    StageEffect::Produced { outcome: None } => end = Some(s),
                    other => panic!("{other:?}"),
                }
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(end, Some(300), "ends at the deadline, with the last slot");
    assert_eq!(fx.ticks(), vec![0, 1, 5, 6, 7, 8, 9]);
    // 7 of 10 valid, ≤1 FAIL, last 2 PASS: missed slots are not proof of failure.
    assert_eq!(
        fx.log().unwrap().get_str("post_deploy_status"),
        Some("HEALTHY")
    );
}

#[tokio::test]
async fn a_rerun_after_the_rollback_started_never_rolls_back_twice() {
    let mut fx = Fx::new().await;
    std::fs::write(fx.ctl.join("health"), "500").unwrap();
    fx.repo.rollback = Some(NO_FIX.replace("$CTL", &fx.ctl.display().to_string()));
    fx.arm();
    fx.drive(&exec(), no_change).await;
    assert_eq!(read(&fx.ctl.join("rolled_back")).lines().count(), 1);
    // Crash before `done` landed: the last job runs again.
    let dir = fx.watch().dir().unwrap().to_path_buf();
    std::fs::remove_file(dir.join("done")).unwrap();
    let jobs = fx.db.store.task_jobs(fx.task.id).await.unwrap();
    let last = jobs.iter().map(|j| j.id).max().unwrap();
    let rerun = fx.run_of(last).await;
    exec().execute(&rerun).await.unwrap();
    assert_eq!(
        read(&fx.ctl.join("rolled_back")).lines().count(),
        1,
        "the rollback ran once"
    );
    assert_eq!(
        fx.events_of(events::POST_DEPLOY_ROLLBACK_STARTED)
            .await
            .len(),
        1
    );
    assert_eq!(
        fx.log().unwrap().get_str("action_taken"),
        Some("rollback_failed")
    );
}

#[tokio::test]
async fn a_rerun_after_a_rollback_that_worked_verifies_it_instead_of_seeing_another_revision() {
    let mut fx = Fx::new().await;
    std::fs::write(fx.ctl.join("health"), "500").unwrap();
    fx.repo.rollback = Some(FIX.replace("$CTL", &fx.ctl.display().to_string()));
    fx.arm();
    fx.drive(&exec(), no_change).await;
    assert_eq!(fx.log().unwrap().get_str("action_taken"), Some("rollback"));
    // Crash after the rollback ran, before `done` landed: the previous release is live now,
    // so a fresh compare-and-swap would see "another revision" and only alert.
    let dir = fx.watch().dir().unwrap().to_path_buf();
    std::fs::remove_file(dir.join("done")).unwrap();
    std::fs::remove_file(fx.artifact_log_path()).unwrap();
    let jobs = fx.db.store.task_jobs(fx.task.id).await.unwrap();
    let last = jobs.iter().map(|j| j.id).max().unwrap();
    exec().execute(&fx.run_of(last).await).await.unwrap();
    assert_eq!(read(&fx.ctl.join("rolled_back")).lines().count(), 1);
    let fm = fx.log().unwrap();
    assert_eq!(fm.get_str("post_deploy_status"), Some("FAILED"));
    assert_eq!(
        fm.get_str("action_taken"),
        Some("rollback"),
        "the started rollback is verified, not replaced by an alert"
    );
    assert!(fx.events_of(events::POST_DEPLOY_ALERT).await.is_empty());
}

// ---- GET /queue and the recovery sweep -----------------------------------------------------

#[tokio::test]
async fn the_recovery_sweep_ends_an_armed_watch_whose_task_does_not_exist() {
    let fx = Fx::new().await;
    let orphan = WatchState::new(&fx.repos_dir, "app", "ORCH-404");
    let record = orch_deploystate::ArmedRecord::new(Default::default(), 5, REV);
    assert_eq!(orphan.arm(&record), orch_deploystate::ArmOutcome::Armed);
    // A corrupt one too: an operator saw it listed with a made-up deadline before.
    let corrupt = WatchState::new(&fx.repos_dir, "app", "ORCH-405");
    assert_eq!(corrupt.arm(&record), orch_deploystate::ArmOutcome::Armed);
    std::fs::write(corrupt.dir().unwrap().join("armed"), "not json").unwrap();
    let active = active_watches(&fx.repos_dir);
    assert_eq!(active.len(), 2, "{active:?}");
    assert!(
        active[1]
            .problem
            .as_deref()
            .is_some_and(|p| p.contains("armed unusable")),
        "{active:?}"
    );
    assert_eq!(active[1].deadline_ms, None, "never a made-up deadline");

    let swept = recover_watches(&fx.db.store, &fx.repos_dir, "node-a").await;
    assert_eq!(
        swept,
        [
            ("ORCH-404".to_owned(), RecoveryAction::NoTask),
            ("ORCH-405".to_owned(), RecoveryAction::NoTask)
        ]
    );
    assert!(orphan.is_done() && corrupt.is_done());
    assert!(active_watches(&fx.repos_dir).is_empty());
    // Idempotent: nothing is left to sweep.
    assert!(
        recover_watches(&fx.db.store, &fx.repos_dir, "node-a")
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn the_recovery_sweep_reenqueues_a_stranded_watch_once_pinned_to_this_node() {
    let fx = Fx::new().await;
    fx.arm();
    let seq = fx.task.stage_seq;
    // Slot 0 was polled; its follow-up tick job was then lost: the watch is stranded.
    let first = fx.run(fx.first_content()).await; // waits
    let StageEffect::Requeue {
        delay_ms, marker, ..
    } = exec().execute(&first).await.unwrap()
    else {
        panic!()
    };
    fx.db.clock.advance_ms(i64::try_from(delay_ms).unwrap());
    let tick0 = fx
        .run(
            StageJob::from_content(&fx.first_content())
                .unwrap()
                .with_marker(&marker),
        )
        .await;
    exec().execute(&tick0).await.unwrap();
    fx.db
        .store
        .cancel_task_jobs(fx.task.id, None)
        .await
        .unwrap();

    let active = active_watches(&fx.repos_dir);
    assert_eq!(active.len(), 1);
    assert_eq!(
        (
            active[0].work_item_id.as_str(),
            active[0].revision.as_deref(),
            active[0].polls,
            active[0].planned_polls
        ),
        (ITEM, Some(REV), 1, Some(10))
    );
    assert_eq!(active[0].problem, None);

    let swept = recover_watches(&fx.db.store, &fx.repos_dir, "node-a").await;
    let job_id = match swept.as_slice() {
        [
            (
                item,
                RecoveryAction::Enqueued {
                    job_id,
                    duplicate: false,
                },
            ),
        ] if item == ITEM => *job_id,
        other => panic!("{other:?}"),
    };
    let job = fx.db.store.get_job(job_id).await.unwrap().unwrap();
    assert_eq!(job.node.as_deref(), Some("node-a"));
    assert_eq!(job.agent, AGENT);
    assert_eq!(
        job.dedupe_key.as_deref(),
        Some(format!("monitor-recover:{}:{seq}:1", fx.task.id).as_str())
    );
    assert!(
        job.task_content
            .contains(&markers::monitor_tick_prefix(seq)),
        "{}",
        job.task_content
    );
    assert_eq!(fx.events_of(events::POST_DEPLOY_RECOVERED).await.len(), 1);

    // A second sweep finds the live job and does nothing.
    let again = recover_watches(&fx.db.store, &fx.repos_dir, "node-a").await;
    assert_eq!(
        again,
        vec![(ITEM.to_owned(), RecoveryAction::AlreadyQueued { job_id })]
    );

    // The restored job completes the watch.
    fx.db.clock.advance_ms(30_000);
    let restored = fx.run_of(job_id).await;
    assert!(matches!(
        exec().execute(&restored).await.unwrap(),
        StageEffect::Requeue { .. }
    ));
    assert_eq!(fx.ticks(), vec![0, 1]);

    // Once the task left observe, the sweep leaves the watch alone; once done, it is gone.
    fx.db
        .store
        .cancel_task_jobs(fx.task.id, None)
        .await
        .unwrap();
    fx.db
        .store
        .advance_stage(AdvanceStage {
            task_id: fx.task.id,
            expected_stage: "observe".parse().unwrap(),
            new_stage: "lessons".parse().unwrap(),
            fence: Fence::Seq(seq),
            event: NewEvent::new("stage.changed", "test"),
            next_job: None,
        })
        .await
        .unwrap();
    let moved = recover_watches(&fx.db.store, &fx.repos_dir, "node-a").await;
    assert_eq!(
        moved,
        vec![(
            ITEM.to_owned(),
            RecoveryAction::NotObserving {
                stage: "lessons".into()
            }
        )]
    );
    assert!(fx.watch().mark_done("x"));
    assert!(active_watches(&fx.repos_dir).is_empty());
    assert!(
        recover_watches(&fx.db.store, &fx.repos_dir, "node-a")
            .await
            .is_empty()
    );
}

/// The hook of the supersede table: a newer deploy (ORCH-99) arms its watch once three polls
/// are in, as its deployer would.
fn superseded_at_3(polls: usize, ctl: &Path) {
    if polls == 3 {
        let repos = ctl.parent().unwrap().join("repos");
        let marked = supersede_others(&repos, "app", "ORCH-99", "b0b0b0b0b0b0");
        assert_eq!(marked, [ITEM]);
    }
}

/// As [`superseded_at_3`], with the second poll failing.
fn fail_at_1_superseded_at_3(polls: usize, ctl: &Path) {
    if polls == 1 {
        std::fs::write(ctl.join("health"), "500").unwrap();
    } else {
        let _ = std::fs::remove_file(ctl.join("health"));
    }
    superseded_at_3(polls, ctl);
}

/// The one place the supersede table runs a watch: `hook` supersedes it after 3 polls.
async fn check_superseded(name: &str, hook: fn(usize, &Path), action: &str) {
    let mut fx = Fx::new().await;
    fx.repo.rollback = Some(FIX.replace("$CTL", &fx.ctl.display().to_string()));
    fx.with_alert_hooks();
    fx.arm();
    // Another repo's watch is not superseded by a deploy of `app`.
    let other = WatchState::new(&fx.repos_dir, "billing", "ORCH-98");
    assert_eq!(
        other.arm(&ArmedRecord::new(PARAMS, 0, "cafecafecafe")),
        ArmOutcome::Armed
    );
    let requeues = fx.drive(&exec(), hook).await;
    assert_eq!(
        requeues.len(),
        4,
        "{name}: a wait and 3 ticks: {requeues:?}"
    );
    assert_eq!(fx.ticks(), [0, 1, 2], "{name}: no poll after the supersede");
    let fm = fx.log().unwrap_or_else(|| panic!("{name}: no log"));
    assert_eq!(fm.get_str("post_deploy_status"), Some("DEGRADED"), "{name}");
    assert_eq!(fm.get_str("action_taken"), Some(action), "{name}");
    let reason = fm.get_str("reason").unwrap_or_default().to_owned();
    assert!(reason.contains("superseded by ORCH-99"), "{name}: {reason}");
    assert!(fx.watch().is_done(), "{name}");
    assert!(!other.is_done(), "{name}: the other repo's watch runs on");
    assert!(
        read(&fx.ctl.join("rolled_back")).is_empty(),
        "{name}: never rolled back"
    );
    assert_eq!(
        fx.events_of(events::POST_DEPLOY_SUPERSEDED).await.len(),
        1,
        "{name}"
    );
    let (lines, hooks) = fx.delivered().await;
    let alerted = action == "alert";
    assert_eq!(lines.len(), usize::from(alerted), "{name}: {lines:?}");
    assert_eq!(hooks.len(), usize::from(alerted), "{name}: {hooks:?}");
}

#[tokio::test]
async fn a_newer_deploy_of_the_repo_supersedes_the_watch_without_a_rollback() {
    check_superseded(
        "healthy so far: cut short, no alert",
        superseded_at_3,
        "none",
    )
    .await;
    check_superseded(
        "a FAIL poll seen: alert, no rollback",
        fail_at_1_superseded_at_3,
        "alert",
    )
    .await;
}

/// A rollback killed with orch before it ended (no result recorded) and production not back:
/// the re-run runs it again — also after earlier reruns that orch's death interrupted too — up
/// to `ROLLBACK_RERUNS` times per visit, never more (a rollback that kills orch cannot loop).
#[tokio::test]
async fn an_interrupted_rollback_runs_again_a_bounded_number_of_times() {
    for earlier_reruns in [
        0,
        orch_runner::deploy::ROLLBACK_RERUNS - 1,
        orch_runner::deploy::ROLLBACK_RERUNS,
    ] {
        let mut fx = Fx::new().await;
        std::fs::write(fx.ctl.join("health"), "500").unwrap();
        fx.repo.rollback = Some(FIX.replace("$CTL", &fx.ctl.display().to_string()));
        fx.arm();
        // The first run was recorded as started and then died with orch (no command effect),
        // and so did `earlier_reruns` reruns.
        let seq = serde_json::json!({"seq": fx.task.stage_seq}).to_string();
        let mut interrupted = vec![events::POST_DEPLOY_ROLLBACK_STARTED];
        interrupted.extend((0..earlier_reruns).map(|_| events::POST_DEPLOY_ROLLBACK_RERUN));
        for kind in interrupted {
            fx.db
                .store
                .append_event(
                    NewEvent::new(kind, "interrupted")
                        .task(fx.task.id)
                        .data(seq.clone()),
                )
                .await
                .unwrap();
        }
        fx.drive(&exec(), no_change).await;
        let runs = read(&fx.ctl.join("rolled_back")).lines().count();
        let reruns = fx.events_of(events::POST_DEPLOY_ROLLBACK_RERUN).await;
        let action = fx.log().unwrap().get_str("action_taken").map(str::to_owned);
        if earlier_reruns < orch_runner::deploy::ROLLBACK_RERUNS {
            assert_eq!(runs, 1, "run again after {earlier_reruns} earlier reruns");
            assert_eq!(reruns.len(), earlier_reruns as usize + 1);
            let last = reruns.last().unwrap();
            assert!(
                last.message
                    .contains(&format!("rerun {} of at most", earlier_reruns + 1)),
                "{}",
                last.message
            );
            assert_eq!(action.as_deref(), Some("rollback"));
        } else {
            assert_eq!(runs, 0, "the bound: verified only");
            assert_eq!(reruns.len(), earlier_reruns as usize);
            assert_eq!(action.as_deref(), Some("rollback_failed"));
        }
    }
}

/// A rollback whose command already ended successfully (`post_deploy.rollback_ran`) and whose
/// verification orch's death interrupted is never run again, even while production is not
/// back (a rollback such as `rollout undo` run twice would put the bad revision back): the
/// re-run only verifies.
#[tokio::test]
async fn a_rollback_that_ran_is_only_verified_again() {
    let mut fx = Fx::new().await;
    std::fs::write(fx.ctl.join("health"), "500").unwrap();
    fx.repo.rollback = Some(FIX.replace("$CTL", &fx.ctl.display().to_string()));
    fx.arm();
    let seq = serde_json::json!({"seq": fx.task.stage_seq}).to_string();
    for kind in [
        events::POST_DEPLOY_ROLLBACK_STARTED,
        events::POST_DEPLOY_ROLLBACK_RAN,
    ] {
        fx.db
            .store
            .append_event(
                NewEvent::new(kind, "earlier")
                    .task(fx.task.id)
                    .data(seq.clone()),
            )
            .await
            .unwrap();
    }
    fx.drive(&exec(), no_change).await;
    assert_eq!(read(&fx.ctl.join("rolled_back")).lines().count(), 0);
    assert!(
        fx.events_of(events::POST_DEPLOY_ROLLBACK_RERUN)
            .await
            .is_empty()
    );
    assert_eq!(
        fx.log().unwrap().get_str("action_taken"),
        Some("rollback_failed"),
        "production is not back and the command is not run again"
    );
}

/// A FAILED watch whose change cannot be reverted because the revert itself cannot run (here:
/// no git repository where orch's clone should be) has no verdict on the revert: the ending's
/// attempt fails and holds nothing, so the job's next attempt tries again; only the job's last
/// attempt holds the repo, naming the error. (A hold waits for an operator: one written by an
/// attempt that merely hit a transient error stopped every later release of the repo.)
#[tokio::test]
async fn a_revert_that_cannot_run_holds_the_repo_only_on_the_last_attempt() {
    let mut fx = Fx::new().await;
    std::fs::write(fx.ctl.join("health"), "500").unwrap();
    fx.repo.rollback = Some(FIX.replace("$CTL", &fx.ctl.display().to_string()));
    fx.arm();
    common::record_promoted(&fx.db, &fx.task, &"0".repeat(40), REV).await;
    let (content, _) = fx.to_the_ending(&exec(), no_change).await;
    let content = content.expect("a FAILED watch has an ending job");
    let ending = |max_attempts: i64| {
        NewJob::new(AGENT, content.clone())
            .task(fx.task.id)
            .max_attempts(max_attempts)
    };
    // Attempt 1 of 3: an error, nothing held, the watch not ended.
    let job = fx.db.store.enqueue(ending(3)).await.unwrap().job_id;
    let run = fx.run_of(job).await;
    let err = format!("{:#}", exec().execute(&run).await.unwrap_err());
    assert!(err.contains("did not finish (attempt 1 of 3)"), "{err}");
    assert!(fx.events_of(events::RELEASE_HELD).await.is_empty());
    assert!(!fx.watch().is_done(), "the next attempt ends the watch");
    assert_eq!(fx.events_of(events::POST_DEPLOY_ROLLBACK).await.len(), 1);
    // The job's last attempt: the repo holds, with the error, and the watch ends.
    let job = fx.db.store.enqueue(ending(1)).await.unwrap().job_id;
    let run = fx.run_of(job).await;
    match exec().execute(&run).await.unwrap() {
        StageEffect::Produced { outcome: None } => {}
        other => panic!("unexpected effect {other:?}"),
    }
    let held = fx.events_of(events::RELEASE_HELD).await;
    assert_eq!(held.len(), 1, "{held:?}");
    assert!(
        held[0].message.contains("failed in all 1 attempts"),
        "{}",
        held[0].message
    );
    assert!(fx.watch().is_done());
    assert_eq!(
        read(&fx.ctl.join("rolled_back")).lines().count(),
        1,
        "the rollback ran once"
    );
    assert_eq!(
        fx.events_of(events::POST_DEPLOY_ROLLBACK).await.len(),
        1,
        "the second attempt replays the rollback's recorded outcome, never verifies again"
    );
}

/// Ends the watch as a failed task does, then has an operator retry it into `observe`.
async fn fail_then_retry(fx: &Fx) {
    fx.arm();
    assert!(
        fx.watch()
            .mark_done("the task failed: the worker died 10 times")
    );
    fx.db
        .store
        .append_event(
            NewEvent::new(
                events::TASK_RETRIED,
                "retried at stage observe by an operator",
            )
            .task(fx.task.id)
            .data(serde_json::json!({"from": "failed", "to": "observe"}).to_string()),
        )
        .await
        .unwrap();
}

/// A task that failed in `observe`, retried while its revision is still live, is watched again
/// from the start: a fresh watch, polls, a verdict, the log.
#[tokio::test]
async fn a_retried_watch_watches_the_live_revision_again() {
    let fx = Fx::new().await;
    fail_then_retry(&fx).await;
    fx.drive(&exec(), no_change).await;
    assert_eq!(fx.events_of(events::POST_DEPLOY_REARMED).await.len(), 1);
    assert!(!fx.ticks().is_empty(), "polled again");
    let verdicts = fx.events_of(events::POST_DEPLOY_VERDICT).await;
    assert_eq!(verdicts.len(), 1);
    assert!(verdicts[0].message.contains("HEALTHY"), "{verdicts:?}");
    let log = fx.log().expect("the log is written");
    assert_eq!(log.get_str("post_deploy_status"), Some("HEALTHY"));
    // A later job of the same visit (a duplicate, a crash after the verdict) does nothing more.
    let run = fx.run(fx.first_content()).await;
    assert!(matches!(
        exec().execute(&run).await.unwrap(),
        StageEffect::Produced { outcome: None }
    ));
    assert_eq!(fx.events_of(events::POST_DEPLOY_REARMED).await.len(), 1);
}

/// Retried after another revision went live (a later deploy): nothing of this item can be
/// watched; the visit ends DEGRADED saying what is live, without polling or rolling back.
#[tokio::test]
async fn a_retried_watch_whose_revision_is_gone_ends_degraded() {
    let mut fx = Fx::new().await;
    fx.repo.rollback = Some(NO_FIX.replace("$CTL", &fx.ctl.display().to_string()));
    fail_then_retry(&fx).await;
    std::fs::write(fx.ctl.join("live_rev"), "feedfacefeed").unwrap();
    std::fs::write(fx.ctl.join("health"), "500").unwrap();
    fx.drive(&exec(), no_change).await;
    assert!(fx.events_of(events::POST_DEPLOY_REARMED).await.is_empty());
    assert!(fx.ticks().is_empty(), "nothing polled");
    let verdicts = fx.events_of(events::POST_DEPLOY_VERDICT).await;
    assert_eq!(verdicts.len(), 1);
    assert!(
        verdicts[0].message.contains("DEGRADED") && verdicts[0].message.contains("feedfacefeed"),
        "{verdicts:?}"
    );
    assert_eq!(
        fx.log().expect("the log").get_str("post_deploy_status"),
        Some("DEGRADED")
    );
    assert!(!fx.ctl.join("rolled_back").exists(), "no rollback");
}

// ---- the control probe -------------------------------------------------------------------

/// With a control endpoint configured, a monitor that cannot reach anything (the service and
/// the control both refuse connections) is blind: its polls are ERROR, never FAIL, and the
/// watch ends DEGRADED (not enough evidence) with an alert, never a rollback. With the control
/// answering, the same unreachable service is the service's failure: FAILED.
#[tokio::test]
async fn a_blind_monitor_is_error_never_fail_and_never_rolls_back() {
    let mut fx = Fx::new().await;
    fx.repo.health_url = Some(closed_port_url("/health").await);
    fx.repo.revision_url = Some(closed_port_url("/revision").await);
    fx.repo.control_url = Some(closed_port_url("/status").await);
    fx.with_alert_hooks();
    fx.arm();
    fx.drive(&exec(), no_change).await;
    let fm = fx.log().expect("the watch wrote its log");
    assert_eq!(fm.get_str("post_deploy_status"), Some("DEGRADED"), "{fm:?}");
    assert_eq!(fm.get_str("action_taken"), Some("alert"), "{fm:?}");
    let polls = fx.watch().series().polls;
    assert!(!polls.is_empty());
    for p in &polls {
        assert_eq!(p.status(), CheckOutcome::Error, "{p:?}");
        assert!(
            p.checks
                .iter()
                .any(|c| c.name == "control" && c.outcome == CheckOutcome::Error),
            "{p:?}"
        );
        assert!(
            p.checks.iter().all(|c| c.outcome != CheckOutcome::Fail),
            "{p:?}"
        );
    }
    assert!(fx.events_of(events::POST_DEPLOY_ROLLBACK).await.is_empty());

    let mut fx = Fx::new().await;
    fx.repo.health_url = Some(closed_port_url("/health").await);
    fx.repo.control_url = Some(format!("{}/health", fx.base));
    fx.arm();
    fx.drive(&exec(), no_change).await;
    let fm = fx.log().expect("the watch wrote its log");
    assert_eq!(fm.get_str("post_deploy_status"), Some("FAILED"), "{fm:?}");
    let polls = fx.watch().series().polls;
    assert!(
        polls
            .iter()
            .all(|p| p.checks.iter().all(|c| c.name != "control")),
        "a control check that answers is not recorded: {polls:?}"
    );
}
