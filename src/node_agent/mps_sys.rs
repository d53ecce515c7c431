//! The system calls an MPS daemon's supervision needs and the standard library lacks: a child's own mount
//! namespace with a directory at `/dev/shm`, and a kill of a daemon's process group. `unsafe` is kept here (and in
//! the NVML MIG calls).

#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

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
