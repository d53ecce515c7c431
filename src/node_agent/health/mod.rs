//! GPU health: faults reported by NVML (or injected into simulated GPUs) become device taints in the node's
//! ResourceSlices, Warning Events on the Node and metrics, and clear themselves when the GPU recovers.
//!
//! ```text
//!  NVML event thread ──┐                       ┌─▶ store (health.json: survives restarts)
//!  inject-faults file ─┴─▶ Monitor ─▶ state ───┼─▶ changed ─▶ node agent republishes with taints (≤ 1 s)
//!                          (reports)  machine  └─▶ Events on the Node, metrics
//! ```
//!
//! `classify` (the XID table), `state` (the per-GPU state machine), `taints` and `inject` (the file format) are
//! pure and unit-tested; `store` keeps the state on disk, `sources` starts what feeds the monitor (`nvml_events`, or
//! the injection file), `events` sends the Events (a fault's names the claims prepared on the GPU and their pods,
//! from the kubelet plugin's checkpoint); this module is the glue.

pub mod classify;
pub mod coverage;
mod events;
pub mod inject;
pub mod nvml_events;
mod saver;
pub mod sources;
pub mod state;
pub mod store;
pub mod taints;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::runtime::events::EventType;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value;
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::device::Device;
use super::gpu::Gpu;
use crate::kubelet_plugin::health::{DeviceHealth, Health, HealthReport};
use crate::kubelet_plugin::state::DriverState;
use coverage::{Coverage, Verdict};
use inject::{Action, Injection};
use state::{HealthBook, Now, Policy, Transition};
use taints::Effects;

/// The longest the monitor sleeps without checking the healthy window.
const EXPIRY_CHECK: Duration = Duration::from_secs(60);
/// How often the monitor looks at what the source sees, besides when the source says it changed (a source that
/// hangs says nothing).
const COVERAGE_CHECK: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    device: String,
    uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    class: &'static str,
    fault: String,
}

/// The health metrics.
#[derive(Clone, Debug, Default)]
struct HealthMetrics {
    healthy: Family<GpuLabels, Gauge>,
    watched: Family<GpuLabels, Gauge>,
    faults: Family<FaultLabels, Counter>,
}

/// The health monitor of one node.
#[derive(Debug)]
pub struct Monitor {
    driver: String,
    node: String,
    state_dir: PathBuf,
    policy: Policy,
    effects: Effects,
    book: Mutex<HealthBook>,
    /// The book publishing shows ([`Monitor::taints`]): a copy of `book` made once it was saved, or once its save
    /// was late or failed ([`saver`]), so that no taint is published before it is on disk (or known not to get there).
    shown: Mutex<HealthBook>,
    /// Notified whenever the book shown changes: the node agent republishes at once.
    pub changed: Notify,
    /// The saver's side ([`saver`]): taint changes are saved off the async threads, and retried until saved.
    saving: saver::Saving,
    metrics: HealthMetrics,
    /// What the kubelet's health stream sends (see [`crate::kubelet_plugin::health`]).
    health: watch::Sender<HealthReport>,
    /// What the health source sees: what may be said of GPUs without a fault.
    pub coverage: Arc<Coverage>,
    /// The devices last published (name, GPU UUID): what the health stream reports on.
    devices: Mutex<Vec<(String, String)>>,
    /// When each GPU (by UUID) was last reported reset: a report read before is stale ([`Injection::read_at`]).
    resets: Mutex<HashMap<String, std::time::Instant>>,
    /// The kubelet plugin's state once it serves: which claims (and so pods) a faulted GPU affects.
    holders: Arc<OnceLock<Arc<DriverState>>>,
    /// Why the saved state could not be read at start, for a Warning Event on the Node.
    unreadable: Option<String>,
    /// Whether there was no saved state at start (a new node, or the state directory deleted or replaced): the
    /// faults are read back from the published taints all the same, as for an unreadable one.
    missing: bool,
    /// When this boot began (wall clock seconds): taints added before are not read back ([`Monitor::restore`]).
    booted: Option<i64>,
    /// Set until the faults read back from the published taints ([`Monitor::restore`]) are saved: the saved state
    /// was unreadable or missing, nothing may be published before they are read back (it would untaint the faulted
    /// GPUs), and nothing is saved before (it would replace the unreadable file with a book without them).
    restore_pending: AtomicBool,
    /// The GPUs whose faults [`Monitor::restore`] read back, once it did (it reads them back once).
    read_back: Mutex<Option<Vec<String>>>,
    /// Where the saver copied the unreadable file (or why it could not), once it did.
    kept_aside: Mutex<Option<String>>,
    /// What the read-back did, once it was saved, for an Event on the Node: the GPUs whose faults were read back,
    /// and where the unreadable file was kept (or why it could not be).
    restored: watch::Sender<Option<(Vec<String>, String)>>,
    clock: Clock,
    /// The GPUs the health gauge has a series for.
    gauged: Mutex<HashSet<GpuLabels>>,
}

