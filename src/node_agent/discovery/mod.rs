//! GPU discovery behind one trait: NVML on real machines, a simulated backend on machines without GPUs. Everything
//! downstream (ResourceSlices, the kubelet plugin, CDI) is the same code for both.

pub mod nvml;
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
    #[error(transparent)]
    SimulatedSpec(#[from] simulated::SpecError),
}

/// A source of GPUs.
pub trait Discovery: Send + Sync {
    /// The GPUs of this node now.
    fn discover(&self) -> Result<Vec<Gpu>, DiscoveryError>;
}
