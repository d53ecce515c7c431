//! The periodic check for prepared claims the kubelet forgot ([`crate::kubelet_plugin::stale`] decides): every
//! interval, while the Node is `Ready`, each claim prepared here is read from the API; one found stale by two checks
//! an interval apart is reported (`warn`, the default) or, with `unprepare`, looked at once more (still prepared as
//! it was, still stale in the API, no pod on this node that is not done naming it) and unprepared through the same
//! path as the kubelet's call; either way with a Warning Event on the Node naming it and its GPUs.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::kubelet_plugin::allocation::ClaimRef;
use crate::kubelet_plugin::stale::{Suspects, pod_holds_claim, pods_may_hold, why_stale};
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
            // Nothing is checked while the Node is not Ready (the kubelet may be down, its pods still running), and
            // what was suspected starts again: the gauge says none, rather than what a check before said.
            suspects.node_not_ready();
            state.metrics().stale_claims.set(0);
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
        reported.retain(|(uid, _)| stale.iter().any(|(u, _)| u == uid));
        for (uid, why) in stale {
            let Some((claim, devices)) = prepared.iter().find(|(c, _)| c.uid == uid) else { continue };
            let devices: Vec<&str> = devices.iter().map(String::as_str).collect();
            let devices = devices.join(", ");
            match action {
                StaleClaimAction::Warn => {
                    if reported.insert((uid.clone(), "stale")) {
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
                    let Some((why, now)) = still_stale(&state, &client, claim, devices_of(&prepared, &uid)).await
                    else {
                        suspects.forget(&uid);
                        continue;
                    };
                    // Deleted by hand (its finalizer removed) while its pod runs, the pod still names it. Still
                    // suspected meanwhile: looked at again at each check, and unprepared once its pods are done.
                    let held = if pods_may_hold(why) {
                        held_here(&client, &node, claim, now.as_ref()).await
                    } else {
                        Ok(Vec::new())
                    };
                    let kept = match held {
                        Ok(users) if users.is_empty() => None,
                        Ok(users) => Some(format!(
                            "while pods on this node that are not done still name it: {}. Kept prepared (its GPUs \
                             refused to other claims) until they are done or gone; a claim deleted while in use had \
                             its finalizer removed by hand",
                            users.join(", ")
                        )),
                        Err(error) => Some(format!(
                            "listing this node's pods to see whether one still uses it failed ({error}). Kept \
                             prepared, checked again at each check; to unprepare, the agent needs list on pods (the \
                             chart grants it with staleClaims.action unprepare)"
                        )),
                    };
                    if let Some(kept) = kept {
                        if reported.insert((uid.clone(), "kept")) {
                            warn!(claim = %claim, %uid, why, %kept, "a stale claim is kept prepared");
                            let note = format!(
                                "Claim {claim} (UID {uid}) is prepared on this node for {devices}, but {why}, {kept}."
                            );
                            super::plugin::node_warning(
                                client.clone(),
                                &node,
                                "StaleClaimPrepared",
                                "CheckClaims",
                                note,
                            )
                            .await;
                        }
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
                            if reported.insert((uid.clone(), "failed")) {
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

/// Why `claim` is stale, and the claim of its name the API has now, when it is still prepared here with the same
/// `devices` and the API still shows it stale; `None` otherwise (or when either cannot be read).
async fn still_stale(
    state: &Arc<DriverState>,
    client: &kube::Client,
    claim: &ClaimRef,
    devices: Option<&BTreeSet<String>>,
) -> Option<(&'static str, Option<ResourceClaim>)> {
    let this = state.clone();
    let now = tokio::task::spawn_blocking(move || this.prepared_claims()).await.ok()?;
    let devices = devices.filter(|devices| devices_of(&now, &claim.uid) == Some(*devices))?;
    let read = Api::<ResourceClaim>::namespaced(client.clone(), &claim.namespace).get_opt(&claim.name).await.ok()?;
    let why = why_stale(&claim.uid, devices, read.as_ref(), state.driver(), state.pool())?;
    Some((why, read))
}

/// The pods on `node` that still hold the prepared `claim` ([`pod_holds_claim`]; `now`: the claim of its name the
/// API has now, if any), as `namespace/name`.
async fn held_here(
    client: &kube::Client,
    node: &str,
    claim: &ClaimRef,
    now: Option<&ResourceClaim>,
) -> kube::Result<Vec<String>> {
    let reserved_now = now.and_then(|c| c.status.as_ref()?.reserved_for.as_deref()).unwrap_or_default();
    let created_now = now.and_then(|c| c.metadata.creation_timestamp.as_ref()).map(|t| t.0);
    let pods = ApiResource::erase::<Pod>(&());
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), &claim.namespace, &pods);
    let on_node = api.list(&ListParams::default().fields(&format!("spec.nodeName={node}"))).await?;
    let holders = on_node.items.iter().filter(|pod| {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        pod_holds_claim(uid, &pod.data, &claim.name, reserved_now, created_now)
    });
    Ok(holders.map(|pod| format!("{}/{}", claim.namespace, pod.metadata.name.as_deref().unwrap_or_default())).collect())
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
