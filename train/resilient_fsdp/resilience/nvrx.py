"""Every adaptation this project makes to NVRx's restart layers, in one place.

Each adaptation's why is beside it: aborting gloo process groups (:func:`abort_process_groups`);
NVRx 0.7's health checks kept to GPU nodes (:func:`new_wrapper`, :func:`rank_health_check`); a
fixed world under in-process restart (:func:`whole_world_rank_assignment`); rank 0 hosting the
wrapper's store (:func:`hosting_store_factory`); ``ft_launcher`` leaving the rendezvous open
(:func:`keep_rendezvous_open`) and polling instead of one-second sleeps
(:func:`quicken_restart_polls`); hot spares only from NVRx 0.6 (:func:`hot_spares_unsupported`).
``python -m resilient_fsdp.resilience.nvrx ARGS`` is that ``ft_launcher``, which the node agent
runs. The checkpointing side is :mod:`resilient_fsdp.checkpoint.writer`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import os
import signal
import socket
import sys
from typing import Callable, Iterable, Iterator, Optional

# What the restart layers import of NVRx (in-process restart; ft_launcher, which the node agent
# runs), for reports of what a machine can import.
NVRX_MODULES = ("nvidia_resiliency_ext.inprocess", "nvidia_resiliency_ext.fault_tolerance.launcher")
RDZV_STORE_IN_NODE = "--rdzv-conf=is_host=true"
QUIET_WARNINGS = "ignore:The pynvml package is deprecated:FutureWarning"
# The first NVRx whose ft_launcher keeps the nodes beyond --nnodes' minimum as standby spares.
STANDBY_SINCE = (0, 6)


# (fd, local address, remote address) of every TCP connection the process groups made.
_GROUP_SOCKETS: set[tuple] = set()
# The ports that lazily connected groups listen on: their connections are made after the group,
# on a pair's first message, and every one of them arrives at one rank's listener.
_GROUP_LISTENERS: set[int] = set()
# Helper threads of a failed attempt, blocked on a group's peers: joined by the abort.
_LEFT_THREADS: list = []
# Called by the abort before it shuts the connections down: helpers stop posting messages.
_BEFORE_ABORT: list = []
# How long the abort waits for them once their connections are shut down (they wake at once).
LEFT_THREADS_JOIN_S = 10.0


def _tcp_connections(skip_ports: Iterable[int] = ()) -> set[tuple]:
    import psutil

    skip = set(skip_ports)
    found = set()
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return found
    for c in conns:
        if c.fd < 0 or c.status != psutil.CONN_ESTABLISHED or not c.raddr:
            continue
        if c.laddr.port in skip or c.raddr.port in skip:
            continue  # a rendezvous or in-process store: not the group's, and still needed
        found.add((c.fd, tuple(c.laddr), tuple(c.raddr)))
    return found


@contextlib.contextmanager
def recording_group_sockets(store_ports: Iterable[int] = ()) -> Iterator[None]:
    """Record the TCP connections made inside the block (gloo connects every pair when a group is
    created), except those to or from ``store_ports``, for :func:`abort_process_groups`."""
    ports = list(store_ports)
    before = _tcp_connections(ports)
    yield
    _GROUP_SOCKETS.update(_tcp_connections(ports) - before)


@contextlib.contextmanager
def recording_group_listeners() -> Iterator[None]:
    """Record the ports a lazily connected group made inside the block listens on
    (``TORCH_GLOO_LAZY_INIT``: it connects a pair on its first message, long after the block), for
    :func:`abort_process_groups`. Every connection of such a group is accepted by one rank's
    listener, so the ranks, each shutting down what arrived at its own, shut down all of them."""
    before = _listening_ports()
    yield
    _GROUP_LISTENERS.update(_listening_ports() - before)


def _listening_ports() -> set[int]:
    import psutil

    try:
        return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    except (psutil.Error, OSError):
        return set()


def forget_group_sockets() -> None:
    """The groups were destroyed cleanly: their connections are closed."""
    _GROUP_SOCKETS.clear()
    _GROUP_LISTENERS.clear()


def shutdown_group_sockets() -> int:
    """``shutdown(SHUT_RDWR)`` on the recorded connections that are still open (the same fd and
    addresses: a closed fd's number may have been reused), and on those that arrived at a lazily
    connected group's listener. Returns how many were shut down."""
    current = _tcp_connections()
    done = 0
    accepted = {c for c in current if c[1][1] in _GROUP_LISTENERS}
    for fd, _laddr, _raddr in (_GROUP_SOCKETS & current) | accepted:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)  # acts on the connection, not on this descriptor
            done += 1
        except OSError:
            pass
        finally:
            sock.close()  # closes the duplicate only
    _GROUP_SOCKETS.clear()
    _GROUP_LISTENERS.clear()
    return done


