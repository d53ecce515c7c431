//! Observability shared by every component: logging set-up, the metrics/health HTTP server, process metrics, the
//! build's identity.

pub mod build;
pub mod process;
pub mod server;

use crate::cli::{LogArgs, LogFormat};
use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Errors while setting up telemetry.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("parse log filter {filter:?} (expected tracing syntax such as `info` or `gpu_dra=debug`)")]
    LogFilter {
        filter: String,
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("install the global log subscriber")]
    Install(#[source] tracing_subscriber::util::TryInitError),
}

/// Installs the global `tracing` subscriber: logs go to stderr, as text or JSON lines.
pub fn init_logging(args: &LogArgs) -> Result<(), TelemetryError> {
    let filter = EnvFilter::try_new(&args.log_filter)
        .map_err(|source| TelemetryError::LogFilter { filter: args.log_filter.clone(), source })?;
    let registry = tracing_subscriber::registry().with(filter);
    let result = match args.log_format {
        LogFormat::Text => {
            // Colours only for a person at a terminal, never into files or log collectors.
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            registry.with(fmt::layer().with_ansi(ansi).with_writer(std::io::stderr)).try_init()
        }
        LogFormat::Json => registry.with(fmt::layer().json().with_writer(std::io::stderr)).try_init(),
    };
    result.map_err(TelemetryError::Install)
}
