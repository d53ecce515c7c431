//! What preparing one claim means, decided without I/O: the claim as read from the API plus this node's GPUs give
//! the list of GPUs to hand out, or the reason to refuse.
//!
//! Refusals are per claim and write nothing. They guard against the mistakes that would hand a container the wrong
//! GPU: a claim deleted and re-created under the same name (UID mismatch), a claim not allocated, results for
//! another node's pool, and devices this node does not have (e.g. a GPU that vanished since the slice was
//! published).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

use super::config::{
    ConfigEntry, DeviceKind, GpuConfig, SharingStrategy, TimeSliceInterval, effective_config,
    memory_bytes as memory_bytes_of,
};
use crate::node_agent::device::Device;

/// This node's devices by ResourceSlice device name (`gpu-<minor>`, `gpu-<minor>-mig-…`).
pub type Inventory = BTreeMap<String, Device>;

/// The claim kubelet asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ClaimRef {
    /// How a refusal of this claim names the claim `uid` (`namespace/name`) that is in its way: in full when it is
    /// of the same namespace, otherwise only as another namespace's. A refusal reaches the kubelet, which puts it in
    /// the pod's Events, readable by whoever reads that namespace; the agent's log names the other claim (see
    /// [`super::checkpoint::Checkpoint::holders_beside`]).
    pub fn other(&self, namespace: &str, name: &str, uid: &str) -> String {
        if namespace.is_empty() {
            // Adopted from its CDI spec after the checkpoint was lost: only its UID is known.
            "a claim recovered from its CDI spec (the node agent's log names it)".to_string()
        } else if namespace == self.namespace {
            format!("claim {namespace}/{name} (UID {uid})")
        } else {
            "a claim of another namespace (the node agent's log names it)".to_string()
        }
    }
}

/// One allocated device, ready to be prepared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedDevice {
    /// The request as the allocation names it (`gpus` or `gpus/h100` for a subrequest).
    pub request: String,
    pub pool: String,
    pub device: Device,
    pub share_id: Option<String>,
    /// A share (`share_id`) of all of its GPU's memory, as a claim naming no memory gets on a GPU shared by memory
    /// (the request policy's default): no other share fits beside it, so it holds the GPU whole.
    pub all_memory: bool,
    /// The memory a share (`share_id`) consumed of its GPU, as the scheduler recorded it.
    pub memory_bytes: Option<u64>,
    pub admin_access: bool,
    pub config: GpuConfig,
}

impl PlannedDevice {
    /// The request name kubelet matches against containers' `resources.claims[].request`: without `/subrequest`.
    pub fn base_request(&self) -> &str {
        self.request.split('/').next().unwrap_or(&self.request)
    }
}

