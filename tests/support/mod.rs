//! Test support for integration tests against a real local control plane.
//!
//! Each test binary runs under its own `main` (`harness = false`): [`run`] starts ONE cluster through
//! `e2e/cluster.sh up` (or reuses the one `KUBECONFIG` points at, when that is a gpu-dra e2e cluster), gives every
//! test its own namespace and a fresh client, and stops the cluster when all tests are done. The cluster's
//! watchdog (`GPU_DRA_E2E_OWNER_PID`) stops it too if the test process is killed.
//!
//! Without a cluster (no Go, no binaries) the tests are reported as ignored with the reason, except under CI
//! (`CI` set), where that is a failure.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different part of this module.

pub mod api_proxy;
pub mod cluster;
pub mod harness;
pub mod measure;
pub mod node;
pub mod objects;
pub mod pod_resources;
pub mod podgroup;
pub mod process;
pub mod real_node;
pub mod wait;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, PostParams};
use libtest_mimic::{Arguments, Failed, Trial};

pub use cluster::Cluster;

/// A binary `e2e/build-k8s.sh` builds into the cache (`kubectl`, `kubelet`, `helm`, …), found through the
/// directories it prints; missing is an error that says how to build it.
pub fn k8s_tool(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/build-k8s.sh");
    let output = std::process::Command::new(script)
        .arg("--print-bin-dirs")
        .output()
        .context("run e2e/build-k8s.sh --print-bin-dirs")?;
    let dirs = String::from_utf8(output.stdout)?;
    // One line each: Kubernetes, etcd, helm.
    let line = match name {
        "helm" => 2,
        "etcd" => 1,
        _ => 0,
    };
    let dir = dirs.lines().nth(line).context("build-k8s.sh printed fewer bin directories than expected")?;
    let path = std::path::Path::new(dir).join(name);
    anyhow::ensure!(path.exists(), "{} is missing: run e2e/build-k8s.sh", path.display());
    Ok(path)
}

/// The release binary (`make release`; `make test` builds it first), in the target directory these tests were
/// built in (wherever `CARGO_TARGET_DIR` or cargo's configuration put it).
pub fn release_binary() -> std::path::PathBuf {
    let test_build = std::path::Path::new(env!("CARGO_BIN_EXE_gpu-dra"));
    let target = test_build.parent().and_then(std::path::Path::parent).unwrap_or(std::path::Path::new("target"));
    target.join("release/gpu-dra")
}

/// What a test gets: a client with admin rights, a namespace of its own, and the cluster.
#[derive(Clone)]
pub struct TestContext {
    pub client: kube::Client,
    pub namespace: String,
    pub cluster: Arc<Cluster>,
}

impl std::fmt::Debug for TestContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestContext").field("namespace", &self.namespace).finish()
    }
}

type TestFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// One integration test: a name and an async body.
#[derive(Clone, Copy)]
pub struct Test {
    pub name: &'static str,
    pub body: fn(TestContext) -> TestFuture,
}

/// `test!(my_async_fn)` registers `async fn my_async_fn(ctx: TestContext) -> anyhow::Result<()>`.
#[macro_export]
macro_rules! test {
    ($f:ident) => {
        $crate::support::Test { name: stringify!($f), body: |ctx| Box::pin($f(ctx)) }
    };
}

/// The longest a single test may run before it is failed (a hung watch must not hang CI).
const TEST_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs `tests` against one shared cluster and exits with libtest's status.
pub fn run(binary: &str, tests: &[Test]) -> ! {
    run_with_env(binary, false, &[], tests)
}

/// Like [`run`]; `kcm_claim_controller` starts the cluster with kube-controller-manager's claim controller.
pub fn run_with(binary: &str, kcm_claim_controller: bool, tests: &[Test]) -> ! {
    run_with_env(binary, kcm_claim_controller, &[], tests)
}

/// Like [`run_with`], passing `env` to `e2e/cluster.sh up` (e.g. more kube-controller-manager controllers).
pub fn run_with_env(binary: &str, kcm_claim_controller: bool, env: &[(&str, &str)], tests: &[Test]) -> ! {
    run_on(binary, tests, Pace::default(), || Cluster::start_with(binary, kcm_claim_controller, env))
}

/// Runs `tests` one at a time, each up to `timeout`, on a control plane of the binary's own that a real node can
/// join (`e2e/cluster.sh up --for-real-node`). A machine that cannot run a real node (not root, node binaries
/// missing) is handled like a missing cluster: the tests are ignored, or fail under CI.
pub fn run_on_real_node_cluster(binary: &str, timeout: Duration, tests: &[Test]) -> ! {
    let pace = Pace { serial: true, timeout };
    run_on(binary, tests, pace, || {
        real_node::can_run()?;
        Cluster::start_own(binary, false, real_node::CLUSTER_ENV)
    })
}

/// How a binary's tests run: in parallel or one at a time, and how long each may take.
#[derive(Clone, Copy)]
struct Pace {
    serial: bool,
    timeout: Duration,
}

