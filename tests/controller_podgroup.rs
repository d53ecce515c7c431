//! PodGroup claims (KEP-5729) on a control plane started with `GenericWorkload` and `DRAWorkloadResourceClaims`
//! and `scheduling.k8s.io/v1beta1` served, with the real scheduler: a PodGroup's template claim becomes ONE
//! claim shared by the group's pods, as kube-controller-manager makes it, and is released when the group goes.
//!
//! The cluster is this binary's own: the feature gates change the whole control plane.

mod support;

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use support::objects::{self, create_template};
use support::process::Component;
use support::{TestContext, wait};

const ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
const SETTLE: Duration = Duration::from_secs(60);

fn main() {
    support::run_with_env(
        "controller_podgroup",
        false,
        &support::cluster::PODGROUP_CLUSTER_ENV,
        &[test!(a_pod_groups_pods_share_one_claim), test!(a_pod_group_whose_claim_cannot_be_created_says_why)],
    )
}

fn pod_groups(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("scheduling.k8s.io", "v1beta1", "PodGroup"));
    Api::namespaced_with(client.clone(), namespace, &resource)
}

/// Pods read untyped: `spec.schedulingGroup` is newer than the compiled types.
fn raw_pods(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("", "v1", "Pod"));
    Api::namespaced_with(client.clone(), namespace, &resource)
}

fn recorded(object: &DynamicObject) -> Option<String> {
    let statuses = object.data["status"]["resourceClaimStatuses"].as_array()?;
    let entry = statuses.iter().find(|s| s["name"] == "gpu")?;
    entry["resourceClaimName"].as_str().map(str::to_string)
}

