//! The per-GPU health state machine, pure: events and the clock in, transitions out.
//!
//! ```text
//!  healthy ──fault (class ≥ needs-reset)──▶ faulted(class, fault, since, last_seen)
//!     ▲                                        │  same or lesser fault: last_seen = now
//!     │                                        │  worse fault: class, fault and since replaced (a new taint)
//!     └── reset reported, or no fault for the healthy window (measured from last_seen) ──┘
//! ```
//!
//! Application errors never change the state. Two clocks, both in seconds ([`Now`]): `since` is the wall clock's
//! (Unix seconds, the taints' `timeAdded`); `last_seen` and the healthy window are the steady clock's, which a step of
//! the wall clock (NTP correcting it at boot, a VM resumed) does not move, so such a step neither ends every window
//! at once nor stretches one. The steady clock starts at the wall clock's reading when the agent starts, so what is
//! saved still reads as Unix seconds; an agent (re)started starts every window again ([`HealthBook::restart_windows`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::classify::{Fault, FaultClass, classify};

/// One reading of the two clocks (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Unix seconds.
    pub wall: i64,
    /// Seconds of a clock that only moves forward with time, from the wall clock's reading when it started.
    pub steady: i64,
}

#[cfg(test)]
impl Now {
    /// Both clocks at `seconds`.
    pub fn at(seconds: i64) -> Self {
        Self { wall: seconds, steady: seconds }
    }
}

/// The health policy from the command line.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Policy {
    /// XIDs treated as application errors on top of the table's.
    pub ignore_xids: BTreeSet<u64>,
    /// A faulted GPU with no new fault for this long is healthy again; `None`: only a reported reset heals it.
    pub healthy_window: Option<Duration>,
}

/// A faulted GPU.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Faulted {
    pub class: FaultClass,
    /// The worst fault seen since the GPU became faulted (the first of that class).
    pub fault: Fault,
    /// When the GPU entered `class` (Unix seconds): the taint's `timeAdded`.
    pub since: i64,
    /// The latest fault of any tainting class (steady seconds): the healthy window counts from here.
    pub last_seen: i64,
}

