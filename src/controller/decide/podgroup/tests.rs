use serde_json::json;

use super::*;

fn pod(group: Option<&str>, node: Option<&str>) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid"},
        "spec": {"nodeName": node, "schedulingGroup": group.map(|g| json!({"podGroupName": g})),
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}
    }))
    .expect("pod")
}

fn group(claims: serde_json::Value, statuses: serde_json::Value) -> PodGroup {
    serde_json::from_value(json!({
        "metadata": {"name": "g", "namespace": "ns", "uid": "g-uid"},
        "spec": {"resourceClaims": claims},
        "status": {"resourceClaimStatuses": statuses}
    }))
    .expect("group")
}

fn claim(owner: serde_json::Value, reserved: serde_json::Value, allocated: bool) -> ResourceClaim {
    let allocation = allocated.then(|| json!({"devices": {"results": []}}));
    serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": "ns", "ownerReferences": [owner]},
        "spec": {"devices": {"requests": []}},
        "status": {"reservedFor": reserved, "allocation": allocation}
    }))
    .expect("claim")
}

fn group_owner(api_version: &str, name: &str, uid: &str) -> serde_json::Value {
    json!({"apiVersion": api_version, "kind": "PodGroup", "name": name, "uid": uid, "controller": true})
}

fn pod_claim(name: &str, template: Option<&str>, claim: Option<&str>) -> PodResourceClaim {
    PodResourceClaim {
        name: name.into(),
        resource_claim_template_name: template.map(Into::into),
        resource_claim_name: claim.map(Into::into),
    }
}

#[test]
fn a_pod_claim_binds_to_the_group_only_when_all_fields_match() {
    let g = group(json!([{"name": "gpu", "resourceClaimTemplateName": "t"}]), json!([]));
    let cases = [
        (pod(Some("g"), None), pod_claim("gpu", Some("t"), None), true),
        (pod(Some("g"), None), pod_claim("gpu", Some("other"), None), false),
        (pod(Some("g"), None), pod_claim("other", Some("t"), None), false),
        (pod(Some("g"), None), pod_claim("gpu", None, Some("t")), false),
        (pod(Some("h"), None), pod_claim("gpu", Some("t"), None), false),
        (pod(None, None), pod_claim("gpu", Some("t"), None), false),
    ];
    for (i, (p, pc, want)) in cases.iter().enumerate() {
        assert_eq!(binds_to_group(p, pc, &g), *want, "case {i}");
    }
}

