//! A classic NVIDIA device plugin on the same node hands out the same GPUs through the kubelet's device manager, and
//! neither knows what the other gave: two pods on one GPU. The agent tells one from the Node itself: a device plugin
//! that serves GPUs makes `nvidia.com/gpu` (or its shared or MIG resources) allocatable there, which DRA never does
//! (extended resources backed by DRA, 1.34+, are matched by the scheduler from the DeviceClass, not the Node). A node
//! label cannot tell it: the GPU Operator labels every GPU node `nvidia.com/gpu.deploy.device-plugin=true`, whether
//! its device plugin is enabled or not.
//!
//! While such resources are allocatable the agent publishes none of its GPUs (`--refuse-with-device-plugin`, on by
//! default) and says so (error log, Warning Event `DevicePluginServesGpus` on the Node,
//! `gpu_dra_node_agent_device_plugin_refused 1`); it still serves the kubelet, so claims prepared before can be
//! unprepared. Once the resources are gone (the device plugin removed: the kubelet marks its devices unallocatable at
//! once) the next round publishes them again.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use prometheus_client::metrics::gauge::Gauge;
use tracing::{error, info, warn};

/// Whether `name` is an extended resource that NVIDIA's device plugin (or a cloud's, under the same names) serves
/// GPUs as: whole GPUs, time-sliced or MPS-shared GPUs renamed `.shared`, MIG devices (mixed strategy).
fn is_device_plugin_gpu_resource(name: &str) -> bool {
    name == "nvidia.com/gpu" || name == "nvidia.com/gpu.shared" || name.starts_with("nvidia.com/mig-")
}

/// The GPU resources a device plugin makes allocatable on the node, as `name=quantity`, sorted. Zero is left out:
/// the kubelet keeps a stopped plugin's resources in the Node's capacity for a while, with nothing allocatable.
pub fn advertised(allocatable: Option<&BTreeMap<String, Quantity>>) -> Vec<String> {
    allocatable
        .into_iter()
        .flatten()
        .filter(|(name, quantity)| is_device_plugin_gpu_resource(name) && !is_zero(&quantity.0))
        .map(|(name, quantity)| format!("{name}={}", quantity.0))
        .collect()
}

/// Extended resources are whole numbers; anything else that is not plainly zero counts as something.
fn is_zero(quantity: &str) -> bool {
    quantity.trim().parse::<u64>() == Ok(0)
}

/// What a change of the advertised resources means for the log and the Node's Events.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// A device plugin serves GPUs where none did.
    Appeared,
    /// None serves them any more.
    Gone,
}

/// The change from `before` to `now` (both from [`advertised`]); a plugin whose counts change is no news.
pub fn change(before: &[String], now: &[String]) -> Option<Change> {
    match (before.is_empty(), now.is_empty()) {
        (true, false) => Some(Change::Appeared),
        (false, true) => Some(Change::Gone),
        _ => None,
    }
}

/// Keeps the agent's GPUs out of the pool while a device plugin serves GPUs on its node (`refuse`), and reports it.
pub struct DevicePluginGuard {
    refuse: bool,
    /// What the Node read last showed allocatable (see [`advertised`]).
    found: Vec<String>,
    gauge: Gauge<i64>,
    recorder: Recorder,
}

impl std::fmt::Debug for DevicePluginGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePluginGuard").field("refuse", &self.refuse).field("found", &self.found).finish()
    }
}

impl DevicePluginGuard {
    pub fn new(refuse: bool, client: kube::Client, registry: &mut prometheus_client::registry::Registry) -> Self {
        let gauge = Gauge::<i64>::default();
        registry.register(
            "gpu_dra_node_agent_device_plugin_refused",
            "1 while a device plugin serves NVIDIA GPUs on this node (nvidia.com/gpu allocatable) and the agent \
             publishes none of its own (--refuse-with-device-plugin)",
            gauge.clone(),
        );
        let recorder = Recorder::new(client, Reporter { controller: "gpu-dra-node-agent".into(), instance: None });
        Self { refuse, found: Vec::new(), gauge, recorder }
    }

    /// Whether the node's GPUs are to be left out of its pool now.
    pub fn refusing(&self) -> bool {
        self.refuse && !self.found.is_empty()
    }

