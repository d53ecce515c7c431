//! Dynamic MIG (`--mig-layout dynamic`): two H100s in MIG mode, GPU 0 empty, GPU 1 holding a `1g.10gb` an
//! administrator made. The agent publishes every placement of every profile and each GPU whole, with counter sets;
//! the real scheduler picks placements that fit together; the kubelet's DRA code prepares them, which makes the MIG
//! devices, and unprepares them, which destroys them. The administrator's device is never touched.

use std::collections::BTreeSet;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};

use super::mig::{MigNode, allocated, claim_and_pod};
use super::support::node::{DRIVER, start_agent};
use super::support::{self, TestContext, objects, wait};
use super::{PREPARE_TIMEOUT, inject, pod_using};

const GPUS: &str = "1xH100-80GB/mig=,1xH100-80GB/mig=1g.10gb";

/// A pod asking `4g.40gb` + `2g.20gb` + `1g.10gb` (all seven compute slices, slice 0 included) can only go on GPU
/// 0, and gets those three MIG devices made there; a `1g.10gb` pod goes beside the administrator's device on GPU 1;
/// a whole-GPU claim waits while GPU 0 is partitioned (GPU 1 never is whole: a MIG device no claim holds is on it)
/// and gets GPU 0 once the first pod is gone and its MIG devices destroyed. The agent is killed and restarted while
/// the whole GPU is prepared: the MIG device it made is still its own, also when its checkpoint was lost at that
/// restart (the claim adopted from its CDI spec), and unprepare destroys it. Before 1.36
/// (DRAPartitionableDevices off) the API server drops the counters: the agent says so and publishes the MIG
/// devices that exist instead.
pub(super) async fn the_scheduler_partitions_gpus_and_prepare_makes_the_mig_devices(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    // The node's name as MigNode::start makes it; the watch has listed before the agent starts.
    let node = format!("e2e-{}-dynmig", &ctx.namespace[ctx.namespace.len() - 6..]);
    let (listed, listed_rx) = tokio::sync::oneshot::channel();
    let watching = tokio::spawn(devices_ever_stored(ctx.client.clone(), node, seen.clone(), listed));
    tokio::time::timeout(std::time::Duration::from_secs(10), listed_rx)
        .await
        .context("the slice watch never listed")??;
    let mut bed = MigNode::start(&ctx, "dynmig", GPUS, &["--mig-layout", "dynamic"]).await?;
    let result = partition(&ctx, &mut bed, &seen).await;
    watching.abort();
    bed.remove_classes(&ctx).await;
    result
}

/// Collects into `seen` the name of every device a slice of this driver for `node` was ever stored with, from a
/// watch that says on `listed` when it has listed (before the node's agent starts).
async fn devices_ever_stored(
    client: kube::Client,
    node: String,
    seen: std::sync::Arc<std::sync::Mutex<BTreeSet<String>>>,
    listed: tokio::sync::oneshot::Sender<()>,
) {
    use futures::StreamExt as _;
    use kube::runtime::watcher::Event;
    let config = kube::runtime::watcher::Config::default().fields(&format!("spec.driver={DRIVER}"));
    let events = kube::runtime::watcher(Api::<ResourceSlice>::all(client), config);
    let mut events = std::pin::pin!(events);
    let mut listed = Some(listed);
    while let Some(event) = events.next().await {
        let slice = match event {
            Ok(Event::Apply(slice) | Event::InitApply(slice)) => slice,
            Ok(Event::InitDone) => {
                if let Some(listed) = listed.take() {
                    let _ = listed.send(());
                }
                continue;
            }
            _ => continue,
        };
        if slice.spec.node_name.as_deref() == Some(node.as_str())
            && let Ok(mut seen) = seen.lock()
        {
            seen.extend(slice.spec.devices.unwrap_or_default().into_iter().map(|d| d.name));
        }
    }
}

