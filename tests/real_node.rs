//! gpu-dra installed the way operators install it, on a real node: `helm install charts/gpu-dra` with the image
//! built from the Dockerfile's runtime stage, onto a kubelet v1.37.2 + containerd 2.4 node (e2e/node.sh) joined to
//! the local control plane. The controller replicas and the node agent run as containers; workload containers get
//! their GPUs (simulated: device nodes with NVIDIA's major number) from the agent's CDI specs through containerd.
//!
//! Needs root and the node binaries (`e2e/build-node.sh`); without them the tests are ignored, and fail under CI.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use support::real_node::RealNode;
use support::{TestContext, objects, wait};

#[path = "real_node/host.rs"]
mod host;
#[path = "real_node/leftover.rs"]
mod leftover;
#[path = "real_node/mig.rs"]
mod mig;
#[path = "real_node/monitoring.rs"]
mod monitoring;
#[path = "real_node/mps.rs"]
mod mps;
#[path = "real_node/quota.rs"]
mod quota;
#[path = "real_node/workloads.rs"]
mod workloads;

use leftover::a_node_left_by_a_killed_run_is_taken_down_by_the_next_up;
use mig::containers_get_exactly_their_mig_devices;
use monitoring::a_gpu_monitor_sees_which_container_holds_which_gpu_through_pod_resources;
use mps::containers_of_a_pod_are_clients_of_their_claims_mps_daemon;
use quota::a_job_over_its_namespaces_gpu_quota_runs_as_its_pods_finish;
use workloads::a_statefulset_lives_through_a_replaced_replica_a_drain_and_its_namespace_deletion;

fn main() {
    support::run_on_real_node_cluster(
        "real_node",
        Duration::from_secs(480),
        &[
            test!(helm_install_gives_real_containers_their_gpus_and_uninstall_leaves_nothing),
            test!(taking_a_node_down_leaves_the_machine_as_it_found_it_even_with_a_dead_kubelet),
            test!(a_node_left_by_a_killed_run_is_taken_down_by_the_next_up),
            test!(containers_of_two_namespaces_share_one_gpu_by_memory),
            test!(containers_get_exactly_their_mig_devices),
            test!(containers_of_a_pod_are_clients_of_their_claims_mps_daemon),
            test!(a_statefulset_lives_through_a_replaced_replica_a_drain_and_its_namespace_deletion),
            test!(a_job_over_its_namespaces_gpu_quota_runs_as_its_pods_finish),
            test!(a_gpu_monitor_sees_which_container_holds_which_gpu_through_pod_resources),
        ],
    )
}

const GPUS: usize = 4;
/// The label Node Feature Discovery puts on a node with an NVIDIA PCI device; the chart's DaemonSet selects it.
const NVIDIA_PCI_LABEL: &str = "feature.node.kubernetes.io/pci-10de.present";
const WAIT: Duration = Duration::from_secs(90);

// --- images and tools ----------------------------------------------------------------------------------------------

