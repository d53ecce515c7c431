//! Lint, render, schema and server-side apply of the chart, and what the API server stored.

use super::*;

pub(super) async fn lints_and_renders_with_default_and_all_on_values(_ctx: TestContext) -> anyhow::Result<()> {
    let chart = chart_dir();
    let chart = chart.to_str().context("chart path")?;
    let values = all_on_values();
    let values = values.to_str().context("values path")?;
    for args in [vec!["lint", "--strict", chart], vec!["lint", "--strict", chart, "-f", values]] {
        let output = helm(&args)?;
        ensure!(output.status.success(), "helm {}:\n{}{}", args.join(" "), text(&output.stdout), text(&output.stderr));
    }

    let default = kinds(&render("gpu-dra", "gpu-dra", false, &[])?);
    let expected: BTreeMap<String, usize> = [
        ("ClusterRole", 2),
        ("ClusterRoleBinding", 2),
        ("DaemonSet", 1),
        ("Deployment", 1),
        ("DeviceClass", 1),
        ("PodDisruptionBudget", 1),
        ("Role", 1),
        ("RoleBinding", 1),
        ("Service", 2),
        ("ServiceAccount", 2),
        ("ValidatingAdmissionPolicy", 1),
        ("ValidatingAdmissionPolicyBinding", 1),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_string(), n))
    .collect();
    ensure!(default == expected, "default values render {default:?}");
    let all_on = kinds(&render("gpu-dra", "gpu-dra", true, &[])?);
    let mut expected_all_on = expected.clone();
    expected_all_on.insert("ServiceMonitor".into(), 2);
    expected_all_on.insert("DeviceClass".into(), 2);
    ensure!(all_on == expected_all_on, "all-on values render {all_on:?}");
    let off = kinds(&render(
        "gpu-dra",
        "gpu-dra",
        false,
        &["controller.enabled=false", "nodeAgent.enabled=false", "deviceClasses.gpu.enabled=false"],
    )?);
    ensure!(off.is_empty(), "everything off still renders {off:?}");

    // The Kubernetes floor of Chart.yaml.
    let old = helm(&["template", "gpu-dra", chart, "--kube-version", "1.33.5"])?;
    ensure!(
        !old.status.success() && text(&old.stderr).contains("requires kubeVersion: >=1.34.0-0"),
        "a 1.33 cluster is not refused: {}",
        text(&old.stderr)
    );
    // NOTES.txt renders and tells the operator how to check the install.
    let install = helm(&["install", "gpu-dra", chart, "--namespace", "gpu-dra", "--dry-run=client"])?;
    let notes = text(&install.stdout);
    ensure!(install.status.success(), "helm install --dry-run=client: {}", text(&install.stderr));
    for check in [
        "kubectl get pods -n gpu-dra",
        "kubectl get resourceslices --field-selector spec.driver=gpu.gpu-dra.dev",
        "kubectl get deviceclass gpu.gpu-dra.dev",
        "resourceClaimTemplateName: one-gpu",
        "--controllers=*,-resourceclaim-controller",
    ] {
        ensure!(notes.contains(check), "NOTES lack {check:?}:\n{notes}");
    }
    Ok(())
}

pub(super) async fn schema_refuses_wrong_values_naming_them(_ctx: TestContext) -> anyhow::Result<()> {
    let chart = chart_dir();
    let chart = chart.to_str().context("chart path")?;
    for (set, expected) in [
        ("controller.replicas=two", "at '/controller/replicas': got string, want integer"),
        ("controller.replica=2", "at '/controller': additional properties 'replica' not allowed"),
        ("nodeAgent.gpuBackend=cuda", "at '/nodeAgent/gpuBackend'"),
        ("nodeAgent.gpuBackend=simulated", "at '/nodeAgent/simulatedGpus'"),
        ("driverName=GPU_driver", "at '/driverName'"),
        ("nodeAgent.kubeletDir=var/lib/kubelet", "at '/nodeAgent/kubeletDir'"),
        ("controller.leaderElection.leaseDuration=15", "at '/controller/leaderElection/leaseDuration'"),
        ("controller.resources.requests.memory=lots", "at '/controller/resources/requests/memory'"),
        ("nodeAgent.tolerations[0].operator=Maybe", "at '/nodeAgent/tolerations/0/operator'"),
        ("deviceClasses.gpu.extendedResourceName=gpu", "at '/deviceClasses/gpu/extendedResourceName'"),
    ] {
        let output = helm(&["template", "gpu-dra", chart, "--set", set])?;
        let stderr = text(&output.stderr);
        ensure!(
            !output.status.success() && stderr.contains("don't meet the specifications of the schema"),
            "--set {set} was not refused by the schema: {stderr}"
        );
        ensure!(stderr.contains(expected), "--set {set}: the refusal does not name the value ({expected}):\n{stderr}");
    }
    Ok(())
}

