//! Pure decisions of the controller: what a pod needs, which claim belongs to which pod, what a new claim looks
//! like. No I/O here, so every rule is unit-tested with plain tables.

use std::collections::BTreeMap;

use super::slim_claim::ResourceClaim;
use super::slim_pod::Pod;
use super::slim_template::{NewClaim, ResourceClaimTemplate};
use k8s_openapi::api::core::v1::{PodResourceClaim, PodResourceClaimStatus};
use serde_json::{Value, json};

use super::naming::claim_generate_name;

pub mod podgroup;
pub mod quota;

/// Annotation on a generated claim naming the pod claim (`spec.resourceClaims[].name`) it was made for.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
/// Finalizer the scheduler puts on claims it allocates; the controller removes it after deallocating.
pub const DELETE_PROTECTION_FINALIZER: &str = "resource.kubernetes.io/delete-protection";
/// The API's limit on `status.reservedFor` entries.
pub const MAX_RESERVED_FOR: usize = 256;

/// How a pod names the claim behind one of its `spec.resourceClaims` entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimSource<'a> {
    /// `resourceClaimName`: a claim the user manages; no owner check.
    Named(&'a str),
    /// `resourceClaimTemplateName`: a claim generated for this pod, recorded in the pod's status.
    Template { template: &'a str, recorded: Recorded<'a> },
    /// Neither field set: a pod from an API version this controller does not understand.
    Unsupported,
}

/// What `pod.status.resourceClaimStatuses` says about a template claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded<'a> {
    /// No entry yet: the claim must be found (adopted) or created.
    Missing,
    /// An entry without a claim name: no claim is needed.
    NoClaimNeeded,
    Claim(&'a str),
}

/// Like [`claim_source`], also taking statuses this controller applied that the pod cache does not show yet.
pub fn claim_source_with<'a>(
    pod: &'a Pod,
    pod_claim: &'a PodResourceClaim,
    applied: &'a [(String, String)],
) -> ClaimSource<'a> {
    match claim_source(pod, pod_claim) {
        ClaimSource::Template { template, recorded: Recorded::Missing } => {
            let recorded = applied
                .iter()
                .find(|(name, _)| *name == pod_claim.name)
                .map_or(Recorded::Missing, |(_, claim)| Recorded::Claim(claim.as_str()));
            ClaimSource::Template { template, recorded }
        }
        other => other,
    }
}

pub fn claim_source<'a>(pod: &'a Pod, pod_claim: &'a PodResourceClaim) -> ClaimSource<'a> {
    if let Some(name) = pod_claim.resource_claim_name.as_deref() {
        return ClaimSource::Named(name);
    }
    let Some(template) = pod_claim.resource_claim_template_name.as_deref() else {
        return ClaimSource::Unsupported;
    };
    let entry = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|statuses| statuses.iter().find(|s| s.name == pod_claim.name));
    let recorded = match entry {
        None => Recorded::Missing,
        Some(entry) => match entry.resource_claim_name.as_deref() {
            Some(name) => Recorded::Claim(name),
            None => Recorded::NoClaimNeeded,
        },
    };
    ClaimSource::Template { template, recorded }
}

/// The claim name the pod's status records for template pod claim `pod_claim`.
pub fn recorded_claim<'a>(pod: &'a Pod, pod_claim: &str) -> Option<&'a str> {
    let pc = pod_claims(pod).iter().find(|pc| pc.name == pod_claim)?;
    match claim_source(pod, pc) {
        ClaimSource::Template { recorded: Recorded::Claim(name), .. } => Some(name),
        _ => None,
    }
}

/// The pod's `spec.resourceClaims` (empty when it has none).
pub fn pod_claims(pod: &Pod) -> &[PodResourceClaim] {
    pod.spec.as_ref().and_then(|s| s.resource_claims.as_deref()).unwrap_or_default()
}

