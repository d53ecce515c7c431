//! Starting the kubelet plugin once the node's GPUs are known: recovery of the checkpoint (with a Warning Event on
//! the Node when it was corrupt), then the two sockets, then `/healthz` checks that they answer.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::Resource;
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cdi::DriverFiles;
use crate::kubelet_plugin::allocation::Inventory;
use crate::kubelet_plugin::health::{HealthReport, HealthService};
use crate::kubelet_plugin::metrics::PluginMetrics;
use crate::kubelet_plugin::state::{DriverState, Recovery, StateConfig};
use crate::kubelet_plugin::{self, SocketPaths};
use crate::node_agent::gpu_settings::GpuSettings;
use crate::telemetry::server::{Liveness, Readiness};

/// Everything the plugin needs that does not change while the agent runs.
#[derive(Debug)]
pub(super) struct PluginSettings {
    pub(super) driver: String,
    pub(super) node: String,
    pub(super) sockets: SocketPaths,
    /// How long the kubelet may take to register the plugin before the agent warns (`--kubelet-registration-timeout`).
    pub(super) registration_timeout: std::time::Duration,
    pub(super) cdi_dir: PathBuf,
    pub(super) state_dir: PathBuf,
    /// Where claims' MPS daemons keep their directories.
    pub(super) mps_dir: PathBuf,
    /// What an MPS daemon is (the driver's `nvidia-cuda-mps-control`, or the simulated backend's stand-in).
    pub(super) mps_program: crate::node_agent::mps_control::MpsProgram,
    /// `None`: specs carry no driver files (simulated GPUs without `--driver-root`).
    pub(super) driver_root: Option<PathBuf>,
    /// Simulated GPUs: specs describe their device nodes in full (see `DriverFiles::simulated`).
    pub(super) simulated_gpus: bool,
    /// Simulated GPUs: where their optional device nodes are looked for (`--simulated-dev-root`).
    pub(super) simulated_dev_root: Option<PathBuf>,
    /// Where the host sees `driver_root` when it differs (see `--host-driver-root`).
    pub(super) host_driver_root: Option<PathBuf>,
    pub(super) boot_id: String,
    /// Sets the time slices claims ask of their GPUs.
    pub(super) gpu_settings: Arc<dyn GpuSettings>,
    /// Makes and destroys the MIG devices of dynamic MIG: the agent's discovery backend.
    pub(super) mig_control: Arc<dyn crate::node_agent::discovery::Discovery>,
    /// Whether containers get device metadata files (`--device-metadata`).
    pub(super) device_metadata: bool,
    /// What to do with prepared claims the kubelet forgot, and how often to look (`--stale-claims`).
    pub(super) stale_claims: super::stale_claims::StaleClaimSettings,
}

/// Recovers the plugin's state and starts serving; the returned task ends (sockets removed) after `stop`. The state
/// is returned too, for the health monitor to name the claims a faulted GPU affects. From then on `readiness` also
/// needs the kubelet's registration (see [`kubelet_plugin::Registration::readiness`]). Without the driver's files
/// under the driver root it fails, unless `without_driver` (serving while the GPUs cannot be discovered, so that
/// prepared claims can be unprepared): prepares then fail, naming what is missing, until the files are there.
#[allow(clippy::too_many_arguments)]
pub(super) async fn start(
    settings: &PluginSettings,
    without_driver: bool,
    client: kube::Client,
    inventory: watch::Receiver<Arc<Inventory>>,
    metrics: PluginMetrics,
    health: watch::Receiver<HealthReport>,
    (liveness, readiness): (&Liveness, &Readiness),
    stop: CancellationToken,
) -> Result<(JoinHandle<()>, Arc<DriverState>), String> {
    let (root, host_root) = (settings.driver_root.as_deref(), settings.host_driver_root.as_deref());
    let driver_files = match (driver_files(root, host_root, settings.simulated_gpus), root) {
        (Ok(files), _) => files,
        (Err(error), Some(root)) if without_driver => {
            warn!(%error, "the driver's files are not there: prepares fail until they are");
            as_seen(DriverFiles::awaiting(root), host_root, settings.simulated_gpus)
        }
        (Err(error), _) => return Err(error.to_string()),
    };
    let driver_files = match &settings.simulated_dev_root {
        Some(dev_root) if settings.simulated_gpus => driver_files.with_dev_root(dev_root),
        _ => driver_files,
    };
    let config = StateConfig {
        driver: settings.driver.clone(),
        pool: settings.node.clone(),
        cdi_dir: settings.cdi_dir.clone(),
        state_dir: settings.state_dir.clone(),
        mps_dir: settings.mps_dir.clone(),
        mps_program: settings.mps_program.clone(),
        driver_files,
        boot_id: settings.boot_id.clone(),
        gpu_settings: settings.gpu_settings.clone(),
        mig_control: settings.mig_control.clone(),
        device_metadata: settings.device_metadata,
    };
    let registration = kubelet_plugin::Registration::new(metrics.registered.clone());
    let (state, recovery) =
        DriverState::start(config, client.clone(), inventory, metrics).await.map_err(|e| e.to_string())?;
    report(&recovery, &settings.node, client.clone()).await;
    let health = HealthService::new(settings.node.clone(), health);
    let (sockets, driver) = (settings.sockets.clone(), settings.driver.clone());
    let task = kubelet_plugin::serve(sockets, driver, state.clone(), (health, &registration), stop.clone())
        .map_err(|e| e.to_string())?;
    let (socket_appeared, timeout) = (std::time::Instant::now(), settings.registration_timeout);
    let said = registration.clone();
    readiness.require(move || said.readiness(socket_appeared.elapsed(), timeout));
    // Only once it serves: a start that fails is tried again with a new state, and a task of this one would act on
    // its stale copy of the checkpoint beside it.
    tokio::spawn(super::stale_claims::run(
        state.clone(),
        client.clone(),
        settings.node.clone(),
        settings.stale_claims,
        stop.clone(),
    ));
    tokio::spawn(warn_unregistered(settings, registration, client.clone(), stop.clone()));
    tokio::spawn(restore_lost_specs(state.clone(), stop));
    let sockets = settings.sockets.clone();
    let host_dirs = HostDirs::new(&settings.sockets, [&settings.cdi_dir, &settings.state_dir, &settings.mps_dir]);
    liveness.set(move || {
        let sockets = sockets.clone();
        let host_dirs = host_dirs.clone();
        Box::pin(async move {
            if let Some(dir) = host_dirs.deleted_one().await {
                return Err(format!(
                    "{} was deleted on the host while mounted here: the kubelet and the runtime no longer see what \
                     the agent writes there; restarting the container mounts the new one",
                    dir.display()
                ));
            }
            kubelet_plugin::check_sockets(&sockets).await
        })
    });
    Ok((task, state))
}

