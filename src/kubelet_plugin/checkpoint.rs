//! The node agent's record of the ResourceClaims it prepared on this node.
//!
//! Why it exists: on `NodeUnprepareResources` the kubelet sends only a claim's namespace, name and UID, and the claim
//! may already be deleted from the API, so the agent must itself remember which devices and CDI files belong to which
//! claim, across agent restarts.
//!
//! What it guards against:
//! - a corrupted or truncated file crash-looping the plugin with nothing in the cluster saying why:
//!   [`LoadOutcome::Corrupt`] tells the caller to rebuild the record and emit a Warning event and a metric. The file
//!   stays where it is until [`CheckpointStore::replace_corrupt`] has saved the rebuilt one (then it is kept aside,
//!   never deleted: an operator can inspect it), so a rebuild that fails or is killed is simply done again at the
//!   next start: there is never a moment when the node has CDI specs and no record saying they are in use;
//! - stale entries after an interrupted prepare: an entry is written [`PrepareState::PrepareStarted`] before any CDI
//!   file exists and [`PrepareState::PrepareCompleted`] after, so on start-up every `PrepareStarted` entry is a
//!   half-done prepare (or an unprepare that failed part-way, marked so again) whose leftovers the caller cleans up;
//! - a reboot losing device state while the checkpoint still says "prepared": the file records the kernel's boot ID,
//!   and entries from another boot are dropped (and reported) instead of being served as if still in place.
//!
//! On disk (`checkpoint.json` in the state directory):
//! `{"version": 1, "checksum": "<16 hex digits>", "checkpoint": {...}}`. The checksum is FNV-1a 64 over the compact
//! serialization of the `checkpoint` value as a `serde_json::Value`, which is canonical (object keys sorted), so it
//! does not depend on the file's whitespace or key order, only on its content.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::config::TimeSliceInterval;
use crate::fsutil::write_atomic;
use crate::node_agent::gpu::stable_hash;

/// The only file format version this agent reads and writes. Any other version is treated as corrupt (kept aside),
/// so a downgraded agent never misreads a newer agent's file. Within a version, fields added later are not acted on
/// by an agent that lacks them, but kept as they were at its saves (the `unknown` maps of the checkpoint, each claim
/// and each device; also when the claim is prepared again), so that what they record (a setting to set back, a MIG
/// device made for a claim) is there again once the newer agent is back; an entry the older agent removes (its
/// claim unprepared) goes with its fields. Fields within the MPS and metadata records are not kept.
pub const CHECKPOINT_VERSION: u64 = 1;

/// The checkpoint's file name inside the state directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";

/// Where Linux publishes a random ID that changes on every boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Every claim this node prepared (or began to prepare) during the boot `boot_id`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// The kernel boot ID the entries belong to (see [`boot_id`]); empty when it could not be read.
    pub boot_id: String,
    /// The driver name the claims were prepared for (empty in files of versions before it was kept): an agent of
    /// another name (`driverName` changed) must not take them over, see [`Checkpoint::prepared_for_another`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub driver: String,
    /// Claim UID → what was prepared for it.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimEntry>,
    /// Devices of this pool whose time slice this agent changed and has not yet set back to the default: what
    /// start-up sets again (the interval their holders ask, or the default), so a restore that failed or was
    /// interrupted by a crash is finished later. See [`super::time_slice`].
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub time_sliced: BTreeSet<String>,
    /// Devices of this pool this agent set to the `EXCLUSIVE_PROCESS` compute mode for a claim's MPS daemon and has
    /// not yet set back to `Default`: listed before they are set, taken off once set back, so a crash in between
    /// leaves them to the next unprepare or start-up. See [`super::mps`].
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub exclusive_process: BTreeSet<String>,
    /// Fields of a newer agent's file this one does not know: kept as they were (see [`CHECKPOINT_VERSION`]).
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Value>,
}

/// One claim's prepare record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    pub namespace: String,
    pub name: String,
    pub state: PrepareState,
    #[serde(default)]
    pub devices: Vec<PreparedDevice>,
    /// Adopted from a CDI spec on disk while a corrupt checkpoint was rebuilt: the claim's name, requests, shares and
    /// admin access are unknown, so the entry only keeps its spec from being removed as an orphan and lets unprepare
    /// find it; it never conflicts with another claim and a prepare of the claim plans it again from the API.
    #[serde(default, skip_serializing_if = "is_false")]
    pub recovered: bool,
    /// The MPS control daemon the claim asked for (`GpuConfig` strategy MPS): start-up starts it again from this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<super::mps::MpsDaemon>,
    /// Set when device metadata files were written for the claim ([`super::device_metadata`]): its spec mounts them,
    /// so a spec written again mounts them too. Absent in files written before it was recorded, or with
    /// `--device-metadata=false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<MetadataRecord>,
    /// Fields of a newer agent's file this one does not know: kept as they were (see [`CHECKPOINT_VERSION`]).
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Value>,
}

/// What a claim's device metadata mounts are made from besides its entry: the name its pod gave it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MetadataRecord {
    /// The claim's `resource.kubernetes.io/pod-claim-name` annotation: made from a template by that pod claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_claim_name: Option<String>,
}

fn is_false(value: &bool) -> bool {
    !value
}

/// How far a prepare got. Saved `PrepareStarted` before the first CDI file is written and `PrepareCompleted` after the
/// last, so a crash in between leaves a `PrepareStarted` entry that names what to clean up. An unprepare that fails
/// part-way sets its entry back to `PrepareStarted`: what is left of it is cleaned up the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PrepareState {
    PrepareStarted,
    PrepareCompleted,
}

/// One allocated device as prepared for a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The claim's requests this device satisfies.
    pub request_names: Vec<String>,
    pub pool: String,
    pub device: String,
    /// Fully qualified CDI device names handed to the kubelet.
    pub cdi_device_ids: Vec<String>,
    /// Set when the allocation is one share of a device that several claims may hold at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// Allocated with admin access (e.g. a monitoring agent looking at every GPU): it never makes the device busy,
    /// for other claims as for the scheduler. Absent (false) in files written before it was recorded.
    #[serde(default, skip_serializing_if = "is_false")]
    pub admin_access: bool,
    /// The time slice this claim asked of the device (`GpuConfig` strategy `TimeSlicing`); absent when it asked
    /// none. Every claim holding one device asks the same or none (see [`super::time_slice`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slice: Option<TimeSliceInterval>,
    /// Dynamic MIG: the UUID of the MIG device the agent made for this claim (recorded before its spec is written).
    /// Only a MIG device recorded here is ever destroyed: never one an administrator made, one a claim only looks
    /// at with admin access, or one whose making is not known (a recovered entry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub made_mig: Option<String>,
    /// Dynamic MIG: set (and saved) before the agent makes this partition's MIG device on a placement it found
    /// empty, cleared once the device's UUID is in `made_mig`. Left set by a prepare killed between the make and
    /// that save: start-up destroys the MIG device at the placement (no claim records it), which otherwise stayed,
    /// nobody's, and failed every retry of the claim's prepare as overlapping it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub making_mig: bool,
    /// The GPU memory a share (`share_id`) consumed, as the scheduler recorded it: what a new share of the GPU is
    /// counted beside ([`Checkpoint::memory_taken`]). Absent in files written before it was recorded (counted as
    /// none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Fields of a newer agent's file this one does not know: kept as they were (see [`CHECKPOINT_VERSION`]).
    #[serde(flatten)]
    pub unknown: BTreeMap<String, Value>,
}

