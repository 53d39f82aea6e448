"""The errors a user's mistake raises: :class:`ConfigError` for a key, :class:`UsageError` for a flag.

``resilient-fsdp`` prints either as ``error: MESSAGE`` and exits 2; :func:`did_you_mean` is the
hint every unknown name gets; :func:`writable_file` and :func:`existing_file` check the paths a
command's flags name before any work starts.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterable


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message names the key and the fix."""

    # With the PyTorchJob restart policy `ExitCode`, codes 1-127 fail the job at once while
    # 128-255 recreate the pod: a retry cannot fix a configuration error, so fail fast.
    exit_code = 2


class UsageError(ConfigError):
    """A command-line flag or a file named by one that the command cannot use; the message names the flag."""


def did_you_mean(name: str, valid: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'PREFIXx'?)`` for the closest of ``valid`` to ``name``, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def writable_file(flag: str, path: Path) -> Path:
    """``path``, once a file can be written there; else :class:`UsageError` naming ``flag``
    (checked before the work, so a typo in an output path costs nothing)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file path")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: the directory {path.parent} does not exist; create it or write elsewhere")
    return path


def existing_file(text: str) -> str:
    """An argparse ``type`` for a file the command reads: argparse names the flag in its error."""
    import argparse

    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text
