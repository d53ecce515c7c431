//! GPU health against the real control plane: a fault injected into a simulated GPU becomes a device taint in the
//! node's ResourceSlice within a second; the real scheduler gives a tainted GPU to no new claim;
//! kube-controller-manager's own device-taint-eviction controller evicts the pod of a `NoExecute` (lost) GPU;
//! a reset or the healthy window untaints it; an agent restart keeps the fault with its `timeAdded`; an unreadable
//! saved state is kept aside, reported, and its faults read back from the published taints; a failing or hung state
//! disk neither holds up a fault's taint nor loses the fault once it answers again.

#[path = "health/state_disk.rs"]
mod state_disk;
mod support;
#[path = "health/unwatched.rs"]
mod unwatched;

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};
use state_disk::{
    a_deleted_health_state_is_read_back_from_the_published_taints,
    a_health_save_that_failed_is_tried_again_until_it_is_on_disk, a_hung_state_disk_does_not_hold_up_a_fault_taint,
};
use support::harness::KubeletHarness;
use support::node::{DRIVER, NodeAgent, start_agent};
use support::objects::{self, create_pod_on};
use support::{TestContext, wait};
use unwatched::a_gpu_whose_faults_would_go_unnoticed_is_unknown_in_the_pod_status;

fn main() {
    // Before 1.36 device taints and device health in the pod status are off (`make test-matrix`): what the README's
    // version table documents for them is asserted instead.
    let taints_served = support::cluster::kubernetes_minor().map_or(true, |minor| minor >= 36);
    let tests = if taints_served {
        vec![
            test!(a_faulted_gpu_is_tainted_within_a_second_and_gets_no_claim_until_reset),
            test!(the_pod_of_a_lost_gpu_is_evicted_by_kubernetes),
            test!(a_restart_mid_fault_keeps_it_and_the_healthy_window_clears_it),
            test!(a_reboot_ends_a_fault_only_a_reset_clears),
            test!(the_kubelet_writes_device_health_into_the_pod_status),
            test!(a_gpu_whose_faults_would_go_unnoticed_is_unknown_in_the_pod_status),
            test!(an_open_health_stream_does_not_hold_up_the_agents_shutdown),
            test!(an_unreadable_health_state_is_kept_aside_and_reported),
            test!(a_fault_during_a_request_the_api_server_never_answers_is_published_after_the_deadline),
            test!(a_health_save_that_failed_is_tried_again_until_it_is_on_disk),
            test!(a_hung_state_disk_does_not_hold_up_a_fault_taint),
            test!(a_deleted_health_state_is_read_back_from_the_published_taints),
        ]
    } else {
        vec![
            test!(without_device_taints_a_faulted_gpu_stays_allocatable_and_the_agent_says_why),
            test!(an_unreadable_health_state_is_kept_aside_and_reported),
        ]
    };
    support::run_with_env(
        "health",
        false,
        &[("GPU_DRA_E2E_KCM_CONTROLLERS", "device-taint-eviction-controller")],
        &tests,
    )
}

fn node_name(ctx: &TestContext) -> String {
    format!("gpu-node-{}", &ctx.namespace[ctx.namespace.len() - 6..])
}

use support::node::inject_fault as inject;

/// The taints of each device of the node's current pool, by device name.
async fn taints(ctx: &TestContext, node: &str) -> anyhow::Result<Vec<(String, Vec<Value>)>> {
    let selector = format!("spec.nodeName={node},spec.driver={DRIVER}");
    let slices = Api::<ResourceSlice>::all(ctx.client.clone()).list(&ListParams::default().fields(&selector)).await?;
    let generation = slices.items.iter().map(|s| s.spec.pool.generation).max().unwrap_or(0);
    let mut devices: Vec<(String, Vec<Value>)> = slices
        .items
        .iter()
        .filter(|s| s.spec.pool.generation == generation)
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .map(|d| {
            let taints = d.taints.iter().flatten().map(serde_json::to_value).collect::<Result<Vec<_>, _>>();
            taints.map(|t| (d.name, t))
        })
        .collect::<Result<_, _>>()?;
    devices.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(devices)
}

