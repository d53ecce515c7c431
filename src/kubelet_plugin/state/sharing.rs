//! How the sharing a claim's configuration asks is applied to the node's GPUs while it is prepared: time slices
//! ([`super::super::time_slice`] decides them), the MPS daemon ([`super::super::mps`]) and the compute mode of the
//! GPUs it serves. Each setting changed is listed in the checkpoint before it is changed and taken off once it is
//! back at its default, so a crash or a failed restore is finished by the next unprepare or start-up.

use std::collections::{BTreeMap, BTreeSet};

use tracing::{info, warn};

use super::super::allocation::{ClaimRef, Inventory};
use super::super::checkpoint::Checkpoint;
use super::super::config::TimeSliceInterval;
use super::super::mps::{self, MpsDaemon};
use super::super::time_slice;
use super::{DriverState, Todo};
use crate::cdi;
use crate::node_agent::device::{self, Device};
use crate::node_agent::gpu_settings::ComputeMode;

impl DriverState {
    /// Sets the intervals `claim` asks of its GPUs, except where a completed claim already had the same set (one
    /// earlier in this batch counts: its entry is completed before the next claim's GPUs are set).
    pub(super) fn set_time_slices(
        &self,
        checkpoint: &Checkpoint,
        claim: &ClaimRef,
        devices: &[Device],
        asks: &BTreeMap<String, TimeSliceInterval>,
    ) -> Result<(), String> {
        for (device, interval) in asks {
            if time_slice::already_set(checkpoint, &self.pool, &claim.uid, device, *interval) {
                continue;
            }
            let Some(gpu) = devices.iter().find(|d| d.name() == *device).map(|d| &d.gpu) else { continue };
            self.gpu_settings.set_time_slice(gpu, *interval).map_err(|e| {
                format!(
                    "claim {claim}: set the time slice of device {device:?} (GPU {}) to {interval:?}: {e}",
                    gpu.uuid
                )
            })?;
            info!(claim = %claim, uid = %claim.uid, device, ?interval, "set the GPU's time slice");
        }
        Ok(())
    }

    /// Sets each device of `devices` that is in [`Checkpoint::time_sliced`] to what its holders ask now, taking it
    /// off the list (in memory: the next save records it) once it is back at `Default`. A GPU a recovered entry
    /// holds is left as it is (what that claim asked is unknown). A GPU gone from the node, or a failed set, stays
    /// listed (the next unprepare or start-up tries again) and is warned about.
    pub(super) fn reset_time_slices(&self, checkpoint: &mut Checkpoint, devices: &BTreeSet<String>) {
        let inventory = self.inventory.borrow().clone();
        let listed: Vec<&String> = devices
            .iter()
            .filter(|d| checkpoint.time_sliced.contains(*d))
            .filter(|d| !time_slice::held_by_recovered(checkpoint, &self.pool, d))
            .collect();
        for device in listed {
            if device::is_mig_device_name(device) || inventory.get(device).is_some_and(Device::is_mig) {
                // Never set for a MIG device (a checkpoint of an older agent may list one): nothing to set back.
                checkpoint.time_sliced.remove(device);
                continue;
            }
            let wanted = time_slice::wanted(checkpoint, &self.pool, device);
            let Some(gpu) = inventory.get(device).map(|d| &d.gpu) else {
                warn!(device, "a time-sliced GPU is gone from this node; its time slice is set when it is back");
                continue;
            };
            match self.gpu_settings.set_time_slice(gpu, wanted) {
                Ok(()) => {
                    info!(device, interval = ?wanted, "set the GPU's time slice to what its claims ask");
                    if wanted == TimeSliceInterval::Default {
                        checkpoint.time_sliced.remove(device);
                    }
                }
                Err(e) => {
                    self.metrics.time_slice_restore_failures.inc();
                    warn!(device, interval = ?wanted, error = %e, "setting the GPU's time slice failed; the next \
                        unprepare or start-up tries again");
                }
            }
        }
    }

    /// Kills every MPS daemon (the agent is stopping); their directories stay for the next start-up.
    pub fn stop_mps_daemons(&self) {
        self.mps.kill_all();
    }

    /// Starts the claim's MPS daemon, if it asks for one (noting whether this prepare started it), its GPUs set to
    /// `EXCLUSIVE_PROCESS` first (as NVIDIA's driver does: only the daemon's MPS server then makes CUDA contexts on
    /// them, so no container of the claim gets around the daemon's limits); the edits its containers get to be the
    /// daemon's clients.
    pub(super) fn start_mps(&self, todo: &mut Todo) -> Result<cdi::ClaimEdits, String> {
        let Some(daemon) = &todo.mps else { return Ok(cdi::ClaimEdits::default()) };
        for name in &todo.exclusive {
            let Some(gpu) = todo.devices.iter().find(|d| d.name() == *name).map(|d| &d.gpu) else { continue };
            self.gpu_settings.set_compute_mode(gpu, ComputeMode::ExclusiveProcess).map_err(|e| {
                format!(
                    "claim {}: set the compute mode of device {name:?} (GPU {}) to EXCLUSIVE_PROCESS for its MPS \
                         daemon: {e}",
                    todo.claim, gpu.uuid
                )
            })?;
        }
        todo.mps_started = self.mps.start(&todo.claim.uid, daemon).map_err(|e| e.to_string())?;
        Ok(self.mps_edits(&todo.claim.uid, daemon))
    }

    pub(super) fn mps_edits(&self, uid: &str, daemon: &MpsDaemon) -> cdi::ClaimEdits {
        let (env, mounts) = daemon.client_edits(&self.mps.dirs(uid));
        cdi::ClaimEdits { env, mounts, file_devices: Vec::new() }
    }

