//! Dead-node takeover (design.md §10) with real processes on PostgreSQL: two `orch worker`
//! processes, `--node a` and `--node b`, each with its own `repos_dir` (its own clone, deploy
//! markers and watch files), share one queue and the demo's sample service, whose repo is a
//! bare repository both clone from and push to. Node a runs the item alone and dies (a
//! failpoint abort right after the production deploy command, or kill -9 in the middle of
//! the post-deploy watch); node b starts, and once a has not been seen for the grace (3 s
//! here) b takes the pinned job over, rebuilds from the events what a kept on its disk, and
//! the item ends as in a clean run: done, shipped, the production deploy applied once (the
//! sample service's `effects.log`, written by its deploy script).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{ORCH, become_subreaper, demo_setup, orch_db, python_available, reap_orphans};
use orch_store::{ConnectOptions, Event, JobState, Store};

/// The lease and the node grace the workers run with.
const LEASE_S: &str = "2";
const GRACE_S: &str = "3";

/// Where node `name` keeps its clone and its local deploy state.
fn repos_dir(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("node-{name}/repos"))
}

/// An `orch worker --node <name>` of the demo in `dir` on `url`, with its own `repos_dir`, its
/// own process group, 2 s leases, a 3 s node grace, and `failpoints` (empty: none).
fn spawn_node(dir: &Path, url: &str, name: &str, failpoints: &str) -> tokio::process::Child {
    spawn_node_with(dir, url, name, failpoints, 50)
}

/// [`spawn_node`] whose scripted agent thinks `agent_ms` per run.
fn spawn_node_with(
    dir: &Path,
    url: &str,
    name: &str,
    failpoints: &str,
    agent_ms: u64,
) -> tokio::process::Child {
    tokio::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(["--database-url", url])
        .args(["worker", "--node", name, "--worker-id"])
        .arg(format!("worker-{name}"))
        .args(["--grace-s", "1"])
        .env("ORCH_REPOS_DIR", repos_dir(dir, name))
        .env("ORCH_LOG", "warn")
        .env("ORCH_LEASE_S", LEASE_S)
        .env("ORCH_NODE_GRACE_S", GRACE_S)
        .env("ORCH_DEMO_AGENT_SLEEP_MS", agent_ms.to_string())
        .env("ORCH_FAILPOINTS", failpoints)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn orch worker")
}

fn run(dir: &Path, program: &str, args: &[&str]) {
    let out = std::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(out.status.success(), "{program} {args:?}: {out:?}");
}

/// The demo, its service repo made a bare repository (so work branches are pushed and another
/// node continues from them), a longer watch window (so the taker has ticks left to poll),
/// production running the initial release, and a fresh PostgreSQL schema.
async fn setup(dir: &Path) -> String {
    demo_setup(dir);
    run(
        dir,
        "git",
        &["clone", "--quiet", "--bare", "service", "service.git"],
    );
    let toml_path = dir.join("orch.toml");
    let toml = std::fs::read_to_string(&toml_path).unwrap();
    let toml = toml
        .replace("path = \"service\"", "path = \"service.git\"")
        .replace("window_s = 8", "window_s = 16");
    std::fs::write(&toml_path, toml).unwrap();
    let deploy = production_deploy(dir);
    run(&dir.join("service"), "sh", &["-c", &deploy]);
    let url = orch_store::testing::fresh_pg_schema().await;
    orch_db(dir, &url, &["migrate"]);
    url
}

/// The demo's production deploy command from its orch.toml.
fn production_deploy(dir: &Path) -> String {
    let toml = std::fs::read_to_string(dir.join("orch.toml")).unwrap();
    toml.lines()
        .find(|l| l.starts_with("deploy = ") && l.contains("deploy.sh production"))
        .expect("the demo's deploy command")
        .trim_start_matches("deploy = ")
        .trim_matches('"')
        .to_owned()
}

