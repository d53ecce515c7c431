//! ResourceSlices: the devices the agent publishes (pure: built from discovered GPUs, split into slices of at most
//! [`MAX_DEVICES_PER_SLICE`]; with dynamic MIG, counter sets in slices of their own) and the publisher that makes
//! the API server hold exactly them.

pub mod dropped;
pub mod node_sharing;
pub mod partitions;
pub mod publisher;

use std::collections::{BTreeSet, HashMap};

use serde_json::{Map, Value, json};
use tracing::warn;

use super::device::Device;
use super::gpu::{Gpu, MigDevice, normalize_version};

/// The API's limit on devices per slice (without taints or counters).
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// The API's limit on devices per slice once any device in it has taints.
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS: usize = 64;
/// The API's limit on a string attribute, in bytes (Go's `len`).
const MAX_STRING_ATTRIBUTE: usize = 64;

/// How the scheduler may hand out a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Sharing {
    /// One claim holds the whole GPU.
    Whole,
    /// Several claims share the GPU (`allowMultipleAllocations`, KEP-5075 consumable capacity), each consuming the
    /// `memory` it requests (at least [`MIN_SHARED_MEMORY_BYTES`]); a request that names no memory consumes all of it, so
    /// a claim written for whole GPUs still gets one to itself. Claims may also ask a share of the GPU's
    /// [`COMPUTE`] (none unless they name one), so inference pods can be packed by the compute they declare.
    ByMemory,
}

/// The capacity a shared GPU publishes for its compute: percent of the GPU, 100 in all. A request that names none
/// consumes none (its default is 0): memory alone decides whether a claim gets the GPU to itself, as before this
/// capacity existed, and a claim that names compute gets at most what is left of 100.
pub const COMPUTE: &str = "compute";

/// The smallest memory share a claim may ask of a shared GPU (1 GiB): below it a share is a mistake, not a workload.
pub const MIN_SHARED_MEMORY_BYTES: u64 = 1 << 30;

/// The ResourceSlice device for `device`, with the attribute names NVIDIA's DRA driver publishes, so existing
/// DeviceClasses and CEL selectors keep working. A MIG device is always published whole (`sharing` is for GPUs).
pub fn device(device: &Device, sharing: Sharing) -> Value {
    match (&device.partition, &device.mig) {
        (Some(partition), _) => partitions::device(device, partition),
        (None, None) => gpu_device(&device.gpu, sharing),
        (None, Some(mig)) => mig_device(device, mig),
    }
}

/// `device`'s attributes as its ResourceSlice entry has them and, for a dynamic MIG partition made for a claim, its
/// MIG device's `uuid` too: what a claim's device metadata lists (see `kubelet_plugin::device_metadata`).
pub fn attributes(device: &Device) -> Map<String, Value> {
    let mut attributes = match self::device(device, Sharing::Whole).get_mut("attributes").map(Value::take) {
        Some(Value::Object(attributes)) => attributes,
        _ => Map::new(),
    };
    if let (Some(_), Some(mig)) = (&device.partition, &device.mig) {
        attributes.entry("uuid").or_insert_with(|| json!({"string": mig.uuid}));
    }
    attributes
}

fn gpu_device(gpu: &Gpu, sharing: Sharing) -> Value {
    let attributes = gpu_attributes(gpu);
    let memory = memory_quantity(gpu.memory_bytes);
    // The API refuses a policy whose minimum exceeds the capacity: such a GPU (none known) is published whole.
    let shareable = gpu.memory_bytes >= MIN_SHARED_MEMORY_BYTES;
    match sharing {
        Sharing::ByMemory if !shareable => {
            warn!(gpu = %gpu.uuid, memory = %memory, "less memory than the smallest share; published whole");
            json!({"name": gpu.device_name(), "attributes": attributes, "capacity": {"memory": {"value": memory}}})
        }
        Sharing::Whole => json!({
            "name": gpu.device_name(),
            "attributes": attributes,
            "capacity": {"memory": {"value": memory}},
        }),
        Sharing::ByMemory => json!({
            "name": gpu.device_name(),
            "attributes": attributes,
            "allowMultipleAllocations": true,
            "capacity": {
                "memory": {
                    "value": memory,
                    "requestPolicy": {"default": memory, "validRange": {"min": memory_quantity(MIN_SHARED_MEMORY_BYTES), "max": memory}},
                },
                COMPUTE: {
                    "value": "100",
                    "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
                },
            },
        }),
    }
}

