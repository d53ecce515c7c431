//! MPS control daemons, one per prepared claim that asks MPS ([`crate::kubelet_plugin::mps`] decides which), run by
//! the agent as supervised children: `nvidia-cuda-mps-control -f` of the driver under the driver root for real GPUs,
//! the agent's own stand-in ([`super::mps_stand_in`]) for simulated ones, through the same code.
//!
//! - **Started** while the claim is prepared, before its CDI spec is written, and waited for until its control pipe
//!   exists (clients connect there); a daemon that does not come up fails the prepare with its log's last lines.
//! - **Its own `/dev/shm`**: the daemon runs in a mount namespace of its own where the claim's `shm` directory is
//!   bind-mounted at `/dev/shm`; the claim's containers get the same directory there, so the MPS server and its
//!   clients share memory. The claim's directory is a tmpfs of its own (half the memory at most, as NVIDIA's
//!   driver mounts for its daemons), so what a workload writes there never fills the filesystem the MPS root is on
//!   (the node's `/run` by default, where the CDI specs and the runtime's state are); unmounted at unprepare (the
//!   agent needs `CAP_SYS_ADMIN`: the chart's privileged agent has it, and mounts the root with `Bidirectional`
//!   propagation so the runtime sees the tmpfs).
//! - **Supervised**: a daemon that exits while its claim is prepared is started again (1 s back-off, doubling to
//!   30 s), counted in `gpu_dra_kubelet_plugin_mps_daemon_restarts_total`. The MPS servers it started, left in its
//!   process group, are killed first and reaped: the agent is their reaper (as its container's PID 1, and made one
//!   where it is not), so none stays a zombie.
//! - **Stopped** at unprepare: `quit` through its control pipe, as NVIDIA documents, then killed after
//!   [`STOP_TIMEOUT`]; then its directories are removed.
//! - **Across agent restarts**: a daemon is the agent's child, so a restarted agent's container took it down (the
//!   runtime kills a container's processes); where the agent is not in a container of its own (a host process), a
//!   daemon may outlive it, so start-up stops any daemon left running (recorded pid with the same start time),
//!   removes directories of claims no longer prepared and starts the daemons of prepared ones again (one that does
//!   not come up is kept restarting, its directories kept: the claim's spec mounts them).
//!   Clients of the old daemon see it go: MPS work in flight across an agent restart fails and is retried by its
//!   workload, as on a node-agent upgrade of NVIDIA's driver when its daemon Deployment is replaced.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use tracing::{info, warn};

use super::bounded_run::{self, Outcome};
use super::driver_tool::DriverTool;
use super::mps_sys::{self, kill_group};
use crate::kubelet_plugin::mps::{MpsDaemon, MpsDirs};
use crate::proc_stat::start_time;

/// How long a daemon has to create its control pipe after it starts.
pub const START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a daemon has to exit after `quit` before it is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The control pipe a daemon creates in its pipe directory once it takes clients.
pub const CONTROL_PIPE: &str = "control";
/// The daemon's pid, start time and the kernel's boot ID, in the claim's directory: start-up stops a daemon a
/// previous agent left.
const PID_FILE: &str = "daemon.pid";
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long a dead daemon's killed servers have to die and be reaped before its supervisor goes on.
const REAP_WITHIN: Duration = Duration::from_secs(2);

