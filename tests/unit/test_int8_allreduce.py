"""Blockwise int8 with error feedback for a replicated stage's gradient all-reduce: the codec
(``runtime.wire.grad_codecs.Int8ReduceState``) with replicas simulated in one process, its price
(``cost_models.codecs.int8_allreduce_*``), and the plan file's ``allreduce_codec: int8``."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from plan_fixtures import golden_plan

from cost_models.cluster import Link
from cost_models.codecs import (
    BLOCK,
    REL_ERROR,
    int8_allreduce_bytes,
    int8_allreduce_ms,
    int8_payload_bytes,
)
from cost_models.comm import allreduce_ms
from planner.errors import InvalidInputError, ProtocolError
from planner.plan import Plan
from planner.plan_load import load_plan
from planner.runtime.wire.grad_codecs import Int8ReduceState

N = 1001   # odd, not a whole number of blocks: the last block is padded, the codes end unaligned


def _reduce(states: list[Int8ReduceState], flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every replica's sum: each encodes, all see every message (the all-gather), each combines."""
    messages = [s.encode(f) for s, f in zip(states, flats)]
    outs = [torch.empty_like(f) for f in flats]
    for s, out in zip(states, outs):
        s.combine(messages, out, ranks=range(len(states)))
    return outs


def _bound(flat: torch.Tensor) -> torch.Tensor:
    """Half a quantisation step of each value's block: the codec's elementwise error bound."""
    pad = (-flat.numel()) % BLOCK["int8"]
    blocks = torch.nn.functional.pad(flat.abs(), (0, pad)).reshape(-1, BLOCK["int8"])
    return (blocks.amax(dim=1, keepdim=True) * REL_ERROR["int8"]).expand_as(blocks).reshape(-1)[:flat.numel()]


@pytest.mark.parametrize("replicas", [2, 3])
def test_every_replica_applies_the_same_sum_within_the_bound_and_the_tail_exactly(replicas):
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(N, generator=gen) * (1 + 10 * (torch.arange(N) % 300 == 0)) for _ in range(replicas)]
    flats = [torch.cat([g, torch.tensor([2.0 + r])]) for r, g in enumerate(grads)]   # a trained count rides last
    states = [Int8ReduceState(N) for _ in range(replicas)]
    outs = _reduce(states, flats)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])   # bit for bit
    assert float(outs[0][-1]) == sum(2.0 + r for r in range(replicas))
    err = (outs[0][:N] - sum(grads)).abs()
    assert torch.all(err <= sum(_bound(g) for g in grads) * (1 + 1e-5) + 1e-7)
    assert err.max() > 0   # it was in fact quantised
    for s, g in zip(states, grads):   # the residual kept is exactly what was left out
        assert torch.all(s.error.abs() <= _bound(g) * (1 + 1e-5) + 1e-7)


def _run(steps: int, *, feedback: bool, replicas: int = 2) -> list[float]:
    """Relative error of the applied sum accumulated over ``steps`` against the true one, step by step: a
    steady gradient whose small values sit below half a quantisation step of their block's absmax."""
    gen = torch.Generator().manual_seed(1)
    steady = [torch.where(torch.arange(N) % BLOCK["int8"] == 0, 100.0, 0.3) * torch.rand(N, generator=gen)
              for _ in range(replicas)]
    states = [Int8ReduceState(N) for _ in range(replicas)]
    applied, true, gaps = torch.zeros(N), torch.zeros(N), []
    for _ in range(steps):
        if not feedback:
            for s in states:
                s.error = None
        grads = [g + 0.05 * torch.randn(N, generator=gen) for g in steady]
        true += sum(grads)
        applied += _reduce(states, [g.clone() for g in grads])[0]
        gaps.append(float((applied - true).norm() / true.norm()))
    return gaps


def test_error_feedback_keeps_the_accumulated_error_bounded_and_without_it_it_stays():
    with_ef, without = _run(20, feedback=True), _run(20, feedback=False)
    # the true sum grows with the steps; with feedback the left-out part does not, so the relative gap falls
    assert with_ef[-1] < 0.2 * with_ef[0]
    assert without[-1] > 0.5 * without[0]   # without: the same values drop every step
    assert with_ef[-1] < 0.1 * without[-1]


