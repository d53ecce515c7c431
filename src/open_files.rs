//! The process's open-file limit, raised to its hard limit at start as every Go program does for itself (Go 1.19 and
//! later: the kubelet and kube-controller-manager included). containerd 2.0 and later no longer set `LimitNOFILE` in
//! their systemd unit, so containers start at systemd's 1,024 soft and 524,288 hard limit; the node agent holds the
//! kubelet's connections, API connections, checkpoint, CDI and MPS files and the metrics endpoint's connections at
//! once, and a component that runs out fails calls it would otherwise answer. The raise stops at [`CEILING`]: the
//! processes the agent starts (`nvidia-smi`, MPS daemons) inherit the limit, and a program that closes every
//! descriptor up to it at start would crawl through a hard limit in the hundreds of millions. `unsafe` is kept
//! here: the standard library has no `setrlimit`.

#![allow(unsafe_code)]

/// The most the soft limit is raised to: far above what either component holds.
pub const CEILING: u64 = 1 << 16;

/// The soft limit on open files now (`None` if it cannot be read).
pub fn soft_limit() -> Option<u64> {
    current().ok().map(|limit| limit.rlim_cur)
}

/// The soft and hard limits on open files now.
fn current() -> std::io::Result<libc::rlimit> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(limit)
}

/// Raises the soft limit on open files to the hard limit, or [`CEILING`] if that is lower (a soft limit above it is
/// left as it is). Returns the soft limit before and after; an error leaves the limit as it was (the process runs
/// on with it).
pub fn raise_to_hard_limit() -> std::io::Result<(u64, u64)> {
    let mut limit = current()?;
    let before = limit.rlim_cur;
    let target = limit.rlim_max.min(CEILING);
    if limit.rlim_cur < target {
        limit.rlim_cur = target;
        // SAFETY: setrlimit only reads the struct, which lives for the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((before, limit.rlim_cur))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one_up_to_the_ceiling() -> std::io::Result<()> {
        let mut limit = current()?;
        let target = limit.rlim_max.min(CEILING);
        limit.rlim_cur = target - 1;
        // SAFETY: setrlimit only reads the struct; the soft limit is lowered by one below where it is raised to,
        // which no other test reaches.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
        assert_eq!(raise_to_hard_limit()?, (target - 1, target));
        Ok(())
    }
}
