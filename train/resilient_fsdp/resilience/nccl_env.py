"""The environment torch.distributed and NCCL read, set by each rank before its process group exists.

Two concerns, each beside its data: what in-process restart needs of NCCL and torch
(:data:`IN_PROCESS_ENV`, applied before torch's first import by :func:`apply_before_torch`), and
where NCCL's flight recorder writes its hang dumps (:func:`dump_prefix`: the shared volume, not
the pod's home). A value set in the pod's environment wins. The entrypoint
(:mod:`resilient_fsdp.train.entrypoint`) and the pre-warmed server (:mod:`.prewarm`) apply it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, MutableMapping, Optional

from ..config import Config

# What NVRx's in-process usage guide requires. Without in-process restart none is set: the in-job
# restart wants a failed rank torn down.
IN_PROCESS_ENV = {
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP must be off for an abort to work
    # Abort the failed communicator and keep the process; ft_launcher injects 1 (tear the process
    # down), right for the in-job restart, fatal for an in-process one.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",  # else the watchdog ends the process before the wrapper restarts it
    # The wrapper's store waits time out by design, each a C++ warning; torch reads this once, at
    # import: hence :func:`apply_before_torch`.
    "TORCH_CPP_LOG_LEVEL": "error",
}
# NCCL's flight recorder writes one file per rank when a collective times out
# (TORCH_NCCL_DUMP_ON_TIMEOUT, set by the chart on GPU pods), by default under $HOME/.cache/torch,
# which a pod loses. The older name second; gloo never dumps, so on CPU the directory is left alone.
DUMP_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DUMP_DIR = "nccl-flight-recorder"


def layer_env(cfg: Config) -> dict[str, str]:
    """The variables the configured restart layers need (none without in-process restart)."""
    return dict(IN_PROCESS_ENV) if cfg.resilience.in_process.enabled else {}


def dump_prefix(run_dir: Path | str, restart_count: int | str) -> Path:
    """The flight recorder's file prefix for one in-job restart on the shared volume; torch appends
    the rank. ``restart_count``: ``TORCHELASTIC_RESTART_COUNT``, job-wide under NVRx 0.7."""
    return Path(run_dir) / DUMP_DIR / f"restart-{restart_count}" / "rank_"


def apply_before_torch(argv: list[str], environ: MutableMapping[str, str] = os.environ) -> None:
    """:func:`layer_env` for the trainer's arguments, before torch is imported. Silent, and a
    no-op when the arguments or the configuration are bad: the entrypoint reports those."""
    from ..train.arguments import build_parser, resolve_config

    try:
        args, _ = build_parser(quiet=True).parse_known_args(argv)
        cfg = resolve_config(args)
    except Exception:
        return
    environ.update(layer_env(cfg))


def apply(
    cfg: Config, nccl: bool, environ: MutableMapping[str, str] = os.environ, say: Optional[Callable[[str], None]] = None
) -> dict[str, str]:
    """Set the restart layers' variables and, when ``nccl`` (the process group will be NCCL's), the
    flight recorder's dump path (created); returns what was set. Rank 0 says it once."""
    done = layer_env(cfg)
    environ.update(done)
    said = [f"in-process restart: {', '.join(f'{k}={v}' for k, v in done.items())}"] if done else []
    if nccl:
        given = next((environ[k] for k in DUMP_FILE_VARS if environ.get(k)), None)
        if given is None:
            prefix = dump_prefix(cfg.run_dir, environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            prefix.parent.mkdir(parents=True, exist_ok=True)
            for key in DUMP_FILE_VARS:
                done[key] = environ[key] = str(prefix)
            said.append(f"NCCL flight-recorder dumps go to {prefix}<rank>")
        else:
            said.append(f"NCCL flight-recorder dumps go to {given}<rank> (set in the environment)")
    if said and environ.get("RANK", "0") == "0":
        (say or (lambda m: print(m, file=sys.stderr, flush=True)))(f"[resilient-fsdp] rank 0: {'; '.join(said)}")
    return done
