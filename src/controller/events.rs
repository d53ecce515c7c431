//! Kubernetes Events (events.k8s.io/v1) for operators, on pods, PodGroups and claims. Repeats of the same event (same object, related object,
//! type and reason) within [`SERIES_WINDOW`] update one Event's `series` (count, last observed time) instead of
//! creating another, as client-go's recorder does, so a retried failure never makes a storm.
//!
//! An event on a pod about one of its claims names the claim as `related`: the claim is part of the series key
//! (as in client-go), so a pod with several claims gets one event per claim, and
//! `kubectl get events --field-selector related.name=<claim>` finds it.
//!
//! Events never slow the controller down: they queue for one background sender ([`sender`]), which uses a client
//! of its own and keeps the rate limit (`--events-qps`) itself, sending what is queued in batches. At most
//! [`MAX_QUEUED`] wait; beyond that they are dropped and counted in `gpu_dra_controller_events_dropped_total`, as
//! client-go's recorder drops what it cannot send.
//!
//! The sender remembers each recent event in a few hundred bytes (its key and name), at most [`MAX_SERIES`] of
//! them: a burst of 5,000 pods makes 5,000 creation events, and keeping the whole Event objects for the window (as
//! kube-runtime's `Recorder` does) was a third of the controller's heap.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Resource;
use tokio::sync::mpsc;

use super::slim_claim::ResourceClaim;
use super::slim_pod::Pod;
use super::slim_pod_group::PodGroup;
use crate::kube_client::TokenBucket;

mod sender;

/// How long a sent event takes repeats into its series (client-go and kube-runtime: 6 minutes).
pub const SERIES_WINDOW: SignedDuration = SignedDuration::from_secs(6 * 60);
/// Recent events remembered for aggregation; the oldest are forgotten first (client-go's LRU holds 4,096).
pub const MAX_SERIES: usize = 4096;

/// Events waiting to be sent; more are dropped.
pub const MAX_QUEUED: usize = 1000;

/// One event waiting for the sender.
#[derive(Debug)]
struct Queued {
    regarding: ObjectReference,
    /// The second object the event is about (a pod's claim).
    related: Option<ObjectReference>,
    type_: EventType,
    reason: Reason,
    note: String,
}

/// An Event's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// Event reasons, as operators filter them (`kubectl get events --field-selector reason=…`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Warning on a pod or a PodGroup: a claim could not be created (same reason, and the same objects, as
    /// kube-controller-manager).
    FailedResourceClaimCreation,
    ResourceClaimCreated,
    ResourceClaimAdopted,
    /// On a claim deleted because its pod finished or was replaced.
    ResourceClaimDeleted,
    DuplicateResourceClaimDeleted,
    /// Warning: another controller generates claims; this one only observes.
    AnotherClaimControllerActive,
}

impl Reason {
    fn as_str(self) -> &'static str {
        match self {
            Reason::FailedResourceClaimCreation => "FailedResourceClaimCreation",
            Reason::ResourceClaimCreated => "ResourceClaimCreated",
            Reason::ResourceClaimAdopted => "ResourceClaimAdopted",
            Reason::ResourceClaimDeleted => "ResourceClaimDeleted",
            Reason::DuplicateResourceClaimDeleted => "DuplicateResourceClaimDeleted",
            Reason::AnotherClaimControllerActive => "AnotherClaimControllerActive",
        }
    }

    fn action(self) -> &'static str {
        match self {
            Reason::FailedResourceClaimCreation | Reason::ResourceClaimCreated => "CreateResourceClaim",
            Reason::ResourceClaimAdopted => "AdoptResourceClaim",
            Reason::ResourceClaimDeleted | Reason::DuplicateResourceClaimDeleted => "DeleteResourceClaim",
            Reason::AnotherClaimControllerActive => "ObserveOnly",
        }
    }
}

/// Publishes the controller's Events; failures to publish are logged, never fatal.
#[derive(Clone)]
pub struct Events {
    queue: mpsc::Sender<Queued>,
    dropped: Arc<AtomicU64>,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

impl Events {
    /// `client` should be one of its own, without a rate limit: the sender keeps `pace` (`--events-qps`, none:
    /// unlimited) itself, so that it can send a batch at once. Starts the sender task.
    pub fn new(client: kube::Client, instance: String, pace: Option<Arc<TokenBucket>>) -> Self {
        let (queue, queued) = mpsc::channel::<Queued>(MAX_QUEUED);
        tokio::spawn(sender::run(sender::Sender::new(client, instance), queued, pace));
        Self { queue, dropped: Arc::default() }
    }

