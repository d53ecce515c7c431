//! Pods (and PodGroups) whose claims a ResourceQuota refused, looked at again when quota for claims comes free.
//!
//! A namespace's quota on devices (`<class>.deviceclass.resource.k8s.io/devices`) or on claims
//! (`count/resourceclaims.resource.k8s.io`) refuses a claim's create with 403 "exceeded quota". The pod is
//! admitted; only its claim waits. kube-controller-manager retries such a pod with its per-key back-off (5 ms
//! doubling to 1,000 s), so a pod refused for ten minutes gets its claim up to a quarter of an hour after quota
//! comes free, its GPUs idle meanwhile: the quota a team's finished Job pods give back goes unused.
//!
//! Here the controller watches ResourceQuotas and keeps, per quota, the claim limits in its status (`hard` and
//! `used` of the resources a claim is charged with: [`super::decide::quota::claim_limits`]). When a change leaves
//! more room for some of them (`used` down: the quota controller counted a claim gone; `hard` up or gone; the quota
//! deleted), the refused keys of that namespace whose needs fit in the room every quota there leaves are queued at
//! once, oldest refusal first. A key's needs are what its refusal named (`requested:
//! <class>.deviceclass.resource.k8s.io/devices=2`): a pod waiting for another class, or for more devices than came
//! free, keeps its place and is passed over, so it neither takes a wake that cannot help it nor holds back the pod
//! behind it that the room fits. Quota writes that leave no room for claims (another claim counted in, a pod's CPU,
//! a ConfigMap count) wake nobody, so a namespace over its quota costs about a refused create per freed unit, not
//! per write. A refused key is also retried on its own, in case a change is missed: after [`QUOTA_RETRY`], doubling
//! with each refusal up to 1,000 s, and refused keys coming due together are let in 10 a second, so a Job of
//! thousands of waiting pods does not spend the client's limit on refused creates
//! ([`super::queue::WorkQueue::retry_refused`]; its back-off count is reset: a later failure of another kind starts
//! from 5 ms). It is forgotten once a sync is not
//! refused for quota or its pod is deleted or done. A key woken and refused again (the API server's quota admission can lag the watch
//! by a moment) is looked at once more after [`WOKEN_REFUSED_AGAIN`].
//!
//! A change that lands between the API server's refusal and the key being remembered would be missed: changes that
//! left room are numbered (one sequence for all namespaces, read before each sync with one atomic load), and a key
//! refused after a change in its namespace numbered above what its sync read is queued again at once. Without
//! permission to list ResourceQuotas (the chart grants it) nothing is remembered and refused keys keep to their own
//! retries.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::Client;
use kube::api::Api;
use kube::runtime::watcher;
use tracing::{debug, info, warn};

use super::Context;
use super::decide::quota::{ClaimLimits, Needs, Refusal, asks, claim_limits, freed_resources, needs, refusal, to_wake};
use super::error::SyncError;
use super::queue::WorkKey;

/// When a key a quota refused is first retried on its own (doubling with each refusal in a row): the safety net
/// when the quota's change is missed.
pub const QUOTA_RETRY: Duration = Duration::from_secs(60);
/// When a key woken by a quota's change and refused again is looked at once more.
pub const WOKEN_REFUSED_AGAIN: Duration = Duration::from_secs(1);

/// What to do with a key just refused for quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterRefusal {
    /// Wait for a quota's change (or the retry of its own).
    Wait,
    /// Look again now: room was left while its sync ran.
    Now,
    /// Look again after [`WOKEN_REFUSED_AGAIN`]: it was woken for room and refused anyway.
    Soon,
}

