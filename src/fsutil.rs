//! Crash-safe file writes shared by the CDI specs and the checkpoint: a reader (the container runtime, the next
//! agent process) sees the old content or the new one, never half a file.
//!
//! A writer holds an exclusive `flock` on its temporary file from creation to rename, so "is the writer of this
//! temporary file still alive?" is answered by the kernel, not by a PID: the agent is PID 1 in every container, so a
//! PID in a file name says nothing about whether the process that wrote it still runs. The lock dies with the
//! process that held it, whichever PID namespace it ran in.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Writes `data` to `path` atomically: a hidden temporary file in the same directory (so the runtime's CDI cache,
/// which reads only `*.json`/`*.yaml`, never picks it up), locked while it is written, fsync, rename over the target,
/// fsync the directory so the rename itself survives a power cut. Creates the directory when missing.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| io::Error::other(format!("{} names no file", path.display())))?;
    fs::create_dir_all(dir).map_err(|err| with_remedy(err, dir))?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut file = open_locked(&tmp)?;
        file.write_all(data)?;
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        drop(file);
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(|err| with_remedy(err, dir))
}

/// A full, over-quota or read-only filesystem names which one and what to do: the error alone ("No space left on
/// device") does not say which of the node's filesystems (the CDI directory is often on `/run`, the checkpoint on
/// `/var/lib`) to free. Other errors are returned as they are.
pub fn with_remedy(err: io::Error, dir: &Path) -> io::Error {
    let what = match err.kind() {
        io::ErrorKind::StorageFull => " is full; free space there, then retry",
        io::ErrorKind::QuotaExceeded => "'s quota is used up; free space there, then retry",
        io::ErrorKind::ReadOnlyFilesystem => {
            " is read-only (a filesystem remounts read-only after I/O errors: see the kernel log); make it writable, \
             then retry"
        }
        _ => return err,
    };
    io::Error::new(err.kind(), format!("{err}: the filesystem holding {}{what}", dir.display()))
}

/// A free name `<file>.corrupt-<unix seconds>[-<n>]` beside `path`, where a file that cannot be trusted is kept for
/// an operator to read: never the name of one kept earlier.
pub fn aside_path(path: &Path) -> io::Result<PathBuf> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let base = format!("{}.corrupt-{secs}", path.file_name().unwrap_or_default().to_string_lossy());
    let mut n = 0u32;
    loop {
        let name = if n == 0 { base.clone() } else { format!("{base}-{n}") };
        let candidate = path.with_file_name(name);
        match fs::symlink_metadata(&candidate) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(candidate),
            Err(err) => return Err(err),
            Ok(_) => n += 1,
        }
    }
}

/// Opens (creating) the temporary file `tmp`, locked and empty. The lock is taken after the open, so a clean-up may
/// have removed the file in between (it found it unlocked), or another writer with the same PID (another container)
/// may have renamed it while this one waited for the lock: then `tmp` no longer names the file this one holds, and it
/// opens the new one.
fn open_locked(tmp: &Path) -> io::Result<File> {
    for _ in 0..8 {
        let file = OpenOptions::new().write(true).create(true).truncate(false).open(tmp)?;
        file.lock()?;
        let held = file.metadata()?;
        match fs::symlink_metadata(tmp) {
            Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => {
                file.set_len(0)?;
                return Ok(file);
            }
            Ok(_) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(err),
        }
    }
    Err(io::Error::other(format!("{} keeps being replaced while it is opened", tmp.display())))
}

/// Removes the temporary files [`write_atomic`] left in `dir` for targets whose name satisfies `target` when no
/// process holds their lock any more (their writer was killed between create and rename). Those being written, by
/// this process or another agent (e.g. the old one during a rolling update), are locked and left alone. Only regular
/// files are opened. Returns how many were removed.
pub fn remove_abandoned_temporaries(dir: &Path, target: impl Fn(&str) -> bool) -> io::Result<usize> {
    let entries = match fs::read_dir(dir) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(0),
        entries => entries?,
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(target_name) = name.to_str().and_then(temporary_of) else { continue };
        if target(target_name) && entry.file_type()?.is_file() && remove_if_unlocked(&entry.path())? {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Removes `path` when nobody holds its lock; `true` when it did.
fn remove_if_unlocked(path: &Path) -> io::Result<bool> {
    let file = match File::open(path) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
        file => file?,
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => return Ok(false),
        Err(TryLockError::Error(err)) => return Err(err),
    }
    // Still the file that was locked (not renamed away and re-created since the open)?
    let held = file.metadata()?;
    match fs::symlink_metadata(path) {
        Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => {
            remove_if_exists(path)?;
            Ok(true)
        }
        Ok(_) => Ok(false),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err),
    }
}

