//! Unpreparing claims in batches: under the state lock each claim's spec and device metadata are removed, its MIG
//! devices destroyed, and one save drops the entries of those done; a claim whose MPS daemon is supervised has it
//! stopped with the lock let go, and a second save drops its entry.

use super::super::allocation::ClaimRef;
use super::super::checkpoint::{Checkpoint, ClaimEntry};
use super::{ClaimResult, DriverState, undoing};
use crate::cdi;
use tracing::{info, warn};

/// A batch's claims once their files are removed.
struct Removed {
    /// Answered already: not prepared here, or being unprepared by another batch.
    answered: Vec<ClaimResult<()>>,
    /// Whose files are gone (or whose removal failed): their entries are dropped (or kept) next.
    done: Vec<(ClaimRef, Result<(), String>)>,
    /// Whose MPS daemons are still to be stopped, with the lock let go.
    stopping: Vec<ClaimRef>,
}

impl DriverState {
    /// Does every unprepare queued by the time the lock is free, in one batch. A claim's MPS daemon is stopped with
    /// the lock let go: one that does not quit takes seconds (a tenant's workload can make it so), and the node's
    /// other prepares and unprepares go on meanwhile. The claim's entry, listing its GPUs, stays until the daemon
    /// is stopped, so that they are not handed out before.
    pub(super) fn commit_unprepares(&self) {
        let mut checkpoint = self.lock();
        let Some((batch, replies)) = self.unprepares.take() else { return };
        let Removed { mut answered, done, stopping } = self.remove_files(&mut checkpoint, batch);
        // The batch's other claims are done and recorded first: with the lock let go, an entry still completed
        // without its spec would have the spec written again by the look for lost specs.
        answered.extend(self.drop_entries(&mut checkpoint, done));
        if !stopping.is_empty() {
            drop(checkpoint);
            let uids: Vec<String> = stopping.iter().map(|claim| claim.uid.clone()).collect();
            let stopped: Vec<(ClaimRef, Result<(), String>)> = stopping
                .into_iter()
                .map(|claim| {
                    let stopped = self.mps.stop(&claim.uid).map_err(|e| e.to_string());
                    (claim, stopped)
                })
                .collect();
            let mut checkpoint = self.lock();
            answered.extend(self.drop_entries(&mut checkpoint, stopped));
            let mut marked = self.mps_stopping.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            marked.retain(|uid| !uids.contains(uid));
        }
        replies.answer(answered);
    }

    /// Removes each claim's spec and device metadata and destroys its MIG devices. Its MPS daemon goes once no
    /// container can start with the spec: at once where none is supervised (asked of every claim: one whose entry
    /// lost the record, e.g. a recovered one, may still have a daemon's directories), else left to the caller.
    fn remove_files(&self, checkpoint: &mut Checkpoint, claims: Vec<ClaimRef>) -> Removed {
        let mut removed = Removed { answered: Vec::new(), done: Vec::new(), stopping: Vec::new() };
        let mut stopping = self.mps_stopping.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for claim in claims {
            // Whatever comes of it: a prepare asked before it must not be done after it (see `call_order`).
            self.order.unprepared(&claim.uid);
            if stopping.contains(&claim.uid) {
                let reason = format!("claim {claim} is being unprepared (its MPS daemon is stopping); retry");
                removed.answered.push((claim.uid, Err(reason)));
                continue;
            }
            if !checkpoint.claims.contains_key(&claim.uid) {
                removed.answered.push((claim.uid, Ok(())));
                continue;
            }
            // Its MIG devices go before its entry: a crash in between leaves them listed, to be destroyed by the
            // kubelet's next unprepare (the spec is gone already: no container starts with them).
            let result = cdi::remove_claim_spec(&self.cdi_dir, &self.cdi_kind, &claim.uid)
                .map_err(|e| e.to_string())
                .and_then(|()| self.remove_metadata(&claim.uid))
                .and_then(|()| self.destroy_made(checkpoint, &claim.uid));
            match result {
                Ok(()) if self.mps.supervises(&claim.uid) => {
                    // Marked unfinished meanwhile: its spec is not written again by the look for lost specs.
                    undoing(checkpoint.claims.get_mut(&claim.uid));
                    stopping.insert(claim.uid.clone());
                    removed.stopping.push(claim);
                }
                Ok(()) => {
                    let stopped = self.mps.stop(&claim.uid).map_err(|e| e.to_string());
                    removed.done.push((claim, stopped));
                }
                Err(e) => removed.done.push((claim, Err(e))),
            }
        }
        removed
    }

    /// Drops the entries of the claims unprepared and saves once; a failed one is kept, marked unfinished.
    fn drop_entries(
        &self,
        checkpoint: &mut Checkpoint,
        done: Vec<(ClaimRef, Result<(), String>)>,
    ) -> Vec<ClaimResult<()>> {
        let mut results = Vec::with_capacity(done.len());
        let mut removed: Vec<(ClaimRef, ClaimEntry)> = Vec::new();
        let mut marked = false;
        for (claim, result) in done {
            match result {
                Ok(()) => {
                    if let Some(entry) = checkpoint.claims.remove(&claim.uid) {
                        removed.push((claim, entry));
                    } else {
                        results.push((claim.uid, Ok(())));
                    }
                }
                Err(e) => {
                    warn!(claim = %claim, uid = %claim.uid, error = %e, "unpreparing the claim failed");
                    undoing(checkpoint.claims.get_mut(&claim.uid));
                    marked = true;
                    results.push((claim.uid, Err(e)));
                }
            }
        }
        if removed.is_empty() {
            // Only failures: their entries, now started, are saved so, where the disk allows, so that a restart
            // does not write their specs again (the kubelet's retry finishes them either way).
            if marked && let Err(e) = self.save(checkpoint) {
                warn!(error = %e, "recording failed unprepares as unfinished failed");
            }
            self.update_gauges(checkpoint);
            return results;
        }
        let saved = self.save(checkpoint);
        if saved.is_ok() {
            // After the save, the GPUs still listed: a crash or failure here leaves them for the next try. Every
            // listed GPU nobody asks for any more, so a set-back that failed earlier is tried again.
            if self.reset_idle_gpus(checkpoint)
                && let Err(e) = self.save(checkpoint)
            {
                // Still listed on disk: the next save, or start-up, records it (setting Default again is harmless).
                warn!(error = %e, "recording GPUs set back to their default time slice and compute mode failed");
            }
        }
        for (claim, entry) in removed {
            match &saved {
                Ok(()) => {
                    info!(claim = %claim, uid = %claim.uid, "unprepared claim");
                    results.push((claim.uid, Ok(())));
                }
                Err(e) => {
                    // Keep the entry (its spec is gone): the kubelet retries and the next save drops it.
                    results.push((claim.uid.clone(), Err(format!("record the unprepare in the checkpoint: {e}"))));
                    let mut entry = entry;
                    undoing(Some(&mut entry));
                    checkpoint.claims.insert(claim.uid, entry);
                }
            }
        }
        self.update_gauges(checkpoint);
        results
    }
}
