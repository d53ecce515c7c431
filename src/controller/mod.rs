//! The ResourceClaimTemplate controller: creates each pod's ResourceClaims from its templates, the way
//! kube-controller-manager's resourceclaim controller does, and goes beyond it where operators need more.
//!
//! ```text
//!  watch pods (slim) ─────┐                       ┌─▶ syncPod   (pod.rs):   find/adopt/create claims,
//!  watch claims (slim) ───┼─▶ handlers ─▶ queue ─▶┤                          ONE pod status write, reserve
//!  watch templates ───────┘  (enqueue   (dedup,   └─▶ syncClaim (claim.rs): drop stale reservations,
//!                             keys only) back-off)                           deallocate, delete finished pods' claims
//! ```
//!
//! Where the API server serves `scheduling.k8s.io/v1beta1` PodGroups (KEP-5729) they are watched too, and
//! syncPodGroup ([`podgroup`]) gives each PodGroup template claim ONE claim shared by the group's pods; PodGroups
//! served only later are noticed without a restart ([`group_api`]).
//!
//! Reads: pods, resourceclaims, resourceclaimtemplates, podgroups where served, resourcequotas (watched; a quota
//! that leaves room for claims looks again at the pods whose claims it refused, [`quota`]). Writes: resourceclaims
//! (create, delete, status), pods/status and podgroups/status (server-side apply), events, and one Lease for
//! leader election.
//!
//! Guarantees:
//! - one claim per pod claim: claims it created are remembered until the watch shows them ([`cache`]), orphans
//!   of a crashed instance are adopted, and duplicates another controller made are removed once unused;
//! - only the leader writes; a replica that loses the Lease exits ([`crate::leader`]);
//! - beside another active claim controller (evidence a tenant cannot forge) it warns, and turns observe-only
//!   when started with `--on-another-claim-controller=observe-only` ([`foreign`]).

/// Names the Kubernetes resource a slim type reduces (k8s-openapi's `Resource` constants).
macro_rules! resource_names {
    ($ty:ident, api_version: $api_version:literal, group: $group:literal, kind: $kind:literal, version: $version:literal,
     plural: $plural:literal) => {
        impl k8s_openapi::Resource for $ty {
            const API_VERSION: &'static str = $api_version;
            const GROUP: &'static str = $group;
            const KIND: &'static str = $kind;
            const VERSION: &'static str = $version;
            const URL_PATH_SEGMENT: &'static str = $plural;
            type Scope = k8s_openapi::NamespaceResourceScope;
        }
    };
}
use resource_names;

/// Makes a slim cache type (a struct with `metadata: ObjectMeta`) a Kubernetes resource for kube's API and watcher
/// (and so for the informer store, [`store`]), exactly like the full k8s-openapi type it reduces.
macro_rules! slim_resource {
    ($ty:ident, $($names:tt)*) => {
        super::resource_names!($ty, $($names)*);

        impl k8s_openapi::Metadata for $ty {
            type Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

            fn metadata(&self) -> &Self::Ty {
                &self.metadata
            }

            fn metadata_mut(&mut self) -> &mut Self::Ty {
                &mut self.metadata
            }
        }
    };
}
use slim_resource;

/// Makes a slim cache type with a compact [`wire_meta::Meta`] (a pod, a claim: the caches hold one per object) name
/// its Kubernetes resource, and gives it the metadata readers kube's `ResourceExt` gives full types, so code reads
/// both alike (`name_any` is the name: cached objects always have one, and `generateName` is not kept). kube's API
/// and watcher handle it as [`api_object::ApiObject`].
macro_rules! cached_resource {
    ($ty:ident, $($names:tt)*) => {
        super::resource_names!($ty, $($names)*);

        impl $crate::controller::store::Keyed for $ty {
            fn key(&self) -> (&str, &str) {
                (
                    self.metadata.namespace.as_deref().unwrap_or_default(),
                    self.metadata.name.as_deref().unwrap_or_default(),
                )
            }

            fn uid(&self) -> Option<&str> {
                self.metadata.uid.as_deref()
            }
        }

        impl $crate::controller::api_object::HasMeta for $ty {
            fn meta(&self) -> &$crate::controller::wire_meta::Meta {
                &self.metadata
            }
        }

        impl $ty {
            pub fn name_any(&self) -> String {
                self.metadata.name.clone().unwrap_or_default()
            }

            pub fn namespace(&self) -> Option<String> {
                self.metadata.namespace.clone()
            }

            pub fn uid(&self) -> Option<String> {
                self.metadata.uid.clone()
            }

            pub fn resource_version(&self) -> Option<String> {
                self.metadata.resource_version.clone()
            }

            pub fn owner_references(&self) -> &[k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference] {
                self.metadata.owner_references.as_deref().unwrap_or_default()
            }

            pub fn finalizers(&self) -> &[String] {
                self.metadata.finalizers.as_deref().unwrap_or_default()
            }

            /// A reference to this object, as kube's `Resource::object_ref` makes one.
            pub fn object_ref(&self, _: &()) -> k8s_openapi::api::core::v1::ObjectReference {
                k8s_openapi::api::core::v1::ObjectReference {
                    name: self.metadata.name.clone(),
                    namespace: self.metadata.namespace.clone(),
                    uid: self.metadata.uid.clone(),
                    api_version: Some(<$ty as k8s_openapi::Resource>::API_VERSION.to_string()),
                    kind: Some(<$ty as k8s_openapi::Resource>::KIND.to_string()),
                    ..Default::default()
                }
            }
        }
    };
}
use cached_resource;

