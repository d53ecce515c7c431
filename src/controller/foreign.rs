//! Detecting another active ResourceClaim controller, on evidence a tenant cannot forge.
//!
//! kube-controller-manager runs its own `resourceclaim-controller` by default since 1.34. Two controllers that
//! both create claims race: a pod gets two claims. Anyone who may create ResourceClaims can make a claim that
//! *looks* generated (the pod-claim-name annotation, a Pod as controlling owner, any field manager name), and may
//! rewrite the managed fields of any claim in their namespace, gpu-dra's included, so neither a claim nor its
//! managed fields prove anything. What a tenant cannot write is a pod's **status**: `pods/status` is granted to the
//! kubelet, the scheduler and controllers, never by the `edit` or `admin` roles, and a pod's status is reset when
//! the pod is created. The evidence is therefore:
//!
//! - a pod's `status.resourceClaimStatuses` came to record claim C for its pod claim N while this replica led and
//!   watched the pod (the record was not there when it last saw the pod), and this replica did not write that
//!   record: another writer of pod status wrote it; and
//! - C is owned by that pod (its UID), annotated with N, created by a field manager other than this controller's,
//!   after this replica began to lead.
//!
//! Only another writer of pod status that generates claims, i.e. another claim controller, produces that. A record
//! this replica wrote never counts, whatever a tenant then does to its claim (strips gpu-dra from its managed
//! fields, or deletes it and makes one of the same name), nor does a claim it adopted; nor does a record already
//! there when this replica first saw the pod, as it cannot tell who wrote it (a previous leader). "After this
//! replica began to lead" keeps out claims that a previous leader made: with leader election the window opens
//! [`CLOCK_SKEW`] after leadership began (a previous leader stopped writing before that); without it,
//! [`CLOCK_SKEW`] before the process started, as claims of that age cannot be a predecessor's.
//!
//! On the first evidence the controller says so (a Warning event on the claim, an error log line with the fix,
//! `gpu_dra_controller_another_claim_controller_detected` = 1). What it does then is the operator's explicit
//! choice, `--on-another-claim-controller`: `warn` (default) keeps creating claims, pod by pod, and removes the
//! unused duplicates either controller made; `observe-only` stops this controller from creating, adopting,
//! reserving and recording anything cluster-wide for the rest of its life
//! (`gpu_dra_controller_observe_only` = 1).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Mutex, OnceLock, PoisonError};

use smallvec::SmallVec;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tracing::error;

use super::decide;
use super::events::Reason;
use super::slim_claim::ResourceClaim;
use super::slim_pod::Pod;
use super::{CLAIM_FIELD_MANAGER, Context};

/// Clock skew tolerated between this process and the API server when comparing creation times.
const CLOCK_SKEW: SignedDuration = SignedDuration::from_secs(5);

/// What the operator should do, repeated in the event, the log and the docs.
pub const REMEDY: &str = "Run only one ResourceClaim controller: start kube-controller-manager with \
--controllers=*,-resourceclaim-controller, or uninstall gpu-dra's controller (Helm value controller.enabled=false); \
then restart gpu-dra's controller";

/// What this controller does once it has evidence of another active claim controller
/// (`--on-another-claim-controller`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnAnotherController {
    /// Say so (event, log, metric) and keep creating claims; unused duplicate claims are removed.
    #[default]
    Warn,
    /// Say so and stop creating, adopting, reserving and recording claims cluster-wide until restarted.
    ObserveOnly,
}

/// The first evidence found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detection {
    /// The manager that created the claim (for the log and the event; never a metric label).
    pub field_manager: String,
    /// `namespace/name` of the claim and of the pod whose status records it.
    pub claim: String,
    pub pod: String,
}

/// Watches pods and claims for evidence of another active claim controller.
#[derive(Debug)]
pub struct ForeignControllerDetector {
    mode: OnAnotherController,
    /// Claims created from then on count; unset (nothing counts) until this replica leads.
    since: OnceLock<Timestamp>,
    detection: OnceLock<Detection>,
    /// What the statuses of pods with claims recorded when this replica last saw them, and the records this replica
    /// wrote, by pod UID ([`uid_key`]); a pod's entry goes with the pod. Every pod with claims has one, so it is
    /// kept small: no names, and no allocation for a pod of one claim (about 70 bytes a pod; 470 with the names,
    /// which put the controller's peak RSS over 10,000 pods from 0.23x to 0.27x kube-controller-manager's).
    seen: Mutex<HashMap<u128, Seen>>,
}

