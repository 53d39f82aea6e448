"""``resilient-fsdp validate``: check rendered manifests as the cluster would, without a cluster.

Each document is checked against the Kubernetes OpenAPI schemas of one pinned version (strict:
unknown fields fail, as ``kubectl apply`` rejects them), or its CRD's ``openAPIV3Schema`` made
strict the same way; against the admission rules no schema states (the training operator's for
PyTorchJobs here, JobSet's, Trainer's and the Job API's in :mod:`.admission`); and every pod
against a Pod Security Standards level (``--pod-security``, :mod:`.pod_security`). The CRDs come
from ``--crds``, else ``$RESILIENT_FSDP_CRDS``, else ``charts/vendor/crds`` (``scripts/fetch-crds``).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import yaml

from .chart import KUBERNETES_VERSION, REPO_ROOT, ChartError

CRDS_ENV = "RESILIENT_FSDP_CRDS"
# Pinned copies of the operators' CRDs (never installed by the chart: each operator owns its own).
VENDORED_CRDS = REPO_ROOT / "charts" / "vendor" / "crds"
PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")
JOBSET = ("jobset.x-k8s.io/v1alpha2", "JobSet")
TRAINJOB = ("trainer.kubeflow.org/v1alpha1", "TrainJob")
RUNTIMES = {
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"),
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"),
}
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# runPolicy.managedBy values the operator accepts (empty means itself).
_MANAGED_BY = ("", "kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")
# The CRD files are large (the PyTorchJob's alone is ~9,000 lines): parse them with libyaml when present.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class Problem:
    """One finding: which object, which field, what is wrong."""

    obj: str
    path: str
    message: str
    check: str

    def __str__(self) -> str:
        return f"{self.obj}: {self.path or '(object)'}: {self.message} [{self.check}]"


def crd_dir(explicit: Optional[str | Path] = None) -> Path:
    """Where the CRDs are: ``explicit``, else ``$RESILIENT_FSDP_CRDS``, else the vendored copy
    (``charts/vendor/crds``, which ``scripts/fetch-crds`` updates)."""
    if explicit or os.environ.get(CRDS_ENV):
        return Path(explicit or os.environ[CRDS_ENV])
    return VENDORED_CRDS


def load_crd_schemas(directory: Path) -> dict[tuple[str, str], dict]:
    """``{(apiVersion, kind): openAPIV3Schema}`` for every served version of every CRD in ``directory``."""
    if not directory.is_dir():
        raise ChartError(
            f"--crds {directory}: no such directory; run scripts/fetch-crds, or pass --crds DIR "
            f"(or set {CRDS_ENV}) to a directory holding kubeflow.org_pytorchjobs.yaml"
        )
    schemas = {}
    for path in sorted(directory.glob("*.y*ml")):
        for doc in yaml.load_all(path.read_text(), Loader=_LOADER):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec.get("versions", []):
                schema = (version.get("schema") or {}).get("openAPIV3Schema")
                if schema and version.get("served", True):
                    schemas[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = schema
    if PYTORCHJOB not in schemas:
        raise ChartError(
            f"{directory} holds no PyTorchJob CRD ({PYTORCHJOB[0]}): run scripts/fetch-crds, "
            f"or pass --crds DIR (or set {CRDS_ENV})"
        )
    return schemas


def strict_schema(schema: dict) -> dict:
    """The schema with unknown fields rejected wherever the CRD lists the fields (structural
    schemas prune unknown fields silently; strict field validation, kubectl's default, rejects them)."""
    node = copy.deepcopy(schema)

    def walk(n: object) -> None:
        if isinstance(n, dict):
            if (
                "properties" in n
                and "additionalProperties" not in n
                and not n.get("x-kubernetes-preserve-unknown-fields")
            ):
                n["additionalProperties"] = False
            for value in n.values():
                walk(value)
        elif isinstance(n, list):
            for value in n:
                walk(value)

    walk(node)
    # The API server fills these in; a manifest may carry them.
    node.setdefault("properties", {})["metadata"] = {"type": "object"}
    return node


def _path(parts: Iterable) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")


def _name(doc: dict) -> str:
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


def check_crd(doc: dict, schema: dict) -> list[Problem]:
    import jsonschema

    validator = jsonschema.Draft7Validator(strict_schema(schema))
    return [
        Problem(_name(doc), _path(e.absolute_path), e.message, "CRD schema")
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def check_kubernetes(doc: dict, version: str = KUBERNETES_VERSION) -> list[Problem]:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [Problem(_name(doc), _path(e.path), e.message, f"Kubernetes {version} schema")]
    except SchemaNotFoundError:
        return [
            Problem(
                _name(doc),
                "",
                f"no Kubernetes {version} schema and no CRD for {doc.get('apiVersion')} "
                f"{doc.get('kind')}: pass its CRD's directory with --crds",
                "schema lookup",
            )
        ]
    return []


def check_pytorchjob_webhook(doc: dict) -> list[Problem]:
    """The training operator's admission rules (pkg/webhooks/pytorch of training-operator v1.9)."""
    name, spec = _name(doc), doc.get("spec") or {}
    found = []

    def problem(path: str, message: str) -> None:
        found.append(Problem(name, path, message, "PyTorchJob webhook"))

    job_name = (doc.get("metadata") or {}).get("name", "")
    if not _DNS1035.match(job_name) or len(job_name) > 63:
        problem("metadata.name", f"{job_name!r} is not a DNS-1035 label")
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        problem("spec.pytorchReplicaSpecs", "must be set")
    for role, rspec in replicas.items():
        where = f"spec.pytorchReplicaSpecs.{role}"
        if role not in ("Master", "Worker"):
            problem(where, "replica type must be Master or Worker")
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            problem(f"{where}.template.spec.containers", "must be specified")
        for i, c in enumerate(containers):
            if not c.get("image"):
                problem(f"{where}.template.spec.containers[{i}].image", "must be set")
        if not any(c.get("name") == "pytorch" for c in containers):
            problem(f"{where}.template.spec.containers", "must have a container named pytorch")
        count = (rspec or {}).get("replicas")
        if role == "Master" and count != 1:
            problem(f"{where}.replicas", f"must be 1 (is {count})")
        elif role == "Worker" and count is not None and count < 1:
            problem(f"{where}.replicas", f"must be at least 1 (is {count})")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            problem("spec.pytorchReplicaSpecs.Worker", "must be configured if elastic policy is used")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            problem("spec.elasticPolicy.nProcPerNode", "must not be used with spec.nprocPerNode")
    managed_by = (spec.get("runPolicy") or {}).get("managedBy")
    if managed_by is not None and managed_by not in _MANAGED_BY:
        problem("spec.runPolicy.managedBy", f"must be one of {', '.join(repr(m) for m in _MANAGED_BY)}")
    return found


def check_job_templates(
    doc: dict, replicated_jobs: list, path: str, version: str = KUBERNETES_VERSION
) -> list[Problem]:
    """Each replicated Job's template as the batch/v1 Job it becomes, against the pinned Kubernetes
    schema (the CRD embeds a Job schema of its own Kubernetes release)."""
    problems = []
    for i, rjob in enumerate(replicated_jobs or []):
        template = (rjob or {}).get("template") or {}
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                **(template.get("metadata") or {}),
                "name": f"{(doc.get('metadata') or {}).get('name')}-{(rjob or {}).get('name')}-0",
            },
            "spec": template.get("spec") or {},
        }
        for p in check_kubernetes(job, version):
            problems.append(Problem(_name(doc), f"{path}[{i}].template.{p.path}", p.message, p.check))
    return problems


