//! `e2e/cluster.sh` under faults: every test starts clusters of its own in its own state directory and checks
//! what is left running afterwards (by the pids the script recorded).

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use support::StandaloneTest;
use support::cluster::script;

fn main() {
    support::run_standalone(&[
        StandaloneTest {
            name: "up_is_idempotent_and_down_twice_is_harmless",
            body: up_is_idempotent_and_down_twice_is_harmless,
        },
        StandaloneTest {
            name: "component_dying_during_up_fails_and_leaves_nothing",
            body: component_dying_during_up_fails_and_leaves_nothing,
        },
        StandaloneTest { name: "pinned_api_port_in_use_is_named", body: pinned_api_port_in_use_is_named },
        StandaloneTest { name: "killed_owner_stops_the_cluster", body: killed_owner_stops_the_cluster },
        StandaloneTest {
            name: "an_ended_runs_watchdog_never_stops_the_next_run",
            body: an_ended_runs_watchdog_never_stops_the_next_run,
        },
        StandaloneTest {
            name: "a_started_component_already_runs_its_command",
            body: a_started_component_already_runs_its_command,
        },
        StandaloneTest {
            name: "build_script_names_missing_go_and_proxy",
            body: build_script_names_missing_go_and_proxy,
        },
        StandaloneTest {
            name: "stale_state_from_a_killed_run_is_cleaned",
            body: stale_state_from_a_killed_run_is_cleaned,
        },
        StandaloneTest {
            name: "feature_gates_runtime_config_and_controllers_reach_the_components",
            body: feature_gates_runtime_config_and_controllers_reach_the_components,
        },
    ])
}

fn state_dir(test: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("script-{test}"));
    let _ = run(&dir, &["down"], &[]);
    dir
}

