{{- define "spotguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "spotguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "spotguard.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "spotguard.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "spotguard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "spotguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "spotguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spotguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "spotguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "spotguard.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /*
The operator's image: [registry/]repository:tag (the tag defaults to the appVersion).
*/}}
{{- define "spotguard.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- with .Values.image.registry -}}
{{- printf "%s/%s" . $ref -}}
{{- else -}}
{{- $ref -}}
{{- end -}}
{{- end -}}

{{- /*
The Lease the replicas elect their leader with: its name with two or more
replicas (leader election on), else empty (a single replica runs alone).
*/}}
{{- define "spotguard.leaderLease" -}}
{{- if gt (int .Values.replicaCount) 1 -}}
{{- $le := .Values.leaderElection -}}
{{- if le (float64 $le.leaseDurationSeconds) (float64 $le.renewDeadlineSeconds) -}}
{{- fail "leaderElection.leaseDurationSeconds must be longer than leaderElection.renewDeadlineSeconds" -}}
{{- end -}}
{{- if le (float64 $le.renewDeadlineSeconds) (mulf 1.2 $le.retryPeriodSeconds) -}}
{{- fail "leaderElection.renewDeadlineSeconds must be longer than 1.2 x leaderElection.retryPeriodSeconds" -}}
{{- end -}}
{{- printf "%s-leader" (include "spotguard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
