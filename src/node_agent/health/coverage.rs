//! What the health source can see. A GPU whose faults nobody would notice is not healthy as far as anyone knows:
//! the kubelet is told `Unknown` for its devices (and writes that into the status of the pods using them), with
//! the reason, rather than `Healthy`. That is the case while NVML cannot be used at all (no driver, a
//! driver/library version mismatch), for a GPU that reports none of the events watched (NVML: not supported), for a
//! GPU that appeared, or came back from a fault, after the watch started (until the watch is renewed, after
//! [`RENEW_AFTER`] at first), and while the source has not answered for [`STALL`] (an NVML call hanging on a wedged
//! driver). A known fault outweighs all of these: a faulted GPU is `Unhealthy`.
//!
//! The kubelet stamps every device in a report with the time it received it, so the time and timeout sent with a
//! device do not make it `Unknown` on their own while the stream lives: the agent must say so.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// A source that has not answered for this long is taken to hang: the kubelet's own timeout for a device not
/// reported (`DefaultHealthTimeout`).
pub const STALL: Duration = Duration::from_secs(30);
/// The least time between two renewals of the watch for GPUs it does not cover.
pub const RENEW_AFTER: Duration = Duration::from_secs(10);

/// What the source sees.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Seen {
    /// Not watching yet (the agent just started, for a second): nothing is said about any GPU, which the kubelet
    /// (that forgot the driver's devices when the last agent's stream ended) reads as Unknown without a message.
    #[default]
    Starting,
    /// Nothing can be watched, and why.
    Blind(String),
    /// Watching.
    Watching {
        /// The GPUs watched (by UUID); `None`: every GPU (the simulated source).
        watched: Option<BTreeSet<String>>,
        /// The GPUs that cannot be watched, and why.
        unwatched: BTreeMap<String, String>,
    },
}

/// What may be said of a GPU without a known fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Healthy,
    /// Its faults would go unnoticed, and why.
    Unknown(String),
    /// Nothing (the source is starting).
    Unsaid,
}

impl Seen {
    /// What may be said of the GPU `uuid` when the source last answered `silent` ago. Pure.
    pub fn verdict(&self, uuid: &str, silent: Duration) -> Verdict {
        if let Seen::Blind(why) = self {
            return Verdict::Unknown(format!("GPU health events unavailable: {why}"));
        }
        if silent > STALL {
            return Verdict::Unknown(format!(
                "the GPU health watch has not answered for over {} s (NVML hanging?)",
                STALL.as_secs()
            ));
        }
        match self {
            Seen::Starting | Seen::Blind(_) => Verdict::Unsaid,
            Seen::Watching { unwatched, .. } if unwatched.contains_key(uuid) => {
                Verdict::Unknown(format!("health not watched: {}", unwatched[uuid]))
            }
            Seen::Watching { watched: Some(watched), .. } if !watched.contains(uuid) => Verdict::Unknown(
                "health not watched yet: the GPU appeared, or came back, after the watch began; the watch is renewed"
                    .into(),
            ),
            Seen::Watching { .. } => Verdict::Healthy,
        }
    }

    /// Marks the GPU `uuid` as not watched, and why (`None`: watched again). Only while watching.
    pub fn set_unwatched(&mut self, uuid: &str, why: Option<&str>) {
        if let Seen::Watching { unwatched, .. } = self {
            match why {
                Some(why) => unwatched.insert(uuid.to_string(), why.to_string()),
                None => unwatched.remove(uuid),
            };
        }
    }

    /// Whether the watch leaves out one of `uuids` without a reason (it appeared later): renewing it would cover it.
    pub fn misses<'a>(&self, mut uuids: impl Iterator<Item = &'a str>) -> bool {
        match self {
            Seen::Watching { watched: Some(watched), unwatched } => {
                uuids.any(|uuid| !watched.contains(uuid) && !unwatched.contains_key(uuid))
            }
            _ => false,
        }
    }
}

