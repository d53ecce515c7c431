//! The controller's Prometheus metrics. Names follow kube-controller-manager's where a twin exists, so existing
//! dashboards and alerts keep working: the work-queue metrics of client-go (`workqueue_*{name="resource_claim"}`,
//! same names, label, help and buckets as `k8s.io/component-base/metrics/prometheus/workqueue`),
//! `dynamic_resource_allocation_resourceclaim_creates_total` and `dynamic_resource_allocation_resource_claims`
//! (labels and help as `k8s.io/dynamic-resource-allocation/resourceclaim/metrics` and
//! `pkg/controller/resourceclaim/metrics`). Every label value comes from a fixed set.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::cache::Caches;
use super::decide::is_allocated;
use super::queue::WorkQueue;

use super::CLAIM_FIELD_MANAGER;
use super::foreign::manager_label;

/// The `name` label of the work-queue metrics: kube-controller-manager's name for this controller's queue.
pub const QUEUE_NAME: &str = "resource_claim";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CreateLabels {
    status: &'static str,
    admin_access: &'static str,
    owner_api_group: &'static str,
    owner_api_kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabel {
    name: &'static str,
}

/// A metric of the work queue, encoded with the queue's `name` label (as client-go's metrics provider does).
#[derive(Debug)]
struct OfQueue<M>(M);

impl<M: EncodeMetric> EncodeMetric for OfQueue<M> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder.encode_family(&QueueLabel { name: QUEUE_NAME })?)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SyncLabels {
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ManagerLabels {
    /// `kube-controller-manager` or `other` ([`manager_label`]): never the name a writer chose.
    field_manager: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    allocated: &'static str,
    admin_access: &'static str,
    source: &'static str,
}

/// Metrics the controller updates as it works.
#[derive(Debug)]
pub struct ControllerMetrics {
    creates: Family<CreateLabels, Counter>,
    syncs: Family<SyncLabels, Histogram>,
    another_controller: Gauge,
    observe_only: Gauge,
    leader: Gauge,
    waiting_for_quota: Gauge,
}

impl ControllerMetrics {
    pub fn register(
        registry: &mut Registry,
        caches: Arc<Caches>,
        queue: WorkQueue,
        events: super::events::Events,
    ) -> Self {
        let metrics = Self {
            creates: Family::default(),
            // 1 ms to 65.5 s: past the 60 s a sync is cut at.
            syncs: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 17))),
            another_controller: Gauge::default(),
            observe_only: Gauge::default(),
            leader: Gauge::default(),
            waiting_for_quota: Gauge::default(),
        };
        registry.register(
            "gpu_dra_controller_sync_duration_seconds",
            "Time to sync one pod, claim or PodGroup key, by kind (pod|claim|podgroup) and result (success or the error's label)",
            metrics.syncs.clone(),
        );
        registry.register(
            "gpu_dra_controller_another_claim_controller_detected",
            "1 once a pod's status recorded a claim another ResourceClaim controller generated while this one led",
            metrics.another_controller.clone(),
        );
        registry.register(
            "gpu_dra_controller_observe_only",
            "1 when another active ResourceClaim controller was detected and this one only observes \
             (--on-another-claim-controller=observe-only)",
            metrics.observe_only.clone(),
        );
        registry.register(
            "gpu_dra_controller_leader",
            "1 while this replica holds the leader lease",
            metrics.leader.clone(),
        );
        registry.register(
            "gpu_dra_controller_waiting_for_quota",
            "Pods and PodGroups whose claims a ResourceQuota refused, waiting for a quota of their namespace to leave \
             room (each counted until a sync is not refused for quota, or its pod or PodGroup goes)",
            metrics.waiting_for_quota.clone(),
        );
        let creates = metrics.creates.clone();
        let leader = metrics.leader.clone();
        registry.register_collector(Box::new(UpstreamMetrics {
            creates,
            queue: queue.clone(),
            leader: leader.clone(),
        }));
        registry.register_collector(Box::new(ScrapeTimeMetrics { caches, queue, events, leader }));
        metrics
    }

    /// A create request for a claim owned by a Pod.
    pub fn claim_created(&self, success: bool, admin_access: bool) {
        self.claim_created_for_owner(success, admin_access, "", "Pod");
    }

    /// A create request for a claim whose controlling owner has API group `owner_api_group` ("" for the core
    /// group) and kind `owner_api_kind`, as kube-controller-manager labels it (`scheduling.k8s.io`, `PodGroup`).
    pub fn claim_created_for_owner(
        &self,
        success: bool,
        admin_access: bool,
        owner_api_group: &'static str,
        owner_api_kind: &'static str,
    ) {
        self.creates
            .get_or_create(&CreateLabels {
                status: if success { "success" } else { "failure" },
                admin_access: bool_label(admin_access),
                owner_api_group,
                owner_api_kind,
            })
            .inc();
    }

    pub fn sync_finished(&self, kind: &'static str, result: &'static str, seconds: f64) {
        self.syncs.get_or_create(&SyncLabels { kind, result }).observe(seconds);
    }

    pub fn set_another_controller_detected(&self, on: bool) {
        self.another_controller.set(i64::from(on));
    }

    pub fn set_observe_only(&self, on: bool) {
        self.observe_only.set(i64::from(on));
    }

    pub fn set_leader(&self, on: bool) {
        self.leader.set(i64::from(on));
    }

    pub fn set_waiting_for_quota(&self, keys: usize) {
        self.waiting_for_quota.set(i64::try_from(keys).unwrap_or(i64::MAX));
    }
}

