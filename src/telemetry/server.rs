//! The HTTP endpoint every component serves: `/metrics` (Prometheus text format), `/healthz` (the process is
//! alive, and its own [`Liveness`] check passes) and `/readyz` (the component is ready; the body says why not).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
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
    let listener = listen(addr).map_err(|source| ServerError::Bind { addr, source })?;
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

/// A listener on `addr`. The IPv4 wildcard `0.0.0.0` (the default) listens on every address, IPv6 too, as Go's
/// listeners do with it (kube-controller-manager's `--bind-address`): the kubelet probes a Pod and Prometheus scrapes
/// it at the Pod's IP, which is IPv6 on single-stack IPv6 and IPv6-first clusters. A node without IPv6 gets the
/// IPv4 wildcard alone.
fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    if addr.ip() == IpAddr::V4(Ipv4Addr::UNSPECIFIED) {
        match dual_stack(addr.port()) {
            Ok(listener) => return tokio::net::TcpListener::from_std(listener),
            // Taken on IPv6 is taken on IPv4 too (a dual-stack socket holds both).
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => return Err(e),
            Err(e) => tracing::info!(error = %e, "no IPv6 here; listening on IPv4 only"),
        }
    }
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    ready_to_listen(socket, addr).and_then(tokio::net::TcpListener::from_std)
}

/// `[::]:port` with IPv4 mapped in (IPV6_V6ONLY off, whatever the node's `net.ipv6.bindv6only`).
fn dual_stack(port: u16) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None)?;
    socket.set_only_v6(false)?;
    ready_to_listen(socket, SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
}

/// Binds and listens as tokio's own `TcpListener::bind` does (SO_REUSEADDR, non-blocking, the standard library's
/// backlog of 128).
fn ready_to_listen(socket: socket2::Socket, addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    Ok(socket.into())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The default wildcard answers over IPv4 and IPv6 (a Pod's IP on an IPv6 cluster), on the port it took; a
    /// named address only there.
    #[tokio::test]
    async fn the_ipv4_wildcard_listens_on_ipv6_too() -> std::io::Result<()> {
        let any = listen(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)))?;
        let port = any.local_addr()?.port();
        // Where the machine has no IPv6 (a container with it off), the fallback is what is tested: IPv4 alone.
        let ipv6 = std::net::TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).is_ok();
        let loopbacks = if ipv6 {
            vec![IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)]
        } else {
            eprintln!("no IPv6 on this machine: testing the IPv4 fallback");
            vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]
        };
        for ip in loopbacks {
            tokio::net::TcpStream::connect((ip, port)).await?;
            any.accept().await?;
        }
        let loopback = listen(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
        let port = loopback.local_addr()?.port();
        assert!(tokio::net::TcpStream::connect((Ipv6Addr::LOCALHOST, port)).await.is_err());
        // A port taken stays an error, not a quiet fall back.
        let taken = any.local_addr()?.port();
        let error = listen(SocketAddr::from((Ipv4Addr::UNSPECIFIED, taken))).err();
        assert_eq!(error.map(|e| e.kind()), Some(std::io::ErrorKind::AddrInUse));
        Ok(())
    }
}
