//! What the controller knows: informer caches of pods (stripped), claims and templates, secondary indexes over
//! them, the UIDs of recently deleted pods, and the claims it created that the claim informer has not shown yet.
//!
//! The informer handlers in this module only update indexes and enqueue keys; all decisions that write happen
//! in the workers ([`super::pod`], [`super::claim`]).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use super::slim_claim::ResourceClaim;
use super::slim_pod::Pod;
use super::slim_pod_group::PodGroup;
use super::slim_template::ResourceClaimTemplate;
use super::store::{Act, Cache, CacheWriter, Change, WriterDropped, feed};
use futures::StreamExt;
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::{debug, warn};

use super::Context;
use super::api_object::ApiObject;
use super::decide::{self, is_owned_by, pod_claim_name_annotation};
use super::index::{Index, object_key};
use super::queue::{ObjectKey, WorkKey};

/// How many deleted pod UIDs are remembered, so that a reservation for a just-deleted pod is dropped without an
/// API call. Deletions older than this are found by a live GET instead.
const DELETED_PODS_REMEMBERED: usize = 500;

/// Informer caches and indexes.
pub struct Caches {
    pub pods: Cache<Pod>,
    pub claims: Cache<ResourceClaim>,
    pub templates: Cache<ResourceClaimTemplate>,
    /// PodGroups (`scheduling.k8s.io/v1beta1`); stays empty when the API server does not serve them.
    pub pod_groups: Cache<PodGroup>,
    /// Whether PodGroups are handled: served, listable and listed ([`super::group_api`]); until then pods that
    /// name none are handled as before.
    groups_served: AtomicBool,
    /// Claims by the UID of their controlling pod or PodGroup (orphan adoption, a group's claim).
    pub(super) claims_by_owner: Index<ResourceClaim>,
    /// Pods by `namespace/podgroup` of the PodGroup they belong to.
    pub(super) pods_by_group: Index<Pod>,
    /// Pods by `namespace/claim-name` of every claim they name directly (`resourceClaimName`). A claim generated
    /// from a template leads to its pod through its owner reference instead, so the common case costs no entry.
    pods_by_named_claim: Index<Pod>,
    /// Pods by `namespace/template-name` of every template they use.
    pods_by_template: Index<Pod>,
    deleted_pods: Mutex<RecentSet>,
    created: Mutex<CreatedClaims>,
    /// Pod claim statuses this controller applied that the pod informer has not shown yet, by pod UID.
    applied: Mutex<HashMap<String, BTreeMap<String, String>>>,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches").field("pods", &self.pods.len()).field("claims", &self.claims.len()).finish()
    }
}

/// The writers that feed [`Caches`]; handed to [`run_informers`].
#[derive(Debug)]
pub struct Writers {
    pods: CacheWriter<Pod>,
    claims: CacheWriter<ResourceClaim>,
    templates: CacheWriter<ResourceClaimTemplate>,
    pod_groups: CacheWriter<PodGroup>,
}

impl Caches {
    pub fn new() -> (Self, Writers) {
        let (pods_writer, claims_writer) = (CacheWriter::new(), CacheWriter::new());
        let (templates_writer, pod_groups_writer) = (CacheWriter::new(), CacheWriter::new());
        let caches = Self {
            pods: pods_writer.as_reader(),
            claims: claims_writer.as_reader(),
            templates: templates_writer.as_reader(),
            pod_groups: pod_groups_writer.as_reader(),
            groups_served: AtomicBool::new(false),
            claims_by_owner: Index::new(|claim: &ResourceClaim| {
                owner_uid(claim).map(str::to_string).into_iter().collect()
            }),
            pods_by_group: Index::new(|pod: &Pod| {
                let ns = pod.namespace().unwrap_or_default();
                decide::podgroup::pod_group_name(pod).map(|g| format!("{ns}/{g}")).into_iter().collect()
            }),
            pods_by_named_claim: Index::new(|pod: &Pod| {
                let ns = pod.namespace().unwrap_or_default();
                decide::named_claim_names(pod).into_iter().map(|name| format!("{ns}/{name}")).collect()
            }),
            pods_by_template: Index::new(|pod: &Pod| {
                let ns = pod.namespace().unwrap_or_default();
                decide::pod_claims(pod)
                    .iter()
                    .filter_map(|pc| pc.resource_claim_template_name.as_ref())
                    .map(|template| format!("{ns}/{template}"))
                    .collect()
            }),
            deleted_pods: Mutex::default(),
            created: Mutex::default(),
            applied: Mutex::default(),
        };
        let writers = Writers {
            pods: pods_writer,
            claims: claims_writer,
            templates: templates_writer,
            pod_groups: pod_groups_writer,
        };
        (caches, writers)
    }

