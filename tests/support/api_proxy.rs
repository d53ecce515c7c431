//! A reverse proxy in front of the test cluster's real API server that garbles or holds chosen requests: how a
//! component behaves when the server did what was asked but the answer cannot be decoded (a proxy or load balancer in
//! the path mangling a body, a server answering with another version's shape), and when one request takes as long
//! as the test wants (a slow or restarting API server), with everything else going on; and watches it ends and
//! answers as a restarted API server does (410 Gone: the client must list again), or as one restored from an older
//! etcd backup does (504, the version too large). Everything else passes through
//! unchanged, watches streamed. The component under test talks plain HTTP to the proxy (a kubeconfig of its own); the proxy
//! talks to the API server with the test's admin client.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context as _;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode, header};
use serde_json::json;

/// The body a garbled answer carries: JSON, but not the object that was asked for.
pub const GARBLED: &str = r#"{"kind": 7, "metadata": "garbled by the test's proxy"}"#;

/// Answers to garble: requests of `method` whose path ends with `path_suffix`, the next `count` of them.
#[derive(Debug, Default)]
struct Garble {
    method: Option<Method>,
    path_suffix: String,
    count: usize,
    garbled: usize,
}

/// Requests held until the gate opens: those of `method` (any method where `None`) whose path ends with
/// `path_suffix`, while it is shut. Requests to hold ([`ApiProxy::hold`]) pass one; watches to expire
/// ([`ApiProxy::cut_watches`]) another.
#[derive(Debug, Default)]
struct Gate {
    /// `None`: open.
    shut: Option<Shut>,
    /// Requests held since it was last shut.
    held: usize,
}

#[derive(Debug)]
struct Shut {
    method: Option<Method>,
    path_suffix: String,
    /// Holds only this many more (watches passed over), where set: the rest pass.
    remaining: Option<usize>,
    /// Never given permits: closed when the gate opens, which ends every wait.
    waiting: Arc<tokio::sync::Semaphore>,
}

impl Gate {
    fn shut(&mut self, method: Option<Method>, path_suffix: &str) {
        self.shut_for(method, path_suffix, None);
    }

    fn shut_for(&mut self, method: Option<Method>, path_suffix: &str, remaining: Option<usize>) {
        let waiting = Arc::new(tokio::sync::Semaphore::new(0));
        let shut = Shut { method, path_suffix: path_suffix.to_string(), remaining, waiting };
        *self = Gate { shut: Some(shut), held: 0 };
    }

    /// Lets the held requests, and all later ones, through.
    fn open(&mut self) {
        if let Some(shut) = self.shut.take() {
            shut.waiting.close();
        }
    }

    /// What a request of `method` on `path` must wait for, if the gate holds it (counted).
    fn holds(&mut self, method: &Method, uri: &http::Uri) -> Option<Arc<tokio::sync::Semaphore>> {
        let shut = self.shut.as_mut()?;
        if shut.method.as_ref().is_some_and(|m| m != method) || !uri.path().ends_with(&shut.path_suffix) {
            return None;
        }
        if let Some(remaining) = shut.remaining.as_mut() {
            if *remaining == 0 || is_watch(uri) {
                return None;
            }
            *remaining -= 1;
        }
        let waiting = shut.waiting.clone();
        self.held += 1;
        Some(waiting)
    }
}

/// Waits at `gate` if it holds the request (the wait ends when the gate opens).
async fn pass(gate: &Mutex<Gate>, method: &Method, uri: &http::Uri) -> bool {
    let waiting = gate.lock().unwrap_or_else(PoisonError::into_inner).holds(method, uri);
    match waiting {
        Some(waiting) => {
            // Closed when the gate opens: the wait ends with an error, which is the signal to go on.
            let _ = waiting.acquire().await;
            true
        }
        None => false,
    }
}

#[derive(Clone)]
struct Shared {
    client: kube::Client,
    garble: Arc<Mutex<Garble>>,
    hold: Arc<Mutex<Gate>>,
    /// Watches ended and held, to be expired when this opens.
    expire: Arc<Mutex<Gate>>,
    /// Each cut: the path suffix of the watches it ends.
    cut: Arc<tokio::sync::watch::Sender<String>>,
    too_large: Arc<Mutex<TooLarge>>,
}

/// Watches answered that their resource version is newer than the server's ([`ApiProxy::restore_held_watches`]).
#[derive(Debug, Default)]
struct TooLarge {
    /// Whether the held watches are answered so when the gate opens (else: 410, expired).
    held: bool,
    /// The resource versions refused: every watch from one of them is refused again.
    versions: std::collections::HashSet<String>,
}