#[test]
fn a_group_claim_is_the_pods_only_through_its_own_group() {
    let member = pod(Some("g"), None);
    let cases = [
        (group_owner("scheduling.k8s.io/v1beta1", "g", "g-uid"), &member, true),
        // The version may change, the API group may not.
        (group_owner("scheduling.k8s.io/v1", "g", "g-uid"), &member, true),
        (group_owner("example.com/v1", "g", "g-uid"), &member, false),
        (group_owner("scheduling.k8s.io/v1beta1", "h", "h-uid"), &member, false),
    ];
    for (i, (owner, p, want)) in cases.iter().enumerate() {
        assert_eq!(is_for_pod(&claim(owner.clone(), json!([]), false), p), *want, "case {i}");
    }
    let not_member = pod(None, None);
    assert!(!is_for_pod(&claim(group_owner("scheduling.k8s.io/v1beta1", "g", "g-uid"), json!([]), false), &not_member));
    let own = json!({"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "pod-uid", "controller": true});
    assert!(is_for_pod(&claim(own, json!([]), false), &not_member), "a pod's own claim stays the pod's");

    let g = group(json!([]), json!([]));
    assert!(is_for_pod_group(&claim(group_owner("scheduling.k8s.io/v1beta1", "g", "g-uid"), json!([]), false), &g));
    assert!(
        !is_for_pod_group(&claim(group_owner("scheduling.k8s.io/v1beta1", "g", "old-uid"), json!([]), false), &g),
        "a claim of an earlier PodGroup of the same name is not this one's"
    );
}

#[test]
fn the_group_status_says_what_is_recorded() {
    let g = group(json!([]), json!([{"name": "gpu", "resourceClaimName": "g-gpu-x"}, {"name": "none"}]));
    assert_eq!(group_recorded(&g, "gpu"), Recorded::Claim("g-gpu-x"));
    assert_eq!(group_recorded(&g, "none"), Recorded::NoClaimNeeded);
    assert_eq!(group_recorded(&g, "other"), Recorded::Missing);
}

#[test]
fn a_group_needs_work_until_each_template_claim_is_recorded_and_exists() {
    let template = json!([{"name": "gpu", "resourceClaimTemplateName": "t"}]);
    let cases = [
        (group(template.clone(), json!([])), true, true),
        (group(template.clone(), json!([{"name": "gpu", "resourceClaimName": "c"}])), true, false),
        (group(template.clone(), json!([{"name": "gpu", "resourceClaimName": "c"}])), false, true),
        (group(json!([{"name": "gpu", "resourceClaimName": "shared"}]), json!([])), false, false),
        (group(json!([]), json!([])), false, false),
    ];
    for (i, (g, exists, want)) in cases.iter().enumerate() {
        assert_eq!(pod_group_needs_work(g, |_| *exists).0, *want, "case {i}");
    }
}

#[test]
fn a_group_reservation_is_dropped_only_when_the_group_is_surely_gone() {
    use GroupReservation::*;
    let cases = [
        (true, Seen::Cache(Some("u")), Drop("PodGroup was deleted")),
        (false, Seen::Cache(Some("u")), Keep),
        (false, Seen::Cache(None), AskServer),
        (false, Seen::Server(None), Drop("PodGroup not found")),
        (false, Seen::Server(Some("u")), Keep),
        (false, Seen::Cache(Some("v")), AskServer),
        (false, Seen::Server(Some("v")), Drop("PodGroup was replaced by one with another UID")),
    ];
    for (i, (deleted, seen, want)) in cases.iter().enumerate() {
        assert_eq!(group_reservation("u", *deleted, *seen), *want, "case {i}");
    }
}

#[test]
fn a_scheduled_member_reserves_the_group_claim_for_its_group_once() {
    let owner = group_owner("scheduling.k8s.io/v1beta1", "g", "g-uid");
    let reserved_g = json!([{"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "g", "uid": "g-uid"}]);
    let cases = [
        (claim(owner.clone(), json!([]), true), pod(Some("g"), Some("n")), true),
        (claim(owner.clone(), reserved_g, true), pod(Some("g"), Some("n")), false),
        (claim(owner.clone(), json!([]), false), pod(Some("g"), Some("n")), false),
        (claim(owner, json!([]), true), pod(Some("g"), None), false),
    ];
    for (i, (c, p, want)) in cases.iter().enumerate() {
        assert_eq!(crate::controller::decide::should_reserve(c, p), *want, "case {i}");
    }
    let consumer = group_consumer(&group(json!([]), json!([])));
    assert!(is_group_consumer(&consumer));
    assert_eq!((consumer.name.as_str(), consumer.uid.as_str()), ("g", "g-uid"));
}

#[test]
fn the_group_claim_is_owned_by_the_group_and_named_after_it() -> Result<(), TemplateError> {
    let template: ResourceClaimTemplate = serde_json::from_str(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t", "namespace": "ns"},
            "spec": {"metadata": {"labels": {"l": "v"}}, "spec": {"devices": {"requests": [{"name": "gpu"}]}}}
        })
        .to_string(),
    )
    .expect("template");
    let got = desired_group_claim(&group(json!([]), json!([])), "gpu", &template)?;
    let got = serde_json::to_value(got).expect("JSON");
    assert_eq!(got["metadata"]["generateName"], "g-gpu-");
    assert_eq!(got["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"], "gpu");
    assert_eq!(
        got["metadata"]["ownerReferences"],
        json!([{"apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "name": "g", "uid": "g-uid",
                "controller": true}])
    );
    assert_eq!(got["spec"], json!({"devices": {"requests": [{"name": "gpu"}]}}));
    Ok(())
}

/// A claim the PodGroup and its pods name (`resourceClaimName`): the scheduler reserves it for the PodGroup once;
/// each member counts as reserved (upstream `IsReservedForPod`), so none adds itself (before, each member was
/// added, filling `reservedFor` to its limit), and a member reserves it for the group (upstream `BindTo`).
#[test]
fn a_named_claim_of_the_group_reserved_for_it_is_reserved_for_each_member() {
    let member: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid"},
        "spec": {"nodeName": "n", "schedulingGroup": {"podGroupName": "g"},
                 "resourceClaims": [{"name": "fabric", "resourceClaimName": "shared"}]}
    }))
    .expect("pod");
    let reserved_for_group = json!([{"apiGroup": GROUP, "resource": RESOURCE, "name": "g", "uid": "g-uid"}]);
    let shared: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "shared", "namespace": "ns"},
        "spec": {"devices": {"requests": []}},
        "status": {"reservedFor": reserved_for_group, "allocation": {"devices": {"results": []}}}
    }))
    .expect("claim");
    assert!(!super::super::should_reserve(&shared, &member));
    let lookup = |_: &str| Some(std::sync::Arc::new(shared.clone()));
    assert_eq!(super::super::pod_needs_work(&member, &[], lookup), (false, "nothing to do"));

    let named = group(json!([{"name": "fabric", "resourceClaimName": "shared"}]), json!([]));
    assert!(named_claim_binds_to_group(&member, "shared", &named));
    assert!(!named_claim_binds_to_group(&member, "other", &named));
    let elsewhere = group(json!([{"name": "fabric", "resourceClaimName": "another"}]), json!([]));
    assert!(!named_claim_binds_to_group(&member, "shared", &elsewhere), "the pod's own claim, not the group's");
}
