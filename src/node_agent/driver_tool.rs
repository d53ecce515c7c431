//! A program of the NVIDIA driver (`nvidia-smi`, `nvidia-cuda-mps-control`) as the agent runs it: the one under the
//! driver root, with that driver's libraries.
//!
//! The program runs under the agent image's dynamic loader. Pointing `LD_LIBRARY_PATH` at the driver's library
//! directory would make that loader take the C library found there too, wherever the driver's libraries sit beside
//! the system's (a host install's `/usr/lib/x86_64-linux-gnu` or `/usr/lib64`, the GPU Operator's driver container):
//! another glibc's `libc.so.6` under this image's `ld.so` fails at start ("GLIBC_PRIVATE" symbols). So only the
//! driver's libraries are given: `nvidia-smi` gets NVML preloaded (as NVIDIA's DRA plugin runs it), and the MPS
//! daemon, whose servers load CUDA and more of the driver, a directory of links to the driver's libraries alone.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The driver's own libraries, by file name: CUDA, NVML and the rest of `libnvidia-*`, the video decoder.
const DRIVER_LIBRARY_PREFIXES: [&str; 3] = ["libcuda", "libnvidia-", "libnvcuvid"];

/// A driver program and the directory of its libraries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverTool {
    /// The program of this name under the driver root, with the NVML library there, looked for again at each run (a
    /// driver root mounted after the agent started holds them later).
    Under { root: PathBuf, name: String },
    /// A program as it is, without the driver's libraries (tests, the simulated MPS daemon).
    Given(PathBuf),
}

impl DriverTool {
    /// `name` under `driver_root` (`usr/bin`, `bin`), else the one on `PATH`, with the NVML library under it
    /// ([`crate::node_agent::discovery::nvml::library_in`]), each looked for again at every run.
    pub fn find(driver_root: &Path, name: &str) -> Self {
        Self::Under { root: driver_root.to_path_buf(), name: name.to_string() }
    }

    /// The program now: under the driver root, else its name for `PATH`.
    pub fn program(&self) -> PathBuf {
        match self {
            Self::Given(program) => program.clone(),
            Self::Under { root, name } => ["usr/bin", "bin"]
                .iter()
                .find_map(|dir| crate::cdi::existing_in_root(root, &Path::new(dir).join(name)))
                .unwrap_or_else(|| PathBuf::from(name)),
        }
    }

    /// The driver's `libnvidia-ml.so.1` now, when it is not where the dynamic loader looks; its directory holds the
    /// driver's other libraries.
    pub fn nvml(&self) -> Option<PathBuf> {
        let Self::Under { root, .. } = self else { return None };
        Some(PathBuf::from(crate::node_agent::discovery::nvml::library_in(root))).filter(|path| path.is_absolute())
    }

    /// The program as a command that finds NVML: the driver's NVML preloaded, so that the program's own
    /// `dlopen("libnvidia-ml.so.1")` gets it and nothing else of that directory is searched.
    pub fn command(&self) -> Command {
        let mut command = Command::new(self.program());
        if let Some(nvml) = self.nvml() {
            command.env("LD_PRELOAD", nvml);
        }
        command
    }

    /// Makes `links` (a directory of the agent's) hold a link to each of the driver's libraries and nothing else,
    /// for [`Self::command_with_links`]; again at each start of a program, as a driver upgraded in place brings
    /// other files. Nothing to do where the loader finds the driver by itself.
    pub fn link_driver_libraries(&self, links: &Path) -> io::Result<()> {
        match self.nvml().as_deref().and_then(Path::parent) {
            Some(dir) => link_driver_libraries(dir, links),
            None => Ok(()),
        }
    }

    /// The program as a command that finds all of the driver's libraries, and so do its children (the MPS daemon
    /// starts servers that load CUDA): `LD_LIBRARY_PATH` set to `links` ([`Self::link_driver_libraries`]).
    pub fn command_with_links(&self, links: &Path) -> Command {
        let mut command = Command::new(self.program());
        if self.nvml().is_some() {
            command.env("LD_LIBRARY_PATH", links);
        }
        command
    }
}

/// Makes `links` hold a link to each of the driver's libraries in `dir` and nothing else. Each link names the file
/// it resolves to now where it can be resolved (an upgrade relinks them all here), else the name in `dir`.
fn link_driver_libraries(dir: &Path, links: &Path) -> io::Result<()> {
    std::fs::create_dir_all(links)?;
    for entry in std::fs::read_dir(links)? {
        match std::fs::remove_file(entry?.path()) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let text = name.to_string_lossy();
        if !(DRIVER_LIBRARY_PREFIXES.iter().any(|prefix| text.starts_with(prefix)) && text.contains(".so")) {
            continue;
        }
        let target = std::fs::canonicalize(dir.join(&name)).unwrap_or_else(|_| dir.join(&name));
        match std::os::unix::fs::symlink(target, links.join(&name)) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
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
    /// path of a program run under the image's loader: NVML is preloaded, or a directory of links to the driver's
    /// libraries alone is searched.
    #[test]
    fn the_system_c_library_beside_the_drivers_is_never_searched() -> io::Result<()> {
        let host = tempfile::tempdir()?;
        for file in ["libc.so.6", "libstdc++.so.6", "libnvidia-ml.so.550.54.15", "libcuda.so.550.54.15"] {
            std::fs::write(host.path().join(file), "")?;
        }
        std::os::unix::fs::symlink("libnvidia-ml.so.550.54.15", host.path().join("libnvidia-ml.so.1"))?;
        std::os::unix::fs::symlink("libcuda.so.550.54.15", host.path().join("libcuda.so.1"))?;
        // The host's root, its libraries in usr/lib64 (a RHEL-family host).
        let root = host.path();
        let lib64 = root.join("usr/lib64");
        std::fs::create_dir_all(&lib64)?;
        for entry in std::fs::read_dir(root)? {
            let entry = entry?;
            if entry.file_type()?.is_file() || entry.file_type()?.is_symlink() {
                std::fs::rename(entry.path(), lib64.join(entry.file_name()))?;
            }
        }
        let nvml = lib64.join("libnvidia-ml.so.1");
        let tool = DriverTool::find(root, "nvidia-smi");
        assert_eq!(env_of(&tool.command()), [("LD_PRELOAD".to_string(), nvml.display().to_string())]);

        let links = host.path().join("state/links");
        std::fs::create_dir_all(&links)?;
        std::fs::write(links.join("stale.so.1"), "")?;
        tool.link_driver_libraries(&links)?;
        tool.link_driver_libraries(&links)?;
        let command = tool.command_with_links(&links);
        assert_eq!(env_of(&command), [("LD_LIBRARY_PATH".to_string(), links.display().to_string())]);
        let mut linked: Vec<String> = std::fs::read_dir(&links)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()?;
        linked.sort();
        let expected = ["libcuda.so.1", "libcuda.so.550.54.15", "libnvidia-ml.so.1", "libnvidia-ml.so.550.54.15"];
        assert_eq!(linked, expected);
        let real = std::fs::canonicalize(lib64.join("libcuda.so.550.54.15"))?;
        assert_eq!(std::fs::read_link(links.join("libcuda.so.1"))?, real, "linked to the file it resolves to");

        // No driver under a root (yet): nothing set, and the program by its name.
        let empty = tempfile::tempdir()?;
        let plain = DriverTool::find(empty.path(), "nvidia-smi");
        assert!(env_of(&plain.command()).is_empty() && env_of(&plain.command_with_links(&links)).is_empty());
        assert_eq!(plain.program(), PathBuf::from("nvidia-smi"));
        Ok(())
    }
}
