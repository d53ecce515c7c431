//! The Pod Security Standards the chart's pods meet, checked by the API server's own PodSecurity admission: the
//! controller runs in a namespace that enforces `restricted`; the node agent needs `privileged` (host paths for the
//! kubelet's plugin directories, the CDI and state directories; privileged for NVML), as charts/README.md tells
//! operators to label the release's namespace. Each pod template is created as a Pod with a server-side dry run in
//! namespaces enforcing each level.

use super::*;

pub(super) async fn pods_meet_the_pod_security_levels_the_docs_name(ctx: TestContext) -> anyhow::Result<()> {
    let namespaces: Vec<(String, &str)> = {
        let mut made = Vec::new();
        for level in ["restricted", "baseline", "privileged"] {
            made.push((namespace_enforcing(&ctx, level).await?, level));
        }
        made
    };
    let result = with_chart_applied(&ctx, &[], async |applied| levels(&ctx, applied, &namespaces).await).await;
    let all = Api::<k8s_openapi::api::core::v1::Namespace>::all(ctx.client.clone());
    for (name, _) in &namespaces {
        let _ = all.delete(name, &DeleteParams::default()).await;
    }
    result
}

async fn levels(ctx: &TestContext, applied: &[Value], namespaces: &[(String, &str)]) -> anyhow::Result<()> {
    let controller = &object(applied, "Deployment", Some("controller"))?["spec"]["template"]["spec"];
    let agent = node_agent_pod_spec(applied)?;
    for (namespace, level) in namespaces {
        let refusal = dry_run_pod(ctx, namespace, controller).await?;
        ensure!(refusal.is_none(), "the controller refused under {level}: {refusal:?}");
        let refusal = dry_run_pod(ctx, namespace, agent).await?;
        match *level {
            "privileged" => ensure!(refusal.is_none(), "the node agent refused under privileged: {refusal:?}"),
            _ => {
                let message = refusal.with_context(|| format!("the node agent was admitted under {level}"))?;
                ensure!(
                    message.contains("violates PodSecurity") && message.contains("hostPath"),
                    "the agent's refusal under {level} does not name its host paths: {message}"
                );
            }
        }
    }
    Ok(())
}

/// A namespace whose PodSecurity admission enforces `level`.
async fn namespace_enforcing(ctx: &TestContext, level: &str) -> anyhow::Result<String> {
    let name = support::unique_name(&format!("pss-{level}"));
    let namespace: k8s_openapi::api::core::v1::Namespace = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"gpu-dra.dev/test": "true",
                                              "pod-security.kubernetes.io/enforce": level}}
    }))?;
    Api::all(ctx.client.clone()).create(&PostParams::default(), &namespace).await?;
    Ok(name)
}

/// Creates a Pod of `spec` in `namespace` with a server-side dry run: `None` when admitted, else the refusal. The
/// ServiceAccount is left out (it lives in the release's namespace; PodSecurity does not look at it).
async fn dry_run_pod(ctx: &TestContext, namespace: &str, spec: &Value) -> anyhow::Result<Option<String>> {
    let mut spec = spec.clone();
    if let Some(spec) = spec.as_object_mut() {
        spec.remove("serviceAccountName");
    }
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "pss-check"}, "spec": spec}))?;
    let params = PostParams { dry_run: true, ..Default::default() };
    match Api::<Pod>::namespaced(ctx.client.clone(), namespace).create(&params, &pod).await {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(status)) if status.code == 403 => Ok(Some(status.message)),
        Err(err) => Err(err.into()),
    }
}
