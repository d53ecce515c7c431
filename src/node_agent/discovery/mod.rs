//! GPU discovery behind one trait: NVML on real machines, a simulated backend on machines without GPUs. Everything
//! downstream (ResourceSlices, the kubelet plugin, CDI) is the same code for both.

pub mod nvml;
mod nvml_mig;
pub mod simulated;

use super::gpu::{Gpu, MigDevice};
use super::mig::{PlacementError, Profile};

/// Why discovery failed. The agent stays up and retries; it publishes nothing until discovery works.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error(
        "load NVML ({library}): {source}. Is the NVIDIA driver installed on this node and --driver-root right? \
         The agent looks again every 10 s at most and publishes nothing until then"
    )]
    NvmlUnavailable {
        library: String,
        #[source]
        source: ::nvml_wrapper::error::NvmlError,
    },
    #[error("query {what} through NVML: {source}")]
    Nvml {
        what: String,
        #[source]
        source: ::nvml_wrapper::error::NvmlError,
    },
    #[error("--gpu-backend simulated needs --simulated-gpus (e.g. 4xH100-80GB)")]
    SimulatedSpecMissing,
    #[error(transparent)]
    SimulatedSpec(#[from] simulated::SpecError),
}

/// The backend `gpu` chooses, for node `node` (simulated UUIDs are stable per node). A bad simulated spec is an
/// error here, at start-up; NVML problems show only when discovering (the agent then retries). Simulated GPUs keep
/// the MIG devices made on them under `kept` (state directory, boot ID) when given, as a real GPU does.
pub fn backend(
    gpu: &crate::cli::GpuArgs,
    node: &str,
    kept: Option<(&std::path::Path, &str)>,
) -> Result<std::sync::Arc<dyn Discovery>, DiscoveryError> {
    Ok(match gpu.gpu_backend {
        crate::cli::GpuBackend::Simulated => {
            let spec = gpu.simulated_gpus.as_deref().ok_or(DiscoveryError::SimulatedSpecMissing)?;
            let simulated = match kept {
                Some((state_dir, boot_id)) => {
                    simulated::Simulated::keeping_mig_devices(node, spec, state_dir, boot_id)?
                }
                None => simulated::Simulated::new(node, spec)?,
            };
            std::sync::Arc::new(match &gpu.sysfs_root {
                Some(sysfs) => simulated.with_sysfs(sysfs),
                None => simulated,
            })
        }
        crate::cli::GpuBackend::Nvml => std::sync::Arc::new(nvml::NvmlDiscovery::new(
            gpu.driver_root_to_read().unwrap_or(std::path::Path::new("/")),
            gpu.sysfs(),
        )),
    })
}

/// Why a MIG device could not be made or destroyed.
#[derive(Debug, thiserror::Error)]
pub enum MigControlError {
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    #[error("this node has no GPU of index {index}")]
    NoGpu { index: u32 },
    #[error("GPU {uuid} is not in MIG mode: turn it on (nvidia-smi -i <index> -mig 1) before making MIG devices")]
    MigModeOff { uuid: String },
    #[error("GPU {uuid}: {source}")]
    Placement {
        uuid: String,
        #[source]
        source: PlacementError,
    },
    #[error("GPU {uuid} has no MIG device of GPU instance {gpu_instance} and compute instance {compute_instance}")]
    NotFound { uuid: String, gpu_instance: u32, compute_instance: u32 },
    #[error("{what} on GPU {uuid} through NVML: {source}")]
    Nvml {
        what: String,
        uuid: String,
        #[source]
        source: ::nvml_wrapper::error::NvmlError,
    },
}

/// What a discovery found: the GPUs it could read, and those it could not while NVML answered for the others.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Discovered {
    pub gpus: Vec<Gpu>,
    pub unreadable: Vec<Unreadable>,
}

/// A GPU NVML counts but answers "GPU is lost" for (fallen off the bus, XID 79). One such GPU must not take the
/// node's others with it: they are published and prepared as usual.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub index: u32,
    pub reason: String,
}

impl Discovered {
    /// The GPUs unreadable now taken from `known` (the last discovery's GPUs) by index: a GPU that fell off the bus
    /// while the agent ran stays published, with the taint its fault brings, rather than vanish from the slices.
    /// Only while every GPU read now is where `known` had it (NVML's indexes carry no promise: a driver reload that
    /// no longer counts a GPU shifts them), and the known GPU is not among those read under another index; else
    /// it counts as never read. Returns the GPUs, sorted by index, the UUIDs of those taken from `known`, and what
    /// is unreadable and not taken.
    pub fn filled_from(self, known: Option<&[Gpu]>) -> Filled {
        let Self { mut gpus, unreadable } = self;
        let known = known.unwrap_or_default();
        let in_place = gpus.iter().all(|g| known.iter().find(|k| k.index == g.index).is_none_or(|k| k.uuid == g.uuid));
        let mut filled = Vec::new();
        let mut unknown = Vec::new();
        for missing in unreadable {
            let last = known.iter().find(|k| k.index == missing.index);
            match last.filter(|k| in_place && gpus.iter().all(|g| g.uuid != k.uuid && g.minor != k.minor)) {
                Some(gpu) => {
                    filled.push(gpu.uuid.clone());
                    gpus.push(gpu.clone());
                }
                None => unknown.push(missing),
            }
        }
        gpus.sort_by_key(|g| g.index);
        Filled { gpus, filled, unknown }
    }
}