/// The running proxy; stops when dropped.
#[derive(Debug)]
pub struct ApiProxy {
    kubeconfig: PathBuf,
    address: SocketAddr,
    garble: Arc<Mutex<Garble>>,
    hold: Arc<Mutex<Gate>>,
    expire: Arc<Mutex<Gate>>,
    cut: Arc<tokio::sync::watch::Sender<String>>,
    too_large: Arc<Mutex<TooLarge>>,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl ApiProxy {
    /// Listens on a free local port, forwarding to the API server `client` talks to.
    pub async fn start(client: kube::Client) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address: SocketAddr = listener.local_addr()?;
        let garble = Arc::new(Mutex::new(Garble::default()));
        let hold = Arc::new(Mutex::new(Gate::default()));
        let expire = Arc::new(Mutex::new(Gate::default()));
        let cut = Arc::new(tokio::sync::watch::Sender::new(String::new()));
        let too_large = Arc::new(Mutex::new(TooLarge::default()));
        let shared = Shared {
            client,
            garble: garble.clone(),
            hold: hold.clone(),
            expire: expire.clone(),
            cut: cut.clone(),
            too_large: too_large.clone(),
        };
        let app = axum::Router::new().fallback(forward).with_state(shared);
        let task = tokio::spawn(async move {
            if let Err(err) = axum::serve(listener, app).await {
                eprintln!("api proxy stopped: {err}");
            }
        });
        let dir = tempfile::tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_text(address)).context("write the proxy's kubeconfig")?;
        Ok(Self { kubeconfig, address, garble, hold, expire, cut, too_large, task, _dir: dir })
    }

    /// The port the proxy listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.address.port()
    }

    /// A kubeconfig naming the proxy (plain HTTP, no credentials: the proxy authenticates upstream).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Garbles the answers to the next `count` requests of `method` whose path ends with `path_suffix`: the server
    /// still handles each request, the client gets its status and [`GARBLED`] as the body.
    pub fn garble_next(&self, method: Method, path_suffix: &str, count: usize) {
        let mut garble = self.garble.lock().unwrap_or_else(PoisonError::into_inner);
        *garble = Garble { method: Some(method), path_suffix: path_suffix.to_string(), count, garbled: 0 };
    }

    /// How many answers were garbled since the last [`Self::garble_next`].
    pub fn garbled(&self) -> usize {
        self.garble.lock().unwrap_or_else(PoisonError::into_inner).garbled
    }

    /// Holds every request of `method` whose path ends with `path_suffix` from now on, before it reaches the server,
    /// until [`Self::release`] (or the proxy's end).
    pub fn hold(&self, method: Method, path_suffix: &str) {
        self.hold.lock().unwrap_or_else(PoisonError::into_inner).shut(Some(method), path_suffix);
    }

    /// Holds the next `count` requests of `method` (watches aside) whose path ends with `path_suffix`, and no
    /// later ones, until [`Self::release`]: a request sent on a connection to an API server that vanished.
    pub fn hold_next(&self, method: Method, path_suffix: &str, count: usize) {
        self.hold.lock().unwrap_or_else(PoisonError::into_inner).shut_for(Some(method), path_suffix, Some(count));
    }

    /// How many requests were held since the last [`Self::hold`] (released ones included).
    pub fn held(&self) -> usize {
        self.hold.lock().unwrap_or_else(PoisonError::into_inner).held
    }

    /// Lets the held requests (and any later ones) through.
    pub fn release(&self) {
        self.hold.lock().unwrap_or_else(PoisonError::into_inner).open();
    }

    /// Ends the open watches on paths ending with `path_suffix` and holds the watches that follow on such paths, as
    /// while an API server restarts; [`Self::expire_held_watches`] then answers them as the restarted server does.
    pub fn cut_watches(&self, path_suffix: &str) {
        self.expire.lock().unwrap_or_else(PoisonError::into_inner).shut(None, path_suffix);
        self.cut.send_replace(path_suffix.to_string());
    }

    /// How many watches were held since the last [`Self::cut_watches`].
    pub fn held_watches(&self) -> usize {
        self.expire.lock().unwrap_or_else(PoisonError::into_inner).held
    }

    /// Answers the held watches that their resource version is too old (a watch event of type ERROR, code 410, as
    /// the API server sends once the version left its watch cache, e.g. after a restart): the client lists again.
    /// Later watches pass through.
    pub fn expire_held_watches(&self) {
        self.expire.lock().unwrap_or_else(PoisonError::into_inner).open();
    }

    /// Answers the held watches, and every later watch from the same resource versions, that their version is newer
    /// than the server's (504, cause `ResourceVersionTooLarge`), as an API server whose etcd was restored from an
    /// older backup does: retrying from that version never succeeds; the client must list again.
    pub fn restore_held_watches(&self) {
        self.too_large.lock().unwrap_or_else(PoisonError::into_inner).held = true;
        self.expire.lock().unwrap_or_else(PoisonError::into_inner).open();
    }
}

impl Drop for ApiProxy {
    fn drop(&mut self) {
        self.release();
        self.expire_held_watches();
        self.task.abort();
    }
}

