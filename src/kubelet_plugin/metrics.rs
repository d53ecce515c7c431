//! What the kubelet plugin tells Prometheus: per-claim outcomes, call durations, what is prepared, and the
//! conditions an operator must act on (kubelet registration, a corrupt checkpoint).

use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

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
            // Prepares are expected in milliseconds (a claim read and a few fsync'd writes); 45 s is kubelet's limit.
            durations: Family::new_with_constructor(|| {
                Histogram::new([0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 45.0])
            }),
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
        sub.register("claims", "Claims prepared or unprepared, by operation and result", metrics.claims.clone());
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
            "Corrupt checkpoints found at start (rebuilt from the CDI specs on disk, then kept aside)",
            metrics.checkpoint_corruptions.clone(),
        );
        sub.register(
            "specs_rewritten",
            "CDI specs of prepared claims written again: found missing (deleted on the host), or saying something else \
             than they would now (the driver upgraded in place, or while no agent ran; a changed driver root or MPS \
             directory, found at start)",
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
             its record of them; see --stale-claims)",
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
