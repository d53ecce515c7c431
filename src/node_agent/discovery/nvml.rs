//! NVML discovery (`nvml-wrapper`; `libnvidia-ml.so.1` is loaded at run time, so the binary runs — and reports
//! clearly — on nodes without a driver).

use std::ffi::OsString;
use std::path::Path;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;

use super::{Discovered, Discovery, DiscoveryError, MigControlError, Unreadable, placeable};
use crate::node_agent::gpu::{Gpu, MigDevice, cuda_version_from_int, normalize_pci_bus_id};
use crate::node_agent::mig::Profile;

/// NVML discovery. The library is looked for and loaded on every discovery, so a driver installed after the agent
/// started (the GPU Operator's driver container mounting its root minutes later) is found on the next retry.
#[derive(Debug, Clone)]
pub struct NvmlDiscovery {
    driver_root: std::path::PathBuf,
    /// Where each GPU's PCIe root and NUMA node are read ([`Gpu::locate_in`]).
    sysfs: std::path::PathBuf,
}

impl NvmlDiscovery {
    pub fn new(driver_root: &Path, sysfs: &Path) -> Self {
        Self { driver_root: driver_root.to_path_buf(), sysfs: sysfs.to_path_buf() }
    }

    /// The NVML library this discovery loads now (the health monitor loads the same).
    pub fn library(&self) -> OsString {
        library_in(&self.driver_root)
    }
}

/// `libnvidia-ml.so.1` under `driver_root` (GPU Operator and similar put the driver there; a symlink is followed
/// inside it), else the bare name, for the dynamic loader to search.
pub fn library_in(driver_root: &Path) -> OsString {
    let candidates = ["usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib/aarch64-linux-gnu", "usr/lib", "lib64"];
    candidates
        .iter()
        .find_map(|dir| crate::cdi::existing_in_root(driver_root, &Path::new(dir).join("libnvidia-ml.so.1")))
        .map_or_else(|| OsString::from("libnvidia-ml.so.1"), |p| p.into_os_string())
}

fn query<T>(what: &str, result: Result<T, NvmlError>) -> Result<T, DiscoveryError> {
    result.map_err(|source| DiscoveryError::Nvml { what: what.to_string(), source })
}

impl NvmlDiscovery {
    fn init(&self) -> Result<Nvml, DiscoveryError> {
        let library = self.library();
        // Say where it was looked for: a wrong --driver-root falls back to the loader's own search.
        let shown = match Path::new(&library).is_absolute() {
            true => library.to_string_lossy().into_owned(),
            false => format!(
                "{}, not under --driver-root {}, so from the loader's default paths",
                library.to_string_lossy(),
                self.driver_root.display()
            ),
        };
        Nvml::builder()
            .lib_path(&library)
            .init()
            .map_err(|source| DiscoveryError::NvmlUnavailable { library: shown, source })
    }
}

impl Discovery for NvmlDiscovery {
    fn discover_all(&self) -> Result<Discovered, DiscoveryError> {
        let nvml = self.init()?;
        let driver_version = query("the driver version", nvml.sys_driver_version())?;
        let cuda_driver_version =
            cuda_version_from_int(query("the CUDA driver version", nvml.sys_cuda_driver_version())?);
        let count = query("the device count", nvml.device_count())?;
        let mut found = Discovered { gpus: Vec::with_capacity(count as usize), unreadable: Vec::new() };
        for index in 0..count {
            match read_gpu(&nvml, index, &driver_version, &cuda_driver_version) {
                Ok(mut gpu) => {
                    gpu.locate_in(&self.sysfs);
                    found.gpus.push(gpu);
                }
                // A GPU fallen off the bus answers "GPU is lost" to its handle or its first query: it alone is out.
                // Any other failure fails the discovery, as before: a GPU read wrong is worse than a round retried.
                Err(err @ DiscoveryError::Nvml { source: NvmlError::GpuLost, .. }) => {
                    found.unreadable.push(Unreadable { index, reason: err.to_string() });
                }
                Err(err) => return Err(err),
            }
        }
        Ok(found)
    }

