//! Dynamic MIG as the scheduler sees it (KEP-4815 partitionable devices, Kubernetes 1.36+). Pure.
//!
//! Each GPU in MIG mode gets a counter set `gpu-<minor>-counter-set` with one counter per memory slice
//! (`memory-slice-<i>`, 1 each), its compute slices (`compute-slices`, 7) and its media engines (`media-engines`,
//! 1). Every placement of every profile is a device consuming the slices it spans, its compute slices and, for the
//! `+me` profiles, the media engines; the whole GPU consumes everything. The scheduler then hands out only
//! placements that fit together, exactly the rules of [`crate::node_agent::mig::check_placement`]: overlapping
//! memory slices, the compute limit and the one media-engine instance are counters running out, and every profile's
//! instance limit follows from its placements.
//!
//! A MIG device on the GPU that no claim prepared here holds (an administrator made it, or another tool) is not the
//! agent's to destroy: the counters it uses are published as used up, so nothing is allocated on top of it.

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use super::{common_attributes, memory_quantity};
use crate::node_agent::device::{Device, Partition, mig_device_name};
use crate::node_agent::gpu::{Gpu, MigDevice};
use crate::node_agent::mig::{self, COMPUTE_SLICES, MEMORY_SLICES};

/// The API's limit on counter sets per slice.
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// The API's limit on devices per slice once a device in it consumes counters.
pub const MAX_DEVICES_PER_SLICE_WITH_COUNTERS: usize = 64;

const COMPUTE_COUNTER: &str = "compute-slices";
const MEDIA_COUNTER: &str = "media-engines";

/// The counter set of `gpu`'s slices.
pub fn counter_set_name(gpu: &Gpu) -> String {
    format!("{}-counter-set", gpu.device_name())
}

fn memory_counter(slice: u32) -> String {
    format!("memory-slice-{slice}")
}

/// Whether a profile carries the GPU's media engines (`1g.10gb+me`).
fn has_media_engines(profile: &str) -> bool {
    profile.ends_with("+me")
}

/// The MIG devices of `gpu` that no prepared claim holds: `held` are the device names the plugin's checkpoint
/// records. A MIG device is held under its placement's name, or the GPU's own name when it is the whole.
pub fn foreign<'a>(gpu: &'a Gpu, held: &BTreeSet<String>) -> Vec<&'a MigDevice> {
    gpu.mig_devices
        .iter()
        .filter(|m| {
            let whole = m.placement_start == 0 && m.placement_size == MEMORY_SLICES;
            let ours = held.contains(&mig_device_name(gpu, m)) || (whole && held.contains(&gpu.device_name()));
            !ours
        })
        .collect()
}

/// `gpu`'s counter set: everything the GPU has, less what `foreign` MIG devices use.
pub fn counter_set(gpu: &Gpu, foreign: &[&MigDevice]) -> Value {
    let table = mig::profiles(gpu).unwrap_or_default();
    let mut counters = Map::new();
    for slice in 0..MEMORY_SLICES {
        let taken = foreign.iter().any(|m| (m.placement_start..m.placement_start + m.placement_size).contains(&slice));
        counters.insert(memory_counter(slice), json!({"value": if taken { "0" } else { "1" }}));
    }
    // A device of a profile the table does not know counts one compute slice per memory slice.
    let compute_used: u32 = foreign
        .iter()
        .map(|m| table.iter().find(|p| p.id == m.profile_id).map_or(m.placement_size, |p| p.compute_slices))
        .sum();
    counters.insert(COMPUTE_COUNTER.into(), json!({"value": COMPUTE_SLICES.saturating_sub(compute_used).to_string()}));
    let media = if foreign.iter().any(|m| has_media_engines(&m.profile)) { "0" } else { "1" };
    counters.insert(MEDIA_COUNTER.into(), json!({"value": media}));
    json!({"name": counter_set_name(gpu), "counters": counters})
}

/// The ResourceSlice device of a partition: a MIG device not made yet (NVIDIA's `mig` attributes without the ones
/// only a made device has: its UUID and instance IDs), or the whole GPU (`gpu`), consuming its share of the
/// counter set.
pub fn device(device: &Device, partition: &Partition) -> Value {
    let gpu = &device.gpu;
    let profile = &partition.profile;
    let mut attributes = common_attributes(gpu);
    let memory = gpu.memory_bytes / u64::from(MEMORY_SLICES) * u64::from(profile.memory_slices);
    let mut capacity = Map::new();
    if partition.whole {
        attributes.insert("type".into(), json!({"string": "gpu"}));
        attributes.insert("uuid".into(), json!({"string": gpu.uuid}));
        attributes.insert("index".into(), json!({"int": gpu.index}));
        attributes.insert("minor".into(), json!({"int": gpu.minor}));
        attributes.insert("migEnabled".into(), json!({"bool": true}));
        capacity.insert("memory".into(), json!({"value": memory_quantity(gpu.memory_bytes)}));
    } else {
        attributes.insert("type".into(), json!({"string": "mig"}));
        attributes.insert("profile".into(), json!({"string": profile.name}));
        attributes.insert("parentUUID".into(), json!({"string": gpu.uuid}));
        attributes.insert("parentIndex".into(), json!({"int": gpu.index}));
        attributes.insert("parentMinor".into(), json!({"int": gpu.minor}));
        capacity.insert("memory".into(), json!({"value": memory_quantity(memory & !((1 << 20) - 1))}));
        for slice in partition.start..partition.start + profile.memory_slices {
            capacity.insert(format!("memorySlice{slice}"), json!({"value": "1"}));
        }
    }
    let mut consumed = Map::new();
    for slice in partition.start..partition.start + profile.memory_slices {
        consumed.insert(memory_counter(slice), json!({"value": "1"}));
    }
    consumed.insert(COMPUTE_COUNTER.into(), json!({"value": profile.compute_slices.to_string()}));
    if partition.whole || has_media_engines(profile.name) {
        consumed.insert(MEDIA_COUNTER.into(), json!({"value": "1"}));
    }
    json!({
        "name": device.name(),
        "attributes": attributes,
        "capacity": capacity,
        "consumesCounters": [{"counterSet": counter_set_name(gpu), "counters": consumed}],
    })
}

