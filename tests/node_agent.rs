//! `gpu-dra node-agent` against the real API server and scheduler: discovery (simulated; NVML where no driver is
//! installed), ResourceSlices for its node, re-publication after deletion, allocation from them, and a driver
//! upgraded in place under a running agent.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::harness::KubeletHarness;
use support::node::{DRIVER, Kubelet, NodeAgent, NodeDirs, start_agent};
use support::objects::{self, create_pod_on};
use support::{TestContext, wait};

fn main() {
    support::run(
        "node_agent",
        &[
            test!(publishes_simulated_gpus_as_slices_of_its_node),
            test!(deleted_slices_are_published_again),
            test!(a_node_with_the_longest_name_publishes_its_gpus),
            test!(scheduler_allocates_from_published_gpus),
            test!(many_gpus_split_and_a_change_bumps_the_generation),
            test!(a_change_to_one_slice_of_a_pool_updates_it_in_place),
            test!(without_a_driver_it_stays_up_not_ready_and_publishes_nothing),
            test!(a_bad_simulated_spec_is_refused_with_the_reason),
            test!(a_driver_upgraded_in_place_is_what_the_next_prepare_mounts),
            test!(a_node_label_chooses_gpu_sharing_for_its_node_pool),
            test!(beside_a_device_plugin_serving_gpus_the_agent_publishes_none_until_it_is_gone),
            test!(beside_another_dra_driver_publishing_its_gpus_the_agent_publishes_none),
            test!(a_restarted_agent_republishes_only_a_pool_the_server_stored_short),
            test!(a_replacement_agent_waits_for_the_old_one_and_keeps_its_sockets),
            test!(an_agent_the_kubelet_never_registers_says_so_on_its_node),
            test!(a_kubelet_up_before_the_agent_beside_a_stale_socket_registers_it_at_once),
            test!(a_failed_publish_leaves_no_partial_pool_and_backs_off),
            test!(old_slices_a_policy_keeps_hold_back_new_generations),
            test!(a_slice_someone_edits_gets_the_agents_devices_back),
            test!(dynamic_mig_publishes_a_pool_wherever_partitionable_devices_are_on),
        ],
    )
}

/// What a classic device plugin's registration makes of a Node: `nvidia.com/gpu` in its capacity and allocatable,
/// as the kubelet's device manager writes them (`count` 0: the plugin stopped, its resource kept with nothing
/// allocatable).
async fn device_plugin_gpus(ctx: &TestContext, node: &str, count: u32) -> anyhow::Result<()> {
    let gpus = json!({"nvidia.com/gpu": count.to_string()});
    let patch = json!({"status": {"capacity": gpus, "allocatable": gpus}});
    Api::<k8s_openapi::api::core::v1::Node>::all(ctx.client.clone())
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// A node name unique to the test (node names become 63-character label values).
fn node_name(ctx: &TestContext) -> String {
    format!("gpu-node-{}", &ctx.namespace[ctx.namespace.len() - 6..])
}

async fn agent(ctx: &TestContext, node: &str, extra: &[&str]) -> anyhow::Result<NodeAgent> {
    NodeAgent::start(ctx, node, extra)
}

async fn slices_of(ctx: &TestContext, node: &str) -> anyhow::Result<Vec<ResourceSlice>> {
    let selector = format!("spec.nodeName={node},spec.driver={DRIVER}");
    Ok(Api::<ResourceSlice>::all(ctx.client.clone()).list(&ListParams::default().fields(&selector)).await?.items)
}

fn device_names(slices: &[ResourceSlice]) -> Vec<String> {
    let mut names: Vec<String> =
        slices.iter().flat_map(|s| s.spec.devices.clone().unwrap_or_default()).map(|d| d.name).collect();
    names.sort();
    names
}

async fn wait_devices(ctx: &TestContext, node: &str, count: usize) -> anyhow::Result<Vec<ResourceSlice>> {
    wait::until(&format!("{count} published devices"), Duration::from_secs(30), || async {
        let slices = slices_of(ctx, node).await?;
        Ok((device_names(&slices).len() == count).then_some(slices))
    })
    .await
}

async fn publishes_simulated_gpus_as_slices_of_its_node(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let agent = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "4xH100-80GB"]).await?;
    agent.wait_ready().await?;
    let slices = wait_devices(&ctx, &node, 4).await?;
    ensure!(slices.len() == 1, "{} slices", slices.len());
    let slice = &slices[0];
    let node_obj = Api::<k8s_openapi::api::core::v1::Node>::all(ctx.client.clone()).get(&node).await?;
    let owner = slice.owner_references().first().context("no owner")?;
    ensure!(
        owner.kind == "Node" && owner.name == node && Some(&owner.uid) == node_obj.metadata.uid.as_ref(),
        "{owner:?}"
    );
    ensure!(
        slice.spec.pool.name == node
            && slice.spec.pool.resource_slice_count == 1
            && slice.spec.node_name.as_deref() == Some(node.as_str()),
        "{:?}",
        slice.spec.pool
    );
    ensure!(device_names(&slices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"], "{:?}", device_names(&slices));
    let device = serde_json::to_value(&slice.spec.devices.as_ref().context("no devices")?[0])?;
    ensure!(device["attributes"]["productName"]["string"] == "NVIDIA H100 80GB HBM3", "{device}");
    ensure!(device["attributes"]["uuid"]["string"].as_str().is_some_and(|u| u.starts_with("GPU-")), "{device}");
    ensure!(agent.metric("gpu_dra_node_agent_devices", &[]).await? == 4.0, "devices gauge");
    // The liveness probe calls the plugin's socket with an empty unprepare: no call of the kubelet's, not counted as
    // one (every 10 s it made an idle node's unprepares look busy and fast).
    for _ in 0..3 {
        let (code, _) = agent.process.get("/healthz").await?;
        ensure!(code == 200, "/healthz answered {code}");
    }
    let unprepares = [("operation", "Unprepare")];
    let counted = agent.metric("gpu_dra_kubelet_plugin_request_duration_seconds_count", &unprepares).await?;
    ensure!(counted == 0.0, "{counted} unprepare calls counted; the kubelet made none");
    Ok(())
}

/// A node whose name is as long as Kubernetes takes (253 characters; some clouds' hostnames come close): its GPUs
/// are published. The slices' `generateName` is cut to what the API server keeps of it; before, a node name of more
/// than 236 characters made a `generateName` over 253, and every slice of the node was refused.
async fn a_node_with_the_longest_name_publishes_its_gpus(ctx: TestContext) -> anyhow::Result<()> {
    let mut node = node_name(&ctx);
    while node.len() + 1 < 253 {
        let room = 253 - node.len() - 1;
        node = format!("{node}.{}", "n".repeat(room.min(63)));
    }
    ensure!(node.len() == 253, "{} characters", node.len());
    ctx.cluster.add_node(&node)?;
    let agent = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xL4-24GB"]).await?;
    let slices = wait_devices(&ctx, &node, 2).await.with_context(|| agent.log_tail())?;
    ensure!(slices.iter().all(|s| s.spec.pool.name == node), "pools {:?}", slices.iter().map(|s| &s.spec.pool));
    Ok(())
}

async fn deleted_slices_are_published_again(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let agent = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xL4-24GB"]).await?;
    let first = wait_devices(&ctx, &node, 2).await?;
    // What a kubelet restart does: delete every slice of the node.
    let api = Api::<ResourceSlice>::all(ctx.client.clone());
    for slice in &first {
        api.delete(&slice.name_any(), &DeleteParams::default()).await?;
    }
    let deleted = std::time::Instant::now();
    let again = wait::until("the slices to be published again", Duration::from_secs(10), || async {
        let slices = slices_of(&ctx, &node).await?;
        let fresh = slices.iter().all(|s| first.iter().all(|f| f.uid() != s.uid()));
        Ok((device_names(&slices).len() == 2 && fresh).then_some(slices))
    })
    .await
    .with_context(|| agent.log_tail())?;
    eprintln!("re-published {:?} after deletion", deleted.elapsed());
    ensure!(again[0].spec.pool.generation > first[0].spec.pool.generation, "generation not bumped");
    Ok(())
}

async fn scheduler_allocates_from_published_gpus(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let _agent =
        agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xA100-40GB,2xH100-80GB"]).await?;
    wait_devices(&ctx, &node, 4).await?;
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": ctx.namespace},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'")}}]}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &class).await?;
    let claim: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "two-h100"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": ctx.namespace, "count": 2,
            "selectors": [{"cel": {"expression": format!("device.attributes['{DRIVER}'].productName.startsWith('NVIDIA H100') && device.capacity['{DRIVER}'].memory.compareTo(quantity('80G')) >= 0")}}]
        }}]}}
    }))?;
    objects::claims(&ctx).create(&PostParams::default(), &claim).await?;
    create_pod_on(&ctx, "trainer", &node, json!([{"name": "gpu", "resourceClaimName": "two-h100"}])).await?;
    let claims = objects::claims(&ctx);
    let devices = wait::until("the scheduler to allocate two H100s", Duration::from_secs(30), || async {
        let c = claims.get("two-h100").await?;
        let results = c.status.and_then(|s| s.allocation).and_then(|a| a.devices).and_then(|d| d.results);
        Ok(results.map(|r| r.into_iter().map(|r| (r.pool, r.device)).collect::<Vec<_>>()))
    })
    .await?;
    let mut names: Vec<&str> = devices.iter().map(|(_, d)| d.as_str()).collect();
    names.sort();
    ensure!(names == ["gpu-2", "gpu-3"] && devices.iter().all(|(p, _)| *p == node), "allocated {devices:?}");
    Ok(())
}

