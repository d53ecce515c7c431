//! The controller when the API server did what was asked but its answer cannot be decoded (a proxy in the path
//! mangling a body, a server answering in another shape): a claim create answered with something that is not a
//! claim. The real API server runs behind the test's proxy ([`ApiProxy`]), which garbles exactly that answer.

use anyhow::{Context as _, ensure};
use http::Method;
use kube::ResourceExt;
use serde_json::json;

use super::support::api_proxy::ApiProxy;
use super::support::objects::{claim_statuses, create_pod, create_template, list_claims, one_gpu};
use super::support::process::Component;
use super::support::{TestContext, wait};
use super::{SETTLE, wait_recorded};

/// The claim POST succeeds on the server but its answer is garbled: the sync fails as `decode_claim` (not as a
/// failed create), the claim the server made arrives through the informer and is the one recorded in the pod's
/// status, and the namespace ends with exactly that claim (one a retry may have created meanwhile is deleted as a
/// duplicate).
pub(super) async fn a_claim_created_but_answered_garbled_is_recorded_once(ctx: TestContext) -> anyhow::Result<()> {
    let proxy = ApiProxy::start(ctx.client.clone()).await?;
    proxy.garble_next(Method::POST, "/resourceclaims", 1);
    let args = ["controller", "--namespace", ctx.namespace.as_str(), "--leader-elect=false"];
    let controller = Component::start(proxy.kubeconfig(), &ctx.namespace, &args)?;
    controller.wait_ready().await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    create_pod(&ctx, "trainer", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;

    let recorded = wait_recorded(&ctx, "trainer", 1).await?;
    let name = claim_statuses(&recorded)[0].1.clone().context("status entry without a claim name")?;
    ensure!(proxy.garbled() == 1, "the proxy garbled {} answers, expected the first claim create's", proxy.garbled());
    wait::until("exactly the recorded claim to be left", SETTLE, || async {
        let claims = list_claims(&ctx).await?;
        Ok((claims.len() == 1 && claims[0].name_any() == name).then_some(()))
    })
    .await
    .with_context(|| format!("controller log:\n{}", controller.log_tail()))?;
    let decode = [("kind", "pod"), ("result", "decode_claim")];
    let failed = controller.metric("gpu_dra_controller_sync_duration_seconds_count", &decode).await?;
    ensure!(failed >= 1.0, "no pod sync failed as decode_claim:\n{}", controller.log_tail());
    let failed_creates =
        controller.metric("dynamic_resource_allocation_resourceclaim_creates_total", &[("status", "failure")]).await?;
    ensure!(failed_creates == 0.0, "a create the server carried out counted as failed");
    ensure!(
        controller.log_text().contains("decode the ResourceClaim the API server returned"),
        "the log does not say what went wrong:\n{}",
        controller.log_tail()
    );
    Ok(())
}
