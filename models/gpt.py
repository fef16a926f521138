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

from models.decoder import DecoderLM, LMHead, PreNormBlock, merge_heads, split_heads  # noqa: F401 (LMHead: importable here too)
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
        q, k, v = self.qkv(x).split(x.shape[-1], dim=2)
        q, k, v = (split_heads(z, self.n_heads) for z in (q, k, v))
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GPTBlock(PreNormBlock):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = GPTMLP(cfg)

    def sublayers(self) -> tuple[tuple[nn.Module, nn.Module], ...]:
        return ((self.ln1, self.attn), (self.ln2, self.mlp))


class GPT(DecoderLM):
    """``idx: LongTensor[B, T]`` -> logits ``[B, T, vocab_size]``."""

    RESIDUAL_PROJECTIONS = (".attn.proj", ".mlp.proj")

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg, embed=GPTEmbed(cfg), layers=(GPTBlock(cfg) for _ in range(cfg.n_layers)),
                         final_norm=nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps))
