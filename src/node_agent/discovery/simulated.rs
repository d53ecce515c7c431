//! Simulated GPUs for machines without any (tests, the demo): realistic attributes from a small product table,
//! UUIDs and PCI addresses stable per node and index.
//!
//! Spec: a comma-separated list of `<count>x<model>`, e.g. `4xH100-80GB` or `2xA100-40GB,2xH100-80GB`; or
//! `@<path>` naming a file that holds such a spec. `<count>x<model>/mig=<profile>+<profile>…` puts those GPUs in
//! MIG mode with those MIG devices (e.g. `1xH100-80GB/mig=3g.40gb+2g.20gb+1g.10gb`), laid out as
//! [`mig::layout`] places them; `/mig=` with no profile is MIG mode with no device yet. `<count>x<model>/lost` are
//! GPUs fallen off the bus: counted, but unreadable, as NVML answers for such a GPU ("GPU is lost"). While
//! `<state-dir>/simulated-driver-unusable` exists, discovery fails as NVML does after a driver upgrade without a reboot;
//! while `<state-dir>/simulated-driver-hung` exists, it does not return, as NVML on a wedged GPU or driver.

use std::sync::{Mutex, PoisonError};

use super::{Discovered, Discovery, DiscoveryError, MigControlError, Unreadable, placeable};
use crate::node_agent::gpu::{Gpu, MigDevice, stable_hash};
use crate::node_agent::mig::{self, LayoutError, Profile};

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
    /// The total NVML reports (nvidia-smi's `Total`), not the marketing size: an H100 80GB has 81,559 MiB, so
    /// shares that fill the marketed 80Gi exactly do not fit, here as on the real GPU.
    memory_mib: u64,
    /// Streaming multiprocessors per MIG compute slice (the simulated MIG devices' `multiprocessors`).
    sms_per_slice: u32,
}

const MODELS: &[Model] = &[
    Model {
        key: "A100-40GB",
        sms_per_slice: 14,
        product: "NVIDIA A100-SXM4-40GB",
        architecture: "Ampere",
        compute_capability: "8.0",
        memory_mib: 40_960,
    },
    Model {
        key: "A100-80GB",
        sms_per_slice: 14,
        product: "NVIDIA A100-SXM4-80GB",
        architecture: "Ampere",
        compute_capability: "8.0",
        memory_mib: 81_920,
    },
    Model {
        key: "L4-24GB",
        sms_per_slice: 0,
        product: "NVIDIA L4",
        architecture: "Ada Lovelace",
        compute_capability: "8.9",
        memory_mib: 23_034,
    },
    Model {
        key: "H100-80GB",
        sms_per_slice: 16,
        product: "NVIDIA H100 80GB HBM3",
        architecture: "Hopper",
        compute_capability: "9.0",
        memory_mib: 81_559,
    },
    Model {
        key: "H200-141GB",
        sms_per_slice: 16,
        product: "NVIDIA H200",
        architecture: "Hopper",
        compute_capability: "9.0",
        memory_mib: 143_771,
    },
    Model {
        key: "B200-180GB",
        sms_per_slice: 18,
        product: "NVIDIA B200",
        architecture: "Blackwell",
        compute_capability: "10.0",
        memory_mib: 183_359,
    },
];

/// A spec that cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("--simulated-gpus names no GPU (empty, or counts of 0); give e.g. 4xH100-80GB")]
    Empty,
    #[error("--simulated-gpus entry {entry:?} is not <count>x<model> (e.g. 4xH100-80GB)")]
    Malformed { entry: String },
    #[error("--simulated-gpus entry {entry:?}: unknown model {model:?}; known: {known}")]
    UnknownModel { entry: String, model: String, known: String },
    #[error("--simulated-gpus asks for {count} GPUs; at most {MAX_GPUS}")]
    TooMany { count: u32 },
    #[error("read --simulated-gpus file {path}: {message}")]
    File { path: String, message: String },
    #[error("--simulated-gpus entry {entry:?}: {source}")]
    Mig {
        entry: String,
        #[source]
        source: LayoutError,
    },
}