impl Checkpoint {
    /// An empty checkpoint for the boot `boot_id`.
    pub fn new(boot_id: &str) -> Self {
        Self { boot_id: boot_id.to_owned(), ..Self::default() }
    }

    /// The claims (namespace/name) this checkpoint holds for a driver other than `driver`: the kubelet unprepares a
    /// claim only through the plugin of the driver it was prepared by, so an agent renamed (`driverName` changed)
    /// with claims prepared would never see their unprepare, and would publish their GPUs as free beside them.
    /// In a file written before the name was kept, a claim's driver is its CDI ids' vendor (`<driver>/gpu=…`).
    /// Named by namespace/name, or by UID for an entry adopted from its spec; at most ten, then how many more.
    /// Answers that driver's name and the claims.
    pub fn prepared_for_another(&self, driver: &str) -> Option<(String, Vec<String>)> {
        let of = |entry: &ClaimEntry| -> Option<String> {
            match self.driver.as_str() {
                "" => entry.devices.iter().flat_map(|d| &d.cdi_device_ids).find_map(|id| {
                    id.split_once('/').map(|(vendor, _)| vendor.to_string()).filter(|vendor| vendor != driver)
                }),
                recorded => (recorded != driver).then(|| recorded.to_string()),
            }
        };
        let recorded = self.claims.values().find_map(of)?;
        let mut named: Vec<String> = self
            .claims
            .iter()
            .filter(|(_, entry)| of(entry).is_some())
            .map(
                |(uid, e)| if e.name.is_empty() { format!("UID {uid}") } else { format!("{}/{}", e.namespace, e.name) },
            )
            .collect();
        if named.len() > 10 {
            let more = named.len() - 10;
            named.truncate(10);
            named.push(format!("and {more} more"));
        }
        Some((recorded, named))
    }

    /// The UID of a claim (the first by UID) holding `device` of `pool` in any state, shared or not.
    pub fn device_owner(&self, pool: &str, device: &str) -> Option<&str> {
        self.holders(pool, device).map(|(uid, _)| uid).next()
    }

    /// Every claim holding `device` of `pool` or one of its MIG devices (`<device>-mig-…`) (any state, shared or
    /// with admin access: all of them use the GPU), as `(claim UID, entry)`, each once: whom a fault of that GPU
    /// affects.
    pub fn claims_holding(&self, pool: &str, device: &str) -> Vec<(&str, &ClaimEntry)> {
        let on_gpu = |name: &str| name == device || crate::node_agent::device::mig_parent_name(name) == Some(device);
        self.claims
            .iter()
            .filter(|(_, entry)| entry.devices.iter().any(|d| d.pool == pool && on_gpu(&d.device)))
            .map(|(uid, entry)| (uid.as_str(), entry))
            .collect()
    }

    /// Another claim (not `claim_uid`) whose hold conflicts with preparing `wanted` for `claim_uid`, as (its UID,
    /// the device it holds): both are in the same pool and share hardware (the same device, a GPU and one of its
    /// MIG devices, or overlapping MIG devices: [`devices_overlap`]), and they are not two different shares of one
    /// device. Entries still `PrepareStarted` count: their device is not free until their cleanup has run. A hold
    /// with admin access never conflicts (it does not make the device busy), nor does a recovered entry (what it
    /// holds is unknown). Use this, not [`device_owner`] (which ignores shares), to refuse a device already prepared
    /// for someone else.
    ///
    /// [`device_owner`]: Checkpoint::device_owner
    /// [`devices_overlap`]: crate::node_agent::device::devices_overlap
    pub fn conflicting_owner(&self, claim_uid: &str, wanted: &PreparedDevice) -> Option<(&str, &str)> {
        self.claims
            .iter()
            .filter(|(uid, entry)| *uid != claim_uid && !entry.recovered)
            .flat_map(|(uid, entry)| entry.devices.iter().map(move |held| (uid.as_str(), held)))
            .filter(|(_, held)| held.pool == wanted.pool && !held.admin_access)
            .filter(|(_, held)| crate::node_agent::device::devices_overlap(&held.device, &wanted.device))
            .find(|(_, held)| match (&held.share_id, &wanted.share_id) {
                (Some(held_share), Some(wanted_share)) if held.device == wanted.device => held_share == wanted_share,
                _ => true,
            })
            .map(|(uid, held)| (uid, held.device.as_str()))
    }

    /// The claim of `uid` as a refusal of `refused` names it: in full only when it is of `refused`'s namespace
    /// ([`ClaimRef::other`]).
    ///
    /// [`ClaimRef::other`]: super::allocation::ClaimRef::other
    pub fn holder_named_to(&self, refused: &super::allocation::ClaimRef, uid: &str) -> String {
        let (namespace, name) = self.claims.get(uid).map(|e| (e.namespace.as_str(), e.name.as_str())).unzip();
        refused.other(namespace.unwrap_or_default(), name.unwrap_or_default(), uid)
    }

    /// The other claims (not `claim_uid`) holding any of `devices` or a device overlapping one (a MIG device of a
    /// GPU, the GPU of a MIG device), as `namespace/name (UID …)`: what the agent's log names beside a refusal, whose
    /// text names only the claims of the refused claim's own namespace ([`ClaimRef::other`]).
    ///
    /// [`ClaimRef::other`]: super::allocation::ClaimRef::other
    pub fn holders_beside(&self, claim_uid: &str, devices: &[PreparedDevice]) -> Vec<String> {
        self.claims
            .iter()
            .filter(|(uid, _)| *uid != claim_uid)
            .filter(|(_, entry)| {
                entry.devices.iter().any(|held| {
                    devices.iter().any(|wanted| {
                        held.pool == wanted.pool
                            && crate::node_agent::device::devices_overlap(&held.device, &wanted.device)
                    })
                })
            })
            .map(|(uid, entry)| match entry.namespace.is_empty() {
                true => format!("UID {uid} (recovered from its CDI spec)"),
                false => format!("{}/{} (UID {uid})", entry.namespace, entry.name),
            })
            .collect()
    }

