//! The ResourceClaimTemplate as this controller caches it: its identity, the labels and annotations its claims get,
//! and its claim spec as the exact JSON text the API server sent, never parsed.
//!
//! A template's opaque driver parameters are any JSON object of up to 10 KiB, nested as deep as its author likes: the
//! API server checks the size and nothing else. Parsed as a tree (kube's `DynamicObject`, a `serde_json::Value`),
//! one nested deeper than serde_json's limit of 128 levels made the whole list of templates undecodable, so that a
//! controller starting, failing over or listing again never synced and no pod of any namespace got a claim: one
//! tenant's template stopped the controller for everyone. Skipped as text, the spec costs its length in memory
//! (as a tree, 10 KiB of `[0,0,…]` took 160 KiB) and reaches the claim as written, fields unknown to this build
//! included.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::wire_meta::{Meta, NoAnnotations, WireMeta};

/// A template reduced to what a claim made from it needs.
#[derive(Clone, Debug, Deserialize)]
#[serde(from = "WireTemplate")]
pub struct ResourceClaimTemplate {
    pub metadata: Meta,
    /// `spec.metadata.labels`: the claim's labels.
    pub labels: BTreeMap<String, String>,
    /// `spec.metadata.annotations`: the claim's annotations (beside the pod-claim-name one).
    pub annotations: BTreeMap<String, String>,
    /// `spec.spec`, as the API server sent it (`None`: the template has none).
    pub claim_spec: Option<Box<RawValue>>,
}

super::cached_resource!(
    ResourceClaimTemplate,
    api_version: "resource.k8s.io/v1",
    group: "resource.k8s.io",
    kind: "ResourceClaimTemplate",
    version: "v1",
    plural: "resourceclaimtemplates"
);

#[derive(Deserialize)]
struct WireTemplate {
    metadata: WireMeta<NoAnnotations>,
    #[serde(default)]
    spec: Option<WireTemplateSpec>,
}

#[derive(Default, Deserialize)]
struct WireTemplateSpec {
    #[serde(default)]
    metadata: Option<WireClaimMeta>,
    #[serde(default)]
    spec: Option<Box<RawValue>>,
}

/// The claim metadata a template gives: the API server has checked both maps (string keys and values).
#[derive(Default, Deserialize)]
struct WireClaimMeta {
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

impl From<WireTemplate> for ResourceClaimTemplate {
    fn from(wire: WireTemplate) -> Self {
        let WireTemplateSpec { metadata, spec } = wire.spec.unwrap_or_default();
        let WireClaimMeta { labels, annotations } = metadata.unwrap_or_default();
        Self {
            metadata: wire.metadata.into_meta(),
            labels: labels.unwrap_or_default(),
            annotations: annotations.unwrap_or_default(),
            claim_spec: spec,
        }
    }
}

/// A claim to create, as the body of its POST: the template's spec is written out exactly as it was read.
#[derive(Debug, Serialize)]
pub struct NewClaim {
    #[serde(rename = "apiVersion")]
    pub api_version: &'static str,
    pub kind: &'static str,
    pub metadata: serde_json::Value,
    pub spec: Box<RawValue>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_nested_deeper_than_serde_jsons_limit_is_kept_as_written() -> Result<(), serde_json::Error> {
        let deep = format!("{}0{}", "[".repeat(1000), "]".repeat(1000));
        let spec = format!(r#"{{"devices":{{"config":[{{"opaque":{{"driver":"d","parameters":{{"x":{deep}}}}}}}]}}}}"#);
        let text = format!(
            r#"{{"items":[{{"metadata":{{"name":"t","namespace":"n","resourceVersion":"7","managedFields":[{{"manager":"m","fieldsV1":{{}}}}]}},
               "spec":{{"metadata":{{"labels":{{"l":"v"}},"annotations":{{"a":"b"}}}},"spec":{spec}}}}}]}}"#
        );
        #[derive(Deserialize)]
        struct List {
            items: Vec<ResourceClaimTemplate>,
        }
        let list: List = serde_json::from_str(&text)?;
        let [template] = list.items.as_slice() else { panic!("one template") };
        assert_eq!(template.name_any(), "t");
        assert_eq!(template.resource_version().as_deref(), Some("7"));
        assert_eq!(template.labels, BTreeMap::from([("l".to_string(), "v".to_string())]));
        assert_eq!(template.annotations, BTreeMap::from([("a".to_string(), "b".to_string())]));
        assert_eq!(template.claim_spec.as_ref().map(|s| s.get()), Some(spec.as_str()));
        // Parsed as a tree, the same list is refused: what the controller did before.
        assert!(serde_json::from_str::<serde_json::Value>(&text).is_err());
        Ok(())
    }

    #[test]
    fn a_template_without_spec_or_metadata_reads_as_empty() -> Result<(), serde_json::Error> {
        let template: ResourceClaimTemplate = serde_json::from_str(r#"{"metadata":{"name":"t"},"spec":{}}"#)?;
        assert!(template.claim_spec.is_none() && template.labels.is_empty() && template.annotations.is_empty());
        let template: ResourceClaimTemplate = serde_json::from_str(r#"{"metadata":{"name":"t"}}"#)?;
        assert!(template.claim_spec.is_none());
        Ok(())
    }
}
