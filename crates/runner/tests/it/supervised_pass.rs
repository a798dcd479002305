//! The supervised pass: what this machine keeps of a job (a lost command's record, an agent's
//! session state) goes once the job has ended or another node holds it, and stays while the
//! job may still run here.

use orch_runner::maintenance::{Pass, SupervisedPass};
use orch_store::NewJob;
use orch_store::testing::{TestDb, start_job};

/// A lost command's record (no result, no supervisor) and its agent state, for `job`.
fn keep_records_of(records: &std::path::Path, job: i64) -> [std::path::PathBuf; 2] {
    let record = records.join(format!("j{job}.agent-0"));
    std::fs::create_dir_all(&record).unwrap();
    let state = orch_exec::supervise::state_dir(&format!("j{job}.agent-0"))
        .unwrap()
        .unwrap();
    std::fs::write(state.join("transcript"), "what the agent saw").unwrap();
    [record, state]
}

#[tokio::test]
async fn the_records_of_jobs_this_machine_no_longer_runs_are_forgotten() {
    let tmp = tempfile::tempdir().unwrap();
    let records = tmp.path().join("supervised");
    orch_exec::supervise::enable(&records).unwrap();
    let children = tmp.path().join("children");
    std::fs::create_dir_all(&children).unwrap();
    // This machine's orch processes ran as worker `test` (the id `start_job` claims with).
    std::fs::write(children.join("1.worker"), "test\n").unwrap();
    let db = TestDb::sqlite().await;
    let enqueue = |n: u32| {
        let store = db.store.clone();
        async move {
            store
                .enqueue(NewJob::new("k", format!("job {n}")))
                .await
                .unwrap()
                .job_id
        }
    };
    let (ended, queued, running) = (enqueue(1).await, enqueue(2).await, enqueue(3).await);
    assert!(db.store.cancel_job(ended).await.unwrap());
    start_job(&db.store, running).await;
    let kept_of = |job| keep_records_of(&records, job);
    let (ended_files, queued_files, running_files) =
        (kept_of(ended), kept_of(queued), kept_of(running));
    let pass = SupervisedPass {
        every: std::time::Duration::from_secs(1),
        children_dir: children.clone(),
    };
    pass.run(&db.store).await.unwrap();
    for f in &ended_files {
        assert!(!f.exists(), "an ended job's {} is forgotten", f.display());
    }
    for f in queued_files.iter().chain(&running_files) {
        assert!(f.exists(), "{} may still be needed here", f.display());
    }
    // Another node holds the running job now: this machine's copy goes too.
    std::fs::write(children.join("1.worker"), "an-earlier-id\n").unwrap();
    pass.run(&db.store).await.unwrap();
    for f in &running_files {
        assert!(
            !f.exists(),
            "a job taken over elsewhere: {} is forgotten",
            f.display()
        );
    }
    for f in &queued_files {
        assert!(
            f.exists(),
            "{} stays while the job waits to run",
            f.display()
        );
    }
    assert_eq!(orch_exec::supervise::jobs_with_records(), [queued]);
}
