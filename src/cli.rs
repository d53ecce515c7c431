//! The command line: one subcommand per component, shared flag groups flattened in.
//!
//! Every flag has an environment-variable twin so that a Helm chart can set it either way.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::node_agent::health::taints::Effect;

/// Kubernetes Dynamic Resource Allocation for NVIDIA GPUs.
#[derive(Debug, Parser)]
#[command(name = "gpu-dra", version = crate::telemetry::build::LONG_VERSION, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create each pod's ResourceClaims from its ResourceClaimTemplates (kube-controller-manager style).
    Controller(Box<ControllerArgs>),
    /// Discover this node's GPUs, publish them as ResourceSlices and serve the kubelet DRA plugin API.
    NodeAgent(Box<NodeAgentArgs>),
    /// Check this machine's GPUs without a cluster: print what the node agent would publish and prepare one claim
    /// into a CDI directory (e2e/gpu-check.sh).
    GpuCheck(Box<GpuCheckArgs>),
    /// The simulated backend's stand-in for `nvidia-cuda-mps-control` (run by the node agent, not by people).
    #[command(hide = true)]
    SimulatedMpsControl {
        /// Run as the daemon (in the foreground); without it, send standard input to the daemon.
        #[arg(short = 'f')]
        foreground: bool,
        /// Run as the MPS server the daemon starts.
        #[arg(long)]
        server: bool,
    },
}

