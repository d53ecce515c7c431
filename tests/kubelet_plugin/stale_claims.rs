//! A kubelet that lost its record of what it prepared (its `dra_manager_state` deleted, the node re-provisioned with
//! the agent's state directory kept) never unprepares those claims: here the test plays that kubelet by preparing
//! claims and never unpreparing them. The agent checks its prepared claims against the API (every second here) and
//! unprepares one the API no longer allocates what was prepared, once two checks an interval apart found it so
//! while the Node was Ready; before, its GPU was refused to every later claim until the node rebooted.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use super::support::node::{Kubelet, NodeDirs};
use super::support::process::Component;
use super::support::{TestContext, objects, wait};
use super::{allocated_claim, checkpoint, gpu_result, node_name, prepares_fully, ready_agent_with, reallocate};

const CHECK_EVERY: &str = "1s";

async fn agent(ctx: &TestContext, node: &str, dirs: &NodeDirs, action: &str) -> anyhow::Result<Component> {
    let checks = ["--stale-claim-check-interval", CHECK_EVERY, "--stale-claims", action];
    ready_agent_with(ctx, node, dirs, "2xH100-80GB", &checks).await
}

async fn set_ready(ctx: &TestContext, node: &str, ready: bool) -> anyhow::Result<()> {
    let status = if ready { "True" } else { "False" };
    let patch = json!({"status": {"conditions": [{"type": "Ready", "status": status, "reason": "Test"}]}});
    Api::<Node>::all(ctx.client.clone()).patch_status(node, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(())
}

/// A Warning event on `node` with `reason`, once it is there.
async fn node_event(ctx: &TestContext, node: &str, reason: &str) -> anyhow::Result<String> {
    let events: Api<Event> = Api::namespaced(ctx.client.clone(), "default");
    wait::until(&format!("a {reason} event on the Node"), Duration::from_secs(20), || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list.items.into_iter().find_map(|e| {
            let on_node = e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node);
            (on_node && e.reason.as_deref() == Some(reason) && e.type_.as_deref() == Some("Warning")).then_some(e.note?)
        }))
    })
    .await
}

