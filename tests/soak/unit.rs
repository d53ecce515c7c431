//! Unit tables for the pure parts of the soak (model and invariants), run as trials of the soak binary without a
//! cluster: `cargo test --test soak -- unit::`.

use std::time::Duration;

use anyhow::ensure;
use serde_json::json;

use super::invariants::{Checker, Counts, EndState, Kind, Limits};
use super::model::Model;
use super::model::fixtures::{claim, group, group_claim, member, pod};

/// A unit table: its name and body.
pub type UnitTest = (&'static str, fn() -> anyhow::Result<()>);

pub const TESTS: &[UnitTest] = &[
    ("unit::released_claim_of_a_finished_pod_is_clean_and_timed", released_claim_of_a_finished_pod_is_clean_and_timed),
    ("unit::claim_created_after_the_pod_finished_is_a_violation", claim_created_after_the_pod_finished_is_a_violation),
    ("unit::unreleased_extended_claim_names_its_cause", unreleased_extended_claim_names_its_cause),
    ("unit::reservation_for_a_finished_pod_outlives_the_grace", reservation_for_a_finished_pod_outlives_the_grace),
    ("unit::running_pod_without_its_claim_is_debounced", running_pod_without_its_claim_is_debounced),
    ("unit::pending_pod_without_claims_after_the_deadline", pending_pod_without_claims_after_the_deadline),
    (
        "unit::duplicates_live_are_violations_deleted_are_explained",
        duplicates_live_are_violations_deleted_are_explained,
    ),
    (
        "unit::foreign_owner_in_another_namespace_is_not_a_pod_claim",
        foreign_owner_in_another_namespace_is_not_a_pod_claim,
    ),
    ("unit::end_state_names_every_leftover", end_state_names_every_leftover),
    (
        "unit::late_claim_of_a_deleted_pod_is_lag_until_the_deadline",
        late_claim_of_a_deleted_pod_is_lag_until_the_deadline,
    ),
    ("unit::pod_group_sharing_one_claim_is_clean", pod_group_sharing_one_claim_is_clean),
    ("unit::pod_group_members_own_claim_is_a_violation", pod_group_members_own_claim_is_a_violation),
    ("unit::deleted_pod_groups_claim_must_be_released", deleted_pod_groups_claim_must_be_released),
];

fn s(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

fn one_template() -> serde_json::Value {
    json!([{"name": "gpu", "resourceClaimTemplateName": "t"}])
}

fn kinds(checker: &Checker) -> Vec<Kind> {
    checker.violations.iter().map(|v| v.kind).collect()
}

fn released_claim_of_a_finished_pod_is_clean_and_timed() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.pod_seen(&pod("p", "Running", one_template(), json!([{"name": "gpu", "resourceClaimName": "c"}])), s(1));
    m.claim_seen(&claim("c1", "c", Some("p"), true, &["p"]), s(1));
    let mut checker = Checker::new(Limits::default());
    checker.check(&m, s(2));
    m.pod_seen(&pod("p", "Succeeded", one_template(), json!([{"name": "gpu", "resourceClaimName": "c"}])), s(10));
    m.claim_gone("c1", s(12));
    checker.check(&m, s(100));
    ensure!(checker.violations.is_empty(), "{:?}", checker.violations);
    let counts = Counts::of(&m);
    ensure!(counts.claims_created == 1 && counts.claims_needed == 1 && counts.unexplained() == 0, "{counts:?}");
    ensure!(counts.release_latencies == [s(2)], "{counts:?}");
    Ok(())
}

fn claim_created_after_the_pod_finished_is_a_violation() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.pod_seen(&pod("p", "Succeeded", one_template(), json!([])), s(1));
    m.claim_seen(&claim("c1", "c-a", Some("p"), false, &[]), s(1));
    m.claim_gone("c1", s(2));
    m.claim_seen(&claim("c2", "c-b", Some("p"), false, &[]), s(5));
    let mut checker = Checker::new(Limits::default());
    let confirmed = checker.check(&m, s(5));
    ensure!(kinds(&checker) == [Kind::RecreatedForFinishedPod], "{confirmed:?}");
    // Still there long after: it is not counted a second time as an unreleased claim.
    checker.check(&m, s(60));
    ensure!(kinds(&checker) == [Kind::RecreatedForFinishedPod], "{:?}", checker.violations);
    ensure!(Kind::RecreatedForFinishedPod.known_cause().is_some_and(|c| c.contains("point 1")));
    let counts = Counts::of(&m);
    ensure!(counts.recreated_for_finished == 1 && counts.unexplained() == 0, "{counts:?}");
    Ok(())
}