/// Names of the claims a pod uses through `spec.resourceClaims` that are known now (named claims and recorded
/// template claims), each with whether the pod must own it before using it (upstream `resourceclaim.Name`'s
/// `mustCheckOwner`: true for a generated claim, false for a claim the user names).
pub fn spec_claims(pod: &Pod) -> Vec<(&str, bool)> {
    pod_claims(pod)
        .iter()
        .filter_map(|pc| match claim_source(pod, pc) {
            ClaimSource::Named(name) => Some((name, false)),
            ClaimSource::Template { recorded: Recorded::Claim(name), .. } => Some((name, true)),
            _ => None,
        })
        .collect()
}

/// Names of the claims a pod uses through `spec.resourceClaims` that are known now.
pub fn known_claim_names(pod: &Pod) -> Vec<&str> {
    spec_claims(pod).into_iter().map(|(name, _)| name).collect()
}

/// The claim the scheduler generated for the pod's DRA-backed extended resources
/// (`status.extendedResourceClaimStatus`, feature `DRAExtendedResource`).
pub fn extended_resource_claim(pod: &Pod) -> Option<&str> {
    let status = pod.status.as_ref()?.extended_resource_claim_status.as_ref()?;
    Some(status.resource_claim_name.as_str()).filter(|name| !name.is_empty())
}

/// Every claim the pod uses that is known now: [`known_claim_names`] and the extended-resource claim (upstream
/// `resourceclaim.PodClaims`). These are the claims to release when the pod is done or deleted.
pub fn all_claim_names(pod: &Pod) -> Vec<&str> {
    let mut names = known_claim_names(pod);
    names.extend(extended_resource_claim(pod));
    names
}

/// Whether the controller has anything to do for the pod at all: it has `spec.resourceClaims`, or the scheduler
/// recorded an extended-resource claim for it (which must be released when the pod is done, although the pod
/// spec names no claim).
pub fn has_claims(pod: &Pod) -> bool {
    !pod_claims(pod).is_empty() || pod.status.as_ref().is_some_and(|s| s.extended_resource_claim_status.is_some())
}

/// Names of the claims a pod names directly (`resourceClaimName`): claims it shares, or that others made for it.
pub fn named_claim_names(pod: &Pod) -> Vec<&str> {
    pod_claims(pod).iter().filter_map(|pc| pc.resource_claim_name.as_deref()).collect()
}

pub fn is_scheduled(pod: &Pod) -> bool {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_some_and(|n| !n.is_empty())
}

/// A pod that will never run (again): terminal, or deleted before it was scheduled.
pub fn is_pod_done(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed")) || (pod.metadata.deletion_timestamp.is_some() && !is_scheduled(pod))
}

/// The pod a claim was generated for: its controlling owner reference, when that is a Pod.
pub fn owning_pod(claim: &ResourceClaim) -> Option<(&str, &str)> {
    claim
        .metadata
        .owner_references
        .as_deref()?
        .iter()
        .find(|r| r.controller == Some(true) && r.api_version == "v1" && r.kind == "Pod")
        .map(|r| (r.name.as_str(), r.uid.as_str()))
}

/// Whether `claim` is owned by `pod`: same namespace and a controller reference with the pod's UID.
pub fn is_owned_by(claim: &ResourceClaim, pod: &Pod) -> bool {
    claim.metadata.namespace == pod.metadata.namespace
        && owning_pod(claim).is_some_and(|(_, uid)| Some(uid) == pod.metadata.uid.as_deref())
}

pub fn pod_claim_name_annotation(claim: &ResourceClaim) -> Option<&str> {
    claim.pod_claim_name.as_deref()
}

pub fn is_allocated(claim: &ResourceClaim) -> bool {
    claim.allocated
}

pub fn reserved_for(claim: &ResourceClaim) -> &[k8s_openapi::api::resource::v1::ResourceClaimConsumerReference] {
    &claim.reserved_for
}

