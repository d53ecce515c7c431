//! What clusters do to GPU pods besides creating and deleting them, through the whole pipeline: a StatefulSet
//! replica replaced under its own name, a Deployment rolled on a full node, a node drained with the Eviction API, a
//! namespace deleted with everything in it, a high-priority pod finding the GPUs taken. The workload controllers are
//! kube-controller-manager's own (statefulset, deployment, replicaset, disruption, namespace); the nodes' kubelet
//! side is the kubelet's DRA code (the harness).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::support::{TestContext, objects, wait};
use super::{PREPARE_TIMEOUT, Testbed, allocated, claim_of, pod_using};

/// A StatefulSet replica deleted (`kubectl delete pod web-0`, a failed node) comes back under the same name with a
/// new UID. Its old claim belongs to the old pod: the controller must not adopt it but give the new pod a claim of
/// its own, and the old one must be deleted (by the controller, as kube-controller-manager's does once the pod is
/// replaced, or by the garbage collector once its owner is gone), so its GPUs come free. The node is full (two
/// replicas of two H100s on a node of four), so the new replica starts only once they do, and it gets exactly those
/// GPUs. The other replica keeps its claim, prepared once. Scaled to zero, every claim and CDI spec goes.
pub(super) async fn a_statefulset_replica_replaced_under_its_name_gets_a_new_claim_and_the_freed_gpus(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "pair", 2).await?;
    let node = bed.nodes[1].name.clone();
    let template = bed.pod_on(&ctx, "web", &node, "pair")?;
    let set: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 2, "serviceName": "web", "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}}, "spec": template.spec}}
    }))?;
    let sets: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    sets.create(&PostParams::default(), &set).await?;
    let pods = objects::pods(&ctx);
    for pod in ["web-0", "web-1"] {
        wait::until(&format!("the StatefulSet to create {pod}"), PREPARE_TIMEOUT, || async {
            Ok(pods.get_opt(pod).await?.map(drop))
        })
        .await?;
        bed.prepared(&ctx, pod).await?;
    }
    let old_uid = pods.get("web-0").await?.metadata.uid.context("web-0 without uid")?;
    let (old_claim, kept_claim) = (claim_of(&ctx, "web-0", "gpus").await?, claim_of(&ctx, "web-1", "gpus").await?);
    let freed = allocated(&ctx, &old_claim).await?;

    pods.delete("web-0", &DeleteParams::default()).await?;
    let (new_uid, new_claim) = wait::until("web-0 back under its name with a claim", PREPARE_TIMEOUT, || async {
        let Some(pod) = pods.get_opt("web-0").await? else { return Ok(None) };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let claim = objects::claim_statuses(&pod).into_iter().find(|(n, _)| n == "gpus").and_then(|(_, c)| c);
        Ok(claim.filter(|_| uid != old_uid).map(|c| (uid, c)))
    })
    .await?;
    ensure!(new_claim != old_claim, "the new web-0 was given the old pod's claim {old_claim}");
    let kubelet = &bed.node(&node)?.kubelet;
    let key = |pod: &str| format!("{}/{pod}", ctx.namespace);
    let prepared = wait::until("the new web-0 to be prepared", PREPARE_TIMEOUT, || async {
        let count = kubelet.count("prepared", &key("web-0"));
        Ok((count >= 2).then_some(count))
    })
    .await?;
    ensure!(prepared == 2, "web-0 under its two UIDs was prepared {prepared} times");
    wait::until("the old web-0's claim to be deleted", PREPARE_TIMEOUT, || async {
        Ok(objects::claims(&ctx).get_opt(&old_claim).await?.is_none().then_some(()))
    })
    .await?;
    let claim = objects::claims(&ctx).get(&new_claim).await?;
    let owners = claim.metadata.owner_references.unwrap_or_default();
    ensure!(
        owners.len() == 1 && owners[0].uid == new_uid && owners[0].controller == Some(true),
        "the new claim's owners {owners:?}, the new pod's uid {new_uid}"
    );
    let got = allocated(&ctx, &new_claim).await?;
    ensure!(got == freed, "the node is full: the new web-0 should get the freed {freed:?}, got {got:?}");
    ensure!(claim_of(&ctx, "web-1", "gpus").await? == kept_claim, "web-1's claim changed");
    let (prepared, unprepared) = (kubelet.count("prepared", &key("web-1")), kubelet.count("unprepared", &key("web-1")));
    ensure!(prepared == 1 && unprepared == 0, "web-1 prepared {prepared}, unprepared {unprepared} times");
    eprintln!("web-0 replaced ({old_uid} → {new_uid}): claim {old_claim} deleted, {new_claim} got its GPUs {got:?}");

    sets.patch("web", &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 0}}))).await?;
    let dirs = &bed.node(&node)?.dirs;
    wait::until("no claims and no CDI specs once scaled to zero", PREPARE_TIMEOUT, || async {
        let gone = objects::list_claims(&ctx).await?.is_empty() && dirs.cdi_specs()?.is_empty();
        Ok(gone.then_some(()))
    })
    .await
}

