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

#[test]
fn a_done_pod_needs_nothing() {
    // Its claim deleted (recorded claim missing), never recorded, or allocated and unreserved: nothing to do,
    // else every deletion of a finished pod's claim would create the next one.
    let recorded = json!({"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "pod-gpu-x"}]}});
    let allocated_claim = Arc::new(claim(merge_into(json!({"metadata": {"name": "pod-gpu-x"}}), allocated())));
    for phase in ["Succeeded", "Failed"] {
        let done = json!({"spec": {"nodeName": "n"}, "status": {"phase": phase}});
        for (patch, lookup) in [
            (merge_into(recorded.clone(), done.clone()), None),
            (done.clone(), None),
            (merge_into(recorded.clone(), done.clone()), Some(allocated_claim.clone())),
        ] {
            let got = pod_needs_work(&pod(patch.clone()), &[], |_| lookup.clone());
            assert_eq!(got, (false, "pod is done"), "{patch}");
        }
    }
    // Deleted before it was scheduled: done as well.
    let deleted_unscheduled = pod(json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}));
    assert!(!pod_needs_work(&deleted_unscheduled, &[], |_| None).0);
}

#[test]
fn a_recorded_claim_of_someone_else_is_neither_reserved_nor_waited_for() {
    let foreign = Arc::new(claim(merge_into(
        json!({"metadata": {"name": "foreign", "ownerReferences": [
            {"apiVersion": "v1", "kind": "Pod", "name": "other", "uid": "other-uid", "controller": true}]}}),
        allocated(),
    )));
    let unowned =
        Arc::new(claim(merge_into(json!({"metadata": {"name": "foreign", "ownerReferences": null}}), allocated())));
    let scheduled = pod(
        json!({"spec": {"nodeName": "n", "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "tmpl"}]},
        "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "foreign"}]}}),
    );
    for c in [foreign, unowned] {
        assert_eq!(pod_needs_work(&scheduled, &[], |_| Some(c.clone())), (false, "nothing to do"), "{c:?}");
    }
    // A claim the pod names directly is the user's: no owner to check.
    let named = pod(
        json!({"spec": {"nodeName": "n", "resourceClaims": [{"name": "shared", "resourceClaimName": "shared-claim"}]}}),
    );
    let users = Arc::new(claim(merge_into(json!({"metadata": {"ownerReferences": null}}), allocated())));
    assert_eq!(
        pod_needs_work(&named, &[], |_| Some(users.clone())),
        (true, "allocated claim not reserved for the scheduled pod")
    );
    assert_eq!(spec_claims(&scheduled), vec![("foreign", true)]);
    assert_eq!(spec_claims(&named), vec![("shared-claim", false)]);
}

#[test]
fn recorded_claim_verdicts() {
    let p = pod(json!({}));
    let owned = claim(json!({}));
    let others = claim(json!({"metadata": {"ownerReferences": [
        {"apiVersion": "v1", "kind": "Pod", "name": "pod", "uid": "old-uid", "controller": true}]}}));
    let cases = [
        (Seen::Cache(Some(&owned)), RecordedVerdict::Keep),
        (Seen::Cache(Some(&others)), RecordedVerdict::Replace("the recorded claim is not the pod's")),
        // Missing from the informer is no proof that it is gone: ask the API server.
        (Seen::Cache(None), RecordedVerdict::AskServer),
        (Seen::Server(Some(&owned)), RecordedVerdict::Keep),
        (Seen::Server(Some(&others)), RecordedVerdict::Replace("the recorded claim is not the pod's")),
        (Seen::Server(None), RecordedVerdict::Replace("the recorded claim does not exist")),
    ];
    for (seen, want) in cases {
        assert_eq!(recorded_claim_verdict(seen, &p), want, "{seen:?}");
    }
}

#[test]
fn extended_resource_claims_count_as_the_pods_claims() {
    let extended = json!({"status": {"extendedResourceClaimStatus": {"resourceClaimName": "pod-extended-resources-x",
        "requestMappings": [{"containerName": "c", "resourceName": "nvidia.com/gpu", "requestName": "r"}]}}});
    let no_spec_claims = json!({"spec": {"resourceClaims": null}});
    let only_extended = pod(merge_into(extended.clone(), no_spec_claims.clone()));
    assert!(has_claims(&only_extended));
    assert_eq!(all_claim_names(&only_extended), vec!["pod-extended-resources-x"]);
    assert!(known_claim_names(&only_extended).is_empty(), "never reserved nor created by this controller");
    assert!(!has_claims(&pod(no_spec_claims)));

    let both = pod(extended);
    assert_eq!(all_claim_names(&both), vec!["shared-claim", "pod-extended-resources-x"]);
    let empty_name = pod(json!({"status": {"extendedResourceClaimStatus": {"resourceClaimName": ""}}}));
    assert_eq!(extended_resource_claim(&empty_name), None);
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
    let spec = json!({"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}],
                                  "fieldFromTheFuture": {"keep": [1, 2]}}});
    let template: ResourceClaimTemplate = serde_json::from_str(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "tmpl", "namespace": "ns"},
            "spec": {"metadata": {"labels": {"team": "ml"}, "annotations": {"note": "x"}}, "spec": spec}
        })
        .to_string(),
    )
    .expect("template");
    let p = pod(json!({}));
    let claim = serde_json::to_value(desired_claim(&p, "gpu", &template).expect("claim")).expect("JSON");
    assert_eq!(claim["spec"], spec, "spec must be copied verbatim, unknown fields included");
    assert_eq!((&claim["apiVersion"], &claim["kind"]), (&json!("resource.k8s.io/v1"), &json!("ResourceClaim")));
    assert_eq!(claim["metadata"]["generateName"], "pod-gpu-");
    assert_eq!(claim["metadata"]["labels"], json!({"team": "ml"}));
    assert_eq!(claim["metadata"]["annotations"], json!({"note": "x", POD_CLAIM_NAME_ANNOTATION: "gpu"}));
    assert_eq!(
        claim["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Pod", "name": "pod", "uid": "pod-uid", "controller": true}])
    );
    assert_eq!(template.annotations.len(), 1, "the cached template must not change");

    let empty: ResourceClaimTemplate = serde_json::from_str(r#"{"metadata": {"name": "t"}}"#).expect("t");
    assert!(matches!(desired_claim(&p, "gpu", &empty), Err(TemplateError::NoSpec)));
}
