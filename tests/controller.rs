//! `gpu-dra controller` against the real API server (and the real scheduler where reservations matter): the
//! kube-controller-manager parity checklist and what goes beyond it. Every test runs its own controller process,
//! restricted to the test's namespace.

mod support;

#[path = "controller/garbled.rs"]
mod garbled;
#[path = "controller/watch_gaps.rs"]
mod watch_gaps;
#[path = "controller/workloads.rs"]
mod workloads;

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use futures::{StreamExt, TryStreamExt};
use garbled::a_claim_created_but_answered_garbled_is_recorded_once;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, WatchParams};
use kube::core::WatchEvent;
use serde_json::json;
use support::objects::{self, CLASS, claim_statuses, create_pod, create_template, events_about, list_claims, one_gpu};
use support::process::Component;
use support::{TestContext, wait};
use watch_gaps::{
    a_pod_created_again_under_its_name_keeps_its_claims_while_the_pod_watch_lags,
    a_watch_refused_as_newer_than_the_server_lists_again,
    what_was_deleted_while_the_watches_were_down_is_handled_after_the_relist,
};
use workloads::{
    a_burst_of_pods_gets_every_creation_event_within_the_rate_limit,
    a_namespace_deleted_while_no_controller_runs_goes_once_one_does,
    extended_resource_claim_of_finished_pod_is_released, finished_pod_claim_is_deleted_once_and_never_recreated,
    pod_status_naming_another_pods_claim_gets_no_reservation,
    recorded_claim_missing_from_a_lagging_informer_is_read_not_recreated,
};

const ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
const ADMIN_LABEL: &str = "resource.kubernetes.io/admin-access";
const SETTLE: Duration = Duration::from_secs(30);

fn main() {
    support::run(
        "controller",
        &[
            test!(creates_claim_from_template_and_records_it),
            test!(unknown_template_fields_survive),
            test!(template_created_after_pod_is_used_at_once),
            test!(a_pod_named_with_253_characters_gets_its_warning),
            test!(three_template_claims_and_a_named_one_take_one_status_write),
            test!(long_names_are_truncated_in_proportion),
            test!(orphan_is_adopted_and_unowned_lookalike_is_not),
            test!(missing_recorded_claim_is_recreated),
            test!(a_claim_created_but_answered_garbled_is_recorded_once),
            test!(what_was_deleted_while_the_watches_were_down_is_handled_after_the_relist),
            test!(a_watch_refused_as_newer_than_the_server_lists_again),
            test!(a_pod_created_again_under_its_name_keeps_its_claims_while_the_pod_watch_lags),
            test!(recorded_claim_and_template_deleted_come_back_with_the_template),
            test!(recorded_claim_missing_from_a_lagging_informer_is_read_not_recreated),
            test!(health_and_metrics_endpoints),
            test!(metrics_match_kube_controller_manager_after_real_work),
            test!(each_claim_of_a_pod_gets_an_event_naming_it),
            test!(a_burst_of_pods_gets_every_creation_event_within_the_rate_limit),
            test!(finished_pod_claims_are_deleted_and_user_claims_released),
            test!(finished_pod_claim_is_deleted_once_and_never_recreated),
            test!(extended_resource_claim_of_finished_pod_is_released),
            test!(reservation_of_deleted_pod_is_released_for_the_next_pod),
            test!(allocated_claim_is_reserved_for_its_scheduled_pod),
            test!(pod_status_naming_another_pods_claim_gets_no_reservation),
            test!(gone_pod_reservation_is_dropped_and_other_consumers_kept),
            test!(many_gone_pods_reservations_go_over_several_syncs),
            test!(deleted_claim_is_deallocated_and_released),
            test!(a_namespace_deleted_while_no_controller_runs_goes_once_one_does),
            test!(rejected_claim_warns_once_and_backs_off),
            test!(deleted_warning_event_is_created_again),
            test!(forbidden_create_names_verb_and_resource),
        ],
    )
}

/// Waits until the pod's status records `n` claims; returns the pod.
async fn wait_recorded(ctx: &TestContext, pod: &str, n: usize) -> anyhow::Result<Pod> {
    let pods = objects::pods(ctx);
    wait::until(&format!("pod {pod} to record {n} claims"), SETTLE, || async {
        let p = pods.get(pod).await?;
        Ok((claim_statuses(&p).len() == n).then_some(p))
    })
    .await
}

