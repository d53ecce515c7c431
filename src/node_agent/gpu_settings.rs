//! The GPU settings a claim's configuration changes while it is prepared, behind one trait like discovery: the
//! compute time slice (time-slicing) and the compute mode (`EXCLUSIVE_PROCESS` under an MPS daemon). Real GPUs are
//! set with the driver's `nvidia-smi` (`compute-policy --set-timeslice`, which NVML has no call for, and `-c`: the
//! commands NVIDIA's own DRA driver runs); simulated ones keep theirs in state files, so that the whole prepare
//! path, restarts included, runs on machines without GPUs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::bounded_run::{self, Outcome};
use super::driver_tool::DriverTool;

use crate::kubelet_plugin::config::TimeSliceInterval;
use crate::node_agent::gpu::Gpu;

/// The simulated GPUs' time slices, under the state directory: `{"gpu-0": "Long"}`, a GPU absent is `Default`.
pub const SIMULATED_FILE: &str = "simulated-time-slices.json";
/// The simulated GPUs' compute modes, beside it: `{"gpu-0": "ExclusiveProcess"}`, a GPU absent is `Default`.
pub const SIMULATED_COMPUTE_MODES: &str = "simulated-compute-modes.json";

/// How long one `nvidia-smi` may take before it is given up on (it runs under the prepare lock).
const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a setting could not be changed; the claim's prepare fails with it, and the kubelet retries.
#[derive(Debug, thiserror::Error)]
pub enum GpuSettingError {
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
    #[error("record the simulated setting in {path}: {source}")]
    Simulated {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The settings of `gpu`'s backend: simulated GPUs keep theirs under `state_dir`, for the boot `boot_id`.
pub fn backend(gpu: &crate::cli::GpuArgs, state_dir: &Path, boot_id: &str) -> std::sync::Arc<dyn GpuSettings> {
    match gpu.gpu_backend {
        crate::cli::GpuBackend::Simulated => std::sync::Arc::new(SimulatedGpuSettings::for_boot(state_dir, boot_id)),
        crate::cli::GpuBackend::Nvml => std::sync::Arc::new(NvidiaSmi::of(gpu)),
    }
}

/// Sets a GPU's time slice and compute mode.
pub trait GpuSettings: Send + Sync + std::fmt::Debug {
    fn set_time_slice(&self, gpu: &Gpu, interval: TimeSliceInterval) -> Result<(), GpuSettingError>;
    fn set_compute_mode(&self, gpu: &Gpu, mode: ComputeMode) -> Result<(), GpuSettingError>;
}

/// A GPU's compute mode, of those the agent sets: `ExclusiveProcess` while an MPS daemon serves the GPU (only its
/// MPS server may then make a CUDA context on it, so a container cannot bypass the daemon and its limits), else
/// `Default`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ComputeMode {
    #[default]
    Default,
    ExclusiveProcess,
}

impl ComputeMode {
    /// The name `nvidia-smi -c` takes.
    pub fn nvidia_smi_name(self) -> &'static str {
        match self {
            ComputeMode::Default => "DEFAULT",
            ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
        }
    }
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
    tool: DriverTool,
    timeout: Duration,
}

impl NvidiaSmi {
    /// `nvidia-smi` under `driver_root` (`usr/bin`, `bin`), else the one on `PATH`, with the NVML library under it
    /// preloaded; both looked for at each run.
    pub fn new(driver_root: &Path) -> Self {
        Self { tool: DriverTool::find(driver_root, "nvidia-smi"), timeout: NVIDIA_SMI_TIMEOUT }
    }

    /// The `nvidia-smi` of the driver `gpu` names (its driver root, `/` unless given, and NVML library).
    pub fn of(gpu: &crate::cli::GpuArgs) -> Self {
        Self::new(gpu.nvml_root())
    }

    /// A given program and time limit (tests of the process handling).
    pub fn with_program(program: PathBuf, timeout: Duration) -> Self {
        Self { tool: DriverTool::Given(program), timeout }
    }

    fn run(&self, args: &[String]) -> Result<(), GpuSettingError> {
        let program = self.tool.program().display().to_string();
        let shown = args.join(" ");
        let mut command = self.tool.command();
        command.args(args);
        match bounded_run::run(command, None, self.timeout) {
            Ok(Outcome::Exited { status, .. }) if status.success() => Ok(()),
            Ok(Outcome::Exited { status, stdout, stderr }) => Err(GpuSettingError::Failed {
                program,
                args: shown,
                status: status.to_string(),
                output: format!("{stdout}{stderr}").trim().to_string(),
            }),
            Ok(Outcome::TimedOut) => Err(GpuSettingError::TimedOut { program, args: shown, timeout: self.timeout }),
            Err(source) => Err(GpuSettingError::Spawn { program, args: shown, source }),
        }
    }
}

