//! A node's directories failing under the agent.
//!
//! A full disk: the CDI directory is often on `/run` (a small tmpfs) and the checkpoint on `/var/lib`, which container
//! logs and images fill. Here each is a tmpfs of its own, 1 MiB, filled up. What must hold: a prepare fails with the
//! reason and the filesystem to free, leaves nothing half-written and no record of itself, and touches no other
//! claim; an unprepare is done where it can be recorded, and otherwise fails with the reason and keeps its record; an
//! agent restarted meanwhile with nothing to record starts and serves; once space is freed the kubelet's retries
//! succeed with no restart.
//!
//! A directory deleted on the host while the agent's container mounts it: the liveness check fails, so the kubelet
//! restarts the container onto the new one.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, ensure};
use gpu_dra::kubelet_plugin::checkpoint::PrepareState;

use super::support::TestContext;
use super::support::node::{Kubelet, NodeDirs};
use super::{allocated_claim, checkpoint, node_name, prepares_fully, ready_agent, ready_agent_with};

/// A filesystem mounted over a directory for the test's length (unmounted, lazily, when dropped).
struct Mount {
    target: PathBuf,
}

impl Mount {
    /// Runs `mount <args> <target>`, creating `target` first.
    fn new(args: &[&std::ffi::OsStr], target: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(target)?;
        let status = Command::new("mount").args(args).arg(target).status()?;
        ensure!(
            status.success(),
            "mount {args:?} on {} (the test needs root, as the real-node tests)",
            target.display()
        );
        Ok(Self { target: target.to_owned() })
    }

    /// A directory bind-mounted over `target`, as a hostPath volume in the agent's container.
    fn bind(source: &Path, target: &Path) -> anyhow::Result<Self> {
        Self::new(&["--bind".as_ref(), source.as_os_str()], target)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.target).status();
    }
}

/// A 1 MiB tmpfs mounted over a directory for the test's length, with a file that fills it.
struct Tmpfs {
    mount: Mount,
}

impl Tmpfs {
    fn mount(dir: &Path) -> anyhow::Result<Self> {
        let args = ["-t", "tmpfs", "-o", "size=1m", "tmpfs"].map(std::ffi::OsStr::new);
        Ok(Self { mount: Mount::new(&args, dir)? })
    }

    fn filler(&self) -> PathBuf {
        self.mount.target.join("filler")
    }

    /// Writes a file (emptied first when there) until the filesystem refuses the next page.
    fn fill(&self) -> anyhow::Result<()> {
        let mut file = std::fs::File::create(self.filler())?;
        let chunk = vec![0u8; 4096];
        loop {
            if let Err(e) = file.write_all(&chunk).and_then(|()| file.sync_all()) {
                ensure!(e.kind() == std::io::ErrorKind::StorageFull, "filling {}: {e}", self.mount.target.display());
                break;
            }
        }
        Ok(())
    }

    fn free(&self) -> anyhow::Result<()> {
        std::fs::remove_file(self.filler()).context("remove the filler")
    }
}

/// The temporary files left in `dir` (a write's `.<name>.tmp-<pid>`), recursively.
fn temporaries(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)?.flatten() {
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            found.extend(temporaries(&path)?);
        } else if entry.file_name().to_string_lossy().contains(".tmp-") {
            found.push(path);
        }
    }
    Ok(found)
}

fn leaves_nothing_half_written(dirs: &NodeDirs) -> anyhow::Result<()> {
    let left: Vec<PathBuf> =
        [dirs.cdi(), dirs.state()].iter().map(|d| temporaries(d)).collect::<Result<Vec<_>, _>>()?.concat();
    ensure!(left.is_empty(), "temporary files left: {left:?}");
    Ok(())
}

