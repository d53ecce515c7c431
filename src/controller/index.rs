//! Secondary indexes over informer caches: "which objects carry index key X".
//!
//! Informer handlers keep them current from watch events; a re-list (watcher `Init` … `InitDone`) builds a fresh
//! index beside the live one and swaps it in at the end, so lookups never see a half-built index and objects
//! deleted while the watch was down do not linger.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, PoisonError};

use kube::runtime::watcher;
use kube::{Resource, ResourceExt};

use super::queue::ObjectKey;

#[derive(Default)]
struct Maps {
    by_index_key: HashMap<String, BTreeSet<ObjectKey>>,
    by_object: HashMap<ObjectKey, Vec<String>>,
}

impl Maps {
    fn remove(&mut self, object: &ObjectKey) {
        for key in self.by_object.remove(object).unwrap_or_default() {
            if let Some(set) = self.by_index_key.get_mut(&key) {
                set.remove(object);
                if set.is_empty() {
                    self.by_index_key.remove(&key);
                }
            }
        }
    }

    fn insert(&mut self, object: ObjectKey, keys: Vec<String>) {
        self.remove(&object);
        for key in &keys {
            self.by_index_key.entry(key.clone()).or_default().insert(object.clone());
        }
        if !keys.is_empty() {
            self.by_object.insert(object, keys);
        }
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

    /// Applies one watch event, exactly as the reflector applies it to the store.
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

    /// The objects indexed under `key`.
    pub fn get(&self, key: &str) -> Vec<ObjectKey> {
        self.lock().live.by_index_key.get(key).map(|set| set.iter().cloned().collect()).unwrap_or_default()
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
}
