//! `gpu-dra controller` beside kube-controller-manager's own resourceclaim-controller (on by default since 1.34):
//! it detects the other controller from the claims kube-controller-manager records in pod statuses, turns
//! observe-only when told to (`--on-another-claim-controller=observe-only`), says so, and no pod ends up with two
//! claims.

mod support;

use std::time::Duration;

use anyhow::{Context as _, ensure};
use kube::{Api, ResourceExt};
use serde_json::json;
use support::objects::{self, claim_statuses, create_pod, create_template, list_claims, one_gpu};
use support::process::Component;
use support::{TestContext, wait};

fn main() {
    support::run_with(
        "controller_beside_kcm",
        true,
        &[test!(turns_observe_only_and_no_pod_gets_two_claims), test!(warns_by_default_and_pods_settle_on_one_claim)],
    )
}

/// Settles when every pod records one existing claim and no other claim is left.
async fn one_claim_per_pod(ctx: &TestContext, pods: usize) -> anyhow::Result<()> {
    let pods_api = objects::pods(ctx);
    wait::until("one claim per pod", Duration::from_secs(60), || async {
        let listed = pods_api.list(&Default::default()).await?.items;
        let claims = list_claims(ctx).await?;
        let names: Vec<String> = claims.iter().map(|c| c.name_any()).collect();
        let recorded: Vec<String> =
            listed.iter().filter_map(|p| claim_statuses(p).first().and_then(|s| s.1.clone())).collect();
        let settled = recorded.len() == pods && claims.len() == pods && recorded.iter().all(|r| names.contains(r));
        Ok(settled.then_some(()))
    })
    .await
}

/// Without `--on-another-claim-controller`, the controller says another controller is active and keeps working:
/// both controllers create, the unused duplicates are removed, and every pod ends with one claim.
async fn warns_by_default_and_pods_settle_on_one_claim(ctx: TestContext) -> anyhow::Result<()> {
    const PODS: usize = 10;
    let controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    for i in 0..PODS {
        create_pod(&ctx, &format!("p{i:02}"), json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    }
    wait::until("the other controller to be detected", Duration::from_secs(30), || async {
        let detected = controller.metric("gpu_dra_controller_another_claim_controller_detected", &[]).await?;
        Ok((detected == 1.0).then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    one_claim_per_pod(&ctx, PODS).await.with_context(|| controller.log_tail())?;
    ensure!(controller.metric("gpu_dra_controller_observe_only", &[]).await? == 0.0, "observe-only without the flag");
    ensure!(controller.log_text().contains("--on-another-claim-controller=observe-only"), "the log names no choice");
    Ok(())
}

async fn turns_observe_only_and_no_pod_gets_two_claims(ctx: TestContext) -> anyhow::Result<()> {
    const PODS: usize = 20;
    let controller = Component::controller(&ctx, &["--on-another-claim-controller=observe-only"]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    for i in 0..PODS {
        create_pod(&ctx, &format!("p{i:02}"), json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    }
    wait::until("observe-only mode", Duration::from_secs(30), || async {
        Ok((controller.metric("gpu_dra_controller_observe_only", &[]).await? == 1.0).then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;

    // Settle: every pod records one existing claim and no other claim is left.
    one_claim_per_pod(&ctx, PODS).await?;
    // Stays settled: nothing creates more claims later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let claims = list_claims(&ctx).await?;
    ensure!(claims.len() == PODS, "{} claims for {PODS} pods", claims.len());

    let log = controller.log_text();
    ensure!(
        log.contains("OBSERVE-ONLY") && log.contains("--controllers=*,-resourceclaim-controller"),
        "log lacks the warning"
    );
    let warned = wait::until("the AnotherClaimControllerActive warning", Duration::from_secs(10), || async {
        let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        let found = events.list(&Default::default()).await?.items.into_iter().find(|e| {
            e.type_.as_deref() == Some("Warning") && e.reason.as_deref() == Some("AnotherClaimControllerActive")
        });
        Ok(found.map(|e| (e.type_.unwrap_or_default(), e.reason.unwrap_or_default(), e.note.unwrap_or_default())))
    })
    .await?;
    ensure!(warned.2.contains("kube-controller-manager") || warned.2.contains("field manager"), "{warned:?}");
    eprintln!(
        "claims created by gpu-dra before it noticed: {}",
        controller.metric("dynamic_resource_allocation_resourceclaim_creates_total", &[("status", "success")]).await?
    );
    Ok(())
}