    /// Waits until all informers have listed once.
    pub async fn wait_synced(&self) -> Result<(), WriterDropped> {
        self.pods.wait_until_ready().await?;
        self.claims.wait_until_ready().await?;
        if self.groups_served() {
            self.pod_groups.wait_until_ready().await?;
        }
        self.templates.wait_until_ready().await
    }

    /// Records what discovery found at start (before the informers start), or that PodGroups served since were
    /// listed.
    pub fn set_groups_served(&self, served: bool) {
        self.groups_served.store(served, Ordering::Relaxed);
    }

    pub fn groups_served(&self) -> bool {
        self.groups_served.load(Ordering::Relaxed)
    }

    pub fn pod_group(&self, namespace: &str, name: &str) -> Option<Arc<PodGroup>> {
        self.pod_groups.get(namespace, name)
    }

    /// The claim generated for `group`'s claim `group_claim` (upstream `findPodGroupResourceClaim`): owned by the
    /// PodGroup, annotated with the claim's name; from the informer or created and not observed yet.
    pub fn group_claim(&self, group: &PodGroup, group_claim: &str) -> Option<Arc<ResourceClaim>> {
        let uid = group.metadata.uid.as_deref()?;
        self.oldest_owned(uid, group.metadata.namespace.as_deref().unwrap_or_default(), group_claim, |c| {
            decide::podgroup::is_for_pod_group(c, group)
        })
    }

    /// The claim `name` when it is `group`'s: from the informer, or created and not observed yet.
    pub fn claim_of_group(&self, group: &PodGroup, name: &str) -> Option<Arc<ResourceClaim>> {
        let namespace = group.metadata.namespace.as_deref().unwrap_or_default();
        self.claim_of_owner(namespace, group.metadata.uid.as_deref(), name, false)
            .filter(|c| decide::podgroup::is_for_pod_group(c, group))
    }

    /// A claim of `namespace` by name: from the informer, or created by us for the owner with UID `owner_uid` and
    /// not observed yet (with `confirmed`, not one a relist has not shown since: see [`Self::claims_relisted`]).
    fn claim_of_owner(
        &self,
        namespace: &str,
        owner_uid: Option<&str>,
        name: &str,
        confirmed: bool,
    ) -> Option<Arc<ResourceClaim>> {
        self.claim(namespace, name).or_else(|| {
            let created = lock(&self.created);
            let claim = created.by_pod.get(owner_uid?)?.iter().find(|c| c.name_any() == name)?;
            let unconfirmed = claim.metadata.uid.as_ref().is_some_and(|uid| created.unconfirmed.contains(uid));
            (!(confirmed && unconfirmed)).then(|| claim.clone())
        })
    }

    pub fn pod(&self, key: &ObjectKey) -> Option<Arc<Pod>> {
        self.pods.get(&key.namespace, &key.name)
    }

    pub fn claim(&self, namespace: &str, name: &str) -> Option<Arc<ResourceClaim>> {
        self.claims.get(namespace, name)
    }

    pub fn template(&self, namespace: &str, name: &str) -> Option<Arc<ResourceClaimTemplate>> {
        self.templates.get(namespace, name)
    }

    /// A claim of `pod`'s namespace by name: from the informer, or created by us and not observed yet (unless a
    /// relist did not show it since: then none, so that the pod's sync asks the API server).
    pub fn claim_for_pod(&self, pod: &Pod, name: &str) -> Option<Arc<ResourceClaim>> {
        self.claim_of_owner(&pod.namespace().unwrap_or_default(), pod.metadata.uid.as_deref(), name, true)
    }