impl Monitor {
    /// The monitor with the state saved in `state_dir` (an unreadable one is said in the log and in a Warning Event
    /// on the Node, and its faults are read back from the published taints before the next publish, when it is kept
    /// aside: see [`Monitor::restore`]; so are a missing one's, which a new node has none of), its metrics registered
    /// in `registry`.
    pub fn new(
        driver: &str,
        node: &str,
        (state_dir, boot_id): (PathBuf, &str),
        policy: Policy,
        effects: Effects,
        registry: &mut Registry,
    ) -> Self {
        let mut unreadable = None;
        let loaded = store::load_if_present(&state_dir).unwrap_or_else(|error| {
            warn!(%error, "GPU health state unreadable; reading the faults back from the published taints");
            unreadable = Some(error.to_string());
            Some(HealthBook::default())
        });
        let missing = loaded.is_none();
        let book = loaded.unwrap_or_default();
        let unstamped = book.boot_id.is_empty() && !book.faulted.is_empty();
        let (mut book, forgotten) = book.carried_into(boot_id);
        let clock = Clock::start();
        book.restart_windows(clock.now().steady);
        if !forgotten.is_empty() {
            info!(?forgotten, "GPU faults of the machine's previous boot forgotten: the reboot reset the GPUs");
        }
        // Saved at once when it changed, also when only stamped with this boot (a file of an earlier version): a
        // fault that sees no transition is never saved otherwise, and the next reboot could not tell its boot.
        if (!forgotten.is_empty() || (unstamped && !book.boot_id.is_empty()))
            && let Err(error) = store::save(&state_dir, &book)
        {
            warn!(%error, "GPU health state not saved at start");
        }
        if !book.faulted.is_empty() {
            info!(faulted = ?book.faulted.keys().collect::<Vec<_>>(), "GPU faults restored from the state directory");
        }
        let metrics = HealthMetrics::default();
        let saving = saver::Saving::default();
        registry.register(
            "gpu_dra_node_agent_health_state_unsaved",
            "1 while the GPU health state in memory is newer than the one in the state directory because saving it \
             failed (tried again until it succeeds; an agent restarted meanwhile forgets the change)",
            saving.unsaved.clone(),
        );
        registry.register(
            "gpu_dra_node_agent_gpu_healthy",
            "0 while the GPU is tainted for a fault, 1 otherwise (also when its faults would go unnoticed: see \
             gpu_dra_node_agent_gpu_health_watched)",
            metrics.healthy.clone(),
        );
        registry.register(
            "gpu_dra_node_agent_gpu_health_watched",
            "1 while the GPU's faults would be seen (or one was: it is tainted), 0 while they would go unnoticed and \
             the kubelet is told its health is Unknown: NVML reports no health events for it, the driver is \
             unusable, or the watch has not answered for 30 s (no series while the watch starts)",
            metrics.watched.clone(),
        );
        registry.register(
            "gpu_dra_node_agent_gpu_faults",
            "GPU faults reported, by class (application, needs-reset, lost) and fault (XID or kind)",
            metrics.faults.clone(),
        );
        Self {
            driver: driver.into(),
            node: node.into(),
            state_dir,
            policy,
            effects,
            shown: Mutex::new(book.clone()),
            book: Mutex::new(book),
            changed: Notify::new(),
            saving,
            metrics,
            health: watch::Sender::new(HealthReport::default()),
            coverage: Arc::default(),
            devices: Mutex::default(),
            resets: Mutex::default(),
            holders: Arc::default(),
            restore_pending: AtomicBool::new(unreadable.is_some() || missing),
            missing,
            booted: boot_wall_time(),
            read_back: Mutex::default(),
            kept_aside: Mutex::default(),
            unreadable,
            restored: watch::Sender::new(None),
            clock,
            gauged: Mutex::default(),
        }
    }

    /// Lets fault Events name the claims prepared on the GPU and their pods (set once the plugin serves).
    pub fn set_holders(&self, state: Arc<DriverState>) {
        let _ = self.holders.set(state);
    }

