//! Secondary indexes over informer caches: "which objects carry index key X".
//!
//! Informer handlers keep them current from watch events; a re-list (watcher `Init` … `InitDone`) builds a fresh
//! index beside the live one and swaps it in at the end, so lookups never see a half-built index and objects
//! deleted while the watch was down do not linger.
//!
//! Built for tens of thousands of objects with one or two keys each: a key is stored once (shared by the reverse
//! map), and a key's members are a plain vector until it has many (one template used by 5,000 pods), so the common
//! single-member key costs one small allocation instead of a tree node or a hash table.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use kube::runtime::watcher;
use kube::{Resource, ResourceExt};

use super::queue::ObjectKey;

/// Above this many members a key's members move from a vector (linear removal) to a hash set.
const FEW: usize = 16;

/// The objects under one index key.
enum Members {
    Few(Vec<ObjectKey>),
    Many(HashSet<ObjectKey>),
}

impl Members {
    fn insert(&mut self, object: ObjectKey) {
        match self {
            Members::Few(few) if few.contains(&object) => {}
            Members::Few(few) if few.len() < FEW => few.push(object),
            Members::Few(few) => {
                let mut many: HashSet<ObjectKey> = few.drain(..).collect();
                many.insert(object);
                *self = Members::Many(many);
            }
            Members::Many(many) => {
                many.insert(object);
            }
        }
    }

    /// Removes `object`; true when no member is left.
    fn remove(&mut self, object: &ObjectKey) -> bool {
        match self {
            Members::Few(few) => {
                few.retain(|member| member != object);
                few.is_empty()
            }
            Members::Many(many) => {
                many.remove(object);
                many.is_empty()
            }
        }
    }

    fn sorted(&self) -> Vec<ObjectKey> {
        let mut members: Vec<ObjectKey> = match self {
            Members::Few(few) => few.clone(),
            Members::Many(many) => many.iter().cloned().collect(),
        };
        members.sort();
        members
    }
}

#[derive(Default)]
struct Maps {
    by_index_key: HashMap<Arc<str>, Members>,
    by_object: HashMap<ObjectKey, Box<[Arc<str>]>>,
}

impl Maps {
    fn remove(&mut self, object: &ObjectKey) {
        for key in self.by_object.remove(object).unwrap_or_default() {
            if self.by_index_key.get_mut(&key).is_some_and(|members| members.remove(object)) {
                self.by_index_key.remove(&key);
            }
        }
    }

    fn insert(&mut self, object: ObjectKey, keys: Vec<String>) {
        self.remove(&object);
        if keys.is_empty() {
            return;
        }
        let mut shared = Vec::with_capacity(keys.len());
        for key in keys {
            let key: Arc<str> = match self.by_index_key.get_key_value(key.as_str()) {
                Some((stored, _)) => stored.clone(),
                None => key.into(),
            };
            let members = self.by_index_key.entry(key.clone()).or_insert_with(|| Members::Few(Vec::with_capacity(1)));
            members.insert(object.clone());
            shared.push(key);
        }
        self.by_object.insert(object, shared.into_boxed_slice());
    }
}

#[derive(Default)]
struct State {
    live: Maps,
    relisting: Option<Maps>,
}

/// An index of namespaced objects of type `K` by the keys `index_keys` extracts.
pub struct Index<K> {
    index_keys: fn(&K) -> Vec<String>,
    state: Mutex<State>,
}

impl<K> std::fmt::Debug for Index<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index").finish_non_exhaustive()
    }
}

impl<K: Resource> Index<K> {
    pub fn new(index_keys: fn(&K) -> Vec<String>) -> Self {
        Self { index_keys, state: Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies one watch event, exactly as [`super::store::CacheWriter`] applies it to the store.
    pub fn apply(&self, event: &watcher::Event<K>) {
        let mut state = self.lock();
        match event {
            watcher::Event::Apply(obj) => state.live.insert(object_key(obj), (self.index_keys)(obj)),
            watcher::Event::Delete(obj) => state.live.remove(&object_key(obj)),
            watcher::Event::Init => state.relisting = Some(Maps::default()),
            watcher::Event::InitApply(obj) => {
                let keys = (self.index_keys)(obj);
                state.relisting.get_or_insert_with(Maps::default).insert(object_key(obj), keys);
            }
            watcher::Event::InitDone => {
                if let Some(fresh) = state.relisting.take() {
                    state.live = fresh;
                }
            }
        }
    }

    /// The objects indexed under `key`, sorted.
    pub fn get(&self, key: &str) -> Vec<ObjectKey> {
        self.lock().live.by_index_key.get(key).map(Members::sorted).unwrap_or_default()
    }
}

/// The namespace/name key of an object.
pub fn object_key<K: Resource>(obj: &K) -> ObjectKey {
    ObjectKey::new(obj.namespace().unwrap_or_default(), obj.name_any())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn cm(name: &str, label: &str) -> ConfigMap {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(name.into());
        cm.metadata.namespace = Some("ns".into());
        cm.metadata.labels = Some([("k".to_string(), label.to_string())].into());
        cm
    }

    fn by_label(cm: &ConfigMap) -> Vec<String> {
        cm.labels().get("k").cloned().into_iter().collect()
    }

    #[test]
    fn follows_updates_deletes_and_relists() {
        let index = Index::new(by_label);
        index.apply(&watcher::Event::Apply(cm("a", "x")));
        index.apply(&watcher::Event::Apply(cm("b", "x")));
        assert_eq!(index.get("x").len(), 2);

        index.apply(&watcher::Event::Apply(cm("a", "y")));
        assert_eq!(index.get("x"), vec![ObjectKey::new("ns", "b")]);
        assert_eq!(index.get("y"), vec![ObjectKey::new("ns", "a")]);

        index.apply(&watcher::Event::Delete(cm("a", "y")));
        assert!(index.get("y").is_empty());

        // A re-list that no longer contains "b": the live index answers until InitDone, then forgets "b".
        index.apply(&watcher::Event::Init);
        index.apply(&watcher::Event::InitApply(cm("c", "x")));
        assert_eq!(index.get("x"), vec![ObjectKey::new("ns", "b")]);
        index.apply(&watcher::Event::InitDone);
        assert_eq!(index.get("x"), vec![ObjectKey::new("ns", "c")]);
    }

    #[test]
    fn a_key_shared_by_many_objects_keeps_every_member() {
        let index = Index::new(by_label);
        let names: Vec<String> = (0..3 * FEW).map(|i| format!("cm-{i:03}")).collect();
        for name in &names {
            index.apply(&watcher::Event::Apply(cm(name, "shared")));
            // Re-applying an unchanged object must not add it twice.
            index.apply(&watcher::Event::Apply(cm(name, "shared")));
        }
        let all: Vec<ObjectKey> = names.iter().map(|n| ObjectKey::new("ns", n.as_str())).collect();
        assert_eq!(index.get("shared"), all);

        for name in names.iter().skip(1) {
            index.apply(&watcher::Event::Delete(cm(name, "shared")));
        }
        assert_eq!(index.get("shared"), vec![ObjectKey::new("ns", "cm-000")]);
        index.apply(&watcher::Event::Apply(cm("cm-000", "other")));
        assert!(index.get("shared").is_empty());
        assert_eq!(index.get("other"), vec![ObjectKey::new("ns", "cm-000")]);
    }
}
