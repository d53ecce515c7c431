//! A classic NVIDIA device plugin on the same node hands out the same GPUs through the kubelet's device manager, and
//! neither knows what the other gave: two pods on one GPU. The agent tells one from the Node itself: a device plugin
//! that serves GPUs puts `nvidia.com/gpu` (or its shared or MIG resources, or the names `--device-plugin-resources`
//! lists) in the Node's allocatable, which DRA never does (extended resources backed by DRA, 1.34+, are
//! matched by the scheduler from the DeviceClass, not the Node). A node label cannot tell it: the GPU Operator labels
//! every GPU node `nvidia.com/gpu.deploy.device-plugin=true`, whether its device plugin is enabled or not.
//!
//! While such resources are there the agent publishes none of its GPUs (`--refuse-with-device-plugin`, on by
//! default) and says so (error log, Warning Event `DevicePluginServesGpus` on the Node,
//! `gpu_dra_node_agent_device_plugin_refused 1`); it still serves the kubelet, so claims prepared before can be
//! unprepared. A plugin serves while it makes GPUs allocatable; a zero is not a plugin gone: the kubelet zeroes its
//! allocatable while the plugin or the kubelet restarts, until it registers again. So the GPUs are published again
//! only once none has been allocatable for `--device-plugin-grace-period` (5 minutes: the kubelet's own wait for a
//! disconnected plugin). When a plugin last served is kept in `<state-dir>/device-plugin.json`, so that an agent
//! restarted within that time (a node rebooting: the kubelet lists the plugin's resources at zero until it is back)
//! holds the GPUs back too. Zeros alone mean nothing: the kubelet leaves a removed plugin's resources at zero in the
//! Node for good.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

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
    /// The resources with something allocatable, as `name=<allocatable>`, sorted.
    pub serving: Vec<String>,
}

/// Reads `status` for the resources `patterns` names.
pub fn observe(status: Option<&NodeStatus>, patterns: &[String]) -> Observed {
    let serving = status
        .and_then(|s| s.allocatable.as_ref())
        .into_iter()
        .flatten()
        .filter(|(name, quantity)| matches(patterns, name) && !is_zero(quantity))
        .map(|(name, quantity)| format!("{name}={}", quantity.0))
        .collect();
    Observed { serving }
}

/// Extended resources are whole numbers; anything else that is not plainly zero counts as something.
fn is_zero(quantity: &Quantity) -> bool {
    quantity.0.trim().parse::<u64>() == Ok(0)
}

/// Whether the GPUs are held back, and since when no plugin served any.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub refusing: bool,
    /// When a plugin was last seen serving GPUs, while refusing.
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

