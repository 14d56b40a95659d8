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
app.kubernetes.io/component: {{ if include "extproc.sidecar" . }}gateway{{ else }}endpoint-picker{{ end }}
{{- end -}}

{{/* "true" in the sidecar layout (Envoy and the router in one pod), "" in the picker layout. */}}
{{- define "extproc.sidecar" -}}
{{- if eq .Values.layout "sidecar" -}}true{{- end -}}
{{- end -}}

{{/* "true" when the ext_proc port serves TLS: the picker layout's gateway dials it over the
network; in the sidecar layout Envoy dials it on loopback, in plaintext. */}}
{{- define "extproc.tls" -}}
{{- if and .Values.tls.enabled (not (include "extproc.sidecar" .)) -}}true{{- end -}}
{{- end -}}

{{- define "extproc.modelService" -}}
{{- required "sidecar.modelServers.service: the model servers' Service, whose EndpointSlices the router follows (layout sidecar)" .Values.sidecar.modelServers.service -}}
{{- end -}}

{{- define "extproc.modelNamespace" -}}
{{- default .Release.Namespace .Values.sidecar.modelServers.namespace -}}
{{- end -}}

{{/* The namespace the router reads the model servers from: the pool's, or the Service's. */}}
{{- define "extproc.watchNamespace" -}}
{{- if include "extproc.sidecar" . -}}
{{- include "extproc.modelNamespace" . -}}
{{- else -}}
{{- include "extproc.poolNamespace" . -}}
{{- end -}}
{{- end -}}

{{/* The sidecar layout's Envoy bootstrap: files/envoy-sidecar.yaml (rendered by `extproc
envoy-config --scenario kubernetes`, scripts/chart_envoy.py) with its placeholders replaced. */}}
{{- define "extproc.envoyConfig" -}}
{{- .Files.Get "files/envoy-sidecar.yaml"
  | replace "sidecar-model-service" (include "extproc.modelService" .)
  | replace "sidecar-model-namespace" (include "extproc.modelNamespace" .)
  | replace "65001" (toString .Values.sidecar.modelServers.port)
  | replace "65002" (toString .Values.ports.grpc)
  | replace "65003" (toString .Values.sidecar.envoy.port) -}}
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
{{- if include "extproc.tls" . -}}
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
{{- if include "extproc.sidecar" . -}}
{{- $_ := set $cfg "discovery" (dict "type" "kubernetes" "service" (include "extproc.modelService" .) "namespace" (include "extproc.modelNamespace" .) "port" .Values.sidecar.modelServers.port) -}}
{{- $_ := set $cfg "grpc" (dict "health_listen" (printf "0.0.0.0:%v" .Values.ports.health) "secure_serving" false) -}}
{{- end -}}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.router.config)) -}}
{{- end -}}
