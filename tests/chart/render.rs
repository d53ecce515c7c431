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

    let rendered = render("gpu-dra", "gpu-dra", false, &[])?;
    // Both components outrank workloads: without the agent a node's GPU pods cannot start or stop, and without the
    // controller (kube-controller-manager's claim controller turned off) no template pod starts anywhere.
    for (kind, class) in [("Deployment", "system-cluster-critical"), ("DaemonSet", "system-node-critical")] {
        let doc = documents(&rendered).into_iter().find(|(k, _)| k == kind).map(|(_, d)| d).unwrap_or_default();
        ensure!(doc.contains(&format!("priorityClassName: {class}")), "the {kind} does not run at {class}:\n{doc}");
    }
    // Listing pods is granted to the node agent only where it unprepares stale claims (it looks for their users).
    let agent_role = |rendered: &str| {
        let documents = documents(rendered);
        let role = documents.into_iter().find(|(k, d)| k == "ClusterRole" && d.contains("component: node-agent"));
        role.map(|(_, doc)| doc).unwrap_or_default()
    };
    let pods_rule = "resources: [\"pods\"]\n    verbs: [\"list\"]";
    ensure!(!agent_role(&rendered).contains(pods_rule), "the node agent may list pods by default");
    let unprepares = render("gpu-dra", "gpu-dra", false, &["nodeAgent.staleClaims.action=unprepare"])?;
    ensure!(agent_role(&unprepares).contains(pods_rule), "unprepare without list pods:\n{}", agent_role(&unprepares));
    let default = kinds(&rendered);
    let expected: BTreeMap<String, usize> = [
        ("ClusterRole", 2),
        ("ClusterRoleBinding", 2),
        ("DaemonSet", 1),
        ("Deployment", 1),
        ("DeviceClass", 2),
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
    // The GPU, MIG and extra classes, and one MIG class per profile listed.
    expected_all_on.insert("DeviceClass".into(), 5);
    // GKE's admission of the system-critical classes in the release's namespace.
    expected_all_on.insert("ResourceQuota".into(), 1);
    ensure!(all_on == expected_all_on, "all-on values render {all_on:?}");
    // The quota names exactly the classes of the components rendered.
    let quota_classes = |sets: &[&str]| -> anyhow::Result<Vec<String>> {
        let rendered = render("gpu-dra", "gpu-dra", false, sets)?;
        let quota = documents(&rendered).into_iter().find(|(k, _)| k == "ResourceQuota").map(|(_, d)| d);
        let quota = quota.unwrap_or_default();
        let values = quota.split("values:").nth(1).unwrap_or_default();
        Ok(values
            .lines()
            .filter_map(|l| l.trim().strip_prefix("- "))
            .map(|v| v.trim_matches('"').to_string())
            .collect())
    };
    let on = "priorityClassQuota.enabled=true";
    ensure!(
        quota_classes(&[on])? == ["system-cluster-critical", "system-node-critical"],
        "{:?}",
        quota_classes(&[on])?
    );
    let agent_only = quota_classes(&[on, "controller.enabled=false"])?;
    ensure!(agent_only == ["system-node-critical"], "the agent alone: {agent_only:?}");
    let off = kinds(&render(
        "gpu-dra",
        "gpu-dra",
        false,
        &[
            "controller.enabled=false",
            "nodeAgent.enabled=false",
            "deviceClasses.gpu.enabled=false",
            "deviceClasses.mig.enabled=false",
        ],
    )?);
    ensure!(off.is_empty(), "everything off still renders {off:?}");

    // A release name of 37 characters or more still names every Service within 63 (a DNS label): the longest
    // suffix, "-controller-metrics", is 19 characters after the 44 of the prefix.
    let long = "team-ml-platform-production-eu-west-1-gpus";
    for (kind, doc) in documents(&render(long, "gpu-dra", true, &[])?).into_iter().filter(|(k, _)| k == "Service") {
        let name = doc.lines().find_map(|l| l.strip_prefix("  name: ")).unwrap_or_default().trim().trim_matches('"');
        ensure!(name.len() <= 63, "the {kind} {name} has {} characters, more than 63", name.len());
    }

    // A driver name whose sockets the agent could not bind (sun_path: 107 bytes) is refused at install.
    let long = format!("driverName={}.example.com", "d".repeat(40));
    let refused = helm(&["template", "gpu-dra", chart, "--set", &long])?;
    ensure!(
        !refused.status.success() && text(&refused.stderr).contains("more than the 107 a unix socket path may have"),
        "a driver name too long for the agent's socket paths is not refused: {}",
        text(&refused.stderr)
    );
    // At the limit the chart and the agent agree: the longest driver name the chart takes is one the agent can bind
    // (its registration socket, <kubeletDir>/plugins_registry/<driver>/<driver>-reg.sock, is the longer).
    for (length, fits) in [(31, true), (32, false)] {
        let driver = format!("{}.example.com", "d".repeat(length - ".example.com".len()));
        let rendered = helm(&["template", "gpu-dra", chart, "--set", &format!("driverName={driver}")])?;
        let registry = format!("/var/lib/kubelet/plugins_registry/{driver}");
        let bindable = gpu_dra::kubelet_plugin::SocketPaths::new(
            Path::new(&registry),
            Path::new("/var/lib/kubelet/plugins"),
            &driver,
        );
        ensure!(
            rendered.status.success() == fits && bindable.is_ok() == fits,
            "a driver name of {length} characters: chart renders {}, agent binds {bindable:?}: {}",
            rendered.status.success(),
            text(&rendered.stderr)
        );
    }
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
    // Which nodes get an agent, in the operator's words, for the values that choose them.
    for (set, lines) in [
        (
            "",
            &[
                "only runs on nodes\n     matching one of these node affinity terms:",
                "- feature.node.kubernetes.io/pci-10de.present In [\"true\"]\n       - nvidia.com/gpu.present In [\"true\"]",
                "Where a classic device plugin serves GPUs (nvidia.com/gpu allocatable), the agent publishes none",
                "--field-selector reason=DevicePluginServesGpus",
            ][..],
        ),
        ("nodeAgent.nodeSelector.gpu=yes", &["with the labels {\"gpu\":\"yes\"}\n     and matching one of"][..]),
        (
            "nodeAgent.affinity=null,nodeAgent.devicePluginNodeLabel=example.com/device-plugin",
            &["only runs on nodes\n     not labeled example.com/device-plugin=true", "operator: NotIn"][..],
        ),
        // The label keeps the agent off those nodes also where the agent only warns beside a device plugin.
        (
            "nodeAgent.affinity=null,nodeAgent.refuseWithDevicePlugin=false,\
             nodeAgent.devicePluginNodeLabel=example.com/device-plugin",
            &["only runs on nodes\n     not labeled example.com/device-plugin=true", "operator: NotIn"][..],
        ),
        ("nodeAgent.affinity=null", &["the DaemonSet runs on every node"][..]),
    ] {
        let mut args = vec!["install", "gpu-dra", chart, "--namespace", "gpu-dra", "--dry-run=client"];
        if !set.is_empty() {
            args.extend(["--set", set]);
        }
        let install = helm(&args)?;
        ensure!(install.status.success(), "helm install --set {set}: {}", text(&install.stderr));
        let notes = text(&install.stdout);
        for line in lines {
            ensure!(notes.contains(line), "with {set:?} the NOTES lack {line:?}:\n{notes}");
        }
    }
    Ok(())
}

