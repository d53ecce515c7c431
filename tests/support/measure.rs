//! Figures the benchmarks read off processes and series.

use anyhow::Context as _;

/// A field of /proc/PID/status that the kernel gives in kB (`VmRSS:`, `VmHWM:`: peak resident memory), in KiB.
pub fn status_kib(pid: u32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// Nearest-rank percentile (`p` in 0..=1) of a sorted, non-empty series.
pub fn nearest_rank<T: Copy>(sorted: &[T], p: f64) -> T {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}
