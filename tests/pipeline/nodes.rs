//! What happens to GPU nodes in clusters that grow and are repaired, through the whole pipeline: a node joining while
//! GPU pods wait for room (an autoscaler's scale-up), and a Node object deleted and registered again under its name
//! (`kubectl delete node` and a kubelet restart, or a machine replaced under the same name), and a node coming back
//! (restarted or rebooted) after its pod was force-deleted and its GPUs handed to another pod.

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::Value;

use super::support::harness::KubeletHarness;
use super::support::node::{DRIVER, gpu_in_two_specs};
use super::support::{TestContext, objects, wait};
use super::{GPUS, PREPARE_TIMEOUT, Testbed, allocated, claim_of};

/// A Deployment of two trainers that each take a whole node's four H100s: the node of four takes one; the other
/// waits as unschedulable (the other node has two H100s). A node of four H100s joins (its Node object, agent and
/// kubelet started, as a new machine's), and the waiting replica is placed there and prepared, with GPUs of that node.
pub(super) async fn a_node_joining_takes_the_gpu_pods_waiting_for_room(ctx: TestContext) -> anyhow::Result<()> {
    let mut bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "four-h100", 4).await?;
    let template = bed.pod(
        &ctx,
        "trainer",
        serde_json::json!([{"name": "gpus", "resourceClaimTemplateName": "four-h100"}]),
        &[("train", &["gpus"])],
    )?;
    bed.deploy(&ctx, template, 2, Value::Null).await?;
    let pods = objects::pods(&ctx);
    let waiting = wait::until("one replica placed and one waiting", PREPARE_TIMEOUT, || async {
        let list = pods.list(&ListParams::default().labels("app=trainer")).await?;
        let waiting = list.items.iter().find(|p| objects::unschedulable_message(p).is_some());
        let placed = list.items.iter().filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some())).count();
        Ok(waiting.filter(|_| placed == 1).and_then(|p| p.metadata.name.clone()))
    })
    .await?;

    let joined = Instant::now();
    let node = bed.add_node(&ctx, "4xH100-80GB").await?;
    let (placed_on, _) = bed.prepared(&ctx, &waiting).await?;
    ensure!(placed_on == node, "{waiting} was placed on {placed_on}, not the node that joined ({node})");
    let devices = allocated(&ctx, &claim_of(&ctx, &waiting, "gpus").await?).await?;
    ensure!(devices.len() == 4 && devices.iter().all(|(pool, _)| *pool == node), "{waiting} got {devices:?}");
    eprintln!("node joined → waiting replica prepared on it in {:?}", joined.elapsed());
    Ok(())
}

/// How long the Node stays deleted: long enough for the agent's back-off over its failed publishes to reach 16 s
/// (1, 2, 4, 8, 16 s), so that an agent backing off as for any failure would look again only 13 s after the Node is
/// back (31 s after the first failure).
const AWAY: Duration = Duration::from_secs(18);
/// How soon after the Node is back its GPUs must be published (the agent looks every 5 s while it is missing, and
/// a round then takes well under a second on an idle machine): before the 13 s a back-off would take.
const REPUBLISHED_WITHIN: Duration = Duration::from_secs(11);

