//! The HTTP endpoint every component serves: `/metrics` (Prometheus text format), `/healthz` (the process is
//! alive, and its own [`Liveness`] check passes) and `/readyz` (the component is ready; the body says why not).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
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
}

/// What clients may hold of the endpoint. It answers whoever reaches the pod (Prometheus, the kubelet's probes, and
/// any pod where no NetworkPolicy says otherwise), and each connection is one of the process's file descriptors:
/// a few hundred idle connections would leave the node agent none for its sockets, checkpoint and CDI files. So a
/// request's headers must arrive within `header_read` (kube-controller-manager's secure serving allows 32 s; every
/// legitimate client here sends them at once), a connection lasts at most `lifetime` (then it is closed after the
/// request in flight; Prometheus reconnects), one client address may hold `per_peer` connections (so that one
/// pod cannot take them all and fail the kubelet's probes, which come from the node's address) and all clients
/// together `max_connections`, a quarter of the open-file limit (64 to 4,096: 256 pods of a tenant would be needed
/// to fill it); a connection beyond either is closed as soon as it is accepted.
#[derive(Clone, Copy, Debug)]
struct Limits {
    header_read: Duration,
    lifetime: Duration,
    per_peer: usize,
    max_connections: usize,
}

fn limits() -> Limits {
    let quarter = crate::open_files::soft_limit().unwrap_or(1024) / 4;
    let max_connections = usize::try_from(quarter.clamp(64, 4096)).unwrap_or(4096);
    Limits { header_read: Duration::from_secs(10), lifetime: Duration::from_secs(60), per_peer: 16, max_connections }
}

/// How often a failing accept is said at most (out of file descriptors, it fails at once each time).
const ACCEPT_FAILURE_SAID_EVERY: Duration = Duration::from_secs(10);

/// How long a request in flight may take to be answered once its connection is cut or the server stops.
const DRAIN: Duration = Duration::from_secs(5);

/// The connections open now, in all and per client address.
#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_peer: HashMap<IpAddr, usize>,
}

/// One admitted connection's place in [`Open`], given back when it is dropped.
struct Slot {
    open: Arc<Mutex<Open>>,
    peer: IpAddr,
}

impl Slot {
    /// A place for a connection from `peer`, unless the limits are reached.
    fn admit(open: &Arc<Mutex<Open>>, peer: IpAddr, limits: &Limits) -> Option<Self> {
        let mut now = open.lock().unwrap_or_else(PoisonError::into_inner);
        let from_peer = now.by_peer.get(&peer).copied().unwrap_or_default();
        if now.total >= limits.max_connections || from_peer >= limits.per_peer {
            return None;
        }
        now.total += 1;
        now.by_peer.insert(peer, from_peer + 1);
        Some(Self { open: open.clone(), peer })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut now = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        now.total = now.total.saturating_sub(1);
        if let Some(count) = now.by_peer.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                now.by_peer.remove(&self.peer);
            }
        }
    }
}

/// Readiness, set by the component: `Ok(())` when ready, `Err(reason)` otherwise; and a condition it may add, looked
/// at on each ask (a state that changes without the component's loop knowing, such as the kubelet's registration).
#[derive(Clone)]
pub struct Readiness {
    state: Arc<Mutex<Result<(), String>>>,
    condition: Arc<Mutex<Option<Condition>>>,
}

type Condition = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Readiness").field(&self.get()).finish()
    }
}

impl Readiness {
    pub fn not_ready(reason: impl Into<String>) -> Self {
        Self { state: Arc::new(Mutex::new(Err(reason.into()))), condition: Arc::default() }
    }

    pub fn set(&self, state: Result<(), String>) {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = state;
    }

    /// From now on, ready also needs `condition` to hold (it replaces the one set before).
    pub fn require(&self, condition: impl Fn() -> Result<(), String> + Send + Sync + 'static) {
        *self.condition.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(condition));
    }

    pub fn get(&self) -> Result<(), String> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).clone()?;
        let condition = self.condition.lock().unwrap_or_else(PoisonError::into_inner).clone();
        condition.map_or(Ok(()), |condition| condition())
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
    Ok((local, serve(listener, app, limits(), stop)))
}

