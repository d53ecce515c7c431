//go:build k8s_before_1_36

// The DRA manager's node getter of Kubernetes 1.34 and 1.35, without a context (compat_since_1_36.go: later).

package main

import (
	"context"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
)

func nodeGetter(ctx context.Context, client kubernetes.Interface, nodeName string) dra.GetNodeFunc {
	return func() (*v1.Node, error) {
		return client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	}
}
