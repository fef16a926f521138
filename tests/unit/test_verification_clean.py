"""The clean-run benchmark's plan shapes route each boundary tensor to the right verifier, as the right sender."""
from __future__ import annotations

import pytest
import torch

from benchmarks.verification import RunConfig
from benchmarks.verification_clean import ShapedPipeline, _senders
from planner.integrity.verifier import Verdict


class Recorder:
    """Stands in for a verifier: records (boundary, direction, sender) and passes everything."""

    def __init__(self, seen: list[tuple[int, str, int]], verdict: Verdict) -> None:
        self.seen, self.verdict = seen, verdict

    def check(self, boundary, direction, tensor, *, step, mb, sender, labels=None):
        self.seen.append((boundary, direction, sender))
        return self.verdict


def routed(shape: str, mb: int, *, flag: tuple[int, str] | None = None) -> tuple[list[tuple[int, str, int]], dict]:
    """What one microbatch's tensors reach the shape's verifiers as (``flag``: that check fails)."""
    pipe = ShapedPipeline(RunConfig(steps=1), shape)
    seen: list[tuple[int, str, int]] = []
    ok, bad = Verdict(flagged=False, tainted=False), Verdict(flagged=True, tainted=True)
    pipe.route = {key: Recorder(seen, bad if key == flag else ok) for key in pipe.route}
    idx = torch.randint(0, 256, (2, 32))
    pipe.microbatch(idx, torch.roll(idx, -1, 1), step=0, mb=mb)
    return seen, pipe.counts


@pytest.mark.parametrize(("shape", "mb", "expected"), [
    ("one-verifier", 1, [(0, "act", 0), (1, "act", 1), (2, "act", 2), (2, "grad", 3), (1, "grad", 2), (0, "grad", 1)]),
    ("split", 0, [(1, "act", 1), (2, "act", 2), (1, "grad", 2), (0, "grad", 1)]),
    ("replicated", 0, [(0, "act", 0), (1, "act", 1), (2, "act", 2), (2, "grad", 3), (1, "grad", 2), (0, "grad", 1)]),
    ("replicated", 1, [(0, "act", 0), (1, "act", 4), (2, "act", 2), (2, "grad", 3), (1, "grad", 2), (0, "grad", 4)]),
])
def test_each_shape_checks_its_boundaries_as_their_senders(shape, mb, expected):
    seen, counts = routed(shape, mb)
    assert seen == expected
    assert counts["checks"] == len(expected) and counts["dropped"] == counts["flags_microbatch"] == 0


def test_a_flagged_tensor_is_counted_and_dropped():
    seen, counts = routed("split", 0, flag=(1, "act"))
    assert seen == [(1, "act", 1)]                   # dropped: nothing downstream is sent
    assert (counts["checks"], counts["flags_microbatch"], counts["dropped"]) == (1, 1, 1)


def test_senders_per_shape():
    assert _senders("one-verifier") == {0, 1, 2, 3}
    assert _senders("split") == {1, 2}
    assert _senders("replicated") == {0, 1, 2, 3, 4}


def test_an_honest_change_on_the_split_placement_is_an_alert_and_bans_nobody():
    # Seed 2: at step 30 stage 1's gradients grow 2.4x and change shape for good (a loss wave); with no
    # verifier seeing both of its sides the step-level shape tests flag it. Those flags once locked the
    # monitor out (flagged every step from 32) and banned the honest rank 1 at step 36.
    from benchmarks.verification_clean import clean_run

    torch.set_num_threads(1)
    row = clean_run("split", steps=60, seed=2)
    assert row["banned"] == [] and row["blamed_pairs"] == 0, row
    # followed (its heavy gradient rows capped, summaries.ROW_ENERGY_CAP, it raises no alert: 6 before the cap)
    assert row["flags_step"] <= 10, row
