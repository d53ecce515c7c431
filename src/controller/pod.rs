//! syncPod: give every template claim of a pod its ResourceClaim (found, adopted or created), record them all in
//! ONE pod status write, and reserve allocated claims for the scheduled pod. A done pod gets nothing: its claims
//! are released and deleted by syncClaim, never created again.

use std::sync::Arc;

use super::api_object::{self, ApiObject};
use super::slim_claim::ResourceClaim;
use super::slim_pod::Pod;
use super::slim_template::{NewClaim, ResourceClaimTemplate};
use k8s_openapi::api::core::v1::PodResourceClaim;
use kube::Resource;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use tracing::{debug, info, instrument};

use super::decide::{self, ClaimSource, Recorded, RecordedVerdict, Seen};
use super::error::SyncError;
use super::events::Reason;
use super::podgroup::Membership;
use super::queue::{ObjectKey, WorkKey};
use super::{CLAIM_FIELD_MANAGER, Context, POD_STATUS_FIELD_MANAGER};

/// What became of one pod claim in this sync.
enum Outcome {
    /// Nothing to record (named claim, already recorded, or no claim needed).
    Unchanged,
    /// A claim to record in the pod status: created now or adopted.
    Record(String),
}

#[instrument(level = "debug", skip(ctx, key), fields(pod = %key))]
pub async fn sync_pod(ctx: &Context, key: &ObjectKey) -> Result<(), SyncError> {
    let Some(pod) = ctx.caches.pod(key) else {
        debug!("pod is gone");
        return Ok(());
    };
    if pod.metadata.deletion_timestamp.is_some() {
        debug!("pod is being deleted");
        return Ok(());
    }
    if decide::is_pod_done(&pod) {
        // Queued before it finished: a done pod needs no claims and gets no writes (see `pod_needs_work`).
        debug!("pod is done");
        return Ok(());
    }
    let observe_only = ctx.foreign.observe_only();
    let quota_changes = ctx.quota.changes();
    let applied = ctx.caches.applied_statuses(&pod);
    let mut to_record = Vec::new();
    let mut failed = None;
    for pod_claim in decide::pod_claims(&pod) {
        match handle_claim(ctx, &pod, pod_claim, &applied, observe_only).await {
            Ok(Outcome::Record(name)) => to_record.push((pod_claim.name.clone(), name)),
            Ok(Outcome::Unchanged) => {}
            Err(err) => {
                // Tell the operator on the pod, and stop there as upstream does: the pod starts only with all its
                // claims, and creating the later ones meanwhile would only charge them to the namespace's quota
                // (a Job's waiting pods could take all of another class's quota) or leave them unused.
                ctx.events.pod_warning(
                    &pod,
                    Reason::FailedResourceClaimCreation,
                    format!("PodResourceClaim {}: {err}", pod_claim.name),
                );
                failed = Some(err);
                break;
            }
        }
    }
    if let Some(err) = &failed {
        super::quota::after_failure(ctx, &key.namespace, &WorkKey::Pod(key.clone()), quota_changes, &[err]);
    }
    if !to_record.is_empty() {
        // Also when a later pod claim failed (upstream forgets them until the retry finds them by owner): recorded
        // now, the retry has less to do.
        let entries: Vec<(String, String)> = applied.iter().cloned().chain(to_record.iter().cloned()).collect();
        apply_claim_statuses(ctx, &pod, &entries).await?;
    }
    if let Some(err) = failed {
        return Err(err);
    }
    if decide::is_scheduled(&pod) && !observe_only {
        reserve_claims(ctx, &pod, &to_record).await?;
    }
    Ok(())
}

