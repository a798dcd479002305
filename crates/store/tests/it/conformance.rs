//! The conformance suite: the same test functions run against SQLite and PostgreSQL. A backend
//! is correct when it passes every case here.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use orch_domain::control::events;
use orch_store::testing::{T0, TestDb};
use orch_store::*;

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(orch_store::testing::TestDb::sqlite().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(orch_store::testing::TestDb::postgres().await).await;
                }
            )*
        }
    };
}

conformance!(
    stale_attempt_cannot_mark_done,
    expired_lease_is_rescued_exactly_once,
    a_dead_workers_leases_end_at_once,
    concurrent_claimers_run_every_job_exactly_once,
    advance_stage_with_wrong_expected_stage_changes_nothing,
    advance_stage_with_a_lost_lease_changes_nothing,
    advance_stage_writes_stage_event_and_next_job_together,
    operator_fence_is_the_stage_seq,
    dedupe_key_allows_one_job_ever,
    delayed_job_is_invisible_before_its_time,
    next_available_at_is_the_soonest_job_this_worker_may_run,
    attempt_limit_ends_in_failed_and_fails_the_stranded_task,
    crash_rescues_do_not_spend_attempts,
    crash_loop_ends_the_job_with_a_clear_reason,
    retry_at_the_attempt_limit_is_a_failure,
    heartbeat_extends_leases_and_reports_lost_ones,
    release_does_not_spend_an_attempt,
    cancelled_job_fences_its_worker,
    bad_job_input_is_refused,
    work_item_ids_are_allocated_per_prefix,
    concurrent_task_creation_never_reuses_an_id,
    retention_prunes_only_old_finished_jobs_of_finished_tasks,
    marker_counts_match_literal_substrings,
    complete_and_claim_reports_fenced_completions,
    claim_order_priority_and_node_affinity,
    queue_stats_counts_kinds_and_leases,
    control_views_count_the_work_in_flight_and_a_recent_window,
    migrate_is_idempotent_and_versioned,
    wakeups_fire_on_enqueue,
    events_of_many_tasks_are_read_at_once_per_task_oldest_first,
    a_jobs_fenced_event_is_written_only_while_its_lease_holds,
    a_task_stranded_after_its_other_job_ended_is_failed_by_the_sweep,
    agent_runs_and_usage,
    bulk_enqueue_skips_duplicates,
    list_tasks_filters_and_pages_newest_first,
    cancel_task_jobs_spares_the_kept_job_and_fences_workers,
    appended_events_are_read_back_by_task_and_by_kind,
    target_names_the_database_and_close_ends_the_store,
    exclusive_stages_admit_one_task_per_repo,
    racing_exclusive_changes_admit_exactly_one,
    jobs_of_a_gone_node_are_claimable_after_the_grace_not_before,
    a_live_nodes_jobs_are_never_taken_over,
    a_never_seen_node_counts_from_when_its_job_became_ready,
    a_gone_nodes_job_waits_the_grace_once_ready,
    take_over_repins_the_job_fenced_by_its_lease,
    a_follow_up_and_its_event_are_written_together_fenced_by_the_lease,
    every_terminal_stage_change_enqueues_one_task_ended_job,
    a_followed_repo_is_every_live_task_and_the_recently_ended,
    a_write_at_a_visit_is_one_compare_and_swap,
    racing_writes_at_one_visit_enqueue_exactly_one_job,
    a_corrupt_task_row_is_an_error_alone_and_left_out_of_listings,
);

const LEASE: i64 = 30_000;

fn claim(worker: &str, limit: u32) -> Claim {
    Claim {
        worker_id: worker.to_owned(),
        limit,
        lease_ms: LEASE,
        kinds: Vec::new(),
        node: None,
        node_grace_ms: None,
    }
}

async fn claim_one(store: &Store, worker: &str) -> ClaimedJob {
    let mut got = store.claim(&claim(worker, 1)).await.expect("claim");
    assert_eq!(got.len(), 1, "expected exactly one job to claim");
    got.remove(0)
}

async fn new_task(store: &Store, with_job: bool) -> Task {
    store
        .create_task(NewTask {
            work_item: WorkItemSpec::Next {
                prefix: "ORCH".parse().unwrap(),
            },
            repo: "svc".parse().unwrap(),
            title: "a task".into(),
            body: String::new(),
            stage: "intake".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "submitted"),
            first_job: with_job.then(|| NewJob::new("analyst", "analyse")),
        })
        .await
        .expect("create task")
}

async fn stale_attempt_cannot_mark_done(db: TestDb) {
    let s = &db.store;
    s.enqueue(NewJob::new("noop", "x")).await.unwrap();
    let first = claim_one(s, "w1").await;
    db.clock.advance_ms(LEASE + 1);
    let report = s.rescue_expired(Rescue::default()).await.unwrap();
    assert_eq!(report.requeued, vec![first.lease.job_id]);
    db.clock.advance_ms(Rescue::default().backoff_ms(1));
    let second = claim_one(s, "w2").await;
    assert_eq!(second.lease.job_id, first.lease.job_id);
    assert_eq!(second.lease.attempt, first.lease.attempt + 1);

    let err = s
        .mark_job(first.lease, JobOutcome::Done, None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::LeaseLost { .. }),
        "stale attempt must be fenced, got {err}"
    );
    let job = s.get_job(first.lease.job_id).await.unwrap().unwrap();
    assert_eq!(
        job.state,
        JobState::Running,
        "the stale mark changed nothing"
    );
    assert_eq!(job.locked_by.as_deref(), Some("w2"));

    s.mark_job(second.lease, JobOutcome::Done, None)
        .await
        .unwrap();
    let job = s.get_job(first.lease.job_id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Done);
    // Marking again, even with the right attempt, is an error: the job is no longer running.
    let again = s.mark_job(second.lease, JobOutcome::Done, None).await;
    assert!(matches!(again, Err(StoreError::LeaseLost { .. })));
}

async fn expired_lease_is_rescued_exactly_once(db: TestDb) {
    let s = &db.store;
    let id = s.enqueue(NewJob::new("noop", "x")).await.unwrap().job_id;
    let claimed = claim_one(s, "w1").await;
    db.clock.advance_ms(LEASE + 1);
    // Four "processes" rescue at the same time.
    let mut handles = Vec::new();
    for _ in 0..4 {
        let store = db.reopen().await;
        handles.push(tokio::spawn(async move {
            store.rescue_expired(Rescue::default()).await
        }));
    }
    let mut requeued = Vec::new();
    for h in handles {
        requeued.extend(h.await.unwrap().unwrap().requeued);
    }
    assert_eq!(requeued, vec![id], "rescued exactly once");
    let job = s.get_job(id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Queued);
    assert_eq!(job.attempt, claimed.lease.attempt, "rescue does not claim");
    assert!(
        job.last_error
            .unwrap_or_default()
            .contains("stopped heartbeating (crash)")
    );
    let lost = s.events_by_kind(events::JOB_RESCUED, 0, 10).await.unwrap();
    assert_eq!(lost.len(), 1, "one lost attempt recorded once");
    assert_eq!(
        job.available_at,
        db.clock.now_ms() + Rescue::default().backoff_ms(1),
        "re-queued with backoff"
    );
    // A second pass finds nothing.
    let again = s.rescue_expired(Rescue::default()).await.unwrap();
    assert!(again.requeued.is_empty() && again.failed.is_empty());
}

async fn a_dead_workers_leases_end_at_once(db: TestDb) {
    let s = &db.store;
    let dead = s.enqueue(NewJob::new("noop", "a")).await.unwrap().job_id;
    claim_one(s, "w-dead").await;
    let live = s.enqueue(NewJob::new("noop", "b")).await.unwrap().job_id;
    let held = claim_one(s, "w-live").await;
    assert_eq!(held.job.id, live);
    // Before the lease runs out: nothing to rescue.
    assert!(
        s.rescue_expired(Rescue::default())
            .await
            .unwrap()
            .requeued
            .is_empty()
    );
    assert_eq!(s.expire_leases_of("w-dead").await.unwrap(), 1);
    assert_eq!(
        s.expire_leases_of("w-dead").await.unwrap(),
        0,
        "already ended"
    );
    assert_eq!(s.expire_leases_of("w-nobody").await.unwrap(), 0);
    assert!(s.expire_leases_of("").await.is_err());
    let report = s.rescue_expired(Rescue::default()).await.unwrap();
    assert_eq!(report.requeued, vec![dead], "only the dead worker's job");
    let job = s.get_job(dead).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Queued);
    assert_eq!(
        s.events_by_kind(events::JOB_RESCUED, 0, 10)
            .await
            .unwrap()
            .len(),
        1,
        "a crash like any other: job.rescued, no attempt spent"
    );
    let other = s.get_job(live).await.unwrap().unwrap();
    assert_eq!(
        other.state,
        JobState::Running,
        "the live worker keeps its lease"
    );
}

async fn concurrent_claimers_run_every_job_exactly_once(db: TestDb) {
    const JOBS: usize = 400;
    const CLAIMERS: usize = 8;
    let jobs = (0..JOBS)
        .map(|i| NewJob::new("noop", format!("job {i}")))
        .collect();
    assert_eq!(db.store.enqueue_many(jobs).await.unwrap(), JOBS as u64);
    let mut handles = Vec::new();
    for w in 0..CLAIMERS {
        let store = db.reopen().await;
        handles.push(tokio::spawn(async move {
            let worker = format!("w{w}");
            let mut ran = Vec::new();
            let mut pending: Vec<Lease> = Vec::new();
            loop {
                let limit = 1 + (w as u32 % 4);
                let out = store
                    .complete_and_claim(&pending, Some(&claim(&worker, limit)))
                    .await
                    .expect("complete_and_claim");
                assert!(out.fenced.is_empty(), "no completion may be fenced here");
                if out.claimed.is_empty() {
                    return ran;
                }
                pending = out.claimed.iter().map(|c| c.lease).collect();
                ran.extend(out.claimed.iter().map(|c| c.job.id));
            }
        }));
    }
    let mut runs: HashMap<i64, usize> = HashMap::new();
    for h in handles {
        for id in h.await.unwrap() {
            *runs.entry(id).or_default() += 1;
        }
    }
    assert_eq!(runs.len(), JOBS, "every job ran");
    assert!(runs.values().all(|&n| n == 1), "no job ran twice");
    let stats = db.store.queue_stats().await.unwrap();
    let done: i64 = stats
        .counts
        .iter()
        .filter(|c| c.state == JobState::Done)
        .map(|c| c.count)
        .sum();
    assert_eq!(done, JOBS as i64, "every job is done");
}

async fn advance_stage_with_wrong_expected_stage_changes_nothing(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, true).await;
    let job = claim_one(s, "w1").await;
    let events_before = s.task_events(task.id).await.unwrap().len();
    let err = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "review".parse().unwrap(),
            new_stage: "verification".parse().unwrap(),
            fence: Fence::Job(job.lease),
            event: NewEvent::new("stage.advanced", "x"),
            next_job: Some(NewJob::new("tester", "t")),
        })
        .await
        .unwrap_err();
    match &err {
        StoreError::StageConflict {
            expected, actual, ..
        } => {
            assert_eq!(expected, "review");
            assert_eq!(actual, "intake");
        }
        other => panic!("expected a stage conflict, got {other}"),
    }
    assert!(err.to_string().contains("nothing was changed"), "{err}");
    let after = s.get_task(task.id).await.unwrap().unwrap();
    assert_eq!(after, task, "the task is untouched");
    assert_eq!(s.task_events(task.id).await.unwrap().len(), events_before);
    assert_eq!(
        s.task_jobs(task.id).await.unwrap().len(),
        1,
        "no job enqueued"
    );
}

async fn advance_stage_with_a_lost_lease_changes_nothing(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, true).await;
    let job = claim_one(s, "w1").await;
    db.clock.advance_ms(LEASE + 1);
    s.rescue_expired(Rescue::default()).await.unwrap();
    let err = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "intake".parse().unwrap(),
            new_stage: "analysis".parse().unwrap(),
            fence: Fence::Job(job.lease),
            event: NewEvent::new("stage.advanced", "x"),
            next_job: None,
        })
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err}");
    assert_eq!(s.get_task(task.id).await.unwrap().unwrap().stage, "intake");
}