/// Waits until the device `device` has exactly the taint keys `keys`, returning its taints and how long it took.
async fn wait_taints(
    ctx: &TestContext,
    node: &str,
    device: &str,
    keys: &[&str],
    timeout: Duration,
) -> anyhow::Result<(Vec<Value>, Duration)> {
    let start = Instant::now();
    let found = wait::until(&format!("{device} tainted with {keys:?}"), timeout, || async {
        let devices = taints(ctx, node).await?;
        let taints = devices.into_iter().find(|(name, _)| name == device).map(|(_, t)| t);
        Ok(taints.filter(|t| t.iter().map(|t| t["key"].as_str().unwrap_or_default()).eq(keys.iter().copied())))
    })
    .await?;
    Ok((found, start.elapsed()))
}

async fn device_class(ctx: &TestContext) -> anyhow::Result<()> {
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": ctx.namespace},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}]}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &class).await?;
    Ok(())
}

async fn claim_for(ctx: &TestContext, name: &str, count: u32) -> anyhow::Result<()> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": ctx.namespace, "count": count}}]}}
    }))?;
    objects::claims(ctx).create(&PostParams::default(), &claim).await?;
    Ok(())
}

async fn allocated(ctx: &TestContext, claim: &str) -> anyhow::Result<Option<Vec<String>>> {
    let claim = objects::claims(ctx).get(claim).await?;
    let results = claim.status.and_then(|s| s.allocation).and_then(|a| a.devices).and_then(|d| d.results);
    Ok(results.map(|r| r.into_iter().map(|r| r.device).collect()))
}

