//! A team namespace with a GPU quota, through the whole pipeline: a ResourceQuota on its DeviceClass's devices
//! (`<class>.deviceclass.resource.k8s.io/devices`, kube-controller-manager's resourcequota controller keeping the
//! usage) and a Job asking for more GPUs at once than the quota allows.

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use super::support::node::DRIVER;
use super::support::{TestContext, objects, wait};
use super::{PREPARE_TIMEOUT, Testbed, claim_of};

/// How long each of the Job's pods runs (the kubelet harness's `run-for`): long enough for a pod refused all that
/// time to be backing off for many seconds (the back-off doubles from 5 ms: retries about 10, 20 and 41 s after the
/// first refusal, so quota freed after about 29 s would wait some 12 s for the next).
const RUN_FOR: &str = "28s";
/// Writes to another quota of the namespace while the pods wait (ConfigMaps counted): none may wake them.
const OTHER_WRITES: usize = 20;
/// How soon after quota comes free a waiting pod must have its claim: well before the next back-off retry (about
/// 12 s away), with room for the quota controller's recount on a busy machine.
const CLAIMED_WITHIN: Duration = Duration::from_secs(8);

/// A Job of four one-GPU pods, all at once, in a namespace whose quota allows two GPUs. Two pods get their claims
/// and run; the quota refuses the other two's claims (403 "exceeded quota"): each is told so in one Warning Event
/// (repeats aggregated), the controller's `gpu_dra_controller_waiting_for_quota` counts them, and the controller
/// does not mistake the refusal for a missing permission. Twenty writes to another quota of the namespace (a
/// ConfigMap count) meanwhile make no more refused creates than the back-off would. When the first
/// two finish, their claims are deleted, the quota controller writes the lower usage, and the waiting pods get their
/// claims within seconds (the controller watches ResourceQuotas; kube-controller-manager waits out each pod's
/// back-off, by then seconds and growing to 1,000 s), and run. The Job completes.
pub(super) async fn a_job_over_its_namespaces_gpu_quota_runs_as_quota_comes_free(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let devices = format!("{}.deviceclass.resource.k8s.io/devices", bed.class);
    objects::create_quota(&ctx, "gpus", &devices, "2").await?;

    let mut pod = bed.pod(
        &ctx,
        "train",
        json!([{"name": "gpu", "resourceClaimTemplateName": "one-h100"}]),
        &[("train", &["gpu"])],
    )?;
    let spec = pod.spec.as_mut().context("pod without spec")?;
    spec.restart_policy = Some("Never".into());
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": "train"},
        "spec": {"completions": 4, "parallelism": 4, "backoffLimit": 0,
                 "template": {"metadata": {"annotations": {"e2e.gpu-dra.dev/run-for": RUN_FOR}}, "spec": pod.spec}}
    }))?;
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    jobs.create(&PostParams::default(), &job).await?;

    let pods = objects::pods(&ctx);
    let list = ListParams::default().labels("job-name=train");
    let (claimed, waiting) = wait::until("two pods with claims and two refused", PREPARE_TIMEOUT, || async {
        let all = pods.list(&list).await?.items;
        let (claimed, waiting): (Vec<_>, Vec<_>) =
            all.iter().partition(|p| objects::claim_statuses(p).iter().any(|(_, c)| c.is_some()));
        let names = |p: Vec<&k8s_openapi::api::core::v1::Pod>| -> Vec<String> {
            p.iter().filter_map(|p| p.metadata.name.clone()).collect()
        };
        Ok((all.len() == 4 && claimed.len() == 2).then(|| (names(claimed), names(waiting))))
    })
    .await?;
    for name in &waiting {
        let warnings = wait::until(&format!("{name}'s quota warning"), PREPARE_TIMEOUT, || async {
            let events = objects::events_about(&ctx, name).await?;
            let warnings: Vec<String> = events
                .into_iter()
                .filter(|(_, reason, _)| reason == "FailedResourceClaimCreation")
                .map(|(_, _, note)| note)
                .collect();
            Ok((!warnings.is_empty()).then_some(warnings))
        })
        .await?;
        ensure!(warnings.len() == 1, "{name}: the refusals were not aggregated into one Event: {warnings:?}");
        ensure!(warnings[0].contains("exceeded quota: gpus"), "{name}: {warnings:?}");
    }
    waiting_for_quota(&bed, 2.0).await?;
    other_quota_writes_wake_nobody(&ctx, &bed).await?;
    for name in &claimed {
        bed.prepared(&ctx, name).await?;
    }
    // The first two finish: their claims go, and the waiting pods' claims come within seconds.
    let claims: Vec<String> = {
        let mut names = Vec::new();
        for name in &claimed {
            names.push(claim_of(&ctx, name, "gpu").await?);
        }
        names
    };
    let freed = wait::until("a finished pod's claim to be deleted", Duration::from_secs(60), || async {
        for claim in &claims {
            if objects::claims(&ctx).get_opt(claim).await?.is_none() {
                return Ok(Some(Instant::now()));
            }
        }
        Ok(None)
    })
    .await?;
    let first = wait::until("a waiting pod to get its claim", Duration::from_secs(60), || async {
        for name in &waiting {
            if objects::claim_statuses(&pods.get(name).await?).iter().any(|(_, c)| c.is_some()) {
                return Ok(Some(freed.elapsed()));
            }
        }
        Ok(None)
    })
    .await?;
    ensure!(first <= CLAIMED_WITHIN, "a waiting pod got its claim {first:?} after quota came free");
    for name in &waiting {
        bed.prepared(&ctx, name).await?;
    }
    waiting_for_quota(&bed, 0.0).await?;
    wait::until("the Job to complete", Duration::from_secs(90), || async {
        let status = jobs.get("train").await?.status;
        Ok(status.and_then(|s| s.succeeded).filter(|n| *n == 4))
    })
    .await?;
    let log = bed.controller.log_text();
    ensure!(!log.contains("grant the controller's ServiceAccount"), "a quota refusal taken for a missing permission");
    eprintln!("quota came free → the waiting pod's claim in {first:?} (from the 200 ms poll that saw a claim gone)");
    Ok(())
}

