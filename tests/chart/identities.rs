//! The components under their chart ServiceAccounts: everything they need works, the rest is refused.

use super::*;

pub(super) async fn controller_works_under_its_service_account_and_is_refused_the_rest(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let sets = ["nodeAgent.enabled=false", "deviceClasses.gpu.enabled=false", "deviceClasses.mig.enabled=false"];
    with_chart_applied(&ctx, &sets, async |applied| controller_under_its_account(&ctx, applied).await).await
}

async fn controller_under_its_account(ctx: &TestContext, applied: &[Value]) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let deployment = object(applied, "Deployment", Some("controller"))?;
    let pod_spec = &deployment["spec"]["template"]["spec"];
    let account = pod_spec["serviceAccountName"].as_str().context("no serviceAccountName")?;
    let lease_name = env_value(&pod_spec["containers"][0], "GPU_DRA_LEADER_ELECT_LEASE_NAME").context("no lease")?;

    // Exactly these grants (a change to the chart's RBAC must change this table too).
    let cluster_role = object(applied, "ClusterRole", Some("controller"))?;
    let granted = rules(cluster_role);
    let expected = rows(&[
        ("", "pods", "get,list,watch"),
        ("", "pods/status", "patch"),
        ("resource.k8s.io", "resourceclaims", "create,delete,get,list,patch,watch"),
        ("resource.k8s.io", "resourceclaims/status", "patch"),
        ("resource.k8s.io", "resourceclaims/binding", "patch"),
        ("resource.k8s.io", "resourceclaimtemplates", "list,watch"),
        ("scheduling.k8s.io", "podgroups", "get,list,watch"),
        ("scheduling.k8s.io", "podgroups/status", "patch"),
        ("", "resourcequotas", "list,watch"),
        ("events.k8s.io", "events", "create,patch"),
    ]);
    ensure!(granted == expected, "controller ClusterRole {granted:?}");
    let role = rules(object(applied, "Role", Some("controller"))?);
    let lease_rule = format!("leases[{lease_name}]");
    let expected = rows(&[
        ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", lease_rule.as_str(), "get,update"),
    ]);
    ensure!(role == expected, "controller Role {role:?}");

    let token = token(ctx, account, None).await?;
    // The token also makes a kubeconfig, for checking what the account is refused.
    let kubeconfig = ctx.cluster.kubeconfig_for_token(&format!("{ns}-controller"), &token)?;
    let identity = format!("{account}-7d9f8-x2x4q");
    let fields = HashMap::from([("metadata.name", identity.clone()), ("metadata.namespace", ns.to_string())]);
    let mut args = command_line(&pod_spec["containers"][0], "controller", &fields, &HashMap::new())?;
    ensure!(args.iter().any(|a| a == "--leader-elect=true"), "leader election is not on: {args:?}");
    args.extend(["--namespace".to_string(), ns.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // As the Deployment runs it: in-cluster configuration from the service account's files, no kubeconfig.
    let account_files = InClusterAccount { token, namespace: ns.to_string() };
    let mut controller = Component::start_in_cluster(&ctx.cluster, &account_files, &format!("{ns}-controller"), &args)?;
    controller.wait_ready().await?;
    let configured = format!("namespace={ns}");
    ensure!(
        controller.log_text().lines().any(|l| l.contains("API server configuration") && l.contains(&configured)),
        "the controller did not take its namespace from the service account files:\n{}",
        controller.log_tail()
    );

    create_template(ctx, "one-gpu", one_gpu()).await?;
    create_pod(ctx, "trainer", json!([{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}])).await?;
    let pods = objects::pods(ctx);
    let recorded = wait::until("the pod to record its claim", SETTLE, || async {
        let pod = pods.get("trainer").await?;
        Ok(claim_statuses(&pod).first().and_then(|(_, claim)| claim.clone()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    let claim = objects::claims(ctx).get(&recorded).await?;
    ensure!(claim.metadata.owner_references.is_some_and(|o| o[0].name == "trainer"), "claim {recorded} not the pod's");
    ensure!(
        !controller.log_text().contains("cannot watch ResourceQuotas"),
        "the controller's ServiceAccount cannot watch ResourceQuotas:\n{}",
        controller.log_tail()
    );
    wait::until("the ResourceClaimCreated event", SETTLE, || async {
        Ok(events_about(ctx, "trainer").await?.into_iter().find(|(_, reason, _)| reason == "ResourceClaimCreated"))
    })
    .await?;
    let lease = Api::<Lease>::namespaced(ctx.client.clone(), ns).get(lease_name).await?;
    let holder = lease.spec.and_then(|s| s.holder_identity);
    ensure!(holder.as_deref() == Some(identity.as_str()), "Lease {lease_name} held by {holder:?}");
    super::podgroup::pod_group_claim_end_to_end(ctx, &controller).await?;

    // Outside the grant.
    let client = client_for(&kubeconfig).await?;
    let message = forbidden(
        "delete a pod",
        Api::<Pod>::namespaced(client.clone(), ns).delete("trainer", &Default::default()).await,
    )?;
    ensure!(message.contains("cannot delete resource \"pods\""), "{message}");
    forbidden("list secrets", Api::<Secret>::namespaced(client.clone(), ns).list(&ListParams::default()).await)?;
    forbidden("list ResourceSlices", Api::<ResourceSlice>::all(client.clone()).list(&ListParams::default()).await)?;
    forbidden("read another Lease", Api::<Lease>::namespaced(client.clone(), ns).get("kube-controller-manager").await)?;
    // The claim allocated, reserved and protected as the scheduler does it, then the pod deleted: the controller drops the
    // reservation (1.36+ authorizes that change twice: resourceclaims/status and the synthetic
    // resourceclaims/binding) and the claim goes.
    let trainer_uid = pods.get("trainer").await?.metadata.uid.context("pod without uid")?;
    let status = json!({"status": {
        "allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.gpu-dra.dev", "pool": "some-node", "device": "gpu-0"}]}},
        "reservedFor": [{"resource": "pods", "name": "trainer", "uid": trainer_uid}]
    }});
    let protect = json!({"metadata": {"finalizers": ["resource.kubernetes.io/delete-protection"]}});
    objects::claims(ctx).patch(&recorded, &PatchParams::default(), &Patch::Merge(&protect)).await?;
    objects::claims(ctx).patch_status(&recorded, &PatchParams::default(), &Patch::Merge(&status)).await?;
    pods.delete("trainer", &Default::default()).await?;
    wait::until("the deleted pod's claim to be released and deleted", SETTLE, || async {
        Ok(objects::claims(ctx).get_opt(&recorded).await?.is_none().then_some(()))
    })
    .await
    .with_context(|| controller.log_tail())?;
    ensure!(
        !controller.log_text().contains("forbidden"),
        "the controller was refused something:\n{}",
        controller.log_tail()
    );

    // Shutdown releases the Lease (get and update on it).
    let status = controller.terminate()?;
    ensure!(status.success(), "controller exited with {status}");
    let lease = Api::<Lease>::namespaced(ctx.client.clone(), ns).get(lease_name).await?;
    ensure!(lease.spec.and_then(|s| s.holder_identity).is_none(), "the Lease was not released");
    Ok(())
}

pub(super) async fn node_agent_works_under_its_service_account_and_is_refused_the_rest(
    ctx: TestContext,
) -> anyhow::Result<()> {
    with_simulated_agent_chart(&ctx, async |applied, class| node_agent_under_its_account(&ctx, applied, class).await)
        .await
}

/// The chart with the node agent only (two simulated GPUs, the GPU DeviceClass named after the test's namespace)
/// applied around `check(applied objects, class)`.
pub(super) async fn with_simulated_agent_chart(
    ctx: &TestContext,
    check: impl AsyncFnOnce(&[Value], &str) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let class = ctx.namespace.clone();
    let class_set = format!("deviceClasses.gpu.name={class}");
    let mig_class_set = format!("deviceClasses.mig.name={class}-mig");
    let sets = [
        "controller.enabled=false",
        "nodeAgent.gpuBackend=simulated",
        "nodeAgent.simulatedGpus=2xH100-80GB",
        &class_set,
        &mig_class_set,
    ];
    with_chart_applied(ctx, &sets, async |applied| check(applied, &class).await).await
}

/// A pod object of the agent's ServiceAccount bound to `node` (it never runs: there is no kubelet) and a token
/// bound to it, which therefore carries the node's name, as the projected token of a DaemonSet pod does.
pub(super) async fn node_bound_token(ctx: &TestContext, account: &str, node: &str) -> anyhow::Result<String> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("node-agent-{node}")},
        "spec": {"serviceAccountName": account, "nodeName": node, "automountServiceAccountToken": false,
                 "containers": [{"name": "node-agent", "image": "gpu-dra:test"}]}
    }))?;
    let pod = objects::pods(ctx).create(&PostParams::default(), &pod).await?;
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    token(ctx, account, Some((&name, &uid))).await
}

