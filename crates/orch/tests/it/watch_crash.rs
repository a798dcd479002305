//! The post-deploy watch survives crashes (design.md §7, §11; seed ORCH-021 §2–§3) with real
//! processes: the real `orch serve` on the demo repo, the demo's real deploy and rollback
//! scripts and its real Python service. The "greeting" item breaks production health about 2 s
//! after its deploy; while its watch runs, the whole `orch serve` process group is SIGKILLed at
//! seeded random instants and restarted each time. The watch must still count each poll tick
//! once, decide FAILED, and roll back exactly once.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::{
    ORCH, Serve, become_subreaper, demo_setup, git_show, open, python_available, reap_orphans,
    skip, stop_service, wait_for_task,
};
use orch_store::{Store, Task};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The seed of the kill schedule; `ORCH_CRASH_SEED` overrides it to replay another schedule.
const DEFAULT_SEED: u64 = 0x5eed_0021;

async fn task(store: &Store, id: &str) -> Option<Task> {
    store.get_task_by_work_item(id).await.unwrap()
}

fn orch(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(args)
        .output()
        .expect("run orch");
    assert!(
        out.status.success(),
        "orch {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits until `id` satisfies `done`, failing after `limit`.
async fn wait_for(store: &Store, id: &str, limit: Duration, done: impl Fn(&Task) -> bool) -> Task {
    wait_for_task(store, id, limit, "awaited stage", done).await
}

/// The `(tick, check)` pairs of the `## Series` table of a post-deploy log, in order.
fn series_rows(log: &str) -> Vec<(u32, String)> {
    let Some(start) = log.find("## Series") else {
        return Vec::new();
    };
    log[start..]
        .lines()
        .skip_while(|l| !l.starts_with("|---"))
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            Some((cells.get(1)?.parse().ok()?, (*cells.get(4)?).to_owned()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_killed_at_random_instants_counts_each_tick_once_and_rolls_back_once() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    // Each crash costs a lease (2 s) plus a restart, and a slot missed while no worker runs is
    // skipped, not polled late: give the watch a window the crashes cannot run out, so the
    // verdict comes from the service failing, not from the deadline.
    let config_path = dir.join("orch.toml");
    let config = std::fs::read_to_string(&config_path).unwrap();
    assert!(config.contains("window_s = 8"), "{config}");
    std::fs::write(
        &config_path,
        config.replace("window_s = 8", "window_s = 40"),
    )
    .unwrap();

    let store = open(&dir).await;
    let mut serve = Serve::start(&dir, 50);
    // The first item deploys the initial production release (the one to roll back to).
    orch(
        &dir,
        &[
            "submit",
            "--repo",
            "service",
            "--title",
            "Add a /version endpoint",
            "--body",
            "Add GET /version.",
        ],
    );
    let first = wait_for(&store, "APP-1", Duration::from_secs(300), Task::is_terminal).await;
    assert_eq!(first.stage, "done");
    orch(
        &dir,
        &[
            "submit",
            "--repo",
            "service",
            "--title",
            "Make the greeting configurable",
            "--body",
            "Add `GET /greeting`, configurable through the APP_GREETING environment variable.",
        ],
    );
    wait_for(&store, "APP-2", Duration::from_secs(300), |t| {
        t.stage == "observe" || t.is_terminal()
    })
    .await;

    let seed = std::env::var("ORCH_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED);
    let mut rng = StdRng::seed_from_u64(seed);
    let planned = rng.random_range(3..=5);
    let mut kills = Vec::new();
    while kills.len() < planned {
        let after = Duration::from_millis(rng.random_range(200..=2_500));
        tokio::time::sleep(after).await;
        let stage = task(&store, "APP-2").await.map(|t| t.stage.to_string());
        if stage.as_deref() != Some("observe") {
            break;
        }
        serve.kill_group().await;
        kills.push(after.as_millis());
        serve = Serve::start(&dir, 50);
    }
    let end = wait_for(&store, "APP-2", Duration::from_secs(240), Task::is_terminal).await;
    serve.terminate().await;
    stop_service(&dir);
    reap_orphans();
    let schedule = format!("seed {seed}, kills after {kills:?} ms of {planned} planned");
    eprintln!("watch crash schedule: {schedule}");

    assert!(!kills.is_empty(), "{schedule}: no kill landed in observe");
    assert_eq!(end.stage, "done", "{schedule}");
    let repo = dir.join(".orch/repos/service");
    let log = git_show(
        &repo,
        "orch/APP-2:docs/work-items/APP-2/16-post-deploy-log.md",
    )
    .unwrap_or_else(|| panic!("{schedule}: no post-deploy log on orch/APP-2"));
    assert!(
        log.contains("post_deploy_status: FAILED"),
        "{schedule}:\n{log}"
    );
    assert!(log.contains("action_taken: rollback"), "{schedule}:\n{log}");

    // Each tick once: per check, the tick numbers strictly increase (none repeated).
    let rows = series_rows(&log);
    assert!(rows.len() >= 3, "{schedule}: {rows:?}\n{log}");
    let mut checks: Vec<&str> = rows.iter().map(|(_, c)| c.as_str()).collect();
    checks.sort_unstable();
    checks.dedup();
    for check in checks {
        let ticks: Vec<u32> = rows
            .iter()
            .filter(|(_, c)| c == check)
            .map(|(t, _)| *t)
            .collect();
        assert!(
            ticks.windows(2).all(|w| w[0] < w[1]),
            "{schedule}: check `{check}` has repeated or unordered ticks {ticks:?}"
        );
    }

    let events = store.task_events(end.id).await.unwrap();
    let count = |kind: &str| events.iter().filter(|e| e.kind == kind).count();
    assert_eq!(
        count("post_deploy.rollback_started"),
        1,
        "{schedule}: the rollback ran exactly once"
    );
    assert!(count("post_deploy.verdict") <= 1, "{schedule}: one verdict");
    store.close().await;
}

/// A kill between the watch's recorded verdict and its `done` (failpoint
/// `monitor.before_done`, the process aborts like kill -9): the restarted orch runs the ending
/// again, finds the verdict recorded, and the item ends with one verdict, the log on its branch
/// and one rollback. The verdict used to be recorded after `done`: a kill there left a watch
/// marked done, and the re-run advanced the stage with neither the verdict nor the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_the_verdict_and_done_loses_neither() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let store = open(&dir).await;
    // APP-1 deploys the release to roll back to, watched HEALTHY without the failpoint.
    let serve = Serve::start(&dir, 50);
    orch(
        &dir,
        &[
            "submit",
            "--repo",
            "service",
            "--title",
            "Add a /version endpoint",
        ],
    );
    let first = wait_for(&store, "APP-1", Duration::from_secs(300), Task::is_terminal).await;
    assert_eq!(first.stage, "done");
    serve.terminate().await;

    submit_until_failpoint(
        &dir,
        "monitor.before_done",
        "Make the greeting configurable",
    )
    .await;
    let cut = task(&store, "APP-2").await.unwrap();
    assert_eq!(cut.stage, "observe", "cut short while ending its watch");
    let events = store.task_events(cut.id).await.unwrap();
    assert_eq!(
        count(&events, "post_deploy.verdict"),
        1,
        "recorded before the cut"
    );

    let serve = Serve::start(&dir, 50);
    let end = wait_for(&store, "APP-2", Duration::from_secs(240), Task::is_terminal).await;
    serve.terminate().await;
    stop_service(&dir);
    reap_orphans();
    assert_eq!(end.stage, "done");
    let repo = dir.join(".orch/repos/service");
    let log = git_show(
        &repo,
        "orch/APP-2:docs/work-items/APP-2/16-post-deploy-log.md",
    )
    .expect("the post-deploy log on orch/APP-2");
    assert!(log.contains("post_deploy_status: FAILED"), "{log}");
    assert!(log.contains("action_taken: rollback"), "{log}");
    let events = store.task_events(end.id).await.unwrap();
    assert_eq!(count(&events, "post_deploy.verdict"), 1, "one verdict");
    assert_eq!(
        count(&events, "post_deploy.rollback_started"),
        1,
        "the rollback ran once"
    );
    store.close().await;
}

/// A kill between a deploy's recorded outcome and its deploy record (failpoint
/// `deploy.before_record_deployed`): the restarted orch replays the visit's outcome and writes
/// the record it lacks, once. Before, the replay advanced without it, and the deploy history
/// missed a deploy that happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_the_deploys_outcome_and_its_record_loses_neither() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let store = open(&dir).await;
    submit_until_failpoint(
        &dir,
        "deploy.before_record_deployed",
        "Add a /version endpoint",
    )
    .await;
    let cut = task(&store, "APP-1").await.unwrap();
    let events = store.task_events(cut.id).await.unwrap();
    assert_eq!(
        count(&events, "deploy.confirmed"),
        1,
        "cut after the outcome"
    );
    assert_eq!(
        count(&events, "release.deployed"),
        0,
        "and before the record"
    );

    let serve = Serve::start(&dir, 50);
    let end = wait_for(&store, "APP-1", Duration::from_secs(240), Task::is_terminal).await;
    serve.terminate().await;
    stop_service(&dir);
    reap_orphans();
    assert_eq!(end.stage, "done");
    let events = store.task_events(end.id).await.unwrap();
    assert_eq!(count(&events, "deploy.confirmed"), 1, "deployed once");
    assert_eq!(count(&events, "release.deployed"), 1, "recorded once");
    let deployed = events
        .iter()
        .find(|e| e.kind == "release.deployed")
        .unwrap();
    assert!(
        deployed.data.contains("\"confirmed\":true"),
        "{}",
        deployed.data
    );
    store.close().await;
}

/// Submits `title` to an `orch serve` of the demo in `dir` with failpoint `failpoint` active,
/// and waits for that process to abort there (as kill -9 would leave it).
async fn submit_until_failpoint(dir: &Path, failpoint: &str, title: &str) {
    let mut cmd = Serve::command(dir, "127.0.0.1:0");
    cmd.env("ORCH_FAILPOINTS", failpoint);
    let serve = Serve::spawn(cmd);
    orch(dir, &["submit", "--repo", "service", "--title", title]);
    let status = serve.wait_exit(Duration::from_secs(300)).await;
    assert!(
        status.is_some_and(|s| !s.success()),
        "the failpoint {failpoint} aborted orch: {status:?}"
    );
}

/// How many of `events` are of `kind`.
fn count(events: &[orch_store::Event], kind: &str) -> usize {
    events.iter().filter(|e| e.kind == kind).count()
}
