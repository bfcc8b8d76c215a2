{{/* Names, labels, images and the operator's RBAC rules, shared by the templates. */}}

{{- define "ravnest.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ravnest.fullname" -}}
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

{{- define "ravnest.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "ravnest.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ravnest
{{- end }}

{{/* The operator pod's labels; workers carry component=worker and managed-by=ravnest-operator. */}}
{{- define "ravnest.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ravnest.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The labels the operator puts on every worker pod (ravnest_operator.resources.job_labels). */}}
{{- define "ravnest.workerSelectorLabels" -}}
app.kubernetes.io/component: worker
app.kubernetes.io/managed-by: ravnest-operator
{{- end }}

{{- define "ravnest.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ravnest.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ravnest.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "ravnest.workerImage" -}}
{{- default (include "ravnest.image" .) .Values.workerImage }}
{{- end }}

{{/* Namespaces where jobs (and so worker pods) live, for the NetworkPolicy. */}}
{{- define "ravnest.jobNamespaces" -}}
{{- $ns := .Values.networkPolicy.namespaces | default .Values.operator.watchNamespaces | default (list .Release.Namespace) }}
{{- toJson $ns }}
{{- end }}

{{/*
What the operator does in the namespaces it serves: exactly its API calls
(operator/ravnest_operator/handling.py) and kopf's, no more. tests/integration/deriving_rbac.py
derives the same set from the code and tests/integration/test_chart.py compares.
*/}}
{{- define "ravnest.namespacedRules" -}}
# handling.py: pods are created per provider, listed by job, deleted on restart/suspend/cleanup,
# and a cluster's root pod is annotated with its drain order (providers removed from the spec);
# kopf watches the jobs' pods (by label) for disruptions.
- apiGroups: [""]
  resources: [pods]
  verbs: [create, delete, list, patch, watch]
# handling.py: the plan ConfigMap is read back each pass; plan and node ConfigMaps are created,
# and the plan ConfigMap is replaced when providers are added to a running job (it grows).
# The ConfigMaps, Service, NetworkPolicy and PodDisruptionBudget are deleted again by the pass
# that made them when the apiserver refuses a later object of that pass (nothing is left half
# made); Secrets are only ever created (they go with their job).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create, delete, get, update]
# handling.py: the headless workers Service.
- apiGroups: [""]
  resources: [services]
  verbs: [create, delete]
# handling.py: the job's token, TLS and identity Secrets: created, never read nor deleted.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# handling.py: with networkPolicy.enabled, a NetworkPolicy per job (gRPC from its own workers).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, delete]
# handling.py: a PodDisruptionBudget per job (a drain evicts its workers one at a time).
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, delete]
# kopf.info/kopf.warn and kopf's handler events: core v1 Events.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# kopf watches the jobs (list, watch) and patches its annotations on them; each pass of
# handling.py reads its job as it is now (get); finished jobs are deleted after
# ttlSecondsAfterFinished.
- apiGroups: [ravnest.io]
  resources: [ravnestjobs]
  verbs: [delete, get, list, patch, watch]
# The handlers' status patches go to the status subresource.
- apiGroups: [ravnest.io]
  resources: [ravnestjobs/status]
  verbs: [patch]
# Objects are created with ownerReferences.blockOwnerDeletion=true: where the
# OwnerReferencesPermissionEnforcement admission plugin is on, that needs update on the owner's
# finalizers.
- apiGroups: [ravnest.io]
  resources: [ravnestjobs/finalizers]
  verbs: [update]
{{- end }}

{{/* Cluster-scoped reads kopf does: CRD discovery, and namespaces when --namespace is given. */}}
{{- define "ravnest.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.operator.watchNamespaces }}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end }}

{{/* Where `helm test` runs its job: the release namespace, unless the operator does not serve it. */}}
{{- define "ravnest.testNamespace" -}}
{{- $watched := .Values.operator.watchNamespaces }}
{{- if and $watched (not (has .Release.Namespace $watched)) }}
{{- first $watched }}
{{- else }}
{{- .Release.Namespace }}
{{- end }}
{{- end }}
