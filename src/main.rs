//! The `gpu-dra` binary: parse the command line, set up logging, hand over to the chosen component.

use clap::Parser;
use gpu_dra::cli::{Cli, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    gpu_dra::telemetry::init_logging(&cli.log)?;
    match cli.command {
        Command::Controller(args) => {
            gpu_dra::telemetry::build::log_start("controller");
            gpu_dra::controller::run(*args).await?
        }
        Command::NodeAgent(args) => {
            gpu_dra::telemetry::build::log_start("node-agent");
            gpu_dra::node_agent::run(*args).await?
        }
        Command::GpuCheck(args) => gpu_dra::node_agent::gpu_check::run(&args)?,
    }
    Ok(())
}
