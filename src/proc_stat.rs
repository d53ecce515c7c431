//! `/proc/<pid>/stat`, read by field number: the process telemetry (CPU, threads, start time) and the MPS daemons'
//! supervision (a pid's start time, which tells its reuse apart, and whether it is a zombie).

/// The fields of one `/proc/<pid>/stat` text.
#[derive(Debug)]
pub struct ProcStat<'a> {
    /// Fields 3 onwards (proc(5) numbers them from 1, with pid = 1 and the command name = 2).
    after_name: Vec<&'a str>,
}

impl<'a> ProcStat<'a> {
    /// Splits `stat` after its command name, which may hold spaces and parentheses (the fields after its last `)`
    /// are plain); `None` when there is no name.
    pub fn parse(stat: &'a str) -> Option<Self> {
        Some(Self { after_name: stat[stat.rfind(')')? + 1..].split_whitespace().collect() })
    }

    /// Field `n` in proc(5)'s numbering (3: state, 14: utime, 22: start time, …); `None` for 1, 2 and past the end.
    pub fn field(&self, n: usize) -> Option<&'a str> {
        self.after_name.get(n.checked_sub(3)?).copied()
    }

    /// Field `n` as a number.
    pub fn number(&self, n: usize) -> Option<f64> {
        self.field(n)?.parse().ok()
    }

    /// Whether the process has exited and waits to be reaped (state `Z`).
    pub fn is_zombie(&self) -> bool {
        self.field(3) == Some("Z")
    }
}

/// The start time of process `pid` in clock ticks since boot (field 22), which tells a pid's reuse apart; `None`
/// when it is gone or a zombie.
pub fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let stat = ProcStat::parse(&stat)?;
    if stat.is_zombie() { None } else { stat.field(22).map(str::to_string) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_numbered_past_a_name_with_spaces_and_parentheses() {
        let stat = "42 (a (b) c) Z 1 42 42 0 -1 4194560 0 0 0 0 7 3 0 0 20 0 1 0 12345 0 0";
        let parsed = ProcStat::parse(stat).expect("a name");
        assert_eq!((parsed.field(3), parsed.field(4), parsed.field(22)), (Some("Z"), Some("1"), Some("12345")));
        assert_eq!((parsed.number(14), parsed.number(15)), (Some(7.0), Some(3.0)));
        assert_eq!((parsed.field(2), parsed.field(99)), (None, None));
        assert!(parsed.is_zombie());
        assert!(ProcStat::parse("no name").is_none());
    }

    #[test]
    fn this_process_has_a_start_time() {
        assert!(start_time(std::process::id()).is_some_and(|t| t.parse::<u64>().is_ok()));
    }
}
