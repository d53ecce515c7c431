#!/usr/bin/env bash
# Installs grpc-python (grpcio, pinned in e2e/versions.sh) into a virtual environment in the cache outside the
# repository, for the tests that call the plugin's sockets with other gRPC implementations than ours
# (tests/grpc_clients.rs runs e2e/grpc-call.py with it):
#   ${GPU_DRA_CACHE}/grpcio-<GRPCIO_VERSION>/bin/python
# The last line on stdout is that interpreter's path; everything else goes to stderr.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=e2e/versions.sh
source "$E2E_DIR/versions.sh"

log() { printf '[build-grpc-python] %s\n' "$*" >&2; }
die() { printf '[build-grpc-python] error: %s\n' "$*" >&2; exit 1; }

venv="$GPU_DRA_CACHE/grpcio-$GRPCIO_VERSION"
# Written last: an interrupted install is never taken for a finished one.
done_marker="$venv/.installed"
if [[ -f "$done_marker" ]]; then
    log "cached: $venv"
    printf '%s\n' "$venv/bin/python"
    exit 0
fi

command -v python3 >/dev/null 2>&1 || die "python3 is not on PATH; install Python >= 3.9 and retry"
log "installing grpcio==$GRPCIO_VERSION into $venv"
rm -rf "$venv"
mkdir -p "$GPU_DRA_CACHE"
python3 -m venv "$venv" || die "python3 -m venv failed; on Debian/Ubuntu install python3-venv"
"$venv/bin/python" -m pip install --quiet --no-input "grpcio==$GRPCIO_VERSION" >&2 ||
    die "pip could not install grpcio==$GRPCIO_VERSION; check that the Python package index is reachable"
"$venv/bin/python" -c 'import grpc' || die "grpcio does not import in $venv"
touch "$done_marker"
printf '%s\n' "$venv/bin/python"
