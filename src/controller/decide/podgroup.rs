//! Pure decisions about PodGroup claims (KEP-5729), after upstream's `resourceclaim` helpers (`BindTo`,
//! `NameFromPodGroup`, `IsForPod` with PodGroup owners, `IsForPodGroup`, `IsReservedForPod`) and the PodGroup
//! parts of kube-controller-manager's resourceclaim controller (`podGroupNeedsWork`, the `reservedFor` cleanup).
//!
//! The model: a PodGroup's `spec.resourceClaims` entry with a template gets ONE claim, owned by the PodGroup and
//! recorded in `PodGroup.status.resourceClaimStatuses`. A member pod (`spec.schedulingGroup.podGroupName`) whose
//! own pod claim matches that entry exactly (name, `resourceClaimName`, `resourceClaimTemplateName`) uses the
//! group's claim, records it in its own status, and the claim is reserved for the PodGroup, not for the pod.

use k8s_openapi::api::core::v1::{PodResourceClaim, PodResourceClaimStatus};
use k8s_openapi::api::resource::v1::ResourceClaimConsumerReference;
use serde_json::json;

use super::{Recorded, Seen, TemplateError, claim_from_template, is_owned_by, reserved_for};
use crate::controller::slim_claim::ResourceClaim;
use crate::controller::slim_pod::Pod;
use crate::controller::slim_pod_group::{GROUP, PodGroup, RESOURCE, VERSION};
use crate::controller::slim_template::{NewClaim, ResourceClaimTemplate};

/// The PodGroup `pod` belongs to, by name (same namespace).
pub fn pod_group_name(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.scheduling_group.as_ref()?.pod_group_name.as_deref().filter(|n| !n.is_empty())
}

pub fn group_claims(group: &PodGroup) -> &[PodResourceClaim] {
    group.spec.as_ref().and_then(|s| s.resource_claims.as_deref()).unwrap_or_default()
}

/// What the PodGroup's status records for its claim `name` (upstream `NameFromPodGroup`).
pub fn group_recorded<'a>(group: &'a PodGroup, name: &str) -> Recorded<'a> {
    let statuses = group.status.as_ref().and_then(|s| s.resource_claim_statuses.as_deref()).unwrap_or_default();
    match statuses.iter().find(|s| s.name == name) {
        None => Recorded::Missing,
        Some(s) => s.resource_claim_name.as_deref().map_or(Recorded::NoClaimNeeded, Recorded::Claim),
    }
}

/// The PodGroup a claim was generated for: its controlling owner, when that is a `scheduling.k8s.io` PodGroup
/// (of any version, as upstream: the version may change, the group may not).
pub fn owning_pod_group(claim: &ResourceClaim) -> Option<(&str, &str)> {
    let prefix = format!("{GROUP}/");
    claim
        .metadata
        .owner_references
        .as_deref()?
        .iter()
        .find(|r| r.controller == Some(true) && r.kind == "PodGroup" && r.api_version.starts_with(&prefix))
        .map(|r| (r.name.as_str(), r.uid.as_str()))
}

/// Upstream `IsForPodGroup`: same namespace, and the PodGroup (by UID) is the controlling owner.
pub fn is_for_pod_group(claim: &ResourceClaim, group: &PodGroup) -> bool {
    claim.metadata.namespace == group.metadata.namespace
        && owning_pod_group(claim).is_some_and(|(_, uid)| Some(uid) == group.metadata.uid.as_deref())
}

/// Upstream `IsForPod` with PodGroup owners accepted: the pod owns the claim, or the pod's PodGroup (by name:
/// a pod does not know its group's UID) does.
pub fn is_for_pod(claim: &ResourceClaim, pod: &Pod) -> bool {
    is_owned_by(claim, pod) || is_group_claim_of(claim, pod)
}

/// Whether the claim is owned by the pod's PodGroup (by name): such a claim is reserved for the PodGroup.
pub fn is_group_claim_of(claim: &ResourceClaim, pod: &Pod) -> bool {
    claim.metadata.namespace == pod.metadata.namespace
        && pod_group_name(pod).is_some_and(|g| owning_pod_group(claim).is_some_and(|(name, _)| name == g))
}

/// Upstream `BindTo`: whether the pod claim is the group's claim (bound to the PodGroup) rather than the pod's
/// own. `group` must be the pod's PodGroup; a pod claim matches a group claim only when all three fields agree.
pub fn binds_to_group(pod: &Pod, pod_claim: &PodResourceClaim, group: &PodGroup) -> bool {
    pod.metadata.namespace == group.metadata.namespace
        && pod_group_name(pod).is_some_and(|g| Some(g) == group.metadata.name.as_deref())
        && group_claims(group).iter().any(|gc| {
            gc.name == pod_claim.name
                && gc.resource_claim_name == pod_claim.resource_claim_name
                && gc.resource_claim_template_name == pod_claim.resource_claim_template_name
        })
}

