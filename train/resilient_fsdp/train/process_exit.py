"""A rank's process ends without the interpreter's finalization.

Once a rank has closed what it owns, the interpreter's teardown of torch's modules costs about a
second of CPU a rank (2.3-2.9 s when four ranks of a 2-core node end together), and the launcher
sees a failed rank only once its process has ended: that time would be added to every in-job
restart. :func:`run_and_exit` ends the process with ``os._exit`` after what a normal exit does
before finalization; a thread that never ends holds it at most :data:`EXIT_GRACE_S`. The trainer's
``__main__`` uses it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn, Optional, Union

ExitCode = Union[int, str, None]


def run_and_exit(main: Callable[[], ExitCode]) -> NoReturn:
    """Run ``main`` and end the process with its exit code, as ``sys.exit(main())`` would: what the
    interpreter does up to finalization, in its order (threading's shutdown, ``atexit``, the
    streams flushed, an uncaught exception through ``sys.excepthook``), then ``os._exit``. Nothing
    written is lost: owners close their files before ``main`` returns; the metrics log is
    line-buffered."""
    try:
        code = exit_status(main())
    except SystemExit as stop:
        code = exit_status(stop.code)
    except KeyboardInterrupt:
        # The interpreter ends such a process by SIGINT itself, which its parent may read: keep that.
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finish(code)


def exit_status(code: ExitCode) -> int:
    """The status ``sys.exit(code)`` ends a process with (a message is printed, as it would be)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# How long an exit waits for the rank's threads: an idle pool's workers leave in milliseconds;
# one blocked on a peer that is gone (a frozen pod) would hold the exit, and with it the restart
# that the launcher starts only once this process has ended, for ever.
EXIT_GRACE_S = 30.0


def finish(status: int, grace_s: Optional[float] = None) -> NoReturn:
    """What the interpreter does before finalizing, then the end of the process; past ``grace_s``
    (:data:`EXIT_GRACE_S`) the process ends anyway, naming the threads still running and where
    they wait."""
    grace_s = EXIT_GRACE_S if grace_s is None else grace_s
    watchdog = threading.Timer(grace_s, _end_held_exit, (status, grace_s))
    watchdog.daemon = True
    watchdog.start()
    # The interpreter's own first step of an exit: the callbacks threading runs at shutdown (an
    # idle ThreadPoolExecutor's workers, boto's among them, leave only once theirs has run), then
    # every non-daemon thread joined.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # a closed or detached stream: nothing left to write
    os._exit(status)


def _end_held_exit(status: int, grace_s: float) -> None:
    frames = sys._current_frames()
    held = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    where = "; ".join(f"{t.name}: {_innermost(frames.get(t.ident))}" for t in held) or "none named"
    print(
        f"[resilient-fsdp] the process did not end within {grace_s:g} s of its exit; ending it. Threads still "
        f"running: {where}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(status)


def _innermost(frame) -> str:
    import traceback

    if frame is None:
        return "?"
    last = traceback.extract_stack(frame)[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"
