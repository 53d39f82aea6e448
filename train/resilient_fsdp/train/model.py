"""The built-in decoder-only transformer (pre-norm, RoPE, grouped-query attention, SwiGLU).

Built on the meta device and materialised after sharding, so no rank ever holds the full model:
``build_model`` allocates nothing, and ``init_weights`` fills whatever shards exist afterwards.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .presets import ModelArgs, preset_args


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Computed per forward rather than stored as a buffer: a buffer would need its own
    # materialisation path after meta-device construction, and this costs microseconds.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate interleaved halves.
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens[b, t]) -> logits[b, t, vocab]``.

    ``layers`` is the list of blocks that FSDP shards one by one (the trainer looks for it on
    custom models too, unless ``model.blocks`` names another attribute). Its forward draws no
    random numbers, so activation checkpointing need not save and restore RNG state.
    """

    recompute_needs_rng = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = rope_tables(tokens.shape[1], self.args.dim // self.args.n_heads, self.args.rope_theta, h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise in place; works on sharded (DTensor) parameters after ``to_empty``."""
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        # Output projections of residual branches are scaled down with depth (GPT-2 style) so the
        # residual stream's variance does not grow with the number of layers.
        depth_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for layer in self.layers:
            for lin in (
                layer.attention.wq,
                layer.attention.wk,
                layer.attention.wv,
                layer.feed_forward.w1,
                layer.feed_forward.w3,
            ):
                nn.init.trunc_normal_(lin.weight, std=0.02)
            for lin in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.trunc_normal_(lin.weight, std=depth_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5)


def build_model(preset: str, vocab_size: int | None = None) -> Transformer:
    """The built-in model for ``preset``; call under ``torch.device("meta")`` to allocate nothing."""
    return Transformer(preset_args(preset, vocab_size))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