/// `kubectl drain`: the node is cordoned and each of its pods evicted through the Eviction API, which keeps to the
/// Deployment's PodDisruptionBudget (one replica down at most: a refused eviction is retried, as `kubectl drain`
/// does). The evicted replicas come back on the other node with claims of their own; the drained node's kubelet
/// unprepares the old ones, whose claims and CDI specs go.
pub(super) async fn draining_a_node_moves_its_gpu_replicas_and_frees_their_gpus(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let (drained, other) = (bed.nodes[0].name.clone(), bed.nodes[1].name.clone());
    objects::cordon(&ctx.client, &other, true).await?;
    let template = bed.pod(
        &ctx,
        "trainer",
        json!([{"name": "gpus", "resourceClaimTemplateName": "one-h100"}]),
        &[("app", &["gpus"])],
    )?;
    bed.deploy(&ctx, template, 2, Value::Null).await?;
    let budget: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "trainers"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "trainer"}}}
    }))?;
    Api::<PodDisruptionBudget>::namespaced(ctx.client.clone(), &ctx.namespace)
        .create(&PostParams::default(), &budget)
        .await?;
    let before = replicas(&ctx, &bed, 2, &BTreeSet::new()).await?;
    let mut old_claims = BTreeSet::new();
    for (pod, node) in &before {
        ensure!(*node == drained, "{pod} ran on {node} while it was cordoned");
        old_claims.insert(claim_of(&ctx, pod, "gpus").await?);
    }

    objects::cordon(&ctx.client, &other, false).await?;
    objects::cordon(&ctx.client, &drained, true).await?;
    let pods = objects::pods(&ctx);
    let mut refused = 0;
    for (pod, _) in &before {
        refused += evict(&pods, pod).await?;
    }
    let old: BTreeSet<String> = before.into_iter().map(|(pod, _)| pod).collect();
    let after = replicas(&ctx, &bed, 2, &old).await?;
    for (pod, node) in &after {
        ensure!(*node == other, "{pod} came back on {node}, not on the uncordoned {other}");
        let claim = claim_of(&ctx, pod, "gpus").await?;
        ensure!(!old_claims.contains(&claim), "{pod} was given an evicted pod's claim {claim}");
        let devices = allocated(&ctx, &claim).await?;
        ensure!(devices.len() == 1 && devices.iter().all(|(pool, _)| *pool == other), "{pod}: {devices:?}");
    }
    eprintln!(
        "drained {drained}: {old:?} evicted ({refused} evictions refused by the budget), {after:?} took their place"
    );
    let node = bed.node(&drained)?;
    for pod in &old {
        node.kubelet.wait_for("unprepared", &format!("{}/{pod}", ctx.namespace), PREPARE_TIMEOUT).await?;
    }
    wait::until("the evicted pods' claims and CDI specs to go", PREPARE_TIMEOUT, || async {
        let claims: BTreeSet<String> =
            objects::list_claims(&ctx).await?.into_iter().filter_map(|c| c.metadata.name).collect();
        Ok((claims.is_disjoint(&old_claims) && node.dirs.cdi_specs()?.is_empty()).then_some(()))
    })
    .await
}