fn kubeconfig_text(address: SocketAddr) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: proxy\n  cluster: {{server: \"http://{address}\"}}\n\
         users:\n- name: via-proxy\n  user: {{}}\ncontexts:\n- name: proxy\n  context: {{cluster: proxy, user: via-proxy}}\n\
         current-context: proxy\n"
    )
}

/// Whether this request's answer is to be garbled (counting it if so).
fn take_garble(garble: &Mutex<Garble>, method: &Method, path: &str) -> bool {
    let mut garble = garble.lock().unwrap_or_else(PoisonError::into_inner);
    let matches = garble.method.as_ref() == Some(method) && path.ends_with(&garble.path_suffix);
    if matches && garble.garbled < garble.count {
        garble.garbled += 1;
        return true;
    }
    false
}

async fn forward(State(shared): State<Shared>, request: Request) -> Response {
    match forward_request(&shared, request).await {
        Ok(response) => response,
        Err(err) => (StatusCode::BAD_GATEWAY, format!("api proxy: {err:#}")).into_response(),
    }
}

/// Whether the request is a watch (`?watch=true`, as kube and client-go ask).
fn is_watch(uri: &http::Uri) -> bool {
    uri.query().is_some_and(|query| query.split('&').any(|pair| pair == "watch=true" || pair == "watch=1"))
}

/// What the API server streams to a watch from a resource version it no longer has.
fn expired_watch() -> Response {
    let event = json!({"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version (expired by the test's proxy)", "reason": "Expired", "code": 410
    }});
    let mut response = Response::new(Body::from(format!("{event}\n")));
    response.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    response
}

/// The resource version a watch resumes from, if it names one.
fn resource_version(uri: &http::Uri) -> Option<String> {
    let query = uri.query()?;
    let version = query.split('&').find_map(|pair| pair.strip_prefix("resourceVersion="))?;
    (!version.is_empty() && version != "0").then(|| version.to_string())
}

/// What an API server restored from an older etcd backup answers to a watch from a version it has not reached.
fn too_large_watch(version: &str) -> Response {
    let status = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Timeout", "code": 504,
        "message": format!("Too large resource version: {version}, current: 1 (refused by the test's proxy)"),
        "details": {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                    "retryAfterSeconds": 1}
    });
    let mut response = Response::new(Body::from(status.to_string()));
    *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
    response.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    // As the API server sets it from the Status's retryAfterSeconds: clients retry the request after it.
    response.headers_mut().insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
    response
}

/// A watch's body that ends when [`ApiProxy::cut_watches`] names its path.
fn cuttable(body: Body, path: String, cut: &tokio::sync::watch::Sender<String>) -> Body {
    let mut cuts = cut.subscribe();
    cuts.mark_unchanged();
    let cut_here = async move {
        while cuts.changed().await.is_ok() {
            if path.ends_with(cuts.borrow_and_update().as_str()) {
                return;
            }
        }
        std::future::pending::<()>().await;
    };
    Body::from_stream(futures::StreamExt::take_until(body.into_data_stream(), Box::pin(cut_here)))
}

async fn forward_request(shared: &Shared, request: Request) -> anyhow::Result<Response> {
    let (parts, body) = request.into_parts();
    pass(&shared.hold, &parts.method, &parts.uri).await;
    let watch = is_watch(&parts.uri);
    let request_path = parts.uri.path().to_string();
    let version = resource_version(&parts.uri).filter(|_| watch);
    if let Some(version) = &version
        && shared.too_large.lock().unwrap_or_else(PoisonError::into_inner).versions.contains(version)
    {
        return Ok(too_large_watch(version));
    }
    if watch && pass(&shared.expire, &parts.method, &parts.uri).await {
        let mut too_large = shared.too_large.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(version) = version.filter(|_| too_large.held) {
            too_large.versions.insert(version.clone());
            return Ok(too_large_watch(&version));
        }
        return Ok(expired_watch());
    }
    let garble = take_garble(&shared.garble, &parts.method, parts.uri.path());
    let body = axum::body::to_bytes(body, usize::MAX).await?;
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut upstream = http::Request::builder().method(parts.method.clone()).uri(path);
    for (name, value) in parts.headers.iter().filter(|(name, _)| *name != header::HOST) {
        upstream = upstream.header(name, value);
    }
    let answer = shared.client.send(upstream.body(kube::client::Body::from(body.to_vec()))?).await?;
    let (mut parts, body) = answer.into_parts();
    if watch {
        let body = cuttable(Body::new(body), request_path, &shared.cut);
        return Ok(Response::from_parts(parts, body));
    }
    if !garble {
        return Ok(Response::from_parts(parts, Body::new(body)));
    }
    // The server's answer is read to its end (the request is complete upstream), then replaced.
    drop(axum::body::to_bytes(Body::new(body), usize::MAX).await?);
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok(Response::from_parts(parts, Body::from(GARBLED)))
}
