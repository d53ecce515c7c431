//! `gpu-dra controller` under faults and load: leader election between replicas, a burst of pods with the
//! controller killed in the middle.

mod support;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use futures::{StreamExt, TryStreamExt};
use kube::ResourceExt;
use serde_json::json;
use support::objects::{self, claim_statuses, create_pod, create_template, list_claims, one_gpu};
use support::process::Component;
use support::{TestContext, wait};

const ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

fn main() {
    support::run(
        "controller_ha",
        &[
            test!(one_leader_writes_and_a_killed_leader_hands_over),
            test!(a_leader_that_loses_the_lease_stops_and_exits),
            test!(burst_with_a_controller_kill_makes_one_claim_per_pod),
        ],
    )
}

const ELECTION: [&str; 4] = [
    "--leader-elect=true",
    "--leader-elect-lease-duration=4s",
    "--leader-elect-renew-deadline=3s",
    "--leader-elect-retry-period=500ms",
];

async fn is_leader(c: &Component) -> anyhow::Result<bool> {
    Ok(c.metric("gpu_dra_controller_leader", &[]).await? == 1.0)
}

async fn wait_claims_recorded(ctx: &TestContext, pods: usize, timeout: Duration) -> anyhow::Result<()> {
    let api = objects::pods(ctx);
    wait::until(&format!("{pods} pods to record their claim"), timeout, || async {
        let list = api.list(&Default::default()).await?;
        let done = list.items.iter().filter(|p| claim_statuses(p).len() == 1).count();
        Ok((done == pods).then_some(()))
    })
    .await
}

