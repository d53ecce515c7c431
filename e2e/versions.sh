# Pinned versions of the components the tests run against, and where their binaries are cached.
# Sourced by the e2e scripts; the Rust test support reads the same cache layout through `build-k8s.sh --print-bin-dirs`.
K8S_VERSION=${K8S_VERSION:-v1.37.2}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
HELM_VERSION=${HELM_VERSION:-v4.3.2}
GPU_DRA_CACHE=${GPU_DRA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra}
K8S_BIN="$GPU_DRA_CACHE/k8s-$K8S_VERSION/bin"
ETCD_BIN="$GPU_DRA_CACHE/etcd-$ETCD_VERSION/bin"
HELM_BIN="$GPU_DRA_CACHE/helm-$HELM_VERSION/bin"
HADOLINT_VERSION=${HADOLINT_VERSION:-2.15.1}
HADOLINT_DIR="$GPU_DRA_CACHE/hadolint-$HADOLINT_VERSION"
