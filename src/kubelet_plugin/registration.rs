//! The registration service the kubelet's plugin watcher calls: GetInfo tells it who we are and where the DRA
//! service listens; NotifyRegistrationStatus tells us whether it accepted.

use std::path::PathBuf;

use prometheus_client::metrics::gauge::Gauge;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::proto::registration::registration_server::Registration;
use super::proto::registration::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};

/// The plugin type the kubelet routes to its DRA manager.
const PLUGIN_TYPE: &str = "DRAPlugin";
/// Services served, in order of preference: the kubelet takes the first DRA service it supports, so a 1.34+ kubelet
/// speaks v1 and older ones v1beta1. A 1.37 kubelet likewise takes the first health service listed (and opens no
/// health stream for a plugin that lists none); 1.34–1.36 kubelets dial v1alpha1 whenever their ResourceHealthStatus
/// gate is on (by default from 1.36), whatever the list says.
pub const SUPPORTED_VERSIONS: [&str; 4] =
    ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"];

/// Answers the kubelet's plugin watcher.
#[derive(Debug)]
pub struct RegistrationService {
    pub driver: String,
    pub dra_socket: PathBuf,
    /// 1 while the kubelet says we are registered.
    pub registered: Gauge,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _request: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_string(),
            name: self.driver.clone(),
            endpoint: self.dra_socket.to_string_lossy().into_owned(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            info!(driver = %self.driver, "kubelet registered the plugin");
            self.registered.set(1);
        } else {
            warn!(driver = %self.driver, error = %status.error, "kubelet refused to register the plugin");
            self.registered.set(0);
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