async fn handle_claim(
    ctx: &Context,
    pod: &Pod,
    pod_claim: &PodResourceClaim,
    applied: &[(String, String)],
    observe_only: bool,
) -> Result<Outcome, SyncError> {
    let template = match decide::claim_source_with(pod, pod_claim, applied) {
        ClaimSource::Named(_) | ClaimSource::Template { recorded: Recorded::NoClaimNeeded, .. } => {
            return Ok(Outcome::Unchanged);
        }
        ClaimSource::Unsupported => {
            return Err(SyncError::UnsupportedPodClaim { pod_claim: pod_claim.name.clone() });
        }
        ClaimSource::Template { recorded: Recorded::Claim(name), template } => {
            if recorded_claim_exists(ctx, pod, name).await? {
                return Ok(Outcome::Unchanged);
            }
            template
        }
        ClaimSource::Template { recorded: Recorded::Missing, template } => template,
    };

    match super::podgroup::member_claim(ctx, pod, pod_claim) {
        Membership::Own => {}
        // The PodGroup's claim: created by the PodGroup's sync, only recorded here (never one of the pod's own).
        Membership::Group(Some(claim)) if !observe_only => return Ok(Outcome::Record(claim.name_any())),
        Membership::Group(_) => return Ok(Outcome::Unchanged),
        // Upstream `getPodGroup` fails the same way; the PodGroup's creation brings the pod back.
        Membership::MissingGroup(group) => return Err(SyncError::PodGroupNotFound { group }),
        // Upstream refuses such a pod while its PodGroup support is off; the PodGroup informer's start brings it back.
        Membership::GroupsNotHandled(group) => return Err(SyncError::PodGroupsNotHandled { group }),
    }
    if observe_only {
        debug!(pod_claim = %pod_claim.name, "observe-only: leaving the claim to the other claim controller");
        return Ok(Outcome::Unchanged);
    }
    if let Some(orphan) = ctx.caches.orphan_for(pod, &pod_claim.name) {
        let name = orphan.name_any();
        info!(claim = %name, pod_claim = %pod_claim.name, "adopting claim generated earlier for this pod");
        let note = format!("Adopted ResourceClaim {name} (from template {template}) for pod claim {}", pod_claim.name);
        ctx.events.pod_claim_normal(pod, &orphan, Reason::ResourceClaimAdopted, note);
        return Ok(Outcome::Record(name));
    }
    let claim = create_claim(ctx, pod, &pod_claim.name, template).await?;
    Ok(Outcome::Record(claim.name_any()))
}

/// Whether the claim the pod's status records exists and is the pod's (upstream `claimExists`): the informer
/// first; a claim it does not show is read from the API server, because an informer can lag behind the server
/// (a new leader, a re-list, a broken watch) and a claim created on a lagging cache would be a second one, with
/// the pod status forced onto it. Only a NotFound (or a claim that is not the pod's) leads to a new claim.
async fn recorded_claim_exists(ctx: &Context, pod: &Pod, name: &str) -> Result<bool, SyncError> {
    let cached = ctx.caches.claim_for_pod(pod, name);
    let mut verdict = decide::recorded_claim_verdict(Seen::Cache(cached.as_deref()), pod);
    if verdict == RecordedVerdict::AskServer {
        debug!(claim = name, "recorded claim is not in the informer; reading it from the API server");
        let namespace = pod.namespace().unwrap_or_default();
        let live = api_object::namespaced::<ResourceClaim>(ctx.client.clone(), &namespace)
            .get_opt(name)
            .await
            .map(|live| live.map(|c| c.object))
            .map_err(|source| SyncError::GetClaim { claim: ObjectKey::new(namespace.clone(), name), source })?;
        verdict = decide::recorded_claim_verdict(Seen::Server(live.as_ref()), pod);
    }
    match verdict {
        RecordedVerdict::Replace(why) => {
            info!(claim = name, why, "replacing the recorded claim");
            if let Some(uid) = pod.metadata.uid.as_deref() {
                ctx.caches.forget_created(uid, name);
            }
            Ok(false)
        }
        // A server lookup never answers AskServer; were it to, keeping the claim is the answer that cannot duplicate.
        RecordedVerdict::Keep | RecordedVerdict::AskServer => Ok(true),
    }
}

