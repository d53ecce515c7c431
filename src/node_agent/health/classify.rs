//! What a GPU fault means for the pods that use the GPU: the classification of NVIDIA XIDs and NVML events.
//!
//! The table is data (README "GPU health" shows the same rows) so that the policy is reviewed in one place. XIDs not
//! listed are treated as needing a reset: a driver newer than this table reports a fault we cannot judge, and
//! tainting a healthy GPU for a while is cheaper than handing a broken one to the next pod. Operators extend the
//! ignore list with `--health-ignore-xids`.

use std::collections::BTreeSet;

/// How bad a fault is, in increasing order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultClass {
    /// An error of the application that caused it (its own bad memory access, its own exception): the GPU is fine.
    Application,
    /// The GPU still answers but needs a reset (ECC double-bit, firmware or NVLink errors): no new work belongs on it.
    NeedsReset,
    /// The GPU is gone (fell off the bus) or unusable for everyone on it: running work cannot continue.
    Lost,
}

impl FaultClass {
    /// The name used in metrics, Events, persisted state and the README.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Application => "application",
            Self::NeedsReset => "needs-reset",
            Self::Lost => "lost",
        }
    }
}

/// A fault as reported by NVML or injected into a simulated GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "xid")]
pub enum Fault {
    /// A critical XID error (NVML `nvmlEventTypeXidCriticalError`); `None` when NVML could not tell which (999).
    Xid(Option<u64>),
    /// A corrected (single-bit) ECC error.
    EccSingleBit,
    /// An uncorrected (double-bit) ECC error.
    EccDoubleBit,
    /// NVML answers `GPU_IS_LOST` for the device.
    GpuLost,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Xid(Some(xid)) => write!(f, "XID {xid}"),
            Self::Xid(None) => f.write_str("XID unknown"),
            Self::EccSingleBit => f.write_str("single-bit ECC error"),
            Self::EccDoubleBit => f.write_str("double-bit ECC error"),
            Self::GpuLost => f.write_str("GPU lost"),
        }
    }
}

/// One row of the XID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidInfo {
    pub xid: u64,
    pub class: FaultClass,
    pub meaning: &'static str,
}

const fn row(xid: u64, class: FaultClass, meaning: &'static str) -> XidInfo {
    XidInfo { xid, class, meaning }
}

use FaultClass::{Application, Lost, NeedsReset};

/// The XIDs this driver knows, from NVIDIA's XID catalogue. Application errors are those NVIDIA's own device plugin
/// skips by default (13, 31, 43, 45, 68, 109) plus the ones its catalogue attributes to user programs.
pub const XID_TABLE: &[XidInfo] = &[
    row(13, Application, "graphics engine exception (usually an application error, e.g. out-of-range access)"),
    row(31, Application, "GPU memory page fault (usually an application's illegal address)"),
    row(43, Application, "GPU stopped processing (an application fault reset its channel)"),
    row(45, Application, "preemptive cleanup after an earlier error (application exit or kill)"),
    row(68, Application, "video processor (NVDEC) exception"),
    row(109, Application, "context switch timeout (an application's kernel did not yield)"),
    row(48, NeedsReset, "double-bit ECC error"),
    row(61, NeedsReset, "internal micro-controller breakpoint/warning"),
    row(62, NeedsReset, "internal micro-controller halt"),
    row(63, NeedsReset, "ECC page retirement or row remapping recorded (reset to apply)"),
    row(64, NeedsReset, "ECC page retirement or row remapping failure"),
    row(74, NeedsReset, "NVLink error"),
    row(92, NeedsReset, "high single-bit ECC error rate"),
    row(94, NeedsReset, "contained ECC error (the affected application was stopped)"),
    row(95, Lost, "uncontained ECC error (every application on the GPU is affected)"),
    row(119, NeedsReset, "GSP firmware RPC timeout"),
    row(120, NeedsReset, "GSP firmware error"),
    row(79, Lost, "GPU has fallen off the bus"),
];

/// The row for `xid`, if the table knows it.
pub fn xid_info(xid: u64) -> Option<&'static XidInfo> {
    XID_TABLE.iter().find(|row| row.xid == xid)
}

/// What a fault means: the class and a sentence for Events and logs. `ignore` (from `--health-ignore-xids`) makes
/// any XID an application error.
pub fn classify(fault: Fault, ignore: &BTreeSet<u64>) -> (FaultClass, &'static str) {
    match fault {
        Fault::Xid(Some(xid)) if ignore.contains(&xid) => (Application, "ignored by --health-ignore-xids"),
        Fault::Xid(Some(xid)) => match xid_info(xid) {
            Some(row) => (row.class, row.meaning),
            None => (NeedsReset, "XID not in the classification table (treated as needing a reset)"),
        },
        Fault::Xid(None) => (NeedsReset, "critical XID that NVML could not identify"),
        Fault::EccSingleBit => (Application, "corrected single-bit ECC error"),
        Fault::EccDoubleBit => (NeedsReset, "uncorrected double-bit ECC error"),
        Fault::GpuLost => (Lost, "NVML reports the GPU lost (fell off the bus or is otherwise inaccessible)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_table() {
        let none = BTreeSet::new();
        let ignore_48 = BTreeSet::from([48, 79]);
        let cases: &[(Fault, &BTreeSet<u64>, FaultClass)] = &[
            (Fault::Xid(Some(13)), &none, Application),
            (Fault::Xid(Some(31)), &none, Application),
            (Fault::Xid(Some(43)), &none, Application),
            (Fault::Xid(Some(45)), &none, Application),
            (Fault::Xid(Some(68)), &none, Application),
            (Fault::Xid(Some(109)), &none, Application),
            (Fault::Xid(Some(48)), &none, NeedsReset),
            (Fault::Xid(Some(48)), &ignore_48, Application),
            (Fault::Xid(Some(79)), &ignore_48, Application),
            (Fault::Xid(Some(64)), &none, NeedsReset),
            (Fault::Xid(Some(94)), &none, NeedsReset),
            (Fault::Xid(Some(95)), &none, Lost),
            (Fault::Xid(Some(79)), &none, Lost),
            (Fault::Xid(Some(12345)), &none, NeedsReset),
            (Fault::Xid(None), &none, NeedsReset),
            (Fault::EccSingleBit, &none, Application),
            (Fault::EccDoubleBit, &none, NeedsReset),
            (Fault::GpuLost, &none, Lost),
        ];
        for (fault, ignore, want) in cases {
            assert_eq!(classify(*fault, ignore).0, *want, "{fault} with ignore list {ignore:?}");
        }
    }

    #[test]
    fn the_table_names_each_xid_once() {
        let xids: BTreeSet<u64> = XID_TABLE.iter().map(|row| row.xid).collect();
        assert_eq!(xids.len(), XID_TABLE.len());
        assert!(XID_TABLE.iter().all(|row| !row.meaning.is_empty()));
    }

    #[test]
    fn classes_order_by_severity() {
        assert!(Application < NeedsReset && NeedsReset < Lost);
    }
}
