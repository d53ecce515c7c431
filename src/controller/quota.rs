//! Pods (and PodGroups) whose claims a ResourceQuota refused, looked at again when quota for claims comes free.
//!
//! A namespace's quota on devices (`<class>.deviceclass.resource.k8s.io/devices`) or on claims
//! (`count/resourceclaims.resource.k8s.io`) refuses a claim's create with 403 "exceeded quota". The pod is
//! admitted; only its claim waits. kube-controller-manager retries such a pod with its per-key back-off (5 ms
//! doubling to 1,000 s), so a pod refused for ten minutes gets its claim up to a quarter of an hour after quota
//! comes free, its GPUs idle meanwhile: the quota a team's finished Job pods give back goes unused.
//!
//! Here the controller watches ResourceQuotas and keeps, per quota, the claim limits in its status (`hard` and
//! `used` of those two kinds of resource). When one of them leaves more room (`used` down: the quota controller
//! counted a claim gone; `hard` up or gone; the quota deleted), as many refused keys of that namespace as there is
//! room for are queued at once, oldest refusal first. Nothing else wakes them: quota writes for other resources (a
//! pod's CPU, a ConfigMap count) and for claims taking room never do, so a namespace over its quota costs a refused
//! create per freed unit, not per write. A refused key is retried on its own at most every [`QUOTA_RETRY_MAX`]
//! (instead of up to 1,000 s) in case a change is missed, and is forgotten once its sync succeeds.
//!
//! A change that lands between the API server's refusal and the key being remembered would be missed; the changes
//! that left room are counted per namespace, and a key refused after one it could not have seen is queued again at
//! once. While the watch is not working (no permission: the chart grants it), nothing is remembered and refused keys
//! keep to the capped back-off.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tracing::{debug, info, warn};

use super::Context;
use super::decide::quota::{ClaimLimits, Refusal, claim_limits, refusal, room_freed};
use super::error::SyncError;
use super::queue::WorkKey;

/// Longest retry delay of a key a quota refused: the safety net when the quota's change is missed.
pub const QUOTA_RETRY_MAX: Duration = Duration::from_secs(60);

/// Whether `err` is a quota's refusal.
pub fn is_quota_refusal(err: &SyncError) -> bool {
    err.api_status().is_some_and(|(code, message)| refusal(code, message) == Refusal::Quota)
}

/// The keys a quota refused, oldest refusal first, and what the controller knows of the quotas.
#[derive(Debug, Default)]
pub struct QuotaWaits {
    state: Mutex<State>,
    /// Keys remembered (waiting or queued again and not yet through): lets a successful sync skip the lock.
    tracked: AtomicUsize,
    /// Whether the watch of ResourceQuotas has listed and is not failing.
    watching: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// Claim limits per quota (namespace, name), as last seen.
    quotas: HashMap<(String, String), ClaimLimits>,
    /// Changes that left room, per namespace.
    changes: HashMap<String, u64>,
    /// Keys waiting, per namespace, by the order of their first refusal.
    waiting: HashMap<String, BTreeMap<u64, WorkKey>>,
    /// Every remembered key's place in that order, kept while it is queued again after a change.
    first_refused: HashMap<WorkKey, u64>,
    next: u64,
}

impl QuotaWaits {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many changes that left room `namespace` has seen: read before a sync, handed to [`Self::wait`].
    pub fn changes(&self, namespace: &str) -> u64 {
        if !self.watching.load(Ordering::Relaxed) {
            return 0;
        }
        self.lock().changes.get(namespace).copied().unwrap_or(0)
    }

    /// Remembers `key`, refused for quota in `namespace` by a sync that began after `seen` changes there; true when
    /// room was left since (look again now). Nothing is remembered while the quota watch is not working.
    pub fn wait(&self, namespace: &str, key: WorkKey, seen: u64) -> bool {
        if !self.watching.load(Ordering::Relaxed) {
            return false;
        }
        let mut state = self.lock();
        let changed = state.changes.get(namespace).copied().unwrap_or(0) != seen;
        let place = match state.first_refused.get(&key) {
            Some(place) => *place,
            None => {
                state.next += 1;
                let place = state.next;
                state.first_refused.insert(key.clone(), place);
                place
            }
        };
        state.waiting.entry(namespace.to_string()).or_default().insert(place, key);
        self.tracked.store(state.first_refused.len(), Ordering::Relaxed);
        changed
    }

