//! The `gpu-dra` binary: parse the command line, set up logging, hand over to the chosen component.

use anyhow::Context as _;
use clap::Parser;
use gpu_dra::cli::{Cli, Command};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Command::Controller(args) = &cli.command {
        runtime.worker_threads(args.threads.into());
    }
    runtime.enable_all().build().context("start the async runtime")?.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
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
