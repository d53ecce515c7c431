//! A faulted GPU's device taint in the ResourceSlice (`resource.k8s.io/v1` `Device.taints`).
//!
//! The key names the class under the driver's domain (`<driver>/needs-reset`, `<driver>/gpu-lost`), the value the
//! fault (`79` for an XID, `ecc-double-bit`, `gpu-lost`, `unknown-xid`), so a toleration can accept a class or one
//! XID. The effect per class is policy (`--health-needs-reset-effect`, `--health-lost-effect`): the scheduler keeps
//! new claims off a `NoSchedule` device, kube-controller-manager's device-taint-eviction controller evicts the pods
//! of a `NoExecute` one. `timeAdded` is when the GPU entered the class, so republishing never moves it.

use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use super::classify::{Fault, FaultClass};
use super::state::{Faulted, Now};

/// A device taint's effect, spelled as the API spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Effect {
    /// Informational: visible in the slice, no effect on scheduling.
    #[value(name = "None")]
    None,
    /// No new claim is allocated the device; running pods stay.
    #[value(name = "NoSchedule")]
    NoSchedule,
    /// As NoSchedule, and pods using the device are evicted.
    #[value(name = "NoExecute")]
    NoExecute,
}

impl Effect {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "None",
            Self::NoSchedule => "NoSchedule",
            Self::NoExecute => "NoExecute",
        }
    }
}

/// The effect of each tainting class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effects {
    pub needs_reset: Effect,
    pub lost: Effect,
}

impl Default for Effects {
    fn default() -> Self {
        Self { needs_reset: Effect::NoSchedule, lost: Effect::NoExecute }
    }
}

/// The taint key for `class` under `driver` (`None` for application errors, which never taint).
pub fn key(driver: &str, class: FaultClass) -> Option<String> {
    match class {
        FaultClass::Application => None,
        FaultClass::NeedsReset => Some(format!("{driver}/needs-reset")),
        FaultClass::Lost => Some(format!("{driver}/gpu-lost")),
    }
}

/// The taint value for `fault`: a label value.
pub fn value(fault: Fault) -> String {
    match fault {
        Fault::Xid(Some(xid)) => xid.to_string(),
        Fault::Xid(None) => "unknown-xid".into(),
        Fault::EccSingleBit => "ecc-single-bit".into(),
        Fault::EccDoubleBit => "ecc-double-bit".into(),
        Fault::GpuLost => "gpu-lost".into(),
    }
}

/// The `taints` of a device in state `state` (`None`: healthy, no taints).
pub fn taints(driver: &str, state: Option<&Faulted>, effects: Effects) -> Vec<Value> {
    let Some(state) = state else { return Vec::new() };
    let Some(key) = key(driver, state.class) else { return Vec::new() };
    let effect = if state.class == FaultClass::Lost { effects.lost } else { effects.needs_reset };
    let mut taint = json!({"key": key, "value": value(state.fault), "effect": effect.as_str()});
    if let Ok(time) = Timestamp::from_second(state.since) {
        taint["timeAdded"] = json!(time.to_string());
    }
    vec![taint]
}

/// The fault a taint value written by [`value`] names (`None`: not a value this agent writes).
pub fn fault_of(value: &str) -> Option<Fault> {
    match value {
        "unknown-xid" => Some(Fault::Xid(None)),
        "ecc-single-bit" => Some(Fault::EccSingleBit),
        "ecc-double-bit" => Some(Fault::EccDoubleBit),
        "gpu-lost" => Some(Fault::GpuLost),
        xid => xid.parse().ok().map(|xid| Fault::Xid(Some(xid))),
    }
}

