"""Kubernetes pods simulated on one machine: ``PodNetwork`` (one local run) and its ``NetnsPod``s.

A ``PodNetwork`` owns a Linux bridge and, per pod, a network namespace joined to it by a veth
pair, with an address in the run's own /24; nothing forwards or NATs, so pods reach each other
and nothing else, except a host port relayed into every pod (``forward_host_port``). Names
resolve as on a cluster: the run's name server (:mod:`.dns`), a pod's search path and the
kubelet's ``/etc/hosts``. Each process a pod runs gets its own UTS and mount namespaces
(:mod:`.podinit`). Names and stale-run cleanup are in :mod:`.plumbing`, state files in
``run_state``, cleanup at exit in ``exit_cleanup``. The netns runtime uses it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from . import exit_cleanup, plumbing, run_state
from .host_ports import HostPort
from .plumbing import NetnsError

if TYPE_CHECKING:
    from .dns import ClusterDNS

PODINIT = Path(__file__).with_name("podinit.py")


class NetnsPod:
    """One simulated pod: a network namespace with an address, a hostname, and its processes."""

    def __init__(self, network: PodNetwork, hostname: str, index: int, ip: str, fqdn: str | None = None):
        self.network = network
        self.hostname = hostname
        self.fqdn = fqdn
        """The name the kubelet writes beside the hostname for a pod with a subdomain, or None."""
        self.index = index
        self.ip = ip
        self.netns = plumbing.netns_name(network.run_id, hostname)
        self.veth = plumbing.veth_name(network.run_id, index)  # the host end, on the bridge
        self._procs: list[subprocess.Popen] = []
        self._partitioned = False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NetnsPod({self.hostname!r}, ip={self.ip!r}, netns={self.netns!r})"

    @property
    def hosts_file(self) -> Path:
        """The pod's /etc/hosts on the host."""
        return self.network.dir / "hosts" / self.hostname

    def _write_hosts(self) -> None:
        # As the kubelet writes it: localhost, then the pod's address with its own names only.
        own = f"{self.fqdn}\t{self.hostname}" if self.fqdn else self.hostname
        text = (
            f"# Kubernetes-managed hosts file (resilient-fsdp local run {self.network.run_id}).\n"
            "127.0.0.1\tlocalhost\n"
            "::1\tlocalhost ip6-localhost ip6-loopback\n"
            "fe00::0\tip6-localnet\n"
            "fe00::0\tip6-mcastprefix\n"
            "fe00::1\tip6-allnodes\n"
            "fe00::2\tip6-allrouters\n"
            f"{self.ip}\t{own}\n"
        )
        self.hosts_file.parent.mkdir(mode=0o755, exist_ok=True)
        self.hosts_file.write_text(text)

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        mounts: Mapping[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
        ro_mounts: Mapping[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
        tmpfs: Mapping[str | os.PathLike[str], str] | None = None,
        security: Mapping | None = None,
        nofile: tuple[int, int] | None = None,
        inits: Sequence[Mapping] = (),
        traverse: Sequence[str] = (),
        stdin=None,
        stdout=None,
        stderr=None,
        start_new_session: bool = False,
        **popen_kwargs,
    ) -> subprocess.Popen:
        """Start ``argv`` inside the pod; the returned Popen's pid is the command's own pid.

        Args:
            argv: the command and its arguments (looked up on PATH inside the pod).
            env: its environment (default: this process's).
            cwd: its working directory as the pod sees it (may be a mount target).
            mounts: host path (file or directory) -> absolute pod path, read-write.
            ro_mounts: the same, read-only (ConfigMaps). A pod path whose parents do not exist is
                made on a tmpfs private to the process; nothing is created on the host.
            tmpfs: absolute pod path -> tmpfs mount options (``"size=1073741824,mode=1777"``): a
                memory-backed directory of its own (an ``emptyDir`` with ``medium: Memory``).
            security: what the process runs as, applied after the mounts
                (:meth:`resilient_fsdp.local.manifests.security.Security.podinit`); None: as this process.
            nofile: its ``RLIMIT_NOFILE`` (soft, hard); None: this process's.
            inits: init containers, run to completion in order before ``argv``, each in a mount
                namespace of its own: ``name``, ``argv``, ``env``, ``mounts``, ``ro_mounts``,
                ``tmpfs`` and ``security`` as above. A failing one ends the pod with its status.
            traverse: directories every user gets search permission on in the pod (the way to
                this machine's interpreter for a non-root user).
            stdin, stdout, stderr, start_new_session, popen_kwargs: as for ``subprocess.Popen``.

        Setup failures inside the pod (a mount) exit with status 125 and a line on stderr.
        """
        self.network._check_open()
        if isinstance(argv, (str, bytes)) or not argv:
            raise TypeError("argv must be a non-empty sequence of strings")
        if "args" in popen_kwargs or "executable" in popen_kwargs:
            raise TypeError("spawn() takes the command as argv only")
        spec = {
            "hostname": self.hostname,
            "mounts": self._mount_specs(mounts, ro_mounts, tmpfs),
            "stage": str(self.network.stage_dir),
            "cwd": os.path.abspath(cwd) if cwd is not None else None,
            "security": dict(security) if security else None,
            "nofile": list(nofile) if nofile else None,
            "traverse": [str(p) for p in traverse],
            "inits": [
                {
                    "name": i["name"],
                    "argv": [str(a) for a in i["argv"]],
                    "env": dict(i["env"]),
                    "mounts": self._mount_specs(i.get("mounts"), i.get("ro_mounts"), i.get("tmpfs")),
                    "security": dict(i["security"]),
                }
                for i in inits
            ],
        }
        tools = self.network.tools
        command = [
            tools["ip"],
            "netns",
            "exec",
            self.netns,
            tools["unshare"],
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "--",
            sys.executable or "python3",
            "-I",
            "-S",
            str(PODINIT),
            json.dumps(spec, separators=(",", ":")),
            "--",
            *map(str, argv),
        ]
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=start_new_session,
            **popen_kwargs,
        )
        self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        return proc

    def _mount_specs(self, mounts, ro_mounts, tmpfs) -> list[dict]:
        """One container's mounts as podinit reads them: the kubelet's /etc/hosts and
        /etc/resolv.conf, then its volumes."""
        specs = [
            {"source": str(self.hosts_file), "target": "/etc/hosts", "ro": True},
            {"source": str(self.network.resolv_conf), "target": "/etc/resolv.conf", "ro": True},
        ]
        for table, ro in ((mounts or {}, False), (ro_mounts or {}, True)):
            for host_path, pod_path in table.items():
                specs.append({"source": _source(host_path), "target": _target(pod_path), "ro": ro})
        for pod_path, options in (tmpfs or {}).items():
            specs.append({"tmpfs": str(options), "target": _target(pod_path), "ro": False})
        targets = [s["target"] for s in specs]
        if len(set(targets)) != len(targets):
            raise ValueError(
                f"two mounts share a pod path (or one replaces /etc/hosts or /etc/resolv.conf): {sorted(targets)}"
            )
        return specs

    def pids(self) -> list[int]:
        """Every process now in the pod's network namespace."""
        return plumbing.pids_in_netns([self.netns])

    def kill_all(self, sig: int = signal.SIGKILL, timeout: float = 5.0) -> list[int]:
        """Signal every process in the pod at once (a lost node for SIGKILL); return their pids.

        With SIGKILL it returns once the pod holds no process; the pod itself stays, and
        ``spawn`` can start its processes again (a recreated pod: same address and hostname).
        """
        pids = plumbing.kill_netns_processes([self.netns], sig, timeout)
        for proc in self._procs:  # reap our own children, so they do not linger as zombies
            proc.poll()
        return pids

    def freeze(self) -> list[int]:
        """Stop the pod as a node that stops reporting does: its link down, every process stopped
        (SIGSTOP), no connection closed; return the pids stopped. ``kill_all`` ends it."""
        self.partition(True)
        return plumbing.stop_netns_processes([self.netns])

    @property
    def partitioned(self) -> bool:
        return self._partitioned

    def partition(self, on: bool = True) -> None:
        """Cut the pod off from the other pods (``on``) or reconnect it.

        Takes the host end of the veth down: the pod keeps its address and its loopback, but its
        eth0 loses carrier and every packet to or from the other pods is dropped, so connections
        time out or find no route, as across a real partition. Cancels a pending ``partition_for``.
        """
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._set_link(on)

    def partition_for(self, seconds: float) -> threading.Timer:
        """Cut the pod off now and reconnect it after ``seconds`` (in a daemon timer thread)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._set_link(True)
            self._timer = threading.Timer(seconds, self._heal)
            self._timer.daemon = True
            self._timer.start()
            return self._timer

    def _heal(self) -> None:
        with self._lock:
            self._timer = None
            if not self.network.closed:
                self._set_link(False)

    def _set_link(self, down: bool) -> None:
        state = "down" if down else "up"
        what = f"{'cutting off' if down else 'reconnecting'} pod {self.hostname}"
        plumbing.run([self.network.tools["ip"], "link", "set", self.veth, state], what)
        self._partitioned = down

    def _stop_timer(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


class PodNetwork:
    """The pods of one local run: a bridge, a /24, and per pod a network namespace.

    Args:
        run_id: up to 6 of ``[a-z0-9]``; random when omitted. All names carry it.
        namespace: the Kubernetes namespace the pods are in: their DNS search path.
        reap_stale: first remove what dead runs left behind (``plumbing.cleanup_stale``); the names
            removed are in ``stale_removed``.

    Raises:
        NetnsError: naming the failed step and its fix; nothing is left behind then.

    Typical use::

        cleanup_stale()                      # done by PodNetwork() too, unless reap_stale=False
        with PodNetwork() as net:
            restore = exit_cleanup.install_signal_cleanup([net])
            master = net.add_pod("myjob-master-0", aliases=["myjob-master-0.myjob.default.svc"])
            worker = net.add_pod("myjob-worker-0")
            proc = master.spawn(["python", "-m", "resilient_fsdp.train"], ro_mounts={cfg: "/etc/app/config.yaml"})
            worker.kill_all()                # node loss
            worker.partition_for(30)         # network partition
    """

    def __init__(self, run_id: str | None = None, *, namespace: str = "default", reap_stale: bool = True):
        self.run_id = run_id or run_state.new_run_id()
        if not run_state.RUN_ID.match(self.run_id):
            raise ValueError(f"run id {self.run_id!r}: use 1 to 6 characters of a-z and 0-9")
        if not plumbing.HOSTNAME.match(namespace):
            raise ValueError(f"namespace {namespace!r}: use a DNS label (a-z, 0-9, '-', at most 63)")
        self.namespace = namespace
        self.tools = {"ip": plumbing.tool("ip"), "unshare": plumbing.tool("unshare")}
        self.bridge = plumbing.bridge_name(self.run_id)
        self.dns_netns = plumbing.dns_netns_name(self.run_id)
        self.dns_veth = plumbing.dns_veth_name(self.run_id)
        self.dns: ClusterDNS | None = None
        self.dir = run_state.run_dir(self.run_id)
        self.resolv_conf = self.dir / "resolv.conf"
        self.stage_dir = self.dir / "stage"
        self.pods: dict[str, NetnsPod] = {}
        self.aliases: dict[str, str] = {}  # alias -> pod hostname
        self.stale_removed: list[str] = []
        self.host_ports: dict[int, HostPort] = {}
        self._owner = os.getpid()
        self._closed = False
        with run_state.state_lock():
            if reap_stale:
                self.stale_removed = plumbing.cleanup_stale(locked=True)
            states = run_state.read_states()
            mine = f"{plumbing.PREFIX}{self.run_id}-"
            if self.run_id in states or any(n.startswith(mine) for n in plumbing.list_netns() + plumbing.list_links()):
                raise NetnsError(f"run id {self.run_id} is in use by another local run; pick another")
            self.subnet = plumbing.choose_subnet(s["subnet"] for s in states.values() if s.get("subnet"))
            self.dns_address = plumbing.dns_address(self.subnet)
            self._save_state()  # recorded before anything exists, so a crash from here on is found
        exit_cleanup.register(self)
        try:
            self.dir.mkdir(mode=0o755)
            self.stage_dir.mkdir(mode=0o755)
            # addrgenmode none: no IPv6 link-local address either, so the host has no address
            # at all on the bridge and sends nothing (router solicitations, MLD) to the pods.
            plumbing.run(
                [self.tools["ip"], "-batch", "-"],
                f"creating bridge {self.bridge}",
                stdin=(
                    f"link add {self.bridge} type bridge\n"
                    f"link set {self.bridge} addrgenmode none\n"
                    f"link set {self.bridge} up\n"
                ),
            )
            self._start_dns()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> PodNetwork:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PodNetwork(run_id={self.run_id!r}, subnet={str(self.subnet)!r}, pods={list(self.pods)})"

    @property
    def closed(self) -> bool:
        return self._closed

    def add_pod(self, hostname: str, aliases: Iterable[str] = (), fqdn: str | None = None) -> NetnsPod:
        """Create a pod: its namespace, veth pair, loopback and address; resolvable by all pods.

        Args:
            hostname: the Kubernetes pod hostname, a DNS label (``myjob-worker-0``).
            aliases: more names for its address (a Service, ``<pod>.<svc>.<ns>.svc``, ...), which
                the other pods resolve by DNS.
            fqdn: for a pod with a subdomain, ``<hostname>.<subdomain>.<ns>.svc.cluster.local``:
                in its own hosts file beside the hostname (as the kubelet writes it), resolvable
                by all pods, and what the reverse lookup of its address gives (else the hostname).
        """
        self._check_open()
        aliases = list(aliases)
        if fqdn is not None and fqdn not in aliases:
            aliases.append(fqdn)
        if not plumbing.HOSTNAME.match(hostname):
            raise ValueError(f"pod hostname {hostname!r}: use a DNS label (a-z, 0-9, '-', at most 63)")
        self._check_new_names([hostname, *aliases])
        index = len(self.pods)
        if index >= plumbing.MAX_PODS:
            raise NetnsError(f"a local run holds at most {plumbing.MAX_PODS} pods (one /24 with its DNS server)")
        pod = NetnsPod(self, hostname, index, str(self.subnet.network_address + 1 + index), fqdn)
        self.pods[hostname] = pod
        self.aliases.update((alias, hostname) for alias in aliases)
        self._save_state()
        ip = self.tools["ip"]
        try:
            # The pod end is created inside the namespace, so "eth0" never clashes with the host's.
            plumbing.run(
                [ip, "-batch", "-"],
                f"creating pod {hostname}",
                stdin=(
                    f"netns add {pod.netns}\n"
                    f"link add {pod.veth} type veth peer name eth0 netns {pod.netns}\n"
                    f"link set {pod.veth} master {self.bridge} addrgenmode none up\n"
                ),
            )
            plumbing.run(
                [ip, "-n", pod.netns, "-batch", "-"],
                f"configuring pod {hostname}",
                stdin=(
                    "link set lo up\n"
                    "link set eth0 addrgenmode none\n"
                    f"addr add {pod.ip}/{self.subnet.prefixlen} dev eth0\n"
                    "link set eth0 up\n"
                ),
            )
        except BaseException:
            plumbing.teardown(self.run_id, [pod.netns], [pod.veth])
            del self.pods[hostname]
            self.aliases = {a: h for a, h in self.aliases.items() if h != hostname}
            self._save_state()
            raise
        pod._write_hosts()
        self._publish_names()
        for relay in self.host_ports.values():
            relay.add(pod)
        return pod

    def forward_host_port(self, port: int) -> HostPort:
        """Make ``127.0.0.1:port`` of this machine reachable at the same address in every pod, those
        added later too (:mod:`.host_ports`)."""
        self._check_open()
        if port not in self.host_ports:
            self.host_ports[port] = HostPort(port, list(self.pods.values()))
        return self.host_ports[port]

    def add_alias(self, alias: str, pod: NetnsPod | str) -> None:
        """Make ``alias`` resolve to ``pod``'s address in every pod, at once (running ones too)."""
        self._check_open()
        hostname = pod.hostname if isinstance(pod, NetnsPod) else pod
        if hostname not in self.pods:
            raise KeyError(f"no pod {hostname!r} in run {self.run_id}")
        self._check_new_names([alias])
        self.aliases[alias] = hostname
        self._save_state()
        self._publish_names()

    def close(self) -> None:
        """Remove everything the run created; idempotent, and safe from a signal handler.

        Stops the DNS server, kills the pods' processes, then deletes the veth pairs, namespaces,
        bridge, temp files and, last, the state file (so an interrupted close is finished by ``cleanup_stale``).
        A handler that interrupts a close runs a complete one itself: every step skips what is
        already gone. Raises ``NetnsError`` if something could not be removed.
        """
        if self._closed or os.getpid() != self._owner:  # a forked child does not own the run
            return
        for pod in self.pods.values():
            pod._stop_timer()
        if self.dns is not None:
            self.dns.close()
        for relay in self.host_ports.values():
            relay.close()
        links = [pod.veth for pod in self.pods.values()] + [self.dns_veth, self.bridge]
        namespaces = [pod.netns for pod in self.pods.values()] + [self.dns_netns]
        _, problems = plumbing.teardown(self.run_id, namespaces, links)
        for pod in self.pods.values():
            for proc in pod._procs:
                proc.poll()
        if problems:
            raise NetnsError(f"closing local run {self.run_id}: {'; '.join(problems)}")
        run_state.remove_state(self.run_id)
        self._closed = True
        exit_cleanup.unregister(self)

    def _check_open(self) -> None:
        if self._closed:
            raise NetnsError(f"local run {self.run_id} is closed")

    def _check_new_names(self, names: list[str]) -> None:
        for name in names:
            if not plumbing.ALIAS.match(name):
                raise ValueError(f"host name {name!r} is not a valid DNS name")
            if name in self.pods or name in self.aliases or name == "localhost" or names.count(name) > 1:
                raise ValueError(f"host name {name!r} is already taken in run {self.run_id}")

    def _save_state(self) -> None:
        start = run_state.process_start(self._owner)
        run_state.write_state(
            self.run_id,
            {
                "run_id": self.run_id,
                "owner_pid": self._owner,
                "owner_start": start,
                "boot_id": run_state.boot_id(),
                "subnet": str(self.subnet),
                "links": [self.bridge, self.dns_veth] + [pod.veth for pod in self.pods.values()],
                "netns": [self.dns_netns] + [pod.netns for pod in self.pods.values()],
                "pods": {pod.hostname: pod.ip for pod in self.pods.values()},
            },
        )

    def _start_dns(self) -> None:
        """The DNS namespace on the bridge, the server's socket in it, and the pods' resolv.conf."""
        try:
            from .dns import PORT as DNS_PORT, ClusterDNS
        except ModuleNotFoundError as exc:
            if exc.name != "dnslib":
                raise
            raise NetnsError(
                "the pods' DNS server needs dnslib, of the `chart` extra: pip install -c constraints.txt -e '.[chart]'"
            ) from None
        ip, ns, veth = self.tools["ip"], self.dns_netns, self.dns_veth
        plumbing.run(
            [ip, "-batch", "-"],
            "creating the pods' DNS namespace",
            stdin=(
                f"netns add {ns}\n"
                f"link add {veth} type veth peer name eth0 netns {ns}\n"
                f"link set {veth} master {self.bridge} addrgenmode none up\n"
            ),
        )
        plumbing.run(
            [ip, "-n", ns, "-batch", "-"],
            "configuring the pods' DNS namespace",
            stdin=(
                "link set eth0 addrgenmode none\n"
                f"addr add {self.dns_address}/{self.subnet.prefixlen} dev eth0\n"
                "link set eth0 up\n"
            ),
        )
        sock = plumbing.socket_in_netns(
            str(plumbing.NETNS_DIR / ns), self.dns_address, DNS_PORT, what="the pods' DNS server"
        )
        self.dns = ClusterDNS(sock, name=f"dns-{self.run_id}")
        self._publish_names()
        search = f"{self.namespace}.svc.cluster.local svc.cluster.local cluster.local"
        self.resolv_conf.write_text(
            f"# resilient-fsdp local run {self.run_id}: the run's cluster DNS\n"
            f"search {search}\nnameserver {self.dns_address}\noptions ndots:5\n"
        )

    def _publish_names(self) -> None:
        """Hand the server every name the run knows, and each pod address's reverse name."""
        if self.dns is None:
            return
        forward = {pod.hostname: pod.ip for pod in self.pods.values()}
        forward.update((alias, self.pods[hostname].ip) for alias, hostname in self.aliases.items())
        reverse = {pod.ip: pod.fqdn or pod.hostname for pod in self.pods.values()}
        self.dns.set_records(forward, reverse)


def _source(host_path: str | os.PathLike[str]) -> str:
    path = os.path.realpath(host_path)
    if not os.path.exists(path):
        raise NetnsError(f"mount source {os.fspath(host_path)} does not exist on the host")
    return path


def _target(pod_path: str | os.PathLike[str]) -> str:
    path = os.fspath(pod_path)
    if not os.path.isabs(path):
        raise ValueError(f"pod mount path {path!r} must be absolute")
    path = os.path.normpath(path)
    if path in ("/", "//"):
        raise ValueError("cannot mount over the pod's root directory")
    return "/" + path.lstrip("/")
