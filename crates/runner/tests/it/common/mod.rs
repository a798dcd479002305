//! The fixture the runner's integration tests share: a real git repo with a worktree, a migrated
//! SQLite `TestDb`, a task, and the `StageRun` the engine would build for it. One `repo_config`
//! names every `RepoConfig` field, so a new config field touches this file only; each test file
//! overrides what it needs with `RepoConfig { .., ..repo_config(..) }`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use orch_domain::config::{MergeStrategy, PostDeployConfig, RepoConfig, Settings};
use orch_domain::ids::WorkItemId;
use orch_domain::pipeline::Pipeline;
use orch_exec::{Git, Pathspec};
use orch_runner::counters::Counters;
use orch_runner::engine::{StageJob, StageRun};
use orch_store::testing::TestDb;
use orch_store::{Claim, Job, Lease, NewEvent, NewJob, NewTask, Task, WorkItemSpec};
use tokio_util::sync::CancellationToken;

/// The work item of the stage fixtures ([`Fixture`]).
pub const ID: &str = "DEMO-1";

/// A repo's configuration with every field at the tests' baseline: work item prefix `prefix`,
/// branch `main`, no commands, no URLs, fast-forward merges.
pub fn repo_config(prefix: &str) -> RepoConfig {
    RepoConfig {
        path: None,
        url: None,
        default_branch: "main".into(),
        prefix: prefix.parse().unwrap(),
        test: None,
        test_timeout_s: 60,
        staging: Vec::new(),
        staging_smoke: Vec::new(),
        deploy: None,
        deploy_timeout_s: 900,
        rollback: None,
        health_url: None,
        revision_url: None,
        alert: None,
        alert_webhook: None,
        alert_webhook_secret: None,
        alert_webhook_format: Default::default(),
        staging_health_url: None,
        merge_strategy: MergeStrategy::Ff,
        post_deploy: PostDeployConfig::default(),
        staging_defer_limit: 2,
        staging_defer_delay_s: None,
        lessons_file: "LESSONS.md".into(),
        on_failure: Default::default(),
        control_url: None,
        // On the host: these fixtures test the runner's logic with scripts and files in the
        // test's temporary directories; the sandboxed paths are tested on the real binary
        // (crates/orch/tests: the demo, hostile/, agent_clis) and in crates/exec.
        sandbox: orch_domain::config::SandboxConfig {
            enabled: false,
            ..Default::default()
        },
        env: Vec::new(),
        forge: None,
    }
}

/// Makes `dir` a git repo on `main` with one commit holding `README.md` = `readme`.
pub async fn init_repo(git: &Git, dir: &Path, readme: &str) {
    git.init_repo(dir, "main").await.unwrap();
    std::fs::write(dir.join("README.md"), readme).unwrap();
    git.add_and_commit(dir, &Pathspec::All, "init")
        .await
        .unwrap();
}

/// The `StageRun` the engine builds for `job` of `task`: stage, repo name and work item come
/// from the task; the repos dir is `repo_dir`'s parent, the worktree
/// `<repo_dir>/worktrees/<item>`. Callers override the rest (`node`, `loops`, `counters`, ...)
/// with `StageRun { .., ..stage_run(..) }`.
pub fn stage_run(
    db: &TestDb,
    task: &Task,
    job: Job,
    lease: Lease,
    repo_dir: &Path,
    repo: RepoConfig,
) -> StageRun {
    let work_item: WorkItemId = task.work_item_id.clone();
    let worktree = repo_dir.join("worktrees").join(task.work_item_id.as_str());
    StageRun {
        store: db.store.clone(),
        job,
        lease,
        cancel: CancellationToken::new(),
        task: task.clone(),
        work_item: work_item.clone(),
        stage: Pipeline::default_pipeline()
            .stage(&task.stage)
            .unwrap()
            .clone(),
        repo_name: task.repo.clone(),
        repo,
        settings: Settings::default(),
        repos_dir: repo_dir.parent().unwrap().to_path_buf(),
        repo_dir: repo_dir.to_path_buf(),
        artifact_dir: worktree.join(work_item.artifact_dir()),
        worktree,
        feedback: None,
        loops: 0,
        git: Git::new(),
        counters: Arc::new(Counters::new()),
        node: "test-node".into(),
        prep: Default::default(),
        start: None,
    }
}

/// Enqueues a job of `agent` carrying `content` for `task`; returns it with a lease of attempt 1,
/// as a claim would.
pub async fn enqueue(db: &TestDb, task: &Task, agent: &str, content: String) -> (Job, Lease) {
    let job_id = db
        .store
        .enqueue(NewJob::new(agent, content).task(task.id))
        .await
        .unwrap()
        .job_id;
    first_lease(db, job_id).await
}

/// Job `job_id` started as a claim starts it (running, attempt bumped, leased), with its lease:
/// the executors' fenced writes hold as they do in a worker.
pub async fn first_lease(db: &TestDb, job_id: i64) -> (Job, Lease) {
    let lease = orch_store::testing::start_job(&db.store, job_id).await;
    let job = db.store.get_job(job_id).await.unwrap().unwrap();
    (job, lease)
}

/// The `StageRun` of the existing job `job_id` of `task` under its first lease: the one fixture
/// for "run this job as the engine would" ([`stage_run`] with [`first_lease`]).
pub async fn run_of(
    db: &TestDb,
    task: &Task,
    job_id: i64,
    repo_dir: &Path,
    repo: RepoConfig,
) -> StageRun {
    let (job, lease) = first_lease(db, job_id).await;
    stage_run(db, task, job, lease, repo_dir, repo)
}

