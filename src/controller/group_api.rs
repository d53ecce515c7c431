//! Whether this controller handles PodGroups, and noticing when it can start to.
//!
//! The `scheduling.k8s.io/v1beta1` PodGroup API is off by default in Kubernetes 1.37: it appears when an operator
//! turns on `GenericWorkload` and the runtime-config on the API server (an upgrade, a feature enabled), or when
//! the controller's RBAC grows the PodGroup grants (a chart upgrade), usually while this controller keeps running.
//! So while PodGroups are not handled, discovery is re-run every [`RECHECK_PERIOD`] (kube-controller-manager's
//! garbage collector and quota controller re-run discovery every 30 s for the same reason) and at once when a pod
//! names a PodGroup (the surest sign the API is on). Once PodGroups are served and may be listed, their
//! informer starts, and when it has listed them the controller handles PodGroup claims from then on, without a
//! restart. Exiting for a restart instead would cost a leader handover and a crash-loop count for what is a
//! normal change of the cluster.
//!
//! Until then a pod that names a PodGroup gets no claim of its own (upstream refuses such a pod when its
//! PodGroup support is off): the claim it needs is its group's, and one made per pod would hold a device of
//! its own for every member.

use std::time::Duration;

use super::store::CacheWriter;
use kube::Client;
use kube::api::{Api, ListParams};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::Context;
use super::queue::WorkKey;
use super::slim_pod_group::{GROUP, PodGroup, RESOURCE, VERSION};

/// How often discovery is re-run while PodGroups are not handled.
pub const RECHECK_PERIOD: Duration = Duration::from_secs(30);
/// The least time between two discoveries a pod asked for: a burst of member pods makes one request.
const NUDGE_GAP: Duration = Duration::from_secs(1);

/// What discovery found out about PodGroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// Served and listable: handle them.
    Served,
    /// The API server does not serve them (the default in 1.37).
    NotServed,
    /// Served only in another version of the group (an alpha one: `v1alpha2` in Kubernetes 1.36, `v1alpha3` beside
    /// `v1beta1` in 1.37), which this controller does not read: PodGroup claims stay unhandled until the cluster
    /// serves [`VERSION`].
    OnlyOtherVersion(String),
    /// Served, but this controller may not list them (an older chart's RBAC).
    Forbidden(String),
    /// Discovery failed (the API server unreachable, a timeout).
    Unknown(String),
}

impl Availability {
    /// What the operator reads in the log, naming what to do.
    pub fn explain(&self) -> String {
        match self {
            Availability::Served => "PodGroup claims are handled".into(),
            Availability::NotServed => format!(
                "the API server does not serve {GROUP}/{VERSION} {RESOURCE} (GenericWorkload off): PodGroup claims \
                 are not handled; checked again every {}s",
                RECHECK_PERIOD.as_secs()
            ),
            Availability::OnlyOtherVersion(version) => format!(
                "the API server serves PodGroups only as {GROUP}/{version}, which gpu-dra does not read: PodGroup \
                 claims are not handled and a pod of a PodGroup gets no claim; serve {GROUP}/{VERSION} (Kubernetes \
                 1.37: --runtime-config {GROUP}/{VERSION}=true), or leave claims to kube-controller-manager's \
                 resourceclaim-controller; checked again every {}s",
                RECHECK_PERIOD.as_secs()
            ),
            Availability::Forbidden(err) => format!(
                "PodGroups are served but cannot be listed ({err}): grant get, list and watch on {GROUP} \
                 {RESOURCE} and patch on {RESOURCE}/status; checked again every {}s",
                RECHECK_PERIOD.as_secs()
            ),
            Availability::Unknown(err) => format!(
                "discovery of {GROUP}/{VERSION} failed ({err}): PodGroup claims are not handled yet; checked again \
                 every {}s",
                RECHECK_PERIOD.as_secs()
            ),
        }
    }
}

/// Wakes the discovery loop early (a pod named a PodGroup while they are not handled), and remembers what
/// discovery found at start, so that the loop reports only changes.
#[derive(Debug, Default)]
pub struct GroupApi {
    nudge: Notify,
    at_start: std::sync::OnceLock<Availability>,
}

impl GroupApi {
    pub fn nudge(&self) {
        self.nudge.notify_one();
    }

    /// Records what discovery found at start (already logged).
    pub fn started_with(&self, found: Availability) {
        let _ = self.at_start.set(found);
    }
}

