//! Compiles the kubelet's plugin APIs (proto/, written for this project from the documented facts) with protox, a
//! pure-Rust protobuf compiler, so that building needs no system `protoc`; and records which source the binary was
//! built from (`gpu-dra --version`, `gpu_dra_build_info`).

use std::path::Path;
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTOS: [&str; 5] = [
        "proto/pluginregistration/v1/api.proto",
        "proto/dra/v1/api.proto",
        "proto/dra/v1beta1/api.proto",
        "proto/dra-health/v1/api.proto",
        "proto/dra-health/v1alpha1/api.proto",
    ];
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    emit_source_identity();
    Ok(())
}

/// Sets `GPU_DRA_GIT_COMMIT` (12 hex digits, or `unknown`) and `GPU_DRA_GIT_DIRTY` (`true`, `false` or `unknown`)
/// for the crate. Read from git when the source is a git checkout; a build without one (a source tarball, a
/// container build whose context leaves `.git` out) may pass the commit as `GPU_DRA_BUILD_COMMIT`, else both are
/// `unknown`: never a guess.
fn emit_source_identity() {
    println!("cargo:rerun-if-env-changed=GPU_DRA_BUILD_COMMIT");
    let given = std::env::var("GPU_DRA_BUILD_COMMIT").ok().filter(|c| !c.trim().is_empty() && c != "unknown");
    let (commit, dirty) = match (given, own_checkout().then(|| git(&["rev-parse", "--short=12", "HEAD"])).flatten()) {
        (Some(commit), _) => (commit.trim().chars().take(12).collect(), "unknown".to_owned()),
        (None, Some(commit)) => {
            watch_git_state();
            // Tracked files only: an untracked scratch file does not change what was built.
            // --no-optional-locks: never refresh the index, which would make the next build run this again.
            let dirty = match git(&["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"]) {
                Some(changes) => (!changes.is_empty()).to_string(),
                None => "unknown".to_owned(),
            };
            (commit, dirty)
        }
        (None, None) => ("unknown".to_owned(), "unknown".to_owned()),
    };
    println!("cargo:rustc-env=GPU_DRA_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=GPU_DRA_GIT_DIRTY={dirty}");
}

/// Reruns this script when the commit or the tree's state may have changed: HEAD (a checkout), the branch's ref
/// (a commit), packed refs, and the sources compiled into the binary (an edit). Not the index: `git status` run by
/// anyone rewrites it, and a rebuild after every `git status` would be a tax; an edit outside these sources (a test,
/// a doc) is reported dirty from the next build that has to run this anyway.
fn watch_git_state() {
    let mut paths = vec!["HEAD".to_owned(), "packed-refs".to_owned()];
    if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
        paths.push(reference);
    }
    for path in paths {
        if let Some(file) = git(&["rev-parse", "--git-path", &path]).filter(|f| Path::new(f).exists()) {
            println!("cargo:rerun-if-changed={file}");
        }
    }
    for source in ["src", "Cargo.toml", "Cargo.lock", "build.rs", "proto"] {
        println!("cargo:rerun-if-changed={source}");
    }
}

/// Whether the crate's directory is the top of a git work tree: a source tarball unpacked inside some other
/// repository must not report that repository's commit.
fn own_checkout() -> bool {
    let top = git(&["rev-parse", "--show-toplevel"]).and_then(|top| Path::new(&top).canonicalize().ok());
    top.is_some() && top == Path::new(env!("CARGO_MANIFEST_DIR")).canonicalize().ok()
}

/// `git ARGS…` in the crate's directory: its trimmed output, or `None` when git or the repository is missing.
fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8(output.stdout).ok().map(|s| s.trim().to_owned())
}
