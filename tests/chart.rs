//! The Helm chart `charts/gpu-dra` against the pinned helm and the real API server: lint and render (default values
//! and `ci/all-on-values.yaml`), the schema's refusals, every rendered object accepted by a server-side apply, and
//! least privilege both ways: each component, run as a process under its chart ServiceAccount with the settings of
//! its rendered workload, does its job; it is refused what lies outside its grant; and the admission policy keeps
//! the node agent to its own node's ResourceSlices.
//!
//! Objects are applied with the pinned kubectl (`apply --server-side`), which also hands back what the server
//! stored as JSON: the chart's YAML is never parsed here.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use support::node::{DRIVER, Kubelet, NodeDirs};
use support::objects::{self, claim_statuses, create_pod, create_template, events_about, one_gpu};
use support::process::Component;
use support::{TestContext, wait};

const FIELD_MANAGER: &str = "gpu-dra-chart-test";
const SETTLE: Duration = Duration::from_secs(30);

fn main() {
    support::run(
        "chart",
        &[
            test!(lints_and_renders_with_default_and_all_on_values),
            test!(schema_refuses_wrong_values_naming_them),
            test!(every_rendered_object_is_accepted_by_the_api_server),
            test!(controller_works_under_its_service_account_and_is_refused_the_rest),
            test!(node_agent_works_under_its_service_account_and_is_refused_the_rest),
            test!(admission_policy_keeps_the_node_agent_to_its_own_node),
        ],
    )
}

// --- helm and kubectl --------------------------------------------------------------------------------------------

fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/gpu-dra")
}

fn all_on_values() -> PathBuf {
    chart_dir().join("ci/all-on-values.yaml")
}

/// `<kubernetes bin>/kubectl` and `<helm bin>/helm` from the cache `e2e/build-k8s.sh` fills.
fn tool(name: &str) -> anyhow::Result<PathBuf> {
    let output = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/build-k8s.sh"))
        .arg("--print-bin-dirs")
        .output()
        .context("run e2e/build-k8s.sh --print-bin-dirs")?;
    let dirs = String::from_utf8(output.stdout)?;
    let dir = match name {
        "kubectl" => dirs.lines().next(),
        "helm" => dirs.lines().nth(2),
        _ => None,
    };
    let path = Path::new(dir.context("build-k8s.sh printed fewer bin directories than expected")?).join(name);
    ensure!(path.exists(), "{} is missing: run e2e/build-k8s.sh", path.display());
    Ok(path)
}