/// The keys a quota refused, oldest refusal first, and what the controller knows of the quotas.
#[derive(Debug, Default)]
pub struct QuotaWaits {
    state: Mutex<State>,
    /// Keys remembered (waiting or woken and not yet through): lets a successful sync skip the lock.
    tracked: AtomicUsize,
    /// Whether the quotas could be listed (a permission missing: not).
    watching: AtomicBool,
    /// The number of the last change that left room, in any namespace (`State::last_change`, readable without
    /// the lock: every pod sync reads it).
    last_change: AtomicU64,
    /// Refusals remembered so far (a key's last one is stamped with this count): tells a worker whether its sync
    /// was refused, whatever else failed after.
    refusals: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    /// Claim limits per quota (namespace, name), as last seen.
    quotas: HashMap<(String, String), ClaimLimits>,
    /// The sequence number of the last change that left room, overall and per namespace; a namespace without an
    /// entry reads `forgotten_up_to` (the last number of a namespace whose entry went with its last quota).
    last_change: u64,
    changes: HashMap<String, u64>,
    forgotten_up_to: u64,
    /// Keys waiting, per namespace, by the order of their first refusal, with what their last refusal said they
    /// need.
    waiting: HashMap<String, BTreeMap<u64, (WorkKey, Option<Needs>)>>,
    /// Every remembered key's place in that order, kept while it is woken and not yet through, and the stamp of its
    /// last refusal.
    first_refused: HashMap<WorkKey, (u64, u64)>,
    /// Keys woken by a change and not refused again since, with their needs: the room they are about to take.
    woken: HashMap<WorkKey, Option<Needs>>,
    next_place: u64,
}

impl State {
    fn changes_of(&self, namespace: &str) -> u64 {
        self.changes.get(namespace).copied().unwrap_or(self.forgotten_up_to)
    }
}

impl QuotaWaits {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The number of the last change that left room, in any namespace: read before a sync, handed to
    /// [`Self::wait`].
    pub fn changes(&self) -> u64 {
        self.last_change.load(Ordering::Relaxed)
    }

    /// Remembers `key`, refused for quota in `namespace` by a sync that began when the last change was `seen`,
    /// needing `needs` (what the refusals said, `None` when they did not); says when to look again, and whether
    /// the key is newly remembered. Nothing is remembered while the quotas cannot be listed.
    pub fn wait(&self, namespace: &str, key: WorkKey, seen: u64, needs: Option<Needs>) -> (AfterRefusal, bool) {
        if !self.watching.load(Ordering::Relaxed) {
            return (AfterRefusal::Wait, false);
        }
        let mut state = self.lock();
        let changed = state.changes_of(namespace) > seen;
        let woken = state.woken.remove(&key).is_some();
        let stamp = self.refusals.fetch_add(1, Ordering::Relaxed) + 1;
        let (place, new) = match state.first_refused.get(&key) {
            Some((place, _)) => (*place, false),
            None => {
                state.next_place += 1;
                (state.next_place, true)
            }
        };
        state.first_refused.insert(key.clone(), (place, stamp));
        state.waiting.entry(namespace.to_string()).or_default().insert(place, (key, needs));
        self.tracked.store(state.first_refused.len(), Ordering::Relaxed);
        let after = match (changed, woken) {
            (true, _) => AfterRefusal::Now,
            (false, true) => AfterRefusal::Soon,
            (false, false) => AfterRefusal::Wait,
        };
        (after, new)
    }

    /// The count of refusals remembered so far: read before a sync, handed to [`Self::forget_unless_refused_since`].
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// `key` synced without a quota refusal (claims made, or the pod is gone), or its pod went or finished: no
    /// longer remembered. True when it was.
    pub fn forget(&self, key: &WorkKey) -> bool {
        self.forget_unless_refused_since(key, u64::MAX)
    }

    /// [`Self::forget`], unless `key` was refused after the count of refusals was `since` (a sync whose claim a
    /// quota refused and whose pod status write then failed is still waiting for quota, in its place).
    pub fn forget_unless_refused_since(&self, key: &WorkKey, since: u64) -> bool {
        if self.tracked.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let mut state = self.lock();
        if state.first_refused.get(key).is_some_and(|(_, stamp)| *stamp > since) {
            return false;
        }
        state.woken.remove(key);
        let Some((place, _)) = state.first_refused.remove(key) else { return false };
        let namespace = namespace_of(key);
        if let Some(waiting) = state.waiting.get_mut(namespace) {
            waiting.remove(&place);
            if waiting.is_empty() {
                state.waiting.remove(namespace);
            }
        }
        self.tracked.store(state.first_refused.len(), Ordering::Relaxed);
        true
    }

