//! Bearer-token guard for mutating calls. Closed by default: without a configured token every
//! mutating call is refused. The comparison takes the same time wherever the first difference
//! is, and the token never appears in logs or messages.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::ApiState;
use crate::error::AppError;

/// Middleware over the whole router: every method other than GET, HEAD and OPTIONS is a
/// mutating call and needs the token, so a new mutating route cannot be left open by mistake.
pub(crate) async fn require_token(
    State(state): State<ApiState>,
    req: Request,
    next: Next,
) -> Response {
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(req).await;
    }
    // A forge's webhook cannot carry orch's token: its deliveries are signed instead, and the
    // one handler under this prefix refuses (401) a delivery whose signature does not hold.
    if *req.method() == Method::POST && req.uri().path().starts_with(crate::WEBHOOK_PREFIX) {
        // Nobody without the token gets a body read (up to a MiB) before the delivery at
        // least looks signed: a flood of unsigned posts is refused from its headers.
        if let Err(why) = looks_signed(req.headers()) {
            tracing::warn!(path = %req.uri().path(), "refused an unsigned webhook delivery");
            return AppError::new(StatusCode::UNAUTHORIZED, "bad_signature", why).into_response();
        }
        return next.run(req).await;
    }
    if let Err(e) = same_origin(req.headers()) {
        tracing::warn!(method = %req.method(), path = %req.uri().path(), "refused a cross-site call");
        return e.into_response();
    }
    match check(state.token.as_deref(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => {
            tracing::warn!(
                method = %req.method(),
                path = %req.uri().path(),
                code = e.code,
                "refused a mutating call"
            );
            e.into_response()
        }
    }
}

/// Whether a webhook delivery carries a well-formed `X-Hub-Signature-256` (`sha256=` and 64
/// hex digits). Its check against the body is the handler's; this only spares reading the
/// body of a delivery that cannot pass it.
fn looks_signed(headers: &HeaderMap) -> Result<(), String> {
    let value = headers
        .get("x-hub-signature-256")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    match value.strip_prefix("sha256=") {
        Some(hex) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(()),
        _ => Err(
            "the delivery carries no well-formed X-Hub-Signature-256 (sha256=<64 hex digits>)"
                .to_owned(),
        ),
    }
}

/// Refuses a mutating call a browser says comes from another site: `Sec-Fetch-Site` other
/// than `same-origin`/`none`, or an `Origin` whose host is not the `Host` asked for. Clients
/// that are not browsers send neither and are judged by the token alone. The bearer token is
/// what really protects (a browser never attaches it by itself, unlike a cookie); this check
/// keeps a page on another site from replaying a token it somehow learned through a
/// user's browser, and documents the intent.
fn same_origin(headers: &HeaderMap) -> Result<(), AppError> {
    let refuse = |why: String| Err(AppError::new(StatusCode::FORBIDDEN, "cross_site", why));
    if let Some(site) = headers.get("sec-fetch-site") {
        let site = site.to_str().unwrap_or("invalid");
        if !matches!(site, "same-origin" | "none") {
            return refuse(format!(
                "a browser sent this call from another site (Sec-Fetch-Site: {site}); \
                 use the dashboard of this server or a non-browser client"
            ));
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let origin_host = origin
            .split_once("://")
            .map(|(_, rest)| rest.trim_end_matches('/'))
            .unwrap_or("");
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if origin_host.is_empty() || !origin_host.eq_ignore_ascii_case(host) {
            return refuse(format!(
                "the call's Origin {origin:?} is not this server ({host:?})"
            ));
        }
    }
    Ok(())
}

fn check(configured: Option<&str>, headers: &HeaderMap) -> Result<(), AppError> {
    let Some(expected) = configured.filter(|t| !t.is_empty()) else {
        return Err(AppError::new(
            StatusCode::FORBIDDEN,
            "no_token_configured",
            "mutating calls are disabled because this server has no API token configured; \
             set an API token for the server and send it as `Authorization: Bearer <token>`",
        ));
    };
    let unauthorized = |m: &str| Err(AppError::new(StatusCode::UNAUTHORIZED, "unauthorized", m));
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return unauthorized("this call needs `Authorization: Bearer <token>`");
    };
    let Some(given) = value
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
    else {
        return unauthorized("the Authorization header must be `Bearer <token>`");
    };
    if constant_time_eq(expected.as_bytes(), given.as_bytes()) {
        Ok(())
    } else {
        unauthorized("the bearer token is not valid")
    }
}

/// Compares `given` with `expected` in time that depends only on their lengths, never on where
/// they first differ.
fn constant_time_eq(expected: &[u8], given: &[u8]) -> bool {
    let mut diff = u64::from(expected.len() != given.len());
    for (i, e) in expected.iter().enumerate() {
        let g = given.get(i).copied().unwrap_or(0);
        diff |= u64::from(std::hint::black_box(e ^ g));
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn check_case(configured: Option<&str>, header: Option<&str>, want: Option<u16>) {
        let mut headers = HeaderMap::new();
        if let Some(h) = header {
            headers.insert(header::AUTHORIZATION, HeaderValue::from_str(h).unwrap());
        }
        let got = check(configured, &headers).err().map(|e| {
            assert!(
                !e.message.contains("s3cret"),
                "the token leaked: {}",
                e.message
            );
            e.status.as_u16()
        });
        assert_eq!(got, want, "configured={configured:?} header={header:?}");
    }

    #[test]
    fn token_checks() {
        for (configured, header, want) in [
            (None, Some("Bearer s3cret"), Some(403)),
            (Some(""), Some("Bearer "), Some(403)),
            (Some("s3cret"), None, Some(401)),
            (Some("s3cret"), Some("Bearer wrong"), Some(401)),
            (Some("s3cret"), Some("Bearer s3cre"), Some(401)),
            (Some("s3cret"), Some("Bearer s3cretX"), Some(401)),
            (Some("s3cret"), Some("Basic s3cret"), Some(401)),
            (Some("s3cret"), Some("s3cret"), Some(401)),
            (Some("s3cret"), Some("Bearer s3cret"), None),
            (Some("s3cret"), Some("bearer s3cret"), None),
        ] {
            check_case(configured, header, want);
        }
    }

    #[test]
    fn cross_site_calls_are_refused() {
        for (headers, ok) in [
            (vec![], true),
            (vec![("sec-fetch-site", "same-origin")], true),
            (vec![("sec-fetch-site", "none")], true),
            (vec![("sec-fetch-site", "cross-site")], false),
            (vec![("sec-fetch-site", "same-site")], false),
            (
                vec![
                    ("origin", "http://127.0.0.1:7878"),
                    ("host", "127.0.0.1:7878"),
                ],
                true,
            ),
            (
                vec![
                    ("origin", "http://evil.example"),
                    ("host", "127.0.0.1:7878"),
                ],
                false,
            ),
            (vec![("origin", "null"), ("host", "127.0.0.1:7878")], false),
        ] {
            let mut h = HeaderMap::new();
            for (k, v) in &headers {
                h.insert(*k, HeaderValue::from_str(v).unwrap());
            }
            assert_eq!(same_origin(&h).is_ok(), ok, "{headers:?}");
        }
    }

    #[test]
    fn constant_time_eq_is_equality() {
        for (a, b, eq) in [
            ("", "", true),
            ("a", "", false),
            ("", "a", false),
            ("abc", "abc", true),
            ("abc", "abd", false),
            ("abc", "abc\0", false),
        ] {
            assert_eq!(
                constant_time_eq(a.as_bytes(), b.as_bytes()),
                eq,
                "{a:?} {b:?}"
            );
        }
    }
}
