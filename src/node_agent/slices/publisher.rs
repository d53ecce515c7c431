//! Makes the API server hold exactly this node's devices: one pool named after the node, slices owned by the
//! Node object, a new pool generation whenever the content changes (the scheduler ignores older generations),
//! obsolete slices deleted with UID and resourceVersion preconditions.
//!
//! Idempotent: each slice carries a hash of its devices, so publishing what is already there writes nothing.
//! A slice someone else changed (a taint removed with `kubectl edit`) gets this agent's content back.
//! A device field the API server did not store (its feature gate off) is reported ([`super::dropped`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tracing::{info, warn};

use super::SliceContent;
use super::dropped::{DroppedField, dropped_fields};

/// Annotation holding the hash of a slice's devices.
pub const DEVICES_HASH_ANNOTATION: &str = "gpu-dra.dev/devices-hash";

/// Errors while publishing.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("node {node} not found: is --node-name (NODE_NAME) this node's name?")]
    NodeNotFound { node: String },
    #[error("get node {node}: {source}")]
    GetNode {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("list the ResourceSlices of node {node}: {source}")]
    ListSlices {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("create a ResourceSlice for node {node}: {source}")]
    CreateSlice {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("update ResourceSlice {slice}: {source}")]
    UpdateSlice {
        slice: String,
        #[source]
        source: kube::Error,
    },
    #[error("delete obsolete ResourceSlice {slice}: {source}")]
    DeleteSlice {
        slice: String,
        #[source]
        source: kube::Error,
    },
    #[error("encode a ResourceSlice: {0}")]
    Encode(#[source] serde_json::Error),
}

/// Publishes one node's pool.
#[derive(Clone)]
pub struct Publisher {
    client: Client,
    driver: String,
    node: String,
    /// The last generation published: after all slices were deleted, the next must still be newer.
    last_generation: Arc<AtomicI64>,
    /// Whether an unchanged pool was checked for fields the API server dropped ([`super::dropped`]): once per
    /// agent start, so that a gate turned on since is picked up by restarting the agents, without rewriting the
    /// pool every resync where the gate stays off.
    checked_dropped: Arc<AtomicBool>,
    /// Whether the API server dropped the devices' `consumesCounters` (DRAPartitionableDevices off): dynamic MIG
    /// cannot work, and the agent publishes MIG devices as they exist instead.
    counters_dropped: Arc<AtomicBool>,
    /// Whether the API server was seen to keep the devices' `consumesCounters` (a dry-run create, once per agent
    /// start, before the first pool with counters is written).
    counters_kept: Arc<AtomicBool>,
    /// Whether the API server refused the last in-place update (403: a ClusterRole without `update` on
    /// resourceslices, such as an older chart's beside a newer image): each such change is published as a new
    /// generation instead, as before in-place updates; the refusal is logged once until an update is allowed again.
    update_refused: Arc<AtomicBool>,
    /// The resource version at which this agent last wrote or checked each of its slices, by UID. A slice listed
    /// at another one was changed by someone else, or not checked since this agent started: its content is written
    /// again (see [`Publisher::restore_edited`]).
    checked: Arc<Mutex<HashMap<String, String>>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").field("driver", &self.driver).field("node", &self.node).finish()
    }
}

/// What a publish did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Unchanged,
    Published { generation: i64, slices: usize },
}

impl Publisher {
    pub fn new(client: Client, driver: impl Into<String>, node: impl Into<String>) -> Self {
        Self {
            client,
            driver: driver.into(),
            node: node.into(),
            last_generation: Arc::default(),
            checked_dropped: Arc::default(),
            update_refused: Arc::default(),
            counters_dropped: Arc::default(),
            counters_kept: Arc::default(),
            checked: Arc::default(),
        }
    }

