#!/usr/bin/env bash
# Builds gpu-dra-kubelet-harness (e2e/kubelet-harness): the real kubelet DRA code from k8s.io/kubernetes
# (plugin manager + DRA manager) for one fake node. See e2e/kubelet-harness/README.md.
#
# The binary lands in a cache outside the repository, keyed by the Kubernetes version and a hash of the harness
# sources (and this script), so a changed harness rebuilds and an unchanged one is found again:
#   ${GPU_DRA_CACHE}/kubelet-harness-<K8S_VERSION>-<hash>/bin/gpu-dra-kubelet-harness
# The last line on stdout is the binary's path; everything else goes to stderr.
#
# Usage: e2e/build-kubelet-harness.sh [--update-go-mod]
#   --update-go-mod  rewrite the module file for K8S_VERSION, then build: go.mod and go.sum for the default
#                    version (after bumping it in e2e/versions.sh), k8s-versions/<version>.mod and .sum for
#                    another (K8S_VERSION=v1.34.4 e2e/build-kubelet-harness.sh --update-go-mod).
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=e2e/versions.sh
source "$E2E_DIR/versions.sh"
SRC="$E2E_DIR/kubelet-harness"

log() { printf '[build-kubelet-harness] %s\n' "$*" >&2; }
die() { printf '[build-kubelet-harness] error: %s\n' "$*" >&2; exit 1; }

export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--buildvcs=false}"

require_go() {
    command -v go >/dev/null 2>&1 ||
        die "the 'go' command is not on PATH; install Go >= 1.26 (https://go.dev/doc/install) and retry"
}

# go_in DIR ARGS…: runs go in DIR; a failure shows the end of its output.
go_in() {
    local dir=$1 out
    shift
    if ! out=$(cd "$dir" && go "$@" 2>&1); then
        printf '%s\n' "$out" | tail -n 30 >&2
        die "'go $1' failed in $dir; check that the Go module proxy ($(go env GOPROXY)) is reachable"
    fi
}

# The module file for K8S_VERSION: go.mod for the default version, k8s-versions/<version>.mod (with its .sum) for
# the older ones `make test-matrix` runs against (go build -modfile).
if [[ "$K8S_VERSION" == "$K8S_DEFAULT_VERSION" ]]; then
    MODFILE=go.mod
else
    MODFILE=k8s-versions/$K8S_VERSION.mod
fi
SUMFILE=${MODFILE%.mod}.sum

# Build tags for the kubelet APIs that changed between 1.34 and 1.37 (the compat_*.go files).
build_tags() {
    local tags=() minor
    for minor in 35 36 37; do ((K8S_MINOR < minor)) && tags+=("k8s_before_1_$minor"); done
    local IFS=,
    echo "${tags[*]}"
}

# The module file is written the way build-k8s.sh writes its wrapper module: k8s.io/kubernetes requires every
# staging module at v0.0.0, and each gets a replace to its published twin (v0.<minor>.<patch>). Written in a
# scratch copy of the sources, then copied to $MODFILE and $SUMFILE.
update_go_mod() {
    require_go
    log "writing $SRC/$MODFILE for k8s.io/kubernetes $K8S_VERSION"
    local scratch
    scratch=$(mktemp -d)
    cp "$SRC"/*.go "$scratch/"
    go_in "$scratch" mod init local/gpu-dra-kubelet-harness
    local gomod
    gomod=$(cd "$scratch" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    [[ -n "$gomod" && -f "$gomod" ]] || die "could not download k8s.io/kubernetes@$K8S_VERSION from the Go module proxy"
    local replaces=()
    mapfile -t replaces < <(staging_replaces "$gomod")
    [[ ${#replaces[@]} -gt 0 ]] || die "found no staging modules in $gomod; the module layout changed"
    go_in "$scratch" mod edit "${replaces[@]}"
    go_in "$scratch" get "k8s.io/kubernetes@$K8S_VERSION"
    go_in "$scratch" mod tidy
    mkdir -p "$(dirname "$SRC/$MODFILE")"
    cp "$scratch/go.mod" "$SRC/$MODFILE"
    cp "$scratch/go.sum" "$SRC/$SUMFILE"
    rm -rf "$scratch"
}

case "${1:-}" in
    --update-go-mod) update_go_mod ;;
    "") ;;
    *) die "usage: e2e/build-kubelet-harness.sh [--update-go-mod]" ;;
esac

pinned=$(awk '$1 == "k8s.io/kubernetes" {print $2; exit}' "$SRC/$MODFILE" 2>/dev/null || true)
[[ "$pinned" == "$K8S_VERSION" ]] ||
    die "e2e/kubelet-harness/$MODFILE pins k8s.io/kubernetes ${pinned:-(none, or no such file)}, but K8S_VERSION is $K8S_VERSION; run: K8S_VERSION=$K8S_VERSION e2e/build-kubelet-harness.sh --update-go-mod"
TAGS=$(build_tags)

# The key covers everything that shapes the binary: sources, module pins, tags and the build command (this script).
hash=$(cd "$SRC" && { cat ./*.go "$MODFILE" "$SUMFILE" "$E2E_DIR/build-kubelet-harness.sh"; echo "$TAGS"; } | sha256sum | cut -c1-12)
bin="$GPU_DRA_CACHE/kubelet-harness-$K8S_VERSION-$hash/bin/gpu-dra-kubelet-harness"
if [[ -x "$bin" ]]; then
    log "cached: $bin"
    printf '%s\n' "$bin"
    exit 0
fi

require_go
log "building $bin (cold, with the Go build cache of build-k8s.sh: a few minutes on 2 cores)"
mkdir -p "$(dirname "$bin")"
t0=$SECONDS
# -mod=readonly: go.mod and go.sum are pinned in the repository; the build never rewrites them.
go_in "$SRC" build -mod=readonly -modfile="$MODFILE" ${TAGS:+-tags "$TAGS"} -trimpath -ldflags "-s -w" -o "$bin.tmp" .
mv "$bin.tmp" "$bin"
log "built in $((SECONDS - t0))s"
printf '%s\n' "$bin"
