//! The node agent's kubelet plugin against the real API server and scheduler, driven by a kubelet stand-in that
//! speaks the real protocol over the unix sockets: registration, prepare of what the scheduler allocated (CDI specs
//! checked against the official schema and loaded with the `container-device-interface` crate), every refusal,
//! idempotence, and the faults: kill -9 during concurrent prepares, a corrupt checkpoint (with the API server
//! unreachable too), lost specs (also while the agent runs), a reboot, an interrupted prepare and writers killed mid-write, a disk that hangs a
//! prepare while the liveness probe asks, and the calls queued behind it done together, full disks.

#[path = "kubelet_plugin/hung_discovery.rs"]
mod hung_discovery;
#[path = "kubelet_plugin/mps.rs"]
mod mps;
#[path = "kubelet_plugin/node_disks.rs"]
mod node_disks;
#[path = "kubelet_plugin/shares.rs"]
mod shares;
#[path = "kubelet_plugin/stale_claims.rs"]
mod stale_claims;
mod support;
#[path = "kubelet_plugin/time_slices.rs"]
mod time_slices;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use gpu_dra::kubelet_plugin::checkpoint::{Checkpoint, CheckpointStore, ClaimEntry, LoadOutcome, PrepareState};
use gpu_dra::kubelet_plugin::proto::dra_v1 as v1;
use hung_discovery::{
    a_discovery_that_hangs_at_start_still_lets_prepared_claims_be_unprepared,
    an_agent_whose_discovery_hangs_stops_on_sigterm,
};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use mps::{
    a_claim_asking_mps_gets_its_own_daemon_while_prepared,
    a_control_pipe_replaced_by_a_link_sends_no_quit_to_another_claims_daemon,
    a_hung_mps_daemon_holds_back_no_other_claim, an_admin_access_claim_beside_an_mps_claim_changes_nothing,
    an_mps_daemon_outlives_the_recovery_once_the_gpus_are_back,
    an_mps_daemon_that_cannot_start_leaves_the_gpu_at_default, mps_settings_naming_no_device_are_refused,
    start_up_removes_only_the_mps_directories_the_agent_made,
};
use node_disks::{
    a_full_disk_fails_the_prepare_with_the_reason_and_loses_nothing, a_reboot_onto_a_full_state_disk_still_serves,
    a_spec_directory_deleted_on_the_host_fails_the_liveness_check,
    a_state_directory_deleted_on_the_host_fails_the_liveness_check,
};
use serde_json::{Value, json};
use shares::{
    a_claim_allocated_again_as_another_share_is_not_answered_with_the_old_one,
    a_share_beside_a_force_deleted_pods_share_waits_for_its_memory,
};
use stale_claims::{
    a_claim_deleted_while_its_pod_runs_is_kept_until_the_pod_is_done,
    a_claim_the_kubelet_forgot_is_unprepared_once_the_api_has_it_no_more,
    a_stale_claim_of_many_devices_is_reported_within_the_note_limit, with_warn_a_forgotten_claim_is_reported_and_kept,
};
use support::node::{DRIVER, Kubelet, NodeDirs, start_agent, start_agent_with};
use support::process::Component;
use support::{TestContext, objects, wait};
use time_slices::{
    a_time_slice_is_set_while_its_claim_is_prepared_and_set_back_after,
    claims_sharing_a_gpu_must_ask_the_same_time_slice,
};

fn main() {
    support::run(
        "kubelet_plugin",
        &[
            test!(registers_and_prepares_what_the_scheduler_allocated),
            test!(refuses_what_it_must_not_prepare_and_answers_every_claim),
            test!(kill_during_fifty_concurrent_prepares_leaves_a_consistent_state),
            test!(a_corrupt_checkpoint_is_rebuilt_from_the_specs_and_kept_aside),
            test!(a_corrupt_checkpoint_with_the_api_unreachable_deletes_no_spec),
            test!(a_lost_checkpoint_keeps_the_specs_of_prepared_claims),
            test!(health_answers_while_a_prepare_hangs_on_the_disk),
            test!(a_full_disk_fails_the_prepare_with_the_reason_and_loses_nothing),
            test!(a_reboot_onto_a_full_state_disk_still_serves),
            test!(a_spec_written_before_the_unified_memory_nodes_gets_them_once_they_appear),
            test!(a_spec_directory_deleted_on_the_host_fails_the_liveness_check),
            test!(a_state_directory_deleted_on_the_host_fails_the_liveness_check),
            test!(a_prepare_the_kubelet_gave_up_on_is_not_done_after_its_unprepare),
            test!(a_prepare_the_kubelet_stops_waiting_for_is_counted_and_logged),
            test!(pods_started_together_share_the_checkpoint_saves),
            test!(restart_rewrites_lost_specs_and_a_reboot_drops_old_entries),
            test!(a_rollback_and_upgrade_keep_the_metadata_device_the_kubelet_was_given),
            test!(a_spec_lost_while_the_agent_runs_is_written_again),
            test!(an_interrupted_prepare_and_stray_specs_are_cleaned_up_on_start),
            test!(an_interrupted_dynamic_mig_prepare_destroys_only_the_mig_device_it_made),
            test!(a_prepare_killed_after_making_a_mig_device_leaves_it_to_be_destroyed),
            test!(a_claim_needing_nothing_slow_is_not_held_back_by_mig_work_in_its_batch),
            test!(a_renamed_driver_does_not_take_over_claims_prepared_for_the_old_name),
            test!(a_time_slice_is_set_while_its_claim_is_prepared_and_set_back_after),
            test!(claims_sharing_a_gpu_must_ask_the_same_time_slice),
            test!(a_claim_asking_mps_gets_its_own_daemon_while_prepared),
            test!(a_control_pipe_replaced_by_a_link_sends_no_quit_to_another_claims_daemon),
            test!(mps_settings_naming_no_device_are_refused),
            test!(start_up_removes_only_the_mps_directories_the_agent_made),
            test!(an_mps_daemon_that_cannot_start_leaves_the_gpu_at_default),
            test!(a_hung_mps_daemon_holds_back_no_other_claim),
            test!(a_share_beside_a_force_deleted_pods_share_waits_for_its_memory),
            test!(an_mps_daemon_outlives_the_recovery_once_the_gpus_are_back),
            test!(an_admin_access_claim_beside_an_mps_claim_changes_nothing),
            test!(a_claim_the_kubelet_forgot_is_unprepared_once_the_api_has_it_no_more),
            test!(with_warn_a_forgotten_claim_is_reported_and_kept),
            test!(a_stale_claim_of_many_devices_is_reported_within_the_note_limit),
            test!(a_claim_deleted_while_its_pod_runs_is_kept_until_the_pod_is_done),
            test!(a_discovery_that_hangs_at_start_still_lets_prepared_claims_be_unprepared),
            test!(a_claim_allocated_again_as_another_share_is_not_answered_with_the_old_one),
            test!(an_agent_whose_discovery_hangs_stops_on_sigterm),
        ],
    )
}

fn node_name(ctx: &TestContext) -> String {
    format!("gpu-node-{}", &ctx.namespace[ctx.namespace.len() - 6..])
}

/// Starts an agent with `gpus` simulated GPUs and waits until it is ready (plugin serving, slices published).
async fn ready_agent(ctx: &TestContext, node: &str, dirs: &NodeDirs, gpus: &str) -> anyhow::Result<Component> {
    ready_agent_with(ctx, node, dirs, gpus, &[]).await
}

/// [`ready_agent`] with `extra` flags.
async fn ready_agent_with(
    ctx: &TestContext,
    node: &str,
    dirs: &NodeDirs,
    gpus: &str,
    extra: &[&str],
) -> anyhow::Result<Component> {
    let args = [&["--gpu-backend", "simulated", "--simulated-gpus", gpus], extra].concat();
    let agent = start_agent(ctx, node, dirs, &args)?;
    agent.wait_ready().await?;
    Ok(agent)
}

/// Creates claim `name` asking for `devices.len()` GPUs and writes the allocation the scheduler would: `devices`
/// of `pool`, the opaque `config`, reserved for a pod. Returns the claim's UID.
async fn allocated_claim(
    ctx: &TestContext,
    name: &str,
    pool: &str,
    devices: &[&str],
    config: Value,
) -> anyhow::Result<String> {
    let results: Vec<Value> = devices.iter().map(|device| gpu_result(pool, device)).collect();
    allocated_claim_with(ctx, name, results, config).await
}

/// An allocation result of request `gpus`: the whole device `device` of pool `pool`.
fn gpu_result(pool: &str, device: &str) -> Value {
    json!({"request": "gpus", "driver": DRIVER, "pool": pool, "device": device})
}

/// Creates claim `name` asking for as many GPUs as `results` lists and writes `results` (request `gpus`) as its
/// allocation, with the opaque `config`, reserved for a pod. Returns the claim's UID.
async fn allocated_claim_with(
    ctx: &TestContext,
    name: &str,
    results: Vec<Value>,
    config: Value,
) -> anyhow::Result<String> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu", "allocationMode": "ExactCount", "count": results.len().max(1)}}]}}
    }))?;
    let created = objects::claims(ctx).create(&PostParams::default(), &claim).await?;
    let status = json!({"status": {
        "allocation": {"devices": {"results": results, "config": config}},
        "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("{}-pod", created.metadata.uid.clone().unwrap_or_default())}]
    }});
    objects::claims(ctx).patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await?;
    created.metadata.uid.context("created claim has no UID")
}

/// Deallocates `claim` and allocates it `results` again, reserved for the pod `pod` (`uid`), without the kubelet
/// unpreparing it between: what the kubelet sees of a claim whose pods ended while it was down or had forgotten it.
async fn reallocate(
    ctx: &TestContext,
    claim: &str,
    results: Vec<Value>,
    (pod, uid): (&str, &str),
) -> anyhow::Result<()> {
    let none = json!({"status": {"allocation": null, "reservedFor": null}});
    objects::claims(ctx).patch_status(claim, &PatchParams::default(), &Patch::Merge(&none)).await?;
    let status = json!({"status": {"allocation": {"devices": {"results": results}},
        "reservedFor": [{"resource": "pods", "name": pod, "uid": uid}]}});
    objects::claims(ctx).patch_status(claim, &PatchParams::default(), &Patch::Merge(&status)).await?;
    Ok(())
}

/// The official CDI schema (../shared/cdi-schema, or GPU_DRA_CDI_SCHEMA_DIR).
fn cdi_schema_dir() -> PathBuf {
    std::env::var_os("GPU_DRA_CDI_SCHEMA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/cdi-schema")))
}

