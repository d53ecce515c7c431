//go:build !k8s_before_1_37

// `gpu-dra-kubelet-harness read-device-metadata FILE`: upstream's own reader of KEP-5304 device metadata files
// (k8s.io/dynamic-resource-allocation/devicemetadata, as a workload would read them), so tests check what the agent
// writes against it rather than against our idea of the format. Older versions build without it
// (devicemetadata_before_1_37.go).

package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/runtime/schema"
	metadatav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

// readDeviceMetadata decodes the file's stream as a v1beta1 reader does, with upstream's validation, and prints
// {"apiVersion": the version decoded, "object": the v1beta1 object}; a decode or validation error fails.
func readDeviceMetadata(args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("usage: read-device-metadata FILE")
	}
	file, err := os.Open(args[0])
	if err != nil {
		return err
	}
	defer file.Close()
	var object metadatav1beta1.DeviceMetadata
	var invalid error
	var decoded schema.GroupVersionKind
	err = devicemetadata.DecodeMetadataFromStream(json.NewDecoder(file), &object,
		devicemetadata.DecodeMetadataWithValidationResult(&invalid), devicemetadata.DecodeMetadataStoreGVKResult(&decoded))
	if err != nil {
		return fmt.Errorf("decode %s: %w", args[0], err)
	}
	if invalid != nil {
		return fmt.Errorf("validate %s: %w", args[0], invalid)
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{"apiVersion": decoded.GroupVersion().String(), "object": object})
}
