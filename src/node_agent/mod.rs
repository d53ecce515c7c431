//! The GPU node agent: discovers this node's GPUs, publishes them as ResourceSlices and serves the kubelet's DRA
//! plugin API (see [`crate::kubelet_plugin`]) that prepares them as CDI devices.
//!
//! ```text
//!  discovery (NVML | simulated) ─▶ slices::device ─▶ split_into_slices ─▶ Publisher ─▶ ResourceSlices
//!        │ ▲ retry with back-off                                 ▲
//!        │ └── resync every minute ── watch of own slices ───────┘ (deleted, e.g. by a kubelet restart)
//!        └─▶ inventory ─▶ kubelet plugin (started after the first successful discovery, or the first failed one)
//! ```
//!
//! Without a usable driver the agent stays up, not ready, says why on /readyz and in its log, publishes nothing,
//! and looks for the driver again every 10 s at most ([`retry`]): never a crash loop. Its kubelet plugin serves
//! meanwhile with no GPUs, so that claims prepared before can be unprepared (prepares fail with the reason).

pub mod bounded_run;
pub mod device;
pub mod device_plugin;
pub mod discovery;
pub mod driver_tool;
pub mod gpu;
pub mod gpu_check;
pub mod gpu_settings;
pub mod health;
pub mod instance_lock;
pub mod mig;
pub mod mps_control;
pub mod mps_stand_in;
mod mps_sys;
pub mod other_drivers;
mod plugin;
pub mod retry;
pub mod slices;
pub mod stale_claims;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::Api;
use kube::runtime::watcher;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::cli::{GpuBackend, NodeAgentArgs};
use crate::kubelet_plugin::allocation::Inventory;
use crate::kubelet_plugin::metrics::PluginMetrics;
use crate::kubelet_plugin::{SocketError, SocketPaths};
use crate::telemetry::process::ProcessCollector;
use crate::telemetry::server::{self, Liveness, Readiness, ServerError};
use gpu::Gpu;
use plugin::PluginSettings;
use retry::{BACKOFF_START, FailureKind, RoundFailure};
use slices::publisher::{Outcome, Publisher};

/// Changes to the node's slices that arrive together are handled once.
const DEBOUNCE: Duration = Duration::from_millis(200);
/// After a failed round, how long changes the watch reports are taken for the round's own (at most the back-off).
const FAILURE_HOLD: Duration = Duration::from_secs(2);