pub(super) fn slice(name: &str, node: &str, driver: &str) -> anyhow::Result<ResourceSlice> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": []}
    }))?)
}

/// Waits until the admission policy is in force (the API server loads it asynchronously): a ResourceSlice of
/// `other` node written with `client` is refused. Returns the refusal.
pub(super) async fn policy_in_force(ctx: &TestContext, client: &kube::Client, other: &str) -> anyhow::Result<String> {
    let name = format!("{other}-probe");
    wait::until("the admission policy to be in force", SETTLE, || async {
        match Api::<ResourceSlice>::all(client.clone())
            .create(&PostParams::default(), &slice(&name, other, DRIVER)?)
            .await
        {
            Ok(_) => {
                Api::<ResourceSlice>::all(ctx.client.clone()).delete(&name, &DeleteParams::default()).await?;
                Ok(None)
            }
            Err(kube::Error::Api(status))
                if status.code == 403 && status.message.contains("ValidatingAdmissionPolicy") =>
            {
                Ok(Some(status.message))
            }
            Err(err) => Err(err.into()),
        }
    })
    .await
}

async fn node_agent_under_its_account(ctx: &TestContext, applied: &[Value], class: &str) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let node = test_node_name(ctx, "gpu-node");
    ctx.cluster.add_node(&node)?;
    let pod_spec = node_agent_pod_spec(applied)?;
    let account = pod_spec["serviceAccountName"].as_str().context("no serviceAccountName")?;

    let granted = rules(object(applied, "ClusterRole", Some("node-agent"))?);
    let expected = rows(&[
        ("resource.k8s.io", "resourceslices", "create,delete,list,update,watch"),
        ("resource.k8s.io", "resourceclaims", "get"),
        ("", "nodes", "get"),
        ("events.k8s.io", "events", "create,patch"),
    ]);
    ensure!(granted == expected, "node agent ClusterRole {granted:?}");

    let token = node_bound_token(ctx, account, &node).await?;
    let kubeconfig = ctx.cluster.kubeconfig_for_token(&format!("{ns}-node-agent"), &token)?;
    let client = client_for(&kubeconfig).await?;
    // The agent runs under the policy, not before it is in force.
    policy_in_force(ctx, &client, &test_node_name(ctx, "other")).await?;

    let dirs = NodeDirs::new()?;
    std::fs::write(dirs.boot_id_file(), "boot-1\n")?;
    std::fs::create_dir_all(dirs.state())?;
    // A corrupt checkpoint makes the agent rebuild its record (from the CDI specs, with no API call) and publish an
    // Event, which must be granted.
    std::fs::write(dirs.checkpoint(), b"{\"version\": 1, \"checksum\": \"00\", \"checkpo")?;
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    let overrides = HashMap::from([
        ("GPU_DRA_KUBELET_REGISTRY_DIR", path(dirs.registry())),
        ("GPU_DRA_KUBELET_PLUGINS_DIR", path(dirs.plugins())),
        ("GPU_DRA_CDI_DIR", path(dirs.cdi())),
        ("GPU_DRA_STATE_DIR", path(dirs.state())),
        ("GPU_DRA_MPS_DIR", path(dirs.mps())),
    ]);
    let fields = HashMap::from([("spec.nodeName", node.clone())]);
    let mut args = command_line(&pod_spec["containers"][0], "node-agent", &fields, &overrides)?;
    args.push(format!("--boot-id-file={}", dirs.boot_id_file().display()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = Component::start(&kubeconfig, &format!("{ns}-node-agent"), &args)?;
    agent.wait_ready().await?;

    let selector = format!("spec.nodeName={node},spec.driver={DRIVER}");
    let slices = Api::<ResourceSlice>::all(ctx.client.clone());
    wait::until("the agent's ResourceSlice", SETTLE, || async {
        let list = slices.list(&ListParams::default().fields(&selector)).await?.items;
        Ok(list.iter().any(|s| s.spec.devices.as_ref().is_some_and(|d| d.len() == 2)).then_some(()))
    })
    .await
    .with_context(|| agent.log_tail())?;
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(ctx.client.clone(), "default");
    wait::until("the CheckpointCorrupt event", SETTLE, || async {
        let list = events.list(&ListParams::default()).await?.items;
        Ok(list
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("CheckpointCorrupt")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node.as_str())
            })
            .map(|_| ()))
    })
    .await
    .with_context(|| agent.log_tail())?;

    // The scheduler allocates through the chart's DeviceClass; the agent prepares.
    let mut kubelet = Kubelet::register(&dirs).await?;
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "pair"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": class, "count": 2}}]}}
    }))?;
    objects::claims(ctx).create(&PostParams::default(), &claim).await?;
    objects::create_pod_on(ctx, "trainer", &node, json!([{"name": "gpus", "resourceClaimName": "pair"}])).await?;
    let claims = objects::claims(ctx);
    let uid = wait::until("the scheduler to allocate the claim", SETTLE, || async {
        let claim = claims.get("pair").await?;
        let status = claim.status.unwrap_or_default();
        let allocated = status.allocation.and_then(|a| a.devices).and_then(|d| d.results).unwrap_or_default();
        Ok((allocated.len() == 2 && status.reserved_for.is_some_and(|r| !r.is_empty()))
            .then(|| claim.metadata.uid.unwrap_or_default()))
    })
    .await?;
    let answer = kubelet.prepare(&[(ns, "pair", &uid)]).await?;
    let prepared = answer.get(&uid).context("no answer")?;
    ensure!(prepared.error.is_empty() && prepared.devices.len() == 2, "prepare: {prepared:?}");
    ensure!(dirs.cdi_spec(&uid).exists(), "no CDI spec written");
    let unprepared = kubelet.unprepare(&[(ns, "pair", &uid)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "unprepare: {unprepared:?}");

    // Outside the grant.
    let message =
        forbidden("list secrets", Api::<Secret>::namespaced(client.clone(), ns).list(&ListParams::default()).await)?;
    ensure!(message.contains("cannot list resource \"secrets\""), "{message}");
    forbidden("read a pod", Api::<Pod>::namespaced(client.clone(), ns).get("trainer").await)?;
    // Claims are read one by one, by the name the kubelet gives: never listed or watched, here or cluster-wide.
    let all_claims = Api::<ResourceClaim>::all(client.clone());
    forbidden("list every ResourceClaim", all_claims.list(&ListParams::default()).await)?;
    let own_claims = Api::<ResourceClaim>::namespaced(client.clone(), ns);
    forbidden("list the namespace's claims", own_claims.list(&ListParams::default()).await)?;
    watch_forbidden("watch every ResourceClaim", &all_claims).await?;
    forbidden(
        "delete a claim",
        Api::<ResourceClaim>::namespaced(client.clone(), ns).delete("pair", &DeleteParams::default()).await,
    )?;

    // A GPU's fault changes the pool's one slice: updated in place under the grant, same name and generation, not
    // republished as a new generation (whatever the API server keeps of the taint: before 1.36 it drops it).
    let pool = |list: Vec<ResourceSlice>| -> Vec<(String, i64, String)> {
        list.iter()
            .map(|s| {
                let hash = s.annotations().get("gpu-dra.dev/devices-hash").cloned().unwrap_or_default();
                (s.name_any(), s.spec.pool.generation, hash)
            })
            .collect()
    };
    let before = pool(slices.list(&ListParams::default().fields(&selector)).await?.items);
    ensure!(before.len() == 1, "the pool of two GPUs is one slice: {before:?}");
    support::node::inject_fault(&dirs.state(), "gpu-1 xid 48")?;
    let after = wait::until("the faulted GPU's slice to change", SETTLE, || async {
        let now = pool(slices.list(&ListParams::default().fields(&selector)).await?.items);
        Ok((now != before).then_some(now))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(
        after.len() == 1 && after[0].0 == before[0].0 && after[0].1 == before[0].1,
        "the slice was not updated in place: {before:?} became {after:?}\n{}",
        agent.log_tail()
    );
    ensure!(!agent.log_text().contains("forbidden"), "the agent was refused something:\n{}", agent.log_tail());

    // An older ClusterRole without `update` (a newer image beside an older chart's RBAC): the next change still
    // reaches the scheduler, as a new generation, and the agent names the verb to grant.
    let role_name = object(applied, "ClusterRole", Some("node-agent"))?["metadata"]["name"]
        .as_str()
        .context("ClusterRole name")?
        .to_string();
    let roles = Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(ctx.client.clone());
    let mut role = roles.get(&role_name).await?;
    for rule in role.rules.iter_mut().flatten() {
        rule.verbs.retain(|verb| verb != "update");
    }
    roles.replace(&role_name, &PostParams::default(), &role).await?;
    // In force once the agent's own credentials are refused an update (dry run).
    let as_agent = Api::<ResourceSlice>::all(client.clone());
    let dry_run = PostParams { dry_run: true, ..Default::default() };
    wait::until("update to be refused to the agent", SETTLE, || async {
        let current = slices.get(&after[0].0).await?;
        match as_agent.replace(&after[0].0, &dry_run, &current).await {
            Err(kube::Error::Api(status)) if status.code == 403 => Ok(Some(())),
            _ => Ok(None),
        }
    })
    .await?;
    support::node::inject_fault(&dirs.state(), "gpu-0 xid 48")?;
    let republished = wait::until("the next change, as a new generation", SETTLE, || async {
        let now = pool(slices.list(&ListParams::default().fields(&selector)).await?.items);
        Ok((now != after && now.len() == 1 && now[0].1 > after[0].1).then_some(now))
    })
    .await
    .with_context(|| agent.log_tail())?;
    ensure!(
        agent.log_text().contains("may not update ResourceSlices in place (grant the verb update"),
        "the agent did not say what to grant ({republished:?}):\n{}",
        agent.log_tail()
    );
    let status = agent.terminate()?;
    ensure!(status.success(), "agent exited with {status}");
    Ok(())
}

/// A watch refused with 403, whether the refusal comes as the answer to the request or as the stream's first item.
async fn watch_forbidden(what: &str, api: &Api<ResourceClaim>) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    let stream = match api.watch(&kube::api::WatchParams::default(), "0").await {
        Err(err) => return forbidden(what, Err::<(), _>(err)).map(drop),
        Ok(stream) => stream,
    };
    let first = std::pin::pin!(stream).next().await;
    match first {
        Some(Err(kube::Error::Api(status))) if status.code == 403 => Ok(()),
        Some(Ok(kube::api::WatchEvent::Error(status))) if status.code == 403 => Ok(()),
        other => bail!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}
