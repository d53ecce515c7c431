//! Benchmark: NodePrepareResources through the real kubelet DRA code. The kubelet harness (e2e/kubelet-harness: the
//! plugin manager and DRA manager of `k8s.io/kubernetes`, one pod worker per pod as in a kubelet) prepares the claims
//! of pods that the real kube-scheduler allocated from the node agent's ResourceSlice (`gpu-dra node-agent`, release
//! build, 64 simulated H100s) and bound to the node. Measured per pod: the DRA manager's `PrepareResources` call as the
//! pod worker waits on it (the claim read from the API server, the gRPC NodePrepareResources with the agent's checkpoint
//! and CDI spec written with fsync, the kubelet's checkpoint), with 1, 10 and 50 pods created at once.
//!
//! Each round creates N claims of one GPU and N pods using them, waits until all N are prepared, then deletes the pods
//! (the harness unprepares them and removes them, as a kubelet does) and the claims. Rounds repeat until each level has
//! `GPU_DRA_BENCH_PREPARE_SAMPLES` samples (default 100: 100 rounds of 1 pod, 10 of 10, 2 of 50).
//!
//!   cargo bench --bench kubelet_prepare
//!   GPU_DRA_BENCH_PREPARE_SAMPLES=50 cargo bench --bench kubelet_prepare
//!
//! The API server, etcd, the scheduler, the agent and the harness share the machine's cores with this process.

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use support::harness::KubeletHarness;
use support::node::{NodeDirs, start_agent};
use support::process::Component;
use support::{Cluster, TestContext};

const GPUS: usize = 64;
const AT_ONCE: [usize; 3] = [1, 10, 50];
const ROUND_TIMEOUT: Duration = Duration::from_secs(120);

/// Prepare times (ms) of one level of pods started at once.
struct Level {
    pods: usize,
    rounds: usize,
    prepare_ms: Vec<f64>,
    /// The slowest round, from its first create to its last pod prepared.
    slowest_round_ms: f64,
}

fn main() -> anyhow::Result<()> {
    let samples = match std::env::var("GPU_DRA_BENCH_PREPARE_SAMPLES") {
        Ok(v) => v.trim().parse::<usize>().context("GPU_DRA_BENCH_PREPARE_SAMPLES must be a whole number")?,
        Err(_) => 100,
    };
    ensure!(samples > 0, "GPU_DRA_BENCH_PREPARE_SAMPLES must be at least 1");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let cluster = Arc::new(Cluster::start("bench-kubelet-prepare", false)?);
    let result = runtime.block_on(measure(cluster.clone(), samples));
    let stopped = cluster.stop();
    print_report(&result?);
    stopped
}

async fn measure(cluster: Arc<Cluster>, samples: usize) -> anyhow::Result<Vec<Level>> {
    let client = cluster.client().await?;
    let namespace = support::unique_name("bench-prepare");
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))?;
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    let ctx = TestContext { client: client.clone(), namespace, cluster };
    let result = levels(&ctx, samples).await;
    let _ = Api::<Namespace>::all(client.clone()).delete(&ctx.namespace, &DeleteParams::default()).await;
    let _ = Api::<DeviceClass>::all(client).delete(&ctx.namespace, &DeleteParams::default()).await;
    result
}

async fn levels(ctx: &TestContext, samples: usize) -> anyhow::Result<Vec<Level>> {
    let node = format!("{}-node", ctx.namespace);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let gpus = format!("{GPUS}xH100-80GB");
    let mut agent = start_agent(ctx, &node, &dirs, &["--gpu-backend", "simulated", "--simulated-gpus", &gpus])?;
    agent.wait_ready().await?;
    let workers = AT_ONCE.iter().max().copied().unwrap_or(1).to_string();
    let kubelet =
        KubeletHarness::start_with(ctx, &node, &dirs.registry(), &dirs.kubelet_state(), &["--workers", &workers])?;
    kubelet.wait_for("registered", "", Duration::from_secs(60)).await?;
    support::objects::driver_device_class(ctx).await?;
    // The claim controller frees what the pods of a round held (their reservations, then the deleted claims'
    // allocations): without it the GPUs run out after 64 pods.
    let _controller = Component::controller(ctx, &[]).await?;

    let mut levels = Vec::new();
    for pods in AT_ONCE {
        let rounds = samples.div_ceil(pods);
        eprintln!("--- {pods} pod(s) at once: {rounds} round(s)");
        let mut level = Level { pods, rounds, prepare_ms: Vec::new(), slowest_round_ms: 0.0 };
        for round in 0..rounds {
            let (times, took) = run_round(ctx, &kubelet, &node, &format!("p{pods}-r{round}"), pods).await?;
            level.prepare_ms.extend(times);
            level.slowest_round_ms = level.slowest_round_ms.max(took);
        }
        levels.push(level);
    }
    ensure!(agent.terminate()?.success(), "the agent did not exit cleanly");
    Ok(levels)
}

