//! Benchmark: gpu-dra controller vs kube-controller-manager's resourceclaim-controller vs a raw client doing the
//! same writes directly (the API server's own limit), on the local control plane.
//!
//! For each pod count, each contender gets a fresh cluster; N pods with one template claim each are created as
//! fast as the API server takes them, and the clock runs from the first pod created until every pod's status
//! records its claim. The two controllers get the same client rate limit (QPS/burst); the raw baseline has none
//! and keeps 100 writes in flight, so it shows what the API server itself sustains.
//!
//!   cargo bench --bench claim_controller                 # 2,000 and 5,000 pods
//!   GPU_DRA_BENCH_PODS=500 cargo bench --bench claim_controller
//!   GPU_DRA_BENCH_LIMITS=500/1000 …                       # client limits (QPS/burst) for both controllers, each
//!                                                         # run in turn (default 500/1000,5000/10000: one that
//!                                                         # binds, one that leaves the API server as the limit)
//!   GPU_DRA_BENCH_ONLY=gpu-dra …                          # one contender (no ratios): gpu-dra, kcm or raw

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::Cluster;
use support::process::Component;

const NAMESPACE: &str = "bench";
/// Pods the raw baseline works on at once: enough that the API server, not the client, sets its pace.
const RAW_IN_FLIGHT: usize = 100;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Contender {
    GpuDra,
    Kcm,
    Raw,
}

impl Contender {
    fn key(self) -> &'static str {
        match self {
            Contender::GpuDra => "gpu-dra",
            Contender::Kcm => "kcm",
            Contender::Raw => "raw",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Contender::GpuDra => "gpu-dra controller",
            Contender::Kcm => "kube-controller-manager",
            Contender::Raw => "raw client baseline",
        }
    }
}

#[derive(Debug)]
struct Run {
    wall: Duration,
    writes: f64,
    events: f64,
    duplicates: i64,
    peak_rss_mib: Option<f64>,
}

/// A client rate limit given to both controllers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Limit {
    qps: u32,
    burst: u32,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.qps, self.burst)
    }
}

fn limits() -> anyhow::Result<Vec<Limit>> {
    let text = std::env::var("GPU_DRA_BENCH_LIMITS").unwrap_or_else(|_| "500/1000,5000/10000".into());
    text.split(',')
        .map(|pair| {
            let (qps, burst) = pair.trim().split_once('/')?;
            Some(Limit { qps: qps.parse().ok()?, burst: burst.parse().ok()? })
        })
        .collect::<Option<_>>()
        .with_context(|| format!("GPU_DRA_BENCH_LIMITS={text:?}: expected QPS/BURST pairs separated by commas"))
}

fn main() -> anyhow::Result<()> {
    let counts: Vec<usize> = std::env::var("GPU_DRA_BENCH_PODS")
        .unwrap_or_else(|_| "2000,5000".into())
        .split(',')
        .map(|n| n.trim().parse().context("GPU_DRA_BENCH_PODS must be a comma-separated list of pod counts"))
        .collect::<anyhow::Result<_>>()?;
    let limits = limits()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let only = std::env::var("GPU_DRA_BENCH_ONLY").ok();
    let wanted = |c: Contender| only.as_deref().is_none_or(|o| o == c.key());
    // The raw baseline has no client limit: one run per pod count serves every limit.
    let mut raw = BTreeMap::new();
    let mut controllers = BTreeMap::new();
    for &pods in &counts {
        if wanted(Contender::Raw) {
            eprintln!("--- {pods} pods: {}", Contender::Raw.label());
            let run = runtime.block_on(run_one(Contender::Raw, pods, Limit { qps: 0, burst: 0 }))?;
            eprintln!("    {run:?}");
            raw.insert(pods, run);
        }
        for &limit in &limits {
            for contender in [Contender::GpuDra, Contender::Kcm].into_iter().filter(|c| wanted(*c)) {
                eprintln!("--- {pods} pods, {limit} QPS/burst: {}", contender.label());
                let run = runtime.block_on(run_one(contender, pods, limit))?;
                eprintln!("    {run:?}");
                controllers.insert((pods, limit, contender as u8), run);
            }
        }
    }
    if only.is_some() {
        return Ok(());
    }
    println!();
    println!("Claim creation, local control plane. Client limit (QPS/burst): the same for both controllers; the raw");
    println!("baseline has none (the API server's own limit).");
    println!(
        "{:>6}  {:>11}  {:<24} {:>8} {:>9} {:>11} {:>11} {:>6} {:>13} {:>8} {:>8}",
        "pods",
        "limit",
        "contender",
        "wall s",
        "pods/s",
        "writes/pod",
        "events/pod",
        "dups",
        "peak RSS MiB",
        "vs KCM",
        "vs raw"
    );
    for &pods in &counts {
        let rate = |r: &Run| pods as f64 / r.wall.as_secs_f64();
        let raw_run = &raw[&pods];
        for &limit in &limits {
            let kcm = &controllers[&(pods, limit, Contender::Kcm as u8)];
            for contender in [Contender::GpuDra, Contender::Kcm] {
                let r = &controllers[&(pods, limit, contender as u8)];
                print_row(pods, &limit.to_string(), contender, r, rate(r) / rate(kcm), rate(r) / rate(raw_run));
            }
        }
        let best_kcm =
            limits.iter().map(|&limit| rate(&controllers[&(pods, limit, Contender::Kcm as u8)])).fold(0.0, f64::max);
        print_row(pods, "none", Contender::Raw, raw_run, rate(raw_run) / best_kcm, 1.0);
    }
    println!("(raw \"vs KCM\": against kube-controller-manager's best run)");
    for &pods in &counts {
        for &limit in &limits {
            let ours = &controllers[&(pods, limit, Contender::GpuDra as u8)];
            let kcm = &controllers[&(pods, limit, Contender::Kcm as u8)];
            if let (Some(a), Some(b)) = (ours.peak_rss_mib, kcm.peak_rss_mib) {
                println!("{pods} pods, {limit}: gpu-dra peak RSS is {:.2} of kube-controller-manager's", a / b);
            }
        }
    }
    Ok(())
}

