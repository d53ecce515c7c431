//! The controller across a watch gap: while an API server restarts (a control-plane upgrade, a rolling restart of
//! its replicas) the controller's watches are down, and the restarted server answers their resumption with 410 Gone
//! (the resource version left its watch cache), so the controller lists again. What was deleted in between shows
//! only as missing from that list. The real API server runs behind the test's proxy ([`ApiProxy`]), which ends the
//! watches, holds their resumption while the test deletes, then expires them.

use anyhow::Context as _;
use kube::api::DeleteParams;
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
    let proxy = ApiProxy::start(ctx.client.clone()).await?;
    let args = ["controller", "--namespace", ctx.namespace.as_str(), "--leader-elect=false"];
    let controller = Component::start(proxy.kubeconfig(), &ctx.namespace, &args)?;
    controller.wait_ready().await?;
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