/// The host directories the agent writes: the sockets' (the kubelet's plugin watcher), the CDI directory (the
/// container runtime), the state directory (the checkpoint, the health state: what a restarted agent reads) and the
/// MPS directory (containers mount the daemons' pipes from there). Looked at by the liveness check.
#[derive(Clone)]
struct HostDirs {
    dirs: Arc<Vec<PathBuf>>,
    /// At most one look at a time: a look stuck on a hung filesystem holds a blocking thread, and probes must not
    /// pile up more of them.
    looking: Arc<AtomicBool>,
}

impl HostDirs {
    fn new(sockets: &SocketPaths, others: [&PathBuf; 3]) -> Self {
        let parents = [sockets.registration.parent(), sockets.dra.parent()].into_iter().flatten();
        let dirs = parents.chain(others.map(PathBuf::as_path)).map(Path::to_path_buf).collect();
        Self { dirs: Arc::new(dirs), looking: Arc::default() }
    }

    /// The first of them [`deleted`] under its mount. Off the async threads, and never waited for long (2 s): a hung
    /// filesystem is not what this looks for, so a look still running or too slow finds nothing.
    async fn deleted_one(&self) -> Option<PathBuf> {
        if self.looking.swap(true, Ordering::AcqRel) {
            return None;
        }
        let this = self.clone();
        let look = tokio::task::spawn_blocking(move || {
            let found = this.dirs.iter().find(|dir| deleted(dir)).cloned();
            this.looking.store(false, Ordering::Release);
            found
        });
        tokio::time::timeout(std::time::Duration::from_secs(2), look).await.ok().and_then(Result::ok).flatten()
    }
}

/// Whether `dir` is a directory deleted while still open or mounted here (no links left): a hostPath directory
/// removed on the host (`rm -rf /var/run/cdi`, a stale plugin directory cleaned up) stays mounted in the container
/// as the deleted one, where nothing can be created and nobody else looks. A path that is gone is not this case:
/// outside a container the next write creates it again.
fn deleted(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(dir).is_ok_and(|m| m.is_dir() && m.nlink() == 0)
}

/// How often the agent looks for prepared claims' CDI specs deleted under it: within the kubelet's first container
/// restart back-off (10 s), so a container that crashes after its spec was lost starts again at the next try.
const LOST_SPEC_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Writes again, every [`LOST_SPEC_CHECK_INTERVAL`], the specs of prepared claims that went missing or name the
/// driver's files from before an upgrade in place: the kubelet prepares a claim once per pod and the runtime reads
/// its spec at every container start.
async fn restore_lost_specs(state: Arc<DriverState>, stop: CancellationToken) {
    let mut said = std::collections::BTreeSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(LOST_SPEC_CHECK_INTERVAL) => {}
        }
        let this = state.clone();
        let Ok(done) = tokio::task::spawn_blocking(move || this.restore_lost_specs()).await else { continue };
        if done.written > 0 {
            warn!(
                rewritten = done.written,
                "CDI specs of prepared claims were missing (deleted on the host?) or named the driver's old files; \
                 wrote them again"
            );
        }
        // Each claim whose spec cannot be written said once, not every pass, until it can be or is gone.
        for (uid, error) in done.failed.iter().filter(|(uid, _)| !said.contains(uid)) {
            warn!(%uid, %error, "a prepared claim's CDI spec cannot be written again; retrying every pass");
        }
        said = done.failed.into_iter().map(|(uid, _)| uid).collect();
    }
}