/// Runs `helm ARGS…`.
fn helm(args: &[&str]) -> anyhow::Result<Output> {
    Command::new(tool("helm")?).args(args).output().context("run helm")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `helm template RELEASE charts/gpu-dra --namespace NAMESPACE [-f all-on] [--set …]`: the rendered YAML.
fn render(release: &str, namespace: &str, all_on: bool, sets: &[&str]) -> anyhow::Result<String> {
    let chart = chart_dir();
    let values = all_on_values();
    let mut args = vec!["template", release, chart.to_str().context("chart path")?, "--namespace", namespace];
    if all_on {
        args.extend(["-f", values.to_str().context("values path")?]);
    }
    for set in sets {
        args.extend(["--set", set]);
    }
    let output = helm(&args)?;
    ensure!(output.status.success(), "helm {}: {}", args.join(" "), text(&output.stderr));
    Ok(text(&output.stdout))
}

/// The YAML documents of a rendered chart with their top-level `kind`.
fn documents(rendered: &str) -> Vec<(String, String)> {
    rendered
        .split("\n---")
        .filter_map(|doc| {
            let kind = doc.lines().find_map(|l| l.strip_prefix("kind: "))?.trim().to_string();
            Some((kind, doc.to_string()))
        })
        .collect()
}

fn kinds(rendered: &str) -> BTreeMap<String, usize> {
    let mut kinds = BTreeMap::new();
    for (kind, _) in documents(rendered) {
        *kinds.entry(kind).or_insert(0) += 1;
    }
    kinds
}

/// Runs the pinned kubectl against the test cluster with `stdin`.
fn kubectl(ctx: &TestContext, args: &[&str], stdin: &str) -> anyhow::Result<Output> {
    let mut child = Command::new(tool("kubectl")?)
        .arg("--kubeconfig")
        .arg(ctx.cluster.kubeconfig())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("run kubectl")?;
    child.stdin.take().context("kubectl stdin")?.write_all(stdin.as_bytes())?;
    Ok(child.wait_with_output()?)
}

/// Server-side applies the documents (as the admin, one field manager) and returns the objects as the server stored
/// them. Fails naming every object the server refused.
fn apply(ctx: &TestContext, documents: &[(String, String)]) -> anyhow::Result<Vec<Value>> {
    let yaml: Vec<&str> = documents.iter().map(|(_, doc)| doc.as_str()).collect();
    let output = kubectl(
        ctx,
        &["apply", "--server-side", "--field-manager", FIELD_MANAGER, "-o", "json", "-f", "-"],
        &yaml.join("\n---\n"),
    )?;
    ensure!(output.status.success(), "kubectl apply --server-side refused objects:\n{}", text(&output.stderr));
    let applied: Value = serde_json::from_slice(&output.stdout).context("kubectl apply -o json output")?;
    let items = match applied["kind"].as_str() {
        Some("List") => applied["items"].as_array().cloned().unwrap_or_default(),
        _ => vec![applied],
    };
    ensure!(items.len() == documents.len(), "{} documents sent, {} objects applied", documents.len(), items.len());
    Ok(items)
}

/// Deletes what `documents` describe (best effort: the cluster goes away at the end anyway), so that the
/// cluster-scoped objects of one test do not outlive it.
fn delete(ctx: &TestContext, documents: &[(String, String)]) {
    let yaml: Vec<&str> = documents.iter().map(|(_, doc)| doc.as_str()).collect();
    let _ = kubectl(ctx, &["delete", "--ignore-not-found", "--wait=false", "-f", "-"], &yaml.join("\n---\n"));
}

/// The one applied object of `kind` (and `component`, when given).
fn object<'a>(objects: &'a [Value], kind: &str, component: Option<&str>) -> anyhow::Result<&'a Value> {
    let mut found = objects.iter().filter(|o| {
        o["kind"] == kind
            && component.is_none_or(|c| o["metadata"]["labels"]["app.kubernetes.io/component"].as_str() == Some(c))
    });
    let first = found.next().with_context(|| format!("no {kind} {component:?} rendered"))?;
    ensure!(found.next().is_none(), "more than one {kind} {component:?} rendered");
    Ok(first)
}

/// A release name unique to the test (cluster-scoped objects are named after it).
fn release(ctx: &TestContext) -> String {
    format!("r{}", &ctx.namespace[ctx.namespace.len() - 6..])
}

// --- the components as the chart runs them -----------------------------------------------------------------------

/// The environment variables of `gpu-dra SUBCOMMAND` and their flags, from its `--help` (`[env: NAME=]`).
fn env_twins(subcommand: &str) -> anyhow::Result<HashMap<String, String>> {
    let output = Command::new(env!("CARGO_BIN_EXE_gpu-dra")).args([subcommand, "--help"]).output()?;
    ensure!(output.status.success(), "gpu-dra {subcommand} --help: {}", text(&output.stderr));
    let mut twins = HashMap::new();
    let mut flag = None;
    for line in text(&output.stdout).lines() {
        let trimmed = line.trim_start();
        let long = trimmed.strip_prefix("--").or_else(|| trimmed.split_once(", --").map(|(_, long)| long));
        if trimmed.starts_with('-')
            && let Some(long) = long
        {
            flag = long.split([' ', '=']).next().map(|name| format!("--{name}"));
        }
        if let (Some(flag), Some((_, rest))) = (&flag, line.split_once("[env: ")) {
            let name = rest.split('=').next().unwrap_or_default();
            twins.insert(name.to_string(), flag.clone());
        }
    }
    ensure!(!twins.is_empty(), "no [env: …] in gpu-dra {subcommand} --help");
    Ok(twins)
}

