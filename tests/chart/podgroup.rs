//! A PodGroup's claim (KEP-5729) handled end to end by the controller under its chart ServiceAccount, on a
//! control plane that serves PodGroups: the chart's PodGroup grants (podgroups get/list/watch, podgroups/status
//! patch) and the claim grants they lean on (resourceclaims/binding to drop the group's reservation).

use super::*;
use kube::ResourceExt;
use support::podgroup;

/// Two workers of a PodGroup sharing its one claim on a one-GPU node, then the job goes: the controller (watching
/// PodGroups, applying their status, creating the group's claim, dropping the group's reservation) must do all of
/// it with the chart's grants, and the claim is released and deleted. Before 1.37 (no PodGroup API) the controller
/// under the same grants says so and goes on without PodGroups, as the README's version table documents.
pub(super) async fn pod_group_claim_end_to_end(ctx: &TestContext, controller: &Component) -> anyhow::Result<()> {
    if !super::serves_pod_groups() {
        ensure!(
            controller.log_text().contains("PodGroup claims are not handled"),
            "the controller does not say that PodGroups are not served:\n{}",
            controller.log_tail()
        );
        return Ok(());
    }
    ensure!(
        controller.log_text().contains("PodGroup claims are handled"),
        "the controller does not handle PodGroups under the chart's account:\n{}",
        controller.log_tail()
    );
    let node = objects::fake_gpu_node(ctx, 1).await?;
    let request = json!({"name": "gpu", "exactly": {"deviceClassName": node.class}});
    create_template(ctx, "group-gpu", json!({"spec": {"devices": {"requests": [request]}}})).await?;
    let workers = ["worker-0", "worker-1"];
    podgroup::create_job(ctx, "trainers", &workers, "group-gpu", &node.name).await?;
    let claim = podgroup::wait_shared_and_scheduled(ctx, "trainers", &workers, controller, SETTLE).await?;
    let claims = objects::claims(ctx);
    let stored = claims.get(&claim).await?;
    ensure!(stored.owner_references().first().is_some_and(|o| o.kind == "PodGroup"), "{claim} is not the group's");
    let reserved = stored.status.and_then(|s| s.reserved_for).unwrap_or_default();
    ensure!(
        reserved.iter().map(|r| r.resource.as_str()).collect::<Vec<_>>() == ["podgroups"],
        "the claim must be reserved for the PodGroup only: {reserved:?}"
    );

    podgroup::delete_job(ctx, "trainers", &workers).await?;
    wait::until("the group's claim to be released and deleted", SETTLE, || async {
        Ok(claims.get_opt(&claim).await?.is_none().then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    Ok(())
}
