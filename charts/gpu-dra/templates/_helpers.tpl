{{/* The chart name, for the app.kubernetes.io/name label. */}}
{{- define "gpu-dra.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name. Kept to 44 characters so that "<fullname>-controller-metrics" (19 more, the
longest suffix) and the other names stay within 63, as a Service's name must.
*/}}
{{- define "gpu-dra.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 44 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 44 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 44 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "gpu-dra.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "gpu-dra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpu-dra
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component's objects: (dict "ctx" $ "component" "controller"). */}}
{{- define "gpu-dra.componentLabels" -}}
{{ include "gpu-dra.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The immutable selector of one component's pods: (dict "ctx" $ "component" "controller"). */}}
{{- define "gpu-dra.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-dra.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "gpu-dra.controller.fullname" -}}
{{ include "gpu-dra.fullname" . }}-controller
{{- end }}

{{- define "gpu-dra.nodeAgent.fullname" -}}
{{ include "gpu-dra.fullname" . }}-node-agent
{{- end }}

{{- define "gpu-dra.controller.serviceAccountName" -}}
{{ default (include "gpu-dra.controller.fullname" .) .Values.controller.serviceAccount.name }}
{{- end }}

{{- define "gpu-dra.nodeAgent.serviceAccountName" -}}
{{ default (include "gpu-dra.nodeAgent.fullname" .) .Values.nodeAgent.serviceAccount.name }}
{{- end }}

{{- define "gpu-dra.controller.leaseName" -}}
{{ default (include "gpu-dra.controller.fullname" .) .Values.controller.leaderElection.leaseName }}
{{- end }}

{{- define "gpu-dra.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The CEL expression selecting this driver's whole GPUs. */}}
{{- define "gpu-dra.gpuSelector" -}}
device.driver == '{{ .Values.driverName }}' && device.attributes['{{ .Values.driverName }}'].type == 'gpu'
{{- end }}

{{- /* A DeviceClass's `config` from a class's `sharing` values: a GpuConfig of this driver, which every claim of
the class gets (a claim's own config for the same request wins). Call with (dict "root" $ "sharing" <values>). */}}
{{- define "gpu-dra.classConfig" -}}
{{- with .sharing -}}
config:
  - opaque:
      driver: {{ $.root.Values.driverName | quote }}
      parameters:
        apiVersion: {{ printf "%s/v1alpha1" $.root.Values.driverName | quote }}
        kind: GpuConfig
        sharing:
          {{- toYaml . | nindent 10 }}
{{- end }}
{{- end }}

{{- define "gpu-dra.migSelector" -}}
device.driver == '{{ .Values.driverName }}' && device.attributes['{{ .Values.driverName }}'].type == 'mig'
{{- end }}

{{/* The MIG class: deviceClasses.mig.name, else the driver name with "mig." for its first label's "gpu."
     (gpu.gpu-dra.dev -> mig.gpu-dra.dev, like NVIDIA's gpu.nvidia.com and mig.nvidia.com), else "mig." before it. */}}
{{- define "gpu-dra.migClassName" -}}
{{- $driver := .Values.driverName }}
{{- default (printf "mig.%s" (trimPrefix "gpu." $driver)) .Values.deviceClasses.mig.name }}
{{- end }}

{{/* An address for host:port: IPv6 addresses in brackets. */}}
{{- define "gpu-dra.hostPort" -}}
{{- if contains ":" . }}[{{ . }}]{{ else }}{{ . }}{{ end }}
{{- end }}

{{- /* The node agent's view of nodeAgent.driverRoot: the host's / at /driver-root, any other root through its
parent directory at /driver-root-parent (see the DaemonSet's driver-root mount). */}}
{{- define "gpu-dra.driverRootIsHostRoot" -}}
{{- if eq (clean .Values.nodeAgent.driverRoot) "/" }}true{{ end }}
{{- end }}

{{- define "gpu-dra.driverRootMount" -}}
{{- if include "gpu-dra.driverRootIsHostRoot" . }}/driver-root{{ else }}/driver-root-parent{{ end }}
{{- end }}

{{- define "gpu-dra.driverRootMountSource" -}}
{{- if include "gpu-dra.driverRootIsHostRoot" . }}/{{ else }}{{ dir (clean .Values.nodeAgent.driverRoot) }}{{ end }}
{{- end }}

{{- define "gpu-dra.driverRootInContainer" -}}
{{- if include "gpu-dra.driverRootIsHostRoot" . }}/driver-root{{ else }}/driver-root-parent/{{ base (clean .Values.nodeAgent.driverRoot) }}{{ end }}
{{- end }}