    fn create_mig_device(&self, index: u32, profile: &Profile, start: u32) -> Result<MigDevice, MigControlError> {
        let gpus = self.discover()?;
        let gpu = &gpus[placeable(&gpus, index, profile, start)?];
        let nvml = self.init()?;
        let device = query(&format!("device {index}"), nvml.device_by_index(index))?;
        let nvml_error = |(what, source): (&str, NvmlError)| MigControlError::Nvml {
            what: format!("{what} ({} at memory slice {start})", profile.name),
            uuid: gpu.uuid.clone(),
            source,
        };
        let (gpu_instance, compute_instance) =
            super::nvml_mig::create_instance(&nvml, &device, profile, start).map_err(nvml_error)?;
        let made = super::nvml_mig::mig_devices(&nvml, &device, gpu).map_err(MigControlError::from).and_then(|found| {
            found
                .into_iter()
                .find(|m| (m.gpu_instance, m.compute_instance) == (gpu_instance, compute_instance))
                .ok_or_else(|| MigControlError::NotFound { uuid: gpu.uuid.clone(), gpu_instance, compute_instance })
        });
        if made.is_err() {
            // Made but not found as a MIG device: undone, or nobody would ever know it was this agent's.
            if let Err((what, e)) = super::nvml_mig::destroy_instance(&nvml, &device, gpu_instance, compute_instance) {
                tracing::warn!(gpu = %gpu.uuid, gpu_instance, compute_instance, error = %e, step = what,
                    "destroying a MIG device that was made but could not be read back failed");
            }
        }
        made
    }

    fn destroy_mig_device(&self, index: u32, gpu_instance: u32, compute_instance: u32) -> Result<(), MigControlError> {
        let nvml = self.init()?;
        let device = query(&format!("device {index}"), nvml.device_by_index(index))?;
        let uuid = query("the UUID", device.uuid())?;
        super::nvml_mig::destroy_instance(&nvml, &device, gpu_instance, compute_instance).map_err(|(what, source)| {
            match source {
                NvmlError::NotFound => MigControlError::NotFound { uuid, gpu_instance, compute_instance },
                source => MigControlError::Nvml { what: what.to_string(), uuid, source },
            }
        })
    }
}

/// GPU `index` as NVML reports it: any query that fails fails the GPU (not the node).
fn read_gpu(nvml: &Nvml, index: u32, driver_version: &str, cuda_driver_version: &str) -> Result<Gpu, DiscoveryError> {
    let device = query(&format!("device {index}"), nvml.device_by_index(index))?;
    let cc = query("the compute capability", device.cuda_compute_capability())?;
    // Not every GPU supports MIG; "not supported" means MIG is off.
    let mig_enabled = match device.mig_mode() {
        Ok(mode) => mode.current == 1,
        Err(NvmlError::NotSupported) => false,
        Err(source) => return Err(DiscoveryError::Nvml { what: "the MIG mode".into(), source }),
    };
    let minor = query("the minor number", device.minor_number())?;
    let mut gpu = Gpu {
        index,
        minor,
        uuid: query("the UUID", device.uuid())?,
        product_name: query("the product name", device.name())?,
        brand: known_or_unknown(query("the brand", device.brand().map(brand_name)))?.into(),
        architecture: known_or_unknown(query("the architecture", device.architecture().map(architecture_name)))?.into(),
        cuda_compute_capability: format!("{}.{}", cc.major, cc.minor),
        driver_version: driver_version.to_string(),
        cuda_driver_version: cuda_driver_version.to_string(),
        pci_bus_id: normalize_pci_bus_id(&query("the PCI bus id", device.pci_info())?.bus_id),
        pcie_root: None,
        numa_node: None,
        memory_bytes: query("the memory size", device.memory_info())?.total,
        mig_enabled,
        mig_devices: Vec::new(),
    };
    if mig_enabled {
        gpu.mig_devices = super::nvml_mig::mig_devices(nvml, &device, &gpu)?;
    }
    Ok(gpu)
}

