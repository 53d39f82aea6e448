"""What the API server and the operators' admission webhooks refuse, beyond any schema.

A CRD's ``openAPIV3Schema`` says which fields exist; it does not say that a JobSet's pod names must
fit in 63 characters or that a TrainJob may not set ``PET_NNODES``. Those rules live in Go code,
and a manifest that breaks one is refused at ``kubectl apply`` (or its Jobs later, by the JobSet
controller). Each ``check_*`` function restates one component's rules, at the version the chart
targets (its docstring names the source), and returns :class:`Finding` s naming the field.
``validate`` uses it; standard library only, so it runs wherever ``validate`` does.
"""

from __future__ import annotations

import copy
import re
from typing import NamedTuple, Optional

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_HTTP_PATH = re.compile(r"^[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$")

# batch/v1 (kubernetes pkg/apis/batch/validation/validation.go)
MAX_POD_FAILURE_POLICY_RULES = 20
MAX_EXIT_CODE_VALUES = 255
MAX_POD_CONDITIONS = 20
JOB_ACTIONS = ("FailJob", "FailIndex", "Ignore", "Count")

# JobSet v0.12.0 (pkg/webhooks/jobset_webhook.go, api/jobset/v1alpha2/jobset_types.go)
JOB_FAILURE_REASONS = (
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)
JOBSET_ACTIONS = (
    "FailJobSet",
    "RestartJobSet",
    "RestartJobSetAndIgnoreMaxRestarts",
    "RestartJob",
    "RestartJobAndIgnoreMaxRestarts",
)
# Behind the alpha RestartJob / InPlaceRestart gates, off by default (pkg/features/features.go).
GATED_ACTIONS = ("RestartJob", "RestartJobAndIgnoreMaxRestarts")
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")

# Kubeflow Trainer v2.3.0 (pkg/constants/constants.go)
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
ANCESTOR_CONTAINERS = {
    "trainer": "node",
    "model-initializer": "model-initializer",
    "dataset-initializer": "dataset-initializer",
}
TORCH_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
TRAINJOB_MANAGED_BY = ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
MAX_RUNTIME_PATCHES = 16


class Finding(NamedTuple):
    """A refused field: where, why, and whose rule it is."""

    path: str
    message: str
    check: str


def _dig(node, *keys, default=None):
    for key in keys:
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and -len(node) <= key < len(node):
            node = node[key]
        else:
            return default
        if node is None:
            return default
    return node


def _dns1035_problems(value: str, max_len: int = 63) -> list[str]:
    found = []
    if len(value) > max_len:
        found.append(f"must be no more than {max_len} characters (is {len(value)})")
    if not _DNS1035.match(value):
        found.append("must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter)")
    return found


def _is_domain_prefixed_path(value: str) -> bool:
    """k8s.io/apimachinery IsDomainPrefixedPath: ``<DNS-1123 subdomain>/<http path>``."""
    host, sep, path = value.partition("/")
    if not sep or not host or not path or len(host) > 253:
        return False
    return all(_DNS1123_LABEL.match(part) for part in host.split(".")) and bool(_HTTP_PATH.match(path))


# ---- batch/v1 Job ----------------------------------------------------------------------------------


