//! A classic NVIDIA device plugin on the same node hands out the same GPUs through the kubelet's device manager, and
//! neither knows what the other gave: two pods on one GPU. The agent tells one from the Node itself: a device plugin
//! that serves GPUs puts `nvidia.com/gpu` (or its shared or MIG resources, or the names `--device-plugin-resources`
//! lists) in the Node's capacity and allocatable, which DRA never does (extended resources backed by DRA, 1.34+, are
//! matched by the scheduler from the DeviceClass, not the Node). A node label cannot tell it: the GPU Operator labels
//! every GPU node `nvidia.com/gpu.deploy.device-plugin=true`, whether its device plugin is enabled or not.
//!
//! While such resources are there the agent publishes none of its GPUs (`--refuse-with-device-plugin`, on by
//! default) and says so (error log, Warning Event `DevicePluginServesGpus` on the Node,
//! `gpu_dra_node_agent_device_plugin_refused 1`); it still serves the kubelet, so claims prepared before can be
//! unprepared. A zero is not a plugin gone: the kubelet zeroes a plugin's resources while it restarts (until the
//! plugin registers again) and keeps a disconnected plugin's capacity for 5 minutes; so the GPUs are published again
//! only once no plugin has served any for `--device-plugin-grace-period` (5 minutes, the kubelet's own grace), and
//! an agent that starts beside resources listed at zero (a node rebooting) waits as long.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, NodeStatus};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use prometheus_client::metrics::gauge::Gauge;
use tracing::{error, info, warn};

/// The extended resources NVIDIA's device plugin (and clouds' plugins, under the same names) serve GPUs as: whole
/// GPUs, time-sliced or MPS-shared GPUs renamed `.shared`, MIG devices (mixed strategy). A trailing `*` matches any
/// rest of the name.
pub const DEFAULT_RESOURCES: &str = "nvidia.com/gpu,nvidia.com/gpu.shared,nvidia.com/mig-*";

/// Whether `name` is one of `patterns` (see [`DEFAULT_RESOURCES`]).
fn matches(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == p,
    })
}

/// What the Node shows of device plugins serving GPUs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// The resources with something in capacity or allocatable, as `name=<capacity>`, sorted.
    pub serving: Vec<String>,
    /// Whether any of the resources is listed at all, zero included.
    pub listed: bool,
}

/// Reads `status` for the resources `patterns` names.
pub fn observe(status: Option<&NodeStatus>, patterns: &[String]) -> Observed {
    let empty = BTreeMap::new();
    let capacity = status.and_then(|s| s.capacity.as_ref()).unwrap_or(&empty);
    let allocatable = status.and_then(|s| s.allocatable.as_ref()).unwrap_or(&empty);
    let mut serving = BTreeMap::new();
    let mut listed = false;
    for (name, quantity) in capacity.iter().chain(allocatable) {
        if !matches(patterns, name) {
            continue;
        }
        listed = true;
        if !is_zero(quantity) {
            let shown = capacity.get(name).unwrap_or(quantity);
            serving.insert(name.clone(), format!("{name}={}", shown.0));
        }
    }
    Observed { serving: serving.into_values().collect(), listed }
}

/// Extended resources are whole numbers; anything else that is not plainly zero counts as something.
fn is_zero(quantity: &Quantity) -> bool {
    quantity.0.trim().parse::<u64>() == Ok(0)
}

/// Whether the GPUs are held back, and since when no plugin served any.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub refusing: bool,
    /// When a plugin was last seen serving GPUs (or the agent started beside listed zeros) while refusing.
    pub last_served: Option<Instant>,
}

/// What a decision means for the log and the Node's Events.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// A device plugin serves GPUs (or may, after a restart) where none did.
    Refused,
    /// None has served any for the grace period.
    Released,
}

/// Decides from the last verdict and what the Node shows `now`. `first`: the agent's first look at the Node.
pub fn decide(
    last: Verdict,
    observed: &Observed,
    first: bool,
    now: Instant,
    grace: Duration,
) -> (Verdict, Option<Change>) {
    let refused = (!last.refusing).then_some(Change::Refused);
    if !observed.serving.is_empty() {
        return (Verdict { refusing: true, last_served: Some(now) }, refused);
    }
    let since = match (last.refusing, first && observed.listed) {
        (true, _) => last.last_served.unwrap_or(now),
        (false, true) => now,
        (false, false) => return (Verdict::default(), None),
    };
    if now.saturating_duration_since(since) >= grace {
        return (Verdict::default(), last.refusing.then_some(Change::Released));
    }
    (Verdict { refusing: true, last_served: Some(since) }, refused)
}

