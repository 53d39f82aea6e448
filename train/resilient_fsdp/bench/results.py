"""What every ``resilient-fsdp bench`` does with its results: ``--out FILE`` as sorted JSON, the
form ``docs/benchmarks/*.json`` keeps them in (diffs between runs stay readable)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def write_results(results: dict, out: Optional[str]) -> None:
    if out:
        Path(out).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"results: {out}")
