"""The ``gain`` test: where one verifier sees both sides of an untrusted stage, the stage's own share of a
size change (its input's removed) has fences of its own, held closer than the raw ``scale``'s. Before, a
sender scaling its gradients by 3 (1.1 e-folds) while its input moved 0.1 e-folds scored under the raw
floor of 1.0, was learnt as honest at once and never flagged again (gpt-tiny, linked placement, seed 0)."""
from __future__ import annotations

import math

import torch

from planner.integrity.blame import STEP_MB
from planner.integrity.verifier import Verifier
from planner.verifier_config import VerifierConfig

torch.set_num_threads(1)

D, ROWS, MBS = 16, 64, 4


def _norm(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True)


def run_resized_sender(factor: float, *, start: int = 12, steps: int = 22, input_jump: float = 0.25
                       ) -> tuple[Verifier, list[dict]]:
    """A pre-norm residual stage (rank 1) after a trusted stage 0 whose output one verifier watches
    (the linked placement); from ``start`` rank 1 multiplies what it sends by ``factor``, and at that
    step its input grows by ``input_jump`` e-folds for good (a loss spike's calm after). Returns the
    verifier and the flags on rank 1's output."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(D, D, generator=gen) / D ** 0.5
    v = Verifier({"warmup": 6}, [(0, "act"), (1, "act")], watched=[(0, "act")])
    flags = []
    for step in range(steps):
        for mb in range(MBS):
            x0 = (torch.randn(ROWS, D, generator=gen) * 2 + 1) * (math.exp(input_jump) if step >= start else 1.0)
            x1 = x0 + torch.tanh(_norm(x0) @ weight)
            v.check(0, "act", x0, step=step, mb=mb, sender=0)
            verdict = v.check(1, "act", factor * x1 if step >= start else x1, step=step, mb=mb, sender=1)
            flags += [{"step": step, "mb": mb, "reasons": list(verdict.reasons)}] if verdict.flagged else []
        events = v.flag_events(step)
        flags += [e for e in events if e["boundary"] == 1]
        v.end_step(step, [events])
    return v, flags


def test_an_honest_stage_under_a_jumping_input_is_not_flagged() -> None:
    v, flags = run_resized_sender(1.0)
    assert flags == [] and v.banned == set()


def test_a_sender_that_scales_its_output_by_3_is_flagged_every_step_and_banned() -> None:
    v, flags = run_resized_sender(3.0)
    flagged = {f["step"] for f in flags}
    assert flagged >= set(range(12, 17)), flags
    assert all("gain" in f["reasons"] for f in flags)
    ban = next(e for e in v.events if e["type"] == "ban")
    assert v.banned == {1} and ban["step"] - 12 <= 4


def test_a_damping_sender_is_caught_by_its_step_gain() -> None:
    """Damping by 0.5 (-0.69 e-folds) stays inside a sample's fence (1.0) but not a step's (0.5)."""
    v, flags = run_resized_sender(0.5)
    assert {f["step"] for f in flags if f["mb"] == STEP_MB} >= set(range(12, 17))
    assert v.banned == {1}


def test_a_plan_made_before_gain_scores_the_own_share_as_scale() -> None:
    """A plan's ``verifier_config`` lists its tests: one written before ``gain`` keeps its behaviour."""
    old = [d for d in VerifierConfig().distances if d != "gain"]
    v = Verifier({"warmup": 6, "distances": old}, [(0, "act"), (1, "act")], watched=[(0, "act")])
    gen = torch.Generator().manual_seed(1)
    scores = {}
    for step in range(8):
        for mb in range(MBS):
            x0 = torch.randn(ROWS, D, generator=gen) * 2 + 1
            v.check(0, "act", x0, step=step, mb=mb, sender=0)
            scores = v.check(1, "act", 2 * x0, step=step, mb=mb, sender=1).scores
        v.end_step(step, [v.flag_events(step)])
    assert "scale" in scores and "gain" not in scores and scores["scale"] < 0.2