/// Logging flags shared by every component.
#[derive(Debug, Args)]
pub struct LogArgs {
    /// Log filter in `tracing` syntax, e.g. `info` or `gpu_dra=debug,kube=info`.
    #[arg(long, env = "GPU_DRA_LOG", default_value = "info", global = true)]
    pub log_filter: String,
    /// Log line format: `text` for people, `json` for log pipelines.
    #[arg(long, env = "GPU_DRA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Flags of `gpu-dra controller`.
#[derive(Debug, Args)]
pub struct ControllerArgs {
    #[command(flatten)]
    pub client: crate::kube_client::ClientArgs,
    /// Address of the HTTP endpoint serving /metrics, /healthz and /readyz (`127.0.0.1:0` picks a free port).
    #[arg(long, env = "GPU_DRA_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Events per second, sent on a client of their own so that Events never hold up claims (0: unlimited). The
    /// Event sender keeps this rate itself, sending what is queued in batches.
    #[arg(long, env = "GPU_DRA_EVENTS_QPS", default_value_t = 50.0, value_parser = crate::kube_client::parse_qps)]
    pub events_qps: f64,
    /// Events allowed at once above the average; when limited, also the largest batch (at most 25).
    #[arg(long, env = "GPU_DRA_EVENTS_BURST", default_value_t = 200)]
    pub events_burst: u32,
    /// Watch and act on one namespace only (tests, or one controller per tenant); default: all namespaces.
    #[arg(long, env = "GPU_DRA_WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// Concurrent syncs (kube-controller-manager's --concurrent-resourceclaim-syncs, also 50 by default).
    #[arg(long, env = "GPU_DRA_CONTROLLER_WORKERS", default_value_t = 50, value_parser = clap::value_parser!(u16).range(1..))]
    pub workers: u16,
    /// Threads running the controller's tasks: with 1 (the default) the process's main thread runs them all; with
    /// N > 1, N worker threads do (the main thread only waits). The controller mostly waits on the API server, and
    /// one worker thread spent 10–25 % less CPU than two on a 2-core machine (see the README's controller cost).
    /// Raise it only if the controller's one thread is busy.
    #[arg(long, env = "GPU_DRA_CONTROLLER_THREADS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,
    /// Elect a leader through a Lease so that only one replica writes. `false` only for a single process.
    #[arg(long, env = "GPU_DRA_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the leader-election Lease.
    #[arg(long, env = "GPU_DRA_LEADER_ELECT_LEASE_NAME", default_value = "gpu-dra-controller")]
    pub leader_elect_lease_name: String,
    /// Namespace of the Lease; default: --namespace if set, else the client's namespace (the pod's own namespace
    /// in a cluster).
    #[arg(long, env = "GPU_DRA_LEADER_ELECT_NAMESPACE")]
    pub leader_elect_namespace: Option<String>,
    /// How long a Lease stays valid without renewal; a standby takes over after this.
    #[arg(long, env = "GPU_DRA_LEADER_ELECT_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    pub leader_elect_lease_duration: Duration,
    /// How long the leader tries to renew before it stops leading (and exits).
    #[arg(long, env = "GPU_DRA_LEADER_ELECT_RENEW_DEADLINE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub leader_elect_renew_deadline: Duration,
    /// Pause between leader-election attempts.
    #[arg(long, env = "GPU_DRA_LEADER_ELECT_RETRY_PERIOD", default_value = "2s", value_parser = humantime::parse_duration)]
    pub leader_elect_retry_period: Duration,
    /// This replica's identity in the Lease and in Events; default: POD_NAME, else host name and process id.
    #[arg(long, env = "GPU_DRA_IDENTITY")]
    pub identity: Option<String>,
    /// What to do once a pod's status records a claim another ResourceClaim controller (kube-controller-manager's
    /// resourceclaim-controller) generated: `warn` (Warning event, error log, metric; keep creating claims and
    /// remove unused duplicates) or `observe-only` (the same, then create, adopt, reserve and record nothing,
    /// cluster-wide, until restarted).
    #[arg(long, env = "GPU_DRA_ON_ANOTHER_CLAIM_CONTROLLER", value_enum, default_value_t = crate::controller::foreign::OnAnotherController::Warn)]
    pub on_another_claim_controller: crate::controller::foreign::OnAnotherController,
}

/// Flags of `gpu-dra node-agent`. Every path is configurable so that several agents (one per fake node) can run
/// side by side in tests.
#[derive(Debug, Args)]
pub struct NodeAgentArgs {
    #[command(flatten)]
    pub client: crate::kube_client::ClientArgs,
    /// The Node this agent runs on (from the downward API in a DaemonSet).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// How often the GPUs are discovered again and the Node's `<driver>/gpu-sharing` label read; a slice
    /// touched by someone else starts such a round at once (a health change only republishes)
    #[arg(long, env = "GPU_DRA_RESYNC_PERIOD", default_value = "60s", value_parser = parse_resync_period)]
    pub resync_period: Duration,
    /// How long the GPU discovery at start may take before the kubelet plugin serves without GPUs (as when it
    /// fails): claims prepared before this start can then be unprepared while an NVML call hangs; the GPUs are
    /// prepared once it answers (1s to 1h)
    #[arg(long, env = "GPU_DRA_DISCOVERY_TIMEOUT", default_value = "60s", value_parser = parse_resync_period)]
    pub discovery_timeout: Duration,
    #[command(flatten)]
    pub gpu: GpuArgs,
    #[command(flatten)]
    pub health: HealthArgs,
    /// The driver root as the container runtime on the host sees it, when this process sees it elsewhere (a
    /// DaemonSet mounting the host's root at `--driver-root /driver-root`): CDI host paths start here. Default:
    /// `--driver-root`.
    #[arg(long, env = "GPU_DRA_HOST_DRIVER_ROOT")]
    pub host_driver_root: Option<PathBuf>,
    /// The kubelet's plugin registration directory.
    #[arg(long, env = "GPU_DRA_KUBELET_REGISTRY_DIR", default_value = "/var/lib/kubelet/plugins_registry")]
    pub kubelet_registry_dir: PathBuf,
    /// How long the kubelet may take to register the plugin once its registration socket is there before the agent
    /// warns (Warning Event `NotRegistered` on the Node) and `/readyz` fails: a kubelet whose root directory is not
    /// the one the registry directory is under never looks there, and every pod given this node's GPUs then fails.
    #[arg(long, env = "GPU_DRA_KUBELET_REGISTRATION_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub kubelet_registration_timeout: Duration,
    /// The kubelet's plugins directory; the DRA socket goes into `<dir>/<driver>/dra.sock`.
    #[arg(long, env = "GPU_DRA_KUBELET_PLUGINS_DIR", default_value = "/var/lib/kubelet/plugins")]
    pub kubelet_plugins_dir: PathBuf,
    /// Where CDI specs are written (the runtime's dynamic CDI directory).
    #[arg(long, env = "GPU_DRA_CDI_DIR", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
    /// Where the agent keeps its checkpoint of prepared claims.
    #[arg(long, env = "GPU_DRA_STATE_DIR", default_value = "/var/lib/gpu-dra")]
    pub state_dir: PathBuf,
    /// Where the MPS control daemons of claims asking MPS keep their pipes, logs and shared memory
    /// (`<dir>/<claim UID>/{pipe,log,shm}`); containers mount them from here, so it is a host path, best on a tmpfs.
    #[arg(long, env = "GPU_DRA_MPS_DIR", default_value = "/run/gpu-dra/mps")]
    pub mps_dir: PathBuf,
    /// Give each container that uses a claim a file describing its request's GPUs (KEP-5304 device metadata:
    /// `/var/run/kubernetes.io/dra-device-attributes/…/<driver>-metadata.json`, their ResourceSlice attributes),
    /// kept under `<state-dir>/device-metadata`, which must be the same path on the host.
    #[arg(long, env = "GPU_DRA_DEVICE_METADATA", default_value_t = true, action = clap::ArgAction::Set)]
    pub device_metadata: bool,
    /// Publish none of this node's GPUs while a device plugin serves NVIDIA GPUs on it (one of
    /// `--device-plugin-resources` allocatable in the Node's status): both would hand out the same GPUs. Said in
    /// the log, a Warning Event on the Node and `gpu_dra_node_agent_device_plugin_refused`; the GPUs are published
    /// again once none has served any for `--device-plugin-grace-period`. Off, the agent only warns.
    #[arg(long, env = "GPU_DRA_REFUSE_WITH_DEVICE_PLUGIN", default_value_t = true, action = clap::ArgAction::Set)]
    pub refuse_with_device_plugin: bool,
    /// The extended resources a device plugin serves GPUs as, comma-separated; a trailing `*` matches any rest of
    /// the name. Add the names of a plugin configured to rename its resources (e.g. `nvidia.com/a100`).
    #[arg(long, env = "GPU_DRA_DEVICE_PLUGIN_RESOURCES", value_delimiter = ',', value_parser = parse_resource_name,
          default_value = crate::node_agent::device_plugin::DEFAULT_RESOURCES)]
    pub device_plugin_resources: Vec<String>,
    /// How long no device plugin must have served GPUs before the agent publishes them again: the kubelet zeroes a
    /// plugin's allocatable while the plugin or the kubelet restarts, and waits 5 minutes for a disconnected one. When
    /// one last served is kept in `<state-dir>/device-plugin.json` for an agent restarted meanwhile.
    #[arg(long, env = "GPU_DRA_DEVICE_PLUGIN_GRACE_PERIOD", default_value = "5m", value_parser = humantime::parse_duration)]
    pub device_plugin_grace_period: Duration,
    /// What to do with a claim prepared here that the API no longer allocates what was prepared (deleted,
    /// deallocated, allocated other devices), found so by two checks an interval apart while the Node is Ready: the
    /// kubelet lost its record of it, or a container it cannot stop still holds it. `warn` says so (log, Warning
    /// Event on the Node, `gpu_dra_kubelet_plugin_stale_claims`); `unprepare` also frees its GPUs.
    #[arg(long, env = "GPU_DRA_STALE_CLAIMS", value_enum, default_value_t = crate::node_agent::stale_claims::StaleClaimAction::Warn)]
    pub stale_claims: crate::node_agent::stale_claims::StaleClaimAction,
    /// How often prepared claims are checked against the API for `--stale-claims` (1s to 24h: a claim is stale
    /// only after two checks this far apart, the kubelet's time to stop a force-deleted pod's containers).
    #[arg(long, env = "GPU_DRA_STALE_CLAIM_CHECK_INTERVAL", default_value = "5m", value_parser = parse_stale_claim_check_interval)]
    pub stale_claim_check_interval: Duration,
    /// The file holding this boot's ID: checkpoint entries of an earlier boot are dropped (their device state is
    /// gone). Only tests point it elsewhere.
    #[arg(long, env = "GPU_DRA_BOOT_ID_FILE", default_value = "/proc/sys/kernel/random/boot_id")]
    pub boot_id_file: PathBuf,
    /// Address of /metrics (and /healthz, /readyz unless --health-addr differs).
    #[arg(long, env = "GPU_DRA_METRICS_ADDR", default_value = "0.0.0.0:8081")]
    pub metrics_addr: SocketAddr,
    /// Address of /healthz and /readyz when they should be served apart from /metrics.
    #[arg(long, env = "GPU_DRA_HEALTH_ADDR")]
    pub health_addr: Option<SocketAddr>,
}

