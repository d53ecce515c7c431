//! `gpu-dra gpu-check`: the node agent's discovery and prepare path on this machine, without a cluster. It prints
//! the GPUs found, the ResourceSlice spec the agent would publish, and prepares one sample claim into a scratch CDI
//! directory (validated by loading it back with the CDI crate), so a GPU machine can be checked in one command.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::json;

use super::gpu::Gpu;
use super::{discovery, plugin, slices};
use crate::cdi::{self, CdiKind};
use crate::cli::{GpuBackend, GpuCheckArgs};

/// What can go wrong, each naming what to do.
#[derive(Debug, thiserror::Error)]
pub enum GpuCheckError {
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
    #[error("no GPU found: nothing to publish or prepare")]
    NoGpus,
    #[error(transparent)]
    Cdi(#[from] cdi::CdiError),
    #[error("load the written CDI spec {path} back with the CDI crate: {reason}")]
    LoadSpec { path: String, reason: String },
}

/// A fixed, recognisable claim UID for the sample claim.
const SAMPLE_CLAIM_UID: &str = "0c4ec4ec-0000-4000-8000-000000000001";

/// Runs the check and prints the report to stdout.
pub fn run(args: &GpuCheckArgs) -> Result<(), GpuCheckError> {
    let gpu = &args.gpu;
    let gpus = discovery::backend(gpu, &args.node_name)?.discover()?;
    if gpus.is_empty() {
        return Err(GpuCheckError::NoGpus);
    }
    print!("{}", gpu_table(&gpus));

    let devices: Vec<_> = gpus.iter().map(slices::device).collect();
    for (i, devices) in slices::split_into_slices(devices, slices::MAX_DEVICES_PER_SLICE).iter().enumerate() {
        let spec = json!({"driver": gpu.driver_name, "nodeName": args.node_name,
            "pool": {"name": args.node_name, "generation": 1}, "devices": devices});
        println!("\nResourceSlice {} spec (as the agent would publish it):", i + 1);
        println!("{}", serde_json::to_string_pretty(&spec).unwrap_or_default());
    }

    let simulated = gpu.gpu_backend == GpuBackend::Simulated;
    let driver_files = plugin::driver_files(gpu.driver_root_to_read(), None, simulated)?;
    let kind = CdiKind::from_driver_name(&gpu.driver_name)?;
    let claim: Vec<Gpu> = gpus.iter().take(args.claim_gpus.max(1)).cloned().collect();
    let spec = cdi::build_claim_spec(&kind, SAMPLE_CLAIM_UID, &claim, &driver_files)?;
    let path = cdi::write_claim_spec(&args.cdi_dir, &kind, SAMPLE_CLAIM_UID, &spec)?;
    let mut loaded = container_device_interface::spec::read_spec(&path, 0)
        .and_then(|mut s| s.validate().map(|_| s))
        .map_err(|e| GpuCheckError::LoadSpec { path: path.display().to_string(), reason: format!("{e:#}") })?;
    println!("\nPrepared a sample claim with {} GPU(s): {}", claim.len(), path.display());
    for gpu in &claim {
        println!("  CDI device {}", cdi::device_id(&kind, SAMPLE_CLAIM_UID, gpu.minor));
    }
    println!("  {} driver files mounted read-only (libraries, utilities, firmware)", driver_files.mounts()?.len());
    let edits = loaded.edits().map(|e| e.container_edits);
    let env = edits.as_ref().and_then(|e| e.env.clone()).unwrap_or_default();
    println!("  environment: {}", env.join(" "));
    for node in device_nodes(&claim) {
        let state = if Path::new(&node).exists() { "present" } else { "MISSING on this machine" };
        println!("  device node {node}: {state}");
    }
    Ok(())
}

fn device_nodes(gpus: &[Gpu]) -> Vec<String> {
    let mut nodes: Vec<String> = gpus.iter().map(|g| format!("/dev/nvidia{}", g.minor)).collect();
    nodes.extend(["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"].map(String::from));
    nodes
}

fn gpu_table(gpus: &[Gpu]) -> String {
    let mut out = format!("{} GPU(s) found:\n", gpus.len());
    for g in gpus {
        let _ = writeln!(
            out,
            "  {:<7} {:<28} {} memory {} GiB, CUDA {} (compute {}), driver {}, PCI {}{}",
            g.device_name(),
            g.product_name,
            g.uuid,
            g.memory_bytes >> 30,
            g.cuda_driver_version,
            g.cuda_compute_capability,
            g.driver_version,
            g.pci_bus_id,
            if g.mig_enabled { ", MIG mode on" } else { "" }
        );
    }
    out
}
