#!/usr/bin/env bash
# The demo: a local Kubernetes control plane with one fake node, ready for DRA.
# (The full GPU pipeline demo replaces this once the controller and node agent exist.)
set -euo pipefail
E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODE=${GPU_DRA_DEMO_NODE:-gpu-node-1}

"$E2E_DIR/build-k8s.sh"
"$E2E_DIR/cluster.sh" up >/dev/null
"$E2E_DIR/cluster.sh" add-node "$NODE"
eval "$("$E2E_DIR/cluster.sh" env)"

cat <<TXT

The local control plane is up: etcd, kube-apiserver, kube-scheduler and kube-controller-manager at
$(kubectl config view -o jsonpath='{.clusters[0].cluster.server}'), with one Ready node ($NODE, no kubelet).

$(kubectl get nodes -o wide)

DRA (resource.k8s.io/v1) is served:
$(kubectl api-resources --api-group=resource.k8s.io | sed 's/^/  /')

Explore it:
  eval "\$(e2e/cluster.sh env)"   # KUBECONFIG and PATH (kubectl, helm)
  kubectl get nodes,deviceclasses,resourceslices,resourceclaims -A
Stop it:
  e2e/cluster.sh down
TXT