async fn advance_stage_writes_stage_event_and_next_job_together(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, true).await;
    let job = claim_one(s, "w1").await;
    let adv = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "intake".parse().unwrap(),
            new_stage: "analysis".parse().unwrap(),
            fence: Fence::Job(job.lease),
            event: NewEvent::new("stage.advanced", "intake → analysis"),
            next_job: Some(NewJob::new("analyst", "go")),
        })
        .await
        .unwrap();
    assert_eq!(adv.task.stage, "analysis");
    assert_eq!(adv.task.stage_seq, task.stage_seq + 1);
    let next = s.get_job(adv.next_job_id.unwrap()).await.unwrap().unwrap();
    assert_eq!(next.task_id, Some(task.id));
    assert_eq!(
        next.dedupe_key,
        Some(stage_job_key(task.id, adv.task.stage_seq))
    );
    let events = s.task_events(task.id).await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.kind, "stage.advanced");
    assert_eq!(last.stage.as_deref(), Some("analysis"));
    // The same advance again (a crashed worker's retry) is refused and adds nothing.
    let again = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "intake".parse().unwrap(),
            new_stage: "analysis".parse().unwrap(),
            fence: Fence::Job(job.lease),
            event: NewEvent::new("stage.advanced", "again"),
            next_job: Some(NewJob::new("analyst", "go")),
        })
        .await;
    assert!(matches!(again, Err(StoreError::StageConflict { .. })));
    assert_eq!(s.task_jobs(task.id).await.unwrap().len(), 2);
}

async fn operator_fence_is_the_stage_seq(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, false).await;
    let moved = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "intake".parse().unwrap(),
            new_stage: "analysis".parse().unwrap(),
            fence: Fence::Seq(task.stage_seq),
            event: NewEvent::new("approval.granted", "approved"),
            next_job: None,
        })
        .await
        .unwrap();
    // An operator acting on the stale view (same stage name, old seq) is refused.
    let back = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "analysis".parse().unwrap(),
            new_stage: "cancelled".parse().unwrap(),
            fence: Fence::Seq(task.stage_seq),
            event: NewEvent::new("task.cancelled", "x"),
            next_job: None,
        })
        .await;
    assert!(matches!(back, Err(StoreError::StageConflict { .. })));
    let ok = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "analysis".parse().unwrap(),
            new_stage: "cancelled".parse().unwrap(),
            fence: Fence::Seq(moved.task.stage_seq),
            event: NewEvent::new("task.cancelled", "x"),
            next_job: None,
        })
        .await
        .unwrap();
    assert!(ok.task.is_terminal());
}

/// Whatever ends a task (a stage change to a terminal stage, the failure of its last job), its
/// `task-ended` job is written in the same transaction: one per terminal visit, task-less (a
/// cancel of the task's jobs never cancels it), naming the task and the visit.
async fn every_terminal_stage_change_enqueues_one_task_ended_job(db: TestDb) {
    use orch_domain::control::{dedupe, jobs};
    let s = &db.store;
    let ended = |limit| {
        let mut c = claim("w", limit);
        c.kinds = vec![jobs::TASK_ENDED.to_owned()];
        c
    };
    // A stage change that does not end the task enqueues nothing.
    let task = new_task(s, false).await;
    let moved = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "intake".parse().unwrap(),
            new_stage: "analysis".parse().unwrap(),
            fence: Fence::Seq(task.stage_seq),
            event: NewEvent::new("stage.advanced", "on"),
            next_job: None,
        })
        .await
        .unwrap();
    assert!(s.claim(&ended(10)).await.unwrap().is_empty());
    // An operator's cancel ends it: one job, for that visit.
    let done = s
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "analysis".parse().unwrap(),
            new_stage: "cancelled".parse().unwrap(),
            fence: Fence::Seq(moved.task.stage_seq),
            event: NewEvent::new("task.cancelled", "x"),
            next_job: None,
        })
        .await
        .unwrap();
    s.cancel_task_jobs(task.id, None).await.unwrap();
    let got = s.claim(&ended(10)).await.unwrap();
    assert_eq!(
        got.len(),
        1,
        "one task-ended job, not cancelled with the task's jobs"
    );
    let job = &got[0].job;
    assert_eq!(job.task_id, None);
    assert_eq!(
        job.dedupe_key.as_deref(),
        Some(dedupe::task_ended(task.id, done.task.stage_seq).as_str())
    );
    let payload: serde_json::Value = serde_json::from_str(&job.task_content).unwrap();
    assert_eq!(payload["task"], task.id);
    assert_eq!(payload["seq"], done.task.stage_seq);
    // The failure of a task's last job ends it too.
    let other = new_task_with(s, NewJob::new("analyst", "x").max_attempts(1)).await;
    let mut c = claim("w", 1);
    c.kinds = vec!["analyst".to_owned()];
    let lease = s.claim(&c).await.unwrap().remove(0).lease;
    s.mark_job(
        lease,
        JobOutcome::Failed {
            error: "broke".into(),
        },
        None,
    )
    .await
    .unwrap();
    let failed = s.get_task(other.id).await.unwrap().unwrap();
    assert_eq!(failed.stage, "failed");
    let got = s.claim(&ended(10)).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].job.dedupe_key.as_deref(),
        Some(dedupe::task_ended(other.id, failed.stage_seq).as_str())
    );
}

async fn dedupe_key_allows_one_job_ever(db: TestDb) {
    let s = &db.store;
    let a = s
        .enqueue(NewJob::new("noop", "a").dedupe("k1"))
        .await
        .unwrap();
    let b = s
        .enqueue(NewJob::new("noop", "b").dedupe("k1"))
        .await
        .unwrap();
    assert!(!a.duplicate);
    assert!(b.duplicate);
    assert_eq!(a.job_id, b.job_id);
    let c = claim_one(s, "w").await;
    s.mark_job(c.lease, JobOutcome::Done, None).await.unwrap();
    // Even once the job is done, the key cannot be used again: a crashed worker re-running its
    // step cannot enqueue the follow-up a second time.
    let d = s
        .enqueue(NewJob::new("noop", "d").dedupe("k1"))
        .await
        .unwrap();
    assert!(d.duplicate);
    assert_eq!(d.job_id, a.job_id);
    assert!(s.claim(&claim("w", 5)).await.unwrap().is_empty());
}

async fn delayed_job_is_invisible_before_its_time(db: TestDb) {
    let s = &db.store;
    s.enqueue(NewJob::new("noop", "later").delay_s(10))
        .await
        .unwrap();
    assert!(s.claim(&claim("w", 10)).await.unwrap().is_empty());
    assert_eq!(
        s.next_available_at(&[], None).await.unwrap(),
        Some(T0 + 10_000)
    );
    db.clock.advance_ms(9_999);
    assert!(s.claim(&claim("w", 10)).await.unwrap().is_empty());
    db.clock.advance_ms(1);
    assert_eq!(s.claim(&claim("w", 10)).await.unwrap().len(), 1);
}

async fn next_available_at_is_the_soonest_job_this_worker_may_run(db: TestDb) {
    let s = &db.store;
    assert_eq!(s.next_available_at(&[], None).await.unwrap(), None);
    let kinds = |k: &[&str]| k.iter().map(|k| (*k).to_owned()).collect::<Vec<_>>();
    // Across priorities: the soonest is a low-priority job, behind a later high-priority one.
    s.enqueue(NewJob::new("a", "high, later").priority(5).delay_s(50))
        .await
        .unwrap();
    s.enqueue(NewJob::new("a", "low, sooner").priority(-1).delay_s(20))
        .await
        .unwrap();
    s.enqueue(NewJob::new("a", "default").delay_s(30))
        .await
        .unwrap();
    assert_eq!(
        s.next_available_at(&[], None).await.unwrap(),
        Some(T0 + 20_000)
    );
    // Only the kinds this worker runs, and only jobs it may run (unpinned or its node's).
    s.enqueue(NewJob::new("b", "other kind, soonest").delay_s(1))
        .await
        .unwrap();
    s.enqueue(
        NewJob::new("a", "other node, soonest")
            .delay_s(2)
            .node("n2"),
    )
    .await
    .unwrap();
    s.enqueue(NewJob::new("a", "this node").delay_s(15).node("n1"))
        .await
        .unwrap();
    assert_eq!(
        s.next_available_at(&kinds(&["a"]), Some("n1"))
            .await
            .unwrap(),
        Some(T0 + 15_000)
    );
    assert_eq!(
        s.next_available_at(&kinds(&["a"]), None).await.unwrap(),
        Some(T0 + 20_000)
    );
    assert_eq!(
        s.next_available_at(&kinds(&["a", "b"]), Some("n2"))
            .await
            .unwrap(),
        Some(T0 + 1_000)
    );
    assert_eq!(
        s.next_available_at(&kinds(&["c"]), None).await.unwrap(),
        None
    );
    // A job already due counts (its time is in the past): the worker should not sleep.
    db.clock.advance_ms(25_000);
    assert_eq!(
        s.next_available_at(&kinds(&["a"]), None).await.unwrap(),
        Some(T0 + 20_000)
    );
    // Claimed jobs are no longer queued.
    let mut c = claim("w", 10);
    c.kinds = kinds(&["a"]);
    assert_eq!(s.claim(&c).await.unwrap().len(), 1);
    assert_eq!(
        s.next_available_at(&kinds(&["a"]), None).await.unwrap(),
        Some(T0 + 30_000)
    );
}

async fn attempt_limit_ends_in_failed_and_fails_the_stranded_task(db: TestDb) {
    let s = &db.store;
    let task = s
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact("ORCH-7".parse().unwrap()),
            repo: "svc".parse().unwrap(),
            title: "t".into(),
            body: String::new(),
            stage: "intake".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "x"),
            first_job: Some(NewJob::new("analyst", "x").max_attempts(2)),
        })
        .await
        .unwrap();
    // Handler failures spend the job's attempts: the second retry is the last one.
    for attempt in 1..=2 {
        let c = claim_one(s, "w").await;
        assert_eq!(c.lease.attempt, attempt);
        s.mark_job(
            c.lease,
            JobOutcome::Retry {
                error: "the stage broke".into(),
                delay_ms: 0,
            },
            None,
        )
        .await
        .unwrap();
    }
    let job = &s.task_jobs(task.id).await.unwrap()[0];
    assert_eq!(job.state, JobState::Failed);
    let t = s.get_task(task.id).await.unwrap().unwrap();
    assert_eq!(
        t.stage, "failed",
        "a task whose only job failed does not hang"
    );
    assert_eq!(
        t.stage_seq,
        task.stage_seq + 1,
        "a stage change bumps stage_seq"
    );
    let events = s.task_events(task.id).await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.kind, "task.failed");
    assert_eq!(last.stage.as_deref(), Some("failed"));
    assert!(last.message.contains("the stage broke"), "{}", last.message);
    let data: serde_json::Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(
        data["from"], "intake",
        "task.failed says where it came from: {data}"
    );
    assert_eq!(data["to"], "failed");
    assert_eq!(data["outcome"], "failed");
}

/// A lease that expires (the worker died) is a crash, not a failure: it does not spend the
/// job's attempts, so a job with 2 attempts survives many crashes and still gets both of its
/// handler attempts.
async fn crash_rescues_do_not_spend_attempts(db: TestDb) {
    let s = &db.store;
    let task = new_task_with(s, NewJob::new("analyst", "x").max_attempts(2)).await;
    let rescue = Rescue::default();
    for crash in 1..=5 {
        let c = claim_one(s, "w").await;
        assert_eq!(c.lease.attempt, crash);
        db.clock.advance_ms(LEASE + 1);
        let report = s.rescue_expired(rescue).await.unwrap();
        assert_eq!(
            report.requeued,
            vec![c.lease.job_id],
            "crash {crash} requeues"
        );
        db.clock.advance_ms(rescue.backoff_ms(crash));
    }
    // The handler fails once: one attempt of two is left.
    let c = claim_one(s, "w").await;
    s.mark_job(
        c.lease,
        JobOutcome::Retry {
            error: "flaky".into(),
            delay_ms: 0,
        },
        None,
    )
    .await
    .unwrap();
    let job = s.get_job(c.lease.job_id).await.unwrap().unwrap();
    assert_eq!(
        job.state,
        JobState::Queued,
        "5 crashes + 1 failure of 2 attempts"
    );
    let c = claim_one(s, "w").await;
    s.mark_job(
        c.lease,
        JobOutcome::Retry {
            error: "flaky".into(),
            delay_ms: 0,
        },
        None,
    )
    .await
    .unwrap();
    let job = s.get_job(c.lease.job_id).await.unwrap().unwrap();
    assert_eq!(
        job.state,
        JobState::Failed,
        "the second handler failure is the last"
    );
    let events = s.task_events(task.id).await.unwrap();
    let lost: Vec<&Event> = events
        .iter()
        .filter(|e| e.kind == events::JOB_RESCUED)
        .collect();
    assert_eq!(lost.len(), 5);
    assert!(
        lost[0].message.starts_with(
            "attempt 1 lost: the worker stopped heartbeating (crash) \u{2014} not counted as a failure"
        ),
        "{}",
        lost[0].message
    );
    assert_eq!(lost[0].job_id, Some(c.lease.job_id));
}

