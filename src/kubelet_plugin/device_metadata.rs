//! Device metadata (KEP-5304, beta in Kubernetes 1.37): a file in each container that uses a claim, saying which
//! devices its request got and their ResourceSlice attributes (UUID, PCI bus id, NUMA node, …), so a workload can
//! find its GPUs without calling NVML or parsing environment variables. Nothing in the kubelet is involved: the
//! driver writes the file on the host and hands the container a CDI device that bind-mounts it, read-only.
//!
//! The layout and format are upstream's (`k8s.io/dynamic-resource-allocation/api/metadata`), the consumer-facing
//! contract that upstream's reader (`devicemetadata.ReadResourceClaimMetadata`) and the example driver's demos rely on:
//! - in the container: `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json`
//!   for a claim the pod names, `…/resourceclaimtemplates/<pod claim>/<request>/…` for one made from a template
//!   (known by the `resource.kubernetes.io/pod-claim-name` annotation the claim controllers set);
//! - the file: a stream of `DeviceMetadata` objects, one per API version, newest first (`v1beta1`, then `v1alpha1`
//!   for 1.36 readers), each on its own line; readers take the first version they know.
//!
//! Where ours differs, and why: the host file lives in the agent's state directory under the claim's UID
//! (`<state-dir>/device-metadata/<uid>/<request>/metadata.json`), so start-up matches directories to checkpoint
//! entries and a claim deleted and created again under its name never finds the old one's file; the mounts are
//! devices of the claim's own CDI spec (`<uid>_<request>`), so a prepare writes one spec and an unprepare removes
//! one, as before. A request's mount is handed out with the first device of that request only, so a container
//! that uses another request of the claim does not see it (as upstream).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::fsutil::write_atomic;

/// The directory in every container under which the files are mounted (upstream's `ContainerDir`).
pub const CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";

/// The API versions written, newest first: readers take the first they know.
const API_VERSIONS: [&str; 2] = ["metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"];

/// The annotation the claim controllers set on a claim made from a template: the pod's name for the claim.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// The subdirectory of the state directory holding the files, one directory per claim UID.
const HOST_SUBDIR: &str = "device-metadata";

/// The API's limit on a device's attributes (the metadata file has the same).
const MAX_ATTRIBUTES: usize = 32;

/// Who the metadata is about: the claim, and the name its pod gave it when it was made from a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimIdentity<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
    pub pod_claim_name: Option<&'a str>,
}

/// One allocated device of a request, as the file lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataDevice {
    pub pool: String,
    pub name: String,
    /// In the ResourceSlice format (`{"uuid": {"string": "GPU-…"}}`).
    pub attributes: serde_json::Map<String, Value>,
}

/// The file's content for one request of a claim: the same object once per API version, each line one object.
/// `request` is the request as allocated (`gpus`, or `gpus/large` for a subrequest); the path uses its base name.
pub fn document(driver: &str, claim: &ClaimIdentity, request: &str, devices: &[MetadataDevice]) -> Vec<u8> {
    let devices: Vec<Value> = devices
        .iter()
        .map(|d| {
            // Sorted by name, at most the API's number: readers validate the count.
            let attributes: BTreeMap<&String, &Value> = d.attributes.iter().take(MAX_ATTRIBUTES).collect();
            let mut device = json!({ "driver": driver, "pool": d.pool, "name": d.name });
            if !attributes.is_empty() {
                device["attributes"] = json!(attributes);
            }
            device
        })
        .collect();
    let mut out = Vec::new();
    for version in API_VERSIONS {
        let mut object = json!({
            "kind": "DeviceMetadata",
            "apiVersion": version,
            "metadata": { "name": claim.name, "namespace": claim.namespace, "uid": claim.uid, "generation": 1 },
            "requests": [{ "name": request, "devices": devices }],
        });
        if let Some(pod_claim) = claim.pod_claim_name {
            object["podClaimName"] = json!(pod_claim);
        }
        // A `Value` always serializes.
        out.extend(serde_json::to_vec(&object).unwrap_or_default());
        out.push(b'\n');
    }
    out
}

