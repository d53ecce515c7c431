//! Graceful shutdown: SIGTERM (the kubelet stopping a pod) and SIGINT (Ctrl-C) cancel one token that every
//! component task watches.

use tokio_util::sync::CancellationToken;
use tracing::info;

/// Cancels `stop` on SIGTERM or SIGINT.
pub fn spawn_signal_handler(stop: CancellationToken) -> Result<(), std::io::Error> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: shutting down"),
            _ = int.recv() => info!("SIGINT: shutting down"),
        }
        stop.cancel();
    });
    Ok(())
}
