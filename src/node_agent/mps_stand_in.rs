//! The simulated backend's MPS control daemon (`gpu-dra simulated-mps-control`): the same command line, environment
//! and control pipe as `nvidia-cuda-mps-control`, so that [`super::mps_control`] starts, supervises and stops it
//! exactly as it does the real one, on machines without GPUs.
//!
//! With `-f` it is the daemon: it creates the control pipe (`$CUDA_MPS_PIPE_DIRECTORY/control`, a Unix socket),
//! writes `control.log` under `$CUDA_MPS_LOG_DIRECTORY` with the devices and limits it was given, leaves a file in
//! the `/dev/shm` it sees (so a test can tell that it is the claim's), starts its server (`--server`, logged as
//! `server pid=…`; the real daemon starts `nvidia-cuda-mps-server` for its first client) and serves until a client
//! sends `quit`, when it stops its server and exits. A daemon killed leaves its server behind, as the real one does.
//! Without `-f` it is the client: it sends its standard input to the daemon, as `echo quit | nvidia-cuda-mps-control`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::Context as _;

use super::mps_control::CONTROL_PIPE;

/// The file the daemon leaves in its `/dev/shm`, holding its pid.
pub const SHM_MARKER: &str = "gpu-dra-mps-stand-in";

pub fn run(foreground: bool, server: bool) -> anyhow::Result<()> {
    if server {
        // Serves until killed: with its daemon on `quit`, or by the agent with the daemon's process group.
        loop {
            std::thread::park();
        }
    }
    let pipe =
        PathBuf::from(std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").context("CUDA_MPS_PIPE_DIRECTORY is not set")?);
    if foreground { daemon(pipe) } else { client(pipe) }
}

fn daemon(pipe: PathBuf) -> anyhow::Result<()> {
    let log_dir =
        PathBuf::from(std::env::var_os("CUDA_MPS_LOG_DIRECTORY").context("CUDA_MPS_LOG_DIRECTORY is not set")?);
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(log_dir.join("control.log"))?;
    let env = |name: &str| std::env::var(name).unwrap_or_default();
    let pid = std::process::id();
    std::fs::write(PathBuf::from("/dev/shm").join(SHM_MARKER), pid.to_string()).context("write to /dev/shm")?;
    let mut server = Command::new(std::env::current_exe()?)
        .args(["simulated-mps-control", "--server"])
        .stdin(Stdio::null())
        .spawn()
        .context("start the MPS server")?;
    writeln!(log, "server pid={}", server.id())?;
    let listener = UnixListener::bind(pipe.join(CONTROL_PIPE)).context("create the control pipe")?;
    writeln!(
        log,
        "started pid={pid} devices={} active_thread_percentage={} pinned_device_mem_limit={}",
        env("CUDA_VISIBLE_DEVICES"),
        env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    )?;
    for connection in listener.incoming() {
        let Ok(connection) = connection else { continue };
        for line in BufReader::new(connection).lines() {
            let command = line.unwrap_or_default();
            writeln!(log, "command {command}")?;
            if command.trim() == "quit" {
                let _ = server.kill();
                let _ = server.wait();
                let _ = std::fs::remove_file(pipe.join(CONTROL_PIPE));
                writeln!(log, "quit pid={pid}")?;
                return Ok(());
            }
        }
    }
    Ok(())
}

fn client(pipe: PathBuf) -> anyhow::Result<()> {
    let mut commands = Vec::new();
    std::io::stdin().read_to_end(&mut commands)?;
    let mut daemon = UnixStream::connect(pipe.join(CONTROL_PIPE)).context("connect to the MPS control daemon")?;
    daemon.write_all(&commands)?;
    Ok(())
}
