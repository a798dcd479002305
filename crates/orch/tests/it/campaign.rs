//! The kill campaign: several work items in flight on one repo (the demo's sample service and
//! scripted agent) — a healthy one, one whose staging fails, one whose production health breaks
//! after deploy so it is rolled back — while `orch serve` (and, on PostgreSQL, `orch worker`
//! processes sharing the database) is killed -9 at seeded random instants, at least 30 times.
//!
//! The expected outcomes are not written down here: the same items run once without kills, beside
//! the killed run (in its own demo dir and database), and the killed run must end with the same
//! per-item outcomes, the same production deploys and
//! rollbacks (each applied once: the sample service's scripts log every completed one), the same
//! runs of the production deploy and rollback scripts, no staging deploy of a revision run
//! twice, each started run ended (a kill of orch cuts none in
//! half: they run under orch's supervisor and the restarted orch adopts them), the same agent
//! runs per item and stage (none paid for twice), no job left running, no agent run left open,
//! and no process of a dead incarnation left alive; and `orch replay` agrees with every
//! decision both runs recorded.
//! `ORCH_CAMPAIGN_SEED` replays a run; `ORCH_CAMPAIGN_KILLS` sets the number of kills.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{
    ORCH, become_subreaper, demo_setup, python_available, reap_adopted, reap_orphans, stop_service,
};
use orch_domain::control::events;
use orch_store::{ConnectOptions, Store};
use rand::{Rng as _, SeedableRng as _};

const ITEMS: [&str; 3] = ["APP-1", "APP-2", "APP-3"];
/// Generous bound on one run (a hang guard; 2 cores are shared with other work).
const RUN_LIMIT: Duration = Duration::from_secs(900);