/// Why a claim's daemon could not be started or stopped; the prepare or unprepare fails with it and the kubelet
/// retries.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("create the MPS directories of claim {claim_uid} under {dir}: {source}")]
    Dirs {
        claim_uid: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "start the MPS control daemon {program} for claim {claim_uid}: {source}. Is the NVIDIA driver's \
         nvidia-cuda-mps-control under --driver-root, and does the agent have CAP_SYS_ADMIN (privileged) for the \
         daemon's own /dev/shm?"
    )]
    Spawn {
        program: String,
        claim_uid: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the MPS control daemon of claim {claim_uid} did not create {pipe} within {timeout:?}; its log: {log}")]
    NotReady { claim_uid: String, pipe: PathBuf, timeout: Duration, log: String },
    #[error("send {command:?} to the MPS control daemon of claim {claim_uid}: {source}")]
    Control {
        claim_uid: String,
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "mount a tmpfs of claim {claim_uid}'s own at {dir} (its MPS pipes and shared memory, kept off the node's \
         filesystem): {source}. Does the agent have CAP_SYS_ADMIN (privileged)?"
    )]
    Tmpfs {
        claim_uid: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("remove the MPS directories of claim {claim_uid} ({dir}): {source}")]
    Remove {
        claim_uid: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The program a daemon is, and how it is told to quit.
#[derive(Clone, Debug)]
pub struct MpsProgram {
    /// Run with `args` then `-f` as the daemon, with `args` alone as the client that sends `quit`. Its directory
    /// leads `PATH`: the daemon starts the driver's `nvidia-cuda-mps-server` beside it.
    pub tool: DriverTool,
    pub args: Vec<OsString>,
}

impl MpsProgram {
    /// `nvidia-cuda-mps-control` under `driver_root` (`usr/bin`, `bin`), else the one on `PATH`, with the libraries
    /// of the NVML library discovery loads.
    pub fn nvidia(driver_root: &Path) -> Self {
        Self { tool: DriverTool::find(driver_root, "nvidia-cuda-mps-control"), args: Vec::new() }
    }

    /// This binary's stand-in (`gpu-dra simulated-mps-control`).
    pub fn stand_in() -> std::io::Result<Self> {
        let tool = DriverTool::Given(std::env::current_exe()?);
        Ok(Self { tool, args: vec!["simulated-mps-control".into()] })
    }

    /// The program for `gpu`'s backend.
    pub fn of(gpu: &crate::cli::GpuArgs) -> std::io::Result<Self> {
        match gpu.gpu_backend {
            crate::cli::GpuBackend::Simulated => Self::stand_in(),
            crate::cli::GpuBackend::Nvml => Ok(Self::nvidia(gpu.nvml_root())),
        }
    }

    /// Where the program is, as shown in messages.
    pub fn shown(&self) -> String {
        self.tool.program().display().to_string()
    }

    fn command(&self, daemon: &MpsDaemon, dirs: &MpsDirs) -> Command {
        let mut command = self.tool.command_with_links(&driver_libraries(dirs));
        command.args(&self.args).envs(daemon.daemon_env(dirs)).stdin(Stdio::null());
        if let Some(bin) = self.tool.program().parent().filter(|dir| dir.is_absolute()) {
            let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into());
            command.env("PATH", format!("{}:{path}", bin.display()));
        }
        command
    }
}

/// One supervised daemon.
struct Supervised {
    stop: Arc<AtomicBool>,
    pid: Arc<AtomicU32>,
    thread: JoinHandle<()>,
}

/// The node's MPS daemons, by claim UID.
pub struct MpsDaemons {
    program: MpsProgram,
    root: PathBuf,
    restarts: Counter,
    running: Mutex<BTreeMap<String, Supervised>>,
}

impl std::fmt::Debug for MpsDaemons {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpsDaemons").field("program", &self.program.tool).field("root", &self.root).finish()
    }
}

impl MpsDaemons {
    /// Daemons of `program`, their directories under `root`; each restart of one counts in `restarts`.
    /// The agent becomes the reaper of its daemons' orphans (see [`mps_sys::become_subreaper`]).
    pub fn new(program: MpsProgram, root: PathBuf, restarts: Counter) -> Self {
        if let Err(e) = mps_sys::become_subreaper() {
            warn!(error = %e, "becoming the reaper of MPS servers failed; a dead daemon's servers go to init");
        }
        Self { program, root, restarts, running: Mutex::default() }
    }

    pub fn dirs(&self, claim_uid: &str) -> MpsDirs {
        MpsDirs::of(&self.root, claim_uid)
    }