/// The GPU health policy of `node-agent` (README "GPU health").
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// XIDs to treat as application errors (never tainting) on top of the built-in ones, comma-separated, e.g.
    /// `63,94`.
    #[arg(long, env = "GPU_DRA_HEALTH_IGNORE_XIDS", value_delimiter = ',')]
    pub health_ignore_xids: Vec<u64>,
    /// A faulted GPU with no new fault for this long is untainted again; `0s`: only a reset (or `clear` injected
    /// into a simulated GPU) untaints it.
    /// Whole seconds (the window is kept and compared in seconds).
    #[arg(long, env = "GPU_DRA_HEALTH_HEALTHY_WINDOW", default_value = "5m", value_parser = parse_healthy_window)]
    pub health_healthy_window: Duration,
    /// Taint effect for faults after which the GPU needs a reset (ECC double-bit, firmware, NVLink errors).
    #[arg(long, env = "GPU_DRA_HEALTH_NEEDS_RESET_EFFECT", value_enum, default_value_t = Effect::NoSchedule)]
    pub health_needs_reset_effect: Effect,
    /// Taint effect for a lost GPU (fell off the bus, uncontained ECC error): NoExecute evicts its pods.
    #[arg(long, env = "GPU_DRA_HEALTH_LOST_EFFECT", value_enum, default_value_t = Effect::NoExecute)]
    pub health_lost_effect: Effect,
}

