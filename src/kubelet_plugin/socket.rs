//! The plugin's two unix sockets: where they live, binding them safely, and dialing them (health checks, tests).

use std::io;
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::{Channel, Endpoint};

/// The longest unix socket path Linux accepts (`sun_path` is 108 bytes including the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Errors of the plugin's sockets.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error(
        "socket path {path} is {len} bytes; unix sockets allow at most {MAX_SOCKET_PATH}: choose shorter \
         --kubelet-registry-dir / --kubelet-plugins-dir"
    )]
    PathTooLong { path: PathBuf, len: usize },
    #[error("create the socket directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("remove the stale socket {path}: {source}")]
    RemoveStale {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} exists and is not a socket: refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("listen on {path}: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Where the kubelet looks for the plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketPaths {
    /// `<registry dir>/<driver>-reg.sock`, or `<driver>.reg.sock` where an earlier agent left a socket at the first:
    /// the kubelet's plugin watcher finds the plugin here. Not the path an earlier agent left a socket at, because the
    /// kubelet's plugin manager keeps its registration back-off per socket path, across the socket being removed and
    /// created again: a kubelet that started before the agent (a reboot, a kubelet restart while the agent was down)
    /// fails at the socket the last agent left, 10 s a try, and waits up to 2 min 2 s between tries
    /// (`pluginmanager/operationexecutor`, `goroutinemap`). At the same path the new agent would wait out that
    /// back-off unregistered; at the other it is registered within a second. Two names of one length, so that the
    /// path is never longer than before (unix sockets allow 107 bytes, and some kubelet directories are long).
    pub registration: PathBuf,
    /// `<plugins dir>/<driver>/dra.sock`: the DRA service, announced through registration.
    pub dra: PathBuf,
}

impl SocketPaths {
    /// The kubelet's conventional locations for `driver`, the registration socket at a path no earlier agent left a
    /// socket at (see [`SocketPaths::registration`]); refuses paths too long for a unix socket up front. Called by
    /// the node's one agent (it holds the instance lock).
    pub fn new(registry_dir: &Path, plugins_dir: &Path, driver: &str) -> Result<Self, SocketError> {
        Self::for_instance(registry_dir, plugins_dir, driver, free_instance(registry_dir, driver))
    }

    /// [`SocketPaths::new`] with registration socket `instance` (an index of [`REGISTRATION_SUFFIXES`]).
    pub fn for_instance(
        registry_dir: &Path,
        plugins_dir: &Path,
        driver: &str,
        instance: usize,
    ) -> Result<Self, SocketError> {
        let paths = Self {
            registration: registry_dir.join(registration_file_name(driver, instance)),
            dra: plugins_dir.join(driver).join("dra.sock"),
        };
        for path in [&paths.registration, &paths.dra] {
            let len = path.as_os_str().len();
            if len > MAX_SOCKET_PATH {
                return Err(SocketError::PathTooLong { path: path.clone(), len });
            }
        }
        Ok(paths)
    }
}

/// What follows the driver name in the registration socket's two names, of one length: `<driver>-reg.sock` (the
/// name of every version before) and `<driver>.reg.sock`.
pub const REGISTRATION_SUFFIXES: [&str; 2] = ["-reg.sock", ".reg.sock"];

/// The registration socket's file name `instance` (an index of [`REGISTRATION_SUFFIXES`]; past it, the last).
pub fn registration_file_name(driver: &str, instance: usize) -> String {
    format!("{driver}{}", REGISTRATION_SUFFIXES[instance.min(REGISTRATION_SUFFIXES.len() - 1)])
}

/// The first instance with nothing at its registration path in `registry_dir` (0 when both are taken).
fn free_instance(registry_dir: &Path, driver: &str) -> usize {
    (0..REGISTRATION_SUFFIXES.len())
        .find(|&n| std::fs::symlink_metadata(registry_dir.join(registration_file_name(driver, n))).is_err())
        .unwrap_or(0)
}

/// Whether `file_name` is a registration socket of `driver`'s agent (either name). Only these are ever removed as
/// stale: the registry directory may be the kubelet's own, shared with every other plugin.
pub fn is_registration_of(file_name: &str, driver: &str) -> bool {
    file_name.strip_prefix(driver).is_some_and(|rest| REGISTRATION_SUFFIXES.contains(&rest))
}

/// Removes the registration sockets earlier starts of `driver`'s agent left beside `current` (a killed agent, or
/// the machine's last boot), so the kubelet stops dialing them. Only ever called by the one agent of the node (it
/// holds the instance lock). A socket that cannot be removed is only logged: the kubelet retries it in vain, with
/// back-off, while it registers `current`.
pub fn remove_stale_registrations(current: &Path, driver: &str) {
    let Some(dir) = current.parent() else { return };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot list the registry directory for stale sockets");
            return;
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_socket = entry.file_type().is_ok_and(|t| {
            use std::os::unix::fs::FileTypeExt;
            t.is_socket()
        });
        let ours = entry.file_name().to_str().is_some_and(|name| is_registration_of(name, driver));
        if !ours || !is_socket || path == current {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(socket = %path.display(), "removed the registration socket an earlier agent left"),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(socket = %path.display(), error = %e, "cannot remove a stale registration socket"),
        }
    }
}

