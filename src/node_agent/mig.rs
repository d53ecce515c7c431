//! MIG (Multi-Instance GPU) profiles and placements, as NVIDIA documents them for each MIG-capable model (MIG user
//! guide, "Supported MIG Profiles"), in one table the simulated backend uses and `gpu-check` compares NVML's answer
//! with.
//!
//! A MIG GPU has 8 memory slices and 7 compute slices. A GPU instance of a profile takes a run of memory slices (its
//! placement: a start and a size), and the placements a profile allows are fixed per model family: every model below
//! has the same shape, only the memory in the names differs. `+me` profiles carry the media engines (decoders, JPEG,
//! OFA), which exist once per GPU, so one such instance at a time.

use crate::node_agent::gpu::Gpu;

/// Memory slices of a MIG-capable GPU (placements are in these units).
pub const MEMORY_SLICES: u32 = 8;
/// Compute slices (GPCs available to MIG) of a MIG-capable GPU.
pub const COMPUTE_SLICES: u32 = 7;

/// One GPU instance profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    /// NVIDIA's name, e.g. `1g.10gb` (compute slices, memory in GB).
    pub name: &'static str,
    /// NVML's profile index (`NVML_GPU_INSTANCE_PROFILE_*`), what `nvmlDeviceGetGpuInstanceProfileInfo` takes.
    pub nvml_id: u32,
    /// NVML's profile ID (`nvmlGpuInstanceProfileInfo_t.id`): what a GPU instance reports as its `profileId` and
    /// what MIG device names carry (`nvidia-smi mig -lgip` lists it).
    pub id: u32,
    pub compute_slices: u32,
    pub memory_slices: u32,
    /// How many such instances fit at once.
    pub max_instances: u32,
    /// The first memory slice of each placement NVML allows; each spans `memory_slices`.
    pub placement_starts: &'static [u32],
}

/// The shape every documented model shares, in NVIDIA's order of the table (names come from [`MODELS`]).
const SHAPE: [Profile; 7] = [
    shape(0, 19, 1, 1, 7, &[0, 1, 2, 3, 4, 5, 6]), // NVML_GPU_INSTANCE_PROFILE_1_SLICE
    shape(7, 20, 1, 1, 1, &[0, 1, 2, 3, 4, 5, 6]), // 1_SLICE_REV1: with the media engines
    shape(9, 15, 1, 2, 4, &[0, 2, 4, 6]),          // 1_SLICE_REV2: twice the memory
    shape(1, 14, 2, 2, 3, &[0, 2, 4]),             // 2_SLICE
    shape(2, 9, 3, 4, 2, &[0, 4]),                 // 3_SLICE
    shape(3, 5, 4, 4, 1, &[0]),                    // 4_SLICE
    shape(4, 0, 7, 8, 1, &[0]),                    // 7_SLICE
];

/// (profile index, profile ID, compute slices, memory slices, max instances, placement starts) as a nameless profile.
const fn shape(
    nvml_id: u32,
    id: u32,
    compute_slices: u32,
    memory_slices: u32,
    max_instances: u32,
    placement_starts: &'static [u32],
) -> Profile {
    Profile { name: "", nvml_id, id, compute_slices, memory_slices, max_instances, placement_starts }
}

/// The documented models: (family in the product name, memory GiB the driver reports at most, profile names in
/// the order of [`SHAPE`]).
const MODELS: [(&str, u64, [&str; 7]); 5] = [
    ("A100", 40, ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]),
    ("A100", 80, ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]),
    ("H100", 80, ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]),
    ("H200", 141, ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]),
    ("B200", 180, ["1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"]),
];

