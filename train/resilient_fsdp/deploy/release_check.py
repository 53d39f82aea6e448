"""The chart's ``helm test`` check: can this release's pods train, before they spend GPU hours?

Run in a Pod with the training pods' image, user, volumes and placement
(``templates/tests/release-check.yaml``): ``python -m resilient_fsdp.deploy.release_check
--shared-dir /fsx --check-dir DIR --rdzv-host HOST --rdzv-port PORT [--gpus N --efa N] [--memlock]``.
Each ``check_*`` prints one line, ``ok`` or ``FAIL`` with what was found and what to change; the
exit code is 1 when any failed. Standard library, ``resilient_fsdp.atomic`` and
:mod:`resilient_fsdp.checkpoint.shared_volume` (torch-free) only: it runs in the trainer image
without touching torch or CUDA.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from resilient_fsdp import atomic
from resilient_fsdp.checkpoint.shared_volume import writable_fix


@dataclass(frozen=True)
class Result:
    """One check's outcome: its name, whether it passed, and what was found (or what to change)."""

    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def _owner(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return "unknown owner"
    return f"owner {st.st_uid}:{st.st_gid}, mode {st.st_mode & 0o7777:o}"


def memlock_shortfall(limits: Callable[[int], tuple[int, int]] = resource.getrlimit) -> Optional[str]:
    """Why this process's locked-memory limit is too low for EFA, with the fix; None when unlimited.
    The one rule both ``helm test`` and the image's self-check (:mod:`.image_check`) apply."""
    soft, hard = limits(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None

    def shown(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"

    return (
        f"ulimit -l is {shown(soft)} (hard {shown(hard)}), EFA needs unlimited: it registers its buffers as "
        f"locked memory, and NCCL fails to set up EFA. The limit comes from the node's container runtime, not "
        f"the pod: set LimitMEMLOCK=infinity in containerd's systemd unit (the EKS GPU AMIs do), or "
        f"default_ulimits memlock=-1 in its config (`docker run --ulimit memlock=-1` for docker), on the nodes "
        f"of this instance type"
    )


def check_memlock(required: bool, limits: Callable[[int], tuple[int, int]] = resource.getrlimit) -> Result:
    """The locked-memory limit is unlimited (EFA pods); skipped when not ``required``."""
    name = "memlock"
    if not required:
        return Result(name, True, "no EFA (skipped)")
    shortfall = memlock_shortfall(limits)
    return Result(name, False, shortfall) if shortfall else Result(name, True, "unlimited")


def check_shared_volume(shared_dir: Path, check_dir: Path) -> Result:
    """The checkpoint directory is on the shared volume and this user can create it and write there.

    A file from this process's user is written, synced, read back and removed. A new FSx for Lustre
    file system's root belongs to root, and a pod running as UID 10001 cannot write there: the
    failure names both fixes, ``storage.prepare`` and ``pod.securityContext.runAsUser``.
    """
    name = "shared volume"
    who = f"uid {os.getuid()} gid {os.getgid()}"
    shared, target = Path(shared_dir), Path(check_dir)
    if not shared.is_dir():
        return Result(
            name, False, f"{shared} is not mounted (no such directory): check the pod's volume and storage.mountPath"
        )
    if os.path.commonpath([os.path.abspath(shared), os.path.abspath(target)]) != os.path.abspath(shared):
        return Result(
            name,
            False,
            f"{target} is not under the shared volume {shared}: every pod must see the "
            f"same checkpoints; set trainer.checkpoint.dir under storage.mountPath",
        )
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # The deepest directory that exists is the one that refused.
        parent = target
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        return Result(
            name,
            False,
            f"cannot create {target} as {who} ({exc.strerror}); {parent} has {_owner(parent)}: {writable_fix(parent)}",
        )
    probe = target / f".release-check-{socket.gethostname()}-{os.getpid()}"
    payload = os.urandom(2048).hex()
    try:
        # Created exclusively and synced, as the trainer's own records are (atomic.create_exclusive).
        if not atomic.create_exclusive(probe, payload):
            return Result(name, False, f"{probe} exists already: another check with this pod's name is running")
        if probe.read_text() != payload:
            return Result(name, False, f"{probe} read back different bytes: the volume is not consistent")
    except OSError as exc:
        return Result(
            name,
            False,
            f"cannot write in {target} as {who} ({exc.strerror}); it has {_owner(target)}: {writable_fix(target)}",
        )
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return Result(name, True, f"{target} writable by {who}")


def _count(directory: Path, pattern: str) -> int:
    rx = re.compile(pattern)
    try:
        return sum(1 for entry in os.listdir(directory) if rx.fullmatch(entry))
    except OSError:
        return 0


def check_devices(name: str, requested: int, directory: Path, pattern: str, plugin: str) -> Result:
    """At least ``requested`` device nodes matching ``pattern`` in ``directory``; skipped when none requested.

    The device nodes the NVIDIA and EFA device plugins give a pod: ``/dev/nvidiaN``,
    ``/dev/infiniband/uverbsN``.
    """
    if requested <= 0:
        return Result(name, True, "not requested (skipped)")
    found = _count(directory, pattern)
    if found < requested:
        return Result(
            name,
            False,
            f"requested {requested}, {found} visible in {directory}: the {plugin} did not "
            f"give this pod its devices; check that it runs on the node and that the "
            f"instance type has them (instanceType, gpusPerNode, efa.devices)",
        )
    return Result(name, True, f"{found} visible in {directory} (requested {requested})")


def check_rendezvous_host(
    host: str,
    port: int,
    timeout_s: float,
    interval_s: float = 5.0,
    resolve: Callable = socket.getaddrinfo,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Result:
    """``host`` resolves within ``timeout_s`` seconds (tried every ``interval_s``).

    The name every agent passes to ``--rdzv-endpoint`` resolves once the job's first pod exists,
    hence the retries.
    """
    name = "rendezvous host"
    deadline = clock() + timeout_s
    while True:
        try:
            addresses = sorted({info[4][0] for info in resolve(host, port, type=socket.SOCK_STREAM)})
            return Result(name, True, f"{host}:{port} -> {', '.join(addresses)}")
        except OSError as exc:
            error = exc
        if clock() + interval_s > deadline:
            break
        sleep(interval_s)
    return Result(
        name,
        False,
        f"{host} did not resolve in {timeout_s:g} s ({error}): it resolves once the job's "
        f"first pod exists; if that pod is Pending (no node, or Kueue has not admitted the "
        f"job) run the check again later, otherwise every agent would wait "
        f"rendezvous.joinTimeoutSeconds and fail",
    )


# What each trainer path must hold: (what to call it, the files to find in a directory).
INPUTS = {
    "data.path": ("prepared data", ("tokens.bin", "tokens.json")),
    "model.hf_config": ("the model's config", ("config.json",)),
    "model.init_from": ("the weights", ("*.safetensors",)),
}


def check_input(key: str, value: str) -> Result:
    """``value`` (trainer key ``key``) exists and this process's user can read what it names.

    The prepared data of ``data.path``, the ``config.json`` of ``model.hf_config``, the safetensors
    of ``model.init_from``. ``transformers`` writes weights owner-only (0600) and the pods run as
    another user, so a copy that works for whoever made it can fail every rank at start. An
    ``s3://`` ``data.path`` is the trainer's to check (its bucket's access is the pods' role's).
    """
    name = f"input {key}"
    if value.startswith("s3://"):
        return Result(name, True, f"{value}: in S3, checked by the trainer at start")
    what, wanted = INPUTS[key]
    path = Path(value)
    if path.is_dir():
        files = [f for pattern in wanted for f in sorted(path.glob(pattern))]
        missing = [p for p in wanted if not any(path.glob(p))]
        if missing:
            return Result(
                name,
                False,
                f"{value} holds no {', '.join(missing)}: not {what}; set trainer.{key} to "
                "where it is on the shared volume (or in the image)",
            )
    elif path.is_file():
        files = [path]
    else:
        return Result(
            name,
            False,
            f"{value} does not exist in this pod (uid {os.getuid()}): put {what} on the "
            f"shared volume at that path, or set trainer.{key} to where it is",
        )
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        f = unreadable[0]
        st = f.stat()
        return Result(
            name,
            False,
            f"{f} cannot be read by uid {os.getuid()} (mode {stat.filemode(st.st_mode)}, "
            f"owner {st.st_uid}:{st.st_gid}){' and more' if len(unreadable) > 1 else ''}: "
            "make it readable by the pods' user or group (chmod a+r, or the pods' fsGroup "
            "and g+r)",
        )
    return Result(name, True, f"{value}: {len(files)} file(s) readable by uid {os.getuid()}")


def run_checks(args: argparse.Namespace) -> list[Result]:
    dev = Path(args.dev_dir)
    return [
        check_shared_volume(Path(args.shared_dir), Path(args.check_dir or args.shared_dir)),
        check_devices("GPUs", args.gpus, dev, r"nvidia[0-9]+", "NVIDIA device plugin"),
        check_devices("EFA", args.efa, dev / "infiniband", r"uverbs[0-9]+", "EFA device plugin"),
        check_memlock(args.memlock),
        check_rendezvous_host(args.rdzv_host, args.rdzv_port, args.rdzv_timeout),
    ] + [check_input(*spec.split("=", 1)) for spec in args.inputs]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m resilient_fsdp.deploy.release_check", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--shared-dir", required=True, help="where the shared volume is mounted (storage.mountPath)")
    p.add_argument("--check-dir", help="the checkpoint directory to create and write in; default: --shared-dir")
    p.add_argument("--rdzv-host", required=True, help="the host in every agent's --rdzv-endpoint")
    p.add_argument("--rdzv-port", type=int, default=29400, help="its port (reported only; default 29400)")
    p.add_argument("--rdzv-timeout", type=float, default=300.0, help="seconds to keep trying it (default 300)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs this pod requested (0: skip the check)")
    p.add_argument("--efa", type=int, default=0, help="EFA interfaces this pod requested (0: skip the check)")
    p.add_argument(
        "--memlock",
        action="store_true",
        help="check that the locked-memory limit is unlimited (the training pods use EFA)",
    )
    p.add_argument("--dev-dir", default="/dev", help="where device nodes appear (default /dev)")
    p.add_argument(
        "--input",
        dest="inputs",
        action="append",
        default=[],
        metavar="KEY=PATH",
        type=_input_spec,
        help=f"a trainer path to find readable ({', '.join(INPUTS)}; repeatable)",
    )
    return p


def _input_spec(text: str) -> str:
    key, sep, value = text.partition("=")
    if not sep or key not in INPUTS or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=PATH with KEY one of {', '.join(INPUTS)}")
    return text


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    results = run_checks(args)
    for result in results:
        print(result, flush=True)
    failed = [r.name for r in results if not r.ok]
    print(
        f"release check: {len(results) - len(failed)} ok, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
