//! PodGroup claims (KEP-5729) on a control plane started with `GenericWorkload` and `DRAWorkloadResourceClaims`
//! and `scheduling.k8s.io/v1beta1` served, with the real scheduler: a PodGroup's template claim becomes ONE
//! claim shared by the group's pods, as kube-controller-manager makes it, and is released when the group goes.
//!
//! The cluster is this binary's own: the feature gates change the whole control plane.

mod support;

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams, TypeMeta};
use serde_json::{Value, json};
use support::objects::{self, create_template};
use support::process::Component;
use support::{TestContext, podgroup, wait};

const ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
const SETTLE: Duration = Duration::from_secs(60);

fn main() {
    // 1.36 serves PodGroups only as v1alpha2, which the controller does not read (`make test-matrix`): what the
    // README's version table documents for it is asserted there instead. Before 1.36 there is no PodGroup API.
    let minor = support::cluster::kubernetes_minor().unwrap_or(37);
    if minor < 36 {
        eprintln!(
            "controller_podgroup needs Kubernetes 1.36 or later (no PodGroup API before); make test-matrix runs it from 1.36"
        );
        std::process::exit(2);
    }
    if minor >= 37 {
        support::run_with_env(
            "controller_podgroup",
            false,
            &support::cluster::PODGROUP_CLUSTER_ENV,
            &[
                test!(a_pod_groups_pods_share_one_claim),
                test!(a_pod_group_whose_claim_cannot_be_created_says_why),
                test!(a_claim_a_pod_group_names_stays_reserved_for_the_group_alone),
                test!(members_record_the_claim_their_pod_group_records_of_two),
                test!(a_pod_groups_claim_deleted_unseen_while_the_watch_was_down_is_replaced),
            ],
        )
    }
    support::run_with_env(
        "controller_podgroup",
        false,
        &ALPHA_PODGROUP_CLUSTER_ENV,
        &[test!(a_pod_of_an_alpha_pod_group_gets_no_claim_and_is_told_why)],
    )
}

/// Kubernetes 1.36's PodGroups: `scheduling.k8s.io/v1alpha2`, behind the same two alpha gates.
const ALPHA_PODGROUP_CLUSTER_ENV: [(&str, &str); 3] = [
    ("GPU_DRA_E2E_FEATURE_GATES", "GenericWorkload=true,DRAWorkloadResourceClaims=true"),
    ("GPU_DRA_E2E_RUNTIME_CONFIG", "scheduling.k8s.io/v1alpha2=true"),
    ("GPU_DRA_E2E_KCM_CONTROLLERS", "podgroup-protection-controller"),
];

