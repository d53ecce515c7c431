//! Kubernetes Events (events.k8s.io/v1) for operators. The recorder aggregates repeats of the same event into a
//! series, so a retried failure updates one Event instead of creating a storm.
//!
//! Events never slow the controller down: they queue for one background sender (one at a time, so repeats
//! aggregate), which uses a client with its own rate limit (`--events-qps`). At most [`MAX_QUEUED`] wait; beyond
//! that they are dropped and counted in `gpu_dra_controller_events_dropped_total`, as client-go's recorder drops
//! what it cannot send.

use super::slim_pod::Pod;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc;
use tracing::warn;

/// Events waiting to be sent; more are dropped.
pub const MAX_QUEUED: usize = 1000;

type Queued = (ObjectReference, EventType, Reason, String);

/// Event reasons, as operators filter them (`kubectl get events --field-selector reason=…`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Warning on a pod: a claim could not be created (same reason as kube-controller-manager).
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
    /// `client` should be one of its own, with its own rate limit. Starts the sender task.
    pub fn new(client: kube::Client, instance: String) -> Self {
        let reporter = Reporter { controller: super::CLAIM_FIELD_MANAGER.into(), instance: Some(instance) };
        let recorder = Recorder::new(client, reporter);
        let (queue, mut queued) = mpsc::channel::<Queued>(MAX_QUEUED);
        tokio::spawn(async move {
            while let Some((regarding, type_, reason, note)) = queued.recv().await {
                send(&recorder, regarding, type_, reason, note).await;
            }
        });
        Self { queue, dropped: Arc::default() }
    }

    /// Events dropped because too many were in flight.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn pod_warning(&self, pod: &Pod, reason: Reason, note: String) {
        self.publish(pod.object_ref(&()), EventType::Warning, reason, note);
    }

    pub fn pod_normal(&self, pod: &Pod, reason: Reason, note: String) {
        self.publish(pod.object_ref(&()), EventType::Normal, reason, note);
    }

    pub fn claim_normal(&self, claim: &ResourceClaim, reason: Reason, note: String) {
        self.publish(claim.object_ref(&()), EventType::Normal, reason, note);
    }

    pub fn claim_warning(&self, claim: &ResourceClaim, reason: Reason, note: String) {
        self.publish(claim.object_ref(&()), EventType::Warning, reason, note);
    }

    fn publish(&self, regarding: ObjectReference, type_: EventType, reason: Reason, note: String) {
        if self.queue.try_send((regarding, type_, reason, note)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn send(recorder: &Recorder, regarding: ObjectReference, type_: EventType, reason: Reason, mut note: String) {
    // The API limits an Event's note to 1 kB.
    if note.len() > 1024 {
        let mut cut = 1021;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
        note.push_str("...");
    }
    let event = Event {
        type_,
        reason: reason.as_str().into(),
        note: Some(note),
        action: reason.action().into(),
        secondary: None,
    };
    if let Err(err) = recorder.publish(&event, &regarding).await {
        warn!(
            reason = reason.as_str(),
            object = ?regarding.name,
            error = %err,
            "could not publish event (does the controller's role allow create/patch on events.k8s.io events?)"
        );
    }
}
