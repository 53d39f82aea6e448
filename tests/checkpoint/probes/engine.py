"""The checkpoint engine across attempts and dead writers, in one process (a world of one), run by
test_checkpoint_failures.py and test_staging.py against each NVRx lane.

usage: python engine.py RUN_DIR SCENARIO MODE

- ``stale``: what an in-process restart does to the engine: attempt 1 starts a save and fails
  while the write is in flight (the trainer closes with ``failed=True``: the engine is drained
  and the save forgotten); attempt 2, on the same engine, resumes and saves at every step while
  the non-tensor state changes size from save to save (the sampler's position crosses a pickle
  boundary; Python's ``random`` is drawn from a varying number of times). Every committed checkpoint is then loaded into a fresh trainer and
  compared, bit for bit, with the state captured when it was saved.
- ``dead-worker``: the writer process is killed between saves; the next save starts a new one
  and commits, and after another kill, closing returns at once.
- ``warm``: the staging buffers allocated after the first step are the ones the first save fills,
  and a job that never saves allocates none.
- ``orphan``: a trainer (``orphan-child``, a process of its own) is killed with SIGKILL while its
  writer is in the middle of a (slowed) write; the writer, which blocks SIGTERM, exits by itself
  within seconds, and the write it was doing is never committed. This process is the orphans'
  subreaper, so it can reap the writer and see when it exits.
- ``back-to-back``: a save made while the previous write is still running (slowed by 3 s) waits
  for it; that wait is the new save's stall (its ``previous_s``), counted once.
- ``commit-in-flight``: the step's poll hands a finished write's commit to rank 0's commit
  process and returns at once; a failed attempt closing while that (slowed) commit runs lets it
  finish, so the checkpoint is committed before the lease is released and a next start looks at it.
- ``commit-process-dies``: the commit process is killed in a commit (once it has started it): a
  failed save, counted, the checkpoint left incomplete; the next save commits in a new commit process.
- ``commit-inline``: no commit process can start: the commit runs on the training thread, and
  its record counts it in the stall, not as background work.
- ``commit-hangs``: the commit process never finishes: at ``checkpoint.write_timeout_s`` a failed
  save (a timeout), the process killed; the next save commits in a new commit process.
- ``hung-writer``: a write never finishes: waiting for it fails at ``checkpoint.write_timeout_s``,
  the failed attempt closes without waiting for it again, and the next attempt (an in-process
  restart) gets a new engine that commits.

Prints one JSON line.
"""

import json
import os
import random
import sys
import time
from pathlib import Path

import psutil

from round_trip import equal, snapshot
from resilient_fsdp.checkpoint import commit, store
from resilient_fsdp.checkpoint.writer.process import NVRX_VERSION
from resilient_fsdp.checkpoint.resume import load
from resilient_fsdp.config import load_config
from resilient_fsdp.train import distributed
from resilient_fsdp.train.resources import ProcessResources
from resilient_fsdp.train.trainer import Trainer


def step(trainer):
    trainer.train_step()
    trainer.counters.step += 1
    return trainer.counters.step


def stale(run_dir, mode):
    # 64 samples a step: the sampler's position, a pickled int, crosses 255 -> 256 between the saves
    # of steps 3 and 4 and takes a byte more from then on.
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"checkpoint.mode={mode}",
            "train.steps=100",
            "checkpoint.save_final=false",
            "checkpoint.keep_last=0",
            "data.micro_batch_size=64",
        ],
    )
    resources = ProcessResources(cfg)
    first = Trainer(cfg, resources)
    step(first)
    first.checkpointer.save(1)
    first.checkpointer.wait()
    step(first)
    first.checkpointer.save(2)  # in flight when the attempt fails
    first.close(failed=True)
    distributed.shutdown(clean=False)

    second = Trainer(cfg, resources)
    resumed = second.checkpointer.resume()
    saved = {}
    for i in range(6):
        for _ in range(1 + 37 * i):
            random.random()  # the pickled Python RNG state changes size with what was drawn
        n = step(second)
        saved[n] = snapshot(second)
        second.checkpointer.save(n)
        second.checkpointer.wait()
    second.close(failed=False)
    distributed.shutdown()

    fresh = Trainer(cfg, resources)
    results = {}
    for info in store.scan(fresh.cfg.checkpoint_dir)[0]:
        if info.step not in saved:
            continue
        error = load(fresh.checkpointer.state, info, 0, True)
        after = snapshot(fresh) if error is None else None
        results[info.step] = error or all(equal(saved[info.step][k], after[k]) for k in saved[info.step])
    fresh.close(failed=False)
    resources.close(False)
    return {"resumed_step": resumed, "loaded_bitwise": results}


