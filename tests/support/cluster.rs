//! The shared test cluster, started and stopped through `e2e/cluster.sh` so that tests, the demo and developers
//! all run the very same control plane.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail, ensure};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// The kubeconfig context `e2e/cluster.sh` writes; only a cluster with this context is ever reused.
const E2E_CONTEXT: &str = "gpu-dra-e2e";

/// A running local control plane.
#[derive(Debug)]
pub struct Cluster {
    state_dir: PathBuf,
    /// Whether this process started the cluster (and so stops it).
    owned: bool,
}

impl Cluster {
    /// Reuses the cluster `KUBECONFIG` points at when it is a gpu-dra e2e cluster; starts one otherwise. With
    /// `kcm_claim_controller` it always starts its own, with kube-controller-manager's resourceclaim-controller.
    pub fn start(binary: &str, kcm_claim_controller: bool) -> anyhow::Result<Self> {
        Self::start_with(binary, kcm_claim_controller, &[])
    }

    /// Like [`Cluster::start`], passing `env` to `e2e/cluster.sh up` (e.g. `GPU_DRA_E2E_KCM_CONTROLLERS`).
    pub fn start_with(binary: &str, kcm_claim_controller: bool, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        if !kcm_claim_controller
            && env.is_empty()
            && let Some(state_dir) = reusable_state_dir()
        {
            eprintln!("reusing the test cluster in {}", state_dir.display());
            return Ok(Self { state_dir, owned: false });
        }
        Self::start_own(binary, kcm_claim_controller, env)
    }

    /// Starts a cluster of this process's own, never reusing a running one: for tests that disturb the control
    /// plane (stop the API server).
    pub fn start_own(binary: &str, kcm_claim_controller: bool, env: &[(&str, &str)]) -> anyhow::Result<Self> {
        let state_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cluster-{binary}"));
        let mut up = script();
        up.arg("up");
        if kcm_claim_controller {
            up.arg("--with-kcm-claim-controller");
        }
        up.envs(env.iter().copied());
        let status = up
            .env("GPU_DRA_E2E_DIR", &state_dir)
            .env("GPU_DRA_E2E_OWNER_PID", std::process::id().to_string())
            .stdout(Stdio::null())
            .status()
            .context("run e2e/cluster.sh up")?;
        if !status.success() {
            bail!("e2e/cluster.sh up failed ({status}); its output above says why");
        }
        Ok(Self { state_dir, owned: true })
    }

    /// Stops the cluster if this process started it.
    pub fn stop(&self) -> anyhow::Result<()> {
        if self.owned {
            self.script_command("down")?;
        }
        Ok(())
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.state_dir.join("kubeconfig")
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The pid `e2e/cluster.sh` recorded for `component` (`kube-apiserver`, `etcd`, …).
    pub fn pid(&self, component: &str) -> anyhow::Result<u32> {
        let pids = std::fs::read_to_string(self.state_dir.join("pids")).context("read the cluster's pids file")?;
        pids.lines()
            .find_map(|line| line.strip_prefix(component)?.strip_prefix(' ')?.trim().parse().ok())
            .with_context(|| format!("no pid recorded for {component}"))
    }

    /// The API server's URL, as the kubeconfig names it.
    pub fn server(&self) -> anyhow::Result<String> {
        let kubeconfig = Kubeconfig::read_from(self.kubeconfig()).context("read test kubeconfig")?;
        kubeconfig
            .clusters
            .iter()
            .find_map(|c| c.cluster.as_ref()?.server.clone())
            .context("the kubeconfig names no API server")
    }

    /// A client with the cluster's admin identity.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        let config = self.client_config().await?;
        {
            gpu_dra::kube_client::install_crypto_provider();
            kube::Client::try_from(config)
        }
        .context("build kube client")
    }

    /// The admin client configuration, for tests that derive other identities from it.
    pub async fn client_config(&self) -> anyhow::Result<kube::Config> {
        let kubeconfig = Kubeconfig::read_from(self.kubeconfig()).context("read test kubeconfig")?;
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .context("load test kubeconfig")
    }

    /// Creates a Ready Node object (no kubelet) that the scheduler will place pods on.
    pub fn add_node(&self, name: &str) -> anyhow::Result<()> {
        self.script_command_args(&["add-node", name])
    }

