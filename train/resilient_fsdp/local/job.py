"""From ``resilient-fsdp local``'s flags to a running job: chart values, render, pods, launch.

The flags are chart values (:func:`chart_values` names each flag's value); the few that are not
(``--pod-start-delay``, ``--replacement-delay``, ``--nofile``, ``--shared-volume-fsgroup``) are
what a cluster would decide: when a pod first starts, how long a lost pod's replacement takes,
the container runtime's limits, the volume driver's ``fsGroup``. :func:`main` renders the chart,
reads the job from the manifests (:mod:`.manifests`) and runs it (:mod:`.cluster`); the
``local`` command of :mod:`resilient_fsdp.cli` calls it.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Optional

import yaml

from ..config import CUT_OFF_KINDS, ConfigError, load_config, parse_faults, user_tree
from ..deploy.chart import DEFAULT_RELEASE, REPO_ROOT, chart_dir, deep_merge, load_values, render
from ..resilience.accounting import JOB_START_ENV
from ..resilience.agent import parse_agent_args
from ..resilience.nvrx import QUIET_WARNINGS, hot_spares_unsupported, installed_version
from ..resilience.faults import REQUESTS_ENV
from .cluster.fault_requests import requests_dir
from .cluster.launcher import DEFAULT_MAX_RECREATIONS, LocalJob, LocalLauncher, free_port
from .manifests.kinds import pods_of
from .manifests.security import nofile_limit
from .manifests.spec import WorkloadError
from .runtime.paths import replace_paths

DEFAULT_VALUES = REPO_ROOT / "values" / "dev-cpu.yaml"
LOCAL_CLAIM = "local-run-dir"
"""The claim name the local run renders; the local cluster binds it to ``--run-dir``."""
ISOLATIONS = ("netns", "loopback")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..config.errors import existing_file

    p.add_argument(
        "-f",
        "--values",
        dest="values_files",
        action="append",
        default=[],
        metavar="FILE",
        help=f"chart values file (repeatable; later files win); default {DEFAULT_VALUES.relative_to(REPO_ROOT)}",
    )
    p.add_argument("--nodes", type=int, help="pods (simulated nodes): the chart's nodes; default: the values'")
    p.add_argument("--nproc-per-node", type=int, help="trainer ranks per pod; default: the values'")
    p.add_argument(
        "--run-dir", required=True, help="the shared volume every pod mounts: logs, metrics, summary and checkpoints"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        help="in-job restarts ft_launcher may make (trainer.resilience.launcher.max_restarts)",
    )
    p.add_argument(
        "--max-pod-recreations",
        dest="max_recreations",
        type=int,
        default=DEFAULT_MAX_RECREATIONS,
        help="LOCAL SAFETY CAP, not an operator feature: pod recreations after which the local "
        "job fails (a PyTorchJob with restartPolicy ExitCode and backoffLimit >= 1 recreates "
        f"failed pods forever; job.backoffLimit=0 fails at the first failure); default "
        f"{DEFAULT_MAX_RECREATIONS}",
    )
    p.add_argument(
        "--pod-start-delay",
        dest="pod_start_delays",
        action="append",
        default=[],
        metavar="INDEX=SECONDS",
        help="start pod INDEX (its place in the job; 0 hosts the rendezvous store) SECONDS after the "
        "others, the first time only (recreations start at once): an image pull on a fresh node "
        "(repeatable)",
    )
    p.add_argument(
        "--replacement-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="start a lost pod's replacement (node-loss) SECONDS after the loss, as a new node is "
        "provisioned and pulls the image; a pod that exits on its own is recreated at once "
        "(default 0)",
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@STEP[:rank=R|:node=N]",
        help="inject a fault once per job: the chaos drill (repeatable)",
    )
    p.add_argument(
        "--isolation",
        choices=ISOLATIONS,
        help="netns: a network namespace per pod (default when root and available); loopback: "
        "processes on 127.0.0.x (the fallback)",
    )
    p.add_argument("--rdzv-port", type=int, help="rendezvous.port; default: the chart's (loopback: a free port)")
    p.add_argument(
        "--release", default=DEFAULT_RELEASE, help=f"release name (names the pods); default {DEFAULT_RELEASE}"
    )
    p.add_argument(
        "--value",
        dest="chart_values",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a chart value as helm --set does, e.g. --value job.backoffLimit=0 (repeatable)",
    )
    p.add_argument(
        "--value-json",
        dest="chart_values_json",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set a chart value as helm --set-json does, e.g. --value-json shm.sizeLimit='\"2Gi\"' "
        "(repeatable; before --value)",
    )
    p.add_argument(
        "--manifests",
        metavar="FILE",
        type=existing_file,
        help="run these rendered manifests (resilient-fsdp render or helm template output) instead of "
        "rendering the chart: no chart, trainer or fault flags then",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print the ft_launcher agents' own logs (always saved in RUN_DIR/logs)",
    )
    p.add_argument(
        "--nofile",
        metavar="SOFT[:HARD]",
        help="the open-files limit each container starts with, as a container runtime sets it "
        "(netns); default 1024:524288, systemd's default that containerd 2.0 passes on",
    )
    p.add_argument(
        "--shared-volume-fsgroup",
        choices=("skip", "apply"),
        default="skip",
        help="whether fsGroup reaches the shared volume (netns): skip, as the FSx CSI driver does for "
        "ReadWriteMany volumes (default), or apply, as a driver with fsGroupPolicy File does",
    )
    p.add_argument("--config", help="trainer configuration file (trainer.* values)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set one trainer key, e.g. --set train.steps=50 (trainer.KEY; repeatable; applied last)",
    )


def choose_isolation(requested: Optional[str]) -> tuple[str, Optional[str]]:
    """(mode, a notice or None): netns when root and network namespaces work, else loopback."""
    from .runtime.netns_pods.plumbing import available

    if requested == "loopback":
        return "loopback", None
    ok, reason = available()
    if requested == "netns":
        if not ok:
            raise ConfigError(f"--isolation netns: {reason}")
        return "netns", None
    if ok:
        return "netns", None
    return "loopback", f"pods run as processes on loopback, not network namespaces: {reason}"


def trainer_values(config_file: Optional[str], overrides: list[str]) -> dict:
    """``--config FILE`` then ``--set`` as ``trainer`` values, typed as the trainer reads them
    (``--set optim.lr=3e-4`` is a number), so the chart's schema sees what the trainer would."""
    return user_tree(config_file, overrides)


