"""Linux plumbing for local pods: names, subnets, process kills, teardown, stale-run cleanup.

Every resource a run creates carries :data:`PREFIX` and the run id (:func:`bridge_name`,
:func:`veth_name`, :func:`netns_name`, :func:`dns_netns_name`); ``cleanup_stale()`` removes what
runs whose owner is gone left behind, by their state files and by a prefix scan, and nothing
without the prefix is ever touched. Only the ``ip`` (iproute2) and ``unshare`` (util-linux)
commands are used: Python 3.11 has no ``os.setns``/``os.unshare``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterable

from .run_state import owner_alive, read_states, remove_leftover_files, remove_state, run_dir, state_lock

CLONE_NEWNET = 0x40000000  # <sched.h>: setns() into a network namespace

PREFIX = "rfn"
# Where `ip netns` keeps named namespaces (a bind mount of each namespace's nsfs file).
NETNS_DIR = Path("/run/netns")
# IFNAMSIZ is 16 bytes including the terminating NUL, so an interface name holds 15 characters:
# "rfn" + a run id of up to 6 + "-v" + a pod index of up to 3 digits = 14.
IFNAME_MAX = 15
# .1 to .253 of the run's /24 are the pods'; .254 is the DNS server's; .0 and .255 are the network
# and broadcast addresses.
MAX_PODS = 253

# One /24 per run, from second octets that hosts rarely route. A run takes the first candidate
# that overlaps no host route or address and no other run's /24.
SUBNET_POOL = tuple(
    ipaddress.IPv4Network(f"10.{second}.{third}.0/24") for second in (213, 157, 89) for third in range(32)
)

HOSTNAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
ALIAS = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_LINK = re.compile(rf"^{PREFIX}([a-z0-9]{{1,6}})-(?:br|dns|v\d{{1,4}})$")
_NETNS = re.compile(rf"^{PREFIX}([a-z0-9]{{1,6}})-[a-z0-9-]{{1,63}}$")
_PACKAGES = {"ip": "iproute2", "unshare": "util-linux"}


class NetnsError(RuntimeError):
    """A namespace, link or mount operation failed; the message names what and how to fix it."""


def socket_in_netns(
    netns_path: str, address: str, port: int, kind: int = socket.SOCK_DGRAM, what: str = "a socket"
) -> socket.socket:
    """A socket of ``kind`` bound to ``address:port`` inside the network namespace at ``netns_path``
    (a TCP one listening).

    A socket belongs to the namespace it was created in, whichever thread uses it later; a thread
    of its own enters the namespace (``setns``, which for a network namespace moves only the
    calling thread) and ends there, so no other thread of this process ever leaves its own.
    ``what`` names the socket in the error.
    """
    result: dict = {}

    def make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            result["error"] = f"opening {netns_path}: {exc.strerror}"
            return
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                result["error"] = f"entering {netns_path}: {os.strerror(ctypes.get_errno())}"
                return
            sock = socket.socket(socket.AF_INET, kind)
            try:
                if kind == socket.SOCK_STREAM:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((address, port))
                if kind == socket.SOCK_STREAM:
                    sock.listen(64)
            except OSError as exc:
                sock.close()
                result["error"] = f"binding {address}:{port}: {exc.strerror}"
                return
            result["socket"] = sock
        finally:
            os.close(fd)

    thread = threading.Thread(target=make, name="netns-socket", daemon=True)
    thread.start()
    thread.join()
    if "socket" not in result:
        raise NetnsError(f"starting {what}: {result.get('error', 'no socket')}")
    return result["socket"]


def bridge_name(run_id: str) -> str:
    return f"{PREFIX}{run_id}-br"


def veth_name(run_id: str, index: int) -> str:
    # The host end; the pod end lives in the pod's namespace as eth0, never among the host's links.
    return f"{PREFIX}{run_id}-v{index}"


def netns_name(run_id: str, hostname: str) -> str:
    return f"{PREFIX}{run_id}-{hostname}"


def dns_netns_name(run_id: str) -> str:
    return f"{PREFIX}{run_id}--dns"  # no pod hostname starts with "-"


def dns_veth_name(run_id: str) -> str:
    return f"{PREFIX}{run_id}-dns"


def dns_address(subnet: ipaddress.IPv4Network) -> str:
    """The pods' name server: the last host address of the run's /24, after the pods'."""
    return str(subnet.broadcast_address - 1)


def tool(name: str) -> str:
    """Absolute path of ``ip`` or ``unshare``; sbin directories count even when PATH lacks them."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    path = shutil.which(name, path=search)
    if path is None:
        raise NetnsError(f"{name}: command not found: install {_PACKAGES.get(name, name)}")
    return path


def _hint(stderr: str) -> str:
    text = stderr.lower()
    if "operation not permitted" in text or "permission denied" in text:
        return " (needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN: a privileged container, or the host)"
    if "unknown device type" in text or "not supported" in text:
        return " (the kernel lacks bridge or veth support: modprobe bridge veth)"
    if "file exists" in text:
        return " (left by a dead run? resilient_fsdp.local.runtime.netns_pods.plumbing.cleanup_stale() removes those)"
    return ""


def run(argv: list[str], what: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a short command; if it fails, raise ``NetnsError`` naming ``what``, the command, its stderr."""
    try:
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        name = os.path.basename(argv[0])
        raise NetnsError(f"{what}: {name}: command not found: install {_PACKAGES.get(name, name)}") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{what}: `{shlex.join(argv)}` did not finish within 30 s") from None
    if check and result.returncode != 0:
        err = result.stderr.strip() or f"exit status {result.returncode}"
        raise NetnsError(f"{what}: `{shlex.join(argv)}` failed: {err}{_hint(err)}")
    return result


