//! The kubelet side of a fake node: `gpu-dra-kubelet-harness` (e2e/kubelet-harness), which runs the real kubelet's
//! plugin watcher and DRA manager from the `k8s.io/kubernetes` module for one node. Its stdout is one JSON event
//! per line (`registered`, `prepared`, `unprepared`, …), collected here for tests to wait on.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde_json::Value;

use super::node::NodeDirs;
use super::{TestContext, wait};

/// Builds the harness once per test process (cached outside the repository, keyed by its sources).
pub fn binary() -> anyhow::Result<PathBuf> {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    build_once(&BINARY, "build-kubelet-harness.sh")
}

/// Runs `e2e/<script>` once per test process (`once` remembers the outcome) and returns the path it prints on
/// its last line: what it built, or found in its cache.
pub fn build_once(once: &OnceLock<Result<PathBuf, String>>, script: &str) -> anyhow::Result<PathBuf> {
    once.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e").join(script);
        let output = Command::new(&script).stderr(Stdio::inherit()).output().map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        match stdout.lines().last() {
            Some(path) if output.status.success() => Ok(PathBuf::from(path.trim())),
            _ => Err(format!("{} failed ({})", script.display(), output.status)),
        }
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// A running harness for one node.
#[derive(Debug)]
pub struct KubeletHarness {
    child: Child,
    events: Arc<Mutex<Vec<Value>>>,
    pub log: PathBuf,
}

impl KubeletHarness {
    /// Starts the kubelet side of `node`, watching the registry directory of `dirs`.
    pub fn start(ctx: &TestContext, node: &str, dirs: &NodeDirs) -> anyhow::Result<Self> {
        Self::start_watching(ctx, node, &dirs.registry(), &dirs.kubelet_state())
    }

    /// Starts the kubelet side of `node`, watching `registry` (the kubelet's plugins_registry) and keeping its own
    /// state in `state` (its log beside it).
    pub fn start_watching(ctx: &TestContext, node: &str, registry: &Path, state: &Path) -> anyhow::Result<Self> {
        Self::start_with(ctx, node, registry, state, &[])
    }

    /// Like [`KubeletHarness::start_watching`], with more harness flags (e.g. `--feature-gates`).
    pub fn start_with(
        ctx: &TestContext,
        node: &str,
        registry: &Path,
        state: &Path,
        flags: &[&str],
    ) -> anyhow::Result<Self> {
        let log = state.with_extension("log");
        let mut child = Command::new(binary()?)
            .args(flags)
            .arg("--kubeconfig")
            .arg(ctx.cluster.kubeconfig())
            .args(["--node-name", node])
            .arg("--registry-dir")
            .arg(registry)
            .arg("--state-dir")
            .arg(state)
            .arg("--log-file")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("start gpu-dra-kubelet-harness")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(event) = serde_json::from_str::<Value>(&line) {
                    sink.lock().unwrap_or_else(PoisonError::into_inner).push(event);
                }
            }
        });
        Ok(Self { child, events, log })
    }

    /// Every event so far.
    pub fn events(&self) -> Vec<Value> {
        self.events.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Waits for the first event named `event` about `pod` (`namespace/name`; empty: any) after the first `skip`
    /// such events.
    pub async fn wait_for(&self, event: &str, pod: &str, timeout: Duration) -> anyhow::Result<Value> {
        let found = wait::until(&format!("harness event {event} {pod}"), timeout, || async {
            Ok(self.events().into_iter().find(|e| e["event"] == event && (pod.is_empty() || e["pod"] == pod)))
        })
        .await;
        found.with_context(|| format!("harness events: {:?}\nlog tail:\n{}", self.events(), self.log_tail()))
    }

    /// How many events named `event` about `pod` arrived.
    pub fn count(&self, event: &str, pod: &str) -> usize {
        self.events().iter().filter(|e| e["event"] == event && e["pod"] == pod).count()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGKILL (a kubelet crash) and wait.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// Fails when the harness exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("the kubelet harness exited ({status}):\n{}", self.log_tail());
        }
        Ok(())
    }
}

impl Drop for KubeletHarness {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
