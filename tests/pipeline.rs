//! The whole pipeline end to end: pod → claim from a template (gpu-dra controller) → allocation and binding by the
//! real kube-scheduler from the node agents' ResourceSlices → prepare through the REAL kubelet DRA code
//! (`gpu-dra-kubelet-harness`: the kubelet's plugin watcher and DRA manager from `k8s.io/kubernetes`) → CDI devices,
//! resolved and injected into an OCI spec with the `container-device-interface` crate → unprepare → claim deleted.
//!
//! Each test has two fake nodes (simulated GPUs, own kubelet directories, its own agent and kubelet harness), a
//! DeviceClass, and a namespaced gpu-dra controller; the cluster runs kube-controller-manager's garbage collector,
//! namespace, deployment, replicaset, statefulset, disruption, job and resourcequota controllers (never its claim
//! controller).

mod support;

#[path = "pipeline/choices.rs"]
mod choices;
#[path = "pipeline/compute.rs"]
mod compute;
#[path = "pipeline/dynamic_mig.rs"]
mod dynamic_mig;
#[path = "pipeline/mig.rs"]
mod mig;
#[path = "pipeline/nodes.rs"]
mod nodes;
#[path = "pipeline/quota.rs"]
mod quota;
#[path = "pipeline/workloads.rs"]
mod workloads;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use choices::{
    a_pod_preferring_an_h100_gets_an_a100_once_they_are_taken_with_that_choices_config,
    gpus_and_a_nic_asked_to_share_a_pcie_root_get_devices_under_one_root,
    two_gpus_asked_to_match_are_one_model_and_each_rank_gets_its_own,
};
use compute::{an_mps_claim_naming_no_memory_holds_a_shared_gpu_whole, inference_pods_share_one_gpu_by_compute};
use dynamic_mig::the_scheduler_partitions_gpus_and_prepare_makes_the_mig_devices;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, DeviceRequestAllocationResult, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use mig::{a_node_in_mig_mode_hands_out_its_mig_devices, nvidias_mig_quickstart_runs_as_a_deployment};
use nodes::{
    a_gpu_lost_while_the_agent_runs_stays_published_and_tainted_until_reset,
    a_machine_rebooted_after_its_pod_was_force_deleted_prepares_the_new_pod_at_once,
    a_node_back_after_its_pod_was_force_deleted_frees_the_old_claim_first,
    a_node_deleted_and_registered_again_publishes_its_gpus_again, a_node_joining_takes_the_gpu_pods_waiting_for_room,
    an_agent_restarted_while_a_gpu_is_lost_serves_the_nodes_other_gpus,
    an_agent_restarted_without_a_usable_driver_still_unprepares_its_pods,
};
use quota::{
    a_device_plugin_era_gpu_quota_holds_template_claims_and_frees_them_at_once,
    a_job_over_its_namespaces_gpu_quota_runs_as_quota_comes_free,
    a_team_with_quotas_on_two_gpu_models_gets_each_freed_gpu_to_a_pod_of_its_model,
};
use serde_json::{Value, json};
use support::harness::KubeletHarness;
use support::node::{DRIVER, NodeDirs, gpu_cdi_ids, start_agent};
use support::process::Component;
use support::{TestContext, objects, wait};
use workloads::{
    a_high_priority_gpu_pod_waits_instead_of_preempting_and_gets_the_gpu_freed_for_it,
    a_rolling_update_on_a_full_node_hands_the_old_replicas_gpus_to_the_new_ones,
    a_statefulset_replica_replaced_under_its_name_gets_a_new_claim_and_the_freed_gpus,
    deleting_a_namespace_with_running_gpu_pods_leaves_nothing,
    draining_a_node_moves_its_gpu_replicas_and_frees_their_gpus,
};

const KCM_CONTROLLERS: &str = "deployment-controller,replicaset-controller,statefulset-controller,\
                               disruption-controller,job-controller,resourcequota-controller";
const PREPARE_TIMEOUT: Duration = Duration::from_secs(60);

fn main() {
    support::run_with_env(
        "pipeline",
        false,
        &[("GPU_DRA_E2E_KCM_CONTROLLERS", KCM_CONTROLLERS)],
        &[
            test!(a_template_pod_gets_two_h100s_prepared_and_released),
            test!(replicas_get_their_own_gpus_and_the_one_beyond_capacity_waits),
            test!(two_containers_with_two_claims_get_different_gpus),
            test!(a_shared_claim_is_prepared_once_and_released_after_its_last_pod),
            test!(restarts_of_agent_kubelet_and_controller_lose_nothing),
            test!(a_monitoring_pod_with_admin_access_never_makes_gpus_busy),
            test!(pods_of_two_namespaces_share_one_gpu_by_memory),
            test!(two_requests_of_one_claim_get_two_shares_of_one_gpu),
            test!(inference_pods_share_one_gpu_by_compute),
            test!(an_mps_claim_naming_no_memory_holds_a_shared_gpu_whole),
            test!(a_node_in_mig_mode_hands_out_its_mig_devices),
            test!(nvidias_mig_quickstart_runs_as_a_deployment),
            test!(the_scheduler_partitions_gpus_and_prepare_makes_the_mig_devices),
            test!(a_statefulset_replica_replaced_under_its_name_gets_a_new_claim_and_the_freed_gpus),
            test!(a_rolling_update_on_a_full_node_hands_the_old_replicas_gpus_to_the_new_ones),
            test!(draining_a_node_moves_its_gpu_replicas_and_frees_their_gpus),
            test!(deleting_a_namespace_with_running_gpu_pods_leaves_nothing),
            test!(a_high_priority_gpu_pod_waits_instead_of_preempting_and_gets_the_gpu_freed_for_it),
            test!(a_pod_preferring_an_h100_gets_an_a100_once_they_are_taken_with_that_choices_config),
            test!(two_gpus_asked_to_match_are_one_model_and_each_rank_gets_its_own),
            test!(gpus_and_a_nic_asked_to_share_a_pcie_root_get_devices_under_one_root),
            test!(a_node_joining_takes_the_gpu_pods_waiting_for_room),
            test!(a_node_deleted_and_registered_again_publishes_its_gpus_again),
            test!(a_node_back_after_its_pod_was_force_deleted_frees_the_old_claim_first),
            test!(a_machine_rebooted_after_its_pod_was_force_deleted_prepares_the_new_pod_at_once),
            test!(an_agent_restarted_while_a_gpu_is_lost_serves_the_nodes_other_gpus),
            test!(an_agent_restarted_without_a_usable_driver_still_unprepares_its_pods),
            test!(a_gpu_lost_while_the_agent_runs_stays_published_and_tainted_until_reset),
            test!(a_job_over_its_namespaces_gpu_quota_runs_as_quota_comes_free),
            test!(a_team_with_quotas_on_two_gpu_models_gets_each_freed_gpu_to_a_pod_of_its_model),
            test!(a_device_plugin_era_gpu_quota_holds_template_claims_and_frees_them_at_once),
        ],
    )
}

