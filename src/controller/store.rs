//! The informer caches' store: the objects a watch shows, by namespace and name, fed by its events exactly as
//! kube's reflector feeds its `Store` (a relist fills a buffer that replaces the store once complete), but keyed
//! compactly. kube's store keys every object by an `ObjectRef`, which copies its name, namespace, UID and
//! resourceVersion into four allocations next to the object's own; here an object is filed under its own name (the
//! set's entries are the objects, found by the name they carry), in a set per namespace. With 10,000 pods and
//! 10,000 claims cached that is megabytes of the controller's peak memory.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, PoisonError, RwLock};

use kube::Resource;
use kube::runtime::watcher;
use tokio::sync::watch;

/// Objects by name, per namespace (`""` for cluster-scoped ones).
type Objects<K> = HashMap<Box<str>, HashSet<Named<K>>>;

/// A cached object as a set entry: equal to, and hashed as, its name, so a namespace's set is looked up by a `&str`
/// and holds no copy of the name.
struct Named<K>(Arc<K>);

impl<K: Keyed> Named<K> {
    fn name(&self) -> &str {
        self.0.key().1
    }
}

impl<K: Keyed> Borrow<str> for Named<K> {
    fn borrow(&self) -> &str {
        self.name()
    }
}

impl<K: Keyed> PartialEq for Named<K> {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl<K: Keyed> Eq for Named<K> {}

/// Hashes exactly as the name does (`Borrow` requires it).
impl<K: Keyed> Hash for Named<K> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name().hash(state);
    }
}

/// The writer went away before the first list completed: the informer stopped.
#[derive(Debug, thiserror::Error)]
#[error("the informer stopped before its first list completed")]
pub struct WriterDropped;

/// The read side: cheap to clone, shared by workers and handlers.
pub struct Cache<K> {
    objects: Arc<RwLock<Objects<K>>>,
    ready: watch::Receiver<bool>,
}

impl<K> Clone for Cache<K> {
    fn clone(&self) -> Self {
        Self { objects: self.objects.clone(), ready: self.ready.clone() }
    }
}

impl<K> std::fmt::Debug for Cache<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache").field("len", &self.len()).finish()
    }
}

impl<K: Keyed> Cache<K> {
    /// The object `namespace/name`, as the watch last showed it.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<K>> {
        Some(self.read().get(namespace)?.get(name)?.0.clone())
    }

    /// Every object (a snapshot; the store may change meanwhile).
    pub fn state(&self) -> Vec<Arc<K>> {
        self.read().values().flat_map(HashSet::iter).map(|named| named.0.clone()).collect()
    }
}

