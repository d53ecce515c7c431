//! The NVIDIA user-space driver files a CUDA container needs, found under the driver root.
//!
//! The kernel driver is the node's, so the user-space half (`libcuda.so.1`, NVML, the JIT compilers, `nvidia-smi`)
//! must come from the node too, in exactly the node's version: a container with the device nodes but without these
//! libraries sees its GPU and cannot use it. Each file is bind-mounted read-only at its own path.
//!
//! The driver root may be a foreign tree (the GPU Operator's driver container under `/run/nvidia/driver`), so every
//! symlink is resolved *inside* that root, as `chroot` would: an absolute target such as
//! `/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15` means that path under the root, and `..` never climbs above it.
//! Otherwise a link in the driver tree could make the agent mount an arbitrary host file into every GPU container.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::CdiError;

/// The libraries a CUDA (and OpenCL) container needs, as file name prefixes (`libcuda.so` matches `libcuda.so.1`):
/// the compute ones the NVIDIA Container Toolkit mounts, the video codecs (NVDEC/NVENC, optical flow) and, for
/// confidential computing and NVSwitch systems, PKCS#11 and NSCQ.
const LIBRARY_PREFIXES: &[&str] = &[
    "libcuda.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-nvvm70.so",
    "libcudadebugger.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-opencl.so",
    "libnvcuvid.so",
    "libnvidia-encode.so",
    "libnvidia-opticalflow.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nscq.so",
    // Tile IR's compiler (drivers 590 and later), which the CUDA library loads by its full versioned name.
    "libnvidia-tileiras.so",
];

/// Where distributions (Debian multiarch, RHEL, the GPU Operator's driver image) put those libraries.
const LIBRARY_DIRS: &[&str] = &[
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib",
];

/// Where CUDA-based images (NVIDIA's `nvidia/cuda`, and PyTorch's and the others built on them) look for the
/// driver's libraries first: their `LD_LIBRARY_PATH` names it. Each library is mounted there as well as at its own
/// path, because a container's dynamic linker searches only its own distribution's directories: an Ubuntu image on a
/// RHEL-family node (libraries in `/usr/lib64`) would not find `libcuda.so.1` at the node's path, nor a UBI image on
/// an Ubuntu node (`/usr/lib/x86_64-linux-gnu`).
const CUDA_IMAGE_LIBRARY_DIR: &str = "/usr/local/nvidia/lib64";

/// Where images not built on CUDA's find a library with nothing on their `LD_LIBRARY_PATH` (`python:3-slim` with
/// pip's PyTorch asking for `libcuda.so.1`): their C library's default directories, Debian's multiarch one and the
/// RHEL family's `/usr/lib64`. Each library is mounted in both as well, so an image of either family finds the
/// driver of a node of either (the NVIDIA Container Toolkit gets there by running `ldconfig` in the container).
/// Only the names a loader asks for go there (`libcuda.so.1`, and `libcuda.so` for those that link): the versioned
/// files are reached through them at the library's own path.
#[cfg(target_arch = "aarch64")]
const DEFAULT_LIBRARY_DIRS: [&str; 2] = ["/usr/lib/aarch64-linux-gnu", "/usr/lib64"];
#[cfg(target_arch = "powerpc64")]
const DEFAULT_LIBRARY_DIRS: [&str; 2] = ["/usr/lib/powerpc64le-linux-gnu", "/usr/lib64"];
#[cfg(not(any(target_arch = "aarch64", target_arch = "powerpc64")))]
const DEFAULT_LIBRARY_DIRS: [&str; 2] = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"];

/// Which directory's library goes under [`CUDA_IMAGE_LIBRARY_DIR`] when several hold one name, first first: the
/// 64-bit ones; `usr/lib` and `lib` last, where a RHEL-family node keeps its 32-bit libraries.
const ALIAS_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib",
    "/lib",
];

/// The utilities workloads and their tooling expect (`nvidia-smi` above all).
const UTILITIES: &[&str] =
    &["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"];

const UTILITY_DIRS: &[&str] = &["usr/bin", "bin", "usr/sbin"];

/// The GSP firmware of driver version `<v>` lives in `<FIRMWARE_DIR>/<v>/`.
const FIRMWARE_DIR: &str = "lib/firmware/nvidia";

/// The library the CUDA runtime loads: without it the driver root is not a driver installation.
const CUDA_LIBRARY: &str = "libcuda.so.1";

/// Symlinks followed while resolving one path before giving up (Linux's own limit), so a loop ends.
const MAX_SYMLINKS: usize = 40;

/// One driver file: bind-mount `host_path` read-only at `container_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverMount {
    host_path: PathBuf,
    container_path: PathBuf,
}

impl DriverMount {
    /// The real file on the host (symlinks resolved inside the driver root; the driver root included).
    pub fn host_path(&self) -> &Path {
        &self.host_path
    }

