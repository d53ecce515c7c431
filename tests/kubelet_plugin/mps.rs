//! MPS applied: a claim asking `sharing.strategy: MPS` gets an MPS control daemon of its own while it is prepared
//! (the simulated backend's stand-in, started, supervised and stopped exactly as `nvidia-cuda-mps-control -f`),
//! with the claim's GPUs and limits; its containers get the daemon's pipe directory, shared memory and limits
//! through the CDI spec. A daemon that dies is started again (its orphaned server killed and reaped), one an agent
//! restart leaves behind is replaced (one of the agent's own outlives its recovery once the GPUs are discovered
//! after a start without them), a claim adopted from its spec after a corrupt checkpoint gets its daemon back,
//! and unprepare stops it and its server and removes its directories. The GPUs a daemon serves are in the
//! `EXCLUSIVE_PROCESS` compute mode while it runs (set again at start-up, set back when it goes or fails to start).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use serde_json::{Value, json};

use super::support::node::{DRIVER, Kubelet, NodeDirs, start_agent};
use super::support::{TestContext, wait};
use super::{allocated_claim, checkpoint, node_name, ready_agent};

/// A claim's configuration in NVIDIA's spelling (manifests written for NVIDIA's driver work).
fn nvidia_mps(mps_config: Value) -> Value {
    json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": mps_config}}}}])
}

/// The pids the claim's daemons logged at start, in order.
fn started_pids(claim: &Path) -> Vec<u32> {
    let log = std::fs::read_to_string(claim.join("log/control.log")).unwrap_or_default();
    log.lines().filter_map(|line| line.strip_prefix("started pid=")?.split_whitespace().next()?.parse().ok()).collect()
}

/// The pids of the servers the claim's daemons started, in order.
fn server_pids(claim: &Path) -> Vec<u32> {
    let log = std::fs::read_to_string(claim.join("log/control.log")).unwrap_or_default();
    log.lines().filter_map(|line| line.strip_prefix("server pid=")?.trim().parse().ok()).collect()
}

/// The start time `/proc/<pid>/stat` records for `pid`, a zombie's too; `None` once it is gone.
fn recorded_start(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    gpu_dra::proc_stat::ProcStat::parse(&stat)?.field(22).map(str::to_string)
}

/// Waits until `pid`, which started at `started` (read while it ran), is gone from the process table: dead and
/// reaped, not left a zombie (the pid taken again since by another process, with another start time, counts as gone).
async fn reaped(what: &str, pid: u32, started: Option<String>) -> anyhow::Result<()> {
    ensure!(started.is_some(), "{what}: process {pid} was not running to begin with");
    let gone = wait::until(what, Duration::from_secs(10), || async {
        Ok((started.is_none() || recorded_start(pid) != started).then_some(()))
    })
    .await;
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    ensure!(gone.is_ok(), "{what}: process {pid} is still in the process table: {state}");
    Ok(())
}

/// Whether `pid` runs (a zombie does not).
fn alive(pid: u32) -> bool {
    gpu_dra::proc_stat::start_time(pid).is_some()
}

async fn next_daemon(claim: &Path, after: usize) -> anyhow::Result<u32> {
    let pid = wait::until("a daemon started", Duration::from_secs(20), || async {
        Ok(started_pids(claim).get(after).copied().filter(|pid| alive(*pid) && claim.join("pipe/control").exists()))
    })
    .await?;
    Ok(pid)
}