def check_job_spec(spec: dict, path: str = "spec") -> list[Finding]:
    """The Job API's own rules for ``spec`` (a batch/v1 JobSpec), as the API server applies them.

    Kubernetes ``pkg/apis/batch/validation``, 1.31 and later: ``podFailurePolicy`` needs
    ``restartPolicy: Never`` and at most 20 rules, each with exactly one of ``onExitCodes`` (1-255
    unique, ascending values, no 0 with ``In``, a ``containerName`` that exists) or
    ``onPodConditions`` (at most 20); ``FailIndex`` and ``maxFailedIndexes`` need
    ``backoffLimitPerIndex``, which needs Indexed completion.
    """
    check = "Job API"
    found: list[Finding] = []
    pod_spec = _dig(spec, "template", "spec", default={})
    indexed = spec.get("completionMode") == "Indexed"
    per_index = spec.get("backoffLimitPerIndex") is not None
    if indexed and spec.get("completions") is None:
        found.append(Finding(f"{path}.completions", "must be set when completionMode is Indexed", check))
    if per_index and not indexed:
        found.append(Finding(f"{path}.backoffLimitPerIndex", "requires completionMode Indexed", check))
    if spec.get("maxFailedIndexes") is not None:
        if not per_index:
            found.append(Finding(f"{path}.maxFailedIndexes", "requires backoffLimitPerIndex", check))
        elif spec.get("completions") is not None and spec["maxFailedIndexes"] > spec["completions"]:
            found.append(Finding(f"{path}.maxFailedIndexes", "must be less than or equal to completions", check))
    policy = spec.get("podFailurePolicy")
    if policy is None:
        return found
    where = f"{path}.podFailurePolicy"
    restart = pod_spec.get("restartPolicy", "")
    if restart != "Never":
        found.append(
            Finding(
                f"{path}.template.spec.restartPolicy",
                f"only Never is supported when podFailurePolicy is specified (is {restart or 'empty'})",
                check,
            )
        )
    replacement = spec.get("podReplacementPolicy")
    if replacement is not None and replacement != "Failed":
        found.append(
            Finding(f"{path}.podReplacementPolicy", "must be Failed when podFailurePolicy is specified", check)
        )
    rules = policy.get("rules") or []
    if len(rules) > MAX_POD_FAILURE_POLICY_RULES:
        found.append(
            Finding(
                f"{where}.rules", f"must have at most {MAX_POD_FAILURE_POLICY_RULES} items (has {len(rules)})", check
            )
        )
    containers = {c.get("name") for c in (pod_spec.get("containers") or []) + (pod_spec.get("initContainers") or [])}
    for i, rule in enumerate(rules):
        at = f"{where}.rules[{i}]"
        action = rule.get("action")
        if action not in JOB_ACTIONS:
            found.append(Finding(f"{at}.action", f"must be one of {', '.join(JOB_ACTIONS)} (is {action!r})", check))
        if action == "FailIndex" and not per_index:
            found.append(Finding(f"{at}.action", "FailIndex requires backoffLimitPerIndex", check))
        codes, conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
        if (codes is None) == (conditions is None):
            found.append(Finding(at, "specify exactly one of onExitCodes and onPodConditions", check))
        if codes is not None:
            found += _check_exit_codes(codes, f"{at}.onExitCodes", containers)
        if conditions is not None:
            if len(conditions) > MAX_POD_CONDITIONS:
                found.append(Finding(f"{at}.onPodConditions", f"must have at most {MAX_POD_CONDITIONS} items", check))
            for j, cond in enumerate(conditions):
                if not cond.get("type"):
                    found.append(Finding(f"{at}.onPodConditions[{j}].type", "must be set", check))
                if cond.get("status", "True") not in ("True", "False", "Unknown"):
                    found.append(Finding(f"{at}.onPodConditions[{j}].status", "must be True, False or Unknown", check))
    return found


def _check_exit_codes(codes: dict, at: str, containers: set) -> list[Finding]:
    check = "Job API"
    found = []
    operator, values = codes.get("operator"), codes.get("values") or []
    if operator not in ("In", "NotIn"):
        found.append(Finding(f"{at}.operator", f"must be In or NotIn (is {operator!r})", check))
    name = codes.get("containerName")
    if name is not None and name not in containers:
        found.append(
            Finding(
                f"{at}.containerName",
                f"{name!r} is not a container or initContainer of the pod "
                f"template ({', '.join(sorted(map(str, containers)))})",
                check,
            )
        )
    if not 1 <= len(values) <= MAX_EXIT_CODE_VALUES:
        found.append(
            Finding(
                f"{at}.values",
                f"must have 1 to {MAX_EXIT_CODE_VALUES} items (has {len(values)}); "
                "the API takes listed exit codes, no ranges",
                check,
            )
        )
    if len(set(values)) != len(values):
        found.append(Finding(f"{at}.values", "must not contain duplicates", check))
    if list(values) != sorted(values):
        found.append(Finding(f"{at}.values", "must be ordered in ascending order", check))
    if operator == "In" and 0 in values:
        found.append(Finding(f"{at}.values", "must not contain 0 with operator In", check))
    return found


# ---- JobSet ----------------------------------------------------------------------------------------


def jobset_defaults(spec: dict) -> dict:
    """``spec`` with the JobSet webhook's and CRD's defaults applied (jobset v0.12.0 Default())."""
    spec = copy.deepcopy(spec)
    for rjob in spec.get("replicatedJobs") or []:
        rjob.setdefault("replicas", 1)
        rjob.setdefault("groupName", "default")
        job = rjob.setdefault("template", {}).setdefault("spec", {})
        job.setdefault("completionMode", "Indexed")
        pod = job.setdefault("template", {}).setdefault("spec", {})
        if not pod.get("restartPolicy"):
            pod["restartPolicy"] = "OnFailure"
    for i, rule in enumerate(_dig(spec, "failurePolicy", "rules", default=[])):
        if not rule.get("name"):
            rule["name"] = f"failurePolicyRule{i}"
    return spec


