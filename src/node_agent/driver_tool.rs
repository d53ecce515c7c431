//! A program of the NVIDIA driver (`nvidia-smi`, `nvidia-cuda-mps-control`) as the agent runs it: the one under the
//! driver root, with that driver's libraries.
//!
//! The program runs under the agent image's dynamic loader. Pointing `LD_LIBRARY_PATH` at the driver's library
//! directory would make that loader take the C library found there too, wherever the driver's libraries sit beside
//! the system's (a host install's `/usr/lib/x86_64-linux-gnu` or `/usr/lib64`, the GPU Operator's driver container):
//! another glibc's `libc.so.6` under this image's `ld.so` fails at start ("GLIBC_PRIVATE" symbols). So there only
//! the driver's libraries are given: `nvidia-smi` gets NVML preloaded (as NVIDIA's DRA plugin runs it), and the MPS
//! daemon, whose servers load CUDA and more of the driver, a directory of links to the driver's libraries alone.

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use tracing::warn;

/// The driver's own libraries, by file name: CUDA, NVML and the rest of `libnvidia-*`, the video decoder.
const DRIVER_LIBRARY_PREFIXES: [&str; 3] = ["libcuda", "libnvidia-", "libnvcuvid"];

/// A driver program and the directory of its libraries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverTool {
    pub program: PathBuf,
    /// The directory of the driver's `libnvidia-ml.so.1`, when it is not where the dynamic loader looks.
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

    /// The program as a command that finds NVML: `LD_LIBRARY_PATH` set to the library directory where it holds the
    /// driver's libraries only, NVML preloaded where it holds the system's too.
    pub fn command(&self) -> Command {
        let mut command = Command::new(&self.program);
        match &self.library_dir {
            Some(dir) if holds_system_libraries(dir) => {
                command.env("LD_PRELOAD", dir.join("libnvidia-ml.so.1"));
            }
            Some(dir) => {
                command.env("LD_LIBRARY_PATH", dir);
            }
            None => {}
        }
        command
    }

    /// The program as a command that finds all of the driver's libraries (and its children too: the MPS daemon
    /// starts servers that load CUDA): `LD_LIBRARY_PATH` set to the library directory where it holds the driver's
    /// libraries only, else to `links`, a directory of the agent's made to hold links to them alone (refreshed
    /// now: a driver upgraded in place brings other files).
    pub fn command_with_driver_libraries(&self, links: &Path) -> Command {
        let Some(dir) = self.library_dir.as_ref().filter(|dir| holds_system_libraries(dir)) else {
            return self.command();
        };
        let mut command = Command::new(&self.program);
        match link_driver_libraries(dir, links) {
            Ok(()) => {
                command.env("LD_LIBRARY_PATH", links);
            }
            Err(error) => {
                warn!(%error, links = %links.display(), "linking the driver's libraries failed; preloading CUDA and NVML");
                let preload = [dir.join("libcuda.so.1"), dir.join("libnvidia-ml.so.1")];
                command.env("LD_PRELOAD", std::env::join_paths(preload).unwrap_or_default());
            }
        }
        command
    }
}

/// Whether `dir` holds the system's C library beside the driver's.
fn holds_system_libraries(dir: &Path) -> bool {
    dir.join("libc.so.6").exists()
}

/// Makes `links` hold a link to each of the driver's libraries in `dir` (by the name there, so that a soname link
/// the driver updates stays current), and nothing else.
fn link_driver_libraries(dir: &Path, links: &Path) -> io::Result<()> {
    std::fs::create_dir_all(links)?;
    for entry in std::fs::read_dir(links)? {
        let entry = entry?;
        std::fs::remove_file(entry.path())?;
    }
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let text = name.to_string_lossy();
        if DRIVER_LIBRARY_PREFIXES.iter().any(|prefix| text.starts_with(prefix)) && text.contains(".so") {
            std::os::unix::fs::symlink(dir.join(&name), links.join(&name))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(command: &Command) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = command
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_string_lossy().into_owned(), v?.to_string_lossy().into_owned())))
            .collect();
        env.sort();
        env
    }

    /// A host's library directory (the driver's libraries beside the system's C library) never becomes the search
    /// path of a program run under the image's loader; a directory of the driver's alone does.
    #[test]
    fn the_system_c_library_beside_the_drivers_is_never_searched() -> io::Result<()> {
        let host = tempfile::tempdir()?;
        for file in ["libc.so.6", "libstdc++.so.6", "libnvidia-ml.so.1", "libnvidia-ml.so.550.54.15", "libcuda.so.1"] {
            std::fs::write(host.path().join(file), "")?;
        }
        let tool = DriverTool { program: "nvidia-smi".into(), library_dir: Some(host.path().to_path_buf()) };
        let preload = host.path().join("libnvidia-ml.so.1").display().to_string();
        assert_eq!(env_of(&tool.command()), [("LD_PRELOAD".to_string(), preload)]);

        let links = host.path().join("state/links");
        std::fs::create_dir_all(&links)?;
        std::fs::write(links.join("stale.so.1"), "")?;
        let command = tool.command_with_driver_libraries(&links);
        assert_eq!(env_of(&command), [("LD_LIBRARY_PATH".to_string(), links.display().to_string())]);
        let mut linked: Vec<String> = std::fs::read_dir(&links)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()?;
        linked.sort();
        assert_eq!(linked, ["libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ml.so.550.54.15"]);
        assert_eq!(std::fs::read_link(links.join("libcuda.so.1"))?, host.path().join("libcuda.so.1"));

        // GKE's /home/kubernetes/bin/nvidia/lib64: the driver's libraries only.
        let drivers = tempfile::tempdir()?;
        std::fs::write(drivers.path().join("libnvidia-ml.so.1"), "")?;
        let tool = DriverTool { program: "nvidia-smi".into(), library_dir: Some(drivers.path().to_path_buf()) };
        let dir = drivers.path().display().to_string();
        assert_eq!(env_of(&tool.command()), [("LD_LIBRARY_PATH".to_string(), dir.clone())]);
        assert_eq!(env_of(&tool.command_with_driver_libraries(&links)), [("LD_LIBRARY_PATH".to_string(), dir)]);
        Ok(())
    }
}