fn print_row(pods: usize, limit: &str, contender: Contender, r: &Run, vs_kcm: f64, vs_raw: f64) {
    println!(
        "{:>6}  {:>11}  {:<24} {:>8.2} {:>9.1} {:>11.2} {:>11.2} {:>6} {:>13} {:>7.2}x {:>7.2}x",
        pods,
        limit,
        contender.label(),
        r.wall.as_secs_f64(),
        pods as f64 / r.wall.as_secs_f64(),
        r.writes,
        r.events,
        r.duplicates,
        r.peak_rss_mib.map_or("-".into(), |m| format!("{m:.1}")),
        vs_kcm,
        vs_raw,
    );
}

async fn run_one(contender: Contender, pods: usize, limit: Limit) -> anyhow::Result<Run> {
    let Limit { qps, burst } = limit;
    let kcm_flags = format!("--kube-api-qps={qps} --kube-api-burst={burst} --concurrent-resourceclaim-syncs=50");
    let env = [("GPU_DRA_E2E_KCM_FLAGS", kcm_flags.as_str())];
    let cluster =
        Cluster::start_with(&format!("bench-{contender:?}").to_lowercase(), contender == Contender::Kcm, &env)?;
    let result = measure(&cluster, contender, pods, qps, burst).await;
    cluster.stop()?;
    result
}

async fn measure(cluster: &Cluster, contender: Contender, pods: usize, qps: u32, burst: u32) -> anyhow::Result<Run> {
    let client = cluster.client().await?;
    support::objects::namespace_with_one_gpu_template(&client, NAMESPACE, "gpu.bench").await?;

    let (qps_s, burst_s) = (qps.to_string(), burst.to_string());
    let mut component = None;
    let mut raw = None;
    match contender {
        Contender::GpuDra => {
            // Production logging (info): the test harness's debug lines are not what an operator runs.
            let args = [
                "controller",
                "--leader-elect=false",
                "--log-filter=info",
                "--kube-api-qps",
                &qps_s,
                "--kube-api-burst",
                &burst_s,
            ];
            let c = Component::start(&cluster.kubeconfig(), "bench-gpu-dra", &args)?;
            c.wait_ready().await?;
            component = Some(c);
        }
        Contender::Kcm => {}
        Contender::Raw => {
            let unlimited = unlimited_client(cluster).await?;
            raw = Some(tokio::spawn(raw_controller(unlimited)));
        }
    }

    let before = write_counters(&client).await?;
    let recorded = tokio::spawn(wait_all_recorded(client.clone(), pods));
    let started = Instant::now();
    futures::stream::iter(0..pods)
        .map(|i| {
            let client = client.clone();
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("pod-{i:05}")},
                    "spec": {
                        // No scheduler takes these pods: the run measures claim creation alone.
                        "schedulerName": "bench-no-scheduler",
                        "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "gpu"}]}}],
                        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
                    }
                }))?;
                Api::<Pod>::namespaced(client, NAMESPACE).create(&PostParams::default(), &pod).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(64)
        .try_collect::<Vec<_>>()
        .await?;
    tokio::time::timeout(Duration::from_secs(900), recorded).await.context("timed out after 15 min")???;
    let wall = started.elapsed();
    // Let trailing writes (events, retries) land before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = write_counters(&client).await?;

    let claims = Api::<ResourceClaim>::namespaced(client.clone(), NAMESPACE).list(&Default::default()).await?.items;
    let mut seen = HashSet::new();
    let mut duplicates = 0i64;
    for claim in &claims {
        let owner = claim.owner_references().first().map(|o| o.uid.clone()).unwrap_or_default();
        if !seen.insert(owner) {
            duplicates += 1;
        }
    }
    let peak_rss_mib = match contender {
        Contender::GpuDra => component.as_ref().and_then(|c| peak_rss_mib(c.pid())),
        Contender::Kcm => cluster.pid("kube-controller-manager").ok().and_then(peak_rss_mib),
        Contender::Raw => None,
    };
    if let Some(task) = raw {
        task.abort();
    }
    Ok(Run {
        wall,
        writes: (after.0 - before.0) / pods as f64,
        events: (after.1 - before.1) / pods as f64,
        duplicates,
        peak_rss_mib,
    })
}