/// A job that kills its worker every time still ends, with a reason that says so.
async fn crash_loop_ends_the_job_with_a_clear_reason(db: TestDb) {
    let s = &db.store;
    let task = new_task_with(s, NewJob::new("analyst", "x").max_attempts(3)).await;
    let rescue = Rescue::default();
    for crash in 1..=rescue.max_crashes {
        claim_one(s, "w").await;
        db.clock.advance_ms(LEASE + 1);
        let report = s.rescue_expired(rescue).await.unwrap();
        if crash < rescue.max_crashes {
            assert_eq!(report.requeued.len(), 1, "crash {crash}");
            db.clock.advance_ms(rescue.backoff_ms(crash));
        } else {
            assert_eq!(report.failed.len(), 1);
            assert_eq!(report.failed_tasks, vec![task.id]);
        }
    }
    let job = &s.task_jobs(task.id).await.unwrap()[0];
    assert_eq!(job.state, JobState::Failed);
    assert!(
        job.last_error
            .as_deref()
            .unwrap()
            .starts_with("the job's worker died 10 times while running it"),
        "{:?}",
        job.last_error
    );
    let t = s.get_task(task.id).await.unwrap().unwrap();
    assert_eq!(t.stage, "failed");
    let events = s.task_events(task.id).await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.kind, "task.failed");
    assert!(
        last.message.contains("worker died 10 times"),
        "{}",
        last.message
    );
    let data: serde_json::Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(
        (data["from"].as_str(), data["to"].as_str()),
        (Some("intake"), Some("failed"))
    );
}

async fn new_task_with(s: &Store, job: NewJob) -> Task {
    s.create_task(NewTask {
        work_item: WorkItemSpec::Next {
            prefix: "ORCH".parse().unwrap(),
        },
        repo: "svc".parse().unwrap(),
        title: "t".into(),
        body: String::new(),
        stage: "intake".parse().unwrap(),
        branch_prefix: "orch/".into(),
        event: NewEvent::new("task.submitted", "x"),
        first_job: Some(job),
    })
    .await
    .unwrap()
}

async fn retry_at_the_attempt_limit_is_a_failure(db: TestDb) {
    let s = &db.store;
    s.enqueue(NewJob::new("noop", "x").max_attempts(2))
        .await
        .unwrap();
    let c = claim_one(s, "w").await;
    s.mark_job(
        c.lease,
        JobOutcome::Retry {
            error: "flaky".into(),
            delay_ms: 500,
        },
        None,
    )
    .await
    .unwrap();
    assert!(s.claim(&claim("w", 1)).await.unwrap().is_empty(), "backoff");
    db.clock.advance_ms(500);
    let c2 = claim_one(s, "w").await;
    s.mark_job(
        c2.lease,
        JobOutcome::Retry {
            error: "flaky".into(),
            delay_ms: 500,
        },
        None,
    )
    .await
    .unwrap();
    let job = s.get_job(c.lease.job_id).await.unwrap().unwrap();
    assert_eq!(job.state, JobState::Failed);
    assert!(job.last_error.unwrap().contains("no attempts left"));
}

async fn heartbeat_extends_leases_and_reports_lost_ones(db: TestDb) {
    let s = &db.store;
    for i in 0..3 {
        s.enqueue(NewJob::new("noop", format!("{i}")))
            .await
            .unwrap();
    }
    let claimed = s.claim(&claim("w", 3)).await.unwrap();
    let leases: Vec<Lease> = claimed.iter().map(|c| c.lease).collect();
    db.clock.advance_ms(LEASE - 1);
    assert!(s.heartbeat("w", &leases, LEASE).await.unwrap().is_empty());
    db.clock.advance_ms(LEASE - 1);
    // Still alive thanks to the heartbeat.
    let r = s.rescue_expired(Rescue::default()).await.unwrap();
    assert!(r.requeued.is_empty());
    // One job is cancelled: its heartbeat reports it lost. Another worker's name loses all.
    s.cancel_job(leases[1].job_id).await.unwrap();
    assert_eq!(
        s.heartbeat("w", &leases, LEASE).await.unwrap(),
        vec![leases[1]]
    );
    assert_eq!(s.heartbeat("other", &leases, LEASE).await.unwrap().len(), 3);
}

async fn release_does_not_spend_an_attempt(db: TestDb) {
    let s = &db.store;
    s.enqueue(NewJob::new("noop", "x").max_attempts(1))
        .await
        .unwrap();
    let c = claim_one(s, "w").await;
    assert_eq!(s.release(&[c.lease]).await.unwrap(), 1);
    // The released job can run again even though max_attempts was 1.
    let again = claim_one(s, "w2").await;
    assert_eq!(again.lease.attempt, 2);
    s.mark_job(again.lease, JobOutcome::Done, None)
        .await
        .unwrap();
    // Releasing a lease that is already gone does nothing.
    assert_eq!(s.release(&[c.lease]).await.unwrap(), 0);
}

async fn cancelled_job_fences_its_worker(db: TestDb) {
    let s = &db.store;
    s.enqueue(NewJob::new("noop", "x")).await.unwrap();
    let c = claim_one(s, "w").await;
    assert!(s.cancel_job(c.lease.job_id).await.unwrap());
    assert!(
        !s.cancel_job(c.lease.job_id).await.unwrap(),
        "already ended"
    );
    let err = s
        .mark_job(c.lease, JobOutcome::Done, None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert!(matches!(
        s.cancel_job(987_654).await,
        Err(StoreError::JobNotFound(987_654))
    ));
}

async fn bad_job_input_is_refused(db: TestDb) {
    let s = &db.store;
    let cases = [
        NewJob::new("noop", "x").delay_ms(-1),
        NewJob::new("", "x"),
        NewJob::new("bad kind with spaces", "x"),
        NewJob::new("noop", "x").max_attempts(0),
        NewJob::new("noop", "x".repeat(MAX_TASK_CONTENT + 1)),
        NewJob::new("noop", "x").dedupe(""),
    ];
    for job in cases {
        let err = s.enqueue(job.clone()).await.unwrap_err();
        assert!(matches!(err, StoreError::Invalid(_)), "{job:?}: {err}");
    }
    let bad = s
        .enqueue(NewJob::new("noop", "x").delay_s(-5))
        .await
        .unwrap_err();
    assert!(bad.to_string().contains("negative"), "{bad}");
    assert!(
        s.claim(&claim("w", 10)).await.unwrap().is_empty(),
        "nothing written"
    );
    assert!(matches!(
        s.claim(&Claim {
            limit: 0,
            ..claim("w", 1)
        })
        .await,
        Err(StoreError::Invalid(_))
    ));
}

async fn work_item_ids_are_allocated_per_prefix(db: TestDb) {
    let s = &db.store;
    let a = new_task(s, false).await;
    let b = new_task(s, false).await;
    assert_eq!(a.work_item_id, "ORCH-1");
    assert_eq!(b.work_item_id, "ORCH-2");
    assert_eq!(b.branch, "orch/ORCH-2");
    let other = s
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact("ORCH-115".parse().unwrap()),
            repo: "svc".parse().unwrap(),
            title: "t".into(),
            body: String::new(),
            stage: "intake".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "x"),
            first_job: None,
        })
        .await
        .unwrap();
    assert_eq!(other.work_item_id, "ORCH-115");
    assert_eq!(new_task(s, false).await.work_item_id, "ORCH-116");
    let taken = s
        .create_task(NewTask {
            work_item: WorkItemSpec::Exact("ORCH-115".parse().unwrap()),
            repo: "svc".parse().unwrap(),
            title: "t".into(),
            body: String::new(),
            stage: "intake".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "x"),
            first_job: None,
        })
        .await;
    assert!(matches!(taken, Err(StoreError::WorkItemTaken(_))));
    // A bad prefix cannot reach the store: `WorkItemSpec::Next` takes a validated `Prefix`.
    assert!("OR%".parse::<orch_domain::ids::Prefix>().is_err());
    assert_eq!(
        s.get_task_by_work_item("ORCH-2").await.unwrap().unwrap().id,
        b.id
    );
}

async fn concurrent_task_creation_never_reuses_an_id(db: TestDb) {
    let mut handles = Vec::new();
    for _ in 0..4 {
        let store = db.reopen().await;
        handles.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for _ in 0..10 {
                ids.push(new_task(&store, true).await.work_item_id);
            }
            ids
        }));
    }
    let mut all = HashSet::new();
    for h in handles {
        for id in h.await.unwrap() {
            assert!(all.insert(id.clone()), "{id} allocated twice");
        }
    }
    assert_eq!(all.len(), 40);
}

async fn retention_prunes_only_old_finished_jobs_of_finished_tasks(db: TestDb) {
    let s = &db.store;
    const DAY: i64 = 24 * 3600 * 1000;
    // A live task's finished job: kept however old.
    let live = new_task(s, true).await;
    let c = claim_one(s, "w").await;
    s.mark_job(c.lease, JobOutcome::Done, None).await.unwrap();
    // A task that ends now: its job finished long before, but the task ended recently.
    let recent = new_task(s, true).await;
    let c = claim_one(s, "w").await;
    s.mark_job(c.lease, JobOutcome::Done, None).await.unwrap();
    // A task-less job that finishes now.
    s.enqueue(NewJob::new("noop", "free-standing"))
        .await
        .unwrap();
    let c = claim_one(s, "w").await;
    s.mark_job(c.lease, JobOutcome::Done, None).await.unwrap();
    // A task that ends now (cancelled), its job cancelled with it.
    let old = new_task(s, true).await;
    let advance = |t: &Task| AdvanceStage {
        task_id: t.id,
        expected_stage: t.stage.clone(),
        new_stage: "cancelled".parse().unwrap(),
        fence: Fence::Seq(t.stage_seq),
        event: NewEvent::new(events::TASK_CANCELLED, "cancelled"),
        next_job: None,
    };
    s.cancel_task_jobs(old.id, None).await.unwrap();
    s.advance_stage(advance(&old)).await.unwrap();
    db.clock.advance_ms(4 * DAY);
    s.advance_stage(advance(&recent)).await.unwrap();
    let cutoff = db.clock.now_ms() - 3 * DAY;
    let jobs_before = s.count_all_jobs().await.unwrap();
    let first = s.prune_finished(cutoff, 1).await.unwrap();
    assert_eq!(first, Pruned { jobs: 1, total: 1 }, "one per batch");
    let second = s.prune_finished(cutoff, 100).await.unwrap();
    assert_eq!(
        second,
        Pruned { jobs: 1, total: 2 },
        "the old task's job and the task-less one"
    );
    let none = s.prune_finished(cutoff, 100).await.unwrap();
    assert_eq!(none, Pruned { jobs: 0, total: 2 });
    assert_eq!(s.count_all_jobs().await.unwrap(), jobs_before - 2);
    assert_eq!(
        s.task_jobs(live.id).await.unwrap().len(),
        1,
        "a live task's job stays"
    );
    assert_eq!(
        s.task_jobs(recent.id).await.unwrap().len(),
        1,
        "ended within the retention"
    );
    assert!(s.task_jobs(old.id).await.unwrap().is_empty());
    assert_eq!(s.pruned_total().await.unwrap(), 2);
    // Each batch is one event, written with its deletion, carrying the running total.
    let pruned = s.events_by_kind(events::JOBS_PRUNED, 0, 10).await.unwrap();
    assert_eq!(pruned.len(), 2);
    let data: Vec<serde_json::Value> = pruned
        .iter()
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect();
    assert_eq!(data[0]["jobs"], 1);
    assert_eq!(data[1]["total"], 2);
    // Events and the tasks themselves are kept.
    assert!(!s.task_events(old.id).await.unwrap().is_empty());
    assert!(s.get_task(old.id).await.unwrap().is_some());
    // Counters read live tasks only: a finished task counts nothing, before or after.
    let count = JobCount {
        task_id: recent.id,
        agent: "analyst".into(),
        content_contains: None,
    };
    assert_eq!(s.count_jobs(&count).await.unwrap(), 0);
    let count = JobCount {
        task_id: live.id,
        ..count
    };
    assert_eq!(s.count_jobs(&count).await.unwrap(), 1);
}

