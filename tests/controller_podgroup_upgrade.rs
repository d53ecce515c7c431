//! PodGroups that become served while the controller runs (a cluster upgraded, `GenericWorkload` turned on):
//! the controller starts on a cluster without them, the API server is restarted with the PodGroup API, and
//! PodGroup claims are handled from then on without a restart of the controller. Runs on a cluster of its own:
//! it restarts the API server.

mod support;

use std::time::Duration;

use anyhow::{Context as _, ensure};
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use support::objects::{self, create_template};
use support::process::Component;
use support::{TestContext, podgroup, wait};

/// Discovery is re-run every 30 s while PodGroups are not handled; the restart and the informer's list come on top.
const NOTICED: Duration = Duration::from_secs(75);

fn main() {
    support::run_on_own_cluster(
        "controller_podgroup_upgrade",
        &[test!(pod_groups_served_after_start_are_handled_without_a_restart)],
    )
}

/// Creates `object`, retrying while the restarted API server is not serving it yet (a connection of the old
/// process in the client's pool, the new group version still being registered).
async fn create_when_served(api: &Api<DynamicObject>, object: DynamicObject) -> anyhow::Result<()> {
    let name = object.name_any();
    let mut last = None;
    for _ in 0..100 {
        match api.create(&PostParams::default(), &object).await {
            Ok(_) => return Ok(()),
            Err(err) => last = Some(err),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(last.map_or_else(|| anyhow::anyhow!("no attempt"), anyhow::Error::from))
        .with_context(|| format!("create {name}"))
}

/// The controller runs on a cluster without the PodGroup API; then the operator turns it on (API server restarted
/// with `GenericWorkload`, `DRAWorkloadResourceClaims` and `scheduling.k8s.io/v1beta1`) and a training job arrives
/// at once: a PodGroup with a template claim and a worker pod that joins it. The controller must pick PodGroups
/// up by itself: the group gets its one claim, recorded in its status and in the pod's, and the pod never gets
/// a claim of its own (one made before the controller noticed would hold a GPU per member).
async fn pod_groups_served_after_start_are_handled_without_a_restart(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &[]).await?;
    ensure!(
        controller.log_text().contains("does not serve scheduling.k8s.io/v1beta1 podgroups"),
        "the controller did not say PodGroups are not served:\n{}",
        controller.log_tail()
    );

    create_template(&ctx, "one-gpu", objects::one_gpu()).await?;
    let cluster = ctx.cluster.clone();
    tokio::task::spawn_blocking(move || {
        cluster.restart_api_server_with(&[
            ("--feature-gates", "GenericWorkload=true,DRAWorkloadResourceClaims=true"),
            ("--runtime-config", "scheduling.k8s.io/v1beta1=true"),
        ])
    })
    .await??;

    let groups = podgroup::pod_groups(&ctx);
    create_when_served(&groups, podgroup::group_object("trainers", "one-gpu")?).await?;
    let pods = podgroup::raw_pods(&ctx);
    create_when_served(&pods, podgroup::member_object("worker-0", "trainers", "one-gpu", None)?).await?;
    ensure!(
        pods.get("worker-0").await?.data["spec"]["schedulingGroup"]["podGroupName"] == "trainers",
        "the restarted API server dropped spec.schedulingGroup: GenericWorkload is not on"
    );

    let claim = wait::until("the PodGroup to record its claim", NOTICED, || async {
        Ok(podgroup::recorded(&groups.get("trainers").await?))
    })
    .await
    .with_context(|| controller.log_tail())?;
    wait::until("the worker to record the group's claim", NOTICED, || async {
        Ok((podgroup::recorded(&pods.get("worker-0").await?).as_deref() == Some(claim.as_str())).then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    let names: Vec<String> =
        objects::claims(&ctx).list(&ListParams::default()).await?.iter().map(|c| c.name_any()).collect();
    ensure!(names == [claim.clone()], "exactly the group's claim must exist, found {names:?}");
    let owner = objects::claims(&ctx).get(&claim).await?.owner_references().first().map(|o| o.kind.clone());
    ensure!(owner.as_deref() == Some("PodGroup"), "claim {claim} is owned by {owner:?}, not the PodGroup");
    ensure!(
        controller.log_text().contains("PodGroup claims are handled from now on"),
        "the controller did not say it handles PodGroups now:\n{}",
        controller.log_tail()
    );
    Ok(())
}
