//! Benchmark: what the claim controller costs an operator, gpu-dra's next to kube-controller-manager running only
//! its resourceclaim-controller, each a process of its own against the same kind of local control plane (a fresh
//! cluster per contender and scenario; the cluster's own kube-controller-manager runs only its garbage-collector and
//! namespace controllers). Both get the same client limit (`GPU_DRA_COST_LIMIT`, default 500/1000 QPS/burst) and
//! KCM `--concurrent-resourceclaim-syncs=50`.
//!
//! - **CPU per 1,000 pod claims**: the process's utime + stime (/proc/PID/stat) across a burst of
//!   `GPU_DRA_COST_BURST` pods (default 2,000), and across each steady-rate run below.
//! - **Latency** from a pod's creation (its create call answered) to its claim recorded in its status (seen by a
//!   watch), at steady rates `GPU_DRA_COST_RATES` pods/s (default 20,100) for `GPU_DRA_COST_SECONDS` (default 30):
//!   p50 and p99.
//! - **Backlog**: `GPU_DRA_COST_BACKLOG` pods (default 10,000) with template claims created before the controller
//!   starts: the time from its start until every pod has its claim, and its peak RSS (VmHWM).
//!
//!   cargo bench --bench controller_cost
//!   GPU_DRA_COST_BACKLOG=2000 GPU_DRA_COST_SECONDS=10 cargo bench --bench controller_cost
//!
//! `GPU_DRA_COST_LATENCY_DIR=<dir>` also writes each steady-rate pod's latency to a CSV file there.
//!
//! `GPU_DRA_COST_ONLY=gpu-dra` (or `kcm`) measures one contender and prints its figures without the table: for
//! trying a change or profiling one process, not for ratios.
//!
//! The API server, etcd, this process and the contender share the machine's cores; the ratios are what to read.

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::Cluster;
use support::process::Component;

const NAMESPACE: &str = "cost";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Contender {
    GpuDra,
    Kcm,
}

impl Contender {
    fn label(self) -> &'static str {
        match self {
            Contender::GpuDra => "gpu-dra controller",
            Contender::Kcm => "kube-controller-manager",
        }
    }
}

/// The contender's process: gpu-dra through the test support, kube-controller-manager spawned here.
enum Running {
    GpuDra(Component),
    /// The certificate directory lives as long as the process.
    Kcm {
        child: Child,
        _certs: tempfile::TempDir,
    },
}

