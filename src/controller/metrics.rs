//! The controller's Prometheus metrics. Names follow kube-controller-manager's where a twin exists, so existing
//! dashboards and alerts keep working.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::cache::Caches;
use super::decide::is_allocated;
use super::queue::WorkQueue;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CreateLabels {
    status: &'static str,
    admin_access: &'static str,
    source: &'static str,
    owner_api_group: &'static str,
    owner_api_kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SyncLabels {
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ManagerLabels {
    field_manager: String,
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
    foreign_claims: Family<ManagerLabels, Counter>,
    observe_only: Gauge,
    leader: Gauge,
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
            syncs: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 16))),
            foreign_claims: Family::default(),
            observe_only: Gauge::default(),
            leader: Gauge::default(),
        };
        registry.register(
            "dynamic_resource_allocation_resourceclaim_creates",
            "Number of ResourceClaims creation requests, by status (success|failure), admin access and source",
            metrics.creates.clone(),
        );
        registry.register(
            "gpu_dra_controller_sync_duration_seconds",
            "Time to sync one pod or claim key, by kind (pod|claim) and result (success or the error's label)",
            metrics.syncs.clone(),
        );
        registry.register(
            "gpu_dra_controller_foreign_claims",
            "Generated claims seen that another claim controller created, by its field manager",
            metrics.foreign_claims.clone(),
        );
        registry.register(
            "gpu_dra_controller_observe_only",
            "1 when another active ResourceClaim controller was detected and this one only observes",
            metrics.observe_only.clone(),
        );
        registry.register(
            "gpu_dra_controller_leader",
            "1 while this replica holds the leader lease",
            metrics.leader.clone(),
        );
        registry.register_collector(Box::new(ScrapeTimeMetrics { caches, queue, events }));
        metrics
    }

    pub fn claim_created(&self, success: bool, admin_access: bool) {
        self.creates
            .get_or_create(&CreateLabels {
                status: if success { "success" } else { "failure" },
                admin_access: bool_label(admin_access),
                source: "resource_claim_template",
                owner_api_group: "",
                owner_api_kind: "Pod",
            })
            .inc();
    }

    pub fn sync_finished(&self, kind: &'static str, result: &'static str, seconds: f64) {
        self.syncs.get_or_create(&SyncLabels { kind, result }).observe(seconds);
    }

    pub fn foreign_claim_seen(&self, field_manager: &str) {
        self.foreign_claims.get_or_create(&ManagerLabels { field_manager: field_manager.to_string() }).inc();
    }

    pub fn set_observe_only(&self, on: bool) {
        self.observe_only.set(i64::from(on));
    }

    pub fn set_leader(&self, on: bool) {
        self.leader.set(i64::from(on));
    }
}

fn bool_label(b: bool) -> &'static str {
    if b { "true" } else { "false" }
}

/// Metrics computed from the caches when scraped: the claims gauge and the queue depth.
#[derive(Debug)]
struct ScrapeTimeMetrics {
    caches: Arc<Caches>,
    queue: WorkQueue,
    events: super::events::Events,
}

impl Collector for ScrapeTimeMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let claims: Family<ClaimLabels, Gauge> = Family::default();
        for claim in self.caches.claims.state() {
            let source = if claim.pod_claim_name.is_some() {
                "resource_claim_template"
            } else if claim.extended_resource {
                "extended_resource"
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
            "Number of ResourceClaims, by allocation status, admin access and source \
             (resource_claim_template, extended_resource, or empty for claims users created)",
            None,
            MetricType::Gauge,
        )?)?;
        let depth = ConstGauge::new(i64::try_from(self.queue.depth()).unwrap_or(i64::MAX));
        depth.encode(encoder.encode_descriptor(
            "gpu_dra_controller_workqueue_depth",
            "Keys waiting in the work queue",
            None,
            MetricType::Gauge,
        )?)?;
        let dropped = prometheus_client::metrics::counter::ConstCounter::new(self.events.dropped());
        dropped.encode(encoder.encode_descriptor(
            "gpu_dra_controller_events_dropped",
            "Events not sent because too many were in flight",
            None,
            MetricType::Counter,
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
