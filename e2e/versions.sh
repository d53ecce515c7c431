# Pinned versions of the components the tests run against, and where their binaries are cached.
# Sourced by the e2e scripts; the Rust test support reads the same cache layout through `build-k8s.sh --print-bin-dirs`.
# The version every test runs against; `make test-matrix` (e2e/test-matrix.sh) also runs them on older ones by
# setting K8S_VERSION.
K8S_DEFAULT_VERSION=v1.37.2
K8S_VERSION=${K8S_VERSION:-$K8S_DEFAULT_VERSION}
# The minor version (37 for v1.37.2): components of older versions refuse feature gates they do not know.
K8S_MINOR=${K8S_VERSION#v1.}
K8S_MINOR=${K8S_MINOR%%.*}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
HELM_VERSION=${HELM_VERSION:-v4.3.2}
GPU_DRA_CACHE=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra}
K8S_BIN="$GPU_DRA_CACHE/k8s-$K8S_VERSION/bin"
ETCD_BIN="$GPU_DRA_CACHE/etcd-$ETCD_VERSION/bin"
HELM_BIN="$GPU_DRA_CACHE/helm-$HELM_VERSION/bin"
# k8s.io/kubernetes requires every staging module (k8s.io/api, …) at v0.0.0; a module built from it needs a replace
# to each one's published twin (v0.<minor>.<patch>). Prints one `-replace=…` argument for `go mod edit` per staging
# module named in the go.mod file $1.
staging_replaces() {
    local staging_version="v0.${K8S_VERSION#v1.}"
    grep -E '^\s+k8s\.io/[a-z0-9-]+ v0\.0\.0$' "$1" | awk -v v="$staging_version" '{print "-replace=" $1 "=" $1 "@" v}'
}
HADOLINT_VERSION=${HADOLINT_VERSION:-2.15.1}
HADOLINT_DIR="$GPU_DRA_CACHE/hadolint-$HADOLINT_VERSION"
# grpc-python, one of the gRPC clients the plugin's sockets are tested against (e2e/build-grpc-python.sh).
GRPCIO_VERSION=${GRPCIO_VERSION:-1.85.1}
# The real node (e2e/build-node.sh, e2e/node.sh): the container runtime and network plugins a kubelet runs pods with.
CONTAINERD_VERSION=${CONTAINERD_VERSION:-v2.4.2}
RUNC_VERSION=${RUNC_VERSION:-v1.3.3}
CNI_PLUGINS_VERSION=${CNI_PLUGINS_VERSION:-v1.10.0}
CRICTL_VERSION=${CRICTL_VERSION:-v1.37.0}
NODE_BIN="$GPU_DRA_CACHE/node-containerd-$CONTAINERD_VERSION-runc-$RUNC_VERSION/bin"
CNI_BIN="$GPU_DRA_CACHE/cni-plugins-$CNI_PLUGINS_VERSION/bin"
CRICTL_BIN="$GPU_DRA_CACHE/crictl-$CRICTL_VERSION/bin"
# Debian packages the real node needs: runc's seccomp support, iptables/nft for kube-proxy and the CNI bridge's
# masquerading, busybox for the pause and workload images.
NODE_DEBIAN_PACKAGES=(libseccomp-dev pkg-config iptables nftables busybox-static)
# cargo-deny (e2e/cargo-deny.sh): dependency licenses, bans and sources, from crates.io into the cache on first use.
CARGO_DENY_VERSION=${CARGO_DENY_VERSION:-0.20.2}
CARGO_DENY_DIR="$GPU_DRA_CACHE/cargo-deny-$CARGO_DENY_VERSION"
# The local cluster's state directory (cluster.sh, node.sh): certificates, kubeconfig, logs, pids, real nodes' records.
E2E_STATE="${GPU_DRA_E2E_DIR:-${TMPDIR:-/tmp}/gpu-dra-e2e-$(id -u)}"
# Absolute and canonical: node.sh writes it into kubelet and containerd configs, and compares it with the path a
# node's runtime directory names.
E2E_STATE="$(realpath -m "$E2E_STATE")"
