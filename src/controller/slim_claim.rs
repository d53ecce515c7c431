//! The ResourceClaim as this controller caches it: what its decisions and metrics read, lifted out of the wire
//! form while deserializing, so the rest of a claim (device requests, selectors, allocation results, managed
//! fields, annotations) is never held. Next to the pods, claims are the largest cache; every claim this
//! controller generates costs a few hundred bytes here instead of a few kilobytes.
//!
//! Every way a claim enters the controller (watch, create response, status patch response) deserializes into
//! this type, so no claim can skip the reduction. Writes never go through it: status and finalizer changes are
//! merge patches of exactly the fields being changed.

use k8s_openapi::api::resource::v1::ResourceClaimConsumerReference;
use serde::Deserialize;
use serde::de::IgnoredAny;

use super::wire_meta::{Meta, WireMeta, exact};

/// Annotation on the claims kube-scheduler creates for extended resources.
pub const EXTENDED_RESOURCE_CLAIM_ANNOTATION: &str = "resource.kubernetes.io/extended-resource-claim";

/// A claim reduced to its identity and ownership (metadata without labels, annotations and managed fields), the
/// two annotations the controller reads, whether any request asks for admin access, who wrote it, whether it is
/// allocated, and its reservations.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "WireClaim")]
pub struct ResourceClaim {
    pub metadata: Meta,
    /// The `resource.kubernetes.io/pod-claim-name` annotation: which claim of its pod this generated claim is.
    pub pod_claim_name: Option<String>,
    /// `resource.kubernetes.io/extended-resource-claim: "true"`: kube-scheduler made it for an extended resource.
    pub extended_resource: bool,
    /// Some request of `spec.devices.requests` has `exactly.adminAccess: true`.
    pub admin_access: bool,
    /// Field managers that wrote the object itself (managed-field entries without a subresource), in their
    /// order; the creator is among them.
    pub writers: Vec<String>,
    /// `status.allocation` is set.
    pub allocated: bool,
    /// `status.reservedFor`.
    pub reserved_for: Vec<ResourceClaimConsumerReference>,
}

super::cached_resource!(
    ResourceClaim,
    api_version: "resource.k8s.io/v1",
    group: "resource.k8s.io",
    kind: "ResourceClaim",
    version: "v1",
    plural: "resourceclaims"
);

/// The parts of a claim on the wire that [`ResourceClaim`] keeps something of; everything else is skipped by the
/// deserializer without being allocated.
#[derive(Deserialize)]
struct WireClaim {
    metadata: WireMeta<WireAnnotations>,
    #[serde(default)]
    spec: WireSpec,
    #[serde(default)]
    status: Option<WireStatus>,
}

/// The two annotations the controller reads (the keys are [`super::decide::POD_CLAIM_NAME_ANNOTATION`] and
/// [`EXTENDED_RESOURCE_CLAIM_ANNOTATION`]; serde needs them spelled out).
#[derive(Deserialize)]
struct WireAnnotations {
    #[serde(default, rename = "resource.kubernetes.io/pod-claim-name")]
    pod_claim_name: Option<String>,
    #[serde(default, rename = "resource.kubernetes.io/extended-resource-claim")]
    extended_resource_claim: Option<String>,
}

#[derive(Default, Deserialize)]
struct WireSpec {
    #[serde(default)]
    devices: Option<WireDevices>,
}

impl WireSpec {
    /// Some request of `devices.requests` has `exactly.adminAccess: true`.
    fn requests_admin_access(&self) -> bool {
        let requests = self.devices.as_ref().and_then(|d| d.requests.as_deref()).unwrap_or_default();
        requests.iter().any(|r| r.exactly.as_ref().and_then(|e| e.admin_access) == Some(true))
    }
}

/// Whether a claim spec (JSON text, as a template carries it) asks for admin access, by the same rule as
/// [`ResourceClaim::admin_access`]: for the creation metric, before the claim exists. What it does not read (the
/// opaque parameters, however deep) is skipped unparsed.
pub fn spec_requests_admin_access(spec: &serde_json::value::RawValue) -> bool {
    serde_json::from_str::<WireSpec>(spec.get()).is_ok_and(|spec| spec.requests_admin_access())
}

#[derive(Deserialize)]
struct WireDevices {
    #[serde(default)]
    requests: Option<Vec<WireRequest>>,
}

