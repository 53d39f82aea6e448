"""A rank's process ends as ``sys.exit(main())`` would, minus the interpreter's finalization.

Each case runs a real Python process whose main goes through :func:`run_and_exit`; an object
kept alive until the end says, in its ``__del__``, whether finalization ran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import resilient_fsdp

PROGRAM = """
import atexit, sys, threading, time
from resilient_fsdp.train.process_exit import run_and_exit

class Finalized:
    def __del__(self):
        sys.stdout.write("FINALIZED\\n")
        sys.stdout.flush()

KEPT = Finalized()  # freed only by the interpreter's finalization

def late_writer(path):
    time.sleep(0.3)
    with open(path, "w") as f:
        f.write("written")

def main():
    atexit.register(lambda: print("atexit ran"))
    sys.stdout.write("buffered, no newline")  # flushed only at the end
    threading.Thread(target=late_writer, args=(sys.argv[1],)).start()  # not a daemon
    # An idle pool's worker is not a daemon either; it leaves once threading's shutdown callback ran.
    global POOL  # kept, as a client library keeps its pool
    from concurrent.futures import ThreadPoolExecutor
    POOL = ThreadPoolExecutor(1)
    POOL.submit(lambda: None).result()
    {body}

run_and_exit(main)
"""


def run(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, Path]:
    written = tmp_path / "written"
    env = {**os.environ, "PYTHONPATH": str(Path(resilient_fsdp.__file__).resolve().parents[1])}
    # Written to stdout through a pipe: block-buffered, as a rank's streams are under a launcher.
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROGRAM).format(body=body), str(written)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, written


@pytest.mark.parametrize(
    "body, status",
    [("return 0", 0), ("return 3", 3), ("return None", 0), ("sys.exit(7)", 7), ("return 300", 300 & 0xFF)],
)
def test_the_exit_status_is_mains_and_threads_atexit_and_streams_finish_first(tmp_path, body, status):
    proc, written = run(tmp_path, body)
    assert proc.returncode == status, proc.stderr
    assert written.read_text() == "written"  # the non-daemon thread was waited for
    assert proc.stdout.startswith("buffered, no newline")
    assert "atexit ran" in proc.stdout
    # Without the interpreter's finalization: what only it frees is never freed.
    assert "FINALIZED" not in proc.stdout


def test_an_uncaught_exception_is_printed_by_the_excepthook_and_exits_1(tmp_path):
    proc, written = run(
        tmp_path,
        "sys.excepthook = lambda *e: print('hook:', e[1], file=sys.stderr)\n    raise RuntimeError('the rank failed')",
    )
    assert proc.returncode == 1
    assert "hook: the rank failed" in proc.stderr
    assert written.read_text() == "written" and "atexit ran" in proc.stdout
    assert "FINALIZED" not in proc.stdout


def test_a_message_given_to_sys_exit_is_printed_and_exits_1(tmp_path):
    proc, _ = run(tmp_path, "sys.exit('configuration refused')")
    assert proc.returncode == 1
    assert "configuration refused" in proc.stderr


def test_keyboard_interrupt_ends_the_process_as_the_interpreter_does(tmp_path):
    proc, _ = run(tmp_path, "raise KeyboardInterrupt")
    # The interpreter's own ending for it: the traceback, then death by SIGINT.
    assert proc.returncode == -signal.SIGINT
    assert "KeyboardInterrupt" in proc.stderr


def test_a_thread_that_never_ends_holds_the_exit_only_for_the_grace_and_is_named(tmp_path):
    """A non-daemon thread blocked for good (on a peer whose pod froze) would hold the exit, and
    the in-job restart that waits for it, for ever: past the grace the process ends, naming it."""
    body = (
        "import resilient_fsdp.train.process_exit as process_exit\n"
        "    process_exit.EXIT_GRACE_S = 1.0\n"
        "    def wait_for_a_peer_that_is_gone():\n"
        "        threading.Event().wait()\n"
        "    threading.Thread(target=wait_for_a_peer_that_is_gone, name='replica-receive').start()\n"
        "    return 4"
    )
    proc, written = run(tmp_path, body)
    assert proc.returncode == 4, proc.stderr
    assert "did not end within 1 s of its exit" in proc.stderr
    assert "replica-receive:" in proc.stderr and "in wait" in proc.stderr, proc.stderr
    assert written.read_text() == "written"  # the threads that end were still waited for