    /// The claims' relist is complete: the claims created and not observed that it does not show were deleted while
    /// the watch was down, or created after the list was taken (their watch event is to come). Both stay
    /// remembered, so no orphan lookup can miss one and create a second, but pod lookups pass over them
    /// ([`Self::claim_for_pod`]), and their pods and PodGroups are returned to be synced: a recorded claim the
    /// informer does not show is read from the API server, and replaced when it is gone ([`Self::forget_created`]).
    /// Before, such a claim was taken for existing as long as its owner lived, and it never got another.
    pub fn claims_relisted(&self) -> Vec<WorkKey> {
        let mut created = lock(&self.created);
        let created = &mut *created;
        let mut owners = Vec::new();
        for claim in created.by_pod.values().flatten() {
            let Some(uid) = claim.metadata.uid.as_ref() else { continue };
            let namespace = claim.namespace().unwrap_or_default();
            let listed =
                self.claim(&namespace, &claim.name_any()).is_some_and(|c| c.metadata.uid.as_ref() == Some(uid));
            if listed || !created.unconfirmed.insert(uid.clone()) {
                continue;
            }
            if let Some((pod, _)) = decide::owning_pod(claim) {
                owners.push(WorkKey::Pod(ObjectKey::new(namespace, pod)));
            } else if let Some((group, _)) = decide::podgroup::owning_pod_group(claim) {
                owners.push(WorkKey::PodGroup(ObjectKey::new(namespace, group)));
            }
        }
        owners
    }

    /// The API server says the claim `name` created for the pod or PodGroup with UID `owner_uid` is gone (or is
    /// another's): it is no longer remembered (an orphan lookup would adopt it again).
    pub fn forget_created(&self, owner_uid: &str, name: &str) {
        let mut created = lock(&self.created);
        let created = &mut *created;
        if let Some(list) = created.by_pod.get_mut(owner_uid) {
            list.retain(|c| {
                let keep = c.name_any() != name;
                if !keep && let Some(uid) = c.metadata.uid.as_ref() {
                    created.unconfirmed.remove(uid);
                }
                keep
            });
            if list.is_empty() {
                created.by_pod.remove(owner_uid);
            }
        }
    }

    /// A claim generated earlier for pod claim `pod_claim` of `pod` that the pod's status does not record (the
    /// controller stopped between creating it and writing the status): owned by the pod, annotated with the pod
    /// claim's name. The oldest wins, so every replica and every restart picks the same one.
    pub fn orphan_for(&self, pod: &Pod, pod_claim: &str) -> Option<Arc<ResourceClaim>> {
        let uid = pod.metadata.uid.as_deref()?;
        self.oldest_owned(uid, &pod.namespace().unwrap_or_default(), pod_claim, |c| is_owned_by(c, pod))
    }

    /// The oldest claim of `namespace` whose controlling owner has UID `owner_uid`, annotated with `claim_name`
    /// and passing `owned` (informer and created-but-not-observed claims).
    fn oldest_owned(
        &self,
        owner_uid: &str,
        namespace: &str,
        claim_name: &str,
        owned: impl Fn(&ResourceClaim) -> bool,
    ) -> Option<Arc<ResourceClaim>> {
        let mut candidates: Vec<Arc<ResourceClaim>> = self
            .claims_by_owner
            .get(owner_uid)
            .iter()
            .filter_map(|key| self.claim(&key.namespace, &key.name))
            .chain(lock(&self.created).by_pod.get(owner_uid).cloned().unwrap_or_default())
            .filter(|c| c.namespace().as_deref() == Some(namespace))
            .filter(|c| owned(c) && pod_claim_name_annotation(c) == Some(claim_name))
            .collect();
        candidates.sort_by(|a, b| {
            (&a.metadata.creation_timestamp, a.name_any()).cmp(&(&b.metadata.creation_timestamp, b.name_any()))
        });
        candidates.into_iter().next()
    }

    /// Remembers a claim this controller created until the claim informer shows it. Unbounded on purpose: an
    /// entry leaves only when the informer has the claim, the API server says it is gone (or another's) or its pod
    /// is gone, so no eviction can ever make a retry create a duplicate (kube-controller-manager's bounded cache
    /// did, at 6–10k pods).
    ///
    /// The watch event may arrive before the create call returns: the store is checked under the same lock the
    /// claim handler takes after the store has the claim, so the entry is either never added or removed again.
    pub fn remember_created(&self, pod_uid: &str, claim: Arc<ResourceClaim>) {
        let mut created = lock(&self.created);
        let namespace = claim.namespace().unwrap_or_default();
        let seen = self.claim(&namespace, &claim.name_any()).is_some_and(|c| c.metadata.uid == claim.metadata.uid);
        if !seen {
            created.by_pod.entry(pod_uid.to_string()).or_default().push(claim);
        }
    }

