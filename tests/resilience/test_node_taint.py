"""A node NVRx finds unhealthy is tainted by its agent before the pod exits 201
(resilience/node_taint.py, ``pod.taintUnhealthyNode``).

No Kubernetes control plane can exist here: the API server is a stand-in, an HTTPS server on
loopback with a certificate the test makes, that keeps one Node object and answers the two
requests the agent makes (GET, and a merge patch that carries the node's ``resourceVersion``)
as the API server does, 409 on a stale version included. The agent, ``ft_launcher`` and NVRx's
health check (``NVRX_INJECT_GPU_FAILURE``, its own failure injection) are real processes."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from resilient_fsdp.resilience import exit_codes, node_taint

KEY = "resilient-fsdp.io/unhealthy-node"


def _certificate(directory):
    """A self-signed certificate for 127.0.0.1: its PEM files (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "ca.crt", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


class StandInApiServer:
    """One Node, ``nodes/<name>`` GET and merge-patch, bearer token checked, ``resourceVersion``
    enforced; ``conflicts``: how many patches to answer 409 (as if the node changed meanwhile);
    ``forbid``: answer 403 to every request."""

    def __init__(self, directory, node: str, token: str = "tok3n"):
        self.node, self.token = node, token
        self.taints = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
        self.version, self.conflicts, self.forbid = 7, 0, False
        self.requests: list[tuple[str, str, dict]] = []
        cert, key = _certificate(directory)
        self.account = directory
        (directory / "token").write_text(token + "\n")
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _allowed(self) -> bool:
                if self.path != f"/api/v1/nodes/{server.node}":
                    self._answer(404, {"kind": "Status", "code": 404})
                    return False
                if server.forbid or self.headers.get("Authorization") != f"Bearer {server.token}":
                    self._answer(403, {"kind": "Status", "code": 403})
                    return False
                return True

            def do_GET(self):
                server.requests.append(("GET", self.path, {}))
                if self._allowed():
                    self._answer(200, server.object())

            def do_PATCH(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(("PATCH", self.path, {"content_type": self.headers["Content-Type"], **body}))
                if not self._allowed():
                    return
                if server.conflicts:
                    server.conflicts -= 1
                    server.version += 1  # someone else changed the node
                if body["metadata"]["resourceVersion"] != str(server.version):
                    self._answer(409, {"kind": "Status", "code": 409, "reason": "Conflict"})
                    return
                server.taints = body["spec"]["taints"]
                server.version += 1
                self._answer(200, server.object())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def object(self) -> dict:
        return {
            "kind": "Node",
            "metadata": {"name": self.node, "resourceVersion": str(self.version)},
            "spec": {"taints": self.taints},
        }

    def env(self) -> dict:
        return {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.httpd.server_port),
            node_taint.NODE_NAME_ENV: self.node,
            node_taint.SERVICE_ACCOUNT_ENV: str(self.account),
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def api(tmp_path):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    server = StandInApiServer(account, "ip-10-1-2-3.us-west-2.compute.internal")
    yield server
    server.close()


def test_the_node_is_tainted_once_beside_its_own_taints(api):
    done = node_taint.taint_node(KEY, "Node n0 has an unhealthy GPU.", env=api.env())
    assert done == f"tainted node {api.node} {KEY}=Node-n0-has-an-unhealthy-GPU:NoSchedule"
    assert api.taints == [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": KEY, "value": "Node-n0-has-an-unhealthy-GPU", "effect": "NoSchedule"},
    ]
    patch = next(r for r in api.requests if r[0] == "PATCH")[2]
    assert patch["content_type"] == "application/merge-patch+json" and patch["metadata"]["resourceVersion"] == "7"
    again = node_taint.taint_node(KEY, "again", env=api.env())
    assert again == f"node {api.node} already has the taint {KEY}:NoSchedule"
    assert len(api.taints) == 2


def test_a_node_that_changed_meanwhile_is_read_again_and_nothing_is_overwritten(api):
    api.conflicts = 1
    node_taint.taint_node(KEY, "gpu", env=api.env())
    assert [r[0] for r in api.requests] == ["GET", "PATCH", "GET", "PATCH"]
    assert [t["key"] for t in api.taints] == ["nvidia.com/gpu", KEY]


def test_without_permission_the_error_names_the_chart_value(api):
    api.forbid = True
    with pytest.raises(node_taint.TaintError, match="403.*pod.taintUnhealthyNode.enabled creates the ClusterRole"):
        node_taint.taint_node(KEY, "gpu", env=api.env())


def test_outside_a_pod_nothing_is_attempted():
    with pytest.raises(node_taint.TaintError, match="NODE_NAME and KUBERNETES_SERVICE_HOST unset"):
        node_taint.taint_node(KEY, "gpu", env={})


def test_an_unhealthy_nodes_agent_taints_its_node_then_exits_201(api, tmp_path, nvrx07_lane):
    """Real processes: the node agent runs NVRx 0.7's ft_launcher, whose node health check fails
    (NVRx's own injection standing in for a failed GPU); the agent taints its node through the
    stand-in API server, says so, and exits 201 with it in the termination message."""
    from tests.resilience.node import AGENT, free_port
    from tests.support import run_guarded

    message = tmp_path / "termination-log"
    message.write_text("")
    cmd = [
        *AGENT,
        "--rejoin-timeout=30",
        f"--taint-unhealthy-node={KEY}",
        "--",
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=taint",
        "--rdzv-conf=is_host=true",
        "--max-restarts=0",
        "-m",
        "resilient_fsdp.train",
        "--describe-config",
    ]
    env = {
        "JOB_COMPLETION_INDEX": "0",
        "NVRX_INJECT_GPU_FAILURE": "0:0",
        exit_codes.TERMINATION_LOG_ENV: str(message),
        **api.env(),
    }
    proc = run_guarded(cmd, tmp_path, [nvrx07_lane], 120, env)
    assert proc.returncode == exit_codes.UNHEALTHY_NODE, proc.stderr[-3000:]
    assert [t["key"] for t in api.taints] == ["nvidia.com/gpu", KEY], api.requests
    agent = [line for line in proc.stderr.splitlines() if line.startswith("[resilient-fsdp agent]")]
    assert any(
        f"tainted node {api.node} {KEY}=" in line and "so that the recreated pod lands elsewhere" in line
        for line in agent
    ), agent
    assert f"tainted node {api.node}" in message.read_text()


def test_the_agent_takes_a_taint_key_and_refuses_one_that_is_not():
    from resilient_fsdp.resilience.agent import parse_agent_args

    flags, rest = parse_agent_args([f"--taint-unhealthy-node={KEY}", "--", "--nnodes=1"])
    assert flags == {"--taint-unhealthy-node": KEY} and rest == ["--nnodes=1"]
    with pytest.raises(ValueError, match="a taint key such as resilient-fsdp.io/unhealthy-node"):
        parse_agent_args(["--taint-unhealthy-node=not a key", "--"])
