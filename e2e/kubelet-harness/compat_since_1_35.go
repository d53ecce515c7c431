//go:build !k8s_before_1_35

// The plugin manager's Run takes a context from Kubernetes 1.35 on (compat_before_1_35.go: 1.34).

package main

import (
	"context"

	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

func runPluginManager(ctx context.Context, plugins pluginmanager.PluginManager, sourcesReady config.SourcesReady) {
	plugins.Run(ctx, sourcesReady, ctx.Done())
}
