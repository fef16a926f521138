"""A row's energy is capped in the summaries (``summaries.ROW_ENERGY_CAP``): an honest gradient whose attention-sink
row held 1144x the median row's energy (tiny HF Llama, issue 37) failed the size, spectral and label tests at once
and was dropped. Corruptions of the whole tensor are still seen, and a replay's sketch is the raw tensor's."""
from __future__ import annotations

import torch

from planner.integrity import distances as dist
from planner.integrity import summaries as summ
from planner.integrity.verifier import Verifier

torch.set_num_threads(1)

D, BATCH, SEQ, MBS = 32, 4, 32, 3


def _summary(x: torch.Tensor) -> summ.Summary:
    return summ.summarize(x, directions=summ.random_directions(D, 8, 0), levels=summ.quantile_levels(16))


def _gradient(gen: torch.Generator, basis: torch.Tensor, sink: float = 1.0) -> torch.Tensor:
    """``[BATCH, SEQ, D]`` low-rank rows; the first sequence's first row carries ``sink`` times the energy."""
    x = torch.randn(BATCH, SEQ, basis.shape[0], generator=gen) @ basis + 0.05 * torch.randn(BATCH, SEQ, D, generator=gen)
    x[0, 0] *= sink ** 0.5
    return x * 1e-4


def test_rows_under_the_cap_are_left_as_they_are() -> None:
    x = torch.randn(128, D)
    assert summ.cap_heavy_rows(x) is None
    assert summ.cap_heavy_rows(torch.zeros(16, D)) is None


def test_a_heavy_row_is_capped_at_the_cap_times_the_median_nonzero_row() -> None:
    x = torch.ones(64, D)
    x[:40] = 0.0     # masked positions send zero rows: the median is of the others
    x[50] *= 100.0
    capped = summ.cap_heavy_rows(x)
    assert capped is not None
    energy = capped.square().sum(dim=1)
    assert torch.isclose(energy[50], torch.tensor(summ.ROW_ENERGY_CAP * D))
    assert torch.equal(capped[:50], x[:50]) and torch.equal(capped[51:], x[51:])


def test_one_heavy_row_no_longer_reads_as_a_size_change_but_a_scale_of_every_row_does() -> None:
    gen = torch.Generator().manual_seed(0)
    basis = torch.randn(4, D, generator=gen)
    ref = dist.reference(_summary(_gradient(gen, basis)))
    sunk = _gradient(gen, basis, sink=1000.0)
    assert dist.summary_scores(_summary(sunk), ref, ("scale",))["scale"] < 0.3
    assert dist.summary_scores(_summary(3.0 * sunk), ref, ("scale",))["scale"] > 0.8   # ln 3 = 1.1


def test_a_replay_keeps_the_raw_tensors_sketch() -> None:
    x = torch.randn(BATCH, SEQ, D)
    x[0, 0] *= 100.0
    at = summ.sketch_positions(x.numel(), 256, 0)
    s = summ.summarize(x, directions=summ.random_directions(D, 8, 0), levels=summ.quantile_levels(16), sketch_at=at)
    rows = x.reshape(-1, D)
    assert torch.equal(s.sketch, torch.take(rows, at) - torch.take(rows.mean(dim=0), at % D))


def _run(attack: float | None, *, steps: int = 24, start: int = 14) -> list[tuple[int, int]]:
    """Boundary-0 gradients with a sink row at 30-2000x the median row's energy in a third of the microbatches;
    from ``start`` the sender scales every row by ``attack`` (None: honest). Returns the flagged (step, mb)."""
    gen = torch.Generator().manual_seed(1)
    basis = torch.randn(4, D, generator=gen)
    v = Verifier({"warmup": 5}, [(0, "grad")])
    flagged = []
    for step in range(steps):
        for mb in range(MBS):
            sink = float(torch.empty(()).uniform_(3.4, 7.6, generator=gen).exp()) if (step + mb) % 3 == 0 else 1.0
            x = _gradient(gen, basis, sink)
            if attack is not None and step >= start:
                x = attack * x
            if v.check(0, "grad", x, step=step, mb=mb, sender=1).flagged:
                flagged.append((step, mb))
        events = v.flag_events(step)
        flagged += [(e["step"], e["mb"]) for e in events]
        v.end_step(step, [events])
    return flagged


def test_honest_sink_rows_are_never_flagged_and_a_scaled_sender_still_is() -> None:
    assert _run(None) == []
    flagged = _run(3.0)
    assert {s for s, _ in flagged} >= set(range(14, 18)), flagged
