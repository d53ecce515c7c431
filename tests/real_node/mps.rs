//! MPS on the real node: a pod whose two containers (one of them root, the other not: the pipe directory and
//! `/dev/shm` serve any user, as a sidecar sharing memory with the CUDA container needs; MPS itself serves one user's
//! CUDA processes at a time, which the stand-in does not model) share a claim asking `sharing.strategy: MPS` are both
//! clients of the claim's MPS control daemon through containerd's CDI support —
//! the daemon's pipe directory at `/tmp/nvidia-mps`, its shared memory at `/dev/shm` (the same one for both
//! containers and the daemon), the limits in their environment — with its GPU in EXCLUSIVE_PROCESS compute mode. A
//! daemon that dies is started again, the server it left killed and reaped by the agent (its container's PID 1),
//! and deleting the pod stops the daemon, removes its directories and sets the GPU back to DEFAULT. The GPUs are simulated and so is the daemon (the agent's stand-in, run in the agent's container
//! exactly as `nvidia-cuda-mps-control -f` would be); the agent runs privileged, as MPS needs.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{LogParams, PostParams};
use serde_json::json;

use super::support::real_node::RealNode;
use super::support::{TestContext, objects, wait};
use super::{WAIT, claim_of, claim_uid, delete_and_wait, install_with, on_gpu_node};

/// What each container runs: shows what it was given, writes a file of its own into `/dev/shm`, waits for the other
/// container's, lists `/dev/shm`, then waits.
const MPS_CLIENT: &str = "test -S /tmp/nvidia-mps/control && echo control=socket; \
    echo pipe=$CUDA_MPS_PIPE_DIRECTORY threads=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE \
    pinned=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT uid=$(id -u); \
    echo hello > /dev/shm/from-$NAME && echo wrote; \
    until [ -f /dev/shm/from-a ] && [ -f /dev/shm/from-b ]; do sleep 0.2; done; \
    echo shm=$(ls /dev/shm | tr '\\n' ' '); echo listed; exec sleep 3600";

pub(super) async fn containers_of_a_pod_are_clients_of_their_claims_mps_daemon(ctx: TestContext) -> anyhow::Result<()> {
    on_gpu_node(&ctx, "mps-gpu-node", async |node| mps_clients(&ctx, node).await).await
}

/// Host processes that are the daemon of the claim whose pipe directory is `pipe`.
fn daemons_serving(pipe: &Path) -> Vec<u32> {
    processes_of(pipe, |cmdline| cmdline.contains("-f"))
}

/// Host processes that are the MPS server of that daemon (the stand-in's, started by it).
fn servers_of(pipe: &Path) -> Vec<u32> {
    processes_of(pipe, |cmdline| cmdline.contains("--server"))
}

/// Host processes of the stand-in whose command line passes `which`, with `pipe` as their pipe directory.
fn processes_of(pipe: &Path, which: impl Fn(&str) -> bool) -> Vec<u32> {
    let wanted = format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe.display());
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let read = |file: &str| std::fs::read(format!("/proc/{pid}/{file}")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&read("cmdline")).into_owned();
            let environ = read("environ");
            cmdline.contains("simulated-mps-control")
                && which(&cmdline)
                && environ.split(|b| *b == 0).any(|entry| entry == wanted.as_bytes())
        })
        .collect()
}