def check_jobset_spec(
    name: str, spec: dict, path: str = "spec", check: str = "JobSet webhook", jobs: bool = True
) -> list[Finding]:
    """The JobSet webhook's create-time rules for a JobSet ``name`` with ``spec``, then (``jobs``) the
    Job API's rules for each replicated Job as the JobSet controller will create it.

    ``pkg/webhooks/jobset_webhook.go`` of v0.12.0, after its defaults (:func:`jobset_defaults`):
    Job and pod name lengths, subdomain, failure-policy rule names, reasons, targets and
    feature-gated actions, ``dependsOn`` and the coordinator.
    """
    found: list[Finding] = []
    spec = jobset_defaults(spec)
    rjobs = spec.get("replicatedJobs") or []
    names = [r.get("name", "") for r in rjobs]
    subdomain = _dig(spec, "network", "subdomain")
    if subdomain:
        for message in _dns1035_problems(subdomain):
            found.append(Finding(f"{path}.network.subdomain", message, check))
    if rjobs and rjobs[0].get("dependsOn"):
        found.append(Finding(f"{path}.replicatedJobs[0].dependsOn", "can't be set for the first ReplicatedJob", check))
    for i, rjob in enumerate(rjobs):
        at = f"{path}.replicatedJobs[{i}]"
        job = rjob["template"]["spec"]
        for message in _dns1035_problems(rjob["groupName"]):
            found.append(Finding(f"{at}.groupName", message, check))
        longest_job = f"{name}-{rjob.get('name', '')}-{int(rjob['replicas']) - 1}"
        for message in _dns1035_problems(longest_job):
            found.append(Finding(f"{at}.name", f"Job name {longest_job!r}: {message}", check))
        if job.get("completionMode") == "Indexed" and job.get("completions") is not None:
            longest_pod = f"{longest_job}-{int(job['completions']) - 1}-abcde"
            if len(longest_pod) > 63:
                found.append(
                    Finding(
                        f"{at}.name",
                        f"JobSet name is too long: pod names such as {longest_pod!r} "
                        f"({len(longest_pod)} characters) exceed 63",
                        check,
                    )
                )
        for dep in rjob.get("dependsOn") or []:
            if dep.get("name") not in names[:i]:
                found.append(Finding(f"{at}.dependsOn", f"{dep.get('name')!r} is not an earlier replicatedJob", check))
        if jobs:
            found += [f._replace(path=f"{at}.template.{f.path}") for f in check_job_spec(job, "spec")]
    policy = spec.get("failurePolicy")
    if policy:
        if policy.get("restartStrategy") == "InPlaceRestart":
            found.append(
                Finding(
                    f"{path}.failurePolicy.restartStrategy",
                    "InPlaceRestart needs the alpha InPlaceRestart feature gate, off by default",
                    check,
                )
            )
        seen: dict[str, int] = {}
        for j, rule in enumerate(policy.get("rules") or []):
            at = f"{path}.failurePolicy.rules[{j}]"
            rule_name = rule.get("name", "")
            if not 1 <= len(rule_name) <= 128 or not _RULE_NAME.match(rule_name):
                found.append(
                    Finding(
                        f"{at}.name",
                        f"{rule_name!r}: 1-128 characters, a letter first, then letters, "
                        "digits or '_,:', ending in a letter, digit or '_'",
                        check,
                    )
                )
            if rule_name in seen:
                found.append(Finding(f"{at}.name", f"{rule_name!r} repeats rule {seen[rule_name]}", check))
            seen.setdefault(rule_name, j)
            action = rule.get("action")
            if action not in JOBSET_ACTIONS:
                found.append(Finding(f"{at}.action", f"must be one of {', '.join(JOBSET_ACTIONS)}", check))
            elif action in GATED_ACTIONS:
                found.append(
                    Finding(f"{at}.action", f"{action} needs the alpha RestartJob feature gate, off by default", check)
                )
            for reason in rule.get("onJobFailureReasons") or []:
                if reason not in JOB_FAILURE_REASONS:
                    found.append(
                        Finding(
                            f"{at}.onJobFailureReasons",
                            f"{reason!r} is not a Job failure reason ({', '.join(JOB_FAILURE_REASONS)})",
                            check,
                        )
                    )
            for target in rule.get("targetReplicatedJobs") or []:
                if target not in names:
                    found.append(Finding(f"{at}.targetReplicatedJobs", f"{target!r} is not a replicatedJob", check))
    coordinator = spec.get("coordinator")
    if coordinator:
        target = next((r for r in rjobs if r.get("name") == coordinator.get("replicatedJob")), None)
        if target is None:
            found.append(Finding(f"{path}.coordinator.replicatedJob", "is not a replicatedJob", check))
        elif not (
            0 <= int(coordinator.get("jobIndex", 0)) < int(target["replicas"])
            and 0 <= int(coordinator.get("podIndex", 0)) < int(target["template"]["spec"].get("completions") or 1)
        ):
            found.append(Finding(f"{path}.coordinator", "jobIndex or podIndex is outside the replicatedJob", check))
    for i, target in enumerate(_dig(spec, "successPolicy", "targetReplicatedJobs", default=[])):
        if target not in names:
            found.append(
                Finding(f"{path}.successPolicy.targetReplicatedJobs[{i}]", f"{target!r} is not a replicatedJob", check)
            )
    return found


