//! The `gpu-dra` binary: parse the command line, set up logging, hand over to the chosen component.

use anyhow::Context as _;
use clap::Parser;
use gpu_dra::cli::{Cli, Command};

fn main() -> std::process::ExitCode {
    match start() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {}", error_text(&error));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error followed by each of its causes that its text does not already say. Most of the crate's errors and the
/// client's put their cause in their own text too: printed as a chain (anyhow's default), a missing kubeconfig was
/// said four times over, with a backtrace where `RUST_BACKTRACE` was set.
fn error_text(error: &anyhow::Error) -> String {
    let mut text = error.to_string();
    for cause in error.chain().skip(1).map(ToString::to_string) {
        if !text.contains(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}

fn start() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::SimulatedMpsControl { foreground, server } = cli.command {
        return gpu_dra::node_agent::mps_stand_in::run(foreground, server);
    }
    // The controller mostly waits on the API server: with one thread its tasks run on this one (no scheduler
    // handing work between threads), which costs the least CPU; the node agent serves gRPC beside its loops.
    let mut runtime = match &cli.command {
        Command::Controller(args) if args.threads == 1 => tokio::runtime::Builder::new_current_thread(),
        Command::Controller(args) => {
            let mut runtime = tokio::runtime::Builder::new_multi_thread();
            runtime.worker_threads(args.threads.into());
            runtime
        }
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = runtime.enable_all().build().context("start the async runtime")?;
    let outcome = runtime.block_on(run(cli));
    // Dropping the runtime would wait for every blocking task, and one nothing waits for may never end: a GPU
    // discovery hung in NVML, a late health save or a directory check on a hung disk. The stop has done what it
    // must by now (sockets removed, MPS daemons stopped, the health state given its time to save): those are given
    // a moment, then left behind, so that the process exits instead of at the kubelet's SIGKILL (its pod
    // Terminating until then, holding up a rollout). Every file is written aside and renamed into place, so one
    // left mid-write leaves at most a temporary file.
    runtime.shutdown_timeout(BLOCKING_TASKS_AT_EXIT);
    outcome
}

/// How long the exit waits for blocking tasks still running (see [`start`]).
const BLOCKING_TASKS_AT_EXIT: std::time::Duration = std::time::Duration::from_secs(2);

async fn run(cli: Cli) -> anyhow::Result<()> {
    gpu_dra::telemetry::init_logging(&cli.log)?;
    if matches!(cli.command, Command::Controller(_) | Command::NodeAgent(_)) {
        raise_open_files_limit();
    }
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
        Command::SimulatedMpsControl { foreground, server } => {
            gpu_dra::node_agent::mps_stand_in::run(foreground, server)?
        }
    }
    Ok(())
}

/// See [`gpu_dra::open_files`].
fn raise_open_files_limit() {
    match gpu_dra::open_files::raise_to_hard_limit() {
        Ok((before, after)) if before != after => tracing::info!(before, after, "raised the open-file limit"),
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "could not raise the open-file limit; running with it as it is"),
    }
}

#[cfg(test)]
mod tests {
    use super::error_text;

    #[derive(Debug, thiserror::Error)]
    #[error("read the kubeconfig: {0}")]
    struct Says(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("read the kubeconfig")]
    struct Hides(#[source] std::io::Error);

    #[test]
    fn each_cause_is_said_once() {
        let missing = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let says = anyhow::Error::new(Says(missing())).context("create the client");
        assert_eq!(error_text(&says), "create the client: read the kubeconfig: no such file");
        let hides = anyhow::Error::new(Hides(missing()));
        assert_eq!(error_text(&hides), "read the kubeconfig: no such file");
    }
}
