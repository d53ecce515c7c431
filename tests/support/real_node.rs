//! A real node for end-to-end tests: `e2e/node.sh` starts containerd, a kubelet and kube-proxy joined to the
//! test cluster (started with `GPU_DRA_E2E_REAL_NODE=1`), and imports the images `e2e/build-images.sh` made.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

use super::Cluster;

/// The environment `e2e/cluster.sh up` needs for a control plane a real node can join.
pub const CLUSTER_ENV: &[(&str, &str)] = &[("GPU_DRA_E2E_REAL_NODE", "1")];

/// A node `e2e/node.sh up` started; [`RealNode::down`] (or the cluster's `down`) undoes it.
#[derive(Debug)]
pub struct RealNode {
    pub name: String,
    state_dir: PathBuf,
    env: HashMap<String, String>,
}

impl RealNode {
    /// Starts node `name` on `cluster`.
    pub fn up(cluster: &Cluster, name: &str) -> anyhow::Result<Self> {
        let output = script(cluster.state_dir(), &["up", name])?;
        let env = output
            .lines()
            .filter_map(|line| line.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim_matches('\'').to_string()))
            .collect();
        Ok(Self { name: name.to_string(), state_dir: cluster.state_dir().to_path_buf(), env })
    }

    fn path(&self, key: &str) -> anyhow::Result<PathBuf> {
        self.env.get(key).map(PathBuf::from).with_context(|| format!("e2e/node.sh up printed no {key}"))
    }

    /// The kubelet's `--root-dir` (the chart's `nodeAgent.kubeletDir`).
    pub fn kubelet_dir(&self) -> anyhow::Result<PathBuf> {
        self.path("GPU_DRA_NODE_KUBELET_DIR")
    }

    /// The directory containerd reads CDI specs from (the chart's `nodeAgent.cdiDir`).
    pub fn cdi_dir(&self) -> anyhow::Result<PathBuf> {
        self.path("GPU_DRA_NODE_CDI_DIR")
    }

    /// A directory for the agent's state (the chart's `nodeAgent.stateDir`).
    pub fn agent_state_dir(&self) -> anyhow::Result<PathBuf> {
        self.path("GPU_DRA_NODE_STATE_DIR")
    }

    /// The agent's MPS directory: beside its state directory, not in it (the agent refuses an MPS directory inside
    /// another of its own).
    pub fn agent_mps_dir(&self) -> anyhow::Result<PathBuf> {
        let state = self.agent_state_dir()?;
        Ok(PathBuf::from(format!("{}-mps", state.display())))
    }

    /// Imports OCI image archives into the node's containerd.
    pub fn import(&self, archives: &[PathBuf]) -> anyhow::Result<()> {
        let mut args = vec!["import".to_string(), self.name.clone()];
        args.extend(archives.iter().map(|a| a.display().to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        script(&self.state_dir, &args).map(drop)
    }

    /// `crictl ARGS…` against the node's containerd: its standard output.
    pub fn crictl(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all = vec!["crictl", self.name.as_str()];
        all.extend_from_slice(args);
        script(&self.state_dir, &all)
    }

    /// Takes the node down, undoing every change `up` made.
    pub fn down(&self) -> anyhow::Result<()> {
        script(&self.state_dir, &["down", &self.name]).map(drop)
    }
}

/// `e2e/node.sh down name` on `cluster`, for a node a test may or may not have started (nothing to take down is
/// no error).
pub fn down_named(cluster: &Cluster, name: &str) -> anyhow::Result<()> {
    script(cluster.state_dir(), &["down", name]).map(drop)
}

fn script(state_dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/node.sh"))
        .args(args)
        .env("GPU_DRA_E2E_DIR", state_dir)
        .output()
        .with_context(|| format!("run e2e/node.sh {}", args.join(" ")))?;
    if !output.status.success() {
        bail!("e2e/node.sh {} failed: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Whether this machine can run a real node: root, and the binaries `e2e/build-node.sh` builds. `Err` says what is
/// missing and how to get it.
pub fn can_run() -> anyhow::Result<()> {
    // The effective uid, from /proc: no libc binding needed for one number.
    let status = std::fs::read_to_string("/proc/self/status").context("read /proc/self/status")?;
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .context("no Uid line in /proc/self/status")?;
    if euid != "0" {
        bail!("a real node needs root (mounts, network namespaces, cgroups); this test runs as uid {euid}");
    }
    super::cluster::run_build_script("e2e/build-node.sh")
}
