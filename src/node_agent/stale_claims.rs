//! The periodic check for prepared claims the kubelet forgot ([`crate::kubelet_plugin::stale`] decides): every
//! interval, while the Node is `Ready`, each claim prepared here is read from the API; one found stale by two checks
//! an interval apart is reported (`warn`, the default) or, with `unprepare`, looked at once more (still prepared as
//! it was, still stale in the API) and unprepared through the same path as the kubelet's call; either way with a
//! Warning Event on the Node naming it and its GPUs.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::kubelet_plugin::allocation::ClaimRef;
use crate::kubelet_plugin::stale::{Suspects, why_stale};
use crate::kubelet_plugin::state::DriverState;

/// What to do with a stale claim (`--stale-claims`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StaleClaimAction {
    /// Keep it prepared and say so (log, Warning Event, metric).
    Warn,
    /// Unprepare it: its CDI spec, MPS daemon and MIG devices go, its GPUs can be prepared for other claims.
    Unprepare,
}

#[derive(Debug, Clone, Copy)]
pub struct StaleClaimSettings {
    pub action: StaleClaimAction,
    pub interval: Duration,
}

/// Checks every `settings.interval` until `stop`.
pub async fn run(
    state: Arc<DriverState>,
    client: kube::Client,
    node: String,
    settings: StaleClaimSettings,
    stop: CancellationToken,
) {
    let StaleClaimSettings { action, interval } = settings;
    let mut suspects = Suspects::default();
    let mut reported = BTreeSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        if !node_ready(&client, &node).await {
            suspects.node_not_ready();
            continue;
        }
        let this = state.clone();
        let Ok(prepared) = tokio::task::spawn_blocking(move || this.prepared_claims()).await else { continue };
        let mut checked = Vec::with_capacity(prepared.len());
        for (claim, devices) in &prepared {
            match Api::<ResourceClaim>::namespaced(client.clone(), &claim.namespace).get_opt(&claim.name).await {
                Ok(read) => {
                    let why = why_stale(&claim.uid, devices, read.as_ref(), state.driver(), state.pool());
                    checked.push((claim.uid.clone(), why));
                }
                Err(error) => debug!(claim = %claim, %error, "reading a prepared claim failed; checked next time"),
            }
        }
        let stale = suspects.record(std::time::Instant::now(), interval, &checked);
        state.metrics().stale_claims.set(stale.len() as i64);
        reported.retain(|uid| stale.iter().any(|(u, _)| u == uid));
        for (uid, why) in stale {
            let Some((claim, devices)) = prepared.iter().find(|(c, _)| c.uid == uid) else { continue };
            let devices: Vec<&str> = devices.iter().map(String::as_str).collect();
            let devices = devices.join(", ");
            match action {
                StaleClaimAction::Warn => {
                    if reported.insert(uid.clone()) {
                        warn!(claim = %claim, %uid, why, %devices, "a claim prepared here is stale; kept prepared");
                        let note = format!(
                            "Claim {claim} (UID {uid}) is prepared on this node for {devices}, but {why}. Either a \
                             container the kubelet cannot stop still holds it (it unprepares the claim once that \
                             container is gone) or the kubelet lost its record of it and never will. Kept prepared, \
                             its GPUs refused to other claims; with --stale-claims=unprepare the agent frees them."
                        );
                        super::plugin::node_warning(client.clone(), &node, "StaleClaimPrepared", "CheckClaims", note)
                            .await;
                    }
                }
                StaleClaimAction::Unprepare => {
                    // Looked at again just before: still prepared as it was, still stale in the API.
                    if !still_stale(&state, &client, claim, devices_of(&prepared, &uid)).await {
                        suspects.forget(&uid);
                        continue;
                    }
                    let result = state.unprepare(vec![claim.clone()]).await;
                    match result.into_iter().next().map(|(_, r)| r) {
                        Some(Ok(())) => {
                            suspects.forget(&uid);
                            state.metrics().stale_claims_unprepared.inc();
                            info!(claim = %claim, %uid, why, %devices, "unprepared a stale claim");
                            let note = format!(
                                "Claim {claim} (UID {uid}) was prepared on this node for {devices}, but {why}: the \
                                 kubelet lost its record of it and would never unprepare it. Unprepared; its GPUs can \
                                 be prepared for other claims."
                            );
                            super::plugin::node_warning(
                                client.clone(),
                                &node,
                                "StaleClaimUnprepared",
                                "UnprepareClaim",
                                note,
                            )
                            .await;
                        }
                        Some(Err(error)) => {
                            warn!(claim = %claim, %uid, %error, "unpreparing a stale claim failed; tried again next check");
                            // Still prepared: said on the Node as `warn` says it (once), so alerts on it fire.
                            if reported.insert(uid.clone()) {
                                let note = format!(
                                    "Claim {claim} (UID {uid}) is prepared on this node for {devices}, but {why}. \
                                     Unpreparing it failed ({error}); tried again at each check, its GPUs refused to \
                                     other claims meanwhile."
                                );
                                super::plugin::node_warning(
                                    client.clone(),
                                    &node,
                                    "StaleClaimPrepared",
                                    "UnprepareClaim",
                                    note,
                                )
                                .await;
                            }
                        }
                        None => {}
                    }
                }
            }
        }
    }
}

fn devices_of<'a>(prepared: &'a [(ClaimRef, BTreeSet<String>)], uid: &str) -> Option<&'a BTreeSet<String>> {
    prepared.iter().find(|(c, _)| c.uid == uid).map(|(_, d)| d)
}

/// Whether `claim` is still prepared here with the same `devices` and the API still shows it stale.
async fn still_stale(
    state: &Arc<DriverState>,
    client: &kube::Client,
    claim: &ClaimRef,
    devices: Option<&BTreeSet<String>>,
) -> bool {
    let this = state.clone();
    let Ok(now) = tokio::task::spawn_blocking(move || this.prepared_claims()).await else { return false };
    if devices.is_none() || devices_of(&now, &claim.uid) != devices {
        return false;
    }
    let Some(devices) = devices else { return false };
    match Api::<ResourceClaim>::namespaced(client.clone(), &claim.namespace).get_opt(&claim.name).await {
        Ok(read) => why_stale(&claim.uid, devices, read.as_ref(), state.driver(), state.pool()).is_some(),
        Err(_) => false,
    }
}

/// Whether the Node's `Ready` condition is `True`: its kubelet runs (and stops the containers of pods the API no
/// longer has). Unreadable counts as not ready.
async fn node_ready(client: &kube::Client, node: &str) -> bool {
    match Api::<Node>::all(client.clone()).get(node).await {
        Ok(node) => {
            let conditions = node.status.and_then(|s| s.conditions).unwrap_or_default();
            conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True")
        }
        Err(error) => {
            debug!(%error, "reading the Node failed; prepared claims are checked next time");
            false
        }
    }
}
