{{/*
The escape hatches every resource block has (as the official NATS chart does):

  merge: a map deep-merged into the rendered resource (maps merge key by key, a list replaces
         the list it lands on, a value replaces a value);
  patch: a JSON Patch (RFC 6902) list applied after the merge; ops add, remove, replace and
         test; paths like /spec/template/spec/containers/0/args/- (`-` appends to a list).

Both go through `tpl`, so they may use template expressions such as {{ .Release.Name }}.

Usage, from a template that builds its resource in a variable:
  {{ include "kvbus.render" (dict "root" $ "doc" $yaml "block" .Values.nats.service "what" "nats.service") }}
*/}}
{{- define "kvbus.render" -}}
{{- $doc := fromYaml .doc -}}
{{- if hasKey $doc "Error" -}}
{{- fail (printf "internal: %s renders invalid YAML: %s\n%s" .what $doc.Error .doc) -}}
{{- end -}}
{{- if and (hasKey $doc "metadata") (empty (dig "metadata" "annotations" dict $doc)) -}}
{{- $_ := unset $doc.metadata "annotations" -}}
{{- end -}}
{{- $block := .block | default dict -}}
{{- with $block.merge -}}
{{- $merge := tpl (toYaml .) $.root | fromYaml -}}
{{- $doc = mergeOverwrite $doc $merge -}}
{{- end -}}
{{- range $i, $op := $block.patch | default list -}}
{{- $op = tpl (toYaml $op) $.root | fromYaml -}}
{{- $doc = include "kvbus.patch.op" (dict "doc" $doc "op" $op "what" (printf "%s.patch[%d]" $.what $i)) | fromJson | dig "v" dict -}}
{{- end -}}
{{- printf "---\n%s\n" (toYaml $doc) -}}
{{- end -}}

{{/* One JSON Patch operation on a document; returns {"v": the new document} as JSON. */}}
{{- define "kvbus.patch.op" -}}
{{- $op := .op -}}
{{- if not (and (kindIs "map" $op) (hasKey $op "op") (hasKey $op "path")) -}}
{{- fail (printf "%s: each patch operation needs `op` and `path`, got %s" .what (toJson $op)) -}}
{{- end -}}
{{- if not (has $op.op (list "add" "remove" "replace" "test")) -}}
{{- fail (printf "%s: op %q is not supported; use add, remove, replace or test" .what $op.op) -}}
{{- end -}}
{{- if and (ne $op.op "remove") (not (hasKey $op "value")) -}}
{{- fail (printf "%s: op %q needs a `value`" .what $op.op) -}}
{{- end -}}
{{- if not (hasPrefix "/" $op.path) -}}
{{- fail (printf "%s: path %q must start with /" .what $op.path) -}}
{{- end -}}
{{- $segments := list -}}
{{- range $s := rest (splitList "/" $op.path) -}}
{{- $segments = append $segments (replace "~0" "~" (replace "~1" "/" $s)) -}}
{{- end -}}
{{- include "kvbus.patch.at" (dict "node" .doc "segments" $segments "op" $op "what" .what) -}}
{{- end -}}

{{/* Apply $op at $segments below $node, recursively; returns {"v": new node} as JSON. */}}
{{- define "kvbus.patch.at" -}}
{{- $node := .node -}}
{{- $key := first .segments -}}
{{- $op := .op -}}
{{- $what := .what -}}
{{- $last := eq (len .segments) 1 -}}
{{- if kindIs "map" $node -}}
  {{- if $last -}}
    {{- if and (ne $op.op "add") (not (hasKey $node $key)) -}}
      {{- fail (printf "%s: %s %s: key %q does not exist" $what $op.op $op.path $key) -}}
    {{- end -}}
    {{- if eq $op.op "remove" -}}
      {{- $_ := unset $node $key -}}
    {{- else if eq $op.op "test" -}}
      {{- if not (deepEqual (index $node $key) $op.value) -}}
        {{- fail (printf "%s: test %s failed: expected %s, found %s" $what $op.path (toJson $op.value) (toJson (index $node $key))) -}}
      {{- end -}}
    {{- else -}}
      {{- $_ := set $node $key $op.value -}}
    {{- end -}}
  {{- else -}}
    {{- if not (hasKey $node $key) -}}
      {{- fail (printf "%s: %s %s: key %q does not exist" $what $op.op $op.path $key) -}}
    {{- end -}}
    {{- $child := include "kvbus.patch.at" (dict "node" (index $node $key) "segments" (rest .segments) "op" $op "what" $what) | fromJson -}}
    {{- $_ := set $node $key $child.v -}}
  {{- end -}}
{{- else if kindIs "slice" $node -}}
  {{- $n := len $node -}}
  {{- $i := $n -}}
  {{- if ne $key "-" -}}
    {{- if not (regexMatch "^(0|[1-9][0-9]*)$" $key) -}}
      {{- fail (printf "%s: %s: %q is not a list index" $what $op.path $key) -}}
    {{- end -}}
    {{- $i = atoi $key -}}
  {{- else if not (and $last (eq $op.op "add")) -}}
    {{- fail (printf "%s: %s: `-` (end of list) can only be the last segment of an add" $what $op.path) -}}
  {{- end -}}
  {{- $limit := ternary $n (sub $n 1 | int) (eq $op.op "add") -}}
  {{- if or (gt $i $limit) (and (not $last) (ge $i $n)) -}}
    {{- fail (printf "%s: %s: index %d is out of range (the list has %d items)" $what $op.path $i $n) -}}
  {{- end -}}
  {{- if $last -}}
    {{- if eq $op.op "add" -}}
      {{- $node = concat (slice $node 0 $i) (list $op.value) (slice $node $i) -}}
    {{- else if eq $op.op "remove" -}}
      {{- $node = concat (slice $node 0 $i) (slice $node (add $i 1 | int)) -}}
    {{- else if eq $op.op "test" -}}
      {{- if not (deepEqual (index $node $i) $op.value) -}}
        {{- fail (printf "%s: test %s failed: expected %s, found %s" $what $op.path (toJson $op.value) (toJson (index $node $i))) -}}
      {{- end -}}
    {{- else -}}
      {{- $node = concat (slice $node 0 $i) (list $op.value) (slice $node (add $i 1 | int)) -}}
    {{- end -}}
  {{- else -}}
    {{- $child := include "kvbus.patch.at" (dict "node" (index $node $i) "segments" (rest .segments) "op" $op "what" $what) | fromJson -}}
    {{- $node = concat (slice $node 0 $i) (list $child.v) (slice $node (add $i 1 | int)) -}}
  {{- end -}}
{{- else -}}
  {{- fail (printf "%s: %s: cannot go into %q of a %s" $what $op.path $key (kindOf $node)) -}}
{{- end -}}
{{- toJson (dict "v" $node) -}}
{{- end -}}