    /// Another claim (not `claim_uid`) holding a share of `wanted`'s device when the two shares cannot be side by
    /// side: shares of one GPU never conflict ([`Self::conflicting_owner`]), unless MPS runs there, whose daemon sets
    /// the GPU to `EXCLUSIVE_PROCESS` and so locks every other share's processes out. A share asking MPS (one of all
    /// the memory, which the scheduler gives no company; another share here is a force-deleted pod's, still
    /// prepared) waits for the others to be unprepared, and a share waits while one with an MPS daemon holds the GPU.
    /// As (its UID, the device).
    pub fn share_beside_mps(&self, claim_uid: &str, wanted: &PreparedDevice, wants_mps: bool) -> Option<(&str, &str)> {
        wanted.share_id.as_ref()?;
        self.claims
            .iter()
            .filter(|(uid, entry)| *uid != claim_uid && !entry.recovered && (wants_mps || entry.mps.is_some()))
            .find_map(|(uid, entry)| {
                let held = entry
                    .devices
                    .iter()
                    .find(|held| held.pool == wanted.pool && held.device == wanted.device && !held.admin_access)?;
                Some((uid.as_str(), held.device.as_str()))
            })
    }

    /// Another claim (not `claim_uid`) holding a share of `wanted`'s device whose memory, with the shares of it
    /// prepared here, leaves less than `wanted` consumes of the GPU's `capacity`: the scheduler never allocates
    /// more than the GPU has, so the other share is a pod's that is gone from the API (force-deleted) while its
    /// containers may still run on the GPU. The new share waits until it is unprepared, as a whole GPU does
    /// ([`Self::conflicting_owner`]). As (its UID, the memory the prepared shares hold).
    pub fn memory_taken(&self, claim_uid: &str, wanted: &PreparedDevice, capacity: u64) -> Option<(&str, u64)> {
        let (_, wants) = (wanted.share_id.as_ref()?, wanted.memory_bytes?);
        let holders: Vec<(&str, u64)> = self
            .claims
            .iter()
            .filter(|(uid, entry)| *uid != claim_uid && !entry.recovered)
            .flat_map(|(uid, entry)| entry.devices.iter().map(move |held| (uid.as_str(), held)))
            .filter(|(_, held)| held.pool == wanted.pool && held.device == wanted.device && !held.admin_access)
            .filter_map(|(uid, held)| Some((uid, held.share_id.as_ref().and(held.memory_bytes)?)))
            .collect();
        let taken: u64 = holders.iter().map(|(_, bytes)| bytes).sum();
        let first = holders.first()?.0;
        (taken.saturating_add(wants) > capacity).then_some((first, taken))
    }

    /// The entry of claim `uid` when its prepare completed (a repeated prepare may answer from it); never a
    /// recovered entry, whose answer is unknown.
    pub fn completed(&self, uid: &str) -> Option<&ClaimEntry> {
        self.claims.get(uid).filter(|entry| entry.state == PrepareState::PrepareCompleted && !entry.recovered)
    }

    /// Half-done prepares (`PrepareStarted`) as `(claim UID, entry)`: after a restart, their CDI files and device
    /// state are to be cleaned up before anything else is prepared.
    pub fn half_prepared(&self) -> impl Iterator<Item = (&str, &ClaimEntry)> {
        self.claims
            .iter()
            .filter(|(_, entry)| entry.state == PrepareState::PrepareStarted)
            .map(|(uid, entry)| (uid.as_str(), entry))
    }

    /// Every device of `pool` with its holders, as `(claim UID, device)`: what [`super::time_slice`] decides from.
    pub fn holders<'a, 'q>(
        &'a self,
        pool: &'q str,
        device: &'q str,
    ) -> impl Iterator<Item = (&'a str, &'a PreparedDevice)> + use<'a, 'q> {
        self.claims.iter().flat_map(move |(uid, entry)| {
            entry.devices.iter().filter(move |d| d.pool == pool && d.device == device).map(move |d| (uid.as_str(), d))
        })
    }
}

/// What [`CheckpointStore::load`] found, with the checkpoint to continue from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// Always for the current boot: empty unless the outcome is [`LoadOutcome::Loaded`].
    pub checkpoint: Checkpoint,
    pub outcome: LoadOutcome,
}

/// How loading went. Only `Loaded` carries entries over; the caller should save the returned checkpoint in the other
/// cases so that the next start-up does not report the same thing again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadOutcome {
    /// No checkpoint file: first start on this node.
    Fresh,
    /// The file was valid and from this boot (or the boot could not be told, see [`boot_id`]).
    Loaded,
    /// The file was valid but written during another boot: device state from then is gone, so its entries were
    /// dropped. They are returned (claim UID → entry) so the caller can log them, or re-write their CDI specs if it
    /// chooses; the kubelet calls `NodePrepareResources` again for the pods that restart.
    PreviousBoot { dropped: BTreeMap<String, ClaimEntry> },
    /// The file could not be trusted (unreadable, not JSON, truncated, wrong checksum, unknown version): an empty
    /// checkpoint is returned and the file left in place; the caller rebuilds the record, saves it with
    /// [`CheckpointStore::replace_corrupt`] (which keeps the bad file aside) and emits a Warning event. Until then
    /// every start finds the same file and reports `Corrupt` again.
    Corrupt { reason: String },
}

