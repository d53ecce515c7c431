//! The churn soak: ordinary workloads and faults against the real control plane, the real scheduler, the real
//! kubelet DRA code and real `gpu-dra` processes, with invariants checked every second and once everything is
//! deleted. It prints a table and fails on any violation, naming the known controller bug a violation points to.
//!
//! `GPU_DRA_SOAK_DURATION` (default 2m, the short form `cargo test` runs; `make soak DURATION=30m` for the long
//! one) bounds the workload; setting up adds about half a minute, the drain a few seconds (at most 90 s, when
//! something is left). `GPU_DRA_SOAK_SEED` repeats a run's random choices. `GPU_DRA_SOAK_CLAIM_CONTROLLER=
//! kube-controller-manager` runs the same soak against kube-controller-manager's claim controller instead of
//! gpu-dra's: the reference, which must pass too.
//!
//! - `bed.rs` — the cluster, nodes, controller replicas; `workload.rs` — the actors; `faults.rs` — the faults;
//! - `observer.rs` → `model.rs` — what was seen, when; `invariants.rs` — the checks (pure); `report.rs` — the table;
//! - `unit.rs` — unit tables of the pure parts, run as trials of this binary without a cluster.

// The modules of a test binary: `pub` marks what one offers the others.
#![allow(unreachable_pub)]

#[path = "../support/mod.rs"]
mod support;

mod bed;
mod faults;
mod invariants;
mod model;
mod observer;
mod report;
mod unit;
mod workload;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use kube::api::{Api, DynamicObject, ListParams};
use libtest_mimic::{Arguments, Trial};

use bed::{Bed, ClaimController, TENANT_NS, WORKLOAD_NS, resource};
use invariants::{Checker, Counts, EndState, Limits};
use observer::Observed;

const SOAK: &str = "churn_soak";
const DEFAULT_DURATION: &str = "2m";
/// How long the soak waits, after deleting the workload, for every claim, allocation, CDI spec and checkpoint
/// entry to go.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(90);

fn main() {
    let args = Arguments::from_args();
    let mut trials: Vec<Trial> = unit::TESTS
        .iter()
        .chain(&[("unit::fault_schedule", faults::schedule_table as fn() -> _)])
        .chain(&[("unit::quantiles", report::quantile_table as fn() -> _)])
        .map(|(name, body)| {
            let body = *body;
            Trial::test(*name, move || body().map_err(|e| format!("{e:#}").into()))
        })
        .collect();
    let mut soak = Trial::test(SOAK, || run_soak().map_err(|e| format!("{e:#}").into()));
    if selected(&args, SOAK)
        && !args.list
        && let Err(err) = support::cluster::build_binaries()
    {
        if std::env::var_os("CI").is_some() {
            eprintln!("error: CI is set and the Kubernetes binaries are not available: {err:#}");
            std::process::exit(1);
        }
        eprintln!("warning: {err:#}; the soak is IGNORED");
        soak = soak.with_ignored_flag(true);
    }
    trials.push(soak);
    libtest_mimic::run(&args, trials).exit()
}

/// Whether libtest's filter selects `name` (so the binaries are built only when the soak runs).
fn selected(args: &Arguments, name: &str) -> bool {
    let matches = |f: &str| if args.exact { f == name } else { name.contains(f) };
    args.filter.as_deref().is_none_or(matches) && !args.skip.iter().any(|s| matches(s))
}

