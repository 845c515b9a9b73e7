{{/* ---------------------------------------------------------------------------------------------
NATS users: the per-agent scheme of kvbus/security.py, one user per agent (agent-<name>), per
group scheduler (sched-<group>) and for the coordinator, each with exactly the permissions
agent_permissions / scheduler_permissions / coordinator_permissions give (tests/test_helm.py
compares them). Each user's password is the Secret key named as the user.
*/}}

{{/* The agent names `helm test` uses (they get users like any other agent). */}}
{{- define "kvbus.test.sender" -}}selftest-tx{{- end -}}
{{- define "kvbus.test.receiver" -}}selftest-rx{{- end -}}

{{/* The group `helm test` runs in: test.group, else the first group. */}}
{{- define "kvbus.test.group" -}}
{{- .Values.test.group | default (first (include "kvbus.groups" . | fromJson).groups).name -}}
{{- end -}}

{{/* Every agent with a user: nats.auth.agents, then the two test agents when test.enabled.
Returned as JSON: {"agents": [{name, group, broadcastsFrom}]}. */}}
{{- define "kvbus.nats.agents" -}}
{{- $agents := list -}}
{{- range $a := .Values.nats.auth.agents -}}
{{- $agents = append $agents (dict "name" $a.name "group" $a.group "broadcastsFrom" ($a.broadcastsFrom | default list)) -}}
{{- end -}}
{{- if .Values.test.enabled -}}
{{- $group := include "kvbus.test.group" . -}}
{{- range $n := list (include "kvbus.test.sender" .) (include "kvbus.test.receiver" .) -}}
{{- $agents = append $agents (dict "name" $n "group" $group "broadcastsFrom" list) -}}
{{- end -}}
{{- end -}}
{{- toJson (dict "agents" $agents) -}}
{{- end -}}

{{/* kvbus.security.agent_permissions for {name, group, broadcastsFrom}, as JSON: acks and data
only on subjects ending in (data: carrying) the agent's own name, reads only under its own prefix
(broadcastsFrom grants nothing: every receiver of a secure broadcast gets its own stream); the
vLLM connector's subjects and prefix index (kvbus.security.vllm_agent_subjects). */}}
{{- define "kvbus.nats.agentPermissions" -}}
{{- $a := .name -}}
{{- $g := .group -}}
{{- $subscribe := list (printf "kvbus.agent.%s.>" $a) (printf "_INBOX.%s.>" $a) (printf "kvbus.vllm.%s.>" $a) -}}
{{- $publish := list
  (printf "kvbus.sched.%s.request.%s" $g $a) (printf "kvbus.sched.%s.done.%s" $g $a)
  (printf "kvbus.sched.%s.probe.%s" $g $a) (printf "kvbus.sched.%s.reserve.%s" $g $a)
  (printf "kvbus.sched.%s.register.%s" $g $a) (printf "kvbus.sched.%s.leave.%s" $g $a)
  (printf "kvbus.agent.*.inbox.%s" $a) (printf "kvbus.agent.*.ack.%s" $a)
  (printf "kvbus.agent.*.data.%s.*" $a)
  "kvbus.coord.place"
  (printf "kvbus.vllm.%s.lookup" $a) (printf "kvbus.vllm.%s.push" $a) "kvbus.vllm.*.have"
  (printf "kvbus.vllm.*.pull.%s" $a) (printf "kvbus.vllm.*.pulled.%s" $a) (printf "kvbus.vllm.events.%s" $a)
  "$JS.API.STREAM.INFO.KV_kvbus_vllm_prefix" "$JS.API.STREAM.CREATE.KV_kvbus_vllm_prefix"
  "$JS.API.STREAM.MSG.GET.KV_kvbus_vllm_prefix" "$JS.API.DIRECT.GET.KV_kvbus_vllm_prefix.>"
  "$KV.kvbus_vllm_prefix.>" -}}
{{- toJson (dict "publish" (dict "allow" $publish) "subscribe" (dict "allow" $subscribe) "allow_responses" true) -}}
{{- end -}}

