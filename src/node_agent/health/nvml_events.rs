//! NVML's health events: critical XIDs and ECC errors, read in a blocking thread (`nvmlEventSetWait` blocks), and
//! `GPU_IS_LOST` answers turned into faults of the GPU that gave them.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, info, warn};

use super::classify::Fault;
use super::coverage::{Coverage, RENEW_AFTER, Seen};
use super::inject::{Action, Injection};

/// How long one wait blocks, so that the thread notices `stop`.
const WAIT_MS: u32 = 1_000;
/// Pause before the watch starts again after NVML failed.
const RETRY: Duration = Duration::from_secs(10);

/// The events the monitor asks for.
pub fn wanted_events() -> EventTypes {
    EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR | EventTypes::SINGLE_BIT_ECC_ERROR
}

/// The fault an NVML event reports, if it is one the monitor asked for. Pure.
pub fn fault_of(event_type: EventTypes, xid: Option<XidError>) -> Option<Fault> {
    if event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
        Some(Fault::Xid(match xid {
            Some(XidError::Value(value)) => Some(value),
            Some(XidError::Unknown) | None => None,
        }))
    } else if event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        Some(Fault::EccDoubleBit)
    } else if event_type.contains(EventTypes::SINGLE_BIT_ECC_ERROR) {
        Some(Fault::EccSingleBit)
    } else {
        None
    }
}

/// Watches NVML until `stop`, starting again after failures (no driver yet, a GPU that made registration fail),
/// and when `coverage` asks for it (a GPU the watch does not cover), after [`RENEW_AFTER`], twice as long after each
/// renewal that did not cover it either, at most [`RENEW_AT_MOST`] (a GPU that stays unwatchable costs a renewal
/// every 5 minutes, not every 10 s). A failure is logged as a warning once; the same failure again, every [`RETRY`]
/// until the driver is there, at debug level (a node waiting for its driver would otherwise warn 360 times an hour).
/// `coverage` says what is watched, and that the thread still answers. NVML is the one under `driver_root`.
pub fn run(driver_root: &Path, reports: &UnboundedSender<Injection>, coverage: &Coverage, stop: &Arc<AtomicBool>) {
    let mut last_said: Option<String> = None;
    let mut renew_after = RENEW_AFTER;
    let mut renewals = 0u32;
    while !stop.load(Ordering::Relaxed) {
        let started = std::time::Instant::now();
        // Looked for at each try: a driver root mounted after the agent started holds it later.
        let library = crate::node_agent::discovery::nvml::library_in(driver_root);
        match watch(&library, reports, coverage, stop, (&mut renew_after, renewals == 0)) {
            Ok(Ended::Stopped) => return,
            Ok(Ended::Renew) => {
                renewals += 1;
                info!(renewals, next_after = ?renew_after, "renewing the NVML health watch for GPUs it did not cover");
                continue;
            }
            Err(error) => {
                coverage.set(Seen::Blind(format!("NVML: {error}")));
                let text = error.to_string();
                // A watch that ran a while before it failed worked: its failure is news again.
                if last_said.as_deref() == Some(text.as_str()) && started.elapsed() < RETRY {
                    debug!(%error, retry_in = ?RETRY, "NVML health events still unavailable");
                } else {
                    warn!(%error, retry_in = ?RETRY, "NVML health events unavailable");
                    last_said = Some(text);
                }
            }
        }
        let deadline = std::time::Instant::now() + RETRY;
        while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
            coverage.answered();
        }
    }
}

/// The longest between two renewals of the watch for a GPU it cannot cover.
const RENEW_AT_MOST: Duration = Duration::from_secs(5 * 60);

/// Why a watch ended without an error.
enum Ended {
    Stopped,
    Renew,
}

/// One watch, until `stop`, an NVML error, or a renewal asked for once `renew_after` has passed (which then doubles;
/// a watch that passes it with none asked covered every GPU, and the next miss is renewed after [`RENEW_AFTER`]
/// again). `first`: the first watch of the process, whose GPUs are logged at info level.
fn watch(
    library: &OsStr,
    reports: &UnboundedSender<Injection>,
    coverage: &Coverage,
    stop: &AtomicBool,
    (renew_after, first): (&mut Duration, bool),
) -> Result<Ended, NvmlError> {
    let nvml = Nvml::builder().lib_path(library).init()?;
    let subscribed = subscribe(&nvml)?;
    let since = std::time::Instant::now();
    for uuid in &subscribed.lost {
        send(reports, uuid, Action::Fault(Fault::GpuLost));
    }
    for (uuid, _, events) in &subscribed.devices {
        if first {
            info!(gpu = %uuid, ?events, "watching NVML health events");
        } else {
            debug!(gpu = %uuid, ?events, "watching NVML health events");
        }
    }
    coverage.set(subscribed.seen());
    // Asked while this watch was being made, for the watch before it.
    coverage.renewal_asked();
    while !stop.load(Ordering::Relaxed) {
        for (uuid, fault) in subscribed.next_faults(WAIT_MS)? {
            send(reports, &uuid, Action::Fault(fault));
        }
        coverage.answered();
        if since.elapsed() >= *renew_after {
            if coverage.renewal_asked() {
                *renew_after = (*renew_after * 2).min(RENEW_AT_MOST);
                return Ok(Ended::Renew);
            }
            *renew_after = RENEW_AFTER;
        }
    }
    Ok(Ended::Stopped)
}

/// What NVML's health events showed in a while (`gpu-dra gpu-check`).
#[derive(Debug, Default)]
pub struct Watched {
    /// Each GPU's UUID and the wanted events it supports (empty: none, faults then show only as GPU lost).
    pub subscribed: Vec<(String, EventTypes)>,
    /// The faults reported meanwhile, by GPU UUID (GPUs already lost at the start included).
    pub faults: Vec<(String, Fault)>,
}

/// Subscribes to the health events of every GPU and collects what they report for `duration`.
pub fn watch_for(library: &OsStr, duration: Duration) -> Result<Watched, NvmlError> {
    let nvml = Nvml::builder().lib_path(library).init()?;
    let subscribed = subscribe(&nvml)?;
    let mut watched = Watched {
        subscribed: subscribed.devices.iter().map(|(uuid, _, events)| (uuid.clone(), *events)).collect(),
        faults: subscribed.lost.iter().map(|uuid| (uuid.clone(), Fault::GpuLost)).collect(),
    };
    let deadline = std::time::Instant::now() + duration;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(watched);
        }
        let wait = u32::try_from(left.as_millis()).unwrap_or(WAIT_MS).clamp(1, WAIT_MS);
        watched.faults.extend(subscribed.next_faults(wait)?);
    }
}

/// Every GPU's event subscription.
struct Subscribed<'n> {
    set: EventSet<'n>,
    /// UUID, device, the wanted events it supports (registered with `set`).
    devices: Vec<(String, Device<'n>, EventTypes)>,
    /// GPUs that answered "lost" while subscribing: faulted, and not watched until the watch is renewed after.
    lost: Vec<String>,
    /// GPUs whose events NVML refused to register, and its answer: the others are watched all the same.
    refused: BTreeMap<String, String>,
}

/// Subscribes to every GPU's wanted events. A GPU whose registration fails is left out with the reason and the
/// rest subscribed again (a failed registration releases the whole event set).
fn subscribe(nvml: &Nvml) -> Result<Subscribed<'_>, NvmlError> {
    let mut refused = BTreeMap::new();
    loop {
        match subscribe_except(nvml, &refused)? {
            Attempt::Subscribed(mut subscribed) => {
                subscribed.refused = refused;
                return Ok(subscribed);
            }
            Attempt::Refused(uuid, error) => {
                warn!(gpu = %uuid, %error, "NVML refused to watch the GPU's health events; watching the others");
                refused.insert(uuid, format!("NVML refused to watch its events: {error}"));
            }
        }
    }
}

/// What one try of [`subscribe`] came to.
enum Attempt<'n> {
    Subscribed(Subscribed<'n>),
    /// The GPU whose registration failed, and why.
    Refused(String, NvmlError),
}