async fn create_claim(
    ctx: &Context,
    pod: &Pod,
    pod_claim: &str,
    template_name: &str,
) -> Result<Arc<ResourceClaim>, SyncError> {
    let namespace = pod.namespace().unwrap_or_default();
    let template =
        cached_template(ctx, &namespace, template_name).ok_or_else(|| template_not_found(&namespace, template_name))?;
    let desired = decide::desired_claim(pod, pod_claim, &template)
        .map_err(|source| SyncError::Template { template: template_name.to_string(), source })?;
    let created = post_claim(ctx, &namespace, desired, pod_claim, template_name, ("", "Pod")).await?;
    if let Some(uid) = pod.metadata.uid.as_deref() {
        ctx.caches.remember_created(uid, created.clone());
    }
    debug!(claim = %created.name_any(), pod_claim, template = template_name, "created ResourceClaim");
    let note =
        format!("Created ResourceClaim {} from template {template_name} for pod claim {pod_claim}", created.name_any());
    ctx.events.pod_claim_normal(pod, &created, Reason::ResourceClaimCreated, note);
    Ok(created)
}

/// A template from the informer cache, or the error naming the missing one.
pub(super) fn cached_template(
    ctx: &Context,
    namespace: &str,
    template_name: &str,
) -> Option<Arc<ResourceClaimTemplate>> {
    ctx.caches.template(namespace, template_name)
}

pub(super) fn template_not_found(namespace: &str, template_name: &str) -> SyncError {
    SyncError::TemplateNotFound { namespace: namespace.to_string(), template: template_name.to_string() }
}

/// Creates the claim `desired` (for claim `claim_name` from `template_name`, owned by an object of API group and
/// kind `owner`) and counts the request in `dynamic_resource_allocation_resourceclaim_creates_total`.
pub(super) async fn post_claim(
    ctx: &Context,
    namespace: &str,
    desired: NewClaim,
    claim_name: &str,
    template_name: &str,
    owner: (&'static str, &'static str),
) -> Result<Arc<ResourceClaim>, SyncError> {
    let admin_access = super::slim_claim::spec_requests_admin_access(&desired.spec);
    let created = match post_claim_json(ctx, namespace, &desired).await {
        Ok(claim) => Ok(Arc::new(claim)),
        // Created, but the answer is not a claim: not a failed create. The informer brings the claim; a retry
        // before it does may create a second one, which syncClaim deletes as a duplicate.
        Err(kube::Error::SerdeError(err)) => Err(SyncError::DecodeClaim(err)),
        Err(source) => Err(SyncError::CreateClaim {
            pod_claim: claim_name.to_string(),
            template: template_name.to_string(),
            source,
        }),
    };
    let made = !matches!(created, Err(SyncError::CreateClaim { .. }));
    ctx.metrics.claim_created_for_owner(made, admin_access, owner.0, owner.1);
    created
}

/// POSTs the claim as built (fields unknown to this build included) and decodes the answer straight into the
/// cached form: no typed or untyped copy of the whole claim is made on the way in or out.
async fn post_claim_json(ctx: &Context, namespace: &str, desired: &NewClaim) -> kube::Result<ResourceClaim> {
    let body = serde_json::to_vec(desired).map_err(kube::Error::SerdeError)?;
    let params = PostParams { field_manager: Some(CLAIM_FIELD_MANAGER.to_string()), ..Default::default() };
    let path = ApiObject::<ResourceClaim>::url_path(&(), Some(namespace));
    let mut request = kube::core::Request::new(path).create(&params, body).map_err(kube::Error::BuildRequest)?;
    request.extensions_mut().insert("create");
    ctx.client.request::<ResourceClaim>(request).await
}

