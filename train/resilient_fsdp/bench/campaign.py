"""``resilient-fsdp bench campaign``: a week of a job's faults in ten minutes, and what must stay true.

One local job (``--nodes`` pods x 1 rank, a JobSet, one run directory) goes through the four legs
of :data:`LEGS`, with a fault every ``--fault-every-steps`` steps of each leg, ``--kinds`` in turn
(a kind not in ``FAULT_KINDS`` is refused before anything starts; one this isolation cannot run
is reported as skipped). The S3 tier runs against a moto server on loopback, which netns pods
reach through the local cluster's relay, so a ``partition`` cuts a pod's uploads too. Every
``--sample-every-s`` seconds it samples the checkpoint bytes (set-aside directories apart), the
bucket's bytes and each pod's processes and open files. The same job without faults is the
reference. The checks (:data:`CHECKS`) and where the time went are printed; ``--out`` writes
them as JSON. Exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import psutil
import yaml

from ..checkpoint.run_identity import read_run_identity
from ..checkpoint import store
from ..checkpoint.store import MARKER
from ..config import FAULT_KINDS
from .recovery import fresh_dir
from .results import write_results

RUN_MARK_ENV = "RESILIENT_FSDP_BENCH_CAMPAIGN"
"""Set in every leg's environment (inherited by every process a pod runs): how the sampler and the
leftover check find the job's processes, however they were re-parented."""
POD_ENV = "RESILIENT_FSDP_LOCAL_POD"  # the local cluster's per-pod mark: ``<run id>/<pod hostname>``
# Each leg one `resilient-fsdp local` launch: train to the stop step with faults; relaunch from the older
# kept checkpoint (steps trained again, :func:`rewind_step`); relaunch with half the pods (a
# reshard); relaunch with every pod to --steps. A job's world is fixed (hot spares keep it), so it
# changes size as an operator changes it: a relaunch at another size.
LEGS = ("main", "rewind", "shrink", "regrow")
SET_ASIDE = (".abandoned-", ".superseded-")
DEFAULT_KINDS = (
    "sigkill-during-save:rank=1,node-loss:node=0,hang:rank=2,partition:node=1:for=20,"
    "sigkill-during-save:rank=3,nan-loss:rank=0,hang-in-collective:rank=2,sigkill:rank=0,"
    "node-loss:node=1,exception:rank=3,node-loss:node=0,writer-raise:rank=1"
)
KEEP_LAST = 2
# Each launch's restart budgets: in-job restarts (ft_launcher) and pod recreations (the local
# cluster); what a launch used of them is reported, and must stay within one per fault.
MAX_RESTARTS, MAX_POD_RECREATIONS = 50, 50
# The fault tests' settings: a stuck rank is killed 2 s after SIGTERM, a hung step is detected
# after 8 s, rank monitors look twice a second; a write or commit that has not finished in 30 s
# (a writer-hang: a save of the tiny model takes milliseconds) fails its save.
COMMON = [
    "dist.timeout_s=60",
    "resilience.launcher.workers_stop_timeout_s=2",
    "resilience.hang_detection.workload_check_interval_s=0.5",
    "resilience.hang_detection.step_timeout_s=8",
    "resilience.hang_detection.learn_timeouts=false",
    f"checkpoint.keep_last={KEEP_LAST}",
    "checkpoint.write_timeout_s=30",
]
S3_SETTINGS = [
    f"checkpoint.s3.keep_last={KEEP_LAST}",
    "checkpoint.s3.connect_timeout_s=1",
    "checkpoint.s3.read_timeout_s=2",
    "checkpoint.s3.max_attempts=2",
    "checkpoint.s3.retry_backoff_s=0.5",
    "checkpoint.s3.retry_backoff_max_s=2",
]
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    "AWS_EC2_METADATA_DISABLED": "true",
}

CHECKS = {
    "legs_finished": "every leg's launch ended 0 at its stop step",
    "disk_bounded": "checkpoint.dir (set-asides apart) <= (keep_last + 1 in flight + 1 torn) x checkpoint + margin",
    "bucket_bounded": "the bucket <= (s3.keep_last + 1 in flight + 1 torn by a fault, swept after the next "
    "upload) x checkpoint + margin",
    "open_files_bounded": "per pod, the job's open files <= 2 x the fault-free job's peak",
    "processes_bounded": "per pod, the job's processes <= 2 x the fault-free job's peak",
    "threads_bounded": "per pod, the job's threads <= 2 x the fault-free job's peak",
    "shm_bounded": "the memory tier's bytes in the pods' /dev/shm <= 2 x the fault-free job's peak + 1 MiB",
    "resources_bounded_after_every_fault": "once each fault is recovered, every pod's descriptors, threads and "
    "processes and the /dev/shm bytes are within those bounds",
    "resources_do_not_grow_fault_after_fault": "in each run of in-process restarts that no other restart cuts (the "
    "same processes), the figures after its last exceed those after its "
    "first by no more than a margin (descriptors 64, threads 16, "
    "processes 2): no leak per restart in the same processes",
    "ledger_is_the_schedule": "the ledger (<run_dir>/faults) holds each scheduled fault once, and nothing else",
    "summary_is_the_ledger": "summary.json's faults_injected are the ledger's faults",
    "one_recovery_per_stopping_fault": "every fired fault that stops training has one recovery (a partition may "
    "instead have gone on)",
    "restarts_count_the_recoveries": "restarts by layer (summary.json: attempts that reached training) = the "
    "attempts of that layer that closed recoveries",
    "pod_budget_counts_real_failures": "pod failures counted against backoffLimit <= job-level recoveries of "
    "faults other than node-loss (a lost node is a disruption, not counted); "
    "no whole-JobSet restart",
    "rewind_resumed_at_its_step": "the rewind leg's first step is N + 1 (resume_from=step_N)",
    "rewind_restarts_stay_on_its_line": "every restart within the rewind leg resumed from step N or a later "
    "checkpoint of the rewound line, never an older one or a set-aside one",
    "losses_equal_fault_free": "every step trained at the reference's world size on its line (main and "
    "rewind legs) has the fault-free job's loss, exactly",
    "no_processes_left": "no process of the job outlives it",
    "no_pods_left": "no network namespace, veth or bridge outlives it",
    "incomplete_dirs_at_most_one": "at most one .incomplete-* checkpoint directory is left",
    "no_markerless_s3_prefixes": "every step_N/ under the S3 prefix has its marker",
}