    /// `key` synced without a quota refusal (claims made, or the pod is gone): no longer remembered. True when it
    /// was.
    pub fn forget(&self, key: &WorkKey) -> bool {
        if self.tracked.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let mut state = self.lock();
        let Some(place) = state.first_refused.remove(key) else { return false };
        let (WorkKey::Pod(k) | WorkKey::Claim(k) | WorkKey::PodGroup(k)) = key;
        if let Some(waiting) = state.waiting.get_mut(&k.namespace) {
            waiting.remove(&place);
            if waiting.is_empty() {
                state.waiting.remove(&k.namespace);
            }
        }
        self.tracked.store(state.first_refused.len(), Ordering::Relaxed);
        true
    }

    /// Quota `name` of `namespace` is now `limits` (`None`: deleted). Returns the keys to queue again: as many as
    /// there is room for, oldest refusal first, when it left room for claims; none otherwise.
    pub fn quota_changed(&self, namespace: &str, name: &str, limits: Option<ClaimLimits>) -> Vec<WorkKey> {
        let mut state = self.lock();
        let id = (namespace.to_string(), name.to_string());
        let before = state.quotas.get(&id);
        let room = room_freed(before, limits.as_ref());
        // Every quota is kept, those without claim limits too: its status may add them later.
        let deleted = limits.is_none();
        match limits {
            Some(limits) => state.quotas.insert(id, limits),
            None => state.quotas.remove(&id),
        };
        // A namespace's count of changes goes with its last quota (a namespace deleted), unless keys wait there.
        if deleted && !state.waiting.contains_key(namespace) && !state.quotas.keys().any(|(ns, _)| ns == namespace) {
            state.changes.remove(namespace);
            return Vec::new();
        }
        let Some(room) = room else { return Vec::new() };
        *state.changes.entry(namespace.to_string()).or_default() += 1;
        let Some(waiting) = state.waiting.get_mut(namespace) else { return Vec::new() };
        let mut keys = Vec::new();
        while keys.len() < room {
            let Some((_, key)) = waiting.pop_first() else { break };
            keys.push(key);
        }
        if waiting.is_empty() {
            state.waiting.remove(namespace);
        }
        keys
    }

    /// The watch listed (true) or failed (false).
    fn set_watching(&self, on: bool) {
        self.watching.store(on, Ordering::Relaxed);
    }

    /// Keys remembered now (waiting, or queued again and not yet through).
    pub fn waiting(&self) -> usize {
        self.tracked.load(Ordering::Relaxed)
    }
}

/// After a failed sync of `key` in `namespace` (begun after `seen` changes that left room there): remembers it when
/// a quota refused one of its claims.
pub fn after_failure(ctx: &Context, namespace: &str, key: &WorkKey, seen: u64, errors: &[&SyncError]) {
    let Some((_, message)) =
        errors.iter().filter_map(|e| e.api_status()).find(|(c, m)| refusal(*c, m) == Refusal::Quota)
    else {
        return;
    };
    info!(%message, "waiting for quota: looked at again when a ResourceQuota of the namespace leaves room");
    if ctx.quota.wait(namespace, key.clone(), seen) {
        ctx.queue.add(key.clone());
    }
    ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
}

