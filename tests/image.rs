//! The image is built the way CI builds: the Dockerfile's cargo command is exactly the one `make test` runs (through
//! `make release`), and the one the demo and `e2e/gpu-check.sh` run. There is no container engine here to build the
//! image itself; hadolint checks the Dockerfile in `make lint`. `e2e/build-images.sh` builds the image's content
//! without one, from the Dockerfile's runtime stage, and the pause and workload images a real node runs; the tests
//! below check those archives as containerd would import them and run their content with `chroot`.

#[path = "image/containerd.rs"]
mod containerd;
#[path = "image/layout.rs"]
mod layout;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use layout::{Layout, run, sha256};

const BUILD: &str = "cargo build --release --locked";

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The lines of `make`'s recipe for `target`, with `$(CARGO)` as `cargo`.
fn recipe(makefile: &str, target: &str) -> Vec<String> {
    let mut lines = makefile.lines().skip_while(|l| !l.starts_with(&format!("{target}:"))).skip(1);
    let mut recipe = Vec::new();
    for line in lines.by_ref() {
        let Some(command) = line.strip_prefix('\t') else { break };
        recipe.push(command.replace("$(CARGO)", "cargo"));
    }
    recipe
}

#[test]
fn the_dockerfile_builds_with_the_command_ci_runs() {
    let dockerfile = read("Dockerfile");
    let builds: Vec<&str> = dockerfile.lines().filter(|l| l.contains("cargo build")).map(str::trim).collect();
    assert_eq!(builds.len(), 1, "one cargo build in the Dockerfile: {builds:?}");
    assert!(builds[0].starts_with(BUILD), "the Dockerfile builds with {:?}, not {BUILD:?}", builds[0]);

    let makefile = read("Makefile");
    assert_eq!(recipe(&makefile, "release"), [BUILD], "make release");
    // `make test` builds its prerequisites (release among them) through `test-prerequisites`, two at a time.
    let test_recipe = recipe(&makefile, "test");
    assert!(test_recipe.iter().any(|l| l.contains("test-prerequisites")), "make test: {test_recipe:?}");
    let prerequisites = makefile.lines().find(|l| l.starts_with("test-prerequisites:")).unwrap_or_default();
    assert!(
        prerequisites.split_whitespace().any(|w| w == "release"),
        "make test must build release first: {prerequisites}"
    );
    let ci = read(".ci/run");
    assert!(ci.lines().any(|l| l.trim() == "make test"), "CI runs make test:\n{ci}");

    for script in ["e2e/demo.sh", "e2e/demo-real-node.sh", "e2e/gpu-check.sh"] {
        let text = read(script);
        let commands: Vec<&str> =
            text.lines().filter(|l| l.contains("cargo build") && !l.trim_start().starts_with('#')).collect();
        assert!(
            commands.iter().all(|l| l.contains(&format!("&& {BUILD})")) || l.contains(&format!("({BUILD})"))),
            "{script} builds differently: {commands:?}"
        );
    }
}

const PAUSE: &str = "registry.k8s.io/pause:3.10.2";
const WORKLOAD: &str = "docker.io/library/busybox:gpu-dra-e2e";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh directory for one test under Cargo's scratch space.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("image-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
}

/// The gpu-dra image's name: the chart's default image (image.repository, tag = appVersion).
fn gpu_dra_name() -> String {
    let values = read("charts/gpu-dra/values.yaml");
    let repository = values.split("\nimage:\n").nth(1).and_then(|image| {
        image.lines().find_map(|l| l.trim().strip_prefix("repository:")).map(|r| r.trim().to_string())
    });
    let chart = read("charts/gpu-dra/Chart.yaml");
    let tag = chart.lines().find_map(|l| l.strip_prefix("appVersion:")).map(|t| t.trim().trim_matches('"').to_string());
    format!("{}:{}", repository.unwrap_or_default(), tag.unwrap_or_default())
}

fn cargo_version() -> String {
    read("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("version = \"").map(|v| v.trim_end_matches('"').to_string()))
        .unwrap_or_default()
}

/// The release binary the image ships; `make test` builds it first (`make release`).
fn release_binary() -> PathBuf {
    // In the target directory this test was built in (wherever CARGO_TARGET_DIR or cargo's configuration put it).
    let test_build = Path::new(env!("CARGO_BIN_EXE_gpu-dra"));
    let binary = test_build.parent().and_then(Path::parent).unwrap_or(Path::new("target")).join("release/gpu-dra");
    assert!(binary.is_file(), "{} is missing: run `make release` (make test builds it first)", binary.display());
    binary
}

