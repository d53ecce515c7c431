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
# absent; on 1.36 `controller_podgroup` asserts that its alpha PodGroups are refused with a reason). From 1.36 on
# `controller_podgroup` runs too (1.34 and 1.35 have no PodGroup API to run it against). Test binaries not listed
# (controller HA and API outage, PodGroup upgrade, gRPC clients, image, cluster script, gpu-check, real node, soak)
# are not version-specific or need a real node, and run with `make test` on the default version.
set -euo pipefail
# A test binary whose cluster cannot start fails the version instead of being ignored (and counted as passing).
export CI=true

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VERSIONS=${GPU_DRA_MATRIX_VERSIONS:-v1.34.4 v1.35.4 v1.36.3 v1.37.2}
TESTS=(dra_harness controller controller_tenants controller_beside_kcm pipeline kubelet_plugin node_agent health chart)
# From 1.36 on, where a PodGroup API exists (v1alpha2 in 1.36, v1beta1 in 1.37).
TESTS_SINCE_1_36=(controller_podgroup)
CARGO=${CARGO:-cargo}
LOGS="${CARGO_TARGET_DIR:-$E2E_DIR/../target}/test-matrix"

log() { printf '[test-matrix] %s\n' "$*" >&2; }

mkdir -p "$LOGS"
# Every cluster is the test binaries' own, of the version under test: never one KUBECONFIG points at.
unset KUBECONFIG
# test_args VERSION: the --test arguments of the binaries run on VERSION.
test_args() {
    local minor=${1#v1.} t
    minor=${minor%%.*}
    for t in "${TESTS[@]}"; do printf -- '--test\n%s\n' "$t"; done
    if ((minor >= 36)); then for t in "${TESTS_SINCE_1_36[@]}"; do printf -- '--test\n%s\n' "$t"; done; fi
}
mapfile -t all_args < <(test_args v1.99.0)
log "building the test binaries once: ${TESTS[*]} ${TESTS_SINCE_1_36[*]}"
"$CARGO" test --locked --no-run "${all_args[@]}" >&2

results=() failed=0
for version in $VERSIONS; do
    log "=== Kubernetes $version"
    t0=$SECONDS
    out="$LOGS/$version.log"
    mapfile -t args < <(test_args "$version")
    if K8S_VERSION=$version "$E2E_DIR/build-k8s.sh" >"$out" 2>&1 &&
        K8S_VERSION=$version "$E2E_DIR/build-kubelet-harness.sh" >>"$out" 2>&1 &&
        K8S_VERSION=$version "$CARGO" test --locked "${args[@]}" >>"$out" 2>&1; then
        passed=$(grep -oE '^test result: ok\. [0-9]+ passed' "$out" | awk '{s += $4} END {print s + 0}')
        ignored=$(grep -oE '^test result: ok\. [0-9]+ passed; [0-9]+ failed; [0-9]+ ignored' "$out" | awk '{s += $8} END {print s + 0}')
        if ((ignored > 0)); then
            failed=1
            results+=("$version: FAILED: $ignored tests ignored (a test never run is no pass); log: $out")
        else
            results+=("$version: passed, $passed tests in $((${#args[@]} / 2)) binaries ($((SECONDS - t0)) s)")
        fi
    else
        failed=1
        results+=("$version: FAILED after $((SECONDS - t0)) s; log: $out")
        tail -n 40 "$out" >&2
    fi
    log "${results[-1]}"
done
printf '\nKubernetes version matrix (%s; from 1.36: %s):\n' "${TESTS[*]}" "${TESTS_SINCE_1_36[*]}"
printf '  %s\n' "${results[@]}"
exit "$failed"