/// The three images `e2e/build-images.sh` builds from the release binary (built once per test binary).
fn images() -> anyhow::Result<Vec<PathBuf>> {
    static BUILT: OnceLock<Result<Vec<PathBuf>, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("real-node-images");
            let output = Command::new(repo().join("e2e/build-images.sh"))
                .arg("--binary")
                .arg(support::release_binary())
                .arg(&out)
                .output()
                .map_err(|e| format!("run e2e/build-images.sh: {e}"))?;
            if !output.status.success() {
                return Err(format!("e2e/build-images.sh failed: {}", String::from_utf8_lossy(&output.stderr)));
            }
            Ok(["pause.tar", "workload.tar", "gpu-dra.tar"].iter().map(|f| out.join(f)).collect())
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `helm ARGS…` against the test cluster; fails with helm's error output.
fn helm(ctx: &TestContext, args: &[&str]) -> anyhow::Result<Output> {
    let output = Command::new(support::k8s_tool("helm")?)
        .args(args)
        .env("KUBECONFIG", ctx.cluster.kubeconfig())
        .output()
        .context("run helm")?;
    ensure!(output.status.success(), "helm {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
    Ok(output)
}

// --- the node and the release --------------------------------------------------------------------------------------

/// A real node with the images imported and NFD's NVIDIA label, as on a GPU machine.
async fn gpu_node(ctx: &TestContext, name: &str) -> anyhow::Result<RealNode> {
    let images = images()?;
    let node = RealNode::up(&ctx.cluster, name)?;
    node.import(&images)?;
    let label = json!({"metadata": {"labels": {NVIDIA_PCI_LABEL: "true"}}});
    Api::<Node>::all(ctx.client.clone()).patch(name, &PatchParams::default(), &Patch::Merge(&label)).await?;
    Ok(node)
}

/// The values a real node needs beyond the chart's defaults: its kubelet directory and CDI directory, and the
/// simulated backend (no NVIDIA driver here), unprivileged as it needs no device access.
fn node_values(node: &RealNode) -> anyhow::Result<Vec<String>> {
    Ok(vec![
        format!("nodeAgent.kubeletDir={}", node.kubelet_dir()?.display()),
        format!("nodeAgent.cdiDir={}", node.cdi_dir()?.display()),
        format!("nodeAgent.stateDir={}", node.agent_state_dir()?.display()),
        format!("nodeAgent.mpsDir={}", node.agent_mps_dir()?.display()),
        "nodeAgent.gpuBackend=simulated".into(),
        format!("nodeAgent.simulatedGpus={GPUS}xH100-80GB"),
        "nodeAgent.privileged=false".into(),
        "deviceClasses.gpu.extendedResourceName=nvidia.com/gpu".into(),
    ])
}

/// Runs `body` on a fresh GPU node `name`, then uninstalls the chart and takes the node down whatever happened (the
/// chart's cluster-scoped objects would stop the next install).
async fn on_gpu_node(
    ctx: &TestContext,
    name: &str,
    body: impl AsyncFnOnce(&RealNode) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let node = gpu_node(ctx, name).await?;
    let result = body(&node).await;
    let uninstalled = helm(ctx, &["uninstall", "gpu-dra", "-n", &ctx.namespace, "--wait", "--timeout", "120s"]);
    let down = node.down();
    result?;
    uninstalled?;
    down
}

fn install(ctx: &TestContext, node: &RealNode) -> anyhow::Result<()> {
    install_with(ctx, node, &[])
}

/// [`install`] with more values (`--set`; later ones win).
fn install_with(ctx: &TestContext, node: &RealNode, more: &[&str]) -> anyhow::Result<()> {
    let chart = repo().join("charts/gpu-dra");
    let mut args =
        vec!["install".to_string(), "gpu-dra".into(), chart.display().to_string(), "-n".into(), ctx.namespace.clone()];
    for value in node_values(node)?.into_iter().chain(more.iter().map(|v| v.to_string())) {
        args.extend(["--set".into(), value]);
    }
    args.extend(["--wait".into(), "--timeout".into(), "120s".into()]);
    helm(ctx, &args.iter().map(String::as_str).collect::<Vec<_>>()).map(drop)
}

// --- workloads -----------------------------------------------------------------------------------------------------

/// The command every workload container runs: lists its NVIDIA device nodes and the UUIDs it was given, then waits.
const SHOW_GPUS: &str = "ls -l /dev/ | grep ' nvidia[0-9]*$'; echo GPU_DRA_GPU_UUIDS=$GPU_DRA_GPU_UUIDS; \
                         for f in $(find /var/run/kubernetes.io/dra-device-attributes -type f 2>/dev/null); do \
                         echo DEVICE_METADATA $f $(head -n 1 $f); done; echo listed; exec sleep 3600";

/// The device metadata files (KEP-5304) a container running [`SHOW_GPUS`] found: each path with the first object of
/// its stream (the newest version written).
fn device_metadata_seen(pod: &str, log: &str) -> anyhow::Result<Vec<(String, Value)>> {
    let mut seen = Vec::new();
    for line in log.lines() {
        let Some(rest) = line.strip_prefix("DEVICE_METADATA ") else { continue };
        let (path, object) = rest.split_once(' ').with_context(|| format!("{pod}: odd metadata line {line}"))?;
        let object = serde_json::from_str(object).with_context(|| format!("{pod}: metadata of {path}: {object}"))?;
        seen.push((path.to_string(), object));
    }
    Ok(seen)
}

/// Checks that `pod` found one device metadata file, at `path`, of `claim`, listing the GPUs it `saw`.
async fn check_device_metadata(
    ctx: &TestContext,
    pod: &str,
    path: &str,
    claim: &str,
    saw: &Seen,
) -> anyhow::Result<()> {
    let found = device_metadata_seen(pod, &listing(ctx, &ctx.namespace, pod).await?)?;
    let [(found_path, object)] = found.as_slice() else { bail!("{pod}: device metadata files {found:?}") };
    let uuids: BTreeSet<String> = object["requests"][0]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["attributes"]["uuid"]["string"].as_str().map(String::from))
        .collect();
    ensure!(
        found_path.starts_with(path)
            && object["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
            && object["metadata"]["name"] == claim
            && uuids == saw.uuids,
        "{pod}: device metadata {found_path} {object}, expected {path}… of claim {claim} listing {saw:?}"
    );
    Ok(())
}

async fn create_template(ctx: &TestContext) -> anyhow::Result<()> {
    objects::create_template(
        ctx,
        "one-gpu",
        json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpu-dra.dev"}}]}}}),
    )
    .await
    .map(drop)
}

/// A busybox pod on `node` running [`SHOW_GPUS`], with a template claim or an extended-resource limit.
async fn workload(ctx: &TestContext, name: &str, node: &str, extended: bool) -> anyhow::Result<()> {
    let template = (!extended).then_some("one-gpu");
    workload_in(ctx, &ctx.namespace, name, node, template).await
}

/// [`workload`] in `namespace`, claiming from `template` (`None`: `nvidia.com/gpu: 1`).
async fn workload_in(
    ctx: &TestContext,
    namespace: &str,
    name: &str,
    node: &str,
    template: Option<&str>,
) -> anyhow::Result<()> {
    let mut container = json!({
        "name": "main", "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
        "command": ["sh", "-c", SHOW_GPUS]
    });
    let mut spec = json!({"nodeName": Value::Null, "nodeSelector": {"kubernetes.io/hostname": node},
                          "terminationGracePeriodSeconds": 1});
    match template {
        None => container["resources"] = json!({"limits": {"nvidia.com/gpu": 1}}),
        Some(template) => {
            container["resources"] = json!({"claims": [{"name": "gpu"}]});
            spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": template}]);
        }
    }
    spec["containers"] = json!([container]);
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec}))?;
    Api::<Pod>::namespaced(ctx.client.clone(), namespace).create(&PostParams::default(), &pod).await?;
    Ok(())
}

