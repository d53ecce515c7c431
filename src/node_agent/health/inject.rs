//! Fault injection for simulated GPUs: the whole health path (taints, eviction, recovery, Events, metrics) runs on
//! machines without GPUs.
//!
//! With `--gpu-backend simulated` the agent watches `<state-dir>/inject-faults`. Each line names a GPU (device
//! name `gpu-2` or its UUID) and what happens to it:
//!
//! ```text
//! gpu-2 xid 79        # a critical XID
//! gpu-2 ecc-dbe       # a double-bit (uncorrected) ECC error;  ecc-sbe: single-bit (corrected)
//! gpu-2 lost          # NVML reports the GPU lost
//! gpu-2 clear         # the GPU was reset: healthy at once
//! gpu-2 unwatched     # NVML reports none of the watched events for the GPU: its health is Unknown
//! gpu-2 watched       # … watched again
//! ```
//!
//! While `<state-dir>/simulated-driver-unusable` exists no GPU is watched, and while `simulated-driver-hung` exists
//! the watch does not answer, as with NVML.
//!
//! The agent takes the file as a whole (renames it to `inject-faults.applied`) and applies its lines in order, so
//! append with one write (`echo 'gpu-2 xid 79' >> inject-faults`) and each line is applied exactly once, also
//! across agent restarts.

use std::io;
use std::path::{Path, PathBuf};

use super::classify::Fault;

/// The file name under the state directory.
pub const FILE_NAME: &str = "inject-faults";

/// What an injected line does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Fault(Fault),
    Reset,
    /// Whether the GPU's health can be watched (`false`: see [`UNWATCHED`]).
    Watched(bool),
}

/// Why a GPU injected `unwatched` is not watched.
pub const UNWATCHED: &str = "NVML reports none of the watched events (XID, ECC) for this GPU (injected)";

/// One injected line, or one report of a health source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injection {
    /// A device name (`gpu-2`) or a GPU UUID.
    pub gpu: String,
    pub action: Action,
    /// When the GPU was read so, where that may be well before the report is sent: a discovery round reads a GPU
    /// lost, then publishes, then reports it. A reading taken before the GPU's last reset is stale, and dropped
    /// (it would fault the GPU the reset just cleared). `None`: read as it is sent.
    pub read_at: Option<std::time::Instant>,
}

/// A line that says nothing we understand.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "line {line} of the fault file, {text:?}: {reason}; expected `<gpu-N|UUID> xid <number>`, `… ecc-dbe`, \
     `… ecc-sbe`, `… lost`, `… clear`, `… unwatched` or `… watched`"
)]
pub struct ParseError {
    pub line: usize,
    pub text: String,
    pub reason: &'static str,
}

/// Parses the fault file: one injection per line, `#` starts a comment, blank lines are skipped. A bad line is
/// reported and the others still apply.
pub fn parse(content: &str) -> Vec<Result<Injection, ParseError>> {
    content
        .lines()
        .enumerate()
        .filter_map(|(index, raw)| {
            let text = raw.split('#').next().unwrap_or_default().trim();
            (!text.is_empty()).then(|| {
                parse_line(text).map_err(|reason| ParseError { line: index + 1, text: raw.trim().into(), reason })
            })
        })
        .collect()
}

fn parse_line(text: &str) -> Result<Injection, &'static str> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let action = match words.get(1..).unwrap_or_default() {
        ["xid", number] => Action::Fault(Fault::Xid(Some(number.parse().map_err(|_| "the XID is not a number")?))),
        ["ecc-dbe"] => Action::Fault(Fault::EccDoubleBit),
        ["ecc-sbe"] => Action::Fault(Fault::EccSingleBit),
        ["lost"] => Action::Fault(Fault::GpuLost),
        ["clear"] => Action::Reset,
        ["unwatched"] => Action::Watched(false),
        ["watched"] => Action::Watched(true),
        [] => return Err("no action after the GPU"),
        _ => return Err("unknown action"),
    };
    Ok(Injection { gpu: words[0].to_string(), action, read_at: None })
}

/// Takes the fault file in `state_dir` if there is one: renamed to `inject-faults.applied` (replacing the last one)
/// and returned.
pub fn take(state_dir: &Path) -> io::Result<Option<String>> {
    let path = state_dir.join(FILE_NAME);
    let applied = applied_path(state_dir);
    match std::fs::rename(&path, &applied) {
        Ok(()) => std::fs::read_to_string(&applied).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn applied_path(state_dir: &Path) -> PathBuf {
    state_dir.join(format!("{FILE_NAME}.applied"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines() {
        let parsed = parse(
            "# demo\n\ngpu-2 xid 79\nGPU-1234 ecc-dbe # comment\ngpu-0  ecc-sbe\ngpu-1 lost\ngpu-2 clear\n\
             gpu-3 xid x\ngpu-3\ngpu-3 reboot\ngpu-0 unwatched\ngpu-0 watched\n",
        );
        let ok: Vec<_> = parsed.iter().filter_map(|r| r.as_ref().ok()).map(|i| (i.gpu.as_str(), i.action)).collect();
        assert_eq!(
            ok,
            [
                ("gpu-2", Action::Fault(Fault::Xid(Some(79)))),
                ("GPU-1234", Action::Fault(Fault::EccDoubleBit)),
                ("gpu-0", Action::Fault(Fault::EccSingleBit)),
                ("gpu-1", Action::Fault(Fault::GpuLost)),
                ("gpu-2", Action::Reset),
                ("gpu-0", Action::Watched(false)),
                ("gpu-0", Action::Watched(true)),
            ]
        );
        let errors: Vec<_> = parsed.iter().filter_map(|r| r.as_ref().err()).map(|e| (e.line, e.reason)).collect();
        assert_eq!(errors, [(8, "the XID is not a number"), (9, "no action after the GPU"), (10, "unknown action")]);
        let message = parsed[5].as_ref().err().map(ToString::to_string).unwrap_or_default();
        assert!(message.contains("line 8") && message.contains("gpu-3 xid x") && message.contains("expected"));
    }

    #[test]
    fn take_consumes_the_file_once() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        assert_eq!(take(dir.path())?, None);
        std::fs::write(dir.path().join(FILE_NAME), "gpu-0 xid 79\n")?;
        assert_eq!(take(dir.path())?.as_deref(), Some("gpu-0 xid 79\n"));
        assert_eq!(take(dir.path())?, None);
        assert!(applied_path(dir.path()).exists());
        Ok(())
    }
}