    /// Where the container sees it: the name found in the driver tree (`/usr/lib/x86_64-linux-gnu/libcuda.so.1`),
    /// so the sonames the dynamic linker looks for exist as plain files.
    pub fn container_path(&self) -> &Path {
        &self.container_path
    }
}

/// The driver files to mount into every GPU container, kept current: a driver upgraded in place (new
/// `libcuda.so.<version>`, the old one removed, firmware of the new version) is found again before the next spec is
/// built, without restarting the agent. Cheap to clone (one shared record per driver root).
#[derive(Clone, Debug, Default)]
pub struct DriverFiles {
    /// `None`: no driver files at all.
    tracked: Option<Arc<Tracked>>,
    simulated: bool,
    /// Where the host's `/dev` is seen (`None`: at `/dev`, as the chart mounts it).
    dev_root: Option<PathBuf>,
}

/// One driver root and the files last found under it.
#[derive(Debug)]
struct Tracked {
    /// As configured (`--driver-root`), canonicalized anew at every check.
    root: PathBuf,
    /// Where the container runtime sees `root`, when that differs (see [`DriverFiles::seen_from_host`]).
    host_root: Option<PathBuf>,
    /// `None` until a discovery succeeds (see [`DriverFiles::awaiting`]).
    current: Mutex<Option<Found>>,
    /// How many times the files were found anew since the first discovery: specs written before name files that
    /// may be gone (see [`DriverFiles::changes`]).
    changes: AtomicU64,
}

/// What one discovery found.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Found {
    /// The canonical driver root.
    root: PathBuf,
    /// Container path → path relative to the root, symlinks resolved; sorted by container path.
    files: Vec<(PathBuf, PathBuf)>,
    /// From the real CUDA library's name (`libcuda.so.550.54.15`), when it has one.
    version: Option<String>,
}

impl DriverFiles {
    /// The simulated GPU backend's (machines without GPUs, tests, the demo): no driver files at all, and device
    /// nodes described in full (type, major, minor) so that a runtime injects them without looking for them on the
    /// host, where they do not exist. A container given such a spec starts but cannot run CUDA. Real GPUs need
    /// [`Self::discover`].
    pub fn simulated() -> Self {
        Self { tracked: None, simulated: true, dev_root: None }
    }

    /// Whether specs describe simulated device nodes ([`Self::simulated`], [`Self::with_simulated_devices`]).
    pub fn is_simulated(&self) -> bool {
        self.simulated
    }

    /// Whether the host has the device node `path` (`/dev/…`), looked up where the agent sees the host's `/dev`.
    /// Simulated GPUs have every node, unless a root to look them up under was given ([`Self::with_dev_root`]).
    pub fn has_device_node(&self, path: &str) -> bool {
        match &self.dev_root {
            None if self.simulated => true,
            root => root.as_deref().unwrap_or(Path::new("/")).join(path.trim_start_matches('/')).exists(),
        }
    }

    /// Device nodes are looked up under `root` instead of `/` ([`Self::has_device_node`]): for simulated GPUs
    /// (`--simulated-dev-root`) and tests.
    pub fn with_dev_root(mut self, root: &Path) -> Self {
        self.dev_root = Some(root.to_path_buf());
        self
    }

    /// The same driver files for simulated GPUs: their device nodes are described in full, as [`Self::simulated`]'s,
    /// while the driver's files are mounted (simulated GPUs beside a driver tree: tests of what real nodes get).
    pub fn with_simulated_devices(mut self) -> Self {
        self.simulated = true;
        self
    }

    /// Finds the driver files under `driver_root` (`/` on most nodes) now, and tracks them from then on (see
    /// [`Self::mounts`]).
    ///
    /// Fails when the root is missing or holds no `libcuda.so.1`: a spec without the driver would give containers
    /// GPUs they cannot use, which is worse than failing prepare with an error that says what to fix.
    pub fn discover(driver_root: &Path) -> Result<Self, CdiError> {
        let found = Found::discover(driver_root)?;
        Ok(Self::tracking(driver_root, Some(found)))
    }

    /// The driver files under `driver_root` once they are there: [`Self::mounts`] looks for them at every call and
    /// fails, saying what is missing, until they are found. For a plugin that must serve while the driver is not
    /// usable yet (being installed, or broken by an upgrade without a reboot): unprepare needs no driver file, and
    /// a prepare then fails with the reason.
    pub fn awaiting(driver_root: &Path) -> Self {
        Self::tracking(driver_root, None)
    }

    fn tracking(driver_root: &Path, found: Option<Found>) -> Self {
        let tracked = Tracked {
            root: driver_root.to_path_buf(),
            host_root: None,
            current: Mutex::new(found),
            changes: AtomicU64::new(0),
        };
        Self { tracked: Some(Arc::new(tracked)), simulated: false, dev_root: None }
    }