    fn book(&self) -> std::sync::MutexGuard<'_, HealthBook> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn shown(&self) -> std::sync::MutexGuard<'_, HealthBook> {
        self.shown.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes `book` the one publishing shows, and wakes the publisher.
    fn show(&self, book: HealthBook) {
        *self.shown() = book;
        self.changed.notify_one();
    }

    /// Shows the book as it is now, copied under its lock so that no older copy is shown after a newer one; wakes
    /// the publisher if `wake`.
    fn show_live(&self, wake: bool) {
        {
            let book = self.book();
            *self.shown() = book.clone();
        }
        if wake {
            self.changed.notify_one();
        }
    }

    /// The `taints` of each of `gpus`' devices, by GPU UUID; also sets their health gauges and removes those of GPUs
    /// no longer among them (unbound for passthrough, renamed by a driver reload, all of them when the pool is
    /// emptied), so that no series speaks for a GPU that is gone.
    pub fn taints(&self, gpus: &[Gpu]) -> HashMap<String, Vec<Value>> {
        let book = self.shown();
        let mut now = HashSet::with_capacity(gpus.len());
        let taints = gpus
            .iter()
            .map(|gpu| {
                let state = book.get(&gpu.uuid);
                let labels = GpuLabels { device: gpu.device_name(), uuid: gpu.uuid.clone() };
                self.metrics.healthy.get_or_create(&labels).set(i64::from(state.is_none()));
                now.insert(labels);
                (gpu.uuid.clone(), taints::taints(&self.driver, state, self.effects))
            })
            .collect();
        let mut gauged = self.gauged.lock().unwrap_or_else(PoisonError::into_inner);
        for gone in gauged.difference(&now) {
            self.metrics.healthy.remove(gone);
            self.metrics.watched.remove(gone);
        }
        *gauged = now;
        taints
    }

    /// The device health the kubelet's stream sends, updated by [`Monitor::update_health`].
    pub fn health_updates(&self) -> watch::Receiver<HealthReport> {
        self.health.subscribe()
    }

    /// Sets the devices the kubelet's stream reports on (a MIG device has its GPU's health), and reports.
    pub fn update_health(&self, devices: &[Device]) {
        *self.devices.lock().unwrap_or_else(PoisonError::into_inner) =
            devices.iter().map(|device| (device.name(), device.gpu.uuid.clone())).collect();
        self.report_health();
    }

    /// Sets the health the kubelet's stream sends (wakes the stream only when something changed): a fault makes a
    /// device Unhealthy, and what the source cannot see Unknown (see [`coverage`]). Asks the source to renew its
    /// watch when it misses one of the GPUs.
    fn report_health(&self) {
        // One report at a time, from what the source sees now: the monitor's task and the publisher both report,
        // and an older view sent last would stand until the next look.
        let devices = self.devices.lock().unwrap_or_else(PoisonError::into_inner);
        let (seen, silent) = (self.coverage.seen(), self.coverage.silent());
        // A faulted GPU's fault was seen (the kubelet is told Unhealthy), even where the watch cannot see it now (a
        // lost one). Read before the gauges' lock, which is never held while the book is taken.
        let faulted: HashSet<String> = self.book().faulted.keys().cloned().collect();
        for gpu in self.gauged.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let watched = match seen.verdict(&gpu.uuid, silent) {
                _ if faulted.contains(&gpu.uuid) => 1,
                Verdict::Healthy => 1,
                Verdict::Unknown(_) => 0,
                Verdict::Unsaid => {
                    self.metrics.watched.remove(gpu);
                    continue;
                }
            };
            self.metrics.watched.get_or_create(gpu).set(watched);
        }
        let report: Vec<DeviceHealth> = {
            let book = self.book();
            // Not for a faulted GPU (a lost one cannot be watched): once its fault clears, it is renewed for.
            if seen.misses(devices.iter().map(|(_, uuid)| uuid.as_str()).filter(|uuid| book.get(uuid).is_none())) {
                self.coverage.ask_renewal();
            }
            devices
                .iter()
                .filter_map(|(device, uuid)| {
                    let (health, message) = match book.get(uuid) {
                        Some(s) => {
                            let meaning = classify::classify(s.fault, &self.policy.ignore_xids).1;
                            let since = Timestamp::from_second(s.since).map(|t| t.to_string()).unwrap_or_default();
                            (
                                Health::Unhealthy,
                                format!("{}: {meaning} (class {}, since {since})", s.fault, s.class.as_str()),
                            )
                        }
                        None => match seen.verdict(uuid, silent) {
                            Verdict::Healthy => (Health::Healthy, String::new()),
                            Verdict::Unknown(why) => (Health::Unknown, why),
                            Verdict::Unsaid => return None,
                        },
                    };
                    Some(DeviceHealth { device: device.clone(), health, message })
                })
                .collect()
        };
        self.health.send_if_modified(|current| {
            let changed = **current != report;
            if changed {
                *current = Arc::new(report);
            }
            changed
        });
    }