async fn many_gpus_split_and_a_change_bumps_the_generation(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let mut big = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "200xL4-24GB"]).await?;
    let slices = wait_devices(&ctx, &node, 200).await?;
    let mut sizes: Vec<usize> = slices.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).collect();
    sizes.sort();
    ensure!(sizes == [72, 128], "slice sizes {sizes:?}");
    ensure!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 2), "resourceSliceCount");
    let generation = slices[0].spec.pool.generation;
    big.terminate()?;

    let _small = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "4xL4-24GB"]).await?;
    let after = wait::until("the smaller pool, alone", Duration::from_secs(30), || async {
        let s = slices_of(&ctx, &node).await?;
        Ok((s.len() == 1 && device_names(&s).len() == 4).then_some(s))
    })
    .await?;
    ensure!(
        after[0].spec.pool.generation > generation,
        "generation {} → {}",
        generation,
        after[0].spec.pool.generation
    );
    Ok(())
}

/// A fault on one GPU of a pool of several slices (200 GPUs, 64 a slice once one is tainted) changes one slice: it
/// is updated in place and the pool keeps its generation, as upstream's resourceslice controller does. A new
/// generation would be incomplete until all its slices were written, and the scheduler allocates nothing from an
/// incomplete pool: every GPU of the node out of reach for those round trips, at every health change of a
/// dynamic-MIG node (a slice per GPU).
async fn a_change_to_one_slice_of_a_pool_updates_it_in_place(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let agent = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "200xL4-24GB"]).await?;
    wait_devices(&ctx, &node, 200).await?;
    let stored = |slices: &[ResourceSlice]| -> BTreeSet<(String, i64, String)> {
        slices
            .iter()
            .map(|s| (s.name_any(), s.spec.pool.generation, s.resource_version().unwrap_or_default()))
            .collect()
    };
    // A first fault splits the pool anew (a slice with a tainted device holds at most 64): a new generation.
    support::node::inject_fault(&agent.dirs.state(), "gpu-10 xid 48")?;
    let before = wait::until("the pool split for taints", Duration::from_secs(10), || async {
        let slices = slices_of(&ctx, &node).await?;
        Ok((slices.len() == 4 && device_names(&slices).len() == 200).then_some(slices))
    })
    .await
    .with_context(|| agent.log_tail())?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let was = stored(&slices_of(&ctx, &node).await?);
    ensure!(was == stored(&before), "the pool kept changing: {was:?}");
    support::node::inject_fault(&agent.dirs.state(), "gpu-150 xid 48")?;
    wait::until("the faulted GPU's slice to change", Duration::from_secs(10), || async {
        Ok((stored(&slices_of(&ctx, &node).await?) != was).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    // Whatever the API server keeps of the taint (before 1.36 it drops it), the slice holding gpu-150 was written
    // again and the other one was not; the names and the generation stay (a second later too).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let now = slices_of(&ctx, &node).await?;
    let names = |s: &BTreeSet<(String, i64, String)>| s.iter().map(|(n, g, _)| (n.clone(), *g)).collect::<Vec<_>>();
    let is = stored(&now);
    ensure!(names(&is) == names(&was), "the pool was published anew: {was:?} → {is:?}\n{}", agent.log_tail());
    let kept: Vec<_> = is.intersection(&was).collect();
    let holds = |name: &str| {
        now.iter().any(|s| s.name_any() == name && s.spec.devices.iter().flatten().any(|d| d.name == "gpu-150"))
    };
    ensure!(
        kept.len() + 1 == was.len() && kept.iter().all(|(name, _, _)| !holds(name)),
        "one slice, gpu-150's, written again; kept: {kept:?}"
    );
    ensure!(agent.log_text().contains("updated one ResourceSlice in place"), "{}", agent.log_tail());
    Ok(())
}

/// A node whose driver is not installed yet (the GPU Operator's driver container builds and loads it minutes after
/// the node joins): the agent stays up and not ready, says why, publishes nothing, and keeps looking for the driver
/// at least every 10 s however long it is missing (with the back-off of other failures, the sixth try would wait
/// 32 s and later ones up to 5 minutes: GPUs unpublished that long after the driver is ready), saying so once.
async fn without_a_driver_it_stays_up_not_ready_and_publishes_nothing(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let missing_root = std::env::temp_dir().join("gpu-dra-no-driver-here");
    let root = missing_root.to_string_lossy();
    let mut agent =
        agent(&ctx, &node, &["--gpu-backend", "nvml", "--driver-root", &root, "--log-filter", "gpu_dra=debug"]).await?;
    let (code, body) = wait::until("/readyz to explain", Duration::from_secs(20), || async {
        Ok(agent.get("/readyz").await.ok().filter(|(_, body)| body.contains("NVML")))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(
        code == 503 && body.contains("libnvidia-ml.so.1") && body.contains("NVIDIA driver installed"),
        "{code} {body}"
    );
    ensure!(agent.get("/healthz").await?.0 == 200, "the process must stay healthy");
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(agent.try_wait()?.is_none(), "the agent exited:\n{}", agent.log_tail());
    ensure!(slices_of(&ctx, &node).await?.is_empty(), "published without GPUs");
    // Six tries: about 25 s with the 10 s cap, 31 s without.
    let waits = wait::until("six tries for the driver", Duration::from_secs(60), || async {
        let waits = retry_waits(&agent.log_text());
        Ok((waits.len() >= 6).then_some(waits))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(waits.iter().all(|w| *w <= Duration::from_secs(10)), "waits between tries for the driver: {waits:?}");
    let log = agent.log_text();
    for what in ["discover and publish failed", "NVML health events unavailable"] {
        let warned = log.lines().filter(|l| l.contains(" WARN ") && l.contains(what)).count();
        ensure!(warned == 1, "{what}: said {warned} times, not once:\n{}", agent.log_tail());
    }
    ensure!(slices_of(&ctx, &node).await?.is_empty(), "published without GPUs");
    Ok(())
}

/// The `retry_in` of each failed round the agent logged (`retry_in=4s`, `retry_in=500ms`).
fn retry_waits(log: &str) -> Vec<Duration> {
    log.lines()
        .filter(|l| l.contains("discover and publish failed"))
        .filter_map(|l| l.split("retry_in=").nth(1)?.split_whitespace().next())
        .filter_map(|w| match w.strip_suffix("ms") {
            Some(ms) => ms.parse::<f64>().ok().map(|ms| Duration::from_secs_f64(ms / 1000.0)),
            None => w.strip_suffix('s')?.parse::<f64>().ok().map(Duration::from_secs_f64),
        })
        .collect()
}

async fn a_bad_simulated_spec_is_refused_with_the_reason(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    let mut agent = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "4xV100"]).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = agent.try_wait()? {
            break status;
        }
        ensure!(std::time::Instant::now() < deadline, "the agent did not exit on a bad spec");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(!status.success(), "exit {status}");
    let log = agent.log_text();
    ensure!(log.contains("unknown model \"V100\"") && log.contains("H100-80GB"), "{log}");
    Ok(())
}

/// Installs the user-space driver of `version` under `root` as a package would: the versioned libraries, their
/// soname links switched to them, the GSP firmware of that version.
fn install_driver(root: &Path, version: &str) -> anyhow::Result<()> {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib)?;
    std::fs::create_dir_all(root.join(format!("lib/firmware/nvidia/{version}")))?;
    std::fs::write(root.join(format!("lib/firmware/nvidia/{version}/gsp_ga10x.bin")), b"firmware")?;
    for library in ["libcuda.so", "libnvidia-ml.so"] {
        std::fs::write(lib.join(format!("{library}.{version}")), b"elf")?;
        let link = lib.join(format!("{library}.1"));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(format!("{library}.{version}"), link)?;
    }
    Ok(())
}

/// Removes what [`install_driver`] installed of `version` (the soname links stay: they point at the new version).
fn remove_driver(root: &Path, version: &str) -> anyhow::Result<()> {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    for library in ["libcuda.so", "libnvidia-ml.so"] {
        std::fs::remove_file(lib.join(format!("{library}.{version}")))?;
    }
    std::fs::remove_dir_all(root.join(format!("lib/firmware/nvidia/{version}")))?;
    Ok(())
}

/// A one-GPU claim `name` for a pod on `node`, allocated and reserved by the scheduler; returns its UID.
async fn scheduled_claim(ctx: &TestContext, name: &str, node: &str) -> anyhow::Result<String> {
    let claim: k8s_openapi::api::resource::v1::ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": ctx.namespace}}]}}
    }))?;
    objects::claims(ctx).create(&PostParams::default(), &claim).await?;
    create_pod_on(ctx, &format!("{name}-pod"), node, json!([{"name": "gpu", "resourceClaimName": name}])).await?;
    let claims = objects::claims(ctx);
    wait::until(&format!("the scheduler to allocate {name}"), Duration::from_secs(30), || async {
        let c = claims.get(name).await?;
        let reserved = c.status.as_ref().and_then(|s| s.reserved_for.as_ref()).is_some_and(|r| !r.is_empty());
        Ok(reserved.then(|| c.metadata.uid.unwrap_or_default()))
    })
    .await
}