/// A Deployment rolled to a new template on a full node, the way GPU Deployments roll (`maxSurge: 0`,
/// `maxUnavailable: 1`: no GPU is spare for a surge pod): each old replica's claim is deleted and its GPUs go to a
/// new replica, until only the new replicas and their claims are left, holding all of the node's GPUs.
pub(super) async fn a_rolling_update_on_a_full_node_hands_the_old_replicas_gpus_to_the_new_ones(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "pair", 2).await?;
    let node = bed.nodes[1].name.clone();
    let template = bed.pod_on(&ctx, "trainer", &node, "pair")?;
    let strategy = json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}});
    let deployments = bed.deploy(&ctx, template, 2, strategy).await?;
    let before = replicas(&ctx, &bed, 2, &BTreeSet::new()).await?;
    let (mut old_claims, mut gpus) = (BTreeSet::new(), BTreeSet::new());
    for (pod, _) in &before {
        let claim = claim_of(&ctx, pod, "gpus").await?;
        gpus.extend(allocated(&ctx, &claim).await?);
        old_claims.insert(claim);
    }
    ensure!(gpus.len() == 4, "two replicas of two H100s should fill the node: {gpus:?}");

    let roll = json!({"spec": {"template": {"metadata": {"annotations": {"e2e.gpu-dra.dev/revision": "2"}}}}});
    deployments.patch("trainers", &PatchParams::default(), &Patch::Merge(&roll)).await?;
    let old: BTreeSet<String> = before.into_iter().map(|(pod, _)| pod).collect();
    let after = replicas(&ctx, &bed, 2, &old).await?;
    let (mut new_claims, mut handed_on) = (BTreeSet::new(), BTreeSet::new());
    let kubelet = &bed.node(&node)?.kubelet;
    for (pod, _) in &after {
        let claim = claim_of(&ctx, pod, "gpus").await?;
        ensure!(!old_claims.contains(&claim), "{pod} was given an old replica's claim {claim}");
        handed_on.extend(allocated(&ctx, &claim).await?);
        new_claims.insert(claim);
        let key = format!("{}/{pod}", ctx.namespace);
        ensure!(kubelet.count("prepared", &key) == 1, "{key} prepared {} times", kubelet.count("prepared", &key));
    }
    ensure!(handed_on == gpus, "the new replicas hold {handed_on:?}, the node's GPUs are {gpus:?}");
    let dirs = &bed.node(&node)?.dirs;
    wait::until("only the new replicas' claims and CDI specs", PREPARE_TIMEOUT, || async {
        let claims: BTreeSet<String> =
            objects::list_claims(&ctx).await?.into_iter().filter_map(|c| c.metadata.name).collect();
        Ok((claims == new_claims && dirs.cdi_specs()?.len() == 2).then_some(()))
    })
    .await?;
    eprintln!("rolled: {old:?} → {after:?}, claims {old_claims:?} → {new_claims:?}");
    Ok(())
}