    /// Sets each device of `devices` that is in [`Checkpoint::exclusive_process`] and no claim's MPS daemon serves
    /// any more back to the `Default` compute mode, taking it off the list (in memory: the next save records it). A
    /// GPU gone from the node, or a failed set, stays listed (the next unprepare or start-up tries again).
    pub(super) fn reset_compute_modes(&self, checkpoint: &mut Checkpoint, devices: &BTreeSet<String>) {
        for (device, e) in self.set_back_compute_modes(checkpoint, devices) {
            self.metrics.compute_mode_restore_failures.inc();
            warn!(device, error = %e, "setting the GPU's compute mode back to DEFAULT failed; the next unprepare or \
                  start-up tries again");
        }
    }

    /// Before a claim that asks no MPS is prepared: its GPUs that an MPS claim's daemon left in `EXCLUSIVE_PROCESS`
    /// (a set-back that failed) are set back now, or the prepare fails saying so (the kubelet retries), so that a
    /// claim never gets a GPU left that way by a claim that is gone. Not the devices it holds with admin access: it
    /// changes nothing of those (an MPS claim of the same batch, not yet completed, may be about to use one).
    pub(super) fn ensure_default_compute_modes(&self, checkpoint: &mut Checkpoint, todo: &Todo) -> Result<(), String> {
        if todo.mps.is_some() {
            return Ok(());
        }
        let held = checkpoint.claims.get(&todo.claim.uid).map(|entry| &entry.devices[..]).unwrap_or_default();
        let devices = held.iter().filter(|d| !d.admin_access).map(|d| d.device.clone()).collect();
        let Some((device, e)) = self.set_back_compute_modes(checkpoint, &devices).into_iter().next() else {
            return Ok(());
        };
        self.metrics.compute_mode_restore_failures.inc();
        Err(format!(
            "claim {}: device {device:?} is still in the EXCLUSIVE_PROCESS compute mode an MPS claim's daemon needed, \
             and setting it back to DEFAULT failed: {e}",
            todo.claim
        ))
    }

    /// Sets the listed, idle devices among `devices` back to `Default` (see [`Self::reset_compute_modes`]); the
    /// devices that could not be, with why.
    fn set_back_compute_modes(&self, checkpoint: &mut Checkpoint, devices: &BTreeSet<String>) -> Vec<(String, String)> {
        let inventory = self.inventory.borrow().clone();
        // A daemon an unprepare is stopping (no longer supervised, its entry unfinished) still serves its GPUs.
        let serving = |uid: &str| self.mps.supervises(uid) || self.mps_stopping(uid);
        let idle = mps::exclusive_to_set_back(checkpoint, whole_gpu_uuid(&inventory), serving);
        let mut failed = Vec::new();
        for device in idle.iter().filter(|d| devices.contains(*d)) {
            if device::is_mig_device_name(device) || inventory.get(device).is_some_and(Device::is_mig) {
                checkpoint.exclusive_process.remove(device);
                continue;
            }
            let Some(gpu) = inventory.get(device).map(|d| &d.gpu) else {
                warn!(device, "a GPU set to EXCLUSIVE_PROCESS is gone from this node; it is set back when it is back");
                continue;
            };
            match self.gpu_settings.set_compute_mode(gpu, ComputeMode::Default) {
                Ok(()) => {
                    info!(device, "set the GPU's compute mode back to DEFAULT: no MPS daemon serves it");
                    checkpoint.exclusive_process.remove(device);
                }
                Err(e) => failed.push((device.clone(), e.to_string())),
            }
        }
        failed
    }

    /// Start-up, before the daemons of prepared claims are started again: `EXCLUSIVE_PROCESS` set again on every
    /// listed GPU a prepared claim's daemon serves (a driver reloaded without a reboot forgot it), as a prepare sets
    /// it before its daemon starts. The others are set back once the daemons run ([`Self::reset_compute_modes`]).
    pub(super) fn set_exclusive_again(&self, checkpoint: &Checkpoint) {
        let inventory = self.inventory.borrow().clone();
        let idle: BTreeSet<String> =
            mps::exclusive_to_set_back(checkpoint, whole_gpu_uuid(&inventory), |_| false).into_iter().collect();
        for device in checkpoint.exclusive_process.difference(&idle) {
            let Some(gpu) = inventory.get(device).filter(|d| !d.is_mig()).map(|d| &d.gpu) else { continue };
            if let Err(e) = self.gpu_settings.set_compute_mode(gpu, ComputeMode::ExclusiveProcess) {
                warn!(device, error = %e, "setting the compute mode of a GPU an MPS daemon serves failed");
            }
        }
    }

    /// Every listed GPU whose claims went back to its defaults: time slice and compute mode. Answers whether the
    /// lists changed (for the caller to save).
    pub(super) fn reset_idle_gpus(&self, checkpoint: &mut Checkpoint) -> bool {
        let before = (checkpoint.time_sliced.len(), checkpoint.exclusive_process.len());
        let idle = time_slice::to_set_back(checkpoint, &self.pool);
        self.reset_time_slices(checkpoint, &idle.into_iter().collect());
        let exclusive = checkpoint.exclusive_process.clone();
        self.reset_compute_modes(checkpoint, &exclusive);
        before != (checkpoint.time_sliced.len(), checkpoint.exclusive_process.len())
    }
}

/// A whole GPU's UUID by its device name (`None` for a MIG device or one gone from the node).
fn whole_gpu_uuid(inventory: &Inventory) -> impl Fn(&str) -> Option<String> + '_ {
    |name| inventory.get(name).filter(|d| !d.is_mig()).map(|d| d.uuid().to_string())
}
