//! The `scheduling.k8s.io` PodGroup as this controller reads it (KEP-5729, `GenericWorkload` +
//! `DRAWorkloadResourceClaims`): identity metadata, `spec.resourceClaims` and `status.resourceClaimStatuses`.
//! k8s-openapi v1_34 has no PodGroup type; the two lists have exactly the shape of the pod's
//! (`name`, `resourceClaimName` | `resourceClaimTemplateName`; `name`, `resourceClaimName`), so the pod's types
//! are reused.

use k8s_openapi::api::core::v1::{PodResourceClaim, PodResourceClaimStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// API group of PodGroups.
pub const GROUP: &str = "scheduling.k8s.io";
/// The version this controller reads and writes: the one Kubernetes 1.37 serves (beta, off by default; enabled
/// with `--runtime-config scheduling.k8s.io/v1beta1=true`).
pub const VERSION: &str = "v1beta1";
/// Resource (plural) name, as `reservedFor` entries name it.
pub const RESOURCE: &str = "podgroups";

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct PodGroup {
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PodGroupSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PodGroupStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodGroupSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_claims: Option<Vec<PodResourceClaim>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodGroupStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_claim_statuses: Option<Vec<PodResourceClaimStatus>>,
}

impl super::store::IntoCached for PodGroup {
    type Cached = Self;

    fn into_cached(self) -> Self {
        self
    }
}

super::slim_resource!(PodGroup, api_version: "scheduling.k8s.io/v1beta1", group: "scheduling.k8s.io",
    kind: "PodGroup", version: "v1beta1", plural: "podgroups");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_group_keeps_its_claims_and_statuses() -> Result<(), serde_json::Error> {
        let group: PodGroup = serde_json::from_value(serde_json::json!({
            "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
            "metadata": {"name": "g", "namespace": "ns", "uid": "g-uid"},
            "spec": {"schedulingPolicy": {"basic": {}},
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
            "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "g-gpu-x"}]}
        }))?;
        assert_eq!(
            serde_json::to_value(&group)?,
            serde_json::json!({
                "metadata": {"name": "g", "namespace": "ns", "uid": "g-uid"},
                "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
                "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "g-gpu-x"}]}
            })
        );
        Ok(())
    }
}