@dataclasses.dataclass
class Fault:
    leg: str
    spec: str  # KIND@STEP:target, or the slot's entry when skipped
    kind: str
    step: int
    skipped: Optional[str] = None


@dataclasses.dataclass
class Leg:
    name: str
    pods: int
    first_step: int  # the step it resumes from (0: a fresh start)
    stop_step: int
    overrides: list[str]
    faults: list[Fault]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "campaign",
        help="a long mixed schedule of faults, rewinds and resizes: what stays bounded",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--run-dir", default="runs/bench-campaign", help="scratch directory for the jobs")
    p.add_argument("--nodes", type=int, default=4, help="pods (one rank each) of the main, rewind and regrow legs")
    p.add_argument(
        "--steps",
        type=int,
        default=3600,
        help="steps of the whole campaign (default 3600: about ten minutes of training at 6 steps/s)",
    )
    p.add_argument("--interval-steps", type=int, default=40, help="checkpoint.interval_steps")
    p.add_argument("--fault-every-steps", type=int, default=120, help="one fault this many steps apart in each leg")
    p.add_argument(
        "--kinds", default=DEFAULT_KINDS, help="comma-separated KIND[:rank=R|:node=N][:for=S] entries, used in turn"
    )
    p.add_argument(
        "--isolation",
        choices=("netns", "loopback"),
        default="netns",
        help="netns: pods as network namespaces (partition runs); loopback: plain processes (partition skipped)",
    )
    p.add_argument(
        "--s3", choices=("on", "off"), default="on", help="the S3 tier against a local moto server (default on)"
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per pod (default 1)")
    p.add_argument("--in-process", action="store_true", help="in-process restart on as well")
    p.add_argument(
        "--memory-interval-steps",
        type=int,
        default=0,
        help="checkpoint.memory.interval_steps: the memory tier's snapshots (default 0: off)",
    )
    p.add_argument(
        "--memory-replicas",
        type=int,
        choices=(0, 1),
        default=1,
        help="checkpoint.memory.replicas with the memory tier on (default 1)",
    )
    p.add_argument("--spares", type=int, default=0, help="hot spares beside the pods (the chart's spares)")
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=0,
        help="dist.shard_group_size: HSDP in groups of this many ranks (default 0: FSDP over every rank)",
    )
    p.add_argument("--sample-every-s", type=float, default=1.0)
    p.add_argument("--leg-timeout-s", type=float, default=3600.0)
    p.add_argument("--out", help="write the results as JSON here")
    p.set_defaults(bench=main)


def feature_overrides(args: argparse.Namespace) -> list[str]:
    """The trainer settings of the features this campaign turns on, given to every launch and to
    the fault-free job alike (so the reference trains the same numerics)."""
    out = []
    if getattr(args, "in_process", False):
        out += IN_PROCESS
    if getattr(args, "memory_interval_steps", 0):
        out += [
            f"checkpoint.memory.interval_steps={args.memory_interval_steps}",
            f"checkpoint.memory.replicas={args.memory_replicas}",
        ]
    if getattr(args, "shard_group_size", 0):
        out.append(f"dist.shard_group_size={args.shard_group_size}")
    return out


# In-process restart's timeouts as the fault tests set them: a soft timeout that outlasts the
# longest legitimate wait of a loaded two-core machine, hang detection left to it.
IN_PROCESS = [
    "resilience.in_process.enabled=true",
    "resilience.in_process.max_iterations=50",
    "resilience.in_process.soft_timeout_s=20",
    "resilience.in_process.hard_timeout_s=40",
    "resilience.in_process.heartbeat_timeout_s=20",
    "resilience.in_process.barrier_timeout_s=120",
    "resilience.hang_detection.step_timeout_s=60",
]


# ---- the schedule -----------------------------------------------------------------------------


