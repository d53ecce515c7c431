//! The release as a user gets it: one version everywhere (Cargo.toml's is the source), the packaged chart (not the
//! source directory) installed on the cluster, and the build each running component reports.

use super::*;

/// Cargo.toml's version: every other version string must say the same.
const VERSION: &str = env!("CARGO_PKG_VERSION");

fn read(path: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).with_context(|| format!("read {path}"))
}

/// The value of the first line `KEY VALUE` (after `prefix`) in `text`, quotes removed.
fn value_after(text: &str, prefix: &str) -> Option<String> {
    text.lines().find_map(|l| l.strip_prefix(prefix)).map(|v| v.trim().trim_matches('"').to_string())
}

/// The newest release heading of a Keep a Changelog file (`## [0.1.0] - 2026-12-01`), skipping `[Unreleased]`.
fn changelog_release(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("## ["))
        .filter_map(|l| l.split_once(']').map(|(v, _)| v.to_string()))
        .find(|v| v != "Unreleased")
}

pub(super) async fn release_has_one_version_everywhere(_ctx: TestContext) -> anyhow::Result<()> {
    let chart = read("charts/gpu-dra/Chart.yaml")?;
    let dockerfile = read("Dockerfile")?;
    let rendered = render("gpu-dra", "gpu-dra", false, &[])?;
    let mut images: Vec<String> = rendered
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("image: "))
        .map(|i| i.trim_matches('"').rsplit_once(':').map(|(_, tag)| tag.to_string()).unwrap_or_default())
        .collect();
    images.sort();
    images.dedup();
    ensure!(!images.is_empty(), "no image in the rendered chart");
    let found = [
        ("charts/gpu-dra/Chart.yaml version", value_after(&chart, "version:")),
        ("charts/gpu-dra/Chart.yaml appVersion (the default image tag)", value_after(&chart, "appVersion:")),
        ("the tag of the rendered chart's images", Some(images.join(","))),
        ("the Dockerfile's ARG VERSION", value_after(&dockerfile, "ARG VERSION=")),
        ("the newest release in CHANGELOG.md", changelog_release(&read("CHANGELOG.md")?)),
        ("gpu-dra --version", Some(version_output(&[])?.version)),
    ];
    let wrong: Vec<String> = found
        .iter()
        .filter(|(_, v)| v.as_deref() != Some(VERSION))
        .map(|(what, v)| format!("{what}: {}", v.as_deref().unwrap_or("(missing)")))
        .collect();
    ensure!(wrong.is_empty(), "Cargo.toml's version is {VERSION}; set these to it:\n  {}", wrong.join("\n  "));
    Ok(())
}

/// What `gpu-dra [ARGS] --version` printed.
#[derive(Debug, PartialEq)]
struct VersionOutput {
    version: String,
    commit: String,
    dirty: String,
}

fn version_output(args: &[&str]) -> anyhow::Result<VersionOutput> {
    let output = Command::new(env!("CARGO_BIN_EXE_gpu-dra")).args(args).arg("--version").output()?;
    ensure!(output.status.success(), "gpu-dra --version: {}", text(&output.stderr));
    let line = text(&output.stdout);
    let fields: Vec<&str> = line.split_whitespace().collect();
    let field = |key: &str| fields.iter().find_map(|f| f.strip_prefix(key)).map(str::to_string);
    // The program's name, then the version: `gpu-dra 0.1.0 …`, `gpu-dra-controller 0.1.0 …` for a subcommand.
    match (fields.first(), fields.get(1), field("commit="), field("dirty=")) {
        (Some(name), Some(version), Some(commit), Some(dirty)) if name.starts_with("gpu-dra") => {
            Ok(VersionOutput { version: version.to_string(), commit, dirty })
        }
        _ => bail!("gpu-dra --version printed {line:?}, not `gpu-dra VERSION commit=COMMIT dirty=true|false|unknown`"),
    }
}

/// `git ARGS…` in the source tree, when git and the repository are there.
fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().ok()?;
    output.status.success().then(|| text(&output.stdout).trim().to_string())
}

