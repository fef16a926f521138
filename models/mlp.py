"""A residual MLP classifier: ``x: [B, d_in]`` -> logits ``[B, n_classes]``.

Layout: ``embed`` (input projection), ``layers`` (pre-LayerNorm residual
blocks on ``[B, d_model]``) and ``head`` (final LayerNorm + class projection).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import init_parameters
from planner.errors import InvalidInputError


@dataclass(frozen=True, slots=True, kw_only=True)
class MLPConfig:
    d_in: int
    d_model: int
    d_ff: int
    n_layers: int
    n_classes: int

    def __post_init__(self) -> None:
        for field_name in ("d_in", "d_model", "d_ff", "n_layers", "n_classes"):
            if getattr(self, field_name) < 1:
                raise InvalidInputError(f"MLPConfig.{field_name}", expected=">= 1",
                                        found=str(getattr(self, field_name)))


class MLPBlock(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ClassifierHead(nn.Module):
    def __init__(self, d_model: int, n_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Linear(cfg.d_in, cfg.d_model)
        self.layers = nn.ModuleList(MLPBlock(cfg) for _ in range(cfg.n_layers))
        self.head = ClassifierHead(cfg.d_model, cfg.n_classes)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init keyed by parameter name: N(0, 1/fan_in) weights, with the
        residual output projections scaled down by sqrt(2 * n_layers)."""
        scale = 1.0 / math.sqrt(2 * self.config.n_layers)

        def linear_std(name: str, m: nn.Linear) -> float:
            std = 1.0 / math.sqrt(m.in_features)
            return std * scale if name.endswith(".fc2") else std

        init_parameters(self, seed, linear_std=linear_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