{{/* kvbus.security.scheduler_permissions for a group name, as JSON: heartbeats and leaves
only on its own group's coordinator subjects. */}}
{{- define "kvbus.nats.schedulerPermissions" -}}
{{- $publish := list "kvbus.agent.*.ctl" (printf "kvbus.coord.register.%s" .) (printf "kvbus.coord.leave.%s" .)
  "kvbus.coord.lease" "kvbus.coord.reserve" "kvbus.coord.unreserve" "kvbus.coord.groups"
  "$JS.API.>" "$KV.kvbus_agents.>" "$KV.kvbus_coord.>" (printf "$KV.kvbus_sched_reservations.%s.>" .)
  (printf "$KV.kvbus_sched_learned.%s.>" .) (printf "_INBOX.sched-%s.>" .) -}}
{{- $subscribe := list (printf "kvbus.sched.%s.>" .) (printf "_INBOX.sched-%s.>" .) "$KV.kvbus_agents.>"
  (printf "$KV.kvbus_sched_reservations.%s.>" .) (printf "$KV.kvbus_sched_learned.%s.>" .) -}}
{{- toJson (dict "publish" (dict "allow" $publish) "subscribe" (dict "allow" $subscribe) "allow_responses" true) -}}
{{- end -}}

{{/* kvbus.security.coordinator_permissions, as JSON. */}}
{{- define "kvbus.nats.coordinatorPermissions" -}}
{{- $publish := list "$JS.API.>" "$KV.kvbus_coord.>" "_INBOX.coord.>" -}}
{{- $subscribe := list "kvbus.coord.>" "_INBOX.coord.>" "$KV.kvbus_coord.>" -}}
{{- toJson (dict "publish" (dict "allow" $publish) "subscribe" (dict "allow" $subscribe) "allow_responses" true) -}}
{{- end -}}

{{/* Every user, in the order kvbus.security.permissions_config writes them (agents, the
schedulers, the coordinator). Returned as JSON: {"users": [{user, permissions}]}. */}}
{{- define "kvbus.nats.users" -}}
{{- $users := list -}}
{{- range $a := (include "kvbus.nats.agents" . | fromJson).agents -}}
{{- $users = append $users (dict "user" (printf "agent-%s" $a.name) "permissions" (include "kvbus.nats.agentPermissions" $a | fromJson)) -}}
{{- end -}}
{{- range $g := (include "kvbus.groups" . | fromJson).groups -}}
{{- $users = append $users (dict "user" (printf "sched-%s" $g.name) "permissions" (include "kvbus.nats.schedulerPermissions" $g.name | fromJson)) -}}
{{- end -}}
{{- $users = append $users (dict "user" "coordinator" "permissions" (include "kvbus.nats.coordinatorPermissions" . | fromJson)) -}}
{{- toJson (dict "users" $users) -}}
{{- end -}}

{{/* The environment variable of the NATS servers holding a user's password (nats.conf reads
it as $VAR): NATS variables allow only letters, digits and '_', so '_' is written '__' and '-'
'_H', which keeps distinct users apart (agent-a_b -> KVBUS_PW_agent_Ha__b). */}}
{{- define "kvbus.nats.passwordVar" -}}
{{- printf "KVBUS_PW_%s" (. | replace "_" "__" | replace "-" "_H") -}}
{{- end -}}

{{/* The Secret holding the users' passwords (the chart's, nats.auth.existingSecret or, with
an external NATS, nats.external.existingSecret). */}}
{{- define "kvbus.nats.usersSecret" -}}
{{- if .Values.nats.enabled -}}
{{- include "kvbus.nats.authSecretName" . -}}
{{- else -}}
{{- .Values.nats.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* "true" when the users and their passwords live in the auth.conf key of the Secret the chart
generates (nats.conf includes it, so adding a user changes only that Secret and the reloader
sidecar hot-reloads it); empty with nats.auth.existingSecret (or authSecret.enabled false),
where the chart cannot write the passwords and nats.conf reads them from environment variables. */}}
{{- define "kvbus.nats.authFile" -}}
{{- $auth := .Values.nats.auth -}}
{{- if and $auth.enabled (not $auth.existingSecret) .Values.nats.authSecret.enabled -}}true{{- end -}}
{{- end -}}
