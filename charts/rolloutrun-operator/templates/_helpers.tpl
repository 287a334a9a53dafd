{{/* The release's full name, at most 63 characters. */}}
{{- define "rolloutrun.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "rolloutrun.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Labels that select the operator pod. */}}
{{- define "rolloutrun.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "rolloutrun.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rolloutrun.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator's rights: exactly what it uses (rolloutrun_operator.kube.PERMISSIONS less
nodes and resourceflavors, cluster-scoped reads in clusterrole.yaml; the chart tests compare the two). A ClusterRole's rules in cluster mode, each watched
namespace's Role's rules in namespaced mode. It holds the lease verbs it grants to member pods
(RBAC forbids granting what one does not hold) and creates, per run, a Role limited to that
run's Lease. Secrets: `get` reads the run's Gym token Secret and checks that the Secrets a run
names exist (RBAC has no metadata-only read); `create` makes the token Secret; no `list` or
`watch` on Secrets (a deleted token Secret comes back at the resync). `list, watch` on the
other static children: a child deleted by hand makes its run's pass due at once. */}}
{{- define "rolloutrun.rules" -}}
- apiGroups: [rolloutrun.dev]
  resources: [rolloutruns]
  verbs: [get, list, watch, patch]
- apiGroups: [rolloutrun.dev]
  resources: [rolloutruns/status]
  verbs: [get, patch]
# children carry blockOwnerDeletion: OwnerReferencesPermissionEnforcement checks this
- apiGroups: [rolloutrun.dev]
  resources: [rolloutruns/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, update]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create]
# get: a spec.serviceAccountName is used only if the account's rolloutrun.dev/allow-runs allows it
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, list, watch, create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, list, watch, create, update, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles]
  verbs: [get, list, watch, create]
# update: the member RoleBinding follows spec.serviceAccountName
- apiGroups: [rbac.authorization.k8s.io]
  resources: [rolebindings]
  verbs: [get, list, watch, create, update]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create]
# Kueue: a run labelled kueue.x-k8s.io/queue-name owns a Workload and writes its status as
# its job controller (docs/operations.md, "Running under Kueue")
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, update, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- if .Values.peering.enabled }}
# Kopf's peering object: a ClusterKopfPeering in cluster mode, a KopfPeering per watched namespace
- apiGroups: [kopf.dev]
  resources: [{{ if .Values.watchNamespaces }}kopfpeerings{{ else }}clusterkopfpeerings{{ end }}]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}

{{/* The Secret holding the bearer token of the operator's /metrics (key `token`). */}}
{{- define "rolloutrun.metricsTokenSecret" -}}
{{- default (printf "%s-metrics-token" (include "rolloutrun.fullname" .)) .Values.metrics.existingTokenSecret -}}
{{- end -}}

{{/* Where the operator and the helm test pod mount that Secret. */}}
{{- define "rolloutrun.metricsTokenDir" -}}
/var/run/secrets/rolloutrun/metrics
{{- end -}}
