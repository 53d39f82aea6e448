"""In-process restart: NVRx ``inprocess.Wrapper`` re-enters the training function in the same
processes after an exception or a hang on any rank.

No ``from __future__ import annotations`` here: ``inprocess.Wrapper`` finds the parameter that
receives its ``CallWrapper`` by the annotation's class, which string annotations would hide.
"""

import datetime
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from ..config import InProcessConfig
from . import exit_codes, nvrx

# NVRx in-process restart warns at every start that its own logging was not configured.
warnings.filterwarnings("ignore", message="logging not initialized, logs are disabled")


LAST_CALL_WAIT_S = 0.1


class InProcessRestartsExhausted(BaseException):
    """Passes through in-process restart to the in-job restart below it."""


class NotRetried(BaseException):
    """A configuration-type failure (:func:`.exit_codes.is_configuration_failure`), carried through
    in-process restart, which retries every ``Exception``, so that no layer retries it."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class InProcessAttempt:
    """One call of the training function under in-process restart.

    ``number``: 0 for the first call, then one more per restart (equal on every rank).
    ``ping``: marks progress (once per step) for the wrapper's hang detection.
    ``store``: the key space this attempt's process group must rendezvous in.
    """

    number: int
    ping: Callable[[], None]
    store: Any


_OWN_CONNECTION: dict = {}


def own_connection(base_store: dist.Store, timeout_s: float) -> dist.Store:
    """This process's own client of the wrapper's store (made once, kept across attempts), for
    the attempt's process group.

    The wrapper's monitor thread waits on ``base_store`` for interruptions, ``monitor_thread_interval``
    at a time, and a TCPStore client holds its lock for a whole wait: every get or wait of the
    group's rendezvous on that client queued behind one (measured: the group took 2.0 s instead
    of 0.05 s after each in-process restart, and its first start 2-4 s). A second connection to the
    same server does not share that lock. The cost: at N ranks, rank 0's server holds 2N
    connections instead of N.
    """
    if not isinstance(base_store, dist.TCPStore):
        return base_store  # a store without a connection to share (FileStore, HashStore)
    where = (base_store.host, base_store.port)
    if where not in _OWN_CONNECTION:
        _OWN_CONNECTION[where] = dist.TCPStore(*where, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return _OWN_CONNECTION[where]


def run_in_process(cfg: InProcessConfig, body: Callable[[InProcessAttempt], Any]) -> Any:
    """Run ``body(attempt)`` under ``inprocess.Wrapper``; on a fault anywhere, every rank calls it
    again (``attempt.number`` + 1) in the same process.

    ``body`` must create the process group (in ``attempt.store``) and the model itself and load
    the newest checkpoint.
    """
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess import CallWrapper

    seconds = datetime.timedelta
    soft = cfg.soft_timeout_s
    # Monitoring intervals must be shorter than the timeouts they serve; short timeouts (tests)
    # get proportionally short intervals.
    interval = seconds(seconds=min(1.0, soft / 5, cfg.heartbeat_timeout_s / 5))
    wrapper = nvrx.new_wrapper(
        inprocess.Wrapper,
        store_factory=nvrx.hosting_store_factory(),  # rank 0 hosts it or says why
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + cfg.store_port_offset},
        abort=nvrx.make_abort(),  # shuts the gloo group's connections down first
        health_check=nvrx.rank_health_check(),  # CudaHealthCheck on GPU nodes
        rank_assignment=nvrx.whole_world_rank_assignment(),  # a lost rank is the in-job restart's
        soft_timeout=seconds(seconds=soft),
        hard_timeout=seconds(seconds=cfg.hard_timeout_s),
        heartbeat_timeout=seconds(seconds=cfg.heartbeat_timeout_s),
        barrier_timeout=seconds(seconds=cfg.barrier_timeout_s),
        completion_timeout=seconds(seconds=cfg.barrier_timeout_s),
        monitor_thread_interval=interval,
        monitor_process_interval=interval,
        heartbeat_interval=interval,
        progress_watchdog_interval=interval,
        # How long the monitor waits for other ranks' interruption records before aborting: they
        # name the faults in the log only; every rank is restarted either way.
        last_call_wait=seconds(seconds=min(LAST_CALL_WAIT_S, soft / 10)),
        termination_grace_time=seconds(seconds=min(5.0, soft)),
    )

    def attempt(call_wrapper: CallWrapper = None):
        iteration = call_wrapper.iteration
        if iteration >= cfg.max_iterations:
            raise InProcessRestartsExhausted(
                f"{iteration} in-process restarts reached resilience.in_process.max_iterations="
                f"{cfg.max_iterations}; leaving recovery to the in-job restart"
            )
        # The wrapper's own store is hosted by rank 0 of this generation of processes, so it is
        # new after every in-job restart, and every rank of a generation agrees on the iteration.
        # Keys derived from TORCHELASTIC_RESTART_COUNT would not do: a node restarted because a
        # peer failed keeps its count, so nodes would rendezvous under different keys and hang.
        connection = own_connection(call_wrapper.base_store, cfg.barrier_timeout_s)
        store = dist.PrefixStore(f"/resilient_fsdp/in_process_{iteration}", connection)
        try:
            return body(InProcessAttempt(iteration, call_wrapper.ping, store))
        except Exception as exc:
            if exit_codes.is_configuration_failure(exc):
                raise NotRetried(exc) from exc  # re-raised at once, never retried
            raise

    return wrapper(attempt)()
