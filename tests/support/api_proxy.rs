//! A reverse proxy in front of the test cluster's real API server that garbles chosen answers: how a component
//! behaves when the server did what was asked but the answer cannot be decoded (a proxy or load balancer in the path
//! mangling a body, a server answering with another version's shape). Everything else passes through unchanged,
//! watches streamed. The component under test talks plain HTTP to the proxy (a kubeconfig of its own); the proxy
//! talks to the API server with the test's admin client.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context as _;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode, header};

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

#[derive(Clone)]
struct Shared {
    client: kube::Client,
    garble: Arc<Mutex<Garble>>,
}

/// The running proxy; stops when dropped.
#[derive(Debug)]
pub struct ApiProxy {
    kubeconfig: PathBuf,
    garble: Arc<Mutex<Garble>>,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl ApiProxy {
    /// Listens on a free local port, forwarding to the API server `client` talks to.
    pub async fn start(client: kube::Client) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address: SocketAddr = listener.local_addr()?;
        let garble = Arc::new(Mutex::new(Garble::default()));
        let shared = Shared { client, garble: garble.clone() };
        let app = axum::Router::new().fallback(forward).with_state(shared);
        let task = tokio::spawn(async move {
            if let Err(err) = axum::serve(listener, app).await {
                eprintln!("api proxy stopped: {err}");
            }
        });
        let dir = tempfile::tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_text(address)).context("write the proxy's kubeconfig")?;
        Ok(Self { kubeconfig, garble, task, _dir: dir })
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
}

impl Drop for ApiProxy {
    fn drop(&mut self) {
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

async fn forward_request(shared: &Shared, request: Request) -> anyhow::Result<Response> {
    let (parts, body) = request.into_parts();
    let garble = take_garble(&shared.garble, &parts.method, parts.uri.path());
    let body = axum::body::to_bytes(body, usize::MAX).await?;
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut upstream = http::Request::builder().method(parts.method.clone()).uri(path);
    for (name, value) in parts.headers.iter().filter(|(name, _)| *name != header::HOST) {
        upstream = upstream.header(name, value);
    }
    let answer = shared.client.send(upstream.body(kube::client::Body::from(body.to_vec()))?).await?;
    let (mut parts, body) = answer.into_parts();
    if !garble {
        return Ok(Response::from_parts(parts, Body::new(body)));
    }
    // The server's answer is read to its end (the request is complete upstream), then replaced.
    drop(axum::body::to_bytes(Body::new(body), usize::MAX).await?);
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok(Response::from_parts(parts, Body::from(GARBLED)))
}