pub fn is_reserved_for(claim: &ResourceClaim, pod_uid: &str) -> bool {
    reserved_for(claim)
        .iter()
        .any(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or_default().is_empty() && r.uid == pod_uid)
}

/// Whether the controller should add `pod` (or its PodGroup) to the claim's `reservedFor`: the claim is allocated,
/// not reserved for it yet, has room, and the pod is scheduled and still going to run (a terminal pod is never
/// re-reserved).
///
/// Upstream `IsReservedForPod`: reserved for the pod's PodGroup (by name) counts as reserved for the pod, whatever
/// claim it is: the group's own, or one the group and its pods name (`resourceClaimName`), which the scheduler
/// reserves for the PodGroup once for all its members (upstream `BindTo`).
pub fn should_reserve(claim: &ResourceClaim, pod: &Pod) -> bool {
    let Some(uid) = pod.metadata.uid.as_deref() else {
        return false;
    };
    may_reserve(claim, pod) && !is_reserved_for(claim, uid) && !podgroup::is_reserved_for_group_of(claim, pod)
}

/// The claim is allocated and has room left in `reservedFor`, and the pod is scheduled and still going to run.
fn may_reserve(claim: &ResourceClaim, pod: &Pod) -> bool {
    is_scheduled(pod)
        && !is_pod_done(pod)
        && pod.metadata.deletion_timestamp.is_none()
        && is_allocated(claim)
        && reserved_for(claim).len() < MAX_RESERVED_FOR
}

/// Where an object was looked up (a recorded claim, a PodGroup named in `reservedFor`), and what was found.
#[derive(Debug, Clone, Copy)]
pub enum Seen<T> {
    /// The informer (for claims, also those this controller created that it does not show yet).
    Cache(Option<T>),
    /// A live GET; `None` is NotFound.
    Server(Option<T>),
}

/// What to do about the claim a pod's status records for a template pod claim (upstream `claimExists`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordedVerdict {
    /// It exists and the pod owns it: nothing to create.
    Keep,
    /// Not in the informer, which may lag behind the server (a new leader, a re-list, a watch that broke): only
    /// the API server can say it is gone.
    AskServer,
    /// Gone, or not the pod's: a claim is found (adopted) or created in its place; the reason is logged.
    Replace(&'static str),
}

pub fn recorded_claim_verdict(seen: Seen<&ResourceClaim>, pod: &Pod) -> RecordedVerdict {
    match seen {
        Seen::Cache(None) => RecordedVerdict::AskServer,
        Seen::Server(None) => RecordedVerdict::Replace("the recorded claim does not exist"),
        Seen::Cache(Some(claim)) | Seen::Server(Some(claim)) if podgroup::is_for_pod(claim, pod) => {
            RecordedVerdict::Keep
        }
        Seen::Cache(Some(_)) | Seen::Server(Some(_)) => RecordedVerdict::Replace("the recorded claim is not the pod's"),
    }
}

