//! The spec files: one `<vendor>-<class>_<claimUID>.json` per prepared claim in the runtime's CDI directory.
//!
//! Blocking I/O (small files, but an fsync): async callers should run these on a blocking thread.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use container_device_interface::specs::config::Spec;

use super::{CdiError, CdiKind, FileDevice, check_claim_uid};
use crate::fsutil::{remove_if_exists, write_atomic};

/// The file name of a claim's spec, `<vendor>-<class>_<claimUID>.json`: the transient per-claim convention, so the
/// file is recognisably this driver's and this claim's. Refuses a claim UID that is not a valid CDI device name
/// (which also keeps `/` and `..` out of the name).
pub fn spec_file_name(kind: &CdiKind, claim_uid: &str) -> Result<String, CdiError> {
    check_claim_uid(claim_uid)?;
    Ok(format!("{}{claim_uid}.json", file_prefix(kind)))
}

fn file_prefix(kind: &CdiKind) -> String {
    format!("{}-{}_", kind.vendor(), kind.class())
}

fn spec_path(dir: &Path, kind: &CdiKind, claim_uid: &str) -> Result<PathBuf, CdiError> {
    Ok(dir.join(spec_file_name(kind, claim_uid)?))
}

/// Writes a claim's spec (pretty JSON) atomically: the runtime, which watches the directory, sees the old file or
/// the new one, never half a spec. Creates `dir` when missing. Returns the file's path.
pub fn write_claim_spec(dir: &Path, kind: &CdiKind, claim_uid: &str, spec: &Spec) -> Result<PathBuf, CdiError> {
    let path = spec_path(dir, kind, claim_uid)?;
    let write_error = |source| CdiError::WriteSpec { path: path.clone(), source };
    let data = spec_bytes(spec).map_err(write_error)?;
    write_atomic(&path, &data).map_err(write_error)?;
    Ok(path)
}

/// Whether the claim's spec file holds exactly `spec`, as [`write_claim_spec`] would write it (`false` when it
/// cannot be read).
pub fn claim_spec_is(dir: &Path, kind: &CdiKind, claim_uid: &str, spec: &Spec) -> bool {
    let Ok(path) = spec_path(dir, kind, claim_uid) else { return false };
    spec_bytes(spec).is_ok_and(|data| fs::read(path).is_ok_and(|on_disk| on_disk == data))
}

fn spec_bytes(spec: &Spec) -> io::Result<Vec<u8>> {
    let mut data = serde_json::to_vec_pretty(spec).map_err(io::Error::other)?;
    data.push(b'\n');
    Ok(data)
}

/// Removes a claim's spec. Idempotent: unprepare is retried, and a spec already gone is the wanted state.
pub fn remove_claim_spec(dir: &Path, kind: &CdiKind, claim_uid: &str) -> Result<(), CdiError> {
    let path = spec_path(dir, kind, claim_uid)?;
    remove_if_exists(&path).map_err(|source| CdiError::RemoveSpec { path, source })
}

/// Whether a claim's spec file exists (e.g. to rewrite one lost while the claim stays prepared). `false` when that
/// cannot be told (an invalid claim UID, an unreadable directory): the caller then writes the spec again, and the
/// write reports the real error.
pub fn claim_spec_exists(dir: &Path, kind: &CdiKind, claim_uid: &str) -> bool {
    spec_path(dir, kind, claim_uid).is_ok_and(|path| path.try_exists().unwrap_or(false))
}

/// The claim UIDs that have a spec of this kind in `dir`, sorted, so specs the checkpoint no longer knows can be
/// removed. Other files (other drivers' specs, temporary files) are ignored; a missing directory holds none.
pub fn list_claim_specs(dir: &Path, kind: &CdiKind) -> Result<Vec<String>, CdiError> {
    let list_error = |source| CdiError::ListSpecs { dir: dir.to_path_buf(), source };
    let entries = match fs::read_dir(dir) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        entries => entries.map_err(list_error)?,
    };
    let prefix = file_prefix(kind);
    let mut uids = Vec::new();
    for entry in entries {
        let name = entry.map_err(list_error)?.file_name();
        let uid = name.to_str().and_then(|name| name.strip_prefix(&prefix)?.strip_suffix(".json"));
        if let Some(uid) = uid.filter(|uid| check_claim_uid(uid).is_ok()) {
            uids.push(uid.to_string());
        }
    }
    uids.sort();
    Ok(uids)
}

/// A claim's spec on disk, as JSON (what the adoption and rewrite paths read back from it).
fn read_spec(dir: &Path, kind: &CdiKind, claim_uid: &str) -> io::Result<serde_json::Value> {
    let path = spec_path(dir, kind, claim_uid).map_err(io::Error::other)?;
    serde_json::from_slice(&fs::read(&path)?).map_err(io::Error::other)
}

