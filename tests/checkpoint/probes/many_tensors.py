"""A model factory (``model.factory=many_tensors:build``) whose checkpoint holds over 3,000
tensors with little arithmetic: what counts for the open-files tests is the number of tensors
staged, not the model's size. 8 blocks of 32 parameters (1,036 tensors with AdamW's two moments
and step counts) and 256 persistent buffers each (2,048 more, as running statistics are)."""

import torch
from torch import nn

BLOCKS, PIECES, STATS = 8, 30, 256


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.pieces = nn.ParameterList(nn.Parameter(torch.empty(2)) for _ in range(PIECES))
        for i in range(STATS):
            self.register_buffer(f"stat{i}", torch.empty(3))

    def reset_parameters(self) -> None:  # the trainer builds on the meta device, then initialises
        for p in self.pieces:
            nn.init.normal_(p, std=0.01)
        for i in range(STATS):
            getattr(self, f"stat{i}").fill_(float(i))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # One op for all the pieces: per-parameter ops would make each step slow on CPU.
        return h + torch.tanh(self.mix(h)) + torch.cat(list(self.pieces)).sum()


class ManyTensors(nn.Module):
    def __init__(self, vocab: int, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(BLOCKS))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def build(cfg):
    return ManyTensors(cfg.vocab_size or 256)
