//! `gpu-dra controller` watching the whole cluster, with a hostile tenant beside a victim namespace. The tenant has
//! what the `edit` role grants (pods, claims and templates of its own namespace; no `pods/status`) and forges
//! every kind of "another claim controller is here" claim it can. None of it may stop claims being created for
//! pods in another namespace, and none of the names it chose may reach a metric label.
//!
//! One test in this binary: its controller acts on every namespace, so it must not share the cluster with
//! tests that run controllers of their own.

mod support;

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use support::objects::{claim_statuses, one_gpu, template_resource};
use support::process::{Component, sample};
use support::{TestContext, wait};

const ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
const SETTLE: Duration = Duration::from_secs(30);

fn main() {
    support::run("controller_tenants", &[test!(a_tenants_forged_claims_stop_no_claim_elsewhere)])
}

async fn a_tenants_forged_claims_stop_no_claim_elsewhere(ctx: TestContext) -> anyhow::Result<()> {
    let tenant_ns = ctx.namespace.clone();
    let victim_ns = support::create_namespace(&ctx.client, "victim").await?;
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    let result = run_tenant_scenario(&ctx, &tenant_ns, &victim_ns).await;
    let _ = namespaces.delete(&victim_ns, &DeleteParams::default()).await;
    result
}

async fn run_tenant_scenario(ctx: &TestContext, tenant_ns: &str, victim_ns: &str) -> anyhow::Result<()> {
    // The strictest setting an operator can choose: even with the cluster-wide switch allowed, only evidence a
    // tenant cannot forge may turn it on.
    let args = ["controller", "--leader-elect=false", "--on-another-claim-controller=observe-only"];
    let mut controller = Component::start(&ctx.cluster.kubeconfig(), tenant_ns, &args)?;
    controller.wait_ready().await?;

    let tenant = tenant_client(ctx).await?;
    let tenant_claims: Api<ResourceClaim> = Api::namespaced(tenant.clone(), tenant_ns);

    // 1. The forgery of the report: annotated claims whose controlling owner is a Pod that does not exist, one
    //    written as kube-controller-manager and ten under invented field-manager names.
    for i in 0..11 {
        let manager = if i == 0 { "kube-controller-manager".to_string() } else { format!("tenant-manager-{i}") };
        let owner = json!({"name": format!("ghost-{i}"), "uid": format!("00000000-0000-0000-0000-{i:012}")});
        forge_claim(&tenant_claims, &format!("ghost-{i}-gpu"), &owner, &manager).await?;
    }
    victim_pod_gets_its_claim(ctx, &controller, victim_ns, "after-ghosts").await?;

    // 2. Forged evidence through the controller itself: a real pod of the tenant whose template does not exist
    //    (so no claim is created for it), and a claim the tenant made for it, which the controller adopts and
    //    records in the pod's status: a pod status naming a claim another manager created, written by gpu-dra.
    let bait_pod = tenant_pod(&tenant, tenant_ns, "bait").await?;
    let owner = json!({"name": "bait", "uid": bait_pod.uid().context("pod without uid")?});
    forge_claim(&tenant_claims, "bait-gpu-forged", &owner, "kube-controller-manager").await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), tenant_ns);
    wait::until("the forged claim of the tenant's pod to be adopted", SETTLE, || async {
        let recorded = claim_statuses(&pods.get("bait").await?);
        Ok((recorded.first().and_then(|r| r.1.as_deref()) == Some("bait-gpu-forged")).then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    // The premise: the tenant cannot write a pod status itself.
    let status = json!({"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "ghost-1-gpu"}]}});
    let bait: Api<Pod> = Api::namespaced(tenant.clone(), tenant_ns);
    match bait.patch_status("bait", &PatchParams::default(), &Patch::Merge(&status)).await {
        Err(kube::Error::Api(err)) if err.code == 403 => {}
        other => anyhow::bail!("the tenant could write pods/status: {other:?}"),
    }
    victim_pod_gets_its_claim(ctx, &controller, victim_ns, "after-adoption").await?;

    // 3. The claim gpu-dra created and recorded for a tenant's pod, its managed fields rewritten by the tenant
    //    (`[{}]` clears them; the tenant's patch is then their only entry): gpu-dra no longer among its writers.
    let tenant_templates =
        Api::<kube::api::DynamicObject>::namespaced_with(tenant.clone(), tenant_ns, &template_resource());
    for name in ["tenant-gpu", "tenant-gpu-2"] {
        let template: kube::api::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name}, "spec": one_gpu()
        }))?;
        tenant_templates.create(&PostParams::default(), &template).await?;
    }
    let tenant_pods: Api<Pod> = Api::namespaced(tenant.clone(), tenant_ns);
    tenant_pods.create(&PostParams::default(), &pod("stripped", "tenant-gpu")?).await?;
    let stripped = recorded_claim(&pods, "stripped").await.with_context(|| controller.log_tail())?;
    let clear = json!({"metadata": {"managedFields": [{}]}});
    tenant_claims.patch(&stripped, &PatchParams::default(), &Patch::Merge(&clear)).await?;
    let managers: Vec<String> =
        tenant_claims.get(&stripped).await?.managed_fields().iter().filter_map(|m| m.manager.clone()).collect();
    ensure!(!managers.iter().any(|m| m == "gpu-dra-controller"), "the tenant's patch kept gpu-dra: {managers:?}");
    victim_pod_gets_its_claim(ctx, &controller, victim_ns, "after-stripping").await?;

    // 4. The claim gpu-dra created and recorded, deleted by the tenant with its template (so none replaces it) and
    //    made again under the same name, owner and annotation by the tenant, as kube-controller-manager.
    tenant_pods.create(&PostParams::default(), &pod("swapped", "tenant-gpu-2")?).await?;
    let swapped = recorded_claim(&pods, "swapped").await.with_context(|| controller.log_tail())?;
    tenant_templates.delete("tenant-gpu-2", &DeleteParams::default()).await?;
    tenant_claims.delete(&swapped, &DeleteParams::default()).await?;
    wait::until("the tenant's deletion of the recorded claim", SETTLE, || async {
        Ok(tenant_claims.get_opt(&swapped).await?.is_none().then_some(()))
    })
    .await?;
    let owner = json!({"name": "swapped", "uid": pods.get("swapped").await?.uid().context("pod without uid")?});
    forge_claim(&tenant_claims, &swapped, &owner, "kube-controller-manager").await?;
    victim_pod_gets_its_claim(ctx, &controller, victim_ns, "after-swapping").await?;

    let (_, body) = controller.get("/metrics").await?;
    for (metric, value) in
        [("gpu_dra_controller_observe_only", 0.0), ("gpu_dra_controller_another_claim_controller_detected", 0.0)]
    {
        ensure!(sample(&body, metric, &[]) == Some(value), "{metric} is not {value}:\n{}", controller.log_tail());
    }
    ensure!(!body.contains("tenant-manager"), "a field-manager name the tenant chose is a label value:\n{body}");
    // Bounded: kube-controller-manager or other, whatever the tenant wrote (the garbage collector removes the
    // claims of pods that never existed meanwhile, so only the adopted one is sure to be counted).
    let foreign_lines: Vec<&str> =
        body.lines().filter(|l| l.starts_with("gpu_dra_controller_foreign_claims{")).collect();
    ensure!(
        foreign_lines
            .iter()
            .all(|l| l.contains("field_manager=\"kube-controller-manager\"") || l.contains("field_manager=\"other\"")),
        "{foreign_lines:?}"
    );
    let adopted = sample(&body, "gpu_dra_controller_foreign_claims", &[("field_manager", "kube-controller-manager")]);
    ensure!(adopted.is_some_and(|n| n >= 1.0), "the adopted forged claim is not counted: {foreign_lines:?}");
    let log = controller.log_text();
    ensure!(!log.contains("OBSERVE-ONLY"), "turned observe-only:\n{}", controller.log_tail());

    // 5. A template whose opaque parameters nest 200 deep: the API server takes any JSON object of up to 10 KiB
    //    there. Parsed as a tree (serde_json stops at 128 levels) it made the whole template list undecodable: a
    //    controller started after it (a restart, a failover, a relist) never synced, and no pod of any namespace
    //    got a claim. The tenant's own pod gets its claim, with the parameters exactly as written.
    let mut deep = json!(0);
    for _ in 0..200 {
        deep = json!([deep]);
    }
    let mut spec = one_gpu();
    let parameters = json!({"apiVersion": "gpu.gpu-dra.dev/v1alpha1", "kind": "GpuConfig", "x": deep});
    spec["spec"]["devices"]["config"] = json!([{"opaque": {"driver": "gpu.gpu-dra.dev", "parameters": parameters}}]);
    let template: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "deep"}, "spec": spec
    }))?;
    match tenant_templates.create(&PostParams::default(), &template).await {
        // Created: only the test's client cannot read the answer back.
        Ok(_) | Err(kube::Error::SerdeError(_)) => {}
        Err(error) => return Err(error).context("the tenant creates the deep template"),
    }
    tenant_pods.create(&PostParams::default(), &pod("deep", "deep")?).await?;
    let deep_claim = recorded_claim(&pods, "deep").await.with_context(|| controller.log_tail())?;
    controller.kill()?;
    let restarted = Component::start(&ctx.cluster.kubeconfig(), tenant_ns, &args)?;
    restarted.wait_ready().await?;
    victim_pod_gets_its_claim(ctx, &restarted, victim_ns, "after-deep-template").await?;
    let path = format!("/apis/resource.k8s.io/v1/namespaces/{tenant_ns}/resourceclaims/{deep_claim}");
    let text = ctx.client.request_text(http::Request::get(path).body(Vec::new())?).await?;
    let nested = format!("{}0{}", "[".repeat(200), "]".repeat(200));
    ensure!(text.contains(&nested), "the claim's parameters are not the template's: {text}");
    Ok(())
}

