//! `gpu-dra gpu-check`: the node agent's discovery and prepare path on this machine, without a cluster. It prints
//! the GPUs found, the ResourceSlice spec the agent would publish, and prepares one sample claim into a scratch CDI
//! directory (validated by loading it back with the CDI crate), then watches NVML's health events for a few seconds
//! and reports what the health monitor would see, so a GPU machine can be checked in one command. It also lists the
//! MIG profiles and placements of each GPU model (NVML's, checked against NVIDIA's documented table, in MIG mode).

use std::fmt::Write as _;
use std::path::Path;

use serde_json::json;

use super::device::{self, Device};
use super::gpu::Gpu;
use super::health::{classify, inject, nvml_events};
use super::{discovery, mig, plugin, slices};
use crate::cdi::{self, CdiKind};
use crate::cli::{GpuBackend, GpuCheckArgs};

/// What can go wrong, each naming what to do.
#[derive(Debug, thiserror::Error)]
pub enum GpuCheckError {
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
    #[error("--driver-name {0:?} is not a DNS subdomain of at most 63 characters (e.g. gpu.example.com)")]
    DriverName(String),
    #[error("no GPU found: nothing to publish or prepare")]
    NoGpus,
    #[error(
        "{} GPU(s) NVML reports lost ({}): the agent leaves them out and publishes the others; reset the GPU or \
         reboot the machine",
        lost.len(),
        lost.join("; ")
    )]
    Lost { lost: Vec<String> },
    #[error(
        "every GPU is in MIG mode without a MIG device: nothing to prepare (create some with nvidia-smi mig -cgi … -C)"
    )]
    NoDevices,
    #[error(transparent)]
    Cdi(#[from] cdi::CdiError),
    #[error("load the written CDI spec {path} back with the CDI crate: {reason}")]
    LoadSpec { path: String, reason: String },
    #[error("change a GPU's setting: {0} (run without --check-time-slice and --check-mps to skip)")]
    GpuSetting(#[source] crate::node_agent::gpu_settings::GpuSettingError),
    #[error("make or destroy a MIG device: {0} (run without --check-mig-device to skip)")]
    MigDevice(#[source] discovery::MigControlError),
    #[error(
        "MIG device {uuid} was {what}, yet discovery {listed} it (run without --check-mig-device to skip; check \
         nvidia-smi mig -lgi)"
    )]
    MigDeviceListing { uuid: String, what: &'static str, listed: &'static str },
    #[error("find this program, to run it as the simulated MPS control daemon: {0}")]
    MpsProgram(#[source] std::io::Error),
    #[error("start, ask or stop an MPS control daemon: {0} (run without --check-mps to skip)")]
    Mps(#[source] crate::node_agent::mps_control::MpsError),
    #[error(
        "device node(s) {} missing on this machine: a container given the GPUs would fail to start (\"failed to \
         stat CDI host device\"). Is the NVIDIA driver loaded (nvidia-smi), and are its device nodes created \
         (nvidia-modprobe -c=<minor>)? In a container, is the host's /dev mounted?",
        nodes.join(", ")
    )]
    MissingDeviceNodes { nodes: Vec<String> },
    #[error(
        "a node agent runs on this machine ({holder}, holding the lock in {state_dir}): --check-time-slice, \
         --check-mig-device and --check-mps change GPU settings its prepared claims depend on. Run them where no \
         agent runs (drain the node and stop its agent), or without those flags"
    )]
    AgentRunning { state_dir: String, holder: String },
    #[error("watch NVML's health events: {0} (run with --watch-health 0s to skip)")]
    HealthEvents(#[source] nvml_wrapper::error::NvmlError),
}

/// A fixed, recognisable claim UID for the sample claim.
const SAMPLE_CLAIM_UID: &str = "0c4ec4ec-0000-4000-8000-000000000001";
/// The same for the claim of the MIG device `--check-mig-device` makes.
const SAMPLE_MIG_CLAIM_UID: &str = "0c4ec4ec-0000-4000-8000-000000000002";