/// A Node object deleted while its machine runs on (its agent, its kubelet and a prepared pod stay), then registered
/// again under its name with a new UID after a while. The garbage collector deletes the ResourceSlices the old Node
/// owned; the agent publishes them again within seconds of the new Node's registration, owned by it (owned by the
/// old one, the collector would delete them again), so the node's GPUs can be allocated once more. The prepared pod
/// keeps its CDI spec throughout.
pub(super) async fn a_node_deleted_and_registered_again_publishes_its_gpus_again(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let node = bed.nodes[1].name.clone();
    let pods = objects::pods(&ctx);
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "running", &node, "one-h100")?).await?;
    bed.prepared(&ctx, "running").await?;
    let specs = bed.node(&node)?.dirs.cdi_specs()?;

    let nodes = Api::<Node>::all(ctx.client.clone());
    let old_uid = nodes.get(&node).await?.uid().context("node without a UID")?;
    nodes.delete(&node, &DeleteParams::default()).await?;
    wait::until("the garbage collector to delete the old Node's slices", Duration::from_secs(60), || async {
        Ok(node_slices(&ctx, &node).await?.is_empty().then_some(()))
    })
    .await?;

    // Away for a while, as a machine being repaired: the agent's publishes fail meanwhile (no Node to own slices).
    tokio::time::sleep(AWAY).await;
    ctx.cluster.add_node_labeled(&node, &[&format!("gpu-dra.dev/e2e={}", ctx.namespace)])?;
    let registered = Instant::now();
    let new_uid = nodes.get(&node).await?.uid().context("node without a UID")?;
    ensure!(new_uid != old_uid, "the Node came back with its old UID {old_uid}");
    wait::until("the agent to publish the node's four GPUs again", Duration::from_secs(90), || async {
        let slices = node_slices(&ctx, &node).await?;
        let devices: usize = slices.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).sum();
        Ok((devices == 4).then_some(slices))
    })
    .await?;
    let published = registered.elapsed();
    ensure!(published <= REPUBLISHED_WITHIN, "published again {published:?} after the Node came back");
    // Owned by the new Node: the collector leaves them.
    let slices = node_slices(&ctx, &node).await?;
    let owners: Vec<String> = slices.iter().flat_map(|s| s.owner_references().iter().map(|o| o.uid.clone())).collect();
    ensure!(!slices.is_empty() && owners.iter().all(|o| *o == new_uid), "slices owned by {owners:?}, not {new_uid}");
    ensure!(bed.node(&node)?.dirs.cdi_specs()? == specs, "the running pod's CDI spec changed");

    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "after", &node, "one-h100")?).await?;
    bed.prepared(&ctx, "after").await?;
    let (before, after) = (
        allocated(&ctx, &claim_of(&ctx, "running", "gpus").await?).await?,
        allocated(&ctx, &claim_of(&ctx, "after", "gpus").await?).await?,
    );
    ensure!(before.is_disjoint(&after), "the new pod got the running pod's GPU: {after:?}");
    eprintln!("Node registered again → its GPUs published again in {published:?}");
    Ok(())
}

/// The ResourceSlices of `node`.
async fn node_slices(ctx: &TestContext, node: &str) -> anyhow::Result<Vec<ResourceSlice>> {
    let list = Api::<ResourceSlice>::all(ctx.client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?;
    Ok(list.items)
}

/// A GPU falls off the bus (XID 79) on a node of four, and the agent restarts before the machine is repaired (a
/// `helm upgrade`, a node-agent crash): NVML counts the lost GPU but cannot read it. The agent registers with the
/// kubelet again, is ready, publishes the three GPUs it can read, says which one it left out
/// (`gpu_dra_node_agent_unreadable_gpus`), unprepares the pod that held one of them, and prepares new pods on all
/// three. Before, one unreadable GPU failed the whole discovery: the restarted agent never registered, so no pod on
/// that node could be unprepared or prepared.
pub(super) async fn an_agent_restarted_while_a_gpu_is_lost_serves_the_nodes_other_gpus(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let mut bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let index = 1;
    let node_name = bed.nodes[index].name.clone();
    let pods = objects::pods(&ctx);
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "held", &node_name, "one-h100")?).await?;
    bed.prepared(&ctx, "held").await?;
    let held = allocated(&ctx, &claim_of(&ctx, "held", "gpus").await?).await?;
    let held_device = held.iter().next().map(|(_, d)| d.clone()).context("held pod without a device")?;
    let held_index: usize = held_device.trim_start_matches("gpu-").parse()?;
    let lost_index = (held_index + 1) % 4;
    let lost_device = format!("gpu-{lost_index}");
    let spec: Vec<&str> = (0..4).map(|i| if i == lost_index { "1xH100-80GB/lost" } else { "1xH100-80GB" }).collect();

    {
        let node = &mut bed.nodes[index];
        node.agent.kill()?;
        node.restart_agent(&ctx, &spec.join(","))?;
        node.agent.wait_ready().await.with_context(|| node.agent.log_tail())?;
        wait::until("the kubelet to register the restarted agent", PREPARE_TIMEOUT, || async {
            Ok((node.kubelet.events().iter().filter(|e| e["event"] == "registered").count() >= 2).then_some(()))
        })
        .await?;
        let unreadable = node.agent.metric("gpu_dra_node_agent_unreadable_gpus", &[]).await?;
        ensure!(unreadable == 1.0, "gpu_dra_node_agent_unreadable_gpus is {unreadable}");
        ensure!(node.agent.log_text().contains("GPUs NVML reports lost"), "{}", node.agent.log_tail());
    }
    let published = wait::until("the three readable GPUs published", Duration::from_secs(30), || async {
        let mut names: Vec<String> = node_slices(&ctx, &node_name)
            .await?
            .iter()
            .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
            .map(|d| d.name)
            .collect();
        names.sort();
        Ok((names.len() == 3).then_some(names))
    })
    .await?;
    ensure!(!published.contains(&lost_device), "the lost {lost_device} is published: {published:?}");

    bed.delete_pod(&ctx, "held", &node_name).await?;
    let mut devices = Vec::new();
    for i in 0..3 {
        let name = format!("after-{i}");
        pods.create(&PostParams::default(), &bed.pod_on(&ctx, &name, &node_name, "one-h100")?).await?;
        bed.prepared(&ctx, &name).await?;
        devices.extend(allocated(&ctx, &claim_of(&ctx, &name, "gpus").await?).await?.into_iter().map(|(_, d)| d));
    }
    devices.sort();
    ensure!(devices == published, "the new pods got {devices:?}, the node publishes {published:?}");
    eprintln!("{lost_device} lost across a restart: {published:?} published and prepared");
    Ok(())
}