/// Simulated GPUs for one node. MIG devices made and destroyed through [`Discovery`] change what later discoveries
/// report: for this process's lifetime, or with [`Simulated::keeping_mig_devices`] for the boot, as on a real GPU
/// (an agent restarted finds the MIG devices it made; a reboot finds the spec's layout).
#[derive(Debug)]
pub struct Simulated {
    node: String,
    gpus: Mutex<Vec<Gpu>>,
    /// The indexes of GPUs fallen off the bus (`/lost`, or a fault injected: [`Discovery::set_lost`]).
    lost: Mutex<std::collections::BTreeSet<u32>>,
    /// Where each GPU's PCIe root and NUMA node are read, as for real GPUs (`None`: not read, neither).
    sysfs: Option<std::path::PathBuf>,
    /// What makes each made MIG device's UUID its own, as NVML's are: the process's start and a count.
    made: (u64, std::sync::atomic::AtomicU64),
    /// Where the MIG layouts are kept across restarts, and the spec and boot they belong to.
    kept: Option<KeptLayouts>,
    /// While this file exists, discovery fails as NVML does on a node whose driver was upgraded without a reboot
    /// ("Driver/library version mismatch"): `<state-dir>/simulated-driver-unusable`, for tests of an agent
    /// that cannot discover its GPUs.
    unusable_marker: Option<std::path::PathBuf>,
    /// While this file exists, discovery does not return, as an NVML call on a wedged GPU or driver:
    /// `<state-dir>/simulated-driver-hung`.
    hung_marker: Option<std::path::PathBuf>,
    /// While this file exists, a MIG device's make does not return once done: [`SIMULATED_MIG_MADE_HUNG_FILE`].
    made_hung_marker: Option<std::path::PathBuf>,
}

/// The file under the state directory that makes simulated GPUs' discovery fail while it exists.
pub const SIMULATED_DRIVER_UNUSABLE_FILE: &str = "simulated-driver-unusable";
/// The file under the state directory that makes simulated GPUs' discovery hang while it exists.
pub const SIMULATED_DRIVER_HUNG_FILE: &str = "simulated-driver-hung";

/// The file under the state directory that makes a MIG device's make, once done, not return while it exists: an
/// agent killed there has made a MIG device it has not recorded.
pub const SIMULATED_MIG_MADE_HUNG_FILE: &str = "simulated-mig-made-hung";

/// The file that keeps simulated MIG layouts: `{"spec": …, "boot": …, "gpus": {"<index>": [[profile ID, first
/// memory slice, GPU instance, UUID], …]}}`, written after every change.
#[derive(Debug)]
struct KeptLayouts {
    path: std::path::PathBuf,
    spec: String,
    boot: String,
}

/// MIG layouts by GPU index: (profile ID, first memory slice, GPU instance, UUID) of each MIG device.
type Layouts = std::collections::BTreeMap<String, Vec<(u32, u32, u32, String)>>;

/// The file name under the state directory.
pub const SIMULATED_MIG_FILE: &str = "simulated-mig-devices.json";