pub(super) async fn a_claim_asking_mps_gets_its_own_daemon_while_prepared(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let limits = json!({"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi",
                        "defaultPerDevicePinnedMemoryLimit": {"1": "2Gi"}});
    let uid = allocated_claim(&ctx, "mps", &node, &["gpu-0", "gpu-1"], nvidia_mps(limits)).await?;
    let claims = [(ns, "mps", uid.as_str())];
    let mut kubelet = Kubelet::register(&dirs).await?;
    let answers = kubelet.prepare(&claims).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");

    // The daemon serves both GPUs with the limits (the per-device key "1" is the second UUID in sorted order).
    let claim_dir: PathBuf = dirs.mps().join(&uid);
    let first = next_daemon(&claim_dir, 0).await?;
    let entry = checkpoint(&dirs, "boot-1")?.claims.remove(&uid).context("no checkpoint entry")?;
    let daemon = entry.mps.context("the entry records no MPS daemon")?;
    ensure!(daemon.uuids.len() == 2 && daemon.active_thread_percentage == Some(50), "{daemon:?}");
    let pinned = format!("{}=10240M,{}=2048M", daemon.uuids[0], daemon.uuids[1]);
    let log = std::fs::read_to_string(claim_dir.join("log/control.log"))?;
    let expected = format!(
        "started pid={first} devices={} active_thread_percentage=50 pinned_device_mem_limit={pinned}",
        daemon.uuids.join(",")
    );
    ensure!(log.contains(&expected), "control.log {log:?} lacks {expected:?}");
    // Its GPUs are in EXCLUSIVE_PROCESS compute mode: only its MPS server makes CUDA contexts on them.
    let exclusive = BTreeMap::from([("gpu-0", "ExclusiveProcess"), ("gpu-1", "ExclusiveProcess")]);
    let exclusive: BTreeMap<String, String> = exclusive.into_iter().map(|(d, m)| (d.into(), m.into())).collect();
    ensure!(dirs.compute_modes()? == exclusive, "compute modes while prepared: {:?}", dirs.compute_modes()?);
    // The claim's directory is a tmpfs of its own: what its workload writes there cannot fill the filesystem the
    // MPS root (and beside it the CDI specs) is on.
    let tmpfs = super::support::node::mounts_under(&dirs.mps());
    ensure!(tmpfs == [claim_dir.clone()], "mounts under the MPS root: {tmpfs:?}");
    let statfs = std::process::Command::new("stat").args(["-f", "-c", "%T"]).arg(&claim_dir).output()?;
    ensure!(String::from_utf8_lossy(&statfs.stdout).trim() == "tmpfs", "{} is not a tmpfs", claim_dir.display());
    // Its /dev/shm is the claim's shm directory, which the containers get at /dev/shm.
    let marker = std::fs::read_to_string(claim_dir.join("shm/gpu-dra-mps-stand-in"))?;
    ensure!(marker == first.to_string(), "the daemon's /dev/shm is not the claim's: {marker:?}");
    for dir in ["pipe", "log", "shm"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(claim_dir.join(dir))?.permissions().mode() & 0o7777;
        ensure!(mode == 0o1777, "{dir} has mode {mode:o}: a container's non-root processes could not write there");
    }
    let spec: Value = serde_json::from_slice(&std::fs::read(dirs.cdi_spec(&uid))?)?;
    let edits = &spec["containerEdits"];
    let env: Vec<&str> = edits["env"].as_array().context("no env")?.iter().filter_map(Value::as_str).collect();
    for wanted in [
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
        &format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={pinned}"),
    ] {
        ensure!(env.contains(&wanted), "the spec's env {env:?} lacks {wanted}");
    }
    let mounts = edits["mounts"].as_array().context("no mounts")?;
    for (host, container) in [("pipe", "/tmp/nvidia-mps"), ("shm", "/dev/shm")] {
        let host = claim_dir.join(host).display().to_string();
        ensure!(
            mounts.iter().any(|m| m["hostPath"] == host.as_str()
                && m["containerPath"] == container
                && m["options"] == json!(["rw", "nosuid", "nodev", "bind"])),
            "the spec mounts no {host} at {container}: {mounts:?}"
        );
    }

    // The daemon dies, leaving its server: the server is killed and reaped (the agent is its reaper, as its
    // container's PID 1 is), and the daemon is started again and counted.
    let first_server = *server_pids(&claim_dir).first().context("the daemon started no server")?;
    ensure!(alive(first_server), "server {first_server} does not run");
    let first_server_start = recorded_start(first_server);
    std::process::Command::new("kill").args(["-9", &first.to_string()]).status()?;
    let second = next_daemon(&claim_dir, 1).await?;
    ensure!(second != first && !alive(first), "daemon {first} was not replaced: {:?}", started_pids(&claim_dir));
    reaped("the dead daemon's server to be killed and reaped", first_server, first_server_start).await?;
    // By the agent: the test process is not the server's reaper (the agent is, as its container's PID 1 would be).
    let log = agent.log_text();
    ensure!(log.contains("reaped the MPS servers the daemon left"), "the agent did not reap the server:\n{log}");
    let restarts = agent.metric("gpu_dra_kubelet_plugin_mps_daemon_restarts_total", &[]).await?;
    ensure!(restarts == 1.0, "restarts counted: {restarts}");

    // The agent is killed; its daemon outlives it here (no container took it down). The next agent replaces it,
    // and sets the compute mode again where it was lost (a driver reloaded without a reboot).
    agent.kill()?;
    ensure!(alive(second), "the daemon went with the agent process");
    std::fs::write(dirs.state().join("simulated-compute-modes.json"), "{}")?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let third = next_daemon(&claim_dir, 2).await?;
    ensure!(dirs.compute_modes()? == exclusive, "compute modes after a restart: {:?}", dirs.compute_modes()?);
    ensure!(!alive(second), "the daemon the killed agent left still runs beside {third}");
    let again = Kubelet::register(&dirs).await?.prepare(&claims).await?;
    ensure!(again.values().all(|a| a.error.is_empty()), "a repeated prepare: {again:?}");
    ensure!(started_pids(&claim_dir).len() == 3, "a repeated prepare started another daemon");

    // The checkpoint is lost to a truncated write: the claim adopted from its spec gets its daemon back (the spec
    // names its GPUs and limits), and its directories, which the spec mounts, stay.
    agent.terminate()?;
    let gone = wait::until("the stopped agent's daemon to go", Duration::from_secs(10), || async {
        Ok((!alive(third)).then_some(()))
    })
    .await;
    ensure!(gone.is_ok(), "a stopping agent leaves its daemon running:\n{}", agent.log_tail());
    std::fs::write(dirs.checkpoint(), b"{\"version\": 1, \"checksum\": \"00\", \"checkpo")?;
    let _agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let fourth = next_daemon(&claim_dir, 3).await?;
    let adopted = checkpoint(&dirs, "boot-1")?.claims.remove(&uid).context("the claim was not adopted")?;
    ensure!(adopted.recovered && adopted.mps.as_ref() == Some(&daemon), "adopted as {adopted:?}");
    let log = std::fs::read_to_string(claim_dir.join("log/control.log"))?;
    ensure!(log.contains(&format!("started pid={fourth} devices={}", daemon.uuids.join(","))), "{log}");

    // Unprepare: the daemon is told to quit (and stops its server), and its directories go.
    let fourth_server = *server_pids(&claim_dir).last().context("no server")?;
    let fourth_server_start = recorded_start(fourth_server);
    let mut kubelet = Kubelet::register(&dirs).await?;
    let unprepared = kubelet.unprepare(&claims).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    ensure!(!alive(fourth), "daemon {fourth} still runs after unprepare");
    reaped("the quit daemon's server to go", fourth_server, fourth_server_start).await?;
    ensure!(!claim_dir.exists(), "{} is left", claim_dir.display());
    let left = super::support::node::mounts_under(&dirs.mps());
    ensure!(left.is_empty(), "mounts left under the MPS root after unprepare: {left:?}");
    ensure!(dirs.compute_modes()?.is_empty(), "compute modes after unprepare: {:?}", dirs.compute_modes()?);
    let listed = checkpoint(&dirs, "boot-1")?.exclusive_process;
    ensure!(listed.is_empty(), "the checkpoint still lists {listed:?} as set to EXCLUSIVE_PROCESS");
    Ok(())
}