/// One fake node: its directories, agent and kubelet side.
struct Node {
    name: String,
    dirs: NodeDirs,
    agent: Component,
    kubelet: KubeletHarness,
}

impl Node {
    /// Registers node number `index` of the test (labelled for its pods), with `gpus`, and starts its agent and
    /// kubelet side.
    fn start(ctx: &TestContext, index: usize, gpus: &str) -> anyhow::Result<Self> {
        Self::start_with(ctx, index, gpus, &[])
    }

    /// [`Self::start`] with more agent flags.
    fn start_with(ctx: &TestContext, index: usize, gpus: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let suffix = &ctx.namespace[ctx.namespace.len() - 6..];
        let name = format!("e2e-{suffix}-{index}");
        ctx.cluster.add_node_labeled(&name, &[&format!("gpu-dra.dev/e2e={}", ctx.namespace)])?;
        let dirs = NodeDirs::new()?;
        let mut args = vec!["--gpu-backend", "simulated", "--simulated-gpus", gpus];
        args.extend_from_slice(extra);
        let agent = start_agent(ctx, &name, &dirs, &args)?;
        let kubelet = KubeletHarness::start(ctx, &name, &dirs)?;
        Ok(Self { name, dirs, agent, kubelet })
    }

    /// Starts this node's agent again, on its directories, with simulated `gpus` (the one it had, or others).
    fn restart_agent(&mut self, ctx: &TestContext, gpus: &str) -> anyhow::Result<()> {
        self.agent =
            start_agent(ctx, &self.name, &self.dirs, &["--gpu-backend", "simulated", "--simulated-gpus", gpus])?;
        Ok(())
    }

    async fn wait_ready(&self) -> anyhow::Result<()> {
        self.agent.wait_ready().await?;
        self.kubelet.wait_for("registered", "", Duration::from_secs(60)).await?;
        Ok(())
    }
}

/// Two GPU nodes, a DeviceClass and a controller, all the test's own.
struct Testbed {
    nodes: Vec<Node>,
    controller: Component,
    /// The DeviceClass, and the node label the test's pods select.
    class: String,
}

const GPUS: [&str; 2] = ["2xA100-80GB,2xH100-80GB", "4xH100-80GB"];

impl Testbed {
    async fn start(ctx: &TestContext) -> anyhow::Result<Self> {
        let mut nodes = Vec::new();
        for (i, gpus) in GPUS.iter().enumerate() {
            nodes.push(Node::start(ctx, i, gpus)?);
        }
        for node in &nodes {
            node.wait_ready().await?;
        }
        let class: DeviceClass = serde_json::from_value(json!({
            "metadata": {"name": ctx.namespace},
            "spec": {"selectors": [{"cel": {"expression": format!(
                "device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'")}}]}
        }))?;
        Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &class).await?;
        let controller = Component::controller(ctx, &[]).await?;
        Ok(Self { nodes, controller, class: ctx.namespace.clone() })
    }

    /// A node with `gpus` joins, as a new machine would: its Node object, agent and kubelet side; returns its name.
    async fn add_node(&mut self, ctx: &TestContext, gpus: &str) -> anyhow::Result<String> {
        self.add_node_with(ctx, gpus, &[]).await
    }

    /// [`Self::add_node`] with more agent flags.
    async fn add_node_with(&mut self, ctx: &TestContext, gpus: &str, extra: &[&str]) -> anyhow::Result<String> {
        let node = Node::start_with(ctx, self.nodes.len(), gpus, extra)?;
        node.wait_ready().await?;
        let name = node.name.clone();
        self.nodes.push(node);
        Ok(name)
    }

    fn node(&self, name: &str) -> anyhow::Result<&Node> {
        self.nodes.iter().find(|n| n.name == name).with_context(|| format!("no node {name}"))
    }

    /// A template asking for `count` H100s (a CEL selector on the product name).
    async fn h100_template(&self, ctx: &TestContext, name: &str, count: u32) -> anyhow::Result<()> {
        let selector = format!("device.attributes['{DRIVER}'].productName.startsWith('NVIDIA H100')");
        objects::create_template(
            ctx,
            name,
            json!({"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                "deviceClassName": self.class, "count": count, "selectors": [{"cel": {"expression": selector}}]}}]}}}),
        )
        .await?;
        Ok(())
    }

    /// A pod spec on the test's nodes whose `containers` (name → pod claims it uses) use `claims`.
    fn pod(&self, ctx: &TestContext, name: &str, claims: Value, containers: &[(&str, &[&str])]) -> anyhow::Result<Pod> {
        let containers: Vec<Value> = containers
            .iter()
            .map(|(c, uses)| {
                let uses: Vec<Value> = uses.iter().map(|u| json!({"name": u})).collect();
                json!({"name": c, "image": "registry.k8s.io/pause:3.10", "resources": {"claims": uses}})
            })
            .collect();
        Ok(serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"containers": containers, "resourceClaims": claims,
                     "nodeSelector": {"gpu-dra.dev/e2e": ctx.namespace}, "terminationGracePeriodSeconds": 0}
        }))?)
    }

    /// [`Self::pod`] pinned to node `node`.
    fn pod_on(&self, ctx: &TestContext, name: &str, node: &str, template: &str) -> anyhow::Result<Pod> {
        let claims = json!([{"name": "gpus", "resourceClaimTemplateName": template}]);
        let mut pod = self.pod(ctx, name, claims, &[("app", &["gpus"])])?;
        if let Some(spec) = pod.spec.as_mut() {
            spec.node_selector = Some([("kubernetes.io/hostname".to_string(), node.to_string())].into());
        }
        Ok(pod)
    }

    /// Creates Deployment `trainers`: `replicas` copies of `pod`, selected by its `app` label (its name), rolled by
    /// `strategy` (`null`: the default rolling update).
    async fn deploy(
        &self,
        ctx: &TestContext,
        pod: Pod,
        replicas: i32,
        strategy: Value,
    ) -> anyhow::Result<Api<Deployment>> {
        let app = pod.metadata.name.clone().context("pod template without a name")?;
        let deployment: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "trainers"},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": app}}, "strategy": strategy,
                     "template": {"metadata": {"labels": {"app": app}}, "spec": pod.spec}}
        }))?;
        let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        deployments.create(&PostParams::default(), &deployment).await?;
        Ok(deployments)
    }

    /// Waits until some node's kubelet prepared `pod`; returns (node, container → CDI ids).
    async fn prepared(&self, ctx: &TestContext, pod: &str) -> anyhow::Result<(String, BTreeMap<String, Vec<String>>)> {
        let key = format!("{}/{pod}", ctx.namespace);
        let node = wait::until(&format!("{key} to be bound"), PREPARE_TIMEOUT, || async {
            Ok(objects::pods(ctx).get(pod).await?.spec.and_then(|s| s.node_name))
        })
        .await?;
        let event = self.node(&node)?.kubelet.wait_for("prepared", &key, PREPARE_TIMEOUT).await?;
        let containers: BTreeMap<String, Vec<String>> = serde_json::from_value(event["containers"].clone())?;
        let gpus = containers.into_iter().map(|(c, ids)| Ok((c, gpu_cdi_ids(&ids)?)));
        Ok((node, gpus.collect::<anyhow::Result<_>>()?))
    }

    /// Deletes `pod` at once and waits for its node's kubelet to unprepare it.
    async fn delete_pod(&self, ctx: &TestContext, pod: &str, node: &str) -> anyhow::Result<()> {
        objects::pods(ctx).delete(pod, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
        let key = format!("{}/{pod}", ctx.namespace);
        self.node(node)?.kubelet.wait_for("unprepared", &key, PREPARE_TIMEOUT).await?;
        Ok(())
    }
}