/// Runs the check and prints the report to stdout.
pub fn run(args: &GpuCheckArgs) -> Result<(), GpuCheckError> {
    if (args.check_time_slice || args.check_mig_device || args.check_mps)
        && let Some(holder) = super::instance_lock::holder(&args.state_dir)
    {
        return Err(GpuCheckError::AgentRunning { state_dir: args.state_dir.display().to_string(), holder });
    }
    let gpu = &args.gpu;
    if !super::is_dns_subdomain(&gpu.driver_name) {
        return Err(GpuCheckError::DriverName(gpu.driver_name.clone()));
    }
    let backend = discovery::backend(gpu, &args.node_name, None)?;
    let found = backend.discover_all()?;
    if !found.unreadable.is_empty() {
        let lost = found.unreadable.iter().map(|u| format!("GPU {}: {}", u.index, u.reason)).collect();
        return Err(GpuCheckError::Lost { lost });
    }
    let gpus = found.gpus;
    if gpus.is_empty() {
        return Err(GpuCheckError::NoGpus);
    }
    print!("{}", gpu_table(&gpus));

    let all = device::devices(&gpus, gpu.mig_layout);
    // As the agent publishes them before any claim is prepared: every MIG device there is an administrator's.
    let pool = slices::node_pool(&gpus, &all, gpu.gpu_sharing, &Default::default(), &Default::default());
    for (i, content) in pool.iter().enumerate() {
        let spec = json!({"driver": gpu.driver_name, "nodeName": args.node_name,
            "pool": {"name": args.node_name, "generation": 1}, content.field(): content.items()});
        println!("\nResourceSlice {} spec (as the agent would publish it):", i + 1);
        println!("{}", serde_json::to_string_pretty(&spec).unwrap_or_default());
    }

    let simulated = gpu.gpu_backend == GpuBackend::Simulated;
    let driver_files = plugin::driver_files(gpu.driver_root_to_read(), None, simulated)?;
    let kind = CdiKind::from_driver_name(&gpu.driver_name)?;
    // Devices that exist now: a dynamic MIG partition is made only for a claim (see --check-mig-device).
    let existing = device::devices(&gpus, device::MigLayout::Static);
    let claim: Vec<Device> = existing.iter().take(args.claim_gpus.into()).cloned().collect();
    if claim.len() < usize::from(args.claim_gpus) && !claim.is_empty() {
        println!(
            "\n--claim-gpus {}: this node has {} device(s); the sample claim takes them all",
            args.claim_gpus,
            claim.len()
        );
    }
    if claim.is_empty() {
        // The profiles are what an administrator needs to make MIG devices.
        mig_profiles(args, &gpus)?;
        if args.check_mig_device {
            // A GPU in MIG mode without MIG devices is what dynamic MIG starts from: the made device is prepared.
            return check_mig_device(args, backend.as_ref(), &gpus, &kind, &driver_files);
        }
        return Err(GpuCheckError::NoDevices);
    }
    let spec = cdi::build_claim_spec(&kind, SAMPLE_CLAIM_UID, &claim, &driver_files)?;
    let path = cdi::write_claim_spec(&args.cdi_dir, &kind, SAMPLE_CLAIM_UID, &spec)?;
    let mut loaded = container_device_interface::spec::read_spec(&path, 0)
        .and_then(|mut s| s.validate().map(|_| s))
        .map_err(|e| GpuCheckError::LoadSpec { path: path.display().to_string(), reason: format!("{e:#}") })?;
    println!("\nPrepared a sample claim with {} device(s): {}", claim.len(), path.display());
    for device in &claim {
        println!("  CDI device {}", cdi::device_id(&kind, SAMPLE_CLAIM_UID, &device.name()));
    }
    println!("  {} driver files mounted read-only (libraries, utilities, firmware)", driver_files.mounts()?.len());
    let edits = loaded.edits().map(|e| e.container_edits);
    let env = edits.as_ref().and_then(|e| e.env.clone()).unwrap_or_default();
    println!("  environment: {}", env.join(" "));
    let mut missing = Vec::new();
    for node in device_nodes(&claim) {
        let present = Path::new(&node).exists();
        println!("  device node {node}: {}", if present { "present" } else { "MISSING on this machine" });
        if !present {
            missing.push(node);
        }
    }
    // Simulated GPUs have none. A real GPU's spec names its nodes and the control device, and the runtime fails
    // the container without them ("failed to stat CDI host device"); the unified-memory nodes are left out of the
    // spec until they exist, and CUDA fails without them: said, not failed (nvidia-smi works).
    if !simulated {
        let (optional, required) = required_missing(missing);
        if !optional.is_empty() {
            println!(
                "  WARNING: {} missing: CUDA fails in containers until the nvidia-uvm module is loaded \
                      (nvidia-modprobe -u -c=0 on the node)",
                optional.join(", ")
            );
        }
        if !required.is_empty() {
            return Err(GpuCheckError::MissingDeviceNodes { nodes: required });
        }
    }
    mig_profiles(args, &gpus)?;
    if args.check_time_slice {
        // A time slice is a whole GPU's: a GPU in MIG mode has none to set.
        match gpus.iter().find(|g| !g.mig_enabled) {
            Some(whole) => check_time_slice(args, whole)?,
            None => println!("\nTime slice: every GPU is in MIG mode, where a time slice cannot be set; not checked"),
        }
    }
    if args.check_mig_device {
        check_mig_device(args, backend.as_ref(), &gpus, &kind, &driver_files)?;
    }
    if args.check_mps {
        check_mps(args, &claim)?;
    }
    if !args.watch_health.is_zero() {
        watch_health(args, &gpus)?;
    }
    Ok(())
}

