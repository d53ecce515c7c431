//! MPS applied, decided without I/O: which MPS control daemon a claim gets and what its containers are given to be
//! its clients. [`super::state`] starts and stops the daemon through [`MpsDaemons`]
//! (`nvidia-cuda-mps-control -f` for real GPUs, a stand-in for simulated ones).
//!
//! One daemon per claim, serving all of the claim's devices, as NVIDIA's driver runs it:
//! - every device of the claim that is not looked at with admin access asks `sharing.strategy: MPS` with the same
//!   settings, or none does: the daemon's pipe and limits reach every container of the claim, so a claim mixing
//!   MPS with something else, or two different limits, is refused naming the requests;
//! - MPS needs its GPUs whole: a share of part of a GPU shared by memory (a share of all its memory, which a claim
//!   naming no memory gets, holds it whole) and a dynamic MIG device (made at prepare, so its UUID is not known to
//!   the limits) are refused; static MIG devices are served by their MIG UUIDs;
//! - the daemon sees the claim's devices by UUID (`CUDA_VISIBLE_DEVICES`), its default active thread percentage
//!   and pinned device memory limits in its environment (the defaults of every server it starts), and writes its
//!   pipes, logs and shared memory under the claim's own directories;
//! - the claim's containers get the pipe directory at `/tmp/nvidia-mps`, the daemon's shared memory at `/dev/shm`
//!   and the same limits in their environment (a client's limit can only lower the daemon's).
//!
//! [`MpsDaemons`]: crate::node_agent::mps_control::MpsDaemons

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::allocation::{ClaimRef, PlannedDevice};
use super::checkpoint::{Checkpoint, PrepareState};
use super::config::{MpsConfig, SharingStrategy, pinned_limit_mib};
use crate::node_agent::device::Device;

/// Where a client finds the daemon's pipes (MPS's default, so images need no configuration of their own).
pub const CLIENT_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";
/// Where a client's shared memory with the MPS server lives.
pub const CLIENT_SHM_DIRECTORY: &str = "/dev/shm";

/// The MPS control daemon of one claim, as its checkpoint entry records it: start-up starts it again from this.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsDaemon {
    /// The devices it serves, by UUID, sorted.
    pub uuids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u8>,
    /// Pinned device memory limit per device UUID, in MiB.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pinned_mib: BTreeMap<String, u64>,
}

/// A claim's daemon directories on the node: `<root>/<claim UID>/{pipe,log,shm}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsDirs {
    pub claim: PathBuf,
    pub pipe: PathBuf,
    pub log: PathBuf,
    pub shm: PathBuf,
}

impl MpsDirs {
    pub fn of(root: &Path, claim_uid: &str) -> Self {
        let claim = root.join(claim_uid);
        Self { pipe: claim.join("pipe"), log: claim.join("log"), shm: claim.join("shm"), claim }
    }
}

