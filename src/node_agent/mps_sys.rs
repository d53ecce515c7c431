//! The system calls an MPS daemon's supervision needs and the standard library lacks: a child's own mount
//! namespace with a directory at `/dev/shm`, a kill of a daemon's process group, and reaping the MPS servers a
//! dead daemon leaves to the agent. `unsafe` is kept here (and in the NVML MIG calls).

#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
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

/// Reaps the exited children of this process in process group `pgid` (a dead daemon's MPS servers, handed to the
/// agent as their reaper and killed with [`kill_group`]), waiting at most `within` for the group to empty; answers
/// how many were reaped. A child still there then (a CUDA process tearing down its GPU context can take a while to
/// die) is waited for by a thread of its own, so it never stays a zombie. Only that group is waited for: the agent's
/// other children stay theirs to wait on.
pub(super) fn reap_group(pgid: u32, within: Duration) -> usize {
    let Ok(pgid) = i32::try_from(pgid) else { return 0 };
    if pgid <= 0 {
        return 0;
    }
    let deadline = Instant::now() + within;
    let mut reaped = 0;
    loop {
        let mut status = 0;
        // SAFETY: a plain system call writing to a local.
        let pid = unsafe { libc::waitpid(-pgid, &mut status, libc::WNOHANG) };
        if pid > 0 {
            reaped += 1;
            continue;
        }
        // -1: no child left in the group (ECHILD); 0: some still run (killed, not yet dead).
        if pid < 0 {
            return reaped;
        }
        if Instant::now() >= deadline {
            std::thread::spawn(move || {
                let mut status = 0;
                // SAFETY: as above; blocks until each is gone, then ends with ECHILD.
                while unsafe { libc::waitpid(-pgid, &mut status, 0) } > 0 {}
            });
            return reaped;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