/// The agent restarts while the driver is unusable (reloaded by an upgrade without a reboot, which also set every
/// GPU's compute mode back to DEFAULT): it serves without GPUs and starts the prepared MPS claim's daemon again. Once
/// the GPUs are discovered, its start-up recovery, done again with them, leaves that daemon running (it is this
/// process's own, not one a previous agent left) and sets the compute mode to EXCLUSIVE_PROCESS again.
pub(super) async fn an_mps_daemon_outlives_the_recovery_once_the_gpus_are_back(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let uid = allocated_claim(&ctx, "mps", &node, &["gpu-0"], nvidia_mps(json!({}))).await?;
    let claims = [(ctx.namespace.as_str(), "mps", uid.as_str())];
    let answers = Kubelet::register(&dirs).await?.prepare(&claims).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");
    let claim_dir: PathBuf = dirs.mps().join(&uid);
    next_daemon(&claim_dir, 0).await?;

    agent.kill()?;
    let unusable = dirs.state().join("simulated-driver-unusable");
    std::fs::write(&unusable, b"")?;
    std::fs::write(dirs.state().join("simulated-compute-modes.json"), "{}")?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"];
    let agent = start_agent(&ctx, &node, &dirs, &args)?;
    let second = next_daemon(&claim_dir, 1).await.with_context(|| agent.log_tail())?;
    ensure!(dirs.compute_modes()?.is_empty(), "a compute mode set without GPUs: {:?}", dirs.compute_modes()?);

    std::fs::remove_file(&unusable)?;
    agent.wait_ready().await.with_context(|| agent.log_tail())?;
    ensure!(agent.log_text().contains("recovered again now that the GPUs are discovered"), "{}", agent.log_tail());
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(
        alive(second) && started_pids(&claim_dir).len() == 2,
        "the recovery replaced the agent's own daemon {second}: {:?}",
        started_pids(&claim_dir)
    );
    let restarts = agent.metric("gpu_dra_kubelet_plugin_mps_daemon_restarts_total", &[]).await?;
    ensure!(restarts == 0.0, "daemon restarts counted: {restarts}");
    let exclusive = BTreeMap::from([("gpu-0".to_string(), "ExclusiveProcess".to_string())]);
    ensure!(dirs.compute_modes()? == exclusive, "compute modes once the GPUs are back: {:?}", dirs.compute_modes()?);
    Ok(())
}

