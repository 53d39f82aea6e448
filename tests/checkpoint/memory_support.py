"""What the memory tier's tests share: a small model trained a few steps with AdamW, so that its
optimizer has moments and step counts to snapshot."""

from __future__ import annotations

import torch
from torch import nn


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for _ in range(3):
        model(torch.randn(5, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer
