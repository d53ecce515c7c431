//! NVML's health events: critical XIDs and ECC errors, read in a blocking thread (`nvmlEventSetWait` blocks), and
//! `GPU_IS_LOST` answers turned into faults of the GPU that gave them.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
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
/// and when `coverage` asks for it (a GPU the watch does not cover), at most every [`RENEW_AFTER`]. A failure is
/// logged as a warning once; the same failure again, every [`RETRY`] until the driver is there, at debug level (a
/// node waiting for its driver would otherwise warn 360 times an hour). `coverage` says what is watched, and that
/// the thread still answers.
pub fn run(library: &OsStr, reports: &UnboundedSender<Injection>, coverage: &Coverage, stop: &Arc<AtomicBool>) {
    let mut last_said: Option<String> = None;
    while !stop.load(Ordering::Relaxed) {
        let started = std::time::Instant::now();
        match watch(library, reports, coverage, stop) {
            Ok(Ended::Stopped) => return,
            Ok(Ended::Renew) => {
                info!("renewing the NVML health watch for GPUs it did not cover");
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

/// Why a watch ended without an error.
enum Ended {
    Stopped,
    Renew,
}

fn watch(
    library: &OsStr,
    reports: &UnboundedSender<Injection>,
    coverage: &Coverage,
    stop: &AtomicBool,
) -> Result<Ended, NvmlError> {
    let nvml = Nvml::builder().lib_path(library).init()?;
    let subscribed = subscribe(&nvml)?;
    let since = std::time::Instant::now();
    for uuid in &subscribed.lost {
        send(reports, uuid, Action::Fault(Fault::GpuLost));
    }
    for (uuid, _, events) in &subscribed.devices {
        info!(gpu = %uuid, ?events, "watching NVML health events");
    }
    coverage.set(subscribed.seen());
    while !stop.load(Ordering::Relaxed) {
        for (uuid, fault) in subscribed.next_faults(WAIT_MS)? {
            send(reports, &uuid, Action::Fault(fault));
        }
        coverage.answered();
        if since.elapsed() >= RENEW_AFTER && coverage.renewal_asked() {
            return Ok(Ended::Renew);
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
    /// UUID, device, the wanted events it supports.
    devices: Vec<(String, Device<'n>, EventTypes)>,
    /// GPUs that answered "lost" while subscribing.
    lost: Vec<String>,
}

fn subscribe(nvml: &Nvml) -> Result<Subscribed<'_>, NvmlError> {
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
            set = device.register_events(events, set).map_err(|e| e.error)?;
        }
        devices.push((uuid, device, events));
    }
    Ok(Subscribed { set, devices, lost })
}

impl Subscribed<'_> {
    /// What the watch covers: GPUs that support none of the wanted events, or were lost while subscribing, are not
    /// watched.
    fn seen(&self) -> Seen {
        let (mut watched, mut unwatched) = (BTreeSet::new(), BTreeMap::new());
        for (uuid, _, events) in &self.devices {
            if self.lost.contains(uuid) {
                unwatched.insert(uuid.clone(), "the GPU was lost when its events were subscribed to".into());
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
    let _ = reports.send(Injection { gpu: uuid.to_string(), action });
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
