//! Pure decisions about ResourceQuotas and claims (see [`crate::controller::quota`]): what a refusal from the API
//! server means, a quota's limits on claims, and how much room for claims a quota's change leaves.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceQuota;

/// What a refusal from the API server means, read from its code and message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// RBAC: the controller's ServiceAccount lacks a permission; an operator must grant it.
    Permission,
    /// A ResourceQuota of the namespace: the claim waits until quota comes free.
    Quota,
    /// Anything else (an admission webhook or policy, an invalid object): its message says why.
    Other,
}

/// The quota admission plugin's refusals (k8s.io/apiserver `admission/plugin/resourcequota`), after
/// `admission.NewForbidden`'s `<resource> "<name>" is forbidden: `.
const QUOTA_MESSAGES: [&str; 4] = [
    "is forbidden: exceeded quota: ",
    "is forbidden: status unknown for quota: ",
    "is forbidden: insufficient quota to consume: ",
    "is forbidden: failed quota: ",
];

/// Reads a refusal: the authorizer's 403 says `is forbidden: User "<name>" cannot <verb> resource`, the quota
/// plugin's one of [`QUOTA_MESSAGES`]; a claim status patch without the `resourceclaims/binding` grant is a 422
/// (`requires resource="resourceclaims/binding"`).
pub fn refusal(code: u16, message: &str) -> Refusal {
    match code {
        403 if QUOTA_MESSAGES.iter().any(|m| message.contains(m)) => Refusal::Quota,
        403 if message.contains("is forbidden: User \"") && message.contains(" cannot ") => Refusal::Permission,
        422 if message.contains("requires resource=\"resourceclaims/binding\"") => Refusal::Permission,
        _ => Refusal::Other,
    }
}

/// A quota's limits on claims, as its status has them: resource name → (hard, used), each `None` when absent or
/// not a plain count.
pub type ClaimLimits = BTreeMap<String, (Option<i64>, Option<i64>)>;

/// Whether a quota resource limits claims.
fn limits_claims(resource: &str) -> bool {
    resource == "count/resourceclaims.resource.k8s.io" || resource.ends_with(".deviceclass.resource.k8s.io/devices")
}

/// The claim limits of `quota`'s status.
pub fn claim_limits(quota: &ResourceQuota) -> ClaimLimits {
    let status = quota.status.as_ref();
    let hard = status.and_then(|s| s.hard.as_ref());
    let used = status.and_then(|s| s.used.as_ref());
    let mut limits = ClaimLimits::new();
    for (resource, quantity) in hard.into_iter().flatten() {
        if limits_claims(resource) {
            limits.entry(resource.clone()).or_default().0 = count(&quantity.0);
        }
    }
    for (resource, quantity) in used.into_iter().flatten() {
        if limits_claims(resource) {
            limits.entry(resource.clone()).or_default().1 = count(&quantity.0);
        }
    }
    limits
}

/// A count as a quota writes it (`2`, `10k`); `None` for anything else.
fn count(quantity: &str) -> Option<i64> {
    let (digits, factor) = match quantity.strip_suffix('k') {
        Some(d) => (d, 1_000),
        None => match quantity.strip_suffix('M') {
            Some(d) => (d, 1_000_000),
            None => (quantity, 1),
        },
    };
    digits.parse::<i64>().ok()?.checked_mul(factor)
}

/// How much more room for claims `after` leaves than `before` (`None`: the quota is new or deleted): `None` when
/// none; else how many claims' worth, at most (`usize::MAX` when it cannot be told).
pub fn room_freed(before: Option<&ClaimLimits>, after: Option<&ClaimLimits>) -> Option<usize> {
    match (before, after) {
        // Deleted: whatever it limited is free.
        (Some(before), None) => (!before.is_empty()).then_some(usize::MAX),
        // New: it only takes room (until its status says more, below).
        (None, _) => None,
        (Some(before), Some(after)) => {
            let grew = after.iter().any(|(resource, (hard, used))| {
                let (old_hard, old_used) = before.get(resource).copied().unwrap_or((None, None));
                let hard_grew = match (old_hard, *hard) {
                    (Some(old), Some(new)) => new > old,
                    // The quota controller wrote the status (until then every create is refused).
                    (None, Some(_)) => true,
                    _ => false,
                };
                let used_fell = matches!((old_used, *used), (Some(old), Some(new)) if new < old);
                hard_grew || used_fell
            }) || before.keys().any(|resource| !after.contains_key(resource));
            grew.then(|| available(after))
        }
    }
}

