"""A pod's paths as this machine sees them: the one rule for rewriting a mount path (``/fsx``,
``/etc/resilient-fsdp``) into its host directory, in commands, in the files pods read, and in
the lines the console shows a user (the pods' own logs keep the pods' view).
"""

from __future__ import annotations

import re

IN_TEXT = r"(?:^|(?<=[\s'\"=(\[]))"  # a path in prose or a file: after a space, a quote, = or a bracket


def replace_paths(text: str, paths: list[tuple[str, str]], before: str) -> str:
    """Each path of ``paths`` (``(from, to)``), where it stands as a whole path or a path's start
    (``/fsx`` or ``/fsx/x``, after ``before``), replaced in one pass: a replacement is never
    replaced again."""
    if not paths:
        return text
    table = dict(paths)
    alternatives = "|".join(re.escape(p) for p in sorted(table, key=len, reverse=True))
    return re.sub(rf"{before}({alternatives})(?=/|$|[\s'\",:;)\]])", lambda m: table[m.group(1)], text, flags=re.M)