    /// Events dropped because too many were in flight.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn pod_warning(&self, pod: &Pod, reason: Reason, note: String) {
        self.publish(pod.object_ref(&()), None, EventType::Warning, reason, note);
    }

    pub fn pod_normal(&self, pod: &Pod, reason: Reason, note: String) {
        self.publish(pod.object_ref(&()), None, EventType::Normal, reason, note);
    }

    /// A Normal event on `pod` about its claim `claim` (created, adopted): the claim is the event's `related`
    /// object, so each claim of the pod has its own series.
    pub fn pod_claim_normal(&self, pod: &Pod, claim: &ResourceClaim, reason: Reason, note: String) {
        self.publish(pod.object_ref(&()), Some(claim.object_ref(&())), EventType::Normal, reason, note);
    }

    /// A Warning on a PodGroup (upstream: a group claim that could not be found or created).
    pub fn pod_group_warning(&self, group: &PodGroup, reason: Reason, note: String) {
        self.publish(group.object_ref(&()), None, EventType::Warning, reason, note);
    }

    pub fn claim_normal(&self, claim: &ResourceClaim, reason: Reason, note: String) {
        self.publish(claim.object_ref(&()), None, EventType::Normal, reason, note);
    }

    pub fn claim_warning(&self, claim: &ResourceClaim, reason: Reason, note: String) {
        self.publish(claim.object_ref(&()), None, EventType::Warning, reason, note);
    }