/// ONE server-side apply of the pod's complete, sorted `resourceClaimStatuses` (existing entries merged with new
/// ones), under the field manager kube-controller-manager uses, so that a switch between the two controllers
/// never leaves entries owned by a stale manager. The pod's UID is a precondition: a re-created pod of the same
/// name is never written to.
async fn apply_claim_statuses(ctx: &Context, pod: &Pod, new: &[(String, String)]) -> Result<(), SyncError> {
    let key = super::index::object_key(pod);
    let statuses = decide::merged_claim_statuses(pod, new);
    let patch = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": key.name, "namespace": key.namespace, "uid": pod.metadata.uid},
        "status": {"resourceClaimStatuses": statuses},
    });
    // Known as this replica's records before the pod watch can show them, whatever becomes of the apply.
    ctx.foreign.writing(pod, new);
    let params = PatchParams::apply(POD_STATUS_FIELD_MANAGER).force();
    // The answer (the whole pod, managed fields and all) is left undecoded: nothing here reads it, and the
    // informer brings the pod anyway. (A failure's Status is still decoded into `kube::Error::Api`.)
    let path = <k8s_openapi::api::core::v1::Pod as kube::Resource>::url_path(&(), Some(&key.namespace));
    let applied = kube::core::Request::new(path)
        .patch_subresource("status", &key.name, &params, &Patch::Apply(&patch))
        .map_err(kube::Error::BuildRequest);
    let sent = match applied {
        Ok(mut request) => {
            request.extensions_mut().insert("patch_status");
            ctx.client.request_text(request).await.map(drop)
        }
        Err(err) => Err(err),
    };
    sent.map_err(|source| SyncError::ApplyPodStatus { pod: key.clone(), source })?;
    ctx.caches.remember_applied(pod, new);
    debug!(entries = statuses.len(), "applied pod claim statuses");
    Ok(())
}

/// Adds the scheduled pod to `reservedFor` of each of its allocated claims that is not reserved for it yet.
/// (The scheduler normally reserves before binding; this covers claims allocated some other way.) A generated
/// claim is reserved only for the pod that owns it (upstream `IsForPod`), whatever the pod status names. A claim
/// bound to the pod's PodGroup (the group's own, or one the group names as the pod does) is reserved for the
/// PodGroup (upstream `BindTo`), which must be known by UID.
async fn reserve_claims(ctx: &Context, pod: &Pod, just_recorded: &[(String, String)]) -> Result<(), SyncError> {
    let namespace = pod.namespace().unwrap_or_default();
    let (Some(uid), pod_name) = (pod.metadata.uid.clone(), pod.name_any()) else {
        return Ok(());
    };
    let names = decide::spec_claims(pod)
        .into_iter()
        .map(|(name, must_check_owner)| (name.to_string(), must_check_owner))
        .chain(just_recorded.iter().map(|(_, claim)| (claim.clone(), true)));
    for (name, must_check_owner) in names {
        let Some(claim) = ctx.caches.claim(&namespace, &name) else {
            continue;
        };
        if must_check_owner && !decide::podgroup::is_for_pod(&claim, pod) {
            info!(claim = %name, "not reserving a claim the pod status records but the pod does not own");
            continue;
        }
        if !decide::should_reserve(&claim, pod) {
            continue;
        }
        let group_name = decide::podgroup::pod_group_name(pod);
        let group = group_name.and_then(|g| ctx.caches.pod_group(&namespace, g));
        let named_for_group = !must_check_owner
            && group_name.is_some()
            && group.as_ref().is_none_or(|g| decide::podgroup::named_claim_binds_to_group(pod, &name, g));
        let consumer = if decide::podgroup::is_group_claim_of(&claim, pod) || named_for_group {
            // Not known yet (the informer lags behind a new PodGroup): left to the scheduler, or a later sync.
            let Some(group) = group else { continue };
            decide::podgroup::group_consumer(&group)
        } else {
            k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
                api_group: None,
                resource: "pods".into(),
                name: pod_name.clone(),
                uid: uid.clone(),
            }
        };
        let mut reserved = decide::reserved_for(&claim).to_vec();
        reserved.push(consumer);
        // The resourceVersion makes this fail on any concurrent change instead of overwriting it.
        let patch = json!({
            "metadata": {"resourceVersion": claim.resource_version()},
            "status": {"reservedFor": reserved},
        });
        api_object::namespaced::<ResourceClaim>(ctx.client.clone(), &namespace)
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|source| SyncError::ReserveClaim {
                claim: ObjectKey::new(namespace.clone(), name.clone()),
                pod: pod_name.clone(),
                source,
            })?;
        debug!(claim = %name, "reserved claim for the scheduled pod");
    }
    Ok(())
}

/// The pod's object reference, for events.
pub fn pod_reference(pod: &Pod) -> k8s_openapi::api::core::v1::ObjectReference {
    pod.object_ref(&())
}