impl HealthArgs {
    /// The policy and taint effects these flags describe.
    pub fn policy(&self) -> (crate::node_agent::health::state::Policy, crate::node_agent::health::taints::Effects) {
        let policy = crate::node_agent::health::state::Policy {
            ignore_xids: self.health_ignore_xids.iter().copied().collect(),
            healthy_window: Some(self.health_healthy_window).filter(|w| !w.is_zero()),
        };
        let effects = crate::node_agent::health::taints::Effects {
            needs_reset: self.health_needs_reset_effect,
            lost: self.health_lost_effect,
        };
        (policy, effects)
    }
}

/// The driver and where its GPUs come from: shared by `node-agent` and `gpu-check`, so that the check sees what
/// the agent would.
#[derive(Debug, Args)]
pub struct GpuArgs {
    /// The DRA driver name: a DNS subdomain, the `driver` of every ResourceSlice and the domain of attributes.
    #[arg(long, env = "GPU_DRA_DRIVER_NAME", default_value = "gpu.gpu-dra.dev")]
    pub driver_name: String,
    /// Where GPUs come from: `nvml` (the NVIDIA driver) or `simulated` (machines without GPUs).
    #[arg(long, env = "GPU_DRA_GPU_BACKEND", value_enum, default_value_t = GpuBackend::Nvml)]
    pub gpu_backend: GpuBackend,
    /// Simulated GPUs: `<count>x<model>[,…]` (e.g. `4xH100-80GB`) or `@<file>` holding such a list.
    #[arg(long, env = "GPU_DRA_SIMULATED_GPUS")]
    pub simulated_gpus: Option<String>,
    /// Simulated GPUs: a directory in which their optional device nodes (`dev/nvidia-uvm`, `dev/nvidia-uvm-tools`)
    /// are looked for, as a real GPU's are under `/`, so that a node booted without them can be played (by default
    /// simulated GPUs have them all).
    #[arg(long, env = "GPU_DRA_SIMULATED_DEV_ROOT")]
    pub simulated_dev_root: Option<PathBuf>,
    /// Root of the NVIDIA driver installation (default for `nvml`: `/`; e.g. `/run/nvidia/driver` with the GPU
    /// Operator). With `simulated` GPUs only when given: their CDI specs then mount this tree's driver files too.
    #[arg(long, env = "GPU_DRA_DRIVER_ROOT")]
    pub driver_root: Option<PathBuf>,
    /// How the scheduler may hand out this node's GPUs: `whole` (one claim per GPU) or `by-memory` (several claims
    /// share a GPU, each consuming the memory it asks for, one that asks for none taking all of it, and the percent
    /// of its `compute` it asks for, none unless named). Not enforced on the GPU: see the README's "Shared GPUs".
    #[arg(long, env = "GPU_DRA_GPU_SHARING", value_enum, default_value_t = crate::node_agent::slices::Sharing::Whole)]
    pub gpu_sharing: crate::node_agent::slices::Sharing,
    /// How GPUs in MIG mode are published: `static` (the MIG devices an administrator made) or `dynamic` (every
    /// placement of every MIG profile plus the whole GPU, with counters so the scheduler picks placements that fit
    /// together; NodePrepareResources makes the MIG device, NodeUnprepareResources destroys it). Dynamic needs
    /// Kubernetes 1.36+ (DRAPartitionableDevices); see the README's "Dynamic MIG".
    #[arg(long, env = "GPU_DRA_MIG_LAYOUT", value_enum, default_value_t = crate::node_agent::device::MigLayout::Static)]
    pub mig_layout: crate::node_agent::device::MigLayout,
    /// Where sysfs is mounted (default `/sys`): each GPU's PCIe root complex (the `resource.kubernetes.io/pcieRoot`
    /// attribute) is read from `<sysfs-root>/bus/pci/devices/<bus id>`. Simulated GPUs read it only when given (a
    /// test's tree placing them), never the host's devices.
    #[arg(long, env = "GPU_DRA_SYSFS_ROOT")]
    pub sysfs_root: Option<PathBuf>,
}