    fn publish(
        &self,
        regarding: ObjectReference,
        related: Option<ObjectReference>,
        type_: EventType,
        reason: Reason,
        note: String,
    ) {
        if self.queue.try_send(Queued { regarding, related, type_, reason, note }).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What makes two events "the same" for aggregation (client-go's key, less the reporter, which is this process).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SeriesKey {
    /// Kind, namespace, name and UID of the object the event is about, then those of the related object.
    objects: String,
    type_: EventType,
    reason: Reason,
}

impl SeriesKey {
    fn new(regarding: &ObjectReference, related: Option<&ObjectReference>, type_: EventType, reason: Reason) -> Self {
        let part = |p: &Option<String>| p.clone().unwrap_or_default();
        let mut objects = Vec::with_capacity(8);
        for object in std::iter::once(regarding).chain(related) {
            objects.extend([part(&object.kind), part(&object.namespace), part(&object.name), part(&object.uid)]);
        }
        Self { objects: objects.join("/"), type_, reason }
    }
}

/// A sent Event, as far as a repeat needs it.
#[derive(Clone, Debug, PartialEq)]
struct Sent {
    namespace: String,
    name: String,
    count: i32,
    last: Timestamp,
}

/// Events sent within the window, by key, oldest first.
#[derive(Debug, Default)]
struct RecentEvents {
    by_key: HashMap<SeriesKey, Sent>,
    /// Keys in the order their events were created. An event repeated since stays in place: it is kept while its
    /// series is alive and holds back younger ones until then (harmless, and bounded by [`MAX_SERIES`]).
    created: VecDeque<SeriesKey>,
}

impl RecentEvents {
    /// Forgets events last seen a window ago, and the oldest beyond [`MAX_SERIES`].
    fn expire(&mut self, now: Timestamp) {
        while let Some(key) = self.created.front() {
            let alive = self.by_key.get(key).is_some_and(|sent| sent.last + SERIES_WINDOW > now);
            if alive && self.by_key.len() <= MAX_SERIES {
                return;
            }
            if let Some(key) = self.created.pop_front() {
                self.by_key.remove(&key);
            }
        }
    }

    fn repeat(&mut self, key: &SeriesKey, now: Timestamp) -> Option<Sent> {
        let sent = self.by_key.get_mut(key)?;
        sent.count += 1;
        sent.last = now;
        Some(sent.clone())
    }

    fn insert(&mut self, key: SeriesKey, sent: Sent) {
        self.created.push_back(key.clone());
        self.by_key.insert(key, sent);
    }

    /// Forgets a series whose Event is gone, from both maps: a key left behind in `created` would stand for the
    /// new series that reuses it, and evicting it early would drop the newest series instead of the oldest.
    /// (Rare: a 404 on a series patch; the scan is bounded by [`MAX_SERIES`].)
    fn forget(&mut self, key: &SeriesKey) {
        self.by_key.remove(key);
        self.created.retain(|created| created != key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> ObjectReference {
        ObjectReference {
            kind: Some("Pod".into()),
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            ..Default::default()
        }
    }

    /// The series of claim creations about pod `p<i>`.
    fn key(i: usize) -> SeriesKey {
        SeriesKey::new(&pod(&format!("p{i}")), None, EventType::Normal, Reason::ResourceClaimCreated)
    }

    fn sent(name: &str, last: Timestamp) -> Sent {
        Sent { namespace: "ns".into(), name: name.into(), count: 1, last }
    }

    #[test]
    fn repeats_within_the_window_count_on_one_event() {
        let t0 = Timestamp::UNIX_EPOCH;
        let mut recent = RecentEvents::default();
        let key = SeriesKey::new(&pod("p"), None, EventType::Warning, Reason::FailedResourceClaimCreation);
        assert_eq!(recent.repeat(&key, t0), None, "nothing sent yet");
        recent.insert(key.clone(), sent("p.1", t0));

        let later = t0 + SignedDuration::from_secs(300);
        recent.expire(later);
        let repeated = recent.repeat(&key, later).expect("within the window");
        assert_eq!((repeated.name.as_str(), repeated.count), ("p.1", 2));

        // The window counts from the last repeat.
        let after_first_window = t0 + SignedDuration::from_secs(420);
        recent.expire(after_first_window);
        assert_eq!(recent.repeat(&key, after_first_window).map(|s| s.count), Some(3));

        let quiet = after_first_window + SERIES_WINDOW;
        recent.expire(quiet);
        assert_eq!(recent.repeat(&key, quiet), None, "a window without repeats ends the series");
    }

    #[test]
    fn different_objects_types_and_reasons_are_different_events() {
        let a = SeriesKey::new(&pod("a"), None, EventType::Warning, Reason::FailedResourceClaimCreation);
        assert_ne!(a, SeriesKey::new(&pod("b"), None, EventType::Warning, Reason::FailedResourceClaimCreation));
        assert_ne!(a, SeriesKey::new(&pod("a"), None, EventType::Normal, Reason::FailedResourceClaimCreation));
        assert_ne!(a, SeriesKey::new(&pod("a"), None, EventType::Warning, Reason::ResourceClaimCreated));
        let mut recreated = pod("a");
        recreated.uid = Some("another-uid".into());
        assert_ne!(a, SeriesKey::new(&recreated, None, EventType::Warning, Reason::FailedResourceClaimCreation));
    }

    #[test]
    fn each_related_claim_is_its_own_series() {
        let claim = |name: &str| ObjectReference {
            kind: Some("ResourceClaim".into()),
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            ..Default::default()
        };
        let created = |related: Option<&ObjectReference>| {
            SeriesKey::new(&pod("p"), related, EventType::Normal, Reason::ResourceClaimCreated)
        };
        let (left, right) = (claim("p-left-abcde"), claim("p-right-fghij"));
        assert_ne!(created(Some(&left)), created(Some(&right)), "two claims of one pod");
        assert_ne!(created(Some(&left)), created(None));
        assert_eq!(created(Some(&left)), created(Some(&left.clone())), "a repeat about the same claim");
        // A related object never collides with a regarding object of the same parts.
        assert_ne!(
            SeriesKey::new(&left, None, EventType::Normal, Reason::ResourceClaimCreated),
            SeriesKey::new(&pod("p"), Some(&left), EventType::Normal, Reason::ResourceClaimCreated)
        );
    }

    #[test]
    fn remembers_at_most_max_series() {
        let now = Timestamp::UNIX_EPOCH;
        let mut recent = RecentEvents::default();
        for i in 0..MAX_SERIES + 10 {
            recent.expire(now);
            recent.insert(key(i), sent(&format!("p{i}.1"), now));
        }
        recent.expire(now);
        assert_eq!(recent.by_key.len(), MAX_SERIES);
        assert!(recent.repeat(&key(0), now).is_none(), "the oldest are forgotten first");
        assert!(recent.repeat(&key(MAX_SERIES + 9), now).is_some());
    }

    #[test]
    fn a_series_whose_event_was_deleted_starts_over_as_the_newest() {
        let now = Timestamp::UNIX_EPOCH;
        let mut recent = RecentEvents::default();
        recent.insert(key(0), sent("p0.1", now));
        for i in 1..MAX_SERIES {
            recent.insert(key(i), sent(&format!("p{i}.1"), now));
        }
        // The oldest series' Event was deleted (404 on its patch): it is forgotten and sent anew.
        recent.forget(&key(0));
        recent.insert(key(0), sent("p0.2", now));
        assert_eq!(recent.created.iter().filter(|k| **k == key(0)).count(), 1, "one place in the creation order");
        // One more series: the oldest now is p1, not the new p0.
        recent.insert(key(MAX_SERIES), sent("p-new.1", now));
        recent.expire(now);
        assert_eq!(recent.repeat(&key(0), now).map(|s| s.name), Some("p0.2".into()), "the new series is kept");
        assert!(recent.repeat(&key(1), now).is_none(), "the oldest is forgotten");
    }
}
