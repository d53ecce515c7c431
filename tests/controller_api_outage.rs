//! `gpu-dra controller` when the API server stops answering: SIGSTOP on kube-apiserver, so connections are still
//! accepted by the kernel but no request is ever answered (a hung process, a half-dead node or proxy). Runs on a
//! cluster of this binary's own: stopping the API server would disturb every other test.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use support::TestContext;
use support::process::Component;
use support::wait;

fn main() {
    support::run_on_own_cluster("controller_api_outage", &[test!(a_leader_whose_api_server_hangs_steps_down_in_time)])
}

const LEASE_DURATION: Duration = Duration::from_secs(4);
const RENEW_DEADLINE: Duration = Duration::from_secs(3);
const ELECTION: [&str; 4] = [
    "--leader-elect=true",
    "--leader-elect-lease-duration=4s",
    "--leader-elect-renew-deadline=3s",
    "--leader-elect-retry-period=500ms",
];

/// A process stopped with SIGSTOP for as long as this lives: dropping it (at the end of the test, on an error, a
/// panic or the test's timeout) sends SIGCONT, so no test can leave the API server stopped. Were the test process
/// killed, the cluster's watchdog stops the cluster with SIGKILL, which a stopped process gets too.
struct Stopped {
    pid: u32,
}

impl Stopped {
    fn new(pid: u32) -> anyhow::Result<Self> {
        signal("STOP", pid)?;
        Ok(Self { pid })
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Err(err) = signal("CONT", self.pid) {
            eprintln!("error: could not resume process {}: {err:#}", self.pid);
        }
    }
}

fn signal(name: &str, pid: u32) -> anyhow::Result<()> {
    let status = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status().context("run kill")?;
    ensure!(status.success(), "kill -{name} {pid}: {status}");
    Ok(())
}

/// The leader's requests hang: it must stop leading (and exit) within its renew deadline, before the Lease can
/// expire for anyone else, instead of waiting for the client's read timeout (minutes) while still leading.
async fn a_leader_whose_api_server_hangs_steps_down_in_time(ctx: TestContext) -> anyhow::Result<()> {
    let mut leader = Component::controller(&ctx, &[&ELECTION[..], &["--identity", "replica-a"]].concat()).await?;
    wait::until("leadership", Duration::from_secs(20), || async {
        Ok((leader.metric("gpu_dra_controller_leader", &[]).await? == 1.0).then_some(()))
    })
    .await?;

    // Stopped for longer than the lease, so that a replica that kept leading would outlive it.
    let hold = LEASE_DURATION + Duration::from_secs(2);
    let api_server = Stopped::new(ctx.cluster.pid("kube-apiserver")?)?;
    let stopped = Instant::now();
    let mut exited = None;
    while stopped.elapsed() < hold {
        if exited.is_none()
            && let Some(status) = leader.try_wait()?
        {
            exited = Some((status, stopped.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(api_server);

    let (status, after) = exited.with_context(|| {
        format!(
            "the leader still runs {hold:?} after its API server stopped answering (renew deadline {RENEW_DEADLINE:?}, \
             lease {LEASE_DURATION:?}):\n{}",
            leader.log_tail()
        )
    })?;
    eprintln!("leader exited {after:?} after the API server stopped answering (renew deadline {RENEW_DEADLINE:?})");
    // The renew deadline counts from the last renewal, before the stop; the margin covers exiting.
    let margin = Duration::from_secs(1);
    ensure!(after <= RENEW_DEADLINE + margin, "stepped down only after {after:?}:\n{}", leader.log_tail());
    ensure!(!status.success(), "exit status {status}");
    let log = leader.log_text();
    ensure!(log.contains("lost the lease") && log.contains("lost leadership"), "{}", leader.log_tail());
    Ok(())
}