impl GpuArgs {
    /// The driver root this backend reads: `--driver-root`, else `/` for NVML; simulated GPUs have none unless
    /// given one.
    /// The sysfs NVML discovery reads: `--sysfs-root`, else `/sys`.
    pub fn sysfs(&self) -> &Path {
        self.sysfs_root.as_deref().unwrap_or(Path::new("/sys"))
    }

    pub fn driver_root_to_read(&self) -> Option<&Path> {
        match (&self.driver_root, self.gpu_backend) {
            (Some(root), _) => Some(root),
            (None, GpuBackend::Nvml) => Some(Path::new("/")),
            (None, GpuBackend::Simulated) => None,
        }
    }

    /// The NVML library NVML discovery and the health events load now: the one under the driver root read (`/`
    /// unless given).
    pub fn nvml_library(&self) -> std::ffi::OsString {
        crate::node_agent::discovery::nvml::library_in(self.nvml_root())
    }

    /// The driver root NVML is looked for under (`/` unless given): look again with
    /// [`crate::node_agent::discovery::nvml::library_in`] where the driver may appear later.
    pub fn nvml_root(&self) -> &Path {
        self.driver_root_to_read().unwrap_or(Path::new("/"))
    }
}

/// Where the node agent finds GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuBackend {
    Nvml,
    Simulated,
}