def check_jobset(doc: dict) -> list[Finding]:
    """A JobSet object, as the JobSet webhook and then the Job API will see it."""
    name = _dig(doc, "metadata", "name", default="")
    found = [Finding("metadata.name", m, "JobSet webhook") for m in _dns1035_problems(name)]
    managed_by = _dig(doc, "spec", "managedBy")
    if managed_by is not None and (len(managed_by) > 63 or not _is_domain_prefixed_path(managed_by)):
        found.append(
            Finding("spec.managedBy", "must be a domain-prefixed path of at most 63 characters", "JobSet webhook")
        )
    return found + check_jobset_spec(name, doc.get("spec") or {})


# ---- Kubeflow Trainer ------------------------------------------------------------------------------


def check_training_runtime(doc: dict) -> list[Finding]:
    """A TrainingRuntime or ClusterTrainingRuntime, as Trainer's webhook sees it.

    Trainer v2.3.0's ``pkg/webhooks/trainingruntime_webhook.go``: a Job labelled
    ``trainer.kubeflow.org/trainjob-ancestor-step: trainer`` has one replica and a container ``node``;
    then the Job API's rules on its Jobs.
    """
    check = "Trainer webhook"
    found: list[Finding] = []
    rjobs = _dig(doc, "spec", "template", "spec", "replicatedJobs", default=[])
    for i, rjob in enumerate(rjobs):
        at = f"spec.template.spec.replicatedJobs[{i}]"
        ancestor = _dig(rjob, "template", "metadata", "labels", ANCESTOR_LABEL)
        if ancestor not in ANCESTOR_CONTAINERS:
            continue
        if rjob.get("replicas", 1) != 1:
            found.append(Finding(f"{at}.replicas", "always must be 1 (Trainer scales the Job's pods instead)", check))
        containers = [
            c.get("name") for c in _dig(rjob, "template", "spec", "template", "spec", "containers", default=[])
        ]
        if ANCESTOR_CONTAINERS[ancestor] not in containers:
            found.append(
                Finding(
                    f"{at}.template.spec.template.spec.containers",
                    f"must contain the container {ANCESTOR_CONTAINERS[ancestor]!r} for the ancestor {ancestor!r}",
                    check,
                )
            )
    # Its Jobs, as the JobSet webhook will default them and the Job API will check them.
    for i, rjob in enumerate(jobset_defaults({"replicatedJobs": rjobs})["replicatedJobs"]):
        found += [
            f._replace(path=f"spec.template.spec.replicatedJobs[{i}].template.{f.path}")
            for f in check_job_spec(rjob["template"]["spec"], "spec")
        ]
    policy = _dig(doc, "spec", "mlPolicy", default={})
    sources = [k for k in ("torch", "mpi", "jax", "xgboost", "flux") if k in policy]
    if len(sources) > 1:
        found.append(Finding("spec.mlPolicy", f"only one of {', '.join(sources)} may be set", check))
    return found


def _built_jobset_spec(trainjob: dict, runtime: dict) -> dict:
    """The JobSet spec Trainer builds for ``trainjob`` from ``runtime`` (the parts its rules look at):
    the runtime's spec, the trainer Job's pod count from ``trainer.numNodes`` (else mlPolicy.numNodes)."""
    spec = copy.deepcopy(_dig(runtime, "spec", "template", "spec", default={}))
    nodes = _dig(trainjob, "spec", "trainer", "numNodes") or _dig(runtime, "spec", "mlPolicy", "numNodes")
    for rjob in spec.get("replicatedJobs") or []:
        if _dig(rjob, "template", "metadata", "labels", ANCESTOR_LABEL) == "trainer" and nodes:
            job = rjob.setdefault("template", {}).setdefault("spec", {})
            rjob["replicas"] = 1
            job["parallelism"] = job["completions"] = int(nodes)
    return spec


