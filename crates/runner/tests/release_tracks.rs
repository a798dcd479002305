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
                prefix: "APP".into(),
            },
            repo: repo.into(),
            title: "t".into(),
            body: String::new(),
            stage: stage.into(),
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
        expected_stage: "verification".into(),
        new_stage: "implementation".into(),
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
                Some((holder.work_item_id.clone(), "observe".to_owned())),
                Some("a conflicting revert".to_owned()),
                vec![waiter.work_item_id.clone()],
            ),
            (
                "web".to_owned(),
                Some((other_repo.work_item_id.clone(), "merge".to_owned())),
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
