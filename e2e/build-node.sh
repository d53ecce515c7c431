#!/usr/bin/env bash
# Builds what a real node runs pods with, from their published Go modules: containerd and its runc shim, runc, the
# CNI plugins (bridge, host-local, loopback, portmap) and crictl. kubelet and kube-proxy come from build-k8s.sh.
# Installs the Debian packages they need (runc's libseccomp, iptables/nft, busybox for the test images) when missing.
#
# Binaries land in version-keyed caches outside the repository and are built only when missing:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra/node-containerd-<v>-runc-<v>/bin/
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra/cni-plugins-<v>/bin/
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra/crictl-<v>/bin/
set -euo pipefail

# shellcheck source=e2e/versions.sh
source "$(dirname "${BASH_SOURCE[0]}")/versions.sh"
# shellcheck source=e2e/cache-install.sh
source "$(dirname "${BASH_SOURCE[0]}")/cache-install.sh"

log() { printf '[build-node] %s\n' "$*" >&2; }
die() { printf '[build-node] error: %s\n' "$*" >&2; exit 1; }

export GOFLAGS="${GOFLAGS:--buildvcs=false}"

# Runs go in a work directory; its chatter goes to go.log there, and a failure shows the log's end.
go_in() {
    local dir=$1; shift
    mkdir -p "$dir"
    if ! (cd "$dir" && go "$@") >>"$dir/go.log" 2>&1; then
        tail -n 30 "$dir/go.log" >&2
        die "'go ${1}' failed in $dir (log: $dir/go.log); check that the Go module proxy ($(go env GOPROXY)) serves the pinned version"
    fi
}

install_debian_packages() {
    local missing=()
    for p in "${NODE_DEBIAN_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return
    log "installing Debian packages: ${missing[*]}"
    # A run killed during an earlier install left dpkg "interrupted": apt-get refuses everything until this runs.
    DEBIAN_FRONTEND=noninteractive dpkg --configure -a >/dev/null 2>&1 || true
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get update >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null ||
            die "apt-get could not install ${missing[*]}; install them by hand (as root) and retry"
    fi
}

build_containerd() {
    local b missing=()
    for b in containerd containerd-shim-runc-v2 ctr; do [[ -x "$NODE_BIN/$b" ]] || missing+=("$b"); done
    [[ ${#missing[@]} -eq 0 ]] && { log "containerd $CONTAINERD_VERSION: cached in $NODE_BIN"; return; }
    log "containerd $CONTAINERD_VERSION: building ${missing[*]}"
    mkdir -p "$NODE_BIN"
    local pkgs=()
    for b in "${missing[@]}"; do pkgs+=("github.com/containerd/containerd/v2/cmd/$b@$CONTAINERD_VERSION"); done
    # No btrfs snapshotter (needs its C headers); overlayfs and native are what the node uses.
    CGO_ENABLED=1 go_install_into "$NODE_BIN" "$GPU_DRA_CACHE/work/containerd-$CONTAINERD_VERSION" -trimpath \
        -tags no_btrfs -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" "${pkgs[@]}"
}

build_runc() {
    [[ -x "$NODE_BIN/runc" ]] && { log "runc $RUNC_VERSION: cached in $NODE_BIN"; return; }
    log "runc $RUNC_VERSION: building"
    local work="$GPU_DRA_CACHE/work/runc-$RUNC_VERSION"
    rm -rf "$work" && mkdir -p "$work"
    go_in "$work" mod download -json "github.com/opencontainers/runc@$RUNC_VERSION"
    local dir
    dir=$(sed -n 's/.*"Dir": "\(.*\)".*/\1/p' "$work/go.log" | tail -n 1)
    [[ -n "$dir" && -d "$dir" ]] || die "could not download github.com/opencontainers/runc@$RUNC_VERSION"
    # Its go.mod replaces a module with a directory the module zip does not carry, so build a copy without that
    # replace (and without vendor/, which would then disagree with go.mod).
    cp -r "$dir" "$work/src" && chmod -R u+w "$work/src" && rm -rf "$work/src/vendor"
    go_in "$work/src" mod edit -dropreplace github.com/opencontainers/selinux
    mkdir -p "$NODE_BIN"
    CGO_ENABLED=1 go_in "$work/src" build -mod=mod -trimpath -tags seccomp \
        -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" -o "$NODE_BIN/runc.tmp" .
    mv "$NODE_BIN/runc.tmp" "$NODE_BIN/runc"
}

build_cni_plugins() {
    local p missing=()
    for p in bridge host-local loopback portmap; do [[ -x "$CNI_BIN/$p" ]] || missing+=("$p"); done
    [[ ${#missing[@]} -eq 0 ]] && { log "CNI plugins $CNI_PLUGINS_VERSION: cached in $CNI_BIN"; return; }
    log "CNI plugins $CNI_PLUGINS_VERSION: building ${missing[*]}"
    mkdir -p "$CNI_BIN"
    local pkgs=() m=github.com/containernetworking/plugins
    for p in "${missing[@]}"; do
        case $p in
        host-local) pkgs+=("$m/plugins/ipam/host-local@$CNI_PLUGINS_VERSION") ;;
        portmap) pkgs+=("$m/plugins/meta/portmap@$CNI_PLUGINS_VERSION") ;;
        *) pkgs+=("$m/plugins/main/$p@$CNI_PLUGINS_VERSION") ;;
        esac
    done
    CGO_ENABLED=0 go_install_into "$CNI_BIN" "$GPU_DRA_CACHE/work/cni-plugins-$CNI_PLUGINS_VERSION" -trimpath \
        -ldflags "-s -w" "${pkgs[@]}"
}

build_crictl() {
    [[ -x "$CRICTL_BIN/crictl" ]] && { log "crictl $CRICTL_VERSION: cached in $CRICTL_BIN"; return; }
    log "crictl $CRICTL_VERSION: building"
    mkdir -p "$CRICTL_BIN"
    CGO_ENABLED=0 go_install_into "$CRICTL_BIN" "$GPU_DRA_CACHE/work/crictl-$CRICTL_VERSION" -trimpath \
        -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" \
        "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
}

command -v go >/dev/null 2>&1 || die "the 'go' command is not on PATH; install Go >= 1.26 and retry"
install_debian_packages
build_runc
build_containerd
build_cni_plugins
build_crictl
log "done: $NODE_BIN $CNI_BIN $CRICTL_BIN"
