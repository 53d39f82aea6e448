"""Pre-warmed ranks: a pod's server that has imported torch and the trainer forks every new rank,
so an in-job restart does not pay the imports again (several CPU-seconds a rank).

The node agent starts ``python -m resilient_fsdp.resilience.prewarm --socket=PATH -- ARGS``
beside each ``ft_launcher`` run and hands ``ft_launcher`` :data:`SOCKET_ENV`. Each rank ``ft_launcher``
starts is a *client* that passes its arguments, environment and streams to the server
(:func:`run_as_client`); the server forks the rank (:func:`serve`), and the client relays signals and
ends as the rank ended. The fork-safety conditions are checked before every fork
(:func:`refusal`); when one does not hold, or there is no server, the client runs the rank itself
and says why.
"""

from __future__ import annotations

import array
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Optional

# Set by the node agent for ft_launcher's workers: the server's socket.
SOCKET_ENV = "RESILIENT_FSDP_PREWARM_SOCKET"
# The module ranks run (``python -m``): what the server runs in each fork.
TRAINER_MODULE = "resilient_fsdp.train"
# When the process ft_launcher started for a rank began, on the wall clock (train/__main__.py stamps
# it; a forked rank keeps its client's): the start of a restart's new-process phase (accounting).
PROCESS_START_ENV = "RESILIENT_FSDP_PROCESS_START"
# What the server imports before it accepts a rank: the trainer, and what a rank imports later
# (the checkpoint writer's side, NVRx's rank monitor client and in-process restart; torch._dynamo,
# which FSDP2's hooks import at the first forward: 0.7 s per rank, started by no thread).
PRELOAD = (
    "resilient_fsdp.train.entrypoint",
    "resilient_fsdp.checkpoint.writer.process",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "numpy.random",
)
# Read by the interpreter, torch or NumPy when they are imported: a client whose value differs
# from the server's runs the rank itself. OpenMP and MKL take their thread counts when torch loads
# them, so a fork keeps the server's whatever the rank's environment says.
IMPORT_TIME_VARS = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONSAFEPATH",
    "PYTHONWARNINGS",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_LOGS",
    "TORCH_SHOW_CPP_STACKTRACES",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)
# What ft_launcher (as torchrun) sets for its ranks when a node runs several and it is unset.
LAUNCHER_OMP_NUM_THREADS = "1"
# Signals the client passes on to its rank (ft_launcher stops workers with SIGTERM, then SIGKILL).
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# How long a client waits for a server still importing before it runs the rank itself.
CONNECT_WAIT_S = 120.0
_HEADER = struct.Struct("!I")


# -- what the node agent gives ft_launcher and the server alike ---------------------------------------


def with_launcher_threads(env: dict[str, str], nproc_per_node: Optional[int]) -> dict[str, str]:
    """``env`` with the ``OMP_NUM_THREADS`` ft_launcher gives its ranks: ``1`` when a node runs
    several ranks and the variable is unset, so that they do not each start a thread per core. The
    node agent gives the result to ft_launcher and to the pre-warmed server alike, so the server
    imports torch with the ranks' thread count (an :data:`IMPORT_TIME_VARS` entry). With
    ``nproc_per_node`` unknown (``auto``) nothing is set: the server then refuses ranks whose count
    ft_launcher set, and they import their own."""
    if "OMP_NUM_THREADS" in env or nproc_per_node is None or nproc_per_node <= 1:
        return env
    return {**env, "OMP_NUM_THREADS": LAUNCHER_OMP_NUM_THREADS}


# -- the client (the process ft_launcher started) ---------------------------------------------------


