//! Events about the node's GPUs: Warning `GpuFault` (on the Node, naming the claims and pods that hold the GPU, and
//! on each of those pods), Normal `GpuRecovered` (on the Node).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource as _};
use tracing::{debug, warn};

use crate::event_note::{NOTE_LIMIT, fit};
use crate::kubelet_plugin::state::DriverState;

/// At most this many pods of one claim are named in the Node's Event (the rest counted): a claim shared by a Job's
/// hundreds of pods would otherwise fill the note before its own name.
const POD_NAMES_MAX: usize = 5;

/// At most this many pods get an Event of their own per fault (the Node's Event counts them all).
const POD_EVENTS_MAX: usize = 32;
/// The distinct messages whose Events are counted up when repeated ([`NodeEvents::recorder`]).
const RECORDERS_MAX: usize = 64;

/// A claim holding a faulted GPU and the pods it is reserved for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Affected {
    /// `namespace/name`.
    pub claim: String,
    /// `(namespace, name, uid)` of each pod in the claim's `reservedFor`.
    pub pods: Vec<(String, String, String)>,
    /// `namespace/name` of each PodGroup in the claim's `reservedFor` (a gang's shared claim).
    pub groups: Vec<String>,
}

/// `base` followed by the claims and pods a fault affects, cut to the API's note limit (what does not fit is
/// counted, never silently dropped).
pub(super) fn fault_note(base: &str, affected: &[Affected]) -> String {
    if affected.is_empty() {
        return format!("{base}; no claim prepared on this node holds it");
    }
    let items: Vec<String> = affected
        .iter()
        .map(|a| {
            let mut users: Vec<String> = a.groups.iter().map(|group| format!("PodGroup {group}")).collect();
            users.extend(a.pods.iter().take(POD_NAMES_MAX).map(|(ns, name, _)| format!("pod {ns}/{name}")));
            if a.pods.len() > POD_NAMES_MAX {
                users.push(format!("{} more pods", a.pods.len() - POD_NAMES_MAX));
            }
            match users.as_slice() {
                [] => format!("claim {} (no pod reserved)", a.claim),
                _ => format!("claim {} ({})", a.claim, users.join(", ")),
            }
        })
        .collect();
    let mut note = format!("{base}; in use by ");
    for (i, item) in items.iter().enumerate() {
        let rest = items.len() - i;
        let more = if rest > 1 { format!(" … and {} more claims", rest - 1) } else { String::new() };
        let separator = if i == 0 { "" } else { ", " };
        if note.len() + separator.len() + item.len() + more.len() > NOTE_LIMIT {
            if i > 0 {
                note.push_str(&format!(" … and {rest} more claims"));
                break;
            }
            // The first claim is always named, its list of pods cut to leave room for the count of the others.
            let room = NOTE_LIMIT.saturating_sub(note.len() + more.len() + '…'.len_utf8());
            note.push_str(&item[..item.floor_char_boundary(room)]);
            note.push('…');
            note.push_str(&more);
            break;
        }
        note.push_str(separator);
        note.push_str(item);
    }
    fit(note)
}

/// Events about this node, sent in the background so that a slow API server never delays a taint.
#[derive(Clone)]
pub(super) struct NodeEvents {
    /// A recorder per message: kube-runtime's counts an event up under its object, reason and action, sending the
    /// first one's note again, so a fault of gpu-5 after one of gpu-2 would show as gpu-2's, counted twice. Each
    /// distinct message is an Event of its own, as client-go's recorder (`tools/record`) keys them; a repeated one
    /// is counted. Bounded: beyond [`RECORDERS_MAX`] messages the map starts again.
    recorders: Arc<Mutex<HashMap<u64, Recorder>>>,
    client: Client,
    node: String,
    /// The kubelet plugin's prepared claims, once it serves: who holds a faulted GPU.
    holders: Arc<OnceLock<Arc<DriverState>>>,
}

