#!/usr/bin/env bash
# A real node on this machine, joined to the local control plane of e2e/cluster.sh (started with --for-real-node):
# containerd (CDI on) with runc and the CNI bridge, a kubelet and kube-proxy, all built by build-k8s.sh and
# build-node.sh. Pods scheduled to it run as real containers; the kubelet's DRA code calls a node agent's plugin
# socket under the node's kubelet directory, and containerd injects the devices of the CDI specs it writes.
#
# Usage:
#   e2e/node.sh up NAME            start the node (one real node per machine); prints its paths as exports
#   e2e/node.sh env NAME           print the node's paths as exports (GPU_DRA_NODE_KUBELET_DIR, …_CDI_DIR, …)
#   e2e/node.sh import NAME FILE…  import OCI image archives into the node's containerd (namespace k8s.io)
#   e2e/node.sh crictl NAME ARG…   crictl against the node's containerd
#   e2e/node.sh down NAME | --all  stop the node and undo every change it made to this machine
#
# Environment: GPU_DRA_E2E_DIR (the cluster's state directory, as for cluster.sh), GPU_DRA_NODE_ROOT (where the
# node's runtime directories live; default /var/lib/gpu-dra-e2e-node: socket paths must stay under 108 bytes).
#
# What `up` changes on this machine, and `down` undoes: processes (containerd, its shims, kubelet, kube-proxy),
# mounts under the node's directories, the bridge gpudra0 and the pods' network namespaces, iptables chains added by
# the kubelet and kube-proxy, the kernel settings the kubelet sets (recorded before, restored after), the kubepods
# cgroups, and the Node object. A node a killed run left behind (its cluster's state directory gone too) is taken
# down by `down` or, once its cluster is gone, by the next `up` (see take_down_leftover).
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=e2e/versions.sh
source "$E2E_DIR/versions.sh"
# shellcheck source=e2e/pki.sh
source "$E2E_DIR/pki.sh"
# shellcheck source=e2e/detach.sh
source "$E2E_DIR/detach.sh"

STATE="$E2E_STATE"
NODE_ROOT="${GPU_DRA_NODE_ROOT:-/var/lib/gpu-dra-e2e-node}"
BRIDGE=gpudra0
POD_SUBNET=10.244.0.0/24
CLUSTER_CIDR=10.244.0.0/16
# Kernel settings a node changes, recorded by `up` and restored by `down`: those the kubelet sets when
# protectKernelDefaults is false (pkg/kubelet/cm/container_manager_linux.go, setupKernelTunables).
# The CNI bridge turns on IPv4 forwarding (isGateway).
HOST_SYSCTLS=(net/ipv4/ip_forward vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys
    kernel/keys/root_maxbytes)
START_TIMEOUT_S=${GPU_DRA_NODE_START_TIMEOUT_S:-120}

log() { printf '[node] %s\n' "$*" >&2; }
die() { printf '[node] error: %s\n' "$*" >&2; exit 1; }

kubectl_admin() { "$K8S_BIN/kubectl" --kubeconfig "$STATE/kubeconfig" "$@"; }

# Paths of node $1: bookkeeping in the cluster's state directory, runtime directories under NODE_ROOT. What `up`
# found on the machine, which `down` restores, is recorded under the runtime directory (HOST_RECORD), and that
# directory names its bookkeeping directory (OWNER): a node whose run was killed, and whose cluster state directory
# went with it (a CI clone, a test's temporary directory), is still taken down whole by the next `up`.
node_paths() {
    NAME=$1
    [[ "$NAME" =~ ^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$ ]] ||
        die "node name '$NAME' must be a DNS label of at most 42 characters (lowercase letters, digits, '-')"
    META="$STATE/nodes/$NAME"
    RUN="$NODE_ROOT/$NAME"
    LOGS="$STATE/logs"
    CONTAINERD_SOCK="$RUN/containerd.sock"
    KUBELET_DIR="$RUN/kubelet"
    CDI_DIR="$RUN/cdi"
    AGENT_STATE_DIR="$RUN/gpu-dra"
    HOST_RECORD="$RUN/host-before-up"
    OWNER="$RUN/owner"
}

# Points META at the bookkeeping directory the node's runtime directory names: another cluster's for a node that
# cluster started (or a killed run left).
use_owner() {
    local owner
    owner=$(cat "$OWNER" 2>/dev/null) || return 0
    # Only what `up` writes: an absolute path ending in nodes/NAME (anything else is not trusted near rm -rf).
    [[ "$owner" == /* && "$owner" == */nodes/"$NAME" ]] && META=$owner
    return 0
}

