# gpu-dra developer entry points. `make` alone lists them.
.DEFAULT_GOAL := help
CARGO ?= cargo

.PHONY: help demo test test-prerequisites test-matrix soak release dist bench lint fmt k8s-binaries node-binaries cluster-up cluster-down

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

demo: ## Run the demo on a local control plane (builds what is missing; leaves the cluster up)
	e2e/demo.sh

test: ## Run every check and test CI runs (builds what is missing)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-prerequisites
	$(CARGO) test --locked

# Two at a time: the Go builds and cargo's serial stretches (linking, the last crate) overlap on two cores.
test-prerequisites: k8s-binaries node-binaries lint release

test-matrix: ## The pipeline tests on every supported Kubernetes minor (1.34-1.37; builds each version once, cached)
	CARGO=$(CARGO) e2e/test-matrix.sh

DURATION ?= 30m
soak: k8s-binaries ## Churn soak against the local control plane: make soak DURATION=30m (prints a table, fails on violations)
	GPU_DRA_SOAK_DURATION=$(DURATION) $(CARGO) test --locked --test soak -- churn_soak

release: ## Build target/release/gpu-dra exactly as the Dockerfile, the demo and gpu-check do
	$(CARGO) build --release --locked

dist: release k8s-binaries ## Release artifacts in dist/: the binary, the packaged chart, the image archive, SHA256SUMS
	e2e/dist.sh

bench: k8s-binaries ## Benchmark the claim controller against kube-controller-manager (throughput, cost), and the kubelet plugin, directly and through the kubelet's DRA code (prints tables)
	$(CARGO) bench --locked --bench claim_controller
	$(CARGO) bench --locked --bench controller_cost
	$(CARGO) bench --locked --bench kubelet_plugin
	$(CARGO) bench --locked --bench kubelet_prepare

lint: ## cargo fmt --check, clippy with warnings as errors, THIRD-PARTY-NOTICES current, hadolint on the Dockerfile, cargo-deny (offline)
	$(CARGO) fmt --all --check
	$(CARGO) clippy --locked --all-targets -- -D warnings
	e2e/third_party_notices.py --check
	e2e/hadolint.sh
	e2e/cargo-deny.sh

fmt: ## Format the code
	$(CARGO) fmt --all

k8s-binaries: ## Build etcd, Kubernetes and helm from their Go modules into the cache (skips what is cached)
	e2e/build-k8s.sh

node-binaries: ## Build containerd, runc, the CNI plugins and crictl for a real node (skips what is cached)
	e2e/build-node.sh

cluster-up: ## Start the local control plane and print the KUBECONFIG export
	e2e/cluster.sh up

cluster-down: ## Stop the local control plane
	e2e/cluster.sh down
