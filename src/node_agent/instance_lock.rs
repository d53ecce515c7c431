//! One agent per node at a time: an exclusive lock on `<state dir>/agent.lock`, held for the agent's whole life.
//!
//! Two agents can run on one node for a while: an agent pod deleted with `--force --grace-period=0` (the
//! DaemonSet's replacement starts while the old container is still stopping), a DaemonSet with `updateStrategy:
//! OnDelete` handled the same way, or a second release of the chart. Together they would undo each other: the new
//! agent replaces the old one's sockets, the old one removes them as it exits (so the kubelet unregisters the live
//! agent and, 30 s later, wipes its ResourceSlices), and both save their whole checkpoint and health state from
//! memory, the last writer losing the other's claims. So the agent takes this lock before it reads any state or
//! binds a socket, and an agent that finds it held waits, saying which process holds it. The kernel drops an
//! `flock` when its holder dies, however it dies, so a killed agent never leaves it behind.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The lock file, in the state directory.
pub const LOCK_FILE: &str = "agent.lock";
/// How often a waiting agent tries again.
const RETRY: Duration = Duration::from_millis(250);

/// Why the lock could not be taken (not: that another agent holds it; that is waited for).
#[derive(Debug, thiserror::Error)]
#[error("lock {path} (one node agent per node): {source}")]
pub struct LockError {
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

/// The held lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct InstanceLock {
    _file: File,
}

/// Takes the lock in `state_dir`, waiting while another process holds it. `None` when `stop` ends the wait.
pub async fn acquire(state_dir: &Path, stop: &CancellationToken) -> Result<Option<InstanceLock>, LockError> {
    let path = state_dir.join(LOCK_FILE);
    let failed_at =
        |at: &Path, source| LockError { path: at.to_path_buf(), source: crate::fsutil::with_remedy(source, state_dir) };
    let failed = |source| failed_at(&path, source);
    std::fs::create_dir_all(state_dir).map_err(|source| failed_at(state_dir, source))?;
    let mut file =
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(failed)?;
    let mut said = false;
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(TryLockError::WouldBlock) => {
                if !said {
                    let holder = holder_of(&mut file);
                    warn!(
                        lock = %path.display(),
                        holder = %holder,
                        "another node agent holds this state directory (its pod being replaced? or another release's \
                         agent given the same --state-dir: give each release its own nodeAgent.stateDir): waiting for \
                         it to exit"
                    );
                    said = true;
                }
            }
            Err(TryLockError::Error(source)) => return Err(failed(source)),
        }
        tokio::select! {
            () = stop.cancelled() => return Ok(None),
            () = tokio::time::sleep(RETRY) => {}
        }
    }
    // Who holds it, for the next agent's message: in a container the pid is its own namespace's, the host name its
    // pod's name.
    let pid = std::process::id();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let written =
        file.set_len(0).and_then(|()| file.rewind()).and_then(|()| writeln!(file, "pid {pid} on {}", host.trim()));
    if let Err(error) = written {
        warn!(lock = %path.display(), %error, "could not record this agent's pid in its lock file");
    }
    if said {
        info!(lock = %path.display(), "the other node agent exited: going on");
    }
    Ok(Some(InstanceLock { _file: file }))
}

/// Who holds the lock in `state_dir` now (its file's record), if a node agent does: for a one-shot tool about to
/// change GPU settings that a running agent's prepared claims depend on. Takes nothing; a lock file that is not there
/// or not held is no agent.
pub fn holder(state_dir: &Path) -> Option<String> {
    let mut file = File::open(state_dir.join(LOCK_FILE)).ok()?;
    match file.try_lock() {
        Ok(()) => {
            let _ = file.unlock();
            None
        }
        Err(TryLockError::WouldBlock) => Some(holder_of(&mut file)),
        Err(TryLockError::Error(_)) => None,
    }
}

/// The holder's pid as it recorded it, for the log.
fn holder_of(file: &mut File) -> String {
    let mut text = String::new();
    match file.rewind().and_then(|()| file.read_to_string(&mut text)) {
        Ok(_) if !text.trim().is_empty() => text.trim().to_string(),
        _ => "unknown".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_holder_waits_until_the_first_is_gone() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let stop = CancellationToken::new();
        let first = acquire(dir.path(), &stop).await?.ok_or("first lock")?;
        let recorded = std::fs::read_to_string(dir.path().join(LOCK_FILE))?;
        assert!(recorded.starts_with(&format!("pid {} on ", std::process::id())), "{recorded}");
        let path = dir.path().to_path_buf();
        let waiting = {
            let stop = stop.clone();
            tokio::spawn(async move { acquire(&path, &stop).await })
        };
        tokio::time::sleep(RETRY * 3).await;
        assert!(!waiting.is_finished(), "a second agent must wait while the first holds the lock");
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), waiting).await???;
        assert!(second.is_some(), "taken once the first let go");

        // A wait ended by the agent's stop gives up without the lock.
        let path = dir.path().to_path_buf();
        let given_up = {
            let stop = stop.clone();
            tokio::spawn(async move { acquire(&path, &stop).await })
        };
        tokio::time::sleep(RETRY * 2).await;
        stop.cancel();
        assert!(tokio::time::timeout(Duration::from_secs(5), given_up).await???.is_none());
        Ok(())
    }
}