impl MpsDaemon {
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`'s value: `<uuid>=<MiB>M,…`; `None` without limits.
    fn pinned_env(&self) -> Option<String> {
        let limits: Vec<String> = self.pinned_mib.iter().map(|(uuid, mib)| format!("{uuid}={mib}M")).collect();
        (!limits.is_empty()).then(|| limits.join(","))
    }

    /// The limits, as `NAME=value` for the daemon's and the clients' environment alike.
    fn limit_env(&self) -> Vec<String> {
        let mut env = Vec::new();
        if let Some(percentage) = self.active_thread_percentage {
            env.push(format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percentage}"));
        }
        if let Some(pinned) = self.pinned_env() {
            env.push(format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={pinned}"));
        }
        env
    }

    /// The daemon's environment (beside its own `/dev/shm`, which is the claim's `shm` directory).
    pub fn daemon_env(&self, dirs: &MpsDirs) -> Vec<(String, String)> {
        let mut env = vec![
            ("CUDA_VISIBLE_DEVICES".to_string(), self.uuids.join(",")),
            ("CUDA_MPS_PIPE_DIRECTORY".to_string(), dirs.pipe.display().to_string()),
            ("CUDA_MPS_LOG_DIRECTORY".to_string(), dirs.log.display().to_string()),
        ];
        env.extend(self.limit_env().into_iter().filter_map(|e| e.split_once('=').map(|(k, v)| (k.into(), v.into()))));
        env
    }

    /// What every container of the claim is given: `NAME=value` environment and (host, container) mounts.
    /// `GPU_DRA_MPS_UUIDS` names the devices the daemon serves (a claim's device looked at with admin access is not
    /// one), so that a claim adopted from its spec gets exactly this daemon back ([`from_client_env`]).
    pub fn client_edits(&self, dirs: &MpsDirs) -> (Vec<String>, Vec<(PathBuf, PathBuf)>) {
        let mut env = vec![
            format!("CUDA_MPS_PIPE_DIRECTORY={CLIENT_PIPE_DIRECTORY}"),
            format!("GPU_DRA_MPS_UUIDS={}", self.uuids.join(",")),
        ];
        env.extend(self.limit_env());
        let mounts = vec![
            (dirs.pipe.clone(), PathBuf::from(CLIENT_PIPE_DIRECTORY)),
            (dirs.shm.clone(), PathBuf::from(CLIENT_SHM_DIRECTORY)),
        ];
        (env, mounts)
    }
}

/// The daemon whose client environment (a claim's spec-wide CDI env, as [`MpsDaemon::client_edits`] writes it) is
/// `env`: how a claim adopted from its spec after a corrupt checkpoint gets its daemon back. `None` without MPS.
pub fn from_client_env(env: &[String]) -> Option<MpsDaemon> {
    let value = |name: &str| env.iter().find_map(|e| e.strip_prefix(name)?.strip_prefix('='));
    value("CUDA_MPS_PIPE_DIRECTORY")?;
    let uuids: Vec<String> =
        value("GPU_DRA_MPS_UUIDS")?.split(',').filter(|u| !u.is_empty()).map(str::to_string).collect();
    let active_thread_percentage = value("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").and_then(|p| p.parse().ok());
    let pinned_mib = value("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        .into_iter()
        .flat_map(|limits| limits.split(','))
        .filter_map(|limit| {
            let (uuid, mib) = limit.split_once('=')?;
            Some((uuid.to_string(), mib.strip_suffix('M')?.parse().ok()?))
        })
        .collect();
    Some(MpsDaemon { uuids, active_thread_percentage, pinned_mib })
}

/// The daemon `claim` gets, `None` when it asks no MPS; refused when it cannot have one (see the module's rules).
pub fn plan(claim: &ClaimRef, planned: &[PlannedDevice]) -> Result<Option<MpsDaemon>, String> {
    let served: Vec<&PlannedDevice> = planned.iter().filter(|p| !p.admin_access).collect();
    let Some(first) = served.iter().find(|p| p.config.sharing.strategy == SharingStrategy::Mps) else {
        return Ok(None);
    };
    for device in &served {
        let sharing = &device.config.sharing;
        if sharing.strategy != SharingStrategy::Mps {
            return Err(format!(
                "claim {claim}: request {:?} asks sharing.strategy MPS and request {:?} asks {:?}; one MPS daemon \
                 serves every container of a claim, so all of its requests ask MPS with the same settings, or none \
                 does",
                first.request, device.request, sharing.strategy
            ));
        }
        let name = device.device.name();
        // MPS sets its GPUs' compute mode to EXCLUSIVE_PROCESS, which would lock the other shares' processes out. A
        // share of all the memory has none beside it (a claim naming no memory gets that by default).
        if device.share_id.is_some() && !device.all_memory {
            return Err(format!(
                "claim {claim}: request {:?} has a share of part of device {name:?}'s memory (a GPU shared by \
                 memory); MPS needs its GPUs whole: ask for no memory capacity (the whole GPU) or a GPU from a class \
                 of unshared GPUs",
                device.request
            ));
        }
        if device.device.partition.as_ref().is_some_and(|p| p.whole) {
            return Err(format!(
                "claim {claim}: request {:?} has device {name:?}, a GPU in MIG mode (dynamic MIG: its whole is a MIG \
                 device made at prepare); MPS is not run on those: select GPUs out of MIG mode \
                 (`device.attributes['<driver>'].migEnabled == false`)",
                device.request
            ));
        }
        if device.device.partition.is_some() {
            return Err(format!(
                "claim {claim}: request {:?} has device {name:?}, a MIG device made at prepare (dynamic MIG); MPS is \
                 not run on those: ask for a whole GPU or an existing MIG device",
                device.request
            ));
        }
    }
    let mut uuids: Vec<String> = served.iter().map(|p| p.device.uuid().to_string()).collect();
    uuids.sort();
    uuids.dedup();
    // Settings are compared as the daemon would get them: `1Gi` and `1024Mi` are the same limit.
    let daemon = |device: &PlannedDevice| {
        let config = device.config.sharing.mps.clone().unwrap_or_default();
        let pinned_mib = limits(claim, &config, &uuids)?;
        let active_thread_percentage = config.default_active_thread_percentage.and_then(|p| u8::try_from(p).ok());
        Ok::<_, String>(MpsDaemon { uuids: uuids.clone(), active_thread_percentage, pinned_mib })
    };
    let wanted = daemon(first)?;
    for device in &served {
        if daemon(device)? != wanted {
            return Err(format!(
                "claim {claim}: requests {:?} and {:?} ask MPS with different settings; one MPS daemon serves every \
                 container of a claim",
                first.request, device.request
            ));
        }
    }
    Ok(Some(wanted))
}

/// The whole GPUs among `devices` (a claim's, or the node's) that `daemon` serves, by device name: set to the
/// `EXCLUSIVE_PROCESS` compute mode while its claim is prepared. A MIG device is not (the compute mode is its parent
/// GPU's, which other claims' MIG devices share), nor one held with admin access (the daemon does not serve it).
pub fn exclusive_gpus<'a>(daemon: &MpsDaemon, devices: impl IntoIterator<Item = &'a Device>) -> BTreeSet<String> {
    let served = |d: &&Device| !d.is_mig() && daemon.uuids.iter().any(|u| u == d.uuid());
    devices.into_iter().filter(served).map(Device::name).collect()
}

/// The devices [`Checkpoint::exclusive_process`] lists whose UUID (`uuid_of` a device name; `None`: gone from the
/// node) no prepared claim's MPS daemon serves: those to set back to the `Default` compute mode. A daemon serves the
/// UUIDs it records, which leave out devices held with admin access (also for a recovered claim, whose spec names
/// its daemon's); a claim half prepared (its prepare failed or was interrupted) has none, unless its daemon still
/// runs (`daemon_runs` for its UID: a prepare whose last save failed).
pub fn exclusive_to_set_back(
    checkpoint: &Checkpoint,
    uuid_of: impl Fn(&str) -> Option<String>,
    daemon_runs: impl Fn(&str) -> bool,
) -> Vec<String> {
    let served: BTreeSet<&str> = checkpoint
        .claims
        .iter()
        .filter(|(uid, entry)| entry.state == PrepareState::PrepareCompleted || daemon_runs(uid))
        .filter_map(|(_, entry)| entry.mps.as_ref())
        .flat_map(|daemon| daemon.uuids.iter().map(String::as_str))
        .collect();
    let idle = |device: &String| uuid_of(device).is_none_or(|uuid| !served.contains(uuid.as_str()));
    checkpoint.exclusive_process.iter().filter(|d| idle(d)).cloned().collect()
}

/// Each device's pinned memory limit: the default for all, then the per-device ones, whose keys are a device's UUID
/// or its index among `uuids` (sorted), as NVIDIA's driver reads them.
fn limits(claim: &ClaimRef, config: &MpsConfig, uuids: &[String]) -> Result<BTreeMap<String, u64>, String> {
    let mut limits = BTreeMap::new();
    if let Some(default) = &config.default_pinned_device_memory_limit {
        let mib =
            pinned_limit_mib(&default.0).map_err(|e| format!("claim {claim}: defaultPinnedDeviceMemoryLimit: {e}"))?;
        limits.extend(uuids.iter().map(|uuid| (uuid.clone(), mib)));
    }
    for (key, limit) in &config.default_per_device_pinned_memory_limit {
        let uuid = match uuids.iter().find(|uuid| *uuid == key) {
            Some(uuid) => uuid,
            None => key.parse::<usize>().ok().and_then(|index| uuids.get(index)).ok_or_else(|| {
                format!(
                    "claim {claim}: defaultPerDevicePinnedMemoryLimit[{key:?}] names none of the claim's {} device(s): \
                     a key is a device's UUID ({}) or its index among them sorted by UUID (0 to {})",
                    uuids.len(),
                    uuids.join(", "),
                    uuids.len().saturating_sub(1)
                )
            })?,
        };
        let mib = pinned_limit_mib(&limit.0)
            .map_err(|e| format!("claim {claim}: defaultPerDevicePinnedMemoryLimit[{key:?}]: {e}"))?;
        limits.insert(uuid.clone(), mib);
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet_plugin::config::{GpuConfig, Sharing};
    use crate::node_agent::device::Device;
    use crate::node_agent::gpu::test_gpu;

    fn claim() -> ClaimRef {
        ClaimRef { namespace: "ns".into(), name: "train".into(), uid: "uid-1".into() }
    }

    fn device(request: &str, minor: u32, sharing: Sharing) -> PlannedDevice {
        PlannedDevice {
            request: request.into(),
            pool: "node-a".into(),
            device: Device::whole(&test_gpu(minor, "0000:01:00.0")),
            share_id: None,
            all_memory: false,
            memory_bytes: None,
            admin_access: false,
            config: GpuConfig { sharing },
        }
    }

    fn mps(config: MpsConfig) -> Sharing {
        Sharing { strategy: SharingStrategy::Mps, time_slicing: None, mps: Some(config) }
    }

    #[test]
    fn a_claim_asking_mps_gets_one_daemon_for_all_its_gpus_with_its_limits() -> Result<(), String> {
        let config = MpsConfig {
            default_active_thread_percentage: Some(50),
            default_pinned_device_memory_limit: Some("2Gi".into()),
            default_per_device_pinned_memory_limit: BTreeMap::from([("1".into(), "512Mi".into())]),
        };
        let planned = [device("gpus", 1, mps(config.clone())), device("gpus", 0, mps(config))];
        let daemon = plan(&claim(), &planned)?.ok_or("no daemon")?;
        let uuids: Vec<String> = [0, 1].map(|m| Device::whole(&test_gpu(m, "")).uuid().to_string()).into();
        let mut sorted = uuids.clone();
        sorted.sort();
        assert_eq!(daemon.uuids, sorted);
        assert_eq!(daemon.active_thread_percentage, Some(50));
        assert_eq!(daemon.pinned_mib, BTreeMap::from([(sorted[0].clone(), 2048), (sorted[1].clone(), 512)]));

        let dirs = MpsDirs::of(Path::new("/run/gpu-dra/mps"), "uid-1");
        let env = daemon.daemon_env(&dirs);
        assert!(env.contains(&("CUDA_VISIBLE_DEVICES".into(), sorted.join(","))), "{env:?}");
        assert!(env.contains(&("CUDA_MPS_PIPE_DIRECTORY".into(), "/run/gpu-dra/mps/uid-1/pipe".into())), "{env:?}");
        assert!(env.contains(&("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), "50".into())), "{env:?}");
        let (client_env, mounts) = daemon.client_edits(&dirs);
        let pinned = format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={}=2048M,{}=512M", sorted[0], sorted[1]);
        assert_eq!(
            client_env,
            [
                "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".to_string(),
                format!("GPU_DRA_MPS_UUIDS={}", sorted.join(",")),
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50".into(),
                pinned
            ]
        );
        assert_eq!(
            mounts,
            [
                (PathBuf::from("/run/gpu-dra/mps/uid-1/pipe"), PathBuf::from("/tmp/nvidia-mps")),
                (PathBuf::from("/run/gpu-dra/mps/uid-1/shm"), PathBuf::from("/dev/shm"))
            ]
        );
        Ok(())
    }

    #[test]
    fn an_adopted_spec_gives_its_daemon_back() {
        let daemon = MpsDaemon {
            uuids: vec!["GPU-a".into(), "GPU-b".into()],
            active_thread_percentage: Some(30),
            pinned_mib: BTreeMap::from([("GPU-a".into(), 512), ("GPU-b".into(), 2048)]),
        };
        let (mut env, _) = daemon.client_edits(&MpsDirs::of(Path::new("/run/gpu-dra/mps"), "uid-1"));
        // The claim's devices include one looked at with admin access, which the daemon does not serve.
        env.push("GPU_DRA_GPU_UUIDS=GPU-b,GPU-c,GPU-a".into());
        assert_eq!(from_client_env(&env), Some(daemon));
        let plain = ["GPU_DRA_GPU_UUIDS=GPU-a".to_string(), "CUDA_DEVICE_ORDER=PCI_BUS_ID".into()];
        assert_eq!(from_client_env(&plain), None, "a spec without MPS");
    }

    #[test]
    fn claims_without_mps_get_no_daemon_and_admin_access_neither_asks_nor_constrains() -> Result<(), String> {
        assert_eq!(plan(&claim(), &[device("gpu", 0, Sharing::default())])?, None);
        let mut monitor = device("look", 1, Sharing::default());
        monitor.admin_access = true;
        let daemon = plan(&claim(), &[device("gpu", 0, mps(MpsConfig::default())), monitor])?.ok_or("no daemon")?;
        assert_eq!(daemon.uuids.len(), 1, "the device looked at with admin access is not served");
        assert_eq!((daemon.active_thread_percentage, daemon.pinned_mib.len()), (None, 0), "the daemon's defaults");
        Ok(())
    }

    #[test]
    fn requests_asking_the_same_limits_spelled_differently_share_the_daemon() -> Result<(), String> {
        let gib = MpsConfig { default_pinned_device_memory_limit: Some("1Gi".into()), ..MpsConfig::default() };
        let mib = MpsConfig { default_pinned_device_memory_limit: Some("1024Mi".into()), ..MpsConfig::default() };
        let daemon = plan(&claim(), &[device("a", 0, mps(gib)), device("b", 1, mps(mib))])?.ok_or("no daemon")?;
        assert!(daemon.pinned_mib.values().all(|mib| *mib == 1024), "{daemon:?}");
        Ok(())
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let half = MpsConfig { default_active_thread_percentage: Some(50), ..MpsConfig::default() };
        let mut shared = device("gpu", 0, mps(MpsConfig::default()));
        shared.share_id = Some("share-1".into());
        let bad_key = MpsConfig {
            default_per_device_pinned_memory_limit: BTreeMap::from([("2".into(), "1Gi".into())]),
            ..MpsConfig::default()
        };
        // The whole of a GPU on a dynamic-MIG node, and one of its partitions.
        let partition = |whole: bool| {
            let mut planned = device("p", 0, mps(MpsConfig::default()));
            let gpu = &planned.device.gpu;
            let profiles = crate::node_agent::mig::profiles(gpu).unwrap_or_default();
            let profile = if whole { profiles.last() } else { profiles.first() }.copied();
            planned.device.partition =
                profile.map(|profile| crate::node_agent::device::Partition { profile, start: 0, whole });
            planned
        };
        let cases: [(Vec<PlannedDevice>, &str); 6] = [
            (
                vec![device("a", 0, mps(MpsConfig::default())), device("b", 1, Sharing::default())],
                "request \"a\" asks sharing.strategy MPS and request \"b\" asks Exclusive",
            ),
            (
                vec![device("a", 0, mps(MpsConfig::default())), device("b", 1, mps(half))],
                "requests \"a\" and \"b\" ask MPS with different settings",
            ),
            (vec![shared], "a GPU shared by memory); MPS needs its GPUs whole"),
            (
                vec![device("a", 0, mps(bad_key))],
                "defaultPerDevicePinnedMemoryLimit[\"2\"] names none of the claim's 1",
            ),
            (vec![partition(true)], "a GPU in MIG mode (dynamic MIG: its whole is a MIG device made at prepare)"),
            (vec![partition(false)], "a MIG device made at prepare (dynamic MIG); MPS is not run on those"),
        ];
        for (planned, expected) in cases {
            match plan(&claim(), &planned) {
                Ok(daemon) => panic!("{expected}: planned {daemon:?}"),
                Err(error) => assert!(error.contains(expected), "{error:?} lacks {expected:?}"),
            }
        }
    }

    /// On a GPU shared by memory, a claim naming no memory gets a share of all of it: nothing shares it beside the
    /// daemon, which serves it as a whole GPU.
    #[test]
    fn a_share_of_all_the_memory_gets_a_daemon() -> Result<(), String> {
        let mut whole = device("gpu", 0, mps(MpsConfig::default()));
        whole.share_id = Some("share-1".into());
        whole.all_memory = true;
        let daemon = plan(&claim(), &[whole])?.ok_or("no daemon")?;
        assert_eq!(daemon.uuids.len(), 1, "{daemon:?}");
        Ok(())
    }

    #[test]
    fn gpus_served_by_an_mps_daemon_are_exclusive_until_no_daemon_serves_them() -> Result<(), String> {
        use crate::kubelet_plugin::checkpoint::{ClaimEntry, PreparedDevice};
        let mut looked_at = device("monitor", 2, mps(MpsConfig::default()));
        looked_at.admin_access = true;
        let planned = [device("gpus", 0, mps(MpsConfig::default())), looked_at];
        let daemon = plan(&claim(), &planned)?.ok_or("no daemon")?;
        assert_eq!(exclusive_gpus(&daemon, planned.iter().map(|p| &p.device)), BTreeSet::from(["gpu-0".to_string()]));

        let entry = |devices: &[(&str, bool)], daemon: &[&str], state| ClaimEntry {
            unknown: Default::default(),
            namespace: "ns".into(),
            name: "c".into(),
            state,
            devices: devices
                .iter()
                .map(|(device, admin_access)| PreparedDevice {
                    unknown: Default::default(),
                    request_names: vec!["gpu".into()],
                    pool: "node-a".into(),
                    device: device.to_string(),
                    cdi_device_ids: Vec::new(),
                    share_id: None,
                    admin_access: *admin_access,
                    time_slice: None,
                    made_mig: None,
                    making_mig: false,
                    memory_bytes: None,
                })
                .collect(),
            recovered: false,
            mps: (!daemon.is_empty())
                .then(|| MpsDaemon { uuids: daemon.iter().map(|u| u.to_string()).collect(), ..MpsDaemon::default() }),
            metadata: None,
        };
        let mut checkpoint = Checkpoint::new("boot");
        checkpoint.exclusive_process = ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-9"].map(String::from).into();
        // gpu-0: its MPS claim's daemon serves it. gpu-1: only a claim without MPS holds it. gpu-2: the MPS claim
        // holds it with admin access (its daemon does not serve it). gpu-3: a half-prepared MPS claim's (no daemon
        // runs). gpu-9: gone from the node.
        let completed = PrepareState::PrepareCompleted;
        let mps_claim = entry(&[("gpu-0", false), ("gpu-2", true)], &["GPU-0"], completed);
        checkpoint.claims.insert("mps".into(), mps_claim);
        checkpoint.claims.insert("plain".into(), entry(&[("gpu-1", false)], &[], completed));
        let half = entry(&[("gpu-3", false)], &["GPU-3"], PrepareState::PrepareStarted);
        checkpoint.claims.insert("half".into(), half);
        let uuid_of = |name: &str| name.strip_prefix("gpu-").filter(|n| *n != "9").map(|n| format!("GPU-{n}"));
        let none_runs = |_: &str| false;
        assert_eq!(exclusive_to_set_back(&checkpoint, uuid_of, none_runs), ["gpu-1", "gpu-2", "gpu-3", "gpu-9"]);
        // A half-prepared claim whose daemon still runs (its last save failed) still serves its GPU.
        let half_runs = |uid: &str| uid == "half";
        assert_eq!(exclusive_to_set_back(&checkpoint, uuid_of, half_runs), ["gpu-1", "gpu-2", "gpu-9"]);
        Ok(())
    }
}