/// Failures that leave the state directory unusable; everything else about a bad file is a [`LoadOutcome`]. The
/// message carries its cause: it reaches the kubelet (and the pod's events) as a string.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("create the checkpoint directory {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("keep the untrusted checkpoint {} aside before replacing it: {source}", path.display())]
    KeepAside {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("encode the checkpoint for {}: {source}", path.display())]
    Encode {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("write the checkpoint {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The checkpoint file in the agent's state directory. One agent process owns it.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    path: PathBuf,
}

impl CheckpointStore {
    /// The store for `state_dir/checkpoint.json`.
    pub fn new(state_dir: &Path) -> Self {
        Self { path: state_dir.join(CHECKPOINT_FILE) }
    }

    /// The checkpoint file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Loads the checkpoint for the boot `current_boot_id`, creating the state directory when missing (so a directory
    /// the agent cannot write fails here, at start-up, not at the first prepare). A bad file never fails the load: it
    /// is reported as [`LoadOutcome::Corrupt`] and left in place; only a directory that cannot be created is an
    /// error.
    pub fn load(&self, current_boot_id: &str) -> Result<Loaded, CheckpointError> {
        let dir = self.dir();
        fs::create_dir_all(dir).map_err(|source| CheckpointError::CreateDir { path: dir.to_path_buf(), source })?;
        // A save killed before its rename leaves a temporary file; the checkpoint itself is intact either way.
        if let Err(e) = crate::fsutil::remove_abandoned_temporaries(dir, |name| name == CHECKPOINT_FILE) {
            tracing::warn!(dir = %dir.display(), error = %e, "removing abandoned temporary checkpoint files failed");
        }
        let fresh = Checkpoint::new(current_boot_id);
        let mut tries = 1;
        let bytes = loop {
            match fs::read(&self.path) {
                Ok(bytes) => break bytes,
                Err(err) if err.kind() == io::ErrorKind::NotFound => {
                    return Ok(Loaded { checkpoint: fresh, outcome: LoadOutcome::Fresh });
                }
                // Not the file's fault, maybe for a moment: read again before it is taken for corrupt (a good record
                // replaced by one rebuilt from the specs loses the claims' names, shares and MIG devices made). A
                // lasting one is taken for corrupt all the same: refusing to start, the plugin could unprepare
                // nothing, and every pod with a claim here would stay Terminating.
                Err(source) if is_io_failure(&source) && tries < READ_TRIES => {
                    tracing::warn!(path = %self.path.display(), error = %source, try_number = tries,
                                   "reading the checkpoint failed (an I/O error); reading it again");
                    tries += 1;
                    std::thread::sleep(READ_RETRY);
                }
                Err(source) => {
                    let how = if is_io_failure(&source) { format!(" ({tries} reads)") } else { String::new() };
                    let outcome = LoadOutcome::Corrupt { reason: format!("unreadable{how}: {source}") };
                    return Ok(Loaded { checkpoint: fresh, outcome });
                }
            }
        };
        let stored = match decode(&bytes) {
            Ok(stored) => stored,
            Err(reason) => return Ok(Loaded { checkpoint: fresh, outcome: LoadOutcome::Corrupt { reason } }),
        };
        if same_boot(&stored.boot_id, current_boot_id) {
            Ok(Loaded {
                checkpoint: Checkpoint {
                    claims: stored.claims,
                    time_sliced: stored.time_sliced,
                    exclusive_process: stored.exclusive_process,
                    driver: stored.driver,
                    unknown: stored.unknown,
                    ..fresh
                },
                outcome: LoadOutcome::Loaded,
            })
        } else {
            Ok(Loaded { checkpoint: fresh, outcome: LoadOutcome::PreviousBoot { dropped: stored.claims } })
        }
    }

    /// Replaces the file atomically (temporary file, fsync, rename, directory fsync): a crash leaves the old
    /// checkpoint or the new one, never half of one.
    pub fn save(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
        self.write(&self.encode(checkpoint)?)
    }

    fn encode(&self, checkpoint: &Checkpoint) -> Result<Vec<u8>, CheckpointError> {
        encode(checkpoint).map_err(|source| CheckpointError::Encode { path: self.path.clone(), source })
    }

    fn write(&self, bytes: &[u8]) -> Result<(), CheckpointError> {
        write_atomic(&self.path, bytes).map_err(|source| CheckpointError::Write { path: self.path.clone(), source })
    }

    /// [`save`](Self::save), unless the file already holds `checkpoint` (the same bytes; for a checkpoint with no
    /// entries, no file at all is the same, as [`load`](Self::load) reads a missing file as an empty one). Returns
    /// whether it wrote. Start-up saves what its clean-up changed this way: an agent restarted on a full disk with
    /// nothing to record then starts and serves, its prepares failing with the reason until space is freed, instead
    /// of retrying its start, unregistered, until then.
    pub fn save_if_changed(&self, checkpoint: &Checkpoint) -> Result<bool, CheckpointError> {
        let bytes = self.encode(checkpoint)?;
        let stored = match fs::read(&self.path) {
            Ok(stored) => stored == bytes,
            // The driver name alone is nothing to record.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                *checkpoint == Checkpoint { driver: checkpoint.driver.clone(), ..Checkpoint::new(&checkpoint.boot_id) }
            }
            Err(_) => false,
        };
        if stored {
            return Ok(false);
        }
        self.write(&bytes)?;
        Ok(true)
    }

    /// Saves `rebuilt` in place of a file [`load`](Self::load) found corrupt, keeping the bad file as
    /// `checkpoint.json.corrupt-<unix seconds>` (with `-<n>` appended when that name is taken, so an earlier corrupt
    /// file is never overwritten); returns that path. A regular file gets a second name (a hard link, or a copy where
    /// links are not supported) before the atomic save replaces it, so a crash at any point leaves either the corrupt
    /// file (the next start rebuilds again) or the rebuilt one. Anything else there (a directory) is renamed first.
    pub fn replace_corrupt(&self, rebuilt: &Checkpoint) -> Result<PathBuf, CheckpointError> {
        let keep_aside = || -> io::Result<PathBuf> {
            let target = crate::fsutil::aside_path(&self.path)?;
            if fs::symlink_metadata(&self.path)?.is_file() {
                if fs::hard_link(&self.path, &target).is_err() {
                    fs::copy(&self.path, &target)?;
                }
            } else {
                fs::rename(&self.path, &target)?;
            }
            Ok(target)
        };
        let aside = keep_aside().map_err(|source| CheckpointError::KeepAside { path: self.path.clone(), source })?;
        self.save(rebuilt)?;
        Ok(aside)
    }

    fn dir(&self) -> &Path {
        self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
    }
}

/// The ID of the running boot, read from [`BOOT_ID_PATH`].
///
/// When it cannot be read (no procfs, a sandbox hiding it) this returns an empty string, which means "unknown": a
/// checkpoint written or loaded with an unknown boot ID is kept as if from this boot, so a reboot is then NOT
/// detected and entries from before it are served as prepared. Keeping them is the lesser harm: dropping would lose
/// what unprepare needs to clean up.
pub fn boot_id() -> String {
    boot_id_from(Path::new(BOOT_ID_PATH))
}

/// [`boot_id`] read from `path` (trimmed); empty when unreadable.
pub fn boot_id_from(path: &Path) -> String {
    fs::read_to_string(path).map(|id| id.trim().to_owned()).unwrap_or_default()
}

/// Entries carry over when both boot IDs are known and equal, or when either is unknown (see [`boot_id`]).
fn same_boot(stored: &str, current: &str) -> bool {
    stored.is_empty() || current.is_empty() || stored == current
}

/// How many times a read failing with an I/O error is made before the file is taken for corrupt, and the pause
/// between them.
const READ_TRIES: u32 = 5;
const READ_RETRY: std::time::Duration = std::time::Duration::from_millis(200);

/// Whether a read failed for the disk's sake (an I/O error, a timeout), not for what is at the path (a directory,
/// a file it may not read): the first may read fine again, the second is a bad file.
fn is_io_failure(error: &io::Error) -> bool {
    const EIO: i32 = 5;
    matches!(error.kind(), io::ErrorKind::Interrupted | io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)
        || error.raw_os_error() == Some(EIO)
}