async fn creates_claim_from_template_and_records_it(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &[]).await?;
    let mut spec = one_gpu();
    spec["metadata"] = json!({"labels": {"team": "ml"}, "annotations": {"cost-center": "42"}});
    create_template(&ctx, "one-gpu", spec.clone()).await?;
    let pod = create_pod(&ctx, "trainer", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;

    let recorded = wait_recorded(&ctx, "trainer", 1).await?;
    let statuses = claim_statuses(&recorded);
    let name = statuses[0].1.clone().context("status entry without a claim name")?;
    ensure!(
        statuses[0].0 == "gpu" && name.starts_with("trainer-gpu-") && name.len() == "trainer-gpu-".len() + 5,
        "{statuses:?}"
    );

    let claims = list_claims(&ctx).await?;
    ensure!(claims.len() == 1, "expected one claim, got {}", claims.len());
    let claim = &claims[0];
    ensure!(claim.name_any() == name, "status names {name}, claim is {}", claim.name_any());
    let owner = &claim.owner_references()[0];
    ensure!(
        owner.kind == "Pod"
            && owner.name == "trainer"
            && Some(&owner.uid) == pod.metadata.uid.as_ref()
            && owner.controller == Some(true),
        "wrong owner {owner:?}"
    );
    ensure!(claim.annotations().get(ANNOTATION).map(String::as_str) == Some("gpu"), "{:?}", claim.annotations());
    ensure!(claim.annotations().get("cost-center").map(String::as_str) == Some("42"), "template annotation not copied");
    ensure!(claim.labels().get("team").map(String::as_str) == Some("ml"), "template label not copied");
    let spec_json = serde_json::to_value(&claim.spec)?;
    ensure!(spec_json["devices"]["requests"][0]["exactly"]["deviceClassName"] == CLASS, "{spec_json}");

    let events = wait::until("the ResourceClaimCreated event", SETTLE, || async {
        let events = events_about(&ctx, "trainer").await?;
        Ok(events.into_iter().find(|(_, reason, _)| reason == "ResourceClaimCreated"))
    })
    .await?;
    ensure!(events.0 == "Normal" && events.2.contains(&name) && events.2.contains("one-gpu"), "{events:?}");
    let creates =
        controller.metric("dynamic_resource_allocation_resourceclaim_creates_total", &[("status", "success")]).await?;
    ensure!(creates == 1.0, "creates_total = {creates}");
    Ok(())
}

async fn unknown_template_fields_survive(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    // `derivedAttributes` (Kubernetes 1.37, alpha, enabled in the test cluster) is unknown to the k8s-openapi
    // v1_34 types this crate is built with: it must reach the claim anyway. (`make test-matrix` on older versions:
    // their API servers prune it, and the claim equals what they stored.)
    let derived = json!([{"name": "derived/index", "expression": "device.attributes['gpu.test.gpu-dra.dev'].index"}]);
    let spec = json!({"spec": {"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS, "count": 2, "derivedAttributes": derived}}],
        "constraints": [{"requests": ["gpu"], "matchAttribute": "derived/index"}]
    }}});
    let template = create_template(&ctx, "derived", spec).await?;
    let stored = &template.data["spec"]["spec"]["devices"]["requests"][0]["exactly"]["derivedAttributes"];
    if support::cluster::kubernetes_minor()? >= 37 {
        ensure!(*stored == derived, "the API server did not keep derivedAttributes (feature gate off?): {stored}");
    } else {
        // Older API servers do not know the field and prune it: the claim must still equal what they stored.
        ensure!(stored.is_null(), "an API server before 1.37 kept derivedAttributes: {stored}");
    }
    create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "derived"}])).await?;
    wait_recorded(&ctx, "p", 1).await?;

    let api = Api::<kube::api::DynamicObject>::namespaced_with(
        ctx.client.clone(),
        &ctx.namespace,
        &kube::api::ApiResource::erase::<k8s_openapi::api::resource::v1::ResourceClaim>(&()),
    );
    let claim = api.list(&Default::default()).await?.items.into_iter().next().context("no claim")?;
    ensure!(
        claim.data["spec"] == template.data["spec"]["spec"],
        "claim spec differs from the template's:\nclaim    {}\ntemplate {}",
        claim.data["spec"],
        template.data["spec"]["spec"]
    );
    Ok(())
}

/// Event names are `<object>.<hex>`: for an object's name of more than 236 characters that is no valid name, and
/// the API server refused the Event (only a log line said why the pod got no claim).
async fn a_pod_named_with_253_characters_gets_its_warning(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    let name = format!("long-{}", "a".repeat(248));
    create_pod(&ctx, &name, json!([{"name": "gpu", "resourceClaimTemplateName": "missing"}])).await?;
    wait::until("the FailedResourceClaimCreation warning", SETTLE, || async {
        let events = events_about(&ctx, &name).await?;
        Ok(events.into_iter().find(|(_, reason, _)| reason == "FailedResourceClaimCreation"))
    })
    .await?;
    Ok(())
}

/// A pod whose first template is not there yet (a chart applying its Deployment before its ResourceClaimTemplate, or
/// a misspelt name) is told so in a Warning Event and retried with back-off; its second pod claim waits, as
/// kube-controller-manager's does. Once the template appears, the pod gets both claims at once.
async fn template_created_after_pod_is_used_at_once(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let pod_claims = json!([
        {"name": "gpu", "resourceClaimTemplateName": "late"},
        {"name": "nic", "resourceClaimTemplateName": "one-gpu"}
    ]);
    create_pod(&ctx, "early", pod_claims).await?;
    let warning = wait::until("the FailedResourceClaimCreation warning", SETTLE, || async {
        let events = events_about(&ctx, "early").await?;
        Ok(events.into_iter().find(|(_, reason, _)| reason == "FailedResourceClaimCreation"))
    })
    .await?;
    ensure!(
        warning.0 == "Warning"
            && warning.2.contains("PodResourceClaim gpu")
            && warning.2.contains("\"late\"")
            && warning.2.contains("not found"),
        "{warning:?}"
    );
    // Let the retry back-off grow well past a second (5 ms doubling: ~5 s after 10 failures).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let failures = controller
        .metric("gpu_dra_controller_sync_duration_seconds_count", &[("result", "template_not_found")])
        .await?;
    ensure!((5.0..=20.0).contains(&failures), "{failures} failed syncs in 6 s: not an exponential back-off");
    // As upstream, the pod claims after the failing one wait for it: created meanwhile, they would only be charged
    // to the namespace's quota while the pod cannot start.
    let claims = list_claims(&ctx).await?;
    ensure!(
        claims.is_empty(),
        "claims created while the first pod claim fails: {:?}",
        claims.iter().map(ResourceExt::name_any).collect::<Vec<_>>()
    );

    let created = Instant::now();
    create_template(&ctx, "late", one_gpu()).await?;
    wait_recorded(&ctx, "early", 2).await?;
    let took = created.elapsed();
    // The template watch triggers the pod at once; waiting out the back-off would take seconds.
    ensure!(took < Duration::from_secs(2), "claim took {took:?} after the template appeared");
    eprintln!("template → claim recorded: {took:?}");
    Ok(())
}