# ere PATH: PATH as an extended regular expression matching it literally (pgrep -f takes one).
ere() { printf '%s' "$1" | sed 's/[][\.*^$(){}+?|]/\\&/g'; }

print_env() {
    printf 'export GPU_DRA_NODE_NAME=%q\n' "$NAME"
    printf 'export GPU_DRA_NODE_KUBELET_DIR=%q\n' "$KUBELET_DIR"
    printf 'export GPU_DRA_NODE_CDI_DIR=%q\n' "$CDI_DIR"
    printf 'export GPU_DRA_NODE_STATE_DIR=%q\n' "$AGENT_STATE_DIR"
    printf 'export GPU_DRA_NODE_CONTAINERD=%q\n' "unix://$CONTAINERD_SOCK"
}

# --- processes ---------------------------------------------------------------------------------------------------

# start NAME CMD…: detached, logging to $LOGS/node-$NAME-NAME.log, pid recorded in $META/pids.
start() {
    local what=$1; shift
    detach "$LOGS/node-$NAME-$what.log" "$@"
    echo "$what $DETACHED_PID" >>"$META/pids"
}

# True when pid $1 is alive and its command line names this node's directories (a reused pid is never signalled).
ours() {
    local cmdline
    cmdline=$(cmdline_of "$1") || return 1
    [[ "$cmdline" == *"$META/"* || "$cmdline" == *"$RUN/"* ]]
}

# stop_process NAME: SIGTERM, SIGKILL after 10 s.
stop_process() {
    local pid
    pid=$(awk -v n="$1" '$1 == n {print $2}' "$META/pids" 2>/dev/null | tail -n 1)
    [[ -n "$pid" ]] && ours "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do ours "$pid" || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
}

# stop_naming PATTERN: SIGTERM to every process whose command line matches PATTERN (pgrep -f: an extended regular
# expression; paths go through `ere`), SIGKILL after 10 s.
# For a node's processes its bookkeeping does not list: it went with a killed run's state directory.
stop_naming() {
    local pids
    pids=$(pgrep -f -- "$1" 2>/dev/null) || return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 100); do pgrep -f -- "$1" >/dev/null 2>&1 || return 0; sleep 0.1; done
    pids=$(pgrep -f -- "$1" 2>/dev/null) || return 0
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
}

wait_for() { # WHAT TIMEOUT CMD…
    local what=$1 timeout=$2; shift 2
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
    log "$what ready"
}

# Shows the end of a component's log and takes the node down again.
fail() {
    local what=$1 why=$2
    log "$what: $why; the end of $LOGS/node-$NAME-$what.log:"
    tail -n 25 "$LOGS/node-$NAME-$what.log" >&2 || true
    cmd_down "$NAME" >/dev/null 2>&1 || true
    die "$what of node $NAME $why (full log above: $LOGS/node-$NAME-$what.log)"
}

# --- host changes recorded before `up` -----------------------------------------------------------------------------

record_host() {
    local s
    mkdir -p "$HOST_RECORD"
    : >"$HOST_RECORD/sysctls"
    for s in "${HOST_SYSCTLS[@]}"; do
        [[ -r "/proc/sys/$s" ]] && echo "$s $(cat "/proc/sys/$s")" >>"$HOST_RECORD/sysctls"
    done
    for ipt in iptables ip6tables; do
        "$ipt-save" 2>/dev/null | sed -n 's/^:\([^ ]*\) .*/\1/p' | sort -u >"$HOST_RECORD/$ipt-chains" || : >"$HOST_RECORD/$ipt-chains"
    done
    # Last, so that a record cut short names no hierarchy: the cgroup hierarchies (v1 controllers, v2's unified one,
    # a pure v2 root) that had no kubepods cgroup, the only ones whose kubepods `down` may empty and remove.
    local h absent=()
    for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
        h=${h%/}
        [[ -e "$h/cgroup.procs" && ! -e "$h/kubepods" ]] && absent+=("$h")
    done
    printf '%s\n' "${absent[@]}" >"$HOST_RECORD/kubepods-absent.tmp" && mv "$HOST_RECORD/kubepods-absent.tmp" "$HOST_RECORD/kubepods-absent"
    return 0
}

