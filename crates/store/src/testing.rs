//! Test support for every crate's tests: a fresh, migrated store on a real SQLite file or in a
//! private schema of the real PostgreSQL, with a manual clock.
//!
//! PostgreSQL is found at `ORCH_TEST_PG_URL` (default `postgres://root@127.0.0.1:5432/test`);
//! tests use their own database `orch_test` on that server, one schema per test store, and
//! drop the schemas of test processes that are gone.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Backend, ConnectOptions, Lease, ManualClock, Store, StoreError};

/// Where the tests' PostgreSQL lives.
pub fn pg_admin_url() -> String {
    std::env::var("ORCH_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".to_owned())
}

/// The backend `ORCH_TEST_BACKEND` names (`sqlite` when unset). Panics on any other value, so
/// a typo cannot silently run the suite on the default.
pub fn backend_from_env() -> Backend {
    match std::env::var("ORCH_TEST_BACKEND").as_deref() {
        Err(_) | Ok("") | Ok("sqlite") => Backend::Sqlite,
        Ok("postgres") => Backend::Postgres,
        Ok(other) => panic!("ORCH_TEST_BACKEND={other:?}: expected sqlite or postgres"),
    }
}

/// A migrated store for one test. Dropping it leaves the files/schema behind until the process
/// ends (SQLite: the temp dir is removed; PostgreSQL: the next test run drops the schema).
pub struct TestDb {
    pub store: Store,
    pub clock: Arc<ManualClock>,
    /// The URL another process (a spawned `orch`) can use to open the same store.
    pub url: String,
    _dir: Option<tempfile::TempDir>,
}

/// A start time far from 0 so that arithmetic on times never looks like "unset".
pub const T0: i64 = 1_800_000_000_000;

impl TestDb {
    pub async fn new(backend: Backend) -> TestDb {
        match backend {
            Backend::Sqlite => TestDb::sqlite().await,
            Backend::Postgres => TestDb::postgres().await,
        }
    }

    /// A store on the backend named by `ORCH_TEST_BACKEND` (`sqlite`, the default, or
    /// `postgres`): for suites that are not written once per backend but should run on both
    /// (`scripts/test` runs them a second time with `ORCH_TEST_BACKEND=postgres`).
    pub async fn from_env() -> TestDb {
        TestDb::new(backend_from_env()).await
    }

    pub async fn sqlite() -> TestDb {
        let dir = match tempfile::tempdir() {
            Ok(d) => d,
            Err(e) => panic!("cannot create a temp dir for a test database: {e}"),
        };
        let path = dir.path().join("orch.db");
        let url = format!("sqlite://{}", path.display());
        let clock = ManualClock::new(T0);
        let store = open(&url, clock.clone(), true).await;
        TestDb {
            store,
            clock,
            url,
            _dir: Some(dir),
        }
    }

    pub async fn postgres() -> TestDb {
        let url = fresh_pg_schema().await;
        let clock = ManualClock::new(T0);
        let store = open(&url, clock.clone(), false).await;
        TestDb {
            store,
            clock,
            url,
            _dir: None,
        }
    }

    /// Opens another store on the same database (another "process"), sharing the clock.
    pub async fn reopen(&self) -> Store {
        let store = Store::connect(
            &self.url,
            ConnectOptions {
                clock: self.clock.clone(),
                ..ConnectOptions::default()
            },
        )
        .await;
        match store {
            Ok(s) => s,
            Err(e) => panic!("cannot reopen the test database {}: {e}", self.url),
        }
    }
}

async fn open(url: &str, clock: Arc<ManualClock>, create: bool) -> Store {
    let opts = ConnectOptions {
        clock,
        create_if_missing: create,
        ..ConnectOptions::default()
    };
    let store = match Store::connect(url, opts).await {
        Ok(s) => s,
        Err(e) => panic!("cannot open the test database {url}: {e}"),
    };
    if let Err(e) = store.migrate().await {
        panic!("cannot migrate the test database {url}: {e}");
    }
    store
}

static SCHEMA_SEQ: AtomicU64 = AtomicU64::new(0);

/// Creates (once) the `orch_test` database and a fresh schema in it; returns a URL whose
/// connections use that schema.
pub async fn fresh_pg_schema() -> String {
    let admin = pg_admin_url();
    let base = match admin.rsplit_once('/') {
        Some((base, _db)) => base.to_owned(),
        None => panic!("ORCH_TEST_PG_URL {admin} has no database part"),
    };
    let db_url = format!("{base}/orch_test");
    let result: Result<String, StoreError> = async {
        ensure_database(&admin, "orch_test").await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&db_url)
            .await?;
        drop_dead_schemas(&pool).await?;
        let schema = format!(
            "t_{}_{}_{}",
            std::process::id(),
            SCHEMA_SEQ.fetch_add(1, Ordering::SeqCst),
            rand_suffix()
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&pool)
            .await?;
        pool.close().await;
        Ok(format!("{db_url}?options[search_path]={schema}"))
    }
    .await;
    match result {
        Ok(url) => url,
        Err(e) => panic!(
            "PostgreSQL for tests is not usable at {admin}: {e}. Start it with \
             `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
             or point ORCH_TEST_PG_URL elsewhere"
        ),
    }
}