/// Waits until `gpu_dra_controller_waiting_for_quota` reads `expected`.
async fn waiting_for_quota(bed: &Testbed, expected: f64) -> anyhow::Result<()> {
    let what = format!("gpu_dra_controller_waiting_for_quota to be {expected}");
    wait::until(&what, Duration::from_secs(10), || async {
        let now = bed.controller.metric("gpu_dra_controller_waiting_for_quota", &[]).await?;
        Ok((now == expected).then_some(()))
    })
    .await
}

/// Creates a quota on ConfigMaps and [`OTHER_WRITES`] ConfigMaps (each a write of that quota's usage); checks that
/// the claims refused meanwhile are no more than the waiting pods' own retries would make.
async fn other_quota_writes_wake_nobody(ctx: &TestContext, bed: &Testbed) -> anyhow::Result<()> {
    let failed = async || {
        let labels = [("status", "failure")];
        bed.controller.metric("dynamic_resource_allocation_resourceclaim_creates_total", &labels).await
    };
    // Until the waiting pods' updates (the scheduler's conditions) have settled: each makes a sync, refused again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = failed().await?;
    let started = Instant::now();
    objects::create_quota(ctx, "configmaps", "count/configmaps", "100").await?;
    let maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    for i in 0..OTHER_WRITES {
        let map: ConfigMap = serde_json::from_value(json!({"metadata": {"name": format!("settings-{i}")}}))?;
        maps.create(&PostParams::default(), &map).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let refused = failed().await? - before;
    // Two waiting pods retried on their own from a minute on: none of these writes leaves room (woken by each, they would be
    // refused twice per write).
    ensure!(
        refused <= 4.0,
        "{refused} claim creates refused in {:?} of writes to another quota (two pods waiting)",
        started.elapsed()
    );
    eprintln!("{OTHER_WRITES} writes to another quota: {refused} more refused creates in {:?}", started.elapsed());
    Ok(())
}

/// A team namespace with quotas on two GPU models (a DeviceClass each, one A100 and one H100 at a time, as a
/// platform team hands out scarce models), pods of both waiting: the A100 pod refused first, the H100 pod after it.
/// An H100 pod finishing frees an H100: the H100 pod gets its claim within seconds, and the A100 pod, waiting
/// longer, is passed over (its refusal named the A100 class) and keeps waiting, until an A100 frees. When any
/// freed device woke the oldest refusal first, the A100 pod took the wake, was refused, and the H100 pod waited
/// for its own retry, a minute after its refusal.
pub(super) async fn a_team_with_quotas_on_two_gpu_models_gets_each_freed_gpu_to_a_pod_of_its_model(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    for (model, product) in [("a100", "NVIDIA A100"), ("h100", "NVIDIA H100")] {
        let class = format!("{}-{model}", ctx.namespace);
        let selector =
            format!("device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].productName.startsWith('{product}')");
        let device_class: DeviceClass = serde_json::from_value(json!({
            "metadata": {"name": class}, "spec": {"selectors": [{"cel": {"expression": selector}}]}
        }))?;
        Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &device_class).await?;
        let requests = json!([{"name": "gpu", "exactly": {"deviceClassName": class}}]);
        objects::create_template(&ctx, &format!("one-{model}"), json!({"spec": {"devices": {"requests": requests}}}))
            .await?;
        objects::create_quota(&ctx, model, &format!("{class}.deviceclass.resource.k8s.io/devices"), "1").await?;
    }
    let pods = objects::pods(&ctx);
    let create = async |name: &str, model: &str| -> anyhow::Result<()> {
        let claims = json!([{"name": "gpu", "resourceClaimTemplateName": format!("one-{model}")}]);
        pods.create(&PostParams::default(), &bed.pod(&ctx, name, claims, &[("app", &["gpu"])])?).await?;
        Ok(())
    };
    let has_claim = async |name: &str| -> anyhow::Result<bool> {
        Ok(objects::claim_statuses(&pods.get(name).await?).iter().any(|(_, c)| c.is_some()))
    };
    for (name, model) in [("a100-first", "a100"), ("h100-first", "h100")] {
        create(name, model).await?;
        wait::until(&format!("{name}'s claim"), PREPARE_TIMEOUT, || async { Ok(has_claim(name).await?.then_some(())) })
            .await?;
    }
    create("a100-waiting", "a100").await?;
    waiting_for_quota(&bed, 1.0).await?;
    create("h100-waiting", "h100").await?;
    waiting_for_quota(&bed, 2.0).await?;
    // Until the waiting pods' own updates (the scheduler's conditions) have settled: each makes a sync.
    tokio::time::sleep(Duration::from_secs(3)).await;

    for (done, next, other) in
        [("h100-first", "h100-waiting", Some("a100-waiting")), ("a100-first", "a100-waiting", None)]
    {
        let claim = claim_of(&ctx, done, "gpu").await?;
        pods.delete(done, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
        let freed = wait::until(&format!("{done}'s claim to be deleted"), Duration::from_secs(60), || async {
            Ok(objects::claims(&ctx).get_opt(&claim).await?.is_none().then(Instant::now))
        })
        .await?;
        let took = wait::until(&format!("{next} to get its claim"), Duration::from_secs(90), || async {
            Ok(has_claim(next).await?.then(|| freed.elapsed()))
        })
        .await?;
        ensure!(took <= CLAIMED_WITHIN, "{next} got its claim {took:?} after {done}'s was deleted");
        if let Some(other) = other {
            ensure!(!has_claim(other).await?, "{other} got a claim though only an H100 came free");
        }
        eprintln!("{done} gone → {next}'s claim in {took:?}");
    }
    waiting_for_quota(&bed, 0.0).await
}

/// A team's GPU quota from device plugin days (`requests.<extended resource>`) where a DeviceClass names that
/// extended resource (`extendedResourceName`): from 1.36 (DRAExtendedResource on) the API server charges template
/// claims of the class against it too, so it refuses the second pod's claim; when the first pod goes, the waiting
/// pod gets its claim within seconds (the controller tracks `requests.<domain>/<name>` limits: before, such a change
/// woke nobody and the pod waited for its one-minute retry). Before 1.36 the API server drops the class's
/// `extendedResourceName` and such a quota does not count claims: both pods get theirs at once.
pub(super) async fn a_device_plugin_era_gpu_quota_holds_template_claims_and_frees_them_at_once(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    let class = format!("{}-mapped", ctx.namespace);
    // One name per test: a DeviceClass's extended resource is the cluster's.
    let extended = format!("e2e.gpu-dra.dev/{}", ctx.namespace);
    let selector = format!("device.driver == '{DRIVER}'");
    let device_class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": class},
        "spec": {"selectors": [{"cel": {"expression": selector}}], "extendedResourceName": extended}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &device_class).await?;
    let requests = json!([{"name": "gpu", "exactly": {"deviceClassName": class}}]);
    objects::create_template(&ctx, "one-gpu", json!({"spec": {"devices": {"requests": requests}}})).await?;
    objects::create_quota(&ctx, "gpus", &format!("requests.{extended}"), "1").await?;

    let pods = objects::pods(&ctx);
    let claims = json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]);
    let has_claim = async |name: &str| -> anyhow::Result<bool> {
        Ok(objects::claim_statuses(&pods.get(name).await?).iter().any(|(_, c)| c.is_some()))
    };
    pods.create(&PostParams::default(), &bed.pod(&ctx, "first", claims.clone(), &[("app", &["gpu"])])?).await?;
    wait::until("first's claim", PREPARE_TIMEOUT, || async { Ok(has_claim("first").await?.then_some(())) }).await?;
    pods.create(&PostParams::default(), &bed.pod(&ctx, "second", claims, &[("app", &["gpu"])])?).await?;
    if super::support::cluster::kubernetes_minor()? < 36 {
        wait::until("second's claim (claims not charged before 1.36)", PREPARE_TIMEOUT, || async {
            Ok(has_claim("second").await?.then_some(()))
        })
        .await?;
        return waiting_for_quota(&bed, 0.0).await;
    }
    waiting_for_quota(&bed, 1.0).await?;
    ensure!(!has_claim("second").await?, "second got a claim past a full quota on requests.{extended}");
    // Until the waiting pod's own updates (the scheduler's conditions) have settled: each makes a sync.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let claim = claim_of(&ctx, "first", "gpu").await?;
    pods.delete("first", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    let freed = wait::until("first's claim to be deleted", Duration::from_secs(60), || async {
        Ok(objects::claims(&ctx).get_opt(&claim).await?.is_none().then(Instant::now))
    })
    .await?;
    let took = wait::until("second to get its claim", Duration::from_secs(90), || async {
        Ok(has_claim("second").await?.then(|| freed.elapsed()))
    })
    .await?;
    ensure!(took <= CLAIMED_WITHIN, "second got its claim {took:?} after first's was deleted");
    eprintln!("first gone → second's claim in {took:?} (quota on requests.{extended})");
    waiting_for_quota(&bed, 0.0).await
}
