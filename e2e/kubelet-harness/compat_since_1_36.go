//go:build !k8s_before_1_36

// The DRA manager's node getter takes a context from Kubernetes 1.36 on (compat_before_1_36.go: before).

package main

import (
	"context"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
)

func nodeGetter(_ context.Context, client kubernetes.Interface, nodeName string) dra.GetNodeFunc {
	return func(ctx context.Context) (*v1.Node, error) {
		return client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	}
}
