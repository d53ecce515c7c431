//! Benchmark: the node agent's kubelet plugin (`gpu-dra node-agent`, release build, `--gpu-backend simulated
//! --simulated-gpus 8xH100-80GB`) on a fake Node of the local control plane, driven over its unix sockets by the
//! kubelet stand-in of the integration tests (tests/support/node.rs). One cluster serves the whole run.
//!
//! - NodePrepareResources and NodeUnprepareResources latency as the client sees it, one claim per call, for a claim
//!   allocated 1 GPU and one allocated 8 GPUs: `GPU_DRA_BENCH_CYCLES` (default 1,000) prepare+unprepare cycles each,
//!   after 10 unmeasured warm-up cycles, one cycle started every `GPU_DRA_BENCH_INTERVAL_MS` (default 25 ms; 0: back
//!   to back), as a kubelet prepares per pod start. Every prepare does the full work (the claim read from the API
//!   server, the checkpoint saved twice and the CDI spec written, each write fsync'd with its directory), because the
//!   unprepare before it dropped the claim's record: a repeated prepare of a claim still held is answered from the
//!   checkpoint without I/O and would measure nothing. Checked: the spec exists after every prepare and is gone
//!   after every unprepare, and the agent logged one "prepared claim" (the full path only) per prepare.
//! - Start to ResourceSlice visible: from spawning the agent until a watch on the node's slices, opened before the
//!   spawn, delivers one; the median of 5 starts, each on a fresh Node with fresh directories.
//! - The agent's resident memory (/proc/<pid>/status): idle after start, and VmRSS and VmHWM (peak) after all cycles.
//!
//!   cargo bench --bench kubelet_plugin
//!   GPU_DRA_BENCH_CYCLES=200 cargo bench --bench kubelet_plugin
//!   GPU_DRA_BENCH_INTERVAL_MS=0 cargo bench --bench kubelet_plugin    # back to back
//!
//! The node directories are under /tmp (the file system is printed): an fsync costs what that disk costs. The API
//! server, etcd and the agent share the machine's cores with this process.

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use support::node::{DRIVER, Kubelet, NodeDirs, start_agent};
use support::{Cluster, TestContext};

const AGENT_ARGS: [&str; 4] = ["--gpu-backend", "simulated", "--simulated-gpus", "8xH100-80GB"];
const WARM_UP: usize = 10;
const STARTS: usize = 5;
/// The targets.
const P50_MS: f64 = 5.0;
const P99_MS: f64 = 20.0;
const SLICE_VISIBLE_MS: f64 = 1000.0;
const RSS_MB: f64 = 20.0;

/// Client-observed call times of one claim's cycles.
#[derive(Debug)]
struct Series {
    gpus: usize,
    prepare: Vec<Duration>,
    unprepare: Vec<Duration>,
}

#[derive(Debug)]
struct Report {
    series: Vec<Series>,
    slice_visible: Vec<Duration>,
    /// MB (10^6 bytes).
    idle_rss: f64,
    end_rss: f64,
    peak_rss: f64,
    file_system: String,
}

/// How the prepare/unprepare cycles run.
#[derive(Clone, Copy, Debug)]
struct Pace {
    cycles: usize,
    /// One cycle starts this long after the previous one started (or when it ends, if later).
    interval: Duration,
}

fn main() -> anyhow::Result<()> {
    let number = |name: &str, default: u64| match std::env::var(name) {
        Ok(v) => v.trim().parse::<u64>().with_context(|| format!("{name} must be a whole number")),
        Err(_) => Ok(default),
    };
    let cycles = number("GPU_DRA_BENCH_CYCLES", 1000)? as usize;
    ensure!(cycles > 0, "GPU_DRA_BENCH_CYCLES must be at least 1");
    let pace = Pace { cycles, interval: Duration::from_millis(number("GPU_DRA_BENCH_INTERVAL_MS", 25)?) };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let cluster = Arc::new(Cluster::start("bench-kubelet-plugin", false)?);
    let result = runtime.block_on(measure(cluster.clone(), pace));
    let stopped = cluster.stop();
    print_report(&result?, pace);
    stopped
}

async fn measure(cluster: Arc<Cluster>, pace: Pace) -> anyhow::Result<Report> {
    let client = cluster.client().await?;
    let namespace = support::unique_name("bench-kubelet-plugin");
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}}))?;
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
    let ctx = TestContext { client: client.clone(), namespace, cluster };
    let result = async {
        eprintln!("--- start to ResourceSlice visible, {STARTS} fresh starts");
        let slice_visible = slice_visible(&ctx).await?;
        eprintln!("--- prepare/unprepare, {} cycles per claim after {WARM_UP} warm-up cycles", pace.cycles);
        latencies(&ctx, pace, slice_visible).await
    }
    .await;
    let _ = Api::<Namespace>::all(client).delete(&ctx.namespace, &DeleteParams::default()).await;
    result
}

