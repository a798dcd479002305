//! Releases are serialized across processes (PostgreSQL): two `orch worker` processes on one
//! machine share the demo's `repos_dir`, and four work items (the demo agent's "note" scenario:
//! each writes only `notes/<id>.txt`) reach the merge gate at about the same time. The repo's
//! release track (held in the database, `release.rs`) lets one of them at a time through merge →
//! staging → deploy → watch → lessons; without it two releases would race on the default branch
//! and one would be lost or fail. The default branch must end with every item's change, and the
//! service's unit tests must pass on its head.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    become_subreaper, demo_setup, orch_db, python_available, skip, spawn_worker, terminate,
};
use orch_store::{ConnectOptions, Store};

const ITEMS: usize = 4;

fn git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?} in {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_worker_processes_merge_four_items_without_losing_one() {
    if !python_available() {
        return skip("python3 is not installed: the demo's sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir: PathBuf = tmp.path().join("demo");
    demo_setup(&dir);
    let url = orch_store::testing::fresh_pg_schema().await;
    orch_db(&dir, &url, &["migrate"]);
    let ids: Vec<String> = (1..=ITEMS).map(|n| format!("APP-{n}")).collect();
    for n in 1..=ITEMS {
        let title = format!("Write note {n}");
        orch_db(
            &dir,
            &url,
            &[
                "submit",
                "--repo",
                "service",
                "--title",
                &title,
                "--body",
                "Add a note.",
            ],
        );
    }
    let store = Store::connect(&url, ConnectOptions::default())
        .await
        .unwrap();

    let workers = [
        spawn_worker(&dir, &url, "merge-serial-a"),
        spawn_worker(&dir, &url, "merge-serial-b"),
    ];
    // One release at a time: all four finish.
    let t0 = Instant::now();
    let stages = loop {
        let mut stages = Vec::new();
        for id in &ids {
            let t = store.get_task_by_work_item(id).await.unwrap().unwrap();
            stages.push((id.clone(), t.stage));
        }
        if stages.iter().all(|(_, s)| s == "done") {
            break stages;
        }
        // An item that ended otherwise will not be released: say why at once.
        if let Some((id, stage)) = stages
            .iter()
            .find(|(_, s)| s == "failed" || s == "cancelled")
        {
            let t = store.get_task_by_work_item(id).await.unwrap().unwrap();
            let story: Vec<String> = store
                .task_events(t.id)
                .await
                .unwrap()
                .iter()
                .map(|e| format!("{} {} {}", e.kind, e.message, e.data))
                .collect();
            for w in workers {
                terminate(w).await;
            }
            common::stop_service(&dir);
            panic!(
                "{id} ended {stage}, not released: {stages:?}\n{story:#?}\nworker a:\n{}\nworker b:\n{}",
                common::worker_log(&dir, "merge-serial-a", 60),
                common::worker_log(&dir, "merge-serial-b", 60)
            );
        }
        if t0.elapsed() > Duration::from_secs(600) {
            for w in workers {
                terminate(w).await;
            }
            common::stop_service(&dir);
            panic!("not every item was released within 600 s: {stages:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    for w in workers {
        terminate(w).await;
    }
    common::stop_service(&dir);
    for (id, stage) in &stages {
        assert_eq!(stage, "done", "{id} released");
    }

    // Every merge is on the default branch of the shared clone; none was lost.
    let repo = dir.join(".orch/repos/service");
    let files = git(&repo, &["ls-tree", "--name-only", "main", "notes/"]);
    let log = git(&repo, &["log", "--format=%H %s", "main"]);
    for id in &ids {
        assert!(
            files.lines().any(|f| f == format!("notes/{id}.txt")),
            "notes/{id}.txt is on main: {files}\n{log}"
        );
        // The commit that added the note reached main once.
        let added = git(
            &repo,
            &[
                "log",
                "--format=%H",
                "main",
                "--",
                &format!("notes/{id}.txt"),
            ],
        );
        assert_eq!(
            added.lines().count(),
            1,
            "one commit on main adds notes/{id}.txt:\n{log}"
        );
        let merge_log = git(
            &repo,
            &[
                "show",
                &format!("orch/{id}:docs/work-items/{id}/14-merge-log.md"),
            ],
        );
        assert!(
            merge_log.contains(&format!("work_item: {id}")),
            "{merge_log}"
        );
    }

    // The head of main passes the service's unit tests.
    let check = tmp.path().join("check");
    let out = std::process::Command::new("git")
        .args(["clone", "--quiet", "--branch", "main"])
        .arg(&repo)
        .arg(&check)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tests = std::process::Command::new("python3")
        .args(["-m", "unittest", "-q"])
        .current_dir(&check)
        .output()
        .unwrap();
    assert!(
        tests.status.success(),
        "python3 -m unittest on main's head: {}",
        String::from_utf8_lossy(&tests.stderr)
    );
    store.close().await;
}
