//! The same-run baseline for the PostgreSQL figures: `pgbench` driving the minimal job
//! lifecycle the peers' README calls the physical limit of this machine (claim one row with
//! `FOR UPDATE SKIP LOCKED`, then mark it done: two transactions per job, 8 clients), and its
//! batched variant (claim 10, then mark them done). The machine is shared and noisy, so orch's
//! drain rates are printed as ratios against this baseline measured minutes apart, not only
//! against figures from another day.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, Result};

/// The table and index of the peers' pgbench setup script (`jobq_setup.sql`).
const SETUP: &[&str] = &[
    "CREATE TABLE jobq (id bigserial PRIMARY KEY, state smallint NOT NULL DEFAULT 0, \
     locked_at timestamptz, locked_by int, done_at timestamptz, \
     payload jsonb NOT NULL DEFAULT '{}')",
    "INSERT INTO jobq (payload) SELECT jsonb_build_object('i', g) FROM generate_series(1, 300000) g",
    "CREATE INDEX jobq_available ON jobq (id) WHERE state = 0",
    "VACUUM ANALYZE jobq",
];

/// `jobq_lifecycle.sql`: one job per lifecycle, two autocommit transactions.
const LIFECYCLE: &str = "\
UPDATE jobq SET state = 1, locked_at = now()
 WHERE id = (SELECT id FROM jobq WHERE state = 0 ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
 RETURNING id AS job_id \\gset
UPDATE jobq SET state = 2, done_at = now() WHERE id = :job_id;
";

/// `jobq_lifecycle_batch10.sql`: ten jobs per lifecycle.
const LIFECYCLE_BATCH10: &str = "\
WITH claimed AS (
  UPDATE jobq j SET state = 1, locked_at = now(), locked_by = :client_id
    FROM (SELECT id FROM jobq WHERE state = 0 ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED) c
   WHERE j.id = c.id
  RETURNING j.id)
SELECT min(id) AS lo, max(id) AS hi FROM claimed \\gset
UPDATE jobq SET state = 2, done_at = now()
 WHERE state = 1 AND locked_by = :client_id AND id BETWEEN :lo AND :hi;
";

/// Jobs/s of the two lifecycles.
#[derive(Debug, Clone, Copy)]
pub struct Baseline {
    pub per_job: f64,
    pub batch10: f64,
}

/// Runs both lifecycles for `seconds` each against a fresh schema. `None` (with the reason on
/// stderr) when `pgbench` is not installed: the baseline is optional, the bench is not.
pub async fn baseline(target_url: &str, seconds: u32) -> Result<Option<Baseline>> {
    if which("pgbench").is_none() || which("psql").is_none() {
        eprintln!(
            "postgres pgbench or psql is not installed: no same-run baseline \
             (apt-get install postgresql-client)"
        );
        return Ok(None);
    }
    // The target URL is sqlx's: `postgres://…/db?options[search_path]=schema`. libpq takes the
    // URL without the query and the schema through PGOPTIONS.
    let (conninfo, schema) = match target_url.split_once("?options[search_path]=") {
        Some((base, schema)) => (base.to_owned(), schema.to_owned()),
        None => anyhow::bail!("unexpected bench database URL shape"),
    };
    let mut psql = tokio::process::Command::new("psql");
    psql.args(["-X", "-q", "-v", "ON_ERROR_STOP=1"])
        .arg(&conninfo)
        .env("PGOPTIONS", format!("-c search_path={schema}"))
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for stmt in SETUP {
        psql.args(["-c", stmt]);
    }
    let out = psql
        .output()
        .await
        .context("cannot run psql for the pgbench baseline's table")?;
    anyhow::ensure!(
        out.status.success(),
        "pgbench baseline setup failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = tempfile::tempdir().context("temp dir for the pgbench scripts")?;
    let mut tps = Vec::new();
    for (name, script) in [("lifecycle", LIFECYCLE), ("batch10", LIFECYCLE_BATCH10)] {
        let path = dir.path().join(format!("{name}.sql"));
        std::fs::write(&path, script).context("writing a pgbench script")?;
        let out = tokio::time::timeout(
            Duration::from_secs(u64::from(seconds) + 60),
            tokio::process::Command::new("pgbench")
                .args(["-n", "-c", "8", "-j", "2", "-T", &seconds.to_string(), "-f"])
                .arg(&path)
                .arg(&conninfo)
                .env("PGOPTIONS", format!("-c search_path={schema}"))
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .context("pgbench did not finish")?
        .context("cannot run pgbench")?;
        let text = String::from_utf8_lossy(&out.stdout);
        anyhow::ensure!(
            out.status.success(),
            "pgbench {name} failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        tps.push(parse_tps(&text).with_context(|| format!("no tps in pgbench's output: {text}"))?);
    }
    Ok(Some(Baseline {
        per_job: tps[0],
        batch10: tps[1] * 10.0,
    }))
}

/// Runs `stmts` with `psql` in the bench schema of `target_url` (sqlx's URL shape); returns
/// psql's unaligned, tuples-only output.
pub async fn psql(target_url: &str, stmts: &[&str]) -> Result<String> {
    let (conninfo, schema) = match target_url.split_once("?options[search_path]=") {
        Some((base, schema)) => (base.to_owned(), schema.to_owned()),
        None => anyhow::bail!("unexpected bench database URL shape"),
    };
    let mut psql = tokio::process::Command::new("psql");
    psql.args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
        .arg(&conninfo)
        .env("PGOPTIONS", format!("-c search_path={schema}"))
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for stmt in stmts {
        psql.args(["-c", stmt]);
    }
    let out = psql.output().await.context("cannot run psql")?;
    anyhow::ensure!(
        out.status.success(),
        "psql failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `tps = 2056.123456 (without initial connection time)` → 2056.12.
fn parse_tps(out: &str) -> Option<f64> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("tps = "))
        .find_map(|rest| rest.split_whitespace().next()?.parse().ok())
}

fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(program))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tps_is_read_from_pgbench_output() {
        let out = "number of failed transactions: 0 (0.000%)\n\
                   latency average = 3.891 ms\n\
                   initial connection time = 10.224 ms\n\
                   tps = 2056.123456 (without initial connection time)\n";
        assert_eq!(parse_tps(out), Some(2056.123456));
        assert_eq!(parse_tps("no figures here"), None);
    }
}