impl GpuSettings for NvidiaSmi {
    fn set_time_slice(&self, gpu: &Gpu, interval: TimeSliceInterval) -> Result<(), GpuSettingError> {
        let value = nvidia_smi_value(interval).to_string();
        self.run(&["compute-policy".into(), "-i".into(), gpu.uuid.clone(), "--set-timeslice".into(), value])
    }

    fn set_compute_mode(&self, gpu: &Gpu, mode: ComputeMode) -> Result<(), GpuSettingError> {
        self.run(&["-i".into(), gpu.uuid.clone(), "-c".into(), mode.nvidia_smi_name().into()])
    }
}

/// Simulated GPUs' settings, kept in files like a GPU keeps them: across agent restarts, not across reboots.
#[derive(Debug, Clone)]
pub struct SimulatedGpuSettings {
    dir: PathBuf,
    /// `<time slice file>.boot` and the boot it is to name: written with the first setting, so an agent that never
    /// sets one leaves no file behind.
    boot: Option<(PathBuf, String)>,
}

impl SimulatedGpuSettings {
    pub fn new(state_dir: &Path) -> Self {
        Self { dir: state_dir.to_path_buf(), boot: None }
    }

    /// As [`new`](Self::new), and like a real GPU after a reboot: settings recorded during another boot than
    /// `boot_id` (named by `<file>.boot`) are gone.
    pub fn for_boot(state_dir: &Path, boot_id: &str) -> Self {
        let boot_file = state_dir.join(format!("{SIMULATED_FILE}.boot"));
        if let Ok(recorded) = std::fs::read_to_string(&boot_file)
            && recorded.trim() != boot_id.trim()
        {
            // Best effort: a file left behind only keeps simulated settings a reboot would have cleared.
            for file in [SIMULATED_FILE, SIMULATED_COMPUTE_MODES] {
                let _ = crate::fsutil::remove_if_exists(&state_dir.join(file));
            }
            let _ = crate::fsutil::remove_if_exists(&boot_file);
        }
        Self { dir: state_dir.to_path_buf(), boot: Some((boot_file, boot_id.trim().to_string())) }
    }

    /// What each simulated GPU is set to in `path` (device name → setting); an unreadable file reads as all default.
    pub fn read<T: serde::de::DeserializeOwned>(path: &Path) -> BTreeMap<String, T> {
        std::fs::read(path).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok()).unwrap_or_default()
    }

    /// Records `gpu`'s setting in `file`: `value`, or none (absent) when it is the default.
    fn record<T>(&self, file: &str, gpu: &Gpu, value: T) -> Result<(), GpuSettingError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned + Default + PartialEq,
    {
        let path = self.dir.join(file);
        let failed = |source| GpuSettingError::Simulated { path: path.clone(), source };
        let mut all: BTreeMap<String, T> = Self::read(&path);
        if value == T::default() {
            all.remove(&gpu.device_name());
        } else {
            all.insert(gpu.device_name(), value);
        }
        let bytes = serde_json::to_vec_pretty(&all).map_err(|e| failed(std::io::Error::other(e)))?;
        if let Some((boot_file, boot_id)) = &self.boot
            && !boot_file.exists()
        {
            crate::fsutil::write_atomic(boot_file, boot_id.as_bytes())
                .map_err(|source| GpuSettingError::Simulated { path: boot_file.clone(), source })?;
        }
        crate::fsutil::write_atomic(&path, &bytes).map_err(failed)
    }
}

impl GpuSettings for SimulatedGpuSettings {
    fn set_time_slice(&self, gpu: &Gpu, interval: TimeSliceInterval) -> Result<(), GpuSettingError> {
        self.record(SIMULATED_FILE, gpu, interval)
    }

