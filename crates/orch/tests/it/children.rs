//! A stage's commands outlive orch on purpose: `orch serve` is killed -9 or upgraded (SIGTERM)
//! while a staging step, an agent or the production deploy runs; the command runs under its
//! supervisor, and the next `orch serve` adopts it (or the result it left while no orch ran)
//! instead of stopping it or running it again. One test holds one command at a time; the
//! upgrade test holds a production deploy, a staging step (of a second repo) and an agent run
//! in flight together through one SIGTERM and checks each is adopted and processed once.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    Serve, become_subreaper, demo_setup, open, python_available, reap_orphans, stop_service,
};

/// Alive and not a zombie.
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        reap_orphans();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Which of a stage's commands the test holds in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    /// The staging step that runs the tests (`python3 -m unittest`).
    StagingStep,
    /// The analyst agent (the demo's scripted Claude Code).
    Agent,
    /// The production deploy.
    Deploy,
}

/// How the first `orch serve` goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// kill -9 of orch alone (its supervisors run in sessions of their own).
    Kill9,
    /// SIGTERM, as an upgrade does: orch must exit within its grace and leave the command be.
    Sigterm,
}

/// A demo project whose `which` command waits for the file `release` and logs `start <pid>`
/// and `done <pid>` to `runs`; the item is submitted. Returns the project and the stage the
/// command belongs to.
struct Slow {
    _tmp: tempfile::TempDir,
    dir: std::path::PathBuf,
    runs: std::path::PathBuf,
    release: std::path::PathBuf,
    stage: &'static str,
}

/// One command held in flight: a wrapper that, for the work item `item` (`ORCH_WORK_ITEM`; any
/// item when `None`), logs `start <pid>` to `runs`, waits for the file `release`, logs
/// `done <pid>` and then execs the real command. [`Hold::apply`] puts it in a config.
struct Hold {
    which: Which,
    wrapper: std::path::PathBuf,
    runs: std::path::PathBuf,
    release: std::path::PathBuf,
}

impl Hold {
    /// Writes the wrapper of `which` in the demo project `dir`, its files named after `name`.
    fn new(dir: &Path, which: Which, name: &str, item: Option<&str>) -> Hold {
        let runs = dir.join(format!("{name}.runs"));
        let release = dir.join(format!("{name}.release"));
        let wrapper = dir.join(format!("{name}.sh"));
        let exec = match which {
            Which::Agent => format!("exec {} \"$@\"", dir.join("agent/demo-agent.sh").display()),
            Which::StagingStep | Which::Deploy => "exec \"$@\"".to_owned(),
        };
        let hold = format!(
            "echo \"start $$\" >> {runs}\n\
             while [ ! -e {release} ]; do sleep 0.1; done\n\
             echo \"done $$\" >> {runs}\n",
            runs = runs.display(),
            release = release.display(),
        );
        let hold = match item {
            None => hold,
            Some(item) => format!("if [ \"$ORCH_WORK_ITEM\" = {item} ]; then\n{hold}fi\n"),
        };
        std::fs::write(&wrapper, format!("#!/bin/sh\n{hold}{exec}\n")).unwrap();
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Hold {
            which,
            wrapper,
            runs,
            release,
        }
    }

    /// The stage the held command belongs to.
    fn stage(&self) -> &'static str {
        match self.which {
            Which::StagingStep => "staging",
            Which::Deploy => "deploy",
            Which::Agent => "analysis",
        }
    }

    /// `config` with the command wrapped: the first staging step or the deploy of
    /// `[repos.<repo>]`, or the analyst agent (of every repo).
    fn apply(&self, config: &str, repo: &str) -> String {
        let dir = self.wrapper.parent().unwrap();
        let wrapper = self.wrapper.display();
        let (from, to) = match self.which {
            Which::StagingStep => (
                "run = \"python3 -m unittest -q\"\ntimeout_s = 60".to_owned(),
                format!("run = \"sh {wrapper} python3 -m unittest -q\"\ntimeout_s = 120"),
            ),
            Which::Deploy => (
                "deploy = \"sh deploy.sh".to_owned(),
                format!("deploy = \"sh {wrapper} sh deploy.sh"),
            ),
            Which::Agent => (
                format!(
                    "[agents.analyst]\nbackend = \"claude\"\ncommand = \"{}\"",
                    dir.join("agent/demo-agent.sh").display()
                ),
                format!("[agents.analyst]\nbackend = \"claude\"\ncommand = \"{wrapper}\""),
            ),
        };
        // A repo's commands are in its section, which runs from its header on.
        let at = match self.which {
            Which::Agent => 0,
            Which::StagingStep | Which::Deploy => config
                .find(&format!("[repos.{repo}]\n"))
                .unwrap_or_else(|| panic!("no [repos.{repo}] in the config")),
        };
        assert!(
            config[at..].contains(&from),
            "the demo config changed shape: {from}"
        );
        format!("{}{}", &config[..at], config[at..].replacen(&from, &to, 1))
    }

    /// The pids the wrapper logged as started.
    fn started(&self) -> Vec<i32> {
        lines(&self.runs)
            .iter()
            .filter_map(|l| l.strip_prefix("start ")?.parse().ok())
            .collect()
    }

    /// How many times the command started and how many times it ended, from its log.
    fn starts_and_ends(&self) -> (usize, usize) {
        let log = lines(&self.runs);
        let count = |p: &str| log.iter().filter(|l| l.starts_with(p)).count();
        (count("start "), count("done "))
    }

    fn release(&self) {
        std::fs::write(&self.release, "").unwrap();
    }
}

