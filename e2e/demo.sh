#!/usr/bin/env bash
# The demo: the whole pipeline on this machine. A local Kubernetes control plane, gpu-dra's RBAC and admission
# policy from the Helm chart, gpu-dra's controller, and two GPU nodes — each with a gpu-dra node agent (simulated
# GPUs; the real GPU through NVML on node 1 when this machine has one) and the kubelet side of the node: the real
# kubelet DRA code (plugin watcher + DRA manager) in e2e/kubelet-harness. Then the manifests in e2e/examples, and a
# plain-words account from pod to CDI devices. Leaves everything running; `e2e/cluster.sh down` stops it all.
#
# Where the machine can run containers (root, overlayfs, iproute2), the demo runs on a REAL node instead: kubelet +
# containerd, `helm install`, and the workload containers' own logs (e2e/demo-real-node.sh). GPU_DRA_DEMO=harness
# forces the harness; GPU_DRA_DEMO=real-node forces the real node.
#
# Usage: e2e/demo.sh [--measure N]   --measure: afterwards, N more runs of the trainer pod; prints the median time
#                                    from `kubectl apply` to its CDI devices being prepared (harness only).
set -euo pipefail
E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$E2E_DIR")"
RUNS=0
[[ "${1:-}" == "--measure" ]] && RUNS=${2:?--measure needs a number of runs}

# Why this machine cannot run the real-node demo (empty when it can).
real_node_unavailable() {
    [[ "$(id -u)" == 0 ]] || { echo "not root (a node needs mounts, network namespaces and cgroups)"; return; }
    grep -qw overlay /proc/filesystems || { echo "the kernel has no overlayfs (containerd's snapshotter)"; return; }
    command -v ip >/dev/null || { echo "no 'ip' command (iproute2)"; return; }
    [[ "$RUNS" -eq 0 ]] || echo "--measure times the harness"
}
case "${GPU_DRA_DEMO:-auto}" in
    real-node) exec "$E2E_DIR/demo-real-node.sh" ;;
    harness) echo "Demo on the kubelet harness (GPU_DRA_DEMO=harness)" ;;
    auto)
        why=$(real_node_unavailable)
        [[ -z "$why" ]] && exec "$E2E_DIR/demo-real-node.sh"
        echo "Demo on the kubelet harness, not a real node: $why" ;;
    *) echo "GPU_DRA_DEMO must be auto, real-node or harness, not '$GPU_DRA_DEMO'" >&2; exit 2 ;;
esac
NODES=(gpu-node-1 gpu-node-2)
GPUS=(2xA100-80GB,2xH100-80GB 4xH100-80GB)
DRIVER=gpu.gpu-dra.dev
say() { printf '\n== %s\n' "$*"; }
now() { date +%s.%N; }
secs() { python3 -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.2f} s")' "$1" "$2"; }

say "Building what is missing (Kubernetes and the kubelet harness from Go modules, gpu-dra with cargo)"
"$E2E_DIR/build-k8s.sh"
HARNESS=$("$E2E_DIR/build-kubelet-harness.sh" | tail -n 1)
(cd "$REPO" && cargo build --release --locked)
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/gpu-dra"

say "Starting the local control plane"
"$E2E_DIR/cluster.sh" up >/dev/null
eval "$("$E2E_DIR/cluster.sh" env)"
STATE=$(dirname "$KUBECONFIG")
LOGS=$STATE/logs

say "Installing gpu-dra's ServiceAccounts, RBAC and admission policy from the Helm chart (no container runtime here: the components run as local processes with the chart's settings)"
kubectl create namespace gpu-dra --dry-run=client -o yaml | kubectl apply -f - >/dev/null
helm template gpu-dra "$REPO/charts/gpu-dra" --namespace gpu-dra |
    python3 -c '
import sys
docs = sys.stdin.read().split("\n---")
skip = ("kind: Deployment", "kind: DaemonSet", "kind: PodDisruptionBudget", "kind: DeviceClass")
print("\n---".join(d for d in docs if not any(k in d for k in skip)))' |
    kubectl apply --server-side --field-manager gpu-dra-demo -f - | sed 's/^/  /'