fn run(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Output> {
    let mut cmd = script();
    cmd.args(args).env("GPU_DRA_E2E_DIR", dir).env_remove("GPU_DRA_E2E_OWNER_PID");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().with_context(|| format!("run e2e/cluster.sh {}", args.join(" ")))
}

fn run_ok(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<(String, String)> {
    let out = run(dir, args, env)?;
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    ensure!(out.status.success(), "cluster.sh {} failed ({}):\n{stderr}", args.join(" "), out.status);
    Ok((stdout, stderr))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The `name pid` lines the script recorded.
fn recorded(dir: &Path) -> anyhow::Result<Vec<(String, u32)>> {
    let pids = std::fs::read_to_string(dir.join("pids")).context("read pids")?;
    pids.lines()
        .map(|l| {
            let (name, pid) = l.split_once(' ').context("malformed pids line")?;
            Ok((name.to_string(), pid.parse()?))
        })
        .collect()
}

/// Whether `pid` is a live process that still belongs to the cluster in `dir` (by command line, or by the
/// environment of processes started with `run`).
fn alive(dir: &Path, pid: u32) -> bool {
    let dir = dir.to_string_lossy();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).map(|c| text(&c)).unwrap_or_default();
    let environ = std::fs::read(format!("/proc/{pid}/environ")).map(|c| text(&c)).unwrap_or_default();
    let in_env = environ.split('\0').any(|v| v == format!("GPU_DRA_E2E_RUN_BY={dir}"));
    !cmdline.is_empty() && (cmdline.contains(&*dir) || in_env)
}

fn ensure_none_alive(dir: &Path, pids: &[(String, u32)], within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let left: Vec<_> = pids.iter().filter(|(_, pid)| alive(dir, *pid)).collect();
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("still running after {within:?}: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn kubectl(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let (stdout, _) = run_ok(dir, &["env"], &[])?;
    let path = stdout
        .lines()
        .find_map(|l| l.strip_prefix("export PATH="))
        .and_then(|p| p.split(':').next())
        .context("env printed no PATH")?
        .to_string();
    let out = Command::new(Path::new(&path).join("kubectl"))
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .args(args)
        .output()?;
    ensure!(out.status.success(), "kubectl {args:?}: {}", text(&out.stderr));
    Ok(text(&out.stdout))
}

fn up_is_idempotent_and_down_twice_is_harmless() -> anyhow::Result<()> {
    let dir = state_dir("lifecycle");
    let (stdout, _) = run_ok(&dir, &["up"], &[])?;
    ensure!(
        stdout.trim() == format!("export KUBECONFIG={}", dir.join("kubeconfig").display()),
        "up printed {stdout:?}"
    );
    let pids = recorded(&dir)?;
    let names: Vec<_> = pids.iter().map(|(n, _)| n.as_str()).collect();
    ensure!(names == ["etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"], "up started {names:?}");

    let (stdout, stderr) = run_ok(&dir, &["up"], &[])?;
    ensure!(stderr.contains("already up") && stdout.contains("KUBECONFIG"), "second up: {stderr}");
    ensure!(recorded(&dir)? == pids, "second up started new processes");

    let (env, _) = run_ok(&dir, &["env"], &[])?;
    ensure!(env.contains("export KUBECONFIG=") && env.contains("export PATH="), "env printed {env:?}");

    run_ok(&dir, &["add-node", "lifecycle-node", "gpu-dra.dev/role=test"], &[])?;
    let ready = kubectl(
        &dir,
        &[
            "get",
            "node",
            "lifecycle-node",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status} {.metadata.labels.gpu-dra\\.dev/role}",
        ],
    )?;
    ensure!(ready == "True test", "node Ready/label: {ready:?}");

    // `run` starts a process the cluster owns: it survives the script, does not count as a cluster component, and
    // `down` stops it too. A process that dies at once is reported with its log, and the cluster stays up.
    run_ok(&dir, &["run", "sleeper", "sleep", "600"], &[])?;
    let sleeper = recorded(&dir)?.into_iter().find(|(n, _)| n == "sleeper").context("sleeper not recorded")?;
    ensure!(alive(&dir, sleeper.1), "sleeper not running");
    let failed = run(&dir, &["run", "broken", "sh", "-c", "echo no such thing >&2; exit 3"], &[])?;
    ensure!(!failed.status.success() && text(&failed.stderr).contains("no such thing"), "{}", text(&failed.stderr));
    let (_, stderr) = run_ok(&dir, &["up"], &[])?;
    ensure!(stderr.contains("already up"), "a dead `run` process made the cluster look stale:\n{stderr}");
    let pids = recorded(&dir)?;

    run_ok(&dir, &["down"], &[])?;
    ensure!(!dir.exists(), "down left {}", dir.display());
    ensure_none_alive(&dir, &pids, Duration::from_secs(1))?;
    let (_, stderr) = run_ok(&dir, &["down"], &[])?;
    ensure!(stderr.contains("nothing to stop"), "second down: {stderr}");
    Ok(())
}

fn component_dying_during_up_fails_and_leaves_nothing() -> anyhow::Result<()> {
    let dir = state_dir("dying");
    let out = run(&dir, &["up"], &[("GPU_DRA_E2E_SCHEDULER_FLAGS", "--no-such-flag")])?;
    let stderr = text(&out.stderr);
    ensure!(!out.status.success(), "up succeeded with a broken scheduler");
    ensure!(
        stderr.contains("kube-scheduler exited during start-up") && stderr.contains("no-such-flag"),
        "up does not say which component died and why:\n{stderr}"
    );
    ensure_none_alive(&dir, &recorded(&dir)?, Duration::from_secs(1))?;
    // The directory is stale now; the next up (or down) cleans it.
    run_ok(&dir, &["down"], &[])?;
    Ok(())
}

fn pinned_api_port_in_use_is_named() -> anyhow::Result<()> {
    let dir = state_dir("port");
    let taken = TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.port().to_string();
    let out = run(&dir, &["up"], &[("GPU_DRA_E2E_API_PORT", &port)])?;
    let stderr = text(&out.stderr);
    ensure!(!out.status.success(), "up succeeded on a port in use");
    ensure!(
        stderr.contains(&format!("port {port} on 127.0.0.1 is already in use")),
        "up does not name the port in use:\n{stderr}"
    );
    ensure_none_alive(&dir, &recorded(&dir)?, Duration::from_secs(1))?;
    run_ok(&dir, &["down"], &[])?;
    Ok(())
}

fn killed_owner_stops_the_cluster() -> anyhow::Result<()> {
    let dir = state_dir("owner");
    let mut owner = Command::new("sleep").arg("600").spawn()?;
    let owner_pid = owner.id().to_string();
    run_ok(&dir, &["up"], &[("GPU_DRA_E2E_OWNER_PID", &owner_pid)])?;
    let pids = recorded(&dir)?;
    ensure!(pids.iter().any(|(n, _)| n == "watchdog"), "no watchdog recorded: {pids:?}");
    owner.kill()?;
    owner.wait()?;
    ensure_none_alive(&dir, &pids, Duration::from_secs(30))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while dir.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    ensure!(!dir.exists(), "the watchdog did not remove {}", dir.display());
    Ok(())
}

/// A test binary that dies leaves its watchdog to stop its cluster; when the next run of that binary has already
/// started a cluster in the same directory, the old watchdog's `down --owner OLD` must leave it alone (it once read
/// the new run's pids and killed its etcd mid-start). `up` and `down` also hold a lock on the directory, so such a
/// `down` already under way finishes before the next `up` looks at the directory.
fn an_ended_runs_watchdog_never_stops_the_next_run() -> anyhow::Result<()> {
    let dir = state_dir("successor");
    let mut owner = Command::new("sleep").arg("600").spawn()?;
    run_ok(&dir, &["up"], &[("GPU_DRA_E2E_OWNER_PID", &owner.id().to_string())])?;
    let pids = recorded(&dir)?;
    // What the watchdog of an earlier run, owned by a process now gone, runs.
    let (_, stderr) = run_ok(&dir, &["down", "--owner", "1"], &[])?;
    ensure!(stderr.contains("no longer belongs to process 1"), "down --owner of another run said:\n{stderr}");
    for (name, pid) in &pids {
        ensure!(alive(&dir, *pid), "{name} (pid {pid}) was stopped by another run's watchdog");
    }
    ensure!(kubectl(&dir, &["get", "--raw", "/readyz"])? == "ok", "the cluster is not ready any more");
    owner.kill()?;
    owner.wait()?;
    ensure_none_alive(&dir, &pids, Duration::from_secs(30)).context("its own watchdog did not stop it")?;
    Ok(())
}

/// `up` judges a component alive by its command line naming the state directory. Right after `&` the pid is still a
/// fork of the script, with the script's command line, so a component slow to exec on a loaded machine was taken
/// for dead: CI once failed "kube-controller-manager exited during start-up" with an empty log. `detach` (both
/// scripts start components with it) returns only once the command runs; without that wait, a few of these 200
/// starts see the script's command line (8 of 200 on an idle 2-core machine).
fn a_started_component_already_runs_its_command() -> anyhow::Result<()> {
    let detach = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/detach.sh");
    let probe = r#"
        source "$1"
        # A loaded machine, as in CI: children wait longer for a core before they exec.
        for _ in 1 2 3 4; do timeout 60 sh -c 'while :; do :; done' & done
        early=0
        for i in $(seq 200); do
            detach /dev/null sleep 61.25
            # argv[0] by a builtin: a forked reader would give the child time to exec.
            read -r -d '' argv0 </proc/$DETACHED_PID/cmdline
            [[ "$argv0" == bash ]] && early=$((early + 1))
            kill -KILL "$DETACHED_PID"
        done
        kill $(jobs -p) 2>/dev/null
        echo "$early"
    "#;
    let out = Command::new("bash").args(["-c", probe, "probe"]).arg(&detach).output()?;
    ensure!(out.status.success(), "the probe failed:\n{}", text(&out.stderr));
    let early = text(&out.stdout).trim().to_owned();
    ensure!(early == "0", "{early} of 200 detached processes did not run their command yet when detach returned");
    Ok(())
}

fn stale_state_from_a_killed_run_is_cleaned() -> anyhow::Result<()> {
    let dir = state_dir("stale");
    run_ok(&dir, &["up"], &[])?;
    let old = recorded(&dir)?;
    let (_, apiserver) = old.iter().find(|(n, _)| n == "kube-apiserver").context("no apiserver")?;
    let status = Command::new("kill").args(["-KILL", &apiserver.to_string()]).status()?;
    ensure!(status.success(), "kill -KILL failed");

    let (_, stderr) = run_ok(&dir, &["up"], &[])?;
    ensure!(stderr.contains("found stale state"), "up did not report the stale state:\n{stderr}");
    ensure_none_alive(&dir, &old, Duration::from_secs(1))
        .context("processes of the killed run survived the next up")?;
    let nodes = kubectl(&dir, &["get", "--raw", "/readyz"])?;
    ensure!(nodes == "ok", "fresh cluster not ready: {nodes}");
    run_ok(&dir, &["down"], &[])?;
    Ok(())
}

/// With nothing cached, a missing `go` command or a disabled module proxy is named, with what to do.
fn build_script_names_missing_go_and_proxy() -> anyhow::Result<()> {
    let empty_cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("empty-k8s-cache");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/build-k8s.sh");
    let go = Command::new("sh").args(["-c", "command -v go"]).output()?;
    let go_dir = Path::new(text(&go.stdout).trim()).parent().map(Path::to_path_buf).context("go not found")?;
    let path_without_go: Vec<String> =
        std::env::var("PATH")?.split(':').filter(|dir| Path::new(dir) != go_dir).map(str::to_string).collect();
    let no_go =
        Command::new(&script).env("GPU_DRA_CACHE", &empty_cache).env("PATH", path_without_go.join(":")).output()?;
    ensure!(!no_go.status.success(), "build-k8s.sh succeeded without go");
    ensure!(text(&no_go.stderr).contains("the 'go' command is not on PATH; install Go"), "{}", text(&no_go.stderr));

    let no_proxy = Command::new(&script).env("GPU_DRA_CACHE", &empty_cache).env("GOPROXY", "off").output()?;
    ensure!(!no_proxy.status.success(), "build-k8s.sh succeeded with GOPROXY=off");
    ensure!(text(&no_proxy.stderr).contains("GOPROXY is 'off'"), "{}", text(&no_proxy.stderr));
    let version = support::cluster::pinned_kubernetes_version()?;
    ensure!(!empty_cache.join(format!("k8s-{version}")).exists(), "something was built");
    Ok(())
}

/// The command line of the recorded component `name`, arguments joined by spaces.
fn cmdline_of(dir: &Path, name: &str) -> anyhow::Result<String> {
    let (_, pid) = recorded(dir)?.into_iter().find(|(n, _)| n == name).with_context(|| format!("no {name}"))?;
    Ok(text(&std::fs::read(format!("/proc/{pid}/cmdline"))?).replace('\0', " "))
}

/// `GPU_DRA_E2E_FEATURE_GATES`, `_RUNTIME_CONFIG` and `_KCM_CONTROLLERS` reach the components (an API group off by
/// default is served, the extra controller runs); a malformed value is refused before anything starts.
fn feature_gates_runtime_config_and_controllers_reach_the_components() -> anyhow::Result<()> {
    let dir = state_dir("gates");
    let bad = run(&dir, &["up"], &[("GPU_DRA_E2E_KCM_CONTROLLERS", "job-controller;rm")])?;
    ensure!(!bad.status.success(), "up accepted a malformed controller list");
    ensure!(
        text(&bad.stderr).contains("GPU_DRA_E2E_KCM_CONTROLLERS='job-controller;rm' is malformed"),
        "{}",
        text(&bad.stderr)
    );
    ensure!(!dir.exists(), "a refused up left {}", dir.display());

    let gates = "GenericWorkload=true,DRAWorkloadResourceClaims=true";
    let env = [
        ("GPU_DRA_E2E_FEATURE_GATES", gates),
        ("GPU_DRA_E2E_RUNTIME_CONFIG", "scheduling.k8s.io/v1beta1=true"),
        ("GPU_DRA_E2E_KCM_CONTROLLERS", "job-controller"),
    ];
    let (_, stderr) = run_ok(&dir, &["up"], &env)?;
    let apiserver = cmdline_of(&dir, "kube-apiserver")?;
    ensure!(apiserver.contains(&format!("DRADerivedAttributes=true,{gates}")), "apiserver: {apiserver}");
    ensure!(apiserver.contains("--runtime-config scheduling.k8s.io/v1beta1=true"), "apiserver: {apiserver}");
    for component in ["kube-scheduler", "kube-controller-manager"] {
        let cmdline = cmdline_of(&dir, component)?;
        ensure!(cmdline.contains(&format!("--feature-gates {gates}")), "{component}: {cmdline}");
    }
    let kcm = cmdline_of(&dir, "kube-controller-manager")?;
    ensure!(kcm.contains("namespace-controller,job-controller"), "kcm: {kcm}");
    ensure!(stderr.contains("job-controller"), "up does not name the controllers: {stderr}");
    let versions = kubectl(&dir, &["api-versions"])?;
    ensure!(versions.lines().any(|v| v == "scheduling.k8s.io/v1beta1"), "not served: {versions}");
    run_ok(&dir, &["down"], &[])?;
    Ok(())
}