/// The claim the pod's status records, once it does.
async fn recorded_claim(pods: &Api<Pod>, name: &str) -> anyhow::Result<String> {
    wait::until(&format!("pod {name} to record its claim"), SETTLE, || async {
        Ok(claim_statuses(&pods.get(name).await?).first().and_then(|s| s.1.clone()))
    })
    .await
}

/// A claim that looks generated for a pod: the pod-claim-name annotation and a Pod as controlling owner, created
/// under `manager`'s name.
async fn forge_claim(api: &Api<ResourceClaim>, name: &str, owner: &Value, manager: &str) -> anyhow::Result<()> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "annotations": {ANNOTATION: "gpu"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": owner["name"], "uid": owner["uid"], "controller": true}]
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": support::objects::CLASS}}]}}
    }))?;
    let params = PostParams { field_manager: Some(manager.to_string()), ..Default::default() };
    api.create(&params, &claim).await.with_context(|| format!("the tenant creates claim {name}"))?;
    Ok(())
}

/// A pod of the tenant with one template claim whose template does not exist.
async fn tenant_pod(tenant: &Client, namespace: &str, name: &str) -> anyhow::Result<Pod> {
    Ok(Api::namespaced(tenant.clone(), namespace).create(&PostParams::default(), &pod(name, "not-yet")?).await?)
}