    /// Whether a publish found the devices' `consumesCounters` dropped by the API server (see
    /// [`DroppedField::ConsumesCounters`]); stays set for the agent's life.
    pub fn counters_dropped(&self) -> bool {
        self.counters_dropped.load(Ordering::Relaxed)
    }

    fn api(&self) -> Api<ResourceSlice> {
        Api::all(self.client.clone())
    }

    /// This node's slices of this driver.
    async fn list_own(&self) -> Result<Vec<ResourceSlice>, PublishError> {
        let params = ListParams::default().fields(&self.field_selector());
        let list = self.api().list(&params).await;
        Ok(list.map_err(|source| PublishError::ListSlices { node: self.node.clone(), source })?.items)
    }

    /// The field selector for this node's slices of this driver.
    pub fn field_selector(&self) -> String {
        format!("spec.nodeName={},spec.driver={}", self.node, self.driver)
    }

    /// The taints of this node's published devices, by the UUID of the GPU each device is (or is part of: a MIG
    /// device's `parentUUID`), as the API serves them: what the devices were last published with, for the health
    /// monitor to read its faults back from when its own record is lost. Devices without taints are left out.
    pub async fn published_taints(&self) -> Result<Vec<(String, Vec<Value>)>, PublishError> {
        let devices = self.list_own().await?.into_iter().flat_map(|slice| slice.spec.devices.unwrap_or_default());
        Ok(devices
            .filter_map(|device| {
                let attributes = device.attributes.unwrap_or_default();
                let gpu = ["parentUUID", "uuid"].iter().find_map(|name| attributes.get(*name)?.string.clone())?;
                let taints: Vec<Value> =
                    device.taints.unwrap_or_default().iter().filter_map(|t| serde_json::to_value(t).ok()).collect();
                (!taints.is_empty()).then_some((gpu, taints))
            })
            .collect())
    }