/// Validates a written spec against the official schema and loads it with the CDI crate; returns its device names.
fn check_cdi_spec(path: &std::path::Path) -> anyhow::Result<Vec<String>> {
    use container_device_interface::schema::{compile_cdi_schema, validate_cdi};
    let dir = cdi_schema_dir();
    let schema = std::fs::read(dir.join("schema.json"))
        .with_context(|| format!("read the CDI schema in {} (set GPU_DRA_CDI_SCHEMA_DIR)", dir.display()))?;
    let defs = std::fs::read(dir.join("defs.json"))?;
    let validator = compile_cdi_schema(&schema, &defs)?;
    let document = std::fs::read(path)?;
    validate_cdi(&validator, &document).with_context(|| format!("{} against the official schema", path.display()))?;
    let mut spec = container_device_interface::spec::read_spec(&path.to_path_buf(), 0)
        .map_err(|e| anyhow::anyhow!("load {} with the CDI crate: {e:#}", path.display()))?;
    let devices = spec.validate().map_err(|e| anyhow::anyhow!("CDI crate validation: {e:#}"))?;
    Ok(devices.into_keys().collect())
}

/// Checks a prepared claim's device metadata (KEP-5304) as a container would get it: the claim's spec mounts the
/// file of `request` read-only at upstream's path, and upstream's reader (the harness's `read-device-metadata`, from
/// 1.37 on; older versions lack it) decodes and validates it, naming the claim (`uid`, name, pod claim name) and
/// its `devices` of this node with their ResourceSlice attributes.
async fn check_device_metadata(
    ctx: &TestContext,
    dirs: &NodeDirs,
    spec: &std::path::Path,
    (uid, name, pod_claim): (&str, &str, Option<&str>),
    request: &str,
    devices: &[String],
) -> anyhow::Result<()> {
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(spec)?)?;
    let device = spec["devices"].as_array().into_iter().flatten().find(|d| d["name"] == format!("{uid}_{request}"));
    let mounts = device.map(|d| d["containerEdits"]["mounts"].clone()).context("no metadata device in the spec")?;
    let host = dirs.state().join("device-metadata").join(uid).join(request).join("metadata.json");
    let container = match pod_claim {
        Some(pod_claim) => format!("resourceclaimtemplates/{pod_claim}"),
        None => format!("resourceclaims/{name}"),
    };
    let container =
        format!("/var/run/kubernetes.io/dra-device-attributes/{container}/{request}/{DRIVER}-metadata.json");
    let want = serde_json::json!([{
        "hostPath": host.to_str(), "containerPath": container, "options": ["ro", "nosuid", "nodev", "bind"],
    }]);
    ensure!(mounts == want, "metadata mount {mounts} , expected {want}");
    let text = std::fs::read_to_string(&host)?;
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap_or_default())?;
    let second: serde_json::Value = serde_json::from_str(text.lines().nth(1).unwrap_or_default())?;
    ensure!(
        first["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
            && second["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
            && first["requests"] == second["requests"],
        "metadata file {text}"
    );
    let object = if support::cluster::kubernetes_minor()? >= 37 {
        let output = std::process::Command::new(support::harness::binary()?)
            .args(["read-device-metadata"])
            .arg(&host)
            .output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(output.status.success(), "upstream's reader refused the file: {stderr}");
        let read: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        ensure!(read["apiVersion"] == "metadata.resource.k8s.io/v1beta1", "read {read}");
        read["object"].clone()
    } else {
        first
    };
    let meta = &object["metadata"];
    ensure!(
        meta["uid"] == uid && meta["name"] == name && meta["namespace"] == ctx.namespace && meta["generation"] == 1,
        "metadata {meta}"
    );
    ensure!(object["podClaimName"].as_str() == pod_claim, "podClaimName {}", object["podClaimName"]);
    let listed = &object["requests"][0]["devices"];
    let mut names: Vec<String> =
        listed.as_array().into_iter().flatten().filter_map(|d| d["name"].as_str().map(str::to_string)).collect();
    names.sort();
    ensure!(object["requests"][0]["name"] == request && names == devices, "requests {}", object["requests"]);
    for device in listed.as_array().into_iter().flatten() {
        ensure!(device["driver"] == DRIVER, "{device}");
        ensure!(device["attributes"]["uuid"]["string"].as_str().is_some_and(|u| u.starts_with("GPU-")), "{device}");
        ensure!(device["attributes"]["resource.kubernetes.io/pciBusID"]["string"].is_string(), "{device}");
    }
    Ok(())
}

fn checkpoint(dirs: &NodeDirs, boot: &str) -> anyhow::Result<Checkpoint> {
    let loaded = CheckpointStore::new(&dirs.state()).load(boot)?;
    ensure!(matches!(loaded.outcome, LoadOutcome::Loaded | LoadOutcome::Fresh), "checkpoint: {:?}", loaded.outcome);
    Ok(loaded.checkpoint)
}

async fn registers_and_prepares_what_the_scheduler_allocated(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "4xH100-80GB").await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    ensure!(
        kubelet.info.supported_versions
            == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"],
        "{:?}",
        kubelet.info
    );
    ensure!(std::path::Path::new(&kubelet.info.endpoint) == dirs.dra_socket(), "endpoint {:?}", kubelet.info.endpoint);

    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": ctx.namespace},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}]}
    }))?;
    Api::<DeviceClass>::all(ctx.client.clone()).create(&PostParams::default(), &class).await?;
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "pair"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": ctx.namespace, "count": 2}}]}}
    }))?;
    objects::claims(&ctx).create(&PostParams::default(), &claim).await?;
    objects::create_pod_on(&ctx, "trainer", &node, json!([{"name": "gpus", "resourceClaimName": "pair"}])).await?;
    let claims = objects::claims(&ctx);
    let (uid, mut allocated) =
        wait::until("the scheduler to allocate and reserve", Duration::from_secs(30), || async {
            let c = claims.get("pair").await?;
            let status = c.status.unwrap_or_default();
            let results = status.allocation.and_then(|a| a.devices).and_then(|d| d.results).unwrap_or_default();
            let reserved = status.reserved_for.is_some_and(|r| !r.is_empty());
            Ok((reserved && results.len() == 2).then(|| {
                (c.metadata.uid.unwrap_or_default(), results.into_iter().map(|r| r.device).collect::<Vec<_>>())
            }))
        })
        .await?;
    allocated.sort();

    let answer = kubelet.prepare(&[(&ctx.namespace, "pair", &uid)]).await?;
    let prepared = answer.get(&uid).context("no answer for the claim")?;
    ensure!(prepared.error.is_empty(), "prepare failed: {}", prepared.error);
    let mut devices: Vec<_> = prepared.devices.iter().map(|d| d.device_name.clone()).collect();
    devices.sort();
    ensure!(devices == allocated, "prepared {devices:?}, allocated {allocated:?}");
    // Each device its own CDI id; the request's first device also the id that mounts its device metadata file.
    let metadata_id = format!("{DRIVER}/gpu={uid}_gpus");
    for (i, device) in prepared.devices.iter().enumerate() {
        let minor = device.device_name.trim_start_matches("gpu-");
        let mut ids = vec![format!("{DRIVER}/gpu={uid}-gpu-{minor}")];
        if i == 0 {
            ids.push(metadata_id.clone());
        }
        ensure!(
            device.request_names == ["gpus"] && device.pool_name == node && device.cdi_device_ids == ids,
            "{device:?}"
        );
    }
    let spec = dirs.cdi_spec(&uid);
    let mut names = check_cdi_spec(&spec)?;
    names.sort();
    let mut expected: Vec<String> = allocated.iter().map(|d| format!("{uid}-{d}")).collect();
    expected.push(format!("{uid}_gpus"));
    ensure!(names == expected, "CDI devices {names:?}, expected {expected:?}");
    check_device_metadata(&ctx, &dirs, &spec, (&uid, "pair", None), "gpus", &allocated).await?;
    let text = std::fs::read_to_string(&spec)?;
    for minor in 0..4 {
        let node_path = format!("\"/dev/nvidia{minor}\"");
        ensure!(text.contains(&node_path) == allocated.contains(&format!("gpu-{minor}")), "{node_path} in {text}");
    }
    ensure!(text.contains("/dev/nvidiactl") && text.contains("NVIDIA_VISIBLE_DEVICES=void"), "{text}");

    // Idempotent, in both protocol versions.
    let again = kubelet.prepare(&[(&ctx.namespace, "pair", &uid)]).await?;
    ensure!(again.get(&uid) == Some(prepared), "second prepare differs: {again:?}");
    let beta = gpu_dra::kubelet_plugin::proto::dra_v1beta1::NodePrepareResourcesRequest {
        claims: vec![gpu_dra::kubelet_plugin::proto::dra_v1beta1::Claim {
            namespace: ctx.namespace.clone(),
            uid: uid.clone(),
            name: "pair".into(),
        }],
    };
    let beta = kubelet.v1beta1.node_prepare_resources(beta).await?.into_inner();
    let beta_ids: Vec<_> = beta.claims.get(&uid).into_iter().flat_map(|c| c.devices.iter()).collect();
    let beta_count: Vec<usize> = beta_ids.iter().map(|d| d.cdi_device_ids.len()).collect();
    ensure!(beta_count == [2, 1], "v1beta1: {beta:?}");
    ensure!(agent.metric("gpu_dra_kubelet_plugin_prepared_devices", &[]).await? == 2.0, "prepared devices gauge");
    ensure!(agent.get("/healthz").await?.0 == 200, "healthz");

    let unprepared = kubelet.unprepare(&[(&ctx.namespace, "pair", &uid)]).await?;
    ensure!(unprepared.get(&uid).is_some_and(String::is_empty), "unprepare: {unprepared:?}");
    ensure!(!spec.exists(), "the spec outlived unprepare");
    let metadata_dir = dirs.state().join("device-metadata").join(&uid);
    ensure!(!metadata_dir.exists(), "the device metadata outlived unprepare");
    let again = kubelet.unprepare(&[(&ctx.namespace, "pair", &uid), (&ctx.namespace, "never", "no-such-uid")]).await?;
    ensure!(again.values().all(String::is_empty), "repeated/unknown unprepare: {again:?}");
    ensure!(agent.metric("gpu_dra_kubelet_plugin_prepared_devices", &[]).await? == 0.0, "gauge after unprepare");

    let status = agent.terminate()?;
    ensure!(status.success(), "agent exited with {status}");
    ensure!(!dirs.registration_socket().exists() && !dirs.dra_socket().exists(), "sockets left after SIGTERM");
    Ok(())
}