def check_trainjob(doc: dict, runtime: Optional[dict] = None) -> list[Finding]:
    """A TrainJob: its CRD's CEL rules, Trainer's TrainJob webhook, and (when ``runtime``, the
    TrainingRuntime it names, is at hand) the JobSet Trainer will build from the two.

    The CEL rules: an RFC 1035 name of at most 63 characters, ``managedBy``. The webhook: the torch
    plugin's reserved ``PET_*`` names in ``trainer.env`` (``plugins/torch/torch.go``); runtime patches
    (a domain-prefixed ``manager``, only jobs and containers the runtime has, no ``env`` on ``node``:
    ``plugins/jobset/jobset.go``); the JobSet it builds (named after the TrainJob, ``trainer.numNodes``
    pods), checked as the JobSet webhook will check it.
    """
    found: list[Finding] = []
    name = _dig(doc, "metadata", "name", default="")
    found += [Finding("metadata.name", m, "TrainJob CRD rules") for m in _dns1035_problems(name)]
    spec = doc.get("spec") or {}
    if spec.get("managedBy") is not None and spec["managedBy"] not in TRAINJOB_MANAGED_BY:
        found.append(
            Finding("spec.managedBy", f"must be one of {', '.join(TRAINJOB_MANAGED_BY)}", "TrainJob CRD rules")
        )
    check = "Trainer webhook"
    torch = runtime is None or "torch" in (_dig(runtime, "spec", "mlPolicy", default={}))
    if torch:
        for i, env in enumerate(_dig(spec, "trainer", "env", default=[])):
            if env.get("name") in TORCH_RESERVED_ENV:
                found.append(
                    Finding(f"spec.trainer.env[{i}]", f"{env['name']} is reserved: the torch plugin sets it", check)
                )
    patches = spec.get("runtimePatches") or []
    if len(patches) > MAX_RUNTIME_PATCHES:
        found.append(Finding("spec.runtimePatches", f"must have at most {MAX_RUNTIME_PATCHES} items", check))
    rjob_containers = None
    if runtime is not None:
        rjob_containers = {}
        for rjob in _dig(runtime, "spec", "template", "spec", "replicatedJobs", default=[]):
            pod = _dig(rjob, "template", "spec", "template", "spec", default={})
            rjob_containers[rjob.get("name")] = {
                c.get("name") for c in (pod.get("containers") or []) + (pod.get("initContainers") or [])
            }
    for i, patch in enumerate(patches):
        at = f"spec.runtimePatches[{i}]"
        if not _is_domain_prefixed_path(patch.get("manager", "")):
            found.append(
                Finding(
                    f"{at}.manager",
                    f"{patch.get('manager')!r} must be a domain-prefixed path (such as example.com/chart)",
                    check,
                )
            )
        for j, rjob in enumerate(_dig(patch, "trainingRuntimeSpec", "template", "spec", "replicatedJobs", default=[])):
            rat = f"{at}.trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
            if rjob_containers is not None and rjob.get("name") not in rjob_containers:
                found.append(
                    Finding(f"{rat}.name", f"{rjob.get('name')!r} is not a replicated job of the runtime", check)
                )
                continue
            pod = _dig(rjob, "template", "spec", "template", "spec", default={})
            for kind in ("initContainers", "containers"):
                for k, c in enumerate(pod.get(kind) or []):
                    cat = f"{rat}.template.spec.template.spec.{kind}[{k}]"
                    if rjob_containers is not None and c.get("name") not in rjob_containers[rjob.get("name")]:
                        found.append(
                            Finding(
                                f"{cat}.name",
                                f"{c.get('name')!r} is not a container of the runtime job {rjob.get('name')!r}",
                                check,
                            )
                        )
                    elif c.get("env") and c.get("name") in ("node", "model-initializer", "dataset-initializer"):
                        found.append(
                            Finding(
                                f"{cat}.env",
                                f"must not set env on the {c['name']} container (use spec.trainer.env)",
                                check,
                            )
                        )
    if runtime is not None:
        found += [
            f._replace(path=f"(the JobSet Trainer builds) {f.path}", check=f"{f.check}, built JobSet")
            for f in check_jobset_spec(name, _built_jobset_spec(doc, runtime), jobs=False)
        ]
    return found