/// Starts one agent and runs the cycles of a 1-GPU and an 8-GPU claim against it.
async fn latencies(ctx: &TestContext, pace: Pace, slice_visible: Vec<Duration>) -> anyhow::Result<Report> {
    let node = format!("{}-node", ctx.namespace);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mut agent = start_agent(ctx, &node, &dirs, &AGENT_ARGS)?;
    agent.wait_ready().await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle_rss = rss_mb(agent.pid(), "VmRSS:")?;

    let ns = ctx.namespace.as_str();
    let mut series = Vec::new();
    for (name, gpus) in [("one-gpu", 1), ("eight-gpus", 8)] {
        let uid = allocated_claim(ctx, name, &node, gpus).await?;
        let (prepare, unprepare) = cycle(&mut kubelet, &dirs, (ns, name, &uid), gpus, pace).await?;
        eprintln!("    {gpus} GPU(s): done");
        series.push(Series { gpus, prepare, unprepare });
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (end_rss, peak_rss) = (rss_mb(agent.pid(), "VmRSS:")?, rss_mb(agent.pid(), "VmHWM:")?);
    let full = agent.log_text().lines().filter(|l| l.contains(": prepared claim ")).count();
    let expected = series.len() * (WARM_UP + pace.cycles);
    ensure!(full == expected, "the agent logged {full} full prepares, expected {expected}: some were answered cached");
    ensure!(agent.terminate()?.success(), "the agent did not exit cleanly");
    let file_system = file_system(&dirs.cdi());
    Ok(Report { series, slice_visible, idle_rss, end_rss, peak_rss, file_system })
}

/// Prepare then unprepare `claim` (namespace, name, uid) `WARM_UP + cycles` times; returns the measured call times.
async fn cycle(
    kubelet: &mut Kubelet,
    dirs: &NodeDirs,
    claim: (&str, &str, &str),
    gpus: usize,
    pace: Pace,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let spec = dirs.cdi_spec(claim.2);
    let (mut prepare, mut unprepare) = (Vec::with_capacity(pace.cycles), Vec::with_capacity(pace.cycles));
    let mut next_cycle = tokio::time::Instant::now();
    for i in 0..WARM_UP + pace.cycles {
        tokio::time::sleep_until(next_cycle).await;
        next_cycle = tokio::time::Instant::now() + pace.interval;
        let started = Instant::now();
        let answers = kubelet.prepare(&[claim]).await?;
        let prepared = started.elapsed();
        let answer = answers.get(claim.2).context("no answer for the claim")?;
        ensure!(answer.error.is_empty() && answer.devices.len() == gpus, "prepare {i}: {answer:?}");
        ensure!(spec.exists(), "cycle {i}: no CDI spec after prepare");

        let started = Instant::now();
        let errors = kubelet.unprepare(&[claim]).await?;
        let unprepared = started.elapsed();
        ensure!(errors.get(claim.2).is_some_and(String::is_empty), "unprepare {i}: {errors:?}");
        ensure!(!spec.exists(), "cycle {i}: the CDI spec outlived unprepare");
        if i >= WARM_UP {
            prepare.push(prepared);
            unprepare.push(unprepared);
        }
    }
    Ok((prepare, unprepare))
}

/// Creates claim `name` and writes the allocation a scheduler would: `gpus` devices of `pool`, reserved for a pod.
async fn allocated_claim(ctx: &TestContext, name: &str, pool: &str, gpus: usize) -> anyhow::Result<String> {
    let api = Api::<ResourceClaim>::namespaced(ctx.client.clone(), &ctx.namespace);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu", "allocationMode": "ExactCount", "count": gpus}}]}}
    }))?;
    let uid = api.create(&PostParams::default(), &claim).await?.metadata.uid.context("created claim has no UID")?;
    let results: Vec<Value> = (0..gpus)
        .map(|i| json!({"request": "gpus", "driver": DRIVER, "pool": pool, "device": format!("gpu-{i}")}))
        .collect();
    let status = json!({"status": {
        "allocation": {"devices": {"results": results}},
        "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("{uid}-pod")}]
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await?;
    Ok(uid)
}

/// For each of `STARTS` fresh Nodes: the time from spawning the agent until the watch of the node's slices (opened
/// before) delivers one.
async fn slice_visible(ctx: &TestContext) -> anyhow::Result<Vec<Duration>> {
    let mut times = Vec::new();
    for i in 0..STARTS {
        let node = format!("{}-start{i}", ctx.namespace);
        ctx.cluster.add_node(&node)?;
        let dirs = NodeDirs::new()?;
        let api = Api::<ResourceSlice>::all(ctx.client.clone());
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let mut events = watcher(api, config).boxed();
        loop {
            match next(&mut events).await? {
                watcher::Event::InitDone => break,
                watcher::Event::InitApply(_) => bail!("node {node} has slices before its agent started"),
                _ => {}
            }
        }
        let started = Instant::now();
        let mut agent = start_agent(ctx, &node, &dirs, &AGENT_ARGS)?;
        while !matches!(next(&mut events).await?, watcher::Event::Apply(_)) {}
        let elapsed = started.elapsed();
        eprintln!("    start {i}: {:.1} ms", ms(elapsed));
        times.push(elapsed);
        ensure!(agent.terminate()?.success(), "the agent did not exit cleanly");
    }
    Ok(times)
}

async fn next<S>(events: &mut S) -> anyhow::Result<watcher::Event<ResourceSlice>>
where
    S: Stream<Item = Result<watcher::Event<ResourceSlice>, watcher::Error>> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(30), events.try_next())
        .await
        .context("no slice event within 30 s")??
        .context("the slice watch ended")
}

