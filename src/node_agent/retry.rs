//! When the agent tries again after a round (discover and publish) failed: exponential back-off from 1 s to 5
//! minutes, so a broken driver or API server is not hammered, except while the agent's Node object or the NVIDIA
//! driver is missing.
//!
//! The driver is often installed after the agent starts: the GPU Operator's driver container builds and loads the
//! kernel modules minutes after the node joins, and reinstalls them on an upgrade. Backing off as for other failures
//! would leave the GPUs unpublished for up to 5 minutes after the driver is ready, so while NVML cannot be loaded
//! the agent looks again at least every [`DRIVER_MISSING_RETRY`] (a library load that fails costs a few file
//! lookups), on a node without GPUs too.
//!
//! A Node deleted and registered again under its name (`kubectl delete node` and a kubelet restart, a machine
//! replaced under the same name) takes the node's ResourceSlices with it: the garbage collector deletes them with
//! their owner. The agent can publish them again only once the new Node exists (they must be owned by it), and
//! nothing it watches changes when that happens. Backing off as for other failures would leave a re-registered
//! node's GPUs unpublished for up to the back-off reached while it was away (64 s after two minutes), so while the
//! Node is missing the agent looks again at least every [`NODE_MISSING_RETRY`], for [`NODE_MISSING_PATIENCE`], then
//! every [`NODE_LONG_MISSING_RETRY`]. Once its kubelet plugin runs, such a round stops at the Node's cached read
//! (one GET served from the API server's watch cache): no discovery, no slice listing. In a cluster the pod garbage
//! collector deletes the agent pod of a Node gone for good within about a minute.

use std::time::{Duration, Instant};

/// First pause after a failed round.
pub const BACKOFF_START: Duration = Duration::from_secs(1);
/// Longest pause after failed rounds.
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Longest pause while the Node object has been missing for less than [`NODE_MISSING_PATIENCE`].
pub const NODE_MISSING_RETRY: Duration = Duration::from_secs(5);
/// How long a missing Node is looked for every [`NODE_MISSING_RETRY`].
pub const NODE_MISSING_PATIENCE: Duration = Duration::from_secs(600);
/// Longest pause once the Node has been missing longer.
pub const NODE_LONG_MISSING_RETRY: Duration = Duration::from_secs(60);

/// Longest pause while NVML cannot be loaded (the driver not installed yet, or being reinstalled).
pub const DRIVER_MISSING_RETRY: Duration = Duration::from_secs(10);

/// Why a round failed.
#[derive(Debug)]
pub struct RoundFailure {
    pub reason: String,
    pub kind: FailureKind,
}

impl From<String> for RoundFailure {
    fn from(reason: String) -> Self {
        Self { reason, kind: FailureKind::Other }
    }
}

/// What a round failed for: something missing is looked for every few seconds and said once, not at every look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The Node object this agent publishes for does not exist (deleted, not yet registered, or a wrong
    /// `--node-name`).
    NodeMissing,
    /// NVML could not be loaded: no driver (yet) under `--driver-root`.
    DriverMissing,
    Other,
}

/// After a failed round with back-off `backoff`, the Node missing for `node_missing_for` (`None`: it is not), the
/// driver missing or not: (how long to wait now, the back-off after the next failure). While something is missing,
/// both are held to how often it is looked for, so the first failure of another kind once it is there waits
/// seconds, not the minutes the back-off would have reached meanwhile.
pub fn after_failure(
    backoff: Duration,
    node_missing_for: Option<Duration>,
    driver_missing: bool,
) -> (Duration, Duration) {
    let node_cap = match node_missing_for {
        Some(missing) if missing < NODE_MISSING_PATIENCE => Some(NODE_MISSING_RETRY),
        Some(_) => Some(NODE_LONG_MISSING_RETRY),
        None => None,
    };
    let driver_cap = driver_missing.then_some(DRIVER_MISSING_RETRY);
    let next = (backoff * 2).min(BACKOFF_MAX);
    match node_cap.into_iter().chain(driver_cap).min() {
        Some(cap) => (backoff.min(cap), next.min(cap)),
        None => (backoff, next),
    }
}

/// Since when the Node has been missing, after a failed round (`since` before it): from now when the round found
/// it missing (`node_missing`, or `node_exists` false) and it was not before; none once a round saw it. A round that
/// failed without reading it (`node_exists` `None`: the API server down, a discovery error) leaves the clock
/// running, so other failures in between do not restart [`NODE_MISSING_PATIENCE`].
pub fn missing_since(
    since: Option<Instant>,
    node_missing: bool,
    node_exists: Option<bool>,
    now: Instant,
) -> Option<Instant> {
    match (node_missing, node_exists) {
        (true, _) | (false, Some(false)) => Some(since.unwrap_or(now)),
        (false, Some(true)) => None,
        (false, None) => since,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_node_seen_stops_the_missing_clock() {
        let start = Instant::now();
        let later = start + Duration::from_secs(90);
        // (since, node_missing, node_exists) → since
        let table = [
            ((None, true, None), Some(later)),
            ((None, false, Some(false)), Some(later)),
            ((Some(start), true, Some(false)), Some(start)),
            ((Some(start), false, None), Some(start)),
            ((Some(start), false, Some(true)), None),
            ((None, false, None), None),
            // Seen by the read, then refused as missing by the publish (deleted in between): missing.
            ((Some(start), true, Some(true)), Some(start)),
        ];
        for ((since, missing, exists), expected) in table {
            assert_eq!(missing_since(since, missing, exists, later), expected, "{since:?} {missing} {exists:?}");
        }
    }

    #[test]
    fn back_off_doubles_to_its_cap_and_a_missing_node_is_looked_at_every_few_seconds_then_every_minute() {
        let s = Duration::from_secs;
        // (back-off, Node missing for, driver missing) → (wait, next back-off)
        let table = [
            ((s(1), None, false), (s(1), s(2))),
            ((s(32), None, false), (s(32), s(64))),
            ((s(256), None, false), (s(256), s(300))),
            ((s(300), None, false), (s(300), s(300))),
            // The Node missing: every 5 s at most for ten minutes, then every minute; the back-off held there too.
            ((s(1), Some(s(0)), false), (s(1), s(2))),
            ((s(4), Some(s(3)), false), (s(4), s(5))),
            ((s(64), Some(s(60)), false), (s(5), s(5))),
            ((s(5), Some(s(599)), false), (s(5), s(5))),
            ((s(5), Some(s(600)), false), (s(5), s(10))),
            ((s(32), Some(s(3600)), false), (s(32), s(60))),
            ((s(60), Some(s(3600)), false), (s(60), s(60))),
            // No driver (yet): every 10 s at most, however long.
            ((s(4), None, true), (s(4), s(8))),
            ((s(8), None, true), (s(8), s(10))),
            ((s(10), None, true), (s(10), s(10))),
            ((s(300), None, true), (s(10), s(10))),
            ((s(60), Some(s(600)), true), (s(10), s(10))),
            ((s(10), Some(s(60)), true), (s(5), s(5))),
        ];
        for ((backoff, missing, driver), expected) in table {
            assert_eq!(
                after_failure(backoff, missing, driver),
                expected,
                "back-off {backoff:?}, Node missing for {missing:?}, driver missing {driver}"
            );
        }
    }
}
