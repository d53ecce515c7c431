//! A node for the node agent without a real kubelet: the directories a kubelet and container runtime would share
//! with it, the agent process, and a kubelet stand-in that speaks the real plugin protocol over the unix sockets
//! (registration as the kubelet's plugin watcher does it, then NodePrepareResources / NodeUnprepareResources).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use gpu_dra::kubelet_plugin::proto::dra_v1 as v1;
use gpu_dra::kubelet_plugin::proto::dra_v1beta1 as v1beta1;
use gpu_dra::kubelet_plugin::proto::registration::registration_client::RegistrationClient;
use gpu_dra::kubelet_plugin::proto::registration::{InfoRequest, RegistrationStatus};
use gpu_dra::kubelet_plugin::socket::dial;

use super::process::Component;
use super::{TestContext, wait};

pub const DRIVER: &str = "gpu.gpu-dra.dev";

/// The requests whose device metadata a container was handed, from its CDI ids (`<driver>/gpu=<claim UID>_<request>`),
/// as (claim UID, request).
pub fn metadata_requests(ids: &[String]) -> Vec<(String, String)> {
    ids.iter()
        .filter_map(|id| id.split_once('=').map(|(_, device)| device))
        .filter_map(|device| device.split_at_checked(36))
        .filter_map(|(uid, rest)| rest.strip_prefix('_').map(|request| (uid.to_string(), request.to_string())))
        .collect()
}

/// A container's CDI ids without those of device metadata mounts: its GPUs'. Checks that it got the metadata of a
/// request of each claim whose GPUs it got, and none of a claim it got no GPU of.
pub fn gpu_cdi_ids(ids: &[String]) -> anyhow::Result<Vec<String>> {
    let metadata = metadata_requests(ids);
    let gpus: Vec<String> =
        ids.iter().filter(|id| !metadata.iter().any(|(u, r)| id.ends_with(&format!("{u}_{r}")))).cloned().collect();
    let claim_of = |id: &String| id.split_once('=').and_then(|(_, d)| d.get(..36)).unwrap_or_default().to_string();
    let with_gpus: std::collections::BTreeSet<String> = gpus.iter().map(claim_of).collect();
    let with_metadata: std::collections::BTreeSet<String> = metadata.iter().map(|(u, _)| u.clone()).collect();
    ensure!(with_gpus == with_metadata, "CDI ids {ids:?}: GPUs of claims {with_gpus:?}, metadata of {with_metadata:?}");
    Ok(gpus)
}

/// The per-node directories, under a short temporary path (unix socket paths must stay under 108 bytes).
#[derive(Debug)]
pub struct NodeDirs {
    root: tempfile::TempDir,
}

/// What a killed agent left: its claims' MPS daemons and their servers (each in a process group of its own, as in
/// the agent's container, where they end with the container; here they would outlive the test, their pipe
/// directories gone), and their tmpfs mounts (the directories could not be removed under them).
impl Drop for NodeDirs {
    fn drop(&mut self) {
        for pid in processes_with_mps_pipes_under(self.root.path()) {
            let _ = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
        for mount in mounts_under(self.root.path()).into_iter().rev() {
            let _ = std::process::Command::new("umount").arg("-l").arg(&mount).status();
        }
    }
}

/// Processes whose `CUDA_MPS_PIPE_DIRECTORY` lies under `dir`: MPS daemons and servers, and their clients.
fn processes_with_mps_pipes_under(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_string_lossy().parse::<u32>().ok()?;
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            environ
                .split(|&b| b == 0)
                .filter_map(|var| std::str::from_utf8(var).ok()?.strip_prefix("CUDA_MPS_PIPE_DIRECTORY="))
                .any(|pipes| Path::new(pipes).starts_with(dir))
                .then_some(pid)
        })
        .collect()
}

/// The mount points under `dir` (in mount order), from `/proc/self/mountinfo`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|mount| mount.starts_with(dir) && mount != dir)
        .collect()
}