async fn marker_counts_match_literal_substrings(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, false).await;
    let marker = "[orch:staging-defer seq=4]";
    for content in [
        format!("deploy {marker}"),
        format!("{marker} again"),
        "deploy [orch:staging-defer seq=5]".to_owned(),
        "no marker".to_owned(),
        "100% _sure_".to_owned(),
    ] {
        s.enqueue(NewJob::new("deployer", content).task(task.id))
            .await
            .unwrap();
    }
    let count = |m: Option<&str>| JobCount {
        task_id: task.id,
        agent: "deployer".into(),
        content_contains: m.map(str::to_owned),
    };
    assert_eq!(s.count_jobs(&count(Some(marker))).await.unwrap(), 2);
    assert_eq!(s.count_jobs(&count(None)).await.unwrap(), 5);
    // LIKE wildcards are literal here.
    assert_eq!(s.count_jobs(&count(Some("%"))).await.unwrap(), 1);
    assert_eq!(s.count_jobs(&count(Some("_sure_"))).await.unwrap(), 1);
    assert_eq!(s.count_jobs(&count(Some("a_b"))).await.unwrap(), 0);
}

async fn complete_and_claim_reports_fenced_completions(db: TestDb) {
    let s = &db.store;
    for i in 0..4 {
        s.enqueue(NewJob::new("noop", format!("{i}")))
            .await
            .unwrap();
    }
    let first = s.claim(&claim("w", 2)).await.unwrap();
    let stale = Lease {
        job_id: first[1].lease.job_id,
        attempt: first[1].lease.attempt + 7,
    };
    let out = s
        .complete_and_claim(&[first[0].lease, stale], Some(&claim("w", 2)))
        .await
        .unwrap();
    assert_eq!(out.fenced, vec![stale]);
    assert_eq!(out.claimed.len(), 2);
    assert_eq!(
        s.get_job(first[0].lease.job_id)
            .await
            .unwrap()
            .unwrap()
            .state,
        JobState::Done
    );
    assert_eq!(
        s.get_job(first[1].lease.job_id)
            .await
            .unwrap()
            .unwrap()
            .state,
        JobState::Running
    );
    // Completion only, no claim.
    let leases: Vec<Lease> = out.claimed.iter().map(|c| c.lease).collect();
    let only = s.complete_and_claim(&leases, None).await.unwrap();
    assert!(only.fenced.is_empty() && only.claimed.is_empty());
}

async fn claim_order_priority_and_node_affinity(db: TestDb) {
    let s = &db.store;
    s.enqueue(NewJob::new("noop", "low")).await.unwrap();
    s.enqueue(NewJob::new("noop", "high").priority(10))
        .await
        .unwrap();
    s.enqueue(NewJob::new("noop", "pinned").node("box-b").priority(20))
        .await
        .unwrap();
    s.enqueue(NewJob::new("other", "other kind").priority(30))
        .await
        .unwrap();
    let mut c = claim("a", 10);
    c.node = Some("box-a".into());
    c.kinds = vec!["noop".into()];
    let got: Vec<String> = s
        .claim(&c)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.job.task_content)
        .collect();
    assert_eq!(
        got,
        vec!["high", "low"],
        "box-a never takes box-b's job or another kind"
    );
    c.node = Some("box-b".into());
    let got = s.claim(&c).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].job.task_content, "pinned");
}

async fn queue_stats_counts_kinds_and_leases(db: TestDb) {
    let s = &db.store;
    s.enqueue(NewJob::new("a", "1")).await.unwrap();
    s.enqueue(NewJob::new("a", "2")).await.unwrap();
    s.enqueue(NewJob::new("b", "3").delay_s(60)).await.unwrap();
    db.clock.advance_ms(5_000);
    let mut c = claim("w", 1);
    c.kinds = vec!["a".into()];
    let claimed = s.claim(&c).await.unwrap();
    let stats = s.queue_stats().await.unwrap();
    let get = |agent: &str, state: JobState| {
        stats
            .counts
            .iter()
            .find(|k| k.agent == agent && k.state == state)
            .map_or(0, |k| k.count)
    };
    assert_eq!(get("a", JobState::Queued), 1);
    assert_eq!(get("a", JobState::Running), 1);
    assert_eq!(get("b", JobState::Queued), 1);
    assert_eq!(
        stats.oldest_ready_at,
        Some(T0),
        "the delayed job is not ready"
    );
    assert_eq!(stats.leases.len(), 1);
    assert_eq!(stats.leases[0].job_id, claimed[0].lease.job_id);
    assert_eq!(stats.leases[0].worker.as_deref(), Some("w"));
    assert_eq!(stats.leases[0].expires_at, Some(T0 + 5_000 + LEASE));
}

/// The views' reads (schema 2's partial indexes): queued and running jobs and live tasks are
/// counted exactly whatever their age; finished jobs and ended tasks only within the recent
/// window; a lease comes with its task's work item.
async fn control_views_count_the_work_in_flight_and_a_recent_window(db: TestDb) {
    let s = &db.store;
    const DAY: i64 = 24 * 3_600_000;
    // Two days ago: a task that ended, one still live, a finished job and a queued one.
    let old_ended = task_in(s, "svc", "done").await;
    let old_live = task_in(s, "svc", "intake").await;
    s.enqueue(NewJob::new("a", "old done").task(old_ended.id))
        .await
        .unwrap();
    let old = claim_one(s, "w").await;
    s.mark_job(old.lease, JobOutcome::Done, None).await.unwrap();
    s.enqueue(NewJob::new("a", "old queued").task(old_live.id))
        .await
        .unwrap();
    db.clock.advance_ms(2 * DAY);
    // Now: a task that just ended, a job that just finished, one running.
    let new_ended = task_in(s, "svc", "cancelled").await;
    s.enqueue(NewJob::new("b", "new").task(old_live.id).priority(9))
        .await
        .unwrap();
    let new = claim_one(s, "w").await;
    s.mark_job(new.lease, JobOutcome::Done, None).await.unwrap();
    s.enqueue(NewJob::new("b", "running").task(old_live.id).priority(9))
        .await
        .unwrap();
    let running = claim_one(s, "w").await;

    let stats = s.queue_stats().await.unwrap();
    assert_eq!(stats.finished_since, stats.now - RECENT_WINDOW_MS);
    let counts: Vec<(String, JobState, i64)> = stats
        .counts
        .iter()
        .map(|k| (k.agent.clone(), k.state, k.count))
        .collect();
    assert_eq!(
        counts,
        vec![
            ("a".to_owned(), JobState::Queued, 1),
            ("b".to_owned(), JobState::Done, 1),
            ("b".to_owned(), JobState::Running, 1),
        ],
        "the job that finished two days ago is not counted"
    );
    assert_eq!(stats.leases.len(), 1);
    assert_eq!(stats.leases[0].job_id, running.lease.job_id);
    assert_eq!(
        stats.leases[0].work_item_id.as_deref(),
        Some(old_live.work_item_id.as_str()),
        "the lease's work item comes with it"
    );
    // The whole table still holds both finished jobs.
    assert_eq!(s.count_all_jobs().await.unwrap(), 4);

    assert_eq!(
        s.active_tasks_by_stage(stats.finished_since).await.unwrap(),
        vec![("cancelled".to_owned(), 1), ("intake".to_owned(), 1)],
        "the live task counts whatever its age, the old ended one does not"
    );
    assert_eq!(
        s.count_tasks_by_stage().await.unwrap(),
        vec![
            ("cancelled".to_owned(), 1),
            ("done".to_owned(), 1),
            ("intake".to_owned(), 1)
        ]
    );
    let ended = s.tasks_ended_since(stats.finished_since).await.unwrap();
    assert_eq!(
        ended,
        vec![s.get_task(new_ended.id).await.unwrap().unwrap()]
    );
    let all_ended = s.tasks_ended_since(0).await.unwrap();
    assert_eq!(
        all_ended.iter().map(|t| t.id).collect::<Vec<_>>(),
        vec![old_ended.id, new_ended.id],
        "oldest ending first"
    );

    s.refresh_statistics().await.unwrap();
    assert!(s.database_size().await.unwrap() > 0);
}

async fn migrate_is_idempotent_and_versioned(db: TestDb) {
    let s = &db.store;
    assert_eq!(s.schema_version().await.unwrap(), SCHEMA_VERSION);
    let again = s.migrate().await.unwrap();
    assert!(again.applied.is_empty());
    s.check_schema().await.unwrap();
    // Concurrent migrations from several processes are safe.
    let mut handles = Vec::new();
    for _ in 0..3 {
        let store = db.reopen().await;
        handles.push(tokio::spawn(async move { store.migrate().await }));
    }
    for h in handles {
        assert!(h.await.unwrap().unwrap().applied.is_empty());
    }
    let migrated = s.events_by_kind("schema.migrated", 0, 10).await.unwrap();
    assert_eq!(
        migrated.len(),
        usize::try_from(SCHEMA_VERSION).unwrap(),
        "one record per applied migration"
    );
}

async fn wakeups_fire_on_enqueue(db: TestDb) {
    let s = &db.store;
    let mut rx = s.wakeups();
    // The PostgreSQL listener announces itself once connected; let that settle.
    let _ = tokio::time::timeout(Duration::from_secs(5), rx.changed()).await;
    rx.borrow_and_update();
    let other = db.reopen().await;
    other.enqueue(NewJob::new("noop", "x")).await.unwrap();
    match s.backend() {
        Backend::Postgres => {
            tokio::time::timeout(Duration::from_secs(10), rx.changed())
                .await
                .expect("NOTIFY reaches the listener of another connection")
                .unwrap();
            assert_eq!(rx.borrow_and_update().due_at, i64::MIN, "due now");
            // A delayed job's NOTIFY says when it is due (one enqueued, then a batch).
            let now = other.now_ms();
            other
                .enqueue(NewJob::new("noop", "in 20 s").delay_ms(20_000))
                .await
                .unwrap();
            let due = |rx: tokio::sync::watch::Receiver<orch_store::Wake>, want: i64| async move {
                let mut rx = rx;
                tokio::time::timeout(Duration::from_secs(10), async {
                    while rx.borrow_and_update().due_at != want {
                        rx.changed().await.unwrap();
                    }
                })
                .await
                .unwrap_or_else(|_| panic!("no wake-up for a job due at {want}"));
            };
            due(rx.clone(), now + 20_000).await;
            other
                .enqueue_many(vec![
                    NewJob::new("noop", "in 15 s").delay_ms(15_000),
                    NewJob::new("noop", "in 12 s").delay_ms(12_000),
                ])
                .await
                .unwrap();
            due(rx.clone(), now + 12_000).await;
            rx.borrow_and_update();
            // A store in another schema of the same database announces on its own channel.
            let elsewhere = TestDb::postgres().await;
            elsewhere
                .store
                .enqueue(NewJob::new("noop", "elsewhere"))
                .await
                .unwrap();
            assert!(
                tokio::time::timeout(Duration::from_secs(1), rx.changed())
                    .await
                    .is_err(),
                "another schema's job woke this store's workers"
            );
        }
        Backend::Sqlite => {
            // The in-process signal wakes the store that enqueued; other processes poll.
            let mut own = other.wakeups();
            own.borrow_and_update();
            other.enqueue(NewJob::new("noop", "y")).await.unwrap();
            tokio::time::timeout(Duration::from_secs(5), own.changed())
                .await
                .expect("in-process wake-up")
                .unwrap();
            assert_eq!(own.borrow_and_update().due_at, i64::MIN, "due now");
            // A delayed job says when it is due, and the soonest announced one is kept.
            let now = other.now_ms();
            for delay in [20_000, 10_000, 30_000] {
                other
                    .enqueue(NewJob::new("noop", format!("in {delay}")).delay_ms(delay))
                    .await
                    .unwrap();
            }
            own.changed().await.unwrap();
            assert_eq!(own.borrow_and_update().due_at, now + 10_000);
            // Once that time has passed, the next announcement replaces it.
            db.clock.advance_ms(15_000);
            other
                .enqueue(NewJob::new("noop", "in 40 s").delay_ms(40_000))
                .await
                .unwrap();
            own.changed().await.unwrap();
            assert_eq!(own.borrow_and_update().due_at, now + 55_000);
            other.enqueue(NewJob::new("noop", "now")).await.unwrap();
            own.changed().await.unwrap();
            assert_eq!(own.borrow_and_update().due_at, i64::MIN, "due now wins");
        }
    }
}

