#!/usr/bin/env bash
# A real, local Kubernetes control plane for tests and the demo: etcd, kube-apiserver (TLS, RBAC, service-account
# signing keys), kube-scheduler and kube-controller-manager as local processes on 127.0.0.1. No kubelet: `add-node`
# creates Ready Node objects that the scheduler places pods on.
#
# Usage:
#   e2e/cluster.sh up [--with-kcm-claim-controller] [--for-real-node]
#                                                      start (or find running) and print `export KUBECONFIG=...`;
#                                                      --for-real-node: ready for e2e/node.sh (see below)
#   e2e/cluster.sh env                                 print the KUBECONFIG and PATH exports of the running cluster
#   e2e/cluster.sh add-node NAME [KEY=VALUE ...]      create a Ready Node (extra labels optional)
#   e2e/cluster.sh run NAME CMD [ARG ...]              start CMD detached with the cluster's KUBECONFIG, logging to
#                                                      logs/NAME.log; `down` stops it with the cluster
#   e2e/cluster.sh down                                stop exactly what `up` started and remove the state directory
#
# Environment:
#   GPU_DRA_E2E_DIR          state directory (default ${TMPDIR:-/tmp}/gpu-dra-e2e-$UID): certs, kubeconfig, logs, pids
#   GPU_DRA_E2E_OWNER_PID    when set, a watchdog stops the cluster once that process is gone (tests set it)
#   GPU_DRA_E2E_API_PORT     pin the API server's port (default: a free port); a pinned port in use is an error
#   GPU_DRA_E2E_<C>_FLAGS    extra flags for component C (ETCD, APISERVER, SCHEDULER, KCM)
#   GPU_DRA_KCM_CLAIM_CONTROLLER=1   same as --with-kcm-claim-controller: also run KCM's resourceclaim-controller
#   GPU_DRA_E2E_FEATURE_GATES        feature gates for kube-apiserver, kube-scheduler and kube-controller-manager,
#                                    e.g. GenericWorkload=true,DRAWorkloadResourceClaims=true
#   GPU_DRA_E2E_RUNTIME_CONFIG       kube-apiserver --runtime-config, e.g. scheduling.k8s.io/v1alpha2=true (to serve
#                                    an API group version that is off by default)
#   GPU_DRA_E2E_KCM_CONTROLLERS      more kube-controller-manager controllers, added to the default list, e.g.
#                                    job-controller,deployment-controller,replicaset-controller
#   GPU_DRA_E2E_REAL_NODE=1          same as --for-real-node
#   GPU_DRA_E2E_NODE_IP              with --for-real-node: the node's address (default: this machine's address
#                                    on its default route)
#
# --for-real-node makes the control plane one a kubelet and pods can use, as on any cluster: the API server listens
# on every address and advertises the node's, so the `kubernetes` Service (10.0.0.1) has an endpoint pods reach
# through kube-proxy; Node,RBAC authorization with NodeRestriction; ServiceAccount admission (pods get tokens);
# kube-controller-manager also runs the serviceaccount, root-ca-certificate-publisher, deployment, replicaset,
# statefulset, daemonset, job, device-taint-eviction and resourcequota controllers. `down` first takes down every
# real node e2e/node.sh started.
#
# From Kubernetes 1.37 on, the API server enables the alpha field `derivedAttributes` (DRADerivedAttributes): the
# controller tests use it to prove that fields unknown to the compiled Rust types (k8s-openapi v1_34) survive claim
# generation. Older versions do not know the gate (K8S_VERSION selects the version; see e2e/versions.sh).
#
# Every process `up` starts is recorded by pid in $GPU_DRA_E2E_DIR/pids and carries the state directory in its
# command line; `down` and the stale-state check signal a pid only when its command line still names that directory.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=e2e/versions.sh
source "$E2E_DIR/versions.sh"
# shellcheck source=e2e/pki.sh
source "$E2E_DIR/pki.sh"
# shellcheck source=e2e/detach.sh
source "$E2E_DIR/detach.sh"

STATE="$E2E_STATE"
# Set by `up --for-real-node`: the node's address; the `kubernetes` Service's address in --service-cluster-ip-range.
NODE_IP=""
SERVICE_IP=10.0.0.1
PIDS="$STATE/pids"
LOGS="$STATE/logs"
START_TIMEOUT_S=${GPU_DRA_E2E_START_TIMEOUT_S:-90}

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] error: %s\n' "$*" >&2; exit 1; }

