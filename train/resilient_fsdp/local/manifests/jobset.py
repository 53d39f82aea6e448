"""The JobSet reader of the local cluster: its pods, and the restart rules of its Jobs and itself.

After JobSet v0.12.0 (``jobset.x-k8s.io/v1alpha2``) and the batch/v1 Job controller: each
replicated Job runs ``completions`` pods in Indexed mode with stable hostnames under the headless
Service; a failed pod goes through its Job's ``podFailurePolicy`` rules, a failed Job through the
JobSet's ``failurePolicy.rules`` (:meth:`JobSetPolicy.on_failure`), and the JobSet succeeds when
every Job has. The local launcher (:mod:`resilient_fsdp.local.cluster.launcher`) applies it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional

from .pytorchjob import RestartPolicy
from .spec import (
    PodSpec,
    Workload,
    WorkloadError,
    container_env,
    container_mounts,
    init_containers,
    local_node,
    pod_volumes,
    security_of,
    service_names,
)

JOBSET_CONTAINER = "node"


@dataclass
class JobSetPolicy(RestartPolicy):
    """The Job's pod failure policy and backoff, then the JobSet's failure policy (stateful: it
    counts each Job's failures and the JobSet's restarts). The pod template's ``restartPolicy``,
    ``backoffLimit`` and ``activeDeadlineSeconds`` are held, and ``retryable`` read, as
    :class:`RestartPolicy` holds and reads them."""

    pod_rules: list = field(default_factory=list)
    """The Job's ``podFailurePolicy.rules``, as rendered."""
    jobset_rules: Optional[list] = None
    """The JobSet's ``failurePolicy.rules``; None when it has no ``failurePolicy``."""
    max_restarts: int = 0
    job_of: dict = field(default_factory=dict)
    """Pod hostname -> its Job's name."""
    counted: dict = field(default_factory=dict)
    """Job name -> failures counted against ``backoffLimit`` since the last whole restart."""
    restarts: int = 0
    """Whole-JobSet restarts that counted towards ``maxRestarts``."""

    def _pod_rule(self, container: str, code: int, lost: bool) -> Optional[str]:
        for rule in self.pod_rules:
            on_codes = rule.get("onExitCodes")
            if on_codes is not None:
                if on_codes.get("containerName") not in (None, container) or lost:
                    continue
                listed = code in [int(v) for v in on_codes.get("values") or []]
                if listed == (on_codes.get("operator", "In") == "In"):
                    return rule["action"]
            elif lost and any(
                c.get("type") == "DisruptionTarget" and str(c.get("status", "True")) == "True"
                for c in rule.get("onPodConditions") or []
            ):
                return rule["action"]
        return None

    def on_failure(self, pod: PodSpec, code: int, lost: bool, failures: int) -> tuple[str, str]:
        job = self.job_of[pod.hostname]
        action = self._pod_rule(pod.container, code, lost)
        if action == "Ignore":
            return "recreate", (
                f"ignored by Job {job}'s podFailurePolicy (not counted"
                + (": DisruptionTarget, lost with its node" if lost else "")
                + "); the Job creates it again"
            )
        if action == "FailJob":
            return self._job_failed(
                job, "PodFailurePolicy", f"exit code {code} matches a FailJob rule of its podFailurePolicy"
            )
        self.counted[job] = self.counted.get(job, 0) + 1
        limit = self.backoff_limit if self.backoff_limit is not None else 6  # the Job API's default
        if self.counted[job] > limit:
            return self._job_failed(
                job, "BackoffLimitExceeded", f"{self.counted[job]} counted pod failures, past backoffLimit: {limit}"
            )
        return "recreate", (
            f"counted by Job {job} ({self.counted[job]} of backoffLimit: {limit}); the Job creates it "
            "again with the same name"
        )

    def _job_failed(self, job: str, reason: str, detail: str) -> tuple[str, str]:
        what = f"Job {job} failed ({reason}: {detail})"
        if self.jobset_rules is None:
            return "fail", f"{what}; the JobSet has no failurePolicy: it fails (FailedJobs)"
        rule = next(
            (r for r in self.jobset_rules if not r.get("onJobFailureReasons") or reason in r["onJobFailureReasons"]),
            None,
        )
        name, action = (rule.get("name", "?"), rule["action"]) if rule else ("(none matched)", "RestartJobSet")
        if action == "FailJobSet":
            return (
                "fail",
                f"{what}; JobSet failurePolicy rule {name}: FailJobSet: the JobSet fails (FailJobSetFailurePolicyAction)",
            )
        if action == "RestartJobSet" and self.restarts >= self.max_restarts:
            return "fail", (
                f"{what}; JobSet failurePolicy rule {name}: RestartJobSet, but {self.restarts} of maxRestarts: "
                f"{self.max_restarts} are spent: the JobSet fails (ReachedMaxRestarts)"
            )
        if action not in ("RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"):
            raise WorkloadError(
                f"JobSet failurePolicy rule {name}: action {action} is not simulated locally "
                "(FailJobSet, RestartJobSet, RestartJobSetAndIgnoreMaxRestarts are)"
            )
        if action == "RestartJobSet":
            self.restarts += 1
        self.counted.clear()  # the Jobs are created again, with a fresh backoff budget
        return "restart", (
            f"{what}; JobSet failurePolicy rule {name}: {action}: every pod of every Job is deleted and "
            f"created again (restart {self.restarts} of maxRestarts: {self.max_restarts})"
        )


