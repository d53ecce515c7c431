//! A node whose GPU is in MIG mode, its MIG devices made by an administrator (static MIG): the agent publishes
//! them (never the GPU whole), the real scheduler allocates mixed profiles by CEL on `profile`, and the kubelet's DRA
//! code prepares CDI devices that give a container the parent GPU's node and its instances' `nvidia-caps` nodes.

use std::collections::BTreeSet;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use super::support::harness::KubeletHarness;
use super::support::node::{DRIVER, NodeDirs, start_agent};
use super::support::process::Component;
use super::support::{TestContext, objects, wait};
use super::{PREPARE_TIMEOUT, inject, pod_using};

/// GPU 0 in MIG mode with four MIG devices, GPU 1 whole.
const GPUS: &str = "1xH100-80GB/mig=3g.40gb+2g.20gb+1g.10gb+1g.10gb,1xH100-80GB";

/// The node publishes the four MIG devices and GPU 1, never GPU 0 whole. A template pod asking two `1g.10gb` and one
/// `3g.40gb` (the chart's MIG class, a CEL selector on `profile`) gets them, prepared with the parent's node and each
/// instance's two capability nodes and the MIG UUIDs in the environment; a third `1g.10gb` waits as unschedulable
/// until that pod is gone; a whole-GPU claim gets GPU 1. A claim asking a time slice of a MIG device is refused at
/// prepare naming the device; NVIDIA's `MigDeviceConfig` with `TimeSlicing` is accepted.
pub(super) async fn a_node_in_mig_mode_hands_out_its_mig_devices(ctx: TestContext) -> anyhow::Result<()> {
    let suffix = &ctx.namespace[ctx.namespace.len() - 6..];
    let node = format!("e2e-{suffix}-mig");
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = start_agent(&ctx, &node, &dirs, &["--gpu-backend", "simulated", "--simulated-gpus", GPUS])?;
    let kubelet = KubeletHarness::start(&ctx, &node, &dirs)?;
    agent.wait_ready().await?;
    kubelet.wait_for("registered", "", std::time::Duration::from_secs(60)).await?;
    let (gpu_class, mig_class) = (format!("{}-gpu", ctx.namespace), format!("{}-mig", ctx.namespace));
    for (name, kind) in [(&gpu_class, "gpu"), (&mig_class, "mig")] {
        // The chart's classes: one per device type.
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": format!(
                "device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{kind}'")}}]}
        }))?;
        Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &class).await?;
    }
    let result = hand_out(&ctx, &node, &dirs, &kubelet, &gpu_class, &mig_class).await;
    for class in [&gpu_class, &mig_class] {
        let _ = Api::<DeviceClass>::all(ctx.client.clone()).delete(class, &DeleteParams::default()).await;
    }
    result
}