/// A node of two simulated H100s, its agent ready and gpu-1 untainted, then a double-bit ECC error injected into
/// gpu-1 (a `needs-reset` fault); returns the node's name and its agent.
async fn node_with_a_double_bit_error_on_gpu_1(ctx: &TestContext) -> anyhow::Result<(String, NodeAgent)> {
    let node = node_name(ctx);
    ctx.cluster.add_node(&node)?;
    device_class(ctx).await?;
    let agent = NodeAgent::start(ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"])?;
    agent.wait_ready().await?;
    wait_taints(ctx, &node, "gpu-1", &[], Duration::from_secs(30)).await?;
    inject(&agent.dirs.state(), "gpu-1 ecc-dbe")?;
    Ok((node, agent))
}

async fn a_faulted_gpu_is_tainted_within_a_second_and_gets_no_claim_until_reset(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let (node, agent) = node_with_a_double_bit_error_on_gpu_1(&ctx).await?;
    let key = format!("{DRIVER}/needs-reset");
    let (found, took) =
        wait_taints(&ctx, &node, "gpu-1", &[&key], Duration::from_secs(5)).await.with_context(|| agent.log_tail())?;
    eprintln!("gpu-1 tainted {took:?} after the fault");
    ensure!(took < Duration::from_secs(1), "taint published after {took:?}");
    ensure!(found[0]["value"] == "ecc-double-bit" && found[0]["effect"] == "NoSchedule", "{found:?}");
    ensure!(found[0]["timeAdded"].is_string(), "{found:?}");
    ensure!(taints(&ctx, &node).await?.iter().all(|(d, t)| d == "gpu-1" || t.is_empty()), "gpu-0 tainted too");

    // Two GPUs for one pod: only one is untainted, so the real scheduler must not allocate.
    claim_for(&ctx, "two", 2).await?;
    create_pod_on(&ctx, "trainer", &node, json!([{"name": "gpu", "resourceClaimName": "two"}])).await?;
    let pods = objects::pods(&ctx);
    wait::until("the scheduler to give up on the pod", Duration::from_secs(30), || async {
        let pod: Pod = pods.get("trainer").await?;
        let conditions = pod.status.and_then(|s| s.conditions).unwrap_or_default();
        Ok(conditions.iter().any(|c| c.type_ == "PodScheduled" && c.status == "False").then_some(()))
    })
    .await?;
    ensure!(allocated(&ctx, "two").await?.is_none(), "a tainted GPU was allocated");

    let events = node_events(&ctx, &node).await?;
    ensure!(
        events
            .iter()
            .any(|(t, r, n)| t == "Warning" && r == "GpuFault" && n.contains("gpu-1") && n.contains("double-bit")),
        "{events:?}"
    );
    let faulted = [("device", "gpu-1")];
    ensure!(agent.metric("gpu_dra_node_agent_gpu_healthy", &faulted).await? == 0.0, "health gauge");
    let labels = [("class", "needs-reset"), ("fault", "ecc-double-bit")];
    ensure!(agent.metric("gpu_dra_node_agent_gpu_faults_total", &labels).await? == 1.0, "fault counter");

    inject(&agent.dirs.state(), "gpu-1 clear")?;
    let (_, took) = wait_taints(&ctx, &node, "gpu-1", &[], Duration::from_secs(5)).await?;
    eprintln!("gpu-1 untainted {took:?} after the reset");
    // A fault of the other GPU within minutes is an Event of its own, naming it (not gpu-1's counted again).
    inject(&agent.dirs.state(), "gpu-0 ecc-dbe")?;
    wait::until("a GpuFault Event on the Node naming gpu-0", Duration::from_secs(10), || async {
        let events = node_events(&ctx, &node).await?;
        Ok(events.iter().any(|(t, r, n)| t == "Warning" && r == "GpuFault" && n.contains("gpu-0")).then_some(()))
    })
    .await
    .with_context(|| format!("{:?}", agent.log_tail()))?;
    inject(&agent.dirs.state(), "gpu-0 clear")?;
    wait_taints(&ctx, &node, "gpu-0", &[], Duration::from_secs(5)).await?;
    let devices =
        wait::until("the pod's claim to be allocated", Duration::from_secs(60), || allocated(&ctx, "two")).await?;
    ensure!(devices.len() == 2, "{devices:?}");
    ensure!(agent.metric("gpu_dra_node_agent_gpu_healthy", &faulted).await? == 1.0, "health gauge after reset");
    Ok(())
}

/// Kubernetes 1.34 and 1.35 (DRADeviceTaints off): the agent publishes the fault's taint, the API server stores the
/// slice without it, the agent warns naming the gate, and the real scheduler still allocates the faulted GPU; the
/// fault is still a Node event and in the health gauge.
async fn without_device_taints_a_faulted_gpu_stays_allocatable_and_the_agent_says_why(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let (node, agent) = node_with_a_double_bit_error_on_gpu_1(&ctx).await?;
    let faulted = [("device", "gpu-1")];
    wait::until("the agent to take gpu-1 as faulted", Duration::from_secs(10), || async {
        Ok((agent.metric("gpu_dra_node_agent_gpu_healthy", &faulted).await? == 0.0).then_some(()))
    })
    .await?;
    let warning = "the API server dropped the devices' taints (feature gate DRADeviceTaints off)";
    wait::until("the agent's warning about dropped taints", Duration::from_secs(10), || async {
        Ok(agent.log_text().contains(warning).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(taints(&ctx, &node).await?.iter().all(|(_, t)| t.is_empty()), "a taint was stored");
    let node_events = node_events(&ctx, &node).await?;
    ensure!(
        node_events.iter().any(|(t, r, n)| t == "Warning" && r == "GpuFault" && n.contains("gpu-1")),
        "{node_events:?}"
    );

    // Both GPUs for one pod: the faulted one is allocated too.
    claim_for(&ctx, "two", 2).await?;
    create_pod_on(&ctx, "trainer", &node, json!([{"name": "gpu", "resourceClaimName": "two"}])).await?;
    let mut devices =
        wait::until("the pod's claim to be allocated", Duration::from_secs(60), || allocated(&ctx, "two")).await?;
    devices.sort();
    ensure!(devices == ["gpu-0", "gpu-1"], "{devices:?}");
    Ok(())
}

async fn the_pod_of_a_lost_gpu_is_evicted_by_kubernetes(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    device_class(&ctx).await?;
    let agent = NodeAgent::start(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"])?;
    agent.wait_ready().await?;
    claim_for(&ctx, "one", 1).await?;
    create_pod_on(&ctx, "worker", &node, json!([{"name": "gpu", "resourceClaimName": "one"}])).await?;
    let pods = objects::pods(&ctx);
    wait::until("the pod to be bound", Duration::from_secs(30), || async {
        Ok(pods.get("worker").await?.spec.and_then(|s| s.node_name))
    })
    .await?;
    let device = allocated(&ctx, "one").await?.and_then(|d| d.into_iter().next()).context("claim not allocated")?;
    // DCGM-style monitors (every GPU with admin access): admin access is no exemption from device taints, so only
    // the one tolerating them keeps running, and only such a monitor gets the node's GPUs while one is faulted. The
    // eviction controller honours only tolerations naming the effect NoExecute (v1.37.2, unlike a pod's
    // tolerations): `operator: Exists` alone keeps the scheduler's allocation but not the pod.
    let label = json!({"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(ctx.client.clone())
        .patch(&ctx.namespace, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&label))
        .await?;
    let both = json!([{"operator": "Exists", "effect": "NoSchedule"}, {"operator": "Exists", "effect": "NoExecute"}]);
    let monitors = [
        ("monitor", both.clone()),
        ("bare-monitor", json!([])),
        ("exists-monitor", json!([{"operator": "Exists"}])),
        ("late-monitor", both),
    ];
    for (monitor, tolerations) in monitors {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": monitor},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": ctx.namespace,
                "allocationMode": "All", "adminAccess": true, "tolerations": tolerations}}]}}
        }))?;
        objects::claims(&ctx).create(&PostParams::default(), &claim).await?;
        if monitor != "late-monitor" {
            create_pod_on(&ctx, monitor, &node, json!([{"name": "gpus", "resourceClaimName": monitor}])).await?;
            wait::until("the monitor's claim to be allocated", Duration::from_secs(30), || async {
                allocated(&ctx, monitor).await
            })
            .await?;
        }
    }

    // An application error on the same GPU changes nothing.
    inject(&agent.dirs.state(), &format!("{device} xid 13"))?;
    // Once the agent has taken it (else the check below could run before, and the next inject replace it unread).
    wait::until("XID 13 to be classified", Duration::from_secs(10), || async {
        Ok(agent.log_text().contains("GPU fault ignored (application error)").then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(taints(&ctx, &node).await?.iter().all(|(_, t)| t.is_empty()), "XID 13 tainted a GPU");

    inject(&agent.dirs.state(), &format!("{device} xid 79"))?;
    let key = format!("{DRIVER}/gpu-lost");
    let (found, took) =
        wait_taints(&ctx, &node, &device, &[&key], Duration::from_secs(5)).await.with_context(|| agent.log_tail())?;
    eprintln!("{device} tainted {took:?} after XID 79");
    ensure!(found[0]["value"] == "79" && found[0]["effect"] == "NoExecute", "{found:?}");
    let pod = wait::until("kube-controller-manager to evict the pod", Duration::from_secs(30), || async {
        let pod = pods.get_opt("worker").await?;
        Ok(match pod {
            Some(pod) if pod.metadata.deletion_timestamp.is_none() => None,
            other => Some(other),
        })
    })
    .await?;
    if let Some(pod) = pod {
        let conditions = pod.status.and_then(|s| s.conditions).unwrap_or_default();
        ensure!(conditions.iter().any(|c| c.type_ == "DisruptionTarget"), "evicted without reason: {conditions:?}");
    }
    for evicted in ["bare-monitor", "exists-monitor"] {
        wait::until(&format!("{evicted} to be evicted"), Duration::from_secs(30), || async {
            Ok(pods.get_opt(evicted).await?.is_none_or(|p| p.metadata.deletion_timestamp.is_some()).then_some(()))
        })
        .await?;
    }
    create_pod_on(&ctx, "late-monitor", &node, json!([{"name": "gpus", "resourceClaimName": "late-monitor"}])).await?;
    let late = wait::until("the monitor created after the fault to get the GPUs", Duration::from_secs(30), || async {
        allocated(&ctx, "late-monitor").await
    })
    .await?;
    ensure!(late.len() == 2, "the late monitor got {late:?}");
    let kept = pods.get("monitor").await?;
    ensure!(kept.metadata.deletion_timestamp.is_none(), "the monitor tolerating the taints was evicted: {kept:?}");
    Ok(())
}

async fn a_restart_mid_fault_keeps_it_and_the_healthy_window_clears_it(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xL4-24GB", "--health-healthy-window", "8s"];
    let mut agent = NodeAgent::start(&ctx, &node, &args)?;
    agent.wait_ready().await?;
    inject(&agent.dirs.state(), "gpu-0 xid 79")?;
    let key = format!("{DRIVER}/gpu-lost");
    let (before, _) = wait_taints(&ctx, &node, "gpu-0", &[&key], Duration::from_secs(5)).await?;
    // The GPU faults again before the restart: the window must count at least from this fault. (Only the first
    // fault was saved; counted from it, the restarted agent untainted a GPU still failing 3 s after its last fault.)
    tokio::time::sleep(Duration::from_secs(3)).await;
    inject(&agent.dirs.state(), "gpu-0 xid 79")?;
    let labels = [("class", "lost"), ("fault", "79")];
    wait::until("the repeated fault to be counted", Duration::from_secs(5), || async {
        Ok((agent.metric("gpu_dra_node_agent_gpu_faults_total", &labels).await? == 2.0).then_some(()))
    })
    .await?;
    let repeated_at = Instant::now();

    agent.process.terminate()?;
    agent.process = start_agent(&ctx, &node, &agent.dirs, &args)?;
    agent.wait_ready().await?;
    // The restarted agent has published (or found its pool unchanged): the fault is still there, same timeAdded,
    // and no other GPU was tainted.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let devices = taints(&ctx, &node).await?;
    ensure!(devices == [("gpu-0".to_string(), before.clone()), ("gpu-1".to_string(), Vec::new())], "{devices:?}");
    // Within the window of the last fault, else the restarted agent rightly untaints the GPU and nothing is shown.
    ensure!(repeated_at.elapsed() < Duration::from_secs(8), "the restart took longer than the window");

    let (_, _) =
        wait_taints(&ctx, &node, "gpu-0", &[], Duration::from_secs(20)).await.with_context(|| agent.log_tail())?;
    let healed_after = repeated_at.elapsed();
    ensure!(
        healed_after >= Duration::from_secs(8),
        "untainted {healed_after:?} after its last fault, within the 8 s window"
    );
    eprintln!(
        "gpu-0 untainted {healed_after:?} after its last fault (healthy window 8 s, started again by the restart)"
    );
    Ok(())
}

/// A needs-reset fault where only a reset untaints (`--health-healthy-window 0s`): a restart of the agent keeps it,
/// the machine's reboot (a new boot ID), which reset the GPU, ends it. Before, it outlived the reboot, for good on
/// nodes where nothing else resets a GPU.
async fn a_reboot_ends_a_fault_only_a_reset_clears(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--health-healthy-window", "0s"];
    let mut agent = NodeAgent::start(&ctx, &node, &args)?;
    agent.wait_ready().await?;
    inject(&agent.dirs.state(), "gpu-1 ecc-dbe")?;
    let key = format!("{DRIVER}/needs-reset");
    wait_taints(&ctx, &node, "gpu-1", &[&key], Duration::from_secs(10)).await?;

    agent.process.terminate()?;
    agent.process = start_agent(&ctx, &node, &agent.dirs, &args)?;
    agent.wait_ready().await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    wait_taints(&ctx, &node, "gpu-1", &[&key], Duration::from_secs(5)).await.context("kept across a restart")?;

    agent.process.terminate()?;
    std::fs::write(agent.dirs.boot_id_file(), "boot-2\n")?;
    agent.process = start_agent(&ctx, &node, &agent.dirs, &args)?;
    agent.wait_ready().await?;
    wait_taints(&ctx, &node, "gpu-1", &[], Duration::from_secs(10)).await.with_context(|| agent.log_tail())?;
    ensure!(
        agent.log_text().contains("GPU faults of the machine's previous boot forgotten"),
        "the log does not say why:\n{}",
        agent.log_tail()
    );
    Ok(())
}

/// The health stream (DRAResourceHealth) as the real kubelet DRA code consumes it, and who is told: a GPU of a
/// running pod faults (taints that do not keep pods away, effect None); the pod's container status shows that device
/// Unhealthy and the other Healthy, and the Node's Warning names the claim and the pod, which gets a Warning too.
async fn the_kubelet_writes_device_health_into_the_pod_status(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    device_class(&ctx).await?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--health-needs-reset-effect", "None"];
    let agent = NodeAgent::start(&ctx, &node, &args)?;
    let kubelet = KubeletHarness::start(&ctx, &node, &agent.dirs)?;
    kubelet.wait_for("registered", "", Duration::from_secs(60)).await.with_context(|| kubelet.log_tail())?;

    claim_for(&ctx, "both", 2).await?;
    create_pod_on(&ctx, "worker", &node, json!([{"name": "gpu", "resourceClaimName": "both"}])).await?;
    device_health(&ctx, "worker", &[("gpu-0", "Healthy"), ("gpu-1", "Healthy")])
        .await
        .with_context(|| kubelet.log_tail())?;

    inject(&agent.dirs.state(), "gpu-0 ecc-dbe")?;
    let key = format!("{DRIVER}/needs-reset");
    let (found, _) = wait_taints(&ctx, &node, "gpu-0", &[&key], Duration::from_secs(5)).await?;
    ensure!(found[0]["effect"] == "None", "{found:?}");
    device_health(&ctx, "worker", &[("gpu-0", "Unhealthy"), ("gpu-1", "Healthy")])
        .await
        .with_context(|| kubelet.log_tail())?;

    let ns = &ctx.namespace;
    let on_node = format!("claim {ns}/both (pod {ns}/worker)");
    let events = node_events(&ctx, &node).await?;
    ensure!(
        events.iter().any(|(t, r, n)| t == "Warning" && r == "GpuFault" && n.contains("gpu-0") && n.contains(&on_node)),
        "no GpuFault on the Node naming {on_node:?}: {events:?}"
    );
    let on_pod = wait::until("a GpuFault Event on the pod", Duration::from_secs(10), || async {
        let events = objects::events_in(&ctx, ns, "worker").await?;
        Ok(events.into_iter().find(|(t, r, _)| t == "Warning" && r == "GpuFault"))
    })
    .await?;
    ensure!(on_pod.2.contains("gpu-0") && on_pod.2.contains(&format!("through claim {ns}/both")), "{on_pod:?}");
    Ok(())
}

/// Waits until the kubelet reports `want` (device name suffix → health) for pod `pod`'s first container.
async fn device_health(ctx: &TestContext, pod: &str, want: &[(&str, &str)]) -> anyhow::Result<()> {
    let reported = || async {
        let pod = serde_json::to_value(objects::pods(ctx).get(pod).await?)?;
        let resources = &pod["status"]["containerStatuses"][0]["allocatedResourcesStatus"][0]["resources"];
        let mut health: Vec<(String, String)> = resources
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                (r["resourceID"].as_str().unwrap_or_default().into(), r["health"].as_str().unwrap_or_default().into())
            })
            .collect();
        health.sort();
        anyhow::Ok(health)
    };
    // Resources are named by their CDI device ids, `<driver>/gpu=<claim UID>-gpu-<minor>`.
    let prefix = format!("{DRIVER}/gpu=");
    let waited = wait::until("the device health in the pod status", Duration::from_secs(60), || async {
        let health = reported().await?;
        ensure!(health.iter().all(|(id, _)| id.starts_with(&prefix)), "{health:?}");
        let states: Vec<(&str, &str)> =
            health.iter().map(|(id, state)| (&id[id.len().saturating_sub(5)..], state.as_str())).collect();
        Ok((states == want).then_some(()))
    })
    .await;
    match waited {
        Ok(()) => Ok(()),
        Err(error) => Err(error.context(format!("wanted {want:?}, last reported {:?}", reported().await?))),
    }
}

