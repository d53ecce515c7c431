//! The soak's invariants, as pure functions of the [`Model`] and the time: what is failing now
//! ([`failing`]), which failures lasted long enough to be violations ([`Checker`]), what was counted
//! ([`Counts`]) and what must be true once everything is deleted ([`EndState`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::Duration;

use super::model::{ClaimRecord, EXTENDED_KEY, Model, PodRecord};

/// How long each kind of transient state may last.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A finished (or deleted) pod's claims must be gone within this.
    pub release_deadline: Duration,
    /// A pod that is not finished must have its template claims recorded within this of being seen.
    pub creation_deadline: Duration,
    /// How long a snapshot condition may fail before it is a violation: the two watches (pods, claims) and the
    /// components each lag a little, and a fault (a killed leader, a restarted kubelet) adds a handover.
    pub grace: Duration,
    /// A claim first seen this long after its pod finished was created for a finished pod.
    pub recreate_tolerance: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            release_deadline: Duration::from_secs(15),
            creation_deadline: Duration::from_secs(30),
            grace: Duration::from_secs(15),
            recreate_tolerance: Duration::from_secs(2),
        }
    }
}

/// What went wrong; the known cause, when the kind matches a known controller bug, goes into the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    RecreatedForFinishedPod,
    NotReleased,
    ExtendedNotReleased,
    ReservedForFinishedPod,
    LiveClaimMissing,
    LiveClaimNotAllocated,
    LiveClaimNotReserved,
    ClaimsNotCreated,
    DuplicateClaims,
    MemberOwnClaim,
    GroupClaimNotReleased,
    ReservedForGoneGroup,
    AllocatedAtEnd,
    ClaimLeftAtEnd,
    CdiSpecLeft,
    CheckpointEntryLeft,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::RecreatedForFinishedPod => "claim created for a finished pod",
            Kind::NotReleased => "finished pod's claim not released",
            Kind::ExtendedNotReleased => "finished pod's extended-resource claim not released",
            Kind::ReservedForFinishedPod => "claim reserved for a finished or deleted pod",
            Kind::LiveClaimMissing => "running pod's claim missing",
            Kind::LiveClaimNotAllocated => "running pod's claim not allocated",
            Kind::LiveClaimNotReserved => "running pod's claim not reserved for it",
            Kind::ClaimsNotCreated => "pending pod's claims never created",
            Kind::DuplicateClaims => "two live claims for one pod claim",
            Kind::MemberOwnClaim => "PodGroup member got a claim of its own for a group claim",
            Kind::GroupClaimNotReleased => "deleted PodGroup's claim not released",
            Kind::ReservedForGoneGroup => "claim reserved for a deleted PodGroup",
            Kind::AllocatedAtEnd => "GPU still allocated at the end",
            Kind::ClaimLeftAtEnd => "claim left at the end",
            Kind::CdiSpecLeft => "CDI spec left at the end",
            Kind::CheckpointEntryLeft => "checkpoint entry left at the end",
        }
    }

    /// The controller bug of issue #11 this kind of violation is the symptom of, when there is one.
    pub fn known_cause(self) -> Option<&'static str> {
        match self {
            Kind::RecreatedForFinishedPod => Some("issue #11 point 1: a finished pod's claim is re-created in a loop"),
            Kind::ExtendedNotReleased => {
                Some("issue #11 point 2: extended-resource claims of finished pods are never released")
            }
            Kind::ReservedForFinishedPod => {
                Some("issue #11 point 2 when the claim is a pod's <pod>-extended-resources-* claim")
            }
            Kind::ClaimsNotCreated => Some(
                "issue #11 point 3 when the controller log says OBSERVE-ONLY (a tenant's forged claim stops claim \
                 creation cluster-wide)",
            ),
            _ => None,
        }
    }
}

/// One violation: its kind, when it was confirmed, the object, and what was seen.
#[derive(Debug, Clone, PartialEq)]
pub struct Violation {
    pub kind: Kind,
    pub at: Duration,
    pub subject: String,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:>6.1}s] {}: {} ({})", self.at.as_secs_f64(), self.kind.label(), self.subject, self.detail)
    }
}