impl NodeDirs {
    pub fn new() -> anyhow::Result<Self> {
        Ok(Self { root: tempfile::Builder::new().prefix("gd-").tempdir_in("/tmp")? })
    }
    pub fn registry(&self) -> PathBuf {
        self.root.path().join("registry")
    }
    pub fn plugins(&self) -> PathBuf {
        self.root.path().join("plugins")
    }
    pub fn cdi(&self) -> PathBuf {
        self.root.path().join("cdi")
    }
    pub fn state(&self) -> PathBuf {
        self.root.path().join("state")
    }
    /// Where claims' MPS daemons keep their directories (`--mps-dir`).
    pub fn mps(&self) -> PathBuf {
        self.root.path().join("mps")
    }
    pub fn checkpoint(&self) -> PathBuf {
        self.state().join("checkpoint.json")
    }
    /// The kubelet harness's own state (its DRA manager checkpoint).
    pub fn kubelet_state(&self) -> PathBuf {
        self.root.path().join("kubelet")
    }
    pub fn boot_id_file(&self) -> PathBuf {
        self.root.path().join("boot_id")
    }
    /// The agent's registration socket now in the registry directory (`<driver>-reg.sock`, or `<driver>.reg.sock`
    /// where an earlier agent left the first); a path that does not exist when there is none.
    pub fn registration_socket(&self) -> PathBuf {
        registration_socket_in(&self.registry()).unwrap_or_else(|| self.registry().join(format!("{DRIVER}-reg.sock")))
    }
    pub fn dra_socket(&self) -> PathBuf {
        self.plugins().join(DRIVER).join("dra.sock")
    }
    /// The CDI spec files now in the CDI directory, sorted.
    pub fn cdi_specs(&self) -> anyhow::Result<Vec<String>> {
        let mut names: Vec<String> = match std::fs::read_dir(self.cdi()) {
            Ok(entries) => entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        names.sort();
        Ok(names)
    }
    /// What each simulated GPU's time slice is now, by device name (absent: `Default`).
    pub fn time_slices(&self) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
        self.simulated_settings("simulated-time-slices.json")
    }
    /// The simulated GPUs' compute modes (device name → mode; absent: Default).
    pub fn compute_modes(&self) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
        self.simulated_settings("simulated-compute-modes.json")
    }
    fn simulated_settings(&self, file: &str) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
        match std::fs::read(self.state().join(file)) {
            Ok(bytes) => Ok(serde_json::from_slice(&bytes)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Default::default()),
            Err(e) => Err(e.into()),
        }
    }
    /// The spec file of claim `uid`.
    pub fn cdi_spec(&self, uid: &str) -> PathBuf {
        self.cdi().join(format!("{DRIVER}-gpu_{uid}.json"))
    }
    fn args(&self) -> anyhow::Result<Vec<String>> {
        if !self.boot_id_file().exists() {
            std::fs::write(self.boot_id_file(), "boot-1\n")?;
        }
        let flag = |name: &str, path: PathBuf| [format!("--{name}"), path.to_string_lossy().into_owned()];
        Ok([
            flag("kubelet-registry-dir", self.registry()),
            flag("kubelet-plugins-dir", self.plugins()),
            flag("cdi-dir", self.cdi()),
            flag("state-dir", self.state()),
            flag("mps-dir", self.mps()),
            flag("boot-id-file", self.boot_id_file()),
        ]
        .concat())
    }
}

/// Starts `gpu-dra node-agent` for `node` with its directories in `dirs`; does not wait.
pub fn start_agent(ctx: &TestContext, node: &str, dirs: &NodeDirs, extra: &[&str]) -> anyhow::Result<Component> {
    start_agent_with(&ctx.cluster.kubeconfig(), &format!("{}-agent", ctx.namespace), node, dirs, extra)
}

/// [`start_agent`] with another kubeconfig (e.g. one naming an API server that does not answer) and log name.
pub fn start_agent_with(
    kubeconfig: &Path,
    log_name: &str,
    node: &str,
    dirs: &NodeDirs,
    extra: &[&str],
) -> anyhow::Result<Component> {
    let dir_args = dirs.args()?;
    let mut args = vec!["node-agent", "--node-name", node];
    if !extra.contains(&"--driver-name") {
        args.extend(["--driver-name", DRIVER]);
    }
    args.extend(dir_args.iter().map(String::as_str));
    args.extend_from_slice(extra);
    Component::start(kubeconfig, log_name, &args)
}

/// The kubelet's side of the plugin protocol.
#[derive(Debug)]
pub struct Kubelet {
    pub info: gpu_dra::kubelet_plugin::proto::registration::PluginInfo,
    pub v1: v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>,
    pub v1beta1: v1beta1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>,
}

