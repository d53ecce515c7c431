//! Object metadata as the slim cache types read it off the wire: only the fields the controller uses are
//! deserialized. Everything else — labels, other annotations, and above all `managedFields`, whose `fieldsV1` trees
//! are most of an object's JSON — is skipped by the deserializer without being allocated. That matters most at
//! start-up, when a list page of 500 pods or claims is decoded at once.
//!
//! What is kept goes into [`Meta`], not k8s-openapi's `ObjectMeta`: that struct is 360 bytes inline, most of them
//! fields no cached object here ever fills, and the caches hold one per pod and claim.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use serde::{Deserialize, Serialize};

/// The metadata fields a slim type keeps, plus what it lifts out of annotations and managed fields (`A`: the
/// annotations it wants, as a struct of optional fields; [`NoAnnotations`] for none).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WireMeta<A> {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    creation_timestamp: Option<Time>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
    #[serde(default)]
    owner_references: Option<Vec<OwnerReference>>,
    #[serde(default)]
    finalizers: Option<Vec<String>>,
    #[serde(default = "Option::default")]
    pub annotations: Option<A>,
    #[serde(default)]
    managed_fields: Option<Vec<WireManager>>,
}

/// A managed-fields entry without its field set.
#[derive(Debug, Deserialize)]
struct WireManager {
    #[serde(default)]
    manager: Option<String>,
    #[serde(default)]
    subresource: Option<String>,
}

/// For types that read no annotation: the annotations are skipped.
#[derive(Debug, Deserialize)]
pub struct NoAnnotations {}

impl<A> WireMeta<A> {
    /// Field managers that wrote the object itself (entries without a subresource), in their order.
    pub fn object_writers(&mut self) -> Vec<String> {
        self.managed_fields
            .take()
            .unwrap_or_default()
            .into_iter()
            .filter(|m| m.subresource.as_deref().unwrap_or_default().is_empty())
            .filter_map(|m| m.manager)
            .collect()
    }

    /// The kept fields, compactly.
    pub fn into_meta(self) -> Meta {
        Meta {
            name: self.name,
            namespace: self.namespace,
            uid: self.uid,
            resource_version: self.resource_version,
            creation_timestamp: self.creation_timestamp,
            deletion_timestamp: self.deletion_timestamp,
            owner_references: exact(self.owner_references),
            finalizers: exact(self.finalizers),
        }
    }
}

/// The metadata a cached pod or claim keeps. Field names and types are `ObjectMeta`'s, so code reads it the same
/// way.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Time>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<Time>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner_references: Option<Vec<OwnerReference>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finalizers: Option<Vec<String>>,
}

/// A decoded list without spare room, for the caches. serde_json grows a vector like any push does, to room for
/// four elements at least, so a claim's one owner reference or a pod's one claim would keep room for four: with
/// 10,000 pods and claims cached that was a quarter of the controller's heap.
pub fn exact<T>(list: Option<Vec<T>>) -> Option<Vec<T>> {
    list.map(|mut list| {
        list.shrink_to_fit();
        list
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_identity_and_ownership_and_skips_the_rest() -> Result<(), serde_json::Error> {
        let mut wire: WireMeta<std::collections::BTreeMap<String, String>> = serde_json::from_value(json!({
            "name": "n", "generateName": "n-", "namespace": "ns", "uid": "u", "resourceVersion": "5",
            "creationTimestamp": "2026-12-01T10:00:00Z", "deletionTimestamp": "2026-12-01T10:05:00Z",
            "labels": {"a": "b"}, "annotations": {"k": "v"}, "finalizers": ["f"],
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pu", "controller": true}],
            "managedFields": [
                {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:spec": {"f:x": {}}}},
                {"manager": "kubelet", "operation": "Update", "subresource": "status", "fieldsV1": {}}
            ]
        }))?;
        assert_eq!(wire.object_writers(), ["kubectl"]);
        assert_eq!(wire.annotations.as_ref().and_then(|a| a.get("k")).map(String::as_str), Some("v"));
        let meta = wire.into_meta();
        assert_eq!(
            (meta.name.as_deref(), meta.namespace.as_deref(), meta.uid.as_deref()),
            (Some("n"), Some("ns"), Some("u"))
        );
        assert_eq!(meta.resource_version.as_deref(), Some("5"));
        assert!(meta.creation_timestamp.is_some() && meta.deletion_timestamp.is_some());
        assert_eq!(meta.finalizers, Some(vec!["f".to_string()]));
        assert_eq!(meta.owner_references.as_ref().map(|o| o[0].uid.as_str()), Some("pu"));
        // k8s-openapi's ObjectMeta is 360 bytes; one of these is held per cached pod and claim.
        assert!(std::mem::size_of::<Meta>() <= 192, "{} bytes", std::mem::size_of::<Meta>());
        Ok(())
    }
}
