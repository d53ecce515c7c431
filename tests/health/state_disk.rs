//! The health state's disk failing under the agent: a fault is still published, and saved once the disk is back.
//! The saves are made to fail or hang at their temporary file (`<state>/.health.json.tmp-<agent PID>`), which
//! every save of the agent writes first: a directory there fails them (as a full or read-only disk does), a FIFO
//! there hangs them (as a disk that stopped answering does) until something reads it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use serde_json::Value;

use super::support::node::{DRIVER, NodeAgent, start_agent};
use super::support::{TestContext, wait};
use super::{inject, node_name, taints, wait_taints};

/// The agent's arguments: two simulated L4s.
const ARGS: [&str; 4] = ["--gpu-backend", "simulated", "--simulated-gpus", "2xL4-24GB"];

/// A node of two simulated GPUs with its agent ready; returns the node's name and the agent.
async fn node_with_two_gpus(ctx: &TestContext) -> anyhow::Result<(String, NodeAgent)> {
    let node = node_name(ctx);
    ctx.cluster.add_node(&node)?;
    let agent = NodeAgent::start(ctx, &node, &ARGS)?;
    agent.wait_ready().await?;
    Ok((node, agent))
}

/// Stops the agent and starts another on its directories, waiting until it is ready.
async fn restart(ctx: &TestContext, node: &str, agent: &mut NodeAgent) -> anyhow::Result<()> {
    agent.process.terminate()?;
    agent.process = start_agent(ctx, node, &agent.dirs, &ARGS)?;
    agent.wait_ready().await
}

/// Where the agent with `pid` writes the health state before renaming it into place.
fn temporary_file(state: &Path, pid: u32) -> PathBuf {
    state.join(format!(".health.json.tmp-{pid}"))
}

/// Whether the saved health state records a fault of the GPU with `uuid`.
fn saved_fault(state: &Path, uuid: &str) -> anyhow::Result<bool> {
    let saved = match std::fs::read(state.join("health.json")) {
        Ok(saved) => saved,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let saved: Value = serde_json::from_slice(&saved)?;
    Ok(saved["faulted"].get(uuid).is_some())
}

/// The UUID the simulated backend gives `device` (from the node's published slices).
async fn uuid_of(ctx: &TestContext, node: &str, device: &str) -> anyhow::Result<String> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use kube::api::{Api, ListParams};
    let selector = format!("spec.nodeName={node},spec.driver={DRIVER}");
    let slices = Api::<ResourceSlice>::all(ctx.client.clone()).list(&ListParams::default().fields(&selector)).await?;
    let found = slices.items.iter().flat_map(|s| s.spec.devices.iter().flatten()).find(|d| d.name == device);
    let uuid = found.and_then(|d| d.attributes.as_ref()?.get("uuid")?.string.clone());
    uuid.with_context(|| format!("{device} has no uuid attribute in the node's slices"))
}