def before_abort(stop: Callable[[], None]) -> None:
    """``stop()`` is called by the next abort before it shuts the groups' connections down: a
    helper thread that posts messages on a group stops posting (gloo never completes a message
    posted on a connection already shut down, so its thread would wait out the group's timeout)."""
    _BEFORE_ABORT.append(stop)


def forget_before_abort(stop: Callable[[], None]) -> None:
    """``stop`` closed cleanly: the abort has nothing to stop."""
    if stop in _BEFORE_ABORT:
        _BEFORE_ABORT.remove(stop)


def _stop_helpers() -> None:
    stops, _BEFORE_ABORT[:] = list(_BEFORE_ABORT), []
    for stop in stops:
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - the abort goes on; the thread is joined or named
            print(
                f"[resilient-fsdp] stopping a helper before the abort: {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )


def leave_to_abort(threads: Iterable) -> None:
    """A failed attempt's helper threads, still blocked on their group's peers: the abort joins
    them after it shuts the connections down (:func:`join_left_threads`)."""
    _LEFT_THREADS.extend(t for t in threads if t.is_alive())


def join_left_threads(timeout_s: float = LEFT_THREADS_JOIN_S) -> list[str]:
    """Join the threads left to the abort, within ``timeout_s`` in all; the names of any still
    running (said, and kept for the next abort)."""
    import time

    deadline = time.monotonic() + timeout_s
    for t in _LEFT_THREADS:
        t.join(max(0.0, deadline - time.monotonic()))
    _LEFT_THREADS[:] = [t for t in _LEFT_THREADS if t.is_alive()]
    names = [t.name for t in _LEFT_THREADS]
    if names:
        import traceback

        frames = sys._current_frames()
        where = "; ".join(
            f"{t.name} at "
            + " < ".join(
                f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})"
                for f in reversed(traceback.extract_stack(frames[t.ident])[-3:])
            )
            for t in _LEFT_THREADS
            if t.ident in frames
        )
        print(
            f"[resilient-fsdp] {', '.join(names)} still running {timeout_s:.0f} s after the abort shut "
            f"their connections down; their groups go when they do: {where}",
            file=sys.stderr,
            flush=True,
        )
    return names


def blocked_helpers() -> list[str]:
    """The helper threads left to an abort that are still running (named at that abort)."""
    return [t.name for t in _LEFT_THREADS if t.is_alive()]


def abort_process_groups() -> None:
    """Abort every process group, then destroy them; for a failed attempt, never a clean one.

    First the groups' TCP connections are shut down: a gloo collective blocked on a peer wakes
    with an error, and every peer's pending collective fails at once (EOF) rather than at
    ``dist.timeout_s``; gloo's own ``abort`` (torch 2.13) wakes neither. Then every backend's
    ``abort`` runs, NCCL's included, so that ``destroy_process_group`` does not block on a
    collective still pending; then the groups are destroyed, and the helper threads left on them
    joined (:func:`leave_to_abort`). Before any of it, helpers stop posting (:func:`before_abort`).
    """
    import torch
    import torch.distributed as dist

    _stop_helpers()
    shutdown_group_sockets()
    if not (dist.is_available() and dist.is_initialized()):
        join_left_threads()
        return
    for group in list(dist.distributed_c10d._world.pg_names):
        for device in ("cpu", "cuda"):
            try:
                backend = group._get_backend(torch.device(device))
            except (RuntimeError, ValueError, AttributeError):
                continue
            try:
                backend.abort()
            except (RuntimeError, AttributeError):
                pass
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        pass
    join_left_threads()