/// The demo's config in `dir` with its repo's sandbox off (the test's log and release files are
/// outside what a sandbox shows) and deploys given 180 s (the machine may be loaded).
fn host_config(dir: &Path) -> String {
    common::sandbox_off(&std::fs::read_to_string(dir.join("orch.toml")).unwrap())
        .replace("deploy_timeout_s = 30", "deploy_timeout_s = 180")
}

fn slow_command(which: Which) -> Slow {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let hold = Hold::new(&dir, which, "slow", None);
    let config_path = dir.join("orch.toml");
    std::fs::write(&config_path, hold.apply(&host_config(&dir), "service")).unwrap();
    common::submit(&config_path, "Add a note");
    Slow {
        _tmp: tmp,
        dir,
        stage: hold.stage(),
        runs: hold.runs,
        release: hold.release,
    }
}

/// The stages of the default pipeline, in order.
fn stages() -> Vec<String> {
    orch_domain::pipeline::Pipeline::default_pipeline()
        .stages
        .iter()
        .map(|d| d.name.to_string())
        .collect()
}

/// Waits (up to 240 s) for work item `item` to get past `stage` (or to end, but not as
/// `failed`), and returns its task.
async fn past(store: &orch_store::Store, item: &str, stage: &str) -> orch_store::Task {
    let stages = stages();
    let past = stages.iter().position(|s| s == stage).unwrap();
    let t0 = Instant::now();
    loop {
        let t = store.get_task_by_work_item(item).await.unwrap().unwrap();
        assert!(t.stage != "failed", "the task failed: {t:?}");
        if stages
            .iter()
            .position(|s| *s == t.stage)
            .is_none_or(|i| i > past)
        {
            return t;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "{item}: {stage} did not finish: {t:?}"
        );
        reap_orphans();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// SIGTERM to the first `orch serve`, as an upgrade does: it must exit successfully within 30 s.
async fn upgrade_stop(mut first: Serve) {
    let serve = first.child.id().unwrap() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(serve, libc::SIGTERM) };
    let t0 = Instant::now();
    let status = tokio::time::timeout(Duration::from_secs(30), first.child.wait())
        .await
        .expect("orch serve did not exit on SIGTERM")
        .unwrap();
    assert!(status.success(), "orch serve exited with {status}");
    eprintln!(
        "orch serve exited {:.1} s after SIGTERM",
        t0.elapsed().as_secs_f64()
    );
}

/// The events of a task whose command was adopted once, in `state`, and neither run again nor
/// redeployed: exactly one `command.adopted` saying `state`, no `command.rerun`,
/// `deploy.redeployed` or `deploy.failed`.
fn assert_adopted_once(events: &[orch_store::Event], state: &str) {
    let adopted: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "command.adopted")
        .collect();
    assert_eq!(adopted.len(), 1, "{events:#?}");
    assert!(
        adopted[0].data.contains(&format!("\"state\":\"{state}\"")),
        "{:?}",
        adopted[0]
    );
    assert!(
        events.iter().all(|e| e.kind != "command.rerun"
            && e.kind != "deploy.redeployed"
            && e.kind != "deploy.failed"),
        "{events:#?}"
    );
}