pub(super) async fn a_claim_the_kubelet_forgot_is_unprepared_once_the_api_has_it_no_more(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = agent(&ctx, &node, &dirs, "unprepare").await?;
    let ns = ctx.namespace.as_str();
    let kept = allocated_claim(&ctx, "kept", &node, &["gpu-0"], json!([])).await?;
    let forgotten = allocated_claim(&ctx, "forgotten", &node, &["gpu-1"], json!([])).await?;
    prepares_fully(&dirs, ns, "kept", &kept, "gpu-0").await?;
    prepares_fully(&dirs, ns, "forgotten", &forgotten, "gpu-1").await?;

    // Its pod force-deleted and the claim with it while the Node is not Ready: nothing is done (the kubelet may be
    // down, with the pod's containers still running).
    set_ready(&ctx, &node, false).await?;
    objects::claims(&ctx).delete("forgotten", &DeleteParams::default()).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    ensure!(dirs.cdi_spec(&forgotten).exists(), "unprepared while the Node was not Ready");

    set_ready(&ctx, &node, true).await?;
    wait::until("the forgotten claim to be unprepared", Duration::from_secs(30), || async {
        Ok((!dirs.cdi_spec(&forgotten).exists()).then_some(()))
    })
    .await?;
    let note = node_event(&ctx, &node, "StaleClaimUnprepared").await?;
    ensure!(note.contains(&format!("{ns}/forgotten")) && note.contains("gpu-1") && note.contains("deleted"), "{note}");
    ensure!(agent.metric("gpu_dra_kubelet_plugin_stale_claims_unprepared_total", &[]).await? == 1.0, "metric");
    let state = checkpoint(&dirs, "boot-1")?;
    ensure!(!state.claims.contains_key(&forgotten) && state.claims.contains_key(&kept), "{:?}", state.claims);
    ensure!(!dirs.state().join("device-metadata").join(&forgotten).exists(), "its device metadata stayed");

    // Its GPU serves the next claim; the claim still allocated stays prepared through many checks.
    let next = allocated_claim(&ctx, "next", &node, &["gpu-1"], json!([])).await?;
    prepares_fully(&dirs, ns, "next", &next, "gpu-1").await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    ensure!(dirs.cdi_spec(&kept).exists() && dirs.cdi_spec(&next).exists(), "a claim in use was unprepared");
    let unprepared = Kubelet::register(&dirs).await?.unprepare(&[(ns, "next", &next), (ns, "kept", &kept)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    Ok(())
}

pub(super) async fn with_warn_a_forgotten_claim_is_reported_and_kept(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = agent(&ctx, &node, &dirs, "warn").await?;
    let ns = ctx.namespace.as_str();
    let forgotten = allocated_claim(&ctx, "forgotten", &node, &["gpu-0"], json!([])).await?;
    prepares_fully(&dirs, ns, "forgotten", &forgotten, "gpu-0").await?;
    // Deallocated (its pods done) without the kubelet unpreparing it.
    let status = json!({"status": {"allocation": null, "reservedFor": null}});
    objects::claims(&ctx).patch_status("forgotten", &PatchParams::default(), &Patch::Merge(&status)).await?;
    let note = node_event(&ctx, &node, "StaleClaimPrepared").await?;
    ensure!(note.contains("no longer allocated") && note.contains("gpu-0"), "{note}");
    ensure!(agent.metric("gpu_dra_kubelet_plugin_stale_claims", &[]).await? == 1.0, "gauge");
    // Nothing is checked while the Node is not Ready: the gauge says no claim is stale, not what a check before said;
    // once Ready, two checks later, it is said again.
    for (ready, want) in [(false, 0.0), (true, 1.0)] {
        set_ready(&ctx, &node, ready).await?;
        wait::until("the stale claims gauge to follow the Node", Duration::from_secs(15), || async {
            Ok((agent.metric("gpu_dra_kubelet_plugin_stale_claims", &[]).await? == want).then_some(()))
        })
        .await
        .with_context(|| format!("Node Ready {ready}"))?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(dirs.cdi_spec(&forgotten).exists(), "unprepared with --stale-claims=warn");
    ensure!(agent.metric("gpu_dra_kubelet_plugin_stale_claims_unprepared_total", &[]).await? == 0.0, "counter");

    // Allocated again, another GPU, while still forgotten: its prepare is refused, not answered with the old GPU.
    reallocate(&ctx, "forgotten", vec![gpu_result(&node, "gpu-1")], ("again", &format!("{forgotten}-again"))).await?;
    let answers = Kubelet::register(&dirs).await?.prepare(&[(ns, "forgotten", &forgotten)]).await?;
    let answer = answers.get(&forgotten).context("no answer")?;
    ensure!(
        answer.devices.is_empty() && answer.error.contains("now allocated") && answer.error.contains("gpu-0"),
        "{answer:?}"
    );
    Ok(())
}

/// A stale claim of many devices (32 static MIG devices of a big node, as a monitoring or training claim holds) with
/// a long name: the Warning that reports it, listing them all, is longer than the 1,024 bytes the API takes for a
/// note, and is sent cut to them, naming the claim. Before, the API server refused it, and the warning, sent once
/// per stale claim, was lost.
pub(super) async fn a_stale_claim_of_many_devices_is_reported_within_the_note_limit(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let sevenths = ["1g.10gb"; 7].join("+");
    let checks = ["--stale-claim-check-interval", CHECK_EVERY, "--stale-claims", "warn"];
    let _agent = ready_agent_with(&ctx, &node, &dirs, &format!("8xH100-80GB/mig={sevenths}"), &checks).await?;
    let devices: Vec<String> = (0..32).map(|i| format!("gpu-{}-mig-19-{}-1", i / 7, i % 7)).collect();
    let devices: Vec<&str> = devices.iter().map(String::as_str).collect();
    let name = ["a".repeat(62), "b".repeat(62), "c".repeat(62), "d".repeat(50)].join(".");
    let uid = allocated_claim(&ctx, &name, &node, &devices, json!([])).await?;
    let ns = ctx.namespace.as_str();
    let answers = Kubelet::register(&dirs).await?.prepare(&[(ns, &name, &uid)]).await?;
    ensure!(answers.values().all(|a| a.error.is_empty() && a.devices.len() == 32), "{answers:?}");
    let status = json!({"status": {"allocation": null, "reservedFor": null}});
    objects::claims(&ctx).patch_status(&name, &PatchParams::default(), &Patch::Merge(&status)).await?;
    let note = node_event(&ctx, &node, "StaleClaimPrepared").await?;
    ensure!(note.len() <= 1024 && note.ends_with('…') && note.contains(&format!("{ns}/{name}")), "{note}");
    Ok(())
}

/// A pod bound to `node` naming `claim`, with no kubelet to run it (its phase is what the test writes); its UID.
async fn pod_naming(ctx: &TestContext, name: &str, node: &str, claim: &str) -> anyhow::Result<String> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": node, "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                 "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                                 "resources": {"claims": [{"name": "gpu"}]}}]}
    }))?;
    let created = objects::pods(ctx).create(&PostParams::default(), &pod).await?;
    created.metadata.uid.context("created pod has no UID")
}

