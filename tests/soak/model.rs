//! What the soak has seen of pods and claims, built from watch events: every pod and claim ever seen, with the
//! times (since the soak started) when it appeared, finished and went away. Pure: the observer feeds it objects
//! as JSON, the invariant checks read it, the unit tests build it from literals.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

/// `metadata.annotations` key of a claim generated for a pod claim (kube-controller-manager, gpu-dra).
pub const POD_CLAIM_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
/// `metadata.annotations` key of a claim the scheduler created for a pod's extended resources.
pub const EXTENDED_ANNOTATION: &str = "resource.kubernetes.io/extended-resource-claim";
/// The pod-claim key of a pod's extended-resource claim (one per pod).
pub const EXTENDED_KEY: &str = "<extended-resources>";

/// One pod as last seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodRecord {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub first_seen: Duration,
    /// First seen in a terminal phase, terminating, or gone: its claims are no longer needed from then on.
    pub finished_at: Option<Duration>,
    pub gone_at: Option<Duration>,
    /// Phase `Running`: the kubelet prepared its claims.
    pub running: bool,
    /// Pod claims that come from a ResourceClaimTemplate.
    pub template_claims: Vec<String>,
    /// Claims the pod names directly (`resourceClaimName`).
    pub direct_claims: Vec<String>,
    /// `status.resourceClaimStatuses`: pod claim → generated claim name (None: none needed).
    pub statuses: BTreeMap<String, Option<String>>,
    /// `status.extendedResourceClaimStatus.resourceClaimName`.
    pub extended_claim: Option<String>,
    /// `spec.schedulingGroup.podGroupName`: the PodGroup the pod belongs to.
    pub group: Option<String>,
}

impl PodRecord {
    /// Whether the pod is done at `now` (a terminal phase, terminating, or deleted).
    pub fn finished(&self) -> bool {
        self.finished_at.is_some()
    }

    /// The claims a running pod uses, by name: generated, extended-resource and direct ones.
    pub fn claim_names(&self) -> Vec<String> {
        let generated = self.statuses.values().flatten().cloned();
        generated.chain(self.extended_claim.clone()).chain(self.direct_claims.iter().cloned()).collect()
    }
}

/// One claim as last seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClaimRecord {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// UID of the Pod that is its controlling owner.
    pub owner_pod: Option<String>,
    /// The pod claim it was generated for: the annotation, or [`EXTENDED_KEY`].
    pub pod_claim: Option<String>,
    pub first_seen: Duration,
    pub gone_at: Option<Duration>,
    pub allocated: bool,
    /// Pod UIDs in `status.reservedFor`, with when each was first seen there.
    pub reserved: BTreeMap<String, Duration>,
    /// UID of the PodGroup that is its controlling owner (a PodGroup's claim, KEP-5729).
    pub owner_group: Option<String>,
    /// PodGroups in `status.reservedFor`: UID → (name, when first seen there).
    pub reserved_groups: BTreeMap<String, (String, Duration)>,
}

/// One PodGroup as last seen.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupRecord {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub gone_at: Option<Duration>,
    /// Its claims that come from a ResourceClaimTemplate.
    pub template_claims: Vec<String>,
}

impl ClaimRecord {
    pub fn alive(&self) -> bool {
        self.gone_at.is_none()
    }
}

/// Everything seen, by UID.
#[derive(Debug, Default, Clone)]
pub struct Model {
    pub pods: BTreeMap<String, PodRecord>,
    pub claims: BTreeMap<String, ClaimRecord>,
    pub groups: BTreeMap<String, GroupRecord>,
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, key| v.get(key)).and_then(Value::as_str)
}

fn array_at<'a>(v: &'a Value, path: &[&str]) -> impl Iterator<Item = &'a Value> {
    path.iter().try_fold(v, |v, key| v.get(key)).and_then(Value::as_array).into_iter().flatten()
}