/// Upstream `BindTo` for a claim the pod names (`resourceClaimName`): whether the pod's PodGroup `group` lists the
/// same entry, so that the claim is reserved for the PodGroup, not the pod.
pub fn named_claim_binds_to_group(pod: &Pod, claim_name: &str, group: &PodGroup) -> bool {
    super::pod_claims(pod)
        .iter()
        .filter(|pc| pc.resource_claim_name.as_deref() == Some(claim_name))
        .any(|pc| binds_to_group(pod, pc, group))
}

/// The `reservedFor` entry of a PodGroup.
pub fn group_consumer(group: &PodGroup) -> ResourceClaimConsumerReference {
    ResourceClaimConsumerReference {
        api_group: Some(GROUP.into()),
        resource: RESOURCE.into(),
        name: group.metadata.name.clone().unwrap_or_default(),
        uid: group.metadata.uid.clone().unwrap_or_default(),
    }
}

pub fn is_group_consumer(consumer: &ResourceClaimConsumerReference) -> bool {
    consumer.api_group.as_deref() == Some(GROUP) && consumer.resource == RESOURCE
}

/// Whether the claim is reserved for the pod's PodGroup (by name, as upstream `IsReservedForPod`).
pub fn is_reserved_for_group_of(claim: &ResourceClaim, pod: &Pod) -> bool {
    pod_group_name(pod).is_some_and(|g| reserved_for(claim).iter().any(|r| is_group_consumer(r) && r.name == g))
}

/// What to do with a PodGroup's `reservedFor` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupReservation {
    Keep,
    /// Not in the informer, or another PodGroup of that name there: the informer may lag behind a new PodGroup
    /// whose pods are being scheduled (also one created again under the name of one it still holds), so only the
    /// API server can say it is gone.
    AskServer,
    Drop(&'static str),
}

/// Upstream's rule for a PodGroup in `reservedFor`: dropped once the PodGroup is known deleted, gone, or replaced
/// by one with another UID; kept while it exists. Unlike upstream, a cached PodGroup of another UID is not taken
/// for proof that the consumer was replaced: the API server is asked.
pub fn group_reservation(consumer_uid: &str, known_deleted: bool, seen: Seen<&str>) -> GroupReservation {
    if known_deleted {
        return GroupReservation::Drop("PodGroup was deleted");
    }
    match seen {
        Seen::Cache(None) => GroupReservation::AskServer,
        Seen::Cache(Some(uid)) if uid != consumer_uid => GroupReservation::AskServer,
        Seen::Server(None) => GroupReservation::Drop("PodGroup not found"),
        Seen::Cache(Some(_)) => GroupReservation::Keep,
        Seen::Server(Some(uid)) if uid == consumer_uid => GroupReservation::Keep,
        Seen::Server(Some(_)) => GroupReservation::Drop("PodGroup was replaced by one with another UID"),
    }
}

/// Upstream `podGroupNeedsWork`: a template claim not recorded yet, or a recorded claim `lookup` does not find.
pub fn pod_group_needs_work<F>(group: &PodGroup, lookup: F) -> (bool, &'static str)
where
    F: Fn(&str) -> bool,
{
    if group.metadata.deletion_timestamp.is_some() {
        return (false, "PodGroup is being deleted");
    }
    for gc in group_claims(group) {
        if gc.resource_claim_template_name.is_none() {
            continue;
        }
        match group_recorded(group, &gc.name) {
            Recorded::Missing => return (true, "template claim not recorded"),
            Recorded::Claim(name) if !lookup(name) => return (true, "recorded claim is missing"),
            Recorded::Claim(_) | Recorded::NoClaimNeeded => {}
        }
    }
    (false, "nothing to do")
}

/// The claim to create for the PodGroup's claim `group_claim` from `template`: as for a pod, with the PodGroup
/// as controlling owner and `<group>-<claim>-` as name prefix (upstream `handlePodGroupClaim`).
pub fn desired_group_claim(
    group: &PodGroup,
    group_claim: &str,
    template: &ResourceClaimTemplate,
) -> Result<NewClaim, TemplateError> {
    let name = group.metadata.name.as_deref().unwrap_or_default();
    let owner = json!({
        "apiVersion": format!("{GROUP}/{VERSION}"), "kind": "PodGroup",
        "name": name, "uid": group.metadata.uid, "controller": true,
    });
    claim_from_template(name, group.metadata.namespace.as_deref(), owner, group_claim, template)
}

/// The PodGroup's complete claim statuses with `new` merged in, sorted: one server-side apply writes them all,
/// so that an apply never drops an entry the same field manager wrote before.
pub fn merged_group_statuses(group: &PodGroup, new: &[(String, String)]) -> Vec<PodResourceClaimStatus> {
    super::merge_statuses(
        group.status.as_ref().and_then(|s| s.resource_claim_statuses.as_deref()).unwrap_or_default(),
        new,
    )
}

#[cfg(test)]
mod tests;