async fn three_template_claims_and_a_named_one_take_one_status_write(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let shared: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "shared"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}}
    }))?;
    objects::claims(&ctx).create(&PostParams::default(), &shared).await?;
    let pod = create_pod(
        &ctx,
        "multi",
        json!([
            {"name": "c-gpu", "resourceClaimTemplateName": "one-gpu"},
            {"name": "a-gpu", "resourceClaimTemplateName": "one-gpu"},
            {"name": "b-gpu", "resourceClaimTemplateName": "one-gpu"},
            {"name": "named", "resourceClaimName": "shared"}
        ]),
    )
    .await?;
    // Watch the pod from its creation on and count the updates that changed its claim statuses.
    let pods = objects::pods(&ctx);
    let params = WatchParams::default().fields(&format!("metadata.name={}", pod.name_any())).timeout(8);
    let mut stream = pods.watch(&params, &pod.resource_version().context("no rv")?).await?.boxed();
    let mut last = Vec::new();
    let mut writes = Vec::new();
    while let Some(event) = stream.try_next().await? {
        if let WatchEvent::Modified(p) = event {
            let statuses = claim_statuses(&p);
            if statuses != last {
                writes.push(statuses.clone());
                last = statuses;
            }
        }
    }
    ensure!(writes.len() == 1, "expected ONE status write, saw {}: {writes:?}", writes.len());
    let names: Vec<&str> = writes[0].iter().map(|(n, _)| n.as_str()).collect();
    ensure!(names == ["a-gpu", "b-gpu", "c-gpu"], "entries not all present or not sorted: {names:?}");
    ensure!(list_claims(&ctx).await?.len() == 4, "expected 3 generated claims + the named one");
    Ok(())
}

async fn long_names_are_truncated_in_proportion(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let pod_name = "p".repeat(63);
    let claim_name = "c".repeat(63);
    create_pod(&ctx, &pod_name, json!([{"name": claim_name, "resourceClaimTemplateName": "one-gpu"}])).await?;
    let pod = wait_recorded(&ctx, &pod_name, 1).await?;
    let name = claim_statuses(&pod)[0].1.clone().context("no claim name")?;
    // 63*57/128 = 28 characters of each, a hyphen, and the API server's five random characters.
    let prefix = format!("{}-{}", "p".repeat(28), "c".repeat(28));
    ensure!(name.starts_with(&prefix) && name.len() == 62, "claim name {name} ({} chars)", name.len());
    Ok(())
}

/// The controller was killed after creating a claim and before writing the pod status: on restart the claim is
/// adopted. A claim with the right annotation but not owned by the pod is never adopted.
async fn orphan_is_adopted_and_unowned_lookalike_is_not(ctx: TestContext) -> anyhow::Result<()> {
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let pod = create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let claim = |name: &str, owned: bool| -> anyhow::Result<k8s_openapi::api::resource::v1::ResourceClaim> {
        let owners = if owned {
            json!([{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": pod.metadata.uid, "controller": true}])
        } else {
            json!([])
        };
        Ok(serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {ANNOTATION: "gpu"}, "ownerReferences": owners},
            "spec": one_gpu()["spec"]
        }))?)
    };
    objects::claims(&ctx).create(&PostParams::default(), &claim("p-gpu-lookalike", false)?).await?;
    // Created as an earlier instance of the controller would have (same field manager).
    let as_controller = PostParams { field_manager: Some("gpu-dra-controller".into()), ..Default::default() };
    objects::claims(&ctx).create(&as_controller, &claim("p-gpu-orphan", true)?).await?;

    let _controller = Component::controller(&ctx, &[]).await?;
    let pod = wait_recorded(&ctx, "p", 1).await?;
    ensure!(claim_statuses(&pod)[0].1.as_deref() == Some("p-gpu-orphan"), "{:?}", claim_statuses(&pod));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let names: Vec<String> = list_claims(&ctx).await?.iter().map(|c| c.name_any()).collect();
    ensure!(names.len() == 2, "a claim was created instead of adopting: {names:?}");
    let events = events_about(&ctx, "p").await?;
    ensure!(events.iter().any(|(_, r, n)| r == "ResourceClaimAdopted" && n.contains("p-gpu-orphan")), "{events:?}");
    Ok(())
}