/// A MIG device: NVIDIA's `mig` type, its own UUID and profile, its parent GPU's identity (`parentUUID`,
/// `parentIndex`, `parentMinor`), instance IDs and model attributes, and what it has of the GPU as capacity, with
/// NVIDIA's names: `memory`, `multiprocessors`, and `memorySlice<i>` (1) for each memory slice it spans.
fn mig_device(device: &Device, mig: &crate::node_agent::gpu::MigDevice) -> Value {
    let mut attributes = mig_attributes(&device.gpu, &mig.profile);
    attributes.insert("uuid".into(), json!({"string": mig.uuid}));
    attributes.insert("gpuInstance".into(), json!({"int": mig.gpu_instance}));
    attributes.insert("computeInstance".into(), json!({"int": mig.compute_instance}));
    let mut capacity = mig_capacity(mig.memory_bytes, mig.placement_start, mig.placement_size);
    capacity.insert("multiprocessors".into(), json!({"value": mig.multiprocessors.to_string()}));
    json!({"name": device.name(), "attributes": attributes, "capacity": capacity})
}

/// A whole GPU's attributes: NVIDIA's `gpu` type, its identity, whether MIG mode is on, and the common ones.
fn gpu_attributes(gpu: &Gpu) -> Map<String, Value> {
    let mut attributes = common_attributes(gpu);
    attributes.insert("type".into(), json!({"string": "gpu"}));
    attributes.insert("uuid".into(), json!({"string": gpu.uuid}));
    attributes.insert("index".into(), json!({"int": gpu.index}));
    attributes.insert("minor".into(), json!({"int": gpu.minor}));
    attributes.insert("migEnabled".into(), json!({"bool": gpu.mig_enabled}));
    attributes
}

/// The attributes every MIG device of `gpu` has, made or not: NVIDIA's `mig` type, its `profile`, its parent's
/// identity (`parentUUID`, `parentIndex`, `parentMinor`) and the common ones.
fn mig_attributes(gpu: &Gpu, profile: &str) -> Map<String, Value> {
    let mut attributes = common_attributes(gpu);
    attributes.insert("type".into(), json!({"string": "mig"}));
    attributes.insert("profile".into(), json!({"string": profile}));
    attributes.insert("parentUUID".into(), json!({"string": gpu.uuid}));
    attributes.insert("parentIndex".into(), json!({"int": gpu.index}));
    attributes.insert("parentMinor".into(), json!({"int": gpu.minor}));
    attributes
}

/// A MIG device's capacities with NVIDIA's names: `memory`, and `memorySlice<i>` (1) for each of the `size` memory
/// slices from `start` it spans.
fn mig_capacity(memory_bytes: u64, start: u32, size: u32) -> Map<String, Value> {
    let mut capacity = Map::new();
    capacity.insert("memory".into(), json!({"value": memory_quantity(memory_bytes)}));
    for slice in start..start + size {
        capacity.insert(format!("memorySlice{slice}"), json!({"value": "1"}));
    }
    capacity
}