/// What the detector knows of one pod's records.
#[derive(Debug, Default)]
struct Seen {
    /// As its status showed them when last seen.
    shown: SmallVec<[Record; 1]>,
    /// [`record_id`]s of the records this replica wrote, shown yet or not: a pod event between the write and its
    /// echo (a condition, a label a tenant sets) must not make the echo look like another writer's.
    ours: SmallVec<[u64; 1]>,
}

/// A record (pod claim, claim) of a pod's status as the detector keeps it: a 64-bit digest of the two names. Two
/// records of one pod mistaken for each other is a chance of 1 in 2^64.
pub fn record_id(pod_claim: &str, claim: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    (pod_claim, claim).hash(&mut hasher);
    hasher.finish()
}

/// A pod UID as the detector's key: the UUID's 128 bits (the API server makes every UID a UUID); another string
/// (none an API server makes), a 64-bit digest of it.
fn uid_key(uid: &str) -> u128 {
    let digits = uid.chars().filter(|c| *c != '-').map(|c| c.to_digit(16));
    let bits = digits.clone().try_fold(0u128, |bits, digit| Some(bits << 4 | u128::from(digit?)));
    match bits {
        Some(bits) if uid.len() == 36 && digits.count() == 32 => bits,
        _ => {
            let mut hasher = DefaultHasher::new();
            uid.hash(&mut hasher);
            u128::from(hasher.finish())
        }
    }
}

/// A claim a pod's status records for one of its pod claims, as the detector saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// [`record_id`] of (pod claim, claim).
    pub id: u64,
    /// Came to be recorded while this replica led and watched the pod, and not by this replica.
    pub foreign: bool,
}

/// The records a pod's status shows now (`current`: pod claim, claim), given those seen before (`before`; `None` on
/// the first sight of the pod), the ones this replica wrote (`ours`) and whether this replica leads. A record seen
/// before keeps what was known of it; one there at first sight is of unknown origin; one that appeared since, while
/// this replica led, is another writer's unless this replica wrote it.
pub fn observe(
    before: Option<&[Record]>,
    ours: &[u64],
    current: &[(&str, &str)],
    leading: bool,
) -> SmallVec<[Record; 1]> {
    current
        .iter()
        .map(|&(pod_claim, claim)| {
            let id = record_id(pod_claim, claim);
            let known = before.and_then(|b| b.iter().find(|r| r.id == id));
            let foreign = match (before, known) {
                (_, Some(record)) => record.foreign,
                (None, None) => false,
                (Some(_), None) => leading && !ours.contains(&id),
            };
            Record { id, foreign }
        })
        .collect()
}

impl ForeignControllerDetector {
    pub fn new(mode: OnAnotherController) -> Self {
        Self { mode, since: OnceLock::new(), detection: OnceLock::new(), seen: Mutex::default() }
    }

    /// Opens the evidence window when this replica starts to lead (`now`). `elected`: leadership came from an
    /// election, so a previous leader may have written until shortly before.
    pub fn start_leading(&self, now: Timestamp, elected: bool) {
        let since = if elected { now + CLOCK_SKEW } else { now - CLOCK_SKEW };
        let _ = self.since.set(since);
    }

    /// Whether this controller must leave claims alone: observe-only was chosen and another controller is active.
    pub fn observe_only(&self) -> bool {
        self.mode == OnAnotherController::ObserveOnly && self.detection.get().is_some()
    }

    pub fn detection(&self) -> Option<&Detection> {
        self.detection.get()
    }