async fn missing_recorded_claim_is_recreated(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let first = claim_statuses(&wait_recorded(&ctx, "p", 1).await?)[0].1.clone().context("no name")?;
    objects::claims(&ctx).delete(&first, &DeleteParams::default()).await?;
    let pods = objects::pods(&ctx);
    let second = wait::until("a new claim to be recorded", SETTLE, || async {
        let p = pods.get("p").await?;
        Ok(claim_statuses(&p)[0].1.clone().filter(|n| *n != first))
    })
    .await?;
    let names: Vec<String> = list_claims(&ctx).await?.iter().map(|c| c.name_any()).collect();
    ensure!(names == [second.clone()], "claims {names:?}, recorded {second}");
    Ok(())
}

/// A user deletes a pod's generated claim and its template, then re-creates the template (a redeploy of the
/// manifest): the template's return brings the pod back at once, as kube-controller-manager's template index does
/// (every pod using a template is indexed by it, recorded or not), instead of after the grown back-off.
async fn recorded_claim_and_template_deleted_come_back_with_the_template(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let first = claim_statuses(&wait_recorded(&ctx, "p", 1).await?)[0].1.clone().context("no name")?;
    let templates = Api::<kube::api::DynamicObject>::namespaced_with(
        ctx.client.clone(),
        &ctx.namespace,
        &objects::template_resource(),
    );
    templates.delete("one-gpu", &DeleteParams::default()).await?;
    wait::until("the template to be gone", SETTLE, || async {
        Ok(templates.get_opt("one-gpu").await?.is_none().then_some(()))
    })
    .await?;
    objects::claims(&ctx).delete(&first, &DeleteParams::default()).await?;
    wait::until("the FailedResourceClaimCreation warning", SETTLE, || async {
        let events = events_about(&ctx, "p").await?;
        Ok(events.into_iter().find(|(_, reason, _)| reason == "FailedResourceClaimCreation"))
    })
    .await?;
    // Let the retry back-off grow well past a second (5 ms doubling: ~5 s after 10 failures).
    tokio::time::sleep(Duration::from_secs(6)).await;

    let created = Instant::now();
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let pods = objects::pods(&ctx);
    wait::until("a new claim to be recorded", SETTLE, || async {
        let p = pods.get("p").await?;
        Ok(claim_statuses(&p)[0].1.clone().filter(|n| *n != first))
    })
    .await?;
    let took = created.elapsed();
    ensure!(took < Duration::from_secs(2), "claim took {took:?} after the template came back");
    Ok(())
}

async fn health_and_metrics_endpoints(ctx: TestContext) -> anyhow::Result<()> {
    // `--threads 1` is the default; named here so that a GPU_DRA_CONTROLLER_THREADS in the environment cannot
    // change what the thread count below checks.
    let controller = Component::controller(&ctx, &["--threads", "1"]).await?;
    ensure!(controller.get("/healthz").await? == (200, "ok".into()), "healthz");
    ensure!(controller.get("/readyz").await?.0 == 200, "readyz");
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    wait_recorded(&ctx, "p", 1).await?;
    let (_, body) = controller.get("/metrics").await?;
    for metric in [
        "dynamic_resource_allocation_resourceclaim_creates_total",
        "dynamic_resource_allocation_resource_claims",
        "gpu_dra_controller_sync_duration_seconds_bucket",
        "workqueue_depth",
        "gpu_dra_controller_observe_only",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
    ] {
        ensure!(body.contains(metric), "/metrics lacks {metric}:\n{body}");
    }
    let gauge = support::process::sample(
        &body,
        "dynamic_resource_allocation_resource_claims",
        &[("allocated", "false"), ("source", "resource_claim_template")],
    );
    ensure!(gauge == Some(1.0), "claims gauge {gauge:?}");
    // With `--threads 1` the main thread runs every task, whatever the machine's cores (no worker thread; the
    // API server is an IP address, so no thread resolves names either); `--threads 2` adds two workers.
    let threads = |pid: u32| std::fs::read_dir(format!("/proc/{pid}/task")).map(Iterator::count);
    let one = threads(controller.pid())?;
    ensure!(one == 1, "the controller runs {one} threads with --threads 1 (expected the main thread only)");
    let two_workers = Component::controller(&ctx, &["--threads", "2"]).await?;
    let three = threads(two_workers.pid())?;
    ensure!(three == 3, "the controller runs {three} threads with --threads 2 (expected main + 2 workers)");
    let _ = (Patch::<()>::Merge(()), PatchParams::default());
    Ok(())
}

