//! Schema snapshot (NFR-1, AC-5, AC-12): features add no table, column or migration. The migrated
//! schema of each backend is compared with a committed copy (`tests/schema/{sqlite,postgres}.sql`);
//! any change to the schema has to show up in review as a change to those files.
//!
//! To accept an intended change: `ORCH_UPDATE_SCHEMA=1 cargo test -p orch-store --test it schema::`.

use std::collections::BTreeSet;
use std::path::PathBuf;

use orch_store::testing::TestDb;

/// The only tables orch may have (ARCHITECTURE.md: "exactly four tables").
const TABLES: [&str; 4] = ["agent_runs", "events", "jobs", "tasks"];

fn snapshot_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("schema")
        .join(name)
}

/// A line diff small enough to read in a test failure: `-` expected, `+` actual.
fn diff(expected: &str, actual: &str) -> String {
    let exp: Vec<&str> = expected.lines().collect();
    let act: Vec<&str> = actual.lines().collect();
    // Longest common subsequence over lines; schemas are short.
    let (n, m) = (exp.len(), act.len());
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if exp[i] == act[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < n || j < m {
        if i < n && j < m && exp[i] == act[j] {
            i += 1;
            j += 1;
        } else if j < m && (i == n || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out.push_str(&format!("+ {}\n", act[j]));
            j += 1;
        } else {
            out.push_str(&format!("- {}\n", exp[i]));
            i += 1;
        }
    }
    out
}

/// Compares `actual` with the committed snapshot `name`, or rewrites it under ORCH_UPDATE_SCHEMA=1.
fn check(name: &str, actual: &str, tables: BTreeSet<String>) {
    let expected_tables: BTreeSet<String> = TABLES.iter().map(|t| (*t).to_owned()).collect();
    assert_eq!(
        tables, expected_tables,
        "{name}: the schema must have exactly the four tables {TABLES:?}"
    );
    let path = snapshot_path(name);
    if std::env::var("ORCH_UPDATE_SCHEMA").is_ok_and(|v| v == "1") {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if expected != actual {
        panic!(
            "the {name} schema differs from the committed snapshot {} \
             (- committed, + migrated):\n{}\nIf the change is intended (a new migration, \
             reviewed against NFR-1: no new table or column for a feature), update the snapshot \
             with `ORCH_UPDATE_SCHEMA=1 cargo test -p orch-store --test it schema::` and commit it.",
            path.display(),
            diff(&expected, actual)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_schema_matches_the_committed_snapshot() {
    let db = TestDb::sqlite().await;
    let dump = db.store.schema_dump().await.unwrap();
    let tables = dump
        .lines()
        .filter_map(|l| l.strip_prefix("CREATE TABLE "))
        .map(|rest| {
            rest.split(|c: char| c == '(' || c.is_whitespace())
                .next()
                .unwrap_or_default()
                .trim_matches('"')
                .to_owned()
        })
        .collect();
    check("sqlite.sql", &dump, tables);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_schema_matches_the_committed_snapshot() {
    let db = TestDb::postgres().await;
    let dump = db.store.schema_dump().await.unwrap();
    let tables = dump
        .lines()
        .filter_map(|l| l.strip_prefix("column "))
        .filter_map(|rest| rest.split_once('.').map(|(t, _)| t.to_owned()))
        .collect();
    check("postgres.sql", &dump, tables);
}

#[test]
fn diff_shows_added_and_removed_lines() {
    let cases = [
        ("a\nb\nc\n", "a\nb\nc\n", ""),
        ("a\nb\n", "a\nx\nb\n", "+ x\n"),
        ("a\nb\nc\n", "a\nc\n", "- b\n"),
        ("a\n", "b\n", "+ b\n- a\n"),
    ];
    for (expected, actual, want) in cases {
        assert_eq!(diff(expected, actual), want, "{expected:?} vs {actual:?}");
    }
}

/// Every PostgreSQL connection runs generic plans (no re-planning per execution, see
/// `PgStore::connect_with`), so the claim statement's plan is fixed once per connection and
/// must be right for any parameters: both updates reach rows by primary key, the pick walks
/// `jobs_ready` in order, and nothing scans the whole `jobs` table. A seq scan here would turn
/// every claim into a full table read (measured once: 3,500 → 520 jobs/s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_shapes_hold_under_generic_plans() {
    use orch_store::postgres::{PgStore, complete_and_claim_sql};
    let db = TestDb::postgres().await;
    let jobs: Vec<orch_store::NewJob> = (0..20_000)
        .map(|i| orch_store::NewJob::new(if i % 2 == 0 { "a" } else { "b" }, ""))
        .collect();
    db.store.enqueue_many(jobs).await.unwrap();
    let pg = PgStore::connect(&db.url, orch_store::ConnectOptions::default())
        .await
        .unwrap();
    let mut conn = pg.pool().acquire().await.unwrap();
    let mode: String = sqlx::query_scalar("SHOW plan_cache_mode")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(mode, "force_generic_plan");
    let prepare = format!(
        "PREPARE cc(bigint, bigint[], bigint[], bigint, text[], text, bigint, text, bigint) AS {}",
        complete_and_claim_sql()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(prepare))
        .execute(&mut *conn)
        .await
        .unwrap();
    for args in [
        "1, '{}', '{}', 1, '{}', NULL, 1000, 'w', NULL",
        "9000000000000000, '{1,2,3}', '{1,1,1}', 100, '{a}', 'n1', 1000, 'w', 300000",
    ] {
        let rows: Vec<String> =
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("EXPLAIN EXECUTE cc({args})")))
                .fetch_all(&mut *conn)
                .await
                .unwrap()
                .iter()
                .map(|r| sqlx::Row::get::<String, _>(r, 0))
                .collect();
        let plan = rows.join("\n");
        assert!(!plan.contains("Seq Scan on jobs"), "{args}:\n{plan}");
        assert!(
            plan.contains("Index Scan using jobs_ready"),
            "{args}:\n{plan}"
        );
        assert_eq!(
            plan.matches("Index Scan using jobs_pkey").count(),
            2,
            "both updates reach their rows by primary key; {args}:\n{plan}"
        );
        assert!(!plan.contains("jobs_state_agent"), "{args}:\n{plan}");
    }
}

/// `next_available_at` runs after every claim that comes back short (how long an idle worker
/// may sleep): it must seek through `jobs_ready`, never read every queued row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_available_at_seeks_the_ready_index_on_both_backends() {
    use sqlx::Row as _;
    let db = TestDb::sqlite().await;
    let path = db.url.trim_start_matches("sqlite://").to_owned();
    let mut conn =
        <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!("sqlite://{path}"))
            .await
            .unwrap();
    let plan: Vec<String> = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "EXPLAIN QUERY PLAN {}",
        orch_store::sqlite::NEXT_AVAILABLE_AT
    )))
    .fetch_all(&mut conn)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<String, _>(3))
    .collect();
    // Every read of `jobs` (as jobs, q or j) goes through `jobs_ready`, in its order.
    let reads: Vec<&String> = plan
        .iter()
        .filter(|l| {
            ["jobs", "q", "j"]
                .iter()
                .any(|t| l.contains(&format!(" {t} ")))
        })
        .collect();
    assert_eq!(reads.len(), 3, "{plan:#?}");
    assert!(
        reads.iter().all(|l| l.contains("INDEX jobs_ready")),
        "{plan:#?}"
    );
    assert!(!plan.iter().any(|l| l.contains("TEMP B-TREE")), "{plan:#?}");

    let db = TestDb::postgres().await;
    let pg = orch_store::postgres::PgStore::connect(&db.url, orch_store::ConnectOptions::default())
        .await
        .unwrap();
    let jobs: Vec<orch_store::NewJob> = (0..20_000)
        .map(|i| orch_store::NewJob::new("a", "").delay_s(i % 100))
        .collect();
    db.store.enqueue_many(jobs).await.unwrap();
    let mut conn = pg.pool().acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "PREPARE na(text[], text) AS {}",
        orch_store::postgres::NEXT_AVAILABLE_AT
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let plan: Vec<String> = sqlx::raw_sql(sqlx::AssertSqlSafe(
        "EXPLAIN EXECUTE na('{a}', 'n1')".to_owned(),
    ))
    .fetch_all(&mut *conn)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<String, _>(0))
    .collect();
    let plan = plan.join("\n");
    assert!(!plan.contains("Seq Scan on jobs"), "{plan}");
    assert!(plan.contains("jobs_ready"), "{plan}");
}