/// Decides from the last verdict and what the Node shows `now`. `remembered`: at the agent's first look, when a
/// plugin last served GPUs by the record an earlier agent left.
pub fn decide(
    last: Verdict,
    observed: &Observed,
    remembered: Option<Instant>,
    now: Instant,
    grace: Duration,
) -> (Verdict, Option<Change>) {
    let refused = (!last.refusing).then_some(Change::Refused);
    if !observed.serving.is_empty() {
        return (Verdict { refusing: true, last_served: Some(now) }, refused);
    }
    let since = match (last.refusing, remembered) {
        (true, _) => last.last_served.unwrap_or(now),
        (false, Some(at)) => at,
        (false, None) => return (Verdict::default(), None),
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
    /// `<state-dir>/device-plugin.json`: when a plugin last served GPUs, for the next agent.
    record: PathBuf,
    /// The machine's boot (see [`crate::kubelet_plugin::checkpoint::boot_id`]): a record of this boot is read on the
    /// boot clock, which a step of the wall clock does not move.
    boot_id: String,
    /// When the record was last written (it is written at most every half grace period while a plugin serves).
    recorded: Option<Instant>,
    /// What the last look saw serving GPUs.
    serving: Vec<String>,
    gauge: Gauge<i64>,
    recorder: Recorder,
    /// Set while a write of the record runs (on a blocking thread): one still hung on the disk is not joined by more.
    writing: std::sync::Arc<std::sync::atomic::AtomicBool>,
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
        state_dir: &std::path::Path,
        boot_id: &str,
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
            record: state_dir.join(RECORD),
            boot_id: boot_id.to_string(),
            recorded: None,
            serving: Vec::new(),
            gauge,
            recorder,
            writing: std::sync::Arc::default(),
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
        let now = Instant::now();
        let remembered = if std::mem::replace(&mut self.looked, true) { None } else { self.remembered(now) };
        let (verdict, change) = decide(self.verdict, &observed, remembered, now, self.grace);
        self.verdict = verdict;
        if !observed.serving.is_empty() && self.recorded.is_none_or(|at| now.duration_since(at) >= self.grace / 2) {
            self.remember();
            self.recorded = Some(now);
        }
        let appeared = self.serving.is_empty() && !observed.serving.is_empty();
        self.serving = observed.serving;
        self.gauge.set(i64::from(self.refusing()));
        let grace = humantime::format_duration(self.grace);
        let (type_, reason, note) = match change {
            Some(Change::Refused) if self.refuse => {
                let what = if self.serving.is_empty() {
                    "A device plugin served GPUs on this node shortly before this agent started (the node or the \
                     plugin restarting?)"
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
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(crate::event_note::fit(note)),
            action: "PublishGpus".into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &node.object_ref(&())).await {
            warn!(%error, reason, "publishing an event about the device plugin failed");
        }
    }
}

/// The record's file name under `--state-dir`.
const RECORD: &str = "device-plugin.json";

impl DevicePluginGuard {
    /// When a plugin last served GPUs by the record, as an instant of this process's clock, if within the grace
    /// period. A record that cannot be read is as none (said in the log): the GPUs are not held back for it.
    fn remembered(&self, now: Instant) -> Option<Instant> {
        let text = match std::fs::read(&self.record) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return None,
            Err(err) => {
                warn!(file = %self.record.display(), error = %err, "cannot read when a device plugin last served GPUs");
                return None;
            }
        };
        let Some(served) = serde_json::from_slice::<Served>(&text).ok() else {
            warn!(file = %self.record.display(), "unreadable record of when a device plugin last served GPUs: ignored");
            return None;
        };
        let Some(ago) = served.ago(SystemTime::now(), &self.boot_id, boot_clock_millis()) else {
            warn!(file = %self.record.display(), "the record of when a device plugin last served GPUs is from more \
                  than a day ahead of this clock: ignored");
            return None;
        };
        (ago < self.grace).then(|| now.checked_sub(ago).unwrap_or(now))
    }

    /// Writes that a plugin serves GPUs now, off the async threads (the write's fsyncs on a slow state disk held the
    /// agent's main loop). A failure is logged, not fatal: only a restart within the grace period would miss it.
    fn remember(&self) {
        use std::sync::atomic::Ordering;
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let served = Served {
            last_served_millis: u64::try_from(now).unwrap_or(u64::MAX),
            boot_id: (!self.boot_id.is_empty()).then(|| self.boot_id.clone()),
            boot_millis: boot_clock_millis(),
        };
        let text = serde_json::to_string(&served).unwrap_or_default();
        if self.writing.swap(true, Ordering::AcqRel) {
            warn!(file = %self.record.display(), "the last record that a device plugin serves GPUs is still being \
                  written (a slow or hung disk?); not written again");
            return;
        }
        let (record, writing) = (self.record.clone(), self.writing.clone());
        tokio::task::spawn_blocking(move || {
            if let Err(err) = crate::fsutil::write_atomic(&record, text.as_bytes()) {
                warn!(file = %record.display(), error = %err, "cannot record that a device plugin serves GPUs");
            }
            writing.store(false, Ordering::Release);
        });
    }
}

/// The record: when a plugin last served GPUs, on the wall clock and, within the boot it names, on the boot clock.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Served {
    last_served_millis: u64,
    /// Absent in records of earlier versions, and where the boot could not be told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    boot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    boot_millis: Option<u64>,
}