/// What a container printed about its GPUs: the minors of its `/dev/nvidia<N>` nodes (each a character device
/// with major 195) and its `GPU_DRA_GPU_UUIDS`.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    minors: BTreeSet<i64>,
    uuids: BTreeSet<String>,
}

/// Waits until `pod` runs and its log is complete (`kubectl logs`: API server → kubelet → containerd).
async fn seen_by(ctx: &TestContext, pod: &str) -> anyhow::Result<Seen> {
    seen_by_in(ctx, &ctx.namespace, pod).await
}

/// [`seen_by`] for a pod in `namespace`.
async fn seen_by_in(ctx: &TestContext, namespace: &str, pod: &str) -> anyhow::Result<Seen> {
    let log = listing(ctx, namespace, pod).await?;
    parse_seen(pod, &log)
}

/// Reads what [`SHOW_GPUS`] printed in `pod`'s log.
fn parse_seen(pod: &str, log: &str) -> anyhow::Result<Seen> {
    let mut seen = Seen { minors: BTreeSet::new(), uuids: BTreeSet::new() };
    for line in log.lines() {
        if let Some(uuids) = line.strip_prefix("GPU_DRA_GPU_UUIDS=") {
            seen.uuids = uuids.split(',').filter(|u| !u.is_empty()).map(String::from).collect();
        } else if let Some(device) = line.split_whitespace().last().and_then(|d| d.strip_prefix("nvidia")) {
            ensure!(line.starts_with('c'), "{pod}: /dev/nvidia{device} is not a character device: {line}");
            ensure!(line.contains(" 195,"), "{pod}: /dev/nvidia{device} has not NVIDIA's major 195: {line}");
            seen.minors.insert(device.parse().with_context(|| format!("{pod}: odd device line {line}"))?);
        }
    }
    Ok(seen)
}

/// The log of `pod` in `namespace` once it runs (or ran to completion) and has listed its devices (`echo listed`).
async fn listing(ctx: &TestContext, namespace: &str, pod: &str) -> anyhow::Result<String> {
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), namespace);
    wait::until(&format!("pod {pod} to run and list its devices"), WAIT, || async {
        let phase = pods.get(pod).await?.status.and_then(|s| s.phase).unwrap_or_default();
        // A Job's pod may have finished since.
        if phase != "Running" && phase != "Succeeded" {
            return Ok(None);
        }
        let log = pods.logs(pod, &LogParams::default()).await?;
        Ok(log.contains("listed").then_some(log))
    })
    .await
}

