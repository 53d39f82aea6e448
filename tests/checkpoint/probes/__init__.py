"""Scripts the checkpoint tests run as processes of their own (a world of one, gloo), each
printing one JSON line: ``round_trip`` (one save and resume), ``engine`` (the engine across failed
attempts and dead or hung writers), ``compare`` (checkpoints compared step by step), ``plan_cache``
(what a cached plan hands the writer), ``open_files`` (a state of thousands of tensors under a low
open-files limit, with the ``many_tensors`` model), ``writer_requests`` (the writer process's
limits and environment, and requests it cannot take); and ``object_group`` (the connections side
groups hold, in a world of eight gloo ranks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.support import run_guarded

HERE = Path(__file__).parent


def run_probe(script: str, run_dir: Path, *args, pythonpath=None, timeout: float = 240, open_files=None) -> dict:
    """Run ``HERE/script`` with ``run_dir`` and ``args`` (``open_files``: its (soft, hard) ``nofile``
    limit); its JSON line."""
    proc = run_guarded(
        [sys.executable, str(HERE / script), str(run_dir), *map(str, args)],
        run_dir,
        pythonpath,
        timeout=timeout,
        open_files=open_files,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