/// The host paths a CDI spec mounts.
fn mounted_files(spec: &Path) -> anyhow::Result<Vec<String>> {
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(spec)?)?;
    let mounts = spec["containerEdits"]["mounts"].as_array().context("the spec mounts no driver files")?;
    Ok(mounts.iter().filter_map(|m| m["hostPath"].as_str().map(str::to_string)).collect())
}

/// A driver upgraded in place under running agents (the driver root is mounted with HostToContainer propagation
/// for that; the GPU Operator's driver container mounts its root again, which the chart's mount of the root's
/// parent shows, render-tested in `tests/chart`): the claims prepared afterwards must mount the new version's files,
/// never the removed ones, or every new GPU container fails to start. The spec of the claim prepared before is
/// written again too (within the agent's 10 s look): the runtime reads it at every container start of the running
/// pod (a restart after a crash), and a mount of a removed file fails it. Then the driver is upgraded again while the agent is
/// stopped: the restarted agent writes both specs again before it serves (before, only missing specs were written
/// at start, and the driver's files of the last start were taken as those the specs named).
async fn a_driver_upgraded_in_place_is_what_the_next_prepare_mounts(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let root = tempfile::tempdir()?;
    install_driver(root.path(), "550.54.15")?;
    let root_arg = root.path().to_string_lossy().into_owned();
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--driver-root", &root_arg];
    let mut agent = agent(&ctx, &node, &args).await?;
    agent.wait_ready().await?;
    let mut kubelet = Kubelet::register(&agent.dirs).await?;
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": ctx.namespace},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}]}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &class).await?;
    let ns = ctx.namespace.clone();

    for (claim, version, removed) in [("before", "550.54.15", "570.86.10"), ("after", "570.86.10", "550.54.15")] {
        if claim == "after" {
            install_driver(root.path(), version)?;
            remove_driver(root.path(), removed)?;
        }
        let uid = scheduled_claim(&ctx, claim, &node).await?;
        let answer = kubelet.prepare(&[(&ns, claim, &uid)]).await?;
        let prepared = answer.get(&uid).context("no answer")?;
        ensure!(prepared.error.is_empty(), "prepare {claim}: {}\n{}", prepared.error, agent.log_tail());
        let files = mounted_files(&agent.dirs.cdi_spec(&uid))?;
        // Two libraries and their soname links, at their own paths and where CUDA images look, the sonames where
        // RHEL-family images look, and the firmware.
        ensure!(
            files.len() == 11
                && files.iter().all(|f| f.contains(version) && !f.contains(removed))
                && files.iter().all(|f| Path::new(f).exists()),
            "the spec of {claim} (driver {version} installed) mounts {files:?}"
        );
    }
    let before = objects::claims(&ctx).get("before").await?.metadata.uid.unwrap_or_default();
    let spec = agent.dirs.cdi_spec(&before);
    let files =
        wait::until("the spec prepared before the upgrade to mount the new files", Duration::from_secs(25), || {
            let spec = spec.clone();
            async move {
                let files = mounted_files(&spec)?;
                Ok(files.iter().all(|f| f.contains("570.86.10") && Path::new(f).exists()).then_some(files))
            }
        })
        .await
        .with_context(|| agent.log_tail())?;
    ensure!(files.len() == 11, "{files:?}");
    ensure!(agent.metric("gpu_dra_kubelet_plugin_specs_rewritten_total", &[]).await? >= 1.0, "not counted");
    ensure!(agent.try_wait()?.is_none(), "the agent exited:\n{}", agent.log_tail());
    ensure!(
        agent.log_text().contains("the driver's files changed"),
        "the re-discovery is not logged:\n{}",
        agent.log_tail()
    );

    // Upgraded again while no agent runs (stopped for the upgrade, as charts/README says, with pods left on the
    // node): the restarted agent's specs name the files there are, before it serves.
    agent.process.kill()?;
    install_driver(root.path(), "580.65.06")?;
    remove_driver(root.path(), "570.86.10")?;
    agent.process = support::node::start_agent(&ctx, &node, &agent.dirs, &args)?;
    agent.wait_ready().await?;
    for claim in ["before", "after"] {
        let uid = objects::claims(&ctx).get(claim).await?.metadata.uid.unwrap_or_default();
        let files = mounted_files(&agent.dirs.cdi_spec(&uid))?;
        ensure!(
            files.len() == 11 && files.iter().all(|f| f.contains("580.65.06") && Path::new(f).exists()),
            "the spec of {claim} after a restart onto driver 580.65.06 mounts {files:?}\n{}",
            agent.log_tail()
        );
    }
    Ok(())
}

