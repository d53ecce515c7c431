//! Pods (and PodGroups) whose claims a ResourceQuota refused, and looking at them again the moment quota may
//! have come free.
//!
//! A namespace's quota on devices (`<class>.deviceclass.resource.k8s.io/devices`) or on claims
//! (`count/resourceclaims.resource.k8s.io`) refuses a claim's create with 403 "exceeded quota". The pod is
//! admitted; only its claim waits. kube-controller-manager retries such a pod with its per-key back-off (5 ms
//! doubling to 1,000 s), so a pod refused for ten minutes gets its claim up to a quarter of an hour after quota
//! comes free, its GPUs idle meanwhile: the quota a team's finished Job pods give back goes unused. Here a refused
//! key is remembered by namespace, and every change to a ResourceQuota of that namespace (the quota controller
//! writing the lower usage after a claim went, an administrator raising the limit) queues those keys at once. The
//! back-off still applies between quota changes, so a namespace over its quota costs no more requests than before.
//!
//! A quota change that lands between the API server's refusal and the key being remembered would be missed; each
//! namespace's changes are counted, and a key refused after a change it could not have seen is queued again at once.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::Client;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::{WatchStreamExt, watcher};
use tracing::{debug, info, warn};

use super::Context;
use super::error::SyncError;
use super::queue::WorkKey;

/// What a 403 from the API server means, read from its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// RBAC: the controller's ServiceAccount lacks a permission; an operator must grant it.
    Permission,
    /// A ResourceQuota of the namespace: the claim waits until quota comes free.
    Quota,
    /// Anything else that answers 403 (an admission webhook or policy): its message says why.
    Other,
}

/// The quota admission plugin's refusals (k8s.io/apiserver `admission/plugin/resourcequota`).
const QUOTA_MESSAGES: [&str; 4] =
    ["exceeded quota: ", "status unknown for quota: ", "insufficient quota to consume: ", "failed quota: "];

/// Reads a 403's message: the authorizer's says `User "<name>" cannot <verb> resource`, the quota plugin's one of
/// [`QUOTA_MESSAGES`].
pub fn refusal(message: &str) -> Refusal {
    if QUOTA_MESSAGES.iter().any(|m| message.contains(m)) {
        Refusal::Quota
    } else if message.contains("is forbidden: User \"") && message.contains(" cannot ") {
        Refusal::Permission
    } else {
        Refusal::Other
    }
}

/// The keys waiting for quota, by namespace, and how many quota changes each namespace has seen.
#[derive(Debug, Default)]
pub struct QuotaWaits {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    changes: HashMap<String, u64>,
    waiting: HashMap<String, HashSet<WorkKey>>,
}

impl QuotaWaits {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many quota changes `namespace` has seen: read before a sync, handed to [`Self::wait`] after a refusal.
    pub fn changes(&self, namespace: &str) -> u64 {
        self.lock().changes.get(namespace).copied().unwrap_or(0)
    }

    /// Remembers `key`, refused for quota in `namespace` by a sync that began after `seen` changes; true when a
    /// quota changed since (look again now: the change may be what frees it).
    pub fn wait(&self, namespace: &str, key: WorkKey, seen: u64) -> bool {
        let mut state = self.lock();
        let changed = state.changes.get(namespace).copied().unwrap_or(0) != seen;
        state.waiting.entry(namespace.to_string()).or_default().insert(key);
        changed
    }

    /// A ResourceQuota of `namespace` changed: the keys that were waiting there (no longer remembered; one
    /// refused again is remembered again).
    pub fn changed(&self, namespace: &str) -> Vec<WorkKey> {
        let mut state = self.lock();
        *state.changes.entry(namespace.to_string()).or_default() += 1;
        state.waiting.remove(namespace).map(|keys| keys.into_iter().collect()).unwrap_or_default()
    }

    /// Keys waiting for quota now.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.values().map(HashSet::len).sum()
    }
}

/// After a failed sync of `key` in `namespace` (begun after `seen` quota changes there): says what a refusal means
/// (a missing permission is an operator's to grant) and remembers a key refused for quota.
pub fn after_failure(ctx: &Context, namespace: &str, key: &WorkKey, seen: u64, errors: &[&SyncError]) {
    let refusals: Vec<(Refusal, &str)> = errors
        .iter()
        .filter_map(|e| e.api_status())
        .filter(|(code, _)| *code == 403)
        .map(|(_, message)| (refusal(message), message))
        .collect();
    if let Some((_, message)) = refusals.iter().find(|(r, _)| *r == Refusal::Permission) {
        warn!(%message, "forbidden: grant the controller's ServiceAccount this permission");
    }
    if let Some((_, message)) = refusals.iter().find(|(r, _)| *r == Refusal::Quota) {
        info!(%message, "waiting for quota: looked at again when a ResourceQuota of the namespace changes");
        if ctx.quota.wait(namespace, key.clone(), seen) {
            ctx.queue.add(key.clone());
        }
        ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
    }
}

