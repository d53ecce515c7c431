//! How this node's GPUs are shared: the agent's `--gpu-sharing` (the chart's `nodeAgent.gpuSharing`, one value
//! for the whole DaemonSet) is the default, and a label on the Node, `<driver>/gpu-sharing`, overrides it, so each
//! node pool chooses (managed clusters label their pools' nodes) with one DaemonSet and no second agent per node.
//!
//! The label is read on every full discover-and-publish round (at start, then every `--resync-period`, a minute by
//! default), so a change is published within that; a value that is not a sharing mode is reported and the default
//! used, never a guess. Pods holding shares when a node turns `whole` keep them, and while they do the scheduler
//! (v1.37.2) counts their memory, not the device as taken: a claim naming less than what is left may get the GPU
//! beside them. So a node's mode is changed when none of its GPUs is shared out (the README says so).

use std::collections::BTreeMap;

use clap::ValueEnum;

use super::Sharing;

/// The Node label that chooses the sharing mode for this node's GPUs.
pub fn label_key(driver: &str) -> String {
    format!("{driver}/gpu-sharing")
}

/// A `<driver>/gpu-sharing` label whose value is not a sharing mode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "Node label {key}={value:?} is not a GPU sharing mode ({valid}): the GPUs are published as --gpu-sharing says \
     ({default}); fix or remove the label",
    valid = all_names(),
    default = name(*.default)
)]
pub struct InvalidSharingLabel {
    pub key: String,
    pub value: String,
    /// What is published instead.
    pub default: Sharing,
}

/// The sharing mode for a node with `labels`: the label's if it names one, else `default`; an unreadable label
/// comes back as the error beside the default.
pub fn resolve(
    labels: &BTreeMap<String, String>,
    driver: &str,
    default: Sharing,
) -> (Sharing, Option<InvalidSharingLabel>) {
    let key = label_key(driver);
    let Some(value) = labels.get(&key) else {
        return (default, None);
    };
    match Sharing::from_str(value.trim(), false) {
        Ok(sharing) => (sharing, None),
        Err(_) => (default, Some(InvalidSharingLabel { key, value: value.clone(), default })),
    }
}

/// The mode as the flag, the chart value and the label spell it (clap's name for it, so the three never differ).
pub fn name(sharing: Sharing) -> String {
    sharing.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default()
}

/// Every mode's name, comma-separated.
fn all_names() -> String {
    Sharing::value_variants().iter().map(|s| name(*s)).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRIVER: &str = "gpu.gpu-dra.dev";

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// (labels, default, resolved, reported)
    type Case = (&'static [(&'static str, &'static str)], Sharing, Sharing, bool);

    #[test]
    fn the_label_overrides_the_default_and_a_bad_value_is_reported() {
        const KEY: &str = "gpu.gpu-dra.dev/gpu-sharing";
        let cases: &[Case] = &[
            (&[], Sharing::Whole, Sharing::Whole, false),
            (&[], Sharing::ByMemory, Sharing::ByMemory, false),
            (&[(KEY, "by-memory")], Sharing::Whole, Sharing::ByMemory, false),
            (&[(KEY, "whole")], Sharing::ByMemory, Sharing::Whole, false),
            (&[(KEY, " by-memory ")], Sharing::Whole, Sharing::ByMemory, false),
            (&[(KEY, "half")], Sharing::Whole, Sharing::Whole, true),
            (&[(KEY, "")], Sharing::ByMemory, Sharing::ByMemory, true),
            (&[(KEY, "By-Memory")], Sharing::Whole, Sharing::Whole, true),
            // Another driver's label is not ours.
            (&[("other.example.com/gpu-sharing", "by-memory")], Sharing::Whole, Sharing::Whole, false),
        ];
        for (pairs, default, want, reported) in cases {
            let (got, error) = resolve(&labels(pairs), DRIVER, *default);
            assert_eq!(got, *want, "{pairs:?}");
            assert_eq!(error.is_some(), *reported, "{pairs:?}: {error:?}");
        }
    }

    #[test]
    fn a_bad_value_names_the_label_the_valid_values_and_what_is_used() {
        let (_, error) = resolve(&labels(&[("gpu.gpu-dra.dev/gpu-sharing", "half")]), DRIVER, Sharing::Whole);
        let text = error.expect("reported").to_string();
        for part in ["gpu.gpu-dra.dev/gpu-sharing=\"half\"", "whole, by-memory", "(whole)", "fix or remove"] {
            assert!(text.contains(part), "{part:?} missing from {text}");
        }
    }
}
