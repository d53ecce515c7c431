//! Time-slicing applied, decided without I/O: which interval each GPU of a claim is to be set to, which claim a
//! different ask conflicts with, and what a GPU is set back to when its claims go. [`super::state`] applies these
//! through [`GpuSettings`] (`nvidia-smi compute-policy` on real GPUs, a state file for simulated ones).
//!
//! A GPU has one compute time slice, whoever holds it, so:
//! - a claim whose `GpuConfig` asks `sharing.strategy: TimeSlicing` has its GPUs set to the interval it asks
//!   (`Default` included) while it is prepared;
//! - claims holding one GPU at once (shares of a GPU shared by memory, two requests of one claim) ask the same
//!   interval or none: a different ask is refused, naming the claim that holds the GPU with its own;
//! - a claim asking none (strategy `Exclusive`, no configuration) takes the GPU as it is;
//! - a device allocated with admin access (a monitoring pod looking at every GPU) neither sets nor constrains it;
//! - when the last claim asking an interval of a GPU is unprepared, the GPU is set back to `Default`; the
//!   checkpoint lists the GPUs not yet set back ([`Checkpoint::time_sliced`]), and start-up sets each again, so a
//!   failed or interrupted restore is finished and a driver reload without a reboot gets the asked intervals back
//!   once the agent restarts; every unprepare also retries listed GPUs nobody asks for any more;
//! - a claim adopted from a CDI spec after a corrupt checkpoint (a recovered entry) may have asked anything: its GPUs
//!   are listed and left as they are until it is unprepared.
//!
//! [`GpuSettings`]: crate::node_agent::gpu_settings::GpuSettings

use std::collections::BTreeMap;

use super::allocation::{ClaimRef, PlannedDevice};
use super::checkpoint::Checkpoint;
use super::config::{SharingStrategy, TimeSliceInterval};

/// The interval one allocated device asks: its configuration's, when it is time-sliced and not admin access. A MIG
/// device asks none (a time slice is its parent GPU's, which MIG mode keeps from being shared in time; planning
/// refuses an explicit interval).
pub fn asked(device: &PlannedDevice) -> Option<TimeSliceInterval> {
    let sharing = &device.config.sharing;
    // A dynamic MIG partition too, whose MIG device is made only later (its whole on a dynamic-MIG node included):
    // its GPU is in MIG mode.
    match (sharing.strategy, device.admin_access || device.device.is_mig()) {
        (SharingStrategy::TimeSlicing, false) => {
            Some(sharing.time_slicing.as_ref().map(|t| t.interval).unwrap_or_default())
        }
        _ => None,
    }
}

/// The interval `claim` asks of each of its GPUs, by device name; refused when two of its requests ask different
/// intervals of one GPU.
pub fn claim_asks(claim: &ClaimRef, planned: &[PlannedDevice]) -> Result<BTreeMap<String, TimeSliceInterval>, String> {
    let mut asks: BTreeMap<String, (TimeSliceInterval, &str)> = BTreeMap::new();
    for device in planned {
        let Some(interval) = asked(device) else { continue };
        match asks.get(&device.device.name()) {
            Some((first, request)) if *first != interval => {
                return Err(format!(
                    "claim {claim}: requests {request:?} and {:?} ask different time slices ({first:?} and \
                     {interval:?}) of device {:?}; a GPU has one",
                    device.request,
                    device.device.name()
                ));
            }
            Some(_) => {}
            None => {
                asks.insert(device.device.name(), (interval, &device.request));
            }
        }
    }
    Ok(asks.into_iter().map(|(device, (interval, _))| (device, interval)).collect())
}

/// [`claim_asks`], refused when another claim holding one of those GPUs asked a different interval ([`conflict`]).
pub fn checked_asks(
    checkpoint: &Checkpoint,
    pool: &str,
    claim: &ClaimRef,
    planned: &[PlannedDevice],
) -> Result<BTreeMap<String, TimeSliceInterval>, String> {
    let asks = claim_asks(claim, planned)?;
    match conflict(checkpoint, pool, claim, &asks) {
        Some(reason) => Err(reason),
        None => Ok(asks),
    }
}

/// Why `claim` cannot have its asks: another claim holding one of those GPUs of `pool` asked a different interval.
/// Recovered entries (what they asked is unknown) never conflict.
pub fn conflict(
    checkpoint: &Checkpoint,
    pool: &str,
    claim: &ClaimRef,
    asks: &BTreeMap<String, TimeSliceInterval>,
) -> Option<String> {
    asks.iter().find_map(|(device, interval)| {
        let (uid, held) =
            holders_asking(checkpoint, pool, device).find(|(uid, held)| *uid != claim.uid && held != interval)?;
        let holder = checkpoint.holder_named_to(claim, uid);
        Some(format!(
            "claim {claim}: device {device:?} is time-sliced {held:?} for {holder}; this claim asks {interval:?}. \
             Claims sharing a GPU must ask the same time slice, or none"
        ))
    })
}