/// Whether every published device of `node` allows multiple allocations (shared by memory), none does (whole), or
/// they differ (`None`).
async fn shared(ctx: &TestContext, node: &str) -> anyhow::Result<Option<bool>> {
    let slices = slices_of(ctx, node).await?;
    let flags: Vec<bool> = slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .map(|d| d.allow_multiple_allocations == Some(true))
        .collect();
    Ok(match flags.first() {
        Some(first) if flags.iter().all(|f| f == first) => Some(*first),
        _ => None,
    })
}

/// NVIDIA's DRA driver left on a node (or shipped by its image) publishes the same GPUs under `gpu.nvidia.com`: the
/// scheduler would give one GPU to a claim of each. The agent publishes none of the node's GPUs while another driver
/// publishes one of them (here by UUID), says so on the Node, and publishes them again once it does not. Before, both
/// pools stayed allocatable.
async fn beside_another_dra_driver_publishing_its_gpus_the_agent_publishes_none(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let gpus = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--resync-period", "1s"];
    let agent = agent(&ctx, &node, &gpus).await?;
    agent.wait_ready().await?;
    let ours = wait_devices(&ctx, &node, 2).await?;
    let uuid = ours
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .find(|d| d.name == "gpu-1")
        .and_then(|d| d.attributes?.get("uuid")?.string.clone())
        .context("gpu-1 has no uuid attribute")?;
    let name = format!("{node}-nvidia");
    let other: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-1", "attributes": {"uuid": {"string": uuid}}}]}
    }))?;
    let slices = Api::<ResourceSlice>::all(ctx.client.clone());
    slices.create(&PostParams::default(), &other).await?;
    let refused = async {
        wait_devices(&ctx, &node, 0).await?;
        let warned =
            wait::until("an AnotherDriverPublishesGpus Warning on the Node", Duration::from_secs(10), || async {
                let events = objects::events_in(&ctx, "default", &node).await?;
                Ok(events
                    .into_iter()
                    .find(|(type_, reason, _)| type_ == "Warning" && reason == "AnotherDriverPublishesGpus"))
            })
            .await?;
        ensure!(warned.2.contains(&format!("gpu.nvidia.com/gpu-1 ({uuid})")), "{}", warned.2);
        ensure!(agent.metric("gpu_dra_node_agent_other_driver_refused", &[]).await? == 1.0, "gauge not set");
        anyhow::Ok(())
    }
    .await;
    slices.delete(&name, &DeleteParams::default()).await?;
    refused.with_context(|| agent.log_tail())?;
    wait_devices(&ctx, &node, 2).await.with_context(|| agent.log_tail())?;
    ensure!(agent.metric("gpu_dra_node_agent_other_driver_refused", &[]).await? == 0.0, "gauge not cleared");
    Ok(())
}

