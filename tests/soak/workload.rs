//! The workload: the ordinary things people run, each as an actor looping until the deadline.
//!
//! - Jobs with completions and parallelism whose pods finish (the kubelet harness's `run-for` annotation) and stay;
//! - Jobs whose pods ask for `nvidia.com/gpu` (extended resource: the scheduler creates their claims);
//! - a Deployment scaled up and down (graceful deletions, finished by the kubelet harness);
//! - bare pods deleted while their claims are created, allocated or prepared;
//! - a claim shared by the pods of a Deployment;
//! - training jobs as PodGroups (KEP-5729): a group claim shared by the group's worker pods;
//! - a second tenant with a pod of its own and odd claims: forged owner references, the controller's annotations.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::bed::{EXTENDED_RESOURCE, TEMPLATE, TENANT_NS, WORKLOAD_NS, resource};
use super::model::{EXTENDED_ANNOTATION, POD_CLAIM_ANNOTATION};

/// The kubelet harness ends a Job pod's containers (exit 0) this long after it started.
const RUN_FOR: &str = "e2e.gpu-dra.dev/run-for";
const SHARED_CLAIM: &str = "shared";

/// A small deterministic generator (xorshift64), seeded per actor so that a run can be repeated by its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// What the actors did, for the report.
#[derive(Debug, Default, Clone)]
pub struct Activity {
    pub jobs: usize,
    pub extended_jobs: usize,
    pub scalings: usize,
    pub churn_pods: usize,
    pub forged_claims: usize,
    pub pod_groups: usize,
}

/// A pod spec with one container; `claims` are its `resourceClaims`, all used by the container; `extended`
/// asks for one `nvidia.com/gpu` instead.
fn pod_spec(claims: Value, extended: bool, restart_policy: &str) -> Value {
    let uses: Vec<Value> = claims.as_array().into_iter().flatten().map(|c| json!({"name": c["name"]})).collect();
    let resources = if extended { json!({"limits": {EXTENDED_RESOURCE: "1"}}) } else { json!({"claims": uses}) };
    json!({"restartPolicy": restart_policy, "resourceClaims": claims,
           "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10", "resources": resources}]})
}

fn template_claim() -> Value {
    json!([{"name": "gpu", "resourceClaimTemplateName": TEMPLATE}])
}

/// Deletes claim `name`; gone already (the garbage collector deletes claims of missing owners) is fine.
async fn delete_if_present(claims: &Api<DynamicObject>, name: &str) -> anyhow::Result<()> {
    match claims.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(err) => Err(err).with_context(|| format!("delete claim {name}")),
    }
}

async fn pause(deadline: Instant, every: Duration) -> bool {
    tokio::time::sleep(every.min(deadline.saturating_duration_since(Instant::now()))).await;
    Instant::now() < deadline
}

fn jobs(client: &kube::Client) -> Api<Job> {
    Api::namespaced(client.clone(), WORKLOAD_NS)
}

/// Creates a Job every `every`, keeping the newest `keep` (older ones are deleted with their pods).
async fn job_actor(client: kube::Client, deadline: Instant, mut rng: Rng, extended: bool) -> anyhow::Result<usize> {
    let (prefix, every, keep, completions, parallelism) =
        if extended { ("ext", 20, 2, 2, 2) } else { ("train", 15, 3, 4, 2) };
    let mut made = Vec::new();
    loop {
        let name = format!("{prefix}-{}", made.len());
        let run_for = format!("{}s", 2 + rng.below(5));
        let claims = if extended { json!([]) } else { template_claim() };
        let job = json!({
            "metadata": {"name": name},
            "spec": {"completions": completions, "parallelism": parallelism, "backoffLimit": 2,
                     "template": {"metadata": {"annotations": {RUN_FOR: run_for}},
                                  "spec": pod_spec(claims, extended, "Never")}}
        });
        jobs(&client).create(&PostParams::default(), &serde_json::from_value(job)?).await.context("create Job")?;
        made.push(name);
        if made.len() > keep {
            let old = &made[made.len() - keep - 1];
            jobs(&client).delete(old, &DeleteParams::background()).await.context("delete Job")?;
        }
        if !pause(deadline, Duration::from_secs(every)).await {
            return Ok(made.len());
        }
    }
}

async fn scale(client: &kube::Client, ns: &str, name: &str, replicas: i32) -> anyhow::Result<()> {
    let patch = json!({"spec": {"replicas": replicas}});
    Api::<Deployment>::namespaced(client.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

async fn create_deployment(
    client: &kube::Client,
    ns: &str,
    name: &str,
    replicas: i32,
    claims: Value,
) -> anyhow::Result<()> {
    let deployment = json!({
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec(claims, false, "Always")}}
    });
    Api::<Deployment>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &serde_json::from_value(deployment)?)
        .await
        .with_context(|| format!("create Deployment {ns}/{name}"))?;
    Ok(())
}

