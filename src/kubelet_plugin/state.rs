//! The prepare/unprepare state machine: the checkpoint, the CDI specs on disk and this node's GPUs kept consistent.
//!
//! ```text
//!  NodePrepareResources ─▶ GET claims (concurrently) ─▶ allocation::plan ─┐
//!                                                                        ▼
//!   checkpoint: PrepareStarted (saved) ─▶ CDI spec per claim (atomic) ─▶ PrepareCompleted (saved) ─▶ CDI ids
//!  NodeUnprepareResources ─▶ remove spec ─▶ drop entry (saved); unknown claims succeed; a failure part-way
//!                            leaves the entry PrepareStarted (saved where the disk allows), finished by a retry
//! ```
//!
//! **Invariant:** a CDI spec exists only for a claim the checkpoint on disk lists (as started or completed), so a
//! crash at any point leaves nothing that start-up recovery cannot find and clean up. The one exception is a corrupt
//! checkpoint: while it is on disk, start-up deletes nothing and adopts every spec it finds (see
//! [`DriverState::start`]). File work happens under one lock, off the async threads (the lock is never awaited on
//! one, so a prepare stuck on a slow disk cannot starve the health checks); the API reads happen before it,
//! concurrently. Calls that arrive together are done together, with one pair of checkpoint saves
//! ([`group_commit`](super::group_commit)).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use tokio::sync::watch;
use tracing::{info, warn};

use super::allocation::{self, ClaimRef, Inventory, PlannedDevice};
use super::call_order::{CallOrder, Ticket};
use super::checkpoint::{
    Checkpoint, CheckpointError, CheckpointStore, ClaimEntry, LoadOutcome, MetadataRecord, PrepareState, PreparedDevice,
};
use super::config::TimeSliceInterval;
use super::group_commit::Queue;
pub use super::metrics::Operation;
use super::metrics::PluginMetrics;
use super::mps::{self, MpsDaemon};
use super::partitions;
use super::time_slice;
use crate::cdi::{self, CdiKind, DriverFiles};
use crate::node_agent::device::{self, Device};
use crate::node_agent::discovery::Discovery;
use crate::node_agent::gpu_settings::GpuSettings;
use crate::node_agent::mps_control::{MpsDaemons, MpsProgram};

mod metadata;
mod sharing;
mod unprepare;

/// A claim's outcome: its devices, or why it was refused.
pub type ClaimResult<T> = (String, Result<T, String>);

/// Errors that stop the plugin from starting.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("the driver name {driver:?} cannot name CDI devices: {source}")]
    CdiKind {
        driver: String,
        #[source]
        source: cdi::CdiError,
    },
    #[error("adopt the CDI specs in {dir} to rebuild the lost checkpoint: {source}")]
    AdoptSpecs {
        dir: PathBuf,
        #[source]
        source: cdi::CdiError,
    },
    #[error("start-up clean-up task failed: {0}")]
    Task(String),
    #[error(
        "the checkpoint in {state_dir} holds claims prepared for driver {recorded}, not {driver} ({}): the kubelet \
         unprepares them only through {recorded}'s plugin, and their GPUs would be published as free. Set the driver \
         name back to {recorded} until no pod on this node holds them (drain the node), then change it",
        claims.join(", ")
    )]
    OtherDriver { state_dir: PathBuf, recorded: String, driver: String, claims: Vec<String> },
}

/// What writing missing specs again did: how many were written, and the claims (UID) whose spec could not be, with
/// why.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Rewrites {
    pub written: usize,
    pub failed: Vec<(String, String)>,
}

/// How the record of prepared claims was lost, when it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lost {
    /// Unreadable: kept aside.
    Corrupt,
    /// No file.
    Missing,
}

/// What start-up found and did, for the log and Events.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// The checkpoint was unreadable: where it was kept aside and why.
    pub corrupt: Option<(PathBuf, String)>,
    /// CDI specs adopted as recovered entries after a corrupt or missing checkpoint.
    pub rebuilt: usize,
    /// The checkpoint was missing while this many specs of the driver's claims were on disk (all adopted): the
    /// record was lost, not a first start.
    pub missing: usize,
    /// Entries of an earlier boot dropped (their devices' state is gone; kubelet prepares again).
    pub previous_boot: usize,
    /// Half-done prepares cleaned up.
    pub half_done: usize,
    /// Specs re-written because they were missing (e.g. the CDI directory is a tmpfs that was emptied) or said
    /// something else than they would now (the driver upgraded while no agent ran, a changed driver root or MPS
    /// directory).
    pub rewritten: usize,
    /// Specs (and MPS daemon directories) of claims the checkpoint does not know as prepared, removed.
    pub orphans: usize,
}

/// Where and how claims are prepared.
#[derive(Debug)]
pub struct StateConfig {
    pub driver: String,
    /// This node's pool (the node name).
    pub pool: String,
    pub cdi_dir: PathBuf,
    pub state_dir: PathBuf,
    /// Where claims' MPS daemons keep their directories, and what a daemon is.
    pub mps_dir: PathBuf,
    pub mps_program: MpsProgram,
    pub driver_files: DriverFiles,
    pub boot_id: String,
    /// Sets the time slice a claim's `GpuConfig` asks of its GPUs, and the compute mode of those an MPS daemon serves.
    pub gpu_settings: Arc<dyn GpuSettings>,
    /// Makes and destroys the MIG devices of dynamic MIG partitions ([`super::partitions`]).
    pub mig_control: Arc<dyn Discovery>,
    /// Whether prepared claims' containers get device metadata files ([`super::device_metadata`]).
    pub device_metadata: bool,
}

/// The plugin's state; shared by the gRPC service and start-up recovery.
pub struct DriverState {
    driver: String,
    pool: String,
    client: kube::Client,
    inventory: watch::Receiver<Arc<Inventory>>,
    cdi_kind: CdiKind,
    cdi_dir: PathBuf,
    /// Where device metadata files are kept ([`super::device_metadata`]), when `device_metadata`.
    state_dir: PathBuf,
    device_metadata: bool,
    driver_files: DriverFiles,
    /// What on the host the specs on disk were written for, and the claims whose specs are still to be written
    /// again since it last changed (a driver upgraded in place, the unified-memory nodes appearing): see
    /// [`Self::restore_lost_specs`].
    stale_specs: Mutex<(SpecInputs, BTreeSet<String>)>,
    gpu_settings: Arc<dyn GpuSettings>,
    mig_control: Arc<dyn Discovery>,
    /// The MPS control daemons of prepared claims that asked MPS ([`super::mps`]).
    mps: MpsDaemons,
    /// The claims whose MPS daemons an unprepare is stopping, with the state lock let go: their prepares and
    /// other unprepares are refused until it is done.
    mps_stopping: Mutex<BTreeSet<String>>,
    store: CheckpointStore,
    checkpoint: Mutex<Checkpoint>,
    prepares: Queue<Asked, Vec<PreparedDevice>>,
    unprepares: Queue<ClaimRef, ()>,
    /// Which unprepare overtook which prepare ([`super::call_order`]).
    order: CallOrder,
    metrics: PluginMetrics,
}

impl std::fmt::Debug for DriverState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverState")
            .field("driver", &self.driver)
            .field("pool", &self.pool)
            .field("cdi_dir", &self.cdi_dir)
            .field("checkpoint", &self.store)
            .finish_non_exhaustive()
    }
}