    /// Applies reports until `stop`; GPUs are named by device name or UUID (a MIG device's too) and looked up in the
    /// last discovered `gpus`.
    pub async fn run(
        self: Arc<Self>,
        client: Client,
        mut reports: mpsc::UnboundedReceiver<Injection>,
        gpus: watch::Receiver<Arc<Vec<Gpu>>>,
        stop: CancellationToken,
    ) {
        tokio::spawn(self.clone().save_changes(stop.clone()));
        let events = events::NodeEvents::new(client, &self.node, self.holders.clone());
        if let Some(why) = self.unreadable.clone() {
            let note = format!(
                "{why}: the GPU faults it held are read back from this node's ResourceSlice taints before the GPUs are \
                 published again; check this node's GPUs (nvidia-smi -q) and reset any that need it"
            );
            events.send(EventType::Warning, "GpuHealthStateUnreadable", note);
        }
        if self.restore_pending() {
            // Once they were read back, what was found (for a missing state, only if something was).
            let (mut restored, events, monitor) = (self.restored.subscribe(), events.clone(), self.clone());
            let missing = self.missing;
            tokio::spawn(async move {
                // Until the saver's last save at stop: it may be the one that saves the read-back.
                let (gpus, kept) = tokio::select! {
                    biased;
                    done = restored.wait_for(Option::is_some) => match done {
                        Ok(done) => done.clone().unwrap_or_default(),
                        Err(_) => return,
                    },
                    () = monitor.saving.stopped.cancelled() => return,
                };
                if !missing || !gpus.is_empty() {
                    events.send(EventType::Normal, "GpuHealthStateRestored", restored_note(&gpus, &kept, missing));
                }
            });
        }
        let mut coverage_check = tokio::time::interval(COVERAGE_CHECK);
        coverage_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let wait = self.until_next_expiry();
            tokio::select! {
                () = stop.cancelled() => return,
                report = reports.recv() => match report {
                    Some(report) => {
                        let gpus = gpus.borrow().clone();
                        self.apply(&report, &gpus, &events);
                    }
                    None => return,
                },
                () = tokio::time::sleep(wait) => self.expire(&events),
                _ = coverage_check.tick() => self.report_health(),
                () = self.coverage.changed.notified() => self.report_health(),
            }
        }
    }

    fn until_next_expiry(&self) -> Duration {
        let next = self.book().next_expiry(&self.policy);
        next.map_or(EXPIRY_CHECK, |at| {
            Duration::from_secs(u64::try_from(at.saturating_sub(self.clock.now().steady)).unwrap_or(0))
                .min(EXPIRY_CHECK)
        })
    }

    fn apply(&self, report: &Injection, gpus: &[Gpu], events: &events::NodeEvents) {
        // A report may name a MIG device (by name or UUID): the fault is its GPU's, also one in MIG mode that has
        // no MIG device yet (the devices made later are published with the fault's taint).
        let Some(gpu) = super::device::gpu_named(gpus, &report.gpu) else {
            warn!(gpu = %report.gpu, "health report for a GPU this node does not have; ignored");
            return;
        };
        if let Action::Watched(watched) = report.action {
            self.coverage.update(|seen| seen.set_unwatched(&gpu.uuid, (!watched).then_some(inject::UNWATCHED)));
            return self.report_health();
        }
        let mut resets = self.resets.lock().unwrap_or_else(PoisonError::into_inner);
        if read_before_reset(report.read_at, resets.get(&gpu.uuid).copied()) {
            debug!(gpu = %gpu.uuid, action = ?report.action, "a reading taken before the GPU's reset; dropped");
            return;
        }
        if report.action == Action::Reset {
            resets.insert(gpu.uuid.clone(), std::time::Instant::now());
        }
        drop(resets);
        let transition = match report.action {
            Action::Fault(fault) => self.book().record(&gpu.uuid, fault, self.clock.now(), &self.policy),
            Action::Reset => self.book().reset(&gpu.uuid),
            Action::Watched(_) => return,
        };
        // A lost GPU is reported again at every discovery that finds it lost (to keep its window open): a fault
        // once, not once a round.
        let rediscovered = matches!(report.action, Action::Fault(classify::Fault::GpuLost))
            && matches!(transition, Transition::Repeated { .. });
        if let Action::Fault(fault) = report.action
            && !rediscovered
        {
            let class = classify::classify(fault, &self.policy.ignore_xids).0;
            let labels = FaultLabels { class: class.as_str(), fault: taints::value(fault) };
            self.metrics.faults.get_or_create(&labels).inc();
        }
        self.announce(gpu, report.action, &transition, events);
        if transition.changes_taints() {
            self.saving.want();
        }
    }

    fn expire(&self, events: &events::NodeEvents) {
        let healed = self.book().expire(self.clock.now().steady, &self.policy);
        if !healed.is_empty() {
            self.saving.want();
        }
        for (uuid, was) in healed {
            info!(gpu = %uuid, class = was.class.as_str(), fault = %was.fault, "GPU healthy again: no fault for the healthy window");
            let note = format!("GPU {uuid} had no fault for the healthy window after {}; taint removed", was.fault);
            events.send(EventType::Normal, "GpuRecovered", note);
        }
    }

    /// Whether the faults read back from the published taints (see [`Monitor::restore`]) are not saved yet: until
    /// they are, the published slices are their only record, and must not be deleted.
    pub fn restore_pending(&self) -> bool {
        self.restore_pending.load(Ordering::Acquire)
    }

    /// Whether [`Monitor::restore`] is still to read the faults back, before anything is published.
    pub fn read_back_pending(&self) -> bool {
        self.restore_pending() && self.read_back_gpus().is_none()
    }

    /// Waits, as long as a save may take before it counts as late, for the faults read back to be saved; whether
    /// they are (the pool may be emptied then: the slices are no longer their only record).
    pub async fn read_back_saved(&self) -> bool {
        let mut restored = self.restored.subscribe();
        let saved = tokio::time::timeout(saver::SLOW_SAVE, restored.wait_for(Option::is_some)).await;
        saved.is_ok_and(|done| done.is_ok())
    }

    fn read_back_gpus(&self) -> std::sync::MutexGuard<'_, Option<Vec<String>>> {
        self.read_back.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// After an unreadable or missing saved state: takes the faults back from the taints this node's devices were
    /// last published with (`published`, from [`Publisher::published_taints`](super::slices::publisher::Publisher::published_taints)),
    /// before anything is published again, leaving out taints added before this boot (the reboot reset those GPUs),
    /// and asks the saver to save them (it copies an unreadable file aside first). The slices are the only other
    /// record of the faults: without this, a GPU that needs a reset was untainted at the next publish and handed out
    /// again (also after the state directory was deleted on the host, which makes the liveness check restart the
    /// agent). Read back once: a reset or a healthy window's end after it is not undone by the taints still
    /// published. Until the save succeeds (the saver tries again until it does) the restore stays pending, so an
    /// agent restarted before reads them back as well; the faults read back are published all the same. What was
    /// never published (a fault in the second before the state was lost) stays forgotten; the Events say so.
    pub fn restore(&self, published: &[(String, Vec<Value>)]) {
        let mut read_back = self.read_back_gpus();
        if read_back.is_some() {
            return;
        }
        let (now, booted) = (self.clock.now(), self.booted);
        let mut restored = Vec::new();
        {
            let mut book = self.book();
            for (gpu, taints) in published {
                for taint in taints {
                    if let Some(state) = taints::restored(&self.driver, taint, now)
                        && booted.is_none_or(|booted| state.since >= booted)
                        && book.restore(gpu, state)
                        && !restored.contains(gpu)
                    {
                        restored.push(gpu.clone());
                    }
                }
            }
        }
        // Without waking the publisher: the caller publishes next.
        self.show_live(false);
        info!(restored = ?restored, "GPU faults read back from the published taints; saving them");
        *read_back = Some(restored);
        drop(read_back);
        self.saving.want();
    }

    /// Copies an unreadable saved state aside before the first save of the faults read back replaces it (run on the
    /// saver's blocking thread): what was done, for the Event, and whether it is done (a failed copy is tried again
    /// with the next save, unless that save succeeds: the file is gone then).
    fn keep_aside(dir: &std::path::Path, missing: bool) -> (String, bool) {
        if missing {
            return ("there was no file to keep aside".to_string(), true);
        }
        match store::keep_aside(dir) {
            Ok(aside) => (format!("the unreadable file was kept as {}", aside.display()), true),
            Err(e) => (format!("the unreadable file could not be kept aside ({e})"), false),
        }
    }

    /// The read-back is saved: nothing is pending any more, and the Event says what was read back.
    fn restore_saved(&self) {
        self.restore_pending.store(false, Ordering::Release);
        let restored = self.read_back_gpus().clone().unwrap_or_default();
        let kept = self.kept_note().clone().unwrap_or_default();
        info!(restored = ?restored, %kept, "GPU faults read back from the published taints saved");
        self.restored.send_replace(Some((restored, kept)));
    }

    fn kept_note(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.kept_aside.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn announce(&self, gpu: &Gpu, action: Action, transition: &Transition, events: &events::NodeEvents) {
        let (device, uuid) = (gpu.device_name(), &gpu.uuid);
        match (action, transition) {
            (Action::Fault(fault), Transition::Faulted { state, meaning }) => {
                let taint = taints::taints(&self.driver, Some(state), self.effects);
                let taint = taint.first().map_or_else(String::new, |t| {
                    format!(
                        "; tainted {}={}:{}",
                        t["key"].as_str().unwrap_or_default(),
                        t["value"].as_str().unwrap_or_default(),
                        t["effect"].as_str().unwrap_or_default()
                    )
                });
                warn!(%device, gpu = %uuid, %fault, class = state.class.as_str(), meaning, "GPU fault");
                let what =
                    format!("{device} ({uuid}) reported {fault}: {meaning}; class {}{taint}", state.class.as_str());
                events.send_fault(device, what);
            }
            (Action::Fault(fault), Transition::Ignored { meaning }) => {
                info!(%device, gpu = %uuid, %fault, meaning, "GPU fault ignored (application error)");
            }
            (Action::Fault(fault), Transition::Repeated { meaning }) => {
                info!(%device, gpu = %uuid, %fault, meaning, "GPU fault on a GPU already tainted");
            }
            (_, Transition::Recovered { was }) => {
                info!(%device, gpu = %uuid, was = %was.fault, "GPU reset: healthy again");
                let note = format!("{device} ({uuid}) was reset after {}; taint removed", was.fault);
                events.send(EventType::Normal, "GpuRecovered", note);
            }
            _ => {}
        }
    }
}

