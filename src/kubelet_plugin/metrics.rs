//! What the kubelet plugin tells Prometheus: per-claim outcomes, call durations, what is prepared, and the
//! conditions an operator must act on (kubelet registration, a corrupt checkpoint).

use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Call durations' bucket bounds, in seconds. A prepare is expected in milliseconds (a claim read and a few fsync'd
/// writes); the slow steps' own limits then fall in buckets of their own: an MPS daemon's start (15 s), an
/// `nvidia-smi` run or a MIG change stuck in the driver (tens of seconds), and the kubelet's deadline (45 s: a call it
/// gave up on is observed at about 45 s, in the `60` bucket with the few answered after 44 s, and counted
/// `abandoned`).
const DURATION_BUCKETS: [f64; 17] =
    [0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 44.0, 60.0];

/// The two calls the kubelet makes.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Operation {
    Prepare,
    Unprepare,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    operation: Operation,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: Operation,
}

/// The plugin's metrics; cheap to clone (every field is a shared handle).
#[derive(Clone, Debug)]
pub struct PluginMetrics {
    claims: Family<ClaimLabels, Counter>,
    durations: Family<OperationLabels, Histogram>,
    pub prepared_claims: Gauge,
    pub prepared_devices: Gauge,
    pub checkpoint_corruptions: Counter,
    pub checkpoint_saves: Counter,
    pub specs_rewritten: Counter,
    pub time_slice_restore_failures: Counter,
    pub compute_mode_restore_failures: Counter,
    pub mps_daemon_restarts: Counter,
    waiting: Family<OperationLabels, Gauge>,
    pub registered: Gauge,
    pub stale_claims: Gauge,
    pub stale_claims_unprepared: Counter,
}