/// `kubectl delete namespace` with GPU pods running in it, one with a template claim and two sharing a claim of
/// their own: the namespace controller deletes everything at once, claims before their pods are gone. The claims
/// wait for their pods (the scheduler's delete-protection finalizer) and the controller releases and deallocates
/// them once the pods are gone: the namespace is gone soon after, with no claim stuck, and the kubelet unprepares
/// each pod once, leaving no CDI spec.
pub(super) async fn deleting_a_namespace_with_running_gpu_pods_leaves_nothing(ctx: TestContext) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let node = bed.nodes[1].name.clone();
    let claim: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "shared"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": bed.class}}]}}
    }))?;
    objects::claims(&ctx).create(&PostParams::default(), &claim).await?;
    let pods = objects::pods(&ctx);
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "trainer", &node, "one-h100")?).await?;
    for name in ["user-1", "user-2"] {
        pods.create(&PostParams::default(), &pod_using(name, &node, "shared")?).await?;
    }
    for pod in ["trainer", "user-1", "user-2"] {
        bed.prepared(&ctx, pod).await?;
    }
    let dirs = &bed.node(&node)?.dirs;
    ensure!(dirs.cdi_specs()?.len() == 2, "specs before the deletion: {:?}", dirs.cdi_specs()?);

    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    namespaces.delete(&ctx.namespace, &DeleteParams::default()).await?;
    let gone = wait::until("the namespace to be gone", Duration::from_secs(90), || async {
        Ok(namespaces.get_opt(&ctx.namespace).await?.is_none().then_some(()))
    })
    .await;
    if let Err(err) = gone {
        let left = namespaces.get_opt(&ctx.namespace).await?.and_then(|n| n.status).and_then(|s| s.conditions);
        let claims: Vec<_> = objects::list_claims(&ctx)
            .await?
            .into_iter()
            .map(|c| (c.metadata.name, c.metadata.finalizers, c.status.map(|s| s.reserved_for)))
            .collect();
        return Err(err.context(format!("namespace conditions {left:?}; claims left {claims:?}")));
    }
    // With a grace period of 0 the pods leave the API before the kubelet has stopped them; it unprepares after.
    let kubelet = &bed.node(&node)?.kubelet;
    let keys: Vec<String> = ["trainer", "user-1", "user-2"].iter().map(|p| format!("{}/{p}", ctx.namespace)).collect();
    wait::until("every pod unprepared and no CDI spec left", PREPARE_TIMEOUT, || async {
        let unprepared = keys.iter().all(|k| kubelet.count("unprepared", k) >= 1);
        Ok((unprepared && dirs.cdi_specs()?.is_empty()).then_some(()))
    })
    .await?;
    for key in &keys {
        ensure!(kubelet.count("unprepared", key) == 1, "{key} unprepared {} times", kubelet.count("unprepared", key));
    }
    Ok(())
}

