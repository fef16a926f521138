"""Grids wider in the middle than at the ends (``search.grid.tapered``): on a SWARM-like pool (2 trusted A100s, slow
untrusted volunteers) trusted end stages leave a uniform grid one replica per stage, so only a tapered grid puts
the volunteers to work; under ``--compress auto`` (boundaries 8-bit, PowerSGD all-reduces) it is the cheapest
candidate the search starts from."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.solver.objective import price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.baselines import single_stage_placements
from planner.solver.search.grid import grid_candidates, grids, tapered
from tests.unit.solver_fixtures import random_chain


def _pool(volunteers: int = 8, trusted_volunteers: bool = False, t4_only: bool = False) -> dict:
    hosts = [{"name": "dc", "region": "dc", "trust": "operator", "trusted": True,
              "devices": [{"type": "T4" if t4_only else "A100-80GB", "count": 2}]}]
    hosts += [{"name": f"t{i}", "region": f"home{i % 2}", "trust": f"t{i}", "trusted": trusted_volunteers,
               "devices": [{"type": "T4"}]} for i in range(volunteers)]
    return {"name": "swarm-mini", "hosts": hosts,
            "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                      "default": {"bandwidth_gbps": 0.2, "latency_ms": 20}}}


def _problem(compress: str, policy: VerificationPolicy = VerificationPolicy(), trusted_volunteers: bool = False,
             t4_only: bool = False):
    # GPT-1.3b-like layers at sequence 2048: 50M parameters, 0.3 TFLOP forward, an 8 MB boundary per sample.
    chain = random_chain(np.random.default_rng(0), 16, param_scale=5e7, flop_scale=3e11, act_scale=4e8,
                         out_scale=8.4e6, uniform=True)
    config = TrainingConfig(global_batch=64, microbatch_size=1, dtype="float16", mixed_precision=True,
                            compress=compress)
    cluster = parse_cluster(_pool(trusted_volunteers=trusted_volunteers, t4_only=t4_only))
    return build_problem(scale_chain(chain, 1), cluster, config, policy)


def _trusted(problem, device: str) -> bool:
    return problem.classes[problem.class_of(device)].trusted


@pytest.fixture(scope="module")
def auto():
    return _problem("auto")


def test_tapered_grids_keep_trusted_ends_and_replicate_the_volunteers_between(auto):
    found = tapered(auto)
    assert found
    for placement in found:
        assert not violations(auto, placement)
        ends = placement.stages[0].devices + placement.stages[-1].devices
        assert all(_trusted(auto, d) for d in ends)
        middle = placement.stages[1:-1]
        assert middle and all(len(st.devices) > len(placement.stages[0].devices) for st in middle)
        assert all(not _trusted(auto, d) for st in middle for d in st.devices)
        assert all(sum(st.microbatches) == auto.num_microbatches for st in placement.stages)
    # The uniform grids here cannot replicate a stage: two trusted devices, one per end.
    assert all(len(st.devices) == 1 for p in grids(auto) if p.num_stages > 2 for st in p.stages)


def test_under_auto_a_tapered_grid_beats_the_uniform_grids_and_the_trusted_devices_alone(auto):
    cands = grid_candidates(auto)
    best = min(cands, key=lambda p: price_program(auto, p).step_ms)
    best_ms = price_program(auto, best).step_ms
    uniform_ms = min(price_program(auto, p).step_ms for p in grids(auto))
    alone_ms = min(price_program(auto, p).step_ms for p in single_stage_placements(auto) if not violations(auto, p))
    assert any(not _trusted(auto, d) for st in best.stages for d in st.devices)
    assert best_ms * 1.25 < min(uniform_ms, alone_ms)


def test_without_trusted_endpoints_the_fastest_type_takes_the_ends():
    for policy in (VerificationPolicy(enabled=False), VerificationPolicy(trusted_endpoints=False)):
        problem = _problem("auto", policy)
        found = tapered(problem)
        assert found and all(not violations(problem, p) for p in found)
        ends = {d for p in found for d in p.stages[0].devices + p.stages[-1].devices}
        assert {problem.classes[problem.class_of(d)].name.split("@")[0] for d in ends} == {"A100-80GB"}


def test_no_tapered_grids_where_every_device_may_hold_an_end():
    assert tapered(_problem("auto", trusted_volunteers=True)) == []  # trusted volunteers: uniform grids serve
    assert tapered(_problem("auto", VerificationPolicy(enabled=False), t4_only=True)) == []  # one device type
