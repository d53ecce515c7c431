//! syncClaim: keep `status.reservedFor` to pods that still need the claim, deallocate and unprotect a claim
//! nobody uses, delete the claims of finished pods, and remove duplicate generated claims.

use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaimConsumerReference;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use serde_json::json;
use tracing::{debug, info, instrument};

use super::Context;
use super::api_object::{self, ApiObject};
use super::queue::WorkKey;
use super::slim_claim::ResourceClaim;
use super::slim_pod::Pod;

/// How old an unrecorded duplicate must be before it is deleted: its creator may be between creating it and
/// recording it in the pod status.
const DUPLICATE_GRACE: Duration = Duration::from_secs(5);
/// How long one sync spends asking the API server about reserved pods its cache lacks (one GET each, throttled by
/// `--kube-api-qps`): what it found by then is written and the claim queued again, so that a claim reserved for
/// many pods gone (a Job's 200 workers force-deleted) is cleaned up over several syncs instead of none, each cut by
/// the sync timeout before it wrote anything. kube-controller-manager has no per-sync deadline to meet.
const RESERVATION_CHECK_BUDGET: Duration = Duration::from_secs(super::SYNC_TIMEOUT.as_secs() * 2 / 3);
use super::decide::{self, DELETE_PROTECTION_FINALIZER};
use super::error::SyncError;
use super::events::Reason;
use super::queue::ObjectKey;

/// Whether a pod named in `reservedFor` still needs the claim.
#[derive(Debug, PartialEq, Eq)]
enum Consumer {
    Alive,
    /// Deleted, replaced by a pod with another UID, or finished.
    Gone(&'static str),
}

#[instrument(level = "debug", skip(ctx, key), fields(claim = %key))]
pub async fn sync_claim(ctx: &Context, key: &ObjectKey) -> Result<(), SyncError> {
    let Some(claim) = ctx.caches.claim(&key.namespace, &key.name) else {
        return Ok(());
    };
    if remove_if_duplicate(ctx, key, &claim).await? || ctx.foreign.observe_only() {
        return Ok(());
    }

    let reserved = decide::reserved_for(&claim);
    let mut valid: Vec<ResourceClaimConsumerReference> = Vec::with_capacity(reserved.len());
    let started = tokio::time::Instant::now();
    let mut unchecked = false;
    for (index, consumer) in reserved.iter().enumerate() {
        if started.elapsed() > RESERVATION_CHECK_BUDGET {
            // The rest is kept as it is for now (a consumer is dropped only when known gone).
            valid.extend(reserved[index..].iter().cloned());
            unchecked = true;
            info!(
                checked = index,
                left = reserved.len() - index,
                "checking the claim's reservations takes long; \
                  writing what was found and checking the rest in another sync"
            );
            break;
        }
        let is_pod = consumer.resource == "pods" && consumer.api_group.as_deref().unwrap_or_default().is_empty();
        if decide::podgroup::is_group_consumer(consumer) {
            if super::podgroup::keep_group_reservation(ctx, &key.namespace, consumer).await? {
                valid.push(consumer.clone());
            }
            continue;
        }
        if !is_pod {
            valid.push(consumer.clone());
            continue;
        }
        match pod_consumer(ctx, &key.namespace, consumer).await? {
            Consumer::Alive => valid.push(consumer.clone()),
            Consumer::Gone(why) => debug!(pod = %consumer.name, why, "dropping reservation"),
        }
    }
    let has_finalizer = claim.finalizers().iter().any(|f| f == DELETE_PROTECTION_FINALIZER);
    let deleting = claim.metadata.deletion_timestamp.is_some();
    let removed = valid.len() < reserved.len();
    // Nobody uses it any more: give the devices back. Only claims the scheduler allocated carry the finalizer;
    // a claim whose allocation came with no consumer is left alone (it has not been used yet).
    if removed || (has_finalizer && deleting && valid.is_empty()) {
        let mut allocated = decide::is_allocated(&claim);
        let mut resource_version = claim.resource_version();
        let deallocate = valid.is_empty() && has_finalizer && allocated;
        if removed || deallocate {
            let mut status = json!({"reservedFor": valid});
            if deallocate {
                status["allocation"] = serde_json::Value::Null;
            }
            // The resourceVersion makes a concurrent change fail this write (retried) instead of being lost.
            let patch = json!({"metadata": {"resourceVersion": resource_version}, "status": status});
            let updated = claims(ctx, key)
                .patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|source| SyncError::UpdateClaimStatus { claim: key.clone(), source })?;
            allocated = decide::is_allocated(&updated.object);
            resource_version = updated.object.resource_version();
            debug!(reservations = valid.len(), deallocated = deallocate, "updated claim status");
        }
        if has_finalizer && !allocated {
            let finalizers: Vec<&String> =
                claim.finalizers().iter().filter(|f| *f != DELETE_PROTECTION_FINALIZER).collect();
            let patch = json!({"metadata": {"resourceVersion": resource_version, "finalizers": finalizers}});
            claims(ctx, key)
                .patch(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|source| SyncError::RemoveFinalizer { claim: key.clone(), source })?;
            debug!("removed the delete-protection finalizer");
        }
    }

