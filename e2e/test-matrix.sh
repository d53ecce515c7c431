#!/usr/bin/env bash
# `make test-matrix`: the pipeline tests against every Kubernetes minor version gpu-dra supports, the newest patch of
# each that the Go module proxy serves. Per version: its control plane and kubelet harness are built (cached like
# the default version's), then the test binaries below run with K8S_VERSION set, so clusters, the kubelet DRA code
# and the tests' version guards all follow it. Prints one line per version and exits non-zero when any failed.
#
#   make test-matrix
#   GPU_DRA_MATRIX_VERSIONS="v1.34.4 v1.37.2" make test-matrix
#
# Tests of a feature a version lacks or leaves off assert what the README's "Kubernetes versions" section documents
# for it (before 1.36 `health` asserts that device taints are dropped, the chart tests that the PodGroup API is
# absent). Test binaries not listed (PodGroups, real node, soak) need 1.37's PodGroup API or a real node, and run
# with `make test` on the default version.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VERSIONS=${GPU_DRA_MATRIX_VERSIONS:-v1.34.4 v1.35.4 v1.36.3 v1.37.2}
TESTS=(dra_harness controller controller_tenants controller_beside_kcm pipeline kubelet_plugin node_agent health chart)
CARGO=${CARGO:-cargo}
LOGS="${CARGO_TARGET_DIR:-$E2E_DIR/../target}/test-matrix"

log() { printf '[test-matrix] %s\n' "$*" >&2; }

mkdir -p "$LOGS"
# Every cluster is the test binaries' own, of the version under test: never one KUBECONFIG points at.
unset KUBECONFIG
# test_args: the --test arguments of the binaries run on every version.
test_args() {
    local t
    for t in "${TESTS[@]}"; do printf -- '--test\n%s\n' "$t"; done
}
mapfile -t all_args < <(test_args)
log "building the test binaries once: ${TESTS[*]}"
"$CARGO" test --locked --no-run "${all_args[@]}" >&2

results=() failed=0
for version in $VERSIONS; do
    log "=== Kubernetes $version"
    t0=$SECONDS
    out="$LOGS/$version.log"
    args=("${all_args[@]}")
    if K8S_VERSION=$version "$E2E_DIR/build-k8s.sh" >"$out" 2>&1 &&
        K8S_VERSION=$version "$E2E_DIR/build-kubelet-harness.sh" >>"$out" 2>&1 &&
        K8S_VERSION=$version "$CARGO" test --locked "${args[@]}" >>"$out" 2>&1; then
        passed=$(grep -oE '^test result: ok\. [0-9]+ passed' "$out" | awk '{s += $4} END {print s + 0}')
        results+=("$version: passed, $passed tests in $((${#args[@]} / 2)) binaries ($((SECONDS - t0)) s)")
    else
        failed=1
        results+=("$version: FAILED after $((SECONDS - t0)) s; log: $out")
        tail -n 40 "$out" >&2
    fi
    log "${results[-1]}"
done
printf '\nKubernetes version matrix (%s):\n' "${TESTS[*]}"
printf '  %s\n' "${results[@]}"
exit "$failed"