/// The command line equivalent to the rendered `container`: its args, then each environment variable as the flag
/// it is the twin of (so a variable that is no flag's twin — a typo, a removed flag — fails here). Downward-API
/// values come from `fields`, `$(VAR)` references are expanded as the kubelet does, `overrides` replace values
/// (paths of the fake node), and GPU_DRA_METRICS_ADDR is left to `Component` (a free port). POD_NAME is not a twin:
/// the controller reads it as its identity, so it becomes `--identity`.
fn command_line(
    container: &Value,
    subcommand: &str,
    fields: &HashMap<&str, String>,
    overrides: &HashMap<&str, String>,
) -> anyhow::Result<Vec<String>> {
    let twins = env_twins(subcommand)?;
    let mut line: Vec<String> = container["args"]
        .as_array()
        .context("container has no args")?
        .iter()
        .map(|a| a.as_str().map(str::to_string).context("non-string arg"))
        .collect::<anyhow::Result<_>>()?;
    ensure!(line.first().map(String::as_str) == Some(subcommand), "args {line:?} do not start with {subcommand}");
    let mut defined: HashMap<String, String> = HashMap::new();
    for var in container["env"].as_array().context("container has no env")? {
        let name = var["name"].as_str().context("env without a name")?;
        let value = match (&var["value"], var["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
            (Value::String(value), _) => expand(value, &defined),
            (_, Some(path)) => fields.get(path).cloned().with_context(|| format!("{name}: no value for {path}"))?,
            _ => bail!("env {name} has neither a value nor a fieldRef: {var}"),
        };
        defined.insert(name.to_string(), value.clone());
        let value = overrides.get(name).cloned().unwrap_or(value);
        match (name, twins.get(name)) {
            ("GPU_DRA_METRICS_ADDR", _) | ("POD_NAMESPACE", _) => {}
            ("POD_NAME", None) if subcommand == "controller" => line.push(format!("--identity={value}")),
            (_, Some(flag)) => line.push(format!("{flag}={value}")),
            (_, None) => bail!("env {name} of the {subcommand} container is no flag's environment twin"),
        }
    }
    Ok(line)
}

/// `$(NAME)` replaced by the value of an earlier variable, as the kubelet expands env values.
fn expand(value: &str, defined: &HashMap<String, String>) -> String {
    let mut out = value.to_string();
    for (name, v) in defined {
        out = out.replace(&format!("$({name})"), v);
    }
    out
}

/// The value of env `name` in `container`.
fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"].as_array()?.iter().find(|v| v["name"] == name)?["value"].as_str()
}