/// Kubernetes 1.36 with its PodGroup gates on serves only `scheduling.k8s.io/v1alpha2` PodGroups, which the
/// controller does not read (the README's version table): it says so at start, naming both versions, and a pod of
/// such a PodGroup gets no claim of its own (one per member would hold a GPU each where the group shares one) but a
/// Warning saying why; the PodGroup gets no claim either.
async fn a_pod_of_an_alpha_pod_group_gets_no_claim_and_is_told_why(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &[]).await?;
    ensure!(
        controller.log_text().contains("serves PodGroups only as scheduling.k8s.io/v1alpha2"),
        "the controller does not say that only the alpha PodGroups are served:\n{}",
        controller.log_tail()
    );
    create_template(&ctx, "shared-gpu", objects::one_gpu()).await?;
    let alpha = ApiResource::from_gvk(&GroupVersionKind::gvk("scheduling.k8s.io", "v1alpha2", "PodGroup"));
    let groups = Api::<DynamicObject>::namespaced_with(ctx.client.clone(), &ctx.namespace, &alpha);
    let mut group = podgroup::group_object("trainers", "shared-gpu")?;
    group.types = Some(TypeMeta { api_version: "scheduling.k8s.io/v1alpha2".into(), kind: "PodGroup".into() });
    groups.create(&PostParams::default(), &group).await.context("create the v1alpha2 PodGroup")?;
    let pod = podgroup::member_object("worker-0", "trainers", "shared-gpu", None)?;
    podgroup::raw_pods(&ctx).create(&PostParams::default(), &pod).await.context("create the member pod")?;

    let events: Api<Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let event = wait::until("a FailedResourceClaimCreation event on the pod", SETTLE, || async {
        let list = events.list(&ListParams::default()).await?.items;
        Ok(list.into_iter().find(|e| {
            e.reason.as_deref() == Some("FailedResourceClaimCreation")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("worker-0")
        }))
    })
    .await
    .with_context(|| controller.log_tail())?;
    let note = event.note.clone().unwrap_or_default();
    ensure!(event.type_.as_deref() == Some("Warning"), "{event:?}");
    ensure!(note.contains("PodGroups are not handled"), "the note must say why: {note:?}");
    let claims = objects::claims(&ctx).list(&ListParams::default()).await?.items;
    ensure!(
        claims.is_empty(),
        "no claim may be made: {:?}",
        claims.iter().map(ResourceExt::name_any).collect::<Vec<_>>()
    );
    ensure!(podgroup::recorded(&groups.get("trainers").await?).is_none(), "the alpha PodGroup recorded a claim");
    Ok(())
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
    let workers = ["worker-0", "worker-1"];
    let group = podgroup::create_job(&ctx, "trainers", &workers, "shared-gpu", &node.name).await?;
    let group_uid = group.uid().context("PodGroup without uid")?;
    let claim_name = podgroup::wait_shared_and_scheduled(&ctx, "trainers", &workers, &controller, SETTLE).await?;

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
    podgroup::delete_job(&ctx, "trainers", &workers).await?;
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
    let groups = podgroup::pod_groups(&ctx);
    let group = podgroup::group_object("trainers", "late-gpu")?;
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
    ensure!(podgroup::recorded(&groups.get("trainers").await?).is_none(), "a claim was recorded without its template");

    create_template(&ctx, "late-gpu", objects::one_gpu()).await?;
    let claim = wait::until("the PodGroup to record its claim", SETTLE, || async {
        Ok(podgroup::recorded(&groups.get("trainers").await?))
    })
    .await
    .with_context(|| controller.log_tail())?;
    objects::claims(&ctx).get(&claim).await.with_context(|| format!("the recorded claim {claim}"))?;
    Ok(())
}

/// A training job whose PodGroup and workers all name one claim created beforehand (`resourceClaimName`, e.g. a
/// device shared by the gang): the scheduler reserves it for the PodGroup once, for every member. The controller
/// leaves it so, as kube-controller-manager does (upstream `IsReservedForPod` counts the group's reservation for
/// each member, `BindTo` names the group). Before, it added each scheduled member too: one conflicting write per
/// member, and `reservedFor` filling toward its limit of 256, after which no other consumer could be added.
async fn a_claim_a_pod_group_names_stays_reserved_for_the_group_alone(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &[]).await?;
    let node = objects::fake_gpu_node(&ctx, 1).await?;
    let claim: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "fabric"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": node.class}}]}}
    }))?;
    let claims = objects::claims(&ctx);
    claims.create(&PostParams::default(), &claim).await?;
    let named = json!([{"name": "gpu", "resourceClaimName": "fabric"}]);
    let mut group = podgroup::group_object("trainers", "unused")?;
    group.data["spec"]["resourceClaims"] = named.clone();
    podgroup::pod_groups(&ctx).create(&PostParams::default(), &group).await.context("create the PodGroup")?;
    let workers = ["worker-0", "worker-1", "worker-2"];
    let pods = podgroup::raw_pods(&ctx);
    for worker in workers {
        let mut pod = podgroup::member_object(worker, "trainers", "unused", Some(&node.name))?;
        pod.data["spec"]["resourceClaims"] = named.clone();
        pods.create(&PostParams::default(), &pod).await.with_context(|| format!("create {worker}"))?;
    }
    wait::until("every worker scheduled", SETTLE, || async {
        for worker in workers {
            if !pods.get(worker).await?.data["spec"]["nodeName"].is_string() {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    // The controller syncs each scheduled worker: time for every sync to have written what it would.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let claim = claims.get("fabric").await?;
    let reserved: Vec<(Option<String>, String, String)> = claim
        .status
        .and_then(|s| s.reserved_for)
        .unwrap_or_default()
        .into_iter()
        .map(|r| (r.api_group, r.resource, r.name))
        .collect();
    ensure!(
        reserved == [(Some("scheduling.k8s.io".to_string()), "podgroups".to_string(), "trainers".to_string())],
        "the claim must stay reserved for the PodGroup alone: {reserved:?}\n{}",
        controller.log_tail()
    );
    Ok(())
}

/// Two claims of one PodGroup claim exist (a create whose answer was lost under load, made again before the first
/// showed): the group records the newer. A member records the claim its group records, as every other member does;
/// before, a member took the oldest, and members recording different claims of one shared claim get two allocations.
async fn members_record_the_claim_their_pod_group_records_of_two(ctx: TestContext) -> anyhow::Result<()> {
    create_template(&ctx, "shared-gpu", objects::one_gpu()).await?;
    let groups = podgroup::pod_groups(&ctx);
    let group = groups.create(&PostParams::default(), &podgroup::group_object("trainers", "shared-gpu")?).await?;
    let uid = group.uid().context("PodGroup without uid")?;
    let claims = objects::claims(&ctx);
    for name in ["trainers-gpu-aaaaa", "trainers-gpu-zzzzz"] {
        let claim: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {ANNOTATION: "gpu"},
                "ownerReferences": [{"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
                    "name": "trainers", "uid": uid, "controller": true}]},
            "spec": objects::one_gpu()["spec"].clone()
        }))?;
        claims.create(&PostParams::default(), &claim).await?;
    }
    let status =
        json!({"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "trainers-gpu-zzzzz"}]}});
    groups.patch_status("trainers", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&status)).await?;
    let controller = Component::controller(&ctx, &[]).await?;
    let pod = podgroup::member_object("worker-0", "trainers", "shared-gpu", None)?;
    podgroup::raw_pods(&ctx).create(&PostParams::default(), &pod).await.context("create the member pod")?;
    let recorded = wait::until("the member to record a claim", SETTLE, || async {
        Ok(podgroup::recorded(&podgroup::raw_pods(&ctx).get("worker-0").await?))
    })
    .await
    .with_context(|| controller.log_tail())?;
    ensure!(recorded == "trainers-gpu-zzzzz", "the member recorded {recorded}, not the claim its PodGroup records");
    Ok(())
}