def read_jobset(doc: dict) -> Workload:
    """The pods a rendered JobSet's Indexed Jobs create, with the Jobs' and the JobSet's restart rules."""
    name, namespace = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    spec = doc["spec"]
    subdomain = (spec.get("network") or {}).get("subdomain") or name
    replicated = spec.get("replicatedJobs") or []
    if len(replicated) != 1:
        raise WorkloadError(f"JobSet {name}: {len(replicated)} replicatedJobs; the local cluster runs one")
    rjob = replicated[0]
    job_spec = rjob["template"]["spec"]
    template = job_spec["template"]
    containers = template.get("spec", {}).get("containers") or []
    if not containers:
        raise WorkloadError(f"JobSet {name}: replicatedJob {rjob['name']} has no containers")
    c = next((c for c in containers if c.get("name") == JOBSET_CONTAINER), containers[0])
    policy = spec.get("failurePolicy")
    restart = JobSetPolicy(
        template.get("spec", {}).get("restartPolicy", "Never"),
        job_spec.get("backoffLimit"),
        job_spec.get("activeDeadlineSeconds"),
        pod_rules=list((job_spec.get("podFailurePolicy") or {}).get("rules") or []),
        jobset_rules=None if policy is None else list(policy.get("rules") or []),
        max_restarts=int((policy or {}).get("maxRestarts", 0)),
    )
    pods = []
    completions = int(job_spec.get("completions", job_spec.get("parallelism", 1)))
    uid = str(uuid.uuid4())  # the JobSet object's: one per install (per local run)
    for j in range(int(rjob.get("replicas", 1))):
        job = f"{name}-{rjob['name']}-{j}"
        for p in range(completions):
            hostname = f"{job}-{p}"
            # The Indexed Job's annotation and the JobSet's labels on each pod.
            fields = {
                "metadata.name": hostname,
                "metadata.namespace": namespace,
                "spec.nodeName": local_node(hostname),
                "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(p),
                "metadata.labels['jobset.sigs.k8s.io/job-index']": str(j),
                "metadata.labels['jobset.sigs.k8s.io/jobset-uid']": uid,
            }
            env = container_env(c, f"JobSet {name} {rjob['name']}", fields)
            env.pop("JOB_COMPLETION_INDEX", None)
            env["JOB_COMPLETION_INDEX"] = str(p)
            restart.job_of[hostname] = job
            names = service_names(f"{hostname}.{subdomain}", namespace)
            pods.append(
                PodSpec(
                    hostname=hostname,
                    index=len(pods),
                    role=rjob["name"],
                    container=c["name"],
                    command=list(c.get("command") or []),
                    args=list(c.get("args") or []),
                    env=env,
                    mounts=container_mounts(c),
                    volumes=pod_volumes(template.get("spec", {})),
                    aliases=[f"{hostname}.{subdomain}", *names],
                    fqdn=names[-1],
                    security=security_of(template.get("spec", {}), c, f"JobSet {name} {rjob['name']}"),
                    init_containers=init_containers(template.get("spec", {}), f"JobSet {name} {rjob['name']}", fields),
                )
            )
    if not pods:
        raise WorkloadError(f"JobSet {name}: no pods")
    # Pod 0's stable name under the JobSet's Service: the host its agent's rendezvous endpoint names.
    return Workload("JobSet", name, namespace, pods, {}, restart, f"{pods[0].hostname}.{subdomain}", "all")