/// What the scheduler allocated to `claim`, once it has: the minors and UUIDs the node agent published for those
/// devices. (A claim just recorded in its pod's status may not be allocated yet.)
async fn allocated(ctx: &TestContext, node: &str, claim: &str) -> anyhow::Result<Seen> {
    let claims = objects::claims(ctx);
    let results = wait::until(&format!("claim {claim} to be allocated"), WAIT, || async {
        let claim = claims.get(claim).await?;
        let results = claim.status.and_then(|s| s.allocation).and_then(|a| a.devices).and_then(|d| d.results);
        Ok(results.filter(|r| !r.is_empty()))
    })
    .await?;
    let devices = objects::published_devices(&ctx.client, node).await?;
    let mut seen = Seen { minors: BTreeSet::new(), uuids: BTreeSet::new() };
    for result in results {
        let device = devices
            .iter()
            .find(|d| d.name == result.device)
            .with_context(|| format!("device {} not published for {node}", result.device))?;
        let attributes = device.attributes.as_ref().context("device without attributes")?;
        seen.minors.insert(attributes.get("minor").and_then(|a| a.int).context("no minor attribute")?);
        seen.uuids.insert(attributes.get("uuid").and_then(|a| a.string.clone()).context("no uuid attribute")?);
    }
    Ok(seen)
}

/// The claim recorded for `pod`: its template claim, or the one the scheduler made for its extended resource.
async fn claim_of(ctx: &TestContext, pod: &str) -> anyhow::Result<String> {
    let pods = objects::pods(ctx);
    wait::until(&format!("a claim recorded for pod {pod}"), WAIT, || async {
        let pod = pods.get(pod).await?;
        let template = objects::claim_statuses(&pod).into_iter().find_map(|(_, claim)| claim);
        let extended = pod.status.and_then(|s| s.extended_resource_claim_status).map(|s| s.resource_claim_name);
        Ok(template.or(extended))
    })
    .await
}

/// The CDI spec files in the node's CDI directory that name `claim_uid`.
fn specs_of(node: &RealNode, claim_uid: &str) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(node.cdi_dir()?)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.contains(claim_uid) {
            names.push(name);
        }
    }
    Ok(names)
}

async fn claim_uid(ctx: &TestContext, claim: &str) -> anyhow::Result<String> {
    objects::claims(ctx).get(claim).await?.metadata.uid.context("claim without uid")
}

async fn delete_and_wait(ctx: &TestContext, pod: &str) -> anyhow::Result<()> {
    let pods = objects::pods(ctx);
    pods.delete(pod, &DeleteParams::default()).await?;
    wait::until(&format!("pod {pod} to be gone"), WAIT, || async {
        Ok(pods.get_opt(pod).await?.is_none().then_some(()))
    })
    .await
}