/// Creates database `name` if it does not exist (tolerating a concurrent creator).
pub async fn ensure_database(admin_url: &str, name: &str) -> Result<(), StoreError> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(admin_url)
        .await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&pool)
            .await?;
    if !exists {
        let created = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&pool)
            .await;
        if let Err(e) = created {
            let raced = matches!(&e, sqlx::Error::Database(db)
                if matches!(db.code().as_deref(), Some("42P04" | "23505")));
            if !raced {
                return Err(e.into());
            }
        }
    }
    pool.close().await;
    Ok(())
}

/// Drops `t_<pid>_…` schemas whose process no longer exists.
async fn drop_dead_schemas(pool: &sqlx::PgPool) -> Result<(), StoreError> {
    let schemas: Vec<String> = sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 't\\_%\\_%\\_%'",
    )
    .fetch_all(pool)
    .await?;
    for schema in schemas {
        let Some(pid) = schema.split('_').nth(1).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        // Another test process may be dropping the same schema; either way it ends up gone.
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(pool)
        .await;
    }
    Ok(())
}

fn rand_suffix() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    nanos % 100_000
}

/// Drops database `name`, disconnecting its sessions (tests of a database that goes away).
pub async fn drop_database(admin_url: &str, name: &str) -> Result<(), StoreError> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(admin_url)
        .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&pool)
    .await?;
    pool.close().await;
    Ok(())
}

/// Job `job_id` of `store` started as a claim by worker `test` would start it (see
/// `Db::start_job`): running, leased for ten minutes, its lease returned. For tests that run an
/// executor on a chosen job without a worker: the executor's fenced writes need a live lease.
pub async fn start_job(store: &Store, job_id: i64) -> Lease {
    let started = match store {
        Store::Sqlite(s) => s.start_job(job_id, "test", 600_000).await,
        Store::Postgres(s) => s.start_job(job_id, "test", 600_000).await,
    };
    match started {
        Ok(lease) => lease,
        Err(e) => panic!("cannot start job {job_id} for the test: {e}"),
    }
}

/// PostgreSQL only: locks job `job_id`'s row from a connection of its own (`FOR UPDATE`, as a
/// claim in flight holds it, so claims skip it) and returns once it holds the lock; the lock
/// is released `hold` later, when the returned task ends.
pub async fn hold_job_row(
    url: &str,
    job_id: i64,
    hold: std::time::Duration,
) -> Result<tokio::task::JoinHandle<Result<(), StoreError>>, StoreError> {
    use sqlx::Connection as _;
    let mut conn = sqlx::postgres::PgConnection::connect(url).await?;
    sqlx::query("BEGIN").execute(&mut conn).await?;
    let locked: Option<i64> = sqlx::query_scalar("SELECT id FROM jobs WHERE id = $1 FOR UPDATE")
        .bind(job_id)
        .fetch_optional(&mut conn)
        .await?;
    if locked != Some(job_id) {
        return Err(StoreError::JobNotFound(job_id));
    }
    Ok(tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        sqlx::query("COMMIT").execute(&mut conn).await?;
        conn.close().await?;
        Ok(())
    }))
}