restore_host() {
    local s v record=$HOST_RECORD
    # A node of an older node.sh kept its record of sysctls and chains in its bookkeeping.
    [[ -d "$record" ]] || record=$META
    if [[ -f "$record/sysctls" ]]; then
        while read -r s v; do
            [[ "$(cat "/proc/sys/$s" 2>/dev/null)" == "$v" ]] || echo "$v" >"/proc/sys/$s" 2>/dev/null ||
                log "could not restore $s to $v"
        done <"$record/sysctls"
    fi
    # kube-proxy removes what it made; then every chain that did not exist before (the kubelet's KUBE-FIREWALL and
    # KUBE-KUBELET-CANARY) loses the rules jumping to it and goes.
    [[ -x "$K8S_BIN/kube-proxy" ]] && "$K8S_BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
    for ipt in iptables ip6tables; do
        command -v "$ipt-save" >/dev/null || continue
        [[ -f "$record/$ipt-chains" ]] || continue
        local table chain rule
        for table in filter nat mangle; do
            local new=()
            while read -r chain; do
                grep -qxF "$chain" "$record/$ipt-chains" || new+=("$chain")
            done < <("$ipt-save" -t "$table" 2>/dev/null | sed -n 's/^:\(KUBE-[^ ]*\) .*/\1/p')
            for chain in "${new[@]}"; do
                while read -r rule; do
                    # shellcheck disable=SC2086
                    "$ipt" -t "$table" -D ${rule#-A } 2>/dev/null || true
                done < <("$ipt-save" -t "$table" | grep -E -- "^-A .* -j $chain( |$)")
            done
            for chain in "${new[@]}"; do "$ipt" -t "$table" -F "$chain" 2>/dev/null || true; done
            for chain in "${new[@]}"; do "$ipt" -t "$table" -X "$chain" 2>/dev/null || true; done
        done
    done
    # The kubelet's cgroups (cgroupfs driver, cgroup root /), in the hierarchies where it made them: a container that
    # outlived its shim (a node whose processes were killed) is killed first, then the cgroups go, leaves first.
    # Without a record (a node of an older node.sh, or a record cut short) they are left alone.
    if [[ -f "$HOST_RECORD/kubepods-absent" ]]; then
        local h d pid
        while read -r h; do
            d=$h/kubepods
            [[ -n "$h" && -d "$d" ]] || continue
            # A PID of 0 is a task outside this PID namespace; 1 and this script are never the node's.
            for pid in $(find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u); do
                ((pid > 1 && pid != $$)) && kill -KILL "$pid" 2>/dev/null || true
            done
            for _ in $(seq 50); do
                [[ -z "$(find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null)" ]] && break
                sleep 0.1
            done
            find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
        done <"$HOST_RECORD/kubepods-absent"
    fi
    return 0
}

# --- up ------------------------------------------------------------------------------------------------------------

write_containerd_config() {
    cat >"$META/containerd.toml" <<TOML
# containerd for gpu-dra's real e2e node $NAME (written by e2e/node.sh).
version = 3
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"

[grpc]
  address = "$CONTAINERD_SOCK"

[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"

[plugins."io.containerd.cri.v1.runtime"]
  # CDI is always on in containerd 2.x; these are the directories it reads specs from.
  cdi_spec_dirs = ["$CDI_DIR"]
  # This machine refuses a negative oom_score_adj even to root; the pod sandbox asks for -998.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$NODE_BIN/runc"
        Root = "$RUN/runc"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$RUN/cni/net.d"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$PAUSE_IMAGE"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
TOML
}

write_cni_config() {
    mkdir -p "$RUN/cni/net.d" "$RUN/cni/ipam"
    cat >"$RUN/cni/net.d/10-gpu-dra-e2e.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "gpu-dra-e2e",
  "plugins": [
    {
      "type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_SUBNET"}]], "routes": [{"dst": "0.0.0.0/0"}],
               "dataDir": "$RUN/cni/ipam"}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
}