/// The metrics kube-controller-manager's resourceclaim controller exports, scraped from the process after it
/// created claims (one rejected by the API server and retried): client-go's work-queue metrics named
/// `resource_claim` with its buckets, and the create counter with upstream's labels and nothing else.
async fn metrics_match_kube_controller_manager_after_real_work(ctx: TestContext) -> anyhow::Result<()> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(ctx.client.clone());
    let label = |value: serde_json::Value| json!({"metadata": {"labels": {ADMIN_LABEL: value}}});
    namespaces.patch(&ctx.namespace, &PatchParams::default(), &Patch::Merge(label(json!("true")))).await?;
    let admin = json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS, "adminAccess": true}}]}}});
    create_template(&ctx, "admin", admin).await?;
    namespaces.patch(&ctx.namespace, &PatchParams::default(), &Patch::Merge(label(serde_json::Value::Null))).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;

    let controller = Component::controller(&ctx, &[]).await?;
    for i in 0..3 {
        create_pod(&ctx, &format!("p{i}"), json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    }
    create_pod(&ctx, "rejected", json!([{"name": "gpu", "resourceClaimTemplateName": "admin"}])).await?;
    for i in 0..3 {
        wait_recorded(&ctx, &format!("p{i}"), 1).await?;
    }
    wait::until("a rejected create to be retried", SETTLE, || async {
        Ok((controller.metric("workqueue_retries_total", &[("name", "resource_claim")]).await? >= 2.0).then_some(()))
    })
    .await?;
    let (_, body) = controller.get("/metrics").await?;
    let queue = [("name", "resource_claim")];
    let value = |metric: &str, labels: &[(&str, &str)]| support::process::sample(&body, metric, labels);

    // Every key added was handed out once it was added (pods, claims, retries).
    let adds = value("workqueue_adds_total", &queue).context("workqueue_adds_total")?;
    ensure!(adds >= 8.0, "workqueue_adds_total {adds}: 4 pods and 3 claims at least");
    for histogram in ["workqueue_queue_duration_seconds", "workqueue_work_duration_seconds"] {
        let count = value(&format!("{histogram}_count"), &queue).with_context(|| format!("{histogram}_count"))?;
        ensure!(count >= 7.0 && count <= adds, "{histogram}_count {count} for {adds} adds");
        let bounds = bucket_bounds(&body, histogram);
        let expected: Vec<f64> = std::iter::successors(Some(10e-9_f64), |b| Some(b * 10.0)).take(10).collect();
        ensure!(
            bounds.len() == 11 && bounds[..10].iter().zip(&expected).all(|(a, b)| (a / b - 1.0).abs() < 1e-9),
            "{histogram} buckets {bounds:?}, client-go has {expected:?} and +Inf"
        );
    }
    for gauge in ["workqueue_depth", "workqueue_unfinished_work_seconds", "workqueue_longest_running_processor_seconds"]
    {
        let sample = value(gauge, &queue).with_context(|| format!("no {gauge}{{name=\"resource_claim\"}}:\n{body}"))?;
        ensure!(sample >= 0.0, "{gauge} {sample}");
    }

    let creates = "dynamic_resource_allocation_resourceclaim_creates_total";
    let pod_owner = [("owner_api_group", ""), ("owner_api_kind", "Pod")];
    let ok = value(creates, &[&[("status", "success"), ("admin_access", "false")][..], &pod_owner[..]].concat());
    ensure!(ok == Some(3.0), "successful creates {ok:?}:\n{body}");
    let failed = value(creates, &[&[("status", "failure"), ("admin_access", "true")][..], &pod_owner[..]].concat());
    ensure!(failed.is_some_and(|f| f >= 1.0), "failed creates {failed:?}");
    // Upstream's label set exactly: status, admin_access, owner_api_group, owner_api_kind.
    for line in body.lines().filter(|l| l.starts_with(creates)) {
        let labels = label_names(line);
        ensure!(labels == ["admin_access", "owner_api_group", "owner_api_kind", "status"], "{line}");
    }
    ensure!(!body.contains("gpu_dra_controller_workqueue_depth"), "the old queue gauge is replaced by workqueue_depth");
    Ok(())
}

/// The `le` bounds of `histogram`'s buckets in a Prometheus text body, in order.
fn bucket_bounds(body: &str, histogram: &str) -> Vec<f64> {
    let prefix = format!("{histogram}_bucket{{");
    body.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next()?.parse::<f64>().ok())
        .collect()
}

/// The sorted label names of one sample line.
fn label_names(line: &str) -> Vec<String> {
    let labels = line.split_once('{').and_then(|(_, rest)| rest.rsplit_once('}')).map_or("", |(l, _)| l);
    let mut names: Vec<String> = labels.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, _)| k.into()).collect();
    names.sort();
    names
}

/// A pod with several template claims: one `ResourceClaimCreated` event per claim, each naming its claim as the
/// related object and in its note (not one event whose series counts them and names only the first claim).
async fn each_claim_of_a_pod_gets_an_event_naming_it(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    let uses = ["gpu-left", "gpu-right", "gpu-third"]
        .map(|name| json!({"name": name, "resourceClaimTemplateName": "one-gpu"}));
    create_pod(&ctx, "pair", json!(uses)).await?;
    let pod = wait_recorded(&ctx, "pair", 3).await?;
    let mut claims: Vec<String> = claim_statuses(&pod).into_iter().filter_map(|(_, claim)| claim).collect();
    claims.sort();

    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let created = wait::until("an event for every created claim", SETTLE, || async {
        let events: Vec<_> = api
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("ResourceClaimCreated"))
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("pair"))
            .collect();
        let observed: i32 = events.iter().map(|e| e.series.as_ref().map_or(1, |s| s.count)).sum();
        Ok((observed >= 3).then_some(events))
    })
    .await?;
    let mut related: Vec<String> = Vec::new();
    for event in &created {
        let claim = event.related.as_ref().filter(|r| r.kind.as_deref() == Some("ResourceClaim"));
        let name = claim.and_then(|r| r.name.clone()).with_context(|| format!("no related claim: {event:?}"))?;
        let note = event.note.as_deref().unwrap_or_default();
        ensure!(note.contains(&name), "the note {note:?} does not name its claim {name}");
        ensure!(event.series.is_none(), "one event per claim, not a series: {event:?}");
        related.push(name);
    }
    related.sort();
    ensure!(related == claims, "events name {related:?}; the pod's claims are {claims:?}");
    Ok(())
}