def list_netns() -> list[str]:
    """Names of ``ip netns`` namespaces (what ``ip netns list`` prints, without a process)."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def list_links() -> list[str]:
    """Names of the host's network interfaces."""
    out = run([tool("ip"), "-j", "link", "show"], "listing network interfaces").stdout
    return [link["ifname"] for link in json.loads(out or "[]")]


# --- Subnets ----------------------------------------------------------------------------------


def host_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks this host already uses: routes in every table, addresses, DNS servers."""
    ip = tool("ip")
    nets: list[ipaddress.IPv4Network] = []
    out = run([ip, "-4", "-j", "route", "show", "table", "all"], "reading the host's routes").stdout
    routes = json.loads(out or "[]")
    for route in routes:
        try:
            net = ipaddress.ip_network(route.get("dst", ""), strict=False)
        except ValueError:  # "default", or a type keyword
            continue
        # Catch-all routes (a default route, a VPN's 0/1 + 128/1) overlap everything; they say
        # nothing about which block is in use.
        if isinstance(net, ipaddress.IPv4Network) and net.prefixlen >= 8:
            nets.append(net)
    links = json.loads(run([ip, "-4", "-j", "addr", "show"], "reading the host's addresses").stdout or "[]")
    for link in links:
        for addr in link.get("addr_info", []):
            if addr.get("family") == "inet":
                nets.append(ipaddress.IPv4Interface(f"{addr['local']}/{addr['prefixlen']}").network)
    # A pod subnet holding the resolver's address would send the pods' DNS queries to a pod.
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.IPv4Network(parts[1]))
    return nets


def choose_subnet(taken: Iterable[str]) -> ipaddress.IPv4Network:
    """The first /24 of ``SUBNET_POOL`` that overlaps nothing on the host and no run in ``taken``."""
    used = host_networks() + [ipaddress.IPv4Network(t) for t in taken]
    for candidate in SUBNET_POOL:
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise NetnsError(
        f"no free /24 for local pods: all {len(SUBNET_POOL)} candidates in 10.213/16, 10.157/16 and "
        "10.89/16 overlap a host route or address or another run; stop other local runs or remove "
        "the overlapping route"
    )


# --- Processes --------------------------------------------------------------------------------


def pids_in_netns(names: Iterable[str]) -> list[int]:
    """Processes whose network namespace is one of ``names`` (``ip netns pids``, in one /proc pass)."""
    keys = set()
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(NETNS_DIR / name)
            keys.add((st.st_dev, st.st_ino))
    if not keys:
        return []
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:  # exited, or a zombie: its namespaces are already released
            continue
        if (st.st_dev, st.st_ino) in keys:
            pids.append(int(entry.name))
    return sorted(pids)


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_netns_processes(names: Iterable[str], timeout: float = 5.0) -> list[int]:
    """SIGSTOP every process in the namespaces ``names``, repeated until a scan finds no new pid (a
    process forked meanwhile is stopped too); return the pids stopped."""
    names = list(names)
    deadline = time.monotonic() + timeout
    signalled: set[int] = set()
    while (new := set(pids_in_netns(names)) - signalled) and time.monotonic() < deadline:
        _signal_all(new, signal.SIGSTOP)
        signalled |= new
    return sorted(signalled)


def kill_netns_processes(names: Iterable[str], sig: int = signal.SIGKILL, timeout: float = 5.0) -> list[int]:
    """Signal every process in the namespaces ``names``; return the pids signalled.

    For SIGKILL everything is first stopped (SIGSTOP, repeated until a scan finds no new pid), so
    no process can fork or react to another's death, then killed, and the call waits until the
    namespaces hold no process. Another signal is sent once to each process found.
    """
    names = list(names)
    if sig != signal.SIGKILL:
        pids = pids_in_netns(names)
        _signal_all(pids, sig)
        return pids
    deadline = time.monotonic() + timeout
    signalled = set(stop_netns_processes(names, timeout))
    while pids := pids_in_netns(names):
        _signal_all(pids, signal.SIGKILL)
        signalled.update(pids)
        if time.monotonic() > deadline:
            raise NetnsError(
                f"processes {pids} in {', '.join(names)} outlived SIGKILL for {timeout:.0f} s "
                "(stuck in the kernel, state D?)"
            )
        time.sleep(0.005)
    return sorted(signalled)


# --- Teardown and stale runs ------------------------------------------------------------------


def teardown(run_id: str, ns_names: Iterable[str], link_names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Remove one run's resources; missing ones are skipped. Returns (removed, still present).

    Order matters: processes first (a namespace with a process in it outlives ``ip netns del``,
    and keeps its veth pair), then the veths (deleting one end deletes both, at once, even when the
    namespace lingers because some other mount namespace still holds a reference to it), then the
    namespaces, then the bridge, then the temp directory. Names that do not carry this run's
    prefix are ignored, whatever a state file says.
    """
    ns_names = [n for n in ns_names if (m := _NETNS.match(n)) and m.group(1) == run_id]
    link_names = [n for n in link_names if (m := _LINK.match(n)) and m.group(1) == run_id]
    problems: list[str] = []
    try:
        kill_netns_processes(ns_names)
    except NetnsError as exc:
        problems.append(str(exc))
    present_ns, present_links = set(list_netns()), set(list_links())
    veths = [n for n in link_names if n in present_links and not n.endswith("-br")]
    bridges = [n for n in link_names if n in present_links and n.endswith("-br")]
    namespaces = [n for n in ns_names if n in present_ns]
    commands = [f"link del {n}" for n in veths] + [f"netns del {n}" for n in namespaces]
    commands += [f"link del {n}" for n in bridges]
    if commands:
        # -force: carry on past a line that fails (e.g. a veth gone with its namespace).
        script = "\n".join(commands) + "\n"
        run([tool("ip"), "-force", "-batch", "-"], f"removing run {run_id}", stdin=script, check=False)
    shutil.rmtree(run_dir(run_id), ignore_errors=True)
    left = set(list_netns()) & set(namespaces) | set(list_links()) & set(veths + bridges)
    if left:
        problems.append(f"could not remove {', '.join(sorted(left))}")
    removed = sorted(set(veths + bridges + namespaces) - left)
    return removed, problems


