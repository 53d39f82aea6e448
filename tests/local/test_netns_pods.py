"""Local pods as network namespaces: real namespaces, bridges and processes, nothing mocked.

Needs root: skipped otherwise, saying how to run them, and failed instead under CI. Every test must leave nothing with the prefix behind, checked
after each one; every wait is bounded by a subprocess timeout.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from dnslib import OPCODE, RCODE, DNSRecord

import resilient_fsdp
from resilient_fsdp.local.runtime.netns_pods import plumbing, run_state
from resilient_fsdp.local.runtime.netns_pods.dns import ClusterDNS
from resilient_fsdp.local.runtime.netns_pods.network import PodNetwork
from resilient_fsdp.local.runtime.netns_pods.plumbing import NetnsError, available, cleanup_stale
from tests.support import netns_required


@pytest.fixture(autouse=True)
def needs_netns():
    """Skipped where pods cannot be made (not root), with how to run them; a failure under CI."""
    netns_required()


PY = sys.executable
TRAIN_DIR = Path(resilient_fsdp.__file__).resolve().parents[1]
MASTER, WORKER = "myjob-master-0", "myjob-worker-0"
ALIASES = ["myjob-master-0.myjob.default.svc", "myjob-master-0.default.svc.cluster.local", "myjob"]
PORT = 29500  # each pod has its own port space: no clash with the host or other tests


def leftovers() -> list[str]:
    """Everything on the host that carries the prefix, plus state files and temp directories."""
    names = [n for n in plumbing.list_netns() if n.startswith(plumbing.PREFIX)]
    names += [n for n in plumbing.list_links() if n.startswith(plumbing.PREFIX)]
    if run_state.STATE_DIR.exists():
        names += [p.name for p in run_state.STATE_DIR.iterdir() if p.name != ".lock"]
    return names


@pytest.fixture(autouse=True)
def nothing_left_behind():
    assert leftovers() == [], "left by an earlier run: remove them (plumbing.cleanup_stale() does)"
    yield
    assert leftovers() == []


@pytest.fixture
def net():
    with PodNetwork() as network:
        network.add_pod(MASTER, aliases=ALIASES)
        network.add_pod(WORKER)
        yield network


def run_py(pod, code: str, timeout: float = 15, argv: tuple[str, ...] = (), **kwargs) -> str:
    """Run Python code in ``pod`` (``argv``: its ``sys.argv[1:]``); return its stdout, failing the
    test on a non-zero exit."""
    proc = pod.spawn(
        [PY, "-c", textwrap.dedent(code), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode} in {pod.hostname}:\n{out}\n{err}"
    return out


def read_line(proc: subprocess.Popen, timeout: float = 15) -> str:
    """One line of a child's stdout, or fail after ``timeout`` (never block the suite)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        pytest.fail(f"no output from {proc.args!r} within {timeout} s")
    line = proc.stdout.readline()
    assert line, f"{proc.args!r} exited before printing: {proc.wait(timeout=5)}"
    return line


def wait_exec(proc: subprocess.Popen, name: str, timeout: float = 10) -> None:
    """Wait until ``proc`` runs ``name``: past the exec chain, so it is inside its pod."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == name:
                return
        except OSError:
            pass
        time.sleep(0.01)
    pytest.fail(f"{proc.args!r} did not start {name} within {timeout} s")


def gone(pid: int) -> bool:
    return run_state.process_start(pid) is None  # exited, or a zombie


SERVER = f"""
import socket, sys
srv = socket.create_server(("0.0.0.0", {PORT}), reuse_port=True)
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        conn.sendall(conn.recv(64) + b" from " + socket.gethostname().encode())
"""

CLIENT = """
import socket, sys, time
host, port, timeout, until = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + until
while True:
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"ping")
            print("ok", s.recv(64).decode(), round(time.monotonic() - start, 2))
            break
    except OSError as exc:
        if time.monotonic() >= deadline:
            print("fail", type(exc).__name__, round(time.monotonic() - start, 2))
            break
        time.sleep(0.1)
