//! Setting a GPU's compute time slice, behind one trait like discovery: `nvidia-smi compute-policy` for real GPUs
//! (NVML has no call for it; NVIDIA's own DRA driver runs the same command), a state file for simulated ones so
//! that the whole prepare path, restarts included, runs on machines without GPUs.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::kubelet_plugin::config::TimeSliceInterval;
use crate::node_agent::gpu::Gpu;

/// The simulated GPUs' time slices, under the state directory: `{"gpu-0": "Long"}`, a GPU absent is `Default`.
pub const SIMULATED_FILE: &str = "simulated-time-slices.json";

/// How long one `nvidia-smi` may take before it is given up on (it runs under the prepare lock).
const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a time slice could not be set; the claim's prepare fails with it, and the kubelet retries.
#[derive(Debug, thiserror::Error)]
pub enum TimeSliceError {
    #[error("run {program} ({args}): {source}. Is the NVIDIA driver's nvidia-smi under --driver-root?")]
    Spawn {
        program: String,
        args: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} {args} failed ({status}): {output}")]
    Failed { program: String, args: String, status: String, output: String },
    #[error("{program} {args} did not finish within {timeout:?}; it was killed")]
    TimedOut { program: String, args: String, timeout: Duration },
    #[error("record the simulated time slice in {path}: {source}")]
    Simulated {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The control for `gpu`'s backend: simulated GPUs keep theirs under `state_dir`, for the boot `boot_id`.
pub fn backend(gpu: &crate::cli::GpuArgs, state_dir: &Path, boot_id: &str) -> std::sync::Arc<dyn TimeSliceControl> {
    match gpu.gpu_backend {
        crate::cli::GpuBackend::Simulated => std::sync::Arc::new(SimulatedTimeSlices::for_boot(state_dir, boot_id)),
        crate::cli::GpuBackend::Nvml => std::sync::Arc::new(NvidiaSmi::of(gpu)),
    }
}

/// Sets a GPU's time slice.
pub trait TimeSliceControl: Send + Sync + std::fmt::Debug {
    fn set(&self, gpu: &Gpu, interval: TimeSliceInterval) -> Result<(), TimeSliceError>;
}

/// The number `nvidia-smi compute-policy --set-timeslice` takes: 0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG.
pub fn nvidia_smi_value(interval: TimeSliceInterval) -> u8 {
    match interval {
        TimeSliceInterval::Default => 0,
        TimeSliceInterval::Short => 1,
        TimeSliceInterval::Medium => 2,
        TimeSliceInterval::Long => 3,
    }
}

/// `nvidia-smi` of the driver under the driver root, run with that root's libraries.
#[derive(Debug, Clone)]
pub struct NvidiaSmi {
    program: PathBuf,
    /// The directory of the driver's `libnvidia-ml.so.1`, when it is not where the dynamic loader looks.
    library_dir: Option<PathBuf>,
    timeout: Duration,
}

impl NvidiaSmi {
    /// `nvidia-smi` under `driver_root` (`usr/bin`, `bin`), else the one on `PATH`; `nvml_library` is the NVML
    /// library discovery loads (its directory joins `LD_LIBRARY_PATH` when it is a path).
    pub fn new(driver_root: &Path, nvml_library: &std::ffi::OsStr) -> Self {
        let tool = super::driver_tool::DriverTool::find(driver_root, "nvidia-smi", nvml_library);
        Self { program: tool.program, library_dir: tool.library_dir, timeout: NVIDIA_SMI_TIMEOUT }
    }

    /// The `nvidia-smi` of the driver `gpu` names (its driver root, `/` unless given, and NVML library).
    pub fn of(gpu: &crate::cli::GpuArgs) -> Self {
        Self::new(gpu.driver_root_to_read().unwrap_or(Path::new("/")), &gpu.nvml_library())
    }

    /// A given program and time limit (tests of the process handling).
    pub fn with_program(program: PathBuf, timeout: Duration) -> Self {
        Self { program, library_dir: None, timeout }
    }

    fn run(&self, args: &[String]) -> Result<(), TimeSliceError> {
        let program = self.program.display().to_string();
        let shown = args.join(" ");
        let mut command = Command::new(&self.program);
        command.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        if let Some(dir) = &self.library_dir {
            command.env("LD_LIBRARY_PATH", dir);
        }
        let mut child = command.spawn().map_err(|source| TimeSliceError::Spawn {
            program: program.clone(),
            args: shown.clone(),
            source,
        })?;
        // Drained while it runs, so no amount of output can block it.
        let outputs = [drain(child.stdout.take()), drain(child.stderr.take())];
        let status = match wait_at_most(&mut child, self.timeout) {
            Ok(Some(status)) => status,
            Ok(None) => {
                give_up(child);
                return Err(TimeSliceError::TimedOut { program, args: shown, timeout: self.timeout });
            }
            Err(source) => {
                give_up(child);
                return Err(TimeSliceError::Spawn { program, args: shown, source });
            }
        };
        if status.success() {
            return Ok(());
        }
        let output: String = outputs.into_iter().filter_map(|reader| reader.join().ok()).collect();
        Err(TimeSliceError::Failed {
            program,
            args: shown,
            status: status.to_string(),
            output: output.trim().to_string(),
        })
    }
}

/// Reads a pipe to its end on a thread of its own.
fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
}

/// The child's exit status, or `None` when it has not exited within `limit`.
fn wait_at_most(child: &mut Child, limit: Duration) -> std::io::Result<Option<ExitStatus>> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if started.elapsed() >= limit {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills a child that overran and reaps it on a thread of its own: one stuck in the kernel (a wedged GPU) may not
/// die at once, and the caller holds the prepare lock.
fn give_up(mut child: Child) {
    let _ = child.kill();
    std::thread::spawn(move || child.wait());
}

impl TimeSliceControl for NvidiaSmi {
    fn set(&self, gpu: &Gpu, interval: TimeSliceInterval) -> Result<(), TimeSliceError> {
        let value = nvidia_smi_value(interval).to_string();
        self.run(&["compute-policy".into(), "-i".into(), gpu.uuid.clone(), "--set-timeslice".into(), value])
    }
}

/// Simulated GPUs' time slices, kept in a file like a GPU keeps its setting: across agent restarts.
#[derive(Debug, Clone)]
pub struct SimulatedTimeSlices {
    path: PathBuf,
    /// `<file>.boot` and the boot it is to name: written with the first setting, so an agent that never sets one
    /// leaves no file behind.
    boot: Option<(PathBuf, String)>,
}

impl SimulatedTimeSlices {
    pub fn new(state_dir: &Path) -> Self {
        Self { path: state_dir.join(SIMULATED_FILE), boot: None }
    }

    /// As [`new`](Self::new), and like a real GPU after a reboot: settings recorded during another boot than
    /// `boot_id` (named by `<file>.boot`) are gone.
    pub fn for_boot(state_dir: &Path, boot_id: &str) -> Self {
        let boot_file = state_dir.join(format!("{SIMULATED_FILE}.boot"));
        let path = state_dir.join(SIMULATED_FILE);
        if let Ok(recorded) = std::fs::read_to_string(&boot_file)
            && recorded.trim() != boot_id.trim()
        {
            // Best effort: a file left behind only keeps simulated settings a reboot would have cleared.
            let _ = crate::fsutil::remove_if_exists(&path);
            let _ = crate::fsutil::remove_if_exists(&boot_file);
        }
        Self { path, boot: Some((boot_file, boot_id.trim().to_string())) }
    }

    /// What each simulated GPU is set to (device name → interval); an unreadable file reads as all `Default`.
    pub fn read(path: &Path) -> BTreeMap<String, TimeSliceInterval> {
        std::fs::read(path).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default()
    }
}

impl TimeSliceControl for SimulatedTimeSlices {
    fn set(&self, gpu: &Gpu, interval: TimeSliceInterval) -> Result<(), TimeSliceError> {
        let mut all = Self::read(&self.path);
        match interval {
            TimeSliceInterval::Default => all.remove(&gpu.device_name()),
            other => all.insert(gpu.device_name(), other),
        };
        let bytes = serde_json::to_vec_pretty(&all)
            .map_err(|e| TimeSliceError::Simulated { path: self.path.clone(), source: std::io::Error::other(e) })?;
        if let Some((boot_file, boot_id)) = &self.boot
            && !boot_file.exists()
        {
            crate::fsutil::write_atomic(boot_file, boot_id.as_bytes())
                .map_err(|source| TimeSliceError::Simulated { path: boot_file.clone(), source })?;
        }
        crate::fsutil::write_atomic(&self.path, &bytes)
            .map_err(|source| TimeSliceError::Simulated { path: self.path.clone(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_agent::gpu::test_gpu;

    #[test]
    fn nvidia_smi_numbers() {
        let all =
            [TimeSliceInterval::Default, TimeSliceInterval::Short, TimeSliceInterval::Medium, TimeSliceInterval::Long];
        assert_eq!(all.map(nvidia_smi_value), [0, 1, 2, 3]);
    }

    #[test]
    fn a_failing_nvidia_smi_is_reported_with_its_output() {
        let gpu = test_gpu(0, "0000:01:00.0");
        let failing = NvidiaSmi::with_program("/bin/sh".into(), Duration::from_secs(10));
        // `sh compute-policy …` fails: no such script; its message is part of the error.
        let error = failing.set(&gpu, TimeSliceInterval::Long).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            error.contains("compute-policy -i GPU-00000000-0000-0000-0000-000000000000 --set-timeslice 3"),
            "{error}"
        );
        assert!(error.contains("failed (exit status"), "{error}");
        assert!(error.contains("compute-policy"), "{error}");
        let missing = NvidiaSmi::with_program("/nonexistent/nvidia-smi".into(), Duration::from_secs(10));
        let error = missing.set(&gpu, TimeSliceInterval::Short).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("Is the NVIDIA driver's nvidia-smi under --driver-root?"), "{error}");
    }

    #[test]
    fn a_hung_nvidia_smi_is_given_up_on_in_time() -> Result<(), Box<dyn std::error::Error>> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir()?;
        let hung = dir.path().join("nvidia-smi");
        std::fs::write(&hung, "#!/bin/sh\nexec sleep 30\n")?;
        std::fs::set_permissions(&hung, std::fs::Permissions::from_mode(0o755))?;
        let started = Instant::now();
        let outcome = NvidiaSmi::with_program(hung, Duration::from_millis(300))
            .set(&test_gpu(0, "0000:01:00.0"), TimeSliceInterval::Long);
        assert!(matches!(outcome, Err(TimeSliceError::TimedOut { .. })), "{outcome:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        Ok(())
    }

    #[test]
    fn simulated_gpus_keep_their_time_slice_in_a_file() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let control = SimulatedTimeSlices::new(dir.path());
        control.set(&test_gpu(0, "0000:01:00.0"), TimeSliceInterval::Long)?;
        control.set(&test_gpu(1, "0000:02:00.0"), TimeSliceInterval::Short)?;
        control.set(&test_gpu(1, "0000:02:00.0"), TimeSliceInterval::Default)?;
        let now = SimulatedTimeSlices::read(&dir.path().join(SIMULATED_FILE));
        assert_eq!(now, [("gpu-0".to_string(), TimeSliceInterval::Long)].into());
        // An agent start in the same boot keeps them; one after a reboot finds them gone, as on a real GPU.
        let file = dir.path().join(SIMULATED_FILE);
        let boot_file = dir.path().join(format!("{SIMULATED_FILE}.boot"));
        let started = SimulatedTimeSlices::for_boot(dir.path(), "boot-1");
        assert!(!boot_file.exists(), "nothing set in this boot yet, no file");
        started.set(&test_gpu(2, "0000:03:00.0"), TimeSliceInterval::Short)?;
        assert_eq!(SimulatedTimeSlices::read(&file).len(), 2);
        SimulatedTimeSlices::for_boot(dir.path(), "boot-1");
        assert_eq!(SimulatedTimeSlices::read(&file).len(), 2, "the same boot");
        SimulatedTimeSlices::for_boot(dir.path(), "boot-2");
        assert!(SimulatedTimeSlices::read(&file).is_empty() && !boot_file.exists(), "after a reboot");
        Ok(())
    }
}