/// Prints the MIG profiles and placements of each GPU model found: NVIDIA's documented table, and for a GPU in MIG
/// mode NVML's own answer, each profile checked against the table.
fn mig_profiles(args: &GpuCheckArgs, gpus: &[Gpu]) -> Result<(), GpuCheckError> {
    println!("\nMIG profiles (placements as {{memory slice starts}}:size, of {} slices):", mig::MEMORY_SLICES);
    let mut seen = std::collections::BTreeSet::new();
    for gpu in gpus {
        let Some(table) = mig::profiles(gpu) else {
            if seen.insert((gpu.product_name.clone(), false)) {
                println!("  {}: no MIG profiles known for this model", gpu.product_name);
            }
            continue;
        };
        let nvml = args.gpu.gpu_backend == GpuBackend::Nvml && gpu.mig_enabled;
        if !nvml {
            if seen.insert((gpu.product_name.clone(), true)) {
                let why = if args.gpu.gpu_backend == GpuBackend::Nvml { "MIG mode off; " } else { "" };
                println!("  {} ({why}NVIDIA's documented table):", gpu.product_name);
                for profile in &table {
                    println!("    {}", profile_line(profile));
                }
            }
            continue;
        }
        let root = args.gpu.driver_root_to_read().unwrap_or(Path::new("/"));
        let found = discovery::nvml::NvmlDiscovery::new(root, args.gpu.sysfs()).gpu_instance_profiles(gpu.index)?;
        println!("  {} {} (MIG mode on; from NVML):", gpu.device_name(), gpu.product_name);
        for profile in &found {
            let documented = table.iter().find(|p| p.nvml_id == profile.nvml_id);
            let starts: Vec<u32> = profile.placements.iter().map(|(start, _)| *start).collect();
            let size = profile.placements.first().map_or(0, |(_, size)| *size);
            let verdict = match documented {
                Some(p)
                    if p.id == profile.id
                        && p.placement_starts == starts
                        && p.memory_slices == size
                        && p.max_instances == profile.instance_count =>
                {
                    format!("{}: as documented", p.name)
                }
                Some(p) => format!("DIFFERS from the documented {}", profile_line(p)),
                None => "not in the documented table".to_string(),
            };
            println!(
                "    profile {:>2} (ID {:>2}): {} compute slice(s), {} MiB, {} SMs, up to {}, placements {} — {verdict}",
                profile.nvml_id,
                profile.id,
                profile.slice_count,
                profile.memory_mib,
                profile.multiprocessors,
                profile.instance_count,
                mig::placements_text(&starts, size)
            );
        }
    }
    Ok(())
}

