//! Simulated GPUs for machines without any (tests, the demo): realistic attributes from a small product table,
//! UUIDs and PCI addresses stable per node and index.
//!
//! Spec: a comma-separated list of `<count>x<model>`, e.g. `4xH100-80GB` or `2xA100-40GB,2xH100-80GB`; or
//! `@<path>` naming a file that holds such a spec.

use super::{Discovery, DiscoveryError};
use crate::node_agent::gpu::{Gpu, stable_hash};

/// What the simulated driver reports.
const DRIVER_VERSION: &str = "570.133.20";
const CUDA_DRIVER_VERSION: &str = "12.8";
/// More GPUs than any node has; a larger count is a typo.
const MAX_GPUS: u32 = 1024;

struct Model {
    key: &'static str,
    product: &'static str,
    architecture: &'static str,
    compute_capability: &'static str,
    memory_gib: u64,
}

const MODELS: &[Model] = &[
    Model {
        key: "A100-40GB",
        product: "NVIDIA A100-SXM4-40GB",
        architecture: "Ampere",
        compute_capability: "8.0",
        memory_gib: 40,
    },
    Model {
        key: "A100-80GB",
        product: "NVIDIA A100-SXM4-80GB",
        architecture: "Ampere",
        compute_capability: "8.0",
        memory_gib: 80,
    },
    Model {
        key: "L4-24GB",
        product: "NVIDIA L4",
        architecture: "Ada Lovelace",
        compute_capability: "8.9",
        memory_gib: 24,
    },
    Model {
        key: "H100-80GB",
        product: "NVIDIA H100 80GB HBM3",
        architecture: "Hopper",
        compute_capability: "9.0",
        memory_gib: 80,
    },
    Model {
        key: "H200-141GB",
        product: "NVIDIA H200",
        architecture: "Hopper",
        compute_capability: "9.0",
        memory_gib: 141,
    },
    Model {
        key: "B200-180GB",
        product: "NVIDIA B200",
        architecture: "Blackwell",
        compute_capability: "10.0",
        memory_gib: 180,
    },
];

/// A spec that cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("--simulated-gpus is empty; give e.g. 4xH100-80GB")]
    Empty,
    #[error("--simulated-gpus entry {entry:?} is not <count>x<model> (e.g. 4xH100-80GB)")]
    Malformed { entry: String },
    #[error("--simulated-gpus entry {entry:?}: unknown model {model:?}; known: {known}")]
    UnknownModel { entry: String, model: String, known: String },
    #[error("--simulated-gpus asks for {count} GPUs; at most {MAX_GPUS}")]
    TooMany { count: u32 },
    #[error("read --simulated-gpus file {path}: {message}")]
    File { path: String, message: String },
}

/// Simulated GPUs for one node.
#[derive(Debug, Clone)]
pub struct Simulated {
    gpus: Vec<Gpu>,
}

impl Simulated {
    /// Parses `spec` for `node`.
    pub fn new(node: &str, spec: &str) -> Result<Self, SpecError> {
        let spec = match spec.trim().strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| SpecError::File { path: path.to_string(), message: e.to_string() })?,
            None => spec.to_string(),
        };
        let mut gpus = Vec::new();
        for entry in spec.split([',', '\n']).map(str::trim).filter(|e| !e.is_empty()) {
            let (count, model_key) =
                entry.split_once(['x', 'X']).ok_or_else(|| SpecError::Malformed { entry: entry.into() })?;
            let count: u32 = count.trim().parse().map_err(|_| SpecError::Malformed { entry: entry.into() })?;
            let model = MODELS.iter().find(|m| m.key.eq_ignore_ascii_case(model_key.trim())).ok_or_else(|| {
                SpecError::UnknownModel {
                    entry: entry.into(),
                    model: model_key.trim().into(),
                    known: MODELS.iter().map(|m| m.key).collect::<Vec<_>>().join(", "),
                }
            })?;
            let total = gpus.len() as u32 + count;
            if total > MAX_GPUS {
                return Err(SpecError::TooMany { count: total });
            }
            for _ in 0..count {
                let index = gpus.len() as u32;
                gpus.push(simulated_gpu(node, index, model));
            }
        }
        if gpus.is_empty() {
            return Err(SpecError::Empty);
        }
        Ok(Self { gpus })
    }
}

impl Discovery for Simulated {
    fn discover(&self) -> Result<Vec<Gpu>, DiscoveryError> {
        Ok(self.gpus.clone())
    }
}

fn simulated_gpu(node: &str, index: u32, model: &Model) -> Gpu {
    let h = mixed_hash(&format!("{node}/{index}"));
    let g = mixed_hash(&format!("{index}/{node}/uuid"));
    let uuid = format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        h & 0xffff,
        g >> 48,
        g & 0xffff_ffff_ffff
    );
    Gpu {
        index,
        minor: index,
        uuid,
        product_name: model.product.into(),
        brand: "Nvidia".into(),
        architecture: model.architecture.into(),
        cuda_compute_capability: model.compute_capability.into(),
        driver_version: DRIVER_VERSION.into(),
        cuda_driver_version: CUDA_DRIVER_VERSION.into(),
        pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + index * 8 % 0xe0),
        memory_bytes: model.memory_gib << 30,
        mig_enabled: false,
    }
}

/// [`stable_hash`], then splitmix64's finaliser so that similar inputs give unrelated outputs.
fn mixed_hash(s: &str) -> u64 {
    let h = stable_hash(s.as_bytes());
    let h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let gpus = Simulated::new("node-a", "2xA100-40GB, 2xh100-80gb").expect("spec").gpus;
        assert_eq!(gpus.len(), 4);
        assert_eq!(gpus[0].product_name, "NVIDIA A100-SXM4-40GB");
        assert_eq!(gpus[3].product_name, "NVIDIA H100 80GB HBM3");
        assert_eq!(gpus[3].memory_bytes, 80 << 30);
        assert_eq!(gpus.iter().map(Gpu::device_name).collect::<Vec<_>>(), ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    }

    #[test]
    fn uuids_are_stable_per_node_and_index_and_distinct() {
        let a = Simulated::new("node-a", "4xH100-80GB").expect("spec").gpus;
        let again = Simulated::new("node-a", "4xH100-80GB").expect("spec").gpus;
        let b = Simulated::new("node-b", "4xH100-80GB").expect("spec").gpus;
        assert_eq!(a, again);
        let mut all: Vec<&str> = a.iter().chain(&b).map(|g| g.uuid.as_str()).collect();
        assert!(all.iter().all(|u| u.len() == 40 && u.starts_with("GPU-")), "{all:?}");
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 8, "UUIDs must differ across nodes and indexes");
    }

    #[test]
    fn bad_specs_name_what_is_wrong() {
        assert_eq!(Simulated::new("n", " ").err(), Some(SpecError::Empty));
        assert_eq!(Simulated::new("n", "4H100").err(), Some(SpecError::Malformed { entry: "4H100".into() }));
        assert_eq!(
            Simulated::new("n", "fourxH100-80GB").err(),
            Some(SpecError::Malformed { entry: "fourxH100-80GB".into() })
        );
        let unknown = Simulated::new("n", "1xV100").expect_err("unknown model").to_string();
        assert!(unknown.contains("unknown model \"V100\"") && unknown.contains("H100-80GB"), "{unknown}");
        assert_eq!(Simulated::new("n", "2000xL4-24GB").err(), Some(SpecError::TooMany { count: 2000 }));
        assert!(matches!(Simulated::new("n", "@/no/such/file").err(), Some(SpecError::File { .. })));
    }
}
