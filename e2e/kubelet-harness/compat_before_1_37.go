//go:build k8s_before_1_37

// The kubelet APIs of Kubernetes 1.34 to 1.36 where 1.37 changed them (see compat_since_1_37.go).

package main

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
)

func (r reportingHandler) RegisterPlugin(name, endpoint string, versions []string, timeout *time.Duration) error {
	return r.registered(name, endpoint, r.PluginHandler.RegisterPlugin(name, endpoint, versions, timeout))
}

func (r reportingHandler) DeRegisterPlugin(name, endpoint string) {
	r.PluginHandler.DeRegisterPlugin(name, endpoint)
	r.deregistered(name, endpoint)
}

// stopManager: before 1.37 the DRA manager has no Stop; its goroutines end with the Start context.
func stopManager(*dra.Manager) {}

func updateAllocatedResourcesStatus(_ context.Context, m *dra.Manager, pod *v1.Pod, status *v1.PodStatus) {
	m.UpdateAllocatedResourcesStatus(pod, status)
}
