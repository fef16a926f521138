"""What a rank keeps while a verifier's verdict is still out (deferred verdicts, see ``executor``).

* :class:`ReplayPoint`: the state a forward started from, so that it can run again on zeros
  if its input is dropped after all (the RNG, and the stage's buffers, which only change in
  place, e.g. BatchNorm's running statistics).
* :class:`HeldBackward` and :func:`merge_grads`: a backward's parameter gradients kept apart
  from those accumulated before it, merged in (or discarded) once its gradient's verdict comes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class HeldBackward:
    """A backward whose incoming gradient still awaits its verdict: the parameters' ``.grad``
    hold only its contribution, ``stash`` what they had accumulated before it."""

    mb: int
    stash: list[torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class ReplayPoint:
    """What a forward run again on zeros (its input dropped after all) must start from."""

    rng: torch.Tensor
    device_rng: torch.Tensor | None
    buffers: tuple[tuple[torch.Tensor, torch.Tensor], ...]   # (buffer, its value before the forward)

    @classmethod
    def take(cls, device: torch.device, buffers: Sequence[torch.Tensor]) -> ReplayPoint:
        device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(rng=torch.get_rng_state(), device_rng=device_rng,
                   buffers=tuple((b, b.detach().clone()) for b in buffers))

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.rng)
        if self.device_rng is not None:
            torch.cuda.set_rng_state(self.device_rng, device)
        with torch.no_grad():
            for buffer, before in self.buffers:
                buffer.copy_(before)


def merge_grads(params: Sequence[torch.Tensor], stash: Sequence[torch.Tensor | None], *, keep: bool) -> None:
    """Put back the gradients set aside before a held backward, whose own are in ``.grad``.

    ``keep``: the set-aside ones plus the held backward's (``stash.add_``: the very sum
    autograd's in-place accumulation computes). Otherwise the set-aside ones alone; where
    there were none, zeros for a parameter the backward reached, as back-propagating a zero
    gradient would leave (an optimizer skips a parameter without a gradient, not one of zeros).
    """
    for p, before in zip(params, stash, strict=True):
        mine = p.grad
        if keep:
            if before is not None and mine is not None:
                p.grad = before.add_(mine)
            elif before is not None:
                p.grad = before
        elif before is not None:
            p.grad = before
        elif mine is not None:
            p.grad = torch.zeros_like(mine)