    /// How many times the driver's files changed under it (a driver upgraded in place), or were found at last after
    /// [`Self::awaiting`]: each change makes the specs written before it name files that may no longer exist.
    /// Checked by [`Self::mounts`]; always 0 without a driver root.
    pub fn changes(&self) -> u64 {
        self.tracked.as_ref().map_or(0, |t| t.changes.load(Ordering::Acquire))
    }

    /// The same files with host paths as the container runtime sees them, when this process sees the driver root
    /// somewhere else: in a DaemonSet the host's `/run/nvidia/driver` is mounted at, say, `/driver-root`, but the
    /// runtime reads CDI `hostPath`s on the host.
    pub fn seen_from_host(self, host_root: &Path) -> Self {
        let Some(tracked) = &self.tracked else { return self };
        let current = tracked.current.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let tracked = Tracked {
            root: tracked.root.clone(),
            host_root: Some(host_root.to_path_buf()),
            current: Mutex::new(current),
            changes: AtomicU64::new(tracked.changes.load(Ordering::Acquire)),
        };
        Self { tracked: Some(Arc::new(tracked)), simulated: self.simulated, dev_root: self.dev_root.clone() }
    }

    /// The mounts, sorted by container path, as they are now. Every call checks that the files last found are
    /// still the driver's: each container path still resolves to the same file, which still exists (a few `lstat`s
    /// per file). An upgrade in place changes that (`libcuda.so.1` points at the new version, the old library and
    /// firmware are removed), and the files are then discovered again. Fails when that discovery fails (the driver
    /// is half-installed, or gone): a spec naming files that do not exist would make every container fail instead.
    pub fn mounts(&self) -> Result<Vec<DriverMount>, CdiError> {
        let Some(tracked) = &self.tracked else { return Ok(Vec::new()) };
        let mut current = tracked.current.lock().unwrap_or_else(PoisonError::into_inner);
        let current = match &mut *current {
            Some(found) if found.still_there(&tracked.root) => found,
            Some(found) => {
                let new = Found::discover(&tracked.root)?;
                tracing::info!(
                    driver_root = %tracked.root.display(),
                    from_version = found.version.as_deref().unwrap_or("unknown"),
                    to_version = new.version.as_deref().unwrap_or("unknown"),
                    files = new.files.len(),
                    "the driver's files changed (driver upgraded in place?): discovered them again"
                );
                tracked.changes.fetch_add(1, Ordering::AcqRel);
                *found = new;
                found
            }
            none @ None => {
                let new = Found::discover(&tracked.root)?;
                // Specs on disk from before (a driver being reinstalled) may name another version's files.
                tracked.changes.fetch_add(1, Ordering::AcqRel);
                tracing::info!(driver_root = %tracked.root.display(), version = new.version.as_deref().unwrap_or("unknown"),
                               files = new.files.len(), "the driver's files are there now");
                none.insert(new)
            }
        };
        let host_root = tracked.host_root.as_deref().unwrap_or(&current.root);
        let mut mounts: BTreeMap<PathBuf, PathBuf> = current
            .files
            .iter()
            .map(|(container_path, relative)| (container_path.clone(), host_root.join(relative)))
            .collect();
        for (container_path, host_path) in library_aliases(&current.files, host_root) {
            mounts.entry(container_path).or_insert(host_path);
        }
        Ok(mounts.into_iter().map(|(container_path, host_path)| DriverMount { host_path, container_path }).collect())
    }
}

impl Found {
    fn discover(driver_root: &Path) -> Result<Self, CdiError> {
        let root_error = |source| CdiError::DriverRoot { path: driver_root.to_path_buf(), source };
        let root = fs::canonicalize(driver_root).map_err(root_error)?;
        if !root.is_dir() {
            return Err(root_error(io::Error::new(io::ErrorKind::NotADirectory, "not a directory")));
        }
        let mut scan = Scan { root: root.clone(), scanned: BTreeSet::new(), found: BTreeMap::new() };
        for dir in LIBRARY_DIRS {
            scan.dir(dir, |name| LIBRARY_PREFIXES.iter().any(|prefix| name.starts_with(prefix)))?;
        }
        let Some(cuda) = scan.found.iter().find(|(path, _)| path.file_name() == Some(CUDA_LIBRARY.as_ref())) else {
            return Err(CdiError::NoCudaLibrary {
                library: CUDA_LIBRARY,
                root: driver_root.to_path_buf(),
                searched: LIBRARY_DIRS.join(", "),
            });
        };
        let version = driver_version(cuda.1);
        for dir in UTILITY_DIRS {
            scan.dir(dir, |name| UTILITIES.contains(&name))?;
        }
        if let Some(version) = &version {
            scan.dir(&format!("{FIRMWARE_DIR}/{version}"), |_| true)?;
        }
        let files = scan
            .found
            .into_iter()
            .filter_map(|(container_path, host_path)| {
                let relative = host_path.strip_prefix(&root).ok()?.to_path_buf();
                Some((container_path, relative))
            })
            .collect();
        Ok(Self { root, files, version })
    }

