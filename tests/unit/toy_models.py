"""A tiny language model with the top-level units the profiler times (``embed``, ``layers.i``, ``head``)."""
from __future__ import annotations

import torch
from torch import nn


class ToyLM(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(layers))
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