/// The pod claim a claim was generated for, from its `resource.kubernetes.io/pod-claim-name` annotation: only a
/// DNS label, which a pod's `spec.resourceClaims[].name` must be. Anyone who may create claims may set the annotation;
/// any other value (`/etc`, `../..`, empty, kilobytes) would move the file's path in the container or swell the
/// checkpoint, so the claim counts as one made by hand.
pub fn pod_claim_name(annotation: Option<&String>) -> Option<String> {
    let name = annotation?;
    let label = name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    label.then(|| name.clone())
}

/// Where a container finds the file of `request` (a base request name) of a claim.
pub fn container_path(driver: &str, claim: &ClaimIdentity, request: &str) -> PathBuf {
    let (subdir, name) = match claim.pod_claim_name {
        Some(pod_claim) => ("resourceclaimtemplates", pod_claim),
        None => ("resourceclaims", claim.name),
    };
    Path::new(CONTAINER_DIR).join(subdir).join(name).join(request).join(format!("{driver}-metadata.json"))
}

/// The directory of a claim's files on the host.
pub fn claim_dir(state_dir: &Path, uid: &str) -> PathBuf {
    state_dir.join(HOST_SUBDIR).join(uid)
}

/// The host file of `request` (a base request name) of a claim.
pub fn host_path(state_dir: &Path, uid: &str, request: &str) -> PathBuf {
    claim_dir(state_dir, uid).join(request).join("metadata.json")
}

/// The CDI device (of the claim's own spec) that mounts the file of `request`: `<uid>_<request>`, apart from the
/// claim's GPU devices (`<uid>-<device>`).
pub fn cdi_device_name(uid: &str, request: &str) -> String {
    format!("{uid}_{request}")
}

/// Writes the files of a claim (base request name, content), replacing any an earlier try left, each atomically
/// and readable by any user (a container's user is not the agent's).
pub fn write_files(state_dir: &Path, uid: &str, files: &[(String, Vec<u8>)]) -> io::Result<()> {
    remove_files(state_dir, uid)?;
    for (request, content) in files {
        let path = host_path(state_dir, uid, request);
        write_atomic(&path, content)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644))?;
        for dir in [claim_dir(state_dir, uid), claim_dir(state_dir, uid).join(request)] {
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
        }
    }
    Ok(())
}