/// One GPU instance profile as NVML reports it for a GPU, with its possible placements (start, size).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlProfile {
    pub nvml_id: u32,
    /// The profile ID (`nvmlGpuInstanceProfileInfo_t.id`).
    pub id: u32,
    pub slice_count: u32,
    pub instance_count: u32,
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub placements: Vec<(u32, u32)>,
}

impl NvmlDiscovery {
    /// The GPU instance profiles NVML offers on GPU `index` (NVML answers only with MIG mode on; a profile the GPU
    /// does not have is skipped).
    pub fn gpu_instance_profiles(&self, index: u32) -> Result<Vec<NvmlProfile>, DiscoveryError> {
        let nvml = self.init()?;
        let device = query(&format!("device {index}"), nvml.device_by_index(index))?;
        let mut found = Vec::new();
        for id in 0..nvml_wrapper_sys::bindings::NVML_GPU_INSTANCE_PROFILE_COUNT {
            let info = match device.profile_info(id) {
                Ok(info) => info,
                Err(NvmlError::NotSupported | NvmlError::InvalidArg) => continue,
                Err(source) => return Err(DiscoveryError::Nvml { what: format!("MIG profile {id}"), source }),
            };
            found.push(NvmlProfile {
                nvml_id: id,
                id: info.id,
                slice_count: info.slice_count,
                instance_count: info.instance_count,
                memory_mib: info.memory_size_mb,
                multiprocessors: info.multiprocessor_count,
                placements: query("the MIG placements", super::nvml_mig::placements(&nvml, &device, info.id))?,
            });
        }
        Ok(found)
    }
}

/// An informational name NVML gave a value this nvml-wrapper does not know (a newer architecture or brand):
/// "Unknown", rather than the GPU left out for it.
fn known_or_unknown(name: Result<&'static str, DiscoveryError>) -> Result<&'static str, DiscoveryError> {
    match name {
        Err(DiscoveryError::Nvml { source: NvmlError::UnexpectedVariant(_), .. }) => Ok("Unknown"),
        other => other,
    }
}

/// The `architecture` attribute as NVIDIA's driver publishes it (go-nvlib's names, e.g. "Ada Lovelace"), so that
/// selectors written for it keep working; nvml-wrapper's own names differ ("Ada").
fn architecture_name(architecture: DeviceArchitecture) -> &'static str {
    match architecture {
        DeviceArchitecture::Kepler => "Kepler",
        DeviceArchitecture::Maxwell => "Maxwell",
        DeviceArchitecture::Pascal => "Pascal",
        DeviceArchitecture::Volta => "Volta",
        DeviceArchitecture::Turing => "Turing",
        DeviceArchitecture::Ampere => "Ampere",
        DeviceArchitecture::Ada => "Ada Lovelace",
        DeviceArchitecture::Hopper => "Hopper",
        DeviceArchitecture::Blackwell => "Blackwell",
        DeviceArchitecture::Unknown => "Unknown",
    }
}