    /// Claims created and not yet observed (for tests and metrics).
    pub fn created_pending(&self) -> usize {
        lock(&self.created).by_pod.values().map(Vec::len).sum()
    }

    /// Remembers pod claim statuses just applied, until the pod informer shows them. Without this, a sync that
    /// runs before the pod's watch event would adopt the claim again and apply the same status a second time
    /// (and a later apply of the full list would drop entries the cache does not show yet).
    pub fn remember_applied(&self, pod: &Pod, entries: &[(String, String)]) {
        let Some(uid) = pod.metadata.uid.as_deref() else { return };
        let mut applied = lock(&self.applied);
        // As for created claims: the pod's watch event may already be in the store (checked under the lock).
        let cached = self.pod(&object_key(pod)).filter(|p| p.metadata.uid.as_deref() == Some(uid));
        let shown = |pod_claim: &str, claim: &str| {
            cached.as_ref().is_some_and(|p| decide::recorded_claim(p, pod_claim) == Some(claim))
        };
        let missing: Vec<_> = entries.iter().filter(|(pc, claim)| !shown(pc, claim)).cloned().collect();
        if !missing.is_empty() {
            applied.entry(uid.to_string()).or_default().extend(missing);
        }
    }

    /// Statuses applied for the pod and not yet observed.
    pub fn applied_statuses(&self, pod: &Pod) -> Vec<(String, String)> {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return Vec::new();
        };
        lock(&self.applied)
            .get(uid)
            .map(|r| r.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    fn observed_pod(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        let mut applied = lock(&self.applied);
        let Some(record) = applied.get_mut(uid) else {
            return;
        };
        let statuses = pod.status.as_ref().and_then(|s| s.resource_claim_statuses.as_deref()).unwrap_or_default();
        // Once the pod shows an entry for a pod claim (ours or another writer's), the record has served.
        record.retain(|pod_claim, _| !statuses.iter().any(|s| &s.name == pod_claim));
        if record.is_empty() {
            applied.remove(uid);
        }
    }

    pub fn was_deleted(&self, pod_uid: &str) -> bool {
        lock(&self.deleted_pods).contains(pod_uid)
    }

    /// Pods that name `namespace/claim` directly.
    pub fn pods_naming_claim(&self, namespace: &str, claim: &str) -> Vec<ObjectKey> {
        self.pods_by_named_claim.get(&format!("{namespace}/{claim}"))
    }

    fn observed_claim(&self, claim: &ResourceClaim) {
        let (Some(owner), Some(uid)) = (owner_uid(claim), claim.metadata.uid.as_deref()) else {
            return;
        };
        let mut created = lock(&self.created);
        created.unconfirmed.remove(uid);
        if let Some(list) = created.by_pod.get_mut(owner) {
            list.retain(|c| c.metadata.uid.as_deref() != Some(uid));
            if list.is_empty() {
                created.by_pod.remove(owner);
            }
        }
    }

    /// A PodGroup was deleted: its reservations can go without an API call (upstream `deletedObjects`).
    pub(super) fn group_gone(&self, group_uid: &str) {
        lock(&self.deleted_pods).insert(group_uid);
        lock(&self.created).forget_owner(group_uid);
    }

    fn pod_gone(&self, pod_uid: &str) {
        lock(&self.deleted_pods).insert(pod_uid);
        lock(&self.created).forget_owner(pod_uid);
        lock(&self.applied).remove(pod_uid);
    }
}

/// The UID of a claim's controlling Pod or PodGroup.
fn owner_uid(claim: &ResourceClaim) -> Option<&str> {
    decide::owning_pod(claim).or_else(|| decide::podgroup::owning_pod_group(claim)).map(|(_, uid)| uid)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Default)]
