//! The image is built the way CI builds: the Dockerfile's cargo command is exactly the one `make test` runs (through
//! `make release`), and the one the demo and `e2e/gpu-check.sh` run. There is no container engine here to build the
//! image itself; hadolint checks the Dockerfile in `make lint`.

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
    let test_line = makefile.lines().find(|l| l.starts_with("test:")).unwrap_or_default();
    assert!(test_line.split_whitespace().any(|w| w == "release"), "make test must depend on release: {test_line}");
    assert!(read(".ci/run").contains("make test") || read("README.md").contains("make test"), "CI runs make test");

    for script in ["e2e/demo.sh", "e2e/gpu-check.sh"] {
        let text = read(script);
        let commands: Vec<&str> =
            text.lines().filter(|l| l.contains("cargo build") && !l.trim_start().starts_with('#')).collect();
        assert!(
            commands.iter().all(|l| l.contains(&format!("&& {BUILD})")) || l.contains(&format!("({BUILD})"))),
            "{script} builds differently: {commands:?}"
        );
    }
}
