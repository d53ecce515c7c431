//! CDI (Container Device Interface) specs for prepared ResourceClaims.
//!
//! NodePrepareResources answers the kubelet with CDI device ids; the container runtime looks them up in the spec
//! files of its CDI directory and edits the container accordingly. One transient spec file per claim (not one per
//! node) makes prepare and unprepare a single atomic write or removal, and the claim UID in every device name means a
//! runtime that still caches the spec of an earlier claim can never hand its GPUs to a new one.
//!
//! - [`CdiKind`], [`device_name`], [`device_id`]: the names, checked against the CDI rules up front, so that a bad
//!   name fails prepare with a clear error instead of the runtime rejecting the whole file later.
//! - [`DriverFiles`]: the NVIDIA user-space files a CUDA container needs, found under the driver root.
//! - [`build_claim_spec`]: the spec itself (pure, validated by the `container-device-interface` crate).
//! - [`write_claim_spec`] and its siblings: the spec files in the CDI directory.

mod driver_files;
mod files;
mod spec;

use std::fmt;
use std::io;
use std::path::PathBuf;

pub use driver_files::{DriverFiles, DriverMount, existing_in_root};
pub use files::{
    claim_spec_devices, claim_spec_env, claim_spec_exists, claim_spec_file_devices, claim_spec_is, list_claim_specs,
    remove_abandoned_spec_temporaries, remove_claim_spec, spec_file_name, write_claim_spec,
};
pub use spec::{
    ClaimEdits, FileDevice, OPTIONAL_DEVICE_NODES, build_claim_spec, build_claim_spec_with, optional_nodes_present,
    validate_claim_spec,
};

