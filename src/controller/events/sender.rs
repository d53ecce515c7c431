//! The background sender: creates Events, or patches the series of a recent one, in batches.
//!
//! Why batches: after a burst of pods the queue holds hundreds of creation Events, sent at `--events-qps`. One
//! Event per token means two wake-ups of the process per Event (the rate limiter's timer, then the answer) for as
//! long as the queue drains. So the sender takes what is queued (at most [`MAX_BATCH`], and at most the burst),
//! waits until the rate limit allows the whole batch, and sends it [`SEND_CONCURRENCY`] at a time: the same average
//! rate, fewer wake-ups (gpu-dra alone, a burst of 2,000 pods: 6,000–6,500 voluntary context switches per run
//! instead of 7,200–7,900, and 0.49–0.67 CPU s per 1,000 claims instead of 0.57–0.85). A single Event, the usual
//! case outside a burst, goes out at once, as before. The first Event of a full batch waits for the whole batch's
//! tokens (at most 0.5 s at the default 50/s). The limit counts Events: the rare re-creation of an Event deleted
//! under its series takes no token of its own.
//!
//! Series keep their order within a batch: a repeat is planned only after its series' Event was created (or
//! created anew, when its series patch found the Event gone).

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::mpsc;
use tracing::warn;

use super::{Queued, RecentEvents, Sent, SeriesKey};
use crate::kube_client::TokenBucket;

/// Most Events taken from the queue and sent together.
pub(super) const MAX_BATCH: usize = 25;
/// Event writes in flight at once: the events client opens at most this many connections.
pub(super) const SEND_CONCURRENCY: usize = 8;

/// Sends what `queued` brings until every [`super::Events`] handle is gone, paced by `pace` (none: unlimited).
pub(super) async fn run(mut sender: Sender, mut queued: mpsc::Receiver<Queued>, pace: Option<Arc<TokenBucket>>) {
    // A batch is never larger than the bucket, or it would wait for ever.
    let max_batch = pace.as_ref().map_or(MAX_BATCH, |bucket| MAX_BATCH.min(bucket.burst()));
    let mut batch = Vec::with_capacity(max_batch);
    while queued.recv_many(&mut batch, max_batch).await > 0 {
        if let Some(bucket) = &pace {
            bucket.take(batch.len()).await;
        }
        sender.send_batch(std::mem::take(&mut batch)).await;
    }
}

/// One write, decided before it is sent.
enum Write {
    /// A new Event; its series is remembered once the API server took it.
    Create { queued: Queued, key: SeriesKey, event: Box<Event> },
    /// A repeat: the series of a recent Event, whose count was already raised.
    Patch { queued: Queued, key: SeriesKey, sent: Sent, now: Timestamp },
}

/// What became of a [`Write`].
enum Outcome {
    Done,
    Created {
        key: SeriesKey,
        sent: Sent,
    },
    /// The Event a series patch was for is gone (Events expire on the server too): send this one anew.
    Gone {
        queued: Box<Queued>,
        key: SeriesKey,
    },
}

/// Creates Events and patches their series; remembers recent ones for aggregation.
pub(super) struct Sender {
    client: kube::Client,
    instance: String,
    recent: RecentEvents,
    /// Nanoseconds of the last Event name made: names stay unique within a batch made in one clock reading.
    last_name_nanos: i128,
}

impl Sender {
    /// `client` should be one of its own (the sender paces itself, so it needs no rate limit).
    pub(super) fn new(client: kube::Client, instance: String) -> Self {
        Self { client, instance, recent: RecentEvents::default(), last_name_nanos: 0 }
    }