fn profile_line(profile: &mig::Profile) -> String {
    format!(
        "{:<11} profile {:>2} (ID {:>2}): {} compute / {} memory slice(s), up to {}, placements {}",
        profile.name,
        profile.nvml_id,
        profile.id,
        profile.compute_slices,
        profile.memory_slices,
        profile.max_instances,
        mig::placements_text(profile.placement_starts, profile.memory_slices)
    )
}

/// Sets `gpu`'s time slice to Long and back to Default the way a prepare and an unprepare do, and prints each
/// outcome; a failure fails the check (after the attempt to set it back).
fn check_time_slice(args: &GpuCheckArgs, gpu: &Gpu) -> Result<(), GpuCheckError> {
    use crate::kubelet_plugin::config::TimeSliceInterval;
    use crate::node_agent::gpu_settings::{GpuSettings, NvidiaSmi};
    if args.gpu.gpu_backend == GpuBackend::Simulated {
        println!("\nTime slice: simulated GPUs keep theirs in <state-dir>/simulated-time-slices.json (see the README)");
        return Ok(());
    }
    let control = NvidiaSmi::of(&args.gpu);
    println!("\nTime slice of {} ({}), as a claim asking TimeSlicing would set it:", gpu.device_name(), gpu.uuid);
    let mut first_failure = None;
    for interval in [TimeSliceInterval::Long, TimeSliceInterval::Default] {
        match control.set_time_slice(gpu, interval) {
            Ok(()) => println!("  set to {interval:?}: ok"),
            Err(e) => {
                println!("  set to {interval:?}: FAILED: {e}");
                first_failure = first_failure.or(Some(e));
            }
        }
    }
    first_failure.map_or(Ok(()), |e| Err(GpuCheckError::GpuSetting(e)))
}

/// Starts the MPS control daemon the sample claim would get if it asked `sharing.strategy: MPS` (half of each GPU's
/// threads), its whole GPUs set to `EXCLUSIVE_PROCESS` first, asks it for its servers through its control pipe as a
/// client would, and stops it, setting the GPUs back to `DEFAULT`, printing each step; its directories live in a
/// scratch directory removed afterwards.
fn check_mps(args: &GpuCheckArgs, claim: &[Device]) -> Result<(), GpuCheckError> {
    use crate::kubelet_plugin::mps::MpsDaemon;
    use crate::node_agent::gpu_settings::{ComputeMode, GpuSettings, NvidiaSmi};
    use crate::node_agent::mps_control::{MpsDaemons, MpsProgram};
    let program = MpsProgram::of(&args.gpu).map_err(GpuCheckError::MpsProgram)?;
    let root = std::env::temp_dir().join(format!("gpu-dra-check-mps-{}", std::process::id()));
    let mut uuids: Vec<String> = claim.iter().map(|d| d.uuid().to_string()).collect();
    uuids.sort();
    let daemon = MpsDaemon { uuids, active_thread_percentage: Some(50), pinned_mib: Default::default() };
    println!(
        "\nMPS control daemon for {} device(s), as a claim asking MPS gets one ({}):",
        claim.len(),
        program.shown()
    );
    // Its whole GPUs in EXCLUSIVE_PROCESS while it runs, as a prepare sets them (simulated GPUs keep theirs in a
    // state file of the agent's, not checked here).
    let exclusive: Vec<&Device> = claim.iter().filter(|d| !d.is_mig()).collect();
    let settings = (args.gpu.gpu_backend == GpuBackend::Nvml).then(|| NvidiaSmi::of(&args.gpu));
    let mut first_failure = None;
    let mut set_all = |mode: ComputeMode| {
        let Some(settings) = &settings else { return };
        for device in &exclusive {
            match settings.set_compute_mode(&device.gpu, mode) {
                Ok(()) => println!("  compute mode of {} set to {}: ok", device.name(), mode.nvidia_smi_name()),
                Err(e) => {
                    println!("  compute mode of {} set to {}: FAILED: {e}", device.name(), mode.nvidia_smi_name());
                    first_failure = first_failure.take().or(Some(e));
                }
            }
        }
    };
    set_all(ComputeMode::ExclusiveProcess);
    let daemons = MpsDaemons::new(program, root.clone(), prometheus_client::metrics::counter::Counter::default());
    let result = daemons.start(SAMPLE_CLAIM_UID, &daemon).and_then(|_| {
        println!(
            "  started (pid {}), control pipe in {}",
            daemons.pid(SAMPLE_CLAIM_UID).unwrap_or_default(),
            daemons.dirs(SAMPLE_CLAIM_UID).pipe.display()
        );
        let servers = daemons.control(SAMPLE_CLAIM_UID, "get_server_list")?;
        println!("  get_server_list: {}", if servers.trim().is_empty() { "(no server yet)" } else { servers.trim() });
        Ok(())
    });
    let stopped = daemons.stop(SAMPLE_CLAIM_UID);
    let _ = std::fs::remove_dir_all(&root);
    set_all(ComputeMode::Default);
    result.and(stopped).map_err(GpuCheckError::Mps)?;
    println!("  stopped (quit), directories removed");
    first_failure.map_or(Ok(()), |e| Err(GpuCheckError::GpuSetting(e)))
}