def _under_mount(tree: object, declared: str, mount: str) -> object:
    """``tree`` with every string that is ``declared`` or a path under it moved under ``mount``."""
    if isinstance(tree, dict):
        return {k: _under_mount(v, declared, mount) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_under_mount(v, declared, mount) for v in tree]
    if isinstance(tree, str):
        return replace_paths(tree, [(declared.rstrip("/"), mount)], "^")
    return tree


def chart_values(args: argparse.Namespace, run_dir: Path, isolation: str, mount_path: Optional[str] = None) -> dict:
    """The values the local job renders with: the values files (``-f``, default
    values/dev-cpu.yaml), ``--value``/``--value-json`` as ``helm --set``/``--set-json``, then the
    flags that are chart values: ``--nodes`` (``nodes``), ``--nproc-per-node`` (``cpuRanksPerNode``,
    ``gpusPerNode`` on a GPU instance type), ``--config``/``--set`` (``trainer.*``),
    ``--max-restarts`` (``trainer.resilience.launcher.max_restarts``), ``--inject``
    (``chaos.inject``), ``--rdzv-port`` (``rendezvous.port``) and ``--run-dir`` (an
    ``existingClaim`` volume at ``storage.mountPath``, which is ``trainer.run_dir``)."""
    files = args.values_files or [DEFAULT_VALUES]
    values = load_values(files, args.chart_values, args.chart_values_json)
    declared = values.get("storage", {}).get("mountPath") or "/fsx"
    mount = mount_path or declared
    # The volume is modelled as a new FSx file system's: its root is whoever owns --run-dir and
    # fsGroup does not reach it, so under netns the init container that makes the run directories
    # the pod user's is on, as on a first EKS run; under loopback pods run as this user.
    prepare = (values.get("storage") or {}).get("prepare", isolation == "netns")
    trainer = trainer_values(args.config, args.overrides)
    if mount != declared:
        # Paths the user wrote under the volume's mount path (data.path=/fsx/data/text) name the
        # same files when the volume is rendered at another path (loopback: the run directory).
        trainer = _under_mount(trainer, declared, mount)
    forced: dict = {
        "storage": {
            "type": "existingClaim",
            "existingClaim": LOCAL_CLAIM,
            "mountPath": mount,
            "fsx": {"subnetId": ""},
            "fsxStatic": {"volumeHandle": ""},
            "prepare": prepare,
        },
        "trainer": deep_merge(trainer, {"run_dir": mount}),
    }
    if args.nodes is not None:
        forced["nodes"] = args.nodes
    if args.nproc_per_node is not None:
        merged = deep_merge(yaml.safe_load((chart_dir() / "values.yaml").read_text()), values)
        instance = (merged.get("instanceTypes") or {}).get(merged.get("instanceType")) or {}
        forced["gpusPerNode" if instance.get("gpus") else "cpuRanksPerNode"] = args.nproc_per_node
    if args.max_restarts is not None:
        forced["trainer"] = deep_merge(
            forced["trainer"], {"resilience": {"launcher": {"max_restarts": args.max_restarts}}}
        )
    chaos = list(values.get("chaos", {}).get("inject") or []) + list(args.inject)
    if chaos:
        forced["chaos"] = {"enabled": True, "inject": chaos}
    if args.rdzv_port is not None:
        forced["rendezvous"] = {"port": args.rdzv_port}
    elif isolation == "loopback":
        forced["rendezvous"] = {"port": free_port()}
    if isolation == "loopback" and "port" not in (values.get("metrics") or {}):
        # The pods share this machine's ports (each agent listens on its pod's own address).
        forced["metrics"] = {"port": free_port()}
    return deep_merge(values, forced)