/// Claims' worth of room left under `limits` (the least over its resources), `usize::MAX` when it cannot be told.
fn available(limits: &ClaimLimits) -> usize {
    limits
        .values()
        .map(|(hard, used)| match (hard, used) {
            (Some(hard), Some(used)) => usize::try_from(hard.saturating_sub(*used).max(1)).unwrap_or(usize::MAX),
            _ => usize::MAX,
        })
        .min()
        .unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_told_apart_by_their_code_and_message() {
        let table = [
            (
                403,
                r#"resourceclaims.resource.k8s.io "p-gpu-x7k2q" is forbidden: exceeded quota: gpus, requested: gpu.deviceclass.resource.k8s.io/devices=1, used: gpu.deviceclass.resource.k8s.io/devices=2, limited: gpu.deviceclass.resource.k8s.io/devices=2"#,
                Refusal::Quota,
            ),
            (
                403,
                r#"resourceclaims.resource.k8s.io "c" is forbidden: status unknown for quota: gpus, resources: count/resourceclaims.resource.k8s.io"#,
                Refusal::Quota,
            ),
            (
                403,
                r#"resourceclaims.resource.k8s.io "c" is forbidden: insufficient quota to consume: gpu.deviceclass.resource.k8s.io/devices"#,
                Refusal::Quota,
            ),
            (
                403,
                r#"resourceclaims.resource.k8s.io is forbidden: User "system:serviceaccount:gpu-dra:controller" cannot create resource "resourceclaims" in API group "resource.k8s.io" in the namespace "team-a""#,
                Refusal::Permission,
            ),
            (
                422,
                r#"ResourceClaim.resource.k8s.io "c" is invalid: status: Forbidden: changing status.allocation or status.reservedFor requires resource="resourceclaims/binding", verb="patch" permission: no"#,
                Refusal::Permission,
            ),
            (
                403,
                r#"resourceclaims.resource.k8s.io "c" is forbidden: ValidatingAdmissionPolicy 'no-admin' with binding 'b' denied request: admin access"#,
                Refusal::Other,
            ),
            // A webhook quoting a quota's words is not a quota.
            (403, r#"admission webhook "claims.example.com" denied the request: exceeded quota: ours"#, Refusal::Other),
            (409, r#"Operation cannot be fulfilled: exceeded quota: "#, Refusal::Other),
        ];
        for (code, message, expected) in table {
            assert_eq!(refusal(code, message), expected, "{code} {message}");
        }
    }

    fn limits(entries: &[(&str, Option<i64>, Option<i64>)]) -> ClaimLimits {
        entries.iter().map(|(r, h, u)| (r.to_string(), (*h, *u))).collect()
    }

    const GPUS: &str = "gpu.deviceclass.resource.k8s.io/devices";
    const CLAIMS: &str = "count/resourceclaims.resource.k8s.io";

    #[test]
    fn room_is_freed_only_by_less_used_more_allowed_or_a_limit_gone() {
        let two_of_two = limits(&[(GPUS, Some(2), Some(2))]);
        // (case, before, after, room freed)
        type Case = (&'static str, Option<ClaimLimits>, Option<ClaimLimits>, Option<usize>);
        let table: Vec<Case> = vec![
            ("a claim counted gone", Some(two_of_two.clone()), Some(limits(&[(GPUS, Some(2), Some(1))])), Some(1)),
            (
                "three gone at once",
                Some(limits(&[(GPUS, Some(4), Some(4))])),
                Some(limits(&[(GPUS, Some(4), Some(1))])),
                Some(3),
            ),
            ("the limit raised", Some(two_of_two.clone()), Some(limits(&[(GPUS, Some(5), Some(2))])), Some(3)),
            ("a claim counted in", Some(limits(&[(GPUS, Some(2), Some(1))])), Some(two_of_two.clone()), None),
            ("the limit lowered", Some(two_of_two.clone()), Some(limits(&[(GPUS, Some(1), Some(2))])), None),
            ("nothing changed", Some(two_of_two.clone()), Some(two_of_two.clone()), None),
            ("the limit dropped from the quota", Some(two_of_two.clone()), Some(limits(&[])), Some(usize::MAX)),
            ("the quota deleted", Some(two_of_two.clone()), None, Some(usize::MAX)),
            ("a quota of other resources deleted", Some(limits(&[])), None, None),
            ("a new quota", None, Some(two_of_two.clone()), None),
            ("its status written", Some(limits(&[])), Some(limits(&[(CLAIMS, Some(3), Some(0))])), Some(3)),
            (
                "one of two limits full",
                Some(limits(&[(GPUS, Some(8), Some(8)), (CLAIMS, Some(4), Some(3))])),
                Some(limits(&[(GPUS, Some(8), Some(6)), (CLAIMS, Some(4), Some(3))])),
                Some(1),
            ),
            (
                "a count it cannot read",
                Some(limits(&[(GPUS, Some(2), Some(2))])),
                Some(limits(&[(GPUS, None, Some(1))])),
                Some(usize::MAX),
            ),
        ];
        for (case, before, after, expected) in table {
            assert_eq!(room_freed(before.as_ref(), after.as_ref()), expected, "{case}");
        }
    }

    #[test]
    fn counts_are_read_as_quotas_write_them() {
        for (text, expected) in
            [("2", Some(2)), ("10k", Some(10_000)), ("1M", Some(1_000_000)), ("1.5", None), ("x", None)]
        {
            assert_eq!(count(text), expected, "{text}");
        }
    }
}
