"""Reference models (GPT, Llama-style, MLP, ResNet-style CNN), presets and data.

Every model has the same top-level layout: ``embed`` (or ``stem``), ``layers``
(an ``nn.ModuleList``, one entry per transformer layer or residual block) and
``head``; each layer takes and returns one tensor, so a cut between layers
crosses exactly one tensor.

Weights are initialised *by parameter name*: every parameter draws from a CPU
generator seeded with ``(seed, full parameter name)``. A pipeline rank can
therefore build the model on the meta device, materialise only its own stage
(``to_empty``) and call ``model.init_weights(seed)``: it gets bit-for-bit the
weights an unpipelined copy built with the same seed has, without ever
allocating the other stages. Parameters still on the meta device are skipped.

The public API (``build_model``, ``PRESETS``, ...) lives in ``models.registry``.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch
from torch import nn


def stable_seed(*parts: object) -> int:
    """A 63-bit seed derived from ``parts``; stable across processes and Python runs
    (unlike ``hash``, which is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill(param: torch.Tensor, seed: int, name: str,
          draw: Callable[[torch.Tensor, torch.Generator], None]) -> None:
    """Draw on the CPU (same numbers on any device), then copy into ``param``."""
    gen = torch.Generator(device="cpu").manual_seed(stable_seed(seed, name))
    tmp = torch.empty(param.shape, dtype=torch.float32)
    draw(tmp, gen)
    param.copy_(tmp)


LinearStd = Callable[[str, nn.Linear], float]


def init_parameters(model: nn.Module, seed: int, *, linear_std: LinearStd,
                    embed_std: float = 0.02) -> None:
    """Initialise every materialised parameter of ``model`` from ``(seed, name)``.

    Rules by module type: Linear weights ``N(0, linear_std(module_name, m))``,
    Embeddings ``N(0, embed_std)``, Conv weights Kaiming-normal (fan_out, ReLU),
    norm weights 1, all biases 0. A parameter shared by two modules (weight
    tying) is initialised once, under its first name.
    """
    seen: set[int] = set()
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            for p_name, param in mod.named_parameters(recurse=False):
                if id(param) in seen or param.device.type == "meta":
                    continue
                seen.add(id(param))
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                _init_one(mod, mod_name, p_name, param, full, seed, linear_std, embed_std)


def _init_one(mod: nn.Module, mod_name: str, p_name: str, param: torch.Tensor, full: str,
              seed: int, linear_std: LinearStd, embed_std: float) -> None:
    if p_name == "bias":
        param.zero_()
    elif isinstance(mod, nn.Linear):
        std = linear_std(mod_name, mod)
        _fill(param, seed, full, lambda t, g: nn.init.normal_(t, 0.0, std, generator=g))
    elif isinstance(mod, nn.Embedding):
        _fill(param, seed, full, lambda t, g: nn.init.normal_(t, 0.0, embed_std, generator=g))
    elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        _fill(param, seed, full, lambda t, g: nn.init.kaiming_normal_(
            t, mode="fan_out", nonlinearity="relu", generator=g))
    elif isinstance(mod, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm2d)):
        param.fill_(1.0)
    else:
        raise AssertionError(f"no init rule for parameter {full} of {type(mod).__name__}")


def scaled_residual_std(n_layers: int, base_std: float = 0.02) -> float:
    """GPT-2's init for projections that write into the residual stream: the
    stream's variance then stays O(1) however many layers add to it."""
    return base_std / math.sqrt(2 * n_layers)
