//! The kubelet's DRA plugin API: registration with the kubelet's plugin watcher and the DRA service that prepares
//! allocated GPUs as CDI devices.
//!
//! ```text
//!  kubelet ──dial──▶ <registry dir>/<driver>-reg.sock  (registration: GetInfo, NotifyRegistrationStatus)
//!     │                         │ endpoint
//!     └──────dial──▶ <plugins dir>/<driver>/dra.sock   (v1 + v1beta1 DRAPlugin, v1 + v1alpha1 DRAResourceHealth)
//!                               │
//!                          DriverState ── checkpoint (state dir) ── CDI specs (CDI dir)
//! ```
//!
//! **Architecture Invariant:** the DRA socket serves before the registration socket appears (the kubelet dials the
//! endpoint as soon as it registers us), and both sockets are removed on shutdown (a leftover socket would make the
//! kubelet believe the plugin is still there).

pub mod allocation;
mod authority;
pub mod call_order;
pub mod checkpoint;
pub mod config;
pub mod device_metadata;
pub mod group_commit;
pub mod health;
pub mod metrics;
pub mod mps;
pub mod partitions;
pub mod proto;
pub mod registration;
pub mod service;
pub mod socket;
pub mod stale;
pub mod state;
pub mod time_slice;

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tracing::{info, warn};

use proto::dra_v1::dra_plugin_server::DraPluginServer as DraV1Server;
use proto::dra_v1beta1::dra_plugin_server::DraPluginServer as DraV1beta1Server;
use proto::registration::registration_server::RegistrationServer;
use proto::v1::dra_resource_health_server::DraResourceHealthServer as HealthV1Server;
use proto::v1alpha1::dra_resource_health_server::DraResourceHealthServer as HealthV1alpha1Server;
pub use registration::Registration;
use registration::RegistrationService;
use service::DraService;
pub use socket::{SocketError, SocketPaths, is_registration_of};
use state::DriverState;

/// Serves the plugin until `stop`; the returned task removes both sockets before it ends. Every connection on
/// either socket goes through [`authority::incoming`], so that any gRPC client is answered (not only grpc-go). What
/// the kubelet says of the registration goes to `registration`.
pub fn serve(
    paths: SocketPaths,
    driver: String,
    state: Arc<DriverState>,
    (health, registration): (health::HealthService, &Registration),
    stop: CancellationToken,
) -> Result<JoinHandle<()>, SocketError> {
    let dra_listener = socket::bind(&paths.dra)?;
    let dra_bound = socket::identity(&paths.dra);
    let service = DraService { state: state.clone() };
    let dra = Server::builder()
        .add_service(DraV1Server::new(service.clone()))
        .add_service(DraV1beta1Server::new(service))
        .add_service(HealthV1Server::new(health.clone().ending_with(stop.clone())))
        .add_service(HealthV1alpha1Server::new(health.ending_with(stop.clone())))
        .serve_with_incoming_shutdown(authority::incoming(dra_listener), stop.clone().cancelled_owned());
    let dra = tokio::spawn(dra);
    info!(socket = %paths.dra.display(), "serving the DRA service");

    // Only now may the kubelet find us, and no longer at a socket an earlier agent left.
    socket::remove_stale_registrations(&paths.registration, &driver);
    let registration_listener = match socket::bind(&paths.registration) {
        Ok(listener) => listener,
        Err(e) => {
            dra.abort();
            remove_socket(&paths.dra, dra_bound);
            return Err(e);
        }
    };
    let registration_bound = socket::identity(&paths.registration);
    let service = RegistrationService { driver, dra_socket: paths.dra.clone(), registration: registration.clone() };
    let registration = Server::builder()
        .add_service(RegistrationServer::new(service))
        .serve_with_incoming_shutdown(authority::incoming(registration_listener), stop.cancelled_owned());
    info!(socket = %paths.registration.display(), "registration socket ready for the kubelet");
    Ok(tokio::spawn(async move {
        let (dra, registration) = tokio::join!(dra, tokio::spawn(registration));
        for (name, outcome) in [("DRA", dra), ("registration", registration)] {
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(error = %e, "the {name} server failed"),
                Err(e) => warn!(error = %e, "the {name} server task failed"),
            }
        }
        remove_socket(&paths.registration, registration_bound);
        remove_socket(&paths.dra, dra_bound);
        info!("plugin sockets removed");
    }))
}

/// Removes the socket this agent bound at `path`; one another agent bound there since (same path, another file) is
/// left alone: removed, the kubelet would unregister that agent.
fn remove_socket(path: &std::path::Path, bound: Option<socket::Identity>) {
    let now = socket::identity(path);
    if now.is_none() {
        return;
    }
    if bound.is_none() || now != bound {
        warn!(socket = %path.display(), "the socket is no longer the one this agent bound: leaving it");
        return;
    }
    if let Err(e) = crate::fsutil::remove_if_exists(path) {
        warn!(socket = %path.display(), error = %e, "removing the socket failed");
    }
}

/// Checks that both sockets answer gRPC (the liveness probe): the registration service's GetInfo, and the DRA
/// service with an empty unprepare (harmless by definition).
pub async fn check_sockets(paths: &SocketPaths) -> Result<(), String> {
    use proto::dra_v1::NodeUnprepareResourcesRequest;
    use proto::dra_v1::dra_plugin_client::DraPluginClient;
    use proto::registration::InfoRequest;
    use proto::registration::registration_client::RegistrationClient;
    let timeout = std::time::Duration::from_secs(2);
    let check = async {
        let channel = socket::dial(&paths.registration).await.map_err(|e| format!("registration socket: {e}"))?;
        RegistrationClient::new(channel).get_info(InfoRequest {}).await.map_err(|e| format!("GetInfo: {e}"))?;
        let channel = socket::dial(&paths.dra).await.map_err(|e| format!("DRA socket: {e}"))?;
        DraPluginClient::new(channel)
            .node_unprepare_resources(NodeUnprepareResourcesRequest { claims: Vec::new() })
            .await
            .map_err(|e| format!("NodeUnprepareResources: {e}"))?;
        Ok(())
    };
    tokio::time::timeout(timeout, check).await.unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
}