def validate_documents(
    docs: list[dict], crds: dict[tuple[str, str], dict], version: str = KUBERNETES_VERSION
) -> list[Problem]:
    """Every problem in ``docs``; empty when all pass."""
    from resilient_fsdp.deploy import admission

    def found(doc: dict, findings: list) -> list[Problem]:
        return [Problem(_name(doc), f.path, f.message, f.check) for f in findings]

    problems: list[Problem] = []
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key in crds:
            problems += check_crd(doc, crds[key])
        else:
            problems += check_kubernetes(doc, version)
        if key == PYTORCHJOB:
            problems += check_pytorchjob_webhook(doc)
            # The CRD embeds a pod schema of its own Kubernetes release; check the pinned one too.
            for role, rspec in ((doc.get("spec") or {}).get("pytorchReplicaSpecs") or {}).items():
                wrapped = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata'].get('name')}-{role.lower()}"},
                    "template": (rspec or {}).get("template") or {},
                }
                for p in check_kubernetes(wrapped, version):
                    problems.append(
                        Problem(_name(doc), f"spec.pytorchReplicaSpecs.{role}.{p.path}", p.message, p.check)
                    )
        elif key == JOBSET:
            problems += found(doc, admission.check_jobset(doc))
            problems += check_job_templates(
                doc, (doc.get("spec") or {}).get("replicatedJobs"), "spec.replicatedJobs", version
            )
        elif key in RUNTIMES:
            problems += found(doc, admission.check_training_runtime(doc))
            spec = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
            problems += check_job_templates(
                doc, spec.get("replicatedJobs"), "spec.template.spec.replicatedJobs", version
            )
        elif key == TRAINJOB:
            # The runtime it names, when it is among the documents (else it lives in the cluster).
            ref = (doc.get("spec") or {}).get("runtimeRef") or {}
            runtime_kind = ref.get("kind", "ClusterTrainingRuntime")
            runtime = next(
                (
                    d
                    for d in docs
                    if d.get("kind") == runtime_kind and (d.get("metadata") or {}).get("name") == ref.get("name")
                ),
                None,
            )
            problems += found(doc, admission.check_trainjob(doc, runtime))
    return problems


