//! The delivery report (issue 32) over a synthetic history written through the store, on both
//! backends: every figure checked against the value worked by hand from the DORA definitions
//! (the history and its hand computation: `orch_store::testing::report_history`).

use orch_domain::report::{Range, StagingVerdicts};
use orch_store::testing::{TestDb, report_history, seed_item};

const H: i64 = 3_600_000;
/// 2026-12-01T00:00:00Z.
const D: i64 = 1_796_083_200_000;

async fn seeded(db: &TestDb) {
    for item in report_history(D) {
        seed_item(&db.store, &db.clock, "REP", &item)
            .await
            .expect("seed an item");
    }
}

async fn report_matches_the_hand_computed_figures(db: TestDb) {
    seeded(&db).await;
    let range = Range::new(D, D + 10 * 24 * H).unwrap();
    let r = db.store.report(range, None).await.expect("the report");
    let f = &r.overall;
    // Deployment frequency: A, B, C, D deployed in the 10 days (F before): 0.4 a day.
    assert_eq!(f.deploys, 4);
    assert!((f.deploys_per_day - 0.4).abs() < 1e-9);
    // Lead time from submission: A 5 h, B 4 h, C 2 h, D 6 h → median 4 h, p90 6 h.
    let l = &f.lead_time_from_submission;
    assert_eq!(
        (l.count, l.median_ms, l.p90_ms),
        (4, Some(4 * H), Some(6 * H))
    );
    // From the first commit: A 4 h, B 2 h, C 1 h, D 5 h → median 2 h, p90 5 h.
    let c = &f.lead_time_from_first_commit;
    assert_eq!(
        (c.count, c.median_ms, c.p90_ms),
        (4, Some(2 * H), Some(5 * H))
    );
    // Change failure rate: B rolled back, C reverted, of 4 deploys.
    assert_eq!((f.rolled_back, f.reverted, f.change_failures), (1, 1, 2));
    assert_eq!(f.change_failure_rate, Some(0.5));
    // Time to restore: B 30 min (FAILED → verified rollback), C 1 h.
    let t = &f.time_to_restore;
    assert_eq!(
        (t.count, t.median_ms, t.p90_ms, t.mean_ms),
        (2, Some(H / 2), Some(H), Some(3 * H / 4))
    );
    // orch's figures over the 5 items that ended in the range.
    let ended: Vec<(&str, u64)> = f.ended.iter().map(|(k, v)| (*k, *v)).collect();
    assert_eq!(
        ended,
        [
            ("failed", 1),
            ("reverted", 1),
            ("rolled_back", 1),
            ("shipped", 2)
        ]
    );
    assert!((f.cost_usd - 7.75).abs() < 1e-9, "{}", f.cost_usd);
    assert_eq!(f.unknown_cost_runs, 1);
    assert_eq!(f.cost_per_shipped_usd, Some(7.75 / 2.0));
    assert_eq!(f.agent_runs_per_shipped, Some(2.0));
    assert_eq!(f.review_loops_per_shipped, Some(0.5));
    assert_eq!(
        f.staging,
        StagingVerdicts {
            passed: 3,
            change_failures: 1,
            infrastructure_errors: 3
        }
    );
    assert_eq!((f.release_wait.count, f.release_wait.total_ms), (1, H));
    let agents: Vec<(&str, u64, u64, u64, u64)> = f
        .by_agent
        .iter()
        .map(|a| {
            (
                a.backend.as_str(),
                a.runs,
                a.items,
                a.shipped,
                a.change_failures,
            )
        })
        .collect();
    assert_eq!(agents, [("claude", 6, 4, 2, 1), ("codex", 2, 1, 0, 1)]);
    assert!((f.by_agent[0].cost_usd - 3.75).abs() < 1e-9);
    // By repo.
    let repos: Vec<(&str, u64, u64)> = r
        .repos
        .iter()
        .map(|(n, f)| (n.as_str(), f.deploys, f.shipped))
        .collect();
    assert_eq!(repos, [("a", 3, 1), ("b", 1, 1)]);
}

async fn the_range_and_the_repo_bound_what_is_read(db: TestDb) {
    seeded(&db).await;
    // F ended before the range: not read at all.
    let tasks = db
        .store
        .tasks_alive_in(D, D + 10 * 24 * H, None)
        .await
        .unwrap();
    assert_eq!(tasks.len(), 5);
    // Submitted at or after `until`: not read; ended before `since`: not read.
    let tasks = db
        .store
        .tasks_alive_in(D + 11 * H, D + 20 * H, None)
        .await
        .unwrap();
    assert_eq!(
        tasks.len(),
        1,
        "only B was submitted before +20 h and ended after +11 h"
    );
    let b = db
        .store
        .report(Range::new(D, D + 10 * 24 * H).unwrap(), Some("b"))
        .await
        .unwrap();
    assert_eq!((b.overall.deploys, b.repos.len()), (1, 1));
    // A name that would be SQL if it were spliced in is a value: no repo has it.
    let hostile = db
        .store
        .report(
            Range::new(D, D + 10 * 24 * H).unwrap(),
            Some("a' OR '1'='1"),
        )
        .await
        .unwrap();
    assert_eq!((hostile.overall.deploys, hostile.repos.len()), (0, 0));
    // A live item that deployed in the range counts as a deploy before it ends.
    let mut live = report_history(D).remove(0);
    live.end = None;
    live.created = D + 50 * H;
    for e in &mut live.events {
        e.0 += 50 * H;
    }
    seed_item(&db.store, &db.clock, "REP", &live).await.unwrap();
    let r = db
        .store
        .report(Range::new(D, D + 10 * 24 * H).unwrap(), None)
        .await
        .unwrap();
    assert_eq!(r.overall.deploys, 5);
    assert_eq!(r.overall.shipped, 2, "it has not ended");
}

macro_rules! both {
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

both!(
    report_matches_the_hand_computed_figures,
    the_range_and_the_repo_bound_what_is_read,
);
