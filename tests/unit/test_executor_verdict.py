"""Deferred verdicts: a backward held apart from the accumulated gradients, then merged or dropped,
leaves exactly the gradients of waiting for the verdict first (planner.runtime.rank.deferred.merge_grads)."""
from __future__ import annotations

import pytest
import torch

from planner.runtime.rank.deferred import merge_grads


class _Stage(torch.nn.Module):
    """Two used layers, a parameter only the second microbatch reaches, and one nobody reaches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.late = torch.nn.Parameter(torch.randn(8))
        self.unused = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, *, late: bool) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        return h * self.late if late else h


def _backward(stage: _Stage, seed: int, *, late: bool, grad_scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=gen)
    out = stage(x, late=late)
    out.backward(torch.randn(out.shape, generator=gen) * grad_scale)


def _grads(stage: _Stage) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in stage.named_parameters()}


def _held(stage: _Stage, seed: int, *, late: bool, grad_scale: float, keep: bool) -> None:
    params = list(stage.parameters())
    stash = [p.grad for p in params]
    for p in params:
        p.grad = None
    _backward(stage, seed, late=late, grad_scale=grad_scale)
    merge_grads(params, stash, keep=keep)


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            assert got[name] is not None, name
            assert torch.equal(got[name], want[name]), name   # bit for bit, not merely close


@pytest.mark.parametrize("first_held", [False, True])
def test_kept_held_backward_equals_in_place_accumulation(first_held):
    ref, held = _Stage(), _Stage()
    for seed in (1, 2, 3):
        _backward(ref, seed, late=seed == 3)
    if first_held:   # the step's first backward held: nothing set aside yet
        _held(held, 1, late=False, grad_scale=1.0, keep=True)
    else:
        _backward(held, 1, late=False)
    _backward(held, 2, late=False)
    _held(held, 3, late=True, grad_scale=1.0, keep=True)
    _assert_same(_grads(held), _grads(ref))
    assert held.unused.grad is None


def test_dropped_held_backward_equals_back_propagating_zeros():
    """A flagged gradient (here huge) is held, then dropped: the same gradients as a zero
    incoming gradient, including zeros (not None) for a parameter only it reached."""
    ref, held = _Stage(), _Stage()
    _backward(ref, 1, late=False)
    _backward(ref, 2, late=True, grad_scale=0.0)
    _backward(held, 1, late=False)
    _held(held, 2, late=True, grad_scale=1e30, keep=False)
    got, want = _grads(held), _grads(ref)
    _assert_same(got, want)
    assert got["late"] is not None and not got["late"].any()


def test_dropped_first_backward_leaves_zeros_where_it_reached():
    ref, held = _Stage(), _Stage()
    _backward(ref, 1, late=True, grad_scale=0.0)
    _held(held, 1, late=True, grad_scale=1e30, keep=False)
    _assert_same(_grads(held), _grads(ref))
