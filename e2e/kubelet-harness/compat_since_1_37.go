//go:build !k8s_before_1_37

// The kubelet APIs as of Kubernetes 1.37: plugin handlers take a context, the DRA manager has Stop, and
// UpdateAllocatedResourcesStatus a logger. Older versions build with the tag k8s_before_1_37
// (compat_before_1_37.go); e2e/build-kubelet-harness.sh sets the tags from K8S_VERSION.

package main

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
)

func (r reportingHandler) RegisterPlugin(ctx context.Context, name, endpoint string, versions []string, timeout *time.Duration) error {
	return r.registered(name, endpoint, r.PluginHandler.RegisterPlugin(ctx, name, endpoint, versions, timeout))
}

func (r reportingHandler) DeRegisterPlugin(ctx context.Context, name, endpoint string) {
	r.PluginHandler.DeRegisterPlugin(ctx, name, endpoint)
	r.deregistered(name, endpoint)
}

func stopManager(m *dra.Manager) { m.Stop() }

func updateAllocatedResourcesStatus(ctx context.Context, m *dra.Manager, pod *v1.Pod, status *v1.PodStatus) {
	m.UpdateAllocatedResourcesStatus(klog.FromContext(ctx), pod, status)
}