    fn set_compute_mode(&self, gpu: &Gpu, mode: ComputeMode) -> Result<(), GpuSettingError> {
        self.record(SIMULATED_COMPUTE_MODES, gpu, mode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_agent::gpu::test_gpu;
    use std::time::Instant;

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
        let error =
            failing.set_time_slice(&gpu, TimeSliceInterval::Long).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            error.contains("compute-policy -i GPU-00000000-0000-0000-0000-000000000000 --set-timeslice 3"),
            "{error}"
        );
        assert!(error.contains("failed (exit status"), "{error}");
        assert!(error.contains("compute-policy"), "{error}");
        let missing = NvidiaSmi::with_program("/nonexistent/nvidia-smi".into(), Duration::from_secs(10));
        let error =
            missing.set_time_slice(&gpu, TimeSliceInterval::Short).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("Is the NVIDIA driver's nvidia-smi under --driver-root?"), "{error}");
    }

    /// Held by a test while it writes and runs a script: a script run while another thread's fork still holds a
    /// just-written one open for writing fails with ETXTBSY ("Text file busy").
    static SCRIPTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// An executable `nvidia-smi` in `dir` that runs `script`.
    fn fake_nvidia_smi(dir: &tempfile::TempDir, script: &str) -> std::io::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.path().join("nvidia-smi");
        std::fs::write(&path, format!("#!/bin/sh\n{script}\n"))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        Ok(path)
    }

    #[test]
    fn a_hung_nvidia_smi_is_given_up_on_in_time() -> Result<(), Box<dyn std::error::Error>> {
        let _scripts = SCRIPTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let dir = tempfile::tempdir()?;
        let hung = fake_nvidia_smi(&dir, "exec sleep 30")?;
        let started = Instant::now();
        let outcome = NvidiaSmi::with_program(hung, Duration::from_millis(300))
            .set_time_slice(&test_gpu(0, "0000:01:00.0"), TimeSliceInterval::Long);
        assert!(matches!(outcome, Err(GpuSettingError::TimedOut { .. })), "{outcome:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        Ok(())
    }

    #[test]
    fn nvidia_smi_is_asked_for_the_compute_mode() -> Result<(), Box<dyn std::error::Error>> {
        let _scripts = SCRIPTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let dir = tempfile::tempdir()?;
        let refusing = fake_nvidia_smi(&dir, "echo \"Insufficient Permissions\" >&2; exit 4")?;
        let gpu = test_gpu(0, "0000:01:00.0");
        let failing = NvidiaSmi::with_program(refusing, Duration::from_secs(10));
        let error = failing.set_compute_mode(&gpu, ComputeMode::ExclusiveProcess).err().map(|e| e.to_string());
        let error = error.unwrap_or_default();
        assert!(error.contains("-i GPU-00000000-0000-0000-0000-000000000000 -c EXCLUSIVE_PROCESS"), "{error}");
        assert!(error.contains("failed (exit status: 4): Insufficient Permissions"), "{error}");
        assert_eq!(ComputeMode::Default.nvidia_smi_name(), "DEFAULT");
        Ok(())
    }

    #[test]
    fn simulated_gpus_keep_their_settings_in_files() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let control = SimulatedGpuSettings::new(dir.path());
        control.set_time_slice(&test_gpu(0, "0000:01:00.0"), TimeSliceInterval::Long)?;
        control.set_time_slice(&test_gpu(1, "0000:02:00.0"), TimeSliceInterval::Short)?;
        control.set_time_slice(&test_gpu(1, "0000:02:00.0"), TimeSliceInterval::Default)?;
        control.set_compute_mode(&test_gpu(1, "0000:02:00.0"), ComputeMode::ExclusiveProcess)?;
        let file = dir.path().join(SIMULATED_FILE);
        let modes = dir.path().join(SIMULATED_COMPUTE_MODES);
        let now: BTreeMap<String, TimeSliceInterval> = SimulatedGpuSettings::read(&file);
        assert_eq!(now, [("gpu-0".to_string(), TimeSliceInterval::Long)].into());
        let now: BTreeMap<String, ComputeMode> = SimulatedGpuSettings::read(&modes);
        assert_eq!(now, [("gpu-1".to_string(), ComputeMode::ExclusiveProcess)].into());
        control.set_compute_mode(&test_gpu(1, "0000:02:00.0"), ComputeMode::Default)?;
        assert!(SimulatedGpuSettings::read::<ComputeMode>(&modes).is_empty());
        control.set_compute_mode(&test_gpu(1, "0000:02:00.0"), ComputeMode::ExclusiveProcess)?;
        // An agent start in the same boot keeps them; one after a reboot finds them gone, as on a real GPU.
        let boot_file = dir.path().join(format!("{SIMULATED_FILE}.boot"));
        let started = SimulatedGpuSettings::for_boot(dir.path(), "boot-1");
        assert!(!boot_file.exists(), "nothing set in this boot yet, no file");
        started.set_time_slice(&test_gpu(2, "0000:03:00.0"), TimeSliceInterval::Short)?;
        assert_eq!(SimulatedGpuSettings::read::<TimeSliceInterval>(&file).len(), 2);
        SimulatedGpuSettings::for_boot(dir.path(), "boot-1");
        assert_eq!(SimulatedGpuSettings::read::<TimeSliceInterval>(&file).len(), 2, "the same boot");
        SimulatedGpuSettings::for_boot(dir.path(), "boot-2");
        assert!(SimulatedGpuSettings::read::<TimeSliceInterval>(&file).is_empty(), "after a reboot");
        assert!(SimulatedGpuSettings::read::<ComputeMode>(&modes).is_empty() && !boot_file.exists());
        Ok(())
    }
}
