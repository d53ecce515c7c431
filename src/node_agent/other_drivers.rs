//! Another DRA driver publishing this node's GPUs: NVIDIA's (`gpu.nvidia.com`) left installed beside gpu-dra, or
//! shipped by a cloud's node image. Both drivers' devices are allocatable, and the scheduler would give one GPU to a
//! claim of each: nothing in either driver's API says they are the same. So every full round reads the node's
//! ResourceSlices of all drivers, and while another driver publishes a device with one of this node's GPU UUIDs or
//! PCI bus IDs, gpu-dra publishes none of its GPUs (as beside the classic device plugin), says so once (a Warning
//! Event `AnotherDriverPublishesGpus` on the Node, an error in the log, `gpu_dra_node_agent_other_driver_refused 1`)
//! and publishes them again once it does not.

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value;
use tracing::{error, info, warn};

use super::gpu::{Gpu, normalize_pci_bus_id};
use super::slices::publisher::DEVICES_HASH_ANNOTATION;

/// The devices of drivers other than `our_driver` in `slices` (the node's ResourceSlices as the API serves them)
/// that are one of `gpus`: an attribute `uuid` or `parentUUID` (qualified or not) naming one of the GPUs or their
/// MIG devices, or a PCI bus ID (`resource.kubernetes.io/pciBusID`, or older NVIDIA releases' `pcieBusID`) of one
/// of the GPUs. Each as `driver/device (what matched)`.
pub fn overlapping(gpus: &[Gpu], our_driver: &str, slices: &[Value]) -> Vec<String> {
    let named = |attributes: &serde_json::Map<String, Value>, wanted: &[&str]| -> Vec<String> {
        let wanted =
            |name: &str| wanted.iter().any(|w| name == *w || name.rsplit_once('/').is_some_and(|(_, n)| n == *w));
        let values = attributes.iter().filter(|(name, _)| wanted(name));
        values.filter_map(|(_, value)| value.get("string")?.as_str().map(str::to_string)).collect()
    };
    let mut found = Vec::new();
    for slice in slices {
        let driver = slice.pointer("/spec/driver").and_then(Value::as_str).unwrap_or_default();
        if driver == our_driver {
            continue;
        }
        let devices = slice.pointer("/spec/devices").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        for device in devices {
            let Some(attributes) = device.get("attributes").and_then(Value::as_object) else { continue };
            let uuids = named(attributes, &["uuid", "parentUUID"]);
            let buses: Vec<String> =
                named(attributes, &["pciBusID", "pcieBusID"]).iter().map(|bus| normalize_pci_bus_id(bus)).collect();
            let same = gpus.iter().find_map(|gpu| {
                let ours = std::iter::once(gpu.uuid.as_str()).chain(gpu.mig_devices.iter().map(|m| m.uuid.as_str()));
                if let Some(uuid) = ours.into_iter().find(|ours| uuids.iter().any(|u| u == ours)) {
                    Some(uuid.to_string())
                } else {
                    buses.contains(&gpu.pci_bus_id).then(|| format!("PCI {}", gpu.pci_bus_id))
                }
            });
            if let Some(same) = same {
                let name = device.get("name").and_then(Value::as_str).unwrap_or_default();
                found.push(format!("{driver}/{name} ({same})"));
            }
        }
    }
    found
}

/// At most this many of the other driver's devices are named in the Event (its note holds 1 KiB).
const NAMED_IN_EVENT: usize = 4;

/// Whether the node's GPUs are held back for another driver, kept across rounds.
pub struct OtherDriverGuard {
    client: kube::Client,
    node: String,
    driver: String,
    /// What another driver publishes of this node's GPUs, as last read (empty: nothing).
    shared: Vec<String>,
    /// `gpu_dra_node_agent_other_driver_refused`: 1 while refusing.
    gauge: Gauge<i64>,
}

impl std::fmt::Debug for OtherDriverGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtherDriverGuard").field("node", &self.node).field("shared", &self.shared).finish()
    }
}

impl OtherDriverGuard {
    pub fn new(client: kube::Client, node: &str, driver: &str, registry: &mut Registry) -> Self {
        let gauge = Gauge::<i64>::default();
        registry.register(
            "gpu_dra_node_agent_other_driver_refused",
            "1 while another DRA driver publishes GPUs of this node and the agent publishes none of its own",
            gauge.clone(),
        );
        Self { client, node: node.into(), driver: driver.into(), shared: Vec::new(), gauge }
    }

    pub fn refusing(&self) -> bool {
        !self.shared.is_empty()
    }