    /// Quota `name` of `namespace` is now `limits` (`None`: deleted). Returns the keys to queue again: when the
    /// change left room for claims, those whose needs fit in the room every quota of the namespace leaves, oldest
    /// refusal first ([`to_wake`]).
    pub fn quota_changed(&self, namespace: &str, name: &str, limits: Option<ClaimLimits>) -> Vec<WorkKey> {
        let mut state = self.lock();
        let state = &mut *state;
        let id = (namespace.to_string(), name.to_string());
        let freed = freed_resources(state.quotas.get(&id), limits.as_ref());
        // Every quota is kept, those without claim limits too: its status may add them later.
        match limits {
            Some(limits) => state.quotas.insert(id, limits),
            None => state.quotas.remove(&id),
        };
        if freed.is_empty() {
            return Vec::new();
        }
        state.last_change += 1;
        self.last_change.store(state.last_change, Ordering::Relaxed);
        let in_namespace = state.quotas.iter().filter(|((ns, _), _)| ns == namespace).map(|(_, limits)| limits);
        let last_quota_gone = in_namespace.clone().count() == 0;
        let mut taken = Needs::new();
        for (_, needs) in state.woken.iter().filter(|(key, _)| namespace_of(key) == namespace) {
            for (resource, amount) in asks(needs.as_ref(), &freed) {
                *taken.entry(resource).or_default() += amount;
            }
        }
        let mut keys = Vec::new();
        if let Some(waiting) = state.waiting.get_mut(namespace) {
            let candidates = waiting.iter().map(|(place, (_, needs))| (*place, needs.as_ref()));
            for place in to_wake(in_namespace, &freed, taken, candidates) {
                if let Some((key, needs)) = waiting.remove(&place) {
                    state.woken.insert(key.clone(), needs);
                    keys.push(key);
                }
            }
            if waiting.is_empty() {
                state.waiting.remove(namespace);
            }
        }
        // A namespace's entry goes with its last quota (a namespace deleted) once nothing waits there; it then
        // reads the number of this change, so a sync begun before it still sees that it came.
        if last_quota_gone && !state.waiting.contains_key(namespace) {
            state.changes.remove(namespace);
            state.forgotten_up_to = state.last_change;
        } else {
            state.changes.insert(namespace.to_string(), state.last_change);
        }
        keys
    }

    /// The quotas are listed again: those not in `listed` were deleted meanwhile. Returns the keys to queue again.
    fn relisted(&self, listed: &HashSet<(String, String)>) -> Vec<WorkKey> {
        let gone: Vec<(String, String)> =
            self.lock().quotas.keys().filter(|id| !listed.contains(*id)).cloned().collect();
        gone.into_iter().flat_map(|(ns, name)| self.quota_changed(&ns, &name, None)).collect()
    }

    fn set_watching(&self, on: bool) {
        self.watching.store(on, Ordering::Relaxed);
    }

    /// Keys remembered now (waiting, or woken and not yet through).
    pub fn waiting(&self) -> usize {
        self.tracked.load(Ordering::Relaxed)
    }
}

/// After a failed sync of `key` in `namespace` (begun when the last change that left room there was `seen`):
/// remembers it when a quota refused one of its claims.
pub fn after_failure(ctx: &Context, namespace: &str, key: &WorkKey, seen: u64, errors: &[&SyncError]) {
    let refusals: Vec<&str> = errors
        .iter()
        .filter_map(|e| e.api_status())
        .filter(|(code, message)| refusal(*code, message) == Refusal::Quota)
        .map(|(_, message)| message)
        .collect();
    let Some(message) = refusals.first() else { return };
    let (after, first) = ctx.quota.wait(namespace, key.clone(), seen, needs(refusals.iter().copied()));
    match after {
        AfterRefusal::Now => ctx.queue.add(key.clone()),
        AfterRefusal::Soon => ctx.queue.add_after(key.clone(), WOKEN_REFUSED_AGAIN),
        AfterRefusal::Wait => {}
    }
    if first {
        info!(%message, "waiting for quota: looked at again when a ResourceQuota of the namespace leaves room");
    }
    ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
}

