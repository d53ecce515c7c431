//! Small builders for the objects controller tests create, from JSON so that any field (even one unknown to the
//! compiled types) can be set.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use serde_json::{Value, json};

use super::TestContext;

pub const CLASS: &str = "gpu.test.gpu-dra.dev";

pub fn template_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceClaimTemplate"))
}

/// Creates a ResourceClaimTemplate from a full `spec` (untyped, so unknown fields reach the server).
pub async fn create_template(ctx: &TestContext, name: &str, spec: Value) -> anyhow::Result<DynamicObject> {
    let api = Api::<DynamicObject>::namespaced_with(ctx.client.clone(), &ctx.namespace, &template_resource());
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name}, "spec": spec
    }))?;
    Ok(api.create(&PostParams::default(), &obj).await?)
}

/// A template asking for one device of the test class.
pub fn one_gpu() -> Value {
    json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}}})
}

/// Creates a pod with the given `spec.resourceClaims` (each used by the one container).
pub async fn create_pod(ctx: &TestContext, name: &str, claims: Value) -> anyhow::Result<Pod> {
    let uses: Vec<Value> = claims
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| json!({"name": c["name"]}))
        .collect();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": uses}}],
            "resourceClaims": claims,
            // Keep the scheduler away unless a test wants it: no node carries this label.
            "nodeSelector": {"gpu-dra.dev/test-no-node": "true"}
        }
    }))?;
    Ok(Api::<Pod>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&PostParams::default(), &pod)
        .await?)
}

pub fn pods(ctx: &TestContext) -> Api<Pod> {
    Api::namespaced(ctx.client.clone(), &ctx.namespace)
}

pub fn claims(ctx: &TestContext) -> Api<ResourceClaim> {
    Api::namespaced(ctx.client.clone(), &ctx.namespace)
}

pub async fn list_claims(ctx: &TestContext) -> anyhow::Result<Vec<ResourceClaim>> {
    Ok(claims(ctx).list(&ListParams::default()).await?.items)
}

/// The pod's `status.resourceClaimStatuses` as (pod claim, claim name) pairs.
pub fn claim_statuses(pod: &Pod) -> Vec<(String, Option<String>)> {
    pod.status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|s| (s.name, s.resource_claim_name))
        .collect()
}

/// Events (events.k8s.io/v1) about the object named `name` in the test namespace, as (type, reason, note).
pub async fn events_about(ctx: &TestContext, name: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| {
            (
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default(),
            )
        })
        .collect())
}
