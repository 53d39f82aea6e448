"""The built-in model's size presets: their shapes and parameter counts, without torch.

The workstation side (``resilient-fsdp advise``) sizes checkpoints from these without importing
torch; :mod:`resilient_fsdp.train.model` builds the modules from the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


# Shapes follow well-known open models of each size so throughput and memory are realistic:
# 125m ~ GPT-2 small width, 1b ~ TinyLlama-1.1B, 8b ~ Llama-3-8B, 70b ~ Llama-3-70B.
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256),
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000),
    "1b": ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, vocab_size=32000),
    "8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256),
    "70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, rope_theta=500000.0
    ),
}


def preset_args(preset: str, vocab_size: int | None = None) -> ModelArgs:
    """The shapes of ``preset``, with another vocabulary when ``vocab_size`` is given."""
    args = PRESETS[preset]
    return replace(args, vocab_size=vocab_size) if vocab_size is not None else args


def parameter_count(args: ModelArgs) -> int:
    """Parameters of the model :mod:`~resilient_fsdp.train.model` builds from ``args``: the
    embedding and output projection, and per block two norms, the attention projections (grouped
    key/value heads) and the SwiGLU feed-forward; no biases."""
    head_dim = args.dim // args.n_heads
    attention = 2 * args.dim * args.n_heads * head_dim + 2 * args.dim * args.n_kv_heads * head_dim
    block = 2 * args.dim + attention + 3 * args.dim * args.ffn_dim
    return 2 * args.vocab_size * args.dim + args.n_layers * block + args.dim