def start_delays(flags: list[str], pods: Optional[int] = None) -> dict[int, float]:
    """``--pod-start-delay INDEX=SECONDS`` flags as pod index -> seconds; with ``pods``, each
    INDEX is also checked against a job of that many pods."""
    delays: dict[int, float] = {}
    for flag in flags:
        index_text, sep, seconds_text = flag.partition("=")
        example = "e.g. --pod-start-delay 0=30 starts pod 0, the store host, 30 s after the others"
        if not sep or not index_text.strip().isdigit():
            raise ConfigError(
                f"--pod-start-delay {flag}: give INDEX=SECONDS, INDEX a pod's place in the job "
                f"(0 for the first pod); {example}"
            )
        index = int(index_text)
        try:
            seconds = float(seconds_text)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise ConfigError(f"--pod-start-delay {flag}: SECONDS must be a number of seconds, 0 or more; {example}")
        if pods is not None and index >= pods:
            raise ConfigError(f"--pod-start-delay {flag}: the job has {pods} pod(s), so INDEX is 0 to {pods - 1}")
        if index in delays:
            raise ConfigError(f"--pod-start-delay {flag}: pod {index} already has a delay; give each pod one")
        delays[index] = seconds
    return delays


def prepare(args: argparse.Namespace) -> tuple[LocalJob, str, Optional[str]]:
    """Check the flags, render the chart, read its pods: (job, isolation, notice)."""
    for flag, value in (("--nodes", args.nodes), ("--nproc-per-node", args.nproc_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}={value}: must be at least 1")
    replacement_delay = getattr(args, "replacement_delay", 0.0) or 0.0
    if not math.isfinite(replacement_delay) or replacement_delay < 0:
        raise ConfigError(f"--replacement-delay={replacement_delay:g}: give a number of seconds, 0 or more")
    for flag, value in (("--max-restarts", args.max_restarts), ("--max-pod-recreations", args.max_recreations)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag}={value}: must be 0 or more")
    delay_flags = list(getattr(args, "pod_start_delays", None) or [])
    start_delays(delay_flags)
    # The trainer's own checks first, with its messages: a typo should not cost a render.
    config_path = str(Path(args.config).resolve()) if args.config else None
    load_config(config_path, list(args.overrides))
    run_dir = Path(args.run_dir).resolve()
    isolation, notice = choose_isolation(args.isolation)
    if getattr(args, "manifests", None):
        shaping = [
            flag
            for flag, given in (
                ("-f", args.values_files),
                ("--value", args.chart_values),
                ("--value-json", args.chart_values_json),
                ("--set", args.overrides),
                ("--config", args.config),
                ("--inject", args.inject),
                ("--nodes", args.nodes is not None),
                ("--nproc-per-node", args.nproc_per_node is not None),
                ("--max-restarts", args.max_restarts is not None),
                ("--rdzv-port", args.rdzv_port is not None),
            )
            if given
        ]
        if shaping:
            raise ConfigError(
                f"--manifests runs what was rendered; {', '.join(shaping)} would need a new render: "
                "render with them, or leave --manifests out"
            )
        documents = [d for d in yaml.safe_load_all(Path(args.manifests).read_text()) if d]
        values: dict = {}
        text = Path(args.manifests).read_text()
    else:
        values = chart_values(args, run_dir, isolation, mount_path=str(run_dir) if isolation == "loopback" else None)
        rendered = render(values, release=args.release)
        documents, text = rendered.documents(), rendered.text()
    workload = pods_of(documents)
    delays = start_delays(delay_flags, len(workload.pods))
    try:
        launcher_args = parse_agent_args(list(workload.pods[0].args))[1]
    except ValueError:
        launcher_args = []  # the agent names a bad flag of its own when the pod starts
    # The pods run this interpreter with its path: refuse spares its NVRx would train with.
    refused = hot_spares_unsupported(launcher_args, installed_version())
    if refused:
        raise ConfigError(
            f"{refused} (resilient-fsdp local: the NVRx on this Python's path; the test lane "
            "./scripts/test prepares has the image's, see docs/local-runs.md)"
        )
    # The trainer configuration the pods will load, checked as the trainer checks it.
    maps = [d for d in documents if d.get("kind") == "ConfigMap"]
    cfg_text = (maps[0].get("data") or {}).get("config.yaml", "") if maps else ""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(cfg_text)
    try:
        cfg = load_config(f.name, [])
    finally:
        os.unlink(f.name)
    nproc = workload.pods[0].ranks
    chaos = [a.split("=", 1)[1] for a in workload.pods[0].argv if a.startswith("--inject=")]
    specs = parse_faults(
        list(cfg.resilience.inject) + chaos, world_size=len(workload.pods) * nproc, nodes=len(workload.pods)
    )
    cut_off = sorted({s.kind for s in specs if s.kind in CUT_OFF_KINDS})
    if isolation == "loopback" and cut_off:
        raise ConfigError(
            f"{' and '.join(cut_off)} faults need --isolation netns (root): on loopback no pod has a "
            "network link of its own to cut"
        )
    endpoint = cfg.checkpoint.s3.endpoint_url if cfg.checkpoint.s3.uri else None
    host_ports = []
    if isolation == "netns" and endpoint and _is_loopback(endpoint):
        # A pod's loopback is its own: the local cluster relays the endpoint's port from each
        # pod's loopback to this machine's, so the URL the chart rendered works unchanged.
        host_ports.append(_port_of(endpoint))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "cluster").mkdir(exist_ok=True)
    (run_dir / "cluster" / "manifests.yaml").write_text(text)
    job = LocalJob(
        workload=workload,
        run_dir=run_dir,
        max_recreations=args.max_recreations,
        verbose=args.verbose,
        start_delays=delays,
        replacement_delay_s=replacement_delay,
    )
    job.extra_env = {JOB_START_ENV: repr(time.time())}
    job.nofile = nofile_limit(getattr(args, "nofile", None))
    job.host_ports = host_ports
    if host_ports:
        job.notes.append(
            f"checkpoint.s3.endpoint_url={endpoint} is this machine's loopback: each pod reaches it at "
            f"the same address, through a relay of port {host_ports[0]} in the pod (a local run's "
            "stand-in; on a cluster the endpoint must be an address the pods can reach)"
        )
    if notice:
        job.notes.append(notice)
    return job, isolation, notice


