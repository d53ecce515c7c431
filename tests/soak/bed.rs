//! The soak's cluster: the real control plane with kube-controller-manager's job, deployment and replicaset
//! controllers (never its claim controller), GPU nodes each with a real `gpu-dra node-agent` and the real kubelet
//! DRA code (`gpu-dra-kubelet-harness`), two `gpu-dra controller` replicas with leader election, a DeviceClass
//! with an extended resource name, and the two namespaces (workload, tenant) with a template each.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::json;

use crate::support::cluster::PODGROUP_CLUSTER_ENV;
use crate::support::harness::KubeletHarness;
use crate::support::node::{DRIVER, NodeDirs, start_agent};
use crate::support::process::Component;
use crate::support::{Cluster, TestContext, objects, wait};

pub const WORKLOAD_NS: &str = "soak";
pub const TENANT_NS: &str = "soak-tenant";
pub const CLASS: &str = "soak-gpu";
/// The extended resource the DeviceClass maps to GPUs: `resources.limits: {nvidia.com/gpu: 1}`.
pub const EXTENDED_RESOURCE: &str = "nvidia.com/gpu";
pub const TEMPLATE: &str = "one-gpu";
/// Simulated GPUs per node.
const NODE_GPUS: [&str; 2] = ["6xH100-80GB", "6xH100-80GB"];
const KCM_CONTROLLERS: &str =
    "job-controller,deployment-controller,replicaset-controller,podgroup-protection-controller";
/// The kubelet accepts a claim reserved for the pod's PodGroup only with these gates, as the control plane has.
const KUBELET_FLAGS: [&str; 2] = ["--feature-gates", "GenericWorkload=true,DRAWorkloadResourceClaims=true"];
/// Short leases so that a killed leader is replaced within seconds.
const ELECTION: [&str; 4] = [
    "--leader-elect=true",
    "--leader-elect-lease-duration=4s",
    "--leader-elect-renew-deadline=3s",
    "--leader-elect-retry-period=500ms",
];
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// One GPU node: its directories, agent and kubelet side.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub gpus: &'static str,
    pub dirs: NodeDirs,
    pub agent: Component,
    pub kubelet: KubeletHarness,
}

/// A controller replica and the identity it runs under.
#[derive(Debug)]
pub struct Replica {
    pub identity: String,
    pub process: Component,
}

/// Everything the soak runs against; dropping it kills the processes (the cluster stops with the test process).
pub struct Bed {
    pub cluster: Arc<Cluster>,
    pub client: kube::Client,
    /// A test context on the workload namespace, for the support helpers that take one.
    pub ctx: TestContext,
    pub nodes: Vec<Node>,
    pub replicas: Vec<Replica>,
    /// The log of every controller process started, restarts included.
    pub controller_logs: Vec<std::path::PathBuf>,
}

/// Which ResourceClaim controller the soak runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimController {
    /// Two `gpu-dra controller` replicas with leader election.
    GpuDra,
    /// kube-controller-manager's `resourceclaim-controller`, the reference: a clean run against it shows that the
    /// invariants ask for upstream's behaviour and nothing else.
    KubeControllerManager,
}