/// One try of [`subscribe`], leaving out the GPUs in `refused`.
fn subscribe_except<'n>(nvml: &'n Nvml, refused: &BTreeMap<String, String>) -> Result<Attempt<'n>, NvmlError> {
    let mut set = nvml.create_event_set()?;
    let (mut devices, mut lost) = (Vec::new(), Vec::new());
    for index in 0..nvml.device_count()? {
        // A GPU lost before it can be named is discovery's to report (from its last reading, or left out): the
        // others are still watched.
        let device = match nvml.device_by_index(index) {
            Ok(device) => device,
            Err(NvmlError::GpuLost) => continue,
            Err(e) => return Err(e),
        };
        let uuid = match device.uuid() {
            Ok(uuid) => uuid,
            Err(NvmlError::GpuLost) => continue,
            Err(e) => return Err(e),
        };
        if refused.contains_key(&uuid) {
            continue;
        }
        let events = match device.supported_event_types() {
            Ok(supported) => supported & wanted_events(),
            Err(NvmlError::NotSupported) => EventTypes::empty(),
            Err(NvmlError::GpuLost) => {
                lost.push(uuid.clone());
                EventTypes::empty()
            }
            Err(e) => return Err(e),
        };
        if !events.is_empty() {
            set = match device.register_events(events, set) {
                Ok(set) => set,
                Err(e) => return Ok(Attempt::Refused(uuid, e.error)),
            };
        }
        devices.push((uuid, device, events));
    }
    Ok(Attempt::Subscribed(Subscribed { set, devices, lost, refused: BTreeMap::new() }))
}

impl Subscribed<'_> {
    /// What the watch covers: GPUs that support none of the wanted events, or whose registration NVML refused, are
    /// not watched, for that reason; GPUs lost while subscribing are not watched either, without one (faulted now,
    /// the watch is renewed for them once they are not).
    fn seen(&self) -> Seen {
        let (mut watched, mut unwatched) = (BTreeSet::new(), self.refused.clone());
        for (uuid, _, events) in &self.devices {
            if self.lost.contains(uuid) {
                continue;
            } else if events.is_empty() {
                unwatched
                    .insert(uuid.clone(), "NVML reports none of the watched events (XID, ECC) for this GPU".into());
            } else {
                watched.insert(uuid.clone());
            }
        }
        Seen::Watching { watched: Some(watched), unwatched }
    }

    /// The faults reported within `wait_ms` (none on a timeout).
    fn next_faults(&self, wait_ms: u32) -> Result<Vec<(String, Fault)>, NvmlError> {
        match self.set.wait(wait_ms) {
            Ok(event) => {
                let Some(fault) = fault_of(event.event_type, event.event_data) else { return Ok(Vec::new()) };
                match event.device.uuid() {
                    Ok(uuid) => Ok(vec![(uuid, fault)]),
                    Err(error) => {
                        warn!(%error, %fault, "NVML event from a device whose UUID it cannot tell");
                        Ok(Vec::new())
                    }
                }
            }
            Err(NvmlError::Timeout) => Ok(Vec::new()),
            // Which GPU is gone, the answer does not say: ask each.
            Err(NvmlError::GpuLost) => {
                let lost = self
                    .devices
                    .iter()
                    .filter(|(_, device, _)| matches!(device.uuid(), Err(NvmlError::GpuLost)))
                    .map(|(uuid, _, _)| (uuid.clone(), Fault::GpuLost))
                    .collect();
                std::thread::sleep(Duration::from_millis(u64::from(wait_ms)));
                Ok(lost)
            }
            Err(e) => Err(e),
        }
    }
}

fn send(reports: &UnboundedSender<Injection>, uuid: &str, action: Action) {
    // The monitor gone means the agent is stopping.
    let _ = reports.send(Injection { gpu: uuid.to_string(), action, read_at: None });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_to_faults() {
        let cases = [
            (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(79)), Some(Fault::Xid(Some(79)))),
            (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Unknown), Some(Fault::Xid(None))),
            (EventTypes::DOUBLE_BIT_ECC_ERROR, None, Some(Fault::EccDoubleBit)),
            (EventTypes::SINGLE_BIT_ECC_ERROR, None, Some(Fault::EccSingleBit)),
            (EventTypes::PSTATE_CHANGE, None, None),
        ];
        for (event, xid, want) in cases {
            assert_eq!(fault_of(event, xid), want, "{event:?}");
        }
        assert!(wanted_events().contains(EventTypes::CRITICAL_XID_ERROR));
    }
}