def _port_of(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"checkpoint.s3.endpoint_url={url}: its port is not a number from 1 to 65535") from None
    return port or (443 if parts.scheme == "https" else 80)


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_env(job: LocalJob, pod_requests: str) -> dict[str, str]:
    """What the local cluster adds to every pod's environment, beside the operator's variables."""
    env = dict(job.extra_env)
    env[REQUESTS_ENV] = pod_requests
    env["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), QUIET_WARNINGS) if w)
    return env


def metrics_note(workload, runtime) -> Optional[str]:
    """How to read pod 0's metrics endpoint from this machine, when the pods serve one."""
    pod = workload.pods[0]
    try:
        port = int(parse_agent_args(list(pod.args))[0].get("--metrics-port", 0))
    except ValueError:
        return None  # the agent says what is wrong with its flag
    if not port:
        return None
    if runtime.mode == "netns":
        from .runtime.netns_pods.plumbing import netns_name

        # The host has no address on the pods' bridge: read it from inside the pod.
        how = f"sudo ip netns exec {netns_name(runtime.run_id, pod.hostname)} curl -s localhost:{port}/metrics"
    else:
        how = f"curl -s {runtime.addresses[pod.hostname]}:{port}/metrics"
    return f"metrics: every pod's agent serves the run's metrics on port {port}; pod 0's: {how}"


def main(args: argparse.Namespace) -> int:
    try:
        job, isolation, _ = prepare(args)
    except WorkloadError as exc:
        raise ConfigError(str(exc)) from None
    from .runtime.loopback import LoopbackRuntime
    from .runtime.netns import NetnsRuntime
    from .runtime.netns_pods.run_state import new_run_id

    host_env = dict(os.environ)
    if isolation == "netns":
        mount = next(
            m.path
            for m in job.workload.pods[0].mounts
            if job.workload.pods[0].volumes[m.volume].kind == "persistentVolumeClaim"
        )
        runtime = NetnsRuntime(job.workload, job.run_dir, None, host_env, shared_mount=mount, host_ports=job.host_ports)
    else:
        runtime = LoopbackRuntime(job.workload, job.run_dir, new_run_id(), host_env)
    if job.nofile:
        runtime.nofile = job.nofile
    runtime.shared_fs_group = getattr(args, "shared_volume_fsgroup", "skip")
    try:
        job.extra_env = local_env(job, runtime.pod_path(requests_dir(job.run_dir)))
        note = metrics_note(job.workload, runtime)
        if note:
            job.notes.append(note)
        return LocalLauncher(job, runtime).run()
    finally:
        runtime.close()