/// Why a CDI spec could not be built, written or removed. Every message starts with the operation and names the
/// path or claim it concerns, because these errors end up in kubelet events where nothing else gives context.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// The driver root does not exist or cannot be read.
    #[error(
        "open the NVIDIA driver root {}: {source}. Set --driver-root (GPU_DRA_DRIVER_ROOT) to where the driver is \
         installed: `/` on most nodes, `/run/nvidia/driver` with the GPU Operator",
        path.display()
    )]
    DriverRoot {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The driver root holds no CUDA driver library: containers would see their GPUs and be unable to use them.
    #[error(
        "find {library} under the NVIDIA driver root {}: it is in none of {searched}. Containers cannot use a GPU \
         without it: set --driver-root (GPU_DRA_DRIVER_ROOT) to where the driver is installed (`/run/nvidia/driver` \
         with the GPU Operator), or install the driver",
        root.display()
    )]
    NoCudaLibrary { library: &'static str, root: PathBuf, searched: String },
    /// A library or utility directory under the driver root exists but cannot be listed.
    #[error("list the NVIDIA driver directory {}: {source}", path.display())]
    ReadDriverDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A vendor, class, device name or claim UID breaks the CDI naming rules.
    #[error("check the CDI {what} {name:?}: {reason}")]
    InvalidName { what: &'static str, name: String, reason: String },
    /// A claim without GPUs has nothing to put into a spec (CDI rejects specs without devices).
    #[error("build the CDI spec of claim {claim_uid}: the claim has no GPUs")]
    NoGpus { claim_uid: String },
    /// The generated document does not fit the CDI types (a bug here, never a user error).
    #[error("build the CDI spec of claim {claim_uid}: {source}")]
    BuildSpec {
        claim_uid: String,
        #[source]
        source: serde_json::Error,
    },
    /// The `container-device-interface` crate rejects the spec; the runtime would reject it too.
    /// `reason` is the whole chain of the crate's (`anyhow`) error, which its `Display` alone would cut short.
    #[error("validate the CDI spec of claim {claim_uid}: {reason}")]
    InvalidSpec {
        claim_uid: String,
        reason: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Serializing or writing the spec file failed.
    #[error("write the CDI spec {}: {source}", path.display())]
    WriteSpec {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Removing the spec file failed (a file already gone is not an error).
    #[error("remove the CDI spec {}: {source}", path.display())]
    RemoveSpec {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The CDI directory exists but cannot be listed.
    #[error("list the CDI specs in {}: {source}", dir.display())]
    ListSpecs {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The CDI kind (`vendor/class`) of every device this driver hands out. Validated on construction, so every name
/// built from it is well-formed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CdiKind {
    vendor: String,
    class: String,
}

impl CdiKind {
    /// The class of the devices: whole GPUs.
    pub const GPU_CLASS: &'static str = "gpu";

    /// The kind for a DRA driver: the driver name is the vendor (it is already a unique domain), the class is
    /// [`Self::GPU_CLASS`]. `gpu.gpu-dra.dev` → `gpu.gpu-dra.dev/gpu`.
    pub fn from_driver_name(driver_name: &str) -> Result<Self, CdiError> {
        Self::new(driver_name, Self::GPU_CLASS)
    }

    /// A kind from its parts, checked against the CDI rules: start with a letter, end with a letter or digit,
    /// letters, digits, `_`, `.` and `-` inside.
    pub fn new(vendor: &str, class: &str) -> Result<Self, CdiError> {
        check_name("vendor", vendor, VENDOR_OR_CLASS)?;
        check_name("class", class, VENDOR_OR_CLASS)?;
        Ok(Self { vendor: vendor.to_string(), class: class.to_string() })
    }

    /// The vendor, e.g. `gpu.gpu-dra.dev`.
    pub fn vendor(&self) -> &str {
        &self.vendor
    }

    /// The class, e.g. `gpu`.
    pub fn class(&self) -> &str {
        &self.class
    }

    /// The fully qualified CDI device id `vendor/class=name`, the form the kubelet passes to the runtime.
    pub fn qualified_name(&self, device_name: &str) -> String {
        format!("{self}={device_name}")
    }
}

impl fmt::Display for CdiKind {
    /// `vendor/class`, the spec's `kind`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.vendor, self.class)
    }
}

/// The CDI device name of one device of a claim: `<claimUID>-<ResourceSlice device name>` (`<uid>-gpu-3`,
/// `<uid>-gpu-0-mig-0-4-1`). The claim UID makes the name unique per claim, so a runtime's stale cache of an earlier
/// claim's spec can never match it.
pub fn device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// The fully qualified CDI id of one device of a claim (`vendor/class=<claimUID>-<device>`), what
/// NodePrepareResources returns to the kubelet.
pub fn device_id(kind: &CdiKind, claim_uid: &str, device: &str) -> String {
    kind.qualified_name(&device_name(claim_uid, device))
}

/// Which characters a CDI name may hold.
#[derive(Clone, Copy)]
struct NameRule {
    /// Vendors and classes must start with a letter; device names may start with a digit.
    letter_first: bool,
    /// Allowed between the first and last character besides letters and digits.
    inner: &'static str,
}

const VENDOR_OR_CLASS: NameRule = NameRule { letter_first: true, inner: "-_." };
const DEVICE: NameRule = NameRule { letter_first: false, inner: "-_.:" };

/// Checks `name` against a CDI naming rule (the rules of the CDI specification, as the runtimes apply them).
fn check_name(what: &'static str, name: &str, rule: NameRule) -> Result<(), CdiError> {
    let invalid = |reason: String| Err(CdiError::InvalidName { what, name: name.to_string(), reason });
    let (Some(first), Some(last)) = (name.chars().next(), name.chars().last()) else {
        return invalid("it is empty".into());
    };
    if rule.letter_first && !first.is_ascii_alphabetic() {
        return invalid("it must start with a letter".into());
    }
    if !first.is_ascii_alphanumeric() {
        return invalid("it must start with a letter or a digit".into());
    }
    if !last.is_ascii_alphanumeric() {
        return invalid("it must end with a letter or a digit".into());
    }
    if let Some(bad) = name.chars().find(|&c| !c.is_ascii_alphanumeric() && !rule.inner.contains(c)) {
        return invalid(format!("{bad:?} is not allowed (only letters, digits and {:?})", rule.inner));
    }
    Ok(())
}

/// A claim UID becomes part of device names and of the spec file name: it must be a valid device name on its own
/// (which also keeps `/` and `..` out of file names).
fn check_claim_uid(claim_uid: &str) -> Result<(), CdiError> {
    check_name("claim UID", claim_uid, DEVICE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_and_ids() -> Result<(), CdiError> {
        let kind = CdiKind::from_driver_name("gpu.gpu-dra.dev")?;
        assert_eq!((kind.vendor(), kind.class()), ("gpu.gpu-dra.dev", "gpu"));
        assert_eq!(kind.to_string(), "gpu.gpu-dra.dev/gpu");
        assert_eq!(device_name("uid-1", "gpu-3"), "uid-1-gpu-3");
        assert_eq!(device_id(&kind, "uid-1", "gpu-3"), "gpu.gpu-dra.dev/gpu=uid-1-gpu-3");
        assert_eq!(device_id(&kind, "uid-1", "gpu-0-mig-19-4-1"), "gpu.gpu-dra.dev/gpu=uid-1-gpu-0-mig-19-4-1");
        Ok(())
    }

    #[test]
    fn names_follow_the_cdi_rules() {
        for bad in ["", "1vendor", "vendor-", "ven/dor", "ven:dor", "-v"] {
            assert!(matches!(CdiKind::new(bad, "gpu"), Err(CdiError::InvalidName { what: "vendor", .. })), "{bad:?}");
        }
        assert!(matches!(CdiKind::new("v", "gpu_"), Err(CdiError::InvalidName { what: "class", .. })));
        assert!(CdiKind::new("a", "b").is_ok());
        assert!(CdiKind::new("Example_1.com", "gpu.x-y").is_ok());
        for good in ["0b5b2d9c-8d4e-4c5f-9d3e-1a2b3c4d5e6f", "a", "a:b.c_d-e"] {
            assert!(check_claim_uid(good).is_ok(), "{good:?}");
        }
        for bad in ["", "a/b", "../x", "a b", "-a", "a-", ".", "é"] {
            assert!(matches!(check_claim_uid(bad), Err(CdiError::InvalidName { what: "claim UID", .. })), "{bad:?}");
        }
    }

    #[test]
    fn errors_say_what_failed_and_what_to_do() {
        let err = CdiError::NoCudaLibrary { library: "libcuda.so.1", root: "/r".into(), searched: "usr/lib".into() };
        let text = err.to_string();
        assert!(text.starts_with("find libcuda.so.1 under the NVIDIA driver root /r"), "{text}");
        assert!(text.contains("--driver-root"), "{text}");
        let err = check_claim_uid("a/b").err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "check the CDI claim UID \"a/b\": '/' is not allowed (only letters, digits and \"-_.:\")");
    }
}
