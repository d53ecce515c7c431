//! `e2e/gpu-check.sh`, the one-command check of a GPU machine: with simulated GPUs everywhere, and with NVML as this
//! machine allows (a clear refusal without a driver; the full report where a GPU is present).

use std::process::Command;

fn gpu_check(args: &[&str]) -> (bool, String) {
    let output = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/e2e/gpu-check.sh"))
        .args(args)
        .env("GPU_DRA_BIN", env!("CARGO_BIN_EXE_gpu-dra"))
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap_or_else(|e| panic!("run e2e/gpu-check.sh: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

#[test]
fn simulated_gpus_are_reported_published_and_prepared() {
    let simulated = ["--gpu-backend", "simulated", "--simulated-gpus", "2xH100-80GB", "--claim-gpus", "2"];
    let (ok, out) = gpu_check(&[&simulated[..], &["--check-time-slice", "--check-mps"]].concat());
    assert!(ok, "{out}");
    for expected in [
        "2 GPU(s) found",
        "ResourceSlice 1 spec",
        "\"productName\"",
        "Prepared a sample claim with 2 device(s)",
        "CDI device gpu.gpu-dra.dev/gpu=0c4ec4ec-0000-4000-8000-000000000001-gpu-1",
        "\"path\": \"/dev/nvidia1\"",
        "NVIDIA_VISIBLE_DEVICES=void",
        "GPU health: simulated GPUs have no NVML events",
        "inject-faults",
        "Time slice: simulated GPUs keep theirs in <state-dir>/simulated-time-slices.json",
        "MPS control daemon for 2 device(s), as a claim asking MPS gets one",
        "get_server_list: (no server yet)",
        "stopped (quit), directories removed",
        "NVIDIA H100 80GB HBM3 (NVIDIA's documented table):",
        "1g.10gb     profile  0 (ID 19): 1 compute / 1 memory slice(s), up to 7, placements {0,1,2,3,4,5,6}:1",
        "3g.40gb     profile  2 (ID  9): 3 compute / 4 memory slice(s), up to 2, placements {0,4}:4",
        "7g.80gb     profile  4 (ID  0): 7 compute / 8 memory slice(s), up to 1, placements {0}:8",
    ] {
        assert!(out.contains(expected), "{expected:?} missing from:\n{out}");
    }
}

#[test]
fn a_simulated_gpu_in_mig_mode_is_published_and_prepared_as_its_mig_devices() {
    let (ok, out) = gpu_check(&[
        "--gpu-backend",
        "simulated",
        "--simulated-gpus",
        "1xH100-80GB/mig=3g.40gb+1g.10gb",
        "--claim-gpus",
        "2",
    ]);
    assert!(ok, "{out}");
    for expected in [
        "1 GPU(s) found",
        ", MIG mode on",
        "MIG 3g.40gb   MIG-",
        "GPU instance 1 compute instance 0, memory slices 0..4, 40779 MiB, 48 SMs",
        "\"name\": \"gpu-0-mig-19-4-1\"",
        "\"profile\"",
        "Prepared a sample claim with 2 device(s)",
        "CDI device gpu.gpu-dra.dev/gpu=0c4ec4ec-0000-4000-8000-000000000001-gpu-0-mig-9-0-4",
        // The driver's numbering: GPU 0's instance 1 is nvidia-cap12 (its compute instance 0: 13), instance 2 is 21.
        "device node /dev/nvidia-caps/nvidia-cap12",
        "device node /dev/nvidia-caps/nvidia-cap22",
    ] {
        assert!(out.contains(expected), "{expected:?} missing from:\n{out}");
    }
    assert!(!out.contains("\"name\": \"gpu-0\""), "a GPU in MIG mode is never published whole:\n{out}");
}

#[test]
fn dynamic_mig_is_shown_as_the_agent_would_publish_it() {
    let (ok, out) = gpu_check(&[
        "--gpu-backend",
        "simulated",
        "--simulated-gpus",
        "1xH100-80GB/mig=1g.10gb",
        "--mig-layout",
        "dynamic",
    ]);
    assert!(ok, "{out}");
    for expected in [
        "\"name\": \"gpu-0-mig-9-4-4\"",
        "\"counterSet\": \"gpu-0-counter-set\"",
        "\"sharedCounters\"",
        // What exists is what the sample claim prepares.
        "CDI device gpu.gpu-dra.dev/gpu=0c4ec4ec-0000-4000-8000-000000000001-gpu-0-mig-19-0-1",
    ] {
        assert!(out.contains(expected), "{expected:?} missing from:\n{out}");
    }
    // The administrator's 1g.10gb holds memory slice 0: no partition on it is published.
    for absent in ["\"name\": \"gpu-0-mig-19-0-1\"", "\"name\": \"gpu-0-mig-5-0-4\"", "\"name\": \"gpu-0\""] {
        assert!(!out.contains(absent), "{absent} published:\n{out}");
    }
}

#[test]
fn nvml_reports_the_gpus_or_names_the_missing_driver() {
    let (ok, out) = gpu_check(&[]);
    if std::path::Path::new("/dev/nvidiactl").exists() {
        assert!(ok && out.contains("Prepared a sample claim") && out.contains("libcuda"), "{out}");
    } else {
        assert!(!ok, "succeeded without a GPU driver:\n{out}");
        assert!(out.contains("load NVML (libnvidia-ml.so.1, not under --driver-root /, so from the loader"), "{out}");
    }
}

#[test]
fn bad_input_is_named() {
    let (ok, out) = gpu_check(&["--gpu-backend", "simulated"]);
    assert!(!ok && out.contains("needs --simulated-gpus"), "{out}");
    let (ok, out) = gpu_check(&["--gpu-backend", "simulated", "--simulated-gpus", "2xZ999"]);
    assert!(!ok && out.contains("Z999"), "{out}");
    let (ok, out) = gpu_check(&["--gpu-backend", "simulated", "--simulated-gpus", "1xL4-24GB/mig=1g.10gb"]);
    assert!(!ok && out.contains("NVIDIA L4 has no documented MIG profiles"), "{out}");
}

#[test]
fn a_mig_device_is_made_and_destroyed_where_there_is_room() {
    let simulated = ["--gpu-backend", "simulated", "--watch-health", "0s", "--check-mig-device", "--simulated-gpus"];
    // 3g.40gb on memory slices 0-3 and 1g.10gb on 4: the lowest free 1g placement is slice 5, instance 3.
    let (ok, out) = gpu_check(&[&simulated[..], &["1xH100-80GB,1xH100-80GB/mig=3g.40gb+1g.10gb"]].concat());
    assert!(ok, "{out}");
    for expected in [
        "MIG device: making a 1g.10gb at memory slice 5 of gpu-1",
        "(GPU instance 3, compute instance 0, 10194 MiB, 16 SMs,",
        "listed by discovery; published as gpu-1-mig-19-5-1",
        "a claim of it gets a valid CDI spec (",
        "CDI spec gpu.gpu-dra.dev-gpu_0c4ec4ec-0000-4000-8000-000000000002.json:",
        "device node /dev/nvidia-caps/nvidia-cap165:",
        "destroyed; discovery no longer lists it",
    ] {
        assert!(out.contains(expected), "{expected:?} missing from:\n{out}");
    }
    // A GPU in MIG mode without MIG devices (where dynamic MIG starts): nothing to prepare but the made device.
    let (ok, out) = gpu_check(&[&simulated[..], &["1xH100-80GB/mig="]].concat());
    assert!(ok, "{out}");
    for expected in ["making a 1g.10gb at memory slice 0 of gpu-0", "(GPU instance 1,", "nvidia-cap12:", "destroyed"] {
        assert!(out.contains(expected), "{expected:?} missing from:\n{out}");
    }
    for (gpus, why) in [("1xH100-80GB/mig=7g.80gb", "a full GPU"), ("2xH100-80GB", "no GPU in MIG mode")] {
        let (ok, out) = gpu_check(&[&simulated[..], &[gpus]].concat());
        assert!(
            ok && out.contains("MIG device: no GPU in MIG mode with room for a 1g profile; not checked"),
            "{why}:\n{out}"
        );
    }
}

/// An operator runs the GPU-changing checks on a node whose agent serves claims: they would set its GPUs' time slice
/// and compute mode back under the claims. Refused, naming the agent, while it holds its lock; done once it is gone.
#[test]
fn the_checks_that_change_gpus_are_refused_while_an_agent_runs() {
    let state = tempfile::tempdir().expect("tempdir");
    let lock = std::fs::File::create(state.path().join("agent.lock")).expect("lock file");
    std::fs::write(state.path().join("agent.lock"), "pid 4242 on gpu-node-7\n").expect("record");
    lock.try_lock().expect("take the lock, as a running agent holds it");
    let dir = state.path().to_str().expect("path");
    let simulated = ["--gpu-backend", "simulated", "--simulated-gpus", "1xH100-80GB", "--watch-health", "0s"];
    let (ok, out) = gpu_check(&[&simulated[..], &["--check-time-slice", "--state-dir", dir]].concat());
    assert!(!ok, "{out}");
    assert!(out.contains("a node agent runs on this machine (pid 4242 on gpu-node-7"), "{out}");
    // The read-only report goes on beside it.
    let (ok, out) = gpu_check(&[&simulated[..], &["--state-dir", dir]].concat());
    assert!(ok, "{out}");
    drop(lock);
    let (ok, out) = gpu_check(&[&simulated[..], &["--check-time-slice", "--state-dir", dir]].concat());
    assert!(ok, "{out}");
}