    /// Records that this replica is about to record `entries` (pod claim, claim) in `pod`'s status (claims it
    /// created or adopted): known as its own before the pod watch can show them.
    /// A pod without an entry is gone (the pod watch notes every pod with claims before it can be synced): nothing
    /// is kept for it.
    pub fn writing(&self, pod: &Pod, entries: &[(String, String)]) {
        let Some(uid) = pod.metadata.uid.as_deref() else { return };
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(known) = seen.get_mut(&uid_key(uid)) else { return };
        for (pod_claim, claim) in entries {
            let id = record_id(pod_claim, claim);
            if !known.ours.contains(&id) {
                known.ours.push(id);
            }
        }
    }

    /// A pod is gone: what its status recorded is forgotten.
    pub fn pod_gone(&self, pod_uid: &str) {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).remove(&uid_key(pod_uid));
    }

    /// Whether `pod`'s status came to record `claim` for `pod_claim` by another writer (see [`observe`]).
    fn foreign_record(&self, pod: &Pod, pod_claim: &str, claim: &str) -> bool {
        let Some(uid) = pod.metadata.uid.as_deref() else { return false };
        let id = record_id(pod_claim, claim);
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        seen.get(&uid_key(uid)).is_some_and(|known| known.shown.iter().any(|r| r.foreign && r.id == id))
    }

    /// Checks a claim from the claim watch against the pod it names as owner (from the cache).
    pub fn inspect(&self, ctx: &Context, claim: &ResourceClaim) {
        if self.detection.get().is_some() {
            return;
        }
        let Some((pod_name, _)) = decide::owning_pod(claim) else { return };
        let key = super::queue::ObjectKey::new(claim.namespace().unwrap_or_default(), pod_name);
        if let Some(pod) = ctx.caches.pod(&key) {
            self.check(ctx, &pod, claim);
        }
    }

    /// Notes what `pod`'s status records (from the pod watch), and checks the claims that came to be recorded by
    /// another writer against the cache.
    pub fn inspect_pod(&self, ctx: &Context, pod: &Pod) {
        if self.detection.get().is_some() || decide::pod_claims(pod).is_empty() {
            return;
        }
        let Some(uid) = pod.metadata.uid.as_deref() else { return };
        let statuses = pod.status.as_ref().and_then(|s| s.resource_claim_statuses.as_deref()).unwrap_or_default();
        let current: Vec<(&str, &str)> = statuses
            .iter()
            .filter_map(|s| s.resource_claim_name.as_deref().map(|claim| (s.name.as_str(), claim)))
            .collect();
        let foreign: Vec<&str> = {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            let key = uid_key(uid);
            let first_sight = !seen.contains_key(&key);
            let known = seen.entry(key).or_default();
            let before = (!first_sight).then_some(known.shown.as_slice());
            let shown = observe(before, &known.ours, &current, self.since.get().is_some());
            // `shown` follows `current`, record by record.
            let foreign = shown.iter().zip(&current).filter(|(r, _)| r.foreign).map(|(_, (_, claim))| *claim).collect();
            known.shown = shown;
            foreign
        };
        let namespace = pod.namespace().unwrap_or_default();
        for name in foreign {
            if let Some(claim) = ctx.caches.claim(&namespace, name) {
                self.check(ctx, pod, &claim);
            }
        }
    }

    fn check(&self, ctx: &Context, pod: &Pod, claim: &ResourceClaim) {
        let Some(since) = self.since.get() else { return };
        let Some(detection) = evidence(pod, claim, *since) else { return };
        let pod_claim = decide::pod_claim_name_annotation(claim).unwrap_or_default();
        if !self.foreign_record(pod, pod_claim, &claim.name_any()) || self.detection.set(detection.clone()).is_err() {
            return;
        }
        // Nothing more to find: what was seen is of no further use.
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).clear();
        ctx.metrics.set_another_controller_detected(true);
        let consequence = match self.mode {
            OnAnotherController::ObserveOnly => {
                ctx.metrics.set_observe_only(true);
                error!(
                    claim = %detection.claim, pod = %detection.pod, field_manager = %detection.field_manager,
                    "another ResourceClaim controller is active; gpu-dra controller is now OBSERVE-ONLY and creates \
                     no claims. {REMEDY}"
                );
                "gpu-dra controller now only observes (--on-another-claim-controller=observe-only)"
            }
            OnAnotherController::Warn => {
                error!(
                    claim = %detection.claim, pod = %detection.pod, field_manager = %detection.field_manager,
                    "another ResourceClaim controller is active; both create claims and pods can get duplicates \
                     (removed once unused). {REMEDY}, or start gpu-dra with --on-another-claim-controller=observe-only"
                );
                "gpu-dra controller keeps creating claims and removes unused duplicates \
                 (--on-another-claim-controller=warn)"
            }
        };
        let note = format!(
            "Pod {} records ResourceClaim {}, which field manager {:?} created: another ResourceClaim controller is \
             active. {consequence}. {REMEDY}.",
            detection.pod, detection.claim, detection.field_manager
        );
        ctx.events.claim_warning(claim, Reason::AnotherClaimControllerActive, note);
    }
}