async fn agent_runs_and_usage(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, false).await;
    for (tokens, cost) in [(100, 0.5), (50, 0.25)] {
        let id = s
            .start_agent_run(NewAgentRun {
                task_id: task.id,
                job_id: None,
                stage: "analysis".into(),
                agent: "analyst".into(),
                backend: "command".into(),
                model: Some("m".into()),
                attempt: 1,
            })
            .await
            .unwrap();
        db.clock.advance_ms(1_500);
        s.finish_agent_run(
            id,
            AgentRunFinish {
                outcome: "success".into(),
                exit_code: Some(0),
                input_tokens: Some(tokens),
                output_tokens: Some(tokens / 2),
                cost_usd: Some(cost),
                error: None,
                data: String::new(),
            },
        )
        .await
        .unwrap();
    }
    let runs = s.task_agent_runs(task.id).await.unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0].finished_at, Some(runs[0].started_at + 1_500));
    assert_eq!(runs[0].data, "{}");
    let usage = s.task_usage(task.id).await.unwrap();
    assert_eq!(usage.runs, 2);
    assert_eq!(usage.input_tokens, 150);
    assert_eq!(usage.output_tokens, 75);
    assert!((usage.cost_usd - 0.75).abs() < 1e-9);
    assert_eq!(usage.unknown_cost_runs, 0, "every cost is known");
    let none = s.task_usage(task.id + 1000).await.unwrap();
    assert_eq!(none, Usage::default());

    // Totals by agent, over every task; a run that reported nothing counts as a run.
    let other = new_task(s, false).await;
    let id = s
        .start_agent_run(NewAgentRun {
            task_id: other.id,
            job_id: None,
            stage: "review".into(),
            agent: "reviewer".into(),
            backend: "command".into(),
            model: None,
            attempt: 1,
        })
        .await
        .unwrap();
    let totals = s.usage_by_agent().await.unwrap();
    assert_eq!(
        totals,
        vec![
            ("analyst".to_owned(), usage),
            (
                "reviewer".to_owned(),
                Usage {
                    runs: 1,
                    unknown_cost_runs: 1,
                    ..Usage::default()
                }
            ),
        ],
        "run {id} still running counts, with no tokens and its cost unknown (not zero)"
    );
    // The same runs by agent and outcome.
    assert_eq!(
        s.runs_by_agent_outcome().await.unwrap(),
        vec![
            ("analyst".to_owned(), "success".to_owned(), 2),
            ("reviewer".to_owned(), "running".to_owned(), 1),
        ]
    );
}

async fn bulk_enqueue_skips_duplicates(db: TestDb) {
    let s = &db.store;
    assert!(
        !s.has_live_jobs().await.unwrap(),
        "an empty queue has no live job"
    );
    s.enqueue(NewJob::new("noop", "pre").dedupe("d1"))
        .await
        .unwrap();
    let jobs = vec![
        NewJob::new("noop", "a").dedupe("d1"),
        NewJob::new("noop", "b").dedupe("d2"),
        NewJob::new("noop", "c"),
        NewJob::new("noop", "d").delay_s(5),
    ];
    assert_eq!(s.enqueue_many(jobs).await.unwrap(), 3);
    assert!(s.has_live_jobs().await.unwrap());
    let claimed = s.claim(&claim("w", 10)).await.unwrap();
    assert_eq!(claimed.len(), 3);
    assert!(s.has_live_jobs().await.unwrap(), "running jobs are live");
    let leases: Vec<Lease> = claimed.iter().map(|c| c.lease).collect();
    s.complete_and_claim(&leases, None).await.unwrap();
    assert!(
        s.has_live_jobs().await.unwrap(),
        "the delayed job is still queued"
    );
    assert_eq!(s.enqueue_many(Vec::new()).await.unwrap(), 0);

    // Every field survives the bulk path exactly, whatever the text holds.
    let task = new_task(s, false).await;
    let tricky =
        "quote\" back\\slash\nnew line, ünïcødé 🎉 {\"json\": [1]} 123 '; DROP TABLE jobs; --";
    let jobs = vec![
        NewJob::new("kind.a", tricky)
            .task(task.id)
            .priority(7)
            .max_attempts(5)
            .dedupe(tricky)
            .node("node-1"),
        NewJob::new("kind.b", "").delay_s(60),
        NewJob::new("kind.c", "42"),
    ];
    assert_eq!(s.enqueue_many(jobs).await.unwrap(), 3);
    let got = s
        .claim(&Claim {
            node: Some("node-1".into()),
            node_grace_ms: None,
            ..claim("w", 10)
        })
        .await
        .unwrap();
    assert_eq!(got.len(), 2, "the delayed job waits");
    let a = &got[0].job;
    assert_eq!(
        (
            a.agent.as_str(),
            a.task_content.as_str(),
            a.task_id,
            a.priority
        ),
        ("kind.a", tricky, Some(task.id), 7)
    );
    assert_eq!(a.max_attempts, 5);
    assert_eq!(a.dedupe_key.as_deref(), Some(tricky));
    assert_eq!(a.node.as_deref(), Some("node-1"));
    assert_eq!(a.available_at, T0);
    assert_eq!(
        got[1].job.task_content, "42",
        "numeric-looking text stays text"
    );
    assert!(got[1].job.task_id.is_none());
    // NUL cannot be stored by PostgreSQL: refused on both backends, nothing inserted.
    let err = s
        .enqueue_many(vec![
            NewJob::new("kind.d", "ok"),
            NewJob::new("kind.d", "a\0b"),
        ])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("NUL"), "{err}");
    let stats = s.queue_stats().await.unwrap();
    assert!(
        stats.counts.iter().all(|c| c.agent != "kind.d"),
        "{:?}",
        stats.counts
    );
}

async fn task_in(store: &Store, repo: &str, stage: &str) -> Task {
    store
        .create_task(NewTask {
            work_item: WorkItemSpec::Next {
                prefix: "LIST".parse().unwrap(),
            },
            repo: repo.parse().unwrap(),
            title: format!("{repo} {stage}"),
            body: String::new(),
            stage: stage.parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "submitted"),
            first_job: None,
        })
        .await
        .expect("create task")
}

async fn list_tasks_filters_and_pages_newest_first(db: TestDb) {
    let s = &db.store;
    assert!(s.count_tasks_by_stage().await.unwrap().is_empty());
    let a1 = task_in(s, "alpha", "intake").await;
    let b1 = task_in(s, "beta", "intake").await;
    let a2 = task_in(s, "alpha", "review").await;
    let a3 = task_in(s, "alpha", "intake").await;
    let ids = |tasks: Vec<Task>| tasks.iter().map(|t| t.id).collect::<Vec<_>>();
    let all = TaskFilter {
        limit: 100,
        ..TaskFilter::default()
    };
    assert_eq!(
        ids(s.list_tasks(&all).await.unwrap()),
        vec![a3.id, a2.id, b1.id, a1.id],
        "newest first"
    );
    let alpha_intake = TaskFilter {
        stage: Some("intake".into()),
        repo: Some("alpha".into()),
        limit: 100,
        offset: 0,
    };
    assert_eq!(
        ids(s.list_tasks(&alpha_intake).await.unwrap()),
        vec![a3.id, a1.id]
    );
    let beta = TaskFilter {
        repo: Some("beta".into()),
        limit: 100,
        ..TaskFilter::default()
    };
    assert_eq!(ids(s.list_tasks(&beta).await.unwrap()), vec![b1.id]);
    let review = TaskFilter {
        stage: Some("review".into()),
        limit: 100,
        ..TaskFilter::default()
    };
    assert_eq!(ids(s.list_tasks(&review).await.unwrap()), vec![a2.id]);
    let nothing = TaskFilter {
        repo: Some("gamma".into()),
        limit: 100,
        ..TaskFilter::default()
    };
    assert!(s.list_tasks(&nothing).await.unwrap().is_empty());
    // Paging: limit and offset; a limit of 0 still returns one row (clamped to 1..=1000).
    let page = TaskFilter {
        limit: 2,
        offset: 1,
        ..TaskFilter::default()
    };
    assert_eq!(ids(s.list_tasks(&page).await.unwrap()), vec![a2.id, b1.id]);
    let past_end = TaskFilter {
        limit: 2,
        offset: 4,
        ..TaskFilter::default()
    };
    assert!(s.list_tasks(&past_end).await.unwrap().is_empty());
    assert_eq!(
        ids(s.list_tasks(&TaskFilter::default()).await.unwrap()),
        vec![a3.id]
    );
    // The rows are whole tasks.
    let listed = s.list_tasks(&beta).await.unwrap().remove(0);
    assert_eq!(listed, s.get_task(b1.id).await.unwrap().unwrap());

    // Counts by stage, sorted by stage, follow stage changes.
    assert_eq!(
        s.count_tasks_by_stage().await.unwrap(),
        vec![("intake".to_owned(), 3), ("review".to_owned(), 1)]
    );
    s.advance_stage(AdvanceStage {
        task_id: a1.id,
        expected_stage: "intake".parse().unwrap(),
        new_stage: "done".parse().unwrap(),
        fence: Fence::Seq(a1.stage_seq),
        event: NewEvent::new("task.done", "done"),
        next_job: None,
    })
    .await
    .unwrap();
    assert_eq!(
        s.count_tasks_by_stage().await.unwrap(),
        vec![
            ("done".to_owned(), 1),
            ("intake".to_owned(), 2),
            ("review".to_owned(), 1)
        ]
    );
}

async fn cancel_task_jobs_spares_the_kept_job_and_fences_workers(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, true).await;
    let other = new_task(s, false).await;
    let running = claim_one(s, "w1").await;
    assert_eq!(running.job.task_id, Some(task.id));
    let finished = s
        .enqueue(NewJob::new("noop", "finished").task(task.id))
        .await
        .unwrap()
        .job_id;
    let lease = claim_one(s, "w2").await;
    assert_eq!(lease.job.id, finished);
    s.mark_job(lease.lease, JobOutcome::Done, None)
        .await
        .unwrap();
    let delayed = s
        .enqueue(NewJob::new("tester", "later").task(task.id).delay_s(60))
        .await
        .unwrap()
        .job_id;
    let kept = s
        .enqueue(NewJob::new("tester", "keep").task(task.id))
        .await
        .unwrap()
        .job_id;
    let untouched = s
        .enqueue(NewJob::new("tester", "another task").task(other.id))
        .await
        .unwrap()
        .job_id;
    db.clock.advance_ms(10);

    let cancelled = s.cancel_task_jobs(task.id, Some(kept)).await.unwrap();
    assert_eq!(cancelled, 2, "the running and the delayed job");
    let state = |id| async move { s.get_job(id).await.unwrap().unwrap().state };
    assert_eq!(state(running.job.id).await, JobState::Cancelled);
    assert_eq!(state(delayed).await, JobState::Cancelled);
    assert_eq!(state(kept).await, JobState::Queued, "kept");
    assert_eq!(
        state(finished).await,
        JobState::Done,
        "a finished job stays"
    );
    assert_eq!(state(untouched).await, JobState::Queued, "another task's");
    let row = s.get_job(delayed).await.unwrap().unwrap();
    assert_eq!(row.finished_at, Some(T0 + 10));

    // The worker of the cancelled running job has lost its lease.
    let err = s
        .mark_job(running.lease, JobOutcome::Done, None)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err}");

    // Without `keep`, the rest goes too; a second call finds nothing.
    assert_eq!(s.cancel_task_jobs(task.id, None).await.unwrap(), 1);
    assert_eq!(state(kept).await, JobState::Cancelled);
    assert_eq!(s.cancel_task_jobs(task.id, None).await.unwrap(), 0);
    assert_eq!(state(untouched).await, JobState::Queued);
}