    /// Publishes `slices` (from [`super::pool_slices`]) as the node's pool.
    pub async fn publish(&self, slices: &[SliceContent]) -> Result<Outcome, PublishError> {
        let existing = self.list_own().await?;
        if let Ok(mut checked) = self.checked.lock() {
            checked.retain(|uid, _| existing.iter().any(|s| s.metadata.uid.as_ref() == Some(uid)));
        }
        let hashes: Vec<String> = slices.iter().map(content_hash).collect();
        let generation = existing.iter().map(|s| s.spec.pool.generation).max().unwrap_or(0);
        let current: Vec<&ResourceSlice> =
            existing.iter().filter(|s| s.spec.pool.name == self.node && s.spec.pool.generation == generation).collect();
        let mut current_hashes: Vec<String> =
            current.iter().filter_map(|s| s.annotations().get(DEVICES_HASH_ANNOTATION).cloned()).collect();
        current_hashes.sort();
        let mut wanted = hashes.clone();
        wanted.sort();
        let counts_right = current.iter().all(|s| s.spec.pool.resource_slice_count == slices.len() as i64);
        if existing.len() == slices.len() && current_hashes == wanted && counts_right {
            let lacking =
                !self.checked_dropped.swap(true, Ordering::Relaxed) && stored_lack_fields(slices, &hashes, &current);
            if !lacking {
                // A failure is the next round's to retry: the pool is as wanted, as far as the publish goes.
                if let Err(error) = self.restore_edited(slices, &hashes, &current).await {
                    warn!(node = %self.node, %error, "writing back a ResourceSlice someone else changed failed");
                }
                return Ok(Outcome::Unchanged);
            }
            info!(node = %self.node, "the stored slices lack fields this agent publishes (written while a feature gate \
                  was off): publishing them again once");
        }

        // A pool stored without fields this agent sends (a gate off) is written whole once, as above, not in part.
        let lacking = !self.checked_dropped.load(Ordering::Relaxed) && stored_lack_fields(slices, &hashes, &current);
        if counts_right
            && !lacking
            && let Some(outcome) = self.update_in_place(slices, &hashes, &existing, generation).await?
        {
            return Ok(outcome);
        }

        // Slices of older generations that a refused delete left (an admission policy, a verb missing): deleted
        // first, as upstream's resourceslice controller does, and nothing created while they stay, or every retry
        // would add a whole generation beside them.
        for old in existing.iter().filter(|s| s.spec.pool.generation < generation) {
            self.delete_slice(old).await?;
        }
        let node_uid = self.node_uid().await?;
        let generation = generation.max(self.last_generation.load(Ordering::Relaxed)) + 1;
        let slice = |content: &SliceContent, hash: &str| -> Result<ResourceSlice, PublishError> {
            serde_json::from_value(json!({
                "metadata": {
                    "generateName": generate_name(&self.node, &self.driver),
                    "annotations": {DEVICES_HASH_ANNOTATION: hash},
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node_uid, "controller": true}]
                },
                "spec": self.spec(content, generation, slices.len())
            }))
            .map_err(PublishError::Encode)
        };
        // Devices that consume counters, stored without them (DRAPartitionableDevices off), are a GPU's overlapping
        // MIG partitions offered as independent devices: a complete pool of them, even for the moment before the
        // agent switches to the MIG devices that exist, lets the scheduler allocate two that cannot both be made.
        // So before the first such pool is written, the API server is asked what it would store.
        let consuming = slices.iter().zip(&hashes).find(|(content, _)| consumes_counters(content.devices()));
        if let Some((content, hash)) = consuming
            && !self.counters_kept.load(Ordering::Relaxed)
        {
            let dry_run = PostParams { dry_run: true, ..Default::default() };
            let would_store = match self.api().create(&dry_run, &slice(content, hash)?).await {
                Ok(would_store) => would_store,
                // An API server whose partitionable-devices validation predates this layout (1.34 with the alpha
                // gate on wants the counter sets in the slices that consume them, and at most 32 counters a
                // slice): no pool of partitions can be stored, and insisting would leave the node's whole pool,
                // its GPUs outside MIG too, unpublished for good. The MIG devices that exist are published instead.
                Err(kube::Error::Api(status)) if refuses_counter_layout(status.code, &status.message) => {
                    self.counters_dropped.store(true, Ordering::Relaxed);
                    warn!(
                        node = %self.node,
                        reason = %status.message,
                        "the API server refuses the dynamic MIG layout's slices (Kubernetes 1.35 and later take them \
                         with DRAPartitionableDevices on): publishing the MIG devices that exist (static) until the \
                         agent restarts, as with the gate off"
                    );
                    return Ok(Outcome::Unchanged);
                }
                Err(source) => return Err(PublishError::CreateSlice { node: self.node.clone(), source }),
            };
            let dropped = dropped_fields(content.devices(), &would_store);
            if dropped.contains(&DroppedField::ConsumesCounters) {
                self.counters_dropped.store(true, Ordering::Relaxed);
                self.warn_dropped(&dropped, "(dry run)");
                return Ok(Outcome::Unchanged);
            }
            self.counters_kept.store(true, Ordering::Relaxed);
        }
        for (content, hash) in slices.iter().zip(&hashes) {
            let stored = match self.api().create(&PostParams::default(), &slice(content, hash)?).await {
                Ok(stored) => {
                    self.remember(&stored);
                    stored
                }
                Err(source) => {
                    self.remove_generation(generation).await;
                    return Err(PublishError::CreateSlice { node: self.node.clone(), source });
                }
            };
            let dropped = dropped_fields(content.devices(), &stored);
            if dropped.contains(&DroppedField::ConsumesCounters) {
                // Checked by the dry run; a gate turned off since (an API server restarted meanwhile): the
                // generation is taken back before it is complete.
                self.counters_dropped.store(true, Ordering::Relaxed);
                self.warn_dropped(&dropped, &stored.name_any());
                self.remove_generation(generation).await;
                self.last_generation.store(generation, Ordering::Relaxed);
                return Ok(Outcome::Unchanged);
            }
            self.warn_dropped(&dropped, &stored.name_any());
        }
        for old in &existing {
            self.delete_slice(old).await?;
        }
        self.last_generation.store(generation, Ordering::Relaxed);
        // Just written and checked (the warnings above): the pool counts as checked for dropped fields.
        self.checked_dropped.store(true, Ordering::Relaxed);
        let devices: usize = slices.iter().map(|s| s.devices().len()).sum();
        info!(node = %self.node, generation, slices = slices.len(), devices, "published ResourceSlices");
        Ok(Outcome::Published { generation, slices: slices.len() })
    }

    /// Deletes `old` as listed (its UID and resource version); one gone already, or changed meanwhile, is left to
    /// the next publish.
    async fn delete_slice(&self, old: &ResourceSlice) -> Result<(), PublishError> {
        let name = old.name_any();
        let params = DeleteParams {
            preconditions: Some(Preconditions { uid: old.uid(), resource_version: old.resource_version() }),
            ..Default::default()
        };
        match self.api().delete(&name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(()),
            Err(source) => Err(PublishError::DeleteSlice { slice: name, source }),
        }
    }

    /// When one slice of a complete pool changed (a GPU's taint in a pool of several slices: dynamic MIG), updates
    /// it in place and keeps the generation, as upstream's resourceslice controller does when at most one update is
    /// needed. A new generation would be incomplete until all its slices are created, and the scheduler allocates
    /// nothing from an incomplete pool ("resource pool … is currently being updated"): every GPU of the node would be
    /// out of reach for those round trips. `None`: not such a change (or the slice changed meanwhile): the caller
    /// publishes a new generation.
    async fn update_in_place(
        &self,
        slices: &[SliceContent],
        hashes: &[String],
        existing: &[ResourceSlice],
        generation: i64,
    ) -> Result<Option<Outcome>, PublishError> {
        if existing.len() != slices.len() || existing.iter().any(|s| s.spec.pool.generation != generation) {
            return Ok(None);
        }
        let Some((index, old)) = one_changed(hashes, existing) else { return Ok(None) };
        let content = &slices[index];
        // A slice of counters stays one, a slice of devices too.
        if old.spec.shared_counters.is_some() != matches!(content, SliceContent::Counters(_)) {
            return Ok(None);
        }
        let name = old.name_any();
        let stored = match self.rewrite(old, content, &hashes[index], slices.len()).await? {
            Rewritten::Stored(stored) => stored,
            Rewritten::Changed => return Ok(None),
            Rewritten::Refused(reason) => {
                // Creating and deleting are allowed (they are how the pool was written): the change still reaches
                // the scheduler, as a new generation, and the operator learns what to grant.
                let meaning =
                    "publishing each change as a new generation, during which the node's GPUs cannot be allocated";
                self.say_update_refused(&name, &reason, meaning);
                return Ok(None);
            }
        };
        let dropped = dropped_fields(content.devices(), &stored);
        if dropped.contains(&DroppedField::ConsumesCounters) {
            self.counters_dropped.store(true, Ordering::Relaxed);
        }
        self.warn_dropped(&dropped, &name);
        // The rest was stored as sent (checked just before): the pool counts as checked for dropped fields.
        self.checked_dropped.store(true, Ordering::Relaxed);
        info!(node = %self.node, generation, slice = %name, devices = content.devices().len(),
              "updated one ResourceSlice in place");
        Ok(Some(Outcome::Published { generation, slices: slices.len() }))
    }

    /// Writes this agent's content again into each slice of `current` (the complete pool, each slice's content
    /// hash one of `hashes`) listed at a resource version this agent did not write or check: someone changed it
    /// (a taint removed with `kubectl edit`, a device's attributes), or it was written before this agent started.
    /// Upstream's resourceslice controller compares each slice with what it wants and updates one that differs;
    /// here the API server compares: an update that changes nothing is not stored and keeps the resource version,
    /// so a field it defaulted or dropped (a gate off) does not pass for someone's edit, and a restart writes
    /// nothing. A slice changed again meanwhile is left to the round its watch event starts.
    async fn restore_edited(
        &self,
        slices: &[SliceContent],
        hashes: &[String],
        current: &[&ResourceSlice],
    ) -> Result<(), PublishError> {
        for stored in current {
            let (Some(uid), Some(version)) = (stored.uid(), stored.resource_version()) else { continue };
            if self.checked.lock().is_ok_and(|checked| checked.get(&uid) == Some(&version)) {
                continue;
            }
            let hash = stored.annotations().get(DEVICES_HASH_ANNOTATION);
            let Some(index) = hashes.iter().position(|wanted| Some(wanted) == hash) else { continue };
            let name = stored.name_any();
            match self.rewrite(stored, &slices[index], &hashes[index], slices.len()).await? {
                Rewritten::Stored(written) if written.resource_version().as_ref() != Some(&version) => {
                    warn!(node = %self.node, slice = %name, "a ResourceSlice of this node was changed by someone \
                          else: its devices are published as they are again");
                }
                Rewritten::Stored(_) | Rewritten::Changed => {}
                Rewritten::Refused(reason) => {
                    // Not asked again until the slice changes: every round would be refused alike.
                    self.remember(stored);
                    self.say_update_refused(&name, &reason, "a slice someone else changed keeps their change");
                }
            }
        }
        Ok(())
    }

    /// Updates `old` to hold `content` (its hash `hash`, in a pool of `count` slices), keeping its generation and
    /// metadata. The update carries the resource version listed: a slice changed or deleted meanwhile is not
    /// overwritten ([`Rewritten::Changed`]).
    async fn rewrite(
        &self,
        old: &ResourceSlice,
        content: &SliceContent,
        hash: &str,
        count: usize,
    ) -> Result<Rewritten, PublishError> {
        let mut slice = serde_json::to_value(old).map_err(PublishError::Encode)?;
        slice["metadata"]["annotations"][DEVICES_HASH_ANNOTATION] = json!(hash);
        slice["spec"] = self.spec(content, old.spec.pool.generation, count);
        let slice: ResourceSlice = serde_json::from_value(slice).map_err(PublishError::Encode)?;
        let name = old.name_any();
        match self.api().replace(&name, &PostParams::default(), &slice).await {
            Ok(stored) => {
                if self.update_refused.swap(false, Ordering::Relaxed) {
                    info!(node = %self.node, "ResourceSlices may be updated in place again");
                }
                self.remember(&stored);
                Ok(Rewritten::Stored(Box::new(stored)))
            }
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(Rewritten::Changed),
            Err(kube::Error::Api(status)) if status.code == 403 => Ok(Rewritten::Refused(status.message)),
            Err(source) => Err(PublishError::UpdateSlice { slice: name, source }),
        }
    }

    /// Says once, until an update is allowed again, that updates of the node's slices are refused, and `meaning`
    /// what that does.
    fn say_update_refused(&self, slice: &str, reason: &str, meaning: &str) {
        if !self.update_refused.swap(true, Ordering::Relaxed) {
            warn!(node = %self.node, slice, reason, "may not update ResourceSlices in place (grant the verb update \
                  on resource.k8s.io resourceslices to the agent's ServiceAccount; the chart does): {meaning}");
        }
    }

    /// Records `slice` as this agent wrote or checked it.
    fn remember(&self, slice: &ResourceSlice) {
        if let (Some(uid), Some(version), Ok(mut checked)) =
            (slice.uid(), slice.resource_version(), self.checked.lock())
        {
            checked.insert(uid, version);
        }
    }

    /// The spec of a slice of this node's pool holding `content`, in generation `generation` of `count` slices.
    fn spec(&self, content: &SliceContent, generation: i64, count: usize) -> Value {
        json!({
            "driver": self.driver,
            "nodeName": self.node,
            "pool": {"name": self.node, "generation": generation, "resourceSliceCount": count},
            content.field(): content.items()
        })
    }

    /// Says which of the devices' fields the API server dropped from `slice` (a name, or that it was a dry run).
    fn warn_dropped(&self, dropped: &[DroppedField], slice: &str) {
        for field in dropped {
            warn!(
                node = %self.node,
                slice,
                gate = field.feature_gate(),
                "the API server dropped the devices' {} (feature gate {} off): {}",
                field.field(),
                field.feature_gate(),
                field.consequence()
            );
        }
    }

    /// After a create of `generation` failed: removes the slices of it that were made (also one whose answer was
    /// lost), so that the pool stays the complete one before. Left in place, the scheduler would take the newer,
    /// incomplete generation for the pool and allocate none of the node's GPUs until a later round completed one.
    /// Best effort: what is left, the next round finds and deletes with the old generation.
    async fn remove_generation(&self, generation: i64) {
        let slices = match self.list_own().await {
            Ok(slices) => slices,
            Err(error) => {
                warn!(node = %self.node, generation, %error, "listing the slices of a failed publish failed");
                return;
            }
        };
        for slice in slices.iter().filter(|s| s.spec.pool.name == self.node && s.spec.pool.generation == generation) {
            let params = DeleteParams {
                preconditions: Some(Preconditions { uid: slice.uid(), resource_version: None }),
                ..Default::default()
            };
            match self.api().delete(&slice.name_any(), &params).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
                Err(error) => warn!(node = %self.node, slice = %slice.name_any(), %error,
                                    "removing a slice of a failed publish failed"),
            }
        }
    }

    async fn node_uid(&self) -> Result<String, PublishError> {
        let node = Api::<Node>::all(self.client.clone())
            .get_opt(&self.node)
            .await
            .map_err(|source| PublishError::GetNode { node: self.node.clone(), source })?
            .ok_or_else(|| PublishError::NodeNotFound { node: self.node.clone() })?;
        Ok(node.uid().unwrap_or_default())
    }
}

