//! A node whose GPU is in MIG mode, its MIG devices made by an administrator (static MIG): the agent publishes
//! them (never the GPU whole), the real scheduler allocates mixed profiles by CEL on `profile`, and the kubelet's DRA
//! code prepares CDI devices that give a container the parent GPU's node and its instances' `nvidia-caps` nodes.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};

use super::support::harness::KubeletHarness;
use super::support::node::{DRIVER, NodeDirs, gpu_cdi_ids, start_agent};
use super::support::process::Component;
use super::support::{self, TestContext, objects, wait};
use super::{PREPARE_TIMEOUT, inject, pod_using};

/// GPU 0 in MIG mode with four MIG devices, GPU 1 whole.
const GPUS: &str = "1xH100-80GB/mig=3g.40gb+2g.20gb+1g.10gb+1g.10gb,1xH100-80GB";

/// The node publishes the four MIG devices and GPU 1, never GPU 0 whole. A template pod asking two `1g.10gb` and one
/// `3g.40gb` (the chart's MIG class, a CEL selector on `profile`) gets them, prepared with the parent's node and each
/// instance's two capability nodes and the MIG UUIDs in the environment; a third `1g.10gb` waits as unschedulable
/// until that pod is gone; a whole-GPU claim gets GPU 1. A claim asking a time slice of a MIG device is refused at
/// prepare naming the device; NVIDIA's `MigDeviceConfig` with `TimeSlicing` is accepted.
pub(super) async fn a_node_in_mig_mode_hands_out_its_mig_devices(ctx: TestContext) -> anyhow::Result<()> {
    let bed = MigNode::start(&ctx, "mig", GPUS, &[]).await?;
    let result = hand_out(&ctx, &bed).await;
    bed.remove_classes(&ctx).await;
    result
}

/// A node of the test's own with simulated GPUs `gpus` (its agent, with `extra` arguments, and kubelet side), and
/// the chart's two classes.
pub(super) struct MigNode {
    pub(super) name: String,
    pub(super) dirs: NodeDirs,
    pub(super) agent: Component,
    pub(super) kubelet: KubeletHarness,
    pub(super) gpu_class: String,
    pub(super) mig_class: String,
}

impl MigNode {
    pub(super) async fn start(ctx: &TestContext, name: &str, gpus: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let suffix = &ctx.namespace[ctx.namespace.len() - 6..];
        let node = format!("e2e-{suffix}-{name}");
        ctx.cluster.add_node(&node)?;
        let dirs = NodeDirs::new()?;
        let args = [&["--gpu-backend", "simulated", "--simulated-gpus", gpus], extra].concat();
        let agent = start_agent(ctx, &node, &dirs, &args)?;
        let kubelet = KubeletHarness::start(ctx, &node, &dirs)?;
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
        Ok(Self { name: node, dirs, agent, kubelet, gpu_class, mig_class })
    }

    pub(super) async fn remove_classes(&self, ctx: &TestContext) {
        for class in [&self.gpu_class, &self.mig_class] {
            let _ = Api::<DeviceClass>::all(ctx.client.clone()).delete(class, &DeleteParams::default()).await;
        }
    }
}

/// NVIDIA's DRA driver quickstart "gpu-test4" (one pod, four containers, each its own MIG device of one GPU: two
/// 1g.5gb, a 2g.10gb and a 3g.20gb, kept on one parent by a `matchAttribute` constraint on `parentUUID`; a
/// Deployment of such pods), translated to this driver's names, on a node of two A100-40GB laid out for it. Three
/// replicas: two run, each on one GPU, every container with exactly its own MIG device; the third waits.
pub(super) async fn nvidias_mig_quickstart_runs_as_a_deployment(ctx: TestContext) -> anyhow::Result<()> {
    let bed = MigNode::start(&ctx, "migdemo", "2xA100-40GB/mig=1g.5gb+1g.5gb+2g.10gb+3g.20gb", &[]).await?;
    let result = quickstart(&ctx, &bed).await;
    bed.remove_classes(&ctx).await;
    result
}