/// Listens on `path`, replacing a socket a previous process left behind (it can no longer be served: a unix socket
/// outlives its listener), but never another kind of file.
pub fn bind(path: &Path) -> Result<UnixListener, SocketError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| SocketError::CreateDir { path: dir.to_owned(), source })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(SocketError::NotASocket { path: path.to_owned() });
            }
            std::fs::remove_file(path).map_err(|source| SocketError::RemoveStale { path: path.to_owned(), source })?;
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(SocketError::RemoveStale { path: path.to_owned(), source }),
    }
    UnixListener::bind(path).map_err(|source| SocketError::Bind { path: path.to_owned(), source })
}

/// Which file a path names (device and inode): a socket bound again at the same path is another file.
pub type Identity = (u64, u64);

/// The identity of the file at `path`, if there is one.
pub fn identity(path: &Path) -> Option<Identity> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|meta| (meta.dev(), meta.ino()))
}

/// A gRPC channel to the unix socket at `path` (what the kubelet does; also the health check and the tests).
pub async fn dial(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_owned();
    // The URI is required by the API but unused: every connection goes to the socket.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conventional_paths_and_the_length_limit() {
        let paths = SocketPaths::for_instance(
            Path::new("/var/lib/kubelet/plugins_registry"),
            Path::new("/var/lib/kubelet/plugins"),
            "gpu.gpu-dra.dev",
            1,
        );
        assert_eq!(
            paths.ok(),
            Some(SocketPaths {
                registration: "/var/lib/kubelet/plugins_registry/gpu.gpu-dra.dev.reg.sock".into(),
                dra: "/var/lib/kubelet/plugins/gpu.gpu-dra.dev/dra.sock".into(),
            })
        );
        let long = Path::new("/tmp").join("d".repeat(100));
        assert!(matches!(SocketPaths::new(&long, Path::new("/p"), "x"), Err(SocketError::PathTooLong { .. })));
    }

    #[test]
    fn registration_sockets_of_a_driver() {
        let driver = "gpu.gpu-dra.dev";
        let table = [
            ("gpu.gpu-dra.dev-reg.sock", true),
            ("gpu.gpu-dra.dev.reg.sock", true),
            // Other drivers whose names begin with ours, and names not of this form.
            ("gpu.gpu-dra.dev-mig-reg.sock", false),
            ("gpu.gpu-dra.dev.reg-reg.sock", false),
            ("gpu.gpu-dra.devx-reg.sock", false),
            ("other.dev-reg.sock", false),
            ("gpu.gpu-dra.dev-reg.sock.tmp", false),
        ];
        for (name, ours) in table {
            assert_eq!(is_registration_of(name, driver), ours, "{name}");
        }
        for instance in [0, 1] {
            let name = registration_file_name(driver, instance);
            assert!(is_registration_of(&name, driver));
            assert_eq!(name.len(), "gpu.gpu-dra.dev-reg.sock".len(), "never longer than before");
        }
    }

    #[test]
    fn a_start_takes_a_name_no_socket_left_behind_has() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let driver = "gpu.gpu-dra.dev";
        assert_eq!(free_instance(dir.path(), driver), 0);
        std::fs::write(dir.path().join(registration_file_name(driver, 0)), "")?;
        assert_eq!(free_instance(dir.path(), driver), 1);
        std::fs::remove_file(dir.path().join(registration_file_name(driver, 0)))?;
        std::fs::write(dir.path().join(registration_file_name(driver, 1)), "")?;
        assert_eq!(free_instance(dir.path(), driver), 0);
        std::fs::write(dir.path().join(registration_file_name(driver, 0)), "")?;
        assert_eq!(free_instance(dir.path(), driver), 0, "both taken (nothing removes them): the first");
        Ok(())
    }

    #[tokio::test]
    async fn removes_only_the_stale_registration_sockets_of_its_driver() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let driver = "gpu.gpu-dra.dev";
        let at = |name: &str| dir.path().join(name);
        let current = at(&registration_file_name(driver, 1));
        let stale = [at(&registration_file_name(driver, 0))];
        let kept = [at("gpu.gpu-dra.dev-mig-reg.sock"), at("csi.example.com-reg.sock")];
        for path in stale.iter().chain(&kept).chain([&current]) {
            drop(bind(path)?);
        }
        remove_stale_registrations(&current, driver);
        for path in &stale {
            assert!(!path.exists(), "{} left", path.display());
        }
        for path in kept.iter().chain([&current]) {
            assert!(path.exists(), "{} removed", path.display());
        }
        // A file of the other name that is no socket is not the kubelet's to dial: left alone.
        let not_a_socket = at(&registration_file_name(driver, 0));
        std::fs::write(&not_a_socket, "keep")?;
        remove_stale_registrations(&current, driver);
        assert!(not_a_socket.exists(), "a file that is no socket was removed");
        Ok(())
    }

    #[tokio::test]
    async fn replaces_a_stale_socket_but_not_a_file() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("a.sock");
        drop(bind(&path)?);
        assert!(path.exists(), "a dropped listener leaves its socket file behind");
        drop(bind(&path)?);
        let file = dir.path().join("file");
        std::fs::write(&file, "keep")?;
        assert!(matches!(bind(&file), Err(SocketError::NotASocket { .. })));
        assert_eq!(std::fs::read_to_string(&file)?, "keep");
        Ok(())
    }
}
