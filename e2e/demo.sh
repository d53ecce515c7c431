#!/usr/bin/env bash
# The demo: a local Kubernetes control plane, gpu-dra's controller and a node agent with simulated GPUs, and a
# pod whose ResourceClaimTemplate asks for two H100s — created by the controller, allocated by the real
# kube-scheduler from the agent's ResourceSlices. (Preparing the GPUs on the node, CDI, comes with the kubelet
# plugin.) Leaves everything running; `e2e/cluster.sh down` stops it all.
set -euo pipefail
E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$E2E_DIR")"
NODE=${GPU_DRA_DEMO_NODE:-gpu-node-1}
GPUS=${GPU_DRA_DEMO_GPUS:-2xA100-80GB,4xH100-80GB}
say() { printf '\n== %s\n' "$*"; }

say "Building what is missing (Kubernetes binaries from Go modules, gpu-dra with cargo)"
"$E2E_DIR/build-k8s.sh"
(cd "$REPO" && cargo build --locked --release --quiet)
BIN="$REPO/target/release/gpu-dra"

say "Starting the local control plane"
"$E2E_DIR/cluster.sh" up >/dev/null
eval "$("$E2E_DIR/cluster.sh" env)"
STATE=$(dirname "$KUBECONFIG")
"$E2E_DIR/cluster.sh" add-node "$NODE"

say "Starting gpu-dra: the claim controller, and a node agent on $NODE with simulated GPUs ($GPUS)"
"$E2E_DIR/cluster.sh" run gpu-dra-controller "$BIN" controller --leader-elect=false --metrics-addr 127.0.0.1:0
"$E2E_DIR/cluster.sh" run "gpu-dra-agent-$NODE" "$BIN" node-agent --node-name "$NODE" --gpu-backend simulated \
    --simulated-gpus "$GPUS" --metrics-addr 127.0.0.1:0 --state-dir "$STATE/agent-$NODE"
for _ in $(seq 100); do
    [[ -n "$(kubectl get resourceslices --field-selector "spec.nodeName=$NODE" -o name)" ]] && break
    sleep 0.1
done

say "Applying e2e/examples (DeviceClass, a ResourceClaimTemplate for two H100s, a pod using it)"
kubectl create namespace gpu-demo --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl apply -f "$E2E_DIR/examples/deviceclass.yaml" >/dev/null
t0=$(date +%s.%N)
kubectl apply -f "$E2E_DIR/examples/two-h100.yaml" >/dev/null
claim=""
for _ in $(seq 300); do
    claim=$(kubectl get pod trainer -n gpu-demo -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}' 2>/dev/null || true)
    node=$(kubectl get pod trainer -n gpu-demo -o jsonpath='{.spec.nodeName}' 2>/dev/null || true)
    [[ -n "$claim" && -n "$node" ]] && break
    sleep 0.1
done
t1=$(date +%s.%N)
[[ -n "$claim" && -n "$node" ]] || { echo "the pod was not scheduled; see: kubectl describe pod trainer -n gpu-demo" >&2; exit 1; }

say "What happened"
echo "Pod gpu-demo/trainer got its own ResourceClaim $claim from template two-h100 (gpu-dra controller),"
echo "and the kube-scheduler placed it on node $node with these devices:"
kubectl get resourceclaim "$claim" -n gpu-demo \
    -o jsonpath='{range .status.allocation.devices.results[*]}{.pool}/{.device}{"\n"}{end}' | while read -r dev; do
    device=${dev#*/}
    attrs=$(kubectl get resourceslices --field-selector "spec.nodeName=$NODE" -o json | python3 -c '
import json, sys
name = sys.argv[1]
for s in json.load(sys.stdin)["items"]:
    for d in s["spec"].get("devices", []):
        if d["name"] == name:
            a = d["attributes"]
            print(a["productName"]["string"], a["uuid"]["string"], "memory", d["capacity"]["memory"]["value"])
' "$device")
    echo "  $dev: $attrs"
done
python3 -c 'import sys; print(f"From kubectl apply to an allocated, reserved claim: {float(sys.argv[2]) - float(sys.argv[1]):.2f} s")' "$t0" "$t1"
echo
echo "Events the controller emitted:"
kubectl get events -n gpu-demo --field-selector reason=ResourceClaimCreated -o custom-columns=OBJECT:.involvedObject.name,REASON:.reason,MESSAGE:.message --no-headers | sed 's/^/  /'
cat <<TXT

Not yet: preparing the GPUs on the node (kubelet plugin, CDI specs) — the pod stays Pending without a kubelet.

Explore it:
  eval "\$(e2e/cluster.sh env)"   # KUBECONFIG and PATH (kubectl, helm)
  kubectl get resourceslices -o wide; kubectl get resourceclaims,pods -n gpu-demo -o wide
  less $STATE/logs/gpu-dra-controller.log
Stop it all:
  e2e/cluster.sh down
TXT