impl DriverState {
    /// Loads the checkpoint and makes disk and checkpoint agree again (see [`Recovery`]) before anything is served.
    ///
    /// A corrupt checkpoint is rebuilt from the CDI specs on disk, not from the API: every spec of this driver is
    /// adopted as a recovered entry (its GPUs read from the spec's device names) and the rebuilt checkpoint saved in
    /// place of the corrupt one, which only then is kept aside. Nothing here needs the API server (it may be
    /// unreachable at boot, or the agent may lack a permission), nothing is deleted before the save, and a failure
    /// leaves the corrupt file for the next attempt. Recovered entries keep their specs until the kubelet unprepares
    /// them; a prepare of such a claim plans it again from the API. Reading claims back from the API instead would
    /// need a cluster-wide list of ResourceClaims, which the agent is not granted.
    pub async fn start(
        config: StateConfig,
        client: kube::Client,
        inventory: watch::Receiver<Arc<Inventory>>,
        metrics: PluginMetrics,
    ) -> Result<(Arc<Self>, Recovery), StateError> {
        let cdi_kind = CdiKind::from_driver_name(&config.driver)
            .map_err(|source| StateError::CdiKind { driver: config.driver.clone(), source })?;
        let store = CheckpointStore::new(&config.state_dir);
        let state_dir = config.state_dir.clone();
        let mut loaded = store.load(&config.boot_id)?;
        if let Some((recorded, claims)) = loaded.checkpoint.prepared_for_another(&config.driver) {
            return Err(StateError::OtherDriver {
                state_dir: config.state_dir,
                recorded,
                driver: config.driver,
                claims,
            });
        }
        loaded.checkpoint.driver = config.driver.clone();
        let state = Arc::new(Self {
            driver: config.driver,
            pool: config.pool,
            client,
            inventory,
            cdi_kind,
            cdi_dir: config.cdi_dir,
            state_dir,
            device_metadata: config.device_metadata,
            stale_specs: Mutex::new((SpecInputs::of(&config.driver_files), BTreeSet::new())),
            driver_files: config.driver_files,
            gpu_settings: config.gpu_settings,
            mig_control: config.mig_control,
            mps: MpsDaemons::new(config.mps_program, config.mps_dir, metrics.mps_daemon_restarts.clone()),
            mps_stopping: Mutex::default(),
            store,
            checkpoint: Mutex::new(loaded.checkpoint),
            prepares: Queue::new(metrics.waiting(Operation::Prepare)),
            unprepares: Queue::new(metrics.waiting(Operation::Unprepare)),
            order: CallOrder::default(),
            metrics,
        });
        let mut recovery = Recovery::default();
        match loaded.outcome {
            LoadOutcome::Loaded => {}
            LoadOutcome::Fresh => {
                // No record, yet specs of this driver's claims on disk: the record was lost (a wiped or changed
                // state directory), not a first start. The kubelet still holds those claims as prepared and never
                // prepares them again, so their specs are adopted as after a corrupt checkpoint instead of being
                // removed as orphans under running containers.
                let this = state.clone();
                let (adopted, _) = tokio::task::spawn_blocking(move || this.adopt_specs(Lost::Missing))
                    .await
                    .map_err(|e| StateError::Task(e.to_string()))??;
                recovery.missing = adopted;
                recovery.rebuilt = adopted;
            }
            LoadOutcome::PreviousBoot { dropped } => {
                recovery.previous_boot = dropped.len();
                for (uid, _) in dropped {
                    state.remove_spec_logged(&uid);
                    state.remove_metadata_logged(&uid);
                }
            }
            LoadOutcome::Corrupt { reason } => {
                state.metrics.checkpoint_corruptions.inc();
                let this = state.clone();
                let (adopted, moved_to) = tokio::task::spawn_blocking(move || this.adopt_specs(Lost::Corrupt))
                    .await
                    .map_err(|e| StateError::Task(e.to_string()))??;
                recovery.rebuilt = adopted;
                recovery.corrupt = moved_to.map(|moved_to| (moved_to, reason));
            }
        }
        let this = state.clone();
        let cleanup =
            tokio::task::spawn_blocking(move || this.clean_up()).await.map_err(|e| StateError::Task(e.to_string()))?;
        recovery.half_done = cleanup.0;
        recovery.rewritten = cleanup.1;
        recovery.orphans = cleanup.2;
        Ok((state, recovery))
    }

    /// Start-up's clean-up again, once the GPUs are discovered after the plugin started without them (the driver
    /// unusable then): what needed them could not be done at start (the MIG devices of interrupted prepares
    /// destroyed, time slices and compute modes set back, missing specs written). Safe while serving: prepares and
    /// unprepares hold the state lock for their whole batch, so nothing it finds started is in progress (an unprepare
    /// stopping an MPS daemon with the lock let go is waited for).
    pub async fn recover_with_gpus(self: &Arc<Self>) -> Result<(), StateError> {
        let this = self.clone();
        let (half_done, rewritten, orphans) = tokio::task::spawn_blocking(move || {
            // Claims adopted after a corrupt checkpoint without GPUs: what their specs say of them needs the GPUs too
            // (saved by the clean-up).
            this.note_adopted_gpus(&mut this.lock());
            this.clean_up()
        })
        .await
        .map_err(|e| StateError::Task(e.to_string()))?;
        info!(half_done, rewritten, orphans, "checkpoint recovered again now that the GPUs are discovered");
        Ok(())
    }

    /// What the entries adopted from their specs after a corrupt checkpoint need the GPUs to know: the MIG devices
    /// made for them ([`Self::mark_made_mig_devices`]) and the GPUs their MPS daemons serve, listed as set to
    /// `EXCLUSIVE_PROCESS` so that they are set back once the claims are unprepared.
    fn note_adopted_gpus(&self, checkpoint: &mut Checkpoint) {
        self.mark_made_mig_devices(checkpoint);
        let inventory = self.inventory.borrow().clone();
        let daemons = checkpoint.claims.values().filter(|e| e.recovered).filter_map(|e| e.mps.as_ref());
        let exclusive: Vec<String> =
            daemons.flat_map(|daemon| mps::exclusive_gpus(daemon, inventory.values())).collect();
        checkpoint.exclusive_process.extend(exclusive);
    }

    /// Marks, in the entries adopted from their specs after a corrupt checkpoint, the dynamic MIG devices made for
    /// them, so that their unprepare destroys them (left, one would stay in the way of the partitions around it for
    /// good). With dynamic MIG a claim is only ever allocated partitions, whose MIG devices prepare made; a claim's
    /// spec names each device's UUID. Not marked: a device of the inventory that is no partition (static MIG: an
    /// administrator's), and a MIG device more than one claim names (an admin-access claim looks at a device
    /// another claim made, and its spec says nothing of admin access: destroying it for the wrong one would pull it
    /// from under the other's pods; left, it leaks, which is said). The one device wrongly taken for made: a node
    /// switched from `--mig-layout static` to dynamic while a claim of an administrator's MIG device was prepared,
    /// with the checkpoint lost at that restart. Needs the GPUs (see [`Self::recover_with_gpus`]).
    fn mark_made_mig_devices(&self, checkpoint: &mut Checkpoint) {
        let inventory = self.inventory.borrow().clone();
        let mut candidates = Vec::new();
        let mut named: BTreeMap<String, usize> = BTreeMap::new();
        for (uid, entry) in &checkpoint.claims {
            if !entry.recovered {
                entry.devices.iter().filter_map(|d| d.made_mig.clone()).for_each(|u| *named.entry(u).or_default() += 1);
                continue;
            }
            let Ok(devices) = cdi::claim_spec_devices(&self.cdi_dir, &self.cdi_kind, uid) else { continue };
            for (device, uuid) in devices {
                let Some(uuid) = uuid.filter(|uuid| uuid.starts_with("MIG-")) else { continue };
                *named.entry(uuid.clone()).or_default() += 1;
                if inventory.get(&device).is_some_and(|d| d.partition.is_some()) {
                    candidates.push((uid.clone(), device, uuid));
                }
            }
        }
        for (uid, device, uuid) in candidates {
            let Some(entry) = checkpoint.claims.get_mut(&uid) else { continue };
            for recorded in entry.devices.iter_mut().filter(|d| d.device == device && d.made_mig.is_none()) {
                if named.get(&uuid) == Some(&1) {
                    info!(%uid, %device, mig = %uuid, "the adopted claim's MIG device was made for it: unprepare destroys it");
                    recorded.made_mig = Some(uuid.clone());
                } else {
                    warn!(%uid, %device, mig = %uuid, "the adopted claim's MIG device is named by another claim too \
                          (admin access?): it is not destroyed when unprepared; destroy it by hand once no pod uses it");
                }
            }
        }
    }

    pub fn metrics(&self) -> &PluginMetrics {
        &self.metrics
    }

    /// The driver whose claims this state prepares.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// This node's pool.
    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// The claims prepared (or being prepared) on `device` of this node, as (UID, namespace, name): whom a fault
    /// of that GPU affects. Recovered entries have no name and are left out. Takes the file lock: call it off the
    /// async threads.
    pub fn claims_holding(&self, device: &str) -> Vec<(String, String, String)> {
        self.lock()
            .claims_holding(&self.pool, device)
            .into_iter()
            .filter(|(_, entry)| !entry.recovered)
            .map(|(uid, entry)| (uid.to_owned(), entry.namespace.clone(), entry.name.clone()))
            .collect()
    }

