//! Crash-safe file writes shared by the CDI specs and the checkpoint: a reader (the container runtime, the next
//! agent process) sees the old content or the new one, never half a file.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

/// Writes `data` to `path` atomically: a hidden temporary file in the same directory (so the runtime's CDI cache,
/// which reads only `*.json`/`*.yaml`, never picks it up), fsync, rename over the target, fsync the directory so the
/// rename itself survives a power cut. Creates the directory when missing.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| io::Error::other(format!("{} names no file", path.display())))?;
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut file = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
        file.write_all(data)?;
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes the temporary files [`write_atomic`] left in `dir` for targets whose name satisfies `target` when the
/// process that wrote them is gone (killed between create and rename). Those of a live process, this one or
/// another instance, are left alone. Returns how many were removed.
pub fn remove_abandoned_temporaries(dir: &Path, target: impl Fn(&str) -> bool) -> io::Result<usize> {
    let entries = match fs::read_dir(dir) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(0),
        entries => entries?,
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some((target_name, pid)) = name.to_str().and_then(temporary_of) else { continue };
        let alive = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if target(target_name) && !alive {
            remove_if_exists(&entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// `.<name>.tmp-<pid>` → (`<name>`, pid).
fn temporary_of(file_name: &str) -> Option<(&str, u32)> {
    let (target, pid) = file_name.strip_prefix('.')?.rsplit_once(".tmp-")?;
    Some((target, pid.parse().ok()?))
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
    fn abandoned_temporaries_go_live_ones_stay() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        // pid 0 is never a process of ours (and /proc/0 does not exist): abandoned.
        let names = [".a.json.tmp-0", ".b.json.tmp-0", &format!(".a.json.tmp-{}", std::process::id()), "a.json"];
        for name in names {
            fs::write(dir.path().join(name), "x")?;
        }
        assert_eq!(remove_abandoned_temporaries(dir.path(), |target| target == "a.json")?, 1);
        let mut left: Vec<_> = fs::read_dir(dir.path())?.flatten().map(|e| e.file_name()).collect();
        left.sort();
        let expected: Vec<std::ffi::OsString> =
            [names[2], names[1], "a.json"].iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        let mut expected = expected;
        expected.sort();
        assert_eq!(left, expected);
        assert_eq!(remove_abandoned_temporaries(&dir.path().join("missing"), |_| true)?, 0);
        Ok(())
    }
}
