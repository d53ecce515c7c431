//! The registration service the kubelet's plugin watcher calls: GetInfo tells it who we are and where the DRA
//! service listens; NotifyRegistrationStatus tells us whether it accepted.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::proto::registration::registration_server::Registration as RegistrationApi;
use super::proto::registration::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};

/// The plugin type the kubelet routes to its DRA manager.
const PLUGIN_TYPE: &str = "DRAPlugin";
/// Services served, in order of preference: the kubelet takes the first DRA service it supports, so a 1.34+ kubelet
/// speaks v1 and older ones v1beta1. A 1.37 kubelet likewise takes the first health service listed (and opens no
/// health stream for a plugin that lists none); 1.34–1.36 kubelets dial v1alpha1 whenever their ResourceHealthStatus
/// gate is on (by default from 1.36), whatever the list says.
pub const SUPPORTED_VERSIONS: [&str; 4] =
    ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"];

/// What the kubelet last said of the registration: the `registered` gauge, and why it refused, if it did.
#[derive(Clone, Debug, Default)]
pub struct Registration {
    /// 1 while the kubelet says we are registered.
    registered: Gauge,
    refusal: Arc<Mutex<Option<String>>>,
}

impl Registration {
    /// A registration not yet answered, said in `registered`.
    pub fn new(registered: Gauge) -> Self {
        registered.set(0);
        Self { registered, refusal: Arc::default() }
    }

    pub fn registered(&self) -> bool {
        self.registered.get() == 1
    }

    fn accepted(&self) {
        self.registered.set(1);
        *self.refusal.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    fn refused(&self, error: String) {
        self.registered.set(0);
        *self.refusal.lock().unwrap_or_else(PoisonError::into_inner) = Some(error);
    }

    /// The readiness it allows, `waited` after the registration socket appeared: not ready while the kubelet refuses
    /// the plugin, nor once it has not registered it within `timeout` (its plugin watcher finds a socket within a
    /// second: one it never finds is under a directory it does not watch). Before that it is given the benefit of
    /// the doubt, so that the agent is ready beside no kubelet at all for that long.
    pub fn readiness(&self, waited: Duration, timeout: Duration) -> Result<(), String> {
        if let Some(error) = self.refusal.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
            return Err(format!("the kubelet refused to register the plugin: {error}"));
        }
        if self.registered() || waited < timeout {
            return Ok(());
        }
        Err(format!(
            "the kubelet has not registered the plugin {} after its socket appeared (is nodeAgent.kubeletDir the \
             kubelet's root directory? see the NotRegistered Event on the Node)",
            humantime::format_duration(timeout)
        ))
    }
}

/// Answers the kubelet's plugin watcher.
#[derive(Debug)]
pub struct RegistrationService {
    pub driver: String,
    pub dra_socket: PathBuf,
    pub registration: Registration,
}

#[tonic::async_trait]
impl RegistrationApi for RegistrationService {
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
            self.registration.accepted();
        } else {
            warn!(driver = %self.driver, error = %status.error, "kubelet refused to register the plugin");
            self.registration.refused(status.error);
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(60);

    #[test]
    fn readiness_waits_for_the_timeout_then_needs_the_kubelets_registration() {
        let registration = Registration::new(Gauge::default());
        assert_eq!(registration.readiness(Duration::from_secs(59), TIMEOUT), Ok(()));
        let late = registration.readiness(TIMEOUT, TIMEOUT).expect_err("ready past the timeout");
        assert!(late.contains("has not registered the plugin 1m after") && late.contains("kubeletDir"), "{late}");
        registration.accepted();
        assert!(registration.registered());
        assert_eq!(registration.readiness(Duration::from_secs(3600), TIMEOUT), Ok(()));
    }

    #[test]
    fn a_refusal_is_not_ready_at_once_until_the_kubelet_accepts() {
        let registration = Registration::new(Gauge::default());
        registration.accepted();
        registration.refused("version 9 is not supported".into());
        assert!(!registration.registered());
        let refused = registration.readiness(Duration::ZERO, TIMEOUT).expect_err("ready though refused");
        assert!(refused.contains("refused to register the plugin: version 9 is not supported"), "{refused}");
        registration.accepted();
        assert_eq!(registration.readiness(TIMEOUT, TIMEOUT), Ok(()));
    }
}