async fn appended_events_are_read_back_by_task_and_by_kind(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, true).await;
    let job = claim_one(s, "w").await;
    db.clock.advance_ms(250);
    let first = s
        .append_event(
            NewEvent::new("probe.result", "healthy")
                .task(task.id)
                .job(job.job.id)
                .stage("intake")
                .data(r#"{"ok":true,"n":1}"#),
        )
        .await
        .unwrap();
    let global = s
        .append_event(NewEvent::new("probe.result", "no task"))
        .await
        .unwrap();
    let other_kind = s
        .append_event(NewEvent::new("note", "a note").task(task.id))
        .await
        .unwrap();
    assert!(first < global && global < other_kind, "ids grow");

    let events = s.task_events(task.id).await.unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        vec!["task.submitted", "probe.result", "note"],
        "oldest first, only this task's"
    );
    let e = &events[1];
    assert_eq!(e.id, first);
    assert_eq!(e.task_id, Some(task.id));
    assert_eq!(e.job_id, Some(job.job.id));
    assert_eq!(e.stage.as_deref(), Some("intake"));
    assert_eq!(e.message, "healthy");
    let data: serde_json::Value = serde_json::from_str(&e.data).unwrap();
    assert_eq!(data, serde_json::json!({"ok": true, "n": 1}));
    assert_eq!(
        e.created_at,
        T0 + 250,
        "the store's clock, not the server's"
    );
    assert_eq!(events[2].data, "{}", "no data is an empty object");
    assert_eq!(events[2].stage, None);

    let by_kind = s.events_by_kind("probe.result", 0, 10).await.unwrap();
    assert_eq!(
        by_kind.iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![first, global]
    );
    assert_eq!(by_kind[1].task_id, None);
    let after = s.events_by_kind("probe.result", first, 10).await.unwrap();
    assert_eq!(after.iter().map(|e| e.id).collect::<Vec<_>>(), vec![global]);
    let limited = s.events_by_kind("probe.result", 0, 1).await.unwrap();
    assert_eq!(
        limited.iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![first]
    );
    assert!(s.events_by_kind("none", 0, 10).await.unwrap().is_empty());
}

async fn a_jobs_fenced_event_is_written_only_while_its_lease_holds(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, false).await;
    s.enqueue(NewJob::new("monitor", "end").task(task.id))
        .await
        .unwrap();
    let first = claim_one(s, "w1").await;
    let held = NewEvent::new(events::RELEASE_HELD, "held by the first attempt").task(task.id);
    s.append_event_fenced(first.lease, held.clone())
        .await
        .expect("the running attempt writes its event");
    // The first attempt's worker is gone; the job runs again as attempt 2.
    db.clock.advance_ms(LEASE + 1);
    s.rescue_expired(Rescue::default()).await.unwrap();
    let late = NewEvent::new(events::RELEASE_HELD, "held by the lost attempt").task(task.id);
    let err = s
        .append_event_fenced(first.lease, late.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err}");
    db.clock.advance_ms(Rescue::default().backoff_ms(1));
    let second = claim_one(s, "w2").await;
    let err = s
        .append_event_fenced(first.lease, late.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err}");
    s.append_event_fenced(
        second.lease,
        NewEvent::new(events::RELEASE_UNHELD, "go on").task(task.id),
    )
    .await
    .expect("the attempt that holds the job writes");
    s.mark_job(second.lease, JobOutcome::Done, None)
        .await
        .unwrap();
    let err = s.append_event_fenced(second.lease, late).await.unwrap_err();
    assert!(
        matches!(err, StoreError::LeaseLost { .. }),
        "a finished job fences too: {err}"
    );
    let messages: Vec<String> = s
        .task_events(task.id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind.starts_with("release."))
        .map(|e| e.message)
        .collect();
    assert_eq!(messages, ["held by the first attempt", "go on"]);
}

async fn a_task_stranded_after_its_other_job_ended_is_failed_by_the_sweep(db: TestDb) {
    const GRACE: i64 = 60_000;
    let s = &db.store;
    let sweep = || async {
        s.fail_stranded_tasks(s.now_ms() - GRACE, 100)
            .await
            .unwrap()
    };
    let stage = |id: i64| async move { s.get_task(id).await.unwrap().unwrap().stage };
    let task = new_task(s, true).await;
    // A second job of the task is live while the first fails for good: the failure cannot end
    // the task then.
    s.enqueue(NewJob::new("analyst", "an older visit's job").task(task.id))
        .await
        .unwrap();
    let first = claim_one(s, "w1").await;
    s.mark_job(
        first.lease,
        JobOutcome::Failed {
            error: "the agent broke".into(),
        },
        None,
    )
    .await
    .unwrap();
    assert_eq!(stage(task.id).await, "intake");
    // A healthy task (its job live) is never touched.
    let healthy = new_task(s, true).await;
    db.clock.advance_ms(GRACE + 1);
    assert!(sweep().await.is_empty(), "the other job is still live");
    // The other job ends without moving the task on (its visit was over): nothing would.
    let other = claim_one(s, "w1").await;
    assert_eq!(other.job.task_id, Some(task.id));
    s.mark_job(other.lease, JobOutcome::Done, None)
        .await
        .unwrap();
    assert_eq!(sweep().await, vec![task.id]);
    assert_eq!(stage(task.id).await, "failed");
    let ended = s
        .task_events(task.id)
        .await
        .unwrap()
        .into_iter()
        .rfind(|e| e.kind == events::TASK_FAILED)
        .expect("task.failed");
    assert_eq!(ended.job_id, Some(first.lease.job_id));
    assert!(
        ended.message.contains("the agent broke")
            && ended.message.contains("ended later without moving it on"),
        "{}",
        ended.message
    );
    assert!(sweep().await.is_empty(), "once");
    assert_eq!(stage(healthy.id).await, "intake");

    // A task that waits at an approval stage has no job either; a job that failed before it
    // got there is history, not a stranding.
    let waiting = new_task(s, true).await;
    s.enqueue(NewJob::new("analyst", "a second").task(waiting.id))
        .await
        .unwrap();
    let failed_job = loop {
        let c = claim_one(s, "w1").await;
        if c.job.task_id == Some(waiting.id) {
            break c;
        }
        s.mark_job(c.lease, JobOutcome::Done, None).await.unwrap();
    };
    s.mark_job(
        failed_job.lease,
        JobOutcome::Failed {
            error: "an earlier failure".into(),
        },
        None,
    )
    .await
    .unwrap();
    let second = claim_one(s, "w1").await;
    assert_eq!(second.job.task_id, Some(waiting.id));
    db.clock.advance_ms(1);
    s.advance_stage(AdvanceStage {
        task_id: waiting.id,
        expected_stage: "intake".parse().unwrap(),
        new_stage: "approval".parse().unwrap(),
        fence: Fence::Job(second.lease),
        event: NewEvent::new(events::STAGE_ADVANCED, "to the approval"),
        next_job: None,
    })
    .await
    .unwrap();
    s.mark_job(second.lease, JobOutcome::Done, None)
        .await
        .unwrap();
    db.clock.advance_ms(GRACE + 1);
    assert!(
        sweep().await.is_empty(),
        "a task waiting for approval is not stranded"
    );
    assert_eq!(stage(waiting.id).await, "approval");
}

async fn events_of_many_tasks_are_read_at_once_per_task_oldest_first(db: TestDb) {
    let s = &db.store;
    // More tasks than one statement reads, so the chunks are joined in order.
    let n = EVENTS_OF_TASKS_CHUNK + 3;
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        tasks.push(new_task(s, false).await);
    }
    for (i, t) in tasks.iter().enumerate() {
        s.append_event(NewEvent::new("note", format!("note {i}")).task(t.id))
            .await
            .unwrap();
        if i % 2 == 0 {
            s.append_event(NewEvent::new("probe.result", format!("probe {i}")).task(t.id))
                .await
                .unwrap();
        }
    }
    let unrelated = new_task(s, false).await;
    s.append_event(NewEvent::new("note", "not asked for").task(unrelated.id))
        .await
        .unwrap();

    let ids: Vec<i64> = tasks.iter().map(|t| t.id).collect();
    let all = s.events_of_tasks(&ids, &[]).await.unwrap();
    assert_eq!(
        all.len(),
        n * 2 + n.div_ceil(2),
        "submitted, note, and every other probe"
    );
    assert!(all.iter().all(|e| e.task_id != Some(unrelated.id)));
    let by_task = group_by_task(all);
    for (i, t) in tasks.iter().enumerate() {
        let own = &by_task[&t.id];
        assert_eq!(
            own,
            &s.task_events(t.id).await.unwrap(),
            "as task_events reads them"
        );
        let kinds: Vec<&str> = own.iter().map(|e| e.kind.as_str()).collect();
        let want = match i % 2 {
            0 => vec!["task.submitted", "note", "probe.result"],
            _ => vec!["task.submitted", "note"],
        };
        assert_eq!(kinds, want, "task {i}: oldest first");
    }

    let probes = s.events_of_tasks(&ids, &["probe.result"]).await.unwrap();
    assert_eq!(probes.len(), n.div_ceil(2));
    assert!(probes.iter().all(|e| e.kind == "probe.result"));
    let two_kinds = s
        .events_of_tasks(&ids[..4], &["probe.result", "task.submitted"])
        .await
        .unwrap();
    assert_eq!(two_kinds.len(), 4 + 2);
    assert!(s.events_of_tasks(&[], &[]).await.unwrap().is_empty());
    assert!(
        s.events_of_tasks(&[-1, i64::MAX], &[])
            .await
            .unwrap()
            .is_empty()
    );
    assert!(s.events_of_tasks(&ids, &["none"]).await.unwrap().is_empty());
}

async fn target_names_the_database_and_close_ends_the_store(db: TestDb) {
    let s = &db.store;
    let target = s.target();
    match s.backend() {
        Backend::Sqlite => {
            assert!(target.starts_with("sqlite://"), "{target}");
            assert!(target.ends_with("orch.db"), "{target}");
        }
        Backend::Postgres => assert!(target.starts_with("postgres"), "{target}"),
    }
    assert_eq!(s.now_ms(), T0);
    assert_eq!(s.clock().now_ms(), T0);
    new_task(s, true).await;
    s.close().await;
    assert!(s.get_task(1).await.is_err(), "a closed store refuses reads");
    assert!(
        s.enqueue(NewJob::new("noop", "x")).await.is_err(),
        "and writes"
    );
}

fn to_stage(task: &Task, from: &str, to: &str) -> AdvanceStage {
    AdvanceStage {
        task_id: task.id,
        expected_stage: from.parse().unwrap(),
        new_stage: to.parse().unwrap(),
        fence: Fence::Seq(task.stage_seq),
        event: NewEvent::new("stage.advanced", format!("{from} -> {to}")),
        next_job: None,
    }
}

fn track() -> Exclusive {
    Exclusive {
        stages: vec![
            "merge".parse().unwrap(),
            "staging".parse().unwrap(),
            "deploy".parse().unwrap(),
        ],
    }
}