/// A GPU Operator node whose device plugin serves its GPUs (the Operator's labels, `nvidia.com/gpu` allocatable): the
/// agent runs there but publishes none of them, as both would hand out the same GPUs, and says so on the Node. A
/// plugin restarting (its resource zeroed a moment, as the kubelet does) does not let them out; once none has served
/// any for the grace period the GPUs are published again. With `--refuse-with-device-plugin=false` the agent only
/// warns and keeps them published.
async fn beside_a_device_plugin_serving_gpus_the_agent_publishes_none_until_it_is_gone(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    let tolerant = format!("{node}-b");
    // The Operator labels every GPU node so, whether its device plugin runs or not: the label decides nothing.
    let labels = ["nvidia.com/gpu.present=true", "nvidia.com/gpu.deploy.device-plugin=true"];
    ctx.cluster.add_node_labeled(&node, &labels)?;
    ctx.cluster.add_node_labeled(&tolerant, &labels)?;
    let gpus = [
        "--gpu-backend",
        "simulated",
        "--simulated-gpus",
        "2xH100-80GB",
        "--resync-period",
        "1s",
        "--device-plugin-grace-period",
        "6s",
        // No kubelet registers these agents: their readiness below must not hang on the registration's timeout.
        "--kubelet-registration-timeout",
        "10m",
    ];
    let both = agent(&ctx, &tolerant, &[&gpus[..], &["--refuse-with-device-plugin=false"]].concat()).await?;
    let mut agent = agent(&ctx, &node, &gpus).await?;
    agent.wait_ready().await?;
    both.wait_ready().await?;
    wait_devices(&ctx, &node, 2).await?;
    wait_devices(&ctx, &tolerant, 2).await?;
    ensure!(agent.metric("gpu_dra_node_agent_device_plugin_refused", &[]).await? == 0.0, "refused before a plugin");

    device_plugin_gpus(&ctx, &node, 2).await?;
    device_plugin_gpus(&ctx, &tolerant, 2).await?;
    wait_devices(&ctx, &node, 0).await.with_context(|| agent.log_tail())?;
    let warned = wait::until("a DevicePluginServesGpus Warning on the Node", Duration::from_secs(10), || async {
        let events = objects::events_in(&ctx, "default", &node).await?;
        Ok(events.into_iter().find(|(type_, reason, _)| type_ == "Warning" && reason == "DevicePluginServesGpus"))
    })
    .await?;
    for part in ["nvidia.com/gpu=2", "publishes none of this node's GPUs", "for 6s", "devicePlugin.enabled=false"] {
        ensure!(warned.2.contains(part), "the Event lacks {part:?}: {}", warned.2);
    }
    ensure!(agent.metric("gpu_dra_node_agent_device_plugin_refused", &[]).await? == 1.0, "metric not set");
    // Still Ready: the agent works as it should there, and a DaemonSet rollout must not stall on it.
    ensure!(agent.get("/readyz").await?.0 == 200, "not ready while refusing:\n{}", agent.log_tail());
    // A few resyncs later: still nothing published, and the other agent keeps its GPUs (only warning).
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(device_names(&slices_of(&ctx, &node).await?).is_empty(), "GPUs published beside the device plugin");
    ensure!(device_names(&slices_of(&ctx, &tolerant).await?).len() == 2, "refused with the refusal off");
    ensure!(
        objects::events_in(&ctx, "default", &tolerant)
            .await?
            .iter()
            .any(|(type_, reason, _)| type_ == "Warning" && reason == "DevicePluginServesGpus"),
        "no warning with the refusal off"
    );
    ensure!(both.metric("gpu_dra_node_agent_device_plugin_refused", &[]).await? == 0.0, "refused with it off");

    // The plugin restarting: zero for a few resyncs (well within the grace period, rounds slowed by a busy machine
    // included), then back. Nothing is published meanwhile.
    device_plugin_gpus(&ctx, &node, 0).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    device_plugin_gpus(&ctx, &node, 2).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(device_names(&slices_of(&ctx, &node).await?).is_empty(), "published while the plugin restarted");
    // Gone: published again once none has served GPUs for the grace period, not before.
    device_plugin_gpus(&ctx, &node, 0).await?;
    let gone = Instant::now();
    wait_devices(&ctx, &node, 2).await.with_context(|| agent.log_tail())?;
    ensure!(gone.elapsed() >= Duration::from_secs(5), "published {:?} after the plugin went", gone.elapsed());
    wait::until("a DevicePluginGone event on the Node", Duration::from_secs(10), || async {
        let events = objects::events_in(&ctx, "default", &node).await?;
        Ok(events.iter().any(|(type_, reason, _)| type_ == "Normal" && reason == "DevicePluginGone").then_some(()))
    })
    .await?;
    ensure!(agent.metric("gpu_dra_node_agent_device_plugin_refused", &[]).await? == 0.0, "metric not cleared");

    // The kubelet leaves a removed plugin's resource at zero for good: an agent restarted later holds nothing back.
    agent.process.terminate()?;
    agent.process = start_agent(&ctx, &node, &agent.dirs, &gpus)?;
    agent.wait_ready().await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(device_names(&slices_of(&ctx, &node).await?).len() == 2, "held back for a zero:\n{}", agent.log_tail());
    // A node rebooting: the plugin served a moment before the agent restarted and is not back yet. The restarted
    // agent holds the GPUs back for the rest of the grace period (from its record under the state directory).
    device_plugin_gpus(&ctx, &node, 2).await?;
    wait_devices(&ctx, &node, 0).await.with_context(|| agent.log_tail())?;
    device_plugin_gpus(&ctx, &node, 0).await?;
    agent.process.terminate()?;
    let restarted = Instant::now();
    agent.process = start_agent(&ctx, &node, &agent.dirs, &gpus)?;
    // Ready once it has published (here: held back), read at once: the rest of the grace period is a few seconds.
    agent.wait_ready().await?;
    ensure!(device_names(&slices_of(&ctx, &node).await?).is_empty(), "published at once after a restart");
    wait_devices(&ctx, &node, 2).await.with_context(|| agent.log_tail())?;
    // The plugin last served at most a round and a stop before the restart: the rest of the 6 s is 3 s or more.
    ensure!(restarted.elapsed() >= Duration::from_secs(3), "published {:?} after the restart", restarted.elapsed());
    Ok(())
}

