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
    /// NVML's profile ID (`NVML_GPU_INSTANCE_PROFILE_*`).
    pub nvml_id: u32,
    pub compute_slices: u32,
    pub memory_slices: u32,
    /// How many such instances fit at once.
    pub max_instances: u32,
    /// The first memory slice of each placement NVML allows; each spans `memory_slices`.
    pub placement_starts: &'static [u32],
}

/// The shape every documented model shares: (NVML profile ID, compute slices, memory slices, max instances,
/// placement starts), in NVIDIA's order of the table.
const SHAPE: [(u32, u32, u32, u32, &[u32]); 7] = [
    (0, 1, 1, 7, &[0, 1, 2, 3, 4, 5, 6]), // NVML_GPU_INSTANCE_PROFILE_1_SLICE
    (7, 1, 1, 1, &[0, 1, 2, 3, 4, 5, 6]), // 1_SLICE_REV1: with the media engines
    (9, 1, 2, 4, &[0, 2, 4, 6]),          // 1_SLICE_REV2: twice the memory
    (1, 2, 2, 3, &[0, 2, 4]),             // 2_SLICE
    (2, 3, 4, 2, &[0, 4]),                // 3_SLICE
    (3, 4, 4, 1, &[0]),                   // 4_SLICE
    (4, 7, 8, 1, &[0]),                   // 7_SLICE
];

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
    Some(
        SHAPE
            .iter()
            .zip(names)
            .map(|(&(nvml_id, compute_slices, memory_slices, max_instances, placement_starts), name)| Profile {
                name,
                nvml_id,
                compute_slices,
                memory_slices,
                max_instances,
                placement_starts,
            })
            .collect(),
    )
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
    fn placements_read_like_nvidia_smi() {
        assert_eq!(placements_text(&[0, 2, 4], 2), "{0,2,4}:2");
        assert_eq!(placements_text(&[0], 8), "{0}:8");
    }
}
