//! The controller under workloads the parity checklist does not cover: pods that finish and stay (Jobs),
//! extended resources allocated by the scheduler, an informer that lags behind the API server, and a pod status
//! that names a claim made for someone else, a burst of pods whose Events the rate limit holds back, and a
//! namespace deleted while no claim controller runs.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::support::objects::{self, claim_statuses, create_pod, create_template, list_claims, one_gpu};
use super::support::process::Component;
use super::support::{TestContext, wait};
use super::{ANNOTATION, SETTLE, allocated, create_bound_pod, reserved, wait_recorded};

/// How long a test watches for a write that must not happen.
const QUIET: Duration = Duration::from_secs(6);

/// A Job's pod finished and is kept: its claim is deleted ONCE. No claim is created again, and the pod gets no
/// further write, however long the pod object stays.
pub(super) async fn finished_pod_claim_is_deleted_once_and_never_recreated(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    create_pod(&ctx, "job-0", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let claim = claim_statuses(&wait_recorded(&ctx, "job-0", 1).await?)[0].1.clone().context("no claim")?;
    // The scheduler's one write, once the claim exists, is done before the pod finishes (a write of its made after
    // the finish would read as the controller's).
    objects::unschedulable(&ctx.client, &ctx.namespace, "job-0", Duration::from_secs(30)).await?;

    // As the kubelet reports a completed Job pod.
    let pods = objects::pods(&ctx);
    let finished = pods
        .patch_status("job-0", &PatchParams::default(), &Patch::Merge(json!({"status": {"phase": "Succeeded"}})))
        .await?;
    let claims = objects::claims(&ctx);
    wait::until("the finished pod's claim to be deleted", SETTLE, || async {
        Ok(claims.get_opt(&claim).await?.is_none().then_some(()))
    })
    .await?;

    tokio::time::sleep(QUIET).await;
    let left: Vec<String> = list_claims(&ctx).await?.iter().map(|c| c.name_any()).collect();
    ensure!(left.is_empty(), "claims were created again for the finished pod: {left:?}");
    let creates =
        controller.metric("dynamic_resource_allocation_resourceclaim_creates_total", &[("status", "success")]).await?;
    ensure!(creates == 1.0, "{creates} claims created for one pod claim of one pod");
    let pod = pods.get("job-0").await?;
    ensure!(
        pod.resource_version() == finished.resource_version(),
        "the finished pod was written again: status now {:?}",
        claim_statuses(&pod)
    );
    Ok(())
}

/// The scheduler allocates a claim for a container's extended resource (`nvidia.com/gpu`, mapped to a DeviceClass
/// by `extendedResourceName`; the Node does not list it) and records it in `status.extendedResourceClaimStatus`.
/// When the pod finishes, the controller unreserves, deallocates and deletes that claim, as it does a claim from a
/// template: the GPU is free again within seconds.
pub(super) async fn extended_resource_claim_of_finished_pod_is_released(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    let node = objects::fake_gpu_node(&ctx, 1).await?;
    let classes = Api::<k8s_openapi::api::resource::v1::DeviceClass>::all(ctx.client.clone());
    let extended = json!({"spec": {"extendedResourceName": "nvidia.com/gpu"}});
    classes.patch(&node.class, &PatchParams::default(), &Patch::Merge(&extended)).await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "cuda-job"},
        "spec": {
            "containers": [{"name": "cuda", "image": "registry.k8s.io/pause:3.10",
                            "resources": {"limits": {"nvidia.com/gpu": 1}}}],
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "restartPolicy": "Never"
        }
    }))?;
    objects::pods(&ctx).create(&PostParams::default(), &pod).await?;
    if super::support::cluster::kubernetes_minor()? < 36 {
        return extended_resources_are_off(&ctx, &node.class, &pod.name_any()).await;
    }

    // Read untyped: `extendedResourceClaimStatus` is newer than the compiled types.
    let raw_pods = Api::<DynamicObject>::namespaced_with(ctx.client.clone(), &ctx.namespace, &pod_resource());
    let claim_name = wait::until("the scheduler to bind the pod with an extended-resource claim", SETTLE, || async {
        let p = raw_pods.get("cuda-job").await?;
        let bound = p.data["spec"]["nodeName"].as_str().is_some();
        let name = p.data["status"]["extendedResourceClaimStatus"]["resourceClaimName"].as_str().map(str::to_string);
        Ok(name.filter(|_| bound))
    })
    .await?;
    let claims = objects::claims(&ctx);
    let claim = claims.get(&claim_name).await?;
    ensure!(
        claim.annotations().get("resource.kubernetes.io/extended-resource-claim").map(String::as_str) == Some("true")
            && claim.annotations().get(ANNOTATION).is_none(),
        "not a scheduler-made extended-resource claim: {:?}",
        claim.annotations()
    );
    ensure!(allocated(&claim) && reserved(&claim) == ["cuda-job"], "not allocated and reserved: {:?}", claim.status);
    ensure!(
        claim.owner_references().iter().any(|o| o.kind == "Pod" && o.name == "cuda-job" && o.controller == Some(true)),
        "not owned by the pod: {:?}",
        claim.owner_references()
    );

    let finished = Instant::now();
    objects::set_phase(&ctx, "cuda-job", "Succeeded").await?;
    wait::until("the extended-resource claim to be released and deleted", Duration::from_secs(10), || async {
        Ok(claims.get_opt(&claim_name).await?.is_none().then_some(()))
    })
    .await?;
    eprintln!("pod Succeeded → extended-resource claim deleted: {:?}", finished.elapsed());
    Ok(())
}

