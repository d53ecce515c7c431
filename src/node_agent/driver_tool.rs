//! A program of the NVIDIA driver (`nvidia-smi`, `nvidia-cuda-mps-control`) as the agent runs it: the one under the
//! driver root, with that driver's libraries.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A driver program and the directory of its libraries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverTool {
    pub program: PathBuf,
    /// The directory of the driver's `libnvidia-ml.so.1`, when it is not where the dynamic loader looks: the program
    /// runs with `LD_LIBRARY_PATH` set to it.
    pub library_dir: Option<PathBuf>,
}

impl DriverTool {
    /// `name` under `driver_root` (`usr/bin`, `bin`), else the one on `PATH`; `nvml_library` is the NVML library
    /// discovery loads (its directory is the library directory when it is a path).
    pub fn find(driver_root: &Path, name: &str, nvml_library: &OsStr) -> Self {
        let program = ["usr/bin", "bin"]
            .iter()
            .find_map(|dir| crate::cdi::existing_in_root(driver_root, &Path::new(dir).join(name)))
            .unwrap_or_else(|| PathBuf::from(name));
        let library_dir = Path::new(nvml_library).parent().filter(|dir| dir.is_absolute()).map(Path::to_path_buf);
        Self { program, library_dir }
    }

    /// The program as a command, with the driver's libraries where the dynamic loader finds them.
    pub fn command(&self) -> Command {
        let mut command = Command::new(&self.program);
        if let Some(dir) = &self.library_dir {
            command.env("LD_LIBRARY_PATH", dir);
        }
        command
    }
}
