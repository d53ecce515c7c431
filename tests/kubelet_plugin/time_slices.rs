//! Time-slicing applied: a claim asking `sharing.strategy: TimeSlicing` has its GPU's time slice set while it is
//! prepared and set back when it goes, the setting survives an agent restart and comes back after a driver reload,
//! and claims holding shares of one GPU must ask the same interval. The simulated GPUs keep their time slice in
//! the state directory, as a GPU keeps its setting across agent restarts.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context as _, ensure};
use serde_json::{Value, json};

use super::support::node::{DRIVER, Kubelet, NodeDirs};
use super::support::{TestContext, cluster};
use super::{allocated_claim, allocated_claim_with, checkpoint, node_name, ready_agent};

fn set_to(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(device, interval)| (device.to_string(), interval.to_string())).collect()
}

/// A claim's configuration asking `interval`, in NVIDIA's spelling (manifests written for NVIDIA's driver work).
fn nvidia_time_slicing(interval: &str) -> Value {
    json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}}}}])
}

/// The same in this driver's own spelling.
fn time_slicing(interval: &str) -> Value {
    json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": format!("{DRIVER}/v1alpha1"), "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}}}])
}

pub(super) async fn a_time_slice_is_set_while_its_claim_is_prepared_and_set_back_after(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let long = allocated_claim(&ctx, "long", &node, &["gpu-0"], nvidia_time_slicing("Long")).await?;
    let plain = allocated_claim(&ctx, "plain", &node, &["gpu-1"], json!([])).await?;
    let claims = [(ns, "long", long.as_str()), (ns, "plain", plain.as_str())];
    // The GPU refuses the setting (the simulated GPUs' file cannot be written): the prepare fails saying so and
    // leaves nothing; the kubelet's retry succeeds once the GPU takes it.
    let simulated = dirs.state().join("simulated-time-slices.json");
    std::fs::create_dir_all(&simulated)?;
    let refused = Kubelet::register(&dirs).await?.prepare(&claims[..1]).await?;
    let error = &refused.get(&long).context("no answer")?.error;
    ensure!(error.contains("set the time slice of device \"gpu-0\"") && error.contains("to Long"), "{error:?}");
    ensure!(!dirs.cdi_spec(&long).exists() && !checkpoint(&dirs, "boot-1")?.claims.contains_key(&long), "left");
    std::fs::remove_dir(&simulated)?;
    let answers = Kubelet::register(&dirs).await?.prepare(&claims).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");
    ensure!(dirs.time_slices()? == set_to(&[("gpu-0", "Long")]), "after prepare: {:?}", dirs.time_slices()?);
    let listed: BTreeSet<String> = ["gpu-0".to_string()].into();
    ensure!(checkpoint(&dirs, "boot-1")?.time_sliced == listed, "the checkpoint does not list gpu-0");

    // The driver is reloaded while the agent is down (the GPU's settings are gone): start-up sets it again.
    agent.kill()?;
    std::fs::write(dirs.state().join("simulated-time-slices.json"), "{}")?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    ensure!(dirs.time_slices()? == set_to(&[("gpu-0", "Long")]), "after restart: {:?}", dirs.time_slices()?);
    let mut kubelet = Kubelet::register(&dirs).await?;
    let again = kubelet.prepare(&claims).await?;
    ensure!(again.values().all(|a| a.error.is_empty()), "a repeated prepare: {again:?}");

    let unprepared = kubelet.unprepare(&claims[..1]).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    ensure!(dirs.time_slices()?.is_empty(), "after unprepare: {:?}", dirs.time_slices()?);
    ensure!(checkpoint(&dirs, "boot-1")?.time_sliced.is_empty(), "gpu-0 still listed as time-sliced");
    let unprepared = kubelet.unprepare(&claims[1..]).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");

    // The checkpoint is lost to a truncated write while the claim is prepared: the rebuilt record adopts its spec
    // without knowing what it asked, so its GPU is left as it is while it runs and set back once it is unprepared.
    let answers = kubelet.prepare(&claims[..1]).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");
    agent.terminate()?;
    std::fs::write(dirs.checkpoint(), b"{\"version\": 1, \"checksum\": \"00\", \"checkpo")?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    ensure!(dirs.time_slices()? == set_to(&[("gpu-0", "Long")]), "after the rebuild: {:?}", dirs.time_slices()?);
    ensure!(checkpoint(&dirs, "boot-1")?.time_sliced == listed, "the rebuilt checkpoint does not list gpu-0");
    let mut kubelet = Kubelet::register(&dirs).await?;
    let unprepared = kubelet.unprepare(&claims[..1]).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    ensure!(dirs.time_slices()?.is_empty(), "the adopted claim went: {:?}", dirs.time_slices()?);
    ensure!(checkpoint(&dirs, "boot-1")?.time_sliced.is_empty(), "gpu-0 still listed after the adopted claim");

    // A reboot while the claim is prepared: the GPU comes back at the default, and nothing is listed or set.
    let answers = kubelet.prepare(&claims[..1]).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");
    ensure!(dirs.time_slices()? == set_to(&[("gpu-0", "Long")]), "{:?}", dirs.time_slices()?);
    agent.kill()?;
    std::fs::write(dirs.boot_id_file(), "boot-2\n")?;
    let _agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    ensure!(dirs.time_slices()?.is_empty(), "after the reboot: {:?}", dirs.time_slices()?);
    let after = checkpoint(&dirs, "boot-2")?;
    ensure!(after.claims.is_empty() && after.time_sliced.is_empty(), "after the reboot: {after:?}");
    Ok(())
}