/// Evicts `pod` as `kubectl drain` does, retrying while a disruption budget refuses it (429); how often it was refused.
async fn evict(pods: &Api<Pod>, pod: &str) -> anyhow::Result<usize> {
    let refused = AtomicUsize::new(0);
    wait::until(&format!("the disruption budget to allow evicting {pod}"), PREPARE_TIMEOUT, || async {
        match pods.evict(pod, &EvictParams::default()).await {
            Ok(_) => Ok(Some(())),
            Err(kube::Error::Api(status)) if status.code == 429 => {
                refused.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
            Err(err) => Err(anyhow::Error::new(err).context(format!("evict {pod}"))),
        }
    })
    .await?;
    Ok(refused.into_inner())
}

/// Waits for `count` prepared pods labelled `app=trainer` other than `except`; (pod, node) of each.
async fn replicas(
    ctx: &TestContext,
    bed: &Testbed,
    count: usize,
    except: &BTreeSet<String>,
) -> anyhow::Result<Vec<(String, String)>> {
    let names = wait::until(&format!("{count} new replicas"), PREPARE_TIMEOUT, || async {
        let list = objects::pods(ctx).list(&ListParams::default().labels("app=trainer")).await?;
        let names: Vec<String> = list
            .items
            .into_iter()
            .filter(|p: &Pod| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.metadata.name)
            .filter(|n| !except.contains(n))
            .collect();
        Ok((names.len() == count).then_some(names))
    })
    .await?;
    let mut placed = Vec::new();
    for name in names {
        let (node, _) = bed.prepared(ctx, &name).await?;
        placed.push((name, node));
    }
    Ok(placed)
}

/// Pod priority with GPUs full: four low-priority pods hold a node's four H100s and a high-priority pod asks for one
/// there. kube-scheduler 1.34–1.37 cannot preempt for DRA devices: its `dynamicresources` Filter refuses a node
/// whose devices are taken as `UnschedulableAndUnresolvable` ("cannot allocate all claims"), and preemption only
/// looks at nodes refused as `Unschedulable` (`preemption.go`, `findCandidates`; KEP-5690 is to change this). The
/// high-priority pod stays Pending and says so, and no low-priority pod is evicted. What an operator does instead,
/// deleting one, hands its GPU to the waiting pod.
pub(super) async fn a_high_priority_gpu_pod_waits_instead_of_preempting_and_gets_the_gpu_freed_for_it(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let classes: Api<PriorityClass> = Api::all(ctx.client.clone());
    let class = |level: &str| format!("{}-{level}", ctx.namespace);
    let result = async {
        for (level, value) in [("low", 10), ("high", 1_000_000)] {
            let priority: PriorityClass =
                serde_json::from_value(json!({"metadata": {"name": class(level)}, "value": value}))?;
            classes.create(&PostParams::default(), &priority).await?;
        }
        wait_for_a_freed_gpu(&ctx, &bed, &class("low"), &class("high")).await
    }
    .await;
    // Cluster-scoped: deleted whatever happened (a class not created is simply not found).
    for level in ["low", "high"] {
        let _ = classes.delete(&class(level), &DeleteParams::default()).await;
    }
    result
}

async fn wait_for_a_freed_gpu(ctx: &TestContext, bed: &Testbed, low: &str, high: &str) -> anyhow::Result<()> {
    let node = bed.nodes[1].name.clone();
    let pods = objects::pods(ctx);
    let with_priority = |name: &str, class: &str| -> anyhow::Result<Pod> {
        let mut pod = bed.pod_on(ctx, name, &node, "one-h100")?;
        if let Some(spec) = pod.spec.as_mut() {
            spec.priority_class_name = Some(class.to_string());
        }
        Ok(pod)
    };
    let lows: Vec<String> = (0..4).map(|i| format!("low-{i}")).collect();
    for name in &lows {
        pods.create(&PostParams::default(), &with_priority(name, low)?).await?;
        bed.prepared(ctx, name).await?;
    }
    pods.create(&PostParams::default(), &with_priority("urgent", high)?).await?;
    let why = wait::until("the scheduler to give up on preemption for urgent", PREPARE_TIMEOUT, || async {
        Ok(objects::unschedulable_message(&pods.get("urgent").await?).filter(|why| why.contains("preemption")))
    })
    .await?;
    ensure!(why.contains("Preemption is not helpful"), "the scheduler said: {why}");
    let kubelet = &bed.node(&node)?.kubelet;
    for name in &lows {
        let pod = pods.get(name).await?;
        let key = format!("{}/{name}", ctx.namespace);
        ensure!(
            pod.metadata.deletion_timestamp.is_none() && kubelet.count("unprepared", &key) == 0,
            "{name} was preempted: {:?}",
            pod.status.and_then(|s| s.conditions)
        );
    }
    ensure!(pods.get("urgent").await?.status.and_then(|s| s.nominated_node_name).is_none(), "urgent was nominated");

    let freed = allocated(ctx, &claim_of(ctx, "low-0", "gpus").await?).await?;
    bed.delete_pod(ctx, "low-0", &node).await?;
    let (on, _) = bed.prepared(ctx, "urgent").await?;
    let got = allocated(ctx, &claim_of(ctx, "urgent", "gpus").await?).await?;
    ensure!(on == node && got == freed, "urgent got {got:?} on {on}, not low-0's freed {freed:?}");
    eprintln!("urgent waited ({why}); got {got:?} once low-0 was deleted");
    Ok(())
}
