//! The HTTP endpoint every component serves: `/metrics` (Prometheus text format), `/healthz` (the process is
//! alive, and its own [`Liveness`] check passes) and `/readyz` (the component is ready; the body says why not).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// Errors of the telemetry server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("bind the metrics and health endpoint to {addr} (is the port in use? choose another address)")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serve the metrics and health endpoint")]
    Serve(#[source] std::io::Error),
}

/// Readiness, set by the component: `Ok(())` when ready, `Err(reason)` otherwise.
#[derive(Clone, Debug)]
pub struct Readiness(Arc<Mutex<Result<(), String>>>);

impl Readiness {
    pub fn not_ready(reason: impl Into<String>) -> Self {
        Self(Arc::new(Mutex::new(Err(reason.into()))))
    }

    pub fn set(&self, state: Result<(), String>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = state;
    }

    pub fn get(&self) -> Result<(), String> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

type Check = Arc<dyn Fn() -> futures::future::BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// What `/healthz` checks beyond the process answering HTTP (e.g. that the node agent's gRPC sockets answer);
/// settable later, because some checks only make sense once their subject exists.
#[derive(Clone, Default)]
pub struct Liveness(Arc<Mutex<Option<Check>>>);

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Liveness")
    }
}

impl Liveness {
    /// From now on `/healthz` fails with the check's reason when it fails.
    pub fn set(
        &self,
        check: impl Fn() -> futures::future::BoxFuture<'static, Result<(), String>> + Send + Sync + 'static,
    ) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(check));
    }

    async fn check(&self) -> Result<(), String> {
        let check = self.0.lock().unwrap_or_else(PoisonError::into_inner).clone();
        match check {
            Some(check) => check().await,
            None => Ok(()),
        }
    }
}

#[derive(Clone)]
struct AppState {
    registry: Arc<Registry>,
    readiness: Readiness,
    liveness: Liveness,
}

/// Binds `addr` now (so a bad address fails start-up) and returns the server future, which runs until `stop`.
pub async fn bind(
    addr: SocketAddr,
    registry: Arc<Registry>,
    readiness: Readiness,
    liveness: Liveness,
    stop: CancellationToken,
) -> Result<(SocketAddr, impl Future<Output = Result<(), ServerError>>), ServerError> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| ServerError::Bind { addr, source })?;
    let local = listener.local_addr().map_err(|source| ServerError::Bind { addr, source })?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { registry, readiness, liveness });
    let serve = async move {
        axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await.map_err(ServerError::Serve)
    };
    Ok((local, serve))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            body,
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "encoding metrics failed".to_string(),
        ),
    }
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    match state.liveness.check().await {
        Ok(()) => (StatusCode::OK, "ok".to_string()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("unhealthy: {reason}")),
    }
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    match state.readiness.get() {
        Ok(()) => (StatusCode::OK, "ok".to_string()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}")),
    }
}