    /// Like [`Cluster::add_node`], with extra `KEY=VALUE` labels.
    pub fn add_node_labeled(&self, name: &str, labels: &[&str]) -> anyhow::Result<()> {
        let mut args = vec!["add-node", name];
        args.extend_from_slice(labels);
        self.script_command_args(&args)
    }

    fn script_command(&self, command: &str) -> anyhow::Result<()> {
        self.script_command_args(&[command])
    }

    fn script_command_args(&self, args: &[&str]) -> anyhow::Result<()> {
        let output = script()
            .args(args)
            .env("GPU_DRA_E2E_DIR", &self.state_dir)
            .output()
            .with_context(|| format!("run e2e/cluster.sh {}", args.join(" ")))?;
        if !output.status.success() {
            bail!("e2e/cluster.sh {} failed: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
        }
        Ok(())
    }
}

/// Builds (or finds cached) the Kubernetes binaries through `e2e/build-k8s.sh`.
pub fn build_binaries() -> anyhow::Result<()> {
    run_build_script("e2e/build-k8s.sh")
}

/// Runs one of the repository's build scripts (`e2e/build-*.sh`, which skip what is cached); its output goes to the
/// test's output, so a failure there says why.
pub fn run_build_script(script: &str) -> anyhow::Result<()> {
    let status = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join(script))
        .status()
        .with_context(|| format!("run {script}"))?;
    if !status.success() {
        bail!("{script} failed ({status}); its output above says why");
    }
    Ok(())
}

/// `e2e/cluster.sh` of this repository.
pub fn script() -> Command {
    Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/cluster.sh"))
}

/// The state directory of the cluster `KUBECONFIG` points at, when it is one `e2e/cluster.sh` made.
fn reusable_state_dir() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os("KUBECONFIG")?);
    let kubeconfig = Kubeconfig::read_from(&path).ok()?;
    if kubeconfig.current_context.as_deref() != Some(E2E_CONTEXT) || !path.ends_with("kubeconfig") {
        return None;
    }
    path.parent().map(Path::to_path_buf)
}

/// The Kubernetes version the tests run against: `K8S_VERSION` when set (as `e2e/versions.sh` and `make test-matrix`
/// take it), else the version `e2e/versions.sh` pins.
pub fn pinned_kubernetes_version() -> anyhow::Result<String> {
    if let Ok(version) = std::env::var("K8S_VERSION")
        && !version.is_empty()
    {
        return Ok(version);
    }
    let versions = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/versions.sh"))?;
    versions
        .lines()
        .find_map(|l| l.strip_prefix("K8S_DEFAULT_VERSION="))
        .map(|v| v.trim().to_string())
        .context("K8S_DEFAULT_VERSION not found in e2e/versions.sh")
}