/// A health state the agent cannot read (a corrupt file, or one a newer agent wrote before a rollback) has lost the
/// faults it recorded. The agent keeps the file aside, so its next save does not overwrite it, and reads the faults
/// back from the taints its slices were last published with (from 1.36, where taints are served) before it
/// publishes again: the faulted GPU is never untainted, not even for one pool generation. A Warning Event on the
/// Node says the state was unreadable, so that an operator checks the GPUs; a Normal one then says what was read
/// back and where the file was kept.
async fn an_unreadable_health_state_is_kept_aside_and_reported(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let taints_served = support::cluster::kubernetes_minor()? >= 36;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xL4-24GB"];
    let mut agent = NodeAgent::start(&ctx, &node, &args)?;
    agent.wait_ready().await?;
    let key = format!("{DRIVER}/needs-reset");
    let tainted = if taints_served {
        inject(&agent.dirs.state(), "gpu-1 ecc-dbe")?;
        Some(wait_taints(&ctx, &node, "gpu-1", &[&key], Duration::from_secs(5)).await?.0)
    } else {
        None
    };
    let generation = pool_generation(&ctx, &node).await?;
    agent.process.terminate()?;
    let torn = b"{\"version\": 1, \"faulted\": {\"GPU-";
    std::fs::write(agent.dirs.state().join("health.json"), torn)?;

    agent.process = start_agent(&ctx, &node, &agent.dirs, &args)?;
    agent.wait_ready().await?;
    let (kind, _, warning) = node_event(&ctx, &node, "GpuHealthStateUnreadable").await?;
    ensure!(kind == "Warning" && warning.contains("check this node's GPUs"), "{kind}: {warning}");
    let note = node_event(&ctx, &node, "GpuHealthStateRestored").await?.2;
    let kept: Vec<_> = std::fs::read_dir(agent.dirs.state())?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("health.json.corrupt-"))
        .map(|e| e.path())
        .collect();
    ensure!(kept.len() == 1 && std::fs::read(&kept[0])? == torn, "kept aside: {kept:?}");
    ensure!(note.contains(&kept[0].display().to_string()) && note.contains("is forgotten"), "{note}");
    let devices = taints(&ctx, &node).await?;
    let saved = std::fs::read_to_string(agent.dirs.state().join("health.json")).unwrap_or_default();
    match tainted {
        Some(before) => {
            // Read back: same taint, same timeAdded, the pool never republished, and saved again.
            ensure!(devices == [("gpu-0".into(), Vec::new()), ("gpu-1".into(), before)], "{devices:?}");
            ensure!(pool_generation(&ctx, &node).await? == generation, "the pool was republished meanwhile");
            ensure!(note.contains("were read back from this node's ResourceSlice taints"), "{note}");
            ensure!(saved.contains("ecc-double-bit"), "the fault read back was not saved: {saved}");
        }
        None => {
            ensure!(devices.iter().all(|(_, t)| t.is_empty()), "{devices:?}");
            ensure!(note.contains("carried no GPU fault taint"), "{note}");
        }
    }
    Ok(())
}

