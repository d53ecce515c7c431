use std::sync::Arc;

use super::*;
use serde_json::json;

fn pod(value: Value) -> Pod {
    let mut base = json!({
        "metadata": {"name": "pod", "namespace": "ns", "uid": "pod-uid"},
        "spec": {"containers": [{"name": "c", "image": "i"}], "resourceClaims": [
            {"name": "gpu", "resourceClaimTemplateName": "tmpl"},
            {"name": "shared", "resourceClaimName": "shared-claim"}
        ]}
    });
    merge(&mut base, value);
    serde_json::from_value(base).expect("test pod")
}

fn claim(value: Value) -> ResourceClaim {
    let mut base = json!({
        "metadata": {"name": "pod-gpu-abcde", "namespace": "ns",
                     "annotations": {POD_CLAIM_NAME_ANNOTATION: "gpu"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "pod", "uid": "pod-uid", "controller": true}]},
        "spec": {"devices": {"requests": []}}
    });
    merge(&mut base, value);
    serde_json::from_value(base).expect("test claim")
}

fn allocated() -> Value {
    json!({"status": {"allocation": {"devices": {"results": []}}}})
}

/// JSON merge patch (RFC 7386), enough for building fixtures.
fn merge(target: &mut Value, patch: Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(&k);
                } else {
                    merge(t.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p,
    }
}

#[test]
fn claim_sources() {
    let fresh = pod(json!({}));
    let claims = pod_claims(&fresh);
    assert_eq!(
        claim_source(&fresh, &claims[0]),
        ClaimSource::Template { template: "tmpl", recorded: Recorded::Missing }
    );
    assert_eq!(claim_source(&fresh, &claims[1]), ClaimSource::Named("shared-claim"));

    let recorded =
        pod(json!({"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "pod-gpu-x"}]}}));
    let pc = &pod_claims(&recorded)[0];
    assert_eq!(
        claim_source(&recorded, pc),
        ClaimSource::Template { template: "tmpl", recorded: Recorded::Claim("pod-gpu-x") }
    );

    let not_needed = pod(json!({"status": {"resourceClaimStatuses": [{"name": "gpu"}]}}));
    let pc = &pod_claims(&not_needed)[0];
    assert_eq!(
        claim_source(&not_needed, pc),
        ClaimSource::Template { template: "tmpl", recorded: Recorded::NoClaimNeeded }
    );

    let neither = PodResourceClaim { name: "x".into(), ..Default::default() };
    assert_eq!(claim_source(&fresh, &neither), ClaimSource::Unsupported);
    assert_eq!(known_claim_names(&recorded), vec!["pod-gpu-x", "shared-claim"]);
    assert_eq!(named_claim_names(&recorded), vec!["shared-claim"], "template claims are found through their owner");
}

#[test]
fn pod_done() {
    let cases = [
        (json!({}), false),
        (json!({"status": {"phase": "Running"}}), false),
        (json!({"status": {"phase": "Succeeded"}}), true),
        (json!({"status": {"phase": "Failed"}}), true),
        (json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}), true),
        (json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"nodeName": "n"}}), false),
    ];
    for (patch, done) in cases {
        assert_eq!(is_pod_done(&pod(patch.clone())), done, "{patch}");
    }
}

#[test]
fn ownership() {
    let p = pod(json!({}));
    assert!(is_owned_by(&claim(json!({})), &p));
    assert!(!is_owned_by(&claim(json!({"metadata": {"namespace": "other"}})), &p));
    let not_controller = claim(json!({"metadata": {"ownerReferences": [
        {"apiVersion": "v1", "kind": "Pod", "name": "pod", "uid": "pod-uid"}]}}));
    assert!(!is_owned_by(&not_controller, &p));
    let other_uid = claim(json!({"metadata": {"ownerReferences": [
        {"apiVersion": "v1", "kind": "Pod", "name": "pod", "uid": "old-uid", "controller": true}]}}));
    assert!(!is_owned_by(&other_uid, &p));
    assert_eq!(owning_pod(&other_uid), Some(("pod", "old-uid")));
    assert_eq!(pod_claim_name_annotation(&claim(json!({}))), Some("gpu"));
}