impl Model {
    /// A pod added or changed at `now`.
    pub fn pod_seen(&mut self, pod: &Value, now: Duration) {
        let Some(uid) = str_at(pod, &["metadata", "uid"]) else { return };
        let record = self.pods.entry(uid.to_string()).or_insert_with(|| PodRecord {
            uid: uid.to_string(),
            namespace: str_at(pod, &["metadata", "namespace"]).unwrap_or_default().to_string(),
            name: str_at(pod, &["metadata", "name"]).unwrap_or_default().to_string(),
            first_seen: now,
            ..Default::default()
        });
        let phase = str_at(pod, &["status", "phase"]).unwrap_or_default();
        let terminating = pod["metadata"].get("deletionTimestamp").is_some_and(|t| !t.is_null());
        if (terminating || phase == "Succeeded" || phase == "Failed") && record.finished_at.is_none() {
            record.finished_at = Some(now);
        }
        record.running = phase == "Running" && record.finished_at.is_none();
        record.template_claims.clear();
        record.direct_claims.clear();
        for claim in array_at(pod, &["spec", "resourceClaims"]) {
            let name = claim["name"].as_str().unwrap_or_default().to_string();
            if claim.get("resourceClaimTemplateName").and_then(Value::as_str).is_some() {
                record.template_claims.push(name);
            } else if let Some(direct) = claim.get("resourceClaimName").and_then(Value::as_str) {
                record.direct_claims.push(direct.to_string());
            }
        }
        record.statuses = array_at(pod, &["status", "resourceClaimStatuses"])
            .map(|s| {
                let name = s["name"].as_str().unwrap_or_default().to_string();
                (name, s.get("resourceClaimName").and_then(Value::as_str).map(str::to_string))
            })
            .collect();
        record.extended_claim =
            str_at(pod, &["status", "extendedResourceClaimStatus", "resourceClaimName"]).map(str::to_string);
        record.group = str_at(pod, &["spec", "schedulingGroup", "podGroupName"]).map(str::to_string);
    }

    /// A PodGroup added or changed.
    pub fn group_seen(&mut self, group: &Value) {
        let Some(uid) = str_at(group, &["metadata", "uid"]) else { return };
        let record = self.groups.entry(uid.to_string()).or_insert_with(|| GroupRecord {
            uid: uid.to_string(),
            namespace: str_at(group, &["metadata", "namespace"]).unwrap_or_default().to_string(),
            name: str_at(group, &["metadata", "name"]).unwrap_or_default().to_string(),
            ..Default::default()
        });
        record.template_claims = array_at(group, &["spec", "resourceClaims"])
            .filter(|c| c.get("resourceClaimTemplateName").and_then(Value::as_str).is_some())
            .filter_map(|c| c["name"].as_str().map(str::to_string))
            .collect();
    }

    /// Whether `pod_claim` of `pod` is its PodGroup's claim (the group, by name, has a template claim of that
    /// name: upstream `BindTo`).
    pub fn is_group_claim_of(&self, pod: &PodRecord, pod_claim: &str) -> bool {
        pod.group.as_deref().is_some_and(|group| {
            self.groups.values().any(|g| {
                g.namespace == pod.namespace && g.name == group && g.template_claims.iter().any(|c| c == pod_claim)
            })
        })
    }

    /// A PodGroup deleted (or found missing after a re-list) at `now`.
    pub fn group_gone(&mut self, uid: &str, now: Duration) {
        if let Some(record) = self.groups.get_mut(uid) {
            record.gone_at.get_or_insert(now);
        }
    }

    /// A pod deleted (or found missing after a re-list) at `now`.
    pub fn pod_gone(&mut self, uid: &str, now: Duration) {
        if let Some(record) = self.pods.get_mut(uid) {
            record.gone_at.get_or_insert(now);
            record.finished_at.get_or_insert(now);
            record.running = false;
        }
    }

    /// A claim added or changed at `now`.
    pub fn claim_seen(&mut self, claim: &Value, now: Duration) {
        let Some(uid) = str_at(claim, &["metadata", "uid"]) else { return };
        let annotations = &claim["metadata"]["annotations"];
        let pod_claim = match annotations.get(POD_CLAIM_ANNOTATION).and_then(Value::as_str) {
            Some(name) => Some(name.to_string()),
            None => (annotations.get(EXTENDED_ANNOTATION).and_then(Value::as_str) == Some("true"))
                .then(|| EXTENDED_KEY.to_string()),
        };
        let owner_pod = array_at(claim, &["metadata", "ownerReferences"])
            .find(|o| o["kind"] == "Pod" && o["controller"] == true)
            .and_then(|o| o["uid"].as_str())
            .map(str::to_string);
        let record = self.claims.entry(uid.to_string()).or_insert_with(|| ClaimRecord {
            uid: uid.to_string(),
            namespace: str_at(claim, &["metadata", "namespace"]).unwrap_or_default().to_string(),
            name: str_at(claim, &["metadata", "name"]).unwrap_or_default().to_string(),
            first_seen: now,
            ..Default::default()
        });
        record.owner_pod = owner_pod;
        record.owner_group = array_at(claim, &["metadata", "ownerReferences"])
            .find(|o| o["kind"] == "PodGroup" && o["controller"] == true)
            .and_then(|o| o["uid"].as_str())
            .map(str::to_string);
        let groups: Vec<(String, String)> = array_at(claim, &["status", "reservedFor"])
            .filter(|r| r["resource"] == "podgroups")
            .filter_map(|r| Some((r["uid"].as_str()?.to_string(), r["name"].as_str()?.to_string())))
            .collect();
        record.reserved_groups.retain(|uid, _| groups.iter().any(|(u, _)| u == uid));
        for (uid, name) in groups {
            record.reserved_groups.entry(uid).or_insert((name, now));
        }
        record.pod_claim = pod_claim;
        record.allocated = claim["status"].get("allocation").is_some_and(|a| !a.is_null());
        let reserved: Vec<String> = array_at(claim, &["status", "reservedFor"])
            .filter(|r| r["resource"] == "pods")
            .filter_map(|r| r["uid"].as_str().map(str::to_string))
            .collect();
        record.reserved.retain(|uid, _| reserved.contains(uid));
        for uid in reserved {
            record.reserved.entry(uid).or_insert(now);
        }
    }

