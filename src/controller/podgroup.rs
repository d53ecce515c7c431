//! PodGroup claims (KEP-5729: `GenericWorkload` + `DRAWorkloadResourceClaims`), as kube-controller-manager
//! handles them: a `scheduling.k8s.io` PodGroup's template claim becomes ONE ResourceClaim, owned by the PodGroup
//! (so the garbage collector deletes it with the group), recorded in `PodGroup.status.resourceClaimStatuses`,
//! shared by the member pods (each records it in its own status, see [`super::pod`]) and reserved for the
//! PodGroup; syncClaim drops the PodGroup from `reservedFor` once the group is gone ([`super::claim`]).
//!
//! All of it only when the API server serves `scheduling.k8s.io/v1beta1` podgroups and the controller may list
//! them ([`super::group_api`]: discovery at start, and again while they are not handled): on a cluster without
//! them the controller watches no PodGroups and treats every pod that names none as before.

use std::sync::Arc;

use super::store::{Act, CacheWriter, Change, feed};
use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use tracing::{debug, info, instrument};

use super::api_object;
use super::decide::Recorded;
use super::decide::Seen;
use super::decide::podgroup::{self as decide_group, GroupReservation};
use super::error::SyncError;
use super::events::Reason;
use super::index::object_key;
use super::pod::{cached_template, post_claim, template_not_found};
use super::queue::{ObjectKey, WorkKey};
use super::slim_claim::ResourceClaim;
use super::slim_pod_group::{GROUP, PodGroup, VERSION};
use super::{Context, POD_STATUS_FIELD_MANAGER};

/// Watches PodGroups into the cache; events enqueue the group and its member pods.
pub async fn run_informer(client: Client, namespace: Option<&str>, writer: CacheWriter<PodGroup>, ctx: &Context) {
    let api = match namespace {
        Some(ns) => Api::<PodGroup>::namespaced(client, ns),
        None => Api::<PodGroup>::all(client),
    };
    crate::kube_client::watch::watcher("podgroups", api, watcher::Config::default())
        .map(feed(writer))
        .for_each(|event| {
            super::cache::on_event("podgroups", event, |e| on_event(ctx, e));
            futures::future::ready(())
        })
        .await;
}

fn on_event(ctx: &Context, change: &Change<PodGroup>) {
    if !ctx.caches.groups_served() {
        // PodGroups served since start: nothing is handled until the informer has listed them all, then
        // everything is queued at once (`group_api::run_informer`).
        return;
    }
    for act in change.acts() {
        match act {
            Act::Shown(group) => group_shown(ctx, group),
            Act::Deleted(group) => group_deleted(ctx, group),
        }
    }
}

/// A PodGroup as the store now shows it: it may need its claims, its members may need them recorded.
pub(super) fn group_shown(ctx: &Context, group: &PodGroup) {
    let (needed, reason) = decide_group::pod_group_needs_work(group, |name| {
        ctx.caches.claim(&group.namespace().unwrap_or_default(), name).is_some()
    });
    if needed {
        debug!(podgroup = %object_key(group), reason, "PodGroup needs work");
        ctx.queue.add(WorkKey::PodGroup(object_key(group)));
    }
    enqueue_members(ctx, group);
}

/// Its reservations go now (upstream: the deleted PodGroup's claims are queued); its claims follow by the garbage
/// collector, through their owner reference.
fn group_deleted(ctx: &Context, group: &PodGroup) {
    let namespace = group.namespace().unwrap_or_default();
    if ctx.quota.forget(&WorkKey::PodGroup(object_key(group))) {
        ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
    }
    if let Some(uid) = group.metadata.uid.as_deref() {
        ctx.caches.group_gone(uid);
        for key in ctx.caches.claims_by_owner.get(uid) {
            ctx.queue.add(WorkKey::Claim(key));
        }
    }
    for name in recorded_claims(group) {
        ctx.queue.add(WorkKey::Claim(ObjectKey::new(namespace.clone(), name)));
    }
    enqueue_members(ctx, group);
}