async fn quickstart(ctx: &TestContext, bed: &MigNode) -> anyhow::Result<()> {
    let _controller = Component::controller(ctx, &[]).await?;
    let requests = [
        ("mig-1g-5gb-0", "1g.5gb"),
        ("mig-1g-5gb-1", "1g.5gb"),
        ("mig-2g-10gb", "2g.10gb"),
        ("mig-3g-20gb", "3g.20gb"),
    ];
    let asked: Vec<Value> = requests
        .iter()
        .map(|(name, profile)| {
            let selector = format!("device.attributes['{DRIVER}'].profile == '{profile}'");
            json!({"name": name, "exactly": {"deviceClassName": bed.mig_class, "selectors": [{"cel": {"expression": selector}}]}})
        })
        .collect();
    let constraint = json!({"requests": [], "matchAttribute": format!("{DRIVER}/parentUUID")});
    objects::create_template(
        ctx,
        "mig-devices",
        json!({"spec": {"devices": {"requests": asked, "constraints": [constraint]}}}),
    )
    .await?;
    let containers: Vec<Value> = requests
        .iter()
        .enumerate()
        .map(|(i, (request, _))| {
            json!({"name": format!("ctr{i}"), "image": "registry.k8s.io/pause:3.10",
                   "resources": {"claims": [{"name": "mig-devices", "request": request}]}})
        })
        .collect();
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "pod"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "pod"}}, "template": {
            "metadata": {"labels": {"app": "pod"}},
            "spec": {"resourceClaims": [{"name": "mig-devices", "resourceClaimTemplateName": "mig-devices"}],
                     "containers": containers, "nodeSelector": {"kubernetes.io/hostname": bed.name},
                     "terminationGracePeriodSeconds": 0}}}
    }))?;
    Api::<Deployment>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&PostParams::default(), &deployment)
        .await?;

    // Two replicas are prepared (one per GPU); the third is unschedulable.
    let pods = wait::until("three replicas, two of them prepared", PREPARE_TIMEOUT, || async {
        let pods = objects::pods(ctx).list(&ListParams::default().labels("app=pod")).await?.items;
        let prepared: Vec<String> = pods
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .filter(|name| bed.kubelet.count("prepared", &format!("{}/{name}", ctx.namespace)) > 0)
            .collect();
        Ok((pods.len() == 3 && prepared.len() == 2).then_some((pods, prepared)))
    })
    .await?;
    let (pods, prepared) = pods;
    let waiting =
        pods.iter().filter_map(|p| p.metadata.name.clone()).find(|n| !prepared.contains(n)).context("no third pod")?;
    let why = objects::unschedulable(&ctx.client, &ctx.namespace, &waiting, PREPARE_TIMEOUT).await?;

    let published = published(ctx, &bed.name).await?;
    let mut parents = BTreeSet::new();
    for pod in &prepared {
        let event = bed.kubelet.wait_for("prepared", &format!("{}/{pod}", ctx.namespace), PREPARE_TIMEOUT).await?;
        let by_container: BTreeMap<String, Vec<String>> = serde_json::from_value(event["containers"].clone())?;
        ensure!(by_container.len() == 4, "{pod}: containers {by_container:?}");
        let mut uuids = BTreeSet::new();
        let mut gpu_nodes = BTreeSet::new();
        for (container, ids) in &by_container {
            let ids = &gpu_cdi_ids(ids)?;
            ensure!(ids.len() == 1, "{pod}/{container}: CDI ids {ids:?}");
            let (nodes, env) = inject(&bed.dirs, ids)?;
            let caps = nodes.iter().filter(|n| n.starts_with("/dev/nvidia-caps/")).count();
            ensure!(caps == 2, "{pod}/{container}: device nodes {nodes:?}");
            gpu_nodes.extend(nodes.into_iter().filter(|n| n.trim_start_matches("/dev/nvidia").parse::<u32>().is_ok()));
            // Its own device by its own variable; the claim's four in GPU_DRA_GPU_UUIDS (spec-wide).
            let own: Vec<&str> = env
                .iter()
                .filter(|e| e.starts_with("GPU_DRA_DEVICE_"))
                .filter_map(|e| e.split_once('=').map(|(_, uuid)| uuid))
                .collect();
            ensure!(own.len() == 1 && own[0].starts_with("MIG-"), "{pod}/{container}: env {env:?}");
            let claim =
                env.iter().find_map(|e| e.strip_prefix("GPU_DRA_GPU_UUIDS=")).context("no GPU_DRA_GPU_UUIDS")?;
            ensure!(claim.split(',').count() == 4 && claim.contains(own[0]), "{pod}/{container}: env {env:?}");
            uuids.insert(own[0].to_string());
        }
        ensure!(uuids.len() == 4, "{pod}: its containers share a MIG device: {uuids:?}");
        ensure!(
            gpu_nodes.len() == 1,
            "{pod}: MIG devices of several GPUs {gpu_nodes:?}, despite the parentUUID constraint"
        );
        ensure!(uuids.iter().all(|u| published.iter().any(|(_, p)| p == u)), "{pod}: unpublished UUIDs {uuids:?}");
        parents.extend(gpu_nodes);
    }
    ensure!(parents.len() == 2, "the two replicas on GPUs {parents:?}, not one each");
    eprintln!(
        "NVIDIA's gpu-test4 as a Deployment: two replicas on {parents:?}, four MIG devices each; the third waited ({why})"
    );
    Api::<Deployment>::namespaced(ctx.client.clone(), &ctx.namespace).delete("pod", &DeleteParams::default()).await?;
    Ok(())
}