/// The allocated (pool, device) pairs of a claim.
async fn allocated(ctx: &TestContext, claim: &str) -> anyhow::Result<BTreeSet<(String, String)>> {
    let results = allocation_results(ctx, &ctx.namespace, claim).await?;
    Ok(results.into_iter().map(|r| (r.pool, r.device)).collect())
}

/// The claim the controller created for `pod`'s pod claim `name`.
async fn claim_of(ctx: &TestContext, pod: &str, name: &str) -> anyhow::Result<String> {
    let pod = objects::pods(ctx).get(pod).await?;
    objects::claim_statuses(&pod)
        .into_iter()
        .find(|(n, _)| n == name)
        .and_then(|(_, claim)| claim)
        .with_context(|| format!("no claim recorded for pod claim {name}"))
}

/// A device's attribute (string) from its node's ResourceSlices.
async fn attribute(ctx: &TestContext, node: &str, device: &str, attr: &str) -> anyhow::Result<String> {
    let devices = objects::published_devices(&ctx.client, node).await?;
    let device =
        devices.iter().find(|d| d.name == device).with_context(|| format!("{device} not published for {node}"))?;
    let value = device.attributes.as_ref().and_then(|a| a.get(attr)).and_then(|a| a.string.clone());
    value.with_context(|| format!("{device:?} has no string attribute {attr}"))
}

/// Resolves `ids` with the CDI crate from the node's CDI directory, as a runtime does, and injects them into an
/// empty OCI spec: (device node paths, environment).
fn inject(dirs: &NodeDirs, ids: &[String]) -> anyhow::Result<(BTreeSet<String>, Vec<String>)> {
    use container_device_interface::cache::{new_cache, with_auto_refresh};
    use container_device_interface::spec_dirs::with_spec_dirs;
    let dir = dirs.cdi().to_string_lossy().into_owned();
    let cache = new_cache(vec![with_spec_dirs(&[&dir]), with_auto_refresh(false)]);
    let mut cache = cache.lock().map_err(|_| anyhow::anyhow!("CDI cache lock poisoned"))?;
    let mut spec = oci_spec::runtime::Spec::default();
    cache.inject_devices(Some(&mut spec), ids.to_vec()).map_err(|e| anyhow::anyhow!("inject {ids:?}: {e}"))?;
    let devices = spec
        .linux()
        .as_ref()
        .and_then(|l| l.devices().clone())
        .unwrap_or_default()
        .iter()
        .map(|d| d.path().display().to_string())
        .collect();
    let env = spec.process().as_ref().and_then(|p| p.env().clone()).unwrap_or_default();
    Ok((devices, env))
}

async fn a_template_pod_gets_two_h100s_prepared_and_released(ctx: TestContext) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "two-h100", 2).await?;
    let claims = json!([{"name": "gpus", "resourceClaimTemplateName": "two-h100"}]);
    let created = std::time::Instant::now();
    objects::pods(&ctx)
        .create(&PostParams::default(), &bed.pod(&ctx, "trainer", claims.clone(), &[("train", &["gpus"])])?)
        .await?;
    let (node_name, containers) = bed.prepared(&ctx, "trainer").await?;
    let elapsed = created.elapsed();
    let claim = claim_of(&ctx, "trainer", "gpus").await?;
    let devices = allocated(&ctx, &claim).await?;
    ensure!(devices.len() == 2 && devices.iter().all(|(pool, _)| *pool == node_name), "allocated {devices:?}");
    let mut uuids = Vec::new();
    for (_, device) in &devices {
        let product = attribute(&ctx, &node_name, device, "productName").await?;
        ensure!(product.starts_with("NVIDIA H100"), "{device} is a {product}");
        uuids.push(attribute(&ctx, &node_name, device, "uuid").await?);
    }
    let ids = containers.get("train").context("no CDI ids for container train")?;
    ensure!(ids.len() == 2, "CDI ids {ids:?}");

    let node = bed.node(&node_name)?;
    let (device_nodes, env) = inject(&node.dirs, ids)?;
    let mut expected: BTreeSet<String> =
        devices.iter().map(|(_, d)| format!("/dev/nvidia{}", d.trim_start_matches("gpu-"))).collect();
    expected.extend(["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"].map(String::from));
    ensure!(device_nodes == expected, "injected device nodes {device_nodes:?}, expected {expected:?}");
    let visible = env.iter().find_map(|e| e.strip_prefix("GPU_DRA_GPU_UUIDS=")).context("no GPU_DRA_GPU_UUIDS")?;
    let visible: BTreeSet<&str> = visible.split(',').collect();
    ensure!(visible == uuids.iter().map(String::as_str).collect(), "env {env:?}, uuids {uuids:?}");
    ensure!(env.iter().any(|e| e == "NVIDIA_VISIBLE_DEVICES=void"), "env {env:?}");
    eprintln!("pod created → CDI devices prepared in {elapsed:?}");

    bed.delete_pod(&ctx, "trainer", &node_name).await?;
    ensure!(node.dirs.cdi_specs()?.is_empty(), "specs left after unprepare: {:?}", node.dirs.cdi_specs()?);
    wait::until("the claim to be deleted", Duration::from_secs(30), || async {
        Ok(objects::claims(&ctx).get_opt(&claim).await?.is_none().then_some(()))
    })
    .await?;
    // The GPUs are allocatable again: a second pod asking for two H100s on the same node gets them.
    let mut again = bed.pod(&ctx, "trainer-2", claims, &[("train", &["gpus"])])?;
    if let Some(spec) = again.spec.as_mut() {
        spec.node_selector = Some([("kubernetes.io/hostname".to_string(), node_name.clone())].into());
    }
    objects::pods(&ctx).create(&PostParams::default(), &again).await?;
    let (second_node, _) = bed.prepared(&ctx, "trainer-2").await?;
    ensure!(second_node == node_name, "second pod on {second_node}");
    Ok(())
}

