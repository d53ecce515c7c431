//! Feeds the [`Model`] from three watches (pods, claims, PodGroups; all namespaces), stamping every event with the time since
//! the soak started. A re-list marks what it no longer contains as gone, so a deletion missed during a watch gap
//! is still seen.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::task::JoinHandle;

use super::bed::resource;
use super::model::Model;

/// The shared model and the clock it is stamped with.
#[derive(Debug, Clone)]
pub struct Observed {
    pub model: Arc<Mutex<Model>>,
    pub start: Instant,
}

impl Observed {
    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    /// A copy of the model as it is now.
    pub fn snapshot(&self) -> Model {
        self.model.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Pod,
    Claim,
    Group,
}

/// Starts the watches; they run until the returned tasks are aborted.
pub fn start(client: &kube::Client, observed: &Observed) -> Vec<JoinHandle<()>> {
    let pods = ApiResource::erase::<Pod>(&());
    let groups = ApiResource::from_gvk(&GroupVersionKind::gvk("scheduling.k8s.io", "v1beta1", "PodGroup"));
    [(pods, Kind::Pod), (resource("ResourceClaim"), Kind::Claim), (groups, Kind::Group)]
        .into_iter()
        .map(|(ar, kind)| {
            let api = Api::<DynamicObject>::all_with(client.clone(), &ar);
            tokio::spawn(watch(api, kind, observed.clone()))
        })
        .collect()
}

async fn watch(api: Api<DynamicObject>, kind: Kind, observed: Observed) {
    let mut stream = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
    let mut relisted: Option<BTreeSet<String>> = None;
    while let Some(event) = stream.next().await {
        let event = match event {
            Ok(event) => event,
            Err(err) => {
                eprintln!("soak: watch error (retried): {err}");
                continue;
            }
        };
        let now = observed.now();
        let mut model = observed.model.lock().unwrap_or_else(PoisonError::into_inner);
        match event {
            Event::Init => relisted = Some(BTreeSet::new()),
            Event::InitApply(obj) => {
                if let (Some(seen), Some(uid)) = (relisted.as_mut(), obj.metadata.uid.clone()) {
                    seen.insert(uid);
                }
                apply(&mut model, kind, &obj, now);
            }
            Event::Apply(obj) => apply(&mut model, kind, &obj, now),
            Event::InitDone => {
                let seen = relisted.take().unwrap_or_default();
                let known: Vec<String> = match kind {
                    Kind::Pod => model.pods.values().filter(|p| p.gone_at.is_none()).map(|p| p.uid.clone()).collect(),
                    Kind::Claim => model.claims.values().filter(|c| c.alive()).map(|c| c.uid.clone()).collect(),
                    Kind::Group => {
                        model.groups.values().filter(|g| g.gone_at.is_none()).map(|g| g.uid.clone()).collect()
                    }
                };
                for uid in known.into_iter().filter(|uid| !seen.contains(uid)) {
                    gone(&mut model, kind, &uid, now);
                }
            }
            Event::Delete(obj) => {
                if let Some(uid) = obj.metadata.uid.as_deref() {
                    gone(&mut model, kind, uid, now);
                }
            }
        }
    }
}

fn apply(model: &mut Model, kind: Kind, obj: &DynamicObject, now: Duration) {
    let Ok(value) = serde_json::to_value(obj) else { return };
    match kind {
        Kind::Pod => model.pod_seen(&value, now),
        Kind::Claim => model.claim_seen(&value, now),
        Kind::Group => model.group_seen(&value),
    }
}

fn gone(model: &mut Model, kind: Kind, uid: &str, now: Duration) {
    match kind {
        Kind::Pod => model.pod_gone(uid, now),
        Kind::Claim => model.claim_gone(uid, now),
        Kind::Group => model.group_gone(uid, now),
    }
}
