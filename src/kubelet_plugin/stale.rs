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

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;

/// How many checks in a row must find a claim stale before it is acted on.
pub const CHECKS: u32 = 2;

/// Why a claim prepared here is stale, from one read of it: `None` when the API still shows it allocated the
/// devices prepared. `read` is `None` when the claim does not exist.
pub fn why_stale(
    uid: &str,
    prepared: &BTreeSet<String>,
    read: Option<&ResourceClaim>,
    driver: &str,
    pool: &str,
) -> Option<&'static str> {
    let Some(claim) = read else { return Some("the claim is deleted") };
    if claim.metadata.uid.as_deref() != Some(uid) {
        return Some("the claim was deleted and another created under its name");
    }
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Some("the claim is no longer allocated");
    };
    let results = allocation.devices.as_ref().and_then(|d| d.results.as_deref()).unwrap_or_default();
    let here: BTreeSet<String> =
        results.iter().filter(|r| r.driver == driver && r.pool == pool).map(|r| r.device.clone()).collect();
    (here != *prepared).then_some("the claim is allocated other devices now")
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