/// Whether another claim than `claim_uid` holds `device` of `pool` prepared (completed: its interval was set)
/// asking `interval`, so setting it again is not needed.
pub fn already_set(
    checkpoint: &Checkpoint,
    pool: &str,
    claim_uid: &str,
    device: &str,
    interval: TimeSliceInterval,
) -> bool {
    holders_asking(checkpoint, pool, device)
        .any(|(uid, held)| uid != claim_uid && held == interval && checkpoint.completed(uid).is_some())
}

/// What `device` of `pool` is to be set to now: the interval its holders ask (they agree), else `Default`.
pub fn wanted(checkpoint: &Checkpoint, pool: &str, device: &str) -> TimeSliceInterval {
    holders_asking(checkpoint, pool, device).map(|(_, interval)| interval).next().unwrap_or_default()
}

/// Whether a recovered entry (adopted after a corrupt checkpoint: what it asked is unknown) holds `device` of
/// `pool`: its GPU is left as it is until the kubelet unprepares it.
pub fn held_by_recovered(checkpoint: &Checkpoint, pool: &str, device: &str) -> bool {
    checkpoint.holders(pool, device).any(|(uid, _)| checkpoint.claims.get(uid).is_some_and(|entry| entry.recovered))
}

/// The devices [`Checkpoint::time_sliced`] lists that no claim holds asking an interval any more (nor a recovered
/// one, which might): those to set back to `Default`.
pub fn to_set_back(checkpoint: &Checkpoint, pool: &str) -> Vec<String> {
    checkpoint
        .time_sliced
        .iter()
        .filter(|device| holders_asking(checkpoint, pool, device).next().is_none())
        .filter(|device| !held_by_recovered(checkpoint, pool, device))
        .cloned()
        .collect()
}