write_kubelet_config() {
    local pki="$META/pki"
    mkdir -p "$pki"
    cp "$STATE/pki/ca.crt" "$STATE/pki/ca.key" "$pki/"
    # The kubelet's identity: system:node:NAME in system:nodes, what the Node authorizer and NodeRestriction expect.
    pki_issue "$pki" kubelet-client "/O=system:nodes/CN=system:node:$NAME" || die "openssl failed issuing the kubelet's certificate"
    pki_issue "$pki" kubelet-serving "/CN=system:node:$NAME" "IP:$NODE_IP,DNS:$NAME" || die "openssl failed"
    pki_issue "$pki" kube-proxy "/CN=system:kube-proxy" || die "openssl failed issuing kube-proxy's certificate"
    rm -f "$pki/ca.key"
    local server="https://$NODE_IP:$API_PORT"
    pki_kubeconfig "$META/kubelet.kubeconfig" "$server" "$pki/ca.crt" "system:node:$NAME" "$pki/kubelet-client.crt" "$pki/kubelet-client.key"
    pki_kubeconfig "$META/kube-proxy.kubeconfig" "$server" "$pki/ca.crt" system:kube-proxy "$pki/kube-proxy.crt" "$pki/kube-proxy.key"
    cat >"$META/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine kind mounts cgroup v1 (with v2 at /sys/fs/cgroup/unified); kubelet 1.37 runs on it when told to.
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $pki/kubelet-serving.crt
tlsPrivateKeyFile: $pki/kubelet-serving.key
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
# Nothing here may be collected or evicted for lack of space: the images cannot be pulled again.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 50Mi, nodefs.available: "1%", nodefs.inodesFree: "1%", imagefs.available: "1%"}
protectKernelDefaults: false
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
shutdownGracePeriod: 0s
serializeImagePulls: false
YAML
    cat >"$META/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $META/kube-proxy.kubeconfig}
hostnameOverride: $NAME
mode: iptables
clusterCIDR: $CLUSTER_CIDR
bindAddress: 0.0.0.0
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# No sysctl writes for conntrack (this machine may refuse them); the kernel's defaults serve a test node.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false}
YAML
}

