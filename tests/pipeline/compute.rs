//! Inference pods packed onto one shared GPU by the compute they declare: a node publishing its H100 for sharing
//! (`--gpu-sharing by-memory`) offers `compute`, percent of the GPU, beside its memory. The real scheduler adds up
//! what the claims ask and the kubelet's DRA code prepares every share it allocates.

use anyhow::ensure;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use super::support::node::DRIVER;
use super::support::{self, TestContext, objects};
use super::{PREPARE_TIMEOUT, SharedGpuNode, allocation_results, pod_using};

/// Three inference pods ask 20Gi each of one 80GB H100, two of them 60 % of its compute: the second of those waits as
/// unschedulable though memory is left, while a pod asking 40 % fits beside the first and one naming no compute
/// takes none of it. Once the first pod and its claim are gone, the waiting pod gets its 60 %. Before 1.36 consumable
/// capacity is off: the GPU goes to one claim, and the second pod waits for that reason.
pub(super) async fn inference_pods_share_one_gpu_by_compute(ctx: TestContext) -> anyhow::Result<()> {
    let SharedGpuNode { node, dirs, agent, kubelet, _controller } = SharedGpuNode::start(&ctx, "compute").await?;
    let ns = ctx.namespace.as_str();
    let prepared = async |name: &str| kubelet.wait_for("prepared", &format!("{ns}/{name}"), PREPARE_TIMEOUT).await;

    pod_asking(&ctx, "chat", &node, json!({"memory": "20Gi", "compute": 60})).await?;
    prepared("chat").await?;
    pod_asking(&ctx, "search", &node, json!({"memory": "20Gi", "compute": 60})).await?;
    let why = objects::unschedulable(&ctx.client, ns, "search", PREPARE_TIMEOUT).await?;
    ensure!(why.contains("cannot allocate all claims"), "search waits for another reason: {why}");
    if support::cluster::kubernetes_minor()? < 36 {
        // The API server drops the claims' capacity requests and the devices' allowMultipleAllocations (gate off):
        // chat holds gpu-0 whole, and the operator is told why.
        let chat = consumed(&ctx, "chat").await?;
        ensure!(chat == [("gpu-0".into(), String::new(), String::new())], "chat consumed {chat:?}");
        let claim = objects::claims(&ctx).get("search").await?;
        let requests = claim.spec.devices.and_then(|d| d.requests).unwrap_or_default();
        ensure!(
            requests.iter().all(|r| r.exactly.as_ref().is_some_and(|e| e.capacity.is_none())),
            "capacity requests kept: {requests:?}"
        );
        let warning = "the API server dropped the devices' allowMultipleAllocations";
        ensure!(agent.log_text().contains(warning), "no warning about the dropped field:\n{}", agent.log_tail());
        eprintln!("before 1.36 a GPU is never shared: {why}");
        return Ok(());
    }
    pod_asking(&ctx, "embed", &node, json!({"memory": "20Gi", "compute": 40})).await?;
    prepared("embed").await?;
    pod_asking(&ctx, "batch", &node, json!({"memory": "20Gi"})).await?;
    prepared("batch").await?;
    for (name, compute) in [("chat", "60"), ("embed", "40"), ("batch", "0")] {
        let consumed = consumed(&ctx, name).await?;
        ensure!(
            consumed == [("gpu-0".to_string(), "20Gi".to_string(), compute.to_string())],
            "{name} consumed {consumed:?}, asked 20Gi and {compute} % of gpu-0"
        );
    }
    let waiting = consumed(&ctx, "search").await?;
    ensure!(waiting.is_empty(), "100 % of gpu-0's compute is taken, yet search got {waiting:?}");

    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    objects::pods(&ctx).delete("chat", &now).await?;
    kubelet.wait_for("unprepared", &format!("{ns}/chat"), PREPARE_TIMEOUT).await?;
    objects::claims(&ctx).delete("chat", &DeleteParams::default()).await?;
    prepared("search").await?;
    let search = consumed(&ctx, "search").await?;
    ensure!(search == [("gpu-0".into(), "20Gi".into(), "60".into())], "search consumed {search:?}");
    ensure!(dirs.cdi_specs()?.len() == 3, "a CDI spec per share: {:?}", dirs.cdi_specs()?);
    eprintln!("60 % + 40 % + none of gpu-0's compute shared; a second 60 % waited ({why}) until the first was gone");
    Ok(())
}