/// Watches ResourceQuotas and queues the refused keys of a namespace when one of its quotas leaves room for claims.
/// Without permission to watch them the controller works on, refused keys retried with the capped back-off alone;
/// that is said once.
pub async fn watch(client: Client, namespace: Option<String>, ctx: Arc<Context>) {
    let api: Api<ResourceQuota> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let failing = AtomicBool::new(false);
    watcher(api, watcher::Config::default())
        .default_backoff()
        .for_each(|event| {
            let changed = match event {
                Ok(watcher::Event::Apply(quota) | watcher::Event::InitApply(quota)) => {
                    Some((quota.metadata.namespace.clone(), quota.metadata.name.clone(), Some(claim_limits(&quota))))
                }
                Ok(watcher::Event::Delete(quota)) => {
                    Some((quota.metadata.namespace.clone(), quota.metadata.name.clone(), None))
                }
                Ok(watcher::Event::InitDone) => {
                    failing.store(false, Ordering::Relaxed);
                    ctx.quota.set_watching(true);
                    None
                }
                Ok(watcher::Event::Init) => None,
                Err(err) => {
                    ctx.quota.set_watching(false);
                    if failing.swap(true, Ordering::Relaxed) {
                        debug!(error = %err, "watch of ResourceQuotas still failing");
                    } else {
                        warn!(error = %err, "cannot watch ResourceQuotas (the chart grants list and watch): pods whose \
                              claims a quota refused are retried every {QUOTA_RETRY_MAX:?} at most, not when quota \
                              comes free");
                    }
                    None
                }
            };
            if let Some((Some(ns), Some(name), limits)) = changed {
                let keys = ctx.quota.quota_changed(&ns, &name, limits);
                if !keys.is_empty() {
                    debug!(namespace = %ns, quota = %name, keys = keys.len(), "a ResourceQuota left room for claims: \
                           looking again at the keys it refused");
                    keys.into_iter().for_each(|key| ctx.queue.add(key));
                }
            }
            futures::future::ready(())
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::queue::ObjectKey;

    fn limits(entries: &[(&str, Option<i64>, Option<i64>)]) -> ClaimLimits {
        entries.iter().map(|(r, h, u)| (r.to_string(), (*h, *u))).collect()
    }

    const GPUS: &str = "gpu.deviceclass.resource.k8s.io/devices";

    fn pod(name: &str) -> WorkKey {
        WorkKey::Pod(ObjectKey::new("team-a", name))
    }

    fn watching() -> QuotaWaits {
        let waits = QuotaWaits::default();
        waits.set_watching(true);
        assert!(waits.quota_changed("team-a", "gpus", Some(limits(&[(GPUS, Some(2), Some(2))]))).is_empty());
        waits
    }

    #[test]
    fn freed_room_wakes_that_many_keys_oldest_refusal_first_and_only_in_its_namespace() {
        let waits = watching();
        for name in ["p1", "p2", "p3"] {
            assert!(!waits.wait("team-a", pod(name), waits.changes("team-a")));
        }
        let other = WorkKey::Pod(ObjectKey::new("team-b", "q1"));
        assert!(!waits.wait("team-b", other.clone(), waits.changes("team-b")));
        assert_eq!(waits.waiting(), 4);

        // Usage up (another claim got in) or another resource's write: nobody.
        assert!(waits.quota_changed("team-a", "gpus", Some(limits(&[(GPUS, Some(2), Some(2))]))).is_empty());
        assert!(waits.quota_changed("team-a", "pods", Some(limits(&[]))).is_empty());
        // One GPU freed: the oldest refusal.
        assert_eq!(waits.quota_changed("team-a", "gpus", Some(limits(&[(GPUS, Some(2), Some(1))]))), vec![pod("p1")]);
        // It is refused again (it needed two): it keeps its place, ahead of p2.
        assert!(!waits.wait("team-a", pod("p1"), waits.changes("team-a")));
        assert!(waits.quota_changed("team-a", "gpus", Some(limits(&[(GPUS, Some(2), Some(2))]))).is_empty());
        assert_eq!(
            waits.quota_changed("team-a", "gpus", Some(limits(&[(GPUS, Some(2), Some(0))]))),
            vec![pod("p1"), pod("p2")]
        );
        // p2 got its claim; p3 still waits, and team-b's key was never woken.
        waits.forget(&pod("p2"));
        assert_eq!(waits.waiting(), 3, "p1 (queued again), p3, q1");
        assert_eq!(waits.quota_changed("team-a", "gpus", None), vec![pod("p3")]);
        waits.forget(&pod("p1"));
        waits.forget(&pod("p3"));
        assert_eq!(waits.waiting(), 1);
        waits.forget(&other);
        assert_eq!(waits.waiting(), 0);
    }

    #[test]
    fn a_key_refused_after_a_change_it_did_not_see_is_looked_at_again_at_once() {
        let waits = watching();
        let seen = waits.changes("team-a");
        // The quota controller wrote the freed usage while the create was on its way back.
        assert!(waits.quota_changed("team-a", "gpus", Some(limits(&[(GPUS, Some(2), Some(1))]))).is_empty());
        assert!(waits.wait("team-a", pod("p1"), seen));
        // A refusal after the change was seen waits for the next one.
        assert!(!waits.wait("team-a", pod("p2"), waits.changes("team-a")));
    }

    #[test]
    fn a_namespaces_count_of_changes_goes_with_its_last_quota() {
        let waits = watching();
        assert!(waits.quota_changed("team-a", "gpus", Some(limits(&[(GPUS, Some(2), Some(1))]))).is_empty());
        assert_eq!(waits.changes("team-a"), 1);
        assert!(waits.quota_changed("team-a", "gpus", None).is_empty());
        assert_eq!(waits.changes("team-a"), 0);
        assert!(waits.lock().quotas.is_empty() && waits.lock().changes.is_empty());
    }

    #[test]
    fn nothing_is_remembered_while_the_watch_does_not_work() {
        let waits = QuotaWaits::default();
        assert!(!waits.wait("team-a", pod("p1"), 0));
        assert_eq!(waits.waiting(), 0);
    }
}
