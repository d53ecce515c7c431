//! The health state on disk (`<state-dir>/health.json`), so that an agent restart neither forgets a fault (the GPU
//! would be handed out again) nor invents one (the taints' `timeAdded` and the healthy window carry on).

use std::io;
use std::path::{Path, PathBuf};

use super::state::HealthBook;
use crate::fsutil::write_atomic;

/// The file name under the state directory.
pub const FILE_NAME: &str = "health.json";
const VERSION: u32 = 1;

/// Reading or writing the health state failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("read the GPU health state {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the GPU health state {path} is not valid ({source})")]
    Decode {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("the GPU health state {path} has version {found}; this agent reads version {VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("write the GPU health state {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

#[derive(serde::Serialize, serde::Deserialize)]
struct OnDisk {
    version: u32,
    #[serde(flatten)]
    book: HealthBook,
}

/// The path of the state file in `state_dir`.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE_NAME)
}

/// Loads the state; a missing file is an empty book (every GPU healthy).
pub fn load(state_dir: &Path) -> Result<HealthBook, StoreError> {
    load_if_present(state_dir).map(Option::unwrap_or_default)
}

/// Loads the state; `None` when there is no file.
pub fn load_if_present(state_dir: &Path) -> Result<Option<HealthBook>, StoreError> {
    let path = path(state_dir);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(StoreError::Read { path, source }),
    };
    let on_disk: OnDisk =
        serde_json::from_slice(&bytes).map_err(|source| StoreError::Decode { path: path.clone(), source })?;
    if on_disk.version != VERSION {
        return Err(StoreError::Version { path, found: on_disk.version });
    }
    Ok(Some(on_disk.book))
}

/// Copies an unreadable state file to `health.json.corrupt-<unix seconds>` (`-<n>` appended when taken), so that
/// the next save, which replaces it, does not lose what an operator may want to read; returns the copy's path. A
/// copy, not a rename: until that save succeeds, the unreadable file stays where a restart finds it (and reads the
/// faults back from the published taints again).
pub fn keep_aside(state_dir: &Path) -> io::Result<PathBuf> {
    let path = path(state_dir);
    let target = crate::fsutil::aside_path(&path)?;
    std::fs::copy(&path, &target)?;
    Ok(target)
}

/// Saves the state atomically.
pub fn save(state_dir: &Path, book: &HealthBook) -> Result<(), StoreError> {
    let path = path(state_dir);
    let on_disk = OnDisk { version: VERSION, book: book.clone() };
    let bytes = serde_json::to_vec_pretty(&on_disk)
        .map_err(|e| StoreError::Write { path: path.clone(), source: io::Error::other(e) })?;
    write_atomic(&path, &bytes).map_err(|source| StoreError::Write { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_agent::health::classify::Fault;
    use crate::node_agent::health::state::{Now, Policy};

    #[test]
    fn an_unreadable_file_is_kept_aside_under_a_new_name() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        std::fs::write(path(dir.path()), b"{torn")?;
        assert!(matches!(load(dir.path()), Err(StoreError::Decode { .. })));
        let first = keep_aside(dir.path())?;
        assert_eq!(std::fs::read(path(dir.path()))?, b"{torn", "a copy: the file stays until a save replaces it");
        std::fs::write(path(dir.path()), b"{torn again")?;
        let second = keep_aside(dir.path())?;
        std::fs::remove_file(path(dir.path()))?;
        assert_ne!(first, second, "an earlier kept file is never overwritten");
        assert_eq!(std::fs::read(&first)?, b"{torn");
        assert_eq!(std::fs::read(&second)?, b"{torn again");
        assert!(load(dir.path())?.faulted.is_empty(), "no file left: an empty book");
        Ok(())
    }

    #[test]
    fn round_trip_and_errors() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        assert_eq!(load(dir.path())?, HealthBook::default());
        let mut book = HealthBook::default();
        book.record("GPU-1", Fault::Xid(Some(79)), Now::at(1_700_000_000), &Policy::default());
        book.record("GPU-2", Fault::EccDoubleBit, Now::at(1_700_000_001), &Policy::default());
        save(dir.path(), &book)?;
        assert_eq!(load(dir.path())?, book);

        std::fs::write(path(dir.path()), b"{not json")?;
        let error = load(dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("health.json") && error.contains("is not valid"), "{error}");
        std::fs::write(path(dir.path()), br#"{"version": 9, "faulted": {}}"#)?;
        assert!(matches!(load(dir.path()), Err(StoreError::Version { found: 9, .. })));
        Ok(())
    }
}