"""


def connect(pod, host: str, timeout: float = 1.0, retry_for: float = 0.0) -> str:
    args = ["-c", CLIENT, host, str(PORT), str(timeout), str(retry_for)]
    proc = pod.spawn([PY, *args], stdout=subprocess.PIPE, text=True)
    return proc.communicate(timeout=timeout + retry_for + 15)[0].strip()


def start_server(pod) -> subprocess.Popen:
    proc = pod.spawn([PY, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert read_line(proc).strip() == "ready"
    return proc


def test_two_pods_hostnames_names_and_tcp(net):
    master, worker = net.pods[MASTER], net.pods[WORKER]
    names = [MASTER, WORKER, *ALIASES]
    probe = f"""
        import json, os, socket
        srv = socket.create_server(("localhost", 0))
        with socket.create_connection(("localhost", srv.getsockname()[1]), timeout=5) as c:
            conn, _ = srv.accept(); c.sendall(b"hi"); echoed = conn.recv(2).decode()
        print(json.dumps({{"hostname": socket.gethostname(), "pid": os.getpid(), "echoed": echoed,
                           "resolved": {{n: socket.gethostbyname(n) for n in {names!r} + ["localhost"]}}}}))
    """
    expected = {MASTER: master.ip, WORKER: worker.ip, **{a: master.ip for a in ALIASES}, "localhost": "127.0.0.1"}
    for pod in (master, worker):
        proc = pod.spawn([PY, "-c", textwrap.dedent(probe)], stdout=subprocess.PIPE, text=True)
        seen = json.loads(proc.communicate(timeout=15)[0])
        assert seen["hostname"] == pod.hostname
        assert seen["pid"] == proc.pid  # the exec chain: Popen's pid is the command itself
        assert seen["resolved"] == expected
        assert seen["echoed"] == "hi"  # localhost works inside the pod
    assert master.ip != worker.ip and all(ip.startswith(str(net.subnet)[:-4]) for ip in (master.ip, worker.ip))

    server = start_server(master)
    try:
        assert connect(worker, MASTER).startswith(f"ok ping from {MASTER}")
        assert connect(worker, ALIASES[0]).startswith(f"ok ping from {MASTER}")
    finally:
        server.kill()
        server.wait(timeout=5)

    # The host keeps no address on the bridge or the veths (the DNS server's too): it has no way
    # into the pods' /24.
    for link in [net.bridge, net.dns_veth, master.veth, worker.veth]:
        info = json.loads(plumbing.run(["ip", "-j", "addr", "show", "dev", link], "reading").stdout)
        assert info[0]["addr_info"] == [], link
    longest = [plumbing.bridge_name("zzzzzz"), plumbing.veth_name("zzzzzz", plumbing.MAX_PODS - 1)]
    assert all(len(name) <= plumbing.IFNAME_MAX for name in longest)


RESOLVER = """
import json, socket, subprocess, sys

def lookup(name):
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)})
    except socket.gaierror as exc:
        return exc.errno

def getent(name):
    out = subprocess.run(["getent", "hosts", name], capture_output=True, text=True, timeout=30)
    return out.stdout.split() if out.returncode == 0 else out.returncode

def reverse(address):
    try:
        return socket.gethostbyaddr(address)[0]
    except OSError as exc:
        return str(exc)

for line in sys.stdin:
    ask = json.loads(line)
    print(json.dumps({
        "lookup": {n: lookup(n) for n in ask["names"]},
        "getent": {n: getent(n) for n in ask["names"]},
        # What a dual-stack server such as c10d's TCPStore asks for an IPv4 peer: ::ffff:<ip>.
        "reverse": {ip: [reverse(ip), socket.getnameinfo(("::ffff:" + ip, 0), 0)[0]] for ip in ask["ips"]},
        "hosts": open("/etc/hosts").read(), "resolv": open("/etc/resolv.conf").read()}), flush=True)
