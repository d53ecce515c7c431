//! Small builders for the objects controller tests create, from JSON so that any field (even one unknown to the
//! compiled types) can be set.

use k8s_openapi::api::core::v1::{Node, Pod, ResourceQuota};
use k8s_openapi::api::resource::v1::{Device, DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::TestContext;

pub const CLASS: &str = "gpu.test.gpu-dra.dev";

pub fn template_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceClaimTemplate"))
}

/// Creates a ResourceClaimTemplate from a full `spec` (untyped, so unknown fields reach the server).
pub async fn create_template(ctx: &TestContext, name: &str, spec: Value) -> anyhow::Result<DynamicObject> {
    create_template_in(&ctx.client, &ctx.namespace, name, spec).await
}

/// [`create_template`] in `namespace`, for callers without a [`TestContext`] (the benchmarks).
pub async fn create_template_in(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    spec: Value,
) -> anyhow::Result<DynamicObject> {
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &template_resource());
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name}, "spec": spec
    }))?;
    Ok(api.create(&PostParams::default(), &obj).await?)
}

/// Creates `namespace` and in it the template `one-gpu`, asking for one device of `class` (the benchmarks' start).
pub async fn namespace_with_one_gpu_template(
    client: &kube::Client,
    namespace: &str,
    class: &str,
) -> anyhow::Result<()> {
    let ns: k8s_openapi::api::core::v1::Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))?;
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    let spec = json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}]}}});
    create_template_in(client, namespace, "one-gpu", spec).await?;
    Ok(())
}

/// A template asking for one device of the test class.
pub fn one_gpu() -> Value {
    json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}}})
}

/// Creates a pod with the given `spec.resourceClaims`, kept away from the scheduler (no node carries its
/// node selector) unless a test wants it there.
pub async fn create_pod(ctx: &TestContext, name: &str, claims: Value) -> anyhow::Result<Pod> {
    create_pod_selecting(ctx, name, claims, json!({"gpu-dra.dev/test-no-node": "true"})).await
}

/// Creates a pod pinned to `node` (by node selector) with the given `spec.resourceClaims`.
pub async fn create_pod_on(ctx: &TestContext, name: &str, node: &str, claims: Value) -> anyhow::Result<Pod> {
    create_pod_selecting(ctx, name, claims, json!({"kubernetes.io/hostname": node})).await
}

/// A pod whose one container uses every claim in `claims`, with `node_selector`.
async fn create_pod_selecting(
    ctx: &TestContext,
    name: &str,
    claims: Value,
    node_selector: Value,
) -> anyhow::Result<Pod> {
    let uses: Vec<Value> = claims.as_array().into_iter().flatten().map(|c| json!({"name": c["name"]})).collect();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": uses}}],
            "resourceClaims": claims,
            "nodeSelector": node_selector
        }
    }))?;
    Ok(pods(ctx).create(&PostParams::default(), &pod).await?)
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
    events_in(ctx, &ctx.namespace, name).await
}

/// Like [`events_about`], in `namespace` (e.g. `default` for events about a Node).
pub async fn events_in(
    ctx: &TestContext,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Vec<(String, String, String)>> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ctx.client.clone(), namespace);
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.type_.unwrap_or_default(), e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect())
}

/// Creates ServiceAccount `name` in the test namespace, binds `rules` to it with a Role, and returns a token.
pub async fn service_account_with_rules(ctx: &TestContext, name: &str, rules: Value) -> anyhow::Result<String> {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let pp = PostParams::default();
    let sas = Api::<ServiceAccount>::namespaced(ctx.client.clone(), &ctx.namespace);
    sas.create(&pp, &serde_json::from_value(json!({"metadata": {"name": name}}))?).await?;
    let role = json!({"metadata": {"name": name}, "rules": rules});
    Api::<Role>::namespaced(ctx.client.clone(), &ctx.namespace).create(&pp, &serde_json::from_value(role)?).await?;
    let binding = json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}]
    });
    Api::<RoleBinding>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&pp, &serde_json::from_value(binding)?)
        .await?;
    let request: TokenRequest = serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 3600}}))?;
    let status = sas.create_token_request(name, &pp, &request).await?.status;
    Ok(status.map(|s| s.token).unwrap_or_default())
}

/// Sets a claim's allocation (one device of `pool`) and `reservedFor` directly, as a scheduler would.
pub async fn allocate(ctx: &TestContext, claim: &str, reserved_for: Value, finalizer: bool) -> anyhow::Result<()> {
    let api = claims(ctx);
    if finalizer {
        let patch = json!({"metadata": {"finalizers": ["resource.kubernetes.io/delete-protection"]}});
        api.patch(claim, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await?;
    }
    let status = json!({"status": {
        "allocation": {"devices": {"results": [
            {"request": "gpu", "driver": CLASS, "pool": "test-pool", "device": "gpu-0"}
        ]}},
        "reservedFor": reserved_for
    }});
    api.patch_status(claim, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&status)).await?;
    Ok(())
}