/// The attributes a GPU and its MIG devices share: model, driver and PCI identity.
fn common_attributes(gpu: &Gpu) -> Map<String, Value> {
    let mut attributes = Map::new();
    let mut string = |name: &str, value: &str| {
        let value = &value[..value.floor_char_boundary(MAX_STRING_ATTRIBUTE)];
        attributes.insert(name.into(), json!({"string": value}));
    };
    string("productName", &gpu.product_name);
    string("brand", &gpu.brand);
    string("architecture", &gpu.architecture);
    string("resource.kubernetes.io/pciBusID", &gpu.pci_bus_id);
    if let Some(root) = &gpu.pcie_root {
        string("resource.kubernetes.io/pcieRoot", root);
    }
    if let Some(node) = gpu.numa_node {
        attributes.insert("resource.kubernetes.io/numaNode".into(), json!({"int": node}));
    }
    for (name, raw) in [
        ("cudaComputeCapability", &gpu.cuda_compute_capability),
        ("driverVersion", &gpu.driver_version),
        ("cudaDriverVersion", &gpu.cuda_driver_version),
    ] {
        // An attribute the API would reject is left out rather than losing the whole slice.
        match normalize_version(raw) {
            Some(version) => {
                attributes.insert(name.into(), json!({"version": version}));
            }
            None => warn!(gpu = %gpu.uuid, attribute = name, value = %raw, "not a version; attribute left out"),
        }
    }
    attributes
}

/// The most devices a slice of `devices` may hold: the API allows fewer once any device has taints.
pub fn max_devices_per_slice(devices: &[Value]) -> usize {
    if devices.iter().any(|d| d.get("taints").and_then(Value::as_array).is_some_and(|t| !t.is_empty())) {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS
    } else {
        MAX_DEVICES_PER_SLICE
    }
}

/// Bytes as a Kubernetes quantity, in Mi when exact (the form the API server keeps as is).
fn memory_quantity(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 20) { format!("{}Mi", bytes >> 20) } else { bytes.to_string() }
}

/// The node's pool as the agent publishes it (and `gpu-check` shows it): `devices` (those of `gpus`) with their
/// GPU's `taints` (by GPU UUID), less the partitions that MIG devices not among `ours` (UUIDs the agent made) are in
/// the way of, and the counter sets of GPUs published as partitions; split by [`pool_slices`].
pub fn node_pool(
    gpus: &[Gpu],
    devices: &[Device],
    sharing: Sharing,
    ours: &BTreeSet<String>,
    taints: &HashMap<String, Vec<Value>>,
) -> Vec<SliceContent> {
    let foreign: HashMap<&str, Vec<&MigDevice>> =
        gpus.iter().map(|gpu| (gpu.uuid.as_str(), partitions::foreign(gpu, ours))).collect();
    let published: Vec<Value> = devices
        .iter()
        .filter(|d| partitions::publishable(d, foreign.get(d.gpu.uuid.as_str()).map_or(&[], Vec::as_slice)))
        .map(|d| {
            let mut device = device(d, sharing);
            match taints.get(&d.gpu.uuid) {
                Some(taints) if !taints.is_empty() => device["taints"] = Value::Array(taints.clone()),
                _ => {}
            }
            device
        })
        .collect();
    let counter_sets = gpus
        .iter()
        .filter(|gpu| devices.iter().any(|d| d.partition.is_some() && d.gpu.uuid == gpu.uuid))
        .map(partitions::counter_set)
        .collect();
    pool_slices(published, counter_sets)
}

/// What one ResourceSlice holds: devices, or the counter sets that devices in the pool's other slices consume (from
/// Kubernetes 1.36 a slice holds one or the other).
#[derive(Debug, Clone, PartialEq)]
pub enum SliceContent {
    Devices(Vec<Value>),
    Counters(Vec<Value>),
}

impl SliceContent {
    /// The spec field it fills: `devices` or `sharedCounters`.
    pub fn field(&self) -> &'static str {
        match self {
            SliceContent::Devices(_) => "devices",
            SliceContent::Counters(_) => "sharedCounters",
        }
    }

    pub fn items(&self) -> &[Value] {
        match self {
            SliceContent::Devices(items) | SliceContent::Counters(items) => items,
        }
    }

    /// Its devices (none in a counter slice).
    pub fn devices(&self) -> &[Value] {
        match self {
            SliceContent::Devices(devices) => devices,
            SliceContent::Counters(_) => &[],
        }
    }
}

