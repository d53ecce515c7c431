//! Pure: which claims prepared here the kubelet forgot. The kubelet unprepares a claim when its pods are gone, from
//! its own record of what it prepared (`dra_manager_state`). A kubelet that lost that record (the file deleted, a
//! node re-provisioned with the agent's state directory kept) never does: the claim stays prepared for nobody, its
//! GPU refused to every later claim ("already prepared for claim …") until the node is rebooted. NVIDIA's driver has
//! the same hole for completed prepares (kubernetes-sigs/dra-driver-nvidia-gpu #1278).
//!
//! A prepared claim is **stale** when the API no longer shows it allocated what this node prepared: the claim is
//! gone (deleted, or deleted and created again under its name), no longer allocated, or allocated other devices.
//! Neither can happen while a pod uses it: the allocation has a finalizer and is removed only once the claim is
//! reserved for no pod, and the claim controllers release a pod's reservation only once the pod is done or gone.
//! A pod force-deleted from the API while its containers still run is gone too: only the kubelet can still stop
//! them, so a claim counts as stale only through checks that each found the Node `Ready` (its kubelet up, which
//! stops containers of pods the API no longer has within seconds of starting), [`CHECKS`] in a row for the same
//! reason, the first at least one check interval before the last: a transient state (the kubelet unpreparing just
//! after the controller deallocated) is never acted on. What no check can tell is a container the kubelet cannot
//! stop (a process stuck in the driver after a GPU fault, its pod force-deleted): the kubelet has not forgotten
//! that claim and unprepares it once the container is gone, and its GPU must not be handed out before. So acting
//! is the operator's choice (`--stale-claims=unprepare`); by default such claims are only reported.
//!
//! The finalizer is no guarantee either: anyone who may update a claim (the built-in `edit` role) may remove it, and
//! a claim deleted then is gone at once while its pod runs on, its GPU free for the scheduler to give to another
//! claim. So before unpreparing a claim deleted (or deleted and created again), the agent also looks for pods on
//! this node that still name it ([`pod_holds_claim`]); while one does, the claim stays prepared, and another claim
//! for its GPU stays refused. A claim's status (deallocated, allocated other devices) is written only by the
//! scheduler and the claim controllers, never by a tenant, so those reasons need no such look: the pod naming a
//! claim allocated other devices is the one waiting for them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimConsumerReference};
use k8s_openapi::jiff::Timestamp;

/// How many checks in a row must find a claim stale before it is acted on.
pub const CHECKS: u32 = 2;

/// The claim is gone.
pub const DELETED: &str = "the claim is deleted";
/// A claim of the same name with another UID exists.
pub const CREATED_AGAIN: &str = "the claim was deleted and another created under its name";

/// Why a claim prepared here is stale, from one read of it: `None` when the API still shows it allocated the
/// devices prepared. `read` is `None` when the claim does not exist.
pub fn why_stale(
    uid: &str,
    prepared: &BTreeSet<String>,
    read: Option<&ResourceClaim>,
    driver: &str,
    pool: &str,
) -> Option<&'static str> {
    let Some(claim) = read else { return Some(DELETED) };
    if claim.metadata.uid.as_deref() != Some(uid) {
        return Some(CREATED_AGAIN);
    }
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Some("the claim is no longer allocated");
    };
    let results = allocation.devices.as_ref().and_then(|d| d.results.as_deref()).unwrap_or_default();
    let here: BTreeSet<String> =
        results.iter().filter(|r| r.driver == driver && r.pool == pool).map(|r| r.device.clone()).collect();
    (here != *prepared).then_some("the claim is allocated other devices now")
}

/// Whether pods may still hold a claim found stale for `why`: only where the claim was deleted (its finalizer
/// removed by hand), not where its status changed (see the module docs).
pub fn pods_may_hold(why: &str) -> bool {
    why == DELETED || why == CREATED_AGAIN
}

/// Whether `pod` (its UID and the object as the API serves it) is not done and names the claim `claim` of its
/// namespace that was prepared here: in `spec.resourceClaims` (a claim by name), `status.resourceClaimStatuses` (one
/// made from a template, or a PodGroup's) or `status.extendedResourceClaimStatus` (the scheduler's claim for extended
/// resources). A pod being deleted still counts: its containers may run until the kubelet has stopped them. A done
/// pod (`Succeeded`, `Failed`) holds nothing, and neither does one that the claim of that name existing now
/// (`reserved_now`: its `status.reservedFor`; `created_now`: its creation) was reserved for: by the pod's UID (the
/// scheduler reserves a claim only for a pod it is scheduling, which therefore never ran on the old one), or by its
/// PodGroup when the pod was scheduled after the new claim was created (a PodGroup a tenant names after the fact
/// does not make a pod that ran on the old claim let go of it).
pub fn pod_holds_claim(
    pod_uid: &str,
    pod: &serde_json::Value,
    claim: &str,
    reserved_now: &[ResourceClaimConsumerReference],
    created_now: Option<Timestamp>,
) -> bool {
    if matches!(pod.pointer("/status/phase").and_then(serde_json::Value::as_str), Some("Succeeded" | "Failed")) {
        return false;
    }
    let group = pod.pointer("/spec/schedulingGroup/podGroupName").and_then(serde_json::Value::as_str);
    // Strictly after: both times have second precision, and a tie must not free the old claim.
    let scheduled_after_it = created_now.zip(scheduled_at(pod)).is_some_and(|(created, scheduled)| scheduled > created);
    let new_claims = reserved_now.iter().any(|consumer| match consumer.resource.as_str() {
        "pods" => consumer.uid == pod_uid,
        "podgroups" => Some(consumer.name.as_str()) == group && scheduled_after_it,
        _ => false,
    });
    if new_claims {
        return false;
    }
    let names = |pointer: &str| -> Vec<&str> {
        let list = pod.pointer(pointer).and_then(serde_json::Value::as_array).map(Vec::as_slice).unwrap_or_default();
        list.iter().filter_map(|entry| entry.get("resourceClaimName")?.as_str()).collect()
    };
    let extended = pod.pointer("/status/extendedResourceClaimStatus/resourceClaimName").and_then(|n| n.as_str());
    names("/spec/resourceClaims")
        .into_iter()
        .chain(names("/status/resourceClaimStatuses"))
        .chain(extended)
        .any(|n| n == claim)
}

