//! Timestamps in artifacts: RFC 3339 UTC from epoch milliseconds (the store's clock).

/// `2026-11-29T20:00:00Z` for `ms` since the epoch.
pub fn rfc3339(ms: i64) -> String {
    orch_domain::staging::rfc3339_utc(ms)
}