/// The note of the Event saying what was read back after an unreadable (or `missing`) saved state: the GPUs whose
/// faults were found in the published taints, and where the unreadable file was kept.
fn restored_note(restored: &[String], kept: &str, missing: bool) -> String {
    let found = match restored {
        [] => "this node's ResourceSlices carried no GPU fault taint of this driver to read back".to_string(),
        gpus => format!(
            "the faults of GPUs {} were read back from this node's ResourceSlice taints, their healthy window \
             starting again now",
            gpus.join(", ")
        ),
    };
    let what = if missing {
        "GPU health state missing at start (the state directory deleted or replaced?)"
    } else {
        "GPU health state unreadable at start"
    };
    format!(
        "{what}: {found}; {kept}. A fault recorded but not yet published, or published in slices deleted since (a \
         kubelet restart deletes them), is forgotten"
    )
}

/// Whether a reading taken at `read_at` is older than the GPU's last reset, at `reset_at`.
fn read_before_reset(read_at: Option<std::time::Instant>, reset_at: Option<std::time::Instant>) -> bool {
    matches!((read_at, reset_at), (Some(read), Some(reset)) if read < reset)
}

/// When this boot began, on the wall clock (`btime` in /proc/stat); `None` where it cannot be read.
fn boot_wall_time() -> Option<i64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines().find_map(|line| line.strip_prefix("btime "))?.trim().parse().ok()
}

