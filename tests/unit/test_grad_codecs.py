"""PowerSGD for a replicated stage's gradient all-reduce: the algorithm (``runtime.wire.grad_codecs``) with
replicas simulated in one process, and its price (``cost_models.codecs``) against real GPT shapes."""
from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch

from cost_models.cluster import Link
from cost_models.codecs import powersgd_allreduce_ms, powersgd_bytes
from cost_models.comm import allreduce_ms
from models.registry import build_model
from planner.coarsen import coarsen
from planner.instruction_costs import CostModel
from planner.runtime.wire.grad_codecs import PowerSGDState
from planner.solver import objective
from planner.solver.codec_choice import AUTO_SLACK, choose_codecs
from planner.trace import trace
from tests.unit.program_fixtures import POLICY, _compiled
from tests.unit.test_codec_planning import _case


def _sum_over_replicas(states: list[PowerSGDState], flats: list[torch.Tensor]) -> None:
    """Run every replica's ``reduce`` in lock step, the all-reduce summing the replicas' buffers of a round."""

    barrier = threading.Barrier(len(states))
    rounds: dict[int, list[torch.Tensor]] = {}
    lock = threading.Lock()
    counters = [0] * len(states)

    def make(i: int):
        def all_reduce(t: torch.Tensor) -> None:
            k = counters[i]
            counters[i] += 1
            with lock:
                rounds.setdefault(k, [None] * len(states))[i] = t.clone()
            barrier.wait()
            t.copy_(sum(rounds[k]))
            barrier.wait()
        return all_reduce

    threads = [threading.Thread(target=s.reduce, args=(f, make(i))) for i, (s, f) in enumerate(zip(states, flats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


SHAPES = [torch.Size((96, 80)), torch.Size((80,)), torch.Size((64, 8, 8))]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_a_low_rank_sum_comes_through_almost_exactly():
    gen = torch.Generator().manual_seed(0)
    grads = []
    for r in range(2):   # two replicas whose matrices have rank 2 each: their sum has rank <= 4
        u = torch.randn(96, 2, generator=gen)
        v = torch.randn(64, 2, generator=gen)
        grads.append([u @ torch.randn(2, 80, generator=gen), torch.randn(80, generator=gen),
                      (v @ torch.randn(2, 64, generator=gen)).reshape(64, 8, 8),
                      torch.tensor([2.0 + r])])   # a verified run's trained count rides last, summed exactly
    states = [PowerSGDState(SHAPES) for _ in grads]
    flats = [_flat(g) for g in grads]
    want = flats[0] + flats[1]
    for _ in range(2):   # the power iteration warm-starts: a second round refines Q
        flats = [_flat(g) for g in grads]
        _sum_over_replicas(states, flats)
    assert torch.equal(flats[0], flats[1])                      # every replica applies the same sum
    assert float(flats[0][-1]) == 5.0
    torch.testing.assert_close(flats[0], want, rtol=1e-4, atol=1e-4)


def test_error_feedback_makes_the_applied_sum_track_the_true_sum():
    gen = torch.Generator().manual_seed(1)
    shapes = [torch.Size((128, 32)), torch.Size((80,))]   # 32 directions, covered 4 a step at most
    states = [PowerSGDState(shapes) for _ in range(2)]
    applied = torch.zeros(sum(s.numel() for s in shapes))
    true = torch.zeros_like(applied)
    gaps = []
    drift = [torch.randn(applied.numel(), generator=gen) for _ in states]   # a steady signal under the noise
    for _ in range(60):
        flats = [d + 0.5 * torch.randn(applied.numel(), generator=gen) for d in drift]
        true += flats[0] + flats[1]
        _sum_over_replicas(states, flats)
        applied += flats[0]
        held = torch.cat([e.reshape(-1) if e is not None else torch.zeros(n)
                          for e, n in zip(states[0].errors, states[0].numels)])
        held += torch.cat([e.reshape(-1) if e is not None else torch.zeros(n)
                           for e, n in zip(states[1].errors, states[1].numels)])
        torch.testing.assert_close(applied + held, true, rtol=1e-3, atol=1e-3)   # nothing is ever lost
        gaps.append(float((applied - true).norm() / true.norm()))
    assert gaps[-1] < 0.2 * gaps[0]   # the left-out part stays bounded while the sum grows


def test_one_dimensional_and_small_tensors_go_whole():
    state = PowerSGDState([torch.Size((4096,)), torch.Size((8, 8)), torch.Size((512, 512))])
    assert state.matrices[:2] == (None, None)
    assert state.wire_values() == 4096 + 64 + 4 * (512 + 512)


@pytest.mark.parametrize("spec,seq", [("gpt-tiny", None), ("gpt-1.3b", 128)])
def test_priced_bytes_near_the_true_powersgd_bytes_of_every_stage(spec, seq):
    bundle = build_model(spec, batch=1, seq=seq, device="meta")
    chain = coarsen(trace(bundle.module, bundle.example_inputs, name=spec))
    shapes = dict(bundle.module.named_parameters())
    true = [4.0 * PowerSGDState([shapes[n].shape for n in b.param_names]).wire_values() for b in chain.blocks]
    est = [powersgd_bytes(b.param_count, len(b.param_names)) for b in chain.blocks]
    ratios = {(i, j): sum(est[i:j + 1]) / sum(true[i:j + 1])
              for i in range(len(true)) for j in range(i, len(true))}
    # The embedding block alone is the low end (about 0.5: a vocabulary matrix is far from square);
    # every stage of two blocks or more is within 2x, the whole model within 25%.
    assert all(0.45 <= r <= 2.0 for r in ratios.values()), min(ratios.values())
    assert all(0.5 <= r <= 2.0 for (i, j), r in ratios.items() if j > i)
    assert 0.8 <= ratios[0, len(true) - 1] <= 1.25


def test_priced_bytes_and_time_grow_with_the_tensor_and_stay_under_uncompressed():
    slow = (Link(bandwidth_gbps=0.2, latency_ms=50.0),) * 2
    prev_bytes = prev_ms = 0.0
    for params in (1e6, 1e7, 1e8, 1e9):   # big tensors: below, the second round's latency can dominate
        nbytes = powersgd_bytes(params, 12)
        ms = powersgd_allreduce_ms(params, 12, slow, 2, 10e12, 500e9)
        assert nbytes > prev_bytes and ms > prev_ms
        assert nbytes < 0.1 * 4 * params and ms < allreduce_ms(4 * params, slow, 2)
        prev_bytes, prev_ms = nbytes, ms
    assert powersgd_bytes(1000, 4) == 4000          # small tensors go whole
    assert math.isclose(powersgd_allreduce_ms(1e6, 1, slow, 1, 1e12, 1e11), 0.0)


def test_auto_and_int8_compress_all_reduces_where_it_pays_and_other_fixed_codecs_never_do():
    chosen = {"auto": 0, "int8": 0}
    for seed in range(12):
        for compress in ("auto", "int8", "fp8"):
            problem, placement, chain, cluster, config = _case(seed, compress)
            if placement is None:
                continue
            placement = choose_codecs(problem, placement)
            codecs = [st.allreduce_codec for st in placement.stages]
            allowed = {"auto": {"none", "int8", "powersgd"}, "int8": {"none", "int8"}, "fp8": {"none"}}[compress]
            assert set(codecs) <= allowed
            assert all(len(st.devices) > 1 for st in placement.stages if st.allreduce_codec != "none")
            if set(codecs) == {"none"}:
                continue
            chosen[compress] += 1
            plain = dataclasses.replace(placement, stages=tuple(dataclasses.replace(st, allreduce_codec="none")
                                                                for st in placement.stages))
            if compress == "auto":
                priced = objective.price_program(problem, placement).step_ms
                assert priced < (1 - AUTO_SLACK) * objective.price_program(problem, plain).step_ms
            for st, exact in zip(placement.stages, plain.stages):   # int8 only where no dearer than exact
                assert compress != "int8" or objective.allreduce_ms(problem, st) <= objective.allreduce_ms(problem, exact)
            _, plan = _compiled(problem, placement, chain, cluster, config, POLICY)
            assert [st.allreduce_codec for st in plan.stages] == codecs
            costs = CostModel.for_plan(plan)   # the simulator prices each all-reduce as the objective does
            for k, st in enumerate(placement.stages):
                assert costs.allreduce_ms(k) == pytest.approx(objective.allreduce_ms(problem, st), rel=1e-9)
    assert chosen["auto"] >= 4 and chosen["int8"] >= 1, chosen