def cleanup_stale(locked: bool = False) -> list[str]:
    """Remove everything left by local runs whose launcher is gone; return the names removed.

    Runs whose owner lives are never touched. Dead runs are removed by the names their state file
    records, then a prefix scan of ``ip netns list`` and ``ip -j link`` removes anything else
    carrying the prefix whose run id has no live owner (e.g. a state file lost or unreadable).

    Args:
        locked: the caller already holds ``state_lock()``.
    """
    if not locked:
        with state_lock():
            return cleanup_stale(locked=True)
    removed: list[str] = []
    states = read_states()
    live = {run_id for run_id, state in states.items() if owner_alive(state)}
    for run_id, state in states.items():
        if run_id not in live:
            names, _ = teardown(run_id, state.get("netns", []), state.get("links", []))
            removed += names
            remove_state(run_id)
    orphans: dict[str, tuple[list[str], list[str]]] = {}
    for name in list_netns():
        if (m := _NETNS.match(name)) and m.group(1) not in live:
            orphans.setdefault(m.group(1), ([], []))[0].append(name)
    for name in list_links():
        if (m := _LINK.match(name)) and m.group(1) not in live:
            orphans.setdefault(m.group(1), ([], []))[1].append(name)
    for run_id, (netns, links) in orphans.items():
        names, _ = teardown(run_id, netns, links)
        removed += names
    remove_leftover_files(live)
    return removed


def leaked() -> list[str]:
    """Namespaces, veth pairs and bridges carrying the prefix whose run has no live owner: what
    finished runs left behind (``cleanup_stale`` removes them). Runs still going are not listed."""
    if not NETNS_DIR.exists() and os.geteuid() != 0:
        return []
    live = {run_id for run_id, state in read_states().items() if owner_alive(state)}
    names = [(n, _NETNS.match(n)) for n in list_netns()] + [(n, _LINK.match(n)) for n in list_links()]
    return sorted(n for n, m in names if m and m.group(1) not in live)


def available() -> tuple[bool, str]:
    """Whether local pods can be made here, and if not, why (one line for the loopback fallback).

    Needs root, ``ip`` and ``unshare``, and a kernel that creates a namespace, a bridge and a
    veth pair and lets ``ip netns exec`` + ``unshare --uts --mount`` enter them: all tried, on
    throwaway resources that are removed again.
    """
    if os.geteuid() != 0:
        return False, "not root: network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN"
    try:
        ip, unshare = tool("ip"), tool("unshare")
        run_id = "p" + secrets.token_hex(2)
        ns, bridge, veth = netns_name(run_id, "probe"), bridge_name(run_id), veth_name(run_id, 0)
        # Under the lock, so a concurrent cleanup_stale() cannot take the probe for a dead run's.
        with state_lock():
            try:
                run([ip, "netns", "add", ns], "creating a network namespace")
                run([ip, "link", "add", bridge, "type", "bridge"], "creating a bridge")
                run(
                    [ip, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
                    "creating a veth pair",
                )
                enter = [ip, "netns", "exec", ns, unshare, "--uts", "--mount", "--propagation", "private", "true"]
                run(enter, "entering a network namespace")
            finally:
                teardown(run_id, [ns], [veth, bridge])
    except (NetnsError, OSError) as exc:
        return False, str(exc)
    return True, "network namespaces, bridges and veth pairs work"
