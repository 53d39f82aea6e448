"""Every adaptation this project makes to NVRx's restart layers, in one place.

- **CPU (gloo) process groups**: NVRx's in-process restart aborts NCCL only; :func:`abort_process_groups`
  aborts every backend (gloo's ``abort`` since torch 2.7) and destroys the groups, and
  :func:`make_abort` hands it to ``inprocess.Wrapper``.
- **NVRx 0.7's health checks**: 0.7 adds GPU, NVLink and NIC checks to in-process restart when
  ``LOCAL_RANK`` is set; on a CPU-only host they fail: :func:`without_health_checks`.
- **The c10d rendezvous store** is hosted by pod 0's agent, on the cluster and locally: NVRx 0.7
  keeps only its own (barrier) rendezvous, whose rounds only the agent hosting the store closes.
  When that pod is lost the other agents exit 1; the node agent (:mod:`.agent`) makes that exit
  retryable.
- **Warnings**: torch prints a pynvml deprecation notice in every process when NVRx's pynvml
  dependency is installed; :data:`QUIET_WARNINGS` silences it in the processes we start.

The checkpointing side has its own module, :mod:`resilient_fsdp.checkpoint.nvrx`.
"""

from __future__ import annotations

# What the restart layers import of NVRx (in-process restart; ft_launcher, which the node agent
# runs), for reports of what a machine can import.
NVRX_MODULES = ("nvidia_resiliency_ext.inprocess", "nvidia_resiliency_ext.fault_tolerance.launcher")
QUIET_WARNINGS = "ignore:The pynvml package is deprecated:FutureWarning"


def abort_process_groups() -> None:
    """Abort every process group's backend, then destroy them.

    NVRx's default abort handles NCCL only; gloo's ``abort`` (torch >= 2.7) fails the operations
    a rank can still be woken from. An operation waiting on a peer that never answers still runs
    to ``dist.timeout_s``: gloo has no way to cancel it, which is why tests keep that timeout short.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(dist.distributed_c10d._world.pg_names):
        for device in ("cpu", "cuda"):
            try:
                backend = group._get_backend(torch.device(device))
            except (RuntimeError, ValueError, AttributeError):
                continue
            try:
                backend.abort()
            except (RuntimeError, AttributeError):
                pass
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        pass


def make_abort():
    """An ``inprocess.abort.Abort`` that runs :func:`abort_process_groups`."""
    from nvidia_resiliency_ext import inprocess

    class AbortProcessGroups(inprocess.abort.Abort):
        def __call__(self, state):
            abort_process_groups()
            return state

    return AbortProcessGroups()


def without_health_checks(wrapper):
    """``wrapper`` with NVRx 0.7's restart health checks (GPU, NVLink, NIC) off: on a CPU-only
    host they fail and would turn every restart into a termination. 0.4 has none."""
    if hasattr(wrapper, "restart_health_check"):
        wrapper.restart_health_check = None
    return wrapper
