"""Whether a model's training state fits in the GPUs it is sharded over: one rule, applied by the
chart at render (``templates/validations.yaml``, from the instance type's GPU memory and the
preset's parameters) and by the trainer on a GPU node, before the model is materialised (from
the device's own memory), so that a job that cannot fit is refused before it holds GPU nodes or,
at the latest, before it allocates.

The state a GPU holds while training is :data:`TRAINING_BYTES_PER_PARAM` per parameter of its
shard (fp32 weights, AdamW's two moments, the fp32 gradient) over the shard group
(``dist.shard_group_size``, or every GPU under FSDP). It may take :data:`MAX_STATE_PERCENT` of the
GPU's memory; the rest is the CUDA context, NCCL's buffers, one gathered block and the activations.
Torch-free (the workstation side, ``resilient-fsdp advise``, uses it too), integer arithmetic (as
Helm's templates do it), so that the chart and the trainer decide alike.
"""

from __future__ import annotations

from typing import Optional

TRAINING_BYTES_PER_PARAM = 16
"""What a GPU holds of each parameter of its shard while training: fp32 weights and AdamW's two
moments (12 B, what a checkpoint holds) and the fp32 gradient (4 B)."""
MAX_STATE_PERCENT = 75
"""The share of a GPU's memory the sharded training state may take, in percent; the chart's
``validations.yaml`` uses the same number."""


def state_bytes_per_gpu(params: int, shard_group: int) -> float:
    return params * TRAINING_BYTES_PER_PARAM / max(shard_group, 1)


def fits(params: int, shard_group: int, gpu_memory_bytes: int) -> bool:
    """``params`` parameters sharded over ``shard_group`` GPUs of ``gpu_memory_bytes`` each."""
    return params * TRAINING_BYTES_PER_PARAM * 100 <= MAX_STATE_PERCENT * gpu_memory_bytes * max(shard_group, 1)


def gpus_needed(params: int, gpu_memory_bytes: int) -> int:
    """The fewest GPUs the state of ``params`` parameters fits in, sharded over all of them."""
    need, room = params * TRAINING_BYTES_PER_PARAM * 100, MAX_STATE_PERCENT * gpu_memory_bytes
    return -(-need // room)


def refusal(
    params: int, shard_group: int, gpu_memory_bytes: int, model: str, gpus_per_node: int, where: str
) -> Optional[str]:
    """Why ``model`` (``params`` parameters, sharded over ``shard_group`` GPUs of
    ``gpu_memory_bytes``, ``gpus_per_node`` a pod) cannot train, naming the keys that fix it; None
    when it fits. ``where``: what the GPU's memory was read from."""
    if fits(params, shard_group, gpu_memory_bytes):
        return None
    gpus = gpus_needed(params, gpu_memory_bytes)
    nodes = -(-gpus // max(gpus_per_node, 1))
    return (
        f"{model} does not fit: its training state is {state_bytes_per_gpu(params, shard_group) / 1e9:.1f} GB a "
        f"GPU ({params / 1e9:.3g}e9 parameters x {TRAINING_BYTES_PER_PARAM} B for weights, gradients and AdamW's "
        f"moments, sharded over {shard_group} GPU(s)), and {where} has {gpu_memory_bytes / 1e9:.0f} GB, of which "
        f"the state may take {MAX_STATE_PERCENT}% (the rest: CUDA, NCCL's buffers, one gathered block, the "
        f"activations). Shard it over {gpus} GPUs or more: nodes={nodes} or more with dist.shard_group_size=0 "
        f"(or a shard group of at least {gpus} GPUs), or train a smaller model"
    )