/// The `brand` attribute as NVIDIA's driver publishes it (go-nvlib's names, e.g. "Grid", "NvidiaVWS");
/// nvml-wrapper's variant names differ for the vGPU brands ("GRID", "VWS").
fn brand_name(brand: Brand) -> &'static str {
    match brand {
        Brand::Unknown => "Unknown",
        Brand::Quadro => "Quadro",
        Brand::Tesla => "Tesla",
        Brand::NVS => "NVS",
        Brand::GRID => "Grid",
        Brand::GeForce => "GeForce",
        Brand::Titan => "Titan",
        Brand::VApps => "NvidiaVApps",
        Brand::VPC => "NvidiaVPC",
        Brand::VCS => "NvidiaVCS",
        Brand::VWS => "NvidiaVWS",
        // The same NVML value under its old name.
        Brand::CloudGaming | Brand::VGaming => "NvidiaCloudGaming",
        Brand::QuadroRTX => "QuadroRTX",
        Brand::NvidiaRTX => "NvidiaRTX",
        Brand::Nvidia => "Nvidia",
        Brand::GeForceRTX => "GeForceRTX",
        Brand::TitanRTX => "TitanRTX",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVIDIA's driver's names, which existing selectors compare with; nvml-wrapper's Display and Debug give "Ada",
    /// "GRID", "VWS".
    #[test]
    fn architectures_and_brands_have_nvidias_names() {
        assert_eq!(architecture_name(DeviceArchitecture::Ada), "Ada Lovelace");
        assert_eq!(architecture_name(DeviceArchitecture::Hopper), "Hopper");
        assert_eq!(architecture_name(DeviceArchitecture::Blackwell), "Blackwell");
        let brands = [(Brand::GRID, "Grid"), (Brand::VWS, "NvidiaVWS"), (Brand::VGaming, "NvidiaCloudGaming")];
        for (brand, name) in brands {
            assert_eq!(brand_name(brand), name);
        }
        assert_eq!(brand_name(Brand::Tesla), "Tesla");
        // A value newer than nvml-wrapper knows: the GPU is kept, named "Unknown".
        let newer = query::<&str>("the architecture", Err(NvmlError::UnexpectedVariant(99)));
        assert_eq!(known_or_unknown(newer).ok(), Some("Unknown"));
        assert!(known_or_unknown(query::<&str>("the brand", Err(NvmlError::GpuLost))).is_err());
    }

    /// A host whose `libnvidia-ml.so.1` is an absolute symlink (Debian's alternatives), mounted at a driver root:
    /// the link dangles here, and is followed inside the root instead.
    #[test]
    fn the_library_behind_an_absolute_symlink_is_found_inside_the_driver_root() {
        let root = tempfile::tempdir().expect("tempdir");
        let real = root.path().join("usr/lib/x86_64-linux-gnu/nvidia/current");
        std::fs::create_dir_all(&real).expect("mkdir");
        std::fs::write(real.join("libnvidia-ml.so.580.95.05"), b"").expect("write");
        std::os::unix::fs::symlink("libnvidia-ml.so.580.95.05", real.join("libnvidia-ml.so.1")).expect("link");
        let alternatives = root.path().join("etc/alternatives");
        std::fs::create_dir_all(&alternatives).expect("mkdir");
        let alternative = alternatives.join("nvidia--libnvidia-ml.so.1-x86_64-linux-gnu");
        std::os::unix::fs::symlink("/usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.1", &alternative)
            .expect("link");
        let lib = root.path().join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
        std::os::unix::fs::symlink("/etc/alternatives/nvidia--libnvidia-ml.so.1-x86_64-linux-gnu", &lib).expect("link");
        assert!(!lib.exists(), "the link dangles outside the root");

        let discovery = NvmlDiscovery::new(root.path(), Path::new("/sys"));
        let found = std::path::PathBuf::from(discovery.library());
        assert_eq!(found, real.join("libnvidia-ml.so.580.95.05"), "{}", found.display());
    }

    #[test]
    fn without_the_library_in_the_driver_root_the_loader_searches_until_it_is_there() {
        let root = tempfile::tempdir().expect("tempdir");
        let discovery = NvmlDiscovery::new(root.path(), Path::new("/sys"));
        assert_eq!(discovery.library(), "libnvidia-ml.so.1");
        // The driver appears under the root later (a driver container's mount): the next look finds it.
        let lib = root.path().join("usr/lib64/libnvidia-ml.so.1");
        std::fs::create_dir_all(root.path().join("usr/lib64")).expect("dir");
        std::fs::write(&lib, "").expect("library");
        assert_eq!(discovery.library(), lib.as_os_str());
    }
}