def run_as_client(argv: list[str]) -> Optional[int]:
    """Hand this rank to the pod's server when :data:`SOCKET_ENV` names one: the rank's exit
    code (or this process dies of the rank's signal); None when there is no server to hand it
    to, or it refused (said on stderr), and this process is to run the rank itself."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return None
    try:
        conn = _connect(path)
    except OSError as exc:
        _say(f"no pre-warmed server at {path} ({exc.strerror or exc}); this rank imports its own")
        return None
    with conn:
        umask = os.umask(0)
        os.umask(umask)
        request = {
            "argv": list(argv),
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "umask": umask,
            "executable": sys.executable,
        }
        try:
            _send(conn, request, fds=[0, 1, 2])
            reply = _receive(conn)
        except OSError as exc:
            _say(f"the pre-warmed server at {path} did not take this rank ({exc}); this rank imports its own")
            return None
        if reply is None or "pid" not in reply:
            why = reply.get("refused") if reply else "it closed the connection"
            _say(f"the pre-warmed server did not fork this rank: {why}; this rank imports its own")
            return None
        pid = int(reply["pid"])

        def relay(signum: int, _frame) -> None:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

        for sig in RELAYED:
            signal.signal(sig, relay)
        ending = _receive(conn)  # the recv resumes after each relayed signal (PEP 475)
    if ending is None:  # the server died: the rank is not ours to wait for
        relay(signal.SIGKILL, None)
        _say(f"the pre-warmed server went away while rank process {pid} ran; it was killed")
        return 1
    if ending.get("signal"):
        sig = int(ending["signal"])
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(1.0)  # a signal that does not end a process (SIGCHLD, SIGCONT): exit as a shell reports it
        return 128 + sig
    return int(ending.get("code", 1))


def _connect(path: str) -> socket.socket:
    """Connect to the server, waiting for a socket that is not there yet (the agent starts the
    server as it starts ft_launcher; the socket exists once it is bound, before the imports)."""
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline or not _starting(path):
                raise
            time.sleep(0.05)


def _starting(path: str) -> bool:
    """Whether a server for ``path`` is on its way: its marker is there (the agent writes it
    before it starts the server, then the server's pid into it), and that pid, once written, is
    alive (a server that died before it bound leaves no client waiting)."""
    try:
        with open(path + ".starting") as f:
            pid = f.read().strip()
    except FileNotFoundError:
        return False
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# -- the server (one per pod, beside ft_launcher) -----------------------------------------------------


def serve(path: str, trainer_argv: list[str], module: str = TRAINER_MODULE) -> int:
    """Bind ``path``, import what a rank needs (in the environment ``trainer_argv``'s ranks import
    with), then fork a rank for every client until SIGTERM, each running ``module`` as
    ``__main__``. Returns in a forked rank only, with the rank's exit code."""
    starting = path + ".starting"
    with open(starting, "w") as f:
        f.write(str(os.getpid()))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(256)
    os.environ.pop(SOCKET_ENV, None)
    t0 = time.perf_counter()
    _preload(trainer_argv)
    os.unlink(starting)
    _say(f"pre-warmed server ready at {path}: {', '.join(PRELOAD)} imported in {time.perf_counter() - t0:.2f} s")
    _start_writer_fork_server(listener)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, _f: stopping.append(s))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    ranks: dict[int, socket.socket] = {}  # pid -> its client's connection
    clients: dict[socket.socket, Optional[int]] = {}  # connection -> its rank's pid, once forked
    while not stopping:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                clients[conn] = None
                sel.register(conn, selectors.EVENT_READ, "client")
            elif key.data == "wake":
                _drain(wake_r)
                _reap(ranks, clients, sel)
            elif clients.get(key.fileobj) is None:
                conn = key.fileobj
                try:
                    request, fds = _receive_with_fds(conn)
                except OSError:
                    request, fds = None, []
                if request is None:
                    _close(conn, clients, sel)
                    continue
                why = refusal(request)
                if why is not None:
                    _reply(conn, {"refused": why})
                    for fd in fds:
                        os.close(fd)
                    _close(conn, clients, sel)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for s in (listener, *clients):
                        s.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    return become_rank(request, fds, module)
                for fd in fds:
                    os.close(fd)
                clients[conn] = pid
                ranks[pid] = conn
                _reply(conn, {"pid": pid})
            else:  # a forked rank's client: anything readable is its end
                conn = key.fileobj
                pid = clients[conn]
                try:
                    gone = conn.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    gone = True
                if gone:
                    _kill_group(pid)
                    _close(conn, clients, sel)
    for pid in list(ranks):  # stopped: no rank outlives its server's pod
        _kill_group(pid)
    listener.close()
    os.unlink(path)
    return 0


def refusal(request: dict, environ: Optional[dict] = None) -> Optional[str]:
    """Why the server must not fork a rank for ``request`` now, or None. A fork is safe with one OS
    thread, no CUDA context, no process group (:func:`_unsafe_to_fork`), and the same interpreter
    and import-time variables as the rank will hold (:data:`IMPORT_TIME_VARS` and
    ``nccl_env.layer_env``, read when torch and the trainer are imported)."""
    environ = os.environ if environ is None else environ
    if request.get("executable") != sys.executable:
        return f"the client runs {request.get('executable')}, the server {sys.executable}"
    unsafe = _unsafe_to_fork()
    if unsafe is not None:
        return unsafe
    env = _import_time_env(request)
    differ = sorted(k for k in env if (env[k] or "") != (environ.get(k) or ""))
    if differ:
        return f"{', '.join(differ)} differ between the rank's environment and the server's"
    return None


def _unsafe_to_fork() -> Optional[str]:
    """Why this process must not fork now, or None: a fork keeps one thread (NumPy's OpenBLAS pool
    is why the server imports with ``OPENBLAS_NUM_THREADS=1``) and must not copy a CUDA context."""
    threads = _threads()
    if threads != 1:
        return f"the server has {threads} threads (a fork keeps only one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the server has a CUDA context"
    return None


