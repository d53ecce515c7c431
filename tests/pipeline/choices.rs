//! What pods ask for beyond "n GPUs of a class", through the whole pipeline: a prioritized list of choices
//! (`firstAvailable`: an H100, else an A100) with configuration for one choice only, and two GPUs that must be of
//! one model (`matchAttribute`) with a container per request. The scheduler picks; what is ours is that the agent
//! publishes attributes the constraints can name, applies each choice's configuration, and answers each device with
//! the request names the kubelet matches against a container's `resources.claims[].request`.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use super::support::node::{DRIVER, metadata_requests};
use super::support::{TestContext, objects, wait};
use super::{PREPARE_TIMEOUT, Testbed, allocation_results, attribute, claim_of, inject};

/// A pod on `node` whose containers (name → `resources.claims` entries) use the one pod claim `pod_claim`, made
/// from `template`.
fn pod(name: &str, node: &str, pod_claim: &str, template: &str, containers: &[(&str, Value)]) -> anyhow::Result<Pod> {
    let containers: Vec<Value> = containers
        .iter()
        .map(|(c, uses)| json!({"name": c, "image": "registry.k8s.io/pause:3.10", "resources": {"claims": uses}}))
        .collect();
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": containers,
                 "resourceClaims": [{"name": pod_claim, "resourceClaimTemplateName": template}],
                 "nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0}
    }))?)
}

/// A CEL selector for GPUs whose product name starts with `product`.
fn product_selector(product: &str) -> Value {
    json!([{"cel": {"expression": format!("device.attributes['{DRIVER}'].productName.startsWith('{product}')")}}])
}

/// The device `pod`'s container `container` was given: its one CDI id resolved on `node`, checked to inject exactly
/// the device node of the GPU allocated to the pod as `device`.
fn one_device_injected(
    bed: &Testbed,
    node: &str,
    containers: &BTreeMap<String, Vec<String>>,
    container: &str,
    device: &str,
) -> anyhow::Result<()> {
    let ids = containers.get(container).with_context(|| format!("no container {container} in {containers:?}"))?;
    ensure!(ids.len() == 1, "container {container} got CDI ids {ids:?}, expected one (for {device})");
    let (device_nodes, _) = inject(&bed.node(node)?.dirs, ids)?;
    let expected = format!("/dev/nvidia{}", device.trim_start_matches("gpu-"));
    ensure!(device_nodes.contains(&expected), "{ids:?} inject {device_nodes:?}, not {expected}");
    Ok(())
}

