"""A model traced on the meta device whatever it was built on, so every trace of it is the same graph.

A model's exported graph depends on where its tensors live: CPU SDPA returns a layout whose
``transpose().contiguous()`` is a no-op that export drops, the meta kernel one where it is a copy it
keeps. The CLI traces and every rank exports on meta; the Python API does too, through this.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

META = torch.device("meta")


@contextlib.contextmanager
def on_meta(model: nn.Module, inputs: Sequence[Any]) -> Iterator[tuple[Any, ...]]:
    """``model`` with each parameter and buffer swapped for a meta tensor of its shape (tied ones stay tied),
    restored on exit; yields ``inputs`` on meta. No weight is copied."""
    twins: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for name, tensor in list(store.items()):
                    if tensor is None or tensor.device.type == "meta":
                        continue
                    if id(tensor) not in twins:
                        twins[id(tensor)] = _meta_like(tensor)
                    swapped.append((store, name, tensor))
                    store[name] = twins[id(tensor)]
        yield tuple(x.to(META) if isinstance(x, torch.Tensor) else x for x in inputs)
    finally:
        for store, name, tensor in reversed(swapped):
            store[name] = tensor


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    twin = torch.empty_like(tensor, device=META)
    return nn.Parameter(twin, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else twin