struct CreatedClaims {
    by_pod: HashMap<String, Vec<Arc<ResourceClaim>>>,
    /// UIDs of remembered claims that a relist of the claims did not show ([`Caches::claims_relisted`]): deleted while
    /// the watch was down, or created after the list was taken. Pod lookups pass over them, so the API server is
    /// asked which.
    unconfirmed: HashSet<String>,
}

impl CreatedClaims {
    fn forget_owner(&mut self, owner_uid: &str) {
        for claim in self.by_pod.remove(owner_uid).unwrap_or_default() {
            if let Some(uid) = claim.metadata.uid.as_ref() {
                self.unconfirmed.remove(uid);
            }
        }
    }
}

/// A bounded set that forgets its oldest members first.
#[derive(Default)]
struct RecentSet {
    order: VecDeque<String>,
    members: HashSet<String>,
}

impl RecentSet {
    fn insert(&mut self, value: &str) {
        if self.members.insert(value.to_string()) {
            self.order.push_back(value.to_string());
            if self.order.len() > DELETED_PODS_REMEMBERED
                && let Some(oldest) = self.order.pop_front()
            {
                self.members.remove(&oldest);
            }
        }
    }

    fn contains(&self, value: &str) -> bool {
        self.members.contains(value)
    }
}

/// `Api` for all namespaces, or one.
fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Runs the three informers until the client's watches end (never, barring a bug: watch errors back off and
/// retry). Each event updates the store first, then the handler sees it.
pub async fn run_informers(client: Client, namespace: Option<String>, writers: Writers, ctx: Arc<Context>) {
    let namespace = namespace.as_deref();
    let pods = crate::kube_client::watch::watcher(
        "pods",
        api::<ApiObject<Pod>>(&client, namespace),
        watcher::Config::default(),
    )
    .map(feed(writers.pods))
    .for_each(|event| {
        on_event("pods", event, |e| on_pod_event(&ctx, e));
        futures::future::ready(())
    });
    let inspecting = ctx.clone();
    let claims = crate::kube_client::watch::watcher(
        "resourceclaims",
        api::<ApiObject<ResourceClaim>>(&client, namespace),
        watcher::Config::default(),
    )
    // Claims arrive reduced (slim_claim): managed fields are already down to the list of writers.
    .modify(move |claim| inspecting.foreign.inspect(&inspecting, &claim.object))
    .map(feed(writers.claims))
    .for_each(|event| {
        on_event("resourceclaims", event, |e| on_claim_event(&ctx, e));
        futures::future::ready(())
    });
    let templates = crate::kube_client::watch::watcher(
        "resourceclaimtemplates",
        api::<ApiObject<ResourceClaimTemplate>>(&client, namespace),
        watcher::Config::default(),
    )
    .map(feed(writers.templates))
    .for_each(|event| {
        on_event("resourceclaimtemplates", event, |e| on_template_event(&ctx, e));
        futures::future::ready(())
    });
    let pod_groups = super::group_api::run_informer(client, namespace, writers.pod_groups, &ctx);
    tokio::join!(pods, claims, templates, pod_groups);
}

pub(super) fn on_event<K>(resource: &str, change: Result<Change<K>, watcher::Error>, handle: impl FnOnce(&Change<K>)) {
    match change {
        Ok(change) => handle(&change),
        // The watcher backs off and retries by itself; a persistent error (e.g. RBAC) must still be visible.
        Err(err) => warn!(resource, error = %err, "watch failed; retrying with back-off"),
    }
}

fn on_pod_event(ctx: &Context, change: &Change<Pod>) {
    ctx.caches.pods_by_named_claim.apply(change);
    ctx.caches.pods_by_group.apply(change);
    ctx.caches.pods_by_template.apply(change);
    for act in change.acts() {
        match act {
            Act::Shown(pod) => pod_shown(ctx, pod),
            Act::Deleted(pod) => pod_deleted(ctx, pod),
        }
    }
}

/// Queues what the informers' handlers would queue for every object the caches show: a replica that begins to lead
/// kept no queue while it stood by ([`super::queue::WorkQueue::stand_by`]), as kube-controller-manager starts its
/// informers, whose first list queues everything, only once it leads. Pods deleted meanwhile are not in the caches;
/// their claims are, and a claim's sync drops the reservations of pods that are gone.
pub fn enqueue_everything(ctx: &Context) {
    for claim in ctx.caches.claims.state() {
        ctx.queue.add(WorkKey::Claim(object_key(claim.as_ref())));
    }
    for pod in ctx.caches.pods.state() {
        enqueue_pod_work(ctx, &pod);
    }
    for group in ctx.caches.pod_groups.state() {
        super::podgroup::group_shown(ctx, &group);
    }
}