    if unchecked {
        // After the informer shows the write (a sync of the cached claim would check the same pods again).
        ctx.queue.add_after(WorkKey::Claim(key.clone()), Duration::from_secs(1));
    } else if valid.is_empty() && !deleting {
        delete_if_pod_finished(ctx, key, &claim).await?;
    }
    Ok(())
}

fn claims(ctx: &Context, key: &ObjectKey) -> Api<ApiObject<ResourceClaim>> {
    api_object::namespaced(ctx.client.clone(), &key.namespace)
}

async fn pod_consumer(
    ctx: &Context,
    namespace: &str,
    consumer: &ResourceClaimConsumerReference,
) -> Result<Consumer, SyncError> {
    if ctx.caches.was_deleted(&consumer.uid) {
        return Ok(Consumer::Gone("pod was deleted"));
    }
    let pod_key = ObjectKey::new(namespace, consumer.name.clone());
    let pod = match ctx.caches.pod(&pod_key) {
        Some(pod) if pod.metadata.uid.as_deref() == Some(consumer.uid.as_str()) => pod,
        // Not in the cache, or another pod of that name there (not known deleted: checked above). The cache may lag
        // behind a new pod, also one created again under the name of a pod it still holds (a StatefulSet's or a
        // training job's worker recreated), so ask the API server before dropping anything. Upstream trusts a
        // cached pod of another UID and drops the new pod's reservation while its pod watch lags.
        _ => match live_pod(ctx, &pod_key).await? {
            Some(pod) => pod,
            None => return Ok(Consumer::Gone("pod not found")),
        },
    };
    Ok(if pod.metadata.uid.as_deref() != Some(consumer.uid.as_str()) {
        Consumer::Gone("pod was replaced by one with another UID")
    } else if decide::is_pod_done(&pod) {
        Consumer::Gone("pod is done")
    } else {
        Consumer::Alive
    })
}

/// The pod as the API server has it now; `None` when there is none of that name.
async fn live_pod(ctx: &Context, pod_key: &ObjectKey) -> Result<Option<std::sync::Arc<Pod>>, SyncError> {
    match api_object::namespaced::<Pod>(ctx.client.clone(), &pod_key.namespace).get_opt(&pod_key.name).await {
        Ok(pod) => Ok(pod.map(|pod| std::sync::Arc::new(pod.object))),
        Err(source) => Err(SyncError::GetPod { pod: pod_key.clone(), source }),
    }
}

/// Deletes an unreserved claim generated for a pod that is finished or was replaced. A pod that is not in the
/// cache is left to the garbage collector (the ownerReference).
async fn delete_if_pod_finished(ctx: &Context, key: &ObjectKey, claim: &ResourceClaim) -> Result<(), SyncError> {
    let Some((pod_name, pod_uid)) = decide::owning_pod(claim) else {
        return Ok(());
    };
    let pod_key = ObjectKey::new(key.namespace.clone(), pod_name);
    let Some(cached) = ctx.caches.pod(&pod_key) else {
        return Ok(());
    };
    // A cached pod with another UID proves the owner replaced only if the owner is known deleted; else the
    // cache may lag behind the owner (created again under the name of the pod it holds, its claim made by the
    // scheduler for its extended resources): ask the API server. Upstream deletes on the cached pod alone.
    let pod = if cached.metadata.uid.as_deref() == Some(pod_uid) || ctx.caches.was_deleted(pod_uid) {
        cached
    } else {
        match live_pod(ctx, &pod_key).await? {
            Some(pod) => pod,
            None => return Ok(()),
        }
    };
    let why = if pod.metadata.uid.as_deref() != Some(pod_uid) {
        "its pod was replaced by one with another UID"
    } else if decide::is_pod_done(&pod) {
        "its pod finished"
    } else {
        return Ok(());
    };
    delete_claim(ctx, key, claim).await?;
    debug!(pod = pod_name, why, "deleted claim");
    ctx.events.claim_normal(
        claim,
        Reason::ResourceClaimDeleted,
        format!("Deleted ResourceClaim: {why} (pod {pod_name})"),
    );
    Ok(())
}

