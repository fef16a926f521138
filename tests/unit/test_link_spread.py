"""The link share of an honest sample with almost no spread of its own (a window of one repeated byte)
is read against the honest samples' usual spread, not its own, while a sender that flattens what it
sends is still flagged."""
from __future__ import annotations

import torch

from planner.integrity.verifier import Verifier

torch.set_num_threads(1)

D, ROWS, MBS, STEPS = 16, 32, 4, 14


def _norm(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True)


class _Stage:
    """A pre-norm residual stage whose output also carries a little of its own per-row variation (what
    a linear surrogate of a real stage leaves unexplained)."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(0)
        self.w = torch.randn(D, D, generator=self.gen) / D ** 0.5

    def input(self, spread: float = 1.0) -> torch.Tensor:
        centre = torch.randn(1, D, generator=self.gen) * 2 + 1
        return centre + spread * torch.randn(ROWS, D, generator=self.gen)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(_norm(x) @ self.w) + 0.1 * torch.randn(ROWS, D, generator=self.gen)


def _trained() -> tuple[Verifier, _Stage]:
    """A verifier that watches a trusted stage 0's output and checks stage 1 (sender 1) with the link
    tests, after ``STEPS`` honest steps of ordinary samples."""
    v = Verifier({"warmup": 4, "distances": ["link", "residual"]}, [(0, "act"), (1, "act")], watched=[(0, "act")])
    stage = _Stage()
    for step in range(STEPS):
        for mb in range(MBS):
            x0 = stage.input()
            v.check(0, "act", x0, step=step, mb=mb, sender=0)
            assert not v.check(1, "act", stage(x0), step=step, mb=mb, sender=1).flagged
        v.end_step(step, [v.flag_events(step)])
    return v, stage


def _check(v: Verifier, x0: torch.Tensor, x1: torch.Tensor):
    v.check(0, "act", x0, step=STEPS, mb=0, sender=0)
    return v.check(1, "act", x1, step=STEPS, mb=0, sender=1)


def test_an_honest_sample_without_spread_of_its_own_passes_the_link_test() -> None:
    v, stage = _trained()
    x0 = stage.input(spread=0.02)   # one row repeated: "################################"
    verdict = _check(v, x0, stage(x0))
    assert not verdict.flagged, verdict
    assert verdict.scores["link"] < 0.3   # below the link floor: before, its own tiny spread made it ~1


def test_a_sender_that_flattens_its_output_is_still_flagged() -> None:
    v, stage = _trained()
    x0 = stage.input()
    x1 = stage(x0)
    flat = x1.mean(dim=0, keepdim=True) + 0.02 * torch.randn(ROWS, D, generator=stage.gen)
    verdict = _check(v, x0, flat)
    assert verdict.flagged and "link" in verdict.reasons, verdict
