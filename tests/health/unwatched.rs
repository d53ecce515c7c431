//! What the kubelet is told of GPUs whose faults would go unnoticed: `Unknown`, with the reason, in the status of
//! the pods using them, rather than `Healthy`.

use std::time::Duration;

use anyhow::Context as _;
use gpu_dra::node_agent::discovery::simulated::{SIMULATED_DRIVER_HUNG_FILE, SIMULATED_DRIVER_UNUSABLE_FILE};
use serde_json::json;

use super::support::harness::KubeletHarness;
use super::support::node::NodeAgent;
use super::support::objects::create_pod_on;
use super::support::podgroup::raw_pods;
use super::support::{TestContext, wait};
use super::{claim_for, device_class, inject, node_name};

/// A running pod's two GPUs: one that NVML reports no health events for is Unknown in the pod's status, and Healthy
/// again once watched; both are Unknown while the driver is unusable (NVML cannot watch anything), and while the
/// watch hangs (an NVML call on a wedged driver) for longer than the kubelet's own timeout. The agent's
/// `gpu_health_watched` gauge says the same of each GPU (0 while Unknown), and `gpu_healthy` stays 1: no fault.
pub(crate) async fn a_gpu_whose_faults_would_go_unnoticed_is_unknown_in_the_pod_status(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    device_class(&ctx).await?;
    let agent = NodeAgent::start(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"])?;
    let kubelet = KubeletHarness::start(&ctx, &node, &agent.dirs)?;
    kubelet.wait_for("registered", "", Duration::from_secs(60)).await.with_context(|| kubelet.log_tail())?;
    claim_for(&ctx, "both", 2).await?;
    create_pod_on(&ctx, "worker", &node, json!([{"name": "gpu", "resourceClaimName": "both"}])).await?;
    let healthy = [("gpu-0", "Healthy", ""), ("gpu-1", "Healthy", "")];
    reported(&ctx, "worker", &healthy, Duration::from_secs(60)).await.with_context(|| kubelet.log_tail())?;
    watched(&agent, [1, 1]).await?;

    let state = agent.dirs.state();
    inject(&state, "gpu-1 unwatched")?;
    let not_watched = "health not watched: NVML reports none of the watched events (XID, ECC) for this GPU (injected)";
    let want = [("gpu-0", "Healthy", ""), ("gpu-1", "Unknown", not_watched)];
    reported(&ctx, "worker", &want, Duration::from_secs(20)).await?;
    watched(&agent, [1, 0]).await?;
    inject(&state, "gpu-1 watched")?;
    reported(&ctx, "worker", &healthy, Duration::from_secs(20)).await?;
    watched(&agent, [1, 1]).await?;

    // The driver unusable, then hung: for the hung one, 30 s without an answer, then the monitor's look (2 s) and
    // the stream's resend (on the change, at once).
    let blind = "GPU health events unavailable: Driver/library version mismatch (simulated)";
    let hung = "the GPU health watch has not answered for over 30 s (NVML hanging?)";
    for (marker, why, within) in [(SIMULATED_DRIVER_UNUSABLE_FILE, blind, 20), (SIMULATED_DRIVER_HUNG_FILE, hung, 45)] {
        std::fs::write(state.join(marker), "")?;
        let want = [("gpu-0", "Unknown", why), ("gpu-1", "Unknown", why)];
        reported(&ctx, "worker", &want, Duration::from_secs(within)).await?;
        watched(&agent, [0, 0]).await?;
        std::fs::remove_file(state.join(marker))?;
        reported(&ctx, "worker", &healthy, Duration::from_secs(20)).await?;
        watched(&agent, [1, 1]).await?;
    }
    Ok(())
}

/// Checks the agent's `gpu_health_watched` of gpu-0 and gpu-1 (read after the kubelet was told, from the same
/// report) and that `gpu_healthy` reads 1 for both: no GPU is faulted here.
async fn watched(agent: &NodeAgent, want: [u8; 2]) -> anyhow::Result<()> {
    let (_, metrics) = agent.process.get("/metrics").await?;
    for (gpu, want) in ["gpu-0", "gpu-1"].into_iter().zip(want) {
        let sample = |name: &str| {
            let prefix = format!("{name}{{device=\"{gpu}\",");
            metrics.lines().find(|l| l.starts_with(&prefix)).and_then(|l| l.rsplit(' ').next()).map(str::to_owned)
        };
        let watched = sample("gpu_dra_node_agent_gpu_health_watched");
        anyhow::ensure!(watched.as_deref() == Some(&want.to_string()), "{gpu}: health watched {watched:?}, not {want}");
        let healthy = sample("gpu_dra_node_agent_gpu_healthy");
        anyhow::ensure!(healthy.as_deref() == Some("1"), "{gpu}: healthy {healthy:?}");
    }
    Ok(())
}

/// Waits until the kubelet reports `want` (device name suffix, health, message) for pod `pod`'s first container.
async fn reported(ctx: &TestContext, pod: &str, want: &[(&str, &str, &str)], within: Duration) -> anyhow::Result<()> {
    let read = || async {
        // Untyped: the typed Pod (1.34's API) has no health message.
        let pod = serde_json::to_value(raw_pods(ctx).get(pod).await?)?;
        let resources = &pod["status"]["containerStatuses"][0]["allocatedResourcesStatus"][0]["resources"];
        let mut health: Vec<(String, String, String)> = resources
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                let text = |key: &str| r[key].as_str().unwrap_or_default().to_string();
                let id = text("resourceID");
                (id[id.len().saturating_sub(5)..].to_string(), text("health"), text("message"))
            })
            .collect();
        health.sort();
        anyhow::Ok(health)
    };
    let waited = wait::until("the device health in the pod status", within, || async {
        let health = read().await?;
        let got: Vec<(&str, &str, &str)> =
            health.iter().map(|(d, h, m)| (d.as_str(), h.as_str(), m.as_str())).collect();
        Ok((got == want).then_some(()))
    })
    .await;
    match waited {
        Ok(()) => Ok(()),
        Err(error) => Err(error.context(format!("wanted {want:?}, last reported {:?}", read().await?))),
    }
}
