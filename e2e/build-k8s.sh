#!/usr/bin/env bash
# Builds the real Kubernetes components the tests run against, from their published Go modules:
# etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, kubelet, kube-proxy and helm.
#
# Binaries land in a version-keyed cache outside the repository and are built only when missing:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra/k8s-<version>/bin/
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra/etcd-<version>/bin/
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra/helm-<version>/bin/
#
# Usage: e2e/build-k8s.sh [--print-bin-dirs]
#   --print-bin-dirs  print the three bin directories (one per line) and exit; builds nothing.
set -euo pipefail

# shellcheck source=e2e/versions.sh
source "$(dirname "${BASH_SOURCE[0]}")/versions.sh"
# shellcheck source=e2e/cache-install.sh
source "$(dirname "${BASH_SOURCE[0]}")/cache-install.sh"

if [[ "${1:-}" == "--print-bin-dirs" ]]; then
    printf '%s\n' "$K8S_BIN" "$ETCD_BIN" "$HELM_BIN"
    exit 0
fi

log() { printf '[build-k8s] %s\n' "$*" >&2; }
die() { printf '[build-k8s] error: %s\n' "$*" >&2; exit 1; }

# Go and the module proxy are needed only when something has to be built.
require_go() {
    command -v go >/dev/null 2>&1 ||
        die "the 'go' command is not on PATH; install Go >= 1.26 (https://go.dev/doc/install) and retry"
    go_env_proxy=$(go env GOPROXY)
    if [[ "$go_env_proxy" == "off" ]]; then
        die "GOPROXY is 'off'; the Kubernetes modules come from the Go module proxy. Set GOPROXY (e.g. the default https://proxy.golang.org) and retry"
    fi
}
go_env_proxy=unknown

export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--buildvcs=false}"

# A throwaway module outside the repository that pins one component's modules.
# $1: directory, remaining args: lines for go.mod (replace directives).
new_wrapper_module() {
    local dir=$1
    rm -rf "$dir"
    mkdir -p "$dir"
    (cd "$dir" && go mod init local/gpu-dra-build >/dev/null 2>&1)
}

# Runs go in a wrapper module; its chatter goes to go.log there, and a failure shows the log's end and names
# the likely cause.
go_in() {
    local dir=$1; shift
    if ! (cd "$dir" && go "$@") >>"$dir/go.log" 2>&1; then
        tail -n 30 "$dir/go.log" >&2
        die "'go ${1}' failed in $dir (log: $dir/go.log); check that the Go module proxy ($go_env_proxy) is reachable and serves the pinned version"
    fi
}

build_kubernetes() {
    local want=(kube-apiserver kube-scheduler kube-controller-manager kubectl kubelet kube-proxy)
    local missing=()
    for b in "${want[@]}"; do [[ -x "$K8S_BIN/$b" ]] || missing+=("$b"); done
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "kubernetes $K8S_VERSION: cached in $K8S_BIN"
        return
    fi
    require_go
    log "kubernetes $K8S_VERSION: building ${missing[*]} (cold: 10-25 min on 2 cores)"
    local work="$GPU_DRA_CACHE/work/k8s-$K8S_VERSION"
    new_wrapper_module "$work"

    # k8s.io/kubernetes requires every staging module at v0.0.0; each needs a replace to its published twin.
    local gomod
    gomod=$(cd "$work" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    [[ -n "$gomod" && -f "$gomod" ]] || die "could not download k8s.io/kubernetes@$K8S_VERSION from the Go module proxy ($go_env_proxy)"
    local replaces=()
    mapfile -t replaces < <(staging_replaces "$gomod")
    [[ ${#replaces[@]} -gt 0 ]] || die "found no staging modules in $gomod; the module layout changed"
    go_in "$work" mod edit "${replaces[@]}"
    local pkgs=()
    for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b@$K8S_VERSION"); done
    go_in "$work" get "${pkgs[@]}"

    local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
    local date; date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    local ldflags="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
        ldflags+=" -X $pkg.gitCommit=0000000000000000000000000000000000000000 -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
    done
    mkdir -p "$K8S_BIN"
    # One `go build` for all of them: it compiles the shared packages once and links the binaries in parallel.
    local out="$work/bin"
    mkdir -p "$out"
    log "kubernetes $K8S_VERSION: go build ${missing[*]}"
    local cmds=()
    for b in "${missing[@]}"; do cmds+=("k8s.io/kubernetes/cmd/$b"); done
    go_in "$work" build -trimpath -ldflags "$ldflags" -o "$out/" "${cmds[@]}"
    for b in "${missing[@]}"; do mv "$out/$b" "$K8S_BIN/$b"; done
}

build_etcd() {
    if [[ -x "$ETCD_BIN/etcd" ]]; then
        log "etcd $ETCD_VERSION: cached in $ETCD_BIN"
        return
    fi
    require_go
    log "etcd $ETCD_VERSION: building"
    local work="$GPU_DRA_CACHE/work/etcd-$ETCD_VERSION"
    new_wrapper_module "$work"
    # etcd's own go.mod carries replace directives, so `go install` refuses it; a wrapper module can build it.
    local mods=(api pkg client/pkg client/v3 server)
    local replaces=()
    for m in "${mods[@]}"; do
        replaces+=("-replace=go.etcd.io/etcd/$m/v3=go.etcd.io/etcd/$m/v3@$ETCD_VERSION")
    done
    go_in "$work" mod edit "${replaces[@]}"
    go_in "$work" get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    mkdir -p "$ETCD_BIN"
    go_in "$work" build -trimpath -ldflags "-s -w" -o "$ETCD_BIN/etcd.tmp" go.etcd.io/etcd/server/v3
    mv "$ETCD_BIN/etcd.tmp" "$ETCD_BIN/etcd"
}

build_helm() {
    if [[ -x "$HELM_BIN/helm" ]]; then
        log "helm $HELM_VERSION: cached in $HELM_BIN"
        return
    fi
    require_go
    log "helm $HELM_VERSION: building"
    mkdir -p "$HELM_BIN"
    local work="$GPU_DRA_CACHE/work/helm-$HELM_VERSION"
    mkdir -p "$work"
    # helm's go.mod has no replace directives, so `go install module@version` works as is.
    go_install_into "$HELM_BIN" "$work" -trimpath \
        -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
}

build_etcd
build_kubernetes
build_helm
log "done: $K8S_BIN $ETCD_BIN $HELM_BIN"