#[derive(Deserialize)]
struct WireRequest {
    #[serde(default)]
    exactly: Option<WireExactly>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireExactly {
    #[serde(default)]
    admin_access: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireStatus {
    #[serde(default)]
    allocation: Option<IgnoredAny>,
    #[serde(default)]
    reserved_for: Option<Vec<ResourceClaimConsumerReference>>,
}

impl From<WireClaim> for ResourceClaim {
    fn from(wire: WireClaim) -> Self {
        let WireClaim { mut metadata, spec, status } = wire;
        let mut writers = metadata.object_writers();
        writers.shrink_to_fit();
        let (pod_claim_name, extended_resource_claim) = match metadata.annotations.take() {
            Some(a) => (a.pod_claim_name, a.extended_resource_claim),
            None => (None, None),
        };
        let (allocated, reserved_for) = match status {
            Some(status) => (status.allocation.is_some(), exact(status.reserved_for).unwrap_or_default()),
            None => (false, Vec::new()),
        };
        Self {
            metadata: metadata.into_meta(),
            pod_claim_name,
            extended_resource: extended_resource_claim.as_deref() == Some("true"),
            admin_access: spec.requests_admin_access(),
            writers,
            allocated,
            reserved_for,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_full_claim_keeps_only_what_the_controller_reads() -> Result<(), serde_json::Error> {
        let full = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {
                "name": "p-gpu-abcde", "generateName": "p-gpu-", "namespace": "ns", "uid": "c1", "resourceVersion": "7",
                "labels": {"team": "a"},
                "annotations": {crate::controller::decide::POD_CLAIM_NAME_ANNOTATION: "gpu", "note": "x"},
                "finalizers": ["resource.kubernetes.io/delete-protection"],
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u", "controller": true}],
                "managedFields": [
                    {"manager": "gpu-dra-controller", "operation": "Update", "apiVersion": "resource.k8s.io/v1"},
                    {"manager": "kube-scheduler", "operation": "Update", "apiVersion": "resource.k8s.io/v1", "subresource": "status"}
                ]
            },
            "spec": {"devices": {"requests": [
                {"name": "a", "exactly": {"deviceClassName": "gpu", "selectors": [{"cel": {"expression": "true"}}]}},
                {"name": "b", "exactly": {"deviceClassName": "gpu", "adminAccess": true}}
            ]}},
            "status": {
                "allocation": {"devices": {"results": [{"request": "a", "driver": "d", "pool": "p", "device": "gpu-0"}]}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]
            }
        });
        let claim: ResourceClaim = serde_json::from_value(full)?;
        assert_eq!(claim.pod_claim_name.as_deref(), Some("gpu"));
        assert!(claim.admin_access && claim.allocated && !claim.extended_resource);
        assert_eq!(claim.writers, ["gpu-dra-controller"]);
        assert_eq!(claim.reserved_for.len(), 1);
        // Labels, annotations, generateName and managed fields are gone; identity and ownership stay.
        assert_eq!(
            serde_json::to_value(&claim.metadata)?,
            json!({
                "name": "p-gpu-abcde", "namespace": "ns", "uid": "c1", "resourceVersion": "7",
                "finalizers": ["resource.kubernetes.io/delete-protection"],
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u", "controller": true}]
            })
        );
        Ok(())
    }

    #[test]
    fn a_template_spec_asks_for_admin_access_by_the_same_rule() {
        let raw = |spec: serde_json::Value| serde_json::value::RawValue::from_string(spec.to_string());
        let spec = |requests: serde_json::Value| raw(json!({"devices": {"requests": requests}})).expect("JSON text");
        assert!(spec_requests_admin_access(&spec(json!([
            {"name": "a", "exactly": {"deviceClassName": "gpu"}},
            {"name": "b", "exactly": {"deviceClassName": "gpu", "adminAccess": true}}
        ]))));
        assert!(!spec_requests_admin_access(&spec(json!([{"name": "a", "exactly": {"adminAccess": false}}]))));
        assert!(!spec_requests_admin_access(&spec(json!([{"name": "a", "firstAvailable": [{"name": "x"}]}]))));
        assert!(!spec_requests_admin_access(&raw(json!({})).expect("JSON text")));
    }

    #[test]
    fn a_bare_claim_decodes() -> Result<(), serde_json::Error> {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"}},
            "spec": {"devices": {}},
            "status": {"allocation": null}
        }))?;
        assert!(claim.extended_resource && !claim.allocated && !claim.admin_access);
        assert!(claim.pod_claim_name.is_none() && claim.writers.is_empty() && claim.reserved_for.is_empty());
        Ok(())
    }
}
