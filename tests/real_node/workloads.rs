//! A StatefulSet of GPU workers on the real node, through what a cluster does to it over its life: a replica
//! replaced under its own name (deleted, then force-deleted on a full node), the node drained for maintenance and
//! uncordoned, the namespace deleted.

use std::collections::BTreeSet;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, EvictParams, PostParams};
use serde_json::json;

use super::support::real_node::RealNode;
use super::support::{self, TestContext, objects, wait};
use super::{SHOW_GPUS, Seen, WAIT, allocated, claim_of, claim_uid, install, on_gpu_node, seen_by, specs_of};

const REPLICAS: [&str; 2] = ["web-0", "web-1"];

/// Two replicas, each with a GPU of its own from a template, in a namespace of their own:
/// - `web-0` deleted comes back under its name with a new UID: a new claim (never the old pod's), the old claim
///   and its CDI spec gone, and the container sees the GPU it was allocated; force-deleted on a full node, the new
///   one gets the same GPU once the old container is stopped, and no GPU is ever in two CDI specs;
/// - the node drained as `kubectl drain --pod-selector` does (cordoned, each replica evicted through the Eviction
///   API): the replicas come back Pending, with claims of their own but no allocation, while every claim of the
///   evicted ones and its CDI spec go; uncordoned, they run again with their GPUs;
/// - the namespace deleted with the replicas running: gone, no CDI spec or claim left behind.
pub(super) async fn a_statefulset_lives_through_a_replaced_replica_a_drain_and_its_namespace_deletion(
    ctx: TestContext,
) -> anyhow::Result<()> {
    on_gpu_node(&ctx, "sts-node", async |node| {
        install(&ctx, node)?;
        let namespace = support::create_namespace(&ctx.client, "training").await?;
        let training = TestContext { namespace: namespace.clone(), ..ctx.clone() };
        let result = lifecycle(&training, node).await;
        if result.is_err() {
            // Before the chart goes: its controller releases the claims a namespace deletion waits for, and its
            // pods must be gone while the kubelet still runs.
            let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
            let _ = namespaces.delete(&namespace, &DeleteParams::default()).await;
            let _ = wait::until("the failed test's namespace to be gone", WAIT, || async {
                Ok(namespaces.get_opt(&namespace).await?.is_none().then_some(()))
            })
            .await;
        }
        result
    })
    .await
}