def dead_worker(run_dir, mode):
    cfg = load_config(
        None, [f"run_dir={run_dir}", f"checkpoint.mode={mode}", "train.steps=100", "checkpoint.save_final=false"]
    )
    trainer = Trainer(cfg)
    out = {}
    step(trainer)
    trainer.checkpointer.save(1)
    out["first"] = trainer.checkpointer.wait() is not None
    engine = trainer.checkpointer.engine

    def kill_worker():
        proc = engine.writer.process
        psutil.Process(proc.pid).kill()
        proc.join(10)

    kill_worker()
    step(trainer)
    trainer.checkpointer.save(2)  # the dead writer is noticed and replaced
    out["after_dead_worker"] = trainer.checkpointer.wait() is not None
    kill_worker()
    t0 = time.monotonic()
    trainer.close(failed=False)
    out["close_s"] = time.monotonic() - t0
    distributed.shutdown()
    return out


def hung_writer(run_dir, mode):
    # The healthy writes get a deadline a loaded machine meets (the writer runs niced, so other
    # processes on the machine slow it down); the hung one gets 2 s.
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"checkpoint.mode={mode}",
            "train.steps=100",
            "checkpoint.save_final=false",
            "checkpoint.write_timeout_s=120",
            "resilience.inject=[writer-hang@2]",
        ],
    )
    resources = ProcessResources(cfg)
    first = Trainer(cfg, resources)
    out = {}
    step(first)
    first.checkpointer.save(1)
    out["first"] = first.checkpointer.wait() is not None
    step(first)
    first.checkpointer.save(2)
    first.checkpointer.cfg.write_timeout_s = 2
    try:
        first.checkpointer.wait()
        out["late_error"] = None
    except Exception as exc:  # noqa: BLE001 - the probe reports what was raised
        out["late_error"] = str(exc)
    first.checkpointer.cfg.write_timeout_s = 120
    hung = first.checkpointer.engine
    t0 = time.monotonic()
    first.close(failed=True)
    out["close_s"] = time.monotonic() - t0
    distributed.shutdown(clean=False)

    second = Trainer(cfg, resources)
    out["resumed_step"] = second.checkpointer.resume()
    out["replaced"] = second.checkpointer.engine is not hung and not second.checkpointer.engine.hung
    step(second)
    second.checkpointer.save(3)
    out["after_restart"] = second.checkpointer.wait() is not None
    second.close(failed=False)
    distributed.shutdown()
    resources.close(False)
    return out


def slow_second_write(run_dir, mode, seconds):
    """A trainer (a world of one) whose save of step 1 is committed, so its writer is up, and
    whose write of step 2 will finish ``seconds`` late; and whether step 1 was committed."""
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"checkpoint.mode={mode}",
            "train.steps=100",
            "checkpoint.save_final=false",
            f"resilience.inject=[writer-slow@2:for={seconds}]",
        ],
    )
    trainer = Trainer(cfg)
    step(trainer)
    trainer.checkpointer.save(1)
    return trainer, trainer.checkpointer.wait() is not None


def orphan_child(run_dir, mode):
    trainer, committed = slow_second_write(run_dir, mode, 600)
    step(trainer)
    trainer.checkpointer.save(2)  # its writer sleeps 600 s after writing the data
    engine = trainer.checkpointer.engine
    proc = engine.writer.process
    print(json.dumps({"committed": committed, "writer_pid": proc.pid}), flush=True)
    time.sleep(600)  # killed by the parent scenario