def make_abort():
    """An ``inprocess.abort.Abort`` that runs :func:`abort_process_groups`."""
    from nvidia_resiliency_ext import inprocess

    class AbortProcessGroups(inprocess.abort.Abort):
        def __call__(self, state):
            abort_process_groups()
            return state

    return AbortProcessGroups()


def new_wrapper(
    wrapper_class, gpu_present: Optional[bool] = None, say: Optional[Callable[[str], None]] = None, **kwargs
):
    """``wrapper_class(**kwargs)`` (NVRx's ``inprocess.Wrapper``) with NVRx 0.7's GPU, NVLink and NIC
    restart health checks only where a GPU is present.

    0.7 adds them in the constructor when ``LOCAL_RANK`` is set, and constructing them initialises
    NVML, which fails (and logs it) on a host without one: there the wrapper is built with
    ``LOCAL_RANK`` hidden, and the absence is said once. With a GPU, or under NVRx 0.4 (which has
    no such checks), the wrapper is built as NVRx builds it.
    """
    if gpu_present is None:
        import torch

        gpu_present = torch.cuda.is_available()
    adds_gpu_checks = hasattr(wrapper_class, "_construct_restart_health_check")  # 0.7's constructor step
    if gpu_present or not adds_gpu_checks or "LOCAL_RANK" not in os.environ:
        wrapper = wrapper_class(**kwargs)
        adapt_health_checks(wrapper, gpu_present, say)
        return wrapper
    local_rank = os.environ.pop("LOCAL_RANK")
    try:
        wrapper = wrapper_class(**kwargs)
    finally:
        os.environ["LOCAL_RANK"] = local_rank
    _say_dropped(list(GPU_HEALTH_CHECKS), say)
    return wrapper


# How long rank 0 retries binding the in-process store's port (a previous generation's rank may
# still be ending), and how often.
STORE_HOST_RETRY_S = 10.0
STORE_HOST_RETRY_EVERY_S = 0.25
# Set by each rank's process before the wrapper starts NVRx's monitor process: the process that
# must host the store (the monitor process inherits it, with another pid, and stays a client).
HOSTING_PID_ENV = "RESILIENT_FSDP_STORE_HOST_PID"


class StoreHostError(RuntimeError):
    """Rank 0 could not host the in-process wrapper's store."""


def hosting_store_factory():
    """The in-process wrapper's ``store_factory``: NVRx's ``TCPStore``, hosted by rank 0's own
    process or failing there with the port and the reason. NVRx's store falls back to a client
    without a word when rank 0 cannot bind its port, and every rank then waits 300 s for a store
    nobody hosts; the port is ``MASTER_PORT`` plus an offset, in the ephemeral range where the
    pod's own connections take ports too. So rank 0 retries the bind for
    :data:`STORE_HOST_RETRY_S`, then fails naming the port: the in-job restart picks another."""
    import time

    import torch.distributed as dist
    from nvidia_resiliency_ext.inprocess.store import TCPStore

    class HostingTCPStore(TCPStore):
        def __init__(self, **kwargs):
            if int(os.environ["RANK"]) != self.TCP_STORE_HOST_RANK or os.environ.get(HOSTING_PID_ENV) != str(
                os.getpid()
            ):
                super().__init__(**kwargs)  # a client, as NVRx makes it
                return
            args = {
                "host_name": os.environ["MASTER_ADDR"],
                "port": int(os.environ["MASTER_PORT"]),
                "world_size": int(os.environ["WORLD_SIZE"]),
                **kwargs,
            }
            deadline, error = time.monotonic() + STORE_HOST_RETRY_S, None
            while True:
                try:
                    dist.TCPStore.__init__(self, is_master=True, **args)
                    return
                except Exception as exc:  # noqa: BLE001 - the port is taken (or will not bind): retried
                    error = exc
                if time.monotonic() >= deadline:
                    break
                time.sleep(STORE_HOST_RETRY_EVERY_S)
            raise StoreHostError(
                f"rank 0 could not host the in-process restart store on port {args['port']} "
                f"(MASTER_PORT + resilience.in_process.store_port_offset) within "
                f"{STORE_HOST_RETRY_S:g} s: {error}; the in-job restart's next round picks "
                "another MASTER_PORT"
            ) from error

    os.environ[HOSTING_PID_ENV] = str(os.getpid())
    return HostingTCPStore