/// The driver files prepared claims get: those under `driver_root` (host paths as the runtime sees them when
/// `host_driver_root` is given), kept current across driver upgrades, or, without a driver root, none.
pub(super) fn driver_files(
    driver_root: Option<&Path>,
    host_driver_root: Option<&Path>,
    simulated_gpus: bool,
) -> Result<DriverFiles, crate::cdi::CdiError> {
    let Some(root) = driver_root else { return Ok(DriverFiles::simulated()) };
    Ok(as_seen(DriverFiles::discover(root)?, host_driver_root, simulated_gpus))
}

/// `files` with host paths as the runtime sees them when `host_driver_root` is given, and simulated device nodes
/// for simulated GPUs.
fn as_seen(files: DriverFiles, host_driver_root: Option<&Path>, simulated_gpus: bool) -> DriverFiles {
    let files = match host_driver_root {
        Some(host_root) => files.seen_from_host(host_root),
        None => files,
    };
    if simulated_gpus { files.with_simulated_devices() } else { files }
}

async fn report(recovery: &Recovery, node: &str, client: kube::Client) {
    if recovery != &Recovery::default() {
        info!(?recovery, "checkpoint recovered");
    }
    if recovery.missing > 0 {
        let note = format!(
            "The checkpoint of prepared claims was missing while {} CDI specs of this driver's claims were on disk (a \
             wiped or changed state directory): they were adopted as prepared and are kept until the kubelet \
             unprepares them.",
            recovery.missing
        );
        warn!(adopted = recovery.missing, "checkpoint was missing beside CDI specs of prepared claims");
        node_warning(client.clone(), node, "CheckpointMissing", "RecoverCheckpoint", note).await;
    }
    let Some((moved_to, reason)) = &recovery.corrupt else { return };
    let note = format!(
        "The checkpoint of prepared claims was unreadable ({reason}); it was kept as {} and the record rebuilt from \
         the CDI specs on disk: {} prepared claims adopted (kept until the kubelet unprepares them).",
        moved_to.display(),
        recovery.rebuilt
    );
    warn!(moved_to = %moved_to.display(), %reason, rebuilt = recovery.rebuilt, "checkpoint was corrupt");
    node_warning(client, node, "CheckpointCorrupt", "RecoverCheckpoint", note).await;
}

/// Says so, once, when the kubelet has not registered the plugin `registration_timeout` after its socket appeared.
/// The kubelet's plugin watcher finds a new socket within a second; one it never finds is under a directory the
/// kubelet does not watch (its root directory elsewhere: k0s, MicroK8s), and every pod allocated this node's GPUs
/// then fails with "DRA driver … is not registered" while the agent itself looks healthy.
fn warn_unregistered(
    settings: &PluginSettings,
    registration: kubelet_plugin::Registration,
    client: kube::Client,
    stop: CancellationToken,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let (node, timeout) = (settings.node.clone(), settings.registration_timeout);
    let socket = settings.sockets.registration.clone();
    async move {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(timeout) => {}
        }
        if registration.registered() {
            return;
        }
        let dir = socket.parent().unwrap_or(&socket).display().to_string();
        let note = format!(
            "The kubelet has not registered the plugin {} after its socket {} appeared: the kubelet watches \
             <its root directory>/plugins_registry, so if its root directory is not the one {dir} is under, set the \
             chart's nodeAgent.kubeletDir to it (--kubelet-registry-dir and --kubelet-plugins-dir). Until then pods \
             allocated this node's GPUs fail to start. (A kubelet that found it and refused it: the agent's log \
             says why.)",
            humantime::format_duration(timeout),
            socket.display()
        );
        tracing::error!(socket = %socket.display(), "the kubelet has not registered the plugin");
        node_warning(client, &node, "NotRegistered", "RegisterPlugin", note).await;
    }
}

/// Publishes a Warning Event on the Node (by name alone when it cannot be read); a failure is logged.
pub(super) async fn node_warning(client: kube::Client, node: &str, reason: &str, action: &str, note: String) {
    let reference = match Api::<Node>::all(client.clone()).get(node).await {
        Ok(node) => node.object_ref(&()),
        Err(e) => {
            warn!(error = %e, "cannot read the Node to attach the event; using its name only");
            ObjectReference { kind: Some("Node".into()), name: Some(node.to_string()), ..Default::default() }
        }
    };
    let event = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(crate::event_note::fit(note)),
        action: action.into(),
        secondary: None,
    };
    let recorder = Recorder::new(client, Reporter { controller: "gpu-dra-node-agent".into(), instance: None });
    if let Err(e) = recorder.publish(&event, &reference).await {
        warn!(error = %e, reason, "publishing a Node event failed");
    }
}
