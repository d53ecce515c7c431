//! What the API server silently dropped from a published slice. An API server whose feature gate for a field is
//! off (Kubernetes before 1.36, or the gate turned off) stores the slice without the field and says nothing, so a
//! faulted GPU stays allocatable or a shared GPU goes to one claim at a time. The agent compares what it sent with
//! what was stored and tells the operator, naming the gate. A pool stored without such a field is published again
//! once per agent start (so restarting the agents after turning the gate on fixes it), never every resync.

use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::Value;

/// A device field the API server did not keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DroppedField {
    /// `taints` (DRADeviceTaints): faults are not kept from the scheduler.
    Taints,
    /// `allowMultipleAllocations` (DRAConsumableCapacity): GPUs are not shared.
    AllowMultipleAllocations,
    /// `consumesCounters` (DRAPartitionableDevices): dynamic MIG placements could overlap.
    ConsumesCounters,
}

impl DroppedField {
    /// The field as the API names it.
    pub fn field(self) -> &'static str {
        match self {
            DroppedField::Taints => "taints",
            DroppedField::AllowMultipleAllocations => "allowMultipleAllocations",
            DroppedField::ConsumesCounters => "consumesCounters",
        }
    }

    /// The feature gate that keeps the field.
    pub fn feature_gate(self) -> &'static str {
        match self {
            DroppedField::Taints => "DRADeviceTaints",
            DroppedField::AllowMultipleAllocations => "DRAConsumableCapacity",
            DroppedField::ConsumesCounters => "DRAPartitionableDevices",
        }
    }

    /// What it means for the node's GPUs, and what to do.
    pub fn consequence(self) -> &'static str {
        match self {
            DroppedField::Taints => {
                "faulted GPUs stay allocatable (faults are still reported as Node events and in the health metrics); \
                 enable the gate on kube-apiserver, kube-scheduler and kube-controller-manager (on by default from \
                 Kubernetes 1.36), then restart the node agents to publish the taints again"
            }
            DroppedField::AllowMultipleAllocations => {
                "GPUs are not shared: each goes to one claim at a time (--gpu-sharing by-memory has no effect); \
                 enable the gate on kube-apiserver and kube-scheduler (on by default from Kubernetes 1.36), then \
                 restart the node agents to publish the field again; or use --gpu-sharing whole"
            }
            DroppedField::ConsumesCounters => {
                "dynamic MIG is off: the agent publishes the MIG devices that exist instead, at once (--mig-layout \
                 static); enable the gate on kube-apiserver and kube-scheduler (on by default from Kubernetes 1.36), \
                 then restart the node agents"
            }
        }
    }
}

/// The fields some device of `sent` (the devices of one slice as published) had that the same device of `stored`
/// (the slice as the API server returned it) lacks; each once, in a fixed order.
pub fn dropped_fields(sent: &[Value], stored: &ResourceSlice) -> Vec<DroppedField> {
    let stored_devices = stored.spec.devices.as_deref().unwrap_or_default();
    let mut dropped = Vec::new();
    for device in sent {
        let Some(kept) = stored_devices.iter().find(|d| device["name"].as_str() == Some(d.name.as_str())) else {
            continue;
        };
        let sent_taints = device["taints"].as_array().is_some_and(|t| !t.is_empty());
        if sent_taints && kept.taints.as_ref().is_none_or(Vec::is_empty) {
            dropped.push(DroppedField::Taints);
        }
        if device["allowMultipleAllocations"] == Value::Bool(true) && kept.allow_multiple_allocations != Some(true) {
            dropped.push(DroppedField::AllowMultipleAllocations);
        }
        let sent_counters = device["consumesCounters"].as_array().is_some_and(|c| !c.is_empty());
        if sent_counters && kept.consumes_counters.as_ref().is_none_or(Vec::is_empty) {
            dropped.push(DroppedField::ConsumesCounters);
        }
    }
    dropped.sort();
    dropped.dedup();
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(devices: Value) -> ResourceSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "s"},
            "spec": {"driver": "d", "nodeName": "n", "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}
        }))
        .expect("slice")
    }

    fn taint() -> Value {
        json!({"key": "gpu.gpu-dra.dev/needs-reset", "value": "ecc-double-bit", "effect": "NoSchedule"})
    }

    #[test]
    fn names_each_field_the_server_dropped_once() {
        let sent = [
            json!({"name": "gpu-0", "taints": [taint()], "allowMultipleAllocations": true}),
            json!({"name": "gpu-1", "taints": [taint()], "allowMultipleAllocations": true}),
        ];
        let cases = [
            // (what the server stored, what was dropped)
            (
                json!([{"name": "gpu-0"}, {"name": "gpu-1"}]),
                vec![DroppedField::Taints, DroppedField::AllowMultipleAllocations],
            ),
            (
                json!([{"name": "gpu-0", "taints": [taint()]}, {"name": "gpu-1", "taints": [taint()]}]),
                vec![DroppedField::AllowMultipleAllocations],
            ),
            (
                json!([{"name": "gpu-0", "allowMultipleAllocations": true, "taints": [taint()]},
                       {"name": "gpu-1", "allowMultipleAllocations": true, "taints": [taint()]}]),
                vec![],
            ),
            (
                json!([{"name": "gpu-0", "allowMultipleAllocations": true, "taints": []},
                       {"name": "gpu-1", "allowMultipleAllocations": true}]),
                vec![DroppedField::Taints],
            ),
        ];
        for (kept, want) in cases {
            assert_eq!(dropped_fields(&sent, &stored(kept.clone())), want, "stored {kept}");
        }
    }

    #[test]
    fn consumed_counters_the_server_dropped_are_named() {
        let consumes = json!([{"counterSet": "gpu-0-counter-set", "counters": {"compute-slices": {"value": "1"}}}]);
        let sent = [json!({"name": "gpu-0-mig-19-0-1", "consumesCounters": consumes})];
        let lost = stored(json!([{"name": "gpu-0-mig-19-0-1"}]));
        assert_eq!(dropped_fields(&sent, &lost), vec![DroppedField::ConsumesCounters]);
        let kept = stored(json!([{"name": "gpu-0-mig-19-0-1", "consumesCounters": consumes}]));
        assert_eq!(dropped_fields(&sent, &kept), vec![]);
    }

    #[test]
    fn fields_never_sent_are_never_missed() {
        let sent =
            [json!({"name": "gpu-0"}), json!({"name": "gpu-1", "taints": [], "allowMultipleAllocations": false})];
        assert_eq!(dropped_fields(&sent, &stored(json!([{"name": "gpu-0"}, {"name": "gpu-1"}]))), vec![]);
        // A device the server does not return at all is not a dropped field (nothing to compare).
        assert_eq!(dropped_fields(&[json!({"name": "gpu-9", "taints": [taint()]})], &stored(json!([]))), vec![]);
    }

    #[test]
    fn every_field_names_its_gate_and_what_to_do() {
        for field in [DroppedField::Taints, DroppedField::AllowMultipleAllocations, DroppedField::ConsumesCounters] {
            assert!(field.feature_gate().starts_with("DRA"));
            assert!(field.consequence().contains("enable the gate"), "{field:?}");
        }
    }
}
