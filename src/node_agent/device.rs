//! What the agent publishes and prepares: a whole GPU, or one MIG device of a GPU in MIG mode. Pure.
//!
//! A GPU in MIG mode is never published whole: CUDA cannot use it whole while MIG is on, and publishing it beside
//! its MIG devices would let the scheduler hand out both. Its health is its MIG devices' health.

use super::gpu::{Gpu, MigDevice};

/// One publishable device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// The physical GPU (the whole device, or the parent of `mig`).
    pub gpu: Gpu,
    pub mig: Option<MigDevice>,
}

impl Device {
    /// The whole of `gpu`.
    pub fn whole(gpu: &Gpu) -> Self {
        Self { gpu: gpu.clone(), mig: None }
    }

    /// The ResourceSlice device name: `gpu-<minor>`, or for a MIG device
    /// `gpu-<minor>-mig-<profile ID>-<placement start>-<placement size>` (NVIDIA's canonical form: the same
    /// layout gets the same names after a reboot, whatever instance IDs the driver hands out).
    pub fn name(&self) -> String {
        match &self.mig {
            None => self.gpu.device_name(),
            Some(mig) => mig_device_name(&self.gpu, mig),
        }
    }

    /// The UUID a CUDA program sees: the GPU's, or the MIG device's `MIG-…`.
    pub fn uuid(&self) -> &str {
        self.mig.as_ref().map_or(&self.gpu.uuid, |m| &m.uuid)
    }
}

/// The name of `mig` on `gpu` (see [`Device::name`]).
fn mig_device_name(gpu: &Gpu, mig: &MigDevice) -> String {
    format!("{}-mig-{}-{}-{}", gpu.device_name(), mig.profile_id, mig.placement_start, mig.placement_size)
}

/// The GPU that `name` names: its device name or UUID, or one of its MIG devices' (a fault NVML reports for a MIG
/// device is its GPU's). A GPU in MIG mode without MIG devices is found by its own name or UUID too.
pub fn gpu_named<'a>(gpus: &'a [Gpu], name: &str) -> Option<&'a Gpu> {
    gpus.iter().find(|gpu| {
        gpu.device_name() == name
            || gpu.uuid == name
            || gpu.mig_devices.iter().any(|mig| mig.uuid == name || mig_device_name(gpu, mig) == name)
    })
}

/// The GPU device name of a MIG device's name (`gpu-3` for `gpu-3-mig-…`), `None` for any other name: for records
/// that keep names only.
pub fn mig_parent_name(name: &str) -> Option<&str> {
    let (parent, _) = name.split_once("-mig-")?;
    let minor = parent.strip_prefix("gpu-")?;
    (!minor.is_empty() && minor.bytes().all(|b| b.is_ascii_digit())).then_some(parent)
}

/// Whether a ResourceSlice device name is a MIG device's (`gpu-<minor>-mig-…`).
pub fn is_mig_device_name(name: &str) -> bool {
    mig_parent_name(name).is_some()
}

/// The devices of `gpus`: each GPU whole, or its MIG devices when MIG mode is on (none when no MIG device exists
/// yet: such a GPU has nothing a container could use).
pub fn devices(gpus: &[Gpu]) -> Vec<Device> {
    gpus.iter()
        .flat_map(|gpu| -> Vec<Device> {
            if gpu.mig_enabled {
                let parent = Gpu { mig_devices: Vec::new(), ..gpu.clone() };
                gpu.mig_devices.iter().map(|mig| Device { gpu: parent.clone(), mig: Some(mig.clone()) }).collect()
            } else {
                vec![Device::whole(gpu)]
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_agent::gpu::test_gpu;

    pub(crate) fn mig(profile: &str, profile_id: u32, gi: u32, start: u32, size: u32) -> MigDevice {
        MigDevice {
            uuid: format!("MIG-{gi:08x}-0000-0000-0000-000000000000"),
            profile: profile.into(),
            profile_id,
            gpu_instance: gi,
            compute_instance: 0,
            placement_start: start,
            placement_size: size,
            memory_bytes: u64::from(size) * (10 << 30),
            multiprocessors: 16,
            gi_cap_minor: 3 + gi * 9,
            ci_cap_minor: 4 + gi * 9,
            caps_major: Some(508),
        }
    }

    #[test]
    fn a_gpu_in_mig_mode_is_its_mig_devices() {
        let whole = test_gpu(0, "0000:01:00.0");
        let mut partitioned = test_gpu(1, "0000:02:00.0");
        partitioned.mig_enabled = true;
        partitioned.mig_devices = vec![mig("3g.40gb", 9, 1, 0, 4), mig("1g.10gb", 19, 7, 4, 1)];
        let mut empty = test_gpu(2, "0000:03:00.0");
        empty.mig_enabled = true;
        let all = devices(&[whole, partitioned, empty.clone()]);
        let names: Vec<String> = all.iter().map(Device::name).collect();
        assert_eq!(names, ["gpu-0", "gpu-1-mig-9-0-4", "gpu-1-mig-19-4-1"]);
        assert_eq!(all[0].uuid(), all[0].gpu.uuid);
        assert_eq!(all[2].uuid(), "MIG-00000007-0000-0000-0000-000000000000");
        assert!(all[1].gpu.mig_devices.is_empty(), "a MIG device's parent does not carry its siblings");
        assert!(names.iter().all(|n| is_mig_device_name(n) == n.contains("-mig-")), "{names:?}");
        for not_mig in ["gpu-1", "gpu--mig-1", "gpux-mig-1", "nic-0-mig-1", "gpu-1-mi"] {
            assert!(!is_mig_device_name(not_mig), "{not_mig}");
        }
        assert_eq!(mig_parent_name("gpu-12-mig-19-4-1"), Some("gpu-12"));
        let gpus = [test_gpu(0, "0000:01:00.0"), all[1].gpu.clone(), empty.clone()];
        let mut gpus = gpus.to_vec();
        gpus[1].mig_devices = vec![mig("3g.40gb", 9, 1, 0, 4), mig("1g.10gb", 19, 7, 4, 1)];
        let found = |name: &str| gpu_named(&gpus, name).map(|g| g.minor);
        assert_eq!(found("gpu-0"), Some(0));
        assert_eq!(found("gpu-1-mig-19-4-1"), Some(1), "a MIG device's name is its GPU's");
        assert_eq!(found("MIG-00000007-0000-0000-0000-000000000000"), Some(1), "and its UUID");
        assert_eq!(found(&empty.uuid), Some(2), "a GPU in MIG mode without MIG devices is still found");
        assert_eq!(found("gpu-1"), Some(1));
        assert_eq!(found("gpu-7"), None);
    }
}