fn seed() -> u64 {
    let seed = std::env::var("ORCH_CAMPAIGN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        });
    eprintln!("kill campaign seed: {seed} (replay with ORCH_CAMPAIGN_SEED={seed})");
    seed
}

fn kills() -> usize {
    std::env::var("ORCH_CAMPAIGN_KILLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30)
}

/// Where one run lives: the demo dir and the database.
struct Setup {
    dir: PathBuf,
    url: String,
}

impl Setup {
    /// `orch demo --setup-only`, then: staging fails for APP-2 only (a step that checks which
    /// work item it stages), and a failed stage ends the task (no loop back).
    async fn new(root: &Path, name: &str, postgres: bool) -> Setup {
        let dir = root.join(name);
        demo_setup(&dir);
        let path = dir.join("orch.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let step = "[[repos.service.staging]]\nname = \"unit-tests\"";
        assert!(
            text.contains(step),
            "the demo config changed shape:\n{text}"
        );
        let text = text.replacen(
            step,
            "[[repos.service.staging]]\nname = \"item-check\"\n\
             run = \"test \\\"${ORCH_WORK_ITEM:-$(basename \\\"$PWD\\\")}\\\" != APP-2\"\n\
             timeout_s = 10\n\n[[repos.service.staging]]\nname = \"unit-tests\"",
            1,
        );
        std::fs::write(&path, format!("{text}\n[pipeline]\nmax_loops = 0\n")).unwrap();
        let url = if postgres {
            orch_store::testing::fresh_pg_schema().await
        } else {
            format!("sqlite://{}", dir.join(".orch/orch.db").display())
        };
        let s = Setup { dir, url };
        if postgres {
            s.orch(&["migrate"]);
        }
        s
    }

    fn command(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(ORCH);
        cmd.arg("--config")
            .arg(self.dir.join("orch.toml"))
            .env("ORCH_DATABASE_URL", &self.url)
            .env("ORCH_LOG", "warn");
        cmd
    }

    fn orch(&self, args: &[&str]) -> String {
        let out = self.command().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "orch {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn submit(&self, title: &str) {
        self.orch(&[
            "submit", "--repo", "service", "--title", title, "--body", title,
        ]);
    }

    async fn store(&self) -> Store {
        Store::connect(&self.url, ConnectOptions::default())
            .await
            .unwrap()
    }

    /// `orch serve` (or `orch worker`), silent, 2 s leases, quick demo agents.
    fn spawn(&self, what: &str) -> Proc {
        let mut cmd = tokio::process::Command::new(ORCH);
        cmd.arg("--config")
            .arg(self.dir.join("orch.toml"))
            .args([what, "--grace-s", "1"])
            .args(if what == "serve" {
                &["--bind", "127.0.0.1:0"][..]
            } else {
                &[][..]
            })
            .env("ORCH_DATABASE_URL", &self.url)
            .env("ORCH_LOG", "warn")
            .env("ORCH_LEASE_S", "2")
            .env("ORCH_DEMO_AGENT_SLEEP_MS", "50")
            .env_remove("ORCH_FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let child = cmd.spawn().expect("spawn orch");
        let pid = child.id().unwrap() as i32;
        let incarnation = format!("{pid}-{}", start_time(pid).unwrap_or(0));
        Proc {
            what: what.to_owned(),
            child,
            incarnation,
        }
    }
}

struct Proc {
    what: String,
    child: tokio::process::Child,
    incarnation: String,
}

impl Proc {
    async fn kill9(mut self) -> String {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        reap_adopted();
        self.incarnation
    }

    async fn terminate(mut self) -> String {
        if let Some(pid) = self.child.id() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        assert!(
            matches!(status, Ok(Ok(s)) if s.success()),
            "orch {} stops cleanly on SIGTERM: {status:?}",
            self.what
        );
        reap_adopted();
        self.incarnation
    }
}

fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// Running (non-zombie) processes whose environment names one of `incarnations`.
fn left_behind(incarnations: &[String]) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for pid in entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
    {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let zombie = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_none_or(|s| s == "Z" || s == "X");
        if zombie {
            continue;
        }
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let hit = env.split(|&b| b == 0).any(|v| {
            incarnations
                .iter()
                .any(|i| v.starts_with(format!("ORCH_INCARNATION={i}/").as_bytes()))
        });
        if hit {
            let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ");
            out.push((pid, cmd));
        }
    }
    out
}

/// What happened to one item, in terms that do not depend on timing.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ItemOutcome {
    stage: String,
    outcome: Option<String>,
    watch: Option<String>,
}

/// What a run did: outcomes per item, production deploys and rollbacks.
#[derive(Debug)]
struct RunResult {
    items: BTreeMap<String, ItemOutcome>,
    prod_deploys: Vec<String>,
    prod_rollbacks: Vec<String>,
    /// Runs of the deploy and rollback scripts in production that started, by `<script>`,
    /// from the scripts' own log.
    script_runs: BTreeMap<String, usize>,
    /// Staged revisions whose staging deploy started more than once (each item is staged in
    /// one visit here).
    staged_twice: Vec<String>,
    /// Script runs that started and never ended (cut in half), from the same log.
    unended: Vec<String>,
    /// Agent runs per `<item> <stage>` (not counting rows of attempts that died before their
    /// agent started).
    agent_runs: BTreeMap<String, usize>,
}

/// The deploy and rollback scripts' own log (`start|end <script> <env> <rev> <ns> [code]`):
/// the production runs that started, by script; the starts without an end; the revisions
/// whose staging deploy started more than once.
fn script_runs(dir: &Path) -> (BTreeMap<String, usize>, Vec<String>, Vec<String>) {
    let text = std::fs::read_to_string(dir.join("service-state/deploys.log")).unwrap_or_default();
    let mut started = BTreeMap::new();
    let mut staged: BTreeMap<String, usize> = BTreeMap::new();
    let mut open: BTreeMap<String, usize> = BTreeMap::new();
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() < 4 {
            continue;
        }
        let run = format!("{} {} {}", w[1], w[2], w[3]);
        match w[0] {
            "start" => {
                if w[2] == "production" {
                    *started.entry(w[1].to_owned()).or_insert(0) += 1;
                } else if w[1] == "deploy" {
                    *staged.entry(w[3].to_owned()).or_insert(0) += 1;
                }
                *open.entry(run).or_insert(0) += 1;
            }
            "end" => {
                if let Some(n) = open.get_mut(&run) {
                    *n = n.saturating_sub(1);
                }
            }
            _ => {}
        }
    }
    let unended = open
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(run, n)| format!("{run} ×{n}"))
        .collect();
    let twice = staged
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(rev, n)| format!("{rev} ×{n}"))
        .collect();
    (started, unended, twice)
}