    /// The claims prepared here with the names of their devices, to be checked against the API for ones the kubelet
    /// forgot ([`super::stale`]): completed ones, and those a failure left started (an unprepare that failed
    /// part-way, which only another unprepare finishes). No batch is in progress while the lock is held. Recovered
    /// entries have no name and are left out. Takes the file lock: call it off the async threads.
    pub fn prepared_claims(&self) -> Vec<(ClaimRef, BTreeSet<String>)> {
        let checkpoint = self.lock();
        let prepared = checkpoint.claims.iter().filter(|(_, e)| !e.recovered);
        prepared
            .map(|(uid, e)| {
                let claim = ClaimRef { namespace: e.namespace.clone(), name: e.name.clone(), uid: uid.clone() };
                (claim, e.devices.iter().map(|d| d.device.clone()).collect())
            })
            .collect()
    }

    /// The UUIDs of the MIG devices the agent made for the claims the checkpoint lists (dynamic MIG): the MIG devices
    /// that are this agent's, not an administrator's. Takes the file lock: call it off the async threads.
    pub fn made_mig_devices(&self) -> BTreeSet<String> {
        self.lock().claims.values().flat_map(|e| e.devices.iter().filter_map(|d| d.made_mig.clone())).collect()
    }

    /// Prepares each claim; one claim's refusal never affects another's answer (a failed checkpoint save fails every
    /// claim of its part of the batch: see [`group_commit`](super::group_commit) and [`Self::prepare_planned`]).
    pub async fn prepare(self: &Arc<Self>, claims: Vec<ClaimRef>) -> Vec<ClaimResult<Vec<PreparedDevice>>> {
        // Taken first: an unprepare of one of these claims done from here on overtakes this call (see `call_order`).
        let tickets: Vec<Ticket> = claims.iter().map(|_| self.order.arrive()).collect();
        let inventory = self.inventory.borrow().clone();
        // Every claim is read, a repeated prepare too: its allocation is what says whether what is prepared is
        // still what the claim has (a claim deallocated and allocated again without the kubelet unpreparing it).
        let reads = futures::future::join_all(claims.into_iter().zip(tickets).map(|(claim, ticket)| {
            let inventory = inventory.clone();
            async move {
                let (plan, pod_claim_name) = match self.read_claim(&claim).await {
                    Ok(object) => {
                        let annotations = object.metadata.annotations.as_ref();
                        let pod_claim_name = super::device_metadata::pod_claim_name(
                            annotations.and_then(|a| a.get(super::device_metadata::POD_CLAIM_NAME_ANNOTATION)),
                        );
                        (allocation::plan(&claim, &object, &self.driver, &self.pool, &inventory), pod_claim_name)
                    }
                    Err(error) => (Err(error), None),
                };
                Asked { claim, plan, ticket, pod_claim_name }
            }
        }))
        .await;
        let uids: Vec<String> = reads.iter().map(|a| a.claim.uid.clone()).collect();
        let answer = self.prepares.join(reads);
        let this = self.clone();
        // This call's work may be done by another call's task, or this task may do others': see group_commit.
        tokio::task::spawn_blocking(move || this.commit_prepares());
        // Every claim needs an answer, even if the committing task died (the kubelet retries the ones that failed).
        let results = answer.await.unwrap_or_else(|_| {
            uids.into_iter()
                .map(|uid| (uid, Err("the prepare failed unexpectedly (the agent logs why); retry".into())))
                .collect()
        });
        for (_, result) in &results {
            self.metrics.claim(Operation::Prepare, result.is_ok());
        }
        results
    }

