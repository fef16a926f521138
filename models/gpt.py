"""A GPT-2-style decoder: learned positions, pre-LayerNorm blocks, causal SDPA, GELU MLP.

Layout: ``embed`` (token + position embedding), ``layers`` (``GPTBlock``s, each
mapping the residual stream ``[B, T, d]`` to itself) and ``head`` (final
LayerNorm + vocabulary projection). No dropout, so runs are deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import init_parameters, scaled_residual_std
from planner.errors import InvalidInputError


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    vocab_size: int
    max_seq: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int = 0              # 0 means 4 * d_model
    tie_weights: bool = False  # head.proj.weight is embed.tok.weight
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "max_seq", "n_layers", "d_model", "n_heads"):
            if getattr(self, field_name) < 1:
                raise InvalidInputError(f"GPTConfig.{field_name}", expected=">= 1",
                                        found=str(getattr(self, field_name)))
        if self.d_model % self.n_heads:
            raise InvalidInputError("GPTConfig.d_model", expected=f"a multiple of n_heads={self.n_heads}",
                                    found=str(self.d_model))
        if self.d_ff < 0:
            raise InvalidInputError("GPTConfig.d_ff", expected=">= 0 (0 means 4 * d_model)",
                                    found=str(self.d_ff))

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model


class GPTEmbed(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # [B, T, d] -> [B, H, T, d/H]
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Final norm + projection to the vocabulary (shared by GPT and Llama)."""

    def __init__(self, norm: nn.Module, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class GPT(nn.Module):
    """``idx: LongTensor[B, T]`` -> logits ``[B, T, vocab_size]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = GPTEmbed(cfg)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.head = LMHead(nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps), cfg.d_model, cfg.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the token embedding with the output projection when configured.
        Called again after ``to_empty``, which replaces the two tensors separately."""
        if self.config.tie_weights:
            self.head.proj.weight = self.embed.tok.weight

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic GPT-2 init keyed by parameter name (see ``models``)."""
        self.tie_weights()
        out_std = scaled_residual_std(self.config.n_layers)

        def linear_std(name: str, _m: nn.Linear) -> float:
            return out_std if name.endswith((".attn.proj", ".mlp.proj")) else 0.02

        init_parameters(self, seed, linear_std=linear_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
