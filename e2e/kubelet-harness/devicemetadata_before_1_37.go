//go:build k8s_before_1_37

// Device metadata has a v1beta1 reader from Kubernetes 1.37 on (devicemetadata_since_1_37.go); tests run against
// older versions check the files without it.

package main

import "fmt"

func readDeviceMetadata([]string) error {
	return fmt.Errorf("read-device-metadata needs the harness of Kubernetes 1.37 or later")
}