/// A per-device limit naming a device the claim does not have is refused with the reason; nothing is started or
/// left.
pub(super) async fn mps_settings_naming_no_device_are_refused(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let _agent = ready_agent(&ctx, &node, &dirs, "1xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let config = nvidia_mps(json!({"defaultPerDevicePinnedMemoryLimit": {"3": "1Gi"}}));
    let uid = allocated_claim(&ctx, "bad-key", &node, &["gpu-0"], config).await?;
    let answers = Kubelet::register(&dirs).await?.prepare(&[(ns, "bad-key", uid.as_str())]).await?;
    let error = &answers.get(&uid).context("no answer")?.error;
    ensure!(
        error.contains("defaultPerDevicePinnedMemoryLimit[\"3\"] names none of the claim's 1 device(s)"),
        "{error:?}"
    );
    ensure!(!dirs.mps().join(&uid).exists() && !dirs.cdi_spec(&uid).exists(), "a refused claim left files");
    ensure!(!checkpoint(&dirs, "boot-1")?.claims.contains_key(&uid), "a refused claim is recorded");
    Ok(())
}

/// A daemon that cannot be started (its claim's directory cannot be made) fails the prepare with the reason, and the
/// GPU set to EXCLUSIVE_PROCESS for it is set back to DEFAULT; the kubelet's retry, once the fault is gone, prepares
/// it. A set-back that fails at unprepare is counted and keeps the next claim asking no MPS from getting the GPU in
/// EXCLUSIVE_PROCESS.
pub(super) async fn an_mps_daemon_that_cannot_start_leaves_the_gpu_at_default(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = ready_agent(&ctx, &node, &dirs, "1xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let uid = allocated_claim(&ctx, "blocked", &node, &["gpu-0"], nvidia_mps(json!({}))).await?;
    let claims = [(ns, "blocked", uid.as_str())];
    std::fs::create_dir_all(dirs.mps())?;
    std::fs::write(dirs.mps().join(&uid), "in the way")?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let answers = kubelet.prepare(&claims).await?;
    let error = &answers.get(&uid).context("no answer")?.error;
    ensure!(error.contains("create the MPS directories of claim"), "{error:?}");
    ensure!(dirs.compute_modes()?.is_empty(), "compute modes after a failed prepare: {:?}", dirs.compute_modes()?);
    let log = agent.log_text();
    ensure!(log.contains("set the GPU's compute mode back to DEFAULT"), "it was never set, or not back:\n{log}");
    let recorded = checkpoint(&dirs, "boot-1")?;
    ensure!(recorded.exclusive_process.is_empty() && !recorded.claims.contains_key(&uid), "{recorded:?}");

    std::fs::remove_file(dirs.mps().join(&uid))?;
    let answers = kubelet.prepare(&claims).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "the retry: {answers:?}");
    ensure!(dirs.compute_modes()?.get("gpu-0").map(String::as_str) == Some("ExclusiveProcess"), "after the retry");

    // Setting it back fails at unprepare (the simulated GPU's setting cannot be written): it stays listed and is
    // counted, and a claim asking no MPS is not given the GPU in EXCLUSIVE_PROCESS: its prepare fails saying why
    // until the GPU can be set back, then succeeds with the GPU at DEFAULT.
    let modes = dirs.state().join("simulated-compute-modes.json");
    std::fs::remove_file(&modes)?;
    std::fs::create_dir(&modes)?;
    let unprepared = kubelet.unprepare(&claims).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    let failures = agent.metric("gpu_dra_kubelet_plugin_compute_mode_restore_failures_total", &[]).await?;
    ensure!(failures == 1.0, "failed set-backs counted: {failures}");
    ensure!(checkpoint(&dirs, "boot-1")?.exclusive_process.contains("gpu-0"), "no longer listed after a failure");
    let plain_uid = allocated_claim(&ctx, "plain", &node, &["gpu-0"], json!([])).await?;
    let plain = [(ns, "plain", plain_uid.as_str())];
    let answers = kubelet.prepare(&plain).await?;
    let error = &answers.get(&plain_uid).context("no answer")?.error;
    ensure!(error.contains("is still in the EXCLUSIVE_PROCESS compute mode"), "{error:?}");
    std::fs::remove_dir(&modes)?;
    let answers = kubelet.prepare(&plain).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "once it can be set back: {answers:?}");
    ensure!(dirs.compute_modes()?.is_empty(), "compute modes of the plain claim: {:?}", dirs.compute_modes()?);
    ensure!(checkpoint(&dirs, "boot-1")?.exclusive_process.is_empty(), "still listed once set back");
    let unprepared = kubelet.unprepare(&plain).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    Ok(())
}