/// A command of a stage is in flight when `orch serve` goes away (`stop`); a new `orch serve`
/// starts. The command is neither stopped nor run again: the new orch adopts it (still running,
/// or, with `end_while_down`, ended while no orch ran) and the item goes on with its result.
/// Checked from the command's own log (one start, one end) and the `command.adopted` event.
async fn command_outlives_orch(which: Which, stop: Stop, end_while_down: bool) {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let slow = slow_command(which);
    let (dir, runs, release, stage) = (
        slow.dir.clone(),
        slow.runs.clone(),
        slow.release.clone(),
        slow.stage,
    );

    let mut first = Serve::start(&dir, 20);
    until("the command to start", Duration::from_secs(240), || {
        !lines(&runs).is_empty()
    })
    .await;
    let pid: i32 = lines(&runs)[0]
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap();
    match stop {
        Stop::Kill9 => {
            first.child.start_kill().unwrap();
            let _ = first.child.wait().await;
        }
        Stop::Sigterm => upgrade_stop(first).await,
    }
    reap_orphans();
    assert!(running(pid), "the command was stopped with orch");
    if end_while_down {
        std::fs::write(&release, "").unwrap();
        until(
            "the command to end while no orch runs",
            Duration::from_secs(120),
            || !running(pid),
        )
        .await;
    }
    let second = Serve::start(&dir, 20);
    if !end_while_down {
        tokio::time::sleep(Duration::from_secs(3)).await;
        reap_orphans();
        assert!(
            running(pid),
            "the restarted orch stopped the command instead of adopting it"
        );
        std::fs::write(&release, "").unwrap();
    }
    let store = open(&dir).await;
    let task = past(&store, "APP-1", stage).await;
    let events = store.task_events(task.id).await.unwrap();
    let agent_runs: Vec<_> = store
        .task_agent_runs(task.id)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.stage == "analysis")
        .collect();
    // The adopted agent run is one run, one row, finished with its own result.
    assert_eq!(agent_runs.len(), 1, "{agent_runs:#?}");
    assert_eq!(agent_runs[0].outcome, "ok", "{agent_runs:#?}");
    second.terminate().await;
    stop_service(&dir);
    reap_orphans();
    let log = lines(&runs);
    let starts = log.iter().filter(|l| l.starts_with("start ")).count();
    let done = log.iter().filter(|l| l.starts_with("done ")).count();
    assert_eq!(
        (starts, done),
        (1, 1),
        "the command ran once, whole: {log:?}"
    );
    let state = if end_while_down {
        "finished"
    } else {
        "running"
    };
    assert_adopted_once(&events, state);
    store.close().await;
}

/// An upgrade (SIGTERM, a new orch) during a staging step: orch exits within its grace, the
/// step goes on, the new orch adopts it, and it runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_staging_step_leaves_it_to_the_next_orch() {
    command_outlives_orch(Which::StagingStep, Stop::Sigterm, false).await;
}

/// kill -9 during a staging step that then ends while no orch runs: the restarted orch reads
/// its result and goes on, without running it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staging_step_that_ends_while_orch_is_down_is_taken_not_rerun() {
    command_outlives_orch(Which::StagingStep, Stop::Kill9, true).await;
}

/// kill -9 during an agent run: the agent goes on, the restarted orch adopts it and its
/// result (and its cost) counts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_an_agent_run_adopts_the_run() {
    command_outlives_orch(Which::Agent, Stop::Kill9, false).await;
}

/// An upgrade during the production deploy: the deploy is never cut in half nor run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_the_production_deploy_leaves_it_to_the_next_orch() {
    command_outlives_orch(Which::Deploy, Stop::Sigterm, false).await;
}

/// kill -9 during the production deploy, which ends while no orch runs: its result is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deploy_that_ends_while_orch_is_down_is_taken_not_rerun() {
    command_outlives_orch(Which::Deploy, Stop::Kill9, true).await;
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits (up to 120 s) for every deploy and rollback the demo's scripts started with the state
/// directory `state` to have ended (each logs its start and its end), then stops the service
/// they started in both environments: a deploy left running by a stopped orch would start it
/// again after the stop.
async fn stop_service_at(dir: &Path, state: &Path) {
    let log = state.join("deploys.log");
    until(
        "the demo's deploys to end",
        Duration::from_secs(120),
        || {
            let log = lines(&log);
            let count = |p: &str| log.iter().filter(|l| l.starts_with(p)).count();
            count("start ") == count("end ")
        },
    )
    .await;
    for env in ["production", "staging"] {
        let _ = std::process::Command::new("sh")
            .arg(dir.join("service/stop.sh"))
            .arg(env)
            .arg(state)
            .status();
    }
}