/// Two workers of a training job in one PodGroup that declares a shared GPU claim, on a node with ONE GPU: the
/// group gets exactly one claim (owned by the PodGroup, recorded in its status and in both pods' statuses),
/// the scheduler allocates it and reserves it for the PodGroup, and both pods run on the one GPU. Per-pod
/// claims would leave the second pod unschedulable. Deleting the PodGroup drops its reservation, which frees
/// the device, and the garbage collector removes the claim.
async fn a_pod_groups_pods_share_one_claim(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &[]).await?;
    let node = objects::fake_gpu_node(&ctx, 1).await?;
    let request = json!({"name": "gpu", "exactly": {"deviceClassName": node.class}});
    create_template(&ctx, "shared-gpu", json!({"spec": {"devices": {"requests": [request]}}})).await?;
    let claim_ref = json!([{"name": "gpu", "resourceClaimTemplateName": "shared-gpu"}]);

    let groups = pod_groups(&ctx.client, &ctx.namespace);
    let group: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
        "metadata": {"name": "trainers"},
        "spec": {"schedulingPolicy": {"basic": {}}, "resourceClaims": claim_ref}
    }))?;
    let group = groups.create(&PostParams::default(), &group).await.context("create the PodGroup")?;
    let group_uid = group.uid().context("PodGroup without uid")?;
    let pods = raw_pods(&ctx.client, &ctx.namespace);
    for name in ["worker-0", "worker-1"] {
        let pod: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {
                "containers": [{"name": "train", "image": "registry.k8s.io/pause:3.10",
                                "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": claim_ref,
                "schedulingGroup": {"podGroupName": "trainers"},
                "nodeSelector": {"kubernetes.io/hostname": node.name}
            }
        }))?;
        pods.create(&PostParams::default(), &pod).await.with_context(|| format!("create {name}"))?;
    }

    let claim_name = wait::until("the PodGroup to record its claim", SETTLE, || async {
        Ok(recorded(&groups.get("trainers").await?))
    })
    .await
    .with_context(|| controller.log_tail())?;
    for name in ["worker-0", "worker-1"] {
        wait::until(&format!("{name} to record the group's claim and be scheduled"), SETTLE, || async {
            let pod = pods.get(name).await?;
            let bound = pod.data["spec"]["nodeName"].as_str().is_some();
            Ok((recorded(&pod).as_deref() == Some(claim_name.as_str()) && bound).then_some(()))
        })
        .await
        .with_context(|| controller.log_tail())?;
    }

    let claims = objects::claims(&ctx);
    let all = claims.list(&ListParams::default()).await?.items;
    let names: Vec<String> = all.iter().map(ResourceExt::name_any).collect();
    ensure!(names == [claim_name.clone()], "exactly the group's claim must exist, found {names:?}");
    let claim = &all[0];
    let owners: Vec<Value> = claim.owner_references().iter().map(serde_json::to_value).collect::<Result<_, _>>()?;
    ensure!(
        owners
            == [json!({"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "name": "trainers",
                        "uid": group_uid, "controller": true})],
        "the claim is not the PodGroup's: {owners:?}"
    );
    ensure!(claim.annotations().get(ANNOTATION).map(String::as_str) == Some("gpu"), "{:?}", claim.annotations());
    let status = claim.status.as_ref().context("claim without status")?;
    ensure!(status.allocation.is_some(), "the scheduler did not allocate the group's claim");
    let reserved: Vec<(Option<String>, String, String)> = (status.reserved_for.clone().unwrap_or_default())
        .into_iter()
        .map(|r| (r.api_group, r.resource, r.name))
        .collect();
    ensure!(
        reserved == [(Some("scheduling.k8s.io".to_string()), "podgroups".to_string(), "trainers".to_string())],
        "the claim must be reserved for the PodGroup only: {reserved:?}"
    );
    ensure!(
        claim.finalizers().iter().any(|f| f == "resource.kubernetes.io/delete-protection"),
        "the allocated claim is protected until it is deallocated: {:?}",
        claim.finalizers()
    );

    // The job is done: its pods go, then the PodGroup. The reservation must go with the group (the claim's
    // delete-protection finalizer holds it until the device is released), and the claim with it.
    for name in ["worker-0", "worker-1"] {
        pods.delete(name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    }
    groups.delete("trainers", &DeleteParams::background()).await?;
    wait::until("the group's claim to be released and deleted", SETTLE, || async {
        Ok(claims.get_opt(&claim_name).await?.is_none().then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    Ok(())
}

/// A job applied in one go (`kubectl apply -f dir/`) whose PodGroup arrives before its ResourceClaimTemplate: the
/// group's claim cannot be created yet, and the operator must see why on the PodGroup, as kube-controller-manager
/// shows it (`Warning FailedResourceClaimCreation`, "PodGroupResourceClaim <name>: <error>", regarding the
/// PodGroup). Once the template exists the claim is created without any other change.
async fn a_pod_group_whose_claim_cannot_be_created_says_why(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &[]).await?;
    let groups = pod_groups(&ctx.client, &ctx.namespace);
    let group: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
        "metadata": {"name": "trainers"},
        "spec": {"schedulingPolicy": {"basic": {}},
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "late-gpu"}]}
    }))?;
    groups.create(&PostParams::default(), &group).await.context("create the PodGroup")?;

    let events: Api<Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let event = wait::until("a FailedResourceClaimCreation event on the PodGroup", SETTLE, || async {
        let list = events.list(&ListParams::default()).await?.items;
        Ok(list.into_iter().find(|e| e.reason.as_deref() == Some("FailedResourceClaimCreation")))
    })
    .await
    .with_context(|| controller.log_tail())?;
    let regarding = event.regarding.clone().unwrap_or_default();
    ensure!(
        (regarding.api_version.as_deref(), regarding.kind.as_deref(), regarding.name.as_deref())
            == (Some("scheduling.k8s.io/v1beta1"), Some("PodGroup"), Some("trainers")),
        "the event is not about the PodGroup: {regarding:?}"
    );
    ensure!(event.type_.as_deref() == Some("Warning"), "{event:?}");
    let note = event.note.clone().unwrap_or_default();
    ensure!(
        note.starts_with("PodGroupResourceClaim gpu: ") && note.contains("\"late-gpu\"") && note.contains("not found"),
        "the note must name the group claim and the missing template: {note:?}"
    );
    ensure!(recorded(&groups.get("trainers").await?).is_none(), "a claim was recorded without its template");

    create_template(&ctx, "late-gpu", objects::one_gpu()).await?;
    let claim = wait::until("the PodGroup to record its claim", SETTLE, || async {
        Ok(recorded(&groups.get("trainers").await?))
    })
    .await
    .with_context(|| controller.log_tail())?;
    objects::claims(&ctx).get(&claim).await.with_context(|| format!("the recorded claim {claim}"))?;
    Ok(())
}
