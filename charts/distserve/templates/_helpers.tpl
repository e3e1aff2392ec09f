{{/* The chart's name. */}}
{{- define "distserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A release-scoped name for the operator's objects. */}}
{{- define "distserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s-operator" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object of the chart. */}}
{{- define "distserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "distserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Labels that select the operator's pod. */}}
{{- define "distserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "distserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "distserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "distserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
RBAC rules on namespaced objects: what the operator code and kopf call, verb by verb
(tests/k8s/test_k8s_rbac.py records every call against the API emulator and checks
these rules grant each one and nothing more).
*/}}
{{- define "distserve.namespacedRules" -}}
# The custom resources: kopf watches them and patches its annotations and finalizer;
# the operator reads one before writing its status.
- apiGroups: ["distserve.io"]
  resources: ["distservedeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["distserve.io"]
  resources: ["distservedeployments/status"]
  verbs: ["patch"]
# Owned objects carry ownerReferences with blockOwnerDeletion: the API server asks for
# this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["distserve.io"]
  resources: ["distservedeployments/finalizers"]
  verbs: ["update"]
# What a plan becomes: worker pods, instance and router Services, configs, the router.
# Created or patched by name, listed by label, deleted when drained; pods are labelled
# draining.
- apiGroups: [""]
  resources: ["pods", "services", "configmaps"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- if .Values.rbac.gangScheduling }}
# Gang scheduling (spec.engine.gangScheduling): scheduler-plugins' PodGroups.
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
{{- if .Values.networkPolicy.enabled }}
# Who may reach a deployment's pods (networkPolicy.enabled, spec.networkPolicy): one
# NetworkPolicy for its instances and one for its router, created or patched by name,
# listed by label (the monitor re-creates a missing one), deleted with the deployment.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "create", "patch", "delete"]
{{- end }}
# Events that say what happened and why (kopf posts them).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/* RBAC rules on cluster-scoped objects. */}}
{{- define "distserve.clusterRules" -}}
{{- if .Values.rbac.readNodes }}
# The cluster shape (nodes, GPUs per node, GPU type): listed, never changed.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list"]
{{- if .Values.watchNamespaces }}
# The GPUs other pods hold on each node (a reshuffle plans against the free ones): listed.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
{{- end }}
{{- end }}
{{- if not .Values.watchNamespaces }}
# kopf notices the CRD being installed or removed while it runs (all namespaces only).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}
{{- end -}}