/// The node's pool: devices that consume no counters split as [`split_into_slices`] does (at
/// [`max_devices_per_slice`]), then one slice per counter set holding the devices that consume it (a GPU's
/// partitions: 26 on an H100, within the API's 64), then the counter sets, [`partitions::MAX_COUNTER_SETS_PER_SLICE`]
/// to a slice.
pub fn pool_slices(devices: Vec<Value>, counter_sets: Vec<Value>) -> Vec<SliceContent> {
    let (partitioned, plain): (Vec<Value>, Vec<Value>) =
        devices.into_iter().partition(|d| partitions::consumed_counter_set(d).is_some());
    let mut pool: Vec<SliceContent> = if plain.is_empty() && !partitioned.is_empty() {
        Vec::new()
    } else {
        let max = max_devices_per_slice(&plain);
        split_into_slices(plain, max).into_iter().map(SliceContent::Devices).collect()
    };
    let mut by_set: std::collections::BTreeMap<String, Vec<Value>> = Default::default();
    for device in partitioned {
        let set = partitions::consumed_counter_set(&device).unwrap_or_default().to_string();
        by_set.entry(set).or_default().push(device);
    }
    for devices in by_set.into_values() {
        let slices = split_into_slices(devices, partitions::MAX_DEVICES_PER_SLICE_WITH_COUNTERS);
        pool.extend(slices.into_iter().map(SliceContent::Devices));
    }
    for chunk in counter_sets.chunks(partitions::MAX_COUNTER_SETS_PER_SLICE) {
        pool.push(SliceContent::Counters(chunk.to_vec()));
    }
    pool
}

/// Devices sorted by name, split into slices of at most `max` (at least one slice, possibly empty: a pool
/// is published even when the node has no GPU, so the scheduler knows there is none).
pub fn split_into_slices(mut devices: Vec<Value>, max: usize) -> Vec<Vec<Value>> {
    devices.sort_by(|a, b| natural_key(&a["name"]).cmp(&natural_key(&b["name"])));
    if devices.is_empty() {
        return vec![Vec::new()];
    }
    devices.chunks(max.max(1)).map(<[Value]>::to_vec).collect()
}