/// What [`Discovered::filled_from`] makes of a discovery.
#[derive(Debug, Clone, PartialEq)]
pub struct Filled {
    /// The GPUs to publish, sorted by index.
    pub gpus: Vec<Gpu>,
    /// The UUIDs of those unreadable now and published with their last reading.
    pub filled: Vec<String>,
    /// The unreadable GPUs left out.
    pub unknown: Vec<Unreadable>,
}

/// A source of GPUs, which can also make and destroy MIG devices on GPUs in MIG mode (what `gpu-check` verifies on
/// a GPU machine, and what dynamic MIG prepares claims with).
pub trait Discovery: Send + Sync + std::fmt::Debug {
    /// The GPUs of this node now, and those NVML counts but cannot read. Fails when NVML cannot be loaded or does
    /// not answer for the node (driver version, device count).
    fn discover_all(&self) -> Result<Discovered, DiscoveryError>;

    /// The GPUs of this node that can be read now.
    fn discover(&self) -> Result<Vec<Gpu>, DiscoveryError> {
        self.discover_all().map(|found| found.gpus)
    }

    /// Simulated GPUs only: GPU `gpu` (device name or UUID) falls off the bus (`lost`) or comes back (a reset), as
    /// an injected fault says, so that discovery answers for it as NVML would. Real GPUs ignore it.
    fn set_lost(&self, _gpu: &str, _lost: bool) {}

    /// Makes a MIG device on GPU `index`: a GPU instance of `profile` (from [`super::mig::profiles`] of the GPU's
    /// model) at memory slice `start`, and one compute instance spanning it, checked first with
    /// [`super::mig::check_placement`]. Answers the device as discovery now reports it.
    fn create_mig_device(&self, index: u32, profile: &Profile, start: u32) -> Result<MigDevice, MigControlError>;

    /// Destroys the MIG device of GPU instance `gpu_instance` and compute instance `compute_instance` on GPU
    /// `index`: the compute instance, then the GPU instance.
    fn destroy_mig_device(&self, index: u32, gpu_instance: u32, compute_instance: u32) -> Result<(), MigControlError>;
}

/// Where in `gpus` GPU `index` is, when it is in MIG mode with a MIG device of `profile` possible at `start`.
fn placeable(gpus: &[Gpu], index: u32, profile: &Profile, start: u32) -> Result<usize, MigControlError> {
    let position = gpus.iter().position(|g| g.index == index).ok_or(MigControlError::NoGpu { index })?;
    let gpu = &gpus[position];
    if !gpu.mig_enabled {
        return Err(MigControlError::MigModeOff { uuid: gpu.uuid.clone() });
    }
    super::mig::check_placement(gpu, profile, start)
        .map_err(|source| MigControlError::Placement { uuid: gpu.uuid.clone(), source })?;
    Ok(position)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, uuid: &str) -> Gpu {
        let found = simulated::Simulated::new("node", "1xH100-80GB").map(|s| s.discover_all());
        let mut gpu = found.expect("spec").expect("discover").gpus.remove(0);
        (gpu.index, gpu.minor, gpu.uuid) = (index, index, uuid.into());
        gpu
    }

    fn lost(index: u32) -> Unreadable {
        Unreadable { index, reason: format!("query device {index} through NVML: GPU is lost") }
    }

    #[test]
    fn an_unreadable_gpu_keeps_its_last_reading_and_one_never_read_is_left_out() {
        let known = [gpu(0, "a"), gpu(1, "b"), gpu(2, "c")];
        // (case, found now, known before by index) → (GPUs by UUID, filled, unreadable left out)
        type Case = (&'static str, Discovered, Option<&'static [u32]>, [&'static [&'static str]; 2], Vec<u32>);
        let table: Vec<Case> = vec![
            (
                "all read",
                Discovered { gpus: known.to_vec(), unreadable: vec![] },
                None,
                [&["a", "b", "c"], &[]],
                vec![],
            ),
            (
                "GPU 1 lost while the agent ran: its last reading, in order",
                Discovered { gpus: vec![gpu(0, "a"), gpu(2, "c")], unreadable: vec![lost(1)] },
                Some(&[0, 1, 2]),
                [&["a", "b", "c"], &["b"]],
                vec![],
            ),
            (
                "GPU 1 lost before the agent started: left out",
                Discovered { gpus: vec![gpu(0, "a"), gpu(2, "c")], unreadable: vec![lost(1)] },
                None,
                [&["a", "c"], &[]],
                vec![1],
            ),
            (
                "a GPU never read before (not among the known): left out",
                Discovered { gpus: vec![gpu(0, "a")], unreadable: vec![lost(3)] },
                Some(&[0, 1, 2]),
                [&["a"], &[]],
                vec![3],
            ),
            (
                "indexes shifted (a driver reload no longer counts one): nothing taken from the old ones",
                Discovered { gpus: vec![gpu(0, "a"), gpu(1, "c")], unreadable: vec![lost(2)] },
                Some(&[0, 1, 2]),
                [&["a", "c"], &[]],
                vec![2],
            ),
        ];
        for (case, found, known_indexes, [uuids, filled_uuids], unreadable) in table {
            let known: Option<Vec<Gpu>> =
                known_indexes.map(|ix| known.iter().filter(|g| ix.contains(&g.index)).cloned().collect());
            let Filled { gpus, filled, unknown } = found.filled_from(known.as_deref());
            assert_eq!(gpus.iter().map(|g| g.uuid.as_str()).collect::<Vec<_>>(), uuids, "{case}");
            assert_eq!(filled, filled_uuids, "{case}");
            assert_eq!(unknown.iter().map(|u| u.index).collect::<Vec<_>>(), unreadable, "{case}");
        }
    }
}
