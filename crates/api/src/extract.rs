//! Extractors whose failures use the API's error shape: axum's own `Json` and `Query` answer a
//! bad body or query with plain text; these wrap them and answer with [`AppError`]. And
//! [`Caller`]: who makes a call, for the event it records.

use std::net::SocketAddr;

use axum::Json;
use axum::extract::{ConnectInfo, FromRequest, FromRequestParts, Query, Request};
use axum::http::header;
use axum::http::request::Parts;
use orch_domain::control::actor::Actor;
use serde::de::DeserializeOwned;

use crate::error::AppError;

/// A JSON body; bad JSON, a wrong content type or an oversized body becomes an [`AppError`].
#[derive(Debug)]
pub(crate) struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Json(value) = Json::<T>::from_request(req, state).await?;
        Ok(ApiJson(value))
    }
}

/// A query string; a malformed one becomes an [`AppError`].
#[derive(Debug)]
pub(crate) struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Query(value) = Query::<T>::from_request_parts(parts, state).await?;
        Ok(ApiQuery(value))
    }
}

/// Who makes a mutating call: the API with the token (every mutating route needs it), from
/// the TCP peer the server saw (when served with connect info, as [`crate::serve`] does) and
/// with the `User-Agent` the client sent (escaped and bounded by [`Actor::api`]). Never fails.
#[derive(Debug, Clone)]
pub(crate) struct Caller(pub Actor);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.to_string());
        let agent = parts
            .headers
            .get(header::USER_AGENT)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        Ok(Caller(Actor::api(peer, agent.as_deref())))
    }
}
