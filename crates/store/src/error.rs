//! The store's error type: every failure names its cause in words a user can act on.

use crate::model::Lease;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The caller's job is no longer running under its attempt: another worker took over, the
    /// lease was rescued, or the job was cancelled. Nothing was changed.
    #[error("job {} attempt {} no longer holds its lease (job is now {actual}); nothing was changed", lease.job_id, lease.attempt)]
    LeaseLost { lease: Lease, actual: String },

    /// `advance_stage` found the task elsewhere than expected. Nothing was changed.
    #[error(
        "task {task_id} is at stage '{actual}' (seq {actual_seq}), not '{expected}'; nothing was changed"
    )]
    StageConflict {
        task_id: i64,
        expected: String,
        actual: String,
        actual_seq: i64,
    },

    #[error("task {0} not found")]
    TaskNotFound(String),

    /// `advance_stage_exclusive` found another task of the repo in the exclusive stages (the
    /// repo's release track is held). Nothing was changed.
    #[error(
        "repo {repo}'s release track is held by {holder} (at stage {stage}); nothing was changed"
    )]
    TrackBusy {
        repo: String,
        holder: String,
        stage: String,
    },

    #[error("job {0} not found")]
    JobNotFound(i64),

    #[error("work item id {0} is already taken")]
    WorkItemTaken(String),

    #[error("invalid input: {0}")]
    Invalid(String),

    /// A row read from the database holds a value that is not a valid name of its column's
    /// kind (a hand edit, a bug of another version): the row is not used. `value` is cut to
    /// `common::CORRUPT_VALUE_ECHO` (80) characters and shown escaped.
    #[error(
        "the {table} row {id} is corrupt: its {column} {value:?} is not valid ({reason}); the row is left as it is for an operator to repair"
    )]
    CorruptRow {
        table: &'static str,
        id: i64,
        column: &'static str,
        value: String,
        reason: String,
    },

    #[error("invalid database URL '{url}': {reason}")]
    BadUrl { url: String, reason: String },

    #[error("cannot open the database at {target}: {reason}")]
    Connect { target: String, reason: String },

    #[error("the database at {target} has no orch schema yet; run `orch migrate` (or `orch init`)")]
    NotMigrated { target: String },

    #[error(
        "the database at {target} has schema version {found}, newer than this orch binary supports ({supported}); upgrade orch"
    )]
    SchemaTooNew {
        target: String,
        found: i64,
        supported: i64,
    },

    #[error(
        "the database at {target} has schema version {found}, older than this orch binary needs ({supported}); run `orch migrate`"
    )]
    SchemaTooOld {
        target: String,
        found: i64,
        supported: i64,
    },

    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
}

impl StoreError {
    /// True when the database itself cannot be reached or used right now (down, dropped,
    /// unreadable, out of connections): the API answers 503 for these, not 500.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Connect { .. } => true,
            StoreError::Db(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => true,
                sqlx::Error::Database(db) => {
                    let code = db.code().unwrap_or_default();
                    // PostgreSQL: class 08 (connection), 57P0x (shutdown, cannot connect now),
                    // 3D000 (the database does not exist), 53300 (too many connections).
                    code.starts_with("08")
                        || code.starts_with("57P0")
                        || code == "3D000"
                        || code == "53300"
                        // SQLite (primary code of the extended one): CANTOPEN, IOERR,
                        // NOTADB, READONLY, BUSY, PERM, CORRUPT.
                        || code.parse::<i64>().is_ok_and(|c| {
                            matches!(c & 0xff, 3 | 5 | 8 | 10 | 11 | 14 | 26)
                        })
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// True for errors that a retry may cure (connection loss, lock timeouts, serialization).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Db(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed => true,
                sqlx::Error::Database(db) => {
                    let code = db.code();
                    matches!(
                        code.as_deref(),
                        // PostgreSQL: serialization failure, deadlock, admin shutdown, too many connections.
                        Some("40001" | "40P01" | "57P01" | "53300")
                        // SQLite: SQLITE_BUSY, SQLITE_LOCKED.
                        | Some("5" | "6" | "261" | "517")
                    )
                }
                _ => false,
            },
            _ => false,
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Hides the password of a database URL for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn redacts_passwords_only() {
        for (input, want) in [
            (
                "postgres://u:secret@h:5432/db",
                "postgres://u:***@h:5432/db",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("sqlite://.orch/orch.db", "sqlite://.orch/orch.db"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(input), want, "{input}");
        }
    }
}
