//! Schema migrations: one folder per backend, embedded in the binary. The applied versions are
//! recorded as `events` rows of kind `schema.migrated` (the schema has exactly four tables, so
//! there is no migrations table).

use crate::error::{Result, StoreError};

/// One migration: its version, name and SQL for one backend.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

pub const SQLITE: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_init",
        sql: include_str!("../migrations/sqlite/0001_init.sql"),
    },
    Migration {
        version: 2,
        name: "0002_active_views",
        sql: include_str!("../migrations/sqlite/0002_active_views.sql"),
    },
];

pub const POSTGRES: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_init",
        sql: include_str!("../migrations/postgres/0001_init.sql"),
    },
    Migration {
        version: 2,
        name: "0002_active_views",
        sql: include_str!("../migrations/postgres/0002_active_views.sql"),
    },
];

/// The schema version this binary was built for.
pub const SCHEMA_VERSION: i64 = 2;

/// What `migrate` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateReport {
    pub from: i64,
    pub to: i64,
    pub applied: Vec<String>,
}

/// Reads the version out of a `schema.migrated` event's data (`{"version": N, …}`).
pub fn version_of(data: &str) -> Option<i64> {
    serde_json::from_str::<serde_json::Value>(data)
        .ok()?
        .get("version")?
        .as_i64()
}

pub fn event_data(m: &Migration) -> String {
    serde_json::json!({ "version": m.version, "name": m.name }).to_string()
}

/// Migrations still to apply at version `from`; an error when the database is newer.
pub fn pending(
    all: &'static [Migration],
    target: &str,
    from: i64,
) -> Result<Vec<&'static Migration>> {
    if from > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            target: target.to_owned(),
            found: from,
            supported: SCHEMA_VERSION,
        });
    }
    Ok(all.iter().filter(|m| m.version > from).collect())
}

pub fn check_version(target: &str, found: i64) -> Result<()> {
    match found {
        0 => Err(StoreError::NotMigrated {
            target: target.to_owned(),
        }),
        v if v > SCHEMA_VERSION => Err(StoreError::SchemaTooNew {
            target: target.to_owned(),
            found: v,
            supported: SCHEMA_VERSION,
        }),
        v if v < SCHEMA_VERSION => Err(StoreError::SchemaTooOld {
            target: target.to_owned(),
            found: v,
            supported: SCHEMA_VERSION,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_in_order_on_both_backends() {
        for all in [SQLITE, POSTGRES] {
            for (i, m) in all.iter().enumerate() {
                assert_eq!(m.version, i as i64 + 1, "{}", m.name);
            }
            assert_eq!(all.last().map(|m| m.version), Some(SCHEMA_VERSION));
        }
        assert_eq!(SQLITE.len(), POSTGRES.len());
    }

    #[test]
    fn versions_are_read_from_event_data() {
        assert_eq!(version_of(r#"{"version":3,"name":"x"}"#), Some(3));
        assert_eq!(version_of("not json"), None);
        assert_eq!(version_of("{}"), None);
    }

    #[test]
    fn a_newer_database_is_refused() {
        assert!(matches!(
            pending(SQLITE, "t", SCHEMA_VERSION + 1),
            Err(StoreError::SchemaTooNew { .. })
        ));
        assert!(matches!(
            check_version("t", 0),
            Err(StoreError::NotMigrated { .. })
        ));
        assert!(check_version("t", SCHEMA_VERSION).is_ok());
    }
}