/// Removes a claim's files. Idempotent: a claim without any has nothing to remove.
pub fn remove_files(state_dir: &Path, uid: &str) -> io::Result<()> {
    match fs::remove_dir_all(claim_dir(state_dir, uid)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The claim UIDs that have files on the host, so those of claims no longer prepared can be removed.
pub fn claims_with_files(state_dir: &Path) -> io::Result<Vec<String>> {
    let entries = match fs::read_dir(state_dir.join(HOST_SUBDIR)) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        entries => entries?,
    };
    let mut uids = Vec::new();
    for entry in entries {
        if let Some(name) = entry?.file_name().to_str() {
            uids.push(name.to_string());
        }
    }
    uids.sort();
    Ok(uids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_dns_label_is_a_pod_claim_name() {
        for good in ["gpu", "gpu-0", "a", &"a".repeat(63)] {
            assert_eq!(pod_claim_name(Some(&good.to_string())).as_deref(), Some(good), "{good}");
        }
        for bad in ["", "/etc", "../..", "a/b", "GPU", "-gpu", "gpu-", "gpu.0", &"a".repeat(64)] {
            assert_eq!(pod_claim_name(Some(&bad.to_string())), None, "{bad:?}");
        }
        assert_eq!(pod_claim_name(None), None);
    }

    const DRIVER: &str = "gpu.gpu-dra.dev";

    fn claim(pod_claim_name: Option<&str>) -> ClaimIdentity<'_> {
        ClaimIdentity { namespace: "ml", name: "train-gpu-x7k2q", uid: "3f1c", pod_claim_name }
    }

    fn gpu(name: &str) -> MetadataDevice {
        let mut attributes = serde_json::Map::new();
        attributes.insert("uuid".into(), json!({"string": format!("GPU-{name}")}));
        attributes.insert("resource.kubernetes.io/pciBusID".into(), json!({"string": "0000:18:00.0"}));
        MetadataDevice { pool: "node-1".into(), name: name.into(), attributes }
    }

    fn objects(content: &[u8]) -> Vec<Value> {
        let text = std::str::from_utf8(content).unwrap_or_default();
        assert!(text.ends_with('\n'), "{text}");
        text.lines().map(|l| serde_json::from_str(l).unwrap_or(Value::Null)).collect()
    }

    #[test]
    fn container_paths_follow_how_the_pod_names_the_claim() {
        let cases = [
            (
                None,
                "gpus",
                "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train-gpu-x7k2q/gpus/gpu.gpu-dra.dev-metadata.json",
            ),
            (
                Some("gpu"),
                "gpus",
                "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpus/gpu.gpu-dra.dev-metadata.json",
            ),
        ];
        for (pod_claim, request, want) in cases {
            assert_eq!(container_path(DRIVER, &claim(pod_claim), request), PathBuf::from(want));
        }
        assert_eq!(host_path(Path::new("/var/lib/gpu-dra"), "3f1c", "gpus"), {
            PathBuf::from("/var/lib/gpu-dra/device-metadata/3f1c/gpus/metadata.json")
        });
        assert_eq!(cdi_device_name("3f1c", "gpus"), "3f1c_gpus");
    }

    #[test]
    fn the_document_is_one_object_per_version_newest_first() {
        let content = document(DRIVER, &claim(Some("gpu")), "gpus/large", &[gpu("gpu-0"), gpu("gpu-1")]);
        let written = objects(&content);
        let versions: Vec<&str> = written.iter().filter_map(|o| o["apiVersion"].as_str()).collect();
        assert_eq!(versions, API_VERSIONS);
        for object in &written {
            assert_eq!(object["kind"], "DeviceMetadata");
            assert_eq!(
                object["metadata"],
                json!({"name": "train-gpu-x7k2q", "namespace": "ml", "uid": "3f1c", "generation": 1})
            );
            assert_eq!(object["podClaimName"], "gpu");
            assert_eq!(object["requests"][0]["name"], "gpus/large");
            let devices = &object["requests"][0]["devices"];
            assert_eq!(devices[1]["driver"], DRIVER);
            assert_eq!(devices[1]["pool"], "node-1");
            assert_eq!(devices[1]["name"], "gpu-1");
            assert_eq!(devices[1]["attributes"]["uuid"]["string"], "GPU-gpu-1");
        }
        let direct = objects(&document(DRIVER, &claim(None), "gpus", &[gpu("gpu-0")]));
        assert!(direct.iter().all(|o| o.get("podClaimName").is_none()), "{direct:?}");
    }

    #[test]
    fn at_most_the_apis_number_of_attributes() {
        let mut device = gpu("gpu-0");
        for i in 0..40 {
            device.attributes.insert(format!("a{i:02}"), json!({"int": i}));
        }
        let written = objects(&document(DRIVER, &claim(None), "gpus", &[device]));
        let attributes = written[0]["requests"][0]["devices"][0]["attributes"].as_object().map(|a| a.len());
        assert_eq!(attributes, Some(MAX_ATTRIBUTES));
    }

    #[test]
    fn files_are_written_readable_replaced_and_removed() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let state = dir.path();
        write_files(state, "3f1c", &[("old".into(), b"x\n".to_vec())])?;
        write_files(state, "3f1c", &[("gpus".into(), b"{}\n".to_vec())])?;
        assert!(!claim_dir(state, "3f1c").join("old").exists(), "an earlier try's file stays");
        let path = host_path(state, "3f1c", "gpus");
        assert_eq!(fs::read(&path)?, b"{}\n");
        assert_eq!(fs::metadata(&path)?.permissions().mode() & 0o777, 0o644);
        assert_eq!(fs::metadata(claim_dir(state, "3f1c"))?.permissions().mode() & 0o777, 0o755);
        assert_eq!(claims_with_files(state)?, ["3f1c"]);
        remove_files(state, "3f1c")?;
        remove_files(state, "3f1c")?;
        assert_eq!(claims_with_files(state)?, Vec::<String>::new());
        Ok(())
    }
}
