"""Blame that stays with the attacker when a damped stage makes the honest stage after it fail its link
test, and watch-only copies of a trusted sender's tensor that feed the link test but never flag."""
from __future__ import annotations

import torch

from planner.integrity.blame import blame
from planner.integrity.fits import Fit
from planner.integrity.monitor import Monitor, upstream_culprit
from planner.integrity.verifier import Verifier
from planner.verifier_config import VerifierConfig

torch.set_num_threads(1)

D, ROWS, MBS = 16, 64, 4


def _norm(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True)


def run_chain(steps: int, *, garbage_in: bool = False) -> tuple[Verifier, list[dict]]:
    """Two pre-norm residual stages (ranks 1 and 2) after a trusted stage 0: one verifier watches
    boundary 0 (rank 0's output, the input of stage 1) and checks boundaries 1 and 2. Returns the
    verifier and every flag event."""
    gen = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(D, D, generator=gen) / D ** 0.5 for _ in range(2))
    v = Verifier({"warmup": 6}, [(0, "act"), (1, "act"), (2, "act")], watched=[(0, "act")])
    events: list[dict] = []
    for step in range(steps):
        for mb in range(MBS):
            x0 = torch.randn(ROWS, D, generator=gen) * 2 + 1
            x1 = x0 + torch.tanh(_norm(x0) @ w1)
            x2 = x1 + torch.tanh(_norm(x1) @ w2)
            seen = torch.randn(ROWS, D, generator=gen) * 50 if garbage_in else x0
            v.check(0, "act", seen, step=step, mb=mb, sender=0)
            v.check(1, "act", x1, step=step, mb=mb, sender=1)
            v.check(2, "act", x2, step=step, mb=mb, sender=2)
        flags = v.flag_events(step)
        events += flags
        v.end_step(step, [flags])
    return v, events


def test_a_watched_trusted_sender_is_never_flagged_and_feeds_the_link_test() -> None:
    v, events = run_chain(14, garbage_in=True)
    assert not [e for e in events if e["boundary"] == 0]
    assert v.summary()["monitors"][0]["flagged"] == 0
    v, events = run_chain(14)
    fences = {(m["boundary"], m["direction"]): m["fences"] for m in v.summary()["monitors"]}
    assert fences[(1, "act")]["link"] is not None and fences[(2, "act")]["link"] is not None
    assert not events and not v.banned


def _fit(dlog: float | None, sender: int | None = 1) -> dict[str, Fit]:
    return {"link": Fit(num=1.0, den=1.0, update=(), input_dlog=dlog, input_sender=sender)}


def test_a_link_flag_fed_a_resized_input_is_laid_on_the_input_s_sender() -> None:
    """Stage 1 halves what it sends (-0.69 e-folds): its own output passes the scale-free tests, but
    stage 2's output no longer follows its input, and that link flag is stage 1's doing."""
    assert upstream_culprit([_fit(-0.69)], ["link"]) == 1
    assert upstream_culprit([_fit(-0.69), _fit(-0.6)], ["residual", "drift"]) == 1
    assert upstream_culprit([_fit(-0.1)], ["link"]) is None                 # an input that kept its size
    assert upstream_culprit([_fit(-0.69)], ["link", "scale"]) is None       # a test of the stage's own
    assert upstream_culprit([_fit(-0.69, None)], ["link"]) is None          # a trusted (watched) input
    assert upstream_culprit([_fit(None)], ["link"]) is None                 # no reference for the input yet


def test_the_input_s_blame_runs_on_while_the_flags_do() -> None:
    """The input's monitor learns the new size within a step or two; the flags it caused go on and
    stay laid on the input's sender until the flagged sender passes a step."""
    mon = Monitor(VerifierConfig(), 2, "act")
    assert mon.culprit(2, [_fit(-0.69)], ["link"]) == 1
    assert mon.culprit(2, [_fit(-0.05)], ["link"]) == 1            # input size learnt, flags unbroken
    assert mon.culprit(2, [_fit(-0.05)], ["mad"]) is None          # another test's flag is the sender's
    mon._runs.pop(2)                                               # what a passed step does (close())
    assert mon.culprit(2, [_fit(-0.05)], ["link"]) is None


def test_a_run_of_flags_that_began_as_the_sender_s_own_stays_its_own() -> None:
    """A sign-flipping attacker is flagged on every microbatch from the attack's start, its input at its
    usual size; when that input later grows in training, the run is still the attacker's, not the honest
    input sender's."""
    mon = Monitor(VerifierConfig(), 0, "grad")
    assert mon.culprit(1, [_fit(0.02, 2)], ["skew", "link"]) is None
    assert mon.culprit(1, [_fit(0.01, 2)], ["link"]) is None
    assert mon.culprit(1, [_fit(0.40, 2)], ["link"]) is None       # the input grew: still the sender's run
    mon._runs.pop(1)                                               # a passed step ends the run
    assert mon.culprit(1, [_fit(0.40, 2)], ["link"]) == 2


def test_blame_lays_an_upstream_flag_where_its_input_crossed() -> None:
    laid = {"type": "flag", "step": 3, "mb": 0, "boundary": 2, "direction": "act", "sender": 2, "upstream": 1}
    other = {"type": "flag", "step": 3, "mb": 0, "boundary": 1, "direction": "grad", "sender": 1}
    assert blame([laid]) == {1}
    assert blame([laid, other]) == {1}    # forward at boundary 1 comes before the backward there
    grad = {"type": "flag", "step": 3, "mb": 1, "boundary": 0, "direction": "grad", "sender": 1, "upstream": 2}
    assert blame([grad, {**other, "mb": 1, "boundary": 2, "sender": 3}]) == {3}
