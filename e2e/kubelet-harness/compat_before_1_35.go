//go:build k8s_before_1_35

// The plugin manager's Run of Kubernetes 1.34, without a context (compat_since_1_35.go: later).

package main

import (
	"context"

	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

func runPluginManager(ctx context.Context, plugins pluginmanager.PluginManager, sourcesReady config.SourcesReady) {
	plugins.Run(sourcesReady, ctx.Done())
}