/// Decides which of this node's GPUs `claim` (as read from the API) allocates to driver `driver` in pool `pool`.
pub fn plan(
    wanted: &ClaimRef,
    claim: &ResourceClaim,
    driver: &str,
    pool: &str,
    inventory: &Inventory,
) -> Result<Vec<PlannedDevice>, String> {
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if uid != wanted.uid {
        return Err(format!(
            "claim {wanted} has UID {uid:?}, kubelet asked for {:?}: it was deleted and re-created; not preparing it",
            wanted.uid
        ));
    }
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Err(format!("claim {wanted} is not allocated: nothing to prepare"));
    };
    let Some(devices) = allocation.devices.as_ref() else {
        return Ok(Vec::new());
    };
    let configs: Vec<ConfigEntry<'_>> = devices
        .config
        .iter()
        .flatten()
        .filter_map(|c| {
            let opaque = c.opaque.as_ref()?;
            Some(ConfigEntry {
                source: &c.source,
                requests: c.requests.as_deref().unwrap_or_default(),
                driver: &opaque.driver,
                parameters: &opaque.parameters.0,
            })
        })
        .collect();
    let mut planned = Vec::new();
    for result in devices.results.iter().flatten().filter(|r| r.driver == driver) {
        if result.pool != pool {
            return Err(format!(
                "claim {wanted}: request {:?} is allocated device {:?} of pool {:?}, but this node's pool is {pool:?}",
                result.request, result.device, result.pool
            ));
        }
        let Some(device) = inventory.get(&result.device) else {
            if inventory.is_empty() {
                return Err(format!(
                    "claim {wanted}: request {:?} is allocated device {:?}, but this node's GPUs are not discovered \
                     (the NVIDIA driver is missing or unusable: see the node agent's /readyz and log); retried until \
                     they are",
                    result.request, result.device
                ));
            }
            return Err(format!(
                "claim {wanted}: request {:?} is allocated device {:?}, which this node does not have (it has {})",
                result.request,
                result.device,
                inventory.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        };
        // As published: a dynamic-MIG GPU's whole partition is type `gpu` (the whole-GPU class finds it).
        let whole_partition = device.partition.as_ref().is_some_and(|p| p.whole);
        let kind = if device.is_mig() && !whole_partition { DeviceKind::Mig } else { DeviceKind::Gpu };
        let config =
            effective_config(driver, &result.request, kind, &configs).map_err(|e| format!("claim {wanted}: {e}"))?;
        let interval = config.sharing.time_slicing.as_ref().map(|t| t.interval).unwrap_or_default();
        if device.is_mig()
            && config.sharing.strategy == SharingStrategy::TimeSlicing
            && interval != TimeSliceInterval::Default
        {
            if whole_partition {
                return Err(format!(
                    "claim {wanted}: request {:?} asks time slice {interval:?} of device {:?}, a GPU in MIG mode \
                     (dynamic MIG: its whole is a MIG device spanning it); a time slice is set on GPUs out of MIG \
                     mode only. Select those: `device.attributes['{driver}'].migEnabled == false`",
                    result.request, result.device
                ));
            }
            return Err(format!(
                "claim {wanted}: request {:?} asks time slice {interval:?} of MIG device {:?}; a time slice is set \
                 on whole GPUs only (a MIG device is isolated from its siblings). Drop timeSlicingConfig for MIG \
                 devices",
                result.request, result.device
            ));
        }
        planned.push(PlannedDevice {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: device.clone(),
            share_id: result.share_id.clone(),
            all_memory: result.share_id.is_some()
                && consumed_memory(result).is_some_and(|bytes| bytes >= device.gpu.memory_bytes),
            memory_bytes: result.share_id.as_ref().and(consumed_memory(result)),
            admin_access: result.admin_access.unwrap_or(false),
            config,
        });
    }
    Ok(planned)
}

/// What `result` consumed of its device's `memory` capacity (the scheduler records what each share of a device with
/// `allowMultipleAllocations` consumes).
fn consumed_memory(result: &DeviceRequestAllocationResult) -> Option<u64> {
    let consumed = result.consumed_capacity.as_ref()?.get("memory")?;
    memory_bytes_of(&consumed.0)
        .inspect_err(|error| {
            tracing::warn!(device = %result.device, %error, "the memory a share consumed cannot be read: it is not \
                           counted beside the GPU's other shares");
        })
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_only_claims_of_the_refused_claims_namespace() {
        let claim = ClaimRef { namespace: "team-a".into(), name: "mine".into(), uid: "u1".into() };
        assert_eq!(claim.other("team-a", "theirs", "u2"), "claim team-a/theirs (UID u2)");
        let other = claim.other("team-b", "secret-project", "u3");
        assert!(!other.contains("team-b") && !other.contains("secret-project") && !other.contains("u3"), "{other}");
        assert!(other.contains("another namespace"), "{other}");
        let recovered = claim.other("", "", "u4");
        assert!(recovered.contains("recovered from its CDI spec") && !recovered.contains("u4"), "{recovered}");
    }
    use crate::node_agent::gpu::test_gpu;
    use serde_json::json;

    const DRIVER: &str = "gpu.gpu-dra.dev";

    fn inventory() -> Inventory {
        let gpus = [0, 1].map(|m| test_gpu(m, &format!("0000:{m:02x}:00.0")));
        let mut inventory: Inventory = gpus.iter().map(|g| (g.device_name(), Device::whole(g))).collect();
        // GPU 2 in MIG mode, with one 1g.10gb.
        let simulated =
            crate::node_agent::discovery::simulated::Simulated::new("n", "2xL4-24GB,1xH100-80GB/mig=1g.10gb");
        let gpus = simulated.map(|s| crate::node_agent::discovery::Discovery::discover(&s).unwrap_or_default());
        for mig in
            crate::node_agent::device::devices(&gpus.unwrap_or_default(), crate::node_agent::device::MigLayout::Static)
                .into_iter()
                .filter(|d| d.mig.is_some())
        {
            inventory.insert(mig.name(), mig);
        }
        inventory
    }

    fn wanted() -> ClaimRef {
        ClaimRef { namespace: "ns".into(), name: "c".into(), uid: "uid-1".into() }
    }

    fn claim(status: serde_json::Value) -> ResourceClaim {
        let value = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "ns", "name": "c", "uid": "uid-1"},
            "spec": {}, "status": status,
        });
        serde_json::from_value(value).unwrap_or_else(|e| panic!("test claim: {e}"))
    }

    fn allocated(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        claim(json!({"allocation": {"devices": {"results": results, "config": config}}}))
    }

    fn result(request: &str, pool: &str, device: &str) -> serde_json::Value {
        json!({"request": request, "driver": DRIVER, "pool": pool, "device": device})
    }

    #[test]
    fn plans_the_allocated_gpus_of_this_driver_only() {
        let claim = allocated(
            json!([
                result("gpus/h100", "node-a", "gpu-1"),
                {"request": "nic", "driver": "net.example.com", "pool": "node-a", "device": "eth0"},
            ]),
            json!([]),
        );
        let planned = plan(&wanted(), &claim, DRIVER, "node-a", &inventory()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(planned.len(), 1);
        assert_eq!((planned[0].base_request(), planned[0].device.gpu.minor), ("gpus", 1));
    }

    #[test]
    fn refusals_say_why() {
        let other_uid = {
            let mut c = allocated(json!([result("g", "node-a", "gpu-0")]), json!([]));
            c.metadata.uid = Some("uid-2".into());
            c
        };
        let bad_config = allocated(
            json!([result("g", "node-a", "gpu-0")]),
            json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "gpu.gpu-dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "Nope"}}}}]),
        );
        let time_sliced_mig = |interval: &str| {
            allocated(
                json!([result("g", "node-a", "gpu-2-mig-19-0-1")]),
                json!([{"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {
                    "apiVersion": "gpu.gpu-dra.dev/v1alpha1", "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}}}]),
            )
        };
        let planned = plan(&wanted(), &time_sliced_mig("Default"), DRIVER, "node-a", &inventory());
        assert!(
            planned.as_ref().is_ok_and(|p| p[0].device.mig.is_some()),
            "the default time slice is no ask: {planned:?}"
        );
        let cases = [
            (time_sliced_mig("Long"), "asks time slice Long of MIG device \"gpu-2-mig-19-0-1\""),
            (other_uid, "deleted and re-created"),
            (claim(json!({})), "is not allocated"),
            (allocated(json!([result("g", "node-b", "gpu-0")]), json!([])), "this node's pool is \"node-a\""),
            (
                allocated(json!([result("g", "node-a", "gpu-7")]), json!([])),
                "does not have (it has gpu-0, gpu-1, gpu-2-mig-19-0-1)",
            ),
            (bad_config, "config #1 (FromClaim): sharing.strategy: unknown variant `Nope`"),
        ];
        for (claim, expected) in cases {
            match plan(&wanted(), &claim, DRIVER, "node-a", &inventory()) {
                Ok(planned) => panic!("expected refusal {expected:?}, planned {planned:?}"),
                Err(reason) => assert!(reason.contains(expected), "{reason:?} lacks {expected:?}"),
            }
        }
    }

    /// A share of a GPU shared by memory that consumed all of it (a claim naming no memory) holds the GPU whole; one
    /// of part of it does not. Results without a share ID never count as shares.
    #[test]
    fn a_share_of_all_the_memory_holds_the_gpu_whole() -> Result<(), String> {
        let share = |request: &str, device: &str, memory: &str| {
            let mut result = result(request, "node-a", device);
            result["shareID"] = json!(format!("share-{request}"));
            result["consumedCapacity"] = json!({"memory": memory});
            result
        };
        let claim = allocated(json!([share("all", "gpu-0", "80Gi"), share("half", "gpu-1", "40Gi")]), json!([]));
        let planned = plan(&wanted(), &claim, DRIVER, "node-a", &inventory())?;
        let whole: Vec<(&str, bool)> = planned.iter().map(|p| (p.request.as_str(), p.all_memory)).collect();
        assert_eq!(whole, [("all", true), ("half", false)]);
        Ok(())
    }

    /// NVIDIA's `GpuConfig` naming no request configures the claim's whole GPUs only, not its MIG devices (NVIDIA's
    /// driver does the same): a claim of both with a long time slice for its GPU is prepared, the MIG device as is.
    #[test]
    fn nvidia_gpu_config_leaves_the_claims_mig_devices_alone() -> Result<(), String> {
        let gpu_config = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}}}]);
        let claim = allocated(
            json!([result("gpu", "node-a", "gpu-0"), result("mig", "node-a", "gpu-2-mig-19-0-1")]),
            gpu_config,
        );
        let planned = plan(&wanted(), &claim, DRIVER, "node-a", &inventory())?;
        let intervals: Vec<(&str, Option<TimeSliceInterval>)> = planned
            .iter()
            .map(|p| (p.request.as_str(), p.config.sharing.time_slicing.as_ref().map(|t| t.interval)))
            .collect();
        assert_eq!(intervals, [("gpu", Some(TimeSliceInterval::Long)), ("mig", None)]);
        Ok(())
    }

    /// On a dynamic-MIG node a GPU's whole partition is published as a GPU (type `gpu`), so NVIDIA's `GpuConfig`
    /// naming no request configures it, as it would in NVIDIA's driver, which decides by the published type.
    #[test]
    fn nvidia_gpu_config_configures_a_dynamic_mig_gpus_whole() -> Result<(), String> {
        let mut gpu = test_gpu(5, "0000:05:00.0");
        gpu.mig_enabled = true;
        let devices = crate::node_agent::device::devices(&[gpu], crate::node_agent::device::MigLayout::Dynamic);
        let whole = devices.into_iter().find(|d| d.partition.as_ref().is_some_and(|p| p.whole)).ok_or("no whole")?;
        let mut inventory = inventory();
        inventory.insert(whole.name(), whole);
        let gpu_config = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}}}]);
        let claim = allocated(json!([result("gpu", "node-a", "gpu-5")]), gpu_config);
        let planned = plan(&wanted(), &claim, DRIVER, "node-a", &inventory)?;
        assert_eq!(planned.len(), 1);
        assert_eq!(planned[0].config.sharing.strategy, SharingStrategy::TimeSlicing);
        // An explicit interval there is refused, naming the selector for GPUs out of MIG mode.
        let long = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}}}]);
        let claim = allocated(json!([result("gpu", "node-a", "gpu-5")]), long);
        let error = plan(&wanted(), &claim, DRIVER, "node-a", &inventory).err().ok_or("planned")?;
        let selector = format!("device.attributes['{DRIVER}'].migEnabled == false");
        assert!(error.contains("a GPU in MIG mode") && error.contains(&selector), "{error}");
        Ok(())
    }
}
