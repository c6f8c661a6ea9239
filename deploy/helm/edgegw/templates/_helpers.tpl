{{/* Names and labels */}}
{{- define "edgegw.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "edgegw.fullname" -}}
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

{{- define "edgegw.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "edgegw.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "edgegw.selectorLabels" -}}
app.kubernetes.io/name: {{ include "edgegw.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "edgegw.redisName" -}}
{{- printf "%s-redis" (include "edgegw.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "edgegw.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "edgegw.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "edgegw.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "edgegw.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "edgegw.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if and .Values.gpu.enabled .Values.gpu.imageTag }}{{ $tag = .Values.gpu.imageTag }}{{ end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The CPU limit in whole CPUs, rounded down, at least 1 ("2", 2, "1500m", "0.5" -> 2, 2, 1, 1). */}}
{{- define "edgegw.cpuLimit" -}}
{{- $cpu := toString (dig "limits" "cpu" "" (.Values.resources | default dict)) }}
{{- if eq $cpu "" }}1
{{- else if hasSuffix "m" $cpu }}{{ max 1 (div (atoi (trimSuffix "m" $cpu)) 1000) }}
{{- else }}{{ max 1 (int (floor (float64 $cpu))) }}
{{- end }}
{{- end }}

{{- define "edgegw.workers" -}}
{{- if eq (toString .Values.gateway.workers) "auto" }}{{ include "edgegw.cpuLimit" . }}
{{- else }}{{ int .Values.gateway.workers }}
{{- end }}
{{- end }}

{{- define "edgegw.redisURL" -}}
{{- if .Values.redis.url }}{{ .Values.redis.url }}
{{- else if .Values.redis.enabled }}{{ printf "redis://%s:6379/0" (include "edgegw.redisName" .) }}
{{- end }}
{{- end }}

{{/* The environment variable holding a tenant's keys: EDGEGW_KEYS_<NAME> (upper case, [A-Z0-9_]). */}}
{{- define "edgegw.keysEnv" -}}
{{- printf "EDGEGW_KEYS_%s" (regexReplaceAll "[^A-Z0-9]" (upper .) "_") }}
{{- end }}

{{- define "edgegw.drainGrace" -}}
{{- $computed := add (int .Values.drain.preStopSeconds) (int (ceil (float64 .Values.drain.timeoutSeconds))) 5 }}
{{- if kindIs "invalid" .Values.drain.terminationGracePeriodSeconds }}{{ $computed }}
{{- else if lt (int .Values.drain.terminationGracePeriodSeconds) (int $computed) }}
{{- fail (printf "drain.terminationGracePeriodSeconds (%v) must be at least drain.preStopSeconds + drain.timeoutSeconds + 5 = %v" .Values.drain.terminationGracePeriodSeconds $computed) }}
{{- else }}{{ int .Values.drain.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* The gateway's configuration file: the chart's defaults, .Values.config over them, then
     what the chart owns (the pod's port, workers, drain, tenants' keys_env, Redis URLs). */}}
{{- define "edgegw.config" -}}
{{- $defaults := dict "edge" (dict "enabled" .Values.edge.enabled) }}
{{- $redis := include "edgegw.redisURL" . }}
{{- if $redis }}
{{- $_ := set $defaults "cache" (dict "backend" "tiered") }}
{{- $_ := set $defaults "rate_limits" (dict "backend" "redis") }}
{{- end }}
{{- $config := mustMergeOverwrite (dict) $defaults (deepCopy (.Values.config | default dict)) }}
{{- $listen := mustMergeOverwrite (dict) (get $config "listen" | default dict) (dict "host" "0.0.0.0" "port" (int .Values.gateway.port) "workers" (int (include "edgegw.workers" .))) }}
{{- if .Values.admin.port }}
{{- $_ := set $listen "admin" (dict "port" (int .Values.admin.port)) }}
{{- end }}
{{- $_ := set $config "listen" $listen }}
{{- if or .Values.admin.keys .Values.admin.existingSecret }}
{{- $_ := set $config "admin" (mustMergeOverwrite (dict) (get $config "admin" | default dict) (dict "keys_file" "/etc/edgegw-admin/keys")) }}
{{- end }}
{{- $limits := mustMergeOverwrite (dict) (get $config "limits" | default dict) (dict "drain_timeout_s" .Values.drain.timeoutSeconds) }}
{{- $_ := set $config "limits" $limits }}
{{- $edge := mustMergeOverwrite (dict) (get $config "edge" | default dict) (dict "enabled" .Values.edge.enabled) }}
{{- if .Values.edge.enabled }}
{{- if hasKey $edge "num_threads" }}
{{- else if eq (toString .Values.edge.numThreads) "auto" }}
{{- $_ := set $edge "num_threads" (int (include "edgegw.cpuLimit" .)) }}
{{- else if not (kindIs "invalid" .Values.edge.numThreads) }}
{{- $_ := set $edge "num_threads" (int .Values.edge.numThreads) }}
{{- end }}
{{- if .Values.edge.cpus }}
{{- $_ := set $edge "cpus" (toString .Values.edge.cpus) }}
{{- $_ := set $edge "process" true }}
{{- end }}
{{- if .Values.gpu.enabled }}
{{- $_ := set $edge "device" (get $edge "device" | default "cuda") }}
{{- end }}
{{- end }}
{{- $_ := set $config "edge" $edge }}
{{- if $redis }}
{{- range $section := list "cache" "rate_limits" "slo" }}
{{- $_ := set $config $section (mustMergeOverwrite (dict) (get $config $section | default dict) (dict "redis_url" $redis)) }}
{{- end }}
{{- end }}
{{- $tenants := list }}
{{- range .Values.tenants }}
{{- $tenant := omit . "keys" "existingSecret" }}
{{- if $.Values.tenantKeysAsFiles }}
{{- $_ := set $tenant "keys_file" (printf "/etc/edgegw-keys/%s" (include "edgegw.keysEnv" .name)) }}
{{- else }}
{{- $_ := set $tenant "keys_env" (include "edgegw.keysEnv" .name) }}
{{- end }}
{{- $tenants = append $tenants $tenant }}
{{- end }}
{{- if $tenants }}
{{- $_ := set $config "tenants" $tenants }}
{{- end }}
{{- toYaml $config }}
{{- end }}
