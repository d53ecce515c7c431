//! Secondary indexes over informer caches: "which objects carry index key X".
//!
//! Informer handlers keep them current from the store's changes ([`Change`]); a re-list (watcher `Init` …
//! `InitDone`) builds a fresh index beside the live one and swaps it in at the end, so lookups never see a
//! half-built index and objects deleted while the watch was down do not linger.
//!
//! Built for tens of thousands of objects with one or two keys each. Members are the store's own objects
//! (shared, not copied), a key is stored once, and a key's members are a plain vector until it has many (one
//! template used by 5,000 pods). There is no reverse map from object to keys: the keys an object was filed under
//! are recomputed from the object the store replaced or removed ([`Change::previous`]), which is the object this
//! index filed (in the live index, or in the one a relist is building).

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, PoisonError};

use kube::runtime::watcher;

use super::queue::ObjectKey;
use super::store::{Change, Keyed};

/// Above this many members a key's members move from a vector (linear removal) to a hash set.
const FEW: usize = 16;

/// An indexed object, equal to another of the same namespace and name (whatever its version).
struct Member<K>(Arc<K>);

impl<K: Keyed> PartialEq for Member<K> {
    fn eq(&self, other: &Self) -> bool {
        self.0.key() == other.0.key()
    }
}

impl<K: Keyed> Eq for Member<K> {}

impl<K: Keyed> Hash for Member<K> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.key().hash(state);
    }
}

/// The objects under one index key.
enum Members<K> {
    Few(Vec<Arc<K>>),
    Many(HashSet<Member<K>>),
}

impl<K: Keyed> Members<K> {
    /// Adds `object`, replacing a member of the same name.
    fn insert(&mut self, object: &Arc<K>) {
        match self {
            Members::Few(few) => match few.iter().position(|member| member.key() == object.key()) {
                Some(at) => few[at] = object.clone(),
                None if few.len() < FEW => few.push(object.clone()),
                None => {
                    let mut many: HashSet<Member<K>> = few.drain(..).map(Member).collect();
                    many.insert(Member(object.clone()));
                    *self = Members::Many(many);
                }
            },
            Members::Many(many) => {
                many.replace(Member(object.clone()));
            }
        }
    }

    /// Removes the member named as `object`; true when no member is left.
    fn remove(&mut self, object: &Arc<K>) -> bool {
        match self {
            Members::Few(few) => {
                few.retain(|member| member.key() != object.key());
                few.is_empty()
            }
            Members::Many(many) => {
                many.remove(&Member(object.clone()));
                many.is_empty()
            }
        }
    }

    fn sorted(&self) -> Vec<ObjectKey> {
        let mut members: Vec<ObjectKey> = match self {
            Members::Few(few) => few.iter().map(|member| object_key(&**member)).collect(),
            Members::Many(many) => many.iter().map(|member| object_key(&*member.0)).collect(),
        };
        members.sort();
        members
    }
}

struct Maps<K> {
    by_index_key: HashMap<Box<str>, Members<K>>,
}

impl<K> Default for Maps<K> {
    fn default() -> Self {
        Self { by_index_key: HashMap::new() }
    }
}

impl<K: Keyed> Maps<K> {
    fn remove(&mut self, object: &Arc<K>, keys: Vec<String>) {
        for key in keys {
            if self.by_index_key.get_mut(key.as_str()).is_some_and(|members| members.remove(object)) {
                self.by_index_key.remove(key.as_str());
            }
        }
    }

    fn insert(&mut self, object: &Arc<K>, keys: Vec<String>) {
        for key in keys {
            match self.by_index_key.get_mut(key.as_str()) {
                Some(members) => members.insert(object),
                None => {
                    self.by_index_key.insert(key.into(), Members::Few(vec![object.clone()]));
                }
            }
        }
    }
}

struct State<K> {
    live: Maps<K>,
    relisting: Option<Maps<K>>,
}

/// An index of namespaced objects of type `K` by the keys `index_keys` extracts.
pub struct Index<K> {
    index_keys: fn(&K) -> Vec<String>,
    state: Mutex<State<K>>,
}

impl<K> std::fmt::Debug for Index<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index").finish_non_exhaustive()
    }
}