/// Discovery of PodGroups: does the API server serve them, and may this controller list them.
pub async fn probe(client: &Client, namespace: Option<&str>) -> Availability {
    match serves_pod_groups(client, VERSION).await {
        Ok(true) => {}
        // Which other version serves them only words the log: a failure to find out is "not served".
        Ok(false) => {
            return other_version(client).await.map_or(Availability::NotServed, Availability::OnlyOtherVersion);
        }
        Err(err) => return Availability::Unknown(err.to_string()),
    }
    let api = match namespace {
        Some(ns) => Api::<PodGroup>::namespaced(client.clone(), ns),
        None => Api::<PodGroup>::all(client.clone()),
    };
    match api.list_metadata(&ListParams::default().limit(1)).await {
        Ok(_) => Availability::Served,
        Err(kube::Error::Api(status)) if status.code == 403 => Availability::Forbidden(status.message),
        // Served a moment ago and gone now (a downgrade between the two calls), or unreachable: try again later.
        Err(err) => Availability::Unknown(err.to_string()),
    }
}

/// Another version of the group that serves PodGroups, if any (the group's discovery, then each version's).
async fn other_version(client: &Client) -> Option<String> {
    let groups = client.list_api_groups().await.ok()?;
    let group = groups.groups.into_iter().find(|g| g.name == GROUP)?;
    for version in group.versions.into_iter().map(|v| v.version).filter(|v| v != VERSION) {
        if serves_pod_groups(client, &version).await.unwrap_or(false) {
            return Some(version);
        }
    }
    None
}

/// Whether the API server serves PodGroups in `version` of their group.
async fn serves_pod_groups(client: &Client, version: &str) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(&format!("{GROUP}/{version}")).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == RESOURCE)),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(err) => Err(err),
    }
}

/// Runs the PodGroup informer: at once when PodGroups were handled at start, else once discovery finds them.
/// Never returns while the controller runs.
pub async fn run_informer(client: Client, namespace: Option<&str>, writer: CacheWriter<PodGroup>, ctx: &Context) {
    if ctx.caches.groups_served() {
        return super::podgroup::run_informer(client, namespace, writer, ctx).await;
    }
    let mut last = ctx.group_api.at_start.get().cloned().unwrap_or(Availability::NotServed);
    loop {
        tokio::select! {
            () = tokio::time::sleep(RECHECK_PERIOD) => {}
            () = ctx.group_api.nudge.notified() => tokio::time::sleep(NUDGE_GAP).await,
        }
        let now = probe(&client, namespace).await;
        if now == Availability::Served {
            break;
        }
        if now != last {
            warn!("{}", now.explain());
        }
        last = now;
    }
    info!("PodGroups are served now: starting their informer");
    let reader = writer.as_reader();
    let handled_once_listed = async {
        if reader.wait_until_ready().await.is_ok() {
            ctx.caches.set_groups_served(true);
            info!(podgroups = reader.len(), "PodGroup claims are handled from now on");
            enqueue_all(ctx);
        }
    };
    tokio::join!(super::podgroup::run_informer(client, namespace, writer, ctx), handled_once_listed);
}

/// Everything PodGroups change: every PodGroup (its claims), every pod that names one (they waited), every
/// claim reserved for one (the group may be gone).
fn enqueue_all(ctx: &Context) {
    for group in ctx.caches.pod_groups.state() {
        super::podgroup::enqueue_group(ctx, &super::index::object_key(&*group));
    }
    for pod in ctx.caches.pods.state() {
        if super::decide::podgroup::pod_group_name(&pod).is_some() {
            super::cache::enqueue_pod(ctx, &pod, false);
        }
    }
    for claim in ctx.caches.claims.state() {
        if claim.reserved_for.iter().any(super::decide::podgroup::is_group_consumer) {
            ctx.queue.add(WorkKey::Claim(super::index::object_key(&*claim)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_says_what_to_do() {
        let forbidden = Availability::Forbidden("podgroups is forbidden: User \"x\" cannot list".into());
        let text = forbidden.explain();
        assert!(text.contains("cannot list") && text.contains("grant get, list and watch"), "{text}");
        assert!(Availability::NotServed.explain().contains("GenericWorkload"));
        let alpha = Availability::OnlyOtherVersion("v1alpha2".into()).explain();
        assert!(alpha.contains("scheduling.k8s.io/v1alpha2") && alpha.contains("scheduling.k8s.io/v1beta1"), "{alpha}");
        assert!(Availability::Unknown("timeout".into()).explain().contains("timeout"));
        let other = Availability::OnlyOtherVersion("v1alpha3".into());
        for state in [Availability::NotServed, other, forbidden, Availability::Unknown(String::new())] {
            assert!(state.explain().contains("checked again every 30s"), "{state:?}");
        }
    }
}