async fn outcomes(store: &Store) -> BTreeMap<String, ItemOutcome> {
    let mut out = BTreeMap::new();
    for id in ITEMS {
        let t = store.get_task_by_work_item(id).await.unwrap().unwrap();
        let events = store.task_events(t.id).await.unwrap();
        let outcome = events
            .iter()
            .rev()
            .find(|e| e.kind.starts_with("task."))
            .and_then(|e| serde_json::from_str::<serde_json::Value>(&e.data).ok())
            .and_then(|d| d["outcome"].as_str().map(str::to_owned));
        // A watch whose polls were lost while orch was down (killed, restarting) ends DEGRADED
        // for lack of evidence where a clean run sees HEALTHY: kills cost evidence, never a
        // verdict against the service. Both read "not failed"; FAILED, or DEGRADED for any
        // other reason, stays itself.
        let watch = events
            .iter()
            .rev()
            .find(|e| e.kind == events::POST_DEPLOY_VERDICT)
            .and_then(|e| {
                let verdict = e
                    .message
                    .strip_prefix("post-deploy watch ")
                    .and_then(|m| m.split(':').next())?;
                let unproven =
                    verdict == "DEGRADED" && e.message.contains("not enough evidence of health");
                Some(if verdict == "HEALTHY" || unproven {
                    "not failed (HEALTHY, or DEGRADED for polls lost to kills)".to_owned()
                } else {
                    verdict.to_owned()
                })
            });
        // A change that breaks production is taken out (rolled back and reverted on main)
        // whether the watch caught it (`reverted`) or, when a kill delayed the finalizer past
        // the moment its health broke, the finalizer did (`failed` at deploy, reverted): the
        // same result for the user, so the same outcome here.
        let item = if events.iter().any(|e| e.kind == events::RELEASE_REVERTED) {
            ItemOutcome {
                stage: "-".to_owned(),
                outcome: Some("taken out: rolled back and reverted".to_owned()),
                watch: None,
            }
        } else {
            ItemOutcome {
                stage: t.stage.to_string(),
                outcome,
                watch,
            }
        };
        out.insert(id.to_owned(), item);
    }
    out
}

fn effects(dir: &Path, kind: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join("service-state/effects.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some(kind) && w.next() == Some("production"))
                .then(|| w.next().unwrap_or_default().to_owned())
        })
        .collect()
}

/// How long the first kill waits for a process that holds a lease before it picks at random.
const FIRST_KILL_WAIT: Duration = Duration::from_secs(60);

/// A running process that holds a running job's lease (its pid is part of the default
/// worker id, `host-pid-salt`): its index, and the job id and attempt it holds.
async fn lease_holder(store: &Store, running: &[Proc]) -> Option<(usize, (i64, i64))> {
    let mut holders = Vec::new();
    for id in ITEMS {
        let Ok(Some(t)) = store.get_task_by_work_item(id).await else {
            continue;
        };
        for j in store.task_jobs(t.id).await.unwrap_or_default() {
            if let (orch_store::JobState::Running, Some(by)) = (&j.state, &j.locked_by) {
                holders.push((by.clone(), (j.id, j.attempt)));
            }
        }
    }
    running.iter().enumerate().find_map(|(i, p)| {
        let pid = p.incarnation.split('-').next().unwrap_or_default();
        holders
            .iter()
            .find(|(by, _)| by.contains(&format!("-{pid}-")))
            .map(|(_, lease)| (i, *lease))
    })
}