/// `/var/lib` full when a GPU falls off the bus: the fault is published all the same, and its save, which failed,
/// is tried again until the disk takes it (before, it was tried only at the next taint change, and an agent
/// restarted meanwhile read the older state and untainted the GPU at its first publish). The restarted agent keeps
/// the fault.
pub(crate) async fn a_health_save_that_failed_is_tried_again_until_it_is_on_disk(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let (node, mut agent) = node_with_two_gpus(&ctx).await?;
    let state = agent.dirs.state();
    let uuid = uuid_of(&ctx, &node, "gpu-0").await?;
    let blocker = temporary_file(&state, agent.process.pid());
    std::fs::create_dir_all(&blocker)?;

    inject(&state, "gpu-0 xid 79")?;
    let key = format!("{DRIVER}/gpu-lost");
    let (before, _) = wait_taints(&ctx, &node, "gpu-0", &[&key], Duration::from_secs(5)).await?;
    wait::until("the unsaved state to show in the metric", Duration::from_secs(5), || async {
        Ok((agent.metric("gpu_dra_node_agent_health_state_unsaved", &[]).await? == 1.0).then_some(()))
    })
    .await?;
    ensure!(!saved_fault(&state, &uuid)?, "the fault was saved through a failing save");

    // The disk takes writes again.
    std::fs::remove_dir(&blocker)?;
    wait::until("the fault to be saved", Duration::from_secs(10), || async {
        Ok(saved_fault(&state, &uuid)?.then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(agent.metric("gpu_dra_node_agent_health_state_unsaved", &[]).await? == 0.0, "still counted unsaved");

    restart(&ctx, &node, &mut agent).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let devices = taints(&ctx, &node).await?;
    ensure!(devices == [("gpu-0".to_string(), before), ("gpu-1".to_string(), Vec::new())], "{devices:?}");
    Ok(())
}

/// The state disk stops answering (a hung NFS or iSCSI volume, a dying disk) when a GPU falls off the bus: the
/// taint is published within seconds all the same, the agent keeps answering, and the fault is saved once the disk
/// answers again. Before, the save ran on a runtime thread with the health book locked: the taint was never
/// published while the disk hung.
pub(crate) async fn a_hung_state_disk_does_not_hold_up_a_fault_taint(ctx: TestContext) -> anyhow::Result<()> {
    let (node, agent) = node_with_two_gpus(&ctx).await?;
    let state = agent.dirs.state();
    let (uuid_0, uuid_1) = (uuid_of(&ctx, &node, "gpu-0").await?, uuid_of(&ctx, &node, "gpu-1").await?);
    let fifo = temporary_file(&state, agent.process.pid());
    let made = std::process::Command::new("mkfifo").arg(&fifo).status()?;
    ensure!(made.success(), "mkfifo {}", fifo.display());

    // A double-bit ECC error: nothing but the fault's own publish shows it (a GPU lost is also seen by discovery).
    inject(&state, "gpu-1 ecc-dbe")?;
    let (_, took) = wait_taints(&ctx, &node, "gpu-1", &[&format!("{DRIVER}/needs-reset")], Duration::from_secs(10))
        .await
        .with_context(|| agent.log_tail())?;
    eprintln!("gpu-1 tainted {took:?} after the fault, its save hung (published after at most 2 s)");
    // A second fault while the first save still hangs is published at once.
    inject(&state, "gpu-0 ecc-dbe")?;
    wait_taints(&ctx, &node, "gpu-0", &[&format!("{DRIVER}/needs-reset")], Duration::from_secs(5)).await?;
    let (code, body) = agent.get("/healthz").await?;
    ensure!(code == 200, "/healthz while the disk hangs: {code} {body}");
    ensure!(!saved_fault(&state, &uuid_1)?, "saved through a hung write");

    // The disk answers again: the hung write ends (and fails, a FIFO is no file), the next one saves both faults.
    let drained = std::thread::spawn(move || -> std::io::Result<usize> {
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut std::fs::File::open(&fifo)?, &mut data)?;
        Ok(data.len())
    });
    wait::until("both faults to be saved", Duration::from_secs(15), || async {
        Ok((saved_fault(&state, &uuid_0)? && saved_fault(&state, &uuid_1)?).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    drained.join().map_err(|_| anyhow::anyhow!("the reader of the hung write panicked"))??;
    Ok(())
}

/// The state directory deleted on the host (`rm -rf /var/lib/gpu-dra`, a node clean-up script), whereupon the
/// liveness check restarts the agent: the restarted agent finds no health state, and reads the faults back from
/// the taints it published before (before, a missing state meant every GPU healthy, and the first publish untainted
/// a GPU that needed a reset). The read-back is saved.
pub(crate) async fn a_deleted_health_state_is_read_back_from_the_published_taints(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let (node, mut agent) = node_with_two_gpus(&ctx).await?;
    let state = agent.dirs.state();
    let uuid = uuid_of(&ctx, &node, "gpu-1").await?;
    inject(&state, "gpu-1 ecc-dbe")?;
    let key = format!("{DRIVER}/needs-reset");
    let (before, _) = wait_taints(&ctx, &node, "gpu-1", &[&key], Duration::from_secs(5)).await?;

    agent.process.terminate()?;
    std::fs::remove_dir_all(&state)?;
    std::fs::create_dir_all(&state)?;
    agent.process = start_agent(&ctx, &node, &agent.dirs, &ARGS)?;
    agent.wait_ready().await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let devices = taints(&ctx, &node).await?;
    ensure!(devices == [("gpu-0".to_string(), Vec::new()), ("gpu-1".to_string(), before)], "{devices:?}");
    ensure!(saved_fault(&state, &uuid)?, "the fault read back was not saved");
    Ok(())
}