async fn exclusive_stages_admit_one_task_per_repo(db: TestDb) {
    let s = &db.store;
    let a = new_task(s, false).await;
    let b = new_task(s, false).await;
    let a = s
        .advance_stage_exclusive(to_stage(&a, "intake", "merge"), &track())
        .await
        .expect("the track is free")
        .task;
    // The holder, as a waiting task reads it; a task does not wait for itself.
    assert_eq!(
        s.track_holder("svc", b.id, &track()).await.unwrap(),
        Some((a.work_item_id.to_string(), "merge".to_owned()))
    );
    assert_eq!(s.track_holder("svc", a.id, &track()).await.unwrap(), None);
    assert_eq!(s.track_holder("other", b.id, &track()).await.unwrap(), None);
    // B cannot enter while A is anywhere in the track, and nothing of B changes.
    let busy = s
        .advance_stage_exclusive(to_stage(&b, "intake", "merge"), &track())
        .await;
    match busy {
        Err(StoreError::TrackBusy {
            repo,
            holder,
            stage,
        }) => {
            assert_eq!((repo.as_str(), stage.as_str()), ("svc", "merge"));
            assert_eq!(holder, a.work_item_id);
        }
        other => panic!("expected TrackBusy, got {other:?}"),
    }
    let b_now = s.get_task(b.id).await.unwrap().unwrap();
    assert_eq!(
        (b_now.stage.as_str(), b_now.stage_seq),
        ("intake", b.stage_seq)
    );
    // Moving inside the track needs no admission; A still holds it at `staging`.
    let a = s
        .advance_stage(to_stage(&a, "merge", "staging"))
        .await
        .unwrap()
        .task;
    assert!(matches!(
        s.advance_stage_exclusive(to_stage(&b, "intake", "merge"), &track())
            .await,
        Err(StoreError::TrackBusy { .. })
    ));
    // A task of another repo is not affected.
    let other = s
        .create_task(NewTask {
            work_item: WorkItemSpec::Next {
                prefix: "OTH".parse().unwrap(),
            },
            repo: "other".parse().unwrap(),
            title: "another repo".into(),
            body: String::new(),
            stage: "intake".parse().unwrap(),
            branch_prefix: "orch/".into(),
            event: NewEvent::new("task.submitted", "submitted"),
            first_job: None,
        })
        .await
        .unwrap();
    s.advance_stage_exclusive(to_stage(&other, "intake", "merge"), &track())
        .await
        .expect("another repo's track is free");
    // A terminal holder releases the track.
    s.advance_stage(to_stage(&a, "staging", "done"))
        .await
        .unwrap();
    assert_eq!(s.track_holder("svc", b.id, &track()).await.unwrap(), None);
    let b = s
        .advance_stage_exclusive(to_stage(&b, "intake", "merge"), &track())
        .await
        .expect("the track was released")
        .task;
    assert_eq!(b.stage, "merge");
}

async fn racing_exclusive_changes_admit_exactly_one(db: TestDb) {
    let s = &db.store;
    let mut tasks = Vec::new();
    for _ in 0..6 {
        tasks.push(new_task(s, false).await);
    }
    let mut handles = Vec::new();
    for t in tasks {
        let s = s.clone();
        handles.push(tokio::spawn(async move {
            s.advance_stage_exclusive(to_stage(&t, "intake", "merge"), &track())
                .await
        }));
    }
    let mut admitted = 0;
    for h in handles {
        match h.await.unwrap() {
            Ok(_) => admitted += 1,
            Err(StoreError::TrackBusy { .. }) => {}
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!(admitted, 1, "exactly one task may enter the track");
    let in_track = s
        .list_tasks(&TaskFilter {
            stage: Some("merge".into()),
            repo: Some("svc".into()),
            limit: 100,
            offset: 0,
        })
        .await
        .unwrap();
    assert_eq!(in_track.len(), 1);
}

// ----- an operator's write at a stage visit ----------------------------------------------

fn approved(note: &str) -> NewEvent {
    NewEvent::new(events::STAGE_APPROVED, note.to_owned())
}

/// `write_at_visit` writes only while the task is at the visit read: a task that moved on
/// (another `stage_seq`) or is at another stage is a `StageConflict` with nothing written; the
/// job and its event are written together; a second write finds the job and writes nothing.
async fn a_write_at_a_visit_is_one_compare_and_swap(db: TestDb) {
    let s = &db.store;
    let t = new_task(s, false).await;
    let job = || NewJob::new("analyst", "analyse");
    let events_of = |kind: &'static str| async move {
        s.task_events(t.id)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == kind)
            .count()
    };
    let stale = Visit {
        stage_seq: t.stage_seq + 1,
        ..Visit::of(&t)
    };
    match s
        .write_at_visit(stale, Some(job()), approved("stale"))
        .await
    {
        Err(StoreError::StageConflict { actual_seq, .. }) => assert_eq!(actual_seq, t.stage_seq),
        other => panic!("a stale visit must conflict: {other:?}"),
    }
    let elsewhere = Visit {
        stage: "design".parse().unwrap(),
        ..Visit::of(&t)
    };
    assert!(matches!(
        s.write_at_visit(elsewhere, None, approved("elsewhere"))
            .await,
        Err(StoreError::StageConflict { .. })
    ));
    assert!(
        s.task_jobs(t.id).await.unwrap().is_empty(),
        "nothing enqueued"
    );
    assert_eq!(
        events_of(events::STAGE_APPROVED).await,
        0,
        "nothing appended"
    );

    let first = s
        .write_at_visit(Visit::of(&t), Some(job()), approved("first"))
        .await
        .unwrap()
        .expect("a job was asked for");
    assert!(!first.duplicate);
    let jobs = s.task_jobs(t.id).await.unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(
        jobs[0].dedupe_key.as_deref(),
        Some(stage_job_key(t.id, t.stage_seq).as_str()),
        "the visit's stage job key by default"
    );
    let again = s
        .write_at_visit(Visit::of(&t), Some(job()), approved("again"))
        .await
        .unwrap()
        .expect("a job was asked for");
    assert!(again.duplicate);
    assert_eq!(again.job_id, first.job_id);
    assert_eq!(
        events_of(events::STAGE_APPROVED).await,
        1,
        "one event, with its job"
    );

    // An event alone, under the same check.
    assert_eq!(
        s.write_at_visit(Visit::of(&t), None, approved("note"))
            .await
            .unwrap(),
        None
    );
    assert_eq!(events_of(events::STAGE_APPROVED).await, 2);
    let moved = s
        .advance_stage(to_stage(&t, "intake", "design"))
        .await
        .unwrap()
        .task;
    assert!(matches!(
        s.write_at_visit(Visit::of(&t), None, approved("late"))
            .await,
        Err(StoreError::StageConflict { .. })
    ));
    assert!(
        s.write_at_visit(Visit::of(&moved), None, approved("now"))
            .await
            .is_ok()
    );
}

/// Approvals racing at one visit: exactly one job is enqueued, with one event, and every other
/// writer finds it (a duplicate, nothing written). An approval racing the item moving on
/// writes only if it came first: a job exactly when its event, never one without the other.
async fn racing_writes_at_one_visit_enqueue_exactly_one_job(db: TestDb) {
    let s = &db.store;
    let race = |t: Task, mover: bool| async move {
        let mut handles = Vec::new();
        for i in 0..4 {
            let s = s.clone();
            let visit = Visit::of(&t);
            handles.push(tokio::spawn(async move {
                s.write_at_visit(
                    visit,
                    Some(NewJob::new("analyst", "analyse")),
                    approved(&format!("approval {i}")),
                )
                .await
            }));
        }
        let moved = mover.then(|| {
            let s = s.clone();
            let t = t.clone();
            tokio::spawn(async move { s.advance_stage(to_stage(&t, "intake", "design")).await })
        });
        let (mut written, mut found, mut conflicts) = (0, 0, 0);
        for h in handles {
            match h.await.unwrap() {
                Ok(Some(e)) if !e.duplicate => written += 1,
                Ok(Some(_)) => found += 1,
                Err(StoreError::StageConflict { .. }) => conflicts += 1,
                other => panic!("unexpected: {other:?}"),
            }
        }
        if let Some(m) = moved {
            m.await.unwrap().expect("the move is a plain stage change");
        }
        let jobs = s.task_jobs(t.id).await.unwrap();
        let approvals = s
            .task_events(t.id)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == events::STAGE_APPROVED)
            .count();
        assert_eq!(jobs.len(), written, "a job exactly when an approval wrote");
        assert_eq!(approvals, written, "its event with it, never without");
        (written, found, conflicts)
    };
    let (written, found, conflicts) = race(new_task(s, false).await, false).await;
    assert_eq!((written, found, conflicts), (1, 3, 0));
    let (written, found, conflicts) = race(new_task(s, false).await, true).await;
    assert!(written <= 1, "at most one approval writes");
    assert_eq!(written + found + conflicts, 4);
}

// ----- node affinity and takeover (design.md §10) ---------------------------------------

const GRACE: i64 = 5_000;

fn claim_on(node: &str, grace: Option<i64>) -> Claim {
    let mut c = claim(&format!("w-{node}"), 10);
    c.node = Some(node.to_owned());
    c.node_grace_ms = grace;
    c
}

async fn jobs_of_a_gone_node_are_claimable_after_the_grace_not_before(db: TestDb) {
    let s = &db.store;
    s.node_seen("box-a").await.unwrap();
    s.enqueue(NewJob::new("noop", "a's").node("box-a"))
        .await
        .unwrap();
    // box-a stops being seen at T0.
    db.clock.advance_ms(GRACE);
    assert!(
        s.claim(&claim_on("box-b", Some(GRACE)))
            .await
            .unwrap()
            .is_empty(),
        "box-a was seen exactly the grace ago: not gone yet"
    );
    db.clock.advance_ms(1);
    assert!(
        s.claim(&claim_on("box-b", None)).await.unwrap().is_empty(),
        "a worker without a node grace never takes another node's job"
    );
    let mut unpinned = claim("w-none", 10);
    unpinned.node_grace_ms = None;
    assert!(s.claim(&unpinned).await.unwrap().is_empty());
    let got = s.claim(&claim_on("box-b", Some(GRACE))).await.unwrap();
    assert_eq!(
        got.len(),
        1,
        "box-a gone longer than the grace: box-b takes its job"
    );
    assert_eq!(
        got[0].job.node.as_deref(),
        Some("box-a"),
        "still pinned to a until re-pinned"
    );
    // The beacon is listed and is never claimed, counted as live or left running.
    let nodes = s.nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(
        (
            nodes[0].node.as_str(),
            nodes[0].first_seen_ms,
            nodes[0].last_seen_ms
        ),
        ("box-a", T0, T0)
    );
    s.complete_and_claim(&[got[0].lease], None).await.unwrap();
    assert!(
        !s.has_live_jobs().await.unwrap(),
        "a beacon is not a live job"
    );
    assert!(
        s.claim(&claim_on("box-a", Some(GRACE)))
            .await
            .unwrap()
            .is_empty()
    );
}

async fn a_live_nodes_jobs_are_never_taken_over(db: TestDb) {
    let s = &db.store;
    s.node_seen("box-a").await.unwrap();
    s.enqueue(NewJob::new("noop", "a's").node("box-a"))
        .await
        .unwrap();
    for _ in 0..10 {
        db.clock.advance_ms(GRACE / 2);
        s.node_seen("box-a").await.unwrap();
        assert!(
            s.claim(&claim_on("box-b", Some(GRACE)))
                .await
                .unwrap()
                .is_empty(),
            "box-a is seen every half grace: its job stays its own"
        );
    }
    let nodes = s.nodes().await.unwrap();
    assert_eq!(nodes[0].first_seen_ms, T0);
    assert_eq!(nodes[0].last_seen_ms, T0 + 5 * GRACE);
    // A beacon written with an older clock never moves "last seen" backwards.
    db.clock.advance_ms(-GRACE);
    s.node_seen("box-a").await.unwrap();
    assert_eq!(s.nodes().await.unwrap()[0].last_seen_ms, T0 + 5 * GRACE);
    db.clock.advance_ms(GRACE);
    assert_eq!(
        s.claim(&claim_on("box-a", Some(GRACE)))
            .await
            .unwrap()
            .len(),
        1,
        "box-a itself claims it"
    );
}

async fn a_never_seen_node_counts_from_when_its_job_became_ready(db: TestDb) {
    let s = &db.store;
    s.enqueue(NewJob::new("noop", "x's").node("box-x").delay_s(10))
        .await
        .unwrap();
    db.clock.advance_ms(10_000 + GRACE);
    assert!(
        s.claim(&claim_on("box-b", Some(GRACE)))
            .await
            .unwrap()
            .is_empty(),
        "ready for exactly the grace: box-x may still come"
    );
    db.clock.advance_ms(1);
    assert_eq!(
        s.claim(&claim_on("box-b", Some(GRACE)))
            .await
            .unwrap()
            .len(),
        1
    );
}

