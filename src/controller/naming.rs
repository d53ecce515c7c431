//! Names of generated ResourceClaims.

/// The longest `generateName` we send: the API server appends five random characters, and a claim name must fit
/// in a 63-character DNS label... plus one spare, exactly as kube-controller-manager leaves it.
pub const MAX_GENERATE_NAME_LEN: usize = 57;

/// `generateName` for the claim of pod claim `claim` in pod `pod`: `<pod>-<claim>-`.
///
/// When that is longer than [`MAX_GENERATE_NAME_LEN`], both parts shrink in proportion to their length (the API
/// server would otherwise cut only the end and lose the pod claim's name) and the trailing hyphen is dropped:
/// `pod[..len(pod)*57/len(full)] + "-" + claim[..len(claim)*57/len(full)]`, as kube-controller-manager does.
pub fn claim_generate_name(pod: &str, claim: &str) -> String {
    let full_len = pod.len() + claim.len() + 2;
    if full_len <= MAX_GENERATE_NAME_LEN {
        return format!("{pod}-{claim}-");
    }
    let pod_len = pod.len() * MAX_GENERATE_NAME_LEN / full_len;
    let claim_len = claim.len() * MAX_GENERATE_NAME_LEN / full_len;
    // A pod or PodGroup name is a DNS subdomain: cut after a dot (`train.v2.exp42` to `train.`), it would make
    // `train.-gp…`, which the API server refuses, for ever. kube-controller-manager sends that name and retries it;
    // here the dot goes.
    format!("{}-{}", prefix(pod, pod_len).trim_end_matches('.'), prefix(claim, claim_len))
}

/// The first `len` bytes of `s`, backing off to a character boundary (object names are ASCII once validated, but
/// a slice must never panic on input from outside).
fn prefix(s: &str, len: usize) -> &str {
    &s[..s.floor_char_boundary(len)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_names() {
        let a63 = "a".repeat(63);
        let b63 = "b".repeat(63);
        let cases: &[(&str, &str, String)] = &[
            ("my-pod", "gpu", "my-pod-gpu-".into()),
            // 55 + 2 = 57: still fits, hyphen kept.
            (&"p".repeat(50), "gpu-x", format!("{}-gpu-x-", "p".repeat(50))),
            // 58: shrinks. 51*57/58 = 50, 5*57/58 = 4.
            (&"p".repeat(51), "gpu-x", format!("{}-gpu-", "p".repeat(50))),
            // Two 63-character names: 63*57/128 = 28 each.
            (&a63, &b63, format!("{}-{}", "a".repeat(28), "b".repeat(28))),
            // A long pod name keeps a share of the claim name.
            // 63*57/68 = 52 and 3*57/68 = 2.
            (&a63, "gpu", format!("{}-gp", "a".repeat(52))),
        ];
        for (pod, claim, want) in cases {
            let got = claim_generate_name(pod, claim);
            assert_eq!(&got, want, "pod {pod:?} claim {claim:?}");
            assert!(got.len() <= MAX_GENERATE_NAME_LEN, "{got} too long");
        }
    }

    #[test]
    fn a_name_cut_after_a_dot_is_still_a_valid_claim_name() {
        // A 1.37 Job's PodGroup: `<job>-<hash>-<job>-pgt-0-<hash>`, its name cut after a dot.
        let group = "gpt.oss.120b.grpo.exp42-4f8c9d2b7a-gpt.oss.120b.grpo.exp42-pgt-0-7d9c";
        for claim in ["gpu", "fabric", "g"] {
            // Every prefix that is itself a valid name (not ending in a dot or hyphen).
            for cut in (1..=group.len()).filter(|cut| !group[..*cut].ends_with(['.', '-'])) {
                let name = format!("{}abcde", claim_generate_name(&group[..cut], claim));
                assert!(crate::node_agent::is_dns_subdomain(&name), "{name} is not a valid claim name");
            }
        }
        // 80*57/85 = 53 characters of the pod name, the last a dot, dropped.
        let pod = format!("{}.{}", "x".repeat(52), "y".repeat(27));
        assert_eq!(claim_generate_name(&pod, "gpu"), format!("{}-gp", "x".repeat(52)));
    }

    #[test]
    fn non_ascii_input_never_panics() {
        let name = claim_generate_name(&"é".repeat(40), &"ü".repeat(40));
        assert!(name.len() <= MAX_GENERATE_NAME_LEN);
    }
}