async fn refuses_what_it_must_not_prepare_and_answers_every_claim(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let _agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let ns = ctx.namespace.as_str();
    let bad_config = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": format!("{DRIVER}/v1alpha1"), "kind": "GpuConfig", "sharing": {"strategy": "Nope"}}}}]);
    let good = allocated_claim(&ctx, "good", &node, &["gpu-0"], json!([])).await?;
    let other_pool = allocated_claim(&ctx, "other-pool", "some-other-node", &["gpu-1"], json!([])).await?;
    let unknown = allocated_claim(&ctx, "unknown-device", &node, &["gpu-9"], json!([])).await?;
    let config = allocated_claim(&ctx, "bad-config", &node, &["gpu-1"], bad_config).await?;
    let unallocated = objects::create_claim(&ctx, "unallocated").await?.metadata.uid.unwrap_or_default();
    let answers = kubelet
        .prepare(&[
            (ns, "good", &good),
            (ns, "good", "0b5e1c4e-0000-4000-8000-000000000000"),
            (ns, "other-pool", &other_pool),
            (ns, "unknown-device", &unknown),
            (ns, "bad-config", &config),
            (ns, "unallocated", &unallocated),
            (ns, "missing", "11111111-0000-4000-8000-000000000000"),
        ])
        .await?;
    let error = |uid: &str| answers.get(uid).map(|a| a.error.clone()).unwrap_or_else(|| "NO ANSWER".into());
    ensure!(error(&good).is_empty() && dirs.cdi_spec(&good).exists(), "good claim: {:?}", error(&good));
    let expected = [
        ("0b5e1c4e-0000-4000-8000-000000000000", "deleted and re-created"),
        (other_pool.as_str(), "this node's pool is"),
        (unknown.as_str(), "\"gpu-9\", which this node does not have"),
        (config.as_str(), "sharing.strategy: unknown variant `Nope`"),
        (unallocated.as_str(), "is not allocated"),
        ("11111111-0000-4000-8000-000000000000", "not found"),
    ];
    for (uid, reason) in expected {
        ensure!(error(uid).contains(reason), "claim {uid}: {:?} lacks {reason:?}", error(uid));
    }
    ensure!(dirs.cdi_specs()?.len() == 1, "specs written for refused claims: {:?}", dirs.cdi_specs()?);

    // gpu-0 is held by "good": a second claim allocated the same device (stale allocation) is refused until the
    // first is unprepared.
    let twin = allocated_claim(&ctx, "twin", &node, &["gpu-0"], json!([])).await?;
    let refused = kubelet.prepare(&[(ns, "twin", &twin)]).await?;
    let reason = refused.get(&twin).map(|a| a.error.clone()).unwrap_or_default();
    ensure!(reason.contains(&format!("already prepared for claim {ns}/good")), "twin: {reason:?}");
    kubelet.unprepare(&[(ns, "good", &good)]).await?;
    let accepted = kubelet.prepare(&[(ns, "twin", &twin)]).await?;
    ensure!(accepted.get(&twin).is_some_and(|a| a.error.is_empty()), "twin after unprepare: {accepted:?}");

    // The same claim prepared, then unprepared, by eight calls at once (kubelet retries overlap): one outcome.
    let busy = allocated_claim(&ctx, "busy", &node, &["gpu-1"], json!([])).await?;
    let request = || gpu_dra::kubelet_plugin::proto::dra_v1::NodePrepareResourcesRequest {
        claims: vec![gpu_dra::kubelet_plugin::proto::dra_v1::Claim {
            namespace: ns.to_string(),
            name: "busy".into(),
            uid: busy.clone(),
        }],
    };
    let calls = (0..8).map(|_| {
        let mut client = kubelet.v1.clone();
        let request = request();
        async move { client.node_prepare_resources(request).await.map(|r| r.into_inner()) }
    });
    let answers: Vec<_> = futures::future::join_all(calls).await.into_iter().collect::<Result<_, _>>()?;
    ensure!(answers.windows(2).all(|w| w[0] == w[1]), "concurrent prepares disagree: {answers:?}");
    ensure!(answers[0].claims.get(&busy).is_some_and(|a| a.error.is_empty() && a.devices.len() == 1), "{answers:?}");
    let unprepares = (0..8).map(|_| {
        let mut client = kubelet.v1.clone();
        let claims = request().claims;
        async move {
            let request = gpu_dra::kubelet_plugin::proto::dra_v1::NodeUnprepareResourcesRequest { claims };
            client.node_unprepare_resources(request).await.map(|r| r.into_inner())
        }
    });
    for answer in futures::future::join_all(unprepares).await {
        ensure!(answer?.claims.get(&busy).is_some_and(|a| a.error.is_empty()), "concurrent unprepare failed");
    }
    ensure!(!dirs.cdi_spec(&busy).exists(), "spec left after concurrent unprepares");
    Ok(())
}

/// A kubelet starting many pods at once, and the agent killed mid-way (OOM kill, node drain's `kill -9`): prepares
/// done, a batch in flight on a disk that stopped answering, nine calls queued behind it. Which calls are where at
/// the kill is set by the test (the last claim's spec write hangs, the queued calls are seen on the agent's
/// `calls_waiting` gauge), not by timing, so the kill always lands with work done, in flight and not started.
async fn kill_during_fifty_concurrent_prepares_leaves_a_consistent_state(ctx: TestContext) -> anyhow::Result<()> {
    const CLAIMS: usize = 50;
    const FIRST_WAVE: usize = 10;
    const QUEUED_FROM: usize = 40;
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "64xH100-80GB").await?;
    let mut claims = Vec::new();
    for i in 0..CLAIMS {
        let name = format!("c{i}");
        let uid = allocated_claim(&ctx, &name, &node, &[&format!("gpu-{i}")], json!([])).await?;
        claims.push((name, uid));
    }
    let kubelet = Kubelet::register(&dirs).await?;
    let ns = ctx.namespace.clone();
    let call = |(name, uid): &(String, String)| {
        let mut client = kubelet.v1.clone();
        let claim = v1::Claim { namespace: ns.clone(), name: name.clone(), uid: uid.clone() };
        tokio::spawn(async move {
            client.node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![claim] }).await
        })
    };
    let mut answered = 0;
    for first in claims[..FIRST_WAVE].iter().map(call).collect::<Vec<_>>() {
        let answer = first.await??.into_inner();
        ensure!(answer.claims.values().all(|a| a.error.is_empty()), "{answer:?}");
        answered += 1;
    }
    // The second wave's batches run until the one holding the last claim hangs on its spec write.
    let (_, last_uid) = &claims[CLAIMS - 1];
    let fifo = hang_spec_write(&dirs, &agent, last_uid)?;
    let second_wave = claims[FIRST_WAVE..QUEUED_FROM].iter().chain(&claims[CLAIMS - 1..]);
    let mut calls: Vec<_> = second_wave.map(call).collect();
    wait::until("the prepare of the last claim to reach the disk", Duration::from_secs(30), || async {
        Ok(checkpoint(&dirs, "boot-1")?.claims.contains_key(last_uid).then_some(()))
    })
    .await?;
    // The third wave queues behind it: these prepares have not started when the agent dies.
    calls.extend(claims[QUEUED_FROM..CLAIMS - 1].iter().map(call));
    let waiting = [("operation", "Prepare")];
    wait::until("the third wave to wait for the state lock", Duration::from_secs(20), || async {
        let now = agent.metric("gpu_dra_kubelet_plugin_calls_waiting", &waiting).await?;
        Ok((now >= (CLAIMS - 1 - QUEUED_FROM) as f64).then_some(()))
    })
    .await?;
    agent.kill()?;
    for call in calls {
        if matches!(call.await, Ok(Ok(_))) {
            answered += 1;
        }
    }
    let at_kill = checkpoint(&dirs, "boot-1")?;
    let in_flight = at_kill.half_prepared().count();
    ensure!(in_flight > 0, "no prepare was in flight at the kill: the test proves nothing");
    let started: Vec<_> =
        claims[QUEUED_FROM..CLAIMS - 1].iter().filter(|(_, uid)| at_kill.claims.contains_key(uid)).collect();
    ensure!(started.is_empty(), "queued behind the hung batch, yet started: {started:?}");
    let specs_at_kill = dirs.cdi_specs()?.iter().filter(|name| name.ends_with(".json")).count();
    // The hung write's fifo was the test's stand-in for a dead disk, not state the agent left: it goes with the disk.
    std::fs::remove_file(&fifo)?;

    let _agent = ready_agent(&ctx, &node, &dirs, "64xH100-80GB").await?;
    let state = checkpoint(&dirs, "boot-1")?;
    ensure!(state.half_prepared().next().is_none(), "half-done entries survived the restart");
    let recorded: BTreeSet<String> = state.claims.keys().map(|uid| format!("{DRIVER}-gpu_{uid}.json")).collect();
    let on_disk: BTreeSet<String> = dirs.cdi_specs()?.into_iter().collect();
    ensure!(recorded == on_disk, "checkpoint {recorded:?} vs specs {on_disk:?}");
    // No temporary file left; the killed agent's lock file is the new agent's now (the kernel dropped the lock). The
    // health state is saved at the first publish (read back from the published taints: there was none).
    let mut state_files: Vec<_> = std::fs::read_dir(dirs.state())?.flatten().map(|e| e.file_name()).collect();
    state_files.sort();
    ensure!(
        state_files == ["agent.lock", "checkpoint.json", "device-metadata", "health.json"],
        "state dir after restart: {state_files:?}"
    );
    // Device metadata files only of the claims the checkpoint lists: those of the interrupted prepares went too.
    let mut with_metadata: Vec<String> = std::fs::read_dir(dirs.state().join("device-metadata"))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    with_metadata.sort();
    let listed: Vec<String> = state.claims.keys().cloned().collect();
    ensure!(with_metadata == listed, "device metadata of {with_metadata:?}, checkpoint lists {listed:?}");

    let mut kubelet = Kubelet::register(&dirs).await?;
    let refs: Vec<(&str, &str, &str)> = claims.iter().map(|(n, u)| (ns.as_str(), n.as_str(), u.as_str())).collect();
    let answers = kubelet.prepare(&refs).await?;
    let failed: Vec<_> = answers.iter().filter(|(_, a)| !a.error.is_empty()).collect();
    ensure!(failed.is_empty(), "prepares after restart failed: {failed:?}");
    ensure!(dirs.cdi_specs()?.len() == CLAIMS, "{} specs", dirs.cdi_specs()?.len());
    let unprepared = kubelet.unprepare(&refs).await?;
    ensure!(unprepared.values().all(String::is_empty), "{unprepared:?}");
    ensure!(dirs.cdi_specs()?.is_empty() && checkpoint(&dirs, "boot-1")?.claims.is_empty(), "state left behind");
    eprintln!(
        "kill -9 with {answered} of {CLAIMS} prepares answered, {in_flight} in flight, {} queued and \
         {specs_at_kill} specs written: consistent",
        CLAIMS - 1 - QUEUED_FROM
    );
    Ok(())
}