impl Kubelet {
    /// Registers the plugin as the kubelet does: waits for the registration socket, GetInfo, checks the answer,
    /// dials the announced endpoint, reports success.
    pub async fn register(dirs: &NodeDirs) -> anyhow::Result<Self> {
        let socket = wait::until("the registration socket", Duration::from_secs(30), || async {
            Ok(registration_socket_in(&dirs.registry()))
        })
        .await?;
        let mut registration = RegistrationClient::new(dial(&socket).await?);
        let info = registration.get_info(InfoRequest {}).await?.into_inner();
        ensure!(info.r#type == "DRAPlugin" && info.name == DRIVER, "plugin info {info:?}");
        let endpoint = Path::new(&info.endpoint);
        ensure!(endpoint.exists(), "announced endpoint {endpoint:?} does not exist");
        let v1 = v1::dra_plugin_client::DraPluginClient::new(dial(endpoint).await?);
        let v1beta1 = v1beta1::dra_plugin_client::DraPluginClient::new(dial(endpoint).await?);
        registration
            .notify_registration_status(RegistrationStatus { plugin_registered: true, error: String::new() })
            .await?;
        Ok(Self { info, v1, v1beta1 })
    }

    /// NodePrepareResources (v1) for `claims` (namespace, name, uid): the answer per claim UID.
    pub async fn prepare(
        &mut self,
        claims: &[(&str, &str, &str)],
    ) -> anyhow::Result<HashMap<String, v1::NodePrepareResourceResponse>> {
        let request = v1::NodePrepareResourcesRequest { claims: claims.iter().map(claim).collect() };
        let response = self.v1.node_prepare_resources(request).await.context("NodePrepareResources")?.into_inner();
        ensure!(
            response.claims.len() == claims.len(),
            "answers for {} of {} claims",
            response.claims.len(),
            claims.len()
        );
        Ok(response.claims)
    }

    /// NodeUnprepareResources (v1): the error per claim UID (empty = success).
    pub async fn unprepare(&mut self, claims: &[(&str, &str, &str)]) -> anyhow::Result<HashMap<String, String>> {
        let request = v1::NodeUnprepareResourcesRequest { claims: claims.iter().map(claim).collect() };
        let response = self.v1.node_unprepare_resources(request).await.context("NodeUnprepareResources")?.into_inner();
        ensure!(
            response.claims.len() == claims.len(),
            "answers for {} of {} claims",
            response.claims.len(),
            claims.len()
        );
        Ok(response.claims.into_iter().map(|(uid, r)| (uid, r.error)).collect())
    }
}

fn claim((namespace, name, uid): &(&str, &str, &str)) -> v1::Claim {
    v1::Claim { namespace: namespace.to_string(), name: name.to_string(), uid: uid.to_string() }
}

/// An agent together with its node's directories (removed when it is dropped).
#[derive(Debug)]
pub struct NodeAgent {
    pub process: Component,
    pub dirs: NodeDirs,
}

impl NodeAgent {
    pub fn start(ctx: &TestContext, node: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let dirs = NodeDirs::new()?;
        Ok(Self { process: start_agent(ctx, node, &dirs, extra)?, dirs })
    }
}

impl std::ops::Deref for NodeAgent {
    type Target = Component;
    fn deref(&self) -> &Component {
        &self.process
    }
}

impl std::ops::DerefMut for NodeAgent {
    fn deref_mut(&mut self) -> &mut Component {
        &mut self.process
    }
}

/// Injects `line` (`<gpu> xid <n>`, …) into the simulated GPUs' fault file of the agent whose state directory is
/// `state`, as an operator would: the file appears whole (written aside, renamed into place).
pub fn inject_fault(state: &Path, line: &str) -> anyhow::Result<()> {
    let aside = state.join("inject-faults.writing");
    std::fs::write(&aside, format!("{line}\n"))?;
    std::fs::rename(&aside, state.join("inject-faults"))?;
    Ok(())
}

/// A GPU minor that two CDI spec files in `cdi_dir` name (a device's `deviceNodes` path `/dev/nvidia<minor>`). Only
/// for nodes of whole GPUs: MIG devices and shares by memory name their GPU's node in each of their claims' specs.
pub fn gpu_in_two_specs(cdi_dir: &Path) -> anyhow::Result<Option<String>> {
    let mut seen = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(cdi_dir)? {
        let path = entry?.path();
        // What a runtime reads: `*.json`, not the agent's `.<name>.tmp-<pid>` files being written.
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        // A spec being replaced or removed may be gone between the listing and the read (renamed into place whole,
        // so one that is read parses).
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let spec: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("CDI spec {}", path.display()))?;
        let devices = spec["devices"].as_array().into_iter().flatten();
        let minors: std::collections::BTreeSet<String> = devices
            .flat_map(|device| device["containerEdits"]["deviceNodes"].as_array().into_iter().flatten())
            .filter_map(|node| node["path"].as_str()?.strip_prefix("/dev/nvidia"))
            .filter(|minor| !minor.is_empty() && minor.bytes().all(|b| b.is_ascii_digit()))
            .map(String::from)
            .collect();
        for minor in minors {
            if !seen.insert(minor.clone()) {
                return Ok(Some(minor));
            }
        }
    }
    Ok(None)
}

/// The registration socket of the driver's agent in `registry`, if there is one.
pub fn registration_socket_in(registry: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(registry).ok()?;
    entries
        .flatten()
        .find(|e| e.file_name().to_str().is_some_and(|n| gpu_dra::kubelet_plugin::is_registration_of(n, DRIVER)))
        .map(|e| e.path())
}