pub(super) async fn every_rendered_object_is_accepted_by_the_api_server(ctx: TestContext) -> anyhow::Result<()> {
    let monitors_served = kube::discovery::pinned_kind(
        &ctx.client,
        &kube::api::GroupVersionKind::gvk("monitoring.coreos.com", "v1", "ServiceMonitor"),
    )
    .await
    .is_ok();
    let suffix = &ctx.namespace[ctx.namespace.len() - 6..];
    for (name, all_on) in [("default", false), ("all-on", true)] {
        // Unique names for what is cluster-scoped: the release (RBAC, policy) and the driver (DeviceClasses).
        let driver = format!("{name}-{suffix}.gpu-dra.dev");
        let driver_set = format!("driverName={driver}");
        let release = format!("{name}-{suffix}");
        let rendered = documents(&render(&release, &ctx.namespace, all_on, &[&driver_set])?);
        let (monitors, documents): (Vec<_>, Vec<_>) =
            rendered.into_iter().partition(|(kind, _)| kind == "ServiceMonitor" && !monitors_served);
        if !monitors.is_empty() {
            eprintln!(
                "{name}: {} ServiceMonitor(s) rendered and NOT applied: the test cluster serves no \
                 monitoring.coreos.com/v1 (the Prometheus Operator's CRDs are not installed)",
                monitors.len()
            );
        }
        let applied = apply(&ctx, &documents)?;
        let result = check_applied(&applied, &release, &driver, all_on);
        delete(&ctx, &documents);
        result.with_context(|| format!("{name} values"))?;
        eprintln!("{name}: {} objects accepted by a server-side apply", applied.len());
    }
    Ok(())
}