async fn hand_out(
    ctx: &TestContext,
    node: &str,
    dirs: &NodeDirs,
    kubelet: &KubeletHarness,
    gpu_class: &str,
    mig_class: &str,
) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let expected_names =
        BTreeSet::from(["gpu-0-mig-14-0-2", "gpu-0-mig-19-2-1", "gpu-0-mig-19-3-1", "gpu-0-mig-9-4-4", "gpu-1"]);
    // The kubelet deletes a driver's slices when the plugin registers; the agent publishes them again at once.
    let devices = wait::until("the node's devices to be published", PREPARE_TIMEOUT, || async {
        let devices = published(ctx, node).await?;
        let names: BTreeSet<String> = devices.iter().map(|(name, _)| name.clone()).collect();
        Ok((!names.is_empty()).then_some(devices))
    })
    .await?;
    let names: BTreeSet<&str> = devices.iter().map(|(name, _)| name.as_str()).collect();
    ensure!(names == expected_names, "published {names:?}, expected {expected_names:?}");

    let _controller = Component::controller(ctx, &[]).await?;
    let profile = |p: &str| format!("device.attributes['{DRIVER}'].profile == '{p}'");
    let request = |name: &str, class: &str, count: u32, selector: Option<String>| {
        let selectors: Vec<Value> = selector.into_iter().map(|s| json!({"cel": {"expression": s}})).collect();
        json!({"name": name, "exactly": {"deviceClassName": class, "count": count, "selectors": selectors}})
    };
    objects::create_template(
        ctx,
        "mixed",
        json!({"spec": {"devices": {"requests": [
            request("small", mig_class, 2, Some(profile("1g.10gb"))),
            request("medium", mig_class, 1, Some(profile("3g.40gb"))),
        ]}}}),
    )
    .await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "mixed"},
        "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                                 "resources": {"claims": [{"name": "mig"}]}}],
                 "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": "mixed"}],
                 "nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0}
    }))?;
    objects::pods(ctx).create(&PostParams::default(), &pod).await?;
    let prepared = kubelet.wait_for("prepared", &format!("{ns}/mixed"), PREPARE_TIMEOUT).await?;
    let ids: Vec<String> = serde_json::from_value(prepared["containers"]["app"].clone())?;
    ensure!(ids.len() == 3, "CDI ids {ids:?}");
    let claim = objects::claim_statuses(&objects::pods(ctx).get("mixed").await?)
        .into_iter()
        .find_map(|(_, claim)| claim)
        .context("no claim recorded for pod mixed")?;
    let got = allocated(ctx, ns, &claim).await?;
    let got_devices: BTreeSet<&str> = got.iter().map(|(_, device)| device.as_str()).collect();
    ensure!(
        got_devices == BTreeSet::from(["gpu-0-mig-19-2-1", "gpu-0-mig-19-3-1", "gpu-0-mig-9-4-4"]),
        "allocated {got:?}"
    );

    // What a runtime injects: the parent GPU, both capability nodes of each instance, the MIG UUIDs.
    let (device_nodes, env) = inject(dirs, &ids)?;
    let mut expected: BTreeSet<String> =
        ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"].map(String::from).into();
    for (gi, ci) in [(2, 0), (3, 0), (4, 0)] {
        // Simulated GPU instances are numbered from 1 in placement order (2g@0, 1g@2, 1g@3, 3g@4: the 3g must take
        // the top half for the rest to fit); the driver's table gives GPU 0's instance I the minors 3 + 9·I and
        // 4 + 9·I + C.
        expected.insert(format!("/dev/nvidia-caps/nvidia-cap{}", 3 + 9 * gi));
        expected.insert(format!("/dev/nvidia-caps/nvidia-cap{}", 4 + 9 * gi + ci));
    }
    ensure!(device_nodes == expected, "injected {device_nodes:?}, expected {expected:?}");
    let uuids: BTreeSet<String> =
        devices.iter().filter(|(n, _)| got_devices.contains(n.as_str())).map(|(_, u)| u.clone()).collect();
    ensure!(uuids.iter().all(|u| u.starts_with("MIG-")), "uuids {uuids:?}");
    let visible = env.iter().find_map(|e| e.strip_prefix("GPU_DRA_GPU_UUIDS=")).context("no GPU_DRA_GPU_UUIDS")?;
    ensure!(visible.split(',').map(String::from).collect::<BTreeSet<_>>() == uuids, "env {env:?}, uuids {uuids:?}");

    // No third 1g.10gb: it waits. A whole GPU is GPU 1, never the GPU in MIG mode.
    claim_and_pod(ctx, "late", node, json!([request("gpu", mig_class, 1, Some(profile("1g.10gb")))]), json!([]))
        .await?;
    let why = objects::unschedulable(&ctx.client, ns, "late", PREPARE_TIMEOUT).await?;
    claim_and_pod(ctx, "whole", node, json!([request("gpu", gpu_class, 1, None)]), json!([])).await?;
    kubelet.wait_for("prepared", &format!("{ns}/whole"), PREPARE_TIMEOUT).await?;
    let whole = allocated(ctx, ns, "whole").await?;
    ensure!(whole.iter().map(|(_, d)| d.as_str()).eq(["gpu-1"]), "whole GPU claim got {whole:?}");

    // A time slice is a whole GPU's: asking one of a MIG device is refused, naming it.
    let two_g = || json!([request("gpu", mig_class, 1, Some(profile("2g.20gb")))]);
    let long = json!([{"opaque": {"driver": DRIVER, "parameters": {"apiVersion": format!("{DRIVER}/v1alpha1"),
        "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}}}]);
    claim_and_pod(ctx, "sliced", node, two_g(), long).await?;
    let failed = kubelet.wait_for("prepare-failed", &format!("{ns}/sliced"), PREPARE_TIMEOUT).await?;
    let error = failed["error"].as_str().unwrap_or_default();
    ensure!(error.contains("asks time slice Long of MIG device \"gpu-0-mig-14-0-2\""), "prepare-failed: {failed}");
    delete_pod_and_claim(ctx, "sliced", kubelet).await?;
    // NVIDIA's MigDeviceConfig, as manifests written for NVIDIA's driver carry it.
    let nvidia = json!([{"opaque": {"driver": DRIVER, "parameters": {"apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}}}}]);
    claim_and_pod(ctx, "nvidia-spelled", node, two_g(), nvidia).await?;
    kubelet.wait_for("prepared", &format!("{ns}/nvidia-spelled"), PREPARE_TIMEOUT).await?;

    // The mixed pod goes: its MIG devices are free again, and the waiting pod gets one.
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    objects::pods(ctx).delete("mixed", &now).await?;
    kubelet.wait_for("unprepared", &format!("{ns}/mixed"), PREPARE_TIMEOUT).await?;
    kubelet.wait_for("prepared", &format!("{ns}/late"), PREPARE_TIMEOUT).await?;
    let late = allocated(ctx, ns, "late").await?;
    ensure!(
        late.iter().all(|(_, d)| d == "gpu-0-mig-19-2-1" || d == "gpu-0-mig-19-3-1") && late.len() == 1,
        "{late:?}"
    );
    ensure!(dirs.cdi_specs()?.len() == 3, "specs: {:?}", dirs.cdi_specs()?);
    eprintln!("MIG devices of mixed profiles handed out; the third 1g.10gb waited ({why}) until they were free");

    // A fault of the GPU is every MIG device's: named by one MIG device, all four are tainted, GPU 1 is not.
    let inject = |line: &str| -> anyhow::Result<()> {
        let aside = dirs.state().join("inject-faults.writing");
        std::fs::write(&aside, format!("{line}\n"))?;
        std::fs::rename(&aside, dirs.state().join("inject-faults"))?;
        Ok(())
    };
    inject("gpu-0-mig-19-2-1 xid 79")?;
    let gpu0: BTreeSet<String> =
        expected_names.iter().filter(|d| d.starts_with("gpu-0-")).map(|d| d.to_string()).collect();
    wait::until("the MIG devices of the faulted GPU to be tainted", PREPARE_TIMEOUT, || async {
        Ok((tainted(ctx, node).await? == gpu0).then_some(()))
    })
    .await?;
    inject("gpu-0 clear")?;
    wait::until("the taints to go with the reset", PREPARE_TIMEOUT, || async {
        Ok(tainted(ctx, node).await?.is_empty().then_some(()))
    })
    .await?;
    Ok(())
}

/// The devices `node` publishes with taints.
async fn tainted(ctx: &TestContext, node: &str) -> anyhow::Result<BTreeSet<String>> {
    let devices = objects::published_devices(&ctx.client, node).await?;
    Ok(devices.into_iter().filter(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty())).map(|d| d.name).collect())
}

/// (device name, uuid) of every device `node` publishes.
async fn published(ctx: &TestContext, node: &str) -> anyhow::Result<Vec<(String, String)>> {
    let devices = objects::published_devices(&ctx.client, node).await?;
    Ok(devices
        .into_iter()
        .map(|d| {
            let uuid = d.attributes.as_ref().and_then(|a| a.get("uuid")).and_then(|a| a.string.clone());
            (d.name, uuid.unwrap_or_default())
        })
        .collect())
}

/// The (pool, device) pairs allocated to claim `name` in `namespace`.
async fn allocated(ctx: &TestContext, namespace: &str, name: &str) -> anyhow::Result<BTreeSet<(String, String)>> {
    let claim = Api::<ResourceClaim>::namespaced(ctx.client.clone(), namespace).get(name).await?;
    let results = claim.status.and_then(|s| s.allocation).and_then(|a| a.devices).and_then(|d| d.results);
    Ok(results.unwrap_or_default().into_iter().map(|r| (r.pool, r.device)).collect())
}

/// Claim `name` with `requests` and `config`, and a pod of the same name on `node` using it.
async fn claim_and_pod(
    ctx: &TestContext,
    name: &str,
    node: &str,
    requests: Value,
    config: Value,
) -> anyhow::Result<()> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": requests, "config": config}}
    }))?;
    objects::claims(ctx).create(&PostParams::default(), &claim).await?;
    objects::pods(ctx).create(&PostParams::default(), &pod_using(name, node, name)?).await?;
    Ok(())
}

async fn delete_pod_and_claim(ctx: &TestContext, name: &str, kubelet: &KubeletHarness) -> anyhow::Result<()> {
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    objects::pods(ctx).delete(name, &now).await?;
    // Never prepared: nothing to unprepare, so the kubelet side only finishes the deletion.
    kubelet.wait_for("deleted", &format!("{}/{name}", ctx.namespace), PREPARE_TIMEOUT).await?;
    objects::claims(ctx).delete(name, &DeleteParams::default()).await?;
    Ok(())
}
