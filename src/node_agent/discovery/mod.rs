//! GPU discovery behind one trait: NVML on real machines, a simulated backend on machines without GPUs. Everything
//! downstream (ResourceSlices, the kubelet plugin, CDI) is the same code for both.

pub mod nvml;
mod nvml_mig;
pub mod simulated;

use super::gpu::Gpu;

/// Why discovery failed. The agent stays up and retries; it publishes nothing until discovery works.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error(
        "load NVML ({library}): {source}. Is the NVIDIA driver installed on this node and --driver-root right? \
         The agent retries with back-off and publishes nothing until then"
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
/// error here, at start-up; NVML problems show only when discovering (the agent then retries).
pub fn backend(gpu: &crate::cli::GpuArgs, node: &str) -> Result<std::sync::Arc<dyn Discovery>, DiscoveryError> {
    Ok(match gpu.gpu_backend {
        crate::cli::GpuBackend::Simulated => {
            let spec = gpu.simulated_gpus.as_deref().ok_or(DiscoveryError::SimulatedSpecMissing)?;
            std::sync::Arc::new(simulated::Simulated::new(node, spec)?)
        }
        crate::cli::GpuBackend::Nvml => std::sync::Arc::new(nvml::NvmlDiscovery::new(
            gpu.driver_root_to_read().unwrap_or(std::path::Path::new("/")),
        )),
    })
}

/// A source of GPUs.
pub trait Discovery: Send + Sync {
    /// The GPUs of this node now.
    fn discover(&self) -> Result<Vec<Gpu>, DiscoveryError>;
}