impl PluginMetrics {
    /// Creates the metrics and registers them under `gpu_dra_kubelet_plugin_`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            claims: Family::default(),
            durations: Family::new_with_constructor(|| Histogram::new(DURATION_BUCKETS)),
            prepared_claims: Gauge::default(),
            prepared_devices: Gauge::default(),
            checkpoint_corruptions: Counter::default(),
            checkpoint_saves: Counter::default(),
            specs_rewritten: Counter::default(),
            time_slice_restore_failures: Counter::default(),
            compute_mode_restore_failures: Counter::default(),
            mps_daemon_restarts: Counter::default(),
            waiting: Family::default(),
            registered: Gauge::default(),
            stale_claims: Gauge::default(),
            stale_claims_unprepared: Counter::default(),
        };
        let sub = registry.sub_registry_with_prefix("gpu_dra_kubelet_plugin");
        sub.register(
            "claims",
            "Claims in the kubelet's calls, by operation and result: success, error (the kubelet was told why), \
             abandoned (the kubelet stopped waiting for the call, e.g. its 45 s deadline passed; the kubelet asks \
             again). A claim in several calls counts once for each",
            metrics.claims.clone(),
        );
        sub.register(
            "request_duration_seconds",
            "Duration of NodePrepareResources / NodeUnprepareResources calls",
            metrics.durations.clone(),
        );
        sub.register("prepared_claims", "Claims prepared on this node", metrics.prepared_claims.clone());
        sub.register(
            "prepared_devices",
            "Devices prepared for claims on this node (a device shared by several claims counts once for each)",
            metrics.prepared_devices.clone(),
        );
        sub.register(
            "checkpoint_corruptions",
            "Corrupt checkpoints found at start (rebuilt from the CDI specs on disk, then kept aside); counted before \
             the first scrape, so alert on a value above 0, not on increase()",
            metrics.checkpoint_corruptions.clone(),
        );
        sub.register(
            "specs_rewritten",
            "CDI specs of prepared claims written again: found missing (deleted on the host), or saying something else \
             than they would now (the driver upgraded in place, or while no agent ran; a changed driver root or MPS \
             directory, found at start: counted before the first scrape, where increase() misses them)",
            metrics.specs_rewritten.clone(),
        );
        sub.register(
            "checkpoint_saves",
            "Checkpoint saves, each an fsync'd atomic write; calls that arrive together share them",
            metrics.checkpoint_saves.clone(),
        );
        sub.register(
            "time_slice_restore_failures",
            "Failed attempts to set a GPU's time slice back after its claims went, or again at start-up (the next \
             unprepare or start-up tries again)",
            metrics.time_slice_restore_failures.clone(),
        );
        sub.register(
            "compute_mode_restore_failures",
            "Failed attempts to set a GPU's compute mode back to DEFAULT after its MPS daemon went, or at start-up \
             (the next unprepare or start-up tries again)",
            metrics.compute_mode_restore_failures.clone(),
        );
        sub.register(
            "mps_daemon_restarts",
            "MPS control daemons started again after they exited while their claim was prepared",
            metrics.mps_daemon_restarts.clone(),
        );
        sub.register(
            "calls_waiting",
            "Calls waiting for the state lock, by operation (a slow or hung disk shows here first)",
            metrics.waiting.clone(),
        );
        sub.register("registered", "1 while the kubelet reports the plugin registered", metrics.registered.clone());
        sub.register(
            "stale_claims",
            "Claims prepared here that the last check found no longer allocated what was prepared (the kubelet lost \
             its record of them; see --stale-claims); 0 while the Node is not Ready or cannot be read (nothing is \
             checked then)",
            metrics.stale_claims.clone(),
        );
        sub.register(
            "stale_claims_unprepared",
            "Stale claims the agent unprepared itself (--stale-claims=unprepare)",
            metrics.stale_claims_unprepared.clone(),
        );
        metrics
    }

    /// Counts one claim's outcome.
    pub fn claim(&self, operation: Operation, ok: bool) {
        let result = if ok { "success" } else { "error" };
        self.claims.get_or_create(&ClaimLabels { operation, result }).inc();
    }

    /// Watches a call of `operation` for `claims` until [`Abandonment::answered`]: dropped before that (the kubelet
    /// stopped waiting, and the gRPC server dropped the call), it counts each claim `abandoned` and says so in the
    /// log. Otherwise nothing would: the kubelet's pods sit in ContainerCreating while every count stays flat.
    pub fn watch_call(&self, operation: Operation, claims: Vec<String>) -> Abandonment {
        Abandonment { metrics: self.clone(), operation, claims, start: Instant::now(), answered: false }
    }

    /// The gauge of calls of `operation` waiting for the state lock.
    pub fn waiting(&self, operation: Operation) -> Gauge {
        self.waiting.get_or_create(&OperationLabels { operation }).clone()
    }

    /// Observes the call's duration when the returned guard drops.
    pub fn time(&self, operation: Operation) -> CallTimer {
        CallTimer {
            histogram: self.durations.get_or_create(&OperationLabels { operation }).clone(),
            start: Instant::now(),
        }
    }
}

/// Records the elapsed time into its histogram on drop, however the call ends.
#[derive(Debug)]
pub struct CallTimer {
    histogram: Histogram,
    start: Instant,
}

impl Drop for CallTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

/// A call in flight; see [`PluginMetrics::watch_call`].
#[derive(Debug)]
pub struct Abandonment {
    metrics: PluginMetrics,
    operation: Operation,
    /// The claims asked, as `namespace/name`.
    claims: Vec<String>,
    start: Instant,
    answered: bool,
}

impl Abandonment {
    /// The call is answered (its claims counted by their outcome).
    pub fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Abandonment {
    fn drop(&mut self) {
        // A panic in the call is its own fault, logged as one. (A call in flight when the agent stops is counted
        // here too: its answer is lost all the same.)
        if self.answered || std::thread::panicking() {
            return;
        }
        let labels = ClaimLabels { operation: self.operation, result: "abandoned" };
        self.metrics.claims.get_or_create(&labels).inc_by(self.claims.len() as u64);
        tracing::warn!(
            operation = ?self.operation,
            claims = ?self.claims,
            after = ?self.start.elapsed(),
            "the kubelet stopped waiting for the call (its deadline passed, or it went away): what was queued of it \
             goes on, its answer is lost, and the kubelet asks again. A slow API server (the claims' reads), a hung \
             disk or slow GPU work (calls_waiting, the request durations) holds calls this long"
        );
    }
}
