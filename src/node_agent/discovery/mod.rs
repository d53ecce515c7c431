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
            std::sync::Arc::new(match kept {
                Some((state_dir, boot_id)) => {
                    simulated::Simulated::keeping_mig_devices(node, spec, state_dir, boot_id)?
                }
                None => simulated::Simulated::new(node, spec)?,
            })
        }
        crate::cli::GpuBackend::Nvml => std::sync::Arc::new(nvml::NvmlDiscovery::new(
            gpu.driver_root_to_read().unwrap_or(std::path::Path::new("/")),
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

/// A source of GPUs, which can also make and destroy MIG devices on GPUs in MIG mode (what `gpu-check` verifies on
/// a GPU machine, and what dynamic MIG prepares claims with).
pub trait Discovery: Send + Sync + std::fmt::Debug {
    /// The GPUs of this node now.
    fn discover(&self) -> Result<Vec<Gpu>, DiscoveryError>;

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