/// Serves HTTP/1.1 on `listener` within `limits` until `stop`, then lets requests in flight finish for [`DRAIN`].
async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    stop: CancellationToken,
) -> Result<(), ServerError> {
    let open = Arc::new(Mutex::new(Open::default()));
    let mut connections = tokio::task::JoinSet::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    // Requests here are a line and a few headers: a small read buffer keeps thousands of slow clients to megabytes
    // (hyper's default lets each buffer about 400 KiB).
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_read).max_buf_size(16 * 1024);
    let mut accept_failure_said: Option<tokio::time::Instant> = None;
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors (EMFILE) and the like: wait a little rather than spin on the error.
                if accept_failure_said.is_none_or(|said| said.elapsed() >= ACCEPT_FAILURE_SAID_EVERY) {
                    tracing::warn!(%error, "accepting a connection to the metrics and health endpoint failed");
                    accept_failure_said = Some(tokio::time::Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = Slot::admit(&open, peer.ip(), &limits) else {
            tracing::debug!(%peer, "the metrics and health endpoint's connection limit is reached; closed");
            continue;
        };
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let stop = stop.clone();
        connections.spawn(async move {
            let _slot = slot;
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                ended = connection.as_mut() => {
                    if let Err(error) = ended {
                        tracing::debug!(%peer, %error, "a connection to the metrics and health endpoint ended");
                    }
                    return;
                }
                () = tokio::time::sleep(limits.lifetime) => {}
                () = stop.cancelled() => {}
            }
            // The request in flight, if any, is answered; then the connection closes.
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(DRAIN, connection).await;
        });
    }
    let drained = tokio::time::timeout(DRAIN, async { while connections.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::debug!("connections to the metrics and health endpoint still open at shutdown");
    }
    Ok(())
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Whether the server closed `stream` within `within` (a read returns end of file or a reset).
    async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
        let mut buffer = [0u8; 512];
        loop {
            match tokio::time::timeout(within, stream.read(&mut buffer)).await {
                Ok(Ok(0) | Err(_)) => return true,
                Ok(Ok(_)) => {}
                Err(_) => return false,
            }
        }
    }

    /// A connection to `addr` from the loopback address `from` (127.0.0.0/8: each its own client address).
    async fn connect_from(from: [u8; 4], addr: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::from((from, 0)))?;
        socket.connect(addr).await
    }

    async fn fetch_from(from: [u8; 4], addr: SocketAddr, path: &str) -> std::io::Result<String> {
        let mut stream = connect_from(from, addr).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut answer)).await??;
        Ok(answer)
    }

    /// Any pod may reach the endpoint: connections that send nothing are cut once their headers are late, and beyond
    /// the limits (per client address, and in all) a connection is closed at once, so idle connections cannot take
    /// the process's file descriptors, nor one client the places of the kubelet's probes. Before, each stayed open
    /// for as long as its client wished, with no limit on how many.
    #[tokio::test]
    async fn idle_connections_are_cut_and_capped() -> anyhow::Result<()> {
        let limits = Limits {
            header_read: Duration::from_millis(500),
            lifetime: Duration::from_secs(30),
            per_peer: 2,
            max_connections: 3,
        };
        let listener = listen(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
        let addr = listener.local_addr()?;
        let app = Router::new().route("/readyz", get(readyz)).with_state(AppState {
            registry: Arc::new(Registry::default()),
            readiness: Readiness::not_ready("starting"),
            liveness: Liveness::default(),
        });
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(listener, app, limits, stop.clone()));
        let (pod, node, other) = ([127, 0, 0, 1], [127, 0, 0, 2], [127, 0, 0, 3]);
        assert!(fetch_from(pod, addr, "/readyz").await?.contains("not ready: starting"));

        let mut idle = vec![connect_from(pod, addr).await?, connect_from(pod, addr).await?];
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut over = connect_from(pod, addr).await?;
        assert!(closed_within(&mut over, Duration::from_millis(300)).await, "a client beyond its limit was kept");
        assert!(fetch_from(node, addr, "/readyz").await?.contains("not ready"), "another client was refused");
        idle.push(connect_from(node, addr).await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut over = connect_from(other, addr).await?;
        assert!(closed_within(&mut over, Duration::from_millis(300)).await, "a connection beyond the limit was kept");
        for stream in &mut idle {
            assert!(closed_within(stream, Duration::from_secs(3)).await, "an idle connection stayed open");
        }
        // A half-sent request is cut the same way.
        let mut slow = connect_from(pod, addr).await?;
        slow.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n").await?;
        assert!(closed_within(&mut slow, Duration::from_secs(3)).await, "a request without its end stayed open");
        assert!(fetch_from(pod, addr, "/readyz").await?.contains("not ready"), "served again once they were cut");
        stop.cancel();
        server.await??;
        Ok(())
    }

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
