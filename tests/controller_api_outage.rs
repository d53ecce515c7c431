//! `gpu-dra controller` when the API server stops answering: SIGSTOP on kube-apiserver, so connections are still
//! accepted by the kernel but no request is ever answered (a hung process, a half-dead node or proxy), and when its
//! connections are black-holed (iptables; root, as the real-node tests). Runs on a cluster of this binary's own:
//! stopping the API server would disturb every other test.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use support::TestContext;
use support::process::Component;
use support::wait;

fn main() {
    support::run_on_own_cluster(
        "controller_api_outage",
        &[
            test!(a_leader_whose_api_server_hangs_steps_down_in_time),
            test!(connections_to_an_api_server_that_vanished_are_given_up_within_a_minute),
        ],
    )
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

/// Every established connection from a local port to `port` on 127.0.0.1 black-holed (both directions dropped,
/// no reset), as to an API server whose machine went off, for as long as this lives; new connections pass.
struct BlackHole {
    rules: Vec<Vec<String>>,
}

impl BlackHole {
    /// Needs root (iptables).
    fn connections_to(port: u16) -> anyhow::Result<Self> {
        let listed = Command::new("ss").args(["-Htn", "state", "established"]).output().context("run ss")?;
        ensure!(listed.status.success(), "ss: {}", String::from_utf8_lossy(&listed.stderr));
        let server = format!("127.0.0.1:{port}");
        let clients: Vec<String> = String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let (local, peer) = (fields.get(2)?, fields.get(3)?);
                (*peer == server).then(|| local.rsplit(':').next().map(str::to_string)).flatten()
            })
            .collect();
        ensure!(!clients.is_empty(), "no connection to {server} to black-hole");
        let mut hole = Self { rules: Vec::new() };
        for client in clients {
            for (from, to) in [(client.as_str(), port.to_string()), (&*port.to_string(), client.clone())] {
                let rule: Vec<String> =
                    ["INPUT", "-p", "tcp", "-s", "127.0.0.1", "--sport", from, "--dport", &to, "-j", "DROP"]
                        .iter()
                        .map(|s| s.to_string())
                        .collect();
                let status = Command::new("iptables").arg("-I").args(&rule).status().context("run iptables")?;
                ensure!(
                    status.success(),
                    "iptables -I {} (the test needs root, as the real-node tests)",
                    rule.join(" ")
                );
                hole.rules.push(rule);
            }
        }
        Ok(hole)
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        for rule in &self.rules {
            let removed = Command::new("iptables").arg("-D").args(rule).status();
            if !removed.is_ok_and(|s| s.success()) {
                eprintln!("error: could not remove iptables rule {}", rule.join(" "));
            }
        }
    }
}

/// An API server that vanished under the controller's connections (its machine off, a load balancer failing over
/// without a reset): its watches get nothing and no error. TCP keepalive makes the kernel give such a connection up
/// within 45 s of silence, and the watches are made again on new connections: a pod created meanwhile gets its
/// claim within a minute. Before, kube's client set no keepalive and the watch waited for its own timeout (295 s)
/// while the controller saw no new pod; client-go's HTTP/2 pings notice in 45 s.
async fn connections_to_an_api_server_that_vanished_are_given_up_within_a_minute(
    ctx: TestContext,
) -> anyhow::Result<()> {
    // Root and iptables, which e2e/build-node.sh installs for the real node.
    support::real_node::can_run()?;
    let proxy = support::api_proxy::ApiProxy::start(ctx.client.clone()).await?;
    let ns = ctx.namespace.as_str();
    let args = ["controller", "--namespace", ns, "--leader-elect=false", "--kube-api-timeout", "5s"];
    let controller = Component::start(proxy.kubeconfig(), ns, &args)?;
    controller.wait_ready().await?;
    support::objects::create_template(&ctx, "one-gpu", support::objects::one_gpu()).await?;
    let claims = serde_json::json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]);
    let recorded = |pod: &'static str| {
        let ctx = &ctx;
        async move {
            let pod = support::objects::pods(ctx).get(pod).await?;
            let statuses = pod.status.and_then(|s| s.resource_claim_statuses).unwrap_or_default();
            anyhow::Ok(statuses.into_iter().find_map(|s| s.resource_claim_name))
        }
    };
    support::objects::create_pod(&ctx, "before", claims.clone()).await?;
    wait::until("the first pod's claim", Duration::from_secs(30), || recorded("before")).await?;

    let hole = BlackHole::connections_to(proxy.port())?;
    let started = Instant::now();
    support::objects::create_pod(&ctx, "after", claims).await?;
    wait::until("the claim of the pod created after the API server vanished", Duration::from_secs(90), || {
        recorded("after")
    })
    .await
    .with_context(|| controller.log_tail())?;
    let took = started.elapsed();
    drop(hole);
    eprintln!("a pod created after the controller's connections were black-holed got its claim in {took:?}");
    ensure!(took < Duration::from_secs(75), "{took:?}: the dead connections were not given up within a minute");
    // The hole held the watch up (the claim came over a new connection): else this checks nothing.
    ensure!(took >= Duration::from_secs(3), "{took:?}: the black hole did not cut the controller's connections");
    Ok(())
}