/// Prepares claims `a` (gpu-0) and `b` (gpu-1) through a first agent, stops it and corrupts its checkpoint (a
/// truncated write). Returns the two UIDs.
async fn two_prepared_claims_and_a_corrupt_checkpoint(
    ctx: &TestContext,
    node: &str,
    dirs: &NodeDirs,
) -> anyhow::Result<(String, String)> {
    let (a, b) = two_prepared_claims_agent_stopped(ctx, node, dirs).await?;
    std::fs::write(dirs.checkpoint(), b"{\"version\": 1, \"checksum\": \"00\", \"checkpo")?;
    Ok((a, b))
}

/// Prepares claims `a` (gpu-0) and `b` (gpu-1) through a first agent and stops it. Returns the two UIDs.
async fn two_prepared_claims_agent_stopped(
    ctx: &TestContext,
    node: &str,
    dirs: &NodeDirs,
) -> anyhow::Result<(String, String)> {
    let mut agent = ready_agent(ctx, node, dirs, "2xH100-80GB").await?;
    let a = allocated_claim(ctx, "a", node, &["gpu-0"], json!([])).await?;
    let b = allocated_claim(ctx, "b", node, &["gpu-1"], json!([])).await?;
    let ns = ctx.namespace.as_str();
    let answers = Kubelet::register(dirs).await?.prepare(&[(ns, "a", &a), (ns, "b", &b)]).await?;
    ensure!(answers.values().all(|r| r.error.is_empty()), "{answers:?}");
    agent.terminate()?;
    Ok((a, b))
}

/// Waits for a Warning Event `reason` on Node `node` whose note contains `note`.
async fn node_warning(ctx: &TestContext, node: &str, reason: &str, note: &str) -> anyhow::Result<()> {
    wait::until(&format!("a {reason} Warning on the Node"), Duration::from_secs(20), || async {
        let events = support::objects::events_in(ctx, "default", node).await?;
        Ok(events.iter().any(|(type_, r, n)| type_ == "Warning" && r == reason && n.contains(note)).then_some(()))
    })
    .await
}

/// The files the corrupt checkpoint was kept as.
fn kept_aside(dirs: &NodeDirs) -> anyhow::Result<Vec<PathBuf>> {
    Ok(std::fs::read_dir(dirs.state())?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("checkpoint.json.corrupt-"))
        .map(|e| e.path())
        .collect())
}

/// A prepare of `uid` through the kubelet stand-in answers the claim's request and its GPU, and its spec exists.
async fn prepares_fully(dirs: &NodeDirs, ns: &str, name: &str, uid: &str, device: &str) -> anyhow::Result<()> {
    let answers = Kubelet::register(dirs).await?.prepare(&[(ns, name, uid)]).await?;
    let answer = answers.get(uid).context("no answer")?;
    ensure!(answer.error.is_empty() && answer.devices.len() == 1, "{answer:?}");
    let prepared = &answer.devices[0];
    ensure!(prepared.request_names == ["gpus"] && prepared.device_name == device, "{prepared:?}");
    ensure!(dirs.cdi_spec(uid).exists(), "no spec for {name}");
    Ok(())
}

async fn a_corrupt_checkpoint_is_rebuilt_from_the_specs_and_kept_aside(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let (a, b) = two_prepared_claims_and_a_corrupt_checkpoint(&ctx, &node, &dirs).await?;
    let ns = ctx.namespace.as_str();
    let written = std::fs::read(dirs.cdi_spec(&a))?;

    let agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    ensure!(agent.metric("gpu_dra_kubelet_plugin_checkpoint_corruptions_total", &[]).await? == 1.0, "metric");
    ensure!(kept_aside(&dirs)?.len() == 1, "the corrupt file was not kept aside");
    node_warning(&ctx, &node, "CheckpointCorrupt", "").await?;
    // Both specs adopted untouched, both claims recorded again.
    ensure!(std::fs::read(dirs.cdi_spec(&a))? == written && dirs.cdi_spec(&b).exists(), "a spec changed or went");
    let state = checkpoint(&dirs, "boot-1")?;
    ensure!(state.claims.contains_key(&a) && state.claims.contains_key(&b), "rebuilt entries: {:?}", state.claims);
    // A repeated prepare answers in full (the claim is read again), and unprepare releases both.
    prepares_fully(&dirs, ns, "a", &a, "gpu-0").await?;
    let unprepared = Kubelet::register(&dirs).await?.unprepare(&[(ns, "a", &a), (ns, "b", &b)]).await?;
    ensure!(unprepared.values().all(String::is_empty) && dirs.cdi_specs()?.is_empty(), "{unprepared:?}");
    ensure!(checkpoint(&dirs, "boot-1")?.claims.is_empty(), "entries left after unprepare");
    Ok(())
}

/// The checkpoint is gone while claims are prepared (the state directory wiped to "reset" a node, or moved by an
/// upgrade that changed it; the CDI directory kept): not a first start. The kubelet holds the claims as prepared and
/// never prepares them again, so their specs stay (adopted, as after a corrupt checkpoint) for the containers that
/// restart, and go with the kubelet's unprepare.
async fn a_lost_checkpoint_keeps_the_specs_of_prepared_claims(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let (a, b) = two_prepared_claims_agent_stopped(&ctx, &node, &dirs).await?;
    let ns = ctx.namespace.as_str();
    let written = std::fs::read(dirs.cdi_spec(&a))?;
    std::fs::remove_file(dirs.checkpoint())?;

    let agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    ensure!(
        std::fs::read(dirs.cdi_spec(&a))? == written && dirs.cdi_spec(&b).exists(),
        "the specs of prepared claims were removed: {:?}\n{}",
        dirs.cdi_specs()?,
        agent.log_tail()
    );
    let state = checkpoint(&dirs, "boot-1")?;
    ensure!(state.claims.contains_key(&a) && state.claims.contains_key(&b), "adopted entries: {:?}", state.claims);
    ensure!(kept_aside(&dirs)?.is_empty(), "a missing file is not corrupt");
    node_warning(&ctx, &node, "CheckpointMissing", "2 CDI specs").await.with_context(|| agent.log_tail())?;
    // A container of `a` restarting finds its devices; the kubelet's unprepares remove both specs.
    prepares_fully(&dirs, ns, "a", &a, "gpu-0").await?;
    let unprepared = Kubelet::register(&dirs).await?.unprepare(&[(ns, "a", &a), (ns, "b", &b)]).await?;
    ensure!(unprepared.values().all(String::is_empty) && dirs.cdi_specs()?.is_empty(), "{unprepared:?}");
    ensure!(checkpoint(&dirs, "boot-1")?.claims.is_empty(), "entries left after unprepare");
    Ok(())
}

/// The node boots, the checkpoint is corrupt and the API server cannot be reached (not up yet, or the agent lacks a
/// permission): the agent keeps every CDI spec (running pods' containers need them to restart), serves the kubelet,
/// and prepares again from the API once it is reachable.
async fn a_corrupt_checkpoint_with_the_api_unreachable_deletes_no_spec(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let (a, b) = two_prepared_claims_and_a_corrupt_checkpoint(&ctx, &node, &dirs).await?;
    let ns = ctx.namespace.as_str();

    let server = ctx.cluster.server()?;
    let dead = format!("https://127.0.0.1:{}", std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port());
    let kubeconfig = ctx.cluster.kubeconfig().with_file_name(format!("kubeconfig-unreachable-{ns}"));
    std::fs::write(&kubeconfig, std::fs::read_to_string(ctx.cluster.kubeconfig())?.replace(&server, &dead))?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"];
    let mut offline = start_agent_with(&kubeconfig, &format!("{ns}-offline-agent"), &node, &dirs, &args)?;
    // The plugin serves (so the kubelet can unprepare) once start-up recovery is done; give a failed start time to
    // be retried (1 s back-off) before looking at the specs.
    wait::until("the plugin to serve without the API", Duration::from_secs(30), || async {
        Ok(dirs.registration_socket().exists().then_some(()))
    })
    .await
    .with_context(|| offline.log_tail())?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let specs = dirs.cdi_specs()?;
    ensure!(
        dirs.cdi_spec(&a).exists() && dirs.cdi_spec(&b).exists(),
        "specs deleted while the API was unreachable: {specs:?}\n{}",
        offline.log_tail()
    );
    ensure!(kept_aside(&dirs)?.len() == 1, "the corrupt file was not kept aside once the rebuilt one was saved");
    // Offline, a prepare fails (the claim cannot be read) and deletes nothing; an unprepare works.
    let mut kubelet = Kubelet::register(&dirs).await?;
    let answers = kubelet.prepare(&[(ns, "a", &a)]).await?;
    ensure!(answers.get(&a).is_some_and(|r| !r.error.is_empty()), "{answers:?}");
    ensure!(dirs.cdi_spec(&a).exists(), "a failed prepare removed the spec of a running claim");
    let unprepared = kubelet.unprepare(&[(ns, "b", &b)]).await?;
    ensure!(unprepared.values().all(String::is_empty) && !dirs.cdi_spec(&b).exists(), "{unprepared:?}");
    offline.terminate()?;

    // The API is back: the claim still in use is prepared in full from it, with its spec in place all along.
    let _agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    prepares_fully(&dirs, ns, "a", &a, "gpu-0").await?;
    ensure!(kept_aside(&dirs)?.len() == 1, "a second corruption was reported");
    Ok(())
}