/// A parent chart listing this one among its `dependencies` (how Argo CD and Flux users commonly wrap a chart): Helm
/// gives a dependency the parent's `global` values and the switch its `condition` names, which a schema refusing
/// unknown keys refused, so no such parent rendered at all.
pub(super) async fn a_parent_chart_renders_it_as_a_dependency(_ctx: TestContext) -> anyhow::Result<()> {
    let parent = tempfile::tempdir()?;
    copy_dir(&chart_dir(), &parent.path().join("charts/gpu-dra"))?;
    let chart_yaml = std::fs::read_to_string(chart_dir().join("Chart.yaml"))?;
    let version = chart_yaml.lines().find_map(|l| l.strip_prefix("version: ")).context("the chart's version")?;
    std::fs::write(
        parent.path().join("Chart.yaml"),
        format!(
            "apiVersion: v2\nname: platform\nversion: 1.0.0\ndependencies:\n  - name: gpu-dra\n    version: \"{}\"\n    \
             condition: gpu-dra.enabled\n",
            version.trim()
        ),
    )?;
    std::fs::write(parent.path().join("values.yaml"), "global:\n  team: ml\ngpu-dra:\n  enabled: true\n")?;
    let path = parent.path().to_str().context("parent chart path")?;
    let output = helm(&["template", "gpu-dra", path, "--namespace", "gpu-dra"])?;
    ensure!(output.status.success(), "a parent chart depending on gpu-dra: {}", text(&output.stderr));
    let alone = kinds(&render("gpu-dra", "gpu-dra", false, &[])?);
    let rendered = kinds(&text(&output.stdout));
    ensure!(rendered == alone, "as a dependency it rendered {rendered:?}, alone {alone:?}");
    let off = helm(&["template", "gpu-dra", path, "--namespace", "gpu-dra", "--set", "gpu-dra.enabled=false"])?;
    ensure!(off.status.success(), "switched off: {}", text(&off.stderr));
    ensure!(kinds(&text(&off.stdout)).is_empty(), "switched off, it still rendered {:?}", kinds(&text(&off.stdout)));
    Ok(())
}