async fn replicas_get_their_own_gpus_and_the_one_beyond_capacity_waits(ctx: TestContext) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "pair", 2).await?;
    let template = bed.pod(
        &ctx,
        "replica",
        json!([{"name": "gpus", "resourceClaimTemplateName": "pair"}]),
        &[("app", &["gpus"])],
    )?;
    let deployments = bed.deploy(&ctx, template, 3, Value::Null).await?;
    let pods = wait::until("three replica pods", Duration::from_secs(30), || async {
        let list = objects::pods(&ctx).list(&ListParams::default().labels("app=replica")).await?;
        Ok((list.items.len() == 3).then_some(list.items))
    })
    .await?;
    let mut all_devices = BTreeSet::new();
    let mut claims = BTreeSet::new();
    for pod in &pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        bed.prepared(&ctx, &name).await?;
        let claim = claim_of(&ctx, &name, "gpus").await?;
        let devices = allocated(&ctx, &claim).await?;
        ensure!(devices.len() == 2, "{name}: {devices:?}");
        ensure!(claims.insert(claim.clone()), "two pods share claim {claim}");
        for device in devices {
            ensure!(all_devices.insert(device.clone()), "{device:?} allocated twice");
        }
    }
    // Six H100s in all: a fourth replica cannot be placed, and the scheduler says why.
    deployments.patch("trainers", &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": 4}}))).await?;
    let reason = wait::until("the fourth replica to be unschedulable", Duration::from_secs(30), || async {
        let list = objects::pods(&ctx).list(&ListParams::default().labels("app=replica")).await?;
        Ok(list.items.iter().find_map(objects::unschedulable_message))
    })
    .await?;
    ensure!(reason.contains("cannot allocate all claims"), "scheduler said: {reason}");
    Ok(())
}

async fn two_containers_with_two_claims_get_different_gpus(ctx: TestContext) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let claims = json!([
        {"name": "gpu-a", "resourceClaimTemplateName": "one-h100"},
        {"name": "gpu-b", "resourceClaimTemplateName": "one-h100"}
    ]);
    let pod = bed.pod(&ctx, "pod-with-two", claims, &[("first", &["gpu-a"]), ("second", &["gpu-b"])])?;
    objects::pods(&ctx).create(&PostParams::default(), &pod).await?;
    let (node, containers) = bed.prepared(&ctx, "pod-with-two").await?;
    let (first, second) = (containers.get("first"), containers.get("second"));
    let (Some([first]), Some([second])) = (first.map(Vec::as_slice), second.map(Vec::as_slice)) else {
        anyhow::bail!("expected one CDI id per container: {containers:?}");
    };
    let gpu = |id: &str| id.rsplit("-gpu-").next().map(str::to_string);
    ensure!(gpu(first) != gpu(second), "both containers got the same GPU: {first} {second}");
    let (a, b) = (claim_of(&ctx, "pod-with-two", "gpu-a").await?, claim_of(&ctx, "pod-with-two", "gpu-b").await?);
    let (a, b) = (allocated(&ctx, &a).await?, allocated(&ctx, &b).await?);
    ensure!(a.len() == 1 && b.len() == 1 && a != b, "allocations {a:?} {b:?}");
    let node = bed.node(&node)?;
    for id in [first, second] {
        let (devices, _) = inject(&node.dirs, std::slice::from_ref(id))?;
        let minor = gpu(id).unwrap_or_default();
        ensure!(devices.contains(&format!("/dev/nvidia{minor}")), "{id} injects {devices:?}");
    }
    Ok(())
}

async fn a_shared_claim_is_prepared_once_and_released_after_its_last_pod(ctx: TestContext) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "shared"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": bed.class}}]}}
    }))?;
    objects::claims(&ctx).create(&PostParams::default(), &claim).await?;
    let node_name = bed.nodes[1].name.clone();
    for name in ["user-1", "user-2"] {
        let mut pod =
            bed.pod(&ctx, name, json!([{"name": "gpus", "resourceClaimName": "shared"}]), &[("app", &["gpus"])])?;
        if let Some(spec) = pod.spec.as_mut() {
            spec.node_selector = Some([("kubernetes.io/hostname".to_string(), node_name.clone())].into());
        }
        objects::pods(&ctx).create(&PostParams::default(), &pod).await?;
    }
    let (_, mut one) = bed.prepared(&ctx, "user-1").await?;
    let (_, mut two) = bed.prepared(&ctx, "user-2").await?;
    if support::cluster::kubernetes_minor()? < 37 {
        // Kubelets before 1.37 append each NodePrepareResources answer to the claim's devices, so a pod started
        // while the claim was being prepared for the other may list the same CDI device twice (1.37 resets the
        // list per answer). The agent's answers are the same either way; compare the devices, not the repeats.
        for ids in one.values_mut().chain(two.values_mut()) {
            ids.sort();
            ids.dedup();
        }
    }
    ensure!(one == two, "the pods of one claim got different devices: {one:?} {two:?}");
    let node = bed.node(&node_name)?;
    ensure!(node.dirs.cdi_specs()?.len() == 1, "specs: {:?}", node.dirs.cdi_specs()?);
    // The kubelet may ask once per pod; the second answer comes from the checkpoint ("prepared claim" is logged
    // only when the work is done).
    let log = node.agent.log_text();
    let prepared = log.lines().filter(|l| l.contains("prepared claim") && !l.contains("unprepared claim")).count();
    ensure!(prepared == 1, "the agent prepared the shared claim {prepared} times");

    bed.delete_pod(&ctx, "user-1", &node_name).await?;
    ensure!(node.dirs.cdi_specs()?.len() == 1, "unprepared while user-2 still runs");
    bed.delete_pod(&ctx, "user-2", &node_name).await?;
    wait::until("the shared claim's spec to go", Duration::from_secs(30), || async {
        Ok(node.dirs.cdi_specs()?.is_empty().then_some(()))
    })
    .await?;
    ensure!(objects::claims(&ctx).get_opt("shared").await?.is_some(), "a user's claim must outlive its pods");
    Ok(())
}