/// Makes a MIG device of the smallest profile (`1g`) at the lowest free placement of the first GPU in MIG mode with
/// room for one, checks that discovery then lists it and that a claim's CDI spec for it is valid (its capability
/// nodes as the driver numbered them), destroys it and checks that discovery no longer lists it: the create/destroy
/// pair dynamic MIG prepares and releases claims with.
fn check_mig_device(
    args: &GpuCheckArgs,
    backend: &dyn discovery::Discovery,
    gpus: &[Gpu],
    kind: &CdiKind,
    driver_files: &cdi::DriverFiles,
) -> Result<(), GpuCheckError> {
    let room = gpus.iter().filter(|g| g.mig_enabled).find_map(|gpu| {
        let smallest = *mig::profiles(gpu)?.first()?;
        Some((gpu, smallest, mig::free_placement(gpu, &smallest)?))
    });
    let Some((gpu, profile, start)) = room else {
        println!("\nMIG device: no GPU in MIG mode with room for a 1g profile; not checked");
        return Ok(());
    };
    println!(
        "\nMIG device: making a {} at memory slice {start} of {} ({}):",
        profile.name,
        gpu.device_name(),
        gpu.uuid
    );
    let made = backend.create_mig_device(gpu.index, &profile, start).map_err(GpuCheckError::MigDevice)?;
    println!(
        "  made {} (GPU instance {}, compute instance {}, {} MiB, {} SMs, /dev/nvidia-caps/nvidia-cap{} and {})",
        made.uuid,
        made.gpu_instance,
        made.compute_instance,
        made.memory_bytes >> 20,
        made.multiprocessors,
        made.gi_cap_minor,
        made.ci_cap_minor
    );
    let listed = |gpus: &[Gpu]| gpus.iter().flat_map(|g| &g.mig_devices).any(|m| m.uuid == made.uuid);
    let seen = backend.discover().map(|gpus| listed(&gpus));
    let device = Device { gpu: gpu.clone(), mig: Some(made.clone()), partition: None };
    let spec = cdi::build_claim_spec(kind, SAMPLE_MIG_CLAIM_UID, std::slice::from_ref(&device), driver_files)
        .and_then(|spec| cdi::validate_claim_spec(kind, SAMPLE_MIG_CLAIM_UID, &spec).map(|()| spec))
        .and_then(|spec| cdi::write_claim_spec(&args.cdi_dir, kind, SAMPLE_MIG_CLAIM_UID, &spec));
    // Looked at while the device exists.
    let nodes: Vec<(String, bool)> =
        device_nodes(std::slice::from_ref(&device)).into_iter().map(|n| (n.clone(), Path::new(&n).exists())).collect();
    // Destroyed whatever discovery said: the check must not leave the GPU changed.
    backend
        .destroy_mig_device(gpu.index, made.gpu_instance, made.compute_instance)
        .map_err(GpuCheckError::MigDevice)?;
    if !seen? {
        return Err(GpuCheckError::MigDeviceListing { uuid: made.uuid, what: "made", listed: "did not list" });
    }
    println!("  listed by discovery; published as {}", device.name());
    let path = spec?;
    println!("  a claim of it gets a valid CDI spec ({}) with:", path.display());
    for (node, present) in nodes {
        println!("    device node {node}: {}", if present { "present" } else { "MISSING on this machine" });
    }
    if listed(&backend.discover()?) {
        return Err(GpuCheckError::MigDeviceListing { uuid: made.uuid, what: "destroyed", listed: "still lists" });
    }
    println!("  destroyed; discovery no longer lists it");
    Ok(())
}

