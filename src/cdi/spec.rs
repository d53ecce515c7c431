//! The CDI spec of one prepared claim: pure, deterministic, and validated before anyone writes it.

use std::path::{Path, PathBuf};

use container_device_interface::specs::config::Spec;
use container_device_interface::{spec::new_spec, version::minimum_required_version};
use serde_json::{Value, json};
use tracing::warn;

use super::{CdiError, CdiKind, DriverFiles, check_claim_uid, check_name, device_name, files::spec_file_name};
use crate::node_agent::device::Device;

/// Driver files are read-only in the container, and nothing mounted from the driver tree may bring set-uid
/// binaries or device files with it.
const MOUNT_OPTIONS: [&str; 4] = ["ro", "nosuid", "nodev", "bind"];

/// A claim's own directories (an MPS daemon's pipes and shared memory) are written by its containers.
const CLAIM_MOUNT_OPTIONS: [&str; 4] = ["rw", "nosuid", "nodev", "bind"];

/// Edits a claim's configuration adds: spec-wide, for every container of the claim (an MPS daemon's pipe directory,
/// shared memory and limits, [`crate::kubelet_plugin::mps`]), `NAME=value` environment and writable bind mounts
/// (host path, container path); and CDI devices of their own that each mount one file read-only, for the
/// containers handed that device only (a request's device metadata, [`crate::kubelet_plugin::device_metadata`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimEdits {
    pub env: Vec<String>,
    pub mounts: Vec<(PathBuf, PathBuf)>,
    pub file_devices: Vec<FileDevice>,
}

/// A CDI device that only mounts one host file read-only into the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileDevice {
    /// The device's name in the claim's spec (not a GPU's `<claimUID>-<device>`).
    pub name: String,
    pub host_path: PathBuf,
    pub container_path: PathBuf,
}

/// Device nodes every CUDA process needs besides its GPUs' own: the control device and unified memory, with the
/// numbers simulated specs give them (see [`device_node`]).
const SHARED_DEVICE_NODES: [(&str, u32, u32); 3] =
    [("/dev/nvidiactl", NVIDIA_MAJOR, 255), ("/dev/nvidia-uvm", UVM_MAJOR, 0), ("/dev/nvidia-uvm-tools", UVM_MAJOR, 1)];

/// Shared nodes a container starts without. CUDA needs `/dev/nvidia-uvm`; `nvidia-smi` and monitoring agents do not,
/// and a freshly booted node has neither until something loads the `nvidia-uvm` module (`nvidia-modprobe -u -c=0`).
/// A spec naming a node the host lacks fails the container's creation ("failed to stat CDI host device"), so a real
/// GPU's spec leaves a missing one out, as NVIDIA's container toolkit does, and the agent warns.
pub const OPTIONAL_DEVICE_NODES: [&str; 2] = ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// The character-device major of `/dev/nvidia<minor>` and `/dev/nvidiactl`, fixed by the NVIDIA driver.
const NVIDIA_MAJOR: u32 = 195;
/// `nvidia-uvm`'s major is assigned at load time; simulated specs use a typical value.
const UVM_MAJOR: u32 = 510;

/// The CDI spec that gives a container the claim's `devices`: one CDI device per device, named
/// [`device_name`]`(claim_uid, <device name>)` — a whole GPU is its `/dev/nvidia<minor>`; a MIG device is its
/// parent's node plus the `/dev/nvidia-caps/nvidia-cap<N>` nodes of its GPU and compute instance (CUDA shows a
/// process exactly the MIG devices whose capabilities it can open) — and spec-wide edits that every container with
/// any of them gets: the shared device nodes, the driver files, and the environment:
///
/// - `NVIDIA_VISIBLE_DEVICES=void`: a node's legacy `nvidia-container-runtime` hook would otherwise inject every
///   GPU of the node into the container as well (the double-allocation problem).
/// - `CUDA_DEVICE_ORDER=PCI_BUS_ID`: CUDA numbers the devices the way `nvidia-smi` and `GPU_DRA_GPU_UUIDS` list them.
/// - `GPU_DRA_GPU_UUIDS`: the UUIDs of the claim's devices (`MIG-…` for MIG devices) by PCI bus id. Spec-wide, so
///   every container using any device of the claim sees all of them, also where each container names one request.
/// - `GPU_DRA_DEVICE_<DEVICE>=<uuid>` per device (`GPU_DRA_DEVICE_GPU_0_MIG_19_2_1`): only in the containers given
///   that device — what a container of a pod whose containers ask different requests of one claim really got (one
///   variable per device, since runtimes keep only the last value of a repeated variable).
///
/// `cdiVersion` is the lowest version that covers the fields used: runtimes refuse versions newer than they know.
/// The output depends only on the input (devices in any order give the same spec) and the driver files as they are
/// now: the only I/O is [`DriverFiles::mounts`]' check that they are still the driver's (a driver upgraded in place
/// is discovered again, so no spec names the removed files of the old version).
pub fn build_claim_spec(
    kind: &CdiKind,
    claim_uid: &str,
    claim_devices: &[Device],
    driver_files: &DriverFiles,
) -> Result<Spec, CdiError> {
    build_claim_spec_with(kind, claim_uid, claim_devices, driver_files, &ClaimEdits::default())
}