    /// Takes in the Node just read: says in the log and an Event on the Node when a device plugin starts or stops
    /// serving GPUs there.
    pub async fn observe(&mut self, node: &Node) {
        let now = advertised(node.status.as_ref().and_then(|s| s.allocatable.as_ref()));
        let change = change(&self.found, &now);
        self.found = now;
        self.gauge.set(i64::from(self.refusing()));
        let (type_, reason, note) = match change {
            None => return,
            Some(Change::Appeared) if self.refuse => {
                let note = format!(
                    "A device plugin serves GPUs on this node ({}): gpu-dra publishes none of this node's GPUs, as \
                     both would hand out the same ones. Disable the device plugin on this node (GPU Operator: \
                     devicePlugin.enabled=false in its ClusterPolicy), or let both run with the chart's \
                     nodeAgent.refuseWithDevicePlugin=false (--refuse-with-device-plugin=false) if they are kept \
                     apart by other means. Claims prepared here before can still be unprepared.",
                    self.found.join(", ")
                );
                error!(resources = ?self.found, "{note}");
                (EventType::Warning, "DevicePluginServesGpus", note)
            }
            Some(Change::Appeared) => {
                let note = format!(
                    "A device plugin serves GPUs on this node ({}) and gpu-dra publishes them too \
                     (--refuse-with-device-plugin=false): both can hand out the same GPU.",
                    self.found.join(", ")
                );
                warn!(resources = ?self.found, "{note}");
                (EventType::Warning, "DevicePluginServesGpus", note)
            }
            Some(Change::Gone) if self.refuse => {
                let note = "No device plugin serves GPUs on this node any more: gpu-dra publishes its GPUs again.";
                info!("{note}");
                (EventType::Normal, "DevicePluginGone", note.to_string())
            }
            Some(Change::Gone) => return,
        };
        let event =
            Event { type_, reason: reason.into(), note: Some(note), action: "PublishGpus".into(), secondary: None };
        if let Err(error) = self.recorder.publish(&event, &node.object_ref(&())).await {
            warn!(%error, reason, "publishing an event about the device plugin failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nvidia_gpu_resources_with_something_allocatable_count() {
        type Allocatable = &'static [(&'static str, &'static str)];
        let cases: &[(Allocatable, &[&str])] = &[
            (&[], &[]),
            (&[("cpu", "8"), ("memory", "32Gi"), ("pods", "110")], &[]),
            (&[("nvidia.com/gpu", "8")], &["nvidia.com/gpu=8"]),
            // A stopped plugin's resource stays in the Node with nothing allocatable.
            (&[("nvidia.com/gpu", "0")], &[]),
            (&[("nvidia.com/gpu.shared", "40")], &["nvidia.com/gpu.shared=40"]),
            (
                &[("nvidia.com/mig-1g.10gb", "7"), ("nvidia.com/mig-3g.40gb", "0"), ("example.com/fpga", "2")],
                &["nvidia.com/mig-1g.10gb=7"],
            ),
            // Look-alikes of other vendors and resources are not NVIDIA's device plugin.
            (&[("nvidia.com/gpumem", "80"), ("amd.com/gpu", "2"), ("gpu.nvidia.com/gpu", "1")], &[]),
            // Not a whole number: counted rather than ignored.
            (&[("nvidia.com/gpu", "1k")], &["nvidia.com/gpu=1k"]),
        ];
        for (allocatable, want) in cases {
            let map: BTreeMap<String, Quantity> =
                allocatable.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect();
            assert_eq!(advertised(Some(&map)), *want, "{allocatable:?}");
        }
        assert!(advertised(None).is_empty());
    }

    #[test]
    fn only_a_plugin_appearing_or_going_is_news() {
        let some = vec!["nvidia.com/gpu=8".to_string()];
        let other = vec!["nvidia.com/gpu=7".to_string()];
        assert_eq!(change(&[], &some), Some(Change::Appeared));
        assert_eq!(change(&some, &[]), Some(Change::Gone));
        assert_eq!(change(&some, &other), None);
        assert_eq!(change(&[], &[]), None);
    }
}
