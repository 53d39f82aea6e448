{{/*
The pod template of every kind and replica: a PyTorchJob's Master and Workers, the JobSet's and
the TrainingRuntime's `node` Job. Written once, called with
(dict "ctx" $ "role" "master"|"worker"|"node"). Each pod is one node of the job: the node wrapper
(resilient_fsdp.resilience.agent) runs ft_launcher, which runs `--nproc-per-node` trainer ranks.
*/}}
{{- define "resilient-fsdp.podTemplate" -}}
{{- $ := .ctx }}
{{- $v := $.Values }}
{{- $inst := include "resilient-fsdp.instance" $ | fromJson }}
{{- $gpu := include "resilient-fsdp.gpu" $ }}
{{- $efa := include "resilient-fsdp.efa" $ }}
{{- $hugepages := include "resilient-fsdp.hugepages" $ }}
{{- $ranks := include "resilient-fsdp.ranksPerNode" $ }}
{{- $r := dict "ctx" $ }}
metadata:
  labels:
    {{- include "resilient-fsdp.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
    {{- with $v.pod.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $annotations := deepCopy $v.pod.annotations }}
  {{- if $v.pod.doNotDisrupt }}
  {{- $_ := set $annotations "karpenter.sh/do-not-disrupt" "true" }}
  {{- end }}
  {{- $annotations = merge $annotations (include "resilient-fsdp.podSetAnnotations" $ | fromYaml) }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if ne $v.workload.kind "PyTorchJob" }}
  # A Job with a podFailurePolicy takes only Never; left empty, the JobSet webhook would make it
  # OnFailure (the kubelet restarts the container in place, out of the exit-code rules' reach).
  restartPolicy: Never
  {{- end }}
  serviceAccountName: {{ include "resilient-fsdp.serviceAccountName" $ }}
  # The agent's token for tainting its node (pod.taintUnhealthyNode), else the chart's setting.
  automountServiceAccountToken: {{ or $v.serviceAccount.automountToken $v.pod.taintUnhealthyNode.enabled }}
  terminationGracePeriodSeconds: {{ include "resilient-fsdp.terminationGrace" $ }}
  {{- with $v.pod.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  {{- $selector := deepCopy $v.pod.nodeSelector }}
  {{- if $v.selectInstanceType }}
  {{- $_ := set $selector "node.kubernetes.io/instance-type" $v.instanceType }}
  {{- end }}
  {{- with $selector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $tolerations := list }}
  {{- $given := list }}
  {{- range $v.pod.tolerations }}
  {{- $tolerations = append $tolerations . }}
  {{- $given = append $given (.key | default "") }}
  {{- end }}
  {{- if not (kindIs "invalid" $v.pod.unreachableTolerationSeconds) }}
  {{- /* A node that stops reporting is tainted unreachable (not-ready when its kubelet says so):
  its pod is evicted after this long instead of Kubernetes' 300 s, so it carries DisruptionTarget
  (its failure not counted) and is replaced as soon as the node is deleted or tainted
  out-of-service. The job has stalled on that node long before. A toleration of the same key in
  pod.tolerations wins. */}}
  {{- range list "node.kubernetes.io/unreachable" "node.kubernetes.io/not-ready" }}
  {{- if not (has . $given) }}
  {{- $tolerations = append $tolerations (dict "key" . "operator" "Exists" "effect" "NoExecute" "tolerationSeconds" (int $v.pod.unreachableTolerationSeconds)) }}
  {{- end }}
  {{- end }}
  {{- end }}
  {{- with $tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "resilient-fsdp.affinity" $ | fromYaml }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.pod.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- include "resilient-fsdp.prepareStorage" $ | nindent 2 }}
  containers:
    # The name each kind needs: `pytorch` for the training operator's webhook and exit-code
    # reading, `node` for Kubeflow Trainer's torch plugin (and the podFailurePolicy's containerName).
    - name: {{ include "resilient-fsdp.containerName" $ }}
      image: {{ include "resilient-fsdp.image" $ }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: [python, -m, resilient_fsdp.resilience.agent]
      args:
        # The node agent's own flag: a node other than the store host joins again in its pod when
        # another node's failure ends its launcher (one event counts once, on the store host's pod).
        - --rejoin-timeout={{ int $v.rendezvous.rejoinTimeoutSeconds }}
        # A store host gone without closing its connections (its node hung or cut off) is given up
        # after this long without accepting a connection, not after TCP's retransmissions (~15 min).
        - --store-timeout={{ int $v.rendezvous.storeTimeoutSeconds }}
        {{- if and (eq $v.workload.kind "PyTorchJob") (gt (int $v.job.backoffLimit) 0) }}
        # The operator recreates pods that exit 128-255 for ever (its backoffLimit of 1 or more
        # counts nothing; 0 it applies itself): the agents count the job's pod failures in the run
        # directory and end the job (exit 2) after more than job.backoffLimit in a row without progress.
        - --max-pod-failures={{ int $v.job.backoffLimit }}
        {{- end }}
        {{- if $v.pod.taintUnhealthyNode.enabled }}
        # A node NVRx finds unhealthy is tainted before the pod exits 201 (its NODE_NAME below).
        - --taint-unhealthy-node={{ $v.pod.taintUnhealthyNode.key }}
        {{- end }}
        {{- if $v.metrics.enabled }}
        # The run's Prometheus metrics, served by the agent (container port `metrics`).
        - --metrics-port={{ int $v.metrics.port }}
        {{- end }}
        {{- if eq (include "resilient-fsdp.resilience" (set $r "key" "launcher.prewarm")) "true" }}
        # New ranks are forked from a server in the pod that has imported the trainer.
        - --prewarm=true
        {{- end }}
        - --
        - --ft-cfg-path=/etc/resilient-fsdp/ft_config.yaml
        - --nnodes={{ include "resilient-fsdp.nnodes" $ }}
        - --nproc-per-node={{ $ranks }}
        # Explicit endpoint: without it ft_launcher falls back to localhost and pods never meet.
        - --rdzv-backend=c10d
        - --rdzv-endpoint={{ include "resilient-fsdp.rdzvHost" $ }}:{{ int $v.rendezvous.port }}
        - --rdzv-id={{ include "resilient-fsdp.fullname" $ }}
        # Pods that start apart (an image pull, pod 0 replaced) still meet: a node waits up to the
        # join timeout for the store to listen (store_connect_wait_seconds; the agent waits for
        # NVRx versions without it). read_timeout, the store client's wait for a key, is what an
        # operation takes, not the join's. The agent adds is_host from the pod's index.
        {{- $join := int $v.rendezvous.joinTimeoutSeconds }}
        - --rdzv-conf=join_timeout={{ $join }},read_timeout={{ int $v.rendezvous.storeTimeoutSeconds }},store_connect_wait_seconds={{ $join }}
        # In-job restart, as resilience.ft_launcher_flags spells it.
        - --max-restarts={{ include "resilient-fsdp.resilience" (set $r "key" "launcher.max_restarts") }}
        - --workers-stop-timeout={{ include "resilient-fsdp.g" (include "resilient-fsdp.resilience" (set $r "key" "launcher.workers_stop_timeout_s")) }}
        - --term-timeout={{ include "resilient-fsdp.g" (include "resilient-fsdp.resilience" (set $r "key" "stop.timeout_s")) }}
        - --monitor-interval={{ include "resilient-fsdp.g" (include "resilient-fsdp.resilience" (set $r "key" "launcher.monitor_interval_s")) }}
        - -m
        - resilient_fsdp.train
        - --config=/etc/resilient-fsdp/config.yaml
        {{- if $v.chaos.enabled }}
        {{- range $v.chaos.inject }}
        - --inject={{ . }}
        {{- end }}
        {{- end }}
      ports:
        # The rendezvous store. The training operator points MASTER_PORT at the port named
        # `pytorchjob-port`; Trainer adds its own 29500, which this port must not take.
        - name: {{ if eq $v.workload.kind "PyTorchJob" }}pytorchjob-port{{ else }}rendezvous{{ end }}
          containerPort: {{ int $v.rendezvous.port }}
          protocol: TCP
        {{- if $v.metrics.enabled }}
        - name: metrics
          containerPort: {{ int $v.metrics.port }}
          protocol: TCP
        {{- end }}
      env:
        - name: PYTHONUNBUFFERED
          value: "1"
        # The root file system is read-only: caches (torch, triton) go to the /tmp volume.
        - name: HOME
          value: /tmp
        {{- if include "resilient-fsdp.prepareStorageOn" $ }}
        # Its init container prepared the shared volume: a directory the trainer still cannot
        # write is one it could not, and the trainer's message points at its log.
        - name: RESILIENT_FSDP_STORAGE_PREPARED
          value: "true"
        {{- end }}
        # The node this pod runs on: named when it stops reporting (and tainted when NVRx finds it
        # unhealthy, with pod.taintUnhealthyNode).
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        {{- if ne $v.workload.kind "PyTorchJob" }}
        # This install of the release: the JobSet's UID (a TrainJob's JobSet too), the same for
        # every pod and every restart, new with every install. The agent adds it to the rendezvous
        # id, so the pods of a new install never join the store of an old one still terminating,
        # and the trainer's lease waits for that old one to release the checkpoint directory.
        - name: RESILIENT_FSDP_INSTALL_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['jobset.sigs.k8s.io/jobset-uid']
        {{- end }}
        {{- if $gpu }}
        - name: NCCL_DEBUG
          value: {{ $v.nccl.debug | quote }}
        - name: NCCL_SOCKET_IFNAME
          value: {{ $v.nccl.socketIfname | quote }}
        - name: PYTORCH_CUDA_ALLOC_CONF
          value: expandable_segments:True
        {{- if $v.nccl.flightRecorder.enabled }}
        - name: TORCH_NCCL_TRACE_BUFFER_SIZE
          value: {{ int $v.nccl.flightRecorder.bufferSize | quote }}
        # The dump path is the trainer's: under the run directory on the shared volume.
        - name: TORCH_NCCL_DUMP_ON_TIMEOUT
          value: "1"
        {{- end }}
        {{- end }}
        {{- if $efa }}
        - name: FI_PROVIDER
          value: efa
        - name: FI_EFA_FORK_SAFE
          value: "1"
        {{- if include "resilient-fsdp.gpuDirectRdma" $ }}
        # Only where the instance has GPUDirect RDMA (not g5/g6): elsewhere libfabric fails to start.
        - name: FI_EFA_USE_DEVICE_RDMA
          value: "1"
        {{- end }}
        {{- /* EFA/NCCL settings AWS's NVRx-on-EKS sample sets (awsome-distributed-ai,
        3.test_cases/pytorch/nvrx/kubernetes); the restart layers' NCCL settings come from the trainer. */}}
        # rdma-core's own fork protection (libibverbs): DataLoader workers and the checkpoint
        # writer fork after EFA has registered memory; without it a child's copy-on-write can move
        # pages the NIC still writes to.
        - name: RDMAV_FORK_SAFE
          value: "1"
        {{- with $v.efa.ncclTunerPlugin }}
        # aws-ofi-nccl's tuner: algorithm and protocol choices measured on AWS instance types,
        # where NCCL's built-in model does not know the EFA topology.
        - name: NCCL_TUNER_PLUGIN
          value: {{ . | quote }}
        {{- end }}
        {{- end }}
        {{- range $name, $ref := $v.pod.secretEnv }}
        - name: {{ $name }}
          valueFrom:
            secretKeyRef:
              name: {{ $ref.secretName }}
              key: {{ $ref.key }}
        {{- end }}
        {{- with $v.pod.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.pod.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $res := dict "cpu" (default $inst.cpu $v.resources.cpu | toString) "memory" (default $inst.memory $v.resources.memory | toString) }}
      {{- if $gpu }}{{ $_ := set $res "nvidia.com/gpu" (int $ranks) }}{{ end }}
      {{- if $efa }}{{ $_ := set $res "vpc.amazonaws.com/efa" (int (include "resilient-fsdp.efaDevices" $)) }}{{ end }}
      {{- with $hugepages }}{{ $_ := set $res "hugepages-2Mi" . }}{{ end }}
      resources:
        requests:
          {{- toYaml $res | nindent 10 }}
        # Limits equal requests: extended resources and hugepages require it, and it gives the
        # pods Guaranteed QoS, the last class the kubelet evicts under memory pressure.
        limits:
          {{- toYaml $res | nindent 10 }}
      securityContext:
        {{- $sc := deepCopy $v.pod.containerSecurityContext }}
        {{- /* No capability for EFA: its memory registration needs the runtime's unlimited memlock
        limit (the release check tests it); IPC_LOCK would grant a non-root user nothing and takes the
        pod out of Pod Security baseline. */}}
        {{- $_ := set $sc "privileged" false }}
        {{- toYaml $sc | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/resilient-fsdp
          readOnly: true
        - name: shared
          mountPath: {{ $v.storage.mountPath }}
        - name: dshm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        {{- with $v.pod.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "resilient-fsdp.configMapName" $ }}
    - name: shared
      {{- if eq $v.storage.type "emptyDir" }}
      emptyDir:
        sizeLimit: {{ $v.storage.emptyDirSizeLimit }}
      {{- else }}
      persistentVolumeClaim:
        claimName: {{ include "resilient-fsdp.claimName" $ }}
      {{- end }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shm.sizeLimit }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ $v.pod.tmpSizeLimit }}
    {{- with $v.pod.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{- define "resilient-fsdp.claimName" -}}
{{- $s := .Values.storage }}
{{- if eq $s.type "existingClaim" }}{{ $s.existingClaim }}
{{- else if $s.fromRelease }}
{{- /* The claim a storage-only release of this chart made: its fullname, as fullname derives it. */ -}}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name $s.fromRelease }}{{ $s.fromRelease | trunc 48 | trimSuffix "-" }}{{ else }}{{ printf "%s-%s" $s.fromRelease $name | trunc 48 | trimSuffix "-" }}{{ end }}-shared
{{- else }}{{ include "resilient-fsdp.fullname" . }}-shared{{ end }}
{{- end }}

{{/*
The pods' affinity: `pod.affinity` verbatim, with the chart's own required node rules (the
unhealthy-node labels, `pod.zone`) added to each of its nodeSelectorTerms (terms are ORed, the
expressions in a term ANDed, so every term must carry them).
*/}}
{{- define "resilient-fsdp.affinity" -}}
{{- $v := .Values }}
{{- $affinity := deepCopy $v.pod.affinity }}
{{- $extra := list }}
{{- if $v.pod.avoidUnhealthyNodes }}
{{- range $key, $values := $v.pod.unhealthyNodeLabels }}
{{- $extra = append $extra (dict "key" $key "operator" "NotIn" "values" $values) }}
{{- end }}
{{- end }}
{{- with $v.pod.zone }}
{{- $extra = append $extra (dict "key" "topology.kubernetes.io/zone" "operator" "In" "values" (list .)) }}
{{- end }}
{{- if $extra }}
{{- $node := deepCopy (default dict $affinity.nodeAffinity) }}
{{- $required := deepCopy (default dict (get $node "requiredDuringSchedulingIgnoredDuringExecution")) }}
{{- $terms := list }}
{{- range (default (list dict) $required.nodeSelectorTerms) }}
{{- $term := deepCopy . }}
{{- $_ := set $term "matchExpressions" (concat (default list $term.matchExpressions) $extra) }}
{{- $terms = append $terms $term }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $node }}
{{- end }}
{{- toYaml $affinity }}
{{- end }}

{{/* Whether the pods prepare the shared volume (storage.prepare; auto: on for a new or static FSx). */}}
{{- define "resilient-fsdp.prepareStorageOn" -}}
{{- $p := .Values.storage.prepare }}
{{- if eq (toString $p) "auto" }}{{ if has .Values.storage.type (list "fsx" "fsxStatic") }}true{{ end }}
{{- else if $p }}true{{ end }}
{{- end }}

{{/*
storage.prepare: an init container that makes the run and checkpoint directories the pod user's
on a volume whose root is root's and where the CSI driver skips fsGroup (FSx on RWX). Only those
two directories change owner, not what is in them; root with CHOWN alone, inside Pod Security
baseline. It always exits 0: what it cannot do (a root-squashed file system, a root another UID
owns) is permanent, and a failed init container is retried for ever (a PyTorchJob reads the
missing `pytorch` exit code as 0xbeef, which it recreates) or spends a JobSet's budget at once.
It says what it could not do, and the trainer's own check of the directories fails the job with
exit 2 and the fix. The `helm test` pod runs it too.
*/}}
{{- define "resilient-fsdp.prepareStorage" -}}
{{- if include "resilient-fsdp.prepareStorageOn" . }}
{{- $v := .Values }}
{{- $sc := $v.pod.securityContext | default dict }}
{{- $owner := printf "%v:%v" (default 0 $sc.runAsUser | int64) (default 0 (default $sc.runAsUser $sc.runAsGroup) | int64) }}
initContainers:
  - name: prepare-storage
    image: {{ include "resilient-fsdp.image" . }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    # Root without DAC_OVERRIDE cannot create inside (or, for mode 0700, even look inside) a
    # directory the user owns: the checkpoint directory goes first, and one it cannot reach is
    # left to the trainer, which can. Another pod may take the run directory mid-script (its
    # last chown), so a failed chown is judged by whether the directory is still reachable.
    command:
      - sh
      - -c
      - 'say() { echo "prepare-storage: $*; the trainer checks the directories and says how to fix them" >&2; }; if ! mkdir -p -- "$1"; then say "could not create $1"; exit 0; fi; mkdir -p -- "$2" 2>/dev/null; if [ -d "$2" ]; then chown -- "$3" "$2" 2>/dev/null || [ ! -d "$2" ] || chown -- "$3" "$2" || say "could not give $2 to $3"; fi; chown -- "$3" "$1" || say "could not give $1 to $3"; exit 0'
      - prepare-storage
    args:
      - {{ include "resilient-fsdp.runDir" . | quote }}
      - {{ include "resilient-fsdp.checkpointDir" . | quote }}
      - {{ $owner | quote }}
    resources:
      requests: {cpu: 100m, memory: 64Mi}
      limits: {cpu: 100m, memory: 64Mi}
    securityContext:
      runAsUser: 0
      runAsGroup: 0
      runAsNonRoot: false
      privileged: false
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities:
        drop: [ALL]
        add: [CHOWN]
    volumeMounts:
      - name: shared
        mountPath: {{ $v.storage.mountPath }}
{{- end }}
{{- end }}
