"""FSDP2 sharding and activation checkpointing, applied in place to a meta-device model."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..config import ConfigError

BLOCKS_KEY = "model.blocks"


def blocks_of(model: nn.Module, attr: Optional[str] = None) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one (and activation checkpointing wraps):
    ``model.<attr>`` (a dotted path, ``model.blocks``) when given, else ``model.layers``.

    A model without either is refused: it would silently become a single FSDP unit, every
    parameter gathered at once. The error names the key that fixes it.
    """
    container = _blocks_container(model, attr)
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return list(container)
    return list(container.values())


def _blocks_container(model: nn.Module, attr: Optional[str]) -> nn.Module:
    path = attr or "layers"
    target: object = model
    for part in path.split("."):
        target = getattr(target, part, None)
        if target is None:
            break
    if isinstance(target, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and len(target):
        return target
    kind = type(model).__qualname__
    if attr:
        what = "missing" if target is None else f"a {type(target).__qualname__}"
        raise ConfigError(
            f"{BLOCKS_KEY}={attr!r}: {kind}.{attr} is {what}, not a non-empty nn.ModuleList, "
            "nn.Sequential or nn.ModuleDict; name the attribute that holds the model's repeated "
            f"blocks, e.g. {BLOCKS_KEY}=transformer.h"
        )
    raise ConfigError(
        f"model {kind} has no .layers (an nn.ModuleList, nn.Sequential or nn.ModuleDict of its "
        f"repeated blocks): set {BLOCKS_KEY} to the attribute that holds them (e.g. {BLOCKS_KEY}=blocks "
        "or transformer.h), so that FSDP shards each block on its own"
    )


def needs_rng_in_recompute(model: nn.Module) -> bool:
    """Whether recomputing a block must replay the random numbers of its forward (dropout, ...).
    True unless the model says otherwise with ``recompute_needs_rng = False``."""
    return bool(getattr(model, "recompute_needs_rng", True))


def mixed_precision_for(device: torch.device) -> MixedPrecisionPolicy:
    # bf16 compute with fp32 gradient reduction on GPUs; plain fp32 on CPU, where bf16 matmuls are
    # slow and the point of a CPU run is exact, comparable numerics.
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_ac(model: nn.Module, attr: Optional[str] = None) -> None:
    """Wrap each block so its activations are recomputed in backward instead of stored.

    The RNG state is saved at each block's forward and restored for its recompute, so dropout
    draws the same masks again (otherwise the gradients are wrong), unless the model declares it
    draws no random numbers (:func:`needs_rng_in_recompute`).
    """
    container = _blocks_container(model, attr)
    preserve = needs_rng_in_recompute(model)
    keys = range(len(container)) if isinstance(container, (nn.ModuleList, nn.Sequential)) else list(container.keys())
    for key in keys:
        container[key] = checkpoint_wrapper(container[key], preserve_rng_state=preserve)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, device: torch.device, attr: Optional[str] = None) -> None:
    """``fully_shard`` each block (:func:`blocks_of`), then the root (which takes the rest)."""
    mp = mixed_precision_for(device)
    blocks = blocks_of(model, attr)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at the start of backward: keeping them
        # unsharded after forward saves one all-gather per step.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)


@torch.no_grad()
def materialize(
    model: nn.Module, device: torch.device, seed: int, init: Optional[Callable[[nn.Module], None]] = None
) -> None:
    """Allocate the (sharded) parameters on ``device`` and initialise them deterministically:
    ``init(model)`` when given, else the model's ``init_weights()``, else each module's
    ``reset_parameters()``."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        # On a CPU mesh each rank draws its shard from the same seeded generator: deterministic
        # for a given world size, which is all a CPU run needs; torch warns about it regardless.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        if init is not None:
            init(model)
            return
        if hasattr(model, "init_weights"):
            model.init_weights()
            return
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