impl NodeEvents {
    pub(super) fn new(client: Client, node: &str, holders: Arc<OnceLock<Arc<DriverState>>>) -> Self {
        Self { recorders: Arc::default(), client, node: node.into(), holders }
    }

    /// The recorder of `event`'s reason and note.
    fn recorder(&self, event: &Event) -> Recorder {
        let key = format!("{}\n{}", event.reason, event.note.as_deref().unwrap_or_default());
        let key = crate::node_agent::gpu::stable_hash(key.as_bytes());
        let mut recorders = self.recorders.lock().unwrap_or_else(PoisonError::into_inner);
        if recorders.len() >= RECORDERS_MAX && !recorders.contains_key(&key) {
            recorders.clear();
        }
        let reporter = || Reporter { controller: "gpu-dra-node-agent".into(), instance: None };
        recorders.entry(key).or_insert_with(|| Recorder::new(self.client.clone(), reporter())).clone()
    }

    pub(super) fn send(&self, type_: EventType, reason: &str, note: String) {
        let this = self.clone();
        let event = event(type_, reason, note);
        tokio::spawn(async move { this.publish_on_node(event).await });
    }

    /// A Warning `GpuFault`: on the Node, `what` (e.g. "gpu-1 (GPU-…) reported XID 79: …") followed by the claims
    /// prepared on `device` and their pods; on each of those pods, the same with the claim that brought the GPU.
    pub(super) fn send_fault(&self, device: String, what: String) {
        let this = self.clone();
        tokio::spawn(async move {
            let affected = this.affected(&device).await;
            let note = fault_note(&what, &affected);
            this.publish_on_node(event(EventType::Warning, "GpuFault", note)).await;
            let pods: Vec<(String, (String, String, String))> = affected
                .into_iter()
                .flat_map(|a| a.pods.into_iter().map(move |pod| (a.claim.clone(), pod)))
                .take(POD_EVENTS_MAX)
                .collect();
            for (claim, (namespace, name, uid)) in pods {
                let note = fit(format!("{what}; allocated to this pod through claim {claim} on node {}", this.node));
                let pod = ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                    uid: Some(uid),
                    ..Default::default()
                };
                let event = event(EventType::Warning, "GpuFault", note);
                if let Err(error) = this.recorder(&event).publish(&event, &pod).await {
                    warn!(%error, pod = %format!("{namespace}/{name}"), "publishing a GPU fault event on a pod failed");
                }
            }
        });
    }

    /// The claims prepared on `device` (read off the async threads: the checkpoint's lock may be held by a prepare
    /// on a slow disk) and the pods each is reserved for (read from the API; a claim that cannot be read is still
    /// named, without pods).
    async fn affected(&self, device: &str) -> Vec<Affected> {
        let Some(state) = self.holders.get().cloned() else { return Vec::new() };
        let device = device.to_owned();
        let held = tokio::task::spawn_blocking(move || state.claims_holding(&device)).await.unwrap_or_default();
        let mut affected = Vec::with_capacity(held.len());
        for (uid, namespace, name) in held {
            let claim = Api::<ResourceClaim>::namespaced(self.client.clone(), &namespace).get_opt(&name).await;
            let reserved = match claim {
                Ok(Some(claim)) if claim.metadata.uid.as_deref() == Some(uid.as_str()) => {
                    claim.status.and_then(|s| s.reserved_for).unwrap_or_default()
                }
                Ok(_) => Vec::new(),
                Err(error) => {
                    debug!(%error, claim = %format!("{namespace}/{name}"), "reading a faulted GPU's claim failed");
                    Vec::new()
                }
            };
            let (mut pods, mut groups) = (Vec::new(), Vec::new());
            for consumer in reserved {
                match (consumer.api_group.as_deref().unwrap_or_default(), consumer.resource.as_str()) {
                    ("", "pods") => pods.push((namespace.clone(), consumer.name, consumer.uid)),
                    ("scheduling.k8s.io", "podgroups") => groups.push(format!("{namespace}/{}", consumer.name)),
                    _ => {}
                }
            }
            affected.push(Affected { claim: format!("{namespace}/{name}"), pods, groups });
        }
        affected
    }

    async fn publish_on_node(&self, event: Event) {
        let reference = match Api::<Node>::all(self.client.clone()).get(&self.node).await {
            Ok(node) => node.object_ref(&()),
            Err(_) => {
                ObjectReference { kind: Some("Node".into()), name: Some(self.node.clone()), ..Default::default() }
            }
        };
        if let Err(error) = self.recorder(&event).publish(&event, &reference).await {
            warn!(%error, reason = %event.reason, "publishing a GPU health event failed");
        }
    }
}