/// FNV-1a 64 over the canonical compact serialization of `value`, as 16 hex digits (a string, because JSON tools
/// lose precision on integers above 2^53).
fn checksum(value: &Value) -> Result<String, serde_json::Error> {
    Ok(format!("{:016x}", stable_hash(&serde_json::to_vec(value)?)))
}

#[derive(Serialize)]
struct FileOut<'a> {
    version: u64,
    checksum: String,
    checkpoint: &'a Value,
}

fn encode(checkpoint: &Checkpoint) -> Result<Vec<u8>, serde_json::Error> {
    let inner = serde_json::to_value(checkpoint)?;
    let checksum = checksum(&inner)?;
    let mut bytes = serde_json::to_vec_pretty(&FileOut { version: CHECKPOINT_VERSION, checksum, checkpoint: &inner })?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// The checkpoint in `bytes`, or why the file cannot be trusted.
fn decode(bytes: &[u8]) -> Result<Checkpoint, String> {
    let file: Value = serde_json::from_slice(bytes).map_err(|err| format!("not valid JSON: {err}"))?;
    let Value::Object(mut fields) = file else {
        return Err("not a JSON object".to_owned());
    };
    match fields.get("version") {
        Some(version) if version.as_u64() == Some(CHECKPOINT_VERSION) => {}
        Some(version) => {
            return Err(format!(
                "unsupported checkpoint version {version} (this agent reads version {CHECKPOINT_VERSION})"
            ));
        }
        None => return Err("no version field".to_owned()),
    }
    let Some(Value::String(recorded)) = fields.remove("checksum") else {
        return Err("no checksum string".to_owned());
    };
    let inner = fields.remove("checkpoint").ok_or_else(|| "no checkpoint field".to_owned())?;
    let actual = checksum(&inner).map_err(|err| format!("cannot re-encode the content: {err}"))?;
    if recorded != actual {
        return Err(format!("checksum mismatch: the file records {recorded}, its content hashes to {actual}"));
    }
    serde_json::from_value(inner)
        .map_err(|err| format!("content is not a version {CHECKPOINT_VERSION} checkpoint: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn device(pool: &str, device: &str, share_id: Option<&str>) -> PreparedDevice {
        PreparedDevice {
            unknown: Default::default(),
            request_names: vec!["gpu".to_owned()],
            pool: pool.to_owned(),
            device: device.to_owned(),
            cdi_device_ids: vec![format!("k8s.gpu.nvidia.com/claim=uid-{device}")],
            share_id: share_id.map(str::to_owned),
            admin_access: false,
            time_slice: None,
            made_mig: None,
            making_mig: false,
            memory_bytes: None,
        }
    }

    fn entry(name: &str, state: PrepareState, devices: Vec<PreparedDevice>) -> ClaimEntry {
        ClaimEntry {
            unknown: Default::default(),
            namespace: "default".to_owned(),
            name: name.to_owned(),
            state,
            devices,
            recovered: false,
            mps: None,
            metadata: None,
        }
    }

    #[test]
    fn claims_holding_a_device_are_every_holder_once() {
        let mut checkpoint = sample("boot");
        let mut c = entry("c", PrepareState::PrepareCompleted, vec![device("node1", "gpu-1", Some("s2"))]);
        c.devices.push(device("node1", "gpu-1", Some("s3")));
        checkpoint.claims.insert("uid-c".to_owned(), c);
        let held: Vec<&str> = checkpoint.claims_holding("node1", "gpu-1").into_iter().map(|(uid, _)| uid).collect();
        assert_eq!(held, ["uid-b", "uid-c"]);
        assert!(checkpoint.claims_holding("node2", "gpu-1").is_empty());
        assert!(checkpoint.claims_holding("node1", "gpu-7").is_empty());
        let d = entry("d", PrepareState::PrepareCompleted, vec![device("node1", "gpu-1-mig-19-4-1", None)]);
        checkpoint.claims.insert("uid-d".to_owned(), d);
        let held: Vec<&str> = checkpoint.claims_holding("node1", "gpu-1").into_iter().map(|(uid, _)| uid).collect();
        assert_eq!(held, ["uid-b", "uid-c", "uid-d"], "a GPU's fault affects the claims on its MIG devices");
        assert!(checkpoint.claims_holding("node1", "gpu-1-mig-19-4-1").iter().all(|(uid, _)| *uid == "uid-d"));
        assert!(checkpoint.claims_holding("node1", "gpu-10").is_empty(), "gpu-1's prefix is no match");
    }

    fn sample(boot: &str) -> Checkpoint {
        let mut checkpoint = Checkpoint::new(boot);
        checkpoint.claims.insert(
            "uid-a".to_owned(),
            entry("a", PrepareState::PrepareCompleted, vec![device("node1", "gpu-0", None)]),
        );
        checkpoint.claims.insert(
            "uid-b".to_owned(),
            entry("b", PrepareState::PrepareStarted, vec![device("node1", "gpu-1", Some("s1"))]),
        );
        checkpoint
    }

    fn names(dir: &Path) -> io::Result<Vec<String>> {
        let mut names: Vec<String> = fs::read_dir(dir)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()?;
        names.sort();
        Ok(names)
    }

    /// Loads and asserts a `Corrupt` outcome with an empty checkpoint for the current boot and the file untouched;
    /// then saves a rebuilt checkpoint in its place and asserts the bad file was kept aside, byte for byte. Returns
    /// the reason.
    fn expect_corrupt(store: &CheckpointStore, original: &[u8]) -> Result<String, Box<dyn std::error::Error>> {
        let loaded = store.load("boot-1")?;
        assert_eq!(loaded.checkpoint, Checkpoint::new("boot-1"));
        let LoadOutcome::Corrupt { reason } = loaded.outcome else {
            panic!("expected Corrupt, got {:?}", loaded.outcome);
        };
        assert_eq!(fs::read(store.path())?, original, "the corrupt file must stay until a rebuilt one is saved");
        let rebuilt = sample("boot-1");
        let moved_to = store.replace_corrupt(&rebuilt)?;
        let moved_name = moved_to.file_name().ok_or("no file name")?.to_string_lossy().into_owned();
        assert!(moved_name.starts_with("checkpoint.json.corrupt-"), "{moved_name}");
        assert_eq!(fs::read(&moved_to)?, original);
        assert_eq!(store.load("boot-1")?, Loaded { checkpoint: rebuilt, outcome: LoadOutcome::Loaded });
        Ok(reason)
    }

    #[test]
    fn round_trip() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        store.save(&sample("boot-1"))?;
        let loaded = store.load("boot-1")?;
        assert_eq!(loaded, Loaded { checkpoint: sample("boot-1"), outcome: LoadOutcome::Loaded });
        Ok(())
    }

    #[test]
    fn fresh_directory_is_created() -> TestResult {
        let dir = tempfile::tempdir()?;
        let state = dir.path().join("plugins").join("gpu");
        let loaded = CheckpointStore::new(&state).load("boot-1")?;
        assert_eq!(loaded, Loaded { checkpoint: Checkpoint::new("boot-1"), outcome: LoadOutcome::Fresh });
        assert!(state.is_dir());
        Ok(())
    }

    #[test]
    fn unusable_directory_is_an_error() -> TestResult {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("not-a-dir");
        fs::write(&file, b"")?;
        let err = CheckpointStore::new(&file.join("state")).load("boot-1").err().ok_or("expected an error")?;
        assert!(matches!(err, CheckpointError::CreateDir { .. }), "{err:?}");
        assert!(err.to_string().starts_with("create the checkpoint directory "), "{err}");
        assert!(std::error::Error::source(&err).is_some());
        Ok(())
    }

    #[test]
    fn invalid_json_is_moved_aside() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        fs::write(store.path(), b"{not json")?;
        let reason = expect_corrupt(&store, b"{not json")?;
        assert!(reason.contains("not valid JSON"), "{reason}");
        Ok(())
    }

    /// A rebuild that fails (or an agent killed during it) saves nothing: the next start finds the same corrupt
    /// file, never an empty record that would make every CDI spec look orphaned.
    #[test]
    fn a_corrupt_file_stays_until_a_rebuilt_one_is_saved() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        fs::write(store.path(), b"{\"version\": 1, \"checks")?;
        for _ in 0..2 {
            assert!(matches!(store.load("boot-1")?.outcome, LoadOutcome::Corrupt { .. }));
        }
        assert_eq!(names(dir.path())?, [CHECKPOINT_FILE]);
        Ok(())
    }

    #[test]
    fn unreadable_file_is_moved_aside() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        fs::create_dir(store.path())?;
        let loaded = store.load("boot-1")?;
        let LoadOutcome::Corrupt { reason } = loaded.outcome else {
            panic!("expected Corrupt, got {:?}", loaded.outcome);
        };
        assert!(reason.starts_with("unreadable: "), "{reason}");
        let moved_to = store.replace_corrupt(&Checkpoint::new("boot-1"))?;
        assert!(moved_to.is_dir() && store.path().is_file());
        Ok(())
    }

    /// Claims prepared for another driver name: the name recorded, or in a file of a version before it was kept,
    /// the vendor of the claims' CDI ids; named by namespace/name (by UID when adopted from a spec), ten at most.
    #[test]
    fn claims_of_another_driver_are_found_by_the_name_recorded_or_their_cdi_ids() {
        let mut checkpoint = Checkpoint::new("boot-1");
        assert_eq!(checkpoint.prepared_for_another("k8s.gpu.nvidia.com"), None, "nothing prepared");
        checkpoint
            .claims
            .insert("uid-a".into(), entry("a", PrepareState::PrepareCompleted, vec![device("n", "gpu-0", None)]));
        assert_eq!(checkpoint.prepared_for_another("k8s.gpu.nvidia.com"), None, "its CDI ids are this driver's");
        let others = Some(("k8s.gpu.nvidia.com".to_string(), vec!["default/a".to_string()]));
        assert_eq!(checkpoint.prepared_for_another("renamed.example.com"), others, "read from the CDI ids");
        checkpoint.driver = "k8s.gpu.nvidia.com".into();
        assert_eq!(checkpoint.prepared_for_another("k8s.gpu.nvidia.com"), None);
        assert_eq!(checkpoint.prepared_for_another("renamed.example.com"), others, "the name recorded");
        for i in 0..11 {
            let adopted = ClaimEntry {
                name: String::new(),
                recovered: true,
                ..entry("", PrepareState::PrepareCompleted, Vec::new())
            };
            checkpoint.claims.insert(format!("uid-r{i:02}"), adopted);
        }
        let (_, named) = checkpoint.prepared_for_another("renamed.example.com").unwrap_or_default();
        assert_eq!((named.len(), named[1].as_str(), named[10].as_str()), (11, "UID uid-r00", "and 2 more"));
    }

    /// An I/O error reading the file (a failing or overloaded disk) is read again (five times in a second) before
    /// the file is taken for corrupt; what is wrong with the path itself (a directory there, no permission) makes
    /// it corrupt at once.
    #[test]
    fn an_io_error_is_no_corrupt_file() {
        let cases = [
            (io::Error::from_raw_os_error(5), true), // EIO
            (io::Error::from(io::ErrorKind::TimedOut), true),
            (io::Error::from(io::ErrorKind::Interrupted), true),
            (io::Error::from_raw_os_error(21), false), // EISDIR
            (io::Error::from_raw_os_error(13), false), // EACCES
            (io::Error::from(io::ErrorKind::InvalidData), false),
        ];
        for (error, failure) in cases {
            assert_eq!(is_io_failure(&error), failure, "{error}");
        }
    }

    #[test]
    fn a_second_corrupt_file_does_not_overwrite_the_first() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        fs::write(store.path(), b"first")?;
        expect_corrupt(&store, b"first")?;
        fs::write(store.path(), b"second")?;
        expect_corrupt(&store, b"second")?;
        assert_eq!(names(dir.path())?.len(), 3);
        Ok(())
    }

    #[test]
    fn truncated_file_is_corrupt() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        store.save(&sample("boot-1"))?;
        let bytes = fs::read(store.path())?;
        let half = &bytes[..bytes.len() / 2];
        fs::write(store.path(), half)?;
        expect_corrupt(&store, half)?;
        Ok(())
    }

    #[test]
    fn wrong_checksum_is_corrupt() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        store.save(&sample("boot-1"))?;
        let tampered = fs::read_to_string(store.path())?.replace("gpu-0", "gpu-7");
        fs::write(store.path(), &tampered)?;
        let reason = expect_corrupt(&store, tampered.as_bytes())?;
        assert!(reason.contains("checksum mismatch"), "{reason}");
        Ok(())
    }

    #[test]
    fn unknown_version_is_corrupt() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        let file = br#"{"version": 2, "checksum": "0", "checkpoint": {"bootId": "boot-1", "claims": {}}}"#;
        fs::write(store.path(), file)?;
        let reason = expect_corrupt(&store, file)?;
        assert!(reason.contains("version 2"), "{reason}");
        Ok(())
    }

    #[test]
    fn valid_json_of_the_wrong_shape_is_corrupt() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        let inner = serde_json::json!({"bootId": "boot-1", "claims": {"uid-a": {"state": "Prepared"}}});
        let file =
            serde_json::to_vec(&serde_json::json!({"version": 1, "checksum": checksum(&inner)?, "checkpoint": inner}))?;
        fs::write(store.path(), &file)?;
        let reason = expect_corrupt(&store, &file)?;
        assert!(reason.contains("not a version 1 checkpoint"), "{reason}");
        Ok(())
    }

    /// A file as written by this version, byte for byte: a change in the encoding or the checksum would make every
    /// node's checkpoint "corrupt" after an agent upgrade.
    #[test]
    fn reads_the_version_1_format() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        let mut checkpoint = Checkpoint::new("boot-1");
        checkpoint.claims.insert(
            "uid-a".to_owned(),
            entry("a", PrepareState::PrepareCompleted, vec![device("node1", "gpu-0", Some("s1"))]),
        );
        let golden = r#"{
  "version": 1,
  "checksum": "8b7ab56587a7a4ea",
  "checkpoint": {
    "bootId": "boot-1",
    "claims": {
      "uid-a": {
        "devices": [
          {
            "cdiDeviceIds": [
              "k8s.gpu.nvidia.com/claim=uid-gpu-0"
            ],
            "device": "gpu-0",
            "pool": "node1",
            "requestNames": [
              "gpu"
            ],
            "shareId": "s1"
          }
        ],
        "name": "a",
        "namespace": "default",
        "state": "PrepareCompleted"
      }
    }
  }
}
"#;
        fs::write(store.path(), golden)?;
        assert_eq!(store.load("boot-1")?, Loaded { checkpoint: checkpoint.clone(), outcome: LoadOutcome::Loaded });
        store.save(&checkpoint)?;
        assert_eq!(fs::read_to_string(store.path())?, golden);
        Ok(())
    }

    /// A newer agent's fields (same format version) are kept through this agent's saves, at every level, so that a
    /// rollback and an upgrade again lose nothing they record; a claim this agent changes keeps them too.
    #[test]
    fn fields_of_a_newer_agent_are_kept_through_a_save() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        let mut newer = serde_json::to_value(Checkpoint::new("boot-1"))?;
        let mut claim =
            serde_json::to_value(entry("a", PrepareState::PrepareCompleted, vec![device("node1", "gpu-0", None)]))?;
        claim["devices"][0]["madeVgpu"] = serde_json::json!("vgpu-7");
        claim["resetOnUnprepare"] = serde_json::json!(true);
        newer["claims"] = serde_json::json!({ "uid-a": claim });
        newer["gpusToReset"] = serde_json::json!(["gpu-1"]);
        let file = serde_json::json!({"version": 1, "checksum": checksum(&newer)?, "checkpoint": newer});
        fs::write(store.path(), serde_json::to_vec(&file)?)?;

        let mut loaded = store.load("boot-1")?;
        assert_eq!(loaded.outcome, LoadOutcome::Loaded);
        loaded.checkpoint.time_sliced.insert("gpu-0".into());
        store.save(&loaded.checkpoint)?;
        let saved: Value = serde_json::from_slice(&fs::read(store.path())?)?;
        let saved = &saved["checkpoint"];
        assert_eq!(saved["gpusToReset"], serde_json::json!(["gpu-1"]));
        assert_eq!(saved["claims"]["uid-a"]["resetOnUnprepare"], serde_json::json!(true));
        assert_eq!(saved["claims"]["uid-a"]["devices"][0]["madeVgpu"], serde_json::json!("vgpu-7"));
        assert_eq!(store.load("boot-1")?.checkpoint, loaded.checkpoint, "the saved file reads back the same");
        Ok(())
    }

    /// Admin access and recovered entries are written only when set: files of the format above stay byte-identical,
    /// and an older agent reading a newer file ignores the fields (it does not deny unknown fields).
    #[test]
    fn admin_access_and_recovered_entries_round_trip() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        let mut checkpoint = Checkpoint::new("boot-1");
        let admin = PreparedDevice { admin_access: true, ..device("node1", "gpu-0", None) };
        checkpoint.claims.insert("uid-m".to_owned(), entry("m", PrepareState::PrepareCompleted, vec![admin]));
        let recovered = ClaimEntry { recovered: true, ..entry("", PrepareState::PrepareCompleted, Vec::new()) };
        checkpoint.claims.insert("uid-r".to_owned(), recovered);
        store.save(&checkpoint)?;
        let text = fs::read_to_string(store.path())?;
        assert_eq!(
            (text.matches("\"adminAccess\": true").count(), text.matches("\"recovered\": true").count()),
            (1, 1)
        );
        assert_eq!(store.load("boot-1")?.checkpoint, checkpoint);
        Ok(())
    }

    #[test]
    fn previous_boot_entries_are_dropped_and_reported() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        store.save(&sample("boot-1"))?;
        let loaded = store.load("boot-2")?;
        assert_eq!(loaded.checkpoint, Checkpoint::new("boot-2"));
        assert_eq!(loaded.outcome, LoadOutcome::PreviousBoot { dropped: sample("boot-1").claims });
        Ok(())
    }

    #[test]
    fn unknown_boot_id_keeps_entries() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        store.save(&sample(""))?;
        assert_eq!(store.load("boot-2")?, Loaded { checkpoint: sample("boot-2"), outcome: LoadOutcome::Loaded });
        store.save(&sample("boot-1"))?;
        assert_eq!(store.load("")?, Loaded { checkpoint: sample(""), outcome: LoadOutcome::Loaded });
        Ok(())
    }

    #[test]
    fn save_leaves_no_temporary_files() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        store.save(&sample("boot-1"))?;
        store.save(&Checkpoint::new("boot-1"))?;
        assert_eq!(names(dir.path())?, vec![CHECKPOINT_FILE.to_owned()]);
        assert_eq!(store.load("boot-1")?.checkpoint, Checkpoint::new("boot-1"));
        Ok(())
    }

    #[test]
    fn save_if_changed_writes_only_what_the_file_does_not_hold() -> TestResult {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::new(dir.path());
        // An empty checkpoint and no file are the same to load: nothing written.
        assert!(!store.save_if_changed(&Checkpoint::new("boot-1"))?);
        assert!(names(dir.path())?.is_empty());
        assert!(store.save_if_changed(&sample("boot-1"))?);
        let written = fs::metadata(store.path())?.modified()?;
        assert!(!store.save_if_changed(&store.load("boot-1")?.checkpoint)?, "the loaded checkpoint is the stored one");
        assert_eq!(fs::metadata(store.path())?.modified()?, written);
        // A changed entry, a new boot, or an emptied checkpoint over a file are written.
        let mut changed = sample("boot-1");
        changed.claims.remove("uid-b");
        assert!(store.save_if_changed(&changed)?);
        assert!(store.save_if_changed(&sample("boot-2"))?);
        assert!(store.save_if_changed(&Checkpoint::new("boot-2"))?);
        assert_eq!(
            store.load("boot-2")?,
            Loaded { checkpoint: Checkpoint::new("boot-2"), outcome: LoadOutcome::Loaded }
        );
        Ok(())
    }

    /// Shares of one GPU go side by side, unless one of them runs MPS (its daemon makes the GPU exclusive to it).
    #[test]
    fn no_share_beside_an_mps_share() {
        let mut checkpoint = Checkpoint::new("boot-1");
        let share = |id: &str| device("node1", "gpu-0", Some(id));
        checkpoint.claims.insert("uid-a".to_owned(), entry("a", PrepareState::PrepareCompleted, vec![share("s1")]));
        // A plain share beside a plain share: fine; an MPS share beside it waits.
        assert_eq!(checkpoint.share_beside_mps("uid-c", &share("s2"), false), None);
        assert_eq!(checkpoint.share_beside_mps("uid-c", &share("s2"), true), Some(("uid-a", "gpu-0")));
        // A share beside one that runs MPS waits; a whole GPU is [`Checkpoint::conflicting_owner`]'s to judge.
        let daemon = super::super::mps::MpsDaemon {
            uuids: vec!["GPU-0".into()],
            active_thread_percentage: None,
            pinned_mib: BTreeMap::new(),
        };
        if let Some(a) = checkpoint.claims.get_mut("uid-a") {
            a.mps = Some(daemon);
        }
        assert_eq!(checkpoint.share_beside_mps("uid-c", &share("s2"), false), Some(("uid-a", "gpu-0")));
        assert_eq!(checkpoint.share_beside_mps("uid-c", &device("node1", "gpu-0", None), false), None);
        assert_eq!(checkpoint.share_beside_mps("uid-a", &share("s1"), true), None, "its own share");
        assert_eq!(checkpoint.share_beside_mps("uid-c", &device("node1", "gpu-1", Some("s3")), true), None);
    }

    #[test]
    fn helpers() {
        let checkpoint = sample("boot-1");
        assert_eq!(checkpoint.device_owner("node1", "gpu-0"), Some("uid-a"));
        assert_eq!(checkpoint.device_owner("node1", "gpu-1"), Some("uid-b"));
        assert_eq!(checkpoint.device_owner("node1", "gpu-2"), None);
        assert_eq!(checkpoint.device_owner("node2", "gpu-0"), None);

        // Exclusive device held by uid-a: anyone else conflicts, uid-a itself does not.
        assert_eq!(checkpoint.conflicting_owner("uid-c", &device("node1", "gpu-0", None)).map(|c| c.0), Some("uid-a"));
        assert_eq!(
            checkpoint.conflicting_owner("uid-c", &device("node1", "gpu-0", Some("s9"))).map(|c| c.0),
            Some("uid-a")
        );
        assert_eq!(checkpoint.conflicting_owner("uid-a", &device("node1", "gpu-0", None)), None);
        // Share s1 held by uid-b (still PrepareStarted): another share is fine, the same share or the whole is not.
        assert_eq!(checkpoint.conflicting_owner("uid-c", &device("node1", "gpu-1", Some("s2"))), None);
        assert_eq!(
            checkpoint.conflicting_owner("uid-c", &device("node1", "gpu-1", Some("s1"))).map(|c| c.0),
            Some("uid-b")
        );
        assert_eq!(checkpoint.conflicting_owner("uid-c", &device("node1", "gpu-1", None)).map(|c| c.0), Some("uid-b"));

        // A GPU held whole conflicts with its MIG devices, and a MIG device with its GPU and overlapping ones (a
        // claim prepared by 0.1.0, which published a GPU in MIG mode whole, and one for its MIG devices now).
        let mig = |name: &str| device("node1", name, None);
        assert_eq!(checkpoint.conflicting_owner("uid-c", &mig("gpu-0-mig-19-4-1")), Some(("uid-a", "gpu-0")));
        assert_eq!(checkpoint.conflicting_owner("uid-c", &mig("gpu-1-mig-19-4-1")), Some(("uid-b", "gpu-1")));
        assert_eq!(checkpoint.conflicting_owner("uid-c", &mig("gpu-2-mig-19-4-1")), None);
        let mut with_mig = checkpoint.clone();
        let held = entry("g", PrepareState::PrepareCompleted, vec![mig("gpu-5-mig-9-0-4")]);
        with_mig.claims.insert("uid-g".to_owned(), held);
        assert_eq!(with_mig.conflicting_owner("uid-c", &mig("gpu-5")), Some(("uid-g", "gpu-5-mig-9-0-4")));
        assert_eq!(with_mig.conflicting_owner("uid-c", &mig("gpu-5-mig-19-3-1")), Some(("uid-g", "gpu-5-mig-9-0-4")));
        assert_eq!(with_mig.conflicting_owner("uid-c", &mig("gpu-5-mig-19-4-1")), None);

        // A monitoring claim with admin access on gpu-2 and a recovered entry on gpu-3 make neither busy.
        let mut checkpoint = checkpoint;
        let admin = PreparedDevice { admin_access: true, ..device("node1", "gpu-2", None) };
        checkpoint.claims.insert("uid-m".to_owned(), entry("m", PrepareState::PrepareCompleted, vec![admin]));
        let recovered = entry("", PrepareState::PrepareCompleted, vec![device("node1", "gpu-3", None)]);
        checkpoint.claims.insert("uid-r".to_owned(), ClaimEntry { recovered: true, ..recovered });
        assert_eq!(checkpoint.conflicting_owner("uid-c", &device("node1", "gpu-2", None)), None);
        assert_eq!(checkpoint.conflicting_owner("uid-c", &device("node1", "gpu-3", None)), None);
        assert_eq!(checkpoint.completed("uid-r"), None, "a recovered entry is planned again, never answered from");

        assert_eq!(checkpoint.completed("uid-a").map(|e| e.name.as_str()), Some("a"));
        assert_eq!(checkpoint.completed("uid-b"), None);
        assert_eq!(checkpoint.completed("uid-z"), None);
        let half: Vec<_> = checkpoint.half_prepared().map(|(uid, _)| uid).collect();
        assert_eq!(half, vec!["uid-b"]);
    }

    #[test]
    fn boot_id_is_read_trimmed_or_empty() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("boot_id");
        fs::write(&path, "5f0c3a52-1d5e-4b8e-9a57-2f3c1b9e0d11\n")?;
        assert_eq!(boot_id_from(&path), "5f0c3a52-1d5e-4b8e-9a57-2f3c1b9e0d11");
        assert_eq!(boot_id_from(&dir.path().join("missing")), "");
        Ok(())
    }
}