/// The NVIDIA driver becomes unusable under a node's running GPU pods (upgraded in place without a reboot, so NVML
/// answers "Driver/library version mismatch"; the GPU Operator's driver container reinstalling), and the agent
/// restarts then (a `helm upgrade`, a crash). Its discovery fails, so it stays not ready, but it serves the kubelet
/// without GPUs: the pod that held a GPU is unprepared when deleted (a drain, the reboot that fixes the driver), its
/// CDI spec removed. The slices its previous process published are emptied (its registration keeps the kubelet from
/// deleting them): nothing is sent to GPUs that cannot be prepared. Once the driver works again, the same process
/// publishes the GPUs and prepares a new pod. Before, the restarted agent never registered, the kubelet answered
/// "driver not registered", and the pod stayed Terminating, holding up the drain.
pub(super) async fn an_agent_restarted_without_a_usable_driver_still_unprepares_its_pods(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let mut bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let node_name = bed.nodes[1].name.clone();
    let pods = objects::pods(&ctx);
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "held", &node_name, "one-h100")?).await?;
    bed.prepared(&ctx, "held").await?;
    let claim = objects::claims(&ctx).get(&claim_of(&ctx, "held", "gpus").await?).await?;
    let uid = claim.metadata.uid.context("claim without UID")?;
    let unusable = bed.nodes[1].dirs.state().join("simulated-driver-unusable");
    {
        let node = &mut bed.nodes[1];
        ensure!(node.dirs.cdi_spec(&uid).exists(), "no spec for the prepared claim");
        std::fs::write(&unusable, b"")?;
        // Counted before the restart: the first agent may have registered more than once (a registration the
        // kubelet retried under load), and the restarted one must be the one seen.
        let registrations =
            |node: &super::Node| node.kubelet.events().iter().filter(|e| e["event"] == "registered").count();
        let before = registrations(node);
        node.agent.kill()?;
        node.restart_agent(&ctx, GPUS[1])?;
        wait::until("the kubelet to register the restarted agent", PREPARE_TIMEOUT, || async {
            Ok((registrations(node) > before).then_some(()))
        })
        .await
        .with_context(|| node.agent.log_tail())?;
        let (code, why) = node.agent.get("/readyz").await.context("the restarted agent's /readyz")?;
        ensure!(code == 503 && why.contains("version mismatch"), "/readyz: {code} {why}");
    }
    wait::until("the node's pool to be emptied", PREPARE_TIMEOUT, || async {
        let devices: usize =
            node_slices(&ctx, &node_name).await?.iter().map(|s| s.spec.devices.iter().flatten().count()).sum();
        Ok((devices == 0).then_some(()))
    })
    .await
    .with_context(|| bed.nodes[1].agent.log_tail())?;
    bed.delete_pod(&ctx, "held", &node_name).await.with_context(|| bed.nodes[1].agent.log_tail())?;
    ensure!(!bed.nodes[1].dirs.cdi_spec(&uid).exists(), "the unprepared claim's spec is still there");

    // The driver works again (the node rebooted into it, or the driver container finished): no restart needed.
    std::fs::remove_file(&unusable)?;
    bed.nodes[1].agent.wait_ready().await.with_context(|| bed.nodes[1].agent.log_tail())?;
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "after", &node_name, "one-h100")?).await?;
    bed.prepared(&ctx, "after").await.with_context(|| bed.nodes[1].agent.log_tail())?;
    let log = bed.nodes[1].agent.log_text();
    ensure!(
        log.contains("serving the kubelet without GPUs")
            && log.contains("recovered again now that the GPUs are discovered"),
        "{}",
        bed.nodes[1].agent.log_tail()
    );
    Ok(())
}

