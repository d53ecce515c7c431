#!/usr/bin/env bash
# Checks a GPU machine in one command, without a cluster: the node agent's NVML discovery, the ResourceSlice it
# would publish, one sample claim prepared into a scratch CDI directory (the spec is printed, then removed), and what
# NVML's health events report in 5 s (--watch-health: the events each GPU supports, any fault with its class), and,
# when asked (--check-time-slice: not on a node running claims), the first GPU's time slice set to Long and back,
# and (--check-mig-device: likewise) a MIG device of the smallest profile made on the first GPU in MIG mode with room,
# found by discovery, its claim's CDI spec written (printed with the sample's), and destroyed, and (--check-mps:
# likewise) an MPS control daemon started for the sample claim's GPUs, set to EXCLUSIVE_PROCESS first, asked for its
# servers (get_server_list) and stopped, the GPUs set back to DEFAULT.
#
# Usage: e2e/gpu-check.sh [gpu-dra gpu-check flags…]
#   e.g. e2e/gpu-check.sh --driver-root /run/nvidia/driver --claim-gpus 2
#        e2e/gpu-check.sh --gpu-backend simulated --simulated-gpus 4xH100-80GB   (machines without GPUs)
# Environment:
#   GPU_DRA_BIN   a gpu-dra binary to use (e.g. one built elsewhere and copied here); default: build
#                 target/release/gpu-dra with cargo (or use it as it is when cargo is not installed)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { printf '[gpu-check] %s\n' "$*" >&2; }
die() { printf '[gpu-check] error: %s\n' "$*" >&2; exit 1; }

start=$(date +%s.%N)
bin=${GPU_DRA_BIN:-}
if [[ -z "$bin" ]]; then
    bin=${CARGO_TARGET_DIR:-$root/target}/release/gpu-dra
    if command -v cargo >/dev/null 2>&1; then
        log "building $bin (cargo build --release --locked)"
        (cd "$root" && cargo build --release --locked) >&2
    fi
fi
[[ -x "$bin" ]] || die "no gpu-dra binary at $bin: install Rust (cargo) or set GPU_DRA_BIN"

if command -v nvidia-smi >/dev/null 2>&1; then
    log "nvidia-smi -L:"
    nvidia-smi -L >&2 || true
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/gpu-dra-check.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
"$bin" gpu-check --cdi-dir "$scratch/cdi" "$@"
for spec in "$scratch"/cdi/*.json; do
    [[ -e "$spec" ]] || die "no CDI spec was written"
    printf '\nCDI spec %s:\n' "$(basename "$spec")"
    cat "$spec"
    echo
done
log "done in $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.1f", e - s}') s"