/// [`build_claim_spec`] with the claim's own spec-wide `edits` after the driver's.
pub fn build_claim_spec_with(
    kind: &CdiKind,
    claim_uid: &str,
    claim_devices: &[Device],
    driver_files: &DriverFiles,
    edits: &ClaimEdits,
) -> Result<Spec, CdiError> {
    check_claim_uid(claim_uid)?;
    if claim_devices.is_empty() {
        return Err(CdiError::NoGpus { claim_uid: claim_uid.to_string() });
    }
    let mut by_name: Vec<(String, &Device)> = claim_devices.iter().map(|d| (d.name(), d)).collect();
    by_name.sort_by(|(a, x), (b, y)| (x.gpu.minor, a).cmp(&(y.gpu.minor, b)));
    if let Some(pair) = by_name.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        let reason = format!("multiple devices named {}", pair[0].0);
        return Err(CdiError::InvalidSpec {
            claim_uid: claim_uid.to_string(),
            reason: reason.clone(),
            source: reason.into(),
        });
    }
    let mut devices = Vec::with_capacity(by_name.len());
    for (device, claim_device) in &by_name {
        let name = device_name(claim_uid, device);
        check_name("device name", &name, super::DEVICE)?;
        let minor = claim_device.gpu.minor;
        let mut nodes = vec![device_node(&format!("/dev/nvidia{minor}"), NVIDIA_MAJOR, minor, driver_files)];
        if let Some(mig) = &claim_device.mig {
            for cap in [mig.gi_cap_minor, mig.ci_cap_minor] {
                let path = format!("/dev/nvidia-caps/nvidia-cap{cap}");
                // Fully described whenever the major is known: the host may have no such node to read it from
                // (a user-namespaced pod still needs the host's: runc bind-mounts device nodes there).
                nodes.push(match mig.caps_major {
                    Some(major) => json!({ "path": path, "type": "c", "major": major, "minor": cap }),
                    None => json!({ "path": path }),
                });
            }
        }
        let env = format!("{}={}", device_env_name(device), claim_device.uuid());
        devices.push(json!({ "name": name, "containerEdits": { "deviceNodes": nodes, "env": [env] } }));
    }
    for file in &edits.file_devices {
        check_name("device name", &file.name, super::DEVICE)?;
        let mount = mount(claim_uid, &file.host_path, &file.container_path, &MOUNT_OPTIONS)?;
        devices.push(json!({ "name": file.name, "containerEdits": { "mounts": [mount] } }));
    }
    let mut by_bus: Vec<&Device> = claim_devices.iter().collect();
    by_bus.sort_by(|a, b| (&a.gpu.pci_bus_id, a.uuid()).cmp(&(&b.gpu.pci_bus_id, b.uuid())));
    let uuids: Vec<&str> = by_bus.iter().map(|device| device.uuid()).collect();
    let mut env = vec![
        "NVIDIA_VISIBLE_DEVICES=void".to_string(),
        "CUDA_DEVICE_ORDER=PCI_BUS_ID".to_string(),
        format!("GPU_DRA_GPU_UUIDS={}", uuids.join(",")),
    ];
    env.extend(edits.env.iter().cloned());
    let mut spec_edits = json!({
        "env": env,
        "deviceNodes": shared_device_nodes(claim_uid, driver_files),
    });
    let driver_mounts = driver_files.mounts()?;
    let mut mounts = driver_mounts
        .iter()
        .map(|m| mount(claim_uid, m.host_path(), m.container_path(), &MOUNT_OPTIONS))
        .collect::<Result<Vec<_>, _>>()?;
    for (host, container) in &edits.mounts {
        mounts.push(mount(claim_uid, host, container, &CLAIM_MOUNT_OPTIONS)?);
    }
    if !mounts.is_empty() {
        spec_edits["mounts"] = Value::Array(mounts);
    }
    let document = |version: &str| json!({ "cdiVersion": version, "kind": kind.to_string(), "devices": devices, "containerEdits": spec_edits });
    let invalid = |source: anyhow::Error| CdiError::InvalidSpec {
        claim_uid: claim_uid.to_string(),
        reason: format!("{source:#}"),
        source: source.into(),
    };
    // The crate computes the version from the typed spec, so type it once with any version, then with the right one.
    let draft = typed(claim_uid, document(container_device_interface::specs::config::CURRENT_VERSION))?;
    let version = minimum_required_version(&draft).map_err(invalid)?.to_string();
    typed(claim_uid, document(&version))
}

