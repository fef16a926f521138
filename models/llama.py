"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

Layout: ``embed`` (token embedding), ``layers`` (``LlamaBlock``s on the residual
stream ``[B, T, d]``) and ``head`` (final RMSNorm + vocabulary projection).
Each attention layer owns its rotary ``cos``/``sin`` tables as non-persistent
buffers, so a pipeline stage holding any subset of layers is self-contained.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder import DecoderLM, PreNormBlock, merge_heads, split_heads
from planner.errors import InvalidInputError


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    vocab_size: int
    max_seq: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_weights: bool = False

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "max_seq", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff"):
            if getattr(self, field_name) < 1:
                raise InvalidInputError(f"LlamaConfig.{field_name}", expected=">= 1",
                                        found=str(getattr(self, field_name)))
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise InvalidInputError("LlamaConfig.d_model", expected=f"n_heads={self.n_heads} times an even head size",
                                    found=str(self.d_model))
        if self.n_heads % self.n_kv_heads:
            raise InvalidInputError("LlamaConfig.n_kv_heads", expected=f"a divisor of n_heads={self.n_heads}",
                                    found=str(self.n_kv_heads))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Rotary(nn.Module):
    """Rotary tables ``cos``/``sin`` of shape ``[max_seq, head_dim/2]``.

    Non-persistent: derived from the config, so not in the state dict; rebuilt
    by ``reset_buffers`` after the module leaves the meta device.
    """

    def __init__(self, head_dim: int, max_seq: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq, self.theta = head_dim, max_seq, theta
        cos, sin = self._tables(torch.get_default_device())
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed on the CPU in float32 so every device gets the same tables.
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / self.theta ** (steps / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq, dtype=torch.float32, device="cpu"), inv_freq)
        return angles.cos().to(device), angles.sin().to(device)

    def reset_buffers(self) -> None:
        if self.cos.device.type != "meta":
            cos, sin = self._tables(self.cos.device)
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [B, H, T, head_dim]`` by position; pairs are (i, i + head_dim/2)."""
        t = x.shape[2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class GQAttention(nn.Module):
    """Causal attention with ``n_kv_heads`` key/value heads shared by groups of query heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.q(x), self.n_heads)
        k = split_heads(self.k(x), self.n_kv_heads)
        v = split_heads(self.v(x), self.n_kv_heads)
        q, k = self.rotary(q), self.rotary(k)
        # Explicit repeat instead of SDPA's enable_gqa: exports to ONNX and counts flops everywhere.
        k, v = (z.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for z in (k, v))
        return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(PreNormBlock):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GQAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def sublayers(self) -> tuple[tuple[nn.Module, nn.Module], ...]:
        return ((self.attn_norm, self.attn), (self.mlp_norm, self.mlp))


class LlamaEmbed(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx)


class Llama(DecoderLM):
    """``idx: LongTensor[B, T]`` -> logits ``[B, T, vocab_size]``."""

    RESIDUAL_PROJECTIONS = (".attn.o", ".mlp.down")

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg, embed=LlamaEmbed(cfg), layers=(LlamaBlock(cfg) for _ in range(cfg.n_layers)),
                         final_norm=nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps))

    def reset_buffers(self) -> None:
        """Recompute the rotary tables (derived from the config, not in the state dict)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, Rotary):
                    module.reset_buffers()
