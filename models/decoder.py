"""What the decoder-only language models (GPT, Llama) share: block, head and top-level model.

Each model keeps its own submodule names (``ln1``/``attn``, ``attn_norm``/``attn``,
...), since those names are the module paths and state-dict keys that plans
and checkpoints refer to; only the wiring lives here.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from models import init_parameters, scaled_residual_std


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[B, T, H * hd]`` -> ``[B, H, T, hd]`` (a view)."""
    b, t, width = x.shape
    return x.view(b, t, n_heads, width // n_heads).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, hd]`` -> ``[B, T, H * hd]``, the inverse of :func:`split_heads`."""
    b, h, t, hd = y.shape
    return y.transpose(1, 2).reshape(b, t, h * hd)


class PreNormBlock(nn.Module):
    """A pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Subclasses register their modules under their own names and return them,
    in order, from :meth:`sublayers`.
    """

    def sublayers(self) -> tuple[tuple[nn.Module, nn.Module], ...]:
        """``((norm, sublayer), ...)`` in the order they apply to the residual stream."""
        raise NotImplementedError(f"{type(self).__name__} must define sublayers()")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, sublayer in self.sublayers():
            x = x + sublayer(norm(x))
        return x


class LMHead(nn.Module):
    """Final norm + projection to the vocabulary."""

    def __init__(self, norm: nn.Module, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class DecoderLM(nn.Module):
    """``idx: LongTensor[B, T]`` -> logits ``[B, T, vocab_size]`` through ``embed``, ``layers``, ``head``.

    ``RESIDUAL_PROJECTIONS`` names (by suffix) the linear layers that write into
    the residual stream; they get GPT-2's depth-scaled init.
    """

    RESIDUAL_PROJECTIONS: tuple[str, ...] = ()

    def __init__(self, cfg: Any, *, embed: nn.Module, layers: Iterable[nn.Module], final_norm: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.head = LMHead(final_norm, cfg.d_model, cfg.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the token embedding with the output projection when configured.
        Called again after ``to_empty``, which replaces the two tensors separately."""
        if self.config.tie_weights:
            self.head.proj.weight = self.embed.tok.weight

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic GPT-2-style init keyed by parameter name (see ``models``)."""
        self.tie_weights()
        out_std = scaled_residual_std(self.config.n_layers)
        residual = self.RESIDUAL_PROJECTIONS

        def linear_std(name: str, _m: nn.Linear) -> float:
            return out_std if name.endswith(residual) else 0.02

        init_parameters(self, seed, linear_std=linear_std)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute derived (non-persistent) buffers after the weights are materialised."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