/// What an event did to one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// An application error (or an ignored XID): nothing changes.
    Ignored { meaning: &'static str },
    /// Healthy → faulted, or faulted → a worse class.
    Faulted { state: Faulted, meaning: &'static str },
    /// Already faulted at this class or worse: only `last_seen` moved.
    Repeated { meaning: &'static str },
    /// Faulted → healthy.
    Recovered { was: Faulted },
    /// A reset of a GPU that was healthy.
    AlreadyHealthy,
}

impl Transition {
    /// Whether the GPU's taints change.
    pub fn changes_taints(&self) -> bool {
        matches!(self, Self::Faulted { .. } | Self::Recovered { .. })
    }
}

/// The faulted GPUs of this node by UUID; a GPU not in it is healthy.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HealthBook {
    pub faulted: BTreeMap<String, Faulted>,
    /// The machine's boot the faults were seen in (empty: unknown, as in files of versions before it was kept).
    #[serde(default, rename = "bootId", skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
}

impl HealthBook {
    /// The book as this boot (`boot_id`; empty: unreadable) takes it over, and the GPUs whose faults it forgot: a
    /// reboot resets every GPU, which ends every fault of the boot before (a GPU still lost is found so again by
    /// discovery, one still failing reports its errors again). Without it, a needs-reset fault outlived the reboot
    /// that reset the GPU, for good where only a reset untaints (`--health-healthy-window 0s`), since nothing but a
    /// reboot resets a GPU on most nodes. A book of an unknown boot is kept: it cannot be told from this boot's.
    pub fn carried_into(mut self, boot_id: &str) -> (Self, Vec<String>) {
        let earlier = !self.boot_id.is_empty() && !boot_id.is_empty() && self.boot_id != boot_id;
        let forgotten = if earlier { std::mem::take(&mut self.faulted).into_keys().collect() } else { Vec::new() };
        if !boot_id.is_empty() {
            self.boot_id = boot_id.to_string();
        }
        (self, forgotten)
    }
    /// The state of the GPU with `uuid`: `None` when healthy.
    pub fn get(&self, uuid: &str) -> Option<&Faulted> {
        self.faulted.get(uuid)
    }

    /// Applies `fault` reported for `uuid` at `now`.
    pub fn record(&mut self, uuid: &str, fault: Fault, now: Now, policy: &Policy) -> Transition {
        let (class, meaning) = classify(fault, &policy.ignore_xids);
        if class == FaultClass::Application {
            return Transition::Ignored { meaning };
        }
        match self.faulted.get_mut(uuid) {
            Some(state) if state.class >= class => {
                state.last_seen = state.last_seen.max(now.steady);
                Transition::Repeated { meaning }
            }
            _ => {
                let state = Faulted { class, fault, since: now.wall, last_seen: now.steady };
                self.faulted.insert(uuid.to_string(), state.clone());
                Transition::Faulted { state, meaning }
            }
        }
    }

    /// A reset reported for `uuid` (NVML, or `clear` injected): healthy at once.
    pub fn reset(&mut self, uuid: &str) -> Transition {
        match self.faulted.remove(uuid) {
            Some(was) => Transition::Recovered { was },
            None => Transition::AlreadyHealthy,
        }
    }

    /// Starts every fault's healthy window again at `steady` (an agent starting): a repeat of a fault only moves
    /// `last_seen` in memory (saving at every XID of a GPU that keeps failing would write the state that often), so
    /// the saved one may be the first of many; counted from it, a restart untainted a GPU still failing. The window
    /// counts again in full instead, as for faults read back from the published taints.
    pub fn restart_windows(&mut self, steady: i64) {
        for state in self.faulted.values_mut() {
            state.last_seen = steady;
        }
    }

    /// GPUs whose healthy window has passed at `now` (steady seconds), removed and returned with their last state.
    pub fn expire(&mut self, now: i64, policy: &Policy) -> Vec<(String, Faulted)> {
        let Some(window) = policy.healthy_window else { return Vec::new() };
        let window = i64::try_from(window.as_secs()).unwrap_or(i64::MAX);
        let due: Vec<String> = self
            .faulted
            .iter()
            .filter(|(_, state)| now.saturating_sub(state.last_seen) >= window)
            .map(|(uuid, _)| uuid.clone())
            .collect();
        due.into_iter().filter_map(|uuid| self.faulted.remove(&uuid).map(|state| (uuid, state))).collect()
    }

    /// When the next GPU becomes healthy by the window (steady seconds), for the monitor's timer.
    pub fn next_expiry(&self, policy: &Policy) -> Option<i64> {
        let window = i64::try_from(policy.healthy_window?.as_secs()).unwrap_or(i64::MAX);
        self.faulted.values().map(|state| state.last_seen.saturating_add(window)).min()
    }

    /// Takes `state` for `uuid` unless the GPU is faulted already at its class or worse (a GPU's devices all carry
    /// its taint: read back from several, the worst one stands). Returns whether the book changed.
    pub fn restore(&mut self, uuid: &str, state: Faulted) -> bool {
        if self.faulted.get(uuid).is_some_and(|known| known.class >= state.class) {
            return false;
        }
        self.faulted.insert(uuid.to_string(), state);
        true
    }

    /// Forgets GPUs that are no longer on the node (another GPU may get the same device name later).
    pub fn retain(&mut self, present: impl Fn(&str) -> bool) {
        self.faulted.retain(|uuid, _| present(uuid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use FaultClass::{Lost, NeedsReset};

    fn policy(window: Option<u64>) -> Policy {
        Policy { ignore_xids: BTreeSet::from([48]), healthy_window: window.map(Duration::from_secs) }
    }

    #[test]
    fn a_reboot_ends_the_faults_of_the_boot_before() {
        let faulted = |boot: &str| {
            let mut book = HealthBook { boot_id: boot.to_string(), ..HealthBook::default() };
            book.record("GPU-1", Fault::EccDoubleBit, Now::at(100), &policy(None));
            book
        };
        let kept = |book: &HealthBook| book.faulted.keys().cloned().collect::<Vec<_>>();
        let (same, forgotten) = faulted("boot-1").carried_into("boot-1");
        assert_eq!((kept(&same), forgotten.len()), (vec!["GPU-1".to_string()], 0), "a restart in the same boot");
        let (rebooted, forgotten) = faulted("boot-1").carried_into("boot-2");
        assert_eq!((kept(&rebooted), forgotten), (Vec::<String>::new(), vec!["GPU-1".to_string()]));
        assert_eq!(rebooted.boot_id, "boot-2", "saved as this boot's");
        // Unknown on either side: kept, as it cannot be told from this boot's.
        let (older_file, _) = faulted("").carried_into("boot-2");
        assert_eq!((kept(&older_file), older_file.boot_id.as_str()), (vec!["GPU-1".to_string()], "boot-2"));
        let (unreadable_boot, _) = faulted("boot-1").carried_into("");
        assert_eq!((kept(&unreadable_boot), unreadable_boot.boot_id.as_str()), (vec!["GPU-1".to_string()], "boot-1"));
    }

    #[test]
    fn transitions() {
        let p = policy(Some(60));
        let mut book = HealthBook::default();
        assert!(matches!(book.record("a", Fault::Xid(Some(13)), Now::at(10), &p), Transition::Ignored { .. }));
        assert!(
            matches!(book.record("a", Fault::Xid(Some(48)), Now::at(10), &p), Transition::Ignored { .. }),
            "ignore list"
        );
        assert_eq!(book.get("a"), None);

        let t = book.record("a", Fault::Xid(Some(64)), Now::at(100), &p);
        assert!(t.changes_taints(), "{t:?}");
        assert_eq!(book.get("a").map(|s| (s.class, s.since, s.last_seen)), Some((NeedsReset, 100, 100)));

        let t = book.record("a", Fault::EccDoubleBit, Now::at(130), &p);
        assert!(matches!(t, Transition::Repeated { .. }) && !t.changes_taints(), "{t:?}");
        assert_eq!(book.get("a").map(|s| (s.fault, s.since, s.last_seen)), Some((Fault::Xid(Some(64)), 100, 130)));

        let t = book.record("a", Fault::Xid(Some(79)), Now::at(140), &p);
        assert!(t.changes_taints(), "escalation is a new taint: {t:?}");
        assert_eq!(book.get("a").map(|s| (s.class, s.since)), Some((Lost, 140)));

        let t = book.record("a", Fault::Xid(Some(64)), Now::at(150), &p);
        assert!(matches!(t, Transition::Repeated { .. }), "a lesser fault never downgrades: {t:?}");
        assert_eq!(book.get("a").map(|s| (s.class, s.last_seen)), Some((Lost, 150)));

        assert_eq!(book.next_expiry(&p), Some(210));
        assert!(book.expire(209, &p).is_empty());
        let healed = book.expire(210, &p);
        assert_eq!(healed.iter().map(|(u, s)| (u.as_str(), s.class)).collect::<Vec<_>>(), [("a", Lost)]);
        assert_eq!(book.get("a"), None);
    }

    #[test]
    fn reset_heals_at_once_and_window_none_never_expires() {
        let p = policy(None);
        let mut book = HealthBook::default();
        book.record("a", Fault::GpuLost, Now::at(1), &p);
        book.record("b", Fault::Xid(Some(79)), Now::at(1), &p);
        assert!(book.expire(i64::MAX, &p).is_empty());
        assert_eq!(book.next_expiry(&p), None);
        assert!(matches!(book.reset("a"), Transition::Recovered { .. }));
        assert_eq!(book.reset("a"), Transition::AlreadyHealthy);
        assert!(book.get("b").is_some());
        book.retain(|uuid| uuid != "b");
        assert_eq!(book, HealthBook::default());
    }

    #[test]
    fn the_worst_restored_state_stands() {
        let mut book = HealthBook::default();
        let needs_reset = Faulted { class: NeedsReset, fault: Fault::EccDoubleBit, since: 5, last_seen: 9 };
        let lost = Faulted { class: Lost, fault: Fault::Xid(Some(79)), since: 7, last_seen: 9 };
        assert!(book.restore("a", needs_reset.clone()));
        assert!(!book.restore("a", needs_reset.clone()), "the same state again changes nothing");
        assert!(book.restore("a", lost.clone()));
        assert!(!book.restore("a", needs_reset), "a lesser state never downgrades");
        assert_eq!(book.get("a"), Some(&lost));
    }

    /// The wall clock stepped an hour forward (NTP at boot, a VM resumed) while the steady clock moved a second:
    /// the window still has its 299 s to go, and the taint's `since` is the wall clock's reading at the fault.
    #[test]
    fn a_step_of_the_wall_clock_moves_no_window() {
        let p = policy(Some(300));
        let mut book = HealthBook::default();
        book.record("a", Fault::Xid(Some(79)), Now { wall: 5_000, steady: 1_000 }, &p);
        assert_eq!(book.get("a").map(|s| (s.since, s.last_seen)), Some((5_000, 1_000)));
        let stepped = Now { wall: 5_000 + 3_600, steady: 1_001 };
        assert!(book.expire(stepped.steady, &p).is_empty(), "a window ended by a step of the wall clock");
        assert_eq!(book.next_expiry(&p), Some(1_300));
        assert_eq!(book.expire(1_300, &p).len(), 1);
    }

    /// A GPU faulting again and again, then the agent restarting: its window starts again in full, not from the
    /// first fault (the one saved), which would untaint a GPU still failing.
    #[test]
    fn a_restart_starts_every_window_again() {
        let p = policy(Some(300));
        let mut book = HealthBook::default();
        book.record("a", Fault::Xid(Some(79)), Now::at(1_000), &p);
        let saved = book.clone();
        book.record("a", Fault::Xid(Some(79)), Now::at(1_250), &p);
        let mut restarted = saved;
        restarted.restart_windows(1_260);
        assert!(restarted.expire(1_300, &p).is_empty(), "untainted 50 s after its last fault");
        assert_eq!(restarted.next_expiry(&p), Some(1_560));
        assert_eq!(restarted.get("a").map(|s| s.since), Some(1_000), "the taint's timeAdded is kept");
    }

    #[test]
    fn a_clock_step_back_does_not_rewind_last_seen() {
        let p = policy(Some(10));
        let mut book = HealthBook::default();
        book.record("a", Fault::Xid(Some(64)), Now::at(100), &p);
        book.record("a", Fault::Xid(Some(64)), Now::at(50), &p);
        assert_eq!(book.get("a").map(|s| s.last_seen), Some(100));
    }
}