fn unreleased_extended_claim_names_its_cause() -> anyhow::Result<()> {
    let mut m = Model::default();
    let mut p = pod("p", "Succeeded", json!([]), json!([]));
    p["status"]["extendedResourceClaimStatus"] = json!({"resourceClaimName": "p-extended-resources-x"});
    m.pod_seen(&p, s(10));
    let mut c = claim("c1", "p-extended-resources-x", Some("p"), true, &["p"]);
    c["metadata"]["annotations"] = json!({"resource.kubernetes.io/extended-resource-claim": "true"});
    m.claim_seen(&c, s(5));
    let mut checker = Checker::new(Limits::default());
    ensure!(checker.check(&m, s(20)).is_empty(), "violation before the deadline");
    checker.check(&m, s(30));
    let mut found = kinds(&checker);
    found.sort();
    ensure!(found == [Kind::ExtendedNotReleased, Kind::ReservedForFinishedPod], "{:?}", checker.violations);
    ensure!(Kind::ExtendedNotReleased.known_cause().is_some_and(|c| c.contains("point 2")));
    let counts = Counts::of(&m);
    ensure!(counts.claims_needed == 1 && counts.claims_created == 1, "{counts:?}");
    Ok(())
}

fn reservation_for_a_finished_pod_outlives_the_grace() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.pod_seen(&pod("p", "Running", json!([{"name": "gpu", "resourceClaimName": "shared"}]), json!([])), s(1));
    m.claim_seen(&claim("c1", "shared", None, true, &["p", "ghost"]), s(1));
    m.pod_gone("p", s(10));
    let mut checker = Checker::new(Limits::default());
    ensure!(checker.check(&m, s(12)).is_empty(), "the grace covers the controller's reaction");
    checker.check(&m, s(30));
    ensure!(
        kinds(&checker) == [Kind::ReservedForFinishedPod, Kind::ReservedForFinishedPod],
        "{:?}",
        checker.violations
    );
    Ok(())
}

fn running_pod_without_its_claim_is_debounced() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.pod_seen(&pod("p", "Running", one_template(), json!([{"name": "gpu", "resourceClaimName": "c"}])), s(1));
    let mut checker = Checker::new(Limits::default());
    ensure!(checker.check(&m, s(1)).is_empty(), "the claim watch may lag");
    // The claim shows up, unreserved: the failing condition changes kind but not key, and stays debounced.
    m.claim_seen(&claim("c1", "c", Some("p"), true, &[]), s(5));
    ensure!(checker.check(&m, s(10)).is_empty());
    checker.check(&m, s(17));
    ensure!(kinds(&checker) == [Kind::LiveClaimNotReserved], "{:?}", checker.violations);
    Ok(())
}

fn pending_pod_without_claims_after_the_deadline() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.pod_seen(&pod("p", "Pending", one_template(), json!([])), s(1));
    m.pod_seen(&pod("q", "Pending", one_template(), json!([{"name": "gpu", "resourceClaimName": "c"}])), s(1));
    let mut checker = Checker::new(Limits::default());
    ensure!(checker.check(&m, s(20)).is_empty());
    checker.check(&m, s(40));
    ensure!(kinds(&checker) == [Kind::ClaimsNotCreated], "{:?}", checker.violations);
    ensure!(checker.violations[0].subject.contains("pod-p"), "{:?}", checker.violations);
    Ok(())
}

fn duplicates_live_are_violations_deleted_are_explained() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.pod_seen(&pod("p", "Pending", one_template(), json!([{"name": "gpu", "resourceClaimName": "a"}])), s(1));
    m.pod_seen(&pod("q", "Pending", one_template(), json!([{"name": "gpu", "resourceClaimName": "c"}])), s(1));
    for (uid, name, owner) in [("a", "a", "p"), ("b", "b", "p"), ("c", "c", "q"), ("d", "d", "q")] {
        m.claim_seen(&claim(uid, name, Some(owner), false, &[]), s(2));
    }
    m.claim_gone("b", s(3));
    let mut checker = Checker::new(Limits::default());
    checker.check(&m, s(4));
    checker.check(&m, s(20));
    ensure!(kinds(&checker) == [Kind::DuplicateClaims], "{:?}", checker.violations);
    ensure!(checker.violations[0].subject.contains("pod-q"), "{:?}", checker.violations);
    let counts = Counts::of(&m);
    ensure!(counts.claims_created == 4 && counts.claims_needed == 2, "{counts:?}");
    ensure!(counts.duplicates_deleted == 1 && counts.unexplained() == 1, "{counts:?}");
    Ok(())
}

fn foreign_owner_in_another_namespace_is_not_a_pod_claim() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.pod_seen(&pod("p", "Succeeded", one_template(), json!([])), s(1));
    let mut forged = claim("f", "forged", Some("p"), false, &[]);
    forged["metadata"]["namespace"] = json!("tenant");
    m.claim_seen(&forged, s(10));
    m.claim_seen(&claim("g", "ghost-owner", Some("no-such-pod"), false, &[]), s(10));
    let mut made_up = claim("h", "made-up-pod-claim", Some("p"), false, &[]);
    made_up["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": "not-a-pod-claim"});
    m.claim_seen(&made_up, s(10));
    let mut checker = Checker::new(Limits::default());
    checker.check(&m, s(100));
    ensure!(checker.violations.is_empty(), "{:?}", checker.violations);
    ensure!(Counts::of(&m).claims_created == 0);
    Ok(())
}