/// A pod as the store now shows it: its claims may need work.
fn pod_shown(ctx: &Context, pod: &Pod) {
    ctx.foreign.inspect_pod(ctx, pod);
    ctx.caches.observed_pod(pod);
    enqueue_pod_work(ctx, pod);
}

/// Queues what a pod shown needs: its leftover claims, and the pod itself when it needs work.
fn enqueue_pod_work(ctx: &Context, pod: &Pod) {
    enqueue_unrecorded_claims(ctx, pod);
    enqueue_pod(ctx, pod, false);
}

/// A pod is gone: its claims are released, its records dropped. Only a pod with claims is remembered as deleted
/// (as upstream's `enqueuePod`): the set is bounded, and a namespace of claimless pods must not crowd out the pods
/// whose reservations it answers for.
fn pod_deleted(ctx: &Context, pod: &Pod) {
    if let Some(uid) = pod.metadata.uid.as_deref() {
        ctx.foreign.pod_gone(uid);
        if decide::has_claims(pod) {
            ctx.caches.pod_gone(uid);
        }
    }
    enqueue_pod(ctx, pod, true);
}

/// Enqueues the claims generated for `pod` that its status does not record: leftovers of a race with another
/// writer of the status, which syncClaim deletes once unused.
fn enqueue_unrecorded_claims(ctx: &Context, pod: &Pod) {
    let Some(uid) = pod.metadata.uid.as_deref() else { return };
    let recorded = decide::all_claim_names(pod);
    if recorded.is_empty() {
        return;
    }
    for key in ctx.caches.claims_by_owner.get(uid) {
        if !recorded.contains(&key.name.as_str()) {
            ctx.queue.add(WorkKey::Claim(key));
        }
    }
}

/// Enqueues the claims of a pod that no longer needs them, and the pod itself when it needs work. A pod with
/// no `spec.resourceClaims` counts too when the scheduler made it an extended-resource claim: that claim is
/// released and deleted like a generated one when the pod is done or deleted (as upstream's `enqueuePod`).
pub fn enqueue_pod(ctx: &Context, pod: &Pod, deleted: bool) {
    if !decide::has_claims(pod) {
        return;
    }
    let namespace = pod.namespace().unwrap_or_default();
    let going = deleted || pod.metadata.deletion_timestamp.is_some();
    if (going || decide::is_pod_done(pod)) && ctx.quota.forget(&WorkKey::Pod(object_key(pod))) {
        // Gone or done while a quota held back its claims: it must not take a later wake from a live pod.
        ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
    }
    if deleted || decide::is_pod_done(pod) {
        for name in decide::all_claim_names(pod) {
            ctx.queue.add(WorkKey::Claim(ObjectKey::new(namespace.clone(), name)));
        }
    }
    if deleted {
        return;
    }
    let (needed, reason) =
        decide::pod_needs_work(pod, &ctx.caches.applied_statuses(pod), |name| ctx.caches.claim_for_pod(pod, name));
    if needed {
        debug!(pod = %object_key(pod), reason, "pod needs work");
        ctx.queue.add(WorkKey::Pod(object_key(pod)));
    }
}

fn on_claim_event(ctx: &Context, change: &Change<ResourceClaim>) {
    ctx.caches.claims_by_owner.apply(change);
    for act in change.acts() {
        match act {
            Act::Shown(claim) => claim_shown(ctx, claim),
            Act::Deleted(claim) => claim_deleted(ctx, claim),
        }
    }
    if change.ends_relist() {
        for owner in ctx.caches.claims_relisted() {
            debug!(%owner, "a claim created for it is missing from the claims' relist: looking again");
            ctx.queue.add(owner);
        }
    }
}

fn claim_shown(ctx: &Context, claim: &ResourceClaim) {
    ctx.caches.observed_claim(claim);
    ctx.queue.add(WorkKey::Claim(object_key(claim)));
    enqueue_users(ctx, claim);
}

