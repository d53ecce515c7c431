//! What the agent publishes and prepares: a whole GPU, one MIG device of a GPU in MIG mode, or (dynamic MIG) a MIG
//! device the agent makes when a claim of it is prepared. Pure.
//!
//! A GPU in MIG mode is never published whole as a GPU: CUDA cannot use it whole while MIG is on, and publishing it
//! beside its MIG devices would let the scheduler hand out both. With dynamic MIG its whole is the MIG device that
//! spans it, made on prepare like any other partition. Its health is its MIG devices' health.

use super::gpu::{Gpu, MigDevice};
use super::mig::{self, Profile};

/// One publishable device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// The physical GPU (the whole device, or the parent of `mig`).
    pub gpu: Gpu,
    /// The MIG device, when it exists (for a partition: once made).
    pub mig: Option<MigDevice>,
    /// Dynamic MIG: the MIG device prepare makes (and unprepare destroys) for the claim allocated this device.
    pub partition: Option<Partition>,
}

/// A MIG device of a profile at a placement that dynamic MIG publishes before it exists: the scheduler picks one
/// (the GPU's counters keep it from overlapping others), NodePrepareResources makes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Partition {
    pub profile: Profile,
    /// First memory slice.
    pub start: u32,
    /// Published as the GPU itself (`gpu-<minor>`, type `gpu`): the profile spanning every slice, so that claims
    /// for whole GPUs still find one on a dynamic-MIG node.
    pub whole: bool,
}

impl Device {
    /// The whole of `gpu`.
    pub fn whole(gpu: &Gpu) -> Self {
        Self { gpu: gpu.clone(), mig: None, partition: None }
    }

    /// The ResourceSlice device name: `gpu-<minor>`, or for a MIG device
    /// `gpu-<minor>-mig-<profile ID>-<placement start>-<placement size>` (NVIDIA's canonical form: the same
    /// layout gets the same names after a reboot, whatever instance IDs the driver hands out; a partition has the
    /// name of the MIG device it becomes).
    pub fn name(&self) -> String {
        match (&self.partition, &self.mig) {
            (Some(p), _) if p.whole => self.gpu.device_name(),
            (Some(p), _) => placement_name(&self.gpu, p.profile.id, p.start, p.profile.memory_slices),
            (None, None) => self.gpu.device_name(),
            (None, Some(mig)) => mig_device_name(&self.gpu, mig),
        }
    }

    /// Whether CUDA sees a MIG device (a time slice is never set for one).
    pub fn is_mig(&self) -> bool {
        self.mig.is_some() || self.partition.is_some()
    }

    /// The UUID a CUDA program sees: the GPU's, or the MIG device's `MIG-…`.
    pub fn uuid(&self) -> &str {
        self.mig.as_ref().map_or(&self.gpu.uuid, |m| &m.uuid)
    }
}

/// The name of `mig` on `gpu` (see [`Device::name`]).
fn mig_device_name(gpu: &Gpu, mig: &MigDevice) -> String {
    placement_name(gpu, mig.profile_id, mig.placement_start, mig.placement_size)
}

fn placement_name(gpu: &Gpu, profile_id: u32, start: u32, size: u32) -> String {
    format!("{}-mig-{profile_id}-{start}-{size}", gpu.device_name())
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

/// Whether two device names of one pool share hardware: the same device, a GPU and one of its MIG devices, or two
/// MIG devices of one GPU whose memory slices overlap. A MIG name whose placement cannot be read overlaps every
/// device of its GPU (refusing is the safe side). Pure: what the kubelet plugin refuses a second claim by.
pub fn devices_overlap(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (mig_parent_name(a), mig_parent_name(b)) {
        (Some(parent), None) => parent == b,
        (None, Some(parent)) => parent == a,
        (Some(pa), Some(pb)) if pa == pb => match (mig_slices(a), mig_slices(b)) {
            (Some((s1, n1)), Some((s2, n2))) => s1 < s2.saturating_add(n2) && s2 < s1.saturating_add(n1),
            _ => true,
        },
        _ => false,
    }
}

/// The memory slices (first, count) of a MIG device name `gpu-<minor>-mig-<profile>-<start>-<size>`.
fn mig_slices(name: &str) -> Option<(u32, u32)> {
    let (_, placement) = name.split_once("-mig-")?;
    let mut parts = placement.split('-');
    let (_profile, start, size) = (parts.next()?, parts.next()?.parse().ok()?, parts.next()?.parse().ok()?);
    parts.next().is_none().then_some((start, size))
}

/// Whether a ResourceSlice device name is a MIG device's (`gpu-<minor>-mig-…`).
pub fn is_mig_device_name(name: &str) -> bool {
    mig_parent_name(name).is_some()
}

/// How GPUs in MIG mode are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MigLayout {
    /// As the MIG devices that exist on them (an administrator made them).
    Static,
    /// As every placement of every profile plus the whole, made on prepare ([`Partition`]); GPUs of a model
    /// without a profile table stay static.
    Dynamic,
}

