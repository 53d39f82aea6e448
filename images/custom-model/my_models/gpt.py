"""A small GPT (learned positions, LayerNorm, GELU MLP), built the way the trainer expects.

The trainer calls ``build_model(cfg)`` under the meta device, shards each entry of ``layers``
with FSDP2, then calls ``init_weights()`` on the sharded parameters. ``forward`` maps token ids
``[batch, seq]`` to logits ``[batch, seq, vocab]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from resilient_fsdp.config import ConfigError
from torch import nn

DIM = 128
N_LAYERS = 2
N_HEADS = 4
MAX_SEQ_LEN = 2048  # learned positions: sequences longer than this are refused in forward


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp_in = nn.Linear(dim, 4 * dim)
        self.mlp_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))


class SmallGPT(nn.Module):
    # The trainer refuses a data.seq_len above it before anything is allocated; the values file
    # says the same (model.max_seq_len), so that the chart refuses it at render.
    max_seq_len = MAX_SEQ_LEN

    def __init__(self, vocab_size: int, dim: int = DIM, n_layers: int = N_LAYERS, n_heads: int = N_HEADS):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(MAX_SEQ_LEN, dim)
        # `layers`: the trainer shards each block on its own, so no rank gathers the whole model.
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > MAX_SEQ_LEN:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens; this model handles up to {MAX_SEQ_LEN} "
                             "(data.seq_len)")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's scheme; in place, so it works on the sharded parameters FSDP2 leaves."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        # Residual projections scaled down with depth, so the residual stream keeps its size.
        for block in self.layers:
            for proj in (block.proj, block.mlp_out):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / (2 * len(self.layers)) ** 0.5)


def build_model(cfg) -> nn.Module:
    """``model.factory: my_models.gpt:build_model``; ``cfg`` is the trainer's ``model`` section."""
    if not cfg.vocab_size:
        # ConfigError: the trainer reports it as a configuration error (exit 2, no restarts).
        raise ConfigError("my_models.gpt needs model.vocab_size (the tokenizer's vocabulary size), "
                         "e.g. trainer.model.vocab_size: 4096 in the chart's values")
    return SmallGPT(cfg.vocab_size)