impl Simulated {
    /// Parses `spec` for `node`.
    pub fn new(node: &str, spec: &str) -> Result<Self, SpecError> {
        let spec = match spec.trim().strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| SpecError::File { path: path.to_string(), message: e.to_string() })?,
            None => spec.to_string(),
        };
        let mut gpus = Vec::new();
        let mut lost_indexes = Vec::new();
        for entry in spec.split([',', '\n']).map(str::trim).filter(|e| !e.is_empty()) {
            let (entry_gpus, lost) = match entry.strip_suffix("/lost") {
                Some(gpus_part) => (gpus_part, true),
                None => (entry, false),
            };
            let (gpus_part, mig_part) = match entry_gpus.split_once("/mig=") {
                Some((gpus_part, profiles)) => (gpus_part, Some(profiles)),
                None => (entry_gpus, None),
            };
            let (count, model_key) =
                gpus_part.split_once(['x', 'X']).ok_or_else(|| SpecError::Malformed { entry: entry.into() })?;
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
            let profiles: Option<Vec<String>> = mig_part.map(profile_names);
            let profiles: Option<Vec<&str>> = profiles.as_ref().map(|p| p.iter().map(String::as_str).collect());
            for _ in 0..count {
                let index = gpus.len() as u32;
                let mut gpu = simulated_gpu(node, index, model);
                if let Some(profiles) = &profiles {
                    gpu.mig_devices = simulated_mig_devices(node, &gpu, model, profiles)
                        .map_err(|source| SpecError::Mig { entry: entry.into(), source })?;
                    gpu.mig_enabled = true;
                }
                if lost {
                    lost_indexes.push(index);
                }
                gpus.push(gpu);
            }
        }
        if gpus.is_empty() {
            return Err(SpecError::Empty);
        }
        let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let made = (started as u64, std::sync::atomic::AtomicU64::new(0));
        Ok(Self {
            node: node.to_string(),
            gpus: Mutex::new(gpus),
            lost: Mutex::new(lost_indexes.into_iter().collect()),
            sysfs: None,
            made,
            kept: None,
            unusable_marker: None,
            hung_marker: None,
            made_hung_marker: None,
        })
    }

    /// As [`new`](Self::new), with the MIG devices made and destroyed kept in `<state_dir>/`[`SIMULATED_MIG_FILE`]
    /// for the boot `boot_id`: a file of another spec or boot is ignored (and replaced at the next change), an
    /// unreadable one too, with a warning.
    pub fn keeping_mig_devices(
        node: &str,
        spec: &str,
        state_dir: &std::path::Path,
        boot_id: &str,
    ) -> Result<Self, SpecError> {
        let mut simulated = Self::new(node, spec)?;
        simulated.unusable_marker = Some(state_dir.join(SIMULATED_DRIVER_UNUSABLE_FILE));
        simulated.hung_marker = Some(state_dir.join(SIMULATED_DRIVER_HUNG_FILE));
        simulated.made_hung_marker = Some(state_dir.join(SIMULATED_MIG_MADE_HUNG_FILE));
        let kept = KeptLayouts {
            path: state_dir.join(SIMULATED_MIG_FILE),
            spec: spec.trim().into(),
            boot: boot_id.trim().into(),
        };
        if let Some(layouts) = kept.read() {
            let gpus = simulated.gpus.get_mut().unwrap_or_else(PoisonError::into_inner);
            for gpu in gpus.iter_mut().filter(|g| g.mig_enabled) {
                let model = MODELS.iter().find(|m| m.product == gpu.product_name).map_or(0, |m| m.sms_per_slice);
                let table = mig::profiles(gpu).unwrap_or_default();
                let Some(devices) = layouts.get(&gpu.index.to_string()) else { continue };
                let rebuilt = devices.iter().filter_map(|(id, start, gpu_instance, uuid)| {
                    let profile = table.iter().find(|p| p.id == *id)?;
                    let device = simulated_mig_device(node, gpu, model, profile, *start, *gpu_instance);
                    Some(MigDevice { uuid: uuid.clone(), ..device })
                });
                gpu.mig_devices = rebuilt.collect();
            }
        }
        simulated.kept = Some(kept);
        Ok(simulated)
    }

    /// Reads each GPU's PCIe root and NUMA node under `sysfs` as NVML discovery does, from the simulated PCI bus ids
    /// (`0000:18:00.0`, `0000:20:00.0`, …): a test gives a tree of links there to place them under root complexes.
    pub fn with_sysfs(mut self, sysfs: &std::path::Path) -> Self {
        self.sysfs = Some(sysfs.to_path_buf());
        self
    }

    fn gpus(&self) -> std::sync::MutexGuard<'_, Vec<Gpu>> {
        self.gpus.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Discovery for Simulated {
    fn discover_all(&self) -> Result<Discovered, DiscoveryError> {
        while self.hung_marker.as_deref().is_some_and(std::path::Path::exists) {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        if self.unusable_marker.as_deref().is_some_and(std::path::Path::exists) {
            let source = ::nvml_wrapper::error::NvmlError::LibRmVersionMismatch;
            return Err(DiscoveryError::NvmlUnavailable { library: "simulated NVML".into(), source });
        }
        let lost_now = self.lost.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let (lost, mut gpus): (Vec<Gpu>, Vec<Gpu>) =
            self.gpus().iter().cloned().partition(|g| lost_now.contains(&g.index));
        if let Some(sysfs) = &self.sysfs {
            for gpu in &mut gpus {
                gpu.locate_in(sysfs);
            }
        }
        let unreadable = lost
            .iter()
            .map(|gpu| {
                let source = ::nvml_wrapper::error::NvmlError::GpuLost;
                let reason = DiscoveryError::Nvml { what: format!("device {}", gpu.index), source }.to_string();
                Unreadable { index: gpu.index, reason }
            })
            .collect();
        Ok(Discovered { gpus, unreadable })
    }

    fn set_lost(&self, gpu: &str, lost: bool) {
        let Some(index) = crate::node_agent::device::gpu_named(&self.gpus(), gpu).map(|g| g.index) else { return };
        let mut set = self.lost.lock().unwrap_or_else(PoisonError::into_inner);
        if lost {
            set.insert(index);
        } else {
            set.remove(&index);
        }
    }

    /// As NVML: refused where [`mig::check_placement`] refuses; the GPU instance gets the lowest ID not in use.
    fn create_mig_device(&self, index: u32, profile: &Profile, start: u32) -> Result<MigDevice, MigControlError> {
        let mut gpus = self.gpus();
        let position = placeable(&gpus, index, profile, start)?;
        let gpu = &mut gpus[position];
        let model = MODELS.iter().find(|m| m.product == gpu.product_name).map_or(0, |m| m.sms_per_slice);
        let gpu_instance = (1..).find(|id| gpu.mig_devices.iter().all(|m| m.gpu_instance != *id)).unwrap_or(1);
        let mut made = simulated_mig_device(&self.node, gpu, model, profile, start, gpu_instance);
        let serial = self.made.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (node, seed) = (&self.node, self.made.0);
        made.uuid = mig_uuid(mixed_hash(&format!("{node}/{index}/mig/{start}/{}/made/{seed}/{serial}", profile.id)));
        gpu.mig_devices.push(made.clone());
        gpu.mig_devices.sort_by_key(|m| (m.placement_start, m.compute_instance));
        self.keep(&gpus);
        drop(gpus);
        while self.made_hung_marker.as_deref().is_some_and(std::path::Path::exists) {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Ok(made)
    }

    fn destroy_mig_device(&self, index: u32, gpu_instance: u32, compute_instance: u32) -> Result<(), MigControlError> {
        let mut gpus = self.gpus();
        let gpu = gpus.iter_mut().find(|g| g.index == index).ok_or(MigControlError::NoGpu { index })?;
        let before = gpu.mig_devices.len();
        gpu.mig_devices.retain(|m| (m.gpu_instance, m.compute_instance) != (gpu_instance, compute_instance));
        if gpu.mig_devices.len() == before {
            return Err(MigControlError::NotFound { uuid: gpu.uuid.clone(), gpu_instance, compute_instance });
        }
        self.keep(&gpus);
        Ok(())
    }
}

impl Simulated {
    /// Writes the MIG layouts of `gpus` to the kept file, if any (a failure is a warning: only a restart loses them).
    fn keep(&self, gpus: &[Gpu]) {
        let Some(kept) = &self.kept else { return };
        let layouts: Layouts = gpus
            .iter()
            .filter(|g| g.mig_enabled)
            .map(|g| {
                let devices = g
                    .mig_devices
                    .iter()
                    .map(|m| (m.profile_id, m.placement_start, m.gpu_instance, m.uuid.clone()))
                    .collect();
                (g.index.to_string(), devices)
            })
            .collect();
        let text = serde_json::json!({"spec": kept.spec, "boot": kept.boot, "gpus": layouts}).to_string();
        if let Err(e) = crate::fsutil::write_atomic(&kept.path, text.as_bytes()) {
            tracing::warn!(path = %kept.path.display(), error = %e, "keeping the simulated MIG devices failed");
        }
    }
}

impl KeptLayouts {
    /// The layouts by GPU index, when the file is this spec's and this boot's.
    fn read(&self) -> Option<Layouts> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        let parsed: Result<serde_json::Value, _> = serde_json::from_str(&text);
        let value = match parsed {
            Ok(value) => value,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "unreadable simulated MIG devices; ignored");
                return None;
            }
        };
        if value["spec"] != self.spec.as_str() || value["boot"] != self.boot.as_str() {
            return None;
        }
        serde_json::from_value(value["gpus"].clone()).ok()
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
        pcie_root: None,
        numa_node: None,
        memory_bytes: model.memory_mib << 20,
        mig_enabled: false,
        mig_devices: Vec::new(),
    }
}