    /// Unprepares each claim: its spec removed, its entry dropped. A claim never prepared here succeeds. An empty
    /// call (the liveness check) is answered at once, without waiting for the lock a long prepare may hold.
    pub async fn unprepare(self: &Arc<Self>, claims: Vec<ClaimRef>) -> Vec<ClaimResult<()>> {
        if claims.is_empty() {
            return Vec::new();
        }
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let answer = self.unprepares.join(claims);
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.commit_unprepares());
        let results = answer.await.unwrap_or_else(|_| {
            uids.into_iter()
                .map(|uid| (uid, Err("the unprepare failed unexpectedly (the agent logs why); retry".into())))
                .collect()
        });
        for (_, result) in &results {
            self.metrics.claim(Operation::Unprepare, result.is_ok());
        }
        results
    }

    async fn read_claim(&self, claim: &ClaimRef) -> Result<ResourceClaim, String> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), &claim.namespace)
            .get(&claim.name)
            .await
            .map_err(|e| format!("read claim {claim}: {e}"))
    }

    /// Whether an unprepare is stopping the claim's MPS daemon with the state lock let go ([`Self::mps_stopping`]).
    fn mps_stopping(&self, uid: &str) -> bool {
        self.mps_stopping.lock().unwrap_or_else(PoisonError::into_inner).contains(uid)
    }

    fn lock(&self) -> MutexGuard<'_, Checkpoint> {
        self.checkpoint.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Saves the checkpoint (an fsync'd atomic write), counted.
    fn save(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
        self.metrics.checkpoint_saves.inc();
        self.store.save(checkpoint)
    }

    /// Does every prepare queued by the time the lock is free, in one batch; nothing when another call took them.
    fn commit_prepares(&self) {
        let mut checkpoint = self.lock();
        if let Some((batch, mut replies)) = self.prepares.take() {
            let results = self.prepare_planned(&mut checkpoint, batch, &mut |so_far| replies.answer_settled(so_far));
            replies.answer(results);
        }
    }

    /// Prepares a batch of claims (each once): one save records them all as started, then their specs are written,
    /// then one save records them completed (twice that when the batch has both kinds below). Claims that need
    /// something slow of the GPUs (a MIG device made or looked at, `nvidia-smi`, an MPS daemon: seconds each, up to
    /// the tools' time limits) go after the others, which are committed first and told to `settled` (with the claims
    /// the checks settled: refused, or prepared before), so that their calls are answered without waiting for them:
    /// the kubelet gives a call 45 s, and its retries after a missed deadline, cheap as they are, would otherwise
    /// queue behind the next batch's slow work again.
    fn prepare_planned(
        &self,
        checkpoint: &mut Checkpoint,
        reads: Vec<Asked>,
        settled: &mut dyn FnMut(&[PrepareResult]),
    ) -> Vec<PrepareResult> {
        let mut results = Vec::with_capacity(reads.len());
        let mut todo: Vec<Todo> = Vec::new();
        let mut newly_listed = Vec::new();
        let mut newly_exclusive = Vec::new();
        for Asked { claim, plan, ticket, pod_claim_name } in reads {
            if ticket.overtaken(&claim.uid) {
                // Its unprepare is done: preparing it now would leave it prepared for nobody (see `call_order`).
                let reason = format!(
                    "claim {claim} was unprepared after this prepare was asked; not prepared (ask again to prepare it)"
                );
                warn!(claim = %claim, uid = %claim.uid, "refusing a prepare its claim's unprepare overtook");
                results.push((claim.uid, Err(reason)));
                continue;
            }
            if self.mps_stopping(&claim.uid) {
                let reason = format!("claim {claim} is being unprepared (its MPS daemon is stopping); retry");
                results.push((claim.uid, Err(reason)));
                continue;
            }
            let planned = match plan {
                Err(reason) => {
                    warn!(claim = %claim, uid = %claim.uid, %reason, "refusing to prepare claim");
                    results.push((claim.uid, Err(reason)));
                    continue;
                }
                Ok(planned) if planned.is_empty() => {
                    // Nothing of this driver in the claim: nothing to prepare, nothing to remember.
                    results.push((claim.uid, Ok(Vec::new())));
                    continue;
                }
                Ok(planned) => planned,
            };
            if let Some(entry) = checkpoint.completed(&claim.uid)
                && cdi::claim_spec_exists(&self.cdi_dir, &self.cdi_kind, &claim.uid)
            {
                // Prepared before: answered from the checkpoint while the allocation is the one prepared (each
                // device for the same request, share and access). Another one means the claim was deallocated and
                // allocated again without the kubelet unpreparing it (its record of the claim lost): handing out
                // the old devices would give the pod GPUs, or shares of them, not its own.
                let had: BTreeSet<String> = entry.devices.iter().map(held_as).collect();
                let wanted: BTreeSet<String> = planned.iter().map(planned_as).collect();
                let result = if had == wanted {
                    Ok(entry.devices.clone())
                } else {
                    let reason = format!(
                        "claim {claim} is prepared on this node for {had:?} but now allocated {wanted:?}: its earlier \
                         prepare was never unprepared (the kubelet lost its record of it); the stale-claim check \
                         unprepares it (--stale-claims=unprepare), after which it can be prepared"
                    );
                    warn!(claim = %claim, uid = %claim.uid, %reason, "refusing to prepare claim");
                    Err(reason)
                };
                results.push((claim.uid.clone(), result));
                continue;
            }
            let devices = self.prepared_devices(&claim, &planned);
            let checked = match conflict(checkpoint, &claim, &planned, &devices) {
                Some(reason) => Err(reason),
                None => time_slice::checked_asks(checkpoint, &self.pool, &claim, &planned),
            };
            let checked = checked.and_then(|asks| Ok((asks, mps::plan(&claim, &planned)?)));
            let (asks, mps) = match checked {
                Ok(checked) => checked,
                Err(reason) => {
                    let beside = checkpoint.holders_beside(&claim.uid, &devices);
                    warn!(claim = %claim, uid = %claim.uid, %reason, ?beside, "refusing to prepare claim");
                    results.push((claim.uid, Err(reason)));
                    continue;
                }
            };
            // Listed before the GPU is changed, so a crash right after the change still leaves it to be set back.
            for (device, _) in asks.iter().filter(|(_, i)| **i != TimeSliceInterval::Default) {
                if checkpoint.time_sliced.insert(device.clone()) {
                    newly_listed.push(device.clone());
                }
            }
            let exclusive = mps.as_ref().map(|d| mps::exclusive_gpus(d, planned.iter().map(|p| &p.device)));
            let exclusive = exclusive.unwrap_or_default();
            for device in &exclusive {
                if checkpoint.exclusive_process.insert(device.clone()) {
                    newly_exclusive.push(device.clone());
                }
            }
            let mut entry = ClaimEntry {
                unknown: Default::default(),
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                state: PrepareState::PrepareStarted,
                devices,
                recovered: false,
                mps: mps.clone(),
                metadata: self.device_metadata.then_some(MetadataRecord { pod_claim_name }),
            };
            // MIG devices made for this claim before stay recorded from the first save on: a crash before the last
            // one must not turn them into nobody's. So do a newer agent's fields (see `CHECKPOINT_VERSION`).
            if let Some(before) = checkpoint.claims.get(&claim.uid) {
                entry.unknown = before.unknown.clone();
                for device in &mut entry.devices {
                    let made = before.devices.iter().find(|d| d.device == device.device && d.made_mig.is_some());
                    device.made_mig = made.and_then(|d| d.made_mig.clone());
                    let same = before.devices.iter().find(|d| d.device == device.device);
                    device.unknown = same.map(|d| d.unknown.clone()).unwrap_or_default();
                }
            }
            let previous = checkpoint.claims.insert(claim.uid.clone(), entry);
            let making = planned
                .iter()
                .filter(|p| p.device.partition.is_some())
                .map(|p| {
                    let name = p.device.name();
                    let look = planned.iter().filter(|q| q.device.name() == name).all(|q| q.admin_access);
                    let made_before = previous
                        .as_ref()
                        .and_then(|e| e.devices.iter().find(|d| d.device == name).and_then(|d| d.made_mig.clone()));
                    let making = match (look, made_before) {
                        (true, _) => partitions::Making::Look,
                        (false, Some(uuid)) => partitions::Making::Adopt(uuid),
                        (false, None) => partitions::Making::Make,
                    };
                    (name, making)
                })
                .collect();
            todo.push(Todo {
                devices: unique_devices(&planned),
                allocated: planned.iter().map(|p| (p.request.clone(), p.pool.clone(), p.device.name())).collect(),
                claim,
                previous,
                asks,
                mps,
                mps_started: false,
                exclusive,
                making,
                made: Vec::new(),
            });
        }
        if todo.is_empty() {
            return results;
        }
        let (slow, quick): (Vec<Todo>, Vec<Todo>) = todo.into_iter().partition(|t| needs_the_gpus(checkpoint, t));
        if slow.is_empty() {
            self.commit(checkpoint, quick, newly_listed, newly_exclusive, &mut results);
            return results;
        }
        settled(&results);
        if !quick.is_empty() {
            // The quick commit's saves record none of the slow claims (their entries and the GPU lists they added,
            // which are theirs alone: time slices, MPS), so that a failure of the slow commit's first save leaves
            // the disk without them, as a failed save of one batch does.
            let replaced = slow.iter().map(|t| (t.claim.uid.as_str(), t.previous.as_ref()));
            let hidden = hide(checkpoint, replaced, &newly_listed, &newly_exclusive);
            self.commit(checkpoint, quick, Vec::new(), Vec::new(), &mut results);
            unhide(checkpoint, hidden, &newly_listed, &newly_exclusive);
            settled(&results);
        }
        self.commit(checkpoint, slow, newly_listed, newly_exclusive, &mut results);
        results
    }

    /// Does the prepares `todo` (entries inserted as started by [`Self::prepare_planned`]): saves them started, makes
    /// their MIG devices, writes their specs, saves them completed; each one's result added to `results`.
    /// `newly_listed` and `newly_exclusive` are the GPUs `todo` added to the checkpoint's time-sliced and
    /// exclusive-process lists, taken back if the first save fails.
    fn commit(
        &self,
        checkpoint: &mut Checkpoint,
        todo: Vec<Todo>,
        newly_listed: Vec<String>,
        newly_exclusive: Vec<String>,
        results: &mut Vec<PrepareResult>,
    ) {
        self.mark_making(checkpoint, &todo);
        if let Err(e) = self.save(checkpoint) {
            // Nothing was changed: GPUs listed for this batch only are not to be set back by anyone.
            for device in newly_listed {
                checkpoint.time_sliced.remove(&device);
            }
            for device in newly_exclusive {
                checkpoint.exclusive_process.remove(&device);
            }
            for Todo { claim, previous, .. } in todo {
                restore(checkpoint, &claim.uid, previous);
                results.push((claim.uid, Err(format!("record the prepare in the checkpoint: {e}"))));
            }
            return;
        }
        // Dynamic MIG: the batch's MIG devices are made first and their UUIDs saved before any spec is written, so
        // that a crash after that save leaves only MIG devices known to be this agent's (start-up destroys them). A
        // crash between a make and that save leaves the placement marked (`mark_making`): start-up destroys the
        // MIG device there.
        let mut ready = Vec::with_capacity(todo.len());
        for mut claim in todo {
            match self.make_partitions(checkpoint, &mut claim) {
                Ok(()) => ready.push(claim),
                Err(e) => results.push(self.abandon(checkpoint, claim, e)),
            }
        }
        if ready.iter().any(|t| !t.made.is_empty())
            && let Err(e) = self.save(checkpoint)
        {
            let (made, rest): (Vec<Todo>, Vec<Todo>) = ready.into_iter().partition(|t| !t.made.is_empty());
            for claim in made {
                results.push(self.abandon(checkpoint, claim, format!("record the MIG devices made: {e}")));
            }
            ready = rest;
        }
        let mut written = Vec::new();
        for mut claim in ready {
            let write = self
                .ensure_default_compute_modes(checkpoint, &claim)
                .and_then(|()| self.set_time_slices(checkpoint, &claim.claim, &claim.devices, &claim.asks))
                .and_then(|()| self.write_metadata(checkpoint, &claim))
                .and_then(|()| self.start_mps(&mut claim))
                .and_then(|mut edits| {
                    let entry = checkpoint.claims.get(&claim.claim.uid);
                    edits.file_devices = entry.map(|e| self.metadata_mounts(&claim.claim.uid, e)).unwrap_or_default();
                    self.write_spec(&claim.claim.uid, &claim.devices, &edits).map_err(|e| e.to_string())
                });
            match write {
                Ok(_) => {
                    if let Some(entry) = checkpoint.claims.get_mut(&claim.claim.uid) {
                        entry.state = PrepareState::PrepareCompleted;
                    }
                    written.push(claim.claim);
                }
                Err(e) => results.push(self.abandon(checkpoint, claim, e)),
            }
        }
        let saved = self.save(checkpoint);
        for claim in written {
            let Some(entry) = checkpoint.claims.get_mut(&claim.uid) else { continue };
            match &saved {
                Ok(()) => {
                    info!(claim = %claim, uid = %claim.uid, devices = entry.devices.len(), "prepared claim");
                    results.push((claim.uid, Ok(entry.devices.clone())));
                }
                Err(e) => {
                    // The disk still says started: the next prepare finishes it, or start-up cleans it up.
                    entry.state = PrepareState::PrepareStarted;
                    results.push((claim.uid, Err(format!("record the completed prepare in the checkpoint: {e}"))));
                }
            }
        }
        self.update_gauges(checkpoint);
    }

    /// The answer for each planned device: CDI id, base request name, pool and device.
    fn prepared_devices(&self, claim: &ClaimRef, planned: &[PlannedDevice]) -> Vec<PreparedDevice> {
        let mut devices: Vec<PreparedDevice> = planned
            .iter()
            .map(|p| PreparedDevice {
                unknown: Default::default(),
                request_names: vec![p.base_request().to_string()],
                pool: p.pool.clone(),
                device: p.device.name(),
                cdi_device_ids: vec![cdi::device_id(&self.cdi_kind, &claim.uid, &p.device.name())],
                share_id: p.share_id.clone(),
                admin_access: p.admin_access,
                time_slice: time_slice::asked(p),
                made_mig: None,
                making_mig: false,
                memory_bytes: p.memory_bytes,
            })
            .collect();
        if self.device_metadata {
            self.add_metadata_ids(&claim.uid, &mut devices);
        }
        devices
    }

    /// After a corrupt or missing checkpoint: every spec of this driver on disk becomes a recovered entry, and the
    /// rebuilt checkpoint is saved (in place of the corrupt one, kept aside). Returns (specs adopted, where the
    /// corrupt file was kept). A missing checkpoint with no spec on disk is a first start: nothing is written.
    fn adopt_specs(&self, lost: Lost) -> Result<(usize, Option<PathBuf>), StateError> {
        let mut checkpoint = self.lock();
        let uids = match cdi::list_claim_specs(&self.cdi_dir, &self.cdi_kind) {
            Ok(uids) => uids,
            // Start-up's clean-up cannot list them either, so it removes none: nothing is lost by going on.
            Err(e) if lost == Lost::Missing => {
                warn!(error = %e, "no checkpoint, and the CDI specs cannot be listed to tell a lost one from a first \
                      start: taken for a first start");
                return Ok((0, None));
            }
            Err(source) => return Err(StateError::AdoptSpecs { dir: self.cdi_dir.clone(), source }),
        };
        if lost == Lost::Missing && uids.is_empty() {
            // A first start.
            return Ok((0, None));
        }
        for uid in &uids {
            let devices = adopted_devices(&self.cdi_dir, &self.cdi_kind, &self.pool, uid);
            info!(%uid, devices = devices.len(), record = ?lost, "adopted the CDI spec of a prepared claim whose record was lost");
            let entry = ClaimEntry {
                unknown: Default::default(),
                namespace: String::new(),
                name: String::new(),
                state: PrepareState::PrepareCompleted,
                devices,
                recovered: true,
                // Its spec names its MPS daemon, if it had one: start-up starts it again and keeps its directories.
                mps: cdi::claim_spec_env(&self.cdi_dir, &self.cdi_kind, uid)
                    .map(|env| mps::from_client_env(&env))
                    .unwrap_or_default(),
                // Its spec may mount metadata files: they stay (the directory of a listed UID is never an orphan).
                metadata: None,
            };
            // Its GPUs may have been time-sliced for it: listed, they are set back once it is unprepared. A MIG
            // device never is (its parent's time slice is not changed for it).
            let whole = entry.devices.iter().map(|d| d.device.clone()).filter(|d| !device::is_mig_device_name(d));
            checkpoint.time_sliced.extend(whole);
            checkpoint.claims.insert(uid.clone(), entry);
        }
        // So may the compute mode of those their MPS daemons served; and their MIG devices were made for them.
        self.note_adopted_gpus(&mut checkpoint);
        let moved_to = match lost {
            Lost::Corrupt => Some(self.store.replace_corrupt(&checkpoint)?),
            Lost::Missing => {
                self.store.save(&checkpoint)?;
                None
            }
        };
        Ok((uids.len(), moved_to))
    }

    /// Start-up clean-up: half-done prepares undone, missing or outdated specs of completed prepares re-written,
    /// specs nobody records (and MPS directories of claims not prepared) removed. Returns (half done, rewritten,
    /// orphans).
    fn clean_up(&self) -> (usize, usize, usize) {
        // Once no unprepare is stopping an MPS daemon with the lock let go: its claim, marked unfinished, would pass for
        // a half-done prepare here, and its daemon for one nobody needs.
        let mut checkpoint = loop {
            let checkpoint = self.lock();
            if self.mps_stopping.lock().unwrap_or_else(PoisonError::into_inner).is_empty() {
                break checkpoint;
            }
            drop(checkpoint);
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        let half_done: Vec<String> = checkpoint.half_prepared().map(|(uid, _)| uid.to_string()).collect();
        for uid in &half_done {
            self.remove_spec_logged(uid);
            self.remove_metadata_logged(uid);
            if let Err(e) = self.destroy_made(&checkpoint, uid) {
                // Left listed, so that it stays this agent's: the kubelet prepares the claim again.
                warn!(%uid, error = %e, "a MIG device made for an interrupted prepare could not be destroyed");
                continue;
            }
            checkpoint.claims.remove(uid);
            info!(%uid, "cleaned up a prepare (or unprepare) that was interrupted");
        }
        // Every spec is checked against what it would say now: what it names may have changed while no agent ran
        // (the driver upgraded in place, `driverRoot` or `mpsDir` changed), and the runtime reads it again at every
        // container start of the pods still running. Without GPUs (the driver unusable at start) only missing ones
        // are written; the others are checked once the GPUs are discovered ([`Self::recover_with_gpus`]).
        // Not a claim only looked at with admin access on a dynamic MIG partition: what it gets is whatever is at the
        // placement when it is written (the parent GPU, or the MIG device a claim made), which changes with no change
        // of the driver's.
        let check = if self.inventory.borrow().is_empty() { BTreeSet::new() } else { rewritable(&checkpoint) };
        let check = check.into_iter().filter(|uid| !self.looks_at_a_partition(&checkpoint, uid)).collect();
        let Rewrites { written: rewritten, failed } = self.rewrite_specs(&checkpoint, &check);
        self.metrics.specs_rewritten.inc_by(rewritten as u64);
        for (uid, error) in failed {
            warn!(%uid, %error, "a prepared claim's CDI spec cannot be written again");
        }
        let time_sliced = checkpoint.time_sliced.clone();
        self.reset_time_slices(&mut checkpoint, &time_sliced);
        // Daemons of prepared claims started again; those of claims no longer prepared (or half prepared) stopped
        // and their directories removed.
        let daemons: BTreeMap<String, MpsDaemon> = checkpoint
            .claims
            .iter()
            .filter(|(_, e)| e.state == PrepareState::PrepareCompleted)
            .filter_map(|(uid, e)| Some((uid.clone(), e.mps.clone()?)))
            .collect();
        self.set_exclusive_again(&checkpoint);
        let mut orphans = self.mps.reconcile(&daemons);
        // After the daemons: a GPU is never back at DEFAULT while one a previous agent left still serves it.
        let exclusive = checkpoint.exclusive_process.clone();
        self.reset_compute_modes(&mut checkpoint, &exclusive);
        // A writer killed between creating its temporary file and renaming it leaves the temporary behind.
        match cdi::remove_abandoned_spec_temporaries(&self.cdi_dir, &self.cdi_kind) {
            Ok(removed) => orphans += removed,
            Err(e) => warn!(error = %e, "removing abandoned temporary CDI files failed"),
        }
        match cdi::list_claim_specs(&self.cdi_dir, &self.cdi_kind) {
            Ok(uids) => {
                for uid in uids.iter().filter(|uid| !checkpoint.claims.contains_key(*uid)) {
                    self.remove_spec_logged(uid);
                    orphans += 1;
                }
            }
            Err(e) => warn!(error = %e, "listing CDI specs failed; stale specs stay until the next start"),
        }
        orphans += self.remove_orphaned_metadata(&checkpoint);
        // Unsaved (a full or read-only disk), what it undid is found and undone again at the next start; serving
        // meanwhile, the kubelet can unprepare (claims of a previous boot are unknown here: done at once) and
        // prepares fail with the reason until the checkpoint can be saved. Not serving would leave the node's pods
        // Terminating and its slices unpublished.
        match self.store.save_if_changed(&checkpoint) {
            Ok(saved) => {
                if saved {
                    self.metrics.checkpoint_saves.inc();
                }
            }
            Err(e) => warn!(error = %e, "recording the start-up clean-up in the checkpoint failed; serving, prepares \
                            fail until it can be saved"),
        }
        self.update_gauges(&checkpoint);
        (half_done.len(), rewritten, orphans)
    }

    /// Writes again the spec of every completed claim whose spec file is missing (deleted on the host, `/run`
    /// emptied, a lost write), and those of the completed claims in `stale` (the driver's files changed) that say
    /// something else than they would now. A claim whose device or made MIG device is gone, or whose write fails,
    /// keeps its spec as it is: listed with why, for the caller to say. Start-up does this, and [`DriverState::restore_lost_specs`] while the agent runs. Entries left
    /// started (a failed unprepare, an interrupted prepare) are not completed: their specs stay gone.
    fn rewrite_specs(&self, checkpoint: &Checkpoint, stale: &BTreeSet<String>) -> Rewrites {
        let inventory = self.inventory.borrow().clone();
        let mut done = Rewrites::default();
        for (uid, entry) in checkpoint.claims.iter().filter(|(_, e)| e.state == PrepareState::PrepareCompleted) {
            let is_stale = stale.contains(uid);
            if !is_stale && cdi::claim_spec_exists(&self.cdi_dir, &self.cdi_kind, uid) {
                continue;
            }
            let devices: Option<Vec<Device>> =
                entry.devices.iter().map(|d| inventory.get(&d.device).cloned()).collect();
            let Some(devices) = devices else {
                done.failed.push((uid.clone(), "a device of the claim is gone from this node".into()));
                continue;
            };
            // A MIG device made for it must still be the one there (never another one at its placement).
            let made_there = entry.devices.iter().zip(&devices).all(|(recorded, device)| {
                recorded.made_mig.as_ref().is_none_or(|uuid| device.mig.as_ref().is_some_and(|m| m.uuid == *uuid))
            });
            if !made_there {
                done.failed.push((uid.clone(), "a MIG device made for the claim is gone".into()));
                continue;
            }
            let devices = unique_devices_of(devices);
            let mut edits = entry.mps.as_ref().map(|daemon| self.mps_edits(uid, daemon)).unwrap_or_default();
            edits.file_devices = self.metadata_mounts(uid, entry);
            edits.file_devices.extend(self.metadata_mounts_kept(uid, entry, &edits.file_devices));
            let written = cdi::build_claim_spec_with(&self.cdi_kind, uid, &devices, &self.driver_files, &edits)
                .and_then(|spec| {
                    // A stale spec that says what it would say now is left alone.
                    if is_stale && cdi::claim_spec_is(&self.cdi_dir, &self.cdi_kind, uid, &spec) {
                        return Ok(false);
                    }
                    cdi::write_claim_spec(&self.cdi_dir, &self.cdi_kind, uid, &spec).map(|_| true)
                });
            match written {
                Ok(false) => {}
                Ok(true) => {
                    let claim = format!("{}/{}", entry.namespace, entry.name);
                    let what = if is_stale { "that differed from what it would say now" } else { "that was missing" };
                    info!(%uid, %claim, "re-wrote a CDI spec {what}");
                    done.written += 1;
                }
                Err(e) => done.failed.push((uid.clone(), e.to_string())),
            }
        }
        done
    }

    /// [`Self::rewrite_specs`] under the state lock, counted in `specs_rewritten`: the kubelet asks again for a
    /// claim it prepared only for a new pod sandbox (after its own restart), but the runtime reads its spec at every
    /// container start (a restart after a crash, the next init container). So a spec lost while the pod runs is written again, and after the driver's files
    /// changed (a driver upgraded in place: the old versioned libraries and firmware removed) every spec is, so
    /// that none names files that are gone, and after the unified-memory device nodes appeared (a node booted
    /// without them) or went, so that each names those there are (those that cannot be written are tried again
    /// every pass). Takes the file lock: call it off the async threads.
    pub fn restore_lost_specs(&self) -> Rewrites {
        let checkpoint = self.lock();
        // Looks at the driver's files (a failure, the driver half-installed, leaves them as they were).
        let _ = self.driver_files.mounts();
        let changes = SpecInputs::of(&self.driver_files);
        let mut stale = self.stale_specs.lock().unwrap_or_else(PoisonError::into_inner);
        if stale.0 != changes {
            *stale = (changes, rewritable(&checkpoint));
        }
        let done = self.rewrite_specs(&checkpoint, &stale.1);
        let failed: BTreeSet<&String> = done.failed.iter().map(|(uid, _)| uid).collect();
        stale.1.retain(|uid| failed.contains(uid));
        self.metrics.specs_rewritten.inc_by(done.written as u64);
        done
    }

    /// Gets the MIG device of each dynamic MIG partition `todo` was allocated, as its `making` says (filling in its
    /// devices, from which the spec is written), and records the UUID of each one that is the claim's (made now, or
    /// adopted) in its entry; those made now are added to `todo.made`, also when a later one fails.
    fn make_partitions(&self, checkpoint: &mut Checkpoint, todo: &mut Todo) -> Result<(), String> {
        for device in todo.devices.iter_mut().filter(|d| d.partition.is_some()) {
            let name = device.name();
            let making = todo.making.get(&name).cloned().unwrap_or(partitions::Making::Make);
            let made_now = partitions::make(&*self.mig_control, device, &making)?;
            let uuid = device.mig.as_ref().map(|m| m.uuid.clone()).unwrap_or_default();
            if made_now {
                info!(claim = %todo.claim, device = %name, mig = %uuid, "made a MIG device");
                todo.made.push(uuid.clone());
            }
            if making != partitions::Making::Look
                && let Some(entry) = checkpoint.claims.get_mut(&todo.claim.uid)
            {
                for recorded in entry.devices.iter_mut().filter(|d| d.device == name) {
                    recorded.made_mig = Some(uuid.clone());
                    recorded.making_mig = false;
                }
            }
        }
        Ok(())
    }

    /// Gives up preparing `todo` with `error`: its spec removed (unless a recovered entry's, which is in use), the
    /// MIG devices made for it in this batch destroyed, the MPS daemon this prepare started stopped, its entry put back
    /// as it was, its GPUs' time slices set back. A MIG device that cannot be destroyed keeps the entry, as started, recording it: the kubelet's
    /// retry adopts it, start-up destroys it.
    fn abandon(&self, checkpoint: &mut Checkpoint, todo: Todo, error: String) -> ClaimResult<Vec<PreparedDevice>> {
        let Todo { claim, previous, asks, mps_started, exclusive, made, .. } = todo;
        warn!(claim = %claim, uid = %claim.uid, error = %error, "preparing the claim's GPUs failed");
        // Only a daemon this prepare started: one that ran already serves the claim as prepared before.
        if mps_started && let Err(e) = self.mps.stop(&claim.uid) {
            warn!(claim = %claim, error = %e, "stopping the MPS daemon of a failed prepare failed");
        }
        // A recovered claim's spec is in use: the failed (atomic) write left it as it was.
        if previous.is_none() {
            self.remove_spec_logged(&claim.uid);
            self.remove_metadata_logged(&claim.uid);
        }
        let mut destroyed = BTreeSet::new();
        for uuid in &made {
            match partitions::destroy(&*self.mig_control, uuid) {
                Ok(_) => {
                    destroyed.insert(uuid.clone());
                }
                Err(e) => warn!(claim = %claim, mig = %uuid, error = %e, "destroying a MIG device made for a failed \
                                prepare failed"),
            }
        }
        if destroyed.len() < made.len() {
            if let Some(entry) = checkpoint.claims.get_mut(&claim.uid) {
                entry.state = PrepareState::PrepareStarted;
                for device in &mut entry.devices {
                    if device.made_mig.as_ref().is_some_and(|u| destroyed.contains(u)) {
                        device.made_mig = None;
                    }
                    // Every make of this prepare has an outcome now (made and recorded, or not made): a mark left
                    // could later take a device someone else made at the placement for this claim's.
                    device.making_mig = false;
                }
            }
        } else {
            restore(checkpoint, &claim.uid, previous);
        }
        // A GPU set for this claim before a later step failed goes back to what its holders ask.
        self.reset_time_slices(checkpoint, &asks.into_keys().collect());
        self.reset_compute_modes(checkpoint, &exclusive);
        (claim.uid, Err(error))
    }

    /// Destroys the MIG devices the agent made for the entry of claim `uid` (dynamic MIG): the UUIDs it records,
    /// and the MIG device at each placement it was making one on (`making_mig`: killed between the make and the save
    /// of its UUID) unless another claim records that device.
    fn destroy_made(&self, checkpoint: &Checkpoint, uid: &str) -> Result<(), String> {
        let Some(entry) = checkpoint.claims.get(uid) else { return Ok(()) };
        let uuids: BTreeSet<&String> = entry.devices.iter().filter_map(|d| d.made_mig.as_ref()).collect();
        for uuid in uuids {
            if partitions::destroy(&*self.mig_control, uuid)? {
                info!(mig = %uuid, "destroyed a MIG device");
            }
        }
        let making: BTreeSet<&str> =
            entry.devices.iter().filter(|d| d.making_mig && !d.admin_access).map(|d| d.device.as_str()).collect();
        if making.is_empty() {
            return Ok(());
        }
        let gpus = partitions::discover(&*self.mig_control)?;
        let recorded: BTreeSet<&String> =
            checkpoint.claims.values().flat_map(|e| e.devices.iter().filter_map(|d| d.made_mig.as_ref())).collect();
        for name in making {
            let Some(mig) = partitions::at_partition(&gpus, name).filter(|m| !recorded.contains(&m.uuid)) else {
                continue;
            };
            if partitions::destroy(&*self.mig_control, &mig.uuid)? {
                warn!(%uid, device = name, mig = %mig.uuid, "destroyed the MIG device a prepare killed before \
                      recording it had made");
            }
        }
        Ok(())
    }

    /// Dynamic MIG: marks, in the batch's entries (saved next, before anything is made), each partition whose MIG
    /// device the batch may make and whose placement is empty now (`making_mig`): a kill between a make and the
    /// save of its UUID then leaves the device known to be this agent's, and start-up destroys it. A placement
    /// holding a MIG device already is not marked (the make fails, or adopts the claim's own).
    fn mark_making(&self, checkpoint: &mut Checkpoint, todo: &[Todo]) {
        let wanted: Vec<(&str, &str)> = todo
            .iter()
            .flat_map(|t| {
                let made = t.making.iter().filter(|(_, making)| **making != partitions::Making::Look);
                made.map(|(name, _)| (t.claim.uid.as_str(), name.as_str()))
            })
            .collect();
        if wanted.is_empty() {
            return;
        }
        let gpus = match partitions::discover(&*self.mig_control) {
            Ok(gpus) => gpus,
            // The make discovers too, and fails the prepare with the reason.
            Err(e) => return warn!(error = %e, "the MIG devices to make cannot be marked"),
        };
        for (uid, name) in wanted {
            if partitions::at_partition(&gpus, name).is_some() {
                continue;
            }
            if let Some(entry) = checkpoint.claims.get_mut(uid) {
                entry.devices.iter_mut().filter(|d| d.device == name).for_each(|d| d.making_mig = true);
            }
        }
    }

    fn write_spec(&self, uid: &str, devices: &[Device], edits: &cdi::ClaimEdits) -> Result<(), cdi::CdiError> {
        let spec = cdi::build_claim_spec_with(&self.cdi_kind, uid, devices, &self.driver_files, edits)?;
        cdi::write_claim_spec(&self.cdi_dir, &self.cdi_kind, uid, &spec).map(drop)
    }

    fn remove_spec_logged(&self, uid: &str) {
        if let Err(e) = cdi::remove_claim_spec(&self.cdi_dir, &self.cdi_kind, uid) {
            warn!(%uid, error = %e, "removing a CDI spec failed");
        }
    }

    fn update_gauges(&self, checkpoint: &Checkpoint) {
        let completed = checkpoint.claims.values().filter(|e| e.state == PrepareState::PrepareCompleted);
        let (claims, devices) = completed.fold((0, 0), |(c, d), e| (c + 1, d + e.devices.len() as i64));
        self.metrics.prepared_claims.set(claims);
        self.metrics.prepared_devices.set(devices);
    }
}

/// A claim a prepare call asked for, planned, waiting for the state lock with the call's place in the order.
#[derive(Debug)]
struct Asked {
    claim: ClaimRef,
    plan: Plan,
    /// Travels with the work, not the call: a call the kubelet gave up on (dropped) leaves its work queued.
    ticket: Ticket,
    /// The claim's `resource.kubernetes.io/pod-claim-name`, for its device metadata.
    pod_claim_name: Option<String>,
}

impl super::group_commit::ForClaim for Asked {
    fn uid(&self) -> &str {
        &self.claim.uid
    }

    /// A prepare its claim's unprepare overtook is not: of two calls for the claim in one batch, the one asked after
    /// the unprepare is kept (`take` runs under the state lock, where unprepares are recorded).
    fn usable(&self) -> bool {
        self.plan.is_ok() && !self.ticket.overtaken(&self.claim.uid)
    }
}

/// A claim of a batch, recorded as started, to be prepared.
struct Todo {
    claim: ClaimRef,
    devices: Vec<Device>,
    /// Each device of each request as allocated: (request, subrequest included; pool; device name).
    allocated: Vec<(String, String, String)>,
    /// The entry it replaces (a recovered one), put back if this prepare fails.
    previous: Option<ClaimEntry>,
    /// The time slice it asks of each GPU, by device name.
    asks: BTreeMap<String, TimeSliceInterval>,
    /// The MPS daemon it asks for, and whether this prepare started it.
    mps: Option<MpsDaemon>,
    mps_started: bool,
    /// The whole GPUs its MPS daemon serves, by device name: set to `EXCLUSIVE_PROCESS` before it starts.
    exclusive: BTreeSet<String>,
    /// How it gets each dynamic MIG partition it was allocated, by device name: made, adopted from its own earlier
    /// prepare (the entry it replaces records it), or only looked at (admin access).
    making: BTreeMap<String, partitions::Making>,
    /// The UUIDs of the MIG devices made for it in this batch.
    made: Vec<String>,
}

/// The devices to prepare for a claim read from the API, or why it is refused.
type Plan = Result<Vec<PlannedDevice>, String>;

/// A prepare's answer for one claim.
type PrepareResult = ClaimResult<Vec<PreparedDevice>>;

/// Whether preparing `todo` asks something slow of the GPUs: a dynamic MIG partition (made, adopted or looked at,
/// through NVML), a time slice or a compute mode to set (`nvidia-smi`, also for a GPU an MPS claim left in
/// `EXCLUSIVE_PROCESS`), or an MPS daemon to start.
fn needs_the_gpus(checkpoint: &Checkpoint, todo: &Todo) -> bool {
    !todo.making.is_empty()
        || !todo.asks.is_empty()
        || todo.mps.is_some()
        || todo.devices.iter().any(|d| checkpoint.exclusive_process.contains(&d.name()))
}

/// Why a device of `claim` cannot be prepared: it is held for another claim (an admin-access claim may look at a
/// device in use, so it never conflicts).
fn conflict(
    checkpoint: &Checkpoint,
    claim: &ClaimRef,
    planned: &[PlannedDevice],
    devices: &[PreparedDevice],
) -> Option<String> {
    let holder = |owner: &str| checkpoint.holder_named_to(claim, owner);
    planned.iter().zip(devices).filter(|(p, _)| !p.admin_access).find_map(|(planned, device)| {
        let wants_mps = planned.config.sharing.strategy == super::config::SharingStrategy::Mps;
        let held = checkpoint
            .conflicting_owner(&claim.uid, device)
            .or_else(|| checkpoint.share_beside_mps(&claim.uid, device, wants_mps));
        if let Some((owner, held)) = held {
            let what = if held == device.device { String::new() } else { format!(" (as part of {held:?})") };
            return Some(format!(
                "claim {claim}: device {:?} is already prepared{what} for {}; it must be unprepared first",
                device.device,
                holder(owner)
            ));
        }
        let (owner, taken) = checkpoint.memory_taken(&claim.uid, device, planned.device.gpu.memory_bytes)?;
        Some(format!(
            "claim {claim}: the shares of device {:?} prepared on this node hold {taken} bytes of its memory, too \
             much to add this share of {} bytes beside them: one is no longer allocated (its pod deleted by force, \
             its containers perhaps still running), e.g. {}; retried until the kubelet unprepares it",
            device.device,
            device.memory_bytes.unwrap_or_default(),
            holder(owner)
        ))
    })
}

/// The devices a claim's spec on disk names, as recovered-entry devices (no requests, shares or admin access known;
/// the MIG devices made for them: [`DriverState::mark_made_mig_devices`]). An unreadable spec is adopted with none:
/// it is still kept, and unprepare still removes it.
fn adopted_devices(dir: &Path, kind: &CdiKind, pool: &str, uid: &str) -> Vec<PreparedDevice> {
    let devices = cdi::claim_spec_devices(dir, kind, uid).unwrap_or_else(|e| {
        warn!(%uid, error = %e, "the CDI spec of a recovered claim is unreadable; keeping it without devices");
        Vec::new()
    });
    devices
        .into_iter()
        .map(|(device, _)| PreparedDevice {
            unknown: Default::default(),
            request_names: Vec::new(),
            pool: pool.to_string(),
            cdi_device_ids: vec![cdi::device_id(kind, uid, &device)],
            device,
            share_id: None,
            admin_access: false,
            time_slice: None,
            made_mig: None,
            making_mig: false,
            memory_bytes: None,
        })
        .collect()
}

/// How a prepared device is held, as a repeated prepare compares it with the allocation ([`planned_as`]): the
/// device, its pool, the request, the share and admin access.
fn held_as(device: &PreparedDevice) -> String {
    hold_text(
        &device.device,
        &device.pool,
        &device.request_names.join(","),
        device.share_id.as_deref(),
        device.admin_access,
    )
}

/// How the allocation holds a planned device (see [`held_as`]).
fn planned_as(device: &PlannedDevice) -> String {
    hold_text(
        &device.device.name(),
        &device.pool,
        device.base_request(),
        device.share_id.as_deref(),
        device.admin_access,
    )
}

fn hold_text(device: &str, pool: &str, request: &str, share: Option<&str>, admin_access: bool) -> String {
    let share = share.map(|s| format!(" share {s}")).unwrap_or_default();
    let admin = if admin_access { " with admin access" } else { "" };
    format!("{device} of pool {pool}{share}{admin} for request {request}")
}

/// Marks the entry of a claim whose unprepare failed part-way (its spec may be gone already) as started, not
/// completed: its spec is then never written again while the agent runs (see [`DriverState::restore_lost_specs`]),
/// the kubelet's retried unprepare finishes it, a retried prepare prepares it in full, and start-up undoes it as
/// an interrupted prepare once the mark is saved (a restart before any save finds it completed and writes its spec
/// again, until the kubelet's retry removes it). It stays in the checkpoint, so its devices stay held until then.
fn undoing(entry: Option<&mut ClaimEntry>) {
    if let Some(entry) = entry {
        entry.state = PrepareState::PrepareStarted;
    }
}

/// What on the host a claim's spec is written from, beyond the claim: the driver's files (their
/// [`DriverFiles::changes`]) and the optional device nodes there ([`cdi::optional_nodes_present`]). A spec written
/// before either changed is written again.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SpecInputs {
    driver_changes: u64,
    optional_nodes: Vec<&'static str>,
}