def reap_orphans(timeout_s):
    """Reap what the killed trainer left to this subreaper (its resource tracker ends once every
    pipe to it is closed); the pids still running at the deadline are killed and returned."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []
        if pid == 0:
            time.sleep(0.1)
    left = psutil.Process().children()
    for p in left:
        p.kill()
    return [p.pid for p in left]


def orphan(run_dir, mode):
    import ctypes
    import signal
    import subprocess

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = subprocess.Popen(
        [sys.executable, __file__, run_dir, "orphan-child", mode], stdout=subprocess.PIPE, text=True
    )
    line = child.stdout.readline()
    while line and not line.startswith("{"):  # the trainer's own lines (its open-files limit) come first
        line = child.stdout.readline()
    first = json.loads(line)
    writer = first["writer_pid"]
    time.sleep(2)  # the write of step 2 is under way (its data is written, then it sleeps)
    out = {"committed": first["committed"], "writer_alive_before": psutil.pid_exists(writer)}
    child.send_signal(signal.SIGKILL)
    child.wait()
    t0 = time.monotonic()
    out["writer_exit_s"], out["writer_code"] = None, None
    while time.monotonic() - t0 < 30:
        pid, status = os.waitpid(writer, os.WNOHANG)
        if pid == writer:
            out["writer_exit_s"] = time.monotonic() - t0
            out["writer_code"] = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.1)
    else:
        psutil.Process(writer).kill()  # the test fails; nothing is left behind
        os.waitpid(writer, 0)
    out["others_left"] = reap_orphans(30)
    complete = store.scan(load_config(None, [f"run_dir={run_dir}"]).checkpoint_dir)[0]
    out["complete_steps"] = [info.step for info in complete]
    return out


def back_to_back(run_dir, mode):
    trainer, _ = slow_second_write(run_dir, mode, 3)
    step(trainer)
    trainer.checkpointer.save(2)  # its write takes 3 s more
    t0 = time.monotonic()
    step(trainer)
    trainer.checkpointer.save(3)  # waits for the write of step 2
    waited = time.monotonic() - t0
    trainer.checkpointer.wait()
    records = {r["step"]: r for r in trainer.checkpointer.records}
    trainer.close(failed=False)
    distributed.shutdown()
    return {
        "waited_s": waited,
        "stall_s": {s: r["stall_s"] for s, r in records.items()},
        "previous_s": {s: r["save_call_parts_s"]["previous_s"] for s, r in records.items()},
    }


def commit_started_marker(job) -> Path:
    """The file a test commit creates as it starts, beside the checkpoint it commits: what a
    test waits for before acting mid-commit (never a guess of how long the process takes to start)."""
    return Path(job.where).parent / f".commit-started-{job.step}"


def slow_commit(job):
    """:func:`commit.run`, two seconds late (run in rank 0's commit process)."""
    commit_started_marker(job).write_text(str(os.getpid()))
    time.sleep(2.0)
    return commit.run(job)


def hung_commit(job):
    """A commit that never finishes (run in rank 0's commit process)."""
    commit_started_marker(job).write_text(str(os.getpid()))
    while True:
        time.sleep(60)


def wait_for_marker(path: Path, timeout_s: float = 60.0) -> int:
    """The pid written in ``path`` once it exists (the commit has started)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear: the commit never started")
        time.sleep(0.01)
    return int(path.read_text() or 0)


def handed_off(trainer, step_no):
    """Save ``step_no`` and poll until its commit is handed to the commit process; each poll's time."""
    ckpt = trainer.checkpointer
    step(trainer)
    ckpt.save(step_no)
    polls = []
    while not (ckpt.pending is not None and ckpt.pending.committing):
        t0 = time.monotonic()
        ckpt.poll()  # without votes: a world of one agrees in its own collectives
        polls.append(time.monotonic() - t0)
        time.sleep(0.01)
    return polls


def slow_commit_trainer(run_dir, mode):
    """(config, resources, trainer) whose rank 0 commits with :func:`slow_commit`."""
    cfg = load_config(
        None, [f"run_dir={run_dir}", f"checkpoint.mode={mode}", "train.steps=100", "checkpoint.save_final=false"]
    )
    resources = ProcessResources(cfg)
    trainer = Trainer(cfg, resources)
    trainer.checkpointer.commits.process = commit.CommitProcess(slow_commit)
    return cfg, resources, trainer


def commit_in_flight(run_dir, mode):
    cfg, resources, trainer = slow_commit_trainer(run_dir, mode)
    ckpt = trainer.checkpointer
    polls = handed_off(trainer, 1)
    in_flight = ckpt._commit_running()
    future = ckpt.commits.future
    t0 = time.monotonic()
    trainer.close(failed=True)
    close_s = time.monotonic() - t0
    committed = [c.step for c in store.scan(cfg.checkpoint_dir)[0]]
    distributed.shutdown(clean=False)
    resources.close(False)
    return {
        "handoff_poll_s": polls[-1],
        "in_flight": in_flight,
        "close_s": close_s,
        "committed": committed,
        "commit_pid": future.result().pid,
        "rank_pid": os.getpid(),
    }


def commit_process_dies(run_dir, mode):
    """The commit process is killed while it commits step 1: the ranks learn a failed save (the
    checkpoint stays incomplete) and go on; step 2 commits in a new commit process."""
    cfg, resources, trainer = slow_commit_trainer(run_dir, mode)
    ckpt = trainer.checkpointer
    handed_off(trainer, 1)
    # The process is in the slowed commit: killed mid-commit, not before it began.
    pid = wait_for_marker(cfg.checkpoint_dir / ".commit-started-1")
    (victim,) = [p for p in psutil.Process().children(recursive=True) if p.pid in ckpt.commits.process._pool._processes]
    mid_commit = victim.pid == pid
    victim.kill()
    while ckpt._commit_running():
        time.sleep(0.01)
    failed = ckpt.streak.count
    ckpt._periodic(ckpt.poll)  # learns the failure, counts it, goes on (as after_step does)
    streak = ckpt.streak.count
    ckpt.commits.process.fn = commit.run
    handed_off(trainer, 2)
    while ckpt.pending is not None:
        ckpt.poll()
        time.sleep(0.01)
    committed = [c.step for c in store.scan(cfg.checkpoint_dir)[0]]
    trainer.close(failed=False)
    distributed.shutdown()
    resources.close(False)
    return {"streak_before": failed, "streak_after": streak, "committed": committed, "killed_mid_commit": mid_commit}


def commit_hangs(run_dir, mode):
    """The commit process never finishes step 1's commit: at ``checkpoint.write_timeout_s`` after
    the hand-over (8 s: a new commit process's start counts in it) every rank learns a failed save
    (a timeout, counted), the process is killed, the checkpoint stays incomplete; step 2 commits
    in a new commit process."""
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"checkpoint.mode={mode}",
            "train.steps=100",
            "checkpoint.save_final=false",
            f"checkpoint.write_timeout_s={HUNG_COMMIT_TIMEOUT_S}",
        ],
    )
    resources = ProcessResources(cfg)
    trainer = Trainer(cfg, resources)
    ckpt = trainer.checkpointer
    ckpt.commits.process = commit.CommitProcess(hung_commit)
    try:
        handed_off(trainer, 1)
        handed = time.monotonic()  # the deadline runs from the hand-over, the process's start included
        pid = wait_for_marker(cfg.checkpoint_dir / ".commit-started-1")
        while ckpt.streak.count == 0 and time.monotonic() - handed < 60:
            ckpt._periodic(ckpt.poll)  # as after_step does at every step: learns the failure, counts it
            time.sleep(0.05)
        learned_s = time.monotonic() - handed
        hung_alive = not gone_within(pid, 10.0)  # SIGKILLed: gone (or a zombie) once the kernel acts on it
        ckpt.commits.process.fn = commit.run
        handed_off(trainer, 2)
        while ckpt.pending is not None:
            ckpt._periodic(ckpt.poll)
            time.sleep(0.01)
        committed = [c.step for c in store.scan(cfg.checkpoint_dir)[0]]
    finally:
        trainer.close(failed=False)
        distributed.shutdown()
        resources.close(False)
    return {"learned_s": learned_s, "streak": ckpt.streak.count, "hung_alive": hung_alive, "committed": committed}


