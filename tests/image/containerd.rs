//! The archives as a real node uses them: a containerd v2 of `e2e/build-node.sh` imports them with
//! `ctr images import` (the names it stores are exactly the images' full names) and runs each with runc.
//!
//! The containerd here is the test's own (its root, state and socket under Cargo's scratch space, its own
//! namespace, hence its own cgroup parent), so it never meets a real node's containerd running beside it. The
//! namespace carries the test process's PID: runc keeps a namespace's container state machine-wide
//! (`/run/containerd/runc/<namespace>`, `/run` on disk here) and its cgroups are `/<namespace>/<id>`, so a fixed
//! name left by a killed run (or used by a run from another clone at the same time) would make runc refuse the next
//! run's containers ("container with given ID already exists").

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::layout::run;
use super::{KillOnDrop, PAUSE, WORKLOAD, built, gpu_dra_name, repo, scratch};

/// This run's containerd namespace (see the module's doc).
fn namespace() -> String {
    format!("gpu-dra-image-test-{}", std::process::id())
}

/// The directory `e2e/build-node.sh` puts containerd, its runc shim, ctr and runc in, after running it (it builds
/// what its cache lacks, in minutes, and returns at once when everything is cached).
fn node_bin() -> PathBuf {
    let status = Command::new(repo().join("e2e/build-node.sh")).stdout(Stdio::null()).status();
    assert!(status.is_ok_and(|s| s.success()), "e2e/build-node.sh failed; its output above says why");
    let versions = repo().join("e2e/versions.sh");
    let dir = run(Command::new("bash").args(["-c", "source \"$0\" && printf %s \"$NODE_BIN\""]).arg(versions));
    let dir = PathBuf::from(dir);
    for binary in ["containerd", "containerd-shim-runc-v2", "ctr", "runc"] {
        assert!(dir.join(binary).is_file(), "{} has no {binary}: run e2e/build-node.sh", dir.display());
    }
    dir
}

/// A containerd of its own, stopped (by its PID) and cleaned up when dropped: mounts under its root, its
/// namespace's cgroups and runc state.
struct Containerd {
    process: Option<KillOnDrop>,
    dir: PathBuf,
    bin: PathBuf,
}

impl Containerd {
    fn start(dir: &Path) -> Containerd {
        let bin = node_bin();
        let config = format!(
            "version = 3\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
             disabled_plugins = [\"io.containerd.grpc.v1.cri\", \"io.containerd.cri.v1.runtime\", \
             \"io.containerd.cri.v1.images\"]\n[grpc]\naddress = \"{d}/containerd.sock\"\n\
             [ttrpc]\naddress = \"{d}/containerd.sock.ttrpc\"\n",
            d = dir.display()
        );
        std::fs::write(dir.join("config.toml"), config).unwrap_or_else(|e| panic!("{e}"));
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap_or_else(|e| panic!("{e}"));
        let child = Command::new(bin.join("containerd"))
            .arg("--config")
            .arg(dir.join("config.toml"))
            .env("PATH", path_with(&bin))
            .stdout(log.try_clone().unwrap_or_else(|e| panic!("{e}")))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start containerd: {e}"));
        let containerd = Containerd { process: Some(KillOnDrop(child)), dir: dir.to_path_buf(), bin };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !containerd.ctr(&["version"]).output().is_ok_and(|o| o.status.success()) {
            assert!(Instant::now() < deadline, "containerd did not serve; see {}/containerd.log", dir.display());
            std::thread::sleep(Duration::from_millis(200));
        }
        containerd
    }

    /// `ctr` against this containerd, in the test's namespace, with runc and the shim first on PATH.
    fn ctr(&self, args: &[&str]) -> Command {
        let mut command = Command::new(self.bin.join("ctr"));
        command.arg("--address").arg(self.dir.join("containerd.sock")).args(["--namespace", &namespace()]);
        command.args(args).env("PATH", path_with(&self.bin));
        command
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        drop(self.process.take());
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let mut under: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|m| Path::new(m).starts_with(&self.dir))
            .collect();
        under.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for mount in under {
            let _ = Command::new("umount").args(["-l", mount]).status();
        }
        let cgroups = std::fs::read_dir("/sys/fs/cgroup").map(|d| d.filter_map(Result::ok).collect()).unwrap_or(vec![]);
        for controller in cgroups {
            let _ = std::fs::remove_dir(controller.path().join(namespace()));
        }
        let _ = std::fs::remove_dir(Path::new("/run/containerd/runc").join(namespace()));
    }
}

fn path_with(bin: &Path) -> String {
    format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default())
}

#[test]
fn containerd_imports_every_archive_by_its_name_and_runs_it() {
    let dir = scratch("containerd");
    let containerd = Containerd::start(&dir);
    let out = built().dir.join("out");
    for file in ["pause.tar", "workload.tar", "gpu-dra.tar"] {
        run(containerd.ctr(&["images", "import"]).arg(out.join(file)));
    }
    // Exactly the three full names: no `import-<date>:…` name that would confuse the CRI image cache.
    let listed = run(&mut containerd.ctr(&["images", "ls", "--quiet"]));
    let mut names: Vec<&str> = listed.lines().collect();
    names.sort_unstable();
    let gpu_dra = gpu_dra_name();
    let mut expected = vec![WORKLOAD, gpu_dra.as_str(), PAUSE];
    expected.sort_unstable();
    assert_eq!(names, expected);

    let shell = run(&mut containerd.ctr(&["run", "--rm", WORKLOAD, "workload", "sh", "-c", "echo ok from $(id -u)"]));
    assert_eq!(shell.trim(), "ok from 0");
    let version = run(&mut containerd.ctr(&["run", "--rm", &gpu_dra, "gpu-dra", "/gpu-dra", "--version"]));
    assert!(version.trim().starts_with("gpu-dra "), "{version}");

    // The pause image as a sandbox runs it: until TERM, then exit status 0 (ctr run returns the task's status).
    let pause = containerd
        .ctr(&["run", "--rm", PAUSE, "pause"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("ctr run: {e}"));
    let mut pause = KillOnDrop(pause);
    let deadline = Instant::now() + Duration::from_secs(30);
    // Its shell has installed the trap once it has started the sleep: two processes in the task.
    let processes =
        || containerd.ctr(&["tasks", "ps", "pause"]).output().map(|o| o.stdout.split(|&b| b == b'\n').count());
    while processes().unwrap_or_default() < 4 {
        assert!(Instant::now() < deadline, "the pause task did not start");
        std::thread::sleep(Duration::from_millis(200));
    }
    run(&mut containerd.ctr(&["tasks", "kill", "--signal", "TERM", "pause"]));
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = pause.0.try_wait().unwrap_or_else(|e| panic!("wait: {e}")) {
            break status;
        }
        assert!(Instant::now() < deadline, "the pause task did not exit on TERM");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "pause exited with {status} on TERM");
}