/// Watches ResourceQuotas and queues the refused keys of a namespace when one of its quotas leaves room for claims.
/// Without permission to list them the controller works on, refused keys retried on their own alone; that is said
/// once. A watch that breaks and resumes loses nothing (kube's watcher resumes from the last resourceVersion, or
/// lists again: quotas missing from that list were deleted meanwhile).
pub async fn watch(client: Client, namespace: Option<String>, ctx: Arc<Context>) {
    let api: Api<ResourceQuota> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let reported = AtomicBool::new(false);
    let mut listed: Option<HashSet<(String, String)>> = None;
    crate::kube_client::watch::watcher("resourcequotas", api, watcher::Config::default())
        .for_each(|event| {
            let mut keys = Vec::new();
            match event {
                Ok(event) => {
                    reported.store(false, Ordering::Relaxed);
                    match event {
                        watcher::Event::Init => listed = Some(HashSet::new()),
                        watcher::Event::InitApply(quota) => {
                            let (ns, name) = id(&quota);
                            if let Some(listed) = listed.as_mut() {
                                listed.insert((ns.clone(), name.clone()));
                            }
                            keys = ctx.quota.quota_changed(&ns, &name, Some(claim_limits(&quota)));
                        }
                        watcher::Event::InitDone => {
                            if let Some(listed) = listed.take() {
                                keys = ctx.quota.relisted(&listed);
                            }
                            ctx.quota.set_watching(true);
                        }
                        watcher::Event::Apply(quota) => {
                            let (ns, name) = id(&quota);
                            keys = ctx.quota.quota_changed(&ns, &name, Some(claim_limits(&quota)));
                        }
                        watcher::Event::Delete(quota) => {
                            let (ns, name) = id(&quota);
                            keys = ctx.quota.quota_changed(&ns, &name, None);
                        }
                    }
                }
                // The list itself refused (a missing permission): nothing can be woken, so nothing is remembered.
                Err(err @ watcher::Error::InitialListFailed(_)) => {
                    ctx.quota.set_watching(false);
                    if !reported.swap(true, Ordering::Relaxed) {
                        warn!(error = %err, "cannot list ResourceQuotas (the chart grants list and watch): pods whose \
                              claims a quota refused are retried with a back-off from {QUOTA_RETRY:?}, not when quota comes \
                              free");
                    }
                }
                // A broken watch resumes where it was: what is remembered stays valid.
                Err(err) => debug!(error = %err, "watch of ResourceQuotas interrupted; resuming"),
            }
            if !keys.is_empty() {
                debug!(keys = keys.len(), "a ResourceQuota left room for claims: looking again at the keys it refused");
                ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
                keys.into_iter().for_each(|key| ctx.queue.add(key));
            }
            futures::future::ready(())
        })
        .await;
}

/// A key's namespace.
fn namespace_of(key: &WorkKey) -> &str {
    let (WorkKey::Pod(k) | WorkKey::Claim(k) | WorkKey::PodGroup(k)) = key;
    &k.namespace
}