# check_list VARIABLE REGEX EXAMPLE: a malformed list would only show as a component failing to start, far from
# its cause; name the variable, its value and the expected shape up front instead.
check_list() {
    local value=${!1:-}
    [[ -z "$value" || "$value" =~ ^$2(,$2)*$ ]] ||
        die "$1='$value' is malformed: expected a comma-separated list like $3"
}

# --- process bookkeeping -------------------------------------------------------------------------------------

# True when pid $1 is alive and names the state directory in its command line or (processes started with
# `run`) in its GPU_DRA_E2E_RUN_BY environment variable, so a reused pid is never signalled.
owned_alive() {
    local pid=$1 cmdline
    cmdline=$(cmdline_of "$pid") || return 1
    [[ "$cmdline" == *"$STATE"* ]] && return 0
    { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qxF -- "GPU_DRA_E2E_RUN_BY=$STATE"
}

# `up` and `down` of one state directory never overlap: a `down` still stopping a dying run (its watchdog, say)
# would otherwise read the pids file a new `up` is writing and kill the new run's components. The lock file sits
# beside the directory, which both remove and recreate; it is released when the holding process exits.
lock_state() {
    mkdir -p "$(dirname "$STATE")"
    exec 9>>"$STATE.lock"
    flock 9
}

recorded_pids() { [[ -f "$PIDS" ]] && awk '{print $2}' "$PIDS" || true; }

# Stops every recorded process that is still ours: SIGTERM, then SIGKILL after a grace period.
stop_recorded() {
    local pids=() pid
    # Never this very process: the watchdog becomes `down` by exec, keeping its recorded pid.
    for pid in $(recorded_pids); do [[ "$pid" != "$$" ]] && owned_alive "$pid" && pids+=("$pid"); done
    [[ ${#pids[@]} -eq 0 ]] && return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
        local left=()
        for pid in "${pids[@]}"; do owned_alive "$pid" && left+=("$pid"); done
        [[ ${#left[@]} -eq 0 ]] && return 0
        sleep 0.1
    done
    for pid in "${pids[@]}"; do owned_alive "$pid" && kill -KILL "$pid" 2>/dev/null || true; done
}

# The cluster in $STATE is live when every recorded process is alive and the owner (if any) still runs.
state_is_live() {
    [[ -f "$PIDS" && -f "$STATE/kubeconfig" ]] || return 1
    local name pid
    while read -r name pid; do
        # Processes started with `run` may come and go; the cluster is its own components.
        case "$name" in
            etcd | kube-apiserver | kube-scheduler | kube-controller-manager | watchdog) owned_alive "$pid" || return 1 ;;
        esac
    done <"$PIDS"
    if [[ -f "$STATE/owner-pid" ]]; then
        kill -0 "$(cat "$STATE/owner-pid")" 2>/dev/null || return 1
    fi
    kubectl_admin get --raw /readyz >/dev/null 2>&1
}

clean_stale_state() {
    [[ -e "$STATE" ]] || return 0
    local left=()
    for pid in $(recorded_pids); do owned_alive "$pid" && left+=("$pid"); done
    log "found stale state in $STATE from an earlier run; stopping its ${#left[@]} surviving process(es) and removing it"
    stop_recorded
    rm -rf "$STATE"
}

kubectl_admin() { "$K8S_BIN/kubectl" --kubeconfig "$STATE/kubeconfig" "$@"; }

# The source address of this machine's default route (where a real node's pods and kubelet reach the API server).
default_route_address() {
    local a
    # A route lookup only: nothing is sent.
    a=$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -n 1)
    [[ -n "$a" ]] || a=$(ip -4 -o addr show scope global 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -n 1)
    echo "$a"
}

# --- ports -----------------------------------------------------------------------------------------------------

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

port_in_use() {
    python3 - "$1" <<'PY'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
PY
}

# --- certificates ----------------------------------------------------------------------------------------------

make_certs() {
    local d="$STATE/pki" san="IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc"
    # Pods of a real node reach the API server through the `kubernetes` Service's first address, and the kubelet
    # through the node's address.
    [[ -n "$NODE_IP" ]] && san+=",IP:$NODE_IP,IP:$SERVICE_IP,DNS:kubernetes.default,DNS:kubernetes"
    mkdir -p "$d"
    {
        openssl ecparam -name prime256v1 -genkey -noout -out "$d/ca.key" 2>/dev/null &&
            openssl req -x509 -new -key "$d/ca.key" -subj "/CN=gpu-dra-e2e-ca" -days 365 -out "$d/ca.crt" 2>/dev/null &&
            pki_issue "$d" apiserver "/CN=kube-apiserver" "$san" &&
            pki_issue "$d" admin "/O=system:masters/CN=gpu-dra-e2e-admin" &&
            pki_issue "$d" scheduler "/CN=system:kube-scheduler" &&
            pki_issue "$d" kcm "/CN=system:kube-controller-manager" &&
            openssl genrsa -out "$d/sa.key" 2048 2>/dev/null &&
            openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
    } || die "creating certificates with openssl failed in $d"
}

# kubeconfig FILE USER CERT-NAME
write_kubeconfig() {
    pki_kubeconfig "$1" "https://127.0.0.1:$API_PORT" "$STATE/pki/ca.crt" "$2" "$STATE/pki/$3.crt" "$STATE/pki/$3.key"
}

# --- components ------------------------------------------------------------------------------------------------

# start NAME CMD...: starts a detached process logging to $LOGS/NAME.log and records its pid.
start() {
    local name=$1; shift
    detach "$LOGS/$name.log" "$@"
    echo "$name $DETACHED_PID" >>"$PIDS"
}

pid_of() { awk -v n="$1" '$1 == n {print $2}' "$PIDS"; }

# Stops everything, shows why NAME failed, and exits non-zero. The logs stay for inspection; the next `up`
# treats the directory as stale and removes it.
fail_component() {
    stop_recorded
    report_failure "$@"
}

# report_failure NAME WHY: says why NAME failed, with the end of its log, and exits non-zero.
report_failure() {
    local name=$1 why=$2
    printf '[cluster] error: %s %s; last lines of %s:\n' "$name" "$why" "$LOGS/$name.log" >&2
    tail -n 25 "$LOGS/$name.log" | sed 's/^/    /' >&2
    exit 1
}

# wait_healthy NAME CHECK-CMD...: waits until the check passes; fails when the process dies or time runs out.
wait_healthy() {
    local name=$1; shift
    local pid deadline=$((SECONDS + START_TIMEOUT_S))
    pid=$(pid_of "$name")
    until "$@" >/dev/null 2>&1; do
        owned_alive "$pid" || fail_component "$name" "exited during start-up"
        ((SECONDS < deadline)) || fail_component "$name" "was not healthy after ${START_TIMEOUT_S}s"
        sleep 0.2
    done
    log "$name healthy (pid $pid)"
}

https_ok() { curl -fsS --max-time 2 --cacert "$STATE/pki/ca.crt" --cert "$STATE/pki/admin.crt" --key "$STATE/pki/admin.key" "$1"; }

start_etcd() {
    ETCD_PORT=$(free_port)
    # shellcheck disable=SC2086
    start etcd "$ETCD_BIN/etcd" --name gpu-dra-e2e --data-dir "$STATE/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:0" --unsafe-no-fsync --log-level warn ${GPU_DRA_E2E_ETCD_FLAGS:-}
    wait_healthy etcd curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_PORT/health"
}

start_apiserver() {
    if [[ -n "${GPU_DRA_E2E_API_PORT:-}" ]]; then
        API_PORT=$GPU_DRA_E2E_API_PORT
        if port_in_use "$API_PORT"; then
            stop_recorded
            die "GPU_DRA_E2E_API_PORT=$API_PORT: port $API_PORT on 127.0.0.1 is already in use; free it or unset GPU_DRA_E2E_API_PORT to pick a free port"
        fi
    else
        API_PORT=$(free_port)
    fi
    # The default: reachable only from this machine, no kubelet, no tokens in pods. A real node needs more (header).
    local listen=(--bind-address 127.0.0.1 --advertise-address 127.0.0.1 --endpoint-reconciler-type none
        --authorization-mode RBAC --disable-admission-plugins ServiceAccount)
    if [[ -n "$NODE_IP" ]]; then
        listen=(--bind-address 0.0.0.0 --advertise-address "$NODE_IP" --endpoint-reconciler-type lease
            --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction
            --kubelet-client-certificate "$STATE/pki/admin.crt" --kubelet-client-key "$STATE/pki/admin.key"
            --kubelet-preferred-address-types InternalIP,Hostname)
    fi
    local apiserver_gates=${GPU_DRA_E2E_FEATURE_GATES:-}
    ((K8S_MINOR >= 37)) && apiserver_gates="DRADerivedAttributes=true${apiserver_gates:+,$apiserver_gates}"
    # shellcheck disable=SC2086
    start kube-apiserver "$K8S_BIN/kube-apiserver" \
        --etcd-servers "http://127.0.0.1:$ETCD_PORT" --cert-dir "$STATE/pki" \
        --tls-cert-file "$STATE/pki/apiserver.crt" --tls-private-key-file "$STATE/pki/apiserver.key" \
        --client-ca-file "$STATE/pki/ca.crt" --secure-port "$API_PORT" "${listen[@]}" \
        --service-cluster-ip-range 10.0.0.0/24 --allow-privileged=true \
        --service-account-issuer "https://127.0.0.1:$API_PORT/" \
        --service-account-key-file "$STATE/pki/sa.pub" --service-account-signing-key-file "$STATE/pki/sa.key" \
        --profiling=false \
        ${apiserver_gates:+--feature-gates "$apiserver_gates"} \
        ${GPU_DRA_E2E_RUNTIME_CONFIG:+--runtime-config "$GPU_DRA_E2E_RUNTIME_CONFIG"} ${GPU_DRA_E2E_APISERVER_FLAGS:-}
    wait_healthy kube-apiserver https_ok "https://127.0.0.1:$API_PORT/readyz"
}

# start_kube_component NAME BINARY KUBECONFIG FLAGS...: scheduler and controller-manager share their shape.
start_kube_component() {
    local name=$1 bin=$2 kubeconfig=$3; shift 3
    local port; port=$(free_port)
    start "$name" "$K8S_BIN/$bin" --kubeconfig "$kubeconfig" \
        --authentication-kubeconfig "$kubeconfig" --authorization-kubeconfig "$kubeconfig" \
        --leader-elect=false --bind-address 127.0.0.1 --secure-port "$port" \
        ${GPU_DRA_E2E_FEATURE_GATES:+--feature-gates "$GPU_DRA_E2E_FEATURE_GATES"} "$@"
    # Its serving certificate is self-signed (in --cert-dir); /healthz needs no client identity.
    wait_healthy "$name" curl -fsSk --max-time 2 "https://127.0.0.1:$port/healthz"
}

print_env() {
    printf 'export KUBECONFIG=%q\n' "$STATE/kubeconfig"
    [[ "${1:-}" == "--with-path" ]] && printf 'export PATH=%q:%q:"$PATH"\n' "$K8S_BIN" "$HELM_BIN"
    return 0
}

# --- commands --------------------------------------------------------------------------------------------------

cmd_up() {
    local kcm_claim_controller=${GPU_DRA_KCM_CLAIM_CONTROLLER:-0} real_node=${GPU_DRA_E2E_REAL_NODE:-0}
    for arg in "$@"; do
        case "$arg" in
            --with-kcm-claim-controller) kcm_claim_controller=1 ;;
            --for-real-node) real_node=1 ;;
            *) die "unknown option to up: $arg (known: --with-kcm-claim-controller, --for-real-node)" ;;
        esac
    done
    if [[ "$real_node" == 1 ]]; then
        NODE_IP=${GPU_DRA_E2E_NODE_IP:-$(default_route_address)}
        [[ "$NODE_IP" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ && "$NODE_IP" != 127.* ]] ||
            die "--for-real-node needs a non-loopback IPv4 address for the node; found '${NODE_IP}'. Set GPU_DRA_E2E_NODE_IP to one of this machine's addresses"
    fi
    check_list GPU_DRA_E2E_FEATURE_GATES '[A-Za-z0-9]+=(true|false)' 'GenericWorkload=true,DRAWorkloadResourceClaims=true'
    check_list GPU_DRA_E2E_RUNTIME_CONFIG '[A-Za-z0-9./-]+(=(true|false))?' 'scheduling.k8s.io/v1alpha2=true'
    check_list GPU_DRA_E2E_KCM_CONTROLLERS '-?[a-z][a-z0-9-]*' 'job-controller,deployment-controller'
    command -v openssl >/dev/null || die "openssl is needed to create the cluster's certificates; install it (apt-get install openssl)"
    command -v python3 >/dev/null || die "python3 is needed to find free ports; install it"
    command -v curl >/dev/null || die "curl is needed for health checks; install it (apt-get install curl)"
    command -v flock >/dev/null || die "flock is needed to keep two runs off one state directory; install util-linux"

    lock_state
    if [[ -e "$STATE" ]]; then
        if state_is_live; then
            [[ "$real_node" == 1 && ! -f "$STATE/node-ip" ]] &&
                die "the cluster running in $STATE was started without --for-real-node; stop it with e2e/cluster.sh down, then start it again"
            log "cluster in $STATE is already up"
            print_env
            return 0
        fi
        clean_stale_state
    fi
    "$E2E_DIR/build-k8s.sh"

    local t0=$SECONDS
    mkdir -p "$STATE" "$LOGS"
    : >"$PIDS"
    [[ -n "$NODE_IP" ]] && echo "$NODE_IP" >"$STATE/node-ip"
    # Whatever fails from here on (a component, openssl, a write) leaves nothing running.
    trap 'rc=$?; [[ $rc -eq 0 ]] || stop_recorded' EXIT
    # The watchdog first: an owner killed while the components start (a test binary SIGKILLed, a CI job stopped;
    # no trap runs then) still has its cluster stopped.
    if [[ -n "${GPU_DRA_E2E_OWNER_PID:-}" ]]; then
        echo "$GPU_DRA_E2E_OWNER_PID" >"$STATE/owner-pid"
        start watchdog bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; GPU_DRA_E2E_DIR="$3" exec "$2" down --owner "$1"' \
            gpu-dra-e2e-watchdog "$GPU_DRA_E2E_OWNER_PID" "$E2E_DIR/cluster.sh" "$STATE"
    fi
    make_certs

    start_etcd
    start_apiserver
    write_kubeconfig "$STATE/kubeconfig" admin admin
    mkdir -p "$STATE/pki/kube-scheduler" "$STATE/pki/kube-controller-manager"
    write_kubeconfig "$STATE/scheduler.kubeconfig" system:kube-scheduler scheduler
    start_kube_component kube-scheduler kube-scheduler "$STATE/scheduler.kubeconfig" \
        --cert-dir "$STATE/pki/kube-scheduler" ${GPU_DRA_E2E_SCHEDULER_FLAGS:-}

    local controllers=garbage-collector-controller,namespace-controller kcm_real_node_flags=()
    [[ "$kcm_claim_controller" == 1 ]] && controllers+=,resourceclaim-controller
    if [[ -n "$NODE_IP" ]]; then
        controllers+=,serviceaccount-controller,root-ca-certificate-publisher-controller,deployment-controller
        controllers+=,replicaset-controller,statefulset-controller,daemonset-controller,job-controller
        controllers+=,device-taint-eviction-controller,resourcequota-controller
        kcm_real_node_flags=(--root-ca-file "$STATE/pki/ca.crt")
    fi
    [[ -n "${GPU_DRA_E2E_KCM_CONTROLLERS:-}" ]] && controllers+=,$GPU_DRA_E2E_KCM_CONTROLLERS
    # shellcheck disable=SC2086
    start_kube_component kube-controller-manager kube-controller-manager "$STATE/kubeconfig" \
        --cert-dir "$STATE/pki/kube-controller-manager" --controllers "$controllers" \
        --use-service-account-credentials=false "${kcm_real_node_flags[@]}" ${GPU_DRA_E2E_KCM_FLAGS:-}

    trap - EXIT
    log "up in $((SECONDS - t0))s: Kubernetes $K8S_VERSION at https://127.0.0.1:$API_PORT (controllers: $controllers)"
    print_env
}

cmd_down() {
    local owner=''
    [[ "${1:-}" == --owner ]] && owner=${2:?--owner needs a pid}
    lock_state
    # The watchdog of a run that ended stops only that run's cluster, never a newer one started in the same directory.
    if [[ -n "$owner" && "$(cat "$STATE/owner-pid" 2>/dev/null)" != "$owner" ]]; then
        log "not stopping $STATE: it no longer belongs to process $owner"
        return 0
    fi
    if [[ ! -e "$STATE" ]]; then
        log "nothing to stop: $STATE does not exist"
        return 0
    fi
    # Real nodes first: their pods must be unprepared and their mounts, networks and rules removed while the API
    # server still answers.
    if [[ -d "$STATE/nodes" ]]; then
        GPU_DRA_E2E_DIR="$STATE" "$E2E_DIR/node.sh" down --all || log "taking down the real node(s) failed; continuing"
    fi
    stop_recorded
    rm -rf "$STATE"
    log "stopped and removed $STATE"
}

cmd_env() {
    state_is_live || die "no running cluster in $STATE; start one with: e2e/cluster.sh up"
    print_env --with-path
}

cmd_add_node() {
    local name=${1:-}
    [[ -n "$name" ]] || die "usage: e2e/cluster.sh add-node NAME [KEY=VALUE ...]"
    shift
    state_is_live || die "no running cluster in $STATE; start one with: e2e/cluster.sh up"
    # A label value has at most 63 characters: a longer node name (a fully qualified one) keeps its host part there.
    local hostname=$name
    if (( ${#name} > 63 )); then
        hostname=${name%%.*}
        hostname=${hostname:0:63}
        while [[ "$hostname" == *[-_.] ]]; do hostname=${hostname%?}; done
    fi
    local labels="    kubernetes.io/hostname: \"$hostname\"
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64"
    for kv in "$@"; do
        [[ "$kv" == *=* ]] || die "label '$kv' is not KEY=VALUE"
        labels+=$'\n'"    \"${kv%%=*}\": \"${kv#*=}\""
    done
    if kubectl_admin get node "$name" >/dev/null 2>&1; then
        log "node $name already exists"
        return 0
    fi
    local now; now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    # A Node may carry its status on create. Nothing marks it NotReady later: the node-lifecycle controller is
    # not running, so no kubelet heartbeat is needed.
    kubectl_admin create -f - >/dev/null <<NODE
apiVersion: v1
kind: Node
metadata:
  name: "$name"
  labels:
$labels
status:
  capacity: {cpu: "32", memory: 256Gi, pods: "110", ephemeral-storage: 500Gi}
  allocatable: {cpu: "32", memory: 256Gi, pods: "110", ephemeral-storage: 500Gi}
  conditions:
  - {type: Ready, status: "True", reason: KubeletReady, message: "fake node without a kubelet (gpu-dra e2e)", lastHeartbeatTime: "$now", lastTransitionTime: "$now"}
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: $K8S_VERSION, kubeProxyVersion: "", bootID: "", containerRuntimeVersion: "", kernelVersion: "", machineID: "", osImage: "", systemUUID: ""}
NODE
    # The TaintNodesByCondition admission plugin taints every new node not-ready; the node-lifecycle controller
    # that would lift it once the node reports Ready is not running here, so lift it the same way.
    if kubectl_admin get node "$name" -o jsonpath='{.spec.taints[*].key}' | grep -qw node.kubernetes.io/not-ready; then
        kubectl_admin taint node "$name" node.kubernetes.io/not-ready:NoSchedule- >/dev/null
    fi
    log "node $name created (Ready, untainted)"
}

cmd_run() {
    local name=${1:-}
    [[ -n "$name" && $# -ge 2 ]] || die "usage: e2e/cluster.sh run NAME CMD [ARG ...]"
    [[ "$name" =~ ^[a-zA-Z0-9_.-]+$ ]] || die "run: NAME '$name' may hold only letters, digits, '.', '_' and '-'"
    shift
    state_is_live || die "no running cluster in $STATE; start one with: e2e/cluster.sh up"
    local pid; pid=$(pid_of "$name" | tail -n 1)
    if [[ -n "$pid" ]] && owned_alive "$pid"; then
        log "$name is already running (pid $pid)"
        return 0
    fi
    GPU_DRA_E2E_RUN_BY="$STATE" KUBECONFIG="$STATE/kubeconfig" start "$name" "$@"
    pid=$(pid_of "$name" | tail -n 1)
    sleep 0.5
    # The cluster stays up: only this process failed.
    owned_alive "$pid" || report_failure "$name" "exited at once"
    log "$name running (pid $pid, log $LOGS/$name.log)"
}

case "${1:-}" in
    up) shift; cmd_up "$@" ;;
    down) shift; cmd_down "$@" ;;
    env) cmd_env ;;
    add-node) shift; cmd_add_node "$@" ;;
    run) shift; cmd_run "$@" ;;
    *) die "usage: e2e/cluster.sh up [--with-kcm-claim-controller] | down | env | add-node NAME [KEY=VALUE ...] | run NAME CMD [ARG ...]" ;;
esac