fn print_report(report: &Report, pace: Pace) {
    println!();
    println!(
        "machine: {} cores, {}; node dirs on {}; agent: release build; API server and etcd on the same cores",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model(),
        report.file_system
    );
    println!(
        "kubelet plugin: {} prepare+unprepare cycles per claim, one every {} ms; one claim per call, client-observed",
        pace.cycles,
        pace.interval.as_millis()
    );
    println!("{:<44} {:>10}  {:<3} {:>8} {:>7}", "metric", "measured", "", "target", "ratio");
    let row = |metric: &str, value: f64, unit: &str, target: Option<f64>| {
        let (target, ratio) = match target {
            Some(t) => (format!("≤ {t}"), format!("{:.2}", value / t)),
            None => ("-".into(), "-".into()),
        };
        println!("{metric:<44} {value:>10.2}  {unit:<3} {target:>8} {ratio:>7}");
    };
    for s in &report.series {
        let gpus = if s.gpus == 1 { "1 GPU".to_string() } else { format!("{} GPUs", s.gpus) };
        for (call, times, targets) in
            [("NodePrepareResources", &s.prepare, true), ("NodeUnprepareResources", &s.unprepare, false)]
        {
            let mut sorted = times.clone();
            sorted.sort();
            let mean = sorted.iter().map(|d| ms(*d)).sum::<f64>() / sorted.len() as f64;
            row(&format!("{call}, {gpus}: p50"), ms(percentile(&sorted, 0.50)), "ms", targets.then_some(P50_MS));
            row(&format!("{call}, {gpus}: p99"), ms(percentile(&sorted, 0.99)), "ms", targets.then_some(P99_MS));
            row(&format!("{call}, {gpus}: mean"), mean, "ms", None);
            row(&format!("{call}, {gpus}: max"), sorted.last().map_or(0.0, |d| ms(*d)), "ms", None);
        }
    }
    let mut visible = report.slice_visible.clone();
    visible.sort();
    let median = visible[visible.len() / 2];
    row(&format!("agent start → slice visible: median of {STARTS}"), ms(median), "ms", Some(SLICE_VISIBLE_MS));
    row(&format!("agent start → slice visible: max of {STARTS}"), visible.last().map_or(0.0, |d| ms(*d)), "ms", None);
    row("agent RSS idle (after start)", report.idle_rss, "MB", Some(RSS_MB));
    row("agent RSS after all cycles", report.end_rss, "MB", Some(RSS_MB));
    row("agent peak RSS (VmHWM) after all cycles", report.peak_rss, "MB", Some(RSS_MB));
    println!("(MB = 10^6 bytes; ratio = measured / target, ≤ 1.00 meets it)");
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    support::measure::nearest_rank(sorted, p)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `VmHWM:` (peak) or `VmRSS:` (now) of a process, in MB (10^6 bytes).
fn rss_mb(pid: u32, field: &str) -> anyhow::Result<f64> {
    Ok(support::measure::status_kib(pid, field)? * 1024.0 / 1e6)
}

fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info.lines().find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|(_, m)| m.trim()));
    model.unwrap_or("unknown CPU").to_string()
}

/// The file system holding `path` (the longest mount point above it), e.g. `ext4 (/dev/vda) at /`.
fn file_system(path: &Path) -> String {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (device, mount, kind) = (fields.next()?, fields.next()?, fields.next()?);
            path.starts_with(mount).then(|| (mount.len(), format!("{kind} ({device}) at {mount}")))
        })
        .max_by_key(|(len, _)| *len)
        .map_or_else(|| "an unknown file system".into(), |(_, fs)| fs)
}