async fn take_over_repins_the_job_fenced_by_its_lease(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, false).await;
    s.enqueue(NewJob::new("noop", "a's").node("box-a").task(task.id))
        .await
        .unwrap();
    db.clock.advance_ms(GRACE + 1);
    let got = s.claim(&claim_on("box-b", Some(GRACE))).await.unwrap();
    assert_eq!(got.len(), 1);
    let lease = got[0].lease;
    let event = || NewEvent::new("node.takeover", "box-b took over").task(task.id);
    let stale = Lease {
        job_id: lease.job_id,
        attempt: lease.attempt + 1,
    };
    assert!(matches!(
        s.take_over_job(stale, "box-b", event()).await,
        Err(StoreError::LeaseLost { .. })
    ));
    s.take_over_job(lease, "box-b", event()).await.unwrap();
    let job = s.get_job(lease.job_id).await.unwrap().unwrap();
    assert_eq!(job.node.as_deref(), Some("box-b"));
    let kinds: Vec<String> = s
        .task_events(task.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "node.takeover").count(),
        1,
        "the refused takeover wrote nothing: {kinds:?}"
    );
    // Once the job has ended, a takeover is refused too.
    s.complete_and_claim(&[lease], None).await.unwrap();
    assert!(matches!(
        s.take_over_job(lease, "box-c", event()).await,
        Err(StoreError::LeaseLost { .. })
    ));
}

async fn a_follow_up_and_its_event_are_written_together_fenced_by_the_lease(db: TestDb) {
    let s = &db.store;
    let task = new_task(s, false).await;
    s.enqueue(NewJob::new("noop", "first").task(task.id))
        .await
        .unwrap();
    let lease = claim_one(s, "w1").await.lease;
    let follow_up = || {
        NewJob::new("noop", "again")
            .task(task.id)
            .dedupe(format!("requeue-of-{}", lease.job_id))
    };
    let event = || NewEvent::new("stage.requeued", "deferred").task(task.id);
    let requeued = async || {
        s.task_events(task.id)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "stage.requeued")
            .count()
    };
    let jobs = async || s.task_jobs(task.id).await.unwrap().len();
    // A stale attempt writes neither the job nor the event.
    let stale = Lease {
        job_id: lease.job_id,
        attempt: lease.attempt + 1,
    };
    assert!(matches!(
        s.enqueue_fenced(stale, follow_up(), event()).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert_eq!((jobs().await, requeued().await), (1, 0));
    let first = s.enqueue_fenced(lease, follow_up(), event()).await.unwrap();
    assert!(!first.duplicate);
    assert_eq!((jobs().await, requeued().await), (2, 1));
    // The same follow-up again (a retried attempt): the job that exists, no second event.
    let again = s.enqueue_fenced(lease, follow_up(), event()).await.unwrap();
    assert!(again.duplicate);
    assert_eq!(again.job_id, first.job_id);
    assert_eq!((jobs().await, requeued().await), (2, 1));
    // Once the job has ended, its attempt can enqueue nothing.
    s.complete_and_claim(&[lease], None).await.unwrap();
    let late = NewJob::new("noop", "late").task(task.id).dedupe("late");
    assert!(matches!(
        s.enqueue_fenced(lease, late, event()).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert_eq!((jobs().await, requeued().await), (2, 1));
}

async fn a_gone_nodes_job_waits_the_grace_once_ready(db: TestDb) {
    let s = &db.store;
    s.node_seen("box-a").await.unwrap();
    // box-a left a job that becomes ready long after box-a was last seen.
    s.enqueue(NewJob::new("noop", "a's later").node("box-a").delay_s(60))
        .await
        .unwrap();
    db.clock.advance_ms(60_000 + GRACE);
    assert!(
        s.claim(&claim_on("box-b", Some(GRACE)))
            .await
            .unwrap()
            .is_empty(),
        "box-a is gone, but its job has been ready for only the grace"
    );
    db.clock.advance_ms(1);
    assert_eq!(
        s.claim(&claim_on("box-b", Some(GRACE)))
            .await
            .unwrap()
            .len(),
        1
    );
}

async fn a_followed_repo_is_every_live_task_and_the_recently_ended(db: TestDb) {
    let s = &db.store;
    const DAY: i64 = 24 * 3600 * 1000;
    // The oldest task of the repo is live; one ended long ago; then more than a listing's
    // 1000 ended recently, and another repo's live task.
    let live = task_in(s, "alpha", "implementation").await;
    let long_ago = task_in(s, "alpha", "done").await;
    db.clock.advance_ms(2 * DAY);
    let mut ended = HashSet::new();
    for _ in 0..1001 {
        ended.insert(task_in(s, "alpha", "done").await.id);
    }
    let other = task_in(s, "beta", "review").await;
    let listed = s
        .list_tasks(&TaskFilter {
            repo: Some("alpha".into()),
            limit: 1000,
            ..TaskFilter::default()
        })
        .await
        .unwrap();
    assert!(
        !listed.iter().any(|t| t.id == live.id),
        "a capped listing drops the oldest live task"
    );
    let followed = s.tasks_followed("alpha", s.now_ms() - DAY).await.unwrap();
    let ids: HashSet<i64> = followed.iter().map(|t| t.id).collect();
    assert_eq!(ids.len(), followed.len(), "each task once");
    assert!(
        ids.contains(&live.id),
        "the live task beyond 1000 ended ones"
    );
    assert!(ended.is_subset(&ids), "every recently ended task");
    assert!(!ids.contains(&long_ago.id), "ended before the window");
    assert!(!ids.contains(&other.id), "another repo's task");
    assert_eq!(ids.len(), 1002);
    // A name that would be SQL if it were spliced in is a value.
    assert!(
        s.tasks_followed("alpha' OR '1'='1", 0)
            .await
            .unwrap()
            .is_empty()
    );

    // The newest event id of each task, whatever its history; none for a task without events
    // of its own beyond those given.
    let newest = |ids: Vec<i64>| async move {
        s.newest_event_ids(&ids)
            .await
            .unwrap()
            .into_iter()
            .collect::<HashMap<i64, i64>>()
    };
    let before = newest(vec![live.id, other.id]).await;
    assert_eq!(before.len(), 2, "{before:?}");
    let appended = s
        .append_event(NewEvent::new("stage.started", "again").task(live.id))
        .await
        .unwrap();
    let after = newest(vec![live.id, other.id]).await;
    assert_eq!(after[&live.id], appended);
    assert!(after[&live.id] > before[&live.id]);
    assert_eq!(
        after[&other.id], before[&other.id],
        "another task's is unchanged"
    );
    let many: Vec<i64> = ended.iter().copied().collect();
    assert_eq!(newest(many).await.len(), 1001, "read in chunks");
}

/// Runs `sql` on the test's database past the store, as a hand edit of the database (or an
/// older version that did not validate) would: the only way to put into a row a value the
/// store refuses to write.
async fn write_past_the_store(db: &TestDb, sql: String) {
    use sqlx::Connection as _;
    match db.store.backend() {
        Backend::Sqlite => {
            let mut conn = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut conn)
                .await
                .unwrap();
            conn.close().await.unwrap();
        }
        Backend::Postgres => {
            let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut conn)
                .await
                .unwrap();
            conn.close().await.unwrap();
        }
    }
}

/// A task row whose work item id, repo or stage is not a valid name is never handed out as a
/// typed [`Task`]: a read of that one row is a [`StoreError::CorruptRow`] naming the table, the
/// row, the column and the value (escaped, cut short); a listing leaves the row out and still
/// lists the others; a stage change from it is refused; nothing is deleted.
async fn a_corrupt_task_row_is_an_error_alone_and_left_out_of_listings(db: TestDb) {
    let s = &db.store;
    let good = task_in(s, "svc", "intake").await;
    let bad_stage = task_in(s, "svc", "intake").await;
    let bad_id = task_in(s, "svc", "review").await;
    let bad_repo = task_in(s, "svc", "intake").await;
    let ended = task_in(s, "svc", "done").await;
    let bad_ended = task_in(s, "svc", "failed").await;
    let bad_with_job = new_task(s, true).await;
    let long = format!("Evil\n{}", "y".repeat(500));
    write_past_the_store(
        &db,
        format!(
            "UPDATE tasks SET stage = '../x' WHERE id = {}; \
             UPDATE tasks SET work_item_id = 'nope' WHERE id = {}; \
             UPDATE tasks SET repo = '{long}' WHERE id = {}; \
             UPDATE tasks SET work_item_id = 'LIST-0' WHERE id = {}; \
             UPDATE tasks SET stage = 'Review' WHERE id = {}",
            bad_stage.id, bad_id.id, bad_repo.id, bad_ended.id, bad_with_job.id
        ),
    )
    .await;

    // A single read: the error names the table, the row, the column and the value.
    let corrupt = |r: Result<Option<Task>>, id: i64, column: &str, value: &str| {
        let e = r.expect_err("a corrupt row is an error");
        let text = e.to_string();
        match e {
            StoreError::CorruptRow {
                table,
                id: row,
                column: col,
                value: v,
                ..
            } => {
                assert_eq!((table, row, col), ("tasks", id, column), "{text}");
                assert_eq!(v, value, "{text}");
            }
            other => panic!("expected CorruptRow, got {other:?}"),
        }
        assert!(text.contains(&format!("tasks row {id}")), "{text}");
        assert!(text.contains(column), "{text}");
        text
    };
    let text = corrupt(
        s.get_task(bad_stage.id).await,
        bad_stage.id,
        "stage",
        "../x",
    );
    assert!(text.contains("\"../x\""), "the value is quoted: {text}");
    corrupt(
        s.get_task_by_work_item("nope").await,
        bad_id.id,
        "work_item_id",
        "nope",
    );
    let cut = format!("Evil\n{}…", "y".repeat(75));
    let text = corrupt(s.get_task(bad_repo.id).await, bad_repo.id, "repo", &cut);
    assert!(text.contains("\"Evil\\n"), "the value is escaped: {text}");
    assert!(
        !text.contains('\n'),
        "no raw line break in the error: {text}"
    );
    assert!(text.len() < 400, "the value is cut short: {text}");
    assert_eq!(s.get_task(good.id).await.unwrap().unwrap(), good);

    // A stage change from a corrupt row is refused, and changes nothing.
    let adv = s
        .advance_stage(AdvanceStage {
            task_id: bad_stage.id,
            expected_stage: "intake".parse().unwrap(),
            new_stage: "review".parse().unwrap(),
            fence: Fence::Seq(bad_stage.stage_seq),
            event: NewEvent::new("stage.advanced", "advanced"),
            next_job: None,
        })
        .await;
    assert!(
        matches!(
            adv,
            Err(StoreError::CorruptRow {
                column: "stage",
                ..
            })
        ),
        "{adv:?}"
    );
    let visit = s
        .write_at_visit(
            Visit {
                task_id: bad_repo.id,
                stage: "intake".parse().unwrap(),
                stage_seq: bad_repo.stage_seq,
            },
            None,
            NewEvent::new("stage.approved", "approved"),
        )
        .await;
    assert!(
        matches!(visit, Err(StoreError::CorruptRow { column: "repo", .. })),
        "{visit:?}"
    );

    // A job of a corrupt task that fails for good is still recorded as failed; its task is
    // left as it is (no stage change from a row that cannot be trusted).
    let job = claim_one(s, "w1").await;
    assert_eq!(job.job.task_id, Some(bad_with_job.id));
    s.mark_job(
        job.lease,
        JobOutcome::Failed {
            error: "broken".into(),
        },
        None,
    )
    .await
    .expect("the failure of a corrupt task's job is written");
    let failed = s.get_job(job.lease.job_id).await.unwrap().unwrap();
    assert_eq!(failed.state, JobState::Failed);
    corrupt(
        s.get_task(bad_with_job.id).await,
        bad_with_job.id,
        "stage",
        "Review",
    );

    // Listings leave the corrupt rows out and still list the others.
    let ids = |tasks: Vec<Task>| tasks.iter().map(|t| t.id).collect::<Vec<_>>();
    let all = TaskFilter {
        limit: 100,
        ..TaskFilter::default()
    };
    assert_eq!(
        ids(s.list_tasks(&all).await.unwrap()),
        vec![ended.id, good.id]
    );
    let mut followed = ids(s.tasks_followed("svc", T0 - 1).await.unwrap());
    followed.sort();
    assert_eq!(followed, vec![good.id, ended.id]);
    assert_eq!(
        ids(s.tasks_ended_since(T0 - 1).await.unwrap()),
        vec![ended.id]
    );

    // Nothing was deleted: every row is still there for an operator to repair.
    let counted: i64 = s
        .count_tasks_by_stage()
        .await
        .unwrap()
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(counted, 7);
}
