"""Boundary codecs in the one cost: priced as the compiled programs run them, and chosen per boundary by auto."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_models.codecs import wire_bytes
from cost_models.training import TrainingConfig
from planner.instruction_costs import CostModel
from planner.simulate import simulate
from planner.solver.codec_choice import choose_codecs
from planner.solver.objective import price_program
from planner.solver.problem_build import build_problem, scale_chain
from tests.unit.program_fixtures import POLICY, _compiled, random_placement, wide_area_cluster
from tests.unit.solver_fixtures import random_chain


def _case(seed: int, compress: str):
    rng = np.random.default_rng(seed)
    cluster = wide_area_cluster(rng, int(rng.integers(4, 14)))
    chain = random_chain(rng, int(rng.integers(6, 20)), param_scale=float(rng.choice([2e7, 1e8])), act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    config = TrainingConfig(global_batch=int(rng.choice([8, 16, 32])), microbatch_size=1, dtype="float16",
                            mixed_precision=True, compress=compress)
    problem = build_problem(scale_chain(chain, 1), cluster, config, POLICY)
    return problem, random_placement(rng, problem, cluster), chain, cluster, config


@pytest.mark.parametrize("compress", ["int8", "fp8", "int4", "auto"])
def test_compressed_boundaries_are_priced_as_they_run(compress):
    off = []
    for seed in range(40):
        problem, placement, chain, cluster, config = _case(seed, compress)
        if placement is None:
            continue
        placement = choose_codecs(problem, placement)
        priced, plan = _compiled(problem, placement, chain, cluster, config, POLICY)
        assert [st.out_codec for st in plan.stages] == [st.out_codec for st in placement.stages]
        off.append(abs(priced.step_ms - simulate(plan).step_ms) / simulate(plan).step_ms)
    assert len(off) >= 25
    assert np.mean(np.array(off) <= 0.05) >= 0.85, sorted(off)[-6:]


def test_the_wire_carries_the_encoded_bytes():
    problem, placement, chain, cluster, config = next(c for c in (_case(s, "int8") for s in range(20))
                                                      if c[1] is not None)
    placement = choose_codecs(problem, placement)
    _, plan = _compiled(problem, placement, chain, cluster, config, POLICY)
    costs = CostModel.for_plan(plan)
    for b, raw in enumerate(costs.boundary_bytes):
        assert costs.wire_bytes[b] == pytest.approx(wire_bytes("int8", raw, 2))
        assert costs.wire_bytes[b] < 0.52 * raw                      # fp16 values as one byte and a scale a block


def test_auto_compresses_where_it_pays_and_leaves_fast_boundaries_alone():
    chosen = {"slow": set(), "mid": set(), "fast": set()}
    for seed in range(30):
        problem, placement, *_ = _case(seed, "auto")
        if placement is None:
            continue
        placement = choose_codecs(problem, placement)
        none = dataclasses.replace(placement, stages=tuple(dataclasses.replace(st, out_codec="none")
                                                           for st in placement.stages))
        assert price_program(problem, placement).step_ms <= price_program(problem, none).step_ms * 1.005
        for a, b in zip(placement.stages, placement.stages[1:]):
            gbps = min(problem.link(x, y).bandwidth_gbps for x in a.devices for y in b.devices)
            chosen["slow" if gbps < 5 else "fast" if gbps >= 100 else "mid"].add(a.out_codec)
    assert "none" in chosen["fast"] and "int8" not in chosen["fast"]   # fp8 only where it still prices lower
    assert chosen["slow"] - {"none"}
