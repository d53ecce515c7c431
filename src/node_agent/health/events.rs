//! Events about the node's GPUs (Warning `GpuFault`, Normal `GpuRecovered`), on the Node object.

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource as _};
use tracing::warn;

/// Events about this node, sent in the background so that a slow API server never delays a taint.
#[derive(Clone)]
pub(super) struct NodeEvents {
    recorder: Recorder,
    client: Client,
    node: String,
}

impl NodeEvents {
    pub(super) fn new(client: Client, node: &str) -> Self {
        let recorder =
            Recorder::new(client.clone(), Reporter { controller: "gpu-dra-node-agent".into(), instance: None });
        Self { recorder, client, node: node.into() }
    }

    pub(super) fn send(&self, type_: EventType, reason: &str, note: String) {
        let this = self.clone();
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "MonitorGpuHealth".into(),
            secondary: None,
        };
        tokio::spawn(async move {
            let reference = match Api::<Node>::all(this.client.clone()).get(&this.node).await {
                Ok(node) => node.object_ref(&()),
                Err(_) => {
                    ObjectReference { kind: Some("Node".into()), name: Some(this.node.clone()), ..Default::default() }
                }
            };
            if let Err(error) = this.recorder.publish(&event, &reference).await {
                warn!(%error, reason = %event.reason, "publishing a GPU health event failed");
            }
        });
    }
}