async fn lifecycle(ctx: &TestContext, node: &RealNode) -> anyhow::Result<()> {
    let n = node.name.as_str();
    let one_gpu = json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.gpu-dra.dev"}}]}}});
    objects::create_template_in(&ctx.client, &ctx.namespace, "one-gpu", one_gpu).await?;
    let set: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": REPLICAS.len(), "serviceName": "web", "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                     "nodeSelector": {"kubernetes.io/hostname": n}, "terminationGracePeriodSeconds": 1,
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                     "containers": [{"name": "main", "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", SHOW_GPUS], "resources": {"claims": [{"name": "gpu"}]}}]}}}
    }))?;
    Api::<StatefulSet>::namespaced(ctx.client.clone(), &ctx.namespace).create(&PostParams::default(), &set).await?;
    let pods = objects::pods(ctx);
    let mut claims = Vec::new();
    for pod in REPLICAS {
        wait::until(&format!("the StatefulSet to create {pod}"), WAIT, || async {
            Ok(pods.get_opt(pod).await?.map(drop))
        })
        .await?;
        claims.push(running_with_its_gpu(ctx, n, pod).await?.0);
    }

    // web-0 replaced under its name.
    let old_uid = pods.get("web-0").await?.metadata.uid.context("web-0 without uid")?;
    let old_claim_uid = claim_uid(ctx, &claims[0]).await?;
    pods.delete("web-0", &DeleteParams::default()).await?;
    wait::until("web-0 back under its name", WAIT, || async {
        let pod = pods.get_opt("web-0").await?;
        Ok(pod.filter(|p| p.metadata.uid.as_deref() != Some(old_uid.as_str())).map(drop))
    })
    .await?;
    let (claim, seen) = running_with_its_gpu(ctx, n, "web-0").await?;
    ensure!(claim != claims[0], "the new web-0 was given the old pod's claim {claim}");
    gone(ctx, node, &claims[..1], &[old_claim_uid]).await?;
    eprintln!("web-0 replaced: claim {} → {claim}, sees {:?}", claims[0], seen.uuids);
    claims[0] = force_deleted_replica_waits_for_its_gpu(ctx, node, &claim).await?;

    // The node drained and uncordoned.
    let uids = [claim_uid(ctx, &claims[0]).await?, claim_uid(ctx, &claims[1]).await?];
    let evicted: Vec<String> = {
        let mut uids = Vec::new();
        for pod in REPLICAS {
            uids.push(pods.get(pod).await?.metadata.uid.context("pod without uid")?);
        }
        uids
    };
    objects::cordon(&ctx.client, n, true).await?;
    for pod in REPLICAS {
        pods.evict(pod, &EvictParams::default()).await.with_context(|| format!("evict {pod}"))?;
    }
    for pod in REPLICAS {
        let why = wait::until(&format!("{pod} back and unschedulable"), WAIT, || async {
            let Some(pod) = pods.get_opt(pod).await? else { return Ok(None) };
            if pod.metadata.uid.as_ref().is_none_or(|uid| evicted.contains(uid)) {
                return Ok(None);
            }
            Ok(objects::unschedulable_message(&pod))
        })
        .await?;
        ensure!(why.contains("unschedulable"), "{pod} pending for another reason: {why}");
        let claim = claim_of(ctx, pod).await?;
        let allocation = objects::claims(ctx).get(&claim).await?.status.and_then(|s| s.allocation);
        ensure!(allocation.is_none(), "{pod} is not scheduled, yet its claim {claim} has {allocation:?}");
    }
    gone(ctx, node, &claims, &uids).await?;
    objects::cordon(&ctx.client, n, false).await?;
    let mut after = BTreeSet::new();
    for (i, pod) in REPLICAS.iter().enumerate() {
        let (claim, seen) = running_with_its_gpu(ctx, n, pod).await?;
        ensure!(claim != claims[i], "{pod} came back with the evicted pod's claim {claim}");
        ensure!(after.insert(seen.uuids.clone()), "two replicas share {:?}", seen.uuids);
        claims[i] = claim;
    }
    eprintln!("drained and uncordoned: the replicas run again with claims {claims:?}");

    // The namespace deleted with the replicas running.
    let uids = [claim_uid(ctx, &claims[0]).await?, claim_uid(ctx, &claims[1]).await?];
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    namespaces.delete(&ctx.namespace, &DeleteParams::default()).await?;
    let deleted = wait::until("the namespace to be gone", WAIT, || async {
        Ok(namespaces.get_opt(&ctx.namespace).await?.is_none().then_some(()))
    })
    .await;
    if let Err(err) = deleted {
        let left = namespaces.get_opt(&ctx.namespace).await?.and_then(|n| n.status).and_then(|s| s.conditions);
        return Err(err.context(format!("namespace conditions {left:?}")));
    }
    for uid in &uids {
        ensure!(specs_of(node, uid)?.is_empty(), "the CDI spec of claim {uid} outlived its namespace");
    }
    Ok(())
}