/// The node-agent pod on `node` (uid, name) once it is ready.
async fn agent_pod(ctx: &TestContext, node: &str) -> anyhow::Result<(String, String)> {
    let pods = objects::pods(ctx);
    let selector = "app.kubernetes.io/component=node-agent";
    let params = ListParams::default().labels(selector).fields(&format!("spec.nodeName={node}"));
    wait::until("a ready node-agent pod", WAIT, || async {
        let ready = pods.list(&params).await?.items.into_iter().find(|p| {
            p.metadata.deletion_timestamp.is_none()
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        Ok(ready.and_then(|p| Some((p.metadata.uid?, p.metadata.name?))))
    })
    .await
}

// --- the tests -----------------------------------------------------------------------------------------------------

async fn helm_install_gives_real_containers_their_gpus_and_uninstall_leaves_nothing(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = gpu_node(&ctx, "gpu-node").await?;
    let result = install_use_upgrade_uninstall(&ctx, &node).await;
    let down = node.down();
    result?;
    down
}

async fn install_use_upgrade_uninstall(ctx: &TestContext, node: &RealNode) -> anyhow::Result<()> {
    let n = node.name.as_str();
    install(ctx, node)?;

    // The controller: two replicas in containers, talking to the API server through the `kubernetes` Service
    // (kube-proxy), one of them holding the Lease.
    let pods = objects::pods(ctx);
    let controllers: BTreeSet<String> = pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    ensure!(controllers.len() == 2, "expected two controller replicas, found {controllers:?}");
    let leases = Api::<Lease>::namespaced(ctx.client.clone(), &ctx.namespace);
    let holder = wait::until("a controller replica to hold the Lease", WAIT, || async {
        let held = leases
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .find_map(|l| l.spec?.holder_identity.filter(|h| controllers.contains(h)));
        Ok(held)
    })
    .await?;
    eprintln!("controller replicas {controllers:?}; {holder} holds the Lease");
    let log = pods.logs(&holder, &LogParams::default()).await?;
    ensure!(
        log.lines().any(|l| l.contains("API server configuration") && l.contains("server=https://10.0.0.1/")),
        "the controller did not reach the API server through the kubernetes Service (in-cluster config):\n{log}"
    );

    // The node agent: its DaemonSet pod runs on the node, registered with the kubelet, and published the GPUs.
    let (agent_uid, agent) = agent_pod(ctx, n).await?;
    let slices = Api::<ResourceSlice>::all(ctx.client.clone());
    let published = wait::until("the node's ResourceSlice", WAIT, || async {
        let list = slices.list(&ListParams::default().fields(&format!("spec.nodeName={n}"))).await?;
        let count: usize = list.items.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).sum();
        Ok((count == GPUS).then_some(count))
    })
    .await?;
    eprintln!("agent {agent} published {published} GPUs");

    // A workload with a template claim sees exactly its allocated GPU, from inside the container.
    create_template(ctx).await?;
    workload(ctx, "first", n, false).await?;
    let first_claim = claim_of(ctx, "first").await?;
    let first = seen_by(ctx, "first").await?;
    let want = allocated(ctx, n, &first_claim).await?;
    ensure!(first == want, "pod first sees {first:?}; its claim {first_claim} was allocated {want:?}");
    ensure!(first.minors.len() == 1, "one GPU requested, the container sees {first:?}");
    // Its device metadata, where upstream's reader looks for a template's claim.
    let path =
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/gpu.gpu-dra.dev-metadata.json";
    check_device_metadata(ctx, "first", path, &first_claim, &first).await?;

    // A second pod gets a different GPU.
    workload(ctx, "second", n, false).await?;
    let second_claim = claim_of(ctx, "second").await?;
    let second = seen_by(ctx, "second").await?;
    ensure!(second == allocated(ctx, n, &second_claim).await?, "pod second sees {second:?}, not its allocation");
    ensure!(first.uuids.is_disjoint(&second.uuids), "pods first and second share a GPU: {first:?} {second:?}");

    // Deleting a pod unprepares its claim: its CDI spec goes, and so does the claim.
    let first_uid = claim_uid(ctx, &first_claim).await?;
    ensure!(!specs_of(node, &first_uid)?.is_empty(), "no CDI spec for {first_claim} while its pod runs");
    delete_and_wait(ctx, "first").await?;
    let released = wait::until("the first pod's CDI spec and claim to be gone", WAIT, || async {
        let gone =
            specs_of(node, &first_uid)?.is_empty() && objects::claims(ctx).get_opt(&first_claim).await?.is_none();
        Ok(gone.then_some(()))
    })
    .await;
    if let Err(err) = released {
        let claim = objects::claims(ctx).get_opt(&first_claim).await?;
        bail!("{err}: CDI specs {:?}, claim {:?}", specs_of(node, &first_uid)?, claim.map(|c| (c.metadata, c.status)));
    }

    // The extended-resource path: `nvidia.com/gpu: 1` through the DeviceClass's extendedResourceName.
    workload(ctx, "extended", n, true).await?;
    let extended_claim = claim_of(ctx, "extended").await?;
    let extended = seen_by(ctx, "extended").await?;
    ensure!(extended.minors.len() == 1, "nvidia.com/gpu: 1 should give one GPU, the container sees {extended:?}");
    ensure!(extended == allocated(ctx, n, &extended_claim).await?, "pod extended sees {extended:?}, not its claim's");
    // The scheduler's claim is no template's: its metadata is under the claim's name.
    let path = format!("/var/run/kubernetes.io/dra-device-attributes/resourceclaims/{extended_claim}/");
    check_device_metadata(ctx, "extended", &path, &extended_claim, &extended).await?;

    // GPU health through the real kubelet: a double-bit ECC error on pod second's GPU (fault injection of the
    // simulated backend) taints it and the kubelet writes Unhealthy into the container's status from the agent's
    // DRAResourceHealth stream; a reset makes it Healthy again. (Not the extended-resource pod: kubelet 1.37.2 reports
    // health only for claims named in `resources.claims`, pkg/kubelet/cm/dra/manager.go.)
    let minor = second.minors.iter().next().context("pod second has no GPU")?;
    let device = format!("gpu-{minor}");
    inject_fault(node, &format!("{device} ecc-dbe"))?;
    let healths = || async {
        let pod = serde_json::to_value(pods.get("second").await?)?;
        let statuses = &pod["status"]["containerStatuses"][0]["allocatedResourcesStatus"];
        let healths: Vec<String> = statuses
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["resources"].as_array().cloned().unwrap_or_default())
            .filter(|r| r["resourceID"].as_str().is_some_and(|id| id.ends_with(&device)))
            .filter_map(|r| r["health"].as_str().map(String::from))
            .collect();
        anyhow::Ok(healths)
    };
    wait::until("the kubelet to report the faulted GPU Unhealthy in the pod status", WAIT, || async {
        Ok((healths().await? == ["Unhealthy"]).then_some(()))
    })
    .await?;
    inject_fault(node, &format!("{device} clear"))?;
    wait::until("the kubelet to report the reset GPU Healthy again", WAIT, || async {
        Ok((healths().await? == ["Healthy"]).then_some(()))
    })
    .await?;

    // helm upgrade with a changed value rolls the agent; a running pod keeps its GPU and its spec, its container
    // restarting gets them again, and a pod created after the roll is prepared by the new agent.
    let second_uid = claim_uid(ctx, &second_claim).await?;
    helm(
        ctx,
        &[
            "upgrade",
            "gpu-dra",
            &repo().join("charts/gpu-dra").display().to_string(),
            "-n",
            &ctx.namespace,
            "--reuse-values",
            "--set",
            "logging.filter=debug",
            "--wait",
            "--timeout",
            "120s",
        ],
    )?;
    let daemonsets = Api::<DaemonSet>::namespaced(ctx.client.clone(), &ctx.namespace);
    wait::until("the DaemonSet roll to finish", WAIT, || async {
        let ds = daemonsets.list(&ListParams::default().labels("app.kubernetes.io/component=node-agent")).await?;
        let done = ds.items.iter().all(|d| {
            let s = d.status.as_ref();
            s.and_then(|s| s.updated_number_scheduled) == s.map(|s| s.desired_number_scheduled)
                && s.and_then(|s| s.number_available) == s.map(|s| s.desired_number_scheduled)
        });
        Ok(done.then_some(()))
    })
    .await?;
    let (new_agent_uid, new_agent) = agent_pod(ctx, n).await?;
    ensure!(new_agent_uid != agent_uid, "helm upgrade did not roll the node agent ({agent} is still there)");
    let still = pods.get("second").await?;
    let restarts = still.status.as_ref().and_then(|s| s.container_statuses.as_ref()).map(|c| c[0].restart_count);
    ensure!(
        still.status.and_then(|s| s.phase).as_deref() == Some("Running") && restarts == Some(0),
        "pod second did not keep running through the agent's roll (restarts {restarts:?})"
    );
    ensure!(!specs_of(node, &second_uid)?.is_empty(), "the roll lost pod second's CDI spec");
    // Its container restarting after the roll (a crash; here stopped through the CRI) is created again from the
    // claim's spec as the new agent found it at its start: the same GPU, and its device metadata.
    let namespace = format!("^{}$", ctx.namespace);
    let sandbox = node.crictl(&["pods", "-q", "--state", "ready", "--name", "^second$", "--namespace", &namespace])?;
    let container = node.crictl(&["ps", "-q", "--name", "^main$", "--pod", sandbox.trim()])?;
    ensure!(!container.trim().is_empty(), "no running container of pod second (sandbox {sandbox:?})");
    node.crictl(&["stop", "--timeout", "0", container.trim()])?;
    wait::until("pod second's container to run again", WAIT, || async {
        let pod = pods.get("second").await?;
        let status = pod.status.and_then(|s| s.container_statuses).and_then(|c| c.into_iter().next());
        Ok(status.filter(|c| c.restart_count == 1 && c.ready).map(drop))
    })
    .await?;
    let restarted = seen_by(ctx, "second").await?;
    ensure!(restarted == second, "pod second's restarted container sees {restarted:?}, before {second:?}");
    let path =
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/gpu.gpu-dra.dev-metadata.json";
    check_device_metadata(ctx, "second", path, &second_claim, &restarted).await?;
    workload(ctx, "third", n, false).await?;
    let third_claim = claim_of(ctx, "third").await?;
    let third = seen_by(ctx, "third").await?;
    ensure!(third == allocated(ctx, n, &third_claim).await?, "pod third sees {third:?} after the roll");
    eprintln!("after the roll to {new_agent}: second kept {:?}, third got {:?}", second.uuids, third.uuids);
    // The new agent unprepares what the old one prepared.
    delete_and_wait(ctx, "second").await?;
    wait::until("the second pod's CDI spec to be removed by the new agent", WAIT, || async {
        Ok(specs_of(node, &second_uid)?.is_empty().then_some(()))
    })
    .await?;

    // helm uninstall, after the workloads: no slice, claim, CDI spec or plugin socket is left behind. The slice
    // goes last: the kubelet wipes a driver's slices 30 s after its plugin unregisters (defaultWipingDelay in
    // pkg/kubelet/cm/dra), a grace that keeps them through an agent restart or roll.
    delete_and_wait(ctx, "third").await?;
    delete_and_wait(ctx, "extended").await?;
    helm(ctx, &["uninstall", "gpu-dra", "-n", &ctx.namespace, "--wait", "--timeout", "120s"])?;
    let kubelet_dir = node.kubelet_dir()?;
    let last_seen = std::sync::Mutex::new(Vec::new());
    let clean = wait::until("nothing of gpu-dra left after helm uninstall", WAIT, || async {
        let mut left = Vec::new();
        let list = slices.list(&ListParams::default().fields(&format!("spec.nodeName={n}"))).await?;
        left.extend(list.items.into_iter().filter_map(|s| s.metadata.name).map(|s| format!("slice {s}")));
        let claims = objects::list_claims(ctx).await?;
        left.extend(claims.into_iter().filter_map(|c| c.metadata.name).map(|c| format!("claim {c}")));
        left.extend(files(&node.cdi_dir()?)?.into_iter().map(|f| format!("CDI spec {f}")));
        for dir in ["plugins_registry", "plugins/gpu.gpu-dra.dev"] {
            let sockets = files(&kubelet_dir.join(dir))?.into_iter().filter(|f| f.ends_with(".sock"));
            left.extend(sockets.map(|f| format!("socket {dir}/{f}")));
        }
        let done = left.is_empty();
        *last_seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = left;
        Ok(done.then_some(()))
    })
    .await;
    clean.with_context(|| format!("helm uninstall left behind: {:?}", last_seen.lock().map(|l| l.clone())))
}

