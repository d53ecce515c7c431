//! An agent restarted on a node whose NVML hangs (a wedged GPU or driver: the first call never returns) while a
//! claim it prepared before is still in use. Before, the kubelet plugin started only after the GPU discovery, so it
//! never registered: the kubelet could not unprepare the claim, its pod stayed Terminating and the node's drain with
//! it. Now the plugin serves without GPUs once the discovery has not answered in `--discovery-timeout`, and prepares
//! them once it does, without a restart.

use anyhow::{Context as _, ensure};
use gpu_dra::node_agent::discovery::simulated::SIMULATED_DRIVER_HUNG_FILE;
use serde_json::json;

use super::support::node::{Kubelet, NodeDirs, start_agent};
use super::support::process::Component;
use super::support::{TestContext, wait};
use super::{allocated_claim, node_name, prepares_fully, ready_agent};

pub(super) async fn a_discovery_that_hangs_at_start_still_lets_prepared_claims_be_unprepared(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let held = allocated_claim(&ctx, "held", &node, &["gpu-0"], json!([])).await?;
    prepares_fully(&dirs, ns, "held", &held, "gpu-0").await?;

    agent.kill()?;
    let hung = dirs.state().join(SIMULATED_DRIVER_HUNG_FILE);
    std::fs::write(&hung, b"")?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--discovery-timeout", "2s"];
    let agent = start_agent(&ctx, &node, &dirs, &args)?;
    // The killed agent's sockets are there until the new one replaces them: dial until the new one answers.
    let mut kubelet =
        wait::until("the restarted agent's plugin to serve", std::time::Duration::from_secs(30), || async {
            Ok(Kubelet::register(&dirs).await.ok())
        })
        .await
        .with_context(|| agent.log_tail())?;
    let unprepared = kubelet.unprepare(&[(ns, "held", &held)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    ensure!(!dirs.cdi_spec(&held).exists(), "the claim's spec is still there");
    says_discovery_hangs(&agent, std::time::Duration::from_secs(10)).await?;

    // NVML answers again: the GPUs are prepared, no restart needed.
    std::fs::remove_file(&hung)?;
    agent.wait_ready().await.with_context(|| agent.log_tail())?;
    let next = allocated_claim(&ctx, "next", &node, &["gpu-0"], json!([])).await?;
    prepares_fully(&dirs, ns, "next", &next, "gpu-0").await
}

/// An agent on a node whose NVML hangs, stopped (a rollout, `kubectl delete pod`, `helm uninstall`): it exits on
/// SIGTERM with its sockets removed. The discovery still hung in its blocking thread used to hold the exit (the
/// async runtime waited for it when dropped) until the kubelet's SIGKILL, 30 s later, its pod Terminating
/// meanwhile.
pub(super) async fn an_agent_whose_discovery_hangs_stops_on_sigterm(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    std::fs::create_dir_all(dirs.state())?;
    std::fs::write(dirs.state().join(SIMULATED_DRIVER_HUNG_FILE), b"")?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--discovery-timeout", "2s"];
    let mut agent = start_agent(&ctx, &node, &dirs, &args)?;
    // From a fresh start: the agent's start-up and then the 2 s discovery timeout.
    says_discovery_hangs(&agent, std::time::Duration::from_secs(30)).await?;

    let started = std::time::Instant::now();
    std::process::Command::new("kill").args(["-TERM", &agent.pid().to_string()]).status()?;
    let exited = wait::until("the agent to exit after SIGTERM", std::time::Duration::from_secs(10), || {
        let exited = agent.try_wait();
        async move { exited }
    })
    .await
    .with_context(|| format!("the hung discovery held up the exit:\n{}", agent.log_tail()))?;
    ensure!(exited.success(), "the agent exited with {exited} after SIGTERM");
    let (dra, registration) = (dirs.dra_socket(), dirs.registration_socket());
    ensure!(!dra.exists() && !registration.exists(), "sockets left after the exit: {dra:?} {registration:?}");
    eprintln!("the agent exited {:?} after SIGTERM with its discovery hung", started.elapsed());
    Ok(())
}

/// Waits up to `patience` for `agent`'s /readyz to say its discovery has not answered in its 2 s timeout.
async fn says_discovery_hangs(agent: &Component, patience: std::time::Duration) -> anyhow::Result<()> {
    let said = wait::until("/readyz to name the hung discovery", patience, || async {
        // Not serving yet (an agent just started) is asked again.
        let Ok((code, why)) = agent.get("/readyz").await else { return Ok(None) };
        Ok((code == 503 && why.contains("has not answered in 2s")).then_some(()))
    })
    .await;
    if said.is_err() {
        let (code, why) = agent.get("/readyz").await?;
        anyhow::bail!("/readyz: {code} {why}");
    }
    Ok(())
}
