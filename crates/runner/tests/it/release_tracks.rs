//! `release::tracks`, the view `GET /queue` gives of each repo's release track, on a real
//! store: the holder is the task at a track stage (with its hold, if any); the waiters are the
//! tasks whose latest `release.waiting` belongs to their current stage visit.

use orch_domain::control::events;
use orch_domain::pipeline::Pipeline;
use orch_runner::release;
use orch_store::testing::TestDb;
use orch_store::{AdvanceStage, Fence, NewEvent, NewTask, Store, Task, WorkItemSpec};

async fn task(store: &Store, repo: &str, stage: &str) -> Task {
    store
        .create_task(NewTask {
            work_item: WorkItemSpec::Next {
                prefix: "APP".parse().unwrap(),
            },
            repo: repo.parse().unwrap(),
            title: "t".into(),
            body: String::new(),
            stage: stage.parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "submitted"),
            first_job: None,
        })
        .await
        .unwrap()
}

async fn event(store: &Store, t: &Task, kind: &str, data: serde_json::Value) {
    store
        .append_event(
            NewEvent::new(kind, "test")
                .task(t.id)
                .data(data.to_string()),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn holders_holds_and_waiters_per_repo() {
    let db = TestDb::sqlite().await;
    let s = &db.store;
    let holder = task(s, "svc", "observe").await;
    let waiter = task(s, "svc", "verification").await;
    let moved_on = task(s, "svc", "verification").await;
    let other_repo = task(s, "web", "merge").await;
    event(
        s,
        &waiter,
        events::RELEASE_WAITING,
        serde_json::json!({"seq": waiter.stage_seq}),
    )
    .await;
    // A wait of an earlier visit: the task has moved since.
    event(
        s,
        &moved_on,
        events::RELEASE_WAITING,
        serde_json::json!({"seq": moved_on.stage_seq}),
    )
    .await;
    s.advance_stage(AdvanceStage {
        task_id: moved_on.id,
        expected_stage: "verification".parse().unwrap(),
        new_stage: "implementation".parse().unwrap(),
        fence: Fence::Seq(moved_on.stage_seq),
        event: NewEvent::new("stage.loop_back", "back"),
        next_job: None,
    })
    .await
    .unwrap();
    event(
        s,
        &holder,
        events::RELEASE_HELD,
        serde_json::json!({"repo": "svc", "reason": "a conflicting revert"}),
    )
    .await;

    let tracks = release::tracks(s, &Pipeline::default()).await.unwrap();
    assert_eq!(
        tracks,
        vec![
            (
                "svc".to_owned(),
                Some((holder.work_item_id.to_string(), "observe".to_owned())),
                Some("a conflicting revert".to_owned()),
                vec![waiter.work_item_id.to_string()],
            ),
            (
                "web".to_owned(),
                Some((other_repo.work_item_id.to_string(), "merge".to_owned())),
                None,
                vec![],
            ),
        ]
    );
    // The operator's approval releases the hold.
    event(
        s,
        &holder,
        events::RELEASE_UNHELD,
        serde_json::json!({"repo": "svc"}),
    )
    .await;
    let tracks = release::tracks(s, &Pipeline::default()).await.unwrap();
    assert_eq!(tracks[0].2, None);
}

/// A job waiting for the release track (`[orch:release-wait seq=N]`) while another task of the
/// repo holds it waits again at the cost of one read: it never touches the repo (here the repo's
/// path does not even exist, so any git would fail the attempt), the task stays where it is,
/// and one follow-up wait is queued after `release::WAIT_S`. Once the track is free the same
/// kind of job goes on to the stage change, which needs the repo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_job_waits_again_without_touching_the_repo_while_the_track_is_held() {
    use std::sync::Arc;
    use std::time::Duration;

    use orch_domain::config::Config;
    use orch_domain::control::markers;
    use orch_runner::counters::Counters;
    use orch_runner::engine::{Engine, EngineConfig, StageJob, job_kind};
    use orch_runner::live_config::LiveConfig;
    use orch_runner::worker::{Registry, Worker, WorkerConfig};
    use orch_store::{JobState, NewJob};
    use tokio_util::sync::CancellationToken;

    let db = TestDb::sqlite().await;
    let store = &db.store;
    let tmp = tempfile::tempdir().unwrap();
    let toml = "[agents.analyst]\nbackend = \"claude\"\n[agents.architect]\nbackend = \"claude\"\n\
                [agents.developer]\nbackend = \"claude\"\n[agents.reviewer]\nbackend = \"claude\"\n\
                [repos.app]\npath = \"no-such-repo\"\nprefix = \"APP\"\n";
    let config = Arc::new(Config::from_toml_str(toml, &|_: &str| None).unwrap());
    let pipeline = Arc::new(config.pipeline().unwrap());
    let repos_dir = tmp.path().join("repos");
    let engine = Arc::new(Engine::new(
        store.clone(),
        EngineConfig {
            config: config.clone(),
            live: LiveConfig::new(config.clone(), store.now_ms()),
            pipeline: pipeline.clone(),
            root: tmp.path().to_path_buf(),
            repos_dir: repos_dir.clone(),
            node: "n1".into(),
        },
        Arc::new(Counters::new()),
    ));
    let mut registry = Registry::new();
    engine.register(&mut registry, Duration::from_secs(60));

    let holder = task(store, "app", "merge").await;
    let waiter = task(store, "app", "verification").await;
    let stage = pipeline
        .stages
        .iter()
        .find(|s| s.name.as_str() == "verification")
        .unwrap();
    let kind = job_kind(stage);
    let payload = StageJob {
        stage: "verification".into(),
        seq: waiter.stage_seq,
    }
    .with_marker(&markers::release_wait(waiter.stage_seq));
    let first = store
        .enqueue(NewJob::new(kind.clone(), payload).task(waiter.id))
        .await
        .unwrap()
        .job_id;

    let mut wc = WorkerConfig::new("w");
    wc.poll_interval = Duration::from_millis(20);
    let stop = CancellationToken::new();
    let worker = tokio::spawn(
        Worker::new(store.clone(), registry, wc).run(stop.clone(), CancellationToken::new()),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    // The follow-up is enqueued by the handler, the job's completion comes after it (batched):
    // wait for both.
    let follow_up = loop {
        let jobs = store.task_jobs(waiter.id).await.unwrap();
        let done = jobs
            .iter()
            .any(|j| j.id == first && j.state == JobState::Done);
        if let Some(next) = jobs.iter().find(|j| j.id != first).filter(|_| done) {
            break next.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no follow-up wait: {jobs:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let done = store.get_job(first).await.unwrap().unwrap();
    assert_eq!(done.state, JobState::Done, "{done:?}");
    assert_eq!(follow_up.state, JobState::Queued);
    assert_eq!(follow_up.agent, kind);
    assert!(markers::is_release_wait(&follow_up.task_content));
    assert_eq!(
        follow_up.available_at - done.finished_at.unwrap(),
        i64::try_from(release::WAIT_S * 1000).unwrap(),
        "waits release::WAIT_S (store time stands still in this test)"
    );
    assert!(
        !repos_dir.join("app").exists(),
        "the wait touched the repo: {}",
        repos_dir.display()
    );
    let w = store.get_task(waiter.id).await.unwrap().unwrap();
    assert_eq!(
        (w.stage.as_str(), w.stage_seq),
        ("verification", waiter.stage_seq)
    );
    assert!(
        store
            .task_events(waiter.id)
            .await
            .unwrap()
            .iter()
            .all(|e| e.kind != "job.attempt_failed"),
        "the wait spent an attempt"
    );

    // The holder leaves the track; the next wait goes on to the stage change, which needs the
    // repo (missing here): that attempt fails, which is how we know it got past the read.
    store
        .advance_stage(AdvanceStage {
            task_id: holder.id,
            expected_stage: "merge".parse().unwrap(),
            new_stage: "done".parse().unwrap(),
            fence: Fence::Seq(holder.stage_seq),
            event: NewEvent::new("stage.advanced", "merge -> done"),
            next_job: None,
        })
        .await
        .unwrap();
    db.clock
        .advance_ms(i64::try_from(release::WAIT_S * 1000).unwrap() + 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let events = store.task_events(waiter.id).await.unwrap();
        if let Some(e) = events.iter().find(|e| e.kind == "job.attempt_failed") {
            assert_eq!(e.job_id, Some(follow_up.id), "{e:?}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the free track's wait never reached the repo: {events:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    worker.await.unwrap();
}