/// Scales a Deployment through `sizes` (cycling), one step every `every`.
async fn deployment_actor(
    client: kube::Client,
    deadline: Instant,
    name: &'static str,
    claims: Value,
    sizes: &'static [i32],
    every: Duration,
) -> anyhow::Result<usize> {
    create_deployment(&client, WORKLOAD_NS, name, sizes[0], claims).await?;
    let mut steps = 0;
    while pause(deadline, every).await {
        steps += 1;
        scale(&client, WORKLOAD_NS, name, sizes[steps % sizes.len()]).await?;
    }
    Ok(steps)
}

/// Creates a pod with a template claim every few seconds and deletes it (gracefully) 0–2 s later: while the
/// controller creates its claim, the scheduler allocates it, or the kubelet prepares it.
async fn churn_actor(client: kube::Client, deadline: Instant, mut rng: Rng) -> anyhow::Result<usize> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), WORKLOAD_NS);
    let mut n = 0;
    loop {
        let name = format!("churn-{n}");
        let pod = json!({"metadata": {"name": name}, "spec": pod_spec(template_claim(), false, "Always")});
        pods.create(&PostParams::default(), &serde_json::from_value(pod)?).await.context("create churn pod")?;
        n += 1;
        tokio::time::sleep(Duration::from_millis(rng.below(2000))).await;
        pods.delete(&name, &DeleteParams::default()).await.context("delete churn pod")?;
        if !pause(deadline, Duration::from_secs(4)).await {
            return Ok(n);
        }
    }
}

/// The tenant: a pod of its own with a template claim, and every 30 s a set of odd claims, deleted 15 s later:
/// a pod-claim annotation with a controlling owner pod that does not exist; an owner reference to a pod of the
/// other namespace; a made-up pod claim of the tenant's own pod; the scheduler's extended-resource annotation
/// without an owner.
async fn tenant_actor(client: kube::Client, deadline: Instant, mut rng: Rng) -> anyhow::Result<usize> {
    create_deployment(&client, TENANT_NS, "tenant-app", 1, template_claim()).await?;
    let claims = Api::<DynamicObject>::namespaced_with(client.clone(), TENANT_NS, &resource("ResourceClaim"));
    let tenant_pods: Api<Pod> = Api::namespaced(client.clone(), TENANT_NS);
    let workload_pods: Api<Pod> = Api::namespaced(client.clone(), WORKLOAD_NS);
    let mut made = 0;
    let mut round = 0;
    while pause(deadline, Duration::from_secs(10)).await {
        let own = tenant_pods.list(&ListParams::default()).await?.items.into_iter().next();
        let other = workload_pods.list(&ListParams::default()).await?.items.into_iter().next();
        let owner = |pod: Option<&Pod>, fallback: &str| -> Value {
            let (name, uid) = pod
                .map(|p| (p.metadata.name.clone().unwrap_or_default(), p.metadata.uid.clone().unwrap_or_default()))
                .unwrap_or_else(|| ("ghost".to_string(), fallback.to_string()));
            json!([{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "controller": true,
                    "blockOwnerDeletion": true}])
        };
        let ghost = format!("00000000-0000-4000-8000-{:012x}", rng.below(1 << 40));
        let spec =
            json!({"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": super::bed::CLASS}}]}});
        let odd = [
            ("ghost-owner", json!({POD_CLAIM_ANNOTATION: "gpu"}), owner(None, &ghost)),
            ("cross-namespace-owner", json!({POD_CLAIM_ANNOTATION: "gpu"}), owner(other.as_ref(), &ghost)),
            ("made-up-pod-claim", json!({POD_CLAIM_ANNOTATION: "not-a-pod-claim"}), owner(own.as_ref(), &ghost)),
            ("extended-annotation", json!({EXTENDED_ANNOTATION: "true"}), json!([])),
        ];
        let names: Vec<String> = odd.iter().map(|(what, _, _)| format!("{what}-{round}")).collect();
        for ((_, annotations, owners), name) in odd.into_iter().zip(&names) {
            let claim = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "annotations": annotations, "ownerReferences": owners}, "spec": spec});
            claims.create(&PostParams::default(), &serde_json::from_value(claim)?).await.context("create odd claim")?;
            made += 1;
        }
        round += 1;
        if !pause(deadline, Duration::from_secs(15)).await {
            break;
        }
        for name in &names {
            delete_if_present(&claims, name).await?;
        }
        if !pause(deadline, Duration::from_secs(5)).await {
            break;
        }
    }
    Ok(made)
}

fn pod_groups(client: &kube::Client) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("scheduling.k8s.io", "v1beta1", "PodGroup"));
    Api::namespaced_with(client.clone(), WORKLOAD_NS, &resource)
}