# The exit code of a rank that leaves in-process restart to the in-job restart (any failure is retried).
LEFT_TO_IN_JOB_EXIT = 1


def whole_world_rank_assignment():
    """The in-process wrapper's ``rank_assignment``: every rank stays, at its rank, or none does.

    With no terminated rank it is NVRx's ``ActivateAllRanks`` (the default's rank shift has nothing
    to shift). With one, every rank says why and ends its process: its attempt is over already
    (the abort ran, the checkpointer closed), and raising instead would go through NVRx's barriers,
    which wait for the lost rank, rank 0's without end."""
    from nvidia_resiliency_ext.inprocess.rank_assignment import ActivateAllRanks, RankAssignment

    class WholeWorld(RankAssignment):
        def __call__(self, ctx):
            if ctx.terminated_ranks:
                lost = ", ".join(str(r) for r in sorted(ctx.terminated_ranks))
                print(
                    f"[resilient-fsdp] rank {ctx.state.rank}: in-process restart cannot go on without rank(s) "
                    f"{lost} (unresponsive or past resilience.in_process.hard_timeout_s); the job's world is "
                    "fixed, so the in-job restart takes over (a hot spare, if any, takes the lost place): "
                    "ending this rank's process",
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                os._exit(LEFT_TO_IN_JOB_EXIT)
            return ActivateAllRanks()(ctx)

    return WholeWorld()


def rank_health_check(gpu_present: Optional[bool] = None):
    """The in-process wrapper's ``health_check``: NVRx's ``CudaHealthCheck`` where a GPU is present
    (it synchronises with the GPU before every restart: pending kernels finish, a broken context
    raises and the rank is terminated), None on CPU, where there is nothing to check."""
    if gpu_present is None:
        import torch

        gpu_present = torch.cuda.is_available()
    if not gpu_present:
        return None
    from nvidia_resiliency_ext.inprocess.health_check import CudaHealthCheck

    return CudaHealthCheck()


def _say_dropped(dropped: list[str], say: Optional[Callable[[str], None]]) -> None:
    message = (
        f"[resilient-fsdp] rank {os.environ.get('RANK', '0')}: no GPU: in-process restart runs without "
        f"NVRx's {', '.join(dropped)} (they need a GPU and NVML)"
    )
    (say or (lambda m: print(m, file=sys.stderr, flush=True)))(message)


# NVRx 0.7's restart health checks that need a GPU (and its NVLink and NICs, read through NVML).
GPU_HEALTH_CHECKS = ("ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "ChainedNicHealthCheck")


def adapt_health_checks(
    wrapper, gpu_present: Optional[bool] = None, say: Optional[Callable[[str], None]] = None
) -> list[str]:
    """Drop NVRx 0.7's GPU, NVLink and NIC restart health checks from ``wrapper`` when no GPU is
    present (they fail there, and every in-process restart would become a termination); keep
    them, and any other check, on GPU nodes. NVRx 0.4 has none. Returns the names dropped."""
    checks = getattr(wrapper, "restart_health_check", None)
    if checks is None:
        return []
    if gpu_present is None:
        import torch

        gpu_present = torch.cuda.is_available()
    if gpu_present:
        return []
    instances = list(getattr(checks, "instances", (checks,)))
    kept = [c for c in instances if type(c).__name__ not in GPU_HEALTH_CHECKS]
    dropped = [type(c).__name__ for c in instances if type(c).__name__ in GPU_HEALTH_CHECKS]
    if not dropped:
        return []
    if not kept:
        wrapper.restart_health_check = None
    elif len(kept) == 1:
        wrapper.restart_health_check = kept[0]
    else:
        wrapper.restart_health_check = _compose(checks, kept)
    _say_dropped(dropped, say)
    return dropped


def _compose(original, kept: list):
    """A chain of ``kept`` of the same composition class as ``original`` (NVRx's ``Compose``)."""
    compose = next((c for c in type(original).__mro__ if c.__name__ == "Compose"), None)
    if compose is None:
        from nvidia_resiliency_ext.inprocess.compose import Compose as compose
    return compose(*kept)


def installed_version() -> Optional[str]:
    """The NVRx version this interpreter imports (the first on its path), or None without one."""
    try:
        return importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[int, int]:
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def hot_spares_unsupported(launcher_args: list[str], version: Optional[str]) -> Optional[str]:
    """Why ``launcher_args`` (ft_launcher's) cannot run with NVRx ``version``: an ``--nnodes=N:M``
    range asks for M - N hot spares, which only NVRx 0.6 or newer keeps standby; None when they can."""
    nnodes = next(
        (a.split("=", 1)[1] for a in launcher_args[: _trainer_start(launcher_args)] if a.startswith("--nnodes=")), ""
    )
    low, sep, high = nnodes.partition(":")
    if not sep or not (low.isdigit() and high.isdigit()) or int(low) >= int(high) or version is None:
        return None
    if _major_minor(version) >= STANDBY_SINCE:
        return None
    spares = int(high) - int(low)
    return (
        f"--nnodes={nnodes} asks for {spares} hot spare pod(s) (the chart's spares={spares}), which NVRx "
        f"{STANDBY_SINCE[0]}.{STANDBY_SINCE[1]} or newer keeps standby while {low} nodes train; this pod's NVRx "
        f"{version} would train at every node that joins, a world of up to {high} nodes. Run the image's NVRx "
        f"(constraints-image.txt), or set spares=0"
    )


def _trainer_start(args: list[str]) -> int:
    """Where the training module's arguments begin (``-m MODULE``): ft_launcher's flags are before it."""
    return args.index("-m") if "-m" in args else len(args)


def keep_rendezvous_open(launcher_module) -> str:
    """Patch ``ft_launcher`` (its ``launcher`` module) not to close the rendezvous for good when
    this node's ranks fail; returns which NVRx hook was patched. A closed rendezvous would fail the
    pod the job level recreates, and every other node at its next round, with
    ``RendezvousClosedError``. On 0.4 it also keeps the store host from waiting out
    ``exit_barrier_timeout`` (300 s) for nodes that stay in the rendezvous."""
    agent = getattr(launcher_module, "LocalElasticAgent", None)
    if agent is not None and hasattr(agent, "clean_rdzv_shutdown"):  # 0.4
        original = agent.clean_rdzv_shutdown

        def clean_rdzv_shutdown(self, close):
            if self.any_rank_failed():
                # The store host waits up to exit_barrier_timeout (300 s) for every other node to
                # leave the rendezvous, but after a failure or a stop they stay in it for the next
                # round: pod 0 would linger 5 minutes before its replacement could start. Its
                # peers lose the store instead and are retried (agent.RENDEZVOUS_LOST).
                self._is_store_host = False
            return original(self, close=False)

        agent.clean_rdzv_shutdown = clean_rdzv_shutdown
        return "clean_rdzv_shutdown"
    from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier as barrier  # 0.7

    for cls in vars(barrier).values():
        if isinstance(cls, type) and "shutdown_due_to_failure" in vars(cls):
            cls.shutdown_due_to_failure = lambda self: False
            return f"{cls.__name__}.shutdown_due_to_failure"
    return ""


# How often an in-job restart looks again where NVRx 0.7 waits whole seconds (below).
RESTART_POLL_S = 0.1
# How long a stopped worker's process group has after SIGTERM before SIGKILL (NVRx 0.7's wait).
GROUP_TERM_GRACE_S = 1.0


def quicken_restart_polls(launcher_module) -> list[str]:
    """Turn NVRx's fixed one-second waits in every in-job restart into polls; returns what was
    changed. On 0.4 that is its rendezvous's one-second sleep between looks at the store
    (:func:`_quicken_dynamic_rendezvous`); on 0.7:

    - After it stops the workers, 0.7's launcher sends SIGTERM to their process groups, sleeps a
      whole second, then sends SIGKILL (``utils.terminate_mp_processes``): here the groups get
      the same second, but the restart goes on as soon as none of their processes is left.
    - A node that restarts, or a spare, waits for the next rendezvous round in a loop that sleeps
      a second per look, also after the look that found the round open (the barrier's step 0):
      here it looks every :data:`RESTART_POLL_S`. A waiting node's look is one store read.
    - The store host closes a round after looking at who joined, at most once a second below
      2,000 nodes (``_compute_step2_poll_interval``), so a node joining just after a look waits
      for the next: here the look is every :data:`RESTART_POLL_S` up to 200 nodes, growing with
      the nodes as NVRx's does above (min_nodes / 2,000 s: a look reads one key per node).
    """
    changed = []
    terminate = getattr(launcher_module, "terminate_mp_processes", None)
    if terminate is not None and list(inspect.signature(terminate).parameters) == ["allowed_pgids"]:  # 0.7's
        launcher_module.terminate_mp_processes = terminate_process_groups
        changed.append("terminate_mp_processes")
    try:
        from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier as barrier
    except ImportError:  # NVRx 0.4: its copy of torch's dynamic rendezvous
        return changed + _quicken_dynamic_rendezvous()
    state = getattr(barrier, "_RendezvousBarrierState", None)
    if state is not None and hasattr(state, "_compute_step2_poll_interval"):
        state._compute_step2_poll_interval = staticmethod(step2_poll_interval)
        barrier.time = _QuickerSecondPolls(barrier.time)
        changed += ["_compute_step2_poll_interval", "step 0's poll"]
    return changed


def _quicken_dynamic_rendezvous() -> list[str]:
    """NVRx 0.4's rendezvous (torch's dynamic one, copied into NVRx) sleeps a second between
    looks at the store's state while it waits for the other nodes: a look every
    :data:`RESTART_POLL_S` instead. 0.4 is the local lane (the image runs 0.7), jobs of a few pods."""
    try:
        from nvidia_resiliency_ext.fault_tolerance import _ft_rendezvous as dynamic
    except ImportError:
        return []
    delay = getattr(dynamic, "_delay", None)
    if delay is None or getattr(delay, "quickened", False):
        return []

    def quickened(seconds):
        delay(RESTART_POLL_S if seconds == 1 else seconds)

    quickened.quickened = True
    dynamic._delay = quickened
    return ["_ft_rendezvous._delay"]


def step2_poll_interval(min_nodes: int, segment_check_interval: float) -> float:
    """How often the store host looks at who joined a round (see :func:`quicken_restart_polls`)."""
    return max(RESTART_POLL_S, min(segment_check_interval, min_nodes / 2000.0))


class _QuickerSecondPolls:
    """The ``time`` module as NVRx 0.7's barrier rendezvous sees it: its one-second sleeps (the
    step 0 polls; its other waits are tenths already) take :data:`RESTART_POLL_S`. NVRx counts
    those looks as seconds in two debug-level log lines, which then read ten times too high."""

    def __init__(self, real) -> None:
        self._real = real

    def sleep(self, seconds: float) -> None:
        self._real.sleep(RESTART_POLL_S if seconds == 1.0 else seconds)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def terminate_process_groups(allowed_pgids, grace_s: float = GROUP_TERM_GRACE_S) -> None:
    """SIGTERM every process group of ``allowed_pgids`` (the stopped workers'), wait until none
    has a live process or ``grace_s`` has passed, then SIGKILL what is left: NVRx 0.7's
    ``terminate_mp_processes`` without its fixed wait. Best effort, as NVRx's."""
    import time

    pgids = set(allowed_pgids)
    if not pgids or 1 in pgids:  # as NVRx: process group 1 (init's) is never a worker's to end
        return
    for pgid in pgids:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive_in(pgids) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pgid in pgids:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


def _alive_in(pgids: set[int]) -> bool:
    """Whether a process of ``pgids`` is still running (a zombie only waits to be reaped)."""
    import psutil

    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) in pgids:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def ft_launcher_main(argv: list[str]) -> None:
    """``ft_launcher`` with :func:`keep_rendezvous_open` and :func:`quicken_restart_polls` applied;
    exits with its exit code."""
    from nvidia_resiliency_ext.fault_tolerance import launcher

    keep_rendezvous_open(launcher)
    quicken_restart_polls(launcher)
    sys.argv = ["ft_launcher", *argv]
    launcher.main()


if __name__ == "__main__":
    ft_launcher_main(sys.argv[1:])