fn bool_label(b: bool) -> &'static str {
    if b { "true" } else { "false" }
}

/// kube-controller-manager's metrics that count as the controller works: the claim creates and the work queue's
/// counters and histograms. Encoded through a collector because help texts given to `Registry::register` get a
/// full stop appended, and these keep upstream's help to the letter.
#[derive(Debug)]
struct UpstreamMetrics {
    creates: Family<CreateLabels, Counter>,
    queue: WorkQueue,
    /// Only the leader exports them, as only a leading kube-controller-manager runs the controller: a warm standby
    /// would otherwise double every claim count and show a queue no worker drains.
    leader: Gauge,
}

impl Collector for UpstreamMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if self.leader.get() == 0 {
            return Ok(());
        }
        self.creates.encode(encoder.encode_descriptor(
            "dynamic_resource_allocation_resourceclaim_creates",
            "[ALPHA] Number of ResourceClaims creation requests, categorized by creation status, admin access, and \
             owning API group and kind (either Pod or scheduling.k8s.io/PodGroup)",
            None,
            MetricType::Counter,
        )?)?;
        let queued = self.queue.metrics();
        for (name, help, counter) in [
            ("workqueue_adds", "[BETA] Total number of adds handled by workqueue", &queued.adds),
            ("workqueue_retries", "[BETA] Total number of retries handled by workqueue", &queued.retries),
        ] {
            OfQueue(counter.clone()).encode(encoder.encode_descriptor(name, help, None, MetricType::Counter)?)?;
        }
        for (name, help, histogram) in [
            (
                "workqueue_queue_duration_seconds",
                "[BETA] How long in seconds an item stays in workqueue before being requested.",
                &queued.queue_duration,
            ),
            (
                "workqueue_work_duration_seconds",
                "[BETA] How long in seconds processing an item from workqueue takes.",
                &queued.work_duration,
            ),
        ] {
            OfQueue(histogram.clone()).encode(encoder.encode_descriptor(name, help, None, MetricType::Histogram)?)?;
        }
        Ok(())
    }
}