    /// Sends a batch: each series' first Event in it concurrently, then (rare) the repeats of a series within the
    /// same batch one at a time, as a repeat needs its Event to exist.
    async fn send_batch(&mut self, batch: Vec<Queued>) {
        let now = Timestamp::now();
        self.recent.expire(now);
        let mut seen = HashSet::with_capacity(batch.len());
        let mut firsts = Vec::with_capacity(batch.len());
        let mut repeats = Vec::new();
        for queued in batch {
            let key = SeriesKey::new(&queued.regarding, queued.related.as_ref(), queued.type_, queued.reason);
            if seen.insert(key.clone()) {
                firsts.push(self.plan(queued, key, now));
            } else {
                repeats.push((queued, key));
            }
        }
        let this = &*self;
        let outcomes: Vec<Outcome> = futures::stream::iter(firsts)
            .map(|write| this.write(write))
            .buffer_unordered(SEND_CONCURRENCY)
            .collect()
            .await;
        for outcome in outcomes {
            self.settle(outcome, now).await;
        }
        for (queued, key) in repeats {
            let write = self.plan(queued, key, now);
            let outcome = self.write(write).await;
            self.settle(outcome, now).await;
        }
    }

    /// A repeat of a recent series patches it (counting it now); anything else creates an Event.
    fn plan(&mut self, queued: Queued, key: SeriesKey, now: Timestamp) -> Write {
        match self.recent.repeat(&key, now) {
            Some(sent) => Write::Patch { queued, key, sent, now },
            None => Write::Create { event: Box::new(self.event(&queued, now)), queued, key },
        }
    }