/// Runs `e2e/build-images.sh --binary <release binary> ARGS OUT`: (success, stdout, stderr).
fn build_images(args: &[&str], out: &Path) -> (bool, String, String) {
    let output = Command::new(repo().join("e2e/build-images.sh"))
        .arg("--binary")
        .arg(release_binary())
        .args(args)
        .arg(out)
        .output()
        .unwrap_or_else(|e| panic!("run e2e/build-images.sh: {e}"));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (output.status.success(), text(&output.stdout), text(&output.stderr))
}

/// The images, built once for the tests of this binary.
struct Built {
    dir: PathBuf,
    stdout: String,
}

fn built() -> &'static Built {
    static BUILT: OnceLock<Built> = OnceLock::new();
    BUILT.get_or_init(|| {
        release_binary();
        let dir = scratch("built");
        let started = Instant::now();
        let (ok, stdout, stderr) = build_images(&[], &dir.join("out"));
        assert!(ok, "e2e/build-images.sh failed:\n{stdout}{stderr}");
        eprintln!("e2e/build-images.sh took {:.1?}:\n{stdout}", started.elapsed());
        Built { dir, stdout }
    })
}

/// Unpacks one of the built archives into a directory of its own (tests run in parallel).
fn open(file: &str) -> Layout {
    static OPENED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = OPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let built = built();
    Layout::open(&built.dir.join("out").join(file), &built.dir.join(format!("{}-{n}", file.trim_end_matches(".tar"))))
}

#[test]
fn every_archive_is_an_oci_layout_containerd_names_by_its_full_name() {
    for (file, name) in
        [("pause.tar", PAUSE.to_string()), ("workload.tar", WORKLOAD.into()), ("gpu-dra.tar", gpu_dra_name())]
    {
        let image = open(file);
        // The full name, so that `ctr images import` stores exactly it (a tag alone gets an `import-<date>:` prefix);
        // the OCI ref.name is the tag, as containerd's own exporter writes it.
        let tag = name.rsplit_once(':').map(|(_, t)| t.to_string()).unwrap_or_default();
        assert_eq!(image.names(), (name.clone(), tag), "{file}");
        let manifest = image.index["manifests"][0]["digest"].as_str().unwrap_or_default().to_string();
        let line = format!("{file} {name} {manifest} ");
        assert!(built().stdout.lines().any(|l| l.starts_with(&line)), "{line:?} not printed:\n{}", built().stdout);
    }
    // The two busybox images share their one layer: containerd stores and unpacks it once.
    assert_eq!(open("pause.tar").config["rootfs"], open("workload.tar").config["rootfs"]);
}

/// The values the Dockerfile's runtime stage gives, read with plain string handling (not the builder's parser):
/// USER, ENTRYPOINT and the LABELs with the release build arguments filled in.
fn dockerfile_runtime_stage() -> (String, serde_json::Value, serde_json::Value) {
    let dockerfile = read("Dockerfile");
    let stage = dockerfile.rsplit("\nFROM ").next().unwrap_or_default();
    let line = |keyword: &str| {
        stage.lines().find_map(|l| l.strip_prefix(keyword)).map(|v| v.trim().to_string()).unwrap_or_default()
    };
    let revision = run(Command::new("git").arg("-C").arg(repo()).args(["rev-parse", "HEAD"]));
    let mut labels = serde_json::Map::new();
    for label in stage.split("org.opencontainers.image.").skip(1) {
        let (key, value) = label.split_once("=\"").unwrap_or_default();
        let value = value.split('"').next().unwrap_or_default();
        let value = value.replace("${VERSION}", &cargo_version()).replace("${REVISION}", revision.trim());
        labels.insert(format!("org.opencontainers.image.{key}"), value.into());
    }
    let entrypoint = serde_json::from_str(&line("ENTRYPOINT ")).unwrap_or_default();
    (line("USER "), entrypoint, labels.into())
}