fn pod_resource() -> kube::api::ApiResource {
    kube::api::ApiResource::erase::<Pod>(&())
}

/// The claim a pod's status records exists on the API server but not in the controller's informer: the informer
/// lags (a new leader whose watch has not caught up, a re-list). The controller asks the API server before
/// creating anything, and keeps the recorded claim.
///
/// The lag is made lasting and certain: the controller may list claims but not watch them, so its claim informer
/// holds the state of its start-up list forever, and a claim created after that is only visible to a GET. The
/// claim is made the way the previous leader would have made it (owned by the pod, annotated, recorded in the pod
/// status under the controller's field manager).
pub(super) async fn recorded_claim_missing_from_a_lagging_informer_is_read_not_recreated(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let token = objects::service_account_with_rules(&ctx, "no-claim-watch", rules_without_claim_watch()).await?;
    let kubeconfig = ctx.cluster.kubeconfig_for_token(&format!("{}-no-claim-watch", ctx.namespace), &token)?;
    let args = ["controller", "--namespace", ctx.namespace.as_str(), "--leader-elect=false"];
    let controller = Component::start(&kubeconfig, &ctx.namespace, &args)?;
    controller.wait_ready().await?;

    // The template does not exist yet: the new leader cannot create anything for the pod before the status
    // records the old leader's claim.
    let pod = create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let claim: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "p-gpu-older", "annotations": {ANNOTATION: "gpu"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": pod.metadata.uid, "controller": true}]},
        "spec": one_gpu()["spec"]
    }))?;
    let as_controller = PostParams { field_manager: Some("gpu-dra-controller".into()), ..Default::default() };
    objects::claims(&ctx).create(&as_controller, &claim).await?;
    let status = json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "uid": pod.metadata.uid},
        "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-older"}]}
    });
    let apply = PatchParams::apply("resource_claim").force();
    objects::pods(&ctx).patch_status("p", &apply, &Patch::Apply(&status)).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;

    tokio::time::sleep(QUIET).await;
    let names: Vec<String> = list_claims(&ctx).await?.iter().map(|c| c.name_any()).collect();
    ensure!(names == ["p-gpu-older"], "a second claim was created: {names:?}\n{}", controller.log_tail());
    let recorded = claim_statuses(&objects::pods(&ctx).get("p").await?);
    ensure!(
        recorded == [("gpu".to_string(), Some("p-gpu-older".to_string()))],
        "the pod status was moved off the recorded claim: {recorded:?}"
    );
    ensure!(
        controller.log_text().contains("recorded claim is not in the informer; reading it from the API server"),
        "the live read was not taken (the informer saw the claim?):\n{}",
        controller.log_tail()
    );
    Ok(())
}

/// The controller's grant as the chart gives it, except `watch` on claims.
fn rules_without_claim_watch() -> Value {
    json!([
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "list", "create", "delete", "patch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["patch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"], "verbs": ["list", "watch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}
    ])
}

