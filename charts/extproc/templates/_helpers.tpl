{{/* The chart's name, and the release's full name (both DNS labels). */}}
{{- define "extproc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "extproc.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What selects the picker's pods: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "extproc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{- define "extproc.labels" -}}
{{ include "extproc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: extproc-router
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "extproc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "extproc.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: the ServiceAccount to run as, when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "extproc.poolName" -}}
{{- default (include "extproc.fullname" .) .Values.inferencePool.name -}}
{{- end -}}

{{- define "extproc.poolNamespace" -}}
{{- default .Release.Namespace .Values.inferencePool.namespace -}}
{{- end -}}

{{- define "extproc.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "extproc.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{/* The router's config file: what the chart decides, then router.config over it. */}}
{{- define "extproc.routerConfig" -}}
{{- $grpc := dict "health_listen" (printf "0.0.0.0:%v" .Values.ports.health) -}}
{{- if .Values.tls.enabled -}}
{{- $tls := dict "cert_file" "/etc/extproc/tls/tls.crt" "key_file" "/etc/extproc/tls/tls.key" -}}
{{- if .Values.tls.clientCaSecret -}}
{{- $_ := set $tls "client_ca_file" "/etc/extproc/client-ca/ca.crt" -}}
{{- end -}}
{{- $_ := set $grpc "tls" $tls -}}
{{- end -}}
{{- $cfg := dict
  "listen" (printf "0.0.0.0:%v" .Values.ports.grpc)
  "mode" .Values.router.mode
  "store" .Values.router.store
  "discovery" (dict "type" "inference_pool" "name" (include "extproc.poolName" .) "namespace" (include "extproc.poolNamespace" .))
  "grpc" $grpc
  "metrics" (dict "listen" (printf "0.0.0.0:%v" .Values.ports.metrics))
  "admin" (dict "listen" "127.0.0.1:9191")
-}}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.router.config)) -}}
{{- end -}}