/// Creates a user-managed claim `name` asking for one device of the test class.
pub async fn create_claim(ctx: &TestContext, name: &str) -> anyhow::Result<ResourceClaim> {
    let claim: ResourceClaim = serde_json::from_value(json!({"metadata": {"name": name}, "spec": one_gpu()["spec"]}))?;
    Ok(claims(ctx).create(&PostParams::default(), &claim).await?)
}

/// Sets a pod's phase (as a kubelet would).
pub async fn set_phase(ctx: &TestContext, pod: &str, phase: &str) -> anyhow::Result<()> {
    let patch = json!({"status": {"phase": phase}});
    pods(ctx).patch_status(pod, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await?;
    Ok(())
}

/// A Ready node of the test's own with `gpus` devices published in a ResourceSlice, and a DeviceClass for them.
#[derive(Debug)]
pub struct FakeGpuNode {
    pub name: String,
    pub class: String,
    pub driver: String,
}

pub async fn fake_gpu_node(ctx: &TestContext, gpus: usize) -> anyhow::Result<FakeGpuNode> {
    let name = format!("{}-node", ctx.namespace);
    ctx.cluster.add_node(&name)?;
    let driver = "gpu.test.gpu-dra.dev".to_string();
    // One class per test: a class selecting this node's devices by pool keeps parallel tests apart.
    let class = ctx.namespace.clone();
    let selector = format!("device.driver == '{driver}'");
    let device_class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": class}, "spec": {"selectors": [{"cel": {"expression": selector}}]}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &device_class).await?;
    let devices: Vec<Value> =
        (0..gpus).map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"index": {"int": i}}})).collect();
    let slice: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": format!("{name}-slice")},
        "spec": {"driver": driver, "nodeName": name, "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices}
    }))?;
    Api::<ResourceSlice>::all(ctx.client.clone()).create(&PostParams::default(), &slice).await?;
    Ok(FakeGpuNode { name, class, driver })
}

/// Every device `node`'s ResourceSlices publish, in slice order.
pub async fn published_devices(client: &kube::Client, node: &str) -> anyhow::Result<Vec<Device>> {
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?;
    Ok(slices.items.into_iter().flat_map(|s| s.spec.devices.unwrap_or_default()).collect())
}

/// The scheduler's message while `pod` is Pending as unschedulable (its `PodScheduled` condition).
pub fn unschedulable_message(pod: &Pod) -> Option<String> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let scheduled = conditions
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))?;
    Some(scheduled.message.clone().unwrap_or_default())
}

/// Marks `node` unschedulable (`kubectl cordon`) or schedulable again (`kubectl uncordon`).
pub async fn cordon(client: &kube::Client, node: &str, unschedulable: bool) -> anyhow::Result<()> {
    let patch = json!({"spec": {"unschedulable": unschedulable}});
    Api::<Node>::all(client.clone()).patch(node, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(())
}

/// Waits until the scheduler has said why `pod` in `namespace` cannot be placed; returns its message.
pub async fn unschedulable(
    client: &kube::Client,
    namespace: &str,
    pod: &str,
    timeout: std::time::Duration,
) -> anyhow::Result<String> {
    let pods = Api::<Pod>::namespaced(client.clone(), namespace);
    super::wait::until(&format!("{namespace}/{pod} to be found unschedulable"), timeout, || async {
        Ok(unschedulable_message(&pods.get(pod).await?))
    })
    .await
}

/// Creates a DeviceClass named after the test's namespace that selects every device of the node agents' driver.
pub async fn driver_device_class(ctx: &TestContext) -> anyhow::Result<()> {
    let driver = super::node::DRIVER;
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": ctx.namespace},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{driver}'")}}]}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &class).await?;
    Ok(())
}

/// Creates ResourceQuota `name` in the test's namespace limiting `resource` to `hard`, and waits until the quota
/// controller has taken it up (its status lists the limit): until then the API server refuses every create the
/// quota covers.
pub async fn create_quota(ctx: &TestContext, name: &str, resource: &str, hard: &str) -> anyhow::Result<()> {
    let quota: ResourceQuota =
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"hard": {resource: hard}}}))?;
    let quotas: Api<ResourceQuota> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    quotas.create(&PostParams::default(), &quota).await?;
    super::wait::until(
        &format!("the quota controller to take up quota {name}"),
        std::time::Duration::from_secs(60),
        || async {
            let hard = quotas.get(name).await?.status.and_then(|s| s.hard);
            Ok(hard.is_some_and(|h| h.contains_key(resource)).then_some(()))
        },
    )
    .await
}