say "Starting gpu-dra's controller, and per node its agent and kubelet side"
"$E2E_DIR/cluster.sh" run gpu-dra-controller "$BIN" controller --leader-elect=false --metrics-addr 127.0.0.1:0
for i in "${!NODES[@]}"; do
    node=${NODES[$i]} dir=$STATE/nodes/${NODES[$i]}
    mkdir -p "$dir"
    "$E2E_DIR/cluster.sh" add-node "$node"
    backend=(--gpu-backend simulated --simulated-gpus "${GPUS[$i]}")
    if [[ $i -eq 0 && -e /dev/nvidiactl ]]; then backend=(--gpu-backend nvml); fi
    "$E2E_DIR/cluster.sh" run "agent-$node" "$BIN" node-agent --node-name "$node" "${backend[@]}" \
        --kubelet-registry-dir "$dir/registry" --kubelet-plugins-dir "$dir/plugins" --cdi-dir "$dir/cdi" \
        --state-dir "$dir/state" --metrics-addr 127.0.0.1:0
    "$E2E_DIR/cluster.sh" run "kubelet-$node" "$HARNESS" --node-name "$node" --registry-dir "$dir/registry" \
        --state-dir "$dir/kubelet" --log-file "$LOGS/kubelet-$node.klog"
done
for node in "${NODES[@]}"; do
    for _ in $(seq 300); do grep -q '"event":"registered"' "$LOGS/kubelet-$node.log" && break; sleep 0.1; done
    grep -q '"event":"registered"' "$LOGS/kubelet-$node.log" ||
        { echo "the kubelet of $node did not register the agent; see $LOGS/kubelet-$node.klog" >&2; exit 1; }
    echo "  $node: the kubelet registered gpu-dra's plugin; $(kubectl get resourceslices --field-selector "spec.nodeName=$node" -o jsonpath='{range .items[*]}{.spec.devices[*].name}{end}' | wc -w) GPUs published"
done

# Waits until the kubelet of some node prepared pod $1 (or 60 s); prints the node.
wait_prepared() {
    local node
    for _ in $(seq 600); do
        for node in "${NODES[@]}"; do
            grep -q "\"event\":\"prepared\",\"pod\":\"gpu-demo/$1\"" "$LOGS/kubelet-$node.log" 2>/dev/null &&
                { echo "$node"; return 0; }
        done
        sleep 0.1
    done
    echo "pod $1 was not prepared within 60 s; see: kubectl describe pod $1 -n gpu-demo" >&2
    return 1
}

say "Applying e2e/examples: a DeviceClass, a pod asking for two H100s, a pod with two containers and two claims"
kubectl create namespace gpu-demo --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl apply -f "$E2E_DIR/examples/deviceclass.yaml" >/dev/null
t0=$(now)
kubectl apply -f "$E2E_DIR/examples/two-h100.yaml" >/dev/null
node=$(wait_prepared trainer)
t1=$(now)
kubectl apply -f "$E2E_DIR/examples/two-containers.yaml" >/dev/null
wait_prepared pair >/dev/null

say "What happened to pod gpu-demo/trainer"
claim=$(kubectl get pod trainer -n gpu-demo -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}')
echo "gpu-dra's controller created its ResourceClaim $claim from template two-h100;"
echo "the kube-scheduler picked node $node and these GPUs from the node agent's ResourceSlice:"
kubectl get resourceclaim "$claim" -n gpu-demo -o jsonpath='{range .status.allocation.devices.results[*]}{.device}{"\n"}{end}' |
while read -r device; do
    kubectl get resourceslices --field-selector "spec.nodeName=$node" -o json | python3 -c '
import json, sys
for s in json.load(sys.stdin)["items"]:
    for d in s["spec"].get("devices", []):
        if d["name"] == sys.argv[1]:
            a = {k: list(v.values())[0] for k, v in d["attributes"].items()}
            memory = d["capacity"]["memory"]["value"]
            print("  %s: %s, %s memory, %s, PCI %s" % (d["name"], a["productName"], memory, a["uuid"], a["resource.kubernetes.io/pciBusID"]))
' "$device"
done
echo "The kubelet on $node asked the node agent to prepare them (NodePrepareResources) and got CDI devices:"
grep "\"event\":\"prepared\",\"pod\":\"gpu-demo/trainer\"" "$LOGS/kubelet-$node.log" | head -n 1 | python3 -c '
import json, sys
for container, ids in json.load(sys.stdin)["containers"].items():
    for i in ids:
        print(f"  container {container}: {i}")'