#[test]
fn the_gpu_dra_image_is_the_dockerfiles_runtime_stage_and_runs() {
    let image = open("gpu-dra.tar");
    let (user, entrypoint, labels) = dockerfile_runtime_stage();
    assert_eq!(user, "65532:65532");
    let config = &image.config["config"];
    assert_eq!(config["User"], user.as_str());
    assert_eq!(config["Entrypoint"], entrypoint);
    assert_eq!(config["Entrypoint"], serde_json::json!(["/gpu-dra"]));
    assert_eq!(labels["org.opencontainers.image.version"], cargo_version().as_str());
    // The Dockerfile's labels, but the base's name: the stand-in says what it is instead, so that a scanner or a
    // reader does not take it for distroless (whose packages it does not have).
    let base = "org.opencontainers.image.base.name";
    assert_eq!(labels[base], "gcr.io/distroless/cc-debian12:nonroot");
    let stand_in = config["Labels"]["dev.gpu-dra.image.base-stand-in"].as_str().unwrap_or_default();
    assert!(
        stand_in.starts_with("gcr.io/distroless/cc-debian12:nonroot stood in for") && stand_in.contains("libc.so"),
        "{stand_in:?}"
    );
    let mut expected = labels.clone();
    if let Some(without_base) = expected.as_object_mut() {
        without_base.remove(base);
    }
    expected["dev.gpu-dra.image.base-stand-in"] = stand_in.into();
    assert_eq!(config["Labels"], expected);

    let rootfs = image.rootfs();
    let binary = release_binary();
    let shipped = rootfs.join("gpu-dra");
    assert_eq!(sha256(&shipped, false), sha256(&binary, false), "/gpu-dra is not target/release/gpu-dra");
    let mode = std::fs::metadata(&shipped).map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()));
    assert_eq!(mode.map(|m| m & 0o7777).ok(), Some(0o755), "/gpu-dra's mode (install -m 0755 in the build stage)");
    // The licenses travel with the binary: gpu-dra's and the notices of the crates built into it, the repository's
    // files (not the binary `--binary` names), readable by anyone.
    for license in ["LICENSE", "THIRD-PARTY-NOTICES"] {
        let inside = rootfs.join("usr/share/doc/gpu-dra").join(license);
        assert_eq!(sha256(&inside, false), sha256(&repo().join(license), false), "/usr/share/doc/gpu-dra/{license}");
        let mode = std::fs::metadata(&inside).map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()));
        assert_eq!(mode.map(|m| m & 0o7777).ok(), Some(0o644), "{license}'s mode");
    }
    // Every library ldd names, and the loader at the path the binary names, with this machine's content.
    let ldd = run(Command::new("ldd").arg(&binary));
    let libraries: Vec<&str> =
        ldd.split_whitespace().filter(|w| w.starts_with('/') && !w.starts_with("/proc")).collect();
    assert!(
        libraries.iter().any(|l| l.contains("libc.so")) && libraries.iter().any(|l| l.contains("ld-linux")),
        "{ldd}"
    );
    for library in libraries {
        let inside = rootfs.join(library.trim_start_matches('/'));
        assert!(inside.is_file(), "{library} (from ldd) is missing in the image");
        assert_eq!(sha256(&inside, false), sha256(Path::new(library), false), "{library}");
    }
    // The image's own content runs, as the image's user: the binary, its loader and its C library.
    let version =
        run(Command::new("chroot").arg(format!("--userspec={user}")).arg(&rootfs).arg("/gpu-dra").arg("--version"));
    let expected = format!("gpu-dra {} commit=", cargo_version());
    assert!(version.starts_with(&expected), "--version in the image printed {version:?}, not {expected}…");
}

#[test]
fn the_workload_image_runs_the_shell_a_gpu_pod_runs() {
    let rootfs = open("workload.tar").rootfs();
    let out = run(Command::new("chroot")
        .arg(&rootfs)
        .args(["/bin/sh", "-c", "ls -l /dev/null /bin/sh; echo uuids=$GPU_DRA_GPU_UUIDS"])
        .env("GPU_DRA_GPU_UUIDS", "GPU-0c4ec4ec"));
    assert!(out.contains("/bin/sh -> /bin/busybox") && out.contains("uuids=GPU-0c4ec4ec"), "{out}");
}

