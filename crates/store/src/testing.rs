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
