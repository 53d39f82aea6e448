"""Security scan of the rendered chart with checkov, and the failed checks this project accepts.

checkov knows pod specs only inside built-in workload kinds, so the pod templates of a PyTorchJob,
JobSet or TrainingRuntime would go unscanned. :func:`scan` therefore also writes each template
out as the Pod its controller creates from it, and scans those with the rest of the manifests.

checkov runs from its own virtual environment (``.venv/tools/checkov``, pinned by
``constraints-checkov.txt``; ``scripts/test`` creates it) because its dependency pins conflict with
the project's. It runs offline (``--skip-download``): no platform API key, so checkov reports no
severities, and every failed check must be listed in :data:`ACCEPTED` with its reason instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from .chart import REPO_ROOT, ChartError

CHECKOV_ENV = "RESILIENT_FSDP_CHECKOV"

# Failed checks that are deliberate, with the reason. Anything else failing is a finding to fix.
ACCEPTED = {
    "CKV_K8S_8": "No liveness probe: a training rank has no endpoint to probe, and a probe that restarted a "
    "rank in a collective would cause the failure it looks for. Hangs are detected by "
    "ft_launcher's section timeouts, which restart the ranks in the pod.",
    "CKV_K8S_9": "No readiness probe: the pods serve no traffic through a Service that readiness would gate.",
    "CKV_K8S_15": "imagePullPolicy IfNotPresent, not Always: tags are pinned (never latest) or images pulled by "
    "digest, and re-pulling a ~20 GB training image on every pod recreation lengthens recovery.",
    "CKV_K8S_25": "An added capability: CHOWN on storage.prepare's init container alone (within Pod Security "
    "baseline), which makes the run directory on a new FSx the pod user's; the training "
    "container drops every capability.",
    "CKV_K8S_43": "Image by tag unless image.digest is set: a digest is specific to a user's registry, so the "
    "profiles cannot carry one; set image.digest for production runs.",
}


@dataclass(frozen=True)
class Failure:
    check_id: str
    name: str
    resource: str

    def __str__(self) -> str:
        return f"{self.check_id} {self.resource}: {self.name}"


def checkov_executable() -> Path:
    """checkov from ``$RESILIENT_FSDP_CHECKOV`` or ``.venv/tools/checkov``; an error says how to get it."""
    path = Path(os.environ.get(CHECKOV_ENV) or REPO_ROOT / ".venv" / "tools" / "checkov" / "bin" / "checkov")
    if not path.is_file():
        raise ChartError(
            f"checkov not found at {path}: run ./scripts/test (it installs checkov into "
            f".venv/tools/checkov from constraints-checkov.txt) or set {CHECKOV_ENV}"
        )
    return path


def _templates(doc: dict) -> list[tuple[str, dict]]:
    """(role, pod template) of a PyTorchJob's replicas, or of a JobSet's or TrainingRuntime's Jobs."""
    spec = doc.get("spec") or {}
    if doc.get("kind") == "PyTorchJob":
        return [(role, (r or {}).get("template") or {}) for role, r in (spec.get("pytorchReplicaSpecs") or {}).items()]
    if doc.get("kind") == "TrainingRuntime":
        spec = (spec.get("template") or {}).get("spec") or {}
    elif doc.get("kind") != "JobSet":
        return []
    return [
        (r.get("name", "job"), ((r.get("template") or {}).get("spec") or {}).get("template") or {})
        for r in spec.get("replicatedJobs") or []
    ]


def pods_of(docs: list[dict]) -> list[dict]:
    """The Pods the job objects' templates become: one per PyTorchJob replica type, one per JobSet
    (or TrainingRuntime) replicated Job."""
    pods = []
    for doc in docs:
        meta = doc.get("metadata") or {}
        for role, template in _templates(doc):
            pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        **(template.get("metadata") or {}),
                        "name": f"{meta.get('name')}-{role.lower()}-0",
                        "namespace": meta.get("namespace", "default"),
                    },
                    "spec": template.get("spec") or {},
                }
            )
    return pods


def scan(sets: dict[str, list[dict]], checkov: Optional[Path] = None, timeout: float = 600) -> dict[str, list[Failure]]:
    """Failed checkov checks per named set of documents (the Pods of their PyTorchJobs included), in
    one checkov run: starting checkov costs seconds, scanning a few manifests little."""
    executable = checkov or checkov_executable()
    with tempfile.TemporaryDirectory(prefix="chart-scan-") as tmp:
        for name, docs in sets.items():
            (Path(tmp) / f"{name}.yaml").write_text(yaml.safe_dump_all(docs + pods_of(docs), sort_keys=False))
        # Offline: no platform mapping download, no package scan.
        env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
        proc = subprocess.run(
            [
                str(executable),
                "-d",
                tmp,
                "--framework",
                "kubernetes",
                "--output",
                "json",
                "--quiet",
                "--compact",
                "--skip-download",
                "--soft-fail",
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tmp,
        )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise ChartError(
            f"checkov printed no JSON report (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        ) from None
    found: dict[str, set[Failure]] = {name: set() for name in sets}
    for r in report if isinstance(report, list) else [report]:
        for check in ((r or {}).get("results") or {}).get("failed_checks", []):
            name = Path(check.get("file_path", "")).stem
            found.setdefault(name, set()).add(
                Failure(check["check_id"], check.get("check_name", ""), check.get("resource", ""))
            )
    return {name: sorted(fs, key=lambda f: (f.check_id, f.resource)) for name, fs in found.items()}