async fn restarts_of_agent_kubelet_and_controller_lose_nothing(ctx: TestContext) -> anyhow::Result<()> {
    let mut bed = Testbed::start(&ctx).await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let claims = json!([{"name": "gpu", "resourceClaimTemplateName": "one-h100"}]);
    let first = bed.pod(&ctx, "held", claims.clone(), &[("app", &["gpu"])])?;
    objects::pods(&ctx).create(&PostParams::default(), &first).await?;
    let (node_name, _) = bed.prepared(&ctx, "held").await?;
    let index = bed.nodes.iter().position(|n| n.name == node_name).context("node")?;

    // The agent dies with a prepared pod and comes back: the kubelet re-registers it, nothing is lost.
    {
        let node = &mut bed.nodes[index];
        node.agent.kill()?;
        node.restart_agent(&ctx, GPUS[index])?;
        node.agent.wait_ready().await?;
        wait::until("the kubelet to register the restarted agent", PREPARE_TIMEOUT, || async {
            Ok((node.kubelet.events().iter().filter(|e| e["event"] == "registered").count() >= 2).then_some(()))
        })
        .await?;
        ensure!(node.dirs.cdi_specs()?.len() == 1, "the held pod's spec was lost");
    }
    // The kubelet restarts: it wipes the node's slices, the agent publishes them again, a new pod is prepared.
    {
        let node = &mut bed.nodes[index];
        node.kubelet.kill()?;
        node.kubelet = KubeletHarness::start(&ctx, &node.name, &node.dirs)?;
        node.kubelet.wait_for("registered", "", PREPARE_TIMEOUT).await?;
        let name = node.name.clone();
        wait::until("the node's slices after the kubelet's wipe", Duration::from_secs(30), || async {
            let list = Api::<ResourceSlice>::all(ctx.client.clone())
                .list(&ListParams::default().fields(&format!("spec.nodeName={name}")))
                .await?;
            let devices: usize = list.items.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).sum();
            Ok((devices == 4).then_some(()))
        })
        .await?;
    }
    bed.delete_pod(&ctx, "held", &node_name).await?;
    ensure!(bed.nodes[index].dirs.cdi_specs()?.is_empty(), "the held pod's spec outlived it");

    // The controller is killed in the middle of a burst of pods: each pod still gets exactly one claim, prepared.
    let burst: Vec<String> = (0..6).map(|i| format!("burst-{i}")).collect();
    for name in &burst {
        let pod = bed.pod(&ctx, name, claims.clone(), &[("app", &["gpu"])])?;
        objects::pods(&ctx).create(&PostParams::default(), &pod).await?;
    }
    wait::until("the first claims of the burst", Duration::from_secs(30), || async {
        Ok((!objects::list_claims(&ctx).await?.is_empty()).then_some(()))
    })
    .await?;
    bed.controller.kill()?;
    bed.controller = Component::controller(&ctx, &[]).await?;
    for name in &burst {
        bed.prepared(&ctx, name).await?;
    }
    let mut owners: BTreeMap<String, usize> = BTreeMap::new();
    for claim in objects::list_claims(&ctx).await? {
        for owner in claim.metadata.owner_references.unwrap_or_default() {
            *owners.entry(owner.name).or_default() += 1;
        }
    }
    ensure!(burst.iter().all(|p| owners.get(p) == Some(&1)), "claims per pod: {owners:?}");
    for node in &mut bed.nodes {
        node.kubelet.check_alive()?;
    }
    Ok(())
}

/// A DCGM-exporter-style monitoring pod: every GPU of its node with admin access (allocationMode All), in a namespace
/// labelled for admin access. Admin access never makes a device busy, for the scheduler as for the agent: a workload
/// the scheduler places on a monitored GPU is prepared whichever of the two came first, and the agent's checkpoint
/// records the admin access (so a restarted agent keeps allowing it).
async fn a_monitoring_pod_with_admin_access_never_makes_gpus_busy(ctx: TestContext) -> anyhow::Result<()> {
    let bed = Testbed::start(&ctx).await?;
    let label = json!({"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(ctx.client.clone())
        .patch(&ctx.namespace, &PatchParams::default(), &Patch::Merge(&label))
        .await?;
    objects::create_template(
        &ctx,
        "monitor",
        json!({"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": bed.class, "allocationMode": "All", "adminAccess": true}}]}}}),
    )
    .await?;
    bed.h100_template(&ctx, "one-h100", 1).await?;
    let pods = objects::pods(&ctx);
    let (first, second) = (bed.nodes[1].name.clone(), bed.nodes[0].name.clone());

    // Monitoring first, then a workload on one of the monitored GPUs.
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "monitor-1", &first, "monitor")?).await?;
    let (_, monitor) = bed.prepared(&ctx, "monitor-1").await?;
    ensure!(monitor.get("app").is_some_and(|ids| ids.len() == 4), "monitor CDI ids {monitor:?}");
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "worker-1", &first, "one-h100")?).await?;
    let (_, worker) = bed.prepared(&ctx, "worker-1").await?;
    ensure!(worker.get("app").is_some_and(|ids| ids.len() == 1), "worker CDI ids {worker:?}");
    let monitored = allocated(&ctx, &claim_of(&ctx, "monitor-1", "gpus").await?).await?;
    let used = allocated(&ctx, &claim_of(&ctx, "worker-1", "gpus").await?).await?;
    ensure!(used.is_subset(&monitored), "the worker's GPU {used:?} is not among the monitored {monitored:?}");

    // A workload first, then monitoring.
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "worker-0", &second, "one-h100")?).await?;
    bed.prepared(&ctx, "worker-0").await?;
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "monitor-0", &second, "monitor")?).await?;
    let (_, monitor) = bed.prepared(&ctx, "monitor-0").await?;
    ensure!(monitor.get("app").is_some_and(|ids| ids.len() == 4), "monitor CDI ids {monitor:?}");

    // Recorded with admin access: one entry per monitored GPU says so, the workloads' do not.
    for node in [&first, &second] {
        let text = std::fs::read_to_string(bed.node(node)?.dirs.checkpoint())?;
        ensure!(text.matches("\"adminAccess\": true").count() == 4, "checkpoint of {node}:\n{text}");
    }

    // The workload goes and comes back while monitoring stays: still prepared.
    bed.delete_pod(&ctx, "worker-1", &first).await?;
    pods.create(&PostParams::default(), &bed.pod_on(&ctx, "worker-1b", &first, "one-h100")?).await?;
    bed.prepared(&ctx, "worker-1b").await?;
    Ok(())
}

