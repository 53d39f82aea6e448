"""Taint the node this pod runs on, so that the job's next pod is not scheduled there.

A node whose NVRx health checks fail makes its pod exit :data:`.exit_codes.UNHEALTHY_NODE`, and
nothing in a PyTorchJob, Job or JobSet moves the replacement off that node. With the chart's
``pod.taintUnhealthyNode.enabled`` the node agent calls :func:`taint_node` before it exits: a GET
of the node and a merge patch of its taints through the API server, with the pod's
service-account token. Standard library only: the agent runs before anything heavy is imported.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Where the token and the CA are, when not at the path every pod has (tests point it elsewhere).
SERVICE_ACCOUNT_ENV = "RESILIENT_FSDP_SERVICE_ACCOUNT_DIR"
NODE_NAME_ENV = "NODE_NAME"  # the chart sets it from the downward API (spec.nodeName)
TIMEOUT_S = 10.0
ATTEMPTS = 3


class TaintError(Exception):
    """The node could not be tainted; the message says why and what to do instead."""


def _value(reason: str) -> str:
    """A taint value: a label value (63 characters of ``[A-Za-z0-9._-]``, alphanumeric at the ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", reason).strip("-._")[:63].rstrip("-._")
    return value or "unhealthy"


def _request(
    method: str,
    url: str,
    token: str,
    context: ssl.SSLContext,
    body: Optional[dict] = None,
    content_type: str = "application/json",
) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Accept": "application/json", "Content-Type": content_type},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
        return json.loads(response.read() or b"{}")


def taint_node(key: str, reason: str, node: Optional[str] = None, env: Optional[dict] = None) -> str:
    """Add ``key=<reason>:NoSchedule`` to this pod's node (``node``, else ``$NODE_NAME``); what was
    done, or :class:`TaintError` saying why it could not be.

    The merge patch carries the node's ``resourceVersion``, so a concurrent change (another taint, a
    cordon) is never overwritten: a conflict reads the node again. The scheduler, and Kueue's
    topology-aware placement, then leave the node out; pods already running there stay. The chart's
    ClusterRole grants ``get`` and ``patch`` on nodes.
    """
    env = dict(os.environ if env is None else env)
    node = node or env.get(NODE_NAME_ENV)
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not node or not host:
        raise TaintError(f"not in a pod that knows its node ({NODE_NAME_ENV} and KUBERNETES_SERVICE_HOST unset)")
    where = Path(env.get(SERVICE_ACCOUNT_ENV) or SERVICE_ACCOUNT_DIR)
    try:
        token = (where / "token").read_text().strip()
        context = ssl.create_default_context(cafile=str(where / "ca.crt"))
    except (OSError, ssl.SSLError) as exc:
        raise TaintError(
            f"no service-account token at {where} ({exc}): the chart mounts it with pod.taintUnhealthyNode.enabled"
        ) from None
    url = f"https://{host}:{port}/api/v1/nodes/{node}"
    taint = {"key": key, "value": _value(reason), "effect": "NoSchedule"}
    try:
        for _ in range(ATTEMPTS):
            current = _request("GET", url, token, context)
            taints = (current.get("spec") or {}).get("taints") or []
            if any(t.get("key") == key and t.get("effect") == "NoSchedule" for t in taints):
                return f"node {node} already has the taint {key}:NoSchedule"
            patch = {
                "metadata": {"resourceVersion": (current.get("metadata") or {}).get("resourceVersion")},
                "spec": {"taints": [*taints, taint]},
            }
            try:
                _request("PATCH", url, token, context, patch, "application/merge-patch+json")
            except urllib.error.HTTPError as exc:
                if exc.code == 409:  # the node changed since the GET: read it again
                    continue
                raise
            return f"tainted node {node} {key}={taint['value']}:NoSchedule"
        raise TaintError(f"node {node} kept changing under {ATTEMPTS} attempts to patch it")
    except urllib.error.HTTPError as exc:
        fix = (
            " (the pods' service account needs get and patch on nodes: pod.taintUnhealthyNode.enabled creates "
            "the ClusterRole)"
            if exc.code in (401, 403)
            else ""
        )
        raise TaintError(f"the API server answered {exc.code} {exc.reason} for node {node}{fix}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TaintError(f"the API server at {host}:{port} could not be reached ({exc})") from None