async fn partition(
    ctx: &TestContext,
    bed: &mut MigNode,
    seen: &std::sync::Mutex<BTreeSet<String>>,
) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let node = bed.name.clone();
    if support::cluster::kubernetes_minor()? < 36 {
        let warning = "the API server dropped the devices' consumesCounters (feature gate DRAPartitionableDevices off)";
        wait::until("the agent to warn that the counters were dropped", PREPARE_TIMEOUT, || async {
            Ok(bed.agent.log_text().contains(warning).then_some(()))
        })
        .await?;
        wait::until("the MIG devices that exist to be published instead", PREPARE_TIMEOUT, || async {
            let names: Vec<String> =
                objects::published_devices(&ctx.client, &node).await?.into_iter().map(|d| d.name).collect();
            Ok((names == ["gpu-1-mig-19-0-1"]).then_some(()))
        })
        .await?;
        // Found by a dry run: no slice of partitions stored without their counters (overlapping MIG devices the
        // scheduler could have allocated together), not even for a moment.
        // Watch events come in the order they were stored: partitions stored before the MIG devices that exist
        // would have been seen by the time those are.
        let snapshot = || seen.lock().map(|s| s.clone()).unwrap_or_default();
        wait::until("the watch to see the pool stored", PREPARE_TIMEOUT, || async {
            Ok(snapshot().contains("gpu-1-mig-19-0-1").then_some(()))
        })
        .await?;
        let seen = snapshot();
        ensure!(seen == BTreeSet::from(["gpu-1-mig-19-0-1".to_string()]), "devices ever stored: {seen:?}");
        return Ok(());
    }
    // GPU 0: 26 partitions; GPU 1: 26 less the 8 starting on the administrator's slice 0 (its whole among them).
    let pool = wait::until("the partitions and counters to be published", PREPARE_TIMEOUT, || async {
        let pool = read_pool(ctx, &node).await?;
        Ok((pool.devices.len() == 44 && pool.counters.len() == 2).then_some(pool))
    })
    .await?;
    ensure!(
        !pool.devices.contains("gpu-1-mig-19-0-1") && !pool.devices.contains("gpu-1") && pool.on(0) == 26,
        "published beside the administrator's 1g.10gb: {:?}",
        pool.devices
    );
    ensure!(pool.whole(), "a counter set short of what its GPU has: {:?}", pool.counters);
    let _controller = super::support::process::Component::controller(ctx, &[]).await?;
    let (gpu_class, mig_class) = (bed.gpu_class.clone(), bed.mig_class.clone());
    let profile = |name: &str, p: &str| {
        let selector = format!("device.attributes['{DRIVER}'].profile == '{p}'");
        json!({"name": name, "exactly": {"deviceClassName": mig_class, "selectors": [{"cel": {"expression": selector}}]}})
    };
    // A DCGM-exporter-style monitor, there before the workloads (as a DaemonSet's pod is): every whole GPU the node
    // publishes, with admin access. It makes nothing: GPU 0's whole does not exist as a MIG device, so it gets the
    // parent's device node; GPU 1's whole is not published beside the administrator's device. Admin access consumes
    // no counters: the workload below is allocated all of GPU 0 all the same. (A monitor created while a GPU is
    // partitioned waits: v1.37.2's allocator checks counters for admin access too, allocator_stable.go:1157.)
    let label = json!({"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(ctx.client.clone())
        .patch(ns, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&label))
        .await?;
    let all = json!([{"name": "gpus", "exactly": {"deviceClassName": gpu_class, "allocationMode": "All", "adminAccess": true}}]);
    claim_and_pod(ctx, "monitor", &node, all, json!([])).await?;
    let watched = bed.kubelet.wait_for("prepared", &format!("{ns}/monitor"), PREPARE_TIMEOUT).await?;
    let monitored: Vec<String> = allocated(ctx, ns, "monitor").await?.into_iter().map(|(_, d)| d).collect();
    ensure!(monitored == ["gpu-0"], "the monitor got {monitored:?}");
    let ids: Vec<String> = serde_json::from_value(watched["containers"]["app"].clone())?;
    let (nodes, _) = inject(&bed.dirs, &ids)?;
    ensure!(nodes.contains("/dev/nvidia0") && !nodes.iter().any(|n| n.contains("nvidia-caps")), "monitor: {nodes:?}");
    ensure!(made(bed, 0)?.is_empty(), "admin access made something: {:?}", made(bed, 0)?);

    // One GPU's three MIG devices (NVIDIA's quickstart keeps a pod's MIG devices on one parent the same way).
    let mixed: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "mixed"},
        "spec": {"devices": {
            "requests": [profile("big", "4g.40gb"), profile("mid", "2g.20gb"), profile("small", "1g.10gb")],
            "constraints": [{"matchAttribute": format!("{DRIVER}/parentUUID")}]}}
    }))?;
    objects::claims(ctx).create(&PostParams::default(), &mixed).await?;
    objects::pods(ctx).create(&PostParams::default(), &pod_using("mixed", &node, "mixed")?).await?;
    let prepared = bed.kubelet.wait_for("prepared", &format!("{ns}/mixed"), PREPARE_TIMEOUT).await?;
    let got: BTreeSet<String> = allocated(ctx, ns, "mixed").await?.into_iter().map(|(_, d)| d).collect();
    let want = BTreeSet::from(["gpu-0-mig-5-0-4", "gpu-0-mig-14-4-2", "gpu-0-mig-19-6-1"].map(String::from));
    ensure!(got == want, "allocated {got:?}, expected {want:?}");
    ensure!(made(bed, 0)? == [(5, 0), (14, 4), (19, 6)], "made on GPU 0: {:?}", made(bed, 0)?);
    let ids: Vec<String> = serde_json::from_value(prepared["containers"]["app"].clone())?;
    let (nodes, env) = inject(&bed.dirs, &ids)?;
    let caps = nodes.iter().filter(|n| n.starts_with("/dev/nvidia-caps/")).count();
    ensure!(caps == 6 && nodes.contains("/dev/nvidia0"), "injected {nodes:?}");
    let uuids = env.iter().find_map(|e| e.strip_prefix("GPU_DRA_GPU_UUIDS=")).context("no GPU_DRA_GPU_UUIDS")?;
    ensure!(uuids.split(',').filter(|u| u.starts_with("MIG-")).count() == 3, "env {env:?}");
    release(ctx, bed, "monitor").await?;
    ensure!(made(bed, 0)?.len() == 3, "the monitor's unprepare destroyed something: {:?}", made(bed, 0)?);

    // Beside the administrator's device on GPU 1.
    claim_and_pod(ctx, "side", &node, json!([profile("small", "1g.10gb")]), json!([])).await?;
    bed.kubelet.wait_for("prepared", &format!("{ns}/side"), PREPARE_TIMEOUT).await?;
    let side: Vec<String> = allocated(ctx, ns, "side").await?.into_iter().map(|(_, d)| d).collect();
    ensure!(
        side.len() == 1 && side[0].starts_with("gpu-1-mig-19-") && side[0] != "gpu-1-mig-19-0-1",
        "side got {side:?}"
    );
    ensure!(made(bed, 1)?.len() == 2, "GPU 1: {:?}", made(bed, 1)?);

    // A whole GPU waits while GPU 0 is partitioned.
    let whole = json!([{"name": "gpu", "exactly": {"deviceClassName": gpu_class}}]);
    claim_and_pod(ctx, "whole", &node, whole, json!([])).await?;
    let why = objects::unschedulable(&ctx.client, ns, "whole", PREPARE_TIMEOUT).await?;
    ensure!(why.contains("cannot allocate all claims"), "the whole GPU waits for another reason: {why}");
    // GPU 1 first: the whole GPU still waits. Then GPU 0: once its pod's MIG devices are destroyed, the whole GPU is
    // allocated and its 7g.80gb made (which the three would have been in the way of).
    release(ctx, bed, "side").await?;
    ensure!(made(bed, 1)? == [(19, 0)], "GPU 1 is back to the administrator's device: {:?}", made(bed, 1)?);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let claim = objects::claims(ctx).get("whole").await?;
    ensure!(
        claim.status.and_then(|s| s.allocation).is_none(),
        "the whole GPU was allocated beside GPU 0's MIG devices or the administrator's"
    );
    release(ctx, bed, "mixed").await?;
    bed.kubelet.wait_for("prepared", &format!("{ns}/whole"), PREPARE_TIMEOUT).await?;
    let whole: Vec<String> = allocated(ctx, ns, "whole").await?.into_iter().map(|(_, d)| d).collect();
    ensure!(whole == ["gpu-0"], "the whole-GPU claim got {whole:?}");
    ensure!(made(bed, 0)? == [(0, 0)], "GPU 0 should hold its 7g.80gb alone: {:?}", made(bed, 0)?);

    // The agent dies and comes back: the 7g device is still the whole claim's, not an administrator's. Then again
    // with its checkpoint lost (torn, or written by a newer agent before a rollback): the claim is adopted from its
    // CDI spec, and its MIG device, named there, is known as made for it.
    for (restart, checkpoint_lost) in [(2, false), (3, true)] {
        bed.agent.kill()?;
        if checkpoint_lost {
            std::fs::write(bed.dirs.checkpoint(), b"{\"version\": 99}")?;
        }
        bed.agent = start_agent(
            ctx,
            &node,
            &bed.dirs,
            &["--gpu-backend", "simulated", "--simulated-gpus", GPUS, "--mig-layout", "dynamic"],
        )?;
        bed.agent.wait_ready().await?;
        wait::until("the kubelet to register the restarted agent", PREPARE_TIMEOUT, || async {
            Ok((bed.kubelet.events().iter().filter(|e| e["event"] == "registered").count() >= restart).then_some(()))
        })
        .await?;
        let after = wait::until("the pool after the restart", PREPARE_TIMEOUT, || async {
            let pool = read_pool(ctx, &node).await?;
            Ok((!pool.devices.is_empty() && pool.counters.len() == 2).then_some(pool))
        })
        .await?;
        ensure!(
            after.on(0) == 26 && after.whole(),
            "after a restart (checkpoint lost: {checkpoint_lost}) the whole claim's MIG device passed for an \
             administrator's: {:?}",
            after.devices
        );
        ensure!(made(bed, 0)? == [(0, 0)], "the restart lost the 7g device: {:?}", made(bed, 0)?);
    }
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    objects::pods(ctx).delete("whole", &now).await?;
    bed.kubelet.wait_for("unprepared", &format!("{ns}/whole"), PREPARE_TIMEOUT).await?;
    ensure!(made(bed, 0)?.is_empty(), "unprepare after a restart left {:?}", made(bed, 0)?);
    ensure!(made(bed, 1)? == [(19, 0)], "GPU 1: {:?}", made(bed, 1)?);
    eprintln!("dynamic MIG: 4g+2g+1g made on GPU 0 and destroyed; the whole GPU waited ({why}), then got GPU 0");
    Ok(())
}