/// A pod on `node` in `namespace` whose one container uses claim `claim`.
fn pod_using(name: &str, node: &str, claim: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                                 "resources": {"claims": [{"name": "gpu"}]}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                 "nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0}
    }))?)
}

/// Creates claim `name` in `namespace` asking for `memory` of one GPU of `class`, and a pod on `node` using it.
async fn pod_with_memory_share(
    ctx: &TestContext,
    namespace: &str,
    name: &str,
    node: &str,
    class: &str,
    memory: &str,
) -> anyhow::Result<()> {
    pod_with_configured_share(ctx, namespace, name, node, class, memory, json!([])).await
}

/// As [`pod_with_memory_share`], the claim carrying `config` (its `spec.devices.config`).
async fn pod_with_configured_share(
    ctx: &TestContext,
    namespace: &str,
    name: &str,
    node: &str,
    class: &str,
    memory: &str,
    config: Value,
) -> anyhow::Result<()> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": class, "capacity": {"requests": {"memory": memory}}}}], "config": config}}
    }))?;
    Api::<ResourceClaim>::namespaced(ctx.client.clone(), namespace).create(&PostParams::default(), &claim).await?;
    Api::<Pod>::namespaced(ctx.client.clone(), namespace)
        .create(&PostParams::default(), &pod_using(name, node, name)?)
        .await?;
    Ok(())
}

/// (device, share ID, memory consumed) of each device allocated to claim `name` in `namespace`.
async fn shares(ctx: &TestContext, namespace: &str, name: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    Ok(allocation_results(ctx, namespace, name)
        .await?
        .into_iter()
        .map(|r| {
            let memory = consumed(&r, "memory");
            (r.device, r.share_id.unwrap_or_default(), memory)
        })
        .collect())
}

/// The allocation results of claim `name` in `namespace` (none while it is not allocated).
async fn allocation_results(
    ctx: &TestContext,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Vec<DeviceRequestAllocationResult>> {
    let claim = Api::<ResourceClaim>::namespaced(ctx.client.clone(), namespace).get(name).await?;
    let results = claim.status.and_then(|s| s.allocation).and_then(|a| a.devices).and_then(|d| d.results);
    Ok(results.unwrap_or_default())
}

/// How much of capacity `capacity` an allocation result consumes, as the scheduler wrote it (empty when none).
fn consumed(result: &DeviceRequestAllocationResult, capacity: &str) -> String {
    result.consumed_capacity.as_ref().and_then(|c| c.get(capacity)).map(|q| q.0.clone()).unwrap_or_default()
}

/// A claim of two requests of 20Gi each on a node sharing its one H100 by memory: the scheduler gives both requests
/// shares of the same GPU, each its own share ID (a request's `count: 2` would not: that takes two GPUs, so the
/// second claim, asking two of 20Gi in one request, waits), and the agent prepares them as one claim, one spec,
/// the GPU once in the container's devices, both shares recorded with their memory. Before 1.36 a GPU is never
/// shared and the first claim waits too.
async fn two_requests_of_one_claim_get_two_shares_of_one_gpu(ctx: TestContext) -> anyhow::Result<()> {
    // Every part bound: one left to `..` is dropped here, and a dropped agent is killed.
    let SharedGpuNode { node, dirs, kubelet, agent: _agent, _controller } =
        SharedGpuNode::start(&ctx, "two-requests").await?;
    let (ns, class) = (ctx.namespace.as_str(), ctx.namespace.as_str());
    let request = |name: &str, count: u32| {
        json!({"name": name, "exactly": {"deviceClassName": class, "count": count,
                                         "capacity": {"requests": {"memory": "20Gi"}}}})
    };
    for (name, requests) in [("pair", json!([request("a", 1), request("b", 1)])), ("counted", json!([request("a", 2)]))]
    {
        let claim: ResourceClaim =
            serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"devices": {"requests": requests}}}))?;
        objects::claims(&ctx).create(&PostParams::default(), &claim).await?;
        objects::pods(&ctx).create(&PostParams::default(), &pod_using(name, &node, name)?).await?;
    }
    if support::cluster::kubernetes_minor()? < 36 {
        let why = objects::unschedulable(&ctx.client, ns, "pair", PREPARE_TIMEOUT).await?;
        eprintln!("before 1.36 a GPU is never shared: {why}");
        return Ok(());
    }
    let prepared = kubelet.wait_for("prepared", &format!("{ns}/pair"), PREPARE_TIMEOUT).await?;
    let pair = shares(&ctx, ns, "pair").await?;
    ensure!(pair.len() == 2 && pair.iter().all(|s| s.0 == "gpu-0" && s.2 == "20Gi"), "allocated {pair:?}");
    ensure!(!pair[0].1.is_empty() && pair[0].1 != pair[1].1, "share IDs {pair:?}");
    let ids: Vec<String> = serde_json::from_value(prepared["containers"]["app"].clone()).unwrap_or_default();
    let gpus = gpu_cdi_ids(&ids)?;
    ensure!(!gpus.is_empty() && gpus.iter().all(|id| id.ends_with("-gpu-0")), "the container's CDI ids {ids:?}");
    let uid = objects::claims(&ctx).get("pair").await?.metadata.uid.unwrap_or_default();
    ensure!(dirs.cdi_specs()?.len() == 1 && dirs.cdi_spec(&uid).exists(), "specs {:?}", dirs.cdi_specs()?);
    let checkpoint = std::fs::read_to_string(dirs.checkpoint())?;
    let twenty_gib = format!("\"memoryBytes\": {}", 20u64 << 30);
    ensure!(checkpoint.matches(&twenty_gib).count() == 2, "both shares' memory not recorded in:\n{checkpoint}");
    let why = objects::unschedulable(&ctx.client, ns, "counted", PREPARE_TIMEOUT).await?;
    eprintln!("two requests shared gpu-0 ({pair:?}); one request of count 2 waited: {why}");
    Ok(())
}

