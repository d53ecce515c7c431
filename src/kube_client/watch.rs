//! Watches that list again when the API server no longer has the resource version they resume from.
//!
//! kube's watcher lists again after a 410 Gone (the version left the server's watch cache), but a watch refused
//! because its version is *newer* than the server's (504, cause `ResourceVersionTooLarge`: etcd restored from a
//! backup, an API server whose cache lags behind another's) is retried from the same version, with back-off, for
//! ever: the component's caches froze, and once etcd's revision passed the old one the watch resumed and silently
//! skipped everything in between (pods created then never got claims). client-go's reflector lists again from the
//! server's current state in both cases, backing off between lists; so does [`watcher`].

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt as _};
use kube::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;
use tracing::warn;

/// The cause the API server gives a version newer than its own (`metav1.CauseTypeResourceVersionTooLarge`).
const TOO_LARGE_CAUSE: &str = "ResourceVersionTooLarge";
/// What API servers before the cause existed (1.17) said instead.
const TOO_LARGE_MESSAGE: &str = "Too large resource version";

/// The wait before the first list again; it doubles at each refusal up to [`RELIST_MAX`] (client-go's reflector backs
/// off from 800 ms to 30 s between its lists): an API server stuck behind the others (a load balancer sending the
/// watches to it) refuses every watch after the list, and each list of every pod costs it more than the watch.
const RELIST_FIRST: Duration = Duration::from_millis(800);
const RELIST_MAX: Duration = Duration::from_secs(30);
/// A watcher that has run this long since its last list again starts the back-off over.
const RELIST_RESET: Duration = Duration::from_secs(120);

/// kube's watcher of `api` with `config` and its default back-off, started afresh (a list of the server's current
/// state, after a back-off) whenever the server refuses a resource version as too large; `what` names the resource
/// in the log.
pub fn watcher<K>(
    what: &'static str,
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = watcher::Result<Event<K>>> + Send
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let start = Arc::new(move || watcher::watcher(api.clone(), config.clone()).default_backoff().boxed());
    let first = start();
    let relist = Relist { wait: RELIST_FIRST, last: None };
    futures::stream::unfold((first, relist), move |(mut inner, mut relist)| {
        let start = start.clone();
        async move {
            let item = inner.next().await?;
            if let Err(err) = &item
                && is_too_large(err)
            {
                let wait = relist.next(Instant::now());
                warn!(resource = what, error = %err, ?wait,
                    "the API server no longer has the resource version the watch resumes from (restored from a \
                     backup?); listing again");
                tokio::time::sleep(wait).await;
                inner = start();
            }
            Some((item, (inner, relist)))
        }
    })
}

/// The back-off between lists again.
#[derive(Debug)]
struct Relist {
    wait: Duration,
    /// When the last list again was asked for.
    last: Option<Instant>,
}

impl Relist {
    /// The wait before the list again asked for `now`.
    fn next(&mut self, now: Instant) -> Duration {
        if self.last.is_some_and(|last| now.duration_since(last) >= RELIST_RESET) {
            self.wait = RELIST_FIRST;
        }
        self.last = Some(now);
        let wait = self.wait;
        self.wait = (self.wait * 2).min(RELIST_MAX);
        wait
    }
}

/// Whether the server refused the watch's resource version as newer than its own.
pub fn is_too_large(err: &watcher::Error) -> bool {
    let status = match err {
        watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status))
        | watcher::Error::InitialListFailed(kube::Error::Api(status)) => status.as_ref(),
        watcher::Error::WatchError(status) => status.as_ref(),
        _ => return false,
    };
    status_is_too_large(status)
}

fn status_is_too_large(status: &kube::core::Status) -> bool {
    let mut causes = status.details.iter().flat_map(|d| d.causes.iter());
    status.code == 504
        && (causes.any(|c| c.reason == TOO_LARGE_CAUSE || c.message == TOO_LARGE_MESSAGE)
            || status.message.contains(TOO_LARGE_MESSAGE))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(value: serde_json::Value) -> kube::core::Status {
        serde_json::from_value(value).expect("a Status")
    }

    #[test]
    fn only_a_version_newer_than_the_servers_is_too_large() {
        let current = status(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 504, "reason": "Timeout",
            "message": "Too large resource version: 2500, current: 1200",
            "details": {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                        "retryAfterSeconds": 1}
        }));
        assert!(status_is_too_large(&current));
        let older_server = status(serde_json::json!({
            "status": "Failure", "code": 504, "reason": "Timeout", "message": "Timeout: Too large resource version",
            "details": {"causes": [{"message": "Too large resource version"}]}
        }));
        assert!(status_is_too_large(&older_server));
        let timeout = status(serde_json::json!({
            "status": "Failure", "code": 504, "reason": "Timeout", "message": "the server was unable to return a response in the time allotted"
        }));
        assert!(!status_is_too_large(&timeout), "a plain timeout is retried from the same version");
        let gone = status(
            serde_json::json!({"status": "Failure", "code": 410, "reason": "Expired", "message": "too old resource version"}),
        );
        assert!(!status_is_too_large(&gone), "410 is kube's own relist");

        let err = watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(current.clone())));
        assert!(is_too_large(&err));
        assert!(is_too_large(&watcher::Error::WatchError(Box::new(current))));
        assert!(!is_too_large(&watcher::Error::NoResourceVersion));
    }

    #[test]
    fn lists_again_back_off_and_start_over_after_a_quiet_while() {
        let start = Instant::now();
        let mut relist = Relist { wait: RELIST_FIRST, last: None };
        let waits: Vec<Duration> = (0..8).map(|i| relist.next(start + Duration::from_secs(i))).collect();
        let secs: Vec<f64> = waits.iter().map(Duration::as_secs_f64).collect();
        assert_eq!(secs, [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]);
        assert_eq!(relist.next(start + Duration::from_secs(7) + RELIST_RESET), RELIST_FIRST, "quiet for two minutes");
    }
}