/// The ResourceSlice devices a claim's spec on disk names (its CDI devices are `<claimUID>-<device>`), each with the
/// UUID its own environment gives it (`GPU_DRA_DEVICE_<DEVICE>=<uuid>`, when the spec has it), so the spec can be
/// adopted when the checkpoint that recorded it was lost. Devices named otherwise are skipped.
pub fn claim_spec_devices(dir: &Path, kind: &CdiKind, claim_uid: &str) -> io::Result<Vec<(String, Option<String>)>> {
    let spec = read_spec(dir, kind, claim_uid)?;
    let prefix = format!("{claim_uid}-");
    let devices = spec["devices"].as_array().into_iter().flatten();
    Ok(devices
        .filter_map(|d| {
            let name = d["name"].as_str()?.strip_prefix(&prefix).filter(|name| !name.is_empty())?;
            let wanted = format!("{}=", super::spec::device_env_name(name));
            let env = d["containerEdits"]["env"].as_array().into_iter().flatten().filter_map(|e| e.as_str());
            let uuid = env.into_iter().find_map(|e| e.strip_prefix(&wanted)).map(str::to_string);
            Some((name.to_string(), uuid))
        })
        .collect())
}

/// The devices named in `names` of a claim's spec on disk that each only mount one file ([`FileDevice`], a request's
/// device metadata), as written there; names it lacks, or devices of another shape, are left out.
pub fn claim_spec_file_devices(
    dir: &Path,
    kind: &CdiKind,
    claim_uid: &str,
    names: &[String],
) -> io::Result<Vec<FileDevice>> {
    let spec = read_spec(dir, kind, claim_uid)?;
    let devices = spec["devices"].as_array().into_iter().flatten();
    Ok(devices
        .filter_map(|d| {
            let name = d["name"].as_str().filter(|name| names.iter().any(|n| n == name))?;
            let [mount] = d["containerEdits"]["mounts"].as_array()?.as_slice() else { return None };
            Some(FileDevice {
                name: name.to_string(),
                host_path: PathBuf::from(mount["hostPath"].as_str()?),
                container_path: PathBuf::from(mount["containerPath"].as_str()?),
            })
        })
        .collect())
}

/// The spec-wide environment of a claim's spec on disk (`NAME=value`), from which an adopted claim's MPS daemon is
/// known again ([`crate::kubelet_plugin::mps::from_client_env`]).
pub fn claim_spec_env(dir: &Path, kind: &CdiKind, claim_uid: &str) -> io::Result<Vec<String>> {
    let spec = read_spec(dir, kind, claim_uid)?;
    let env = spec["containerEdits"]["env"].as_array().into_iter().flatten().filter_map(|e| e.as_str());
    Ok(env.map(str::to_string).collect())
}