/// A prioritized list (`firstAvailable`, on by default since 1.34): an H100 if one is free, else an A100, and a time
/// slice configured for the A100 choice only (`requests: ["gpu/a100"]`), as a team whose jobs run on either model
/// but share the older GPUs would write it. On a node with two of each, pods created one at a time get the H100s
/// first, then the A100s, and the fifth waits. Each allocation names its choice (`gpu/h100`, `gpu/a100`); the
/// kubelet gives the device to the container that asked for request `gpu` (the agent answers the base request's
/// name: with the subrequest's, the kubelet's `cdiDevicesAsList` gives such a container nothing) and none to the
/// container that asked for nothing. Only the A100s get the time slice. When an H100's pod goes, the waiting pod
/// gets that H100, still the first choice, without a time slice; when an A100's pod goes, its time slice is set back.
pub(super) async fn a_pod_preferring_an_h100_gets_an_a100_once_they_are_taken_with_that_choices_config(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    let time_slice = json!({"driver": DRIVER, "parameters": {"apiVersion": format!("{DRIVER}/v1alpha1"),
        "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}});
    objects::create_template(
        &ctx,
        "h100-else-a100",
        json!({"spec": {"devices": {
            "requests": [{"name": "gpu", "firstAvailable": [
                {"name": "h100", "deviceClassName": bed.class, "selectors": product_selector("NVIDIA H100")},
                {"name": "a100", "deviceClassName": bed.class, "selectors": product_selector("NVIDIA A100")}]}],
            "config": [{"requests": ["gpu/a100"], "opaque": time_slice}]}}}),
    )
    .await?;
    let node = bed.nodes[0].name.clone();
    let containers = [("train", json!([{"name": "gpus", "request": "gpu"}])), ("logger", json!([]))];
    let pods = objects::pods(&ctx);

    // (pod, the choice it must get, the product that choice means)
    let expected = [
        ("job-1", "gpu/h100", "NVIDIA H100"),
        ("job-2", "gpu/h100", "NVIDIA H100"),
        ("job-3", "gpu/a100", "NVIDIA A100"),
        ("job-4", "gpu/a100", "NVIDIA A100"),
    ];
    let mut devices = BTreeMap::new();
    for (name, choice, product) in expected {
        pods.create(&PostParams::default(), &pod(name, &node, "gpus", "h100-else-a100", &containers)?).await?;
        let device = prepared_with_choice(&ctx, &bed, name, choice, product).await?;
        devices.insert(name, device);
    }
    let a100s: BTreeMap<String, String> =
        ["job-3", "job-4"].iter().map(|p| (devices[p].clone(), "Long".to_string())).collect();
    let dirs = &bed.node(&node)?.dirs;
    ensure!(dirs.time_slices()? == a100s, "time slices {:?}, expected the A100s' only {a100s:?}", dirs.time_slices()?);

    pods.create(&PostParams::default(), &pod("job-5", &node, "gpus", "h100-else-a100", &containers)?).await?;
    let why = objects::unschedulable(&ctx.client, &ctx.namespace, "job-5", PREPARE_TIMEOUT).await?;
    ensure!(why.contains("cannot allocate all claims"), "the scheduler said: {why}");

    bed.delete_pod(&ctx, "job-1", &node).await?;
    let device = prepared_with_choice(&ctx, &bed, "job-5", "gpu/h100", "NVIDIA H100").await?;
    ensure!(device == devices["job-1"], "job-5 got {device}, not the H100 job-1 left ({})", devices["job-1"]);
    ensure!(dirs.time_slices()? == a100s, "an H100 was time-sliced: {:?}", dirs.time_slices()?);

    bed.delete_pod(&ctx, "job-3", &node).await?;
    let left: BTreeMap<String, String> = [(devices["job-4"].clone(), "Long".to_string())].into();
    ensure!(dirs.time_slices()? == left, "after job-3 went: {:?}, expected {left:?}", dirs.time_slices()?);
    Ok(())
}

/// Waits until `pod` is prepared; checks that its claim holds one device, chosen as `choice`, a `product`, given to
/// container `train` alone; returns the device.
async fn prepared_with_choice(
    ctx: &TestContext,
    bed: &Testbed,
    pod: &str,
    choice: &str,
    product: &str,
) -> anyhow::Result<String> {
    let (node, containers) = bed.prepared(ctx, pod).await?;
    let claim = claim_of(ctx, pod, "gpus").await?;
    let results = allocation_results(ctx, &ctx.namespace, &claim).await?;
    let [result] = results.as_slice() else { anyhow::bail!("{pod}: allocation results {results:?}") };
    ensure!(result.request == choice, "{pod} got {} as {}, expected {choice}", result.device, result.request);
    let name = attribute(ctx, &node, &result.device, "productName").await?;
    ensure!(name.starts_with(product), "{pod}: {} is a {name}, chosen as {choice}", result.device);
    one_device_injected(bed, &node, &containers, "train", &result.device)?;
    ensure!(containers.get("logger").is_some_and(Vec::is_empty), "{pod}: the logger got {containers:?}");
    Ok(result.device.clone())
}

/// Two GPUs that must be of one model (`constraints: matchAttribute: <driver>/productName`, two requests of one
/// GPU each), as data-parallel training asks so no rank waits for a slower GPU, with one container per request and
/// a third using the whole claim. On a node of two A100s and two H100s, the first pod gets one model's pair and the
/// second the other's: never one of each. Each request's container gets its own GPU, the third both (the agent
/// names each device's request), and a third pod waits until a pair is freed, then gets that pair.
pub(super) async fn two_gpus_asked_to_match_are_one_model_and_each_rank_gets_its_own(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    objects::create_template(
        &ctx,
        "matched-pair",
        json!({"spec": {"devices": {
            "requests": [{"name": "rank-0", "exactly": {"deviceClassName": bed.class}},
                         {"name": "rank-1", "exactly": {"deviceClassName": bed.class}}],
            "constraints": [{"requests": ["rank-0", "rank-1"], "matchAttribute": format!("{DRIVER}/productName")}]}}}),
    )
    .await?;
    let node = bed.nodes[0].name.clone();
    let containers = [
        ("rank-0", json!([{"name": "pair", "request": "rank-0"}])),
        ("rank-1", json!([{"name": "pair", "request": "rank-1"}])),
        ("monitor", json!([{"name": "pair"}])),
    ];
    let pods = objects::pods(&ctx);
    let mut models = BTreeMap::new();
    for name in ["ddp-1", "ddp-2"] {
        pods.create(&PostParams::default(), &pod(name, &node, "pair", "matched-pair", &containers)?).await?;
        let (model, pair) = matched_pair(&ctx, &bed, name).await?;
        models.insert(name, (model, pair));
    }
    ensure!(models["ddp-1"].0 != models["ddp-2"].0, "both pairs are {}: {models:?}", models["ddp-1"].0);

    pods.create(&PostParams::default(), &pod("ddp-3", &node, "pair", "matched-pair", &containers)?).await?;
    let why = objects::unschedulable(&ctx.client, &ctx.namespace, "ddp-3", PREPARE_TIMEOUT).await?;
    ensure!(why.contains("cannot allocate all claims"), "the scheduler said: {why}");
    bed.delete_pod(&ctx, "ddp-1", &node).await?;
    let got = wait::until("ddp-3 to get the freed pair", PREPARE_TIMEOUT, || async {
        Ok(Some(matched_pair(&ctx, &bed, "ddp-3").await?))
    })
    .await?;
    ensure!(got == models["ddp-1"], "ddp-3 got {got:?}, not the pair ddp-1 left {:?}", models["ddp-1"]);
    Ok(())
}

/// Waits until `pod` is prepared; checks that its two GPUs are one model, one per rank's container and both in the
/// monitor's; returns (the model, the two devices).
async fn matched_pair(ctx: &TestContext, bed: &Testbed, pod: &str) -> anyhow::Result<(String, BTreeSet<String>)> {
    let (node, containers) = bed.prepared(ctx, pod).await?;
    let claim = claim_of(ctx, pod, "pair").await?;
    let results = allocation_results(ctx, &ctx.namespace, &claim).await?;
    ensure!(results.len() == 2, "{pod}: allocation results {results:?}");
    let mut products = BTreeSet::new();
    for result in &results {
        products.insert(attribute(ctx, &node, &result.device, "productName").await?);
        one_device_injected(bed, &node, &containers, &result.request, &result.device)?;
    }
    let [model] = Vec::from_iter(products).try_into().map_err(|p| anyhow::anyhow!("{pod}: one of each: {p:?}"))?;
    let pair: BTreeSet<String> = results.iter().map(|r| r.device.clone()).collect();
    ensure!(pair.len() == 2, "{pod}: both ranks got {pair:?}");
    let monitor = containers.get("monitor").map(Vec::len);
    ensure!(monitor == Some(2), "{pod}: the monitor got {containers:?}, expected both GPUs");
    // Each rank the device metadata of its own request only; the monitor, which names none, both.
    let event =
        bed.node(&node)?.kubelet.wait_for("prepared", &format!("{}/{pod}", ctx.namespace), PREPARE_TIMEOUT).await?;
    let requests = |container: &str| -> Vec<String> {
        let ids: Vec<String> = serde_json::from_value(event["containers"][container].clone()).unwrap_or_default();
        metadata_requests(&ids).into_iter().map(|(_, request)| request).collect()
    };
    for container in ["rank-0", "rank-1"] {
        ensure!(requests(container) == [container], "{pod}: {container} got the metadata of {:?}", requests(container));
    }
    let mut both = requests("monitor");
    both.sort();
    ensure!(both == ["rank-0", "rank-1"], "{pod}: the monitor got the metadata of {both:?}");
    Ok((model, pair))
}

/// What this test's node's sysfs shows: its four GPUs (the simulated bus ids) behind PCIe switches, two under each
/// of two root complexes, as on an eight-GPU server's half: (bus id, link under `bus/pci/devices`, root).
const TOPOLOGY: [(&str, &str, &str); 4] = [
    ("0000:18:00.0", "../../../devices/pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:00.0", "pci0000:16"),
    ("0000:20:00.0", "../../../devices/pci0000:16/0000:16:01.0/0000:17:04.0/0000:20:00.0", "pci0000:16"),
    ("0000:28:00.0", "../../../devices/pci0000:26/0000:26:01.0/0000:27:00.0/0000:28:00.0", "pci0000:26"),
    ("0000:30:00.0", "../../../devices/pci0000:26/0000:26:01.0/0000:27:04.0/0000:30:00.0", "pci0000:26"),
];
const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The NUMA node each GPU of [`TOPOLOGY`] is attached to in the test's sysfs (`None`: the kernel's -1).
const NUMA: [Option<i64>; 4] = [Some(0), Some(0), Some(1), None];
const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";

/// Devices asked to share a PCIe root complex (`matchAttribute: resource.kubernetes.io/pcieRoot`), as a training job
/// asks for GPUs that talk peer to peer, or a GPU with the RDMA NIC beside it (GPUDirect): the agent reads each
/// GPU's root from sysfs as Kubernetes' own helper does (the root complex above any switch, so it equals what a NIC
/// driver publishes for its NIC), and the scheduler pairs accordingly. On a node whose sysfs puts GPUs 0-1 under
/// `pci0000:16` and 2-3 under `pci0000:26`: each GPU publishes its root; a pod asking for two GPUs of one root gets
/// 0-1 or 2-3 and is prepared; a pod asking for a GPU and a NIC of one root (another driver's slice with a NIC under
/// each root, as dranet publishes them) gets a GPU under its NIC's root. Before, the agent published the GPU's own
/// bus as its root (`pci0000:18`): no two devices matched, and both pods stayed unschedulable. Each GPU also
/// publishes the NUMA node sysfs gives it (`resource.kubernetes.io/numaNode`, none for a GPU without affinity), and
/// the GPU and NIC pair is asked to share that too (as a GPU is paired with CPUs of its own node).
pub(super) async fn gpus_and_a_nic_asked_to_share_a_pcie_root_get_devices_under_one_root(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let mut bed = Testbed::start(&ctx).await?;
    let sysfs = tempfile::Builder::new().prefix("gd-sysfs-").tempdir_in("/tmp")?;
    let devices_dir = sysfs.path().join("bus/pci/devices");
    std::fs::create_dir_all(&devices_dir)?;
    for (i, (bus, link, _)) in TOPOLOGY.iter().enumerate() {
        std::os::unix::fs::symlink(link, devices_dir.join(bus))?;
        // NUMA nodes as the kernel writes them: 0 under the first root, 1 under the second, and none (-1) for the
        // last GPU (a machine whose firmware gives it no affinity).
        let device = devices_dir.join(link);
        std::fs::create_dir_all(&device)?;
        std::fs::write(device.join("numa_node"), NUMA[i].map_or("-1\n".to_string(), |n| format!("{n}\n")))?;
    }
    let sysfs_root = sysfs.path().to_string_lossy().into_owned();
    let node = bed.add_node_with(&ctx, "4xH100-80GB", &["--sysfs-root", &sysfs_root]).await?;
    wait::until("the node's four GPUs published", PREPARE_TIMEOUT, || async {
        Ok((objects::published_devices(&ctx.client, &node).await?.len() == 4).then_some(()))
    })
    .await?;
    let devices = objects::published_devices(&ctx.client, &node).await?;
    for (i, (_, _, root)) in TOPOLOGY.iter().enumerate() {
        let published = attribute(&ctx, &node, &format!("gpu-{i}"), PCIE_ROOT).await?;
        ensure!(published == *root, "gpu-{i} publishes root {published}, its sysfs says {root}");
        let device = devices.iter().find(|d| d.name == format!("gpu-{i}")).context("device not published")?;
        let numa = device.attributes.as_ref().and_then(|a| a.get(NUMA_NODE)).and_then(|a| a.int);
        ensure!(numa == NUMA[i], "gpu-{i} publishes NUMA node {numa:?}, its sysfs says {:?}", NUMA[i]);
    }
    let same_root = json!([{"matchAttribute": PCIE_ROOT}]);

    // Two GPUs that talk peer to peer.
    let requests = json!([{"name": "gpus", "exactly": {"deviceClassName": bed.class, "count": 2}}]);
    let spec = json!({"spec": {"devices": {"requests": requests, "constraints": same_root}}});
    objects::create_template(&ctx, "two-on-one-root", spec).await?;
    objects::pods(&ctx).create(&PostParams::default(), &bed.pod_on(&ctx, "peers", &node, "two-on-one-root")?).await?;
    bed.prepared(&ctx, "peers").await?;
    let pair: BTreeSet<String> = allocation_results(&ctx, &ctx.namespace, &claim_of(&ctx, "peers", "gpus").await?)
        .await?
        .into_iter()
        .map(|r| r.device)
        .collect();
    ensure!(
        pair == BTreeSet::from(["gpu-0".into(), "gpu-1".into()])
            || pair == BTreeSet::from(["gpu-2".into(), "gpu-3".into()]),
        "two GPUs asked to share a root got {pair:?}"
    );

    // A GPU with the NIC under its root: another driver's NICs, one under each root complex.
    let nic_driver = "nic.e2e.gpu-dra.dev";
    let nics: Vec<Value> = [("nic-0", "pci0000:16"), ("nic-1", "pci0000:26")]
        .iter()
        .map(|(name, root)| {
            let numa = if *root == "pci0000:16" { 0 } else { 1 };
            json!({"name": name, "attributes": {PCIE_ROOT: {"string": root}, NUMA_NODE: {"int": numa}}})
        })
        .collect();
    let slice: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": format!("{node}-nics")},
        "spec": {"driver": nic_driver, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": nics}
    }))?;
    Api::<ResourceSlice>::all(ctx.client.clone()).create(&PostParams::default(), &slice).await?;
    let nic_class = format!("{}-nic", ctx.namespace);
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": nic_class},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{nic_driver}'")}}]}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &class).await?;
    let requests = json!([
        {"name": "gpu", "exactly": {"deviceClassName": bed.class}},
        {"name": "nic", "exactly": {"deviceClassName": nic_class}},
    ]);
    // Beside each other on the bus and on one NUMA node (as a GPU and the CPUs feeding it are asked for).
    let together = json!([{"matchAttribute": PCIE_ROOT}, {"matchAttribute": NUMA_NODE}]);
    let spec = json!({"spec": {"devices": {"requests": requests, "constraints": together}}});
    objects::create_template(&ctx, "gpu-and-nic", spec).await?;
    objects::pods(&ctx).create(&PostParams::default(), &bed.pod_on(&ctx, "gpudirect", &node, "gpu-and-nic")?).await?;
    // Only the allocation is ours to check: no NIC driver prepares the NIC on this node.
    let results = wait::until("the GPU and NIC pair allocated", PREPARE_TIMEOUT, || async {
        let Ok(claim) = claim_of(&ctx, "gpudirect", "gpus").await else { return Ok(None) };
        let results = allocation_results(&ctx, &ctx.namespace, &claim).await?;
        Ok((results.len() == 2).then_some(results))
    })
    .await?;
    let device_of = |request: &str| results.iter().find(|r| r.request == request).map(|r| r.device.clone());
    let (gpu, nic) = (device_of("gpu").context("no GPU")?, device_of("nic").context("no NIC")?);
    let gpu_root = attribute(&ctx, &node, &gpu, PCIE_ROOT).await?;
    let nic_root = if nic == "nic-0" { "pci0000:16" } else { "pci0000:26" };
    ensure!(gpu_root == nic_root, "{gpu} (under {gpu_root}) paired with {nic} (under {nic_root})");
    ensure!(!pair.contains(&gpu), "{gpu} is the peers' already");
    eprintln!("peers got {pair:?}; {gpu} paired with {nic} under {gpu_root}");
    Ok(())
}