/// Flags of `gpu-dra gpu-check`.
#[derive(Debug, Args)]
pub struct GpuCheckArgs {
    /// The node name the slice would carry.
    #[arg(long, env = "NODE_NAME", default_value = "gpu-check")]
    pub node_name: String,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Where to write the CDI spec of the sample claim (a scratch directory, not the runtime's).
    #[arg(long)]
    pub cdi_dir: PathBuf,
    /// GPUs in the sample claim (the first N discovered), at least 1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub claim_gpus: u16,
    /// How long to watch NVML's health events (critical XIDs, ECC errors, GPU lost) and report what the node agent's
    /// health monitor would see, e.g. 5s; 0s skips it.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub watch_health: std::time::Duration,
    /// Set the first sample GPU's compute time slice to Long and back to Default with nvidia-smi, as a prepare of a
    /// claim asking `TimeSlicing` and its unprepare do (changes the GPU's setting for a moment; needs root).
    #[arg(long)]
    pub check_time_slice: bool,
    /// Make a MIG device of the smallest profile on the first GPU in MIG mode with room for one, check that
    /// discovery lists it, and destroy it again, as dynamic MIG does for a claim (changes the GPU for a moment;
    /// needs root; not on a node running claims).
    #[arg(long)]
    pub check_mig_device: bool,
    /// Start an MPS control daemon for the sample claim's GPUs as a claim asking `sharing.strategy: MPS` does
    /// (their compute mode set to EXCLUSIVE_PROCESS, `nvidia-cuda-mps-control -f` under the driver root, in its own
    /// mount namespace; needs root), ask it for its servers through its control pipe, stop it again and set the GPUs
    /// back to DEFAULT (not on a node running claims).
    #[arg(long)]
    pub check_mps: bool,
    /// The node agent's state directory: the checks that change GPUs (`--check-time-slice`, `--check-mig-device`,
    /// `--check-mps`) are refused while an agent holds its lock there, as they would change GPUs under its claims.
    #[arg(long, default_value = "/var/lib/gpu-dra")]
    pub state_dir: PathBuf,
}

/// A resync period or discovery timeout: at least a second (the round talks to NVML and the API server) and at most
/// an hour.
fn parse_resync_period(text: &str) -> Result<Duration, String> {
    let period = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&period) {
        return Err(format!("{text} is outside 1s..1h"));
    }
    Ok(period)
}

/// A stale-claim check interval: at least a second (`0s` would check in a hot loop and call a claim stale at two
/// checks in a row, before the kubelet could stop anything) and at most a day.
fn parse_stale_claim_check_interval(text: &str) -> Result<Duration, String> {
    let interval = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if !(Duration::from_secs(1)..=Duration::from_secs(24 * 3600)).contains(&interval) {
        return Err(format!("{text} is outside 1s..24h"));
    }
    Ok(interval)
}

/// An extended resource name in a list: spaces around it (`a, b`) dropped, as they never match a resource name.
fn parse_resource_name(text: &str) -> Result<String, String> {
    match text.trim() {
        "" => Err("an empty name (two commas in a row, or one at the end?)".to_string()),
        name => Ok(name.to_string()),
    }
}

