//! A GPU in MIG mode on the real node: containers get exactly their MIG devices through containerd's CDI support.

use std::collections::BTreeSet;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use serde_json::json;

use super::support::real_node::RealNode;
use super::support::{TestContext, objects};
use super::{WAIT, claim_of, delete_and_wait, install_with, listing, on_gpu_node};

/// What a MIG workload prints: its GPU nodes, its capability nodes, the UUIDs it was given.
const SHOW_MIG: &str = "ls -l /dev/ | grep ' nvidia[0-9]*$'; ls -l /dev/nvidia-caps/ 2>/dev/null | grep nvidia-cap; \
                        echo GPU_DRA_GPU_UUIDS=$GPU_DRA_GPU_UUIDS; echo listed; exec sleep 3600";

/// `helm install` with one simulated H100 in MIG mode (a 3g.40gb and three 1g.10gb) and a class for profile
/// 1g.10gb: three pods asking a profile each through the chart's MIG class, and one asking
/// `nvidia.com/mig-1g.10gb: 1` as written for NVIDIA's device plugin, see the parent's `/dev/nvidia0`, exactly the
/// two `nvidia-caps` nodes of their own GPU and compute instance (created by the runtime from the CDI spec: NVIDIA's
/// major 195, the simulated `nvidia-caps` major 508), and their own `MIG-` UUID; a fourth 1g.10gb pod stays
/// unschedulable. The GPUs are simulated: this is the runtime's side, NVML discovery is not exercised.
pub(super) async fn containers_get_exactly_their_mig_devices(ctx: TestContext) -> anyhow::Result<()> {
    on_gpu_node(&ctx, "mig-gpu-node", async |node| mig_devices(&ctx, node).await).await
}

/// What a container printed: (GPU minors, capability minors, UUIDs).
type Seen = (BTreeSet<u32>, BTreeSet<u32>, BTreeSet<String>);

async fn mig_devices(ctx: &TestContext, node: &RealNode) -> anyhow::Result<()> {
    let n = node.name.as_str();
    install_with(
        ctx,
        node,
        &[
            "nodeAgent.simulatedGpus=1xH100-80GB/mig=3g.40gb+1g.10gb+1g.10gb+1g.10gb",
            "deviceClasses.mig.profiles={1g.10gb}",
        ],
    )?;
    for (template, profile) in [("one-1g", "1g.10gb"), ("one-3g", "3g.40gb")] {
        let selector = format!("device.attributes['gpu.gpu-dra.dev'].profile == '{profile}'");
        objects::create_template(
            ctx,
            template,
            json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "mig.gpu-dra.dev", "selectors": [{"cel": {"expression": selector}}]}}]}}}),
        )
        .await?;
    }
    let pods =
        [("small-a", Some("one-1g")), ("small-b", Some("one-1g")), ("medium", Some("one-3g")), ("plugin-style", None)];
    for (pod, template) in pods {
        mig_workload(ctx, pod, n, template).await?;
    }
    let mut all_caps = BTreeSet::new();
    for (pod, _) in pods {
        let (gpus, caps, uuids) = seen(ctx, pod).await?;
        let (expected_caps, expected_uuid) = allocated(ctx, n, pod).await?;
        ensure!(gpus == BTreeSet::from([0]), "{pod} sees GPU nodes {gpus:?}, expected the parent's /dev/nvidia0");
        ensure!(caps == expected_caps, "{pod} sees capability nodes {caps:?}, expected {expected_caps:?}");
        ensure!(uuids == BTreeSet::from([expected_uuid.clone()]), "{pod} was given {uuids:?}, not {expected_uuid}");
        ensure!(all_caps.is_disjoint(&caps), "{pod} shares a capability node with another pod: {caps:?}");
        all_caps.extend(caps);
    }
    mig_workload(ctx, "small-c", n, Some("one-1g")).await?;
    let why = objects::unschedulable(&ctx.client, &ctx.namespace, "small-c", WAIT).await?;
    eprintln!(
        "four containers (one asking nvidia.com/mig-1g.10gb) saw exactly their MIG devices; a fourth 1g.10gb waited ({why})"
    );
    for (pod, _) in pods {
        delete_and_wait(ctx, pod).await?;
    }
    delete_and_wait(ctx, "small-c").await
}

/// A pod on `node` running [`SHOW_MIG`], claiming from `template` (`None`: `nvidia.com/mig-1g.10gb: 1`).
async fn mig_workload(ctx: &TestContext, name: &str, node: &str, template: Option<&str>) -> anyhow::Result<()> {
    let mut spec = json!({"nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
                        "command": ["sh", "-c", SHOW_MIG]}]});
    match template {
        Some(template) => {
            spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": template}]);
            spec["containers"][0]["resources"] = json!({"claims": [{"name": "gpu"}]});
        }
        None => spec["containers"][0]["resources"] = json!({"limits": {"nvidia.com/mig-1g.10gb": 1}}),
    }
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec}))?;
    objects::pods(ctx).create(&PostParams::default(), &pod).await?;
    Ok(())
}

/// Waits for `pod`'s listing and parses it; every node must be a character device with NVIDIA's major (195) or the
/// simulated `nvidia-caps` major (508).
async fn seen(ctx: &TestContext, pod: &str) -> anyhow::Result<Seen> {
    let log = listing(ctx, &ctx.namespace, pod).await?;
    let (mut gpus, mut caps, mut uuids) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    for line in log.lines() {
        let last = line.split_whitespace().last().unwrap_or_default();
        if let Some(list) = line.strip_prefix("GPU_DRA_GPU_UUIDS=") {
            uuids = list.split(',').filter(|u| !u.is_empty()).map(String::from).collect();
        } else if let Some(minor) = last.strip_prefix("nvidia-cap") {
            ensure!(line.starts_with('c') && line.contains(" 508,"), "{pod}: odd capability node: {line}");
            caps.insert(minor.parse().with_context(|| format!("{pod}: odd line {line}"))?);
        } else if let Some(minor) = last.strip_prefix("nvidia") {
            ensure!(line.starts_with('c') && line.contains(" 195,"), "{pod}: odd GPU node: {line}");
            gpus.insert(minor.parse().with_context(|| format!("{pod}: odd line {line}"))?);
        }
    }
    Ok((gpus, caps, uuids))
}

/// The capability minors and UUID of the MIG device allocated to `pod`'s claim, from what the agent published: the
/// driver's numbering for GPU 0's GPU instance I and compute instance C is 3 + 9·I and 4 + 9·I + C.
async fn allocated(ctx: &TestContext, node: &str, pod: &str) -> anyhow::Result<(BTreeSet<u32>, String)> {
    let claim = objects::claims(ctx).get(&claim_of(ctx, pod).await?).await?;
    let results = claim.status.and_then(|s| s.allocation).and_then(|a| a.devices).and_then(|d| d.results);
    let device = results.unwrap_or_default().into_iter().next().context("nothing allocated")?.device;
    let devices = objects::published_devices(&ctx.client, node).await?;
    let published = devices.iter().find(|d| d.name == device).with_context(|| format!("{device} not published"))?;
    let attributes = published.attributes.as_ref().context("no attributes")?;
    let int = |name: &str| attributes.get(name).and_then(|a| a.int).with_context(|| format!("no {name}"));
    let (gi, ci) = (u32::try_from(int("gpuInstance")?)?, u32::try_from(int("computeInstance")?)?);
    let uuid = attributes.get("uuid").and_then(|a| a.string.clone()).context("no uuid")?;
    Ok((BTreeSet::from([3 + 9 * gi, 4 + 9 * gi + ci]), uuid))
}