/// GPUs shared by memory on the real node (`nodeAgent.gpuSharing=by-memory`, one H100): a trainer and a notebook in
/// two namespaces, each claiming 39Gi through a template (two of 40Gi do not fit an H100's 81,559 MiB), run in
/// containers that both see the same GPU; a third pod
/// asking 8Gi more stays unschedulable until the trainer is deleted, then runs on that GPU too.
async fn containers_of_two_namespaces_share_one_gpu_by_memory(ctx: TestContext) -> anyhow::Result<()> {
    let node = gpu_node(&ctx, "shared-gpu-node").await?;
    let other = support::create_namespace(&ctx.client, "notebooks").await?;
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    let result = share_one_gpu(&ctx, &node, &other).await;
    // The chart's cluster-scoped objects would stop the next install: uninstall whatever happened.
    let uninstalled = helm(&ctx, &["uninstall", "gpu-dra", "-n", &ctx.namespace, "--wait", "--timeout", "120s"]);
    let _ = namespaces.delete(&other, &DeleteParams::default()).await;
    let down = node.down();
    result?;
    uninstalled?;
    down
}

async fn share_one_gpu(ctx: &TestContext, node: &RealNode, other: &str) -> anyhow::Result<()> {
    let n = node.name.as_str();
    install_with(ctx, node, &["nodeAgent.gpuSharing=by-memory", "nodeAgent.simulatedGpus=1xH100-80GB"])?;
    let share = |memory: &str| {
        json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.gpu-dra.dev", "capacity": {"requests": {"memory": memory}}}}]}}})
    };
    let ns = ctx.namespace.as_str();
    // The trainer's share asks for a long time slice, in NVIDIA's spelling (a manifest written for NVIDIA's driver);
    // the notebook's asks nothing and takes the GPU as it is.
    let mut time_sliced = share("39Gi");
    time_sliced["spec"]["devices"]["config"] = json!([{"opaque": {"driver": "gpu.gpu-dra.dev", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}}}]);
    objects::create_template_in(&ctx.client, ns, "gpu-39gi", time_sliced).await?;
    objects::create_template_in(&ctx.client, other, "gpu-39gi", share("39Gi")).await?;
    objects::create_template_in(&ctx.client, ns, "gpu-8gi", share("8Gi")).await?;
    workload_in(ctx, ns, "trainer", n, Some("gpu-39gi")).await?;
    workload_in(ctx, other, "notebook", n, Some("gpu-39gi")).await?;
    let trainer = seen_by_in(ctx, ns, "trainer").await?;
    let notebook = seen_by_in(ctx, other, "notebook").await?;
    ensure!(trainer.minors.len() == 1 && trainer.uuids.len() == 1, "the trainer sees {trainer:?}");
    ensure!(trainer == notebook, "one GPU shared, but the trainer sees {trainer:?} and the notebook {notebook:?}");
    let time_slices = node.agent_state_dir()?.join("simulated-time-slices.json");
    let slices_now =
        || std::fs::read_to_string(&time_slices).unwrap_or_default().split_whitespace().collect::<String>();
    ensure!(slices_now() == r#"{"gpu-0":"Long"}"#, "while the trainer runs: {}", slices_now());

    workload_in(ctx, ns, "late", n, Some("gpu-8gi")).await?;
    let why = objects::unschedulable(&ctx.client, ns, "late", WAIT).await?;
    delete_and_wait(ctx, "trainer").await?;
    wait::until("the GPU's time slice to be set back", WAIT, || async { Ok((slices_now() == "{}").then_some(())) })
        .await?;
    let late = seen_by(ctx, "late").await?;
    ensure!(late == notebook, "the late pod sees {late:?}, not the shared GPU {notebook:?}");
    eprintln!(
        "trainer (time slice Long) and notebook shared {:?}; late waited ({why}), then got it too; the slice was set \
         back",
        notebook.uuids
    );
    delete_and_wait(ctx, "late").await?;
    let notebooks = Api::<Pod>::namespaced(ctx.client.clone(), other);
    notebooks.delete("notebook", &DeleteParams::default()).await?;
    wait::until("the notebook to be gone", WAIT, || async {
        Ok(notebooks.get_opt("notebook").await?.is_none().then_some(()))
    })
    .await
}

