{{/*
Names, labels and the values every template derives from one place: the instance type, GPUs per
pod, EFA, and the rendezvous endpoint. Templates call these helpers rather than reading the raw
values twice, so a derived number cannot disagree with itself.
*/}}

{{- define "resilient-fsdp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The job name. 48 characters, not 63: the operator names pods and their Services
`<job>-master-0` / `<job>-worker-<N>`, and a pod's hostname must stay a 63-character label.
*/}}
{{- define "resilient-fsdp.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "resilient-fsdp.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "resilient-fsdp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "resilient-fsdp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "resilient-fsdp.labels" -}}
helm.sh/chart: {{ include "resilient-fsdp.chart" . }}
{{ include "resilient-fsdp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: resilient-fsdp
{{- end }}

{{- define "resilient-fsdp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "resilient-fsdp.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "resilient-fsdp.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The instanceTypes entry of .Values.instanceType, as JSON (validations.yaml rejects unknown ones). */}}
{{- define "resilient-fsdp.instance" -}}
{{- get .Values.instanceTypes .Values.instanceType | default dict | toJson }}
{{- end }}

{{/* Ranks per pod: GPUs per pod on GPU instances, cpuRanksPerNode elsewhere. */}}
{{- define "resilient-fsdp.ranksPerNode" -}}
{{- $inst := include "resilient-fsdp.instance" . | fromJson }}
{{- if gt (int (default 0 $inst.gpus)) 0 }}
{{- if kindIs "invalid" .Values.gpusPerNode }}{{ int $inst.gpus }}{{ else }}{{ int .Values.gpusPerNode }}{{ end }}
{{- else }}
{{- int .Values.cpuRanksPerNode }}
{{- end }}
{{- end }}

{{/* "true" when the pods request GPUs. */}}
{{- define "resilient-fsdp.gpu" -}}
{{- $inst := include "resilient-fsdp.instance" . | fromJson }}
{{- if gt (int (default 0 $inst.gpus)) 0 }}true{{ end }}
{{- end }}

{{/* Every pod of the job, training ones and hot spares: what the controller creates, and what
decides whether EFA has inter-node traffic to carry (a spare trains once it takes a lost node's place). */}}
{{- define "resilient-fsdp.pods" -}}
{{- add (int .Values.nodes) (int .Values.spares) }}
{{- end }}

{{/* "true" when EFA is used: explicitly on, or auto on an EFA instance in a job of several pods. */}}
{{- define "resilient-fsdp.efa" -}}
{{- $inst := include "resilient-fsdp.instance" . | fromJson }}
{{- $mode := toString .Values.efa.enabled }}
{{- if eq $mode "true" }}true
{{- else if and (eq $mode "auto") (gt (int (default 0 $inst.efa)) 0) (gt (int (include "resilient-fsdp.pods" .)) 1) }}true
{{- end }}
{{- end }}

{{/* EFA interfaces per pod. */}}
{{- define "resilient-fsdp.efaDevices" -}}
{{- $inst := include "resilient-fsdp.instance" . | fromJson }}
{{- if kindIs "invalid" .Values.efa.devices }}{{ int (default 0 $inst.efa) }}{{ else }}{{ int .Values.efa.devices }}{{ end }}
{{- end }}

{{/* hugepages-2Mi per pod ("" for none). */}}
{{- define "resilient-fsdp.hugepages" -}}
{{- $h := toString .Values.efa.hugepages2Mi }}
{{- if eq $h "auto" }}{{ if include "resilient-fsdp.efa" . }}5120Mi{{ end }}
{{- else if ne $h "0" }}{{ $h }}
{{- end }}
{{- end }}

{{/* "true" when EFA may use GPUDirect RDMA. */}}
{{- define "resilient-fsdp.gpuDirectRdma" -}}
{{- $inst := include "resilient-fsdp.instance" . | fromJson }}
{{- $mode := toString .Values.efa.gpuDirectRdma }}
{{- if include "resilient-fsdp.efa" . }}
{{- if eq $mode "true" }}true{{ else if and (eq $mode "auto") $inst.gpuDirectRdma }}true{{ end }}
{{- end }}
{{- end }}

{{/*
The host whose ft_launcher agent serves the rendezvous store: the first pod of the job.
- PyTorchJob: the Service the operator creates per pod, `<job>-master-0`.
- JobSet and TrainJob: pod 0's stable hostname under the JobSet's headless Service,
  `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>` (jobset v0.12.0
  api/jobset/v1alpha2/jobset_types.go, Network); the subdomain defaults to the JobSet's name, and a
  TrainJob's JobSet takes the TrainJob's name. Trainer's own PET_MASTER_ADDR is the same name
  (kubeflow/trainer v2.3.0 pkg/runtime/framework/plugins/torch/torch.go).
*/}}
{{- define "resilient-fsdp.rdzvHost" -}}
{{- $name := include "resilient-fsdp.fullname" . }}
{{- if eq .Values.workload.kind "PyTorchJob" }}
{{- $name }}-master-0
{{- else }}
{{- printf "%s-%s-0-0.%s" $name (include "resilient-fsdp.replicatedJob" .) $name }}
{{- end }}
{{- end }}

{{/* The JobSet's one replicated Job: `node`, the name Trainer's torch plugin expects. */}}
{{- define "resilient-fsdp.replicatedJob" -}}node{{- end }}

{{/* The trainer container's name: `pytorch` (training operator webhook) or `node` (Trainer). */}}
{{- define "resilient-fsdp.containerName" -}}
{{- if eq .Values.workload.kind "PyTorchJob" }}pytorch{{ else }}node{{ end }}
{{- end }}

{{/*
The pod-template annotations Kueue's topology-aware scheduling reads, as YAML (empty: none).
Kueue reads them per PodSet, from the pod template (kueue v0.19 apis/kueue/v1beta2/topology_types.go).
A PyTorchJob has two PodSets, Master and Worker: one podset-group-name keeps them in one domain.
*/}}
{{- define "resilient-fsdp.podSetAnnotations" -}}
{{- $t := .Values.scheduling.topology }}
{{- if $t.required }}
kueue.x-k8s.io/podset-required-topology: {{ $t.required | quote }}
{{- else if $t.preferred }}
kueue.x-k8s.io/podset-preferred-topology: {{ $t.preferred | quote }}
{{- end }}
{{- if and (or $t.required $t.preferred) (eq .Values.workload.kind "PyTorchJob") }}
kueue.x-k8s.io/podset-group-name: {{ include "resilient-fsdp.fullname" . | quote }}
{{- end }}
{{- end }}

{{/* The longest pod name a JobSet of this job makes: `<jobset>-node-0-<pods-1>-<5 random>`. */}}
{{- define "resilient-fsdp.longestJobSetPodName" -}}
{{- printf "%s-%s-0-%d-abcde" (include "resilient-fsdp.fullname" .) (include "resilient-fsdp.replicatedJob" .) (sub (int (include "resilient-fsdp.pods" .)) 1) }}
{{- end }}

{{/* `--nnodes`: the training pods, or nodes:nodes+spares with hot spares (NVRx 0.6+ trains at the
first number and keeps the rest standby). */}}
{{- define "resilient-fsdp.nnodes" -}}
{{- if gt (int .Values.spares) 0 }}{{ int .Values.nodes }}:{{ include "resilient-fsdp.pods" . }}{{ else }}{{ int .Values.nodes }}{{ end }}
{{- end }}

{{/* The trainer's run directory: the user's, or one per job on the shared volume. */}}
{{- define "resilient-fsdp.runDir" -}}
{{- $trainer := .Values.trainer | default dict }}
{{- default (printf "%s/runs/%s" (.Values.storage.mountPath | trimSuffix "/") (include "resilient-fsdp.fullname" .)) $trainer.run_dir }}
{{- end }}

{{/* The checkpoint directory as the trainer resolves it (checkpoint.dir, else <run_dir>/checkpoints). */}}
{{- define "resilient-fsdp.checkpointDir" -}}
{{- $ckpt := dig "checkpoint" "dir" "" (.Values.trainer | default dict) }}
{{- default (printf "%s/checkpoints" (include "resilient-fsdp.runDir" .)) $ckpt }}
{{- end }}

{{/*
A `resilience` key of the trainer config, as `group.key` (`launcher.max_restarts`). A user's null
removes a key from the chart's defaults (Helm's merge), and null means "no limit" for the
timeouts: a missing key renders as null.
*/}}
{{- define "resilient-fsdp.resilience" -}}
{{- $parts := splitList "." .key }}
{{- $group := dig "resilience" (index $parts 0) dict (.ctx.Values.trainer | default dict) }}
{{- if hasKey $group (index $parts 1) }}{{ get $group (index $parts 1) | toJson }}{{ else }}null{{ end }}
{{- end }}

{{/* The `fault_tolerance:` section ft_launcher reads: the same keys as resilience.ft_config. */}}
{{- define "resilient-fsdp.ftConfig" -}}
{{- $r := dict "ctx" . }}
fault_tolerance:
  initial_rank_heartbeat_timeout: null
  rank_heartbeat_timeout: null
  rank_section_timeouts:
    init: {{ include "resilient-fsdp.resilience" (set $r "key" "hang_detection.init_timeout_s") }}
    step: {{ include "resilient-fsdp.resilience" (set $r "key" "hang_detection.step_timeout_s") }}
    checkpoint: {{ include "resilient-fsdp.resilience" (set $r "key" "hang_detection.checkpoint_timeout_s") }}
    drain: {{ include "resilient-fsdp.resilience" (set $r "key" "hang_detection.checkpoint_timeout_s") }}
  rank_out_of_section_timeout: {{ include "resilient-fsdp.resilience" (set $r "key" "hang_detection.out_of_section_timeout_s") }}
  safety_factor: {{ include "resilient-fsdp.resilience" (set $r "key" "hang_detection.safety_factor") }}
  rank_termination_signal: {{ include "resilient-fsdp.resilience" (set $r "key" "hang_detection.termination_signal") }}
  workload_check_interval: {{ include "resilient-fsdp.resilience" (set $r "key" "hang_detection.workload_check_interval_s") }}
  gpu_memory_poll_interval: {{ include "resilient-fsdp.resilience" (set $r "key" "launcher.gpu_memory_poll_interval_s") }}
  # NVRx watches InfiniBand link counters through NVML; EFA and CPU-only nodes have none.
  enable_nic_monitor: false
{{- end }}

{{/* The trainer config the pods load: the user's `trainer` values, plus the derived run_dir and faults. */}}
{{- define "resilient-fsdp.trainerConfig" -}}
{{- $cfg := deepCopy (.Values.trainer | default dict) }}
{{- $_ := set $cfg "run_dir" (include "resilient-fsdp.runDir" .) }}
{{- /* A timeout the user set to null was removed by Helm's merge: keep it null (no limit), as
ft_config.yaml does, rather than let the trainer's default come back. */}}
{{- $r := get $cfg "resilience" | default dict }}
{{- $hang := get $r "hang_detection" | default dict }}
{{- range $key := list "init_timeout_s" "step_timeout_s" "checkpoint_timeout_s" "out_of_section_timeout_s" }}
{{- if not (hasKey $hang $key) }}{{ $_ := set $hang $key nil }}{{ end }}
{{- end }}
{{- $_ := set $r "hang_detection" $hang }}
{{- $_ := set $cfg "resilience" $r }}
{{- toYaml $cfg }}
{{- end }}

{{/* Seconds a pod gets between SIGTERM and SIGKILL. */}}
{{- define "resilient-fsdp.terminationGrace" -}}
{{- if kindIs "invalid" .Values.pod.terminationGracePeriodSeconds }}
{{- add (int (ceil (include "resilient-fsdp.resilience" (dict "ctx" . "key" "stop.timeout_s") | float64))) 60 }}
{{- else }}
{{- int .Values.pod.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* Formats a number as Python's "{:g}" does for the values used here (15.0 -> 15, 0.5 -> 0.5). */}}
{{- define "resilient-fsdp.g" -}}
{{- $f := float64 . }}
{{- if eq $f (float64 (int64 $f)) }}{{ int64 $f }}{{ else }}{{ $f }}{{ end }}
{{- end }}

{{/* The job's ConfigMap data: the trainer's config and ft_launcher's. */}}
{{- define "resilient-fsdp.configData" -}}
# The trainer's configuration (resilient-fsdp config --describe lists the keys).
config.yaml: |
  {{- include "resilient-fsdp.trainerConfig" . | nindent 2 }}
# ft_launcher's hang detection, read through --ft-cfg-path.
ft_config.yaml: |
  {{- include "resilient-fsdp.ftConfig" . | trim | nindent 2 }}
{{- end }}

{{/* The job's ConfigMap name: the release's name and the hash of the data it holds. */}}
{{- define "resilient-fsdp.configMapName" -}}
{{- printf "%s-config-%s" (include "resilient-fsdp.fullname" .) (include "resilient-fsdp.configData" . | sha256sum | trunc 10) }}
{{- end }}

{{/*
A trainer key (`section.key`) as the pods' trainer reads it: the user's `trainer` value, else the
trainer's own default (_trainer_facts.tpl), as JSON `{"v": value}` (`fromJson` takes objects only).
*/}}
{{- define "resilient-fsdp.trainerValue" -}}
{{- $parts := splitList "." .key }}
{{- $section := get (.ctx.Values.trainer | default dict) (index $parts 0) | default dict }}
{{- $defaults := (include "resilient-fsdp.trainerFacts" . | fromJson).defaults }}
{{- if hasKey $section (index $parts 1) }}{{ dict "v" (get $section (index $parts 1)) | toJson }}
{{- else }}{{ dict "v" (get $defaults .key) | toJson }}{{ end }}
{{- end }}

{{- /* The label the GitOps admission policy compares (gitops.admissionPolicy): a digest of every
value the job was rendered with. Re-rendering the same values gives the same label; any other
value, another one. */ -}}
{{- define "resilient-fsdp.valuesHashLabel" -}}
{{- if .Values.gitops.admissionPolicy.enabled }}
resilient-fsdp.io/values-hash: {{ toJson .Values | sha256sum | trunc 16 | quote }}
{{- end }}
{{- end }}