"""


def test_pods_resolve_each_other_by_the_runs_dns_as_on_a_cluster(net):
    master, worker = net.pods[MASTER], net.pods[WORKER]
    fqdn = "js-w-0-0.js.default.svc.cluster.local"  # a JobSet pod's: hostname.subdomain.namespace.svc...
    store = net.add_pod("js-w-0-0", aliases=["js-w-0-0.js"], fqdn=fqdn)
    proc = worker.spawn([PY, "-c", RESOLVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(names, ips=()):
        proc.stdin.write(json.dumps({"names": names, "ips": list(ips)}) + "\n")
        proc.stdin.flush()
        return json.loads(read_line(proc, timeout=60))

    try:
        names = [MASTER, *ALIASES, "js-w-0-0.js", fqdn, WORKER, "no-such-pod", "late-store", "pypi.org"]
        seen = ask(names, [master.ip, store.ip])
        net.add_alias("late-store", store)  # while the pod runs
        late = ask(["late-store"])
    finally:
        proc.stdin.close()
        proc.wait(timeout=15)
    expected = {
        MASTER: master.ip,
        **{a: master.ip for a in ALIASES},
        "js-w-0-0.js": store.ip,
        fqdn: store.ip,
        WORKER: worker.ip,
    }
    assert {n: seen["lookup"][n] for n in expected} == {n: [ip] for n, ip in expected.items()}
    assert {n: seen["getent"][n][0] for n in expected} == expected
    # Every other name is unknown, outside names too: the server never forwards a query.
    for name in ("no-such-pod", "late-store", "pypi.org"):
        assert seen["lookup"][name] == socket.EAI_NONAME and seen["getent"][name] == 2, name
    assert late["lookup"]["late-store"] == [store.ip]
    # Reverse lookups of pod addresses, the IPv4-mapped form included: the pod's own names.
    assert seen["reverse"] == {master.ip: [MASTER, MASTER], store.ip: [fqdn, fqdn]}
    # The pod's files are a cluster pod's: a hosts file of its own names only, and the cluster DNS.
    assert seen["hosts"].endswith(f"\n{worker.ip}\t{WORKER}\n")
    assert MASTER not in seen["hosts"] and "js-w-0-0" not in seen["hosts"]
    assert store.hosts_file.read_text().endswith(f"\n{store.ip}\t{fqdn}\tjs-w-0-0\n")  # as the kubelet writes it
    resolv = [line for line in seen["resolv"].splitlines() if not line.startswith("#")]
    assert resolv == [
        "search default.svc.cluster.local svc.cluster.local cluster.local",
        f"nameserver {net.dns_address}",
        "options ndots:5",
    ]
    assert ipaddress.ip_address(net.dns_address) in net.subnet
    assert net.dns_address not in {pod.ip for pod in net.pods.values()}


def test_cluster_dns_answers_known_names_only():
    """The server alone, on this machine's loopback: what it answers for each kind of query."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    server = ClusterDNS(sock)
    port = sock.getsockname()[1]

    def query(name, qtype="A", opcode=0):
        request = DNSRecord.question(name, qtype)
        request.header.opcode = opcode
        return DNSRecord.parse(request.send("127.0.0.1", port, timeout=5))

    try:
        server.set_records({"pod-0": "10.1.2.3", "Store.Default.Svc.Cluster.Local": "10.1.2.3"}, {"10.1.2.3": "pod-0"})
        answer = query("STORE.default.svc.cluster.local.")
        assert [str(rr.rdata) for rr in answer.rr] == ["10.1.2.3"]
        assert answer.header.aa and not answer.header.ra and answer.header.rcode == RCODE.NOERROR
        assert [str(rr.rdata) for rr in query("3.2.1.10.in-addr.arpa", "PTR").rr] == ["pod-0."]
        nodata = query("pod-0", "AAAA")  # the pods have no IPv6: a known name without that record
        assert nodata.header.rcode == RCODE.NOERROR and nodata.rr == []
        for name, qtype in (("pod-1", "A"), ("example.com", "A"), ("4.2.1.10.in-addr.arpa", "PTR")):
            missing = query(name, qtype)
            assert missing.header.rcode == RCODE.NXDOMAIN and missing.rr == [], name
        assert query("pod-0", opcode=OPCODE.UPDATE).header.rcode == RCODE.NOTIMP
        server.set_records({"pod-1": "10.1.2.4"}, {})  # replaces the names at once
        assert query("pod-0").header.rcode == RCODE.NXDOMAIN
        assert [str(rr.rdata) for rr in query("pod-1").rr] == ["10.1.2.4"]
    finally:
        server.close()
    assert not server._thread.is_alive() and sock.fileno() == -1