/// A pod's status (writable by whoever may patch pods/status) names, for its template claim, a claim generated
/// for another pod and allocated to it. The controller never adds the pod to that claim's `reservedFor`
/// (upstream `IsForPod`): the other pod's GPU is not shared with it.
pub(super) async fn pod_status_naming_another_pods_claim_gets_no_reservation(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let owner = create_pod(&ctx, "owner", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let owners_claim = claim_statuses(&wait_recorded(&ctx, "owner", 1).await?)[0].1.clone().context("no claim")?;
    let consumer = json!([{"resource": "pods", "name": "owner", "uid": owner.metadata.uid}]);
    objects::allocate(&ctx, &owners_claim, consumer, true).await?;

    // Bound directly (spec.nodeName): the controller, not the scheduler, reserves this pod's claims.
    create_bound_pod(&ctx, "intruder", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let pods = objects::pods(&ctx);
    wait_recorded(&ctx, "intruder", 1).await?;
    let forged = json!({"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": owners_claim}]}});
    pods.patch_status("intruder", &PatchParams::default(), &Patch::Merge(&forged)).await?;

    // Evidence the forged status reached the controller: a pod created after it, bound and with its claim allocated,
    // gets its reservation (the pod watch delivers the forged status first); the wait below covers its sync.
    create_bound_pod(&ctx, "witness", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let witness_claim = claim_statuses(&wait_recorded(&ctx, "witness", 1).await?)[0].1.clone().context("no claim")?;
    objects::allocate(&ctx, &witness_claim, json!([]), true).await?;
    wait::until("the witness pod's reservation", SETTLE, || async {
        let claim = objects::claims(&ctx).get(&witness_claim).await?;
        Ok((reserved(&claim) == ["witness"]).then_some(()))
    })
    .await?;

    tokio::time::sleep(QUIET).await;
    let claim = objects::claims(&ctx).get(&owners_claim).await?;
    ensure!(
        reserved(&claim) == ["owner"],
        "the other pod's claim was reserved for the intruder: {:?}",
        reserved(&claim)
    );
    Ok(())
}

/// Kubernetes 1.34 and 1.35 (DRAExtendedResource alpha, off), as the README documents: the API server drops the
/// class's `extendedResourceName`, the scheduler finds no node with `nvidia.com/gpu`, and no claim is made.
async fn extended_resources_are_off(ctx: &TestContext, class: &str, pod: &str) -> anyhow::Result<()> {
    let resource = ApiResource::erase::<k8s_openapi::api::resource::v1::DeviceClass>(&());
    let stored = Api::<DynamicObject>::all_with(ctx.client.clone(), &resource).get(class).await?;
    ensure!(
        stored.data["spec"]["extendedResourceName"].is_null(),
        "the API server kept extendedResourceName with DRAExtendedResource off: {}",
        stored.data["spec"]
    );
    let message = wait::until("the scheduler to find no node for nvidia.com/gpu", SETTLE, || async {
        let p = objects::pods(ctx).get(pod).await?;
        Ok(objects::unschedulable_message(&p).filter(|m| m.contains("Insufficient nvidia.com/gpu")))
    })
    .await?;
    let claims = list_claims(ctx).await?;
    ensure!(claims.is_empty(), "claims were made for an unschedulable pod ({message}): {claims:?}");
    Ok(())
}

/// A Job of 30 pods, two template claims each, created at once, with Events limited to 10/s (burst 10): every
/// claim gets its own `ResourceClaimCreated` Event (60 of them, with distinct names, none dropped, none folded into
/// a series), and the sender, which sends them in batches, keeps the limit: 60 Events from a full bucket of 10
/// take at least 5 s at 10/s.
pub(super) async fn a_burst_of_pods_gets_every_creation_event_within_the_rate_limit(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &["--events-qps", "10", "--events-burst", "10"]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let claims = json!([
        {"name": "gpu-a", "resourceClaimTemplateName": "one-gpu"},
        {"name": "gpu-b", "resourceClaimTemplateName": "one-gpu"}
    ]);
    let pods: Vec<String> = (0..30).map(|i| format!("job-{i:02}")).collect();
    futures::future::try_join_all(pods.iter().map(|pod| create_pod(&ctx, pod, claims.clone()))).await?;

    let api: Api<Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let events = wait::until("60 ResourceClaimCreated events", Duration::from_secs(60), || async {
        let events: Vec<Event> = api
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("ResourceClaimCreated"))
            .collect();
        Ok((events.len() >= 60).then_some(events))
    })
    .await?;
    ensure!(events.len() == 60, "{} creation events for 60 claims", events.len());
    let names: HashSet<&str> = events.iter().filter_map(|e| e.metadata.name.as_deref()).collect();
    ensure!(names.len() == 60, "{} distinct event names for 60 events", names.len());
    let about: HashSet<(String, String)> = events
        .iter()
        .filter_map(|e| Some((e.regarding.as_ref()?.name.clone()?, e.related.as_ref()?.name.clone()?)))
        .collect();
    ensure!(about.len() == 60, "60 (pod, claim) pairs expected, the events name {}", about.len());
    for pod in &pods {
        let claims = about.iter().filter(|(regarding, _)| regarding == pod).count();
        ensure!(claims == 2, "pod {pod} has {claims} creation events, not one per claim");
    }
    ensure!(events.iter().all(|e| e.series.is_none()), "a creation event was counted in a series");

    let mut sent: Vec<Timestamp> = events.iter().filter_map(|e| Some(e.event_time.as_ref()?.0)).collect();
    sent.sort();
    let (first, last) = (sent.first().context("no event time")?, sent.last().context("no event time")?);
    let spread = last.duration_since(*first).as_secs_f64();
    ensure!(spread >= 4.5, "60 events sent within {spread:.1} s: faster than 10/s after a burst of 10");

    let (_, metrics) = controller.get("/metrics").await?;
    ensure!(
        metrics.lines().any(|line| line == "gpu_dra_controller_events_dropped_total 0"),
        "events were dropped, or the counter is missing"
    );
    Ok(())
}