/// Injects a fault line into the node agent's state directory (on the host, through its hostPath), as an operator
/// would: the file appears whole.
fn inject_fault(node: &RealNode, line: &str) -> anyhow::Result<()> {
    support::node::inject_fault(&node.agent_state_dir()?, line)
}

/// File names in `dir` (none when it does not exist).
fn files(dir: &Path) -> anyhow::Result<Vec<String>> {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries.map(|e| Ok(e?.file_name().to_string_lossy().into_owned())).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("read {}", dir.display())),
    }
}

async fn taking_a_node_down_leaves_the_machine_as_it_found_it_even_with_a_dead_kubelet(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let before = host::snapshot()?;
    let node = gpu_node(&ctx, "down-node").await?;
    // A pod gives the node everything a pod leaves on a machine: a network namespace, a veth on the bridge,
    // cgroups, mounts, iptables rules of kube-proxy's.
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain"},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": "down-node"}, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "main", "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", "echo listed; exec sleep 3600"]}]}
    }))?;
    objects::pods(&ctx).create(&PostParams::default(), &pod).await?;
    seen_by(&ctx, "plain").await?;
    let during = host::snapshot()?;
    ensure!(during != before, "the node changed nothing on the machine; the snapshot would not see a leftover");

    // The kubelet dies (SIGKILL) with the pod running: `down` must clean up without it.
    host::kill_process_naming(&format!("--hostname-override {}", node.name))?;
    node.down()?;
    let after = host::snapshot()?;
    let diff = before.diff(&after);
    ensure!(diff.is_empty(), "e2e/node.sh down left the machine changed:\n{}", diff.join("\n"));
    let nodes = Api::<Node>::all(ctx.client.clone());
    wait::until("the Node object to be deleted", WAIT, || async {
        Ok(nodes.get_opt("down-node").await?.is_none().then_some(()))
    })
    .await?;
    if during.processes.is_empty() {
        bail!("no node process was seen while the node ran; the snapshot is blind to processes");
    }
    Ok(())
}