/// The counter set a published device consumes from, if any.
pub fn consumed_counter_set(device: &Value) -> Option<&str> {
    device["consumesCounters"].get(0)?["counterSet"].as_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_agent::device::{MigLayout, devices};
    use crate::node_agent::discovery::Discovery;
    use crate::node_agent::discovery::simulated::Simulated;

    fn gpu(spec: &str) -> Gpu {
        Simulated::new("node", spec).expect("spec").discover().expect("discover").remove(0)
    }

    fn consumed(device: &Value) -> Vec<(String, String)> {
        let counters = device["consumesCounters"][0]["counters"].as_object().cloned().unwrap_or_default();
        counters.into_iter().map(|(k, v)| (k, v["value"].as_str().unwrap_or_default().to_string())).collect()
    }

    #[test]
    fn every_placement_consumes_the_slices_it_spans() {
        let gpu = gpu("1xH100-80GB/mig=");
        let all = devices(std::slice::from_ref(&gpu), MigLayout::Dynamic);
        let published: Vec<Value> = all.iter().map(|d| device(d, d.partition.as_ref().expect("a partition"))).collect();
        let by_name = |name: &str| published.iter().find(|d| d["name"] == name).cloned().unwrap_or_default();
        let small = by_name("gpu-0-mig-19-3-1");
        assert_eq!(
            consumed(&small),
            [("compute-slices".into(), "1".into()), ("memory-slice-3".into(), "1".into())],
            "a 1g.10gb at slice 3"
        );
        assert_eq!(small["attributes"]["profile"], json!({"string": "1g.10gb"}));
        assert_eq!(small["attributes"]["type"], json!({"string": "mig"}));
        assert!(small["attributes"].get("uuid").is_none(), "a MIG device not made yet has no UUID");
        assert_eq!(small["capacity"]["memory"], json!({"value": "10240Mi"}));
        let media = by_name("gpu-0-mig-20-6-1");
        assert!(consumed(&media).contains(&("media-engines".into(), "1".into())), "1g.10gb+me takes the engines");
        let whole = by_name("gpu-0");
        assert_eq!(whole["attributes"]["type"], json!({"string": "gpu"}));
        assert_eq!(whole["attributes"]["migEnabled"], json!({"bool": true}));
        assert_eq!(consumed(&whole).len(), 10, "the whole GPU takes every counter");
        assert_eq!(consumed(&by_name("gpu-0-mig-0-0-8")).len(), 9, "7g.80gb: all memory and compute slices");
        for d in &published {
            assert_eq!(consumed_counter_set(d), Some("gpu-0-counter-set"));
            let counted =
                d["attributes"].as_object().map_or(0, |a| a.len()) + d["capacity"].as_object().map_or(0, |c| c.len());
            assert!(counted <= 32, "API limit: 32 attributes+capacities, {counted} on {}", d["name"]);
        }
        assert!(published.len() <= MAX_DEVICES_PER_SLICE_WITH_COUNTERS);
    }

    #[test]
    fn a_mig_device_no_claim_holds_uses_up_its_counters() {
        let gpu = gpu("1xH100-80GB/mig=3g.40gb+1g.10gb+me");
        let names: Vec<String> = gpu.mig_devices.iter().map(|m| mig_device_name(&gpu, m)).collect();
        assert_eq!(names, ["gpu-0-mig-9-0-4", "gpu-0-mig-20-4-1"]);
        let counters = |held: &[&str]| {
            let held: BTreeSet<String> = held.iter().map(|s| (*s).to_string()).collect();
            let set = counter_set(&gpu, &foreign(&gpu, &held));
            let values = set["counters"].as_object().cloned().unwrap_or_default();
            values
                .into_iter()
                .map(|(k, v)| format!("{k}={}", v["value"].as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            counters(&[]),
            [
                "compute-slices=3",
                "media-engines=0",
                "memory-slice-0=0",
                "memory-slice-1=0",
                "memory-slice-2=0",
                "memory-slice-3=0",
                "memory-slice-4=0",
                "memory-slice-5=1",
                "memory-slice-6=1",
                "memory-slice-7=1"
            ],
            "an administrator's MIG devices stay out of the scheduler's reach"
        );
        let ours = counters(&["gpu-0-mig-9-0-4", "gpu-0-mig-20-4-1"]);
        assert!(ours.iter().all(|c| c.ends_with("=1") || c == "compute-slices=7"), "{ours:?}");
        let mut whole = gpu.clone();
        whole.mig_devices = crate::node_agent::discovery::simulated::Simulated::new("node", "1xH100-80GB/mig=7g.80gb")
            .expect("spec")
            .discover()
            .expect("discover")
            .remove(0)
            .mig_devices;
        let held: BTreeSet<String> = ["gpu-0".to_string()].into();
        assert!(foreign(&whole, &held).is_empty(), "the whole GPU's claim holds its 7g device");
        assert_eq!(counter_set_name(&gpu), "gpu-0-counter-set");
    }
}