/// The Event about the Node `node` with `reason`, as (type, reason, note), once there is one.
async fn node_event(ctx: &TestContext, node: &str, reason: &str) -> anyhow::Result<(String, String, String)> {
    wait::until(&format!("a {reason} Event on the Node"), Duration::from_secs(10), || async {
        let events = objects::events_in(ctx, "default", node).await?;
        Ok(events.into_iter().find(|(_, r, _)| r == reason))
    })
    .await
}

/// The generation of the node's pool.
async fn pool_generation(ctx: &TestContext, node: &str) -> anyhow::Result<i64> {
    let selector = format!("spec.nodeName={node},spec.driver={DRIVER}");
    let slices = Api::<ResourceSlice>::all(ctx.client.clone()).list(&ListParams::default().fields(&selector)).await?;
    slices.items.iter().map(|s| s.spec.pool.generation).max().context("no slice published")
}

/// Events about the Node `node` (in `default`), as (type, reason, note), once there is one.
async fn node_events(ctx: &TestContext, node: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    wait::until("an Event about the node", Duration::from_secs(10), || async {
        let events = objects::events_in(ctx, "default", node).await?;
        Ok((!events.is_empty()).then_some(events))
    })
    .await
}

/// The kubelet keeps the health stream open for as long as the plugin serves. SIGTERM (a DaemonSet roll, `helm
/// uninstall`) must still end the agent at once and remove both sockets; a stream that never ends would make the
/// server's graceful shutdown wait until the kubelet kills the pod, leaving the sockets behind.
async fn an_open_health_stream_does_not_hold_up_the_agents_shutdown(ctx: TestContext) -> anyhow::Result<()> {
    use gpu_dra::kubelet_plugin::proto::v1 as health;
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let mut agent = NodeAgent::start(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"])?;
    let _kubelet = support::node::Kubelet::register(&agent.dirs).await?;
    let channel = gpu_dra::kubelet_plugin::socket::dial(&agent.dirs.dra_socket()).await?;
    let mut client = health::dra_resource_health_client::DraResourceHealthClient::new(channel);
    let mut stream = client.node_watch_resources(health::NodeWatchResourcesRequest {}).await?.into_inner();
    // The first report may name no device: nothing is said of a GPU before its health is watched.
    let mut first = stream.message().await?.context("the health stream ended at once")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while first.devices.is_empty() && Instant::now() < deadline {
        first = stream.message().await?.context("the health stream ended")?;
    }
    ensure!(!first.devices.is_empty(), "no health report named a device within 5 s: {first:?}");
    // Kubelets before v1 of the health API (1.34–1.36) dial v1alpha1, and 1.37 falls back to it: the same devices
    // and health there.
    let channel = gpu_dra::kubelet_plugin::socket::dial(&agent.dirs.dra_socket()).await?;
    let mut alpha =
        gpu_dra::kubelet_plugin::proto::v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel);
    let mut alpha_stream = alpha.node_watch_resources(health::NodeWatchResourcesRequest {}).await?.into_inner();
    let alpha_first = alpha_stream.message().await?.context("the v1alpha1 health stream ended at once")?;
    let states =
        |devices: &[health::DeviceHealth]| devices.iter().map(|d| (d.device.clone(), d.health)).collect::<Vec<_>>();
    ensure!(states(&alpha_first.devices) == states(&first.devices), "v1alpha1 {alpha_first:?} != v1 {first:?}");

    let started = Instant::now();
    let pid = agent.process.pid().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status()?;
    let mut exited = None;
    while exited.is_none() && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        exited = agent.process.try_wait()?;
    }
    let exited =
        exited.with_context(|| format!("an open health stream held up the shutdown:\n{}", agent.process.log_tail()))?;
    ensure!(exited.success(), "the agent exited with {exited} after SIGTERM");
    let (dra, registration) = (agent.dirs.dra_socket(), agent.dirs.registration_socket());
    ensure!(!dra.exists() && !registration.exists(), "sockets left after shutdown: {dra:?} {registration:?}");
    eprintln!("agent exited {:?} after SIGTERM with a health stream open", started.elapsed());
    Ok(())
}