fn recorded_claims(group: &PodGroup) -> Vec<String> {
    let statuses = group.status.as_ref().and_then(|s| s.resource_claim_statuses.as_deref()).unwrap_or_default();
    statuses.iter().filter_map(|s| s.resource_claim_name.clone()).collect()
}

/// Member pods may have a group claim to record or reserve now.
fn enqueue_members(ctx: &Context, group: &PodGroup) {
    let namespace = group.namespace().unwrap_or_default();
    for key in ctx.caches.pods_by_group.get(&format!("{namespace}/{}", group.name_any())) {
        if let Some(pod) = ctx.caches.pod(&key) {
            super::cache::enqueue_pod(ctx, &pod, false);
        }
    }
}

/// Enqueues the PodGroup `key` when it is cached and needs work (a claim event for one of its claims).
pub fn enqueue_group(ctx: &Context, key: &ObjectKey) {
    if ctx.caches.groups_served()
        && let Some(group) = ctx.caches.pod_group(&key.namespace, &key.name)
    {
        group_shown(ctx, &group);
    }
}

/// Enqueues the PodGroups of `namespace` that use template `template` (it may have been created late).
pub fn enqueue_groups_using(ctx: &Context, namespace: &str, template: &str) {
    for group in ctx.caches.pod_groups.state() {
        let uses = decide_group::group_claims(&group)
            .iter()
            .any(|gc| gc.resource_claim_template_name.as_deref() == Some(template));
        if uses && group.namespace().as_deref() == Some(namespace) {
            ctx.queue.add(WorkKey::PodGroup(object_key(&*group)));
        }
    }
}

/// syncPodGroup: give every template claim of the PodGroup its one claim (found or created) and record them
/// all in ONE status apply.
#[instrument(level = "debug", skip(ctx, key), fields(podgroup = %key))]
pub async fn sync_pod_group(ctx: &Context, key: &ObjectKey) -> Result<(), SyncError> {
    let Some(group) = ctx.caches.pod_group(&key.namespace, &key.name) else {
        debug!("PodGroup is gone");
        return Ok(());
    };
    if group.metadata.deletion_timestamp.is_some() || ctx.foreign.observe_only() {
        return Ok(());
    }
    let quota_changes = ctx.quota.changes();
    let mut to_record = Vec::new();
    for gc in decide_group::group_claims(&group) {
        match handle_group_claim(ctx, &group, gc).await {
            Ok(Some(claim)) => to_record.push((gc.name.clone(), claim)),
            Ok(None) => {}
            Err(err) => {
                // As upstream: a Warning on the PodGroup (`kubectl describe podgroup` shows why its pods wait),
                // and the sync ends at the first failed claim.
                let note = format!("PodGroupResourceClaim {}: {err}", gc.name);
                ctx.events.pod_group_warning(&group, Reason::FailedResourceClaimCreation, note);
                let work = WorkKey::PodGroup(key.clone());
                super::quota::after_failure(ctx, &key.namespace, &work, quota_changes, &[&err]);
                return Err(err);
            }
        }
    }
    if !to_record.is_empty() {
        apply_statuses(ctx, &group, &to_record).await?;
    }
    Ok(())
}

/// One claim of the PodGroup (upstream `handlePodGroupClaim`): the name of the claim to record, found or created,
/// or `None` when nothing is to be recorded.
async fn handle_group_claim(
    ctx: &Context,
    group: &PodGroup,
    gc: &k8s_openapi::api::core::v1::PodResourceClaim,
) -> Result<Option<String>, SyncError> {
    let Some(template) = gc.resource_claim_template_name.as_deref() else { return Ok(None) };
    match decide_group::group_recorded(group, &gc.name) {
        Recorded::NoClaimNeeded => return Ok(None),
        Recorded::Claim(name) if recorded_claim_exists(ctx, group, name).await? => return Ok(None),
        Recorded::Claim(_) | Recorded::Missing => {}
    }
    let claim = match ctx.caches.group_claim(group, &gc.name) {
        Some(found) => found,
        None => create_claim(ctx, group, &gc.name, template).await?,
    };
    Ok(Some(claim.name_any()))
}