/// A new node with a ready agent of two simulated H100s, and claims `a` (its `gpu-0`) and `b` (`gpu-1`) allocated
/// there: the node's directories, the agent, and the claims' UIDs.
async fn node_with_two_claims(ctx: &TestContext) -> anyhow::Result<(NodeDirs, Component, String, String)> {
    let node = node_name(ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = ready_agent(ctx, &node, &dirs, "2xH100-80GB").await?;
    let a = allocated_claim(ctx, "a", &node, &["gpu-0"], json!([])).await?;
    let b = allocated_claim(ctx, "b", &node, &["gpu-1"], json!([])).await?;
    Ok((dirs, agent, a, b))
}

/// A prepare stuck in the disk (here the spec's temporary file is a fifo nobody reads, so the open blocks as on a
/// hung volume) holds the state lock; the liveness probe (`/healthz`, which calls both sockets) must still answer at
/// once, or the kubelet kills the agent mid-prepare.
async fn health_answers_while_a_prepare_hangs_on_the_disk(ctx: TestContext) -> anyhow::Result<()> {
    let (dirs, agent, a, b) = node_with_two_claims(&ctx).await?;
    let ns = ctx.namespace.clone();
    let fifo = hang_spec_write(&dirs, &agent, &a)?;

    let kubelet = Kubelet::register(&dirs).await?;
    let call = |name: &'static str, uid: &str| {
        let mut client = kubelet.v1.clone();
        let claim = v1::Claim { namespace: ns.clone(), name: name.into(), uid: uid.into() };
        tokio::spawn(async move {
            client.node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![claim] }).await
        })
    };
    let stuck = call("a", &a);
    wait::until("the prepare of a to reach the disk", Duration::from_secs(20), || async {
        Ok(checkpoint(&dirs, "boot-1")?.claims.contains_key(&a).then_some(()))
    })
    .await?;
    // More kubelet calls queue behind it (one per pod the kubelet starts).
    let queued: Vec<_> = (0..4).map(|_| call("b", &b)).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let asked = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(10), agent.get("/healthz")).await;
        let (code, body) = answer.context("/healthz did not answer within 10 s")??;
        slowest = slowest.max(asked.elapsed());
        ensure!(code == 200, "/healthz answered {code} while a prepare waited on the disk: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Answered, not held for the hang (which lasts until the fifo is drained, seconds from now).
    ensure!(slowest < Duration::from_secs(3), "/healthz took {slowest:?}");
    ensure!(!stuck.is_finished(), "the prepare did not hang: the test proves nothing");

    // The disk comes back (the fifo is drained): the stuck write fails, the queued prepares succeed, a retry too.
    let reader = drain(fifo);
    let answer = stuck.await??.into_inner();
    reader.join().map_err(|_| anyhow::anyhow!("fifo reader panicked"))??;
    ensure!(answer.claims.get(&a).is_some_and(|r| !r.error.is_empty()), "{answer:?}");
    for call in queued {
        let answer = call.await??.into_inner();
        ensure!(answer.claims.get(&b).is_some_and(|r| r.error.is_empty()), "{answer:?}");
    }
    prepares_fully(&dirs, &ns, "a", &a, "gpu-0").await?;
    eprintln!("/healthz answered in at most {slowest:?} while a prepare hung on the disk");
    Ok(())
}

/// A node whose agent reaches the API server through a proxy that can hold its requests, one GPU, claim `a`
/// allocated it, and the kubelet stand-in registered.
struct BehindProxy {
    node: String,
    dirs: NodeDirs,
    proxy: support::api_proxy::ApiProxy,
    agent: Component,
    a: String,
    kubelet: Kubelet,
}

async fn behind_proxy(ctx: &TestContext) -> anyhow::Result<BehindProxy> {
    let node = node_name(ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let proxy = support::api_proxy::ApiProxy::start(ctx.cluster.client().await?).await?;
    let gpus = ["--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB"];
    let agent = start_agent_with(proxy.kubeconfig(), &format!("{}-agent", ctx.namespace), &node, &dirs, &gpus)?;
    agent.wait_ready().await?;
    let a = allocated_claim(ctx, "a", &node, &["gpu-0"], json!([])).await?;
    let kubelet = Kubelet::register(&dirs).await?;
    Ok(BehindProxy { node, dirs, proxy, agent, a, kubelet })
}

/// The kubelet gives up on a prepare after 45 s; the agent may still be waiting for the claim's API read (a slow or
/// restarting API server). The pod is deleted meanwhile and the kubelet unprepares the claim, which the agent does
/// not hold yet, so that succeeds and the kubelet forgets the claim. The late prepare must then be refused, not
/// done: done, it would leave the claim prepared for nobody and its GPU refused to every later claim. The claim's
/// read is held in a proxy in front of the real API server.
async fn a_prepare_the_kubelet_gave_up_on_is_not_done_after_its_unprepare(ctx: TestContext) -> anyhow::Result<()> {
    let BehindProxy { node, dirs, proxy, agent: _agent, a, mut kubelet } = behind_proxy(&ctx).await?;
    let b = allocated_claim(&ctx, "b", &node, &["gpu-0"], json!([])).await?;
    let ns = ctx.namespace.clone();

    proxy.hold(http::Method::GET, &format!("/namespaces/{ns}/resourceclaims/a"));
    let mut client = kubelet.v1.clone();
    let request = v1::NodePrepareResourcesRequest {
        claims: vec![v1::Claim { namespace: ns.clone(), name: "a".into(), uid: a.clone() }],
    };
    let late = tokio::spawn(async move { client.node_prepare_resources(request).await });
    wait::until("the prepare's read of claim a to be held", Duration::from_secs(20), || async {
        Ok((proxy.held() > 0).then_some(()))
    })
    .await?;
    let unprepared = kubelet.unprepare(&[(&ns, "a", &a)]).await?;
    ensure!(unprepared.get(&a).is_some_and(String::is_empty), "unprepare of a: {unprepared:?}");

    proxy.release();
    let answer = late.await??.into_inner();
    let error = answer.claims.get(&a).map(|r| r.error.clone()).unwrap_or_default();
    ensure!(error.contains("unprepared after this prepare was asked"), "the late prepare of a answered {answer:?}");
    ensure!(!checkpoint(&dirs, "boot-1")?.claims.contains_key(&a), "a is in the checkpoint after its unprepare");
    ensure!(!dirs.cdi_spec(&a).exists(), "a's spec is on disk after its unprepare");

    // Its GPU is free for the next claim, and asked again (after the unprepare) a is prepared as usual.
    let prepared = kubelet.prepare(&[(&ns, "b", &b)]).await?;
    ensure!(prepared.get(&b).is_some_and(|r| r.error.is_empty()), "b on the freed GPU: {prepared:?}");
    ensure!(kubelet.unprepare(&[(&ns, "b", &b)]).await?.get(&b).is_some_and(String::is_empty));
    let again = kubelet.prepare(&[(&ns, "a", &a)]).await?;
    ensure!(again.get(&a).is_some_and(|r| r.error.is_empty()), "a asked again: {again:?}");
    eprintln!("the late prepare was refused: {error}");
    Ok(())
}

/// The kubelet stops waiting for a prepare after 45 s (here a 2 s deadline; the claim's API read held in a proxy, as
/// by a slow API server). The call is counted `abandoned` and said in the log with how long it waited, its duration
/// observed over a second (and within 5 s); nothing is counted a success or an error. Asked again once the API answers, the claim is
/// prepared.
async fn a_prepare_the_kubelet_stops_waiting_for_is_counted_and_logged(ctx: TestContext) -> anyhow::Result<()> {
    let BehindProxy { proxy, agent, a, mut kubelet, .. } = behind_proxy(&ctx).await?;
    let ns = ctx.namespace.clone();

    proxy.hold(http::Method::GET, &format!("/namespaces/{ns}/resourceclaims/a"));
    let claim = v1::Claim { namespace: ns.clone(), name: "a".into(), uid: a.clone() };
    let mut request = tonic::Request::new(v1::NodePrepareResourcesRequest { claims: vec![claim] });
    request.set_timeout(Duration::from_secs(2));
    let answer = kubelet.v1.clone().node_prepare_resources(request).await;
    let status = answer.err().context("the prepare was answered although its claim's read was held")?;
    ensure!(proxy.held() > 0, "the claim's read was not held: the test proves nothing");
    ensure!(
        matches!(status.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled),
        "the call ended with {status:?}"
    );

    let prepare = |result| [("operation", "Prepare"), ("result", result)];
    let claims = "gpu_dra_kubelet_plugin_claims_total";
    wait::until("the claim to be counted abandoned", Duration::from_secs(10), || async {
        Ok((agent.metric(claims, &prepare("abandoned")).await? == 1.0).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    for result in ["success", "error"] {
        ensure!(agent.metric(claims, &prepare(result)).await? == 0.0, "a {result} counted for the abandoned call");
    }
    let log = agent.log_text();
    let said = log.lines().find(|l| l.contains("the kubelet stopped waiting for the call"));
    let said = said.context("the abandoned call is not in the log")?;
    ensure!(said.contains("WARN") && said.contains(&format!("{ns}/a")), "said as: {said}");
    let bucket = |le| [("operation", "Prepare"), ("le", le)];
    let durations = "gpu_dra_kubelet_plugin_request_duration_seconds_bucket";
    ensure!(agent.metric(durations, &bucket("1.0")).await? == 0.0, "observed within a second");
    ensure!(agent.metric(durations, &bucket("5.0")).await? == 1.0, "not observed within 5 s");

    proxy.release();
    let again = kubelet.prepare(&[(&ns, "a", &a)]).await?;
    ensure!(again.get(&a).is_some_and(|r| r.error.is_empty()), "a asked again: {again:?}");
    ensure!(agent.metric(claims, &prepare("success")).await? == 1.0, "the prepare asked again is not counted");
    eprintln!("abandoned and said: {said}");
    Ok(())
}

/// Makes the write of `uid`'s CDI spec hang as on a hung volume: its temporary file is a fifo nobody reads yet.
fn hang_spec_write(dirs: &NodeDirs, agent: &Component, uid: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dirs.cdi())?;
    let fifo = dirs.cdi().join(format!(".{DRIVER}-gpu_{uid}.json.tmp-{}", agent.pid()));
    let made = std::process::Command::new("mkfifo").arg(&fifo).status()?;
    ensure!(made.success(), "mkfifo {}", fifo.display());
    Ok(fifo)
}

/// The disk comes back: reads the fifo to its end on a thread of its own, so the stuck write finishes (and fails).
fn drain(fifo: PathBuf) -> std::thread::JoinHandle<std::io::Result<Vec<u8>>> {
    std::thread::spawn(move || {
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut std::fs::File::open(&fifo)?, &mut data)?;
        Ok(data)
    })
}

/// Pods the kubelet starts together each send a prepare; every one must be on disk before it is answered. Queued
/// behind a busy disk (a prepare hung on it), ten such calls are done as one batch when it comes back: two
/// checkpoint saves for all ten, not two each, every claim answered with its own GPU.
async fn pods_started_together_share_the_checkpoint_saves(ctx: TestContext) -> anyhow::Result<()> {
    const QUEUED: usize = 10;
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = ready_agent(&ctx, &node, &dirs, "12xH100-80GB").await?;
    let stuck_uid = allocated_claim(&ctx, "stuck", &node, &["gpu-0"], json!([])).await?;
    let mut claims = Vec::new();
    for i in 1..=QUEUED {
        let name = format!("pod{i}-gpu");
        let uid = allocated_claim(&ctx, &name, &node, &[&format!("gpu-{i}")], json!([])).await?;
        claims.push((name, uid));
    }
    let fifo = hang_spec_write(&dirs, &agent, &stuck_uid)?;
    let kubelet = Kubelet::register(&dirs).await?;
    let ns = ctx.namespace.clone();
    let call = |name: &str, uid: &str| {
        let mut client = kubelet.v1.clone();
        let claim = v1::Claim { namespace: ns.clone(), name: name.into(), uid: uid.into() };
        tokio::spawn(async move {
            client.node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![claim] }).await
        })
    };
    let stuck = call("stuck", &stuck_uid);
    wait::until("the stuck prepare to reach the disk", Duration::from_secs(20), || async {
        Ok(checkpoint(&dirs, "boot-1")?.claims.contains_key(&stuck_uid).then_some(()))
    })
    .await?;
    let queued: Vec<_> = claims.iter().map(|(name, uid)| (uid.clone(), call(name, uid))).collect();
    let waiting = [("operation", "Prepare")];
    wait::until("the ten calls to wait for the state lock", Duration::from_secs(20), || async {
        let now = agent.metric("gpu_dra_kubelet_plugin_calls_waiting", &waiting).await?;
        Ok((now >= QUEUED as f64).then_some(()))
    })
    .await?;
    ensure!(!stuck.is_finished(), "the prepare did not hang: the test proves nothing");
    let saves_before = agent.metric("gpu_dra_kubelet_plugin_checkpoint_saves_total", &[]).await?;

    let reader = drain(fifo);
    ensure!(stuck.await??.into_inner().claims.get(&stuck_uid).is_some_and(|r| !r.error.is_empty()), "stuck");
    reader.join().map_err(|_| anyhow::anyhow!("fifo reader panicked"))??;
    for (i, (uid, call)) in queued.into_iter().enumerate() {
        let answer = call.await??.into_inner();
        let result = answer.claims.get(&uid).with_context(|| format!("no answer for call {i}: {answer:?}"))?;
        ensure!(result.error.is_empty(), "call {i}: {}", result.error);
        let devices: Vec<&str> = result.devices.iter().map(|d| d.device_name.as_str()).collect();
        ensure!(devices == [format!("gpu-{}", i + 1)], "call {i} got {devices:?}");
    }
    // The stuck prepare's own clean-up save, then one before and one after the ten specs: exactly three.
    let saves = agent.metric("gpu_dra_kubelet_plugin_checkpoint_saves_total", &[]).await? - saves_before;
    ensure!(
        saves == 3.0,
        "{saves} checkpoint saves for {QUEUED} queued prepares (one at a time would be {})",
        1 + 2 * QUEUED
    );
    ensure!(dirs.cdi_specs()?.len() == QUEUED, "specs: {:?}", dirs.cdi_specs()?);
    let recorded = checkpoint(&dirs, "boot-1")?;
    ensure!(recorded.claims.len() == QUEUED && recorded.half_prepared().next().is_none(), "{recorded:?}");
    ensure!(agent.metric("gpu_dra_kubelet_plugin_calls_waiting", &waiting).await? == 0.0, "calls left waiting");
    eprintln!("{QUEUED} prepares queued behind a hung disk: {saves} checkpoint saves once it came back");
    Ok(())
}

