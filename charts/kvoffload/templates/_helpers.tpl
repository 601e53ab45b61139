{{- define "kvoffload.name" -}}kvoffload{{- end -}}

{{- define "kvoffload.fullname" -}}
{{- if contains "kvoffload" .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-kvoffload" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "kvoffload.labels" -}}
app.kubernetes.io/name: {{ include "kvoffload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvoffload.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvoffload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvoffload.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "kvoffload.fullname" .) .Values.serviceAccount.name }}
{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{- define "kvoffload.operatorImage" -}}
{{ .Values.operator.image.repository }}:{{ default .Chart.AppVersion .Values.operator.image.tag }}
{{- end -}}

{{/* Render a Prometheus Operator object only when enabled and its CRD exists (or force is set). */}}
{{- define "kvoffload.promOperatorEnabled" -}}
{{- $cfg := index . 0 -}}{{- $ctx := index . 1 -}}
{{- if and $cfg.enabled (or $cfg.force ($ctx.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}true{{- end -}}
{{- end -}}
