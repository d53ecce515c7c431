//! What the agent knows about one GPU, whichever backend found it, and the normalisation of what drivers report.

/// One physical GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// NVML index (enumeration order; may change across reboots).
    pub index: u32,
    /// Device minor number: `/dev/nvidia<minor>`; the device is published as `gpu-<minor>`.
    pub minor: u32,
    pub uuid: String,
    pub product_name: String,
    pub brand: String,
    pub architecture: String,
    /// `major.minor`, e.g. `9.0`.
    pub cuda_compute_capability: String,
    /// As the driver reports it, e.g. `550.54.15`.
    pub driver_version: String,
    /// e.g. `12.4`.
    pub cuda_driver_version: String,
    /// `0000:3b:00.0` (lower case, domain included).
    pub pci_bus_id: String,
    /// The PCIe root complex the GPU sits under (`pci0000:3a`), as sysfs shows it ([`pcie_root`]); `None` when
    /// sysfs does not show the device.
    pub pcie_root: Option<String>,
    /// The NUMA node the GPU is attached to, as sysfs shows it ([`numa_node`]); `None` when sysfs does not show one
    /// (no NUMA affinity, or no sysfs).
    pub numa_node: Option<i64>,
    pub memory_bytes: u64,
    /// MIG mode is on: the GPU is published as its MIG devices, never whole (CUDA cannot use a GPU in MIG mode
    /// whole).
    pub mig_enabled: bool,
    /// The MIG devices that exist on it (MIG mode on), in placement order.
    pub mig_devices: Vec<MigDevice>,
}

/// One MIG device that exists on a GPU in MIG mode: a GPU instance with one compute instance using all of it (the
/// static layout an administrator made with `nvidia-smi mig -cgi … -C`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigDevice {
    /// `MIG-<uuid>`.
    pub uuid: String,
    /// NVIDIA's profile name, e.g. `1g.10gb`.
    pub profile: String,
    /// NVML's GPU instance profile ID (`NVML_GPU_INSTANCE_PROFILE_*`).
    pub profile_id: u32,
    pub gpu_instance: u32,
    pub compute_instance: u32,
    /// First memory slice and number of memory slices the GPU instance spans.
    pub placement_start: u32,
    pub placement_size: u32,
    pub memory_bytes: u64,
    pub multiprocessors: u32,
    /// The `nvidia-caps` minors of the GPU instance's and the compute instance's access capabilities: a container
    /// sees the MIG device only through `/dev/nvidia-caps/nvidia-cap<minor>` nodes for both.
    pub gi_cap_minor: u32,
    pub ci_cap_minor: u32,
    /// `nvidia-caps`' character-device major (`/proc/devices`; assigned when the driver loads). Known, the CDI spec
    /// describes the capability nodes fully and the runtime creates them in the container, whether or not
    /// `nvidia-modprobe` made them on the host (not in a user-namespaced pod: there runc mounts the host's).
    pub caps_major: Option<u32>,
}

impl Gpu {
    /// Reads where the GPU sits from `sysfs`: its PCIe root ([`pcie_root`]) and NUMA node ([`numa_node`]).
    pub fn locate_in(&mut self, sysfs: &std::path::Path) {
        self.pcie_root = pcie_root(sysfs, &self.pci_bus_id);
        self.numa_node = numa_node(sysfs, &self.pci_bus_id);
    }

    /// The ResourceSlice device name.
    pub fn device_name(&self) -> String {
        format!("gpu-{}", self.minor)
    }
}

/// A GPU as discovery reports it, for unit tests anywhere in the crate.
#[cfg(test)]
pub(crate) fn test_gpu(minor: u32, bus: &str) -> Gpu {
    Gpu {
        index: minor,
        minor,
        uuid: format!("GPU-{minor:08x}-0000-0000-0000-000000000000"),
        product_name: "NVIDIA H100 80GB HBM3".into(),
        brand: "Nvidia".into(),
        architecture: "Hopper".into(),
        cuda_compute_capability: "9.0".into(),
        driver_version: "550.54.15".into(),
        cuda_driver_version: "12.4".into(),
        pci_bus_id: bus.into(),
        pcie_root: None,
        numa_node: None,
        memory_bytes: 80 << 30,
        mig_enabled: false,
        mig_devices: Vec::new(),
    }
}