impl<K> Cache<K> {
    pub fn len(&self) -> usize {
        self.read().values().map(HashSet::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves once the first list has completed.
    pub async fn wait_until_ready(&self) -> Result<(), WriterDropped> {
        let mut ready = self.ready.clone();
        ready.wait_for(|ready| *ready).await.map(drop).map_err(|_| WriterDropped)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Objects<K>> {
        self.objects.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The write side, owned by the one informer that feeds the store.
pub struct CacheWriter<K> {
    objects: Arc<RwLock<Objects<K>>>,
    /// What a relist has shown so far; replaces the store when it completes.
    relisting: Option<Objects<K>>,
    ready: watch::Sender<bool>,
}

impl<K> std::fmt::Debug for CacheWriter<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheWriter").field("relisting", &self.relisting.is_some()).finish()
    }
}

impl<K: Keyed> Default for CacheWriter<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Keyed> CacheWriter<K> {
    pub fn new() -> Self {
        let (ready, _) = watch::channel(false);
        Self { objects: Arc::default(), relisting: None, ready }
    }

    pub fn as_reader(&self) -> Cache<K> {
        Cache { objects: self.objects.clone(), ready: self.ready.subscribe() }
    }

    /// Applies one watch event, as kube's reflector does: an object shown replaces the one of its name, a relist
    /// (`Init` … `InitApply`… `InitDone`) replaces everything at once when complete, so objects deleted while the
    /// watch was down disappear and readers never see a half-listed store. The object is moved into the store, not
    /// copied: the returned [`Change`] shares it. Unlike kube's reflector, a completed relist also says which objects
    /// it removed and which it holds ([`Change::gone`], [`Change::listed`]), for handlers to act on once the store
    /// shows them.
    pub fn apply_watcher_event(&mut self, event: watcher::Event<K>) -> Change<K> {
        let mut gone = Vec::new();
        let mut listed = Vec::new();
        // A relist after the first (the store serves the old state until it completes).
        let relist = *self.ready.borrow();
        let (event, previous) = match event {
            watcher::Event::Apply(obj) => {
                let obj = Arc::new(obj);
                let previous = insert(&mut self.write(), obj.clone());
                (watcher::Event::Apply(obj), previous)
            }
            watcher::Event::Delete(obj) => {
                let obj = Arc::new(obj);
                let (namespace, name) = obj.key();
                let mut objects = self.write();
                let mut previous = None;
                if let Some(names) = objects.get_mut(namespace) {
                    previous = names.take(name).map(|named| named.0);
                    if names.is_empty() {
                        objects.remove(namespace);
                    }
                }
                drop(objects);
                (watcher::Event::Delete(obj), previous)
            }
            watcher::Event::Init => {
                self.relisting = Some(Objects::new());
                (watcher::Event::Init, None)
            }
            watcher::Event::InitApply(obj) => {
                let obj = Arc::new(obj);
                let previous = insert(self.relisting.get_or_insert_with(Objects::new), obj.clone());
                (watcher::Event::InitApply(obj), previous)
            }
            watcher::Event::InitDone => {
                let complete = self.relisting.take().unwrap_or_default();
                // The old store is dropped after the lock is released.
                let old = std::mem::replace(&mut *self.write(), complete);
                // Only after the first list: a restarted watch's list, not the informer's start.
                if relist {
                    let now = self.objects.read().unwrap_or_else(PoisonError::into_inner);
                    gone = removed_by_relist(&old, &now);
                    listed = now.values().flat_map(HashSet::iter).map(|named| named.0.clone()).collect();
                }
                drop(old);
                self.ready.send_replace(true);
                (watcher::Event::InitDone, None)
            }
        };
        let deferred = relist && matches!(event, watcher::Event::InitApply(_));
        let relisted = relist && matches!(event, watcher::Event::InitDone);
        Change { event, previous, gone, listed, deferred, relisted }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Objects<K>> {
        self.objects.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A watch event as the store applied it. An applied object is the one the store now holds (shared, never
/// copied). `previous` is the object the store held under that name before an `Apply` or `Delete` (or, for an
/// `InitApply`, the one the same relist showed earlier), so an index can drop exactly the keys it filed that object
/// under.
///
/// A relist after a restarted watch (an API server restarting or rolling, a watch expired with 410 Gone) is told
/// apart, because the store shows it only when it completes:
/// - its `InitApply`s are `deferred`: a handler that queued work for them would have it done against the old state
///   (a pod created while the watch was down: "gone"; one replaced under its name: the old one);
/// - its `InitDone` carries `gone`, the objects it no longer shows (deleted while the watch was down, or deleted and
///   created again under the same name with another UID, as a StatefulSet replaces a pod), and `listed`, every
///   object it shows: the first are deletions (client-go's `DeletedFinalStateUnknown`; without them a controller
///   never learns that a pod whose claim it reserved is gone), then the second are shown.
///
/// The informer's first list is neither: nothing acts on it before it completes. Handlers read all of this through
/// [`Change::acts`], which applies these rules in one place.
#[derive(Debug)]
pub struct Change<K> {
    pub event: watcher::Event<Arc<K>>,
    pub previous: Option<Arc<K>>,
    gone: Vec<Arc<K>>,
    listed: Vec<Arc<K>>,
    deferred: bool,
    /// The `InitDone` of a relist.
    relisted: bool,
}

/// One thing a [`Change`] asks its handlers to act on.
#[derive(Debug)]
pub enum Act<'a, K> {
    /// The object as the store now shows it.
    Shown(&'a Arc<K>),
    /// An object that is gone.
    Deleted(&'a Arc<K>),
}

impl<K> Change<K> {
    /// Whether this completes a relist (not the informer's first list): the store now shows what it listed.
    pub fn ends_relist(&self) -> bool {
        self.relisted
    }

    /// What to act on, in order: the object an `Apply` shows or a `Delete` removes, an `InitApply` of the first list;
    /// at a relist's end, what it no longer shows, then everything it shows (its `InitApply`s act through these).
    pub fn acts(&self) -> impl Iterator<Item = Act<'_, K>> {
        let event = match &self.event {
            watcher::Event::Apply(obj) => Some(Act::Shown(obj)),
            watcher::Event::InitApply(obj) if !self.deferred => Some(Act::Shown(obj)),
            watcher::Event::Delete(obj) => Some(Act::Deleted(obj)),
            watcher::Event::InitApply(_) | watcher::Event::Init | watcher::Event::InitDone => None,
        };
        event.into_iter().chain(self.gone.iter().map(Act::Deleted)).chain(self.listed.iter().map(Act::Shown))
    }
}

/// The objects of `old` that `new` does not hold: not under their name, or under it with another UID.
fn removed_by_relist<K: Keyed>(old: &Objects<K>, new: &Objects<K>) -> Vec<Arc<K>> {
    let mut gone = Vec::new();
    for (namespace, names) in old {
        let listed = new.get(namespace);
        for named in names {
            let now = listed.and_then(|names| names.get(named.name()));
            if now.is_none_or(|now| now.0.uid() != named.0.uid()) {
                gone.push(named.0.clone());
            }
        }
    }
    gone
}

/// Feeds every event a watch yields into `writer` before passing it on (`stream.map(feed(writer))`), as kube's
/// `reflect` does: handlers further down the stream see the store already updated.
pub fn feed<W: IntoCached<Cached = K>, K: Keyed, E>(
    mut writer: CacheWriter<K>,
) -> impl FnMut(Result<watcher::Event<W>, E>) -> Result<Change<K>, E> {
    move |event| event.map(|event| writer.apply_watcher_event(cached(event)))
}

/// What a watched object is cached as: itself, or the slim object kube's wrapper carries
/// ([`super::api_object::ApiObject`]).
pub trait IntoCached {
    type Cached;
    fn into_cached(self) -> Self::Cached;
}

fn cached<W: IntoCached>(event: watcher::Event<W>) -> watcher::Event<W::Cached> {
    match event {
        watcher::Event::Apply(obj) => watcher::Event::Apply(obj.into_cached()),
        watcher::Event::Delete(obj) => watcher::Event::Delete(obj.into_cached()),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(obj) => watcher::Event::InitApply(obj.into_cached()),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// What the store and the indexes file an object under: its namespace (`""` for cluster-scoped objects) and name;
/// and its UID, which tells an object from another of the same name.
pub trait Keyed {
    fn key(&self) -> (&str, &str);
    fn uid(&self) -> Option<&str>;
}

impl<K: Resource> Keyed for K {
    fn key(&self) -> (&str, &str) {
        let meta = self.meta();
        (meta.namespace.as_deref().unwrap_or_default(), meta.name.as_deref().unwrap_or_default())
    }

    fn uid(&self) -> Option<&str> {
        self.meta().uid.as_deref()
    }
}

/// Files `obj` under its name; returns the object it replaced.
fn insert<K: Keyed>(objects: &mut Objects<K>, obj: Arc<K>) -> Option<Arc<K>> {
    let namespace = obj.key().0;
    let names = match objects.get_mut(namespace) {
        Some(names) => names,
        None => objects.entry(namespace.into()).or_default(),
    };
    names.replace(Named(obj)).map(|named| named.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn object(namespace: &str, name: &str, version: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    fn version(cache: &Cache<ConfigMap>, namespace: &str, name: &str) -> Option<String> {
        cache.get(namespace, name)?.metadata.resource_version.clone()
    }

    #[test]
    fn applies_and_deletes_by_namespace_and_name() {
        let mut writer = CacheWriter::new();
        let cache = writer.as_reader();
        let previous_version = |change: Change<ConfigMap>| change.previous?.metadata.resource_version.clone();
        assert_eq!(previous_version(writer.apply_watcher_event(watcher::Event::Apply(object("a", "x", "1")))), None);
        writer.apply_watcher_event(watcher::Event::Apply(object("b", "x", "2")));
        let change = writer.apply_watcher_event(watcher::Event::Apply(object("a", "x", "3")));
        assert_eq!(previous_version(change), Some("1".into()), "the object it replaced");
        assert_eq!((version(&cache, "a", "x"), version(&cache, "b", "x")), (Some("3".into()), Some("2".into())));
        assert_eq!(cache.len(), 2);
        let change = writer.apply_watcher_event(watcher::Event::Delete(object("a", "x", "4")));
        assert_eq!(previous_version(change), Some("3".into()), "the object it removed");
        assert_eq!((version(&cache, "a", "x"), cache.len()), (None, 1));
        let change = writer.apply_watcher_event(watcher::Event::Delete(object("a", "x", "5")));
        assert!(change.previous.is_none(), "a delete of an object the store does not have");
        assert!(cache.get("c", "x").is_none(), "an unknown namespace is simply empty");
    }

    #[tokio::test]
    async fn a_relist_replaces_the_store_only_when_complete() {
        let mut writer = CacheWriter::new();
        let cache = writer.as_reader();
        writer.apply_watcher_event(watcher::Event::Init);
        writer.apply_watcher_event(watcher::Event::InitApply(object("a", "kept", "1")));
        writer.apply_watcher_event(watcher::Event::InitApply(object("a", "gone", "1")));
        assert!(cache.is_empty(), "nothing is visible before the list completes");
        let waiting = cache.clone();
        let ready = tokio::spawn(async move { waiting.wait_until_ready().await });
        writer.apply_watcher_event(watcher::Event::InitDone);
        assert!(ready.await.is_ok_and(|r| r.is_ok()), "ready after the first list");
        assert_eq!(cache.len(), 2);

        // The watch broke; "gone" was deleted meanwhile and "new" created: the relist shows exactly what is left.
        writer.apply_watcher_event(watcher::Event::Init);
        writer.apply_watcher_event(watcher::Event::InitApply(object("a", "kept", "5")));
        writer.apply_watcher_event(watcher::Event::InitApply(object("b", "new", "6")));
        assert_eq!(version(&cache, "a", "gone"), Some("1".into()), "the old state serves until the relist completes");
        writer.apply_watcher_event(watcher::Event::InitDone);
        let mut names: Vec<_> = cache.state().iter().filter_map(|o| o.metadata.name.clone()).collect();
        names.sort();
        assert_eq!(names, ["kept", "new"]);
        assert_eq!(version(&cache, "a", "kept"), Some("5".into()));
    }

    fn with_uid(mut object: ConfigMap, uid: &str) -> ConfigMap {
        object.metadata.uid = Some(uid.into());
        object
    }

    fn names(objects: &[Arc<ConfigMap>]) -> Vec<String> {
        let mut names: Vec<_> = objects.iter().filter_map(|o| o.metadata.name.clone()).collect();
        names.sort();
        names
    }

    #[test]
    fn a_relist_after_the_first_says_what_it_removed() {
        let mut writer = CacheWriter::new();
        writer.apply_watcher_event(watcher::Event::Init);
        let shown = writer.apply_watcher_event(watcher::Event::InitApply(with_uid(object("a", "kept", "1"), "u1")));
        assert!(!shown.deferred, "nothing acts on the first list before it completes");
        writer.apply_watcher_event(watcher::Event::InitApply(with_uid(object("a", "deleted", "1"), "u2")));
        writer.apply_watcher_event(watcher::Event::InitApply(with_uid(object("b", "replaced", "1"), "u3")));
        writer.apply_watcher_event(watcher::Event::InitApply(with_uid(object("c", "alone", "1"), "u4")));
        let first = writer.apply_watcher_event(watcher::Event::InitDone);
        assert!(first.gone.is_empty() && first.listed.is_empty(), "the informer's first list is not a relist");

        writer.apply_watcher_event(watcher::Event::Init);
        let during = writer.apply_watcher_event(watcher::Event::InitApply(with_uid(object("a", "kept", "5"), "u1")));
        assert!(during.deferred, "shown by a relist the store does not show yet");
        writer.apply_watcher_event(watcher::Event::InitApply(with_uid(object("b", "replaced", "6"), "u9")));
        writer.apply_watcher_event(watcher::Event::InitApply(with_uid(object("d", "new", "7"), "u5")));
        let relist = writer.apply_watcher_event(watcher::Event::InitDone);
        assert_eq!(names(&relist.gone), ["alone", "deleted", "replaced"]);
        assert_eq!(names(&relist.listed), ["kept", "new", "replaced"], "what the store shows now, to act on");
        let replaced = relist.gone.iter().find(|o| o.metadata.name.as_deref() == Some("replaced"));
        assert_eq!(replaced.and_then(|o| o.metadata.uid.as_deref()), Some("u3"), "the old object, with its UID");

        let applied = writer.apply_watcher_event(watcher::Event::Apply(with_uid(object("a", "kept", "8"), "u1")));
        assert!(applied.gone.is_empty(), "only a relist removes objects this way");
    }

    #[tokio::test]
    async fn waiting_for_a_store_whose_writer_is_gone_fails_unless_it_was_ready() {
        let writer = CacheWriter::<ConfigMap>::new();
        let cache = writer.as_reader();
        drop(writer);
        assert!(cache.wait_until_ready().await.is_err(), "the first list never completed");

        let mut writer = CacheWriter::<ConfigMap>::new();
        let cache = writer.as_reader();
        writer.apply_watcher_event(watcher::Event::Init);
        writer.apply_watcher_event(watcher::Event::InitDone);
        drop(writer);
        assert!(cache.wait_until_ready().await.is_ok(), "ready once, ready for good");
    }
}