/// `3g.40gb+1g.10gb+me+1g.10gb` → the profiles, `+` separating them except before `me` (the media-engine profiles).
fn profile_names(text: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for piece in text.split('+').map(str::trim).filter(|p| !p.is_empty()) {
        match names.last_mut() {
            Some(last) if piece.eq_ignore_ascii_case("me") => last.push_str("+me"),
            _ => names.push(piece.to_string()),
        }
    }
    names
}

/// The MIG devices of a simulated GPU laid out with `profiles`: one GPU instance per profile (IDs from 1 in placement
/// order), each with one compute instance (ID 0) using all of it, UUIDs stable per node, GPU and placement.
fn simulated_mig_devices(
    node: &str,
    gpu: &Gpu,
    model: &Model,
    profiles: &[&str],
) -> Result<Vec<MigDevice>, LayoutError> {
    let placed = mig::layout(gpu, profiles)?;
    Ok(placed
        .into_iter()
        .zip(1..)
        .map(|((profile, start), gpu_instance)| {
            simulated_mig_device(node, gpu, model.sms_per_slice, &profile, start, gpu_instance)
        })
        .collect())
}

/// A MIG device of `profile` at memory slice `start` of `gpu`, GPU instance `gpu_instance` with compute instance 0
/// spanning it; its UUID stable per node, GPU, placement and profile.
fn simulated_mig_device(
    node: &str,
    gpu: &Gpu,
    sms_per_slice: u32,
    profile: &Profile,
    start: u32,
    gpu_instance: u32,
) -> MigDevice {
    let h = mixed_hash(&format!("{node}/{}/mig/{start}/{}", gpu.index, profile.id));
    let (gi_cap_minor, ci_cap_minor) = mig::cap_minors(gpu.minor, gpu_instance, 0);
    MigDevice {
        uuid: mig_uuid(h),
        profile: profile.name.to_string(),
        profile_id: profile.id,
        gpu_instance,
        compute_instance: 0,
        placement_start: start,
        placement_size: profile.memory_slices,
        memory_bytes: mig::memory_bytes(gpu, profile),
        multiprocessors: sms_per_slice * profile.compute_slices,
        gi_cap_minor,
        ci_cap_minor,
        caps_major: Some(mig::SIMULATED_CAPS_MAJOR),
    }
}

