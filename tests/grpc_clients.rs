//! The node agent's two sockets called by gRPC implementations other than ours, as the processes they are:
//! grpc-go (the kubelet harness's `grpc-call`) dialing every way the kubelet and other Go clients dial, and
//! grpc-python (e2e/grpc-call.py, grpcio pinned in e2e/versions.sh). Each sends its own `:authority` for a unix
//! socket (`localhost`, the percent-encoded path, the raw path), and every one must be answered: GetInfo on the
//! registration socket, a real NodePrepareResources and NodeUnprepareResources on the DRA socket.

mod support;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use gpu_dra::kubelet_plugin::proto::dra_v1 as v1;
use gpu_dra::kubelet_plugin::proto::registration::{InfoRequest, PluginInfo};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams, PostParams};
use prost::Message;
use serde_json::json;
use support::node::{DRIVER, NodeDirs, start_agent};
use support::{TestContext, objects};
use tokio::io::AsyncWriteExt;

fn main() {
    support::run("grpc_clients", &[test!(every_grpc_client_is_answered_on_both_sockets)])
}

/// A gRPC implementation and the way it dials a unix socket.
#[derive(Clone, Copy, Debug)]
enum Client {
    /// `unix:///abs/path`: grpc-go's unix resolver, as the kubelet's DRA manager dials (authority `localhost`).
    GoUnixAbsolute,
    /// `unix:rel/path`, relative to the working directory.
    GoUnixRelative,
    /// The path through a custom dialer (passthrough), as the kubelet's plugin watcher dials: the authority is the
    /// percent-encoded path.
    GoCustomDialer,
    /// The raw socket path as authority, as grpc-java sends it.
    GoRawPathAuthority,
    /// `unix:/abs/path` with grpc core (grpc-python): the percent-encoded path.
    PythonUnix,
    /// `unix:///abs/path` with grpc core.
    PythonUnixUri,
}

const CLIENTS: [Client; 6] = [
    Client::GoUnixAbsolute,
    Client::GoUnixRelative,
    Client::GoCustomDialer,
    Client::GoRawPathAuthority,
    Client::PythonUnix,
    Client::PythonUnixUri,
];

/// The interpreter of the grpc-python environment `e2e/build-grpc-python.sh` keeps in the cache.
fn python() -> anyhow::Result<PathBuf> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    support::harness::build_once(&PYTHON, "build-grpc-python.sh")
}

impl Client {
    /// The command that makes one call of `method` on `socket` with this client.
    fn command(self, socket: &Path, method: &str) -> anyhow::Result<tokio::process::Command> {
        let path = socket.to_str().context("socket path is not UTF-8")?;
        let dir = socket.parent().context("socket without directory")?;
        let file = socket.file_name().and_then(|f| f.to_str()).context("socket without file name")?;
        let mut command = match self {
            Client::PythonUnix | Client::PythonUnixUri => {
                let mut command = tokio::process::Command::new(python()?);
                command.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/e2e/grpc-call.py"));
                let target =
                    if matches!(self, Client::PythonUnix) { format!("unix:{path}") } else { format!("unix://{path}") };
                command.args([target.as_str(), method]);
                command
            }
            _ => {
                let mut command = tokio::process::Command::new(support::harness::binary()?);
                command.args(["grpc-call", "--method", method, "--target"]);
                match self {
                    Client::GoUnixAbsolute => command.arg(format!("unix://{path}")),
                    Client::GoUnixRelative => command.arg(format!("unix:{file}")).current_dir(dir),
                    Client::GoCustomDialer => command.args([path, "--unix-dialer"]),
                    _ => command.args([path, "--unix-dialer", "--authority", path]),
                };
                command
            }
        };
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        Ok(command)
    }