def leg_bounds(steps: int, interval: int) -> dict[str, tuple[int, int]]:
    """(first, stop) step per leg: main 45%, the rewind from main's older kept checkpoint to 65%,
    shrink to 80%, regrow to the end; each stop a checkpoint step."""

    def at(fraction: float) -> int:
        return max(interval, int(steps * fraction) // interval * interval)

    main_stop, rewind_stop, shrink_stop = at(0.45), at(0.65), at(0.80)
    if not (2 * interval <= main_stop < rewind_stop < shrink_stop < steps):
        raise ValueError(
            f"--steps {steps} with --interval-steps {interval}: each leg needs its own checkpoints; "
            f"give at least {8 * interval} steps"
        )
    return {
        "main": (0, main_stop),
        "rewind": (main_stop - interval, rewind_stop),
        "shrink": (rewind_stop, shrink_stop),
        "regrow": (shrink_stop, steps),
    }


def available(kind: str, isolation: str) -> Optional[str]:
    """Why ``kind`` cannot run here, or None."""
    if kind == "partition" and isolation != "netns":
        return "a partition needs network-namespace pods (--isolation netns)"
    return None


def place_faults(
    bounds: dict[str, tuple[int, int]],
    pods: dict[str, int],
    entries: list[str],
    every: int,
    isolation: str,
    save_every: int = 1,
    ranks_per_pod: int = 1,
) -> dict[str, list[Fault]]:
    """The faults of every leg: in each leg's new steps, one every ``every``, entries in turn. A
    fault inside the checkpoint writer or rank 0's commit (``when: write``, ``commit``) fires only
    while a periodic save is written or committed, so it goes to the first periodic save (every
    ``save_every`` steps) at or after its slot; a slot with no periodic save left in its leg (the
    final save is the leg's end, not a fault's place) is skipped, saying so. The save the rewind
    resumes from is never one of them: a failed write there leaves nothing to rewind to; nor does
    a graceful stop (``sigterm``) come after it in the main leg: its stop checkpoint would be kept
    in that one's place."""
    placed: dict[str, list[Fault]] = {}
    taken: set[str] = set()
    rewound_to = {bounds["rewind"][0]} if "rewind" in bounds else set()
    slot = 0
    for leg, (first, stop) in bounds.items():
        # None in a leg's first two steps (the restore) nor at its stop (the final save). The
        # rewind's first fault lands among the steps it trains again: its restart must stay on
        # the rewound line.
        placed[leg] = []
        for step in range(first + 2, stop - 1, every):
            entry = entries[slot % len(entries)]
            slot += 1
            kind, _, options = entry.partition(":")
            if kind not in FAULT_KINDS:
                raise ValueError(f"--kinds: {kind!r} is not a fault kind; the kinds are {', '.join(FAULT_KINDS)}")
            suffix = ":" + retarget(options, pods[leg], ranks_per_pod) if options else ""
            writes = FAULT_KINDS[kind].when in ("write", "commit")
            stride = save_every if writes else 1
            if writes:
                step = -(-step // save_every) * save_every
            # The ledger keeps a fault once per job: a rewound step may not repeat an earlier spec.
            while f"{kind}@{step}{suffix}" in taken or (writes and step in rewound_to):
                step += stride
            skipped = available(kind, isolation)
            if writes and skipped is None and step >= stop:
                skipped = f"no periodic save left in the {leg} leg for a fault inside the writer or the commit"
            if (
                skipped is None
                and leg == "main"
                and FAULT_KINDS[kind].recovered_by.startswith("graceful stop")
                and any(step > rewind for rewind in rewound_to)
            ):
                skipped = (
                    f"a graceful stop after step {min(rewound_to)} checkpoints its step, which retention "
                    "keeps in place of the checkpoint the rewind leg resumes from"
                )
            if skipped is None:
                taken.add(f"{kind}@{step}{suffix}")
            placed[leg].append(Fault(leg, f"{kind}@{step}{suffix}", kind, step, skipped))
        _skip_restores_with_no_restart_after(placed[leg])
    return placed


def _skip_restores_with_no_restart_after(faults: list[Fault]) -> None:
    """A fault inside a restore (``when: restore``) fires in the restart a later fault of its leg
    causes: with no later fault that stops training, its slot is skipped, saying so."""
    for i, fault in enumerate(faults):
        if (
            fault.skipped is None
            and FAULT_KINDS[fault.kind].when == "restore"
            and not any(
                later.skipped is None and FAULT_KINDS[later.kind].stops and FAULT_KINDS[later.kind].when != "restore"
                for later in faults[i + 1 :]
            )
        ):
            fault.skipped = f"no later fault in the {fault.leg} leg causes the restart a fault inside a restore needs"


def retarget(options: str, pods: int, ranks_per_pod: int = 1) -> str:
    """``rank=R``/``node=N`` modulo a world of ``pods`` pods x ``ranks_per_pod`` ranks."""
    out = []
    for part in options.split(":"):
        name, _, value = part.partition("=")
        size = {"rank": pods * ranks_per_pod, "node": pods}.get(name)
        out.append(f"{name}={int(value) % size}" if size and value.isdigit() else part)
    return ":".join(out)


def plan(args: argparse.Namespace) -> list[Leg]:
    bounds = leg_bounds(args.steps, args.interval_steps)
    pods = {"main": args.nodes, "rewind": args.nodes, "shrink": max(1, args.nodes // 2), "regrow": args.nodes}
    entries = [e.strip() for e in args.kinds.split(",") if e.strip()]
    faults = place_faults(
        bounds,
        pods,
        entries,
        args.fault_every_steps,
        args.isolation,
        args.interval_steps,
        getattr(args, "nproc_per_node", 1),
    )
    return [
        Leg(name, pods[name], *bounds[name], [f"train.stop_at_step={bounds[name][1]}"], faults[name]) for name in LEGS
    ]


# ---- sampling ---------------------------------------------------------------------------------


def tree_bytes(path: Path) -> tuple[int, int, int]:
    """(bytes outside set-asides, bytes in set-asides, .incomplete-* directories) under ``path``."""
    kept = aside = incomplete = 0
    if not path.is_dir():
        return 0, 0, 0
    for entry in os.scandir(path):
        total = 0
        if entry.is_dir(follow_symlinks=False):
            incomplete += ".incomplete-" in entry.name
            for root, _, files in os.walk(entry.path):
                for name in files:
                    try:
                        total += os.lstat(os.path.join(root, name)).st_size
                    except OSError:
                        pass  # renamed or deleted by retention meanwhile
        else:
            try:
                total = entry.stat(follow_symlinks=False).st_size
            except OSError:
                pass
        if any(mark in entry.name for mark in SET_ASIDE):
            aside += total
        else:
            kept += total
    return kept, aside, incomplete


def job_processes(mark: str) -> list[tuple[psutil.Process, str]]:
    """(process, pod) of every live process whose environment carries ``mark``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
            if env.get(RUN_MARK_ENV) == mark:
                found.append((proc, env.get(POD_ENV, "launcher").rpartition("/")[2]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


class Sampler:
    """Samples the volume, the bucket and the job's processes on a thread until ``stop``."""

    def __init__(self, mark: str, checkpoint_dir: Path, every_s: float, bucket_bytes: Optional[Callable[[], int]]):
        self.mark, self.checkpoint_dir, self.every_s, self.bucket_bytes = mark, checkpoint_dir, every_s, bucket_bytes
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="campaign-sampler")

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.every_s)

    def sample(self) -> dict:
        kept, aside, incomplete = tree_bytes(self.checkpoint_dir)
        pods: dict[str, dict] = {}
        shm_seen: dict[tuple[int, int], int] = {}
        for proc, pod in job_processes(self.mark):
            try:
                fds, threads = proc.num_fds(), proc.num_threads()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            entry = pods.setdefault(pod, {"processes": 0, "fds": 0, "threads": 0})
            entry["processes"] += 1
            entry["fds"] += fds
            entry["threads"] += threads
            run = read_run_identity(self.checkpoint_dir)
            if pod != "launcher" and run is not None:
                shm = pod_shm(proc.pid, run)
                if shm is not None and shm[0] not in shm_seen:
                    shm_seen[shm[0]] = shm[1]
        bucket = None
        if self.bucket_bytes is not None:
            try:
                bucket = self.bucket_bytes()
            except Exception:  # noqa: BLE001 - a listing racing a delete; the next sample counts
                bucket = None
        return {
            "t": time.time(),
            "checkpoint_bytes": kept,
            "set_aside_bytes": aside,
            "incomplete_dirs": incomplete,
            "bucket_bytes": bucket,
            "pods": pods,
            "shm_bytes": sum(shm_seen.values()),
        }


def pod_shm(pid: int, run: str) -> Optional[tuple[tuple[int, int], int]]:
    """(identity, bytes) of what the memory tier holds for run ``run`` (its checkpoint
    directory's ``run_identity``, whatever the job's name) in the ``/dev/shm`` process ``pid``
    sees (its pod's: a network-namespace pod mounts its own; loopback pods share the host's,
    counted once by its identity); None when it cannot be read."""
    top = Path(f"/proc/{pid}/root/dev/shm")
    try:
        st = top.stat()
    except OSError:
        return None
    total = 0
    for root, _, files in (walk for job in (top / "resilient-fsdp").glob("*") for walk in os.walk(job / run)):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass  # a slot replaced meanwhile
    return (st.st_dev, st.st_ino), total


def peaks(samples: list[dict]) -> dict:
    def top(values) -> int:
        return max([v for v in values if v is not None], default=0)

    per_pod = [p for s in samples for name, p in s["pods"].items() if name != "launcher"]
    return {
        "checkpoint_bytes": top(s["checkpoint_bytes"] for s in samples),
        "shm_bytes": top(s.get("shm_bytes", 0) for s in samples),
        "pod_threads": top(p.get("threads", 0) for p in per_pod),
        "set_aside_bytes": top(s["set_aside_bytes"] for s in samples),
        "incomplete_dirs": top(s["incomplete_dirs"] for s in samples),
        "bucket_bytes": top(s["bucket_bytes"] for s in samples),
        "pod_processes": top(p["processes"] for p in per_pod),
        "pod_fds": top(p["fds"] for p in per_pod),
        "samples": len(samples),
    }


# ---- running the legs -------------------------------------------------------------------------


class LocalS3:
    """A moto server on loopback and one bucket: the campaign's S3 tier."""

    def __init__(self, root: Path):
        import boto3

        from .s3 import LocalS3Server

        self.server = LocalS3Server(root / "s3-server.log")
        self.bucket = f"campaign-{uuid.uuid4().hex[:8]}"
        self.client = boto3.session.Session(
            aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
            region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
        ).client("s3", endpoint_url=self.server.endpoint)
        self.client.create_bucket(Bucket=self.bucket)

    def overrides(self, prefix: str) -> list[str]:
        return [
            f"checkpoint.s3.uri=s3://{self.bucket}/{prefix}",
            f"checkpoint.s3.endpoint_url={self.server.endpoint}",
            *S3_SETTINGS,
        ]

    def objects(self, prefix: str) -> list[dict]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix + "/")
        return [o for page in pages for o in page.get("Contents", [])]

    def total_bytes(self, prefix: str) -> int:
        return sum(o["Size"] for o in self.objects(prefix))

    def markerless(self, prefix: str) -> list[str]:
        steps: dict[str, bool] = {}
        for o in self.objects(prefix):
            top, _, rel = o["Key"][len(prefix) + 1 :].partition("/")
            if top.startswith("step_") and rel:
                steps[top] = steps.get(top, False) or rel == MARKER
        return sorted(name for name, complete in steps.items() if not complete)

    def close(self) -> None:
        self.server.stop()


def rewind_step(checkpoints: Path, last: int) -> Optional[int]:
    """The step the rewind leg resumes from: the newest committed checkpoint older than ``last``
    (the main leg's final save), the older of the two ``keep_last=2`` leaves. The schedule plans it
    one interval before ``last``, but a fault can tear that save (a kill while it is written) and
    retention then keeps an older one; the rewind's faults come after the planned step, so they
    still fire from here."""
    committed, _ = store.scan(checkpoints)
    older = [c.step for c in committed if c.step < last]
    return max(older) if older else None


def launch(
    run_dir: Path,
    pods: int,
    overrides: list[str],
    faults: list[str],
    isolation: str,
    mark: str,
    log: Path,
    timeout_s: float,
    env: Optional[dict] = None,
    nproc: int = 1,
    spares: int = 0,
) -> tuple[int, float, str]:
    """One ``resilient-fsdp local`` launch of the JobSet: (exit code, wall seconds, output)."""
    cmd = [
        sys.executable,
        "-m",
        "resilient_fsdp.cli",
        "local",
        f"--nodes={pods}",
        f"--nproc-per-node={nproc}",
        f"--run-dir={run_dir}",
        f"--isolation={isolation}",
        "--value=workload.kind=JobSet",
        *([f"--value=spares={spares}"] if spares else []),
        f"--max-restarts={MAX_RESTARTS}",
        f"--max-pod-recreations={MAX_POD_RECREATIONS}",
        *(f"--inject={f}" for f in faults),
    ]
    for o in overrides:
        cmd += ["--set", o]
    # The local server's throwaway credentials (with S3 on): nothing reaches AWS.
    env = {**os.environ, **(env or {}), RUN_MARK_ENV: mark}
    start = time.time()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p, _ in job_processes(mark):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        out, _ = proc.communicate()
        out += f"\n[campaign] killed after {timeout_s:.0f} s\n"
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n")
    return proc.returncode, time.time() - start, out


def leg_start_index(records: list[dict], leg: int) -> int:
    """Where launch ``leg`` (0: the first) begins in ``metrics.jsonl``: at its first attempt's
    ``start`` event (restarts within a launch log another layer). The trainer drops the records
    past the step it resumes from, so counting lines before a launch would not find it."""
    starts = [i for i, r in enumerate(records) if r.get("event") == "start" and r.get("layer") == "start"]
    return starts[leg] if leg < len(starts) else len(records)


def leg_records(records: list[dict], leg: int) -> list[dict]:
    start = leg_start_index(records, leg)
    return records[start : leg_start_index(records, leg + 1)] if start < len(records) else []


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by a killed writer
    return out


def pod_checkpoint_dir(run_dir: Path) -> str:
    """``checkpoint.dir`` as the pods see it (``resume_from`` names it so)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return cfg["checkpoint"].get("dir") or f"{cfg['run_dir'].rstrip('/')}/checkpoints"


def checkpoint_size(checkpoint_dir: Path) -> int:
    sizes = [
        sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        for d in checkpoint_dir.glob("step_*")
        if d.is_dir() and d.name[5:].isdigit()
    ]
    return max(sizes, default=0)


# ---- the checks -------------------------------------------------------------------------------


def check_accounting(run_dir: Path, fired_specs: list[str], outputs: str) -> dict[str, dict]:
    from ..resilience.ledger import FaultLedger

    ledger = FaultLedger(run_dir)
    fired = ledger.fired()
    recoveries, went_on = ledger.recoveries(), ledger.went_on()
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    ledger_specs = [f["fault"] for f in fired]
    stopping = [f for f in fired if FAULT_KINDS.get(f["kind"]) is None or FAULT_KINDS[f["kind"]].stops]
    missing = [
        f["fault"]
        for f in stopping
        if f["key"] not in recoveries and not (f["kind"] == "partition" and f["key"] in went_on)
    ]
    # Each restart that trained closes the faults before it: two closed by one attempt (a fault
    # inside the restart of another) count as that one restart.
    closing: dict[str, set] = {}
    for f in fired:
        if f["key"] in recoveries:
            record = recoveries[f["key"]]
            closing.setdefault(record["layer"], set()).add(record.get("attempt") or f["key"])
    by_layer = {layer: len(attempts) for layer, attempts in closing.items()}
    restarts = summary.get("restarts", {})
    # The local JobSet's words for a pod failure counted against its Job's backoffLimit.
    counted = len(re.findall(r"counted by Job \S+ \(\d+ of backoffLimit", outputs))
    allowed = sum(
        1
        for f in fired
        if f["key"] in recoveries and recoveries[f["key"]]["layer"] == "job" and f["kind"] != "node-loss"
    )
    whole = outputs.count("RestartJobSet")
    return {
        "ledger_is_the_schedule": result(
            sorted(ledger_specs) == sorted(fired_specs), {"ledger": ledger_specs, "scheduled": fired_specs}
        ),
        "summary_is_the_ledger": result(
            sorted(summary.get("faults_injected", [])) == sorted(ledger_specs),
            {"summary": summary.get("faults_injected")},
        ),
        "one_recovery_per_stopping_fault": result(not missing, {"without_recovery": missing}),
        "restarts_count_the_recoveries": result(
            all(restarts.get(layer, 0) == by_layer.get(layer, 0) for layer in ("in_process", "in_job", "job")),
            {"restarts": restarts, "recoveries_by_layer": by_layer},
        ),
        "pod_budget_counts_real_failures": result(
            counted <= allowed and whole == 0,
            {"counted_pod_failures": counted, "allowed": allowed, "whole_jobset_restarts": whole},
        ),
    }


SETTLE_S = 2.0  # a recovery's first step, then this long: the restart's leftovers have had time to go
# What a figure may grow by between a leg's first recovered fault and its last: what a moment
# legitimately varies by (a commit or writer process there or not, the S3 uploads' connections,
# checkpoint files open: descriptors measured 147-194 after faults with every feature on, against
# 183 at the fault-free job's peak). Threads vary least: a leak per restart shows there first
# (an abort that closed no group left 10 threads and 9 descriptors per in-process restart).
GROWTH_MARGIN = {"pod_fds": 64, "pod_threads": 16, "pod_processes": 2}


def after_each_fault(run_dir: Path, samples: list[dict], legs: list[dict]) -> list[dict]:
    """Per recovered fault, in order, what the job held once it had recovered: the first sample
    ``SETTLE_S`` after its recovery (the largest pod's descriptors, threads and processes, the
    memory tier's bytes in the pods' ``/dev/shm``, the volume's and the bucket's bytes), with the
    leg it fell in."""
    from ..resilience.ledger import FaultLedger

    ledger = FaultLedger(run_dir)
    fired = {f["key"]: f for f in ledger.fired()}
    recovered = sorted(
        ((fired[k]["t_fault"] + r["recovery_s"], r) for k, r in ledger.recoveries().items() if k in fired),
        key=lambda item: item[0],
    )
    ends = [(leg["t_end"], leg["leg"]) for leg in legs]
    out = []
    for t, record in recovered:
        sample = next((s for s in samples if s["t"] >= t + SETTLE_S), None)
        if sample is None:
            continue
        pods = [p for name, p in sample["pods"].items() if name != "launcher"]
        leg = next((name for end, name in ends if t <= end), ends[-1][1] if ends else None)
        out.append(
            {
                "fault": record["fault"],
                "layer": record["layer"],
                "leg": leg,
                "t": sample["t"],
                "pod_fds": max((p["fds"] for p in pods), default=0),
                "pod_threads": max((p.get("threads", 0) for p in pods), default=0),
                "pod_processes": max((p["processes"] for p in pods), default=0),
                "shm_bytes": sample.get("shm_bytes", 0),
                "checkpoint_bytes": sample["checkpoint_bytes"],
                "bucket_bytes": sample["bucket_bytes"],
            }
        )
    return out


def check_after_faults(records: list[dict], ref_peaks: dict) -> dict[str, dict]:
    """After every fault each figure within its bound (twice the fault-free job's peak; the
    memory tier's bytes that plus a MiB), and within each leg nothing that grows fault after fault
    beyond :data:`GROWTH_MARGIN` (a leak: what an aborted attempt left behind)."""
    over = []
    for r in records:
        for name, peak in (
            ("pod_fds", ref_peaks["pod_fds"]),
            ("pod_threads", ref_peaks["pod_threads"]),
            ("pod_processes", ref_peaks["pod_processes"]),
        ):
            if r[name] > 2 * peak:
                over.append({"fault": r["fault"], name: r[name], "bound": 2 * peak})
        if r["shm_bytes"] > 2 * ref_peaks["shm_bytes"] + (1 << 20):
            over.append(
                {"fault": r["fault"], "shm_bytes": r["shm_bytes"], "bound": 2 * ref_peaks["shm_bytes"] + (1 << 20)}
            )
    grew = []
    # Only an in-process restart keeps its processes: any other layer starts new ones, whose
    # figures owe nothing to the faults before (and a sample may meet them still starting). So
    # the in-process restarts are compared in runs that no other restart (nor a leg's end) cuts.
    kept = [r for r in records if r["layer"] == "in_process"]
    runs: list[list[dict]] = []
    for i, r in enumerate(records):
        if r["layer"] != "in_process":
            continue
        if i and records[i - 1]["layer"] == "in_process" and records[i - 1]["leg"] == r["leg"] and runs:
            runs[-1].append(r)
        else:
            runs.append([r])
    for mine in runs:
        if len(mine) < 2:
            continue
        first, last = mine[0], mine[-1]
        for name, margin in GROWTH_MARGIN.items():
            if last[name] > first[name] + margin:
                grew.append(
                    {
                        "leg": first["leg"],
                        "figure": name,
                        "first": first[name],
                        "last": last[name],
                        "margin": margin,
                        "faults": len(mine),
                    }
                )
    return {
        "resources_bounded_after_every_fault": result(
            bool(records) and not over, {"faults": len(records), "over": over[:10]}
        ),
        "resources_do_not_grow_fault_after_fault": result(
            not grew, grew or f"{len(kept)} in-process restart(s) measured, none growing beyond its margin"
        ),
    }


def budgets(leg_records_: list[dict], faults: int) -> dict:
    """What a launch used of its restart budgets (in-job restarts, attempts a pod recreation began)
    and what was left."""
    starts = [r for r in leg_records_ if r.get("event") == "start"]
    used = {layer: sum(1 for r in starts if r.get("layer") == layer) for layer in ("in_process", "in_job", "job")}
    return {
        "faults": faults,
        "used": used,
        "in_job_left": MAX_RESTARTS - used["in_job"],
        "pod_recreations_left": MAX_POD_RECREATIONS - used["job"],
    }


def result(ok: bool, detail: object = None) -> dict:
    return {"ok": bool(ok), "detail": detail}


def rewound_line(records: list[dict], rewind_step: int) -> dict:
    """The rewind leg's starts: the first resumed from ``rewind_step``; every later one from a
    step this leg had trained (a checkpoint of the rewound line), never from before the rewind
    nor from a set-aside checkpoint of the old line. How far the leg had trained: its step records
    and, since a start drops the step records past the step it resumes from (they are trained
    again), the step the fault a restart recovers from hit (its ``recovery`` record's
    ``fault_step``, written after that start)."""
    starts, trained, wrong = [], rewind_step, []
    for i, r in enumerate(records):
        if r.get("event") == "step":
            trained = max(trained, r["step"])
        elif r.get("event") == "start":
            resumed = r.get("resumed_from_step")
            starts.append(resumed)
            first = len(starts) == 1
            reach = trained
            if not first:  # the recovery this start makes, written before the next start
                after = next((n for n in records[i + 1 :] if n.get("event") in ("recovery", "start")), {})
                if after.get("event") == "recovery" and isinstance(after.get("fault_step"), int):
                    reach = max(reach, after["fault_step"])
            if resumed is None or (resumed != rewind_step if first else not rewind_step <= resumed <= reach):
                wrong.append({"resumed_from_step": resumed, "trained_up_to": reach})
    return result(
        bool(starts) and not wrong, {"resumed_from_steps": starts, "rewind_step": rewind_step, "off_the_line": wrong}
    )


def compare_losses(records: list[dict], reference: dict[int, float], upto: int) -> dict:
    """Every step record in ``records[:upto]`` (the main and rewind legs) against the reference."""
    compared, differ, nonfinite = 0, [], 0
    for r in records[:upto]:
        if r.get("event") != "step":
            continue
        loss = r["loss"]
        if not math.isfinite(loss):
            nonfinite += 1
            continue
        compared += 1
        if reference.get(r["step"]) != loss:
            differ.append({"step": r["step"], "loss": loss, "fault_free": reference.get(r["step"])})
    return result(
        compared > 0 and not differ,
        {"compared": compared, "differ": differ[:10], "n_differ": len(differ), "nonfinite_skipped": nonfinite},
    )


def time_table(legs: list[dict], records: list[dict], run_dir: Path) -> dict:
    """Where the campaign's wall time (its launches') went: steps that count (each step once),
    checkpoint stalls, recoveries (each fault to the first step after its restore; the work lost
    to it is inside) and the rest (each launch's start-up and shutdown). Steps trained again:
    the recoveries' lost steps and the rewind's."""
    rewound = sum(
        max(0, legs[i - 1]["stop_step"] - leg["first_step"])
        for i, leg in enumerate(legs)
        if i and leg["leg"] == "rewind"
    )
    from ..resilience.ledger import FaultLedger

    last: dict[int, float] = {}
    for r in records:
        if r.get("event") == "step":
            last[r["step"]] = r["step_time_s"]
    wall = sum(leg["wall_s"] for leg in legs)
    productive = sum(last.values())
    stalls = sum(r.get("stall_s", 0.0) for r in records if r.get("event") == "checkpoint")
    recoveries = list(FaultLedger(run_dir).recoveries().values())
    recovery = sum(r["recovery_s"] for r in recoveries)
    return {
        "wall_s": wall,
        "productive_s": productive,
        "checkpoint_stalls_s": stalls,
        "recovery_s": recovery,
        "other_s": wall - productive - stalls - recovery,
        "goodput": productive / wall if wall else 0.0,
        "steps_trained_again": sum(r["lost_steps"] for r in recoveries) + rewound,
    }


def main(args: argparse.Namespace) -> int:
    root = Path(args.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    log.write_text("")
    try:
        legs = plan(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s3 = LocalS3(root) if args.s3 == "on" else None
    try:
        results = run_campaign(args, root, legs, s3, log)
    finally:
        if s3 is not None:
            s3.close()
    print(format_table(results))
    write_results(results, args.out)
    return 0 if all(c["ok"] for c in results["checks"].values() if c["ok"] is not None) else 1


def run_campaign(args: argparse.Namespace, root: Path, legs: list[Leg], s3: Optional[LocalS3], log: Path) -> dict:
    common = COMMON + [
        f"train.steps={args.steps}",
        f"checkpoint.interval_steps={args.interval_steps}",
        f"train.log_every={max(1, args.interval_steps)}",
        *feature_overrides(args),
    ]
    nproc, spares = getattr(args, "nproc_per_node", 1), getattr(args, "spares", 0)
    started = time.time()
    # The fault-free job: the loss curve, the checkpoint size and the process and file peaks.
    reference_dir = root / "fault-free"
    fresh_dir(reference_dir)
    mark = f"{root}:fault-free"
    with Sampler(mark, reference_dir / "checkpoints", args.sample_every_s, None) as ref_sampler:
        code, ref_wall, _ = launch(
            reference_dir,
            args.nodes,
            common,
            [],
            args.isolation,
            mark,
            log,
            args.leg_timeout_s,
            nproc=nproc,
            spares=spares,
        )
    if code != 0:
        raise RuntimeError(f"the fault-free job failed with code {code}; see {log}")
    reference = {r["step"]: r["loss"] for r in read_records(reference_dir) if r.get("event") == "step"}
    size = checkpoint_size(reference_dir / "checkpoints")
    ref_peaks = peaks(ref_sampler.samples)

    run_dir = root / "campaign"
    fresh_dir(run_dir)
    mark = f"{root}:campaign"
    prefix = "campaign"
    bucket = (lambda: s3.total_bytes(prefix)) if s3 else None
    extra = s3.overrides(prefix) if s3 else []
    leg_results, outputs, fired_specs = [], "", []
    rewind_ok: Optional[dict] = None
    rewind_line: Optional[dict] = None
    with Sampler(mark, run_dir / "checkpoints", args.sample_every_s, bucket) as sampler:
        for leg in legs:
            overrides = common + extra + leg.overrides
            if leg.name == "rewind":
                kept = rewind_step(run_dir / "checkpoints", leg_results[-1]["stop_step"])
                if kept is None:
                    raise RuntimeError(
                        f"the main leg left no committed checkpoint before its last in "
                        f"{run_dir / 'checkpoints'}: nothing to rewind to"
                    )
                if kept != leg.first_step:
                    print(
                        f"[campaign] leg rewind: the main leg's older kept checkpoint is step {kept} (a fault "
                        f"tore the save of step {leg.first_step} or a stop saved another): resuming there",
                        flush=True,
                    )
                    leg = dataclasses.replace(leg, first_step=kept)
                target = f"{pod_checkpoint_dir(run_dir)}/step_{leg.first_step:08d}"
                overrides.append(f"checkpoint.resume_from={target}")
            faults = [f.spec for f in leg.faults if not f.skipped]
            t_leg = time.time()
            # A leg of one pod has no spare: its one pod hosts the store, whose loss no spare takes
            # (the chart refuses spares beside a single node).
            code, wall, out = launch(
                run_dir,
                leg.pods,
                overrides,
                faults,
                args.isolation,
                mark,
                log,
                args.leg_timeout_s,
                FAKE_AWS if s3 else None,
                nproc=nproc,
                spares=spares if leg.pods > 1 else 0,
            )
            outputs += out
            records = read_records(run_dir)
            mine = leg_records(records, len(leg_results))
            steps = [r["step"] for r in mine if r.get("event") == "step"]
            fired_specs += [f.spec for f in leg.faults if not f.skipped]
            leg_results.append(
                {
                    "leg": leg.name,
                    "pods": leg.pods,
                    "first_step": leg.first_step,
                    "stop_step": leg.stop_step,
                    "exit_code": code,
                    "wall_s": wall,
                    "t_start": t_leg,
                    "t_end": t_leg + wall,
                    "last_step": max(steps, default=None),
                    "faults": [dataclasses.asdict(f) for f in leg.faults],
                    "budgets": budgets(mine, len(faults)),
                }
            )
            print(
                f"[campaign] leg {leg.name}: {leg.pods} pod(s), steps {leg.first_step}..{leg.stop_step}, exit {code}, "
                f"{wall:.0f} s; faults: {', '.join(faults) or 'none'}",
                flush=True,
            )
            if leg.name == "rewind":
                rewind_line = rewound_line(mine, leg.first_step)
                rewind_ok = result(
                    bool(steps) and steps[0] == leg.first_step + 1,
                    {"first_step": steps[0] if steps else None, "expected": leg.first_step + 1},
                )
            if code != 0:
                break
    records = read_records(run_dir)
    checkpoints = run_dir / "checkpoints"
    camp_peaks = peaks(sampler.samples)
    # keep_last committed checkpoints, one being written and one torn write (a failed save's, swept
    # at the commit of its step or the next start: checkpoint.store's bound); the margin covers
    # metadata and the checkpoint's size varying by a few percent between world sizes.
    disk_bound = (KEEP_LAST + 2) * size + size // 2 + (1 << 20)
    # The bucket may also hold an upload a fault cut off: it has no marker and is swept once the
    # next upload is marked (s3.uploader), so while that one is in flight both are there.
    bucket_bound = disk_bound + size
    from ..local.runtime.netns_pods import plumbing

    # As the tests' leftover check: a few seconds for the last processes to exit, then whatever
    # is still there is named and killed.
    deadline = time.monotonic() + 5
    while job_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for proc, pod in job_processes(mark):
        try:
            left.append(f"{pod} {proc.pid}: {' '.join(proc.cmdline())[:160]}")
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    names = [p.name for p in checkpoints.iterdir()] if checkpoints.is_dir() else []
    held_after = after_each_fault(run_dir, sampler.samples, leg_results)
    checks = {
        "legs_finished": result(
            all(leg["exit_code"] == 0 and leg["last_step"] == leg["stop_step"] for leg in leg_results)
            and len(leg_results) == len(legs),
            [{k: leg[k] for k in ("leg", "exit_code", "last_step", "stop_step")} for leg in leg_results],
        ),
        "disk_bounded": result(
            camp_peaks["checkpoint_bytes"] <= disk_bound,
            {
                "peak": camp_peaks["checkpoint_bytes"],
                "bound": disk_bound,
                "set_aside_peak": camp_peaks["set_aside_bytes"],
            },
        ),
        "bucket_bounded": (
            result(
                camp_peaks["bucket_bytes"] <= bucket_bound, {"peak": camp_peaks["bucket_bytes"], "bound": bucket_bound}
            )
            if s3
            else {"ok": None, "detail": "S3 off (--s3 off)"}
        ),
        "open_files_bounded": result(
            camp_peaks["pod_fds"] <= 2 * ref_peaks["pod_fds"],
            {"peak": camp_peaks["pod_fds"], "fault_free_peak": ref_peaks["pod_fds"]},
        ),
        "processes_bounded": result(
            camp_peaks["pod_processes"] <= 2 * ref_peaks["pod_processes"],
            {"peak": camp_peaks["pod_processes"], "fault_free_peak": ref_peaks["pod_processes"]},
        ),
        "threads_bounded": result(
            camp_peaks["pod_threads"] <= 2 * ref_peaks["pod_threads"],
            {"peak": camp_peaks["pod_threads"], "fault_free_peak": ref_peaks["pod_threads"]},
        ),
        "shm_bounded": result(
            camp_peaks["shm_bytes"] <= 2 * ref_peaks["shm_bytes"] + (1 << 20),
            {"peak": camp_peaks["shm_bytes"], "fault_free_peak": ref_peaks["shm_bytes"]},
        ),
        **check_after_faults(held_after, ref_peaks),
        **check_accounting(run_dir, fired_specs, outputs),
        "rewind_resumed_at_its_step": rewind_ok or result(False, "the rewind leg did not run"),
        "rewind_restarts_stay_on_its_line": rewind_line or result(False, "the rewind leg did not run"),
        "losses_equal_fault_free": compare_losses(records, reference, leg_start_index(records, LEGS.index("shrink"))),
        "no_processes_left": result(not left, left),
        "no_pods_left": result(
            not plumbing.leaked() if os.geteuid() == 0 else True,
            plumbing.leaked() if os.geteuid() == 0 else "not root: no pods made",
        ),
        "incomplete_dirs_at_most_one": result(
            sum(".incomplete-" in n for n in names) <= 1, [n for n in names if ".incomplete-" in n]
        ),
        "no_markerless_s3_prefixes": (
            result(not s3.markerless(prefix), s3.markerless(prefix))
            if s3
            else {"ok": None, "detail": "S3 off (--s3 off)"}
        ),
    }
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {
        "nodes": args.nodes,
        "steps": args.steps,
        "interval_steps": args.interval_steps,
        "fault_every_steps": args.fault_every_steps,
        "isolation": args.isolation,
        "s3": bool(s3),
        "nproc_per_node": nproc,
        "spares": spares,
        "features": feature_overrides(args),
        "after_each_fault": held_after,
        "cpu_count": os.cpu_count(),
        "keep_last": KEEP_LAST,
        "checkpoint_bytes": size,
        "legs": leg_results,
        "fault_free_wall_s": ref_wall,
        "fault_free_peaks": ref_peaks,
        "peaks": camp_peaks,
        "skipped": [dataclasses.asdict(f) for leg in legs for f in leg.faults if f.skipped],
        "checks": checks,
        "time": time_table(leg_results, records, run_dir),
        "final_summary": {k: summary.get(k) for k in ("goodput", "restarts", "job_wall_s", "productive_s")},
        "recoveries": summary.get("recoveries", []),
        "bench_wall_s": time.time() - started,
    }


def format_table(results: dict) -> str:
    rows = [f"{'leg':<8} {'pods':>4} {'steps':>11} {'exit':>4} {'wall_s':>7}  faults"]
    for leg in results["legs"]:
        faults = ", ".join(f["spec"] + (" (skipped)" if f["skipped"] else "") for f in leg["faults"])
        rows.append(
            f"{leg['leg']:<8} {leg['pods']:>4} {leg['first_step']:>5}..{leg['stop_step']:<5} "
            f"{leg['exit_code']:>4} {leg['wall_s']:>7.1f}  {faults or '-'}"
        )
    t = results["time"]
    rows.append(
        "where the time went (s): "
        + ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {t[k]:.1f}"
            for k in ("wall_s", "productive_s", "checkpoint_stalls_s", "recovery_s", "other_s")
        )
        + f"; campaign goodput {t['goodput']:.3f}; steps trained again {t['steps_trained_again']}"
    )
    for s in results["skipped"]:
        rows.append(f"skipped: {s['spec']}: {s['skipped']}")
    rows.append(f"{'check':<34} result")
    for name, check in results["checks"].items():
        status = "n/a" if check["ok"] is None else ("ok" if check["ok"] else "FAILED")
        rows.append(f"{name:<34} {status}  {json.dumps(check['detail'])[:160]}")
    return "\n".join(rows)
