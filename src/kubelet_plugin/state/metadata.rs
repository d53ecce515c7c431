//! A prepared claim's device metadata ([`super::super::device_metadata`]): the files written with its spec, the CDI
//! ids that hand them out, the mounts in its spec, and their removal with the claim. The files live and die with
//! the checkpoint entry: written after it is saved as started, removed before it is dropped, and at start-up those
//! of UIDs the checkpoint does not list are removed.

use std::collections::BTreeSet;

use tracing::{info, warn};

use super::super::checkpoint::{Checkpoint, ClaimEntry, PreparedDevice};
use super::super::device_metadata::{self as metadata, ClaimIdentity, MetadataDevice};
use super::{DriverState, Todo};
use crate::cdi;
use crate::node_agent::slices;

impl DriverState {
    /// Adds to the first device of each base request the CDI id of that request's metadata mount: the kubelet hands
    /// a container the ids of the devices of the requests it names, so only those containers get the file.
    pub(super) fn add_metadata_ids(&self, uid: &str, devices: &mut [PreparedDevice]) {
        let mut seen = BTreeSet::new();
        for device in devices {
            let Some(request) = device.request_names.first().cloned() else { continue };
            if seen.insert(request.clone()) {
                let id = self.cdi_kind.qualified_name(&metadata::cdi_device_name(uid, &request));
                device.cdi_device_ids.push(id);
            }
        }
    }

    /// Writes the metadata files of the claim `todo` prepares, when its entry asks for them: after its MIG devices
    /// were made, so a made device's UUID is among its attributes.
    pub(super) fn write_metadata(&self, checkpoint: &Checkpoint, todo: &Todo) -> Result<(), String> {
        let uid = &todo.claim.uid;
        let Some(claim) = checkpoint.claims.get(uid).and_then(|entry| identity(uid, entry)) else { return Ok(()) };
        let mut requests: Vec<(&str, Vec<MetadataDevice>)> = Vec::new();
        for (request, pool, name) in &todo.allocated {
            let attributes = todo.devices.iter().find(|d| d.name() == *name).map(slices::attributes);
            let device =
                MetadataDevice { pool: pool.clone(), name: name.clone(), attributes: attributes.unwrap_or_default() };
            match requests.iter_mut().find(|(r, _)| r == request) {
                Some((_, devices)) => devices.push(device),
                None => requests.push((request, vec![device])),
            }
        }
        let files: Vec<(String, Vec<u8>)> = requests
            .iter()
            .map(|(request, devices)| {
                let base = request.split('/').next().unwrap_or(request).to_string();
                (base, metadata::document(&self.driver, &claim, request, devices))
            })
            .collect();
        metadata::write_files(&self.state_dir, uid, &files)
            .map_err(|e| format!("write the device metadata files under {}: {e}", self.state_dir.display()))
    }

    /// The CDI devices of `entry`'s spec that mount its metadata files, one per base request (none when no files
    /// were written for it).
    pub(super) fn metadata_mounts(&self, uid: &str, entry: &ClaimEntry) -> Vec<cdi::FileDevice> {
        let Some(claim) = identity(uid, entry) else { return Vec::new() };
        let requests: BTreeSet<&String> = entry.devices.iter().filter_map(|d| d.request_names.first()).collect();
        requests
            .into_iter()
            .map(|request| cdi::FileDevice {
                name: metadata::cdi_device_name(uid, request),
                host_path: metadata::host_path(&self.state_dir, uid, request),
                container_path: metadata::container_path(&self.driver, &claim, request),
            })
            .collect()
    }

    /// The metadata devices the kubelet was handed for `entry` (its recorded CDI ids) that `made` lacks, as the spec
    /// on disk has them: a rewrite keeps them. An agent of an earlier version (`helm rollback`) drops the entry's
    /// metadata record when it saves the checkpoint, and once upgraded again, the rewrite at start would take the
    /// devices out of the spec, and every restart of a container of the claim would fail ("unresolvable CDI
    /// devices").
    pub(super) fn metadata_mounts_kept(
        &self,
        uid: &str,
        entry: &ClaimEntry,
        made: &[cdi::FileDevice],
    ) -> Vec<cdi::FileDevice> {
        let ids = entry.devices.iter().flat_map(|d| &d.cdi_device_ids);
        let prefix = self.cdi_kind.qualified_name(&metadata::cdi_device_name(uid, ""));
        let missing: Vec<String> = ids
            .filter(|id| id.starts_with(&prefix))
            .filter_map(|id| id.split_once('=').map(|(_, name)| name.to_string()))
            .filter(|name| made.iter().all(|device| device.name != *name))
            .collect();
        if missing.is_empty() {
            return Vec::new();
        }
        let kept = cdi::claim_spec_file_devices(&self.cdi_dir, &self.cdi_kind, uid, &missing).unwrap_or_default();
        if kept.len() < missing.len() {
            warn!(%uid, ?missing, "the device metadata mounts the kubelet was given for this claim are not recorded \
                  (dropped by an earlier agent version) and not all in its spec on disk: a restarted container of \
                  the claim that asks one will not start until its pod is recreated");
        }
        kept
    }

    /// Removes a claim's metadata files (after its spec, which mounts them, is gone).
    pub(super) fn remove_metadata(&self, uid: &str) -> Result<(), String> {
        metadata::remove_files(&self.state_dir, uid)
            .map_err(|e| format!("remove the device metadata files under {}: {e}", self.state_dir.display()))
    }

    /// Logs instead of failing: for clean-ups the next start-up repeats.
    pub(super) fn remove_metadata_logged(&self, uid: &str) {
        if let Err(error) = self.remove_metadata(uid) {
            warn!(%uid, %error, "removing device metadata files failed");
        }
    }

    /// Start-up: removes the metadata files of claims the checkpoint does not list (their entry was dropped by a
    /// crash between the two, or by an earlier boot); returns how many claims had some.
    pub(super) fn remove_orphaned_metadata(&self, checkpoint: &Checkpoint) -> usize {
        let uids = match metadata::claims_with_files(&self.state_dir) {
            Ok(uids) => uids,
            Err(error) => {
                warn!(%error, "listing device metadata files failed; stale ones stay until the next start");
                return 0;
            }
        };
        let mut removed = 0;
        for uid in uids.iter().filter(|uid| !checkpoint.claims.contains_key(*uid)) {
            if self.remove_metadata(uid).is_ok() {
                info!(%uid, "removed the device metadata files of a claim not prepared");
                removed += 1;
            }
        }
        removed
    }
}

/// Who a claim's metadata is about, from its checkpoint entry; `None` when no files were written for it.
fn identity<'a>(uid: &'a str, entry: &'a ClaimEntry) -> Option<ClaimIdentity<'a>> {
    let record = entry.metadata.as_ref()?;
    Some(ClaimIdentity {
        namespace: &entry.namespace,
        name: &entry.name,
        uid,
        pod_claim_name: record.pod_claim_name.as_deref(),
    })
}