pub(super) async fn a_full_disk_fails_the_prepare_with_the_reason_and_loses_nothing(
    ctx: TestContext,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let cdi = Tmpfs::mount(&dirs.cdi())?;
    let state = Tmpfs::mount(&dirs.state())?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "3xH100-80GB").await?;
    let a = allocated_claim(&ctx, "a", &node, &["gpu-0"], serde_json::json!([])).await?;
    let b = allocated_claim(&ctx, "b", &node, &["gpu-1"], serde_json::json!([])).await?;
    let ns = ctx.namespace.clone();
    prepares_fully(&dirs, &ns, "a", &a, "gpu-0").await?;
    let spec_a = std::fs::read(dirs.cdi_spec(&a))?;

    // The CDI directory's filesystem full: b's spec cannot be written.
    cdi.fill()?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let answers = kubelet.prepare(&[(&ns, "b", &b)]).await?;
    let error = &answers.get(&b).context("no answer for b")?.error;
    let named = format!("the filesystem holding {} is full; free space there", dirs.cdi().display());
    ensure!(error.contains("No space left on device") && error.contains(&named), "b's prepare answered {error:?}");
    ensure!(!dirs.cdi_spec(&b).exists(), "b has a spec");
    leaves_nothing_half_written(&dirs)?;
    let saved = checkpoint(&dirs, "boot-1")?;
    ensure!(!saved.claims.contains_key(&b), "the failed prepare is recorded: {saved:?}");
    ensure!(saved.claims.get(&a).is_some_and(|e| e.state == PrepareState::PrepareCompleted), "a lost: {saved:?}");
    ensure!(std::fs::read(dirs.cdi_spec(&a))? == spec_a, "a's spec changed");
    let metadata_b = dirs.state().join("device-metadata").join(&b);
    ensure!(!metadata_b.exists(), "b's device metadata files were left: {}", metadata_b.display());

    // An unprepare on the full CDI filesystem only removes files there: done (pods deleted to make room).
    let unprepared = kubelet.unprepare(&[(&ns, "a", &a)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "a's unprepare on a full disk: {unprepared:?}");
    ensure!(!dirs.cdi_spec(&a).exists() && !checkpoint(&dirs, "boot-1")?.claims.contains_key(&a), "a still prepared");
    cdi.free()?;

    // The checkpoint's filesystem full: nothing is prepared that is not recorded first.
    prepares_fully(&dirs, &ns, "a", &a, "gpu-0").await?;
    state.fill()?;
    let answers = kubelet.prepare(&[(&ns, "b", &b)]).await?;
    let error = &answers.get(&b).context("no answer for b")?.error;
    let named = format!("the filesystem holding {} is full; free space there", dirs.state().display());
    ensure!(error.contains("record the prepare in the checkpoint") && error.contains(&named), "b: {error:?}");
    ensure!(!dirs.cdi_spec(&b).exists(), "b has a spec it has no record of");
    leaves_nothing_half_written(&dirs)?;
    // a's device metadata files are removed before its unprepare is recorded, and the page they free holds the
    // new checkpoint of one claim: the unprepare is done. (One that frees too little: below.)
    let unprepared = kubelet.unprepare(&[(&ns, "a", &a)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "a's unprepare on a full state disk: {unprepared:?}");
    ensure!(!checkpoint(&dirs, "boot-1")?.claims.contains_key(&a), "a's unprepare is not recorded");

    // An agent restarted now (an upgrade, a liveness kill) has nothing to record: it starts and serves, refusing
    // with the reason what it cannot record.
    state.fill()?;
    agent.terminate()?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "3xH100-80GB").await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let answers = kubelet.prepare(&[(&ns, "b", &b)]).await?;
    let error = &answers.get(&b).context("no answer for b")?.error;
    ensure!(error.contains(&named), "b, asked of the restarted agent: {error:?}");

    // Space freed: the kubelet's next try prepares b, without a restart; what is on disk is whole.
    state.free()?;
    prepares_fully(&dirs, &ns, "b", &b, "gpu-1").await?;
    ensure!(checkpoint(&dirs, "boot-1")?.claims.keys().eq([&b]), "b alone is prepared");
    leaves_nothing_half_written(&dirs)?;

    // An unprepare that frees nothing on the checkpoint's full filesystem (no device metadata files): it fails with
    // the reason and keeps the entry (the spec is gone: no container starts with it), and the kubelet's retry
    // finishes it once space is freed. The kubelet's own record (`dra_manager_state` under its root directory)
    // needs room the same way.
    agent.terminate()?;
    let _agent = ready_agent_with(&ctx, &node, &dirs, "3xH100-80GB", &["--device-metadata=false"]).await?;
    let c = allocated_claim(&ctx, "c", &node, &["gpu-2"], serde_json::json!([])).await?;
    prepares_fully(&dirs, &ns, "c", &c, "gpu-2").await?;
    state.fill()?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let unprepared = kubelet.unprepare(&[(&ns, "c", &c)]).await?;
    let error = unprepared.get(&c).context("no answer for c")?;
    ensure!(error.contains("record the unprepare in the checkpoint") && error.contains(&named), "c: {error:?}");
    ensure!(checkpoint(&dirs, "boot-1")?.claims.contains_key(&c), "c's entry is gone though its unprepare failed");
    // Not written again by the agent's look for lost specs (every 10 s) while its unprepare is unfinished.
    tokio::time::sleep(std::time::Duration::from_secs(12)).await;
    ensure!(!dirs.cdi_spec(&c).exists(), "c's spec is back though c is being unprepared");
    state.free()?;
    let unprepared = kubelet.unprepare(&[(&ns, "c", &c)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "c's retried unprepare: {unprepared:?}");
    ensure!(checkpoint(&dirs, "boot-1")?.claims.keys().eq([&b]), "c's unprepare is not recorded");
    leaves_nothing_half_written(&dirs)?;
    Ok(())
}

/// `rm -rf /var/run/cdi` on the host while the agent's container runs: the container keeps the deleted directory
/// mounted, where nothing can be created and the runtime does not look, so every later prepare fails and lost specs
/// cannot be written again. The agent's liveness check says so, and the kubelet restarts the container, which
/// mounts the new directory; the restarted agent writes the prepared claims' specs there. The container's mount is
/// played by a bind mount of a directory that is then deleted.
pub(super) async fn a_spec_directory_deleted_on_the_host_fails_the_liveness_check(
    ctx: TestContext,
) -> anyhow::Result<()> {
    a_directory_deleted_on_the_host_fails_the_liveness_check(ctx, NodeDirs::cdi).await
}

/// The same with the state directory (`rm -rf /var/lib/gpu-dra`, a node clean-up script): every prepare failed to
/// write its checkpoint and every unprepare to record itself (pods stuck Terminating) while the liveness check
/// answered 200. The restarted agent rebuilds its checkpoint from the specs and prepares again.
pub(super) async fn a_state_directory_deleted_on_the_host_fails_the_liveness_check(
    ctx: TestContext,
) -> anyhow::Result<()> {
    a_directory_deleted_on_the_host_fails_the_liveness_check(ctx, NodeDirs::state).await
}

async fn a_directory_deleted_on_the_host_fails_the_liveness_check(
    ctx: TestContext,
    which: fn(&NodeDirs) -> PathBuf,
) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let host = tempfile::Builder::new().prefix("gd-host-dir-").tempdir_in("/tmp")?;
    let mounted = Mount::bind(host.path(), &which(&dirs))?;
    let mut agent = ready_agent(&ctx, &node, &dirs, "3xH100-80GB").await?;
    let a = allocated_claim(&ctx, "a", &node, &["gpu-0"], serde_json::json!([])).await?;
    let b = allocated_claim(&ctx, "b", &node, &["gpu-1"], serde_json::json!([])).await?;
    let ns = ctx.namespace.clone();
    prepares_fully(&dirs, &ns, "a", &a, "gpu-0").await?;
    let (code, _) = agent.get("/healthz").await?;
    ensure!(code == 200, "/healthz answered {code} before the directory was deleted");

    std::fs::remove_dir_all(host.path())?;
    let (code, body) = agent.get("/healthz").await?;
    let named = format!("{} was deleted on the host", which(&dirs).display());
    ensure!(code != 200 && body.contains(&named), "/healthz after the deletion: {code} {body}");

    // The kubelet restarts the container: the new one mounts the host's new directory.
    agent.terminate()?;
    drop(mounted);
    let agent = ready_agent(&ctx, &node, &dirs, "3xH100-80GB").await?;
    ensure!(dirs.cdi_spec(&a).exists(), "the restarted agent did not write a's spec again");
    let (code, body) = agent.get("/healthz").await?;
    ensure!(code == 200, "/healthz of the restarted agent: {code} {body}");
    prepares_fully(&dirs, &ns, "b", &b, "gpu-1").await?;
    ensure!(checkpoint(&dirs, "boot-1")?.claims.contains_key(&b), "b's prepare is not in the new checkpoint");
    Ok(())
}