/// A condition failing now; it becomes a violation once it has failed for `grace`.
#[derive(Debug, Clone, PartialEq)]
pub struct Failing {
    pub key: String,
    pub kind: Kind,
    pub subject: String,
    pub detail: String,
    pub grace: Duration,
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// Every condition that fails at `now`.
pub fn failing(model: &Model, now: Duration, limits: &Limits) -> Vec<Failing> {
    let mut out = Vec::new();
    let mut push = |key: String, kind: Kind, subject: String, detail: String, grace: Duration| {
        out.push(Failing { key, kind, subject, detail, grace });
    };
    let mut generated: BTreeMap<(String, String), Vec<&str>> = BTreeMap::new();
    let mut group_generated: BTreeMap<(String, String), Vec<&str>> = BTreeMap::new();
    for claim in model.claims.values() {
        let subject = format!("claim {}/{}", claim.namespace, claim.name);
        if let Some((pod, pod_claim)) = model.generated_for(claim)
            && model.is_group_claim_of(pod, pod_claim)
        {
            let group = pod.group.as_deref().unwrap_or_default();
            let detail = format!("pod {} of PodGroup {group}, pod claim {pod_claim}", pod.name);
            push(format!("member-own:{}", claim.uid), Kind::MemberOwnClaim, subject.clone(), detail, Duration::ZERO);
        }
        if let (Some(group_uid), Some(pod_claim)) = (&claim.owner_group, &claim.pod_claim) {
            if claim.alive() {
                group_generated.entry((group_uid.clone(), pod_claim.clone())).or_default().push(&claim.name);
            }
            let gone = model.groups.get(group_uid).and_then(|g| g.gone_at);
            if let Some(gone) = gone
                && claim.alive()
                && now.saturating_sub(gone) > limits.release_deadline
            {
                let detail = format!("PodGroup gone {} ago, claim still exists", secs(now.saturating_sub(gone)));
                push(
                    format!("group-release:{}", claim.uid),
                    Kind::GroupClaimNotReleased,
                    subject.clone(),
                    detail,
                    Duration::ZERO,
                );
            }
        }
        if claim.alive() {
            for (uid, (name, since)) in &claim.reserved_groups {
                let from = match model.groups.get(uid) {
                    Some(group) => group.gone_at.map(|g| g.max(*since)),
                    None => Some(*since),
                };
                if let Some(from) = from
                    && now.saturating_sub(from) > limits.grace
                {
                    let detail = format!("PodGroup {name} gone since {}", secs(from));
                    push(
                        format!("reserved-group:{}:{uid}", claim.uid),
                        Kind::ReservedForGoneGroup,
                        subject.clone(),
                        detail,
                        Duration::ZERO,
                    );
                }
            }
        }
        if let Some((pod, pod_claim)) = model.generated_for(claim) {
            if claim.alive() {
                generated.entry((pod.uid.clone(), pod_claim.to_string())).or_default().push(&claim.name);
            }
            if let Some(finished) = pod.finished_at {
                // A claim created for a finished pod is that violation; it is not counted again as unreleased. One
                // created after the pod object was gone is an informer's lag (kube-controller-manager has it too):
                // the garbage collector deletes it, and the release deadline holds it to that.
                let recreated =
                    claim.first_seen > finished + limits.recreate_tolerance && !created_after_pod_gone(pod, claim);
                if recreated {
                    let detail = format!(
                        "pod {} finished at {}, claim created at {}",
                        pod.name,
                        secs(finished),
                        secs(claim.first_seen)
                    );
                    push(
                        format!("recreated:{}", claim.uid),
                        Kind::RecreatedForFinishedPod,
                        subject.clone(),
                        detail,
                        Duration::ZERO,
                    );
                }
                let age = now.saturating_sub(finished);
                if claim.alive() && !recreated && age > limits.release_deadline {
                    let kind = if pod_claim == EXTENDED_KEY { Kind::ExtendedNotReleased } else { Kind::NotReleased };
                    let state = if claim.allocated { "allocated" } else { "unallocated" };
                    let detail = format!("pod {} finished {} ago, claim still exists ({state})", pod.name, secs(age));
                    push(format!("release:{}", claim.uid), kind, subject.clone(), detail, Duration::ZERO);
                }
            }
        }
        if !claim.alive() {
            continue;
        }
        for (uid, since) in &claim.reserved {
            let (who, finished) = match model.pods.get(uid) {
                Some(pod) => (format!("pod {}", pod.name), pod.finished_at.map(|f| f.max(*since))),
                None => (format!("unknown pod {uid}"), Some(*since)),
            };
            if let Some(from) = finished
                && now.saturating_sub(from) > limits.grace
            {
                let detail = format!("{who} finished or gone since {}", secs(from));
                push(
                    format!("reserved:{}:{uid}", claim.uid),
                    Kind::ReservedForFinishedPod,
                    subject.clone(),
                    detail,
                    Duration::ZERO,
                );
            }
        }
    }
    for ((group_uid, group_claim), names) in group_generated {
        if names.len() > 1 {
            let group = model.groups.get(&group_uid).map(|g| g.name.as_str()).unwrap_or_default();
            push(
                format!("dup-group:{group_uid}:{group_claim}"),
                Kind::DuplicateClaims,
                format!("PodGroup {group} claim {group_claim}"),
                format!("live claims {names:?}"),
                limits.grace,
            );
        }
    }
    for ((pod_uid, pod_claim), names) in generated {
        if names.len() > 1 {
            let pod = model.pods.get(&pod_uid).map(|p| p.name.as_str()).unwrap_or_default();
            push(
                format!("dup:{pod_uid}:{pod_claim}"),
                Kind::DuplicateClaims,
                format!("pod {pod} claim {pod_claim}"),
                format!("live claims {names:?}"),
                limits.grace,
            );
        }
    }
    for pod in model.pods.values().filter(|p| !p.finished()) {
        let subject = format!("pod {}/{}", pod.namespace, pod.name);
        let unrecorded: Vec<&String> = pod.template_claims.iter().filter(|c| !pod.statuses.contains_key(*c)).collect();
        if pod.running {
            for name in unrecorded {
                let detail = format!("no claim recorded for pod claim {name}");
                push(format!("live:{}:{name}", pod.uid), Kind::LiveClaimMissing, subject.clone(), detail, limits.grace);
            }
            for name in pod.claim_names() {
                let key = format!("live:{}:{name}", pod.uid);
                let (kind, detail) = match model.live_claim(&pod.namespace, &name) {
                    None => (Kind::LiveClaimMissing, format!("claim {name} does not exist")),
                    Some(c) if !c.allocated => (Kind::LiveClaimNotAllocated, format!("claim {name}")),
                    Some(c) if !c.reserved.contains_key(&pod.uid) && !reserved_for_group_of(c, pod) => {
                        (Kind::LiveClaimNotReserved, format!("claim {name} reserved for {:?}", c.reserved.keys()))
                    }
                    Some(_) => continue,
                };
                push(key, kind, subject.clone(), detail, limits.grace);
            }
        } else if !unrecorded.is_empty() && now.saturating_sub(pod.first_seen) > limits.creation_deadline {
            let detail = format!("seen {} ago, no claim for {unrecorded:?}", secs(now.saturating_sub(pod.first_seen)));
            push(format!("create:{}", pod.uid), Kind::ClaimsNotCreated, subject, detail, Duration::ZERO);
        }
    }
    out
}

/// Turns conditions that keep failing into violations, each reported once.
#[derive(Debug, Default)]
pub struct Checker {
    pub limits: Limits,
    /// Key → when it was first seen failing (without a break).
    failing_since: HashMap<String, Duration>,
    reported: BTreeSet<String>,
    pub violations: Vec<Violation>,
}

impl Checker {
    pub fn new(limits: Limits) -> Self {
        Self { limits, ..Default::default() }
    }

