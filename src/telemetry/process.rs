//! Process metrics (`process_*`, as every Prometheus client library exports them), read from `/proc/self`.
//!
//! Collected at scrape time; on a system without `/proc` the collector reports nothing instead of failing.

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Kernel clock ticks per second for `/proc/<pid>/stat` times. 100 on every Linux architecture Kubernetes runs
/// on (USER_HZ is fixed by the kernel ABI, independent of CONFIG_HZ).
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// Reports CPU time, resident memory, open file descriptors and start time of this process.
#[derive(Debug, Default)]
pub struct ProcessCollector;

/// One reading of `/proc/self`.
#[derive(Debug, Default, PartialEq)]
struct Reading {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    open_fds: i64,
    /// The soft limit on open files ([`crate::open_files::soft_limit`]); `None` when unlimited or unreadable.
    max_fds: Option<i64>,
    start_time_seconds: f64,
    threads: i64,
}

fn read() -> Option<Reading> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let boot_time = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<f64>().ok())?;
    let mut reading = parse_stat(&stat, boot_time)?;
    reading.resident_bytes = status_kib(&status, "VmRSS:")? * 1024;
    reading.virtual_bytes = status_kib(&status, "VmSize:")? * 1024;
    reading.open_fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as i64).unwrap_or(0);
    // RLIM_INFINITY (unlimited) fits no i64: no sample.
    reading.max_fds = crate::open_files::soft_limit().and_then(|limit| i64::try_from(limit).ok());
    Some(reading)
}

/// CPU time, threads and start time from `/proc/self/stat`.
fn parse_stat(stat: &str, boot_time: f64) -> Option<Reading> {
    let stat = crate::proc_stat::ProcStat::parse(stat)?;
    let field = |n: usize| stat.number(n);
    Some(Reading {
        cpu_seconds: (field(14)? + field(15)?) / CLOCK_TICKS_PER_SECOND,
        threads: field(20)? as i64,
        start_time_seconds: boot_time + field(22)? / CLOCK_TICKS_PER_SECOND,
        ..Reading::default()
    })
}

fn status_kib(status: &str, key: &str) -> Option<i64> {
    status.lines().find_map(|l| l.strip_prefix(key))?.split_whitespace().next()?.parse().ok()
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let Some(r) = read() else { return Ok(()) };
        let cpu = ConstCounter::new(r.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            None,
            MetricType::Counter,
        )?)?;
        let gauges: [(&str, &str, f64); 5] = [
            ("process_resident_memory_bytes", "Resident memory size in bytes.", r.resident_bytes as f64),
            ("process_virtual_memory_bytes", "Virtual memory size in bytes.", r.virtual_bytes as f64),
            ("process_open_fds", "Number of open file descriptors.", r.open_fds as f64),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                r.start_time_seconds,
            ),
            ("process_threads", "Number of OS threads in the process.", r.threads as f64),
        ];
        for (name, help, value) in gauges {
            ConstGauge::new(value).encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
        }
        // What an alert on `process_open_fds / process_max_fds` needs: the components size their connection caps
        // from this limit.
        if let Some(max) = r.max_fds {
            let help = "Maximum number of open file descriptors.";
            ConstGauge::new(max as f64).encode(encoder.encode_descriptor(
                "process_max_fds",
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_spaces_in_the_command_name() {
        let stat = "4242 (gpu dra (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 1000 12345 678";
        let r = parse_stat(stat, 1_700_000_000.0).expect("parse");
        assert_eq!(r.cpu_seconds, 3.0);
        assert_eq!(r.threads, 7);
        assert_eq!(r.start_time_seconds, 1_700_000_010.0);
    }

    #[test]
    fn reads_this_process() {
        let r = read().expect("/proc is there on Linux");
        assert!(r.resident_bytes > 0 && r.open_fds > 0 && r.threads > 0, "{r:?}");
        assert!(r.max_fds.is_some_and(|max| max >= r.open_fds), "{r:?}");
        let soft = crate::open_files::soft_limit().and_then(|limit| i64::try_from(limit).ok());
        assert_eq!(r.max_fds, soft, "the soft limit, as the connection caps read it");
    }
}