def pod_security_problems(docs: list[dict], level: str) -> list[Problem]:
    """The pods' breaches of a Pod Security Standards level, as problems."""
    from resilient_fsdp.deploy import pod_security

    return [Problem(name, f.path, f.message, f.check) for name, f in pod_security.check_documents(docs, level)]


def add_parser(sub) -> None:
    """``resilient-fsdp validate``."""
    from .chart import add_values_args

    p = sub.add_parser(
        "validate",
        help="render, lint and validate the manifests against Kubernetes and CRD schemas",
        description="Render the chart (as `render` does), lint it strictly, and check every object "
        f"against the Kubernetes {KUBERNETES_VERSION} schemas, the CRDs' schemas and "
        "the admission rules of the training operator, JobSet, Trainer and the Job API. "
        "Exits 1 when anything fails.",
    )
    add_values_args(p)
    p.add_argument("--crds", help=f"directory of CRD manifests; default ${CRDS_ENV}, else charts/vendor/crds")
    p.add_argument(
        "--pod-security",
        choices=("privileged", "baseline", "restricted"),
        default="baseline",
        help="the Pod Security Standards level of the target namespace "
        "(pod-security.kubernetes.io/enforce); every pod must pass it (default baseline; "
        "privileged checks nothing)",
    )
    p.set_defaults(run=_cmd_validate)


def _cmd_validate(args) -> int:
    import sys

    from .chart import lint, load_values, render_from_args

    crds = load_crd_schemas(crd_dir(args.crds))  # a wrong --crds is said before any rendering
    rendered = render_from_args(args)
    docs = rendered.documents()
    findings = lint(load_values(args.values_files, args.set_values, args.set_json), chart=args.chart)
    problems = validate_documents(docs, crds)
    problems += pod_security_problems(docs, args.pod_security)
    for line in findings:
        print(f"lint: {line}")
    bad = {p.obj for p in problems}
    for doc in docs:
        name = _name(doc)
        print(f"{'FAIL' if name in bad else 'ok  '} {name}")
    for problem in problems:
        print(f"  {problem}")
    print(
        f"{len(docs)} object(s), {len(problems)} problem(s), {len(findings)} lint finding(s)",
        file=sys.stderr if problems or findings else sys.stdout,
    )
    return 1 if problems or findings else 0
