//! Self-deploy: the deploy command restarts the orch that runs it (as deploying orch itself
//! does). The real `orch serve` is killed by its own deploy, which ends under its supervisor; on
//! restart orch finds the `INITIATED` marker and the deploy's result, does not deploy again,
//! confirms the deploy and the pipeline carries on.

use crate::common;

use std::time::Duration;

use common::{
    Serve, become_subreaper, demo_setup, open, python_available, reap_orphans, skip, stop_service,
    wait_terminal,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deploy_that_kills_its_own_orch_is_finalized_after_the_restart() {
    if !python_available() {
        return skip("python3 is not installed: the sample service cannot run");
    }
    become_subreaper();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    demo_setup(&dir);
    let config_path = dir.join("orch.toml");
    let config = std::fs::read_to_string(&config_path).unwrap();
    let count = dir.join("deploy-count");
    let pid_file = dir.join("serve.pid");
    let mut out = String::new();
    for line in config.lines() {
        if let Some(cmd) = line.strip_prefix("deploy = \"") {
            let cmd = cmd.trim_end_matches('"');
            // Count the runs, deploy, then kill the orch that runs this command (as a
            // restart of orch's own service would; the command runs under orch's supervisor,
            // so orch is not its parent).
            out.push_str(&format!(
                "deploy = \"echo run >> {} && {cmd} && kill -9 $(cat {})\"\n",
                count.display(),
                pid_file.display()
            ));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    std::fs::write(&config_path, out).unwrap();
    let submit = std::process::Command::new(common::ORCH)
        .arg("--config")
        .arg(&config_path)
        .args([
            "submit",
            "--repo",
            "service",
            "--title",
            "Add a /version endpoint",
        ])
        .output()
        .unwrap();
    assert!(
        submit.status.success(),
        "{}",
        String::from_utf8_lossy(&submit.stderr)
    );

    let store = open(&dir).await;
    let mut first = Serve::start(&dir, 50);
    std::fs::write(&pid_file, first.child.id().unwrap().to_string()).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(180), first.child.wait())
        .await
        .expect("the deploy kills orch within 180 s")
        .unwrap();
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "orch was killed by its own deploy: {status}"
    );
    reap_orphans();
    let t = store.get_task_by_work_item("APP-1").await.unwrap().unwrap();
    assert_eq!(
        t.stage, "deploy",
        "killed in the middle of its deploy stage"
    );
    let markers = dir.join(".orch/repos/.deploy-state-service/APP-1/INITIATED");
    assert!(
        markers.exists(),
        "the INITIATED marker survives the restart"
    );

    let second = Serve::start(&dir, 50);
    let done = wait_terminal(&store, "APP-1", Duration::from_secs(180)).await;
    second.terminate().await;
    stop_service(&dir);
    reap_orphans();
    assert_eq!(done.stage, "done");
    let runs = std::fs::read_to_string(&count).unwrap();
    assert_eq!(
        runs.lines().count(),
        1,
        "the deploy ran once; the restart finalized it"
    );
    let events = store.task_events(done.id).await.unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == "deploy.confirmed")
            .count(),
        1
    );
    assert!(
        events.iter().any(|e| e.kind == "post_deploy.verdict"),
        "the watch was armed and ran"
    );
    store.close().await;
}