pub mod api_object;

pub mod cache;
pub mod claim;
pub mod decide;
pub mod error;
pub mod events;
pub mod foreign;
pub mod group_api;
pub mod index;
pub mod metrics;
pub mod naming;
pub mod pod;
pub mod podgroup;
pub mod queue;
pub mod quota;
pub mod slim_claim;
pub mod slim_pod;
pub mod slim_pod_group;
pub mod slim_template;
pub mod store;
pub mod wire_meta;

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::cli::ControllerArgs;
use crate::leader::{LeaderElector, LeaderError, Role, Timing};
use crate::telemetry::process::ProcessCollector;
use crate::telemetry::server::{self, Readiness, ServerError};
use cache::Caches;
use error::SyncError;
use events::Events;
use foreign::ForeignControllerDetector;
use metrics::ControllerMetrics;
use queue::{WorkKey, WorkQueue};

/// Field manager of the claims this controller creates; also how it tells its claims from another controller's.
pub const CLAIM_FIELD_MANAGER: &str = "gpu-dra-controller";
/// Field manager of the pod status apply: kube-controller-manager's, so that either controller can take over the
/// entries the other wrote.
pub const POD_STATUS_FIELD_MANAGER: &str = "ResourceClaimController";
/// Longest one sync may take; a hung API call must not hold a worker (and its key) forever.
pub(crate) const SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// How long shutdown waits for in-flight syncs to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors that stop the controller.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("create the Kubernetes client (set KUBECONFIG, or run in a pod with a service account): {0}")]
    Client(#[source] kube::Error),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error(transparent)]
    Leader(#[from] LeaderError),
    #[error("{flag} {value:?} {why}")]
    Flag { flag: &'static str, value: String, why: &'static str },
    #[error("the informer caches stopped before they synced")]
    CachesStopped,
    #[error("install the signal handler: {0}")]
    Signal(#[source] std::io::Error),
}

/// Everything a worker or handler needs.
pub struct Context {
    pub client: Client,
    pub caches: Arc<Caches>,
    pub queue: WorkQueue,
    pub events: Events,
    pub metrics: ControllerMetrics,
    pub foreign: ForeignControllerDetector,
    /// Wakes the PodGroup discovery while PodGroups are not handled.
    pub group_api: group_api::GroupApi,
    /// Pods and PodGroups whose claims a ResourceQuota refused, looked at again when a quota leaves room for claims.
    pub quota: quota::QuotaWaits,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("caches", &self.caches).field("queue", &self.queue).finish_non_exhaustive()
    }
}

/// The names given in flags, checked as the API server would (which refused them only later, at every try, while
/// the controller stood by Ready and created nothing): the Lease's name, its namespace and the watched one, and
/// this replica's identity (client-go refuses an empty one; the Lease reads an empty holder as none, so every
/// replica led).
pub fn check_names(args: &ControllerArgs) -> Result<(), ControllerError> {
    let flag = |flag, value: &str, why| ControllerError::Flag { flag, value: value.to_string(), why };
    const LABEL: &str = "is not a namespace name (a DNS label: lowercase letters, digits and '-', at most 63)";
    for (name, value) in [("--namespace", &args.namespace), ("--leader-elect-namespace", &args.leader_elect_namespace)]
    {
        if let Some(value) = value
            && (value.contains('.') || !crate::node_agent::is_dns_subdomain(value))
        {
            return Err(flag(name, value, LABEL));
        }
    }
    if args.leader_elect && !crate::node_agent::is_dns_subdomain_within(&args.leader_elect_lease_name, 253) {
        let why = "is not a Lease name (a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253)";
        return Err(flag("--leader-elect-lease-name", &args.leader_elect_lease_name, why));
    }
    if let Some(identity) = &args.identity
        && identity.trim().is_empty()
    {
        return Err(flag("--identity", identity, "is empty: leave it out for POD_NAME (or the host name and pid)"));
    }
    Ok(())
}

/// Runs the controller until SIGTERM/SIGINT (or until it loses the leader lease, which is an error).
pub async fn run(args: ControllerArgs) -> Result<(), ControllerError> {
    let timing = Timing {
        lease_duration: args.leader_elect_lease_duration,
        renew_deadline: args.leader_elect_renew_deadline,
        retry_period: args.leader_elect_retry_period,
    };
    if args.leader_elect {
        timing.validate()?;
    }
    check_names(&args)?;
    let client = crate::kube_client::client(&args.client).await.map_err(ControllerError::Client)?;
    // The Event sender keeps `--events-qps` itself (it sends in batches), so its client has no limit of its own.
    let unlimited = args.client.unlimited(args.events_burst);
    let events_client = crate::kube_client::client(&unlimited).await.map_err(ControllerError::Client)?;
    let events_pace = (args.events_qps > 0.0)
        .then(|| Arc::new(crate::kube_client::TokenBucket::new(args.events_qps, args.events_burst.max(1))));
    let stop = CancellationToken::new();
    crate::signals::spawn_signal_handler(stop.clone()).map_err(ControllerError::Signal)?;

    let identity = args.identity.clone().unwrap_or_else(default_identity);
    let (caches, writers) = Caches::new();
    let caches = Arc::new(caches);
    let queue = WorkQueue::new();
    let events = Events::new(events_client, identity.clone(), events_pace);
    let mut registry = Registry::default();
    registry.register_collector(Box::new(ProcessCollector));
    crate::telemetry::build::register(&mut registry);
    let ctx = Arc::new(Context {
        client: client.clone(),
        caches: caches.clone(),
        queue: queue.clone(),
        metrics: ControllerMetrics::register(&mut registry, caches.clone(), queue.clone(), events.clone()),
        events,
        foreign: ForeignControllerDetector::new(args.on_another_claim_controller),
        group_api: group_api::GroupApi::default(),
        quota: quota::QuotaWaits::default(),
    });

    let readiness = Readiness::not_ready("informer caches have not synced");
    let (addr, serve) =
        server::bind(args.metrics_addr, Arc::new(registry), readiness.clone(), Default::default(), stop.clone())
            .await?;
    info!(%addr, "serving /metrics, /healthz and /readyz");
    let server = tokio::spawn(serve);
    if let Some(namespace) = &args.namespace {
        info!(%namespace, "watching one namespace only");
    }
    let groups = group_api::probe(&client, args.namespace.as_deref()).await;
    match &groups {
        group_api::Availability::Served | group_api::Availability::NotServed => info!("{}", groups.explain()),
        _ => warn!("{}", groups.explain()),
    }
    caches.set_groups_served(groups == group_api::Availability::Served);
    ctx.group_api.started_with(groups);
    if args.leader_elect {
        queue.stand_by();
    }
    tokio::spawn(cache::run_informers(client.clone(), args.namespace.clone(), writers, ctx.clone()));
    tokio::spawn(quota::watch(client.clone(), args.namespace.clone(), ctx.clone()));

    let (role_tx, mut role) = watch::channel(if args.leader_elect { Role::Unknown } else { Role::Leader });
    // Without election the sender stays here, so the role never changes (and never reads as closed).
    let mut _fixed_role = None;
    let election = if args.leader_elect {
        let namespace = (args.leader_elect_namespace.clone())
            .or_else(|| args.namespace.clone())
            .unwrap_or_else(|| client.default_namespace().to_string());
        info!(lease = %args.leader_elect_lease_name, %namespace, %identity, "contending for leadership");
        let elector = LeaderElector::new(
            kube::Api::<Lease>::namespaced(client.clone(), &namespace),
            args.leader_elect_lease_name.clone(),
            identity,
            timing,
        );
        Some(tokio::spawn(elector.run(role_tx, stop.clone())))
    } else {
        _fixed_role = Some(role_tx);
        None
    };

    tokio::select! {
        synced = caches.wait_synced() => synced.map_err(|_| ControllerError::CachesStopped)?,
        () = stop.cancelled() => return Ok(()),
    }
    info!(pods = caches.pods.len(), claims = caches.claims.len(), templates = caches.templates.len(), "caches synced");

    // Ready once the caches synced and the role is known; followers are ready too (warm standby).
    let mut workers = Vec::new();
    let lost_leadership = loop {
        let current = *role.borrow_and_update();
        match current {
            Role::Unknown => readiness.set(Err("leadership role not known yet".into())),
            Role::Follower if !workers.is_empty() => break true,
            Role::Follower => readiness.set(Ok(())),
            Role::Leader => {
                readiness.set(Ok(()));
                if workers.is_empty() {
                    queue.lead();
                    if args.leader_elect {
                        cache::enqueue_everything(&ctx);
                    }
                    queue.restart_clocks();
                    ctx.metrics.set_leader(true);
                    ctx.foreign.start_leading(Timestamp::now(), args.leader_elect);
                    info!(workers = args.workers, "leading: starting workers");
                    workers = (0..args.workers).map(|_| tokio::spawn(worker(ctx.clone()))).collect();
                }
            }
        }
        tokio::select! {
            // The elector ended: it only does so on shutdown or after losing the Lease.
            changed = role.changed() => if changed.is_err() { break !workers.is_empty() && !stop.is_cancelled() },
            () = stop.cancelled() => break false,
        }
    };

    queue.shut_down();
    ctx.metrics.set_leader(false);
    if lost_leadership {
        // Another replica leads now: not one more write from here, in-flight syncs included.
        error!("lost leadership: stopping all workers at once");
        workers.iter().for_each(tokio::task::JoinHandle::abort);
    } else {
        // Shutdown while leading: let in-flight syncs finish briefly, then release the Lease.
        let drain = futures::future::join_all(workers);
        if tokio::time::timeout(DRAIN_TIMEOUT, drain).await.is_err() {
            warn!("in-flight syncs did not finish within {DRAIN_TIMEOUT:?}");
        }
    }
    stop.cancel();
    if let Some(election) = election {
        match election.await {
            Ok(result) => result?,
            Err(err) => error!(error = %err, "leader election task failed"),
        }
    }
    match server.await {
        Ok(result) => result?,
        Err(err) => error!(error = %err, "metrics server task failed"),
    }
    info!("stopped");
    Ok(())
}

/// One worker: takes keys until the queue shuts down.
async fn worker(ctx: Arc<Context>) {
    while let Some(key) = ctx.queue.next().await {
        let started = Instant::now();
        let refusals = ctx.quota.refusals();
        // The one span every log line of a sync carries its object in (`sync{key=pod:ns/name}`); the syncs' own
        // spans are debug-level, so that at info a sync makes one span, not two with the same key.
        let span = info_span!("sync", key = %key);
        let result = tokio::time::timeout(SYNC_TIMEOUT, sync(&ctx, &key))
            .instrument(span)
            .await
            .unwrap_or(Err(SyncError::Timeout(SYNC_TIMEOUT)));
        let kind = match key {
            WorkKey::Pod(_) => "pod",
            WorkKey::Claim(_) => "claim",
            WorkKey::PodGroup(_) => "podgroup",
        };
        let label = result.as_ref().map_or_else(SyncError::metric_label, |()| "success");
        ctx.metrics.sync_finished(kind, label, started.elapsed().as_secs_f64());
        match result {
            Ok(()) => {
                ctx.queue.forget(&key);
                if ctx.quota.forget(&key) {
                    ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
                }
            }
            Err(err) => {
                let refused = err.api_status().map(|(code, message)| (decide::quota::refusal(code, message), message));
                if let Some((decide::quota::Refusal::Permission, message)) = refused {
                    warn!(%message, "forbidden: grant the controller's ServiceAccount this permission");
                }
                if matches!(refused, Some((decide::quota::Refusal::Quota, _))) {
                    // Woken by the quota's change; this retry is the net under a missed one.
                    let delay = ctx.queue.retry_refused(key.clone(), quota::QUOTA_RETRY);
                    debug!(%key, error = %err, retry_in = ?delay, "sync refused for quota");
                } else {
                    // Whatever held it back now, it is not a quota (its claims got in, or never got that far),
                    // unless a quota refused one of its claims before the failure returned.
                    if ctx.quota.forget_unless_refused_since(&key, refusals) {
                        ctx.metrics.set_waiting_for_quota(ctx.quota.waiting());
                    }
                    let delay = ctx.queue.retry(key.clone());
                    warn!(%key, error = %err, retry_in = ?delay, "sync failed");
                }
            }
        }
        ctx.queue.done(&key);
    }
    debug!("worker stopped");
}

async fn sync(ctx: &Context, key: &WorkKey) -> Result<(), SyncError> {
    match key {
        WorkKey::Pod(key) => pod::sync_pod(ctx, key).await,
        WorkKey::Claim(key) => claim::sync_claim(ctx, key).await,
        WorkKey::PodGroup(key) => podgroup::sync_pod_group(ctx, key).await,
    }
}

/// `POD_NAME` in a cluster (downward API), else the host name plus the process id.
fn default_identity() -> String {
    std::env::var("POD_NAME").ok().filter(|n| !n.is_empty()).unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    })
}