/// Copies the directory tree `from` to `to` (regular files and directories: a chart).
fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
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
        ("nodeAgent.gpuSharing=half", "at '/nodeAgent/gpuSharing'"),
        ("nodeAgent.migLayout=auto", "at '/nodeAgent/migLayout'"),
        ("driverName=GPU_driver", "at '/driverName'"),
        ("nodeAgent.kubeletDir=var/lib/kubelet", "at '/nodeAgent/kubeletDir'"),
        ("controller.leaderElection.leaseDuration=15", "at '/controller/leaderElection/leaseDuration'"),
        // Names the API server refuses at every try, while the controller stood by Ready and created nothing.
        ("controller.leaderElection.leaseName=GPU_Lease", "at '/controller/leaderElection/leaseName'"),
        ("controller.watchNamespace=Team-A", "at '/controller/watchNamespace'"),
        // The agent removes what it did not make in its MPS directory no more, but refuses one shared with others.
        ("nodeAgent.mpsDir=/run", "at '/nodeAgent/mpsDir'"),
        ("controller.resources.requests.memory=lots", "at '/controller/resources/requests/memory'"),
        ("nodeAgent.tolerations[0].operator=Maybe", "at '/nodeAgent/tolerations/0/operator'"),
        ("deviceClasses.gpu.extendedResourceName=gpu", "at '/deviceClasses/gpu/extendedResourceName'"),
        ("deviceClasses.mig.name=MIG_class", "at '/deviceClasses/mig/name'"),
        ("deviceClasses.mig.profile=1g.10gb", "at '/deviceClasses/mig': additional properties 'profile' not allowed"),
        ("deviceClasses.mig.profiles={1g.10gb+me}", "at '/deviceClasses/mig/profiles/0'"),
        ("deviceClasses.gpu.sharing.timeSlicing.interval=Long", "at '/deviceClasses/gpu/sharing'"),
        ("deviceClasses.mig.sharing.strategy=Shared", "at '/deviceClasses/mig/sharing/strategy'"),
        // A class's sharing as a claim's GpuConfig spells it: a typo failed every prepare of the class, not the install.
        (
            "deviceClasses.gpu.sharing.strategy=TimeSlicing,deviceClasses.gpu.sharing.timeslicing.interval=Long",
            "additional properties 'timeslicing' not allowed",
        ),
        (
            "deviceClasses.gpu.sharing.strategy=TimeSlicing,deviceClasses.gpu.sharing.timeSlicing.interval=Lng",
            "at '/deviceClasses/gpu/sharing/timeSlicing/interval'",
        ),
        (
            "deviceClasses.gpu.sharing.strategy=MPS,deviceClasses.gpu.sharing.mps.defaultActiveThreadPercentage=0",
            "at '/deviceClasses/gpu/sharing/mps/defaultActiveThreadPercentage'",
        ),
        (
            "deviceClasses.gpu.sharing.strategy=Exclusive,deviceClasses.gpu.sharing.mps.defaultActiveThreadPercentage=5",
            "at '/deviceClasses/gpu/sharing/strategy'",
        ),
        // The admission policy would hold every namespace's `default` account to the agent's node.
        ("nodeAgent.serviceAccount.name=default", "at '/nodeAgent/serviceAccount/name'"),
        // With maxSurge 0 the API server refuses maxUnavailable 0 at apply: refused at install instead.
        (
            "nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=0",
            "at '/nodeAgent/updateStrategy/rollingUpdate/maxUnavailable'",
        ),
        (
            "nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=0%",
            "at '/nodeAgent/updateStrategy/rollingUpdate/maxUnavailable'",
        ),
    ] {
        let output = helm(&["template", "gpu-dra", chart, "--set", set])?;
        let stderr = text(&output.stderr);
        ensure!(
            !output.status.success() && stderr.contains("don't meet the specifications of the schema"),
            "--set {set} was not refused by the schema: {stderr}"
        );
        ensure!(stderr.contains(expected), "--set {set}: the refusal does not name the value ({expected}):\n{stderr}");
    }
    // A class's MPS pinned memory limit in each form the agent reads (upstream's quantities), and one it cannot.
    let mps = "deviceClasses.gpu.sharing.strategy=MPS";
    for (limit, taken) in [("1E9", true), ("+512Mi", true), ("1.5e9", true), (".5Gi", true), ("1e999", false)] {
        let set = format!("deviceClasses.gpu.sharing.mps.defaultPinnedDeviceMemoryLimit={limit}");
        let output = helm(&["template", "gpu-dra", chart, "--set", mps, "--set-string", &set])?;
        ensure!(output.status.success() == taken, "--set-string {set}: {}", text(&output.stderr));
    }
    // Large integers in a values file (YAML numbers, floats to Helm) are rendered as the integers the binaries
    // read, not as `1e+06`, which they refused, naming a value nobody wrote.
    let big = tempfile::NamedTempFile::new()?;
    let numbers = "controller:\n  kubeApiBurst: 1000000\n  eventsBurst: 2000000\n  workers: 1000\n  threads: 2\n\
                   nodeAgent:\n  kubeApiBurst: 3000000\n";
    std::fs::write(big.path(), numbers)?;
    let rendered = helm(&["template", "gpu-dra", chart, "-f", big.path().to_str().context("values path")?])?;
    ensure!(rendered.status.success(), "large integers refused: {}", text(&rendered.stderr));
    let rendered = text(&rendered.stdout);
    for value in ["\"1000000\"", "\"2000000\"", "\"3000000\"", "\"1000\"", "\"2\""] {
        ensure!(rendered.contains(&format!("value: {value}")), "{value} not rendered as an integer:\n{rendered}");
    }
    ensure!(!rendered.contains("e+0"), "an integer rendered in exponent form:\n{rendered}");
    // One class per extended resource name (the scheduler serves a name through one class only): a MIG profile's
    // class and an extra class both serving nvidia.com/mig-1g.10gb would leave one of them serving nothing.
    let sets = [
        "deviceClasses.mig.profiles={1g.10gb}",
        "deviceClasses.extra[0].name=small",
        "deviceClasses.extra[0].extendedResourceName=nvidia.com/mig-1g.10gb",
    ];
    let args: Vec<&str> =
        ["template", "gpu-dra", chart].into_iter().chain(sets.iter().flat_map(|s| ["--set", s])).collect();
    let twice = helm(&args)?;
    let stderr = text(&twice.stderr);
    ensure!(
        !twice.status.success()
            && stderr.contains("the extended resource nvidia.com/mig-1g.10gb is named by more than one"),
        "one extended resource in two classes was not refused: {stderr}"
    );
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
    // The GPU Operator's layout too: the driver root in its driver container's mount.
    for (name, all_on, driver_root) in
        [("default", false, "/"), ("all-on", true, "/"), ("operator", false, "/run/nvidia/driver")]
    {
        // Unique names for what is cluster-scoped: the release (RBAC, policy) and the driver (DeviceClasses).
        let driver = format!("{name}-{suffix}.gpu-dra.dev");
        let driver_set = format!("driverName={driver}");
        let root_set = format!("nodeAgent.driverRoot={driver_root}");
        let release = format!("{name}-{suffix}");
        let rendered = documents(&render(&release, &ctx.namespace, all_on, &[&driver_set, &root_set])?);
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
        let result = check_applied(&applied, &release, &driver, (all_on, driver_root));
        delete(&ctx, &documents);
        result.with_context(|| format!("{name} values"))?;
        eprintln!("{name}: {} objects accepted by a server-side apply", applied.len());
    }
    Ok(())
}