/// Watches NVML's health events for `--watch-health` and prints what the node agent's monitor would see: the
/// events each GPU supports, and each fault with its class by the classification table (nothing is injected: on a
/// healthy machine, no fault is the expected answer).
fn watch_health(args: &GpuCheckArgs, gpus: &[Gpu]) -> Result<(), GpuCheckError> {
    let seconds = args.watch_health.as_secs_f64();
    if args.gpu.gpu_backend == GpuBackend::Simulated {
        println!("\nGPU health: simulated GPUs have no NVML events; the node agent takes their faults from");
        println!("  <state-dir>/{} (e.g. \"gpu-1 xid 79\"), see the README's GPU health section", inject::FILE_NAME);
        return Ok(());
    }
    let library = args.gpu.nvml_library();
    let watched = nvml_events::watch_for(&library, args.watch_health).map_err(GpuCheckError::HealthEvents)?;
    println!("\nGPU health: NVML events watched for {seconds:.1} s");
    let name = |uuid: &str| gpus.iter().find(|g| g.uuid == uuid).map_or_else(|| "?".to_owned(), Gpu::device_name);
    for (uuid, events) in &watched.subscribed {
        let what = if events.is_empty() {
            "no health events supported (only GPU lost is seen)".to_owned()
        } else {
            format!("{events:?}")
        };
        println!("  {:<7} {uuid} subscribed: {what}", name(uuid));
    }
    if watched.faults.is_empty() {
        println!("  no fault reported");
    }
    let ignore = std::collections::BTreeSet::new();
    for (uuid, fault) in &watched.faults {
        let (class, meaning) = classify::classify(*fault, &ignore);
        println!("  {:<7} {uuid} reported {fault}: {meaning} (class {})", name(uuid), class.as_str());
    }
    Ok(())
}

/// `missing` device nodes split into (optional, required): the unified-memory nodes a spec leaves out until they
/// exist ([`cdi::OPTIONAL_DEVICE_NODES`]), and the rest.
fn required_missing(missing: Vec<String>) -> (Vec<String>, Vec<String>) {
    missing.into_iter().partition(|node| cdi::OPTIONAL_DEVICE_NODES.contains(&node.as_str()))
}

fn device_nodes(devices: &[Device]) -> Vec<String> {
    let mut nodes: Vec<String> = Vec::new();
    for d in devices {
        nodes.push(format!("/dev/nvidia{}", d.gpu.minor));
        if let Some(mig) = &d.mig {
            nodes.extend([mig.gi_cap_minor, mig.ci_cap_minor].map(|m| format!("/dev/nvidia-caps/nvidia-cap{m}")));
        }
    }
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
        for m in &g.mig_devices {
            let _ = writeln!(
                out,
                "    MIG {:<9} {} GPU instance {} compute instance {}, memory slices {}..{}, {} MiB, {} SMs",
                m.profile,
                m.uuid,
                m.gpu_instance,
                m.compute_instance,
                m.placement_start,
                m.placement_start + m.placement_size,
                m.memory_bytes >> 20,
                m.multiprocessors
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_unified_memory_nodes_may_be_missing() {
        let missing = ["/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidiactl", "/dev/nvidia-uvm-tools"];
        let (optional, required) = required_missing(missing.map(String::from).to_vec());
        assert_eq!(optional, ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]);
        assert_eq!(required, ["/dev/nvidia0", "/dev/nvidiactl"]);
        assert_eq!(required_missing(Vec::new()), (Vec::new(), Vec::new()));
    }
}