/// A child process that does not outlive a failed test.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_pause_image_waits_as_pid_1_and_exits_0_on_term() {
    let image = open("pause.tar");
    let rootfs = image.rootfs();
    let entrypoint: Vec<String> =
        serde_json::from_value(image.config["config"]["Entrypoint"].clone()).unwrap_or_default();
    assert!(!entrypoint.is_empty(), "{}", image.config);
    // PID 1 of a new PID namespace, as in a pod sandbox: the kernel delivers only signals it has a handler for.
    let unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "chroot"])
        .arg(&rootfs)
        .args(&entrypoint)
        .spawn()
        .unwrap_or_else(|e| panic!("unshare: {e}"));
    let mut unshare = KillOnDrop(unshare);
    let children = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    // The pause process is running once it has started its sleep (after installing the trap).
    let deadline = Instant::now() + Duration::from_secs(10);
    let pause = loop {
        let pid = children(unshare.0.id()).split_whitespace().next().and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid.filter(|&p| !children(p).trim().is_empty()) {
            break pid;
        }
        assert!(Instant::now() < deadline, "the pause process did not start");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(unshare.0.try_wait().ok().flatten().is_none(), "pause exited on its own");
    run(Command::new("kill").args(["-TERM", &pause.to_string()]));
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = unshare.0.try_wait().unwrap_or_else(|e| panic!("wait: {e}")) {
            break status;
        }
        if Instant::now() > deadline {
            panic!("pause did not exit on TERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "pause exited with {status} on TERM");
}

#[test]
fn the_images_are_deterministic() {
    let first = built();
    let again = scratch("again");
    let (ok, stdout, stderr) = build_images(&[], &again);
    assert!(ok, "{stdout}{stderr}");
    assert_eq!(stdout, first.stdout, "manifest digests differ between two builds");
    for file in ["pause.tar", "workload.tar", "gpu-dra.tar"] {
        assert_eq!(sha256(&again.join(file), false), sha256(&first.dir.join("out").join(file), false), "{file}");
    }
}

#[test]
fn bad_input_is_refused_with_what_to_do() {
    let dir = scratch("bad");
    let dockerfile = read("Dockerfile");
    let edited = |name: &str, from: &str, to: &str| -> String {
        assert!(dockerfile.contains(from), "the Dockerfile has no {from:?}");
        let path = dir.join(name);
        std::fs::write(&path, dockerfile.replacen(from, to, 1)).unwrap_or_else(|e| panic!("{e}"));
        path.display().to_string()
    };
    let run_in_runtime = edited("run", "\nUSER ", "\nRUN mkdir /data\nUSER ");
    let line = dockerfile.lines().position(|l| l.starts_with("USER ")).map(|i| i + 1).unwrap_or_default();
    let cases: Vec<(Vec<String>, Vec<String>)> = vec![
        (vec!["--binary".into(), "/nonexistent/gpu-dra".into()], vec!["make release".into()]),
        (vec!["--busybox".into(), "/nonexistent/busybox".into()], vec!["busybox-static".into()]),
        (vec!["--busybox".into(), "/bin/ls".into()], vec!["dynamically linked".into(), "busybox-static".into()]),
        (
            vec!["--dockerfile".into(), run_in_runtime.clone()],
            vec![format!("{run_in_runtime}:{line}: "), "has RUN".into()],
        ),
        (
            vec!["--dockerfile".into(), edited("base", "cc-debian12:nonroot\n", "static-debian12\n")],
            vec!["gcr.io/distroless/static-debian12 is not one".into(), "STAND_IN_BASES".into()],
        ),
        (
            vec!["--dockerfile".into(), edited("shell", "ENTRYPOINT [\"/gpu-dra\"]", "ENTRYPOINT /gpu-dra")],
            vec!["exec form".into()],
        ),
        (vec!["--dockerfile".into(), edited("var", "${REVISION}", "${COMMIT}")], vec!["$COMMIT is not an ARG".into()]),
        (
            vec!["--dockerfile".into(), edited("copy", "/out/gpu-dra /gpu-dra", "/out/other /gpu-dra")],
            vec!["no `install -m MODE SRC /out/other`".into()],
        ),
    ];
    for (args, expected) in cases {
        let out = dir.join("out");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, stdout, stderr) = build_images(&args, &out);
        assert!(!ok, "{args:?} succeeded:\n{stdout}");
        for e in &expected {
            assert!(stderr.contains(e.as_str()), "{args:?}: {e:?} not in:\n{stderr}");
        }
        assert!(!out.join("gpu-dra.tar").exists(), "{args:?} wrote an archive");
    }
}

/// THIRD-PARTY-NOTICES is what Cargo.lock gives (`make lint` checks it too): the crates built into the binary with
/// their license texts, not the build-time (.proto compiler) or test-only crates; a file that is not refused naming
/// the command that writes it.
#[test]
fn the_third_party_notices_are_the_crates_built_into_the_binary() {
    let script = repo().join("e2e/third_party_notices.py");
    run(Command::new("python3").arg(&script).arg("--check"));
    let notices = read("THIRD-PARTY-NOTICES");
    let listed = |name: &str| notices.lines().any(|l| l.starts_with(&format!("{name} ")));
    for shipped in ["tokio", "kube-client", "tonic", "prost", "nvml-wrapper", "serde_json", "rustls"] {
        assert!(listed(shipped), "{shipped} is built into the binary but not in THIRD-PARTY-NOTICES");
    }
    for not_shipped in ["protox", "tonic-prost-build", "prost-build", "libtest-mimic"] {
        assert!(!listed(not_shipped), "{not_shipped} (build or test only) is in THIRD-PARTY-NOTICES");
    }
    assert!(notices.contains("Permission is hereby granted, free of charge"), "no MIT text");
    assert!(notices.contains("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION"), "no Apache-2.0 text");

    let stale = scratch("notices").join("THIRD-PARTY-NOTICES");
    let without_tokio: String =
        notices.lines().filter(|l| !l.starts_with("tokio ")).map(|l| format!("{l}\n")).collect();
    std::fs::write(&stale, without_tokio).unwrap_or_else(|e| panic!("{}: {e}", stale.display()));
    let out = Command::new("python3").arg(&script).arg("--check").arg("--file").arg(&stale).output();
    let out = out.unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a stale file passed the check");
    assert!(
        stderr.contains("is not what Cargo.lock gives") && stderr.contains("run e2e/third_party_notices.py"),
        "{stderr}"
    );
}
