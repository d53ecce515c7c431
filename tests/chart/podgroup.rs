//! A PodGroup's claim (KEP-5729) handled end to end by the controller under its chart ServiceAccount, on a
//! control plane that serves PodGroups: the chart's PodGroup grants (podgroups get/list/watch, podgroups/status
//! patch) and the claim grants they lean on.

use super::*;
use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};

fn api(ctx: &TestContext, group: &str, version: &str, kind: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
    Api::namespaced_with(ctx.client.clone(), &ctx.namespace, &resource)
}

fn recorded(object: &DynamicObject) -> Option<String> {
    let statuses = object.data["status"]["resourceClaimStatuses"].as_array()?;
    statuses.iter().find(|s| s["name"] == "gpu")?["resourceClaimName"].as_str().map(str::to_string)
}

/// Two workers of a PodGroup sharing its one claim on a one-GPU node, then the job goes: the controller (watching
/// PodGroups, applying their status, creating the group's claim, dropping the group's reservation) must do all of
/// it with the chart's grants, and the claim is released and deleted.
pub(super) async fn pod_group_claim_end_to_end(ctx: &TestContext, controller: &Component) -> anyhow::Result<()> {
    ensure!(
        controller.log_text().contains("PodGroup claims are handled"),
        "the controller does not handle PodGroups under the chart's account:\n{}",
        controller.log_tail()
    );
    let node = objects::fake_gpu_node(ctx, 1).await?;
    let request = json!({"name": "gpu", "exactly": {"deviceClassName": node.class}});
    create_template(ctx, "group-gpu", json!({"spec": {"devices": {"requests": [request]}}})).await?;
    let claim_ref = json!([{"name": "gpu", "resourceClaimTemplateName": "group-gpu"}]);
    let groups = api(ctx, "scheduling.k8s.io", "v1beta1", "PodGroup");
    let group: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "metadata": {"name": "trainers"},
        "spec": {"schedulingPolicy": {"basic": {}}, "resourceClaims": claim_ref}
    }))?;
    groups.create(&PostParams::default(), &group).await.context("create the PodGroup")?;
    let pods = api(ctx, "", "v1", "Pod");
    for name in ["worker-0", "worker-1"] {
        let pod: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "train", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "resourceClaims": claim_ref, "schedulingGroup": {"podGroupName": "trainers"},
                     "nodeSelector": {"kubernetes.io/hostname": node.name}}
        }))?;
        pods.create(&PostParams::default(), &pod).await.with_context(|| format!("create {name}"))?;
    }

    let claim = wait::until("the PodGroup to record its claim", SETTLE, || async {
        Ok(recorded(&groups.get("trainers").await?))
    })
    .await
    .with_context(|| controller.log_tail())?;
    for name in ["worker-0", "worker-1"] {
        wait::until(&format!("{name} to record the group's claim and be scheduled"), SETTLE, || async {
            let pod = pods.get(name).await?;
            let bound = pod.data["spec"]["nodeName"].as_str().is_some();
            Ok((recorded(&pod).as_deref() == Some(claim.as_str()) && bound).then_some(()))
        })
        .await
        .with_context(|| controller.log_tail())?;
    }
    let claims = objects::claims(ctx);
    let stored = claims.get(&claim).await?;
    ensure!(stored.owner_references().first().is_some_and(|o| o.kind == "PodGroup"), "{claim} is not the group's");
    let reserved = stored.status.and_then(|s| s.reserved_for).unwrap_or_default();
    ensure!(
        reserved.iter().map(|r| r.resource.as_str()).collect::<Vec<_>>() == ["podgroups"],
        "the claim must be reserved for the PodGroup only: {reserved:?}"
    );

    for name in ["worker-0", "worker-1"] {
        pods.delete(name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    }
    groups.delete("trainers", &DeleteParams::background()).await?;
    wait::until("the group's claim to be released and deleted", SETTLE, || async {
        Ok(claims.get_opt(&claim).await?.is_none().then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    Ok(())
}