/// A monitoring claim holding the GPU with admin access, prepared in one batch with an MPS claim of that GPU (either
/// first): it changes nothing of the GPU, which stays in EXCLUSIVE_PROCESS for the MPS claim and listed, and is set
/// back to DEFAULT once both are unprepared.
pub(super) async fn an_admin_access_claim_beside_an_mps_claim_changes_nothing(ctx: TestContext) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Namespace;
    use k8s_openapi::api::resource::v1::ResourceClaim;
    use kube::Api;
    use kube::api::{Patch, PatchParams, PostParams};
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let _agent = ready_agent(&ctx, &node, &dirs, "1xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let label = json!({"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}});
    Api::<Namespace>::all(ctx.client.clone()).patch(ns, &PatchParams::default(), &Patch::Merge(&label)).await?;
    let mps_uid = allocated_claim(&ctx, "mps", &node, &["gpu-0"], nvidia_mps(json!({}))).await?;
    let claims = super::support::objects::claims(&ctx);
    let monitor: ResourceClaim = serde_json::from_value(json!({"metadata": {"name": "monitor"}, "spec": {"devices": {
        "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "adminAccess": true}}]}}}))?;
    let monitor_uid = claims.create(&PostParams::default(), &monitor).await?.metadata.uid.context("no UID")?;
    let status = json!({"status": {"allocation": {"devices": {"results": [
        {"request": "gpus", "driver": DRIVER, "pool": node, "device": "gpu-0", "adminAccess": true}]}}}});
    claims.patch_status("monitor", &PatchParams::default(), &Patch::Merge(&status)).await?;
    let (mps, monitor) = ((ns, "mps", mps_uid.as_str()), (ns, "monitor", monitor_uid.as_str()));
    let mut kubelet = Kubelet::register(&dirs).await?;
    for batch in [[mps, monitor], [monitor, mps]] {
        let answers = kubelet.prepare(&batch).await?;
        ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");
        let modes = dirs.compute_modes()?;
        ensure!(modes.get("gpu-0").map(String::as_str) == Some("ExclusiveProcess"), "{batch:?}: {modes:?}");
        let listed = checkpoint(&dirs, "boot-1")?.exclusive_process;
        ensure!(listed.contains("gpu-0"), "{batch:?}: the GPU is no longer listed: {listed:?}");
        let unprepared = kubelet.unprepare(&batch).await?;
        ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
        ensure!(dirs.compute_modes()?.is_empty(), "{batch:?}: after unprepare: {:?}", dirs.compute_modes()?);
    }
    Ok(())
}

/// A claim's MPS daemon hangs (stuck in the driver on a faulted GPU; here stopped with SIGSTOP): its unprepare
/// asks it to quit, waits out the stop timeout and kills it. Meanwhile another tenant's claim on the node's other
/// GPU prepares as ever: the daemon is stopped with the node's state lock let go (before, every prepare and
/// unprepare of the node waited the 10 s with it). The hung claim's GPU stays listed until its daemon is gone; a
/// claim unprepared in the same batch (the pod's other claim) is done and recorded before the lock is let go, so
/// the look for lost specs does not write its spec again meanwhile.
pub(super) async fn a_hung_mps_daemon_holds_back_no_other_claim(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = ready_agent(&ctx, &node, &dirs, "3xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let mps_uid = allocated_claim(&ctx, "mps", &node, &["gpu-0"], nvidia_mps(json!({}))).await?;
    let other_uid = allocated_claim(&ctx, "other", &node, &["gpu-1"], json!([])).await?;
    let beside_uid = allocated_claim(&ctx, "beside", &node, &["gpu-2"], json!([])).await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let answers = kubelet.prepare(&[(ns, "mps", mps_uid.as_str()), (ns, "beside", beside_uid.as_str())]).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");
    let claim_dir = dirs.mps().join(&mps_uid);
    let daemon = next_daemon(&claim_dir, 0).await?;
    std::process::Command::new("kill").args(["-STOP", &daemon.to_string()]).status()?;

    let (namespace, uid, beside) = (ns.to_string(), mps_uid.clone(), beside_uid.clone());
    let unprepare = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let both = [(namespace.as_str(), "mps", uid.as_str()), (namespace.as_str(), "beside", beside.as_str())];
        let answer = kubelet.unprepare(&both).await;
        (answer, started.elapsed())
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut other_kubelet = Kubelet::register(&dirs).await?;
    let started = std::time::Instant::now();
    let answers = other_kubelet.prepare(&[(ns, "other", other_uid.as_str())]).await?;
    let waited = started.elapsed();
    ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");
    ensure!(
        waited < Duration::from_secs(3),
        "the other claim's prepare waited {waited:?} for the hung daemon:\n{}",
        agent.log_tail()
    );
    let listed = checkpoint(&dirs, "boot-1")?.claims;
    ensure!(listed.contains_key(&mps_uid), "the hung claim's entry went before its daemon");
    ensure!(!listed.contains_key(&beside_uid), "the batch's other claim is not recorded done while the daemon stops");

    let (answer, took) = unprepare.await?;
    let answer = answer?;
    ensure!(answer.values().all(String::is_empty), "{answer:?}");
    ensure!(took >= Duration::from_secs(5), "the unprepare took {took:?}: the daemon did not hang");
    ensure!(!alive(daemon), "the hung daemon {daemon} still runs after its unprepare");
    ensure!(!claim_dir.exists(), "{} is left", claim_dir.display());
    ensure!(agent.log_text().contains("did not quit within"), "the log does not say why it was killed");
    ensure!(!checkpoint(&dirs, "boot-1")?.claims.contains_key(&mps_uid), "the entry is left");
    ensure!(!dirs.cdi_spec(&beside_uid).exists(), "the other claim's spec is back");
    Ok(())
}

/// An MPS directory holding what the agent did not make (`--mps-dir` pointed at a shared directory such as the
/// host's `/run`, or an operator's files beside the claims'): start-up removes only the claim directories it made
/// (named by a claim UID, holding only a daemon's directories) and says what it left alone; before, it removed every
/// entry no prepared claim had, and unmounted the mounts among them. A directory other software keeps files in is
/// refused at start, naming the flag.
pub(super) async fn start_up_removes_only_the_mps_directories_the_agent_made(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mps = dirs.mps();
    let foreign = mps.join("containerd/io.containerd.runtime.v2.task/k8s.io/state.json");
    let foreign_uid = mps.join("16fd2706-8baf-433b-82eb-8c7fada847da");
    let ours = mps.join("0f8fad5b-d9cb-469f-a165-70867728950e");
    std::fs::create_dir_all(foreign.parent().context("parent")?)?;
    std::fs::write(&foreign, b"{}")?;
    std::fs::create_dir_all(foreign_uid.join("pipe"))?;
    std::fs::write(foreign_uid.join("data"), b"not a daemon's")?;
    for dir in ["pipe", "log", "shm"] {
        std::fs::create_dir_all(ours.join(dir))?;
    }
    let agent = ready_agent(&ctx, &node, &dirs, "1xH100-80GB").await?;
    wait::until("the orphaned claim directory removed", Duration::from_secs(10), || async {
        Ok((!ours.exists()).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(foreign.exists(), "start-up removed {}", foreign.display());
    ensure!(foreign_uid.join("data").exists(), "start-up removed {}", foreign_uid.display());
    ensure!(agent.log_text().contains("left alone"), "what was left is not said:\n{}", agent.log_tail());

    let state = tempfile::tempdir()?;
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .args(["node-agent", "--node-name", &node, "--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB"])
        .arg("--state-dir")
        .arg(state.path())
        .args(["--mps-dir", "/run/"])
        .env("KUBECONFIG", ctx.cluster.kubeconfig())
        .output()?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(!refused.status.success(), "the host's /run was taken for the MPS directory: {stderr}");
    ensure!(stderr.contains("--mps-dir /run/ is a directory other software keeps its own files in"), "{stderr}");
    Ok(())
}

/// Two tenants' MPS claims, one GPU each. A root container of the first replaces its claim's control pipe (the
/// pipe directory is shared with the claim's containers) with a link to the second claim's, and its pod is deleted:
/// the first claim's unprepare must not send its `quit` down the link. Before, the second claim's daemon quit, its
/// servers with it, while its workload ran.
pub(super) async fn a_control_pipe_replaced_by_a_link_sends_no_quit_to_another_claims_daemon(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let ns = ctx.namespace.as_str();
    let a = allocated_claim(&ctx, "a", &node, &["gpu-0"], nvidia_mps(json!({}))).await?;
    let b = allocated_claim(&ctx, "b", &node, &["gpu-1"], nvidia_mps(json!({}))).await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let answers = kubelet.prepare(&[(ns, "a", a.as_str()), (ns, "b", b.as_str())]).await?;
    ensure!(answers.values().all(|r| r.error.is_empty()), "{answers:?}");
    let (a_dir, b_dir) = (dirs.mps().join(&a), dirs.mps().join(&b));
    let (a_daemon, b_daemon) = (next_daemon(&a_dir, 0).await?, next_daemon(&b_dir, 0).await?);

    let control = a_dir.join("pipe/control");
    std::fs::remove_file(&control)?;
    std::os::unix::fs::symlink(b_dir.join("pipe/control"), &control)?;
    let unprepared = kubelet.unprepare(&[(ns, "a", a.as_str())]).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    ensure!(!alive(a_daemon), "the first claim's daemon {a_daemon} still runs after its unprepare");
    ensure!(!a_dir.exists(), "{} is left", a_dir.display());
    // The second daemon got no quit: still the first one started, never restarted.
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(alive(b_daemon), "the second claim's daemon {b_daemon} quit:\n{}", agent.log_tail());
    ensure!(started_pids(&b_dir) == [b_daemon], "the second claim's daemon was restarted: {:?}", started_pids(&b_dir));
    ensure!(!std::fs::read_to_string(b_dir.join("log/control.log"))?.contains("quit"), "quit reached the second");
    ensure!(agent.log_text().contains("is a symbolic link"), "the replaced pipe is not said:\n{}", agent.log_tail());
    let unprepared = kubelet.unprepare(&[(ns, "b", b.as_str())]).await?;
    ensure!(unprepared.values().all(String::is_empty) && !alive(b_daemon), "{unprepared:?}");
    Ok(())
}
