//! The system calls an MPS daemon's supervision needs and the standard library lacks: a child's own mount
//! namespace with a directory at `/dev/shm`, a kill of a daemon's process group, and reaping the MPS servers a
//! dead daemon leaves to the agent. `unsafe` is kept here (and in the NVML MIG calls and the open-file limit).

#![allow(unsafe_code)]

use std::collections::BTreeSet;
use std::ffi::{CStr, CString};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, Once, PoisonError};
use std::time::{Duration, Instant};

/// Makes `command`'s process run in a private mount namespace with `shm` bind-mounted at `/dev/shm` (needs
/// `CAP_SYS_ADMIN`; the spawn fails with the system call's error otherwise).
pub(super) fn own_dev_shm(command: &mut Command, shm: &Path) -> std::io::Result<()> {
    let shm = CString::new(shm.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: between fork and exec the closure makes only async-signal-safe system calls, on memory prepared before
    // the fork (the path is moved in).
    unsafe {
        command.pre_exec(move || in_child(&shm));
    }
    Ok(())
}

fn in_child(shm: &CStr) -> std::io::Result<()> {
    let check = |result: libc::c_int| if result == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
    let (no_type, no_data) = (std::ptr::null(), std::ptr::null());
    // SAFETY: plain system calls on NUL-terminated strings that outlive them.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        // Nothing mounted here reaches the node's (or the agent's) mount namespace.
        check(libc::mount(c"none".as_ptr(), c"/".as_ptr(), no_type, libc::MS_REC | libc::MS_PRIVATE, no_data))?;
        check(libc::mount(shm.as_ptr(), c"/dev/shm".as_ptr(), no_type, libc::MS_BIND, no_data))
    }
}

/// Mounts a tmpfs of its own at `dir` (mode 0711, at most half the machine's memory, no devices, set-uid programs or
/// executables), as NVIDIA's driver does for a daemon's shared memory: what the claim's containers and its MPS server
/// write there (pipes, logs, `/dev/shm`, which a container otherwise gets at 64 MiB) is kept off the filesystem
/// `dir` is on, the node's `/run` by default, where a full disk would fail every other claim's CDI spec and the
/// runtime's own state. Needs `CAP_SYS_ADMIN`.
pub(super) fn mount_tmpfs(dir: &Path) -> std::io::Result<()> {
    let target = CString::new(dir.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: a plain system call on NUL-terminated strings that outlive it.
    let result = unsafe {
        libc::mount(
            c"gpu-dra-mps".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            flags,
            c"mode=0711,size=50%".as_ptr().cast(),
        )
    };
    if result == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Unmounts what is mounted at `dir`, lazily: a container still holding a bind mount of a directory in it keeps
/// that, and the memory goes with the last user.
pub(super) fn unmount(dir: &Path) -> std::io::Result<()> {
    let target = CString::new(dir.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: a plain system call on a NUL-terminated string that outlives it.
    let result = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    if result == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Whether a filesystem is mounted at `dir` (it is on another device than its parent).
pub(super) fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let device = |path: &Path| std::fs::metadata(path).map(|m| m.dev()).ok();
    match (device(dir), dir.parent().and_then(device)) {
        (Some(own), Some(parent)) => own != parent,
        _ => false,
    }
}

/// Sends SIGKILL to the process group `pid` leads (a daemon is spawned as one, so the MPS servers it started go with
/// it); 0 and pids beyond `i32` are ignored.
pub(super) fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid)
        && pid > 0
    {
        // SAFETY: a plain system call; callers pass their own daemon's pid or a leftover's whose start time matched.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

/// Makes this process the reaper of its descendants' orphans (`PR_SET_CHILD_SUBREAPER`), as it is anyway as its
/// container's PID 1: the MPS servers of a daemon that died come to the agent wherever it runs, and
/// [`reap_group`] collects them, instead of some runs leaving them to the node's init and others keeping them as
/// zombies.
pub(super) fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: a plain system call with integer arguments.
    let result = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
    if result == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// What [`reap_group`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Reaped {
    /// Members reaped.
    pub count: usize,
    /// Members still there at the deadline (a CUDA process tearing down its GPU context can take a while to die):
    /// the agent's one reaper thread collects them as they die.
    pub lingering: bool,
}

/// Reaps the exited children of this process in process group `pgid` (a dead daemon's MPS servers, handed to the
/// agent as their reaper and killed with [`kill_group`]), waiting at most `within` for the group to empty. Only
/// that group is waited for: the agent's other children stay theirs to wait on.
pub(super) fn reap_group(pgid: u32, within: Duration) -> Reaped {
    let Ok(pgid) = i32::try_from(pgid) else { return Reaped::default() };
    if pgid <= 0 {
        return Reaped::default();
    }
    let deadline = Instant::now() + within;
    let mut reaped = Reaped::default();
    while reap_exited(pgid, &mut reaped.count) {
        if Instant::now() >= deadline {
            reap_later(pgid);
            reaped.lingering = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    reaped
}

/// Reaps the members of group `pgid` that have exited, counting them; whether members remain (alive, or dying).
fn reap_exited(pgid: i32, count: &mut usize) -> bool {
    loop {
        let mut status = 0;
        // SAFETY: a plain system call writing to a local.
        match unsafe { libc::waitpid(-pgid, &mut status, libc::WNOHANG) } {
            pid if pid > 0 => *count += 1,
            // 0: some still run; -1: none left (ECHILD).
            result => return result == 0,
        }
    }
}

/// Groups with members that outlived [`reap_group`]'s wait, and the one thread that reaps them as they die (a
/// group's number cannot be taken by a new process group before its last member is reaped, here).
static LINGERING: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());
static REAPER: Once = Once::new();

fn reap_later(pgid: i32) {
    LINGERING.lock().unwrap_or_else(PoisonError::into_inner).insert(pgid);
    REAPER.call_once(|| {
        std::thread::spawn(|| {
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let groups = LINGERING.lock().unwrap_or_else(PoisonError::into_inner).clone();
                for pgid in groups {
                    if !reap_exited(pgid, &mut 0) {
                        LINGERING.lock().unwrap_or_else(PoisonError::into_inner).remove(&pgid);
                    }
                }
            }
        });
    });
}