    /// Whether the root and every file found are as they were: the root resolves to the same directory, each
    /// container path to the same regular file. Files that appeared since are not looked for; an upgrade always
    /// changes what `libcuda.so.1` resolves to.
    fn still_there(&self, driver_root: &Path) -> bool {
        if fs::canonicalize(driver_root).ok().as_ref() != Some(&self.root) {
            return false;
        }
        self.files.iter().all(|(container_path, relative)| {
            resolve_in_root(&self.root, container_path).ok().as_ref() == Some(relative)
                && self.root.join(relative).is_file()
        })
    }
}

/// Each library of `files` once more under [`CUDA_IMAGE_LIBRARY_DIR`] and the [`DEFAULT_LIBRARY_DIRS`], by its file
/// name; where two directories hold one name, the one [`ALIAS_DIRS`] puts first (a library's own path is mounted
/// as it is: the caller keeps it over an alias).
fn library_aliases(files: &[(PathBuf, PathBuf)], host_root: &Path) -> Vec<(PathBuf, PathBuf)> {
    let rank = |path: &Path| {
        let dir = path.parent().unwrap_or(path);
        ALIAS_DIRS.iter().position(|d| Path::new(d) == dir).unwrap_or(ALIAS_DIRS.len())
    };
    let file_name = |path: &PathBuf| path.file_name().and_then(|n| n.to_str()).map(str::to_owned);
    // Libraries a loader can ask for by a soname or link name; the others (PKCS#11, Tile IR) only by their full name.
    let with_soname: BTreeSet<String> =
        files.iter().filter_map(|(path, _)| file_name(path)).filter(|n| loader_name(n)).map(|n| stem(&n)).collect();
    let mut aliases: BTreeMap<PathBuf, (usize, PathBuf)> = BTreeMap::new();
    for (container_path, relative) in files {
        let Some(name) = container_path.file_name().and_then(|n| n.to_str()) else { continue };
        if !LIBRARY_PREFIXES.iter().any(|prefix| name.starts_with(prefix)) {
            continue;
        }
        let candidate = (rank(container_path), host_root.join(relative));
        let asked = loader_name(name) || !with_soname.contains(&stem(name));
        let defaults = DEFAULT_LIBRARY_DIRS.iter().filter(|_| asked);
        for dir in std::iter::once(&CUDA_IMAGE_LIBRARY_DIR).chain(defaults) {
            let alias = aliases.entry(Path::new(dir).join(name)).or_insert_with(|| candidate.clone());
            if candidate.0 < alias.0 {
                *alias = candidate.clone();
            }
        }
    }
    aliases.into_iter().map(|(alias, (_, host_path))| (alias, host_path)).collect()
}

