//! The Helm chart `charts/gpu-dra` against the pinned helm and the real API server: lint and render (default values
//! and `ci/all-on-values.yaml`), the schema's refusals, every rendered object accepted by a server-side apply, and
//! least privilege both ways: each component, run as a process under its chart ServiceAccount with the settings of
//! its rendered workload, does its job; it is refused what lies outside its grant; the admission policy keeps
//! the node agent to its own node's ResourceSlices and pool; the agent needs no host path beyond the DaemonSet's
//! mounts, beside the real kubelet plugin watcher; and the pods meet the Pod Security levels the docs name.
//!
//! Objects are applied with the pinned kubectl (`apply --server-side`), which also hands back what the server
//! stored as JSON: the chart's YAML is never parsed here.

mod support;

#[path = "chart/artifacts.rs"]
mod artifacts;
#[path = "chart/identities.rs"]
mod identities;
#[path = "chart/mounts.rs"]
mod mounts;
#[path = "chart/pod_security.rs"]
mod pod_security;
#[path = "chart/podgroup.rs"]
mod podgroup;
#[path = "chart/policy.rs"]
mod policy;
#[path = "chart/render.rs"]
mod render;

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
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, ResourceExt as _};
use serde_json::{Value, json};
use support::node::{DRIVER, Kubelet, NodeAgent, NodeDirs};
use support::objects::{self, claim_statuses, create_pod, create_template, events_about, one_gpu};
use support::process::{Component, InClusterAccount};
use support::{TestContext, wait};

const FIELD_MANAGER: &str = "gpu-dra-chart-test";
const SETTLE: Duration = Duration::from_secs(30);

use artifacts::{
    release_components_report_their_build, release_has_one_version_everywhere,
    release_packaged_chart_installs_on_the_cluster, release_version_names_the_commit_and_whether_the_tree_was_dirty,
};
use identities::{
    controller_works_under_its_service_account_and_is_refused_the_rest,
    node_agent_works_under_its_service_account_and_is_refused_the_rest,
};
use mounts::node_agent_works_with_only_its_mounts_beside_the_real_kubelet;
use pod_security::pods_meet_the_pod_security_levels_the_docs_name;
use policy::admission_policy_keeps_the_node_agent_to_its_own_node;
use render::{
    a_parent_chart_renders_it_as_a_dependency, an_upgrade_reusing_the_values_of_0_1_0_renders_and_applies,
    every_rendered_object_is_accepted_by_the_api_server, lints_and_renders_with_default_and_all_on_values,
    schema_refuses_wrong_values_naming_them,
};

fn main() {
    // From 1.37 a control plane that serves PodGroups, so that the controller under the chart's account needs (and
    // is tested with) the PodGroup grants too; before, there is no PodGroup API to serve (`make test-matrix`).
    let env: &[(&str, &str)] = if serves_pod_groups() { &support::cluster::PODGROUP_CLUSTER_ENV } else { &[] };
    support::run_with_env(
        "chart",
        false,
        env,
        &[
            test!(lints_and_renders_with_default_and_all_on_values),
            test!(schema_refuses_wrong_values_naming_them),
            test!(a_parent_chart_renders_it_as_a_dependency),
            test!(every_rendered_object_is_accepted_by_the_api_server),
            test!(an_upgrade_reusing_the_values_of_0_1_0_renders_and_applies),
            test!(controller_works_under_its_service_account_and_is_refused_the_rest),
            test!(node_agent_works_under_its_service_account_and_is_refused_the_rest),
            test!(admission_policy_keeps_the_node_agent_to_its_own_node),
            test!(pods_meet_the_pod_security_levels_the_docs_name),
            test!(node_agent_works_with_only_its_mounts_beside_the_real_kubelet),
            test!(release_has_one_version_everywhere),
            test!(release_version_names_the_commit_and_whether_the_tree_was_dirty),
            test!(release_components_report_their_build),
            test!(release_packaged_chart_installs_on_the_cluster),
        ],
    )
}

/// Whether the Kubernetes version under test has the PodGroup API (`scheduling.k8s.io/v1beta1`, 1.37 on). An
/// unreadable version counts as the default one's, which has it.
fn serves_pod_groups() -> bool {
    support::cluster::kubernetes_minor().map_or(true, |minor| minor >= 37)
}

// --- helm and kubectl --------------------------------------------------------------------------------------------

fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/gpu-dra")
}

fn all_on_values() -> PathBuf {
    chart_dir().join("ci/all-on-values.yaml")
}

/// Runs `helm ARGS…`.
fn helm(args: &[&str]) -> anyhow::Result<Output> {
    Command::new(support::k8s_tool("helm")?).args(args).output().context("run helm")
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
    let mut child = Command::new(support::k8s_tool("kubectl")?)
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
/// A node name unique to the test: `prefix` and the random suffix of the test's namespace.
fn test_node_name(ctx: &TestContext, prefix: &str) -> String {
    let ns = ctx.namespace.as_str();
    format!("{prefix}-{}", &ns[ns.len() - 6..])
}

/// The pod spec of the node agent's DaemonSet among the applied objects.
fn node_agent_pod_spec(applied: &[Value]) -> anyhow::Result<&Value> {
    Ok(&object(applied, "DaemonSet", Some("node-agent"))?["spec"]["template"]["spec"])
}

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
/// Renders the chart as the test's release with `sets`, applies it, runs `check` on the objects the server stored,
/// and deletes what it applied whatever `check` found.
async fn with_chart_applied(
    ctx: &TestContext,
    sets: &[&str],
    check: impl AsyncFnOnce(&[Value]) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let rendered = documents(&render(&release(ctx), &ctx.namespace, false, sets)?);
    let applied = apply(ctx, &rendered)?;
    let result = check(&applied).await;
    delete(ctx, &rendered);
    result
}

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
