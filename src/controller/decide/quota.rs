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

/// Whether a quota resource may limit claims. The API server charges a claim (`claimEvaluator.Usage`,
/// k8s.io/kubernetes `pkg/quota/v1/evaluator/core/resource_claims.go`) with [`CLAIM_COUNT`], its devices per class
/// (`<class>.deviceclass.resource.k8s.io/devices`) and, with extended resources (`DRAExtendedResource`, on by default
/// since 1.36), the same count as `requests.deviceclass.resource.kubernetes.io/<class>` and, for a class that names
/// an extended resource, `requests.<that name>` (`requests.nvidia.com/gpu`: a team's quota from device plugin days
/// refuses claims too). Extended resource names always have a domain, so `requests.cpu` and the like are left out.
fn limits_claims(resource: &str) -> bool {
    resource == CLAIM_COUNT
        || resource.ends_with(".deviceclass.resource.k8s.io/devices")
        || resource.strip_prefix("requests.").is_some_and(|name| name.contains('/'))
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

/// The resource every claim counts against, whatever its devices.
pub const CLAIM_COUNT: &str = "count/resourceclaims.resource.k8s.io";

/// Room left for `resource` under `limits`: `Some(hard - used)` when both are known, `Some(0)` when only the limit
/// is (the quota's usage not written yet: the API server refuses every create it covers), `None` when `resource`
/// is not limited there.
pub fn room(limits: &ClaimLimits, resource: &str) -> Option<i64> {
    match limits.get(resource).copied() {
        Some((Some(hard), Some(used))) => Some(hard.saturating_sub(used)),
        Some((Some(_), None)) => Some(0),
        _ => None,
    }
}

/// The resources for which a quota's change left more room (`before`/`after` `None`: the quota is new/deleted):
/// more room than before, or no longer limited. A quota seen for the first time frees nothing.
pub fn freed_resources(before: Option<&ClaimLimits>, after: Option<&ClaimLimits>) -> Vec<String> {
    let Some(before) = before else { return Vec::new() };
    let limited_before = before.iter().filter(|(_, (hard, _))| hard.is_some()).map(|(r, _)| r);
    match after {
        None => limited_before.cloned().collect(),
        Some(after) => limited_before
            .filter(|r| match (room(before, r), room(after, r)) {
                (_, None) => true,
                (Some(old), Some(new)) => new > old && new > 0,
                (None, Some(new)) => new > 0,
            })
            .cloned()
            .collect(),
    }
}

/// What a refused create asked of the quota that refused it, for the resources it exceeded: resource → amount.
pub type Needs = BTreeMap<String, i64>;

/// The needs an "exceeded quota" refusal names: the plugin writes `exceeded quota: <quota>, requested: <r>=<n>,...,
/// used: ..., limited: ...`, the requested amounts of the resources the create would have taken over the limit
/// (k8s.io/apiserver `admission/plugin/resourcequota`, `CheckRequest` and `prettyPrint`). `None` for the other
/// quota refusals (usage not known yet, a resource no quota covers) and for a list that does not read as counts.
pub fn requested(message: &str) -> Option<Needs> {
    let (_, rest) = message.split_once("is forbidden: exceeded quota: ")?;
    let (_, rest) = rest.split_once(", requested: ")?;
    let (list, _) = rest.split_once(", used: ")?;
    list.split(',')
        .map(|part| {
            let (resource, amount) = part.split_once('=')?;
            Some((resource.to_string(), count(amount)?))
        })
        .collect()
}

/// What a sync's quota refusals (their messages) ask for together: the sum of each refusal's [`requested`], and a
/// claim of the claim count for each refused create (a message names only the resources it exceeded); `None` when
/// one of them does not say.
pub fn needs<'a>(messages: impl IntoIterator<Item = &'a str>) -> Option<Needs> {
    let mut total = Needs::new();
    let mut creates = 0;
    for message in messages {
        creates += 1;
        for (resource, amount) in requested(message)? {
            *total.entry(resource).or_default() += amount;
        }
    }
    let claims = total.entry(CLAIM_COUNT.to_string()).or_default();
    *claims = (*claims).max(creates);
    Some(total)
}