/// A pod, kept away from the scheduler, with one pod claim `gpu` from `template`.
fn pod(name: &str, template: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "nodeSelector": {"gpu-dra.dev/test-no-node": "true"}
        }
    }))?)
}

/// A pod in the victim's namespace gets a claim created by gpu-dra's controller, recorded in its status.
async fn victim_pod_gets_its_claim(
    ctx: &TestContext,
    controller: &Component,
    namespace: &str,
    name: &str,
) -> anyhow::Result<()> {
    let templates =
        Api::<kube::api::DynamicObject>::namespaced_with(ctx.client.clone(), namespace, &template_resource());
    if templates.get_opt("one-gpu").await?.is_none() {
        let template: kube::api::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-gpu"}, "spec": one_gpu()
        }))?;
        templates.create(&PostParams::default(), &template).await?;
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    pods.create(&PostParams::default(), &pod(name, "one-gpu")?).await?;
    let claim = wait::until(&format!("victim pod {name} to record its claim"), SETTLE, || async {
        Ok(claim_statuses(&pods.get(name).await?).first().and_then(|s| s.1.clone()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    let claim = Api::<ResourceClaim>::namespaced(ctx.client.clone(), namespace).get(&claim).await?;
    let managers: Vec<String> = claim.managed_fields().iter().filter_map(|m| m.manager.clone()).collect();
    ensure!(managers.iter().any(|m| m == "gpu-dra-controller"), "claim {} written by {managers:?}", claim.name_any());
    Ok(())
}

/// A client with the rights of a tenant in the test namespace: the parts of the `edit` role this test uses
/// (pods, claims and templates), and, like `edit`, no `pods/status`.
async fn tenant_client(ctx: &TestContext) -> anyhow::Result<Client> {
    let rules = json!([
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list", "watch", "patch", "update"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims", "resourceclaimtemplates"],
         "verbs": ["create", "delete", "get", "list", "watch", "patch", "update"]}
    ]);
    let token = support::objects::service_account_with_rules(ctx, "tenant", rules).await?;
    let path = ctx.cluster.kubeconfig_for_token(&format!("{}-tenant", ctx.namespace), &token)?;
    let config =
        kube::Config::from_custom_kubeconfig(Kubeconfig::read_from(path)?, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}