/// What an update of one slice came to.
enum Rewritten {
    /// Stored as this: the new resource version, or the one before where nothing changed.
    Stored(Box<ResourceSlice>),
    /// Changed or deleted since it was listed: not overwritten.
    Changed,
    /// The API server refused the update (403), for this reason.
    Refused(String),
}

/// Whether some stored slice of `current` lacks a field its devices (in `slices`, matched by their content hash in
/// `hashes`) were sent with.
fn stored_lack_fields(slices: &[SliceContent], hashes: &[String], current: &[&ResourceSlice]) -> bool {
    slices.iter().zip(hashes).any(|(content, hash)| {
        current
            .iter()
            .filter(|s| s.annotations().get(DEVICES_HASH_ANNOTATION) == Some(hash))
            .any(|stored| !dropped_fields(content.devices(), stored).is_empty())
    })
}

/// The one wanted slice (its index in `hashes`) whose content no slice of `existing` has, and the one slice of
/// `existing` whose content is not wanted, when exactly one of each: every other content stored once.
fn one_changed<'a>(hashes: &[String], existing: &'a [ResourceSlice]) -> Option<(usize, &'a ResourceSlice)> {
    let mut unmatched: Vec<&ResourceSlice> = existing.iter().collect();
    let mut missing = Vec::new();
    for (index, hash) in hashes.iter().enumerate() {
        match unmatched.iter().position(|s| s.annotations().get(DEVICES_HASH_ANNOTATION) == Some(hash)) {
            Some(found) => {
                unmatched.swap_remove(found);
            }
            None => missing.push(index),
        }
    }
    match (missing.as_slice(), unmatched.as_slice()) {
        ([index], [old]) => Some((*index, *old)),
        _ => None,
    }
}