/// `.<name>.tmp-<pid>` (a temporary of [`write_atomic`]) → `<name>`.
pub fn temporary_of(file_name: &str) -> Option<&str> {
    let (target, pid) = file_name.strip_prefix('.')?.rsplit_once(".tmp-")?;
    pid.parse::<u32>().ok().map(|_| target)
}

/// Removes `path`; a file that is already gone is success (every removal here must be idempotent).
pub fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_replace_and_leave_no_temporary_files() -> io::Result<()> {
        let dir = std::env::temp_dir().join(format!("gpu-dra-fsutil-{}", std::process::id()));
        let path = dir.join("nested").join("a.json");
        write_atomic(&path, b"one")?;
        write_atomic(&path, b"two")?;
        assert_eq!(fs::read(&path)?, b"two");
        let names: Vec<_> = fs::read_dir(path.parent().unwrap_or(&dir))?.flatten().map(|e| e.file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("a.json")]);
        remove_if_exists(&path)?;
        remove_if_exists(&path)?;
        assert!(!path.exists());
        fs::remove_dir_all(&dir)
    }

    #[test]
    fn a_full_filesystem_is_named_with_what_to_do() {
        let full = with_remedy(io::Error::from_raw_os_error(28), Path::new("/run/cdi"));
        assert_eq!(full.kind(), io::ErrorKind::StorageFull);
        let message = full.to_string();
        assert!(message.starts_with("No space left on device"), "{message}");
        assert!(message.contains("the filesystem holding /run/cdi is full; free space there"), "{message}");
        let quota = with_remedy(io::Error::from_raw_os_error(122), Path::new("/var/lib/gpu-dra")).to_string();
        assert!(
            quota.ends_with("the filesystem holding /var/lib/gpu-dra's quota is used up; free space there, then retry"),
            "{quota}"
        );
        let read_only = with_remedy(io::Error::from_raw_os_error(30), Path::new("/var/lib/gpu-dra")).to_string();
        assert!(read_only.contains("the filesystem holding /var/lib/gpu-dra is read-only"), "{read_only}");
        let denied = with_remedy(io::Error::from_raw_os_error(13), Path::new("/run/cdi"));
        assert_eq!(denied.to_string(), io::Error::from_raw_os_error(13).to_string());
    }

    /// A writer killed mid-write in an earlier container had the same PID as this process (PID 1 in both): its
    /// temporary file is unlocked and goes. A temporary file whose writer still holds the lock stays, whatever
    /// its PID.
    #[test]
    fn abandoned_temporaries_go_locked_ones_stay() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let own_pid = std::process::id();
        let abandoned_same_pid = format!(".a.json.tmp-{own_pid}");
        let names = [abandoned_same_pid.as_str(), ".a.json.tmp-1", ".a.json.tmp-7", ".b.json.tmp-0", "a.json"];
        for name in names {
            fs::write(dir.path().join(name), "x")?;
        }
        // A live writer (another process, as far as flock is concerned: a different open file description).
        let writer = File::open(dir.path().join(".a.json.tmp-7"))?;
        writer.lock()?;
        // Not a regular file: never opened (a fifo would block the open).
        fs::create_dir(dir.path().join(".a.json.tmp-9"))?;
        assert_eq!(remove_abandoned_temporaries(dir.path(), |target| target == "a.json")?, 2);
        let mut left: Vec<_> = fs::read_dir(dir.path())?.flatten().map(|e| e.file_name()).collect();
        left.sort();
        let mut expected: Vec<std::ffi::OsString> =
            [".a.json.tmp-7", ".a.json.tmp-9", ".b.json.tmp-0", "a.json"].iter().map(Into::into).collect();
        expected.sort();
        assert_eq!(left, expected);
        drop(writer);
        assert_eq!(remove_abandoned_temporaries(dir.path(), |target| target == "a.json")?, 1);
        assert_eq!(remove_abandoned_temporaries(&dir.path().join("missing"), |_| true)?, 0);
        Ok(())
    }

    /// A temporary file left by an earlier writer with this PID is taken over, emptied, and renamed.
    #[test]
    fn a_left_over_temporary_of_the_same_pid_is_reused() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("a.json");
        fs::write(dir.path().join(format!(".a.json.tmp-{}", std::process::id())), "old and longer")?;
        write_atomic(&path, b"new")?;
        assert_eq!(fs::read(&path)?, b"new");
        assert_eq!(fs::read_dir(dir.path())?.count(), 1);
        Ok(())
    }
}