/// What must hold of the objects the server stored.
fn check_applied(
    applied: &[Value],
    release: &str,
    driver: &str,
    (all_on, driver_root): (bool, &str),
) -> anyhow::Result<()> {
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
    // The agent outlives the GPU pods a node's drain evicts, so that the kubelet can finish them: it tolerates every
    // NoExecute taint (a maintenance taint), and the cluster autoscaler leaves it to the node's deletion.
    let tolerations = pod["tolerations"].as_array().cloned().unwrap_or_default();
    ensure!(
        tolerations.iter().any(|t| t["operator"] == "Exists" && t["effect"] == "NoExecute" && t.get("key").is_none()),
        "the agent does not tolerate NoExecute taints: {tolerations:?}"
    );
    // Nor is it evicted (Karpenter) or kept from coming back after a rollout (both autoscalers) by a drain's taint.
    for key in ["karpenter.sh/disrupted", "ToBeDeletedByClusterAutoscaler"] {
        ensure!(
            tolerations.iter().any(|t| t["key"] == key && t["operator"] == "Exists" && t["effect"] == "NoSchedule"),
            "the agent does not tolerate the autoscaler's drain taint {key}: {tolerations:?}"
        );
    }
    let annotations = &daemonset["spec"]["template"]["metadata"]["annotations"];
    ensure!(
        annotations["cluster-autoscaler.kubernetes.io/enable-ds-eviction"] == "false",
        "the cluster autoscaler would evict the agent with the workloads: {annotations}"
    );
    ensure!(
        container["startupProbe"]["httpGet"]["path"] == "/healthz"
            && container["startupProbe"]["periodSeconds"].as_u64().unwrap_or(0)
                * container["startupProbe"]["failureThreshold"].as_u64().unwrap_or(0)
                >= 300,
        "the agent's startup probe must give a replaced agent minutes to exit: {}",
        container["startupProbe"]
    );
    // Nodes where a device plugin serves GPUs are told by the agent from the Node's status, not by a label (the GPU
    // Operator labels every GPU node as running its device plugin): no exclusion unless a label is named.
    ensure!(
        env_value(container, "GPU_DRA_REFUSE_WITH_DEVICE_PLUGIN") == Some("true"),
        "the agent must refuse to publish beside a device plugin: {}",
        container["env"]
    );
    let excluded = json!({"key": "example.com/device-plugin", "operator": "NotIn", "values": ["true"]});
    let terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        .as_array()
        .context("no required node affinity")?;
    let excluding =
        |t: &Value| t["matchExpressions"].as_array().is_some_and(|e| e.iter().any(|e| e["operator"] == "NotIn"));
    if all_on {
        ensure!(
            !terms.is_empty()
                && terms.iter().all(|t| t["matchExpressions"].as_array().is_some_and(|e| e.contains(&excluded))),
            "labeled device-plugin nodes not excluded from every term: {terms:?}"
        );
    } else {
        ensure!(!terms.iter().any(excluding), "no node label excludes device-plugin nodes by default: {terms:?}");
    }
    if !all_on {
        // GPU nodes by NFD's label or by the GPU Operator's: either term, each without the device plugin.
        let keys: Vec<&Value> = terms.iter().map(|t| &t["matchExpressions"][0]["key"]).collect();
        ensure!(
            keys == [&json!("feature.node.kubernetes.io/pci-10de.present"), &json!("nvidia.com/gpu.present")]
                && terms.iter().all(|t| t["matchExpressions"][0]["values"] == json!(["true"]))
                && pod.get("nodeSelector").is_none_or(|s| s == &json!({}))
                && container["securityContext"]["privileged"] == true,
            "node agent defaults: {pod}"
        );
    } else {
        ensure!(terms[0]["matchExpressions"][0]["key"] == "kubernetes.io/arch", "the user's term was lost: {terms:?}");
    }
    check_node_agent_mounts(pod, driver, (!all_on).then_some(driver_root))?;
    // The MPS daemons of MPS claims run in the agent's container: no memory limit that would kill them all with it.
    ensure!(
        container["resources"]["requests"]["memory"] == "32Mi" && container["resources"]["limits"]["memory"].is_null(),
        "node agent resources: {}",
        container["resources"]
    );
    ensure!(
        container["terminationMessagePath"] != "/dev/termination-log",
        "the runtime cannot create /dev/termination-log in the read-only host /dev"
    );
    ensure!(env_value(container, "GPU_DRA_DRIVER_NAME") == Some(driver), "driver name: {}", container["env"]);
    let sharing = if all_on { "by-memory" } else { "whole" };
    ensure!(env_value(container, "GPU_DRA_GPU_SHARING") == Some(sharing), "GPU sharing: {}", container["env"]);
    let mig = if all_on { "dynamic" } else { "static" };
    ensure!(env_value(container, "GPU_DRA_MIG_LAYOUT") == Some(mig), "MIG layout: {}", container["env"]);

    let class = applied
        .iter()
        .find(|o| o["kind"] == "DeviceClass" && o["metadata"]["name"] == driver)
        .context("no DeviceClass named after the driver")?;
    let selector = format!("device.driver == '{driver}' && device.attributes['{driver}'].type == 'gpu'");
    ensure!(class["spec"]["selectors"][0]["cel"]["expression"] == selector.as_str(), "{class}");
    // The MIG class: "mig." in place of the driver's first label (default-abc.gpu-dra.dev has no "gpu." to swap).
    let mig_name = format!("mig.{}", driver.strip_prefix("gpu.").unwrap_or(driver));
    let mig = applied
        .iter()
        .find(|o| o["kind"] == "DeviceClass" && o["metadata"]["name"] == mig_name.as_str())
        .with_context(|| format!("no MIG DeviceClass {mig_name}"))?;
    let selector = format!("device.driver == '{driver}' && device.attributes['{driver}'].type == 'mig'");
    ensure!(mig["spec"]["selectors"][0]["cel"]["expression"] == selector.as_str(), "{mig}");
    if all_on {
        // A class per listed profile, serving the NVIDIA device plugin's resource name for it.
        let domain = mig_name.trim_start_matches("mig.");
        let profile = applied
            .iter()
            .find(|o| o["kind"] == "DeviceClass" && o["metadata"]["name"] == format!("mig-1g.10gb.{domain}").as_str())
            .context("no DeviceClass for MIG profile 1g.10gb")?;
        let selects = format!("device.attributes['{driver}'].profile == '1g.10gb'");
        ensure!(profile["spec"]["selectors"][1]["cel"]["expression"] == selects.as_str(), "{profile}");
        let served = profile["spec"].get("extendedResourceName");
        let expected = (support::cluster::kubernetes_minor()? >= 36).then(|| json!("nvidia.com/mig-1g.10gb"));
        ensure!(served == expected.as_ref(), "extendedResourceName of the 1g.10gb class: {profile}");
    }
    if all_on {
        // The extra class's `sharing`: a GpuConfig of the driver that every claim of the class gets.
        let extra = applied
            .iter()
            .find(|o| o["kind"] == "DeviceClass" && o["metadata"]["name"] == "h100.gpu-dra.dev")
            .context("no extra DeviceClass h100.gpu-dra.dev")?;
        let config = json!([{"opaque": {"driver": driver, "parameters": {"apiVersion": format!("{driver}/v1alpha1"),
            "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}}}]);
        ensure!(extra["spec"]["config"] == config, "the extra class's config: {extra}");
    }
    if all_on && support::cluster::kubernetes_minor()? < 36 {
        // Before 1.36 (DRAExtendedResource off) the server drops it, as the README's version table says.
        ensure!(class["spec"].get("extendedResourceName").is_none(), "extendedResourceName kept before 1.36: {class}");
    } else if all_on {
        // Kept by the server: extendedResourceName is served (DRAExtendedResource, beta in 1.36, GA in 1.37).
        ensure!(class["spec"]["extendedResourceName"] == "nvidia.com/gpu", "extendedResourceName dropped: {class}");
    }
    Ok(())
}

/// The node agent's host paths are exactly what it needs, each at the host's own path (socket paths announced to
/// the kubelet and paths in CDI specs are resolved on the host) and the agent is told that path: its own directory
/// of the kubelet's plugin registry and of its plugins (never the directories with other plugins' sockets), the CDI
/// and state directories; with NVML also /dev and the driver root, read-only. Returns nothing but the verdict.
pub(super) fn check_node_agent_mounts(pod: &Value, driver: &str, nvml: Option<&str>) -> anyhow::Result<()> {
    let container = &pod["containers"][0];
    let mounts = container["volumeMounts"].as_array().context("no volume mounts")?;
    let volumes = pod["volumes"].as_array().context("no volumes")?;
    let host_path = |mount: &Value| {
        volumes.iter().find(|v| v["name"] == mount["name"]).and_then(|v| v["hostPath"]["path"].as_str())
    };
    // (path in the container, host path, read-only, propagation)
    let got: BTreeSet<(String, String, bool, String)> = mounts
        .iter()
        .map(|m| {
            let text = |key: &str| m[key].as_str().unwrap_or_default().to_string();
            (
                text("mountPath"),
                host_path(m).unwrap_or("<not a hostPath>").to_string(),
                m["readOnly"] == true,
                text("mountPropagation"),
            )
        })
        .collect();
    let registry = format!("/var/lib/kubelet/plugins_registry/{driver}");
    let plugin = format!("/var/lib/kubelet/plugins/{driver}");
    let privileged = pod["containers"][0]["securityContext"]["privileged"] == true;
    let mut expected = vec![
        (registry.as_str(), registry.as_str(), false, ""),
        (plugin.as_str(), plugin.as_str(), false, ""),
        ("/var/run/cdi", "/var/run/cdi", false, ""),
        ("/var/lib/gpu-dra", "/var/lib/gpu-dra", false, ""),
        // Bidirectional for a privileged agent: the tmpfs it mounts for an MPS claim must reach the runtime.
        ("/run/gpu-dra/mps", "/run/gpu-dra/mps", false, if privileged { "Bidirectional" } else { "" }),
    ];
    // With NVML, the driver root (`Some`): HostToContainer, so that a driver upgraded in place is seen; a root other
    // than / through its parent, so that a mount made there again (the GPU Operator's driver container) is too.
    let parent = nvml.and_then(|root| Path::new(root).parent()).map(|p| p.display().to_string());
    let in_container = match (nvml, &parent) {
        (Some("/"), _) | (Some(_), None) => Some("/driver-root".to_string()),
        (Some(root), Some(_)) => Some(format!("/driver-root-parent/{}", root.rsplit('/').next().unwrap_or_default())),
        (None, _) => None,
    };
    match (nvml, &parent) {
        (Some("/"), _) | (Some(_), None) => {
            expected.extend([("/dev", "/dev", true, ""), ("/driver-root", "/", true, "HostToContainer")])
        }
        (Some(_), Some(parent)) => {
            expected.extend([("/dev", "/dev", true, ""), ("/driver-root-parent", parent, true, "HostToContainer")])
        }
        (None, _) => {}
    }
    let expected: BTreeSet<(String, String, bool, String)> =
        expected.into_iter().map(|(c, h, ro, p)| (c.into(), h.into(), ro, p.into())).collect();
    ensure!(got == expected, "node agent mounts (nvml: {nvml:?}):\n got      {got:?}\n expected {expected:?}");
    // The agent is told those paths, and what it creates from them lies inside the mounts.
    let env = |name: &str| env_value(container, name);
    ensure!(
        env("GPU_DRA_KUBELET_REGISTRY_DIR") == Some(registry.as_str())
            && env("GPU_DRA_KUBELET_PLUGINS_DIR") == Some("/var/lib/kubelet/plugins")
            && env("GPU_DRA_CDI_DIR") == Some("/var/run/cdi")
            && env("GPU_DRA_STATE_DIR") == Some("/var/lib/gpu-dra")
            && env("GPU_DRA_MPS_DIR") == Some("/run/gpu-dra/mps"),
        "node agent directories: {}",
        container["env"]
    );
    let sockets =
        gpu_dra::kubelet_plugin::SocketPaths::new(Path::new(&registry), Path::new("/var/lib/kubelet/plugins"), driver)?;
    ensure!(
        sockets.registration.starts_with(&registry) && sockets.dra.starts_with(&plugin),
        "sockets {sockets:?} outside their mounts"
    );
    let driver_root = (env("GPU_DRA_DRIVER_ROOT"), env("GPU_DRA_HOST_DRIVER_ROOT"));
    ensure!(driver_root == (in_container.as_deref(), nvml), "driver root settings (nvml: {nvml:?}): {driver_root:?}");
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

/// `helm upgrade --reuse-values` from 0.1.0: Helm then renders the new chart with the release's old values in place
/// of the chart's defaults, so every value added since is missing (a chart copy whose values.yaml is 0.1.0's,
/// `values-0.1.0.yaml`, renders the same). It renders (before, a nil value stopped the upgrade), every environment
/// variable has a value (an empty one would stop the agent: the binary refuses `GPU_DRA_DEVICE_METADATA=""`), the new
/// features take the binaries' own defaults (which are the chart's), no MIG class appears that the release never had,
/// and the API server takes every object.
pub(super) async fn an_upgrade_reusing_the_values_of_0_1_0_renders_and_applies(ctx: TestContext) -> anyhow::Result<()> {
    let copy = tempfile::tempdir()?;
    let chart = copy.path().join("gpu-dra");
    let status = Command::new("cp").arg("-r").arg(chart_dir()).arg(&chart).status()?;
    ensure!(status.success(), "copy the chart");
    let old = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chart/values-0.1.0.yaml");
    std::fs::copy(&old, chart.join("values.yaml"))?;
    let suffix = &ctx.namespace[ctx.namespace.len() - 6..];
    let (release, driver) = (format!("reuse-{suffix}"), format!("reuse-{suffix}.gpu-dra.dev"));
    let chart = chart.to_str().context("chart path")?;
    let args = ["template", &release, chart, "--namespace", &ctx.namespace, "--set", &format!("driverName={driver}")];
    let output = helm(&args)?;
    ensure!(output.status.success(), "the chart does not render with 0.1.0's values:\n{}", text(&output.stderr));
    let rendered = text(&output.stdout);
    for empty in ["value: \"\"", "value: null", "value: \n", "path: \n", "path: null"] {
        ensure!(!rendered.contains(empty), "an empty {empty:?} rendered with 0.1.0's values:\n{rendered}");
    }
    for absent in ["GPU_DRA_STALE_CLAIMS", "GPU_DRA_DEVICE_METADATA", "GPU_DRA_CONTROLLER_THREADS"] {
        ensure!(!rendered.contains(absent), "{absent} rendered though 0.1.0's values do not have it");
    }
    // One new value set with the upgrade (`--reuse-values --set ...`): the others of its group stay unset, not empty.
    let lost = ["--set", "nodeAgent.health.lostEffect=NoSchedule"];
    let output = helm(&[&args[..], &lost[..]].concat())?;
    ensure!(output.status.success(), "0.1.0's values and one health value:\n{}", text(&output.stderr));
    let one_set = text(&output.stdout);
    for empty in ["value: \"\"", "value: null", "value: \n"] {
        ensure!(!one_set.contains(empty), "an empty {empty:?} rendered with one health value set:\n{one_set}");
    }
    ensure!(one_set.contains("GPU_DRA_HEALTH_LOST_EFFECT\n              value: \"NoSchedule\""), "{one_set}");
    ensure!(rendered.contains("path: /run/gpu-dra/mps"), "the MPS directory is not the agent's default");
    let documents = documents(&rendered);
    let classes = documents.iter().filter(|(kind, _)| kind == "DeviceClass").count();
    ensure!(classes == 1, "{classes} DeviceClasses rendered: 0.1.0 had the GPU class only");
    let applied = apply(&ctx, &documents);
    delete(&ctx, &documents);
    let applied = applied?;
    eprintln!("0.1.0's values: {} objects rendered and accepted by a server-side apply", applied.len());
    Ok(())
}