    /// Checks the model at `now`; returns the violations confirmed by this call.
    pub fn check(&mut self, model: &Model, now: Duration) -> Vec<Violation> {
        let failing = failing(model, now, &self.limits);
        self.failing_since.retain(|key, _| failing.iter().any(|f| &f.key == key));
        let mut confirmed = Vec::new();
        for f in failing {
            let since = *self.failing_since.entry(f.key.clone()).or_insert(now);
            if now.saturating_sub(since) >= f.grace && self.reported.insert(f.key) {
                let violation = Violation { kind: f.kind, at: now, subject: f.subject, detail: f.detail };
                confirmed.push(violation.clone());
                self.violations.push(violation);
            }
        }
        confirmed
    }
}

/// The claim counts the report prints: every claim generated for a pod claim is either needed, a duplicate that
/// was deleted, or a violation (created for a finished pod, or a live duplicate).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Counts {
    pub pods: usize,
    pub pods_finished: usize,
    /// Claims generated for a pod claim (owner pod of the same namespace, pod-claim or extended annotation).
    pub claims_created: usize,
    /// Distinct (pod, pod claim) pairs that needed a claim: template claims of every pod, and each pod's
    /// extended-resource claim.
    pub claims_needed: usize,
    /// Second claims for a pair, created while the pod still ran and deleted again (explained).
    pub duplicates_deleted: usize,
    /// Claims first seen after their pod finished, while the pod object was still there (beyond
    /// [`Limits::recreate_tolerance`] each is a violation).
    pub recreated_for_finished: usize,
    /// Claims first seen after their pod object was gone (a controller's informer lagging; garbage-collected).
    pub created_for_gone_pod: usize,
    /// Claims owned by a PodGroup (one per group claim; not counted in `claims_created`).
    pub group_claims: usize,
    /// Claims deleted after their pod finished: time from the pod's finish to the claim's deletion.
    pub release_latencies: Vec<Duration>,
}

