//! Children outlive orch no more: `orch serve` is killed -9 while a staging step runs (the
//! step's shell, a child in its group and a `setsid` daemon that left the group). The restarted
//! `orch serve` stops everything the dead incarnation started before it claims work, and the
//! step is re-run cleanly from its start.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    Serve, become_subreaper, demo_setup, open, python_available, reap_orphans, stop_service,
};

fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// Alive and not a zombie.
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// Running processes whose environment carries `ORCH_INCARNATION=<incarnation>/<run>`.
fn marked(incarnation: &str) -> Vec<i32> {
    let needle = format!("ORCH_INCARNATION={incarnation}/");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| running(pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|&b| b == 0)
                    .any(|v| v.starts_with(needle.as_bytes()))
            })
        })
        .collect()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_staging_leaves_no_process_and_the_step_reruns_cleanly() {
    if !python_available() {
        return common::skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let runs = dir.join("stage-runs.log");
    let release = dir.join("release");
    let stage = dir.join("slow-stage.sh");
    std::fs::write(
        &stage,
        format!(
            "echo \"start $$\" >> {runs}\n\
             setsid sleep 600 < /dev/null > /dev/null 2>&1 &\n\
             echo \"daemon $!\" >> {runs}\n\
             sleep 600 &\n\
             echo \"child $!\" >> {runs}\n\
             while [ ! -e {release} ]; do sleep 0.1; done\n\
             kill $! 2>/dev/null\n\
             echo \"done $$\" >> {runs}\n\
             exec python3 -m unittest -q\n",
            runs = runs.display(),
            release = release.display(),
        ),
    )
    .unwrap();
    let config_path = dir.join("orch.toml");
    let config = std::fs::read_to_string(&config_path).unwrap();
    let step = "run = \"python3 -m unittest -q\"\ntimeout_s = 60";
    assert!(config.contains(step), "the demo config changed shape");
    let config = config.replacen(
        step,
        // On the host (the records' path): a sandboxed step's processes end with orch.
        &format!(
            "run = \"sh {}\"\ntimeout_s = 120\nsandbox = false",
            stage.display()
        ),
        1,
    );
    std::fs::write(&config_path, config).unwrap();
    common::submit(&config_path, "Add a note");

    let mut first = Serve::start(&dir, 20);
    until(
        "the staging step to start",
        Duration::from_secs(180),
        || lines(&runs).len() >= 3,
    )
    .await;
    let serve_pid = first.child.id().unwrap() as i32;
    let incarnation = format!("{serve_pid}-{}", start_time(serve_pid).unwrap());
    let pids: Vec<i32> = lines(&runs)
        .iter()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    assert_eq!(pids.len(), 3, "{:?}", lines(&runs));
    // kill -9 of orch alone (not its children's groups).
    first.child.start_kill().unwrap();
    let _ = first.child.wait().await;
    reap_orphans();
    for pid in &pids {
        assert!(
            running(*pid),
            "process {pid} of the stage outlived the kill (the defect)"
        );
    }
    assert!(!marked(&incarnation).is_empty());
    // pids: the step's shell, the `setsid` daemon (left the group), the child in the group.
    let (shell, daemon, child) = (pids[0], pids[1], pids[2]);

    let second = Serve::start(&dir, 20);
    until(
        "the restarted orch to stop the dead incarnation's step (its whole group)",
        Duration::from_secs(60),
        || !running(shell) && !running(child),
    )
    .await;
    // A daemon a staging step starts is what it was run for (the staging service): it is not
    // killed. The test stops it.
    assert!(
        running(daemon),
        "a staging step's own daemon is left running"
    );
    // SAFETY: a process this test caused to exist.
    unsafe { libc::kill(daemon, libc::SIGKILL) };
    std::fs::write(&release, "").unwrap();
    let store = open(&dir).await;
    let t0 = Instant::now();
    loop {
        let t = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
        if ![
            "intake",
            "analysis",
            "architecture",
            "implementation",
            "review",
            "verification",
            "merge",
            "staging",
        ]
        .contains(&t.stage.as_str())
        {
            assert!(t.stage != "failed", "the task failed: {t:?}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "staging did not finish: {t:?}"
        );
        reap_orphans();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let second_pid = second.child.id().unwrap() as i32;
    let second_incarnation = format!("{second_pid}-{}", start_time(second_pid).unwrap());
    second.terminate().await;
    // The re-run's own `setsid` daemon belongs to a run that finished (like a service a deploy
    // starts): orch leaves it; the test stops it.
    for pid in marked(&second_incarnation) {
        // SAFETY: a process this test caused to exist.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    stop_service(&dir);
    reap_orphans();
    let log = lines(&runs);
    let starts = log.iter().filter(|l| l.starts_with("start ")).count();
    let done: Vec<&String> = log.iter().filter(|l| l.starts_with("done ")).collect();
    assert_eq!(starts, 2, "the step ran again after the restart: {log:?}");
    assert_eq!(done.len(), 1, "only the re-run finished: {log:?}");
    assert!(
        !done[0].ends_with(&format!(" {}", pids[0])),
        "the killed run never finished: {log:?}"
    );
    assert!(
        marked(&incarnation).is_empty(),
        "nothing of the dead incarnation is left"
    );
    let records: Vec<_> = std::fs::read_dir(dir.join(".orch/repos/.orch-children"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        records
            .iter()
            .all(|n| !n.to_string_lossy().starts_with(&incarnation)),
        "the dead incarnation's records were forgotten: {records:?}"
    );
    store.close().await;
}

/// An agent's `setsid` daemon is a leftover: killed -9 while the agent runs, orch's next
/// incarnation stops the agent's group and its escaped daemon too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_an_agent_run_stops_the_agents_setsid_daemon() {
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let pids_file = dir.join("agent-pids.log");
    let agent = dir.join("daemon-agent.sh");
    std::fs::write(
        &agent,
        format!(
            "#!/bin/sh\ncat > /dev/null\n\
             setsid sleep 600 < /dev/null > /dev/null 2>&1 &\n\
             echo \"$$ $!\" >> {pids}\n\
             sleep 600\n",
            pids = pids_file.display()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let config_path = dir.join("orch.toml");
    let config = std::fs::read_to_string(&config_path).unwrap();
    let cut = config.find("[agents.analyst]").unwrap();
    let rest = &config[cut..];
    let after = rest.find("[agents.architect]").unwrap();
    // Unsandboxed: this is the records' path (a sandboxed agent's daemons die with its run and
    // with orch: crates/orch/tests/hostile/sandbox.rs).
    let config = format!(
        "{}[agents.analyst]\nbackend = \"command\"\ncommand = \"{}\"\ntimeout_s = 900\n\n{}",
        common::sandbox_off(&config[..cut]),
        agent.display(),
        &rest[after..]
    );
    std::fs::write(&config_path, config).unwrap();
    common::submit(&config_path, "Add a note");

    let mut first = Serve::start(&dir, 20);
    until("the agent to start", Duration::from_secs(120), || {
        !lines(&pids_file).is_empty()
    })
    .await;
    let serve_pid = first.child.id().unwrap() as i32;
    let incarnation = format!("{serve_pid}-{}", start_time(serve_pid).unwrap());
    let pids: Vec<i32> = lines(&pids_file)[0]
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    let (shell, daemon) = (pids[0], pids[1]);
    first.child.start_kill().unwrap();
    let _ = first.child.wait().await;
    reap_orphans();
    assert!(
        running(shell) && running(daemon),
        "both outlived the kill (the defect)"
    );

    let second = Serve::start(&dir, 20);
    until(
        "the restarted orch to stop the agent and its daemon",
        Duration::from_secs(60),
        || !running(shell) && !running(daemon),
    )
    .await;
    assert!(
        marked(&incarnation).is_empty(),
        "nothing of the dead incarnation is left"
    );
    let second_pid = second.child.id().unwrap() as i32;
    let second_incarnation = format!("{second_pid}-{}", start_time(second_pid).unwrap());
    second.child.id();
    let mut second = second;
    second.child.start_kill().unwrap();
    let _ = second.child.wait().await;
    // The re-run agent of the second incarnation: stop what is left (the test's own cleanup).
    for pid in marked(&second_incarnation) {
        // SAFETY: a process this test caused to exist.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    reap_orphans();
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