/// `kubectl delete pod web-0 --grace-period=0 --force` (the documented way out for a replica stuck on a failed node)
/// on a full node: the object goes at once, so its claim is released and deallocated at once and the new `web-0`
/// is scheduled onto the same GPU while the kubelet is still stopping the old container (about 2 s: the kubelet's
/// least grace period for a force-deleted pod). The agent refuses to prepare the new claim while the old one holds
/// the GPU, and the kubelet's retry prepares it once the old one is unprepared: no GPU is in two CDI specs (sampled
/// every ~200 ms), and the new `web-0` runs on the GPU the old one had. Whether the new pod's prepare comes before
/// the old unprepare depends on the scheduler's and the kubelet's timing, so the force delete is repeated (up to
/// [`FORCE_DELETE_TRIES`] times) until one new `web-0` was refused at least once. Returns the last new claim.
async fn force_deleted_replica_waits_for_its_gpu(
    ctx: &TestContext,
    node: &RealNode,
    claim: &str,
) -> anyhow::Result<String> {
    let n = node.name.as_str();
    let pods = objects::pods(ctx);
    let had = allocated(ctx, n, claim).await?;
    // The node's two other GPUs taken, so the new web-0 can only get the one the old web-0 holds.
    let filler = json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.gpu-dra.dev", "count": super::GPUS - REPLICAS.len()}}]}}});
    objects::create_template_in(&ctx.client, &ctx.namespace, "filler", filler).await?;
    let filler: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "filler"},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": n}, "terminationGracePeriodSeconds": 1,
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "filler"}],
                 "containers": [{"name": "main", "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", SHOW_GPUS], "resources": {"claims": [{"name": "gpu"}]}}]}
    }))?;
    pods.create(&PostParams::default(), &filler).await?;
    seen_by(ctx, "filler").await?;

    let mut claim = claim.to_string();
    for attempt in 1..=FORCE_DELETE_TRIES {
        let old_uid = pods.get("web-0").await?.metadata.uid.context("web-0 without uid")?;
        let old_claim_uid = claim_uid(ctx, &claim).await?;
        pods.delete("web-0", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() }).await?;
        let overlap = wait::until("the force-deleted web-0 back under its name and running", WAIT, || async {
            if let Some(minor) = support::node::gpu_in_two_specs(&node.cdi_dir()?)? {
                return Ok(Some(Err(minor)));
            }
            let Some(pod) = pods.get_opt("web-0").await? else { return Ok(None) };
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            Ok((uid != old_uid && running).then_some(Ok(uid)))
        })
        .await?;
        let new_uid = match overlap {
            Ok(uid) => uid,
            Err(minor) => anyhow::bail!("/dev/nvidia{minor} was in two claims' CDI specs at once"),
        };
        let (new_claim, seen) = running_with_its_gpu(ctx, n, "web-0").await?;
        ensure!(new_claim != claim, "the new web-0 was given the force-deleted pod's claim {claim}");
        ensure!(seen == had, "the node is full: the new web-0 should have the freed {had:?}, it sees {seen:?}");
        gone(ctx, node, std::slice::from_ref(&claim), &[old_claim_uid]).await?;
        let refused = refused_prepares(ctx, &new_uid).await?;
        eprintln!("web-0 force-deleted (try {attempt}): claim {claim} → {new_claim}, {refused} refused prepares");
        claim = new_claim;
        if refused > 0 {
            pods.delete("filler", &DeleteParams::default()).await?;
            wait::until("the filler to be gone", WAIT, || async {
                Ok(pods.get_opt("filler").await?.is_none().then_some(()))
            })
            .await?;
            return Ok(claim);
        }
    }
    anyhow::bail!(
        "in {FORCE_DELETE_TRIES} force deletes the new web-0 was never prepared before the old one was unprepared: \
         the agent's refusal was not exercised"
    )
}

/// How many times [`force_deleted_replica_waits_for_its_gpu`] force-deletes `web-0` to see a prepare refused.
const FORCE_DELETE_TRIES: usize = 4;

/// The kubelet's `FailedPrepareDynamicResources` Events about the pod with `uid`.
async fn refused_prepares(ctx: &TestContext, uid: &str) -> anyhow::Result<usize> {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.uid.as_deref()) == Some(uid))
        .filter(|e| e.reason.as_deref() == Some("FailedPrepareDynamicResources"))
        .map(|e| e.series.as_ref().map_or(1, |s| usize::try_from(s.count).unwrap_or(1)))
        .sum())
}

/// Waits until `pod` runs and has listed its devices; checks that it sees exactly what its claim was allocated and
/// returns (claim, what it sees).
async fn running_with_its_gpu(ctx: &TestContext, node: &str, pod: &str) -> anyhow::Result<(String, Seen)> {
    let claim = claim_of(ctx, pod).await?;
    let seen = seen_by(ctx, pod).await?;
    let want = allocated(ctx, node, &claim).await?;
    ensure!(seen == want && seen.minors.len() == 1, "{pod} sees {seen:?}; its claim {claim} was allocated {want:?}");
    Ok((claim, seen))
}

/// Waits until the claims `names` and the CDI specs of the claims with `uids` are gone.
async fn gone(ctx: &TestContext, node: &RealNode, names: &[String], uids: &[String]) -> anyhow::Result<()> {
    wait::until(&format!("claims {names:?} and their CDI specs to go"), WAIT, || async {
        for name in names {
            if objects::claims(ctx).get_opt(name).await?.is_some() {
                return Ok(None);
            }
        }
        for uid in uids {
            if !specs_of(node, uid)?.is_empty() {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await
}