impl Served {
    /// How long ago it was. Within the boot that wrote it, on the boot clock (milliseconds since boot, suspend
    /// included), which a step of the wall clock (NTP correcting it at boot, a VM resumed) does not move: on the wall
    /// clock, a step forward made a record of a second ago look older than the grace period, and the GPUs were
    /// published while the device plugin registered again. Otherwise (another boot, an earlier version's record) on
    /// the wall clock ([`served_ago`]).
    fn ago(&self, wall: SystemTime, boot_id: &str, boot_millis: Option<u64>) -> Option<Duration> {
        match (&self.boot_id, self.boot_millis, boot_millis) {
            (Some(then_boot), Some(then), Some(now)) if !boot_id.is_empty() && then_boot == boot_id => {
                Some(Duration::from_millis(now.saturating_sub(then)))
            }
            _ => served_ago(wall, self.last_served_millis),
        }
    }
}

/// Milliseconds since the machine booted, suspend included (`/proc/uptime`, the kernel's boot clock); `None` when
/// unreadable.
fn boot_clock_millis() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/uptime").ok()?;
    let seconds: f64 = text.split_whitespace().next()?.parse().ok()?;
    (seconds.is_finite() && seconds >= 0.0).then_some((seconds * 1000.0) as u64)
}

/// How long before `now` the record's `lastServedMillis` was. A time after `now` (the clock stepped back since it
/// was written: NTP correcting a fast clock, a reboot with a real-time clock behind) counts as just now, so the GPUs
/// are held back the whole grace period; read as "not remembered", they would be published while the device plugin
/// registers again, both handing out the same GPUs. `None` beyond a day ahead: a record written under a clock that
/// wrong would hold the GPUs back at every start until that day.
fn served_ago(now: SystemTime, served_millis: u64) -> Option<Duration> {
    match now.duration_since(SystemTime::UNIX_EPOCH + Duration::from_millis(served_millis)) {
        Ok(ago) => Some(ago),
        Err(ahead) => (ahead.duration() <= Duration::from_secs(24 * 3600)).then_some(Duration::ZERO),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn a_record_from_the_future_counts_as_just_now() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(served_ago(now, 999_990_000), Some(Duration::from_secs(10)));
        assert_eq!(served_ago(now, 1_000_000_000), Some(Duration::ZERO));
        assert_eq!(served_ago(now, 1_000_600_000), Some(Duration::ZERO), "ten minutes ahead");
        assert_eq!(served_ago(now, 1_090_000_000), None, "a day and more ahead");
    }

    /// Within the boot that wrote it a record is read on the boot clock: the wall clock stepped an hour forward
    /// (or back) since changes nothing. Another boot's, or one of an earlier version, is read on the wall clock.
    #[test]
    fn a_record_of_this_boot_is_read_on_the_boot_clock() {
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let of_boot = |boot: Option<&str>, boot_millis: Option<u64>| Served {
            last_served_millis: 1_000_000_000 - 3_600_000 - 5_000,
            boot_id: boot.map(str::to_string),
            boot_millis,
        };
        let this = of_boot(Some("boot-1"), Some(60_000));
        assert_eq!(this.ago(wall, "boot-1", Some(65_000)), Some(Duration::from_secs(5)), "a wall step forward");
        assert_eq!(this.ago(wall, "boot-1", Some(59_000)), Some(Duration::ZERO), "a boot clock never runs back");
        let wall_ago = Some(Duration::from_secs(3_605));
        assert_eq!(this.ago(wall, "boot-2", Some(65_000)), wall_ago, "after a reboot");
        assert_eq!(this.ago(wall, "", Some(65_000)), wall_ago, "this boot unknown");
        assert_eq!(this.ago(wall, "boot-1", None), wall_ago, "no boot clock now");
        assert_eq!(of_boot(None, None).ago(wall, "boot-1", Some(65_000)), wall_ago, "an earlier version's record");
        let earlier: Served = serde_json::from_str(r#"{"lastServedMillis": 5}"#).expect("an earlier record");
        assert_eq!(earlier, Served { last_served_millis: 5, boot_id: None, boot_millis: None });
        assert!(boot_clock_millis().is_some(), "/proc/uptime");
    }

    #[test]
    fn the_resources_a_device_plugin_serves_gpus_as_are_read_from_the_node() {
        let defaults: Vec<String> = DEFAULT_RESOURCES.split(',').map(String::from).collect();
        let renamed = vec!["nvidia.com/a100".to_string()];
        type Pairs = &'static [(&'static str, &'static str)];
        let cases: &[(Pairs, &[String], &[&str])] = &[
            (&[], &defaults, &[]),
            (&[("cpu", "8"), ("memory", "32Gi")], &defaults, &[]),
            (&[("nvidia.com/gpu", "8")], &defaults, &["nvidia.com/gpu=8"]),
            // Disconnected, restarting, or removed for good: nothing allocatable.
            (&[("nvidia.com/gpu", "0")], &defaults, &[]),
            (&[("nvidia.com/gpu.shared", "40")], &defaults, &["nvidia.com/gpu.shared=40"]),
            (
                &[("nvidia.com/mig-1g.10gb", "7"), ("nvidia.com/mig-3g.40gb", "0"), ("example.com/fpga", "2")],
                &defaults,
                &["nvidia.com/mig-1g.10gb=7"],
            ),
            // Look-alikes of other vendors and of NVIDIA's network operator are no GPU plugin.
            (&[("nvidia.com/gpumem", "80"), ("amd.com/gpu", "2"), ("nvidia.com/hostdev", "4")], &defaults, &[]),
            // A plugin configured to rename its resource, named by --device-plugin-resources.
            (&[("nvidia.com/a100", "4")], &defaults, &[]),
            (&[("nvidia.com/a100", "4")], &renamed, &["nvidia.com/a100=4"]),
            // Not a whole number: counted rather than ignored.
            (&[("nvidia.com/gpu", "1k")], &defaults, &["nvidia.com/gpu=1k"]),
        ];
        for (allocatable, patterns, serving) in cases {
            let map = allocatable.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect();
            // Capacity alone (a disconnected plugin's, kept for the kubelet's grace period) is not serving.
            let status = NodeStatus {
                allocatable: Some(map),
                capacity: Some(BTreeMap::from([("nvidia.com/gpu".to_string(), Quantity("8".into()))])),
                ..Default::default()
            };
            assert_eq!(observe(Some(&status), patterns).serving, *serving, "{allocatable:?}");
        }
        assert_eq!(observe(None, &defaults), Observed::default());
    }

    #[test]
    fn the_gpus_come_back_only_after_a_grace_period_without_a_plugin() {
        let grace = Duration::from_secs(300);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let serving = Observed { serving: vec!["nvidia.com/gpu=8".into()] };
        let none = Observed::default();

        // No plugin: nothing held back, nothing said.
        assert_eq!(decide(Verdict::default(), &none, None, at(0), grace), (Verdict::default(), None));
        // A plugin appears: refused at once.
        let (v, change) = decide(Verdict::default(), &serving, None, at(10), grace);
        assert_eq!((v.refusing, change), (true, Some(Change::Refused)));
        // It restarts (nothing allocatable) and comes back within the grace period: held back throughout, nothing
        // said.
        let (v, change) = decide(v, &none, None, at(20), grace);
        assert_eq!((v.refusing, change), (true, None));
        let (v, change) = decide(v, &serving, None, at(200), grace);
        assert_eq!((v.refusing, change, v.last_served), (true, None, Some(at(200))));
        // Gone: held back until the grace period has passed since it last served.
        let (v, change) = decide(v, &none, None, at(201), grace);
        assert_eq!((v.refusing, change), (true, None));
        let (v, change) = decide(v, &none, None, at(499), grace);
        assert_eq!((v.refusing, change), (true, None));
        let (v, change) = decide(v, &none, None, at(500), grace);
        assert_eq!((v, change), (Verdict::default(), Some(Change::Released)));

        // An agent restarted a minute after a plugin last served (the node rebooting, the plugin not registered
        // again yet) holds back for the rest of the grace period.
        let (v, change) = decide(Verdict::default(), &none, Some(at(0)), at(60), grace);
        assert_eq!((v.refusing, change, v.last_served), (true, Some(Change::Refused), Some(at(0))));
        let (v, change) = decide(v, &none, None, at(300), grace);
        assert_eq!((v, change), (Verdict::default(), Some(Change::Released)));
        // A record older than that: nothing held back.
        assert_eq!(decide(Verdict::default(), &none, Some(at(0)), at(300), grace), (Verdict::default(), None));
    }
}
