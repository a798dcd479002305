//! A stage's commands outlive orch on purpose: `orch serve` is killed -9 or upgraded (SIGTERM)
//! while a staging step, an agent or the production deploy runs; the command runs under its
//! supervisor, and the next `orch serve` adopts it (or the result it left while no orch ran)
//! instead of stopping it or running it again.

mod common;

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

/// A command of a stage is in flight when `orch serve` goes away (`stop`); a new `orch serve`
/// starts. The command is neither stopped nor run again: the new orch adopts it (still running,
/// or, with `end_while_down`, ended while no orch ran) and the item goes on with its result.
/// Checked from the command's own log (one start, one end) and the `command.adopted` event.
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

fn slow_command(which: Which) -> Slow {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let runs = dir.join("runs.log");
    let release = dir.join("release");
    let wrapper = dir.join("slow.sh");
    let exec = match which {
        Which::Agent => format!("exec {} \"$@\"", dir.join("agent/demo-agent.sh").display()),
        Which::StagingStep | Which::Deploy => "exec \"$@\"".to_owned(),
    };
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"start $$\" >> {runs}\n\
             while [ ! -e {release} ]; do sleep 0.1; done\n\
             echo \"done $$\" >> {runs}\n\
             {exec}\n",
            runs = runs.display(),
            release = release.display(),
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let config_path = dir.join("orch.toml");
    // On the host: the test's log and release file are outside what a sandbox shows.
    let mut config = common::sandbox_off(&std::fs::read_to_string(&config_path).unwrap());
    let (from, to, stage) = match which {
        Which::StagingStep => (
            "run = \"python3 -m unittest -q\"\ntimeout_s = 60".to_owned(),
            format!(
                "run = \"sh {} python3 -m unittest -q\"\ntimeout_s = 120",
                wrapper.display()
            ),
            "staging",
        ),
        Which::Deploy => (
            "deploy = \"sh deploy.sh".to_owned(),
            format!("deploy = \"sh {} sh deploy.sh", wrapper.display()),
            "deploy",
        ),
        Which::Agent => (
            format!(
                "[agents.analyst]\nbackend = \"claude\"\ncommand = \"{}\"",
                dir.join("agent/demo-agent.sh").display()
            ),
            format!(
                "[agents.analyst]\nbackend = \"claude\"\ncommand = \"{}\"",
                wrapper.display()
            ),
            "analysis",
        ),
    };
    assert!(
        config.contains(&from),
        "the demo config changed shape: {from}"
    );
    config = config.replacen(&from, &to, 1);
    config = config.replace("deploy_timeout_s = 30", "deploy_timeout_s = 180");
    std::fs::write(&config_path, config).unwrap();
    common::submit(&config_path, "Add a note");
    Slow {
        _tmp: tmp,
        dir,
        runs,
        release,
        stage,
    }
}

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
        Stop::Sigterm => {
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
    // The stages in order (the default pipeline's), to tell when the item got past `stage`.
    let stages: Vec<String> = orch_domain::pipeline::Pipeline::default_pipeline()
        .stages
        .iter()
        .map(|d| d.name.to_string())
        .collect();
    let past = stages.iter().position(|s| s == stage).unwrap();
    let t0 = Instant::now();
    let task = loop {
        let t = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
        assert!(t.stage != "failed", "the task failed: {t:?}");
        if stages
            .iter()
            .position(|s| *s == t.stage)
            .is_none_or(|i| i > past)
        {
            break t;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "{stage} did not finish: {t:?}"
        );
        reap_orphans();
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
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