/// Waits until `pods` pods in the namespace record their claim.
async fn wait_all_recorded(client: Client, pods: usize) -> anyhow::Result<()> {
    let api = Api::<Pod>::namespaced(client, NAMESPACE);
    let mut done = HashSet::new();
    let mut stream = watcher(api, watcher::Config::default()).default_backoff().applied_objects().boxed();
    while let Some(pod) = stream.try_next().await? {
        let recorded =
            pod.status.as_ref().and_then(|s| s.resource_claim_statuses.as_ref()).is_some_and(|s| !s.is_empty());
        if recorded {
            done.insert(pod.name_any());
            if done.len() == pods {
                return Ok(());
            }
        }
    }
    bail!("pod watch ended")
}

/// (object writes, event writes) counted by the API server: claim creates/updates/deletes and pod status writes;
/// events separately.
async fn write_counters(client: &Client) -> anyhow::Result<(f64, f64)> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(request).await?;
    let (mut writes, mut events) = (0.0, 0.0);
    for line in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let Some((labels, value)) = line.rsplit_once(' ') else { continue };
        let value: f64 = value.parse().unwrap_or(0.0);
        let label = |k: &str| {
            labels.split(&[',', '{', '}'][..]).find_map(|kv| kv.strip_prefix(&format!("{k}=\""))?.strip_suffix('"'))
        };
        let verb = label("verb").unwrap_or_default();
        let is_write = matches!(verb, "POST" | "PUT" | "PATCH" | "APPLY" | "DELETE");
        let resource = label("resource").unwrap_or_default();
        let subresource = label("subresource").unwrap_or_default();
        if is_write && (resource == "resourceclaims" || (resource == "pods" && subresource == "status")) {
            writes += value;
        } else if is_write && resource == "events" {
            events += value;
        }
    }
    Ok((writes, events))
}

/// The raw baseline: what any claim controller must at least do, without caches or checks: for every new pod,
/// create its claim and apply its status, [`RAW_IN_FLIGHT`] pods at a time.
async fn raw_controller(client: Client) -> anyhow::Result<()> {
    let pods = Api::<Pod>::namespaced(client.clone(), NAMESPACE);
    let claims = Api::<ResourceClaim>::namespaced(client.clone(), NAMESPACE);
    let handled = Arc::new(Mutex::new(HashSet::new()));
    watcher(pods.clone(), watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .try_for_each_concurrent(RAW_IN_FLIGHT, |pod| {
            let (pods, claims, handled) = (pods.clone(), claims.clone(), handled.clone());
            async move {
                let uid = pod.uid().unwrap_or_default();
                if !handled.lock().map(|mut h| h.insert(uid.clone())).unwrap_or(false) {
                    return Ok(());
                }
                let name = pod.name_any();
                let claim: ResourceClaim = serde_json::from_value(json!({
                    "metadata": {"generateName": format!("{name}-gpu-"), "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
                                 "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "controller": true}]},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.bench"}}]}}
                }))
                .map_err(|e| watcher::Error::WatchFailed(kube::Error::SerdeError(e)))?;
                let Ok(created) = claims.create(&PostParams::default(), &claim).await else { return Ok(()) };
                let status = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                    "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": created.name_any()}]}});
                let _ = pods.patch_status(&name, &PatchParams::apply("raw-baseline").force(), &Patch::Apply(&status)).await;
                Ok(())
            }
        })
        .await?;
    Ok(())
}

/// A client without a rate limit.
async fn unlimited_client(cluster: &Cluster) -> anyhow::Result<Client> {
    let config = cluster.client_config().await?;
    let unlimited = gpu_dra::kube_client::ClientArgs {
        kube_api_qps: 0.0,
        kube_api_burst: 0,
        kube_api_timeout: std::time::Duration::from_secs(70),
    };
    Ok(gpu_dra::kube_client::client_from_config(config, &unlimited)?)
}

/// Peak resident memory (VmHWM) in MiB; none when the process is gone.
fn peak_rss_mib(pid: u32) -> Option<f64> {
    support::measure::status_kib(pid, "VmHWM:").ok().map(|kib| kib / 1024.0)
}