/// A namespace deleted while no claim controller runs (kube-controller-manager's turned off for gpu-dra's, which is
/// down: uninstalled, crash-looping after an upgrade): its pods go, its claims keep the delete-protection finalizer
/// and the namespace stays Terminating. Once a controller runs again it releases and deallocates them, and the
/// namespace goes; nothing an operator has to remove by hand.
pub(super) async fn a_namespace_deleted_while_no_controller_runs_goes_once_one_does(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let mut controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    objects::create_claim(&ctx, "shared").await?;
    let claims_of_pod = json!([
        {"name": "gpu", "resourceClaimTemplateName": "one-gpu"},
        {"name": "shared", "resourceClaimName": "shared"}
    ]);
    let pod = create_pod(&ctx, "trainer", claims_of_pod).await?;
    let recorded = claim_statuses(&wait_recorded(&ctx, "trainer", 1).await?);
    let generated = recorded.iter().find(|(name, _)| name == "gpu").and_then(|(_, c)| c.clone()).context("no claim")?;
    controller.kill()?;

    // What the scheduler would have done for the pod: both claims allocated, protected, reserved for it.
    let consumer = json!([{"resource": "pods", "name": "trainer", "uid": pod.uid().context("pod without uid")?}]);
    for claim in [generated.as_str(), "shared"] {
        objects::allocate(&ctx, claim, consumer.clone(), true).await?;
    }
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(ctx.client.clone());
    namespaces.delete(&ctx.namespace, &Default::default()).await?;

    let claims = objects::claims(&ctx);
    let pods = objects::pods(&ctx);
    wait::until("the pod gone and both claims being deleted", SETTLE, || async {
        let deleting = list_claims(&ctx).await?.iter().filter(|c| c.metadata.deletion_timestamp.is_some()).count();
        Ok((pods.get_opt("trainer").await?.is_none() && deleting == 2).then_some(()))
    })
    .await?;
    // The namespace controller says what it waits for.
    let waiting = wait::until("the namespace to wait on the claims' finalizer", SETTLE, || async {
        let Some(namespace) = namespaces.get_opt(&ctx.namespace).await? else {
            anyhow::bail!("the namespace went without a claim controller")
        };
        let conditions = namespace.status.and_then(|s| s.conditions).unwrap_or_default();
        Ok(conditions
            .into_iter()
            .find(|c| c.type_ == "NamespaceFinalizersRemaining" && c.status == "True")
            .and_then(|c| c.message)
            .filter(|m| m.contains("resource.kubernetes.io/delete-protection")))
    })
    .await?;
    tokio::time::sleep(QUIET).await;
    let stuck = namespaces.get_opt(&ctx.namespace).await?.context("the namespace went without a claim controller")?;
    let phase = stuck.status.and_then(|s| s.phase);
    ensure!(phase.as_deref() == Some("Terminating"), "namespace phase {phase:?} ({waiting})");
    for claim in [generated.as_str(), "shared"] {
        let c = claims.get(claim).await?;
        ensure!(allocated(&c) && reserved(&c) == ["trainer"], "claim {claim} changed with no controller: {c:?}");
    }

    let _controller = Component::controller(&ctx, &[]).await?;
    wait::until("the namespace to go", Duration::from_secs(90), || async {
        Ok(namespaces.get_opt(&ctx.namespace).await?.is_none().then_some(()))
    })
    .await?;
    Ok(())
}