/// NVIDIA's MPS example on a node whose GPU is shared by memory: a claim naming no memory, in NVIDIA's spelling and
/// shared by two pods, gets all of the GPU's memory (the request policy's default) and with it the GPU whole, so its
/// MPS daemon runs for both; a pod asking a share of the memory waits while it is held. Before 1.36 the GPU is whole
/// anyway (no share ID).
pub(super) async fn an_mps_claim_naming_no_memory_holds_a_shared_gpu_whole(ctx: TestContext) -> anyhow::Result<()> {
    let SharedGpuNode { node, dirs, agent, kubelet, _controller } = SharedGpuNode::start(&ctx, "mps").await?;
    let ns = ctx.namespace.as_str();
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "inference"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": ns}}],
            "config": [{"opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}}}}]}}
    }))?;
    let claim = objects::claims(&ctx).create(&PostParams::default(), &claim).await?;
    let uid = claim.metadata.uid.unwrap_or_default();
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns);
    for name in ["server-a", "server-b"] {
        pods.create(&PostParams::default(), &pod_using(name, &node, "inference")?).await?;
    }
    for name in ["server-a", "server-b"] {
        let prepared = kubelet.wait_for("prepared", &format!("{ns}/{name}"), PREPARE_TIMEOUT).await;
        prepared.map_err(|e| anyhow::anyhow!("{e:#}\n{}", agent.log_tail()))?;
    }
    ensure!(dirs.mps().join(&uid).is_dir(), "no MPS daemon for the claim:\n{}", agent.log_tail());
    let results = allocation_results(&ctx, ns, "inference").await?;
    ensure!(results.len() == 1 && results[0].device == "gpu-0", "allocated {results:?}");
    if support::cluster::kubernetes_minor()? >= 36 {
        // An H100 80GB has 81,559 MiB: all of it, under the share ID the scheduler gives every allocation of a
        // shared device.
        let memory = super::consumed(&results[0], "memory");
        ensure!(results[0].share_id.is_some() && memory == "81559Mi", "a share of {memory:?}: {results:?}");
    }
    pod_asking(&ctx, "notebook", &node, json!({"memory": "8Gi"})).await?;
    let why = objects::unschedulable(&ctx.client, ns, "notebook", PREPARE_TIMEOUT).await?;
    ensure!(why.contains("cannot allocate all claims"), "the notebook waits for another reason: {why}");
    eprintln!("MPS on gpu-0 shared by memory, held whole by a claim naming no memory; a share waited ({why})");
    Ok(())
}

/// Creates claim `name` asking `requests` (capacity) of one GPU of the test's class, and a pod on `node` using it.
async fn pod_asking(ctx: &TestContext, name: &str, node: &str, requests: Value) -> anyhow::Result<()> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": ctx.namespace, "capacity": {"requests": requests}}}]}}
    }))?;
    objects::claims(ctx).create(&PostParams::default(), &claim).await?;
    Api::<Pod>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&PostParams::default(), &pod_using(name, node, name)?)
        .await?;
    Ok(())
}

/// (device, memory, compute) the allocation of claim `name` consumes.
async fn consumed(ctx: &TestContext, name: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    Ok(allocation_results(ctx, &ctx.namespace, name)
        .await?
        .into_iter()
        .map(|r| {
            let (memory, compute) = (super::consumed(&r, "memory"), super::consumed(&r, "compute"));
            (r.device, memory, compute)
        })
        .collect())
}
