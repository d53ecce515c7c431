//! PodGroups (KEP-5729) for the tests that run on a control plane serving them: a training job as a PodGroup
//! with one template claim `gpu` and worker pods that join it, read untyped (`spec.schedulingGroup` and the
//! PodGroup API are newer than the compiled types).

use std::time::Duration;

use anyhow::Context as _;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};

use super::process::Component;
use super::{TestContext, wait};

/// PodGroups of the test's namespace.
pub fn pod_groups(ctx: &TestContext) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("scheduling.k8s.io", "v1beta1", "PodGroup"));
    Api::namespaced_with(ctx.client.clone(), &ctx.namespace, &resource)
}

/// Pods of the test's namespace, untyped.
pub fn raw_pods(ctx: &TestContext) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("", "v1", "Pod"));
    Api::namespaced_with(ctx.client.clone(), &ctx.namespace, &resource)
}

/// The claim a PodGroup's or a pod's status records for the claim `gpu`.
pub fn recorded(object: &DynamicObject) -> Option<String> {
    let statuses = object.data["status"]["resourceClaimStatuses"].as_array()?;
    let entry = statuses.iter().find(|s| s["name"] == "gpu")?;
    entry["resourceClaimName"].as_str().map(str::to_string)
}

/// `spec.resourceClaims` with the one claim `gpu` from `template`.
pub fn claim_ref(template: &str) -> Value {
    json!([{"name": "gpu", "resourceClaimTemplateName": template}])
}

/// The PodGroup `name` with the claim `gpu` from `template`, as an object to create.
pub fn group_object(name: &str, template: &str) -> anyhow::Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "metadata": {"name": name},
        "spec": {"schedulingPolicy": {"basic": {}}, "resourceClaims": claim_ref(template)}
    }))?)
}

/// A worker pod of PodGroup `group` using its claim `gpu` from `template`, on `node` when given.
pub fn member_object(name: &str, group: &str, template: &str, node: Option<&str>) -> anyhow::Result<DynamicObject> {
    let mut spec = json!({
        "containers": [{"name": "train", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": claim_ref(template),
        "schedulingGroup": {"podGroupName": group},
    });
    if let Some(node) = node {
        spec["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    }
    Ok(serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}))?)
}

/// Creates PodGroup `group` and its `members` on `node` (all with the claim `gpu` from `template`).
pub async fn create_job(
    ctx: &TestContext,
    group: &str,
    members: &[&str],
    template: &str,
    node: &str,
) -> anyhow::Result<DynamicObject> {
    let created = pod_groups(ctx).create(&PostParams::default(), &group_object(group, template)?).await;
    let created = created.with_context(|| format!("create PodGroup {group}"))?;
    for name in members {
        let pod = member_object(name, group, template, Some(node))?;
        raw_pods(ctx).create(&PostParams::default(), &pod).await.with_context(|| format!("create pod {name}"))?;
    }
    Ok(created)
}

/// Waits until PodGroup `group` records its claim and every member records the same one and is scheduled;
/// returns the claim's name.
pub async fn wait_shared_and_scheduled(
    ctx: &TestContext,
    group: &str,
    members: &[&str],
    controller: &Component,
    timeout: Duration,
) -> anyhow::Result<String> {
    let (groups, pods) = (pod_groups(ctx), raw_pods(ctx));
    let claim =
        wait::until("the PodGroup to record its claim", timeout, || async { Ok(recorded(&groups.get(group).await?)) })
            .await
            .with_context(|| controller.log_tail())?;
    for name in members {
        wait::until(&format!("{name} to record the group's claim and be scheduled"), timeout, || async {
            let pod = pods.get(name).await?;
            let bound = pod.data["spec"]["nodeName"].as_str().is_some();
            Ok((recorded(&pod).as_deref() == Some(claim.as_str()) && bound).then_some(()))
        })
        .await
        .with_context(|| controller.log_tail())?;
    }
    Ok(claim)
}

/// The job is done: its pods go, then the PodGroup (in the background, as `kubectl delete` does).
pub async fn delete_job(ctx: &TestContext, group: &str, members: &[&str]) -> anyhow::Result<()> {
    for name in members {
        raw_pods(ctx).delete(name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    }
    pod_groups(ctx).delete(group, &DeleteParams::background()).await?;
    Ok(())
}
