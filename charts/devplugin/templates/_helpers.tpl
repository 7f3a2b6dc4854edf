{{- define "devplugin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "devplugin.fullname" -}}
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

{{- define "devplugin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "devplugin.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "devplugin.labels" -}}
{{ include "devplugin.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "devplugin.extenderSelectorLabels" -}}
app.kubernetes.io/name: {{ include "devplugin.name" . }}-extender
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "devplugin.extenderURL" -}}
{{- printf "%s://%s-extender.%s.svc:%d/scheduler" (ternary "https" "http" (ne .Values.extender.tlsSecretName "")) (include "devplugin.fullname" .) .Release.Namespace (int .Values.extender.port) -}}
{{- end -}}

{{- define "devplugin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ default (include "devplugin.fullname" .) .Values.serviceAccount.name }}
{{- else -}}
{{ default "default" .Values.serviceAccount.name }}
{{- end -}}
{{- end -}}

{{/* The daemon's config file: values.config plus what the chart manages. */}}
{{- define "devplugin.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $lifecycle := get $config "lifecycle" | default dict -}}
{{- $_ := set $lifecycle "checkpoint_file" "/var/lib/devplugin/checkpoint.json" -}}
{{- $_ = set $config "lifecycle" $lifecycle -}}
{{- $_ = set $config "version" "v1" -}}
{{- $_ = set $config "paths" (dict
      "sysfs_root" "/host/sys"
      "dev_root" "/host/dev"
      "device_plugin_dir" "/var/lib/kubelet/device-plugins"
      "pod_resources_socket" "/var/lib/kubelet/pod-resources/kubelet.sock"
      "kubelet_plugins_dir" .Values.hostPaths.kubeletPlugins
      "kubelet_registry_dir" .Values.hostPaths.kubeletRegistry) -}}
{{- $_ = set $config "metrics" (dict "enabled" .Values.metrics.enabled) -}}
{{- if .Values.hostPaths.kubeletConfig -}}
{{- $kubelet := get $config "kubelet" | default dict -}}
{{- $_ = set $kubelet "config_file" "/host/kubelet/config" -}}
{{- $_ = set $config "kubelet" $kubelet -}}
{{- end -}}
{{- $cdi := get $config "cdi" | default dict -}}
{{- $_ = set $cdi "spec_dirs" (list .Values.hostPaths.cdiStatic .Values.hostPaths.cdiDynamic) -}}
{{- $_ = set $config "cdi" $cdi -}}
{{- /* A device that is unhealthy or awaiting cleanup: tainted where the
     scheduler honours device taints (DRADeviceTaints, on by default from
     1.36), else left out of the slices; config.dra.unhealthy overrides. */ -}}
{{- if eq (include "devplugin.draOn" .) "true" -}}
{{- $dra := get $config "dra" | default dict -}}
{{- if not (hasKey $dra "unhealthy") -}}
{{- $taints := semverCompare ">=1.36-0" .Capabilities.KubeVersion.Version -}}
{{- $_ = set $dra "unhealthy" (ternary "taint" "remove" $taints) -}}
{{- $_ = set $config "dra" $dra -}}
{{- end -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* "true" when a resource is served through DRA. */}}
{{- define "devplugin.draOn" -}}
{{- $on := false -}}
{{- $resources := .Values.config.resources | default dict -}}
{{- range $name := list "gpu" "hca" -}}
{{- $resource := get $resources $name | default dict -}}
{{- if and (ne (toString $resource.enabled) "false") (eq (toString $resource.api) "dra") -}}
{{- $on = true -}}
{{- end -}}
{{- end -}}
{{- $on -}}
{{- end -}}

{{/* The DRA driver's name. */}}
{{- define "devplugin.draDriver" -}}
{{- $dra := .Values.config.dra | default dict -}}
{{- $dra.driver | default "devplugin.io" -}}
{{- end -}}

{{/* "true" when a resource hands its devices out by CDI name (DRA always does). */}}
{{- define "devplugin.cdiOn" -}}
{{- $on := eq (include "devplugin.draOn" .) "true" -}}
{{- $resources := .Values.config.resources | default dict -}}
{{- range $name := list "gpu" "hca" -}}
{{- $resource := get $resources $name | default dict -}}
{{- $strategy := $resource.device_list_strategy | default list -}}
{{- if or (has "cdi-cri" $strategy) (has "cdi-annotations" $strategy) -}}
{{- $on = true -}}
{{- end -}}
{{- end -}}
{{- $on -}}
{{- end -}}

{{/* The second scheduler's KubeSchedulerConfiguration: one profile, the extender. */}}
{{- define "devplugin.schedulerConfig" -}}
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: false
profiles:
  - schedulerName: {{ .Values.extender.scheduler.schedulerName }}
    {{- if and (eq (include "devplugin.draOn" .) "true") (semverCompare ">=1.35-0" .Capabilities.KubeVersion.Version) }}
    {{- /* From 1.35 DynamicResources scores a node by the firstAvailable
         rungs its claims would take there (8 minus each rung's index); at
         the default weight 1 the other default score plugins (weights 3,
         2, 2, 2, 1, 1, 1, 1: 13 in all, each scoring up to 100) outvote
         it. 1301 lets one point of its normalized score outweigh them. */}}
    plugins:
      score:
        enabled:
          - name: DynamicResources
            weight: 1301
    {{- end }}
extenders:
  {{- /* preemptVerb: when the pod must preempt, the scheduler's count-only
       victims are replaced by those that free an aligned set. */}}
  - urlPrefix: {{ include "devplugin.extenderURL" . }}
    filterVerb: filter
    prioritizeVerb: prioritize
    preemptVerb: preempt
    weight: {{ .Values.extender.scheduler.weight }}
    nodeCacheCapable: true
    enableHTTPS: {{ ne .Values.extender.tlsSecretName "" }}
    {{- if .Values.extender.tlsSecretName }}
    tlsConfig:
      caData: {{ required "extender.caBundle: the CA (base64 PEM) that signed the extender's certificate" .Values.extender.caBundle }}
    {{- end }}
    ignorable: true
    managedResources:
      - name: {{ .Values.config.resources.gpu.name }}
        ignoredByScheduler: false
      - name: {{ .Values.config.resources.hca.name }}
        ignoredByScheduler: false
  {{- if eq (include "devplugin.draOn" .) "true" }}
  {{- /* Pods that ask through ResourceClaims request neither resource, and
       the scheduler calls an extender with managedResources only for pods
       that request one (HTTPExtender.IsInterested, 1.34-1.37). This entry
       has none: it is asked about every pod of the profile and answers at
       once for those without claims. */}}
  - urlPrefix: {{ include "devplugin.extenderURL" . }}/claims
    filterVerb: filter
    prioritizeVerb: prioritize
    weight: {{ .Values.extender.scheduler.weight }}
    nodeCacheCapable: true
    enableHTTPS: {{ ne .Values.extender.tlsSecretName "" }}
    {{- if .Values.extender.tlsSecretName }}
    tlsConfig:
      caData: {{ .Values.extender.caBundle }}
    {{- end }}
    ignorable: true
  {{- end }}
{{- end -}}

{{/* The second scheduler's image: the pinned tag, or the cluster's vX.Y.Z
     (managed clusters report e.g. v1.34.2-eks-1a2b3c or v1.33.1+k3s1, and
     registry.k8s.io publishes only the plain release tags). */}}
{{- define "devplugin.schedulerImage" -}}
{{- $image := .Values.extender.scheduler.image -}}
{{- $tag := $image.tag -}}
{{- if not $tag -}}
{{- $tag = regexFind "^v[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- if not $tag -}}
{{- fail (printf "extender.scheduler.image.tag: cannot read a release from the cluster's version %q; set the tag" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- printf "%s:%s" $image.repository $tag -}}
{{- end -}}

{{/* KUBERNETES_SERVICE_HOST/PORT where kubernetesService.host says (the
     kubelet's otherwise). */}}
{{- define "devplugin.apiServerEnv" -}}
{{- with .Values.kubernetesService.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.kubernetesService.port | quote }}
{{- end }}
{{- end -}}