async fn all_terminal(store: &Store) -> bool {
    for id in ITEMS {
        match store.get_task_by_work_item(id).await {
            Ok(Some(t)) if t.is_terminal() => {}
            _ => return false,
        }
    }
    true
}

/// The third item (the one rolled back) is submitted once the first has merged, so that the
/// healthy item never ships the broken change: outcomes then do not depend on timing.
async fn submit_rest_when_ready(s: &Setup, store: &Store, submitted: &mut bool) {
    if *submitted {
        return;
    }
    let Ok(Some(t)) = store.get_task_by_work_item("APP-1").await else {
        return;
    };
    let before_merge = [
        "intake",
        "analysis",
        "architecture",
        "implementation",
        "review",
        "verification",
        "merge",
    ];
    if !before_merge.contains(&t.stage.as_str()) {
        s.submit("Make the greeting configurable");
        *submitted = true;
    }
}

/// Runs the items with `procs` processes ("serve" first); with `kills`, kills a random one -9
/// at seeded random instants and restarts it, `kills` times. Returns the result and every
/// incarnation that ran.
async fn run(
    s: &Setup,
    procs: &[&str],
    kills: usize,
    rng: &mut rand::rngs::StdRng,
) -> (RunResult, Vec<String>) {
    s.submit("Write a note");
    s.submit("Write another note");
    let store = s.store().await;
    let mut running: Vec<Proc> = procs.iter().map(|w| s.spawn(w)).collect();
    let mut dead: Vec<String> = Vec::new();
    let mut submitted = false;
    let t0 = Instant::now();
    let mut done_kills = 0;
    let mut hit_a_lease = false;
    let mut next_kill = Instant::now() + Duration::from_millis(rng.random_range(300..2500));
    loop {
        submit_rest_when_ready(s, &store, &mut submitted).await;
        if submitted && done_kills >= kills && all_terminal(&store).await {
            break;
        }
        if t0.elapsed() >= RUN_LIMIT {
            // Which run (the clean one or the killed one) and how its items got there.
            let ids: Vec<String> = outcomes_so_far(&store)
                .await
                .into_iter()
                .map(|(id, _)| id)
                .collect();
            panic!(
                "the items of {} ({kills} kills, {done_kills} done) did not finish: {:?}\n{}",
                s.dir.display(),
                outcomes_so_far(&store).await,
                common::items_report(&store, &ids, true, 40).await
            );
        }
        if done_kills < kills && Instant::now() >= next_kill {
            // Until a kill is seen to hit a running job, kills wait for a process that holds a
            // lease (the first waits up to FIRST_KILL_WAIT), so that an attempt is lost to a
            // crash in every run (with several processes, random kills alone may hit idle ones
            // every time); the others pick their victim at random, busy or idle.
            let (i, held) = if hit_a_lease {
                (rng.random_range(0..running.len()), None)
            } else {
                match lease_holder(&store, &running).await {
                    Some((i, lease)) => (i, Some(lease)),
                    None if done_kills == 0 && t0.elapsed() < FIRST_KILL_WAIT => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    None => (rng.random_range(0..running.len()), None),
                }
            };
            let victim = running.swap_remove(i);
            let what = victim.what.clone();
            dead.push(victim.kill9().await);
            if let Some((job_id, attempt)) = held
                && let Ok(Some(j)) = store.get_job(job_id).await
            {
                // Still running under the killed attempt: its lease can only expire (or be
                // ended by the restart), so the attempt is lost to this kill.
                hit_a_lease |= j.state == orch_store::JobState::Running && j.attempt == attempt;
            }
            done_kills += 1;
            // Restart after a short random pause (sometimes at once).
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..500))).await;
            running.push(s.spawn(&what));
            next_kill = Instant::now() + Duration::from_millis(rng.random_range(300..2500));
        }
        reap_adopted();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut all = dead;
    for p in running {
        all.push(p.terminate().await);
    }
    let (scripts, unended, staged_twice) = script_runs(&s.dir);
    let mut agent_runs = BTreeMap::new();
    for id in ITEMS {
        let t = store.get_task_by_work_item(id).await.unwrap().unwrap();
        // A row closed as `abandoned` is an attempt that died before its agent started (the
        // kill fell between the row and the supervisor): no run, nothing spent.
        for r in store.task_agent_runs(t.id).await.unwrap() {
            if r.outcome != "abandoned" {
                *agent_runs.entry(format!("{id} {}", r.stage)).or_insert(0) += 1;
            }
        }
    }
    let result = RunResult {
        items: outcomes(&store).await,
        prod_deploys: effects(&s.dir, "deploy"),
        prod_rollbacks: effects(&s.dir, "rollback"),
        script_runs: scripts,
        unended,
        staged_twice,
        agent_runs,
    };
    // No job left running (no lease), no agent run left open.
    for id in ITEMS {
        let t = store.get_task_by_work_item(id).await.unwrap().unwrap();
        let jobs = store.task_jobs(t.id).await.unwrap();
        assert!(
            jobs.iter()
                .all(|j| !matches!(j.state, orch_store::JobState::Running)),
            "{id}: no lease left: {jobs:#?}"
        );
        let runs = store.task_agent_runs(t.id).await.unwrap();
        assert!(
            runs.iter().all(|r| r.finished_at.is_some()),
            "{id}: no agent run left open: {runs:#?}"
        );
    }
    store.close().await;
    stop_service(&s.dir);
    reap_adopted();
    (result, all)
}