async fn mps_clients(ctx: &TestContext, node: &RealNode) -> anyhow::Result<()> {
    let mps_dir: PathBuf = node.agent_mps_dir()?;
    install_with(ctx, node, &["nodeAgent.privileged=true"])?;
    objects::create_template(
        ctx,
        "mps-gpu",
        json!({"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpu-dra.dev"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.gpu-dra.dev", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {
                    "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "1Gi"}}}}}]}}}),
    )
    .await?;
    let container = |name: &str, uid: u32| {
        json!({"name": name, "image": "busybox:gpu-dra-e2e", "imagePullPolicy": "Never",
               "command": ["sh", "-c", MPS_CLIENT], "env": [{"name": "NAME", "value": name}],
               "securityContext": {"runAsUser": uid, "runAsGroup": uid},
               "resources": {"claims": [{"name": "gpu"}]}})
    };
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "mps"}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": node.name}, "terminationGracePeriodSeconds": 1,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "mps-gpu"}],
        "containers": [container("a", 0), container("b", 1000)]}}))?;
    let pods = objects::pods(ctx);
    pods.create(&PostParams::default(), &pod).await?;

    let claim = claim_of(ctx, "mps").await?;
    let uid = claim_uid(ctx, &claim).await?;
    let seen = super::allocated(ctx, &node.name, &claim).await?;
    let uuid = seen.uuids.into_iter().next().context("no GPU")?;
    let minor = seen.minors.into_iter().next().context("no GPU")?;
    for (name, user) in [("a", "0"), ("b", "1000")] {
        let log = wait::until(&format!("container {name} to list /dev/shm"), WAIT, || async {
            let params = LogParams { container: Some(name.into()), ..LogParams::default() };
            let log = pods.logs("mps", &params).await.unwrap_or_default();
            Ok(log.contains("listed").then_some(log))
        })
        .await;
        let log = match log {
            Ok(log) => log,
            Err(e) => {
                let status = pods.get("mps").await.ok().and_then(|p| p.status).map(|s| json!(s));
                let events = objects::events_about(ctx, "mps").await.unwrap_or_default();
                let params = LogParams { container: Some(name.into()), ..LogParams::default() };
                let partial = pods.logs("mps", &params).await.unwrap_or_default();
                anyhow::bail!("{e}\nlog so far: {partial}\nstatus: {status:?}\nevents: {events:?}");
            }
        };
        let expected = format!("pipe=/tmp/nvidia-mps threads=50 pinned={uuid}=1024M uid={user}");
        ensure!(log.contains("control=socket"), "{name}: no MPS control pipe at /tmp/nvidia-mps:\n{log}");
        ensure!(log.contains(&expected), "{name}: lacks {expected:?}:\n{log}");
        ensure!(log.contains("wrote"), "{name} (uid {user}) could not write to /dev/shm:\n{log}");
        let shm = log.lines().find_map(|l| l.strip_prefix("shm=")).unwrap_or_default();
        let shm: Vec<&str> = shm.split_whitespace().collect();
        ensure!(
            ["from-a", "from-b", "gpu-dra-mps-stand-in"].iter().all(|f| shm.contains(f)),
            "{name}'s /dev/shm is not the one it shares with the other container and the daemon: {shm:?}"
        );
    }
    let claim_dir = mps_dir.join(&uid);
    ensure!(claim_dir.join("shm/from-b").exists(), "the containers' /dev/shm is not {}", claim_dir.display());
    // On the host (through the agent's Bidirectional mount) a tmpfs of the claim's own, off the node's filesystem.
    let statfs = std::process::Command::new("stat").args(["-f", "-c", "%T"]).arg(&claim_dir).output()?;
    let mounts = super::support::node::mounts_under(&mps_dir);
    ensure!(
        String::from_utf8_lossy(&statfs.stdout).trim() == "tmpfs",
        "{} is not a tmpfs ({:?}; mounts under the MPS root: {mounts:?})",
        claim_dir.display(),
        String::from_utf8_lossy(&statfs.stdout)
    );
    let pipe = claim_dir.join("pipe");
    let daemons = daemons_serving(&pipe);
    ensure!(daemons.len() == 1, "daemons serving the claim: {daemons:?}");
    // Its GPU is in EXCLUSIVE_PROCESS compute mode while the daemon serves it.
    let compute_modes = node.agent_state_dir()?.join("simulated-compute-modes.json");
    let modes = || std::fs::read_to_string(&compute_modes).unwrap_or_default().split_whitespace().collect::<String>();
    let exclusive = format!("\"gpu-{minor}\":\"ExclusiveProcess\"");
    ensure!(modes().contains(&exclusive), "compute modes while the pod runs: {} (no {exclusive})", modes());

    // The daemon dies, leaving its server: the agent (its container's PID 1) kills the server and reaps it, so it
    // does not stay a zombie, and starts the daemon again.
    let servers = servers_of(&pipe);
    ensure!(servers.len() == 1, "servers of the claim's daemon: {servers:?}");
    let server = servers[0];
    // Its start time, a zombie's too: the pid taken again by another process counts as gone.
    let started = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        gpu_dra::proc_stat::ProcStat::parse(&stat)?.field(22).map(str::to_string)
    };
    let server_start = started(server).context("the server is gone before its daemon")?;
    std::process::Command::new("kill").args(["-9", &daemons[0].to_string()]).status()?;
    wait::until("the dead daemon's server to be killed and reaped", WAIT, || async {
        Ok((started(server).as_ref() != Some(&server_start)).then_some(()))
    })
    .await
    .with_context(|| {
        let state = std::fs::read_to_string(format!("/proc/{server}/stat")).unwrap_or_default();
        format!("server {server} is still in the process table: {state}")
    })?;
    wait::until("the daemon to be started again", WAIT, || async {
        Ok(daemons_serving(&pipe).iter().any(|pid| *pid != daemons[0]).then_some(()))
    })
    .await?;

    delete_and_wait(ctx, "mps").await?;
    wait::until("the claim's MPS directories to go", WAIT, || async { Ok((!claim_dir.exists()).then_some(())) })
        .await?;
    let left = daemons_serving(&claim_dir.join("pipe"));
    ensure!(left.is_empty(), "the daemon still runs after its pod went: {left:?}");
    let mounts = super::support::node::mounts_under(&mps_dir);
    ensure!(mounts.is_empty(), "the claim's tmpfs is still mounted on the host: {mounts:?}");
    let set_back = wait::until("the GPU's compute mode to be set back", WAIT, || async {
        Ok((modes() == "{}" || modes().is_empty()).then_some(()))
    })
    .await;
    ensure!(set_back.is_ok(), "compute modes after the pod went: {}", modes());
    eprintln!(
        "two containers (uid 0 and 1000) were clients of their claim's MPS daemon; its dead predecessor's server was \
         reaped; it went with the pod"
    );
    Ok(())
}
