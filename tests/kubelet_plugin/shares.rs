//! Shares of a GPU shared by memory on one node: what the prepared shares hold of the GPU's memory bounds what a
//! new share may be prepared beside them.

use anyhow::{Context as _, ensure};
use serde_json::json;

use super::support::node::{DRIVER, Kubelet, NodeDirs};
use super::support::process::Component;
use super::support::{TestContext, cluster};
use super::{allocated_claim_with, node_name, ready_agent, reallocate};

/// A pod holding a 60 GiB share of an 80 GB GPU is deleted with `--force --grace-period=0` (or its node's kubelet is
/// slow to stop it): its claim is deallocated and the scheduler hands the memory to a new pod's 40 GiB share on the
/// same GPU while the old containers may still run on it, their memory still in use. The new share is refused,
/// naming the one prepared, until the kubelet unprepares that one (as a whole GPU waits for its predecessor); a
/// 16 GiB share, which fits beside it, is prepared. Before 1.36 the API server drops the share IDs
/// (DRAConsumableCapacity alpha): the claims are whole-GPU allocations and the second is refused as the GPU's
/// second holder.
pub(super) async fn a_share_beside_a_force_deleted_pods_share_waits_for_its_memory(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let shares_served = cluster::kubernetes_minor()? >= 36;
    let (node, dirs, agent) = one_gpu_node(&ctx).await?;
    let ns = ctx.namespace.as_str();
    let share = |n, memory| vec![share_of_gpu_0(&node, n, memory)];
    let gone = allocated_claim_with(&ctx, "gone", share(1, "60Gi"), json!([])).await?;
    let next = allocated_claim_with(&ctx, "next", share(2, "40Gi"), json!([])).await?;
    let small = allocated_claim_with(&ctx, "small", share(3, "16Gi"), json!([])).await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let first = kubelet.prepare(&[(ns, "gone", &gone)]).await?;
    ensure!(first.get(&gone).is_some_and(|a| a.error.is_empty()), "{first:?}");

    let refused = kubelet.prepare(&[(ns, "next", &next)]).await?;
    let reason = &refused.get(&next).context("no answer for next")?.error;
    if !shares_served {
        ensure!(reason.contains(&format!("is already prepared for claim {ns}/gone")), "{reason:?}");
        return Ok(());
    }
    ensure!(
        reason.contains(&format!("hold {} bytes of its memory", 60u64 << 30)) && reason.contains(&format!("{ns}/gone")),
        "{reason:?}\n{}",
        agent.log_tail()
    );
    let fits = kubelet.prepare(&[(ns, "small", &small)]).await?;
    ensure!(fits.get(&small).is_some_and(|a| a.error.is_empty()), "a share that fits was refused: {fits:?}");

    let unprepared = kubelet.unprepare(&[(ns, "gone", &gone)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    let again = kubelet.prepare(&[(ns, "next", &next)]).await?;
    ensure!(again.get(&next).is_some_and(|a| a.error.is_empty()), "once the old share went: {again:?}");
    Ok(())
}

/// A claim prepared as one share of a GPU is deallocated and allocated again as another share of the same GPU while
/// the kubelet never unprepared it (its record of the claim lost, a pod force-deleted while its node's kubelet was
/// down). Its prepare is refused, naming both, not answered with the old share: the share ID is what the scheduler
/// counted the memory under, and before, only device names were compared. Before 1.36 the API server drops share
/// IDs, and the same GPU allocated again is the allocation prepared: it is answered from the checkpoint.
pub(super) async fn a_claim_allocated_again_as_another_share_is_not_answered_with_the_old_one(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let shares_served = cluster::kubernetes_minor()? >= 36;
    let (node, dirs, agent) = one_gpu_node(&ctx).await?;
    let ns = ctx.namespace.as_str();
    let uid = allocated_claim_with(&ctx, "moved", vec![share_of_gpu_0(&node, 1, "20Gi")], json!([])).await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let first = kubelet.prepare(&[(ns, "moved", &uid)]).await?;
    ensure!(first.get(&uid).is_some_and(|a| a.error.is_empty()), "{first:?}");

    // Deallocated, then allocated again as another share, without an unprepare between.
    let again = vec![share_of_gpu_0(&node, 2, "20Gi")];
    reallocate(&ctx, "moved", again, ("again", &format!("{uid}-again"))).await?;
    let answers = kubelet.prepare(&[(ns, "moved", &uid)]).await?;
    let answer = answers.get(&uid).context("no answer")?;
    if !shares_served {
        ensure!(answer.error.is_empty(), "the same GPU allocated again was refused: {answer:?}");
        return Ok(());
    }
    ensure!(
        answer.devices.is_empty()
            && answer.error.contains("now allocated")
            && answer.error.contains("share 00000000-0000-4000-8000-000000000001")
            && answer.error.contains("share 00000000-0000-4000-8000-000000000002"),
        "{answer:?}\n{}",
        agent.log_tail()
    );
    Ok(())
}

/// A node of one H100 (80 GB) and its ready agent: (node name, directories, agent).
async fn one_gpu_node(ctx: &TestContext) -> anyhow::Result<(String, NodeDirs, Component)> {
    let node = node_name(ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = ready_agent(ctx, &node, &dirs, "1xH100-80GB").await?;
    Ok((node, dirs, agent))
}

/// An allocation result: share `n` of `node`'s GPU 0, consuming `memory`.
fn share_of_gpu_0(node: &str, n: u32, memory: &str) -> serde_json::Value {
    json!({"request": "gpus", "driver": DRIVER, "pool": node, "device": "gpu-0",
        "shareID": format!("00000000-0000-4000-8000-00000000000{n}"), "consumedCapacity": {"memory": memory}})
}
