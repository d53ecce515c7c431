//! A slim cache type as kube's `Api` and watcher handle it. They need a k8s-openapi `ObjectMeta` (the watcher
//! reads each object's resourceVersion from it, and its name when it logs one), which the cached pods and claims do
//! without ([`super::wire_meta::Meta`]). [`ApiObject`] carries one beside the object while it passes through kube,
//! with only the name and resourceVersion filled in (every watched object passes here, so nothing else is copied),
//! and is unwrapped before anything is cached.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Api, Client};
use serde::{Deserialize, Deserializer};

use super::store::IntoCached;
use super::wire_meta::Meta;

/// `T` with the `ObjectMeta` kube reads.
#[derive(Clone, Debug)]
pub struct ApiObject<T> {
    metadata: ObjectMeta,
    pub object: T,
}

/// A cached type with compact metadata.
pub trait HasMeta {
    fn meta(&self) -> &Meta;
}

impl<T: HasMeta> ApiObject<T> {
    fn new(object: T) -> Self {
        let meta = object.meta();
        let metadata = ObjectMeta {
            name: meta.name.clone(),
            resource_version: meta.resource_version.clone(),
            ..ObjectMeta::default()
        };
        Self { metadata, object }
    }
}

impl<'de, T: HasMeta + Deserialize<'de>> Deserialize<'de> for ApiObject<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        T::deserialize(deserializer).map(Self::new)
    }
}

impl<T: k8s_openapi::Resource> k8s_openapi::Resource for ApiObject<T> {
    const API_VERSION: &'static str = T::API_VERSION;
    const GROUP: &'static str = T::GROUP;
    const KIND: &'static str = T::KIND;
    const VERSION: &'static str = T::VERSION;
    const URL_PATH_SEGMENT: &'static str = T::URL_PATH_SEGMENT;
    type Scope = T::Scope;
}

impl<T: k8s_openapi::Resource> k8s_openapi::Metadata for ApiObject<T> {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// `Api` for a slim type in `namespace`.
pub fn namespaced<T>(client: Client, namespace: &str) -> Api<ApiObject<T>>
where
    T: k8s_openapi::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
{
    Api::namespaced(client, namespace)
}

impl<T> IntoCached for ApiObject<T> {
    type Cached = T;

    fn into_cached(self) -> T {
        self.object
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::slim_pod::Pod;
    use crate::controller::store::Keyed;
    use kube::Resource;

    #[test]
    fn kube_sees_the_name_and_version_of_the_slim_object() -> Result<(), serde_json::Error> {
        let pod: ApiObject<Pod> = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "9", "labels": {"a": "b"}},
            "spec": {"nodeName": "n"}
        }))?;
        let meta = pod.meta();
        assert_eq!((meta.name.as_deref(), meta.resource_version.as_deref()), (Some("p"), Some("9")));
        assert_eq!(pod.object.key(), ("ns", "p"));
        assert_eq!((ApiObject::<Pod>::kind(&()), ApiObject::<Pod>::plural(&())), ("Pod".into(), "pods".into()));
        assert_eq!(pod.object.spec.and_then(|s| s.node_name).as_deref(), Some("n"));
        Ok(())
    }
}