fn reserved(claim: &k8s_openapi::api::resource::v1::ResourceClaim) -> Vec<String> {
    claim.status.as_ref().and_then(|s| s.reserved_for.clone()).unwrap_or_default().into_iter().map(|r| r.name).collect()
}

fn allocated(claim: &k8s_openapi::api::resource::v1::ResourceClaim) -> bool {
    claim.status.as_ref().is_some_and(|s| s.allocation.is_some())
}

/// A Succeeded pod: its generated claim is deleted (with an Event); its reservation of a user's claim is
/// dropped, the claim deallocated and released, but kept. A Failed pod (a Job's attempt that exhausted its
/// retries, a pod evicted for node pressure: the pod object stays) loses its generated claim the same way.
async fn finished_pod_claims_are_deleted_and_user_claims_released(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    create_pod(&ctx, "failed-attempt", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let failed = claim_statuses(&wait_recorded(&ctx, "failed-attempt", 1).await?)[0].1.clone().context("no claim")?;
    objects::set_phase(&ctx, "failed-attempt", "Failed").await?;
    objects::create_claim(&ctx, "shared").await?;
    let pod = create_pod(
        &ctx,
        "job",
        json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}, {"name": "named", "resourceClaimName": "shared"}]),
    )
    .await?;
    let generated = claim_statuses(&wait_recorded(&ctx, "job", 1).await?)[0].1.clone().context("no claim")?;
    let consumer = json!([{"resource": "pods", "name": "job", "uid": pod.metadata.uid}]);
    objects::allocate(&ctx, "shared", consumer, true).await?;

    objects::set_phase(&ctx, "job", "Succeeded").await?;
    let claims = objects::claims(&ctx);
    wait::until("the generated claim to be deleted", SETTLE, || async {
        Ok(claims.get_opt(&generated).await?.is_none().then_some(()))
    })
    .await?;
    let shared = wait::until("the shared claim to be released", SETTLE, || async {
        let c = claims.get("shared").await?;
        Ok((reserved(&c).is_empty() && !allocated(&c) && c.finalizers().is_empty()).then_some(c))
    })
    .await?;
    ensure!(shared.metadata.deletion_timestamp.is_none(), "the user's claim must be kept");
    wait::until("the failed pod's claim to be deleted", SETTLE, || async {
        Ok(claims.get_opt(&failed).await?.is_none().then_some(()))
    })
    .await?;
    let events = events_about(&ctx, &generated).await?;
    ensure!(
        events.iter().any(|(t, r, n)| t == "Normal" && r == "ResourceClaimDeleted" && n.contains("finished")),
        "{events:?}"
    );
    Ok(())
}

/// The real scheduler allocates and reserves; when the pod is deleted the controller drops the reservation,
/// deallocates and removes the finalizer, the garbage collector deletes the claim, and the device can be
/// allocated again.
async fn reservation_of_deleted_pod_is_released_for_the_next_pod(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    let node = support::objects::fake_gpu_node(&ctx, 1).await?;
    create_template(
        &ctx,
        "one-gpu",
        json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": node.class}}]}}}),
    )
    .await?;
    let first = support::objects::create_pod_on(
        &ctx,
        "first",
        &node.name,
        json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]),
    )
    .await?;
    let pods = objects::pods(&ctx);
    let claims = objects::claims(&ctx);
    let claim_name = wait::until("the scheduler to bind the first pod", SETTLE, || async {
        let p = pods.get("first").await?;
        let bound = p.spec.as_ref().and_then(|s| s.node_name.clone()).is_some();
        Ok(claim_statuses(&p).first().and_then(|s| s.1.clone()).filter(|_| bound))
    })
    .await?;
    let claim = claims.get(&claim_name).await?;
    ensure!(
        allocated(&claim) && reserved(&claim) == ["first"],
        "scheduler did not allocate/reserve: {:?}",
        claim.status
    );
    ensure!(claim.finalizers().iter().any(|f| f == "resource.kubernetes.io/delete-protection"), "no finalizer");

    // No kubelet: delete at once, as a kubelet would once the containers stopped.
    pods.delete("first", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    wait::until("the claim to be released and garbage-collected", SETTLE, || async {
        Ok(claims.get_opt(&claim_name).await?.is_none().then_some(()))
    })
    .await?;
    let _ = first;
    support::objects::create_pod_on(
        &ctx,
        "second",
        &node.name,
        json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]),
    )
    .await?;
    wait::until("the second pod to get the only device", SETTLE, || async {
        let p = pods.get("second").await?;
        Ok(p.spec.and_then(|s| s.node_name).map(|_| ()))
    })
    .await?;
    Ok(())
}