    /// How many daemons are supervised.
    pub fn len(&self) -> usize {
        self.running().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the claim has a daemon supervised (running, or waiting to be started again).
    pub fn supervises(&self, claim_uid: &str) -> bool {
        self.running().contains_key(claim_uid)
    }

    /// The pid of the claim's daemon as now running, if it is.
    pub fn pid(&self, claim_uid: &str) -> Option<u32> {
        self.running().get(claim_uid).map(|s| s.pid.load(Ordering::SeqCst)).filter(|pid| *pid != 0)
    }

    fn running(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Supervised>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the claim's daemon (kept when it runs already) and waits until it takes clients; answers whether it
    /// started one (false: it ran already). A daemon that does not come up is stopped and its directories removed.
    pub fn start(&self, claim_uid: &str, daemon: &MpsDaemon) -> Result<bool, MpsError> {
        self.start_or_keep_trying(claim_uid, daemon, false)
    }

    /// [`MpsDaemons::start`]; with `keep_trying`, a daemon that does not come up stays supervised (restarted with
    /// back-off) and its directories stay.
    fn start_or_keep_trying(&self, claim_uid: &str, daemon: &MpsDaemon, keep_trying: bool) -> Result<bool, MpsError> {
        let dirs = self.dirs(claim_uid);
        let running = self.running().get(claim_uid).map(|s| s.pid.clone());
        if let Some(pid) = running {
            return wait_ready(claim_uid, &dirs, &pid, START_TIMEOUT).map(|()| false);
        }
        // The claim's directory is a tmpfs of its own (see `mps_sys::mount_tmpfs`), kept across agent restarts.
        let claim_dir = std::fs::create_dir_all(&dirs.claim);
        claim_dir.map_err(|source| MpsError::Dirs { claim_uid: claim_uid.into(), dir: dirs.claim.clone(), source })?;
        if !mps_sys::is_mount_point(&dirs.claim) {
            mps_sys::mount_tmpfs(&dirs.claim).map_err(|source| MpsError::Tmpfs {
                claim_uid: claim_uid.into(),
                dir: dirs.claim.clone(),
                source,
            })?;
        }
        // Writable by all, as a container's own /dev/shm is: the claim's processes (any uid) and the MPS server they
        // start (running as its first client's uid) write here. The claim's directory above them can be passed
        // through but not listed (0711), so on the node only who knows the claim's UID finds them.
        for (dir, mode) in [(&dirs.claim, 0o711), (&dirs.pipe, 0o1777), (&dirs.log, 0o1777), (&dirs.shm, 0o1777)] {
            let created = std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)));
            created.map_err(|source| MpsError::Dirs { claim_uid: claim_uid.into(), dir: dir.clone(), source })?;
        }
        // A control pipe left by a daemon that is gone would look ready.
        let _ = std::fs::remove_file(dirs.pipe.join(CONTROL_PIPE));
        // Kept trying, a daemon that cannot even be spawned now is spawned again by its supervisor after back-off.
        let child = match spawn(&self.program, daemon, &dirs, claim_uid) {
            Ok(child) => Some(child),
            Err(e) if keep_trying => {
                warn!(claim_uid, error = %e, "spawning the MPS control daemon failed; it is tried again");
                None
            }
            Err(e) => return Err(e),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let pid = Arc::new(AtomicU32::new(child.as_ref().map_or(0, Child::id)));
        let supervisor = Supervisor {
            claim_uid: claim_uid.to_string(),
            program: self.program.clone(),
            daemon: daemon.clone(),
            dirs: dirs.clone(),
            stop: stop.clone(),
            pid: pid.clone(),
            restarts: self.restarts.clone(),
        };
        let thread = std::thread::spawn(move || supervisor.run(child));
        self.running().insert(claim_uid.to_string(), Supervised { stop, pid: pid.clone(), thread });
        info!(claim_uid, uuids = daemon.uuids.join(","), "started MPS control daemon");
        match wait_ready(claim_uid, &dirs, &pid, START_TIMEOUT) {
            Ok(()) => Ok(true),
            Err(e) => {
                if !keep_trying {
                    let _ = self.stop(claim_uid);
                }
                Err(e)
            }
        }
    }

    /// Sends one command to the claim's daemon through its control pipe (`get_server_list`, …); what it answered.
    pub fn control(&self, claim_uid: &str, command: &str) -> Result<String, MpsError> {
        send(&self.program, &self.dirs(claim_uid), command).map_err(|source| MpsError::Control {
            claim_uid: claim_uid.into(),
            command: command.into(),
            source,
        })
    }