/// Upstream `claimExists` for a PodGroup: the informer first, then a live GET; a claim that is gone or not the
/// group's is replaced.
async fn recorded_claim_exists(ctx: &Context, group: &PodGroup, name: &str) -> Result<bool, SyncError> {
    let namespace = group.namespace().unwrap_or_default();
    let claim = match ctx.caches.claim(&namespace, name) {
        Some(claim) => Some(claim),
        None => api_object::namespaced::<ResourceClaim>(ctx.client.clone(), &namespace)
            .get_opt(name)
            .await
            .map_err(|source| SyncError::GetClaim { claim: ObjectKey::new(namespace.clone(), name), source })?
            .map(|c| Arc::new(c.object)),
    };
    let exists = claim.is_some_and(|c| decide_group::is_for_pod_group(&c, group));
    if !exists {
        info!(claim = name, "the recorded claim is gone or not the PodGroup's: replacing it");
        // Remembered as created, it would be found and recorded again (a claim deleted while the watch was down).
        if let Some(uid) = group.metadata.uid.as_deref() {
            ctx.caches.forget_created(uid, name);
        }
    }
    Ok(exists)
}

async fn create_claim(
    ctx: &Context,
    group: &PodGroup,
    group_claim: &str,
    template_name: &str,
) -> Result<Arc<ResourceClaim>, SyncError> {
    let namespace = group.namespace().unwrap_or_default();
    let template =
        cached_template(ctx, &namespace, template_name).ok_or_else(|| template_not_found(&namespace, template_name))?;
    let desired = decide_group::desired_group_claim(group, group_claim, &template)
        .map_err(|source| SyncError::Template { template: template_name.to_string(), source })?;
    let created = post_claim(ctx, &namespace, desired, group_claim, template_name, (GROUP, "PodGroup")).await?;
    if let Some(uid) = group.metadata.uid.as_deref() {
        ctx.caches.remember_created(uid, created.clone());
    }
    debug!(claim = %created.name_any(), group_claim, template = template_name, "created ResourceClaim for PodGroup");
    let note = format!(
        "Created ResourceClaim {} from template {template_name} for claim {group_claim} of PodGroup {}",
        created.name_any(),
        group.name_any()
    );
    ctx.events.claim_normal(&created, Reason::ResourceClaimCreated, note);
    Ok(created)
}

/// ONE server-side apply of the PodGroup's complete, sorted `resourceClaimStatuses`, under the field manager
/// kube-controller-manager uses, with the PodGroup's UID as precondition.
async fn apply_statuses(ctx: &Context, group: &PodGroup, new: &[(String, String)]) -> Result<(), SyncError> {
    let key = object_key(group);
    let patch = json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": "PodGroup",
        "metadata": {"name": key.name, "namespace": key.namespace, "uid": group.metadata.uid},
        "status": {"resourceClaimStatuses": decide_group::merged_group_statuses(group, new)},
    });
    let params = PatchParams::apply(POD_STATUS_FIELD_MANAGER).force();
    Api::<PodGroup>::namespaced(ctx.client.clone(), &key.namespace)
        .patch_status(&key.name, &params, &Patch::Apply(&patch))
        .await
        .map_err(|source| SyncError::ApplyPodGroupStatus { group: key.clone(), source })?;
    debug!(entries = new.len(), "recorded claims in the PodGroup status");
    Ok(())
}