async fn hand_out(ctx: &TestContext, bed: &MigNode) -> anyhow::Result<()> {
    let (node, dirs, kubelet) = (bed.name.as_str(), &bed.dirs, &bed.kubelet);
    let (gpu_class, mig_class) = (bed.gpu_class.as_str(), bed.mig_class.as_str());
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
    let ids: Vec<String> = gpu_cdi_ids(&serde_json::from_value::<Vec<String>>(prepared["containers"]["app"].clone())?)?;
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
    let inject = |line: &str| super::support::node::inject_fault(&dirs.state(), line);
    inject("gpu-0-mig-19-2-1 xid 79")?;
    if support::cluster::kubernetes_minor()? < 36 {
        // Device taints are off before 1.36: the server drops them and the agent says so (README's version table).
        let warning = "the API server dropped the devices' taints (feature gate DRADeviceTaints off)";
        wait::until("the agent to warn that the taints were dropped", PREPARE_TIMEOUT, || async {
            Ok(bed.agent.log_text().contains(warning).then_some(()))
        })
        .await?;
        return Ok(());
    }
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
pub(super) async fn allocated(
    ctx: &TestContext,
    namespace: &str,
    name: &str,
) -> anyhow::Result<BTreeSet<(String, String)>> {
    let results = super::allocation_results(ctx, namespace, name).await?;
    Ok(results.into_iter().map(|r| (r.pool, r.device)).collect())
}

/// Claim `name` with `requests` and `config`, and a pod of the same name on `node` using it.
pub(super) async fn claim_and_pod(
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
    // Never prepared. The kubelet side says `deleted` once done with it: after finishing the deletion, or, when
    // the pod was gone before it saw it terminating, after unpreparing what the failed prepare may have left.
    kubelet.wait_for("deleted", &format!("{}/{name}", ctx.namespace), PREPARE_TIMEOUT).await?;
    objects::claims(ctx).delete(name, &DeleteParams::default()).await?;
    Ok(())
}