/// Removes the temporary spec files of this kind that a killed writer left behind (see
/// [`crate::fsutil::remove_abandoned_temporaries`]); returns how many.
pub fn remove_abandoned_spec_temporaries(dir: &Path, kind: &CdiKind) -> Result<usize, CdiError> {
    let prefix = file_prefix(kind);
    crate::fsutil::remove_abandoned_temporaries(dir, |name| name.starts_with(&prefix) && name.ends_with(".json"))
        .map_err(|source| CdiError::ListSpecs { dir: dir.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi::{DriverFiles, build_claim_spec, device_name};
    use crate::node_agent::device::Device;
    use crate::node_agent::gpu::test_gpu;
    use container_device_interface::schema::{compile_cdi_schema, validate_cdi};
    use container_device_interface::spec::read_spec;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    const UID: &str = "0b5b2d9c-8d4e-4c5f-9d3e-1a2b3c4d5e6f";

    fn kind() -> Result<CdiKind, CdiError> {
        CdiKind::from_driver_name("gpu.gpu-dra.dev")
    }

    /// The official CDI JSON schema (shared/cdi-schema), or `GPU_DRA_CDI_SCHEMA_DIR`. Missing is a failure, never a
    /// skip: this test is what proves runtimes accept the files.
    fn schema_dir() -> PathBuf {
        std::env::var_os("GPU_DRA_CDI_SCHEMA_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/cdi-schema")))
    }

    fn read_schema(name: &str) -> Result<Vec<u8>, String> {
        let path = schema_dir().join(name);
        fs::read(&path).map_err(|err| {
            format!(
                "read the CDI schema {}: {err}. Point GPU_DRA_CDI_SCHEMA_DIR at a directory holding schema.json and \
                 defs.json of the CDI specification (folder schema/ of cncf-tags/container-device-interface)",
                path.display()
            )
        })
    }

    /// A spec with every kind of edit: two GPUs, driver files from a small fake driver tree.
    fn full_spec(base: &Path) -> Result<Spec, Box<dyn std::error::Error>> {
        let root = base.join("driver");
        fs::create_dir_all(root.join("usr/lib64"))?;
        fs::create_dir_all(root.join("usr/bin"))?;
        fs::write(root.join("usr/lib64/libcuda.so.550.54.15"), b"elf")?;
        std::os::unix::fs::symlink("libcuda.so.550.54.15", root.join("usr/lib64/libcuda.so.1"))?;
        fs::write(root.join("usr/bin/nvidia-smi"), b"elf")?;
        let files = DriverFiles::discover(&root)?;
        // Two libraries at their own paths and where CUDA images look, the soname where Debian-family images look,
        // and nvidia-smi.
        assert_eq!(files.mounts()?.len(), 6);
        let gpus = [test_gpu(3, "0000:3b:00.0"), test_gpu(1, "0000:86:00.0")].map(|g| Device::whole(&g));
        Ok(build_claim_spec(&kind()?, UID, &gpus, &files)?)
    }

    #[test]
    fn file_names() -> Result<(), CdiError> {
        assert_eq!(spec_file_name(&kind()?, UID)?, format!("gpu.gpu-dra.dev-gpu_{UID}.json"));
        assert!(matches!(spec_file_name(&kind()?, "../x"), Err(CdiError::InvalidName { .. })));
        assert!(matches!(remove_claim_spec(Path::new("/tmp"), &kind()?, "a/b"), Err(CdiError::InvalidName { .. })));
        Ok(())
    }

    #[test]
    fn written_specs_match_the_official_schema_and_load_in_the_cdi_crate() -> TestResult {
        let (schema, defs) = (read_schema("schema.json")?, read_schema("defs.json")?);
        let validator = compile_cdi_schema(&schema, &defs).map_err(|err| format!("{err:#}"))?;
        let base = tempfile::tempdir()?;
        let spec = full_spec(base.path())?;
        let path = write_claim_spec(&base.path().join("cdi"), &kind()?, UID, &spec)?;

        let written = fs::read(&path)?;
        validate_cdi(&validator, &written).map_err(|err| format!("{err:#}"))?;
        let value: serde_json::Value = serde_json::from_slice(&written)?;
        assert_eq!(value["cdiVersion"], "0.5.0");
        assert_eq!(
            value["containerEdits"]["mounts"][0]["options"],
            serde_json::json!(["ro", "nosuid", "nodev", "bind"])
        );

        let mut loaded = read_spec(&path, 0).map_err(|err| format!("{err:#}"))?;
        let names: Vec<String> = loaded.validate().map_err(|err| format!("{err:#}"))?.into_keys().collect();
        assert_eq!(names, [device_name(UID, "gpu-1"), device_name(UID, "gpu-3")]);
        assert_eq!(loaded.cdi_spec, spec);
        Ok(())
    }

    #[test]
    fn write_list_remove() -> TestResult {
        let base = tempfile::tempdir()?;
        let dir = base.path().join("cdi");
        assert_eq!(list_claim_specs(&dir, &kind()?)?, Vec::<String>::new(), "a missing directory holds none");
        let spec = full_spec(base.path())?;
        let kind = kind()?;
        for uid in ["b-uid", "a-uid"] {
            write_claim_spec(&dir, &kind, uid, &spec)?;
        }
        fs::write(dir.join("other.vendor-gpu_c-uid.json"), b"{}")?;
        fs::write(dir.join(format!(".gpu.gpu-dra.dev-gpu_{UID}.json.tmp-1")), b"{}")?;
        fs::write(dir.join("gpu.gpu-dra.dev-gpu_bad-.json"), b"{}")?;
        assert_eq!(list_claim_specs(&dir, &kind)?, ["a-uid", "b-uid"]);
        write_claim_spec(&dir, &kind, UID, &spec)?;
        let devices = claim_spec_devices(&dir, &kind, UID)?;
        let names: Vec<&str> = devices.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["gpu-1", "gpu-3"], "the devices its device names name");
        assert!(devices.iter().all(|(_, uuid)| uuid.as_ref().is_some_and(|u| u.starts_with("GPU-"))), "{devices:?}");
        remove_claim_spec(&dir, &kind, UID)?;
        assert!(claim_spec_exists(&dir, &kind, "a-uid"));
        assert!(!claim_spec_exists(&dir, &kind, "a/uid"));
        remove_claim_spec(&dir, &kind, "a-uid")?;
        remove_claim_spec(&dir, &kind, "a-uid")?;
        assert!(!claim_spec_exists(&dir, &kind, "a-uid"));
        assert_eq!(list_claim_specs(&dir, &kind)?, ["b-uid"]);
        Ok(())
    }
}