def test_what_is_applied_plus_what_is_held_is_the_exact_sum():
    gen = torch.Generator().manual_seed(2)
    states = [Int8ReduceState(N) for _ in range(2)]
    applied, true = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    for _ in range(10):
        grads = [torch.randn(N, generator=gen) for _ in states]
        true += sum(g.double() for g in grads)
        applied += _reduce(states, [g.clone() for g in grads])[0].double()
        held = sum(s.error.double() for s in states)
        torch.testing.assert_close(applied + held, true, rtol=0, atol=1e-4)


@pytest.mark.parametrize("replicas", [2, 3])
def test_bytes_on_the_wire_are_the_priced_bytes(replicas):
    params = 5000
    states = [Int8ReduceState(params) for _ in range(replicas)]
    messages = [s.encode(torch.randn(params)) for s in states]
    received = sum(m.numel() * m.element_size() for m in messages[1:])   # what replica 0 receives
    assert received == int8_allreduce_bytes(params, replicas) == (replicas - 1) * int8_payload_bytes(params)
    assert int8_payload_bytes(params) == params + 4 * -(-params // BLOCK["int8"])
    assert states[0].payload_bytes(tail=1) == int8_payload_bytes(params) + 4   # a verified run's count: 4 B


def test_a_message_of_the_wrong_size_or_type_is_refused_naming_its_sender():
    states = [Int8ReduceState(N) for _ in range(2)]
    flat = torch.randn(N)
    good = states[0].encode(flat)
    out = torch.empty(N)
    with pytest.raises(ProtocolError, match="rank 7's int8 gradient message") as info:
        states[0].combine([good, good[:-4]], out, ranks=[3, 7])
    assert info.value.peer == 7
    with pytest.raises(ProtocolError, match="rank 3"):
        states[0].combine([good.view(torch.int8), good], out, ranks=[3, 7])


def test_a_non_finite_gradient_decodes_to_nan_never_to_finite_garbage():
    flat = torch.randn(N)
    flat[5] = float("inf")
    states = [Int8ReduceState(N) for _ in range(2)]
    out = _reduce(states, [flat.clone(), torch.randn(N)])[0]
    assert torch.isnan(out[:BLOCK["int8"]]).all() and torch.isfinite(out[BLOCK["int8"]:]).all()


def test_the_price_undercuts_the_exact_ring_below_8_replicas_on_a_slow_link():
    slow = Link(bandwidth_gbps=0.5, latency_ms=20.0)
    params, bw = 5e7, 500e9
    for r in (2, 3, 7):   # bytes: (r-1) (1 + 4/128) a parameter against the ring's 8 (r-1)/r, about r/8 of it
        ring = (slow,) * r
        assert int8_allreduce_ms(params, ring, r, bw) < min(0.99, 1.1 * r / 8) * allreduce_ms(4 * params, ring, r)
    # from 8 replicas the all-gather receives more than the fp32 ring's 2 (r-1)/r * 4 bytes a parameter
    assert int8_allreduce_bytes(params, 8) > 2 * 7 / 8 * 4 * params
    assert int8_allreduce_ms(params, (slow,), 1, bw) == 0.0
    with pytest.raises(InvalidInputError):
        int8_allreduce_ms(params, (), 2, bw)


def _int8_plan() -> Plan:
    plan = golden_plan()
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, allreduce_codec="int8")
                                                  for st in plan.stages))


def test_a_plan_with_int8_all_reduces_round_trips(tmp_path):
    plan = _int8_plan()
    path = plan.save(tmp_path / "plan.json")
    assert {st["allreduce_codec"] for st in json.loads(path.read_text())["stages"]} == {"int8"}
    assert load_plan(path) == plan


def test_an_unknown_all_reduce_codec_in_a_plan_file_is_refused(tmp_path):
    data = golden_plan().to_dict()
    data["stages"][0]["allreduce_codec"] = "zstd"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInputError, match="allreduce_codec"):
        load_plan(path)