/// The documented profiles of `gpu`'s model, or `None` for a model this table does not know (not MIG-capable, or
/// a variant with another memory size such as H100 NVL 94 GB).
pub fn profiles(gpu: &Gpu) -> Option<Vec<Profile>> {
    let gib = gpu.memory_bytes.div_ceil(1 << 30);
    let (_, _, names) = MODELS.iter().find(|(family, memory, _)| {
        // Drivers report a little less than the nominal size (an H200: 140.4 GiB), never more.
        gpu.product_name.contains(family) && gib <= *memory && gib + 4 > *memory
    })?;
    Some(SHAPE.iter().zip(names).map(|(shape, name)| Profile { name, ..*shape }).collect())
}

/// The memory a MIG device of `profile` has on `gpu`: its share of the memory slices, in whole MiB (what the
/// simulated backend reports, and what a dynamic MIG partition publishes before it is made).
pub fn memory_bytes(gpu: &Gpu, profile: &Profile) -> u64 {
    (gpu.memory_bytes / u64::from(MEMORY_SLICES) * u64::from(profile.memory_slices)) & !((1 << 20) - 1)
}

/// Why a MIG layout cannot exist on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{product} has no documented MIG profiles (MIG-capable: A100 40/80 GB, H100 80 GB, H200, B200)")]
    NotMigCapable { product: String },
    #[error("{product} has no MIG profile {profile:?}; its profiles: {known}")]
    UnknownProfile { product: String, profile: String, known: String },
    #[error(
        "MIG profiles {asked} do not fit on one {product} together (8 memory and 7 compute slices, each profile at \
         its documented placements and instance count)"
    )]
    DoesNotFit { product: String, asked: String },
}

/// Where a layout of `names` goes on `gpu`, as (profile, first memory slice), ordered by placement: the first
/// layout found trying profiles largest first, each at its placements lowest first (a search: `3g+2g+1g+1g` fits
/// only with the `3g` at the top, since a `1g` cannot start on the last slice). Pure; the simulated backend's MIG
/// devices come from it.
pub fn layout(gpu: &Gpu, names: &[&str]) -> Result<Vec<(Profile, u32)>, LayoutError> {
    let product = gpu.product_name.clone();
    let all = profiles(gpu).ok_or_else(|| LayoutError::NotMigCapable { product: product.clone() })?;
    let mut wanted = Vec::with_capacity(names.len());
    for name in names {
        let profile =
            all.iter().find(|p| p.name.eq_ignore_ascii_case(name)).ok_or_else(|| LayoutError::UnknownProfile {
                product: product.clone(),
                profile: (*name).to_string(),
                known: all.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
            })?;
        wanted.push(*profile);
    }
    wanted.sort_by_key(|p| std::cmp::Reverse((p.memory_slices, p.compute_slices)));
    let fits_counts =
        wanted.iter().all(|p| wanted.iter().filter(|q| q.nvml_id == p.nvml_id).count() as u32 <= p.max_instances)
            && wanted.iter().map(|p| p.compute_slices).sum::<u32>() <= COMPUTE_SLICES;
    let mut placed = Vec::with_capacity(wanted.len());
    if !(fits_counts && place(&wanted, &mut [false; MEMORY_SLICES as usize], &mut placed)) {
        return Err(LayoutError::DoesNotFit { product, asked: names.join("+") });
    }
    placed.sort_by_key(|(_, start)| *start);
    Ok(placed)
}

/// Places `rest` on the free memory slices, depth first; true when all found a placement.
fn place(rest: &[Profile], used: &mut [bool; MEMORY_SLICES as usize], placed: &mut Vec<(Profile, u32)>) -> bool {
    let Some((profile, rest)) = rest.split_first() else { return true };
    for &start in profile.placement_starts {
        let span = start as usize..(start + profile.memory_slices) as usize;
        if used[span.clone()].iter().any(|u| *u) {
            continue;
        }
        used[span.clone()].fill(true);
        placed.push((*profile, start));
        if place(rest, used, placed) {
            return true;
        }
        placed.pop();
        used[span].fill(false);
    }
    false
}