/// Whether a pod needs a sync, and why (the reason is logged). `applied` are statuses written but not yet seen
/// in `pod`; `lookup` finds a claim of the pod's namespace by name in the informer cache or among claims created
/// but not yet observed.
///
/// A done pod needs nothing: its claims are only released (their keys are queued by the pod handler), never
/// created or reserved again, and the pod gets no more writes. Without this, the deletion of a finished pod's
/// claim would make the claim "missing" and create it again, in a loop, until the pod object is deleted.
/// A recorded claim that the pod does not own is left alone, as upstream does: the pod cannot use it until it
/// is deleted.
pub fn pod_needs_work<F>(pod: &Pod, applied: &[(String, String)], lookup: F) -> (bool, &'static str)
where
    F: Fn(&str) -> Option<std::sync::Arc<ResourceClaim>>,
{
    if pod.metadata.deletion_timestamp.is_some() {
        return (false, "pod is being deleted");
    }
    if is_pod_done(pod) {
        return (false, "pod is done");
    }
    let mut reservable = Vec::new();
    for pc in pod_claims(pod) {
        match claim_source_with(pod, pc, applied) {
            ClaimSource::Template { recorded: Recorded::Missing, .. } => return (true, "template claim not recorded"),
            ClaimSource::Template { recorded: Recorded::Claim(name), .. } => match lookup(name) {
                None => return (true, "recorded claim is missing"),
                Some(claim) if podgroup::is_for_pod(&claim, pod) => reservable.push(claim),
                Some(_) => {}
            },
            ClaimSource::Named(name) => reservable.extend(lookup(name)),
            ClaimSource::Unsupported => {
                return (true, "pod claim names neither a claim nor a template");
            }
            ClaimSource::Template { recorded: Recorded::NoClaimNeeded, .. } => {}
        }
    }
    if reservable.iter().any(|claim| should_reserve(claim, pod)) {
        return (true, "allocated claim not reserved for the scheduled pod");
    }
    (false, "nothing to do")
}

/// The pod's claim statuses with `new` merged in (later entries win), sorted by pod claim name: the complete
/// list goes into one status write, so entries never flap between writers. `new` must include statuses applied
/// earlier that the pod does not show yet: an apply drops what the same field manager applied before and omits.
pub fn merged_claim_statuses(pod: &Pod, new: &[(String, String)]) -> Vec<PodResourceClaimStatus> {
    merge_statuses(pod.status.as_ref().and_then(|s| s.resource_claim_statuses.as_deref()).unwrap_or_default(), new)
}

/// `existing` statuses with `new` merged in (later entries win), sorted by claim name.
fn merge_statuses(existing: &[PodResourceClaimStatus], new: &[(String, String)]) -> Vec<PodResourceClaimStatus> {
    let mut merged: BTreeMap<String, Option<String>> =
        existing.iter().map(|s| (s.name.clone(), s.resource_claim_name.clone())).collect();
    for (name, claim) in new {
        merged.insert(name.clone(), Some(claim.clone()));
    }
    merged.into_iter().map(|(name, resource_claim_name)| PodResourceClaimStatus { name, resource_claim_name }).collect()
}

/// Why a template cannot become a claim.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TemplateError {
    #[error("has no spec.spec")]
    NoSpec,
}

/// The claim to create for pod claim `pod_claim` of `pod` from `template`.
///
/// The spec is the template's `spec.spec` exactly as the server returned it, fields unknown to this build
/// included; labels and annotations are copied from the template's `spec.metadata` (the cached template itself is
/// never touched), plus the pod-claim-name annotation; the pod is the controlling owner.
pub fn desired_claim(pod: &Pod, pod_claim: &str, template: &ResourceClaimTemplate) -> Result<NewClaim, TemplateError> {
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let owner =
        json!({"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod.metadata.uid, "controller": true});
    claim_from_template(pod_name, pod.metadata.namespace.as_deref(), owner, pod_claim, template)
}

/// The claim `owner_name`'s claim `claim_name` gets from `template` (see [`desired_claim`]); `owner` is the
/// controlling owner reference.
fn claim_from_template(
    owner_name: &str,
    namespace: Option<&str>,
    owner: Value,
    claim_name: &str,
    template: &ResourceClaimTemplate,
) -> Result<NewClaim, TemplateError> {
    let spec = template.claim_spec.clone().ok_or(TemplateError::NoSpec)?;
    let mut annotations = template.annotations.clone();
    annotations.insert(POD_CLAIM_NAME_ANNOTATION.into(), claim_name.into());
    Ok(NewClaim {
        api_version: "resource.k8s.io/v1",
        kind: "ResourceClaim",
        metadata: json!({
            "generateName": claim_generate_name(owner_name, claim_name),
            "namespace": namespace,
            "annotations": annotations,
            "labels": template.labels,
            "ownerReferences": [owner],
        }),
        spec,
    })
}

#[cfg(test)]
mod tests;