impl Bed {
    pub async fn start(claim_controller: ClaimController) -> anyhow::Result<Self> {
        let kcm = claim_controller == ClaimController::KubeControllerManager;
        // PodGroups served (KEP-5729), so that the workload has training jobs as PodGroups sharing a claim.
        let env = PODGROUP_CLUSTER_ENV
            .map(|(k, v)| if k == "GPU_DRA_E2E_KCM_CONTROLLERS" { (k, KCM_CONTROLLERS) } else { (k, v) });
        let cluster = Arc::new(Cluster::start_with("soak", kcm, &env)?);
        let client = cluster.client().await?;
        let ctx = TestContext { client: client.clone(), namespace: WORKLOAD_NS.to_string(), cluster: cluster.clone() };
        for ns in [WORKLOAD_NS, TENANT_NS] {
            let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
            Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &namespace).await?;
        }
        let class = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}],
                     "extendedResourceName": EXTENDED_RESOURCE}
        });
        let classes = Api::<DynamicObject>::all_with(client.clone(), &resource("DeviceClass"));
        classes.create(&PostParams::default(), &serde_json::from_value(class)?).await.context("create DeviceClass")?;
        let template =
            json!({"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}}});
        for ns in [WORKLOAD_NS, TENANT_NS] {
            let ctx = TestContext { namespace: ns.to_string(), ..ctx.clone() };
            objects::create_template(&ctx, TEMPLATE, template.clone()).await?;
        }

        let mut nodes = Vec::new();
        for (i, &gpus) in NODE_GPUS.iter().enumerate() {
            let name = format!("soak-node-{i}");
            cluster.add_node(&name)?;
            let dirs = NodeDirs::new()?;
            let agent = start_agent(&ctx, &name, &dirs, &["--gpu-backend", "simulated", "--simulated-gpus", gpus])?;
            let kubelet = start_kubelet(&ctx, &name, &dirs)?;
            nodes.push(Node { name, gpus, dirs, agent, kubelet });
        }
        for node in &nodes {
            node.agent.wait_ready().await?;
            node.kubelet.wait_for("registered", "", READY_TIMEOUT).await?;
        }
        let mut bed = Self { cluster, client, ctx, nodes, replicas: Vec::new(), controller_logs: Vec::new() };
        if kcm {
            return Ok(bed);
        }
        for identity in ["replica-a", "replica-b"] {
            let process = bed.start_replica(identity)?;
            bed.replicas.push(Replica { identity: identity.to_string(), process });
        }
        for replica in &bed.replicas {
            replica.process.wait_ready().await?;
        }
        bed.leader(READY_TIMEOUT).await?;
        Ok(bed)
    }

    /// `gpu-dra controller` for all namespaces, electing a leader with the other replica.
    fn start_replica(&mut self, identity: &str) -> anyhow::Result<Component> {
        let mut args = vec!["controller", "--identity", identity];
        args.extend(ELECTION);
        let process = Component::start(&self.cluster.kubeconfig(), &format!("soak-controller-{identity}"), &args)?;
        self.controller_logs.push(process.log.clone());
        Ok(process)
    }

    /// The index of the replica that leads, once exactly one does.
    pub async fn leader(&self, timeout: Duration) -> anyhow::Result<usize> {
        wait::until("exactly one leading controller replica", timeout, || async {
            let mut leaders = Vec::new();
            for (i, r) in self.replicas.iter().enumerate() {
                if r.process.metric("gpu_dra_controller_leader", &[]).await.unwrap_or(0.0) == 1.0 {
                    leaders.push(i);
                }
            }
            Ok((leaders.len() == 1).then(|| leaders[0]))
        })
        .await
    }

    /// SIGKILL of replica `i` and a fresh process in its place (it rejoins as a follower).
    pub async fn restart_replica(&mut self, i: usize) -> anyhow::Result<()> {
        self.replicas[i].process.kill()?;
        let identity = self.replicas[i].identity.clone();
        let process = self.start_replica(&identity)?;
        self.replicas[i].process = process;
        self.replicas[i].process.wait_ready().await
    }

    /// SIGKILL of node `i`'s agent and a new one on the same directories.
    pub async fn restart_agent(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[i];
        let registered = node.kubelet.events().iter().filter(|e| e["event"] == "registered").count();
        node.agent.kill()?;
        node.agent = start_agent(
            &self.ctx,
            &node.name,
            &node.dirs,
            &["--gpu-backend", "simulated", "--simulated-gpus", node.gpus],
        )?;
        node.agent.wait_ready().await?;
        let node = &self.nodes[i];
        wait::until("the kubelet to register the restarted agent", READY_TIMEOUT, || async {
            let now = node.kubelet.events().iter().filter(|e| e["event"] == "registered").count();
            Ok((now > registered).then_some(()))
        })
        .await
    }

    /// SIGKILL of node `i`'s kubelet side and a new one on the same directories (the kubelet's checkpoint stays).
    pub async fn restart_kubelet(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[i];
        node.kubelet.kill()?;
        node.kubelet = start_kubelet(&self.ctx, &node.name, &node.dirs)?;
        node.kubelet.wait_for("registered", "", READY_TIMEOUT).await?;
        Ok(())
    }

    /// Fails naming the first component that exited on its own.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        for replica in &mut self.replicas {
            if let Some(status) = replica.process.try_wait()? {
                bail!("controller {} exited ({status}):\n{}", replica.identity, replica.process.log_tail());
            }
        }
        for node in &mut self.nodes {
            if let Some(status) = node.agent.try_wait()? {
                bail!("node agent of {} exited ({status}):\n{}", node.name, node.agent.log_tail());
            }
            node.kubelet.check_alive()?;
        }
        Ok(())
    }

    /// Lines of the controllers' logs that contain `needle` (all replicas, all restarts).
    pub fn controller_log_lines(&self, needle: &str) -> Vec<String> {
        let mut lines = Vec::new();
        for log in &self.controller_logs {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            lines.extend(text.lines().filter(|l| l.contains(needle)).map(str::to_string));
        }
        lines
    }
}

fn start_kubelet(ctx: &TestContext, node: &str, dirs: &NodeDirs) -> anyhow::Result<KubeletHarness> {
    KubeletHarness::start_with(ctx, node, &dirs.registry(), &dirs.kubelet_state(), &KUBELET_FLAGS)
}

/// The `resource.k8s.io/v1` kind `kind`, untyped (fields newer than the compiled types survive).
pub fn resource(kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("resource.k8s.io", "v1", kind))
}