/// The evidence `claim` gives of another claim controller (see the module docs), who wrote the pod's record
/// aside: the pod's status records the claim for the pod claim it is annotated with, the claim is the pod's (UID),
/// and it was created at or after `since` by a manager other than this controller.
pub fn evidence(pod: &Pod, claim: &ResourceClaim, since: Timestamp) -> Option<Detection> {
    if !decide::is_owned_by(claim, pod) {
        return None;
    }
    let pod_claim = decide::pod_claim_name_annotation(claim)?;
    let name = claim.name_any();
    if decide::recorded_claim(pod, pod_claim) != Some(name.as_str()) {
        return None;
    }
    if claim.metadata.creation_timestamp.as_ref()?.0 < since {
        return None;
    }
    if claim.writers.iter().any(|w| w == CLAIM_FIELD_MANAGER) {
        return None;
    }
    let namespace = claim.namespace().unwrap_or_default();
    Some(Detection {
        field_manager: claim.writers.first().cloned().unwrap_or_default(),
        claim: format!("{namespace}/{name}"),
        pod: format!("{namespace}/{}", pod.name_any()),
    })
}

/// A bounded label for a field manager: kube-controller-manager's name or `other`. Any manager name can be
/// chosen by whoever writes, so the name itself never becomes a label value.
pub fn manager_label(field_manager: &str) -> &'static str {
    if field_manager == "kube-controller-manager" { "kube-controller-manager" } else { "other" }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    const SINCE: &str = "2026-12-01T10:00:00Z";
    const FRESH: &str = "2026-12-01T10:00:01Z";

    fn claim(manager: &str, created: &str, owner_uid: &str) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {
                "name": "p-gpu-abcde", "namespace": "ns", "uid": "claim-uid", "creationTimestamp": created,
                "annotations": {decide::POD_CLAIM_NAME_ANNOTATION: "gpu"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": owner_uid, "controller": true}],
                "managedFields": [
                    {"manager": manager, "operation": "Update", "apiVersion": "resource.k8s.io/v1"},
                    {"manager": "kube-scheduler", "operation": "Update", "apiVersion": "resource.k8s.io/v1", "subresource": "status"}
                ]
            },
            "spec": {"devices": {"requests": []}}
        }))
        .expect("claim")
    }

    fn pod(recorded: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid"},
            "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
            "status": {"resourceClaimStatuses": recorded}
        }))
        .expect("pod")
    }

    #[test]
    fn only_a_recorded_fresh_claim_of_the_pod_by_another_manager_is_evidence() {
        let since: Timestamp = SINCE.parse().expect("ts");
        let recorded = pod(json!([{"name": "gpu", "resourceClaimName": "p-gpu-abcde"}]));
        let kcm = claim("kube-controller-manager", FRESH, "pod-uid");
        let found = evidence(&recorded, &kcm, since).expect("evidence");
        assert_eq!((found.field_manager.as_str(), found.claim.as_str()), ("kube-controller-manager", "ns/p-gpu-abcde"));

        let cases = [
            (pod(json!([])), kcm.clone(), "not recorded: anyone can create such a claim"),
            (pod(json!([{"name": "gpu", "resourceClaimName": "other"}])), kcm.clone(), "the status records another"),
            (recorded.clone(), claim("kube-controller-manager", FRESH, "forged-uid"), "owner UID of no such pod"),
            (recorded.clone(), claim(CLAIM_FIELD_MANAGER, FRESH, "pod-uid"), "our own claim"),
            (recorded.clone(), claim("kube-controller-manager", "2026-12-01T09:59:59Z", "pod-uid"), "before since"),
        ];
        for (pod, claim, why) in cases {
            assert_eq!(evidence(&pod, &claim, since), None, "{why}");
        }
    }

    #[test]
    fn pod_uids_are_kept_as_their_128_bits_and_other_strings_apart() {
        let uid = "0f3c7b1e-9a4d-4c2b-8e6f-1a2b3c4d5e6f";
        assert_eq!(uid_key(uid), 0x0f3c7b1e_9a4d_4c2b_8e6f_1a2b3c4d5e6f);
        assert_ne!(uid_key(uid), uid_key("0f3c7b1e-9a4d-4c2b-8e6f-1a2b3c4d5e6e"));
        assert_eq!(uid_key("8f3c7b1e-9a4d-4c2b-8e6f-1a2b3c4d5e6f") >> 124, 8, "all 128 bits kept");
        assert_ne!(uid_key("pod-a"), uid_key("pod-b"), "another string: its digest");
        assert_eq!(uid_key("pod-a"), uid_key("pod-a"));
        assert_ne!(record_id("gpu", "c1"), record_id("gpu", "c2"));
        assert_ne!(record_id("gpu", "c1"), record_id("gpuc", "1"));
    }

    #[test]
    fn only_a_record_another_writer_made_while_this_replica_led_is_foreign() {
        let r = |pod_claim: &str, claim: &str, foreign| Record { id: record_id(pod_claim, claim), foreign };
        let foreign_of = |records: SmallVec<[Record; 1]>| records.into_iter().map(|r| r.foreign).collect::<Vec<_>>();
        let now = [("gpu", "c1")];
        let none: &[u64] = &[];
        let ours = [record_id("gpu", "c1")];
        // First sight of the pod: whoever wrote it, it is of unknown origin (a previous leader's).
        assert_eq!(foreign_of(observe(None, none, &now, true)), [false]);
        // Appeared since the last sight: another writer's while leading, of no account while standing by.
        assert_eq!(foreign_of(observe(Some(&[]), none, &now, true)), [true]);
        assert_eq!(foreign_of(observe(Some(&[]), none, &now, false)), [false]);
        // Written by this replica: not foreign when it appears, also after pod events in between showed it not yet.
        let between = observe(Some(&[]), &ours, &[], true);
        assert_eq!(foreign_of(observe(Some(&between), &ours, &now, true)), [false]);
        // Once foreign, foreign while it stays; another claim for the same pod claim is a new record.
        assert_eq!(foreign_of(observe(Some(&[r("gpu", "c1", true)]), none, &now, true)), [true]);
        assert_eq!(foreign_of(observe(Some(&[r("gpu", "c0", false)]), &ours[..0], &now, true)), [true]);
        // Several pod claims, each on its own.
        let two = [("gpu", "c1"), ("nic", "n1")];
        assert_eq!(foreign_of(observe(Some(&[r("gpu", "c1", false)]), &ours, &two, true)), [false, true]);
    }

    #[test]
    fn the_window_opens_after_an_elected_leadership_began() {
        let now: Timestamp = SINCE.parse().expect("ts");
        let elected = ForeignControllerDetector::new(OnAnotherController::Warn);
        elected.start_leading(now, true);
        assert_eq!(elected.since.get().copied(), Some(now + CLOCK_SKEW));
        let single = ForeignControllerDetector::new(OnAnotherController::Warn);
        single.start_leading(now, false);
        assert_eq!(single.since.get().copied(), Some(now - CLOCK_SKEW));
        assert!(!single.observe_only(), "nothing detected yet");
    }

    #[test]
    fn manager_labels_are_bounded() {
        assert_eq!(manager_label("kube-controller-manager"), "kube-controller-manager");
        for forged in ["tenant-1", "", "kube-controller-manager ", "x".repeat(300).as_str()] {
            assert_eq!(manager_label(forged), "other");
        }
    }
}