impl SpecInputs {
    fn of(driver_files: &DriverFiles) -> Self {
        Self { driver_changes: driver_files.changes(), optional_nodes: cdi::optional_nodes_present(driver_files) }
    }
}

impl DriverState {
    /// Whether the claim `uid` holds a dynamic MIG partition only looked at (admin access, no MIG device made for it).
    fn looks_at_a_partition(&self, checkpoint: &Checkpoint, uid: &str) -> bool {
        let inventory = self.inventory.borrow();
        checkpoint.claims.get(uid).is_some_and(|entry| {
            entry.devices.iter().any(|d| {
                d.admin_access
                    && d.made_mig.is_none()
                    && inventory.get(&d.device).is_some_and(|device| device.partition.is_some())
            })
        })
    }
}

/// The completed claims whose specs may be written again from their entries: not those adopted from their specs
/// after a corrupt checkpoint (what their specs hold beyond their devices, the device metadata files, is not
/// recorded, and a spec written again would lose it).
fn rewritable(checkpoint: &Checkpoint) -> BTreeSet<String> {
    let completed = checkpoint.claims.iter().filter(|(_, e)| e.state == PrepareState::PrepareCompleted && !e.recovered);
    completed.map(|(uid, _)| uid.clone()).collect()
}

/// Takes the entries of the prepares in flight (each claim's UID, with the entry its new one replaced) and the GPUs
/// they added to the time-sliced and exclusive-process lists out of `checkpoint`, putting back the entries they
/// replaced; returns the taken entries for [`unhide`].
fn hide<'a>(
    checkpoint: &mut Checkpoint,
    replaced: impl Iterator<Item = (&'a str, Option<&'a ClaimEntry>)>,
    listed: &[String],
    exclusive: &[String],
) -> Vec<(String, ClaimEntry)> {
    for device in listed {
        checkpoint.time_sliced.remove(device);
    }
    for device in exclusive {
        checkpoint.exclusive_process.remove(device);
    }
    let mut hidden = Vec::new();
    for (uid, previous) in replaced {
        let entry = match previous {
            Some(previous) => checkpoint.claims.insert(uid.to_string(), previous.clone()),
            None => checkpoint.claims.remove(uid),
        };
        hidden.extend(entry.map(|entry| (uid.to_string(), entry)));
    }
    hidden
}

