#!/usr/bin/env bash
# The demo on a real node: a local control plane, a kubelet v1.37.2 + containerd 2.4 node on this machine
# (e2e/node.sh), `helm install` of charts/gpu-dra with the image built from the Dockerfile's runtime stage, and
# workload pods whose containers print the GPUs they were given. e2e/demo.sh runs this when the machine can run
# containers. Leaves everything running; `e2e/cluster.sh down` stops it all (the node too).
set -euo pipefail
E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$E2E_DIR")"
NODE=gpu-node-1
GPUS=2xA100-80GB,2xH100-80GB
say() { printf '\n== %s\n' "$*"; }
show() { printf '  $ %s\n' "$*"; "$@" 2>&1 | sed 's/^/  /'; }

say "Building what is missing (Kubernetes, containerd, runc, CNI from Go modules; gpu-dra with cargo; the images)"
"$E2E_DIR/build-k8s.sh"
"$E2E_DIR/build-node.sh"
(cd "$REPO" && cargo build --release --locked)
# shellcheck source=e2e/versions.sh
source "$E2E_DIR/versions.sh"
IMAGES="$E2E_STATE-images"
"$E2E_DIR/build-images.sh" "$IMAGES" | sed 's/^/  built /'

say "Starting the local control plane and a real node: kubelet + containerd (CDI on) + runc + CNI bridge + kube-proxy"
"$E2E_DIR/cluster.sh" up --for-real-node >/dev/null
eval "$("$E2E_DIR/cluster.sh" env)"
eval "$("$E2E_DIR/node.sh" up "$NODE")"
"$E2E_DIR/node.sh" import "$NODE" "$IMAGES"/*.tar 2>/dev/null | grep -v '^Importing' | sed 's/^/  imported /' || true
# What Node Feature Discovery puts on a machine with an NVIDIA PCI device; the chart's DaemonSet selects it.
kubectl label node "$NODE" feature.node.kubernetes.io/pci-10de.present=true --overwrite >/dev/null
kubectl get nodes -o wide | sed 's/^/  /'

say "Installing gpu-dra with Helm (no registry: the image was imported into the node's containerd)"
show helm install gpu-dra "$REPO/charts/gpu-dra" --namespace gpu-dra --create-namespace \
    --set nodeAgent.gpuBackend=simulated --set "nodeAgent.simulatedGpus=${GPUS//,/\\,}" --set nodeAgent.privileged=false \
    --set "nodeAgent.kubeletDir=$GPU_DRA_NODE_KUBELET_DIR" --set "nodeAgent.cdiDir=$GPU_DRA_NODE_CDI_DIR" \
    --set "nodeAgent.stateDir=$GPU_DRA_NODE_STATE_DIR" --set deviceClasses.gpu.extendedResourceName=nvidia.com/gpu \
    --wait --timeout 180s --hide-notes
show kubectl get pods -n gpu-dra -o wide
echo "  Leader: $(kubectl get lease -n gpu-dra -o jsonpath='{.items[0].spec.holderIdentity}')"
for _ in $(seq 120); do
    [[ -n "$(kubectl get resourceslices --field-selector "spec.nodeName=$NODE" -o name)" ]] && break
    sleep 0.5
done
show kubectl get resourceslices

say "Two pods: trainer asks for two H100s through a ResourceClaimTemplate, classic for nvidia.com/gpu: 1"
kubectl create namespace gpu-demo --dry-run=client -o yaml | kubectl apply -f - >/dev/null
show kubectl apply -f "$E2E_DIR/examples/real-node/trainer.yaml"
kubectl wait -n gpu-demo --for=condition=Ready pod/trainer pod/classic --timeout=120s >/dev/null
show kubectl get pods,resourceclaims -n gpu-demo -o wide

say "What the containers see (their own logs, through kubelet and containerd)"
sleep 1
show kubectl logs -n gpu-demo trainer
show kubectl logs -n gpu-demo classic

say "GPU health: the GPU of pod classic reports XID 79 (fell off the bus), then a reset (fault injection, README \"GPU health\")"
claim=$(kubectl get pod classic -n gpu-demo -o jsonpath='{.status.extendedResourceClaimStatus.resourceClaimName}')
gpu=$(kubectl get resourceclaim "$claim" -n gpu-demo -o jsonpath='{.status.allocation.devices.results[0].device}')
taint_of() {
    kubectl get resourceslices --field-selector "spec.nodeName=$NODE" \
        -o jsonpath="{range .items[*]}{.spec.devices[?(@.name==\"$gpu\")].taints}{end}"
}
inject() { echo "$1" >"$GPU_DRA_NODE_STATE_DIR/inject-faults.new" && mv "$GPU_DRA_NODE_STATE_DIR/inject-faults.new" "$GPU_DRA_NODE_STATE_DIR/inject-faults"; }
inject "$gpu xid 79"
for _ in $(seq 100); do [[ -n "$(taint_of)" && "$(taint_of)" != "[]" ]] && break; sleep 0.05; done
echo "  $gpu tainted: $(taint_of)"
kubectl get events -A --field-selector reason=GpuFault -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message \
    --no-headers | tail -n 1 | sed 's/^/  /'
# NoExecute: kube-controller-manager's device-taint-eviction controller evicts the pod using the lost GPU.
kubectl wait -n gpu-demo --for=delete pod/classic --timeout=60s >/dev/null &&
    echo "  pod classic was evicted by Kubernetes (device-taint-eviction-controller); trainer, on other GPUs, runs on"
inject "$gpu clear"
for _ in $(seq 100); do [[ -z "$(taint_of)" || "$(taint_of)" == "[]" ]] && break; sleep 0.05; done
echo "  reset: $gpu untainted, schedulable again"

say "Events gpu-dra's controller emitted"
kubectl get events -n gpu-demo --field-selector reason=ResourceClaimCreated \
    -o custom-columns=OBJECT:.involvedObject.name,REASON:.reason,MESSAGE:.message --no-headers | sed 's/^/  /'

cat <<TXT

Explore it:
  eval "\$(e2e/cluster.sh env)"   # KUBECONFIG and PATH (kubectl, helm)
  kubectl get pods -A -o wide; kubectl get resourceclaims -n gpu-demo -o yaml
  e2e/node.sh crictl $NODE ps; ls $GPU_DRA_NODE_CDI_DIR
Stop it all (pods, node, control plane; the machine is left as it was):
  e2e/cluster.sh down
TXT