#[test]
fn reservation_rules() {
    let scheduled = pod(json!({"spec": {"nodeName": "n"}}));
    let reserved = json!({"status": {"allocation": {"devices": {"results": []}},
        "reservedFor": [{"resource": "pods", "name": "pod", "uid": "pod-uid"}]}});
    let full: Vec<Value> = (0..MAX_RESERVED_FOR)
        .map(|i| json!({"resource": "pods", "name": format!("p{i}"), "uid": format!("u{i}")}))
        .collect();
    let full = json!({"status": {"allocation": {"devices": {"results": []}}, "reservedFor": full}});
    let cases = [
        (&scheduled, claim(allocated()), true),
        (&scheduled, claim(json!({})), false),
        (&scheduled, claim(reserved), false),
        (&scheduled, claim(full), false),
    ];
    for (p, c, want) in cases {
        assert_eq!(should_reserve(&c, p), want, "{c:?}");
    }
    let unscheduled = pod(json!({}));
    assert!(!should_reserve(&claim(allocated()), &unscheduled));
    // A terminal pod is never re-reserved (kubernetes#141274).
    let terminal = pod(json!({"spec": {"nodeName": "n"}, "status": {"phase": "Succeeded"}}));
    assert!(!should_reserve(&claim(allocated()), &terminal));
}

#[test]
fn needs_work() {
    let existing = Arc::new(claim(json!({"metadata": {"name": "pod-gpu-x"}})));
    let allocated_claim = Arc::new(claim(merge_into(json!({"metadata": {"name": "pod-gpu-x"}}), allocated())));
    let recorded = json!({"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "pod-gpu-x"}]}});
    let none = |_: &str| None;
    let found = |_: &str| Some(existing.clone());
    let found_allocated = |_: &str| Some(allocated_claim.clone());

    assert_eq!(pod_needs_work(&pod(json!({})), &[], none), (true, "template claim not recorded"));
    assert_eq!(pod_needs_work(&pod(recorded.clone()), &[], none), (true, "recorded claim is missing"));
    assert_eq!(pod_needs_work(&pod(recorded.clone()), &[], found), (false, "nothing to do"));
    let scheduled = merge_into(recorded.clone(), json!({"spec": {"nodeName": "n"}}));
    assert_eq!(
        pod_needs_work(&pod(scheduled.clone()), &[], found_allocated),
        (true, "allocated claim not reserved for the scheduled pod")
    );
    let deleting = merge_into(json!({}), json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}));
    assert_eq!(pod_needs_work(&pod(deleting), &[], none), (false, "pod is being deleted"));
    // A status applied but not yet in the cache counts as recorded.
    let applied = [("gpu".to_string(), "pod-gpu-x".to_string())];
    assert_eq!(pod_needs_work(&pod(json!({})), &applied, found), (false, "nothing to do"));
}

fn merge_into(mut base: Value, patch: Value) -> Value {
    merge(&mut base, patch);
    base
}

#[test]
fn statuses_are_merged_and_sorted() {
    let p = pod(json!({"status": {"resourceClaimStatuses": [
        {"name": "z", "resourceClaimName": "pod-z-1"}, {"name": "b"}]}}));
    let merged = merged_claim_statuses(&p, &[("a".into(), "pod-a-1".into()), ("z".into(), "pod-z-2".into())]);
    let got: Vec<_> = merged.iter().map(|s| (s.name.as_str(), s.resource_claim_name.as_deref())).collect();
    assert_eq!(got, vec![("a", Some("pod-a-1")), ("b", None), ("z", Some("pod-z-2"))]);
}

#[test]
fn desired_claim_copies_the_template_verbatim() {
    let template: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "tmpl", "namespace": "ns"},
        "spec": {
            "metadata": {"labels": {"team": "ml"}, "annotations": {"note": "x"}},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}],
                                 "fieldFromTheFuture": {"keep": [1, 2]}}}
        }
    }))
    .expect("template");
    let before = template.clone();
    let p = pod(json!({}));
    let claim = desired_claim(&p, "gpu", &template).expect("claim");
    assert_eq!(claim["spec"], template.data["spec"]["spec"], "spec must be copied verbatim, unknown fields included");
    assert_eq!(claim["metadata"]["generateName"], "pod-gpu-");
    assert_eq!(claim["metadata"]["labels"], json!({"team": "ml"}));
    assert_eq!(claim["metadata"]["annotations"], json!({"note": "x", POD_CLAIM_NAME_ANNOTATION: "gpu"}));
    assert_eq!(
        claim["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Pod", "name": "pod", "uid": "pod-uid", "controller": true}])
    );
    assert_eq!(template, before, "the cached template must not change");

    let empty: DynamicObject =
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "X", "metadata": {"name": "t"}})).expect("t");
    assert_eq!(desired_claim(&p, "gpu", &empty), Err(TemplateError::NoSpec));
}
