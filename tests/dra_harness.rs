//! Proof that Dynamic Resource Allocation works in the test harness: the REAL kube-scheduler allocates devices
//! from a ResourceSlice to a claim with a CEL selector, binds the pod and reserves the claim for it; a claim that
//! nothing matches leaves its pod unschedulable, with the scheduler's reason on the pod.

mod support;

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use support::{TestContext, cluster::pinned_kubernetes_version, wait};

/// The driver name the harness's fake devices are published under.
const DRIVER: &str = "harness.gpu-dra.dev";
const SCHEDULING_TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    support::run(
        "dra_harness",
        &[
            test!(api_server_reports_pinned_version),
            test!(scheduler_allocates_matching_device_and_reserves_claim),
            test!(claim_matching_no_device_leaves_pod_unschedulable),
            test!(rbac_refuses_identity_without_grants),
        ],
    )
}

async fn api_server_reports_pinned_version(ctx: TestContext) -> anyhow::Result<()> {
    let info = ctx.client.apiserver_version().await?;
    let pinned = pinned_kubernetes_version()?;
    ensure!(info.git_version == pinned, "/version says {}, pinned {pinned}", info.git_version);
    Ok(())
}

/// A node of the test's own, a DeviceClass and a slice with two GPUs of different products on it.
struct FakeGpuNode {
    node: String,
    class: String,
}

async fn fake_gpu_node(ctx: &TestContext) -> anyhow::Result<FakeGpuNode> {
    let node = format!("{}-node", ctx.namespace);
    ctx.cluster.add_node(&node)?;
    let class = ctx.namespace.clone();
    let device_class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": class},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}]}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone())
        .create(&PostParams::default(), &device_class)
        .await
        .context("create DeviceClass")?;
    let gpu = |name: &str, index: i64, product: &str| {
        json!({
            "name": name,
            "attributes": {"productName": {"string": product}, "index": {"int": index}},
            "capacity": {"memory": {"value": "80Gi"}}
        })
    };
    let slice: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": format!("{node}-slice")},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [gpu("gpu-0", 0, "NVIDIA H100 80GB HBM3"), gpu("gpu-1", 1, "NVIDIA A100-SXM4-80GB")]
        }
    }))?;
    Api::<ResourceSlice>::all(ctx.client.clone())
        .create(&PostParams::default(), &slice)
        .await
        .context("create ResourceSlice")?;
    Ok(FakeGpuNode { node, class })
}

/// Creates a claim for one device of `class` matching `cel`, and a pod on `node` that uses it.
async fn claim_and_pod(ctx: &TestContext, gpus: &FakeGpuNode, name: &str, cel: &str) -> anyhow::Result<()> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{
            "name": "gpu",
            "exactly": {"deviceClassName": gpus.class, "selectors": [{"cel": {"expression": cel}}]}
        }]}}
    }))?;
    Api::<ResourceClaim>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&PostParams::default(), &claim)
        .await
        .context("create ResourceClaim")?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": gpus.node},
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]
        }
    }))?;
    Api::<Pod>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&PostParams::default(), &pod)
        .await
        .context("create Pod")?;
    Ok(())
}

async fn scheduler_allocates_matching_device_and_reserves_claim(ctx: TestContext) -> anyhow::Result<()> {
    let gpus = fake_gpu_node(&ctx).await?;
    let cel = format!("device.attributes['{DRIVER}'].productName.startsWith('NVIDIA H100')");
    claim_and_pod(&ctx, &gpus, "h100", &cel).await?;

    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ctx.namespace);
    let pod = wait::until("the scheduler to bind the pod", SCHEDULING_TIMEOUT, || async {
        let pod = pods.get("h100").await?;
        Ok(pod.spec.as_ref().and_then(|s| s.node_name.clone()).map(|node| (node, pod)))
    })
    .await?;
    ensure!(pod.0 == gpus.node, "pod bound to {}, expected {}", pod.0, gpus.node);
    let pod_uid = pod.1.metadata.uid.clone().context("pod has no uid")?;

    let claim = Api::<ResourceClaim>::namespaced(ctx.client.clone(), &ctx.namespace).get("h100").await?;
    let status = claim.status.context("claim has no status")?;
    let results = status
        .allocation
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .context("claim has no status.allocation.devices.results")?;
    ensure!(results.len() == 1, "expected one allocated device, got {results:?}");
    let result = &results[0];
    ensure!(
        (result.driver.as_str(), result.pool.as_str(), result.device.as_str(), result.request.as_str())
            == (DRIVER, gpus.node.as_str(), "gpu-0", "gpu"),
        "allocated the wrong device: {result:?}"
    );
    let reserved = status.reserved_for.unwrap_or_default();
    ensure!(
        reserved.len() == 1
            && reserved[0].resource == "pods"
            && reserved[0].name == "h100"
            && reserved[0].uid == pod_uid,
        "claim not reserved for the pod: {reserved:?}"
    );
    Ok(())
}