/// The state one of this agent's taints (from [`taints`], read back from a published ResourceSlice) records, seen
/// at `now`: its class from the key, its fault from the value, since its `timeAdded` (`now` when it has none). The
/// healthy window starts again at `now`: when the GPU last faulted is not in the taint. `None` for any other taint
/// (another driver's, an administrator's, a value this agent never writes).
pub fn restored(driver: &str, taint: &Value, now: Now) -> Option<Faulted> {
    let key = taint["key"].as_str()?;
    let class = [FaultClass::NeedsReset, FaultClass::Lost]
        .into_iter()
        .find(|class| self::key(driver, *class).as_deref() == Some(key))?;
    let fault = fault_of(taint["value"].as_str()?)?;
    let since =
        taint["timeAdded"].as_str().and_then(|t| t.parse::<Timestamp>().ok()).map_or(now.wall, |t| t.as_second());
    Some(Faulted { class, fault, since, last_seen: now.steady })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn faulted(class: FaultClass, fault: Fault) -> Faulted {
        Faulted { class, fault, since: 1_764_608_400, last_seen: 1_764_608_460 }
    }

    #[test]
    fn taint_per_class() {
        let d = "gpu.example.com";
        let e = Effects::default();
        assert!(taints(d, None, e).is_empty());
        assert_eq!(
            taints(d, Some(&faulted(FaultClass::Lost, Fault::Xid(Some(79)))), e),
            [
                json!({"key": "gpu.example.com/gpu-lost", "value": "79", "effect": "NoExecute", "timeAdded": "2025-12-01T17:00:00Z"})
            ]
        );
        assert_eq!(
            taints(d, Some(&faulted(FaultClass::NeedsReset, Fault::EccDoubleBit)), e)[0]["key"],
            "gpu.example.com/needs-reset"
        );
        assert_eq!(
            taints(d, Some(&faulted(FaultClass::NeedsReset, Fault::EccDoubleBit)), e)[0]["effect"],
            "NoSchedule"
        );
        let configured = Effects { needs_reset: Effect::None, lost: Effect::NoSchedule };
        assert_eq!(
            taints(d, Some(&faulted(FaultClass::NeedsReset, Fault::Xid(None))), configured)[0]["effect"],
            "None"
        );
        assert_eq!(taints(d, Some(&faulted(FaultClass::Lost, Fault::GpuLost)), configured)[0]["effect"], "NoSchedule");
        assert_eq!(taints(d, Some(&faulted(FaultClass::Lost, Fault::GpuLost)), configured)[0]["value"], "gpu-lost");
    }

    /// Every taint this agent writes reads back as the state it was written from (the healthy window restarting).
    #[test]
    fn taints_read_back() {
        let d = "gpu.example.com";
        // The steady clock apart from the wall clock: the window restarts on the one, `since` falls back to the other.
        let now = Now { wall: 1_764_700_000, steady: 1_764_600_000 };
        let states = [
            faulted(FaultClass::Lost, Fault::Xid(Some(79))),
            faulted(FaultClass::Lost, Fault::GpuLost),
            faulted(FaultClass::NeedsReset, Fault::EccDoubleBit),
            faulted(FaultClass::NeedsReset, Fault::EccSingleBit),
            faulted(FaultClass::NeedsReset, Fault::Xid(None)),
        ];
        for state in states {
            for effect in [Effect::None, Effect::NoSchedule, Effect::NoExecute] {
                let effects = Effects { needs_reset: effect, lost: effect };
                let taint = &taints(d, Some(&state), effects)[0];
                let back = restored(d, taint, now);
                assert_eq!(back, Some(Faulted { last_seen: now.steady, ..state.clone() }), "{taint}");
            }
        }
        let lost = json!({"key": "gpu.example.com/gpu-lost", "value": "79", "effect": "NoExecute"});
        assert_eq!(restored(d, &lost, now).map(|s| s.since), Some(now.wall), "no timeAdded: since now");
        for other in [
            json!({"key": "other.example.com/gpu-lost", "value": "79", "effect": "NoExecute"}),
            json!({"key": "gpu.example.com/maintenance", "value": "79", "effect": "NoSchedule"}),
            json!({"key": "gpu.example.com/needs-reset", "value": "soon", "effect": "NoSchedule"}),
            json!({"key": "gpu.example.com/needs-reset", "effect": "NoSchedule"}),
        ] {
            assert_eq!(restored(d, &other, now), None, "{other}");
        }
    }
}