/// Two controllers (or a crashed instance) can generate two claims for the same pod claim. The pod status names
/// the one that counts; another one, owned by the same pod for the same pod claim and neither allocated nor
/// reserved, is garbage and is deleted. Caches lag, so the decision is confirmed against the API server (the
/// live pod status and the live recorded claim), and a claim younger than [`DUPLICATE_GRACE`] is looked at again
/// later: its creator may be about to record it. Returns whether the claim was deleted.
async fn remove_if_duplicate(ctx: &Context, key: &ObjectKey, claim: &ResourceClaim) -> Result<bool, SyncError> {
    let (Some((pod_name, _)), Some(pod_claim)) = (decide::owning_pod(claim), decide::pod_claim_name_annotation(claim))
    else {
        return Ok(false);
    };
    if decide::is_allocated(claim)
        || !decide::reserved_for(claim).is_empty()
        || claim.metadata.deletion_timestamp.is_some()
    {
        return Ok(false);
    }
    let Some(cached_pod) = ctx.caches.pod(&ObjectKey::new(key.namespace.clone(), pod_name)) else {
        return Ok(false);
    };
    if !decide::is_owned_by(claim, &cached_pod)
        || decide::recorded_claim(&cached_pod, pod_claim).is_none_or(|r| r == key.name)
    {
        return Ok(false);
    }
    let age = claim
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| Timestamp::now().duration_since(t.0))
        .and_then(|d| Duration::try_from(d).ok())
        .unwrap_or_default();
    if age < DUPLICATE_GRACE {
        ctx.queue.add_after(WorkKey::Claim(key.clone()), DUPLICATE_GRACE - age);
        return Ok(false);
    }

    // Confirm with the API server: the live pod records another claim, and that claim exists and is the pod's.
    let pod_key = ObjectKey::new(key.namespace.clone(), pod_name);
    let Some(pod) = live_pod(ctx, &pod_key).await?.filter(|p| decide::is_owned_by(claim, p)) else { return Ok(false) };
    let Some(recorded) = decide::recorded_claim(&pod, pod_claim).filter(|r| *r != key.name).map(str::to_string) else {
        return Ok(false);
    };
    let live = claims(ctx, key).get_opt(&recorded).await.map_err(|source| SyncError::GetClaim {
        claim: ObjectKey::new(key.namespace.clone(), recorded.clone()),
        source,
    })?;
    if !live.is_some_and(|c| decide::is_owned_by(&c.object, &pod)) {
        return Ok(false);
    }
    delete_claim(ctx, key, claim).await?;
    info!(pod = pod_name, pod_claim, recorded = %recorded, "deleted duplicate generated claim");
    let note =
        format!("Deleted duplicate ResourceClaim for pod claim {pod_claim} of pod {pod_name}: the pod uses {recorded}");
    ctx.events.claim_normal(claim, Reason::DuplicateResourceClaimDeleted, note);
    Ok(true)
}

async fn delete_claim(ctx: &Context, key: &ObjectKey, claim: &ResourceClaim) -> Result<(), SyncError> {
    let params = DeleteParams {
        preconditions: Some(Preconditions { uid: claim.metadata.uid.clone(), resource_version: None }),
        ..Default::default()
    };
    match claims(ctx, key).delete(&key.name, &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => {
            debug!("claim already gone");
            Ok(())
        }
        Err(source) => Err(SyncError::DeleteClaim { claim: key.clone(), source }),
    }
}