/// The upgrade test: a production deploy (APP-1), a staging step (WEB-1, of a second
/// repo: the release train holds one repo's staging and deploy for one item at a time) and an
/// analyst agent run (APP-2) are all in flight when `orch serve` is SIGTERMed. It exits within
/// its grace, none of the three commands is stopped, the next `orch serve` adopts all three
/// (still running), and each runs once, whole, and is processed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_with_a_deploy_a_staging_step_and_an_agent_in_flight_interrupts_none() {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    // The second repo `web`: a copy of the demo's service, with its own prefix, state and ports.
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(dir.join("service"))
        .arg(dir.join("web"))
        .status()
        .unwrap();
    assert!(status.success(), "cp -a service web: {status}");
    let mut config = host_config(&dir);
    let block = {
        let start = config.find("[repos.service]\n").unwrap();
        let end = config.find("[agents.analyst]").unwrap();
        let mut block = config[start..end]
            .replace("[repos.service", "[repos.web")
            .replace("path = \"service\"", "path = \"web\"")
            .replace("prefix = \"APP\"", "prefix = \"WEB\"")
            .replace(
                &dir.join("service-state").display().to_string(),
                &dir.join("web-state").display().to_string(),
            );
        // Its own ports: the service's production and staging ports, as the demo wrote them.
        for port in ["production", "staging"].map(|env| {
            let at = block.find(&format!("sh deploy.sh {env} ")).unwrap();
            block[at..].split_whitespace().nth(3).unwrap().to_owned()
        }) {
            block = block.replace(&port, &free_port().to_string());
        }
        block
    };
    config.push('\n');
    config.push_str(&block);
    let deploy = Hold::new(&dir, Which::Deploy, "deploy", Some("APP-1"));
    let agent = Hold::new(&dir, Which::Agent, "agent", Some("APP-2"));
    let staging = Hold::new(&dir, Which::StagingStep, "staging", Some("WEB-1"));
    config = deploy.apply(&config, "service");
    config = agent.apply(&config, "service");
    config = staging.apply(&config, "web");
    let config_path = dir.join("orch.toml");
    std::fs::write(&config_path, config).unwrap();
    common::submit(&config_path, "Add a note");
    common::submit(&config_path, "Add another note");
    common::submit_to(&config_path, "web", "Add a note to web");
    let held = [("APP-1", &deploy), ("APP-2", &agent), ("WEB-1", &staging)];

    let first = Serve::start(&dir, 20);
    until(
        "the three commands to start",
        Duration::from_secs(480),
        || held.iter().all(|(_, h)| !h.started().is_empty()),
    )
    .await;
    let pids: Vec<i32> = held.iter().map(|(_, h)| h.started()[0]).collect();
    // All three in flight at once, each in its stage.
    let store = open(&dir).await;
    for (item, h) in &held {
        let t = common::task(&store, item).await;
        assert_eq!(t.stage, h.stage(), "{item}: {t:?}");
    }
    upgrade_stop(first).await;
    reap_orphans();
    for ((item, h), pid) in held.iter().zip(&pids) {
        assert!(
            running(*pid),
            "{item}'s {} command was stopped with orch",
            h.stage()
        );
    }
    let second = Serve::start(&dir, 20);
    tokio::time::sleep(Duration::from_secs(3)).await;
    reap_orphans();
    for ((item, h), pid) in held.iter().zip(&pids) {
        assert!(
            running(*pid),
            "the restarted orch stopped {item}'s {} command instead of adopting it",
            h.stage()
        );
    }
    for (_, h) in &held {
        h.release();
    }
    let mut tasks = Vec::new();
    for (item, h) in &held {
        tasks.push(past(&store, item, h.stage()).await);
    }
    second.terminate().await;
    stop_service_at(&dir, &dir.join("service-state")).await;
    stop_service_at(&dir, &dir.join("web-state")).await;
    reap_orphans();
    for ((item, h), task) in held.iter().zip(&tasks) {
        assert_eq!(
            h.starts_and_ends(),
            (1, 1),
            "{item}'s {} command ran once, whole: {:?}",
            h.stage(),
            lines(&h.runs)
        );
        let events = store.task_events(task.id).await.unwrap();
        assert_adopted_once(&events, "running");
    }
    let agent_runs: Vec<_> = store
        .task_agent_runs(tasks[1].id)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.stage == "analysis")
        .collect();
    // The adopted agent run is one run, one row, finished with its own result.
    assert_eq!(agent_runs.len(), 1, "{agent_runs:#?}");
    assert_eq!(agent_runs[0].outcome, "ok", "{agent_runs:#?}");
    store.close().await;
}

