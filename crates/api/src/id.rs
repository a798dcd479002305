//! Work item ids arriving in URLs are hostile until checked: this is the one place that decides
//! what a valid id looks like at the HTTP edge (to be swapped for the domain's `WorkItemId` type),
//! plus the path extractor that applies it before any handler sees the id.

use axum::extract::{FromRequestParts, Path};
use axum::http::StatusCode;
use axum::http::request::Parts;

use crate::error::AppError;

/// Longest prefix (letters/digits after the first letter) of a work item id.
const MAX_PREFIX: usize = 16;
/// Most digits of a work item number.
const MAX_DIGITS: usize = 10;

/// Checks a work item id against `^[A-Z][A-Z0-9]{0,15}-[1-9][0-9]{0,9}$`.
/// Returns a sentence saying what is wrong otherwise.
pub fn validate_work_item_id(id: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "work item id {:?} is not valid: {why}; expected PREFIX-NUMBER such as ORCH-115",
            shorten(id)
        ))
    };
    let Some((prefix, number)) = id.split_once('-') else {
        return bad("it has no '-'");
    };
    let mut p = prefix.bytes();
    match p.next() {
        Some(b) if b.is_ascii_uppercase() => {}
        _ => return bad("the prefix must start with an uppercase letter A-Z"),
    }
    if prefix.len() > MAX_PREFIX {
        return bad("the prefix is longer than 16 characters");
    }
    if !p.all(|b| b.is_ascii_uppercase() || b.is_ascii_digit()) {
        return bad("the prefix may hold only A-Z and 0-9");
    }
    let mut n = number.bytes();
    match n.next() {
        Some(b) if (b'1'..=b'9').contains(&b) => {}
        _ => return bad("the number must start with a digit 1-9"),
    }
    if number.len() > MAX_DIGITS {
        return bad("the number is longer than 10 digits");
    }
    if !n.all(|b| b.is_ascii_digit()) {
        return bad("the number may hold only digits");
    }
    Ok(())
}

/// A bounded, printable rendering of untrusted input for error messages.
fn shorten(s: &str) -> String {
    const MAX: usize = 64;
    if s.chars().count() <= MAX {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(MAX).collect();
        out.push('…');
        out
    }
}

/// A validated work item id taken from the `{id}` path segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkItemPath(pub String);

impl<S: Send + Sync> FromRequestParts<S> for WorkItemPath {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, state).await?;
        validate_work_item_id(&id)
            .map_err(|m| AppError::new(StatusCode::BAD_REQUEST, "invalid_id", m))?;
        Ok(WorkItemPath(id))
    }
}

#[cfg(test)]
mod tests {
    use super::validate_work_item_id;

    fn check(id: &str, valid: bool) {
        let got = validate_work_item_id(id);
        assert_eq!(got.is_ok(), valid, "{id:?} -> {got:?}");
        if let Err(msg) = got {
            assert!(msg.contains("PREFIX-NUMBER"), "{msg}");
        }
    }

    #[test]
    fn ids() {
        for (id, valid) in [
            ("ORCH-115", true),
            ("A-1", true),
            ("X9-1234567890", true),
            ("ABCDEFGHIJKLMNOP-1", true),
            ("ABCDEFGHIJKLMNOPQ-1", false),
            ("X-12345678901", false),
            ("ORCH-0", false),
            ("ORCH-01", false),
            ("orch-1", false),
            ("9RCH-1", false),
            ("ORCH-", false),
            ("-1", false),
            ("ORCH1", false),
            ("ORCH-1-2", false),
            ("ORCH-1a", false),
            ("../../etc/passwd", false),
            ("..%2F..", false),
            ("ORCH-1/../x", false),
            ("ORCH-1\0", false),
            ("ORCH-1 ", false),
            ("ÖRCH-1", false),
            ("ORCH-١", false),
            ("", false),
        ] {
            check(id, valid);
        }
    }

    #[test]
    fn long_hostile_input_is_shortened_in_the_message() {
        let id = "A".repeat(10_000);
        let msg = validate_work_item_id(&id).unwrap_err();
        assert!(msg.len() < 300, "{}", msg.len());
    }
}