fn wall_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The monitor's two clocks (see [`state`]): the wall clock, and a steady one from the wall clock's reading at start.
#[derive(Debug)]
struct Clock {
    wall_at_start: i64,
    started: std::time::Instant,
}

impl Clock {
    fn start() -> Self {
        Self { wall_at_start: wall_now(), started: std::time::Instant::now() }
    }

    fn now(&self) -> Now {
        let elapsed = i64::try_from(self.started.elapsed().as_secs()).unwrap_or(i64::MAX);
        Now { wall: wall_now(), steady: self.wall_at_start.saturating_add(elapsed) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use classify::{Fault, FaultClass};
    use serde_json::json;

    fn monitor(dir: &std::path::Path) -> Monitor {
        monitor_in(dir, &mut Registry::default())
    }

    fn monitor_in(dir: &std::path::Path, registry: &mut Registry) -> Monitor {
        Monitor::new(
            "gpu.example.com",
            "node-a",
            (dir.to_path_buf(), "boot-1"),
            Policy::default(),
            Effects::default(),
            registry,
        )
    }

    /// A GPU gone from the node (unbound for passthrough, renamed by a driver reload, or all of them when the pool
    /// is emptied) leaves no health series behind: an old `0` kept a fault alert firing for hardware that is gone.
    #[test]
    fn a_gpu_gone_leaves_no_health_series() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let mut registry = Registry::default();
        let monitor = monitor_in(dir.path(), &mut registry);
        let gpus: Vec<Gpu> = (0..3).map(|i| crate::node_agent::gpu::test_gpu(i, &format!("0000:0{i}:00.0"))).collect();
        monitor.book().record(&gpus[2].uuid, Fault::GpuLost, monitor.clock.now(), &Policy::default());
        monitor.show(monitor.book().clone());
        let series = |registry: &Registry| -> anyhow::Result<Vec<String>> {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry)?;
            Ok(text.lines().filter(|l| l.starts_with("gpu_dra_node_agent_gpu_healthy{")).map(str::to_owned).collect())
        };
        let taints = monitor.taints(&gpus);
        assert_eq!(taints.len(), 3);
        assert!(!taints[&gpus[2].uuid].is_empty(), "the lost GPU is tainted");
        assert_eq!(series(&registry)?.len(), 3);
        monitor.taints(&gpus[..2]);
        let left = series(&registry)?;
        assert!(left.len() == 2 && left.iter().all(|l| !l.contains(&gpus[2].uuid)), "{left:?}");
        monitor.taints(&[]);
        assert_eq!(series(&registry)?, Vec::<String>::new(), "the pool emptied");
        Ok(())
    }

    /// What the kubelet's stream is told of each device: a fault outweighs everything, a GPU the watch misses is
    /// Unknown (and a renewal is asked for, but not for a faulted GPU), nothing is said while the source starts.
    #[test]
    fn each_device_reported_as_far_as_it_is_known() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let monitor = monitor(dir.path());
        let gpus: Vec<Gpu> = (0..3).map(|i| crate::node_agent::gpu::test_gpu(i, &format!("0000:0{i}:00.0"))).collect();
        let devices: Vec<Device> = gpus.iter().map(Device::whole).collect();
        let reported = || {
            let report = monitor.health_updates().borrow().clone();
            report.iter().map(|d| (d.device.clone(), d.health)).collect::<Vec<_>>()
        };
        monitor.update_health(&devices);
        assert_eq!(reported(), [], "said something while the source starts");

        monitor.book().record(&gpus[1].uuid, Fault::EccDoubleBit, monitor.clock.now(), &Policy::default());
        monitor.coverage.set(coverage::Seen::Watching {
            watched: Some([gpus[0].uuid.clone()].into()),
            unwatched: std::collections::BTreeMap::new(),
        });
        monitor.update_health(&devices);
        let names: Vec<String> = devices.iter().map(Device::name).collect();
        let want = [
            (names[0].clone(), Health::Healthy),
            (names[1].clone(), Health::Unhealthy),
            (names[2].clone(), Health::Unknown),
        ];
        assert_eq!(reported(), want);
        assert!(monitor.coverage.renewal_asked(), "no renewal asked for the GPU the watch misses");

