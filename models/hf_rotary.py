"""Decoder layers that make their own positions and rotary tables (``models.hf.adapt``).

Llama, Mistral, Qwen2 and their kin compute the rotary tables once, at the model level, and hand them to every
layer: split into stages, those tables would cross every cut. Here each layer computes them itself, inside its
own block, so only the hidden state crosses a cut; the model-level call becomes a no-op.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


class _RotaryCopy:
    """The rotary module as its forward sees it, with a fresh copy of its frequency buffer.

    The library converts the buffer with ``inv_freq.to(device, float32)``, a no-op that
    torch.export records as a node which later reads of the same buffer then reuse: every
    layer would read the first layer's node, sent across each cut. A copy made inside the
    layer keeps each layer reading the buffer itself (which every stage holds).
    """

    def __init__(self, rotary: nn.Module) -> None:
        self._rotary = rotary
        self.inv_freq = rotary.inv_freq.clone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rotary, name)


class _LayerWithOwnTables:
    """A decoder layer's forward that makes its positions and rotary tables itself.

    Installed as the layer's instance ``forward``; ops called here are traced under the
    layer's module path, so they land in the layer's block. The rotary module's forward is
    called directly (not through ``__call__``) for the same reason.
    """

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        self.layer = layer
        self.rotary = rotary

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        kwargs["position_ids"] = positions
        rotary = _RotaryCopy(self.rotary) if isinstance(getattr(self.rotary, "inv_freq", None), torch.Tensor) \
            else self.rotary
        kwargs["position_embeddings"] = type(self.rotary).forward(rotary, hidden_states, positions)
        return type(self.layer).forward(self.layer, hidden_states, *args, **kwargs)


def _no_tables(*args: Any, **kwargs: Any) -> None:
    """The model-level rotary call once every layer makes its own tables: nothing to compute."""
    return None


def own_rotary_tables(model: nn.Module) -> bool:
    """Give each decoder layer its own rotary tables; True when the model has rotary positions.

    Only when every layer takes ``position_embeddings`` (so none reads the model-level
    tables) does the model-level call become a no-op; otherwise the model is left as it is.
    """
    base = getattr(model, "base_model", model)
    rotary = getattr(base, "rotary_emb", None)
    layers = getattr(base, "layers", None)
    if not isinstance(rotary, nn.Module) or not isinstance(layers, nn.ModuleList):
        return isinstance(rotary, nn.Module)
    if not all("position_embeddings" in inspect.signature(type(layer).forward).parameters for layer in layers):
        return True
    for layer in layers:
        if not isinstance(vars(layer).get("forward"), _LayerWithOwnTables):
            layer.forward = _LayerWithOwnTables(layer, rotary)
    rotary.forward = _no_tables
    return True