node_ready() {
    [[ "$(kubectl_admin get node "$NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

cmd_up() {
    node_paths "${1:-}"
    [[ -f "$STATE/node-ip" && -f "$STATE/kubeconfig" ]] ||
        die "no cluster ready for a real node in $STATE; start one with: e2e/cluster.sh up --for-real-node"
    [[ "$(id -u)" == 0 ]] || die "a real node needs root (mounts, network namespaces, cgroups); run as root"
    kubectl_admin get --raw /readyz >/dev/null 2>&1 || die "the cluster in $STATE does not answer; start it with: e2e/cluster.sh up --for-real-node"
    if [[ -f "$META/pids" ]]; then
        local pid; pid=$(awk '$1 == "kubelet" {print $2}' "$META/pids" | tail -n 1)
        if [[ -n "$pid" ]] && ours "$pid"; then
            log "node $NAME is already up"
            print_env
            return 0
        fi
        log "found stale state of node $NAME; taking it down first"
        ( cmd_down "$NAME" )
    fi
    local other
    for other in "$NODE_ROOT"/*/; do
        [[ -d "$other" ]] || continue
        other=$(basename "$other")
        [[ "$other" =~ ^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$ ]] || { log "ignoring $NODE_ROOT/$other: no node's name"; continue; }
        take_down_leftover "$other"
    done
    for b in "$K8S_BIN/kubelet" "$K8S_BIN/kube-proxy" "$NODE_BIN/containerd" "$NODE_BIN/runc" "$CNI_BIN/bridge" "$CRICTL_BIN/crictl"; do
        [[ -x "$b" ]] || die "$b is missing; build it with: e2e/build-k8s.sh && e2e/build-node.sh"
    done
    NODE_IP=$(cat "$STATE/node-ip")
    API_PORT=$(sed -n 's|.*server: https://127.0.0.1:\([0-9]*\).*|\1|p' "$STATE/kubeconfig")
    PAUSE_IMAGE=${GPU_DRA_NODE_PAUSE_IMAGE:-registry.k8s.io/pause:3.10.2}

    local t0=$SECONDS
    mkdir -p "$META" "$RUN"
    realpath -m "$META" >"$OWNER"
    mkdir -p "$LOGS" "$CDI_DIR" "$AGENT_STATE_DIR" "$KUBELET_DIR"
    : >"$META/pids"
    trap 'rc=$?; [[ $rc -eq 0 ]] || cmd_down "$NAME" >/dev/null 2>&1 || true' EXIT
    # The node's directories are a shared mount, as everything is on a systemd host (its / is shared): a container's
    # mountPropagation: Bidirectional (the agent's MPS tmpfs) needs one, and this machine's / may be private.
    mount --bind "$RUN" "$RUN" && mount --make-rshared "$RUN" || die "could not make $RUN a shared mount (root needed)"
    record_host
    write_containerd_config
    write_cni_config
    write_kubelet_config

    # containerd finds its shim on PATH: ours must come before any older one installed on the machine.
    start containerd env PATH="$NODE_BIN:$PATH" "$NODE_BIN/containerd" --config "$META/containerd.toml"
    wait_for containerd 30 "$CRICTL_BIN/crictl" --runtime-endpoint "unix://$CONTAINERD_SOCK" info ||
        fail containerd "did not answer on $CONTAINERD_SOCK within 30 s"

    start kubelet "$K8S_BIN/kubelet" --config "$META/kubelet.yaml" --kubeconfig "$META/kubelet.kubeconfig" \
        --root-dir "$KUBELET_DIR" --cert-dir "$META/pki" --hostname-override "$NAME" --node-ip "$NODE_IP" \
        --node-labels "gpu-dra.dev/e2e-real-node=true"
    wait_for "kubelet (node $NAME Ready)" "$START_TIMEOUT_S" node_ready ||
        fail kubelet "did not make node $NAME Ready within ${START_TIMEOUT_S} s"
    # TaintNodesByCondition tainted the new node not-ready; the node-lifecycle controller that lifts it is not part
    # of this control plane, so lift it the same way now that the node is Ready.
    kubectl_admin taint node "$NAME" node.kubernetes.io/not-ready:NoSchedule- >/dev/null 2>&1 || true

    start kube-proxy "$K8S_BIN/kube-proxy" --config "$META/kube-proxy.yaml"
    wait_for kube-proxy 60 curl -fsS --max-time 2 http://127.0.0.1:10256/healthz ||
        fail kube-proxy "did not become healthy within 60 s"
    trap - EXIT
    log "node $NAME up in $((SECONDS - t0))s (kubelet $K8S_VERSION, containerd $CONTAINERD_VERSION, runc $RUNC_VERSION; node IP $NODE_IP)"
    print_env
}

# --- down ----------------------------------------------------------------------------------------------------------

cmd_down() {
    if [[ "${1:-}" == "--all" ]]; then
        local d
        for d in "$STATE"/nodes/*/; do [[ -d "$d" ]] && cmd_down "$(basename "$d")"; done
        return 0
    fi
    node_paths "${1:-}"
    use_owner
    [[ -d "$META" || -d "$RUN" ]] || { log "node $NAME: nothing to take down"; return 0; }
    take_down
}

# take_down: stops the node of node_paths (META may name another cluster's bookkeeping) and undoes its changes to
# the machine. The cluster is told (pods deleted, the Node object) only when the node is this cluster's.
take_down() {
    local api=0
    [[ "$(realpath -m "$META")" == "$(realpath -m "$STATE/nodes/$NAME")" ]] && kubectl_admin get --raw /readyz >/dev/null 2>&1 &&
        api=1
    # Pods first, while the kubelet runs: it stops their containers and unprepares their claims. Pods of a
    # DaemonSet come back; they go with the runtime below.
    if [[ $api == 1 ]] && [[ -f "$META/pids" ]]; then
        kubectl_admin delete pods --all-namespaces --field-selector "spec.nodeName=$NAME" --wait=false >/dev/null 2>&1 || true
        # Until no pod is terminating any more (replacements made meanwhile are not waited for), at most 30 s.
        local terminating='{range .items[?(@.metadata.deletionTimestamp)]}{.metadata.name}{"\n"}{end}'
        for _ in $(seq 60); do
            [[ -z "$(kubectl_admin get pods -A --field-selector "spec.nodeName=$NAME" -o jsonpath="$terminating" 2>/dev/null)" ]] && break
            sleep 0.5
        done
    fi
    [[ -f "$META/pids" ]] && { stop_process kube-proxy; stop_process kubelet; }
    stop_naming "$(ere "$META/kube-proxy.yaml")"
    stop_naming "$(ere "$META/kubelet.yaml")"
    # Every pod sandbox: stops containers, runs CNI DEL (veth, IP), unmounts their volumes and network namespace.
    if [[ -S "$CONTAINERD_SOCK" ]]; then
        timeout 60 "$CRICTL_BIN/crictl" --runtime-endpoint "unix://$CONTAINERD_SOCK" rmp -fa >/dev/null 2>&1 || true
    fi
    [[ -f "$META/pids" ]] && stop_process containerd
    stop_naming "$(ere "$META/containerd.toml")"
    # Shims (and their containers) that outlived containerd: they name our socket in their command line.
    local pid
    for pid in $(pgrep -f "containerd-shim-runc-v2.*$(ere "$RUN/")" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    # Anything else still naming the node's directories.
    stop_naming "$(ere "$RUN/")|$(ere "$META/")"
    # Mounts under the node's directories, deepest first.
    local m
    while read -r m; do umount -l "$m" 2>/dev/null || true; done < <(
        awk -v a="$RUN" -v b="$META" '$2 == a || $2 == b || index($2, a "/") == 1 || index($2, b "/") == 1 {print $2}' /proc/mounts | sort -r)
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE" 2>/dev/null || true
    restore_host
    if [[ $api == 1 ]]; then kubectl_admin delete node "$NAME" --wait=false >/dev/null 2>&1 || true; fi
    rm -rf "$RUN" "$META"
    rmdir "$NODE_ROOT" 2>/dev/null || true
    rmdir "$STATE/nodes" 2>/dev/null || true
    log "node $NAME taken down"
}

# cluster_answers STATE: whether the API server of the cluster in STATE answers /readyz, asked three times (5 s each:
# a loaded machine's live cluster must not lose its node to one slow answer).
cluster_answers() {
    for _ in 1 2 3; do
        "$K8S_BIN/kubectl" --kubeconfig "$1/kubeconfig" --request-timeout=5s get --raw /readyz >/dev/null 2>&1 && return 0
        [[ -f "$1/kubeconfig" ]] || return 1
    done
    return 1
}

# take_down_leftover NAME: node NAME's runtime directory is on this machine, with no bookkeeping in this cluster's
# state directory. While its cluster lives (the bookkeeping its directory names exists and that cluster's API server
# answers), it is another cluster's node, running or starting (one real node per machine): refused, saying how to
# take it down. Otherwise it is what a killed run left (a CI job stopped, a session ended, a test binary killed
# whose clone went before its watchdog could act), taken down here, with any of its processes still running, so
# that nothing of it stays behind and the new node can start.
take_down_leftover() (
    node_paths "$1"
    use_owner
    local owner_state pids
    owner_state=$(dirname "$(dirname "$META")")
    pids=$(pgrep -d ' ' -f "$(ere "$RUN/")|$(ere "$META/")" 2>/dev/null) || pids=""
    if [[ -d "$META" ]] && cluster_answers "$owner_state"; then
        die "another real node is on this machine: $NAME, of the cluster in $owner_state, which answers" \
            "(processes naming its directories: ${pids:-none yet}); one real node per machine: take it down with:" \
            "GPU_DRA_E2E_DIR=$owner_state e2e/node.sh down $NAME"
    fi
    if [[ -n "$pids" ]]; then
        log "found node $NAME of a cluster that is gone ($owner_state), still running; taking it down"
    else
        log "found node $NAME left by a run that ended without taking it down (nothing runs there); taking it down"
    fi
    take_down
)

cmd_env() {
    node_paths "${1:-}"
    [[ -d "$META" ]] || die "node $NAME is not up; start it with: e2e/node.sh up $NAME"
    print_env
}

cmd_import() {
    node_paths "${1:-}"
    shift
    [[ -S "$CONTAINERD_SOCK" ]] || die "node $NAME is not up (no $CONTAINERD_SOCK); start it with: e2e/node.sh up $NAME"
    local f
    for f in "$@"; do
        [[ -f "$f" ]] || die "image archive $f does not exist; build the images with: e2e/build-images.sh DIR"
        "$NODE_BIN/ctr" --address "$CONTAINERD_SOCK" -n k8s.io images import "$f" >&2 ||
            die "containerd could not import $f"
    done
}

cmd_crictl() {
    node_paths "${1:-}"
    shift
    exec "$CRICTL_BIN/crictl" --runtime-endpoint "unix://$CONTAINERD_SOCK" "$@"
}

case "${1:-}" in
    up) shift; cmd_up "$@" ;;
    down) shift; cmd_down "$@" ;;
    env) shift; cmd_env "$@" ;;
    import) shift; cmd_import "$@" ;;
    crictl) shift; cmd_crictl "$@" ;;
    *) die "usage: e2e/node.sh up NAME | env NAME | import NAME FILE... | crictl NAME ARG... | down NAME|--all" ;;
esac