/// Training jobs as PodGroups: a PodGroup with a template claim and two workers that join it (one claim for
/// the group, reserved for it); after a while the workers are deleted, then the group (its claim must go).
async fn group_actor(client: kube::Client, deadline: Instant, mut rng: Rng) -> anyhow::Result<usize> {
    let groups = pod_groups(&client);
    // Untyped: `spec.schedulingGroup` is newer than the compiled Pod type.
    let pods = Api::<DynamicObject>::namespaced_with(client.clone(), WORKLOAD_NS, &ApiResource::erase::<Pod>(&()));
    let mut count = 0;
    while Instant::now() < deadline {
        count += 1;
        let name = format!("trainers-{count}");
        let group = json!({"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "metadata": {"name": name},
            "spec": {"schedulingPolicy": {"basic": {}}, "resourceClaims": template_claim()}});
        let created = groups.create(&PostParams::default(), &serde_json::from_value(group)?).await;
        created.with_context(|| format!("create PodGroup {name}"))?;
        let workers: Vec<String> = (0..2).map(|i| format!("{name}-worker-{i}")).collect();
        for worker in &workers {
            let mut spec = pod_spec(template_claim(), false, "Never");
            spec["schedulingGroup"] = json!({"podGroupName": name});
            let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": worker}, "spec": spec});
            let created = pods.create(&PostParams::default(), &serde_json::from_value(pod)?).await;
            created.with_context(|| format!("create pod {worker}"))?;
        }
        if !pause(deadline, Duration::from_secs(5 + rng.below(10))).await {
            break;
        }
        for worker in &workers {
            pods.delete(worker, &DeleteParams::default()).await.with_context(|| format!("delete pod {worker}"))?;
        }
        groups.delete(&name, &DeleteParams::background()).await.with_context(|| format!("delete PodGroup {name}"))?;
        if !pause(deadline, Duration::from_secs(2)).await {
            break;
        }
    }
    Ok(count)
}

/// Runs every actor until `deadline`; the first error ends the soak.
pub async fn run(client: kube::Client, deadline: Instant, seed: u64) -> anyhow::Result<Activity> {
    let shared = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": SHARED_CLAIM},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": super::bed::CLASS}}]}}});
    Api::<DynamicObject>::namespaced_with(client.clone(), WORKLOAD_NS, &resource("ResourceClaim"))
        .create(&PostParams::default(), &serde_json::from_value(shared)?)
        .await
        .context("create the shared claim")?;
    let shared_users = json!([{"name": "gpu", "resourceClaimName": SHARED_CLAIM}]);
    let c = || client.clone();
    let (train, ext, serve, users, churn, tenant, groups) = tokio::try_join!(
        job_actor(c(), deadline, Rng::new(seed), false),
        job_actor(c(), deadline, Rng::new(seed ^ 1), true),
        deployment_actor(c(), deadline, "serve", template_claim(), &[2, 0, 3, 1], Duration::from_secs(12)),
        deployment_actor(c(), deadline, "shared-users", shared_users, &[3, 1, 2, 0], Duration::from_secs(20)),
        churn_actor(c(), deadline, Rng::new(seed ^ 2)),
        tenant_actor(c(), deadline, Rng::new(seed ^ 3)),
        group_actor(c(), deadline, Rng::new(seed ^ 4)),
    )?;
    Ok(Activity {
        jobs: train,
        extended_jobs: ext,
        scalings: serve + users,
        churn_pods: churn,
        forged_claims: tenant,
        pod_groups: groups,
    })
}

/// Deletes everything the workload made, as a user would: Jobs and Deployments with their pods, bare pods, and
/// the claims that no object owns (the shared one, the tenant's).
pub async fn delete_all(client: &kube::Client) -> anyhow::Result<()> {
    let background = DeleteParams::background();
    let all = ListParams::default();
    for ns in [WORKLOAD_NS, TENANT_NS] {
        Api::<Job>::namespaced(client.clone(), ns).delete_collection(&background, &all).await?;
        Api::<Deployment>::namespaced(client.clone(), ns).delete_collection(&background, &all).await?;
    }
    // The ReplicaSets go with their Deployments (garbage collector); their pods with them, gracefully.
    Api::<Pod>::namespaced(client.clone(), WORKLOAD_NS).delete_collection(&DeleteParams::default(), &all).await?;
    // PodGroups once their pods are going; their claims go with them (reservation dropped, garbage collector).
    pod_groups(client).delete_collection(&background, &all).await?;
    // Claims generated for pods are the controller's (or garbage collector's) to delete: leaving them is what the
    // end check looks for.
    for ns in [WORKLOAD_NS, TENANT_NS] {
        let claims = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &resource("ResourceClaim"));
        for claim in claims.list(&all).await?.items {
            if claim.metadata.owner_references.as_ref().is_none_or(Vec::is_empty)
                && let Some(name) = claim.metadata.name.as_deref()
            {
                delete_if_present(&claims, name).await?;
            }
        }
    }
    Ok(())
}
