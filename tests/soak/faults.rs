//! The faults injected during the run, on a schedule spread over its duration: the leading controller replica
//! killed (SIGKILL, restarted as a follower), a node agent killed and restarted, a node's kubelet side killed and
//! restarted on its checkpoint.

use std::fmt;
use std::time::{Duration, Instant};

use super::bed::Bed;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    KillLeader,
    KillAgent(usize),
    RestartKubelet(usize),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::KillLeader => write!(f, "leader controller killed"),
            Fault::KillAgent(i) => write!(f, "node agent {i} killed"),
            Fault::RestartKubelet(i) => write!(f, "kubelet {i} restarted"),
        }
    }
}

const CYCLE: [Fault; 6] = [
    Fault::KillLeader,
    Fault::KillAgent(0),
    Fault::RestartKubelet(1),
    Fault::KillLeader,
    Fault::KillAgent(1),
    Fault::RestartKubelet(0),
];

/// When each fault happens: every quarter of the run (at least 30 s, at most 3 min apart), cycling through the
/// kinds, none in the last 20 s so that the system settles before the workload stops. Pure.
pub fn schedule(duration: Duration) -> Vec<(Duration, Fault)> {
    let every = (duration / 4).clamp(Duration::from_secs(30), Duration::from_secs(180));
    let last = duration.saturating_sub(Duration::from_secs(20));
    (1u32..).map(|n| every * n).take_while(|at| *at <= last).zip(CYCLE.iter().cycle().copied()).collect()
}

/// Injects `fault` and waits until the system is whole again; returns what it measured.
pub async fn inject(bed: &mut Bed, fault: Fault) -> anyhow::Result<String> {
    let started = Instant::now();
    match fault {
        Fault::KillLeader if bed.replicas.is_empty() => Ok("no gpu-dra controller to kill (reference run)".to_string()),
        Fault::KillLeader => {
            let leader = bed.leader(Duration::from_secs(30)).await?;
            bed.replicas[leader].process.kill()?;
            let killed = Instant::now();
            let next = bed.leader(Duration::from_secs(30)).await?;
            let handover = killed.elapsed();
            bed.restart_replica(leader).await?;
            Ok(format!(
                "{} killed, {} leads after {:.1}s",
                bed.replicas[leader].identity,
                bed.replicas[next].identity,
                handover.as_secs_f64()
            ))
        }
        Fault::KillAgent(i) => {
            bed.restart_agent(i).await?;
            Ok(format!(
                "agent of {} back and registered after {:.1}s",
                bed.nodes[i].name,
                started.elapsed().as_secs_f64()
            ))
        }
        Fault::RestartKubelet(i) => {
            bed.restart_kubelet(i).await?;
            Ok(format!(
                "kubelet of {} back and registered after {:.1}s",
                bed.nodes[i].name,
                started.elapsed().as_secs_f64()
            ))
        }
    }
}

/// The schedule of a short and a long run (unit table).
pub fn schedule_table() -> anyhow::Result<()> {
    let short = schedule(Duration::from_secs(150));
    let times: Vec<u64> = short.iter().map(|(at, _)| at.as_secs()).collect();
    anyhow::ensure!(times == [37, 75, 112], "{short:?}");
    let kinds: Vec<Fault> = short.iter().map(|(_, f)| *f).collect();
    anyhow::ensure!(kinds == CYCLE[..3], "every kind once: {kinds:?}");
    let long = schedule(Duration::from_secs(30 * 60));
    anyhow::ensure!(long.len() == 9 && long[0].0 == Duration::from_secs(180), "{long:?}");
    anyhow::ensure!(schedule(Duration::from_secs(40)).is_empty(), "too short for a fault");
    Ok(())
}
