"""FSDP2 sharding and activation checkpointing, applied in place to a meta-device model."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


# checkpoint_wrapper stores the wrapped block under this attribute name.
_AC_PREFIX = "_checkpoint_wrapped_module."


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: ``model.layers`` when the model has it."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return list(layers)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    return []


def mixed_precision_for(device: torch.device) -> MixedPrecisionPolicy:
    # bf16 compute with fp32 gradient reduction on GPUs; plain fp32 on CPU, where bf16 matmuls are
    # slow and the point of a CPU run is exact, comparable numerics.
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def canonical_name(name: str) -> str:
    """A parameter's name without the activation-checkpointing wrapper's prefix, so hashes and
    checkpoints identify the same parameter with and without activation checkpointing."""
    return name.replace(_AC_PREFIX, "")


def apply_ac(model: nn.Module) -> None:
    """Wrap each block so its activations are recomputed in backward instead of stored."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        for i, block in enumerate(layers):
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    elif isinstance(layers, nn.ModuleDict):
        for name, block in layers.items():
            layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> None:
    """``fully_shard`` each block, then the root (which takes the remaining embedding/head)."""
    mp = mixed_precision_for(device)
    blocks = blocks_of(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at the start of backward: keeping them
        # unsharded after forward saves one all-gather per step.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the (sharded) parameters on ``device`` and initialise them deterministically."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        # On a CPU mesh each rank draws its shard from the same seeded generator: deterministic
        # for a given world size, which is all a CPU run needs; torch warns about it regardless.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        if hasattr(model, "init_weights"):
            model.init_weights()
            return
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
