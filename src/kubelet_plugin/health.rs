//! `DRAResourceHealth.NodeWatchResources` (v1 and v1alpha1) on the DRA socket: the health of every device of this
//! node's pool that the agent can say something of, sent at once, again on every change, and every [`RESEND`] so
//! that the kubelet (which treats a device left out of the reports for longer than its timeout as Unknown) keeps
//! seeing it. The kubelet writes it into the status of the pods
//! using the devices (`containerStatuses[].allocatedResourcesStatus`).

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::proto::{v1, v1alpha1};

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
    pub health: Health,
    /// Why not healthy (empty when healthy).
    pub message: String,
}

/// What the kubelet is told of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy,
    /// Its faults would go unnoticed (see `node_agent::health::coverage`).
    Unknown,
}

/// The health of every device, as the node agent last determined it.
pub type HealthReport = Arc<Vec<DeviceHealth>>;

/// The service, for one pool.
#[derive(Debug, Clone)]
pub struct HealthService {
    pool: String,
    updates: watch::Receiver<HealthReport>,
    /// Ends every stream: the server's graceful shutdown waits for open streams, and the kubelet keeps this one
    /// open for as long as we serve, so without it a stopping agent would hang until it is killed and leave its
    /// sockets behind.
    stop: CancellationToken,
}

impl HealthService {
    pub fn new(pool: String, updates: watch::Receiver<HealthReport>) -> Self {
        Self { pool, updates, stop: CancellationToken::new() }
    }

    /// The same service, whose streams end when `stop` is cancelled.
    pub fn ending_with(self, stop: CancellationToken) -> Self {
        Self { stop, ..self }
    }

    /// The report now, then one per change or [`RESEND`], until the kubelet hangs up or the plugin stops.
    fn stream(&self) -> ResponseStream {
        let pool = self.pool.clone();
        let mut updates = self.updates.clone();
        let stop = self.stop.clone();
        Box::pin(async_stream(move |sender| async move {
            loop {
                let report = updates.borrow_and_update().clone();
                if sender.send(Ok(response(&pool, &report, unix_now()))).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = updates.changed() => if changed.is_err() { return },
                    () = tokio::time::sleep(RESEND) => {}
                    () = stop.cancelled() => return,
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

/// The v1 response for `report`'s devices in `pool`, determined at `now` (Unix seconds).
fn response(pool: &str, report: &[DeviceHealth], now: i64) -> v1::NodeWatchResourcesResponse {
    let devices = report
        .iter()
        .map(|device| v1::DeviceHealth {
            device: Some(v1::DeviceIdentifier { pool_name: pool.to_string(), device_name: device.device.clone() }),
            health: match device.health {
                Health::Healthy => v1::HealthStatus::Healthy,
                Health::Unhealthy => v1::HealthStatus::Unhealthy,
                Health::Unknown => v1::HealthStatus::Unknown,
            } as i32,
            last_updated_time: now,
            health_check_timeout_seconds: TIMEOUT_SECONDS,
            message: message(device),
        })
        .collect();
    v1::NodeWatchResourcesResponse { devices }
}

/// The response stream both service versions return.
type ResponseStream = Pin<Box<dyn Stream<Item = Result<v1::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ResponseStream;

    async fn node_watch_resources(
        &self,
        _request: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<ResponseStream>, Status> {
        Ok(Response::new(self.stream()))
    }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ResponseStream;

    async fn node_watch_resources(
        &self,
        _request: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<ResponseStream>, Status> {
        Ok(Response::new(self.stream()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_as_the_kubelet_would() {
        let long = DeviceHealth { device: "gpu-0".into(), health: Health::Unhealthy, message: "x".repeat(2000) };
        let cut = message(&long);
        assert_eq!(cut.chars().count(), MAX_MESSAGE);
        assert!(cut.ends_with("..."));
        let short = DeviceHealth { message: "XID 79".into(), ..long };
        assert_eq!(message(&short), "XID 79");
    }

    #[test]
    fn every_device_with_its_pool_and_state() {
        let report = [
            DeviceHealth { device: "gpu-0".into(), health: Health::Healthy, message: String::new() },
            DeviceHealth { device: "gpu-1".into(), health: Health::Unhealthy, message: "XID 79".into() },
            DeviceHealth { device: "gpu-2".into(), health: Health::Unknown, message: "not watched".into() },
        ];
        let response = response("node-a", &report, 1_700_000_000);
        let got: Vec<_> = response
            .devices
            .iter()
            .map(|d| {
                let id = d.device.as_ref().map(|i| (i.pool_name.as_str(), i.device_name.as_str()));
                (id, d.health, d.last_updated_time, d.health_check_timeout_seconds, d.message.as_str())
            })
            .collect();
        assert_eq!(
            got,
            [
                (Some(("node-a", "gpu-0")), v1::HealthStatus::Healthy as i32, 1_700_000_000, 30, ""),
                (Some(("node-a", "gpu-1")), v1::HealthStatus::Unhealthy as i32, 1_700_000_000, 30, "XID 79"),
                (Some(("node-a", "gpu-2")), v1::HealthStatus::Unknown as i32, 1_700_000_000, 30, "not watched"),
            ]
        );
    }
}
