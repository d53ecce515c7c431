//! Reading what `e2e/build-images.sh` writes, with the tools a node operator has (`tar`, `gzip`, `sha256sum`), and
//! checking it against the OCI image layout and image specs as containerd's importer reads them.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Runs a command, failing the test with its output when it fails; returns its stdout.
pub(crate) fn run(command: &mut Command) -> String {
    let output = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `sha256:<hex>` of a file, or of its gunzipped content (a layer's diff_id).
pub(crate) fn sha256(path: &Path, gunzip: bool) -> String {
    let script = if gunzip { "gzip -dc \"$0\" | sha256sum" } else { "sha256sum < \"$0\"" };
    let out = run(Command::new("sh").args(["-c", script]).arg(path));
    format!("sha256:{}", out.split_whitespace().next().unwrap_or_default())
}

fn json(path: &Path) -> Value {
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An image archive, unpacked: its index, manifest, config and layer blobs, each checked against its descriptor.
pub(crate) struct Layout {
    pub(crate) dir: PathBuf,
    pub(crate) index: Value,
    pub(crate) config: Value,
    pub(crate) layers: Vec<PathBuf>,
}

impl Layout {
    /// Unpacks `archive` into `dir` and checks the chain index → manifest → config and layers: every descriptor's
    /// digest and size match the blob, every blob is named by its digest, every diff_id is the digest of the
    /// uncompressed layer, and no blob is left unreferenced.
    pub(crate) fn open(archive: &Path, dir: &Path) -> Layout {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        run(Command::new("tar").arg("-xf").arg(archive).arg("-C").arg(dir));
        assert_eq!(json(&dir.join("oci-layout")), serde_json::json!({"imageLayoutVersion": "1.0.0"}));
        let index = json(&dir.join("index.json"));
        assert_eq!(index["schemaVersion"], 2);
        assert_eq!(index["mediaType"], "application/vnd.oci.image.index.v1+json");
        let manifests = index["manifests"].as_array().cloned().unwrap_or_default();
        assert_eq!(manifests.len(), 1, "one image per archive: {index}");
        assert_eq!(manifests[0]["mediaType"], "application/vnd.oci.image.manifest.v1+json");

        let mut referenced = Vec::new();
        let mut blob = |descriptor: &Value, media_type: &str| -> PathBuf {
            assert_eq!(descriptor["mediaType"], media_type, "{descriptor}");
            let digest = descriptor["digest"].as_str().unwrap_or_default().to_string();
            let path = dir.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
            assert_eq!(sha256(&path, false), digest, "{} holds other content", path.display());
            let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or_default();
            assert_eq!(descriptor["size"].as_u64(), Some(size), "size of {digest}");
            referenced.push(path.clone());
            path
        };
        let manifest = json(&blob(&manifests[0], "application/vnd.oci.image.manifest.v1+json"));
        assert_eq!(manifest["schemaVersion"], 2);
        let config = json(&blob(&manifest["config"], "application/vnd.oci.image.config.v1+json"));
        let layers: Vec<PathBuf> = manifest["layers"]
            .as_array()
            .map(|l| l.iter().map(|d| blob(d, "application/vnd.oci.image.layer.v1.tar+gzip")).collect())
            .unwrap_or_default();

        let diff_ids: Vec<String> = layers.iter().map(|l| sha256(l, true)).collect();
        assert_eq!(config["rootfs"], serde_json::json!({"type": "layers", "diff_ids": diff_ids}));
        let goarch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        assert_eq!((config["architecture"].as_str(), config["os"].as_str()), (Some(goarch), Some("linux")));
        assert_eq!(manifests[0]["platform"], serde_json::json!({"architecture": goarch, "os": "linux"}));

        let mut blobs: Vec<PathBuf> = std::fs::read_dir(dir.join("blobs/sha256"))
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        blobs.sort();
        referenced.sort();
        referenced.dedup();
        assert_eq!(blobs, referenced, "blobs no descriptor names");
        Layout { dir: dir.to_path_buf(), index, config, layers }
    }

    /// The annotations containerd's `ctr images import` names the image by.
    pub(crate) fn names(&self) -> (String, String) {
        let annotations = &self.index["manifests"][0]["annotations"];
        let name = |key: &str| annotations[key].as_str().unwrap_or_default().to_string();
        (name("io.containerd.image.name"), name("org.opencontainers.image.ref.name"))
    }

    /// The image's root file system, its layers unpacked in order as a runtime's snapshotter would, with the
    /// `/dev/null` every runtime provides (busybox's shell opens it for background jobs).
    pub(crate) fn rootfs(&self) -> PathBuf {
        let rootfs = self.dir.join("rootfs");
        std::fs::create_dir_all(&rootfs).unwrap_or_else(|e| panic!("{}: {e}", rootfs.display()));
        for layer in &self.layers {
            run(Command::new("tar").arg("--numeric-owner").arg("-xzf").arg(layer).arg("-C").arg(&rootfs));
        }
        std::fs::create_dir_all(rootfs.join("dev")).unwrap_or_else(|e| panic!("{}: {e}", rootfs.display()));
        run(Command::new("mknod").args(["-m", "666"]).arg(rootfs.join("dev/null")).args(["c", "1", "3"]));
        rootfs
    }
}