/// A node of the test's own whose agent has two H100s, and claim `a` allocated its `gpu-1` and prepared.
struct OnePrepared {
    node: String,
    dirs: NodeDirs,
    agent: Component,
    uid: String,
    /// The CDI ids the kubelet was given for the claim.
    given: Vec<String>,
}

async fn one_prepared_claim(ctx: &TestContext) -> anyhow::Result<OnePrepared> {
    let node = node_name(ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = ready_agent(ctx, &node, &dirs, "2xH100-80GB").await?;
    let uid = allocated_claim(ctx, "a", &node, &["gpu-1"], json!([])).await?;
    let answers = Kubelet::register(&dirs).await?.prepare(&[(ctx.namespace.as_str(), "a", &uid)]).await?;
    let answer = answers.get(&uid).context("no answer")?;
    ensure!(answer.error.is_empty(), "prepare: {answer:?}");
    let given = answer.devices.iter().flat_map(|d| d.cdi_device_ids.clone()).collect();
    Ok(OnePrepared { node, dirs, agent, uid, given })
}

async fn restart_rewrites_lost_specs_and_a_reboot_drops_old_entries(ctx: TestContext) -> anyhow::Result<()> {
    let OnePrepared { node, dirs, mut agent, uid, .. } = one_prepared_claim(&ctx).await?;
    let ns = ctx.namespace.as_str();
    let spec = dirs.cdi_spec(&uid);
    let written = std::fs::read(&spec)?;
    agent.terminate()?;

    std::fs::remove_file(&spec)?; // e.g. /var/run/cdi is a tmpfs that was emptied
    let mut agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    ensure!(std::fs::read(&spec).ok() == Some(written), "the lost spec was not re-written identically");
    agent.terminate()?;

    std::fs::write(dirs.boot_id_file(), "boot-2\n")?;
    let _agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    ensure!(checkpoint(&dirs, "boot-2")?.claims.is_empty(), "entries of the earlier boot kept");
    ensure!(!spec.exists(), "the spec of the earlier boot was kept");
    let again = Kubelet::register(&dirs).await?.prepare(&[(ns, "a", &uid)]).await?;
    ensure!(again.get(&uid).is_some_and(|a| a.error.is_empty()) && spec.exists(), "{again:?}");
    Ok(())
}

/// A `helm rollback` to an agent version that does not record device metadata, then an upgrade again: the older
/// agent's save of the checkpoint dropped the claim's metadata record (here taken out by hand, as it would be),
/// while the kubelet still hands the claim's containers the metadata device's CDI id. The upgraded agent's start-up
/// check of the specs keeps that device, as the spec on disk has it; before, it wrote the spec again without it,
/// and every restart of a container of the claim failed ("unresolvable CDI devices").
async fn a_rollback_and_upgrade_keep_the_metadata_device_the_kubelet_was_given(ctx: TestContext) -> anyhow::Result<()> {
    let OnePrepared { node, dirs, mut agent, uid, given } = one_prepared_claim(&ctx).await?;
    let metadata_device = format!("{uid}_gpus");
    ensure!(given.contains(&format!("{DRIVER}/gpu={metadata_device}")), "the kubelet was given {given:?}");
    let spec = dirs.cdi_spec(&uid);
    let written = std::fs::read(&spec)?;
    agent.terminate()?;

    let mut state = checkpoint(&dirs, "boot-1")?;
    let entry = state.claims.get_mut(&uid).context("no entry")?;
    ensure!(entry.metadata.take().is_some(), "no metadata record to drop: {entry:?}");
    CheckpointStore::new(&dirs.state()).save(&state)?;

    let agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let now = std::fs::read(&spec)?;
    ensure!(
        check_cdi_spec(&spec)?.contains(&metadata_device) && now == written,
        "the spec was written again without the metadata device:\n{}\n{}",
        String::from_utf8_lossy(&now),
        agent.log_tail()
    );
    Ok(())
}

/// The kubelet prepares a claim once per pod, but the runtime reads its spec at every container start: a spec
/// deleted on the host while the pod runs (a tool emptying `/var/run/cdi`) would fail the next restart of a crashed
/// container until the agent restarted. The running agent writes it again within its check interval (10 s), also
/// when the whole directory went.
async fn a_spec_lost_while_the_agent_runs_is_written_again(ctx: TestContext) -> anyhow::Result<()> {
    let (dirs, agent, a, b) = node_with_two_claims(&ctx).await?;
    let ns = ctx.namespace.as_str();
    let answers = Kubelet::register(&dirs).await?.prepare(&[(ns, "a", &a), (ns, "b", &b)]).await?;
    ensure!(answers.values().all(|r| r.error.is_empty()), "{answers:?}");
    let written = std::fs::read(dirs.cdi_spec(&a))?;
    let (spec_a, spec_b) = (dirs.cdi_spec(&a), dirs.cdi_spec(&b));
    let back = || {
        let ready = spec_a.exists() && spec_b.exists();
        async move { Ok(ready.then_some(())) }
    };

    std::fs::remove_file(dirs.cdi_spec(&a))?;
    let lost = Instant::now();
    wait::until("a's lost spec written again", Duration::from_secs(25), back).await?;
    ensure!(std::fs::read(dirs.cdi_spec(&a))? == written, "the spec was written again with other content");
    let took = lost.elapsed();
    // Moved away in one step, then removed: a pass of the agent's look never sees it half removed.
    let gone = dirs.cdi().with_extension("gone");
    std::fs::rename(dirs.cdi(), &gone)?;
    std::fs::remove_dir_all(&gone)?;
    wait::until("both specs written again in a new directory", Duration::from_secs(25), back).await?;
    check_cdi_spec(&dirs.cdi_spec(&b))?;
    let rewritten = agent.metric("gpu_dra_kubelet_plugin_specs_rewritten_total", &[]).await?;
    ensure!(rewritten == 3.0, "gpu_dra_kubelet_plugin_specs_rewritten_total is {rewritten}, not 3");
    eprintln!("a spec deleted under the running agent was back after {took:?}");
    Ok(())
}

/// Dynamic MIG on a GPU with an administrator's `1g.10gb` on slice 0. Claims `half` (a `1g.10gb` at slice 3) and
/// `done` (a `2g.20gb` at slice 4) are prepared, then the agent is killed, and its checkpoint made to say what a kill
/// after `half`'s MIG device was made and recorded, before its spec, leaves: `half` started; `never` started too,
/// on slice 0, with no MIG device recorded (killed before its device was made). At start, only `half`'s MIG device
/// is destroyed: the administrator's is not `never`'s to destroy, and `done`'s stays with its claim. Then `done`'s
/// spec is lost while the agent runs: the kubelet's next prepare uses the MIG device made for it, makes no second
/// one. The publication leaves out every partition on slice 0 and keeps the counters whole.
async fn an_interrupted_dynamic_mig_prepare_destroys_only_the_mig_device_it_made(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let gpus = "1xH100-80GB/mig=1g.10gb";
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", gpus, "--mig-layout", "dynamic"];
    let ns = ctx.namespace.as_str();
    let half = allocated_claim(&ctx, "half", &node, &["gpu-0-mig-19-3-1"], json!([])).await?;
    let done = allocated_claim(&ctx, "done", &node, &["gpu-0-mig-14-4-2"], json!([])).await?;
    let (half, done) = (half.as_str(), done.as_str());
    let mut agent = start_agent(&ctx, &node, &dirs, &args)?;
    agent.wait_ready().await?;
    if support::cluster::kubernetes_minor()? < 36 {
        // The API server drops the counters (README's version table): ready, the agent serves static MIG, and a
        // claim allocated a partition is refused, naming the device.
        ensure!(agent.log_text().contains("feature gate DRAPartitionableDevices off"), "{}", agent.log_tail());
        let refused = Kubelet::register(&dirs).await?.prepare(&[(ns, "half", half)]).await?;
        let error = refused.get(half).map(|a| a.error.clone()).unwrap_or_default();
        ensure!(error.contains("\"gpu-0-mig-19-3-1\", which this node does not have"), "prepare: {refused:?}");
        return Ok(());
    }
    let prepared = Kubelet::register(&dirs).await?.prepare(&[(ns, "half", half), (ns, "done", done)]).await?;
    ensure!(prepared.values().all(|a| a.error.is_empty()) && prepared.len() == 2, "prepare: {prepared:?}");
    let kept = dirs.state().join("simulated-mig-devices.json");
    // (profile ID, first memory slice, GPU instance) of each MIG device of GPU 0, as the simulated driver keeps them.
    let layout = || -> anyhow::Result<Value> {
        let kept: Value = serde_json::from_str(&std::fs::read_to_string(&kept)?)?;
        let devices: Vec<(u32, u32, u32, String)> = serde_json::from_value(kept["gpus"]["0"].clone())?;
        Ok(devices.into_iter().map(|(id, start, gi, _)| json!([id, start, gi])).collect())
    };
    // (profile ID, first memory slice, GPU instance): the administrator's is instance 1.
    ensure!(layout()? == json!([[19, 0, 1], [19, 3, 2], [14, 4, 3]]), "MIG devices: {}", layout()?);
    agent.kill()?;

    let mut state = checkpoint(&dirs, "boot-1")?;
    let made = |uid: &str| state.claims.get(uid).and_then(|e| e.devices[0].made_mig.clone());
    ensure!(made(half).is_some() && made(done).is_some() && made(half) != made(done), "recorded: {state:?}");
    let done_mig = made(done);
    if let Some(entry) = state.claims.get_mut(half) {
        entry.state = PrepareState::PrepareStarted;
    }
    let never = "66666666-0000-4000-8000-000000000000";
    let entry: ClaimEntry = serde_json::from_value(json!({
        "namespace": ns, "name": "never", "state": "PrepareStarted",
        "devices": [{"requestNames": ["gpus"], "pool": node, "device": "gpu-0-mig-19-0-1",
                     "cdiDeviceIds": [format!("{DRIVER}/gpu={never}-gpu-0-mig-19-0-1")]}]
    }))?;
    state.claims.insert(never.into(), entry);
    CheckpointStore::new(&dirs.state()).save(&state)?;

    let agent = start_agent(&ctx, &node, &dirs, &args)?;
    agent.wait_ready().await?;
    ensure!(layout()? == json!([[19, 0, 1], [14, 4, 3]]), "MIG devices after start: {}", layout()?);
    let recorded = checkpoint(&dirs, "boot-1")?;
    ensure!(recorded.claims.keys().eq([done]), "checkpoint after start: {recorded:?}");
    ensure!(!dirs.cdi_spec(half).exists() && dirs.cdi_spec(done).exists(), "specs: {:?}", dirs.cdi_specs()?);
    let names = wait::until("the partitions to be published", Duration::from_secs(30), || async {
        let devices = objects::published_devices(&ctx.client, &node).await?;
        Ok((!devices.is_empty()).then(|| devices.into_iter().map(|d| d.name).collect::<BTreeSet<String>>()))
    })
    .await?;
    // 26 partitions, less the 8 starting on slice 0 (the whole GPU among them).
    ensure!(names.len() == 18 && names.contains("gpu-0-mig-19-3-1") && names.contains("gpu-0-mig-14-4-2"), "{names:?}");
    ensure!(!names.contains("gpu-0-mig-19-0-1") && !names.contains("gpu-0"), "published on slice 0: {names:?}");
    let slices = Api::<ResourceSlice>::all(ctx.client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?;
    let counters: Vec<String> = slices
        .items
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .flat_map(|set| set.counters.values().map(|c| c.value.0.clone()))
        .collect();
    ensure!(counters.len() == 10 && counters.iter().all(|v| v != "0"), "counters: {counters:?}");

    std::fs::remove_file(dirs.cdi_spec(done))?;
    let again = Kubelet::register(&dirs).await?.prepare(&[(ns, "done", done)]).await?;
    ensure!(again.get(done).is_some_and(|a| a.error.is_empty()), "prepare again: {again:?}");
    ensure!(dirs.cdi_spec(done).exists(), "the spec was not written again");
    ensure!(layout()? == json!([[19, 0, 1], [14, 4, 3]]), "MIG devices after a prepare again: {}", layout()?);
    let recorded = checkpoint(&dirs, "boot-1")?;
    let kept_mig = recorded.claims.get(done).and_then(|e| e.devices[0].made_mig.clone());
    ensure!(kept_mig == done_mig, "the MIG device made for done is recorded as {kept_mig:?}, was {done_mig:?}");
    drop(agent);
    Ok(())
}

/// Dynamic MIG: an agent killed after making a claim's MIG device, before its UUID was saved. The placement was
/// marked in the checkpoint before the make (`makingMig`), so the restarted agent destroys the device, and the
/// kubelet's retry prepares the claim. Before, the device stayed, nobody's: every retry failed as overlapping it,
/// and the pod never started.
async fn a_prepare_killed_after_making_a_mig_device_leaves_it_to_be_destroyed(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB/mig=", "--mig-layout", "dynamic"];
    let ns = ctx.namespace.as_str();
    let uid = allocated_claim(&ctx, "killed", &node, &["gpu-0-mig-19-1-1"], json!([])).await?;
    let mut agent = start_agent(&ctx, &node, &dirs, &args)?;
    agent.wait_ready().await?;
    if support::cluster::kubernetes_minor()? < 36 {
        // The API server drops the counters (README's version table): the agent serves static MIG, and a claim
        // allocated a partition is refused, naming the device; nothing is made.
        let refused = Kubelet::register(&dirs).await?.prepare(&[(ns, "killed", uid.as_str())]).await?;
        let error = refused.get(&uid).map(|a| a.error.clone()).unwrap_or_default();
        ensure!(error.contains("\"gpu-0-mig-19-1-1\", which this node does not have"), "prepare: {refused:?}");
        return Ok(());
    }
    let hang = dirs.state().join("simulated-mig-made-hung");
    std::fs::write(&hang, b"")?;
    let kubelet = Kubelet::register(&dirs).await?;
    let claims = [(ns.to_string(), "killed".to_string(), uid.clone())];
    let prepare = tokio::spawn(async move {
        let claims: Vec<(&str, &str, &str)> =
            claims.iter().map(|(n, c, u)| (n.as_str(), c.as_str(), u.as_str())).collect();
        let mut kubelet = kubelet;
        kubelet.prepare(&claims).await
    });
    let kept = dirs.state().join("simulated-mig-devices.json");
    wait::until("the MIG device made", Duration::from_secs(20), || async {
        let text = std::fs::read_to_string(&kept).unwrap_or_default();
        let kept: Value = serde_json::from_str(&text).unwrap_or_default();
        Ok(kept["gpus"]["0"].as_array().is_some_and(|d| d.len() == 1).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    let marked = checkpoint(&dirs, "boot-1")?;
    let device = marked.claims.get(&uid).and_then(|e| e.devices.first()).context("no entry")?;
    ensure!(device.making_mig && device.made_mig.is_none(), "the make is not marked before it: {marked:?}");
    agent.kill()?;
    let _ = prepare.await;
    std::fs::remove_file(&hang)?;

    let agent = start_agent(&ctx, &node, &dirs, &args)?;
    agent.wait_ready().await?;
    let kept_now: Value = serde_json::from_str(&std::fs::read_to_string(&kept)?)?;
    ensure!(kept_now["gpus"]["0"] == json!([]), "the unrecorded MIG device is left: {kept_now}\n{}", agent.log_tail());
    ensure!(agent.log_text().contains("a prepare killed before recording it had made"), "{}", agent.log_tail());
    let again = Kubelet::register(&dirs).await?.prepare(&[(ns, "killed", uid.as_str())]).await?;
    ensure!(again.get(&uid).is_some_and(|a| a.error.is_empty()), "the kubelet's retry: {again:?}");
    let recorded = checkpoint(&dirs, "boot-1")?;
    let device = recorded.claims.get(&uid).and_then(|e| e.devices.first()).context("no entry")?;
    ensure!(device.made_mig.is_some() && !device.making_mig, "recorded after the retry: {recorded:?}");
    Ok(())
}

/// A node starting pods together, one of them on a dynamic MIG partition whose MIG work is slow (NVML stuck on a
/// faulted GPU, here the simulated backend's hung markers): a pod asking a whole GPU, in the same batch, is
/// prepared and answered at once, not after the MIG work (the kubelet gives a call 45 s; before, every call of the
/// batch waited for it, and their retries queued behind the next batch's). The order is set by the test, not by
/// timing: a first MIG make holds the state lock until both calls are seen waiting for it (`calls_waiting`), and
/// NVML is stuck before it is let go, so the batch holding both calls finds the partition's look (an admin-access
/// claim's) stuck.
async fn a_claim_needing_nothing_slow_is_not_held_back_by_mig_work_in_its_batch(
    ctx: TestContext,
) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Namespace;
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let args =
        ["--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB/mig=,1xL4-24GB", "--mig-layout", "dynamic"];
    let ns = ctx.namespace.as_str();
    let label = json!({"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}});
    Api::<Namespace>::all(ctx.client.clone()).patch(ns, &PatchParams::default(), &Patch::Merge(&label)).await?;
    let partition = "gpu-0-mig-19-0-1";
    let made_uid = allocated_claim(&ctx, "made", &node, &[partition], json!([])).await?;
    let whole_uid = allocated_claim(&ctx, "whole", &node, &["gpu-1"], json!([])).await?;
    let monitor: ResourceClaim = serde_json::from_value(json!({"metadata": {"name": "monitor"}, "spec": {"devices": {
        "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu", "adminAccess": true}}]}}}))?;
    let monitor_uid = objects::claims(&ctx).create(&PostParams::default(), &monitor).await?.metadata.uid;
    let monitor_uid = monitor_uid.context("no UID")?;
    let status = json!({"status": {"allocation": {"devices": {"results": [
        {"request": "gpus", "driver": DRIVER, "pool": node, "device": partition, "adminAccess": true}]}}}});
    objects::claims(&ctx).patch_status("monitor", &PatchParams::default(), &Patch::Merge(&status)).await?;
    let agent = start_agent(&ctx, &node, &dirs, &args)?;
    agent.wait_ready().await?;
    let kubelet = Kubelet::register(&dirs).await?;
    if support::cluster::kubernetes_minor()? < 36 {
        // The API server drops the counters (README's version table): the agent serves static MIG, and a claim
        // allocated a partition is refused, naming the device.
        let refused = Kubelet::register(&dirs).await?.prepare(&[(ns, "made", made_uid.as_str())]).await?;
        let error = refused.get(&made_uid).map(|a| a.error.clone()).unwrap_or_default();
        ensure!(error.contains(&format!("\"{partition}\", which this node does not have")), "prepare: {refused:?}");
        return Ok(());
    }
    let call = |name: &str, uid: &str| {
        let mut client = kubelet.v1.clone();
        let claim = v1::Claim { namespace: ns.to_string(), name: name.to_string(), uid: uid.to_string() };
        tokio::spawn(async move {
            let answer = client.node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![claim] }).await;
            anyhow::Ok(answer?.into_inner().claims)
        })
    };
    let made_hung = dirs.state().join("simulated-mig-made-hung");
    let nvml_hung = dirs.state().join("simulated-driver-hung");
    std::fs::write(&made_hung, b"")?;
    let made = call("made", &made_uid);
    let kept = dirs.state().join("simulated-mig-devices.json");
    wait::until("the first MIG device made", Duration::from_secs(20), || async {
        let kept: Value = serde_json::from_str(&std::fs::read_to_string(&kept).unwrap_or_default()).unwrap_or_default();
        Ok(kept["gpus"]["0"].as_array().is_some_and(|d| d.len() == 1).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    let (whole, monitor) = (call("whole", &whole_uid), call("monitor", &monitor_uid));
    let waiting = [("operation", "Prepare")];
    wait::until("both calls to wait for the state lock", Duration::from_secs(20), || async {
        let now = agent.metric("gpu_dra_kubelet_plugin_calls_waiting", &waiting).await?;
        Ok((now >= 2.0).then_some(()))
    })
    .await?;
    std::fs::write(&nvml_hung, b"")?;
    std::fs::remove_file(&made_hung)?;
    let answers = tokio::time::timeout(Duration::from_secs(20), made).await.context("the first make hangs")???;
    ensure!(answers.values().all(|a| a.error.is_empty()), "the first MIG claim: {answers:?}");

    let answers = tokio::time::timeout(Duration::from_secs(15), whole)
        .await
        .with_context(|| format!("the whole GPU's claim waited for the stuck MIG look:\n{}", agent.log_tail()))???;
    ensure!(answers.values().all(|a| a.error.is_empty()), "the whole GPU's claim: {answers:?}");
    ensure!(dirs.cdi_spec(&whole_uid).exists(), "answered before its spec was written");
    ensure!(!monitor.is_finished(), "the admin-access claim was answered while NVML is stuck: the test proves nothing");
    let recorded = checkpoint(&dirs, "boot-1")?;
    let done = recorded.claims.get(&whole_uid).map(|e| e.state);
    ensure!(done == Some(PrepareState::PrepareCompleted), "the whole GPU's claim is recorded {done:?}");

    std::fs::remove_file(&nvml_hung)?;
    let answers = tokio::time::timeout(Duration::from_secs(30), monitor).await.context("the look still hangs")???;
    ensure!(answers.values().all(|a| a.error.is_empty()), "the admin-access claim: {answers:?}");
    Ok(())
}

/// `driverName` changed (a `helm upgrade`) while a claim is prepared on the node: the kubelet unprepares it only
/// through the old driver's plugin, so an agent of the new name taking the checkpoint over would never see its
/// unprepare, and would publish its GPU as free beside it. The renamed agent refuses to start its plugin, naming
/// the claim and what to do (it stays up, not ready, publishing nothing); the old name serves again as before.
async fn a_renamed_driver_does_not_take_over_claims_prepared_for_the_old_name(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "1xH100-80GB").await?;
    let uid = allocated_claim(&ctx, "held", &node, &["gpu-0"], json!([])).await?;
    let ns = ctx.namespace.as_str();
    let answers = Kubelet::register(&dirs).await?.prepare(&[(ns, "held", uid.as_str())]).await?;
    ensure!(answers.values().all(|a| a.error.is_empty()), "{answers:?}");
    agent.kill()?;

    let renamed = "renamed.example.com";
    let args = ["--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB", "--driver-name", renamed];
    let mut other = start_agent(&ctx, &node, &dirs, &args)?;
    let said = format!("holds claims prepared for driver {DRIVER}, not {renamed} ({ns}/held)");
    wait::until("the renamed agent to refuse", Duration::from_secs(20), || async {
        Ok(other.log_text().contains(&said).then_some(()))
    })
    .await
    .with_context(|| other.log_tail())?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ready = other.get("/readyz").await.is_ok_and(|(code, _)| code == 200);
    ensure!(!ready, "the renamed agent is ready:\n{}", other.log_tail());
    let published = Api::<ResourceSlice>::all(ctx.client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={renamed}")))
        .await?;
    ensure!(published.items.is_empty(), "the renamed agent published the held GPU: {:?}", published.items);
    ensure!(dirs.cdi_spec(&uid).exists(), "the held claim's spec was removed");
    other.kill()?;

    let agent = ready_agent(&ctx, &node, &dirs, "1xH100-80GB").await?;
    let answers = Kubelet::register(&dirs).await?.unprepare(&[(ns, "held", uid.as_str())]).await?;
    ensure!(answers.values().all(String::is_empty), "unprepare through the old name: {answers:?}");
    ensure!(checkpoint(&dirs, "boot-1")?.claims.is_empty(), "the claim is still recorded");
    drop(agent);
    Ok(())
}

async fn an_interrupted_prepare_and_stray_specs_are_cleaned_up_on_start(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let (half, stray) = ("22222222-0000-4000-8000-000000000000", "33333333-0000-4000-8000-000000000000");
    let mut state = Checkpoint::new("boot-1");
    let entry: ClaimEntry = serde_json::from_value(json!({
        "namespace": ctx.namespace, "name": "half", "state": "PrepareStarted",
        "devices": [{"requestNames": ["gpus"], "pool": node, "device": "gpu-0",
                     "cdiDeviceIds": [format!("{DRIVER}/gpu={half}-gpu-0")]}]
    }))?;
    state.claims.insert(half.into(), entry);
    CheckpointStore::new(&dirs.state()).save(&state)?;
    std::fs::create_dir_all(dirs.cdi())?;
    for uid in [half, stray] {
        std::fs::write(dirs.cdi_spec(uid), "{}")?;
    }
    std::fs::write(dirs.cdi().join("someone-else.json"), "{}")?;
    // Writers killed between creating and renaming their temporary files, in an earlier container where the agent
    // was PID 1 as it is in every container: PID 1 is alive, but nobody holds these files' locks.
    let spec_temporary = dirs.cdi().join(format!(".{DRIVER}-gpu_{stray}.json.tmp-1"));
    let checkpoint_temporary = dirs.state().join(".checkpoint.json.tmp-1");
    for temporary in [&spec_temporary, &checkpoint_temporary] {
        std::fs::write(temporary, "{\"half\": ")?;
    }

    let _agent = ready_agent(&ctx, &node, &dirs, "2xH100-80GB").await?;
    let left = dirs.cdi_specs()?;
    ensure!(left == ["someone-else.json"], "after start: {left:?} (only other vendors' specs may stay)");
    ensure!(!checkpoint_temporary.exists(), "the abandoned temporary checkpoint file was kept");
    if !checkpoint(&dirs, "boot-1")?.claims.is_empty() {
        bail!("the interrupted prepare is still recorded");
    }
    let slices = Api::<ResourceSlice>::all(ctx.client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?;
    ensure!(!slices.items.is_empty(), "no slices published");
    Ok(())
}

/// A node booted without the unified-memory device nodes (nothing ran `nvidia-modprobe -u` yet): the first GPU pod's
/// spec leaves them out (the runtime refuses a spec naming nodes the host lacks), and CUDA fails in its containers.
/// Once the nodes appear the agent writes the prepared claims' specs again within its 10 s look for lost specs, so the
/// containers' next start has them (before, the spec stayed without them for the pod's life).
async fn a_spec_written_before_the_unified_memory_nodes_gets_them_once_they_appear(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let dev = tempfile::tempdir()?;
    let dev_root = dev.path().to_str().context("dev root")?;
    let agent = ready_agent_with(&ctx, &node, &dirs, "1xH100-80GB", &["--simulated-dev-root", dev_root]).await?;
    let uid = allocated_claim(&ctx, "a", &node, &["gpu-0"], json!([])).await?;
    prepares_fully(&dirs, &ctx.namespace, "a", &uid, "gpu-0").await?;
    let shared_nodes = || -> anyhow::Result<Vec<String>> {
        let spec: Value = serde_json::from_slice(&std::fs::read(dirs.cdi_spec(&uid))?)?;
        let nodes = spec["containerEdits"]["deviceNodes"].as_array().cloned().unwrap_or_default();
        Ok(nodes.iter().filter_map(|n| n["path"].as_str().map(str::to_string)).collect())
    };
    ensure!(shared_nodes()? == ["/dev/nvidiactl"], "before the nodes exist: {:?}", shared_nodes()?);

    std::fs::create_dir_all(dev.path().join("dev"))?;
    for name in ["nvidia-uvm", "nvidia-uvm-tools"] {
        std::fs::write(dev.path().join("dev").join(name), b"")?;
    }
    let took = Instant::now();
    wait::until("the spec to name the unified-memory nodes", Duration::from_secs(25), || async {
        Ok((shared_nodes()? == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    eprintln!("the spec named the unified-memory nodes {:?} after they appeared", took.elapsed());
    Ok(())
}