pub(super) async fn release_version_names_the_commit_and_whether_the_tree_was_dirty(
    _ctx: TestContext,
) -> anyhow::Result<()> {
    let top = version_output(&[])?;
    for subcommand in ["controller", "node-agent", "gpu-check"] {
        ensure!(version_output(&[subcommand])? == top, "gpu-dra {subcommand} --version differs from {top:?}");
    }
    match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(head) => {
            ensure!(top.commit == head, "--version says commit {}, the source tree is at {head}", top.commit);
            ensure!(["true", "false"].contains(&top.dirty.as_str()), "dirty={} in a git checkout", top.dirty);
            // The binary was built from this tree just now: a clean tree cannot have made a dirty build.
            let clean = git(&["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|changes| changes.is_empty());
            ensure!(!clean || top.dirty == "false", "the tree is clean but --version says dirty={}", top.dirty);
        }
        None => ensure!(top.commit == "unknown" && top.dirty == "unknown", "no git here, yet --version says {top:?}"),
    }
    Ok(())
}

pub(super) async fn release_components_report_their_build(ctx: TestContext) -> anyhow::Result<()> {
    let build = version_output(&[])?;
    let node = test_node_name(&ctx, "build-info");
    ctx.cluster.add_node(&node)?;
    let agent = NodeAgent::start(&ctx, &node, &["--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB"])?;
    agent.wait_ready().await?;
    let controller = Component::controller(&ctx, &[]).await?;
    let labels =
        [("version", build.version.as_str()), ("commit", build.commit.as_str()), ("dirty", build.dirty.as_str())];
    for (name, component) in [("controller", &controller), ("node-agent", &agent.process)] {
        let (_, metrics) = component.get("/metrics").await?;
        let samples: Vec<&str> = metrics.lines().filter(|l| l.starts_with("gpu_dra_build_info")).collect();
        ensure!(
            samples.len() == 1 && support::process::sample(&metrics, "gpu_dra_build_info", &labels) == Some(1.0),
            "{name}: /metrics has {samples:?}, not one gpu_dra_build_info{{version, commit, dirty}} 1 for {build:?}"
        );
        let log = component.log_text();
        let start = log.lines().find(|l| l.contains("starting gpu-dra")).unwrap_or_default();
        ensure!(
            [name, build.version.as_str(), build.commit.as_str(), build.dirty.as_str()]
                .iter()
                .all(|f| start.contains(f)),
            "{name} did not log its build at start ({build:?}): {start:?}"
        );
    }
    Ok(())
}

pub(super) async fn release_packaged_chart_installs_on_the_cluster(ctx: TestContext) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let destination = dir.path().to_str().context("temporary directory path")?;
    let chart = chart_dir();
    let packaged = helm(&["package", chart.to_str().context("chart path")?, "--destination", destination])?;
    ensure!(packaged.status.success(), "helm package: {}", text(&packaged.stderr));
    let package = dir.path().join(format!("gpu-dra-{VERSION}.tgz"));
    ensure!(package.exists(), "helm package wrote no gpu-dra-{VERSION}.tgz: {}", text(&packaged.stdout));
    let package = package.to_str().context("package path")?;

    // The schema travels in the package: a wrong value is refused naming it.
    let refused = helm(&["template", "gpu-dra", package, "--set", "controller.replicas=two"])?;
    ensure!(
        !refused.status.success() && text(&refused.stderr).contains("at '/controller/replicas'"),
        "the packaged chart does not refuse a wrong value: {}",
        text(&refused.stderr)
    );

    // The package renders what the source directory renders, and the API server accepts every object of it.
    let release = release(&ctx);
    let driver = format!("driverName=pkg-{}.gpu-dra.dev", &ctx.namespace[ctx.namespace.len() - 6..]);
    let from_package = helm(&["template", &release, package, "--namespace", &ctx.namespace, "--set", &driver])?;
    ensure!(from_package.status.success(), "helm template of the package: {}", text(&from_package.stderr));
    let rendered = text(&from_package.stdout);
    ensure!(
        rendered == render(&release, &ctx.namespace, false, &[driver.as_str()])?,
        "the packaged chart renders differently from charts/gpu-dra: a file is missing from the package"
    );
    let documents = documents(&rendered);
    let applied = apply(&ctx, &documents);
    delete(&ctx, &documents);
    let applied = applied?;
    for (kind, component) in [("Deployment", "controller"), ("DaemonSet", "node-agent")] {
        let image = object(&applied, kind, Some(component))?["spec"]["template"]["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        ensure!(image.ends_with(&format!(":{VERSION}")), "the packaged chart's {component} runs {image}");
    }
    eprintln!("{package}: {} objects accepted by a server-side apply", applied.len());
    Ok(())
}