/// The MIG devices simulated GPU `index` has now, as (profile ID, first memory slice): what `nvidia-smi mig -lgi`
/// shows on a real node, read from the simulated driver's file.
fn made(bed: &MigNode, index: u32) -> anyhow::Result<Vec<(u32, u32)>> {
    let path = bed.dirs.state().join("simulated-mig-devices.json");
    let kept: Value = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)?,
        // Nothing made yet: the spec's layout.
        Err(_) => return Ok(if index == 1 { vec![(19, 0)] } else { Vec::new() }),
    };
    let devices: Vec<(u32, u32, u32, String)> = serde_json::from_value(kept["gpus"][index.to_string()].clone())?;
    let mut devices: Vec<(u32, u32)> = devices.into_iter().map(|(id, start, _, _)| (id, start)).collect();
    devices.sort_by_key(|(_, start)| *start);
    Ok(devices)
}

/// Deletes pod `name` at once, waits until the kubelet side unprepared it, deletes its claim.
async fn release(ctx: &TestContext, bed: &MigNode, name: &str) -> anyhow::Result<()> {
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    objects::pods(ctx).delete(name, &now).await?;
    bed.kubelet.wait_for("unprepared", &format!("{}/{name}", ctx.namespace), PREPARE_TIMEOUT).await?;
    objects::claims(ctx).delete(name, &DeleteParams::default()).await?;
    Ok(())
}

