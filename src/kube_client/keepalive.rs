//! The connections to the API server, with TCP keepalive. kube's own client sets none and speaks HTTP/1.1, so
//! nothing notices an API server that vanished under an open connection (its machine off, a load balancer failing
//! over without a reset): a watch on it waits until kube's watcher gives up on silence (295 s) while the component
//! sees no change, where client-go's HTTP/2 pings notice within 45 s. Keepalive probes after [`IDLE`] of silence,
//! every [`INTERVAL`], [`RETRIES`] unanswered: the kernel fails the connection after 45 s, the watch ends with an
//! error and is made again on a new connection. (A request on such a connection is cut by the deadline layer.)
//!
//! The stack is kube's own (`ClientBuilder::try_from`), less its debug trace spans, with this connector: base URI,
//! authentication (token files read again as kube does), extra headers, kube's retry of answers to retry, TLS.
//! Configurations it does not cover (a proxy, exec credentials with client certificates) keep kube's.

use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt as _;
use hyper_util::client::legacy::connect::HttpConnector;
use kube::client::{Body, ClientBuilder, ConfigExt as _, DynBody};
use tower::util::BoxService;
use tower::{BoxError, ServiceBuilder, ServiceExt as _};

/// Silence on a connection before the kernel probes it.
pub const IDLE: Duration = Duration::from_secs(30);
/// Between unanswered probes.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the connection fails.
pub const RETRIES: u32 = 3;

/// The service type kube's builder makes, so that either builder serves the same caller.
pub type Service = BoxService<Request<Body>, Response<Box<DynBody>>, BoxError>;

/// A client builder whose connections have TCP keepalive, or `None` where `config` needs what only kube's own
/// builder does (a proxy, exec credentials).
pub fn builder(config: &kube::Config) -> Result<Option<ClientBuilder<Service>>, kube::Error> {
    if config.proxy_url.is_some() || config.auth_info.exec.is_some() {
        return Ok(None);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(config.connect_timeout);
    http.set_keepalive(Some(IDLE));
    http.set_keepalive_interval(Some(INTERVAL));
    http.set_keepalive_retries(Some(RETRIES));
    let https = config.rustls_https_connector_with_connector(http)?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build(https);
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(UnlessWatch(kube::client::retry::RetryPolicy::server_retry())));
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(client)
        .map_response(|response: Response<hyper::body::Incoming>| {
            response.map(|body| Box::new(body.map_err(BoxError::from)) as Box<DynBody>)
        })
        .boxed();
    Ok(Some(ClientBuilder::new(service, config.default_namespace.clone())))
}

/// kube's retry of answers to retry (429, 503, 504: up to 15 times, backing off from 5 ms, or after `Retry-After`),
/// for every request but a watch. A watch is retried by the watcher that made it, which must see why it failed: a
/// watch refused because its resource version is newer than the server's (504, see [`super::watch`]) must list
/// again, and was retried from the same version for minutes first (client-go: ten times, then it lists). Where
/// kube's own builder is used (a proxy, exec credentials), kube retries watches too: their refusals reach the
/// watcher after those retries, and it lists again then.
#[derive(Clone)]
struct UnlessWatch(kube::client::retry::RetryPolicy);

impl<Res> tower::retry::Policy<Request<Body>, Response<Res>, BoxError> for UnlessWatch {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        request: &mut Request<Body>,
        result: &mut Result<Response<Res>, BoxError>,
    ) -> Option<Self::Future> {
        if is_watch(request.uri()) {
            return None;
        }
        self.0.retry(request, result)
    }

    fn clone_request(&mut self, request: &Request<Body>) -> Option<Request<Body>> {
        if is_watch(request.uri()) {
            return None;
        }
        <kube::client::retry::RetryPolicy as tower::retry::Policy<Request<Body>, Response<Res>, BoxError>>::clone_request(
            &mut self.0,
            request,
        )
    }
}

/// Whether the request is a watch (`?watch=true`, as kube asks).
fn is_watch(uri: &http::Uri) -> bool {
    uri.query().is_some_and(|query| query.split('&').any(|pair| pair == "watch=true" || pair == "watch=1"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_are_told_apart() {
        let uri = |s: &str| s.parse::<http::Uri>().expect("a URI");
        assert!(is_watch(&uri("/api/v1/pods?allowWatchBookmarks=true&resourceVersion=12&watch=true")));
        assert!(is_watch(&uri("/api/v1/namespaces/a/pods?watch=1")));
        assert!(!is_watch(&uri("/api/v1/pods?limit=500")));
        assert!(!is_watch(&uri("/api/v1/namespaces/watch/pods/watch")));
    }
}