impl Running {
    fn pid(&self) -> u32 {
        match self {
            Running::GpuDra(c) => c.pid(),
            Running::Kcm { child, .. } => child.id(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Running::Kcm { child, .. } = self {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Settings {
    qps: u32,
    burst: u32,
    burst_pods: usize,
    rates: Vec<u32>,
    seconds: u64,
    backlog: usize,
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(text) => text.trim().parse().ok().with_context(|| format!("{name}={text:?} is not a valid number")),
        Err(_) => Ok(default),
    }
}

fn settings() -> anyhow::Result<Settings> {
    let limit = std::env::var("GPU_DRA_COST_LIMIT").unwrap_or_else(|_| "500/1000".into());
    let (qps, burst) = limit
        .split_once('/')
        .and_then(|(q, b)| Some((q.parse().ok()?, b.parse().ok()?)))
        .with_context(|| format!("GPU_DRA_COST_LIMIT={limit:?}: expected QPS/BURST"))?;
    let rates = std::env::var("GPU_DRA_COST_RATES").unwrap_or_else(|_| "20,100".into());
    let rates = rates
        .split(',')
        .map(|r| r.trim().parse().ok().filter(|r: &u32| *r > 0))
        .collect::<Option<Vec<u32>>>()
        .with_context(|| format!("GPU_DRA_COST_RATES={rates:?}: expected pods/s, comma-separated"))?;
    Ok(Settings {
        qps,
        burst,
        burst_pods: env_or("GPU_DRA_COST_BURST", 2000)?,
        rates,
        seconds: env_or("GPU_DRA_COST_SECONDS", 30)?,
        backlog: env_or("GPU_DRA_COST_BACKLOG", 10_000)?,
    })
}

/// One contender's figures.
#[derive(Debug, Default)]
struct Figures {
    burst_cpu_per_1000: f64,
    /// Per rate: (CPU s per 1,000 pods, p50 ms, p99 ms).
    steady: Vec<(u32, f64, f64, f64)>,
    backlog_seconds: f64,
    backlog_rss_mib: f64,
    backlog_cpu_per_1000: f64,
}

fn main() -> anyhow::Result<()> {
    let settings = settings()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let ticks = clock_ticks()?;
    let mut figures = HashMap::new();
    for contender in contenders()? {
        eprintln!("--- {}", contender.label());
        let f = runtime.block_on(measure(contender, &settings, ticks))?;
        eprintln!("    {f:?}");
        figures.insert(contender, f);
    }
    if let (Some(ours), Some(kcm)) = (figures.get(&Contender::GpuDra), figures.get(&Contender::Kcm)) {
        print_table(&settings, ours, kcm);
    }
    Ok(())
}

/// Both contenders, or the one `GPU_DRA_COST_ONLY` names.
fn contenders() -> anyhow::Result<Vec<Contender>> {
    match std::env::var("GPU_DRA_COST_ONLY").as_deref() {
        Err(_) | Ok("") => Ok(vec![Contender::GpuDra, Contender::Kcm]),
        Ok("gpu-dra") => Ok(vec![Contender::GpuDra]),
        Ok("kcm") => Ok(vec![Contender::Kcm]),
        Ok(other) => bail!("GPU_DRA_COST_ONLY={other:?}: expected gpu-dra or kcm"),
    }
}

async fn measure(contender: Contender, s: &Settings, ticks: f64) -> anyhow::Result<Figures> {
    let mut f = Figures::default();
    // Burst and steady rates: one cluster, one process, CPU by difference.
    {
        let cluster = Cluster::start_with(&format!("cost-{contender:?}").to_lowercase(), false, &[])?;
        let client = prepare_namespace(&cluster).await?;
        let process = start(contender, &cluster, s).await?;
        let recorded = Recorded::watch(client.clone());
        create_pods(&client, "warm", 1).await?;
        recorded.wait_all("warm", 1, Duration::from_secs(60)).await.context("warm-up pod never got its claim")?;

        let mut before = settle(process.pid(), ticks, &client).await?;
        create_pods(&client, "burst", s.burst_pods).await?;
        recorded.wait_all("burst", s.burst_pods, Duration::from_secs(900)).await?;
        let after = settle(process.pid(), ticks, &client).await?;
        f.burst_cpu_per_1000 = (after - before) / s.burst_pods as f64 * 1000.0;
        before = after;

        for &rate in &s.rates {
            let prefix = format!("rate{rate}");
            let created = create_at_rate(&client, &prefix, rate, s.seconds).await?;
            recorded.wait_all(&prefix, created.len(), Duration::from_secs(300)).await?;
            let after = settle(process.pid(), ticks, &client).await?;
            let cpu = (after - before) / created.len() as f64 * 1000.0;
            before = after;
            // Per pod that got its claim: when its create was answered, and its latency in ms.
            let samples: Vec<(Instant, f64)> = created
                .iter()
                .filter_map(|(name, at)| {
                    Some((*at, recorded.at(name)?.saturating_duration_since(*at).as_secs_f64() * 1e3))
                })
                .collect();
            write_latencies(contender, rate, &samples)?;
            let mut latencies: Vec<f64> = samples.iter().map(|(_, ms)| *ms).collect();
            latencies.sort_by(f64::total_cmp);
            f.steady.push((rate, cpu, percentile(&latencies, 0.50), percentile(&latencies, 0.99)));
        }
        drop(process);
        cluster.stop()?;
    }
    // Backlog: the pods first, then the controller.
    {
        let cluster = Cluster::start_with(&format!("cost-backlog-{contender:?}").to_lowercase(), false, &[])?;
        let client = prepare_namespace(&cluster).await?;
        let recorded = Recorded::watch(client.clone());
        create_pods(&client, "backlog", s.backlog).await?;
        let started = Instant::now();
        let process = start(contender, &cluster, s).await?;
        recorded.wait_all("backlog", s.backlog, Duration::from_secs(1800)).await?;
        f.backlog_seconds = started.elapsed().as_secs_f64();
        f.backlog_cpu_per_1000 = settle(process.pid(), ticks, &client).await? / s.backlog as f64 * 1000.0;
        f.backlog_rss_mib = peak_rss_mib(process.pid())?;
        drop(process);
        cluster.stop()?;
    }
    Ok(f)
}

async fn prepare_namespace(cluster: &Cluster) -> anyhow::Result<Client> {
    let client = cluster.client().await?;
    support::objects::namespace_with_one_gpu_template(&client, NAMESPACE, "gpu.cost").await?;
    Ok(client)
}

/// Starts the contender with the same client limit; ready means serving (gpu-dra) or healthy (KCM).
async fn start(contender: Contender, cluster: &Cluster, s: &Settings) -> anyhow::Result<Running> {
    let (qps, burst) = (s.qps.to_string(), s.burst.to_string());
    match contender {
        Contender::GpuDra => {
            // Production logging (info), as KCM runs at its default verbosity: the test harness's debug lines would
            // be counted as controller cost.
            let args = [
                "controller",
                "--leader-elect=false",
                "--log-filter=info",
                "--kube-api-qps",
                &qps,
                "--kube-api-burst",
                &burst,
            ];
            let c = Component::start(&cluster.kubeconfig(), "cost-gpu-dra", &args)?;
            c.wait_ready().await?;
            Ok(Running::GpuDra(c))
        }
        Contender::Kcm => {
            let kubeconfig = cluster.kubeconfig();
            let kubeconfig = kubeconfig.to_str().context("kubeconfig path is not UTF-8")?;
            let certs = tempfile::tempdir()?;
            let log = std::fs::File::create(cluster.state_dir().join("cost-kcm.log"))?;
            let child = Command::new(support::k8s_tool("kube-controller-manager")?)
                .args(["--kubeconfig", kubeconfig, "--authentication-kubeconfig", kubeconfig])
                .args(["--authorization-kubeconfig", kubeconfig, "--leader-elect=false"])
                .args([
                    "--bind-address",
                    "127.0.0.1",
                    "--secure-port",
                    "0",
                    "--controllers",
                    "resourceclaim-controller",
                ])
                .args(["--use-service-account-credentials=false", "--concurrent-resourceclaim-syncs=50"])
                .args(["--kube-api-qps", &qps, "--kube-api-burst", &burst])
                .arg("--cert-dir")
                .arg(certs.path())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("start kube-controller-manager")?;
            Ok(Running::Kcm { child, _certs: certs })
        }
    }
}

/// When each pod was first seen with its claim recorded, by name; fed by a watch for the whole run.
struct Recorded {
    seen: Arc<Mutex<HashMap<String, Instant>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl Recorded {
    fn watch(client: Client) -> Self {
        let seen = Arc::new(Mutex::new(HashMap::new()));
        let into = seen.clone();
        let task = tokio::spawn(async move {
            let api = Api::<Pod>::namespaced(client, NAMESPACE);
            let mut stream = watcher(api, watcher::Config::default()).default_backoff().applied_objects().boxed();
            while let Some(Ok(pod)) = stream.next().await {
                let recorded = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.resource_claim_statuses.as_ref())
                    .is_some_and(|s| s.iter().any(|c| c.resource_claim_name.is_some()));
                if recorded && let Ok(mut seen) = into.lock() {
                    seen.entry(pod.name_any()).or_insert_with(Instant::now);
                }
            }
        });
        Self { seen, _task: task }
    }

    fn at(&self, name: &str) -> Option<Instant> {
        self.seen.lock().ok()?.get(name).copied()
    }

    async fn wait_all(&self, prefix: &str, count: usize, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let done = self.seen.lock().map(|s| s.keys().filter(|k| k.starts_with(prefix)).count()).unwrap_or(0);
            if done >= count {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{done} of {count} {prefix} pods recorded their claim within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn pod(name: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            // No scheduler takes these pods: the run measures claim creation alone.
            "schedulerName": "cost-no-scheduler",
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
        }
    }))?)
}

/// Creates `count` pods `<prefix>-NNNNN` as fast as the API server takes them.
async fn create_pods(client: &Client, prefix: &str, count: usize) -> anyhow::Result<()> {
    let api = Api::<Pod>::namespaced(client.clone(), NAMESPACE);
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &pod(&format!("{prefix}-{i:05}"))?).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(64)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// With `GPU_DRA_COST_LATENCY_DIR` set, writes each pod's latency at `rate` to `<dir>/<contender>-<rate>.csv`
/// (`ms since the phase's first pod,latency ms`, in creation order): to see whether a p99 comes from slow pods
/// spread over the run or from one stall of the control plane.
fn write_latencies(contender: Contender, rate: u32, samples: &[(Instant, f64)]) -> anyhow::Result<()> {
    let Some(dir) = std::env::var_os("GPU_DRA_COST_LATENCY_DIR") else {
        return Ok(());
    };
    let Some(first) = samples.iter().map(|(at, _)| *at).min() else {
        return Ok(());
    };
    let mut csv = String::from("created_ms,latency_ms\n");
    for (at, latency) in samples {
        csv.push_str(&format!("{:.1},{latency:.2}\n", at.duration_since(first).as_secs_f64() * 1e3));
    }
    let path = std::path::Path::new(&dir).join(format!("{contender:?}-{rate}.csv").to_lowercase());
    std::fs::write(&path, csv).with_context(|| format!("write {}", path.display()))
}

/// Creates `rate` pods a second for `seconds`, each on its own task at its tick; returns when each create was
/// answered, by name.
async fn create_at_rate(
    client: &Client,
    prefix: &str,
    rate: u32,
    seconds: u64,
) -> anyhow::Result<Vec<(String, Instant)>> {
    let api = Api::<Pod>::namespaced(client.clone(), NAMESPACE);
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::new();
    for i in 0..(u64::from(rate) * seconds) {
        ticker.tick().await;
        let api = api.clone();
        let name = format!("{prefix}-{i:05}");
        tasks.push(tokio::spawn(async move {
            api.create(&PostParams::default(), &pod(&name)?).await?;
            anyhow::Ok((name, Instant::now()))
        }));
    }
    let mut created = Vec::with_capacity(tasks.len());
    for task in tasks {
        created.push(task.await??);
    }
    Ok(created)
}

/// Waits until `pid` has finished the work a phase left behind (Events still being sent at the Event client's QPS,
/// a garbage collection): until, over [`SETTLED`], its CPU time grows by at most one clock tick and the namespace's
/// Events stop growing in number. Without it that work is billed to the next phase — a burst of 2,000 pods leaves
/// up to 20 s of queued Events at 50/s, which had raised gpu-dra's CPU per pod at 20 pods/s from 1.2–1.4 to 2.2 ms —
/// and the burst looks cheaper than it is. The Event count is needed since Events are sent in batches: the drain can
/// cost under a tick in several seconds. (Applies to both contenders alike; kube-controller-manager writes none.) A
/// process still busy after [`SETTLE_LIMIT`] is read anyway, with a warning, so that the run's other figures are not
/// lost. Returns the process's CPU seconds as last read.
async fn settle(pid: u32, ticks: f64, client: &Client) -> anyhow::Result<f64> {
    let deadline = Instant::now() + SETTLE_LIMIT;
    let mut last = cpu_seconds(pid, ticks)?;
    let mut last_events = event_count(client).await?;
    let started = Instant::now();
    loop {
        tokio::time::sleep(SETTLED).await;
        let now = cpu_seconds(pid, ticks)?;
        let events = event_count(client).await?;
        if now - last <= 1.5 / ticks && events == last_events {
            eprintln!("    settled in {:.0?} ({events} Events in the namespace)", started.elapsed());
            return Ok(now);
        }
        if Instant::now() > deadline {
            eprintln!(
                "    warning: process {pid} still busy {SETTLE_LIMIT:?} after its phase ended ({:.2} CPU s and {} \
                 Events in the last {SETTLED:?}); read as it is",
                now - last,
                events.saturating_sub(last_events)
            );
            return Ok(now);
        }
        (last, last_events) = (now, events);
    }
}

/// Events in the benchmark's namespace.
async fn event_count(client: &Client) -> anyhow::Result<usize> {
    let api = Api::<Event>::namespaced(client.clone(), NAMESPACE);
    Ok(api.list_metadata(&ListParams::default()).await.context("list Events")?.items.len())
}

/// How long a contender must stay (almost) idle to count as settled.
const SETTLED: Duration = Duration::from_secs(3);
/// How long [`settle`] waits at most.
const SETTLE_LIMIT: Duration = Duration::from_secs(300);

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// utime + stime of `pid` in seconds (fields 14 and 15 of /proc/PID/stat, after the parenthesised name).
fn cpu_seconds(pid: u32, ticks: f64) -> anyhow::Result<f64> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("read /proc/{pid}/stat"))?;
    let stat = gpu_dra::proc_stat::ProcStat::parse(&stat).context("malformed /proc/PID/stat")?;
    let utime = stat.number(14).context("no utime in /proc/PID/stat")?;
    let stime = stat.number(15).context("no stime in /proc/PID/stat")?;
    Ok((utime + stime) / ticks)
}

fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    Ok(support::measure::status_kib(pid, "VmHWM:")? / 1024.0)
}

fn clock_ticks() -> anyhow::Result<f64> {
    let out = Command::new("getconf").arg("CLK_TCK").output().context("run getconf CLK_TCK")?;
    String::from_utf8_lossy(&out.stdout).trim().parse().context("getconf CLK_TCK printed no number")
}

fn print_table(s: &Settings, ours: &Figures, kcm: &Figures) {
    println!();
    println!(
        "Controller cost, local control plane, client limit {}/{} for both; kube-controller-manager runs only its \
         resourceclaim-controller.",
        s.qps, s.burst
    );
    println!("| measure | gpu-dra | kube-controller-manager | gpu-dra / KCM | target |");
    println!("|---|---:|---:|---:|---:|");
    let row = |measure: String, a: f64, b: f64, digits: usize, target: &str| {
        println!("| {measure} | {a:.digits$} | {b:.digits$} | {:.2}x | {target} |", a / b);
    };
    row(
        format!("CPU s per 1,000 pod claims, burst of {}", s.burst_pods),
        ours.burst_cpu_per_1000,
        kcm.burst_cpu_per_1000,
        2,
        "≤ 0.3x",
    );
    for (o, k) in ours.steady.iter().zip(&kcm.steady) {
        row(format!("CPU s per 1,000 pod claims, {} pods/s", o.0), o.1, k.1, 2, "≤ 0.3x");
        row(format!("latency p50 ms, {} pods/s", o.0), o.2, k.2, 1, "-");
        row(format!("latency p99 ms, {} pods/s", o.0), o.3, k.3, 1, "≤ 1x");
    }
    row(
        format!("backlog of {} pods: s until all recorded", s.backlog),
        ours.backlog_seconds,
        kcm.backlog_seconds,
        1,
        "≤ 1x",
    );
    row(
        format!("backlog of {} pods: peak RSS MiB", s.backlog),
        ours.backlog_rss_mib,
        kcm.backlog_rss_mib,
        1,
        "≤ 0.25x",
    );
    row(
        format!("backlog of {} pods: CPU s per 1,000 (start-up included)", s.backlog),
        ours.backlog_cpu_per_1000,
        kcm.backlog_cpu_per_1000,
        2,
        "-",
    );
}