/// `gpu-10` after `gpu-9`.
fn natural_key(name: &Value) -> (String, u64) {
    let name = name.as_str().unwrap_or_default();
    let digits: String =
        name.chars().rev().take_while(char::is_ascii_digit).collect::<Vec<_>>().into_iter().rev().collect();
    (name[..name.len() - digits.len()].to_string(), digits.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_agent::discovery::Discovery;
    use crate::node_agent::discovery::simulated::Simulated;

    fn gpus(spec: &str) -> Vec<Gpu> {
        Simulated::new("node", spec).expect("spec").discover().expect("discover")
    }

    #[test]
    fn a_string_attribute_is_cut_to_the_apis_64_bytes_at_a_character() {
        let mut gpu = gpus("1xH100-80GB").remove(0);
        gpu.product_name = "NVIDIA H100 ".to_string() + &"é".repeat(40);
        let d = device(&Device::whole(&gpu), Sharing::Whole);
        let name = d["attributes"]["productName"]["string"].as_str().expect("productName");
        assert!(name.len() <= 64 && name.len() >= 63 && gpu.product_name.starts_with(name), "{name}");
    }

    #[test]
    fn device_carries_nvidia_compatible_attributes() {
        let mut gpu = gpus("1xH100-80GB").remove(0);
        gpu.driver_version = "535.104.05".into();
        gpu.pcie_root = Some("pci0000:16".into());
        gpu.numa_node = Some(1);
        let d = device(&Device::whole(&gpu), Sharing::Whole);
        assert_eq!(d["name"], "gpu-0");
        assert_eq!(d["attributes"]["type"], json!({"string": "gpu"}));
        assert_eq!(d["attributes"]["productName"], json!({"string": "NVIDIA H100 80GB HBM3"}));
        assert_eq!(d["attributes"]["driverVersion"], json!({"version": "535.104.5"}));
        assert_eq!(d["attributes"]["cudaComputeCapability"], json!({"version": "9.0.0"}));
        assert_eq!(d["attributes"]["resource.kubernetes.io/pciBusID"], json!({"string": "0000:18:00.0"}));
        assert_eq!(d["attributes"]["resource.kubernetes.io/pcieRoot"], json!({"string": "pci0000:16"}));
        assert_eq!(d["attributes"]["resource.kubernetes.io/numaNode"], json!({"int": 1}));
        assert_eq!(d["capacity"]["memory"], json!({"value": "81559Mi"}));
        // A root or NUMA node sysfs does not show is left out, not guessed.
        gpu.pcie_root = None;
        gpu.numa_node = None;
        let d = device(&Device::whole(&gpu), Sharing::Whole);
        assert!(d["attributes"].get("resource.kubernetes.io/pcieRoot").is_none(), "{d}");
        assert!(d["attributes"].get("resource.kubernetes.io/numaNode").is_none(), "{d}");
        assert!(d["attributes"].as_object().is_some_and(|a| a.len() <= 32), "API limit: 32 attributes+capacities");
    }

    #[test]
    fn a_shared_gpu_lets_claims_consume_its_memory() {
        let gpu = gpus("1xH100-80GB").remove(0);
        let whole = device(&Device::whole(&gpu), Sharing::Whole);
        assert!(whole.get("allowMultipleAllocations").is_none());
        assert!(whole["capacity"]["memory"].get("requestPolicy").is_none());
        let shared = device(&Device::whole(&gpu), Sharing::ByMemory);
        assert_eq!(shared["allowMultipleAllocations"], true);
        assert_eq!(
            shared["capacity"]["memory"],
            json!({"value": "81559Mi", "requestPolicy": {"default": "81559Mi", "validRange": {"min": "1024Mi", "max": "81559Mi"}}})
        );
        assert_eq!(
            shared["capacity"]["compute"],
            json!({"value": "100", "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}}),
            "a claim naming no compute takes none of it"
        );
        assert!(whole["capacity"].get("compute").is_none(), "a GPU not shared has no compute to split");
        assert_eq!(shared["attributes"], whole["attributes"]);
        let counted = shared["attributes"].as_object().map_or(0, |a| a.len())
            + shared["capacity"].as_object().map_or(0, |c| c.len());
        assert!(counted <= 32, "API limit: 32 attributes+capacities, {counted}");
    }

    #[test]
    fn a_mig_device_is_published_with_its_profile_and_parent() {
        let gpus = gpus("1xH100-80GB/mig=3g.40gb+1g.10gb");
        let devices = crate::node_agent::device::devices(&gpus, crate::node_agent::device::MigLayout::Static);
        assert_eq!(devices.len(), 2, "a GPU in MIG mode is its MIG devices only");
        // Sharing by memory is for whole GPUs: a MIG device is always one claim's.
        let d = device(&devices[1], Sharing::ByMemory);
        assert_eq!(d["name"], "gpu-0-mig-19-4-1");
        assert!(d.get("allowMultipleAllocations").is_none());
        let a = &d["attributes"];
        assert_eq!(a["type"], json!({"string": "mig"}));
        assert_eq!(a["profile"], json!({"string": "1g.10gb"}));
        assert_eq!(a["uuid"], json!({"string": gpus[0].mig_devices[1].uuid}));
        assert_eq!(a["parentUUID"], json!({"string": gpus[0].uuid}));
        assert_eq!((&a["parentIndex"], &a["parentMinor"]), (&json!({"int": 0}), &json!({"int": 0})));
        assert_eq!(a["productName"], json!({"string": "NVIDIA H100 80GB HBM3"}));
        assert!(a.get("migEnabled").is_none() && a.get("minor").is_none());
        assert_eq!(
            d["capacity"],
            json!({"memory": {"value": "10194Mi"}, "multiprocessors": {"value": "16"}, "memorySlice4": {"value": "1"}})
        );
        let big = device(&devices[0], Sharing::Whole);
        let slices: Vec<&String> = big["capacity"].as_object().into_iter().flat_map(|c| c.keys()).collect();
        assert_eq!(
            slices,
            ["memory", "memorySlice0", "memorySlice1", "memorySlice2", "memorySlice3", "multiprocessors"]
        );
        let counted = |d: &Value| {
            d["attributes"].as_object().map_or(0, |a| a.len()) + d["capacity"].as_object().map_or(0, |c| c.len())
        };
        // A 7g device spans all 8 slices: the most capacities a MIG device has.
        assert!(counted(&big) + 4 <= 32, "API limit: 32 attributes+capacities");
    }

    #[test]
    fn an_odd_version_drops_only_that_attribute() {
        let mut gpu = gpus("1xL4-24GB").remove(0);
        gpu.driver_version = "unknown".into();
        let d = device(&Device::whole(&gpu), Sharing::Whole);
        assert!(d["attributes"].get("driverVersion").is_none());
        assert!(d["attributes"].get("cudaDriverVersion").is_some());
    }

    #[test]
    fn splits_at_the_api_limit_in_natural_order() {
        let devices: Vec<Value> =
            gpus("300xL4-24GB").iter().rev().map(|g| device(&Device::whole(g), Sharing::Whole)).collect();
        let slices = split_into_slices(devices, MAX_DEVICES_PER_SLICE);
        assert_eq!(slices.iter().map(Vec::len).collect::<Vec<_>>(), [128, 128, 44]);
        assert_eq!(slices[0][9]["name"], "gpu-9");
        assert_eq!(slices[0][10]["name"], "gpu-10");
        assert_eq!(split_into_slices(Vec::new(), 128), vec![Vec::<Value>::new()]);
    }

    #[test]
    fn partitions_get_a_slice_per_gpu_and_counters_slices_of_their_own() {
        let gpus = gpus("2xL4-24GB,9xH100-80GB/mig=");
        let devices = crate::node_agent::device::devices(&gpus, crate::node_agent::device::MigLayout::Dynamic);
        let published: Vec<Value> = devices.iter().map(|d| device(d, Sharing::Whole)).collect();
        let sets: Vec<Value> = gpus[2..].iter().map(partitions::counter_set).collect();
        let pool = pool_slices(published, sets);
        let shape: Vec<(&str, usize)> = pool.iter().map(|s| (s.field(), s.items().len())).collect();
        let mut want = vec![("devices", 2)];
        want.extend([("devices", 26); 9]);
        want.extend([("sharedCounters", 8), ("sharedCounters", 1)]);
        assert_eq!(shape, want, "whole GPUs; each MIG GPU's partitions; counter sets 8 to a slice");
        for slice in &pool[1..10] {
            let sets: BTreeSet<_> = slice.devices().iter().filter_map(partitions::consumed_counter_set).collect();
            assert_eq!(sets.len(), 1, "one GPU's partitions per slice");
        }
        assert!(pool[10].devices().is_empty(), "a counter slice has no devices");
        let only = pool_slices(vec![device(&devices[2], Sharing::Whole)], vec![partitions::counter_set(&gpus[2])]);
        assert_eq!(only.iter().map(SliceContent::field).collect::<Vec<_>>(), ["devices", "sharedCounters"]);
        assert_eq!(pool_slices(Vec::new(), Vec::new()), vec![SliceContent::Devices(Vec::new())]);
    }

    #[test]
    fn a_tainted_device_halves_the_slice_size() {
        let mut devices: Vec<Value> =
            gpus("100xL4-24GB").iter().map(|g| device(&Device::whole(g), Sharing::Whole)).collect();
        assert_eq!(max_devices_per_slice(&devices), MAX_DEVICES_PER_SLICE);
        devices[7]["taints"] = json!([]);
        assert_eq!(max_devices_per_slice(&devices), MAX_DEVICES_PER_SLICE);
        devices[7]["taints"] = json!([{"key": "gpu.example.com/gpu-lost", "effect": "NoExecute"}]);
        assert_eq!(max_devices_per_slice(&devices), MAX_DEVICES_PER_SLICE_WITH_TAINTS);
        let slices = split_into_slices(devices.clone(), max_devices_per_slice(&devices));
        assert_eq!(slices.iter().map(Vec::len).collect::<Vec<_>>(), [64, 36]);
    }
}
