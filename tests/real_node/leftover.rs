//! A real node left behind by a run that was killed (a CI job stopped, a test binary killed, a session ended): its
//! cluster's bookkeeping gone with the run's state directory, its directories, mounts, cgroups and host changes still
//! on the machine, its processes still running or dead but for a container that outlived its shim. The next run's
//! `e2e/node.sh up` must take it down whole (instead of failing every real-node test after it), and refuse only a
//! node whose cluster still lives (one real node per machine), saying how to take it down.

use std::path::{Path, PathBuf};

use anyhow::ensure;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;

use super::support::real_node::{self, RealNode};
use super::support::{TestContext, objects, wait};
use super::{WAIT, gpu_node, host, seen_by};

const LEFT: &str = "left-node";
const NEXT: &str = "next-node";
const THIRD: &str = "third-node";

pub(super) async fn a_node_left_by_a_killed_run_is_taken_down_by_the_next_up(ctx: TestContext) -> anyhow::Result<()> {
    let outcome = nodes_left_behind(&ctx).await;
    // Whatever happened, none of the nodes stays up: the next real-node test's `up` would be refused.
    for name in [LEFT, NEXT, THIRD] {
        real_node::down_named(&ctx.cluster, name)?;
    }
    outcome
}

async fn nodes_left_behind(ctx: &TestContext) -> anyhow::Result<()> {
    let before = host::snapshot()?;
    // `down` empties and removes kubepods cgroups only where `up` found none (they may be a host kubelet's).
    ensure!(
        before.cgroups.is_empty(),
        "this machine has kubepods cgroups before any node started ({:?}): a host kubelet's, or left by a node of an \
         older e2e/node.sh; the test of a container outliving its node needs none",
        before.cgroups
    );
    let left = gpu_node(ctx, LEFT).await?;
    run_a_pod(ctx, &left).await?;
    let left_dir = runtime_dir(&left)?;

    // While its cluster lives, a second node is refused, naming the running one and the command that takes it down.
    let refused = match RealNode::up(&ctx.cluster, NEXT) {
        Ok(next) => {
            next.down()?;
            anyhow::bail!("a second node started beside {LEFT}, whose cluster and processes live");
        }
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        refused.contains(&format!("another real node is on this machine: {LEFT}"))
            && refused.contains(&format!("e2e/node.sh down {LEFT}")),
        "the refusal does not name the running node and how to take it down: {refused}"
    );

    // The run's state directory goes (its clone deleted) while the node still runs, its pod too: the next `up`
    // stops it and takes it down.
    lose_bookkeeping(ctx, LEFT)?;
    let next = gpu_node(ctx, NEXT).await?;
    ensure!(!left_dir.exists(), "{} is still there after the next node started", left_dir.display());
    let left_processes = host::processes_naming(&format!("{}/", left_dir.display()))?;
    ensure!(left_processes.is_empty(), "processes of {LEFT} outlived it: {left_processes:?}");

    // Every process of a node dies (SIGKILL: the kubelet, kube-proxy, containerd, the shims) with its state
    // directory, but the pod's container lives on in the kubelet's cgroups: the next `up` takes it down too.
    run_a_pod(ctx, &next).await?;
    let next_dir = runtime_dir(&next)?;
    let bookkeeping_next = lose_bookkeeping(ctx, NEXT)?;
    let containers = host::processes_naming("sleep 3600")?;
    ensure!(containers.len() == 1, "expected the one pod's container, found {containers:?}");
    let killed = host::kill_every_process_naming(&[
        &format!("{}/", next_dir.display()),
        &format!("{}/", bookkeeping_next.display()),
    ])?;
    ensure!(killed.len() >= 4, "expected the kubelet, kube-proxy, containerd and a shim, killed {killed:?}");
    let third = RealNode::up(&ctx.cluster, THIRD)?;
    ensure!(!next_dir.exists(), "{} is still there after the third node started", next_dir.display());
    for pid in containers.keys() {
        ensure!(!Path::new(&format!("/proc/{pid}")).exists(), "the container that outlived {NEXT}'s shim still runs");
    }
    third.down()?;

    // The nodes were this cluster's (the bookkeeping their directories name is this cluster's): their Node objects
    // went with them.
    let nodes = Api::<Node>::all(ctx.client.clone());
    wait::until("the Node objects to be gone", WAIT, || async {
        for name in [LEFT, NEXT, THIRD] {
            if nodes.get_opt(name).await?.is_some() {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await?;
    let diff = before.diff(&host::snapshot()?);
    ensure!(diff.is_empty(), "the nodes left the machine changed:\n{}", diff.join("\n"));
    Ok(())
}

/// A running pod on `node`: a network namespace, a veth on the bridge, cgroups and mounts.
async fn run_a_pod(ctx: &TestContext, node: &RealNode) -> anyhow::Result<()> {
    let name = format!("{}-pod", node.name);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node.name}, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "main", "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", "echo listed; exec sleep 3600"]}]}
    }))?;
    objects::pods(ctx).create(&PostParams::default(), &pod).await?;
    seen_by(ctx, &name).await.map(drop)
}

/// The node's runtime directory on the machine (its kubelet directory's parent).
fn runtime_dir(node: &RealNode) -> anyhow::Result<PathBuf> {
    let dir = node.kubelet_dir()?.parent().map(Path::to_path_buf).unwrap_or_default();
    ensure!(dir.ends_with(&node.name), "the node's kubelet directory is not under its own: {}", dir.display());
    Ok(dir)
}

/// Deletes node `name`'s bookkeeping in the cluster's state directory, as a killed run's deleted clone does.
fn lose_bookkeeping(ctx: &TestContext, name: &str) -> anyhow::Result<PathBuf> {
    let dir = ctx.cluster.state_dir().join("nodes").join(name);
    std::fs::remove_dir_all(&dir)?;
    Ok(dir)
}