def test_mount_with_missing_parents_creates_nothing_on_the_host(net, tmp_path):
    config, ckpt = tmp_path / "config.yaml", tmp_path / "ckpt"
    config.write_text("model: tiny\n")
    ckpt.mkdir()
    hosts_before = Path("/etc/hosts").read_bytes()
    assert not Path("/checkpoints").exists() and not Path("/etc/resilient-fsdp").exists()
    out = run_py(
        net.pods[WORKER],
        f"""
        import errno, json, os
        open("/checkpoints/from-pod", "w").write("saved")
        open({str(tmp_path / "via-root-fs")!r}, "w").write("x")  # an existing path still reaches the host
        try:
            open("/etc/resilient-fsdp/config.yaml", "w")
            ro = None
        except OSError as exc:
            ro = exc.errno
        print(json.dumps({{"cwd": os.getcwd(), "config": open("/etc/resilient-fsdp/config.yaml").read(),
                           "ro": ro, "passwd": os.path.exists("/etc/passwd"),
                           "hosts": open("/etc/hosts").read(), "proc": os.path.exists("/proc/self/ns/net")}}))
    """,
        cwd="/checkpoints",
        mounts={ckpt: "/checkpoints"},
        ro_mounts={config: "/etc/resilient-fsdp/config.yaml"},
    )
    seen = json.loads(out)
    assert seen["cwd"] == "/checkpoints"
    assert seen["config"] == "model: tiny\n"
    assert seen["ro"] == errno.EROFS
    assert seen["passwd"] and seen["proc"]
    assert f"{net.pods[WORKER].ip}\t{WORKER}\n" in seen["hosts"] and MASTER not in seen["hosts"]
    assert (ckpt / "from-pod").read_text() == "saved"
    assert (tmp_path / "via-root-fs").read_text() == "x"
    assert not Path("/checkpoints").exists() and not Path("/etc/resilient-fsdp").exists()
    assert Path("/etc/hosts").read_bytes() == hosts_before
    assert os.listdir(net.stage_dir) == []  # pods only ever mount on it in their own namespaces


def test_partition_cuts_a_pod_off_and_heals(net):
    master, worker = net.pods[MASTER], net.pods[WORKER]
    server = start_server(master)
    try:
        assert connect(worker, MASTER).startswith("ok")
        master.partition(True)
        assert master.partitioned
        t0 = time.monotonic()
        assert connect(worker, MASTER, timeout=1.0).startswith("fail")
        assert time.monotonic() - t0 < 10
        assert connect(master, MASTER).startswith("ok")  # a cut-off pod still reaches itself
        master.partition(False)
        assert connect(worker, MASTER, retry_for=5).startswith("ok")

        # By address: a cut-off pod cannot reach the cluster DNS either, and its lookup would
        # wait out the resolver's timeout, past the heal.
        timer = worker.partition_for(1.5)
        assert connect(worker, master.ip, timeout=0.5).startswith("fail")
        timer.join(timeout=5)
        assert not worker.partitioned
        assert connect(worker, MASTER, retry_for=5).startswith("ok")
    finally:
        server.kill()
        server.wait(timeout=5)


def test_a_forwarded_host_port_is_reached_from_every_pod_at_the_same_address_and_no_other(net):
    """A server on this machine's loopback (as the local S3-API server is): each pod, one added
    after the forward too, reaches it at 127.0.0.1:<port>, and a large body comes back whole; any
    other port of this machine's loopback stays out of reach; a partitioned pod is cut off from it
    too, and reaches it again once healed."""
    body = os.urandom(3 << 20)
    server = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    port, other_port = server.getsockname()[1], other.getsockname()[1]

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(body)

    threading.Thread(target=serve, daemon=True).start()
    fetch = textwrap.dedent(f"""
        import hashlib, socket, sys
        try:
            with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as s:
                s.sendall(b"get")
                got = b""
                while chunk := s.recv(1 << 16):
                    got += chunk
            print(len(got), hashlib.sha256(got).hexdigest())
        except OSError as exc:
            print("fail", type(exc).__name__)
    """)
    expected = f"{len(body)} {hashlib.sha256(body).hexdigest()}"
    try:
        relay = net.forward_host_port(port)
        late = net.add_pod("late-0")
        for pod in [*net.pods.values()]:
            assert run_py(pod, fetch, argv=(str(port),)).strip() == expected, pod.hostname
        assert relay.relayed == 3
        assert run_py(late, fetch, argv=(str(other_port),)).strip() == "fail ConnectionRefusedError"
        late.partition(True)
        assert run_py(late, fetch, argv=(str(port),)).strip().startswith("fail")
        late.partition(False)
        assert run_py(late, fetch, argv=(str(port),)).strip() == expected
    finally:
        server.close()
        other.close()


