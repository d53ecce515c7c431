//! The Pod as this controller caches it: only the fields it reads, deserialized straight from the watch, so the
//! rest of a pod (containers, volumes, conditions, labels, annotations, managed fields…: most of its size) is never
//! held in memory, not even briefly ([`super::wire_meta`] for the metadata).
//! Field names and types match `k8s_openapi::api::core::v1::Pod`, so code reads it the same way.
//!
//! Writes never go through this type: the pod status is written with a server-side apply of exactly the fields
//! this controller owns.

use k8s_openapi::api::core::v1::{PodResourceClaim, PodResourceClaimStatus};
use serde::{Deserialize, Serialize};

use super::wire_meta::{Meta, NoAnnotations, WireMeta, exact};

/// A pod, reduced to identity metadata (name, namespace, uid, resourceVersion, creation and deletion time),
/// `spec.nodeName`, `spec.resourceClaims`, `spec.schedulingGroup.podGroupName`, `status.phase`, `status.resourceClaimStatuses` and the claim name of
/// `status.extendedResourceClaimStatus`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(from = "WirePod")]
pub struct Pod {
    pub metadata: Meta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PodSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PodStatus>,
}

/// A pod on the wire, as far as [`Pod`] reads it.
#[derive(Deserialize)]
struct WirePod {
    metadata: WireMeta<NoAnnotations>,
    #[serde(default)]
    spec: Option<PodSpec>,
    #[serde(default)]
    status: Option<PodStatus>,
}

impl From<WirePod> for Pod {
    fn from(wire: WirePod) -> Self {
        let mut metadata = wire.metadata.into_meta();
        // A pod's owners and finalizers are of no use to this controller.
        metadata.owner_references = None;
        metadata.finalizers = None;
        let spec = wire.spec.map(|spec| PodSpec { resource_claims: exact(spec.resource_claims), ..spec });
        let status = wire
            .status
            .map(|status| PodStatus { resource_claim_statuses: exact(status.resource_claim_statuses), ..status });
        Self { metadata, spec, status }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_claims: Option<Vec<PodResourceClaim>>,
    /// The PodGroup the pod belongs to (`GenericWorkload`): its claims may be the group's shared ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduling_group: Option<SchedulingGroup>,
}

/// `spec.schedulingGroup`, as far as the controller reads it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingGroup {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_group_name: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_claim_statuses: Option<Vec<PodResourceClaimStatus>>,
    /// The claim the scheduler made for the pod's extended resources backed by DRA (`DRAExtendedResource`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extended_resource_claim_status: Option<ExtendedResourceClaimStatus>,
}

/// `status.extendedResourceClaimStatus` as far as the controller reads it: the claim's name. Decoded here
/// rather than through k8s-openapi so that it does not depend on the compiled API version, and so that the
/// request mappings (one entry per container and resource) are never held in memory.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtendedResourceClaimStatus {
    #[serde(default)]
    pub resource_claim_name: String,
}

super::cached_resource!(Pod, api_version: "v1", group: "", kind: "Pod", version: "v1", plural: "pods");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_pod_keeps_only_what_the_controller_reads() -> Result<(), serde_json::Error> {
        let full = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"a": "b"}, "annotations": {"k": "v"},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r", "uid": "r"}],
                         "managedFields": [{"manager": "m", "operation": "Update", "fieldsV1": {"f:spec": {}}}]},
            "spec": {"nodeName": "n", "containers": [{"name": "c", "image": "i"}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                     "schedulingGroup": {"podGroupName": "g"}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                       "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x"}],
                       "extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-y",
                           "requestMappings": [{"containerName": "c", "resourceName": "nvidia.com/gpu", "requestName": "r"}]}}
        });
        let pod: Pod = serde_json::from_value(full)?;
        assert_eq!(
            serde_json::to_value(&pod)?,
            serde_json::json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
                "spec": {"nodeName": "n", "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                         "schedulingGroup": {"podGroupName": "g"}},
                "status": {"phase": "Running", "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x"}],
                           "extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-y"}}
            })
        );
        assert!(std::mem::size_of::<Pod>() < 400, "{} bytes", std::mem::size_of::<Pod>());
        Ok(())
    }
}
