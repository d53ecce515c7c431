//! The ValidatingAdmissionPolicy keeps a node agent to its own node's ResourceSlices.

use super::identities::{node_bound_token, policy_in_force, slice};
use super::*;

/// The chart is rendered without the namespace it runs in (for `default`) and moved there afterwards, as kustomize's
/// `namespace:` does with `helm template` output (the usual `helmCharts` set-up): the policy must still hold the
/// agent, whose ServiceAccount is then of another namespace than the one rendered. (A policy naming the rendered
/// namespace matched no agent at all there, and every agent could write every node's slices.)
pub(super) async fn admission_policy_keeps_the_node_agent_to_its_own_node(ctx: TestContext) -> anyhow::Result<()> {
    let sets = ["controller.enabled=false", "deviceClasses.gpu.enabled=false", "deviceClasses.mig.enabled=false"];
    let moved = render(&release(&ctx), "default", false, &sets)?
        .replace("namespace: default", &format!("namespace: {}", ctx.namespace));
    let rendered = documents(&moved);
    let applied = apply(&ctx, &rendered)?;
    let result = policy_refusals(&ctx, &applied).await;
    delete(&ctx, &rendered);
    result
}

/// Whether the version under test keeps `perDeviceNodeSelection` (DRAPartitionableDevices: beta, on, from 1.36).
fn per_device_node_selection_served() -> anyhow::Result<bool> {
    Ok(support::cluster::kubernetes_minor()? >= 36)
}

async fn policy_refusals(ctx: &TestContext, applied: &[Value]) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let (own, other) = (test_node_name(ctx, "own"), test_node_name(ctx, "other"));
    ctx.cluster.add_node(&own)?;
    let account = node_agent_pod_spec(applied)?["serviceAccountName"].as_str().context("no account")?;
    let bound = node_bound_token(ctx, account, &own).await?;
    let agent = client_for(&ctx.cluster.kubeconfig_for_token(&format!("{ns}-bound"), &bound)?).await?;
    let unbound = token(ctx, account, None).await?;
    let unbound = client_for(&ctx.cluster.kubeconfig_for_token(&format!("{ns}-unbound"), &unbound)?).await?;
    let as_agent = Api::<ResourceSlice>::all(agent.clone());
    let as_admin = Api::<ResourceSlice>::all(ctx.client.clone());
    let pp = PostParams::default();

    let refusal = policy_in_force(ctx, &agent, &other).await?;
    // A slice on its own node in another node's pool: the scheduler would count those devices, allocated on this
    // node, as used on the other one.
    let message = forbidden(
        "write a slice of another node's pool",
        as_agent.create(&pp, &slice_of(&format!("{own}-e"), json!({"nodeName": own}), &other)?).await,
    )?;
    ensure!(
        message.contains(&format!("may only write the pool named after its node ({own}), not pool {other}")),
        "{message}"
    );
    // Another node's slice: create refused, naming both nodes.
    ensure!(
        refusal.contains(&format!(
            "the node agent on node {own} may only write ResourceSlices of its own node (spec.nodeName {own}), not \
             of node {other}"
        )),
        "{refusal}"
    );
    // Its own node's slice: created and deleted.
    as_agent.create(&pp, &slice(&format!("{own}-a"), &own, DRIVER)?).await.context("create own node's slice")?;
    as_agent.delete(&format!("{own}-a"), &DeleteParams::default()).await.context("delete own node's slice")?;
    // Slices for all nodes, or with per-device node names: none of them is only this node's.
    for (name, selection) in [
        ("f", json!({"allNodes": true})),
        ("g", json!({"perDeviceNodeSelection": true, "devices": [{"name": "gpu-0", "nodeName": other}]})),
        (
            "h",
            json!({"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [own.as_str(), other.as_str()]}]}]}}),
        ),
    ] {
        let written = as_agent.create(&pp, &slice_of(&format!("{own}-{name}"), selection.clone(), &own)?).await;
        if name == "g" && !per_device_node_selection_served()? {
            // Before 1.36 (DRAPartitionableDevices off) the API server drops the field, so the slice names no
            // node at all and is invalid before any policy looks at it.
            match written {
                Err(kube::Error::Api(status))
                    if status.code == 422 && status.message.contains("perDeviceNodeSelection") =>
                {
                    continue;
                }
                other => {
                    bail!("write a slice with {selection} (field dropped before 1.36): expected 422, got {other:?}")
                }
            }
        }
        let message = forbidden(&format!("write a slice with {selection}"), written)?;
        ensure!(
            message.contains("not for several nodes (allNodes, nodeSelector or perDeviceNodeSelection)"),
            "{message}"
        );
    }
    // Such a forgery already on its node (written before this policy): the agent may delete it, as its publisher
    // deletes every slice of its node outside its current pool.
    as_admin.create(&pp, &slice_of(&format!("{own}-i"), json!({"nodeName": own}), &other)?).await?;
    as_agent
        .delete(&format!("{own}-i"), &DeleteParams::default())
        .await
        .context("delete a forged slice on own node")?;
    // Another node's existing slice: delete and update (granted by RBAC for the agent's own slices, updated in
    // place) refused by the policy.
    as_admin.create(&pp, &slice(&format!("{other}-b"), &other, DRIVER)?).await?;
    let message = forbidden(
        "delete another node's slice",
        as_agent.delete(&format!("{other}-b"), &DeleteParams::default()).await,
    )?;
    ensure!(message.contains(&format!("not of node {other}")), "{message}");
    let mut existing = as_admin.get(&format!("{other}-b")).await?;
    existing.metadata.annotations = Some([("forged".to_string(), "yes".to_string())].into());
    let message =
        forbidden("update another node's slice", as_agent.replace(&format!("{other}-b"), &pp, &existing).await)?;
    ensure!(message.contains(&format!("not of node {other}")), "{message}");
    // Its own node, another driver's slice.
    let message = forbidden(
        "write another driver's slice",
        as_agent.create(&pp, &slice(&format!("{own}-c"), &own, "other.example.com")?).await,
    )?;
    ensure!(message.contains(&format!("only write ResourceSlices of driver {DRIVER}")), "{message}");
    // A token of the same account that is bound to no pod carries no node: no slice at all.
    let message = forbidden(
        "write a slice without a node-bound token",
        Api::<ResourceSlice>::all(unbound).create(&pp, &slice(&format!("{own}-d"), &own, DRIVER)?).await,
    )?;
    ensure!(message.contains("carry no node name"), "{message}");
    // The admin (anyone but the agent's account) is not restricted.
    as_admin.delete(&format!("{other}-b"), &DeleteParams::default()).await?;
    Ok(())
}

/// A slice of `DRIVER` in `pool` with the node selection (and devices) of `selection`.
fn slice_of(name: &str, selection: Value, pool: &str) -> anyhow::Result<ResourceSlice> {
    let mut spec =
        json!({"driver": DRIVER, "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1}, "devices": []});
    for (key, value) in selection.as_object().context("selection is an object")? {
        spec[key] = value.clone();
    }
    Ok(serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec}))?)
}