impl<K: Keyed> Index<K> {
    pub fn new(index_keys: fn(&K) -> Vec<String>) -> Self {
        Self { index_keys, state: Mutex::new(State { live: Maps::default(), relisting: None }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<K>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies one change of the store, as the store applied it.
    pub fn apply(&self, change: &Change<K>) {
        let mut state = self.lock();
        match &change.event {
            watcher::Event::Apply(obj) => {
                if let Some(previous) = &change.previous {
                    state.live.remove(previous, (self.index_keys)(previous));
                }
                state.live.insert(obj, (self.index_keys)(obj));
            }
            watcher::Event::Delete(obj) => {
                let filed = change.previous.as_ref().unwrap_or(obj);
                state.live.remove(filed, (self.index_keys)(filed));
            }
            watcher::Event::Init => state.relisting = Some(Maps::default()),
            watcher::Event::InitApply(obj) => {
                let relisting = state.relisting.get_or_insert_with(Maps::default);
                if let Some(previous) = &change.previous {
                    // The same relist showed this object before (a streaming list shows changes as it goes).
                    relisting.remove(previous, (self.index_keys)(previous));
                }
                relisting.insert(obj, (self.index_keys)(obj));
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
pub fn object_key<K: Keyed>(obj: &K) -> ObjectKey {
    let (namespace, name) = obj.key();
    ObjectKey::new(namespace, name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::ResourceExt;

    use super::super::store::CacheWriter;

    /// The store and the index, fed as the informers feed them.
    struct Fed {
        store: CacheWriter<ConfigMap>,
        index: Index<ConfigMap>,
    }

    impl Fed {
        fn new() -> Self {
            Self { store: CacheWriter::new(), index: Index::new(by_label) }
        }

        fn apply(&mut self, event: watcher::Event<ConfigMap>) {
            self.index.apply(&self.store.apply_watcher_event(event));
        }

        fn get(&self, key: &str) -> Vec<ObjectKey> {
            self.index.get(key)
        }
    }

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
        let mut index = Fed::new();
        index.apply(watcher::Event::Apply(cm("a", "x")));
        index.apply(watcher::Event::Apply(cm("b", "x")));
        assert_eq!(index.get("x").len(), 2);

        index.apply(watcher::Event::Apply(cm("a", "y")));
        assert_eq!(index.get("x"), vec![ObjectKey::new("ns", "b")]);
        assert_eq!(index.get("y"), vec![ObjectKey::new("ns", "a")]);

        index.apply(watcher::Event::Delete(cm("a", "y")));
        assert!(index.get("y").is_empty());

        // The index drops the keys it filed an object under, whatever the delete event shows.
        index.apply(watcher::Event::Apply(cm("d", "x")));
        index.apply(watcher::Event::Delete(cm("d", "z")));
        assert_eq!(index.get("x"), vec![ObjectKey::new("ns", "b")]);

        // A re-list that no longer contains "b": the live index answers until InitDone, then forgets "b".
        index.apply(watcher::Event::Init);
        index.apply(watcher::Event::InitApply(cm("c", "x")));
        // A streaming list may show an object twice, changed in between: only its last keys count.
        index.apply(watcher::Event::InitApply(cm("e", "x")));
        index.apply(watcher::Event::InitApply(cm("e", "w")));
        assert_eq!(index.get("x"), vec![ObjectKey::new("ns", "b")]);
        index.apply(watcher::Event::InitDone);
        assert_eq!(index.get("x"), vec![ObjectKey::new("ns", "c")]);
        assert_eq!(index.get("w"), vec![ObjectKey::new("ns", "e")]);
    }

    #[test]
    fn a_key_shared_by_many_objects_keeps_every_member() {
        let mut index = Fed::new();
        let names: Vec<String> = (0..3 * FEW).map(|i| format!("cm-{i:03}")).collect();
        for name in &names {
            index.apply(watcher::Event::Apply(cm(name, "shared")));
            // Re-applying an unchanged object must not add it twice.
            index.apply(watcher::Event::Apply(cm(name, "shared")));
        }
        let all: Vec<ObjectKey> = names.iter().map(|n| ObjectKey::new("ns", n.as_str())).collect();
        assert_eq!(index.get("shared"), all);

        for name in names.iter().skip(1) {
            index.apply(watcher::Event::Delete(cm(name, "shared")));
        }
        assert_eq!(index.get("shared"), vec![ObjectKey::new("ns", "cm-000")]);
        index.apply(watcher::Event::Apply(cm("cm-000", "other")));
        assert!(index.get("shared").is_empty());
        assert_eq!(index.get("other"), vec![ObjectKey::new("ns", "cm-000")]);
    }
}
