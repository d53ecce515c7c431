//! The node agent needs nothing of the node beyond the DaemonSet's mounts: run as the chart runs it on a node whose
//! filesystem is a temporary directory, with only the DaemonSet's hostPaths made, it registers with the real
//! kubelet plugin watcher (which watches the whole plugins_registry while the agent sees only its own subdirectory),
//! prepares a pod's claim through the real DRA manager, and writes nothing outside its mounts.

use std::path::Path;

use super::identities::{node_bound_token, policy_in_force, with_simulated_agent_chart};
use super::render::check_node_agent_mounts;
use super::*;
use support::harness::KubeletHarness;

pub(super) async fn node_agent_works_with_only_its_mounts_beside_the_real_kubelet(
    ctx: TestContext,
) -> anyhow::Result<()> {
    with_simulated_agent_chart(&ctx, async |applied, class| through_the_mounts(&ctx, applied, class).await).await
}

/// The directories of the agent's environment that are host paths (re-rooted under the node's directory).
const HOST_PATH_VARS: [&str; 5] = [
    "GPU_DRA_KUBELET_REGISTRY_DIR",
    "GPU_DRA_KUBELET_PLUGINS_DIR",
    "GPU_DRA_CDI_DIR",
    "GPU_DRA_STATE_DIR",
    "GPU_DRA_MPS_DIR",
];

async fn through_the_mounts(ctx: &TestContext, applied: &[Value], class: &str) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let node = test_node_name(ctx, "mounts");
    ctx.cluster.add_node(&node)?;
    let pod_spec = node_agent_pod_spec(applied)?;
    let container = &pod_spec["containers"][0];
    check_node_agent_mounts(pod_spec, DRIVER, None)?;

    // The node's filesystem: only what the kubelet makes for the DaemonSet's hostPath volumes (DirectoryOrCreate).
    // Every mount is at its host path (checked above), so the container's view is the host's, re-rooted.
    let host = tempfile::Builder::new().prefix("gd-").tempdir_in("/tmp")?;
    let on_host = |path: &str| host.path().join(path.trim_start_matches('/'));
    let mut mounted = Vec::new();
    for volume in pod_spec["volumes"].as_array().context("no volumes")? {
        let path = volume["hostPath"]["path"].as_str().context("a volume that is no hostPath")?;
        std::fs::create_dir_all(on_host(path))?;
        mounted.push(on_host(path));
    }
    let overrides: HashMap<&str, String> = HOST_PATH_VARS
        .iter()
        .map(|var| {
            let value = env_value(container, var).with_context(|| format!("{var} not set"))?;
            Ok((*var, on_host(value).to_string_lossy().into_owned()))
        })
        .collect::<anyhow::Result<_>>()?;
    // The kubelet's own directory (its plugin watcher), and its state elsewhere.
    let kubelet_registry = on_host("/var/lib/kubelet/plugins_registry");
    let kubelet_state = tempfile::Builder::new().prefix("gd-kubelet-").tempdir_in("/tmp")?;
    let kubelet = KubeletHarness::start_watching(ctx, &node, &kubelet_registry, &kubelet_state.path().join("state"))?;

    let account = pod_spec["serviceAccountName"].as_str().context("no serviceAccountName")?;
    let token = node_bound_token(ctx, account, &node).await?;
    let kubeconfig = ctx.cluster.kubeconfig_for_token(&format!("{ns}-mounts"), &token)?;
    policy_in_force(ctx, &client_for(&kubeconfig).await?, &test_node_name(ctx, "other")).await?;
    let fields = HashMap::from([("spec.nodeName", node.clone())]);
    let args = command_line(container, "node-agent", &fields, &overrides)?;
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = Component::start(&kubeconfig, &format!("{ns}-mounts-agent"), &args)?;
    agent.wait_ready().await?;
    kubelet.wait_for("registered", "", SETTLE).await.with_context(|| agent.log_tail())?;

    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "pair"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": class, "count": 2}}]}}
    }))?;
    objects::claims(ctx).create(&PostParams::default(), &claim).await?;
    objects::create_pod_on(ctx, "trainer", &node, json!([{"name": "gpus", "resourceClaimName": "pair"}])).await?;
    let prepared =
        kubelet.wait_for("prepared", &format!("{ns}/trainer"), SETTLE).await.with_context(|| agent.log_tail())?;
    let ids = prepared["containers"]["app"].as_array().map_or(0, Vec::len);
    // Two GPUs, and the mount of the request's device metadata file.
    ensure!(ids == 3, "CDI devices of the prepared pod: {prepared}");

    // Everything the agent made lies inside a mount: the sockets, the CDI spec, the checkpoint, the device metadata.
    let made = files_under(host.path())?;
    let registry = on_host(&format!("/var/lib/kubelet/plugins_registry/{DRIVER}"));
    let registration = support::node::registration_socket_in(&registry);
    ensure!(
        registration.is_some_and(|r| made.contains(&r)),
        "no registration socket in {}: {made:?}",
        registry.display()
    );
    ensure!(made.iter().any(|f| f.starts_with(on_host("/var/run/cdi"))), "no CDI spec: {made:?}");
    let metadata = on_host("/var/lib/gpu-dra/device-metadata");
    ensure!(made.iter().any(|f| f.starts_with(&metadata)), "no device metadata file: {made:?}");
    let outside: Vec<_> = made.iter().filter(|f| !mounted.iter().any(|m| f.starts_with(m))).collect();
    ensure!(outside.is_empty(), "the agent wrote outside its mounts: {outside:?}");
    ensure!(!agent.log_text().contains("forbidden"), "the agent was refused something:\n{}", agent.log_tail());
    Ok(())
}

/// Every entry under `dir` that is not a directory.
fn files_under(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                pending.push(entry.path());
            } else {
                files.push(entry.path());
            }
        }
    }
    Ok(files)
}