/// The minor version of [`pinned_kubernetes_version`] (37 for v1.37.2): tests of a feature that older versions
/// lack or leave off assert what the README documents for the version they run against.
pub fn kubernetes_minor() -> anyhow::Result<u32> {
    let version = pinned_kubernetes_version()?;
    version
        .strip_prefix("v1.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|minor| minor.parse().ok())
        .with_context(|| format!("Kubernetes version {version:?} is not of the form v1.MINOR.PATCH"))
}

impl Cluster {
    /// Writes a kubeconfig that authenticates with `token` (e.g. a ServiceAccount's) and returns its path.
    pub fn kubeconfig_for_token(&self, name: &str, token: &str) -> anyhow::Result<PathBuf> {
        let mut kubeconfig = Kubeconfig::read_from(self.kubeconfig()).context("read admin kubeconfig")?;
        let auth = kube::config::AuthInfo { token: Some(token.to_string().into()), ..Default::default() };
        kubeconfig.auth_infos = vec![kube::config::NamedAuthInfo {
            name: name.to_string(),
            auth_info: Some(auth),
            other: Default::default(),
        }];
        for context in kubeconfig.contexts.iter_mut().filter_map(|c| c.context.as_mut()) {
            context.user = Some(name.to_string());
        }
        let path = self.state_dir.join(format!("{name}.kubeconfig"));
        // JSON is YAML: every kubeconfig reader takes it.
        std::fs::write(&path, serde_json::to_string(&kubeconfig)?)?;
        Ok(path)
    }
}

/// `e2e/cluster.sh up`'s environment for a control plane that serves PodGroups with claims (KEP-5729):
/// `GenericWorkload` + `DRAWorkloadResourceClaims`, `scheduling.k8s.io/v1beta1`, and kube-controller-manager's
/// `podgroup-protection-controller`, which removes the `scheduling.k8s.io/podgroup-protection` finalizer the API
/// server puts on every PodGroup once no pod uses it, as in any cluster with the gate on.
pub const PODGROUP_CLUSTER_ENV: [(&str, &str); 3] = [
    ("GPU_DRA_E2E_FEATURE_GATES", "GenericWorkload=true,DRAWorkloadResourceClaims=true"),
    ("GPU_DRA_E2E_RUNTIME_CONFIG", "scheduling.k8s.io/v1beta1=true"),
    ("GPU_DRA_E2E_KCM_CONTROLLERS", "podgroup-protection-controller"),
];

impl Cluster {
    /// Restarts kube-apiserver with `flags` added to its command line, as an operator enabling an API or a
    /// feature gate does: a flag it has already gets the value appended (`,`-separated, as for `--feature-gates`
    /// and `--runtime-config`), any other is added. Same etcd, port and certificates; the new process is
    /// recorded in the cluster's pids file in place of the old one, so `down` (and the watchdog) stop it. Waits
    /// until it is ready. Blocking: call it from `spawn_blocking`.
    pub fn restart_api_server_with(&self, flags: &[(&str, &str)]) -> anyhow::Result<()> {
        use std::time::{Duration, Instant};
        let old = self.pid("kube-apiserver")?;
        let cmdline = std::fs::read(format!("/proc/{old}/cmdline")).context("read kube-apiserver's command line")?;
        let mut args: Vec<String> = (cmdline.split(|b| *b == 0))
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        for (flag, value) in flags {
            match args.iter().position(|a| a == flag) {
                Some(at) if at + 1 < args.len() => args[at + 1] = format!("{},{value}", args[at + 1]),
                _ => args.extend([flag.to_string(), value.to_string()]),
            }
        }
        // As `cluster.sh down` stops it: SIGTERM, and SIGKILL after 5 s (its graceful shutdown can hang on open
        // watches). Gone, or a zombie, counts as stopped (whoever reaps orphans here may never do it).
        let stopped = || std::fs::read_to_string(format!("/proc/{old}/stat")).map_or(true, |s| s.contains(") Z "));
        for (signal, wait) in [("-TERM", Duration::from_secs(5)), ("-KILL", Duration::from_secs(10))] {
            let status = Command::new("kill").args([signal, &old.to_string()]).status().context("run kill")?;
            ensure!(status.success() || stopped(), "kill {signal} {old}: {status}");
            let until = Instant::now() + wait;
            while !stopped() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(100));
            }
            if stopped() {
                break;
            }
        }
        ensure!(stopped(), "kube-apiserver (pid {old}) did not stop on SIGTERM nor SIGKILL");
        // Detached as `cluster.sh` starts it (its parent exits at once, so init reaps it), logging to the same file.
        let log_path = self.state_dir.join("logs/kube-apiserver.log");
        let started = Command::new("bash")
            .args(["-c", r#"log=$1; shift; setsid "$@" >>"$log" 2>&1 </dev/null & echo $!"#, "bash"])
            .arg(&log_path)
            .args(&args)
            .output()
            .context("start kube-apiserver again")?;
        ensure!(
            started.status.success(),
            "starting kube-apiserver again: {}",
            String::from_utf8_lossy(&started.stderr)
        );
        let new: u32 =
            String::from_utf8_lossy(&started.stdout).trim().parse().context("the new kube-apiserver's pid")?;
        let pids_path = self.state_dir.join("pids");
        let pids = std::fs::read_to_string(&pids_path)?;
        let replaced: Vec<String> = pids
            .lines()
            .map(|l| if l == format!("kube-apiserver {old}") { format!("kube-apiserver {new}") } else { l.to_string() })
            .collect();
        std::fs::write(&pids_path, replaced.join("\n") + "\n")?;

        let ready = format!("{}/readyz", self.server()?.trim_end_matches('/'));
        let pki = self.state_dir.join("pki");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ok = Command::new("curl")
                .args(["-fsS", "--max-time", "2", "--cacert"])
                .arg(pki.join("ca.crt"))
                .arg("--cert")
                .arg(pki.join("admin.crt"))
                .arg("--key")
                .arg(pki.join("admin.key"))
                .arg(&ready)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                bail!("kube-apiserver was not ready again within 60s; its log ends:\n{}", tail.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