impl Default for Pace {
    fn default() -> Self {
        Self { serial: false, timeout: TEST_TIMEOUT }
    }
}

/// Like [`run`], on a cluster of the binary's own even when `KUBECONFIG` names a running one, one test at a time:
/// for tests that disturb the control plane (stop the API server, cut its connections), which would disturb each
/// other's measurements too.
pub fn run_on_own_cluster(binary: &str, tests: &[Test]) -> ! {
    let pace = Pace { serial: true, ..Pace::default() };
    run_on(binary, tests, pace, || Cluster::start_own(binary, false, &[]))
}

fn run_on(binary: &str, tests: &[Test], pace: Pace, start: impl FnOnce() -> anyhow::Result<Cluster>) -> ! {
    let mut args = Arguments::from_args();
    if pace.serial {
        args.test_threads = Some(1);
    }
    if args.list {
        let trials = tests.iter().map(|t| Trial::test(t.name, || Ok(()))).collect();
        libtest_mimic::run(&args, trials).exit();
    }
    let cluster = match start() {
        Ok(cluster) => Arc::new(cluster),
        // Only missing binaries (no Go here) make the tests ignored: a cluster that fails to start with them (a port
        // taken, etcd failing) is a failure, not a reason to report the tests as passing.
        Err(err) if std::env::var_os("CI").is_some() || cluster::build_binaries().is_ok() => {
            eprintln!("error: the test cluster could not be started: {err:#}");
            std::process::exit(1);
        }
        Err(err) => {
            eprintln!(
                "warning: no test cluster ({err:#}); the {} tests of {binary} are IGNORED. \
                 Run e2e/build-k8s.sh (needs Go and the module proxy) to build the binaries.",
                tests.len()
            );
            let trials = tests.iter().map(|t| Trial::test(t.name, || Ok(())).with_ignored_flag(true)).collect();
            libtest_mimic::run(&args, trials).exit();
        }
    };
    let trials = tests
        .iter()
        .map(|t| {
            let (test, cluster) = (*t, cluster.clone());
            Trial::test(t.name, move || run_one(test, cluster, pace.timeout))
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if let Err(err) = cluster.stop() {
        eprintln!("warning: stopping the test cluster: {err:#}");
    }
    conclusion.exit()
}

fn run_one(test: Test, cluster: Arc<Cluster>, timeout: Duration) -> Result<(), Failed> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("build tokio runtime: {e}"))?;
    runtime.block_on(async move {
        let client = cluster.client().await.map_err(|e| format!("{e:#}"))?;
        let namespace = create_namespace(&client, test.name).await.map_err(|e| format!("{e:#}"))?;
        let ctx = TestContext { client: client.clone(), namespace: namespace.clone(), cluster };
        let result = tokio::time::timeout(timeout, (test.body)(ctx)).await;
        // Deleting the namespace is best effort: the cluster goes away at the end anyway.
        let _ = Api::<Namespace>::all(client).delete(&namespace, &DeleteParams::default()).await;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(format!("{err:#}").into()),
            Err(_) => Err(format!("timed out after {timeout:?}").into()),
        }
    })
}

/// Creates a namespace named after the test (or a test's second namespace, after `test_name`), with a random suffix
/// so that reruns against a reused cluster never collide; returns its name.
pub async fn create_namespace(client: &kube::Client, test_name: &str) -> anyhow::Result<String> {
    let name = unique_name(test_name);
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"gpu-dra.dev/test": "true"}}
    }))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("create test namespace {name}"))?;
    Ok(name)
}

/// A DNS label made from `base` plus a random six-hex-digit suffix.
pub fn unique_name(base: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default(),
    );
    let mut stem: String =
        base.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).take(48).collect();
    stem = stem.trim_matches('-').to_string();
    format!("{stem}-{:06x}", hasher.finish() & 0xff_ffff)
}

/// A test that needs the Kubernetes binaries but no shared cluster (it starts its own through the script).
#[derive(Clone, Copy)]
pub struct StandaloneTest {
    pub name: &'static str,
    pub body: fn() -> anyhow::Result<()>,
}

/// Runs tests that bring up clusters of their own, one at a time (two cores do not start several at once
/// reliably). Missing binaries are handled as in [`run`].
pub fn run_standalone(tests: &[StandaloneTest]) -> ! {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    let missing = cluster::build_binaries();
    let trials = tests
        .iter()
        .map(|t| {
            let body = t.body;
            let trial = Trial::test(t.name, move || body().map_err(|e| format!("{e:#}").into()));
            trial.with_ignored_flag(missing.is_err())
        })
        .collect();
    if let Err(err) = missing {
        if std::env::var_os("CI").is_some() && !args.list {
            eprintln!("error: CI is set and the Kubernetes binaries are not available: {err:#}");
            std::process::exit(1);
        }
        eprintln!("warning: {err:#}; these tests are IGNORED");
    }
    libtest_mimic::run(&args, trials).exit()
}