/// Whether a loader asks for a library by this name: `libX.so` or `libX.so.<N>` (a soname), not the versioned file
/// `libX.so.550.54.15`.
fn loader_name(name: &str) -> bool {
    name.split_once(".so").is_some_and(|(_, rest)| {
        rest.is_empty()
            || rest.strip_prefix('.').is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// A library's name up to `.so` (`libcuda.so.1` → `libcuda`): its names share it.
fn stem(name: &str) -> String {
    name.split_once(".so").map_or(name, |(stem, _)| stem).to_owned()
}

/// The driver version from the real CUDA library's name (`libcuda.so.550.54.15` → `550.54.15`); it names the
/// firmware directory of the driver that is installed, not of older ones left behind.
fn driver_version(cuda_library: &Path) -> Option<String> {
    let version = cuda_library.file_name()?.to_str()?.strip_prefix("libcuda.so.")?;
    let plausible = version.contains('.') && version.chars().all(|c| c.is_ascii_digit() || c == '.');
    plausible.then(|| version.to_string())
}

/// One discovery in progress.
struct Scan {
    /// The canonical driver root.
    root: PathBuf,
    /// Directories already listed, resolved: `lib` → `usr/lib` on merged-/usr systems is listed once.
    scanned: BTreeSet<PathBuf>,
    /// Container path → host path (under the canonical root).
    found: BTreeMap<PathBuf, PathBuf>,
}

impl Scan {
    /// Adds the regular files of `dir` (relative to the root) whose names `wanted` accepts. A directory that does
    /// not exist is simply not there; one that exists but cannot be listed is an error.
    fn dir(&mut self, dir: &str, wanted: impl Fn(&str) -> bool) -> Result<(), CdiError> {
        let Ok(resolved) = resolve_in_root(&self.root, Path::new(dir)) else {
            return Ok(());
        };
        let host_dir = self.root.join(&resolved);
        if !host_dir.is_dir() || !self.scanned.insert(resolved.clone()) {
            return Ok(());
        }
        let read_error = |source| CdiError::ReadDriverDir { path: host_dir.clone(), source };
        let mut names = Vec::new();
        for entry in fs::read_dir(&host_dir).map_err(read_error)? {
            names.push(entry.map_err(read_error)?.file_name());
        }
        for name in names.iter().filter_map(|name| name.to_str()).filter(|name| wanted(name)) {
            let link = resolved.join(name);
            let target = match resolve_in_root(&self.root, &link) {
                Ok(target) => self.root.join(target),
                Err(err) => {
                    tracing::debug!(path = %host_dir.join(name).display(), error = %err, "skipping driver file");
                    continue;
                }
            };
            // JSON needs UTF-8 paths; the runtime needs a regular file to bind.
            if target.is_file() && target.to_str().is_some() {
                self.found.entry(Path::new("/").join(link)).or_insert(target);
            }
        }
        Ok(())
    }
}

/// One step of a path still to resolve.
enum Step {
    Up,
    Name(OsString),
}

fn steps(path: &Path) -> impl DoubleEndedIterator<Item = Step> + '_ {
    path.components().filter_map(|component| match component {
        Component::ParentDir => Some(Step::Up),
        Component::Normal(name) => Some(Step::Name(name.to_os_string())),
        Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
    })
}

/// `relative` under `root`, as this process can open it: as it is where it resolves here, else with its symlinks
/// followed inside `root` ([`resolve_in_root`]). A host's driver file may be an absolute symlink (Debian's
/// `/etc/alternatives`), which dangles in a container that mounts the host at `root`. `None`: not there either way.
pub fn existing_in_root(root: &Path, relative: &Path) -> Option<PathBuf> {
    let plain = root.join(relative);
    if plain.exists() {
        return Some(plain);
    }
    let resolved = root.join(resolve_in_root(root, relative).ok()?);
    resolved.exists().then_some(resolved)
}

/// Resolves `path` (relative to `root`) with every symlink followed as if `root` were `/`: absolute targets start
/// over at the root, `..` stops at the root. Returns the resolved path relative to the root, free of symlinks.
/// Fails when a component is missing or the links loop.
fn resolve_in_root(root: &Path, path: &Path) -> io::Result<PathBuf> {
    let mut resolved = PathBuf::new();
    let mut pending: VecDeque<Step> = steps(path).collect();
    let mut links = 0;
    while let Some(step) = pending.pop_front() {
        let name = match step {
            Step::Up => {
                resolved.pop();
                continue;
            }
            Step::Name(name) => name,
        };
        let candidate = resolved.join(&name);
        let on_host = root.join(&candidate);
        if !fs::symlink_metadata(&on_host)?.file_type().is_symlink() {
            resolved = candidate;
            continue;
        }
        links += 1;
        if links > MAX_SYMLINKS {
            return Err(io::Error::other(format!("{}: too many levels of symbolic links", on_host.display())));
        }
        let target = fs::read_link(&on_host)?;
        if target.has_root() {
            resolved.clear();
        }
        for step in steps(&target).rev() {
            pending.push_front(step);
        }
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    const LIB: &str = "usr/lib/x86_64-linux-gnu";

    fn touch(root: &Path, path: &str) -> io::Result<()> {
        let path = root.join(path);
        fs::create_dir_all(path.parent().unwrap_or(root))?;
        fs::write(path, b"elf")
    }

    fn link(root: &Path, path: &str, target: &str) -> io::Result<()> {
        symlink(target, root.join(path))
    }

    /// A Debian-like merged-/usr driver tree, beside a directory outside the root that links try to reach.
    fn fake_driver_root(base: &Path) -> io::Result<PathBuf> {
        let root = base.join("root");
        touch(&root, &format!("{LIB}/libcuda.so.550.54.15"))?;
        touch(&root, &format!("{LIB}/libnvidia-ml.so.550.54.15"))?;
        touch(&root, &format!("{LIB}/libcudadebugger.so.550.54.15"))?;
        touch(&root, &format!("{LIB}/libunrelated.so.1"))?;
        touch(&root, "usr/lib/libnvidia-cfg.so.550")?;
        touch(&root, "usr/bin/nvidia-smi")?;
        touch(&root, "usr/bin/bash")?;
        touch(&root, "usr/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin")?;
        touch(&root, "usr/lib/firmware/nvidia/535.104.05/gsp_ga10x.bin")?;
        touch(base, "lib/libnvidia-cfg.so.550")?; // outside the root
        link(&root, "lib", "usr/lib")?;
        link(&root, "bin", "usr/bin")?;
        link(&root, &format!("{LIB}/libcuda.so.1"), "libcuda.so.550.54.15")?;
        // Absolute: means the same path under the root, never the host's.
        link(&root, &format!("{LIB}/libcuda.so"), &format!("/{LIB}/libcuda.so.1"))?;
        link(&root, &format!("{LIB}/libnvidia-ml.so.1"), &format!("/{LIB}/libnvidia-ml.so.550.54.15"))?;
        // Climbs four levels from root/usr/lib/x86_64-linux-gnu: to base/lib without the clamp, root/lib with it.
        link(&root, &format!("{LIB}/libnvidia-cfg.so.1"), "../../../../lib/libnvidia-cfg.so.550")?;
        // Escapes to a file that exists only outside: must be skipped.
        link(&root, &format!("{LIB}/libnvidia-opencl.so.1"), "../../../../../../../lib/libunrelated.so.1")?;
        touch(base, "lib/libunrelated.so.1")?;
        link(&root, &format!("{LIB}/libnvidia-gpucomp.so.1"), "missing.so")?; // dangling
        link(&root, &format!("{LIB}/libnvidia-nvvm.so.1"), "libnvidia-nvvm.so.4")?; // loop
        link(&root, &format!("{LIB}/libnvidia-nvvm.so.4"), "libnvidia-nvvm.so.1")?;
        Ok(root)
    }

    /// The fixture is an x86_64 Debian-family layout, and the aliases follow the machine's architecture.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn finds_the_driver_files_with_links_resolved_inside_the_root() -> TestResult {
        let base = tempfile::tempdir()?;
        let root = fake_driver_root(base.path())?;
        let files = DriverFiles::discover(&root)?;
        let real = fs::canonicalize(&root)?;
        let got: Vec<(String, PathBuf)> = files
            .mounts()?
            .iter()
            .map(|m| {
                (
                    m.container_path().display().to_string(),
                    m.host_path().strip_prefix(&real).unwrap_or(m.host_path()).to_path_buf(),
                )
            })
            .collect();
        let lib = |name: &str| format!("/{LIB}/{name}");
        let cuda_image = |name: &str| format!("/usr/local/nvidia/lib64/{name}");
        let lib64 = |name: &str| format!("/usr/lib64/{name}");
        let expected = [
            ("/usr/bin/nvidia-smi".into(), "usr/bin/nvidia-smi".into()),
            (
                "/usr/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin".into(),
                "usr/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin".into(),
            ),
            ("/usr/lib/libnvidia-cfg.so.550".into(), "usr/lib/libnvidia-cfg.so.550".into()),
            (lib("libcuda.so"), format!("{LIB}/libcuda.so.550.54.15")),
            (lib("libcuda.so.1"), format!("{LIB}/libcuda.so.550.54.15")),
            (lib("libcuda.so.550.54.15"), format!("{LIB}/libcuda.so.550.54.15")),
            (lib("libcudadebugger.so.550.54.15"), format!("{LIB}/libcudadebugger.so.550.54.15")),
            (lib("libnvidia-cfg.so.1"), "usr/lib/libnvidia-cfg.so.550".into()),
            // A library of another directory where a Debian-family image looks by default.
            (lib("libnvidia-cfg.so.550"), "usr/lib/libnvidia-cfg.so.550".into()),
            (lib("libnvidia-ml.so.1"), format!("{LIB}/libnvidia-ml.so.550.54.15")),
            (lib("libnvidia-ml.so.550.54.15"), format!("{LIB}/libnvidia-ml.so.550.54.15")),
            // Each library again where a RHEL-family image looks by default, by the names a loader asks for.
            (lib64("libcuda.so"), format!("{LIB}/libcuda.so.550.54.15")),
            (lib64("libcuda.so.1"), format!("{LIB}/libcuda.so.550.54.15")),
            // One with no soname beside it, by the only name there is.
            (lib64("libcudadebugger.so.550.54.15"), format!("{LIB}/libcudadebugger.so.550.54.15")),
            (lib64("libnvidia-cfg.so.1"), "usr/lib/libnvidia-cfg.so.550".into()),
            (lib64("libnvidia-cfg.so.550"), "usr/lib/libnvidia-cfg.so.550".into()),
            (lib64("libnvidia-ml.so.1"), format!("{LIB}/libnvidia-ml.so.550.54.15")),
            // Each library again where CUDA images' LD_LIBRARY_PATH looks.
            (cuda_image("libcuda.so"), format!("{LIB}/libcuda.so.550.54.15")),
            (cuda_image("libcuda.so.1"), format!("{LIB}/libcuda.so.550.54.15")),
            (cuda_image("libcuda.so.550.54.15"), format!("{LIB}/libcuda.so.550.54.15")),
            (cuda_image("libcudadebugger.so.550.54.15"), format!("{LIB}/libcudadebugger.so.550.54.15")),
            (cuda_image("libnvidia-cfg.so.1"), "usr/lib/libnvidia-cfg.so.550".into()),
            (cuda_image("libnvidia-cfg.so.550"), "usr/lib/libnvidia-cfg.so.550".into()),
            (cuda_image("libnvidia-ml.so.1"), format!("{LIB}/libnvidia-ml.so.550.54.15")),
            (cuda_image("libnvidia-ml.so.550.54.15"), format!("{LIB}/libnvidia-ml.so.550.54.15")),
        ];
        let expected: Vec<(String, PathBuf)> = expected.into_iter().map(|(c, h)| (c, PathBuf::from(h))).collect();
        assert_eq!(got, expected);
        assert!(files.mounts()?.iter().all(|m| m.host_path().starts_with(&real)));
        assert_eq!(DriverFiles::discover(&root)?.mounts()?, files.mounts()?, "discovery is deterministic");

        let host = files.clone().seen_from_host(Path::new("/run/nvidia/driver"));
        for (seen, moved) in files.mounts()?.iter().zip(host.mounts()?) {
            let relative = seen.host_path().strip_prefix(&real)?;
            assert_eq!(moved.host_path(), Path::new("/run/nvidia/driver").join(relative));
            assert_eq!(moved.container_path(), seen.container_path());
        }
        Ok(())
    }

    #[test]
    fn a_missing_root_or_driver_is_a_typed_error() -> TestResult {
        let base = tempfile::tempdir()?;
        let missing = base.path().join("nope");
        let err = DriverFiles::discover(&missing).err();
        assert!(matches!(&err, Some(CdiError::DriverRoot { path, .. }) if *path == missing), "{err:?}");
        assert!(err.map(|e| e.to_string()).unwrap_or_default().contains("--driver-root"));

        touch(base.path(), "file")?;
        let err = DriverFiles::discover(&base.path().join("file")).err();
        assert!(matches!(err, Some(CdiError::DriverRoot { .. })), "{err:?}");

        touch(base.path(), &format!("{LIB}/libnvidia-ml.so.1"))?;
        link(base.path(), &format!("{LIB}/libcuda.so.1"), "../../../../../elsewhere/libcuda.so.1")?;
        let err = DriverFiles::discover(base.path()).err();
        assert!(matches!(&err, Some(CdiError::NoCudaLibrary { root, .. }) if root == base.path()), "{err:?}");
        Ok(())
    }

    #[test]
    fn none_has_no_mounts() -> TestResult {
        assert!(DriverFiles::simulated().mounts()?.is_empty());
        assert!(DriverFiles::default().mounts()?.is_empty());
        Ok(())
    }

    /// A driver tree of `version`: the CUDA library with its soname link, NVML, and the GSP firmware.
    fn install_driver(root: &Path, version: &str) -> io::Result<()> {
        touch(root, &format!("{LIB}/libcuda.so.{version}"))?;
        touch(root, &format!("{LIB}/libnvidia-ml.so.{version}"))?;
        touch(root, &format!("lib/firmware/nvidia/{version}/gsp_ga10x.bin"))?;
        for (link, target) in [("libcuda.so.1", "libcuda.so"), ("libnvidia-ml.so.1", "libnvidia-ml.so")] {
            let path = root.join(LIB).join(link);
            let _ = fs::remove_file(&path);
            symlink(format!("{target}.{version}"), path)?;
        }
        Ok(())
    }

    fn remove_driver(root: &Path, version: &str) -> io::Result<()> {
        fs::remove_file(root.join(format!("{LIB}/libcuda.so.{version}")))?;
        fs::remove_file(root.join(format!("{LIB}/libnvidia-ml.so.{version}")))?;
        fs::remove_dir_all(root.join(format!("lib/firmware/nvidia/{version}")))
    }

    fn names(files: &DriverFiles) -> Result<Vec<String>, CdiError> {
        Ok(files.mounts()?.iter().map(|m| m.host_path().display().to_string()).collect())
    }

    #[test]
    fn a_driver_upgraded_in_place_is_found_again() -> TestResult {
        let base = tempfile::tempdir()?;
        let root = base.path().join("root");
        install_driver(&root, "550.54.15")?;
        let files = DriverFiles::discover(&root)?.seen_from_host(Path::new("/run/nvidia/driver"));
        let before = names(&files)?;
        assert_eq!(before.len(), 11, "{before:?}");
        assert!(before.iter().all(|n| n.contains("550.54.15")), "{before:?}");
        assert_eq!(names(&files)?, before, "nothing changed, nothing moves");
        assert_eq!(files.changes(), 0);

        // The package manager's order: the new files, the links switched, the old files removed.
        install_driver(&root, "570.86.10")?;
        remove_driver(&root, "550.54.15")?;
        let after = names(&files)?;
        assert_eq!(after.len(), 11, "{after:?}");
        assert!(after.iter().all(|n| n.contains("570.86.10") && n.starts_with("/run/nvidia/driver/")), "{after:?}");
        assert!(files.clone().mounts()? == files.mounts()?, "clones share the current files");
        assert_eq!((files.changes(), files.clone().changes()), (1, 1), "a change counted once, shared by clones");

        // Mid-upgrade (no libcuda.so.1 target): an error naming what is missing, and found again once it is back.
        remove_driver(&root, "570.86.10")?;
        let err = files.mounts().err();
        assert!(matches!(err, Some(CdiError::NoCudaLibrary { .. })), "{err:?}");
        install_driver(&root, "580.65.06")?;
        assert!(names(&files)?.iter().all(|n| n.contains("580.65.06")));
        // An upgrade that leaves the old library behind still moves the soname link.
        install_driver(&root, "580.82.07")?;
        let kept = names(&files)?;
        assert!(kept.iter().any(|n| n.ends_with("libcuda.so.580.82.07")), "{kept:?}");
        assert!(kept.iter().all(|n| !n.contains("580.65.06/")), "old firmware: {kept:?}");
        Ok(())
    }

    /// A plugin started before the driver is there: every spec's mounts fail with the reason until it is installed,
    /// which counts as a change (specs written before may name another version's files).
    #[test]
    fn awaited_files_are_found_once_installed() -> TestResult {
        let base = tempfile::tempdir()?;
        let root = base.path().join("root");
        let files = DriverFiles::awaiting(&root);
        assert!(matches!(files.mounts(), Err(CdiError::DriverRoot { .. })));
        fs::create_dir_all(&root)?;
        assert!(matches!(files.mounts(), Err(CdiError::NoCudaLibrary { .. })));
        install_driver(&root, "550.54.15")?;
        assert_eq!(names(&files)?.len(), 11);
        assert_eq!(files.changes(), 1);
        assert_eq!((names(&files)?.len(), files.changes()), (11, 1), "found once");
        Ok(())
    }

    /// A RHEL-family node (Amazon Linux, OpenShift): the libraries in `/usr/lib64`, which the dynamic linker of a
    /// Debian-family image (CUDA's, PyTorch's) never searches; its `LD_LIBRARY_PATH` names `/usr/local/nvidia/lib64`.
    #[test]
    fn libraries_of_any_layout_are_also_where_cuda_images_look() -> TestResult {
        let base = tempfile::tempdir()?;
        let root = base.path().join("root");
        touch(&root, "usr/lib64/libcuda.so.570.86.10")?;
        touch(&root, "usr/lib64/libnvidia-ml.so.570.86.10")?;
        touch(&root, "usr/bin/nvidia-smi")?;
        symlink("libcuda.so.570.86.10", root.join("usr/lib64/libcuda.so.1"))?;
        symlink("libnvidia-ml.so.570.86.10", root.join("usr/lib64/libnvidia-ml.so.1"))?;
        // Libraries with no soname: the CUDA library loads them by their full name.
        touch(&root, "usr/lib64/libnvidia-tileiras.so.570.86.10")?;
        touch(&root, "usr/lib64/libnvidia-pkcs11-openssl3.so.570.86.10")?;
        // The 32-bit libraries of the same driver, where RHEL keeps them: never the ones CUDA images get.
        touch(&root, "usr/lib/libcuda.so.570.86.10")?;
        symlink("libcuda.so.570.86.10", root.join("usr/lib/libcuda.so.1"))?;
        let mounts = DriverFiles::discover(&root)?.mounts()?;
        let real = fs::canonicalize(&root)?;
        let at = |path: &str| mounts.iter().find(|m| m.container_path() == Path::new(path)).map(|m| m.host_path());
        let full_name_only = ["libnvidia-tileiras.so.570.86.10", "libnvidia-pkcs11-openssl3.so.570.86.10"];
        for name in
            ["libcuda.so.1", "libcuda.so.570.86.10", "libnvidia-ml.so.570.86.10"].into_iter().chain(full_name_only)
        {
            let lib64 = at(&format!("/usr/lib64/{name}"));
            assert!(lib64.is_some_and(|p| p.starts_with(&real)), "{name} at its own path: {mounts:?}");
            assert_eq!(at(&format!("/usr/local/nvidia/lib64/{name}")), lib64, "{name} where CUDA images look");
            // And where a Debian-family image's loader looks by default (pip's PyTorch on `python:3-slim`), by the
            // names a loader asks for.
            let multiarch = at(&format!("{}/{name}", DEFAULT_LIBRARY_DIRS[0]));
            let asked = loader_name(name) || full_name_only.contains(&name);
            assert_eq!(multiarch, lib64.filter(|_| asked), "{name} where a Debian image looks");
        }
        // Utilities and firmware stay where they are.
        assert!(at("/usr/bin/nvidia-smi").is_some() && at("/usr/local/nvidia/lib64/nvidia-smi").is_none());
        Ok(())
    }

    #[test]
    fn loaders_ask_for_sonames_and_the_link_name() {
        for (name, asked) in [
            ("libcuda.so", true),
            ("libcuda.so.1", true),
            ("libnvidia-nvvm.so.4", true),
            ("libcuda.so.550.54.15", false),
            ("libnvidia-ml.so.1.2", false),
            ("libcuda.so.", false),
        ] {
            assert_eq!(loader_name(name), asked, "{name}");
        }
    }

    #[test]
    fn versions_come_from_the_real_library_name() {
        assert_eq!(driver_version(Path::new("/x/libcuda.so.550.54.15")).as_deref(), Some("550.54.15"));
        assert_eq!(driver_version(Path::new("/x/libcuda.so.1")), None);
        assert_eq!(driver_version(Path::new("/x/libcuda.so.550-beta")), None);
    }
}