    /// Calls `method` on `socket` with `request`; the decoded response.
    async fn call<Req: Message, Resp: Message + Default>(
        self,
        socket: &Path,
        method: &str,
        request: &Req,
    ) -> anyhow::Result<Resp> {
        let mut child = self.command(socket, method)?.spawn().with_context(|| format!("start {self:?}"))?;
        let mut stdin = child.stdin.take().context("no stdin")?;
        stdin.write_all(&request.encode_to_vec()).await?;
        drop(stdin);
        let output = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
            .await
            .with_context(|| format!("{self:?} did not finish {method}"))??;
        if !output.status.success() {
            bail!("{method}: {}", String::from_utf8_lossy(&output.stderr).trim());
        }
        Resp::decode(output.stdout.as_slice()).with_context(|| format!("decode the answer to {method}"))
    }
}

/// Creates claim `name` with one GPU of `node` allocated, as the scheduler would; returns its UID.
async fn claim_with_one_gpu(ctx: &TestContext, name: &str, node: &str) -> anyhow::Result<String> {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}}
    }))?;
    let created = objects::claims(ctx).create(&PostParams::default(), &claim).await?;
    let uid = created.metadata.uid.context("created claim has no UID")?;
    let status = json!({"status": {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"}]}},
        "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("{uid}-pod")}]
    }});
    objects::claims(ctx).patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await?;
    Ok(uid)
}

/// GetInfo, then a prepare and an unprepare of `claim`, all with `client`.
async fn exercise(client: Client, dirs: &NodeDirs, claim: &v1::Claim) -> anyhow::Result<()> {
    let info: PluginInfo = client
        .call(&dirs.registration_socket(), "/pluginregistration.Registration/GetInfo", &InfoRequest {})
        .await
        .context("registration socket")?;
    ensure!(info.name == DRIVER && Path::new(&info.endpoint) == dirs.dra_socket(), "GetInfo answered {info:?}");

    let service = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin";
    let request = v1::NodePrepareResourcesRequest { claims: vec![claim.clone()] };
    let prepared: v1::NodePrepareResourcesResponse = client
        .call(&dirs.dra_socket(), &format!("{service}/NodePrepareResources"), &request)
        .await
        .context("DRA socket")?;
    let answer = prepared.claims.get(&claim.uid).context("no answer for the claim")?;
    let devices: Vec<&str> = answer.devices.iter().map(|d| d.device_name.as_str()).collect();
    ensure!(answer.error.is_empty() && devices == ["gpu-0"], "prepare answered {answer:?}");
    ensure!(dirs.cdi_spec(&claim.uid).exists(), "no CDI spec after the prepare");

    let request = v1::NodeUnprepareResourcesRequest { claims: vec![claim.clone()] };
    let unprepared: v1::NodeUnprepareResourcesResponse = client
        .call(&dirs.dra_socket(), &format!("{service}/NodeUnprepareResources"), &request)
        .await
        .context("DRA socket")?;
    let answer = unprepared.claims.get(&claim.uid).context("no answer for the claim")?;
    ensure!(answer.error.is_empty(), "unprepare answered {answer:?}");
    ensure!(!dirs.cdi_spec(&claim.uid).exists(), "the CDI spec outlived the unprepare");
    Ok(())
}

async fn every_grpc_client_is_answered_on_both_sockets(ctx: TestContext) -> anyhow::Result<()> {
    let node = format!("grpc-node-{}", &ctx.namespace[ctx.namespace.len() - 6..]);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let agent = start_agent(&ctx, &node, &dirs, &["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB"])?;
    agent.wait_ready().await?;
    let uid = claim_with_one_gpu(&ctx, "one", &node).await?;
    let claim = v1::Claim { namespace: ctx.namespace.clone(), name: "one".into(), uid };

    // Every client, even after one failed: the report names each one that is not answered.
    let mut failures = Vec::new();
    for client in CLIENTS {
        if let Err(err) = exercise(client, &dirs, &claim).await {
            failures.push(format!("{client:?}: {err:#}"));
        }
    }
    ensure!(failures.is_empty(), "not answered:\n{}\nagent log:\n{}", failures.join("\n"), agent.log_tail());
    Ok(())
}