/// Undoes [`hide`].
fn unhide(checkpoint: &mut Checkpoint, hidden: Vec<(String, ClaimEntry)>, listed: &[String], exclusive: &[String]) {
    checkpoint.time_sliced.extend(listed.iter().cloned());
    checkpoint.exclusive_process.extend(exclusive.iter().cloned());
    checkpoint.claims.extend(hidden);
}

/// Puts back the entry a failed prepare replaced, or drops the new one.
fn restore(checkpoint: &mut Checkpoint, uid: &str, previous: Option<ClaimEntry>) {
    match previous {
        Some(entry) => checkpoint.claims.insert(uid.to_string(), entry),
        None => checkpoint.claims.remove(uid),
    };
}

/// Each device once, whatever the number of requests that share it.
fn unique_devices(planned: &[PlannedDevice]) -> Vec<Device> {
    unique_devices_of(planned.iter().map(|p| p.device.clone()).collect())
}

fn unique_devices_of(devices: Vec<Device>) -> Vec<Device> {
    let mut seen = BTreeSet::new();
    devices.into_iter().filter(|d| seen.insert(d.name())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, state: PrepareState) -> Result<ClaimEntry, serde_json::Error> {
        serde_json::from_value(serde_json::json!({"namespace": "ns", "name": name, "state": state, "devices": []}))
    }

    #[test]
    fn hidden_prepares_leave_the_checkpoint_as_before_them_until_put_back() -> Result<(), serde_json::Error> {
        let mut before = Checkpoint::new("boot");
        before.claims.insert("kept".into(), entry("kept", PrepareState::PrepareCompleted)?);
        before.claims.insert("replaced".into(), entry("replaced", PrepareState::PrepareCompleted)?);
        before.time_sliced.insert("gpu-0".into());
        let previous = before.claims.get("replaced").cloned();

        let mut during = before.clone();
        during.claims.insert("new".into(), entry("new", PrepareState::PrepareStarted)?);
        during.claims.insert("replaced".into(), entry("replaced", PrepareState::PrepareStarted)?);
        let (listed, exclusive) = (vec!["gpu-1".to_string()], vec!["gpu-2".to_string()]);
        during.time_sliced.insert("gpu-1".into());
        during.exclusive_process.insert("gpu-2".into());

        let mut checkpoint = during.clone();
        let replaced = [("new", None), ("replaced", previous.as_ref())].into_iter();
        let hidden = hide(&mut checkpoint, replaced, &listed, &exclusive);
        assert_eq!(checkpoint, before);
        unhide(&mut checkpoint, hidden, &listed, &exclusive);
        assert_eq!(checkpoint, during);
        Ok(())
    }
}