/// A node whose agent publishes its one H100 for sharing by memory (`--gpu-sharing by-memory`): a training pod and
/// a notebook in two namespaces get 39Gi each of the same GPU (an H100 80GB has 81,559 MiB: two of 40Gi would not
/// fit) — allocated by the real scheduler with a share ID each,
/// prepared by the kubelet's DRA code with a CDI spec each, no conflict — and a third pod asking for 8Gi more waits
/// as unschedulable until the trainer and its claim are gone; a pod asking `nvidia.com/gpu: 1` gets the GPU whole once
/// the shares are released, and a share waits for it. Before 1.36 consumable capacity is off (the API server
/// drops `allowMultipleAllocations`): the GPU is whole, the notebook waits, and the agent warns naming the gate.
async fn pods_of_two_namespaces_share_one_gpu_by_memory(ctx: TestContext) -> anyhow::Result<()> {
    let SharedGpuNode { node, dirs, agent, kubelet, _controller } = SharedGpuNode::start(&ctx, "shared").await?;
    let other = support::create_namespace(&ctx.client, "notebooks").await?;
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    let result = share_one_gpu(&ctx, &other, &node, &dirs, &kubelet).await;
    let _ = namespaces.delete(&other, &DeleteParams::default()).await;
    result?;
    if support::cluster::kubernetes_minor()? < 36 {
        // The operator is told why: the agent saw the field missing from what the API server stored.
        let warning =
            "the API server dropped the devices' allowMultipleAllocations (feature gate DRAConsumableCapacity off)";
        ensure!(agent.log_text().contains(warning), "no warning about the dropped field:\n{}", agent.log_tail());
    }
    Ok(())
}

/// A node of the test's own whose agent publishes its one H100 for sharing (`--gpu-sharing by-memory`), its kubelet
/// harness registered, a DeviceClass of the driver's devices named after the test's namespace, and a controller.
struct SharedGpuNode {
    node: String,
    dirs: NodeDirs,
    agent: Component,
    kubelet: KubeletHarness,
    _controller: Component,
}

impl SharedGpuNode {
    async fn start(ctx: &TestContext, name: &str) -> anyhow::Result<Self> {
        let suffix = &ctx.namespace[ctx.namespace.len() - 6..];
        let node = format!("e2e-{suffix}-{name}");
        ctx.cluster.add_node(&node)?;
        let dirs = NodeDirs::new()?;
        let gpus = ["--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB", "--gpu-sharing", "by-memory"];
        let agent = start_agent(ctx, &node, &dirs, &gpus)?;
        let kubelet = KubeletHarness::start(ctx, &node, &dirs)?;
        agent.wait_ready().await?;
        kubelet.wait_for("registered", "", Duration::from_secs(60)).await?;
        objects::driver_device_class(ctx).await?;
        let _controller = Component::controller(ctx, &[]).await?;
        Ok(Self { node, dirs, agent, kubelet, _controller })
    }
}

async fn share_one_gpu(
    ctx: &TestContext,
    other: &str,
    node: &str,
    dirs: &NodeDirs,
    kubelet: &KubeletHarness,
) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let class = ctx.namespace.as_str();
    pod_with_memory_share(ctx, ns, "trainer", node, class, "39Gi").await?;
    let trainer = kubelet.wait_for("prepared", &format!("{ns}/trainer"), PREPARE_TIMEOUT).await?;
    pod_with_memory_share(ctx, other, "notebook", node, class, "39Gi").await?;
    if support::cluster::kubernetes_minor()? < 36 {
        let why = objects::unschedulable(&ctx.client, other, "notebook", PREPARE_TIMEOUT).await?;
        eprintln!("before 1.36 a GPU is never shared: {why}");
        return Ok(());
    }
    let notebook = kubelet.wait_for("prepared", &format!("{other}/notebook"), PREPARE_TIMEOUT).await?;
    let (mine, theirs) = (shares(ctx, ns, "trainer").await?, shares(ctx, other, "notebook").await?);
    ensure!(mine.len() == 1 && theirs.len() == 1, "allocations: {mine:?} {theirs:?}");
    ensure!(mine[0].0 == "gpu-0" && theirs[0].0 == "gpu-0", "not the same GPU: {mine:?} {theirs:?}");
    ensure!(!mine[0].1.is_empty() && mine[0].1 != theirs[0].1, "share IDs: {mine:?} {theirs:?}");
    ensure!(mine[0].2 == "39Gi" && theirs[0].2 == "39Gi", "memory consumed: {mine:?} {theirs:?}");
    // Each claim its own CDI device, both for the GPU of minor 0.
    let ids = |event: &Value| -> anyhow::Result<Vec<String>> {
        gpu_cdi_ids(&serde_json::from_value::<Vec<String>>(event["containers"]["app"].clone()).unwrap_or_default())
    };
    let (trainer, notebook) = (ids(&trainer)?, ids(&notebook)?);
    ensure!(trainer.len() == 1 && notebook.len() == 1 && trainer != notebook, "CDI ids {trainer:?} {notebook:?}");
    ensure!(trainer.iter().chain(&notebook).all(|id| id.ends_with("-gpu-0")), "CDI ids {trainer:?} {notebook:?}");
    ensure!(dirs.cdi_specs()?.len() == 2, "specs: {:?}", dirs.cdi_specs()?);

    // 78Gi of the H100's 81,559 MiB consumed: 8 GB more does not fit until a share is released. Asked in the
    // exponent form, which the scheduler records as given.
    pod_with_memory_share(ctx, ns, "late", node, class, "8e9").await?;
    let why = objects::unschedulable(&ctx.client, ns, "late", PREPARE_TIMEOUT).await?;
    objects::pods(ctx).delete("trainer", &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await?;
    kubelet.wait_for("unprepared", &format!("{ns}/trainer"), PREPARE_TIMEOUT).await?;
    objects::claims(ctx).delete("trainer", &DeleteParams::default()).await?;
    kubelet.wait_for("prepared", &format!("{ns}/late"), PREPARE_TIMEOUT).await?;
    let late = shares(ctx, ns, "late").await?;
    ensure!(late.len() == 1 && late[0].0 == "gpu-0" && late[0].2 == "8e9", "late: {late:?}");
    // The agent recorded the share's memory in bytes, to count it beside the next share.
    let checkpoint = std::fs::read_to_string(dirs.checkpoint())?;
    ensure!(checkpoint.contains("\"memoryBytes\": 8000000000"), "late's share not recorded in:\n{checkpoint}");
    ensure!(dirs.cdi_specs()?.len() == 2, "specs after the swap: {:?}", dirs.cdi_specs()?);
    eprintln!("two namespaces shared gpu-0 by memory; the third share waited ({why}) until one was released");
    shares_ask_one_time_slice(ctx, other, node, dirs, kubelet, class).await?;
    whole_gpu_by_extended_resource(ctx, other, node, class, dirs).await
}

