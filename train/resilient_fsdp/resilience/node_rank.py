"""A node's place in the job: its index (the pod's), who hosts the rendezvous store, its node rank.

Every workload controller numbers its pods in its own variable (:func:`node_index`). The node
agent (:mod:`.agent`) pins to that index three decisions NVRx otherwise makes on its own: who
hosts the store (:func:`with_store_host`), the rendezvous id of this install
(:func:`with_install`) and the node rank (:func:`launcher_env`). Each is left alone when the
launcher's arguments or environment already set it.
"""

from __future__ import annotations

from typing import Mapping, Optional

NODE_INDEX_ENV = "RESILIENT_FSDP_NODE_INDEX"
# This install of the job (the chart passes its JobSet's UID), and the job's own id, set by the
# agent for the trainer (:func:`with_install`).
INSTALL_ENV = "RESILIENT_FSDP_INSTALL_ID"
JOB_ENV = "RESILIENT_FSDP_JOB_ID"
# In the order they are read: the operator's node rank, the Indexed Job's index, the chart's.
INDEX_SOURCES = ("PET_NODE_RANK", "JOB_COMPLETION_INDEX", NODE_INDEX_ENV)


class NodeIndexError(ValueError):
    """A node index that is not a non-negative integer; the message names the variable."""


def node_index(env: Mapping[str, str]) -> Optional[int]:
    """The pod's index in the job from the first of :data:`INDEX_SOURCES` that is set; None when
    none is (a node run by hand, outside a workload controller).

    Each controller says it differently: the training operator sets ``PET_NODE_RANK`` (PyTorchJob
    with a Master, Trainer's torch plugin), an Indexed Job ``JOB_COMPLETION_INDEX`` (JobSet); an
    elastic PyTorchJob sets neither, so the chart passes its replica-index label as
    :data:`NODE_INDEX_ENV`.
    """
    for name in INDEX_SOURCES:
        text = env.get(name, "").strip()
        if text:
            if not text.isdigit():
                raise NodeIndexError(f"{name}={text!r}: a pod's index must be a non-negative integer")
            return int(text)
    return None


def rdzv_conf(args: list[str]) -> dict[str, str]:
    """The ``key=value`` pairs of every ``--rdzv-conf`` in ``args`` (ft_launcher's own flags,
    before the training module's)."""
    pairs: dict[str, str] = {}
    for arg in _launcher_part(args):
        if arg.startswith("--rdzv-conf="):
            for item in arg.split("=", 1)[1].split(","):
                if "=" in item:
                    key, value = item.split("=", 1)
                    pairs[key.strip()] = value.strip()
    return pairs


def rdzv_endpoint(args: list[str]) -> Optional[tuple[str, int]]:
    """The host and port of ``--rdzv-endpoint`` (or ``--rdzv_endpoint``, either as ``=VALUE`` or
    as the next argument) among ft_launcher's flags; None when absent or without a port.
    An IPv6 address comes in brackets: ``[fd00::1]:29400``."""
    launcher = _launcher_part(args)
    value = None
    for i, arg in enumerate(launcher):
        for flag in ("--rdzv-endpoint", "--rdzv_endpoint"):
            if arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            elif arg == flag and i + 1 < len(launcher):
                value = launcher[i + 1]
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def with_store_host(args: list[str], is_host: bool) -> list[str]:
    """``args`` with ``is_host`` in its ``--rdzv-conf`` (added to the first, or as a new flag
    before the training module), unless one already says.

    Index 0 hosts. Without it NVRx 0.7 decides by matching the endpoint's name against the machine,
    separately in three places; under a JobSet the endpoint matches only through cluster DNS, so a
    record published late means that nobody hosts.
    """
    if "is_host" in rdzv_conf(args):
        return list(args)
    flag = f"is_host={'true' if is_host else 'false'}"
    end = len(_launcher_part(args))
    out = list(args)
    for i in range(end):
        if out[i].startswith("--rdzv-conf="):
            out[i] = f"{out[i]},{flag}"
            return out
    out.insert(end, f"--rdzv-conf={flag}")
    return out


def with_install(args: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """``args`` whose ``--rdzv-id`` names this install (``<id>-<first 8 of INSTALL_ENV>``), and
    ``env`` with :data:`JOB_ENV` = the id as given, the job the trainer's lease names: a new
    install of a release is the same job (its checkpoints, its ``resume_from`` record) but never
    joins an old install's rendezvous store. Unchanged without :data:`INSTALL_ENV` or an id."""
    install = env.get(INSTALL_ENV, "").strip()
    out, extra = list(args), dict(env)
    end = len(_launcher_part(args))
    for i in range(end):
        for flag in ("--rdzv-id", "--rdzv_id"):
            if out[i].startswith(flag + "="):
                given = out[i].split("=", 1)[1]
                at = i
            elif out[i] == flag and i + 1 < end:
                given, at = out[i + 1], i + 1
            else:
                continue
            if install and given:
                out[at] = f"{given}-{install[:8]}" if at == i + 1 else f"{flag}={given}-{install[:8]}"
                extra.setdefault(JOB_ENV, given)
            return out, extra
    return out, extra


def _launcher_part(args: list[str]) -> list[str]:
    """ft_launcher's flags: everything before the training module (``-m MODULE``, as the chart
    and the local cluster run it)."""
    return args[: args.index("-m")] if "-m" in args else args


# Set by the node agent for its ranks: how many hot spares the job has (:func:`spares`).
SPARES_ENV = "RESILIENT_FSDP_SPARES"


def spares(args: list[str]) -> int:
    """The hot spares ft_launcher's ``--nnodes=N:M`` asks for (M - N); 0 without a range."""
    for arg in _launcher_part(args):
        if arg.startswith("--nnodes="):
            low, _, high = arg.split("=", 1)[1].partition(":")
            if low.isdigit() and high.isdigit():
                return max(0, int(high) - int(low))
    return 0


def launcher_env(env: Mapping[str, str], index: Optional[int]) -> dict[str, str]:
    """``env`` with ``GROUP_RANK`` set to the node's index, unless already set.

    Without it NVRx 0.7 orders nodes by their FQDN as a string: in a 16-pod job pods 10..15 would
    take node ranks 2..7, against the order topology-aware placement used.
    """
    out = dict(env)
    if index is not None:
        out.setdefault("GROUP_RANK", str(index))
    return out