async fn unprepared(dirs: &NodeDirs, uid: &str, what: &str) -> anyhow::Result<()> {
    wait::until(what, Duration::from_secs(30), || async { Ok((!dirs.cdi_spec(uid).exists()).then_some(())) }).await
}

/// A tenant who may edit claims (the built-in `edit` role) removes the allocation's finalizer and deletes a claim
/// while its pod runs: the claim is gone at once and its GPU free for the scheduler to give to another claim, but
/// the pod's container still holds it. With `unprepare` the agent freed it once two checks had found the claim
/// deleted, for the next claim of another tenant to be handed the GPU in use; now it is kept prepared while a pod on
/// the node that is not done names it, and unprepared once that pod is done. A claim allocated other devices, or
/// deleted and created again for another pod, is still freed while the pod waiting for it names it.
pub(super) async fn a_claim_deleted_while_its_pod_runs_is_kept_until_the_pod_is_done(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let _agent = agent(&ctx, &node, &dirs, "unprepare").await?;
    let ns = ctx.namespace.as_str();

    // Deallocated and allocated other devices while forgotten (the scheduler's doing): the pod waiting for them names
    // the claim, and the old prepare must go for its own to be done.
    let moved = allocated_claim(&ctx, "moved", &node, &["gpu-1"], json!([])).await?;
    prepares_fully(&dirs, ns, "moved", &moved, "gpu-1").await?;
    let waiting = pod_naming(&ctx, "waiting", &node, "moved").await?;
    reallocate(&ctx, "moved", vec![gpu_result(&node, "gpu-0")], ("waiting", &waiting)).await?;
    unprepared(&dirs, &moved, "the claim allocated other devices to be unprepared").await?;
    // Deleted and created again under its name for another pod: that pod names the new claim.
    let again = allocated_claim(&ctx, "again", &node, &["gpu-1"], json!([])).await?;
    prepares_fully(&dirs, ns, "again", &again, "gpu-1").await?;
    objects::claims(&ctx).delete("again", &DeleteParams::default()).await?;
    allocated_claim(&ctx, "again", &node, &["gpu-1"], json!([])).await?;
    let next = pod_naming(&ctx, "next", &node, "again").await?;
    reallocate(&ctx, "again", vec![gpu_result(&node, "gpu-1")], ("next", &next)).await?;
    unprepared(&dirs, &again, "the claim created again for another pod to be unprepared").await?;

    let held = allocated_claim(&ctx, "held", &node, &["gpu-0"], json!([])).await?;
    let finalizer = json!({"metadata": {"finalizers": ["resource.kubernetes.io/delete-protection"]}});
    objects::claims(&ctx).patch("held", &PatchParams::default(), &Patch::Merge(&finalizer)).await?;
    prepares_fully(&dirs, ns, "held", &held, "gpu-0").await?;
    pod_naming(&ctx, "user", &node, "held").await?;
    objects::set_phase(&ctx, "user", "Running").await?;

    let unprotected = json!({"metadata": {"finalizers": null}});
    objects::claims(&ctx).patch("held", &PatchParams::default(), &Patch::Merge(&unprotected)).await?;
    objects::claims(&ctx).delete("held", &DeleteParams::default()).await?;
    let note = node_event(&ctx, &node, "StaleClaimPrepared").await?;
    ensure!(note.contains(&format!("{ns}/user")) && note.contains("deleted"), "{note}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(dirs.cdi_spec(&held).exists(), "unprepared while its pod runs");

    objects::set_phase(&ctx, "user", "Succeeded").await?;
    unprepared(&dirs, &held, "the claim to be unprepared once its pod is done").await
}
