"""Replicas check each other (issue 37): a sign-flipped or noised gradient contribution is flagged on its sender,
never on its twin, and twins that train honestly are not flagged.

The twins train a toy model together: a quadratic loss with a spread of curvatures (a gradient concentrated
in few coordinates, like a network's), each replica's gradient on its own noisy sample, the update a
momentum step along the sum of what they sent. So the honest twin's next gradient answers the update a flip
put into the sum, as it does in a real stage (what the monitor's response test reads)."""
from __future__ import annotations

import math

import pytest
import torch

from planner.integrity.contributions import SKETCH_SIZE, ContributionMonitor, sketch

DIM, START, LR, MOMENTUM = 4000, 30, 0.05, 0.9


def train(steps: int, *, attack=None, seed: int = 0, replicas: int = 2, feedback: bool = True,
          lr: float = LR) -> list[dict]:
    """Every flag event of ``steps`` steps of the twins' training; ``attack`` rewrites replica 1's contribution
    from ``START``; without ``feedback`` the weights stay put (no update answers the sum)."""
    gen = torch.Generator().manual_seed(seed)
    curvature = torch.exp(torch.empty(DIM).uniform_(math.log(1e-3), 0.0, generator=gen))
    w, velocity = 10 * torch.randn(DIM, generator=gen), torch.zeros(DIM)
    mon, events = ContributionMonitor(seed=seed), []
    for step in range(steps):
        parts = {r: curvature * w + curvature.sqrt() * torch.randn(DIM, generator=gen) for r in range(1, replicas + 1)}
        if attack is not None and step >= START:
            parts[1] = attack(parts[1], gen)
        events += mon.check(1, parts, step=step)
        if feedback:
            velocity = MOMENTUM * velocity + sum(parts.values())
            w = w - lr * velocity
    return events


def flip(g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return -g


def noise(g: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return g + g.std() * torch.randn(g.shape, generator=gen)   # the benchmark's kind=noise,std=1.0


def test_the_sketch_carries_the_density():
    gen = torch.Generator().manual_seed(0)
    dense, spike = torch.randn(100_000, generator=gen), torch.zeros(10_000)
    spike[7] = 3.0
    assert sketch(dense, seed=1).shape == (SKETCH_SIZE,)
    assert float(sketch(dense, seed=1)[1]) == pytest.approx(math.sqrt(2 / math.pi), abs=0.01)   # Gaussian
    assert float(sketch(spike, seed=1)[1]) == pytest.approx(0.01)   # 1 / sqrt(n): all in one coordinate
    assert float(sketch(torch.zeros(10), seed=1)[1]) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_twins_training_honestly_are_not_flagged(seed):
    assert train(200, seed=seed) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sign_flip_is_flagged_on_its_sender_never_its_twin(seed):
    events = train(60, attack=flip, seed=seed)
    assert events and {e["sender"] for e in events} == {1}
    assert min(e["step"] for e in events) <= START + 8
    assert all(e["reasons"] == ["contrib_dir"] for e in events)
    # flagged every step once found: five blamed steps in a row ban it
    first = min(e["step"] for e in events)
    assert {e["step"] for e in events} >= set(range(first, first + 5))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_is_flagged_on_its_sender_never_its_twin(seed):
    events = train(60, attack=noise, seed=seed)
    assert events and {e["sender"] for e in events} == {1}
    assert min(e["step"] for e in events) <= START + 2
    assert "contrib_density" in {r for e in events for r in e["reasons"]}


def test_of_three_replicas_the_flipped_one_is_flagged():
    events = train(60, attack=flip, replicas=3)
    assert events and {e["sender"] for e in events} == {1}
    assert min(e["step"] for e in events) <= START + 5


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(("lr", "feedback"), [(LR, False), (0.02, True), (0.01, True)])
def test_where_the_updates_answer_a_flip_little_its_twin_is_still_not_flagged(seed, lr, feedback):
    # the agreement alarms; the stage's history still holds the honest past, which the honest twin agrees
    # with more than the flipped one: nobody is flagged until the part since the onset says who flipped
    events = train(70, attack=flip, seed=seed, feedback=feedback, lr=lr)
    assert all(e["sender"] == 1 for e in events)