/// Turns a driver's version string into a semantic version the API server accepts: numeric parts without
/// leading zeros, padded to three (`535.104.05` → `535.104.5`, `12.4` → `12.4.0`), anything after the numbers
/// dropped (`550.54.15-custom` → `550.54.15`). NVIDIA's own driver publishes the raw string, and one odd version
/// gets its whole ResourceSlice rejected. `None` when there is no leading number at all.
pub fn normalize_version(raw: &str) -> Option<String> {
    let mut parts: Vec<u64> = Vec::with_capacity(3);
    for piece in raw.trim().trim_start_matches(['v', 'V']).split('.') {
        let digits: String = piece.chars().take_while(char::is_ascii_digit).collect();
        let Ok(n) = digits.parse::<u64>() else { break };
        parts.push(n);
        if parts.len() == 3 || digits.len() != piece.len() {
            break;
        }
    }
    if parts.is_empty() {
        return None;
    }
    parts.resize(3, 0);
    Some(format!("{}.{}.{}", parts[0], parts[1], parts[2]))
}

/// `12040` (NVML's CUDA driver version) → `12.4`.
pub fn cuda_version_from_int(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The PCIe root complex of the PCI device `bus_id` (`0000:3b:00.0`), for the standard
/// `resource.kubernetes.io/pcieRoot` attribute, read as Kubernetes' own helper reads it (k8s.io/dynamic-resource-
/// allocation `deviceattribute.GetPCIeRootAttributeByPCIBusID`), so that it equals what other drivers publish for
/// a NIC under the same root (a `matchAttribute` constraint pairs them): `<sysfs>/bus/pci/devices/<bus_id>` links to
/// `../../../devices/pci0000:3a/0000:3a:02.0/0000:3b:00.0`, whose first element under `devices` is the root.
/// `None` when the link is missing or not of that shape (then the attribute is left out: a wrong root would pair
/// devices that are not together).
pub fn pcie_root(sysfs: &std::path::Path, bus_id: &str) -> Option<String> {
    let target = std::fs::read_link(pci_device(sysfs, bus_id)?).ok()?;
    pcie_root_of_link(&target, bus_id)
}

/// `<sysfs>/bus/pci/devices/<bus_id>`, for a standard bus id only (the upstream helpers' check).
fn pci_device(sysfs: &std::path::Path, bus_id: &str) -> Option<std::path::PathBuf> {
    is_standard_bdf(bus_id).then(|| sysfs.join("bus/pci/devices").join(bus_id))
}

/// The NUMA node of the PCI device `bus_id`, for the standard `resource.kubernetes.io/numaNode` attribute, read as
/// Kubernetes' own helper reads it (k8s.io/dynamic-resource-allocation `deviceattribute.
/// GetNUMANodeAttributeByPCIBusID`, scalar form): `<sysfs>/bus/pci/devices/<bus_id>/numa_node`. A `matchAttribute`
/// on it puts a GPU beside the CPUs and memory (another driver's devices) of its own node. `None` for a device
/// with no NUMA affinity (the kernel's `-1`: published, it would match every other such device), a node number
/// the kernel cannot have (1,024 or more), or anything unreadable.
pub fn numa_node(sysfs: &std::path::Path, bus_id: &str) -> Option<i64> {
    let text = std::fs::read_to_string(pci_device(sysfs, bus_id)?.join("numa_node")).ok()?;
    numa_node_of(&text)
}

/// [`numa_node`] from the file's text.
fn numa_node_of(text: &str) -> Option<i64> {
    const MAX_NUMA_NODES: i64 = 1024;
    let node: i64 = text.trim().parse().ok()?;
    (0..MAX_NUMA_NODES).contains(&node).then_some(node)
}

/// [`pcie_root`] from the link's target: relative to `bus/pci/devices`, it must lead into `devices/pci…` of the
/// same sysfs and end at the device itself (the upstream helper's checks).
fn pcie_root_of_link(target: &std::path::Path, bus_id: &str) -> Option<String> {
    use std::path::Component;
    if target.is_absolute() || target.file_name()?.to_str()? != bus_id {
        return None;
    }
    // Lexically, as Go's filepath.Clean(filepath.Join("bus/pci/devices", target)).
    let mut path: Vec<&std::ffi::OsStr> = vec!["bus".as_ref(), "pci".as_ref(), "devices".as_ref()];
    for part in target.components() {
        match part {
            Component::ParentDir => {
                path.pop()?;
            }
            Component::Normal(name) => path.push(name),
            _ => {}
        }
    }
    match path.as_slice() {
        [devices, root, ..] if *devices == "devices" => {
            let root = root.to_str()?;
            (root.starts_with("pci") && root != bus_id).then(|| root.to_string())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_nodes_as_sysfs_writes_them() {
        for (text, expected) in [
            ("0\n", Some(0)),
            ("3", Some(3)),
            ("1023\n", Some(1023)),
            ("-1\n", None),
            ("1024", None),
            ("", None),
            ("node0", None),
        ] {
            assert_eq!(numa_node_of(text), expected, "{text:?}");
        }
    }

    #[test]
    fn versions() {
        let cases = [
            ("535.104.05", Some("535.104.5")),
            ("550.54.15", Some("550.54.15")),
            ("12.4", Some("12.4.0")),
            ("550", Some("550.0.0")),
            ("550.54.15-custom", Some("550.54.15")),
            ("v1.2.3.4", Some("1.2.3")),
            ("470.82.01+grid", Some("470.82.1")),
            ("abc", None),
            ("", None),
        ];
        for (raw, want) in cases {
            assert_eq!(normalize_version(raw).as_deref(), want, "{raw:?}");
        }
        assert_eq!(cuda_version_from_int(12040), "12.4");
        assert_eq!(cuda_version_from_int(11080), "11.8");
        // (link target, bus id) → root
        let table = [
            ("../../../devices/pci0000:3a/0000:3a:02.0/0000:3b:00.0", "0000:3b:00.0", Some("pci0000:3a")),
            ("../../../devices/pci0000:00/0000:00:00.0", "0000:00:00.0", Some("pci0000:00")),
            // Behind a switch: still the root complex, not the switch's ports.
            (
                "../../../devices/pci0000:16/0000:16:02.0/0000:17:00.0/0000:18:00.0/0000:19:00.0",
                "0000:19:00.0",
                Some("pci0000:16"),
            ),
            // Absolute, or not leading to the same sysfs's devices: nothing (as upstream).
            ("/sys/devices/pci0000:5d/0000:5d:00.0/0000:5e:00.0", "0000:5e:00.0", None),
            ("../../devices/pci0000:5d/0000:5e:00.0", "0000:5e:00.0", None),
            // Not a PCI root, or another device's link: nothing.
            ("../../../devices/platform/0000:3b:00.0", "0000:3b:00.0", None),
            ("../../../devices/pci0000:3a/0000:3a:02.0/0000:3c:00.0", "0000:3b:00.0", None),
            ("0000:3b:00.0", "0000:3b:00.0", None),
        ];
        for (target, bus, expected) in table {
            assert_eq!(pcie_root_of_link(std::path::Path::new(target), bus).as_deref(), expected, "{target}");
        }
    }
}

/// FNV-1a, 64 bit: a hash stable across builds and platforms (std's hashers promise neither), for names and
/// content hashes that must not change between agent versions.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// NVML's `00000000:3B:00.0` → the standard `0000:3b:00.0` (lower case, the domain's leading zeros beyond four
/// digits dropped). A domain above `ffff` (Intel VMD's `10000`) keeps all its digits, as sysfs names it: cutting it
/// to four would name another device.
pub fn normalize_pci_bus_id(raw: &str) -> String {
    let lower = raw.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            let digits = domain.trim_start_matches('0');
            format!("{digits:0>4}:{rest}")
        }
        _ => lower,
    }
}

/// Whether `bus_id` is a PCI address as the standard attributes take it: `dddd:bb:dd.f`, lower-case hex (the
/// upstream helper's `verifyPCIBDFFormat`).
fn is_standard_bdf(bus_id: &str) -> bool {
    let bytes = bus_id.as_bytes();
    let hex = |b: &u8| b.is_ascii_digit() || (b'a'..=b'f').contains(b);
    bytes.len() == 12
        && bytes.iter().enumerate().all(|(i, b)| match i {
            4 | 7 => *b == b':',
            10 => *b == b'.',
            _ => hex(b),
        })
}

#[cfg(test)]
mod pci_tests {
    #[test]
    fn pci_bus_ids() {
        assert_eq!(super::normalize_pci_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(super::normalize_pci_bus_id("0000:3b:00.0"), "0000:3b:00.0");
        // Intel VMD's domains: all their digits, never another device's address.
        assert_eq!(super::normalize_pci_bus_id("00010000:01:00.0"), "10000:01:00.0");
        for (bus, standard) in [
            ("0000:3b:00.0", true),
            ("10000:01:00.0", false),
            ("0000:3B:00.0", false),
            ("0000:3b:00", false),
            ("0000:3b:00.0 ", false),
        ] {
            assert_eq!(super::is_standard_bdf(bus), standard, "{bus}");
        }
    }
}
