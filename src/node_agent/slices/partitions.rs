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
//! A MIG device on the GPU that the agent did not make for a claim (an administrator made it, or another tool) is
//! not the agent's to destroy: the partitions it is in the way of are not published. The counters stay what the
//! GPU has, so a claim allocated before such a device appeared never drives them below zero (which would keep the
//! scheduler from every partition of the node: it checks all counter sets of a pool).

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use super::{gpu_attributes, memory_quantity, mig_attributes, mig_capacity};
use crate::node_agent::device::{Device, Partition};
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

/// The MIG devices of `gpu` the agent did not make: `ours` are the UUIDs the plugin's checkpoint records.
pub fn foreign<'a>(gpu: &'a Gpu, ours: &BTreeSet<String>) -> Vec<&'a MigDevice> {
    gpu.mig_devices.iter().filter(|m| !ours.contains(&m.uuid)).collect()
}

/// Whether `device` is to be published beside the `foreign` MIG devices of its GPU: a partition they are in the way
/// of is not (its memory slices, the media engines or the compute slices they hold); any other device is.
pub fn publishable(device: &Device, foreign: &[&MigDevice]) -> bool {
    let Some(partition) = &device.partition else { return true };
    let beside = Gpu { mig_devices: foreign.iter().map(|m| (*m).clone()).collect(), ..device.gpu.clone() };
    mig::check_placement(&beside, &partition.profile, partition.start).is_ok()
}

/// `gpu`'s counter set: everything the GPU has.
pub fn counter_set(gpu: &Gpu) -> Value {
    let mut counters = Map::new();
    for slice in 0..MEMORY_SLICES {
        counters.insert(memory_counter(slice), json!({"value": "1"}));
    }
    counters.insert(COMPUTE_COUNTER.into(), json!({"value": COMPUTE_SLICES.to_string()}));
    counters.insert(MEDIA_COUNTER.into(), json!({"value": "1"}));
    json!({"name": counter_set_name(gpu), "counters": counters})
}

/// The ResourceSlice device of a partition: a MIG device not made yet (NVIDIA's `mig` attributes without the ones
/// only a made device has: its UUID and instance IDs), or the whole GPU (`gpu`), consuming its share of the
/// counter set.
pub fn device(device: &Device, partition: &Partition) -> Value {
    let gpu = &device.gpu;
    let profile = &partition.profile;
    let (attributes, capacity) = if partition.whole {
        let mut capacity = Map::new();
        capacity.insert("memory".into(), json!({"value": memory_quantity(gpu.memory_bytes)}));
        (gpu_attributes(gpu), capacity)
    } else {
        let capacity = mig_capacity(mig::memory_bytes(gpu, profile), partition.start, profile.memory_slices);
        (mig_attributes(gpu, profile.name), capacity)
    };
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
        assert_eq!(small["capacity"]["memory"], json!({"value": "10194Mi"}));
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
    fn partitions_in_the_way_of_a_mig_device_the_agent_did_not_make_are_not_published() {
        let gpu = gpu("1xH100-80GB/mig=3g.40gb+1g.10gb+me");
        let all = devices(std::slice::from_ref(&gpu), MigLayout::Dynamic);
        let published = |ours: &[&str]| -> Vec<String> {
            let ours: BTreeSet<String> = ours.iter().map(|s| (*s).to_string()).collect();
            let foreign = foreign(&gpu, &ours);
            all.iter().filter(|d| publishable(d, &foreign)).map(Device::name).collect()
        };
        // The 3g.40gb holds slices 0-3, the 1g.10gb+me slice 4 and the media engines: left are 1g.10gb at 5 and 6
        // and 1g.20gb at 6 (2g.20gb starts at 0, 2 or 4 only).
        assert_eq!(
            published(&[]),
            ["gpu-0-mig-19-5-1", "gpu-0-mig-19-6-1", "gpu-0-mig-15-6-2"],
            "an administrator's MIG devices keep the partitions they are in the way of unpublished"
        );
        let (three, media) = (gpu.mig_devices[0].uuid.as_str(), gpu.mig_devices[1].uuid.as_str());
        assert_eq!(published(&[three, media]).len(), 26, "the agent's own are no obstacle: it destroys them");
        assert!(published(&[three]).iter().all(|n| !n.contains("-mig-20-")), "one +me instance per GPU");
        let set = counter_set(&gpu);
        assert_eq!(set["name"], "gpu-0-counter-set");
        let values: Vec<String> = set["counters"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k}={}", v["value"].as_str().unwrap_or_default()))
            .collect();
        assert_eq!(
            values,
            [
                "compute-slices=7",
                "media-engines=1",
                "memory-slice-0=1",
                "memory-slice-1=1",
                "memory-slice-2=1",
                "memory-slice-3=1",
                "memory-slice-4=1",
                "memory-slice-5=1",
                "memory-slice-6=1",
                "memory-slice-7=1"
            ]
        );
    }
}
