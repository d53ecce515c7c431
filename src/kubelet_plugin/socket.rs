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
    /// `<registry dir>/<driver>-reg.sock`: the kubelet's plugin watcher finds the plugin here.
    pub registration: PathBuf,
    /// `<plugins dir>/<driver>/dra.sock`: the DRA service, announced through registration.
    pub dra: PathBuf,
}

impl SocketPaths {
    /// The kubelet's conventional locations for `driver`; refuses paths too long for a unix socket up front.
    pub fn new(registry_dir: &Path, plugins_dir: &Path, driver: &str) -> Result<Self, SocketError> {
        let paths = Self {
            registration: registry_dir.join(format!("{driver}-reg.sock")),
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
        let paths = SocketPaths::new(
            Path::new("/var/lib/kubelet/plugins_registry"),
            Path::new("/var/lib/kubelet/plugins"),
            "gpu.gpu-dra.dev",
        );
        assert_eq!(
            paths.ok(),
            Some(SocketPaths {
                registration: "/var/lib/kubelet/plugins_registry/gpu.gpu-dra.dev-reg.sock".into(),
                dra: "/var/lib/kubelet/plugins/gpu.gpu-dra.dev/dra.sock".into(),
            })
        );
        let long = Path::new("/tmp").join("d".repeat(100));
        assert!(matches!(SocketPaths::new(&long, Path::new("/p"), "x"), Err(SocketError::PathTooLong { .. })));
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