    /// A claim deleted (or found missing after a re-list) at `now`.
    pub fn claim_gone(&mut self, uid: &str, now: Duration) {
        if let Some(record) = self.claims.get_mut(uid) {
            record.gone_at.get_or_insert(now);
        }
    }

    /// The pod a claim was generated for: its controlling owner, when that is a pod of the same namespace.
    pub fn owner_of(&self, claim: &ClaimRecord) -> Option<&PodRecord> {
        let pod = self.pods.get(claim.owner_pod.as_ref()?)?;
        (pod.namespace == claim.namespace).then_some(pod)
    }

    /// The pod and pod claim a claim was generated for: its owner (see [`Model::owner_of`]) and a pod claim that
    /// pod has (a template claim, or its extended resources). A tenant's claim with a made-up pod claim name is
    /// no pod's claim.
    pub fn generated_for<'a>(&'a self, claim: &'a ClaimRecord) -> Option<(&'a PodRecord, &'a str)> {
        let pod = self.owner_of(claim)?;
        let pod_claim = claim.pod_claim.as_deref()?;
        (pod_claim == EXTENDED_KEY || pod.template_claims.iter().any(|c| c == pod_claim)).then_some((pod, pod_claim))
    }

    /// The live claim `namespace/name`.
    pub fn live_claim(&self, namespace: &str, name: &str) -> Option<&ClaimRecord> {
        self.claims.values().find(|c| c.alive() && c.namespace == namespace && c.name == name)
    }
}

/// Builders for the unit tables of the invariant checks.
pub mod fixtures {
    use serde_json::{Value, json};

    pub fn pod(uid: &str, phase: &str, claims: Value, statuses: Value) -> Value {
        json!({"metadata": {"uid": uid, "namespace": "ns", "name": format!("pod-{uid}")},
               "spec": {"resourceClaims": claims}, "status": {"phase": phase, "resourceClaimStatuses": statuses}})
    }

    /// PodGroup `g-<uid>` with the template claim `gpu`.
    pub fn group(uid: &str) -> Value {
        json!({"metadata": {"uid": uid, "namespace": "ns", "name": format!("g-{uid}")},
               "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}})
    }

    /// A running member pod of PodGroup `g-<group>` that records `claim` for its claim `gpu`.
    pub fn member(uid: &str, group: &str, claim: &str) -> Value {
        let mut pod = pod(
            uid,
            "Running",
            json!([{"name": "gpu", "resourceClaimTemplateName": "t"}]),
            json!([{"name": "gpu", "resourceClaimName": claim}]),
        );
        pod["spec"]["schedulingGroup"] = json!({"podGroupName": format!("g-{group}")});
        pod
    }

    /// The claim of PodGroup `g-<group>`, allocated and reserved for it when `reserved`.
    pub fn group_claim(uid: &str, name: &str, group: &str, reserved: bool) -> Value {
        let mut claim = claim(uid, name, None, true, &[]);
        claim["metadata"]["ownerReferences"] = json!([{"kind": "PodGroup", "name": format!("g-{group}"), "uid": group,
                                                       "controller": true}]);
        if reserved {
            claim["status"]["reservedFor"] = json!([{"apiGroup": "scheduling.k8s.io", "resource": "podgroups",
                                                     "name": format!("g-{group}"), "uid": group}]);
        }
        claim
    }

    pub fn claim(uid: &str, name: &str, owner: Option<&str>, allocated: bool, reserved: &[&str]) -> Value {
        let owners: Vec<Value> =
            owner.iter().map(|o| json!({"kind": "Pod", "name": "x", "uid": o, "controller": true})).collect();
        let reserved: Vec<Value> =
            reserved.iter().map(|u| json!({"resource": "pods", "name": "x", "uid": u})).collect();
        let allocation = if allocated { json!({"devices": {"results": []}}) } else { Value::Null };
        json!({"metadata": {"uid": uid, "namespace": "ns", "name": name, "ownerReferences": owners,
                            "annotations": {super::POD_CLAIM_ANNOTATION: "gpu"}},
               "status": {"allocation": allocation, "reservedFor": reserved}})
    }
}