spec=$(ls "$STATE/nodes/$node/cdi/"*"$(kubectl get resourceclaim "$claim" -n gpu-demo -o jsonpath='{.metadata.uid}')"*)
echo "The CDI spec the container runtime would read, $spec, gives the container:"
python3 - "$spec" <<'PY'
import json, sys
spec = json.load(open(sys.argv[1]))
nodes = [n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
nodes += [n["path"] for n in spec["containerEdits"].get("deviceNodes", [])]
print("  device nodes:", " ".join(nodes))
print("  environment: ", " ".join(spec["containerEdits"].get("env", [])))
mounts = spec["containerEdits"].get("mounts", [])
print(f"  driver files: {len(mounts)} read-only mounts" + ("" if mounts else " (simulated GPUs: no driver to mount)"))
PY
echo "From kubectl apply to prepared CDI devices: $(secs "$t0" "$t1")"
echo
echo "Pod gpu-demo/pair: two containers, each with its own claim and GPU:"
grep '"event":"prepared","pod":"gpu-demo/pair"' "$LOGS"/kubelet-*.log | head -n 1 | sed 's/^[^{]*//' | python3 -c '
import json, sys
for container, ids in sorted(json.load(sys.stdin)["containers"].items()):
    print("  container %s: %s" % (container, " ".join(ids)))'
echo
echo "Events gpu-dra's controller emitted:"
kubectl get events -n gpu-demo --field-selector reason=ResourceClaimCreated \
    -o custom-columns=OBJECT:.involvedObject.name,REASON:.reason,MESSAGE:.message --no-headers | sed 's/^/  /'

say "GPU health: gpu-0 of ${NODES[-1]} reports XID 79 (fell off the bus), then a reset (fault injection, README \"GPU health\")"
fault_node=${NODES[-1]}
fault_file=$STATE/nodes/$fault_node/state/inject-faults
taint_of() {
    kubectl get resourceslices --field-selector "spec.nodeName=$fault_node" \
        -o jsonpath='{range .items[*]}{.spec.devices[?(@.name=="gpu-0")].taints}{end}'
}
# Waits until gpu-0's taints are non-empty ($1 = set) or empty ($1 = clear); prints how long it took.
wait_taint() {
    local t0 taints
    t0=$(now)
    for _ in $(seq 100); do
        taints=$(taint_of)
        if [[ ( "$1" == set && -n "$taints" && "$taints" != "[]" ) || ( "$1" == clear && ( -z "$taints" || "$taints" == "[]" ) ) ]]; then
            secs "$t0" "$(now)"
            return 0
        fi
        sleep 0.05
    done
    echo "gpu-0 of $fault_node not ${1} within 5 s; see $LOGS/agent-$fault_node.log" >&2
    return 1
}
echo 'gpu-0 xid 79' >"$fault_file.new" && mv "$fault_file.new" "$fault_file"
echo "  tainted after $(wait_taint set): $(taint_of)"
kubectl get events -A --field-selector reason=GpuFault -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message \
    --no-headers | tail -n 1 | sed 's/^/  /'
echo 'gpu-0 clear' >"$fault_file.new" && mv "$fault_file.new" "$fault_file"
echo "  reset: untainted after $(wait_taint clear)"

if [[ "$RUNS" -gt 0 ]]; then
    say "Measuring: $RUNS more runs of the trainer pod (delete, apply, wait for prepared CDI devices)"
    times=()
    for run in $(seq "$RUNS"); do
        kubectl delete pod trainer -n gpu-demo --grace-period=0 --force >/dev/null 2>&1
        for _ in $(seq 300); do
            [[ -z "$(kubectl get resourceclaims -n gpu-demo -o name | grep trainer || true)" ]] && break
            sleep 0.1
        done
        before=$(cat "$LOGS"/kubelet-*.log | grep -c '"event":"prepared","pod":"gpu-demo/trainer"' || true)
        t0=$(now)
        kubectl apply -f "$E2E_DIR/examples/two-h100.yaml" >/dev/null
        for _ in $(seq 600); do
            [[ $(cat "$LOGS"/kubelet-*.log | grep -c '"event":"prepared","pod":"gpu-demo/trainer"' || true) -gt $before ]] && break
            sleep 0.02
        done
        times+=("$(python3 -c 'import sys; print(float(sys.argv[2]) - float(sys.argv[1]))' "$t0" "$(now)")")
    done
    python3 -c '
import statistics, sys
t = sorted(float(x) for x in sys.argv[1:])
print(f"  kubectl apply → CDI devices prepared, {len(t)} runs: median {statistics.median(t):.2f} s, min {t[0]:.2f} s, max {t[-1]:.2f} s")' "${times[@]}"
fi

cat <<TXT

Explore it:
  eval "\$(e2e/cluster.sh env)"   # KUBECONFIG and PATH (kubectl, helm)
  kubectl get resourceslices; kubectl get pods,resourceclaims -n gpu-demo -o wide
  ls $STATE/nodes/*/cdi; less $LOGS/agent-gpu-node-1.log $LOGS/kubelet-gpu-node-1.log
Stop it all:
  e2e/cluster.sh down
TXT