fn event(type_: EventType, reason: &str, note: String) -> Event {
    Event { type_, reason: reason.into(), note: Some(fit(note)), action: "MonitorGpuHealth".into(), secondary: None }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn affected(claim: &str, pods: &[&str]) -> Affected {
        let pods = pods.iter().map(|p| ("ns".to_owned(), (*p).to_owned(), format!("uid-{p}"))).collect();
        Affected { claim: format!("ns/{claim}"), pods, groups: Vec::new() }
    }

    #[test]
    fn the_fault_note_names_claims_and_pods() {
        let cases: &[(&[Affected], &str)] = &[
            (&[], "F; no claim prepared on this node holds it"),
            (&[affected("a", &["p"])], "F; in use by claim ns/a (pod ns/p)"),
            (
                &[affected("a", &["p", "q"]), affected("b", &[])],
                "F; in use by claim ns/a (pod ns/p, pod ns/q), claim ns/b (no pod reserved)",
            ),
            (
                &[Affected { groups: vec!["ns/gang".into()], ..affected("g", &[]) }],
                "F; in use by claim ns/g (PodGroup ns/gang)",
            ),
        ];
        for (given, want) in cases {
            assert_eq!(fault_note("F", given), *want);
        }
    }

    #[test]
    fn a_long_fault_note_fits_the_api_limit_and_counts_what_it_leaves_out() {
        let many: Vec<Affected> = (0..100).map(|i| affected(&format!("claim-{i:03}"), &["pod"])).collect();
        let note = fault_note("F", &many);
        assert!(note.len() <= NOTE_LIMIT, "{} bytes", note.len());
        let named = note.matches("claim ns/").count();
        assert!(note.ends_with(&format!(" … and {} more claims", 100 - named)), "{note}");

        let huge = fault_note(&"x".repeat(2000), &[affected("a", &["p"])]);
        assert!(huge.len() <= NOTE_LIMIT && huge.ends_with('…'), "{} bytes", huge.len());

        // A claim shared by a Job's 200 pods, beside another: both claims named, five of the pods, the rest counted.
        let job: Vec<String> = (0..200).map(|i| format!("worker-with-a-long-generated-name-{i:03}")).collect();
        let job: Vec<&str> = job.iter().map(String::as_str).collect();
        let note = fault_note("F", &[affected("shared", &job), affected("other", &["p"])]);
        assert!(note.len() <= NOTE_LIMIT, "{} bytes", note.len());
        assert!(note.contains("claim ns/shared (pod ns/worker-with-a-long-generated-name-000, "), "{note}");
        assert!(note.contains("195 more pods), claim ns/other (pod ns/p)"), "{note}");

        // A first claim whose five pods' names fill the note: cut, and the other claims still counted.
        let long: Vec<String> = (0..5).map(|i| format!("{i}{}", "p".repeat(250))).collect();
        let long: Vec<&str> = long.iter().map(String::as_str).collect();
        let note = fault_note("F", &[affected("first", &long), affected("second", &["p"]), affected("third", &["p"])]);
        assert!(note.len() <= NOTE_LIMIT && note.starts_with("F; in use by claim ns/first (pod ns/0"), "{note}");
        assert!(note.ends_with("… … and 2 more claims"), "{note}");
    }
}