/// A scheduled pod whose claim is allocated but not reserved for it gets reserved by the controller.
async fn allocated_claim_is_reserved_for_its_scheduled_pod(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    objects::create_claim(&ctx, "pre-allocated").await?;
    objects::allocate(&ctx, "pre-allocated", json!([]), true).await?;
    create_bound_pod(&ctx, "bound", json!([{"name": "gpu", "resourceClaimName": "pre-allocated"}])).await?;
    let claims = objects::claims(&ctx);
    wait::until("the controller to reserve the claim", SETTLE, || async {
        Ok((reserved(&claims.get("pre-allocated").await?) == ["bound"]).then_some(()))
    })
    .await?;
    Ok(())
}

/// Creates pod `name` bound directly (spec.nodeName) to a node of the test's own, bypassing the scheduler that
/// would otherwise reserve its claims itself; its one container uses every claim in `claims`.
async fn create_bound_pod(ctx: &TestContext, name: &str, claims: serde_json::Value) -> anyhow::Result<Pod> {
    let node = format!("{}-node", ctx.namespace);
    ctx.cluster.add_node(&node)?;
    let uses: Vec<_> = claims.as_array().into_iter().flatten().map(|c| json!({"name": c["name"]})).collect();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": node,
                 "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": uses}}],
                 "resourceClaims": claims}
    }))?;
    Ok(objects::pods(ctx).create(&PostParams::default(), &pod).await?)
}

/// Only the stale entry goes: a gone pod's reservation is dropped, a consumer of another type is kept, and so is
/// the allocation (still in use).
async fn gone_pod_reservation_is_dropped_and_other_consumers_kept(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    objects::create_claim(&ctx, "c").await?;
    let consumers = json!([
        {"resource": "pods", "name": "ghost", "uid": "00000000-0000-0000-0000-000000000001"},
        {"apiGroup": "example.com", "resource": "widgets", "name": "w", "uid": "00000000-0000-0000-0000-000000000002"}
    ]);
    objects::allocate(&ctx, "c", consumers, true).await?;
    let claims = objects::claims(&ctx);
    let claim = wait::until("the ghost's reservation to be dropped", SETTLE, || async {
        let c = claims.get("c").await?;
        Ok((reserved(&c) == ["w"]).then_some(c))
    })
    .await?;
    ensure!(allocated(&claim) && !claim.finalizers().is_empty(), "allocation/finalizer must stay while in use");
    Ok(())
}

/// A Job's 150 workers force-deleted while the controller was down: the claim they shared is reserved for 150 pods
/// its cache never saw, each to be asked about (one GET), and at `--kube-api-qps 2` that takes 75 s, past a sync's
/// 60 s limit. Each sync writes what it found within its budget and checks the rest in the next, so the
/// reservations go (before, every sync was cut before it wrote anything, and none ever went).
async fn many_gone_pods_reservations_go_over_several_syncs(ctx: TestContext) -> anyhow::Result<()> {
    let controller = Component::controller(&ctx, &["--kube-api-qps", "2", "--kube-api-burst", "2"]).await?;
    objects::create_claim(&ctx, "c").await?;
    let workers: Vec<serde_json::Value> = (0..150)
        .map(|i| json!({"resource": "pods", "name": format!("worker-{i}"), "uid": format!("00000000-0000-4000-8000-{i:012}")}))
        .collect();
    objects::allocate(&ctx, "c", json!(workers), true).await?;
    let claims = objects::claims(&ctx);
    let started = std::time::Instant::now();
    let left = wait::until("the first gone workers' reservations to be dropped", Duration::from_secs(75), || async {
        let left = reserved(&claims.get("c").await?).len();
        Ok((left < 150).then_some(left))
    })
    .await
    .with_context(|| controller.log_tail())?;
    eprintln!("{} of 150 reservations dropped {:?} after they were written", 150 - left, started.elapsed());
    ensure!(controller.log_text().contains("checking the rest in another sync"), "{}", controller.log_tail());
    // The rest in the next sync: every reservation goes.
    wait::until("every gone worker's reservation to be dropped", Duration::from_secs(60), || async {
        Ok(reserved(&claims.get("c").await?).is_empty().then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    eprintln!("all 150 reservations dropped {:?} after they were written", started.elapsed());
    Ok(())
}

/// A claim being deleted with nothing reserved: the controller clears the allocation and the finalizer, so the
/// deletion completes.
async fn deleted_claim_is_deallocated_and_released(ctx: TestContext) -> anyhow::Result<()> {
    let _controller = Component::controller(&ctx, &[]).await?;
    objects::create_claim(&ctx, "c").await?;
    objects::allocate(&ctx, "c", json!([]), true).await?;
    let claims = objects::claims(&ctx);
    claims.delete("c", &DeleteParams::default()).await?;
    wait::until("the claim to be gone", SETTLE, || async { Ok(claims.get_opt("c").await?.is_none().then_some(())) })
        .await?;
    Ok(())
}

/// The API server rejects the generated claim (admin access without the namespace label): the server's message
/// reaches ONE aggregated Warning event, and retries back off exponentially.
async fn rejected_claim_warns_once_and_backs_off(ctx: TestContext) -> anyhow::Result<()> {
    create_rejected_admin_template(&ctx).await?;
    let controller = Component::controller(&ctx, &[]).await?;
    create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "admin"}])).await?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let events: Vec<_> =
        events_about(&ctx, "p").await?.into_iter().filter(|(_, r, _)| r == "FailedResourceClaimCreation").collect();
    ensure!(events.len() == 1, "expected ONE aggregated warning, got {events:?}");
    ensure!(
        events[0].2.contains("admin access to devices requires"),
        "the server's message is missing: {:?}",
        events[0]
    );
    let failures = controller
        .metric(
            "dynamic_resource_allocation_resourceclaim_creates_total",
            &[("status", "failure"), ("admin_access", "true")],
        )
        .await?;
    ensure!((3.0..=20.0).contains(&failures), "{failures} create attempts in 6 s: expected an exponential back-off");
    // The repeats are counted on that one Event (events.k8s.io series), as client-go's recorder does.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let series = events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("FailedResourceClaimCreation"))
        .and_then(|e| e.series)
        .map(|s| s.count);
    ensure!(series.is_some_and(|count| count >= 2), "the repeats were not aggregated: series count {series:?}");
    ensure!(list_claims(&ctx).await?.is_empty(), "no claim may exist");
    Ok(())
}

