"""Whether this process can write a directory on the shared volume, and the values that fix it.

A new FSx for Lustre file system's root belongs to root, and the FSx CSI driver does not apply
``fsGroup`` to a ReadWriteMany volume (its ``fsGroupPolicy`` is ``ReadWriteOnceWithFSType``), so a
pod running as a non-root user cannot write there on the first run. That is a configuration
failure: no restart fixes it; the chart's ``storage.prepare`` or the pod's user does.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from ..config import ConfigError


def require_writable(path: Path, key: str) -> None:
    """Raise :class:`ConfigError` unless this process can create ``path`` (the config's ``key``)
    and write a file in it; the probe file is removed again."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(not_writable_message(key, path, exc)) from None


def not_writable_message(key: str, path: Path, exc: OSError) -> str:
    """Why ``path`` (the config's ``key``) is not writable, naming the chart values that fix it."""
    return (
        f"{key}={str(path)!r} is not writable by uid {os.getuid()} gid {os.getgid()} ({exc.strerror or exc}): "
        f"{writable_fix(path)} (docs/eks-helm.md)"
    )


# Set by the chart when the pod's init container prepared the shared volume (storage.prepare).
PREPARED_ENV = "RESILIENT_FSDP_STORAGE_PREPARED"


def writable_fix(directory: Path) -> str:
    """The fixes, in the chart's values: prepare the directory, or run as its owner. The trainer and
    ``helm test`` (:mod:`resilient_fsdp.deploy.release_check`) both say this. Where the pod's init
    container already tried (``storage.prepare`` on), what it could not do is in its log."""
    uid, gid = os.getuid(), os.getgid()
    try:
        owner = f" (its owner, {directory.stat().st_uid})"
    except OSError:
        owner = ""
    if os.environ.get(PREPARED_ENV) == "true":
        return (
            f"storage.prepare is on and its init container could not make it so (`kubectl logs POD -c "
            f"prepare-storage` says what it could not do: a file system that squashes root, a directory another "
            f"UID owns, a read-only volume): chown {uid}:{gid} the directory on the file system yourself, or run "
            f"the pods as its owner (pod.securityContext.runAsUser/runAsGroup{owner})"
        )
    return (
        f"set storage.prepare=true (an init container creates the run and checkpoint directories and gives "
        f"them to uid {uid}, gid {gid}; a new FSx file system's root belongs to root and its CSI driver skips "
        f"fsGroup on a ReadWriteMany volume), or chown {uid}:{gid} the directory on the file system yourself, "
        f"or run the pods as the directory's owner (pod.securityContext.runAsUser/runAsGroup{owner})"
    )