fn end_state_names_every_leftover() -> anyhow::Result<()> {
    let clean = EndState::default();
    ensure!(clean.is_clean() && clean.violations(s(1)).is_empty());
    let end = EndState {
        allocated: vec!["ns/a".into()],
        claims_left: vec!["ns/a".into()],
        cdi_specs: vec![("n0".into(), "gpu.gpu-dra.dev-gpu_u.json".into())],
        checkpoint_entries: vec![("n0".into(), "u".into())],
    };
    let kinds: Vec<Kind> = end.violations(s(1)).iter().map(|v| v.kind).collect();
    ensure!(
        kinds == [Kind::AllocatedAtEnd, Kind::ClaimLeftAtEnd, Kind::CdiSpecLeft, Kind::CheckpointEntryLeft],
        "{kinds:?}"
    );
    Ok(())
}

/// A claim created after its pod was deleted (the controller's pod informer lagging) is no re-creation; the
/// garbage collector deletes it, and if nothing does, the release deadline catches it.
fn late_claim_of_a_deleted_pod_is_lag_until_the_deadline() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.pod_seen(&pod("p", "Pending", one_template(), json!([])), s(1));
    m.pod_gone("p", s(2));
    m.claim_seen(&claim("late", "late", Some("p"), false, &[]), s(6));
    let mut checker = Checker::new(Limits::default());
    ensure!(checker.check(&m, s(7)).is_empty(), "{:?}", checker.violations);
    let counts = Counts::of(&m);
    ensure!(counts.created_for_gone_pod == 1 && counts.unexplained() == 0, "{counts:?}");
    checker.check(&m, s(30));
    ensure!(kinds(&checker) == [Kind::NotReleased], "{:?}", checker.violations);
    Ok(())
}

/// Two running members record the group's claim, allocated and reserved for the group; the job ends, the
/// reservation and the claim go in time: no violation, and no claim counted as a pod's.
fn pod_group_sharing_one_claim_is_clean() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.group_seen(&group("g"));
    m.pod_seen(&member("p1", "g", "gc"), s(1));
    m.pod_seen(&member("p2", "g", "gc"), s(1));
    m.claim_seen(&group_claim("c1", "gc", "g", true), s(1));
    let mut checker = Checker::new(Limits::default());
    checker.check(&m, s(30));
    m.pod_gone("p1", s(40));
    m.pod_gone("p2", s(40));
    m.group_gone("g", s(41));
    m.claim_seen(&group_claim("c1", "gc", "g", false), s(42));
    m.claim_gone("c1", s(43));
    checker.check(&m, s(100));
    ensure!(checker.violations.is_empty(), "{:?}", checker.violations);
    let counts = Counts::of(&m);
    let own = (counts.claims_created, counts.claims_needed, counts.group_claims);
    ensure!(own == (0, 0, 1) && counts.unexplained() == 0, "members need no claim of their own: {counts:?}");
    Ok(())
}

/// A member pod that gets its own claim for the group's claim (a controller that ignores PodGroups), and a
/// second live claim for the group: both are violations.
fn pod_group_members_own_claim_is_a_violation() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.group_seen(&group("g"));
    m.pod_seen(&member("p1", "g", "own"), s(1));
    m.claim_seen(&claim("c1", "own", Some("p1"), true, &["p1"]), s(1));
    m.claim_seen(&group_claim("c2", "gc-a", "g", false), s(1));
    m.claim_seen(&group_claim("c3", "gc-b", "g", false), s(1));
    let mut checker = Checker::new(Limits::default());
    checker.check(&m, s(2));
    checker.check(&m, s(30));
    let found = kinds(&checker);
    ensure!(found == [Kind::MemberOwnClaim, Kind::DuplicateClaims], "{found:?}");
    Ok(())
}

/// The PodGroup is deleted and its claim stays reserved for it: the reservation after the grace, the claim after
/// the release deadline.
fn deleted_pod_groups_claim_must_be_released() -> anyhow::Result<()> {
    let mut m = Model::default();
    m.group_seen(&group("g"));
    m.claim_seen(&group_claim("c1", "gc", "g", true), s(1));
    m.group_gone("g", s(10));
    let mut checker = Checker::new(Limits::default());
    checker.check(&m, s(20));
    ensure!(checker.violations.is_empty(), "within the deadlines: {:?}", checker.violations);
    checker.check(&m, s(30));
    let mut found = kinds(&checker);
    found.sort();
    ensure!(found == [Kind::GroupClaimNotReleased, Kind::ReservedForGoneGroup], "{found:?}");
    Ok(())
}