/// Two tenants' pods on shares of one GPU asking different time slices (`GpuConfig` TimeSlicing, one in NVIDIA's
/// spelling): the GPU is set for the first; the second's prepare fails (the reason, which the second tenant reads
/// in its pod's Events, does not name the first tenant's claim: the agent's log does), the kubelet retries, and
/// once the first pod is gone the GPU is set for the second; when that one goes too, back to the default. The
/// shares already on the GPU ask nothing and are not disturbed.
async fn shares_ask_one_time_slice(
    ctx: &TestContext,
    other: &str,
    node: &str,
    dirs: &NodeDirs,
    kubelet: &KubeletHarness,
    class: &str,
) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let asking = |parameters: Value| json!([{"opaque": {"driver": DRIVER, "parameters": parameters}}]);
    let long = asking(json!({"apiVersion": format!("{DRIVER}/v1alpha1"), "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}));
    let short = asking(json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}}));
    pod_with_configured_share(ctx, ns, "slow", node, class, "8Gi", long).await?;
    kubelet.wait_for("prepared", &format!("{ns}/slow"), PREPARE_TIMEOUT).await?;
    ensure!(dirs.time_slices()? == BTreeMap::from([("gpu-0".into(), "Long".into())]), "{:?}", dirs.time_slices()?);
    pod_with_configured_share(ctx, other, "fast", node, class, "8Gi", short).await?;
    let failed = kubelet.wait_for("prepare-failed", &format!("{other}/fast"), PREPARE_TIMEOUT).await?;
    let error = failed["error"].as_str().unwrap_or_default();
    ensure!(error.contains("is time-sliced Long for a claim of another namespace"), "prepare-failed: {failed}");
    let slow_uid = objects::claims(ctx).get("slow").await?.metadata.uid.unwrap_or_default();
    ensure!(!error.contains(ns) && !error.contains(&slow_uid), "the other tenant's claim named: {failed}");
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    objects::pods(ctx).delete("slow", &now).await?;
    kubelet.wait_for("unprepared", &format!("{ns}/slow"), PREPARE_TIMEOUT).await?;
    objects::claims(ctx).delete("slow", &DeleteParams::default()).await?;
    kubelet.wait_for("prepared", &format!("{other}/fast"), PREPARE_TIMEOUT).await?;
    ensure!(dirs.time_slices()? == BTreeMap::from([("gpu-0".into(), "Short".into())]), "{:?}", dirs.time_slices()?);
    Api::<Pod>::namespaced(ctx.client.clone(), other).delete("fast", &now).await?;
    kubelet.wait_for("unprepared", &format!("{other}/fast"), PREPARE_TIMEOUT).await?;
    Api::<ResourceClaim>::namespaced(ctx.client.clone(), other).delete("fast", &DeleteParams::default()).await?;
    ensure!(dirs.time_slices()?.is_empty(), "the last claim asking a time slice went: {:?}", dirs.time_slices()?);
    eprintln!("shares of gpu-0 asking Long then Short: the second waited ({error}), then got its own");
    Ok(())
}

/// A container asking `nvidia.com/gpu: 1` (the class's extended resource) names no memory, so it asks for the
/// whole shared GPU: it waits while shares hold part of it, then gets all of it, and a new share waits for it.
async fn whole_gpu_by_extended_resource(
    ctx: &TestContext,
    other: &str,
    node: &str,
    class: &str,
    dirs: &NodeDirs,
) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    // With the class's own config, as the chart renders a class's `sharing`: the only config such a pod can have,
    // its claim being the scheduler's.
    let sharing = json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}});
    let config = json!([{"opaque": {"driver": DRIVER, "parameters": {"apiVersion": format!("{DRIVER}/v1alpha1"),
        "kind": "GpuConfig", "sharing": sharing}}}]);
    let extended = json!({"spec": {"extendedResourceName": "nvidia.com/gpu", "config": config}});
    Api::<DeviceClass>::all(ctx.client.clone()).patch(class, &PatchParams::default(), &Patch::Merge(&extended)).await?;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "whole"},
        "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                                 "resources": {"limits": {"nvidia.com/gpu": 1}}}],
                 "nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0}
    }))?;
    objects::pods(ctx).create(&PostParams::default(), &pod).await?;
    let why = objects::unschedulable(&ctx.client, ns, "whole", PREPARE_TIMEOUT).await?;
    // The test's controller watches its own namespace only: the notebook's namespace gets one of its own (as a
    // tenant's would), which releases the notebook's claim once its pod is gone.
    let args = ["controller", "--namespace", other, "--leader-elect=false"];
    let tenant_controller = Component::start(&ctx.cluster.kubeconfig(), &format!("{other}-controller"), &args)?;
    tenant_controller.wait_ready().await?;
    let now = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    for (namespace, name) in [(ns, "late"), (other, "notebook")] {
        Api::<Pod>::namespaced(ctx.client.clone(), namespace).delete(name, &now).await?;
        Api::<ResourceClaim>::namespaced(ctx.client.clone(), namespace).delete(name, &DeleteParams::default()).await?;
    }
    let claim = wait::until("the nvidia.com/gpu pod's claim to be allocated", PREPARE_TIMEOUT, || async {
        let pod = objects::pods(ctx).get("whole").await?;
        let claim = pod.status.and_then(|s| s.extended_resource_claim_status).map(|s| s.resource_claim_name);
        let Some(claim) = claim else { return Ok(None) };
        let shares = shares(ctx, ns, &claim).await?;
        Ok((!shares.is_empty()).then_some(shares))
    })
    .await?;
    ensure!(claim.len() == 1 && claim[0].0 == "gpu-0", "the nvidia.com/gpu pod got {claim:?}");
    let sliced = wait::until("the class's time slice on gpu-0", PREPARE_TIMEOUT, || async {
        Ok(dirs.time_slices()?.get("gpu-0").filter(|interval| *interval == "Long").cloned())
    })
    .await;
    sliced.with_context(|| format!("time slices {:?}", dirs.time_slices()))?;
    pod_with_memory_share(ctx, ns, "after", node, class, "8Gi").await?;
    let why_after = objects::unschedulable(&ctx.client, ns, "after", PREPARE_TIMEOUT).await?;
    eprintln!(
        "nvidia.com/gpu: 1 waited for the shares ({why}), then held gpu-0 whole ({claim:?}); a share waited ({why_after})"
    );
    Ok(())
}