/// Whose claim a pod claim is (upstream `BindTo`).
#[derive(Debug)]
pub enum Membership {
    /// The pod's own (not in a PodGroup, or no matching group claim).
    Own,
    /// The PodGroup's; `None` while the group's claim does not exist yet (the PodGroup's sync creates it, and its
    /// watch event brings the pod back).
    Group(Option<Arc<ResourceClaim>>),
    /// The pod names a PodGroup that is not in the cache.
    MissingGroup(ObjectKey),
    /// The pod names a PodGroup, and PodGroups are not handled (not served, not listable, or not listed yet):
    /// the claim is probably the group's, so none is made for the pod.
    GroupsNotHandled(ObjectKey),
}

/// Upstream `BindTo` + the PodGroup branch of `handleClaim`: whose claim `pod_claim` is, and the group's claim.
pub fn member_claim(
    ctx: &Context,
    pod: &super::slim_pod::Pod,
    pod_claim: &k8s_openapi::api::core::v1::PodResourceClaim,
) -> Membership {
    let Some(group_name) = decide_group::pod_group_name(pod) else {
        return Membership::Own;
    };
    let namespace = pod.namespace().unwrap_or_default();
    if !ctx.caches.groups_served() {
        ctx.group_api.nudge();
        return Membership::GroupsNotHandled(ObjectKey::new(namespace, group_name));
    }
    let Some(group) = ctx.caches.pod_group(&namespace, group_name) else {
        return Membership::MissingGroup(ObjectKey::new(namespace, group_name));
    };
    if !decide_group::binds_to_group(pod, pod_claim, &group) {
        return Membership::Own;
    }
    // The claim the PodGroup records, where it is the group's: every member records the same one even where two
    // exist (a create whose answer was lost, made again before the first showed), not the oldest for some and the
    // recorded one for others: one claim shared is two allocations split.
    let recorded = match decide_group::group_recorded(&group, &pod_claim.name) {
        Recorded::Claim(name) => ctx.caches.claim_of_group(&group, name),
        Recorded::Missing | Recorded::NoClaimNeeded => None,
    };
    Membership::Group(recorded.or_else(|| ctx.caches.group_claim(&group, &pod_claim.name)))
}

/// syncClaim's rule for a PodGroup in `reservedFor`: whether to keep it (upstream: known deleted → drop; in the
/// cache → keep unless replaced; not in the cache → ask the API server, as the scheduler may be placing the
/// group's pods right now; here also when the cache holds another PodGroup of that name). Without the PodGroup API
/// the entry is kept, as any consumer this controller does not know.
pub async fn keep_group_reservation(
    ctx: &Context,
    namespace: &str,
    consumer: &k8s_openapi::api::resource::v1::ResourceClaimConsumerReference,
) -> Result<bool, SyncError> {
    if !ctx.caches.groups_served() {
        return Ok(true);
    }
    let deleted = ctx.caches.was_deleted(&consumer.uid);
    let cached = ctx.caches.pod_group(namespace, &consumer.name);
    let cached_uid = cached.as_ref().and_then(|g| g.metadata.uid.clone());
    let mut verdict = decide_group::group_reservation(&consumer.uid, deleted, Seen::Cache(cached_uid.as_deref()));
    if verdict == GroupReservation::AskServer {
        let key = ObjectKey::new(namespace, consumer.name.clone());
        let live = Api::<PodGroup>::namespaced(ctx.client.clone(), namespace)
            .get_opt(&consumer.name)
            .await
            .map_err(|source| SyncError::GetPodGroup { group: key, source })?;
        let live_uid = live.and_then(|g| g.metadata.uid);
        verdict = decide_group::group_reservation(&consumer.uid, false, Seen::Server(live_uid.as_deref()));
    }
    match verdict {
        GroupReservation::Drop(why) => {
            debug!(podgroup = %consumer.name, why, "dropping reservation");
            Ok(false)
        }
        GroupReservation::Keep | GroupReservation::AskServer => Ok(true),
    }
}