fn run_soak() -> anyhow::Result<()> {
    let duration = std::env::var("GPU_DRA_SOAK_DURATION").unwrap_or_else(|_| DEFAULT_DURATION.to_string());
    let duration = humantime::parse_duration(&duration)
        .with_context(|| format!("GPU_DRA_SOAK_DURATION={duration:?} is not a duration like 2m or 30m"))?;
    let seed = match std::env::var("GPU_DRA_SOAK_SEED") {
        Ok(seed) => seed.parse().with_context(|| format!("GPU_DRA_SOAK_SEED={seed:?} is not a number"))?,
        Err(_) => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs(),
    };
    let claim_controller = match std::env::var("GPU_DRA_SOAK_CLAIM_CONTROLLER").as_deref() {
        Err(_) | Ok("gpu-dra") => ClaimController::GpuDra,
        Ok("kube-controller-manager") => ClaimController::KubeControllerManager,
        Ok(other) => anyhow::bail!(
            "GPU_DRA_SOAK_CLAIM_CONTROLLER={other:?}: expected gpu-dra (the default) or kube-controller-manager"
        ),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(soak(duration, seed, claim_controller))
}

async fn soak(duration: Duration, seed: u64, claim_controller: ClaimController) -> anyhow::Result<()> {
    let mut bed = Bed::start(claim_controller).await?;
    let observed = Observed { model: Arc::new(Mutex::new(model::Model::default())), start: Instant::now() };
    let watches = observer::start(&bed.client, &observed);
    let deadline = tokio::time::Instant::now() + duration;
    let workload = tokio::spawn(workload::run(bed.client.clone(), deadline, seed));
    let mut checker = Checker::new(Limits::default());
    let mut schedule = faults::schedule(duration).into_iter().peekable();
    let mut fault_log = Vec::new();
    while !workload.is_finished() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        check(&mut checker, &observed);
        bed.check_alive()?;
        if let Some((_, fault)) = schedule.next_if(|(at, _)| observed.now() >= *at) {
            let at = observed.now();
            let what = faults::inject(&mut bed, fault).await.with_context(|| format!("fault: {fault}"))?;
            eprintln!("soak: [{:>6.1}s] {fault}: {what}", at.as_secs_f64());
            fault_log.push(format!("[{:.0}s] {fault}: {what}", at.as_secs_f64()));
        }
    }
    let activity = workload.await.context("workload task")??;

    workload::delete_all(&bed.client).await?;
    let drain_started = Instant::now();
    let end = loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        check(&mut checker, &observed);
        let end = end_state(&bed).await?;
        if end.is_clean() || drain_started.elapsed() > DRAIN_TIMEOUT {
            break end;
        }
    };
    check(&mut checker, &observed);
    let mut violations = checker.violations.clone();
    violations.extend(end.violations(observed.now()));
    let counts = Counts::of(&observed.snapshot());
    let notes: Vec<String> = bed.controller_log_lines("OBSERVE-ONLY").into_iter().take(2).collect();
    eprintln!("\nsoak against the claim controller of {claim_controller:?}");
    let summary = report::Summary {
        duration,
        seed,
        counts: &counts,
        activity: &activity,
        faults: &fault_log,
        violations: &violations,
        notes: &notes,
    };
    eprintln!("{}", summary.render());
    for watch in watches {
        watch.abort();
    }
    bed.replicas.clear();
    bed.cluster.stop()?;
    ensure!(
        violations.is_empty(),
        "{} violations of the soak's invariants (table and list above; rerun with GPU_DRA_SOAK_SEED={seed})",
        violations.len()
    );
    Ok(())
}

/// Checks the invariants now and prints what became a violation.
fn check(checker: &mut Checker, observed: &Observed) {
    for violation in checker.check(&observed.snapshot(), observed.now()) {
        eprintln!("soak: {violation}");
    }
}

/// What is left: allocations anywhere, claims in the soak's namespaces, CDI specs and checkpoint entries on the
/// nodes.
async fn end_state(bed: &Bed) -> anyhow::Result<EndState> {
    let claims = Api::<DynamicObject>::all_with(bed.client.clone(), &resource("ResourceClaim"));
    let mut end = EndState::default();
    for claim in claims.list(&ListParams::default()).await?.items {
        let ns = claim.metadata.namespace.clone().unwrap_or_default();
        let name = format!("{ns}/{}", claim.metadata.name.clone().unwrap_or_default());
        if claim.data["status"].get("allocation").is_some_and(|a| !a.is_null()) {
            end.allocated.push(name.clone());
        }
        if ns == WORKLOAD_NS || ns == TENANT_NS {
            end.claims_left.push(name);
        }
    }
    for node in &bed.nodes {
        end.cdi_specs.extend(node.dirs.cdi_specs()?.into_iter().map(|f| (node.name.clone(), f)));
        let checkpoint = match std::fs::read_to_string(node.dirs.checkpoint()) {
            Ok(text) => serde_json::from_str::<serde_json::Value>(&text)
                .with_context(|| format!("checkpoint of {}", node.name))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(e.into()),
        };
        let entries = checkpoint["checkpoint"]["claims"].as_object().map(|m| m.keys().cloned().collect::<Vec<_>>());
        end.checkpoint_entries.extend(entries.unwrap_or_default().into_iter().map(|uid| (node.name.clone(), uid)));
    }
    Ok(end)
}