/// A restarted orch ends the leases its dead predecessor on this machine held (it knows the
/// process is gone, by pid and start time, and which worker id it claimed as), so the job it
/// was running runs again right after the restart instead of after the lease: a process that
/// keeps crashing loses seconds per crash, not a lease each time. Here the lease is 60 s and
/// the rescue must come well before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_ends_the_dead_processs_leases_at_once() {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    common::submit(&dir.join("orch.toml"), "A note");
    let store = open(&dir).await;
    let serve = |agent_ms: &str| {
        let mut cmd = Serve::command(&dir, "127.0.0.1:0");
        cmd.env("ORCH_LEASE_S", "60")
            .env("ORCH_DEMO_AGENT_SLEEP_MS", agent_ms);
        Serve::spawn(cmd)
    };
    let first = serve("30000");
    let started = |kind: &'static str, text: &'static str| {
        let store = store.clone();
        async move {
            let t = common::task(&store, "APP-1").await;
            store
                .task_events(t.id)
                .await
                .unwrap()
                .iter()
                .any(|e| e.kind == kind && e.message.starts_with(text))
        }
    };
    let t0 = Instant::now();
    while !started("stage.started", "analysis attempt 1").await {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the analysis never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    first.kill_group().await;
    let restarted = Instant::now();
    let second = serve("50");
    while !started("stage.started", "analysis attempt 2").await {
        assert!(
            restarted.elapsed() < Duration::from_secs(40),
            "the dead process's job was not rescued before its lease ran out"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rescued_after = restarted.elapsed();
    assert!(started("job.rescued", "attempt 1 lost").await);
    second.kill_group().await;
    stop_service(&dir);
    reap_orphans();
    eprintln!(
        "the dead process's job ran again {:.1} s after the restart (lease 60 s)",
        rescued_after.as_secs_f64()
    );
}

/// A supervised command whose job another node took over while this node's orch was down is
/// stopped here once orch is back (the other node runs the job; two runs of one command must
/// not race), while a job only waiting to be claimed again would have been adopted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_whose_job_another_node_took_over_is_stopped_here() {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let slow = slow_command(Which::Agent);
    let mut first = Serve::start(&slow.dir, 20);
    until("the agent to start", Duration::from_secs(240), || {
        !lines(&slow.runs).is_empty()
    })
    .await;
    let pid: i32 = lines(&slow.runs)[0]
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap();
    first.child.start_kill().unwrap();
    let _ = first.child.wait().await;
    reap_orphans();
    assert!(running(pid), "the agent outlived orch");
    // Another node takes the job over: the dead process's lease ends and a worker elsewhere
    // claims the job under a long lease.
    let store = open(&slow.dir).await;
    let task = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
    let job = store
        .task_jobs(task.id)
        .await
        .unwrap()
        .into_iter()
        .find(|j| j.state == orch_store::JobState::Running)
        .expect("the analysis job is running");
    let dead = job.locked_by.clone().unwrap();
    assert_eq!(store.expire_leases_of(&dead).await.unwrap(), 1);
    store
        .rescue_expired(orch_store::Rescue {
            backoff_base_ms: 0,
            backoff_max_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap();
    let claimed = store
        .claim(&orch_store::Claim {
            worker_id: "another-node-worker".into(),
            limit: 10,
            lease_ms: 600_000,
            kinds: vec![job.agent.clone()],
            node: None,
            node_grace_ms: None,
        })
        .await
        .unwrap();
    assert!(
        claimed.iter().any(|c| c.lease.job_id == job.id),
        "{claimed:?}"
    );
    let second = Serve::start(&slow.dir, 20);
    until(
        "the restarted orch to stop the command another node now runs",
        Duration::from_secs(30),
        || !running(pid),
    )
    .await;
    // Stopped through its supervisor, which recorded the command as cancelled.
    let result = slow.dir.join(format!(
        ".orch/repos/.orch-children/supervised/j{}.agent-0/result.json",
        job.id
    ));
    let mut recorded = String::new();
    until(
        "the supervisor to record the stop",
        Duration::from_secs(10),
        || {
            recorded = std::fs::read_to_string(&result).unwrap_or_default();
            !recorded.is_empty()
        },
    )
    .await;
    assert!(recorded.contains("Cancelled"), "{recorded}");
    second.terminate().await;
    stop_service(&slow.dir);
    reap_orphans();
    let log = lines(&slow.runs);
    assert!(
        log.iter().all(|l| !l.starts_with("done ")),
        "the command was stopped, not left to finish: {log:?}"
    );
    store.close().await;
}