/// One work item of a synthetic delivery history, written through the store by [`seed_item`]:
/// submitted at `created` (stage `intake`), its agent runs, its events at their times, and its
/// end (a terminal stage change) at its time.
#[derive(Debug, Clone)]
pub struct SeedItem {
    pub repo: String,
    pub created: i64,
    /// `(at, kind, stage, data)`, oldest first.
    pub events: Vec<(i64, &'static str, &'static str, serde_json::Value)>,
    /// `(backend, model, cost)`: runs started at `created`, finished with their cost.
    pub runs: Vec<(&'static str, &'static str, Option<f64>)>,
    /// `(at, terminal stage, data of its terminal event)`; `None`: still live.
    pub end: Option<(i64, &'static str, serde_json::Value)>,
}

/// Writes `item` through `store` at its times (the clock is set to each), as the engine would
/// leave it: `create_task`, `start_agent_run`/`finish_agent_run`, `append_event`, and the end by
/// `advance_stage` (fenced by the stage sequence).
pub async fn seed_item(
    store: &Store,
    clock: &ManualClock,
    prefix: &str,
    item: &SeedItem,
) -> Result<crate::Task, StoreError> {
    use crate::{
        AdvanceStage, AgentRunFinish, Fence, NewAgentRun, NewEvent, NewTask, WorkItemSpec,
    };
    use orch_domain::control::events;
    let name = |e: orch_domain::ids::IdError| StoreError::Invalid(e.to_string());
    clock.set(item.created);
    let task = store
        .create_task(NewTask {
            work_item: WorkItemSpec::Next {
                prefix: prefix.parse().map_err(name)?,
            },
            repo: item.repo.parse().map_err(name)?,
            title: "seeded".to_owned(),
            body: String::new(),
            stage: "intake".parse().map_err(name)?,
            branch_prefix: "orch/".to_owned(),
            event: NewEvent::new(events::TASK_SUBMITTED, "submitted"),
            first_job: None,
        })
        .await?;
    for (backend, model, cost) in &item.runs {
        let run = store
            .start_agent_run(NewAgentRun {
                task_id: task.id,
                job_id: None,
                stage: "implementation".to_owned(),
                agent: "developer".to_owned(),
                backend: (*backend).to_owned(),
                model: Some((*model).to_owned()),
                attempt: 1,
            })
            .await?;
        store
            .finish_agent_run(
                run,
                AgentRunFinish {
                    outcome: "success".to_owned(),
                    cost_usd: *cost,
                    data: "{}".to_owned(),
                    ..AgentRunFinish::default()
                },
            )
            .await?;
    }
    for (at, kind, stage, data) in &item.events {
        clock.set(*at);
        store
            .append_event(
                NewEvent::new(*kind, *kind)
                    .task(task.id)
                    .stage(*stage)
                    .data(data.to_string()),
            )
            .await?;
    }
    let Some((at, stage, data)) = &item.end else {
        return Ok(task);
    };
    let kind = orch_domain::control::terminal_event(stage)
        .ok_or_else(|| StoreError::Invalid(format!("{stage} is not a terminal stage")))?;
    clock.set(*at);
    let adv = store
        .advance_stage(AdvanceStage {
            task_id: task.id,
            expected_stage: "intake".parse().map_err(name)?,
            new_stage: stage.parse().map_err(name)?,
            fence: Fence::Seq(task.stage_seq),
            event: NewEvent::new(kind, kind).data(data.to_string()),
            next_job: None,
        })
        .await?;
    Ok(adv.task)
}

/// The synthetic history of the delivery report's tests, from `d` (hours after it): six items
/// whose figures are worked by hand where they are checked (`crates/store/tests/it/report.rs`,
/// the same history as `orch_domain::report`'s unit tests):
/// - A (repo `a`): shipped; a review loop; waited 1 h for the release track; submitted at
///   `d`, first commit at +1 h, deployed at +5 h; 3 runs `claude`/`opus` at $1.
/// - B (`a`): submitted +10 h, first commit +12 h, deployed +14 h; the watch FAILED at +15 h
///   and production was rolled back, verified, at +15.5 h; 2 runs `codex`/`gpt-5` at $2.
/// - C (`a`): submitted +20 h, first commit +21 h, deployed +22 h, FAILED at +23 h, rolled
///   back at +24 h, reverted at +25 h; 1 run at $0.50.
/// - D (`b`): submitted +30 h, first commit +31 h; failed staging for the change (+32 h), an
///   infrastructure defer (+34 h), staged, deployed +36 h, shipped; 1 run of unknown cost.
/// - E (`a`): submitted +40 h; an infrastructure defer, then failed at staging (+43 h); 1 run
///   at $0.25.
/// - F (`a`): five days before `d`, deployed and shipped then; 1 run at $100.
pub fn report_history(d: i64) -> Vec<SeedItem> {
    use orch_domain::control::{events as k, markers};
    use serde_json::json;
    const H: i64 = 3_600_000;
    use orch_domain::payload::StageChange;
    let change = |c: StageChange| serde_json::to_value(c).unwrap_or_default();
    let adv = |from: &str, to: &str| change(StageChange::new(from, to));
    let verdict = |v: &str, a: &str| json!({"verdict": v, "action": a});
    let defer = || json!({"marker": markers::staging_defer(9)});
    let done = || adv("lessons", "done");
    let opus = |c: Option<f64>| ("claude", "opus", c);
    vec![
        SeedItem {
            repo: "a".into(),
            created: d,
            events: vec![
                (
                    d + H / 2,
                    k::STAGE_LOOP_BACK,
                    "implementation",
                    adv("review", "implementation"),
                ),
                (
                    d + H,
                    k::STAGE_ADVANCED,
                    "review",
                    adv("implementation", "review"),
                ),
                (d + 2 * H, k::RELEASE_WAITING, "verification", json!({})),
                (
                    d + 3 * H,
                    k::STAGE_ADVANCED,
                    "merge",
                    adv("verification", "merge"),
                ),
                (d + 4 * H, k::RELEASE_STAGED, "staging", json!({})),
                (
                    d + 5 * H,
                    k::DEPLOY_CONFIRMED,
                    "deploy",
                    json!({"revision": "a1"}),
                ),
                (
                    d + 6 * H,
                    k::POST_DEPLOY_VERDICT,
                    "observe",
                    verdict("HEALTHY", "none"),
                ),
            ],
            runs: vec![opus(Some(1.0)), opus(Some(1.0)), opus(Some(1.0))],
            end: Some((d + 7 * H, "done", done())),
        },
        SeedItem {
            repo: "a".into(),
            created: d + 10 * H,
            events: vec![
                (
                    d + 12 * H,
                    k::STAGE_ADVANCED,
                    "review",
                    adv("implementation", "review"),
                ),
                (d + 13 * H, k::RELEASE_STAGED, "staging", json!({})),
                (
                    d + 14 * H,
                    k::DEPLOY_CONFIRMED,
                    "deploy",
                    json!({"revision": "b1"}),
                ),
                (
                    d + 15 * H,
                    k::POST_DEPLOY_VERDICT,
                    "observe",
                    verdict("FAILED", "rollback"),
                ),
                (
                    d + 15 * H + H / 2,
                    k::POST_DEPLOY_ROLLBACK,
                    "observe",
                    json!({"verified": true}),
                ),
                (
                    d + 15 * H + H / 2,
                    k::RELEASE_ROLLED_BACK,
                    "observe",
                    json!({"live": "a1"}),
                ),
            ],
            runs: vec![("codex", "gpt-5", Some(2.0)), ("codex", "gpt-5", Some(2.0))],
            end: Some((d + 16 * H, "done", done())),
        },
        SeedItem {
            repo: "a".into(),
            created: d + 20 * H,
            events: vec![
                (
                    d + 21 * H,
                    k::STAGE_ADVANCED,
                    "review",
                    adv("implementation", "review"),
                ),
                (
                    d + 22 * H,
                    k::DEPLOY_CONFIRMED,
                    "deploy",
                    json!({"revision": "c1"}),
                ),
                (
                    d + 23 * H,
                    k::POST_DEPLOY_VERDICT,
                    "observe",
                    verdict("FAILED", "rollback"),
                ),
                (
                    d + 24 * H,
                    k::POST_DEPLOY_ROLLBACK,
                    "observe",
                    json!({"verified": true}),
                ),
                (d + 25 * H, k::RELEASE_REVERTED, "observe", json!({})),
            ],
            runs: vec![opus(Some(0.5))],
            end: Some((d + 26 * H, "done", done())),
        },
        SeedItem {
            repo: "b".into(),
            created: d + 30 * H,
            events: vec![
                (
                    d + 31 * H,
                    k::STAGE_ADVANCED,
                    "review",
                    adv("implementation", "review"),
                ),
                (
                    d + 32 * H,
                    k::STAGE_LOOP_BACK,
                    "implementation",
                    adv("staging", "implementation"),
                ),
                (
                    d + 33 * H,
                    k::STAGE_ADVANCED,
                    "review",
                    adv("implementation", "review"),
                ),
                (d + 34 * H, k::STAGE_REQUEUED, "staging", defer()),
                (d + 35 * H, k::RELEASE_STAGED, "staging", json!({})),
                (
                    d + 36 * H,
                    k::DEPLOY_CONFIRMED,
                    "deploy",
                    json!({"revision": "d1"}),
                ),
                (
                    d + 37 * H,
                    k::POST_DEPLOY_VERDICT,
                    "observe",
                    verdict("HEALTHY", "none"),
                ),
            ],
            runs: vec![opus(None)],
            end: Some((d + 38 * H, "done", done())),
        },
        SeedItem {
            repo: "a".into(),
            created: d + 40 * H,
            events: vec![
                (
                    d + 41 * H,
                    k::STAGE_ADVANCED,
                    "review",
                    adv("implementation", "review"),
                ),
                (d + 42 * H, k::STAGE_REQUEUED, "staging", defer()),
            ],
            runs: vec![opus(Some(0.25))],
            end: Some((
                d + 43 * H,
                "failed",
                change(StageChange {
                    stage: Some("staging".into()),
                    ..StageChange::new("staging", "failed")
                }),
            )),
        },
        SeedItem {
            repo: "a".into(),
            created: d - 120 * H,
            events: vec![
                (
                    d - 119 * H,
                    k::STAGE_ADVANCED,
                    "review",
                    adv("implementation", "review"),
                ),
                (d - 96 * H, k::DEPLOY_CONFIRMED, "deploy", json!({})),
            ],
            runs: vec![opus(Some(100.0))],
            end: Some((d - 95 * H, "done", done())),
        },
    ]
}