fn holders_asking<'a>(
    checkpoint: &'a Checkpoint,
    pool: &'a str,
    device: &'a str,
) -> impl Iterator<Item = (&'a str, TimeSliceInterval)> + 'a {
    checkpoint
        .holders(pool, device)
        .filter(|(uid, _)| checkpoint.claims.get(*uid).is_some_and(|entry| !entry.recovered))
        .filter_map(|(uid, held)| held.time_slice.map(|interval| (uid, interval)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet_plugin::checkpoint::{ClaimEntry, PrepareState, PreparedDevice};
    use crate::kubelet_plugin::config::{GpuConfig, Sharing, TimeSlicing};
    use crate::node_agent::gpu::test_gpu;
    use TimeSliceInterval::{Default, Long, Short};

    fn planned(request: &str, minor: u32, ask: Option<TimeSliceInterval>, admin_access: bool) -> PlannedDevice {
        let sharing = match ask {
            Some(interval) => Sharing {
                strategy: SharingStrategy::TimeSlicing,
                time_slicing: Some(TimeSlicing { interval }),
                mps: None,
            },
            None => Sharing::default(),
        };
        PlannedDevice {
            request: request.into(),
            pool: "node-a".into(),
            device: crate::node_agent::device::Device::whole(&test_gpu(minor, "0000:01:00.0")),
            share_id: None,
            all_memory: false,
            memory_bytes: None,
            admin_access,
            config: GpuConfig { sharing },
        }
    }

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef { namespace: "ns".into(), name: format!("claim-{uid}"), uid: uid.into() }
    }

    fn holding(entries: &[(&str, &str, Option<TimeSliceInterval>, bool)]) -> Checkpoint {
        let mut checkpoint = Checkpoint::new("boot");
        for (uid, device, time_slice, recovered) in entries {
            let entry = checkpoint.claims.entry(uid.to_string()).or_insert_with(|| ClaimEntry {
                unknown: std::collections::BTreeMap::new(),
                namespace: "ns".into(),
                name: format!("claim-{uid}"),
                state: PrepareState::PrepareCompleted,
                devices: Vec::new(),
                recovered: *recovered,
                mps: None,
                metadata: None,
            });
            entry.devices.push(PreparedDevice {
                unknown: std::collections::BTreeMap::new(),
                request_names: vec!["gpu".into()],
                pool: "node-a".into(),
                device: device.to_string(),
                cdi_device_ids: Vec::new(),
                share_id: Some(format!("share-{uid}")),
                admin_access: false,
                time_slice: *time_slice,
                made_mig: None,
                making_mig: false,
                memory_bytes: None,
            });
        }
        checkpoint
    }

    #[test]
    fn what_a_device_asks() {
        let cases = [
            (planned("g", 0, Some(Long), false), Some(Long)),
            (planned("g", 0, Some(Default), false), Some(Default)),
            (planned("g", 0, None, false), None),
            (planned("g", 0, Some(Long), true), None),
        ];
        for (device, want) in cases {
            assert_eq!(asked(&device), want, "{device:?}");
        }
        let mut without_interval = planned("g", 0, None, false);
        without_interval.config.sharing.strategy = SharingStrategy::TimeSlicing;
        assert_eq!(asked(&without_interval), Some(Default));
        // The whole of a GPU on a dynamic-MIG node, its MIG device not made yet: in MIG mode all the same.
        let mut partition = planned("g", 0, Some(Default), false);
        let gpu = &partition.device.gpu;
        let profile =
            crate::node_agent::mig::profiles(gpu).and_then(|p| p.into_iter().last()).expect("an H100's profiles");
        partition.device.partition = Some(crate::node_agent::device::Partition { profile, start: 0, whole: true });
        assert_eq!(asked(&partition), None);
    }

    #[test]
    fn a_claim_asks_one_interval_per_gpu() {
        let asks = claim_asks(
            &claim("a"),
            &[planned("x", 0, Some(Long), false), planned("y", 0, Some(Long), false), planned("z", 1, None, false)],
        );
        assert_eq!(asks, Ok([("gpu-0".to_string(), Long)].into()));
        let refused =
            claim_asks(&claim("a"), &[planned("x", 0, Some(Long), false), planned("y", 0, Some(Short), false)]);
        let reason = refused.err().unwrap_or_default();
        assert!(reason.contains("requests \"x\" and \"y\" ask different time slices (Long and Short)"), "{reason}");
        let admin_looks = claim_asks(&claim("a"), &[planned("x", 0, Some(Long), false), planned("y", 0, None, true)]);
        assert_eq!(admin_looks, Ok([("gpu-0".to_string(), Long)].into()));
    }

    #[test]
    fn claims_sharing_a_gpu_must_agree() {
        let checkpoint = holding(&[
            ("held-long", "gpu-0", Some(Long), false),
            ("asks-none", "gpu-1", None, false),
            ("recovered", "gpu-2", None, true),
            ("recovered-long", "gpu-3", Some(Long), true),
        ]);
        let ask = |device: &str, interval| [(device.to_string(), interval)].into();
        let cases = [
            ("gpu-0", Long, None),
            (
                "gpu-0",
                Short,
                Some("is time-sliced Long for claim ns/claim-held-long (UID held-long); this claim asks Short"),
            ),
            ("gpu-0", Default, Some("asks Default")),
            ("gpu-1", Short, None),
            ("gpu-3", Short, None),
            ("gpu-5", Short, None),
        ];
        for (device, interval, want) in cases {
            let got = conflict(&checkpoint, "node-a", &claim("new"), &ask(device, interval));
            match (got, want) {
                (None, None) => {}
                (Some(reason), Some(want)) => assert!(reason.contains(want), "{reason:?} lacks {want:?}"),
                (got, want) => panic!("{device} {interval:?}: got {got:?}, want {want:?}"),
            }
        }
        // Its own entry (a retried prepare) never conflicts with itself.
        assert_eq!(conflict(&checkpoint, "node-a", &claim("held-long"), &ask("gpu-0", Short)), None);
        assert_eq!(conflict(&checkpoint, "node-b", &claim("new"), &ask("gpu-0", Short)), None);
    }

    #[test]
    fn what_a_gpu_is_set_to() {
        let checkpoint = holding(&[
            ("a", "gpu-0", Some(Long), false),
            ("b", "gpu-0", None, false),
            ("c", "gpu-1", None, false),
            ("d", "gpu-2", Some(Short), true),
        ]);
        assert_eq!(wanted(&checkpoint, "node-a", "gpu-0"), Long);
        assert_eq!(wanted(&checkpoint, "node-a", "gpu-1"), Default);
        assert_eq!(wanted(&checkpoint, "node-a", "gpu-2"), Default);
        assert_eq!(wanted(&checkpoint, "node-a", "gpu-9"), Default);
        assert!(already_set(&checkpoint, "node-a", "b", "gpu-0", Long));
        assert!(!already_set(&checkpoint, "node-a", "a", "gpu-0", Long));
        assert!(!already_set(&checkpoint, "node-a", "b", "gpu-0", Short));
        let mut starting = checkpoint.clone();
        if let Some(entry) = starting.claims.get_mut("a") {
            entry.state = PrepareState::PrepareStarted;
        }
        assert!(!already_set(&starting, "node-a", "b", "gpu-0", Long), "a started prepare has not set it yet");
    }

    #[test]
    fn what_goes_back_to_default() {
        let mut checkpoint = holding(&[
            ("a", "gpu-0", Some(Long), false),
            ("b", "gpu-1", None, false),
            ("recovered", "gpu-2", None, true),
        ]);
        checkpoint.time_sliced = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"].map(String::from).into();
        assert_eq!(to_set_back(&checkpoint, "node-a"), ["gpu-1", "gpu-3"]);
        assert!(held_by_recovered(&checkpoint, "node-a", "gpu-2"));
        assert!(!held_by_recovered(&checkpoint, "node-a", "gpu-0"));
    }
}