/// `newest_event_ids` runs for every followed task on every forge sync pass: on PostgreSQL
/// each task must be one backward read of `events_task`, never a scan of `events` (the earlier
/// `task_id IN (…) AND ($2 = '[]' OR …) GROUP BY` form read the whole table). Measured with
/// a table shaped like a real one (many tasks, each a small share of the events; with a handful
/// of tasks the planner rightly walks the primary key back instead, a few rows), analyzed, and
/// the generic plan the driver's prepared statement ends up with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newest_event_ids_reads_the_task_index_on_postgres() {
    use sqlx::Row as _;
    let db = TestDb::postgres().await;
    let pg = orch_store::postgres::PgStore::connect(&db.url, orch_store::ConnectOptions::default())
        .await
        .unwrap();
    const TASKS: usize = 300;
    let mut ids = Vec::new();
    for _ in 0..TASKS {
        let task = db
            .store
            .create_task(orch_store::NewTask {
                work_item: orch_store::WorkItemSpec::Next {
                    prefix: "ORCH".parse().unwrap(),
                },
                repo: "svc".parse().unwrap(),
                title: "t".into(),
                body: String::new(),
                stage: "intake".parse().unwrap(),
                branch_prefix: "orch/".into(),
                event: orch_store::NewEvent::new("task.submitted", "x"),
                first_job: None,
            })
            .await
            .unwrap();
        ids.push(task.id);
    }
    let mut conn = pg.pool().acquire().await.unwrap();
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO events (task_id, kind, message, created_at) \
         SELECT (ARRAY[{list}])[1 + g % {TASKS}], 'stage.started', 'event ' || g, g \
         FROM generate_series(1, 60000) g; ANALYZE events; \
         SET plan_cache_mode = force_generic_plan; \
         PREPARE newest(text) AS {}",
        orch_store::postgres::NEWEST_EVENT_IDS
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let json = format!(
        "[{}]",
        ids[..5]
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    let plan: Vec<String> = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "EXPLAIN EXECUTE newest('{json}')"
    )))
    .fetch_all(&mut *conn)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<String, _>(0))
    .collect();
    let plan = plan.join("\n");
    assert!(!plan.contains("Seq Scan on events"), "{plan}");
    assert!(plan.contains("events_task"), "{plan}");
    // And the store's answer is each task's newest.
    let newest = db.store.newest_event_ids(&ids[..5]).await.unwrap();
    assert_eq!(newest.len(), 5, "{newest:?}");
}