/// Template "admin": a claim with admin access, created while the namespace allowed it; the label is removed again,
/// so the API server rejects every claim generated from it.
async fn create_rejected_admin_template(ctx: &TestContext) -> anyhow::Result<()> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(ctx.client.clone());
    let label =
        |value: serde_json::Value| json!({"metadata": {"labels": {"resource.kubernetes.io/admin-access": value}}});
    namespaces.patch(&ctx.namespace, &PatchParams::default(), &Patch::Merge(label(json!("true")))).await?;
    let admin = json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS, "adminAccess": true}}]}}});
    create_template(ctx, "admin", admin).await?;
    namespaces.patch(&ctx.namespace, &PatchParams::default(), &Patch::Merge(label(serde_json::Value::Null))).await?;
    Ok(())
}

/// The Warning an operator (or the server's event TTL) deleted while its failure keeps repeating: the next repeat
/// finds the series' Event gone (404 on the series patch) and starts a new Event, so the warning stays visible.
async fn deleted_warning_event_is_created_again(ctx: TestContext) -> anyhow::Result<()> {
    create_rejected_admin_template(&ctx).await?;
    let _controller = Component::controller(&ctx, &[]).await?;
    create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "admin"}])).await?;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let warnings = || async {
        let list = events.list(&Default::default()).await?.items;
        anyhow::Ok(
            list.into_iter()
                .filter(|e| e.reason.as_deref() == Some("FailedResourceClaimCreation"))
                .filter_map(|e| Some((e.metadata.name?, e.series.map_or(1, |s| s.count))))
                .collect::<Vec<_>>(),
        )
    };
    // Wait until the first Event has taken a repeat into its series: the sender now patches it on a repeat.
    let first = wait::until("the warning to repeat on one Event", Duration::from_secs(30), || async {
        Ok(match warnings().await?.as_slice() {
            [(name, count)] if *count >= 2 => Some(name.clone()),
            _ => None,
        })
    })
    .await?;
    events.delete(&first, &Default::default()).await?;
    // A change to the pod syncs it at once (no back-off wait): the create fails again and repeats the warning.
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let round = std::sync::atomic::AtomicU32::new(0);
    wait::until(&format!("a new warning after {first} was deleted"), Duration::from_secs(30), || async {
        let n = round.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let touch = json!({"metadata": {"labels": {"touched": n.to_string()}}});
        pods.patch("p", &PatchParams::default(), &Patch::Merge(touch)).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = warnings().await?;
        if !now.iter().any(|(name, _)| *name != first) {
            return Ok(None);
        }
        ensure!(now.len() == 1, "expected the one new warning, got {now:?}");
        Ok(Some(()))
    })
    .await
}

/// Without permission to create claims: a log line naming the verb and resource, and a Warning event.
async fn forbidden_create_names_verb_and_resource(ctx: TestContext) -> anyhow::Result<()> {
    let rules = json!([
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims", "resourceclaimtemplates"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}
    ]);
    let token = objects::service_account_with_rules(&ctx, "no-create", rules).await?;
    let kubeconfig = ctx.cluster.kubeconfig_for_token(&format!("{}-no-create", ctx.namespace), &token)?;
    let args = ["controller", "--namespace", ctx.namespace.as_str(), "--leader-elect=false"];
    let controller = Component::start(&kubeconfig, &ctx.namespace, &args)?;
    controller.wait_ready().await?;
    create_template(&ctx, "one-gpu", one_gpu()).await?;
    create_pod(&ctx, "p", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    wait::until("the forbidden log line", SETTLE, || async {
        let log = controller.log_text();
        Ok(log
            .lines()
            .any(|l| l.contains("forbidden") && l.contains("cannot create resource \\\"resourceclaims\\\""))
            .then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    let events = events_about(&ctx, "p").await?;
    ensure!(
        events.iter().any(|(t, r, n)| t == "Warning" && r == "FailedResourceClaimCreation" && n.contains("forbidden")),
        "{events:?}"
    );
    Ok(())
}
