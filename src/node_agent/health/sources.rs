//! What feeds the health monitor: NVML's events in a blocking thread, or, for simulated GPUs, the fault injection
//! file in the state directory.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::classify::Fault;
use super::coverage::{Coverage, Seen};
use super::inject::{self, Action, Injection};
use super::{Monitor, nvml_events};
use crate::cli::{GpuBackend, NodeAgentArgs};
use crate::node_agent::discovery::Discovery;
use crate::node_agent::discovery::simulated::{SIMULATED_DRIVER_HUNG_FILE, SIMULATED_DRIVER_UNUSABLE_FILE};
use crate::node_agent::gpu::Gpu;

/// How often the simulated backend looks for `<state-dir>/inject-faults`.
const INJECT_POLL: Duration = Duration::from_millis(100);
/// Why no simulated GPU is watched while the simulated driver is unusable (NVML's words for it).
const SIMULATED_UNUSABLE: &str = "Driver/library version mismatch (simulated)";

/// Starts the health monitor and what feeds it: NVML's events, or the fault injection file for simulated GPUs.
/// Returns a sender of more reports (discovery's: a GPU that answers "GPU is lost").
pub fn start(
    args: &NodeAgentArgs,
    monitor: Arc<Monitor>,
    client: kube::Client,
    gpus: watch::Receiver<Arc<Vec<Gpu>>>,
    discovery: Arc<dyn Discovery>,
    stop: CancellationToken,
) -> mpsc::UnboundedSender<Injection> {
    let (reports, received) = mpsc::unbounded_channel();
    let more = reports.clone();
    let coverage = monitor.coverage.clone();
    tokio::spawn(monitor.run(client, received, gpus, stop.clone()));
    match args.gpu.gpu_backend {
        GpuBackend::Simulated => {
            tokio::spawn(watch_injections(args.state_dir.clone(), reports, discovery, coverage, stop));
        }
        GpuBackend::Nvml => {
            let root = args.gpu.nvml_root().to_path_buf();
            let stopped = Arc::new(AtomicBool::new(false));
            let flag = stopped.clone();
            tokio::spawn(async move {
                stop.cancelled().await;
                flag.store(true, Ordering::Relaxed);
            });
            let spawned = std::thread::Builder::new().name("nvml-events".into()).spawn({
                let coverage = coverage.clone();
                move || nvml_events::run(&root, &reports, &coverage, &stopped)
            });
            if let Err(error) = spawned {
                warn!(%error, "cannot start the NVML event thread; GPU faults go unnoticed");
                coverage.set(Seen::Blind(format!("the NVML event thread could not be started: {error}")));
            }
        }
    }
    more
}

/// Feeds `<state-dir>/inject-faults` to the monitor until `stop` (simulated GPUs only). A GPU injected lost (`lost`,
/// `xid 79`) is also lost to `discovery` until it is cleared, as NVML would no longer read it. Every GPU is watched,
/// as far as `coverage` goes, but while the simulated driver is unusable (none is) or hung (the watch stops
/// answering), as NVML's would be.
pub async fn watch_injections(
    state_dir: PathBuf,
    reports: mpsc::UnboundedSender<Injection>,
    discovery: Arc<dyn Discovery>,
    coverage: Arc<Coverage>,
    stop: CancellationToken,
) {
    info!(file = %state_dir.join(inject::FILE_NAME).display(), "fault injection for simulated GPUs enabled");
    let markers = (state_dir.join(SIMULATED_DRIVER_UNUSABLE_FILE), state_dir.join(SIMULATED_DRIVER_HUNG_FILE));
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(INJECT_POLL) => {}
        }
        let (dir, (unusable, hung)) = (state_dir.clone(), markers.clone());
        let looked = tokio::task::spawn_blocking(move || (unusable.exists(), hung.exists(), inject::take(&dir)));
        let Ok((unusable, hung, taken)) = looked.await else { continue };
        if !hung {
            match (unusable, coverage.seen()) {
                (true, Seen::Blind(_)) | (false, Seen::Watching { .. }) => coverage.answered(),
                (true, _) => coverage.set(Seen::Blind(SIMULATED_UNUSABLE.into())),
                (false, _) => coverage.set(Seen::Watching { watched: None, unwatched: BTreeMap::new() }),
            }
        }
        let content = match taken {
            Ok(Some(content)) => content,
            Ok(None) => continue,
            Err(error) => {
                warn!(%error, "reading the fault injection file failed");
                continue;
            }
        };
        for line in inject::parse(&content) {
            match line {
                Ok(injection) => {
                    match injection.action {
                        Action::Fault(Fault::GpuLost | Fault::Xid(Some(79))) => {
                            discovery.set_lost(&injection.gpu, true)
                        }
                        Action::Reset => discovery.set_lost(&injection.gpu, false),
                        Action::Fault(_) | Action::Watched(_) => {}
                    }
                    if reports.send(injection).is_err() {
                        return;
                    }
                }
                Err(error) => warn!(%error, "fault injection line ignored"),
            }
        }
    }
}