/// Whether some of `devices` (as sent) consume counters.
fn consumes_counters(devices: &[Value]) -> bool {
    devices.iter().any(|device| device.get("consumesCounters").is_some())
}

/// The `generateName` of this node's slices, `<node>-<driver>-`, cut to the 58 characters of it the API server keeps
/// (a longer one is cut there anyway): a node name of more than 236 characters would otherwise make one longer than
/// the 253 the API server takes, and every slice of the node was refused. A cut never leaves a dot last, which the
/// API server refuses in a name's prefix.
fn generate_name(node: &str, driver: &str) -> String {
    const KEPT: usize = 58;
    let mut name = format!("{node}-{driver}-");
    name.truncate(name.floor_char_boundary(KEPT));
    name.trim_end_matches('.').to_string()
}

/// A stable hash of a slice's content: of its device list as before counter slices existed (a pool published by
/// an older agent is not rewritten for nothing), of the field and its items for a counter slice.
fn content_hash(content: &SliceContent) -> String {
    match content {
        SliceContent::Devices(devices) => devices_hash(devices),
        SliceContent::Counters(sets) => devices_hash(&[json!({content.field(): sets})]),
    }
}

/// A stable hash of a device list (over its JSON, which serde_json writes with sorted keys).
fn devices_hash(devices: &[Value]) -> String {
    let text = Value::Array(devices.to_vec()).to_string();
    format!("{:016x}", crate::node_agent::gpu::stable_hash(text.as_bytes()))
}