/// A node pool labelled `gpu.gpu-dra.dev/gpu-sharing=by-memory` gets its GPUs shared by memory from one DaemonSet
/// whose default (`--gpu-sharing`) is whole; a label turned to a value that is no mode is reported, naming the label
/// and the valid values, and the node's GPUs go back to the default at the next resync; removing it keeps them so.
async fn a_node_label_chooses_gpu_sharing_for_its_node_pool(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    let key = format!("{DRIVER}/gpu-sharing");
    ctx.cluster.add_node_labeled(&node, &[&format!("{key}=by-memory")])?;
    let gpus = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--resync-period", "1s"];
    let agent = agent(&ctx, &node, &gpus).await?;
    agent.wait_ready().await?;
    wait_devices(&ctx, &node, 2).await?;
    // Before 1.36 the API server drops `allowMultipleAllocations` (consumable capacity off): the agent says so.
    let sharing_served = support::cluster::kubernetes_minor()? >= 36;
    if sharing_served {
        ensure!(shared(&ctx, &node).await? == Some(true), "the label's by-memory was not published");
    } else {
        let warning = "the API server dropped the devices' allowMultipleAllocations";
        wait::until("the warning about the dropped field", Duration::from_secs(10), || async {
            Ok(agent.log_text().contains(warning).then_some(()))
        })
        .await
        .with_context(|| agent.log_tail())?;
    }

    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(ctx.client.clone());
    let label = |value: serde_json::Value| serde_json::json!({"metadata": {"labels": {key.as_str(): value}}});
    nodes.patch(&node, &PatchParams::default(), &Patch::Merge(&label("half".into()))).await?;
    let warning = format!("Node label {key}=\"half\" is not a GPU sharing mode (whole, by-memory)");
    wait::until("the warning naming the label", Duration::from_secs(30), || async {
        Ok(agent.log_text().contains(&warning).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    if !sharing_served {
        // Whole either way before 1.36: nothing more to see.
        return Ok(());
    }
    wait::until("the GPUs back to whole after the bad label", Duration::from_secs(30), || async {
        Ok((shared(&ctx, &node).await? == Some(false)).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;

    nodes.patch(&node, &PatchParams::default(), &Patch::Merge(&label("by-memory".into()))).await?;
    wait::until("the GPUs shared again", Duration::from_secs(30), || async {
        Ok((shared(&ctx, &node).await? == Some(true)).then_some(()))
    })
    .await?;
    nodes.patch(&node, &PatchParams::default(), &Patch::Merge(&label(serde_json::Value::Null))).await?;
    wait::until("the GPUs whole without the label", Duration::from_secs(30), || async {
        Ok((shared(&ctx, &node).await? == Some(false)).then_some(()))
    })
    .await?;
    Ok(())
}

/// A restarted agent looks once at whether the API server kept what it published. Where it did (1.36 on) the pool
/// is left as it is; where a gate dropped a field (before 1.36, `allowMultipleAllocations` here) the pool is
/// published once more, so that restarting the agents after turning the gate on brings the field back; the
/// resyncs after that leave it alone either way.
async fn a_restarted_agent_republishes_only_a_pool_the_server_stored_short(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB", "--gpu-sharing", "by-memory"];
    let args = [&args[..], &["--resync-period", "1s"]].concat();
    let mut agent = start_agent(&ctx, &node, &dirs, &args)?;
    agent.wait_ready().await?;
    let before = wait_devices(&ctx, &node, 1).await?;
    let first = before[0].spec.pool.generation;
    agent.kill()?;
    let agent = start_agent(&ctx, &node, &dirs, &args)?;
    agent.wait_ready().await?;

    let dropped = support::cluster::kubernetes_minor()? < 36;
    let expected = if dropped { first + 1 } else { first };
    let generation = || async {
        let slices = slices_of(&ctx, &node).await?;
        anyhow::Ok(slices.iter().map(|s| s.spec.pool.generation).max())
    };
    wait::until(&format!("pool generation {expected} after the restart"), Duration::from_secs(10), || async {
        Ok((generation().await? == Some(expected)).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    // Three resyncs later: no further publication.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let now = generation().await?;
    ensure!(now == Some(expected), "generation {now:?} after the resyncs, {expected} expected:\n{}", agent.log_tail());
    let republished = agent.log_text().contains("publishing them again once");
    ensure!(republished == dropped, "republished once: {republished}, fields dropped: {dropped}");
    if !dropped {
        // The restarted agent checks its slices by writing its content again: the API server stores nothing.
        let after = slices_of(&ctx, &node).await?;
        ensure!(
            after.len() == 1 && after[0].resource_version() == before[0].resource_version(),
            "the unchanged slice was written again: {:?} -> {:?}",
            before[0].resource_version(),
            after.iter().map(|s| s.resource_version()).collect::<Vec<_>>()
        );
    }
    Ok(())
}

/// An agent pod deleted with `--force --grace-period=0` (or replaced under `updateStrategy: OnDelete`) still runs
/// while the DaemonSet's replacement starts on the node. The replacement must wait for it: one agent per node, or
/// they overwrite each other's checkpoint and health state. And the old one's exit must not take the replacement's
/// sockets with it, or the kubelet unregisters the live agent and wipes its slices.
async fn a_replacement_agent_waits_for_the_old_one_and_keeps_its_sockets(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let gpus = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"];
    let mut old = agent(&ctx, &node, &gpus).await?;
    old.process.wait_ready().await?;
    wait_devices(&ctx, &node, 2).await?;

    let replacement = start_agent(&ctx, &node, &old.dirs, &gpus)?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ready = replacement.get("/readyz").await.is_ok_and(|(code, _)| code == 200);
    ensure!(!ready, "the replacement went on beside the running agent:\n{}", replacement.log_tail());
    ensure!(
        replacement.log_text().contains("another node agent holds this state directory"),
        "the waiting replacement does not say why:\n{}",
        replacement.log_tail()
    );

    // The old agent exits (its container stopped at last): the replacement takes over and serves the sockets.
    let status = old.process.terminate()?;
    ensure!(status.success(), "the old agent exited with {status}:\n{}", old.process.log_tail());
    replacement.wait_ready().await?;
    let kubelet = Kubelet::register(&old.dirs).await.with_context(|| {
        format!(
            "the kubelet cannot reach the replacement:\n{}\nold agent:\n{}",
            replacement.log_tail(),
            old.process.log_tail()
        )
    })?;
    ensure!(kubelet.info.name == DRIVER, "{:?}", kubelet.info);
    wait_devices(&ctx, &node, 2).await?;
    Ok(())
}

/// An API server that fails a slice create (a brown-out during a control-plane upgrade, a webhook refusing one
/// slice) on a node whose pool needs two slices. The failed round's slices are removed, so the scheduler never sees
/// a newer generation with a slice missing (it would take it for the pool and allocate none of the node's GPUs), and
/// the next round waits for the back-off (1 s, then 2 s): before, the watch seeing the failed round's own slice
/// started the next round 0.2 s later, each try leaving another partial generation. The answers to the first two
/// creates are garbled by a proxy in front of the real API server (the server still makes those slices).
async fn a_failed_publish_leaves_no_partial_pool_and_backs_off(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let proxy = support::api_proxy::ApiProxy::start(ctx.cluster.client().await?).await?;
    proxy.garble_next(http::Method::POST, "/resourceslices", 2);
    let gpus = ["--gpu-backend", "simulated", "--simulated-gpus", "200xL4-24GB"];
    let log_name = format!("{}-agent", ctx.namespace);
    let _agent = support::node::start_agent_with(proxy.kubeconfig(), &log_name, &node, &dirs, &gpus)?;

    let waited = Duration::from_secs(30);
    wait::until("the first create to fail", waited, || async { Ok((proxy.garbled() > 0).then_some(())) }).await?;
    let failed_at = Instant::now();
    // The slice the failed create made goes before the next round: no partial generation stays behind.
    wait::until("the failed round's slice to be removed", Duration::from_secs(10), || async {
        Ok(slices_of(&ctx, &node).await?.is_empty().then_some(()))
    })
    .await?;
    ensure!(proxy.garbled() == 1, "the next round came before the failed round's slice was removed");
    wait::until("the second create to fail", waited, || async { Ok((proxy.garbled() > 1).then_some(())) }).await?;
    let again_after = failed_at.elapsed();
    ensure!(again_after >= Duration::from_millis(900), "the second round came {again_after:?} after the failure");
    let slices = wait_devices(&ctx, &node, 200).await?;
    let complete_after = failed_at.elapsed();
    ensure!(complete_after >= Duration::from_millis(2700), "published {complete_after:?} after the first failure");
    let generations: BTreeSet<i64> = slices.iter().map(|s| s.spec.pool.generation).collect();
    ensure!(
        slices.len() == 2 && generations.len() == 1 && slices.iter().all(|s| s.spec.pool.resource_slice_count == 2),
        "pool {:?}",
        slices.iter().map(|s| (s.name_any(), s.spec.pool.clone())).collect::<Vec<_>>()
    );
    Ok(())
}

/// An agent whose registry directory the kubelet does not watch (the chart's `kubeletDir` left at its default on a
/// node whose kubelet lives elsewhere: k0s, MicroK8s) publishes GPUs the kubelet cannot prepare: it says so with a
/// Warning on its Node once the kubelet has had time to find it, and its /readyz fails from then on (its DaemonSet
/// shows it not ready, where it would look healthy); one the kubelet registered says nothing and stays ready.
async fn an_agent_the_kubelet_never_registers_says_so_on_its_node(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    let registered = format!("{node}-r");
    for name in [&node, &registered] {
        ctx.cluster.add_node(name)?;
    }
    let extra = ["--gpu-backend", "simulated", "--simulated-gpus", "1xL4-24GB", "--kubelet-registration-timeout", "5s"];
    let lonely = agent(&ctx, &node, &extra).await?;
    let watched = agent(&ctx, &registered, &extra).await?;
    let _kubelet = Kubelet::register(&watched.dirs).await?;
    let warned = wait::until("a NotRegistered Warning on the Node", Duration::from_secs(20), || async {
        let events = objects::events_in(&ctx, "default", &node).await?;
        Ok(events.into_iter().find(|(type_, reason, _)| type_ == "Warning" && reason == "NotRegistered"))
    })
    .await
    .with_context(|| lonely.log_tail())?;
    let registry = watched.dirs.registry();
    let lonely_registry = lonely.dirs.registry().display().to_string();
    for part in ["has not registered the plugin 5s after", lonely_registry.as_str(), "nodeAgent.kubeletDir"] {
        ensure!(warned.2.contains(part), "the Event lacks {part:?}: {}", warned.2);
    }
    ensure!(lonely.metric("gpu_dra_kubelet_plugin_registered", &[]).await? == 0.0, "registered metric set");
    let (code, why) = lonely.get("/readyz").await?;
    ensure!(code == 503 && why.contains("has not registered the plugin 5s after"), "/readyz: {code} {why}");
    // The registered one: past its timeout, no warning.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let events = objects::events_in(&ctx, "default", &registered).await?;
    ensure!(
        !events.iter().any(|(_, reason, _)| reason == "NotRegistered"),
        "warned though registered ({}): {events:?}",
        registry.display()
    );
    ensure!(watched.metric("gpu_dra_kubelet_plugin_registered", &[]).await? == 1.0, "registered metric not set");
    let (code, why) = watched.get("/readyz").await?;
    ensure!(code == 200, "/readyz of the registered agent: {code} {why}");
    Ok(())
}

/// A machine back from a crash (or a kubelet restarted while the agent was down): the kubelet starts before the
/// agent and finds the registration socket the last agent left. The kubelet's plugin manager fails there 10 s a
/// try and backs off, per socket path, up to 2 min 2 s, removal and re-creation of the file notwithstanding. The
/// real plugin manager (in the kubelet harness) is let back off to 16 s before the agent starts: the agent, at the
/// other of its two socket names, is registered within seconds, and the stale socket is gone (at the old path it waited out
/// the back-off).
async fn a_kubelet_up_before_the_agent_beside_a_stale_socket_registers_it_at_once(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    std::fs::create_dir_all(dirs.registry())?;
    // What a killed agent leaves: a socket file nobody listens on, at the first name (every earlier version's, which
    // upgraded nodes have).
    let stale = dirs.registry().join(format!("{DRIVER}-reg.sock"));
    drop(std::os::unix::net::UnixListener::bind(&stale)?);
    let kubelet = KubeletHarness::start(&ctx, &node, &dirs)?;
    let backed_off = format!("\"{}\" failed. No retries permitted until", stale.display());
    wait::until("the kubelet backing off 16 s at the stale socket", Duration::from_secs(150), || async {
        let log = std::fs::read_to_string(&kubelet.log).unwrap_or_default();
        Ok(log.lines().any(|l| l.contains(&backed_off) && l.contains("(durationBeforeRetry 16s)")).then_some(()))
    })
    .await
    .with_context(|| kubelet.log_tail())?;

    let started = Instant::now();
    let agent = start_agent(&ctx, &node, &dirs, &["--gpu-backend", "simulated", "--simulated-gpus", "1xL4-24GB"])?;
    kubelet
        .wait_for("registered", "", Duration::from_secs(8))
        .await
        .with_context(|| format!("agent log:\n{}", agent.log_tail()))?;
    eprintln!("registered {:?} after the agent started", started.elapsed());
    ensure!(!stale.exists(), "the stale registration socket is still there");
    let current = dirs.registration_socket();
    ensure!(current.exists() && current != stale, "registration socket {}", current.display());
    Ok(())
}

/// An admission policy (or a verb taken from the agent's role) refuses updates and deletions of the node's slices:
/// a GPU's fault is then published as a new generation whose predecessor cannot be deleted. The agent goes no further
/// than that one extra generation: it deletes the old one first at each retry (as upstream's resourceslice controller
/// does), and creates nothing while it stays (before, each retry, 1 s doubling, added a whole generation). Once the
/// policy goes, the old generation is deleted.
async fn old_slices_a_policy_keeps_hold_back_new_generations(ctx: TestContext) -> anyhow::Result<()> {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let agent = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"]).await?;
    agent.wait_ready().await?;
    let first = wait_devices(&ctx, &node, 2).await?;
    ensure!(first.len() == 1, "{} slices", first.len());

    let name = format!("keep-slices-of-{node}");
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["*"],
                "operations": ["UPDATE", "DELETE"], "resources": ["resourceslices"]}]},
            "validations": [{"expression": format!("oldObject.spec.nodeName != '{node}'"),
                             "reason": "Forbidden", "message": "this node's slices are kept (test policy)"}]
        }
    }))?;
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]}
    }))?;
    let policies = Api::<ValidatingAdmissionPolicy>::all(ctx.client.clone());
    let bindings = Api::<ValidatingAdmissionPolicyBinding>::all(ctx.client.clone());
    policies.create(&PostParams::default(), &policy).await?;
    bindings.create(&PostParams::default(), &binding).await?;
    let result = async {
        let slices = Api::<ResourceSlice>::all(ctx.client.clone());
        let dry_run = DeleteParams { dry_run: true, ..Default::default() };
        wait::until("the policy in force", Duration::from_secs(30), || async {
            Ok(slices.delete(&first[0].name_any(), &dry_run).await.is_err().then_some(()))
        })
        .await?;

        support::node::inject_fault(&agent.dirs.state(), "gpu-1 xid 79")?;
        let taints_served = support::cluster::kubernetes_minor()? >= 36;
        if !taints_served {
            // Before 1.36 a fault changes no slice: nothing more to see.
            return Ok(());
        }
        wait::until("a new generation beside the kept one", Duration::from_secs(20), || async {
            Ok((slices_of(&ctx, &node).await?.len() == 2).then_some(()))
        })
        .await
        .with_context(|| agent.log_tail())?;
        // Retries at 1, 2, 4, 8 s: each would have added a generation.
        tokio::time::sleep(Duration::from_secs(16)).await;
        let kept = slices_of(&ctx, &node).await?;
        ensure!(kept.len() == 2, "{} slices of the node with deletions refused:\n{}", kept.len(), agent.log_tail());
        ensure!(agent.log_text().contains("this node's slices are kept"), "the log does not say what refused");
        Ok(())
    }
    .await;
    let _ = bindings.delete(&name, &DeleteParams::default()).await;
    let _ = policies.delete(&name, &DeleteParams::default()).await;
    result?;
    if support::cluster::kubernetes_minor()? >= 36 {
        let one = wait::until("the kept generation deleted once the policy went", Duration::from_secs(60), || async {
            Ok((slices_of(&ctx, &node).await?.len() == 1).then_some(()))
        })
        .await;
        one.with_context(|| agent.log_tail())?;
    }
    Ok(())
}