/// Creates `n` one-GPU claims and pods on `node` at once, waits for every pod's `prepared` event, then deletes the
/// pods (waiting for their `unprepared`) and the claims. Returns the prepare times and the round's duration (ms).
async fn run_round(
    ctx: &TestContext,
    kubelet: &KubeletHarness,
    node: &str,
    prefix: &str,
    n: usize,
) -> anyhow::Result<(Vec<f64>, f64)> {
    let claims = Api::<ResourceClaim>::namespaced(ctx.client.clone(), &ctx.namespace);
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ctx.namespace);
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let began = std::time::Instant::now();
    let creates = names.iter().map(|name| {
        let (claims, pods) = (claims.clone(), pods.clone());
        async move {
            let claim: ResourceClaim = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": ctx.namespace}}]}}
            }))?;
            claims.create(&PostParams::default(), &claim).await?;
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {
                    "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                                    "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "terminationGracePeriodSeconds": 0
                }
            }))?;
            pods.create(&PostParams::default(), &pod).await?;
            anyhow::Ok(())
        }
    });
    futures::future::try_join_all(creates).await?;
    let mut times = Vec::with_capacity(n);
    for name in &names {
        let key = format!("{}/{name}", ctx.namespace);
        let prepared = kubelet.wait_for("prepared", &key, ROUND_TIMEOUT).await?;
        let ms = prepared["prepareMs"].as_f64().with_context(|| format!("no prepareMs in {prepared}"))?;
        times.push(ms);
    }
    let took = began.elapsed().as_secs_f64() * 1000.0;
    for name in &names {
        pods.delete(name, &DeleteParams::default()).await?;
    }
    for name in &names {
        kubelet.wait_for("unprepared", &format!("{}/{name}", ctx.namespace), ROUND_TIMEOUT).await?;
        claims.delete(name, &DeleteParams::default()).await?;
    }
    eprintln!(
        "    {prefix}: prepared {took:.0} ms after the first create, released {:.0} ms later",
        began.elapsed().as_secs_f64() * 1000.0 - took
    );
    Ok((times, took))
}

fn print_report(levels: &[Level]) {
    println!();
    println!(
        "machine: {} cores; agent: release build, {GPUS} simulated GPUs; kubelet DRA code of Kubernetes {}; API \
         server, etcd and scheduler on the same cores",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::env::var("K8S_VERSION").unwrap_or_else(|_| "v1.37.2".into())
    );
    println!("PrepareResources of the kubelet's DRA manager per pod (1 claim of 1 GPU), pods created at once:");
    println!(
        "{:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "pods", "rounds", "samples", "p50 ms", "p99 ms", "max ms", "p99 / 1 pod", "round ms"
    );
    let single_p99 = levels.first().map(|l| percentile(&l.prepare_ms, 0.99));
    for level in levels {
        let p99 = percentile(&level.prepare_ms, 0.99);
        let ratio = single_p99.map_or("-".into(), |s| format!("{:.2}x", p99 / s));
        println!(
            "{:>8} {:>8} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>11} {:>11.0}",
            level.pods,
            level.rounds,
            level.prepare_ms.len(),
            percentile(&level.prepare_ms, 0.50),
            p99,
            percentile(&level.prepare_ms, 1.0),
            ratio,
            level.slowest_round_ms
        );
    }
    println!("(round ms: the slowest round, from its first create to its last pod prepared, scheduling included)");
}

/// Nearest-rank percentile (`p` in 0..=1) of an unsorted series; NaN when empty.
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    support::measure::nearest_rank(&sorted, p)
}
