//! The agent's HTTP endpoints, served by hyper's HTTP/1 server, one request per connection:
//! `/healthz`, `/readyz` and `/metrics` on localhost (`--http`), and optionally `/metrics` alone on
//! the node's address for Prometheus (`--metrics`), so that health is never exposed off the node.
//!
//! A client cannot hold the agent's resources: a connection whose request head has not arrived
//! within [`HEADER_READ_TIMEOUT`] is closed, none lives longer than [`CONNECTION_DEADLINE`]
//! (a client that stops reading its response), and at most [`MAX_CONNECTIONS`] are served at once;
//! further clients wait in the listen backlog until one ends.

use std::{convert::Infallible, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    body::Incoming, header, server::conn::http1, service::service_fn, Method, Request, Response,
    StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::Semaphore,
};
use tracing::{debug, warn};

use super::{metrics, Agent};

/// How long a client has to send its request line and headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection lives, response included.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(30);
/// Connections served at once: far more than the kubelet's probes and a scraper need.
const MAX_CONNECTIONS: usize = 64;

/// What one listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    All,
    MetricsOnly,
}

/// Accepts and serves connections on `listener` until the runtime stops.
pub async fn serve(agent: Arc<Agent>, listener: TcpListener, endpoints: Endpoints) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        // Take a slot before accepting, so that extra clients wait in the backlog rather than
        // holding a task and a descriptor here.
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        match listener.accept().await {
            Ok((stream, _)) => {
                let agent = Arc::clone(&agent);
                tokio::spawn(async move {
                    serve_connection(agent, stream, endpoints).await;
                    drop(slot);
                });
            }
            Err(e) => {
                // Out of descriptors, most likely: pause rather than spin on the error.
                warn!(error = %e, "accept on the HTTP port");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn serve_connection(agent: Arc<Agent>, stream: TcpStream, endpoints: Endpoints) {
    let service = service_fn(move |req| respond(Arc::clone(&agent), req, endpoints));
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout(CONNECTION_DEADLINE, connection).await {
        Ok(Ok(())) => {}
        // A client that sent nothing or half a request in time, or went away: routine.
        Ok(Err(e)) => debug!(error = %e, "HTTP connection"),
        Err(_) => debug!("HTTP connection dropped after {CONNECTION_DEADLINE:?}"),
    }
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Health,
    Ready,
    Metrics,
    NotFound,
    MethodNotAllowed,
}

fn route(method: &Method, path: &str, endpoints: Endpoints) -> Route {
    if method != Method::GET {
        return Route::MethodNotAllowed;
    }
    match (path, endpoints) {
        ("/metrics", _) => Route::Metrics,
        ("/healthz", Endpoints::All) => Route::Health,
        ("/readyz", Endpoints::All) => Route::Ready,
        _ => Route::NotFound,
    }
}

async fn respond(
    agent: Arc<Agent>,
    req: Request<Incoming>,
    endpoints: Endpoints,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(match route(req.method(), req.uri().path(), endpoints) {
        Route::Health => text(StatusCode::OK, "ok\n"),
        Route::Ready => match agent.node_readiness() {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        Route::Metrics => match agent.render_metrics().await {
            Ok(body) => with_type(StatusCode::OK, metrics::CONTENT_TYPE, body),
            Err(e) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("encoding the metrics failed: {e}\n"),
            ),
        },
        Route::NotFound if endpoints == Endpoints::MetricsOnly => {
            text(StatusCode::NOT_FOUND, "only /metrics here\n")
        }
        Route::NotFound => text(StatusCode::NOT_FOUND, "try /healthz, /readyz or /metrics\n"),
        Route::MethodNotAllowed => {
            let mut resp = text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
            resp.headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static("GET"));
            resp
        }
    })
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    with_type(status, "text/plain; charset=utf-8", body)
}

fn with_type(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_get_only_and_fixed() {
        for (method, path, want) in [
            (Method::GET, "/healthz", Route::Health),
            (Method::GET, "/readyz", Route::Ready),
            (Method::GET, "/metrics", Route::Metrics),
            (Method::GET, "/metrics/", Route::NotFound),
            (Method::GET, "/", Route::NotFound),
            (Method::HEAD, "/healthz", Route::MethodNotAllowed),
            (Method::POST, "/metrics", Route::MethodNotAllowed),
        ] {
            assert_eq!(
                route(&method, path, Endpoints::All),
                want,
                "{method} {path}"
            );
        }
    }

    #[test]
    fn the_metrics_listener_serves_metrics_only() {
        for (path, want) in [
            ("/metrics", Route::Metrics),
            ("/healthz", Route::NotFound),
            ("/readyz", Route::NotFound),
        ] {
            assert_eq!(
                route(&Method::GET, path, Endpoints::MetricsOnly),
                want,
                "{path}"
            );
        }
    }
}