/// An administrator removes a faulted GPU's taint from the node's slice with `kubectl edit` (or a tool rewrites a
/// device's attributes): the slice keeps its content-hash annotation, so a hash alone says nothing changed, and the
/// scheduler would hand out the failing GPU until the next fault transition. The agent puts its devices back in
/// place (the same generation), as upstream's resourceslice controller does for a slice that differs from what it
/// wants; the taint goes only when the fault does.
async fn a_slice_someone_edits_gets_the_agents_devices_back(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let agent = agent(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"]).await?;
    agent.wait_ready().await?;
    wait_devices(&ctx, &node, 2).await?;
    let taints_served = support::cluster::kubernetes_minor()? >= 36;
    let tainted = |slices: &[ResourceSlice]| {
        let devices = slices.iter().flat_map(|s| s.spec.devices.clone().unwrap_or_default());
        devices.filter(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty())).count()
    };
    if taints_served {
        support::node::inject_fault(&agent.dirs.state(), "gpu-1 xid 79")?;
        wait::until("the faulted GPU tainted", Duration::from_secs(20), || async {
            Ok((tainted(&slices_of(&ctx, &node).await?) == 1).then_some(()))
        })
        .await
        .with_context(|| agent.log_tail())?;
    }
    let published = slices_of(&ctx, &node).await?;
    ensure!(published.len() == 1, "{} slices", published.len());
    let product = |slice: &ResourceSlice| -> Vec<Option<String>> {
        let devices = slice.spec.devices.clone().unwrap_or_default();
        devices.iter().map(|d| d.attributes.as_ref()?.get("productName")?.string.clone()).collect()
    };
    let mut edited = published[0].clone();
    for device in edited.spec.devices.iter_mut().flatten() {
        device.taints = None;
        if let Some(name) = device.attributes.as_mut().and_then(|a| a.get_mut("productName")) {
            name.string = Some("edited by hand".into());
        }
    }
    let api = Api::<ResourceSlice>::all(ctx.client.clone());
    let edited = api.replace(&edited.name_any(), &PostParams::default(), &edited).await?;
    ensure!(tainted(std::slice::from_ref(&edited)) == 0 && product(&edited)[0].as_deref() == Some("edited by hand"));

    let restored = wait::until("the agent's devices back in the slice", Duration::from_secs(20), || async {
        let slices = slices_of(&ctx, &node).await?;
        Ok((slices.len() == 1 && product(&slices[0]) == product(&published[0])).then_some(slices))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(tainted(&restored) == usize::from(taints_served), "taints after the restore: {}", tainted(&restored));
    ensure!(
        restored[0].uid() == published[0].uid()
            && restored[0].spec.pool.generation == published[0].spec.pool.generation,
        "restored as a new slice or generation, not in place"
    );
    ensure!(agent.log_text().contains("changed by someone else"), "the log does not say so:\n{}", agent.log_tail());
    Ok(())
}

/// `--mig-layout dynamic` on a control plane with DRAPartitionableDevices on: by default from 1.36, turned on here in
/// a cluster of the test's own on older versions, as an operator trying the alpha does. Kubernetes 1.34's alpha
/// validation wants each slice's counter sets in the slices that consume them and at most 32 counters a slice, so it
/// refuses the dynamic layout's slices (422) rather than dropping their counters: the agent publishes the MIG devices
/// that exist (static) and says why. Before, the dry run's refusal failed every round, and the node's pool, its GPU
/// outside MIG too, was never published. From 1.35 the partitions are published.
async fn dynamic_mig_publishes_a_pool_wherever_partitionable_devices_are_on(ctx: TestContext) -> anyhow::Result<()> {
    let minor = support::cluster::kubernetes_minor()?;
    let own = if minor < 36 {
        let gates = [("GPU_DRA_E2E_FEATURE_GATES", "DRAPartitionableDevices=true")];
        let binary = format!("node_agent-partitionable-{minor}");
        Some(tokio::task::spawn_blocking(move || support::cluster::Cluster::start_own(&binary, false, &gates)).await??)
    } else {
        None
    };
    let cluster = own.as_ref().unwrap_or(&ctx.cluster);
    let published = dynamic_mig_pool(&ctx, cluster, minor).await;
    if let Some(own) = own {
        tokio::task::spawn_blocking(move || own.stop()).await??;
    }
    published
}

async fn dynamic_mig_pool(ctx: &TestContext, cluster: &support::cluster::Cluster, minor: u32) -> anyhow::Result<()> {
    let node = node_name(ctx);
    cluster.add_node(&node)?;
    let client = cluster.client().await?;
    let dirs = NodeDirs::new()?;
    // gpu-0 in MIG mode with no MIG device yet, gpu-1 an L4 outside MIG.
    let gpus = "1xH100-80GB/mig=,1xL4-24GB";
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", gpus, "--mig-layout", "dynamic"];
    let agent = support::node::start_agent_with(
        &cluster.kubeconfig(),
        &format!("{}-agent", ctx.namespace),
        &node,
        &dirs,
        &args,
    )?;
    let selector = format!("spec.nodeName={node},spec.driver={DRIVER}");
    let slices = Api::<ResourceSlice>::all(client);
    let names = wait::until("the node's pool to list gpu-1", Duration::from_secs(30), || async {
        let names = device_names(&slices.list(&ListParams::default().fields(&selector)).await?.items);
        Ok(names.iter().any(|n| n == "gpu-1").then_some(names))
    })
    .await
    .with_context(|| agent.log_tail())?;
    let partitions = names.iter().filter(|n| n.starts_with("gpu-0-mig-")).count();
    let refused = agent.log_text().contains("refuses the dynamic MIG layout");
    if minor == 34 {
        ensure!(refused && partitions == 0, "1.34 with the gate on: {names:?}\n{}", agent.log_tail());
    } else {
        ensure!(!refused && partitions == 25, "partitions of gpu-0 published: {names:?}\n{}", agent.log_tail());
    }
    eprintln!("Kubernetes 1.{minor}, DRAPartitionableDevices on: published {names:?}");
    Ok(())
}