def test_kill_all_kills_the_whole_pod_and_it_can_be_recreated(net):
    master, worker = net.pods[MASTER], net.pods[WORKER]
    sleepers = [master.spawn(["sleep", "300"]) for _ in range(2)]
    for proc in sleepers:
        wait_exec(proc, "sleep")
    parent = master.spawn(
        [
            PY,
            "-c",
            textwrap.dedent("""
        import subprocess, time
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(300)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    grandchild = int(read_line(parent))
    bystander = worker.spawn(["sleep", "300"])
    wait_exec(bystander, "sleep")
    expected = {p.pid for p in sleepers} | {parent.pid, grandchild}
    assert expected <= set(master.pids())
    listed = plumbing.run(["ip", "netns", "pids", master.netns], "listing").stdout.split()
    assert sorted(map(int, listed)) == master.pids()

    killed = master.kill_all()
    assert expected <= set(killed)
    assert master.pids() == []
    assert all(gone(pid) for pid in expected)
    assert [p.returncode for p in sleepers + [parent]] == [-signal.SIGKILL] * 3
    assert bystander.poll() is None and worker.pids() == [bystander.pid]

    out = run_py(master, "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))")
    assert out.split() == [MASTER, master.ip]


def test_close_kills_removes_everything_and_is_idempotent():
    network = PodNetwork()
    pod = network.add_pod("solo-0")
    sleeper = pod.spawn(["sleep", "300"])
    wait_exec(sleeper, "sleep")
    assert {pod.netns, network.dns_netns} <= set(plumbing.list_netns())
    assert {network.bridge, network.dns_veth} <= set(plumbing.list_links())
    assert run_state.state_path(network.run_id).exists()
    server = network.dns._thread
    assert server.is_alive()
    network.close()
    assert sleeper.wait(timeout=5) == -signal.SIGKILL
    assert not server.is_alive() and network.dns.sock.fileno() == -1
    assert not run_state.state_path(network.run_id).exists() and not network.dir.exists()
    network.close()
    with pytest.raises(NetnsError, match="closed"):
        pod.spawn(["true"])


LAUNCHER = """
import json, sys, time
from resilient_fsdp.local.runtime.netns_pods.exit_cleanup import install_signal_cleanup
from resilient_fsdp.local.runtime.netns_pods.network import PodNetwork
net = PodNetwork()
if sys.argv[1] == "handlers":
    install_signal_cleanup()
pods = [net.add_pod("myjob-master-0"), net.add_pod("myjob-worker-0")]
procs = [pod.spawn(["sleep", "300"], start_new_session=True) for pod in pods]
deadline = time.monotonic() + 10  # past the exec chain: the sleeps are inside their pods
while time.monotonic() < deadline and any(open(f"/proc/{p.pid}/comm").read() != "sleep\\n" for p in procs):
    time.sleep(0.01)
print(json.dumps({"run_id": net.run_id, "subnet": str(net.subnet), "netns": [net.dns_netns] + [p.netns for p in pods],
                  "links": [net.bridge, net.dns_veth] + [p.veth for p in pods], "pids": [p.pid for p in procs]}),
      flush=True)
try:
    time.sleep(300)
except KeyboardInterrupt:
    sys.exit(130)
"""


def start_launcher(tmp_path: Path, mode: str, sigint=signal.SIG_DFL) -> tuple[subprocess.Popen, dict]:
    """The launcher script with SIGINT as given (a suite run in a shell's background inherits it ignored)."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(TRAIN_DIR)}
    proc = subprocess.Popen(
        [PY, str(script), mode],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )
    return proc, json.loads(read_line(proc))


def present(run: dict) -> list[str]:
    names = set(plumbing.list_netns()) | set(plumbing.list_links())
    return [n for n in run["netns"] + run["links"] if n in names]


def test_next_start_removes_what_a_sigkilled_launcher_left(tmp_path):
    with PodNetwork() as live:
        live_proc = live.add_pod("other-0").spawn(["sleep", "300"])
        wait_exec(live_proc, "sleep")
        # Both alive at once: each start reaps dead runs, and must leave live ones alone.
        launchers = [start_launcher(tmp_path, "plain") for _ in range(2)]
        runs = [run for _, run in launchers]
        for proc, _ in launchers:
            proc.kill()
            proc.wait(timeout=5)
        for run in runs:
            assert present(run) == run["netns"] + run["links"]  # SIGKILL: nothing could clean up
            assert not any(gone(pid) for pid in run["pids"])
        assert len({live.subnet, *(run["subnet"] for run in runs)}) == 3  # one /24 per run
        # The second run's state file is lost: only the prefix scan can find its resources.
        run_state.state_path(runs[1]["run_id"]).unlink()

        removed = cleanup_stale()

        for run in runs:
            assert present(run) == []
            assert all(gone(pid) for pid in run["pids"])
            assert set(run["netns"] + run["links"]) <= set(removed)
            assert not run_state.state_path(run["run_id"]).exists() and not run_state.run_dir(run["run_id"]).exists()
        # The live run is untouched and still works.
        assert live_proc.poll() is None
        assert run_state.state_path(live.run_id).exists()
        assert run_py(live.pods["other-0"], "import socket; print(socket.gethostname())").strip() == "other-0"
    assert live_proc.wait(timeout=5) == -signal.SIGKILL


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_signal_handlers_clean_up(tmp_path, sig, status):
    proc, run = start_launcher(tmp_path, "handlers")
    assert present(run) == run["netns"] + run["links"]
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launcher did not exit within 60 s of {signal.Signals(sig).name}")
    assert code == status
    assert present(run) == []
    assert all(gone(pid) for pid in run["pids"])
    assert not run_state.state_path(run["run_id"]).exists()


def test_an_ignored_sigint_stays_ignored_and_sigterm_still_cleans_up(tmp_path):
    proc, run = start_launcher(tmp_path, "handlers", sigint=signal.SIG_IGN)
    proc.send_signal(signal.SIGINT)
    time.sleep(1)
    assert proc.poll() is None and present(run) == run["netns"] + run["links"]  # still running, pods kept
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert present(run) == [] and all(gone(pid) for pid in run["pids"])


def test_available_and_clear_errors(net, tmp_path):
    assert available() == (True, "network namespaces, bridges and veth pairs work")
    # Another run's /24 is never handed out again, nor one the host routes or uses.
    chosen = plumbing.choose_subnet([str(net.subnet)])
    assert chosen != net.subnet and chosen.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
    assert not any(chosen.overlaps(n) for n in plumbing.host_networks())
    with pytest.raises(NetnsError, match="no-such-tool: command not found: install no-such-tool"):
        plumbing.run(["no-such-tool"], "probing")
    with pytest.raises(NetnsError, match=r"deleting: `ip link del rfnzzzzzz-br` failed: .*Cannot find device"):
        plumbing.run(["ip", "link", "del", "rfnzzzzzz-br"], "deleting")
    with pytest.raises(ValueError, match="run id"):
        PodNetwork("Bad_Id")
    with pytest.raises(ValueError, match="already taken"):
        net.add_pod(MASTER)
    with pytest.raises(NetnsError, match="does not exist on the host"):
        net.pods[MASTER].spawn(["true"], mounts={tmp_path / "missing": "/data"})
    (tmp_path / "file").write_text("x")
    proc = net.pods[MASTER].spawn(["true"], mounts={tmp_path / "file": "/tmp"}, stderr=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=15)[1].count("setup failed: cannot mount the file") == 1
    assert proc.returncode == 125
    proc = net.pods[MASTER].spawn(["no-such-command"], stderr=subprocess.PIPE, text=True)
    assert "no-such-command: command not found" in proc.communicate(timeout=15)[1] and proc.returncode == 127


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop capabilities")
def test_available_says_why_not_without_capabilities():
    # Root without CAP_NET_ADMIN/CAP_SYS_ADMIN, as in an unprivileged container.
    drop = ["--bounding-set=-net_admin,-sys_admin", "--inh-caps=-net_admin,-sys_admin"]
    code = (
        "import json; from resilient_fsdp.local.runtime.netns_pods.plumbing import available; "
        "print(json.dumps(available()))"
    )
    env = {**os.environ, "PYTHONPATH": str(TRAIN_DIR)}
    out = subprocess.run(["setpriv", *drop, PY, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    ok, reason = json.loads(out.stdout)
    assert not ok
    assert reason.startswith("creating a network namespace: ") and "CAP_NET_ADMIN" in reason, reason