/// Errors that stop the agent at start-up (bad configuration); everything later is retried.
#[derive(Debug, thiserror::Error)]
pub enum NodeAgentError {
    #[error("--driver-name {name:?} is not a DNS subdomain of at most 63 characters (e.g. gpu.example.com)")]
    DriverName { name: String },
    #[error("--node-name (NODE_NAME) is required: the name of the Node this agent runs on")]
    NodeName,
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
    #[error("create the Kubernetes client (set KUBECONFIG, or run in a pod with a service account): {0}")]
    Client(#[source] kube::Error),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error(transparent)]
    Sockets(#[from] SocketError),
    #[error("install the signal handler: {0}")]
    Signal(#[source] std::io::Error),
    #[error(transparent)]
    Lock(#[from] instance_lock::LockError),
    #[error(
        "--mps-dir {dir} {why}: start-up removes the claim directories it finds there that no prepared claim has; \
         give the MPS daemons a directory of their own (the default is /run/gpu-dra/mps)"
    )]
    MpsDir { dir: String, why: String },
    #[error("find this program, to run it as the simulated MPS control daemon: {0}")]
    MpsProgram(#[source] std::io::Error),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// Runs the agent until SIGTERM/SIGINT.
pub async fn run(args: NodeAgentArgs) -> Result<(), NodeAgentError> {
    let node = args.node_name.clone().filter(|n| !n.is_empty()).ok_or(NodeAgentError::NodeName)?;
    let gpu = &args.gpu;
    if !is_dns_subdomain(&gpu.driver_name) {
        return Err(NodeAgentError::DriverName { name: gpu.driver_name.clone() });
    }
    let others: [(&str, &std::path::Path); 2] =
        [("--kubelet-plugins-dir", &args.kubelet_plugins_dir), ("--kubelet-registry-dir", &args.kubelet_registry_dir)];
    mps_control::check_root(&args.mps_dir, &others)
        .map_err(|why| NodeAgentError::MpsDir { dir: args.mps_dir.display().to_string(), why })?;
    let stop = CancellationToken::new();
    crate::signals::spawn_signal_handler(stop.clone()).map_err(NodeAgentError::Signal)?;
    // Before any state is read or socket bound: another agent on this node must be gone first.
    let Some(_lock) = instance_lock::acquire(&args.state_dir, &stop).await? else {
        info!("stopped while waiting for the other node agent");
        return Ok(());
    };
    let boot_id = crate::kubelet_plugin::checkpoint::boot_id_from(&args.boot_id_file);
    if boot_id.is_empty() {
        warn!(
            file = %args.boot_id_file.display(),
            "the boot ID is unreadable: claims prepared before a reboot cannot be told from this boot's and are \
             kept; check --boot-id-file (default /proc/sys/kernel/random/boot_id)"
        );
    }
    let discovery = discovery::backend(gpu, &node, Some((&args.state_dir, &boot_id)))?;
    let settings = PluginSettings {
        driver: gpu.driver_name.clone(),
        node: node.clone(),
        sockets: SocketPaths::new(&args.kubelet_registry_dir, &args.kubelet_plugins_dir, &gpu.driver_name)?,
        registration_timeout: args.kubelet_registration_timeout,
        cdi_dir: args.cdi_dir.clone(),
        state_dir: args.state_dir.clone(),
        mps_dir: args.mps_dir.clone(),
        mps_program: mps_control::MpsProgram::of(gpu).map_err(NodeAgentError::MpsProgram)?,
        driver_root: gpu.driver_root_to_read().map(std::path::Path::to_path_buf),
        simulated_gpus: gpu.gpu_backend == GpuBackend::Simulated,
        simulated_dev_root: gpu.simulated_dev_root.clone(),
        host_driver_root: args.host_driver_root.clone(),
        gpu_settings: gpu_settings::backend(gpu, &args.state_dir, &boot_id),
        mig_control: discovery.clone(),
        device_metadata: args.device_metadata,
        stale_claims: stale_claims::StaleClaimSettings {
            action: args.stale_claims,
            interval: args.stale_claim_check_interval,
        },
        boot_id: boot_id.clone(),
    };
    let config = crate::kube_client::infer_config().await.map_err(NodeAgentError::Client)?;
    let client =
        crate::kube_client::client_from_config(config.clone(), &args.client).map_err(NodeAgentError::Client)?;
    // The kubelet's prepare calls read their claims through a client of their own, outside --kube-api-qps: a node
    // starting many pods at once must not wait behind the agent's own budget (the kubelet paces those calls).
    let unlimited = args.client.unlimited(0);
    let plugin_client = crate::kube_client::client_from_config(config, &unlimited).map_err(NodeAgentError::Client)?;

    let mut registry = Registry::default();
    registry.register_collector(Box::new(ProcessCollector));
    crate::telemetry::build::register(&mut registry);
    let devices_gauge = Gauge::<i64>::default();
    let publishes = Family::<ResultLabels, Counter>::default();
    registry.register(
        "gpu_dra_node_agent_devices",
        "Devices published for this node (whole GPUs, MIG devices and partitions)",
        devices_gauge.clone(),
    );
    let unreadable_gauge = Gauge::<i64>::default();
    registry.register(
        "gpu_dra_node_agent_unreadable_gpus",
        "GPUs NVML reports lost (fallen off the bus): published with their last reading and tainted when read before, \
         else left out",
        unreadable_gauge.clone(),
    );
    registry.register("gpu_dra_node_agent_publishes", "Discover-and-publish rounds, by result", publishes.clone());
    let plugin_metrics = PluginMetrics::register(&mut registry);
    let (policy, effects) = args.health.policy();
    let monitor = Arc::new(health::Monitor::new(
        &gpu.driver_name,
        &node,
        (args.state_dir.clone(), &boot_id),
        policy,
        effects,
        &mut registry,
    ));
    let mut device_plugins = device_plugin::DevicePluginGuard::new(
        args.refuse_with_device_plugin,
        args.device_plugin_resources.clone(),
        args.device_plugin_grace_period,
        &args.state_dir,
        &boot_id,
        client.clone(),
        &mut registry,
    );
    let mut other_drivers =
        other_drivers::OtherDriverGuard::new(client.clone(), &node, &gpu.driver_name, &mut registry);
    let registry = Arc::new(registry);
    let readiness = Readiness::not_ready("GPUs not discovered and published yet");
    let liveness = Liveness::default();
    for addr in serving_addresses(args.metrics_addr, args.health_addr) {
        let (bound, serve) =
            server::bind(addr, registry.clone(), readiness.clone(), liveness.clone(), stop.clone()).await?;
        info!(addr = %bound, "serving /metrics, /healthz and /readyz");
        tokio::spawn(serve);
    }

    let publisher = Publisher::new(client.clone(), gpu.driver_name.clone(), node.clone());
    let changed = Arc::new(Notify::new());
    tokio::spawn(watch_own_slices(client.clone(), publisher.field_selector(), changed.clone()));
    info!(%node, driver = %gpu.driver_name, backend = ?gpu.gpu_backend, "node agent started");

    let (inventory, inventory_rx) = watch::channel(Arc::new(Inventory::new()));
    let (discovered, discovered_rx) = watch::channel(Arc::new(Vec::new()));
    let health_reports =
        health::sources::start(&args, monitor.clone(), client.clone(), discovered_rx, discovery.clone(), stop.clone());
    let mut plugin_task = None;
    let mut plugin_state: Option<Arc<crate::kubelet_plugin::state::DriverState>> = None;
    let mut backoff = BACKOFF_START;
    // The GPUs of the last discovery and their devices: a health change republishes them with new taints at once,
    // without waiting for NVML to answer about a GPU that may have just fallen off the bus.
    // And the MIG devices that were the agent's then.
    let mut known: Option<(Vec<Gpu>, Vec<device::Device>, std::collections::BTreeSet<String>)> = None;
    let mut health_only = false;
    let mut sharing = SharingChoice::new(gpu.gpu_sharing);
    // When the next full round is due: health-only rounds leave it, so a GPU whose health keeps changing never
    // holds off rediscovery and the sharing label.
    let mut next_full = tokio::time::Instant::now();
    // Since when the Node object has been missing (rounds failing for it).
    let mut node_missing_since: Option<std::time::Instant> = None;
    // What the last round failed for (`None`: it did not fail).
    let mut last_failure: Option<FailureKind> = None;
    // The GPUs NVML reports lost, as last said in the log: (kept with their last reading, left out).
    let mut unreadable_said: (Vec<String>, Vec<discovery::Unreadable>) = (Vec::new(), Vec::new());
    // Whether the kubelet plugin serves without GPUs: started while they could not be discovered, and not since.
    let mut without_gpus = false;
    // Whether starting it without GPUs failed and was said.
    let mut start_without_gpus_failed = false;
    // Whether emptying the pool while serving without GPUs failed and was said.
    let mut unpublish_failure_said = false;
    let mut pending_discovery: PendingDiscovery = None;
    let discovery_timeout = args.discovery_timeout;
    let start_plugin = |without_driver| {
        plugin::start(
            &settings,
            without_driver,
            plugin_client.clone(),
            inventory_rx.clone(),
            plugin_metrics.clone(),
            monitor.health_updates(),
            (&liveness, &readiness),
            stop.clone(),
        )
    };
    loop {
        // Whether this round found the Node (`None`: it did not read it, or the read failed).
        let mut node_exists = None;
        // Whether this round's discovery failed (no usable driver, an NVML error).
        let mut discovery_failed = false;
        // The GPUs this round's discovery found lost: (kept with their last reading, left out); `None`: it
        // discovered nothing.
        let mut unreadable_now = None;
        // When the discovery that found them began.
        let mut unreadable_read_at = None;
        let round = async {
            // Nothing is published while a device plugin serves the GPUs; the next full round looks again.
            if health_only && (device_plugins.refusing() || other_drivers.refusing()) {
                return Ok::<_, RoundFailure>((0, Outcome::Unchanged));
            }
            if health_only && let Some((gpus, devices, ours)) = &known {
                let outcome = publish(gpus, devices, sharing.current, ours, &publisher, &monitor).await?;
                return Ok::<_, RoundFailure>((devices.len(), outcome));
            }
            let read = read_node(&client, &node).await;
            node_exists = sharing.refresh(&read, &gpu.driver_name);
            if let Ok(Some(read)) = &read {
                device_plugins.observe(read).await;
            }
            // With the plugin serving, a round for a missing Node stops here: nothing can be published for it.
            if node_exists == Some(false) && plugin_task.is_some() {
                let reason = format!("node {node} not found: waiting for the Node to be registered again");
                return Err(RoundFailure { reason, kind: FailureKind::NodeMissing });
            }
            // Read before discovery as well as after: a MIG device destroyed by an unprepare in between is still
            // seen by the discovery, and must not pass for an administrator's.
            let mut ours = made_mig_devices(plugin_state.as_ref()).await;
            // Also while serving without GPUs: each round gives up on a discovery that hangs, so that what the
            // round does besides (emptying the pool, the Node and device plugin checks) is retried meanwhile.
            let patience = (plugin_task.is_none() || without_gpus).then_some(discovery_timeout);
            let (read_at, found) = discover(discovery.clone(), &mut pending_discovery, patience)
                .await
                .inspect_err(|_| discovery_failed = true)?;
            let discovery::Filled { mut gpus, filled, unknown } =
                found.filled_from(known.as_ref().map(|(g, _, _)| g.as_slice()));
            unreadable_now = Some((filled, unknown));
            unreadable_read_at = Some(read_at);
            discovered.send_replace(Arc::new(gpus.clone()));
            // The plugin serves before the devices are published: a slice must never advertise GPUs that nothing
            // on this node could prepare.
            if plugin_task.is_none() || without_gpus {
                let devices = device::devices(&gpus, mig_layout(gpu.mig_layout, &publisher));
                inventory.send_replace(inventory_of(&devices));
                match &plugin_state {
                    // Serving without GPUs until now: its start-up recovery is done again, with them.
                    Some(state) if without_gpus => {
                        state.recover_with_gpus().await.map_err(|e| format!("recover the kubelet plugin: {e}"))?;
                        without_gpus = false;
                        info!("the GPUs are discovered: the kubelet plugin prepares them");
                    }
                    _ => {
                        let (task, state) =
                            start_plugin(false).await.map_err(|e| format!("start the kubelet plugin: {e}"))?;
                        monitor.set_holders(state.clone());
                        plugin_state = Some(state);
                        plugin_task = Some(task);
                    }
                }
                // Its start-up recovery destroys the MIG devices of interrupted prepares: publish what is left.
                if devices.iter().any(|d| d.partition.is_some()) {
                    let (read_at, found) = discover(discovery.clone(), &mut pending_discovery, None).await?;
                    let discovery::Filled { gpus: found, filled, unknown } = found.filled_from(Some(&gpus));
                    gpus = found;
                    unreadable_now = Some((filled, unknown));
                    unreadable_read_at = Some(read_at);
                    discovered.send_replace(Arc::new(gpus.clone()));
                }
            }
            ours.extend(made_mig_devices(plugin_state.as_ref()).await);
            other_drivers.check(&gpus).await;
            if device_plugins.refusing() || other_drivers.refusing() {
                // Claims allocated before the device plugin (or the other driver) came still prepare (their GPUs stay
                // in the inventory); new ones find no GPU of this node to allocate.
                inventory.send_replace(inventory_of(&device::devices(&gpus, mig_layout(gpu.mig_layout, &publisher))));
                known = None;
                unpublish(&publisher, &monitor).await.map_err(|e| RoundFailure {
                    kind: FailureKind::Other,
                    reason: format!(
                        "empty the pool while a device plugin or another driver serves this node's GPUs: {e}"
                    ),
                })?;
                return Ok((0, Outcome::Unchanged));
            }
            loop {
                let layout = mig_layout(gpu.mig_layout, &publisher);
                let devices = device::devices(&gpus, layout);
                inventory.send_replace(inventory_of(&devices));
                let outcome = publish(&gpus, &devices, sharing.current, &ours, &publisher, &monitor).await?;
                let count = devices.len();
                known = Some((gpus.clone(), devices, ours.clone()));
                // Unless the API server dropped the counters just now: then the MIG devices as they exist, at once.
                if mig_layout(gpu.mig_layout, &publisher) == layout {
                    return Ok::<_, RoundFailure>((count, outcome));
                }
            }
        }
        .await;
        if discovery_failed && plugin_task.is_none() {
            // Claims prepared before this start (the agent upgraded or restarted while the driver is broken, being
            // reinstalled, or mismatched after an upgrade without a reboot) must still be unprepared: without a
            // registered plugin the kubelet cannot, and their pods stay Terminating, holding up a drain. So the
            // plugin serves without GPUs (prepares fail with the reason) until the discovery works.
            // A discovery that worked before a failed plugin start left its GPUs in the inventory.
            inventory.send_replace(Arc::new(Inventory::new()));
            match start_plugin(true).await {
                Ok((task, state)) => {
                    warn!(
                        "serving the kubelet without GPUs while they cannot be discovered: prepared claims can be \
                         unprepared, new ones fail to prepare until the GPUs are discovered"
                    );
                    monitor.set_holders(state.clone());
                    plugin_state = Some(state);
                    plugin_task = Some(task);
                    without_gpus = true;
                }
                Err(error) if !start_without_gpus_failed => {
                    warn!(%error, "the kubelet plugin cannot start without GPUs either: prepared claims cannot be \
                                   unprepared until it can; retrying with the discovery");
                    start_without_gpus_failed = true;
                }
                Err(error) => debug!(%error, "the kubelet plugin cannot start without GPUs either"),
            }
        }
        if discovery_failed && without_gpus {
            // The slices published before (by this node's previous agent) name GPUs that nothing here can prepare
            // now, and the plugin's registration keeps the kubelet from deleting them as it does those of a driver
            // that is gone: the pool is emptied, after the faults of an unreadable health state are read back
            // from them.
            match unpublish(&publisher, &monitor).await {
                Ok(()) => unpublish_failure_said = false,
                Err(error) if !unpublish_failure_said => {
                    warn!(%error, "emptying the pool of a node whose GPUs cannot be discovered failed: pods may be \
                                   sent to GPUs that cannot be prepared; retrying with the discovery");
                    unpublish_failure_said = true;
                }
                Err(error) => debug!(%error, "emptying the pool failed again"),
            }
        }
        if let Some(now) = unreadable_now {
            // Lost now: the monitor taints it (and keeps it tainted while it stays lost).
            for uuid in &now.0 {
                let fault = health::inject::Injection {
                    gpu: uuid.clone(),
                    action: health::inject::Action::Fault(health::classify::Fault::GpuLost),
                    // Read before this round published: a reset reported meanwhile makes it stale.
                    read_at: unreadable_read_at,
                };
                let _ = health_reports.send(fault);
            }
            if now != unreadable_said {
                unreadable_gauge.set((now.0.len() + now.1.len()) as i64);
                if now.0.is_empty() && now.1.is_empty() {
                    info!("every GPU NVML counts can be read again");
                } else {
                    let left_out: Vec<String> =
                        now.1.iter().map(|u| format!("GPU {}: {}", u.index, u.reason)).collect();
                    warn!(kept_as_last_read = ?now.0, ?left_out, "GPUs NVML reports lost: those read before stay \
                          published with their last reading and tainted, those never read are left out; the others \
                          are published and prepared (a GPU fallen off the bus needs a reset or a reboot)");
                }
                unreadable_said = now;
            }
        }
        let full = !health_only;
        let wake_at = match round {
            Ok((count, outcome)) => {
                readiness.set(Ok(()));
                devices_gauge.set(count as i64);
                publishes.get_or_create(&ResultLabels { result: "success" }).inc();
                if let Outcome::Published { generation, slices } = outcome {
                    info!(devices = count, generation, slices, "node pool up to date");
                }
                backoff = BACKOFF_START;
                node_missing_since = None;
                last_failure = None;
                if full {
                    next_full = tokio::time::Instant::now() + args.resync_period;
                }
                next_full
            }
            Err(RoundFailure { reason, kind }) => {
                publishes.get_or_create(&ResultLabels { result: "failure" }).inc();
                let node_missing = kind == FailureKind::NodeMissing;
                node_missing_since =
                    retry::missing_since(node_missing_since, node_missing, node_exists, std::time::Instant::now());
                let missing_for = node_missing_since.map(|t| t.elapsed());
                let (wait, next) = retry::after_failure(backoff, missing_for, kind == FailureKind::DriverMissing);
                // A missing Node or driver is said once; looking again every few seconds is not news.
                let again = kind != FailureKind::Other && last_failure == Some(kind);
                last_failure = Some(kind);
                if again {
                    debug!(error = %reason, retry_in = ?wait, "discover and publish failed again");
                } else {
                    warn!(error = %reason, retry_in = ?wait, "discover and publish failed");
                }
                readiness.set(Err(reason));
                backoff = next;
                tokio::time::Instant::now() + wait
            }
        };
        health_only = false;
        if last_failure.is_some() {
            // The failed round's own slice writes reach the watch within this hold and are not news: taken as a
            // change, they would start the next round at once, several a second against an API server that is
            // failing. Someone else's change after it (a kubelet restart deleting the slices) still wakes the loop.
            let hold = wake_at.saturating_duration_since(tokio::time::Instant::now()).min(FAILURE_HOLD);
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(hold) => {}
            }
            let _ = tokio::time::timeout(Duration::ZERO, changed.notified()).await;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = monitor.changed.notified() => health_only = true,
            () = changed.notified() => tokio::time::sleep(DEBOUNCE).await,
            () = tokio::time::sleep_until(wake_at) => {}
        }
    }
    if let Some(task) = plugin_task {
        let _ = task.await;
    }
    // The claims' MPS daemons go with the agent, as they would with its container; start-up starts them again.
    if let Some(state) = plugin_state {
        let _ = tokio::task::spawn_blocking(move || state.stop_mps_daemons()).await;
    }
    // A health change not saved yet gets its last try (bounded: a hung disk does not hold up the stop).
    monitor.saved_at_stop(Duration::from_secs(3)).await;
    info!("stopped");
    Ok(())
}

/// Reads the Node from the API server's cache (resourceVersion 0: one cheap read per node and resync, never a
/// quorum read from etcd); `None`: it does not exist.
async fn read_node(client: &kube::Client, node: &str) -> Result<Option<Node>, kube::Error> {
    match Api::<Node>::all(client.clone()).get_with(node, &kube::api::GetParams::any()).await {
        Ok(node) => Ok(Some(node)),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(None),
        Err(err) => Err(err),
    }
}

/// This node's sharing mode ([`slices::node_sharing`]): `--gpu-sharing`, unless the Node's label says otherwise.
struct SharingChoice {
    default: slices::Sharing,
    current: slices::Sharing,
    /// The invalid label value last reported, so that it is reported once, not every minute.
    reported: Option<String>,
    /// Whether a failure to read the Node was reported since the last read that worked.
    read_failure_reported: bool,
}

impl SharingChoice {
    fn new(default: slices::Sharing) -> Self {
        Self { default, current: default, reported: None, read_failure_reported: false }
    }

    /// Takes the Node's labels from `read` ([`read_node`]); says whether the Node exists (`None`: the read failed).
    /// A Node that cannot be read keeps the current mode: the round goes on, and the publisher reports what is wrong
    /// with it.
    fn refresh(&mut self, read: &Result<Option<Node>, kube::Error>, driver: &str) -> Option<bool> {
        let labels = match read {
            Ok(Some(node)) => node.metadata.labels.clone().unwrap_or_default(),
            Ok(None) => return Some(false),
            Err(err) => {
                if !std::mem::replace(&mut self.read_failure_reported, true) {
                    let label = slices::node_sharing::label_key(driver);
                    warn!(error = %err, %label, "cannot read this Node's labels (the chart grants nodes get); GPU \
                          sharing stays as it is until it can");
                }
                return None;
            }
        };
        self.read_failure_reported = false;
        let (now, invalid) = slices::node_sharing::resolve(&labels, driver, self.default);
        match invalid {
            Some(invalid) if self.reported.as_ref() != Some(&invalid.value) => {
                warn!("{invalid}");
                self.reported = Some(invalid.value);
            }
            Some(_) => {}
            None => self.reported = None,
        }
        if now != self.current {
            let label = slices::node_sharing::label_key(driver);
            let (from, to) = (slices::node_sharing::name(self.current), slices::node_sharing::name(now));
            info!(%label, "GPU sharing of this node: {to} (was {from})");
            self.current = now;
        }
        Some(true)
    }
}

/// What the plugin prepares from: `devices` by name.
fn inventory_of(devices: &[device::Device]) -> Arc<Inventory> {
    Arc::new(devices.iter().map(|d| (d.name(), d.clone())).collect())
}

/// The MIG layout to publish: `--mig-layout`, or static once the API server dropped the counters dynamic MIG needs.
fn mig_layout(asked: device::MigLayout, publisher: &Publisher) -> device::MigLayout {
    if publisher.counters_dropped() { device::MigLayout::Static } else { asked }
}

/// The UUIDs of the MIG devices the plugin's checkpoint records as made for claims (none before the plugin
/// started), read off the async threads.
async fn made_mig_devices(
    state: Option<&Arc<crate::kubelet_plugin::state::DriverState>>,
) -> std::collections::BTreeSet<String> {
    let Some(state) = state.cloned() else { return std::collections::BTreeSet::new() };
    tokio::task::spawn_blocking(move || state.made_mig_devices()).await.unwrap_or_default()
}

/// A GPU discovery a round started and did not see finish.
type PendingDiscovery =
    Option<tokio::task::JoinHandle<(std::time::Instant, Result<discovery::Discovered, discovery::DiscoveryError>)>>;

/// Discovers the GPUs, with the blocking NVML calls off the async threads. A discovery an earlier round left running
/// is awaited rather than another started: an NVML call that hangs (a wedged GPU or driver) must not take one more
/// blocking thread each round. With `patience` (until the kubelet plugin serves with GPUs), one that has not
/// answered by then fails the round and stays pending, so that the plugin serves without GPUs meanwhile: claims
/// prepared before this start can be unprepared (but for dynamic MIG claims, whose MIG devices are destroyed
/// through NVML), and their pods stop. Answers when the discovery began, too.
async fn discover(
    discovery: Arc<dyn discovery::Discovery>,
    pending: &mut PendingDiscovery,
    patience: Option<Duration>,
) -> Result<(std::time::Instant, discovery::Discovered), RoundFailure> {
    let task = pending.get_or_insert_with(|| {
        tokio::task::spawn_blocking(move || (std::time::Instant::now(), discovery.discover_all()))
    });
    let joined = match patience {
        None => task.await,
        Some(patience) => tokio::time::timeout(patience, task).await.map_err(|_| RoundFailure {
            // Retried as a driver not there yet is (within 10 s), not after a growing back-off: the GPUs are
            // published as soon as NVML answers.
            kind: FailureKind::DriverMissing,
            reason: format!(
                "the GPU discovery has not answered in {} (an NVML call that hangs: a wedged GPU or driver?)",
                humantime::format_duration(patience)
            ),
        })?,
    };
    *pending = None;
    let (began, found) = joined.map_err(|e| format!("discovery task failed: {e}"))?;
    let found = found.map_err(|e| RoundFailure {
        kind: match e {
            discovery::DiscoveryError::NvmlUnavailable { .. } => FailureKind::DriverMissing,
            _ => FailureKind::Other,
        },
        reason: e.to_string(),
    })?;
    Ok((began, found))
}

/// Builds the node's slices from `devices` (those of `gpus`), with the taints of faulted GPUs (a MIG device has its
/// GPU's) and, for GPUs published as partitions, their counter sets, leaving out the partitions that MIG devices not
/// among `ours` (UUIDs the agent made) are in the way of; and publishes them.
async fn publish(
    gpus: &[Gpu],
    devices: &[device::Device],
    sharing: slices::Sharing,
    ours: &std::collections::BTreeSet<String>,
    publisher: &Publisher,
    monitor: &health::Monitor,
) -> Result<Outcome, RoundFailure> {
    read_back_faults(publisher, monitor).await.map_err(|e| RoundFailure {
        kind: FailureKind::Other,
        reason: format!("read the GPU faults back from the published taints: {e}"),
    })?;
    let taints = monitor.taints(gpus);
    let pool = slices::node_pool(gpus, devices, sharing, ours, &taints);
    monitor.update_health(devices);
    publisher.publish(&pool).await.map_err(|e| RoundFailure {
        kind: match e {
            slices::publisher::PublishError::NodeNotFound { .. } => FailureKind::NodeMissing,
            _ => FailureKind::Other,
        },
        reason: e.to_string(),
    })
}

/// Deletes the node's slices, after reading the faults of an unreadable health state back from them (not before
/// those are saved).
async fn unpublish(publisher: &Publisher, monitor: &health::Monitor) -> Result<(), slices::publisher::PublishError> {
    read_back_faults(publisher, monitor).await?;
    if monitor.restore_pending() && !monitor.read_back_saved().await {
        // Not saved (the saver tries again): the slices stay the only record of the faults.
        return Ok(());
    }
    publisher.publish(&[]).await?;
    monitor.taints(&[]);
    Ok(())
}

/// The health state was unreadable or missing: its faults are read back from the node's slices (once) before they
/// are replaced.
async fn read_back_faults(
    publisher: &Publisher,
    monitor: &health::Monitor,
) -> Result<(), slices::publisher::PublishError> {
    if monitor.read_back_pending() {
        monitor.restore(&publisher.published_taints().await?);
    }
    Ok(())
}

/// Wakes the main loop whenever someone else touches this node's slices (a kubelet restart deletes them all).
async fn watch_own_slices(client: kube::Client, field_selector: String, changed: Arc<Notify>) {
    let api = Api::<ResourceSlice>::all(client);
    crate::kube_client::watch::watcher("resourceslices", api, watcher::Config::default().fields(&field_selector))
        .for_each(|event| {
            match event {
                Ok(watcher::Event::Delete(_) | watcher::Event::Apply(_) | watcher::Event::InitDone) => {
                    changed.notify_one()
                }
                Ok(_) => {}
                Err(err) => warn!(error = %err, "watch of own ResourceSlices failed; retrying with back-off"),
            }
            futures::future::ready(())
        })
        .await;
}

fn serving_addresses(metrics: SocketAddr, health: Option<SocketAddr>) -> Vec<SocketAddr> {
    match health {
        Some(health) if health != metrics => vec![metrics, health],
        _ => vec![metrics],
    }
}

/// A DNS subdomain (RFC 1123) of at most 63 characters: what the API accepts as a driver name.
pub fn is_dns_subdomain(name: &str) -> bool {
    is_dns_subdomain_within(name, 63)
}

/// A DNS subdomain (RFC 1123) of at most `max` characters (253 for most object names).
pub fn is_dns_subdomain_within(name: &str, max: usize) -> bool {
    !name.is_empty()
        && name.len() <= max
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn driver_names() {
        for ok in ["gpu.gpu-dra.dev", "gpu.example.com", "a"] {
            assert!(super::is_dns_subdomain(ok), "{ok}");
        }
        for bad in ["", "GPU.example.com", "gpu..example", "-gpu.example", "gpu_example", &"a".repeat(64)] {
            assert!(!super::is_dns_subdomain(bad), "{bad}");
        }
    }
}
