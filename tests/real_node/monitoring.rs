//! What a GPU monitor sees on the real node: DCGM-exporter-style tools learn which pod holds which GPU from the
//! kubelet's PodResources API (KEP-3695: `dynamic_resources`), which the kubelet fills from the agent's
//! NodePrepareResources answers. The pod is the DRA example driver's `initcontainer-shared-gpu` (an init container
//! and the main container sharing one template claim) with a sidecar that asks for no GPU.

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, LogParams, PostParams};
use serde_json::json;

use super::support::pod_resources;
use super::support::{TestContext, objects, wait};
use super::{SHOW_GPUS, Seen, WAIT, allocated, claim_of, claim_uid, create_template, install, on_gpu_node};

/// What the init container runs: lists its GPU, then exits.
const INIT: &str = "ls -l /dev/ | grep ' nvidia[0-9]*$'; echo GPU_DRA_GPU_UUIDS=$GPU_DRA_GPU_UUIDS; echo listed";

/// The init container and the main container see the same GPU, the one allocated; the kubelet's PodResources
/// `List` reports it for the main container (claim, namespace, driver, the node's pool, the device, the CDI devices
/// the agent's spec defines for the claim) and nothing for the sidecar.
pub(super) async fn a_gpu_monitor_sees_which_container_holds_which_gpu_through_pod_resources(
    ctx: TestContext,
) -> anyhow::Result<()> {
    on_gpu_node(&ctx, "monitored-node", async |node| {
        install(&ctx, node)?;
        create_template(&ctx).await?;
        let claims = json!([{"name": "gpu"}]);
        let container = |name: &str, command: &str, claims: serde_json::Value| {
            json!({"name": name, "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
                   "command": ["sh", "-c", command], "resources": {"claims": claims}})
        };
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "pod0"},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node.name}, "terminationGracePeriodSeconds": 1,
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                     "initContainers": [container("init0", INIT, claims.clone())],
                     "containers": [container("ctr0", SHOW_GPUS, claims),
                                    container("sidecar", "exec sleep 3600", json!([]))]}
        }))?;
        objects::pods(&ctx).create(&PostParams::default(), &pod).await?;
        let claim = claim_of(&ctx, "pod0").await?;
        let main = seen_in(&ctx, "pod0", "ctr0").await?;
        let init = seen_in(&ctx, "pod0", "init0").await?;
        let want = allocated(&ctx, &node.name, &claim).await?;
        ensure!(main == want && main.minors.len() == 1, "ctr0 sees {main:?}; {claim} was allocated {want:?}");
        ensure!(init == main, "the init container saw {init:?}, the main container {main:?}");

        let device = allocated_device(&ctx, &claim).await?;
        let uid = claim_uid(&ctx, &claim).await?;
        let listed = wait::until("the kubelet's PodResources to list pod0", WAIT, || async {
            let pods = pod_resources::list(&node.kubelet_dir()?).await?;
            Ok(pods.into_iter().find(|p| p.name == "pod0" && p.namespace == ctx.namespace))
        })
        .await?;
        let of = |name: &str| listed.containers.iter().find(|c| c.name == name).cloned();
        let ctr0 = of("ctr0").with_context(|| format!("no ctr0 in {listed:?}"))?;
        let [resource] = ctr0.dynamic_resources.as_slice() else {
            anyhow::bail!("ctr0's dynamic resources: {:?}", ctr0.dynamic_resources)
        };
        ensure!(resource.claim_name == claim && resource.claim_namespace == ctx.namespace, "{resource:?}");
        let [held] = resource.claim_resources.as_slice() else { anyhow::bail!("claim resources: {resource:?}") };
        ensure!(
            held.driver_name == "gpu.gpu-dra.dev" && held.pool_name == node.name && held.device_name == device,
            "PodResources says {held:?}; the claim was allocated {device} of pool {}",
            node.name
        );
        let ids: Vec<&str> = held.cdi_devices.iter().map(|d| d.name.as_str()).collect();
        ensure!(
            !ids.is_empty() && ids.iter().all(|id| id.starts_with("gpu.gpu-dra.dev/gpu=") && id.contains(&uid)),
            "CDI devices {ids:?} are not the claim's ({uid})"
        );
        let sidecar = of("sidecar").with_context(|| format!("no sidecar in {listed:?}"))?;
        ensure!(sidecar.dynamic_resources.is_empty(), "the sidecar holds {:?}", sidecar.dynamic_resources);
        eprintln!("PodResources: pod0/ctr0 holds {device} of {} ({ids:?})", node.name);
        Ok(())
    })
    .await
}

/// What container `container` of `pod` printed about its GPUs, once it has listed them.
async fn seen_in(ctx: &TestContext, pod: &str, container: &str) -> anyhow::Result<Seen> {
    let pods: Api<Pod> = objects::pods(ctx);
    let params = LogParams { container: Some(container.to_string()), ..Default::default() };
    let log = wait::until(&format!("{pod}/{container} to list its devices"), WAIT, || async {
        match pods.logs(pod, &params).await {
            Ok(log) if log.contains("listed") => Ok(Some(log)),
            // Not started yet (the API server answers 400 until the container exists).
            Ok(_) | Err(kube::Error::Api(_)) => Ok(None),
            Err(err) => Err(err.into()),
        }
    })
    .await?;
    super::parse_seen(pod, &log)
}

/// The device the scheduler allocated to `claim` (one).
async fn allocated_device(ctx: &TestContext, claim: &str) -> anyhow::Result<String> {
    let claim = objects::claims(ctx).get(claim).await?;
    let results = claim.status.and_then(|s| s.allocation).and_then(|a| a.devices).and_then(|d| d.results);
    match results.unwrap_or_default().as_slice() {
        [one] => Ok(one.device.clone()),
        other => anyhow::bail!("allocation results {other:?}"),
    }
}