def _start_writer_fork_server(listener: socket.socket) -> None:
    """Fork the pod's checkpoint-writer fork server (:mod:`resilient_fsdp.checkpoint.writer.fork_server`)
    from this process, imported and not yet serving, under the same conditions as a rank."""
    from ..checkpoint.writer import fork_server

    unsafe = _unsafe_to_fork()
    if unsafe is not None:
        _say(f"no checkpoint-writer fork server: {unsafe}; ranks spawn their writers")
        return
    fork_server.start(close_fds=(listener.fileno(),))


def become_rank(request: dict, fds: list[int], module: str = TRAINER_MODULE) -> int:
    """In the fork: become the rank ``request`` describes and run ``module`` as it; its exit code."""
    import runpy

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    env = {k: v for k, v in request["env"].items() if k != SOCKET_ENV}
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    os.umask(int(request["umask"]))
    sys.argv = [module, *request["argv"]]
    if sys.path and not sys.flags.safe_path:
        sys.path[0] = request["cwd"]  # what `python -m` puts first: the working directory
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code
    return 0


def _preload(trainer_argv: list[str]) -> None:
    import importlib

    from .nccl_env import apply_before_torch

    apply_before_torch(trainer_argv)  # the variables the ranks' torch is imported with
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        if blas is None:
            os.environ.pop("OPENBLAS_NUM_THREADS", None)
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = blas


def _import_time_env(request: dict) -> dict[str, Optional[str]]:
    """The rank's value of each :data:`IMPORT_TIME_VARS` entry and of what the restart layers set
    before torch for its arguments, as it would hold them when it imports torch: the client hands
    over before it applies the layers' variables (``train/__main__``), which the server applied
    before its imports."""
    from .nccl_env import apply_before_torch

    env = {k: request.get("env", {}).get(k) for k in IMPORT_TIME_VARS}
    layer: dict[str, str] = {}
    apply_before_torch(list(request.get("argv", [])), layer)
    env.update(layer)
    return env


def _reap(ranks: dict[int, socket.socket], clients: dict, sel: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is None or conn not in clients:
            continue
        ending = (
            {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"code": os.waitstatus_to_exitcode(status)}
        )
        _reply(conn, ending)
        _close(conn, clients, sel)


def _kill_group(pid: Optional[int]) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _close(conn: socket.socket, clients: dict, sel: selectors.BaseSelector) -> None:
    clients.pop(conn, None)
    try:
        sel.unregister(conn)
    except (KeyError, ValueError):
        pass
    conn.close()


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _send(conn: socket.socket, message: dict, fds: Optional[list[int]] = None) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sent = conn.sendmsg([payload], ancillary)
    if sent < len(payload):
        conn.sendall(payload[sent:])


def _reply(conn: socket.socket, message: dict) -> None:
    try:
        _send(conn, message)
    except OSError:
        pass  # the client is gone; its rank is killed when its end is read


def _receive(conn: socket.socket) -> Optional[dict]:
    message, _ = _receive_with_fds(conn)
    return message


def _receive_with_fds(conn: socket.socket) -> tuple[Optional[dict], list[int]]:
    """One message and the descriptors sent with it; (None, []) at the end of the stream."""
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(_HEADER.size, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    while data and len(data) < _HEADER.size:
        more = conn.recv(_HEADER.size - len(data))
        if not more:
            break
        data += more
    if len(data) < _HEADER.size:
        return None, list(fds)
    (length,) = _HEADER.unpack(data)
    body = b""
    while len(body) < length:
        more = conn.recv(length - len(body))
        if not more:
            return None, list(fds)
        body += more
    return json.loads(body), list(fds)


def _say(message: str) -> None:
    print(f"[resilient-fsdp] {message}", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    path, module, rest = None, TRAINER_MODULE, argv
    while rest and rest[0] != "--":
        if rest[0].startswith("--socket="):
            path = rest[0].split("=", 1)[1]
        elif rest[0].startswith("--module="):
            module = rest[0].split("=", 1)[1]
        else:
            print(
                f"prewarm: unknown argument {rest[0]!r}; usage: python -m resilient_fsdp.resilience.prewarm "
                f"--socket=PATH [--module=MODULE (default {TRAINER_MODULE})] -- TRAINER_ARGS",
                file=sys.stderr,
            )
            return 2
        rest = rest[1:]
    if path is None:
        print("prewarm: --socket=PATH is required", file=sys.stderr)
        return 2
    return serve(path, rest[1:] if rest else [], module)


if __name__ == "__main__":
    sys.exit(main())