/// Pods of two namespaces holding shares of one GPU (a GPU shared by memory): a second pod asking another time
/// slice is refused naming the first; one asking none takes the GPU as it is; once the first is gone the GPU is set
/// back, and the refused one is prepared with its own. Before 1.36 the API server drops the share IDs
/// (DRAConsumableCapacity is alpha), so the claims are whole-GPU allocations of one GPU and the second is refused
/// as the GPU's second holder.
pub(super) async fn claims_sharing_a_gpu_must_ask_the_same_time_slice(ctx: TestContext) -> anyhow::Result<()> {
    let shares_served = cluster::kubernetes_minor()? >= 36;
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let _agent = ready_agent(&ctx, &node, &dirs, "1xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let share = |n: u32| {
        vec![json!({"request": "gpus", "driver": DRIVER, "pool": node, "device": "gpu-0",
            "shareID": format!("00000000-0000-4000-8000-00000000000{n}")})]
    };
    let long = allocated_claim_with(&ctx, "long", share(1), time_slicing("Long")).await?;
    let short = allocated_claim_with(&ctx, "short", share(2), nvidia_time_slicing("Short")).await?;
    let plain = allocated_claim_with(&ctx, "plain", share(3), json!([])).await?;
    let mut kubelet = Kubelet::register(&dirs).await?;

    let first = kubelet.prepare(&[(ns, "long", &long)]).await?;
    ensure!(first.get(&long).is_some_and(|a| a.error.is_empty()), "{first:?}");
    let refused = kubelet.prepare(&[(ns, "short", &short)]).await?;
    let reason = &refused.get(&short).context("no answer for short")?.error;
    if shares_served {
        ensure!(
            reason.contains(&format!("is time-sliced Long for claim {ns}/long"))
                && reason.contains("this claim asks Short"),
            "{reason:?}"
        );
        let plain_answer = kubelet.prepare(&[(ns, "plain", &plain)]).await?;
        ensure!(plain_answer.get(&plain).is_some_and(|a| a.error.is_empty()), "{plain_answer:?}");
    } else {
        ensure!(reason.contains(&format!("is already prepared for claim {ns}/long")), "{reason:?}");
    }
    ensure!(dirs.time_slices()? == set_to(&[("gpu-0", "Long")]), "{:?}", dirs.time_slices()?);

    let unprepared = kubelet.unprepare(&[(ns, "long", &long)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    ensure!(dirs.time_slices()?.is_empty(), "the last claim asking Long went: {:?}", dirs.time_slices()?);
    let second = kubelet.prepare(&[(ns, "short", &short)]).await?;
    ensure!(second.get(&short).is_some_and(|a| a.error.is_empty()), "{second:?}");
    ensure!(dirs.time_slices()? == set_to(&[("gpu-0", "Short")]), "{:?}", dirs.time_slices()?);
    let all = [(ns, "short", short.as_str()), (ns, "plain", plain.as_str())];
    let unprepared = kubelet.unprepare(&all).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    ensure!(dirs.time_slices()?.is_empty(), "{:?}", dirs.time_slices()?);
    Ok(())
}
