//! The DRA plugin service, in both versions the kubelet may speak: thin adapters from the wire messages to
//! [`DriverState`], which does the work. Every claim gets its own answer, never all-or-nothing: one bad claim
//! must not hold back the others of the pod.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::allocation::ClaimRef;
use super::checkpoint::PreparedDevice;
use super::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1};
use super::state::{DriverState, Operation};

/// Serves `v1.DRAPlugin` and `v1beta1.DRAPlugin` from one state.
#[derive(Clone, Debug)]
pub struct DraService {
    pub state: Arc<DriverState>,
}

fn claim_refs<'a>(claims: impl Iterator<Item = (&'a str, &'a str, &'a str)>) -> Vec<ClaimRef> {
    claims
        .map(|(namespace, name, uid)| ClaimRef {
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: uid.to_string(),
        })
        .collect()
}

impl DraService {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> Vec<(String, Result<Vec<PreparedDevice>, String>)> {
        let _timer = self.state.metrics().time(Operation::Prepare);
        let call =
            self.state.metrics().watch_call(Operation::Prepare, claims.iter().map(ClaimRef::to_string).collect());
        let results = self.state.prepare(claims).await;
        call.answered();
        results
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Vec<(String, Result<(), String>)> {
        // An empty call is the agent's own liveness probe of its socket (every 10 s), never the kubelet's: timed, it
        // would count as an unprepare and pull the latency down to the lowest bucket.
        if claims.is_empty() {
            return Vec::new();
        }
        let _timer = self.state.metrics().time(Operation::Unprepare);
        let call =
            self.state.metrics().watch_call(Operation::Unprepare, claims.iter().map(ClaimRef::to_string).collect());
        let results = self.state.unprepare(claims).await;
        call.answered();
        results
    }
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let request = request.into_inner();
        let refs = claim_refs(request.claims.iter().map(|c| (c.namespace.as_str(), c.name.as_str(), c.uid.as_str())));
        let claims: HashMap<_, _> = self
            .prepare(refs)
            .await
            .into_iter()
            .map(|(uid, result)| {
                let response = match result {
                    Ok(devices) => v1::NodePrepareResourceResponse {
                        devices: devices
                            .into_iter()
                            .map(|d| v1::Device {
                                request_names: d.request_names,
                                pool_name: d.pool,
                                device_name: d.device,
                                cdi_device_ids: d.cdi_device_ids,
                                share_id: d.share_id,
                            })
                            .collect(),
                        error: String::new(),
                    },
                    Err(error) => v1::NodePrepareResourceResponse { devices: Vec::new(), error },
                };
                (uid, response)
            })
            .collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let request = request.into_inner();
        let refs = claim_refs(request.claims.iter().map(|c| (c.namespace.as_str(), c.name.as_str(), c.uid.as_str())));
        let claims = self
            .unprepare(refs)
            .await
            .into_iter()
            .map(|(uid, result)| (uid, v1::NodeUnprepareResourceResponse { error: result.err().unwrap_or_default() }))
            .collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let request = request.into_inner();
        let refs = claim_refs(request.claims.iter().map(|c| (c.namespace.as_str(), c.name.as_str(), c.uid.as_str())));
        let claims: HashMap<_, _> = self
            .prepare(refs)
            .await
            .into_iter()
            .map(|(uid, result)| {
                let response = match result {
                    Ok(devices) => v1beta1::NodePrepareResourceResponse {
                        devices: devices
                            .into_iter()
                            .map(|d| v1beta1::Device {
                                request_names: d.request_names,
                                pool_name: d.pool,
                                device_name: d.device,
                                cdi_device_ids: d.cdi_device_ids,
                            })
                            .collect(),
                        error: String::new(),
                    },
                    Err(error) => v1beta1::NodePrepareResourceResponse { devices: Vec::new(), error },
                };
                (uid, response)
            })
            .collect();
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let request = request.into_inner();
        let refs = claim_refs(request.claims.iter().map(|c| (c.namespace.as_str(), c.name.as_str(), c.uid.as_str())));
        let claims = self
            .unprepare(refs)
            .await
            .into_iter()
            .map(|(uid, result)| {
                (uid, v1beta1::NodeUnprepareResourceResponse { error: result.err().unwrap_or_default() })
            })
            .collect();
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse { claims }))
    }
}