/// The production deploys the sample service's deploy script completed, by revision.
fn production_deploys(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("service-state/effects.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("deploy production "))
        .map(str::to_owned)
        .collect()
}

fn submit(dir: &Path, url: &str) -> String {
    let out = orch_db(
        dir,
        url,
        &[
            "submit",
            "--repo",
            "service",
            "--title",
            "Add a /version endpoint",
            "--body",
            "As the title says.",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("submit --json");
    v["work_item_id"]
        .as_str()
        .or_else(|| v["id"].as_str())
        .expect("the work item id")
        .to_owned()
}

async fn events(store: &Store, id: &str) -> Vec<Event> {
    let t = common::task(store, id).await;
    store.task_events(t.id).await.unwrap()
}

fn data(e: &Event) -> serde_json::Value {
    serde_json::from_str(&e.data).unwrap_or_default()
}

/// Polls until `cond` holds (every 100 ms), failing after `limit` with `what`.
async fn until<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !cond().await {
        assert!(t0.elapsed() < limit, "no {what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How node a dies.
#[derive(Clone, Copy, PartialEq)]
enum Death {
    /// Aborts right after the production deploy command ended well, before the outcome was
    /// recorded (its `deploy.started` is in the database, its markers on its disk).
    AfterDeployCommand,
    /// kill -9 while its post-deploy watch is between ticks (its polls on its disk).
    DuringWatch,
}

async fn node_dies_and_the_other_takes_over(death: Death) {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let url = setup(&dir).await;
    let before = production_deploys(&dir);
    let store = Store::connect(&url, ConnectOptions::default())
        .await
        .unwrap();
    let id = submit(&dir, &url);

    let failpoints = match death {
        Death::AfterDeployCommand => "deploy.after_command",
        Death::DuringWatch => "",
    };
    let mut a = spawn_node(&dir, &url, "a", failpoints);
    match death {
        Death::AfterDeployCommand => {
            let t0 = Instant::now();
            loop {
                if a.try_wait().unwrap().is_some() {
                    break;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(240),
                    "node a never reached its deploy (at {:?})",
                    common::task(&store, &id).await.stage
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            reap_orphans();
            let t = common::task(&store, &id).await;
            assert_eq!(t.stage, "deploy", "node a died in the deploy");
            assert_eq!(
                production_deploys(&dir).len(),
                before.len() + 1,
                "node a's deploy command completed before it died"
            );
        }
        Death::DuringWatch => {
            until(
                Duration::from_secs(240),
                "two polls of node a's watch",
                || async {
                    let t = common::task(&store, &id).await;
                    t.stage == "observe"
                        && store
                            .task_jobs(t.id)
                            .await
                            .unwrap()
                            .iter()
                            .filter(|j| {
                                j.agent == "post-deploy-monitor" && j.state == JobState::Done
                            })
                            .count()
                            >= 2
                },
            )
            .await;
            // SAFETY: signalling our own child's process group (the service it deployed runs
            // in its own session and stays up, as production would).
            unsafe { libc::kill(-(a.id().unwrap() as i32), libc::SIGKILL) };
            let _ = a.wait().await;
            reap_orphans();
        }
    }
    let killed_at = Instant::now();

    let b = spawn_node(&dir, &url, "b", "");
    let t = common::wait_terminal(&store, &id, Duration::from_secs(240)).await;
    let taken_after = killed_at.elapsed();
    common::terminate(b).await;
    common::stop_service(&dir);
    reap_orphans();

    // `orch queue` names both nodes with how long ago each was seen.
    let queue = orch_db(&dir, &url, &["queue"]);
    assert!(queue.contains("last seen ago"), "{queue}");
    for node in ["a", "b"] {
        assert!(
            queue
                .lines()
                .any(|l| l.split_whitespace().next() == Some(node)),
            "{queue}"
        );
    }

    let history = events(&store, &id).await;
    let summary: Vec<String> = history
        .iter()
        .map(|e| format!("{} {}", e.kind, e.message))
        .collect();
    assert_eq!(t.stage, "done", "{summary:#?}");
    let done = history
        .iter()
        .rev()
        .find(|e| e.kind == "task.done")
        .unwrap();
    assert_eq!(data(done)["outcome"], "shipped", "{summary:#?}");

    // The takeover: once, from a to b, of the stage node a held, and visible as an event.
    let takeovers: Vec<&Event> = history
        .iter()
        .filter(|e| e.kind == "node.takeover")
        .collect();
    assert_eq!(takeovers.len(), 1, "{summary:#?}");
    let d = data(takeovers[0]);
    assert_eq!(
        (d["from"].as_str(), d["to"].as_str()),
        (Some("a"), Some("b"))
    );
    let stage = match death {
        Death::AfterDeployCommand => "deploy",
        Death::DuringWatch => "observe",
    };
    assert_eq!(d["stage"], stage, "{summary:#?}");
    let last_seen = d["last_seen_ms"].as_i64().expect("a was seen before");
    assert!(
        takeovers[0].created_at - last_seen > 3_000,
        "taken over only after the grace: {d}"
    );
    // Every pinned job after the takeover is b's.
    let jobs = store.task_jobs(t.id).await.unwrap();
    let after: Vec<_> = jobs
        .iter()
        .filter(|j| j.id > d["job"].as_i64().unwrap() && j.node.is_some())
        .collect();
    assert!(
        after.iter().all(|j| j.node.as_deref() == Some("b")),
        "{after:#?}"
    );

    // The deploy was applied once: one production deploy of the item's revision.
    let deployed = history
        .iter()
        .find(|e| e.kind == "deploy.confirmed")
        .map(|e| data(e)["revision"].as_str().unwrap().to_owned())
        .expect("the deploy was confirmed");
    let runs: Vec<String> = production_deploys(&dir)
        .into_iter()
        .filter(|r| *r == deployed)
        .collect();
    assert_eq!(
        runs.len(),
        1,
        "production deploys of {deployed:.12}: {runs:?}"
    );
    assert!(
        !history.iter().any(|e| e.kind == "deploy.redeployed"),
        "the live deploy was not run again: {summary:#?}"
    );
    match death {
        Death::AfterDeployCommand => {
            assert!(
                history.iter().any(|e| e.kind == "deploy.markers_restored"),
                "{summary:#?}"
            );
            let confirmed = history
                .iter()
                .find(|e| e.kind == "deploy.confirmed")
                .unwrap();
            assert!(confirmed.created_at > takeovers[0].created_at);
        }
        Death::DuringWatch => {
            let rearmed = history
                .iter()
                .find(|e| e.kind == "post_deploy.taken_over")
                .unwrap_or_else(|| panic!("the watch was re-armed on b: {summary:#?}"));
            assert_eq!(data(rearmed)["revision"], deployed.as_str());
            let verdict = history
                .iter()
                .find(|e| e.kind == "post_deploy.verdict")
                .expect("the watch ended with a verdict");
            let v = data(verdict);
            assert!(
                v["evidence_lost"]
                    .as_str()
                    .is_some_and(|l| l.contains("node a")),
                "the lost polls are said, never silent: {v}"
            );
            assert_ne!(
                v["verdict"], "HEALTHY",
                "lost evidence never ends HEALTHY: {v}"
            );
            assert_ne!(v["action"], "rollback", "{v}");
        }
    }
    eprintln!(
        "takeover ({stage}): taken over {:.1} s after node a was last seen; item done {:.1} s after node a died (grace {GRACE_S} s, lease {LEASE_S} s)",
        (takeovers[0].created_at - last_seen) as f64 / 1000.0,
        taken_after.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodes_deploy_is_taken_over_and_applied_once() {
    node_dies_and_the_other_takes_over(Death::AfterDeployCommand).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodes_watch_is_taken_over_and_rearmed_with_its_loss_said() {
    node_dies_and_the_other_takes_over(Death::DuringWatch).await;
}

/// A TCP relay to PostgreSQL that the test can cut, as a network cut between one node and the
/// database (its git remote stays reachable): every relayed connection is dropped and new ones
/// are closed at once.
struct DbLink {
    addr: std::net::SocketAddr,
    cut: tokio_util::sync::CancellationToken,
}

impl DbLink {
    async fn start(upstream: String) -> DbLink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = tokio_util::sync::CancellationToken::new();
        let token = cut.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                if token.is_cancelled() {
                    continue; // dropped: the connection is refused
                }
                let token = token.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = token.cancelled() => {}
                    }
                });
            }
        });
        DbLink { addr, cut }
    }

    /// `url` with its `host:port` replaced by this relay's.
    fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap();
        let (auth, tail) = rest.split_once('/').unwrap();
        let user = auth
            .rsplit_once('@')
            .map(|(u, _)| format!("{u}@"))
            .unwrap_or_default();
        format!("{scheme}://{user}{}/{tail}", self.addr)
    }
}

/// `host:port` of a `postgres://` URL.
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").unwrap().1;
    let auth = rest.split_once('/').unwrap().0;
    let hp = auth.rsplit_once('@').map_or(auth, |(_, hp)| hp);
    if hp.contains(':') {
        hp.to_owned()
    } else {
        format!("{hp}:5432")
    }
}

/// A node cut off from the database in the middle of a stage must not push what it finished
/// after its lease was lost: the attempt that replaced it (on another node) owns `orch/<id>`.
/// Node a reaches PostgreSQL through a relay; the relay is cut while a's agent works on the
/// analysis (3 s); a's agent then finishes and a commits, while node b, on a direct link,
/// rescues the stage after the lease (2 s) and redoes it (its agent takes 4 s). Whenever a
/// would push, it is before b's: the remote's `orch/<id>` would then carry a's stale
/// "analysis result (attempt 1)" under b's work. The lease is renewed before every push, so a
/// never pushes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_from_the_database_never_pushes_its_stale_branch() {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let url = setup(&dir).await;
    let store = Store::connect(&url, ConnectOptions::default())
        .await
        .unwrap();
    let link = DbLink::start(host_port(&url)).await;
    let id = submit(&dir, &url);
    let mut a = spawn_node_with(&dir, &link.url(&url), "a", "", 3_000);
    until(Duration::from_secs(120), "node a's analysis", || async {
        events(&store, &id)
            .await
            .iter()
            .any(|e| e.kind == "stage.started" && e.message == "analysis attempt 1")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    link.cut.cancel();
    let b = spawn_node_with(&dir, &url, "b", "", 4_000);
    until(Duration::from_secs(120), "node b's analysis", || async {
        events(&store, &id)
            .await
            .iter()
            .any(|e| e.kind == "stage.advanced" && e.message.starts_with("analysis:"))
    })
    .await;
    // a's agent ended long ago (3 s); give its worker time to try.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // SAFETY: signalling our own children's process groups.
    unsafe { libc::kill(-(a.id().unwrap() as i32), libc::SIGKILL) };
    let _ = a.wait().await;
    common::terminate(b).await;
    common::stop_service(&dir);
    reap_orphans();

    let history = events(&store, &id).await;
    let summary: Vec<String> = history
        .iter()
        .map(|e| format!("{} {}", e.kind, e.message))
        .collect();
    // b redid the analysis: attempt 2, or a later one when a loaded machine made b lose a
    // lease too (2 s leases); the last attempt that started is the one that advanced.
    let last_attempt = summary
        .iter()
        .filter_map(|e| e.strip_prefix("stage.started analysis attempt "))
        .filter_map(|n| n.trim().parse::<u32>().ok())
        .max()
        .unwrap_or(0);
    assert!(last_attempt >= 2, "b redid the analysis: {summary:#?}");
    let log = std::process::Command::new("git")
        .args(["--git-dir", "service.git", "log", "--format=%s"])
        .arg(format!("orch/{id}"))
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(log.status.success(), "{log:?}");
    let log = String::from_utf8_lossy(&log.stdout);
    assert!(
        log.contains(&format!("analysis result (attempt {last_attempt})")),
        "b's analysis (attempt {last_attempt}) is on the remote: {log}\n{summary:#?}"
    );
    assert!(
        !log.contains("analysis result (attempt 1)"),
        "a's stale analysis was pushed: {log}"
    );
}

/// The remote's `orch/<id>` is the record, never a node's own branch. Node a is killed -9 in
/// the middle of the architecture stage, and what a cut-off attempt leaves is put on its
/// branch: a commit of its own, never pushed. Node b rescues the stage, completes it (pushed)
/// and is killed in the middle of the implementation. Node a comes back and rescues the
/// implementation: it must start from b's architecture, setting its own commit aside
/// (`work_branch.set_aside`, kept under `refs/orch/stale/`), never build on it and push it
/// over b's work (the three-host test once shipped a change whose stages had each been pushed
/// over the previous one's this way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_unpushed_attempt_is_set_aside_not_pushed_over_the_remotes_work() {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let url = setup(&dir).await;
    let store = Store::connect(&url, ConnectOptions::default())
        .await
        .unwrap();
    let id = submit(&dir, &url);
    let started = |stage: &'static str| {
        let (store, id) = (store.clone(), id.clone());
        move || {
            let (store, id) = (store.clone(), id.clone());
            async move {
                events(&store, &id)
                    .await
                    .iter()
                    .any(|e| e.kind == "stage.started" && e.message.starts_with(stage))
            }
        }
    };
    let kill = |child: &tokio::process::Child| {
        // SAFETY: signalling our own child's process group.
        unsafe { libc::kill(-(child.id().unwrap() as i32), libc::SIGKILL) };
    };

    let mut a = spawn_node_with(&dir, &url, "a", "", 3_000);
    until(
        Duration::from_secs(120),
        "node a's architecture",
        started("architecture attempt"),
    )
    .await;
    kill(&a);
    let _ = a.wait().await;
    // What an attempt that committed and then lost its lease leaves on a's clone.
    let clone = repos_dir(&dir, "a").join("service");
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .args(args)
            .current_dir(&clone)
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let branch = format!("orch/{id}");
    let stale = git(&[
        "commit-tree",
        &format!("{branch}^{{tree}}"),
        "-p",
        &branch,
        "-m",
        "a stale attempt never pushed",
    ]);
    git(&["update-ref", &format!("refs/heads/{branch}"), &stale]);

    let mut b = spawn_node_with(&dir, &url, "b", "", 3_000);
    until(
        Duration::from_secs(120),
        "node b's implementation",
        started("implementation attempt"),
    )
    .await;
    kill(&b);
    let _ = b.wait().await;
    let a = spawn_node_with(&dir, &url, "a", "", 50);
    until(
        Duration::from_secs(120),
        "the review",
        started("review attempt"),
    )
    .await;
    common::terminate(a).await;
    common::stop_service(&dir);
    reap_orphans();

    let history = events(&store, &id).await;
    let summary: Vec<String> = history
        .iter()
        .map(|e| format!("{} {}", e.kind, e.message))
        .collect();
    let set_aside: Vec<&Event> = history
        .iter()
        .filter(|e| e.kind == "work_branch.set_aside")
        .collect();
    assert_eq!(set_aside.len(), 1, "one set-aside: {summary:#?}");
    assert!(
        set_aside[0].message.contains(&stale[..12])
            && set_aside[0].stage.as_deref() == Some("implementation"),
        "{summary:#?}"
    );
    assert!(
        !history.iter().any(|e| e.kind == "work_branch.replaced"),
        "nothing was pushed over: {summary:#?}"
    );
    assert_eq!(
        git(&["rev-parse", &format!("refs/orch/stale/{branch}/{stale}")]),
        stale,
        "the stale commit is kept"
    );
    let log = std::process::Command::new("git")
        .args(["--git-dir", "service.git", "log", "--format=%H %s"])
        .arg(&branch)
        .current_dir(&dir)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&log.stdout);
    assert!(!log.contains(&stale), "the stale commit was pushed: {log}");
    for stage in ["analysis", "architecture", "implementation"] {
        assert!(
            log.contains(&format!("{stage} result")),
            "the remote holds the {stage}: {log}\n{summary:#?}"
        );
    }
}
