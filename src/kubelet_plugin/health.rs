//! `DRAResourceHealth.NodeWatchResources` (v1 and v1alpha1) on the DRA socket: the health of every device of this
//! node's pool, sent at once, again on every change, and every [`RESEND`] so that the kubelet (which treats a
//! status older than its timeout as Unknown) keeps seeing it. The kubelet writes it into the status of the pods
//! using the devices (`containerStatuses[].allocatedResourcesStatus`).

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::proto::{health_v1 as v1, health_v1alpha1 as v1alpha1};

/// How often the full state is sent without a change.
pub const RESEND: Duration = Duration::from_secs(10);
/// The timeout sent with each device: three resends missed.
const TIMEOUT_SECONDS: i64 = 30;
/// The API's limit on a message.
const MAX_MESSAGE: usize = 1024;

/// One device's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    /// The device name in the pool (`gpu-0`).
    pub device: String,
    pub healthy: bool,
    /// Why not healthy (empty when healthy).
    pub message: String,
}

/// The health of every device, as the node agent last determined it.
pub type HealthReport = Arc<Vec<DeviceHealth>>;

/// The service, for one pool.
#[derive(Debug, Clone)]
pub struct HealthService {
    pool: String,
    updates: watch::Receiver<HealthReport>,
}

impl HealthService {
    pub fn new(pool: String, updates: watch::Receiver<HealthReport>) -> Self {
        Self { pool, updates }
    }

    /// The report now, then one per change or [`RESEND`], each converted by `convert`, until the kubelet hangs up.
    fn stream<T: Send + 'static>(
        &self,
        convert: fn(&str, &DeviceHealth, i64) -> T,
    ) -> Pin<Box<dyn Stream<Item = Result<Vec<T>, Status>> + Send>> {
        let pool = self.pool.clone();
        let mut updates = self.updates.clone();
        Box::pin(async_stream(move |sender| async move {
            loop {
                let report = updates.borrow_and_update().clone();
                let now = unix_now();
                let devices = report.iter().map(|d| convert(&pool, d, now)).collect();
                if sender.send(Ok(devices)).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = updates.changed() => if changed.is_err() { return },
                    () = tokio::time::sleep(RESEND) => {}
                }
            }
        }))
    }
}

/// A stream fed by `body` through a channel (the stream ends when `body` returns or the receiver is dropped).
fn async_stream<T, F, Fut>(body: F) -> impl Stream<Item = T> + Send
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (sender, receiver) = tokio::sync::mpsc::channel(1);
    tokio::spawn(body(sender));
    tokio_stream::wrappers::ReceiverStream::new(receiver)
}

fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn message(device: &DeviceHealth) -> String {
    if device.message.chars().count() <= MAX_MESSAGE {
        return device.message.clone();
    }
    let mut cut: String = device.message.chars().take(MAX_MESSAGE - 3).collect();
    cut.push_str("...");
    cut
}

macro_rules! health_service {
    ($version:ident) => {
        #[tonic::async_trait]
        impl $version::dra_resource_health_server::DraResourceHealth for HealthService {
            type NodeWatchResourcesStream =
                Pin<Box<dyn Stream<Item = Result<$version::NodeWatchResourcesResponse, Status>> + Send>>;

            async fn node_watch_resources(
                &self,
                _request: Request<$version::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                use futures::StreamExt as _;
                let stream = self.stream(|pool, device, now| $version::DeviceHealth {
                    device: Some($version::DeviceIdentifier {
                        pool_name: pool.to_string(),
                        device_name: device.device.clone(),
                    }),
                    health: if device.healthy {
                        $version::HealthStatus::Healthy
                    } else {
                        $version::HealthStatus::Unhealthy
                    } as i32,
                    last_updated_time: now,
                    health_check_timeout_seconds: TIMEOUT_SECONDS,
                    message: message(device),
                });
                let stream =
                    stream.map(|devices| devices.map(|devices| $version::NodeWatchResourcesResponse { devices }));
                Ok(Response::new(Box::pin(stream)))
            }
        }
    };
}

health_service!(v1);
health_service!(v1alpha1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_as_the_kubelet_would() {
        let long = DeviceHealth { device: "gpu-0".into(), healthy: false, message: "x".repeat(2000) };
        let cut = message(&long);
        assert_eq!(cut.chars().count(), MAX_MESSAGE);
        assert!(cut.ends_with("..."));
        let short = DeviceHealth { message: "XID 79".into(), ..long };
        assert_eq!(message(&short), "XID 79");
    }
}