/// Watches ResourceQuotas (their metadata: a change is all that matters) and queues the keys waiting in the
/// namespace of each one that changes. Without permission to watch them the controller works on, refused keys
/// retried with back-off alone; that is said once.
pub async fn watch(client: Client, namespace: Option<String>, ctx: Arc<Context>) {
    let api: Api<PartialObjectMeta<ResourceQuota>> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let failing = AtomicBool::new(false);
    watcher(api, watcher::Config::default())
        .default_backoff()
        .for_each(|event| {
            match event {
                Ok(watcher::Event::Apply(quota) | watcher::Event::InitApply(quota) | watcher::Event::Delete(quota)) => {
                    failing.store(false, Ordering::Relaxed);
                    let ns = quota.metadata.namespace.unwrap_or_default();
                    let keys = ctx.quota.changed(&ns);
                    if !keys.is_empty() {
                        debug!(namespace = %ns, keys = keys.len(), "a ResourceQuota changed: looking again at the keys \
                               waiting for quota");
                        ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
                    }
                    keys.into_iter().for_each(|key| ctx.queue.add(key));
                }
                Ok(_) => failing.store(false, Ordering::Relaxed),
                Err(err) if !failing.swap(true, Ordering::Relaxed) => warn!(
                    error = %err,
                    "cannot watch ResourceQuotas (the chart grants list and watch): pods whose claims a quota \
                     refused are retried with back-off alone, not when quota comes free"
                ),
                Err(err) => debug!(error = %err, "watch of ResourceQuotas still failing"),
            }
            futures::future::ready(())
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::queue::ObjectKey;

    #[test]
    fn refusals_are_told_apart_by_their_messages() {
        let table = [
            (
                r#"resourceclaims.resource.k8s.io "p-gpu-x7k2q" is forbidden: exceeded quota: gpus, requested: gpu.deviceclass.resource.k8s.io/devices=1, used: gpu.deviceclass.resource.k8s.io/devices=2, limited: gpu.deviceclass.resource.k8s.io/devices=2"#,
                Refusal::Quota,
            ),
            (
                r#"resourceclaims.resource.k8s.io "c" is forbidden: status unknown for quota: gpus, resources: count/resourceclaims.resource.k8s.io"#,
                Refusal::Quota,
            ),
            (
                r#"resourceclaims.resource.k8s.io "c" is forbidden: insufficient quota to consume: gpu.deviceclass.resource.k8s.io/devices"#,
                Refusal::Quota,
            ),
            (
                r#"resourceclaims.resource.k8s.io is forbidden: User "system:serviceaccount:gpu-dra:controller" cannot create resource "resourceclaims" in API group "resource.k8s.io" in the namespace "team-a""#,
                Refusal::Permission,
            ),
            (
                r#"resourceclaims.resource.k8s.io "c" is forbidden: ValidatingAdmissionPolicy 'no-admin' with binding 'b' denied request: admin access"#,
                Refusal::Other,
            ),
            (r#"admission webhook "claims.example.com" denied the request: no"#, Refusal::Other),
        ];
        for (message, expected) in table {
            assert_eq!(refusal(message), expected, "{message}");
        }
    }

    #[test]
    fn waiting_keys_go_back_on_a_change_of_their_namespace_only() {
        let waits = QuotaWaits::default();
        let pod = |name: &str| WorkKey::Pod(ObjectKey::new("team-a", name));
        let seen = waits.changes("team-a");
        assert!(!waits.wait("team-a", pod("p1"), seen));
        assert!(!waits.wait("team-a", pod("p2"), seen));
        assert!(!waits.wait("team-b", WorkKey::Pod(ObjectKey::new("team-b", "p3")), waits.changes("team-b")));
        assert_eq!(waits.waiting(), 3);

        let mut back = waits.changed("team-a");
        back.sort_by_key(|k| format!("{k}"));
        assert_eq!(back, vec![pod("p1"), pod("p2")]);
        assert_eq!(waits.waiting(), 1, "team-b's key stays");
        assert!(waits.changed("team-a").is_empty(), "given back once");
    }

    #[test]
    fn a_key_refused_after_a_change_it_did_not_see_is_looked_at_again_at_once() {
        let waits = QuotaWaits::default();
        let seen = waits.changes("team-a");
        // The quota controller wrote the freed usage while the create was on its way back.
        assert!(waits.changed("team-a").is_empty());
        assert!(waits.wait("team-a", WorkKey::Pod(ObjectKey::new("team-a", "p1")), seen));
        // A refusal after the change was seen waits for the next one.
        let seen = waits.changes("team-a");
        assert!(!waits.wait("team-a", WorkKey::Pod(ObjectKey::new("team-a", "p2")), seen));
    }
}