/// Its pods may need it created again.
fn claim_deleted(ctx: &Context, claim: &ResourceClaim) {
    ctx.caches.observed_claim(claim);
    enqueue_users(ctx, claim);
}

/// Pods using the claim may need work now: a missing claim to re-create, an allocation to reserve.
fn enqueue_users(ctx: &Context, claim: &ResourceClaim) {
    let namespace = claim.namespace().unwrap_or_default();
    // The pods that use it: those naming it, and the pod it was generated for.
    let mut pods = ctx.caches.pods_naming_claim(&namespace, &claim.name_any());
    if let Some((owner, _)) = decide::owning_pod(claim) {
        pods.push(ObjectKey::new(namespace.clone(), owner));
    }
    if let Some((group, _)) = decide::podgroup::owning_pod_group(claim) {
        // The group's claim changed: the group may have to record it, its pods to record or reserve it.
        super::podgroup::enqueue_group(ctx, &ObjectKey::new(namespace.clone(), group));
        pods.extend(ctx.caches.pods_by_group.get(&format!("{namespace}/{group}")));
    }
    for key in pods {
        if let Some(pod) = ctx.caches.pod(&key) {
            enqueue_pod(ctx, &pod, false);
        }
    }
}

fn on_template_event(ctx: &Context, change: &Change<ResourceClaimTemplate>) {
    for act in change.acts() {
        if let Act::Shown(template) = act {
            template_shown(ctx, template);
        }
    }
}

/// Pods and PodGroups waiting for the template may go on now.
fn template_shown(ctx: &Context, template: &ResourceClaimTemplate) {
    let namespace = template.namespace().unwrap_or_default();
    super::podgroup::enqueue_groups_using(ctx, &namespace, &template.name_any());
    for key in ctx.caches.pods_by_template.get(&format!("{namespace}/{}", template.name_any())) {
        if let Some(pod) = ctx.caches.pod(&key) {
            enqueue_pod(ctx, &pod, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid"},
            "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}
        }))
        .expect("pod")
    }

    fn claim(name: &str, uid: &str, created: &str) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "creationTimestamp": created,
                         "annotations": {decide::POD_CLAIM_NAME_ANNOTATION: "gpu"},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid", "controller": true}]},
            "spec": {"devices": {"requests": []}}
        }))
        .expect("claim")
    }

    #[test]
    fn a_created_claim_is_found_until_the_watch_shows_it() {
        let (caches, mut writers) = Caches::new();
        let created = Arc::new(claim("p-gpu-aaaaa", "c1", "2026-01-01T00:00:00Z"));
        caches.remember_created("pod-uid", created.clone());
        assert_eq!(caches.created_pending(), 1);
        // Known only from the record: found by name and adopted as the pod's orphan, never created twice.
        assert!(caches.claim_for_pod(&pod(), "p-gpu-aaaaa").is_some());
        assert_eq!(caches.orphan_for(&pod(), "gpu").map(|c| c.name_any()), Some("p-gpu-aaaaa".into()));

        let change = writers.claims.apply_watcher_event(watcher::Event::Apply((*created).clone()));
        caches.claims_by_owner.apply(&change);
        caches.observed_claim(&created);
        assert_eq!(caches.created_pending(), 0, "the record ends when the watch shows the claim");
        assert!(caches.claim_for_pod(&pod(), "p-gpu-aaaaa").is_some());

        // A create whose watch event came first is never recorded at all.
        caches.remember_created("pod-uid", created);
        assert_eq!(caches.created_pending(), 0);
    }

    #[test]
    fn the_oldest_orphan_wins() {
        let (caches, mut writers) = Caches::new();
        for c in
            [claim("p-gpu-newer", "c2", "2026-01-02T00:00:00Z"), claim("p-gpu-older", "c1", "2026-01-01T00:00:00Z")]
        {
            let change = writers.claims.apply_watcher_event(watcher::Event::Apply(c));
            caches.claims_by_owner.apply(&change);
        }
        assert_eq!(caches.orphan_for(&pod(), "gpu").map(|c| c.name_any()), Some("p-gpu-older".into()));
        assert!(caches.orphan_for(&pod(), "other").is_none(), "another pod claim's annotation never matches");
    }
}