/// A PodGroup's claim that the controller created while its claim watch was down (an API server restarting), and
/// that is deleted before the watch resumes: the controller knows it only from its create's answer, and the relist
/// does not show it. The PodGroup must get a new claim, recorded in its status. Before, the remembered claim was
/// found again and recorded again on every sync, for as long as the PodGroup lived.
async fn a_pod_groups_claim_deleted_unseen_while_the_watch_was_down_is_replaced(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let proxy = support::api_proxy::ApiProxy::start(ctx.client.clone()).await?;
    let args = ["controller", "--namespace", ctx.namespace.as_str(), "--leader-elect=false"];
    let controller = Component::start(proxy.kubeconfig(), &ctx.namespace, &args)?;
    controller.wait_ready().await?;
    create_template(&ctx, "shared-gpu", objects::one_gpu()).await?;
    proxy.cut_watches(&format!("/namespaces/{}/resourceclaims", ctx.namespace));
    wait::until("the controller to watch the claims again (held)", SETTLE, || async {
        Ok((proxy.held_watches() > 0).then_some(()))
    })
    .await?;
    let groups = podgroup::pod_groups(&ctx);
    groups.create(&PostParams::default(), &podgroup::group_object("trainers", "shared-gpu")?).await?;
    let unseen = wait::until("the PodGroup to record its claim", SETTLE, || async {
        Ok(podgroup::recorded(&groups.get("trainers").await?))
    })
    .await
    .with_context(|| controller.log_tail())?;
    let claims = objects::claims(&ctx);
    claims.delete(&unseen, &Default::default()).await?;
    wait::until("the claim to be gone", SETTLE, || async {
        Ok(claims.get_opt(&unseen).await?.is_none().then_some(()))
    })
    .await?;
    proxy.expire_held_watches();
    let replaced = wait::until("the PodGroup to record a new claim after the relist", SETTLE, || async {
        let name = podgroup::recorded(&groups.get("trainers").await?).filter(|n| *n != unseen);
        Ok(match name {
            Some(name) => claims.get_opt(&name).await?.map(|_| name),
            None => None,
        })
    })
    .await
    .with_context(|| controller.log_tail())?;
    eprintln!("the PodGroup's claim {unseen}, never seen by the watch and deleted, replaced by {replaced}");
    Ok(())
}