/// A token for ServiceAccount `name` from the TokenRequest API, bound to `pod` (name, uid) when given.
async fn token(ctx: &TestContext, name: &str, pod: Option<(&str, &str)>) -> anyhow::Result<String> {
    let mut spec = json!({"audiences": [], "expirationSeconds": 3600});
    if let Some((pod, uid)) = pod {
        spec["boundObjectRef"] = json!({"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid});
    }
    let request: TokenRequest = serde_json::from_value(json!({"spec": spec}))?;
    let sas = Api::<ServiceAccount>::namespaced(ctx.client.clone(), &ctx.namespace);
    let answer = sas.create_token_request(name, &PostParams::default(), &request).await?;
    answer.status.map(|s| s.token).context("TokenRequest without a token")
}

/// A client that authenticates with the kubeconfig at `path` only.
async fn client_for(path: &Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    gpu_dra::kube_client::install_crypto_provider();
    Ok(kube::Client::try_from(config)?)
}

/// The API server's refusal (403) of `result`, as its message; anything else fails.
fn forbidden<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>) -> anyhow::Result<String> {
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 => Ok(status.message),
        other => bail!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

/// The ClusterRole's rules as (api group, resource, verbs) rows, with resourceNames noted.
fn rules(role: &Value) -> BTreeSet<(String, String, String)> {
    let mut rows = BTreeSet::new();
    for rule in role["rules"].as_array().into_iter().flatten() {
        let strings = |key: &str| -> Vec<String> {
            rule[key].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(str::to_string)).collect()
        };
        let mut verbs = strings("verbs");
        verbs.sort();
        let names = strings("resourceNames");
        for group in strings("apiGroups") {
            for resource in strings("resources") {
                let resource = if names.is_empty() { resource } else { format!("{resource}[{}]", names.join(",")) };
                rows.insert((group.clone(), resource, verbs.join(",")));
            }
        }
    }
    rows
}

fn rows(table: &[(&str, &str, &str)]) -> BTreeSet<(String, String, String)> {
    table.iter().map(|(g, r, v)| (g.to_string(), r.to_string(), v.to_string())).collect()
}

// --- tests -------------------------------------------------------------------------------------------------------

async fn lints_and_renders_with_default_and_all_on_values(_ctx: TestContext) -> anyhow::Result<()> {
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

async fn schema_refuses_wrong_values_naming_them(_ctx: TestContext) -> anyhow::Result<()> {
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

async fn every_rendered_object_is_accepted_by_the_api_server(ctx: TestContext) -> anyhow::Result<()> {
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

async fn controller_works_under_its_service_account_and_is_refused_the_rest(ctx: TestContext) -> anyhow::Result<()> {
    let release = release(&ctx);
    let rendered = documents(&render(
        &release,
        &ctx.namespace,
        false,
        &["nodeAgent.enabled=false", "deviceClasses.gpu.enabled=false"],
    )?);
    let applied = apply(&ctx, &rendered)?;
    let result = controller_under_its_account(&ctx, &applied).await;
    delete(&ctx, &rendered);
    result
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
        ("resource.k8s.io", "resourceclaimtemplates", "list,watch"),
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
    let kubeconfig = ctx.cluster.kubeconfig_for_token(&format!("{ns}-controller"), &token)?;
    let identity = format!("{account}-7d9f8-x2x4q");
    let fields = HashMap::from([("metadata.name", identity.clone()), ("metadata.namespace", ns.to_string())]);
    let mut args = command_line(&pod_spec["containers"][0], "controller", &fields, &HashMap::new())?;
    ensure!(args.iter().any(|a| a == "--leader-elect=true"), "leader election is not on: {args:?}");
    args.extend(["--namespace".to_string(), ns.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut controller = Component::start(&kubeconfig, &format!("{ns}-controller"), &args)?;
    controller.wait_ready().await?;

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
    wait::until("the ResourceClaimCreated event", SETTLE, || async {
        Ok(events_about(ctx, "trainer").await?.into_iter().find(|(_, reason, _)| reason == "ResourceClaimCreated"))
    })
    .await?;
    let lease = Api::<Lease>::namespaced(ctx.client.clone(), ns).get(lease_name).await?;
    let holder = lease.spec.and_then(|s| s.holder_identity);
    ensure!(holder.as_deref() == Some(identity.as_str()), "Lease {lease_name} held by {holder:?}");

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

async fn node_agent_works_under_its_service_account_and_is_refused_the_rest(ctx: TestContext) -> anyhow::Result<()> {
    let release = release(&ctx);
    let class = ctx.namespace.clone();
    let class_set = format!("deviceClasses.gpu.name={class}");
    let rendered = documents(&render(
        &release,
        &ctx.namespace,
        false,
        &[
            "controller.enabled=false",
            "nodeAgent.gpuBackend=simulated",
            "nodeAgent.simulatedGpus=2xH100-80GB",
            &class_set,
        ],
    )?);
    let applied = apply(&ctx, &rendered)?;
    let result = node_agent_under_its_account(&ctx, &applied, &class).await;
    delete(&ctx, &rendered);
    result
}

/// A pod object of the agent's ServiceAccount bound to `node` (it never runs: there is no kubelet) and a token
/// bound to it, which therefore carries the node's name, as the projected token of a DaemonSet pod does.
async fn node_bound_token(ctx: &TestContext, account: &str, node: &str) -> anyhow::Result<String> {
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

fn slice(name: &str, node: &str, driver: &str) -> anyhow::Result<ResourceSlice> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": []}
    }))?)
}

/// Waits until the admission policy is in force (the API server loads it asynchronously): a ResourceSlice of
/// `other` node written with `client` is refused. Returns the refusal.
async fn policy_in_force(ctx: &TestContext, client: &kube::Client, other: &str) -> anyhow::Result<String> {
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
    let suffix = &ns[ns.len() - 6..];
    let node = format!("gpu-node-{suffix}");
    ctx.cluster.add_node(&node)?;
    let daemonset = object(applied, "DaemonSet", Some("node-agent"))?;
    let pod_spec = &daemonset["spec"]["template"]["spec"];
    let account = pod_spec["serviceAccountName"].as_str().context("no serviceAccountName")?;

    let granted = rules(object(applied, "ClusterRole", Some("node-agent"))?);
    let expected = rows(&[
        ("resource.k8s.io", "resourceslices", "create,delete,list,watch"),
        ("resource.k8s.io", "resourceclaims", "get,list"),
        ("", "nodes", "get"),
        ("events.k8s.io", "events", "create,patch"),
    ]);
    ensure!(granted == expected, "node agent ClusterRole {granted:?}");

    let token = node_bound_token(ctx, account, &node).await?;
    let kubeconfig = ctx.cluster.kubeconfig_for_token(&format!("{ns}-node-agent"), &token)?;
    let client = client_for(&kubeconfig).await?;
    // The agent runs under the policy, not before it is in force.
    policy_in_force(ctx, &client, &format!("other-{suffix}")).await?;

    let dirs = NodeDirs::new()?;
    std::fs::write(dirs.boot_id_file(), "boot-1\n")?;
    std::fs::create_dir_all(dirs.state())?;
    // A corrupt checkpoint makes the agent list claims and publish an Event: both must be granted.
    std::fs::write(dirs.checkpoint(), b"{\"version\": 1, \"checksum\": \"00\", \"checkpo")?;
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    let overrides = HashMap::from([
        ("GPU_DRA_KUBELET_REGISTRY_DIR", path(dirs.registry())),
        ("GPU_DRA_KUBELET_PLUGINS_DIR", path(dirs.plugins())),
        ("GPU_DRA_CDI_DIR", path(dirs.cdi())),
        ("GPU_DRA_STATE_DIR", path(dirs.state())),
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
    forbidden(
        "delete a claim",
        Api::<ResourceClaim>::namespaced(client.clone(), ns).delete("pair", &DeleteParams::default()).await,
    )?;
    ensure!(!agent.log_text().contains("forbidden"), "the agent was refused something:\n{}", agent.log_tail());
    let status = agent.terminate()?;
    ensure!(status.success(), "agent exited with {status}");
    Ok(())
}

async fn admission_policy_keeps_the_node_agent_to_its_own_node(ctx: TestContext) -> anyhow::Result<()> {
    let release = release(&ctx);
    let rendered = documents(&render(
        &release,
        &ctx.namespace,
        false,
        &["controller.enabled=false", "deviceClasses.gpu.enabled=false"],
    )?);
    let applied = apply(&ctx, &rendered)?;
    let result = policy_refusals(&ctx, &applied).await;
    delete(&ctx, &rendered);
    result
}

async fn policy_refusals(ctx: &TestContext, applied: &[Value]) -> anyhow::Result<()> {
    let ns = ctx.namespace.as_str();
    let suffix = &ns[ns.len() - 6..];
    let (own, other) = (format!("own-{suffix}"), format!("other-{suffix}"));
    ctx.cluster.add_node(&own)?;
    let daemonset = object(applied, "DaemonSet", Some("node-agent"))?;
    let account = daemonset["spec"]["template"]["spec"]["serviceAccountName"].as_str().context("no account")?;
    let bound = node_bound_token(ctx, account, &own).await?;
    let agent = client_for(&ctx.cluster.kubeconfig_for_token(&format!("{ns}-bound"), &bound)?).await?;
    let unbound = token(ctx, account, None).await?;
    let unbound = client_for(&ctx.cluster.kubeconfig_for_token(&format!("{ns}-unbound"), &unbound)?).await?;
    let as_agent = Api::<ResourceSlice>::all(agent.clone());
    let as_admin = Api::<ResourceSlice>::all(ctx.client.clone());
    let pp = PostParams::default();

    // Another node's slice: create refused, naming both nodes.
    let refusal = policy_in_force(ctx, &agent, &other).await?;
    ensure!(
        refusal.contains(&format!(
            "the node agent on node {own} may only write ResourceSlices of its own node, not of node {other}"
        )),
        "{refusal}"
    );
    // Its own node's slice: created and deleted.
    as_agent.create(&pp, &slice(&format!("{own}-a"), &own, DRIVER)?).await.context("create own node's slice")?;
    as_agent.delete(&format!("{own}-a"), &DeleteParams::default()).await.context("delete own node's slice")?;
    // Another node's existing slice: delete refused by the policy; update is not even granted (RBAC).
    as_admin.create(&pp, &slice(&format!("{other}-b"), &other, DRIVER)?).await?;
    let message = forbidden(
        "delete another node's slice",
        as_agent.delete(&format!("{other}-b"), &DeleteParams::default()).await,
    )?;
    ensure!(message.contains(&format!("not of node {other}")), "{message}");
    let mut existing = as_admin.get(&format!("{other}-b")).await?;
    existing.spec.node_name = Some(own.clone());
    let message =
        forbidden("update another node's slice", as_agent.replace(&format!("{other}-b"), &pp, &existing).await)?;
    ensure!(message.contains("cannot update resource \"resourceslices\""), "{message}");
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