HUNG_COMMIT_TIMEOUT_S = 8


def commit_inline(run_dir, mode):
    """No commit process can start (as with the open-files limit reached: the start raises
    EMFILE): step 1's commit is made on the training thread, and its record says so: not
    background work, and its seconds in the stall."""

    class NoProcesses:
        @staticmethod
        def get_context(method=None):
            raise OSError(24, "Too many open files")

    commit.multiprocessing = NoProcesses
    commit.fork_server.writer_context = lambda: None
    cfg, resources, trainer = slow_commit_trainer(run_dir, mode)
    ckpt = trainer.checkpointer
    try:
        handed_off(trainer, 1)
        while ckpt.pending is not None:
            ckpt._periodic(ckpt.poll)
            time.sleep(0.01)
        (record,) = ckpt.records
    finally:
        trainer.close(failed=False)
        distributed.shutdown()
        resources.close(False)
    return {
        "stall_s": record["stall_s"],
        "commit_s": record["commit_s"],
        "background": record["commit_background"],
        "commit_on_thread_s": record["commit_on_thread_s"],
    }


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def warm(run_dir, mode):
    """``Checkpointer.prepare`` after the first step: the staging buffers are allocated in the
    background for a job that will save, and the first save fills them (no second allocation);
    a job that never saves allocates none."""
    out = {}
    for name, saves in (
        ("never", ["checkpoint.interval_steps=0", "checkpoint.save_final=false"]),
        ("saves", ["checkpoint.interval_steps=2", "checkpoint.save_final=false"]),
    ):
        cfg = load_config(None, [f"run_dir={run_dir}/{name}", f"checkpoint.mode={mode}", *saves])
        trainer = Trainer(cfg)
        step(trainer)
        trainer.checkpointer.prepare()
        stager = trainer.resources.engine.stager
        out[f"{name}_allocating"] = stager.allocating is not None or stager.buffers is not None
        if name == "saves":
            step(trainer)
            trainer.checkpointer.save(2)
            out["committed"] = trainer.checkpointer.wait() is not None
            out["allocations"] = stager.generation
        trainer.close(failed=False)
        distributed.shutdown()
    return out


if __name__ == "__main__":
    run_dir, scenario, mode = sys.argv[1:4]
    report = {
        "stale": stale,
        "dead-worker": dead_worker,
        "hung-writer": hung_writer,
        "warm": warm,
        "orphan": orphan,
        "orphan-child": orphan_child,
        "back-to-back": back_to_back,
        "commit-in-flight": commit_in_flight,
        "commit-process-dies": commit_process_dies,
        "commit-hangs": commit_hangs,
        "commit-inline": commit_inline,
    }[scenario](run_dir, mode)
    print(json.dumps({"nvrx_version": NVRX_VERSION, **{k: v for k, v in report.items()}}, default=str))