    async fn write(&self, write: Write) -> Outcome {
        match write {
            Write::Patch { queued, key, sent, now } => {
                let patch = json!({"series": {"count": sent.count, "lastObservedTime": MicroTime(now)}});
                let request = events_request(&sent.namespace)
                    .patch(&sent.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .map_err(kube::Error::BuildRequest);
                match self.send_unread(request, "patch").await {
                    Ok(()) => Outcome::Done,
                    Err(kube::Error::Api(status)) if status.code == 404 => {
                        Outcome::Gone { queued: Box::new(queued), key }
                    }
                    Err(err) => {
                        log_failure(&queued, &err);
                        Outcome::Done
                    }
                }
            }
            Write::Create { queued, key, event } => {
                let namespace = event.metadata.namespace.clone().unwrap_or_default();
                let name = event.metadata.name.clone().unwrap_or_default();
                let last = event.event_time.as_ref().map_or_else(Timestamp::now, |time| time.0);
                let request = serde_json::to_vec(&event).map_err(kube::Error::SerdeError).and_then(|body| {
                    events_request(&namespace).create(&PostParams::default(), body).map_err(kube::Error::BuildRequest)
                });
                match self.send_unread(request, "create").await {
                    Ok(()) => Outcome::Created { key, sent: Sent { namespace, name, count: 1, last } },
                    Err(err) => {
                        log_failure(&queued, &err);
                        Outcome::Done
                    }
                }
            }
        }
    }

    /// Remembers a created series. A series whose Event is gone is forgotten and its Event created anew at once,
    /// before any later repeat of it in the batch is planned (which then counts on the new Event).
    async fn settle(&mut self, outcome: Outcome, now: Timestamp) {
        match outcome {
            Outcome::Done => {}
            Outcome::Created { key, sent } => self.recent.insert(key, sent),
            Outcome::Gone { queued, key } => {
                self.recent.forget(&key);
                let write = Write::Create { event: Box::new(self.event(&queued, now)), queued: *queued, key };
                if let Outcome::Created { key, sent } = self.write(write).await {
                    self.recent.insert(key, sent);
                }
            }
        }
    }

    /// Sends a request and leaves its answer undecoded: the Event the API server returns (managed fields and all)
    /// is of no use here, and decoding it was a good part of the sender's CPU. (Errors are still decoded: kube
    /// turns a failure's Status into `kube::Error::Api`.)
    async fn send_unread(&self, request: kube::Result<http::Request<Vec<u8>>>, verb: &'static str) -> kube::Result<()> {
        let mut request = request?;
        request.extensions_mut().insert(verb);
        self.client.request_text(request).await.map(drop)
    }

    fn event(&mut self, queued: &Queued, now: Timestamp) -> Event {
        let Queued { regarding, related, type_, reason, note } = queued;
        let namespace = regarding.namespace.clone().unwrap_or_else(|| "default".into());
        let object = regarding.name.as_deref().unwrap_or(crate::controller::CLAIM_FIELD_MANAGER);
        self.last_name_nanos = unique_nanos(self.last_name_nanos, now.as_nanosecond());
        // `<name>.<hex>` as client-go names them, unless that is no longer a valid name (an object's name of more
        // than 236 characters): then the reporter's name stands in for the object's (client-go takes a UUID).
        let mut name = format!("{object}.{:x}", self.last_name_nanos);
        if name.len() > MAX_NAME {
            name = format!("{REPORTER_NAME}.{:x}", self.last_name_nanos);
        }
        Event {
            metadata: ObjectMeta { name: Some(name), namespace: Some(namespace), ..Default::default() },
            event_time: Some(MicroTime(now)),
            type_: Some(type_.as_str().into()),
            reason: Some(reason.as_str().into()),
            action: Some(reason.action().into()),
            note: Some(crate::event_note::fit(note.clone())),
            regarding: Some(regarding.clone()),
            related: related.clone(),
            reporting_controller: Some(crate::controller::CLAIM_FIELD_MANAGER.into()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        }
    }
}

/// The longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;
/// Names an Event whose object's name leaves no room for the suffix.
const REPORTER_NAME: &str = "gpu-dra-controller";

/// The clock's nanoseconds, or one past the last name's when the clock has not moved on (several Events made from
/// one reading, as in a batch): two Events about one pod (two of its claims) must not share a name.
fn unique_nanos(last: i128, now: i128) -> i128 {
    now.max(last + 1)
}

/// Requests on events.k8s.io/v1 Events in `namespace`.
fn events_request(namespace: &str) -> kube::core::Request {
    kube::core::Request::new(Event::url_path(&(), Some(namespace)))
}

/// Logs an Event the API server did not take; names the permission only when the refusal is one (a namespace being
/// deleted, a webhook, a timeout are not, and the error says what they are).
fn log_failure(queued: &Queued, err: &kube::Error) {
    let (reason, object) = (queued.reason.as_str(), &queued.regarding.name);
    let related = queued.related.as_ref().and_then(|r| r.name.as_deref());
    if missing_permission(err) {
        warn!(reason, ?object, ?related, error = %err,
            "could not publish event: grant the controller's role create and patch on events.k8s.io events");
    } else {
        warn!(reason, ?object, ?related, error = %err, "could not publish event");
    }
}

fn missing_permission(err: &kube::Error) -> bool {
    use crate::controller::decide::quota::{Refusal, refusal};
    matches!(err, kube::Error::Api(status) if refusal(status.code, &status.message) == Refusal::Permission)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_permission_refusal_is_called_one() {
        let api = |code: u16, message: &str| {
            let status: kube::core::Status =
                serde_json::from_value(json!({"code": code, "message": message, "reason": "", "status": "Failure"}))
                    .expect("status");
            kube::Error::Api(Box::new(status))
        };
        let rbac = "events.events.k8s.io is forbidden: User \"system:serviceaccount:gpu-dra:controller\" cannot \
                    create resource \"events\" in API group \"events.k8s.io\" in the namespace \"team-a\"";
        assert!(missing_permission(&api(403, rbac)));
        let terminating = "events.events.k8s.io \"p.1\" is forbidden: unable to create new content in namespace team-a \
                           because it is being terminated";
        assert!(!missing_permission(&api(403, terminating)));
        assert!(!missing_permission(&api(422, "Event.events.k8s.io \"p.1\" is invalid")));
    }

    #[test]
    fn names_made_from_one_clock_reading_differ() {
        assert_eq!(unique_nanos(0, 1_000), 1_000, "the clock when it moved on");
        assert_eq!(unique_nanos(1_000, 1_000), 1_001, "the same reading twice");
        assert_eq!(unique_nanos(1_001, 1_000), 1_002, "and a third time");
        assert_eq!(unique_nanos(5_000, 1_000), 5_001, "a clock stepped back");
    }
}