/// A healthy window: `0s`, or whole seconds. The window is kept in seconds, and `500ms`, cut to 0, untainted a GPU
/// the moment it faulted (where `0s` means the opposite: only a reset untaints).
fn parse_healthy_window(text: &str) -> Result<Duration, String> {
    let window = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if window.subsec_nanos() != 0 {
        return Err(format!(
            "{text} is not a whole number of seconds: the healthy window is kept in seconds (give e.g. 90s, or 0s for \
             only a reset to untaint)"
        ));
    }
    Ok(window)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_zero_or_positive_and_resource_names_trimmed() {
        assert_eq!(crate::kube_client::parse_qps("0"), Ok(0.0));
        assert_eq!(crate::kube_client::parse_qps("0.5"), Ok(0.5));
        for bad in ["-5", "NaN", "inf", "fast"] {
            let err = crate::kube_client::parse_qps(bad).expect_err(bad);
            assert!(err.contains("is not a rate"), "{bad}: {err}");
        }
        let parsed = Cli::try_parse_from([
            "gpu-dra",
            "node-agent",
            "--device-plugin-resources",
            "nvidia.com/gpu, nvidia.com/mig-*",
        ]);
        match parsed.map_err(|e| e.to_string()).map(|cli| cli.command) {
            Ok(Command::NodeAgent(args)) => {
                assert_eq!(args.device_plugin_resources, ["nvidia.com/gpu", "nvidia.com/mig-*"]);
            }
            other => panic!("{other:?}"),
        }
        let empty = Cli::try_parse_from(["gpu-dra", "node-agent", "--device-plugin-resources", "a,,b"]);
        assert!(empty.is_err_and(|e| e.to_string().contains("an empty name")));
    }

    #[test]
    fn healthy_windows_are_whole_seconds() {
        assert_eq!(parse_healthy_window("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_healthy_window("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_healthy_window("2000ms"), Ok(Duration::from_secs(2)));
        for bad in ["500ms", "1s 500ms", "1ns"] {
            let err = parse_healthy_window(bad).expect_err(bad);
            assert!(err.contains("not a whole number of seconds"), "{bad}: {err}");
        }
    }

    #[test]
    fn stale_claim_check_intervals_between_a_second_and_a_day() {
        assert_eq!(parse_stale_claim_check_interval("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_stale_claim_check_interval("5m"), Ok(Duration::from_secs(300)));
        for bad in ["0s", "1ms", "25h"] {
            let err = parse_stale_claim_check_interval(bad).expect_err(bad);
            assert!(err.contains("outside 1s..24h"), "{bad}: {err}");
        }
        assert!(parse_stale_claim_check_interval("often").is_err());
    }

    /// Names the API server would refuse at every try (a controller then stood by Ready and created nothing) and an
    /// empty identity (every replica led) stop the controller at start, naming the flag.
    #[test]
    fn controller_names_are_checked_at_start() {
        let check = |extra: &[&str]| -> Result<(), String> {
            let args = ["gpu-dra", "controller"].iter().chain(extra).copied();
            match Cli::try_parse_from(args).map_err(|e| e.to_string())?.command {
                Command::Controller(args) => crate::controller::check_names(&args).map_err(|e| e.to_string()),
                other => Err(format!("parsed as {other:?}")),
            }
        };
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(check(&["--namespace", "team-a", "--leader-elect-lease-name", "gpu-dra.controller"]), Ok(()));
        assert_eq!(check(&["--leader-elect=false", "--leader-elect-lease-name", "Any"]), Ok(()));
        for (flag, bad) in [
            ("--leader-elect-lease-name", "GPU_Lease"),
            ("--leader-elect-lease-name", ""),
            ("--namespace", "Team-A"),
            ("--namespace", "team.a"),
            ("--leader-elect-namespace", "ns-"),
            ("--identity", ""),
            ("--identity", "  "),
        ] {
            let err = check(&[flag, bad]).expect_err(bad);
            assert!(err.starts_with(&format!("{flag} {bad:?}")), "{flag} {bad}: {err}");
        }
    }

    #[test]
    fn controller_threads_default_to_one_and_stay_between_1_and_256() {
        let threads = |extra: &[&str]| -> Result<u16, String> {
            let args = ["gpu-dra", "controller"].iter().chain(extra).copied();
            match Cli::try_parse_from(args).map_err(|e| e.to_string())?.command {
                Command::Controller(args) => Ok(args.threads),
                other => Err(format!("parsed as {other:?}")),
            }
        };
        assert_eq!(threads(&[]), Ok(1));
        assert_eq!(threads(&["--threads", "4"]), Ok(4));
        assert_eq!(threads(&["--threads", "256"]), Ok(256));
        for bad in ["0", "257", "two"] {
            let err = threads(&["--threads", bad]).expect_err(bad);
            assert!(err.contains("--threads"), "{bad}: {err}");
        }
    }

    #[test]
    fn resync_periods_between_a_second_and_an_hour() {
        let cases = [
            ("1s", Ok(Duration::from_secs(1))),
            ("60s", Ok(Duration::from_secs(60))),
            ("1h", Ok(Duration::from_secs(3600))),
            ("999ms", Err("999ms is outside 1s..1h")),
            ("61m", Err("61m is outside 1s..1h")),
            ("0s", Err("0s is outside 1s..1h")),
            ("soon", Err("")),
        ];
        for (text, want) in cases {
            match (parse_resync_period(text), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{text}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{text}: {got:?} lacks {want:?}"),
                (got, want) => panic!("{text}: got {got:?}, want {want:?}"),
            }
        }
    }
}