/// A quota's namespace and name.
fn id(quota: &ResourceQuota) -> (String, String) {
    (quota.metadata.namespace.clone().unwrap_or_default(), quota.metadata.name.clone().unwrap_or_default())
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

    fn gpus(hard: i64, used: i64) -> Option<ClaimLimits> {
        Some(limits(&[(GPUS, Some(hard), Some(used))]))
    }

    fn watching() -> QuotaWaits {
        let waits = QuotaWaits::default();
        waits.set_watching(true);
        assert!(waits.quota_changed("team-a", "gpus", gpus(2, 2)).is_empty());
        waits
    }

    #[test]
    fn freed_room_wakes_that_many_keys_oldest_refusal_first_and_only_in_its_namespace() {
        let waits = watching();
        for name in ["p1", "p2", "p3"] {
            assert_eq!(waits.wait("team-a", pod(name), waits.changes(), None), (AfterRefusal::Wait, true));
        }
        let other = WorkKey::Pod(ObjectKey::new("team-b", "q1"));
        assert_eq!(waits.wait("team-b", other.clone(), waits.changes(), None).0, AfterRefusal::Wait);
        assert_eq!(waits.waiting(), 4);

        // Usage up (another claim got in), a write of the same, or another resource's quota: nobody.
        assert!(waits.quota_changed("team-a", "gpus", gpus(2, 2)).is_empty());
        assert!(waits.quota_changed("team-a", "pods", Some(limits(&[]))).is_empty());
        // One GPU freed: the oldest refusal.
        assert_eq!(waits.quota_changed("team-a", "gpus", gpus(2, 1)), vec![pod("p1")]);
        // Refused again (it needed two) right after its wake: looked at once more soon; it keeps its place.
        assert_eq!(waits.wait("team-a", pod("p1"), waits.changes(), None), (AfterRefusal::Soon, false), "not new");
        assert_eq!(waits.wait("team-a", pod("p1"), waits.changes(), None).0, AfterRefusal::Wait, "once");
        assert!(waits.quota_changed("team-a", "gpus", gpus(2, 2)).is_empty());
        assert_eq!(waits.quota_changed("team-a", "gpus", gpus(2, 0)), vec![pod("p1"), pod("p2")]);
        // p2 got its claim; p3 still waits, and team-b's key was never woken.
        waits.forget(&pod("p2"));
        assert_eq!(waits.waiting(), 3, "p1 (woken), p3, q1");
        assert_eq!(waits.quota_changed("team-a", "gpus", None), vec![pod("p3")]);
        waits.forget(&pod("p1"));
        waits.forget(&pod("p3"));
        assert_eq!(waits.waiting(), 1);
        waits.forget(&other);
        assert_eq!(waits.waiting(), 0);
    }

    #[test]
    fn a_key_needing_another_class_keeps_its_place_while_the_freed_class_goes_to_the_next() {
        const A100: &str = "a100.deviceclass.resource.k8s.io/devices";
        let waits = watching();
        let both = |a100: i64, gpus: i64| Some(limits(&[(A100, Some(1), Some(a100)), (GPUS, Some(2), Some(gpus))]));
        assert!(waits.quota_changed("team-a", "gpus", both(1, 2)).is_empty());
        let needs = |resource: &str| Some([(resource.to_string(), 1)].into());
        assert_eq!(waits.wait("team-a", pod("a2"), waits.changes(), needs(A100)).0, AfterRefusal::Wait);
        assert_eq!(waits.wait("team-a", pod("g3"), waits.changes(), needs(GPUS)).0, AfterRefusal::Wait);
        // A GPU of the other class freed: the older A100 pod is passed over.
        assert_eq!(waits.quota_changed("team-a", "gpus", both(1, 1)), vec![pod("g3")]);
        // Then an A100: the A100 pod, which kept its place.
        assert_eq!(waits.quota_changed("team-a", "gpus", both(0, 1)), vec![pod("a2")]);
        assert_eq!(waits.waiting(), 2, "woken, not yet through");
    }

    #[test]
    fn a_key_woken_holds_its_room_until_it_is_through() {
        let waits = watching();
        // A second quota on the same GPUs (a team's and a project's), full too.
        assert!(waits.quota_changed("team-a", "project", Some(limits(&[(GPUS, Some(5), Some(5))]))).is_empty());
        let one = || Some([(GPUS.to_string(), 1)].into());
        for name in ["p1", "p2"] {
            assert_eq!(waits.wait("team-a", pod(name), waits.changes(), one()).0, AfterRefusal::Wait);
        }
        // A claim gone: the quota controller writes one quota, then the other. The first wakes nobody (the other is
        // still full); the second wakes p1 for the one GPU.
        assert!(waits.quota_changed("team-a", "gpus", gpus(2, 1)).is_empty());
        assert_eq!(
            waits.quota_changed("team-a", "project", Some(limits(&[(GPUS, Some(5), Some(4))]))),
            vec![pod("p1")]
        );
        // The team's quota raised before p1's claim is counted: one more GPU there, but the project's one free GPU
        // is p1's, so p2 is not woken to be refused.
        assert!(waits.quota_changed("team-a", "gpus", gpus(3, 1)).is_empty());
        // The project's limit raised as well: now p2.
        assert_eq!(
            waits.quota_changed("team-a", "project", Some(limits(&[(GPUS, Some(6), Some(4))]))),
            vec![pod("p2")]
        );
    }

    #[test]
    fn a_refusal_in_the_sync_that_then_failed_otherwise_keeps_the_key_in_its_place() {
        let waits = watching();
        let before = waits.refusals();
        assert_eq!(waits.wait("team-a", pod("p1"), waits.changes(), None), (AfterRefusal::Wait, true));
        // The same sync's pod status write failed: the worker's forget leaves the key waiting.
        assert!(!waits.forget_unless_refused_since(&pod("p1"), before));
        assert_eq!(waits.waiting(), 1);
        // A later sync that failed for something else, with no refusal: forgotten.
        assert!(waits.forget_unless_refused_since(&pod("p1"), waits.refusals()));
        assert_eq!(waits.waiting(), 0);
    }

    #[test]
    fn another_full_quota_of_the_namespace_holds_the_wake_back() {
        let waits = watching();
        assert!(waits.quota_changed("team-a", "claims", Some(limits(&[(CLAIMS, Some(4), Some(4))]))).is_empty());
        assert_eq!(waits.wait("team-a", pod("p1"), waits.changes(), None).0, AfterRefusal::Wait);
        // A GPU freed, but the claim count is full: nobody.
        assert!(waits.quota_changed("team-a", "gpus", gpus(2, 1)).is_empty());
        // The claim count freed: now p1.
        let claims = Some(limits(&[(CLAIMS, Some(4), Some(3))]));
        assert_eq!(waits.quota_changed("team-a", "claims", claims), vec![pod("p1")]);
    }

    const CLAIMS: &str = crate::controller::decide::quota::CLAIM_COUNT;

    #[test]
    fn a_key_refused_after_a_change_it_did_not_see_is_looked_at_again_at_once() {
        let waits = watching();
        let seen = waits.changes();
        // The quota controller wrote the freed usage while the create was on its way back.
        assert!(waits.quota_changed("team-a", "gpus", gpus(2, 1)).is_empty());
        assert_eq!(waits.wait("team-a", pod("p1"), seen, None).0, AfterRefusal::Now);
        // A refusal after the change was seen waits for the next one.
        assert_eq!(waits.wait("team-a", pod("p2"), waits.changes(), None).0, AfterRefusal::Wait);
    }

    #[test]
    fn a_namespaces_entry_goes_with_its_last_quota_and_its_deletion_still_counts() {
        let waits = watching();
        assert!(waits.quota_changed("team-a", "gpus", gpus(2, 1)).is_empty());
        let seen = waits.changes();
        assert_eq!(seen, 1);
        // The last quota deleted while a sync was under way: the entry goes, the change is still seen.
        assert!(waits.quota_changed("team-a", "gpus", None).is_empty());
        assert!(waits.lock().quotas.is_empty() && waits.lock().changes.is_empty());
        assert_eq!(waits.wait("team-a", pod("p1"), seen, None).0, AfterRefusal::Now);
        // Other namespaces without an entry read the same number: a key refused there after it waits.
        let other = WorkKey::Pod(ObjectKey::new("team-b", "q1"));
        assert_eq!(waits.wait("team-b", other, waits.changes(), None).0, AfterRefusal::Wait);
    }

    #[test]
    fn quotas_missing_from_a_new_list_were_deleted() {
        let waits = watching();
        assert_eq!(waits.wait("team-a", pod("p1"), waits.changes(), None).0, AfterRefusal::Wait);
        assert_eq!(waits.relisted(&HashSet::new()), vec![pod("p1")]);
        assert!(waits.lock().quotas.is_empty());
    }

    #[test]
    fn nothing_is_remembered_while_the_quotas_cannot_be_listed() {
        let waits = QuotaWaits::default();
        assert_eq!(waits.wait("team-a", pod("p1"), 0, None).0, AfterRefusal::Wait);
        assert_eq!(waits.waiting(), 0);
    }
}
