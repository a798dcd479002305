//! The staging defer survives a crash (ORCH-115 D-2): `orch serve` aborts right after the engine
//! enqueued a deferred staging job and before the running job is marked done
//! (`engine.after_requeue`). After the restart the rescued job runs again; the dedupe key
//! `requeue-of:<job>` keeps it from deferring a second time, so the visit gets exactly the limit
//! of defers (no extra, none lost) and then fails `tool_error_exhausted`. While the restarted
//! process works, `GET /queue` shows the `staging_runner` counters moving (D-4).

use crate::common;

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    ORCH, Serve, become_subreaper, demo_setup, git_show, open, python_available, reap_orphans, skip,
};
use orch_domain::control::markers;
use orch_store::{Store, Task};

/// The repo's `staging_defer_limit` (the default).
const DEFER_LIMIT: usize = 2;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn orch(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new(ORCH)
        .arg("--config")
        .arg(dir.join("orch.toml"))
        .args(args)
        .env("ORCH_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "orch {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `orch demo --setup-only`, then the first staging step runs a tool that does not exist, the
/// defers wait one second instead of a minute, and a failed stage does not loop back.
fn setup(dir: &Path) {
    demo_setup(dir);
    let path = dir.join("orch.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let step = "name = \"unit-tests\"\nrun = \"python3 -m unittest -q\"";
    assert!(
        text.contains(step),
        "the demo config changed shape:\n{text}"
    );
    let text = text
        .replacen(
            step,
            "name = \"unit-tests\"\nrun = \"no-such-tool-xyz -q\"",
            1,
        )
        .replacen(
            "prefix = \"APP\"\n",
            "prefix = \"APP\"\nstaging_defer_delay_s = 1\n",
            1,
        );
    let text = format!("{text}\n[pipeline]\nmax_loops = 0\n");
    std::fs::write(&path, text).unwrap();
}

async fn task(store: &Store, id: &str) -> Task {
    store.get_task_by_work_item(id).await.unwrap().unwrap()
}

fn spawn_serve(dir: &Path, port: u16, failpoints: Option<&str>) -> Serve {
    let mut cmd = Serve::command(dir, &format!("127.0.0.1:{port}"));
    if let Some(fp) = failpoints {
        cmd.env("ORCH_FAILPOINTS", fp);
    }
    Serve::spawn(cmd)
}

/// `GET /queue` → the `staging_runner` counters (None while the server is not answering).
fn staging_counters(port: u16) -> Option<BTreeMap<String, u64>> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /queue HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let raw = String::from_utf8_lossy(&raw);
    let (head, body) = raw.split_once("\r\n\r\n")?;
    assert!(head.starts_with("HTTP/1.1 200"), "GET /queue: {head}");
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    let group = v["runners"]["staging_runner"].as_object()?;
    Some(
        group
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_defer_interrupted_by_a_crash_is_neither_repeated_nor_lost() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir: PathBuf = tmp.path().join("demo");
    setup(&dir);
    orch(
        &dir,
        &[
            "submit",
            "--repo",
            "service",
            "--title",
            "Write a note",
            "--body",
            "Add a note.",
        ],
    );
    let store = open(&dir).await;

    // First run: aborts at the first defer, after the deferred job is in the queue.
    let port = free_port();
    let mut first = spawn_serve(&dir, port, Some("engine.after_requeue"));
    let status = tokio::time::timeout(Duration::from_secs(240), first.child.wait())
        .await
        .expect("orch serve reaches the first staging defer within 240 s")
        .unwrap();
    reap_orphans();
    assert!(
        !status.success(),
        "the failpoint aborts the process: {status}"
    );
    let t = task(&store, "APP-1").await;
    assert_eq!(t.stage, "staging", "the crash happened during staging");
    let marker = markers::staging_defer(t.stage_seq);
    let deferred = |jobs: &[orch_store::Job]| {
        jobs.iter()
            .filter(|j| j.agent == "deployer" && j.task_content.contains(&marker))
            .count()
    };
    let jobs = store.task_jobs(t.id).await.unwrap();
    assert_eq!(
        deferred(&jobs),
        1,
        "one deferred job before the crash: {jobs:#?}"
    );
    let staging_seq = t.stage_seq;

    // Second run: rescues the interrupted job, finishes the visit; /queue shows it.
    let port = free_port();
    let second = spawn_serve(&dir, port, None);
    let mut samples: Vec<BTreeMap<String, u64>> = Vec::new();
    let t0 = Instant::now();
    let end = loop {
        if let Some(c) = staging_counters(port)
            && samples.last() != Some(&c)
        {
            samples.push(c);
        }
        let t = task(&store, "APP-1").await;
        if t.stage != "staging" {
            break t;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "staging did not finish after the restart; counters {samples:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if let Some(c) = staging_counters(port)
        && samples.last() != Some(&c)
    {
        samples.push(c);
    }
    second.terminate().await;

    assert!(
        end.stage == "failed" || end.stage == "implementation",
        "staging FAILED ends the task or loops back, got {}",
        end.stage
    );
    let jobs = store.task_jobs(end.id).await.unwrap();
    assert_eq!(
        deferred(&jobs),
        DEFER_LIMIT,
        "exactly the limit of defers for staging visit seq {staging_seq}: {jobs:#?}"
    );
    let any_marker = jobs
        .iter()
        .filter(|j| {
            j.task_content
                .contains(&markers::start(markers::STAGING_DEFER))
        })
        .count();
    assert_eq!(any_marker, DEFER_LIMIT, "no defer marker of another visit");

    let repo = dir.join(".orch/repos/service");
    let log = git_show(&repo, "orch/APP-1:docs/work-items/APP-1/15-staging-log.md")
        .expect("15-staging-log.md is committed on orch/APP-1");
    assert!(log.contains("staging_status: FAILED"), "{log}");
    assert!(log.contains("failure_kind: tool_error_exhausted"), "{log}");

    // D-4: the counters moved while the restarted process worked.
    let first_c = samples.first().expect("GET /queue answered");
    let last_c = samples.last().unwrap();
    let get = |c: &BTreeMap<String, u64>, k: &str| c.get(k).copied().unwrap_or(0);
    assert!(samples.len() >= 2, "the counters moved: {samples:?}");
    for k in ["runs", "tool_error", "deferred"] {
        assert!(
            get(last_c, k) > get(first_c, k),
            "staging_runner.{k} increased: {samples:?}"
        );
    }
    assert_eq!(get(last_c, "success"), 0, "{samples:?}");
    store.close().await;
}