/// When the pod's `PodScheduled` condition last became `True`.
fn scheduled_at(pod: &serde_json::Value) -> Option<Timestamp> {
    let conditions = pod.pointer("/status/conditions")?.as_array()?;
    let scheduled = conditions.iter().find(|c| c["type"] == "PodScheduled" && c["status"] == "True")?;
    scheduled["lastTransitionTime"].as_str()?.parse().ok()
}

/// Claims found stale by the checks so far, until acted on or found in use again.
#[derive(Debug, Default)]
pub struct Suspects {
    /// By claim UID: when it was first found stale in this run of checks, how many checks in a row did, and why.
    seen: BTreeMap<String, (Instant, u32, &'static str)>,
}

impl Suspects {
    /// Records one round of checks made at `now` while the Node was `Ready`, each claim checked with why it is
    /// stale (or `None`); claims not checked this round (a failed read) are forgotten, so their count starts again.
    /// Returns the claims stale enough to act on, with why.
    pub fn record(
        &mut self,
        now: Instant,
        interval: Duration,
        checked: &[(String, Option<&'static str>)],
    ) -> Vec<(String, &'static str)> {
        let mut next = BTreeMap::new();
        for (uid, why) in checked {
            let Some(why) = why else { continue };
            // Found stale for another reason (deallocated, then allocated other devices): it starts again.
            let (first, count) = match self.seen.get(uid) {
                Some((first, count, before)) if before == why => (*first, *count),
                _ => (now, 0),
            };
            next.insert(uid.clone(), (first, count + 1, *why));
        }
        self.seen = next;
        self.seen
            .iter()
            .filter(|(_, (first, count, _))| *count >= CHECKS && now.duration_since(*first) >= interval)
            .map(|(uid, (_, _, why))| (uid.clone(), *why))
            .collect()
    }

    /// A round made while the Node was not `Ready` (or unreadable): nothing counts, every claim starts again.
    pub fn node_not_ready(&mut self) {
        self.seen.clear();
    }

    /// Forgets a claim once acted on.
    pub fn forget(&mut self, uid: &str) {
        self.seen.remove(uid);
    }

    /// How many claims are suspected now.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const UID: &str = "3f1c";

    fn claim(uid: &str, allocated: Option<&[(&str, &str, &str)]>) -> ResourceClaim {
        let mut object = json!({"metadata": {"name": "c", "namespace": "ns", "uid": uid}, "spec": {}});
        if let Some(results) = allocated {
            let results: Vec<_> = results
                .iter()
                .map(|(driver, pool, device)| json!({"request": "gpu", "driver": driver, "pool": pool, "device": device}))
                .collect();
            object["status"] = json!({"allocation": {"devices": {"results": results}}});
        }
        serde_json::from_value(object).unwrap_or_default()
    }

    #[test]
    fn a_pod_not_done_that_names_the_claim_holds_it() {
        let named = json!({"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]}});
        let recorded = json!({"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
                              "status": {"phase": "Running", "resourceClaimStatuses": [
                                  {"name": "other", "resourceClaimName": "x"}, {"name": "gpu", "resourceClaimName": "c"}]}});
        let extended = json!({"status": {"extendedResourceClaimStatus": {"resourceClaimName": "c"}}});
        let deleting = json!({"metadata": {"deletionTimestamp": "2026-12-06T10:00:00Z"},
                              "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]},
                              "status": {"phase": "Running"}});
        let in_group = json!({"spec": {"schedulingGroup": {"podGroupName": "g"}},
                              "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "c"}]}});
        let cases = [
            (named.clone(), true),
            (recorded, true),
            (extended, true),
            (deleting, true),
            (in_group.clone(), true),
            (json!({"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "c2"}]}}), false),
            (json!({"spec": {"resourceClaims": [{"name": "c", "resourceClaimTemplateName": "c"}]}}), false),
            (json!({"spec": {"containers": []}}), false),
            (json!({"spec": named["spec"], "status": {"phase": "Succeeded"}}), false),
            (json!({"spec": named["spec"], "status": {"phase": "Failed"}}), false),
        ];
        for (pod, want) in cases {
            assert_eq!(pod_holds_claim("pod-uid", &pod, "c", &[], None), want, "{pod}");
        }
        // The claim of that name now is another, reserved for this pod or its group: the pod names that one.
        let consumer = |resource: &str, name: &str, uid: &str| ResourceClaimConsumerReference {
            resource: resource.into(),
            name: name.into(),
            uid: uid.into(),
            ..Default::default()
        };
        let created: Option<Timestamp> = "2026-12-06T10:00:00Z".parse().ok();
        assert!(!pod_holds_claim("pod-uid", &named, "c", &[consumer("pods", "p", "pod-uid")], created));
        assert!(pod_holds_claim("pod-uid", &named, "c", &[consumer("pods", "p", "other-uid")], created));
        // By its group only when the pod was scheduled after the claim of that name was created: a group named
        // after the fact does not free a pod that ran on the old claim.
        let scheduled = |at: &str| {
            let mut pod = in_group.clone();
            pod["status"]["conditions"] = json!([{"type": "PodScheduled", "status": "True", "lastTransitionTime": at}]);
            pod
        };
        let group = [consumer("podgroups", "g", "g-uid")];
        assert!(!pod_holds_claim("pod-uid", &scheduled("2026-12-06T10:00:05Z"), "c", &group, created));
        assert!(pod_holds_claim("pod-uid", &scheduled("2026-12-06T09:59:00Z"), "c", &group, created));
        assert!(pod_holds_claim("pod-uid", &scheduled("2026-12-06T10:00:00Z"), "c", &group, created), "a tie");
        assert!(pod_holds_claim("pod-uid", &in_group, "c", &group, created), "not known to be scheduled after");
        let other_group = [consumer("podgroups", "h", "h-uid")];
        assert!(pod_holds_claim("pod-uid", &scheduled("2026-12-06T10:00:05Z"), "c", &other_group, created));
        // Only a deleted claim can still be held; a status change is the scheduler's or a controller's.
        assert!(pods_may_hold(DELETED) && pods_may_hold(CREATED_AGAIN));
        assert!(!pods_may_hold("the claim is no longer allocated"));
        assert!(!pods_may_hold("the claim is allocated other devices now"));
    }

    #[test]
    fn a_claim_is_stale_when_the_api_no_longer_allocates_it_what_was_prepared() {
        let prepared = BTreeSet::from(["gpu-0".to_string()]);
        let ours = ("d.x", "node-a", "gpu-0");
        let cases: [(Option<ResourceClaim>, Option<&str>); 6] = [
            (Some(claim(UID, Some(&[ours]))), None),
            (Some(claim(UID, Some(&[ours, ("other.x", "pool", "nic-0")]))), None),
            (None, Some("the claim is deleted")),
            (Some(claim("other-uid", Some(&[ours]))), Some("the claim was deleted and another created under its name")),
            (Some(claim(UID, None)), Some("the claim is no longer allocated")),
            (Some(claim(UID, Some(&[("d.x", "node-a", "gpu-1")]))), Some("the claim is allocated other devices now")),
        ];
        for (read, want) in cases {
            assert_eq!(why_stale(UID, &prepared, read.as_ref(), "d.x", "node-a"), want, "{read:?}");
        }
    }

    #[test]
    fn only_checks_in_a_row_over_an_interval_while_ready_count() {
        let interval = Duration::from_secs(60);
        let start = Instant::now();
        let gone = |uid: &str| (uid.to_string(), Some("the claim is deleted"));
        let mut suspects = Suspects::default();
        assert!(suspects.record(start, interval, &[gone("a"), gone("b")]).is_empty(), "one check is not enough");
        // A failed read of b: its count starts again.
        let at = start + interval;
        assert_eq!(suspects.record(at, interval, &[gone("a")]), [("a".to_string(), "the claim is deleted")]);
        assert_eq!(suspects.len(), 1);
        // Two quick checks are not an interval apart.
        let mut quick = Suspects::default();
        quick.record(start, interval, &[gone("a")]);
        assert!(quick.record(start + interval / 2, interval, &[gone("a")]).is_empty());
        // In use again, or the Node not Ready: it starts again.
        let mut back = Suspects::default();
        back.record(start, interval, &[gone("a")]);
        back.record(start + interval / 2, interval, &[("a".to_string(), None)]);
        assert!(back.record(start + interval * 2, interval, &[gone("a")]).is_empty());
        back.node_not_ready();
        assert!(back.is_empty());
        // Another reason starts it again.
        let mut other = Suspects::default();
        other.record(start, interval, &[("a".to_string(), Some("the claim is no longer allocated"))]);
        assert!(other.record(start + interval, interval, &[gone("a")]).is_empty());
        assert_eq!(other.record(start + interval * 2, interval, &[gone("a")]).len(), 1);
        assert!(back.record(start + interval * 3, interval, &[gone("a")]).is_empty());
    }
}