/// The crate's full validation of a spec: the CDI JSON schema (through a YAML round trip), names, version and
/// edits, as a runtime would apply it. Not run on every prepare: it costs more CPU than the rest of building a
/// spec and keeps a few MB of schema and validator code resident in the agent, for a document [`build_claim_spec`]
/// makes from checked names only (typed with `deny_unknown_fields`, so a structural mistake still fails there). The
/// tests and `gpu-dra gpu-check` run it on the specs the builder makes.
pub fn validate_claim_spec(kind: &CdiKind, claim_uid: &str, spec: &Spec) -> Result<(), CdiError> {
    // The path only labels the spec inside the crate.
    let label = PathBuf::from(spec_file_name(kind, claim_uid)?);
    new_spec(spec, &label, 0).map(|_| ()).map_err(|source| CdiError::InvalidSpec {
        claim_uid: claim_uid.to_string(),
        reason: format!("{source:#}"),
        source: source.into(),
    })
}

/// `GPU_DRA_DEVICE_` and the device name in upper case with `_` for `-` (device names are DNS labels).
pub(super) fn device_env_name(device: &str) -> String {
    format!("GPU_DRA_DEVICE_{}", device.to_ascii_uppercase().replace('-', "_"))
}

/// The optional shared device nodes ([`OPTIONAL_DEVICE_NODES`]) the host has now: a claim's spec names those. The
/// specs written before one appeared (a freshly booted node, `nvidia-modprobe -u` run later) lack it, and CUDA fails
/// in their containers at every restart: a change of this set has the specs written again.
pub fn optional_nodes_present(driver_files: &DriverFiles) -> Vec<&'static str> {
    OPTIONAL_DEVICE_NODES.into_iter().filter(|path| driver_files.has_device_node(path)).collect()
}

/// The shared device nodes of a claim's spec: the control device, and those the host has of the optional ones
/// ([`OPTIONAL_DEVICE_NODES`]; simulated GPUs have all unless `--simulated-dev-root` says otherwise).
fn shared_device_nodes(claim_uid: &str, driver_files: &DriverFiles) -> Vec<Value> {
    SHARED_DEVICE_NODES
        .iter()
        .filter(|(path, ..)| {
            let keep = !OPTIONAL_DEVICE_NODES.contains(path) || driver_files.has_device_node(path);
            if !keep {
                warn!(
                    claim_uid,
                    node = path,
                    "the host has no {path}: left out of the claim's CDI spec; CUDA fails in its containers until the \
                     nvidia-uvm module is loaded (nvidia-modprobe -u -c=0 on the node)"
                );
            }
            keep
        })
        .map(|(path, major, minor)| device_node(path, *major, *minor, driver_files))
        .collect()
}

/// A device node. For real GPUs only its path: the runtime reads type and numbers from the host's node, which is
/// always right (minors can change across reboots). Simulated GPUs have no host node, so type and numbers are given.
fn device_node(path: &str, major: u32, minor: u32, driver_files: &DriverFiles) -> Value {
    if driver_files.is_simulated() {
        json!({ "path": path, "type": "c", "major": major, "minor": minor })
    } else {
        json!({ "path": path })
    }
}

/// One read-only bind mount of a driver file.
fn mount(claim_uid: &str, host: &Path, container: &Path, options: &[&str]) -> Result<Value, CdiError> {
    let utf8 = |path: &Path| {
        path.to_str().map(str::to_string).ok_or_else(|| CdiError::InvalidName {
            what: "mount path",
            name: path.display().to_string(),
            reason: format!("it is not UTF-8 (claim {claim_uid})"),
        })
    };
    Ok(json!({ "hostPath": utf8(host)?, "containerPath": utf8(container)?, "options": options }))
}