/// Whether a refused create is Kubernetes 1.34's alpha validation of partitionable devices refusing the layout this
/// agent publishes (counter sets in slices of their own, more than 32 counters in one): its two messages. Any other
/// refusal (an admission policy's 422 among them) stays an error, so it is seen rather than silently turned static.
fn refuses_counter_layout(code: u16, message: &str) -> bool {
    code == 422
        && (message.contains("must reference a counterSet defined in the ResourceSlice sharedCounters")
            || message.contains("the total number of shared counters must not exceed"))
}

#[cfg(test)]
mod tests {
    use super::{generate_name, refuses_counter_layout};

    #[test]
    fn a_slice_generate_name_stays_within_what_the_api_server_takes() {
        assert_eq!(generate_name("node-1", "gpu.gpu-dra.dev"), "node-1-gpu.gpu-dra.dev-");
        let long = ["a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61)].join(".");
        assert_eq!(long.len(), 253);
        let name = generate_name(&long, "gpu.gpu-dra.dev");
        assert_eq!(name, "a".repeat(58));
        // Cut just after a dot: the dot goes.
        let dotted = format!("{}.{}", "a".repeat(57), "b".repeat(40));
        assert_eq!(generate_name(&dotted, "gpu.gpu-dra.dev"), "a".repeat(57));
    }

    #[test]
    fn only_the_1_34_layout_refusals_switch_to_static() {
        let dangling = "ResourceSlice.resource.k8s.io \"n-gpu-x\" is invalid: [spec.devices[0].consumesCounters[0].\
                        counterSet: Invalid value: \"gpu-0-counter-set\": must reference a counterSet defined in the \
                        ResourceSlice sharedCounters]";
        let too_many = "spec.sharedCounters: Invalid value: 80: the total number of shared counters must not exceed 32";
        let policy = "resourceslices.resource.k8s.io \"n-gpu-x\" is forbidden: ValidatingAdmissionPolicy 'slices' \
                      with binding 'slices' denied request: failed expression: object.spec.devices.size() < 8";
        assert!(refuses_counter_layout(422, dangling));
        assert!(refuses_counter_layout(422, too_many));
        assert!(!refuses_counter_layout(422, policy), "an admission policy's refusal stays an error");
        assert!(!refuses_counter_layout(403, dangling));
    }
}