/// A node rebooted with its state disk full (container logs filled `/var/lib`): the checkpoint lists claims of the
/// previous boot, which start-up drops and cannot record dropping. The agent serves anyway (before, its plugin did
/// not start, so the kubelet could unprepare nothing and the node published no GPUs): the kubelet's unprepare of a
/// previous boot's claim is done at once, a new prepare fails naming the full disk, and once space is freed the
/// kubelet's retry prepares it.
pub(super) async fn a_reboot_onto_a_full_state_disk_still_serves(ctx: TestContext) -> anyhow::Result<()> {
    let node = node_name(&ctx);
    ctx.cluster.add_node(&node)?;
    let dirs = NodeDirs::new()?;
    let state = Tmpfs::mount(&dirs.state())?;
    // Without device metadata files, whose removal would free the page the new record needs.
    let agent = ready_agent_with(&ctx, &node, &dirs, "2xH100-80GB", &["--device-metadata=false"]).await?;
    let a = allocated_claim(&ctx, "a", &node, &["gpu-0"], serde_json::json!([])).await?;
    let b = allocated_claim(&ctx, "b", &node, &["gpu-1"], serde_json::json!([])).await?;
    let ns = ctx.namespace.clone();
    prepares_fully(&dirs, &ns, "a", &a, "gpu-0").await?;
    drop(agent);

    std::fs::write(dirs.boot_id_file(), "boot-2\n")?;
    state.fill()?;
    let _agent = ready_agent_with(&ctx, &node, &dirs, "2xH100-80GB", &["--device-metadata=false"]).await?;
    let mut kubelet = Kubelet::register(&dirs).await?;
    let unprepared = kubelet.unprepare(&[(&ns, "a", &a)]).await?;
    ensure!(unprepared.values().all(String::is_empty), "the previous boot's claim: {unprepared:?}");
    let answers = kubelet.prepare(&[(&ns, "b", &b)]).await?;
    let error = &answers.get(&b).context("no answer for b")?.error;
    let named = format!("the filesystem holding {} is full; free space there", dirs.state().display());
    ensure!(error.contains(&named), "b's prepare on the full disk: {error:?}");
    state.free()?;
    prepares_fully(&dirs, &ns, "b", &b, "gpu-1").await?;
    ensure!(checkpoint(&dirs, "boot-2")?.claims.keys().eq([&b]), "b alone is prepared");
    Ok(())
}