/// Why a MIG device of a profile cannot be made at a placement of a GPU as the GPU is now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("{profile} cannot start at memory slice {start}: its placements are {allowed}")]
    NotAPlacement { profile: &'static str, start: u32, allowed: String },
    #[error("{profile} at memory slice {start} overlaps MIG device {uuid} ({other} on slices {other_slices})")]
    Overlaps { profile: &'static str, start: u32, uuid: String, other: String, other_slices: String },
    #[error("{profile}: at most {max} at once on this GPU, and {max} exist")]
    TooMany { profile: &'static str, max: u32 },
    #[error("{profile} needs {needed} compute slices, {free} of {COMPUTE_SLICES} are free")]
    NoCompute { profile: &'static str, needed: u32, free: u32 },
}

/// Whether a MIG device of `profile` (from [`profiles`] of `gpu`'s model) can be made at memory slice `start` of
/// `gpu` beside the MIG devices it has now: an allowed placement, no memory slice taken, fewer than the profile's
/// instance limit, enough compute slices left. Pure; the simulated backend enforces it as NVML does, and NVML's own
/// refusal is then no surprise.
pub fn check_placement(gpu: &Gpu, profile: &Profile, start: u32) -> Result<(), PlacementError> {
    if !profile.placement_starts.contains(&start) {
        let allowed = placements_text(profile.placement_starts, profile.memory_slices);
        return Err(PlacementError::NotAPlacement { profile: profile.name, start, allowed });
    }
    let end = start + profile.memory_slices;
    if let Some(other) =
        gpu.mig_devices.iter().find(|m| m.placement_start < end && start < m.placement_start + m.placement_size)
    {
        return Err(PlacementError::Overlaps {
            profile: profile.name,
            start,
            uuid: other.uuid.clone(),
            other: other.profile.clone(),
            other_slices: format!("{}-{}", other.placement_start, other.placement_start + other.placement_size - 1),
        });
    }
    if gpu.mig_devices.iter().filter(|m| m.profile_id == profile.id).count() as u32 >= profile.max_instances {
        return Err(PlacementError::TooMany { profile: profile.name, max: profile.max_instances });
    }
    let table = profiles(gpu).unwrap_or_default();
    // A device of a profile the table does not know counts one compute slice per memory slice, at most all seven.
    let used: u32 = gpu
        .mig_devices
        .iter()
        .map(|m| table.iter().find(|p| p.id == m.profile_id).map_or(m.placement_size, |p| p.compute_slices))
        .sum::<u32>()
        .min(COMPUTE_SLICES);
    if used + profile.compute_slices > COMPUTE_SLICES {
        let free = COMPUTE_SLICES - used;
        return Err(PlacementError::NoCompute { profile: profile.name, needed: profile.compute_slices, free });
    }
    Ok(())
}

/// The lowest placement where a MIG device of `profile` can be made on `gpu` now, if any.
pub fn free_placement(gpu: &Gpu, profile: &Profile) -> Option<u32> {
    profile.placement_starts.iter().copied().find(|&start| check_placement(gpu, profile, start).is_ok())
}

/// GPU instance IDs per GPU and compute instance IDs per GPU instance that the driver numbers `nvidia-caps` minors
/// for (`/proc/driver/nvidia-caps/mig-minors`: `config 1`, `monitor 2`, then `gpu<N>/gi<I>/access` and
/// `gpu<N>/gi<I>/ci<C>/access` in order).
const CAP_GPU_INSTANCES: u32 = 15;
const CAP_COMPUTE_INSTANCES: u32 = 8;

/// The `nvidia-caps` minors of GPU instance `gi` and its compute instance `ci` on the GPU with device minor
/// `gpu_minor`, as the driver's `mig-minors` table numbers them. Simulated GPUs use it; real ones read the minors
/// the driver reports (`/proc/driver/nvidia/capabilities/gpu<N>/mig/gi<I>/access`).
pub fn cap_minors(gpu_minor: u32, gi: u32, ci: u32) -> (u32, u32) {
    let per_gi = 1 + CAP_COMPUTE_INSTANCES;
    let gi_minor = 3 + gpu_minor * CAP_GPU_INSTANCES * per_gi + gi * per_gi;
    (gi_minor, gi_minor + 1 + ci)
}

/// The `nvidia-caps` major simulated GPUs report (a real driver's is assigned at load time; this is a typical one).
pub const SIMULATED_CAPS_MAJOR: u32 = 508;

/// The major of character device `name` in `/proc/devices` text (`Character devices:` section, `508 nvidia-caps`).
pub fn char_device_major(proc_devices: &str, name: &str) -> Option<u32> {
    proc_devices
        .lines()
        .skip_while(|line| line.trim() != "Character devices:")
        .take_while(|line| line.trim() != "Block devices:")
        .find_map(|line| {
            let (major, device) = line.trim().split_once(' ')?;
            (device.trim() == name).then(|| major.parse().ok()).flatten()
        })
}

/// The minor in a driver capability file's text (`DeviceFileMinor: 21` among its lines).
pub fn parse_cap_minor(text: &str) -> Option<u32> {
    text.lines().find_map(|line| line.strip_prefix("DeviceFileMinor:")?.trim().parse().ok())
}

/// `{0,2,4}:2`, as `nvidia-smi mig -lgipp` writes a profile's placements.
pub fn placements_text(starts: &[u32], size: u32) -> String {
    let starts: Vec<String> = starts.iter().map(u32::to_string).collect();
    format!("{{{}}}:{size}", starts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_agent::gpu::test_gpu;

    fn gpu(product: &str, memory_mib: u64) -> Gpu {
        Gpu { product_name: product.into(), memory_bytes: memory_mib << 20, ..test_gpu(0, "0000:01:00.0") }
    }

    #[test]
    fn models_are_recognised_by_product_and_memory() {
        let cases = [
            ("NVIDIA A100-SXM4-40GB", 40_960, Some("1g.5gb")),
            ("NVIDIA A100-PCIE-40GB", 40_536, Some("1g.5gb")),
            ("NVIDIA A100-SXM4-80GB", 81_920, Some("1g.10gb")),
            ("NVIDIA H100 80GB HBM3", 81_559, Some("1g.10gb")),
            ("NVIDIA H200", 143_771, Some("1g.18gb")),
            ("NVIDIA B200", 183_359, Some("1g.23gb")),
            ("NVIDIA H100 NVL", 95_830, None),
            ("NVIDIA L4", 23_034, None),
        ];
        for (product, memory, first) in cases {
            let found = profiles(&gpu(product, memory)).map(|p| p[0].name);
            assert_eq!(found, first, "{product} {memory} MiB");
        }
    }

    #[test]
    fn profile_ids_are_nvmls_not_the_profile_index() {
        // `nvidia-smi mig -lgip` on an H100 80GB: what a GPU instance reports as its profile ID.
        let Some(h100) = profiles(&gpu("NVIDIA H100 80GB HBM3", 81_559)) else { panic!("H100 not recognised") };
        let ids: Vec<(&str, u32, u32)> = h100.iter().map(|p| (p.name, p.nvml_id, p.id)).collect();
        assert_eq!(
            ids,
            [
                ("1g.10gb", 0, 19),
                ("1g.10gb+me", 7, 20),
                ("1g.20gb", 9, 15),
                ("2g.20gb", 1, 14),
                ("3g.40gb", 2, 9),
                ("4g.40gb", 3, 5),
                ("7g.80gb", 4, 0)
            ]
        );
    }

    #[test]
    fn placements_fit_the_gpu_and_the_instance_counts() {
        for (family, memory, _) in MODELS {
            let Some(all) = profiles(&gpu(&format!("NVIDIA {family}"), memory << 10)) else {
                panic!("{family} {memory} GiB not recognised");
            };
            for profile in all {
                for start in profile.placement_starts {
                    assert!(start + profile.memory_slices <= MEMORY_SLICES, "{profile:?}");
                    assert_eq!(start % profile.memory_slices, 0, "{profile:?}: placements align to their size");
                }
                assert!(profile.compute_slices <= COMPUTE_SLICES, "{profile:?}");
                // As many instances as placements that do not overlap, except the one media-engine instance.
                let disjoint = (profile.placement_starts.len() as u32).min(MEMORY_SLICES / profile.memory_slices);
                let expected = if profile.name.ends_with("+me") { 1 } else { disjoint.min(COMPUTE_SLICES) };
                assert_eq!(profile.max_instances, expected, "{profile:?}");
                assert!(profile.name.starts_with(&format!("{}g.", profile.compute_slices)), "{profile:?}");
            }
        }
    }

    #[test]
    fn layouts_pack_largest_first_and_refuse_what_does_not_fit() {
        let h100 = gpu("NVIDIA H100 80GB HBM3", 81_559);
        let placed = |names: &[&str]| {
            layout(&h100, names).map(|l| l.iter().map(|(p, start)| format!("{}@{start}", p.name)).collect::<Vec<_>>())
        };
        type Case<'a> = (&'a [&'a str], Result<&'a [&'a str], &'a str>);
        let cases: [Case<'_>; 8] = [
            (&["7g.80gb"], Ok(&["7g.80gb@0"])),
            (&["1g.10gb", "3g.40gb", "2g.20gb"], Ok(&["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"])),
            (&["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], Ok(&["2g.20gb@0", "1g.10gb@2", "1g.10gb@3", "3g.40gb@4"])),
            (
                &["1g.10gb"; 7],
                Ok(&["1g.10gb@0", "1g.10gb@1", "1g.10gb@2", "1g.10gb@3", "1g.10gb@4", "1g.10gb@5", "1g.10gb@6"]),
            ),
            (&["4g.40gb", "3g.40gb"], Ok(&["4g.40gb@0", "3g.40gb@4"])),
            (&["1g.10gb"; 8], Err("do not fit")),
            (&["4g.40gb", "4g.40gb"], Err("do not fit on one NVIDIA H100 80GB HBM3 together")),
            (&["1g.10gb+me", "1g.10gb+me"], Err("do not fit")),
        ];
        for (names, want) in cases {
            match (placed(names), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{names:?}"),
                (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{names:?}: {e}"),
                (got, want) => panic!("{names:?}: got {got:?}, want {want:?}"),
            }
        }
        let unknown = layout(&h100, &["1g.5gb"]).map_err(|e| e.to_string());
        assert!(
            unknown.as_ref().is_err_and(|e| e.contains("no MIG profile \"1g.5gb\"") && e.contains("1g.10gb")),
            "{unknown:?}"
        );
        assert!(matches!(layout(&gpu("NVIDIA L4", 23_034), &["1g.10gb"]), Err(LayoutError::NotMigCapable { .. })));
    }

    #[test]
    fn a_placement_is_checked_against_the_devices_there() {
        let mut h100 = gpu("NVIDIA H100 80GB HBM3", 81_559);
        let Some(table) = profiles(&h100) else { panic!("H100 not recognised") };
        let by_name = |name: &str| table.iter().find(|p| p.name == name).copied().expect(name);
        let (one, three, seven) = (by_name("1g.10gb"), by_name("3g.40gb"), by_name("7g.80gb"));
        assert_eq!(free_placement(&h100, &seven), Some(0), "an empty GPU takes any profile");
        let made = |profile: &Profile, start: u32, uuid: &str| crate::node_agent::gpu::MigDevice {
            uuid: uuid.into(),
            profile: profile.name.into(),
            profile_id: profile.id,
            placement_start: start,
            placement_size: profile.memory_slices,
            gpu_instance: 1,
            compute_instance: 0,
            memory_bytes: 10 << 30,
            multiprocessors: 16,
            gi_cap_minor: 12,
            ci_cap_minor: 13,
            caps_major: None,
        };
        h100.mig_devices.push(made(&three, 4, "MIG-a"));
        let refused =
            |gpu: &Gpu, profile: &Profile, start: u32| check_placement(gpu, profile, start).map_err(|e| e.to_string());
        assert_eq!(
            refused(&h100, &one, 5),
            Err("1g.10gb at memory slice 5 overlaps MIG device MIG-a (3g.40gb on slices 4-7)".into())
        );
        assert_eq!(
            refused(&h100, &one, 7),
            Err("1g.10gb cannot start at memory slice 7: its placements are {0,1,2,3,4,5,6}:1".into())
        );
        assert_eq!(refused(&h100, &seven, 0).map_err(|e| e.contains("overlaps")), Err(true));
        assert_eq!(free_placement(&h100, &one), Some(0));
        assert_eq!(free_placement(&h100, &three), Some(0));
        h100.mig_devices.push(made(&three, 0, "MIG-b"));
        assert_eq!(refused(&h100, &three, 0).map_err(|e| e.contains("overlaps")), Err(true));
        assert_eq!(free_placement(&h100, &one), None, "six compute slices and every memory slice taken");
        h100.mig_devices.remove(1);
        for start in 0..4 {
            h100.mig_devices.push(made(&one, start, &format!("MIG-{start}")));
        }
        // 3 + 4 compute slices taken, memory slices 0-7 all used: nothing more fits.
        assert_eq!(free_placement(&h100, &one), None);
        h100.mig_devices.truncate(4);
        assert_eq!(refused(&h100, &by_name("1g.10gb+me"), 3), Ok(()));
        h100.mig_devices.push(made(&by_name("1g.10gb+me"), 3, "MIG-me"));
        assert_eq!(refused(&h100, &by_name("1g.10gb+me"), 3).map_err(|e| e.contains("overlaps")), Err(true));
        let mut other = gpu("NVIDIA H100 80GB HBM3", 81_559);
        other.mig_devices.push(made(&by_name("1g.10gb+me"), 0, "MIG-me"));
        assert_eq!(
            check_placement(&other, &by_name("1g.10gb+me"), 1).map_err(|e| e.to_string()),
            Err("1g.10gb+me: at most 1 at once on this GPU, and 1 exist".into())
        );
    }

    #[test]
    fn cap_minors_follow_the_drivers_table() {
        // /proc/driver/nvidia-caps/mig-minors: gpu0/gi0/access 3, gpu0/gi0/ci0/access 4, gpu0/gi1/access 12, …
        assert_eq!(cap_minors(0, 0, 0), (3, 4));
        assert_eq!(cap_minors(0, 1, 0), (12, 13));
        assert_eq!(cap_minors(0, 14, 7), (129, 137));
        assert_eq!(cap_minors(1, 0, 0), (138, 139));
        assert_eq!(parse_cap_minor("DeviceFileMinor: 21\nDeviceFileMode: 292\nDeviceFileModify: 1\n"), Some(21));
        assert_eq!(parse_cap_minor("DeviceFileMode: 292\n"), None);
        let devices = "Character devices:\n  1 mem\n195 nvidia\n508 nvidia-caps\n510 nvidia-uvm\n\nBlock devices:\n  8 nvidia-caps\n";
        assert_eq!(char_device_major(devices, "nvidia-caps"), Some(508));
        assert_eq!(char_device_major(devices, "nvidia-uv"), None);
        assert_eq!(char_device_major("Block devices:\n  8 nvidia-caps\n", "nvidia-caps"), None);
    }

    #[test]
    fn placements_read_like_nvidia_smi() {
        assert_eq!(placements_text(&[0, 2, 4], 2), "{0,2,4}:2");
        assert_eq!(placements_text(&[0], 8), "{0}:8");
    }
}
