//! The soak's summary table and the list of violations, each kind with the known controller bug it points to.

use std::fmt::Write as _;
use std::time::Duration;

use super::invariants::{Counts, Kind, Violation};
use super::workload::Activity;

/// The `q` quantile (0..=1) of `values`, nearest rank; None when empty. Pure.
pub fn quantile(values: &[Duration], q: f64) -> Option<Duration> {
    let mut sorted = values.to_vec();
    sorted.sort();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).copied()
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_string(), |d| format!("{} ms", d.as_millis()))
}

/// Everything the report shows.
#[derive(Debug)]
pub struct Summary<'a> {
    pub duration: Duration,
    pub seed: u64,
    pub counts: &'a Counts,
    pub activity: &'a Activity,
    pub faults: &'a [String],
    pub violations: &'a [Violation],
    /// Controller log lines that explain violations (e.g. the switch to observe-only).
    pub notes: &'a [String],
}

impl Summary<'_> {
    pub fn render(&self) -> String {
        let c = self.counts;
        let l = &c.release_latencies;
        let mut out = String::new();
        let _ = writeln!(out, "\nsoak: {:?} of churn, seed {} (GPU_DRA_SOAK_SEED)", self.duration, self.seed);
        let rows = [
            ("pods", format!("{} ({} finished or deleted)", c.pods, c.pods_finished)),
            ("jobs / extended-resource jobs", format!("{} / {}", self.activity.jobs, self.activity.extended_jobs)),
            ("deployment scalings", self.activity.scalings.to_string()),
            ("pods deleted while starting", self.activity.churn_pods.to_string()),
            ("tenant's odd claims", self.activity.forged_claims.to_string()),
            ("PodGroup training jobs", self.activity.pod_groups.to_string()),
            ("faults", self.faults.len().to_string()),
            ("claims created", c.claims_created.to_string()),
            ("pod claims that needed one", c.claims_needed.to_string()),
            ("PodGroup claims created", c.group_claims.to_string()),
            ("duplicates deleted (explained)", c.duplicates_deleted.to_string()),
            ("created after its pod was deleted", c.created_for_gone_pod.to_string()),
            ("created for a finished pod", c.recreated_for_finished.to_string()),
            ("unexplained claims", c.unexplained().to_string()),
            ("claims released", l.len().to_string()),
            ("release latency p50", ms(quantile(l, 0.5))),
            ("release latency p99", ms(quantile(l, 0.99))),
            ("release latency max", ms(l.iter().max().copied())),
            ("violations", self.violations.len().to_string()),
        ];
        let _ = writeln!(out, "| {:<34} | {:<28} |", "", "");
        let _ = writeln!(out, "|{:-<36}|{:-<30}|", "", "");
        for (name, value) in rows {
            let _ = writeln!(out, "| {name:<34} | {value:<28} |");
        }
        for fault in self.faults {
            let _ = writeln!(out, "fault: {fault}");
        }
        let mut kinds: Vec<Kind> = self.violations.iter().map(|v| v.kind).collect();
        kinds.sort();
        kinds.dedup();
        for kind in kinds {
            let of_kind: Vec<&Violation> = self.violations.iter().filter(|v| v.kind == kind).collect();
            let _ = writeln!(out, "\nVIOLATION x{}: {}", of_kind.len(), kind.label());
            if let Some(cause) = kind.known_cause() {
                let _ = writeln!(out, "  known cause: {cause}");
            }
            for v in of_kind.iter().take(5) {
                let _ = writeln!(out, "  {v}");
            }
            if of_kind.len() > 5 {
                let _ = writeln!(out, "  … and {} more", of_kind.len() - 5);
            }
        }
        if !self.notes.is_empty() {
            let _ = writeln!(
                out,
                "\nThe controller went OBSERVE-ONLY (issue #11 point 3): from then on it created, released and \
                 deleted nothing, which explains the claims never created and the claims of finished pods left."
            );
        }
        for note in self.notes {
            let _ = writeln!(out, "controller log: {note}");
        }
        out
    }
}

/// Nearest-rank quantiles (unit table).
pub fn quantile_table() -> anyhow::Result<()> {
    let ms = |v: &[u64]| v.iter().map(|m| Duration::from_millis(*m)).collect::<Vec<_>>();
    anyhow::ensure!(quantile(&[], 0.5).is_none());
    let values = ms(&[500, 100, 300, 200, 400]);
    anyhow::ensure!(quantile(&values, 0.5) == Some(Duration::from_millis(300)));
    anyhow::ensure!(quantile(&values, 0.99) == Some(Duration::from_millis(500)));
    anyhow::ensure!(quantile(&values, 0.0) == Some(Duration::from_millis(100)));
    Ok(())
}