async fn claim_matching_no_device_leaves_pod_unschedulable(ctx: TestContext) -> anyhow::Result<()> {
    let gpus = fake_gpu_node(&ctx).await?;
    let cel = format!("device.attributes['{DRIVER}'].productName == 'NVIDIA B200'");
    claim_and_pod(&ctx, &gpus, "b200", &cel).await?;

    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ctx.namespace);
    let (reason, message) = wait::until("the scheduler to mark the pod unschedulable", SCHEDULING_TIMEOUT, || async {
        let pod = pods.get("b200").await?;
        let condition = pod
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False");
        Ok(condition.map(|c| (c.reason.unwrap_or_default(), c.message.unwrap_or_default())))
    })
    .await?;
    ensure!(reason == "Unschedulable", "PodScheduled reason {reason:?}: {message}");
    ensure!(
        message.contains("cannot allocate all claims"),
        "the scheduler's message does not name the claim as the reason: {message}"
    );
    let pod = pods.get("b200").await?;
    ensure!(pod.spec.and_then(|s| s.node_name).is_none(), "pod was bound");
    let claim = Api::<ResourceClaim>::namespaced(ctx.client.clone(), &ctx.namespace).get("b200").await?;
    ensure!(claim.status.and_then(|s| s.allocation).is_none(), "a claim nothing matches got an allocation");
    Ok(())
}

/// The API server authorizes with RBAC: a service account without grants is refused; the same identity can
/// act once a Role allows it. (Permission tests of the components rely on this being real.)
async fn rbac_refuses_identity_without_grants(ctx: TestContext) -> anyhow::Result<()> {
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "nobody"}}))?;
    let service_accounts = Api::<ServiceAccount>::namespaced(ctx.client.clone(), &ctx.namespace);
    service_accounts.create(&PostParams::default(), &sa).await?;
    let request: TokenRequest = serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 600}}))?;
    let token = service_accounts
        .create_token_request("nobody", &PostParams::default(), &request)
        .await
        .context("TokenRequest")?
        .status
        .context("TokenRequest has no status")?
        .token;

    let mut config = ctx.cluster.client_config().await?;
    config.auth_info = kube::config::AuthInfo { token: Some(token.into()), ..Default::default() };
    let nobody = {
        gpu_dra::kube_client::install_crypto_provider();
        kube::Client::try_from(config)
    }?;
    let pods = Api::<Pod>::namespaced(nobody.clone(), &ctx.namespace);
    match pods.list(&ListParams::default()).await {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => anyhow::bail!("listing pods without a grant was not refused with 403: {other:?}"),
    }

    let grant: serde_json::Value = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    });
    let binding: serde_json::Value = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "nobody-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": ctx.namespace}]
    });
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    Api::<Role>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&PostParams::default(), &serde_json::from_value(grant)?)
        .await?;
    Api::<RoleBinding>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&PostParams::default(), &serde_json::from_value(binding)?)
        .await?;
    wait::until("the RoleBinding to take effect", Duration::from_secs(10), || async {
        Ok(pods.list(&ListParams::default()).await.ok().map(|_| ()))
    })
    .await?;
    let _ = service_accounts.delete("nobody", &DeleteParams::default()).await;
    Ok(())
}
