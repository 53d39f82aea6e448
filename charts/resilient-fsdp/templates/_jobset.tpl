{{/*
The JobSet spec (jobset.x-k8s.io/v1alpha2, JobSet v0.12) of the JobSet kind and of the
TrainingRuntime a TrainJob runs: one replicated Job `node` of `nodes` + `spares` Indexed pods. Called with
(dict "ctx" $). The restart contract, in the order things happen:

1. A pod whose trainer container exits 128-255 (the node wrapper's retryable codes: 143 after a
   graceful stop, 137 after a kill) matches no podFailurePolicy rule, so it counts as a failure
   and the Job controller replaces that pod alone, same index, same hostname.
2. A pod failure that carries the DisruptionTarget condition (eviction, preemption, node drain,
   kubelet graceful shutdown) is ignored: not counted, the pod replaced.
3. An exit of 1-127 from the trainer container fails the Job at once (reason PodFailurePolicy),
   and the JobSet rule `fatalExitCode` fails the JobSet.
4. More than `job.backoffLimit` counted failures fail the Job (reason BackoffLimitExceeded); the
   JobSet rule `podFailureBudgetSpent` restarts the whole JobSet (every pod, a fresh Job with a
   fresh budget) up to `workload.jobSet.maxRestarts` times, then the JobSet fails (ReachedMaxRestarts).
Sources: kubernetes batch/v1 types.go and pkg/apis/batch/validation (podFailurePolicy: Never only,
at most 20 rules, 1-255 listed exit codes per rule, no ranges); jobset v0.12.0
pkg/controllers/failure_policy.go (first matching rule wins; no match means RestartJobSet) and
pkg/webhooks/jobset_webhook.go (defaults: Indexed, restartPolicy OnFailure when empty).
*/}}
{{- define "resilient-fsdp.jobSetSpec" -}}
{{- $ := .ctx }}
{{- $v := $.Values }}
{{- $pods := int (include "resilient-fsdp.pods" $) }}
network:
  # Pod 0's hostname is the rendezvous endpoint; published before the pod is Ready, so agents
  # that start first can resolve it while it starts.
  enableDNSHostnames: true
  publishNotReadyAddresses: true
failurePolicy:
  maxRestarts: {{ int $v.workload.jobSet.maxRestarts }}
  restartStrategy: {{ $v.workload.jobSet.restartStrategy }}
  rules:
    - name: fatalExitCode
      action: FailJobSet
      onJobFailureReasons: [PodFailurePolicy]
    # A Job past its activeDeadlineSeconds: the time is up, a restart would not give more.
    - name: deadline
      action: FailJobSet
      onJobFailureReasons: [DeadlineExceeded]
    - name: podFailureBudgetSpent
      action: RestartJobSet
      onJobFailureReasons: [BackoffLimitExceeded]
{{- if and (eq $v.workload.kind "JobSet") (not (kindIs "invalid" $v.job.ttlSecondsAfterFinished)) }}
ttlSecondsAfterFinished: {{ int $v.job.ttlSecondsAfterFinished }}
{{- end }}
replicatedJobs:
  - name: {{ include "resilient-fsdp.replicatedJob" $ }}
    replicas: 1
    template:
      {{- $jobLabels := dict }}
      {{- if eq $v.workload.kind "TrainJob" }}
      {{- /* Marks the Job Trainer's torch plugin injects PET_* into (kubeflow/trainer v2.3.0
      pkg/constants/constants.go LabelTrainJobAncestor; its TrainingRuntime webhook then needs
      replicas 1 and a container named `node`). */}}
      {{- $_ := set $jobLabels "trainer.kubeflow.org/trainjob-ancestor-step" "trainer" }}
      {{- end }}
      {{- if or $jobLabels $v.workload.jobSet.exclusiveTopology }}
      metadata:
        {{- with $jobLabels }}
        labels:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $v.workload.jobSet.exclusiveTopology }}
        annotations:
          # One topology domain per Job, held exclusively: all of this job's pods in it.
          alpha.jobset.sigs.k8s.io/exclusive-topology: {{ . | quote }}
        {{- end }}
      {{- end }}
      spec:
        completionMode: Indexed
        completions: {{ $pods }}
        parallelism: {{ $pods }}
        # Counted pod failures (exits 128-255 without a disruption) this Job absorbs, over all
        # its pods, before it fails with BackoffLimitExceeded. A job-wide count, not
        # backoffLimitPerIndex: the budget is for failures anywhere in the job (the advisor's
        # expected failures over the run), and a node-replacing failure lands on any index.
        backoffLimit: {{ int $v.job.backoffLimit }}
        {{- if and (eq $v.workload.kind "JobSet") (not (kindIs "invalid" $v.job.activeDeadlineSeconds)) }}
        # From this Job's start: a whole-JobSet restart starts a new Job, and a new clock.
        activeDeadlineSeconds: {{ int64 $v.job.activeDeadlineSeconds }}
        {{- end }}
        podFailurePolicy:
          rules:
            # First, so an eviction is never fatal and never spends the budget, whatever it exits with.
            - action: Ignore
              onPodConditions:
                - type: DisruptionTarget
                  status: "True"
            # Exits 1-127 of the trainer container: configuration errors (2) and anything else a
            # retry cannot fix. Listed one by one: the API takes values, not ranges (at most 255).
            - action: FailJob
              onExitCodes:
                containerName: {{ include "resilient-fsdp.containerName" $ }}
                operator: In
                values: [{{ untilStep 1 128 1 | join ", " }}]
        template:
          {{- include "resilient-fsdp.podTemplate" (dict "ctx" $ "role" "node") | trim | nindent 10 }}
{{- end }}
