{{/*
Names, labels and the pieces every kvbus pod shares.
*/}}

{{/* The chart name (nameOverride wins). */}}
{{- define "kvbus.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release-wide prefix of every resource name (fullnameOverride wins). */}}
{{- define "kvbus.fullname" -}}
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

{{/*
Name of a component's resource: its `name` override, else <fullname>-<component>, at most `max`
characters (default 63) by shortening the release part, so that components never collide.
Usage: include "kvbus.componentName" (list $ "nats" .Values.nats.name 52)
*/}}
{{- define "kvbus.componentName" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $override := index . 2 -}}
{{- $max := 63 -}}
{{- if gt (len .) 3 -}}{{- $max = int (index . 3) -}}{{- end -}}
{{- if $override -}}
{{- $override | trunc $max | trimSuffix "-" -}}
{{- else -}}
{{- $room := int (sub (sub $max (len $component)) 1) -}}
{{- printf "%s-%s" (include "kvbus.fullname" $root | trunc $room | trimSuffix "-") $component -}}
{{- end -}}
{{- end -}}

{{- define "kvbus.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of a component: include "kvbus.selectorLabels" (list $ "coordinator") */}}
{{- define "kvbus.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvbus.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* All labels of a component's resources: include "kvbus.labels" (list $ "coordinator") */}}
{{- define "kvbus.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "kvbus.chart" $root }}
{{ include "kvbus.selectorLabels" . }}
app.kubernetes.io/part-of: kvbus
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The kvbus image reference (tag defaults to the chart's appVersion). */}}
{{- define "kvbus.image" -}}
{{- $img := .Values.image -}}
{{- $ref := printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) -}}
{{- if $img.registry -}}{{- $ref = printf "%s/%s" $img.registry $ref -}}{{- end -}}
{{- if $img.digest -}}{{- $ref = printf "%s@%s" $ref $img.digest -}}{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* An image block of another component: include "kvbus.otherImage" .Values.nats.image */}}
{{- define "kvbus.otherImage" -}}
{{- $ref := printf "%s:%s" .repository .tag -}}
{{- if .registry -}}{{- $ref = printf "%s/%s" .registry $ref -}}{{- end -}}
{{- if .digest -}}{{- $ref = printf "%s@%s" $ref .digest -}}{{- end -}}
{{- $ref -}}
{{- end -}}

{{- define "kvbus.serviceAccountName" -}}
{{- if .Values.serviceAccount.enabled -}}
{{- default (include "kvbus.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------------
Groups: the list of {name, replicas, bandwidth, config, env, resources} to run a scheduler for.
`groups.list` wins; else `groups.count` groups named <namePrefix>0 .. <namePrefix>N-1.
Returned as JSON: {"groups": [...]}.
*/}}
{{- define "kvbus.groups" -}}
{{- $groups := list -}}
{{- if .Values.groups.list -}}
{{- $seen := dict -}}
{{- range $g := .Values.groups.list -}}
{{- if hasKey $seen $g.name -}}
{{- fail (printf "groups.list: the group name %q appears twice; each group needs a unique name" $g.name) -}}
{{- end -}}
{{- $_ := set $seen $g.name true -}}
{{- $groups = append $groups $g -}}
{{- end -}}
{{- else -}}
{{- range $i := until (int .Values.groups.count) -}}
{{- $groups = append $groups (dict "name" (printf "%s%d" $.Values.groups.namePrefix $i)) -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "groups" $groups) -}}
{{- end -}}

{{/* Name of a group's resources: <fullname>-sched-<group> (or <statefulSet.name>-<group>), at
most 52 characters (a StatefulSet's pods carry a controller-revision-hash label of name + 11
characters); the release part is shortened, never the group. */}}
{{- define "kvbus.schedulerName" -}}
{{- $root := index . 0 -}}
{{- $group := index . 1 -}}
{{- $prefix := $root.Values.scheduler.statefulSet.name -}}
{{- if not $prefix -}}
{{- $prefix = printf "%s-sched" (include "kvbus.fullname" $root | trunc (int (sub 45 (len $group))) | trimSuffix "-") -}}
{{- end -}}
{{- printf "%s-%s" ($prefix | trunc (int (sub 51 (len $group))) | trimSuffix "-") $group -}}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------------
NATS: where kvbus connects, and with which credentials.
*/}}
{{/* StatefulSet names stay within 52 characters: their pods carry a controller-revision-hash
label of name + 11 characters, and labels are at most 63. */}}
{{- define "kvbus.nats.fullname" -}}
{{- include "kvbus.componentName" (list . "nats" .Values.nats.name 52) -}}
{{- end -}}

{{- define "kvbus.nats.authSecretName" -}}
{{- if .Values.nats.auth.existingSecret -}}
{{- .Values.nats.auth.existingSecret -}}
{{- else -}}
{{- printf "%s-auth" (include "kvbus.nats.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* host:port of NATS without scheme or credentials. */}}
{{- define "kvbus.nats.hostPort" -}}
{{- if .Values.nats.enabled -}}
{{- printf "%s.%s.svc.%s:%d" (default (include "kvbus.nats.fullname" .) .Values.nats.service.name) .Release.Namespace .Values.clusterDomain (int .Values.nats.port) -}}
{{- else -}}
{{- $u := urlParse .Values.nats.external.url -}}
{{- $u.host -}}
{{- end -}}
{{- end -}}

{{- define "kvbus.nats.scheme" -}}
{{- if .Values.nats.enabled -}}
{{- if .Values.nats.tls.enabled -}}tls{{- else -}}nats{{- end -}}
{{- else -}}
{{- (urlParse .Values.nats.external.url).scheme -}}
{{- end -}}
{{- end -}}

{{/* Whether kvbus pods connect with a user and password from a Secret. */}}
{{- define "kvbus.nats.useAuth" -}}
{{- if .Values.nats.enabled -}}
{{- if .Values.nats.auth.enabled -}}true{{- end -}}
{{- else if .Values.nats.external.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* The NATS URL without credentials (shown to users, put in the client ConfigMap). */}}
{{- define "kvbus.nats.url" -}}
{{- printf "%s://%s" (include "kvbus.nats.scheme" .) (include "kvbus.nats.hostPort" .) -}}
{{- end -}}

{{/*
Environment that gives a kvbus container KVBUS_NATS_URL logged in as its own NATS user (the
per-user scheme of templates/nats/_users.tpl: sched-<group> or coordinator), the password read
from the Secret by Kubernetes ($(VAR) expansion), so that no password is in a manifest or in
argv; KVBUS_NATS_INBOX_PREFIX, the reply inbox that user may subscribe to; and
KVBUS_NATS_CONNECT_WAIT, how long a refused login is retried.
Usage: include "kvbus.nats.env" (list $ "sched-g0" "_INBOX.sched-g0")
*/}}
{{- define "kvbus.nats.env" -}}
{{- $root := index . 0 -}}
{{- $user := index . 1 -}}
{{- $inbox := index . 2 -}}
{{- if include "kvbus.nats.useAuth" $root }}
- name: KVBUS_NATS_USER
  value: {{ $user | quote }}
- name: KVBUS_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvbus.nats.usersSecret" $root }}
      key: {{ $user }}
- name: KVBUS_NATS_URL
  value: {{ printf "%s://$(KVBUS_NATS_USER):$(KVBUS_NATS_PASSWORD)@%s" (include "kvbus.nats.scheme" $root) (include "kvbus.nats.hostPort" $root) | quote }}
- name: KVBUS_NATS_INBOX_PREFIX
  value: {{ $inbox | quote }}
# A new user (a group added by `helm upgrade`) reaches the servers by a config reload that may
# land after this pod starts: a refused login is tried again for this long before giving up.
- name: KVBUS_NATS_CONNECT_WAIT
  value: "120"
{{- else }}
- name: KVBUS_NATS_URL
  value: {{ include "kvbus.nats.url" $root | quote }}
{{- end }}
{{- include "kvbus.nats.caEnv" $root }}
{{- include "kvbus.buckets.env" $root }}
{{- end -}}

{{/* Replicas of kvbus's JetStream KV buckets: nats.jetstream.bucketReplicas, else min(3, nats.replicas)
(the chart's NATS) or nothing (an external NATS: kvbus then follows the cluster it finds). */}}
{{- define "kvbus.buckets.replicas" -}}
{{- $n := int .Values.nats.jetstream.bucketReplicas -}}
{{- if and (not $n) .Values.nats.enabled -}}{{- $n = min 3 (int .Values.nats.replicas) -}}{{- end -}}
{{- if $n -}}{{- $n -}}{{- end -}}
{{- end -}}

{{/* KVBUS_BUCKET_REPLICAS for a kvbus container (the servers advertise no client URLs in the chart,
so kvbus cannot count them itself). */}}
{{- define "kvbus.buckets.env" -}}
{{- with include "kvbus.buckets.replicas" . }}
- name: KVBUS_BUCKET_REPLICAS
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
Environment of a container that runs agents (the test pod), one set per agent, named by `var`:
<VAR> (the agent's name), <VAR>_PASSWORD (from the Secret), <VAR>_URL (logged in as
agent-<name>) and <VAR>_INBOX_PREFIX (_INBOX.<name>, its reply inbox).
Usage: include "kvbus.nats.agentEnv" (list $ "KVBUS_SELFTEST_SENDER" "selftest-tx")
*/}}
{{- define "kvbus.nats.agentEnv" -}}
{{- $root := index . 0 -}}
{{- $var := index . 1 -}}
{{- $agent := index . 2 }}
- name: {{ $var }}
  value: {{ $agent | quote }}
{{- if include "kvbus.nats.useAuth" $root }}
- name: {{ $var }}_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvbus.nats.usersSecret" $root }}
      key: agent-{{ $agent }}
- name: {{ $var }}_URL
  value: {{ printf "%s://agent-%s:$(%s_PASSWORD)@%s" (include "kvbus.nats.scheme" $root) $agent $var (include "kvbus.nats.hostPort" $root) | quote }}
{{- else }}
- name: {{ $var }}_URL
  value: {{ include "kvbus.nats.url" $root | quote }}
{{- end }}
- name: {{ $var }}_INBOX_PREFIX
  value: {{ printf "_INBOX.%s" $agent | quote }}
{{- end -}}

{{- define "kvbus.nats.caEnv" -}}
{{- if include "kvbus.nats.caSecret" . }}
- name: SSL_CERT_FILE
  value: /etc/kvbus/nats-ca/{{ include "kvbus.nats.caKey" . }}
{{- end }}
{{- end -}}

{{/* The Secret holding the CA that kvbus pods trust for NATS TLS (empty: system CAs). */}}
{{- define "kvbus.nats.caSecret" -}}
{{- if .Values.nats.enabled -}}
{{- if .Values.nats.tls.enabled -}}{{- default .Values.nats.tls.secretName .Values.nats.tls.caSecretName -}}{{- end -}}
{{- else -}}
{{- .Values.nats.external.caSecretName -}}
{{- end -}}
{{- end -}}

{{- define "kvbus.nats.caKey" -}}
{{- if .Values.nats.enabled -}}{{- .Values.nats.tls.caKey -}}{{- else -}}{{- .Values.nats.external.caKey -}}{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------------
Redis.
*/}}
{{- define "kvbus.redis.fullname" -}}
{{- include "kvbus.componentName" (list . "redis" .Values.redis.name 52) -}}
{{- end -}}

{{- define "kvbus.redis.secretName" -}}
{{- if .Values.redis.enabled -}}
{{- default (printf "%s-auth" (include "kvbus.redis.fullname" .) | trunc 63 | trimSuffix "-") .Values.redis.auth.existingSecret -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "kvbus.redis.secretKey" -}}
{{- if .Values.redis.enabled -}}{{- .Values.redis.auth.existingSecretKey -}}{{- else -}}{{- .Values.redis.external.existingSecretKey -}}{{- end -}}
{{- end -}}

{{/* The Redis URL without credentials; empty when there is no Redis. */}}
{{- define "kvbus.redis.url" -}}
{{- if and .Values.redis.enabled (eq .Values.redis.mode "cluster") -}}
{{- printf "redis+cluster://%s.%s.svc.%s:%d" (default (include "kvbus.redis.fullname" .) .Values.redis.service.name) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc.%s:%d/0" (default (include "kvbus.redis.fullname" .) .Values.redis.service.name) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{- define "kvbus.redis.useAuth" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.enabled -}}true{{- end -}}
{{- else if .Values.redis.external.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* KVBUS_REDIS_URL for agents (the test pod); the password comes from the Secret. */}}
{{- define "kvbus.redis.env" -}}
{{- $url := include "kvbus.redis.url" . -}}
{{- if $url -}}
{{- if include "kvbus.redis.useAuth" . }}
- name: KVBUS_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvbus.redis.secretName" . }}
      key: {{ include "kvbus.redis.secretKey" . }}
{{- $u := urlParse $url }}
- name: KVBUS_REDIS_URL
  value: {{ printf "%s://:$(KVBUS_REDIS_PASSWORD)@%s%s" $u.scheme $u.host $u.path | quote }}
{{- else }}
- name: KVBUS_REDIS_URL
  value: {{ $url | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------------
Tracing and metrics environment of a kvbus container.
Usage: include "kvbus.telemetry.env" (list $ "kvbus-coordinator" (dict "kvbus.group" "g0"))
*/}}
{{- define "kvbus.otel.endpoint" -}}
{{- if .Values.otel.endpoint -}}
{{- .Values.otel.endpoint -}}
{{- else if .Values.jaeger.enabled -}}
{{- $port := ternary .Values.jaeger.ports.otlpGrpc .Values.jaeger.ports.otlpHttp (eq .Values.otel.protocol "grpc") -}}
{{- printf "http://%s.%s.svc.%s:%d" (default (include "kvbus.componentName" (list . "jaeger" .Values.jaeger.name)) .Values.jaeger.service.name) .Release.Namespace .Values.clusterDomain (int $port) -}}
{{- end -}}
{{- end -}}

{{- define "kvbus.telemetry.env" -}}
{{- $root := index . 0 -}}
{{- $service := index . 1 -}}
{{- $attrs := index . 2 -}}
{{- $endpoint := include "kvbus.otel.endpoint" $root -}}
{{- if and $root.Values.otel.enabled $endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $root.Values.otel.protocol | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ $service | quote }}
{{- with $root.Values.otel.headersSecret.name }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $root.Values.otel.headersSecret.key }}
{{- end }}
- name: KVBUS_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: KVBUS_POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- $pairs := list "k8s.pod.name=$(KVBUS_POD_NAME)" "k8s.namespace.name=$(KVBUS_POD_NAMESPACE)" (printf "service.namespace=%s" $root.Release.Name) -}}
{{- range $k, $v := $attrs -}}{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}{{- end -}}
{{- range $k, $v := $root.Values.otel.resourceAttributes -}}{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $pairs | quote }}
{{- if $root.Values.otel.sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $root.Values.otel.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $root.Values.otel.samplerArg | quote }}
{{- end }}
{{- end }}
{{- if and $root.Values.metrics.enabled (ne $service "kvbus-selftest") }}
- name: KVBUS_METRICS_PORT
  value: {{ $root.Values.metrics.port | quote }}
{{- end }}
{{- end -}}

{{/* KVBUS_<PREFIX>_<FIELD> variables from a config map of field: value. */}}
{{- define "kvbus.configEnv" -}}
{{- $prefix := index . 0 -}}
{{- $config := index . 1 -}}
{{- range $k := keys $config | sortAlpha }}
- name: {{ printf "KVBUS_%s_%s" $prefix $k | upper }}
  value: {{ index $config $k | toString | quote }}
{{- end }}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------------
What every kvbus container (coordinator, scheduler, test) shares: writable emptyDirs for the
only places kvbus writes (/tmp and ~/.cache), the NATS CA, the security context.
*/}}
{{- define "kvbus.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/kvbus/.cache
{{- if include "kvbus.nats.caSecret" . }}
- name: nats-ca
  mountPath: /etc/kvbus/nats-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kvbus.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.writableVolumes.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.writableVolumes.cacheSizeLimit }}
{{- with include "kvbus.nats.caSecret" . }}
- name: nats-ca
  secret:
    secretName: {{ . }}
    items:
      - key: {{ include "kvbus.nats.caKey" $ }}
        path: {{ include "kvbus.nats.caKey" $ }}
{{- end }}
{{- end -}}

{{/* Pod-level fields every kvbus pod shares; `component` picks the component's own overrides.
Usage: include "kvbus.podSpecCommon" (list $ .Values.coordinator "coordinator") */}}
{{- define "kvbus.podSpecCommon" -}}
{{- $root := index . 0 -}}
{{- $c := index . 1 -}}
{{- $component := index . 2 -}}
serviceAccountName: {{ include "kvbus.serviceAccountName" $root }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $root.Values.pod.nodeSelector $c.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $root.Values.pod.tolerations $c.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $root.Values.pod.priorityClassName $c.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- with (default $root.Values.pod.topologySpreadConstraints $c.topologySpreadConstraints) }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Affinity: the component's own, else keep replicas on different nodes when possible. */}}
{{- define "kvbus.affinity" -}}
{{- $root := index . 0 -}}
{{- $c := index . 1 -}}
{{- $selector := index . 2 -}}
{{- if $c.affinity }}
affinity:
  {{- toYaml $c.affinity | nindent 2 }}
{{- else if $root.Values.pod.affinity }}
affinity:
  {{- toYaml $root.Values.pod.affinity | nindent 2 }}
{{- else }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- $selector | nindent 14 }}
{{- end }}
{{- end -}}

{{/* The metrics port of a kvbus container. */}}
{{- define "kvbus.metricsPort" -}}
{{- if .Values.metrics.enabled }}
ports:
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
{{- end }}
{{- end -}}

{{/* -v flags for a verbosity of 0, 1 or 2 (kvbus takes them before the subcommand). */}}
{{- define "kvbus.verbosity" -}}
{{- if gt (int .) 0 -}}
- {{ printf "-%s" (repeat (int .) "v") }}
{{- end -}}
{{- end -}}
