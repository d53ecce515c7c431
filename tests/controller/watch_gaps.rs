//! The controller across a watch gap: while an API server restarts (a control-plane upgrade, a rolling restart of
//! its replicas) the controller's watches are down, and the restarted server answers their resumption with 410 Gone
//! (the resource version left its watch cache), so the controller lists again. What was deleted in between shows
//! only as missing from that list. The real API server runs behind the test's proxy ([`ApiProxy`]), which ends the
//! watches, holds their resumption while the test deletes, then expires them.

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use super::support::api_proxy::ApiProxy;
use super::support::objects::{self, claim_statuses, create_pod, create_template, one_gpu};
use super::support::process::Component;
use super::support::{TestContext, wait};
use super::{SETTLE, create_bound_pod, reserved, wait_recorded};

/// Two replicas share a claim (`resourceClaimName`, as a Deployment's pods do); one is deleted while the pod watch is
/// down. Its reservation must still be dropped once the controller has listed the pods again, or the claim stays
/// reserved for a pod that no longer exists; a pod created meanwhile must get its claim. Then a pod's generated claim
/// is deleted while the claim watch is down: the pod must get a new one, also when the watch never showed it.
pub(super) async fn what_was_deleted_while_the_watches_were_down_is_handled_after_the_relist(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let (proxy, controller) = controller_behind_a_proxy(&ctx).await?;
    let ns = ctx.namespace.clone();
    let claims = objects::claims(&ctx);
    let pods = objects::pods(&ctx);

    create_template(&ctx, "one-gpu", one_gpu()).await?;
    objects::create_claim(&ctx, "shared").await?;
    objects::allocate(&ctx, "shared", json!([]), true).await?;
    for replica in ["replica-a", "replica-b"] {
        create_bound_pod(&ctx, replica, json!([{"name": "gpu", "resourceClaimName": "shared"}])).await?;
    }
    wait::until("the shared claim to be reserved for both replicas", SETTLE, || async {
        let mut names = reserved(&claims.get("shared").await?);
        names.sort();
        Ok((names == ["replica-a", "replica-b"]).then_some(()))
    })
    .await?;

    cut_watches(&proxy, &format!("/namespaces/{ns}/pods")).await?;
    pods.delete("replica-a", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    wait::until("replica-a to be gone", SETTLE, || async {
        Ok(pods.get_opt("replica-a").await?.is_none().then_some(()))
    })
    .await?;
    create_pod(&ctx, "newcomer", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    proxy.expire_held_watches();
    wait::until("replica-a's reservation to be dropped after the relist", SETTLE, || async {
        Ok((reserved(&claims.get("shared").await?) == ["replica-b"]).then_some(()))
    })
    .await
    .with_context(|| format!("controller log:\n{}", controller.log_tail()))?;
    wait_recorded(&ctx, "newcomer", 1).await.with_context(|| format!("controller log:\n{}", controller.log_tail()))?;

    create_pod(&ctx, "trainer", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let recorded = wait_recorded(&ctx, "trainer", 1).await?;
    let first = claim_statuses(&recorded)[0].1.clone().context("status entry without a claim name")?;
    cut_watches(&proxy, &format!("/namespaces/{ns}/resourceclaims")).await?;
    delete_claim(&ctx, &first).await?;
    proxy.expire_held_watches();
    let second = new_claim_after_relist(&ctx, "trainer", &first).await.with_context(|| controller.log_tail())?;

    // A claim the controller creates while its claim watch is down, deleted before the watch resumes: the controller
    // knows it only from its create's answer, and the relist does not show it. Before, it was taken for existing as
    // long as the pod lived, and the pod never got another.
    cut_watches(&proxy, &format!("/namespaces/{ns}/resourceclaims")).await?;
    create_pod(&ctx, "latecomer", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let recorded = wait_recorded(&ctx, "latecomer", 1).await?;
    let unseen = claim_statuses(&recorded)[0].1.clone().context("status entry without a claim name")?;
    delete_claim(&ctx, &unseen).await?;
    proxy.expire_held_watches();
    let replaced = new_claim_after_relist(&ctx, "latecomer", &unseen).await.with_context(|| controller.log_tail())?;
    eprintln!(
        "after the relists: replica-a's reservation dropped; claim {first} replaced by {second}; {unseen}, never \
         seen by the watch, replaced by {replaced}"
    );
    Ok(())
}

/// A controller for the test's namespace talking to the API server through the test's proxy, ready.
/// etcd restored from a backup (or an API server whose watch cache lags behind the others'): the controller's watches
/// resume from a resource version the server has not reached, and the server refuses them (504, the version too
/// large, `Retry-After: 1`) for as long as its own revision is lower. client-go retries such a request ten times and
/// its reflector then lists again from the server's current state; kube's watcher retried the same version for ever,
/// so the controller saw no new pod (and, once etcd's revision passed the old one, would have resumed without the
/// pods created in between), and kube's client first retried each refused watch 15 times, backing off to minutes.
/// A pod created meanwhile must get its claim, and a claim deleted while the claim watch is refused must be
/// replaced, each within the usual settling time.
pub(super) async fn a_watch_refused_as_newer_than_the_server_lists_again(ctx: TestContext) -> anyhow::Result<()> {
    let (proxy, controller) = controller_behind_a_proxy(&ctx).await?;
    let ns = ctx.namespace.clone();
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let (claims, pods) = (objects::claims(&ctx), objects::pods(&ctx));

    cut_watches(&proxy, &format!("/namespaces/{ns}/pods")).await?;
    proxy.restore_held_watches();
    let started = Instant::now();
    create_pod(&ctx, "after-restore", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let first = wait::until("the pod created after the restore to record its claim", SETTLE, || async {
        Ok(claim_statuses(&pods.get("after-restore").await?).first().and_then(|s| s.1.clone()))
    })
    .await
    .with_context(|| format!("controller log:\n{}", controller.log_tail()))?;
    let pod_took = started.elapsed();

    cut_watches(&proxy, &format!("/namespaces/{ns}/resourceclaims")).await?;
    delete_claim(&ctx, &first).await?;
    proxy.restore_held_watches();
    let second = wait::until("a new claim once the claims are listed again", SETTLE, || async {
        let name = claim_statuses(&pods.get("after-restore").await?).first().and_then(|s| s.1.clone());
        Ok(match name.filter(|n| *n != first) {
            Some(name) => claims.get_opt(&name).await?.map(|_| name),
            None => None,
        })
    })
    .await
    .with_context(|| controller.log_tail())?;
    let listed_again = controller.log_text().matches("listing again").count();
    ensure!(
        listed_again == 2,
        "the controller said it listed again {listed_again} times, not 2:\n{}",
        controller.log_tail()
    );
    eprintln!(
        "after the refused watches: the new pod got {first} after {pod_took:.1?}, replaced by {second} once deleted"
    );
    Ok(())
}

async fn controller_behind_a_proxy(ctx: &TestContext) -> anyhow::Result<(ApiProxy, Component)> {
    let proxy = ApiProxy::start(ctx.client.clone()).await?;
    let args = ["controller", "--namespace", ctx.namespace.as_str(), "--leader-elect=false"];
    let controller = Component::start(proxy.kubeconfig(), &ctx.namespace, &args)?;
    controller.wait_ready().await?;
    Ok((proxy, controller))
}

/// Ends the controller's watches of `path_suffix` and waits until it watches again (held by the proxy).
async fn cut_watches(proxy: &ApiProxy, path_suffix: &str) -> anyhow::Result<()> {
    proxy.cut_watches(path_suffix);
    wait::until(&format!("the controller to watch {path_suffix} again (held)"), SETTLE, || async {
        Ok((proxy.held_watches() > 0).then_some(()))
    })
    .await
}

/// Deletes the claim `name` and waits until it is gone.
async fn delete_claim(ctx: &TestContext, name: &str) -> anyhow::Result<()> {
    let claims = objects::claims(ctx);
    claims.delete(name, &DeleteParams::default()).await?;
    wait::until(&format!("claim {name} to be gone"), SETTLE, || async {
        Ok(claims.get_opt(name).await?.is_none().then_some(()))
    })
    .await
}

/// Waits until pod `pod` records a claim other than `old` that exists; returns its name.
async fn new_claim_after_relist(ctx: &TestContext, pod: &str, old: &str) -> anyhow::Result<String> {
    let (claims, pods) = (objects::claims(ctx), objects::pods(ctx));
    wait::until(&format!("{pod} to get a new claim after the relist"), SETTLE, || async {
        let recorded = pods.get(pod).await?;
        let name = claim_statuses(&recorded).first().and_then(|s| s.1.clone()).filter(|n| n != old);
        Ok(match name {
            Some(name) => claims.get_opt(&name).await?.map(|_| name),
            None => None,
        })
    })
    .await
}

/// A worker pod deleted and created again under its name (a StatefulSet's, LeaderWorkerSet's or training job's
/// worker after a failure) while the controller's pod watch lags: its cache still holds the old pod of that name.
/// The new pod's reservation of a shared claim, added by the scheduler, and the claim the scheduler made for the new
/// pod's extended resources must survive: a cached pod of another UID is not proof that the consumer or owner was
/// replaced. kube-controller-manager v1.37.2 takes it for proof (`controller.go` syncClaim: `pod.UID !=
/// reservedFor.UID`, and the owner check before deleting), dropping the new pod's reservation (the claim then
/// deallocated under a bound pod) and deleting its extended-resource claim. Once the watch resumes, the old pod's
/// reservation goes.
pub(super) async fn a_pod_created_again_under_its_name_keeps_its_claims_while_the_pod_watch_lags(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let (proxy, controller) = controller_behind_a_proxy(&ctx).await?;
    let ns = ctx.namespace.clone();
    let (claims, pods) = (objects::claims(&ctx), objects::pods(&ctx));
    let named = json!([{"name": "gpu", "resourceClaimName": "shared"}]);

    objects::create_claim(&ctx, "shared").await?;
    objects::allocate(&ctx, "shared", json!([]), true).await?;
    let old = create_bound_pod(&ctx, "worker-0", named.clone()).await?;
    wait::until("the shared claim to be reserved for worker-0", SETTLE, || async {
        Ok((reserved(&claims.get("shared").await?) == ["worker-0"]).then_some(()))
    })
    .await?;

    cut_watches(&proxy, &format!("/namespaces/{ns}/pods")).await?;
    pods.delete("worker-0", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    wait::until("the first worker-0 to be gone", SETTLE, || async {
        Ok(pods.get_opt("worker-0").await?.filter(|p| p.metadata.uid == old.metadata.uid).is_none().then_some(()))
    })
    .await?;
    let new = create_bound_pod(&ctx, "worker-0", named).await?;
    let (old_uid, new_uid) =
        (old.metadata.uid.clone().unwrap_or_default(), new.metadata.uid.clone().unwrap_or_default());
    // The scheduler's part: the new pod's reservation beside the old one (still there: the controller has not seen
    // the old pod go), and a claim for the new pod's extended resources, owned by it.
    let claim_syncs = [("kind", "claim"), ("result", "success")];
    let synced = controller.metric("gpu_dra_controller_sync_duration_seconds_count", &claim_syncs).await?;
    let consumer = |uid: &str| json!({"resource": "pods", "name": "worker-0", "uid": uid});
    let status = json!({"status": {"reservedFor": [consumer(&old_uid), consumer(&new_uid)]}});
    claims.patch_status("shared", &PatchParams::default(), &Patch::Merge(&status)).await?;
    let extended: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "worker-0-extended-resources-abcde",
                     "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "worker-0", "uid": new_uid,
                                          "controller": true, "blockOwnerDeletion": true}]},
        "spec": objects::one_gpu()["spec"]
    }))?;
    claims.create(&PostParams::default(), &extended).await?;

    let reserved_uids = || async {
        let claim = claims.get("shared").await?;
        let uids: Vec<String> =
            claim.status.and_then(|s| s.reserved_for).unwrap_or_default().into_iter().map(|r| r.uid).collect();
        anyhow::Ok(uids)
    };
    // Both claims synced since (their watch events queue them), so the checks below look at what the syncs did.
    wait::until("the controller to sync both claims", SETTLE, || async {
        let now = controller.metric("gpu_dra_controller_sync_duration_seconds_count", &claim_syncs).await?;
        Ok((now >= synced + 2.0).then_some(()))
    })
    .await?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let uids = reserved_uids().await?;
        ensure!(
            uids.contains(&new_uid),
            "the new worker-0's reservation was dropped while the pod watch lagged: {uids:?}\ncontroller log:\n{}",
            controller.log_tail()
        );
        ensure!(
            claims.get_opt("worker-0-extended-resources-abcde").await?.is_some(),
            "the new worker-0's extended-resource claim was deleted while the pod watch lagged\ncontroller log:\n{}",
            controller.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    proxy.expire_held_watches();
    wait::until("the old worker-0's reservation to go after the relist", SETTLE, || async {
        Ok((reserved_uids().await? == [new_uid.clone()]).then_some(()))
    })
    .await
    .with_context(|| format!("controller log:\n{}", controller.log_tail()))?;
    ensure!(
        claims.get_opt("worker-0-extended-resources-abcde").await?.is_some(),
        "the new worker-0's extended-resource claim was deleted after the relist"
    );
    Ok(())
}