/// A GPU falls off the bus while the agent runs (NVML now answers "GPU is lost" for it, and reports the fault): it
/// stays published with its last reading, tainted `gpu-lost`, and stays tainted past the healthy window, because
/// each discovery that finds it lost reports the fault again (on real hardware NVML reports no more events for a
/// GPU that is gone, and the taint would lapse while the GPU is still lost). A reset brings it back, untainted. The
/// agent here rediscovers 2 s after each discovery ends, with a healthy window of 5 s (a discovery slowed by a busy
/// API server must not let the window end between two reports). Before 1.36 (DRADeviceTaints off) the API server
/// stores slices without taints: the GPU stays published and counted lost, untainted, as the README says.
pub(super) async fn a_gpu_lost_while_the_agent_runs_stays_published_and_tainted_until_reset(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let mut bed = Testbed::start(&ctx).await?;
    let extra = ["--resync-period", "2s", "--health-healthy-window", "5s"];
    let node_name = bed.add_node_with(&ctx, "4xH100-80GB", &extra).await?;
    let node = bed.node(&node_name)?;
    let lost_taint = format!("{DRIVER}/gpu-lost");
    let tainted = async |device: &str| -> anyhow::Result<Option<bool>> {
        let devices = objects::published_devices(&ctx.client, &node_name).await?;
        let Some(found) = devices.iter().find(|d| d.name == device) else { return Ok(None) };
        Ok(Some(found.taints.iter().flatten().any(|t| t.key == lost_taint)))
    };
    wait::until("the node's four GPUs published", PREPARE_TIMEOUT, || async {
        Ok((objects::published_devices(&ctx.client, &node_name).await?.len() == 4).then_some(()))
    })
    .await?;

    // Published, and tainted where the API server keeps device taints.
    let lost_state = Some(super::support::cluster::kubernetes_minor()? >= 36);
    inject(node, "gpu-2 lost")?;
    wait::until("gpu-2 tainted and counted lost", Duration::from_secs(20), || async {
        let lost = node.agent.metric("gpu_dra_node_agent_unreadable_gpus", &[]).await?;
        Ok((tainted("gpu-2").await? == lost_state && lost == 1.0).then_some(()))
    })
    .await?;
    // Three healthy windows: the taint would have lapsed twice over without the reports of each discovery.
    let until = Instant::now() + Duration::from_secs(15);
    while Instant::now() < until {
        ensure!(tainted("gpu-2").await? == lost_state, "gpu-2, still lost, is no longer tainted (or published)");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    ensure!(node.agent.log_text().contains("GPUs NVML reports lost"), "{}", node.agent.log_tail());
    // One fault, counted once, though each discovery (every 2 s) reported the GPU lost again to keep it tainted.
    let lost = [("class", "lost"), ("fault", "gpu-lost")];
    let counted = node.agent.metric("gpu_dra_node_agent_gpu_faults_total", &lost).await?;
    ensure!(counted == 1.0, "{counted} faults counted for one GPU lost once");

    inject(node, "gpu-2 clear")?;
    wait::until("gpu-2 readable and untainted after its reset", Duration::from_secs(20), || async {
        let lost = node.agent.metric("gpu_dra_node_agent_unreadable_gpus", &[]).await?;
        Ok((tainted("gpu-2").await? == Some(false) && lost == 0.0).then_some(()))
    })
    .await?;
    Ok(())
}

/// Injects `line` into `node`'s agent as an operator would: the file appears whole (written aside, renamed in).
fn inject(node: &super::Node, line: &str) -> anyhow::Result<()> {
    super::support::node::inject_fault(&node.dirs.state(), line)
}

/// How long a restarted kubelet may take to unprepare the claim of a pod deleted while it was down: its DRA
/// manager's first reconcile runs before its pod informer has synced and does nothing, the next one 60 s later
/// (pkg/kubelet/cm/dra), and the refused pod's retry comes at most 10 s after (the harness's back-off).
const RECONCILED_WITHIN: Duration = Duration::from_secs(100);

/// A GPU node's kubelet and agent stop while a pod holds all four of its H100s (the node hung and its services were
/// restarted, without a reboot), and the operator force-deletes the pod (`kubectl delete pod --force`, the way out
/// for a node that does not answer). The claim controller releases the pod's claim and it goes, so in the API the
/// node's GPUs are free, and a new pod pinned there is allocated the same four GPUs while the node is still out.
/// When its services start again, the kubelet's and the agent's checkpoints still hold the old claim, whose pod and
/// claim no longer exist. The agent refuses the new pod's GPUs while they are prepared for the old claim, and the
/// kubelet's reconcile unprepares the old claim from its checkpoint alone (nothing left to read from the API); then
/// the new pod is prepared. No GPU is ever in two CDI specs, and the old claim's spec goes.
pub(super) async fn a_node_back_after_its_pod_was_force_deleted_frees_the_old_claim_first(
    ctx: TestContext,
) -> anyhow::Result<()> {
    node_back_after_a_force_delete(ctx, false).await
}

/// [`a_node_back_after_its_pod_was_force_deleted_frees_the_old_claim_first`], the machine rebooted meanwhile (a new
/// boot ID): nothing prepared survives a reboot, so the agent drops the old claim from its checkpoint and removes its
/// spec at start, and the new pod is prepared at once, never refused; the kubelet's later unprepare of the old claim
/// finds nothing to do.
pub(super) async fn a_machine_rebooted_after_its_pod_was_force_deleted_prepares_the_new_pod_at_once(
    ctx: TestContext,
) -> anyhow::Result<()> {
    node_back_after_a_force_delete(ctx, true).await
}

async fn node_back_after_a_force_delete(ctx: TestContext, rebooted: bool) -> anyhow::Result<()> {
    let mut bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "four-h100", 4).await?;
    let index = 1;
    let node = bed.nodes[index].name.clone();
    let pods = objects::pods(&ctx);
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "before", &node, "four-h100")?).await?;
    bed.prepared(&ctx, "before").await?;
    let old_claim = claim_of(&ctx, "before", "gpus").await?;
    let old_devices = allocated(&ctx, &old_claim).await?;
    let old_uid = objects::claims(&ctx).get(&old_claim).await?.uid().context("claim without a UID")?;
    let old_spec = bed.nodes[index].dirs.cdi_spec(&old_uid);
    ensure!(old_spec.exists(), "no CDI spec {} for the prepared claim", old_spec.display());

    bed.nodes[index].kubelet.kill()?;
    bed.nodes[index].agent.kill()?;
    pods.delete("before", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    wait::until("the force-deleted pod's claim to go", PREPARE_TIMEOUT, || async {
        Ok(objects::claims(&ctx).get_opt(&old_claim).await?.is_none().then_some(()))
    })
    .await?;
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "after", &node, "four-h100")?).await?;
    let new_devices = wait::until("the new pod's claim allocated while the node is out", PREPARE_TIMEOUT, || async {
        let Ok(claim) = claim_of(&ctx, "after", "gpus").await else { return Ok(None) };
        let devices = allocated(&ctx, &claim).await?;
        Ok((!devices.is_empty()).then_some(devices))
    })
    .await?;
    ensure!(new_devices == old_devices, "the node's four GPUs are free in the API: got {new_devices:?}");

    if rebooted {
        std::fs::write(bed.nodes[index].dirs.boot_id_file(), "boot-2\n")?;
    }
    let back = Instant::now();
    {
        let n = &mut bed.nodes[index];
        n.restart_agent(&ctx, GPUS[index])?;
        n.kubelet = KubeletHarness::start(&ctx, &n.name, &n.dirs)?;
    }
    let n = &bed.nodes[index];
    let key = format!("{}/after", ctx.namespace);
    let within = if rebooted { PREPARE_TIMEOUT } else { RECONCILED_WITHIN };
    wait::until("the new pod prepared, the old claim no longer", within, || async {
        if let Some(minor) = gpu_in_two_specs(&n.dirs.cdi())? {
            anyhow::bail!("/dev/nvidia{minor} was in two claims' CDI specs at once: {:?}", n.dirs.cdi_specs()?);
        }
        Ok((n.kubelet.count("prepared", &key) > 0).then_some(()))
    })
    .await
    .with_context(|| format!("harness log:\n{}", n.kubelet.log_tail()))?;
    ensure!(!old_spec.exists(), "the old claim's CDI spec outlived its unprepare");
    // Refused by the agent for the old claim; before 1.37 the kubelet also fails a prepare while the restarted
    // agent has not registered yet ("not registered"), which is not the agent's refusal.
    let failures: Vec<String> = n
        .kubelet
        .events()
        .into_iter()
        .filter(|e| e["event"] == "prepare-failed" && e["pod"] == key.as_str())
        .map(|e| e["error"].as_str().unwrap_or_default().to_string())
        .collect();
    let refused = failures.iter().filter(|e| e.contains("already prepared")).count();
    if rebooted {
        ensure!(
            refused == 0,
            "after a reboot nothing of the old claim is prepared, yet the agent refused: {failures:?}"
        );
    }
    eprintln!(
        "node back (rebooted: {rebooted}): the new pod prepared {:?} after ({refused} refused by the agent, {} \
         failed prepares in all)",
        back.elapsed(),
        failures.len()
    );
    Ok(())
}