/// Keeps the agent's GPUs out of the pool while a device plugin serves GPUs on its node, and reports it.
pub struct DevicePluginGuard {
    /// `--refuse-with-device-plugin`: off, a plugin is only warned about.
    refuse: bool,
    patterns: Vec<String>,
    grace: Duration,
    verdict: Verdict,
    /// Whether the Node was looked at before.
    looked: bool,
    /// What the last look saw serving GPUs.
    serving: Vec<String>,
    gauge: Gauge<i64>,
    recorder: Recorder,
}

impl std::fmt::Debug for DevicePluginGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePluginGuard")
            .field("refuse", &self.refuse)
            .field("verdict", &self.verdict)
            .field("serving", &self.serving)
            .finish()
    }
}

impl DevicePluginGuard {
    pub fn new(
        refuse: bool,
        patterns: Vec<String>,
        grace: Duration,
        client: kube::Client,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Self {
        let gauge = Gauge::<i64>::default();
        registry.register(
            "gpu_dra_node_agent_device_plugin_refused",
            "1 while a device plugin serves NVIDIA GPUs on this node (or did within --device-plugin-grace-period) and \
             the agent publishes none of its own (--refuse-with-device-plugin)",
            gauge.clone(),
        );
        let recorder = Recorder::new(client, Reporter { controller: "gpu-dra-node-agent".into(), instance: None });
        Self {
            refuse,
            patterns,
            grace,
            verdict: Verdict::default(),
            looked: false,
            serving: Vec::new(),
            gauge,
            recorder,
        }
    }

    /// Whether the node's GPUs are to be left out of its pool now.
    pub fn refusing(&self) -> bool {
        self.refuse && self.verdict.refusing
    }

    /// Takes in the Node just read; says in the log and an Event on the Node when the GPUs are held back or
    /// published again.
    pub async fn observe(&mut self, node: &Node) {
        let observed = observe(node.status.as_ref(), &self.patterns);
        let first = !std::mem::replace(&mut self.looked, true);
        let (verdict, change) = decide(self.verdict, &observed, first, Instant::now(), self.grace);
        self.verdict = verdict;
        let appeared = self.serving.is_empty() && !observed.serving.is_empty();
        self.serving = observed.serving;
        self.gauge.set(i64::from(self.refusing()));
        let grace = humantime::format_duration(self.grace);
        let (type_, reason, note) = match change {
            Some(Change::Refused) if self.refuse => {
                let what = if self.serving.is_empty() {
                    "The Node lists a device plugin's GPU resources with none there now (the kubelet or the plugin \
                     restarting?)"
                        .to_string()
                } else {
                    format!("A device plugin serves GPUs on this node ({})", self.serving.join(", "))
                };
                let note = format!(
                    "{what}: gpu-dra publishes none of this node's GPUs, as both would hand out the same ones, until \
                     no device plugin has served any for {grace}. Disable the device plugin on this node (GPU \
                     Operator: devicePlugin.enabled=false in its ClusterPolicy), or let both run with the chart's \
                     nodeAgent.refuseWithDevicePlugin=false (--refuse-with-device-plugin=false) if they are kept \
                     apart by other means. Claims prepared here before can still be unprepared."
                );
                error!(resources = ?self.serving, "{note}");
                (EventType::Warning, "DevicePluginServesGpus", note)
            }
            _ if !self.refuse && appeared => {
                let note = format!(
                    "A device plugin serves GPUs on this node ({}) and gpu-dra publishes them too \
                     (--refuse-with-device-plugin=false): both can hand out the same GPU.",
                    self.serving.join(", ")
                );
                warn!(resources = ?self.serving, "{note}");
                (EventType::Warning, "DevicePluginServesGpus", note)
            }
            Some(Change::Released) if self.refuse => {
                let note =
                    format!("No device plugin has served GPUs on this node for {grace}: gpu-dra publishes them.");
                info!("{note}");
                (EventType::Normal, "DevicePluginGone", note)
            }
            _ => return,
        };
        let event =
            Event { type_, reason: reason.into(), note: Some(note), action: "PublishGpus".into(), secondary: None };
        if let Err(error) = self.recorder.publish(&event, &node.object_ref(&())).await {
            warn!(%error, reason, "publishing an event about the device plugin failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(capacity: &[(&str, &str)], allocatable: &[(&str, &str)]) -> NodeStatus {
        let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, Quantity> {
            pairs.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect()
        };
        NodeStatus { capacity: Some(map(capacity)), allocatable: Some(map(allocatable)), ..Default::default() }
    }

    #[test]
    fn the_resources_a_device_plugin_serves_gpus_as_are_read_from_the_node() {
        let defaults: Vec<String> = DEFAULT_RESOURCES.split(',').map(String::from).collect();
        let renamed = vec!["nvidia.com/a100".to_string()];
        type Pairs = &'static [(&'static str, &'static str)];
        type Case<'a> = (Pairs, Pairs, &'a [String], &'a [&'a str], bool);
        let cases: &[Case] = &[
            (&[], &[], &defaults, &[], false),
            (&[("cpu", "8"), ("memory", "32Gi")], &[("cpu", "8")], &defaults, &[], false),
            (&[("nvidia.com/gpu", "8")], &[("nvidia.com/gpu", "8")], &defaults, &["nvidia.com/gpu=8"], true),
            // A disconnected plugin: its capacity kept for the kubelet's grace period, nothing allocatable.
            (&[("nvidia.com/gpu", "8")], &[("nvidia.com/gpu", "0")], &defaults, &["nvidia.com/gpu=8"], true),
            // A kubelet restarted: zero until the plugin registers again; listed all the same.
            (&[("nvidia.com/gpu", "0")], &[("nvidia.com/gpu", "0")], &defaults, &[], true),
            (&[("nvidia.com/gpu.shared", "40")], &[], &defaults, &["nvidia.com/gpu.shared=40"], true),
            (
                &[("nvidia.com/mig-1g.10gb", "7"), ("nvidia.com/mig-3g.40gb", "0"), ("example.com/fpga", "2")],
                &[],
                &defaults,
                &["nvidia.com/mig-1g.10gb=7"],
                true,
            ),
            // Look-alikes of other vendors and of NVIDIA's network operator are no GPU plugin.
            (
                &[("nvidia.com/gpumem", "80"), ("amd.com/gpu", "2"), ("nvidia.com/hostdev", "4")],
                &[],
                &defaults,
                &[],
                false,
            ),
            // A plugin configured to rename its resource, named by --device-plugin-resources.
            (&[("nvidia.com/a100", "4")], &[], &defaults, &[], false),
            (&[("nvidia.com/a100", "4")], &[], &renamed, &["nvidia.com/a100=4"], true),
            // Not a whole number: counted rather than ignored.
            (&[("nvidia.com/gpu", "1k")], &[], &defaults, &["nvidia.com/gpu=1k"], true),
        ];
        for (capacity, allocatable, patterns, serving, listed) in cases {
            let seen = observe(Some(&status(capacity, allocatable)), patterns);
            assert_eq!(seen.serving, *serving, "{capacity:?} {allocatable:?}");
            assert_eq!(seen.listed, *listed, "{capacity:?} {allocatable:?}");
        }
        assert_eq!(observe(None, &defaults), Observed::default());
    }

    #[test]
    fn the_gpus_come_back_only_after_a_grace_period_without_a_plugin() {
        let grace = Duration::from_secs(300);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let serving = Observed { serving: vec!["nvidia.com/gpu=8".into()], listed: true };
        let zero = Observed { serving: Vec::new(), listed: true };
        let none = Observed::default();

        // No plugin: nothing held back, nothing said.
        assert_eq!(decide(Verdict::default(), &none, true, at(0), grace), (Verdict::default(), None));
        // A plugin appears: refused at once.
        let (v, change) = decide(Verdict::default(), &serving, false, at(10), grace);
        assert_eq!((v.refusing, change), (true, Some(Change::Refused)));
        // It restarts (zeros) and comes back within the grace period: held back throughout, nothing said.
        let (v, change) = decide(v, &zero, false, at(20), grace);
        assert_eq!((v.refusing, change), (true, None));
        let (v, change) = decide(v, &serving, false, at(200), grace);
        assert_eq!((v.refusing, change, v.last_served), (true, None, Some(at(200))));
        // Gone: held back until the grace period has passed since it last served.
        let (v, change) = decide(v, &none, false, at(201), grace);
        assert_eq!((v.refusing, change), (true, None));
        let (v, change) = decide(v, &none, false, at(499), grace);
        assert_eq!((v.refusing, change), (true, None));
        let (v, change) = decide(v, &none, false, at(500), grace);
        assert_eq!((v, change), (Verdict::default(), Some(Change::Released)));

        // An agent starting beside listed zeros (a node rebooting, its plugin not registered yet) waits too.
        let (v, change) = decide(Verdict::default(), &zero, true, at(0), grace);
        assert_eq!((v.refusing, change), (true, Some(Change::Refused)));
        let (v, change) = decide(v, &zero, false, at(300), grace);
        assert_eq!((v, change), (Verdict::default(), Some(Change::Released)));
        // Zeros listed later, by a kubelet the agent saw without a plugin: no plugin, nothing held back.
        assert_eq!(decide(Verdict::default(), &zero, false, at(400), grace), (Verdict::default(), None));
    }
}