/// A `MIG-…` UUID from a hash.
fn mig_uuid(h: u64) -> String {
    format!(
        "MIG-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        h & 0xffff,
        (h >> 40) & 0xffff,
        h & 0xffff_ffff_ffff
    )
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
    fn mig_devices_are_made_and_destroyed_as_nvml_allows() {
        let simulated = Simulated::new("node-a", "1xH100-80GB/mig=3g.40gb,1xH100-80GB").expect("spec");
        let gpus = simulated.discover().expect("discover");
        let profile = |name: &str| mig::profiles(&gpus[0]).and_then(|p| p.into_iter().find(|p| p.name == name));
        let (Some(one), Some(three)) = (profile("1g.10gb"), profile("3g.40gb")) else { panic!("H100 profiles") };
        let made = simulated.create_mig_device(0, &one, 4).expect("room on slice 4");
        assert_eq!((made.gpu_instance, made.placement_start, made.multiprocessors), (2, 4, 16));
        let listed: Vec<u32> =
            simulated.discover().expect("discover")[0].mig_devices.iter().map(|m| m.gpu_instance).collect();
        assert_eq!(listed, [1, 2]);
        let refused = |index: u32, profile: &Profile, start: u32| {
            simulated.create_mig_device(index, profile, start).map(|m| m.uuid).map_err(|e| e.to_string())
        };
        assert!(refused(0, &three, 4).is_err_and(|e| e.contains("overlaps MIG device") && e.contains(&made.uuid)));
        assert!(refused(1, &one, 0).is_err_and(|e| e.contains("is not in MIG mode")), "GPU 1 is whole");
        assert!(refused(7, &one, 0).is_err_and(|e| e.contains("no GPU of index 7")));
        simulated.destroy_mig_device(0, 2, 0).expect("destroy");
        let again = simulated.destroy_mig_device(0, 2, 0).map_err(|e| e.to_string());
        assert!(again.is_err_and(|e| e.contains("no MIG device of GPU instance 2 and compute instance 0")));
        assert_eq!(simulated.discover().expect("discover")[0].mig_devices.len(), 1, "the spec's 3g.40gb stays");
        let remade = simulated.create_mig_device(0, &three, 4).expect("room for a second 3g");
        assert_eq!(remade.gpu_instance, 2, "the lowest free instance ID");
        simulated.destroy_mig_device(0, 2, 0).expect("destroy");
        let again = simulated.create_mig_device(0, &three, 4).expect("room again");
        assert_ne!(again.uuid, remade.uuid, "as NVML's, a made MIG device's UUID is its own");
    }

    #[test]
    fn made_mig_devices_outlive_a_restart_but_not_a_reboot() {
        let dir = tempfile::tempdir().expect("temp dir");
        let spec = "1xH100-80GB/mig=1g.10gb";
        let first = Simulated::keeping_mig_devices("node-a", spec, dir.path(), "boot-1").expect("spec");
        let gpus = first.discover().expect("discover");
        let profile = mig::profiles(&gpus[0]).and_then(|p| p.into_iter().find(|p| p.name == "3g.40gb"));
        let made = first.create_mig_device(0, &profile.expect("3g.40gb"), 4).expect("room at 4");
        let layout = |s: &Simulated| s.discover().expect("discover")[0].mig_devices.clone();
        let restarted = Simulated::keeping_mig_devices("node-a", spec, dir.path(), "boot-1").expect("spec");
        assert_eq!(layout(&restarted), layout(&first), "a restarted agent finds the MIG device it made");
        assert!(layout(&restarted).iter().any(|m| m.uuid == made.uuid));
        let rebooted = Simulated::keeping_mig_devices("node-a", spec, dir.path(), "boot-2").expect("spec");
        assert_eq!(layout(&rebooted).len(), 1, "a reboot finds the spec's layout");
        let other = Simulated::keeping_mig_devices("node-a", "1xH100-80GB/mig=", dir.path(), "boot-1").expect("spec");
        assert!(layout(&other).is_empty(), "another spec's file is not this one's");
        restarted.destroy_mig_device(0, made.gpu_instance, 0).expect("destroy");
        let again = Simulated::keeping_mig_devices("node-a", spec, dir.path(), "boot-1").expect("spec");
        assert_eq!(layout(&again).len(), 1, "destroyed, it stays gone");
        std::fs::write(dir.path().join(SIMULATED_MIG_FILE), "{").expect("write");
        let garbled = Simulated::keeping_mig_devices("node-a", spec, dir.path(), "boot-1").expect("spec");
        assert_eq!(layout(&garbled).len(), 1, "an unreadable file is ignored");
    }

    #[test]
    fn parses_specs() {
        let gpus = Simulated::new("node-a", "2xA100-40GB, 2xh100-80gb").expect("spec").discover().expect("discover");
        assert_eq!(gpus.len(), 4);
        assert_eq!(gpus[0].product_name, "NVIDIA A100-SXM4-40GB");
        assert_eq!(gpus[3].product_name, "NVIDIA H100 80GB HBM3");
        assert_eq!(gpus[3].memory_bytes, 81_559 << 20, "what NVML reports for an H100 80GB, not 80Gi");
        assert_eq!(gpus.iter().map(Gpu::device_name).collect::<Vec<_>>(), ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    }

    #[test]
    fn a_lost_gpu_is_counted_but_unreadable_and_the_others_keep_their_identity() {
        let whole = Simulated::new("node-a", "4xH100-80GB").expect("spec").discover().expect("discover");
        let found = Simulated::new("node-a", "2xH100-80GB,1xH100-80GB/lost,1xH100-80GB")
            .expect("spec")
            .discover_all()
            .expect("discover");
        assert_eq!(found.gpus.iter().map(|g| g.index).collect::<Vec<_>>(), [0, 1, 3]);
        assert_eq!(found.gpus, [whole[0].clone(), whole[1].clone(), whole[3].clone()], "same UUIDs, same everything");
        assert_eq!(found.unreadable.len(), 1);
        assert_eq!(found.unreadable[0].index, 2);
        assert!(found.unreadable[0].reason.contains("device 2"), "{}", found.unreadable[0].reason);
    }

    #[test]
    fn uuids_are_stable_per_node_and_index_and_distinct() {
        let a = Simulated::new("node-a", "4xH100-80GB").expect("spec").discover().expect("discover");
        let again = Simulated::new("node-a", "4xH100-80GB").expect("spec").discover().expect("discover");
        let b = Simulated::new("node-b", "4xH100-80GB").expect("spec").discover().expect("discover");
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
        let no_mig = Simulated::new("n", "1xL4-24GB/mig=1g.10gb").expect_err("L4 has no MIG").to_string();
        assert!(no_mig.contains("\"1xL4-24GB/mig=1g.10gb\"") && no_mig.contains("no documented MIG"), "{no_mig}");
        let too_many = Simulated::new("n", "1xH100-80GB/mig=4g.40gb+4g.40gb").expect_err("does not fit").to_string();
        assert!(too_many.contains("do not fit on one NVIDIA H100 80GB HBM3"), "{too_many}");
    }

    #[test]
    fn mig_gpus_carry_their_mig_devices() {
        let gpus = Simulated::new("node-a", "1xH100-80GB/mig=1g.10gb+3g.40gb, 1xA100-40GB/mig=, 1xH100-80GB")
            .expect("spec")
            .discover()
            .expect("discover");
        assert!(gpus[0].mig_enabled && gpus[1].mig_enabled && !gpus[2].mig_enabled);
        assert!(gpus[1].mig_devices.is_empty() && gpus[2].mig_devices.is_empty());
        let migs = &gpus[0].mig_devices;
        let summary: Vec<_> = migs
            .iter()
            .map(|m| (m.profile.as_str(), m.profile_id, m.gpu_instance, m.placement_start, m.placement_size))
            .collect();
        assert_eq!(summary, [("3g.40gb", 9, 1, 0, 4), ("1g.10gb", 19, 2, 4, 1)]);
        assert_eq!((migs[0].memory_bytes, migs[0].multiprocessors), (40_779 << 20, 48), "4 of 8 memory slices");
        assert!(migs.iter().all(|m| m.uuid.len() == 40 && m.uuid.starts_with("MIG-")), "{migs:?}");
        assert_ne!(migs[0].uuid, migs[1].uuid);
        let again =
            Simulated::new("node-a", "1xH100-80GB/mig=3g.40gb+1g.10gb").expect("spec").discover().expect("discover");
        assert_eq!(again[0].mig_devices, *migs, "the same layout gives the same devices");
        assert_eq!(profile_names("3g.40gb+1g.10gb+me+ 1g.10gb+"), ["3g.40gb", "1g.10gb+me", "1g.10gb"]);
        let media = Simulated::new("n", "1xA100-40GB/mig=1g.5gb+me+2g.10gb")
            .expect("a +me profile")
            .discover()
            .expect("discover");
        let profiles: Vec<&str> = media[0].mig_devices.iter().map(|m| m.profile.as_str()).collect();
        assert_eq!(profiles, ["2g.10gb", "1g.5gb+me"]);
    }
}