    /// Reads the node's ResourceSlices and decides for `gpus`; a failed read keeps the last decision.
    pub async fn check(&mut self, gpus: &[Gpu]) {
        // Untyped: another driver's slice is read for a few fields and must not fail on the rest.
        let slices = ApiResource::erase::<ResourceSlice>(&());
        let api = Api::<DynamicObject>::all_with(self.client.clone(), &slices);
        // From the API server's cache, which indexes slices by node: one list per node and resync.
        let fields = format!("spec.nodeName={},spec.driver!={}", self.node, self.driver);
        let listed = match api.list(&ListParams::default().fields(&fields).match_any()).await {
            Ok(listed) => listed,
            Err(e) => {
                warn!(error = %e, "reading the node's ResourceSlices of other drivers failed; checked next round");
                return;
            }
        };
        // This driver's own slices under an earlier driver name (the chart's driverName changed), until the kubelet
        // deletes them: not another driver's.
        let theirs =
            listed.items.into_iter().filter(|slice| !slice.annotations().contains_key(DEVICES_HASH_ANNOTATION));
        let slices: Vec<Value> = theirs.map(|slice| slice.data).collect();
        let shared = overlapping(gpus, &self.driver, &slices);
        let was_refusing = self.refusing();
        self.shared = shared;
        self.gauge.set(i64::from(self.refusing()));
        if self.refusing() && !was_refusing {
            let mut shared = self.shared.iter().take(NAMED_IN_EVENT).cloned().collect::<Vec<_>>().join(", ");
            if self.shared.len() > NAMED_IN_EVENT {
                shared = format!("{shared} and {} more", self.shared.len() - NAMED_IN_EVENT);
            }
            error!(%shared, "another DRA driver publishes this node's GPUs: gpu-dra publishes none of them");
            let note = format!(
                "Another DRA driver publishes GPUs of this node ({shared}): the scheduler would give one GPU to a \
                 claim of each. gpu-dra publishes none of this node's GPUs until no other driver does; remove the \
                 other driver's kubelet plugin from this node (charts/README: Not beside NVIDIA's DRA driver)."
            );
            super::plugin::node_warning(self.client.clone(), &self.node, "AnotherDriverPublishesGpus", "Publish", note)
                .await;
        } else if was_refusing && !self.refusing() {
            info!("no other DRA driver publishes this node's GPUs now: publishing them");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn another_drivers_device_with_one_of_our_uuids_or_bus_ids_overlaps() -> anyhow::Result<()> {
        use crate::node_agent::discovery::{Discovery, simulated::Simulated};
        let ours = Simulated::new("node-a", "2xH100-80GB")?.discover_all()?.gpus;
        let (a, b) = (ours[0].uuid.as_str(), ours[1].pci_bus_id.to_uppercase());
        let slice = |driver: &str, devices: Value| json!({"spec": {"driver": driver, "devices": devices}});
        let nvidia = slice(
            "gpu.nvidia.com",
            json!([
                {"name": "gpu-0", "attributes": {"uuid": {"string": a}}},
                {"name": "gpu-1", "attributes": {"resource.kubernetes.io/pciBusID": {"string": b}}},
                {"name": "gpu-2", "attributes": {"uuid": {"string": "GPU-z"}}}
            ]),
        );
        let example = slice(
            "gpu.example.com",
            json!([{"name": "gpu-0", "attributes": {"gpu.example.com/uuid": {"string": ours[1].uuid}}}]),
        );
        let ours_again = slice("gpu.gpu-dra.dev", json!([{"name": "gpu-0", "attributes": {"uuid": {"string": a}}}]));
        let nic = slice(
            "nic.example.com",
            json!([{"name": "eth0", "attributes": {"mac": {"string": "x"}}}, {"name": "bare"}]),
        );
        assert_eq!(
            overlapping(&ours, "gpu.gpu-dra.dev", &[nvidia, example, ours_again.clone(), nic]),
            [
                format!("gpu.nvidia.com/gpu-0 ({a})"),
                format!("gpu.nvidia.com/gpu-1 (PCI {})", ours[1].pci_bus_id),
                format!("gpu.example.com/gpu-0 ({})", ours[1].uuid),
            ]
        );
        assert!(overlapping(&ours, "gpu.gpu-dra.dev", &[ours_again]).is_empty(), "our own slices");
        // An older NVIDIA release's MIG device: its own UUID, the parent's, and the unqualified pcieBusID.
        let mig = slice(
            "gpu.nvidia.com",
            json!([
                {"name": "gpu-0-mig-1g", "attributes": {"uuid": {"string": "MIG-x"}, "parentUUID": {"string": a}}},
                {"name": "gpu-1-mig-1g", "attributes": {"uuid": {"string": "MIG-y"}, "pcieBusID": {"string": b}}}
            ]),
        );
        assert_eq!(
            overlapping(&ours, "gpu.gpu-dra.dev", &[mig]),
            [
                format!("gpu.nvidia.com/gpu-0-mig-1g ({a})"),
                format!("gpu.nvidia.com/gpu-1-mig-1g (PCI {})", ours[1].pci_bus_id)
            ]
        );
        Ok(())
    }
}