async fn one_leader_writes_and_a_killed_leader_hands_over(ctx: TestContext) -> anyhow::Result<()> {
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let a = Component::controller(&ctx, &[&ELECTION[..], &["--identity", "replica-a"]].concat()).await?;
    let b = Component::controller(&ctx, &[&ELECTION[..], &["--identity", "replica-b"]].concat()).await?;
    let (mut leader, follower) = wait::until("exactly one leader", Duration::from_secs(20), || async {
        Ok(match (is_leader(&a).await?, is_leader(&b).await?) {
            (true, false) => Some((true, false)),
            (false, true) => Some((false, true)),
            _ => None,
        })
    })
    .await
    .map(|(a_leads, _)| if a_leads { (a, b) } else { (b, a) })?;

    for i in 0..5 {
        create_pod(&ctx, &format!("p{i}"), json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    }
    wait_claims_recorded(&ctx, 5, Duration::from_secs(30)).await?;
    ensure!(list_claims(&ctx).await?.len() == 5, "duplicate claims with two replicas");
    let follower_syncs = follower.metric("gpu_dra_controller_sync_duration_seconds_count", &[]).await?;
    let follower_creates = follower.metric("dynamic_resource_allocation_resourceclaim_creates_total", &[]).await?;
    ensure!(follower_syncs == 0.0 && follower_creates == 0.0, "the follower worked: {follower_syncs} syncs");
    // Only the leader exports kube-controller-manager's claim and queue metrics, as only a leading KCM runs the
    // controller: a standby would double every claim count and show a queue no worker drains.
    let (_, exported) = follower.get("/metrics").await?;
    let upstream = ["dynamic_resource_allocation_resource_claims", "workqueue_depth", "workqueue_adds_total"];
    let shown: Vec<&str> = upstream.iter().copied().filter(|m| exported.contains(&format!("\n{m}{{"))).collect();
    ensure!(shown.is_empty(), "the follower exports {shown:?}");
    ensure!(leader.metric("dynamic_resource_allocation_resource_claims", &[]).await? > 0.0, "the leader's claims");

    // Churn the standby must not hoard (Job pods come and go): pods created, given claims by the leader, deleted.
    const CHURNED: usize = 40;
    for i in 0..CHURNED {
        create_pod(&ctx, &format!("job-{i}"), json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    }
    wait_claims_recorded(&ctx, 5 + CHURNED, Duration::from_secs(60)).await?;
    let pods = objects::pods(&ctx);
    for i in 0..CHURNED {
        pods.delete(&format!("job-{i}"), &Default::default()).await?;
    }
    wait::until("the churned pods' claims to go", Duration::from_secs(60), || async {
        Ok((list_claims(&ctx).await?.len() == 5).then_some(()))
    })
    .await?;

    // The leader dies without releasing the Lease: the follower takes over once it expires (4 s).
    leader.kill()?;
    let killed = Instant::now();
    wait::until("the follower to take over", Duration::from_secs(15), || async {
        Ok(is_leader(&follower).await?.then_some(()))
    })
    .await?;
    let handover = killed.elapsed();
    eprintln!("handover after SIGKILL of the leader: {handover:?} (lease duration 4 s)");
    ensure!(handover < Duration::from_secs(10), "handover took {handover:?}");
    // The new leader's queue began with what its caches show (5 pods, 5 claims), not every key it saw standing by.
    let adds = follower.metric("workqueue_adds_total", &[("name", "resource_claim")]).await?;
    ensure!(adds < CHURNED as f64, "the new leader's queue took {adds} keys: the standby kept the churned pods'");
    create_pod(&ctx, "after", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    wait_claims_recorded(&ctx, 6, Duration::from_secs(30)).await?;
    ensure!(list_claims(&ctx).await?.len() == 6, "duplicate claims after handover");
    Ok(())
}

async fn burst_with_a_controller_kill_makes_one_claim_per_pod(ctx: TestContext) -> anyhow::Result<()> {
    const PODS: usize = 1000;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let mut controller = Component::controller(&ctx, &[]).await?;
    let started = Instant::now();
    let creating = futures::stream::iter(0..PODS)
        .map(|i| {
            let ctx = ctx.clone();
            async move {
                create_pod(
                    &ctx,
                    &format!("burst-{i:04}"),
                    json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]),
                )
                .await
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>();
    // Kill the controller once it is in the middle of the burst, then start a new one.
    let killing = async {
        wait::until("a third of the claims", Duration::from_secs(120), || async {
            Ok((list_claims(&ctx).await?.len() >= PODS / 3).then_some(()))
        })
        .await?;
        controller.kill()?;
        anyhow::Ok(list_claims(&ctx).await?.len())
    };
    let (created, at_kill) = tokio::join!(creating, killing);
    created?;
    let at_kill = at_kill?;
    let _restarted = Component::controller(&ctx, &[]).await?;
    wait_claims_recorded(&ctx, PODS, Duration::from_secs(150)).await?;
    eprintln!("{PODS} pods, killed at {at_kill} claims: all recorded after {:?}", started.elapsed());

    let claims = list_claims(&ctx).await?;
    let pods = objects::pods(&ctx).list(&Default::default()).await?.items;
    let by_name: HashMap<String, &k8s_openapi::api::resource::v1::ResourceClaim> =
        claims.iter().map(|c| (c.name_any(), c)).collect();
    let mut owners = HashSet::new();
    for claim in &claims {
        let owner = claim.owner_references().first().map(|o| o.uid.clone()).context("claim without owner")?;
        ensure!(
            owners.insert((owner, claim.annotations().get(ANNOTATION).cloned())),
            "duplicate claim {}",
            claim.name_any()
        );
    }
    for pod in &pods {
        let name = claim_statuses(pod)[0].1.clone().context("no claim recorded")?;
        let claim =
            by_name.get(&name).with_context(|| format!("pod {} records missing claim {name}", pod.name_any()))?;
        ensure!(claim.owner_references()[0].uid == pod.uid().unwrap_or_default(), "claim {name} not owned by its pod");
    }
    ensure!(claims.len() == PODS, "{} claims for {PODS} pods", claims.len());
    Ok(())
}

/// Someone else takes the Lease (as after a network partition): the old leader must stop writing and exit.
async fn a_leader_that_loses_the_lease_stops_and_exits(ctx: TestContext) -> anyhow::Result<()> {
    let mut leader = Component::controller(&ctx, &[&ELECTION[..], &["--identity", "replica-a"]].concat()).await?;
    wait::until("leadership", Duration::from_secs(20), || async { Ok(is_leader(&leader).await?.then_some(())) })
        .await?;
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let now = k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string();
    let taken = json!({"spec": {"holderIdentity": "intruder", "renewTime": now, "leaseDurationSeconds": 60}});
    leases.patch("gpu-dra-controller", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&taken)).await?;
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = leader.try_wait()? {
            break status;
        }
        ensure!(Instant::now() < deadline, "still running after losing the lease:\n{}", leader.log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(!status.success(), "exit status {status}");
    let log = leader.log_text();
    ensure!(log.contains("lost leadership") && log.contains("lost the lease"), "{}", leader.log_tail());
    Ok(())
}