/// A node's pool: its devices' names and its counter sets (name → counter → value).
struct Pool {
    devices: BTreeSet<String>,
    counters: std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
}

impl Pool {
    /// How many devices of GPU `minor` are published.
    fn on(&self, minor: u32) -> usize {
        let (whole, prefix) = (format!("gpu-{minor}"), format!("gpu-{minor}-"));
        self.devices.iter().filter(|d| **d == whole || d.starts_with(&prefix)).count()
    }

    /// Whether every counter set holds all its GPU has (a MIG device the agent did not make is kept out of the
    /// scheduler's way by leaving partitions out, never by counters).
    fn whole(&self) -> bool {
        self.counters
            .values()
            .all(|c| c.len() == 10 && c.iter().all(|(name, v)| v == if name == "compute-slices" { "7" } else { "1" }))
    }
}

async fn read_pool(ctx: &TestContext, node: &str) -> anyhow::Result<Pool> {
    let slices = Api::<ResourceSlice>::all(ctx.client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items;
    let devices = slices.iter().flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone())).collect();
    let counters = slices
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .map(|set| {
            let values = set.counters.iter().map(|(name, c)| (name.clone(), c.value.0.clone())).collect();
            (set.name.clone(), values)
        })
        .collect();
    Ok(Pool { devices, counters })
}