/// Creates task [`ID`] of repo `demo` at `stage` whose first job (of `agent`) is claimed.
async fn claimed_task(db: &TestDb, stage: &str, agent: &str) -> (Task, Job, Lease) {
    let content = StageJob {
        stage: stage.into(),
        seq: 0,
    }
    .to_content();
    let task = db
        .store
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact(ID.parse().unwrap()),
            repo: "demo".parse().unwrap(),
            title: "a change".into(),
            body: "body".into(),
            stage: stage.parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.created", "created"),
            first_job: Some(NewJob::new(agent, content)),
        })
        .await
        .unwrap();
    let claimed = db
        .store
        .claim(&Claim {
            worker_id: "test".into(),
            limit: 1,
            lease_ms: 60_000,
            kinds: vec![agent.into()],
            node: None,
            node_grace_ms: None,
        })
        .await
        .unwrap()
        .pop()
        .unwrap();
    (task, claimed.job, claimed.lease)
}

/// A store, a repo `demo` with one commit on `main`, a task [`ID`] at a stage with a claimed
/// job, and its worktree on `orch/DEMO-1`; keeps the temp dir and the store alive.
pub struct Fixture {
    /// Held, never read: the test database lives as long as the fixture.
    pub _db: TestDb,
    pub tmp: tempfile::TempDir,
    pub run: StageRun,
    pub counters: Arc<Counters>,
}

impl Fixture {
    /// The fixture at `stage` with a claimed job of `agent` and the repo configured as `repo`.
    pub async fn new(stage: &str, agent: &str, repo: RepoConfig) -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let repo_dir = Fixture::repo_dir_in(&tmp);
        init_repo(&Git::new(), &repo_dir, "demo\n").await;
        Fixture::in_repo(tmp, stage, agent, repo).await
    }

    /// Where the fixture's repo lives under `tmp`: `repos/demo`.
    pub fn repo_dir_in(tmp: &tempfile::TempDir) -> PathBuf {
        tmp.path().join("repos").join("demo")
    }

    /// The fixture over a repo the caller already made at [`Fixture::repo_dir_in`]`(tmp)`.
    pub async fn in_repo(
        tmp: tempfile::TempDir,
        stage: &str,
        agent: &str,
        repo: RepoConfig,
    ) -> Fixture {
        let repo_dir = Fixture::repo_dir_in(&tmp);
        let db = TestDb::sqlite().await;
        let (task, job, lease) = claimed_task(&db, stage, agent).await;
        let git = Git::new();
        let worktree = repo_dir.join("worktrees").join(ID);
        git.worktree_add(&repo_dir, &worktree, &task.branch, "main")
            .await
            .unwrap();
        let counters = Arc::new(Counters::new());
        let run = StageRun {
            git,
            counters: counters.clone(),
            ..stage_run(&db, &task, job, lease, &repo_dir, repo)
        };
        Fixture {
            _db: db,
            tmp,
            run,
            counters,
        }
    }
}

/// Serves `app` on a free loopback port in the background; returns its `http://127.0.0.1:<port>`.
pub async fn listen(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// Records that `task`'s change moved repo `app`'s default branch from `old` to `new` in its
/// current stage visit (`release.promoted`), as a deploy's promotion does: what a revert
/// takes out.
pub async fn record_promoted(db: &TestDb, task: &Task, old: &str, new: &str) {
    let data = serde_json::json!({"repo": "app", "old": old, "new": new, "seq": task.stage_seq});
    db.store
        .append_event(
            NewEvent::new(orch_domain::control::events::RELEASE_PROMOTED, "promoted")
                .task(task.id)
                .data(data.to_string()),
        )
        .await
        .unwrap();
}

/// Delivers every queued webhook notification once, as its `notify` job would (one try each),
/// with `repo` configured as repo `name`; returns each job's content and what the handler
/// answered.
pub async fn deliver_notices(
    db: &TestDb,
    name: &str,
    repo: &RepoConfig,
) -> Vec<(String, orch_runner::worker::Outcome)> {
    use orch_runner::worker::JobHandler as _;
    let config = orch_domain::config::Config {
        settings: Default::default(),
        repos: [(name.parse().unwrap(), repo.clone())].into(),
        agents: Default::default(),
        pipeline: Default::default(),
        prices: Default::default(),
    };
    let handler = orch_runner::notify::NotifyHandler {
        store: db.store.clone(),
        live: orch_runner::live_config::LiveConfig::new(std::sync::Arc::new(config), 0),
    };
    let claimed = db
        .store
        .claim(&Claim {
            worker_id: "notify-test".into(),
            limit: 100,
            lease_ms: 60_000,
            kinds: vec![orch_runner::notify::NOTIFY.into()],
            node: None,
            node_grace_ms: None,
        })
        .await
        .unwrap();
    let mut out = Vec::new();
    for c in claimed {
        let cx = orch_runner::worker::JobContext {
            job: c.job.clone(),
            lease: c.lease,
            store: db.store.clone(),
            worker_id: "notify-test".into(),
            lease_ms: 60_000,
            cancel: Default::default(),
        };
        let outcome = handler.run(cx).await.unwrap();
        out.push((c.job.task_content, outcome));
    }
    out
}