/// An API server that vanished under an open connection (its machine off, its address black-holed behind the
/// `kubernetes` Service) answers nothing and resets nothing: kube's client has no read timeout in a cluster and no
/// TCP keepalive, so the request waits until the kernel gives up on the connection, up to 15 minutes. The publish
/// round a fault starts lists the node's slices first: a proxy holds that list unanswered. The request fails at the
/// agent's deadline (`--kube-api-timeout`, 3 s here), the connection is dropped, and the next round's list, on a new
/// connection, passes: the fault's taint is published. Before, the round waited for the answer for good, and no
/// fault of the node was published again.
async fn a_fault_during_a_request_the_api_server_never_answers_is_published_after_the_deadline(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = support::node::NodeDirs::new()?;
    let proxy = support::api_proxy::ApiProxy::start(ctx.cluster.client().await?).await?;
    let extra = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--kube-api-timeout", "3s"];
    let log_name = format!("{}-agent", ctx.namespace);
    let agent = support::node::start_agent_with(proxy.kubeconfig(), &log_name, &node, &dirs, &extra)?;
    agent.wait_ready().await?;
    wait_taints(&ctx, &node, "gpu-1", &[], Duration::from_secs(30)).await?;

    proxy.hold_next(http::Method::GET, "/resourceslices", 1);
    let faulted = Instant::now();
    inject(&dirs.state(), "gpu-1 ecc-dbe")?;
    wait::until("the round's list to be held", Duration::from_secs(10), || async {
        Ok((proxy.held() == 1).then_some(()))
    })
    .await?;
    let key = format!("{DRIVER}/needs-reset");
    let (_, _) =
        wait_taints(&ctx, &node, "gpu-1", &[&key], Duration::from_secs(20)).await.with_context(|| agent.log_tail())?;
    let took = faulted.elapsed();
    eprintln!("gpu-1 tainted {took:?} after the fault, its round's list held unanswered");
    ensure!(took >= Duration::from_secs(3), "published {took:?} after the fault: the list was not held");
    ensure!(agent.log_text().contains("no answer from the API server within 3s"), "{}", agent.log_tail());
    Ok(())
}