    /// Stops the claim's daemon, if one runs, and removes its directories. Nothing to stop is no error.
    pub fn stop(&self, claim_uid: &str) -> Result<(), MpsError> {
        let dirs = self.dirs(claim_uid);
        let supervised = self.running().remove(claim_uid);
        if let Some(supervised) = supervised {
            supervised.stop.store(true, Ordering::SeqCst);
            // Within STOP_TIMEOUT of asking, however long the asking took. One that cannot be asked (its control
            // pipe removed by a tenant's container, which shares the pipe directory) is killed at once; one whose
            // client failed with the pipe there may still be quitting, and gets the rest of the time.
            let deadline = Instant::now() + STOP_TIMEOUT;
            let asked = send(&self.program, &dirs, "quit");
            let pipe = dirs.pipe.join(CONTROL_PIPE);
            let may_quit = asked.is_ok() || control_pipe_is_its_own(&pipe).is_ok();
            while may_quit && !supervised.thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !supervised.thread.is_finished() {
                match &asked {
                    Ok(_) => {
                        warn!(claim_uid, "the MPS control daemon did not quit within {STOP_TIMEOUT:?}; killing it")
                    }
                    Err(error) => {
                        warn!(claim_uid, %error, "the MPS control daemon could not be asked to quit; killing it")
                    }
                }
                kill_group(supervised.pid.load(Ordering::SeqCst));
                // A process stuck in the kernel may not die at once: the supervisor is left to end on its own.
                let deadline = Instant::now() + Duration::from_secs(2);
                while !supervised.thread.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            if supervised.thread.is_finished() {
                let _ = supervised.thread.join();
            }
            info!(claim_uid, "stopped MPS control daemon");
        } else {
            stop_leftover(&dirs);
        }
        remove_dirs(claim_uid, &dirs)
    }

    /// Start-up: stops daemons a previous agent left running, removes the directories of claims not in `keep`
    /// (answers how many), then starts the daemons of `keep`, each failure logged (the claim's next prepare, or
    /// its unprepare, deals with it). Run again while serving (the plugin's recovery once the GPUs are discovered),
    /// the daemons this process supervises are left running when kept, stopped when not.
    /// Only directories this agent made are touched ([`is_claims_dir`]): anything else in the root is left alone,
    /// and said once.
    pub fn reconcile(&self, keep: &BTreeMap<String, MpsDaemon>) -> usize {
        let mut removed = 0;
        let (listed, foreign): (BTreeSet<String>, Vec<String>) = match std::fs::read_dir(&self.root) {
            Ok(entries) => {
                let names = entries.filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned());
                let (ours, foreign): (Vec<String>, Vec<String>) =
                    names.partition(|name| keep.contains_key(name) || is_claims_dir(name, &self.root.join(name)));
                (ours.into_iter().collect(), foreign)
            }
            Err(_) => (BTreeSet::new(), Vec::new()),
        };
        if !foreign.is_empty() {
            warn!(root = %self.root.display(), entries = ?foreign, "the MPS directory holds entries this agent did not \
                  make: left alone (give --mps-dir a directory of its own)");
        }
        for uid in &listed {
            if self.supervises(uid) {
                if !keep.contains_key(uid) {
                    match self.stop(uid) {
                        Ok(()) => removed += 1,
                        Err(e) => warn!(claim_uid = %uid, error = %e, "stopping an MPS daemon no claim needs failed"),
                    }
                }
                continue;
            }
            let dirs = self.dirs(uid);
            stop_leftover(&dirs);
            if !keep.contains_key(uid) {
                match remove_dirs(uid, &dirs) {
                    Ok(()) => removed += 1,
                    Err(e) => warn!(claim_uid = %uid, error = %e, "removing an MPS daemon's directories failed"),
                }
            }
        }
        for (uid, daemon) in keep {
            if let Err(e) = self.start_or_keep_trying(uid, daemon, true) {
                warn!(claim_uid = %uid, error = %e, "the MPS control daemon of a prepared claim did not come up; it \
                      is restarted with back-off");
            }
        }
        removed
    }
}

impl MpsDaemons {
    /// Kills every daemon and its servers, leaving their directories: the agent is going, and its daemons go with it
    /// (as they would with its container); start-up starts them again.
    pub fn kill_all(&self) {
        let running = std::mem::take(&mut *self.running());
        for (claim_uid, supervised) in running {
            supervised.stop.store(true, Ordering::SeqCst);
            kill_group(supervised.pid.load(Ordering::SeqCst));
            info!(claim_uid, "stopped MPS control daemon: the agent is stopping");
        }
    }
}