fn typed(claim_uid: &str, document: Value) -> Result<Spec, CdiError> {
    serde_json::from_value(document).map_err(|source| CdiError::BuildSpec { claim_uid: claim_uid.to_string(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi::device_id;
    use crate::node_agent::gpu::test_gpu;

    fn gpu(minor: u32, bus: &str) -> Device {
        Device::whole(&test_gpu(minor, bus))
    }

    fn to_json(spec: &Spec) -> Value {
        serde_json::to_value(spec).unwrap_or_default()
    }

    #[test]
    fn one_device_per_gpu_and_shared_edits() -> Result<(), Box<dyn std::error::Error>> {
        let kind = CdiKind::from_driver_name("gpu.gpu-dra.dev")?;
        // Minor order and bus order differ: devices follow minors, the UUID list follows bus ids.
        let gpus = [gpu(1, "0000:3b:00.0"), gpu(0, "0000:86:00.0")];
        let built = build_claim_spec(&kind, "abc-1", &gpus, &DriverFiles::simulated())?;
        validate_claim_spec(&kind, "abc-1", &built)?;
        let spec = to_json(&built);
        assert_eq!(spec["kind"], "gpu.gpu-dra.dev/gpu");
        assert_eq!(spec["cdiVersion"], "0.3.0", "nothing here needs more than the oldest supported version");
        assert_eq!(spec["devices"][0]["name"], "abc-1-gpu-0");
        assert_eq!(
            spec["devices"][1]["containerEdits"],
            json!({
                "deviceNodes": [{ "path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1 }],
                "env": ["GPU_DRA_DEVICE_GPU_1=GPU-00000001-0000-0000-0000-000000000000"],
            }),
            "simulated device nodes carry their numbers: the host has none to look at"
        );
        let edits = &spec["containerEdits"];
        assert_eq!(edits["env"][0], "NVIDIA_VISIBLE_DEVICES=void");
        assert_eq!(
            edits["env"][2],
            "GPU_DRA_GPU_UUIDS=GPU-00000001-0000-0000-0000-000000000000,GPU-00000000-0000-0000-0000-000000000000"
        );
        assert_eq!(
            edits["deviceNodes"][0],
            json!({ "path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255 })
        );
        assert!(edits.get("mounts").is_none());
        // Real GPUs: the path only, the runtime reads the rest from the host's device node; of the optional nodes
        // only those the host has (here no nvidia-uvm-tools: a container naming it would not be created).
        let dev = tempfile::tempdir()?;
        std::fs::create_dir_all(dev.path().join("dev"))?;
        std::fs::write(dev.path().join("dev/nvidia-uvm"), "")?;
        let real = build_claim_spec(&kind, "abc-1", &gpus, &DriverFiles::default().with_dev_root(dev.path()))?;
        validate_claim_spec(&kind, "abc-1", &real)?;
        let real = to_json(&real);
        assert_eq!(real["devices"][1]["containerEdits"]["deviceNodes"], json!([{ "path": "/dev/nvidia1" }]));
        assert_eq!(
            real["containerEdits"]["deviceNodes"],
            json!([{ "path": "/dev/nvidiactl" }, { "path": "/dev/nvidia-uvm" }])
        );
        assert_eq!(
            device_id(&kind, "abc-1", "gpu-0"),
            format!("{}={}", spec["kind"].as_str().unwrap_or(""), "abc-1-gpu-0")
        );
        Ok(())
    }

    #[test]
    fn a_mig_device_is_its_parent_and_its_instance_capabilities() -> Result<(), CdiError> {
        use crate::node_agent::discovery::{Discovery, simulated::Simulated};
        let kind = CdiKind::from_driver_name("gpu.gpu-dra.dev")?;
        let gpus = Simulated::new("node", "1xH100-80GB,1xH100-80GB/mig=3g.40gb+1g.10gb").map_err(|e| {
            CdiError::InvalidSpec { claim_uid: String::new(), reason: e.to_string(), source: e.to_string().into() }
        })?;
        let all = crate::node_agent::device::devices(
            &gpus.discover().unwrap_or_default(),
            crate::node_agent::device::MigLayout::Static,
        );
        let names: Vec<String> = all.iter().map(Device::name).collect();
        assert_eq!(names, ["gpu-0", "gpu-1-mig-9-0-4", "gpu-1-mig-19-4-1"]);
        let built = build_claim_spec(&kind, "abc-1", &all, &DriverFiles::simulated())?;
        validate_claim_spec(&kind, "abc-1", &built)?;
        let spec = to_json(&built);
        let (gi, ci) = crate::node_agent::mig::cap_minors(1, 2, 0);
        assert_eq!(spec["devices"][1]["name"], "abc-1-gpu-1-mig-19-4-1", "devices by GPU, then name");
        assert_eq!(
            spec["devices"][1]["containerEdits"]["deviceNodes"],
            json!([
                { "path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1 },
                { "path": format!("/dev/nvidia-caps/nvidia-cap{gi}"), "type": "c", "major": 508, "minor": gi },
                { "path": format!("/dev/nvidia-caps/nvidia-cap{ci}"), "type": "c", "major": 508, "minor": ci },
            ])
        );
        let mig_uuids = [&all[1], &all[2]].map(|d| d.uuid().to_string());
        assert_eq!(
            spec["devices"][1]["containerEdits"]["env"],
            json!([format!("GPU_DRA_DEVICE_GPU_1_MIG_19_4_1={}", all[2].uuid())]),
            "each device names its own UUID, for the containers given it"
        );
        assert!(mig_uuids.iter().all(|u| u.starts_with("MIG-")));
        let env = spec["containerEdits"]["env"][2].as_str().unwrap_or_default();
        assert!(env.contains(&mig_uuids[0]) && env.contains(&mig_uuids[1]) && env.contains(all[0].uuid()), "{env}");
        let mut unknown_major = all[2].clone();
        if let Some(mig) = &mut unknown_major.mig {
            mig.caps_major = None;
        }
        let real = to_json(&build_claim_spec(&kind, "abc-1", &[unknown_major], &DriverFiles::default())?);
        assert_eq!(
            real["devices"][0]["containerEdits"]["deviceNodes"],
            json!([{ "path": "/dev/nvidia1" }, { "path": format!("/dev/nvidia-caps/nvidia-cap{gi}") }, { "path": format!("/dev/nvidia-caps/nvidia-cap{ci}") }])
        );
        Ok(())
    }

    #[test]
    fn the_version_is_the_lowest_that_fits() -> Result<(), CdiError> {
        let kind = CdiKind::from_driver_name("gpu.gpu-dra.dev")?;
        // CDI 0.5.0 first allowed device names that start with a digit (as most UIDs do).
        let spec =
            to_json(&build_claim_spec(&kind, "0b5b2d9c-1", &[gpu(0, "0000:01:00.0")], &DriverFiles::simulated())?);
        assert_eq!(spec["cdiVersion"], "0.5.0");
        Ok(())
    }

    #[test]
    fn output_is_deterministic() -> Result<(), CdiError> {
        let kind = CdiKind::from_driver_name("gpu.gpu-dra.dev")?;
        let a = [gpu(2, "0000:02:00.0"), gpu(0, "0000:03:00.0"), gpu(1, "0000:01:00.0")];
        let b = [a[1].clone(), a[2].clone(), a[0].clone()];
        let one =
            serde_json::to_string(&build_claim_spec(&kind, "u", &a, &DriverFiles::simulated())?).unwrap_or_default();
        let two =
            serde_json::to_string(&build_claim_spec(&kind, "u", &b, &DriverFiles::simulated())?).unwrap_or_default();
        assert!(!one.is_empty());
        assert_eq!(one, two);
        Ok(())
    }

    #[test]
    fn bad_claims_are_refused() -> Result<(), CdiError> {
        let kind = CdiKind::from_driver_name("gpu.gpu-dra.dev")?;
        let gpus = [gpu(0, "0000:01:00.0")];
        for uid in ["", "a/b", "../etc", "uid-"] {
            let err = build_claim_spec(&kind, uid, &gpus, &DriverFiles::simulated()).err();
            assert!(matches!(err, Some(CdiError::InvalidName { what: "claim UID", .. })), "{uid:?}: {err:?}");
        }
        let err = build_claim_spec(&kind, "u", &[], &DriverFiles::simulated()).err();
        assert!(matches!(err, Some(CdiError::NoGpus { .. })), "{err:?}");
        let err = build_claim_spec(&kind, "u", &[gpus[0].clone(), gpus[0].clone()], &DriverFiles::simulated()).err();
        assert!(matches!(err, Some(CdiError::InvalidSpec { .. })), "{err:?}");
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            text.starts_with("validate the CDI spec of claim u: ") && text.contains("multiple devices named gpu-0"),
            "{text}"
        );
        Ok(())
    }
}
