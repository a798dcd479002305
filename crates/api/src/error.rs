//! One error type for every JSON route: each failure becomes `{"error": {"code", "message"}}`
//! with the matching status, whether it came from a handler, an extractor (bad JSON, bad query,
//! oversized body) or a bare status produced by a layer (timeout, 405).

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::dto::{ErrorBody, ErrorDetail};
use crate::ops::OpError;

/// An error answer of the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable machine-readable code (`invalid_id`, `unauthorized`, …).
    pub code: &'static str,
    /// A sentence for humans.
    pub message: String,
}

impl AppError {
    /// Builds an error from its parts.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        AppError {
            status,
            code,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        AppError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        AppError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        AppError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid", message)
    }

    /// The store could not answer: 503, logged.
    pub(crate) fn store(what: &str, e: &orch_store::StoreError) -> Self {
        tracing::warn!(error = %e, "store query for {what} failed");
        AppError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            format!("the store could not answer ({what}): {e}"),
        )
    }

    /// The error for a status that a layer produced without a body.
    pub(crate) fn from_status(status: StatusCode) -> Self {
        let (code, message) = match status {
            StatusCode::NOT_FOUND => ("not_found", "no such route"),
            StatusCode::METHOD_NOT_ALLOWED => {
                ("method_not_allowed", "this method is not allowed here")
            }
            StatusCode::REQUEST_TIMEOUT => ("timeout", "the request took too long"),
            StatusCode::PAYLOAD_TOO_LARGE => (
                "payload_too_large",
                "the request body is larger than the limit",
            ),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => (
                "unsupported_media_type",
                "send the body as Content-Type: application/json",
            ),
            s if s.is_server_error() => ("internal", "the server failed to answer"),
            _ => ("bad_request", "the request was refused"),
        };
        AppError::new(status, code, message)
    }
}

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl std::error::Error for AppError {}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(code = self.code, "{}", self.message);
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
            },
        };
        let mut resp = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

impl From<OpError> for AppError {
    fn from(e: OpError) -> Self {
        match e {
            OpError::NotFound(m) => AppError::not_found(m),
            OpError::Conflict(m) => AppError::new(StatusCode::CONFLICT, "conflict", m),
            OpError::Invalid(m) => AppError::invalid(m),
            OpError::Internal(m) => AppError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", m),
            OpError::Unauthorized(m) => AppError::new(StatusCode::UNAUTHORIZED, "bad_signature", m),
            OpError::Unavailable(m) => AppError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                format!("the database is unavailable; try again later ({m})"),
            ),
        }
    }
}

impl From<JsonRejection> for AppError {
    fn from(rej: JsonRejection) -> Self {
        let status = rej.status();
        let code = match &rej {
            JsonRejection::JsonDataError(_) => "invalid_json",
            JsonRejection::JsonSyntaxError(_) => "bad_json",
            JsonRejection::MissingJsonContentType(_) => "unsupported_media_type",
            _ if status == StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
            _ => "bad_request",
        };
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!(
                "the request body is larger than the {} KiB limit",
                crate::BODY_LIMIT / 1024
            )
        } else {
            without_rust_types(&rej.body_text())
        };
        AppError::new(status, code, message)
    }
}

/// serde names the Rust type it expected (`expected struct SubmitBody`); clients know a JSON
/// object, not our types.
fn without_rust_types(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("struct ") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "struct ".len()..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        if name_len == 0 {
            out.push_str("struct ");
        } else {
            out.push_str("a JSON object");
        }
        rest = &after[name_len..];
    }
    out.push_str(rest);
    out.replace(
        "Failed to deserialize the JSON body into the target type: ",
        "",
    )
}

impl From<QueryRejection> for AppError {
    fn from(rej: QueryRejection) -> Self {
        AppError::bad_request(rej.body_text())
    }
}

impl From<PathRejection> for AppError {
    fn from(rej: PathRejection) -> Self {
        AppError::new(StatusCode::BAD_REQUEST, "invalid_id", rej.body_text())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn messages_name_no_rust_type() {
        for (input, want) in [
            (
                "Failed to deserialize the JSON body into the target type: invalid type: string \"x\", expected struct SubmitBody at line 1 column 3",
                "invalid type: string \"x\", expected a JSON object at line 1 column 3",
            ),
            ("missing field `title`", "missing field `title`"),
            ("a struct  b", "a struct  b"),
        ] {
            assert_eq!(super::without_rust_types(input), want);
        }
    }
}