/// What a key is taken to ask of the quotas: its needs, or one of each `freed` resource when they are unknown; and
/// at least one claim of the claim count.
pub fn asks(needs: Option<&Needs>, freed: &[String]) -> Needs {
    let mut asks: Needs = match needs {
        Some(needs) if !needs.is_empty() => needs.clone(),
        _ => freed.iter().map(|r| (r.clone(), 1)).collect(),
    };
    let claims = asks.entry(CLAIM_COUNT.to_string()).or_default();
    *claims = (*claims).max(1);
    asks
}

/// The least room any of `quotas` leaves for `resource`; `None` when none limits it.
fn least_room<'a>(quotas: impl Iterator<Item = &'a ClaimLimits>, resource: &str) -> Option<i64> {
    quotas.filter_map(|q| room(q, resource)).min()
}

/// Which waiting keys (`waiting`: each with what its last refusal said it needs, oldest refusal first) a change
/// that freed the `freed` resources wakes, given every quota of the namespace (`quotas`) and what keys woken before
/// and not through yet take (`taken`): each key whose [`asks`] fit in the room left, counting what the keys woken
/// before it take.
///
/// A key that does not fit is passed over, not waited for: a claim of another class, or a pod asking for more
/// devices than are free, keeps its place while a later key that fits takes the room, as the API server would let
/// it in on a retry; the passed-over key is woken by the change that leaves room for it (or its own retry). Quota is
/// not a queue: a pod asking for many GPUs can wait long while smaller ones keep taking what comes free, as it would
/// with kube-controller-manager's retries (a queueing system such as Kueue orders such workloads).
pub fn to_wake<'a, K>(
    quotas: impl Iterator<Item = &'a ClaimLimits> + Clone,
    freed: &[String],
    mut taken: Needs,
    waiting: impl IntoIterator<Item = (K, Option<&'a Needs>)>,
) -> Vec<K> {
    let mut woken = Vec::new();
    for (key, needs) in waiting {
        let asks = asks(needs, freed);
        let fits = asks.iter().all(|(resource, amount)| {
            least_room(quotas.clone(), resource)
                .is_none_or(|room| room - taken.get(resource).copied().unwrap_or(0) >= *amount)
        });
        if fits {
            for (resource, amount) in asks {
                *taken.entry(resource).or_default() += amount;
            }
            woken.push(key);
        }
    }
    woken
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
        let none: Vec<&str> = Vec::new();
        // (case, before, after, resources freed)
        type Case = (&'static str, Option<ClaimLimits>, Option<ClaimLimits>, Vec<&'static str>);
        let table: Vec<Case> = vec![
            ("a claim counted gone", Some(two_of_two.clone()), Some(limits(&[(GPUS, Some(2), Some(1))])), vec![GPUS]),
            ("the limit raised", Some(two_of_two.clone()), Some(limits(&[(GPUS, Some(5), Some(2))])), vec![GPUS]),
            ("a claim counted in", Some(limits(&[(GPUS, Some(2), Some(1))])), Some(two_of_two.clone()), none.clone()),
            ("the limit lowered", Some(two_of_two.clone()), Some(limits(&[(GPUS, Some(1), Some(2))])), none.clone()),
            ("nothing changed", Some(two_of_two.clone()), Some(two_of_two.clone()), none.clone()),
            ("the limit dropped from the quota", Some(two_of_two.clone()), Some(limits(&[])), vec![GPUS]),
            ("the quota deleted", Some(two_of_two.clone()), None, vec![GPUS]),
            ("a quota of other resources deleted", Some(limits(&[])), None, none.clone()),
            ("a quota seen for the first time", None, Some(limits(&[(GPUS, Some(2), Some(0))])), none.clone()),
            (
                "its limit written, usage not yet",
                Some(limits(&[])),
                Some(limits(&[(CLAIMS, Some(3), None)])),
                none.clone(),
            ),
            (
                "then its usage",
                Some(limits(&[(CLAIMS, Some(3), None)])),
                Some(limits(&[(CLAIMS, Some(3), Some(0))])),
                vec![CLAIMS],
            ),
            (
                "usage written, full",
                Some(limits(&[(CLAIMS, Some(3), None)])),
                Some(limits(&[(CLAIMS, Some(3), Some(3))])),
                none.clone(),
            ),
            (
                "one of two resources freed",
                Some(limits(&[(GPUS, Some(8), Some(8)), (CLAIMS, Some(4), Some(3))])),
                Some(limits(&[(GPUS, Some(8), Some(6)), (CLAIMS, Some(4), Some(3))])),
                vec![GPUS],
            ),
        ];
        for (case, before, after, expected) in table {
            assert_eq!(freed_resources(before.as_ref(), after.as_ref()), expected, "{case}");
        }
    }

    /// `to_wake` over keys 0..n whose needs are unknown: how many it wakes.
    fn wakes_unknown<'a>(quotas: impl Iterator<Item = &'a ClaimLimits> + Clone, freed: &[String], n: usize) -> usize {
        to_wake(quotas, freed, Needs::new(), (0..n).map(|k| (k, None))).len()
    }

    #[test]
    fn keys_of_unknown_needs_are_woken_by_the_least_room_over_the_namespaces_quotas_and_the_claim_count() {
        const H100: &str = "h100.deviceclass.resource.k8s.io/devices";
        let gpus = limits(&[(GPUS, Some(8), Some(5)), (H100, Some(4), Some(4))]);
        let claims = limits(&[(CLAIMS, Some(10), Some(8))]);
        let freed = vec![GPUS.to_string()];
        // GPUS has 3, the claim count 2: 2. The full H100 class does not hold back claims of the other class.
        assert_eq!(wakes_unknown([&gpus, &claims].into_iter(), &freed, 9), 2);
        assert_eq!(wakes_unknown([&gpus].into_iter(), &freed, 9), 3);
        // Another quota of the namespace still full for the freed resource: nothing.
        let full = limits(&[(GPUS, Some(2), Some(2))]);
        assert_eq!(wakes_unknown([&gpus, &full].into_iter(), &freed, 9), 0);
        // Nothing limits it any more (its quota deleted): every waiting key the claim count lets through.
        assert_eq!(wakes_unknown([&claims].into_iter(), &[H100.to_string()], 9), 2);
        assert_eq!(wakes_unknown(std::iter::empty(), &freed, 9), 9);
        // A limit whose usage is not written yet refuses everything.
        assert_eq!(wakes_unknown([&limits(&[(CLAIMS, Some(3), None)])].into_iter(), &freed, 9), 0);
    }

    #[test]
    fn keys_are_woken_by_what_their_refusal_said_they_need_passing_over_those_that_do_not_fit() {
        const A100: &str = "a100.deviceclass.resource.k8s.io/devices";
        const H100: &str = "h100.deviceclass.resource.k8s.io/devices";
        let needs = |entries: &[(&str, i64)]| -> Needs { entries.iter().map(|(r, n)| (r.to_string(), *n)).collect() };
        let (one_a100, one_h100, two_h100) = (needs(&[(A100, 1)]), needs(&[(H100, 1)]), needs(&[(H100, 2)]));
        let both = needs(&[(A100, 1), (H100, 1)]);
        let freed = vec![H100.to_string()];
        // (case, quotas, waiting keys oldest first, woken)
        type Case<'n> = (&'static str, Vec<ClaimLimits>, Vec<(&'static str, Option<&'n Needs>)>, Vec<&'static str>);
        let table: Vec<Case> = vec![
            (
                "an H100 freed: the older A100 pod is passed over, the H100 pod woken",
                vec![limits(&[(A100, Some(1), Some(1)), (H100, Some(1), Some(0))])],
                vec![("a2", Some(&one_a100)), ("h2", Some(&one_h100))],
                vec!["h2"],
            ),
            (
                "one H100 free: a pod asking for two is passed over, one asking for one woken",
                vec![limits(&[(H100, Some(4), Some(3))])],
                vec![("big", Some(&two_h100)), ("small", Some(&one_h100)), ("small2", Some(&one_h100))],
                vec!["small"],
            ),
            (
                "two free: the pod asking for two takes both, oldest first",
                vec![limits(&[(H100, Some(4), Some(2))])],
                vec![("big", Some(&two_h100)), ("small", Some(&one_h100))],
                vec!["big"],
            ),
            (
                "a pod needing both classes waits for both",
                vec![limits(&[(A100, Some(1), Some(1)), (H100, Some(1), Some(0))])],
                vec![("both", Some(&both)), ("h2", Some(&one_h100))],
                vec!["h2"],
            ),
            (
                "the claim count full holds back every key",
                vec![limits(&[(H100, Some(2), Some(0))]), limits(&[(CLAIMS, Some(3), Some(3))])],
                vec![("h2", Some(&one_h100))],
                vec![],
            ),
            (
                "a class no quota limits any more fits",
                vec![limits(&[(H100, Some(1), Some(0))])],
                vec![("a2", Some(&one_a100)), ("h2", Some(&one_h100)), ("h3", Some(&one_h100))],
                vec!["a2", "h2"],
            ),
            (
                "unknown needs take one of the freed resource",
                vec![limits(&[(H100, Some(2), Some(1))])],
                vec![("unknown", None), ("h2", Some(&one_h100))],
                vec!["unknown"],
            ),
        ];
        for (case, quotas, waiting, expected) in table {
            assert_eq!(to_wake(quotas.iter(), &freed, Needs::new(), waiting), expected, "{case}");
        }
    }

    #[test]
    fn the_resources_a_claim_is_charged_with_are_tracked_and_no_others() {
        for (resource, tracked) in [
            (CLAIMS, true),
            (GPUS, true),
            ("requests.deviceclass.resource.kubernetes.io/gpu", true),
            ("requests.nvidia.com/gpu", true),
            ("requests.cpu", false),
            ("requests.memory", false),
            ("count/pods", false),
            ("pods", false),
        ] {
            assert_eq!(limits_claims(resource), tracked, "{resource}");
        }
    }

    #[test]
    fn keys_woken_and_not_yet_through_hold_their_room() {
        const H100: &str = "h100.deviceclass.resource.k8s.io/devices";
        let one: Needs = [(H100.to_string(), 1)].into();
        let quotas = [limits(&[(H100, Some(4), Some(2))])];
        let freed = vec![H100.to_string()];
        // Two free, one already woken for: one more.
        let taken = asks(Some(&one), &freed);
        let waiting = [("a", Some(&one)), ("b", Some(&one))];
        assert_eq!(to_wake(quotas.iter(), &freed, taken, waiting), vec!["a"]);
        assert_eq!(to_wake(quotas.iter(), &freed, Needs::new(), waiting), vec!["a", "b"]);
    }

    #[test]
    fn an_exceeded_quota_says_what_the_create_needed() {
        let exceeded = r#"resourceclaims.resource.k8s.io "p-gpu-x7k2q" is forbidden: exceeded quota: gpus, requested: count/resourceclaims.resource.k8s.io=1,gpu.deviceclass.resource.k8s.io/devices=2, used: count/resourceclaims.resource.k8s.io=4,gpu.deviceclass.resource.k8s.io/devices=7, limited: count/resourceclaims.resource.k8s.io=4,gpu.deviceclass.resource.k8s.io/devices=8"#;
        let expected: Needs = [(CLAIMS.to_string(), 1), (GPUS.to_string(), 2)].into();
        assert_eq!(requested(exceeded), Some(expected.clone()));
        let unknown = r#"resourceclaims.resource.k8s.io "c" is forbidden: status unknown for quota: gpus, resources: count/resourceclaims.resource.k8s.io"#;
        assert_eq!(requested(unknown), None);
        let garbled = r#"resourceclaims.resource.k8s.io "c" is forbidden: exceeded quota: gpus, requested: x, used: y"#;
        assert_eq!(requested(garbled), None);
        // Two claims of one pod refused: their needs add up; one refusal that does not say makes them unknown.
        let doubled: Needs = [(CLAIMS.to_string(), 2), (GPUS.to_string(), 4)].into();
        assert_eq!(needs([exceeded, exceeded]), Some(doubled));
        assert_eq!(needs([exceeded, unknown]), None);
        // A message names only what was exceeded; each refused create still takes a claim of the count.
        let gpus_only = r#"resourceclaims.resource.k8s.io "c" is forbidden: exceeded quota: gpus, requested: gpu.deviceclass.resource.k8s.io/devices=1, used: gpu.deviceclass.resource.k8s.io/devices=2, limited: gpu.deviceclass.resource.k8s.io/devices=2"#;
        let two_creates: Needs = [(CLAIMS.to_string(), 2), (GPUS.to_string(), 2)].into();
        assert_eq!(needs([gpus_only, gpus_only]), Some(two_creates));
        // A quota on the extended resource a class names (requests.nvidia.com/gpu), as teams had for the device plugin.
        let extended = r#"resourceclaims.resource.k8s.io "c" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=4"#;
        let one_gpu: Needs = [(CLAIMS.to_string(), 1), ("requests.nvidia.com/gpu".to_string(), 1)].into();
        assert_eq!(needs([extended]), Some(one_gpu));
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