/// Metrics computed when scraped: the claims gauges from the cache, the queue's depth and work in progress.
#[derive(Debug)]
struct ScrapeTimeMetrics {
    caches: Arc<Caches>,
    queue: WorkQueue,
    events: super::events::Events,
    /// The claim and queue gauges are the leader's only (see [`UpstreamMetrics::leader`]).
    leader: Gauge,
}

impl Collector for ScrapeTimeMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let dropped = prometheus_client::metrics::counter::ConstCounter::new(self.events.dropped());
        dropped.encode(encoder.encode_descriptor(
            "gpu_dra_controller_events_dropped",
            "Events not sent because too many were in flight",
            None,
            MetricType::Counter,
        )?)?;
        if self.leader.get() == 0 {
            return Ok(());
        }
        let claims: Family<ClaimLabels, Gauge> = Family::default();
        let foreign: Family<ManagerLabels, Gauge> = Family::default();
        for claim in self.caches.claims.state() {
            let generated = claim.pod_claim_name.is_some() && super::decide::owning_pod(&claim).is_some();
            if generated && !claim.writers.iter().any(|w| w == CLAIM_FIELD_MANAGER) {
                let field_manager = manager_label(claim.writers.first().map_or("", String::as_str));
                foreign.get_or_create(&ManagerLabels { field_manager }).inc();
            }
            // Upstream's order: the extended-resource annotation first, and a pod-claim name only when not empty.
            let source = if claim.extended_resource {
                "extended_resource"
            } else if claim.pod_claim_name.as_deref().is_some_and(|n| !n.is_empty()) {
                "resource_claim_template"
            } else {
                ""
            };
            claims
                .get_or_create(&ClaimLabels {
                    allocated: bool_label(is_allocated(&claim)),
                    admin_access: bool_label(claim.admin_access),
                    source,
                })
                .inc();
        }
        claims.encode(encoder.encode_descriptor(
            "dynamic_resource_allocation_resource_claims",
            "[ALPHA] Number of ResourceClaims, categorized by allocation status, admin access, and source. Source \
             can be 'resource_claim_template' (created from a template), 'extended_resource' (extended resources), \
             or empty (manually created by a user).",
            None,
            MetricType::Gauge,
        )?)?;
        foreign.encode(encoder.encode_descriptor(
            "gpu_dra_controller_foreign_claims",
            "Claims generated for pods (pod-claim-name annotation, a Pod as controlling owner) that another field \
             manager created, by that manager: kube-controller-manager or other",
            None,
            MetricType::Gauge,
        )?)?;
        let depth = ConstGauge::new(i64::try_from(self.queue.waiting()).unwrap_or(i64::MAX));
        OfQueue(depth).encode(encoder.encode_descriptor(
            "workqueue_depth",
            "[BETA] Current depth of workqueue",
            None,
            MetricType::Gauge,
        )?)?;
        let in_progress = self.queue.in_progress();
        OfQueue(ConstGauge::new(in_progress.total_seconds)).encode(encoder.encode_descriptor(
            "workqueue_unfinished_work_seconds",
            "[BETA] How many seconds of work has done that is in progress and hasn't been observed by \
             work_duration. Large values indicate stuck threads. One can deduce the number of stuck threads by \
             observing the rate at which this increases.",
            None,
            MetricType::Gauge,
        )?)?;
        OfQueue(ConstGauge::new(in_progress.longest_seconds)).encode(encoder.encode_descriptor(
            "workqueue_longest_running_processor_seconds",
            "[BETA] How many seconds has the longest running processor for workqueue been running.",
            None,
            MetricType::Gauge,
        )?)?;
        let pending = ConstGauge::new(i64::try_from(self.caches.created_pending()).unwrap_or(i64::MAX));
        pending.encode(encoder.encode_descriptor(
            "gpu_dra_controller_created_claims_unobserved",
            "Claims created whose watch event has not arrived yet (remembered so retries never duplicate them)",
            None,
            MetricType::Gauge,
        )?)?;
        Ok(())
    }
}