/// The devices of `gpus`: each GPU whole, or when MIG mode is on its MIG devices (none when no MIG device exists
/// yet: such a GPU has nothing a container could use) or, with [`MigLayout::Dynamic`], its partitions.
pub fn devices(gpus: &[Gpu], layout: MigLayout) -> Vec<Device> {
    gpus.iter()
        .flat_map(|gpu| -> Vec<Device> {
            if !gpu.mig_enabled {
                return vec![Device::whole(gpu)];
            }
            let parent = Gpu { mig_devices: Vec::new(), ..gpu.clone() };
            match (layout, mig::profiles(gpu)) {
                (MigLayout::Dynamic, Some(profiles)) => partitions(gpu, &parent, &profiles),
                _ => gpu
                    .mig_devices
                    .iter()
                    .map(|mig| Device { gpu: parent.clone(), mig: Some(mig.clone()), partition: None })
                    .collect(),
            }
        })
        .collect()
}

/// Every placement of every profile of `gpu`, then the whole (the profile spanning all memory slices), each with
/// the MIG device that exists there now, if any.
fn partitions(gpu: &Gpu, parent: &Gpu, profiles: &[Profile]) -> Vec<Device> {
    let placements = profiles.iter().flat_map(|p| p.placement_starts.iter().map(move |start| (*p, *start, false)));
    let whole = profiles.iter().filter(|p| p.memory_slices == mig::MEMORY_SLICES).map(|p| (*p, 0, true));
    placements
        .chain(whole)
        .map(|(profile, start, whole)| Device {
            gpu: parent.clone(),
            mig: gpu.mig_devices.iter().find(|m| m.profile_id == profile.id && m.placement_start == start).cloned(),
            partition: Some(Partition { profile, start, whole }),
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
        let all = devices(&[whole, partitioned, empty.clone()], MigLayout::Static);
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
        for (a, b, overlap) in [
            ("gpu-1", "gpu-1", true),
            ("gpu-1", "gpu-1-mig-19-4-1", true),
            ("gpu-1-mig-9-0-4", "gpu-1", true),
            ("gpu-1-mig-9-0-4", "gpu-1-mig-19-3-1", true),
            ("gpu-1-mig-9-0-4", "gpu-1-mig-19-4-1", false),
            ("gpu-1-mig-0-0-8", "gpu-1-mig-19-7-1", true),
            ("gpu-1-mig-19-4-1", "gpu-1-mig-19-5-1", false),
            ("gpu-1-mig-odd", "gpu-1-mig-19-5-1", true),
            ("gpu-1", "gpu-10-mig-19-4-1", false),
            ("gpu-1", "gpu-2", false),
            ("gpu-1-mig-19-4-1", "gpu-2-mig-19-4-1", false),
        ] {
            assert_eq!(devices_overlap(a, b), overlap, "{a} / {b}");
            assert_eq!(devices_overlap(b, a), overlap, "{b} / {a}");
        }
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

    #[test]
    fn a_dynamic_mig_gpu_is_every_placement_and_its_whole() {
        let mut gpu = test_gpu(1, "0000:02:00.0");
        gpu.mig_enabled = true;
        gpu.mig_devices = vec![mig("1g.10gb", 19, 2, 5, 1)];
        let all = devices(std::slice::from_ref(&gpu), MigLayout::Dynamic);
        // H100: 1g.10gb ×7, 1g.10gb+me ×7, 1g.20gb ×4, 2g.20gb ×3, 3g.40gb ×2, 4g.40gb, 7g.80gb, and the whole.
        assert_eq!(all.len(), 26);
        let names: Vec<String> = all.iter().map(Device::name).collect();
        assert_eq!(names[..2], ["gpu-1-mig-19-0-1", "gpu-1-mig-19-1-1"]);
        assert_eq!(names[24..], ["gpu-1-mig-0-0-8", "gpu-1"]);
        assert!(all.iter().all(Device::is_mig), "the whole of a GPU in MIG mode is its 7g MIG device");
        let made: Vec<String> = all.iter().filter(|d| d.mig.is_some()).map(Device::name).collect();
        assert_eq!(made, ["gpu-1-mig-19-5-1"], "the MIG device that exists is its placement's");
        assert!(all.iter().all(|d| d.gpu.mig_devices.is_empty()));
        let mut unknown = gpu.clone();
        unknown.product_name = "NVIDIA H100 NVL".into();
        unknown.memory_bytes = 94 << 30;
        let static_names: Vec<String> = devices(&[unknown], MigLayout::Dynamic).iter().map(Device::name).collect();
        assert_eq!(static_names, ["gpu-1-mig-19-5-1"], "a model without a profile table stays static");
        assert_eq!(devices(&[test_gpu(0, "0000:01:00.0")], MigLayout::Dynamic)[0].name(), "gpu-0");
    }
}
