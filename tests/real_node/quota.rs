//! A team's Job over its GPU quota on the real node: real containers that finish, the real kubelet unpreparing
//! their claims, kube-controller-manager's job and resourcequota controllers, the chart's controller.

use std::collections::BTreeSet;
use std::time::Instant;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use super::support::{self, TestContext, objects, wait};
use super::{WAIT, allocated, claim_of, claim_uid, install, on_gpu_node, seen_by, specs_of};

/// Each pod lists its GPU, then works this long and exits 0.
const WORK: &str = "ls -l /dev/ | grep ' nvidia[0-9]*$'; echo GPU_DRA_GPU_UUIDS=$GPU_DRA_GPU_UUIDS; echo listed; \
                    sleep 20";

/// In a namespace whose ResourceQuota allows two of the chart's GPUs (`gpu.gpu-dra.dev.deviceclass.resource.k8s.io/
/// devices: 2`), a Job of four one-GPU pods at once on a node of four: two pods get their claims and run, each
/// seeing its own GPU; the other two are refused by the quota (a `FailedResourceClaimCreation` Warning saying
/// "exceeded quota") and wait without a claim, though the node has GPUs free. As the first two finish, the kubelet
/// unprepares their claims, the controller deletes them, the quota controller writes the lower usage, and the
/// waiting pods get their claims within seconds, run with their own GPUs and finish: the Job completes, and no
/// claim or CDI spec is left.
pub(super) async fn a_job_over_its_namespaces_gpu_quota_runs_as_its_pods_finish(
    ctx: TestContext,
) -> anyhow::Result<()> {
    on_gpu_node(&ctx, "quota-node", async |node| {
        install(&ctx, node)?;
        let namespace = support::create_namespace(&ctx.client, "team").await?;
        let team = TestContext { namespace: namespace.clone(), ..ctx.clone() };
        let result = job_over_quota(&team, &node.name).await;
        let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
        namespaces.delete(&namespace, &DeleteParams::default()).await?;
        wait::until("the team's namespace to be gone", WAIT, || async {
            Ok(namespaces.get_opt(&namespace).await?.is_none().then_some(()))
        })
        .await?;
        let uids = result?;
        for uid in &uids {
            ensure!(specs_of(node, uid)?.is_empty(), "the CDI spec of claim {uid} outlived its pod");
        }
        Ok(())
    })
    .await
}

/// The Job's run; returns the UIDs of the claims its pods had.
async fn job_over_quota(ctx: &TestContext, node: &str) -> anyhow::Result<Vec<String>> {
    let devices = "gpu.gpu-dra.dev.deviceclass.resource.k8s.io/devices";
    objects::create_quota(ctx, "gpus", devices, "2").await?;
    let one_gpu = json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.gpu-dra.dev"}}]}}});
    objects::create_template_in(&ctx.client, &ctx.namespace, "one-gpu", one_gpu).await?;
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": "train"},
        "spec": {"completions": 4, "parallelism": 4, "backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            "containers": [{"name": "main", "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
                            "command": ["sh", "-c", WORK], "resources": {"claims": [{"name": "gpu"}]}}]}}}
    }))?;
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    jobs.create(&PostParams::default(), &job).await?;

    let pods = objects::pods(ctx);
    let list = ListParams::default().labels("job-name=train");
    let (first, waiting) = wait::until("two pods with claims and two refused", WAIT, || async {
        let all = pods.list(&list).await?.items;
        let has_claim = |p: &Pod| objects::claim_statuses(p).iter().any(|(_, c)| c.is_some());
        let names = |f: &dyn Fn(&Pod) -> bool| -> Vec<String> {
            all.iter().filter(|p| f(p)).filter_map(|p| p.metadata.name.clone()).collect()
        };
        let (claimed, waiting) = (names(&has_claim), names(&|p| !has_claim(p)));
        Ok((all.len() == 4 && claimed.len() == 2).then_some((claimed, waiting)))
    })
    .await?;
    for name in &waiting {
        let note = wait::until(&format!("{name}'s quota warning"), WAIT, || async {
            let events = objects::events_about(ctx, name).await?;
            Ok(events.into_iter().find(|(_, reason, _)| reason == "FailedResourceClaimCreation").map(|e| e.2))
        })
        .await?;
        ensure!(note.contains("exceeded quota: gpus"), "{name}: {note}");
    }
    let mut gpus = BTreeSet::new();
    let mut uids = Vec::new();
    for name in &first {
        uids.push(runs_with_its_gpu(ctx, node, name, &mut gpus).await?);
    }
    // Both still refused while the first two run: the quota, not the node, holds them back.
    for name in &waiting {
        let pod = pods.get(name).await?;
        ensure!(objects::claim_statuses(&pod).iter().all(|(_, c)| c.is_none()), "{name} got a claim over quota");
    }

    let first_claims: Vec<String> = {
        let mut names = Vec::new();
        for name in &first {
            names.push(claim_of(ctx, name).await?);
        }
        names
    };
    let freed = wait::until("a finished pod's claim to be deleted", WAIT, || async {
        for claim in &first_claims {
            if objects::claims(ctx).get_opt(claim).await?.is_none() {
                return Ok(Some(Instant::now()));
            }
        }
        Ok(None)
    })
    .await?;
    let took = wait::until("a waiting pod to get its claim", WAIT, || async {
        for name in &waiting {
            if objects::claim_statuses(&pods.get(name).await?).iter().any(|(_, c)| c.is_some()) {
                return Ok(Some(freed.elapsed()));
            }
        }
        Ok(None)
    })
    .await?;
    ensure!(took.as_secs() < 3, "a waiting pod got its claim {took:?} after quota came free");
    for name in &waiting {
        uids.push(runs_with_its_gpu(ctx, node, name, &mut BTreeSet::new()).await?);
    }
    wait::until("the Job to complete", WAIT, || async {
        Ok(jobs.get("train").await?.status.and_then(|s| s.succeeded).filter(|n| *n == 4))
    })
    .await?;
    wait::until("the Job's claims to go", WAIT, || async {
        Ok(objects::list_claims(ctx).await?.is_empty().then_some(()))
    })
    .await?;
    eprintln!("quota came free → a waiting pod's claim in {took:?} (from the 200 ms poll that saw a claim gone)");
    Ok(uids)
}

/// Waits until Job pod `pod` runs and has listed its GPU; checks that it sees exactly its allocation, one GPU not in
/// `taken`; returns its claim's UID.
async fn runs_with_its_gpu(
    ctx: &TestContext,
    node: &str,
    pod: &str,
    taken: &mut BTreeSet<String>,
) -> anyhow::Result<String> {
    let claim = claim_of(ctx, pod).await?;
    let uid = claim_uid(ctx, &claim).await?;
    let seen = seen_by(ctx, pod).await?;
    let want = allocated(ctx, node, &claim).await?;
    ensure!(seen == want && seen.minors.len() == 1, "{pod} sees {seen:?}; its claim {claim} was allocated {want:?}");
    let uuid = seen.uuids.iter().next().context("no UUID seen")?.clone();
    ensure!(taken.insert(uuid.clone()), "{pod} got GPU {uuid}, already another running pod's");
    Ok(uid)
}