impl Drop for MpsDaemons {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Restarts a daemon until told to stop.
struct Supervisor {
    claim_uid: String,
    program: MpsProgram,
    daemon: MpsDaemon,
    dirs: MpsDirs,
    stop: Arc<AtomicBool>,
    pid: Arc<AtomicU32>,
    restarts: Counter,
}

impl Supervisor {
    fn run(self, first: Option<Child>) {
        let mut child = first;
        let mut backoff = Duration::from_secs(1);
        loop {
            if let Some(mut running) = child.take() {
                let started = Instant::now();
                let status = running.wait();
                self.pid.store(0, Ordering::SeqCst);
                // MPS servers it started may outlive it in its process group: they go before a new daemon starts,
                // and are reaped (they were handed to the agent, its reaper).
                kill_group(running.id());
                let reaped = mps_sys::reap_group(running.id(), REAP_WITHIN);
                if reaped.count > 0 {
                    info!(claim_uid = %self.claim_uid, reaped = reaped.count, "reaped the MPS servers the daemon left");
                }
                if reaped.lingering {
                    warn!(claim_uid = %self.claim_uid, "MPS servers the daemon left are still dying {REAP_WITHIN:?} \
                          after they were killed (stuck in the GPU driver?); they are reaped when they die");
                }
                if self.stop.load(Ordering::SeqCst) {
                    return;
                }
                if started.elapsed() > 2 * MAX_BACKOFF {
                    backoff = Duration::from_secs(1);
                }
                warn!(claim_uid = %self.claim_uid, status = ?status, ?backoff, "the MPS control daemon exited; starting it again");
            }
            if !self.wait_unless_stopped(backoff) {
                return;
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            let _ = std::fs::remove_file(self.dirs.pipe.join(CONTROL_PIPE));
            match spawn(&self.program, &self.daemon, &self.dirs, &self.claim_uid) {
                Ok(next) => {
                    self.pid.store(next.id(), Ordering::SeqCst);
                    self.restarts.inc();
                    // Stopped between the check and the spawn: the new daemon goes at once.
                    if self.stop.load(Ordering::SeqCst) {
                        kill_group(next.id());
                    }
                    child = Some(next);
                }
                Err(e) => warn!(claim_uid = %self.claim_uid, error = %e, "restarting the MPS control daemon failed"),
            }
        }
    }

    /// Sleeps `time`; false when told to stop meanwhile.
    fn wait_unless_stopped(&self, time: Duration) -> bool {
        let until = Instant::now() + time;
        while Instant::now() < until {
            if self.stop.load(Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        !self.stop.load(Ordering::SeqCst)
    }
}

/// Starts the daemon in its own mount namespace with the claim's `shm` directory at `/dev/shm`, and records its pid.
fn spawn(program: &MpsProgram, daemon: &MpsDaemon, dirs: &MpsDirs, claim_uid: &str) -> Result<Child, MpsError> {
    let failed = |source| MpsError::Spawn { program: program.shown().to_string(), claim_uid: claim_uid.into(), source };
    let log =
        std::fs::OpenOptions::new().create(true).append(true).open(dirs.log.join("daemon.out")).map_err(failed)?;
    let errors = log.try_clone().map_err(failed)?;
    program.tool.link_driver_libraries(&driver_libraries(dirs)).map_err(failed)?;
    let mut command = program.command(daemon, dirs);
    // Its own process group: a kill takes the MPS servers it started with it.
    command.arg("-f").stdout(log).stderr(errors).process_group(0);
    mps_sys::own_dev_shm(&mut command, &dirs.shm).map_err(failed)?;
    let child = command.spawn().map_err(failed)?;
    let record = format!("{} {} {}\n", child.id(), start_time(child.id()).unwrap_or_default(), boot_id());
    // Whole or not at all: a record torn by a kill named no daemon, and start-up left that daemon running.
    if let Err(e) = crate::fsutil::write_atomic(&dirs.claim.join(PID_FILE), record.as_bytes()) {
        warn!(claim_uid, error = %e, "recording the MPS daemon's pid failed");
    }
    Ok(child)
}

/// Host directories other software keeps its own entries in: refused as `--mps-dir`.
const SHARED_DIRS: [&str; 17] = [
    "/",
    "/run",
    "/var/run",
    "/tmp",
    "/var/tmp",
    "/var",
    "/var/lib",
    "/dev",
    "/dev/shm",
    "/etc",
    "/usr",
    "/home",
    "/root",
    "/opt",
    "/mnt",
    "/srv",
    "/var/lib/kubelet",
];

/// Why `root` cannot be the MPS directory, if it cannot: it must be absolute, not a directory other software keeps
/// its entries in, and neither one of the kubelet's `others` (`(flag, dir)`) nor around one: the claims' tmpfs
/// mounts go there, and start-up removes the claim directories there that no prepared claim has (only those:
/// [`is_claims_dir`], so the agent's own state directory may hold it). Compared as written (`.` and `..`
/// resolved, links not followed).
pub fn check_root(root: &Path, others: &[(&str, &Path)]) -> Result<(), String> {
    if !root.is_absolute() {
        return Err("is not an absolute path".into());
    }
    let root = lexical(root);
    if SHARED_DIRS.iter().any(|shared| root == Path::new(shared)) {
        return Err("is a directory other software keeps its own files in".into());
    }
    for (flag, other) in others {
        let other = lexical(other);
        if root == other {
            return Err(format!("is the same directory as {flag}"));
        }
        if other.starts_with(&root) {
            return Err(format!("holds {flag} ({})", other.display()));
        }
    }
    Ok(())
}

/// `path` with `.` and `..` resolved, as written.
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// What a claim's directory holds (see [`MpsDirs`]): the daemon's pipe, log and shared memory directories, its pid
/// record and the links to the driver's libraries.
const CLAIM_DIR_ENTRIES: [&str; 5] = ["pipe", "log", "shm", PID_FILE, "driver-libraries"];

/// Whether `path` (named `name` in the MPS root) is a directory this agent made for a claim: named by a claim UID (a
/// UUID, as the API server gives every object) and holding nothing but what [`CLAIM_DIR_ENTRIES`] names, or the
/// temporary file of a pid record a kill interrupted (nothing at all after a prepare killed just after making it). Start-up removes such directories of claims no longer prepared;
/// an `--mps-dir` pointed at a shared directory (the host's `/run`) must not cost its other contents, as it did.
fn is_claims_dir(name: &str, path: &Path) -> bool {
    let uuid = name.len() == 36
        && name.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_digit() || ('a'..='f').contains(&c),
        });
    let is_dir = std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir());
    uuid && is_dir
        && std::fs::read_dir(path).is_ok_and(|entries| {
            entries.filter_map(Result::ok).all(|e| {
                let entry = e.file_name().to_string_lossy().into_owned();
                let entry = crate::fsutil::temporary_of(&entry).filter(|t| *t == PID_FILE).unwrap_or(&entry);
                CLAIM_DIR_ENTRIES.contains(&entry)
            })
        })
}

/// Where the links to the driver's libraries the daemon and its clients load are made (see
/// [`DriverTool::link_driver_libraries`]), at each start of the daemon: in the claim's directory, removed with it.
fn driver_libraries(dirs: &MpsDirs) -> PathBuf {
    dirs.claim.join("driver-libraries")
}

/// Sends one command line to the daemon through its control pipe, as `echo <command> | nvidia-cuda-mps-control`
/// does, and answers what the client printed; the client is killed after [`STOP_TIMEOUT`].
fn send(program: &MpsProgram, dirs: &MpsDirs, line: &str) -> std::io::Result<String> {
    control_pipe_is_its_own(&dirs.pipe.join(CONTROL_PIPE))?;
    let mut command = program.tool.command_with_links(&driver_libraries(dirs));
    command.args(&program.args).env("CUDA_MPS_PIPE_DIRECTORY", &dirs.pipe).env("CUDA_MPS_LOG_DIRECTORY", &dirs.log);
    match bounded_run::run(command, Some(format!("{line}\n").as_bytes()), STOP_TIMEOUT)? {
        Outcome::Exited { status, stdout, .. } if status.success() => Ok(stdout),
        Outcome::Exited { status, stdout, stderr } => {
            Err(std::io::Error::other(format!("{status}: {}{}", stdout.trim(), stderr.trim())))
        }
        Outcome::TimedOut => {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer within {STOP_TIMEOUT:?}")))
        }
    }
}

/// Checks that `pipe` is a socket or a FIFO itself, not a symbolic link nor anything else. The claim's containers
/// share its pipe directory, and as root one may replace what is there: the client follows a link, so a link to
/// another claim's control pipe would send that claim's daemon the `quit` meant for this one, and its workload's
/// MPS servers would go with it. (A swap between this look and the client's is not excluded; it needs a container
/// of the claim itself to race the agent's unprepare.)
fn control_pipe_is_its_own(pipe: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let kind = std::fs::symlink_metadata(pipe)?.file_type();
    if kind.is_socket() || kind.is_fifo() {
        return Ok(());
    }
    let what = if kind.is_symlink() { "a symbolic link" } else { "not a socket" };
    Err(std::io::Error::other(format!(
        "{} is {what}: replaced from a container sharing the pipe directory; the daemon is not asked through it",
        pipe.display()
    )))
}

/// Waits until the daemon's control pipe exists; gives up at once when the daemon exits (its supervisor clears
/// `pid`), so a daemon that cannot start does not hold the prepare for the whole `timeout`.
fn wait_ready(claim_uid: &str, dirs: &MpsDirs, pid: &AtomicU32, timeout: Duration) -> Result<(), MpsError> {
    let pipe = dirs.pipe.join(CONTROL_PIPE);
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if pipe.exists() {
            return Ok(());
        }
        if pid.load(Ordering::SeqCst) == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(MpsError::NotReady { claim_uid: claim_uid.into(), pipe, timeout, log: log_tail(dirs) })
}

/// The last lines the daemon wrote.
fn log_tail(dirs: &MpsDirs) -> String {
    let mut lines = Vec::new();
    for file in ["daemon.out", "control.log"] {
        if let Ok(text) = std::fs::read_to_string(dirs.log.join(file)) {
            lines.extend(text.lines().rev().take(5).map(str::to_string).collect::<Vec<_>>().into_iter().rev());
        }
    }
    if lines.is_empty() { "(empty)".into() } else { lines.join(" | ") }
}

/// Kills a daemon a previous agent left (see [`leftover`]).
fn stop_leftover(dirs: &MpsDirs) {
    let Ok(record) = std::fs::read_to_string(dirs.claim.join(PID_FILE)) else { return };
    if let Some((pid, started)) = leftover(&record, &boot_id(), start_time) {
        warn!(pid, dir = %dirs.claim.display(), "stopping an MPS control daemon a previous agent left running");
        kill_group(pid);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while start_time(pid).as_deref() == Some(started.as_str()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The daemon a pid file records, when it still runs: the recorded pid, only while it has the recorded start time
/// (`start_time_of` it now) in the recorded boot (a pid and start time of another boot, when the directory outlived a
/// reboot, or a pid reused by another process, are left alone).
fn leftover(record: &str, boot_id: &str, start_time_of: impl Fn(u32) -> Option<String>) -> Option<(u32, String)> {
    let mut fields = record.split_whitespace();
    let pid = fields.next()?.parse::<u32>().ok()?;
    let started = fields.next()?.to_string();
    let recorded_boot = fields.next().unwrap_or_default();
    let same_boot = recorded_boot.is_empty() || boot_id.is_empty() || recorded_boot == boot_id;
    (same_boot && start_time_of(pid).as_deref() == Some(started.as_str())).then_some((pid, started))
}

/// The kernel's boot ID (empty when unreadable): the pid and start time of a process are only unique within it.
fn boot_id() -> String {
    crate::kubelet_plugin::checkpoint::boot_id()
}

fn remove_dirs(claim_uid: &str, dirs: &MpsDirs) -> Result<(), MpsError> {
    if mps_sys::is_mount_point(&dirs.claim) {
        mps_sys::unmount(&dirs.claim).map_err(|source| MpsError::Remove {
            claim_uid: claim_uid.into(),
            dir: dirs.claim.clone(),
            source,
        })?;
    }
    match std::fs::remove_dir_all(&dirs.claim) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(MpsError::Remove { claim_uid: claim_uid.into(), dir: dirs.claim.clone(), source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `--mps-dir` that shares its directory with other software or the agent's other directories is refused
    /// at start: start-up removes what it finds there.
    #[test]
    fn an_mps_directory_of_its_own_is_required() {
        let others: [(&str, &Path); 2] = [
            ("--kubelet-plugins-dir", Path::new("/var/lib/kubelet/plugins")),
            ("--kubelet-registry-dir", Path::new("/var/lib/kubelet/plugins_registry")),
        ];
        let cases = [
            ("/run/gpu-dra/mps", None),
            ("/run/mps", None),
            ("/var/lib/gpu-dra/mps", None), // inside the state directory: nothing there is taken for a claim's
            ("run/gpu-dra/mps", Some("is not an absolute path")),
            ("/run", Some("other software")),
            ("/run/", Some("other software")),
            ("/run/gpu-dra/..", Some("other software")),
            ("/tmp", Some("other software")),
            ("/", Some("other software")),
            ("/var/lib/kubelet/plugins", Some("the same directory as --kubelet-plugins-dir")),
            ("/var/lib/kubelet/./plugins_registry/../plugins", Some("the same directory as --kubelet-plugins-dir")),
            ("/var/lib/kubelet", Some("other software")),
        ];
        for (root, want) in cases {
            let got = check_root(Path::new(root), &others).err();
            match want {
                None => assert_eq!(got, None, "{root}"),
                Some(want) => assert!(got.as_deref().is_some_and(|g| g.contains(want)), "{root}: {got:?}"),
            }
        }
        let around = [("--kubelet-plugins-dir", Path::new("/srv/kubelet/plugins"))];
        assert!(
            check_root(Path::new("/srv/kubelet"), &around).is_err_and(|e| e.contains("holds --kubelet-plugins-dir"))
        );
    }

    /// Only a directory named by a claim UID holding what a claim's directory holds is one this agent made.
    #[test]
    fn only_a_claims_own_directory_is_taken_for_one() -> std::io::Result<()> {
        let root = tempfile::tempdir()?;
        let uid = "0f8fad5b-d9cb-469f-a165-70867728950e";
        let make = |name: &str, entries: &[&str]| -> std::io::Result<PathBuf> {
            let dir = root.path().join(name);
            std::fs::create_dir_all(&dir)?;
            for entry in entries {
                std::fs::create_dir_all(dir.join(entry))?;
            }
            Ok(dir)
        };
        assert!(is_claims_dir(uid, &make(uid, &["pipe", "log", "shm", "driver-libraries"])?));
        let torn = "9b2d5a3c-6f1e-4c7a-8d4b-2e5f6a7b8c9d";
        assert!(is_claims_dir(torn, &make(torn, &["pipe", ".daemon.pid.tmp-42"])?), "a pid record a kill tore");
        let empty = "7c9e6679-7425-40de-944b-e07fc1f90ae7";
        assert!(is_claims_dir(empty, &make(empty, &[])?), "a prepare killed after making it");
        let other = "16fd2706-8baf-433b-82eb-8c7fada847da";
        assert!(!is_claims_dir(other, &make(other, &["pipe", "data"])?), "a directory with more in it");
        assert!(!is_claims_dir("containerd", &make("containerd", &["log"])?), "a name that is no claim UID");
        let upper = "0F8FAD5B-D9CB-469F-A165-70867728950E";
        assert!(!is_claims_dir(upper, &make(upper, &[])?));
        let file = "6ba7b810-9dad-11d1-80b4-00c04fd430c8";
        std::fs::write(root.path().join(file), b"")?;
        assert!(!is_claims_dir(file, &root.path().join(file)), "a file");
        Ok(())
    }

    #[test]
    fn only_a_recorded_daemon_still_running_in_this_boot_is_a_leftover() {
        let running = |pid: u32| (pid == 42).then(|| "1000".to_string());
        let cases = [
            ("42 1000 boot-a\n", Some((42, "1000".to_string()))),
            ("42 1000\n", Some((42, "1000".to_string()))), // no boot recorded: the start time decides
            ("42 1000 boot-b\n", None),                    // another boot: its pid and start time mean nothing now
            ("42 999 boot-a\n", None),                     // the pid was reused
            ("43 1000 boot-a\n", None),                    // gone
            ("garbage", None),
            ("", None),
        ];
        for (record, expected) in cases {
            assert_eq!(leftover(record, "boot-a", running), expected, "{record:?}");
        }
    }
}