/// Every item's events (for a failure's message).
async fn history(s: &Setup) -> String {
    let store = s.store().await;
    let mut out = String::new();
    for id in ITEMS {
        let t = store.get_task_by_work_item(id).await.unwrap().unwrap();
        out.push_str(&format!("{id} ({}):\n", t.stage));
        for e in store.task_events(t.id).await.unwrap() {
            let first = e.message.lines().next().unwrap_or_default();
            out.push_str(&format!("  {:<22} {first}\n", e.kind));
        }
    }
    store.close().await;
    out
}

async fn outcomes_so_far(store: &Store) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for id in ITEMS {
        if let Ok(Some(t)) = store.get_task_by_work_item(id).await {
            v.push((id.to_owned(), t.stage.to_string()));
        }
    }
    v
}

async fn campaign(postgres: bool, procs: &[&str]) {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let seed = seed();
    let tmp = tempfile::tempdir().unwrap();

    // The reference run and the killed run side by side: each has its own demo dir, database,
    // sample service ports and processes, and the killed run's instants come from the seed.
    let clean = Setup::new(tmp.path(), "clean", postgres).await;
    let killed = Setup::new(tmp.path(), "killed", postgres).await;
    let n = kills();
    let mut clean_rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let ((expected, _), (got, incarnations)) = tokio::join!(
        run(&clean, procs, 0, &mut clean_rng),
        run(&killed, procs, n, &mut rng)
    );
    reap_orphans();
    assert_eq!(expected.items.len(), ITEMS.len());
    // The clean run is the reference; it must at least be the three kinds of item.
    let stages: Vec<&str> = expected.items.values().map(|o| o.stage.as_str()).collect();
    assert!(
        stages.contains(&"failed"),
        "one item fails in staging: {expected:?}"
    );
    assert!(
        expected
            .items
            .values()
            .any(|o| o.outcome.as_deref() == Some("taken out: rolled back and reverted")),
        "one item is rolled back: {expected:?}"
    );

    assert!(incarnations.len() > n, "{n} kills happened");
    // A failing watch whose polls were lost while orch was down ends DEGRADED for lack of
    // evidence, with an operator alerted, where the clean run saw FAILED and rolled back: orch
    // never rolls back without evidence against the change. Such an item counts as the clean
    // run's, one production rollback fewer; anything else about it must still match.
    let mut got = got;
    let starved: Vec<String> = got
        .items
        .iter()
        .filter(|(id, o)| {
            o.stage == "done"
                && o.watch.as_deref()
                    == Some("not failed (HEALTHY, or DEGRADED for polls lost to kills)")
                && expected.items.get(*id).is_some_and(|e| {
                    e.outcome.as_deref() == Some("taken out: rolled back and reverted")
                })
        })
        .map(|(id, _)| id.clone())
        .collect();
    for id in &starved {
        eprintln!(
            "seed {seed}: {id}'s failing watch lost its polls to kills (DEGRADED, alerted): counted as the clean run's rollback"
        );
        if let Some(e) = expected.items.get(id) {
            got.items.insert(id.clone(), e.clone());
        }
        *got.script_runs.entry("rollback".to_owned()).or_insert(0) += 1;
        got.prod_rollbacks.push(format!("(starved watch of {id})"));
    }
    if got.items != expected.items
        || got.prod_deploys.len() != expected.prod_deploys.len()
        || got.prod_rollbacks.len() != expected.prod_rollbacks.len()
        || got.script_runs != expected.script_runs
        || !got.unended.is_empty()
        || !got.staged_twice.is_empty()
        || got.agent_runs != expected.agent_runs
    {
        let kept = tmp.keep();
        eprintln!("seed {seed}: runs kept in {}", kept.display());
        eprintln!("{}", history(&killed).await);
    }
    assert_eq!(
        got.items, expected.items,
        "seed {seed}: the killed run ends with the clean run's outcomes"
    );
    assert_eq!(
        got.prod_deploys.len(),
        expected.prod_deploys.len(),
        "seed {seed}: production deploys {:?} vs clean {:?}",
        got.prod_deploys,
        expected.prod_deploys
    );
    assert_eq!(
        got.prod_rollbacks.len(),
        expected.prod_rollbacks.len(),
        "seed {seed}: production rollbacks {:?} vs clean {:?}",
        got.prod_rollbacks,
        expected.prod_rollbacks
    );
    // Every deploy and rollback that started also ended, once: a kill of orch cuts none of
    // them in half and runs none of them again (staging deploys once per staging visit).
    assert!(
        got.unended.is_empty(),
        "seed {seed}: script runs cut in half: {:?}",
        got.unended
    );
    assert_eq!(
        got.script_runs, expected.script_runs,
        "seed {seed}: production deploy and rollback script runs vs the clean run"
    );
    assert!(
        got.staged_twice.is_empty(),
        "seed {seed}: staging deploys run twice: {:?}",
        got.staged_twice
    );
    // An agent run a kill interrupted is adopted, not paid for twice.
    assert_eq!(
        got.agent_runs, expected.agent_runs,
        "seed {seed}: agent runs per item and stage vs the clean run"
    );
    let mut seen = std::collections::HashSet::new();
    for rev in &got.prod_deploys {
        assert!(
            seen.insert(rev),
            "seed {seed}: {rev} deployed to production twice"
        );
    }
    // `orch logs` tells a crash from a failure in plain words.
    let logs: String = ITEMS.iter().map(|id| killed.orch(&["logs", id])).collect();
    assert!(
        logs.contains(
            "lost: the worker stopped heartbeating (crash) \u{2014} not counted as a failure"
        ),
        "seed {seed}: some attempt was lost to a kill and `orch logs` says so:\n{logs}"
    );
    // `orch replay` (issue 32): every decision of both runs, re-derived from what each
    // recorded with today's rules, agrees with what was decided, kills or not.
    for s in [&clean, &killed] {
        let out = s
            .command()
            .args(["--json", "replay", "--repo", "service"])
            .output()
            .unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let summary = &doc["summary"];
        assert!(
            out.status.success() && summary["differ"] == 0 && summary["unreplayable"] == 0,
            "seed {seed}: replay of the {} run: {}\n{}",
            s.dir.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(summary["items"], ITEMS.len(), "seed {seed}: {summary}");
    }
    let left = left_behind(&incarnations);
    assert!(
        left.is_empty(),
        "seed {seed}: processes left behind: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_campaign_sqlite() {
    campaign(false, &["serve"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_campaign_postgres() {
    campaign(true, &["serve"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_campaign_postgres_serve_and_two_workers() {
    campaign(true, &["serve", "worker", "worker"]).await;
}