/// What must hold of the objects the server stored.
fn check_applied(applied: &[Value], release: &str, driver: &str, all_on: bool) -> anyhow::Result<()> {
    for o in applied {
        let labels = &o["metadata"]["labels"];
        ensure!(
            labels["app.kubernetes.io/name"] == "gpu-dra"
                && labels["app.kubernetes.io/instance"] == release
                && labels["app.kubernetes.io/managed-by"] == "Helm"
                && labels["app.kubernetes.io/version"].is_string()
                && labels["helm.sh/chart"].is_string(),
            "{} {} lacks the standard labels: {labels}",
            o["kind"],
            o["metadata"]["name"]
        );
    }

    let deployment = object(applied, "Deployment", Some("controller"))?;
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    ensure!(deployment["spec"]["replicas"] == if all_on { 3 } else { 2 }, "replicas {}", deployment["spec"]);
    let security = &container["securityContext"];
    ensure!(
        pod["securityContext"]["runAsNonRoot"] == true
            && pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
            && security["runAsNonRoot"] == true
            && security["readOnlyRootFilesystem"] == true
            && security["allowPrivilegeEscalation"] == false
            && security["capabilities"]["drop"] == json!(["ALL"]),
        "controller security context: pod {} container {security}",
        pod["securityContext"]
    );
    let pod_name = container["env"].as_array().and_then(|env| env.iter().find(|v| v["name"] == "POD_NAME"));
    ensure!(
        pod_name.is_some_and(|v| v["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"),
        "POD_NAME not from the downward API: {}",
        container["env"]
    );
    check_probes(container, 8080)?;
    let pdb = object(applied, "PodDisruptionBudget", Some("controller"))?;
    ensure!(pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"], "{pdb}");

    let daemonset = object(applied, "DaemonSet", Some("node-agent"))?;
    let pod = &daemonset["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    ensure!(daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate", "{}", daemonset["spec"]);
    check_probes(container, 8081)?;
    let excluded = json!({"key": "nvidia.com/gpu.deploy.device-plugin", "operator": "NotIn", "values": ["true"]});
    let terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        .as_array()
        .context("no required node affinity")?;
    ensure!(
        !terms.is_empty()
            && terms.iter().all(|t| t["matchExpressions"].as_array().is_some_and(|e| e.contains(&excluded))),
        "device-plugin nodes not excluded from every term: {terms:?}"
    );
    if !all_on {
        ensure!(
            pod["nodeSelector"] == json!({"feature.node.kubernetes.io/pci-10de.present": "true"})
                && container["securityContext"]["privileged"] == true,
            "node agent defaults: {pod}"
        );
    } else {
        ensure!(terms[0]["matchExpressions"][0]["key"] == "kubernetes.io/arch", "the user's term was lost: {terms:?}");
    }
    // Each host directory the agent writes is mounted at the host's own path (socket paths announced to the
    // kubelet and paths in CDI specs are resolved on the host), and the agent is told that path.
    let mounts = container["volumeMounts"].as_array().context("no volume mounts")?;
    let volumes = pod["volumes"].as_array().context("no volumes")?;
    let host_path = |mount: &Value| {
        volumes.iter().find(|v| v["name"] == mount["name"]).and_then(|v| v["hostPath"]["path"].as_str())
    };
    for (env, path) in [
        ("GPU_DRA_KUBELET_REGISTRY_DIR", "/var/lib/kubelet/plugins_registry"),
        ("GPU_DRA_KUBELET_PLUGINS_DIR", "/var/lib/kubelet/plugins"),
        ("GPU_DRA_CDI_DIR", "/var/run/cdi"),
        ("GPU_DRA_STATE_DIR", "/var/lib/gpu-dra"),
    ] {
        let mount = mounts.iter().find(|m| m["mountPath"] == path).with_context(|| format!("{path} not mounted"))?;
        ensure!(
            env_value(container, env) == Some(path) && host_path(mount) == Some(path) && mount["readOnly"] != true,
            "{env}: {mount} / {:?}",
            env_value(container, env)
        );
    }
    let dev = mounts.iter().find(|m| m["mountPath"] == "/dev").context("/dev not mounted")?;
    let root = mounts.iter().find(|m| m["mountPath"] == "/driver-root").context("driver root not mounted")?;
    let host_root = if all_on { "/run/nvidia/driver" } else { "/" };
    ensure!(dev["readOnly"] == true && host_path(dev) == Some("/dev"), "/dev: {dev}");
    ensure!(
        root["readOnly"] == true
            && root["mountPropagation"] == "HostToContainer"
            && host_path(root) == Some(host_root)
            && env_value(container, "GPU_DRA_DRIVER_ROOT") == Some("/driver-root")
            && env_value(container, "GPU_DRA_HOST_DRIVER_ROOT") == Some(host_root),
        "driver root: {root}"
    );
    ensure!(
        mounts.iter().all(|m| m["mountPropagation"] != "Bidirectional"),
        "a Bidirectional mount needs privilege the agent does not need: {mounts:?}"
    );
    ensure!(
        container["terminationMessagePath"] != "/dev/termination-log",
        "the runtime cannot create /dev/termination-log in the read-only host /dev"
    );
    ensure!(env_value(container, "GPU_DRA_DRIVER_NAME") == Some(driver), "driver name: {}", container["env"]);

    let class = applied
        .iter()
        .find(|o| o["kind"] == "DeviceClass" && o["metadata"]["name"] == driver)
        .context("no DeviceClass named after the driver")?;
    let selector = format!("device.driver == '{driver}' && device.attributes['{driver}'].type == 'gpu'");
    ensure!(class["spec"]["selectors"][0]["cel"]["expression"] == selector.as_str(), "{class}");
    if all_on {
        // Kept by the server: extendedResourceName is served (DRAExtendedResource, GA in 1.37).
        ensure!(class["spec"]["extendedResourceName"] == "nvidia.com/gpu", "extendedResourceName dropped: {class}");
    }
    Ok(())
}

fn check_probes(container: &Value, port: u16) -> anyhow::Result<()> {
    let metrics = container["ports"].as_array().and_then(|p| p.iter().find(|p| p["name"] == "metrics"));
    ensure!(metrics.is_some_and(|p| p["containerPort"] == port), "metrics port: {}", container["ports"]);
    ensure!(
        container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            && container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            && container["livenessProbe"]["httpGet"]["port"] == "metrics"
            && container["readinessProbe"]["httpGet"]["port"] == "metrics",
        "probes: {container}"
    );
    let addr = env_value(container, "GPU_DRA_METRICS_ADDR").unwrap_or_default();
    ensure!(addr.ends_with(&format!(":{port}")), "GPU_DRA_METRICS_ADDR {addr} is not the metrics port {port}");
    Ok(())
}
