{{/* The chart's name, and the release's full name (both at most 63 characters). */}}
{{- define "trainguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainguard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "trainguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "trainguard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "trainguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The controller's labels: the chart's and its component. */}}
{{- define "trainguard.controllerSelectorLabels" -}}
{{ include "trainguard.selectorLabels" . }}
app.kubernetes.io/component: controller
{{- end }}

{{/* Labels of a Prometheus Operator object: the chart's, monitoringLabels and the object's own (the argument's second item). */}}
{{- define "trainguard.monitoringLabels" -}}
{{- $root := index . 0 -}}
{{ include "trainguard.labels" $root }}
{{- with merge (dict) (index . 1) $root.Values.monitoringLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "trainguard.tokensSecretName" -}}
{{- default (printf "%s-tokens" (include "trainguard.fullname" .)) .Values.tokens.existingSecret }}
{{- end }}

{{- define "trainguard.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The controller Service's address inside the cluster. */}}
{{- define "trainguard.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "trainguard.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/*
A token of the Secret, base64-encoded: the value given in values.yaml, else the one the Secret
already holds (upgrades keep it), else 40 random letters and digits. Refuses a given value the
controller would refuse (fewer than 8 characters, or ':' ',' or whitespace in it).
Argument: (list KEY GIVEN EXISTING-DATA).
*/}}
{{- define "trainguard.token" -}}
{{- $key := index . 0 }}{{- $given := index . 1 }}{{- $existing := index . 2 }}
{{- if $given }}
{{- if not (regexMatch "^[^:,\\s]{8,}$" $given) }}
{{- fail (printf "tokens: the %s must be at least 8 characters without ':', ',' or whitespace" $key) }}
{{- end }}
{{- $given | b64enc }}
{{- else if hasKey $existing $key }}
{{- index $existing $key }}
{{- else }}
{{- randAlphaNum 40 | b64enc }}
{{- end }}
{{- end }}
