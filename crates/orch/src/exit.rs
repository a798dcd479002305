//! Exit codes and the error a failed command prints. Every error ends the process with one of
//! a few documented codes (sysexits(3) values where one fits), and under `--json` it is printed
//! on stdout in the HTTP API's error shape `{"error": {"code", "message"}}` (the API's own
//! `ErrorBody` type), so scripts handle both the same way.
//!
//! | exit | code          | meaning                                                        |
//! |------|---------------|----------------------------------------------------------------|
//! | 0    |               | success                                                        |
//! | 1    | `failed`      | the command ran and its result is a failure, or an unexpected error |
//! | 2    | `usage`/`invalid` | bad arguments or input (unknown flag, malformed id, empty title) |
//! | 66   | `not_found`   | no such work item (or repo)                                    |
//! | 69   | `unavailable` | the database cannot be reached, is not initialized or migrated |
//! | 75   | `conflict`    | the task is not in a state that allows it; look again and retry |
//! | 78   | `config`      | `orch.toml` is missing or invalid (file, line, section and key named) |

use std::process::ExitCode;

use orch_domain::config::ConfigError;
use orch_domain::ids::IdError;
use orch_runner::ops::OpsError;
use orch_store::StoreError;

/// What kind of failure ended a command; decides the exit code and the JSON `code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Failed,
    Usage,
    Invalid,
    NotFound,
    Unavailable,
    Conflict,
    Config,
}

impl Kind {
    /// The process exit code.
    pub fn exit_code(self) -> u8 {
        match self {
            Kind::Failed => 1,
            Kind::Usage | Kind::Invalid => 2,
            Kind::NotFound => 66,
            Kind::Unavailable => 69,
            Kind::Conflict => 75,
            Kind::Config => 78,
        }
    }

    /// The `code` of the JSON error (the API's codes where they mean the same).
    pub fn code(self) -> &'static str {
        match self {
            Kind::Failed => "failed",
            Kind::Usage => "usage",
            Kind::Invalid => "invalid",
            Kind::NotFound => "not_found",
            Kind::Unavailable => "unavailable",
            Kind::Conflict => "conflict",
            Kind::Config => "config",
        }
    }
}

/// The exit code table for `--help`.
pub const HELP: &str = "Exit codes: 0 success; 1 failed (the result is a failure, or an unexpected error); \
2 usage or invalid input; 66 not found; 69 unavailable (database unreachable, not initialized); \
75 conflict (the task's state does not allow it; look again and retry); 78 config (orch.toml missing or invalid).
With --json, errors are printed on stdout as {\"error\":{\"code\",\"message\"}}.
Colour only on a terminal and never with NO_COLOR set.";

/// An error of a known kind raised by the CLI itself.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub kind: Kind,
    pub message: String,
}

/// An error of `kind` with `message`.
pub fn fail(kind: Kind, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Failure {
        kind,
        message: message.into(),
    })
}

/// The kind of `e`: the first cause in its chain that says.
pub fn classify(e: &anyhow::Error) -> Kind {
    for cause in e.chain() {
        if let Some(f) = cause.downcast_ref::<Failure>() {
            return f.kind;
        }
        if cause.downcast_ref::<ConfigError>().is_some() {
            return Kind::Config;
        }
        if cause.downcast_ref::<IdError>().is_some() {
            return Kind::Invalid;
        }
        if let Some(op) = cause.downcast_ref::<OpsError>() {
            match op {
                OpsError::NotFound(_) => return Kind::NotFound,
                OpsError::Conflict(_) => return Kind::Conflict,
                OpsError::Invalid(_) => return Kind::Invalid,
                OpsError::Internal(_) => {}
            }
        }
        if let Some(s) = cause.downcast_ref::<StoreError>() {
            return match s {
                StoreError::TaskNotFound(_) | StoreError::JobNotFound(_) => Kind::NotFound,
                StoreError::StageConflict { .. } | StoreError::WorkItemTaken(_) => Kind::Conflict,
                StoreError::Invalid(_) => Kind::Invalid,
                StoreError::BadUrl { .. } => Kind::Config,
                StoreError::Connect { .. }
                | StoreError::NotMigrated { .. }
                | StoreError::SchemaTooOld { .. }
                | StoreError::SchemaTooNew { .. } => Kind::Unavailable,
                s if s.is_transient() => Kind::Unavailable,
                _ => Kind::Failed,
            };
        }
    }
    Kind::Failed
}

/// Prints `e` (JSON on stdout under `json`, else `orch: error: …` on stderr) and returns the
/// exit code of its kind.
pub fn report(e: &anyhow::Error, json: bool) -> ExitCode {
    report_kind(classify(e), &format!("{e:#}"), json)
}

/// Prints an error of `kind` and returns its exit code.
pub fn report_kind(kind: Kind, message: &str, json: bool) -> ExitCode {
    if json {
        crate::output::print_json_str(&error_json(kind, message));
    } else {
        crate::say(&format!("orch: error: {message}"));
    }
    ExitCode::from(kind.exit_code())
}

/// `{"error":{"code","message"}}` through the API's own type.
pub fn error_json(kind: Kind, message: &str) -> String {
    let body = orch_api::ErrorBody {
        error: orch_api::ErrorDetail {
            code: kind.code(),
            message: message.to_owned(),
        },
    };
    serde_json::to_string(&body).unwrap_or_else(|_| {
        format!(
            "{{\"error\":{{\"code\":\"{}\",\"message\":\"(unprintable)\"}}}}",
            kind.code()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_map_to_distinct_documented_codes() {
        assert_eq!(classify(&fail(Kind::NotFound, "x")).exit_code(), 66);
        let conflict = anyhow::Error::new(OpsError::Conflict("busy".into()));
        assert_eq!(classify(&conflict), Kind::Conflict);
        let config = anyhow::Error::new(ConfigError::Invalid {
            section: "settings".into(),
            key: "workers".into(),
            reason: "0".into(),
        })
        .context("invalid config orch.toml");
        assert_eq!(classify(&config).exit_code(), 78);
        let down = anyhow::Error::new(StoreError::Connect {
            target: "db".into(),
            reason: "refused".into(),
        });
        assert_eq!(classify(&down).exit_code(), 69);
        assert_eq!(classify(&anyhow::anyhow!("boom")).exit_code(), 1);
        let v: serde_json::Value =
            serde_json::from_str(&error_json(Kind::Conflict, "a \"quoted\" reason")).unwrap();
        assert_eq!(v["error"]["code"], "conflict");
        assert_eq!(v["error"]["message"], "a \"quoted\" reason");
    }
}