        // The GPU the watch misses is faulted too: no renewal for it.
        monitor.book().record(&gpus[2].uuid, Fault::GpuLost, monitor.clock.now(), &Policy::default());
        monitor.update_health(&devices);
        assert!(!monitor.coverage.renewal_asked(), "a renewal asked for a faulted GPU");
        Ok(())
    }

    /// A GPU's reset (the simulated `clear`) that lands while a discovery round, which read the GPU lost before it,
    /// publishes: the round's late lost report is stale and leaves the GPU healthy, where it used to fault it again
    /// until the healthy window ended. A lost reading taken after the reset still faults it.
    #[tokio::test]
    async fn a_lost_reading_older_than_the_reset_is_dropped() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let monitor = monitor(dir.path());
        // Events go nowhere: this is about the book, not what the node is told.
        crate::kube_client::install_crypto_provider();
        let nowhere = Client::try_from(kube::Config::new("http://127.0.0.1:9".parse()?))?;
        let events = events::NodeEvents::new(nowhere, "node-a", Arc::default());
        let gpus = [crate::node_agent::gpu::test_gpu(0, "0000:00:00.0")];
        let report = |action, read_at| Injection { gpu: gpus[0].uuid.clone(), action, read_at };
        let faulted = || monitor.book().get(&gpus[0].uuid).is_some();

        monitor.apply(&report(Action::Fault(Fault::GpuLost), None), &gpus, &events);
        let read_lost = std::time::Instant::now();
        assert!(faulted(), "an injected loss did not fault the GPU");
        monitor.apply(&report(Action::Reset, None), &gpus, &events);
        assert!(!faulted(), "the reset did not heal the GPU");
        monitor.apply(&report(Action::Fault(Fault::GpuLost), Some(read_lost)), &gpus, &events);
        assert!(!faulted(), "a lost reading taken before the reset faulted the GPU again");
        monitor.apply(&report(Action::Fault(Fault::GpuLost), Some(std::time::Instant::now())), &gpus, &events);
        assert!(faulted(), "a lost reading taken after the reset was dropped");
        Ok(())
    }

    /// A state of a version that kept no boot ID is stamped with this boot at start, so the next reboot ends its
    /// faults.
    #[test]
    fn a_state_without_a_boot_is_stamped_at_start_and_a_reboot_then_ends_it() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let older = json!({"version": 1, "faulted": {"GPU-1": {"class": "needs-reset", "fault": {"kind": "xid", "xid": 79},
                                                               "since": 100, "lastSeen": 100}}});
        std::fs::write(store::path(dir.path()), serde_json::to_vec(&older)?)?;
        drop(monitor(dir.path()));
        let stamped = store::load(dir.path())?;
        assert_eq!((stamped.boot_id.as_str(), stamped.faulted.len()), ("boot-1", 1), "{stamped:?}");
        let mut registry = Registry::default();
        let rebooted = Monitor::new(
            "gpu.example.com",
            "node-a",
            (dir.path().to_path_buf(), "boot-2"),
            Policy::default(),
            Effects::default(),
            &mut registry,
        );
        assert!(rebooted.book().faulted.is_empty());
        assert!(store::load(dir.path())?.faulted.is_empty(), "the forgetting is saved");
        Ok(())
    }

    /// An unreadable state stays where it is, and the read-back pending, until the faults read back are saved: a
    /// save meanwhile (a fault reported, a healthy window ending) writes nothing, and an agent restarted before
    /// finds the same file and reads them back too.
    #[tokio::test]
    async fn an_unreadable_state_stays_until_the_faults_read_back_are_saved() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let torn = b"{\"version\": 1, \"faulted\": {\"GPU-";
        std::fs::write(store::path(dir.path()), torn)?;
        let first = monitor(dir.path());
        assert!(first.restore_pending());
        first.saving.want();
        assert!(first.save_once(true).await, "a save while the read-back is pending is no failure");
        assert_eq!(std::fs::read(store::path(dir.path()))?, torn, "saved over while the read-back was pending");
        drop(first);

        let mut restarted = monitor(dir.path());
        assert!(restarted.restore_pending(), "a restart before the read-back forgot it");
        let taint = json!({"key": "gpu.example.com/needs-reset", "value": "ecc-double-bit", "effect": "NoSchedule",
                           "timeAdded": "2026-12-01T10:00:00Z"});
        restarted.booted = Some(1_796_083_200); // 2026-12-01T00:00:00Z
        restarted.restore(&[("GPU-1".into(), vec![taint])]);
        assert!(restarted.restore_pending() && !restarted.read_back_pending(), "saved before the saver ran");
        assert!(restarted.save_once(true).await);
        assert!(!restarted.restore_pending());
        let saved = store::load(dir.path())?;
        let state = saved.get("GPU-1").map(|s| (s.class, s.fault));
        assert_eq!(state, Some((FaultClass::NeedsReset, Fault::EccDoubleBit)), "{saved:?}");
        let kept: Vec<_> = std::fs::read_dir(dir.path())?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("health.json.corrupt-"))
            .map(|e| std::fs::read(e.path()))
            .collect::<Result<_, _>>()?;
        assert_eq!(kept, [torn.to_vec()]);
        Ok(())
    }

    /// The faults are read back once: a reset after it is not undone by the taint still published (the next
    /// publish removes it), and a read-back whose save failed is saved by the saver's next try, not at the next
    /// publish (there may be none for long).
    #[tokio::test]
    async fn a_read_back_is_saved_by_a_retry_and_not_merged_again() -> anyhow::Result<()> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("state");
        std::fs::write(&dir, b"a file where the directory should be")?;
        let mut monitor = monitor(&dir);
        monitor.booted = Some(1_796_083_200); // 2026-12-01T00:00:00Z
        let mut restored = monitor.restored.subscribe();
        let taint = json!({"key": "gpu.example.com/needs-reset", "value": "ecc-double-bit", "effect": "NoSchedule",
                           "timeAdded": "2026-12-01T10:00:00Z"});
        let published = [("GPU-1".to_string(), vec![taint])];
        monitor.restore(&published);
        assert!(monitor.book().get("GPU-1").is_some());
        assert!(!monitor.save_once(true).await);

        assert_eq!(
            monitor.book().reset("GPU-1"),
            Transition::Recovered { was: monitor.shown().faulted["GPU-1"].clone() }
        );
        monitor.restore(&published);
        assert!(monitor.book().get("GPU-1").is_none(), "the reset undone by the taint still published");

        // The directory back with the unreadable file in it: the copy that failed with the save is made now.
        std::fs::remove_file(&dir)?;
        std::fs::create_dir(&dir)?;
        let torn = b"{\"version\": 1, \"faulted\": {";
        std::fs::write(store::path(&dir), torn)?;
        assert!(monitor.save_once(false).await, "the retry failed");
        let kept_copies: Vec<Vec<u8>> = std::fs::read_dir(&dir)?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("health.json.corrupt-"))
            .map(|e| std::fs::read(e.path()))
            .collect::<Result<_, _>>()?;
        assert_eq!(kept_copies, [torn.to_vec()], "the unreadable file was replaced without a copy");
        assert!(!monitor.restore_pending(), "a retry did not save the read-back");
        assert_eq!(monitor.saving.unsaved.get(), 0);
        assert!(store::load(&dir)?.faulted.is_empty(), "the reset not saved with the read-back");
        let (gpus, kept) = restored.borrow_and_update().clone().unwrap_or_default();
        assert_eq!(gpus, ["GPU-1"]);
        assert!(kept.starts_with("the unreadable file was kept as"), "{kept}");
        Ok(())
    }

    /// A missing state (the state directory deleted on the host, the liveness check then restarting the agent) is
    /// read back from the published taints as an unreadable one is, without taints added before this boot (the
    /// reboot reset those GPUs); nothing is kept aside, and the read-back is saved.
    #[tokio::test]
    async fn a_missing_state_is_read_back_from_this_boots_taints() -> anyhow::Result<()> {
        // A read-back does not wake the publisher (its caller publishes next); one that cannot be saved stays
        // pending, is tried again by the saver, and is not read back again.
        let file = tempfile::NamedTempFile::new()?;
        let unsavable = monitor(&file.path().join("state"));
        assert!(unsavable.restore_pending());
        unsavable.restore(&[]);
        let woken = tokio::time::timeout(Duration::ZERO, unsavable.changed.notified()).await;
        assert!(woken.is_err(), "the read-back woke the publisher");
        assert!(!unsavable.save_once(true).await, "saved into a directory under a file");
        assert!(unsavable.restore_pending() && !unsavable.read_back_pending());
        assert!(!unsavable.read_back_saved().await, "emptying the pool would lose the only record");
        assert_eq!(unsavable.saving.unsaved.get(), 1, "an unsaved read-back is not on the gauge");

        let dir = tempfile::tempdir()?;
        let mut monitor = monitor(dir.path());
        assert!(monitor.restore_pending(), "a missing state is read back");
        monitor.booted = Some(1_796_083_200); // 2026-12-01T00:00:00Z
        let taint = |key: &str, value: &str, added: &str| json!({"key": format!("gpu.example.com/{key}"), "value": value, "effect": "NoSchedule", "timeAdded": added});
        let published = [
            ("GPU-1".to_string(), vec![taint("needs-reset", "ecc-double-bit", "2026-12-01T10:00:00Z")]),
            ("GPU-2".to_string(), vec![taint("needs-reset", "ecc-double-bit", "2026-11-30T23:00:00Z")]),
        ];
        monitor.restore(&published);
        // Emptying the pool right after a read-back waits for its save, made by the saver meanwhile.
        let (saved, waited) = tokio::join!(monitor.save_once(true), monitor.read_back_saved());
        assert!(saved && waited, "saved {saved}, seen saved {waited}");
        assert!(!monitor.restore_pending());
        let gpus: Vec<Gpu> = [(0, "GPU-1"), (1, "GPU-2")]
            .into_iter()
            .map(|(i, uuid)| Gpu {
                uuid: uuid.into(),
                ..crate::node_agent::gpu::test_gpu(i, &format!("0000:0{i}:00.0"))
            })
            .collect();
        let shown = monitor.taints(&gpus);
        assert_eq!(shown["GPU-1"].len(), 1, "this boot's fault is published");
        assert!(shown["GPU-2"].is_empty(), "the previous boot's fault is not");
        let saved = store::load(dir.path())?;
        assert_eq!(saved.faulted.keys().collect::<Vec<_>>(), ["GPU-1"]);
        let entries = std::fs::read_dir(dir.path())?.flatten().map(|e| e.file_name()).collect::<Vec<_>>();
        assert_eq!(entries, [std::ffi::OsString::from(store::FILE_NAME)], "nothing kept aside");
        Ok(())
    }
}
