//! A client of the kubelet's PodResources API (`v1.PodResourcesLister`, the socket
//! `<kubelet-dir>/pod-resources/kubelet.sock`), as GPU monitors use it to tell which pod holds which device: the
//! `List` call and the messages it needs, written for these tests from the API's field numbers (KEP-3695 added
//! `dynamic_resources`, the DRA devices of each container).

use std::path::Path;

use anyhow::Context as _;
use tonic::codegen::http::uri::PathAndQuery;

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesResponse {
    #[prost(message, repeated, tag = "1")]
    pub pod_resources: Vec<PodResources>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PodResources {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(message, repeated, tag = "3")]
    pub containers: Vec<ContainerResources>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerResources {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, repeated, tag = "5")]
    pub dynamic_resources: Vec<DynamicResource>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DynamicResource {
    #[prost(string, tag = "2")]
    pub claim_name: String,
    #[prost(string, tag = "3")]
    pub claim_namespace: String,
    #[prost(message, repeated, tag = "4")]
    pub claim_resources: Vec<ClaimResource>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ClaimResource {
    #[prost(message, repeated, tag = "1")]
    pub cdi_devices: Vec<CdiDevice>,
    #[prost(string, tag = "2")]
    pub driver_name: String,
    #[prost(string, tag = "3")]
    pub pool_name: String,
    #[prost(string, tag = "4")]
    pub device_name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CdiDevice {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// `List` on the kubelet's PodResources socket under `kubelet_dir`: every pod of the node with its resources.
pub async fn list(kubelet_dir: &Path) -> anyhow::Result<Vec<PodResources>> {
    let socket = kubelet_dir.join("pod-resources/kubelet.sock");
    let channel = gpu_dra::kubelet_plugin::socket::dial(&socket)
        .await
        .with_context(|| format!("dial the kubelet's PodResources socket {}", socket.display()))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.context("PodResources socket not ready")?;
    let codec = tonic_prost::ProstCodec::<ListPodResourcesRequest, ListPodResourcesResponse>::default();
    let path = PathAndQuery::from_static("/v1.PodResourcesLister/List");
    let response = grpc.unary(tonic::Request::new(ListPodResourcesRequest {}), path, codec).await?;
    Ok(response.into_inner().pod_resources)
}