impl Counts {
    pub fn of(model: &Model) -> Self {
        let mut counts = Counts { pods: model.pods.len(), ..Default::default() };
        counts.pods_finished = model.pods.values().filter(|p| p.finished()).count();
        let mut needed: BTreeSet<(String, String)> = BTreeSet::new();
        for pod in model.pods.values() {
            // A PodGroup member's group claim is the group's: it needs no claim of its own.
            let own = pod.template_claims.iter().filter(|c| !model.is_group_claim_of(pod, c));
            needed.extend(own.map(|c| (pod.uid.clone(), c.clone())));
        }
        counts.group_claims = model.claims.values().filter(|c| c.owner_group.is_some()).count();
        // Per pair: (claims, of which deleted).
        let mut per_pair: BTreeMap<(String, String), (usize, usize)> = BTreeMap::new();
        for claim in model.claims.values() {
            let Some((pod, pod_claim)) = model.generated_for(claim) else { continue };
            let pod_claim = pod_claim.to_string();
            counts.claims_created += 1;
            if pod_claim == EXTENDED_KEY {
                needed.insert((pod.uid.clone(), pod_claim.clone()));
            }
            if created_after_pod_gone(pod, claim) {
                counts.created_for_gone_pod += 1;
                continue;
            }
            if pod.finished_at.is_some_and(|f| claim.first_seen > f) {
                counts.recreated_for_finished += 1;
                continue;
            }
            let pair = per_pair.entry((pod.uid.clone(), pod_claim)).or_default();
            pair.0 += 1;
            pair.1 += usize::from(!claim.alive());
            if let (Some(finished), Some(gone)) = (pod.finished_at, claim.gone_at) {
                counts.release_latencies.push(gone.saturating_sub(finished));
            }
        }
        counts.duplicates_deleted = per_pair.values().map(|(all, deleted)| (*deleted).min(all - 1)).sum();
        counts.claims_needed = needed.len();
        counts
    }

    /// Claims that are neither needed nor explained: must be zero (`created ≤ needed + deleted duplicates +
    /// created for a gone pod + created for a finished pod`, the last being violations of their own).
    pub fn unexplained(&self) -> usize {
        let explained =
            self.claims_needed + self.duplicates_deleted + self.created_for_gone_pod + self.recreated_for_finished;
        self.claims_created.saturating_sub(explained)
    }
}

/// Whether `claim` is reserved for the PodGroup of member `pod` (the scheduler reserves a group's claim for the
/// group, as upstream `IsReservedForPod` accepts).
fn reserved_for_group_of(claim: &ClaimRecord, pod: &PodRecord) -> bool {
    pod.group.as_deref().is_some_and(|group| claim.reserved_groups.values().any(|(name, _)| name == group))
}

/// Whether `claim` was first seen once its pod object was already deleted.
fn created_after_pod_gone(pod: &PodRecord, claim: &ClaimRecord) -> bool {
    pod.gone_at.is_some_and(|gone| claim.first_seen >= gone)
}

/// What is left once the workload is deleted and the soak has waited for the drain.
#[derive(Debug, Default, Clone)]
pub struct EndState {
    /// `namespace/name` of claims that still have an allocation.
    pub allocated: Vec<String>,
    /// `namespace/name` of claims left in the soak's namespaces.
    pub claims_left: Vec<String>,
    /// (node, file) of CDI specs left in the agents' CDI directories.
    pub cdi_specs: Vec<(String, String)>,
    /// (node, claim UID) of entries left in the agents' checkpoints.
    pub checkpoint_entries: Vec<(String, String)>,
}

impl EndState {
    pub fn is_clean(&self) -> bool {
        self.allocated.is_empty()
            && self.claims_left.is_empty()
            && self.cdi_specs.is_empty()
            && self.checkpoint_entries.is_empty()
    }

    pub fn violations(&self, at: Duration) -> Vec<Violation> {
        let v = |kind, subject: String, detail: &str| Violation { kind, at, subject, detail: detail.to_string() };
        let mut out: Vec<Violation> = Vec::new();
        out.extend(self.allocated.iter().map(|c| v(Kind::AllocatedAtEnd, format!("claim {c}"), "still allocated")));
        out.extend(self.claims_left.iter().map(|c| v(Kind::ClaimLeftAtEnd, format!("claim {c}"), "workload deleted")));
        out.extend(self.cdi_specs.iter().map(|(n, f)| v(Kind::CdiSpecLeft, format!("node {n}"), f)));
        out.extend(self.checkpoint_entries.iter().map(|(n, c)| v(Kind::CheckpointEntryLeft, format!("node {n}"), c)));
        out
    }
}