/// What the source sees, shared between it (a thread or task) and the monitor.
#[derive(Debug)]
pub struct Coverage {
    seen: Mutex<Seen>,
    /// When the source last answered, or was started ([`monotonic_millis`]).
    alive: AtomicI64,
    /// Set by the monitor when the watch should be renewed.
    renew: AtomicBool,
    /// Notified when what the source sees changes: the monitor reports at once.
    pub changed: Notify,
}

impl Default for Coverage {
    fn default() -> Self {
        Self {
            seen: Mutex::default(),
            alive: AtomicI64::new(monotonic_millis()),
            renew: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }
}

impl Coverage {
    pub fn seen(&self) -> Seen {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Sets what the source sees; also a sign of life.
    pub fn set(&self, seen: Seen) {
        let changed = {
            let mut current = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            std::mem::replace(&mut *current, seen) != *current
        };
        self.answered();
        if changed {
            self.changed.notify_one();
        }
    }

    /// Changes what the source sees.
    pub fn update(&self, change: impl FnOnce(&mut Seen)) {
        change(&mut self.seen.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// The source answered now (a wait returned, a poll ran).
    pub fn answered(&self) {
        self.alive.store(monotonic_millis(), Ordering::Relaxed);
    }

    /// How long the source has not answered (or, before it first did, since it was started).
    pub fn silent(&self) -> Duration {
        let at = self.alive.load(Ordering::Relaxed);
        Duration::from_millis(u64::try_from(monotonic_millis().saturating_sub(at)).unwrap_or(0))
    }

    /// Asks the source to renew its watch.
    pub fn ask_renewal(&self) {
        self.renew.store(true, Ordering::Relaxed);
    }

    /// Whether a renewal was asked for (and forgets that it was).
    pub fn renewal_asked(&self) -> bool {
        self.renew.swap(false, Ordering::Relaxed)
    }
}

/// Milliseconds on a monotonic clock (a wall clock set back would make the source look silent, or never).
fn monotonic_millis() -> i64 {
    static START: OnceLock<Instant> = OnceLock::new();
    i64::try_from(START.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_may_be_said_of_a_gpu() {
        let watching = |watched: Option<&[&str]>, unwatched: &[(&str, &str)]| Seen::Watching {
            watched: watched.map(|w| w.iter().map(|s| s.to_string()).collect()),
            unwatched: unwatched.iter().map(|(u, why)| (u.to_string(), why.to_string())).collect(),
        };
        let fresh = Duration::from_secs(1);
        let hung = STALL + Duration::from_secs(1);
        let unknown = |text: &str| Verdict::Unknown(text.into());
        let cases = [
            (Seen::Starting, fresh, Verdict::Unsaid),
            (Seen::Starting, hung, unknown("the GPU health watch has not answered for over 30 s (NVML hanging?)")),
            (Seen::Blind("no driver".into()), fresh, unknown("GPU health events unavailable: no driver")),
            (watching(None, &[]), fresh, Verdict::Healthy),
            (watching(None, &[]), hung, unknown("the GPU health watch has not answered for over 30 s (NVML hanging?)")),
            (watching(Some(&["GPU-1"]), &[]), fresh, Verdict::Healthy),
            (
                watching(Some(&[]), &[]),
                fresh,
                unknown(
                    "health not watched yet: the GPU appeared, or came back, after the watch began; the watch is renewed",
                ),
            ),
            (watching(None, &[("GPU-1", "no events")]), fresh, unknown("health not watched: no events")),
        ];
        for (seen, silent, want) in cases {
            assert_eq!(seen.verdict("GPU-1", silent), want, "{seen:?} silent {silent:?}");
        }
    }

    #[test]
    fn a_watch_misses_only_gpus_it_has_no_word_on() {
        let seen = Seen::Watching {
            watched: Some(["GPU-1".to_string()].into()),
            unwatched: [("GPU-2".to_string(), "lost".to_string())].into(),
        };
        assert!(!seen.misses(["GPU-1", "GPU-2"].into_iter()));
        assert!(seen.misses(["GPU-1", "GPU-3"].into_iter()));
        assert!(!Seen::Watching { watched: None, unwatched: BTreeMap::new() }.misses(["GPU-3"].into_iter()));
        assert!(!Seen::Blind("x".into()).misses(["GPU-3"].into_iter()));
    }
}
