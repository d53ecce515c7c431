//! The `gpu-dra` binary as a real process under test: started with the test cluster's kubeconfig, logging to a
//! file, its /metrics and /readyz read over HTTP, and killed or terminated on demand.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::cluster::Cluster;
use super::{TestContext, wait};

/// What a pod's service account gives its containers: a token and the namespace (the CA is the cluster's).
#[derive(Debug)]
pub struct InClusterAccount {
    pub token: String,
    pub namespace: String,
}

/// A running `gpu-dra` component.
#[derive(Debug)]
pub struct Component {
    child: Child,
    pub metrics_addr: SocketAddr,
    pub log: PathBuf,
}

impl Component {
    /// Starts `gpu-dra controller` for the test's namespace (its own watches, no leader election unless `args`
    /// turn it on) and waits until it is ready.
    pub async fn controller(ctx: &TestContext, args: &[&str]) -> anyhow::Result<Self> {
        let mut all = vec!["controller", "--namespace", ctx.namespace.as_str()];
        if !args.iter().any(|a| a.starts_with("--leader-elect")) {
            all.push("--leader-elect=false");
        }
        all.extend_from_slice(args);
        let component = Self::start(&ctx.cluster.kubeconfig(), &ctx.namespace, &all)?;
        component.wait_ready().await?;
        Ok(component)
    }

    /// Starts `gpu-dra ARGS… --metrics-addr <free port>` with `kubeconfig`; does not wait.
    pub fn start(kubeconfig: &std::path::Path, log_name: &str, args: &[&str]) -> anyhow::Result<Self> {
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpu-dra"));
        command.args(args).env("KUBECONFIG", kubeconfig);
        Self::spawn(command, log_name)
    }

    /// Starts `gpu-dra ARGS…` the way a pod runs it: no kubeconfig anywhere (`KUBECONFIG` unset, an empty
    /// `HOME`), the service account's token, CA certificate and namespace in
    /// `/var/run/secrets/kubernetes.io/serviceaccount`, and `KUBERNETES_SERVICE_HOST`/`_PORT` naming the API
    /// server. The files are put there inside a private mount namespace (`unshare --user --mount` with a tmpfs on
    /// /run), so the machine's own /run is never touched. Does not wait.
    pub fn start_in_cluster(
        cluster: &Cluster,
        account: &InClusterAccount,
        log_name: &str,
        args: &[&str],
    ) -> anyhow::Result<Self> {
        let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("in-cluster").join(log_name);
        let secrets = root.join("serviceaccount");
        let home = root.join("home");
        std::fs::create_dir_all(&secrets)?;
        std::fs::create_dir_all(&home)?;
        std::fs::write(secrets.join("token"), &account.token)?;
        std::fs::write(secrets.join("namespace"), &account.namespace)?;
        std::fs::copy(cluster.state_dir().join("pki/ca.crt"), secrets.join("ca.crt")).context("copy the cluster CA")?;
        let server = cluster.server()?;
        let (host, port) = server
            .strip_prefix("https://")
            .and_then(|hp| hp.trim_end_matches('/').rsplit_once(':'))
            .with_context(|| format!("API server address {server:?} is not https://HOST:PORT"))?;
        const MOUNT: &str = "mount -t tmpfs tmpfs /run && mkdir -p /run/secrets/kubernetes.io && \
                             cp -r \"$0\" /run/secrets/kubernetes.io/serviceaccount && exec \"$@\"";
        let mut command = Command::new("unshare");
        command
            .args(["--user", "--map-root-user", "--mount", "--", "sh", "-c", MOUNT])
            .arg(&secrets)
            .arg(env!("CARGO_BIN_EXE_gpu-dra"))
            .args(args)
            .env_remove("KUBECONFIG")
            .env("HOME", &home)
            .env("KUBERNETES_SERVICE_HOST", host)
            .env("KUBERNETES_SERVICE_PORT", port);
        Self::spawn(command, log_name)
    }

    /// Runs `command` (the binary and its arguments) with a free metrics address, logging to a fresh file.
    fn spawn(mut command: Command, log_name: &str) -> anyhow::Result<Self> {
        let metrics_addr = free_addr()?;
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("logs");
        std::fs::create_dir_all(&dir)?;
        let mut n = 0;
        let log = loop {
            let candidate = dir.join(format!("{log_name}-{n}.log"));
            if !candidate.exists() {
                break candidate;
            }
            n += 1;
        };
        let out = std::fs::File::create(&log)?;
        let child = command
            .arg("--metrics-addr")
            .arg(metrics_addr.to_string())
            .env("GPU_DRA_LOG", "info,gpu_dra=debug")
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("start gpu-dra")?;
        Ok(Self { child, metrics_addr, log })
    }

    pub async fn wait_ready(&self) -> anyhow::Result<()> {
        wait::until("the component to be ready", Duration::from_secs(30), || async {
            Ok(self.get("/readyz").await.ok().filter(|(code, _)| *code == 200).map(|_| ()))
        })
        .await
        .with_context(|| format!("log:\n{}", self.log_tail()))
    }

    /// `GET path` on the metrics address: (status code, body).
    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let mut stream = tokio::net::TcpStream::connect(self.metrics_addr).await?;
        stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes()).await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        let code = response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).context("no status line")?;
        let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Ok((code, body))
    }

    /// The value of the first sample of `metric` whose labels contain every `labels` pair; 0 when absent.
    pub async fn metric(&self, metric: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
        let (_, body) = self.get("/metrics").await?;
        Ok(sample(&body, metric, labels).unwrap_or(0.0))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: the process gets no chance to clean up.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// SIGTERM and wait for the exit status.
    pub fn terminate(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status()?;
        if !status.success() {
            bail!("kill -TERM failed");
        }
        Ok(self.child.wait()?)
    }

    /// Whether the process has exited (and with what).
    pub fn try_wait(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        Ok(self.child.try_wait()?)
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_addr() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// Finds a sample in Prometheus text output.
pub fn sample(body: &str, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let (name_labels, value) = line.rsplit_once(' ')?;
        let (name, label_text) = match name_labels.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (name_labels, ""),
        };
        let matches =
            name == metric && labels.iter().all(|(k, v)| label_text.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
        if matches { value.parse().ok() } else { None }
    })
}
